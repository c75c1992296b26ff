"""Filled buffers: a fresh tensor written slice by slice and only then read is the concatenation of
what was written.

Model code often builds a tensor by allocating it and copying parts into it, to save the cat's
copy: DeepSeek-V3's attention makes its keys as ``k = x.new_empty(...)``, then
``k[..., :d].copy_(k_nope)`` and ``k[..., d:].copy_(k_rot)``. Captured, that is an allocation,
slices and in-place ``copy_`` ops, whose result is the buffer, not any op's output: a rule that
follows what an op does to a cut dim has nothing to follow (the buffer's own shape is a constant,
the copies return nothing anyone reads). Written as ``cat([k_nope, k_rot], -1)`` the same values come
from an op every axis has a rule for, and the rewrite happens once, right after capture.

Rewritten only when it is exactly a cat: the buffer is fresh (``new_empty``, ``empty``, ``new_zeros``,
``zeros``), every one of its uses before its reads is a slice along one dim written by one
``copy_`` whose result nothing reads, the slices tile the dim with no gap or overlap, each source
has the buffer's dtype and device, and every read comes after the last copy. Anything else is left as written.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autoshard.passes.partition import made_node

aten = torch.ops.aten

_FRESH = {aten.new_empty.default, aten.empty.memory_format, aten.new_zeros.default, aten.zeros.default}


@dataclasses.dataclass(frozen=True)
class _Write:
    start: int
    end: int
    slice: fx.Node
    copy: fx.Node


def filled_buffers_as_cats(graph: fx.Graph) -> int:
    """Rewrite every buffer filled by slice copies into a ``cat`` of the copied values; returns how
    many were rewritten."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    rewritten = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _FRESH:
            found = _writes(node, order)
            if found is not None:
                _as_cat(graph, node, *found)
                rewritten += 1
                order = {n: i for i, n in enumerate(graph.nodes)}  # the cat and its expands are new nodes
    if rewritten:
        graph.eliminate_dead_code()
    return rewritten


def _writes(buffer: fx.Node, order: dict) -> tuple[int, list[_Write], fx.Node] | None:
    """``(dim, writes in dim order, the last copy)`` when ``buffer`` is filled as a cat (see the module
    docstring)."""
    val = buffer.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return None
    writes, reads = [], []
    for user in buffer.users:
        write = _write(buffer, user, val)
        if write is not None:
            writes.append(write)
        else:
            reads.append(user)
    if len(writes) < 2 or len({dim for dim, _ in writes}) != 1:
        return None
    dim = writes[0][0]
    ordered = sorted((w for _, w in writes), key=lambda w: w.start)
    edges = [0, *(w.end for w in ordered)]
    if [w.start for w in ordered] != edges[:-1] or edges[-1] != val.shape[dim]:
        return None  # a gap or an overlap: not every element is written exactly once
    last = max((w.copy for w in ordered), key=order.__getitem__)
    if any(order[r] < order[last] for r in reads):
        return None
    return dim, ordered, last


def _write(buffer: fx.Node, user: fx.Node, val: torch.Tensor) -> tuple[int, _Write] | None:
    """``(dim, write)`` when ``user`` is a slice of ``buffer`` along one dim that one ``copy_`` of a
    value of the buffer's dtype fills, its result unread."""
    if user.target is not aten.slice.Tensor or user.args[0] is not buffer or len(user.users) != 1:
        return None
    copy = next(iter(user.users))
    if copy.target is not aten.copy_.default or copy.args[0] is not user or copy.users or len(copy.args) > 2:
        return None
    source = copy.args[1]
    source_val = source.meta.get("val") if isinstance(source, fx.Node) else None
    if not isinstance(source_val, torch.Tensor) or (source_val.dtype, source_val.device) != (val.dtype, val.device):
        return None  # copy_ would cast or move it: a cat would not
    dim = user.args[1] if len(user.args) > 1 else 0
    dim %= val.dim()
    size = val.shape[dim]
    start = user.args[2] if len(user.args) > 2 and user.args[2] is not None else 0
    end = user.args[3] if len(user.args) > 3 and user.args[3] is not None else size
    step = user.args[4] if len(user.args) > 4 else 1
    if not all(isinstance(v, int) for v in (start, end, step)) or step != 1:
        return None
    start, end = (min(max(v + size if v < 0 else v, 0), size) for v in (start, end))
    return dim, _Write(start, end, user, copy)


def _as_cat(graph: fx.Graph, buffer: fx.Node, dim: int, writes: list[_Write], last: fx.Node) -> None:
    """Replace ``buffer``'s reads by the cat of what ``writes`` copy into it, placed after ``last`` (the
    last copy); the copies and slices are erased, the allocation left for dead-code elimination."""
    parts = []
    with graph.inserting_before(last.next):
        for write in writes:
            source = write.copy.args[1]
            slice_val = write.slice.meta["val"]
            if tuple(source.meta["val"].shape) != tuple(slice_val.shape):  # copy_ broadcasts its source
                source = made_node(graph, aten.expand.default, (source, list(slice_val.shape)), write.copy,
                                   slice_val)
            parts.append(source)
        cat = made_node(graph, aten.cat.default, (parts, dim), writes[-1].copy, buffer.meta["val"])
    buffer.replace_all_uses_with(cat, delete_user_cb=lambda user: user is not cat and user not in
                                 {w.slice for w in writes})
    for write in writes:
        graph.erase_node(write.copy)
        graph.erase_node(write.slice)
