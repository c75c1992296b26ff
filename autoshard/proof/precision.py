"""Precision: the emitted code computes every value in the dtype the model's code does.

Numbers alone cannot catch every bf16-only bug. A cast to float32 dropped before a
norm's statistic, a sum taken in bf16 where the model asked for float32, or bf16
partial sums added in bf16 where the plan adds them in float32 each cost about one
extra rounding at one place, which the model's own bf16 rounding upstream can hide
(:mod:`autoshard.proof.rounding` compares whole outputs and gradients). Each of them,
though, changes a dtype, and dtypes can be compared exactly: every node of the
emitted graph that has a twin in the planned graph must produce values of the twin's
dtype on every rank, and every tp sum of values narrower than the plan's reduce
dtype must be added in that dtype. The first node that does not is named.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.core.errors import describe
from autoshard.runtime import collectives

# each summing collective's position of ``reduce_dtype`` in its arguments
_SUMS = {collectives.REDUCE_PARTIAL: 2, collectives.ENTER_TP: 2, collectives.ENTER_TPS: 2,
         collectives.REDUCE_SCATTER_PARTIAL: 3,
         collectives.GATHER_FOR_COLWISE: 3}


def first_precision_change(root: fx.GraphModule, planned: fx.GraphModule, skip: frozenset[str],
                           values: dict, reduce_dtype: torch.dtype | None) -> str | None:
    """The first node of the code that runs (``root`` and the blocks it calls, in the order they
    run) that computes in another dtype than its planned twin, or adds partial sums narrower than
    ``reduce_dtype``; ``values`` are the simulated per-rank values by node name (``PerRank``)."""
    twins = {n.name: n for n in planned.graph.nodes}
    for node in _running_order(root):
        if node.target in _SUMS:
            found = _narrow_sum(node, values, reduce_dtype)
        elif node.name in twins and node.name not in skip:
            found = _changed_dtype(node, twins[node.name], values)
        else:
            found = None
        if found:
            return f"{describe(node)}: {found}"
    return None


def _running_order(gm: fx.GraphModule):
    """Every ``call_function`` node of ``gm`` and of the graph modules it calls, as they run."""
    for node in gm.graph.nodes:
        if node.op == "call_function":
            yield node
        elif node.op == "call_module" and isinstance(child := gm.get_submodule(node.target), fx.GraphModule):
            yield from _running_order(child)


def _narrow_sum(node: fx.Node, values: dict, reduce_dtype: torch.dtype | None) -> str | None:
    if reduce_dtype is None:
        return None
    first = node.args[0][0] if isinstance(node.args[0], (list, tuple)) and node.args[0] else node.args[0]
    summed = _dtype_of(values.get(first.name) if isinstance(first, fx.Node) else None)
    if summed is None or not summed.is_floating_point or summed.itemsize >= reduce_dtype.itemsize:
        return None
    position = _SUMS[node.target]
    added = node.kwargs.get("reduce_dtype", node.args[position] if len(node.args) > position else None) or summed
    if added.itemsize >= reduce_dtype.itemsize:
        return None
    return (f"adds {_name(summed)} partial sums in {_name(added)}, where the plan adds tp sums in "
            f"{_name(reduce_dtype)}")


def _changed_dtype(node: fx.Node, twin: fx.Node, values: dict) -> str | None:
    want = twin.meta.get("val")
    got = _dtype_of(values.get(node.name))
    if not isinstance(want, torch.Tensor) or got is None or got == want.dtype:
        return None
    return f"computes in {_name(got)} where the model's code computes in {_name(want.dtype)}"


def _dtype_of(per_rank) -> torch.dtype | None:
    value = per_rank.values[0] if per_rank is not None and len(per_rank) else None
    return value.dtype if isinstance(value, torch.Tensor) else None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
