"""Contractions with a weight matrix, however they are spelled, written as the linear they compute.

A linear layer is a contraction of one dim of an activation with one dim of a 2-D parameter,
the other dim of the parameter taking its place. Code spells it many ways: ``nn.Linear``,
``x @ W.T``, ``torch.einsum("bsd,od->bso", x, W)``, ``torch.einsum("...i,io->...o", x, W)``,
``torch.tensordot(x, W, dims=([2], [1]))``, or over a dim that is not the last one
(``einsum("bdn,od->bon", x, W)`` on a channels-first map). ``torch.export`` keeps ``einsum`` and
``tensordot`` as single ops, so discover, which knows ``linear`` and ``matmul``, would see none of
them, and every weight read that way would stay whole over tp.

A broadcast ``matmul`` with a stacked parameter read whole (per-head weights ``W [heads, d, o]``:
``(x.unsqueeze(-2) @ W).squeeze(-2)``) is an ``einsum`` whose batch letter the parameter shares
with the activation; written as one, the layout rules cut the parameter on that letter where the
activation is cut, as they do an ``einsum`` the code wrote. (A ``bmm`` of a whole stack is left to
:mod:`autoshard.passes.experts`, which reads it as experts on the batch dim.)

The same holds for a convolution whose kernel is a 2-D parameter viewed as ``[out, in, 1, ...]``
(``F.conv2d(x, W[:, :, None, None], b)``: a pointwise projection over channels, a linear over
dim 1), and for a lookup written as an index (``W[ids]`` with ``W`` a 2-D parameter), which is
``F.embedding(ids, W)``: each is rewritten into the op discover reads.

So before discover every such contraction is rewritten into the one spelling discover reads:
the activation permuted to put the contracted dim last, ``linear(x, W)`` (``W [out, in]``) or
``matmul(x, W)`` (``W [in, out]``), and the result permuted to the order the code asked for.
The rule is what the op does to dims, read from its subscripts, not from how it is written: an
operand that is a 2-D parameter (or a dtype cast of one), one of whose dims is summed against
exactly one dim of the other operand while its other dim appears in the output alone, and every
other dim of the activation carried to the output unchanged. Anything else (a second contracted
dim, a dim of the weight broadcast against the activation, a diagonal) is left as it is: it is
not a linear layer, and the layout rules judge it as the op it is.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.passes.partition import made_node

aten = torch.ops.aten

_CASTS = (aten._to_copy.default, aten.to.dtype)


def einsum_subscripts(equation: str, ndims: list[int]) -> tuple[list[list[str]], list[str]]:
    """Each operand's subscripts and the output's, for ``einsum(equation, operands of ndims)``: ``...``
    spelled as one subscript per dim (``...0``, ``...1``: aligned from the right, as broadcasting
    aligns them), an implicit output (no ``->``) as einsum forms it."""
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    ins = lhs.split(",")
    ellipsis = max((nd - len(sub) + 3 for sub, nd in zip(ins, ndims, strict=False) if "..." in sub), default=0)

    def spell(sub: str, nd: int) -> list[str]:
        if "..." not in sub:
            return list(sub)
        head, tail = sub.split("...")
        n = nd - len(head) - len(tail)
        return list(head) + [f"...{i}" for i in range(ellipsis - n, ellipsis)] + list(tail)

    subs = [spell(sub, nd) for sub, nd in zip(ins, ndims, strict=False)]
    if arrow:
        out = spell(rhs, ellipsis + len(rhs) - 3) if "..." in rhs else list(rhs)
    else:
        letters = [c for sub in ins for c in sub.replace("...", "")]
        out = [f"...{i}" for i in range(ellipsis)] + sorted(c for c in set(letters) if letters.count(c) == 1)
    return subs, out


def contractions_as_linears(gm: fx.GraphModule, param_shapes: dict[str, tuple[int, ...]]) -> list[fx.Node]:
    """Rewrite every ``einsum``/``tensordot``/pointwise convolution that is a linear layer, and every
    lookup by index into a 2-D parameter (see the module docstring), in place; returns the new
    ``linear``/``matmul``/``embedding`` nodes."""
    graph, made = gm.graph, []
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target == aten.index.Tensor and _lookup(node, param_shapes):
            with graph.inserting_before(node):
                lookup = made_node(graph, aten.embedding.default, (node.args[0], node.args[1][0]), node,
                                   node.meta["val"])
            node.replace_all_uses_with(lookup)
            graph.erase_node(node)
            made.append(lookup)
            continue
        if node.target == aten.matmul.default or (node.target == aten.bmm.default and _batch_from_features(node)):
            # a bmm whose batch dim came from the rows is an expert site (passes.experts)
            written = _batched_as_einsum(graph, node, param_shapes)
            if written is not None:
                made.append(written)
                continue
        kernel = _pointwise_kernel(node, param_shapes) if node.target in _CONVOLUTIONS else None
        if kernel is not None:
            made.append(_convolution_as_linear(graph, node, kernel))
            continue
        found = _as_linear(node, param_shapes)
        if found is None:
            continue
        x, weight, contracted, weight_out_first, order = found
        made.append(_rewrite(graph, node, x, weight, contracted, weight_out_first, order))
    if made:
        graph.eliminate_dead_code()
    return made


_CONVOLUTIONS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _batched_as_einsum(graph: fx.Graph, node: fx.Node, param_shapes) -> fx.Node | None:
    """``matmul`` of a value and a parameter of 3 or more dims read whole (as stored, or with
    its dims permuted) as the ``einsum`` it computes, when no batch dim of the parameter broadcasts."""
    a, b = node.args[:2]
    if not all(isinstance(t, fx.Node) and isinstance(t.meta.get("val"), torch.Tensor) for t in (a, b, node)):
        return None
    out = tuple(node.meta["val"].shape)
    shapes = [tuple(t.meta["val"].shape) for t in (a, b)]
    if min(len(sh) for sh in shapes) < 2 or len(out) < 3:
        return None
    batch = len(out) - 2
    letters = list(_LETTERS[:batch])
    n, k, m = _LETTERS[batch:batch + 3]
    subs = []
    for shape, tail in zip(shapes, ((n, k), (k, m)), strict=True):
        own = len(shape) - 2
        if own > batch or any(shape[i] != out[batch - own + i] for i in range(own)):
            return None  # a batch dim that broadcasts: not a plain einsum
        subs.append(letters[batch - own:] + list(tail))
    for at in (1, 0):
        param, term = _param_read(node.args[at], subs[at], param_shapes)
        if param is not None and len(param_shapes[param.target]) >= 3:
            operands = [node.args[0], param] if at == 1 else [param, node.args[1]]
            terms = [subs[0], term] if at == 1 else [term, subs[1]]
            equation = ",".join("".join(t) for t in terms) + "->" + "".join(letters + [n, m])
            with graph.inserting_before(node):
                einsum = made_node(graph, aten.einsum.default, (equation, operands), node, node.meta["val"])
            node.replace_all_uses_with(einsum)
            graph.erase_node(node)
            return einsum
    return None


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_MOVES = (aten.permute.default, aten.transpose.int, aten.t.default)
_SAME_DIMS = (aten.contiguous.default, aten.clone.default, aten.alias.default)


def _batch_from_features(node: fx.Node) -> bool:
    """Whether the batch dim of ``bmm(x, W)`` is a cut of a feature dim: followed back through
    views and moves, ``x``'s dim 0 splits the last dim of the value it was made from (heads of a
    projection's output, ``y.view(b, s, h, d).permute(2, 0, 1, 3).reshape(h, b * s, d)``). Such a
    bmm is a block-diagonal (per-head) product, the ``einsum`` ``hnd,hdo->hno``, which keeps the
    heads' cut; a batch dim split from the rows (``x.view(E, -1, d)`` of tokens sorted by
    expert) is a mixture's experts and stays an expert site."""
    value, dim = node.args[0], 0
    while isinstance(value, fx.Node) and value.op == "call_function":
        if value.target in _SAME_DIMS:
            value = value.args[0]
        elif value.target in _MOVES:
            shape = _static_shape(value)
            if shape is None:
                return False
            value, dim = value.args[0], _moved_order(value, len(shape))[dim]
        elif value.target in _VIEWS or value.target == aten.unflatten.int:
            source = value.args[0]
            dim = _dim_within(_static_shape(source), _static_shape(value), dim)
            if dim is None:
                return False
            value = source
        else:
            break
    shape = _static_shape(value)
    return shape is not None and len(shape) >= 2 and dim == len(shape) - 1 and value is not node.args[0]


def _moved_order(node: fx.Node, nd: int) -> list[int]:
    """For a permute/transpose ``node`` of ``nd`` dims: result dim i is input dim ``order[i]``."""
    if node.target == aten.permute.default:
        return [d % nd for d in node.args[1]]
    first, second = (node.args[1] % nd, node.args[2] % nd) if node.target == aten.transpose.int else (0, 1)
    order = list(range(nd))
    order[first], order[second] = order[second], order[first]
    return order


def _static_shape(value) -> tuple[int, ...] | None:
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape):
        return None
    return tuple(val.shape)


def _dim_within(source: tuple | None, result: tuple | None, dim: int) -> int | None:
    """The dim of ``source`` that the view's ``result`` dim ``dim`` is (or is a factor of), if any."""
    if source is None or result is None:
        return None
    before = 1
    for d in range(dim):
        before *= result[d]
    after = before * result[dim]
    start = 1
    for i, size in enumerate(source):
        if start <= before and after <= start * size and (start * size) % after == 0 and before % start == 0:
            return i
        start *= size
    return None


def _param_read(value: fx.Node, subs: list[str], param_shapes) -> tuple[fx.Node | None, list[str]]:
    """The parameter ``value`` reads whole through transposes, and its own subscripts for ``subs``."""
    while value.op == "call_function" and value.target in _MOVES:
        nd = len(subs)
        order = _moved_order(value, nd)
        before = [""] * nd
        for i, d in enumerate(order):
            before[d] = subs[i]
        subs, value = before, value.args[0]
    if value.op == "get_attr" and value.target in param_shapes:
        return value, subs
    return None, subs


def _lookup(node: fx.Node, param_shapes) -> bool:
    """``W[ids]``: one integer index tensor into dim 0 of a 2-D parameter."""
    table, indices = node.args[0], node.args[1]
    return (isinstance(table, fx.Node) and table.op == "get_attr" and len(param_shapes.get(table.target, ())) == 2
            and len(indices) == 1 and isinstance(indices[0], fx.Node)
            and isinstance(indices[0].meta.get("val"), torch.Tensor)
            and not indices[0].meta["val"].is_floating_point() and indices[0].meta["val"].dtype != torch.bool)


def _pointwise_kernel(node: fx.Node, param_shapes) -> fx.Node | None:
    """The 2-D parameter a convolution's kernel views as ``[out, in, 1, ...]``, when the convolution
    has stride 1, no padding, no dilation and one group: a linear over the channel dim."""
    x, kernel = node.args[0], node.args[1]
    rest = list(node.args[3:]) + [None] * (4 - len(node.args[3:]))
    stride, padding, dilation, groups = rest[:4]
    if not (isinstance(kernel, fx.Node) and isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)):
        return None
    if any(s not in (None, 1) for s in _ints(stride)) or any(p not in (None, 0) for p in _ints(padding)) \
            or any(d not in (None, 1) for d in _ints(dilation)) or groups not in (None, 1) or node.kwargs:
        return None
    source = kernel
    while source.op == "call_function" and source.target == aten.unsqueeze.default:
        source = source.args[0]
    shape = tuple(kernel.meta["val"].shape) if isinstance(kernel.meta.get("val"), torch.Tensor) else ()
    if source is kernel or source.op != "get_attr" or len(param_shapes.get(source.target, ())) != 2:
        return None
    if shape[:2] != tuple(param_shapes[source.target]) or any(d != 1 for d in shape[2:]):
        return None
    return source


def _ints(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _convolution_as_linear(graph: fx.Graph, node: fx.Node, weight: fx.Node) -> fx.Node:
    """``conv(x, W[..., None], b)`` as ``linear(x.movedim(1, -1), W, b).movedim(-1, 1)``, made contiguous."""
    x, bias = node.args[0], node.args[2] if len(node.args) > 2 else None
    nd = x.meta["val"].dim()
    return _rewrite(graph, node, x, weight, 1, True, [0, nd - 1, *range(1, nd - 1)], bias)


def _weight(arg, param_shapes) -> bool:
    """``arg`` reads a 2-D parameter as it is stored, or through one dtype cast used only here."""
    if not isinstance(arg, fx.Node):
        return False
    if arg.target in _CASTS and len(arg.users) == 1 and isinstance(arg.args[0], fx.Node) \
            and set(arg.kwargs) <= {"dtype"}:
        arg = arg.args[0]
    return arg.op == "get_attr" and len(param_shapes.get(arg.target, ())) == 2


def _as_linear(node: fx.Node, param_shapes):
    """``(x, weight, x's contracted dim, whether the weight is [out, in], output order)`` when
    ``node`` is a linear layer: ``order`` lists, for each output dim, the dim of
    ``linear(x moved, W)`` that holds it."""
    if node.target == aten.einsum.default:
        equation, operands = node.args[0], node.args[1]
        if not isinstance(equation, str) or len(operands) != 2 or not all(isinstance(t, fx.Node) for t in operands):
            return None
        if not all(isinstance(t.meta.get("val"), torch.Tensor) for t in operands):
            return None
        subs, out = einsum_subscripts(equation, [t.meta["val"].dim() for t in operands])
        for w_at in (1, 0):
            if _weight(operands[w_at], param_shapes):
                found = _einsum_linear(subs[1 - w_at], subs[w_at], out)
                if found is not None:
                    return (operands[1 - w_at], operands[w_at], *found)
        return None
    if node.target == aten.tensordot.default:
        a, b, dims_a, dims_b = node.args[:4]
        if len(dims_a) != 1 or len(dims_b) != 1 or not all(isinstance(t, fx.Node) for t in (a, b)):
            return None
        for x, w, dx, dw, w_first in ((a, b, dims_a[0], dims_b[0], False), (b, a, dims_b[0], dims_a[0], True)):
            if not _weight(w, param_shapes) or not isinstance(x.meta.get("val"), torch.Tensor):
                continue
            nd = x.meta["val"].dim()
            xs = [f"x{i}" for i in range(nd)]
            ws = ["w0", "w1"]
            ws[dw % 2] = xs[dx % nd]
            n = ws[1 - dw % 2]
            kept = [s for s in xs if s != xs[dx % nd]]
            out = [n, *kept] if w_first else [*kept, n]
            return (x, w, *_einsum_linear(xs, ws, out))
        return None
    return None


def _einsum_linear(x_subs: list[str], w_subs: list[str], out: list[str]):
    """For subscripts ``x, W -> out``: ``(x's contracted dim, W is [out, in], order)`` when they
    compute a linear layer over one dim of ``x``, else None."""
    if len(w_subs) != 2 or len(set(w_subs)) != 2 or len(set(x_subs)) != len(x_subs) or len(set(out)) != len(out):
        return None
    contracted = [s for s in w_subs if s in x_subs]
    if len(contracted) != 1:
        return None
    (c,) = contracted
    (n,) = [s for s in w_subs if s != c]
    if c in out or n not in out:
        return None
    kept = [s for s in x_subs if s != c]
    if sorted(out) != sorted([*kept, n]):
        return None  # a dim of x summed away besides the contracted one, or a letter from nowhere
    computed = [*kept, n]
    return x_subs.index(c), w_subs[0] == n, [computed.index(s) for s in out]


def _rewrite(graph: fx.Graph, node: fx.Node, x: fx.Node, weight: fx.Node, contracted: int,
             weight_out_first: bool, order: list[int], bias: fx.Node | None = None) -> fx.Node:
    """``node`` replaced by the linear over ``x``'s dim ``contracted`` (its output dims put in
    ``order``), plus ``bias`` (a ``[out, in]`` weight's)."""
    x_val, out_val = x.meta["val"], node.meta["val"]
    nd = x_val.dim()
    to_last = [d for d in range(nd) if d != contracted] + [contracted]
    inverse = [order.index(d) for d in range(len(order))]
    with graph.inserting_before(node):
        rows = x
        if to_last != list(range(nd)):
            rows = made_node(graph, aten.permute.default, (x, to_last), node, x_val.permute(to_last))
        target = aten.linear.default if weight_out_first else aten.matmul.default
        computed = out_val.permute(inverse).contiguous()
        linear = made_node(graph, target, (rows, weight) if bias is None else (rows, weight, bias), node, computed)
        result = linear
        if order != list(range(len(order))):  # made contiguous, as einsum's result is: code may view it
            moved = made_node(graph, aten.permute.default, (linear, order), node, computed.permute(order))
            result = made_node(graph, aten.clone.default, (moved,), node, out_val)
            result.kwargs = {"memory_format": torch.contiguous_format}
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    return linear


