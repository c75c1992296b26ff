"""Placements: turn roles and layouts into the public :class:`~autoshard.plans.plan.Plan`.

Every linear weight ends as one clean block, ``(dp: S(0), tp: S(1))`` on its
stored tensor: colwise weights are stored ``[in, out]`` and rowwise weights
``[out, in]``, so tp always cuts dim 1 and FSDP always cuts dim 0. Embedding
tables ``[num, dim]`` are already in the ``[in, out]`` form and shard the same
way. No parameter ever has two mesh axes on one dim (no ``_StridedShard``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from autoshard.core.errors import describe, source_line
from autoshard.core.mesh import TP, MeshAxes, dp_choice
from autoshard.core.sharding import (
    ALL_REDUCE,
    BWD,
    FWD,
    GATHER_SCATTER,
    REDUCE_SCATTER,
    Collective,
    Indivisible,
    Role,
    Step,
    Why,
    dp_padding,
    param_placements,
)
from autoshard.passes.capture import CapturedGraph
from autoshard.passes.discover import IN_OUT, OUT_IN, EmbeddingSite, LinearSite, Sites
from autoshard.passes.idle_regions import closed_by_grouped_convolution, grouped_on_cut_input
from autoshard.passes.layout_plan import (
    COLWISE,
    COLWISE_LIKE,
    PARTIALS,
    REPLICATE,
    ROWWISE,
    VOCAB_PARALLEL,
    LayoutPlan,
    RowwiseExit,
    is_sharded,
)
from autoshard.passes.layout_rules import Convolution
from autoshard.plans.block_owners import owner_block, unit_of_node
from autoshard.plans.plan import ParamSharding, Plan

SHARDED = Role.SHARDED


def build_plan(
    captured: CapturedGraph,
    sites: Sites,
    layout_plan: LayoutPlan,
    axes: MeshAxes,
    dp_placements: dict[str, str] | None = None,
) -> Plan:
    """The plan for ``captured``; ``dp_placements`` overrides the dp placement per FQN."""
    collectives, activations, activation_nodes = _collectives_by_weight(sites, layout_plan, captured.block_fqns)
    site_by_param = {fqn: s for s in sites.all for fqn in s.param_fqns}
    expert_sites = {s.weight_fqn: s for s in sites.experts}
    entries = {
        fqn: _param_entry(fqn, shape, site_by_param.get(fqn), expert_sites.get(fqn), captured, layout_plan, axes,
                          (dp_placements or {}).get(fqn), collectives.get(fqn, ()) if axes.has_tp else ())
        for fqn, shape in captured.param_shapes.items()
    }
    breaks = ()
    if axes.has_tp:
        entries, whole = _whole_weights(entries, captured, axes, layout_plan)
        breaks = _breaks(layout_plan, captured.block_fqns, whole)
    return Plan(
        mesh=axes.to_dict(),
        params=entries,
        units=("", *captured.block_fqns),
        activations=tuple(activations) if axes.has_tp else (),
        activation_units=tuple(unit_of_node(n, captured.block_fqns) for n in activation_nodes) if axes.has_tp else (),
        functions=tuple(str(f) for f in captured.functions),
        breaks=breaks,
        frozen=tuple(sorted(captured.frozen)),
    )


# Ops that multiply by a weight: a weight they read whole over tp is a block's bulk compute left
# unsharded. Other readers (a table indexed, a scale multiplied elementwise) are cheap to keep whole.
MATMUL_OPS = frozenset(  # op packets: every overload (conv_transpose2d has no .default)
    getattr(torch.ops.aten, name)
    for name in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_grouped_mm", "einsum", "_scaled_mm",
                 "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                 "conv_transpose2d", "conv_transpose3d")
    if hasattr(torch.ops.aten, name)
)


def multiplies(node: fx.Node) -> bool:
    """Whether ``node`` is a matmul or a convolution (any overload)."""
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in MATMUL_OPS


# Ops a weight passes through on its way to the op that uses it: views and casts.
_PASS_THROUGH = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("t", "permute", "view", "reshape", "expand", "unsqueeze", "squeeze", "_to_copy", "clone",
                 "contiguous", "alias", "_unsafe_view")
    if hasattr(torch.ops.aten, name)
) | {torch.ops.aten.transpose.int, torch.ops.aten.to.dtype}


def _whole_weights(entries: dict[str, ParamSharding], captured: CapturedGraph, axes: MeshAxes,
                   layout_plan: LayoutPlan):
    """Every block parameter of 2 or more dims left whole over tp is accounted for.

    Replicated by choice (a narrowing linear computed whole, a table or scale no matmul
    reads) it says so in its note, with what it costs; replicated against the plan's aim
    (a matmul reads it whole: its dims do not divide, or no rule shards its reader) it is
    a break of its block, returned as ``(unit, where)`` so ``plan.breaks`` lists it.
    Returns the entries (with the by-choice notes) and those breaks.
    """
    readers = _readers(captured.gm.graph)
    out, whole = dict(entries), []
    for fqn, entry in entries.items():
        if not entry.unit or len(entry.shape) < 2 or entry.sharded_dim(TP) is not None or entry.why.computed_whole:
            continue
        matmuls = [r for r in readers.get(fqn, ()) if getattr(r.target, "overloadpacket", None) in MATMUL_OPS]
        if _narrow_on_whole_input(entry):  # a router or a 1-output gate on the whole stream
            why = dataclasses.replace(entry.why, computed_whole=(
                f"its {entry.shape[0]} output features, fewer than its {entry.shape[1]} inputs, do not divide by "
                f"tp={axes.tp}; it reads the whole stream, so computed whole it needs no collective"))
            out[fqn] = dataclasses.replace(entry, why=why)
            continue
        depthwise = matmuls and all(_depthwise_on_whole_input(r, layout_plan) for r in matmuls)
        if entry.why.indivisible is None and depthwise:
            why = dataclasses.replace(entry.why, computed_whole=(
                "a depthwise convolution (one input channel per filter) of a replicated input: per-channel work, "
                "computed whole it needs no collective; cut, its input would be split and its output gathered"))
            out[fqn] = _explained(entry, why, axes)
            continue
        if entry.why.indivisible is not None or matmuls:
            why = entry.why.indivisible.reason() if entry.why.indivisible is not None else (
                f"read whole by {describe(matmuls[0])}")
            whole.append((entry.unit, f"'{fqn}' replicated over tp: {why}"))
            continue
        first = next(iter(readers.get(fqn, ())), None)
        reader = describe(first) if first is not None else "nothing in the graph"
        why = dataclasses.replace(entry.why, read_whole=(
            f"read by {reader}, no matmul: {math.prod(entry.shape)} elements kept whole on every tp rank"))
        out[fqn] = _explained(entry, why, axes)
    return out, tuple(whole)


def _explained(entry: ParamSharding, why: Why, axes: MeshAxes) -> ParamSharding:
    """``entry`` with ``why`` and the note it gives (FSDP's padding included)."""
    padding = dp_padding(entry.shape, entry.transposed, dp_choice(entry.placements), axes.fsdp_degree)
    return dataclasses.replace(entry, why=why, note=why.note(axes.tp, padding))


def _narrow_on_whole_input(entry: ParamSharding) -> bool:
    """A linear kept whole because its few outputs do not divide by tp, and fewer than its inputs: it
    reads the whole stream (its role would have been colwise), so computed whole it costs no
    collective and little work; nothing could cut it, so it is no break."""
    indivisible = entry.why.indivisible
    return (indivisible is not None and indivisible.what == "output features" and len(entry.shape) == 2
            and entry.shape[0] == indivisible.size and entry.shape[0] < entry.shape[1])


def _depthwise_on_whole_input(reader: fx.Node, layout_plan: LayoutPlan) -> bool:
    """A depthwise convolution (``groups`` = input channels) reading a replicated input: work per
    channel, small next to a matmul over the channels, so computing it whole is a choice, no
    break (ConvNeXt's 7x7 ``dwconv``, ConvBERT's separable conv on the stream)."""
    conv = Convolution.of(reader)
    return (conv is not None and not conv.transposed and conv.channels_per_group == 1
            and isinstance(conv.input, fx.Node)
            and layout_plan.layouts.get(conv.input) is None and layout_plan.layouts.get(reader) is None)


def _readers(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    """Parameter FQN -> the ops that use it, past views and casts, in graph order."""
    readers: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        frontier, seen = list(node.users), set()
        while frontier:
            user = frontier.pop(0)
            if user in seen:
                continue
            seen.add(user)
            if user.op == "call_function" and user.target in _PASS_THROUGH:
                frontier += list(user.users)
            else:
                readers.setdefault(node.target, []).append(user)
    return readers


def _expert_note(site, role: Role, tp_dim: int) -> str:
    """Why an expert weight is cut where it is: which matmul reads it, and as what."""
    dims = "output" if role == COLWISE else "input"
    return (
        f"experts' {role} weight, read per expert by {site.node.target.__name__.split('.')[0]} at "
        f"{source_line(site.node)}: tp cuts its {dims} dim {tp_dim}, FSDP the experts"
    )


def _breaks(lp: LayoutPlan, block_fqns, whole: tuple[tuple[str, str], ...] = ()) -> tuple[tuple[str, str], ...]:
    """Where a block's tp sharding ends before a rowwise linear: sharded values gathered
    inside a block (not the channels a grouped convolution closing its region makes: that
    gather is its exit, as a rowwise layer's all-reduce is), colwise outputs gathered at once
    (at the op that would have ended their region), and ``whole``: a block's weights a matmul
    reads whole over tp."""
    found: dict[tuple[str, str], None] = dict.fromkeys(whole)
    for source, where in lp.gathered_early.items():
        unit = unit_of_node(source, block_fqns)
        if unit:
            found[(unit, where)] = None
    closing = set(grouped_on_cut_input(lp))
    for (value, consumer), steps in lp.edges.items():
        if (any(step.kind is Step.GATHER for step in steps) and value not in lp.gathered_early
                and not closed_by_grouped_convolution(lp, value, closing)):
            unit = unit_of_node(consumer, block_fqns) if consumer.op != "output" else ""
            if unit:
                found[(unit, describe(consumer))] = None
    order = {unit: i for i, unit in enumerate(block_fqns)}
    # Sorted on the text too: the dicts above fill in set-iteration order.
    return tuple(sorted(found, key=lambda b: (order.get(b[0], -1), b[1])))


_EMBEDDING_NOTE = "embedding table [num, dim] is already the [in, out] form: colwise shards the embedding dim"


_VOCAB_PARALLEL_NOTE = (
    "embedding and LM head share [vocab, dim]; tp cuts vocabulary rows (lookup masked to the "
    "local rows, output all-reduced; head colwise over the vocabulary), FSDP cuts dim 1"
)


def _role_of(fqn: str, site, roles: dict[str, Role]):
    """(role, transposed, note); the tp-sharded dim follows from the role (``TP_DIM_BY_ROLE``)."""
    if site is None:
        return REPLICATE, False, ""
    role = roles[site.weight_fqn]
    if role == VOCAB_PARALLEL:
        if isinstance(site, LinearSite) and fqn == site.bias_fqn:  # the head's bias, cut over the vocabulary
            return Role.COLWISE_BIAS, False, ""
        return VOCAB_PARALLEL, False, _VOCAB_PARALLEL_NOTE
    if isinstance(site, EmbeddingSite):
        if role == COLWISE:
            return COLWISE, False, _EMBEDDING_NOTE
        return REPLICATE, False, ""
    is_bias = fqn == site.bias_fqn
    if role == COLWISE:
        if is_bias:
            return Role.COLWISE_BIAS, False, ""
        return COLWISE, site.orientation == OUT_IN, ""
    if role == ROWWISE:
        if is_bias:
            return Role.ROWWISE_BIAS, False, ""
        return ROWWISE, site.orientation == IN_OUT, ""
    return REPLICATE, False, ""


def _param_entry(fqn: str, shape, site, expert, captured: CapturedGraph, layout_plan: LayoutPlan, axes: MeshAxes,
                 dp_placement: str | None, collectives: tuple) -> ParamSharding:
    """One parameter's entry: its role (from its site), placements, unit and why."""
    role, transposed, about = _role_of(fqn, site, layout_plan.roles)
    explained_by = site.weight_fqn if site is not None else fqn  # an expert weight is its own site
    replicated = layout_plan.notes.get(explained_by) if axes.has_tp else None
    source = getattr(site, "output", getattr(site, "node", None))
    early = layout_plan.gathered_early.get(source, "") if site is not None and fqn == site.weight_fqn else ""
    if site is not None and fqn == site.weight_fqn and axes.has_tp:
        about = layout_plan.role_notes.get(fqn, about)
    why = Why(
        about=about,
        tied_with=tuple(alias for alias, canonical in captured.aliases.items() if canonical == fqn),
        indivisible=replicated if isinstance(replicated, Indivisible) else None,
        computed_whole=replicated if isinstance(replicated, str) else "",
        gathered_early_at=early if axes.has_tp else "",
        sequence_whole=layout_plan.whole_sequences.get(fqn) if axes.has_tp else None,
    )
    tp_dim = None
    if fqn in layout_plan.sharded_params and axes.has_tp:
        role, tp_dim = SHARDED, layout_plan.sharded_params[fqn]
        about = (_expert_note(expert, layout_plan.roles[fqn], tp_dim) if expert is not None
                 else f"read sharded by one op over its tp-sharded dim {tp_dim}: stored cut over tp")
        why = Why(about=about)
    placements = param_placements(role, shape, axes, dp_placement, tp_dim)
    fused = None
    if axes.has_tp and (isinstance(site, LinearSite) or fqn in layout_plan.sharded_params):
        fused = layout_plan.fused.get(explained_by)  # a colwise linear's weight and bias share them
        if fused is not None and role == Role.ROWWISE_BIAS:
            fused = None  # a rowwise weight's sections are its input rows; its bias is per output
    padding = dp_padding(shape, transposed, dp_choice(placements), axes.fsdp_degree)
    sections = {}
    if fused is not None:
        sections = {"sections": fused.sizes, "whole_sections": fused.whole, "section_runs": fused.runs,
                    "duplicated": fused.duplicated(axes.tp)}
    return ParamSharding(role=role, shape=shape, transposed=transposed, placements=placements,
                         unit=_unit_of(fqn, captured.block_fqns), collectives=collectives,
                         note=why.note(axes.tp if axes.has_tp else None, padding), why=why, **sections)


def _unit_of(fqn: str, blocks: tuple[str, ...]) -> str:
    return owner_block(fqn, blocks) or ""


def _collectives_by_weight(
    sites: Sites, lp: LayoutPlan, block_fqns: tuple[str, ...] = ()
) -> tuple[dict[str, tuple[Collective, ...]], list[Collective], list[fx.Node]]:
    """Each tp collective as a record next to the weight that causes it, or among the
    activation collectives (with the node each one belongs to) when no weight does or the
    weight is in another FSDP unit than the code that runs the collective (a sequence-sharded
    residual stream gathered in the next block): a unit's traffic is what its code runs."""
    records = _Records(sites, lp, block_fqns)
    records.linears()
    records.colwise_groups()
    records.embeddings()
    records.edges()
    return {k: tuple(v) for k, v in records.by_weight.items()}, records.activations, records.activation_nodes


class _Records:
    """The plan's tp collective records, built from the sites and from propagation's edges."""

    def __init__(self, sites: Sites, lp: LayoutPlan, block_fqns: tuple[str, ...]):
        self.sites, self.lp, self.block_fqns = sites, lp, block_fqns
        self.by_weight: dict[str, list[Collective]] = {}
        self.activations: list[Collective] = []
        self.activation_nodes: list[fx.Node] = []
        self.origin = {n: s.weight_fqn for s in sites.linears for n in (s.output, s.node)}
        self.origin |= {s.node: s.weight_fqn for s in sites.embeddings}
        self.colwise_nodes = {s.node for s in sites.linears if lp.roles[s.weight_fqn] in COLWISE_LIKE}
        self.buckets = {v: b.values for b in lp.take_shard_buckets() for v in b.values}  # value -> its bucket
        self.entered = {v: b.values for b in lp.enter_tp_buckets() for v in b.values}  # parameter -> its bucket
        self._position: dict[fx.Node, int] | None = None

    def position(self, graph: fx.Graph) -> dict[fx.Node, int]:
        """Each node's place in ``graph``, counted once for all the records that order nodes."""
        if self._position is None:
            self._position = {n: i for i, n in enumerate(graph.nodes)}
        return self._position

    def add(self, fqn: str, collective: Collective) -> None:
        self.by_weight.setdefault(fqn, []).append(collective)

    def record(self, fqn: str | None, collective: Collective, node: fx.Node, value: fx.Node, also=()) -> None:
        """Next to its weight when one explains it, else among the activation collectives;
        ``also``: further values the same collective moves (a bucket), added to its size."""
        collective = _sized(collective, value)
        for other in also:
            collective = dataclasses.replace(collective, numel=collective.numel + _sized(collective, other).numel)
        if fqn is not None and value.op != "get_attr" and _unit_of(fqn, self.block_fqns) != unit_of_node(
                value, self.block_fqns):
            fqn = None  # a value of another unit (gathered where it is made), not this weight's own
        if fqn is None:
            self.activations.append(collective)
            self.activation_nodes.append(node)
        else:
            self.add(fqn, collective)

    def linears(self) -> None:
        """A rowwise output's all-reduce (or reduce-scatter under sequence parallelism), unless its
        partial sum travels on (recorded at the reduce edge it reaches)."""
        for site in self.sites.linears:
            exit_ = self.lp.rowwise_exit(site)
            if exit_ in (None, RowwiseExit.PARTIAL):
                continue
            if exit_ is RowwiseExit.REDUCE_SCATTER:
                self.add(site.weight_fqn, _sized(
                    Collective(REDUCE_SCATTER, FWD, "output", over_sequence=True), site.output))
                if site.bias_node is not None and site.output is site.node:  # added to this rank's rows only
                    self.add(site.bias_node.target, _sized(
                        Collective(ALL_REDUCE, BWD, "grad", cause="its rows of the sequence only"), site.bias_node))
            else:
                self.add(site.weight_fqn, _sized(Collective(ALL_REDUCE, FWD, "output"), site.output))

    def colwise_groups(self) -> None:
        """Colwise linears reading one input share its input-gradient all-reduce (or its
        sequence all-gather)."""
        groups: dict[fx.Node, list[LinearSite]] = {}
        for site in self.sites.linears:
            if self.lp.roles[site.weight_fqn] in COLWISE_LIKE:
                groups.setdefault(site.input, []).append(site)
        for group in groups.values():
            names = tuple(s.weight_fqn for s in group)
            steps = self.lp.edges.get((group[0].input, group[0].node), ())
            if any(step.kind is Step.GATHER_FOR_COLWISE for step in steps):
                first = Collective(GATHER_SCATTER, FWD, "input", over_sequence=True, shared_by=names)
            elif group[0].input not in self.lp.carries_grad or not any(s.node in self.lp.carries_grad for s in group):
                continue  # no gradient reaches the input (the model's own), or none leaves the group (no-grad)
            elif not any(step.kind is Step.ENTER_TP for step in steps):
                continue  # entered higher up, with other views of one value (recorded at that edge)
            else:
                first = Collective(ALL_REDUCE, BWD, "input grad", shared_by=names)
            _add_shared(self.by_weight, _sized(first, group[0].input))

    def embeddings(self) -> None:
        for site in self.sites.embeddings:
            if self.lp.roles[site.weight_fqn] == VOCAB_PARALLEL:
                self.add(site.weight_fqn, _sized(Collective(ALL_REDUCE, FWD, "embedding output"), site.node))

    def edges(self) -> None:
        """Every redistribution propagation put on a use, once per value and step (a colwise
        linear's own input step is its group's, recorded by :meth:`colwise_groups`)."""
        # an input a colwise group enters is entered once for every reader (one shared node): recorded there
        seen = {(value, step) for (value, consumer), steps in self.lp.edges.items()
                if consumer in self.colwise_nodes for step in steps[:1] if step.kind is Step.ENTER_TP}
        for (value, consumer), steps in self.lp.edges.items():
            for step in steps:
                key = (value, step)
                own_group = step.kind in (Step.ENTER_TP, Step.GATHER_FOR_COLWISE) and consumer in self.colwise_nodes
                if key in seen or own_group:
                    continue
                seen.add(key)
                self.edge(value, consumer, step)

    def edge(self, value: fx.Node, consumer: fx.Node, step) -> None:
        node = consumer if consumer.op != "output" else value
        kind = step.kind.plan_kind
        if step.kind is Step.ENTER_TP:  # a replicated input of a sharded op: its gradient is partial
            cause = _entered_cause(consumer, self.lp)
            if value in self.entered:  # one all-reduce for the block's bucket, recorded with its first
                bucket = self.entered[value]
                if value is bucket[0]:
                    names = tuple(v.target for v in bucket)
                    collective = _sized(Collective(kind, BWD, "grad", cause=cause, shared_by=names), value)
                    for other in bucket[1:]:
                        collective = dataclasses.replace(
                            collective, numel=collective.numel + _sized(collective, other).numel)
                    _add_shared(self.by_weight, collective)
            elif value.op == "get_attr":
                self.record(value.target, Collective(kind, BWD, "grad", cause=cause), node, value)
            else:
                self.record(None, Collective(kind, BWD, f"grad of '{value.name}'", cause), node, value)
        elif step.kind is Step.GATHER:
            if value in self.origin:
                collective = Collective(kind, FWD, "output")
            else:
                collective = Collective(kind, FWD, f"'{value.name}'", describe(consumer))
            self.record(_region_origin(value, self.lp, self.origin), collective, node, value)
        elif step.kind is Step.GATHER_FOR_COLWISE:
            collective = Collective(kind, FWD, f"'{value.name}'", f"sharded {describe(consumer)}", over_sequence=True)
            self.record(None, collective, node, value)
        elif step.kind is Step.SHARDED_OUTPUT:
            self.record(_region_origin(value, self.lp, self.origin), Collective(kind, FWD, "output"), node, value)
        elif step.kind is Step.REDUCE:
            weights = tuple(_partial_origins(value, self.lp, self.origin, self.position(value.graph)))
            if not weights:
                collective = Collective(kind, FWD, f"partial sum '{value.name}'", describe(consumer))
                self.record(None, collective, node, value)
            else:
                _add_shared(self.by_weight, _sized(Collective(kind, FWD, "output", shared_by=weights), value))
        elif step.kind is Step.TAKE_SHARD and value in self.lp.carries_grad:  # forward: no communication
            bucket = self.buckets.get(value, (value,))
            if value is not bucket[0]:
                return  # one all-gather for the bucket, recorded with its first value
            subject = ", ".join(f"'{v.name}'" for v in bucket)
            take = Collective(kind, BWD, subject, describe(consumer), dim=step.dim)
            self.record(None, take, node, value, also=bucket[1:])


def _entered_cause(consumer: fx.Node, lp: LayoutPlan) -> str:
    """Why a value's gradient is partial: the sharded op reading it, or, when ``enter_tp`` was
    hoisted above replicated views and chains (a split's pieces, ``1 + w``), the sharded ops that
    read it through them."""
    if is_sharded(lp.layouts.get(consumer)) or consumer.op == "output":
        return f"sharded {describe(consumer)}"
    readers, frontier, seen = [], [consumer], set()
    while frontier:
        node = frontier.pop(0)
        if node in seen:
            continue
        seen.add(node)
        if is_sharded(lp.layouts.get(node)):
            readers.append(node)
        else:
            frontier += list(node.users)
    if not readers:
        return f"sharded {describe(consumer)}"
    kinds = sorted({getattr(r.target, "__name__", str(r.target)) for r in readers})
    return (f"{len(readers)} sharded op(s) ({', '.join(kinds)}) reading it through {describe(consumer)}")


def _sized(collective: Collective, value: fx.Node) -> Collective:
    """``collective`` with the elements and dtype of ``value`` (the whole, tp-unsharded tensor it
    moves), when the capture gave it a static shape."""
    val = value.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return collective
    numel = val.numel()
    if not isinstance(numel, int):
        try:
            numel = int(numel)
        except (TypeError, ValueError, GuardOnDataDependentSymNode):
            return collective  # symbolic (dynamic_shapes, or data-dependent: tokens per expert): unsized
    return dataclasses.replace(collective, numel=numel, dtype=str(val.dtype).removeprefix("torch."))


def _add_shared(by_weight: dict, collective: Collective) -> None:
    """One collective for ``collective.shared_by``: counted in the first weight's entry,
    mentioned in the others'."""
    first, *others = collective.shared_by
    by_weight.setdefault(first, []).append(collective)
    for other in others:
        by_weight.setdefault(other, []).append(dataclasses.replace(collective, counted=False))


def _region_origin(value: fx.Node, lp: LayoutPlan, origin: dict) -> str | None:
    """The weight whose sharded output region ``value`` belongs to."""
    seen = set()
    while value not in origin and value not in seen:
        seen.add(value)
        sharded = [v for v in value.all_input_nodes if lp.layouts.get(v) not in (None, *PARTIALS)]
        if not sharded:
            return None
        value = sharded[0]
    return origin.get(value)


def _partial_origins(value: fx.Node, lp: LayoutPlan, origin: dict, position: dict[fx.Node, int]) -> list[str]:
    """The weights whose partial products flow into ``value``, in graph order (``position``)."""
    frontier, seen, found = [value], set(), []
    while frontier:
        node = frontier.pop(0)
        if node in seen:
            continue
        seen.add(node)
        if node in origin and lp.layouts.get(node) in PARTIALS:
            found.append(node)
            continue
        frontier += [v for v in node.all_input_nodes if lp.layouts.get(v) in PARTIALS]
    return [origin[n] for n in sorted(found, key=position.__getitem__)]
