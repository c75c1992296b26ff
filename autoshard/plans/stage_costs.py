"""Pipeline stages from the plan's own costs: which blocks each stage runs, and the schedule.

A stage is a contiguous run of FSDP units (blocks). The root's code goes where the graph reads
it (:mod:`autoshard.passes.stage_graphs`): the embedding with the first block, the final norm, the
LM head and the loss with the last. So the first and last stages carry more than their blocks,
and the last much more when the vocabulary is large: an equal count of blocks per stage
(torchtitan's split) leaves the last stage the slowest, and every other stage waits for it at
each microbatch.

The cost of a unit is its forward and backward matmul and attention FLOPs on one rank per
microbatch (3x the forward's, each divided by tp where the plan runs the op sharded; the head's
vocabulary matmul is the root's, counted on the last stage), taken from the captured graph. The
split minimizes the slowest stage's cost (every schedule's step time grows with it: each stage
runs every microbatch, and the bubble is a number of slowest-stage steps), subject to each
stage's memory when ``memory_per_rank`` is given: its parameters, gradients and optimizer states
(fp32, local shards) and the activations of the microbatches the schedule holds in flight on it
(all of them under GPipe; under 1F1B, stage ``i`` of ``n`` holds ``n - i``). One dynamic program
over the blocks finds it exactly.

Times need a FLOP rate, which depends on the device: the plan holds FLOPs and bytes (the same on
every rank, so every rank agrees on the plan) and :meth:`PipelineStages.seconds` turns them into
predicted times at a rate, measured on the device by default.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch
import torch.fx as fx

from autoshard.core.mesh import MeshAxes
from autoshard.core.sharding import rank_shape
from autoshard.plans.block_owners import BlockOwners
from autoshard.plans.flops import ATTENTION, MATMULS, matmul_flops

# torch.distributed.pipelining's schedules (``get_schedule_class`` names, any case), by how many
# stages each pp rank runs and how they are laid out: "single" one, "looped" stages r, r + pp, ...
# (``stages_per_rank`` of them), "v" two, r and 2 pp - 1 - r.
SCHEDULES = {
    "gpipe": ("GPipe", "single"),
    "1f1b": ("1F1B", "single"),
    "interleaved1f1b": ("Interleaved1F1B", "looped"),
    "loopedbfs": ("LoopedBFS", "looped"),
    "interleavedzerobubble": ("InterleavedZeroBubble", "looped"),
    "zbvzerobubble": ("ZBVZeroBubble", "v"),
    "dualpipev": ("DualPipeV", "v"),
}
OPTIMIZER_STATES = 2  # AdamW's two fp32 moments, the usual optimizer's
# the ops whose FLOPs a stage's cost counts: suggest_mesh's matmuls and attention, and grouped GEMMs
_COUNTED = MATMULS | ATTENTION | {torch.ops.aten._grouped_mm.default}


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipelining schedule: torch's class ``name``, ``microbatches`` per step, and ``stages_per_rank``
    (1, or more for the looped and V schedules)."""

    name: str
    microbatches: int
    stages_per_rank: int = 1

    @property
    def layout(self) -> str:
        return SCHEDULES[self.name.lower()][1]

    def stages(self, pp: int) -> int:
        return pp * self.stages_per_rank

    def rank_of(self, stage: int, pp: int) -> int:
        """The pp coordinate that runs ``stage``."""
        if self.layout == "v":
            return stage if stage < pp else 2 * pp - 1 - stage
        return stage % pp

    def in_flight(self, stage: int, stages: int) -> int:
        """Microbatches whose activations ``stage`` holds at once: all under GPipe (every forward
        before any backward), else as many as the stages from it to the last (1F1B's warmup)."""
        if self.name.lower() == "gpipe":
            return self.microbatches
        return min(self.microbatches, stages - stage)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Schedules that split each backward into an input-gradient and a later weight-gradient pass. On
# this torch build they lose weight gradients under FSDP2 (measured on pp2 x dp2 x tp2 and pp2 x dp4:
# 3 SGD steps end 1e-3 and 8e-4 from one device; exact on pp x tp): refused with a dp axis.
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble")


def schedule_of(name: str, microbatches: int, pp: int, stages_per_rank: int | None = None,
                data_parallel: bool = False) -> Schedule:
    """The schedule ``name`` (torch's ``get_schedule_class`` names, any case) checked against ``pp``
    and ``microbatches`` (and FSDP: ``data_parallel``), with a clear error for what torch's schedule
    would refuse, or get wrong, later."""
    key = str(name).lower()
    if key not in SCHEDULES:
        raise ValueError(f"autoshard: schedule {name!r} is not one of torch.distributed.pipelining's: "
                         f"{', '.join(v for v, _ in SCHEDULES.values())}")
    canonical, layout = SCHEDULES[key]
    if data_parallel and canonical in SPLIT_BACKWARD:
        raise NotImplementedError(
            f"autoshard: schedule {canonical} computes weight gradients in a pass of their own, which this "
            "torch build's FSDP2 does not follow (the gradients it reduces miss part of the weight gradient); use "
            "it on a mesh without a dp axis, or DualPipeV, Interleaved1F1B or 1F1B")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"autoshard: microbatches must be a positive int, got {microbatches!r}")
    if layout == "single":
        if stages_per_rank not in (None, 1):
            raise ValueError(f"autoshard: schedule {canonical} runs one stage per rank, not {stages_per_rank}")
        per_rank = 1
    elif layout == "v":
        if stages_per_rank not in (None, 2):
            raise ValueError(f"autoshard: schedule {canonical} runs two stages per rank (a V), not {stages_per_rank}")
        per_rank = 2
    else:
        per_rank = 2 if stages_per_rank is None else stages_per_rank
        if per_rank < 2:
            raise ValueError(f"autoshard: schedule {canonical} interleaves stages: stages_per_rank must be >= 2")
    stages = pp * per_rank
    if canonical in ("1F1B", "DualPipeV") and microbatches < stages:
        raise ValueError(f"autoshard: schedule {canonical} needs at least as many microbatches as stages "
                         f"({stages}), got {microbatches}")
    if layout == "looped" and microbatches % max(1, microbatches // pp):
        raise ValueError(f"autoshard: schedule {canonical} on pp={pp} needs microbatches ({microbatches}) to be a "
                         f"multiple of {max(1, microbatches // pp)} (rounds of pp)")
    return Schedule(canonical, microbatches, per_rank)


@dataclasses.dataclass(frozen=True)
class UnitCost:
    """One block and the root code attributed to it, per microbatch on one rank."""

    unit: str
    flops: float  # forward + backward
    param_bytes: int  # fp32 local shards of its parameters
    activation_bytes: int  # floating values its forward leaves for backward (upper bound)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of the plan: its blocks, the pp coordinate running it and its costs per microbatch
    on one rank (``flops`` forward + backward; ``memory`` the bytes it holds at its peak)."""

    index: int
    rank: int
    units: tuple[str, ...]
    flops: float
    param_bytes: int
    activation_bytes: int
    in_flight: int
    root_params: tuple[str, ...] = ()  # the root's parameters it holds (where the graph reads them)

    @property
    def memory(self) -> int:
        """Parameters, gradients and optimizer states, and the activations of the microbatches in flight."""
        return self.param_bytes * (2 + OPTIMIZER_STATES) + self.activation_bytes * self.in_flight

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"units": list(self.units), "root_params": list(self.root_params)}

    @classmethod
    def from_dict(cls, data: Mapping) -> Stage:
        return cls(int(data["index"]), int(data["rank"]), tuple(data["units"]), float(data["flops"]),
                   int(data["param_bytes"]), int(data["activation_bytes"]), int(data["in_flight"]),
                   tuple(data.get("root_params", ())))

    def holds(self, fqn: str, unit: str) -> bool:
        """Whether this stage holds parameter ``fqn`` of FSDP unit ``unit``."""
        return unit in self.units if unit else fqn in self.root_params


@dataclasses.dataclass(frozen=True)
class PipelineStages:
    """The stages of a pp plan, the schedule, and how the split was chosen (``"balanced"`` or
    ``"given"``)."""

    stages: tuple[Stage, ...]
    schedule: Schedule
    chosen: str = "balanced"
    # per boundary (stage k to k + 1), one microbatch's sends on one rank: (messages, bytes) forward,
    # then (messages, bytes) back
    sends: tuple[tuple[int, int, int, int], ...] = ()

    def seconds(self, flops_per_second: float) -> list[float]:
        """Each stage's predicted compute time per microbatch (forward + backward) at ``flops_per_second``."""
        return [s.flops / flops_per_second for s in self.stages]

    def to_dict(self) -> dict:
        return {"schedule": self.schedule.to_dict(), "chosen": self.chosen,
                "stages": [s.to_dict() for s in self.stages], "sends": [list(b) for b in self.sends]}

    @classmethod
    def from_dict(cls, data: Mapping) -> PipelineStages:
        schedule = data["schedule"]
        return cls(tuple(Stage.from_dict(s) for s in data["stages"]),
                   Schedule(str(schedule["name"]), int(schedule["microbatches"]), int(schedule["stages_per_rank"])),
                   str(data.get("chosen", "balanced")), tuple(tuple(int(x) for x in b) for b in data.get("sends", ())))

    def pp_sends(self, pp_rank: int) -> tuple[int, int]:
        """``(messages, bytes)`` pp coordinate ``pp_rank`` sends in one step: each microbatch's values
        forward from each of its stages to the next, and their gradients back to the previous, where
        that stage runs on another pp rank (a V schedule's turn stays on its rank)."""
        messages = nbytes = 0
        m = self.schedule.microbatches
        for boundary, (fwd_n, fwd_b, bwd_n, bwd_b) in enumerate(self.sends):
            sender, receiver = self.stages[boundary].rank, self.stages[boundary + 1].rank
            if sender == receiver:
                continue
            if sender == pp_rank:
                messages, nbytes = messages + m * fwd_n, nbytes + m * fwd_b
            if receiver == pp_rank:
                messages, nbytes = messages + m * bwd_n, nbytes + m * bwd_b
        return messages, nbytes

    def lines(self, flops_per_second: float | None = None) -> list[str]:
        """The stages as the plan prints them."""
        schedule = self.schedule
        out = [f"pipeline: {len(self.stages)} stages ({self.chosen}), schedule {schedule.name}, "
               f"{schedule.microbatches} microbatches" + (f", {schedule.stages_per_rank} stages per pp rank"
                                                         if schedule.stages_per_rank > 1 else "")]
        for stage, seconds in zip(self.stages, self.seconds(flops_per_second) if flops_per_second else
                                  [None] * len(self.stages), strict=True):
            units = _span(stage.units)
            time = f", {seconds * 1e3:.2f} ms" if seconds is not None else ""
            out.append(f"  stage {stage.index} (pp rank {stage.rank}): {units}; {stage.flops / 1e9:.3f} GFLOP per "
                       f"microbatch{time}; memory {stage.memory / 2**20:.1f} MiB ({stage.in_flight} microbatches "
                       f"in flight)")
        return out


def _span(units: tuple[str, ...]) -> str:
    return units[0] if len(units) == 1 else f"{units[0]} .. {units[-1]} ({len(units)} blocks)"


def unit_costs(graph: fx.Graph, layouts: Mapping[fx.Node, object], plan, axes: MeshAxes,
               blocks: tuple[str, ...]) -> list[UnitCost]:
    """The cost of each block in ``blocks`` (forward order), with the root's code attributed to the
    block that reads it next (the root's code after the last block to the last block)."""
    owners = BlockOwners(blocks)
    flops = dict.fromkeys(blocks, 0.0)
    activations = dict.fromkeys(blocks, 0)
    pending_flops, pending_bytes = 0.0, 0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        unit = owners.of_node(node)
        work = _flops(node)
        sharded = layouts.get(node) is not None
        work = work / axes.tp if sharded else work
        held = _held_bytes(node, axes.tp if sharded else 1)
        if unit in flops:
            flops[unit] += work + pending_flops
            activations[unit] += held + pending_bytes
            pending_flops, pending_bytes = 0.0, 0
        else:
            pending_flops += work
            pending_bytes += held
    if blocks:
        flops[blocks[-1]] += pending_flops
        activations[blocks[-1]] += pending_bytes
    params = dict.fromkeys(blocks, 0)
    for fqn, entry in plan.params.items():
        unit = entry.unit if entry.unit in params else _reader_block(graph, fqn, owners, blocks)
        params[unit] += 4 * math.prod(rank_shape(entry, axes))
    return [UnitCost(b, 3 * flops[b], params[b], activations[b]) for b in blocks]


def _reader_block(graph: fx.Graph, fqn: str, owners: BlockOwners, blocks: tuple[str, ...]) -> str:
    """The block a root parameter goes with: the first block to run after its first reader (the last
    block for a reader after every block), as the stages' split places the reader."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    reads = [u for n in nodes if n.op == "get_attr" and n.target == fqn for u in n.users]
    if not reads:
        return blocks[-1]
    first = min(position[u] for u in reads)
    for node in nodes[first:]:
        unit = owners.of_node(node) if node.op == "call_function" else ""
        if unit:
            return unit
    return blocks[-1]


def _flops(node: fx.Node) -> float:
    return matmul_flops(node) if node.target in _COUNTED else 0.0


def _held_bytes(node: fx.Node, tp: int) -> int:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.is_floating_point():
        return val.numel() * val.element_size() // tp
    return 0


def balance(costs: Sequence[UnitCost], schedule: Schedule, pp: int,
            memory_per_rank: int | None = None) -> tuple[tuple[str, ...], ...]:
    """Contiguous runs of ``costs``' units, one per stage, minimizing the slowest stage's FLOPs within
    ``memory_per_rank``; ties go to the split whose stages' FLOPs spread least."""
    count = schedule.stages(pp)
    n = len(costs)
    if count > n:
        raise ValueError(f"autoshard: {count} pipeline stages (pp={pp} x {schedule.stages_per_rank} per rank) need at "
                         f"least as many blocks; the model has {n} ({', '.join(c.unit for c in costs)})")
    prefix_flops = [0.0]
    for c in costs:
        prefix_flops.append(prefix_flops[-1] + c.flops)

    def fits(stage: int, start: int, end: int) -> bool:
        if memory_per_rank is None:
            return True
        params = sum(c.param_bytes for c in costs[start:end])
        held = sum(c.activation_bytes for c in costs[start:end])
        return params * (2 + OPTIMIZER_STATES) + held * schedule.in_flight(stage, count) <= memory_per_rank

    inf = (math.inf, math.inf)
    # best[s][j]: (slowest, sum of squares) splitting units [0, j) into s stages; choice[s][j]: the cut
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    choice = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, count + 1):
        for j in range(s, n - (count - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf or not fits(s - 1, i, j):
                    continue
                work = prefix_flops[j] - prefix_flops[i]
                slowest, spread = best[s - 1][i]
                candidate = (max(slowest, work), spread + work * work)
                if candidate < best[s][j]:
                    best[s][j], choice[s][j] = candidate, i
    if best[count][n] == inf:
        raise ValueError(f"autoshard: no split of the {n} blocks into {count} stages fits memory_per_rank="
                         f"{memory_per_rank} bytes; use more stages or fewer microbatches in flight")
    cuts, j = [], n
    for s in range(count, 0, -1):
        i = choice[s][j]
        cuts.append(tuple(c.unit for c in costs[i:j]))
        j = i
    return tuple(reversed(cuts))


def given_split(split: Sequence[str], blocks: tuple[str, ...], count: int) -> tuple[tuple[str, ...], ...]:
    """The stages a user's ``pp_split`` makes: the first block of every stage after the first, in
    order (torchtitan's split points), checked against the model's blocks."""
    split = list(split)
    unknown = [name for name in split if name not in blocks]
    if unknown:
        raise ValueError(f"autoshard: pp_split names {unknown}, which are not blocks of the model (its blocks: "
                         f"{', '.join(blocks)})")
    if len(split) != count - 1:
        raise ValueError(f"autoshard: pp_split gives {len(split) + 1} stages ({len(split)} split points), the mesh "
                         f"and schedule run {count}")
    starts = [blocks.index(name) for name in split]
    if starts != sorted(set(starts)) or (starts and starts[0] == 0):
        raise ValueError(f"autoshard: pp_split {split} must name each stage's first block in forward order, "
                         f"after {blocks[0]!r} (which starts the first stage)")
    bounds = [0, *starts, len(blocks)]
    return tuple(tuple(blocks[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))


def equal_split(blocks: tuple[str, ...], count: int) -> tuple[str, ...]:
    """torchtitan's split points for ``count`` stages: an equal count of blocks per stage (the first
    stages take one more when it does not divide)."""
    per, extra = divmod(len(blocks), count)
    points, at = [], 0
    for stage in range(count - 1):
        at += per + (stage < extra)
        points.append(blocks[at])
    return tuple(points)


def pipeline_stages(runs: tuple[tuple[str, ...], ...], costs: Sequence[UnitCost], schedule: Schedule, pp: int,
                    chosen: str) -> PipelineStages:
    by_unit = {c.unit: c for c in costs}
    count = len(runs)
    stages = tuple(
        Stage(i, schedule.rank_of(i, pp), run, sum(by_unit[u].flops for u in run),
              sum(by_unit[u].param_bytes for u in run), sum(by_unit[u].activation_bytes for u in run),
              schedule.in_flight(i, count))
        for i, run in enumerate(runs))
    return PipelineStages(stages, schedule, chosen)
