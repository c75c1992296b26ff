"""What the door's three calls run once their options are read: :func:`plan_model` (``plan()``),
:func:`prove_model` (``check()``) and :func:`shard_model` (``autoshard()``: plan, agree, emit, prove,
materialize on the ranks).

The door (:mod:`autoshard.api`) reads the user's options and names no axis, and neither does this
module: each axis of :data:`~autoshard.driver.axis_list.AXES` checks the options and the mesh, an
outer axis (pp) runs the others itself through :data:`INNER`, and the rest is every mesh's. The
compile backend, an adapter above the driver, calls :func:`shard_model` with the options it was made
with, so neither imports the other.
"""

from __future__ import annotations

import torch.nn as nn

from autoshard.core.options import Options
from autoshard.driver.agreement import check_agreement
from autoshard.driver.planning import (
    AXES,
    emit,
    mesh_axes,
    outer_axis,
    plan_result,
    proof_grid,
    prove_emitted,
    prove_on,
    proves,
    taking_part,
)
from autoshard.plans.plan import Plan
from autoshard.proof.proof import Proof
from autoshard.runtime.activation_checkpointing import MODES as CHECKPOINT_MODES
from autoshard.runtime.activation_checkpointing import apply_activation_checkpointing
from autoshard.runtime.clipping import remember_entries
from autoshard.runtime.materialize import materialize
from autoshard.runtime.teardown import let_gloo_workers_finish
from autoshard.runtime.verify import verify

# The largest model (parameter elements) ``autoshard(check="auto")`` proves. The proof runs every
# simulated rank's forward and backward on the example shapes in this process, which costs about one
# unsharded training step plus the simulation's per-op overhead: a few seconds up to this size.
AUTO_CHECK_MAX_ELEMENTS = 16_000_000


class _Inner:
    """The driver's run of the axes below an outer one (:class:`~autoshard.axes.contract.Inner`)."""

    def plan(self, model, axes, example_inputs, example_kwargs, given, options, keep_reference=False):
        return plan_result(model, axes, example_inputs, example_kwargs, given, options, keep_reference=keep_reference)

    def emit(self, planned, axes, options, keep_planned=False):
        return emit(planned, axes, options, keep_planned=keep_planned)

    def prove(self, planned, emitted, model, example_inputs, example_kwargs, axes, *, seed=0, rtol=None):
        return prove_emitted(planned, emitted, model, example_inputs, example_kwargs, axes, seed=seed, rtol=rtol)

    def agree(self, plan, inputs, axes, parts=None):
        check_agreement(plan, inputs, axes, parts)

    def proves(self, check, model, axes):
        return proves(check, model, axes, AUTO_CHECK_MAX_ELEMENTS)

    def grid(self, axes):
        return proof_grid(axes)


INNER = _Inner()


def _checked(axes, chosen: Options, sharding: bool):
    for axis in AXES:
        axis.check(axes, chosen, sharding)
    return axes


def plan_model(model: nn.Module, mesh, example_inputs, example_kwargs, chosen: Options) -> Plan:
    """``plan(model, mesh, ...)`` with its options read (see :func:`autoshard.plan`)."""
    axes = _checked(mesh_axes(mesh), chosen, sharding=False)
    outer = outer_axis(axes)
    if outer is not None:
        return outer.plan(INNER, model, axes, example_inputs, example_kwargs, None, chosen).plan
    return plan_result(model, axes, example_inputs, example_kwargs, None, chosen.plan_options()).plan


def prove_model(model: nn.Module, mesh, example_inputs, example_kwargs, plan, chosen: Options, *,
                seed: int, rtol: float | None) -> Proof:
    """``check(model, mesh, ...)`` with its options read (see :func:`autoshard.check`)."""
    axes = _checked(mesh_axes(mesh), chosen, sharding=False)
    outer = outer_axis(axes)
    if outer is not None:
        return outer.prove(INNER, model, axes, example_inputs, example_kwargs, plan, chosen, seed=seed, rtol=rtol)
    return prove_on(model, axes, example_inputs, example_kwargs, chosen.plan_options(), plan=plan, seed=seed,
                    rtol=rtol)


def shard_model(model: nn.Module, mesh, example_inputs, example_kwargs, plan, chosen: Options):
    """``autoshard(model, mesh, ...)`` with its options read (see :func:`autoshard.autoshard`)."""
    plan_options, sharding = chosen.plan_options(), chosen.sharding
    axes = mesh_axes(mesh)
    if axes.mesh is None:
        raise ValueError("autoshard: `mesh` must be a DeviceMesh to shard (a dict of sizes only plans)")
    if sharding.activation_checkpointing not in (None, *CHECKPOINT_MODES):
        raise ValueError("autoshard: activation_checkpointing must be None, 'full' or 'selective', got "
                         f"{sharding.activation_checkpointing!r}")
    _checked(axes, chosen, sharding=True)
    let_gloo_workers_finish()  # a script whose last collective is its last line must exit cleanly
    outer = outer_axis(axes)
    if outer is not None:
        return outer.shard(INNER, model, axes, example_inputs, example_kwargs, plan, chosen)
    proving = INNER.proves(sharding.check, model, axes)
    planned = plan_result(model, axes, example_inputs, example_kwargs, plan, plan_options, keep_reference=proving)
    final_plan, captured = planned.plan, planned.captured
    emitted = emit(planned, axes, plan_options, keep_planned=proving)
    check_agreement(final_plan, captured.inputs, axes, emitted.parts)  # before the first collective
    if proving:
        prove_emitted(planned, emitted, model, example_inputs, example_kwargs, axes).raise_if_failed()
    parts = emitted.parts
    sharded = materialize(
        parts,
        model,
        final_plan,
        axes,
        captured.aliases,
        sync_module_states=sharding.sync_module_states,
        reshard_after_forward=sharding.reshard_after_forward,
        mp_policy=plan_options.mp_policy,
    )
    apply_activation_checkpointing(parts.blocks, sharding.activation_checkpointing)  # on the final block code
    verify(sharded, final_plan, axes)
    sharded.autoshard_plan = final_plan
    remember_entries(sharded, final_plan)
    for axis in taking_part(axes):
        axis.on_ranks(sharded, final_plan, axes)
    sharded.register_forward_pre_hook(captured.inputs.check, with_kwargs=True, prepend=True)
    return sharded
