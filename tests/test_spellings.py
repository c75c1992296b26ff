"""One function, many spellings, one plan (tests/spellings.py).

Every spelling of a block family computes the reference's function on one device, and is
proven with the reference's tp collectives per block and no more breaks than it. A sample runs
in the first tier (each family's spellings that took a rewrite to read: einsum and tensordot
linears, a matmul on flattened rows, unbound fused sections, a hand-written attention, blocks
called through closures in a list, a per-head ``bmm``, multi-query attention kept cut on q); the
whole set, every family's one-axis spellings and 20 seeded combinations each (300 spellings) on
2x2, tp=4 and tp=8 in fp32 and bf16, in the second (``benchmarks/spellings.py`` is the same run as a report).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.spellings import DTYPES, MESHES, run_one, score
from tests.spellings import FAMILIES, Spelling, all_spellings, spellings


def _varied(family: str, **changes: str) -> Spelling:
    ref = FAMILIES[family].reference(family)
    return Spelling(family, tuple((axis, changes.get(axis, option)) for axis, option in ref.choices))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_spelling_computes_the_reference_function(family):
    x = FAMILIES[family].inputs()
    want = FAMILIES[family].reference(family).build()(*x)
    for spelling in spellings(family, combined=10):
        torch.testing.assert_close(spelling.build()(*x), want, rtol=1e-5, atol=1e-5, msg=spelling.name)


SAMPLE = [
    ("llama_mha", "2x2", {"linear": "einsum"}),
    ("llama_mha", "tp4", {"linear": "tensordot"}),
    ("llama_mha", "2x2", {"linear": "einsum_weight_first", "qkv": "fused_unbind"}),
    ("llama_mha", "tp8", {"linear": "in_out_einsum", "heads": "rearrange", "merge": "rearrange"}),
    ("llama_gqa", "tp4", {"linear": "mm_flat"}),
    ("llama_gqa", "tp4", {"attention": "softmax"}),
    ("llama_gqa", "tp4", {"mlp": "fused_unbind", "qkv": "kv_fused"}),
    ("llama_gqa", "2x2", {"linear": "addmm", "kv_repeat": "expand_reshape"}),
    ("llama_mqa", "tp4", {"linear": "einsum_ellipsis", "attention": "einsum"}),
    ("llama_mha", "2x2", {"container": "closure"}),
    ("per_head", "tp4", {"per_head": "bmm", "heads": "unflatten"}),
    ("llama_mqa", "2x2", {"qkv": "fused_split"}),
    ("llama_mqa", "tp8", {"attention": "softmax"}),
    ("llama_gqa", "tp4", {"rope": "filled_buffer"}),
]


@pytest.mark.parametrize(("family", "mesh", "changes"), SAMPLE,
                         ids=[f"{f}-{m}-" + "-".join(f"{v}" for v in c.values()) for f, m, c in SAMPLE])
def test_a_spelling_is_planned_as_its_reference(family, mesh, changes):
    runs = [run_one(s, mesh, "fp32") for s in (FAMILIES[family].reference(family), _varied(family, **changes))]
    summary = score(runs)
    reference, varied = runs
    assert summary["proven"] == 2, [r["why"] for r in runs]
    assert varied["at_reference"], (varied["collectives"], reference["collectives"], varied["breaks"])
    assert not varied["breaks"]


# What the whole set must reach: every run proven, no internal error, and 98% at the reference's
# collectives (measured 2026-12-07: 1800 of 1800 proven, 1780 at the reference; the 20 left are one
# combination of spellings, listed in docs/limits.md).
AT_REFERENCE_FLOOR = 0.98


@pytest.mark.long
def test_every_spelling_is_proven_at_its_reference_cost():
    """The whole set (every family, one-axis spellings and 20 combinations each: 300 spellings, three
    meshes, fp32 and bf16): every run proven, and the floor above."""
    import multiprocessing

    from benchmarks.spellings import _job

    jobs = [(s, m, d) for s in all_spellings() for m in MESHES for d in DTYPES]
    with multiprocessing.get_context("spawn").Pool(2, maxtasksperchild=50) as pool:
        records = pool.map(_job, jobs, chunksize=4)
    summary = score(records)
    failed = [f"{r['status']} {r['mesh']} {r['dtype']} {r['spelling']}: {(r['why'] or '')[-300:]}"
              for r in records if r["status"] != "proven"]
    assert summary["spellings"] >= 300, summary
    assert summary["internal"] == 0 and summary["crash"] == 0 and summary["failed"] == 0, "\n".join(failed[:20])
    assert summary["proven"] == summary["runs"], "\n".join(failed[:20])
    assert summary["at_reference"] >= AT_REFERENCE_FLOOR * summary["runs"], summary


def _hybrid(kinds: list[str]) -> torch.nn.Module:
    """A stack of grouped-query attention blocks and per-head recurrent blocks in the order ``kinds``,
    each in its family's reference spelling."""
    from tests.spellings import LlamaBlock, PerHeadBlock, Stack

    choices = dict(FAMILIES["llama_gqa"].reference("llama_gqa").choices)
    choices |= dict(FAMILIES["per_head"].reference("per_head").choices)
    sp = Spelling("hybrid", tuple(choices.items()))
    order = iter(kinds)
    torch.manual_seed(0)
    return Stack(sp, lambda: LlamaBlock(sp, FAMILIES["llama_gqa"].kv_heads) if next(order) == "attention"
                 else PerHeadBlock(sp), depth=len(kinds))


@pytest.mark.parametrize("mesh", ["2x2", "tp4"])
def test_a_hybrid_stack_plans_each_kind_of_block_as_it_would_alone(mesh):
    """Recurrent and attention blocks alternating (as Jamba, Zamba or OLMo-hybrid stack them): each
    block keeps its tp at the collectives a stack of its own kind plans for it, with no break."""
    import autoshard

    x = FAMILIES["llama_gqa"].inputs()
    alone = {}
    for kind in ("attention", "recurrent"):
        plan = autoshard.plan(_hybrid([kind] * 3), MESHES[mesh], example_inputs=x)
        alone[kind] = {plan.num_tp_collectives(u) for u in plan.units if u}
        assert len(alone[kind]) == 1 and 0 not in alone[kind], (kind, alone[kind])
    kinds = ["recurrent", "attention", "recurrent"]
    proof = autoshard.check(_hybrid(kinds), MESHES[mesh], example_inputs=x)
    assert proof.ok, str(proof)
    got = [proof.plan.num_tp_collectives(u) for u in proof.plan.units if u]
    assert got == [next(iter(alone[k])) for k in kinds] and not proof.plan.breaks, (got, alone)
