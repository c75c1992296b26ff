"""Context parallelism at sequence 4096 against the same 4 ranks used for dp and for tp.

``make bench-cp`` (``python benchmarks/bench_cp.py``). The model is this project's example Llama
(4 blocks, dim 256, 8 heads over 4 kv heads, FFN 512, vocabulary 4096), trained on a global batch
of 4 sequences of 4096 tokens by 4 gloo CPU ranks (one launch) as

* ``cp=4``: every rank a quarter of every sequence (two chunks of 512, load-balanced), its logits
  left cut (``context_output="local"``) and its loss its tokens' share of the batch's;
* ``cp=4 whole``: the same with the logits gathered whole on every rank (the default), the loss
  computed as on one device;
* ``dp=4``: every rank one whole sequence (FSDP);
* ``tp=4``: every rank every sequence, a quarter of every weight.

Per layout: the median step time (forward, backward and an AdamW step) over the steps after warm-up,
the wire bytes per rank and step (measured by ``CollectiveCounter``, with the plan's prediction next
to it) and the activations each rank holds for backward on its part of the batch
(``tests/parity.held_for_backward``), against one device on the whole batch. A last table gives each cp rank's
attention FLOPs read from the emitted code, for the load-balanced cut and a contiguous one.

This machine has 2 cores for 4 ranks: a step takes about the ranks' total work, so the step times
compare the work and communication each layout adds, not what 4 devices would take. Results go
to ``benchmarks/results/bench_cp.json``.
"""

from __future__ import annotations

import json
import operator
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

VOCAB, LAYERS, DIM, HEADS, KV_HEADS, FFN = 4096, 4, 256, 8, 4, 512
BATCH, SEQ, STEPS, WARMUP = 4, 4096, 3, 1
# name: (mesh axes, context_output)
LAYOUTS = {"cp=4": (("cp",), "local"), "cp=4 whole": (("cp",), "whole"), "dp=4": (("dp",), None),
           "tp=4": (("tp",), None)}


def _model():
    import torch

    from examples.models import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=VOCAB, dim=DIM, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                             ffn_hidden=FFN, max_seq_len=SEQ))


def _rank(rank: int, world: int) -> list[dict]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    import autoshard
    from autoshard.adapters.comm_stats import CollectiveCounter
    from tests.parity import held_for_backward, lm_loss

    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    ids, targets = batch[:, :-1], batch[:, 1:]
    rows = []
    for name, (axes, context_output) in LAYOUTS.items():
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=axes)
        local_ids, local_targets = (ids[rank:rank + 1], targets[rank:rank + 1]) if axes == ("dp",) else (ids, targets)
        model = _model()
        options = {"context_output": context_output} if context_output else {}
        sharded = autoshard.autoshard(model, mesh, example_inputs=(local_ids,), check=False, **options)
        if context_output == "local":  # each rank's loss: its tokens' share of the batch's mean
            mine = local_targets[:, sharded.cp_positions]

            def loss_fn(logits, whole, mine=mine):
                return F.cross_entropy(logits.flatten(0, 1), mine.flatten(), reduction="sum") / whole.numel()
        else:
            loss_fn = lm_loss
        optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
        times, counter = [], None
        for step in range(WARMUP + STEPS):
            if step == WARMUP:
                counter = CollectiveCounter({axes[0]: mesh.get_group(axes[0])})
                counter.__enter__()
            dist.barrier()
            start = time.perf_counter()
            loss = loss_fn(sharded(local_ids), local_targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            dist.barrier()
            times.append(time.perf_counter() - start)
            if step == WARMUP:
                counter.__exit__(None, None, None)
        held = held_for_backward(sharded, local_ids)
        predicted = sharded.autoshard_plan.predicted_comm()
        rows.append({
            "layout": name,
            "step_seconds": statistics.median(times[WARMUP:]),
            "wire_bytes": counter.stats()[axes[0]].wire_bytes,
            "predicted_bytes": sum(b for kinds in predicted.values() for _, b in kinds.values()),
            "held_for_backward": held,
            "loss": _batch_loss(loss, context_output),
        })
        del sharded, optimizer
    if rank == 0:
        model = _model()
        rows.append({"layout": "one device", "held_for_backward": held_for_backward(model, ids)})
    return rows


def _batch_loss(loss, context_output) -> float:
    """The batch's loss: on cp with outputs left cut, the ranks' shares added."""
    import torch.distributed as dist

    total = loss.detach().clone()
    if context_output == "local":
        dist.all_reduce(total)
    return total.item()


def _attention_work() -> dict:
    import torch

    from autoshard.passes.capture import capture
    from autoshard.passes.cut_sequence import cut_sequence
    from autoshard.proof.context_proof import attention_work

    model = _model()
    ids = torch.randint(0, VOCAB, (1, SEQ))
    work = {}
    for balanced in (True, False):
        captured = capture(model, (ids,), {}, None, None, True)
        cut_sequence(captured.gm, SEQ, 4, "cp", set(captured.param_shapes), balanced=balanced)
        weights = {n.target: operator.attrgetter(n.target)(captured.gm) for n in captured.gm.graph.nodes
                   if n.op == "get_attr" and isinstance(operator.attrgetter(n.target)(captured.gm), torch.Tensor)}
        found = attention_work(captured.gm, 4, [ids], weights)
        work["balanced" if balanced else "contiguous"] = {"executed": found.executed, "useful": found.useful}
    return work


def main() -> None:
    from autoshard.adapters.launch import spawn

    rows = spawn(_rank, 4)[0]
    one = next(r for r in rows if r["layout"] == "one device")["held_for_backward"]
    print(f"model: Llama {LAYERS} blocks, dim {DIM}, {HEADS} heads / {KV_HEADS} kv, vocab {VOCAB}; "
          f"global batch {BATCH} x {SEQ} tokens; 4 gloo ranks on this machine's cores")
    print(f"{'layout':<10} {'step (s)':>9} {'wire MB/rank':>13} {'predicted':>10} {'held for backward per rank':>27}")
    for row in rows:
        if row["layout"] == "one device":
            continue
        print(f"{row['layout']:<10} {row['step_seconds']:>9.2f} {row['wire_bytes'] / 1e6:>13.1f} "
              f"{row['predicted_bytes'] / 1e6:>10.1f} {row['held_for_backward'] / 1e6:>12.1f} MB "
              f"({row['held_for_backward'] / one:.2f}x)")
    print(f"one device holds {one / 1e6:.1f} MB for backward on the global batch")
    work = _attention_work()
    print("attention GFLOPs per cp rank (one sequence, forward), read from the emitted code:")
    for name, found in work.items():
        useful, executed = found["useful"], found["executed"]
        print(f"  {name:<11} useful {' '.join(f'{u / 1e9:6.2f}' for u in useful)}   (max/min "
              f"{max(useful) / min(useful):.2f});  executed {' '.join(f'{e / 1e9:6.2f}' for e in executed)}")
    out = os.path.join(ROOT, "benchmarks", "results", "bench_cp.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"runs": rows, "attention": work}, f, indent=1)


if __name__ == "__main__":
    main()
