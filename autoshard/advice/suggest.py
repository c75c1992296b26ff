"""Suggest a mesh: rank every way to split ``world_size`` ranks by a predicted step time.

For each factorization ``dp x tp`` (``{"dp": n}`` and ``{"tp": n}`` included),
each ``pp x dp x tp`` with pipeline stages (1F1B, stages balanced by
:mod:`autoshard.plans.stage_costs`; the pp rank with the most FLOPs sets the pace over
``microbatches + pp - 1`` slots) and, when ``links`` says how many ranks share
a node, each HSDP shape whose shard group fills a node, :func:`suggest_mesh` plans the model on that mesh
(at the dp-local share of the global batch) and predicts:

* **compute**: the FLOPs of every matmul and attention op of the captured
  graph (forward, and twice that for backward), divided by tp where the plan
  runs the op sharded or partial over tp, at ``flops_per_second`` (by default
  measured here with a short fp32 matmul on the calling process's device);
* **communication**: :meth:`Plan.predicted_comm` per axis, under an alpha-beta
  model per link: ``alpha`` per ring step (``2(p-1)`` for an all-reduce on ``p``
  ranks, ``p-1`` for the others) plus wire bytes over bandwidth.
  ``links`` gives them (:class:`Links`); without it one probe on the current
  process group measures a small and a large all-reduce and fits both;
* **memory per rank**: parameters, gradients and ``optimizer_states`` fp32
  states of the local shards, one FSDP unit gathered (the largest, twice: the
  next is prefetched), and the forward's activations held for backward (each
  floating value of the graph, cut by tp where sharded), a rough upper bound.

Candidates above ``memory_per_rank`` are kept in the table, marked, and ranked
last. Step time is compute plus communication: no overlap is assumed, which
ranks meshes as a conservative scheduler would.

Both probes run on the device the ranks compute and communicate on: the one the
current process group uses (the current accelerator under NCCL, the CPU under
gloo), or ``device``. A CPU matmul would rate a GPU job's compute, and NCCL
refuses CPU tensors.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from autoshard.core.mesh import DP, DP_REPLICATE, DP_SHARD, PP, TP, axes_from_sizes
from autoshard.core.options import PipelineOptions, PlanOptions
from autoshard.core.sharding import Wire, tp_local_shape
from autoshard.plans.flops import ATTENTION, MATMULS, matmul_flops


@dataclasses.dataclass(frozen=True)
class Links:
    """Bandwidth (GB/s, per rank, one direction) and latency (microseconds per ring step) of the
    links inside a node and between nodes, and how many ranks a node holds. An axis whose groups
    stay inside one node uses the intra-node link."""

    intra_gbps: float
    inter_gbps: float | None = None
    ranks_per_node: int | None = None
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0

    def link(self, group_span: int) -> tuple[float, float]:
        """``(seconds per ring step, seconds per wire byte)`` for groups spanning ``group_span``
        consecutive ranks."""
        inside = self.ranks_per_node is None or group_span <= self.ranks_per_node
        gbps = self.intra_gbps if inside or self.inter_gbps is None else self.inter_gbps
        latency = self.intra_latency_us if inside else self.inter_latency_us
        return latency * 1e-6, 1.0 / (gbps * 1e9)


@dataclasses.dataclass(frozen=True)
class MeshCandidate:
    mesh: dict[str, int]
    compute_s: float
    comm_s: dict[str, float]
    memory_bytes: int
    fits: bool

    @property
    def step_s(self) -> float:
        return self.compute_s + sum(self.comm_s.values())


@dataclasses.dataclass(frozen=True)
class MeshSuggestion:
    """Candidates ranked best first (those that fit in memory, by predicted step time)."""

    candidates: tuple[MeshCandidate, ...]
    flops_per_second: float
    links: Links
    skipped: tuple[str, ...] = ()

    @property
    def best(self) -> dict[str, int]:
        return dict(self.candidates[0].mesh)

    def __str__(self) -> str:
        lines = [f"{'rank':>4}  {'mesh':<34} {'step ms':>8} {'compute':>8} {'comm':>8}  {'memory/rank':>12}",
                 "-" * 82]
        for i, c in enumerate(self.candidates, 1):
            mesh = " x ".join(f"{a}={n}" for a, n in c.mesh.items())
            comm = ", ".join(f"{a} {1e3 * s:.1f}" for a, s in c.comm_s.items()) or "-"
            lines.append(f"{i:>4}  {mesh:<34} {1e3 * c.step_s:>8.1f} {1e3 * c.compute_s:>8.1f} "
                         f"{1e3 * sum(c.comm_s.values()):>8.1f}  {c.memory_bytes / 2**20:>9.1f} MiB"
                         + ("" if c.fits else "  (does not fit)") + f"   [{comm}]")
        lines.append(f"compute at {self.flops_per_second / 1e9:.1f} GFLOP/s; links {self.links}")
        lines += [f"skipped {s}" for s in self.skipped]
        return "\n".join(lines)


def suggest_mesh(model: nn.Module, world_size: int, *, example_inputs: tuple, example_kwargs: dict | None = None,
                 memory_per_rank: int | None = None, links: Links | None = None,
                 flops_per_second: float | None = None, mp_policy=None, optimizer_states: int = 2,
                 device: str | torch.device | None = None, verbose: bool = True) -> MeshSuggestion:
    """Rank the meshes ``world_size`` ranks can form for ``model`` (see the module docstring).

    Args:
        model: the single-device model (left untouched).
        world_size: the number of ranks to arrange.

    Keyword Args:
        example_inputs, example_kwargs: the *global* batch (dim 0 is split over the
            data-parallel ranks of each candidate).
        memory_per_rank: bytes a rank may hold; a mesh that needs more is kept in the
            table, marked, and ranked last.
        links: link bandwidths and latencies (:class:`Links`; default: one probe on the
            current process group).
        flops_per_second: one rank's compute rate (default: a short fp32 matmul here).
        mp_policy: FSDP2's mixed-precision policy, as for :func:`autoshard.autoshard`.
        optimizer_states: tensors the optimizer keeps per parameter (2 for Adam).
        device: where the probes run (default: the device the current process group
            communicates on; without a group, the current accelerator, else the CPU).
        verbose: print the ranked table.

    Returns:
        A :class:`MeshSuggestion`: the candidates ranked by predicted step time.
    """
    from autoshard.driver.planning import plan_result

    if not isinstance(example_inputs, tuple):
        raise ValueError(f"autoshard: `example_inputs` must be a tuple, got {type(example_inputs).__name__}")
    device = torch.device(device) if device is not None else _probe_device()
    links = links or _probe_links(device)
    rate = flops_per_second or _measure_flops(device)
    batch = next(t.shape[0] for t in example_inputs if isinstance(t, torch.Tensor))
    candidates, skipped = [], []
    for sizes in _pp_shapes(world_size):
        found = _pp_candidate(model, sizes, example_inputs, example_kwargs, batch, mp_policy, rate, links,
                              memory_per_rank, optimizer_states)
        (candidates if isinstance(found, MeshCandidate) else skipped).append(found)
    for sizes in _shapes(world_size, links):
        data_parallel = axes_from_sizes(sizes).data_parallel
        if batch % data_parallel:
            skipped.append(f"{sizes}: batch {batch} does not divide by {data_parallel}")
            continue
        local = _share(example_inputs, batch // data_parallel)
        local_kwargs = _share(example_kwargs or {}, batch // data_parallel)
        options = PlanOptions(mp_policy=mp_policy)
        try:
            planned = plan_result(model, axes_from_sizes(sizes), local, local_kwargs, None, options)
            plan, captured, layout_plan = planned.plan, planned.captured, planned.layout_plan
        except ValueError as err:
            skipped.append(f"{sizes}: {err}")
            continue
        candidates.append(_candidate(sizes, plan, captured, layout_plan, rate, links, memory_per_rank,
                                     optimizer_states))
    if not candidates:
        raise ValueError(f"autoshard: no mesh of {world_size} ranks fits this model and batch: {'; '.join(skipped)}")
    ranked = tuple(sorted(candidates, key=lambda c: (not c.fits, c.step_s)))
    suggestion = MeshSuggestion(ranked, rate, links, tuple(skipped))
    if verbose:
        print(suggestion)
    return suggestion


def _pp_shapes(world: int) -> list[dict[str, int]]:
    """``pp x dp x tp`` (and ``pp x dp``, ``pp x tp``) for every pp size from 2 that divides ``world``."""
    shapes = []
    for pp in (d for d in range(2, world + 1) if world % d == 0):
        rest = world // pp
        for tp in (d for d in range(1, rest + 1) if rest % d == 0):
            dp = rest // tp
            shapes.append({PP: pp} | ({DP: dp} if dp > 1 else {}) | ({TP: tp} if tp > 1 else {}))
    return shapes


def _pp_candidate(model, sizes, example_inputs, example_kwargs, batch, mp_policy, rate, links: Links,
                  memory_limit, states):
    """A mesh with pipeline stages, 1F1B over twice as many microbatches as stages (or as many):
    the pp rank with the most FLOPs sets the pace, ``microbatches + pp - 1`` times (the pipeline
    fills and drains); each stage's tp and dp traffic is its share of the model's, and the pp sends
    are the plan's; memory is the largest stage's. A string: why the mesh was skipped."""
    from autoshard.axes.pp_axis import plan_pipeline
    from autoshard.driver.entry_points import INNER

    axes = axes_from_sizes(sizes)
    data_parallel = axes.stage_axes().data_parallel
    if batch % data_parallel:
        return f"{sizes}: batch {batch} does not divide by {data_parallel}"
    rows = batch // data_parallel
    microbatches = next((m for m in (2 * axes.pp, axes.pp) if rows % m == 0), None)
    if microbatches is None:
        return f"{sizes}: the dp-local batch {rows} does not divide into {axes.pp} or {2 * axes.pp} microbatches"
    local, local_kwargs = _share(example_inputs, rows), _share(example_kwargs or {}, rows)
    try:
        pplan = plan_pipeline(INNER, model, axes, local, local_kwargs, None, PlanOptions(mp_policy=mp_policy),
                              PipelineOptions(microbatches=microbatches, schedule="1F1B"))
    except (ValueError, NotImplementedError) as err:
        return f"{sizes}: {err}"
    plan, stages = pplan.plan, pplan.plan.pipeline
    per_rank: dict[int, float] = {}
    for stage in stages.stages:
        per_rank[stage.rank] = per_rank.get(stage.rank, 0.0) + stage.flops
    compute = max(per_rank.values()) * (microbatches + axes.pp - 1) / rate
    spans = _spans(sizes)
    comm = {}
    for axis, kinds in plan.predicted_comm().items():
        latency, per_byte = links.link(spans[axis])
        ranks = axes.size(axis)
        share = 1.0 if axis == PP else (microbatches if axis == TP else 1.0) / axes.pp
        comm[axis] = sum(share * n * (_steps(kind, ranks) if axis != PP else 1) * latency + share * nbytes * per_byte
                         for kind, (n, nbytes) in kinds.items())
    memory = max(s.param_bytes * (2 + states) + s.activation_bytes * s.in_flight for s in stages.stages)
    return MeshCandidate(dict(sizes), compute, comm, memory, memory_limit is None or memory <= memory_limit)


def _shapes(world: int, links: Links) -> list[dict[str, int]]:
    shapes = []
    for tp in (d for d in range(1, world + 1) if world % d == 0):
        dp = world // tp
        shapes.append({DP: dp} if tp == 1 else {TP: tp} if dp == 1 else {DP: dp, TP: tp})
    node = links.ranks_per_node
    if node and world > node and world % node == 0:
        for tp in (d for d in range(1, node + 1) if node % d == 0):
            shard, replicate = node // tp, world // node
            if shard > 1:
                shapes.append({DP_REPLICATE: replicate, DP_SHARD: shard, TP: tp} if tp > 1 else
                              {DP_REPLICATE: replicate, DP_SHARD: shard})
    return shapes


def _share(values, rows: int):
    if isinstance(values, dict):
        return {k: v[:rows] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in values.items()}
    return tuple(v[:rows] if isinstance(v, torch.Tensor) and v.dim() else v for v in values)


def _candidate(sizes, plan, captured, layout_plan, rate, links: Links, memory_limit, states) -> MeshCandidate:
    axes = axes_from_sizes(sizes)
    flops = 0.0
    for node in captured.gm.graph.nodes:
        if node.op == "call_function" and node.target in MATMULS | ATTENTION:
            work = matmul_flops(node)
            flops += work / axes.tp if layout_plan.layouts.get(node) is not None else work
    compute = 3 * flops / rate  # forward, and backward's two products per forward one
    comm = {}
    spans = _spans(sizes)
    for axis, kinds in plan.predicted_comm().items():
        latency, per_byte = links.link(spans[axis])
        ranks = axes.size(axis)
        comm[axis] = sum(n * _steps(kind, ranks) * latency + nbytes * per_byte for kind, (n, nbytes) in kinds.items())
    memory = _memory(plan, captured, layout_plan, axes, states)
    return MeshCandidate(dict(sizes), compute, comm, memory, memory_limit is None or memory <= memory_limit)


def _steps(kind: str, ranks: int) -> int:
    """Latency-bound steps of a ring collective on ``ranks`` ranks."""
    return 2 * (ranks - 1) if kind == Wire.ALL_REDUCE else ranks - 1


def _spans(sizes: dict[str, int]) -> dict[str, int]:
    """How many consecutive ranks one group of each axis spans (the last axis is innermost)."""
    spans, inner = {}, 1
    for axis in reversed(list(sizes)):
        inner *= sizes[axis]
        spans[axis] = inner
    return spans


def _memory(plan, captured, layout_plan, axes, states: int) -> int:
    sharded, trained = plan.values_per_rank()  # a frozen parameter has no gradient nor optimizer state
    units: dict[str, int] = {}
    for entry in plan.params.values():
        units[entry.unit] = units.get(entry.unit, 0) + math.prod(tp_local_shape(entry, axes))
    gathered = 2 * max(units.values(), default=0)
    activations = 0
    for node in captured.gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, torch.Tensor) and val.is_floating_point():
            size = val.numel() * val.element_size()
            activations += size // axes.tp if layout_plan.layouts.get(node) is not None else size
    return 4 * sharded + 4 * trained * (1 + states) + 4 * gathered + activations


def _probe_device() -> torch.device:
    """The device the ranks compute and communicate on: the current accelerator when the
    current process group moves its tensors with that accelerator's backend (NCCL for CUDA),
    or when there is no group; else the CPU (a gloo group, or no accelerator)."""
    if not torch.accelerator.is_available():
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if dist.is_initialized() and _group_backend(accelerator.type) != dist.get_default_backend_for_device(accelerator):
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _group_backend(device_type: str) -> str | None:
    """The backend the current process group uses for tensors on ``device_type``: gloo serves
    CUDA tensors too, so the group's one backend name does not say ("cpu:gloo,cuda:nccl")."""
    return dict(entry.split(":") for entry in dist.get_backend_config().split(",")).get(device_type)


def _synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``: an accelerator returns before its kernels and
    collectives finish, so a clock read without this measures the queueing."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _measure_flops(device: torch.device, size: int | None = None, repeats: int = 5) -> float:
    """The fp32 matmul rate on ``device``; an accelerator's matmul is made large enough
    (4096) that launching it costs little next to running it."""
    size = size or (512 if device.type == "cpu" else 4096)
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    a @ b
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _synchronize(device)
    return repeats * 2.0 * size**3 / (time.perf_counter() - start)


def _probe_links(device: torch.device, small: int = 256, large: int = 1 << 20, repeats: int = 10) -> Links:
    """Latency per ring step and bandwidth of the current process group, from a small and a
    large all-reduce of tensors on ``device`` (each the mean of ``repeats``, the slowest rank's)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        raise ValueError(
            "autoshard: suggest_mesh measures the links with a short probe on the current process group; "
            "initialize one (all ranks call suggest_mesh), or pass links=autoshard.Links(intra_gbps=...)"
        )
    ranks = dist.get_world_size()
    timings = []
    for numel in (small, large):
        tensor = torch.ones(numel, device=device)
        dist.all_reduce(tensor)
        _synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(tensor)
        _synchronize(device)
        seconds = torch.tensor((time.perf_counter() - start) / repeats, device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        timings.append((2 * (ranks - 1) / ranks * numel * 4, seconds.item()))
    (b0, t0), (b1, t1) = timings
    per_byte = max((t1 - t0) / (b1 - b0), 1e-15)
    alpha = max(t0 - b0 * per_byte, 0.0) / _steps(Wire.ALL_REDUCE, ranks)
    return Links(intra_gbps=1.0 / per_byte / 1e9, intra_latency_us=alpha * 1e6)
