"""Product rules of the cut: matmuls, einsums and outer products follow the cut dim's subscript.

An op combining values by their dims keeps the cut the subscript of the cut dim holds: ``outer(a,
b)`` keeps a's cut on dim 0, an ``einsum`` or a matmul the subscript's output dim (a rotary table
built from cut positions stays cut). An operand cut otherwise (keys against cut queries) is read
whole; a subscript of the sequence summed over or taken as a diagonal mixes positions, and the cut
operands are read whole.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autoshard.core.errors import describe
from autoshard.passes.contractions import einsum_subscripts
from autoshard.passes.sequence_ops import Cut, Gather, op_name, shape_of, val_of

aten = torch.ops.aten


class ProductRules:
    """Rules for products of values (a mixin of :class:`autoshard.passes.cut_sequence._Rewriter`,
    whose cuts and building blocks they read)."""

    def _matmul(self, node: fx.Node):
        target = node.target
        if target is aten.addmm.default:
            a, b = node.args[1], node.args[2]
        else:
            a, b = node.args[0], node.args[1]
        if target in (aten.matmul.default, aten.mm.default, aten.bmm.default) and min(
                len(shape_of(a)), len(shape_of(b))) >= 2:
            # [..., m, k] @ [..., k, n]: a cut on m or n (a table built as ``inv_freq @ positions``), or on a
            # batch dim, keeps it; keys cut on k (or a second operand cut otherwise) are read whole
            nd_a, nd_b, nd_out = len(shape_of(a)), len(shape_of(b)), len(shape_of(node))
            batch = [f"...{i}" for i in range(nd_out - 2)]
            subs = [batch[nd_out - nd_a:] + ["m", "k"], batch[nd_out - nd_b:] + ["k", "n"]]
            cut, (a, b) = self._by_subscripts(node, [a, b], subs, batch + ["m", "n"])
            node.args = (a, b, *node.args[2:])
            return cut
        if target is aten.linear.default or self._cut_of(b) is None:
            cut = self._cut_of(a)
            nd_a = len(shape_of(a))
            if cut is None or cut.dim == nd_a - 1:
                raise Gather("a matmul contracting the sequence")
            out_nd = len(shape_of(node))
            return dataclasses.replace(cut, dim=cut.dim + out_nd - nd_a)
        # the right operand (keys, values) holds the sequence: read it whole
        node.replace_input_with(b, self._gather(b, node))
        if self._cut_of(a) is None:
            return None
        return self._matmul(node)

    def _einsum(self, node: fx.Node) -> Cut:
        """``einsum`` (and ``outer(a, b)``, which is ``einsum("i,j->ij", a, b)``): the cut follows its
        subscript to the output (a rotary table ``outer(positions, inv_freq)`` keeps the cut of the
        positions on dim 0)."""
        if node.target is aten.einsum.default:
            equation, operands = node.args[0], list(node.args[1])
            subs, out = einsum_subscripts(equation, [len(shape_of(v)) for v in operands])
            if len(out) != len(shape_of(node)) or any(len(sub) != len(shape_of(v)) for sub, v in zip(subs, operands,
                                                                                                  strict=True)):
                raise NotImplementedError(f"autoshard: {describe(node)}: context parallelism cannot read the "
                                          f"einsum equation '{equation}'")
            cut, operands = self._by_subscripts(node, operands, subs, out)
            node.args = (equation, operands, *node.args[2:])
            return cut
        cut, operands = self._by_subscripts(node, list(node.args[:2]), [["i"], ["j"]], ["i", "j"])
        node.args = tuple(operands)
        return cut

    def _by_subscripts(self, node: fx.Node, operands: list, subs: list[list[str]], out: list[str]):
        """The output cut and the operands to read, for an op whose dims are named by subscripts
        (``einsum``): the first cut operand's cut dim names a subscript, which the output keeps. Another
        operand cut along that subscript alike keeps its cut; one cut otherwise is read whole (keys
        against cut queries); a whole one holding that subscript at the sequence's length is indexed
        at this rank's positions, one holding it at length 1 is broadcast. A subscript summed over (not
        in ``out``) or repeated (a diagonal) mixes positions: the cut operands are read whole."""
        first = next((i for i, v in enumerate(operands) if isinstance(self._cut_of(v), Cut)), None)
        if first is None:
            raise NotImplementedError(f"autoshard: {describe(node)} reads values cut along the sequence that are not "
                                      f"one tensor")
        cut = self._cut_of(operands[first])
        letter = subs[first][cut.dim]
        name = op_name(node.target)
        if letter not in out:
            raise Gather(f"{name} contracting the sequence")
        if any(sub.count(letter) > 1 for sub in subs) or out.count(letter) > 1:
            raise Gather(f"{name} taking a diagonal along the sequence")
        whole = self._global(cut)
        kept = []  # what each operand becomes: itself, "gather", or the dim to index it along
        for value, sub in zip(operands, subs, strict=True):
            vcut = self._cut_of(value)
            if vcut is not None and not isinstance(vcut, Cut):
                raise NotImplementedError(f"autoshard: {describe(node)} reads '{value.name}', which holds cut values")
            if isinstance(vcut, Cut) and sub[vcut.dim] == letter and vcut == dataclasses.replace(cut, dim=vcut.dim):
                kept.append(None)
                continue
            shape = shape_of(value) if isinstance(val_of(value), torch.Tensor) else None
            at = sub.index(letter) if shape is not None and letter in sub else None
            size = None if at is None else shape[at]  # whole shapes: a cut operand's too
            if size not in (None, 1, whole):
                raise NotImplementedError(f"autoshard: {describe(node)} reads '{value.name}' of size {size} along "
                                          f"the subscript of a sequence of {whole}")
            kept.append(("gather" if isinstance(vcut, Cut) else None, at if size == whole else None))
        new = []
        for value, how in zip(operands, kept, strict=True):
            if how is not None:
                gather, at = how
                if gather:
                    value = self._gather(value, node)
                if at is not None:
                    value = self._index(value, dataclasses.replace(cut, dim=at), node)
            new.append(value)
        return dataclasses.replace(cut, dim=out.index(letter)), new
