"""Reduction rules of the cut: sums over the sequence finished over cp, losses over tokens.

A reduction over other dims keeps the cut; a sum or mean over the cut dim is finished with
``cp_all_reduce``, and a token-mean loss divides the all-reduced sum by the all-reduced count of
tokens that count, as on one device. Any other op combining entries along the sequence (a softmax,
a cumulative sum, a sort, a max) reads it whole.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from autoshard.core.errors import describe
from autoshard.passes.sequence_ops import SUMS, Cut, Gather, bound_args, op_name, shape_of, val_of
from autoshard.runtime.context_ops import CP_ALL_REDUCE

aten = torch.ops.aten


class ReductionRules:
    """Rules for ops combining entries along a dim, losses included (a mixin of
    :class:`autoshard.passes.cut_sequence._Rewriter`, whose cuts and building blocks they read)."""

    def _reduce(self, node: fx.Node):
        src = node.args[0]
        cut = self._cut_of(src)
        nd_in = len(shape_of(src))
        if node.target in (aten.sum.default, aten.mean.default):
            dims, keep = list(range(nd_in)), False
        else:  # by name: ``linalg_vector_norm(x, ord, dim, keepdim)``'s second argument is no dim
            args = bound_args(node)
            raw = args.get("dim")
            dims = list(range(nd_in)) if raw is None or raw == [] else [
                d % nd_in for d in (raw if isinstance(raw, (list, tuple)) else [raw])]
            keep = bool(args.get("keepdim", False))
        if cut.dim not in dims:
            return dataclasses.replace(cut, dim=cut.dim if keep else cut.dim - sum(d < cut.dim for d in dims))
        if node.target not in SUMS:
            raise Gather(f"{op_name(node.target)} over the sequence")
        # a sum over the cut dim: finished over cp; a mean is a sum over the whole count
        users = list(node.users)
        anchor = node.next
        total = node
        if node.target in (aten.mean.dim, aten.mean.default):
            total = self._insert(anchor, aten.mul.Tensor, (node, 1.0 / self.cp), owner=node)
        reduced = self._insert(anchor, CP_ALL_REDUCE, (total, self.cp, self.group), owner=node)
        for user in users:
            user.replace_input_with(node, reduced)
        self.cut[total] = None
        self.cut[reduced] = None
        return None

    def _along(self, node: fx.Node):
        src = node.args[0]
        cut = self._cut_of(src)
        nd = len(shape_of(src))
        args = bound_args(node)  # roll(x, shifts, dims), diff(x, n, dim): the dims by name, defaults included
        dim = args.get("dim", args.get("dims"))
        dims = list(range(nd)) if dim is None or dim == [] else [d % nd for d in (dim if isinstance(dim, (list, tuple))
                                                                                   else [dim])]
        if cut.dim in dims:
            raise Gather(f"{op_name(node.target)} along the sequence")
        return cut

    def _along_other_dim(self, node: fx.Node):
        """``topk`` / ``sort`` along a dim other than the cut one (an MoE router's experts): every
        output keeps the cut."""
        src = node.args[0]
        cut = self._cut_of(src)
        nd = len(shape_of(src))
        names = {aten.topk.default: ("self", "k", "dim"), aten.sort.default: ("self", "dim"),
                 aten.argsort.default: ("self", "dim"), aten.sort.stable: ("self",),
                 aten.argsort.stable: ("self",)}[node.target]
        args = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
        if int(args.get("dim", -1)) % nd == cut.dim:
            raise Gather(f"{op_name(node.target)} along the sequence")
        return cut if node.target in (aten.argsort.default, aten.argsort.stable) else (cut, cut)

    def _nll(self, node: fx.Node):
        """A loss over tokens: sums over cp; a mean divides by the all-reduced count of tokens that count."""
        logits, target = node.args[0], node.args[1]
        lcut = self._cut_of(logits)
        if not isinstance(lcut, Cut) or lcut.dim != 0:
            raise Gather("a loss whose rows are not the cut tokens")
        if self._cut_of(target) is None:
            node.replace_input_with(target, self._index(target, lcut, node))
        reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
        if reduction == 0:  # none
            return (lcut, None) if node.target is aten.nll_loss_forward.default else lcut
        if node.target is not aten.nll_loss_forward.default:
            raise NotImplementedError(f"autoshard: {describe(node)}: a reduced loss op other than nll_loss_forward")
        users = list(node.users)
        anchor = node.next
        node.args = (*node.args[:3], 2, *node.args[4:])  # summed here, divided by the whole count below
        loss = self._insert(anchor, operator.getitem, (node, 0), owner=node)
        count = self._insert(anchor, operator.getitem, (node, 1), owner=node)
        loss = self._insert(anchor, CP_ALL_REDUCE, (loss, self.cp, self.group), owner=node)
        count = self._insert(anchor, CP_ALL_REDUCE, (count, self.cp, self.group), owner=node)
        if reduction == 1:
            loss = self._insert(anchor, aten.div.Tensor, (loss, count), owner=node)
        for user in users:
            assert user.target is operator.getitem
            user.replace_all_uses_with(loss if user.args[1] == 0 else count)
            self.dead.append(user)
        for new in list(self.graph.nodes):
            if new in (loss, count):
                self.cut[new] = None
        return (None, None)

    def _loss_rows(self, node: fx.Node) -> Cut:
        """The cut of a loss's rows (its input's, class dim excluded), its target cut to match."""
        logits, target = node.args[0], node.args[1]
        lcut = self._cut_of(logits)
        if not isinstance(lcut, Cut) or lcut.dim == 1 and len(shape_of(logits)) > 1:
            raise Gather("a loss whose class dim is cut")
        tcut = dataclasses.replace(lcut, dim=lcut.dim if lcut.dim == 0 else lcut.dim - 1)
        if self._cut_of(target) is None:
            node.replace_input_with(target, self._index(target, tcut, node))
        elif self._cut_of(target) != tcut:
            raise Gather("a loss whose targets are cut unlike its inputs")
        return lcut

    def _cross_entropy(self, node: fx.Node):
        """``cross_entropy``: rows summed here, over cp, and a mean divided by the whole count of
        targets that are not ``ignore_index`` (what one device divides by, label smoothing included)."""
        lcut = self._loss_rows(node)
        names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
        args = dict(zip(names[:len(node.args)], node.args, strict=True)) | dict(node.kwargs)
        reduction = args.get("reduction", 1)
        if reduction == 0:
            return dataclasses.replace(lcut, dim=lcut.dim if lcut.dim == 0 else lcut.dim - 1)
        if reduction == 1 and args.get("weight") is not None:
            raise NotImplementedError(f"autoshard: {describe(node)}: a class-weighted mean loss under context "
                                      f"parallelism")
        users = list(node.users)
        anchor = node.next
        node.args, node.kwargs = (args["input"], args["target"]), {
            **{k: v for k, v in args.items() if k not in ("input", "target")}, "reduction": 2}
        total = self._insert(anchor, CP_ALL_REDUCE, (node, self.cp, self.group), owner=node)
        loss = total
        if reduction == 1:
            counted = self._insert(anchor, aten.ne.Scalar, (node.args[1], args.get("ignore_index", -100)), owner=node)
            count = self._insert(anchor, aten.sum.default, (counted,),
                                 {"dtype": val_of(node).dtype}, owner=node)
            count = self._insert(anchor, CP_ALL_REDUCE, (count, self.cp, self.group), owner=node)
            loss = self._insert(anchor, aten.div.Tensor, (total, count), owner=node)
        for user in users:
            user.replace_input_with(node, loss)
        for new in (total, loss):
            self.cut[new] = None
        return None
