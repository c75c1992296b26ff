"""Pipeline parallelism on 8 gloo ranks: torch's schedules against one device, sends, checkpoints.

One process group, a ``pp2 x dp2 x tp2`` mesh over its 8 ranks. Each run is compared with one
device training on the same global batch (every rank builds the reference). The whole matrix
(three models, ``pp2 x dp2 x tp2`` and ``pp4 x tp2``, GPipe, 1F1B and interleaved, 4 and 8
microbatches) runs in ``make pp-parity``; these checks take one run of each kind.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.adapters import checkpoint
from examples.models import Llama, LlamaConfig
from tests import hf_cases
from tests.distributed import distributed_tests, remove_shared, shared_directory
from tests.parity import hf_loss, lm_loss, train_pipeline_both


def _mesh_3d():
    return init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))


def _llama(layers: int = 2):
    torch.manual_seed(0)
    return Llama(LlamaConfig(num_layers=layers))


class _Sends(TorchDispatchMode):
    """Point-to-point sends (``c10d.send``) with their bytes."""

    def __init__(self):
        super().__init__()
        self.messages = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.c10d.send.default:
            self.messages += len(args[0])
            self.bytes += sum(t.numel() * t.element_size() for t in args[0])
        return func(*args, **(kwargs or {}))


def check_pp2_dp2_tp2_llama_1f1b_parity_placements_sends_clipping_checkpoint(ctx):
    """1F1B over 4 microbatches, each step clipped to a tenth of one device's first gradient norm:
    3 SGD (momentum) steps within 1e-5 of one device clipping alike, the norm over every stage one
    device's. This rank holds only its stage's parameters, every linear weight the block (S(0), S(1))
    on its dp x tp mesh; the pp sends of a step are the plan's; the checkpoint loads without pp."""
    mesh = _mesh_3d()
    run = train_pipeline_both(_llama, mesh, lm_loss, schedule="1F1B", microbatches=4, optimizer="sgd-momentum",
                              clip=0.1)
    run.assert_parity(loss_tol=1e-5, param_tol=1e-5)
    for got, want in run.norms:
        assert abs(got - want) <= 1e-5 * want, (got, want)
    pipe = run.pipeline
    plan = pipe.autoshard_plan
    stage = plan.pipeline.stages[mesh.get_local_rank("pp")]
    held = {n for n, _ in pipe.named_parameters()}
    assert {".".join(n.split(".")[:2]) for n in held if n.startswith("layers.")} == set(stage.units)
    for name, param in pipe.named_parameters():
        assert isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == ("dp", "tp"), name
        if name.endswith(("wq.weight", "wo.weight", "w2.weight")):
            assert tuple(param.placements) == (Shard(0), Shard(1)), name
    sends = _Sends()
    tokens, targets = run.batches[0]
    with sends:
        pipe.step(run.local(tokens), run.local(targets))
    pipe.zero_grad()
    predicted = plan.predicted_comm(pp_rank=mesh.get_local_rank("pp"))["pp"]["send"]
    assert (sends.messages, sends.bytes) == predicted and predicted[0] > 0, ((sends.messages, sends.bytes), predicted)
    _checkpoint_moves_from_pp_to_2x2_and_one_process(ctx, run)


def _checkpoint_moves_from_pp_to_2x2_and_one_process(ctx, run):
    """Model and momentum saved on pp2 x dp2 x tp2 load on 2x2 (ranks 0-3, no pp) and into the plain
    model on one process, the model bit-equal."""
    import autoshard

    directory = shared_directory(ctx)
    pipe = run.pipeline
    path = checkpoint.save_checkpoint(directory, 1, pipe, run.optimizer)
    saved = checkpoint.full_state_dict(pipe)
    assert set(saved) == set(_llama().state_dict())
    solo = dist.new_group([0])
    if ctx.in_2d:
        on_2x2 = autoshard.autoshard(_llama(), ctx.mesh_2d, example_inputs=(run.batches[0][0][:4],), check=False)
        torch.nn.init.zeros_(on_2x2.get_parameter("norm.weight"))
        optimizer = torch.optim.SGD(on_2x2.parameters(), lr=0.1, momentum=0.9)
        assert checkpoint.load_checkpoint(path, on_2x2, optimizer, process_group=ctx.group_2d) == 1
        for key, value in checkpoint.full_state_dict(on_2x2).items():
            assert torch.equal(value, saved[key]), key
        assert len(optimizer.state) == len(list(on_2x2.parameters()))  # every momentum came back
    if ctx.rank == 0:
        plain = _llama()
        torch.nn.init.zeros_(plain.norm.weight)
        assert checkpoint.load_checkpoint(path, plain, process_group=solo) == 1
        for key, value in plain.state_dict().items():
            assert torch.equal(value, saved[key]), key
    remove_shared(ctx, directory)
    assert os.path.basename(path) == "step_00000001"


def check_pp2_dp2_tp2_hf_qwen2_interleaved_adamw_with_accumulation(ctx):
    """Hugging Face Qwen2 with an attention mask (built from the inputs, read on every stage),
    interleaved 1F1B with two stages per rank (rank 0 runs stages 0 and 2), each AdamW step after two
    pipeline steps (the first with the dp sync off): within 1e-5 of one device summing the two
    batches' mean losses."""
    run = train_pipeline_both(hf_cases.qwen2_4_blocks, _mesh_3d(), hf_loss, schedule="Interleaved1F1B",
                              microbatches=4, optimizer="adamw", padding_mask=True, steps=2, accumulate=2)
    run.assert_parity(loss_tol=1e-5, param_tol=None)
    assert [s.rank for s in run.pipeline.autoshard_plan.pipeline.stages] == [0, 1, 0, 1]


CHECKS = [
    check_pp2_dp2_tp2_llama_1f1b_parity_placements_sends_clipping_checkpoint,
    check_pp2_dp2_tp2_hf_qwen2_interleaved_adamw_with_accumulation,
]

outcomes, test_check = distributed_tests(CHECKS, world_size=8)
