# Every target creates .venv on first use: torch is pinned to the 2.13.0 CPU build
# (any other spelling would fetch a multi-GB CUDA build), then the package is
# installed editable with its test extras.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# torchtitan without its dependencies: bench-titan, the corpus and the second tier's mixture of experts
TITAN_STAMP := $(VENV)/.titan-stamp

.PHONY: install test test-long lint demo spellings axis-matrix bench bench-titan bench-quant bench-meshes bench-check bench-depth bench-pp pp-parity bench-cp cp-parity bench-ep zoo corpus golden clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,examples]'
	touch $(STAMP)

# The suite in two tiers: `make test` (every one-process proof and one gloo group per multi-process file),
# `make test-long` (the tests marked `long`: the bf16 matrix of every pattern, the GPU check script run on the
# CPU, a wheel installed and run, a rank killed mid-save). CI runs both.
test: $(STAMP)
	$(PY) -m pytest -q -m "not long"

test-long: $(STAMP) $(TITAN_STAMP)
	$(PY) -m pytest -q -m long

lint: $(STAMP)
	$(PY) -m ruff check autoshard passes tests examples benchmarks

demo: $(STAMP)
	$(PY) examples/train_llama.py

bench: $(STAMP)
	$(PY) benchmarks/bench_2d.py
	$(PY) benchmarks/coverage.py

# torchtitan 0.3.0's own Llama-3 under its own parallelize_llama next to autoshard (2x2 and tp=4, fp32 and bf16).
# torchtitan comes without its dependencies (the `bench` extra's pins; see benchmarks/bench_titan.py).
$(TITAN_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps torchtitan==0.3.0 spmd_types==0.3.1
	touch $(TITAN_STAMP)

bench-titan: $(TITAN_STAMP)
	$(PY) benchmarks/bench_titan.py

# The block-quantized all-gather: wire bytes and step time, loss curves, 128x128 alignment on Llama-3 shapes.
bench-quant: $(STAMP)
	$(PY) benchmarks/bench_quant.py

# One function, many spellings (tests/spellings.py): every block family's spellings planned and proven on 2x2,
# tp=4 and tp=8 in fp32 and bf16, each against its reference spelling's tp collectives
# (benchmarks/results/spellings.json; the spellings that cost more are printed with the op and line).
spellings: $(STAMP)
	$(PY) benchmarks/spellings.py

# Every mesh the axis order allows on 8 ranks, proven in one process: 3 models, fp32 and bf16,
# sequence and loss parallelism wherever tp is present (benchmarks/results/axis_matrix.json).
axis-matrix: $(STAMP)
	$(PY) benchmarks/axis_matrix.py

# Expert parallelism on 4 ranks: Qwen3-MoE shapes (64 experts, top 8, expert hidden 64), ep=4 against tp=4 experts
# on the same ranks: step time, bytes per step measured and predicted (equal under balanced routing), the experts'
# GEMM shapes, memory per rank and the rows each expert received (benchmarks/results/bench_ep.json).
bench-ep: $(STAMP)
	$(PY) benchmarks/bench_ep.py

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
# (2x2, tp=4, tp=8, 2x4, HSDP 2x2x2), plus bf16 and sequence parallelism on 2x2 and 2x4; then the corpus.
zoo: $(STAMP) corpus
	$(PY) benchmarks/zoo.py --options

# The corpus (tests/corpus.py): model code of ten libraries other than transformers, each pinned and installed
# without its dependencies (they would replace the CPU torch, or pull CUDA wheels and data stacks), next to the
# few pure-Python packages they import (pinned too); what is stubbed instead, and why, is in tests/corpus.py.
# The last line checks that torch is still the 2.13.0 CPU build.
CORPUS_STAMP := $(VENV)/.corpus-stamp
CORPUS_LIBRARIES := timm==1.0.31 x-transformers==2.31.10 torchtune==0.6.1 peft==0.21.2 litgpt==0.5.13 \
	open-clip-torch==3.3.0 diffusers==0.42.1 fair-esm==2.0.0 vit-pytorch==1.26.11
# x-transformers: einops, einx, frozendict, loguru, torch-einops-utils; torchtune: torchao (0.16: the oldest
# peft accepts, and it still has torchtune's nf4tensor), omegaconf, antlr4, sentencepiece, tiktoken; peft:
# accelerate, psutil; litgpt: lightning-utilities; open_clip: ftfy, wcwidth; diffusers: requests (and its
# dependencies); timm and diffusers: pillow
CORPUS_IMPORTS := einops==0.8.2 einx==0.4.3 frozendict==2.5.1 loguru==0.7.3 torch-einops-utils==0.2.0 \
	torchao==0.16.0 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 sentencepiece==0.2.3 tiktoken==0.14.0 \
	accelerate==1.15.0 psutil==7.2.2 lightning-utilities==0.15.3 ftfy==6.3.1 wcwidth==0.9.4 \
	requests==2.34.2 charset-normalizer==3.5.2 urllib3==2.8.0 certifi==2026.10.19.post1 pillow==13.0.0

$(CORPUS_STAMP): $(TITAN_STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(CORPUS_LIBRARIES) $(CORPUS_IMPORTS)
	$(PY) -c "import torch; assert torch.__version__ == '2.13.0+cpu' and torch.version.cuda is None, torch.__version__"
	touch $(CORPUS_STAMP)

# Each corpus case planned and proven in one process (2x2 and tp=4 in fp32, 2x2 in bf16, cp=2 for decoders), then
# trained on 4 gloo ranks against one device with a strict state-dict round trip (benchmarks/corpus_parity.py);
# the model fingerprinted before and after each run; results in benchmarks/results/corpus.json.
corpus: $(CORPUS_STAMP)
	$(PY) benchmarks/corpus.py

# Rewrite the snapshots (tests/__snapshots__: plan tables, emitted graphs, autoshard.testing reports)
# after an intended change; syrupy also removes the snapshots no test uses any more.
SNAPSHOT_TESTS := tests/test_plan.py tests/test_graphs.py tests/test_hf_plans.py tests/test_snapshots.py
golden: $(STAMP)
	$(PY) -m pytest -q $(SNAPSHOT_TESTS) --snapshot-update

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache benchmarks/results
