"""The plan: how every parameter of a model is stored and sharded.

A :class:`Plan` is plain data keyed by the *original* parameter FQNs and by
mesh axis names, with placements written on the *stored* tensor's dims in
DTensor's compact vocabulary (``S(0)``, ``S(1)``, ``R``). It holds no graph
nodes, so it prints, serializes to JSON (``to_dict``/``from_dict``) and can
be edited and handed back to ``autoshard(..., plan=...)``.

Roles
-----
``colwise``       linear weight stored ``[in, out]`` (transposed if the model
                  stores ``[out, in]``), or an embedding table ``[num, dim]``;
                  tp shards the output dim (``S(1)``).
``rowwise``       linear weight stored ``[out, in]``; tp shards the input dim
                  (``S(1)``); the output is partial and all-reduced once.
``colwise_bias``  bias of a colwise linear: tp ``S(0)``, replicated over dp.
``rowwise_bias``  bias of a rowwise linear, added after the all-reduce.
``vocab_parallel`` an embedding table tied to the LM head, stored
                  ``[vocab, dim]``: tp cuts the vocabulary rows (``S(0)``),
                  FSDP cuts dim 1 (``S(1)``); the lookup is masked to the
                  local rows and all-reduced, the head is colwise.
``sharded``       a parameter that is no linear's weight but is read sharded:
                  the weight of a norm over a tp-sharded width, or a stacked
                  mixture-of-experts weight ``[E, out, in]`` (tp cuts ``out``
                  for gate/up, ``in`` for down; FSDP cuts the experts). Stored
                  cut over tp on the dim its placement names, so no step cuts
                  it or gathers its gradient.
``replicate``     everything else (norm weights, a linear left unsharded):
                  tp ``R``, sharded over dp like any FSDP parameter.

Editable: a linear weight's role (``colwise``/``rowwise``/``replicate``; its
bias follows) and any parameter's dp placement (``S(0)`` FSDP-sharded or
``R`` replicated with an all-reduce of its gradient). Everything else is
derived and checked when the plan is applied.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from torch.distributed.tensor.placement_types import Placement

from autoshard.core.mesh import axes_from_sizes, dp_choice
from autoshard.core.sharding import (
    Collective,
    Role,
    Why,
    as_placement,
    dp_padding,
    placement_dim,
    placements_text,
    rank_shape,
)
from autoshard.plans.block_quant import BlockQuant, TileQuant
from autoshard.plans.context_plan import ContextPlan
from autoshard.plans.ep_choice import ExpertChoice
from autoshard.plans.export import to_hf_tp_plan, to_parallelize_plan
from autoshard.plans.predict import predicted_comm, tp_traffic_by_unit
from autoshard.plans.retarget import retarget
from autoshard.plans.stage_costs import PipelineStages

# 2: collectives are records (kind, direction, subject, cause, sharing); 1 (still loaded): prose
PLAN_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)

ROLES = tuple(Role)


@dataclasses.dataclass(frozen=True)
class ParamSharding:
    """How one parameter is stored and placed.

    ``shape`` is the original shape, ``stored_shape`` the shape of the stored
    (possibly transposed) global tensor that ``placements`` refer to.
    ``unit`` is the FSDP unit (block FQN, ``""`` for the root) whose
    all-gather carries it. ``collectives`` are the tp collectives the plan
    inserts because of this parameter's linear or embedding. ``sections``
    (a fused q|k|v or gate|up projection) are the output sections the stored
    tp-sharded dim is permuted by, so each rank holds its share of each one.

    ``placements`` are DTensor placements per mesh axis name; an entry built
    or edited with their text (``"R"``, ``"S(1)"``) or a role's name holds
    them as ``Placement`` and :class:`Role` all the same.
    """

    role: Role
    shape: tuple[int, ...]
    transposed: bool
    placements: Mapping[str, Placement]
    unit: str = ""
    collectives: tuple[Collective, ...] = ()
    note: str = ""
    sections: tuple[int, ...] = ()
    gather: TileQuant | None = None  # with a quantized all-gather: its tile and blocks, or why not
    why: Why = Why()  # the decisions ``note`` is rendered from (for this plan's mesh)
    # fused sections every tp rank holds whole (k/v heads fewer than tp), their columns repeated
    # once per rank in the stored tensor (``duplicated`` extra columns), and the original columns
    # the sections read in order as [start, stop) runs (empty: in order)
    whole_sections: tuple[int, ...] = ()
    section_runs: tuple[int, ...] = ()
    duplicated: int = 0

    def __post_init__(self):
        object.__setattr__(self, "placements", {str(a): as_placement(p) for a, p in self.placements.items()})
        if self.role not in ROLES:
            known = ", ".join(repr(str(r)) for r in ROLES)
            raise ValueError(f"autoshard: unknown role {self.role!r}; one of {known}")
        object.__setattr__(self, "role", Role(self.role))

    def sharded_dim(self, axis: str) -> int | None:
        """The stored dim ``axis`` cuts, or None when replicated over it."""
        return placement_dim(self.placements.get(axis))

    @property
    def stored_shape(self) -> tuple[int, ...]:
        shape = tuple(reversed(self.shape)) if self.transposed else self.shape
        if self.duplicated:
            dim = self.sharded_dim("tp")
            shape = (*shape[:dim], shape[dim] + self.duplicated, *shape[dim + 1:])
        return shape

    @property
    def fused(self) -> FusedSections | None:
        """The fused sections of the stored tp-sharded dim, if any."""
        return FusedSections(self.sections, self.whole_sections, self.section_runs) if self.sections else None

    def to_dict(self) -> dict:
        return {
            "role": self.role,
            "shape": list(self.shape),
            "transposed": self.transposed,
            "placements": placements_text(self.placements),
            "unit": self.unit,
            "collectives": [c.to_dict() for c in self.collectives],
            "note": self.note,
            "sections": list(self.sections),
        } | self._sections_dict() | ({"gather": self.gather.to_dict()} if self.gather is not None else {}) | (
            {"why": self.why.to_dict()} if self.why != Why() else {})

    def _sections_dict(self) -> dict:
        if not self.whole_sections and not self.section_runs:
            return {}
        return {"whole_sections": list(self.whole_sections), "section_runs": list(self.section_runs),
                "duplicated": self.duplicated}

    @classmethod
    def from_dict(cls, fqn: str, data: Mapping, dp: int = 1) -> ParamSharding:
        """``dp``: the plan's dp size. A plan saved without ``why`` keeps its note as it was
        written (minus FSDP's padding, which is recomputed for each mesh)."""
        try:
            role = data["role"]
            transposed = bool(data["transposed"])
            placements = {str(a): as_placement(p) for a, p in data["placements"].items()}
        except (KeyError, AttributeError, TypeError) as err:
            raise ValueError(f"autoshard: plan entry for '{fqn}' lacks {err}") from err
        except ValueError as err:
            raise ValueError(f"autoshard: plan entry for '{fqn}': {err}") from err
        if role not in ROLES:
            known = ", ".join(repr(str(r)) for r in ROLES)
            raise ValueError(f"autoshard: plan entry for '{fqn}' has unknown role {role!r}; one of {known}")
        shape = tuple(int(n) for n in data.get("shape", ()))
        note = str(data.get("note", ""))
        if "why" in data:
            why = Why.from_dict(data["why"])
        else:
            padding = dp_padding(shape, transposed, dp_choice(placements), dp)
            why = Why(about=note.removesuffix(padding).removesuffix("; ") if padding else note)
        return cls(
            role=Role(role),
            shape=shape,
            transposed=transposed,
            placements=placements,
            unit=str(data.get("unit", "")),
            collectives=tuple(Collective.from_dict(c) for c in data.get("collectives", ())),
            note=note,
            sections=tuple(int(n) for n in data.get("sections", ())),
            whole_sections=tuple(int(n) for n in data.get("whole_sections", ())),
            section_runs=tuple(int(n) for n in data.get("section_runs", ())),
            duplicated=int(data.get("duplicated", 0)),
            gather=TileQuant.from_dict(data["gather"]) if data.get("gather") else None,
            why=why,
        )


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sharding of every parameter over a ``dp`` x ``tp`` mesh.

    ``units`` are the FSDP units in forward order (``""`` is the root).
    ``activations`` lists the tp collectives on activations that no single
    parameter explains (e.g. gathering a value for an op without a layout rule).
    """

    mesh: Mapping[str, int]
    params: Mapping[str, ParamSharding]
    units: tuple[str, ...] = ()
    activations: tuple[Collective, ...] = ()
    version: int = PLAN_VERSION
    activation_units: tuple[str, ...] = ()  # the FSDP unit of each activation collective, in step
    functions: tuple[str, ...] = ()  # custom autograd.Functions checked and inlined
    # where tp stops: (unit, op and source line) of each sharded value gathered inside a block
    breaks: tuple[tuple[str, str], ...] = ()
    # the mixed-precision policy the model runs with: {"param_dtype": ..., "reduce_dtype": ...}
    mixed_precision: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # the block-quantized all-gather: BlockQuant.to_dict() ({} when FSDP gathers as stored)
    all_gather_quant: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # why the blocks were traced one by one although trace_blocks_once asked for one trace
    trace_note: str = ""
    # on a mesh with a pp axis: the stages, their costs and the schedule (see autoshard.plans.stage_costs)
    pipeline: PipelineStages | None = None
    # on a mesh with a cp axis: how the sequence is cut and what cp moves (autoshard.plans.context_plan)
    context: ContextPlan | None = None
    # parameters the model does not train (requires_grad=False: LoRA's base weights, a frozen embedding):
    # no gradient is made or reduced for them over tp or dp, and the optimizer holds no state for them
    frozen: tuple[str, ...] = ()
    # lines whose Python branch on a tensor's value was taken as the example took it, checked at run
    # time (autoshard.passes.specialize)
    branches: tuple[str, ...] = ()
    # on a mesh with an ep axis: each MoE layer split whole over ep or kept as dp keeps dense weights, and why
    experts: tuple[ExpertChoice, ...] = ()

    def ep_weights(self) -> frozenset[str]:
        """The expert weights this plan splits whole over ep (none without an ep axis)."""
        return frozenset(fqn for choice in self.experts if choice.choice == "ep" for fqn in choice.weights)

    def unit_of_activation(self, index: int) -> str:
        return self.activation_units[index] if index < len(self.activation_units) else ""

    def roles(self) -> dict[str, str]:
        return {fqn: p.role for fqn, p in self.params.items()}

    def for_mesh(self, sizes: Mapping[str, int]) -> Plan:
        """This plan on a mesh of other sizes (``{"tp": 4}``, ``{"dp": 4}``, ...), pure data.

        Roles and dp choices are kept; placements, tp collectives, fused
        sections and notes are derived again for the new mesh. A tp-sharded dim
        (or fused section) that does not divide by the new tp size is a
        ``ValueError`` naming the parameter; so is a plan without a tp axis
        retargeted to a mesh with one. See :mod:`autoshard.plans.retarget`.
        """
        return retarget(self, sizes)

    def predicted_comm(self, *, reshard_after_forward: bool = True, master_dtype=None, pp_rank: int | None = None):
        """``{axis: {kind: (num_collectives, wire_bytes)}}`` of one training step, computed from
        this plan alone (see :mod:`autoshard.plans.predict`). On a plan with pipeline stages, ``pp`` holds
        ``{"send": (messages, bytes)}`` of pp coordinate ``pp_rank`` (default: the rank that sends
        most), and the other axes' (tp, dp, ep) are those of one microbatch through the whole model."""
        import torch

        comm = predicted_comm(self, reshard_after_forward=reshard_after_forward,
                              master_dtype=master_dtype or torch.float32)
        if self.pipeline is not None:
            ranks = sorted({s.rank for s in self.pipeline.stages})
            rank = pp_rank if pp_rank is not None else max(ranks, key=lambda r: self.pipeline.pp_sends(r)[1])
            comm["pp"] = {"send": self.pipeline.pp_sends(rank)}
        return comm

    def to_parallelize_plan(self, model=None):
        """The equivalent ``parallelize_module`` plan and the weights it cannot express (see
        :mod:`autoshard.plans.export`); ``model`` gives module types, else they are inferred."""
        return to_parallelize_plan(self, model)

    def to_hf_tp_plan(self, model=None) -> dict[str, str]:
        """This plan's tp decisions as a Hugging Face ``tp_plan`` dict (see :mod:`autoshard.plans.export`)."""
        return to_hf_tp_plan(self, model)

    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "mesh": dict(self.mesh),
            "units": list(self.units),
            "params": {fqn: p.to_dict() for fqn, p in self.params.items()},
            "activations": [a.to_dict() for a in self.activations],
            "activation_units": list(self.activation_units),
            "functions": list(self.functions),
            "breaks": [list(b) for b in self.breaks],
            "mixed_precision": dict(self.mixed_precision),
        } | ({"all_gather_quant": dict(self.all_gather_quant)} if self.all_gather_quant else {}) | (
            {"trace_note": self.trace_note} if self.trace_note else {}) | (
            {"pipeline": self.pipeline.to_dict()} if self.pipeline is not None else {}) | (
            {"context": self.context.to_dict()} if self.context is not None else {}) | (
            {"frozen": list(self.frozen)} if self.frozen else {}) | (
            {"branches": list(self.branches)} if self.branches else {}) | (
            {"experts": [e.to_dict() for e in self.experts]} if self.experts else {})

    @classmethod
    def from_dict(cls, data: Mapping) -> Plan:
        version = data.get("version")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(
                f"autoshard: plan version {version!r} is not supported (expected one of {SUPPORTED_VERSIONS})"
            )
        mesh = data.get("mesh")
        if not isinstance(mesh, Mapping) or not mesh:
            raise ValueError("autoshard: plan has no 'mesh' mapping axis name to size")
        params = data.get("params")
        if not isinstance(params, Mapping):
            raise ValueError("autoshard: plan has no 'params' mapping")
        shards = axes_from_sizes(dict(mesh)).fsdp_degree
        return cls(
            mesh={str(a): int(n) for a, n in mesh.items()},
            params={fqn: ParamSharding.from_dict(fqn, p, shards) for fqn, p in params.items()},
            units=tuple(data.get("units", ())),
            # version 1 counted every activation line as one collective
            activations=tuple(
                dataclasses.replace(a, counted=True) if a.legacy_text else a
                for a in (Collective.from_dict(a) for a in data.get("activations", ()))
            ),
            version=PLAN_VERSION,
            activation_units=tuple(data.get("activation_units", ())),
            functions=tuple(data.get("functions", ())),
            breaks=tuple((str(u), str(w)) for u, w in data.get("breaks", ())),
            mixed_precision={str(k): str(v) for k, v in data.get("mixed_precision", {}).items()},
            all_gather_quant={str(k): str(v) for k, v in data.get("all_gather_quant", {}).items()},
            trace_note=str(data.get("trace_note", "")),
            pipeline=PipelineStages.from_dict(data["pipeline"]) if data.get("pipeline") else None,
            context=ContextPlan.from_dict(data["context"]) if data.get("context") else None,
            frozen=tuple(str(f) for f in data.get("frozen", ())),
            branches=tuple(str(b) for b in data.get("branches", ())),
            experts=tuple(ExpertChoice.from_dict(e) for e in data.get("experts", ())),
        )

    def __str__(self) -> str:
        axes = list(self.mesh)
        has_tp = "tp" in self.mesh
        spec = self.quant_spec()
        header = ["parameter", "role", "stored", *axes, "unit"] + (["all-gather"] if spec else []) + (
            ["tp collectives"] if has_tp else [])
        rows = []
        for fqn, p in self.params.items():
            stored = "x".join(map(str, p.stored_shape)) or "scalar"
            stored += " (T)" if p.transposed else ""
            stored += f" [{p.fused.text()}]" if p.sections else ""
            row = [fqn, p.role, stored, *(self._placement_cell(fqn, p, a) for a in axes), p.unit or "<root>"]
            if spec:
                row.append(p.gather.describe(spec) if p.gather is not None else "-")
            rows.append(row + (["; ".join(map(str, p.collectives)) or "-"] if has_tp else []))
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        # columns padded to a multiple of 8: a new or renamed parameter seldom moves them, so a
        # plan's diff (a snapshot test's) shows the rows that changed, not the whole table
        widths = [-(-w // 8) * 8 for w in widths[:-1]] + widths[-1:]

        def line(cells):
            return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

        mesh = " x ".join(f"{a}={n}" for a, n in self.mesh.items())
        out = [f"autoshard plan v{self.version}  mesh {mesh}  ({len(self.params)} parameters, "
               f"{len(self.units)} FSDP units)", line(header), line("-" * w for w in widths)]
        out += [line(r) for r in rows]
        notes = [(fqn, p.note) for fqn, p in self.params.items() if p.note]
        if notes:
            out.append("")
            out += [f"note {fqn}: {note}" for fqn, note in notes]
        if self.activations:
            out.append("")
            out += [f"activation: {a}" for a in self.activations]
        out.append("(T) stored transposed; placements are on the stored dims")
        if any(p.sections for p in self.params.values()):
            out.append("[a|b|c] fused output sections, permuted so each tp rank holds its share of each"
                       + ("; [b*] one every rank holds whole (its heads fewer than tp)"
                          if any(p.whole_sections for p in self.params.values()) else ""))
        out += list(self.functions)
        shard_axis = axes_from_sizes(dict(self.mesh)).shard_axis
        if shard_axis:
            out.append(
                f"{shard_axis}: each FSDP unit all-gathers its S(0) parameters before forward (blocks again "
                "before backward) and reduce-scatters their gradients; gradients of R parameters "
                "are all-reduced"
            )
        if "dp_replicate" in self.mesh:
            out.append(
                "dp_replicate: HSDP, every parameter replicated; each gradient shard is all-reduced "
                "across replicas after its reduce-scatter"
            )
        if self.mixed_precision:
            out.append(self.mixed_precision_line())
        if self.all_gather_quant:
            out.append(self.all_gather_quant_line())
        if self.trace_note:
            out.append(f"capture: every block traced (not once for all): {self.trace_note}")
        if self.branches:
            out.append("capture: branches on a tensor's value taken as the example input took them, checked at run "
                       f"time: {'; '.join(self.branches)}")
        if self.frozen:
            out.append(self.frozen_line())
        if "tp" in self.mesh:
            out.append(self.breaks_line())
            out += self.tp_traffic_lines()
        if self.pipeline is not None:
            out += self.pipeline.lines()
        if self.context is not None:
            out += self.context.lines()
        out += [e.line_text() for e in self.experts]
        return "\n".join(out)

    def values_per_rank(self) -> tuple[int, int]:
        """``(parameter values, gradient values)`` one rank holds: its shard of every parameter, and
        of the trained ones only (a frozen parameter has no gradient, nor optimizer state)."""
        axes = axes_from_sizes(dict(self.mesh))
        held = {fqn: math.prod(rank_shape(entry, axes)) for fqn, entry in self.params.items()}
        return sum(held.values()), sum(n for fqn, n in held.items() if fqn not in self.frozen)

    def frozen_line(self) -> str:
        values, gradients = self.values_per_rank()
        return (f"frozen: {len(self.frozen)} of {len(self.params)} parameters (requires_grad=False), no gradient "
                f"made or reduced; per rank {values:,} parameter values, {gradients:,} with gradients "
                f"({gradients / max(values, 1):.0%})")

    def _placement_cell(self, fqn: str, entry: ParamSharding, axis: str) -> str:
        """A parameter's placement on ``axis``; on ``pp``, the stage holding it."""
        if axis == "pp" and self.pipeline is not None:
            return next((f"stage {s.index}" for s in self.pipeline.stages if s.holds(fqn, entry.unit)), "-")
        if axis == "cp" and axis not in entry.placements:  # FSDP shards over dp x cp as one axis
            return str(entry.placements.get(axes_from_sizes(dict(self.mesh)).shard_axis, "-"))
        return str(entry.placements.get(axis, "-"))

    def tp_traffic_lines(self) -> list[str]:
        """Per FSDP unit: the tp collectives of one training step and their wire bytes per rank."""
        traffic = tp_traffic_by_unit(self)
        if not traffic:
            return []
        width = max(len(u or "<root>") for u in traffic)
        lines = ["predicted tp traffic per training step (ring wire bytes per rank):",
                 f"  {'unit':<{width}}  collectives        bytes"]
        lines += [f"  {unit or '<root>':<{width}}  {n:>11}  {nbytes:>11,}" for unit, (n, nbytes) in traffic.items()]
        return lines

    def quant_spec(self) -> BlockQuant | None:
        return BlockQuant.from_dict(self.all_gather_quant) if self.all_gather_quant else None

    def all_gather_quant_line(self) -> str:
        spec = self.quant_spec()
        gathers = [p.gather for p in self.params.values() if p.gather is not None]
        quantized = sum(g.quantized for g in gathers)
        rows, cols = spec.shape
        return (
            f"all-gather quantized: {spec.label()} ({self.all_gather_quant['dtype']}, blocks of {rows}x{cols} "
            f"inside each rank's tile, one float32 scale per block) for {quantized} of {len(gathers)} weights; "
            "master weights, gradients and optimizer state stay unquantized"
        )

    def mixed_precision_line(self) -> str:
        """Which dtype each kind of traffic and computation uses."""
        param = self.mixed_precision.get("param_dtype", "float32")
        reduce = self.mixed_precision.get("reduce_dtype", param)
        return (
            f"mixed precision: parameters all-gathered and computed in {param}, activations in {param}; "
            f"gradient reduce-scatters and every tp partial sum in {reduce}; master weights stay float32"
        )

    def num_tp_collectives(self, unit: str | None = None) -> int:
        """tp collectives per training step (forward + backward), in one FSDP unit or in all.

        A collective shared by several weights (one all-reduce for q/k/v's input
        gradients) counts once: the other weights' entries only mention it.
        """
        count = sum(
            1
            for entry in self.params.values()
            if unit is None or entry.unit == unit
            for collective in entry.collectives
            if collective.runs
        )
        return count + sum(
            1 for i, a in enumerate(self.activations)
            if a.runs and (unit is None or self.unit_of_activation(i) == unit)
        )

    def breaks_line(self) -> str:
        """One line: how many blocks stop being tensor parallel somewhere, and where."""
        blocks = [u for u in self.units if u]
        broken = [u for u in blocks if any(b[0] == u for b in self.breaks)]
        where = "; ".join(f"{u}: {w}" for u, w in self.breaks if u in broken)
        return f"tp breaks: {len(broken)} of {len(blocks)} blocks" + (f" ({where})" if where else "")


@dataclasses.dataclass(frozen=True)
class FusedSections:
    """The output sections of a fused projection, as its stored tp-sharded dim holds them.

    ``sizes``: the sections in the order the model reads them (q, k, v); ``whole``: the sections
    every tp rank holds whole rather than its share of (k/v heads fewer than tp ranks);
    ``runs``: the original columns the sections read, in order, as ``[start0, stop0, ...]``
    (empty: the sections are the columns in order).

    Rank ``r``'s stored columns are, section by section, its ``1/tp`` chunk of a cut section or the
    whole of a whole one, so a whole section is stored once per rank.
    """

    sizes: tuple[int, ...]
    whole: tuple[int, ...] = ()
    runs: tuple[int, ...] = ()

    def text(self) -> str:
        return "|".join(f"{size}*" if i in self.whole else str(size) for i, size in enumerate(self.sizes))

    def local_sizes(self, tp: int) -> list[int]:
        """Each section's columns on one rank: its ``1/tp`` share, or all of a whole one."""
        return [size if i in self.whole else size // tp for i, size in enumerate(self.sizes)]

    def duplicated(self, tp: int) -> int:
        """Stored columns beyond the original ones: the whole sections' extra copies."""
        return (tp - 1) * sum(self.sizes[i] for i in self.whole)

    def order(self, tp: int, device="cpu"):
        """The original column of each stored column (whole sections repeated per rank)."""
        import torch

        columns = torch.cat([torch.arange(a, b, device="cpu") for a, b in
                             zip(self.runs[::2], self.runs[1::2], strict=True)]) \
            if self.runs else torch.arange(sum(self.sizes), device="cpu")
        parts = columns.split(list(self.sizes))
        order = [part if i in self.whole else part.chunk(tp)[rank]
                 for rank in range(tp) for i, part in enumerate(parts)]
        return torch.cat(order).to(device)

    def inverse(self, tp: int, device="cpu"):
        """For each original column, the first stored column holding it."""
        import torch

        order = self.order(tp)
        first = torch.full((sum(self.sizes),), -1, dtype=torch.long, device="cpu")
        positions = torch.arange(order.numel(), device="cpu")
        first.scatter_reduce_(0, order, positions, "amin", include_self=False)
        return first.to(device)


def mixed_precision_of(policy) -> dict[str, str]:
    """The plan's record of FSDP2's ``MixedPrecisionPolicy`` (dtype names, unset ones left out)."""
    names = {}
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(policy, field, None)
        if dtype is not None:
            names[field] = str(dtype).removeprefix("torch.")
    return names
