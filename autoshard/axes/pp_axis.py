"""The pipeline axis ``pp``: the model cut between blocks into stages that torch's schedule runs.

pp is the outer axis (``wraps``): it runs the other axes itself, on the stage mesh below it (the
driver's :class:`~autoshard.axes.contract.Inner`), and cuts their emitted code into stages. The
stages share one plan: the model is captured at one microbatch's shapes (the dp-local batch
divided by ``microbatches``: the shapes every stage runs) and planned for the ``dp x tp``
sub-mesh as any model is; the split into stages comes from that plan's costs
(:mod:`autoshard.plans.stage_costs`), and the emitted code is cut along it (:mod:`autoshard.passes.stage_graphs`).
The plan records the pp axis in its mesh and the stages in ``plan.pipeline``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from autoshard.axes.contract import Axis, Emitted, Inner, PlanResult, as_plan
from autoshard.core.mesh import PP, MeshAxes
from autoshard.core.options import Options, PipelineOptions, PlanOptions
from autoshard.passes.stage_graphs import StageSplit, split_stages, stitched
from autoshard.plans.plan import Plan
from autoshard.plans.stage_costs import (
    balance,
    given_split,
    pipeline_stages,
    schedule_of,
    unit_costs,
)
from autoshard.proof.grid_proof import rank_shard
from autoshard.proof.proof import Proof
from autoshard.proof.rank_grid import RankGrid
from autoshard.proof.simulate import PerRank, RankSimulator
from autoshard.runtime.pipeline_stages import Crossing, flat_inputs, materialize_pipeline


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """Everything a pp mesh's runtime is built from: the plan (with its stages), the planned and
    emitted stage code, the stage graphs and each crossing value's shape on one rank."""

    plan: Plan
    planned: PlanResult
    emitted: Emitted
    split: StageSplit
    crossings: dict[str, Crossing]
    micro_inputs: tuple
    micro_kwargs: dict
    flat_inputs: list
    output_names: tuple[str, ...]
    costs: tuple  # UnitCost of every block, the split's input


def microbatch_of(example_inputs: tuple, example_kwargs: dict | None, microbatches: int) -> tuple[tuple, dict]:
    """The first microbatch of the example: every tensor with the batch's leading dim cut to
    ``batch / microbatches`` rows, as the schedule cuts each step's batch."""
    leaves = [v for v in pytree.tree_leaves((example_inputs, example_kwargs or {})) if isinstance(v, torch.Tensor)]
    if not leaves or leaves[0].dim() == 0:
        raise ValueError("autoshard: a pipeline splits the batch into microbatches along dim 0; example_inputs "
                         "holds no tensor with a batch dim")
    batch = leaves[0].shape[0]
    if batch % microbatches:
        raise ValueError(f"autoshard: the dp-local batch ({batch} rows, dim 0 of example_inputs) does not divide "
                         f"into microbatches={microbatches}")
    rows = batch // microbatches

    def cut(value):
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
            return value[:rows]
        return value

    return pytree.tree_map(cut, example_inputs), pytree.tree_map(cut, dict(example_kwargs or {}))


def plan_pipeline(inner: Inner, model: nn.Module, axes: MeshAxes, example_inputs: tuple,
                  example_kwargs: dict | None, given, options: PlanOptions, pipelined: PipelineOptions,
                  keep_reference: bool = False) -> PipelinePlan:
    """The stage plan of ``axes`` (with its pp axis): the other axes planned and emitted by ``inner`` on
    the stage mesh at one microbatch's shapes, split into stages by the plan's costs (or
    ``pipelined.split``), with what crosses each boundary."""
    if not isinstance(example_inputs, tuple):
        raise ValueError(f"autoshard: `example_inputs` must be a tuple, got {type(example_inputs).__name__}")
    schedule, per_rank, microbatches = pipelined.schedule, pipelined.stages_per_rank, pipelined.microbatches
    if microbatches is None:
        microbatches = axes.pp * (per_rank or (1 if schedule.lower() in ("gpipe", "1f1b") else 2))
    if options.context_output != "whole":
        raise NotImplementedError("autoshard: context_output='local' with a pp axis: torch's schedule hands the "
                                  "last stage's output and the whole microbatch's targets to loss_fn; plan with "
                                  "context_output='whole'")
    stage_axes = axes.stage_axes()
    spec = schedule_of(schedule, microbatches, axes.pp, per_rank, data_parallel=stage_axes.has_dp)
    micro_inputs, micro_kwargs = microbatch_of(example_inputs, example_kwargs, microbatches)
    planned = inner.plan(model, stage_axes, micro_inputs, micro_kwargs, given, options, keep_reference=keep_reference)
    captured = planned.captured
    blocks = tuple(captured.block_fqns)
    count = spec.stages(axes.pp)
    if not blocks:
        raise ValueError("autoshard: a pp axis cuts the model between blocks, and this model has none "
                         "(no nn.ModuleList of repeated layers was found)")
    costs = unit_costs(captured.gm.graph, planned.layout_plan.layouts, planned.plan, stage_axes, blocks)
    saved = as_plan(given)
    pp_split = pipelined.split
    if pp_split is None and saved is not None and saved.pipeline is not None:
        pp_split = [stage.units[0] for stage in saved.pipeline.stages[1:]]  # a saved plan's stages, kept
    if pp_split is not None:
        runs, chosen = given_split(pp_split, blocks, count), "given"
    else:
        runs, chosen = balance(costs, spec, axes.pp, pipelined.memory_per_rank), "balanced"
    stages = pipeline_stages(runs, costs, spec, axes.pp, chosen)
    emitted = inner.emit(planned, stage_axes, options, keep_planned=keep_reference)
    stage_of_block = {unit: stage.index for stage in stages.stages for unit in stage.units}
    parts = emitted.parts
    split = split_stages(parts, stage_of_block, count, frozenset(planned.plan.params))
    flat = flat_inputs(captured, micro_inputs, micro_kwargs)
    crossings = local_values(parts.root, planned.plan, inner.grid(stage_axes), flat)
    output = next(n for n in parts.root.graph.nodes if n.op == "output")
    output_names = tuple(n.name for n in pytree.tree_leaves(output.args[0]))
    root = {fqn for fqn, entry in planned.plan.params.items() if not entry.unit}
    held = tuple(dataclasses.replace(stage, root_params=tuple(f for f in graph.params if f in root))
                 for stage, graph in zip(stages.stages, split.stages, strict=True))
    stages = dataclasses.replace(stages, stages=held, sends=_boundary_bytes(split, crossings))
    plan = dataclasses.replace(planned.plan, mesh={PP: axes.pp, **planned.plan.mesh}, pipeline=stages)
    return PipelinePlan(plan, planned, emitted, split, crossings, micro_inputs, micro_kwargs, flat,
                        output_names, tuple(costs))


def local_values(root: fx.GraphModule, plan: Plan, grid: RankGrid, flat_inputs: list) -> dict[str, Crossing]:
    """Every root value as one rank holds it, from running the emitted code on fake tensors
    (shapes and dtypes only: nothing is computed or allocated, and ops naming a device still run).

    Every rank of the stage mesh's ``grid`` is simulated (:class:`~autoshard.proof.rank_grid.RankGrid`,
    as the proof lays them out); all take the whole inputs, and a
    value cut over the sequence crosses a boundary at its cp-local length. Rank 0's shapes are every
    rank's: tp shards and the balanced sequence chunks are equal. Under ``ep`` each rank holds its
    experts and the exchanges keep every rank's row count (:meth:`RankSimulator._exchanged_shapes`):
    the rows an expert gets are data, and only the combine's output, of its input's shape, crosses."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # where the example lives (never the default device, which training code may point elsewhere); an
    # example on meta (a model too large for one host) is run as fakes of the host's device, where the
    # graph's buffers (tables the capture recomputed) and the tensors its ops create live
    device = next((v.device for v in flat_inputs if isinstance(v, torch.Tensor)), torch.device("cpu"))
    if device.type == "meta":
        device = torch.device("cpu")
    dtypes = _param_dtypes(root)
    with mode, torch.enable_grad():
        weights = {}
        for fqn, entry in plan.params.items():
            full = torch.empty(entry.shape, dtype=dtypes.get(fqn, torch.float32), device=device)
            weights[fqn] = PerRank([rank_shard(plan, grid, fqn, full, i).requires_grad_(True) for i in grid])
        inputs = [PerRank([_fake(mode, v, device) if isinstance(v, torch.Tensor) else v] * grid.ranks)
                  for v in flat_inputs]
        simulator = RankSimulator(root, grid, weights.get)
        simulator.run(*inputs)
    crossings = {}
    for name, value in simulator.values.items():
        first = value.values[0]
        if isinstance(first, torch.Tensor) and "." not in name:
            crossings[name] = Crossing(tuple(first.shape), first.dtype, first.requires_grad)
    return crossings


def _fake(mode, value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` as a fake tensor; one on meta moved to ``device`` (no values are read here)."""
    if not value.is_meta:
        return mode.from_tensor(value)
    fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
    return fake.requires_grad_(value.requires_grad)


def _param_dtypes(root: nn.Module) -> dict[str, torch.dtype]:
    return {name: value.dtype for name, value in (*root.named_parameters(), *root.named_buffers())}


def _boundary_bytes(split: StageSplit, crossings) -> tuple[tuple[int, int, int, int], ...]:
    """Per boundary, one microbatch's sends on one rank: forward (every crossing value) and back
    (the gradients of those a gradient flows through), as (messages, bytes) each: torch's stage
    sends one message per tensor."""
    sizes = []
    for names in split.carried:
        back = [n for n in names if crossings[n].requires_grad]
        sizes.append((len(names), sum(_nbytes(crossings[n]) for n in names),
                      len(back), sum(_nbytes(crossings[n]) for n in back)))
    return tuple(sizes)


def _nbytes(crossing: Crossing) -> int:
    count = 1
    for n in crossing.shape:
        count *= n
    return count * torch.empty((), dtype=crossing.dtype).element_size()


def prove_pipeline(inner: Inner, pplan: PipelinePlan, model: nn.Module, axes: MeshAxes, *, seed: int = 0,
                   rtol: float | None = None) -> Proof:
    """``pplan``'s stages called in order (:func:`~autoshard.passes.stage_graphs.stitched`), against
    the unsharded graph at one microbatch's shapes, proven as the stage mesh's code is
    (``inner.prove``). The stages are the emitted code cut at
    block boundaries, so a value the cut lost, passed in the wrong order or read before the stage
    computing it fails here, named by node."""
    root = stitched(pplan.split, pplan.emitted.parts.root)
    subject = pplan.emitted.subject
    emitted = dataclasses.replace(pplan.emitted, parts=dataclasses.replace(pplan.emitted.parts, root=root),
                                  subject=dataclasses.replace(subject, root=root) if subject is not None else None)
    proof = inner.prove(pplan.planned, emitted, model, pplan.micro_inputs, pplan.micro_kwargs,
                        axes.stage_axes(), seed=seed, rtol=rtol)
    return dataclasses.replace(proof, plan=pplan.plan)


class PipelineAxis(Axis):
    """pp's hooks: it checks its options and, as the outer axis, plans, proves and shards a mesh that
    has it through :func:`plan_pipeline` over the driver's run of the other axes."""

    names = (PP,)
    wraps = True

    def check(self, axes: MeshAxes, chosen: Options, sharding: bool) -> None:
        if not self.present(axes):
            given = chosen.pipeline.configured()
            if given:
                raise ValueError(f"autoshard: {', '.join(given)} configure pipeline stages, and this mesh has no "
                                 "'pp' axis")
            return
        if sharding and chosen.pipeline.loss_fn is None:
            raise ValueError("autoshard: a mesh with a 'pp' axis trains through a schedule that runs the loss on "
                             "the last stage: pass loss_fn=(output, target) -> loss")

    def plan(self, inner: Inner, model, axes: MeshAxes, example_inputs, example_kwargs, given, chosen: Options,
             keep_reference: bool = False) -> PipelinePlan:
        return plan_pipeline(inner, model, axes, example_inputs, example_kwargs, given, chosen.plan_options(),
                             chosen.pipeline, keep_reference=keep_reference)

    def prove(self, inner: Inner, model, axes: MeshAxes, example_inputs, example_kwargs, given, chosen: Options, *,
              seed: int, rtol: float | None) -> Proof:
        pplan = self.plan(inner, model, axes, example_inputs, example_kwargs, given, chosen, keep_reference=True)
        return prove_pipeline(inner, pplan, model, axes, seed=seed, rtol=rtol)

    def shard(self, inner: Inner, model, axes: MeshAxes, example_inputs, example_kwargs, given, chosen: Options):
        """``autoshard()`` on a mesh with a pp axis: the stage plan, proven, and this rank's stages
        and schedule (:func:`~autoshard.runtime.pipeline_stages.materialize_pipeline`)."""
        sharding = chosen.sharding
        proving = inner.proves(sharding.check, model, axes)
        pplan = self.plan(inner, model, axes, example_inputs, example_kwargs, given, chosen, keep_reference=proving)
        inner.agree(pplan.plan, pplan.planned.captured.inputs, axes)
        if proving:
            prove_pipeline(inner, pplan, model, axes).raise_if_failed()
        return materialize_pipeline(pplan, model, axes, chosen.pipeline.loss_fn,
                                    sync_module_states=sharding.sync_module_states,
                                    reshard_after_forward=sharding.reshard_after_forward,
                                    mp_policy=chosen.precision.mp_policy,
                                    activation_checkpointing=sharding.activation_checkpointing)
