"""What depth costs planning: ``autoshard.plan`` on a meta-device Hugging Face Llama of 2, 32 and 80 blocks.

``python benchmarks/bench_depth.py`` (``make bench-depth``) builds
``LlamaForCausalLM`` on the meta device with Llama-3 shapes (hidden 4096, 32
heads of which 8 kv heads, MLP 14336, vocabulary 128256; ``use_cache=False``)
at each depth, and plans it for a 2x4 mesh (``dp=2, tp=4``, a fake process
group of 8 ranks in this process) on a batch of 1x64 tokens. The depths are
planned in turn, round after round, so that the load of a shared machine falls
on all of them alike; each depth's time is its median over the rounds, and the
ratios to 2 blocks are what the goal is about: a stack of identical blocks is
traced as two and the rest written, so depth should cost only what writing and
planning the copies costs (goal: 32 blocks at most 1.5x of 2, 80 blocks at
most 2x). One untimed plan first pays torch.export's one-time warm-up. JSON
goes to ``benchmarks/results/bench_depth.json`` unless ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEPTHS = (2, 32, 80)
GOALS = {32: 1.5, 80: 2.0}  # planning time at that depth over planning time at 2 blocks, at most
MESH = (2, 4)  # dp x tp
TOKENS = (1, 64)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """A Llama's sizes; the default is Llama-3 8B's (the depth is the benchmark's variable)."""

    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 14336
    vocab: int = 128256


def meta_llama(blocks: int, shapes: Shapes):
    """``LlamaForCausalLM`` on the meta device, its non-persistent rotary buffer filled (planning
    refuses a buffer the forward reads that holds no values)."""
    import torch
    import transformers as hf

    config = hf.LlamaConfig(vocab_size=shapes.vocab, hidden_size=shapes.hidden, intermediate_size=shapes.intermediate,
                            num_hidden_layers=blocks, num_attention_heads=shapes.heads,
                            num_key_value_heads=shapes.kv_heads, max_position_embeddings=max(TOKENS), use_cache=False)
    with torch.device("meta"):
        model = hf.LlamaForCausalLM(config)
    model.model.rotary_emb.inv_freq = type(model.model.rotary_emb)(config=config).inv_freq
    return model


def plan_seconds(model, mesh, tokens) -> float:
    """One ``autoshard.plan``, from a collected heap so that no earlier round's garbage is paid for."""
    import autoshard

    gc.collect()
    began = time.perf_counter()
    autoshard.plan(model, mesh, example_inputs=(tokens,))
    return time.perf_counter() - began


def fake_mesh():
    """A 2x4 ``DeviceMesh`` over a fake process group: planning for 8 ranks in one process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=MESH[0] * MESH[1])
    return init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--depths", default=",".join(map(str, DEPTHS)), help="comma-separated; the first is the base")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_depth.json"))
    args = parser.parse_args()
    import torch

    depths = tuple(int(d) for d in args.depths.split(","))
    shapes = Shapes()
    mesh = fake_mesh()
    tokens = torch.zeros(TOKENS, dtype=torch.long)
    models = {n: meta_llama(n, shapes) for n in depths}
    plan_seconds(models[depths[0]], mesh, tokens)  # torch.export's first trace warms up
    runs: dict[int, list[float]] = {n: [] for n in depths}
    for r in range(args.rounds):
        for n in depths:
            runs[n].append(plan_seconds(models[n], mesh, tokens))
        print(f"round {r + 1}: " + ", ".join(f"{n} blocks {runs[n][-1]:.3f} s" for n in depths), flush=True)
    median = {n: statistics.median(v) for n, v in runs.items()}
    base = depths[0]
    ratio = {n: median[n] / median[base] for n in depths}
    print(f"\nautoshard.plan, meta Llama (hidden {shapes.hidden}, {shapes.heads} heads / {shapes.kv_heads} kv, "
          f"vocab {shapes.vocab}), mesh dp={MESH[0]} x tp={MESH[1]}, median of {args.rounds} rounds:")
    for n in depths:
        goal = GOALS.get(n) if base == DEPTHS[0] else None
        verdict = "" if goal is None else f"  (goal <= {goal}x: {'met' if ratio[n] <= goal else 'MISSED'})"
        print(f"  {n:3d} blocks  {median[n]:6.3f} s  {ratio[n]:5.2f}x of {base}{verdict}")
    if len(depths) > 1:
        extra = (median[depths[-1]] - median[base]) / (depths[-1] - base) * 1000
        print(f"  each block past {base}: {extra:.1f} ms")
    result = {
        "model": {"family": "LlamaForCausalLM", "device": "meta", **dataclasses.asdict(shapes)},
        "mesh": {"dp": MESH[0], "tp": MESH[1]},
        "tokens": list(TOKENS),
        "torch": torch.__version__,
        "rounds": args.rounds,
        "seconds": {str(n): [round(t, 4) for t in v] for n, v in runs.items()},
        "median_seconds": {str(n): round(t, 4) for n, t in median.items()},
        "ratio_to_base": {str(n): round(x, 3) for n, x in ratio.items()},
        "goals": {str(n): g for n, g in GOALS.items()},
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
