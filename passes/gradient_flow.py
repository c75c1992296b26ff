"""Gradient flow: which values of a graph a gradient flows back through.

A replicated value read by a sharded computation needs its gradient summed over tp
(``enter_tp``) only when a gradient reaches it, and a value cut over tp costs a backward
all-gather only when one flows back through it: propagation, the collective hoists and cp's
traffic count all ask this graph the same question, answered here once (:func:`carries_grad`),
with the ops that stop a gradient or only move it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

_aten = torch.ops.aten

# ops whose result carries no gradient back to their inputs: detach, and new tensors that only
# take their input's shape (``torch.zeros_like(x)`` as an accumulator)
_GRAD_STOPS = (
    _aten.detach.default, _aten.detach_.default, _aten.zeros_like.default, _aten.ones_like.default,
    _aten.empty_like.default, _aten.full_like.default, _aten.new_zeros.default, _aten.new_ones.default,
    _aten.new_empty.default, _aten.new_full.default,
)


def carries_grad(gm: fx.GraphModule) -> frozenset[fx.Node]:
    """Values a gradient flows back through: computed from a trainable parameter or from an
    input that requires grad (an activation handed over from the graph before a graph break),
    floating point, not cut off by ``detach`` or lent only a dtype or shape (``type_as``), and on
    a path to a floating output: a no-grad region's work (an indexer's scores, read only through
    ``detach`` or as top-k indices) carries none."""
    carries = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op in ("get_attr", "placeholder"):
            if isinstance(val, torch.Tensor) and val.requires_grad:
                carries.add(node)
        elif node.op == "call_function" and node.target not in _GRAD_STOPS:
            if _floating(val) and any(i in carries for i in _grad_sources(node)):
                carries.add(node)
    reaching = set()
    for node in reversed(gm.graph.nodes):
        if node.op == "output":
            reaching.update(v for v in node.all_input_nodes if _floating(v.meta.get("val")))
        elif node.op == "call_function" and node.target not in _GRAD_STOPS and (node in reaching or _writes(node)):
            reaching.update(_grad_sources(node))  # a write into a tensor read later (a scan's output) reaches too
    return frozenset(carries & reaching)


def _writes(node: fx.Node) -> bool:
    """An in-place op: its value lands in a tensor that other nodes read, not in its own users."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _floating(val) -> bool:
    return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
               for v in (val if isinstance(val, (tuple, list)) else (val,)))


def _grad_sources(node: fx.Node) -> list[fx.Node]:
    """The inputs a node's gradient flows back to: ``mask.type_as(embeds)``'s second tensor only
    lends its dtype or shape."""
    return list(node.args[:1]) if node.target in SHAPED_LIKE else node.all_input_nodes


# ops whose input gradient is their output gradient moved back (views, pieces of a split, casts):
# partial gradients reaching a value through them are summed there as they are everywhere else
VIEWS = (
    _aten.slice.Tensor, _aten.select.int, _aten.unsqueeze.default, _aten.squeeze.dim, _aten.view.default,
    _aten.reshape.default, _aten._unsafe_view.default, _aten.expand.default, _aten.alias.default,
    _aten.transpose.int, _aten.permute.default, _aten.split.Tensor, _aten.split_with_sizes.default,
    _aten.chunk.default, _aten.unbind.int, operator.getitem, _aten._to_copy.default, _aten.to.dtype,
)
# ops whose second tensor lends only its dtype or shape: no gradient flows to it
SHAPED_LIKE = (_aten.type_as.default, _aten.expand_as.default, _aten.view_as.default, _aten.reshape_as.default)
