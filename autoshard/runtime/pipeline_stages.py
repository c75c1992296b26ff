"""Pipeline parallelism: a model planned by autoshard, cut into stages over the mesh's ``pp`` axis.

Each pp coordinate runs its stages on the ``dp x tp`` sub-mesh below it, and inside a stage
everything autoshard does without pp applies unchanged: the graph is planned and emitted once for
the sub-mesh (captured at the microbatch's shapes), then cut into stages
(:mod:`autoshard.passes.stage_graphs`) along the split :mod:`autoshard.plans.stage_costs` chose; each rank
materializes only its own stages (FSDP2 per block and on the stage, DTensor parameters on tp).
The stages run under ``torch.distributed.pipelining``: each is a ``PipelineStage`` on the pp
group, and the schedule is torch's own (GPipe, 1F1B, interleaved, zero bubble), which splits the
batch into microbatches, sends the values crossing each boundary and their gradients, runs the
loss on the last stage, scales gradients to the microbatches' mean and tells FSDP2 when the last
backward comes (one reduce-scatter per step, not per microbatch).

Every stage's input and output shapes are known before the first step (static
``PipelineStage`` metadata): planning runs the emitted code once on fake tensors, every rank of
the stage mesh's grid simulated (:func:`autoshard.axes.pp_axis.local_values`), which gives
each crossing value's local shape, dtype and
whether a gradient flows back through it. Shapes are then fixed, as the captured graph's are; no
stage runs on uninitialized values to infer them (an int value crossing a boundary, a position id
or a mask, is exactly as valid as it is in the user's model).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from autoshard.core.mesh import PP, MeshAxes
from autoshard.plans.plan import Plan
from autoshard.runtime import collectives
from autoshard.runtime.graph_parts import Partitioned, StageGraph, StageSplit


@dataclasses.dataclass(frozen=True)
class Crossing:
    """A value's shape on one rank, its dtype and whether a gradient flows back through it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    def example(self, device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device, requires_grad=self.requires_grad)


def flat_inputs(captured, args: tuple, kwargs: dict) -> list:
    """``args`` and ``kwargs`` as the captured graph's placeholders take them, in order (the first
    stage's inputs)."""
    import torch.fx._pytree as fx_pytree

    kwargs = captured.inputs.without_keywords_set_by_capture(dict(kwargs))
    return list(fx_pytree.tree_flatten_spec((args, kwargs), captured.gm._in_spec))


class Pipeline:
    """A model trained over pipeline stages: this rank's stages, torch's schedule, the loss.

    ``step(inputs, targets)`` runs one forward and backward of every microbatch of this rank's dp
    batch and returns the loss averaged over the microbatches and the dp ranks (every rank gets
    the number a single device computes for the global batch); gradients are those of that mean.
    The optimizer is the user's, built from :meth:`parameters` (this rank's stages only).
    ``state_dict()`` holds this rank's stages' entries under the model's own FQNs.
    """

    def __init__(self, modules: list[nn.Module], stage_graphs: list[StageGraph], schedule, plan: Plan,
                 axes: MeshAxes, captured, loss_fn: Callable, split: StageSplit, module: nn.Module):
        self.modules = modules
        self.module = module  # this rank's stages as one module under the model's FQNs (state dicts, DCP)
        self.state_dict_keys: tuple[str, ...] = ()  # the model's, in its order (a full state dict's)
        self.stage_graphs = stage_graphs
        self.schedule = schedule
        self.autoshard_plan = plan
        self.axes = axes
        self.captured = captured
        self.loss_fn = loss_fn
        self.split = split
        self.indices = tuple(s.index for s in stage_graphs)
        self.count = len(split.stages)
        self.has_first = 0 in self.indices
        self.has_last = self.count - 1 in self.indices
        # the logits leave the last stage cut over tp: the schedule runs the loss under loss_parallel()
        self.loss_parallel = any(n.op == "call_function" and n.target is collectives.as_sharded_dtensor
                                 for n in split.stages[-1].module.graph.nodes)

    # --- training ---------------------------------------------------------------------------

    def step(self, inputs, targets, kwargs: Mapping | None = None) -> torch.Tensor:
        """One forward and backward of every microbatch; returns the global batch's mean loss.

        ``inputs``: the model's positional input, or a tuple of them (``example_inputs``' form);
        ``kwargs``: its keyword inputs. ``targets``: what ``loss_fn`` takes next to the model's
        output, split into microbatches along dim 0 like the inputs. Every rank passes its dp
        rank's batch and targets; each stage uses what it needs.
        """
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        flat = flat_inputs(self.captured, args, dict(kwargs or {})) if self.has_first else []
        losses: list = []
        call = dict(target=targets, losses=losses) if self.has_last else {}
        with self._loss_context():
            self.schedule.step(*flat, **call)
        # each microbatch's loss was divided by the microbatches (see build_schedule): their sum is the mean
        losses = [loss.to_local() if isinstance(loss, DTensor) else loss for loss in losses]  # loss parallel
        loss = (torch.stack([loss.detach().float() for loss in losses]).sum() if self.has_last
                else torch.zeros((), device=self._device))
        return self._shared_loss(loss)

    def _loss_context(self):
        """torch's ``loss_parallel()`` around the schedule, whose last stage computes the loss and runs
        backward from it, when the logits come out cut over tp (a DTensor ``Shard(-1)``)."""
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def _shared_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The last stage's mean loss averaged over the dp ranks, on every rank of the pp group."""
        stage_axes = self.axes.stage_axes()
        if self.has_last:
            for axis in stage_axes.dp_axes:
                dist.all_reduce(loss, group=stage_axes.submesh(axis).get_group())
            loss /= stage_axes.data_parallel
        pp_group = self.axes.mesh.get_group(PP)
        last_rank = int(self.axes.mesh[PP].mesh[self.autoshard_plan.pipeline.stages[-1].rank])
        dist.broadcast(loss, src=last_rank, group=pp_group)
        return loss

    @property
    def _device(self) -> torch.device:
        return torch.device(self.axes.mesh.device_type)

    # --- parameters and state ---------------------------------------------------------------

    def named_parameters(self):
        return self.module.named_parameters()

    def parameters(self):
        return self.module.parameters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """This rank's stages' entries, under the model's FQNs and in its layout."""
        return self.module.state_dict()

    def load_state_dict(self, state: Mapping, strict: bool = True):
        """Load this rank's stages' entries of ``state``: a full state dict of the model (the
        other stages' entries are left to their ranks), or one holding these stages' keys."""
        own = set(self.module.state_dict())
        result = self.module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
        if strict and result.missing_keys:
            raise RuntimeError(f"autoshard: the state dict lacks entries of this rank's stages: {result.missing_keys}")
        return result

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Accumulate gradients over steps without reducing them over dp: the steps after
        ``False`` keep FSDP2's unsharded gradients, the first step after ``True`` reduces them all.
        (torch's schedules reduce at every step's last backward; the stage skips that while off.)"""
        for stage in self.pipeline_stages:
            stage.requires_gradient_sync = bool(requires_gradient_sync)

    @property
    def pipeline_stages(self) -> list:
        schedule = self.schedule
        return list(getattr(schedule, "_stages", None) or [schedule._stage])

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every stage's gradients so that their norm over the whole model (every stage, and
        every dp and tp shard) is at most ``max_norm``; returns that norm, the same on every rank."""
        params = [p for p in self.parameters() if p.grad is not None]
        norm_type = float(norm_type)
        by_mesh: dict = {}
        for param in params:
            key = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(param.grad)
        parts = []
        for grads in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(grads, norm_type)
            parts.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float())
        local = torch.stack(parts) if parts else torch.zeros(1, device=self._device)
        inf = math.isinf(norm_type)
        local = local.max() if inf else (local ** norm_type).sum()
        dist.all_reduce(local, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                        group=self.axes.mesh.get_group(PP))
        total = local if inf else local ** (1.0 / norm_type)
        scale = min(1.0, float(max_norm) / (float(total) + 1e-6))
        if scale < 1.0:
            for param in params:
                param.grad.mul_(scale)
        return total

    def __repr__(self) -> str:
        return (f"Pipeline(stages {list(self.indices)} of {self.count} on this rank, schedule "
                f"{type(self.schedule).__name__})")


def build_schedule(stage_modules: list[tuple[StageGraph, nn.Module]], crossings: Mapping[str, Crossing],
                   count: int, schedule_spec, axes: MeshAxes, loss_fn: Callable, out_spec, flat_inputs: list,
                   output_names: tuple[str, ...]):
    """torch's ``PipelineStage`` for each of this rank's stages (shapes given, not inferred) and the
    schedule over them."""
    device = torch.device(axes.mesh.device_type)
    group = axes.mesh.get_group(PP)
    stages = []
    for graph, module in stage_modules:
        if graph.index == 0:
            inputs = tuple(_example_input(v, device) for v in flat_inputs)
        else:
            inputs = tuple(crossings[name].example(device) for name in graph.receives)
        if graph.index == count - 1:
            outputs = tuple(_output_example(graph, name, crossings[name], device) for name in output_names)
        else:
            outputs = tuple(crossings[name].example(device) for name in graph.sends)
        stage = _Stage(module, graph.index, count, device, input_args=inputs, output_args=outputs, group=group)
        stage.example_args = inputs  # shapes and dtypes of what it takes (values uninitialized)
        stages.append(stage)
    microbatches = schedule_spec.microbatches

    def loss(output, target):
        """The user's loss of one microbatch, divided by the microbatches: backward then leaves the
        gradient of their mean, accumulating correctly across steps (torch's ``scale_grads``
        divides the whole ``.grad``, earlier steps' included)."""
        flat = list(output) if isinstance(output, (tuple, list)) else [output]
        return loss_fn(pytree.tree_unflatten(flat, out_spec), target) / microbatches

    schedule_class = get_schedule_class(schedule_spec.name)
    if schedule_spec.layout == "single":
        return schedule_class(stages[0], n_microbatches=microbatches, loss_fn=loss, scale_grads=False)
    return schedule_class(stages, n_microbatches=microbatches, loss_fn=loss, scale_grads=False)


class _Stage(PipelineStage):
    """torch's stage, which can leave a step's gradients unreduced over dp (accumulation).

    The schedule reduces FSDP2's gradients at each step's last backward (``perform_reduce_grad``);
    with ``requires_gradient_sync`` off this runs FSDP2's end of backward with its sync off
    instead, so the unsharded gradients accumulate for the next synced step, as FSDP2 does
    outside a pipeline."""

    requires_gradient_sync = True

    def perform_reduce_grad(self, grad_scale_factor: int):
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self.requires_gradient_sync or not isinstance(self.submod, FSDPModule):
            return super().perform_reduce_grad(grad_scale_factor)
        module = self.submod
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(False)
        state = fully_shard.state(module)
        for each in state._state_ctx.all_states:
            for group in each._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
        return None


def _output_example(graph: StageGraph, name: str, crossing: Crossing, device) -> torch.Tensor:
    """What the last stage returns as ``name``: a tensor of the crossing's shape, or for an output
    left cut over tp (loss parallelism) the DTensor ``as_sharded_dtensor`` makes of that shard, as
    the stage's output metadata must describe it."""
    node = next((n for n in graph.module.graph.nodes if n.name == name), None)
    local = crossing.example(device)
    if node is not None and node.op == "call_function" and node.target is collectives.as_sharded_dtensor:
        return collectives.as_sharded_dtensor(local.detach(), *node.args[1:]).requires_grad_(crossing.requires_grad)
    return local


def _example_input(value, device) -> torch.Tensor:
    return torch.empty(value.shape, dtype=value.dtype, device=device) if isinstance(value, torch.Tensor) else value


def stage_part(graph: StageGraph, blocks: Mapping[str, fx.GraphModule]) -> Partitioned:
    return Partitioned(graph.module, {b: blocks[b] for b in graph.blocks})


def materialize_pipeline(pplan, model: nn.Module, axes: MeshAxes, loss_fn: Callable, *, sync_module_states: bool,
                         reshard_after_forward: bool, mp_policy, activation_checkpointing) -> Pipeline:
    """This rank's stages as sharded modules (see :func:`autoshard.runtime.materialize.materialize`),
    each a ``PipelineStage``, and the schedule over them."""
    from autoshard.runtime.activation_checkpointing import apply_activation_checkpointing
    from autoshard.runtime.materialize import materialize
    from autoshard.runtime.verify import verify

    stage_axes = axes.stage_axes()
    stage_plan = pplan.planned.plan
    aliases = pplan.planned.captured.aliases
    parts = pplan.emitted.parts
    mine = axes.mesh.get_local_rank(PP)
    built = []
    for graph in pplan.split.stages:
        if pplan.plan.pipeline.stages[graph.index].rank != mine:
            continue
        held = set(graph.params)
        plan = dataclasses.replace(stage_plan, params={f: e for f, e in stage_plan.params.items() if f in held},
                                   units=tuple(u for u in stage_plan.units if u == "" or u in graph.blocks),
                                   experts=tuple(c for c in stage_plan.experts if set(c.weights) <= held))
        part = stage_part(graph, parts.blocks)
        module = materialize(part, model, plan, stage_axes, {a: c for a, c in aliases.items() if c in held},
                             sync_module_states=sync_module_states, reshard_after_forward=reshard_after_forward,
                             mp_policy=mp_policy, device=torch.device(axes.mesh.device_type))
        apply_activation_checkpointing(part.blocks, activation_checkpointing)
        verify(module, plan, stage_axes)
        built.append((graph, module))
    spec = pplan.plan.pipeline.schedule
    out_spec = pplan.planned.captured.gm._out_spec
    schedule = build_schedule(built, pplan.crossings, len(pplan.split.stages), spec, axes, loss_fn, out_spec,
                              pplan.flat_inputs, pplan.output_names)
    held = {fqn for graph, _ in built for fqn in graph.params}
    local_plan = dataclasses.replace(stage_plan, params={f: e for f, e in stage_plan.params.items() if f in held})
    union = union_module([m for _, m in built], local_plan, stage_axes.tp, model)
    pipeline = Pipeline([m for _, m in built], [g for g, _ in built], schedule, pplan.plan, axes,
                        pplan.planned.captured, loss_fn, pplan.split, union)
    pipeline.state_dict_keys = tuple(model.state_dict().keys())
    return pipeline


def union_module(stage_modules: list[nn.Module], plan: Plan, tp: int, model: nn.Module) -> nn.Module:
    """One module holding the given stages' modules at their own FQNs (two stages' ``layers`` are
    one container holding both stages' blocks), with the sharded module's state-dict hooks: its
    state dict is this rank's share of the model's, as a sharded module's is of the whole."""
    from autoshard.runtime.state_dict import install_state_dict_hooks

    union = nn.Module()
    merged: set[int] = set()

    def graft(target: nn.Module, source: nn.Module) -> None:
        for name, value in source._parameters.items():
            target._parameters[name] = value
        for name, value in source._buffers.items():
            target.register_buffer(name, value, persistent=name not in source._non_persistent_buffers_set)
        for name, child in source._modules.items():
            existing = target._modules.get(name)
            if existing is None or existing is child:
                target._modules[name] = child
                continue
            if id(existing) not in merged:
                container = nn.Module()
                merged.add(id(container))
                graft(container, existing)
                target._modules[name] = existing = container
            graft(existing, child)

    for module in stage_modules:
        graft(union, module)
    union.autoshard_plan = plan
    install_state_dict_hooks(union, plan, tp, model)
    return union
