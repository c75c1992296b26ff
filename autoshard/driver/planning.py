"""Planning runs: capture, plan, emit and prove, without a process group.

The one place the graph pipeline runs (``api`` is the public door over it; the mesh suggestion
and an outer axis call it too, instead of reaching into the door's private functions):

capture -> [axes cut the graph] -> discover -> [layouts: normalize, propagate, alternatives] -> placements
(the plan) -> [axes record] -> [axes emit] -> partition -> [proof on the axes' grid]

Every stage in brackets is each axis's hook (:class:`~autoshard.axes.contract.Axis`), run for the
axes of :data:`~autoshard.driver.axis_list.AXES`: this module names no axis. :func:`plan_result`
runs the stages up to the plan, :func:`emit` those that write the sharded code, and
:func:`checked_on` plans, emits and proves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Mapping

import torch
import torch.nn as nn

from autoshard.axes.contract import EMITTED, Axis, Emitted, Kept, PlanResult, as_plan
from autoshard.core.errors import in_stage
from autoshard.core.mesh import MeshAxes, axes_from_sizes, read_mesh
from autoshard.core.options import PlanOptions
from autoshard.core.sharding import placements_text
from autoshard.driver.axis_list import AXES
from autoshard.passes.capture import CapturedGraph, capture, copy_graph_module
from autoshard.passes.contractions import contractions_as_linears
from autoshard.passes.discover import find_sites
from autoshard.passes.normalize import repeated_views_merged, unbound_views_as_splits, weights_on_the_right
from autoshard.passes.partition import partition
from autoshard.passes.placements import build_plan
from autoshard.plans.plan import Plan, mixed_precision_of
from autoshard.plans.retarget import retarget
from autoshard.proof.proof import Proof, Subject, as_read, prove, vocabularies
from autoshard.proof.rank_grid import RankGrid

__all__ = ["AXES", "Checked", "Emitted", "PlanResult", "as_plan", "capture_for", "checked_on", "emit", "mesh_axes",
           "plan_result", "proof_grid", "prove_emitted", "prove_on", "taking_part"]


def taking_part(axes: MeshAxes) -> tuple[Axis, ...]:
    """The axes whose planning and emission hooks run on ``axes``, outer first."""
    return tuple(axis for axis in AXES if axis.takes_part(axes))


def outer_axis(axes: MeshAxes) -> Axis | None:
    """The axis of ``axes`` that runs the others itself on its sub-mesh (pp), if it has one."""
    return next((axis for axis in AXES if axis.wraps and axis.present(axes)), None)


def grid_sizes(axes: MeshAxes) -> dict[str, int]:
    """The mesh axes whose ranks a proof simulates side by side, with their sizes, in mesh order."""
    sizes = {}
    for axis in taking_part(axes):
        sizes |= axis.grid(axes)
    return sizes


def proof_grid(axes: MeshAxes) -> RankGrid:
    """The ranks a proof of code for ``axes`` simulates side by side."""
    return RankGrid.of(**grid_sizes(axes))


def _on_grid(axes: MeshAxes) -> list[Axis]:
    return [axis for axis in taking_part(axes) if axis.proven_on_grid]


def prove_on(model: nn.Module, axes: MeshAxes, example_inputs: tuple, example_kwargs: dict | None,
             options: PlanOptions, *, plan=None, captured: CapturedGraph | None = None, seed: int = 0,
             rtol: float | None = None) -> Proof:
    """:func:`check` on ``axes`` with ``options``; ``captured`` (this model captured with these
    inputs and options, see :func:`capture_for`) skips capturing again: the zoo proves one
    capture on several meshes."""
    planned = plan_result(model, axes, example_inputs, example_kwargs, plan, options, keep_reference=True,
                          captured=captured)
    emitted = emit(planned, axes, options, keep_planned=True)
    return prove_emitted(planned, emitted, model, example_inputs, example_kwargs, axes, seed=seed, rtol=rtol)


def prove_emitted(planned: PlanResult, emitted: Emitted, model: nn.Module, example_inputs: tuple,
                  example_kwargs: dict | None, axes: MeshAxes, *, seed: int = 0, rtol: float | None = None) -> Proof:
    """The one proof of the code ``emitted`` for ``planned``, against the unsharded graph: every rank
    of the axes' grid simulated (:class:`~autoshard.proof.rank_grid.RankGrid`): the grid proof
    (:func:`prove_grid`) where an axis on it gives each rank data of its own, else the per-node proof
    (:func:`~autoshard.proof.proof.prove`)."""
    if _on_grid(axes):
        return prove_grid(planned, model, example_inputs, example_kwargs, axes, emitted, seed=seed, rtol=rtol)
    proof = prove(emitted.subject, model, example_inputs, example_kwargs, seed=seed, rtol=rtol)
    return dataclasses.replace(proof, plan=planned.plan)


def checked_on(model: nn.Module, axes: MeshAxes, example_inputs: tuple, example_kwargs: dict | None,
               options: PlanOptions, *, plan=None, captured: CapturedGraph | None = None, seed: int = 0,
               rtol: float | None = None, keep_values: bool = False) -> Checked:
    """Plan, emit and prove, without a process group; ``keep_values`` keeps the tensors the proof ran
    (:class:`~autoshard.proof.proof.ProofValues`)."""
    on_grid = _on_grid(axes)
    if on_grid:
        names = " or ".join(repr(axis.names[0]) for axis in on_grid)
        raise NotImplementedError(f"autoshard: the per-node report of a proof does not cover a mesh with a {names} "
                                  "axis; prove it with autoshard.check(model, mesh, example_inputs=...)")
    planned = plan_result(model, axes, example_inputs, example_kwargs, plan, options, keep_reference=True,
                          captured=captured)
    emitted = emit(planned, axes, options, keep_planned=True)
    proof = prove(emitted.subject, model, example_inputs, example_kwargs, seed=seed, rtol=rtol,
                  keep_values=keep_values)
    return Checked(planned, emitted, dataclasses.replace(proof, plan=planned.plan))


def proves(check, model: nn.Module, axes: MeshAxes, max_elements: int) -> bool:
    """Whether ``autoshard(check=...)`` runs the proof: always for True, never for False; for
    ``"auto"`` when it costs little (at most ``max_elements`` parameter elements, none on meta). A
    mesh none of whose axes puts ranks on the proof's grid (dp alone) has nothing to prove."""
    from autoshard.core.meta_model import parameters_on_meta

    if check not in (True, False, "auto"):
        raise ValueError(f"autoshard: check must be True, False or 'auto', got {check!r}")
    simulated = bool(grid_sizes(axes))
    if check != "auto":
        return bool(check) and simulated
    if not simulated or parameters_on_meta(model):
        return False
    return sum(p.numel() for p in model.parameters()) <= max_elements


def capture_for(model: nn.Module, example_inputs: tuple, example_kwargs: dict | None,
                options: PlanOptions, axes: MeshAxes) -> CapturedGraph:
    """The capture :func:`plan_result` makes for ``axes`` (in the dtype an axis's runtime casts the
    parameters to, if one does), to plan on several meshes from one trace."""
    compute_dtype = next((d for axis in taking_part(axes) if (d := axis.capture_dtype(options, axes)) is not None),
                         None)
    if compute_dtype is None:
        return capture(model, example_inputs, example_kwargs, options.dynamic_shapes, None, options.trace_blocks_once)
    policy = options.mp_policy
    return capture(model, example_inputs, example_kwargs, options.dynamic_shapes, compute_dtype,
                   options.trace_blocks_once, options.buffer_dtype, output_dtype=policy.output_dtype,
                   cast_inputs=policy.cast_forward_inputs)


def mesh_axes(mesh) -> MeshAxes:
    if isinstance(mesh, Mapping):
        return axes_from_sizes(dict(mesh))
    return read_mesh(mesh)


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
    parts = taking_part(axes)
    for axis in AXES:
        options = axis.plan_options(options, axes)
    if not isinstance(example_inputs, tuple):
        raise ValueError(f"autoshard: `example_inputs` must be a tuple, got {type(example_inputs).__name__}")
    saved = as_plan(given)
    given = retarget(saved, axes.to_dict()) if saved is not None else None  # a plan made for another mesh shape
    if captured is None:
        captured = capture_for(model, example_inputs, example_kwargs, options, axes)
    else:
        captured = dataclasses.replace(captured, gm=copy_graph_module(captured.gm))
    reference = copy_graph_module(captured.gm) if keep_reference else None
    cuts = {axis: axis.cut(captured, axes, options, example_inputs) for axis in parts}
    with in_stage("discover", captured.gm.graph):
        repeated_views_merged(captured.gm, captured.block_fqns)
        unbound_views_as_splits(captured.gm.graph)
        contractions_as_linears(captured.gm, captured.param_shapes)
        weights_on_the_right(captured.gm, captured.param_shapes)
        sites = find_sites(captured.gm, captured.param_shapes)
    kept = None
    if given is not None:
        _check_plan_params(given, captured.param_shapes)
        for axis in parts:
            axis.check_saved(given, axes)
        kept = Kept.of(given, sites)
    layouts = [found for axis in parts if (found := axis.layouts(captured, sites, axes, options, kept)) is not None]
    assert len(layouts) == 1, f"{len(layouts)} axes planned the layouts; one must"
    layout_plan = layouts[0]
    with in_stage("plan", captured.gm.graph):
        final = build_plan(captured, sites, layout_plan, axes, kept.shard_choices if kept else None)
    if options.mp_policy is not None:
        final = dataclasses.replace(final, mixed_precision=mixed_precision_of(options.mp_policy))
    planned = PlanResult(final, captured, sites, layout_plan, reference)
    for axis in reversed(parts):  # inner first: an outer axis records on what the inner ones placed
        final = axis.record(final, planned, axes, options, cuts[axis])
        planned = dataclasses.replace(planned, plan=final)
    if captured.trace_note:
        final = dataclasses.replace(final, trace_note=captured.trace_note)
    if captured.branches:
        final = dataclasses.replace(final, branches=captured.branches)
    planned = dataclasses.replace(planned, plan=final)
    if given is not None:
        _check_plan_consistent(given, final)
        if given is not saved:
            for axis in parts:
                axis.check_carried(saved, final, planned, kept, options)
    return planned


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
    """The code ``emitted`` (or a pipeline's stages called in order), every rank of the axes' grid
    simulated, each on the data its axes give it, against the unsharded graph (see
    :mod:`autoshard.proof.grid_proof`)."""
    from autoshard.proof.grid_proof import prove_on_grid
    from autoshard.runtime.pipeline_stages import flat_inputs

    inputs = flat_inputs(planned.captured, example_inputs, example_kwargs or {})
    grid = proof_grid(axes)
    return prove_on_grid(planned.reference, emitted.parts.root, planned.plan, grid, inputs,
                         _proof_weights(planned, model), seed=seed, rtol=rtol)


def emit(planned: PlanResult, axes: MeshAxes, options: PlanOptions, keep_planned: bool = False) -> Emitted:
    """The sharded code of a plan: each axis's rewrite of the planned graph, inner axis first (tp's
    collectives and the transposed linears, then the exchanges that wrap the experts' code), and the
    per-block graphs. The graph is rewritten in place, so a :class:`PlanResult` is emitted once.

    The ops name each axis's process group (on sizes alone, the axis's name: a proof runs the code
    without resolving it)."""
    gm, sites = planned.captured.gm, planned.sites
    if gm.meta.get(EMITTED):
        raise RuntimeError("autoshard: this plan's graph was emitted already (emission rewrites it in place); "
                           "plan again to emit again")
    planned_graph = copy_graph_module(gm) if keep_planned else None
    gm.meta[EMITTED] = True
    vocab = vocabularies(sites) if keep_planned else {}  # before the rewrite reads ids locally
    for axis in reversed(taking_part(axes)):
        axis.emit(gm, planned, axes, options)
    with in_stage("partition", gm.graph):
        parts = partition(gm, planned.captured.block_fqns)
    if not keep_planned:
        return Emitted(parts)
    subject = Subject.of(planned.reference, planned_graph, gm, parts.root, planned.plan, planned.layout_plan, sites,
                         vocab)
    return Emitted(parts, subject)


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
