"""The contract every mesh axis keeps, and the data planning's stages hand on.

The driver (:mod:`autoshard.driver.planning`, :mod:`autoshard.driver.entry_points`) runs the stages
of planning and sharding; in each it calls the axes of one list
(:data:`autoshard.driver.axis_list.AXES`, in mesh order) through the hooks of :class:`Axis`, and
names none of them. What an axis is lives in its own module here: adding one is a module and a line
in that list.

The hooks, in the order the driver calls them (a hook an axis does not need keeps the default,
which does nothing):

- ``check``: every axis, before planning: refuse what the mesh and the user's options cannot do
  together; an axis the mesh lacks refuses the options that configure it.
- ``plan_options``: every axis: the planning options as this mesh has them.
- ``capture_dtype``: the dtype the graph is captured in, where the axis's runtime casts the
  parameters (FSDP2's ``param_dtype``).
- ``cut``: outer axis first, before sites are found: rewrite the captured graph into one rank's code
  (cp cuts the sequence); returns the axis's record of the cut.
- ``layouts``: the one axis that cuts inside ops (tp) plans every value's layout: normalize,
  propagate (with a saved plan's roles, if given), and the alternatives.
- ``check_saved``: a saved plan's entries the axis cannot apply.
- ``record``: inner axis first, after the dense plan: the plan with the axis's typed record and
  placements (data only, serialised with the plan).
- ``check_carried``: a saved plan made for other sizes: whether it still holds on this mesh.
- ``emit``: inner axis first: rewrite the emitted code (the tp collectives and the transposed
  linears, then ep's exchanges around the experts' code).
- ``grid``: the axis's ranks on the proof's grid (:class:`~autoshard.proof.rank_grid.RankGrid`);
  ``proven_on_grid``: whether its ranks need data of their own (the grid proof).
- ``on_ranks``: once the parameters are placed: what the sharded module carries for this axis.

An outer axis (``wraps``: pp) owns the whole run of the others on its sub-mesh: the driver hands it
:class:`Inner` (plan, emit, prove, agree and the proof's grid, on the stage mesh) instead of
running them itself.

Traffic is predicted from the plan's records alone (:mod:`autoshard.plans.predict`): a saved plan
is costed without any of this code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

import torch.fx as fx

from autoshard.core.mesh import MeshAxes, dp_choice
from autoshard.core.options import Options, PlanOptions
from autoshard.core.sharding import Role
from autoshard.passes.capture import CapturedGraph
from autoshard.passes.discover import Sites
from autoshard.passes.layout_plan import LayoutPlan
from autoshard.plans.plan import Plan
from autoshard.proof.proof import Proof, Subject
from autoshard.proof.rank_grid import RankGrid
from autoshard.runtime.graph_parts import Partitioned

# The key in a GraphModule's ``meta`` that marks it emitted: emission rewrites the planned graph in
# place, so a PlanResult is emitted once (its graph handed over, see :class:`PlanResult`).
EMITTED = "autoshard_emitted"


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """A plan with what it was made from: the captured graph (normalized), the sites and
    propagation's layouts. ``reference`` is a copy of the graph as captured, before any pass rewrote
    it (kept only for a proof).

    The graph is handed over, not shared: emission rewrites ``captured.gm`` in place and marks it, and
    a second emission of the same result is refused (plan again, or plan on a copy of a capture).
    The sites and layouts name this graph's nodes, so they go with it."""

    plan: Plan
    captured: CapturedGraph
    sites: Sites
    layout_plan: LayoutPlan
    reference: fx.GraphModule | None = None


@dataclasses.dataclass(frozen=True)
class Emitted:
    """The sharded code before any tensor is placed: ``parts`` (root and block graphs), and with
    ``keep_planned`` the :class:`~autoshard.proof.proof.Subject` a proof runs."""

    parts: Partitioned
    subject: Subject | None = None


@dataclasses.dataclass(frozen=True)
class Kept:
    """What a saved plan fixes when it is applied: each linear weight's role (an expert weight's only
    where the plan replicated it: its layout is planned again) and each parameter's choice on the
    FSDP shard axis. Planning decides everything else again on the model's graph."""

    roles: dict
    shard_choices: dict

    @classmethod
    def of(cls, saved: Plan, sites: Sites) -> Kept:
        weights = {s.weight_fqn for s in sites.all}
        experts = {s.weight_fqn for s in sites.experts}
        roles = {fqn: p.role for fqn, p in saved.params.items() if fqn in weights}
        roles |= {fqn: p.role for fqn, p in saved.params.items() if fqn in experts and p.role == Role.REPLICATE}
        choices = {fqn: choice for fqn, p in saved.params.items() if (choice := dp_choice(p.placements))}
        return cls(roles, choices)


class Inner(Protocol):
    """The run of every axis but an outer one, on a mesh without it: what the driver hands to an
    axis that ``wraps`` the others (pp plans, emits and proves each stage's code this way)."""

    def plan(self, model, axes: MeshAxes, example_inputs: tuple, example_kwargs: dict | None, given,
             options: PlanOptions, keep_reference: bool = False) -> PlanResult: ...

    def emit(self, planned: PlanResult, axes: MeshAxes, options: PlanOptions,
             keep_planned: bool = False) -> Emitted: ...

    def prove(self, planned: PlanResult, emitted: Emitted, model, example_inputs: tuple,
              example_kwargs: dict | None, axes: MeshAxes, *, seed: int = 0,
              rtol: float | None = None) -> Proof: ...

    def agree(self, plan: Plan, inputs, axes: MeshAxes, parts: Partitioned | None = None) -> None: ...

    def grid(self, axes: MeshAxes) -> RankGrid: ...

    def proves(self, check, model, axes: MeshAxes) -> bool: ...


def as_plan(given) -> Plan | None:
    """A saved plan as given (a :class:`Plan` or its dict), or None."""
    if given is None or isinstance(given, Plan):
        return given
    if isinstance(given, Mapping):
        return Plan.from_dict(given)
    raise ValueError(f"autoshard: `plan` must be a Plan or its dict, got {type(given).__name__}")


class Axis:
    """One mesh axis's part in each stage (see the module docstring). ``names``: the mesh dims the
    axis owns (HSDP's data axis owns two)."""

    names: tuple[str, ...] = ()
    wraps: bool = False  # runs the other axes itself, on its sub-mesh (pp)
    proven_on_grid: bool = False  # its code is proven by the grid proof, each rank on its own data

    def present(self, axes: MeshAxes) -> bool:
        return any(name in axes.names for name in self.names)

    def takes_part(self, axes: MeshAxes) -> bool:
        """Whether the planning and emission hooks run on ``axes`` (by default: the mesh has it)."""
        return self.present(axes)

    def group(self, axes: MeshAxes, name: str | None = None) -> str:
        """The process group the emitted ops of this axis name: the mesh's, or on sizes alone the
        axis's name (a proof runs the code without resolving it)."""
        name = name or self.names[0]
        return axes.group_name(name) if axes.mesh is not None else name

    def check(self, axes: MeshAxes, chosen: Options, sharding: bool) -> None:
        """Refuse ``chosen`` options that ``axes`` cannot honour (``sharding``: ``autoshard()``, with a
        process group, rather than ``plan()`` or ``check()``)."""

    def plan_options(self, options: PlanOptions, axes: MeshAxes) -> PlanOptions:
        return options

    def capture_dtype(self, options: PlanOptions, axes: MeshAxes):
        return None

    def cut(self, captured: CapturedGraph, axes: MeshAxes, options: PlanOptions, example_inputs: tuple):
        return None

    def layouts(self, captured: CapturedGraph, sites: Sites, axes: MeshAxes, options: PlanOptions,
                kept: Kept | None) -> LayoutPlan | None:
        """Every value's layout on this mesh, from the one axis that cuts values inside ops; None
        from the others."""
        return None

    def check_saved(self, saved: Plan, axes: MeshAxes) -> None:
        """Refuse a saved plan whose entries this axis cannot apply (checked after its parameters are
        matched to the model's)."""

    def record(self, plan: Plan, planned: PlanResult, axes: MeshAxes, options: PlanOptions, cut) -> Plan:
        return plan

    def check_carried(self, saved: Plan, final: Plan, planned: PlanResult, kept: Kept, options: PlanOptions) -> None:
        """``saved``, made for other sizes and applied here as ``final``: refuse it if it does not hold."""

    def emit(self, gm: fx.GraphModule, planned: PlanResult, axes: MeshAxes, options: PlanOptions) -> None:
        pass

    def grid(self, axes: MeshAxes) -> dict[str, int]:
        return {}

    def on_ranks(self, sharded, plan: Plan, axes: MeshAxes) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self.names)})"
