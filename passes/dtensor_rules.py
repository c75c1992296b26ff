"""DTensor's op strategies as the base layout rule set.

DTensor's sharding propagator knows how most ATen ops treat a sharded input:
strided slices, ``stack``, ``repeat_interleave`` on the sharded dim, a flatten of
heads into the batch (a ``_StridedShard``), batched matmuls, scans... For a node
none of autoshard's own rules (:mod:`passes.layout_rules`) decides, we ask it:
the node's inputs become ``DTensorSpec`` s on a one-dim ``tp`` mesh that has no
process group (only its size matters), and the propagator answers with the
output placement and the input placements it wants.

autoshard takes the answer only when it costs no forward communication:

* every sharded (or partial) input keeps its placement;
* a replicated input may be asked for a shard (this rank's chunk, no
  communication forward; an all-gather of its gradient backward, and none for
  a constant like an ALiBi table);
* the output is replicated, sharded, strided-sharded or partial.

Any other answer (DTensor would all-gather or reduce an input) is declined,
and the caller gathers the value itself, once, where the plan says so.

An accepted answer is checked before it is used: the op is run on meta tensors
of the local shapes with the local arguments DTensor gives (a view's shape
argument shrinks to the local size), and must produce the local output shape;
and when the op's tensors are small it is also run on random values, once per
rank's chunks, against the chunk of the full result. A rule that fails either
check is declined.

The values check runs with uninitialized memory filled (NaN, or the largest
integer): an op may leave part of its output unwritten for the check's inputs
(``_grouped_mm`` with the zero offsets an integer input gets writes no row), and
comparing what the allocator left there made the answer differ from process to
process. Ranks that plan on their own then emitted different collectives, and
gloo aborted on mismatched sizes. A full result that is not finite on finite
inputs gives the rule no evidence, and it is declined, as a rule whose values
differ is. Answers are cached by op, placements, shapes and arguments,
so a model's 32 identical blocks ask once.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autoshard.passes.layout_rules import PARTIAL, PARTIAL_AVG, PARTIALS, Decision, Strided

# Ops whose tensors hold more elements than this are checked on shapes only.
_NUMERIC_CHECK_LIMIT = 1 << 18  # elements summed over the op's tensors


# A reshape lays out like a view of a contiguous copy; DTensor's own reshape strategy
# declines the flatten of heads into the batch that its view strategy keeps strided.
_ASK_AS = {
    torch.ops.aten.reshape.default: torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default: torch.ops.aten.view.default,
}


def _mesh(tp: int):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(tp, device="cpu"), mesh_dim_names=("tp",), _init_backend=False, _rank=0)


_MESHES: dict[int, object] = {}


def _placement(layout):
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if layout is None:
        return Replicate()
    if layout == PARTIAL:
        return Partial()
    if layout == PARTIAL_AVG:
        return Partial("avg")
    if isinstance(layout, Strided):
        return _StridedShard(layout.dim, split_factor=layout.split_factor)
    return Shard(layout)


def _layout(placement):
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(placement, _StridedShard):
        return Strided(placement.dim, placement.split_factor)
    if isinstance(placement, Shard):
        return placement.dim
    if isinstance(placement, Replicate):
        return None
    if isinstance(placement, Partial) and placement.reduce_op == "sum":
        return PARTIAL
    if isinstance(placement, Partial) and placement.reduce_op == "avg":
        return PARTIAL_AVG
    raise _Decline


class _Decline(Exception):
    pass


def query(node: fx.Node, layouts: dict[fx.Node, object], tp: int) -> Decision | None:
    """DTensor's communication-free layout for ``node`` given its inputs' layouts, or None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if any(isinstance(lay, tuple) for lay in layouts.values()):
        return None
    tensors = {}
    for value in node.all_input_nodes:
        val = value.meta.get("val")
        if not isinstance(val, torch.Tensor) or _symbolic(val.shape):
            return None
        tensors[value] = val
    out = node.meta.get("val")
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not all(isinstance(o, torch.Tensor) and not _symbolic(o.shape) for o in outs):
        return None
    key = _key(node, layouts, tensors)
    try:
        answer = _answer(key, node.target, node.args, node.kwargs, tp, tuple(layouts.get(v) for v in tensors))
    except (TypeError, ValueError):  # unhashable arguments: ask without the cache
        answer = _ask(node.target, _args_key(node.args), _args_key(node.kwargs), tp, key[1])
    if answer is None:
        return None
    wanted, output, local_args, local_kwargs = answer
    inputs = dict(zip(tensors, wanted, strict=True))
    args = None
    if local_args is not None:
        if _merge(node.kwargs, local_kwargs or {}) != dict(node.kwargs):
            return None  # a keyword argument would change: not expressible as new args
        args = _merge(node.args, local_args)
        if args == node.args:
            args = None
    return Decision(output, inputs, args)


def _symbolic(shape) -> bool:
    return any(isinstance(s, torch.SymInt) for s in shape)


def _key(node, layouts, tensors):
    shapes = tuple((tuple(v.shape), v.dtype) for v in tensors.values())
    return (node.target, tuple(layouts.get(v) for v in tensors), shapes, _args_key(node.args), _args_key(node.kwargs))


def _args_key(args):
    """Node arguments with each tensor replaced by its shape, dtype and position."""
    def leaf(a):
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            return ("tensor", tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else ("node", a.name)
        return a

    return pytree.tree_map(leaf, args if not isinstance(args, dict) else tuple(sorted(args.items())))


@functools.lru_cache(maxsize=4096)
def _answer_cached(key_hashable, op, args_key, kwargs_key, tp, input_layouts):
    return _ask(op, args_key, kwargs_key, tp, input_layouts)


def _answer(key, op, args, kwargs, tp, input_layouts):
    hash(key)  # raises TypeError for unhashable arguments
    return _answer_cached(key, op, key[3], key[4], tp, input_layouts)


def _ask(op, args_key, kwargs_key, tp, input_layouts):
    """(wanted input layouts, output layout, local args, local kwargs) or None."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema

    mesh = _MESHES.get(tp)
    if mesh is None:
        mesh = _MESHES[tp] = _mesh(tp)
    layouts_iter = iter(input_layouts)
    metas = []

    def to_spec(a):
        if isinstance(a, tuple) and len(a) == 3 and a[0] == "tensor":
            shape, dtype = a[1], a[2]
            meta = torch.empty(shape, dtype=dtype, device="meta")
            metas.append(meta)
            lay = next(layouts_iter)
            return DTensorSpec(mesh, (_placement(lay),), TensorMeta(meta.shape, meta.stride(), dtype))
        if isinstance(a, tuple) and len(a) == 2 and a[0] == "node":
            raise _Decline
        return a

    try:
        args = _rebuild(args_key, to_spec)
        kwargs = dict(_rebuild(kwargs_key, to_spec)) if kwargs_key else {}
        prop = DTensor._op_dispatcher.sharding_propagator
        asked = _ASK_AS.get(op, op)
        schema = OpSchema(asked, tuple(args), kwargs, schema_info=prop.op_to_schema_info.get(asked))
        result = prop.propagate_op_sharding_non_cached(schema)
        final = result.redistribute_schema if result.needs_redistribute else schema
        if final is None:
            return None
        wanted = [_layout(s.placements[0]) for s in _specs(final.args_schema, final.kwargs_schema)]
        specs = result.output_spec if isinstance(result.output_spec, (tuple, list)) else (result.output_spec,)
        if any(s is None for s in specs):
            return None
        outputs = [_layout(s.placements[0]) for s in specs]
    except _Decline:
        return None
    except Exception:  # no strategy, or a strategy that cannot take these arguments
        return None
    if len(wanted) != len(input_layouts):
        return None
    for have, want in zip(input_layouts, wanted, strict=True):
        if have is not None and have != want:
            return None  # DTensor would gather or reduce a sharded input: the caller decides
        if have is None and want in PARTIALS:
            return None
    output = tuple(outputs) if isinstance(result.output_spec, (tuple, list)) else outputs[0]
    # Local arguments matter where DTensor rewrites sizes (a view's shape); where it swaps the
    # overload (squeeze.dim -> squeeze.dims) the node keeps its own, equivalent arguments.
    rewritten = result.needs_redistribute and final.op == asked
    local_args = _plain(final.args_schema) if rewritten else None
    local_kwargs = _plain(final.kwargs_schema) if rewritten else None
    with _uninitialized_memory_filled():
        checked = _check(op, args_key, kwargs_key, tp, wanted, output, local_args, local_kwargs)
    if not checked:
        return None
    return tuple(wanted), output, local_args, local_kwargs


def _rebuild(key, leaf):
    if isinstance(key, tuple) and len(key) in (2, 3) and key and key[0] in ("tensor", "node"):
        return leaf(key)
    if isinstance(key, (list, tuple)):
        return type(key)(_rebuild(k, leaf) for k in key)
    return key


def _specs(args, kwargs):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    leaves = pytree.tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(x, DTensorSpec))
    return [x for x in leaves if isinstance(x, DTensorSpec)]


def _plain(args):
    """The non-tensor arguments of a redistribute schema (tensors as placeholders)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return pytree.tree_map_only(DTensorSpec, lambda s: _TENSOR, args, is_leaf=lambda x: isinstance(x, DTensorSpec))


_TENSOR = object()


def _merge(original, local):
    """``original`` node arguments with non-tensor leaves taken from ``local``."""
    if isinstance(original, fx.Node) or local is _TENSOR:
        return original
    if isinstance(original, dict):
        return {k: _merge(v, local.get(k, v)) for k, v in original.items()}
    if isinstance(original, (list, tuple)) and isinstance(local, (list, tuple)) and len(original) == len(local):
        return type(original)(_merge(o, lo) for o, lo in zip(original, local, strict=True))
    return local


# --- checking an answer ---------------------------------------------------------------


def _local_shape(shape, layout, tp):
    shape = list(shape)
    if layout is None or layout in PARTIALS:
        return shape
    dim = layout.dim if isinstance(layout, Strided) else layout
    if shape[dim] % tp:
        raise _Decline
    shape[dim] //= tp
    return shape


def _chunk(x: torch.Tensor, layout, tp: int, rank: int) -> torch.Tensor:
    if layout is None or layout in PARTIALS:
        return x
    if isinstance(layout, Strided):
        dim, sf = layout.dim, layout.split_factor
        parts = x.unflatten(dim, (sf, x.shape[dim] // sf))
        return parts.chunk(tp, dim=dim + 1)[rank].flatten(dim, dim + 1)
    return x.chunk(tp, dim=layout)[rank]


def _check(op, args_key, kwargs_key, tp, wanted, output, local_args, local_kwargs) -> bool:
    """The local op gives the local output shape (always) and values (small ops)."""
    outputs = output if isinstance(output, tuple) else (output,)
    try:
        partial_outputs = []
        tensors = []

        def collect(a):
            if isinstance(a, tuple) and len(a) == 3 and a[0] == "tensor":
                tensors.append(a)
            return a

        _rebuild((args_key, kwargs_key), collect)
        numel = sum(_numel(t[1]) for t in tensors)
        full_outs = None
        if numel <= _NUMERIC_CHECK_LIMIT and not op._schema.is_mutable and not _nondeterministic(op):
            gen = torch.Generator().manual_seed(0)
            values = [_random(t[1], t[2], gen) for t in tensors]
            full_outs = _run(op, args_key, kwargs_key, values, None, None)
            if not all(_finite(o) for o in full_outs):
                return False  # part of the result was never written (or is not finite): no evidence for the rule
        for rank in range(tp):
            it = iter(range(len(tensors)))

            def meta_or_value(a, rank=rank, it=it):
                i = next(it)
                lay = wanted[i]
                if full_outs is None:
                    return torch.empty(_local_shape(a[1], lay, tp), dtype=a[2], device="meta")
                return _chunk(values[i], lay, tp, rank)

            local_outs = _run(op, args_key, kwargs_key, None, meta_or_value, (local_args, local_kwargs))
            for out_layout, local, full in zip(
                outputs, local_outs, full_outs or [None] * len(local_outs), strict=True
            ):
                if out_layout in PARTIALS:
                    partial_outputs.append(out_layout)
                    continue
                if full is not None:
                    if not torch.allclose(local, _chunk(full, out_layout, tp, rank), rtol=1e-4, atol=1e-5):
                        return False
        if full_outs is not None and partial_outputs:
            return _check_partial(op, args_key, kwargs_key, tp, wanted, outputs, local_args, local_kwargs, values,
                                  full_outs)
        return True
    except Exception:
        return False


@contextlib.contextmanager
def _uninitialized_memory_filled():
    """Memory an op allocates and does not write reads as NaN (the largest integer), not as what
    the allocator last held: the values check then answers alike in every process."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # warn_only's notes on ops without a deterministic kernel
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _finite(out) -> bool:
    return not isinstance(out, torch.Tensor) or not out.is_floating_point() or bool(torch.isfinite(out).all())


def _check_partial(op, args_key, kwargs_key, tp, wanted, outputs, local_args, local_kwargs, values, full_outs):
    """Partial outputs: the local results of all ranks add up to the full result.

    Replicated inputs are given to one rank only when DTensor counts them into a
    partial sum; here every replicated input is the same on every rank, so only
    ops linear in their partial inputs pass."""
    sums = None
    for rank in range(tp):
        it = iter(range(len(values)))

        def value(a, rank=rank, it=it):
            i = next(it)
            lay = wanted[i]
            if lay == PARTIAL:
                return values[i] / tp
            if lay == PARTIAL_AVG:
                return values[i]
            return _chunk(values[i], lay, tp, rank)

        local = _run(op, args_key, kwargs_key, None, value, (local_args, local_kwargs))
        sums = list(local) if sums is None else [s + x if o in PARTIALS else s for s, x, o in zip(
            sums, local, outputs, strict=True)]
    for s, full, o in zip(sums, full_outs, outputs, strict=True):
        total = s / tp if o == PARTIAL_AVG else s
        if o in PARTIALS and not torch.allclose(total, full, rtol=1e-4, atol=1e-5):
            return False
    return True


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _nondeterministic(op) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags


def _random(shape, dtype, gen):
    """Values for the numeric check, on the CPU (as ``gen``) whatever the default device."""
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, device="cpu").to(dtype)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool, device="cpu")
    return torch.zeros(shape, dtype=dtype, device="cpu")


def _run(op, args_key, kwargs_key, values, make, local):
    """Run ``op`` on the tensors of ``args_key`` (``values`` in order, or ``make(leaf)``)."""
    it = iter(values) if values is not None else None

    def leaf(a):
        return next(it) if it is not None else make(a)

    args = _rebuild(args_key, leaf)
    kwargs = dict(_rebuild(kwargs_key, leaf)) if kwargs_key else {}
    if local is not None and local[0] is not None:
        args = _merge_values(args, local[0])
        kwargs = {k: _merge_values(v, (local[1] or {}).get(k, v)) for k, v in kwargs.items()}
    out = op(*args, **kwargs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _merge_values(original, local):
    if isinstance(original, torch.Tensor) or local is _TENSOR:
        return original
    if isinstance(original, (list, tuple)) and isinstance(local, (list, tuple)) and len(original) == len(local):
        return type(original)(_merge_values(o, lo) for o, lo in zip(original, local, strict=True))
    return local

