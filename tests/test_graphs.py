"""Emitted graphs: code snapshots (``tests/__snapshots__``, ``make golden``) and exact collective counts.

Built on a fake 4-rank process group in this process (collectives are
no-ops), so the emitted code is exactly what a real rank would run.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.testing import FileCheck

import autoshard
from tests.cases import FEATURES, MODELS

MESH_SHAPES = {"2x2": ((2, 2), ("dp", "tp")), "tp4": ((4,), ("tp",)), "dp4": ((4,), ("dp",))}


def _shard(model_name: str, mesh_name: str):
    build, inputs = MODELS[model_name]
    shape, names = MESH_SHAPES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    return autoshard.autoshard(build(), mesh, example_inputs=inputs), mesh


def emitted_code(sharded, mesh) -> str:
    """The root's code followed by each block's, headed by its FQN.

    Process-group names depend on how many groups the process created before,
    so each axis's group name is shown as ``'<axis>'``.
    """
    parts = [f"# <root> {type(sharded).__name__}\n{sharded.code.strip()}"]
    for name, module in sharded.named_modules():
        if name and isinstance(module, torch.fx.GraphModule):
            parts.append(f"# {name}\n{module.code.strip()}")
    text = "\n\n".join(parts)
    for axis in mesh.mesh_dim_names:
        text = text.replace(repr(mesh.get_group(axis).group_name), f"'<{axis}>'")
    return text


@pytest.mark.parametrize("mesh_name", MESH_SHAPES)
@pytest.mark.parametrize("model_name", MODELS)
def test_emitted_graph_snapshot(fake_world, model_name, mesh_name, autoshard_snapshot):
    assert emitted_code(*_shard(model_name, mesh_name)) + "\n" == autoshard_snapshot


def test_llama_block_has_two_forward_and_two_backward_tp_collectives(fake_world):
    sharded, _ = _shard("llama", "2x2")
    for index in range(2):
        code = getattr(sharded.layers, str(index)).code
        # forward: one all-reduce after wo, one after w2
        FileCheck().check_count("torch.ops.autoshard.reduce_partial", 2, exactly=True).run(code)
        # backward: one input-grad all-reduce for q/k/v, one for w1/w3
        FileCheck().check_count("torch.ops.autoshard.enter_tp", 2, exactly=True).run(code)
        FileCheck().check_not("gather_shards").check_not("take_shard").run(code)
        # colwise: x @ W_t on the transposed [in, out] weight; rowwise: linear on [out, in]
        FileCheck().check_count("_enter_tp, attention_w", 3, exactly=True).run(code)
        FileCheck().check_count("_enter_tp, feed_forward_w", 2, exactly=True).run(code)
        FileCheck().check_count("aten.matmul.default(", 5, exactly=True).run(code)
        FileCheck().check_count("_weight_t_local)", 5, exactly=True).run(code)
        FileCheck().check_count("aten.linear.default(", 2, exactly=True).run(code)
    root = sharded.code
    FileCheck().check("aten.embedding.default").check("autoshard.gather_shards").check(
        'getattr(self.layers, "0")').check('getattr(self.layers, "1")').check(
        "autoshard.enter_tp").check("aten.matmul.default").check("autoshard.gather_shards").run(root)


def test_dp_only_graph_has_no_tp_collectives(fake_world):
    code = emitted_code(*_shard("llama", "dp4"))
    FileCheck().check_not("torch.ops.autoshard").check_not("to_local").run(code)


def test_placements_on_fake_world(fake_world):
    from torch.distributed.tensor import Shard

    sharded, _ = _shard("llama", "2x2")
    for fqn, param in sharded.named_parameters():
        if param.dim() == 2:
            assert tuple(param.placements) == (Shard(0), Shard(1)), fqn


class _Masked(torch.nn.Module):
    """Keyword inputs reach the graph like positional ones."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)

    def forward(self, x, *, mask):
        return self.down(torch.relu(self.up(x)) * mask)


def test_keyword_inputs_are_captured_and_checked(fake_world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mask = torch.ones(2, 5, 1)
    sharded = autoshard.autoshard(_Masked(), mesh, example_inputs=(FEATURES,), example_kwargs={"mask": mask})
    assert sharded(FEATURES, mask=mask).shape == (2, 5, 32)
    # the mask broadcasts over the sharded hidden dim: it stays inside the tp region
    FileCheck().check("enter_tp").check("aten.mul.Tensor").check("aten.linear.default").check(
        "reduce_partial").run(sharded.code)
    with pytest.raises(ValueError, match=r"input 'mask' has shape \[2, 5, 64\]"):
        sharded(FEATURES, mask=torch.ones(2, 5, 64))


def test_loss_parallel_returns_vocab_sharded_logits(fake_world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    build, inputs = MODELS["llama"]
    sharded = autoshard.autoshard(build(), mesh, example_inputs=inputs, loss_parallel=True)
    code = sharded.code
    # the embedding output is still gathered; the head's logits leave the graph sharded
    FileCheck().check_count("autoshard.gather_shards", 1, exactly=True).run(code)
    FileCheck().check("aten.matmul.default").check(
        "autoshard_runtime_collectives_as_sharded_dtensor(").check("tree_unflatten").run(code)
