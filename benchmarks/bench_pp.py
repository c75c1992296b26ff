"""Pipeline stages balanced by the plan's costs against torchtitan's equal split.

``make bench-pp`` (``python benchmarks/bench_pp.py``). The model is a Llama (this project's example
code) whose head is heavy next to its blocks: 8 blocks, dim 512 (FFN 2048), vocabulary 32k (the
head costs about four blocks in FLOPs). On pp=4 (4 gloo CPU ranks, one launch), three runs of the
same steps on the same batches:

* ``balanced``: ``autoshard(model, pp=4 mesh, loss_fn=..., microbatches=8, schedule="1F1B")``, the
  split minimizing the slowest stage's FLOPs (the LM head's vocabulary matmul counted on the last
  stage);
* ``equal``: the same with ``pp_split`` = an equal count of blocks per stage (torchtitan's rule:
  2 blocks each, the head on top of the last stage's two);
* ``2d``: the same 4 ranks as ``dp=2 x tp=2`` without stages (autoshard's 2-D plan).

Per run: median step time and the loss of the last step. Per stage: its blocks, its predicted
time per microbatch (its FLOPs at the matmul rate measured on the rank) and its measured time (its
stage module's forward and backward on one microbatch, run alone, one rank at a time).

This machine has 2 cores, so 4 ranks share them: a step takes about the ranks' total work whatever
the split, and only the stages measured alone show what the split changes. A second launch runs
pp=2 on 2 ranks (a core each, vocabulary 64k), where step times are what stages on their own
devices take: there the balanced/equal step time ratio is measured. Results go to
``benchmarks/results/bench_pp.json``.
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

VOCAB, LAYERS, DIM, HEADS, KV_HEADS, FFN = 32_000, 8, 512, 8, 4, 2048
BATCH, SEQ, MICROBATCHES, STEPS, WARMUP = 16, 64, 8, 5, 2
VOCAB_PP2 = 64_000  # pp=2: the head next to four blocks per stage


def _model(vocab: int = VOCAB):
    import torch

    from examples.models import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=vocab, dim=DIM, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                             ffn_hidden=FFN, max_seq_len=SEQ))


def _loss(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batches(vocab: int = VOCAB):
    import torch

    gen = torch.Generator().manual_seed(3)
    return [tuple(torch.randint(0, vocab, (BATCH, SEQ), generator=gen) for _ in range(2)) for _ in range(STEPS)]


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


def _rank(rank: int, world: int, vocab: int = VOCAB, with_2d: bool = True) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import autoshard
    from autoshard.advice.suggest import _measure_flops
    from autoshard.plans.stage_costs import equal_split

    rate = _measure_flops(torch.device("cpu"))
    batches = _batches(vocab)
    blocks = tuple(f"layers.{i}" for i in range(LAYERS))
    results = {"flops_per_second": rate}
    pp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    for name, split in (("balanced", None), ("equal", equal_split(blocks, world))):
        pipe = autoshard.autoshard(_model(vocab), pp_mesh, example_inputs=(batches[0][0],), loss_fn=_loss,
                                   microbatches=MICROBATCHES, schedule="1F1B", pp_split=split)
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)

        def step(tokens, targets, pipe=pipe, optimizer=optimizer):
            optimizer.zero_grad()
            loss = pipe.step(tokens, targets)
            optimizer.step()
            return loss

        seconds, loss = _time_steps(step, batches)
        stages = pipe.autoshard_plan.pipeline
        measured = None
        for turn in range(world):  # one rank at a time, so each stage has a core to itself
            torch.distributed.barrier()
            if turn == rank:
                measured = _stage_seconds(pipe)
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, measured)
        results[name] = {
            "step_seconds": seconds, "loss": loss,
            "stages": [{"units": list(s.units), "predicted_seconds": s.flops / rate, "measured_seconds": m}
                       for s, m in zip(stages.stages, gathered, strict=True)],
        }
    if not with_2d:
        return results
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    index, count = autoshard.data_parallel_rank(mesh_2d)
    local = batches[0][0].chunk(count)[index]
    sharded = autoshard.autoshard(_model(vocab), mesh_2d, example_inputs=(local,), check=False)
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
    from autoshard.adapters.launch import spawn

    results = spawn(_rank, 4)[0]
    two = spawn(_rank, 2, (VOCAB_PP2, False))[0]
    print(f"Llama vocab {VOCAB}, {LAYERS} blocks, dim {DIM}; batch {BATCH}x{SEQ}, {MICROBATCHES} microbatches, "
          f"1F1B on pp=4 (4 gloo ranks on this machine's 2 cores)")
    _report(results)
    balanced, equal, flat = results["balanced"], results["equal"], results["2d"]
    slowest = {n: max(s["measured_seconds"] for s in results[n]["stages"]) for n in ("balanced", "equal")}
    print(f"slowest stage, each measured alone: balanced / equal {slowest['balanced'] / slowest['equal']:.2f}x; "
          f"step time balanced / equal {balanced['step_seconds'] / equal['step_seconds']:.2f}x (4 ranks share 2 "
          "cores: a step takes the ranks' total work, whatever the split)")
    print(f"2-D dp=2 x tp=2 on the same 4 ranks: step {flat['step_seconds'] * 1e3:.1f} ms (loss {flat['loss']:.4f}); "
          f"pp=4 balanced / 2-D: {balanced['step_seconds'] / flat['step_seconds']:.2f}x")
    print(f"\npp=2 (2 ranks, a core each), vocab {VOCAB_PP2}:")
    _report(two)
    ratio = two["balanced"]["step_seconds"] / two["equal"]["step_seconds"]
    print(f"balanced / equal step time on pp=2: {ratio:.2f}x (goal <= 0.85x)")
    out = os.path.join(ROOT, "benchmarks", "results", "bench_pp.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"pp4": results, "pp2": two}, f, indent=1)


def _report(results: dict) -> None:
    for name in ("balanced", "equal"):
        run = results[name]
        print(f"{name:>9}: step {run['step_seconds'] * 1e3:8.1f} ms (loss {run['loss']:.4f})")
        for i, stage in enumerate(run["stages"]):
            units = stage["units"]
            print(f"           stage {i}: {units[0]}..{units[-1]} ({len(units)} blocks): predicted "
                  f"{stage['predicted_seconds'] * 1e3:7.2f} ms, measured {stage['measured_seconds'] * 1e3:7.2f} ms "
                  "per microbatch")


if __name__ == "__main__":
    main()
