"""Activation checkpointing per FSDP block: ``"full"`` or ``"selective"``.

Each block's GraphModule runs under ``torch.utils.checkpoint`` (non-reentrant)
inside its FSDP unit: FSDP2's hooks gather the block's parameters around the
call, and the recomputation in backward runs while they are gathered for the
backward anyway, so checkpointing adds no dp traffic.

``"full"`` keeps only the block's inputs and recomputes everything in backward,
including its forward tp collectives: every all-reduce of a rowwise output runs
again (counted by :class:`autoshard.adapters.comm_stats.CollectiveCounter`).
Checkpointing recomputes up to the last tensor backward needs (PyTorch's early
stop), so a block's final all-reduce, whose output nothing saves, does not run
again: one extra all-reduce per Llama block, not two.
``"selective"`` saves the outputs of matmuls, of attention and of every
forward tp collective, and recomputes the cheap rest (norms, activations,
rotary, elementwise): backward then issues no tp collective beyond the
gradients' own.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import autoshard.runtime.collectives as collectives

MODES = ("full", "selective")

aten = torch.ops.aten
# Recomputing these costs a GEMM, an attention or a collective: selective mode keeps their outputs.
_SAVED = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_cudnn_attention.default,
    collectives.REDUCE_PARTIAL,
    collectives.GATHER_SHARDS,
    collectives.REDUCE_SCATTER_PARTIAL,
    collectives.GATHER_FOR_COLWISE,
}


def _policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_policy)


def apply_activation_checkpointing(blocks: dict[str, fx.GraphModule], mode: str | None) -> None:
    """Run every block's forward under checkpointing (``mode`` "full" or "selective")."""
    if mode is None:
        return
    for gm in blocks.values():
        gm.forward = checkpointed(gm.forward, mode)


def checkpointed(forward, mode: str):
    """``forward`` run under checkpointing (``mode`` "full" or "selective"): a compiled block's
    function as well as a GraphModule's (the selective policy reads the ops it runs)."""
    assert mode in MODES, mode
    extra = {"context_fn": _selective_contexts} if mode == "selective" else {}
    return functools.partial(_checkpointed, forward, extra)


def _checkpointed(forward, extra: dict, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)
