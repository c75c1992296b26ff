"""The sharding vocabulary, the only module that spells it.

Imported by the planner's passes, the :class:`~autoshard.plans.plan.Plan` and
retargeting alike, and importing none of them:

* roles (:class:`Role`, a ``str`` enum, so plans print and serialize as
  their JSON); the placements of a parameter, DTensor ``Placement`` objects,
  follow from its role, its shape and the mesh (:func:`param_placements`);
  their text ``"R"``/``"S(d)"`` is read back only here (:func:`as_placement`);
* the redistributions propagation puts on a use (:class:`Step`), the kinds
  of collective a plan records (:class:`Collective`), and what each puts on
  the wire (:class:`Wire`, :data:`WIRE_KINDS`);
* why a parameter is stored as it is (:class:`Why`), rendered as its note.

Activation layouts (``passes.layout_rules.Layout``) are not DTensor
placements: a value's layout over the tp axis alone is ``None`` (replicated),
a dim (sharded on it), a partial sum or mean (``Partial``), a ``Strided`` dim
(heads folded into another dim) or a tuple (a multi-output op). A dim is an
``int`` rather than ``Shard(d)`` because propagation does arithmetic on it
(views move it, reductions drop it) and compares it with ``None`` on every op.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoshard.core.mesh import DP_REPLICATE, EP, TP, MeshAxes, dp_choice


class _Spelled(str, enum.Enum):
    """A ``str`` enum: equal to its value, and printed, formatted and serialized as it (Python
    3.10 has no ``StrEnum``), so messages and plans read as their JSON does."""

    def __repr__(self) -> str:
        return repr(self.value)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Role(_Spelled):
    """How tp treats a parameter (see :mod:`autoshard.plans.plan` for each role's storage)."""

    COLWISE = "colwise"
    ROWWISE = "rowwise"
    COLWISE_BIAS = "colwise_bias"
    ROWWISE_BIAS = "rowwise_bias"
    VOCAB_PARALLEL = "vocab_parallel"
    SHARDED = "sharded"  # the tp dim is given per parameter (its placement): norms, expert weights
    REPLICATE = "replicate"


# The stored dim tp cuts, per role: every linear weight and embedding table is an
# [in, out] / [out, in] block cut on dim 1; a colwise bias and a vocabulary-parallel
# table on dim 0; the rest is replicated over tp. ``sharded`` names its dim per parameter.
TP_DIM_BY_ROLE: dict[Role, int | None] = {
    Role.COLWISE: 1,
    Role.ROWWISE: 1,
    Role.COLWISE_BIAS: 0,
    Role.ROWWISE_BIAS: None,
    Role.VOCAB_PARALLEL: 0,
    Role.REPLICATE: None,
}

@dataclasses.dataclass(frozen=True)
class Indivisible:
    """A weight replicated over tp because its ``what`` (``size``) do not divide by the ``tp``
    it was planned for, or each rank's share is not a multiple of ``multiple`` elements, as
    ``kernel`` needs (``_grouped_mm`` reads rows 16-byte aligned)."""

    what: str  # "vocabulary rows", "output features", ...
    size: int
    tp: int
    multiple: int = 1
    kernel: str = ""

    def fits(self, tp: int) -> bool:
        """Whether ``tp`` ranks could share the dim after all."""
        return self.size % tp == 0 and (self.size // tp) % self.multiple == 0

    def reason(self) -> str:
        if self.size % self.tp:
            return f"its {self.what} ({self.size}) do not divide by the tp axis size {self.tp}"
        return (f"its {self.what} ({self.size}) cut {self.tp} ways leave {self.size // self.tp} per rank, not a "
                f"multiple of the {self.multiple} elements {self.kernel} needs")


@dataclasses.dataclass(frozen=True)
class Why:
    """The decisions behind a parameter's entry, kept as data: the plan's note is rendered from
    them for the mesh the plan is on, and retargeting renders it again for another mesh.

    ``about``: what the role means for this weight, independent of the mesh (an embedding table
    already in the [in, out] form, an expert's cut). ``tied_with``: the other names of the
    parameter. The tp decisions (rendered only on a mesh with tp): ``indivisible`` (replicated,
    a dim does not divide), ``computed_whole`` (replicated: why a narrowing linear is computed
    whole), ``gathered_early_at`` (colwise output all-gathered right away; where its sharded
    region would have ended), ``read_whole`` (a block's table or scale no matmul reads, kept
    whole over tp by choice: its reader and what that costs).
    """

    about: str = ""
    tied_with: tuple[str, ...] = ()
    indivisible: Indivisible | None = None
    computed_whole: str = ""
    gathered_early_at: str = ""
    read_whole: str = ""
    sequence_whole: Indivisible | None = None

    def note(self, tp: int | None, padding: str = "") -> str:
        """The note on a mesh with tp axis size ``tp`` (None: no tp axis); ``padding`` is FSDP's."""
        parts = [f"tied with {', '.join(self.tied_with)}"] if self.tied_with else []
        main = self.about
        if tp is not None and self.indivisible is not None:
            main = self._indivisible_note(tp)
        elif tp is not None and self.computed_whole:
            main = f"replicated over tp: {self.computed_whole}"
        elif tp is not None and self.read_whole:
            main = f"replicated over tp: {self.read_whole}"
        elif self.indivisible is not None or self.computed_whole or self.read_whole:
            main = ""
        parts += [main] if main else []
        if tp is not None and self.sequence_whole is not None:
            parts.append(self._sequence_note(tp))
        if tp is not None and self.gathered_early_at:
            parts.append("output all-gathered at once: no rowwise linear reads it (its sharded region ends at "
                         f"{self.gathered_early_at})")
        parts += [padding] if padding else []
        return "; ".join(parts)

    def on_tp(self, tp: int | None) -> Why:
        """These decisions carried to a mesh with tp axis size ``tp`` (None: no tp axis): without tp
        the tp decisions go; a dim that still does not divide is stated for the new size."""
        if tp is None:
            return dataclasses.replace(self, indivisible=None, computed_whole="", gathered_early_at="", read_whole="",
                                       sequence_whole=None)
        moved = self
        if self.indivisible is not None and not self.indivisible.fits(tp):
            moved = dataclasses.replace(moved, indivisible=dataclasses.replace(self.indivisible, tp=tp))
        if self.sequence_whole is not None and not self.sequence_whole.fits(tp):
            moved = dataclasses.replace(moved, sequence_whole=dataclasses.replace(self.sequence_whole, tp=tp))
        return moved

    def _sequence_note(self, tp: int) -> str:
        planned = self.sequence_whole
        if planned.fits(tp) and tp != planned.tp:
            return (f"sequence_parallel: output all-reduced and kept whole as planned for tp={planned.tp}, where "
                    f"its sequence length ({planned.size}) does not divide (it does by {tp}: plan afresh to cut it)")
        return (f"sequence_parallel: output all-reduced and kept whole over tp: its sequence length "
                f"({planned.size}) does not divide by {tp}")

    def _indivisible_note(self, tp: int) -> str:
        planned = self.indivisible
        if not planned.fits(tp) or tp == planned.tp:
            return f"replicated over tp: {dataclasses.replace(planned, tp=tp).reason()}"
        if planned.size % planned.tp:
            return (f"replicated over tp as planned for tp={planned.tp}: its {planned.what} ({planned.size}) do not "
                    f"divide by {planned.tp} (they do by {tp}: plan afresh to shard it)")
        return f"replicated over tp as planned for tp={planned.tp}: {planned.reason()} (not on {tp}: plan afresh)"

    def to_dict(self) -> dict:
        data = {"about": self.about, "tied_with": list(self.tied_with), "computed_whole": self.computed_whole,
                "gathered_early_at": self.gathered_early_at, "read_whole": self.read_whole}
        if self.indivisible is not None:
            data["indivisible"] = _indivisible_dict(self.indivisible)
        if self.sequence_whole is not None:
            data["sequence_whole"] = _indivisible_dict(self.sequence_whole)
        return {k: v for k, v in data.items() if v}

    @classmethod
    def from_dict(cls, data: Mapping) -> Why:
        return cls(
            about=str(data.get("about", "")),
            tied_with=tuple(str(n) for n in data.get("tied_with", ())),
            indivisible=_indivisible_from(data.get("indivisible")),
            computed_whole=str(data.get("computed_whole", "")),
            gathered_early_at=str(data.get("gathered_early_at", "")),
            read_whole=str(data.get("read_whole", "")),
            sequence_whole=_indivisible_from(data.get("sequence_whole")),
        )


def _indivisible_dict(indivisible: Indivisible) -> dict:
    return {k: v for k, v in dataclasses.asdict(indivisible).items()
            if k not in ("multiple", "kernel") or v not in (1, "")}


def _indivisible_from(data: Mapping | None) -> Indivisible | None:
    if not data:
        return None
    return Indivisible(str(data["what"]), int(data["size"]), int(data["tp"]), int(data.get("multiple", 1)),
                       str(data.get("kernel", "")))


# --- placements ---------------------------------------------------------------------------
# A plan holds DTensor placements per mesh axis (``Replicate()``, ``Shard(d)``). Its JSON and
# its table spell them as DTensor prints them, "R" and "S(d)"; only this module reads that
# spelling back (:func:`as_placement`).

REPLICATED = Replicate()


def shard_on(dim: int) -> Shard:
    return Shard(dim)


def as_placement(value) -> Placement:
    """A placement given as a DTensor ``Replicate()``/``Shard(d)`` or as its text, ``"R"``/``"S(d)"``
    (a plan's JSON, or a plan edited by hand)."""
    if type(value) in (Replicate, Shard):
        return value
    text = str(value) if isinstance(value, str) else None
    if text == "R":
        return REPLICATED
    if text is not None and text.startswith("S(") and text.endswith(")") and text[2:-1].isdigit():
        return Shard(int(text[2:-1]))
    raise ValueError(f"autoshard: unknown placement {value!r}; expected Replicate(), Shard(d), 'R' or 'S(d)'")


def placement_dim(placement: Placement | None) -> int | None:
    """The dim a placement cuts, or None for ``Replicate()`` or no placement."""
    return placement.dim if type(placement) is Shard else None


def placements_text(placements: Mapping[str, Placement]) -> dict[str, str]:
    """Placements per axis as a plan's JSON spells them."""
    return {axis: str(placement) for axis, placement in placements.items()}


def sharded_by_fsdp(placements) -> bool:
    """Whether a plan entry's parameter is cut on the FSDP shard axis (not replicated over dp)."""
    return placement_dim(dp_choice(placements)) is not None


def default_dp_placement(role: Role, shape, tp_dim: int | None = None, dp: int | None = None) -> Placement:
    """FSDP shards dim 0, except a colwise bias (already cut by tp) and scalars stay
    replicated, a vocabulary-parallel table gives dim 0 to tp and dim 1 to FSDP, and a
    ``sharded`` parameter whose dim 0 tp cuts gives FSDP its first other dim that ``dp``
    divides (FSDP2 pads dim 0 only), or stays replicated over dp when none does (a
    depthwise convolution's ``[C, 1, 3]``: small)."""
    if role == Role.VOCAB_PARALLEL:
        return shard_on(1)
    if role == Role.SHARDED:
        if len(shape) <= 1:
            return REPLICATED
        if tp_dim != 0:
            return shard_on(0)
        even = [d for d in range(1, len(shape)) if dp is None or shape[d] % dp == 0]
        return shard_on(even[0]) if even else REPLICATED
    return REPLICATED if role == Role.COLWISE_BIAS or not shape else shard_on(0)


def param_placements(
    role: Role, shape, axes: MeshAxes, dp_placement: Placement | None = None, tp_dim: int | None = None
) -> dict[str, Placement]:
    """Placements per mesh axis of a parameter with ``role`` (``dp_placement`` overrides the FSDP
    shard axis's; ``tp_dim`` is the dim tp cuts for role ``sharded``, fixed by the role otherwise)."""
    placements = {}
    if role != Role.SHARDED:
        tp_dim = TP_DIM_BY_ROLE[Role(role)]
    if axes.is_hsdp:
        placements[DP_REPLICATE] = REPLICATED  # HSDP replicates every shard; only the shard axis is a choice
    if axes.has_dp:
        chosen = dp_placement or default_dp_placement(role, shape, tp_dim, axes.fsdp_degree)
        for axis in axes.fsdp_axes:  # with a cp axis FSDP shards over dp x cp as one axis
            placements[axis] = chosen
    if axes.has_tp:
        placements[TP] = REPLICATED if tp_dim is None else shard_on(tp_dim)
    return placements


def tp_dim_of(entry) -> int | None:
    """The stored dim tp cuts for a plan entry (anything with ``role`` and ``placements``)."""
    if entry.role == Role.SHARDED:
        return placement_dim(entry.placements.get(TP))
    return TP_DIM_BY_ROLE[Role(entry.role)]


def tp_local_shape(entry, axes: MeshAxes) -> list[int]:
    """The stored tensor of a plan entry as one tp rank holds it (still whole over dp)."""
    shape = list(entry.stored_shape)
    dim = tp_dim_of(entry) if axes.has_tp else None
    if dim is not None and dim < len(shape):
        shape[dim] //= axes.tp
    return shape


def rank_shape(entry, axes: MeshAxes) -> list[int]:
    """The piece of a plan entry one rank stores: its tp-local shape with FSDP's dim rounded up
    to a multiple of the shard degree and divided (FSDP2 pads the last shard)."""
    shape = tp_local_shape(entry, axes)
    dim = placement_dim(dp_choice(entry.placements))
    ep_dim = placement_dim(entry.placements.get(EP))
    if ep_dim is not None and (dim is None or dim != ep_dim or not axes.expert_fsdp_axes):
        # experts split whole over ep, cut by FSDP over the data axes ep leaves on another dim (or kept whole)
        shape[ep_dim] = -(-shape[ep_dim] // axes.ep)
        if dim is not None and dim != ep_dim:
            degree = math.prod(axes.size(a) for a in axes.expert_fsdp_axes)
            shape[dim] = -(-shape[dim] // degree)
        return shape
    if dim is not None:
        shape[dim] = -(-shape[dim] // axes.fsdp_degree)
    return shape


def dp_padding(shape, transposed: bool, dp_placement: Placement | None, dp: int) -> str:
    """Say so when FSDP2 must pad: the dp-sharded stored dim does not divide by dp."""
    dim = placement_dim(dp_placement)
    if dim is None or dp <= 1:
        return ""
    stored = tuple(reversed(shape)) if transposed else tuple(shape)
    if len(stored) <= dim or stored[dim] % dp == 0:
        return ""
    return f"stored dim {dim} ({stored[dim]}) does not divide by dp={dp}: FSDP2 pads the last shard"


# --- collectives ------------------------------------------------------------------------

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all-reduce", "all-gather", "reduce-scatter"
GATHER_SCATTER = "all-gather+reduce-scatter"  # sequence parallel: all-gather forward, reduce-scatter backward
TAKE_SHARD = "take-shard"  # a local cut forward, an all-gather of the gradient backward
NO_COLLECTIVE = "none"  # a sharded output left sharded (loss parallel)
KINDS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, GATHER_SCATTER, TAKE_SHARD, NO_COLLECTIVE)
class Wire(_Spelled):
    """A collective as it runs on the wire, named as torch names it: what
    :class:`~autoshard.adapters.comm_stats.CollectiveCounter` counts and ``predicted_comm`` predicts."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"


# What each plan kind puts on the wire in one training step, as torch names the collectives
# (``CollectiveCounter`` and ``predicted_comm`` count these); a sum among them runs as
# :func:`sum_on_wire` says.
WIRE_KINDS: dict[str, tuple[Wire, ...]] = {
    ALL_REDUCE: (Wire.ALL_REDUCE,),
    ALL_GATHER: (Wire.ALL_GATHER,),
    REDUCE_SCATTER: (Wire.REDUCE_SCATTER, Wire.ALL_GATHER),  # its backward gathers
    GATHER_SCATTER: (Wire.ALL_GATHER, Wire.REDUCE_SCATTER),
    TAKE_SHARD: (Wire.ALL_GATHER,),  # the gradient's all-gather in backward
    NO_COLLECTIVE: (),
}


SUMS = (Wire.ALL_REDUCE, Wire.REDUCE_SCATTER)  # the collectives that add partial values


def sum_on_wire(kind: Wire, widened: bool, ranks: int) -> tuple[Wire, ...]:
    """The collectives a sum of ``kind`` runs as. Added wider than it travels (bf16 partial sums
    added in fp32, :mod:`autoshard.runtime.collectives`) on more than two ranks, a reduce-scatter is an
    all-to-all of the partial chunks (each rank adds its own), and an all-reduce is that and an
    all-gather of the sums; on two ranks an all-reduce stays one (its one addition rounds once)."""
    if not widened or kind not in SUMS:
        return (kind,)
    if kind is Wire.REDUCE_SCATTER:
        return (Wire.ALL_TO_ALL,)
    return (Wire.ALL_REDUCE,) if ranks <= 2 else (Wire.ALL_TO_ALL, Wire.ALL_GATHER)


def widens(dtype: torch.dtype, reduce_dtype: torch.dtype | None) -> bool:
    """Whether values of ``dtype`` are summed wider (in ``reduce_dtype``) than they travel."""
    return reduce_dtype is not None and dtype.is_floating_point and reduce_dtype.itemsize > dtype.itemsize


class Step(enum.Enum):
    """One redistribution propagation puts on a use of a value. Each step knows the op the
    layouts pass emits for it (in :mod:`autoshard.runtime.collectives`), the kind of collective the plan
    records for it (and through :data:`WIRE_KINDS` what it puts on the wire), and the suffix
    of the emitted node's name."""

    ENTER_TP = ("enter_tp", "ENTER_TP", ALL_REDUCE, "enter_tp")  # identity; its gradient all-reduced
    GATHER = ("gather", "GATHER_SHARDS", ALL_GATHER, "gathered")
    TAKE_SHARD = ("take_shard", "TAKE_SHARD", TAKE_SHARD, "shard")  # a local cut; its gradient gathered
    REDUCE = ("reduce", "REDUCE_PARTIAL", ALL_REDUCE, "reduced")  # a partial sum all-reduced
    SHARDED_OUTPUT = ("sharded_output", "as_sharded_dtensor", NO_COLLECTIVE, "dtensor")  # loss parallel
    # sequence parallel: all-gathered over the sequence forward, its gradient reduce-scattered
    GATHER_FOR_COLWISE = ("gather_for_colwise", "GATHER_FOR_COLWISE", GATHER_SCATTER, "gathered")

    def __init__(self, label: str, op_name: str, plan_kind: str, node_suffix: str):
        self.label, self.op_name, self.plan_kind, self.node_suffix = label, op_name, plan_kind, node_suffix

    @property
    def sums_partials(self) -> bool:
        """Whether the op adds partial values, forward or backward (taken in the reduce dtype)."""
        return any(kind in SUMS for kind in WIRE_KINDS[self.plan_kind])

    def __repr__(self) -> str:
        return f"Step.{self.name}"
_PAST = {ALL_REDUCE: "all-reduced", ALL_GATHER: "all-gathered", REDUCE_SCATTER: "reduce-scattered"}


class Direction(_Spelled):
    """When a collective runs in a training step."""

    FORWARD = "fwd"
    BACKWARD = "bwd"


FWD, BWD = Direction.FORWARD, Direction.BACKWARD


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a training step on mesh axis ``axis``, as the plan records it.

    ``direction`` is when it runs (``fwd``/``bwd``); ``subject`` what it moves (``output``,
    ``input grad``, ``'name'`` of a value); ``cause`` the op and source line that needs it
    when no weight explains it. One collective serves several weights when they share an
    input or sum their partial outputs first: the first weight's entry has it with
    ``shared_by`` naming them all, the others' entries a mention (``counted=False``) naming
    the first. ``legacy_text`` keeps the prose of a version-1 plan, which has no fields.
    Prose is rendered only by ``str()``.
    """

    kind: str
    direction: Direction | str  # a version-1 plan's record keeps the first word of its prose
    subject: str
    cause: str = ""
    shared_by: tuple[str, ...] = ()
    counted: bool = True
    over_sequence: bool = False
    dim: int | None = None
    axis: str = "tp"
    # the tensor the ring formula counts (an all-reduce's, a gather's output, a scatter's input):
    # its elements (tp-unsharded, the plan's dp-local shapes) and traced dtype; 0/"" when unknown.
    # Sizes, not decisions: plans made for other batch shapes compare equal.
    numel: int = dataclasses.field(default=0, compare=False)
    dtype: str = dataclasses.field(default="", compare=False)
    legacy_text: str = ""

    @property
    def runs(self) -> bool:
        """Whether this entry stands for a collective that runs (and is counted once)."""
        return self.counted and self.kind != NO_COLLECTIVE

    def __str__(self) -> str:
        if self.legacy_text:
            return self.legacy_text
        cause = f" for {self.cause}" if self.cause else ""
        over = " over the sequence" if self.over_sequence else ""
        if self.kind == NO_COLLECTIVE:
            return f"{self.subject} returned sharded over the vocabulary (loss parallel), not gathered"
        if self.kind == TAKE_SHARD:
            return f"take shard of {self.subject} on dim {self.dim}{cause} ({BWD} {ALL_GATHER})"
        if not self.counted:
            first = _short(self.shared_by[0])
            if self.kind == GATHER_SCATTER:
                return f"{self.subject} gathered and its grad reduce-scattered with {first}"
            return f"{self.direction} {self.subject} {_PAST[self.kind]} with {first}"
        shared = ""
        if len(self.shared_by) > 1:
            shorts = [_short(n) for n in self.shared_by]
            names = [".".join(n.split(".")[-2:]) if shorts.count(short) > 1 else short
                     for n, short in zip(self.shared_by, shorts, strict=True)]  # norm.weight, norm.bias
            shared = f" (shared by {len(self.shared_by)}: {', '.join(names)})"
        if self.kind == GATHER_SCATTER:
            return f"{FWD} {ALL_GATHER} {self.subject}{over}, {BWD} {REDUCE_SCATTER} its grad{cause}{shared}"
        return f"{self.direction} {self.kind} {self.subject}{over}{cause}{shared}"

    def to_dict(self) -> dict:
        if self.legacy_text:
            return {"text": self.legacy_text}
        fields = dataclasses.asdict(self)
        fields.pop("legacy_text")
        fields["shared_by"] = list(self.shared_by)
        return fields

    @classmethod
    def from_dict(cls, data) -> Collective:
        """A version-2 record, or a version-1 string (kept as prose; counted as version 1 did)."""
        if isinstance(data, str):
            runs = data.startswith((FWD, f"{BWD} {ALL_REDUCE}"))
            kind = next((k for k in (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER) if k in data), NO_COLLECTIVE)
            return cls(kind, data.split(" ", 1)[0], "", counted=runs, legacy_text=data)
        if "text" in data:
            return cls.from_dict(str(data["text"]))
        known = {f.name for f in dataclasses.fields(cls)} - {"legacy_text"}
        unknown = set(data) - known
        if unknown or data.get("kind") not in KINDS:
            raise ValueError(f"autoshard: plan collective {dict(data)!r} has unknown fields or kind")
        values = {k: data[k] for k in known if k in data}
        values["shared_by"] = tuple(values.get("shared_by", ()))
        try:
            values["direction"] = Direction(values.get("direction"))
        except ValueError as err:
            raise ValueError(f"autoshard: plan collective {dict(data)!r} has an unknown direction") from err
        return cls(**values)


def _short(fqn: str) -> str:
    """``layers.0.attention.wq.weight`` -> ``wq``: the module a weight belongs to."""
    parts = fqn.split(".")
    return parts[-2] if len(parts) >= 2 and parts[-1] in ("weight", "bias") else parts[-1]
