"""Op dims: which dim of an op's input a dim of its output is.

A cut is carried through views, casts and elementwise ops without communication as long as the
dim it cuts can be followed from op to op: back from a value to the parameter it is computed
from (a parameter stored cut), or back through views to the replicated value they read (one cut
for all of them). The walk and the collective hoists follow dims the same way.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.passes import layout_rules

_aten = torch.ops.aten


def ndim_of(node: fx.Node) -> int:
    return node.meta["val"].dim()


def norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


SIZED_VIEWS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default)
_SAME_DIMS = (_aten._to_copy.default, _aten.to.dtype, _aten.clone.default, _aten.contiguous.default,
              _aten.alias.default)


def dim_before(node: fx.Node, source: fx.Node, dim: int, tp: int) -> int | None:
    """The dim of ``source`` that becomes ``node``'s ``dim``, when ``node`` only moves or maps
    ``source`` elementwise (a cast, a squeeze, an unsqueeze, a view, a unary elementwise op)."""
    target = node.target
    ndim = ndim_of(node)
    if target in _SAME_DIMS or (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
                                and ndim_of(source) == ndim):
        return dim
    if target == _aten.slice.Tensor and _whole_slice(node, source):
        return dim
    if target == _aten.unsqueeze.default:
        at = node.args[1] % ndim
        return None if dim == at else dim - (dim > at)
    if target == _aten.squeeze.dim:
        at = node.args[1] % ndim_of(source)
        return dim + (dim >= at) if source.meta["val"].shape[at] == 1 else dim
    if target in SIZED_VIEWS:
        shapes = [layout_rules._shape(source), layout_rules._shape(node)]
        found = [d for d in range(ndim_of(source)) if layout_rules._map_reshape(*shapes, d, tp) == dim]
        return found[0] if len(found) == 1 else None
    return None


def _whole_slice(node: fx.Node, source: fx.Node) -> bool:
    """``x[:, :]``: a slice that keeps every element of its dim (``A[None, :, None, :]``)."""
    dim = node.args[1] if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    size = source.meta["val"].shape[dim]
    return start in (None, 0) and (end is None or (isinstance(end, int) and end >= size)) and step == 1
