"""Tensor-parallel coverage: how much of each test-matrix model stays sharded.

For every model autoshard is tested on (the examples, the Hugging Face
families, the public-code patterns of ``tests/pattern_models.py``), plans the
model for a ("dp", "tp") = (2, 2) mesh (sizes only: no process group, no
tensor touched) and prints one row: tp collectives per block per training
step as planned, the analytic minimum for that block, and the blocks whose tp
sharding stops before their rowwise linear (``plan.breaks``). Run from the
repository root: ``python benchmarks/coverage.py`` (``make bench`` runs it).
"""

from __future__ import annotations

import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import autoshard  # noqa: E402
from tests.cases import MODELS  # noqa: E402
from tests.pattern_models import MINIMUM as PATTERN_MINIMUM  # noqa: E402
from tests.pattern_models import PATTERNS  # noqa: E402

# Analytic minimum of tp collectives per block per training step (forward + backward):
# 2 + 2 for a sequential attention + MLP block, 1 + 1 for a parallel block, plus 2 per
# norm over a tp-sharded width (its statistics, forward and backward) and 2 for Qwen3's
# replicated q/k-norm weights on sharded heads (their gradients). An MoE block costs what a
# dense one does. The public-code patterns' minimums, with their reasons, are
# tests/pattern_models.py's MINIMUM.
MINIMUM = {
    "llama": 4, "mlp_stack": 2, "raw_linear": None,
    "hf_llama": 4, "hf_llama_tied": 4, "hf_mistral": 4, "hf_qwen2": 4, "hf_qwen3": 6, "hf_qwen3_moe": 6, "hf_phi3": 4,
    "hf_gpt2": 4, "hf_bert": 4,
} | {name: sorted(set(m.values())) if isinstance(m, dict) else m for name, m in PATTERN_MINIMUM.items()}


def _cases():
    for name, (build, inputs) in MODELS.items():
        yield name, build, inputs, {}
    try:
        from tests.hf_cases import CASES
    except ImportError:  # transformers not installed
        CASES = {}
    for name, case in CASES.items():
        ids, kwargs = case.inputs(batch=2)
        yield f"hf_{name}", case.build, (ids,), kwargs
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    for name, build in PATTERNS.items():
        yield name, build, (tokens,), {}


def main() -> None:
    header = f"{'model':<24}{'tp coll./block':>16}{'minimum':>9}{'blocks broken':>15}  {'plan s':>7}  first break"
    print(header)
    print("-" * len(header))
    for name, build, inputs, kwargs in _cases():
        torch.manual_seed(0)
        start = time.perf_counter()
        plan = autoshard.plan(build(), {"dp": 2, "tp": 2}, example_inputs=inputs, example_kwargs=kwargs)
        seconds = time.perf_counter() - start
        blocks = [u for u in plan.units if u.startswith("layers.")] if name in PATTERN_MINIMUM else [
            u for u in plan.units if u]
        per_block = sorted({plan.num_tp_collectives(b) for b in blocks})
        broken = {u for u, _ in plan.breaks}
        minimum = MINIMUM.get(name)
        first = plan.breaks[0][1][:70] if plan.breaks else "-"
        print(
            f"{name:<24}{'/'.join(map(str, per_block)):>16}{_shown(minimum):>9}"
            f"{f'{len(broken)} of {len(blocks)}':>15}  {seconds:7.2f}  {first}"
        )


def _shown(minimum) -> str:
    if minimum is None:
        return "-"
    return "/".join(map(str, minimum)) if isinstance(minimum, list) else str(minimum)


if __name__ == "__main__":
    main()
