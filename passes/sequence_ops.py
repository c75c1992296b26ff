"""Sequence ops: what each op does to the sequence dim a value is cut along.

The cut (:mod:`autoshard.passes.cut_sequence`) follows the sequence dim from op to op, as tp
follows its layouts: a :class:`Cut` names the dim a value holds cut, these tables sort the ops
by what they do to that dim, and a rule that finds an op mixing positions along it raises
:class:`Gather`, so that the op reads its cut inputs whole. The node readers (a value, its shape,
an op's arguments by name) are what every rule reads.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Cut:
    """A dim cut over cp. The dim's whole size is ``before * seq * after`` (a view merged the
    sequence with ``before`` outer and ``after`` inner elements); this rank holds
    ``before * (seq // cp) * after`` of them."""

    dim: int
    before: int = 1
    after: int = 1


class Gather(Exception):
    """An op that mixes positions along its input's cut dim: its cut inputs are read whole."""


VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
SAME_SHAPE = {aten.clone.default, aten.contiguous.default, aten.detach.default, aten.alias.default,
              aten.lift_fresh_copy.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout,
              aten.to.device, aten.dropout.default,
              aten.feature_dropout.default, aten.alpha_dropout.default, aten.fill.Scalar,
              aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
              aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self, aten.where.ScalarSelf,
              aten.where.ScalarOther, aten.copy.default}
# elementwise, though not tagged pointwise: complex numbers made and taken apart (a complex rotary table)
ELEMENTWISE = {aten.polar.default, aten.complex.default, aten.real.default, aten.imag.default, aten.conj.default,
               aten._conj.default, aten.resolve_conj.default, aten.resolve_neg.default}
# the first operand's values in the dtype (and device) of the second, which gives nothing else
LIKE_FIRST = {aten.type_as.default, aten.to.other}
# a new tensor of the size given, in the dtype and device of a value that gives nothing else (``x.new_ones(s)``)
NEW = {aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
       aten.new_empty_strided.default}
IN_PLACE_SCATTERS = {aten.scatter_.src, aten.scatter_.value, aten.scatter_add_.default, aten.scatter_reduce_.two}
# ops writing or reading each position's entries along ``dim`` (arg 1), by an index of the input's shape
SCATTERS = {aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter_reduce.two,
            aten.gather.default, *IN_PLACE_SCATTERS}
SUMS = {aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default}
REDUCTIONS = {aten.amax.default, aten.amin.default, aten.var.correction, aten.std.correction,
              aten.logsumexp.default, aten.any.dim, aten.all.dim, aten.argmax.default, aten.argmin.default,
              aten.norm.ScalarOpt_dim, aten.linalg_vector_norm.default}
ALONG_DIM = {aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int,
             aten.cumsum.default, aten.cumprod.default, aten.flip.default, aten.roll.default,
             aten.diff.default}
SDPA = aten.scaled_dot_product_attention.default
NLL = (aten.nll_loss_forward.default, aten.nll_loss.default, aten.nll_loss_nd.default)


def val_of(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def shape_of(node) -> tuple[int, ...] | None:
    value = val_of(node)
    return tuple(int(s) for s in value.shape) if isinstance(value, torch.Tensor) else None


def bound_args(node: fx.Node) -> dict:
    """An ATen node's arguments by their schema names, defaults filled in (``flatten(x, -2)`` has
    ``end_dim=-1``)."""
    out = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def op_name(target) -> str:
    return getattr(target, "__name__", str(target))
