"""The context-parallel ops: one cp rank's positions and the two collectives over the ``cp`` axis.

Under context parallelism each rank of a cp group holds ``2 * cp`` chunks' worth of the sequence
in the load-balanced order Megatron and torch use: rank ``r`` holds chunks ``r`` and
``2*cp - 1 - r``, so under a causal mask every rank attends to the same number of keys. A dim cut
this way is called *cut*; its local length is ``seq // cp`` and its entries are the global
positions :func:`local_positions` gives.

=====================  ===========================================  =========================
op                     forward                                      backward
=====================  ===========================================  =========================
``cp_positions``       this rank's global positions (int64)         (none: integer)
``cp_gather``          all-gather a cut dim, in global order        reduce-scatter (sum)
``cp_all_reduce``      sum over the cp ranks                        all-reduce (sum)
``cp_causal_attention``  all-gather k, v; causal attention of this  all-gather k, v again,
                         rank's queries over them                     attention again,
                                                                      reduce-scatter dk, dv
=====================  ===========================================  =========================

Each backward is its forward's adjoint: every cp rank back-propagates its own copy of the loss, so
the sum over the cp ranks of a parameter's gradients is ``cp`` times the single-device gradient,
and FSDP, which averages gradients over ``dp x cp``, leaves exactly the data-parallel mean
(``docs/context-parallel.md``). Groups are named by ``ProcessGroup.group_name``, and the cp size is
an argument so that shapes are known without a process group (planning, fake tensors).
"""

from __future__ import annotations

import torch

from autoshard.runtime.collectives import _group_rank

_LIB = "autoshard"


def chunk_length(seq: int, cp: int) -> int:
    """The length of one of the ``2 * cp`` chunks of a sequence of ``seq`` positions."""
    return seq // (2 * cp)


def local_positions(rank: int, cp: int, seq: int, device=None, balanced: bool = True) -> torch.Tensor:
    """Rank ``rank``'s global positions: chunk ``rank`` then chunk ``2*cp - 1 - rank`` (or, not
    ``balanced``, the ``rank``-th of ``cp`` contiguous pieces)."""
    if not balanced:
        return torch.arange(rank * (seq // cp), (rank + 1) * (seq // cp), device=device)
    chunk = chunk_length(seq, cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, last])


def slot_of_chunk(cp: int) -> list[int]:
    """For each global chunk, its slot among the ranks' gathered chunks (rank-major, two per rank)."""
    return [2 * c if c < cp else 2 * (2 * cp - 1 - c) + 1 for c in range(2 * cp)]


def chunk_of_slot(cp: int) -> list[int]:
    """For each slot of the gathered chunks (rank-major), its global chunk."""
    slots = slot_of_chunk(cp)
    inverse = [0] * (2 * cp)
    for chunk, slot in enumerate(slots):
        inverse[slot] = chunk
    return inverse


def _reorder(x: torch.Tensor, dim: int, cp: int, order: list[int]) -> torch.Tensor:
    """``x`` with its ``dim`` (``2 * cp`` equal chunks) in ``order``: chunk ``i`` of the result is
    chunk ``order[i]`` of ``x``."""
    dim = dim % x.dim()
    chunks = x.unflatten(dim, (2 * cp, x.shape[dim] // (2 * cp)))
    picked = chunks.index_select(dim, torch.tensor(order, device=x.device))
    return torch.ops.aten._unsafe_view(picked, x.shape)  # a tensor of its own, not a view (a model's output)


def to_global_order(gathered: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """The ranks' chunks, concatenated rank after rank along ``dim``, put in sequence order."""
    return _reorder(gathered, dim, cp, slot_of_chunk(cp))


def to_rank_order(whole: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """A whole sequence along ``dim`` with its chunks in rank order (rank 0's two, then rank 1's, ...)."""
    return _reorder(whole, dim, cp, chunk_of_slot(cp))


# --- cp_positions: this rank's global positions --------------------------------


@torch.library.custom_op(f"{_LIB}::cp_positions", mutates_args=())
def cp_positions(like: torch.Tensor, seq: int, cp: int, group_name: str, balanced: bool = True) -> torch.Tensor:
    """The global positions of this rank's part of a sequence of ``seq``, on ``like``'s device."""
    return local_positions(_group_rank(group_name), cp, seq, like.device, balanced)


@cp_positions.register_fake
def _(like, seq, cp, group_name, balanced=True):
    return like.new_empty((seq // cp,), dtype=torch.int64)


# --- cp_gather: all-gather of a cut dim, in sequence order; reduce-scatter backward ---


def _gather(x: torch.Tensor, dim: int, cp: int, group_name: str) -> torch.Tensor:
    dim = dim % x.dim()
    stacked = torch.ops._c10d_functional.all_gather_into_tensor(x.movedim(dim, 0).contiguous(), cp, group_name)
    stacked = torch.ops._c10d_functional.wait_tensor(stacked).movedim(0, dim)
    return to_global_order(stacked, dim, cp)


def _scatter_sum(grad: torch.Tensor, dim: int, cp: int, group_name: str) -> torch.Tensor:
    dim = dim % grad.dim()
    ranked = to_rank_order(grad, dim, cp).movedim(dim, 0).contiguous()
    out = torch.ops._c10d_functional.reduce_scatter_tensor(ranked, "sum", cp, group_name)
    return torch.ops._c10d_functional.wait_tensor(out).movedim(0, dim).contiguous()


@torch.library.custom_op(f"{_LIB}::cp_gather", mutates_args=())
def cp_gather(x: torch.Tensor, dim: int, cp: int, group_name: str) -> torch.Tensor:
    """Every cp rank's part of ``x``'s cut ``dim``, the whole sequence in order (keys and values
    for attention, an output returned whole)."""
    return _gather(x, dim, cp, group_name)


@cp_gather.register_fake
def _(x, dim, cp, group_name):
    shape = list(x.shape)
    shape[dim] *= cp
    return x.new_empty(shape)


def _cp_gather_backward(ctx, grad):
    return _scatter_sum(grad, ctx.dim, ctx.cp, ctx.group_name), None, None, None


def _keep_gather(ctx, inputs, output):
    ctx.dim, ctx.cp, ctx.group_name = inputs[1], inputs[2], inputs[3]


cp_gather.register_autograd(_cp_gather_backward, setup_context=_keep_gather)


# --- cp_all_reduce: a sum over the cp ranks; all-reduce backward -------------------


def _all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    out = torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


@torch.library.custom_op(f"{_LIB}::cp_all_reduce", mutates_args=())
def cp_all_reduce(x: torch.Tensor, cp: int, group_name: str) -> torch.Tensor:
    """A sum over a cut dim finished across the cp ranks (a loss's token sum, its token count)."""
    return _all_reduce(x, group_name)


@cp_all_reduce.register_fake
def _(x, cp, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)  # as the real one: of ``x.contiguous()``


def _cp_all_reduce_backward(ctx, grad):
    return _all_reduce(grad, ctx.group_name), None, None


def _keep_group(ctx, inputs, output):
    ctx.group_name = inputs[2]


cp_all_reduce.register_autograd(_cp_all_reduce_backward, setup_context=_keep_group)

CP_POSITIONS = torch.ops.autoshard.cp_positions.default
CP_GATHER = torch.ops.autoshard.cp_gather.default
CP_ALL_REDUCE = torch.ops.autoshard.cp_all_reduce.default


# --- cp_local_output: an output left cut, each rank's loss its share of the whole ---------


@torch.library.custom_op(f"{_LIB}::cp_local_output", mutates_args=())
def cp_local_output(x: torch.Tensor, cp: int) -> torch.Tensor:
    """A graph output returned cut (``context_output="local"``): the identity forward. Each rank's
    loss on it is a share of the whole batch's, so backward scales its gradient by ``cp``, which keeps
    every rank's parameter gradients what they are when every rank computes the whole loss."""
    return x.clone()


@cp_local_output.register_fake
def _(x, cp):
    return torch.empty_like(x)


cp_local_output.register_autograd(lambda ctx, grad: (grad * ctx.cp, None),
                                  setup_context=lambda ctx, inputs, output: setattr(ctx, "cp", inputs[1]))
CP_LOCAL_OUTPUT = torch.ops.autoshard.cp_local_output.default


# --- cp_causal_attention: this rank's two chunks of causal attention over the whole keys ------


def causal_chunks_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, cp: int,
                            scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """Causal attention of rank ``rank``'s two query chunks (global chunks ``rank`` and
    ``2*cp - 1 - rank``, ``[..., 2L, D]``) over the whole sequence's keys and values: chunk ``c``
    reads the first ``(c + 1) L`` keys only, the last ``L`` of them under a causal mask. Every rank
    reads ``(2 cp + 1) L^2`` (query, key) pairs."""
    chunk = q.shape[-2] // 2
    outs = []
    for i, c in enumerate((rank, 2 * cp - 1 - rank)):
        keys = (c + 1) * chunk
        mask = torch.ones(chunk, keys, dtype=torch.bool, device=q.device).tril(keys - chunk)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[..., i * chunk:(i + 1) * chunk, :], k[..., :keys, :], v[..., :keys, :], attn_mask=mask, scale=scale,
            enable_gqa=enable_gqa))
    return torch.cat(outs, dim=-2)


@torch.library.custom_op(f"{_LIB}::cp_causal_attention", mutates_args=())
def cp_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, group_name: str,
                        scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention(is_causal=True)`` of this rank's queries over every rank's keys
    and values: ``k`` and ``v`` (this rank's, cut) are all-gathered inside and never kept. Backward
    gathers them again, computes the attention again and reduce-scatters their gradients, so what a
    forward leaves for backward is this rank's q, k, v, as on one device for a cp-th of the tokens
    (one more all-gather of k and v per step buys the memory of the whole keys and values)."""
    keys, values = _gather(k, -2, cp, group_name), _gather(v, -2, cp, group_name)
    with torch.no_grad():
        return causal_chunks_attention(q, keys, values, _group_rank(group_name), cp, scale, enable_gqa)


@cp_causal_attention.register_fake
def _(q, k, v, cp, group_name, scale=None, enable_gqa=False):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _keep_attention(ctx, inputs, output):
    q, k, v, cp, group_name = inputs[:5]
    ctx.save_for_backward(q, k, v)
    ctx.cp, ctx.group_name = cp, group_name
    ctx.scale = inputs[5] if len(inputs) > 5 else None
    ctx.enable_gqa = inputs[6] if len(inputs) > 6 else False


def _cp_causal_attention_backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    cp, group = ctx.cp, ctx.group_name
    q = q.detach().requires_grad_()
    keys = _gather(k.detach(), -2, cp, group).requires_grad_()
    values = _gather(v.detach(), -2, cp, group).requires_grad_()
    with torch.enable_grad():
        out = causal_chunks_attention(q, keys, values, _group_rank(group), cp, ctx.scale, ctx.enable_gqa)
    dq, dkeys, dvalues = torch.autograd.grad(out, (q, keys, values), grad)
    return dq, _scatter_sum(dkeys, -2, cp, group), _scatter_sum(dvalues, -2, cp, group), None, None, None, None


cp_causal_attention.register_autograd(_cp_causal_attention_backward, setup_context=_keep_attention)
CP_CAUSAL_ATTENTION = torch.ops.autoshard.cp_causal_attention.default
