"""Pipeline stages balanced by the plan's costs against torchtitan's equal split, on pp=4.

``make bench-pp`` (``python benchmarks/bench_pp.py``): 4 gloo CPU ranks, one launch. The model is
a Llama (this project's example code) whose head is heavy next to its blocks: vocabulary 32k,
8 blocks, dim 128. Three runs of the same steps on the same batches:

* ``balanced``: ``autoshard(model, pp=4 mesh, loss_fn=..., microbatches=8, schedule="1F1B")``, the
  split minimizing the slowest stage's FLOPs (the LM head's vocabulary matmul counted on the last
  stage);
* ``equal``: the same with ``pp_split`` = an equal count of blocks per stage (torchtitan's rule:
  2 blocks each, the head on top of the last stage's two);
* ``2d``: the same 4 ranks as ``dp=2 x tp=2`` without stages (autoshard's 2-D plan).

Per run: median step time over the timed steps and the loss of the last step. Per stage: its
blocks, its predicted time per microbatch (its FLOPs at the matmul rate measured on the rank) and
its measured time (its stage module's forward and backward on one microbatch, run alone on its
rank). Results go to ``benchmarks/results/bench_pp.json``.

Every rank gets one thread and the 4 ranks share this machine's cores, so absolute times are the
machine's; the ratio balanced/equal is what the split changes.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

VOCAB, LAYERS, DIM, HEADS, KV_HEADS, FFN = 32_000, 8, 128, 4, 2, 256
BATCH, SEQ, MICROBATCHES, STEPS, WARMUP = 16, 32, 8, 6, 2


def _model():
    import torch

    from examples.models import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=VOCAB, dim=DIM, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                             ffn_hidden=FFN, max_seq_len=SEQ))


def _loss(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batches():
    import torch

    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))
            for _ in range(STEPS)]


def _time_steps(step, batches) -> tuple[float, float]:
    import torch.distributed as dist

    times, loss = [], None
    for i, (tokens, targets) in enumerate(batches):
        dist.barrier()
        start = time.perf_counter()
        loss = step(tokens, targets)
        dist.barrier()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times), float(loss)


def _stage_seconds(pipe, repeats: int = 3) -> float:
    """This rank's stage alone: forward and backward of one microbatch on inputs of its shapes."""
    import torch

    (module,) = pipe.modules
    (stage,) = pipe.pipeline_stages
    inputs = [a.detach().clone().requires_grad_(a.requires_grad) if a.is_floating_point() else
              torch.randint(0, VOCAB, a.shape) for a in stage.example_args]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = module(*inputs)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        best = min(best, time.perf_counter() - start)
        module.zero_grad(set_to_none=True)
    return best


def _rank(rank: int, world: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import autoshard
    from autoshard.stages import equal_split
    from autoshard.suggest import _measure_flops

    rate = _measure_flops(torch.device("cpu"))
    batches = _batches()
    blocks = tuple(f"layers.{i}" for i in range(LAYERS))
    results = {"flops_per_second": rate}
    pp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
    for name, split in (("balanced", None), ("equal", equal_split(blocks, 4))):
        pipe = autoshard.autoshard(_model(), pp_mesh, example_inputs=(batches[0][0],), loss_fn=_loss,
                                   microbatches=MICROBATCHES, schedule="1F1B", pp_split=split)
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)

        def step(tokens, targets, pipe=pipe, optimizer=optimizer):
            optimizer.zero_grad()
            loss = pipe.step(tokens, targets)
            optimizer.step()
            return loss

        seconds, loss = _time_steps(step, batches)
        stages = pipe.autoshard_plan.pipeline
        measured = _stage_seconds(pipe)
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, measured)
        results[name] = {
            "step_seconds": seconds, "loss": loss,
            "stages": [{"units": list(s.units), "predicted_seconds": s.flops / rate, "measured_seconds": m}
                       for s, m in zip(stages.stages, gathered, strict=True)],
        }
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    index, count = autoshard.data_parallel_rank(mesh_2d)
    sharded = autoshard.autoshard(_model(), mesh_2d, example_inputs=(batches[0][0].chunk(count)[index],), check=False)
    optimizer = torch.optim.SGD(sharded.parameters(), lr=0.01)

    def step_2d(tokens, targets):
        optimizer.zero_grad()
        loss = _loss(sharded(tokens.chunk(count)[index]), targets.chunk(count)[index])
        loss.backward()
        optimizer.step()
        return loss.detach()

    seconds, loss = _time_steps(step_2d, batches)
    results["2d"] = {"step_seconds": seconds, "loss": loss}
    return results


def main() -> None:
    from autoshard.launch import spawn

    results = spawn(_rank, 4)[0]
    balanced, equal, flat = results["balanced"], results["equal"], results["2d"]
    print(f"Llama vocab {VOCAB}, {LAYERS} blocks, dim {DIM}; batch {BATCH}x{SEQ}, {MICROBATCHES} microbatches, "
          f"1F1B on pp=4 (4 gloo ranks)")
    for name in ("balanced", "equal"):
        run = results[name]
        print(f"{name:>9}: step {run['step_seconds'] * 1e3:8.1f} ms (loss {run['loss']:.4f})")
        for i, stage in enumerate(run["stages"]):
            units = stage["units"]
            print(f"           stage {i}: {units[0]}..{units[-1]} ({len(units)} blocks): predicted "
                  f"{stage['predicted_seconds'] * 1e3:7.2f} ms, measured {stage['measured_seconds'] * 1e3:7.2f} ms "
                  "per microbatch")
    print(f"balanced / equal step time: {balanced['step_seconds'] / equal['step_seconds']:.2f}x (goal <= 0.85x)")
    print(f"2-D dp=2 x tp=2 on the same 4 ranks: step {flat['step_seconds'] * 1e3:.1f} ms (loss {flat['loss']:.4f}); "
          f"pp=4 balanced / 2-D: {balanced['step_seconds'] / flat['step_seconds']:.2f}x")
    out = os.path.join(ROOT, "benchmarks", "results", "bench_pp.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
