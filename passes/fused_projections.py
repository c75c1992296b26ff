"""Fused projections: following a fused projection's sections through the ops after it.

A colwise projection whose output is split into sections (q|k|v, gate|up, Mamba's gate|xBC|dt)
stays cut when each rank holds its share of every section: its stored columns are permuted to
match. Whether that holds depends on what lies between the projection and the split (views of
other dims, sums with another projection's output, depthwise convolutions over the channels, a
cat of one piece per section), each step found here, for the walk to accept or refuse the split.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.passes import layout_rules
from autoshard.passes.discover import LinearSite
from autoshard.passes.layout_plan import is_sharded
from autoshard.passes.op_dims import SIZED_VIEWS, ndim_of, norm_dim
from autoshard.plans.plan import FusedSections

_aten = torch.ops.aten


# ops of one tensor that keep each column where it is: a value made from a cat of sections by them
# is cut in those sections as the cat is
_COLUMNWISE = (_aten.mul.Tensor, _aten.div.Tensor, _aten.neg.default, _aten._to_copy.default, _aten.to.dtype,
               _aten.clone.default, _aten.alias.default)


def cat_of_sections(node: fx.Node, dim, fused: FusedSections, tp: int) -> list[fx.Node] | None:
    """``node``, read only by the op that cuts it along ``dim`` in ``fused``'s sections, and the ops
    back to a ``cat`` along ``dim`` of one piece per section that it is made from by columnwise ops of
    it alone (a scale: litgpt's LoRA update ``zero_pad(after_B) * scaling``), each read only by the
    next; None if it is not. Cut piece by piece (a whole section's piece read whole, a cut one in
    contiguous chunks), the cat is each rank's share of every section, in the order the projection
    stores them."""
    if not isinstance(dim, int) or fused.runs not in ((), (0, sum(fused.sizes))):  # columns in order
        return None
    chain = [node]
    while node.target != _aten.cat.default:
        inputs = node.all_input_nodes
        if (node.op != "call_function" or node.target not in _COLUMNWISE or len(inputs) != 1
                or node.args[0] is not inputs[0] or len(node.users) != 1):
            return None
        node = inputs[0]
        if node.meta["val"].shape != chain[-1].meta["val"].shape:
            return None
        chain.append(node)
    pieces = node.args[0]
    cat_dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    ndim = ndim_of(node)
    if (len(node.users) != 1 or cat_dim % ndim != dim % ndim
            or not all(isinstance(p, fx.Node) and ndim_of(p) == ndim for p in pieces)):
        return None
    sizes = tuple(p.meta["val"].shape[dim] for p in pieces)
    if sizes != tuple(fused.sizes) or not all(isinstance(size, int) and (i in fused.whole or size % tp == 0)
                                              for i, size in enumerate(sizes)):
        return None
    return chain


def section_dim_after(user: fx.Node, value: fx.Node, dim: int, param_fqns, tp: int) -> tuple[int, list[str]] | None:
    """Where ``value``'s sections dim ``dim`` is in ``user``'s output, and the parameters ``user``
    reads along it, when ``user`` keeps each channel's values apart; else None."""
    target = user.target
    if target in (_aten.transpose.int, _aten.swapaxes.default):
        a, b = (norm_dim(d, ndim_of(value)) for d in user.args[1:3])
        return (b if dim == a else a if dim == b else dim), []
    if target == _aten.permute.default:
        order = [norm_dim(d, ndim_of(value)) for d in user.args[1]]
        return order.index(dim), []
    if target == _aten.slice.Tensor:
        return None if norm_dim(user.args[1] if len(user.args) > 1 else 0, ndim_of(value)) == dim else (dim, [])
    conv = layout_rules.Convolution.of(user)
    if conv is not None:
        groups, channels = conv.groups, value.meta["val"].shape[1]
        if (conv.input is not value or dim != 1 or groups != channels or ndim_of(user) != ndim_of(value)
                or not layout_rules.cuts_groups(user, tp)):
            return None
        params = [source_param(t, param_fqns) for t in (conv.weight, conv.bias) if isinstance(t, fx.Node)]
        return None if None in params else (1, params)
    single = user.all_input_nodes == [value] and ndim_of(user) == ndim_of(value)
    if single and (layout_rules.is_pointwise(target) or target in layout_rules.ELEMENTWISE_LIKE):
        return dim, []
    return None


def heads_of(piece: fx.Node | None, size: int) -> int:
    """The heads a split's piece of ``size`` channels is viewed into (``B.view(b, s, groups,
    state)``: its groups), or ``size`` when no reader views it so."""
    for user in piece.users if piece is not None else ():
        shape = getattr(user.meta.get("val"), "shape", ())
        if user.target in SIZED_VIEWS and len(shape) >= 2 and all(isinstance(d, int) for d in shape[-2:]) \
                and shape[-2] * shape[-1] == size:
            return shape[-2]
    return size


def source_param(node: fx.Node, param_fqns) -> str | None:
    """The parameter ``node`` is a view or cast of (``conv1d.weight.unsqueeze(1)``), if any."""
    while node.op == "call_function" and len(node.all_input_nodes) == 1 and node.args[0] is node.all_input_nodes[0]:
        node = node.args[0]
    return node.target if node.op == "get_attr" and node.target in param_fqns else None


def fused_origins(value: fx.Node, layouts, output_site, param_fqns,
                   readers: int = 1) -> list[tuple[LinearSite, list[str]]] | None:
    """The colwise sites whose outputs reach ``value`` through single-use reshapes of other dims
    (the sharded dim keeps the sites' full output size all the way), sums of such outputs (a
    LoRA adapter's ``lora_B`` added to its base projection) and their concatenation along another
    dim (JetMoE's experts, one ``F.linear`` per expert on its rows, then ``cat``), each with the parameters of the
    depthwise convolutions on its way (gated DeltaNet's ``conv1d`` between ``in_proj_qkv`` and its
    split), which hold their channels in the sites' order. ``value`` itself has ``readers`` users:
    the split, or the slices tiling it."""

    def walk(node: fx.Node, allowed_users: int, params: list[str]):
        site = output_site.get(node)
        lay = layouts.get(node)
        size = layout_rules.size_expr(node.meta["val"].shape[lay]) if isinstance(lay, int) else None
        if len(node.users) != allowed_users or size is None:
            return None
        if site is not None:
            return [(site, params)] if size == site.out_features else None
        conv = layout_rules.Convolution.of(node)
        if conv is not None and lay == 1:
            found = [source_param(t, param_fqns) for t in (conv.weight, conv.bias) if isinstance(t, fx.Node)]
            if None in found or not isinstance(conv.input, fx.Node):
                return None
            return walk(conv.input, 1, params + found)
        sharded = [i for i in node.all_input_nodes if is_sharded(layouts.get(i))]
        if len(sharded) == 1:
            return walk(sharded[0], 1, params)
        along = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) if node.args else None
        stacked = node.target == _aten.cat.default and norm_dim(along, ndim_of(node)) != lay
        if (node.target not in SUMS and not stacked) or any(
                layouts.get(i) != lay or ndim_of(i) != ndim_of(node) for i in sharded):
            return None
        found = [walk(i, 1, params) for i in sharded]
        return None if None in found else [origin for branch in found for origin in branch]

    return walk(value, readers, [])


SUMS = (_aten.add.Tensor, _aten.sub.Tensor)
