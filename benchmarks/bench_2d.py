"""Benchmark autoshard against a hand-written torchtitan-style 2-D recipe.

One command (``python benchmarks/bench_2d.py`` from the repo root) trains the
example 4-block Llama on a ("dp", "tp") = (2, 2) CPU/gloo mesh of 4 local
processes, once sharded by ``autoshard.autoshard`` and once by the recipe in
``benchmarks/recipe.py``, on the same initial weights and the same batches,
and reports per variant: median step time, collectives and wire bytes per
step on each mesh axis, parameter bytes per rank, peak RSS per rank, and the
loss after training. A table goes to stdout, everything to JSON
(``benchmarks/results/bench_2d.json`` unless ``--out``).

Method, and why:

* Each variant runs in its own ``spawn`` (its own processes and process
  group), so peak RSS (``ru_maxrss``) belongs to that variant alone.
* Before sharding, every rank keeps a single-device deepcopy of the model;
  the first step's logits and loss of each variant are compared with it on
  the rank's local batch. The recipe must match within 1e-4 relative (else
  the run aborts: comparing against a wrong baseline is meaningless);
  autoshard's error is reported alongside.
* Step = zero_grad + forward + cross-entropy + backward + AdamW step. Each
  timed step starts after a ``dist.barrier()`` and ends when the optimizer
  step returns; a step's time is the max over ranks (the step is as slow as
  its slowest rank).
* Warmup steps are untimed. The last warmup step runs inside
  ``CollectiveCounter``, so counts and wire bytes describe one steady-state
  step (forward, backward and optimizer) without slowing a timed step.
* Step time on a small machine running 4 processes is noisy and drifts, so
  the variants are run in ``--rounds`` rounds (default 2) in alternating
  order (A B, then B A, ...); the reported step time is the median of all
  timed steps of a variant pooled over its rounds. Per-round medians are in
  the JSON. Every round trains from the same initial state on the same
  batches, so losses and communication must agree across rounds; the JSON
  records whether they do.
* "final loss" is the dp-averaged loss of a fixed held-out batch evaluated
  under ``no_grad`` after the last timed step.
"""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import argparse  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import autoshard  # noqa: E402
from autoshard.comm_stats import CollectiveCounter  # noqa: E402
from autoshard.launch import spawn  # noqa: E402
from benchmarks.recipe import parallelize_recipe  # noqa: E402
from examples.models import Llama, LlamaConfig  # noqa: E402

MODEL_CONFIG = LlamaConfig(
    num_layers=4, dim=64, num_heads=4, num_kv_heads=2, ffn_hidden=128, vocab_size=256, max_seq_len=64
)
MESH_SHAPE = (2, 2)
MESH_DIMS = ("dp", "tp")
WORLD_SIZE = MESH_SHAPE[0] * MESH_SHAPE[1]
GLOBAL_BATCH = 4
SEQ_LEN = 16
LR = 1e-3
SEED = 0
PARITY_RTOL = 1e-4
VARIANTS = ("autoshard", "recipe")
# target name -> (metric key in a variant summary, max allowed autoshard/recipe ratio)
TARGETS = {
    "tp_wire_bytes": ("tp_wire_bytes", 0.65),
    "dp_wire_bytes": ("dp_wire_bytes", 1.0),
    "step_time": ("step_time_median_s", 1.0),
}
DEFAULT_OUT = os.path.join(REPO_ROOT, "benchmarks", "results", "bench_2d.json")


# --------------------------------------------------------------------------- data


def global_batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``index`` of the run: seeded by its index so every rank, variant and round sees the same data."""
    gen = torch.Generator().manual_seed(10_000 + index)
    tokens = torch.randint(0, MODEL_CONFIG.vocab_size, (GLOBAL_BATCH, SEQ_LEN), generator=gen)
    targets = torch.randint(0, MODEL_CONFIG.vocab_size, (GLOBAL_BATCH, SEQ_LEN), generator=gen)
    return tokens, targets


def local_batch(index: int, mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's dp slice of batch ``index`` (ranks of one tp group share it)."""
    dp_rank, dp_size = mesh.get_local_rank("dp"), mesh.size(0)
    tokens, targets = global_batch(index)
    return tokens.chunk(dp_size)[dp_rank], targets.chunk(dp_size)[dp_rank]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --------------------------------------------------------------------------- per-rank pieces


def build_variant(variant: str, model: torch.nn.Module, mesh, example_tokens: torch.Tensor) -> torch.nn.Module:
    """Shard ``model`` with the chosen method; the only place the two variants differ."""
    if variant == "autoshard":
        return autoshard.autoshard(model, mesh, example_inputs=(example_tokens,))
    if variant == "recipe":
        return parallelize_recipe(model, mesh)
    raise ValueError(f"unknown variant {variant!r}")


def train_step(model, optimizer, tokens, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """One full step; zero_grad first so the timed region ends exactly at the end of ``optimizer.step``."""
    optimizer.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = lm_loss(logits, targets)
    loss.backward()
    optimizer.step()
    return logits.detach(), loss.detach()


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - b| / max |b|: a scale-free error that one outlier cannot hide in a mean."""
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape:
        raise AssertionError(f"shape mismatch {tuple(actual.shape)} vs {tuple(expected.shape)}")
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def parity_errors(reference, tokens, targets, logits, loss) -> dict[str, float]:
    """First-step errors against the unsharded model on the same local batch (it has not stepped yet)."""
    with torch.no_grad():
        ref_logits = reference(tokens)
        ref_loss = lm_loss(ref_logits, targets)
    return {"logits": rel_error(logits, ref_logits), "loss": rel_error(loss, ref_loss)}


def local_param_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank stores (local shards of DTensors)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def comm_summary(counter: CollectiveCounter) -> dict:
    """Counts by kind and wire bytes per axis as plain JSON data."""
    return {
        axis: {"counts": dict(sorted(s.counts.items())), "num_collectives": s.num_collectives,
               "wire_bytes": s.wire_bytes}
        for axis, s in sorted(counter.stats().items())
    }


def dp_mean(value: torch.Tensor, mesh) -> float:
    """Global-batch loss from per-rank losses on equal-sized dp slices."""
    total = value.detach().clone().reshape(1)
    dist.all_reduce(total, group=mesh.get_group("dp"))
    return total.item() / mesh.size(0)


def eval_loss(model, mesh) -> float:
    """Loss on a held-out batch after training: a step-independent end state to compare variants."""
    tokens, targets = local_batch(-1, mesh)
    with torch.no_grad():
        loss = lm_loss(model(tokens), targets)
    return dp_mean(loss, mesh)


def max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise max over all ranks (slowest rank per step, largest footprint)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def quiet_known_warnings() -> None:
    """Silence one FSDP2 warning per rank that would otherwise flood the output.

    FSDP2 warns when the root returns a view (the recipe's gathered logits);
    the hazard it names (an in-place op on that view) does not occur here:
    the loss reads the logits out of place.
    """
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def run_variant(rank: int, world_size: int, variant: str, steps: int, warmup: int) -> dict | None:
    """Everything one spawn measures for one variant; rank 0 returns the gathered result."""
    quiet_known_warnings()
    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=MESH_DIMS)
    torch.manual_seed(SEED)
    model = Llama(MODEL_CONFIG)
    reference = copy.deepcopy(model)
    tokens, _ = local_batch(0, mesh)
    sharded = build_variant(variant, model, mesh, tokens)
    del model
    # Measured now: after a no_grad forward FSDP2 leaves the root (reshard_after_forward=False) unsharded.
    param_bytes = local_param_bytes(sharded)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=LR)
    groups = {name: mesh.get_group(name) for name in MESH_DIMS}

    times, comm, parity = [], None, None
    for i in range(warmup + steps):
        tokens, targets = local_batch(i, mesh)
        if i == warmup - 1:
            with CollectiveCounter(groups) as counter:
                logits, loss = train_step(sharded, optimizer, tokens, targets)
            comm = comm_summary(counter)
        elif i >= warmup:
            dist.barrier()
            start = time.perf_counter()
            logits, loss = train_step(sharded, optimizer, tokens, targets)
            times.append(time.perf_counter() - start)
        else:
            logits, loss = train_step(sharded, optimizer, tokens, targets)
        if i == 0:
            parity = parity_errors(reference, tokens, targets, logits, loss)
            del reference
    final_loss = eval_loss(sharded, mesh)
    first_loss_errs = max_over_ranks([parity["logits"], parity["loss"]])

    step_times = max_over_ranks(times)
    rss_kib, param_bytes = max_over_ranks(
        [float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss), float(param_bytes)]
    )
    all_comm = [None] * world_size
    dist.all_gather_object(all_comm, comm)
    if rank != 0:
        return None
    return {
        "step_times_s": step_times,
        "comm_per_rank": all_comm,
        "param_bytes_per_rank_max": int(param_bytes),
        "peak_rss_kib_max": int(rss_kib),
        "final_loss": final_loss,
        "parity": {"logits_rel_err": first_loss_errs[0], "loss_rel_err": first_loss_errs[1]},
    }


# --------------------------------------------------------------------------- driver side


def run_rounds(rounds: int, steps: int, warmup: int) -> dict[str, list[dict]]:
    """Alternate the variant order each round so slow drift of the machine hits both alike."""
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
        for variant in order:
            result = spawn(run_variant, WORLD_SIZE, (variant, steps, warmup),
                           timeout=datetime.timedelta(minutes=5))[0]
            runs[variant].append(result)
    return runs


def axis_comm(per_rank: list[dict], axis: str) -> dict:
    """One axis over ranks: rank 0's counts, max wire bytes, and whether all ranks agree."""
    entries = [c.get(axis, {"counts": {}, "num_collectives": 0, "wire_bytes": 0}) for c in per_rank]
    return {
        "counts": entries[0]["counts"],
        "num_collectives": entries[0]["num_collectives"],
        "wire_bytes": max(e["wire_bytes"] for e in entries),
        "ranks_agree": all(e == entries[0] for e in entries),
    }


def summarize(results: list[dict]) -> dict:
    """Collapse a variant's rounds into the reported numbers."""
    first = results[0]
    axes = sorted({a for r in results for c in r["comm_per_rank"] for a in c})
    comm = {a: axis_comm(first["comm_per_rank"], a) for a in axes}
    pooled = [t for r in results for t in r["step_times_s"]]
    return {
        "step_time_median_s": statistics.median(pooled),
        "step_time_round_medians_s": [statistics.median(r["step_times_s"]) for r in results],
        "step_times_s": [r["step_times_s"] for r in results],
        "comm_per_step": comm,
        "tp_wire_bytes": comm.get("tp", {}).get("wire_bytes", 0),
        "dp_wire_bytes": comm.get("dp", {}).get("wire_bytes", 0),
        "tp_collectives": comm.get("tp", {}).get("num_collectives", 0),
        "dp_collectives": comm.get("dp", {}).get("num_collectives", 0),
        "comm_same_every_round": all(r["comm_per_rank"] == first["comm_per_rank"] for r in results),
        "param_bytes_per_rank": first["param_bytes_per_rank_max"],
        "peak_rss_kib_per_rank": max(r["peak_rss_kib_max"] for r in results),
        "final_loss": first["final_loss"],
        "final_loss_every_round": [r["final_loss"] for r in results],
        "first_step_parity": first["parity"],
    }


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def check_recipe_parity(summary: dict) -> None:
    """The baseline must compute the model's function, or the comparison is not honest."""
    parity = summary["recipe"]["first_step_parity"]
    worst = max(parity.values())
    if worst > PARITY_RTOL:
        raise AssertionError(f"recipe differs from the single-device model on step 1: {parity}")


def targets_section(summary: dict) -> dict:
    """autoshard/recipe ratios against their thresholds."""
    out = {}
    for name, (key, limit) in TARGETS.items():
        r = ratio(summary["autoshard"][key], summary["recipe"][key])
        out[name] = {"ratio": r, "max_ratio": limit, "met": r is not None and r <= limit}
    return out


def table_rows(summary: dict) -> list[tuple[str, float, float, str]]:
    """(label, autoshard, recipe, formatted value kind) for the printed table."""
    a, b = summary["autoshard"], summary["recipe"]
    rows = [("step time median (ms)", a["step_time_median_s"] * 1e3, b["step_time_median_s"] * 1e3, "f2")]
    for axis in ("tp", "dp"):
        ca, cb = a["comm_per_step"].get(axis, {}), b["comm_per_step"].get(axis, {})
        rows.append((f"{axis} collectives / step", ca.get("num_collectives", 0), cb.get("num_collectives", 0), "d"))
        for kind in sorted(set(ca.get("counts", {})) | set(cb.get("counts", {}))):
            rows.append((f"  {axis} {kind}", ca["counts"].get(kind, 0), cb["counts"].get(kind, 0), "d"))
        rows.append((f"{axis} wire bytes / step", ca.get("wire_bytes", 0), cb.get("wire_bytes", 0), "d"))
    for axis in sorted(set(a["comm_per_step"]) - {"tp", "dp"}):
        rows.append((f"{axis} wire bytes / step", a["comm_per_step"].get(axis, {}).get("wire_bytes", 0),
                     b["comm_per_step"].get(axis, {}).get("wire_bytes", 0), "d"))
    rows += [
        ("param bytes / rank", a["param_bytes_per_rank"], b["param_bytes_per_rank"], "d"),
        ("peak RSS / rank (MiB, max)", a["peak_rss_kib_per_rank"] / 1024, b["peak_rss_kib_per_rank"] / 1024, "f1"),
        ("final loss (held-out batch)", a["final_loss"], b["final_loss"], "f6"),
        ("step-1 loss rel err vs 1 device", a["first_step_parity"]["loss_rel_err"],
         b["first_step_parity"]["loss_rel_err"], "e"),
        ("step-1 logits rel err vs 1 device", a["first_step_parity"]["logits_rel_err"],
         b["first_step_parity"]["logits_rel_err"], "e"),
    ]
    return rows


def fmt(value: float, kind: str) -> str:
    if kind == "d":
        return f"{int(value):,}"
    if kind == "e":
        return f"{value:.2e}"
    return f"{value:.{kind[1:]}f}"


def format_table(summary: dict) -> str:
    rows = table_rows(summary)
    lines = [f"{'metric':<36}{'autoshard':>14}{'recipe':>14}{'ratio a/r':>11}", "-" * 75]
    for label, va, vb, kind in rows:
        r = ratio(va, vb) if kind != "e" else None
        lines.append(f"{label:<36}{fmt(va, kind):>14}{fmt(vb, kind):>14}{(f'{r:.3f}' if r is not None else '-'):>11}")
    return "\n".join(lines)


def format_targets(targets: dict) -> str:
    parts = []
    for name, t in targets.items():
        r = "n/a" if t["ratio"] is None else f"{t['ratio']:.3f}"
        parts.append(f"{name} ratio {r} <= {t['max_ratio']}: {'met' if t['met'] else 'NOT met'}")
    return "targets: " + "; ".join(parts)


def config_section(args) -> dict:
    return {
        "model": "examples.models.Llama",
        "model_config": dataclasses.asdict(MODEL_CONFIG),
        "mesh": {"device_type": "cpu", "backend": "gloo", "shape": list(MESH_SHAPE), "dim_names": list(MESH_DIMS)},
        "world_size": WORLD_SIZE,
        "threads_per_rank": 1,
        "global_batch": [GLOBAL_BATCH, SEQ_LEN],
        "local_batch": [GLOBAL_BATCH // MESH_SHAPE[0], SEQ_LEN],
        "optimizer": {"name": "AdamW", "lr": LR},
        "loss": "cross_entropy on random targets",
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "parity_rtol": PARITY_RTOL,
        "torch_version": torch.__version__,
        "cpu_count": os.cpu_count(),
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 1; the last one is counted)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, variant order alternating")
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON output path")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--warmup, --steps and --rounds must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    runs = run_rounds(args.rounds, args.steps, args.warmup)
    summary = {v: summarize(runs[v]) for v in VARIANTS}
    check_recipe_parity(summary)
    report = {
        "config": config_section(args),
        "variants": summary,
        "targets": targets_section(summary),
        "wall_time_s": time.perf_counter() - start,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(format_table(summary))
    print(format_targets(report["targets"]))
    print(f"wall time {report['wall_time_s']:.1f} s; JSON: {os.path.relpath(args.out)}")
    return report


if __name__ == "__main__":
    main()
