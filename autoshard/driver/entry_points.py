"""What the door's three calls run once their options are read: :func:`plan_model` (``plan()``),
:func:`prove_model` (``check()``) and :func:`shard_model` (``autoshard()``: plan, agree, emit, prove,
materialize on the ranks).

The door (:mod:`autoshard.api`) reads the user's options and names no axis; which axes a mesh has
and what each needs is decided here and below. The compile backend, an adapter above the driver,
calls :func:`shard_model` with the options it was made with, so neither imports the other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from autoshard.core.mesh import CP, MeshAxes
from autoshard.core.meta_model import parameters_on_meta
from autoshard.core.options import Options
from autoshard.driver.agreement import check_ranks_agree, code_lines
from autoshard.driver.pipeline_plan import pipeline_plan_for, prove_pipeline
from autoshard.driver.planning import emit, mesh_axes, plan_result, prove_emitted, prove_on
from autoshard.plans.plan import Plan
from autoshard.proof.proof import Proof
from autoshard.runtime.activation_checkpointing import MODES as CHECKPOINT_MODES
from autoshard.runtime.activation_checkpointing import apply_activation_checkpointing
from autoshard.runtime.clipping import remember_entries
from autoshard.runtime.materialize import materialize
from autoshard.runtime.teardown import let_gloo_workers_finish
from autoshard.runtime.verify import verify

# The largest model (parameter elements) ``autoshard(check="auto")`` proves. The proof runs every
# tp rank's forward and backward on the example shapes in this process, which costs about one
# unsharded training step plus the simulation's per-op overhead: a few seconds up to this size.
AUTO_CHECK_MAX_ELEMENTS = 16_000_000


def plan_model(model: nn.Module, mesh, example_inputs, example_kwargs, chosen: Options) -> Plan:
    """``plan(model, mesh, ...)`` with its options read (see :func:`autoshard.plan`)."""
    plan_options, axes = chosen.plan_options(), mesh_axes(mesh)
    if axes.has_pp:
        return pipeline_plan_for(model, axes, example_inputs, example_kwargs, None, plan_options,
                                 chosen.pipeline.as_keywords()).plan
    _refuse_pipeline_options(chosen)
    return plan_result(model, axes, example_inputs, example_kwargs, None, plan_options).plan


def prove_model(model: nn.Module, mesh, example_inputs, example_kwargs, plan, chosen: Options, *,
                seed: int, rtol: float | None) -> Proof:
    """``check(model, mesh, ...)`` with its options read (see :func:`autoshard.check`)."""
    plan_options, axes = chosen.plan_options(), mesh_axes(mesh)
    if axes.has_pp:
        pplan = pipeline_plan_for(model, axes, example_inputs, example_kwargs, plan, plan_options,
                                  chosen.pipeline.as_keywords(), keep_reference=True)
        return prove_pipeline(pplan, model, axes, seed=seed, rtol=rtol)
    _refuse_pipeline_options(chosen)
    return prove_on(model, axes, example_inputs, example_kwargs, plan_options, plan=plan, seed=seed, rtol=rtol)


def shard_model(model: nn.Module, mesh, example_inputs, example_kwargs, plan, chosen: Options):
    """``autoshard(model, mesh, ...)`` with its options read (see :func:`autoshard.autoshard`)."""
    plan_options, sharding = chosen.plan_options(), chosen.sharding
    axes = mesh_axes(mesh)
    if axes.mesh is None:
        raise ValueError("autoshard: `mesh` must be a DeviceMesh to shard (a dict of sizes only plans)")
    if sharding.activation_checkpointing not in (None, *CHECKPOINT_MODES):
        raise ValueError("autoshard: activation_checkpointing must be None, 'full' or 'selective', got "
                         f"{sharding.activation_checkpointing!r}")
    if plan_options.mp_policy is not None and not axes.has_dp:
        raise ValueError(
            "autoshard: mp_policy is applied by FSDP2 on the dp axis, and this mesh has none "
            f"({axes.to_dict()}); on a tp-only mesh cast the model (model.to(torch.bfloat16)) instead"
        )
    let_gloo_workers_finish()  # a script whose last collective is its last line must exit cleanly
    if axes.has_pp:
        return _pipeline(model, axes, example_inputs, example_kwargs, plan, chosen)
    _refuse_pipeline_options(chosen)
    proving = _proves(sharding.check, model, axes)
    planned = plan_result(model, axes, example_inputs, example_kwargs, plan, plan_options, keep_reference=proving)
    final_plan, captured = planned.plan, planned.captured
    tp_group = axes.group_name("tp") if axes.has_tp else None
    emitted = emit(planned, axes, tp_group, plan_options, keep_planned=proving)
    _check_agreement(final_plan, captured.inputs, axes, emitted.parts)  # before the first collective
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
    if axes.has_cp:  # the global positions of this rank's part of the sequence (its outputs', if left cut)
        from autoshard.runtime.context_ops import local_positions

        sharded.cp_positions = local_positions(axes.mesh.get_local_rank(CP), axes.cp, final_plan.context.seq,
                                               torch.device(axes.mesh.device_type))  # as materialize places tensors
    sharded.register_forward_pre_hook(captured.inputs.check, with_kwargs=True, prepend=True)
    return sharded


def _refuse_pipeline_options(chosen: Options) -> None:
    given = chosen.pipeline.configured()
    if given:
        raise ValueError(f"autoshard: {', '.join(given)} configure pipeline stages, and this mesh has no 'pp' axis")


def _pipeline(model, axes: MeshAxes, example_inputs, example_kwargs, plan, chosen: Options):
    """``autoshard()`` on a mesh with a pp axis: the stage plan, proven, and this rank's stages."""
    from autoshard.runtime.pipeline_stages import materialize_pipeline

    plan_options, sharding, pipelined = chosen.plan_options(), chosen.sharding, chosen.pipeline
    if pipelined.loss_fn is None:
        raise ValueError("autoshard: a mesh with a 'pp' axis trains through a schedule that runs the loss on the "
                         "last stage: pass loss_fn=(output, target) -> loss")
    if plan_options.mp_policy is not None and not axes.stage_axes().has_dp:
        raise ValueError("autoshard: mp_policy is applied by FSDP2 on the dp axis, and this mesh has none")
    proving = _proves(sharding.check, model, axes)
    pplan = pipeline_plan_for(model, axes, example_inputs, example_kwargs, plan, plan_options,
                              pipelined.as_keywords(), keep_reference=proving)
    _check_agreement(pplan.plan, pplan.planned.captured.inputs, axes)
    if proving:
        prove_pipeline(pplan, model, axes).raise_if_failed()
    return materialize_pipeline(pplan, model, axes, pipelined.loss_fn, sync_module_states=sharding.sync_module_states,
                                reshard_after_forward=sharding.reshard_after_forward, mp_policy=plan_options.mp_policy,
                                activation_checkpointing=sharding.activation_checkpointing)


def _check_agreement(final_plan: Plan, inputs, axes: MeshAxes, parts=None) -> None:
    """All ranks of the mesh planned alike (and, given ``parts``, emitted the same code), or all
    raise the same ``ValueError``. Over the default group when the mesh spans it; else per mesh
    axis (a rank that differs shares an axis group with one that does not, so the check still
    fires, on those groups' ranks)."""
    mesh = axes.mesh
    code = ()
    if parts is not None:
        names = {mesh.get_group(axis).group_name: axis for axis in mesh.mesh_dim_names}
        code = code_lines([parts.root.code] + [parts.blocks[b].code for b in sorted(parts.blocks)], names)
    if mesh.size() == dist.get_world_size():
        check_ranks_agree(final_plan, inputs, code=code)
        return
    for name in mesh.mesh_dim_names:
        check_ranks_agree(final_plan, inputs, mesh.get_group(name), code=code)


def _proves(check, model: nn.Module, axes: MeshAxes) -> bool:
    """Whether ``autoshard(check=...)`` runs the proof: always for True, never for False;
    for ``"auto"`` when it costs little (see :data:`AUTO_CHECK_MAX_ELEMENTS`)."""
    if check not in (True, False, "auto"):
        raise ValueError(f"autoshard: check must be True, False or 'auto', got {check!r}")
    if check != "auto":
        return bool(check) and (axes.has_tp or axes.has_cp or axes.has_ep)
    if not (axes.has_tp or axes.has_cp or axes.has_ep) or parameters_on_meta(model):
        return False
    return sum(p.numel() for p in model.parameters()) <= AUTO_CHECK_MAX_ELEMENTS
