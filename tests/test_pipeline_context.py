"""Pipeline stages with context and loss parallelism on 8 gloo ranks: torch's 1F1B against one device.

Hugging Face Llama (4 blocks, 2 kv heads) on ``pp2 x cp2 x tp2`` and ``pp2 x dp2 x cp2``, and loss
parallelism through the schedule on ``pp2 x dp2 x tp2``. Each
stage runs the stage mesh's code: the first stage takes the whole microbatch and keeps its cp
rank's positions, the hidden states cross the stage boundary at their cp-local length, and the
last stage gathers the logits whole for the loss. Three AdamW steps hold the loss within 1e-5 of
one device; three SGD steps hold the loss and every parameter within 1e-5.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from tests import hf_cases
from tests.distributed import distributed_tests
from tests.parity import hf_loss, train_pipeline_both

SEQ = 16


def _check(shape: tuple[int, int, int], names: tuple[str, str, str]):
    def check(ctx):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for optimizer, param_tol in (("adamw", None), ("sgd", 1e-5)):
            run = train_pipeline_both(hf_cases.small_llama_4_blocks, mesh, hf_loss, schedule="1F1B", microbatches=4,
                                      optimizer=optimizer, seq=SEQ)
            run.assert_parity(loss_tol=1e-5, param_tol=param_tol)
        pipe = run.pipeline
        plan = pipe.autoshard_plan
        assert plan.mesh == dict(zip(names, shape, strict=True)) and plan.context.seq == SEQ, plan.mesh
        assert [s.rank for s in plan.pipeline.stages] == [0, 1]
        # the hidden states' gradient crosses back at its cp-local length: a microbatch of 2 rows,
        # SEQ / cp positions, 64 wide, float32 (one message; pp2 x tp2 sends the whole 2 x 16 x 64)
        (_, _, back_messages, back_bytes), = plan.pipeline.sends
        assert (back_messages, back_bytes) == (1, 2 * (SEQ // 2) * 64 * 4), plan.pipeline.sends

    check.__name__ = check.__qualname__ = "check_" + "_".join(f"{n}{s}" for n, s in zip(names, shape, strict=True))
    check.__module__ = __name__
    return check


def check_pp2_dp2_tp2_with_loss_parallelism(ctx):
    """The logits leave the last stage cut over tp (a DTensor ``Shard(2)``) and the schedule runs the
    loss and its backward under ``loss_parallel()``: 3 SGD steps hold the loss and every parameter
    within 1e-5 of one device."""
    from examples.models import Llama, LlamaConfig
    from tests.parity import lm_loss

    def build():
        torch.manual_seed(0)
        return Llama(LlamaConfig(num_layers=4))

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    run = train_pipeline_both(build, mesh, lm_loss, schedule="1F1B", microbatches=4, optimizer="sgd", seq=SEQ,
                              shard_kwargs={"loss_parallel": True})
    run.assert_parity(loss_tol=1e-5, param_tol=1e-5)
    assert run.pipeline.loss_parallel


CHECKS = [_check((2, 2, 2), ("pp", "cp", "tp")), _check((2, 2, 2), ("pp", "dp", "cp")),
          check_pp2_dp2_tp2_with_loss_parallelism]

outcomes, test_check = distributed_tests(CHECKS, world_size=8)
