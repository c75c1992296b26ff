"""Expert parallelism with pipeline stages and context parallelism on 8 gloo ranks, against one device.

``("pp", "ep", "tp")``, ``("pp", "dp", "ep")`` and ``("pp", "ep", "cp")`` through torch's 1F1B: each
stage runs the stage mesh's code, whose expert layers exchange their rows by all-to-all within the
stage's ep group (the ranks of one pp coordinate), between the microbatches the schedule interleaves.
``("ep", "cp", "tp")`` and ``("dp", "ep", "cp")``: each cp rank routes the tokens of its sequence
chunks, exchanges them within its ep group, and the experts' FSDP unit runs over the data axes ep
leaves (cp's ranks hold the same experts). Hugging Face Qwen3-MoE, Mixtral and DeepSeek-V3 (shared
expert, top 8 of 64, the first layer dense) and torchtitan's own Qwen3-MoE: the loss over 3 AdamW steps
and every parameter after 3 SGD steps within 1e-5 of one device (torchtitan's bf16 experts within the
bounds its 4-rank checks give, tests/test_expert_parallel.py), the experts of each stage split whole
over ep, and under dp or cp the experts' own FSDP unit.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from tests.distributed import distributed_tests
from tests.moe_cases import MOE_MODELS, titan_qwen3_moe, tokens
from tests.parity import assert_parity, hf_loss, lm_loss, train_both, train_pipeline_both

MESHES = {"pp2_ep2_tp2": ((2, 2, 2), ("pp", "ep", "tp")), "pp2_dp2_ep2": ((2, 2, 2), ("pp", "dp", "ep")),
          "pp2_ep2_cp2": ((2, 2, 2), ("pp", "ep", "cp")), "ep2_cp2_tp2": ((2, 2, 2), ("ep", "cp", "tp")),
          "dp2_ep2_cp2": ((2, 2, 2), ("dp", "ep", "cp"))}


def _pipeline_check(model_name: str, impl: str | None, mesh_name: str):
    def check(ctx):
        shape, names = MESHES[mesh_name]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        titan = model_name == "titan_qwen3_moe"
        build = titan_qwen3_moe if titan else (lambda: MOE_MODELS[model_name](impl))
        for optimizer in ("adamw", "sgd"):
            run = train_pipeline_both(build, mesh, lm_loss if titan else hf_loss, schedule="1F1B", microbatches=4,
                                      optimizer=optimizer, seq=16)
            # torchtitan's experts compute in bf16, by its own casts (see tests/test_expert_parallel.py)
            run.assert_parity(loss_tol=5e-4 if titan else 1e-5,
                              param_tol=None if optimizer == "adamw" else 5e-3 if titan else 1e-5)
        _assert_stage_experts_split(run.pipeline, mesh)

    check.__name__ = check.__qualname__ = f"check_{model_name}_{impl or 'default'}_{mesh_name}"
    check.__module__ = __name__
    return check


def _assert_stage_experts_split(pipe, mesh) -> None:
    """The plan splits every MoE layer over ep; this rank's stage holds ``E / ep`` experts of each of
    its layers, placed ``ep: Shard(0)``, and under dp cut on another dim by the experts' FSDP unit."""
    plan = pipe.autoshard_plan
    assert plan.experts and all(c.choice == "ep" for c in plan.experts), [c.line_text() for c in plan.experts]
    assert all(c.fsdp == any(a in mesh.mesh_dim_names for a in ("dp", "cp")) for c in plan.experts)
    held = dict(pipe.module.named_parameters())
    staged = {fqn for graph in pipe.stage_graphs for fqn in graph.params}
    mine = plan.ep_weights() & staged
    assert mine == plan.ep_weights() & set(held), "a stage holds the experts of its own layers, and only those"
    if len(plan.experts) > 1:  # two MoE layers, one per stage (DeepSeek-V3's first layer is dense)
        assert mine and mine < plan.ep_weights(), sorted(mine)
    for fqn in mine:
        param = held[fqn]
        assert isinstance(param, DTensor), fqn
        placements = dict(zip(param.device_mesh.mesh_dim_names, param.placements, strict=True))
        assert placements["ep"] == Shard(0), (fqn, placements)
        assert param.to_local().shape[0] == param.shape[0] // mesh["ep"].size(), fqn
        _assert_own_fsdp_cut(placements, fqn)


def _assert_own_fsdp_cut(placements: dict, fqn: str) -> None:
    """Over dp and cp the experts' FSDP unit cuts a dim other than ep's (dim 0)."""
    for axis in ("dp", "cp"):
        if axis in placements:
            assert isinstance(placements[axis], Shard) and placements[axis].dim != 0, (fqn, placements)


def _check(model_name: str, impl: str | None, mesh_name: str):
    """A mesh without pp: every rank trains its slice of the batch (its ep and dp coordinates'), every
    cp rank of it its sequence chunks."""
    def check(ctx):
        shape, names = MESHES[mesh_name]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        ids, targets = tokens()
        for optimizer in ("adamw", "sgd"):
            torch.manual_seed(0)
            run = train_both(MOE_MODELS[model_name](impl), mesh, ids, targets, hf_loss, optimizer=optimizer,
                             steps=3, lr=1e-3 if optimizer == "adamw" else 0.5)
            assert_parity(run, loss_tol=1e-5, param_tol=1e-5 if optimizer == "sgd" else None)
        plan = run.sharded.autoshard_plan
        assert plan.experts and all(c.choice == "ep" and c.fsdp for c in plan.experts)
        for fqn in plan.ep_weights():
            param = run.sharded.get_parameter(fqn)
            assert isinstance(param, DTensor) and param.to_local().shape[0] == param.shape[0] // 2, fqn
            _assert_own_fsdp_cut(plan.params[fqn].placements, fqn)

    check.__name__ = check.__qualname__ = f"check_{model_name}_{impl or 'default'}_{mesh_name}"
    check.__module__ = __name__
    return check


CHECKS = [
    *(_pipeline_check(model, None, "pp2_ep2_tp2") for model in MOE_MODELS),
    _pipeline_check("qwen3_moe", "batched_mm", "pp2_dp2_ep2"),
    _pipeline_check("mixtral", None, "pp2_dp2_ep2"),
    _pipeline_check("titan_qwen3_moe", None, "pp2_ep2_tp2"),
    _pipeline_check("qwen3_moe", None, "pp2_ep2_cp2"),
    _check("qwen3_moe", None, "ep2_cp2_tp2"),
    _check("mixtral", "batched_mm", "dp2_ep2_cp2"),
]

outcomes, test_check = distributed_tests(CHECKS, world_size=8)
