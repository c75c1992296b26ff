"""Hand-written 2-D (FSDP2 over dp x tensor parallel over tp) recipe for the example Llama.

This is the baseline autoshard is measured against, written the way
torchtitan parallelizes Llama with public torch APIs only:

* per block, ``parallelize_module`` on ``mesh["tp"]`` with ``ColwiseParallel``
  on ``attention.wq/wk/wv`` and ``feed_forward.w1/w3`` and ``RowwiseParallel``
  on ``attention.wo`` and ``feed_forward.w2``;
* ``tok_embeddings`` vocab-sharded (``RowwiseParallel(input_layouts=Replicate())``,
  output all-reduced) and the LM head ``output`` column-sharded with the
  logits gathered (``ColwiseParallel(output_layouts=Replicate())``);
* then ``fully_shard`` per block and on the root (root keeps its parameters
  between forward and backward) on ``mesh["dp"]``.

No sequence parallelism: the norms run replicated over tp, as autoshard's
graph does, so the two are compared on the same parallelism scheme.
All tp plan entries keep ``use_local_output=True`` (the default): the example
attention reshapes with ``.view(bsz, seq, -1, head_dim)``, which is correct on
the tp-local (head-sharded) tensors.

``compile_recipe_blocks`` is the compiled counterpart: each block's forward
compiled with one ``torch.compile`` backend, hooks and root eager.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def block_tp_plan() -> dict:
    """Megatron-style plan for one transformer block: colwise in, rowwise out (one all-reduce each)."""
    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def root_tp_plan() -> dict:
    """Embedding sharded over the vocabulary, LM head over its outputs with gathered logits."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }


def parallelize_recipe(
    model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None,
    checkpointing: str | None = None,
) -> nn.Module:
    """Apply tp then FSDP2 to ``model`` in place (the torchtitan order) and return it.

    tp must come first so FSDP2 shards the tp-local blocks on dim 0 of the
    already tp-sharded DTensors. ``mp_policy`` goes to every ``fully_shard``
    (PyTorch applies its ``reduce_dtype`` to FSDP's reductions only: TP's
    Partial -> Replicate all-reduce runs in the activations' dtype).
    ``checkpointing`` ("full" or "selective") runs each block under
    ``torch.utils.checkpoint`` as torchtitan does; selective saves matmul,
    attention and collective outputs.
    """
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp_mesh, root_tp_plan())
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_tp_plan())
        if checkpointing is not None:
            extra = {"context_fn": _selective_contexts} if checkpointing == "selective" else {}
            block.forward = functools.partial(_checkpointed, block.forward, extra)
    policy = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, **policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, **policy)
    return model


_aten, _funcol = torch.ops.aten, torch.ops._c10d_functional
_SAVED = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _funcol.all_reduce.default, _funcol.all_gather_into_tensor.default, _funcol.reduce_scatter_tensor.default,
    _funcol.wait_tensor.default,
}


def _selective_contexts():
    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpointed(forward, extra: dict, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)


def compile_recipe_blocks(model: nn.Module, compiler: str) -> nn.Module:
    """Compile each block's forward with ``compiler``, as ``autoshard.backend`` compiles its blocks.

    Only ``block.forward`` is replaced, so FSDP2's pre/post-forward hooks
    (registered on the module's ``__call__``) stay eager around the compiled
    code, and the root (embedding, final norm, head) runs eagerly. Dynamo
    traces the block's tp DTensors into functional collectives; ``fullgraph``
    makes a graph break an error, so each block is one compiled graph.
    """
    for block in model.layers:
        block.forward = _plain_tensor_input(torch.compile(block.forward, backend=compiler, fullgraph=True))
    return model


def _plain_tensor_input(compiled_forward):
    """Hand the compiled block a plain tensor where the eager root gives an ``AsyncCollectiveTensor``.

    The embedding's output (all-reduced over tp, ``use_local_output=True``) is
    an ``AsyncCollectiveTensor``. Passed as is into the compiled first block,
    its gradient is lost: the embedding weight's gradient is exactly zero
    and it never trains, silently (torch 2.13, ``aot_eager`` and
    ``inductor``). ``clone()`` waits for the all-reduce eagerly and gives
    autograd an ordinary edge; it copies one activation per step.
    """

    @functools.wraps(compiled_forward)
    def forward(x, *args, **kwargs):
        if isinstance(x, AsyncCollectiveTensor):
            x = x.clone()
        return compiled_forward(x, *args, **kwargs)

    return forward
