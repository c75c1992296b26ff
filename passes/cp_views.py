"""View rules of the cut: ops that move, merge, split, repeat or join dims carry the cut along.

The cut dim goes where the op puts the sequence: a transpose or a permute moves it, a view merging
it with other dims keeps it as a :class:`Cut` with ``before`` and ``after`` factors (the view's size
made local), ``repeat`` and ``tile`` hold it several times over, a concatenation or a split along
another dim keeps it in every piece. Slicing, splitting or joining along the sequence reads the
value whole.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autoshard.passes.sequence_ops import VIEWS, Cut, Gather, bound_args, op_name, shape_of, val_of

aten = torch.ops.aten


class ViewRules:
    """Rules for ops that lay dims out anew (a mixin of :class:`autoshard.passes.cut_sequence._Rewriter`,
    whose cuts and building blocks they read)."""

    def _dim_map(self, node: fx.Node) -> Cut:
        """Ops that move, add or drop dims: where the cut dim goes (or a gather if it is sliced)."""
        target, src = node.target, node.args[0]
        cut = self._cut_of(src)
        in_shape, out_shape = shape_of(src), shape_of(node)
        nd_in, nd_out = len(in_shape), len(out_shape)
        dim = cut.dim
        if target is aten.unsqueeze.default:
            at = node.args[1] % nd_out
            return dataclasses.replace(cut, dim=dim + (at <= dim))
        if target in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            dims = node.args[1] if len(node.args) > 1 else [i for i, s in enumerate(in_shape) if s == 1]
            dims = [d % nd_in for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
            dims = [d for d in dims if in_shape[d] == 1]
            return dataclasses.replace(cut, dim=dim - sum(d < dim for d in dims))
        if target in (aten.transpose.int, aten.t.default):
            a, b = (node.args[1] % nd_in, node.args[2] % nd_in) if target is aten.transpose.int else (0, 1)
            return dataclasses.replace(cut, dim=b if dim == a else a if dim == b else dim)
        if target is aten.permute.default:
            order = [d % nd_in for d in node.args[1]]
            return dataclasses.replace(cut, dim=order.index(dim))
        if target is aten.expand.default:
            new_dim = dim + nd_out - nd_in
            sizes = list(node.args[1])
            if sizes[new_dim] == self._global(cut):
                sizes[new_dim] = -1
                node.args = (src, sizes, *node.args[2:])
            return dataclasses.replace(cut, dim=new_dim)
        if target in (aten.select.int, aten.slice.Tensor, aten.narrow.default):
            at = node.args[1] % nd_in if len(node.args) > 1 else 0
            if at == dim:
                if target is aten.slice.Tensor and _covers(node, self._global(cut)):
                    return cut
                raise Gather(f"{op_name(target)} along the sequence")
            return dataclasses.replace(cut, dim=dim - (target is aten.select.int and at < dim))
        if target is aten.unflatten.int:
            at = node.args[1] % nd_in
            if at == dim:
                return self._view(node)
            return dataclasses.replace(cut, dim=dim + (nd_out - nd_in if at < dim else 0))
        if target is aten.flatten.using_ints:
            args = bound_args(node)
            start, end = args["start_dim"] % nd_in, args["end_dim"] % nd_in
            if start <= dim <= end:
                return self._view(node)
            return dataclasses.replace(cut, dim=dim - (end - start) if dim > end else dim)
        raise AssertionError(target)

    def _view(self, node: fx.Node) -> Cut:
        """A reshape: the out dim holding the sequence factor, and its shape argument made local."""
        src = node.args[0]
        cut = self._cut_of(src)
        in_shape, out_shape = shape_of(src), shape_of(node)
        outer = cut.before
        for size in in_shape[:cut.dim]:
            outer *= size
        # the flat offset structure: outer * seq * inner, row-major
        prefix = 1
        for j, size in enumerate(out_shape):
            if outer % prefix == 0 and (prefix * size) % (outer * self.seq) == 0 and prefix <= outer:
                before = outer // prefix
                after = (prefix * size) // (outer * self.seq)
                new = Cut(j, before, after)
                if node.target in VIEWS:
                    sizes = list(node.args[1])
                    if sizes[j] != -1:
                        sizes[j] = before * self.local * after
                    node.args = (src, sizes, *node.args[2:])
                elif node.target is aten.unflatten.int:
                    sizes = list(node.args[2])
                    k = j - node.args[1] % len(in_shape)
                    if sizes[k] != -1:
                        sizes[k] = before * self.local * after
                    node.args = (src, node.args[1], sizes)
                return new
            prefix *= size
        raise Gather("a view that splits the sequence dim")

    def _complex_view(self, node: fx.Node) -> Cut:
        """``view_as_complex`` (pairs of the last dim made complex) and ``view_as_real`` (a last dim of
        2 added): every other dim, the cut one included, is kept."""
        cut = self._cut_of(node.args[0])
        if node.target is aten.view_as_complex.default and cut.dim == len(shape_of(node.args[0])) - 1:
            raise Gather("view_as_complex of pairs along the sequence")
        return cut

    def _repeat(self, node: fx.Node) -> Cut:
        """``repeat`` / ``tile``: new dims added in front; the cut dim repeated ``r`` times holds the
        sequence ``r * before`` times over (each copy this rank's positions)."""
        src = node.args[0]
        cut = self._cut_of(src)
        nd_in, nd_out = len(shape_of(src)), len(shape_of(node))
        repeats = [int(r) for r in node.args[1]]
        repeats = [1] * (nd_out - len(repeats)) + repeats
        dim = cut.dim + nd_out - nd_in
        return dataclasses.replace(cut, dim=dim, before=cut.before * repeats[dim])

    def _repeat_interleave(self, node: fx.Node) -> Cut:
        """Each row repeated ``repeats`` times (an MoE's tokens, once per chosen expert): along the cut
        dim, each position's rows stay together."""
        src, repeats = node.args[0], node.args[1]
        cut = self._cut_of(src)
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if dim is None:
            raise Gather("repeat_interleave of a flattened value")
        dim %= len(shape_of(src))
        if dim != cut.dim:
            return cut
        return dataclasses.replace(cut, after=cut.after * int(repeats))

    def _cat(self, node: fx.Node):
        values = list(node.args[0])
        shapes = [shape_of(v) for v in values]
        out_nd = len(shape_of(node))
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % out_nd
        first = next(self._cut_of(v) for v in values if self._cut_of(v))
        stacked = node.target is aten.stack.default
        if not stacked and first.dim == dim:
            raise Gather("a concatenation along the sequence")
        new_values = []
        for value, shape in zip(values, shapes, strict=True):  # every input cut as the first cut one
            cut = self._cut_of(value)
            if cut == first:
                new_values.append(value)
            elif cut is None and shape[first.dim] == self._global(first):
                new_values.append(self._index(value, first, node))
            else:
                raise Gather("a concatenation of values cut differently")
        node.args = (new_values, *node.args[1:])
        return dataclasses.replace(first, dim=first.dim + (1 if stacked and dim <= first.dim else 0))

    def _split(self, node: fx.Node):
        src = node.args[0]
        cut = self._cut_of(src)
        nd = len(shape_of(src))
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        if node.target is aten.unbind.int:
            dim = node.args[1] if len(node.args) > 1 else 0
        dim %= nd
        if dim == cut.dim:
            raise Gather(f"{op_name(node.target)} along the sequence")
        pieces = len(val_of(node))
        out = dataclasses.replace(cut, dim=cut.dim - (node.target is aten.unbind.int and dim < cut.dim))
        return tuple(out for _ in range(pieces))


def _covers(node: fx.Node, size: int) -> bool:
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    return (start in (0, None)) and (end is None or end >= size) and step == 1
