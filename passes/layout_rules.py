"""Layout rules: how a tp sharding flows through one ATen op.

``apply(node, input_layouts, tp)`` returns a :class:`Decision` (the output's
layout, the layout each input must have, rewritten shape arguments) or
``None`` when the op has no rule for these layouts; the caller then gathers the
sharded inputs, which is always correct.

A layout is ``None`` (replicated) or ``d`` (sharded along dim ``d`` in ``tp``
equal contiguous chunks). Multi-output ops give a tuple of layouts. Rules read
global shapes from ``meta["val"]``; a view's shape argument is rewritten to the
local size by dividing the sharded entry by ``tp``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import operator

import sympy
import torch
import torch.fx as fx

from autoshard.passes.contractions import einsum_subscripts
from autoshard.runtime.context_ops import CP_ALL_REDUCE, CP_CAUSAL_ATTENTION, CP_GATHER
from autoshard.runtime.whole_sections import FUSED_SPLIT

aten = torch.ops.aten

class Partial(enum.Enum):
    """The layout of a value each tp rank holds a share of: a summand of its sum over ranks
    (``SUM``), or of its mean (``AVG``: a mean over the sharded dim)."""

    SUM = "partial"
    AVG = "partial_avg"

    def __str__(self) -> str:
        return self.value


PARTIAL, PARTIAL_AVG = Partial.SUM, Partial.AVG
PARTIALS = (PARTIAL, PARTIAL_AVG)


@dataclasses.dataclass(frozen=True)
class Strided:
    """DTensor's ``_StridedShard``: dim ``dim`` is ``split_factor`` runs, each cut in
    ``tp`` contiguous chunks (heads flattened into the batch: ``[b, h/tp] -> [b*h/tp]``)."""

    dim: int
    split_factor: int

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"


# The layout of a value over the tp ranks: None (replicated), a dim (sharded on it, in equal
# contiguous chunks), a Partial share, a Strided dim, or one layout per output of a multi-output op.
Layout = None | int | Partial | Strided | tuple


@dataclasses.dataclass(frozen=True)
class Decision:
    """``fused_sections``: the op splits a colwise output along its sharded dim into
    these (global) sections; valid only once the producing weight's columns are
    permuted so that every rank holds its share of each section (see propagate).
    ``whole_sections``: those of them every rank holds whole instead (k/v heads fewer than
    tp); ``section_runs``: the weight's columns the sections read, in order (``fused_split``)."""

    output: object
    inputs: dict
    args: tuple | None = None
    fused_sections: tuple[int, ...] | None = None
    whole_sections: tuple[int, ...] = ()
    section_runs: tuple[int, ...] = ()


ATTENTIONS = (
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    CP_CAUSAL_ATTENTION,
)


def apply(node: fx.Node, layouts: dict[fx.Node, object], tp: int) -> Decision | None:
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        src, index = node.args
        lay = layouts[src]
        return Decision(lay[index] if isinstance(lay, tuple) else lay, {src: lay})
    lays = layouts.values()
    if any(isinstance(lay, Strided) for lay in lays) and not any(lay in PARTIALS for lay in lays):
        found = _strided_alike(node, layouts, tp)
        if found is not None:
            return found
    if any(lay in PARTIALS or isinstance(lay, Strided) for lay in layouts.values()):
        return (_split_reduced(node, layouts) or _partial_plus_zero(node, layouts, tp)
                or _partials_cat(node, layouts) or _partial_into_zeros(node, layouts)
                or _statistic_reduced(node, layouts, tp))  # the rest: DTensor's
    for ops, rule in _RULES:
        if node.target in ops:
            return rule(node, layouts, tp)
    if is_pointwise(node.target):
        return _pointwise(node, layouts, tp)
    return None


def _strided_alike(node, layouts, tp):
    """An op that keeps each value of its sharded dim apart (elementwise, a reduction or a norm over
    other dims) on values cut ``Strided`` alike (heads folded into rows, ``[b*s*h, d]``, as gated
    DeltaNet's output norm reads them): the rule for a plain cut of that dim, with the runs kept."""
    strided = {lay for lay in layouts.values() if lay is not None}
    if len(strided) != 1:
        return None
    (lay,) = strided
    if not isinstance(lay, Strided):
        return None
    rule = (_pointwise if is_pointwise(node.target) or node.target in ELEMENTWISE_LIKE
            else _STRIDED_RULES.get(node.target))
    if rule is None:
        return None
    as_dims = {value: (None if v is None else lay.dim) for value, v in layouts.items()}
    if rule is _pointwise and any(v is not None and _ndim(value) != _ndim(node) for value, v in as_dims.items()):
        return None  # the runs are counted in the input's dims: keep the rank
    decision = rule(node, as_dims, tp)
    if decision is None or not isinstance(decision.output, int) or decision.args is not None:
        return None
    runs = lay.split_factor
    return Decision(Strided(decision.output, runs),
                    {value: None if d is None else Strided(d, runs) for value, d in decision.inputs.items()})


# --- helpers ------------------------------------------------------------------


def size_expr(size) -> sympy.Expr:
    """A dim size as a sympy expression: batch and sequence are symbols when the
    graph was captured with dynamic shapes, every other size an integer."""
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


def divides(size: sympy.Expr, tp: int) -> bool:
    """``tp`` divides ``size`` for every value its symbols may take."""
    return sympy.Mod(size, tp) == 0


def _shape(value) -> tuple[sympy.Expr, ...]:
    return tuple(size_expr(n) for n in value.meta["val"].shape)


def is_pointwise(target) -> bool:
    """An ATen overload tagged pointwise (elementwise, broadcasting)."""
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def _ndim(value) -> int:
    return value.meta["val"].dim()


def _norm(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def _sharded(layouts) -> dict:
    return {v: lay for v, lay in layouts.items() if lay is not None}


def _single_sharded_input(node, layouts):
    """(value, dim) when exactly the first tensor argument is sharded, else None."""
    sharded = _sharded(layouts)
    first = node.args[0]
    if len(sharded) != 1 or first not in sharded or isinstance(sharded[first], tuple):
        return None
    return first, sharded[first]


# --- elementwise --------------------------------------------------------------


def _pointwise(node, layouts, tp):
    """Broadcasting elementwise op: every sharded input lands on one output dim,
    and no replicated input spans that dim (size 1 or absent broadcasts fine)."""
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return None
    out_shape = _shape(node)
    out_ndim = len(out_shape)
    out_dim = None
    for value, lay in layouts.items():
        if lay is None:
            continue
        if isinstance(lay, tuple):
            return None
        dim = lay + out_ndim - _ndim(value)
        if out_dim not in (None, dim) or _shape(value)[lay] != out_shape[dim]:
            return None
        out_dim = dim
    for value, lay in layouts.items():
        if lay is None and isinstance(value.meta.get("val"), torch.Tensor):
            shape = _shape(value)
            in_dim = out_dim - (out_ndim - len(shape))
            if in_dim >= 0 and shape[in_dim] != 1:
                return None
    return Decision(out_dim, dict(layouts))


def _dropout_like(node, layouts, tp):
    found = _single_sharded_input(node, layouts)
    if found is None:
        return None
    value, dim = found
    out = (dim, dim) if isinstance(node.meta.get("val"), (tuple, list)) else dim
    return Decision(out, dict(layouts))


_ZEROS = (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)


SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)


def _split_reduced(node, layouts):
    """A partial sum split into pieces is reduced once, before the split, not once per piece
    (Mamba's ``x_proj`` output split into step size, B and C)."""
    if node.target not in SPLITS or layouts.get(node.args[0]) not in PARTIALS or len(layouts) != 1:
        return None
    val = node.meta.get("val")
    return Decision(tuple(None for _ in val), {node.args[0]: None})


def _statistic_reduced(node, layouts, tp):
    """``x - mean(x)`` over a cut width (a layer norm's centring, as written out by
    ``decompose_norm``): the mean is reduced, ``x`` stays cut. DTensor would rather gather ``x``.
    Only this form: elsewhere a partial next to a cut value is left to DTensor's costs."""
    if node.target != aten.sub.Tensor or len(node.args) != 2:
        return None
    x, mean = node.args
    if not (isinstance(mean, fx.Node) and mean.target == aten.mean.dim and mean.args[0] is x
            and layouts.get(mean) in PARTIALS and isinstance(layouts.get(x), int)):
        return None
    return _pointwise(node, {x: layouts[x], mean: None}, tp)


def _replicated_zeros(node, layouts) -> bool:
    """A replicated tensor of zeros made for an accumulation (``zeros``, ``zeros_like``, ``new_zeros``)."""
    return isinstance(node, fx.Node) and node.target in _ZEROS and layouts.get(node) is None


def _partials_cat(node, layouts):
    """A cat of partial sums is the partial sum of the cat (JetMoE's experts: each expert's
    rowwise output on its rows, concatenated): one reduction after it, not one per piece."""
    if node.target != aten.cat.default:
        return None
    tensors = [t for t in node.args[0] if isinstance(t, fx.Node)]
    if len(tensors) != len(node.args[0]) or {layouts.get(t) for t in tensors} != {PARTIAL}:
        return None
    return Decision(PARTIAL, {t: PARTIAL for t in tensors})


def _partial_into_zeros(node, layouts):
    """``zeros.index_add(dim, index, partial)`` is partial: rows of partial sums added into zeros
    (experts' outputs summed back per token) are each rank's share of the total."""
    if node.target != aten.index_add.default or len(node.args) < 4 or node.kwargs.get("alpha", 1) != 1:
        return None
    zero, _, index, source = node.args[:4]
    if _replicated_zeros(zero, layouts) and layouts.get(index) is None and layouts.get(source) == PARTIAL:
        return Decision(PARTIAL, {zero: None, index: None, source: PARTIAL})
    return None


def _partial_plus_zero(node, layouts, tp):
    """``zeros + partial`` is partial: a replicated zero adds nothing to the sum
    (an accumulator started with ``torch.zeros_like`` and summed over experts)."""
    if node.target != aten.add.Tensor or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args
    for zero, partial in ((a, b), (b, a)):
        if _replicated_zeros(zero, layouts) and layouts.get(partial) == PARTIAL and _shape(zero) == _shape(node):
            return Decision(PARTIAL, {zero: None, partial: PARTIAL})
    return None


# --- views --------------------------------------------------------------------


def _map_reshape(in_shape, out_shape, dim, tp) -> int | None:
    """Output dim carrying a sharding of input ``dim`` through a reshape, if any.

    Dims are grouped into the smallest runs with equal products. The sharded
    dim must be the outermost non-trivial dim of its input run, and the
    outermost non-trivial dim of the matching output run must divide by ``tp``;
    then each rank's contiguous chunk of the run is again a contiguous chunk.
    """
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        i0, j0 = i, j
        p_in = p_out = 1
        if i < len(in_shape):
            p_in *= in_shape[i]
            i += 1
        if j < len(out_shape):
            p_out *= out_shape[j]
            j += 1
        while p_in != p_out:
            grow_in = _smaller(p_in, p_out)
            if grow_in is None:
                return None
            if grow_in and i < len(in_shape):
                p_in *= in_shape[i]
                i += 1
            elif not grow_in and j < len(out_shape):
                p_out *= out_shape[j]
                j += 1
            else:
                return None
        # absorb trailing size-1 dims into neither run: they map trivially
        if i0 <= dim < i:
            lead_in = [k for k in range(i0, i) if in_shape[k] != 1]
            lead_out = [k for k in range(j0, j) if out_shape[k] != 1]
            if not lead_in or lead_in[0] != dim or not lead_out:
                return None
            target = lead_out[0]
            return target if divides(out_shape[target], tp) else None
    return None


def _smaller(a: sympy.Expr, b: sympy.Expr) -> bool | None:
    """Whether ``a`` is the smaller of two products of dims (it divides ``b``), None if neither divides."""
    num, den = sympy.fraction(sympy.cancel(b / a))
    if den == 1 and num != 1:
        return True
    num, den = sympy.fraction(sympy.cancel(a / b))
    if den == 1 and num != 1:
        return False
    return None


def _local_shape_arg(arg, dim, tp):
    """``arg`` (a size list) with entry ``dim`` shrunk to its local size."""
    sizes = list(arg)
    entry = sizes[dim]
    if isinstance(entry, int):
        if entry != -1:
            sizes[dim] = entry // tp
        return sizes
    return None  # symbolic size on the sharded dim


def _reshape(node, layouts, tp):
    found = _single_sharded_input(node, layouts)
    if found is None:
        return None
    value, dim = found
    out_dim = _map_reshape(_shape(value), _shape(node), dim, tp)
    sections = None
    if out_dim is None:
        out_dim, sections = _fused_reshape(_shape(value), _shape(node), dim, tp, _projected_width(value))
    if out_dim is None:
        return _folded_reshape(node, value, dim, tp)
    args = None
    if node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        sizes = _local_shape_arg(node.args[1], out_dim, tp)
        if sizes is None:
            return None
        args = (node.args[0], sizes, *node.args[2:])
    elif node.target == aten.unflatten.int:
        start = _norm(node.args[1], _ndim(value))
        if start <= out_dim < start + len(node.args[2]):
            sizes = _local_shape_arg(node.args[2], out_dim - start, tp)
            if sizes is None:
                return None
            args = (value, node.args[1], sizes)
    if sections is not None and args is None:
        return None
    return Decision(out_dim, {value: dim}, args, sections)


def _folded_reshape(node, value, dim, tp):
    """A cut dim ``S`` whose outer part ``h`` (heads) is folded into the rows before it:
    ``gate.reshape(-1, head_dim)`` of ``[b, s, h * d]`` is ``[b * s * h, d]``, rows in
    ``b * s`` runs of ``h``, each run cut over tp (``Strided``), as DTensor folds a
    ``[b, s, h, d]`` whose heads are cut. ``h`` must divide by tp."""
    in_shape, out_shape = _shape(value), _shape(node)
    if node.target not in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return None
    if not all(size.is_Integer for size in (*in_shape, *out_shape)):
        return None
    before, size = math.prod(int(x) for x in in_shape[:dim]), int(in_shape[dim])
    after = math.prod(int(x) for x in in_shape[dim + 1:])
    lead = 1
    for j, out in enumerate(int(x) for x in out_shape):
        if before % lead == 0 and (lead * out) % before == 0 and lead * out > before:
            heads, runs = lead * out // before, before // lead
            rest = math.prod(int(x) for x in out_shape[j + 1:])
            if runs < 2 or size % heads or heads % tp or rest != size // heads * after:
                return None
            sizes = _local_shape_arg(node.args[1], j, tp)
            return None if sizes is None else Decision(Strided(j, runs), {value: dim}, (value, sizes, *node.args[2:]))
        lead *= out
    return None


def _projected_width(value: fx.Node):
    """The last dim of the input a projection ``value`` reads (``None`` for any other op)."""
    if (value.op != "call_function" or not value.args or not isinstance(value.args[0], fx.Node)
            or not isinstance(value.args[0].meta.get("val"), torch.Tensor)):  # a split's pieces: no projection
        return None
    shape = _shape(value.args[0])
    return shape[-1] if shape else None


def _fused_reshape(in_shape, out_shape, dim, tp, projected_width=None) -> tuple[int | None, tuple[int, ...] | None]:
    """A fused projection's sharded output dim unflattened into ``(sections, heads, ...)``, as
    vision code splits q|k|v: ``qkv(x).reshape(B, N, 3, H, hd)``.

    The sharded dim ``S`` must map alone to output dims ``(k, h, d, ...)``, or ``(k, w)`` with
    ``w`` the projection's input width, with ``k >= 2`` sections of ``S / k`` and ``h`` (or
    ``w``) dividing by tp. With the projection's columns stored
    section by section per rank (its fused sections, as for a ``split``), each rank's
    ``S / tp`` columns are ``k`` runs of ``S / (k * tp)``: locally ``(k, h / tp, ...)``.
    Returns the output dim tp then cuts (``h``'s) and the sections, or ``(None, None)``.
    """
    size = in_shape[dim]
    if not size.is_Integer:
        return None, None
    before = sympy.Mul(*in_shape[:dim])
    j, product = 0, sympy.Integer(1)
    while j < len(out_shape) and product != before:
        product *= out_shape[j]
        j += 1
    if sympy.simplify(product - before) != 0:
        return None, None
    run, product = [], sympy.Integer(1)
    while j < len(out_shape) and product != size:
        product *= out_shape[j]
        run.append(j)
        j += 1
    dims = [d for d in run if out_shape[d] != 1]
    # (sections, heads, head_dim); or (sections, width) when each section is as wide as the
    # projection's input, as torch's MultiheadAttention unflattens its packed in_proj
    # (``unflatten(-1, (3, E))``, the heads split from each section later). A plain
    # (heads, head_dim) view is not a fusion: cutting the head dim of kv heads fewer than tp
    # would spread heads over ranks
    pair = len(dims) == 2 and projected_width is not None and sympy.simplify(out_shape[dims[1]] - projected_width) == 0
    if product != size or (len(dims) < 3 and not pair) or not out_shape[dims[0]].is_Integer:
        return None, None
    k, heads = int(out_shape[dims[0]]), dims[1]
    if k < 2 or not divides(out_shape[heads], tp) or (int(size) // k) % tp:
        return None, None
    return heads, (int(size) // k,) * k


def _complex_view(node, layouts, tp):
    found = _single_sharded_input(node, layouts)
    if found is None:
        return None
    value, dim = found
    if dim >= min(_ndim(value), _ndim(node)) - (node.target == aten.view_as_complex.default):
        return None  # the last (real/imag pair) dim is never sharded here
    return Decision(dim, {value: dim})


def _expand(node, layouts, tp):
    found = _single_sharded_input(node, layouts)
    if found is None:
        return None
    value, dim = found
    out_dim = dim + _ndim(node) - _ndim(value)
    sizes = _local_shape_arg(node.args[1], out_dim, tp)
    if sizes is None:
        return None
    return Decision(out_dim, {value: dim}, (value, sizes, *node.args[2:]))


def _expand_as(node, layouts, tp):
    """``x.expand_as(other)`` takes ``other``'s shape as it is on each rank: sharded like
    ``other`` wherever ``x`` broadcasts (size 1 or missing) on that dim, or is cut there too."""
    x, other = node.args[:2]
    dim = layouts.get(other)
    if not isinstance(dim, int):
        return None
    x_dim = dim - (_ndim(other) - _ndim(x))
    if layouts.get(x) is None and (x_dim < 0 or _shape(x)[x_dim] == 1):
        return Decision(dim, {x: None, other: dim})
    if layouts.get(x) is None or layouts.get(x) == x_dim:
        return Decision(dim, {x: x_dim, other: dim})
    return None


def _transpose(node, layouts, tp):
    found = _single_sharded_input(node, layouts)
    if found is None:
        return None
    value, dim = found
    ndim = _ndim(value)
    if node.target == aten.permute.default:
        order = [_norm(d, ndim) for d in node.args[1]]
    else:
        order = list(range(ndim))
        a, b = (0, 1) if node.target == aten.t.default else (_norm(node.args[1], ndim), _norm(node.args[2], ndim))
        if ndim >= 2:
            order[a], order[b] = order[b], order[a]
    return Decision(order.index(dim), {value: dim})


def _slice_like(node, layouts, tp):
    """slice/select/narrow/split/chunk/unbind along a dim other than the sharded one."""
    found = _single_sharded_input(node, layouts)
    if found is None:
        return None
    value, dim = found
    ndim = _ndim(value)
    along = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if node.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        along = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    along = _norm(along, ndim)
    if along == dim:
        return _fused_split(node, value, dim, tp)
    removes_dim = node.target in (aten.select.int, aten.unbind.int)
    out = dim - 1 if removes_dim and along < dim else dim
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        out = tuple(out for _ in val)
    return Decision(out, {value: dim})


def _fused_split(node, value, dim, tp):
    """split/chunk/slices of a fused projection (q|k|v, gate|up) along its sharded dim.

    Each section must divide by tp; ``split``/``chunk`` need equal sections
    (their one size argument), ``split_with_sizes`` takes any, and slices
    count when all readers of the value are slices that tile it.
    """
    size = _shape(value)[dim]
    if not size.is_Integer:
        return None
    size = int(size)
    rest = node.args[2:]
    if node.target == aten.slice.Tensor and (node.args[4] if len(node.args) > 4 else 1) != 1:
        return _strided_slice(node, value, dim, size, tp)
    if node.target == aten.slice.Tensor:
        return _fused_slice(node, value, dim, size, tp)
    if node.target == aten.split_with_sizes.default:
        sections = tuple(node.args[1])
        args = (value, [s // tp for s in sections], *rest)
    elif node.target == aten.split.Tensor and size % node.args[1] == 0:
        sections = (node.args[1],) * (size // node.args[1])
        args = (value, node.args[1] // tp, *rest)
    elif node.target == aten.chunk.default and size % node.args[1] == 0:
        sections = (size // node.args[1],) * node.args[1]
        args = None
    else:
        return None
    if len(sections) < 2 or any(s % tp for s in sections):
        return None
    return Decision(tuple(dim for _ in sections), {value: dim}, args, sections)


def _strided_slice(node, value, dim, size, tp):
    """``x[..., s::k]`` along the cut dim of values interleaved in groups of ``k`` (gpt-oss's
    gate|up pairs: ``gate_up[..., ::2]`` and ``gate_up[..., 1::2]``): when each rank's contiguous
    chunk holds whole groups, its slice from ``s`` by ``k`` is its chunk of those values, in order,
    so the output keeps the cut and the slice reads as it did."""
    start, end = (list(node.args[2:4]) + [None, None])[:2]
    step = node.args[4]
    start = 0 if start is None else start
    if not isinstance(step, int) or not isinstance(start, int) or not 0 <= start < step:
        return None
    if end is not None and (not isinstance(end, int) or end < size):
        return None  # stops before the end: not every group is read
    if size % tp or (size // tp) % step:
        return None
    return Decision(dim, {value: dim})


def _slice_bounds(node, size: int) -> tuple[int, int] | None:
    start, end = (list(node.args[2:4]) + [None, None])[:2]
    step = node.args[4] if len(node.args) > 4 else 1
    if step != 1 or not all(isinstance(b, int) or b is None for b in (start, end)):
        return None
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None or end > size else (end + size if end < 0 else end)
    return start, end


def _fused_slice(node, value, dim, size, tp):
    """``x[..., a:b]`` readers tiling a fused output (Phi-3's q|k|v slices)."""
    tiles = []
    for reader in value.users:
        if reader.target != aten.slice.Tensor or _norm(reader.args[1], _ndim(value)) != dim:
            return None
        bounds = _slice_bounds(reader, size)
        if bounds is None:
            return None
        tiles.append(bounds)
    tiles.sort()
    if tiles[0][0] != 0 or tiles[-1][1] != size or any(a[1] != b[0] for a, b in zip(tiles, tiles[1:], strict=False)):
        return None
    sections = tuple(end - start for start, end in tiles)
    if len(sections) < 2 or any(s % tp for s in sections):
        return None
    start, end = _slice_bounds(node, size)
    return Decision(dim, {value: dim}, (value, node.args[1], start // tp, end // tp), sections)


def _cat(node, layouts, tp):
    """A cat along another dim than the sharded one stays sharded. A replicated input next to
    sharded ones is cut to match: a broadcast over that dim (MLA's shared rotary key,
    ``k_pe.expand(-1, -1, H, -1)``) expands to the local size, any other is cut (a per-head
    attention sink concatenated to the scores, a key cache to new keys): a cut needs no
    communication forward, and one all-gather of its gradient backward if it carries one."""
    tensors = [t for t in node.args[0] if isinstance(t, fx.Node)]
    lays = {layouts.get(t) for t in tensors}
    if any(isinstance(lay, tuple) for lay in lays):
        return None
    sharded = lays - {None}
    if len(sharded) != 1:
        return None
    dim = next(iter(sharded))
    if None in lays and not isinstance(dim, int):
        return None  # partial sums and folded heads: only with every input alike
    along = _norm(node.args[1] if len(node.args) > 1 else 0, _ndim(node))
    if along == dim:
        return _sections_cat(node, tensors, layouts, dim, tp)
    # an empty 1-D tensor, which cat skips (a cache not yet filled), is read as it is
    skipped = {t for t in tensors if _ndim(t) == 1 and _ndim(node) > 1 and _shape(t)[0] == 0}
    if any(layouts.get(t) is None and t not in skipped
           and (_ndim(t) != _ndim(node) or _shape(t)[dim] != _shape(node)[dim]) for t in tensors):
        return None
    return Decision(dim, {t: None if t in skipped else dim for t in tensors})


def _sections_cat(node, tensors, layouts, dim, tp):
    """A cat of sharded values along their sharded dim (Flux's ``cat([attn, mlp], dim=2)``): each rank
    holds its share of each input, side by side, so the result is fused sections, valid for a
    reader that stores its input rows in that order (a rowwise linear; see propagate)."""
    if not isinstance(dim, int) or any(layouts.get(t) != dim for t in tensors) or len(tensors) < 2:
        return None
    sizes = [_shape(t)[dim] for t in tensors]
    if not all(size.is_Integer and int(size) % tp == 0 for size in sizes):
        return None
    return Decision(dim, {t: dim for t in tensors}, fused_sections=tuple(int(size) for size in sizes))


# --- reductions and normalizations ---------------------------------------------


def _reduce(node, layouts, tp):
    """sum/mean/amax... over dims other than the sharded one."""
    found = _single_sharded_input(node, layouts)
    if found is None:
        return None
    value, dim = found
    ndim = _ndim(value)
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None:
        return None
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = {_norm(d, ndim) for d in dims} if dims else set(range(ndim))
    if dim in dims:
        return None
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    out = dim if keepdim else dim - sum(1 for d in dims if d < dim)
    return Decision(out, {value: dim})


def _softmax(node, layouts, tp):
    found = _single_sharded_input(node, layouts)
    if found is None:
        return None
    value, dim = found
    if _norm(node.args[1], _ndim(value)) == dim:
        return None
    return Decision(dim, {value: dim})


def _norm_over_last(node, layouts, tp):
    """rms_norm / layer_norm normalize trailing dims; a sharded leading dim (heads,
    as in q/k norms) passes, its weight and bias span only the trailing dims."""
    found = _single_sharded_input(node, layouts)
    if found is None:
        return None
    value, dim = found
    ndim = _ndim(value)
    if dim >= ndim - len(node.args[1]):
        return None
    val = node.meta["val"]
    out = tuple(dim for _ in val) if isinstance(val, (tuple, list)) else dim
    return Decision(out, dict(layouts))


def _triangle(node, layouts, tp):
    """tril / triu keep a triangle of the last two dims; a cut leading dim (heads of chunked decay
    masks, as gated DeltaNet builds them) passes. DTensor replicates them."""
    found = _single_sharded_input(node, layouts)
    if found is None or found[1] >= _ndim(found[0]) - 2:
        return None
    return Decision(found[1], {found[0]: found[1]})


# --- attention and batched matmul ----------------------------------------------


def _attention(node, layouts, tp):
    """SDPA on [..., heads, seq, head_dim]: q, k, v sharded on the heads dim
    (GQA keeps its ratio when both head counts divide by tp), or k/v of one head
    broadcast over q's heads and read whole; the mask must broadcast over heads
    or be sharded the same way."""
    q, k, v = node.args[:3]
    heads = _ndim(q) - 3
    if heads < 0 or layouts.get(q) != heads:
        return None
    wanted = {}
    for t in (k, v):  # k/v computed whole (fewer heads than tp) are cut like q: as many heads
        if layouts.get(t) is None and _shape(t)[-3] == 1:
            wanted[t] = None  # one kv head broadcast over the q heads (multi-query): read whole
        elif layouts.get(t) != heads and (layouts.get(t) is not None or _shape(t)[-3] != _shape(q)[-3]):
            return None
        else:
            wanted[t] = heads
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, fx.Node):
        m_lay = layouts.get(mask)
        m_dim = heads - (_ndim(q) - _ndim(mask))
        if m_lay is None and m_dim >= 0 and _shape(mask)[m_dim] != 1:
            return None
        if m_lay is not None and m_lay != m_dim:
            return None
    val = node.meta["val"]
    out = tuple(heads if isinstance(t, torch.Tensor) and t.dim() > heads else None for t in val) if isinstance(
        val, (tuple, list)
    ) else heads
    return Decision(out, {**layouts, **wanted})


def _batched_matmul(node, layouts, tp):
    """a @ b between activations, sharded on a shared batch dim (heads in manual
    attention), on a's rows with b replicated, or on the contracted dim (per-head scores weighted
    and summed over heads, ``w[..., 1, h] @ s[..., h, t]``): a replicated operand is cut to match
    (a local slice) and each rank's partial sum is reduced once where it is read, instead of the
    cut operand gathered."""
    a, b = node.args[:2]
    la, lb = layouts.get(a), layouts.get(b)
    na, nb, no = _ndim(a), _ndim(b), _ndim(node)
    if na < 2 or nb < 2:
        return None
    if la is not None and la < na - 2 and lb is not None and lb < nb - 2:
        oa, ob = la + no - na, lb + no - nb
        return Decision(oa, {a: la, b: lb}) if oa == ob else None
    if la == na - 2 and lb is None:
        return Decision(no - 2, {a: la, b: None})
    if {la, lb} - {None} and la in (None, na - 1) and lb in (None, nb - 2):
        return Decision(PARTIAL, {a: na - 1, b: nb - 2})  # the contracted dim cut: each rank's share of the sum
    return None


def einsum_terms(node: fx.Node) -> tuple[list[list[str]], list[str], list[fx.Node]] | None:
    """An ``einsum`` node's input terms, output term (each a list of subscripts, ``...`` spelled as
    one subscript per dim it stands for) and operands."""
    equation, operands = node.args[0], node.args[1]
    if not isinstance(equation, str) or not all(isinstance(t, fx.Node) for t in operands):
        return None
    if len(equation.replace(" ", "").partition("->")[0].split(",")) != len(operands):
        return None
    terms, output = einsum_subscripts(equation, [_ndim(t) for t in operands])
    if any(len(term) != _ndim(t) for term, t in zip(terms, operands, strict=True)):
        return None
    return terms, output, list(operands)


def _einsum(node, layouts, tp):
    """``einsum`` with one letter cut: every operand that has the letter is cut on it (a replicated
    one is cut to match), the others are read whole, and the letter stays in the output (heads
    or batch, as Mamba-2's chunked scan and ProphetNet's attention use them). A cut letter summed
    away is left to DTensor."""
    parsed = einsum_terms(node)
    if parsed is None:
        return None
    terms, output, operands = parsed
    letters = {terms[i][lay] for i, t in enumerate(operands) if isinstance(lay := layouts.get(t), int)}
    if len(letters) != 1 or any(isinstance(layouts.get(t), tuple) for t in operands):
        return None
    (letter,) = letters
    if letter not in output:
        return None
    wanted = {}
    for term, t in zip(terms, operands, strict=True):
        lay = layouts.get(t)
        if letter in term:
            at = term.index(letter)
            if (lay is not None and lay != at) or _shape(t)[at] != _shape(node)[output.index(letter)]:
                return None  # cut elsewhere, or a size-1 dim einsum broadcasts
            wanted[t] = at
        elif lay is not None:
            return None
        else:
            wanted[t] = None
    return Decision(output.index(letter), wanted)


def _sections(node, layouts, tp):
    """``fused_split`` of a colwise output (see :mod:`autoshard.passes.sections`): a section with
    whole heads on every rank is cut over tp, the others are computed whole on every rank. Each
    rank's output then holds its share of each cut section and all of each whole one, in order."""
    found = _single_sharded_input(node, layouts)
    x, runs, sizes, heads = node.args
    if found is None or found[1] != _ndim(x) - 1:
        return None
    cut = [size % tp == 0 and count % tp == 0 for size, count in zip(sizes, heads, strict=True)]
    if not any(cut):
        return None
    local = [size // tp if c else size for size, c in zip(sizes, cut, strict=True)]
    local_heads = [count // tp if c else count for count, c in zip(heads, cut, strict=True)]
    return Decision(
        tuple(found[1] if c else None for c in cut), {x: found[1]}, (x, [0, sum(local)], local, local_heads),
        fused_sections=tuple(sizes), whole_sections=tuple(i for i, c in enumerate(cut) if not c),
        section_runs=tuple(runs),
    )


CONVOLUTIONS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default)


@dataclasses.dataclass(frozen=True)
class Convolution:
    """A convolution node's operands as its overload spells them (``convolution`` puts
    ``transposed`` and ``output_padding`` before ``groups``)."""

    input: object
    weight: object
    bias: object
    groups: object
    transposed: bool
    groups_position: int

    @classmethod
    def of(cls, node: fx.Node) -> Convolution | None:
        if node.op != "call_function" or node.target not in CONVOLUTIONS or len(node.args) < 2:
            return None
        general = node.target == aten.convolution.default
        position = 8 if general else 6
        return cls(
            input=node.args[0], weight=node.args[1],
            bias=node.args[2] if len(node.args) > 2 else node.kwargs.get("bias"),
            groups=node.args[position] if len(node.args) > position else node.kwargs.get("groups", 1),
            transposed=bool(general and node.args[6]), groups_position=position,
        )

    @property
    def channels_per_group(self) -> int | None:
        """Input channels each filter reads (the weight's dim 1): 1 for a depthwise convolution."""
        val = self.weight.meta.get("val") if isinstance(self.weight, fx.Node) else None
        return int(val.shape[1]) if val is not None and val.dim() > 1 else None


def cuts_groups(node: fx.Node, tp: int) -> bool:
    """Whether a grouped convolution's groups can be dealt out over tp, whole groups per rank.
    (A rank's share of one group of one channel is emitted folded over the batch: see
    :mod:`autoshard.passes.local_convolution`.)"""
    conv = Convolution.of(node)
    groups = conv.groups if conv is not None else None
    return isinstance(groups, int) and groups >= 2 and groups % tp == 0 and not conv.transposed


def _channelwise_conv(node, layouts, tp):
    """A depthwise (or grouped) convolution on channel-cut input ``[b, C, ...]``: each group reads
    only its own channels, so a cut of whole groups over tp is a cut of the output channels too,
    and of the weight's and bias's dim 0 (Mamba's causal ``conv1d``, ``groups=C``). A dense one
    (``groups=1``, its bias added apart) is rowwise: the weight cut on its input channels, the
    output each rank's partial sum."""
    conv = Convolution.of(node)
    x, weight, bias, groups, position = conv.input, conv.weight, conv.bias, conv.groups, conv.groups_position
    if conv.transposed:
        return None  # transposed convolution: not a channel-wise rule here
    if groups == 1 and layouts.get(x) == 1 and bias is None and layouts.get(weight) is None:
        # dense over channels, reading them cut: rowwise, each rank's share of the sum (see propagate)
        return Decision(PARTIAL, {x: 1, weight: 1})
    if layouts.get(x) != 1 or not cuts_groups(node, tp):
        return None
    if any(layouts.get(t) not in (None, 0) for t in (weight, bias) if isinstance(t, fx.Node)):
        return None
    wanted = {x: 1, weight: 0} | ({bias: 0} if isinstance(bias, fx.Node) else {})
    args = list(node.args)
    if len(args) > position:
        args[position] = groups // tp
        return Decision(1, wanted, tuple(args))
    return None  # groups given as a keyword: left whole


def _group_norm(node, layouts, tp):
    """GroupNorm on channel-cut input ``[b, C, ...]`` whose groups divide by tp: each rank holds
    whole groups, so their statistics are its own; the per-channel weight and bias are cut with
    the channels and the op counts its local groups."""
    x, groups = node.args[:2]
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
    affine = [t for t in (weight, bias) if isinstance(t, fx.Node)]
    if layouts.get(x) != 1 or not isinstance(groups, int) or groups % tp or node.kwargs:
        return None
    if any(layouts.get(t) not in (None, 0) for t in affine):
        return None
    args = (x, groups // tp, *node.args[2:])
    return Decision(1, {x: 1} | {t: 0 for t in affine}, args)


def _along_cp(node, layouts, tp):
    """A cp collective (``cp_gather`` along the sequence, ``cp_all_reduce``) works on each tp shard
    alike, unless it gathers the very dim tp shards."""
    found = _single_sharded_input(node, layouts)
    if found is None:
        return None
    value, dim = found
    if node.target is CP_GATHER and _norm(node.args[1], _ndim(value)) == dim:
        return None
    return Decision(dim, dict(layouts))


def _sym_size(node, layouts, tp):
    """The size of a dim other than the sharded one is the same on every rank."""
    found = _single_sharded_input(node, layouts)
    if found is None or _norm(node.args[1], _ndim(found[0])) == found[1]:
        return None
    return Decision(None, dict(layouts))


def _metadata_check(node, layouts, tp):
    """``_assert_tensor_metadata`` checks dtype/device/layout: any layout passes.
    A size or stride check would see the local shape, so it gets no rule."""
    if node.kwargs.get("size") is not None or node.kwargs.get("stride") is not None:
        return None
    return Decision(None, dict(layouts))


ELEMENTWISE_LIKE = (
    # elementwise overloads ATen does not tag pointwise: a scalar in place of a tensor operand
    aten.where.ScalarOther,
    aten.where.ScalarSelf,
    aten.where.Scalar,
    aten.masked_fill.Tensor,
    aten._to_copy.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.clone.default,
    aten.contiguous.default,
    aten.detach.default,
    aten.alias.default,
    aten.lift_fresh_copy.default,
    aten.type_as.default,
)

_REDUCTIONS = (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.var.correction)
_SOFTMAXES = (aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
_NORMS = (aten.rms_norm.default, aten.layer_norm.default)  # native_layer_norm returns a tuple: not Strided
# the rules that keep each value of a cut dim apart, applied to Strided values too (_strided_alike)
_STRIDED_RULES = {op: rule for ops, rule in ((_REDUCTIONS, _reduce), (_SOFTMAXES, _softmax), (_NORMS, _norm_over_last))
                  for op in ops}

_RULES = (
    (ELEMENTWISE_LIKE, _pointwise),
    ((CP_GATHER, CP_ALL_REDUCE), _along_cp),
    ((FUSED_SPLIT,), _sections),
    (CONVOLUTIONS, _channelwise_conv),
    ((aten._assert_tensor_metadata.default,), _metadata_check),
    ((aten.sym_size.int,), _sym_size),
    ((aten.dropout.default, aten.native_dropout.default, aten.feature_dropout.default), _dropout_like),
    (
        (
            aten.view.default,
            aten.reshape.default,
            aten._unsafe_view.default,
            aten.unsqueeze.default,
            aten.squeeze.dim,
            aten.squeeze.dims,
            aten.squeeze.default,
            aten.flatten.using_ints,
            aten.unflatten.int,
        ),
        _reshape,
    ),
    ((aten.view_as_complex.default, aten.view_as_real.default), _complex_view),
    ((aten.expand.default,), _expand),
    ((aten.expand_as.default,), _expand_as),
    ((aten.transpose.int, aten.permute.default, aten.t.default), _transpose),
    (
        (
            aten.slice.Tensor,
            aten.select.int,
            aten.narrow.default,
            aten.split.Tensor,
            aten.split_with_sizes.default,
            aten.chunk.default,
            aten.unbind.int,
        ),
        _slice_like,
    ),
    ((aten.cat.default,), _cat),
    (_REDUCTIONS, _reduce),
    (_SOFTMAXES, _softmax),
    ((*_NORMS, aten.native_layer_norm.default), _norm_over_last),
    (ATTENTIONS, _attention),
    ((aten.matmul.default, aten.bmm.default), _batched_matmul),
    ((aten.tril.default, aten.triu.default), _triangle),
    ((aten.einsum.default,), _einsum),
    ((aten.group_norm.default,), _group_norm),
)

