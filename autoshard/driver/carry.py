"""Carry: check that a plan retargeted to another tp size lays activations out as before.

Retargeting (:mod:`autoshard.plans.retarget`) works on the plan's tables alone; whether
activations still divide (heads over tp, fused splits) shows only on the model's
graph. When the plan is applied, its roles are propagated again on the tp size it
was made for and compared with the new mesh's result.
"""

from __future__ import annotations

import dataclasses

from autoshard.core.options import PlanOptions
from autoshard.core.sharding import Role
from autoshard.passes.capture import copy_graph_module
from autoshard.passes.discover import find_sites
from autoshard.passes.normalize import normalize
from autoshard.passes.placements import build_plan
from autoshard.passes.propagate import propagate
from autoshard.plans.plan import ParamSharding, Plan
from autoshard.plans.retarget import mesh_axes, mesh_text


def check_activations_carry(
    given: Plan,
    final: Plan,
    captured,
    sites,
    roles: dict[str, Role],
    dp_placements: dict[str, str],
    options: PlanOptions,
) -> None:
    """A retargeted plan must lay activations out as it did on its own mesh.

    ``final`` is what ``given``'s roles give on the new mesh. The same roles are
    propagated again on the tp size ``given`` was made for; any tp collective or
    fused section that differs means an activation (a view to heads, a fused
    split) divides by one tp size and not the other, and the roles would
    only run with extra redistributes: that is an error naming what changed.
    """
    old = mesh_axes(given.mesh)
    new = mesh_axes(final.mesh)
    if not (old.has_tp and new.has_tp) or old.tp == new.tp:
        return
    # on a copy of the graph (its weights shared): normalizing and propagating rewrite it for a
    # tp size (kv heads expanded where tp cuts finer, a norm over a sharded width written
    # out), and the graph of ``final`` is the one the pipeline goes on to shard
    twin = dataclasses.replace(captured, gm=copy_graph_module(captured.gm))
    twin_sites = find_sites(twin.gm, twin.param_shapes)
    normalize(twin.gm, twin_sites, old.tp)
    layout_plan = propagate(twin.gm, twin_sites, old.tp, roles, options.strict(), written=twin.written)
    before = build_plan(twin, twin_sites, layout_plan, old, dp_placements)
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
