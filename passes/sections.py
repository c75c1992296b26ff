"""Sections: a fused projection's output written as one split into its sections.

Public code takes q, k and v out of one fused projection in many ways: a split of the last dim
(``qkv.split([q, kv, kv], -1)``), slices (Phi-3's ``qkv[..., :q_pos]``), a view to kv groups and
a split along them (torchtitan's ``view(b, s, -1, heads_per_kv + 2, head_dim)``), a view to
``heads + 2`` and index lists (Falcon's multi-query ``qkv[..., [-2], :]``), an inserted dim
(GPT-BigCode's ``unsqueeze(1).split(...)``). The layout rules follow the first two while every
section cuts into whole heads. When one does not (fewer k/v heads than tp ranks, one kv head),
the fused output is rewritten here into one :data:`~autoshard.runtime.whole_sections.FUSED_SPLIT` whose
sections are contiguous columns of the projection read in ``runs`` order, each viewed back to
the shape the model used. The layout rule of ``fused_split`` then cuts the sections with whole
heads and keeps the others whole; the projection's stored columns follow ``runs`` (see
:class:`~autoshard.plans.plan.FusedSections`).

Which columns land in which section is found by running the model's own data movement on a
tensor of column numbers (a *probe* of the fused dim only, never the activation): views,
reshapes, splits, slices, selections, index lists, inserted or removed size-1 dims and
permutations of the trailing dims. The walk stops at the first op that does anything else; the
values it stops at are the sections, and they must use every column exactly once.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx

from autoshard.passes.discover import Sites
from autoshard.passes.layout_rules import SPLITS, size_expr
from autoshard.passes.partition import made_like
from autoshard.runtime.whole_sections import FUSED_SPLIT

aten = torch.ops.aten

_SAME = (aten.clone.default, aten.contiguous.default, aten.alias.default, aten._to_copy.default, aten.to.dtype)
_RESHAPES = (
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int, aten.flatten.using_ints,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
)


@dataclasses.dataclass(frozen=True)
class Section:
    """One value the model reads out of a fused output: its node and the fused columns it holds,
    as a tensor of its trailing (column-derived) dims."""

    node: fx.Node
    columns: torch.Tensor

    @property
    def size(self) -> int:
        return self.columns.numel()


@dataclasses.dataclass(frozen=True)
class FusedOutput:
    """A fused projection's output ``value`` and the sections the model reads out of it."""

    value: fx.Node
    sections: tuple[Section, ...]
    moved: tuple[fx.Node, ...]  # the model's data movement between them, replaced

    def heads(self) -> list[int]:
        """Each section's heads: its first trailing dim, or, for a flat section among headed ones,
        its size in heads of the others' width (a multi-query key of one head)."""
        widths = {s.columns.shape[-1] for s in self.sections if s.columns.dim() >= 2}
        width = next(iter(widths)) if len(widths) == 1 else None
        out = []
        for s in self.sections:
            if s.columns.dim() >= 2:
                out.append(int(s.columns.shape[0]))
            elif width is not None and s.size % width == 0:
                out.append(s.size // width)
            else:
                out.append(s.size)
        return out

    def runs(self) -> list[int]:
        """The columns of every section in order, as ``[start0, stop0, start1, stop1, ...]``."""
        columns = torch.cat([s.columns.flatten() for s in self.sections]).tolist()
        runs, start = [], columns[0]
        for prev, col in zip(columns, columns[1:], strict=False):
            if col != prev + 1:
                runs += [start, prev + 1]
                start = col
        return runs + [start, columns[-1] + 1]


def split_fused_outputs(gm: fx.GraphModule, sites: Sites, tp: int) -> list[fx.Node]:
    """Rewrite each fused output with a section that does not cut into whole heads over ``tp``
    into one ``fused_split`` (see the module docstring). Returns the new split nodes."""
    if tp <= 1:
        return []
    rewritten = []
    for site in sites.linears:
        found = find_fused_output(gm, _added_to(site.output))
        heads = found.heads() if found is not None else []
        if found is None or all(h % tp == 0 for h in heads):
            continue
        rewritten.append(_rewrite(gm.graph, found, heads))
    return rewritten


def _added_to(value: fx.Node) -> fx.Node:
    """``value``, or the sum it is read through alone: ``value + b`` with ``b`` of its shape or a row
    of its width (a bias computed apart: EVA's ``cat((q_bias, k_bias, v_bias))``) keeps every column
    where it is, so its sections are the projection's; ``b`` is cut in the same sections."""
    while len(value.users) == 1:
        (user,) = value.users
        if (user.op != "call_function" or user.target != aten.add.Tensor or len(user.args) != 2
                or user.kwargs.get("alpha", 1) != 1 or not all(isinstance(a, fx.Node) for a in user.args)):
            break
        other = user.args[1] if user.args[0] is value else user.args[0]
        mine, theirs, out = (n.meta.get("val") for n in (value, other, user))
        if other is value or not all(isinstance(t, torch.Tensor) for t in (mine, theirs, out)) \
                or mine.shape != out.shape or mine.dtype != out.dtype \
                or tuple(theirs.shape) not in (tuple(mine.shape), tuple(mine.shape[-1:])):
            break
        value = user
    return value


def find_fused_output(gm: fx.GraphModule, value: fx.Node) -> FusedOutput | None:
    """The sections of ``value``'s last dim, if the model reads it only by moving its columns into
    two or more values that together use every column once."""
    val = value.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or not isinstance(val.shape[-1], int):
        return None
    leading = _leading(val.shape[:-1])
    width = val.shape[-1]
    probes: dict[fx.Node, object] = {value: torch.arange(width, device="cpu")}
    sections, moved, frontier = [], [], [value]
    while frontier:
        node = frontier.pop(0)
        probe = probes[node]
        followed = [u for u in node.users if _moves(gm, u, node, probe, leading, probes)]
        if node.users and len(followed) == len(node.users):
            moved.append(node)
            frontier += followed
        elif isinstance(probe, tuple):
            return None  # a split's results read as a tuple
        else:
            sections.append(Section(node, probe))  # read as it is (by some users at least): a section
    if len(sections) < 2:
        return None
    used = torch.cat([s.columns.flatten() for s in sections])
    if used.numel() != width or not torch.equal(used.sort().values, torch.arange(width, device="cpu")):
        return None
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    sections.sort(key=lambda s: order[s.node])
    return FusedOutput(value, tuple(sections), tuple(moved))


def _leading(shape) -> list:
    return [size_expr(d) for d in shape if size_expr(d) != 1]


def _trailing_start(shape, leading: list) -> int | None:
    """The first dim after the leading dims (equal to ``leading`` once size-1 dims are dropped) and
    the size-1 dims right after them (``scale.unsqueeze(1)``, a broadcast over the sequence)."""
    seen = 0
    for i, d in enumerate(shape):
        if seen == len(leading) and size_expr(d) != 1:
            return i
        d = size_expr(d)
        if d == 1:
            continue
        if d != leading[seen]:
            return None
        seen += 1
    return len(shape) if seen == len(leading) else None


def _moves(gm, user: fx.Node, node: fx.Node, probe, leading: list, probes: dict) -> bool:
    """Whether ``user`` only moves ``node``'s fused columns; records ``user``'s probe if so."""
    if user.op != "call_function":
        return False
    if user.target is operator.getitem:
        if not isinstance(probe, tuple):
            return False
        probes[user] = probe[user.args[1]]
        return True
    if isinstance(probe, tuple) or not user.args or user.args[0] is not node:
        return False
    val = user.meta.get("val")
    shapes = [v.shape for v in val] if isinstance(val, (list, tuple)) else [getattr(val, "shape", None)]
    if any(s is None for s in shapes):
        return False
    starts = [_trailing_start(s, leading) for s in shapes]
    if any(k is None for k in starts):
        return False
    node_start = _trailing_start(node.meta["val"].shape, leading)
    result = _apply(gm, user, probe, node_start)
    if result is None:
        return False
    results = list(result) if isinstance(result, (list, tuple)) else [result]
    for r, shape, k in zip(results, shapes, starts, strict=True):
        trailing = tuple(int(d) for d in shape[k:])
        if r.numel() != math.prod(trailing):
            return False
    if isinstance(result, (list, tuple)):
        probes[user] = tuple(r.reshape(tuple(int(d) for d in s[k:])) for r, s, k in zip(results, shapes, starts,
                                                                                          strict=True))
    else:
        probes[user] = results[0].reshape(tuple(int(d) for d in shapes[0][starts[0]:]))
    return True


def _apply(gm, user: fx.Node, probe: torch.Tensor, start: int):
    """``user``'s op on the probe of its input's trailing dims (which begin at dim ``start``)."""
    target, args = user.target, user.args
    ndim = start + probe.dim()

    def along(dim) -> int | None:
        dim = dim % ndim if ndim else 0
        return dim - start if dim >= start else None

    if target in _SAME or target in _RESHAPES:
        return probe  # reshaped to the user's trailing shape by the caller
    if target in SPLITS:
        dim = along(args[2] if len(args) > 2 else user.kwargs.get("dim", 0)) if target != aten.unbind.int else \
            along(args[1] if len(args) > 1 else 0)
        if dim is None:
            return None
        if target == aten.unbind.int:
            return probe.unbind(dim)
        if target == aten.chunk.default:
            return probe.chunk(args[1], dim)
        return probe.split(list(args[1]) if target == aten.split_with_sizes.default else args[1], dim)
    if target == aten.slice.Tensor:
        dim = along(args[1] if len(args) > 1 else 0)
        if dim is None:
            return None
        start_, end, step = (list(args[2:5]) + [None, None, 1])[:3]
        index = [slice(None)] * probe.dim()
        index[dim] = slice(start_, end, step)
        return probe[tuple(index)]
    if target == aten.select.int:
        dim = along(args[1])
        return None if dim is None else probe.select(dim, args[2])
    if target == aten.narrow.default:
        dim = along(args[1])
        return None if dim is None else probe.narrow(dim, args[2], args[3])
    if target in (aten.permute.default, aten.transpose.int):
        order = list(range(ndim))
        if target == aten.transpose.int:
            a, b = args[1] % ndim, args[2] % ndim
            order[a], order[b] = order[b], order[a]
        else:
            order = [d % ndim for d in args[1]]
        if order[:start] != list(range(start)):
            return None
        return probe.permute([d - start for d in order[start:]])
    if target == aten.index.Tensor:
        return _index(gm, args[1], probe, start)
    return None


def _index(gm, indices, probe: torch.Tensor, start: int):
    """``x[..., [i, j], ...]`` with one constant index list on a trailing dim."""
    picked = [(i, t) for i, t in enumerate(indices) if t is not None]
    if len(picked) != 1 or picked[0][0] < start:
        return None
    position, index = picked[0]
    value = constant_tensor(gm, index)
    if value is None or value.dim() != 1 or value.dtype not in (torch.int64, torch.int32):
        return None
    return probe.index_select(position - start, value.to("cpu").long() % probe.shape[position - start])


# ops between a lifted constant and its reader that keep its value
_CONSTANT_COPIES = (aten.lift_fresh_copy.default, aten.clone.default, aten._to_copy.default, aten.detach.default,
                    aten.detach_.default, aten.alias.default)


def constant_tensor(gm, node) -> torch.Tensor | None:
    """The value of a constant tensor the graph reads (an index list lifted into the graph), through
    copies and detaches; None for anything else, or a constant without a value (meta or fake)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _CONSTANT_COPIES:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value = gm
    for name in node.target.split("."):
        value = getattr(value, name, None)
    if not isinstance(value, torch.Tensor) or value.is_meta or isinstance(value, torch._subclasses.FakeTensor):
        return None
    return value


def _rewrite(graph: fx.Graph, found: FusedOutput, heads: list[int]) -> fx.Node:
    """One ``fused_split`` of ``found.value`` (sections of ``heads`` heads), each section viewed back
    to the model's shape."""
    value = found.value
    options = (found.runs(), [s.size for s in found.sections], heads)
    with graph.inserting_after(value):
        split = graph.call_function(FUSED_SPLIT, (value, *options))
    made_like(split, value)
    split.meta["val"] = FUSED_SPLIT(value.meta["val"], *options)
    split._rename(f"{value.name}_sections")
    previous = split
    for i, section in enumerate(found.sections):
        with graph.inserting_after(previous):
            piece = graph.call_function(operator.getitem, (split, i))
        made_like(piece, section.node)
        piece.meta["val"] = split.meta["val"][i]
        previous = piece
        # the section's node stays (other passes' records, such as a site's input, name it): it
        # now views its piece to the shape the model gave it, in the dtype the model gave it (a
        # section reached through a cast: bf16 pieces of a float32 product)
        sizes = _sizes(graph, value, section.node.meta["val"].shape, split)
        dtype = section.node.meta["val"].dtype
        if dtype == piece.meta["val"].dtype:
            section.node.target, section.node.args, section.node.kwargs = aten.view.default, (piece, sizes), {}
        else:
            with graph.inserting_after(piece):
                viewed = graph.call_function(aten.view.default, (piece, sizes))
            made_like(viewed, section.node)
            viewed.meta["val"] = piece.meta["val"].view(section.node.meta["val"].shape)
            section.node.target, section.node.args = aten._to_copy.default, (viewed,)
            section.node.kwargs = {"dtype": dtype}
    for node in reversed(found.moved):
        if node is not value and not node.users:
            graph.erase_node(node)
    return split


def _sizes(graph: fx.Graph, value: fx.Node, shape, before: fx.Node) -> list:
    """``shape`` as a view's size argument: symbolic sizes read from ``value`` (whose leading dims
    they are), size-1 dims and the trailing ones as integers."""
    lead = list(value.meta["val"].shape[:-1])
    sizes = []
    for d in shape:
        if isinstance(d, int):
            sizes.append(d)
            continue
        position = next(i for i, e in enumerate(lead) if size_expr(e) == size_expr(d))
        with graph.inserting_after(before):
            size = graph.call_function(aten.sym_size.int, (value, position))
        size.meta["val"] = d
        sizes.append(size)
    return sizes
