"""Attention rules of the cut: every rank's keys and values read by this rank's queries.

SDPA reads the keys and values all-gathered over cp (``cp_gather``). A causal one becomes
``cp_causal_attention``, each local chunk reading the keys up to its own end; an explicit mask is
indexed at this rank's query positions, every key read. A causal one the chunks cannot read so (a
contiguous cut, for comparison) reads every key under a causal mask of this rank's positions.
"""

from __future__ import annotations

import torch.fx as fx

from autoshard.core.errors import describe
from autoshard.passes.sequence_ops import SDPA, Cut, shape_of
from autoshard.runtime.context_ops import CP_CAUSAL_ATTENTION


class AttentionRules:
    """Rules for attention (a mixin of :class:`autoshard.passes.cut_sequence._Rewriter`, whose cuts,
    building blocks and causal masks they read)."""

    def _sdpa(self, node: fx.Node):
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        args = dict(zip(names[:len(node.args)], node.args, strict=True))
        args.update(node.kwargs)
        q, k, v = args["query"], args["key"], args["value"]
        mask = args.get("attn_mask")
        qcut = self._cut_of(q)
        nd = len(shape_of(q))
        if not isinstance(qcut, Cut) or qcut.dim != nd - 2 or qcut.before != 1 or qcut.after != 1:
            raise NotImplementedError(f"autoshard: {describe(node)}: context parallelism needs the queries cut along "
                                      f"their sequence dim (-2)")
        if isinstance(mask, fx.Node):
            mask = self._mask_rows(mask, node)
        self.attention.append(node.name)
        rest = {n: args[n] for n in ("dropout_p", "scale", "enable_gqa") if n in args}
        causal = bool(args.get("is_causal", False))
        if causal and mask is not None:
            raise NotImplementedError(f"autoshard: {describe(node)} has both a mask and is_causal")
        if causal and self.balanced and all(self._cut_of(x) == qcut for x in (k, v)):
            return self._causal(node, q, k, v, rest)
        keys, values = [self._gather(x, node) if self._cut_of(x) else x for x in (k, v)]
        if not causal:
            node.args, node.kwargs = (q, keys, values), {**rest, "attn_mask": mask}
            return qcut
        if shape_of(keys)[-2] != self.seq:
            raise NotImplementedError(f"autoshard: {describe(node)} is causal over {shape_of(keys)[-2]} keys, not the "
                                      f"sequence of {self.seq}")
        # a contiguous cut (for comparison): every query against every key, under a mask of positions
        out = self._insert(node.next, SDPA, (q, keys, values),
                           {**rest, "attn_mask": self._causal_mask(0, self.local, self.seq)}, like=node, owner=node)
        self.cut[out] = qcut
        self.dead.append(node)
        node.replace_all_uses_with(out)
        return qcut

    def _mask_rows(self, mask: fx.Node, node: fx.Node) -> fx.Node:
        """An attention mask read at this rank's query positions, every key whole."""
        cut, shape = self._cut_of(mask), shape_of(mask)
        rows = len(shape) - 2
        if isinstance(cut, Cut) and cut.dim != rows:
            mask = self._gather(mask, node)
            cut = None
        if cut is None and shape[rows] == self.seq:
            return self._index(mask, Cut(rows), node)
        return mask

    def _causal(self, node: fx.Node, q, k, v, rest) -> Cut:
        """Causal attention of this rank's two chunks over every rank's keys and values, each chunk
        reading the keys up to its own end (``cp_causal_attention``, which gathers k and v)."""
        if rest.get("dropout_p", 0.0):
            raise NotImplementedError(f"autoshard: {describe(node)}: causal attention with dropout under context "
                                      "parallelism (its backward computes the attention again)")
        node.target = CP_CAUSAL_ATTENTION
        node.args, node.kwargs = (q, k, v, self.cp, self.group, rest.get("scale"),
                                  bool(rest.get("enable_gqa", False))), {}
        return self._cut_of(q)
