"""Fewer kv heads than tp: every block gets the same plan and at most 5 tp collectives.

With 2 kv heads on tp=4, k and v cannot be cut on heads, but each rank's q heads read only
their own kv heads: attention's k and v are repeated per q head and cut like q (see
``passes.decompose.expand_gqa_for_tp``), k/v projections are computed whole, and the two
cuts' gradients travel in one all-gather. A block then costs 2 forward all-reduces, 2
backward (one per colwise group) and that all-gather: the divisible case plus one.
"""

from __future__ import annotations

import pytest
import torch

import autoshard
from examples.models import Llama, LlamaConfig
from tests.hf_cases import CASES

TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def _relative(plan, block: str) -> dict[str, tuple]:
    return {fqn[len(block) + 1:]: (p.role, tuple(p.placements.items()), p.transposed)
            for fqn, p in plan.params.items() if fqn.startswith(block + ".")}


@pytest.mark.parametrize("name", ["example_llama", "llama", "mistral", "qwen2"])
@pytest.mark.parametrize("mesh", [{"tp": 4}, {"dp": 2, "tp": 4}])
def test_kv_heads_fewer_than_tp(name, mesh):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=128)) if name == "example_llama" else CASES[name].build()
    plan = autoshard.plan(model, mesh, example_inputs=(TOKENS,))
    blocks = [u for u in plan.units if u]
    assert not plan.breaks, plan.breaks_line()
    assert all(plan.num_tp_collectives(b) == 5 for b in blocks), [plan.num_tp_collectives(b) for b in blocks]
    first = _relative(plan, blocks[0])
    assert all(_relative(plan, b) == first for b in blocks[1:])
    roles = {k.rsplit(".", 1)[0].rsplit(".", 1)[-1]: v[0] for k, v in first.items() if k.endswith("weight")}
    assert roles["o_proj" if "o_proj" in roles else "wo"] == "rowwise"
    proof = autoshard.check(model, mesh, example_inputs=(TOKENS,))
    assert proof.ok, str(proof)
