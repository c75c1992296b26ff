"""A plan saved on one mesh shape, applied on another: real gloo ranks, one 4-process group.

The plan is saved as JSON on the 2x2 mesh and applied on the tp-only (tp=4) and
dp-only (dp=4) meshes: it must shard exactly as planning afresh there and train
like the single-device model. A plan whose tp-sharded dim divides by 2 but not
by 4 is refused by name; a weight the plan replicated over tp stays replicated.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autoshard
from examples.models import Llama, LlamaConfig, MLPStack
from tests.distributed import distributed_tests
from tests.parity import assert_parity, dp_slice, lm_loss, mse_loss, train_both


def _sizes(mesh) -> dict[str, int]:
    return {name: mesh.size(i) for i, name in enumerate(mesh.mesh_dim_names)}


def _saved_on_2x2(model, local_2x2) -> dict:
    """The plan as a file made on the 2x2 mesh would hold it."""
    return json.loads(json.dumps(autoshard.plan(model, {"dp": 2, "tp": 2}, example_inputs=(local_2x2,)).to_dict()))


def check_plan_from_2x2_on_tp_and_dp_meshes(ctx):
    """8 heads and 4 kv heads divide by 2 and by 4: the 2x2 plan carries to both 1-D meshes."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(num_layers=2, num_heads=8, num_kv_heads=4))
    tokens, targets = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    saved = _saved_on_2x2(model, dp_slice(tokens, ctx.mesh_2d))
    for mesh in (ctx.mesh_tp, ctx.mesh_dp):
        local = dp_slice(tokens, mesh)
        fresh = autoshard.autoshard(copy.deepcopy(model), mesh, example_inputs=(local,))
        run = train_both(model, mesh, tokens, targets, lm_loss, steps=2, shard_kwargs={"plan": saved})
        assert run.sharded.autoshard_plan == fresh.autoshard_plan == autoshard.Plan.from_dict(saved).for_mesh(
            _sizes(mesh)
        )
        assert run.sharded.code == fresh.code
        planned = dict(run.sharded.named_parameters())
        for fqn, want in fresh.named_parameters():  # the same cut of the same weights, before training
            got = planned[fqn]
            assert tuple(got.placements) == tuple(want.placements) and got.shape == want.shape, fqn
        assert_parity(run, loss_tol=1e-5, param_tol=1e-5)


def check_plan_with_a_dim_that_divides_by_2_only_is_refused_on_tp4(ctx):
    torch.manual_seed(0)
    model, x = MLPStack(hidden=66), torch.randn(8, 5, 32)
    saved = _saved_on_2x2(model, dp_slice(x, ctx.mesh_2d))
    with pytest.raises(ValueError) as err:
        autoshard.autoshard(model, ctx.mesh_tp, example_inputs=(x,), plan=saved)
    assert "plan for mesh dp=2 x tp=2 cannot be used on tp=4" in str(err.value)
    assert "'blocks.0.fc1.weight' (colwise) has tp-sharded stored dim 1 of size 66, which does not divide by tp=4" in (
        str(err.value)
    )


def check_weight_replicated_over_tp_stays_replicated_on_another_tp(ctx):
    """The head (34 outputs, wider than its 32 inputs, so sharded where it divides) is
    replicated in a plan for tp=4; on the 2x2 mesh it stays replicated over tp (roles are
    kept) although planning afresh would shard it."""
    torch.manual_seed(0)
    model, x, y = MLPStack(out=34), torch.randn(8, 5, 32), torch.randn(8, 5, 34)
    saved = autoshard.plan(model, {"tp": 4}, example_inputs=(x,)).to_dict()
    assert saved["params"]["head.weight"]["role"] == "replicate"
    run = train_both(model, ctx.mesh_2d, x, y, mse_loss, steps=2, shard_kwargs={"plan": saved})
    head = run.sharded.get_parameter("head.weight")
    assert tuple(head.placements) == (Shard(0), Replicate()) and tuple(head.shape) == (34, 32)
    fresh = autoshard.plan(model, ctx.mesh_2d, example_inputs=(dp_slice(x, ctx.mesh_2d),))
    assert fresh.params["head.weight"].role == "colwise"
    assert_parity(run, loss_tol=1e-5, param_tol=1e-5)


CHECKS = [
    check_plan_from_2x2_on_tp_and_dp_meshes,
    check_plan_with_a_dim_that_divides_by_2_only_is_refused_on_tp4,
    check_weight_replicated_over_tp_stays_replicated_on_another_tp,
]

outcomes, test_plan_meshes = distributed_tests(CHECKS)
