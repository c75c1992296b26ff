"""The expert-parallel axis ``ep``: decide each MoE layer's experts after the dense plan is made
(:func:`plan_experts`), and rewrite the emitted code of the layers split over ep (:func:`emit_experts`).

ep's ranks are data ranks for everything but the experts: each routes its own batch's tokens, the
dense weights are cut by FSDP over ``dp x ep`` as over any data axis (:attr:`MeshAxes.fsdp_axes`),
and tp, where the mesh has it, plans the experts' features as on a mesh without ep. A layer split
over ep stores its expert weights ``Shard(0)`` over ep (whole experts per rank); its rows travel by
all-to-all (:mod:`autoshard.runtime.token_dispatch`).
"""

from __future__ import annotations

import dataclasses

from autoshard.axes.contract import Axis, PlanResult
from autoshard.core.errors import in_stage
from autoshard.core.mesh import EP, TP, MeshAxes
from autoshard.core.options import PlanOptions
from autoshard.core.sharding import REPLICATED, placement_dim, shard_on
from autoshard.passes.ep_regions import dispatch_experts, expert_layers, owns_its_module
from autoshard.plans.ep_choice import EP_CHOICE, choose
from autoshard.plans.plan import Plan


class ExpertAxis(Axis):
    """ep's hooks: the choice per MoE layer recorded after the dense plan, the exchanges written around
    the experts' code (after tp wrote its collectives into it), and its ranks on the proof's grid, each
    on a batch of its own."""

    names = (EP,)
    proven_on_grid = True

    def record(self, plan: Plan, planned: PlanResult, axes: MeshAxes, options: PlanOptions, cut) -> Plan:
        with in_stage("experts", planned.captured.gm.graph):
            return plan_experts(plan, planned.captured.gm, planned.captured.param_shapes, axes)

    def emit(self, gm, planned: PlanResult, axes: MeshAxes, options: PlanOptions) -> None:
        with in_stage("experts", gm.graph):
            emit_experts(gm, planned.captured.param_shapes, planned.plan, axes, self.group(axes))

    def grid(self, axes: MeshAxes) -> dict[str, int]:
        return {EP: axes.ep}


def plan_experts(plan: Plan, gm, param_shapes, axes: MeshAxes, reshard_after_forward: bool = True) -> Plan:
    """``plan`` with each MoE layer's choice (:mod:`autoshard.plans.ep_choice`) and the ep
    placements of the experts split over ep.

    A mesh with an ep axis promises expert parallelism: a model without experts, experts that ep
    does not divide, and a model none of whose layers ep can split are ``ValueError``s naming the
    layers and their lines, not a plan that quietly runs ep as one more data axis."""
    layers = expert_layers(gm, param_shapes)
    if not layers:
        raise ValueError(f"autoshard: the mesh has an 'ep' axis (ep={axes.ep}) and the model has no experts (no matmul "
                         "reads one expert of a stacked [E, ...] weight); use a mesh without 'ep'")
    uneven = [layer for layer in layers if layer.num_experts % axes.ep]
    if uneven:
        where = "; ".join(f"{layer.module}: {layer.num_experts} experts, at {layer.line}" for layer in uneven)
        raise ValueError(f"autoshard: ep={axes.ep} does not divide the experts of {where}; every ep rank holds "
                         "the same number of whole experts")
    if all(layer.refused for layer in layers):
        where = "; ".join(f"{layer.module} ({layer.line}): {layer.refused}" for layer in layers)
        raise NotImplementedError(f"autoshard: ep cannot split any MoE layer of this model: {where}")
    itemsize = _read_itemsize(gm, layers[0].weights[0])
    choices = tuple(choose(layer, axes.to_dict(), itemsize, reshard_after_forward) for layer in layers)
    own_unit = {c.module for c in choices if axes.expert_fsdp_axes and owns_its_module(c.weights, param_shapes)}
    choices = tuple(dataclasses.replace(c, fsdp=c.module in own_unit) if c.choice == EP_CHOICE else c for c in choices)
    params = dict(plan.params)
    for choice in choices:
        if choice.choice == EP_CHOICE:
            for fqn in choice.weights:
                params[fqn] = _split_over_ep(params[fqn], axes, choice.fsdp)
    return dataclasses.replace(plan, params=params, experts=choices)


def _split_over_ep(entry, axes: MeshAxes, fsdp: bool):
    """An expert weight's entry with whole experts per ep rank (its dim 0), its tp cut as planned, and
    over the data axes ep leaves cut by FSDP on its first dim neither ep nor tp cuts (``fsdp``: the
    experts' module is their own unit), else kept whole there (their gradients averaged)."""
    placements = dict(entry.placements)
    tp_dim = placement_dim(placements.get(TP))
    free = [d for d in range(1, len(entry.stored_shape)) if d != tp_dim]
    for axis in axes.expert_fsdp_axes:
        placements[axis] = shard_on(free[0]) if fsdp and free else REPLICATED
    placements[EP] = shard_on(0)
    said = "whole experts per ep rank (S(0) over ep)"
    why = dataclasses.replace(entry.why, about="; ".join(n for n in (entry.why.about, said) if n))
    note = "; ".join(n for n in (entry.note, said) if n)
    return dataclasses.replace(entry, placements=placements, note=note, why=why)


def _read_itemsize(gm, fqn: str) -> int:
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target == fqn:
            return node.meta["val"].dtype.itemsize
    return 4


def emit_experts(gm, param_shapes, plan: Plan, axes: MeshAxes, group: str) -> None:
    """Rewrite the emitted code of every layer the plan splits over ep (see
    :func:`autoshard.passes.ep_regions.dispatch_experts`)."""
    layers = tuple(frozenset(c.weights) for c in plan.experts if c.choice == EP_CHOICE)
    if not layers:
        return
    outlined = frozenset(c.module for c in plan.experts if c.choice == EP_CHOICE and c.fsdp)
    count = dispatch_experts(gm, param_shapes, layers, axes.ep, group, outlined)
    assert count == len(layers), f"ep rewrote {count} MoE layers, the plan splits {len(layers)}"

