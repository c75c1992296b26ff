"""Rank the meshes of 4 CPU ranks with ``autoshard.suggest_mesh``, then measure them.

``python benchmarks/bench_meshes.py`` (``make bench-meshes``) spawns 4 gloo
ranks. For the demo model (``examples/train_llama.py``'s config, batch 8x32)
and a Hugging Face Llama (2 layers, batch 8x32) it prints the table
``suggest_mesh`` ranks (links probed on this process group, compute rate
measured here), then trains the model on each of ``{"dp": 4}``,
``{"dp": 2, "tp": 2}`` and ``{"tp": 4}`` (AdamW, 2 warmup and ``--steps``
timed steps, a step's time the max over ranks) and prints the predicted and
measured step times side by side with both rankings. JSON goes to
``benchmarks/results/bench_meshes.json`` unless ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import autoshard  # noqa: E402
from autoshard.adapters.launch import spawn  # noqa: E402
from examples.models import Llama  # noqa: E402
from examples.train_llama import CONFIG  # noqa: E402

MESHES = ({"dp": 4}, {"dp": 2, "tp": 2}, {"tp": 4})


def _hf_llama():
    import transformers as hf

    return hf.LlamaForCausalLM(hf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              use_cache=False))


MODELS = {"demo Llama": lambda: Llama(CONFIG), "HF Llama": _hf_llama}


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out.logits


def _measure(rank: int, world: int, steps: int) -> dict:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (8, 33), generator=gen)
    results = {}
    for name, build in MODELS.items():
        torch.manual_seed(0)
        suggestion = autoshard.suggest_mesh(build(), world, example_inputs=(batch[:, :-1],), verbose=False)
        measured = {}
        for sizes in MESHES:
            mesh = init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes))
            index, count = autoshard.data_parallel_rank(mesh)
            tokens, targets = batch[:, :-1].chunk(count)[index], batch[:, 1:].chunk(count)[index]
            torch.manual_seed(0)
            sharded = autoshard.autoshard(build(), mesh, example_inputs=(tokens,))
            optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
            times = []
            for step in range(steps + 2):
                dist.barrier()
                start = time.perf_counter()
                logits = _logits(sharded(tokens))
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
                optimizer.step()
                optimizer.zero_grad()
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if step >= 2:
                    times.append(elapsed.item())
            measured[_key(sizes)] = 1e3 * statistics.median(times)
        predicted = {_key(c.mesh): 1e3 * c.step_s for c in suggestion.candidates}
        results[name] = {"table": str(suggestion), "predicted_ms": predicted, "measured_ms": measured}
    return results


def _key(sizes) -> str:
    return " x ".join(f"{a}={n}" for a, n in sizes.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_meshes.json"))
    args = parser.parse_args()
    results = spawn(_measure, 4, (args.steps,))[0]
    for name, data in results.items():
        print(f"\n{name}: suggest_mesh's table\n{data['table']}\n")
        predicted, measured = data["predicted_ms"], data["measured_ms"]
        print(f"{'mesh':<16} {'predicted ms':>13} {'measured ms':>12}")
        for key in measured:
            print(f"{key:<16} {predicted.get(key, float('nan')):>13.1f} {measured[key]:>12.1f}")
        by_prediction = sorted(measured, key=lambda k: predicted.get(k, float("inf")))
        by_measurement = sorted(measured, key=measured.get)
        verdict = "match" if by_prediction == by_measurement else "differ"
        print(f"ranking predicted: {' < '.join(by_prediction)}\nranking measured:  {' < '.join(by_measurement)} "
              f"({verdict})")
        data.update(ranking_predicted=by_prediction, ranking_measured=by_measurement)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
