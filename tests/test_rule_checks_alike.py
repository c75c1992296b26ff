"""A layout rule's values check answers alike whatever the process's memory held before.

DTensor's rules are checked on small random values (:mod:`passes.dtensor_rules`). An op may leave
part of its output unwritten for those values: ``torch._grouped_mm`` with the zero offsets an integer
input gets writes no row. Compared as the allocator left it, that memory made the check pass in one
process and fail in another, so ranks planning on their own placed the experts' all-reduce on either
side of a dtype cast and gloo aborted on mismatched sizes ("4096 vs 2048 bytes").
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from autoshard.core.options import PlanOptions
from autoshard.driver import planning
from autoshard.passes import dtensor_rules
from tests.pattern_models import PATTERNS, VOCAB


def _leave_in_freed_memory(value: float) -> None:
    """Allocate and free blocks of the sizes the check allocates, holding ``value``."""
    blocks = [torch.full((n,), value) for n in (64, 256, 1024, 4096, 16384) for _ in range(8)]
    blocks += [torch.full((n,), value, dtype=torch.bfloat16) for n in (64, 256, 1024, 4096, 16384) for _ in range(8)]
    del blocks


def _emitted_digest() -> str:
    dtensor_rules._answer_cached.cache_clear()  # ask again, not the answer an earlier plan cached
    torch.manual_seed(0)
    model = PATTERNS["moe_grouped_mm"]()
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    axes, options = planning.mesh_axes({"dp": 2, "tp": 2}), PlanOptions()
    planned = planning.plan_result(model, axes, (tokens,), None, None, options)
    parts = planning.emit(planned, axes, options).parts
    code = parts.root.code + "".join(parts.blocks[b].code for b in sorted(parts.blocks))
    return hashlib.sha256(code.encode()).hexdigest()


def test_unwritten_output_memory_reads_as_nan_in_the_check():
    x, w = torch.randn(8, 16).bfloat16(), torch.randn(2, 16, 16).bfloat16()
    with dtensor_rules._uninitialized_memory_filled():
        out = torch._grouped_mm(x, w, offs=torch.zeros(2, dtype=torch.int32))
    assert torch.isnan(out).all()
    assert not torch.are_deterministic_algorithms_enabled()  # restored on exit


@pytest.mark.parametrize("held", [0.0, 1.0, 1e-3])
def test_grouped_experts_plan_alike_whatever_freed_memory_held(held):
    reference = _emitted_digest()
    _leave_in_freed_memory(held)
    assert _emitted_digest() == reference


def test_the_agreement_compares_code_with_each_ranks_group_names_as_their_axis():
    from autoshard.driver.agreement import code_lines

    rank_0 = "x = torch.ops.autoshard.reduce_partial.default(y, '3');  y = None\nz = f(x, '31')"
    rank_2 = "x = torch.ops.autoshard.reduce_partial.default(y, '4');  y = None\nz = f(x, '31')"
    assert code_lines([rank_0], {"3": "tp", "1": "dp"}) == code_lines([rank_2], {"4": "tp", "2": "dp"})
    assert code_lines([rank_0], {"3": "tp"})[0].endswith("(y, '<tp>');  y = None")
    assert code_lines([rank_0], {"3": "tp"})[1] == "z = f(x, '31')"  # a longer name is not a group's
