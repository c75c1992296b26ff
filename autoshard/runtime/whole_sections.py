"""The ops of a fused projection whose sections are not all cut alike over tp.

A fused q|k|v projection with fewer k/v heads than tp ranks (torchtitan's Llama-3 ``wqkv`` with 2 kv
heads on tp=4, Phi-3's ``qkv_proj``, multi-query attention's one kv head) cannot cut its k and v
sections by heads. They are computed whole on every rank instead and cut per q head afterwards, as
separate k/v projections are (:func:`~autoshard.passes.decompose.expand_gqa_for_tp`), while its q
section is cut as usual. Two ops make that one graph:

=============================  =================================================  ===========================
op                             forward                                            backward
=============================  =================================================  ===========================
``fused_split``                the columns of ``x`` in the given runs, split      the gradients put back in
                               into sections (a fused output's q, k, v)           their columns
``matmul_input_grad_scaled``   ``x @ w``                                          ``dw = x.T dy``,
                                                                                  ``dx = scale * dy @ w.T``
``take_sections``              this rank's columns of a replicated ``x``, in the  none (only values that
                               projection's stored order                          carry no gradient)
=============================  =================================================  ===========================

``fused_split`` is how :mod:`autoshard.passes.sections` writes any fused output (a view to groups
and a split along them, slices, index lists) as one op whose sections are contiguous once the
projection's stored columns follow ``runs``. ``matmul_input_grad_scaled`` computes a whole
section: its input's gradient is whole on every rank, and is summed over the tp ranks together
with the cut sections' partial one, so it enters that sum as ``1 / tp`` of itself (``scale``);
its weight's gradient stays whole.
"""

from __future__ import annotations

import torch

_LIB = "autoshard"


def section_columns(runs: list[int], sizes: list[int]) -> list[torch.Tensor]:
    """Each section's column indices of the fused dim: ``runs`` (``[start0, stop0, start1, ...]``)
    concatenated, cut into ``sizes``."""
    columns = torch.cat([torch.arange(a, b, device="cpu") for a, b in zip(runs[::2], runs[1::2], strict=True)])
    return list(columns.split(list(sizes)))


@torch.library.custom_op(f"{_LIB}::fused_split", mutates_args=())
def fused_split(x: torch.Tensor, runs: list[int], sizes: list[int], heads: list[int]) -> list[torch.Tensor]:
    """The sections of a fused last dim: section ``i`` holds ``sizes[i]`` columns of ``x``, taken in
    the order ``runs`` lists them; ``heads[i]`` is how many heads it has (a rule cuts a section
    over tp only by whole heads)."""
    return [x.index_select(-1, cols.to(x.device)) for cols in section_columns(runs, sizes)]


@fused_split.register_fake
def _(x, runs, sizes, heads):
    return [x.new_empty((*x.shape[:-1], size)) for size in sizes]


def _fused_split_backward(ctx, grads):
    grad = None
    for cols, g in zip(section_columns(ctx.runs, ctx.sizes), grads, strict=True):
        if g is None:
            continue
        if grad is None:
            grad = g.new_zeros((*g.shape[:-1], ctx.width))
        grad.index_copy_(-1, cols.to(g.device), g)
    return grad, None, None, None


def _keep_split(ctx, inputs, output):
    ctx.runs, ctx.sizes, ctx.width = inputs[1], inputs[2], inputs[0].shape[-1]


fused_split.register_autograd(_fused_split_backward, setup_context=_keep_split)
FUSED_SPLIT = torch.ops.autoshard.fused_split.default


@torch.library.custom_op(f"{_LIB}::matmul_input_grad_scaled", mutates_args=())
def matmul_input_grad_scaled(x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """``x @ w``, whose gradient reaches ``x`` scaled by ``scale`` (``w``'s is not scaled)."""
    return torch.matmul(x, w)


@matmul_input_grad_scaled.register_fake
def _(x, w, scale):
    return x.new_empty((*x.shape[:-1], w.shape[-1]))


def _matmul_backward(ctx, grad):
    x, w = ctx.saved_tensors
    grad_x = torch.matmul(grad, w.t()) * ctx.scale if ctx.needs_input_grad[0] else None
    grad_w = None
    if ctx.needs_input_grad[1]:
        grad_w = torch.matmul(x.reshape(-1, x.shape[-1]).t(), grad.reshape(-1, grad.shape[-1]))
    return grad_x, grad_w, None


def _keep_operands(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.scale = inputs[2]


matmul_input_grad_scaled.register_autograd(_matmul_backward, setup_context=_keep_operands)
MATMUL_INPUT_GRAD_SCALED = torch.ops.autoshard.matmul_input_grad_scaled.default


@torch.library.custom_op(f"{_LIB}::take_sections", mutates_args=())
def take_sections(x: torch.Tensor, dim: int, runs: list[int], sizes: list[int], whole: list[int],
                  group_name: str) -> torch.Tensor:
    """This tp rank's columns of a replicated ``x`` along ``dim``, in the order a fused projection
    stores its sections (:meth:`~autoshard.plans.plan.FusedSections.order`): a constant that multiplies a
    fused output before its split (Falcon-H1's per-section muP vector) must meet each column where
    the rank holds it. Planned only for values no gradient reaches, so it has no backward."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    tp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    return x.index_select(dim, section_order(runs, sizes, whole, tp, rank).to(x.device))


def section_order(runs: list[int], sizes: list[int], whole: list[int], tp: int, rank: int) -> torch.Tensor:
    """The original columns rank ``rank`` stores of a fused dim, in its stored order."""
    from autoshard.plans.plan import FusedSections

    order = FusedSections(tuple(sizes), tuple(whole), tuple(runs)).order(tp)
    return order.view(tp, -1)[rank]


@take_sections.register_fake
def _(x, dim, runs, sizes, whole, group_name):
    from torch.distributed.distributed_c10d import _resolve_process_group

    from autoshard.plans.plan import FusedSections

    tp = torch.distributed.get_world_size(_resolve_process_group(group_name))
    shape = list(x.shape)
    shape[dim] = sum(FusedSections(tuple(sizes), tuple(whole)).local_sizes(tp))
    return x.new_empty(shape)


TAKE_SECTIONS = torch.ops.autoshard.take_sections.default
