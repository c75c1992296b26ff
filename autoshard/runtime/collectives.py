"""The four tensor-parallel collectives autoshard inserts into a graph.

Each is a ``torch.library`` custom op, so an emitted graph reads
``torch.ops.autoshard.reduce_partial.default(...)`` and the op stays one opaque,
named node under ``torch.export``, dynamo and AOTAutograd. Each pairs a forward
with the backward that makes single-device gradients come out right when every
tp rank computes the same loss from replicated outputs:

==================  ==========================  ==========================
op                  forward                     backward
==================  ==========================  ==========================
``enter_tp``        identity                    all-reduce (sum)
``reduce_partial``  all-reduce (sum)            identity
``gather_shards``   all-gather along ``dim``    keep this rank's chunk
``take_shard``      keep this rank's chunk      all-gather along ``dim``
==================  ==========================  ==========================

``enter_tp`` marks the replicated input of a group of colwise linears: their
input-gradients are partial sums, added locally by autograd and all-reduced
once here. ``reduce_partial`` closes a rowwise linear. ``gather_shards`` ends a
sharded region whose consumer needs the full tensor (embedding output, LM head
logits). ``take_shard`` starts a sharded region from a replicated value; ``take_shards`` does it for
several values one op reads (k and v), whose gradients then share one all-gather.

With sequence parallelism the residual stream is sharded over the sequence:
``reduce_scatter_partial`` (reduce-scatter forward, all-gather backward)
closes a rowwise linear, and ``gather_for_colwise`` (all-gather forward,
reduce-scatter backward) opens a colwise group.

``vocab_shard_ids`` is no collective: it maps token ids onto this rank's rows
of a vocabulary-sharded embedding (the tied-embedding layout), whose masked
lookup is then closed by ``reduce_partial``.

Groups are named by ``ProcessGroup.group_name`` (the functional-collective
convention), so the ops carry no Python objects and trace cleanly.

Every op that sums partial values (``enter_tp``'s backward, ``reduce_partial``,
``reduce_scatter_partial``, ``gather_for_colwise``'s backward) takes an optional
``reduce_dtype``: under a mixed-precision policy activations are bf16, and these
sums are taken in ``reduce_dtype`` as FSDP2 does for gradients, yet the values
travel in bf16. Each rank's partial sum is already a bf16 value, so sending it
as is loses nothing; only the adding must be wide. A reduce-scatter is one
all-to-all of the bf16 chunks, each rank adding the chunks it receives in
``reduce_dtype``; an all-reduce is that, then an all-gather of the bf16 sums
(on two ranks a plain bf16 all-reduce: its one addition rounds once either
way). The result is the fp32 sum rounded once, as upcasting and reducing in
fp32 gives, at half the wire bytes. Gathers and cuts move values unchanged and
need none.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _resolve_process_group

from autoshard.core.sharding import Wire, sum_on_wire, widens

_LIB = "autoshard"


def _group_size(group_name: str) -> int:
    return dist.get_world_size(_resolve_process_group(group_name))


def _group_rank(group_name: str) -> int:
    return dist.get_rank(_resolve_process_group(group_name))


def _all_reduce_sum(x: torch.Tensor, group_name: str, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum over ranks; added in ``reduce_dtype`` when it is wider than ``x``, sent as ``x``."""
    size = _group_size(group_name)
    if sum_on_wire(Wire.ALL_REDUCE, widens(x.dtype, reduce_dtype), size) == (Wire.ALL_REDUCE,):
        out = torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group_name)
        return torch.ops._c10d_functional.wait_tensor(out)
    flat = x.contiguous().view(-1)
    pad = -flat.numel() % size
    mine = _added_chunks(F.pad(flat, (0, pad)) if pad else flat, size, group_name, reduce_dtype)
    full = torch.ops._c10d_functional.all_gather_into_tensor(mine, size, group_name)
    full = torch.ops._c10d_functional.wait_tensor(full)
    return full[: flat.numel()].view(x.shape)


def _added_chunks(stacked: torch.Tensor, size: int, group_name: str, reduce_dtype: torch.dtype) -> torch.Tensor:
    """Rank ``r``'s chunk of the sum: the ``size`` equal chunks of ``stacked`` (flat, chunk ``r``
    for rank ``r``) exchanged as they are, then added here in ``reduce_dtype``."""
    chunk = stacked.numel() // size
    parts = torch.ops._c10d_functional.all_to_all_single(stacked, [chunk] * size, [chunk] * size, group_name)
    parts = torch.ops._c10d_functional.wait_tensor(parts)
    return parts.view(size, chunk).to(reduce_dtype).sum(0).to(stacked.dtype)


def _all_gather(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    size = _group_size(group_name)
    stacked = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), size, group_name)
    stacked = torch.ops._c10d_functional.wait_tensor(stacked)
    if dim % x.dim() == 0:
        return stacked
    return torch.cat(torch.chunk(stacked, size, dim=0), dim=dim)


def _reduce_scatter(
    x: torch.Tensor, dim: int, group_name: str, reduce_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Sum over ranks, keep this rank's chunk along ``dim`` (added in ``reduce_dtype`` when it
    is wider than ``x``: the chunks exchanged as they are, then added here)."""
    size = _group_size(group_name)
    stacked = torch.cat(torch.chunk(x, size, dim=dim), dim=0).contiguous()
    if widens(x.dtype, reduce_dtype):
        shape = _chunk_shape(x, dim, group_name)
        return _added_chunks(stacked.view(-1), size, group_name, reduce_dtype).view(shape)
    out = torch.ops._c10d_functional.reduce_scatter_tensor(stacked, "sum", size, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def _chunk(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    size, rank = _group_size(group_name), _group_rank(group_name)
    return torch.chunk(x, size, dim=dim)[rank].clone(memory_format=torch.contiguous_format)  # never an alias


def _gathered_shape(x: torch.Tensor, dim: int, group_name: str) -> list[int]:
    shape = list(x.shape)
    shape[dim] = shape[dim] * _group_size(group_name)
    return shape


def _chunk_shape(x: torch.Tensor, dim: int, group_name: str) -> list[int]:
    shape = list(x.shape)
    shape[dim] = shape[dim] // _group_size(group_name)
    return shape


# --- enter_tp: identity forward, all-reduce backward -------------------------


@torch.library.custom_op(f"{_LIB}::enter_tp", mutates_args=())
def enter_tp(x: torch.Tensor, group_name: str, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Replicated input of colwise linears; sums their partial input-gradients once."""
    return x.clone()


@enter_tp.register_fake
def _(x, group_name, reduce_dtype=None):
    return torch.empty_like(x)


def _enter_tp_backward(ctx, grad):
    return _all_reduce_sum(grad, ctx.group_name, ctx.reduce_dtype), None, None


# --- enter_tps: enter_tp of several tensors, one all-reduce backward -----------


@torch.library.custom_op(f"{_LIB}::enter_tps", mutates_args=())
def enter_tps(xs: list[torch.Tensor], group_name: str, reduce_dtype: torch.dtype | None) -> list[torch.Tensor]:
    """``enter_tp`` of every tensor of ``xs`` (a block's replicated weights read by its cut heads:
    q/k norm weights, a per-head output norm's): their partial gradients arrive by the end of the
    block's backward and are summed in one all-reduce. ``reduce_dtype`` has no default: a tensor
    list op's backward must answer every argument the dispatcher passes, and it drops defaults."""
    return [x.clone() for x in xs]


@enter_tps.register_fake
def _(xs, group_name, reduce_dtype):
    return [torch.empty_like(x) for x in xs]


def _enter_tps_backward(ctx, grads):
    grads = _zeros_for_missing(ctx, grads)
    flat = torch.cat([g.reshape(-1) for g in grads])
    summed = _all_reduce_sum(flat, ctx.group_name, ctx.reduce_dtype)
    pieces = torch.split(summed, [g.numel() for g in grads])
    return [piece.view(g.shape) for piece, g in zip(pieces, grads, strict=True)], None, None


def _keep_entered(ctx, inputs, output):
    """The group and what a missing gradient's zero is made like (each output's shape, dtype, device)."""
    ctx.group_name, ctx.reduce_dtype = inputs[1], inputs[2]
    _keep_outputs(ctx, output)


# --- reduce_partial: all-reduce forward, identity backward --------------------


@torch.library.custom_op(f"{_LIB}::reduce_partial", mutates_args=())
def reduce_partial(x: torch.Tensor, group_name: str, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Partial sums (a rowwise linear's output) to the replicated total."""
    return _all_reduce_sum(x, group_name, reduce_dtype)


@reduce_partial.register_fake
def _(x, group_name, reduce_dtype=None):
    return torch.empty_like(x)


def _reduce_partial_backward(ctx, grad):
    return grad, None, None


# --- gather_shards: all-gather forward, chunk backward ------------------------


@torch.library.custom_op(f"{_LIB}::gather_shards", mutates_args=())
def gather_shards(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """Shard(dim) to Replicate: concatenate every tp rank's chunk along ``dim``."""
    return _all_gather(x, dim, group_name)


@gather_shards.register_fake
def _(x, dim, group_name):
    return x.new_empty(_gathered_shape(x, dim, group_name))


def _gather_shards_backward(ctx, grad):
    return _chunk(grad, ctx.dim, ctx.group_name), None, None


# --- take_shard: chunk forward, all-gather backward ---------------------------


@torch.library.custom_op(f"{_LIB}::take_shard", mutates_args=())
def take_shard(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """Replicate to Shard(dim): keep this rank's chunk, no communication."""
    return _chunk(x, dim, group_name)


@take_shard.register_fake
def _(x, dim, group_name):
    return x.new_empty(_chunk_shape(x, dim, group_name))


def _take_shard_backward(ctx, grad):
    return _all_gather(grad, ctx.dim, ctx.group_name), None, None


# --- take_shards: take_shard of several tensors, one all-gather backward ---------------


@torch.library.custom_op(f"{_LIB}::take_shards", mutates_args=())
def take_shards(xs: list[torch.Tensor], dim: int, group_name: str) -> list[torch.Tensor]:
    """``take_shard`` of every tensor of ``xs`` (the k and v one attention reads): their
    gradients arrive together and travel in one all-gather."""
    return [_chunk(x, dim, group_name) for x in xs]


@take_shards.register_fake
def _(xs, dim, group_name):
    return [x.new_empty(_chunk_shape(x, dim, group_name)) for x in xs]


def _take_shards_backward(ctx, grads):
    return _all_gather_many(_zeros_for_missing(ctx, grads), ctx.dim, ctx.group_name), None, None


def _keep_shards(ctx, inputs, output):
    ctx.dim, ctx.group_name = inputs[1], inputs[2]
    _keep_outputs(ctx, output)


def _keep_outputs(ctx, output: list[torch.Tensor]) -> None:
    """What a missing gradient's zero is made like: each output's shape, dtype and device."""
    ctx.shapes = [tuple(o.shape) for o in output]
    ctx.dtypes = [o.dtype for o in output]
    ctx.devices = [o.device for o in output]


def _zeros_for_missing(ctx, grads) -> list[torch.Tensor]:
    """A list op's output gradients, zeros (as :func:`_keep_outputs` kept) for the unused outputs."""
    return [g if g is not None else torch.zeros(s, dtype=d, device=dev)
            for g, s, d, dev in zip(grads, ctx.shapes, ctx.dtypes, ctx.devices, strict=True)]


def _all_gather_many(xs: list[torch.Tensor], dim: int, group_name: str) -> list[torch.Tensor]:
    """Each of ``xs`` all-gathered along ``dim``, in one collective: flattened, concatenated (in
    the first one's dtype when they share it), gathered once, split back per rank."""
    if len({x.dtype for x in xs}) > 1:
        return [_all_gather(x, dim, group_name) for x in xs]
    size = _group_size(group_name)
    flat = torch.cat([x.contiguous().view(-1) for x in xs])
    stacked = torch.ops._c10d_functional.all_gather_into_tensor(flat, size, group_name)
    per_rank = torch.ops._c10d_functional.wait_tensor(stacked).view(size, -1)
    out, start = [], 0
    for x in xs:
        pieces = per_rank[:, start : start + x.numel()].reshape(size, *x.shape)
        out.append(torch.cat(pieces.unbind(0), dim=dim))
        start += x.numel()
    return out


# --- sequence parallel: reduce_scatter_partial and gather_for_colwise -------------


@torch.library.custom_op(f"{_LIB}::reduce_scatter_partial", mutates_args=())
def reduce_scatter_partial(
    x: torch.Tensor, dim: int, group_name: str, reduce_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Partial sums (a rowwise output) to their total, sharded along ``dim`` (the sequence)."""
    return _reduce_scatter(x, dim, group_name, reduce_dtype)


@reduce_scatter_partial.register_fake
def _(x, dim, group_name, reduce_dtype=None):
    return x.new_empty(_chunk_shape(x, dim, group_name))


def _reduce_scatter_partial_backward(ctx, grad):
    return _all_gather(grad, ctx.dim, ctx.group_name), None, None, None


@torch.library.custom_op(f"{_LIB}::gather_for_colwise", mutates_args=())
def gather_for_colwise(
    x: torch.Tensor, dim: int, group_name: str, reduce_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A sequence-sharded input of colwise linears, all-gathered; their partial
    input-gradients are summed and scattered back in one reduce-scatter."""
    return _all_gather(x, dim, group_name)


@gather_for_colwise.register_fake
def _(x, dim, group_name, reduce_dtype=None):
    return x.new_empty(_gathered_shape(x, dim, group_name))


def _gather_for_colwise_backward(ctx, grad):
    return _reduce_scatter(grad, ctx.dim, ctx.group_name, ctx.reduce_dtype), None, None, None


# --- vocab_shard_ids: this rank's rows of a vocabulary-sharded table -----------


@torch.library.custom_op(f"{_LIB}::vocab_shard_ids", mutates_args=())
def vocab_shard_ids(ids: torch.Tensor, rows_per_rank: int, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local_ids, in_shard)``: ids relative to this rank's vocabulary rows (0 where
    the row lives elsewhere) and a ``[..., 1]`` bool mask of the ids it holds (bool, so
    the masked lookup keeps its own dtype: bf16 under mixed precision)."""
    local = ids - _group_rank(group_name) * rows_per_rank
    in_shard = (local >= 0) & (local < rows_per_rank)
    return torch.where(in_shard, local, 0), in_shard.unsqueeze(-1)


@vocab_shard_ids.register_fake
def _(ids, rows_per_rank, group_name):
    return torch.empty_like(ids), ids.new_empty((*ids.shape, 1), dtype=torch.bool)


# --- as_sharded_dtensor: a graph output left sharded (loss parallel) -------------

_MESH_OF_GROUP: dict[tuple[str, str], object] = {}


@torch.fx.wrap
def as_sharded_dtensor(x: torch.Tensor, dim: int, group_name: str):
    """The local shard ``x`` as a DTensor ``Shard(dim)`` on the tp group's mesh.

    For outputs a loss consumes sharded (``loss_parallel``): no communication;
    the DTensor's gradient comes back as this rank's shard.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    key = (group_name, x.device.type)
    if key not in _MESH_OF_GROUP:
        group = _resolve_process_group(group_name)
        _MESH_OF_GROUP[key] = DeviceMesh.from_group(group, x.device.type, mesh_dim_names=("tp",))
    return DTensor.from_local(x, _MESH_OF_GROUP[key], [Shard(dim)], run_check=False)


def _keep_group(ctx, inputs, output):
    ctx.group_name = inputs[1]
    ctx.reduce_dtype = inputs[2] if len(inputs) > 2 else None


def _keep_dim_and_group(ctx, inputs, output):
    ctx.dim, ctx.group_name = inputs[1], inputs[2]
    ctx.reduce_dtype = inputs[3] if len(inputs) > 3 else None


# Each op, its backward and what the backward keeps of the forward. Autograd runs a backward with
# torch's function modes off (torch.set_default_device is one), so a test that wants these backwards
# under a mode registers them again, wrapped, from this table.
AUTOGRAD = (
    (enter_tp, _enter_tp_backward, _keep_group),
    (enter_tps, _enter_tps_backward, _keep_entered),
    (reduce_partial, _reduce_partial_backward, _keep_group),
    (gather_shards, _gather_shards_backward, _keep_dim_and_group),
    (take_shard, _take_shard_backward, _keep_dim_and_group),
    (take_shards, _take_shards_backward, _keep_shards),
    (reduce_scatter_partial, _reduce_scatter_partial_backward, _keep_dim_and_group),
    (gather_for_colwise, _gather_for_colwise_backward, _keep_dim_and_group),
)
for _op, _backward, _keep in AUTOGRAD:
    _op.register_autograd(_backward, setup_context=_keep)

ENTER_TP = torch.ops.autoshard.enter_tp.default
ENTER_TPS = torch.ops.autoshard.enter_tps.default
REDUCE_PARTIAL = torch.ops.autoshard.reduce_partial.default
GATHER_SHARDS = torch.ops.autoshard.gather_shards.default
TAKE_SHARD = torch.ops.autoshard.take_shard.default
TAKE_SHARDS = torch.ops.autoshard.take_shards.default
VOCAB_SHARD_IDS = torch.ops.autoshard.vocab_shard_ids.default
REDUCE_SCATTER_PARTIAL = torch.ops.autoshard.reduce_scatter_partial.default
GATHER_FOR_COLWISE = torch.ops.autoshard.gather_for_colwise.default

FORWARD_COLLECTIVES = (REDUCE_PARTIAL, GATHER_SHARDS)
BACKWARD_COLLECTIVES = (ENTER_TP, ENTER_TPS, TAKE_SHARD, TAKE_SHARDS)


def op_of(kind) -> object:
    """The op that runs a :class:`~autoshard.core.sharding.Step` kind (the vocabulary names it by
    ``op_name``; the ops live here, on the runtime side)."""
    return globals()[kind.op_name]
