"""Planning runs: capture, plan, emit and prove, without a process group.

The one place the graph pipeline runs (``api`` is the public door over it; the mesh suggestion
and pipeline planning call it too, instead of reaching into the door's private functions):

capture -> [cut the sequence] -> discover -> normalize -> propagate -> alternatives -> placements (the plan)
-> layouts -> transpose -> partition -> [proof]

:func:`plan_result` runs the stages up to the plan, :func:`emit` those that write the sharded code,
and :func:`checked_on` plans, emits and proves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Mapping

import torch
import torch.fx as fx
import torch.nn as nn

from autoshard.core.errors import in_stage
from autoshard.core.mesh import CP, MeshAxes, axes_from_sizes, dp_choice, read_mesh
from autoshard.core.options import PlanOptions
from autoshard.core.sharding import REPLICATED, Role, placements_text, shard_on
from autoshard.driver.carry import check_activations_carry
from autoshard.driver.ep_axis import emit_experts, plan_experts
from autoshard.passes.alternatives import settle
from autoshard.passes.capture import CapturedGraph, capture, copy_graph_module
from autoshard.passes.contractions import contractions_as_linears
from autoshard.passes.discover import Sites, find_sites
from autoshard.passes.normalize import (
    normalize,
    repeated_views_merged,
    unbound_views_as_splits,
    weights_on_the_right,
)
from autoshard.passes.partition import partition
from autoshard.passes.placements import build_plan
from autoshard.passes.propagate import LayoutPlan, propagate
from autoshard.passes.redistribute import insert_redistributes
from autoshard.passes.transpose import rewrite_linears
from autoshard.plans.block_quant import with_quantized_gathers
from autoshard.plans.plan import Plan, mixed_precision_of
from autoshard.plans.retarget import retarget
from autoshard.proof.proof import Proof, Subject, as_read, prove, vocabularies
from autoshard.proof.rank_grid import RankGrid
from autoshard.runtime.graph_parts import Partitioned


def prove_on(model: nn.Module, axes: MeshAxes, example_inputs: tuple, example_kwargs: dict | None,
             options: PlanOptions, *, plan=None, captured: CapturedGraph | None = None, seed: int = 0,
             rtol: float | None = None) -> Proof:
    """:func:`check` on ``axes`` with ``options``; ``captured`` (this model captured with these
    inputs and options, see :func:`capture_for`) skips capturing again: the zoo proves one
    capture on several meshes."""
    if axes.has_cp or axes.has_ep:
        planned = plan_result(model, axes, example_inputs, example_kwargs, plan, options, keep_reference=True,
                              captured=captured)
        emitted = emit(planned, axes, "tp" if axes.has_tp else None, options, keep_planned=True)
        return prove_emitted(planned, emitted, model, example_inputs, example_kwargs, axes, seed=seed, rtol=rtol)
    return checked_on(model, axes, example_inputs, example_kwargs, options, plan=plan, captured=captured,
                      seed=seed, rtol=rtol).proof


def prove_emitted(planned: PlanResult, emitted: Emitted, model: nn.Module, example_inputs: tuple,
                  example_kwargs: dict | None, axes: MeshAxes, *, seed: int = 0, rtol: float | None = None) -> Proof:
    """The one proof of the code ``emitted`` for ``planned``, against the unsharded graph: every rank
    of the axes' grid simulated (:class:`~autoshard.proof.rank_grid.RankGrid`): the ep x cp x tp grid
    (:func:`prove_grid`) with a cp or an ep axis, else the tp ranks (:func:`~autoshard.proof.proof.prove`)."""
    if axes.has_cp or axes.has_ep:
        return prove_grid(planned, model, example_inputs, example_kwargs, axes, emitted, seed=seed, rtol=rtol)
    proof = prove(emitted.subject, model, example_inputs, example_kwargs, seed=seed, rtol=rtol)
    return dataclasses.replace(proof, plan=planned.plan)


def checked_on(model: nn.Module, axes: MeshAxes, example_inputs: tuple, example_kwargs: dict | None,
               options: PlanOptions, *, plan=None, captured: CapturedGraph | None = None, seed: int = 0,
               rtol: float | None = None, tp_group: str = "tp", keep_values: bool = False) -> Checked:
    """Plan, emit (the tp ops name their group ``tp_group``) and prove, without a process group;
    ``keep_values`` keeps the tensors the proof ran (:class:`~autoshard.proof.proof.ProofValues`)."""
    if axes.has_cp or axes.has_ep:
        raise NotImplementedError("autoshard: the per-node report of a tp proof does not cover a mesh with a 'cp' or "
                                  "'ep' axis; prove it with autoshard.check(model, mesh, example_inputs=...)")
    planned = plan_result(model, axes, example_inputs, example_kwargs, plan, options, keep_reference=True,
                    captured=captured)
    emitted = emit(planned, axes, tp_group if axes.has_tp else None, options, keep_planned=True)
    proof = prove(emitted.subject, model, example_inputs, example_kwargs, seed=seed, rtol=rtol,
                  keep_values=keep_values)
    return Checked(planned, emitted, dataclasses.replace(proof, plan=planned.plan))


def capture_for(model: nn.Module, example_inputs: tuple, example_kwargs: dict | None,
                options: PlanOptions, axes: MeshAxes) -> CapturedGraph:
    """The capture :func:`_plan` makes for ``axes`` (mixed precision captures in ``param_dtype``
    only with a dp axis), to plan on several meshes from one trace."""
    compute_dtype = _compute_dtype(model, axes, options)
    if compute_dtype is None:
        return capture(model, example_inputs, example_kwargs, options.dynamic_shapes, None, options.trace_blocks_once)
    policy = options.mp_policy
    return capture(model, example_inputs, example_kwargs, options.dynamic_shapes, compute_dtype,
                   options.trace_blocks_once, options.buffer_dtype, output_dtype=policy.output_dtype,
                   cast_inputs=policy.cast_forward_inputs)


def _compute_dtype(model: nn.Module, axes: MeshAxes, options: PlanOptions):
    # a dynamo graph replayed node by node (the compile backend) holds FSDP2's casts in the graph itself
    return options.mp_policy.param_dtype if options.mp_policy is not None and axes.has_dp else None


def mesh_axes(mesh) -> MeshAxes:
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


@dataclasses.dataclass(frozen=True)
class Emitted:
    """The sharded code before any tensor is placed: ``parts`` (root and block graphs), and
    with ``keep_planned`` the :class:`~autoshard.proof.proof.Subject` a proof runs."""

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
    saved = as_plan(given)
    given = _check_plan_mesh(saved, axes) if saved is not None else None
    if captured is None:
        captured = capture_for(model, example_inputs, example_kwargs, options, axes)
    else:
        captured = dataclasses.replace(captured, gm=copy_graph_module(captured.gm))
    reference = copy_graph_module(captured.gm) if keep_reference else None
    context = None
    if options.context_output != "whole" and not axes.has_cp:
        raise ValueError("autoshard: context_output configures context parallelism, and this mesh has no 'cp' axis")
    if axes.has_cp:
        context = _cut_sequence(captured, axes, options, example_inputs)
    with in_stage("discover", captured.gm.graph):
        repeated_views_merged(captured.gm, captured.block_fqns)
        unbound_views_as_splits(captured.gm.graph)
        contractions_as_linears(captured.gm, captured.param_shapes)
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
    if axes.has_ep:
        with in_stage("experts", captured.gm.graph):
            final = plan_experts(final, captured.gm, captured.param_shapes, axes)
    if options.mp_policy is not None:
        final = dataclasses.replace(final, mixed_precision=mixed_precision_of(options.mp_policy))
    if options.all_gather_quant is not None:
        final = with_quantized_gathers(final, axes, options.all_gather_quant)
    if captured.trace_note:
        final = dataclasses.replace(final, trace_note=captured.trace_note)
    if captured.branches:
        final = dataclasses.replace(final, branches=captured.branches)
    if context is not None:
        from autoshard.passes.cut_sequence import cp_traffic

        traffic = cp_traffic(captured.gm, layout_plan.layouts, axes.tp)
        final = dataclasses.replace(final, context=dataclasses.replace(context, collectives=traffic))
    if given is not None:
        _check_plan_consistent(given, final)
        if given is not saved:
            check_activations_carry(saved, final, captured, sites, roles, dp_placements, options)
    return PlanResult(final, captured, sites, layout_plan, reference)


def _cut_sequence(captured: CapturedGraph, axes: MeshAxes, options: PlanOptions, example_inputs: tuple):
    """The captured graph rewritten into one cp rank's code (see :mod:`autoshard.passes.cut_sequence`)."""
    from autoshard.passes.cut_sequence import SEQ_DIM, cut_sequence

    if options.dynamic_shapes is not None:
        raise NotImplementedError("autoshard: context parallelism cuts a sequence of fixed length; capture with "
                                  "dynamic_shapes=None")
    first = example_inputs[0] if example_inputs else None
    if not isinstance(first, torch.Tensor) or first.dim() <= SEQ_DIM:
        what = list(first.shape) if isinstance(first, torch.Tensor) else type(first).__name__
        raise ValueError("autoshard: context parallelism cuts dim 1 ([batch, seq, ...]) of the first input, and "
                         f"the first example input is {what}")
    group = axes.group_name(CP) if axes.mesh is not None else CP
    with in_stage("cut the sequence", captured.gm.graph):
        return cut_sequence(captured.gm, int(first.shape[SEQ_DIM]), axes.cp, group, set(captured.param_shapes),
                            local_outputs=options.context_output == "local")


def _proof_weights(planned: PlanResult, model: nn.Module) -> dict:
    """The model's own parameters (copies, in the dtype the graph reads them) and buffers, by the
    reference graph's ``get_attr`` targets."""
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
            weights[node.target] = as_read(buffers[node.target].detach().cpu().clone(), node.meta.get("val"))
    return weights


def prove_grid(planned: PlanResult, model: nn.Module, example_inputs: tuple, example_kwargs: dict | None,
               axes: MeshAxes, emitted: Emitted, *, seed: int = 0, rtol: float | None = None):
    """The code ``emitted`` for a mesh with a cp or an ep axis (its tp code, or a pipeline's stages
    called in order), every rank of the ``ep x cp x tp`` grid simulated, each ep rank on a batch of its
    own, against the unsharded graph (see :mod:`autoshard.proof.grid_proof`)."""
    from autoshard.proof.grid_proof import prove_on_grid
    from autoshard.runtime.pipeline_stages import flat_inputs

    inputs = flat_inputs(planned.captured, example_inputs, example_kwargs or {})
    cut = planned.plan.context
    grid = RankGrid.of(ep=axes.ep, cp=axes.cp, tp=axes.tp)
    return prove_on_grid(planned.reference, emitted.parts.root, planned.plan, grid, inputs,
                         _proof_weights(planned, model), seed=seed, rtol=rtol,
                         output_cuts=cut.output_cuts if cut is not None else (), seq=cut.seq if cut is not None else 0)


def emit(planned: PlanResult, axes: MeshAxes, tp_group: str | None, options: PlanOptions,
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
    if axes.has_ep:
        with in_stage("experts", gm.graph):
            emit_experts(gm, planned.captured.param_shapes, planned.plan, axes)
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


def as_plan(given) -> Plan | None:
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
