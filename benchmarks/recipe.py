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
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


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


def parallelize_recipe(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Apply tp then FSDP2 to ``model`` in place (the torchtitan order) and return it.

    tp must come first so FSDP2 shards the tp-local blocks on dim 0 of the
    already tp-sharded DTensors.
    """
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp_mesh, root_tp_plan())
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_tp_plan())
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
    return model
