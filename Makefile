# Every target creates .venv on first use: torch is pinned to the 2.13.0 CPU build
# (any other spelling would fetch a multi-GB CUDA build), then the package is
# installed editable with its test extras.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install test lint demo bench bench-titan bench-quant bench-meshes bench-check bench-depth bench-pp pp-parity bench-cp cp-parity zoo golden clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,examples]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check autoshard passes tests examples benchmarks

demo: $(STAMP)
	$(PY) examples/train_llama.py

bench: $(STAMP)
	$(PY) benchmarks/bench_2d.py
	$(PY) benchmarks/coverage.py

# torchtitan 0.3.0's own Llama-3 under its own parallelize_llama next to autoshard (2x2 and tp=4, fp32 and bf16).
# torchtitan comes without its dependencies (the `bench` extra's pins; see benchmarks/bench_titan.py).
TITAN_STAMP := $(VENV)/.titan-stamp

$(TITAN_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps torchtitan==0.3.0 spmd_types==0.3.1
	touch $(TITAN_STAMP)

bench-titan: $(TITAN_STAMP)
	$(PY) benchmarks/bench_titan.py

# The block-quantized all-gather: wire bytes and step time, loss curves, 128x128 alignment on Llama-3 shapes.
bench-quant: $(STAMP)
	$(PY) benchmarks/bench_quant.py

# suggest_mesh's ranking of the 4-rank meshes next to their measured step times.
bench-meshes: $(STAMP)
	$(PY) benchmarks/bench_meshes.py

# autoshard.testing.check on a 4-block Llama at dp=2 x tp=4, pinned to one core (goal: 10 s).
bench-check: $(STAMP)
	$(PY) benchmarks/bench_check.py

# autoshard.plan on a meta-device Hugging Face Llama (Llama-3 8B shapes) of 2, 32 and 80 blocks at dp=2 x tp=4:
# seconds and the ratios to 2 blocks (goal: 32 blocks at most 1.5x, 80 blocks at most 2x).
bench-depth: $(STAMP)
	$(PY) benchmarks/bench_depth.py

# Pipeline stages on pp=4 (4 ranks): the balanced split against torchtitan's equal split (goal: <= 0.85x step
# time), each stage's measured time next to its predicted time, and the 2-D plan of the same ranks.
bench-pp: $(STAMP)
	$(PY) benchmarks/bench_pp.py

# Pipeline parity matrix on 8 ranks: 3 models x pp2 x dp2 x tp2 and pp4 x tp2 x GPipe, 1F1B, Interleaved1F1B x 4 and 8
# microbatches, each against one device (3 AdamW steps' losses, parameters after 3 SGD steps; goal <= 1e-5).
pp-parity: $(STAMP)
	$(PY) benchmarks/pp_parity.py

# Context parallelism at sequence 4096: cp=4 against the same 4 ranks as dp=4 and as tp=4 (step time, bytes
# per step, activations held for backward), and the attention work of each rank (load balance).
bench-cp: $(STAMP)
	$(PY) benchmarks/bench_cp.py

# Every cp mesh (cp4, dp2 x cp2, cp2 x tp2) and model (example Llama, HF Llama / Qwen2 / Mistral) against one device.
cp-parity: $(STAMP)
	$(PY) benchmarks/cp_parity.py

# Every transformers family autoshard captures, planned and proven in one process on five meshes
# (2x2, tp=4, tp=8, 2x4, HSDP 2x2x2), plus bf16 and sequence parallelism on 2x2 and 2x4.
zoo: $(STAMP)
	$(PY) benchmarks/zoo.py --options

# Rewrite the snapshots (tests/__snapshots__: plan tables, emitted graphs, autoshard.testing reports)
# after an intended change; syrupy also removes the snapshots no test uses any more.
SNAPSHOT_TESTS := tests/test_plan.py tests/test_graphs.py tests/test_hf_plans.py tests/test_snapshots.py
golden: $(STAMP)
	$(PY) -m pytest -q $(SNAPSHOT_TESTS) --snapshot-update

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache benchmarks/results
