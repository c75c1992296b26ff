"""Alternatives: choices one propagation walk cannot judge, settled by comparing whole plans.

A walk decides each linear from its input's layout and revises regions by local counts
(:class:`~autoshard.passes.idle_regions.Revisions`). Some choices change the roles of every linear
downstream, so only the whole block's bill can judge them.

Four such choices, each a kind of candidate tried on its own:

* **Pulling linears**: a colwise linear whose sharded output meets a replicated activation
  that carries a gradient, so that activation is cut to match (``take_shard``), and from there
  the block is sharded the other way round. The canonical case is adaLN modulation in
  diffusion transformers: ``shift, scale, gate = adaLN(silu(c)).chunk(...)``, then
  ``norm(x) * (1 + scale) + shift``. Sharding the modulation turns the normalized stream
  tp-sharded, so attention's q/k/v become rowwise, its output projection colwise and
  gathered, and the block pays 9 tp collectives and 2 gathers instead of 4. Computed whole,
  the modulation is a ``[batch, 6 * dim]`` product, small next to the block's ``[tokens, dim]``
  ones.
* **Bottlenecks**: the narrow first half of a low-rank pair (DeepSeek's multi-head latent
  attention: ``q_b_proj(norm(q_a_proj(x)))``, ``kv_b_proj(norm(kv_a_proj(x)))``). Cut, the
  latent's norm needs its statistic all-reduced, the wide second half turns rowwise and its
  ``[tokens, heads * head_dim]`` output is all-reduced, and the heads after it are whole.
  Computed whole (as DeepSeek's own and Megatron's plans keep the down-projections), the
  second half is colwise over heads and attention stays cut.

* **Gathered outputs**: a colwise linear on a replicated input whose cut output, met by no other
  cut value, is gathered whole (ConvBERT's output projection after its mixed attention, computed
  whole because its span-conv kernels mix every head; an output projection after attention whose
  heads are fewer than tp). Cut, it is a break that pays an all-gather forward and an all-reduce
  backward to save a share of one matmul; whole, the block needs no collective there. Tried last,
  on the settled plan (the other kinds and cutting places again may remove that gather at no
  work), and never for the model's output (an LM head's logits).

* **Shared linears read on a cut input first**: one weight run at several depths (ALBERT's
  shared layer) takes its role from its first read. When that read's input is cut (the
  embedding mapped up by a colwise linear), q/k/v turn rowwise for every depth: each later read
  of the replicated stream is cut for them, their outputs all-reduced and attention computed
  whole. Made colwise instead, only the first read's input is gathered.

Each kind's linears are tried computed whole (the shared ones: made colwise), bottlenecks first,
all at once and then, when that does not pay, place by place (a linear's name within its block:
one walk per place, not per block), and the result is kept if the plan's tp collectives are
fewer (the blocks whose tp breaks, then tp wire bytes, settle a tie). A trial may break more
blocks on the way: a later round often mends them (a modulation computed whole first, its
neighbours next). Computing a linear whole adds work on every rank, so only linears that
together add at most :data:`COMPUTE_BUDGET` of their block's matmul work per rank (a linear run
once per step, in the root or in a unit of its own such as a final layer's modulation: of the
model's) are tried: a per-sample modulation or a narrow input embedding, not an attention
projection run on every token. The decision and both totals go into each weight's note. A place
kept whole by a trial of several is cut again afterwards when that alone costs less, and so are
sibling places that read one input (a gated MLP's gate and up, taken along with the low-rank pairs
beside them, cut again together). Plans compare by tp collectives, then by the blocks that break
(a break reads a weight whole or holds a gathered activation, work and memory the wire bytes do
not show), then by tp wire bytes.

The search is greedy: a trial that costs more on its own is kept only when one more trial on its
plan, over the candidates it makes anew, brings the pair below the plan's cost (a first layer
type's latent down-projections computed whole turn a second type's colwise, whose trial then pays).
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Callable

import torch.fx as fx

from autoshard.core.errors import describe
from autoshard.core.mesh import TP, MeshAxes
from autoshard.core.options import PlanOptions
from autoshard.core.sharding import Step
from autoshard.passes.capture import CapturedGraph, copy_graph_module
from autoshard.passes.discover import Sites, find_sites
from autoshard.passes.layout_plan import COLWISE, PARTIALS, ROWWISE, LayoutPlan
from autoshard.passes.placements import build_plan
from autoshard.passes.propagate import propagate
from autoshard.plans.block_owners import owner_block, unit_of_node
from autoshard.plans.plan import Plan

# A linear computed whole adds (1 - 1/tp) of its matmul work to every rank; the linears one plan
# computes whole this way may add at most this share of their block's matmul work per rank (a
# root linear: of the model's; see _Budget).
COMPUTE_BUDGET = 1 / 8
# A bottleneck may take more: cut, it costs the all-reduce of its wide partner's output on every
# token and leaves the heads after it whole (attention computed on every rank), work this budget
# does not see. DeepSeek-V3's q_a_proj and kv_a_proj computed whole add 18% of a dense block's
# matmul work per rank at tp=8 (vLLM and Megatron keep them whole too); the cap keeps out pairs
# whose narrow half is most of the block.
BOTTLENECK_BUDGET = 1 / 2
# A colwise linear whose cut output alone is gathered (attention computed whole before it) saves
# (1 - 1/tp) of its 2 * in * out flops per row and moves its output (all-gather) and its input's
# gradient (all-reduce, twice the bytes) per row: in * out / (out + 2 * in) flops per byte in bf16,
# d / 3 for a square d x d weight, about 1400 at d = 4096, below an NVLink GPU's ~2700 (H100: ~990
# TFLOP/s bf16 over ~370 GB/s bus bandwidth) and far below one across nodes. Computed whole it is
# as fast or faster, so it may take a bottleneck's share of the block's work.
GATHERED_BUDGET = 1 / 2


@dataclasses.dataclass(frozen=True)
class Choices:
    """What the cost comparisons decided, as the walk takes it: linears computed whole and shared
    linears made colwise (weight FQN -> why, the reason their notes give)."""

    whole: dict[str, str] = dataclasses.field(default_factory=dict)
    colwise: dict[str, str] = dataclasses.field(default_factory=dict)

    def taken(self, kind: _Kind) -> dict[str, str]:
        return self.colwise if kind.colwise else self.whole

    def adding(self, kind: _Kind, fqns, why: str = "") -> Choices:
        added = self.taken(kind) | dict.fromkeys(fqns, why)
        return dataclasses.replace(self, **{"colwise" if kind.colwise else "whole": added})

    def walk(self, captured: CapturedGraph, sites: Sites, axes: MeshAxes, options: PlanOptions) -> LayoutPlan:
        return propagate(captured.gm, sites, axes.tp, None, options, whole=self.whole, written=captured.written,
                         block_fqns=captured.block_fqns, colwise=self.colwise)


def settle(captured: CapturedGraph, sites: Sites, axes: MeshAxes, options: PlanOptions,
           layout_plan: LayoutPlan) -> LayoutPlan:
    """``layout_plan``, or the plan with candidate linears computed whole (or shared ones made
    colwise) while that costs less.

    Each round tries each kind of candidate on the current plan: all its linears at once, then,
    if that does not pay and they hold different places in their blocks, each place alone (a
    place: the linear's name within its block, so a stack's layers go together). An all-at-once
    trial that costs more is looked one step ahead (:func:`_ahead`): the candidates its plan makes
    anew may pay where it alone does not. The first trial (or pair) that lowers the cost is kept
    and starts the next round; a round whose trials all fail ends the search (rounds end: the
    cost falls each time). Places kept whole are then cut again where that pays (:func:`_pruned`).
    Last, on the settled plan, the linears whose cut output alone is gathered are tried whole
    (:data:`_GATHERED`), and the plan pruned again: tried earlier, they would mend a gather that
    another round, or cutting a place again, removes at no work."""
    search = _Search(captured, sites, axes, options, layout_plan)
    search.run(_KINDS)
    search.prune()
    if search.run((_GATHERED,)):
        search.prune()
    return search.layout_plan


class _Search:
    """The plan being settled: its choices, cost and the compute budget they spend."""

    def __init__(self, captured: CapturedGraph, sites: Sites, axes: MeshAxes, options: PlanOptions,
                 layout_plan: LayoutPlan):
        self.captured, self.sites, self.axes, self.options = captured, sites, axes, options
        self.layout_plan = layout_plan
        self.choices = Choices()
        self.cost = None  # measured when a trial needs it (a plan of data-dependent sizes may have none)
        self.budget = _Budget(layout_plan, sites, axes.tp, _stacked_blocks(captured))

    def run(self, kinds: tuple[_Kind, ...]) -> bool:
        """Rounds of trials of ``kinds`` while one pays; whether any did."""
        captured, sites, axes, options = self.captured, self.sites, self.axes, self.options
        any_kept = False
        while True:
            kept = False
            for kind in kinds:
                found = [fqn for fqn in kind.find(self.layout_plan, sites) if fqn not in self.choices.taken(kind)]
                places = _places(found, captured.block_fqns)
                trials = [found] + (list(places.values()) if len(places) > 1 else [])
                for trial_fqns in trials:
                    candidates = (self.budget.affordable(trial_fqns, kind.budget) if not kind.colwise
                                  else trial_fqns)
                    if not candidates:
                        continue
                    if self.cost is None:
                        self.cost = _cost(build_plan(captured, sites, self.layout_plan, axes))
                    revised = _trial_cost(captured, axes, options, self.choices.adding(kind, candidates))
                    steps = [(kind, candidates)]
                    if revised >= self.cost and trial_fqns is found:
                        steps, revised = _ahead(captured, sites, axes, options, self.layout_plan, self.choices,
                                                kind, candidates, self.budget, self.cost, kinds)
                    if revised >= self.cost:
                        continue
                    for taken_kind, taken in steps:
                        done = "made colwise" if taken_kind.colwise else "computed whole"
                        for fqn, why in taken_kind.why_for(self.layout_plan, sites, taken).items():
                            self.choices = self.choices.adding(
                                taken_kind, [fqn], f"{why}; {done}, {_compared(revised, self.cost)}")
                        if not taken_kind.colwise:
                            self.budget.spend(taken)
                    self.layout_plan = self.choices.walk(captured, sites, axes, options)
                    self.cost, kept = revised, True
                    break
                if kept:
                    break
            if not kept:
                return any_kept
            any_kept = True

    def prune(self) -> None:
        self.layout_plan, self.choices, self.cost = _pruned(self.captured, self.sites, self.axes, self.options,
                                                            self.layout_plan, self.choices, self.cost)


def _ahead(captured: CapturedGraph, sites: Sites, axes: MeshAxes, options: PlanOptions, layout_plan: LayoutPlan,
           choices: Choices, kind: _Kind, candidates: list[str], budget: _Budget, cost, kinds):
    """A trial that costs more, looked one step ahead: on its plan, the candidates it makes anew
    (a later layer type's latent down-projections, turned colwise once the first type's are
    computed whole), tried all at once per kind. The steps and their cost when the pair costs
    less than ``cost``; else no step, at ``cost``."""
    first = choices.adding(kind, candidates)
    spent = budget.copy()
    if not kind.colwise:
        spent.spend(candidates)
    ahead = first.walk(captured, sites, axes, options)
    for kind2 in kinds:
        before = set(kind2.find(layout_plan, sites))
        new = [fqn for fqn in kind2.find(ahead, sites) if fqn not in first.taken(kind2) and fqn not in before]
        then = spent.affordable(new, kind2.budget) if not kind2.colwise else new
        if not then:
            continue
        revised = _trial_cost(captured, axes, options, first.adding(kind2, then))
        if revised < cost:
            return [(kind, candidates), (kind2, then)], revised
    return [], cost


def _pruned(captured: CapturedGraph, sites: Sites, axes: MeshAxes, options: PlanOptions,
            layout_plan: LayoutPlan, choices: Choices, cost) -> tuple[LayoutPlan, Choices, tuple]:
    """``layout_plan`` with each place kept whole by a trial of several (all of a kind at once) cut
    again while that costs less: a trial pays as a whole even when one of its linears does not (a
    LoRA ``lora_A`` on a rowwise layer, whose partial output its ``lora_B`` carries through).
    Returns the plan, its choices and its cost."""
    while choices.whole:
        places = _places(choices.whole, captured.block_fqns)
        if len(places) < 2:
            break
        for fqns in _with_siblings(places, sites):
            kept = dataclasses.replace(
                choices, whole={fqn: why for fqn, why in choices.whole.items() if fqn not in fqns})
            revised = _trial_cost(captured, axes, options, kept)
            if revised < cost:
                choices, cost = kept, revised
                layout_plan = choices.walk(captured, sites, axes, options)
                break
        else:
            break
    return layout_plan, choices, cost


def _with_siblings(places: dict[str, list[str]], sites: Sites) -> list[list[str]]:
    """Each place's linears, then each group of places whose linears read one input (a gated MLP's
    gate and up): cut alone, one sibling's cut output meets the other's whole one and is gathered;
    cut together, their pair may pay (a narrow shared expert kept whole with the low-rank pairs it
    was tried with)."""
    reader = {site.weight_fqn: site.input for site in sites.linears}
    by_input: dict[fx.Node, list[str]] = {}
    for place, fqns in places.items():
        for fqn in fqns:
            if fqn in reader and place not in by_input.setdefault(reader[fqn], []):
                by_input[reader[fqn]].append(place)
    groups = {tuple(group) for group in by_input.values() if len(group) > 1}
    return list(places.values()) + [[fqn for place in group for fqn in places[place]] for group in sorted(groups)]


def _places(fqns, block_fqns: tuple[str, ...]) -> dict[str, list[str]]:
    """``fqns`` by place: a weight's name within its block, so a stack's layers go together."""
    places: dict[str, list[str]] = {}
    for fqn in fqns:
        block = owner_block(fqn, block_fqns)
        places.setdefault(fqn[len(block) + 1:] if block else fqn, []).append(fqn)
    return places


def _trial_cost(captured: CapturedGraph, axes: MeshAxes, options: PlanOptions, choices: Choices):
    """The cost of the plan walked with ``choices``, on a copy (a walk may write out a norm, and
    the plan kept must match its graph)."""
    twin = dataclasses.replace(captured, gm=copy_graph_module(captured.gm))
    twin_sites = find_sites(twin.gm, twin.param_shapes)
    return _cost(build_plan(twin, twin_sites, choices.walk(twin, twin_sites, axes, options), axes))


def _stacked_blocks(captured: CapturedGraph) -> tuple[str, ...]:
    """The blocks with a twin in their container (same parameter names and shapes): a stack's
    layers. A lone unit (``final_layer.adaLN_modulation.1``, one linear of a small
    ``nn.Sequential``) runs once per step like the root."""
    signature: dict[str, tuple] = {}
    for fqn in captured.block_fqns:
        prefix = fqn + "."
        params = sorted((name[len(prefix):], tuple(shape)) for name, shape in captured.param_shapes.items()
                        if name.startswith(prefix))
        signature[fqn] = (fqn.rpartition(".")[0], tuple(params))
    counts: dict[tuple, int] = {}
    for sig in signature.values():
        counts[sig] = counts.get(sig, 0) + 1
    return tuple(fqn for fqn, sig in signature.items() if counts[sig] > 1)


class _Budget:
    """Matmul work each FSDP unit may add per rank by computing linears whole.

    A block's linear is weighed against its block's work per rank. A linear run once per step
    (in the root: an input embedding, a head; or in a lone unit) is weighed against the model's:
    it runs once on the stream every block reads. Measured on the walk's first plan and spent
    across rounds, so rounds cannot raise it.
    """

    def __init__(self, plan: LayoutPlan, sites: Sites, tp: int, stacked_blocks: tuple[str, ...]):
        self.tp = tp
        self.flops: dict[str, int | None] = {}
        for site in sites.linears:  # a shared weight: the work of all its reads
            flops, seen = _matmul_flops(site), self.flops.get(site.weight_fqn, 0)
            self.flops[site.weight_fqn] = None if flops is None or seen is None else seen + flops
        self.unit = {s.weight_fqn: unit_of_node(s.node, stacked_blocks) for s in sites.linears}
        self.work: dict[str, float] = {}  # unit -> matmul work per rank
        self.spent: dict[str, float] = {}
        if any(f is None for f in self.flops.values()):
            return  # symbolic sizes: nothing is affordable
        for fqn, flops in self.flops.items():
            work = flops / (tp if plan.roles[fqn] in (COLWISE, ROWWISE) else 1)
            for unit in {self.unit[fqn], ""}:
                self.work[unit] = self.work.get(unit, 0.0) + work
        for site in sites.experts:  # a mixture of experts' work counts in its block's
            flops = _matmul_flops(site)
            if flops is None:
                continue
            work = flops / (tp if plan.roles.get(site.weight_fqn) in (COLWISE, ROWWISE) else 1)
            for unit in {unit_of_node(site.node, stacked_blocks), ""}:
                self.work[unit] = self.work.get(unit, 0.0) + work

    def affordable(self, candidates: list[str], share: float) -> list[str]:
        """The candidates (smallest first) that keep each unit's added work within ``share`` of its
        work per rank, with what earlier rounds spent; not yet spent."""
        left = {unit: share * work - self.spent.get(unit, 0.0) for unit, work in self.work.items()}
        chosen = []
        for fqn in sorted(candidates, key=lambda f: self.flops[f] or 0):
            extra = (self.flops[fqn] or 0) * (1 - 1 / self.tp)
            unit = self.unit[fqn]
            if unit in left and extra <= left[unit]:
                left[unit] -= extra
                chosen.append(fqn)
        return chosen

    def copy(self) -> _Budget:
        twin = copy.copy(self)
        twin.spent = dict(self.spent)
        return twin

    def spend(self, chosen: list[str]) -> None:
        for fqn in chosen:
            unit = self.unit[fqn]
            self.spent[unit] = self.spent.get(unit, 0.0) + self.flops[fqn] * (1 - 1 / self.tp)


def _matmul_flops(site) -> int | None:
    """2 x rows x in x out of a linear site, or None when its input's size is symbolic."""
    val = site.input.meta.get("val")
    numel = getattr(val, "numel", lambda: None)()
    if not isinstance(numel, int):
        return None
    return 2 * (numel // site.in_features) * site.in_features * site.out_features


def _pulling_linears(plan: LayoutPlan, sites: Sites) -> dict[str, str | None]:
    """Colwise linears whose sharded region cuts a replicated, gradient-carrying activation."""
    cut_into = {consumer for (value, consumer), steps in plan.edges.items()
                if value.op != "get_attr" and value in plan.carries_grad
                and any(step.kind is Step.TAKE_SHARD for step in steps)}
    if not cut_into:
        return {}
    found = {}
    for site in sites.linears:
        if plan.roles[site.weight_fqn] == COLWISE and _region(plan, site.output) & cut_into:
            found[site.weight_fqn] = None
    return found


def _bottlenecks(plan: LayoutPlan, sites: Sites) -> dict[str, str | None]:
    """Colwise narrowing linears (fewer outputs than inputs) whose sharded region reaches a
    rowwise linear with more outputs than they have: the first half of a low-rank pair (MLA's
    ``q_a_proj`` then ``q_b_proj``, a LoRA down-projection)."""
    rowwise = [s for s in sites.linears if plan.roles[s.weight_fqn] == ROWWISE]
    found = {}
    for site in sites.linears:
        if (plan.roles[site.weight_fqn] != COLWISE or site.out_features >= site.in_features
                or site.weight_fqn in sites.tied):
            continue
        region = _region(plan, site.output)
        if any(r.node in region and r.out_features > site.out_features for r in rowwise):
            found[site.weight_fqn] = None
    return found


def _gathered(plan: LayoutPlan, sites: Sites) -> dict[str, str | None]:
    """Colwise linears reading a replicated input whose cut output, met by no other cut value
    (rowwise linears may read it), is gathered whole inside the model (an output projection after
    attention computed whole), each with the op its output is gathered for (where its region would
    have ended, when it is gathered right after the matmul)."""
    gathers = [(value, consumer) for (value, consumer), steps in plan.edges.items()
               if consumer.op != "output" and any(step.kind is Step.GATHER for step in steps)]
    found = {}
    for site in sites.linears if gathers else ():
        if plan.roles[site.weight_fqn] != COLWISE or plan.layouts.get(site.input) is not None:
            continue
        region = _region(plan, site.output)
        if any(other.node in region and plan.roles[other.weight_fqn] != ROWWISE
               for other in sites.linears if other.node is not site.node):
            continue
        if plan.loss_parallel and any(user.op == "output" for value in region for user in value.users):
            continue  # the model's output left cut (loss parallelism), through cp's gather or a view
        gathered_for = [consumer for value, consumer in gathers if value in region]
        if gathered_for:
            early = plan.gathered_early.get(site.node) or plan.gathered_early.get(site.output)
            found[site.weight_fqn] = early or describe(gathered_for[0])
    return found


def _shared_rowwise(plan: LayoutPlan, sites: Sites) -> dict[str, str | None]:
    """Shared linears (one weight, several reads) made rowwise by their first read's cut input
    while another read cuts a replicated input for them: ALBERT's one layer, run first on the
    embedding mapping's cut output and then on the normed stream."""
    found = {}
    for site in sites.linears:
        fqn = site.weight_fqn
        if fqn not in sites.shared or fqn in sites.tied or plan.roles[fqn] != ROWWISE:
            continue
        steps = plan.edges.get((site.input, site.node), ())
        if plan.layouts.get(site.input) is None and any(step.kind == Step.TAKE_SHARD for step in steps):
            found[fqn] = None
    return found


@dataclasses.dataclass(frozen=True)
class _Kind:
    """One kind of candidate: how to find them on a plan, and why computing them whole helps."""

    find: Callable[[LayoutPlan, Sites], dict[str, str | None]]  # candidates -> the op a note names, if any
    why: str
    budget: float  # the share of their block's matmul work per rank they may add
    colwise: bool = False  # made colwise (no work added), not computed whole

    def why_for(self, plan: LayoutPlan, sites: Sites, fqns: list[str]) -> dict[str, str]:
        """Each candidate's reason, naming the op it concerns when the kind knows one."""
        at = self.find(plan, sites)
        return {fqn: self.why.format(at=f" for {at[fqn]}" if at.get(fqn) else "") for fqn in fqns}


_KINDS = (  # upstream first: a bottleneck cut turns everything after it, pulling linears included
    _Kind(_bottlenecks, "a narrowing linear whose cut output a wider linear reads: cut, that linear turns "
                        "rowwise and its wide output is all-reduced; whole, the wide linear is colwise",
          BOTTLENECK_BUDGET),
    _Kind(_pulling_linears, "its sharded output would cut the replicated stream it meets and turn the linears "
                            "after it", COMPUTE_BUDGET),
    _Kind(_shared_rowwise, "one weight read on a cut input first and on replicated inputs after: rowwise, each "
                           "replicated read is cut for it and its partial output reduced; colwise, the cut read is "
                           "gathered", 0.0, colwise=True),
)


# tried last, on the settled plan (see settle)
_GATHERED = _Kind(_gathered, "its cut output alone is gathered whole{at}: cut, it saves a share of its matmul and "
                             "pays an all-gather of its output forward and an all-reduce of its input's gradient "
                             "backward", GATHERED_BUDGET)


def _region(plan: LayoutPlan, source: fx.Node) -> set[fx.Node]:
    """Values and ops reached from ``source`` through uses that keep it sharded."""
    region, expanded, frontier = {source}, set(), [source]
    while frontier:
        node = frontier.pop()
        if node in expanded:
            continue
        expanded.add(node)
        for user in node.users:
            steps = plan.edges.get((node, user), ())
            if any(step.kind in (Step.GATHER, Step.GATHER_FOR_COLWISE) for step in steps):
                continue
            region.add(user)  # an op reading the sharded value, whatever it makes
            layout = _layout(plan, user)
            if layout is not None and layout not in PARTIALS:
                frontier.append(user)
    return region


def _layout(plan: LayoutPlan, node: fx.Node):
    """A node's layout; one output of a multi-output op (``getitem``) has its own."""
    if node.op == "call_function" and node.target is operator.getitem:
        whole = plan.layouts.get(node.args[0])
        if isinstance(whole, tuple) and isinstance(node.args[1], int) and node.args[1] < len(whole):
            return whole[node.args[1]]
    return plan.layouts.get(node)


def _compared(revised: tuple[int, int, int], kept: tuple[int, int, int]) -> str:
    """What a kept trial bought, in a note's words."""
    if revised[0] < kept[0]:
        return f"the plan's tp collectives are {revised[0]} instead of {kept[0]}"
    if revised[1] < kept[1]:
        return f"{revised[1]} blocks break tp instead of {kept[1]}, at the same {revised[0]} tp collectives"
    return f"the plan's tp collectives move {revised[2]:,} wire bytes per rank instead of {kept[2]:,}"


def _cost(plan: Plan) -> tuple[int, int, int]:
    """(tp collectives per training step, blocks whose tp breaks, tp wire bytes per rank): compared
    in that order."""
    wire = plan.predicted_comm().get(TP, {})
    return plan.num_tp_collectives(), len({u for u, _ in plan.breaks}), sum(bytes_ for _, bytes_ in wire.values())
