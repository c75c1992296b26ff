"""A dry run at scale: shard a meta-device Llama-3-8B-shaped model for a 1024-rank job in one process.

A fake process group of 1024 ranks stands in for the cluster: ``autoshard``
plans, partitions and materializes exactly the code rank 0 of
``{"dp": 128, "tp": 8}`` would run, allocating only rank 0's local shards
(1/1024 of each weight). The block code must be the one a 2x2 mesh gets,
except for process-group names.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import autoshard
from examples.models import Llama, LlamaConfig, rotary_tables

LLAMA3_8B = LlamaConfig(vocab_size=128256, dim=4096, num_layers=2, num_heads=32, num_kv_heads=8, ffn_hidden=14336,
                        max_seq_len=64)


@pytest.fixture(scope="module")
def world_1024():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1024)
    yield
    dist.destroy_process_group()


def _meta_llama() -> Llama:
    with torch.device("meta"):
        model = Llama(LLAMA3_8B)
    # non-persistent tables no checkpoint holds: computed as the model's __init__ does
    model.rope_cos, model.rope_sin = rotary_tables(LLAMA3_8B.dim // LLAMA3_8B.num_heads, LLAMA3_8B.max_seq_len,
                                                   LLAMA3_8B.rope_theta)
    return model


def _without_group_names(code: str) -> str:
    return re.sub(r"'\d+'", "'<group>'", code)


def test_a_1024_rank_job_is_built_in_one_process(world_1024):
    tokens = torch.zeros(1, 64, dtype=torch.long)
    big = init_device_mesh("cpu", (128, 8), mesh_dim_names=("dp", "tp"))
    sharded = autoshard.autoshard(_meta_llama(), big, example_inputs=(tokens,))
    assert sharded.autoshard_plan.mesh == {"dp": 128, "tp": 8}

    wq = sharded.get_parameter("layers.0.attention.wq.weight")  # stored [4096, 4096] (T)
    assert wq.shape == (4096, 4096) and wq.to_local().shape == (4096 // 128, 4096 // 8)
    assert not wq.to_local().is_meta  # rank 0's shard is allocated, and nothing more
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in sharded.parameters())
    full_bytes = sum(p.numel() * p.element_size() for p in sharded.parameters())
    assert local_bytes <= full_bytes / 1000

    small = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    on_2x2 = autoshard.autoshard(_meta_llama(), small, example_inputs=(tokens,))
    for i in range(LLAMA3_8B.num_layers):
        got, want = sharded.layers[i].code, on_2x2.layers[i].code
        assert got != want  # the groups differ ...
        assert _without_group_names(got) == _without_group_names(want)  # ... and nothing else
