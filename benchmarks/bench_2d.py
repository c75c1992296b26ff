"""Benchmark autoshard against a hand-written torchtitan-style 2-D recipe.

One command (``python benchmarks/bench_2d.py`` from the repo root) trains the
example 4-block Llama on a ("dp", "tp") = (2, 2) CPU/gloo mesh of 4 local
processes, on the same initial weights and the same batches, as two pairs of
variants:

* eager: ``autoshard.autoshard(model, mesh, ...)`` vs the recipe in
  ``benchmarks/recipe.py``;
* compiled: ``torch.compile(model, backend=autoshard.backend(mesh,
  compiler=C))`` vs the recipe with each block's forward compiled by C
  (``compile_recipe_blocks``). Both compile exactly the blocks' computation
  with C and nothing else: FSDP2's hooks stay eager around the blocks and the
  root (embedding, final norm, LM head) runs eagerly, so the pair compares
  the two shardings under one compiler. C is ``--compiler`` (``inductor``,
  default, or ``aot_eager``); ``--variants eager`` or ``compiled`` runs one
  pair only.

It reports per variant: median step time, the first step's time (which
includes compiling), collectives and wire bytes per step on each mesh axis,
parameter bytes per rank, peak RSS per rank, the loss after training and the
first step's error against one device. A table goes to stdout, everything to
JSON (``benchmarks/results/bench_2d.json`` unless ``--out``).

Method, and why:

* Each variant runs in its own ``spawn`` (its own processes and process
  group), so peak RSS (``ru_maxrss``) belongs to that variant alone.
* Before sharding, every rank keeps a single-device deepcopy of the model;
  the first step's logits and loss of each variant are compared with it on
  the rank's local batch, and every parameter's gradient norm with its
  gradient on the global batch (a norm does not depend on autoshard's
  stored layouts; a lost gradient shows as error 1). Each recipe variant
  must match within 1e-5 relative, 1e-4 when compiled by inductor (else the
  run aborts: comparing against a wrong baseline is meaningless);
  autoshard's errors are reported alongside. Eager and ``aot_eager`` run the
  reference's own ATen kernels; inductor generates fused kernels that sum in
  another order, hence the looser bound.
* Step = zero_grad + forward + cross-entropy + backward + AdamW step. Each
  timed step starts after a ``dist.barrier()`` and ends when the optimizer
  step returns; a step's time is the max over ranks (the step is as slow as
  its slowest rank).
* The first step is timed on its own and reported apart: it includes FSDP2's
  lazy initialization and, for the compiled pair, dynamo's trace, the
  autoshard pipeline (the backend shards at the first call) and C compiling
  forward and backward of every block. Each rank of a compiled variant gets
  an empty inductor cache directory, so every run pays the full compile
  (nothing is reused from the other variant, an earlier round or run).
* The compiled autoshard variant's optimizer is built from
  ``model.parameters()`` before the first call and attached to the backend
  (``backend.attach``: each ``step()`` steps the shards); its parameter bytes are measured on
  ``backend.parameters()``, every variant's after the first step.
* Warmup steps (the first included) are untimed. The last warmup step runs
  inside a ``CollectiveCounter`` (it also counts the collectives
  inductor's code calls, and lets dynamo run compiled frames under it), so
  counts and wire bytes describe one steady-state step
  (forward, backward and optimizer) without slowing a timed step.
* Step time on a small machine running 4 processes is noisy and drifts, so
  the variants are run in ``--rounds`` rounds (default 2) in alternating
  order (A B, then B A, ...); the reported step time is the median of all
  timed steps of a variant pooled over its rounds. Per-round medians are in
  the JSON. Every round trains from the same initial state on the same
  batches, so losses and communication must agree across rounds; the JSON
  records whether they do.
* "final loss" is the dp-averaged loss of a fixed held-out batch evaluated
  after the last timed step (a forward without backward; not under
  ``no_grad``, which would make dynamo recompile the compiled variants).
* Only the eager pair is checked against targets; the compiled pair's
  step-time and wire-byte ratios are reported as information.
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
import logging  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._dynamo.utils import counters as dynamo_counters  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import autoshard  # noqa: E402
from autoshard.adapters.comm_stats import CollectiveCounter  # noqa: E402
from autoshard.adapters.launch import spawn  # noqa: E402
from benchmarks.recipe import compile_recipe_blocks, parallelize_recipe  # noqa: E402
from examples.models import Llama, LlamaConfig  # noqa: E402
from tests.parity import held_for_backward  # noqa: E402

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
# First-step parity vs the single-device model. Eager and aot_eager run the reference's own ATen kernels;
# inductor generates fused kernels that sum in another order, so its rounding differs more.
PARITY_RTOL = 1e-5
PARITY_RTOL_INDUCTOR = 1e-4
# pair name -> (autoshard variant, recipe variant); each pair is compared column against column
PAIRS = {
    "eager": ("autoshard", "recipe"),
    "compiled": ("autoshard_compiled", "recipe_compiled"),
    # eager, configured alike on both sides
    "bf16": ("autoshard_bf16", "recipe_bf16"),  # MixedPrecisionPolicy(bfloat16, float32)
    "selective": ("autoshard_selective", "recipe_selective"),  # selective activation checkpointing
    "full": ("autoshard_full", "recipe_full"),  # full activation checkpointing
}
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
PARITY_RTOL_BF16 = 3e-2  # a bf16 run against the fp32 single-device model
COMPILED_VARIANTS = PAIRS["compiled"]
COMPILERS = ("inductor", "aot_eager")
# target name -> (metric key in a variant summary, max allowed autoshard/recipe ratio); checked on the eager pair
TARGETS = {
    "tp_wire_bytes": ("tp_wire_bytes", 0.65),
    "dp_wire_bytes": ("dp_wire_bytes", 1.0),
    "step_time": ("step_time_median_s", 1.0),
}
# reported for the compiled pair without a threshold
COMPILED_RATIOS = {
    "step_time": "step_time_median_s",
    "tp_wire_bytes": "tp_wire_bytes",
    "dp_wire_bytes": "dp_wire_bytes",
}
SPAWN_TIMEOUT = datetime.timedelta(minutes=15)  # a rank may wait this long for another rank's compile
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


@dataclasses.dataclass
class Built:
    """A sharded model as the training loop sees it.

    The compiled autoshard variant shards at its first call, so what the
    optimizer is built from (the model's parameters, handed over to the
    shards by ``attach``) and what training updates (the backend's shards)
    are two different sets of tensors; the eager variants have one set.
    """

    step_module: Callable[[torch.Tensor], torch.Tensor]
    optimizer_params: list[torch.nn.Parameter]
    # (original FQN, tensor) of what training updates; valid from the first call on
    trained_parameters: Callable[[], Iterable[tuple[str, torch.nn.Parameter]]]
    attach: Callable[[torch.optim.Optimizer], torch.optim.Optimizer] = lambda optimizer: optimizer


def build_variant(variant: str, model: torch.nn.Module, mesh, example_tokens: torch.Tensor, compiler: str) -> Built:
    """Shard ``model`` with the chosen method; the only place the variants differ."""
    options = _variant_options(variant)
    if variant.startswith("autoshard") and variant != "autoshard_compiled":
        autoshard_options = {"mp_policy": options["mp_policy"], "activation_checkpointing": options["checkpointing"]}
        sharded = autoshard.autoshard(model, mesh, example_inputs=(example_tokens,), **autoshard_options)
        return Built(sharded, list(sharded.parameters()), sharded.named_parameters)
    if variant.startswith("recipe") and variant != "recipe_compiled":
        sharded = parallelize_recipe(model, mesh, **options)
        return Built(sharded, list(sharded.parameters()), sharded.named_parameters)
    if variant == "autoshard_compiled":
        backend = autoshard.backend(mesh, compiler=compiler)
        return Built(torch.compile(model, backend=backend), list(model.parameters()), backend.named_parameters,
                     backend.attach)
    if variant == "recipe_compiled":
        sharded = compile_recipe_blocks(parallelize_recipe(model, mesh), compiler)
        return Built(sharded, list(sharded.parameters()), sharded.named_parameters)
    raise ValueError(f"unknown variant {variant!r}")


def _variant_options(variant: str) -> dict:
    """The training options a variant name carries (the same on both sides of its pair)."""
    suffix = variant.split("_", 1)[1] if "_" in variant else ""
    return {
        "mp_policy": BF16 if suffix == "bf16" else None,
        "checkpointing": suffix if suffix in ("selective", "full") else None,
    }


def parity_rtol(variant: str, compiler: str) -> float:
    if variant.endswith("_bf16"):
        return PARITY_RTOL_BF16
    return PARITY_RTOL_INDUCTOR if variant in COMPILED_VARIANTS and compiler == "inductor" else PARITY_RTOL


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


def grad_norm_error(trained: Iterable[tuple[str, torch.nn.Parameter]], reference: torch.nn.Module) -> float:
    """Worst relative error of a parameter's gradient norm against one device on the global batch.

    The logits and loss check the forward only; this catches a gradient that
    is lost (norm 0, error 1) or scaled. A norm does not depend on layout
    (autoshard stores weights transposed, fused sections permuted), so it
    compares across shardings. Gradients are dp-averaged, so they equal the
    single-device gradient of the global batch. Collective: every rank calls it.
    """
    tokens, targets = global_batch(0)
    reference.zero_grad(set_to_none=True)
    lm_loss(reference(tokens), targets).backward()
    expected = {name: p.grad.norm() for name, p in reference.named_parameters()}
    worst = 0.0
    for name, p in trained:
        if p.grad is None:
            worst = max(worst, 1.0)
            continue
        norm = p.grad.norm()
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        worst = max(worst, rel_error(norm, expected[name]))
    return worst


def local_param_bytes(parameters: Iterable[torch.nn.Parameter]) -> int:
    """Bytes of parameters this rank stores (local shards of DTensors)."""
    total = 0
    for p in parameters:
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
    """Loss on a held-out batch after training: a step-independent end state to compare variants.

    A forward without backward, but not under ``no_grad``: dynamo guards the
    grad mode, so a ``no_grad`` call would compile the recipe's blocks again
    (an inductor compile outside the measured steps). Same numbers either way.
    """
    tokens, targets = local_batch(-1, mesh)
    loss = lm_loss(model(tokens), targets)
    return dp_mean(loss.detach(), mesh)


def max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise max over all ranks (slowest rank per step, largest footprint)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def quiet_known_warnings() -> None:
    """Silence two warnings per rank that would otherwise flood the output.

    FSDP2 warns when the root returns a view (the recipe's gathered logits);
    the hazard it names (an in-place op on that view) does not occur here:
    the loss reads the logits out of place. DTensor logs that reducing a 2-D
    gradient norm takes one all-reduce per mesh axis; that happens once, in
    the untimed gradient check.
    """
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def first_step(built: Built, optimizer, reference, tokens, targets) -> tuple[dict[str, float], float]:
    """Step 0: parity errors against one device, and its time (the gradient check between backward and
    optimizer is not timed)."""
    optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    start = time.perf_counter()
    logits = built.step_module(tokens)
    loss = lm_loss(logits, targets)
    loss.backward()
    elapsed = time.perf_counter() - start
    parity = parity_errors(reference, tokens, targets, logits.detach(), loss.detach())
    parity["grad_norm"] = grad_norm_error(built.trained_parameters(), reference)
    start = time.perf_counter()
    optimizer.step()
    return parity, elapsed + time.perf_counter() - start


def timed_step(model, optimizer, tokens, targets) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A step started together on every rank (after a barrier), with its wall time on this rank."""
    dist.barrier()
    start = time.perf_counter()
    logits, loss = train_step(model, optimizer, tokens, targets)
    return logits, loss, time.perf_counter() - start


def fresh_compile_cache() -> str:
    """Point inductor's on-disk caches at an empty directory of this rank's own.

    Otherwise a variant would reuse kernels and graphs compiled by an earlier
    spawn (the other variant, an earlier round, an earlier run) and its first
    step would not show what compiling costs.
    """
    path = tempfile.mkdtemp(prefix="bench_2d_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def run_variant(rank: int, world_size: int, variant: str, steps: int, warmup: int, compiler: str) -> dict | None:
    """Everything one spawn measures for one variant; rank 0 returns the gathered result."""
    cache_dir = fresh_compile_cache() if variant in COMPILED_VARIANTS else None
    try:
        return measure_variant(rank, world_size, variant, steps, warmup, compiler)
    finally:
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)


def measure_variant(rank: int, world_size: int, variant: str, steps: int, warmup: int, compiler: str) -> dict | None:
    """Build, train ``warmup + steps`` steps, evaluate; the compiled variants compile in step 0."""
    quiet_known_warnings()
    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=MESH_DIMS)
    torch.manual_seed(SEED)
    model = Llama(MODEL_CONFIG)
    reference = copy.deepcopy(model)
    tokens, targets = local_batch(0, mesh)
    built = build_variant(variant, model, mesh, tokens, compiler)
    del model
    optimizer = built.attach(torch.optim.AdamW(built.optimizer_params, lr=LR))
    groups = {name: mesh.get_group(name) for name in MESH_DIMS}

    parity, first_step_s = first_step(built, optimizer, reference, tokens, targets)
    del reference
    # After a training step: the compiled autoshard's shards exist only from its first call on, and
    # FSDP2 has resharded the root (a no_grad forward would leave it, reshard_after_forward=False, unsharded).
    param_bytes = local_param_bytes(p for _, p in built.trained_parameters())

    times, comm = [], None
    for i in range(1, warmup + steps):
        tokens, targets = local_batch(i, mesh)
        if i == warmup - 1:
            with CollectiveCounter(groups) as counter:
                train_step(built.step_module, optimizer, tokens, targets)
            comm = comm_summary(counter)
        elif i >= warmup:
            times.append(timed_step(built.step_module, optimizer, tokens, targets)[2])
        else:
            train_step(built.step_module, optimizer, tokens, targets)
    final_loss = eval_loss(built.step_module, mesh)
    # last: its no_grad forward leaves the recipe's root gathered; compiled variants would compile again
    held = held_for_backward(built.step_module, tokens) if variant not in COMPILED_VARIANTS else None
    result = gather_measurements(rank, world_size, times, first_step_s, comm, parity, param_bytes, final_loss)
    held_max = max_over_ranks([float(held)])[0] if held is not None else None
    if result is not None:
        result["held_bytes_per_block_max"] = None if held_max is None else held_max / MODEL_CONFIG.num_layers
        # what dynamo compiled: a block it gave up on (recompile limit) would run eagerly unnoticed
        result["dynamo_graphs_rank0"] = dynamo_counters["stats"]["unique_graphs"]
    return result


def gather_measurements(rank, world_size, times, first_step_s, comm, parity, param_bytes, final_loss) -> dict | None:
    """Worst rank for times, errors and footprint; every rank's collectives (they must agree)."""
    first_step_errs = max_over_ranks([parity["logits"], parity["loss"], parity["grad_norm"]])
    step_times = max_over_ranks(times)
    rss_kib, param_bytes, first_step_s = max_over_ranks(
        [float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss), float(param_bytes), first_step_s]
    )
    all_comm = [None] * world_size
    dist.all_gather_object(all_comm, comm)
    if rank != 0:
        return None
    return {
        "step_times_s": step_times,
        "first_step_s": first_step_s,
        "comm_per_rank": all_comm,
        "param_bytes_per_rank_max": int(param_bytes),
        "peak_rss_kib_max": int(rss_kib),
        "final_loss": final_loss,
        "parity": {"logits_rel_err": first_step_errs[0], "loss_rel_err": first_step_errs[1],
                   "grad_norm_rel_err": first_step_errs[2]},
    }


# --------------------------------------------------------------------------- driver side


def run_rounds(variants: tuple[str, ...], rounds: int, steps: int, warmup: int, compiler: str) -> dict[str, list[dict]]:
    """Alternate the variant order each round so slow drift of the machine hits all alike."""
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(rounds):
        order = variants if r % 2 == 0 else tuple(reversed(variants))
        for variant in order:
            result = spawn(run_variant, WORLD_SIZE, (variant, steps, warmup, compiler), timeout=SPAWN_TIMEOUT)[0]
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


def summarize(variant: str, results: list[dict], compiler: str) -> dict:
    """Collapse a variant's rounds into the reported numbers."""
    first = results[0]
    axes = sorted({a for r in results for c in r["comm_per_rank"] for a in c})
    comm = {a: axis_comm(first["comm_per_rank"], a) for a in axes}
    pooled = [t for r in results for t in r["step_times_s"]]
    return {
        "compiler": compiler if variant in COMPILED_VARIANTS else None,
        "step_time_median_s": statistics.median(pooled),
        "step_time_round_medians_s": [statistics.median(r["step_times_s"]) for r in results],
        "step_times_s": [r["step_times_s"] for r in results],
        "first_step_s": statistics.median(r["first_step_s"] for r in results),
        "first_step_every_round_s": [r["first_step_s"] for r in results],
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
        "dynamo_graphs_rank0": first["dynamo_graphs_rank0"],
        "parity_rtol": parity_rtol(variant, compiler),
        "held_bytes_per_block": first.get("held_bytes_per_block_max"),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def check_recipe_parity(summary: dict) -> None:
    """Each baseline must compute the model's function, or the comparison is not honest."""
    for _, recipe in selected_pairs(summary):
        parity, rtol = summary[recipe]["first_step_parity"], summary[recipe]["parity_rtol"]
        if max(parity.values()) > rtol:
            raise AssertionError(f"{recipe} differs from the single-device model on step 1 (rtol {rtol}): {parity}")


def selected_pairs(summary: dict) -> list[tuple[str, str]]:
    """The (autoshard, recipe) pairs that were run, eager first."""
    return [pair for pair in PAIRS.values() if pair[0] in summary]


def targets_section(summary: dict) -> dict:
    """Eager autoshard/recipe ratios against their thresholds; compiled ratios as information only."""
    out = {}
    if "autoshard" in summary:
        for name, (key, limit) in TARGETS.items():
            r = ratio(summary["autoshard"][key], summary["recipe"][key])
            out[name] = {"ratio": r, "max_ratio": limit, "met": r is not None and r <= limit}
    if "autoshard_compiled" in summary:
        a, b = summary["autoshard_compiled"], summary["recipe_compiled"]
        for name, key in COMPILED_RATIOS.items():
            out[f"compiled_{name}"] = {"ratio": ratio(a[key], b[key]), "informative": True}
    return out


def comm_rows(columns: list[dict]) -> list[tuple[str, list[float], str]]:
    """Collectives by axis and kind; a kind any column issues gets a row (0 where another does not)."""
    rows = []
    axes = sorted({a for c in columns for a in c["comm_per_step"]} - {"tp", "dp"})
    for axis in ("tp", "dp", *axes):
        per_column = [c["comm_per_step"].get(axis, {}) for c in columns]
        rows.append((f"{axis} collectives / step", [c.get("num_collectives", 0) for c in per_column], "d"))
        for kind in sorted({k for c in per_column for k in c.get("counts", {})}):
            rows.append((f"  {axis} {kind}", [c.get("counts", {}).get(kind, 0) for c in per_column], "d"))
        rows.append((f"{axis} wire bytes / step", [c.get("wire_bytes", 0) for c in per_column], "d"))
    return rows


def table_rows(columns: list[dict]) -> list[tuple[str, list[float], str]]:
    """(label, one value per column, formatted value kind) for the printed table."""

    def each(read):
        return [read(c) for c in columns]

    return [
        ("step time median (ms)", each(lambda c: c["step_time_median_s"] * 1e3), "f2"),
        ("first step, incl. compile (s)", each(lambda c: c["first_step_s"]), "f2"),
        *comm_rows(columns),
        ("param bytes / rank", each(lambda c: c["param_bytes_per_rank"]), "d"),
        ("held for backward / block (bytes)", each(lambda c: c.get("held_bytes_per_block")), "d"),
        ("peak RSS / rank (MiB, max)", each(lambda c: c["peak_rss_kib_per_rank"] / 1024), "f1"),
        ("final loss (held-out batch)", each(lambda c: c["final_loss"]), "f6"),
        ("step-1 loss rel err vs 1 device", each(lambda c: c["first_step_parity"]["loss_rel_err"]), "e"),
        ("step-1 logits rel err vs 1 device", each(lambda c: c["first_step_parity"]["logits_rel_err"]), "e"),
        ("step-1 grad-norm rel err vs 1 dev", each(lambda c: c["first_step_parity"]["grad_norm_rel_err"]), "e"),
    ]


def fmt(value: float | None, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "d":
        return f"{int(value):,}"
    if kind == "e":
        return f"{value:.2e}"
    return f"{value:.{kind[1:]}f}"


LABEL_WIDTH, VALUE_WIDTH, RATIO_WIDTH = 34, 12, 8


def format_table(summary: dict, compiler: str) -> str:
    """One (autoshard, recipe, ratio) column group per pair that ran, side by side."""
    pairs = selected_pairs(summary)
    group_width = 2 * VALUE_WIDTH + RATIO_WIDTH
    titles = {"eager": "eager", "compiled": f"compiled ({compiler})", "bf16": "eager bf16",
              "selective": "selective checkpointing", "full": "full checkpointing"}
    names = [n for n, pair in PAIRS.items() if pair in pairs]
    group_line = " " * LABEL_WIDTH + "".join(f"{titles[n]:>{group_width}}" for n in names)
    pair_header = f"{'autoshard':>{VALUE_WIDTH}}{'recipe':>{VALUE_WIDTH}}{'a/r':>{RATIO_WIDTH}}"
    header = f"{'metric':<{LABEL_WIDTH}}" + pair_header * len(pairs)
    lines = [group_line, header, "-" * len(header)]
    for label, values, kind in table_rows([summary[v] for pair in pairs for v in pair]):
        cells = []
        for va, vb in zip(values[::2], values[1::2], strict=True):
            r = ratio(va, vb) if kind != "e" else None
            cells.append(f"{fmt(va, kind):>{VALUE_WIDTH}}{fmt(vb, kind):>{VALUE_WIDTH}}"
                         f"{(f'{r:.3f}' if r is not None else '-'):>{RATIO_WIDTH}}")
        lines.append(f"{label:<{LABEL_WIDTH}}" + "".join(cells))
    return "\n".join(lines)


def format_targets(targets: dict) -> str:
    checked, informative = [], []
    for name, t in targets.items():
        r = "n/a" if t["ratio"] is None else f"{t['ratio']:.3f}"
        if t.get("informative"):
            informative.append(f"{name} ratio {r}")
        else:
            checked.append(f"{name} ratio {r} <= {t['max_ratio']}: {'met' if t['met'] else 'NOT met'}")
    lines = []
    if checked:
        lines.append("targets (eager): " + "; ".join(checked))
    if informative:
        lines.append("informative (compiled, no threshold): " + "; ".join(informative))
    return "\n".join(lines)


def config_section(args, variants: tuple[str, ...]) -> dict:
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
        "variants": list(variants),
        "compiler": args.compiler,
        "compiled_as": {
            "autoshard_compiled": "torch.compile(model, backend=autoshard.backend(mesh, compiler=compiler))",
            "recipe_compiled": "block.forward = torch.compile(block.forward, backend=compiler, fullgraph=True)",
        },
        "compile_cache": "fresh inductor cache directory per rank and spawn",
        "parity_rtol": {"eager": PARITY_RTOL, "inductor": PARITY_RTOL_INDUCTOR},
        "torch_version": torch.__version__,
        "cpu_count": os.cpu_count(),
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps first (>= 2: the first compiles, the last one is counted)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, variant order alternating")
    parser.add_argument("--variants", default=",".join(PAIRS),
                        help=f"comma-separated pairs to run, of {', '.join(PAIRS)} (default: all)")
    parser.add_argument("--compiler", default="inductor", choices=COMPILERS, help="compiler of the compiled pair")
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON output path")
    args = parser.parse_args(argv)
    if args.warmup < 2 or args.steps < 1 or args.rounds < 1:
        parser.error("--warmup must be >= 2, --steps and --rounds >= 1")
    unknown = set(args.variants.split(",")) - set(PAIRS)
    if unknown or not args.variants:
        parser.error(f"--variants takes a comma-separated subset of {sorted(PAIRS)}, got {args.variants!r}")
    return args


def selected_variants(spec: str) -> tuple[str, ...]:
    """Variants of the chosen pairs, in ``PAIRS`` order."""
    chosen = set(spec.split(","))
    return tuple(v for name, pair in PAIRS.items() if name in chosen for v in pair)


def main(argv=None) -> dict:
    args = parse_args(argv)
    variants = selected_variants(args.variants)
    start = time.perf_counter()
    runs = run_rounds(variants, args.rounds, args.steps, args.warmup, args.compiler)
    summary = {v: summarize(v, runs[v], args.compiler) for v in variants}
    check_recipe_parity(summary)
    report = {
        "config": config_section(args, variants),
        "variants": summary,
        "targets": targets_section(summary),
        "wall_time_s": time.perf_counter() - start,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(format_table(summary, args.compiler))
    print(format_targets(report["targets"]))
    print(f"wall time {report['wall_time_s']:.1f} s; JSON: {os.path.relpath(args.out)}")
    return report


if __name__ == "__main__":
    main()
