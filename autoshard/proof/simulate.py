"""Simulate: run the emitted tp code of every tp rank in one process.

The emitted graphs compute on local tensors and talk to other tp ranks only
through autoshard's collective ops (:mod:`autoshard.runtime.collectives`). So all tp
ranks can run side by side in one process: every graph value becomes a
:class:`PerRank` (one value per tp rank), every ordinary op runs once per rank
on that rank's arguments, and each collective combines the per-rank values as
the real one does over the wire (an all-reduce sums, an all-gather
concatenates, a cut keeps the rank's chunk).

Backward is simulated the same way. Each collective is one
``torch.autograd.Function`` over all ranks' tensors whose backward is the op's
own backward collective (``enter_tp`` sums the ranks' gradients, ``take_shard``
gathers them, ...), not the mathematical adjoint of the simulation. Autograd
over the whole simulated world then hands each rank exactly the gradient that
rank computes in a real job, where every rank back-propagates its own copy of
the loss. Nothing here needs a process group, a private torch API or a GPU.

Random ops (dropout) run as identity, here and in the reference: tp ranks
would draw different masks from the reference anyway, and a check must compare
like with like.
"""

from __future__ import annotations

import copy
import operator
import re
import weakref
from collections.abc import Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.node import map_aggregate

from autoshard.core.errors import describe
from autoshard.core.mesh import CP, EP, TP
from autoshard.core.sharding import Wire, sum_on_wire, widens
from autoshard.plans.predict import Tally
from autoshard.proof.rank_grid import RankGrid
from autoshard.runtime import collectives, context_ops, token_dispatch, whole_sections
from autoshard.runtime.whole_sections import section_order

aten = torch.ops.aten


class EmittedCodeError(RuntimeError):
    """An op of the emitted code raised on some tp rank (a view whose local strides no longer
    allow it, a shape argument left global): names the node and its source line; ``node`` is it."""

    def __init__(self, message: str, node: fx.Node | None = None):
        super().__init__(message)
        self.node = node


class PerRank:
    """One graph value on every tp rank (index = tp rank)."""

    __slots__ = ("values", "sharded_dim")

    def __init__(self, values, sharded_dim: int | None = None):
        self.values = list(values)
        self.sharded_dim = sharded_dim  # a graph output left sharded (loss parallel): its dim

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        return f"PerRank({self.values!r})"


def on_rank(arg, rank: int):
    """``arg`` (any nesting of args) as rank ``rank`` sees it."""
    return map_aggregate(arg, lambda a: a.values[rank] if isinstance(a, PerRank) else a)


def replicated(value, tp: int) -> PerRank:
    return PerRank([value] * tp)


# --- collectives across ranks ---------------------------------------------------------------


class _AcrossRanks(torch.autograd.Function):
    """``forward(xs) -> ys`` and ``backward(grads of ys) -> grads of xs`` over all ranks at once."""

    @staticmethod
    def forward(ctx, forward, backward, *xs):
        ctx.backward_fn = backward
        return tuple(forward(list(xs)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *ctx.backward_fn(list(grads)))


def _sum(xs: list[torch.Tensor], reduce_dtype=None) -> torch.Tensor:
    """What an all-reduce leaves on every rank: the sum, taken in ``reduce_dtype`` when given."""
    dtype = xs[0].dtype
    wire = [x if reduce_dtype is None else x.to(reduce_dtype) for x in xs]
    total = wire[0].clone()
    for x in wire[1:]:
        total = total + x
    return total.to(dtype)


def _cat(xs, dim):
    return torch.cat(xs, dim=dim)


def _chunks(x, tp, dim):
    return [c.clone(memory_format=torch.contiguous_format) for c in torch.chunk(x, tp, dim=dim)]


def _copies(x, tp):
    return [x.clone() for _ in range(tp)]


def _across(forward: Callable, backward: Callable, xs: list[torch.Tensor]) -> PerRank:
    return PerRank(_AcrossRanks.apply(forward, backward, *xs))


def _wire(tensors: list[torch.Tensor]) -> int:
    """Bytes of what one rank puts on the wire: partial sums travel in their own dtype, only
    their adding is wide (see autoshard.runtime.collectives)."""
    return sum(t.numel() * t.dtype.itemsize for t in tensors)


def _summed(tally: Tally, xs, reduce_dtype=None, scattered: bool = False):
    kind = Wire.REDUCE_SCATTER if scattered else Wire.ALL_REDUCE
    for wire in sum_on_wire(kind, widens(xs[0].dtype, reduce_dtype), len(xs)):
        tally.add(TP, wire, _wire(xs[:1]), len(xs))
    return _sum(xs, reduce_dtype)


def _gathered(tally: Tally, xs, dim):
    tally.add(TP, Wire.ALL_GATHER, _wire(xs), len(xs))
    return _cat(xs, dim)


def _enter_tp(tally, xs, group_name, reduce_dtype=None):
    tp = len(xs)
    return _across(lambda v: [x.clone() for x in v], lambda g: _copies(_summed(tally, g, reduce_dtype), tp), xs)


def _reduce_partial(tally, xs, group_name, reduce_dtype=None):
    tp = len(xs)
    return _across(lambda v: _copies(_summed(tally, v, reduce_dtype), tp), lambda g: [x.clone() for x in g], xs)


def _gather_shards(tally, xs, dim, group_name):
    tp = len(xs)
    return _across(lambda v: _copies(_gathered(tally, v, dim), tp),
                   lambda g: [_chunks(x, tp, dim)[r] for r, x in enumerate(g)], xs)


def _take_shard(tally, xs, dim, group_name):
    tp = len(xs)
    return _across(lambda v: [_chunks(x, tp, dim)[r] for r, x in enumerate(v)],
                   lambda g: _copies(_gathered(tally, g, dim), tp), xs)


def _take_shards(tally: Tally, values: list[PerRank], dim, group_name) -> PerRank:
    """Several ``take_shard``s in one op: per rank a list, one value's chunk per entry."""
    tp, count = len(values[0]), len(values)
    flat = [x for v in values for x in v.values]  # value-major: flat[i * tp + r]

    def forward(xs):
        return [_chunks(xs[i * tp + r], tp, dim)[r] for i in range(count) for r in range(tp)]

    def backward(grads):
        tally.add(TP, Wire.ALL_GATHER, _wire(grads), tp)  # one all-gather for every value
        return [g for i in range(count) for g in _copies(_cat(grads[i * tp:(i + 1) * tp], dim), tp)]

    out = _AcrossRanks.apply(forward, backward, *flat)
    return PerRank([[out[i * tp + r] for i in range(count)] for r in range(tp)])


def _enter_tps(tally: Tally, values: list[PerRank], group_name, reduce_dtype=None) -> PerRank:
    """Several ``enter_tp``s in one op: per rank a list; their gradients summed in one all-reduce."""
    tp, count = len(values[0]), len(values)
    flat = [x for v in values for x in v.values]  # value-major: flat[i * tp + r]

    def backward(grads):
        per_rank = [torch.cat([grads[i * tp + r].reshape(-1) for i in range(count)]) for r in range(tp)]
        total = _summed(tally, per_rank, reduce_dtype)  # one all-reduce for every value
        pieces = torch.split(total, [grads[i * tp].numel() for i in range(count)])
        return [piece.view(grads[i * tp].shape).clone() for i, piece in enumerate(pieces) for _ in range(tp)]

    out = _AcrossRanks.apply(lambda xs: [x.clone() for x in xs], backward, *flat)
    return PerRank([[out[i * tp + r] for i in range(count)] for r in range(tp)])


def _reduce_scatter_partial(tally, xs, dim, group_name, reduce_dtype=None):
    tp = len(xs)
    return _across(lambda v: _chunks(_summed(tally, v, reduce_dtype, scattered=True), tp, dim),
                   lambda g: _copies(_gathered(tally, g, dim), tp), xs)


def _gather_for_colwise(tally, xs, dim, group_name, reduce_dtype=None):
    tp = len(xs)
    return _across(lambda v: _copies(_gathered(tally, v, dim), tp),
                   lambda g: _chunks(_summed(tally, g, reduce_dtype, scattered=True), tp, dim), xs)


def _vocab_shard_ids(ids: PerRank, rows_per_rank, group_name, *, grid: RankGrid) -> PerRank:
    out = []
    for i, x in enumerate(ids.values):
        local = x - grid.coordinate(i, TP) * rows_per_rank
        in_shard = (local >= 0) & (local < rows_per_rank)
        out.append((torch.where(in_shard, local, 0), in_shard.unsqueeze(-1)))
    return PerRank(out)


def _as_sharded_dtensor(xs: PerRank, dim, group_name) -> PerRank:
    return PerRank(xs.values, sharded_dim=dim)


def _cp_positions(xs: PerRank, seq, cp, group_name, balanced=True, *, grid: RankGrid) -> PerRank:
    return PerRank([context_ops.local_positions(grid.coordinate(i, CP), cp, seq, x.device, balanced)
                    for i, x in enumerate(xs.values)])


def _cp_gather(tally, xs, dim, cp, group_name, regather: bool = False):
    """Every rank's cut part in sequence order; backward: the ranks' gradients summed, each keeping
    its part (after gathering the parts again, ``regather``, as ``cp_causal_attention`` does)."""
    def forward(v):
        tally.add(CP, Wire.ALL_GATHER, _wire(v), len(v))
        return _copies(context_ops.to_global_order(_cat(v, dim), dim, cp), len(v))

    def backward(g):
        if regather:
            tally.add(CP, Wire.ALL_GATHER, _wire(g[:1]), len(g))
        tally.add(CP, Wire.REDUCE_SCATTER, _wire(g[:1]), len(g))
        return _chunks(context_ops.to_rank_order(_sum(g), dim, cp), len(g), dim)

    return _across(forward, backward, xs)


def _cp_all_reduce(tally, xs, cp, group_name):
    def forward(v):
        tally.add(CP, Wire.ALL_REDUCE, _wire(v[:1]), len(v))
        return _copies(_sum(v), len(v))

    def backward(g):
        tally.add(CP, Wire.ALL_REDUCE, _wire(g[:1]), len(g))
        return _copies(_sum(g), len(g))

    return _across(forward, backward, xs)


def _ep_routing(ids: list[torch.Tensor], num_experts: int, by_offsets: bool, rows: list[int]):
    """What :func:`autoshard.runtime.token_dispatch.routing` works out on each of ``ep`` ranks, from all
    their ids at once: per rank ``(order, arrival, send, receive, local_ids, local_offsets)``."""
    ep = len(ids)
    local = num_experts // ep
    flat = [(token_dispatch.expert_of_rows(i, n) if by_offsets else i.reshape(-1)).to(torch.int64)
            for i, n in zip(ids, rows, strict=True)]
    per_expert = [torch.bincount(f, minlength=num_experts).view(ep, local) for f in flat]  # [dest, local expert]
    out = []
    for me in range(ep):
        arrived = torch.stack([per_expert[src][me] for src in range(ep)])  # [source, local expert]
        arrived_ids = torch.repeat_interleave(torch.arange(local).repeat(ep), arrived.reshape(-1))
        arrival = torch.argsort(arrived_ids, stable=True)
        out.append((torch.argsort(flat[me], stable=True), arrival, per_expert[me].sum(1), arrived.sum(1),
                    arrived_ids[arrival], torch.cumsum(arrived.sum(0), 0).to(torch.int32)))
    return out


def _moved(xs: list[torch.Tensor], splits: list[list[int]]) -> list[torch.Tensor]:
    """An all-to-all: rank ``s`` sends ``splits[s][d]`` rows (in order) to rank ``d``; each rank gets
    its parts source by source."""
    parts = [torch.split(x, s) for x, s in zip(xs, splits, strict=True)]
    return [torch.cat([parts[src][dest] for src in range(len(xs))]) for dest in range(len(xs))]


def _rows_out(xs, handles):
    """Each rank's rows to their experts' ranks, expert-major on arrival (the dispatch's rows)."""
    sent = _moved([x[h[0]] for x, h in zip(xs, handles, strict=True)], [h[2].tolist() for h in handles])
    return [r[h[1]] for r, h in zip(sent, handles, strict=True)]


def _rows_back(xs, handles):
    """Expert-major rows back to the ranks that sent them, each in its row's place (the combine)."""
    source_major = [torch.empty_like(x).index_copy(0, h[1], x) for x, h in zip(xs, handles, strict=True)]
    back = _moved(source_major, [h[3].tolist() for h in handles])
    return [torch.empty_like(b).index_copy(0, h[0], b) for b, h in zip(back, handles, strict=True)]


def _ep_tally(tally: Tally, xs, handles, sent: int) -> None:
    """One all-to-all's bytes, as ranks 0 of the group sends them to the others."""
    row = xs[0][0].numel() * xs[0].element_size() if xs[0].shape[0] else 0
    splits = handles[0][sent].tolist()
    tally.counts[EP][Wire.ALL_TO_ALL] += 1
    tally.bytes[EP][Wire.ALL_TO_ALL] += (sum(splits) - splits[0]) * row


def _ep_dispatch(tally: Tally, xs, ids, num_experts, share, by_offsets) -> list:
    """ep_dispatch on one group's ranks: ``(local_rows, local_ids, local_offsets, order, arrival, send,
    receive)`` per rank; the rows' backward brings their gradients back divided by ``share``."""
    handles = _ep_routing(ids, num_experts, by_offsets, [x.shape[0] for x in xs])
    tally.counts[EP][Wire.ALL_TO_ALL] += 1
    tally.bytes[EP][Wire.ALL_TO_ALL] += num_experts * 8 * (len(xs) - 1) / len(xs)
    _ep_tally(tally, xs, handles, 2)

    def backward(grads):
        _ep_tally(tally, grads, handles, 3)
        return [g / share for g in _rows_back(grads, handles)]

    local = _across(lambda v: _rows_out(v, handles), backward, xs).values
    return [(rows, h[4], h[5], h[0], h[1], h[2], h[3]) for rows, h in zip(local, handles, strict=True)]


def _ep_combine(tally: Tally, xs, handles, share) -> list:
    """ep_combine on one group's ranks; its backward sends the gradients out again, times ``share``."""
    _ep_tally(tally, xs, handles, 3)

    def backward(grads):
        _ep_tally(tally, grads, handles, 2)
        return _rows_out([g * share for g in grads], handles)

    return _across(lambda v: _rows_back(v, handles), backward, xs).values


_CP_COLLECTIVES = (context_ops.CP_GATHER, context_ops.CP_ALL_REDUCE)
_TENSOR_COLLECTIVES = {
    context_ops.CP_GATHER: _cp_gather,
    context_ops.CP_ALL_REDUCE: _cp_all_reduce,
    collectives.ENTER_TP: _enter_tp,
    collectives.REDUCE_PARTIAL: _reduce_partial,
    collectives.GATHER_SHARDS: _gather_shards,
    collectives.TAKE_SHARD: _take_shard,
    collectives.REDUCE_SCATTER_PARTIAL: _reduce_scatter_partial,
    collectives.GATHER_FOR_COLWISE: _gather_for_colwise,
}

# Random ops run as identity (see the module docstring).
_DROPOUTS = {aten.dropout.default, aten.native_dropout.default, aten.feature_dropout.default,
             aten.alpha_dropout.default, aten.feature_alpha_dropout.default}


# Attention with its own dropout probability: argument position of ``dropout_p``.
_ATTENTION_DROPOUT = {aten.scaled_dot_product_attention.default: 4,
                      aten._scaled_dot_product_flash_attention_for_cpu.default: 3,
                      aten._scaled_dot_product_efficient_attention.default: 4,
                      aten._scaled_dot_product_flash_attention.default: 3}


def _without_randomness(target, args, kwargs):
    """``(ran, value)``: dropout as the identity (``native_dropout`` gives ``(x, all-true mask)``),
    attention with its dropout probability set to 0."""
    if target in _ATTENTION_DROPOUT:
        at = _ATTENTION_DROPOUT[target]
        if len(args) > at:
            args = (*args[:at], 0.0, *args[at + 1:])
        if "dropout_p" in kwargs:
            kwargs = {**kwargs, "dropout_p": 0.0}
        return True, target(*args, **kwargs)
    if target not in _DROPOUTS:
        return False, None
    x = args[0]
    if target is aten.native_dropout.default:
        return True, (x.clone(), torch.ones_like(x, dtype=torch.bool))
    return True, x.clone()


def _as_simulated(arg, widen: torch.dtype | None = None):
    """The simulation runs on the CPU: tensors the graph creates on meta (a graph captured on a
    meta twin, under mixed precision) or on an accelerator are made there. With ``widen``, every
    float dtype the graph names becomes ``widen`` (a cast to bf16 is exact in a float64 run). A
    nested graph (the body of a higher-order op) runs as a copy with the same changes."""
    if isinstance(arg, torch.device) and arg.type != "cpu":
        return torch.device("cpu")
    if widen is not None and isinstance(arg, torch.dtype) and arg != widen:
        if arg.is_floating_point and torch.finfo(arg).bits < torch.finfo(widen).bits:
            return widen
        if arg.is_complex and widen == torch.float64:
            return torch.complex128
    if isinstance(arg, fx.GraphModule):
        return _body_copy(arg, widen)
    return arg


# each body's CPU copy (by the dtype it is widened to), kept while the body lives
# (a weak key: proofs of many models do not pile up)
_BODIES: weakref.WeakKeyDictionary[fx.GraphModule, dict] = weakref.WeakKeyDictionary()


def _body_copy(body: fx.GraphModule, widen: torch.dtype | None) -> fx.GraphModule:
    copies = _BODIES.setdefault(body, {})
    if widen not in copies:
        graph = copy.deepcopy(body.graph)
        for node in graph.nodes:
            node.args, node.kwargs = map_aggregate((node.args, node.kwargs), lambda a: _as_simulated(a, widen))
        copies[widen] = fx.GraphModule(body, graph)
    return copies[widen]


def widened(value, dtype: torch.dtype | None):
    """``value`` (a tensor or anything else) with a float tensor cast up to ``dtype``."""
    if dtype is None or not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point() and torch.finfo(value.dtype).bits < torch.finfo(dtype).bits:
        return value.to(dtype)
    if value.is_complex() and dtype == torch.float64:
        return value.to(torch.complex128)
    return value


# --- the interpreter -------------------------------------------------------------------------


class RankSimulator(fx.Interpreter):
    """Runs ``gm`` for every rank of ``grid`` (:class:`~autoshard.proof.rank_grid.RankGrid`, any axes
    that cut values within a step) at once; every value is a :class:`PerRank`, indexed by grid rank.
    A collective runs within the groups of the axis it names (:meth:`RankGrid.groups`).

    ``param(fqn)`` returns the per-rank local tensors of a parameter (or None for
    what is no parameter: buffers and constants are read from ``gm`` and are alike
    on every rank). A ``call_module`` of a GraphModule (a block) runs nested, with
    ``prefix`` extended by its name. ``values`` collects every node's value by
    ``prefix + node.name`` for comparisons after the run.
    """

    def __init__(self, gm: fx.GraphModule, grid: RankGrid, param: Callable[[str], PerRank | None],
                 prefix: str = "", values: dict[str, PerRank] | None = None, tally: Tally | None = None,
                 widen: torch.dtype | None = None):
        super().__init__(gm, garbage_collect_values=False)
        self.grid = grid  # row-major in mesh order: on cp x tp rank i is (i // tp, i % tp)
        self.tp = grid.size(TP)
        self.ranks = grid.ranks
        self.widen = widen  # run every float op in this dtype (a proof's exact reference); None: as written
        self.tally = tally if tally is not None else Tally()  # the tp collectives run, forward and backward
        self.param = param
        self.prefix = prefix
        self.values = values if values is not None else {}

    def run_node(self, n: fx.Node):
        try:
            result = super().run_node(n)
        except EmittedCodeError:
            raise
        except Exception as err:
            raise EmittedCodeError(f"{describe(n)} fails in the emitted code: {type(err).__name__}: "
                                   f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}", n) from err
        if isinstance(result, PerRank):
            self.values[self.prefix + n.name] = result
        return result

    def placeholder(self, target, args, kwargs):
        value = super().placeholder(target, args, kwargs)
        return value if isinstance(value, PerRank) else replicated(value, self.ranks)

    def get_attr(self, target, args, kwargs):
        found = self.param(self.prefix + target)
        if found is not None:
            return found
        return replicated(widened(self.fetch_attr(target), self.widen), self.ranks)

    def call_function(self, target, args, kwargs):
        if target in _TENSOR_COLLECTIVES:
            (x, *rest), kw = args, kwargs
            rest, kw = map_aggregate((on_rank(rest, 0), on_rank(kw, 0)), lambda a: _as_simulated(a, self.widen))
            return self._grouped(CP if target in _CP_COLLECTIVES else TP, [x],
                                 lambda tally, xs: _TENSOR_COLLECTIVES[target](tally, xs[0].values, *rest, **kw))
        if target in (collectives.TAKE_SHARDS, collectives.ENTER_TPS):
            # a reduce_dtype among the arguments is widened like any dtype the code names
            rest = map_aggregate(on_rank(args[1:], 0), lambda a: _as_simulated(a, self.widen))
            grouped = _take_shards if target is collectives.TAKE_SHARDS else _enter_tps
            return self._grouped(TP, list(args[0]), lambda tally, xs: grouped(tally, xs, *rest))
        if target in (token_dispatch.EP_DISPATCH, token_dispatch.EP_COMBINE):
            return self._exchanged(target, args)
        if target is context_ops.CP_POSITIONS:
            return _cp_positions(args[0], *on_rank(args[1:], 0), grid=self.grid)
        if target is context_ops.CP_CAUSAL_ATTENTION:
            return self._cp_causal_attention(args, kwargs)
        if target is whole_sections.TAKE_SECTIONS:
            x, (dim, runs, sizes, whole, _) = args[0], on_rank(args[1:], 0)
            values = x.values if isinstance(x, PerRank) else [x] * self.ranks
            return PerRank([v.index_select(dim, section_order(runs, sizes, whole, self.tp,
                                                              self.grid.coordinate(i, TP)).to(v.device))
                            for i, v in enumerate(values)])
        if target is collectives.VOCAB_SHARD_IDS:
            return _vocab_shard_ids(args[0], *on_rank(args[1:], 0), grid=self.grid)
        if target is collectives.as_sharded_dtensor:
            return _as_sharded_dtensor(args[0], *on_rank(args[1:], 0))
        if target is operator.getitem and isinstance(args[0], PerRank) and args[0].sharded_dim is not None:
            raise NotImplementedError("autoshard: indexing into a loss-parallel output")
        if target is operator.getitem and isinstance(args[0], (tuple, list)) and isinstance(args[1], int):
            return args[0][args[1]]  # an entry of what a nested graph returned: the value itself, as it is
        return self._per_rank(lambda a, k: self._call(target, a, k), args, kwargs)

    def _grouped(self, axis: str, values: list[PerRank], collective) -> PerRank:
        """``collective(tally, values)`` run within each group of ``axis``, on its ranks' values; the
        traffic of one group is tallied (per rank, as a real rank counts it)."""
        out: list = [None] * self.ranks
        sharded_dim = None
        for k, group in enumerate(self.grid.groups(axis)):
            result = collective(self.tally if k == 0 else Tally(),
                                [PerRank([v.values[i] for i in group]) for v in values])
            for i, value in zip(group, result.values, strict=True):
                out[i] = value
            sharded_dim = result.sharded_dim
        return PerRank(out, sharded_dim)

    def _exchanged(self, target, args) -> PerRank:
        """ep's dispatch or combine within each ep group: the routing worked out on every rank's ids,
        the rows moved as the all-to-all moves them, and the backward the op's own (the other
        exchange, with the experts' gradient share)."""
        rows = args[0]
        if isinstance(rows.values[0], FakeTensor):
            return self._exchanged_shapes(target, args)
        out: list = [None] * self.ranks
        for k, group in enumerate(self.grid.groups(EP)):
            tally = self.tally if k == 0 else Tally()  # one group's traffic, as a real rank counts it
            if target is token_dispatch.EP_DISPATCH:
                num_experts = on_rank(args[2], 0)
                share = on_rank(args[4], 0) if len(args) > 4 else 1.0
                by_offsets = on_rank(args[5], 0) if len(args) > 5 else False
                result = _ep_dispatch(tally, [rows.values[i] for i in group], [args[1].values[i] for i in group],
                                      num_experts, share, by_offsets)
            else:
                handles = [tuple(args[j].values[i] for j in range(1, 5)) for i in group]
                share = on_rank(args[6], 0) if len(args) > 6 else 1.0
                result = _ep_combine(tally, [rows.values[i] for i in group], handles, share)
            for i, value in zip(group, result, strict=True):
                out[i] = value
        return PerRank(out)

    def _exchanged_shapes(self, target, args) -> PerRank:
        """The exchange on fake tensors (shapes only, as pipeline planning runs the code): which rows go
        where is data, so every rank is taken to receive as many rows as it sends, as under balanced
        routing; the values a boundary carries (the combine's output) have their true shape anyway."""
        ep = self.grid.size(EP)

        def dispatch(rows, num_experts):
            long = dict(dtype=torch.int64, device=rows.device)
            count = rows.shape[0]
            return (rows.clone(), torch.zeros((count,), **long),
                    torch.full((num_experts // ep,), count, dtype=torch.int32, device=rows.device),
                    torch.arange(count, **long), torch.arange(count, **long),
                    torch.full((ep,), count // ep, **long), torch.full((ep,), count // ep, **long))

        if target is token_dispatch.EP_DISPATCH:
            num_experts = on_rank(args[2], 0)
            return PerRank([dispatch(rows, num_experts) for rows in args[0].values])
        return PerRank([rows.clone() for rows in args[0].values])

    def _cp_causal_attention(self, args, kwargs) -> PerRank:
        """k and v gathered over the cp ranks (again in backward, then their gradients
        reduce-scattered), each rank's chunks attending with its own cp rank."""
        q, k, v, cp, group, *rest = args
        keys, values = (self._grouped(CP, [x], lambda tally, xs: _cp_gather(tally, xs[0].values, -2, cp, group,
                                                                             regather=True)) for x in (k, v))

        def one(rank):
            local = map_aggregate(on_rank((q, keys, values, rest, kwargs), rank),
                                  lambda a: _as_simulated(a, self.widen))
            return context_ops.causal_chunks_attention(*local[:3], self.grid.coordinate(rank, CP), cp, *local[3],
                                                       **local[4])

        return PerRank([one(rank) for rank in range(self.ranks)])

    def call_method(self, target, args, kwargs):
        return self._per_rank(lambda a, k: getattr(a[0], target)(*a[1:], **k), args, kwargs)

    def call_module(self, target, args, kwargs):
        module = self.fetch_attr(target)
        if isinstance(module, fx.GraphModule):
            # a pipeline stage holds its parameters at the model's own FQNs (passes.stages.stitched)
            prefix = self.prefix if getattr(module, "holds_model_fqns", False) else f"{self.prefix}{target}."
            nested = RankSimulator(module, self.grid, self.param, prefix, self.values, self.tally, self.widen)
            return nested.run(*args, **kwargs)
        return self._per_rank(lambda a, k: module(*a, **k), args, kwargs)

    def _per_rank(self, fn, args, kwargs) -> PerRank:
        def local(a):
            return _as_simulated(a, self.widen)

        return PerRank([fn(*map_aggregate((on_rank(args, r), on_rank(kwargs, r)), local)) for r in range(self.ranks)])

    @staticmethod
    def _call(target, args, kwargs):
        ran, value = _without_randomness(target, args, kwargs)
        if ran:
            return value
        try:
            return target(*args, **kwargs)
        except (NotImplementedError, RuntimeError) as err:
            if not _MISSING_KERNEL.search(str(err)):
                raise
            return _in_float32(target, args, kwargs)


# the CPU has no kernel for this op in this dtype ("histogram_cpu" for int, an FFT for bf16)
_MISSING_KERNEL = re.compile(r"not implemented for '\w+'|Unsupported dtype \w+")


def _in_float32(target, args, kwargs):
    """An op the CPU lacks a kernel for in its inputs' dtype (an accelerator has one: MoE
    routing's ``histc`` of int expert ids, bf16 FFTs) runs on float32 copies, and its result is
    rounded back to the first input's dtype, as the op computes in it. The proof runs on the
    CPU whatever device the model trains on, so this only decides where the proof can run."""
    tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    dtype = tensors[0].dtype if tensors else None

    def up(a):
        return a.float() if isinstance(a, torch.Tensor) and not a.is_complex() and a.dtype != torch.bool else a

    result = target(*pytree.tree_map(up, args), **pytree.tree_map(up, kwargs))
    return pytree.tree_map(lambda r: r.to(dtype) if isinstance(r, torch.Tensor) and r.dtype == torch.float32
                           and dtype is not None else r, result)
