"""Expert parallelism inside pipeline stages on 8 gloo ranks: torch's 1F1B against one device.

Meshes ``("pp", "ep", "tp") = (2, 2, 2)`` and ``("pp", "dp", "ep") = (2, 2, 2)``: each stage runs the
stage mesh's code, whose expert layers exchange their rows by all-to-all within the stage's ep group
(the ranks of one pp coordinate), between microbatches the schedule interleaves. Hugging Face
Qwen3-MoE, Mixtral and DeepSeek-V3 (shared expert, top 8 of 64, the first layer dense) and
torchtitan's own Qwen3-MoE: the loss over 3 AdamW steps and every parameter after 3 SGD steps within
1e-5 of one device (torchtitan's bf16 experts within the bounds its 4-rank checks give), the experts
of each stage split whole over ep, and under ``dp`` the experts' own FSDP unit.
"""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from tests.distributed import distributed_tests
from tests.moe_cases import MOE_MODELS, titan_qwen3_moe
from tests.parity import hf_loss, lm_loss, train_pipeline_both

MESHES = {"pp2_ep2_tp2": ((2, 2, 2), ("pp", "ep", "tp")), "pp2_dp2_ep2": ((2, 2, 2), ("pp", "dp", "ep"))}


def _check(model_name: str, impl: str | None, mesh_name: str):
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
    assert all(c.fsdp == ("dp" in mesh.mesh_dim_names) for c in plan.experts)
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
        if "dp" in placements:
            assert isinstance(placements["dp"], Shard) and placements["dp"].dim != 0, (fqn, placements)


CHECKS = [
    *(_check(model, None, "pp2_ep2_tp2") for model in MOE_MODELS),
    _check("qwen3_moe", "batched_mm", "pp2_dp2_ep2"),
    _check("mixtral", None, "pp2_dp2_ep2"),
    _check("titan_qwen3_moe", None, "pp2_ep2_tp2"),
]

outcomes, test_check = distributed_tests(CHECKS, world_size=8)
