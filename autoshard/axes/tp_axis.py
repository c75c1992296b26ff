"""The tensor-parallel axis ``tp``: features cut inside each op, the weights stored so that every
linear is a clean block (``W_t [in, out]``: FSDP on dim 0, tp on dim 1).

tp plans every value's layout (normalize, propagate, and the alternatives settled by comparing whole
plans: the roles of the linears are its decisions), and its other hooks are what comes around them:
the options that exist only with tp, the collectives and the transposed linears written into the
code, its ranks on the proof's grid, and the retargeting rule of a saved plan
(a plan made for another tp size must lay activations out as it did there).

It takes part on every mesh: the transposed linears are every mesh's code, and without a tp axis
they carry no collective.
"""

from __future__ import annotations

import dataclasses

from autoshard.axes.contract import Axis, Kept, PlanResult
from autoshard.core.errors import in_stage
from autoshard.core.mesh import TP, MeshAxes
from autoshard.core.options import PlanOptions
from autoshard.passes.alternatives import settle
from autoshard.passes.capture import copy_graph_module
from autoshard.passes.discover import find_sites
from autoshard.passes.normalize import normalize
from autoshard.passes.placements import build_plan
from autoshard.passes.propagate import propagate
from autoshard.passes.redistribute import insert_redistributes
from autoshard.passes.transpose import rewrite_linears
from autoshard.plans.plan import ParamSharding, Plan
from autoshard.plans.retarget import mesh_axes, mesh_text


class TensorAxis(Axis):
    names = (TP,)

    def takes_part(self, axes: MeshAxes) -> bool:
        return True

    def plan_options(self, options: PlanOptions, axes: MeshAxes) -> PlanOptions:
        return options.for_tp(self.present(axes))

    def layouts(self, captured, sites, axes: MeshAxes, options: PlanOptions, kept: Kept | None):
        """Normalize and propagate for ``axes.tp`` (1 without a tp axis: every value whole); with the
        planner's own roles (no saved plan) the alternatives are settled by comparing whole plans."""
        with in_stage("normalize", captured.gm.graph):
            normalize(captured.gm, sites, axes.tp)
        with in_stage("propagate", captured.gm.graph):
            layout_plan = propagate(captured.gm, sites, axes.tp, kept.roles if kept else None, options,
                                    written=captured.written, block_fqns=captured.block_fqns)
        if kept is not None or not self.present(axes):
            return layout_plan
        with in_stage("alternatives", captured.gm.graph):
            return settle(captured, sites, axes, options, layout_plan)

    def check_carried(self, saved: Plan, final: Plan, planned: PlanResult, kept: Kept, options: PlanOptions) -> None:
        check_activations_carry(saved, final, planned, kept, options)

    def emit(self, gm, planned: PlanResult, axes: MeshAxes, options: PlanOptions) -> None:
        group = self.group(axes) if self.present(axes) else None
        reduce_dtype = options.mp_policy.reduce_dtype if options.mp_policy is not None else None
        if group is not None:
            with in_stage("layouts", gm.graph):
                insert_redistributes(gm, planned.layout_plan, group, reduce_dtype)
        with in_stage("transpose", gm.graph):
            rewrite_linears(gm, planned.sites, planned.layout_plan, group, axes.tp, reduce_dtype)

    def grid(self, axes: MeshAxes) -> dict[str, int]:
        return {TP: axes.tp} if self.present(axes) else {}


def check_activations_carry(saved: Plan, final: Plan, planned: PlanResult, kept: Kept, options: PlanOptions) -> None:
    """A plan retargeted to another tp size must lay activations out as it did on its own mesh.

    Retargeting (:mod:`autoshard.plans.retarget`) works on the plan's tables alone; whether activations
    still divide (heads over tp, fused splits) shows only on the model's graph. ``final`` is what
    ``saved``'s roles give on the new mesh. The same roles are propagated again on the tp size
    ``saved`` was made for; any tp collective or fused section that differs means an activation (a view
    to heads, a fused split) divides by one tp size and not the other, and the roles would only run
    with extra redistributes: that is an error naming what changed."""
    old = mesh_axes(saved.mesh)
    new = mesh_axes(final.mesh)
    if not (old.has_tp and new.has_tp) or old.tp == new.tp:
        return
    # on a copy of the graph (its weights shared): normalizing and propagating rewrite it for a
    # tp size (kv heads expanded where tp cuts finer, a norm over a sharded width written
    # out), and the graph of ``final`` is the one the pipeline goes on to shard
    twin = dataclasses.replace(planned.captured, gm=copy_graph_module(planned.captured.gm))
    twin_sites = find_sites(twin.gm, twin.param_shapes)
    normalize(twin.gm, twin_sites, old.tp)
    layout_plan = propagate(twin.gm, twin_sites, old.tp, kept.roles, options.strict(), written=twin.written)
    before = build_plan(twin, twin_sites, layout_plan, old, kept.shard_choices)
    changed = []
    for fqn, now in final.params.items():
        was = before.params[fqn]
        if (was.collectives, was.fused) != (now.collectives, now.fused):
            line = f"  '{fqn}' on tp={new.tp}: {_change(was, now)}"
            changed.append(line + (f"\n    note: {now.note}" if now.note else ""))
    added = [f"  activation: {a}" for a in final.activations if a not in before.activations]
    if changed or added:
        raise ValueError(
            f"autoshard: the plan for mesh {mesh_text(old)} does not carry over to {mesh_text(new)}: with its roles, "
            f"activations are laid out differently on tp={new.tp} than on tp={old.tp} (a view to heads or a "
            f"fused split divides by one and not the other), so the tp collectives change:\n"
            + "\n".join(changed + added)
            + f"\nplan afresh with autoshard.plan(model, {new.to_dict()}, ...)"
        )


def _change(was: ParamSharding, now: ParamSharding) -> str:
    added = [c for c in now.collectives if c not in was.collectives]
    dropped = [c for c in was.collectives if c not in now.collectives]
    parts = [f"adds '{c}'" for c in added] + [f"drops '{c}'" for c in dropped]
    if was.fused != now.fused:
        parts.append(f"fused sections [{was.fused.text() if was.fused else ''}] become "
                     f"[{now.fused.text() if now.fused else ''}]")
    return "; ".join(parts)
