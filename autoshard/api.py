"""``autoshard()`` and ``plan()``: the only place the pipeline runs.

capture -> discover -> normalize -> propagate -> alternatives -> placements (the plan) -> [ranks agree]
-> layouts -> transpose -> partition -> [proof] -> materialize -> activation checkpointing -> verify

``_plan`` runs the stages up to the plan, ``_emit`` those that write the sharded code, and
``autoshard()`` the rest; :func:`checked_on` plans, emits and proves without a process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from autoshard.agreement import check_ranks_agree
from autoshard.block_quant import BlockQuant, with_quantized_gathers
from autoshard.carry import check_activations_carry
from autoshard.clipping import remember_entries
from autoshard.errors import in_stage
from autoshard.mesh import CP, MeshAxes, axes_from_sizes, dp_choice, read_mesh
from autoshard.options import PlanOptions
from autoshard.passes.alternatives import settle
from autoshard.passes.capture import CapturedGraph, capture, copy_graph_module, parameters_on_meta
from autoshard.passes.checkpointing import MODES as CHECKPOINT_MODES
from autoshard.passes.checkpointing import apply_activation_checkpointing
from autoshard.passes.discover import Sites, find_sites
from autoshard.passes.layouts import insert_redistributes
from autoshard.passes.materialize import materialize
from autoshard.passes.normalize import normalize, weights_on_the_right
from autoshard.passes.partition import Partitioned, partition
from autoshard.passes.placements import build_plan
from autoshard.passes.propagate import LayoutPlan, propagate
from autoshard.passes.transpose import rewrite_linears
from autoshard.passes.verify import verify
from autoshard.plan import Plan, mixed_precision_of
from autoshard.proof import Proof, Subject, prove, vocabularies
from autoshard.retarget import retarget
from autoshard.sharding import REPLICATED, Role, placements_text, shard_on

# The largest model (parameter elements) ``autoshard(check="auto")`` proves. The proof runs every
# tp rank's forward and backward on the example shapes in this process, which costs about one
# unsharded training step plus the simulation's per-op overhead: a few seconds up to this size.
AUTO_CHECK_MAX_ELEMENTS = 16_000_000


def check(
    model: nn.Module,
    mesh: DeviceMesh | Mapping[str, int],
    *,
    example_inputs: tuple,
    example_kwargs: dict | None = None,
    plan: Plan | Mapping | None = None,
    seed: int = 0,
    rtol: float | None = None,
    on_indivisible: str = "replicate",
    loss_parallel: bool = False,
    dynamic_shapes=None,
    sequence_parallel: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    all_gather_quant: BlockQuant | None = None,
    trace_blocks_once: bool = True,
    microbatches: int | None = None,
    schedule: str = "1F1B",
    stages_per_rank: int | None = None,
    pp_split=None,
    memory_per_rank: int | None = None,
    context_output: str = "whole",
) -> Proof:
    """Prove the plan for ``model`` on ``mesh`` in this process, without a process group.

    Every tp rank of the emitted code runs here, forward and backward, on fresh inputs of
    the example's shapes (token ids over the whole vocabulary) and one random full set of
    weights cut as the plan cuts them; collectives are simulated across the ranks' values.
    Every output and every parameter gradient is compared with the unsharded captured graph
    on the same weights and inputs. FSDP over the dp axes is torch's own and not simulated.

    Args:
        model: the single-device model, only read: its weights set the spread of the random ones,
            its buffers are used as they are (copied).
        mesh: a ``DeviceMesh`` or a dict of axis sizes (``{"dp": 2, "tp": 4}``).
        example_inputs: one rank's batch; only shapes, dtypes and masks are taken from it.
        plan: a saved plan to prove instead of planning.
        seed: seeds the weights, inputs and output gradients.
        rtol: the relative error allowed (default by compute dtype: 1e-4 fp32, 3e-2 bf16).
        The other options are :func:`autoshard`'s; ``mp_policy`` proves the code as it runs in
        ``param_dtype``. On a mesh with a ``pp`` axis the stages, called one after another on one
        microbatch, are proven against the unsharded graph.

    Returns:
        a :class:`~autoshard.proof.Proof`: ``ok``, the error of every output and gradient, the
        first diverging node when it failed; ``raise_if_failed()`` raises with all of it.

    Example::

        proof = autoshard.check(model, {"dp": 2, "tp": 4}, example_inputs=(tokens,))
        proof.raise_if_failed()
    """
    options = PlanOptions(on_indivisible, loss_parallel, sequence_parallel, dynamic_shapes, mp_policy,
                          all_gather_quant, trace_blocks_once, context_output)
    axes = _axes(mesh)
    pipelined = dict(loss_fn=None, microbatches=microbatches, schedule=schedule, stages_per_rank=stages_per_rank,
                     pp_split=pp_split, memory_per_rank=memory_per_rank)
    if axes.has_pp:
        from autoshard.pipeline_proof import prove_stages

        pplan = _pipeline_plan(model, axes, example_inputs, example_kwargs, plan, options, pipelined,
                               keep_reference=True)
        return prove_stages(pplan, model, pplan.micro_inputs, pplan.micro_kwargs, seed=seed, rtol=rtol)
    _refuse_pipeline_options(pipelined)
    if axes.has_cp:
        planned = plan_result(model, axes, example_inputs, example_kwargs, plan, options, keep_reference=True)
        emitted = _emit(planned, axes, "tp", options) if axes.has_tp else None
        return prove_cut(planned, model, example_inputs, example_kwargs, axes, rtol=rtol, emitted=emitted)
    return prove_on(model, axes, example_inputs, example_kwargs, options, plan=plan, seed=seed, rtol=rtol)


def prove_on(model: nn.Module, axes: MeshAxes, example_inputs: tuple, example_kwargs: dict | None,
             options: PlanOptions, *, plan=None, captured: CapturedGraph | None = None, seed: int = 0,
             rtol: float | None = None) -> Proof:
    """:func:`check` on ``axes`` with ``options``; ``captured`` (this model captured with these
    inputs and options, see :func:`capture_for`) skips capturing again: the zoo proves one
    capture on several meshes."""
    return checked_on(model, axes, example_inputs, example_kwargs, options, plan=plan, captured=captured,
                      seed=seed, rtol=rtol).proof


def checked_on(model: nn.Module, axes: MeshAxes, example_inputs: tuple, example_kwargs: dict | None,
               options: PlanOptions, *, plan=None, captured: CapturedGraph | None = None, seed: int = 0,
               rtol: float | None = None, tp_group: str = "tp", keep_values: bool = False) -> Checked:
    """Plan, emit (the tp ops name their group ``tp_group``) and prove, without a process group;
    ``keep_values`` keeps the tensors the proof ran (:class:`~autoshard.proof.ProofValues`)."""
    if axes.has_cp:
        raise NotImplementedError("autoshard: the per-node report of a tp proof does not cover a mesh with a 'cp' "
                                  "axis; prove it with autoshard.check(model, mesh, example_inputs=...)")
    planned = plan_result(model, axes, example_inputs, example_kwargs, plan, options, keep_reference=True,
                    captured=captured)
    emitted = _emit(planned, axes, tp_group if axes.has_tp else None, options, keep_planned=True)
    proof = prove(emitted.subject, model, example_inputs, example_kwargs, seed=seed, rtol=rtol,
                  keep_values=keep_values)
    return Checked(planned, emitted, dataclasses.replace(proof, plan=planned.plan))


def capture_for(model: nn.Module, example_inputs: tuple, example_kwargs: dict | None,
                options: PlanOptions, axes: MeshAxes) -> CapturedGraph:
    """The capture :func:`_plan` makes for ``axes`` (mixed precision captures in ``param_dtype``
    only with a dp axis), to plan on several meshes from one trace."""
    return capture(model, example_inputs, example_kwargs, options.dynamic_shapes,
                   _compute_dtype(model, axes, options), options.trace_blocks_once)


def _compute_dtype(model: nn.Module, axes: MeshAxes, options: PlanOptions):
    if getattr(model, "replays_graph", False):
        return None  # a dynamo graph replayed node by node: its blocks' input casts never run
    return options.mp_policy.param_dtype if options.mp_policy is not None and axes.has_dp else None


def plan(
    model: nn.Module,
    mesh: DeviceMesh | Mapping[str, int],
    *,
    example_inputs: tuple,
    example_kwargs: dict | None = None,
    on_indivisible: str = "replicate",
    loss_parallel: bool = False,
    dynamic_shapes=None,
    sequence_parallel: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    all_gather_quant: BlockQuant | None = None,
    trace_blocks_once: bool = True,
    microbatches: int | None = None,
    schedule: str = "1F1B",
    stages_per_rank: int | None = None,
    pp_split=None,
    memory_per_rank: int | None = None,
    context_output: str = "whole",
) -> Plan:
    """Plan how ``model`` is sharded over ``mesh`` without touching any tensor.

    One process, no process group: the model is captured on its example inputs
    and planned; nothing is sharded or run.

    Args:
        model: the single-device model (left untouched).
        mesh: a ``DeviceMesh``, or a mapping of axis sizes (``{"dp": 2, "tp": 4}``)
            to plan for a mesh that does not exist in this process.

    Keyword Args:
        example_inputs, example_kwargs, on_indivisible, loss_parallel, dynamic_shapes,
        sequence_parallel, mp_policy, all_gather_quant, trace_blocks_once, and on a mesh with a
        ``pp`` axis microbatches, schedule, stages_per_rank, pp_split, memory_per_rank: as
        :func:`autoshard`'s.

    Returns:
        The :class:`~autoshard.plan.Plan` :func:`autoshard` would apply.

    Example::

        plan = autoshard.plan(model, {"dp": 2, "tp": 4}, example_inputs=(tokens,))
        print(plan)
    """
    options = PlanOptions(on_indivisible, loss_parallel, sequence_parallel, dynamic_shapes, mp_policy,
                          all_gather_quant, trace_blocks_once, context_output)
    axes = _axes(mesh)
    pipelined = dict(loss_fn=None, microbatches=microbatches, schedule=schedule, stages_per_rank=stages_per_rank,
                     pp_split=pp_split, memory_per_rank=memory_per_rank)
    if axes.has_pp:
        return _pipeline_plan(model, axes, example_inputs, example_kwargs, None, options, pipelined).plan
    _refuse_pipeline_options(pipelined)
    return plan_result(model, axes, example_inputs, example_kwargs, None, options).plan


def autoshard(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    example_inputs: tuple,
    example_kwargs: dict | None = None,
    plan: Plan | Mapping | None = None,
    sync_module_states: bool = True,
    reshard_after_forward: bool = True,
    on_indivisible: str = "replicate",
    loss_parallel: bool = False,
    dynamic_shapes=None,
    sequence_parallel: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    activation_checkpointing: str | None = None,
    all_gather_quant: BlockQuant | None = None,
    trace_blocks_once: bool = True,
    check: bool | str = "auto",
    loss_fn=None,
    microbatches: int | None = None,
    schedule: str = "1F1B",
    stages_per_rank: int | None = None,
    pp_split=None,
    memory_per_rank: int | None = None,
    context_output: str = "whole",
):
    """Shard ``model`` over ``mesh`` (axes ``dp`` and/or ``tp``) and return a GraphModule.

    The result, called on a rank's local batch, returns what ``model`` returns for it, as full
    (tp-replicated) tensors; its ``parameters()`` are the sharded DTensors any ``torch.optim``
    optimizer trains, with gradients averaged over dp. The plan applied is
    ``result.autoshard_plan``. The user's model is never modified. The graph is captured for
    the shapes of ``example_inputs``; a call with other shapes raises a ``ValueError`` naming
    the input.

    Args:
        model: the single-device model. Built on the meta device, it is sharded from shapes:
            each rank's local shards are allocated uninitialized, for ``result.load_state_dict``
            to fill (non-persistent buffers the forward reads must hold values beforehand).
        mesh: a ``DeviceMesh`` with axes ``("dp", "tp")``, ``("dp",)``, ``("tp",)``, or for HSDP
            ``("dp_replicate", "dp_shard"[, "tp"])``; ``"pp"`` in front for pipeline stages, ``"cp"``
            before ``"tp"`` for context parallelism (``("dp", "cp", "tp")``, ``("cp",)``, ...): the
            sequence (dim 1 of the first input) cut over cp, see ``docs/context-parallel.md``.

    Keyword Args:
        example_inputs: one rank's dp-local batch (a tuple of positional inputs).
        example_kwargs: its keyword inputs. A forward that takes ``use_cache`` (a Hugging Face
            decoder's KV cache, on by default) and is not given it here runs with
            ``use_cache=False``: the result returns the model's output without the cache.
        plan: a :class:`Plan` or its dict, applied instead of planning.
        sync_module_states: broadcast rank 0's weights first, so ranks that initialized
            differently still agree.
        reshard_after_forward: FSDP2's: blocks free their gathered parameters after forward.
        on_indivisible: a weight whose sharded dim does not divide by tp (a vocabulary of 50257
            on tp=2) is replicated over tp and the plan says why (``"replicate"``), or raises a
            ``ValueError`` naming it (``"error"``).
        loss_parallel: outputs sharded over their last dim (LM-head logits) are returned as
            DTensors ``Shard(-1)`` on the tp mesh, never gathered; compute the loss under
            ``torch.distributed.tensor.parallel.loss_parallel()``.
        dynamic_shapes: ``torch.export``'s spec (e.g. ``({0: Dim("batch"), 1: Dim("seq")},)``):
            those dims are captured symbolic, one plan and one graph for every batch and
            sequence length.
        sequence_parallel: norms, dropout and residual adds run sharded over the sequence; each
            rowwise all-reduce becomes a reduce-scatter and each colwise group's input an
            all-gather (reduce-scatter in backward).
        mp_policy: FSDP2's ``MixedPrecisionPolicy``, applied by every FSDP unit (master
            parameters and optimizer state stay fp32; parameters are all-gathered and computed
            in ``param_dtype``, gradients reduce-scattered in ``reduce_dtype``). autoshard's tp
            collectives follow it: activations travel in ``param_dtype`` and every sum of partial
            values is taken in ``reduce_dtype``. Needs a dp axis, since FSDP2 applies the casts.
        activation_checkpointing: ``"full"`` recomputes each block in backward (its forward tp
            collectives included); ``"selective"`` keeps the outputs of matmuls, attention and
            tp collectives and recomputes the rest (no extra tp collective); ``None`` keeps
            every activation.
        all_gather_quant: an :class:`autoshard.BlockQuant`: each rank quantizes its tile of every
            2-D weight block by block right before FSDP's all-gather, which then carries 1-byte
            values and one fp32 scale per block; the gathered weight is dequantized before the
            matmul. Master weights, gradients and optimizer state are untouched. A weight whose
            tile does not divide by the block is gathered unquantized (the plan says why) unless
            ``BlockQuant(on_unaligned="error")``.
        trace_blocks_once: trace a stack of identical blocks (an ``nn.ModuleList``) as its first
            two and write the others from the second: the same graph and plan as tracing every
            block, in a fraction of the time. Blocks that differ are traced in full and the plan
            says why; ``False`` always traces all.
        check: prove the emitted tp code before any tensor is placed (see :func:`check`); a plan
            that fails raises :class:`~autoshard.proof.ProofError` naming the first diverging
            node and its source line. ``"auto"`` proves when it costs little: a mesh with tp, a
            model holding values (not on meta) with at most :data:`AUTO_CHECK_MAX_ELEMENTS`
            parameter elements. ``True`` always, ``False`` never.

        loss_fn, microbatches, schedule, stages_per_rank, pp_split, memory_per_rank: a mesh with a
            ``pp`` axis (outermost: ``("pp", "dp", "tp")``, ``("pp", "tp")``, ...) cuts the model
            into pipeline stages, see ``docs/pipeline.md``. ``loss_fn(output, target)`` runs on the
            last stage, per microbatch; ``microbatches`` divides the dp-local batch (default: as
            many as stages); ``schedule`` is a ``torch.distributed.pipelining`` schedule name
            (``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``, ``"LoopedBFS"``,
            ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``, ``"DualPipeV"``), with
            ``stages_per_rank`` stages per pp rank for the interleaved ones (default 2);
            ``pp_split`` names the first block of every stage after the first (default: the split
            that balances the stages' FLOPs); ``memory_per_rank`` (bytes) bounds each stage's
            parameters, gradients, optimizer states and in-flight activations.
        context_output: on a mesh with a ``cp`` axis, outputs cut along the sequence come back
            all-gathered (``"whole"``, the default) or as this rank's positions (``"local"``,
            listed in ``result.cp_positions``), each rank's loss then being its share of the batch's.

    Returns:
        the sharded ``fx.GraphModule`` (its blocks are FSDP units); on a mesh with a ``pp`` axis a
        :class:`~autoshard.pipeline.Pipeline` (``step(inputs, targets)``, ``parameters()``).

    Example::

        mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))
        sharded = autoshard.autoshard(model, mesh, example_inputs=(tokens,))
        optimizer = torch.optim.AdamW(sharded.parameters(), lr=3e-4)
    """
    axes = _axes(mesh)
    if axes.mesh is None:
        raise ValueError("autoshard: `mesh` must be a DeviceMesh to shard (a dict of sizes only plans)")
    if activation_checkpointing not in (None, *CHECKPOINT_MODES):
        raise ValueError(
            f"autoshard: activation_checkpointing must be None, 'full' or 'selective', got {activation_checkpointing!r}"
        )
    if mp_policy is not None and not axes.has_dp:
        raise ValueError(
            "autoshard: mp_policy is applied by FSDP2 on the dp axis, and this mesh has none "
            f"({axes.to_dict()}); on a tp-only mesh cast the model (model.to(torch.bfloat16)) instead"
        )
    options = PlanOptions(on_indivisible, loss_parallel, sequence_parallel, dynamic_shapes, mp_policy,
                          all_gather_quant, trace_blocks_once, context_output)
    pipelined = dict(loss_fn=loss_fn, microbatches=microbatches, schedule=schedule, stages_per_rank=stages_per_rank,
                     pp_split=pp_split, memory_per_rank=memory_per_rank)
    if axes.has_pp:
        return _pipeline(model, axes, example_inputs, example_kwargs, plan, options, check, pipelined,
                         sync_module_states=sync_module_states, reshard_after_forward=reshard_after_forward,
                         activation_checkpointing=activation_checkpointing)
    _refuse_pipeline_options(pipelined)
    proving = _proves(check, model, axes)
    planned = plan_result(model, axes, example_inputs, example_kwargs, plan, options, keep_reference=proving)
    final_plan, captured = planned.plan, planned.captured
    _check_agreement(final_plan, captured.inputs, axes)  # before the first collective
    tp_group = axes.group_name("tp") if axes.has_tp else None
    emitted = _emit(planned, axes, tp_group, options, keep_planned=proving)
    if proving and axes.has_cp:
        prove_cut(planned, model, example_inputs, example_kwargs, axes, emitted=emitted).raise_if_failed()
    elif proving:
        prove(emitted.subject, model, example_inputs, example_kwargs).raise_if_failed()
    parts = emitted.parts
    sharded = materialize(
        parts,
        model,
        final_plan,
        axes,
        captured.aliases,
        sync_module_states=sync_module_states,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
    )
    apply_activation_checkpointing(parts.blocks, activation_checkpointing)  # on the final block code
    verify(sharded, final_plan, axes)
    sharded.autoshard_plan = final_plan
    remember_entries(sharded, final_plan)
    if axes.has_cp:  # the global positions of this rank's part of the sequence (its outputs', if left cut)
        from autoshard.context_ops import local_positions

        sharded.cp_positions = local_positions(axes.mesh.get_local_rank(CP), axes.cp, final_plan.context["seq"],
                                               torch.device(axes.mesh.device_type))  # as materialize places tensors
    sharded.register_forward_pre_hook(captured.inputs.check, with_kwargs=True, prepend=True)
    return sharded


_PIPELINE_DEFAULTS = dict(loss_fn=None, microbatches=None, schedule="1F1B", stages_per_rank=None, pp_split=None,
                          memory_per_rank=None)


def _refuse_pipeline_options(pipelined: dict) -> None:
    given = [k for k, v in pipelined.items() if v != _PIPELINE_DEFAULTS[k]]
    if given:
        raise ValueError(f"autoshard: {', '.join(given)} configure pipeline stages, and this mesh has no 'pp' axis")


def _pipeline_plan(model, axes: MeshAxes, example_inputs, example_kwargs, plan, options, pipelined: dict,
                   keep_reference: bool = False):
    from autoshard.pipeline_plan import plan_pipeline

    if not isinstance(example_inputs, tuple):
        raise ValueError(f"autoshard: `example_inputs` must be a tuple, got {type(example_inputs).__name__}")
    per_rank = pipelined["stages_per_rank"]
    microbatches = pipelined["microbatches"]
    if microbatches is None:
        microbatches = axes.pp * (per_rank or (1 if pipelined["schedule"].lower() in ("gpipe", "1f1b") else 2))
    tp_group = axes.stage_axes().group_name("tp") if axes.has_tp and axes.mesh is not None else "tp"
    return plan_pipeline(model, axes, example_inputs, example_kwargs, plan, options,
                         schedule=pipelined["schedule"], microbatches=microbatches, stages_per_rank=per_rank,
                         pp_split=pipelined["pp_split"], memory_per_rank=pipelined["memory_per_rank"],
                         tp_group=tp_group if axes.has_tp else None, keep_reference=keep_reference)


def _pipeline(model, axes: MeshAxes, example_inputs, example_kwargs, plan, options, check, pipelined: dict, *,
              sync_module_states, reshard_after_forward, activation_checkpointing):
    """``autoshard()`` on a mesh with a pp axis: the stage plan, proven, and this rank's stages."""
    from autoshard.pipeline import materialize_pipeline

    if pipelined["loss_fn"] is None:
        raise ValueError("autoshard: a mesh with a 'pp' axis trains through a schedule that runs the loss on the "
                         "last stage: pass loss_fn=(output, target) -> loss")
    if options.mp_policy is not None and not axes.stage_axes().has_dp:
        raise ValueError("autoshard: mp_policy is applied by FSDP2 on the dp axis, and this mesh has none")
    proving = _proves(check, model, axes)
    pplan = _pipeline_plan(model, axes, example_inputs, example_kwargs, plan, options, pipelined,
                           keep_reference=proving)
    _check_agreement(pplan.plan, pplan.planned.captured.inputs, axes)
    if proving:
        from autoshard.pipeline_proof import prove_stages

        prove_stages(pplan, model, pplan.micro_inputs, pplan.micro_kwargs).raise_if_failed()
    return materialize_pipeline(pplan, model, axes, pipelined["loss_fn"], sync_module_states=sync_module_states,
                                reshard_after_forward=reshard_after_forward, mp_policy=options.mp_policy,
                                activation_checkpointing=activation_checkpointing)


def _check_agreement(final_plan: Plan, inputs, axes: MeshAxes) -> None:
    """All ranks of the mesh planned alike, or all raise the same ``ValueError``. Over the
    default group when the mesh spans it; else per mesh axis (a rank that differs shares an
    axis group with one that does not, so the check still fires, on those groups' ranks)."""
    mesh = axes.mesh
    if mesh.size() == dist.get_world_size():
        check_ranks_agree(final_plan, inputs)
        return
    for name in mesh.mesh_dim_names:
        check_ranks_agree(final_plan, inputs, mesh.get_group(name))


def _axes(mesh) -> MeshAxes:
    if isinstance(mesh, Mapping):
        return axes_from_sizes(dict(mesh))
    return read_mesh(mesh)


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """A plan with what it was made from: the captured graph (nodes and all, normalized), the
    sites and propagation's layouts. Emission works from it, and so does ``suggest_mesh``
    (which costs a plan on the graph). ``reference`` is a copy of the graph as captured,
    before any pass rewrote it (kept only for a proof)."""

    plan: Plan
    captured: CapturedGraph
    sites: Sites
    layout_plan: LayoutPlan
    reference: fx.GraphModule | None = None
    # on a mesh with a cp axis: a copy of the graph cut over cp, before tp (kept only for a proof)
    context_graph: fx.GraphModule | None = None


@dataclasses.dataclass(frozen=True)
class Emitted:
    """The sharded code before any tensor is placed: ``parts`` (root and block graphs), and
    with ``keep_planned`` the :class:`~autoshard.proof.Subject` a proof runs."""

    parts: Partitioned
    subject: Subject | None = None


@dataclasses.dataclass(frozen=True)
class Checked:
    """One plan, the code emitted for it and its proof: what :mod:`autoshard.testing` reports."""

    planned: PlanResult
    emitted: Emitted
    proof: Proof


def plan_result(model, axes: MeshAxes, example_inputs, example_kwargs, given, options: PlanOptions,
                keep_reference: bool = False, captured: CapturedGraph | None = None) -> PlanResult:
    """Capture, discover, normalize, propagate, settle the alternatives and build the plan for ``axes``; ``given`` is a
    saved plan to apply instead of deciding roles. ``captured``: a capture of this model
    (:func:`capture_for`) to plan on a copy of instead of capturing again."""
    with _without_cyclic_gc():
        return _planned(model, axes, example_inputs, example_kwargs, given, options, keep_reference, captured)


@contextlib.contextmanager
def _without_cyclic_gc():
    """Python's cyclic garbage collector paused while planning, as torch's own
    ``get_state_dict`` pauses it.

    Planning allocates a few objects per graph node (nodes, their users and meta dicts) and
    keeps most of them. Every so many allocations the collector walks what survived, and once
    the survivors outgrow a quarter of the heap it walks the whole process (torch, the model):
    planning an 80-block Llama on meta paid one such pass, 0.4 s of its 1.5 s. Garbage made
    meanwhile is collected by the first pass after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _planned(model, axes: MeshAxes, example_inputs, example_kwargs, given, options: PlanOptions,
             keep_reference: bool, captured: CapturedGraph | None) -> PlanResult:
    """:func:`plan_result`'s stages."""
    options = options.for_tp(axes.has_tp)
    if not isinstance(example_inputs, tuple):
        raise ValueError(f"autoshard: `example_inputs` must be a tuple, got {type(example_inputs).__name__}")
    saved = _as_plan(given)
    given = _check_plan_mesh(saved, axes) if saved is not None else None
    if captured is None:
        captured = capture_for(model, example_inputs, example_kwargs, options, axes)
    else:
        captured = dataclasses.replace(captured, gm=copy_graph_module(captured.gm))
    reference = copy_graph_module(captured.gm) if keep_reference else None
    context, context_graph = None, None
    if options.context_output != "whole" and not axes.has_cp:
        raise ValueError("autoshard: context_output configures context parallelism, and this mesh has no 'cp' axis")
    if axes.has_cp:
        context = _cut_sequence(captured, axes, options, example_inputs)
        context_graph = copy_graph_module(captured.gm) if keep_reference else None
    with in_stage("discover", captured.gm.graph):
        weights_on_the_right(captured.gm, captured.param_shapes)
        sites = find_sites(captured.gm, captured.param_shapes)
    roles = None
    dp_placements = None
    if given is not None:
        _check_plan_params(given, captured.param_shapes)
        weights = {s.weight_fqn for s in sites.all}
        roles = {fqn: p.role for fqn, p in given.params.items() if fqn in weights}
        # an expert weight's role is planned again from its layout unless the plan replicated it
        experts = {s.weight_fqn for s in sites.experts}
        roles |= {fqn: p.role for fqn, p in given.params.items() if fqn in experts and p.role == Role.REPLICATE}
        dp_placements = {fqn: dp_choice(p.placements) for fqn, p in given.params.items() if dp_choice(p.placements)}
    with in_stage("normalize", captured.gm.graph):
        normalize(captured.gm, sites, axes.tp)
    with in_stage("propagate", captured.gm.graph):
        layout_plan = propagate(captured.gm, sites, axes.tp, roles, options, written=captured.written,
                                block_fqns=captured.block_fqns)
    if roles is None and axes.has_tp:
        with in_stage("alternatives", captured.gm.graph):
            layout_plan = settle(captured, sites, axes, options, layout_plan)
    with in_stage("plan", captured.gm.graph):
        final = build_plan(captured, sites, layout_plan, axes, dp_placements)
    if options.mp_policy is not None:
        final = dataclasses.replace(final, mixed_precision=mixed_precision_of(options.mp_policy))
    if options.all_gather_quant is not None:
        final = with_quantized_gathers(final, axes, options.all_gather_quant)
    if captured.trace_note:
        final = dataclasses.replace(final, trace_note=captured.trace_note)
    if context is not None:
        from autoshard.passes.context import cp_traffic

        traffic = cp_traffic(captured.gm, layout_plan.layouts, axes.tp)
        final = dataclasses.replace(final, context=context.to_dict() | {"collectives": [list(t) for t in traffic]})
    if given is not None:
        _check_plan_consistent(given, final)
        if given is not saved:
            check_activations_carry(saved, final, captured, sites, roles, dp_placements, options)
    return PlanResult(final, captured, sites, layout_plan, reference, context_graph)


def _cut_sequence(captured: CapturedGraph, axes: MeshAxes, options: PlanOptions, example_inputs: tuple):
    """The captured graph rewritten into one cp rank's code (see :mod:`autoshard.passes.context`)."""
    from autoshard.passes.context import SEQ_DIM, cut_sequence

    if options.sequence_parallel:
        raise ValueError("autoshard: sequence_parallel cuts the sequence over tp, and the mesh's cp axis cuts it "
                         "already: use one of them (cp keeps every activation cut, attention included)")
    if options.dynamic_shapes is not None:
        raise NotImplementedError("autoshard: context parallelism cuts a sequence of fixed length; capture with "
                                  "dynamic_shapes=None")
    if options.loss_parallel:
        raise NotImplementedError("autoshard: loss_parallel with a cp axis: the logits come back whole over cp")
    first = example_inputs[0] if example_inputs else None
    if not isinstance(first, torch.Tensor) or first.dim() <= SEQ_DIM:
        what = list(first.shape) if isinstance(first, torch.Tensor) else type(first).__name__
        raise ValueError("autoshard: context parallelism cuts dim 1 ([batch, seq, ...]) of the first input, and "
                         f"the first example input is {what}")
    group = axes.group_name(CP) if axes.mesh is not None else CP
    with in_stage("cut the sequence", captured.gm.graph):
        return cut_sequence(captured.gm, int(first.shape[SEQ_DIM]), axes.cp, group, set(captured.param_shapes),
                            local_outputs=options.context_output == "local")


def prove_cut(planned: PlanResult, model: nn.Module, example_inputs: tuple, example_kwargs: dict | None,
              axes: MeshAxes, rtol: float | None = None, emitted: Emitted | None = None):
    """The graph cut over cp, every cp rank simulated, against the unsharded graph
    (see :mod:`autoshard.context_proof`); on a mesh with tp, the tp code ``emitted`` for it, every
    cp x tp rank simulated."""
    from autoshard.context_proof import prove_context
    from autoshard.passes.context import ContextPlan
    from autoshard.pipeline import flat_inputs

    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    weights = {}
    for node in planned.reference.graph.nodes:
        if node.op == "get_attr" and node.target in params:
            read = node.meta.get("val")  # in the dtype the graph reads it (param_dtype under mixed precision)
            dtype = read.dtype if isinstance(read, torch.Tensor) else None
            weights[node.target] = params[node.target].detach().cpu().to(dtype).clone().requires_grad_(
                params[node.target].requires_grad)
        elif node.op == "get_attr" and node.target in buffers:
            weights[node.target] = buffers[node.target].detach().cpu().clone()
    inputs = flat_inputs(planned.captured, example_inputs, example_kwargs or {})
    cut = ContextPlan.from_dict(planned.plan.context)
    if axes.has_tp:
        proof = prove_context(planned.reference, emitted.parts.root, axes.cp, inputs, weights, rtol=rtol,
                              output_cuts=cut.output_cuts, seq=cut.seq, plan=planned.plan, tp=axes.tp)
    else:
        proof = prove_context(planned.reference, planned.context_graph, axes.cp, inputs, weights, rtol=rtol,
                              output_cuts=cut.output_cuts, seq=cut.seq)
    return dataclasses.replace(proof, plan=planned.plan)


def _emit(planned: PlanResult, axes: MeshAxes, tp_group: str | None, options: PlanOptions,
          keep_planned: bool = False) -> Emitted:
    """The tp collectives, the rewritten linears and the per-block graphs of a plan.

    ``tp_group`` names the tp process group in the emitted ops; a proof runs the code
    without resolving it, so any name serves there."""
    gm, sites, layout_plan = planned.captured.gm, planned.sites, planned.layout_plan
    planned_graph = copy_graph_module(gm) if keep_planned else None
    vocab = vocabularies(sites) if keep_planned else {}  # before the rewrite reads ids locally
    reduce_dtype = options.mp_policy.reduce_dtype if options.mp_policy is not None else None
    if tp_group is not None:
        with in_stage("layouts", gm.graph):
            insert_redistributes(gm, layout_plan, tp_group, reduce_dtype)
    with in_stage("transpose", gm.graph):
        rewrite_linears(gm, sites, layout_plan, tp_group, axes.tp, reduce_dtype)
    with in_stage("partition", gm.graph):
        parts = partition(gm, planned.captured.block_fqns)
    if not keep_planned:
        return Emitted(parts)
    subject = Subject(
        reference=planned.reference,
        planned=planned_graph,
        emitted=gm,
        root=parts.root,
        plan=planned.plan,
        tp=axes.tp,
        layouts=layout_plan.layouts,
        skip=frozenset(n.name for s in sites.all for n in {s.node, getattr(s, "output", s.node)}),
        vocabularies=vocab,
    )
    return Emitted(parts, subject)


def _proves(check, model: nn.Module, axes: MeshAxes) -> bool:
    """Whether ``autoshard(check=...)`` runs the proof: always for True, never for False;
    for ``"auto"`` when it costs little (see :data:`AUTO_CHECK_MAX_ELEMENTS`)."""
    if check not in (True, False, "auto"):
        raise ValueError(f"autoshard: check must be True, False or 'auto', got {check!r}")
    if check != "auto":
        return bool(check) and (axes.has_tp or axes.has_cp)
    if not (axes.has_tp or axes.has_cp) or parameters_on_meta(model):
        return False
    return sum(p.numel() for p in model.parameters()) <= AUTO_CHECK_MAX_ELEMENTS


def _as_plan(given) -> Plan | None:
    if given is None or isinstance(given, Plan):
        return given
    if isinstance(given, Mapping):
        return Plan.from_dict(given)
    raise ValueError(f"autoshard: `plan` must be a Plan or its dict, got {type(given).__name__}")


def _check_plan_mesh(given: Plan, axes: MeshAxes) -> Plan:
    """``given`` on this mesh: retargeted when made for another mesh shape, or a ValueError."""
    return retarget(given, axes.to_dict())


def _check_plan_params(given: Plan, param_shapes) -> None:
    missing = sorted(set(param_shapes) - set(given.params))
    extra = sorted(set(given.params) - set(param_shapes))
    if missing or extra:
        raise ValueError(
            f"autoshard: the plan does not match the model's parameters "
            f"(missing from plan: {missing or 'none'}; not in model: {extra or 'none'})"
        )
    for fqn, entry in given.params.items():
        if entry.shape and tuple(entry.shape) != tuple(param_shapes[fqn]):
            raise ValueError(
                f"autoshard: plan says '{fqn}' has shape {list(entry.shape)}, the model has "
                f"{list(param_shapes[fqn])}"
            )
        dp = dp_choice(entry.placements)
        allowed = (shard_on(1 if entry.role == Role.VOCAB_PARALLEL else 0), REPLICATED)
        if dp not in (None, *allowed):
            raise ValueError(
                f"autoshard: plan gives '{fqn}' ({entry.role}) dp placement '{dp}'; expected "
                f"{' or '.join(repr(str(a)) for a in allowed)}"
            )


def _check_plan_consistent(given: Plan, final: Plan) -> None:
    """Derived fields of an edited plan must match what its roles imply."""
    for fqn, want in final.params.items():
        got = given.params[fqn]
        if got.role != want.role or got.transposed != want.transposed or dict(got.placements) != dict(
            want.placements
        ):
            raise ValueError(
                f"autoshard: plan entry for '{fqn}' is inconsistent: it says role={got.role!r}, "
                f"transposed={got.transposed}, placements={placements_text(got.placements)}; its weight's "
                f"role implies role={want.role!r}, transposed={want.transposed}, "
                f"placements={placements_text(want.placements)}"
            )
