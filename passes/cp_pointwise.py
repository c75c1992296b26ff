"""Pointwise rules of the cut: ops that work position by position keep the cut.

Pointwise ops, norms over other dims than the sequence, embeddings and picks by a cut index,
scatters along another dim: each position's entries stay its own, so the cut carries through
without communication. A whole operand holding the sequence (a rotary table, a mask, shifted
labels) is indexed at this rank's positions; one cut otherwise is read whole first.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autoshard.core.errors import describe
from autoshard.passes.sequence_ops import IN_PLACE_SCATTERS, Cut, Gather, op_name, shape_of, val_of

aten = torch.ops.aten


class PointwiseRules:
    """Rules for ops that keep each position's entries apart (a mixin of
    :class:`autoshard.passes.cut_sequence._Rewriter`, whose cuts and building blocks they read)."""

    def _pointwise(self, node: fx.Node, values) -> Cut:
        out_ndim = len(shape_of(node)) if shape_of(node) is not None else 0
        target_cut = None
        values = list(values)
        for i, value in enumerate(values):
            cut = self._cut_of(value)
            if isinstance(cut, Cut):
                aligned = cut.dim + out_ndim - len(shape_of(value))
                if aligned < 0:  # not broadcast into the output: no elementwise rule says where the cut goes
                    raise NotImplementedError(f"autoshard: context parallelism cannot follow the cut of "
                                              f"'{value.name}' through {describe(node)}, whose output has fewer "
                                              f"dims than that input")
                if target_cut is None:
                    target_cut = dataclasses.replace(cut, dim=aligned)
                elif dataclasses.replace(cut, dim=aligned) != target_cut:
                    # cut otherwise: read whole, then (below) indexed as the output is cut where it holds it
                    values[i] = self._gather(value, node)
                    node.replace_input_with(value, values[i])
        assert target_cut is not None
        for value in values:
            if self._cut_of(value) is None and isinstance(val_of(value), torch.Tensor):
                shape = shape_of(value)
                at = target_cut.dim - (out_ndim - len(shape))
                if at >= 0 and shape[at] == self._global(target_cut):
                    node.replace_input_with(value, self._index(value, dataclasses.replace(target_cut, dim=at), node))
                elif at >= 0 and shape[at] != 1:
                    raise NotImplementedError(f"autoshard: {describe(node)} broadcasts '{value.name}' of size "
                                              f"{shape[at]} against a sequence of {self._global(target_cut)}")
        return target_cut

    def _expand_as(self, node: fx.Node) -> Cut:
        """``x.expand_as(other)``: the output has ``other``'s shape, so ``other``'s cut; where ``x``
        broadcasts on that dim (size 1, or no such dim: a norm kept with ``keepdim``) it is taken as it
        is, a whole ``x`` holding the sequence there is indexed at this rank's positions, and one cut
        otherwise is read whole first. With only ``x`` cut, ``other`` (whose shape alone is read)
        holds the sequence where ``x`` does, and is indexed at this rank's positions."""
        x, other = node.args[:2]
        xcut, ocut = self._cut_of(x), self._cut_of(other)
        nd_x, nd_out = len(shape_of(x)), len(shape_of(other))
        if not isinstance(ocut, Cut):
            if not isinstance(xcut, Cut):
                raise NotImplementedError(f"autoshard: {describe(node)} reads '{x.name}', which holds cut values")
            out = dataclasses.replace(xcut, dim=xcut.dim + nd_out - nd_x)
            if ocut is not None or shape_of(other)[out.dim] != self._global(out):
                raise NotImplementedError(f"autoshard: {describe(node)} expands '{x.name}' cut along the sequence "
                                          f"to the shape of '{other.name}', {list(shape_of(other))}")
            node.replace_input_with(other, self._index(other, out, node))
            return out
        at = ocut.dim - (nd_out - nd_x)  # x's dim broadcast to other's cut one
        if xcut == dataclasses.replace(ocut, dim=at):
            return ocut
        if xcut is not None:
            if not isinstance(xcut, Cut):
                raise NotImplementedError(f"autoshard: {describe(node)} reads '{x.name}', which holds cut values")
            whole = self._gather(x, node)
            node.replace_input_with(x, whole)
            x = whole
        size = shape_of(x)[at] if at >= 0 else 1
        if size == self._global(ocut):
            node.replace_input_with(x, self._index(x, dataclasses.replace(ocut, dim=at), node))
        elif size != 1:
            raise NotImplementedError(f"autoshard: {describe(node)} expands '{x.name}' of size {size} to a sequence "
                                      f"of {self._global(ocut)}")
        return ocut

    def _norm(self, node: fx.Node):
        src = node.args[0]
        cut = self._cut_of(src)
        nd = len(shape_of(src))
        normalized = len(node.args[1])
        if cut is None or cut.dim >= nd - normalized:
            raise Gather("a norm over the sequence")
        if node.target in (aten.native_layer_norm.default, aten._fused_rms_norm.default):
            return (cut, cut, cut)
        return cut

    def _embedding(self, node: fx.Node) -> Cut:
        ids = node.args[1]
        cut = self._cut_of(ids)
        if cut is None:
            raise Gather("an embedding table cut along the sequence")
        return cut

    def _pick(self, node: fx.Node) -> Cut:
        """``table[index]``: a whole table picked by a cut index along its first dim (an expert's
        weights per row, ``W[ids]``) is cut as the index is, its dims leading the result, as an
        embedding is; a cut table, or a pick along another dim, may mix positions."""
        table, indices = node.args[0], node.args[1]
        first = indices[0] if indices else None
        cut = self._cut_of(first) if isinstance(first, fx.Node) else None
        if self._cut_of(table) is None and isinstance(cut, Cut) and len(indices) == 1:
            return cut
        raise Gather(f"{op_name(node.target)} may mix positions along the sequence")

    def _scatter(self, node: fx.Node) -> Cut:
        """``scatter``/``gather`` along ``dim`` (a router's mask made by ``zeros_like(scores).scatter_(1,
        top, 1)``): along another dim than the cut one, with every tensor operand cut alike, each
        position's entries stay its own. An in-place one whose buffer is not cut alike cannot be
        read whole instead (its writes would go to a copy): refused by line."""
        tensors = [a for a in node.args if isinstance(a, fx.Node) and isinstance(val_of(a), torch.Tensor)]
        cuts = [self._cut_of(a) for a in tensors]
        dim = int(node.args[1]) % len(shape_of(node.args[0]))
        if all(isinstance(c, Cut) for c in cuts) and len(set(cuts)) == 1 and cuts[0].dim != dim:
            return cuts[0]
        why = f"{op_name(node.target)} along the sequence, or of values cut otherwise"
        if node.target in IN_PLACE_SCATTERS:
            raise NotImplementedError(f"autoshard: context parallelism cannot cut {describe(node)}: {why}, writes "
                                      "into its buffer in place")
        raise Gather(why)
