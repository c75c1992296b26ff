"""Retarget: carry a saved plan to a mesh of another shape without planning again.

A plan's decisions are its roles and its dp placements; neither depends on the
mesh's sizes, so both are kept as they are. What is derived from them and the
mesh is recomputed: placements (an axis that appears gets its default, one that
disappears is dropped), tp collectives and fused sections (none without a tp
axis; a fused dim's stored order is computed per tp size when materializing),
and the notes about tp replication and FSDP padding.

Divisibility is checked on the plan's own shapes: every stored dim tp cuts, and
each fused section, must divide by the new tp size. A weight the plan replicated
over tp stays replicated. Whether activations still divide (heads over tp) is
not in the plan's tables; :func:`check_activations_carry` finds out when the
plan is applied to the model.

A plan made without a tp axis holds no tp decisions to carry: its roles were
never checked against tp (heads, fused sections, dims that do not divide) and
it records no tp collectives, so it is not retargeted to a mesh with tp.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from autoshard.core.mesh import MeshAxes, axes_from_sizes, dp_choice
from autoshard.core.sharding import dp_padding, param_placements, tp_dim_of
from autoshard.plans.block_quant import BlockQuant, with_quantized_gathers

if TYPE_CHECKING:
    from autoshard.plans.plan import ParamSharding, Plan

def retarget(plan: Plan, sizes: Mapping[str, int]) -> Plan:
    """``plan`` on a mesh of ``sizes`` (``{"dp": 4}``, ``{"tp": 4}``, ``{"dp": 2, "tp": 2}``,
    ``{"dp_replicate": 2, "dp_shard": 2, "tp": 2}``): the dp choice moves between ``dp`` and
    ``dp_shard``, and ``dp_replicate`` is always ``R``.

    Raises a ``ValueError`` naming the parameter, its stored dim and size when
    a tp-sharded dim (or a fused section) does not divide by the new tp size,
    and when ``plan`` has no tp axis but ``sizes`` has.
    """
    new = mesh_axes(sizes)
    old = mesh_axes(plan.mesh)
    if new.to_dict() == old.to_dict():
        return plan
    if new.has_pp or old.has_pp:
        if new.has_pp and new.to_dict() != old.to_dict():
            raise ValueError(
                f"autoshard: pipeline stages are planned for one mesh ({mesh_text(old)}), from its costs; a plan "
                f"is not moved to {mesh_text(new)} with them: plan afresh with "
                f"autoshard.plan(model, {new.to_dict()}, ...)")
        # a pipeline plan read for its stage sub-mesh (its roles, as every stage applies them)
        plan = dataclasses.replace(plan, mesh=old.stage_axes().to_dict(), pipeline=None)
        return retarget(plan, sizes)
    if new.ep != old.ep:
        raise ValueError(
            f"autoshard: each MoE layer's split over ep is decided by cost on the mesh it is planned for "
            f"({mesh_text(old)}); a plan is not moved to {mesh_text(new)} with it: plan afresh with "
            f"autoshard.plan(model, {new.to_dict()}, ...)")
    if new.has_tp and not old.has_tp:
        raise ValueError(
            f"autoshard: the plan for mesh {mesh_text(old)} has no tp axis, so it cannot be used on {mesh_text(new)}: "
            f"its roles were never checked against tp sharding and it records no tp collectives; "
            f"plan afresh with autoshard.plan(model, {new.to_dict()}, ...)"
        )
    if new.has_tp:
        _check_divisible(plan, old, new)
    moved = dataclasses.replace(
        plan,
        mesh=new.to_dict(),
        params={fqn: _retarget_entry(entry, old, new) for fqn, entry in plan.params.items()},
        activations=plan.activations if new.has_tp else (),
        activation_units=plan.activation_units if new.has_tp else (),
        breaks=plan.breaks if new.has_tp else (),
    )
    if plan.all_gather_quant:  # tiles change with the mesh: decide each weight's blocks again
        moved = with_quantized_gathers(moved, new, BlockQuant.from_dict(plan.all_gather_quant))
    return moved


def mesh_axes(sizes: Mapping[str, int]) -> MeshAxes:
    axes = axes_from_sizes(dict(sizes))
    bad = {a: n for a, n in axes.sizes if n < 1}
    if bad:
        raise ValueError(f"autoshard: mesh axis sizes must be positive, got {bad}")
    return axes


def mesh_text(axes: MeshAxes) -> str:
    return " x ".join(f"{a}={n}" for a, n in axes.sizes)


def _check_divisible(plan: Plan, old: MeshAxes, new: MeshAxes) -> None:
    """Every stored dim tp cuts, and each fused section of it, divides by the new tp."""
    tp = new.tp
    faults = []
    for fqn, entry in plan.params.items():
        dim = tp_dim_of(entry)
        if dim is None or len(entry.stored_shape) <= dim:
            continue
        size = entry.stored_shape[dim] - entry.duplicated
        where = f"parameter '{fqn}' ({entry.role}) has tp-sharded stored dim {dim}"
        if entry.whole_sections and tp != old.tp:
            faults.append(f"{where} fused from sections [{entry.fused.text()}], the * ones held whole on each of "
                          f"tp={old.tp} ranks (their heads fewer than tp): which are whole depends on tp")
        elif size % tp:
            faults.append(f"{where} of size {size}, which does not divide by tp={tp}")
        elif any(s % tp for s in entry.sections):
            sections = "|".join(map(str, entry.sections))
            faults.append(f"{where} fused from sections [{sections}], which do not each divide by tp={tp}")
    if faults:
        more = f" (and {len(faults) - 3} more)" if len(faults) > 3 else ""
        raise ValueError(
            f"autoshard: the plan for mesh {mesh_text(old)} cannot be used on {mesh_text(new)}: "
            + "; ".join(faults[:3]) + more
            + ". Plan afresh for this mesh (autoshard.plan), or give such a weight role 'replicate' in the plan"
        )


def _retarget_entry(entry: ParamSharding, old: MeshAxes, new: MeshAxes) -> ParamSharding:
    choice = dp_choice(entry.placements) if old.has_dp else None
    placements = param_placements(entry.role, entry.shape, new, choice, tp_dim_of(entry))
    return dataclasses.replace(
        entry,
        placements=placements,
        collectives=entry.collectives if new.has_tp else (),
        note=_retarget_note(entry, placements, old, new),
        sections=entry.sections if new.has_tp else (),
        whole_sections=entry.whole_sections if new.has_tp else (),
        section_runs=entry.section_runs if new.has_tp else (),
        duplicated=entry.duplicated if new.has_tp else 0,
        why=entry.why.on_tp(new.tp if new.has_tp else None),
    )


def _retarget_note(entry: ParamSharding, placements: Mapping[str, str], old: MeshAxes, new: MeshAxes) -> str:
    """The note rendered again from the entry's decisions for the new mesh: its tp parts for the
    new tp (none without tp), its padding for the new dp."""
    padding = dp_padding(entry.shape, entry.transposed, dp_choice(placements), new.fsdp_degree)
    return entry.why.note(new.tp if new.has_tp else None, padding)
