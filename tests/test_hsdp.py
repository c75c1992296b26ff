"""HSDP: meshes ``("dp_replicate", "dp_shard", "tp")`` and ``("dp_replicate", "dp_shard")``.

One 8-process gloo group (2x2x2, plus a 2x4 mesh without tp and a 2x2 mesh on
ranks 0-3 for checkpoints that move between the shapes). Each run is compared
with one device on the same global batch, split into one slice per
``(dp_replicate, dp_shard)`` coordinate.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

import autoshard
from autoshard.adapters import checkpoint
from autoshard.adapters.comm_stats import CollectiveCounter
from examples.models import Llama, LlamaConfig, MLPStack
from tests.distributed import distributed_tests, remove_shared, shared_directory
from tests.parity import assert_parity, dp_slice, full, lm_loss, mean_over_dp, mse_loss, rel_error, train_both

HSDP_AXES = ("dp_replicate", "dp_shard", "tp")
BLOCK = (Replicate(), Shard(0), Shard(1))  # every linear weight: replicated, FSDP dim 0, tp dim 1


def _tokens(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, 256, (8, 16), generator=gen), torch.randint(0, 256, (8, 16), generator=gen)


def _llama() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(num_layers=2))


def _linear_weights(model) -> set[str]:
    return {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def check_hsdp_3d_parity_placements_and_collectives(ctx):
    """2x2x2: 3 SGD steps within 1e-5 of one device; every linear weight is the block
    (Replicate(), Shard(0), Shard(1)); gradients are all-reduced over dp_replicate once per
    FSDP unit, after the reduce-scatter over dp_shard; tp collectives as on 2x2."""
    mesh = ctx.mesh_hsdp
    tokens, targets = _tokens()
    model = _llama()
    run = train_both(model, mesh, tokens, targets, lm_loss, steps=3)
    assert_parity(run, loss_tol=1e-5, param_tol=1e-5)

    sharded = run.sharded
    plan = sharded.autoshard_plan
    assert plan.mesh == {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    weights = _linear_weights(model)
    assert weights and weights <= set(plan.params)
    for fqn, param in sharded.named_parameters():
        assert isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == HSDP_AXES, fqn
        if fqn in weights:
            assert tuple(param.placements) == BLOCK, (fqn, param.placements)
        assert plan.params[fqn].placements["dp_replicate"] == Replicate(), fqn
    assert "dp_replicate" in str(plan).splitlines()[1]  # a column of the table
    assert json.loads(json.dumps(plan.to_dict()))["mesh"] == plan.mesh

    local_tokens, local_targets = dp_slice(tokens, mesh), dp_slice(targets, mesh)
    with CollectiveCounter({a: mesh.get_group(a) for a in HSDP_AXES}) as counter:
        lm_loss(sharded(local_tokens), local_targets).backward()
    stats = counter.stats()
    units = len(plan.units)
    assert stats["dp_replicate"].counts == {"all_reduce": units}, stats["dp_replicate"].counts
    assert stats["dp_shard"].counts["reduce_scatter"] == units
    assert counter.wire_bytes("dp_replicate", "all_reduce") > 0
    assert "other" not in stats, stats["other"].counts

    on_2x2 = autoshard.plan(_llama(), {"dp": 2, "tp": 2}, example_inputs=(dp_slice(tokens, ctx.mesh_hsdp),))
    tp_2x2 = sum(1 for p in on_2x2.params.values() for c in p.collectives if c.runs)
    tp_hsdp = sum(1 for p in plan.params.values() for c in p.collectives if c.runs)
    assert tp_hsdp == tp_2x2, (tp_hsdp, tp_2x2)
    assert stats["tp"].num_collectives == tp_hsdp, (stats["tp"].counts, tp_hsdp)


def check_hsdp_without_tp_averages_replicated_gradients_over_both_axes(ctx):
    """2x4 (dp_replicate, dp_shard), no tp, on a model with biases: FSDP2 shards the
    weights over dp_shard; a parameter the plan keeps replicated over dp (here every bias,
    set so in the plan) has its gradient averaged over both axes. 3 SGD steps within 1e-5."""
    mesh = ctx.mesh_hsdp_dp
    torch.manual_seed(0)
    model = MLPStack(num_blocks=2)
    x, target = torch.randn(8, 5, 32), torch.randn(8, 5, 16)
    local = dp_slice(x, mesh)
    plan = autoshard.plan(model, mesh, example_inputs=(local,)).to_dict()
    biases = [fqn for fqn in plan["params"] if fqn.endswith(".bias")]
    for fqn in biases:
        plan["params"][fqn]["placements"]["dp_shard"] = "R"
    run = train_both(model, mesh, x, target, mse_loss, steps=3, shard_kwargs={"plan": plan})
    assert_parity(run, loss_tol=1e-5, param_tol=1e-5)
    params = dict(run.sharded.named_parameters())
    for fqn in biases:
        assert not isinstance(params[fqn], DTensor), fqn  # outside FSDP2: a plain replicated tensor
    assert tuple(params["blocks.0.fc1.weight"].placements) == (Replicate(), Shard(0))


def check_plan_from_2x2_applies_on_hsdp(ctx):
    """A plan saved on 2x2 shards the 2x2x2 mesh exactly as planning there does, and back."""
    tokens, _ = _tokens()
    local = dp_slice(tokens, ctx.mesh_hsdp)
    saved = json.loads(json.dumps(autoshard.plan(_llama(), {"dp": 2, "tp": 2}, example_inputs=(local,)).to_dict()))
    fresh = autoshard.autoshard(_llama(), ctx.mesh_hsdp, example_inputs=(local,))
    given = autoshard.autoshard(_llama(), ctx.mesh_hsdp, example_inputs=(local,), plan=saved)
    assert given.autoshard_plan == fresh.autoshard_plan
    assert given.code == fresh.code
    back = fresh.autoshard_plan.for_mesh({"dp": 2, "tp": 2})
    assert back == autoshard.Plan.from_dict(saved)


def _adamw(module):
    return torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)


def _train(sharded, optimizer, mesh, steps) -> float:
    for step in steps:
        tokens, targets = _tokens(step)
        loss = lm_loss(sharded(dp_slice(tokens, mesh)), dp_slice(targets, mesh))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return mean_over_dp(loss, mesh).item()


def _shard(mesh):
    return autoshard.autoshard(_llama(), mesh, example_inputs=(dp_slice(_tokens()[0], mesh),))


def _full_params(module) -> dict[str, torch.Tensor]:
    return {k: full(v) for k, v in module.state_dict().items()}


def check_checkpoint_moves_between_2x2x2_and_2x2(ctx):
    """Model and AdamW state saved on 2x2x2 load on 2x2 (ranks 0-3); one more step there
    gives the loss and weights of continuing on 2x2x2. Saved again on 2x2, they load back
    on 2x2x2 and the step after matches the 2x2 run's."""
    directory = shared_directory(ctx)
    hsdp = _shard(ctx.mesh_hsdp)
    hsdp_opt = _adamw(hsdp)
    _train(hsdp, hsdp_opt, ctx.mesh_hsdp, range(2))
    path = checkpoint.save_checkpoint(directory, 1, hsdp, hsdp_opt)
    saved = _full_params(hsdp)
    want_loss = _train(hsdp, hsdp_opt, ctx.mesh_hsdp, [2])
    want_params = _full_params(hsdp)

    back_path = None
    if ctx.in_2d:
        on_2x2 = _shard(ctx.mesh_2d)
        torch.nn.init.zeros_(on_2x2.get_parameter("norm.weight"))  # only the checkpoint can restore it
        opt_2x2 = _adamw(on_2x2)
        assert checkpoint.load_checkpoint(path, on_2x2, opt_2x2, process_group=ctx.group_2d) == 1
        for key, value in _full_params(on_2x2).items():
            assert torch.equal(value, saved[key]), key
        got_loss = _train(on_2x2, opt_2x2, ctx.mesh_2d, [2])
        assert abs(got_loss - want_loss) <= 1e-5 * abs(want_loss), (got_loss, want_loss)
        for key, value in _full_params(on_2x2).items():
            assert rel_error(value, want_params[key]) <= 1e-5, key
        back_path = checkpoint.save_checkpoint(directory, 3, on_2x2, opt_2x2, process_group=ctx.group_2d)
        want_back = _train(on_2x2, opt_2x2, ctx.mesh_2d, [3])
    shared = [back_path, want_back if ctx.in_2d else None]
    dist.broadcast_object_list(shared, src=0)
    back_path, want_back = shared

    again = _shard(ctx.mesh_hsdp)
    again_opt = _adamw(again)
    assert checkpoint.load_latest(directory, again, again_opt) == 3
    got_back = _train(again, again_opt, ctx.mesh_hsdp, [3])
    assert abs(got_back - want_back) <= 1e-5 * abs(want_back), (got_back, want_back)
    remove_shared(ctx, directory)
    assert os.path.basename(back_path) == "step_00000003"


def check_hsdp_all_gather_is_quantized(ctx):
    """fp8 16x16 blocks on 2x2x2: each tile [64/2, 64/2] is quantized, the dp_shard all-gather
    carries <= 0.30x the bytes, and 3 SGD steps stay within 2% of one device."""
    mesh = ctx.mesh_hsdp
    spec = autoshard.BlockQuant(torch.float8_e4m3fn, 16)
    tokens, targets = _tokens()
    run = train_both(_llama(), mesh, tokens, targets, lm_loss, steps=3, shard_kwargs={"all_gather_quant": spec})
    assert_parity(run, loss_tol=2e-2, param_tol=None)
    gathers = [p.gather for p in run.sharded.autoshard_plan.params.values() if p.gather is not None]
    assert gathers and all(g.quantized for g in gathers)

    def gathered_bytes(sharded) -> int:
        with CollectiveCounter({a: mesh.get_group(a) for a in HSDP_AXES}) as counter:
            lm_loss(sharded(dp_slice(tokens, mesh)), dp_slice(targets, mesh)).backward()
        return counter.wire_bytes("dp_shard", "all_gather")

    plain = autoshard.autoshard(_llama(), mesh, example_inputs=(dp_slice(tokens, mesh),))
    assert gathered_bytes(run.sharded) <= 0.30 * gathered_bytes(plain)


def check_hsdp_with_expert_parallelism(ctx):
    """``("dp_replicate", "dp_shard", "ep") = (2, 2, 2)``: 8 batches, each MoE layer's experts split whole
    over ep and their own FSDP unit over (dp_replicate, dp_shard) (HSDP); 3 SGD steps of the W[ids] experts
    and Hugging Face's Qwen3-MoE within 1e-5 of one device."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests import pattern_models as pm
    from tests.moe_cases import qwen3_moe
    from tests.moe_cases import tokens as moe_tokens
    from tests.parity import hf_loss

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "ep"))
    ids, targets = moe_tokens()
    torch.manual_seed(0)
    run = train_both(pm.ExpertsMoE(pm.Config(), experts=pm.IndexedExperts), mesh, ids % pm.Config().vocab,
                     torch.randn(8, 16, pm.Config().vocab), mse_loss, steps=3, lr=0.5)
    assert_parity(run, loss_tol=1e-5, param_tol=1e-5)
    torch.manual_seed(0)
    run = train_both(qwen3_moe(), mesh, ids, targets, hf_loss, steps=3, lr=0.5)
    assert_parity(run, loss_tol=1e-5, param_tol=1e-5)
    plan = run.sharded.autoshard_plan
    assert plan.experts and all(c.choice == "ep" and c.fsdp for c in plan.experts)
    for fqn in plan.ep_weights():
        param = run.sharded.get_parameter(fqn)
        placements = dict(zip(param.device_mesh.mesh_dim_names, param.placements, strict=True))
        assert placements["ep"] == Shard(0) and placements["dp_replicate"] == Replicate(), (fqn, placements)
        assert isinstance(placements["dp_shard"], Shard) and placements["dp_shard"].dim != 0, (fqn, placements)


CHECKS = [
    check_hsdp_with_expert_parallelism,
    check_hsdp_3d_parity_placements_and_collectives,
    check_hsdp_all_gather_is_quantized,
    check_hsdp_without_tp_averages_replicated_gradients_over_both_axes,
    check_plan_from_2x2_applies_on_hsdp,
    check_checkpoint_moves_between_2x2x2_and_2x2,
]

outcomes, test_check = distributed_tests(CHECKS, world_size=8)
