"""Expert parallelism's two exchanges: tokens to the ranks that hold their experts, and back.

Under expert parallelism each of the ``ep`` ranks of a group holds ``E / ep`` whole experts
(rank ``r`` the experts ``r * L .. (r + 1) * L - 1``, ``L = E / ep``) and routes its own tokens.
The model's router has already chosen an expert per row (a ``(token, choice)`` pair); the rows
travel, the routing stays the model's own code.

``ep_dispatch(rows, ids, num_experts, group)``:

1. sort this rank's rows by expert (stable: rows of one expert keep their order); the rows of the
   experts rank ``j`` holds are then one run, sent to ``j``;
2. exchange the per-expert counts (``all_to_all_single`` of ``E`` integers), so each rank knows
   how many rows of each of its experts every rank sends;
3. exchange the rows themselves (one ``all_to_all_single`` with uneven splits: dropless, no
   capacity, no padding);
4. reorder what arrived (source-major, each source's rows by expert) to expert-major, the order a
   grouped GEMM reads, and give each row its local expert id and each local expert its offset.

``ep_combine(out, handle..., group)`` undoes steps 4, 3 and 1 in reverse for the experts' outputs.
The two are each other's adjoints: dispatch's backward is a combine of the gradient and combine's
backward a dispatch of it, with the same counts, so the gradient of every row comes back to the rank
that sent it. Both are ``torch.library`` custom ops, so an emitted graph reads
``torch.ops.autoshard.ep_dispatch.default`` and the proof's simulator can replace the exchanges by
their one-process equivalent.

The handle (the two permutations and the send and receive counts) rides in the graph as integer
tensors between the pair, so nothing is kept in Python state between forward and backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

_LIB = "autoshard"


def _size_and_rank(group_name: str) -> tuple[int, int]:
    group = _resolve_process_group(group_name)
    return dist.get_world_size(group), dist.get_rank(group)


def _exchange(x: torch.Tensor, send: list[int], receive: list[int], group_name: str) -> torch.Tensor:
    """Rows ``x`` (split ``send`` per destination rank) exchanged; ``receive`` rows from each source."""
    out = torch.ops._c10d_functional.all_to_all_single(x.contiguous(), receive, send, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def routing(ids: torch.Tensor, num_experts: int, group_name: str):
    """Steps 1, 2 and 4's bookkeeping for ``ids`` (one expert per row): ``(order, arrival,
    send_counts, receive_counts, local_ids, local_offsets)``.

    ``order`` sorts this rank's rows by expert; ``arrival`` reorders the received rows
    (source-major) to expert-major; the counts are rows per peer rank; ``local_ids`` and
    ``local_offsets`` (each local expert's end, int32, as ``torch._grouped_mm`` reads ``offs``)
    describe the expert-major rows."""
    size, _ = _size_and_rank(group_name)
    local = num_experts // size
    flat = ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    per_expert = torch.bincount(flat, minlength=num_experts)
    arrived = _exchange(per_expert, [local] * size, [local] * size, group_name)  # [source, local expert]
    send = per_expert.view(size, local).sum(1)
    receive = arrived.view(size, local).sum(1)
    experts = torch.arange(local, device=ids.device).repeat(size)
    arrived_ids = torch.repeat_interleave(experts, arrived)  # source-major
    arrival = torch.argsort(arrived_ids, stable=True)
    local_ids = arrived_ids[arrival]
    local_offsets = torch.cumsum(arrived.view(size, local).sum(0), 0).to(torch.int32)
    return order, arrival, send, receive, local_ids, local_offsets


def expert_of_rows(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's expert, for rows sorted by expert with expert ``e``'s run ending at ``offsets[e]``."""
    positions = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, positions, right=True)


def rows_out(rows: torch.Tensor, order, arrival, send, receive, group_name: str) -> torch.Tensor:
    """This rank's rows to the ranks of their experts, expert-major (steps 1, 3 and 4)."""
    arrived = _exchange(rows[order], send.tolist(), receive.tolist(), group_name)
    return arrived[arrival]


def rows_back(rows: torch.Tensor, order, arrival, send, receive, group_name: str) -> torch.Tensor:
    """Expert-major rows back to the ranks that sent them, in their original order (4, 3, 1 undone)."""
    source_major = torch.empty_like(rows).index_copy(0, arrival, rows)
    returned = _exchange(source_major, receive.tolist(), send.tolist(), group_name)
    return torch.empty_like(returned).index_copy(0, order, returned)


# --- ep_dispatch: rows to their experts' ranks; backward brings the gradients back ----------


@torch.library.custom_op(f"{_LIB}::ep_dispatch", mutates_args=())
def ep_dispatch(
    rows: torch.Tensor, ids: torch.Tensor, num_experts: int, group_name: str, grad_share: float = 1.0,
    by_offsets: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(local_rows, local_ids, local_offsets, order, arrival, send, receive)``: ``rows[i]`` goes to
    expert ``ids[i]``; this rank receives the rows of its ``num_experts / ep`` experts, expert-major.
    ``grad_share``: see :func:`ep_combine`; the rows' gradients leave divided by it again.
    ``by_offsets``: ``ids`` are a grouped GEMM's offsets (the rows sorted by expert, expert ``e``'s
    run ending at ``ids[e]``), read as one id per row."""
    if by_offsets:
        ids = expert_of_rows(ids, rows.shape[0])
    order, arrival, send, receive, local_ids, local_offsets = routing(ids, num_experts, group_name)
    local_rows = rows_out(rows, order, arrival, send, receive, group_name)
    return local_rows, local_ids, local_offsets, order, arrival, send, receive


@ep_dispatch.register_fake
def _(rows, ids, num_experts, group_name, grad_share=1.0, by_offsets=False):
    ctx = torch.library.get_ctx()
    received = ctx.new_dynamic_size()
    size, _ = _size_and_rank(group_name)
    long = dict(dtype=torch.int64, device=rows.device)
    return (
        rows.new_empty((received, *rows.shape[1:])),
        torch.empty((received,), **long),
        torch.empty((num_experts // size,), dtype=torch.int32, device=rows.device),
        torch.empty((rows.shape[0],), **long),
        torch.empty((received,), **long),
        torch.empty((size,), **long),
        torch.empty((size,), **long),
    )


def _keep_routing(ctx, inputs, output):
    ctx.group_name = inputs[3]
    ctx.grad_share = inputs[4] if len(inputs) > 4 else 1.0
    ctx.save_for_backward(*output[3:])


def _dispatch_backward(ctx, grad_rows, *_):
    order, arrival, send, receive = ctx.saved_tensors
    grad = rows_back(grad_rows, order, arrival, send, receive, ctx.group_name)
    return (grad if ctx.grad_share == 1.0 else grad / ctx.grad_share), None, None, None, None, None


# --- ep_combine: the experts' outputs back; backward sends their gradients out again ---------


@torch.library.custom_op(f"{_LIB}::ep_combine", mutates_args=())
def ep_combine(
    rows: torch.Tensor, order: torch.Tensor, arrival: torch.Tensor, send: torch.Tensor, receive: torch.Tensor,
    group_name: str, grad_share: float = 1.0,
) -> torch.Tensor:
    """The experts' output rows (expert-major, as :func:`ep_dispatch` delivered them) back to the
    ranks that sent their inputs, each in the place its input row had.

    ``grad_share`` (``1 / ep``) scales the gradient entering the experts, and dispatch's backward
    undoes it on the way out, so only the expert weights' gradients keep it. An expert's weight
    gradient on its rank sums over every ep rank's rows that chose it, each rank's loss being the
    mean over its own batch: ``ep`` times the mean over the ep ranks' batches, which the dense
    weights get from FSDP's average. Scaling the rows' gradient costs an activation's multiply
    where scaling the weights' would keep a copy of every local expert."""
    return rows_back(rows, order, arrival, send, receive, group_name)


@ep_combine.register_fake
def _(rows, order, arrival, send, receive, group_name, grad_share=1.0):
    return rows.new_empty((order.shape[0], *rows.shape[1:]))


def _keep_handle(ctx, inputs, output):
    ctx.group_name = inputs[5]
    ctx.grad_share = inputs[6] if len(inputs) > 6 else 1.0
    ctx.save_for_backward(*inputs[1:5])


def _combine_backward(ctx, grad):
    order, arrival, send, receive = ctx.saved_tensors
    grad = grad if ctx.grad_share == 1.0 else grad * ctx.grad_share
    return rows_out(grad, order, arrival, send, receive, ctx.group_name), None, None, None, None, None, None


ep_dispatch.register_autograd(_dispatch_backward, setup_context=_keep_routing)
ep_combine.register_autograd(_combine_backward, setup_context=_keep_handle)

EP_DISPATCH = torch.ops.autoshard.ep_dispatch.default
EP_COMBINE = torch.ops.autoshard.ep_combine.default
