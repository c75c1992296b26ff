"""Propagate: decide each site's role and each activation's tp layout.

Walks the graph once in topological order with one layout per value: ``None``
(replicated over tp) or ``d`` (sharded in equal contiguous chunks along dim
``d``). Sites decide roles greedily, Megatron style:

* a linear whose input is replicated becomes **colwise** (its output is
  sharded on the last dim, no communication);
* a linear whose input is sharded on its last dim becomes **rowwise** (its
  output is partial, all-reduced once, then replicated);
* an embedding shards its embedding dim (stored ``[num, dim]`` is already the
  ``[in, out]`` form, so the table is a colwise weight).

Between sites, layout rules (:mod:`passes.layout_rules`) carry a sharding through
elementwise ops, gating products, views to heads, attention and reductions over
other dims. A sharded value reaching an op with no rule (a residual add with a
replicated value, a norm over the sharded dim, the graph output) is gathered
once, and every consumer that needs it full reads the gathered copy.

Each place where a consumer needs another layout than its producer gives is an
*edge* with a :class:`Redistribute`; :mod:`autoshard.passes.redistribute` turns edges into
collective nodes. Replicated inputs of colwise linears get ``enter_tp`` edges:
one per value, so linears sharing an input (q/k/v, gate/up) add their partial
input-gradients locally and all-reduce once.

Every replicated input that carries a gradient into an op with a sharded
output gets ``enter_tp`` too: its gradient from that op is a sum over this
rank's shard only (a norm's ``rsqrt`` broadcast over a sharded hidden dim, a
q/k-norm weight applied to sharded heads).

A sharded region that never reaches a rowwise linear gains nothing from
staying sharded (an embedding whose output meets a norm, an LM head whose
logits are returned). When it costs fewer collectives to gather its sources
right away than to pay for its exits (gathers, and enter_tp on replicated
inputs it consumes), its sources are gathered at once and everything after
runs replicated; BERT's three summed embeddings instead stay sharded until
their one LayerNorm. Propagation reruns until no region changes.

A fused projection (one colwise linear whose output is split along its
sharded dim into q|k|v or gate|up) stays sharded: the weight's output
columns are permuted at materialize time so each rank holds its share of
every section, and the split takes local sizes. Whole heads stay on one rank
because each section's view to heads must divide by tp like any other.

An *expert site* (:mod:`passes.experts`: a matmul on one expert of a stacked
``[E, out, in]`` weight) takes a role the same way; its parameter is stored cut
over tp on the out dim (colwise) or the in dim (rowwise), so the expert picks
between the parameter and the matmul carry the cut without communication.

Reruns also revise two choices. A narrowing linear (fewer outputs than inputs:
a router) whose region is idle is computed whole instead of gathered. A region
of partial sums whose products meet gradient-carrying replicated values (top-k
routing weights) is reduced right at its products when one all-reduce per
product costs fewer collectives than the region's reductions plus an extra
backward all-reduce per such value.

With a user plan the roles come from the plan and only layouts are derived;
a role that disagrees with the incoming layout costs a redistribute, never a
wrong result.

A stack whose blocks past the second were written as copies of the second
(:mod:`passes.reuse_blocks`) is decided once per walk: the second block is
visited and its decisions stamped on every copy whose code and inputs are
checked to be the same (:mod:`passes.stamping`), so a walk over 80 blocks
costs about what a walk over 3 does.
"""

from __future__ import annotations

import dataclasses
import enum
import operator

import torch
import torch.fx as fx

from autoshard.core.errors import describe
from autoshard.core.options import DEFAULT_OPTIONS, PlanOptions
from autoshard.core.sharding import Indivisible, Role, Step
from autoshard.passes import dtensor_rules, layout_rules
from autoshard.passes.decompose import NORMS, decompose_norm
from autoshard.passes.discover import EmbeddingSite, LinearSite, Sites
from autoshard.passes.experts import ExpertSite
from autoshard.passes.layout_rules import Layout, Strided
from autoshard.passes.stamping import Arrival, Copies, Key, Stamper, find_copies
from autoshard.plans.block_owners import unit_of_node
from autoshard.plans.plan import FusedSections

COLWISE, ROWWISE, REPLICATE = Role.COLWISE, Role.ROWWISE, Role.REPLICATE
# A weight tied between the input embedding and the LM head, stored [vocab, dim]
# with its vocabulary rows cut over tp: the head is colwise over the vocabulary,
# the embedding a masked lookup whose partial output is all-reduced.
VOCAB_PARALLEL = Role.VOCAB_PARALLEL
COLWISE_LIKE = (COLWISE, VOCAB_PARALLEL)

ENTER_TP, GATHER, TAKE_SHARD, REDUCE = Step.ENTER_TP, Step.GATHER, Step.TAKE_SHARD, Step.REDUCE
PARTIAL, PARTIAL_AVG, PARTIALS = layout_rules.PARTIAL, layout_rules.PARTIAL_AVG, layout_rules.PARTIALS
# loss parallel: a model output sharded on its last (vocabulary) dim leaves the graph as a
# DTensor ``Shard(-1)`` on the tp mesh instead of being gathered
SHARDED_OUTPUT = Step.SHARDED_OUTPUT
# sequence parallel: a sequence-sharded input of colwise linears, all-gathered forward,
# its partial gradient reduce-scattered backward (one op instead of gather + enter_tp)
GATHER_FOR_COLWISE = Step.GATHER_FOR_COLWISE
SEQ_DIM = 1  # [batch, seq, hidden] activations

_aten = torch.ops.aten
# ops whose result carries no gradient back to their inputs: detach, and new tensors that only
# take their input's shape (``torch.zeros_like(x)`` as an accumulator)
_GRAD_STOPS = (
    _aten.detach.default, _aten.detach_.default, _aten.zeros_like.default, _aten.ones_like.default,
    _aten.empty_like.default, _aten.full_like.default, _aten.new_zeros.default, _aten.new_ones.default,
    _aten.new_empty.default, _aten.new_full.default,
)


@dataclasses.dataclass(frozen=True)
class Redistribute:
    """What a consumer needs done to a value before reading it: ``kind`` on ``dim`` (the sharded
    dim gathered or cut; none for a sum); ``average`` for a reduced partial mean; ``sections``: a
    cut that follows a fused projection's stored sections (a constant along its output)."""

    kind: Step
    dim: int | Strided | None = None
    average: bool = False
    sections: FusedSections | None = None


@dataclasses.dataclass(frozen=True)
class EnterTpBucket:
    """Parameters of one block whose gradients enter tp (``enter_tp``), by one op placed before
    ``first``, the earliest of their consumers."""

    values: tuple[fx.Node, ...]
    first: fx.Node


@dataclasses.dataclass(frozen=True)
class TakeShardBucket:
    """``values`` cut on ``dim`` for ``consumers`` (one each) by one op placed before ``first``."""

    values: tuple[fx.Node, ...]
    consumers: tuple[fx.Node, ...]
    dim: int
    first: fx.Node


# Everything a walk writes, and how each is keyed (for stamping a template's decisions on its copies).
STATE_KEYS = {
    "roles": Key.FQN, "layouts": Key.NODE, "edges": Key.EDGE, "new_args": Key.NODE, "notes": Key.FQN,
    "fused": Key.FQN, "sharded_params": Key.FQN, "stream_entries": Key.NODE, "whole_sequences": Key.FQN,
    "input_sections": Key.FQN, "section_splits": Key.NODE, "convolutions": Key.NODE, "role_notes": Key.FQN,
}


@dataclasses.dataclass(frozen=True)
class _SiteIndex:
    """The sites by the nodes a walk meets: a site's op, an expert's matmul, the nodes a site owns
    (a folded bias add, a weight transpose, an expert pick) and a site's output."""

    site_of: dict[fx.Node, object]
    expert_of: dict[fx.Node, ExpertSite]
    owned: dict[fx.Node, object]
    output_site: dict[fx.Node, object]

    @classmethod
    def of(cls, sites: Sites) -> _SiteIndex:
        owned = {n: s for s in sites.linears for n in s.nodes if n is not s.node}
        owned.update({n: s for s in sites.experts for n in s.chain})
        return cls({s.node: s for s in sites.all}, {s.node: s for s in sites.experts}, owned,
                   {s.output: s for s in (*sites.linears, *sites.experts)})


def block_copies(graph: fx.Graph, sites: Sites, carries_grad: frozenset[fx.Node],
                 written: tuple[str, ...]) -> Copies | None:
    """The copies of ``written[0]`` among ``written[1:]`` whose code is the same, for a walk to stamp."""
    if len(written) < 2:
        return None
    index = _SiteIndex.of(sites)

    def facts(node: fx.Node) -> tuple | bool:
        site = index.site_of.get(node) or index.expert_of.get(node) or index.output_site.get(node)
        if site is None and node not in index.owned:
            return node in carries_grad  # most nodes: no site, only whether a gradient flows
        tied = tuple(f in sites.tied for f in site.param_fqns) if site is not None else ()
        return (index.site_of.get(node), index.expert_of.get(node), index.owned.get(node),
                index.output_site.get(node), node in carries_grad, tied)

    return find_copies(graph, written[0], written[1:], facts)


def _module_of(node: fx.Node) -> str:
    """The innermost module whose code made ``node`` (its ``nn_module_stack``), or ``""``."""
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


class RowwiseExit(enum.Enum):
    """How a rowwise linear's partial product leaves it; decided once, by :meth:`LayoutPlan.rowwise_exit`,
    and read by the rewrite that emits it and by the plan that records it."""

    ALL_REDUCE = enum.auto()  # the total, all-reduced at once
    REDUCE_SCATTER = enum.auto()  # sequence parallelism: reduce-scattered over the sequence
    PARTIAL = enum.auto()  # left a partial sum, reduced where a consumer needs the total (possibly shared)


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """Roles of the sites and the tp layouts of every value (internal, holds nodes).

    ``layouts`` maps a node to the layout of the value it computes locally;
    for a rowwise site's ``node`` that is the partial sum, for its ``output``
    the reduced value. ``edges`` maps ``(producer, consumer)`` to the
    redistributions on that use, applied in order. ``new_args`` are the
    rewritten shape arguments of views whose sharded dim shrinks to its local
    size.
    """

    roles: dict[str, Role]
    layouts: dict[fx.Node, Layout]
    edges: dict[tuple[fx.Node, fx.Node], tuple[Redistribute, ...]]
    new_args: dict[fx.Node, tuple]
    tp: int
    # weight FQN -> why replicated over tp: a dim that does not divide, or why computed whole
    notes: dict[str, Indivisible | str] = dataclasses.field(default_factory=dict)
    fused: dict[str, FusedSections] = dataclasses.field(default_factory=dict)  # weight FQN -> sections
    # colwise outputs gathered right after the matmul -> where their region would have ended
    gathered_early: dict[fx.Node, str] = dataclasses.field(default_factory=dict)
    sequence_parallel: bool = False
    loss_parallel: bool = False  # outputs cut on their last dim leave as DTensors
    carries_grad: frozenset[fx.Node] = frozenset()  # values a gradient flows back through
    # parameters that are no linear's weight but are read sharded by one op (a norm's weight over
    # a sharded width): FQN -> the dim tp cuts; stored that way, so no step cuts or gathers them
    sharded_params: dict[str, int] = dataclasses.field(default_factory=dict)
    # under sequence parallelism, the weights whose output stays whole over tp because its sequence
    # does not divide by tp (a class token's 17 positions, a pooled stage's 1): FQN -> why
    whole_sequences: dict[str, Indivisible] = dataclasses.field(default_factory=dict)
    block_fqns: tuple[str, ...] = ()  # the FSDP blocks, by which parameters' gradients are bucketed
    # dense convolutions over channels cut like linears: node -> (weight FQN, COLWISE or ROWWISE)
    convolutions: dict[fx.Node, tuple[str, Role]] = dataclasses.field(default_factory=dict)
    # weight FQN -> why its role is not the one its first read's input layout gives (a cost comparison)
    role_notes: dict[str, str] = dataclasses.field(default_factory=dict)

    def rowwise_exit(self, site: LinearSite) -> RowwiseExit | None:
        """How ``site``'s output leaves it, if its weight is rowwise: propagation left its output
        partial (a later reduce sums it), sharded over the sequence, or whole."""
        if self.roles[site.weight_fqn] != ROWWISE:
            return None
        layout = self.layouts.get(site.output)
        if layout in PARTIALS:
            return RowwiseExit.PARTIAL
        return RowwiseExit.REDUCE_SCATTER if layout == SEQ_DIM else RowwiseExit.ALL_REDUCE

    def enter_tp_buckets(self) -> tuple[EnterTpBucket, ...]:
        """A block's parameters read by its sharded ops (q and k norm weights applied to cut heads,
        a per-head output norm's), each only through ``enter_tp`` and all in one block: one op
        for all of them, so their partial gradients are summed in one all-reduce at the end of
        the block's backward instead of one each."""
        consumers: dict[fx.Node, list[fx.Node]] = {}
        for (value, consumer), steps in self.edges.items():
            if value.op == "get_attr" and value in self.carries_grad:
                if steps == ENTER_ONLY:
                    consumers.setdefault(value, []).append(consumer)
                else:
                    consumers[value] = []  # read another way too: left alone
        position = {}
        groups: dict[tuple, list[tuple[fx.Node, fx.Node]]] = {}
        for value, readers in consumers.items():
            units = {unit_of_node(c, self.block_fqns) for c in readers}
            if len(units) != 1:
                continue
            if not position:
                position = {n: i for i, n in enumerate(value.graph.nodes)}
            first = min(readers, key=position.__getitem__)
            groups.setdefault((units.pop(), value.meta["val"].dtype), []).append((value, first))
        # in graph order: every rank must lay its gradients out alike in the one all-reduce
        return tuple(EnterTpBucket(tuple(sorted((v for v, _ in pairs), key=position.__getitem__)),
                                   min((c for _, c in pairs), key=position.__getitem__))
                     for pairs in groups.values() if len(pairs) > 1)

    def take_shard_buckets(self) -> tuple[TakeShardBucket, ...]:
        """Replicated values cut on the same dim for consumers in one module (k and v of one
        attention, whose kv heads were repeated per q head, whatever their shapes: ``k.mT`` and ``v``
        of a hand-written attention), each carrying a gradient and read that
        way by one consumer only, and all computed before the first of those consumers: their cuts
        are one op, and their gradients one all-gather."""
        readers: dict[tuple, set] = {}
        for (value, consumer), steps in self.edges.items():
            readers.setdefault((value, steps), set()).add(consumer)
        position = {}
        groups: dict[tuple, list[tuple[fx.Node, fx.Node]]] = {}
        for (value, consumer), steps in self.edges.items():
            if (len(steps) == 1 and steps[0].kind == TAKE_SHARD and isinstance(steps[0].dim, int)
                    and value in self.carries_grad and readers[(value, steps)] == {consumer}):
                if not position:
                    position = {n: i for i, n in enumerate(consumer.graph.nodes)}
                groups.setdefault((_module_of(consumer), steps[0].dim), []).append((value, consumer))
        buckets = []
        for (_, dim), pairs in groups.items():
            first = min((c for _, c in pairs), key=position.__getitem__)
            pairs = [(v, c) for v, c in pairs if position[v] < position[first]]
            if len(pairs) > 1:
                buckets.append(TakeShardBucket(tuple(v for v, _ in pairs), tuple(c for _, c in pairs), dim, first))
        return tuple(buckets)


def propagate(
    gm: fx.GraphModule,
    sites: Sites,
    tp: int,
    roles: dict[str, Role] | None = None,
    options: PlanOptions = DEFAULT_OPTIONS,
    whole: dict[str, str] | None = None,
    written: tuple[str, ...] = (),
    block_fqns: tuple[str, ...] = (),
    colwise: dict[str, str] | None = None,
) -> LayoutPlan:
    """Assign roles (greedy, or from ``roles``) and layouts, on a graph :func:`~autoshard.passes.
    normalize.normalize` has rewritten. ``whole``: linears to compute whole over tp (weight FQN
    -> why), as :mod:`autoshard.passes.alternatives` decides by comparing plans; ``colwise``:
    shared linears it decides colwise, whatever the layout of their first read's input.

    Propagation reads the graph and rewrites one thing only: a norm over a width it shards
    (a q/k norm over all heads) is written out in ops that reduce over the sharded dim
    (:func:`~autoshard.passes.decompose.decompose_norm`), and the walk runs again. Which norms
    those are depends on the layouts, so this rewrite cannot happen before.

    A weight whose sharded dim does not divide by ``tp`` is replicated over tp
    (``options.on_indivisible="replicate"``, noted in the plan) or is an error
    (``"error"``, and always when the role comes from a user plan).
    ``options.loss_parallel`` returns outputs sharded on their last dim (LM-head
    logits over the vocabulary) as DTensors instead of gathering them.
    ``options.sequence_parallel`` keeps the residual stream (norms, dropout,
    residual adds) sharded over the sequence between blocks: reduce-scatter
    after each rowwise linear, all-gather before each colwise group.

    ``written``: a stack's block 1 and the blocks written as its copies
    (:attr:`~autoshard.passes.capture.CapturedGraph.written`); each walk decides block 1
    once and stamps its decisions on every copy found to be the same code
    (:mod:`~autoshard.passes.stamping`). ``block_fqns``: the FSDP blocks, within each of which
    the gradients of parameters entering tp are bucketed (:meth:`LayoutPlan.enter_tp_buckets`).
    """
    _check_roles_cover_sites(roles, sites)
    carries_grad = _carries_grad(gm)
    copies = block_copies(gm.graph, sites, carries_grad, written)
    revised = Revisions(sites, may_replicate=roles is None, whole=whole, colwise=colwise)
    while True:
        plan = Propagation(gm, sites, tp, roles, options, carries_grad, revised, copies).run()
        norms = _norms_over_sharded_width(plan, sites)
        if norms:
            for norm in norms:
                decompose_norm(gm.graph, norm)
            carries_grad = _carries_grad(gm)
            copies = block_copies(gm.graph, sites, carries_grad, written)
            continue
        if not revised.learn(plan):
            return dataclasses.replace(plan, gathered_early=revised.gathered_early, block_fqns=tuple(block_fqns))


@dataclasses.dataclass(frozen=True)
class IdleRegion:
    """Where an idle region ends: ``why`` names the first op it meets the replicated world at (for
    the plan's notes), ``gathered_at`` are the ops that gather it whole."""

    why: str
    gathered_at: frozenset[fx.Node]


@dataclasses.dataclass(frozen=True)
class RegionCost:
    """The tp collectives one region of a walk costs as it is (``kept``) and revised (``revised``).

    A revision changes only the uses inside its region and at its border, so the difference of
    these two counts is the difference of the whole block's tp collective totals (what
    ``predicted_comm`` would count for the two plans), without planning both.
    """

    kept: int
    revised: int

    @property
    def cheaper(self) -> bool:
        return self.revised < self.kept

    @property
    def no_dearer(self) -> bool:
        return self.revised <= self.kept


class Revisions:
    """What one walk learns for the next, by comparing costs on its finished :class:`LayoutPlan`.

    Each revision is a method that reads the plan and returns what it would change, each
    change paid for by a :class:`RegionCost`:

    * :meth:`idle_sources`: a colwise output whose sharded region reaches no rowwise linear
      is gathered right after the matmul (``gathered_early``: source -> where its region
      would have ended), or, for a narrowing linear (fewer outputs than inputs, a router),
      computed whole (``replicated``: FQN -> why, as its note says it);
    * :meth:`partials_reduced_early`: partial products all-reduced where they are made
      (``reduced_early``).

    What is learned only grows, so the walks end.
    """

    def __init__(self, sites: Sites, may_replicate: bool = True, whole: dict[str, str] | None = None,
                 colwise: dict[str, str] | None = None):
        self.sites = sites
        self.may_replicate = may_replicate  # False under a user plan: its roles are kept
        self.narrowing = {
            s.output: s for s in sites.linears if s.out_features < s.in_features and s.weight_fqn not in sites.tied
        }
        # tables of fewer rows than features (class labels, token types): a lookup does no arithmetic,
        # so computed whole such a table costs only its memory, less than one square weight's
        self.small_tables = {
            s.node: s for s in sites.embeddings if s.num_embeddings < s.embedding_dim and s.weight_fqn not in sites.tied
        }
        self.gathered_early: dict[fx.Node, str] = {}
        self.replicated: dict[str, str] = dict(whole or {})  # seeded: linears a cost comparison computes whole
        self.colwise: dict[str, str] = dict(colwise or {})  # seeded: shared linears it decides colwise
        self.reduced_early: set[fx.Node] = set()

    def learn(self, plan: LayoutPlan) -> bool:
        """Take every revision that pays on ``plan``; whether anything new was learned."""
        idle = {s: found for s, found in self.idle_sources(plan).items() if s not in self.gathered_early}
        early = self.partials_reduced_early(plan) - self.reduced_early
        convolutions = {node: fqn for node, (fqn, role) in plan.convolutions.items() if role == COLWISE}
        others = {c for s, found in idle.items() if s not in self.narrowing for c in found.gathered_at}
        meeting = {s: found for s, found in idle.items() if self.may_replicate and s in self.narrowing
                   and s in plan.carries_grad and found.gathered_at & others}
        if meeting:
            # a narrowing projection whose cut is gathered where another region's is: k/v with fewer heads
            # than tp (multi-query attention's one head, cut on its head dim) stop q's cut at the attention
            # or at q @ k.T. Computed whole first, they are cut per q head there and q keeps its cut, where
            # deciding q in the same walk would gather it. Only where gradients flow: a no-grad scorer
            # (DeepSeek's indexer, one key head) computed whole costs no collective at all
            idle = meeting
        for source, found in idle.items():
            why = found.why
            if source in convolutions:
                self.replicated[convolutions[source]] = (
                    f"its output channels reach nothing that reads them cut (its sharded region ends at {why}); "
                    f"computed whole, it needs no collective")
            elif source in self.narrowing and self.may_replicate:
                site = self.narrowing[source]
                self.replicated[site.weight_fqn] = (
                    f"its {site.out_features} outputs (fewer than its {site.in_features} inputs) feed no rowwise "
                    f"linear (its sharded region ends at {why}); computed whole, it needs no collective")
            elif source in self.small_tables and self.may_replicate:
                site = self.small_tables[source]
                self.replicated[site.weight_fqn] = (
                    f"a table of {site.num_embeddings} rows (fewer than its {site.embedding_dim} features) whose "
                    f"output feeds no rowwise linear (its sharded region ends at {why}); a lookup does no arithmetic: "
                    f"computed whole, it needs no collective")
            else:
                self.gathered_early[source] = why
        self.reduced_early |= early
        return bool(idle or early)

    def idle_sources(self, plan: LayoutPlan) -> dict[fx.Node, IdleRegion]:
        """Sources of idle regions (reaching no rowwise linear) cheaper to gather at once, each
        with the first place its region met the replicated world and the ops that gather it.

        Kept, a region costs a collective wherever it meets the replicated world (a gather out
        of it, a replicated input entering it); revised, one gather per source."""
        sites = self.sites
        useful = _useful(plan, sites)
        sources = {s.output for s in sites.linears if plan.roles[s.weight_fqn] in COLWISE_LIKE}
        sources |= {node for node, (_, role) in plan.convolutions.items() if role == COLWISE}
        if not plan.sequence_parallel:  # under sequence parallelism embeddings feed the sharded stream
            sources |= {s.node for s in sites.embeddings if plan.roles[s.weight_fqn] == COLWISE}
        idle = {}
        position: dict[fx.Node, int] = {}
        for region in _regions(plan, useful):
            region_sources = region & sources
            if _leaves_cut(plan, region):
                continue  # the model's output, left cut on purpose (loss parallelism): no region to end
            cost = RegionCost(kept=_exit_cost(plan, region), revised=len(region_sources))
            if not region_sources or not cost.no_dearer:  # a tie gathers early: sharding bought nothing
                continue
            exits = [c for (v, c) in plan.edges if v in region and _gathers(plan, v, c)]
            contractions = _contractions(plan, region)
            if (contractions and not exits and not cost.cheaper and not region & plan.carries_grad
                    and not any(source in self.narrowing for source in region_sources)):
                # a tie, where a region without gradients (a no-grad indexer's scores) ends only in
                # sums over its cut dim: kept cut, its work shared and its reduced sum no break (a
                # narrowing linear, a few outputs per token, is computed whole instead, as on any tie)
                continue
            gathered_at = frozenset(exits)
            exits += contractions
            if exits and not position:
                position = {n: i for i, n in enumerate(exits[0].graph.nodes)}
            first = min(exits, key=position.__getitem__, default=None)
            why = describe(first) if first is not None else "nowhere"
            idle.update(dict.fromkeys(region_sources, IdleRegion(why, gathered_at)))
        return idle

    def partials_reduced_early(self, plan: LayoutPlan) -> set[fx.Node]:
        """Rowwise products whose partial sums should be all-reduced where they are made.

        A partial sum kept partial is reduced once, where a consumer needs the total, and two
        of them added first share that reduction (a parallel block). But a partial multiplied by
        a replicated value that carries a gradient (MoE routing weights) makes that value's
        gradient partial too: one more all-reduce, in backward. Per connected region of partial
        values, kept costs its reductions plus those ``enter_tp``s; revised, one all-reduce per
        product. Counted in collectives: reducing early may move more bytes (a top-k MoE reduces
        its k outputs per token before they are weighted and summed)."""
        sites = self.sites
        products = {s.node for s in sites.linears} | {s.node for s in sites.experts}
        partial = {n for n, lay in plan.layouts.items() if lay in PARTIALS}
        reduced_values = {v for (v, _), steps in plan.edges.items() if steps and steps[0].kind == REDUCE}
        entered_pairs = [(v, c) for (v, c), steps in plan.edges.items() if any(s.kind == ENTER_TP for s in steps)]
        early: set[fx.Node] = set()
        for region in _components(partial, lambda value, user: (value, user) not in plan.edges):
            sources = {n for n in region if not any(i in region for i in n.all_input_nodes)}
            if not sources <= products:
                continue
            entered = {v for v, c in entered_pairs if c in region and v not in region}
            cost = RegionCost(kept=len(reduced_values & region) + len(entered), revised=len(sources))
            if entered and cost.cheaper:  # a tie keeps the region partial
                early |= sources
        return early


class Propagation:
    """One walk over the graph in topological order: each site's role, each value's layout and
    the redistributions its consumers need (see the module docstring).

    The walk only reads the graph. Its state is what it has decided so far: ``roles``,
    ``layouts``, ``edges`` (``(producer, consumer)`` -> steps), ``new_args`` (views whose
    sharded dim shrinks), ``notes``, ``fused`` sections and ``sharded_params``. ``visit``
    decides one node from what its inputs have been given, so a test seeds input layouts and
    visits a single op (``tests/test_rules.py``); ``run`` visits every node and returns the
    :class:`LayoutPlan`.

    ``roles`` fixes the sites' roles (a user plan); ``carries_grad`` are the values a gradient
    flows back through; ``revised`` is what earlier walks learned (:class:`Revisions`);
    ``copies``: blocks whose decisions are stamped from their template's (``stamped`` lists
    those the walk stamped).
    """

    def __init__(self, gm: fx.GraphModule, sites: Sites, tp: int, roles: dict[str, Role] | None = None,
                 options: PlanOptions = DEFAULT_OPTIONS, carries_grad: frozenset[fx.Node] = frozenset(),
                 revised: Revisions | None = None, copies: Copies | None = None):
        self.gm, self.sites, self.tp, self.options = gm, sites, tp, options
        self.carries_grad = carries_grad
        self.revised = revised or Revisions(sites)
        self.copies = copies
        self.stamped: tuple[str, ...] = ()
        self.fixed_roles = roles
        self.roles: dict[str, Role] = dict(roles or {})
        self.layouts: dict[fx.Node, Layout] = {}
        self.edges: dict[tuple[fx.Node, fx.Node], tuple[Redistribute, ...]] = {}
        self.new_args: dict[fx.Node, tuple] = {}
        self.notes: dict[str, Indivisible | str] = {}
        self.fused: dict[str, FusedSections] = {}
        self.sharded_params: dict[str, int] = {}
        self.stream_entries: set[fx.Node] = set()  # embedding outputs read sequence-sharded
        self.input_sections: dict[str, FusedSections] = {}  # rowwise weights reading a cat of sections
        self.section_splits: dict[fx.Node, tuple[int, ...]] = {}  # splits back into a cat's sections
        self.convolutions: dict[fx.Node, tuple[str, Role]] = {}  # dense convolutions cut over channels
        self.whole_sequences: dict[str, Indivisible] = {}
        self.role_notes: dict[str, str] = {}
        index = _SiteIndex.of(sites)
        self.site_of, self.expert_of, self.owned, self.output_site = (
            index.site_of, index.expert_of, index.owned, index.output_site)
        self.param_fqns = {n.target for n in gm.graph.nodes if n.op == "get_attr" and n.meta.get("val") is not None
                           and getattr(n.meta["val"], "requires_grad", False)} | {
                               fqn for s in sites.all for fqn in s.param_fqns}

    def run(self) -> LayoutPlan:
        stamper = Stamper(self, self.copies, STATE_KEYS) if self.copies is not None else None
        for node in self.gm.graph.nodes:
            if stamper is None or not stamper.handles(node):
                self.visit(node)
        self.stamped = tuple(stamper.stamped) if stamper is not None else ()
        _share_gathers(self.edges)
        _hoist_take_shard(self.edges, self.layouts, self.new_args, self.tp)
        _hoist_enter_tp(self.edges, self.layouts, self.carries_grad)
        return LayoutPlan(
            self.roles, self.layouts, self.edges, self.new_args, self.tp, self.notes, self.fused,
            sequence_parallel=self.options.sequence_parallel, loss_parallel=self.options.loss_parallel,
            carries_grad=self.carries_grad,
            sharded_params=self.sharded_params, whole_sequences=self.whole_sequences,
            convolutions=self.convolutions, role_notes=self.role_notes,
        )

    def visit(self, node: fx.Node) -> None:
        """Decide ``node``'s layout (and its site's role) and what its inputs need."""
        if node in self.owned:
            return  # a folded bias add, a weight transpose, an expert pick: handled with its site
        site = self.site_of.get(node)
        if node in self.expert_of:
            self._expert(self.expert_of[node])
        elif isinstance(site, LinearSite):
            self._linear(site)
        elif isinstance(site, EmbeddingSite):
            self._embedding(site)
        elif node.op == "output":
            self._output(node)
        elif node.op in ("placeholder", "get_attr"):
            self.layouts[node] = None
        else:
            self._op(node)

    # --- what stamping reads and writes (passes.stamping) --------------------------------------

    def state(self) -> dict[str, dict | set]:
        """Everything a visit writes, by name (see :data:`STATE_KEYS`)."""
        return {name: getattr(self, name) for name in STATE_KEYS}

    def arrival(self, value: fx.Node) -> Arrival:
        """What a visit may read of ``value`` when ``value`` comes from outside the block visited."""
        trainable = value.op == "get_attr" and value.target in self.param_fqns
        return Arrival(self.layout(value), self.seen(value), value in self.carries_grad, value in self.new_args,
                       len(value.users), trainable)

    def revised_in(self, nodes: tuple[fx.Node, ...], fqns: tuple[str, ...]) -> tuple:
        """What earlier walks (and a user plan) decided of a block's ``nodes`` and parameters."""
        revised, fixed = self.revised, self.fixed_roles or {}
        return (tuple((n in revised.gathered_early, n in revised.reduced_early) for n in nodes),
                tuple((f in revised.replicated, fixed.get(f), f in self.param_fqns, f in self.sites.tied)
                      for f in fqns))

    def stamped_value(self, name: str, key, value):
        """A template's entry as its copy's: a weight computed whole keeps its own note (it names
        its own op)."""
        if name == "notes" and isinstance(value, str):
            return self.revised.replicated[key]
        return value

    # --- layouts as consumers see them ----------------------------------------------------

    def layout(self, value) -> Layout:
        return self.layouts.get(value) if isinstance(value, fx.Node) else None

    def seen(self, value) -> Layout:
        """The layout consumers plan with: a source gathered early reads as replicated,
        an embedding output under sequence parallelism as sequence-sharded."""
        if value in self.stream_entries:
            return SEQ_DIM
        if value in self.revised.reduced_early and self.layout(value) in PARTIALS:
            return None
        return None if value in self.revised.gathered_early else self.layout(value)

    def seq_ok(self, value: fx.Node, fqn: str) -> bool:
        """Whether ``value`` (the output of weight ``fqn``'s op) is cut along the sequence.

        A sequence whose length does not divide by tp is kept whole, as a weight's dim that does
        not divide is (``on_indivisible="replicate"``, noted on ``fqn``): its rowwise linear
        all-reduces instead of reduce-scattering, and the values that divide stay cut. An error
        with ``on_indivisible="error"`` or a user's roles, and for a symbolic length that may not
        divide (checked with sympy): that is fixed by declaring it divisible, not by a plan
        that gives sequence parallelism up for every length."""
        shape = value.meta["val"].shape
        if len(shape) != 3:
            return False
        seq = layout_rules.size_expr(shape[SEQ_DIM])
        if layout_rules.divides(seq, self.tp):
            return True
        if seq.is_Integer and self.fixed_roles is None and self.options.on_indivisible == "replicate":
            self.whole_sequences[fqn] = Indivisible("sequence length", int(seq), self.tp)
            return False
        raise ValueError(
            f"autoshard: sequence_parallel cuts the sequence over tp={self.tp}, but the sequence length "
            f"{seq} of {describe(value)} may not divide by {self.tp}"
            + ("; declare it divisible, e.g. seq = tp * Dim('chunks')" if not seq.is_Integer
               else "; on_indivisible='replicate' keeps it whole")
        )

    def from_colwise(self, value: fx.Node) -> bool:
        """Whether ``value``'s sharding comes from a colwise linear (Megatron's pair), not from
        an embedding: an embedding's shard never decides that the next linear is rowwise."""
        frontier, visited = [value], set()
        while frontier:
            node = frontier.pop()
            if node in visited:
                continue
            visited.add(node)
            site = self.output_site.get(node)
            if site is not None and self.roles.get(site.weight_fqn) in COLWISE_LIKE:
                return True
            frontier += [v for v in node.all_input_nodes if is_sharded(self.seen(v))]
        return False

    # --- roles ----------------------------------------------------------------------------

    def divisible_role(self, site, role: Role) -> Role:
        """``role``, or replicate (noted) when a dim does not divide by tp and the plan is ours."""
        indivisible = _indivisible(site, role, self.tp)
        if indivisible is None:
            return role
        if self.fixed_roles is not None or self.options.on_indivisible == "error":
            shape = list(site.weight_node.meta["val"].shape) if "val" in site.weight_node.meta else "?"
            raise ValueError(f"autoshard: parameter '{site.weight_fqn}' (shape {shape}) is {role} and "
                             f"{indivisible.reason()}; at {describe(site.node)}")
        self.notes[site.weight_fqn] = indivisible
        return REPLICATE

    def _linear(self, site: LinearSite) -> None:
        node = site.node
        if self._partial_through(site) or self._along_rows(site):
            return
        input_layout = self.seen(site.input)
        if input_layout is not None and not self.from_colwise(site.input):
            input_layout = None  # gathered: a rowwise linear pairs with colwise linears only
        role = self.roles.get(site.weight_fqn) if site.weight_fqn in self.sites.shared else None
        if role is None and site.weight_fqn in self.revised.colwise and self.fixed_roles is None:
            role = self.divisible_role(site, COLWISE)
            self.role_notes[site.weight_fqn] = self.revised.colwise[site.weight_fqn]
        if role is None:  # a shared weight's first read decides for all (its input is redistributed)
            role = _linear_role(site, input_layout, self.roles, self.fixed_roles, site.weight_fqn in self.sites.tied)
            role = self.divisible_role(site, role)
        if self.fixed_roles is None and self._kept_whole(site.weight_fqn):
            role = REPLICATE
        self.roles[site.weight_fqn] = role
        # a cat of sections was accepted for this linear only as its rowwise input
        assert role == ROWWISE or site.weight_fqn not in self.input_sections, site.weight_fqn
        if role in COLWISE_LIKE:
            # A gathered input still needs enter_tp: colwise input-gradients are partial.
            self.require(site.input, node, None, then=(Redistribute(ENTER_TP),))
            self.layouts[node] = self.layouts[site.output] = _ndim(site.output) - 1
        elif role == ROWWISE:
            if site.weight_fqn in self.input_sections:
                self.fused[site.weight_fqn] = self.input_sections[site.weight_fqn]
            self.require(site.input, node, _ndim(site.input) - 1)
            self.layouts[node] = PARTIAL
            sequence_parallel = self.options.sequence_parallel
            if site.bias_node is not None or sequence_parallel:  # reduced (scattered) before the bias
                self.layouts[site.output] = (SEQ_DIM if sequence_parallel and self.seq_ok(site.output, site.weight_fqn)
                                              else None)
        else:
            self.require(site.input, node, None)
            self.layouts[node] = self.layouts[site.output] = None

    def _along_rows(self, site: LinearSite) -> bool:
        """A bias-free linear on an input cut on a dim it does not contract (the heads of
        ``[b, s, heads, d] @ proj``: Inkling's per-head relative logits): each rank applies the
        whole weight to its own rows, and the output keeps the cut. The weight's gradient is a sum
        over the ranks' rows: it enters tp (the block's bucket)."""
        node, layout = site.node, self.seen(site.input)
        if (not self._whole_weight_may_read(site) or not isinstance(layout, int) or layout == _ndim(site.input) - 1
                or (self.options.sequence_parallel and layout == SEQ_DIM)  # the stream: gathered for colwise
                or _ndim(node) != _ndim(site.input)):
            return False
        self._whole_weight_reads(site, layout, "applied whole to each rank's rows of an input cut on a dim it does "
                                              "not contract: its output keeps the cut")
        return True

    def _partial_through(self, site: LinearSite) -> bool:
        """A linear without bias on a partial sum, whose output is added (scaled, viewed) to another
        partial sum: computed whole on each rank's share, it gives each rank's share of its output
        (a linear map of a sum is the sum of the maps), so both are reduced in one all-reduce. A
        LoRA adapter on a rowwise layer (PEFT's ``o_proj``/``down_proj``): ``lora_A`` rowwise, then
        ``lora_B`` through. The weight's gradient is a sum over the ranks' shares: it enters tp."""
        if (not self._whole_weight_may_read(site) or self.seen(site.input) != PARTIAL
                or site.node.target not in (_aten.linear.default, _aten.matmul.default)):
            return False
        value = site.output
        while True:
            (user,) = value.users if len(value.users) == 1 else (None,)
            if user is None or user.op != "call_function":
                return False
            if user.target in _SUMS and len(user.all_input_nodes) == 2:
                other = next(i for i in user.all_input_nodes if i is not value)
                if self.layouts.get(other) != PARTIAL:
                    return False
                break
            scalar = user.target in (_aten.mul.Tensor, _aten.div.Tensor) and user.all_input_nodes == [value]
            if not (scalar or user.target in _SIZED_VIEWS):
                return False
            value = user
        self._whole_weight_reads(site, PARTIAL, "computed whole on each rank's share of its partial-sum input: its "
                                               "output is each rank's share too, reduced with the partial sum it is "
                                               "added to")
        return True

    def _whole_weight_may_read(self, site: LinearSite) -> bool:
        """Whether ``site``'s whole weight may be applied to its input as each rank holds it: a
        bias-free ``x @ W`` on the parameter itself, not shared, tied, revised or fixed by a plan."""
        node = site.node
        return (self.fixed_roles is None and site.bias_node is None and site.weight_cast is None
                and len(node.args) >= 2 and _weight_read(site) is not None
                and site.weight_fqn not in self.sites.shared and site.weight_fqn not in self.sites.tied
                and site.weight_fqn not in self.revised.replicated)

    def _whole_weight_reads(self, site: LinearSite, layout, note: str) -> None:
        """``site`` computed with its whole weight on its input as each rank holds it (``layout``, kept
        by the output). The weight's gradient is then a sum over the ranks: it enters tp."""
        self.roles[site.weight_fqn] = REPLICATE
        self.notes[site.weight_fqn] = note
        self.require(site.input, site.node, layout)
        reader = _weight_read(site)  # the op reading the parameter: the site's, or its transpose
        self.require(site.weight_node, reader, None, then=self.partial_grad(site.weight_node))
        self.layouts[reader] = None
        self.layouts[site.node] = self.layouts[site.output] = layout

    def _embedding(self, site: EmbeddingSite) -> None:
        node = site.node
        sharded_role = VOCAB_PARALLEL if site.weight_fqn in self.sites.tied else COLWISE
        role = self.roles.get(site.weight_fqn, sharded_role)
        if role not in (sharded_role, REPLICATE):
            raise ValueError(
                f"autoshard: embedding '{site.weight_fqn}' can be {sharded_role!r} or 'replicate', not {role!r}"
            )
        role = self.divisible_role(site, role)
        if self.fixed_roles is None and self._kept_whole(site.weight_fqn):
            role = REPLICATE
        self.roles[site.weight_fqn] = role
        self.layouts[node] = _ndim(node) - 1 if role == COLWISE else None  # vocab_parallel: reduced at once
        if self.options.sequence_parallel and self.seq_ok(node, site.weight_fqn):
            self.stream_entries.add(node)  # consumers read it sequence-sharded

    def _expert(self, site: ExpertSite) -> None:
        """A matmul on one expert of a stacked weight: colwise cuts the parameter's output dim,
        rowwise its input dim; the parameter is stored cut that way, so the expert picks between
        it and the matmul only carry the cut along (see :mod:`passes.experts`)."""
        role = self.roles.get(site.weight_fqn)
        if role is None:
            rowwise = self.seen(site.input) == site.input_dim and self.from_colwise(site.input)
            role = self.divisible_role(site, ROWWISE if rowwise else COLWISE)
            self.roles[site.weight_fqn] = role
        node = site.node
        if role == REPLICATE:
            self.require(site.input, node, None)
            self.layouts.update({n: None for n in (site.weight_node, *site.chain, node)})
            return
        param_dim = site.out_dim if role == COLWISE else site.in_dim
        self.sharded_params[site.weight_fqn] = param_dim
        self.layouts[site.weight_node] = param_dim
        for link in site.chain:
            self.layouts[link] = site.dim_in_chain(link, param_dim)
        if role == COLWISE:
            self.require(site.input, node, None, then=self.partial_grad(site.input))
            self.layouts[node] = site.output_dim
        else:
            self.require(site.input, node, site.input_dim)
            self.layouts[node] = PARTIAL

    # --- every other op ---------------------------------------------------------------------

    def _output(self, node: fx.Node) -> None:
        for value in node.all_input_nodes:
            lay = self.layout(value)
            if self.options.loss_parallel and isinstance(lay, int) and lay == _ndim(value) - 1:
                self.edges[(value, node)] = (Redistribute(SHARDED_OUTPUT, lay),)
            else:
                self.require(value, node, None)

    def _op(self, node: fx.Node) -> None:
        """An op between sites: its layout rule (or DTensor's strategy) if any input is sharded,
        else (or when no rule fits) its inputs gathered and its output replicated."""
        inputs = {v: self.seen(v) for v in node.all_input_nodes}
        decision = None
        if not any(lay is not None for lay in inputs.values()) and self._colwise_convolution(node):
            return
        if any(lay is not None for lay in inputs.values()):
            decision = (self._nested_sections(node, inputs) or layout_rules.apply(node, inputs, self.tp)
                        or dtensor_rules.query(node, inputs, self.tp))
        convolution = node.target in layout_rules.CONVOLUTIONS
        if decision is not None and convolution and decision.output == layout_rules.PARTIAL:
            weight = _dense_convolution_weight(node, self.param_fqns)
            if weight is None or self.fixed_roles is not None:
                decision = None
            else:
                self.convolutions[node] = (weight, ROWWISE)
        if decision is not None and decision.fused_sections is not None:
            if node.target == _aten.cat.default:
                decision = self._read_in_sections(node, decision) or self._sections_to_split(node, decision)
            elif self.section_splits.get(node) == decision.fused_sections:
                pass  # split back into the sections a cat made (see _sections_to_split)
            else:
                decision = self._fuse(decision)
        if decision is None:
            for value in node.all_input_nodes:
                self.require(value, node, None)
            self.layouts[node] = None
            return
        self.layouts[node] = decision.output
        sharded_output = is_sharded(decision.output)
        for value, wanted in decision.inputs.items():
            then = self.partial_grad(value) if sharded_output and wanted is None else ()
            self.require(value, node, wanted, then)
        if decision.args is not None:
            self.new_args[node] = decision.args

    def _read_in_sections(self, node: fx.Node, decision):
        """Accept a cat of sharded sections along their sharded dim when its one reader is a linear
        that will be rowwise on it: that weight stores its input rows section by section per rank
        (``fused``), so each rank's rows match its share of each section."""
        (reader,) = node.users if len(node.users) == 1 else (None,)
        site = self.site_of.get(reader)
        if (not isinstance(site, LinearSite) or site.input is not node or site.weight_fqn in self.sites.shared
                or site.weight_fqn in self.sites.tied or self.fixed_roles is not None
                or site.weight_fqn in self.revised.replicated
                or not all(self.from_colwise(value) for value in node.all_input_nodes)
                or decision.output != _ndim(node) - 1 or _indivisible(site, ROWWISE, self.tp) is not None):
            return None
        self.input_sections[site.weight_fqn] = FusedSections(decision.fused_sections)
        return decision

    def _colwise_convolution(self, node: fx.Node) -> bool:
        """A dense convolution (``groups=1``) of a replicated input by a parameter is colwise over
        its output channels, like a linear over its features: the weight is stored cut on dim 0
        (FSDP takes another dim), the output is cut on its channel dim 1 and the input's gradient
        is all-reduced (``enter_tp``). Not when a revision computes it whole (its cut channels
        reach nothing that reads them cut), under a user plan, or when the channels do not divide."""
        weight = _dense_convolution_weight(node, self.param_fqns)
        if weight is None:
            return self._grouped_convolution(node)
        if self.fixed_roles is not None or node.meta["val"].shape[1] % self.tp or self._kept_whole(weight):
            return False
        if self._param_chain(node.args[1], 0) is None:
            return False  # a weight read elsewhere too, or computed: kept whole
        self.require(node.args[1], node, 0)
        self.require(node.args[0], node, None, then=self.partial_grad(node.args[0]))
        self.layouts[node] = 1
        self.convolutions[node] = (weight, COLWISE)
        return True

    def _kept_whole(self, weight: str) -> bool:
        """Whether a revision computes the op of ``weight`` whole; its note then says why."""
        if weight not in self.revised.replicated:
            return False
        self.notes[weight] = self.revised.replicated[weight]
        return True

    def _grouped_convolution(self, node: fx.Node) -> bool:
        """A grouped convolution of a replicated input by parameters, its groups (of several
        channels each) dealt out whole over tp (SqueezeBERT's q/k/v and intermediate
        ``Conv1d(groups=4)``, block-diagonal linears over the channels): each group reads only
        its own input channels, so each rank takes its chunk of the input (``take_shard``, free
        forward; readers of one value share it, and its gradient is all-gathered once), convolves
        it with its groups' filters (weight and bias cut on dim 0) and holds its chunk of the
        output channels. Registered as colwise, so that a revision computes it whole when its cut
        channels reach nothing that reads them cut."""
        conv = layout_rules.Convolution.of(node)
        if conv is None or self.fixed_roles is not None or not layout_rules.cuts_groups(node, self.tp):
            return False
        params = [t for t in (conv.weight, conv.bias) if isinstance(t, fx.Node)]
        weight = _source_param(conv.weight, self.param_fqns) if isinstance(conv.weight, fx.Node) else None
        if weight is None or len(node.args) <= conv.groups_position:
            return False  # filters computed from activations, or groups given as a keyword
        if conv.channels_per_group == 1:
            return False  # depthwise: per-channel work, cheaper whole than cut for a dense conv after it
        if self._kept_whole(weight):
            return False
        if any(self._param_chain(t, 0) is None for t in params):
            return False  # a parameter read elsewhere too: kept whole
        for t in params:
            self.require(t, node, 0)
        self.require(conv.input, node, 1)
        args = list(node.args)
        args[conv.groups_position] = conv.groups // self.tp
        self.new_args[node] = tuple(args)
        self.layouts[node] = 1
        self.convolutions[node] = (weight, COLWISE)
        return True

    def _sections_to_split(self, node: fx.Node, decision):
        """Accept a cat of sharded sections along their sharded dim when it is split back into those
        sections after channel-wise work only (gated DeltaNet's ``cat([q, k, v])``, a depthwise
        ``conv1d`` over the channels, then ``split`` into q, k and v): transposes, elementwise ops of
        it alone, slices of other dims, casts, and depthwise convolutions. Each rank then holds its
        share of each section all along, so the convolutions' weights and biases store their
        channels section by section per rank (``fused``) and the split takes local sizes."""
        if self.fixed_roles is not None:
            return None
        sizes, dim, value, params = decision.fused_sections, decision.output, node, []
        while True:
            (user,) = value.users if len(value.users) == 1 else (None,)
            if user is None or user.op != "call_function":
                return None
            if user.target in layout_rules.SPLITS:
                along = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
                if (user.target != _aten.split_with_sizes.default or _norm_dim(along, _ndim(value)) != dim
                        or tuple(user.args[1]) != sizes):
                    return None
                self.section_splits[user] = sizes
                for fqn in params:
                    self.fused[fqn] = FusedSections(sizes)
                return decision
            moved = _section_dim_after(user, value, dim, self.param_fqns, self.tp)
            if moved is None:
                return None
            dim, found = moved
            params += found
            value = user

    def _nested_sections(self, node: fx.Node, inputs: dict):
        """A split of one section of a fused projection's output, after channel-wise work on that
        section alone (Mamba-2: ``in_proj`` -> ``split([gate, xBC, dt])``, a depthwise ``conv1d``
        over ``xBC``, then ``split([x, B, C])``). The projection's sections become the finer ones
        (gate, x, B, C, dt) and the convolutions store their channels in the inner ones.

        An inner section whose heads do not divide by tp (B and C, whose groups every head shares,
        fewer than the tp ranks) is held whole on every rank, as a fused projection's k/v with
        fewer heads than tp are: its columns computed whole (their input gradient scaled, see
        :mod:`passes.transpose`), its channels convolved whole, and its piece replicated, entering
        tp where the cut heads read it. The outer split and the convolutions take local sizes."""
        if node.target != _aten.split_with_sizes.default or self.fixed_roles is not None:
            return None
        value = node.args[0]
        dim = inputs.get(value)
        along = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        if not isinstance(dim, int) or _norm_dim(along, _ndim(value)) != dim:
            return None
        chain = self._channel_chain(value)
        if chain is None:
            return None
        piece, convolutions = chain
        outer = piece.args[0]
        if outer.target != _aten.split_with_sizes.default or outer not in self.new_args:
            return None
        source, outer_sizes, index = outer.args[0], tuple(outer.args[1]), piece.args[1]
        origins = _fused_origins(source, self.layouts, self.output_site, self.param_fqns, readers=len(source.users))
        sizes = tuple(node.args[1])
        if (not origins or len(origins) != 1 or origins[0][1]
                or self.fused.get(origins[0][0].weight_fqn) != FusedSections(outer_sizes)
                or sum(sizes) != outer_sizes[index]):
            return None
        site = origins[0][0]
        pieces = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        whole = tuple(j for j, size in enumerate(sizes) if size % self.tp or _heads_of(pieces.get(j), size) % self.tp)
        if len(whole) == len(sizes):
            return None
        local = FusedSections(sizes, whole).local_sizes(self.tp)
        refined = FusedSections(outer_sizes[:index] + sizes + outer_sizes[index + 1:], tuple(index + j for j in whole))
        if (any(layout_rules.Convolution.of(c).groups_position >= len(c.args) for c in convolutions)
                or not self._cut_in_sections(source, refined)):
            return None
        for conv in convolutions:
            args = list(self.new_args.get(conv, conv.args))
            args[layout_rules.Convolution.of(conv).groups_position] = sum(local)
            self.new_args[conv] = tuple(args)
            for fqn in convolutions[conv]:
                self.fused[fqn] = FusedSections(sizes, whole)
        self.fused[site.weight_fqn] = refined
        outer_args = list(self.new_args[outer])
        outer_args[1] = [sum(local) if i == index else size // self.tp for i, size in enumerate(outer_sizes)]
        self.new_args[outer] = tuple(outer_args)
        return layout_rules.Decision(tuple(None if j in whole else dim for j in range(len(sizes))), {value: dim},
                                     (value, local, *node.args[2:]))

    def _channel_chain(self, value: fx.Node) -> tuple[fx.Node, dict[fx.Node, list[str]]] | None:
        """The piece of a split (a ``getitem``) that ``value`` is made from by channel-wise work on
        it alone (what :func:`_section_dim_after` accepts: transposes, slices of other dims,
        elementwise ops, depthwise convolutions), each step read only by the next, and the
        convolutions on the way with their parameters."""
        node, convolutions = value, {}
        while node.target is not operator.getitem:
            conv = layout_rules.Convolution.of(node)
            sharded = [i for i in node.all_input_nodes if is_sharded(self.layouts.get(i))]
            source = conv.input if conv is not None else (sharded[0] if len(sharded) == 1 else None)
            if (not isinstance(source, fx.Node) or len(source.users) != 1
                    or not isinstance(self.layouts.get(source), int)):
                return None
            moved = _section_dim_after(node, source, self.layouts[source], self.param_fqns, self.tp)
            if moved is None or moved[0] != self.layouts.get(node):
                return None
            if conv is not None:
                convolutions[node] = moved[1]
            node = source
        return (node, convolutions) if isinstance(self.layouts.get(node), int) else None

    def _fuse(self, decision):
        """Accept a split of a fused projection if the path back to its colwise weight
        only reshapes other dims and nothing else reads the (permuted) columns."""
        value = next(iter(decision.inputs))
        origins = _fused_origins(value, self.layouts, self.output_site, self.param_fqns, readers=len(value.users))
        if not origins or any(self.roles.get(site.weight_fqn) != COLWISE for site, _ in origins):
            return None
        fused = FusedSections(decision.fused_sections, decision.whole_sections, decision.section_runs)
        params = [fqn for _, found in origins for fqn in found]
        if params and fused.whole:
            return None  # a convolution's channels are cut, never held whole
        owners = (*(site.weight_fqn for site, _ in origins), *params)
        if any(self.fused.get(fqn, fused) != fused for fqn in owners) or not self._cut_in_sections(value, fused):
            return None
        self.fused.update(dict.fromkeys(owners, fused))
        return decision

    def _cut_in_sections(self, value: fx.Node, fused: FusedSections) -> bool:
        """Cut the replicated operands met between a colwise output and its split ``value`` along the
        fused dim (a constant multiplying the output: Falcon-H1's per-section muP vector) as the
        projection stores its sections, not in contiguous chunks. One that carries a gradient is cut
        so only when it is a ``cat`` of one piece per section (EVA's q|k|v bias ``cat((q_bias, k_bias,
        v_bias))``): each piece is cut in contiguous chunks, so each rank's cat is its share of every
        section, and a piece that is a parameter read there alone is stored cut. Any other such
        operand is not cut (its gradient would be gathered), and the split is not accepted."""
        frontier, cuts, cats = [value], {}, []
        while frontier:
            node = frontier.pop()
            if self.output_site.get(node) is not None:
                continue
            conv = layout_rules.Convolution.of(node)
            previous = [conv.input] if conv is not None else [
                i for i in node.all_input_nodes if is_sharded(self.layouts.get(i))]
            for other in node.all_input_nodes:
                steps = self.edges.get((other, node), ())
                if other in previous or not any(step.kind == TAKE_SHARD for step in steps):
                    continue
                if other in self.carries_grad:
                    chain = _cat_of_sections(other, steps[0].dim, fused, self.tp) if len(steps) == 1 else None
                    if chain is None or not self._cut_for_free(chain[-1], steps[0].dim, fused):
                        return False
                    cats.append((chain, node, steps[0].dim))
                    continue
                cuts[(other, node)] = tuple(dataclasses.replace(step, sections=fused) if step.kind == TAKE_SHARD
                                            else step for step in steps)
            frontier += previous
        self.edges.update(cuts)
        for chain, reader, dim in cats:
            del self.edges[(chain[0], reader)]
            self.layouts.update(dict.fromkeys(chain, dim))
            cat = chain[-1]
            for i, piece in enumerate(cat.args[0]):
                # a whole section's piece is read whole; its gradient arrives whole on every rank, as
                # the whole section's does (gathered over the ranks' heads)
                self.require(piece, cat, None if i in fused.whole else dim)
        return True

    def _cut_for_free(self, cat: fx.Node, dim: int, fused: FusedSections) -> bool:
        """Whether every piece of ``cat`` that a cut section reads is cut with no collective: it
        carries no gradient (a zeros buffer), or it is a parameter read there alone, stored cut. A
        piece that carries a gradient otherwise would be cut with its gradient all-gathered, a
        collective where the split gathered whole costs one too."""
        return all(i in fused.whole or piece not in self.carries_grad or self._param_chain(piece, dim) is not None
                   for i, piece in enumerate(cat.args[0]))

    # --- what a consumer needs ------------------------------------------------------------------

    def partial_grad(self, value) -> tuple:
        """enter_tp for a replicated, gradient-carrying input of a sharded computation."""
        return (Redistribute(ENTER_TP),) if value in self.carries_grad else ()

    def require(self, value: fx.Node, consumer: fx.Node, wanted, then: tuple = ()) -> None:
        """Record what ``consumer`` needs done to read ``value`` as ``wanted``, then ``then``."""
        have = self.layout(value)
        if isinstance(have, tuple) and have != wanted:
            raise NotImplementedError(
                f"autoshard: {describe(consumer)} reads the multi-output value '{value.name}' whole; "
                f"only indexing it is supported while it is sharded"
            )
        if have is None and wanted is not None and self._read_sharded_in_place(value, wanted):
            return
        steps = self._steps(value, consumer, have, wanted)
        if steps and steps[-1].kind == GATHER and then == (Redistribute(ENTER_TP),):
            steps, then = steps[:-1] + (Redistribute(GATHER_FOR_COLWISE, steps[-1].dim),), ()
        if steps + then:
            self.edges[(value, consumer)] = steps + then

    def _read_sharded_in_place(self, value: fx.Node, wanted) -> bool:
        """A replicated value that needs no cut: a broadcast whose sharded dim shrinks to its local
        size, or a parameter read by this op alone, stored sharded over tp (see
        ``LayoutPlan.sharded_params``)."""
        if _shrink_broadcast(value, wanted, self.tp, self.new_args, self.layouts):
            source = value.args[0]
            if source in self.carries_grad:  # each rank's expand sums its gradient over local copies only
                self.edges[(source, value)] = (Redistribute(ENTER_TP),)
            return True
        chain = self._param_chain(value, wanted) if isinstance(wanted, int) else None
        if chain is None:
            return False
        for node, dim in chain:
            self.layouts[node] = dim
            if node.target in _SIZED_VIEWS:
                sizes = layout_rules._local_shape_arg(node.args[1], dim, self.tp)
                self.new_args[node] = (node.args[0], sizes, *node.args[2:])
        param, dim = chain[-1]
        self.sharded_params[param.target] = dim
        return True

    def _param_chain(self, value: fx.Node, wanted: int) -> list[tuple[fx.Node, int]] | None:
        """``value`` and the ops back to the parameter it is computed from alone (casts, views,
        elementwise ops of it: ``-exp(A_log.float())``, ``w.squeeze(1).unsqueeze(1)``), or with
        replicated constants (an einsum with a fixed table, an index by expert ids), each used only
        by the next, with the dim that is ``wanted`` in each; None unless the parameter's own dim
        divides by tp."""
        chain, node, dim = [], value, wanted
        while node.op != "get_attr":
            if node.op != "call_function" or len(node.users) != 1 or not node.args:
                return None
            if node.target in (_aten.einsum.default, _aten.index.Tensor):  # other operands replicated constants
                pick = self._einsum_operand if node.target == _aten.einsum.default else self._indexed_rows
                found = pick(node, dim)
                if found is None:
                    return None
                chain.append((node, dim))
                node, dim = found
                continue
            source = node.args[0]
            if not isinstance(source, fx.Node) or len(node.all_input_nodes) != 1:
                return None
            before = _dim_before(node, source, dim, self.tp)
            if before is None:
                return None
            chain.append((node, dim))
            node, dim = source, before
        if node.target not in self.param_fqns or len(node.users) != 1:
            return None
        shape = node.meta["val"].shape
        if shape[dim] % self.tp:
            return None
        return chain + [(node, dim)]

    def _einsum_operand(self, node: fx.Node, dim: int) -> tuple[fx.Node, int] | None:
        """The one operand of an einsum that carries its output dim ``dim``, and that dim in it,
        when the other operands are replicated and carry no gradient: a weight projecting a
        constant table (Funnel's ``einsum("td,dnh->tnh", sinusoid, r_kernel)``) is cut where the
        output is, and the table is read whole by every rank."""
        parsed = layout_rules.einsum_terms(node)
        if parsed is None:
            return None
        terms, output, operands = parsed
        letter = output[dim]
        holders = [i for i, term in enumerate(terms) if letter in term]
        if len(holders) != 1 or terms[holders[0]].count(letter) != 1:
            return None
        others = [t for i, t in enumerate(operands) if i != holders[0]]
        if any(t in self.carries_grad or self.layout(t) is not None for t in others):
            return None
        return operands[holders[0]], terms[holders[0]].index(letter)

    def _indexed_rows(self, node: fx.Node, dim: int) -> tuple[fx.Node, int] | None:
        """The tensor ``node`` indexes on its leading dims by replicated indices that carry no
        gradient, and its dim that is output dim ``dim`` (one not indexed): gpt-oss's per-token
        expert bias ``gate_up_proj_bias[expert_ids]`` is cut on its features as the experts'
        outputs are."""
        source, indices = node.args[0], node.args[1]
        if not isinstance(source, fx.Node) or not indices or not all(isinstance(i, fx.Node) for i in indices):
            return None
        if any(i in self.carries_grad or self.layout(i) is not None for i in indices):
            return None
        leading = max(_ndim(i) for i in indices)
        before = dim - leading + len(indices)
        return (source, before) if dim >= leading and len(indices) <= before < _ndim(source) else None

    @staticmethod
    def _steps(value: fx.Node, consumer: fx.Node, have, wanted) -> tuple[Redistribute, ...]:
        if have == wanted:
            return ()
        if have in PARTIALS:
            reduce = Redistribute(REDUCE, average=have == PARTIAL_AVG)
            return (reduce,) + (() if wanted is None else (Redistribute(TAKE_SHARD, wanted),))
        if wanted is None:
            return (Redistribute(GATHER, have),)
        if have is None:
            return (Redistribute(TAKE_SHARD, wanted),)
        if wanted != PARTIAL:
            return (Redistribute(GATHER, have), Redistribute(TAKE_SHARD, wanted))
        raise NotImplementedError(
            f"autoshard: {describe(consumer)} needs its input '{value.name}' sharded on dim "
            f"{wanted} but it is {have}"
        )


# ops of one tensor that keep each column where it is: a value made from a cat of sections by them
# is cut in those sections as the cat is
_COLUMNWISE = (_aten.mul.Tensor, _aten.div.Tensor, _aten.neg.default, _aten._to_copy.default, _aten.to.dtype,
               _aten.clone.default, _aten.alias.default)


def _weight_read(site: LinearSite) -> fx.Node | None:
    """The node that reads ``site``'s parameter as the site's op takes it: the op itself
    (``linear(x, W)``, ``x @ W``), or the transpose it reads (``x @ W.T``); None for any other."""
    rhs = site.node.args[1] if len(site.node.args) > 1 else None
    if rhs is site.weight_node:
        return site.node
    if (isinstance(rhs, fx.Node) and rhs in site.nodes and site.node.target == _aten.matmul.default
            and rhs.args and rhs.args[0] is site.weight_node and len(rhs.users) == 1):
        return rhs
    return None


def _cat_of_sections(node: fx.Node, dim, fused: FusedSections, tp: int) -> list[fx.Node] | None:
    """``node``, read only by the op that cuts it along ``dim`` in ``fused``'s sections, and the ops
    back to a ``cat`` along ``dim`` of one piece per section that it is made from by columnwise ops of
    it alone (a scale: litgpt's LoRA update ``zero_pad(after_B) * scaling``), each read only by the
    next; None if it is not. Cut piece by piece (a whole section's piece read whole, a cut one in
    contiguous chunks), the cat is each rank's share of every section, in the order the projection
    stores them."""
    if not isinstance(dim, int) or fused.runs not in ((), (0, sum(fused.sizes))):  # columns in order
        return None
    chain = [node]
    while node.target != _aten.cat.default:
        inputs = node.all_input_nodes
        if (node.op != "call_function" or node.target not in _COLUMNWISE or len(inputs) != 1
                or node.args[0] is not inputs[0] or len(node.users) != 1):
            return None
        node = inputs[0]
        if node.meta["val"].shape != chain[-1].meta["val"].shape:
            return None
        chain.append(node)
    pieces = node.args[0]
    cat_dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    ndim = _ndim(node)
    if (len(node.users) != 1 or cat_dim % ndim != dim % ndim
            or not all(isinstance(p, fx.Node) and _ndim(p) == ndim for p in pieces)):
        return None
    sizes = tuple(p.meta["val"].shape[dim] for p in pieces)
    if sizes != tuple(fused.sizes) or not all(isinstance(size, int) and (i in fused.whole or size % tp == 0)
                                              for i, size in enumerate(sizes)):
        return None
    return chain


def _section_dim_after(user: fx.Node, value: fx.Node, dim: int, param_fqns, tp: int) -> tuple[int, list[str]] | None:
    """Where ``value``'s sections dim ``dim`` is in ``user``'s output, and the parameters ``user``
    reads along it, when ``user`` keeps each channel's values apart; else None."""
    target = user.target
    if target in (_aten.transpose.int, _aten.swapaxes.default):
        a, b = (_norm_dim(d, _ndim(value)) for d in user.args[1:3])
        return (b if dim == a else a if dim == b else dim), []
    if target == _aten.permute.default:
        order = [_norm_dim(d, _ndim(value)) for d in user.args[1]]
        return order.index(dim), []
    if target == _aten.slice.Tensor:
        return None if _norm_dim(user.args[1] if len(user.args) > 1 else 0, _ndim(value)) == dim else (dim, [])
    conv = layout_rules.Convolution.of(user)
    if conv is not None:
        groups, channels = conv.groups, value.meta["val"].shape[1]
        if (conv.input is not value or dim != 1 or groups != channels or _ndim(user) != _ndim(value)
                or not layout_rules.cuts_groups(user, tp)):
            return None
        params = [_source_param(t, param_fqns) for t in (conv.weight, conv.bias) if isinstance(t, fx.Node)]
        return None if None in params else (1, params)
    single = user.all_input_nodes == [value] and _ndim(user) == _ndim(value)
    if single and (layout_rules.is_pointwise(target) or target in layout_rules.ELEMENTWISE_LIKE):
        return dim, []
    return None


def _heads_of(piece: fx.Node | None, size: int) -> int:
    """The heads a split's piece of ``size`` channels is viewed into (``B.view(b, s, groups,
    state)``: its groups), or ``size`` when no reader views it so."""
    for user in piece.users if piece is not None else ():
        shape = getattr(user.meta.get("val"), "shape", ())
        if user.target in _SIZED_VIEWS and len(shape) >= 2 and all(isinstance(d, int) for d in shape[-2:]) \
                and shape[-2] * shape[-1] == size:
            return shape[-2]
    return size


def _dense_convolution_weight(node: fx.Node, param_fqns) -> str | None:
    """The parameter FQN of a dense convolution's weight (``groups=1``, not transposed, no bias:
    normalize adds a bias apart), read directly; else None."""
    conv = layout_rules.Convolution.of(node)
    if conv is None or conv.groups != 1 or conv.bias is not None or conv.transposed:
        return None
    weight = conv.weight
    return weight.target if isinstance(weight, fx.Node) and weight.op == "get_attr" and weight.target in param_fqns \
        else None


def _source_param(node: fx.Node, param_fqns) -> str | None:
    """The parameter ``node`` is a view or cast of (``conv1d.weight.unsqueeze(1)``), if any."""
    while node.op == "call_function" and len(node.all_input_nodes) == 1 and node.args[0] is node.all_input_nodes[0]:
        node = node.args[0]
    return node.target if node.op == "get_attr" and node.target in param_fqns else None


def _norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


_SIZED_VIEWS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default)
_SAME_DIMS = (_aten._to_copy.default, _aten.to.dtype, _aten.clone.default, _aten.contiguous.default,
              _aten.alias.default)


def _dim_before(node: fx.Node, source: fx.Node, dim: int, tp: int) -> int | None:
    """The dim of ``source`` that becomes ``node``'s ``dim``, when ``node`` only moves or maps
    ``source`` elementwise (a cast, a squeeze, an unsqueeze, a view, a unary elementwise op)."""
    target = node.target
    ndim = _ndim(node)
    if target in _SAME_DIMS or (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
                                and _ndim(source) == ndim):
        return dim
    if target == _aten.slice.Tensor and _whole_slice(node, source):
        return dim
    if target == _aten.unsqueeze.default:
        at = node.args[1] % ndim
        return None if dim == at else dim - (dim > at)
    if target == _aten.squeeze.dim:
        at = node.args[1] % _ndim(source)
        return dim + (dim >= at) if source.meta["val"].shape[at] == 1 else dim
    if target in _SIZED_VIEWS:
        shapes = [layout_rules._shape(source), layout_rules._shape(node)]
        found = [d for d in range(_ndim(source)) if layout_rules._map_reshape(*shapes, d, tp) == dim]
        return found[0] if len(found) == 1 else None
    return None


def _whole_slice(node: fx.Node, source: fx.Node) -> bool:
    """``x[:, :]``: a slice that keeps every element of its dim (``A[None, :, None, :]``)."""
    dim = node.args[1] if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    size = source.meta["val"].shape[dim]
    return start in (None, 0) and (end is None or (isinstance(end, int) and end >= size)) and step == 1


def _norms_over_sharded_width(plan: LayoutPlan, sites: Sites) -> list[fx.Node]:
    """Norms whose input is a colwise output region sharded on a normalized dim: they
    run sharded once written out (see passes.decompose); the rest stay one op."""
    colwise = {s.output for s in sites.linears if plan.roles[s.weight_fqn] in COLWISE_LIKE}
    found = []
    for node in plan.layouts:
        if node.op != "call_function" or node.target not in NORMS:
            continue
        x = node.args[0]
        lay = plan.layouts.get(x)
        if not isinstance(lay, int) or lay < _ndim(x) - len(node.args[1]) or _symbolic(x):
            continue
        if _projected(x, colwise):
            found.append(node)
    return found


_PASS_THROUGH = (
    torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.clone.default,
    torch.ops.aten.contiguous.default,
)


def _projected(value: fx.Node, colwise: set) -> bool:
    """``value`` is a colwise projection's output, up to views and casts: a norm of it
    (q/k norms over the projected width) is the projection's own, not the residual
    stream's, whose norms run replicated."""
    while value not in colwise:
        if value.op != "call_function" or value.target not in _PASS_THROUGH:
            return False
        value = value.args[0]
    return True


def _symbolic(node: fx.Node) -> bool:
    return any(isinstance(s, torch.SymInt) for s in node.meta["val"].shape)


def _shrink_broadcast(value: fx.Node, wanted, tp: int, new_args: dict, layouts: dict) -> bool:
    """A replicated ``expand`` read sharded along a dim it broadcasts (a causal mask
    expanded over heads): expand to the local size instead of cutting the full copy."""
    if value.target != torch.ops.aten.expand.default or len(value.users) != 1 or value in new_args:
        return False
    dim = wanted.dim if isinstance(wanted, layout_rules.Strided) else wanted
    if not isinstance(dim, int):
        return False
    source, sizes = value.args[0], list(value.args[1])
    src_dim = dim - (len(sizes) - _ndim(source))
    broadcast = src_dim < 0 or source.meta["val"].shape[src_dim] == 1
    if not broadcast or not isinstance(sizes[dim], int) or sizes[dim] % tp:
        return False
    sizes[dim] //= tp
    new_args[value] = (source, sizes, *value.args[2:])
    layouts[value] = wanted
    return True


def _fused_origins(value: fx.Node, layouts, output_site, param_fqns,
                   readers: int = 1) -> list[tuple[LinearSite, list[str]]] | None:
    """The colwise sites whose outputs reach ``value`` through single-use reshapes of other dims
    (the sharded dim keeps the sites' full output size all the way), sums of such outputs (a
    LoRA adapter's ``lora_B`` added to its base projection) and their concatenation along another
    dim (JetMoE's experts, one ``F.linear`` per expert on its rows, then ``cat``), each with the parameters of the
    depthwise convolutions on its way (gated DeltaNet's ``conv1d`` between ``in_proj_qkv`` and its
    split), which hold their channels in the sites' order. ``value`` itself has ``readers`` users:
    the split, or the slices tiling it."""

    def walk(node: fx.Node, allowed_users: int, params: list[str]):
        site = output_site.get(node)
        lay = layouts.get(node)
        size = layout_rules.size_expr(node.meta["val"].shape[lay]) if isinstance(lay, int) else None
        if len(node.users) != allowed_users or size is None:
            return None
        if site is not None:
            return [(site, params)] if size == site.out_features else None
        conv = layout_rules.Convolution.of(node)
        if conv is not None and lay == 1:
            found = [_source_param(t, param_fqns) for t in (conv.weight, conv.bias) if isinstance(t, fx.Node)]
            if None in found or not isinstance(conv.input, fx.Node):
                return None
            return walk(conv.input, 1, params + found)
        sharded = [i for i in node.all_input_nodes if is_sharded(layouts.get(i))]
        if len(sharded) == 1:
            return walk(sharded[0], 1, params)
        along = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) if node.args else None
        stacked = node.target == _aten.cat.default and _norm_dim(along, _ndim(node)) != lay
        if (node.target not in _SUMS and not stacked) or any(
                layouts.get(i) != lay or _ndim(i) != _ndim(node) for i in sharded):
            return None
        found = [walk(i, 1, params) for i in sharded]
        return None if None in found else [origin for branch in found for origin in branch]

    return walk(value, readers, [])


_SUMS = (_aten.add.Tensor, _aten.sub.Tensor)


def is_sharded(layout) -> bool:
    """Whether a value of ``layout`` differs across tp ranks: cut or partial (a tuple-valued
    node's layout, per output)."""
    if isinstance(layout, tuple):
        return any(lay is not None for lay in layout)
    return layout is not None


def _share_gathers(edges: dict) -> None:
    """A value gathered whole for some readers and gathered for colwise linears by others is
    gathered once: the colwise readers read that gather and enter tp after it (one all-gather
    forward and one all-reduce backward, not a second all-gather and its reduce-scatter). A
    shared layer's first read of a colwise output that the residual add reads too."""
    plain = {(v, steps[0].dim) for (v, _), steps in edges.items() if steps and steps[0].kind == GATHER}
    for (value, consumer), steps in list(edges.items()):
        if steps and steps[0].kind == GATHER_FOR_COLWISE and (value, steps[0].dim) in plain:
            edges[(value, consumer)] = (Redistribute(GATHER, steps[0].dim), Redistribute(ENTER_TP)) + steps[1:]


def _carries_grad(gm: fx.GraphModule) -> frozenset[fx.Node]:
    """Values a gradient flows back through: computed from a trainable parameter or from an
    input that requires grad (an activation handed over from the graph before a graph break),
    floating point, not cut off by ``detach`` or lent only a dtype or shape (``type_as``), and on
    a path to a floating output: a no-grad region's work (an indexer's scores, read only through
    ``detach`` or as top-k indices) carries none."""
    carries = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op in ("get_attr", "placeholder"):
            if isinstance(val, torch.Tensor) and val.requires_grad:
                carries.add(node)
        elif node.op == "call_function" and node.target not in _GRAD_STOPS:
            if _floating(val) and any(i in carries for i in _grad_sources(node)):
                carries.add(node)
    reaching = set()
    for node in reversed(gm.graph.nodes):
        if node.op == "output":
            reaching.update(v for v in node.all_input_nodes if _floating(v.meta.get("val")))
        elif node.op == "call_function" and node.target not in _GRAD_STOPS and (node in reaching or _writes(node)):
            reaching.update(_grad_sources(node))  # a write into a tensor read later (a scan's output) reaches too
    return frozenset(carries & reaching)


def _writes(node: fx.Node) -> bool:
    """An in-place op: its value lands in a tensor that other nodes read, not in its own users."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _floating(val) -> bool:
    return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
               for v in (val if isinstance(val, (tuple, list)) else (val,)))


def _grad_sources(node: fx.Node) -> list[fx.Node]:
    """The inputs a node's gradient flows back to: ``mask.type_as(embeds)``'s second tensor only
    lends its dtype or shape."""
    return list(node.args[:1]) if node.target in _SHAPED_LIKE else node.all_input_nodes


# ops whose input gradient is their output gradient moved back (views, pieces of a split, casts):
# partial gradients reaching a value through them are summed there as they are everywhere else
_VIEWS = (
    _aten.slice.Tensor, _aten.select.int, _aten.unsqueeze.default, _aten.squeeze.dim, _aten.view.default,
    _aten.reshape.default, _aten._unsafe_view.default, _aten.expand.default, _aten.alias.default,
    _aten.transpose.int, _aten.permute.default, _aten.split.Tensor, _aten.split_with_sizes.default,
    _aten.chunk.default, _aten.unbind.int, operator.getitem, _aten._to_copy.default, _aten.to.dtype,
)
ENTER_ONLY = (Redistribute(ENTER_TP),)
# ops whose second tensor lends only its dtype or shape: no gradient flows to it
_SHAPED_LIKE = (_aten.type_as.default, _aten.expand_as.default, _aten.view_as.default, _aten.reshape_as.default)


def _hoist_take_shard(edges: dict, layouts: dict, new_args: dict, tp: int) -> None:
    """Cut a replicated value once where its views are cut for several readers.

    A replicated value read through views by several cut ops (a per-head decay ``decay[None, :,
    None]`` multiplying the state at every step of a loop) would take one cut per view, each an
    all-gather of its gradient in backward. Views only move dims, so cutting their source on the
    dim they read cut and running the views on its local share gives each reader the same values:
    one cut, one all-gather of the summed gradient. A product with a fresh tensor on the way (the
    first step's ``decay * zeros``) is cut too, each rank making its share of the zeros. Done for
    the views that serve one such read alone (other readers of the source keep reading it whole),
    when the source's dim divides by tp.
    """
    cut: dict[tuple[fx.Node, int], list[tuple[fx.Node, fx.Node, list]]] = {}
    for (value, consumer), steps in list(edges.items()):
        if len(steps) != 1 or steps[0].kind != TAKE_SHARD or not isinstance(steps[0].dim, int):
            continue
        chain = _views_back(value, steps[0].dim, layouts, tp)
        if chain is not None:
            cut.setdefault(chain[-1], []).append((value, consumer, chain))
    for (node, dim), members in cut.items():
        members = [m for m in members if _only_for(m[2], m[1])]
        if len(members) < 2 or len({chain[-1][1] for _, _, chain in members}) != 1:
            continue
        if layout_rules._shape(node)[dim] % tp:
            continue
        for value, consumer, chain in members:
            del edges[(value, consumer)]
            for view, view_dim in chain[:-1]:
                layouts[view] = view_dim
                if view.target in _SIZED_VIEWS:
                    new_args[view] = (view.args[0], layout_rules._local_shape_arg(view.args[1], view_dim, tp),
                                      *view.args[2:])
                fresh = _fresh_operand(view)
                if fresh is not None:  # made as this rank's share
                    at = _FRESH[fresh.target]
                    layouts[fresh] = view_dim
                    new_args[fresh] = (*fresh.args[:at], layout_rules._local_shape_arg(fresh.args[at], view_dim, tp),
                                       *fresh.args[at + 1:])
            edges[(node, chain[-2][0])] = (Redistribute(TAKE_SHARD, dim),)  # the source's reader: its first op


def _only_for(chain: list, consumer: fx.Node) -> bool:
    """Each view of ``chain`` (value first, source last) is read only by the next one, and the value
    only by ``consumer``: cut, they change nothing another reader sees."""
    reader = consumer
    for view, _ in chain[:-1]:
        if set(view.users) != {reader}:
            return False
        reader = view
    return True


_CUT_VIEWS = (_aten.unsqueeze.default, _aten.squeeze.dim, _aten.slice.Tensor, *_SIZED_VIEWS)
# fresh tensors made in the forward (a recurrence's zero state): any rank may make its share alone
_FRESH = {_aten.zeros.default: 0, _aten.ones.default: 0, _aten.new_zeros.default: 1, _aten.new_ones.default: 1}


def _views_back(value: fx.Node, dim: int, layouts: dict, tp: int) -> list[tuple[fx.Node, int]] | None:
    """``value`` and the ops back to the replicated value it is made from (the last entry, as
    ``(node, dim)``), each with the dim that is ``dim`` of ``value``: views, and products or sums
    with a fresh tensor of the same shape (a recurrence's first step, ``decay * zeros``), whose
    share each rank makes alone. None when ``value`` is neither."""
    chain, node = [], value
    while node.op == "call_function" and layouts.get(node) is None:
        fresh = _fresh_operand(node)
        if node.target in _CUT_VIEWS and isinstance(node.args[0], fx.Node) and len(node.all_input_nodes) == 1:
            source = node.args[0]
            before = _dim_before(node, source, dim, tp)
        elif fresh is not None:
            source = next(a for a in node.args[:2] if a is not fresh)
            before = dim if _ndim(source) == _ndim(node) and layout_rules._shape(source)[dim] == \
                layout_rules._shape(node)[dim] else None
        else:
            break
        if before is None:
            return None
        chain.append((node, dim))
        node, dim = source, before
    if not chain or layouts.get(node) is not None:
        return None
    return chain + [(node, dim)]


def _fresh_operand(node: fx.Node) -> fx.Node | None:
    """The fresh tensor (zeros, ones) ``node`` multiplies or adds, of ``node``'s own shape and read by
    it alone, when the other operand is a value; else None."""
    if node.target not in (_aten.mul.Tensor, _aten.add.Tensor) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    for fresh, other in ((a, b), (b, a)):
        if (isinstance(fresh, fx.Node) and isinstance(other, fx.Node) and fresh.target in _FRESH
                and len(fresh.users) == 1 and layout_rules._shape(fresh) == layout_rules._shape(node)):
            return fresh
    return None


def _hoist_enter_tp(edges: dict, layouts: dict, carries_grad: frozenset[fx.Node]) -> None:
    """Move ``enter_tp`` up to where one all-reduce serves several readers.

    Entering tp earlier is exact whenever every gradient reaching the earlier value is partial:
    backward is linear in the gradient it is given, and a replicated computation is the same on
    every rank, so summing over tp before it or after it gives one sum. So ``enter_tp`` may climb
    from a value to an ancestor ``top`` when everything between them is replicated, takes its
    gradient only from ``top`` or from parameters, and is read only by ``enter_tp`` or by itself
    (views, casts, a weightless norm of a split's piece, a LoRA adapter's ``lora_A`` computed
    whole). Those parameters' gradients turn partial too, so they enter tp as well, in their
    block's bucket. Readers of ``top`` whose branch does not qualify (a router computed whole
    beside the experts and a shared expert that enter tp) keep reading ``top`` as it is; the
    others read it entered. Two hoists pay:

    - several entered values meet in one (a split's pieces, per-step selects, per-expert slices
      of dense routing weights) that is no larger than they are together: one all-reduce instead
      of one each. A split is entered on its input's edge (after the reduction that made the
      input whole), since its pieces are a tuple: Mamba's step size, B and C cost one all-reduce.
    - a chain computed from one parameter alone (``1 + w.float()``, ``softplus(alpha)``): entered
      at the parameter, which then joins its block's bucket (:meth:`LayoutPlan.enter_tp_buckets`).
    """
    _EnterHoist(edges, layouts, carries_grad).run()


class _EnterHoist:
    """One pass of :func:`_hoist_enter_tp` over a plan's edges (changed in place)."""

    def __init__(self, edges: dict, layouts: dict, carries_grad: frozenset[fx.Node]):
        self.edges, self.layouts, self.carries_grad = edges, layouts, carries_grad

    def gradient_inputs(self, node: fx.Node) -> list[fx.Node]:
        if node.target in _VIEWS or node.target in _SHAPED_LIKE:
            return [node.args[0]] if isinstance(node.args[0], fx.Node) else []
        return [i for i in node.all_input_nodes if i in self.carries_grad]

    def below(self, top: fx.Node):
        """The values between ``top`` and its ``enter_tp`` edges, those edges, the weights to
        enter with them and the readers of ``top`` to enter it for, when ``top`` may be entered in
        their place. A reader of ``top`` whose branch reaches replicated work (a router beside
        a shared expert and the routed experts) keeps reading ``top`` itself."""
        readers = tuple(top.users)
        found = self.reach(top, readers)
        if found is None:
            readers = tuple(user for user in top.users if self.reach(top, (user,)) is not None)
            found = self.reach(top, readers) if readers else None
        return None if found is None else (*found, readers)

    def reach(self, top: fx.Node, readers: tuple[fx.Node, ...]):
        members: set[fx.Node] = set()
        pairs, frontier = [], [top]
        while frontier:
            node = frontier.pop()
            if not node.users:
                return None
            for user in (readers if node is top else node.users):
                steps = self.edges.get((node, user))
                if steps == ENTER_ONLY:
                    pairs.append((node, user))
                elif steps is not None or user.op != "call_function" or is_sharded(self.layouts.get(user)):
                    return None
                elif getattr(getattr(user.target, "_schema", None), "is_mutable", False):
                    return None
                elif user not in members:
                    if len(members) == _HOIST_REACH:
                        return None
                    members.add(user)
                    frontier.append(user)
        weights = []
        for member in sorted(members, key=lambda n: n.name):  # every rank plans alike: no set order
            for i in self.gradient_inputs(member):
                if (i is top and member in readers) or i in members:
                    continue
                weight, reader = self.parameter_read(i, member)
                if weight is None:
                    return None  # a gradient from elsewhere meets top's below it
                weights.append((weight, reader))  # a weight of replicated work (LoRA's lora_A): entered too
        return members, pairs, weights

    def parameter_read(self, value: fx.Node, member: fx.Node):
        """(the parameter, the op reading it) when ``value`` is a parameter, or a view of one read
        by ``member`` alone (litgpt's ``x @ self.lora_A.transpose(0, 1)``), with nothing entered on
        the way; else (None, None)."""
        reader = member
        while value.op == "call_function" and value.target in _VIEWS and len(value.users) == 1 \
                and isinstance(value.args[0], fx.Node) and (value, reader) not in self.edges:
            value, reader = value.args[0], value
        if value.op != "get_attr" or (value, reader) in self.edges:
            return None, None
        return value, reader

    def ancestors(self, node: fx.Node):
        """Replicated values ``node``'s gradient flows to, nearest first."""
        seen, frontier = {node}, [node]
        for _ in range(_HOIST_DEPTH):
            frontier = [i for n in frontier for i in self.gradient_inputs(n) if i not in seen
                        and i in self.carries_grad and not is_sharded(self.layouts.get(i))]
            seen.update(frontier)
            yield from dict.fromkeys(frontier)

    def gains(self, top: fx.Node, found, current) -> bool:
        """Whether entering ``top`` for only some of its readers serves more entered uses than
        the climb holds so far (else the climb would only move tp's entry past a norm's weight)."""
        return found[3] == tuple(top.users) or len(found[1]) > (len(current[1]) if current else 1)

    def climb(self, value: fx.Node):
        """The highest ``top`` above ``value`` that may be entered for it, what lies below it, and
        the split the climb last passed, if it stopped there (then entered on its input's edge)."""
        top, split, node, found = value, None, value, None
        while True:
            step = next(((a, r) for a in self.ancestors(node)
                         if (r := self.below(a)) is not None and node in r[0] and self.gains(a, r, found)), None)
            if step is None:
                return top, split, found
            node, found = step
            if isinstance(node.meta.get("val"), (tuple, list)):
                split = node
            else:
                top, split = node, None

    def run(self) -> None:
        entered = sorted({v for (v, c), steps in self.edges.items() if steps == ENTER_ONLY}, key=lambda n: n.name)
        for value in entered:
            if not any(self.edges.get((value, user)) == ENTER_ONLY for user in value.users):
                continue  # already entered higher up
            top, split, found = self.climb(value)
            if found is None:
                continue
            if split is not None:
                found = self.below(split)
            _, pairs, weights, readers = found
            values = {v for v, _ in pairs}
            whole = split.args[0] if split is not None else top
            at_parameter = split is None and top.op == "get_attr"
            sizes = [_numel(v) for v in (whole, *values)]
            if not at_parameter and (len(values) < 2 or (None not in sizes and sizes[0] > sum(sizes[1:]))):
                continue
            for pair in pairs:
                del self.edges[pair]
            for pair in weights:
                self.edges[pair] = ENTER_ONLY
            if split is not None:
                self.edges[(whole, split)] = self.edges.get((whole, split), ()) + ENTER_ONLY
            else:
                for user in readers:
                    self.edges[(top, user)] = ENTER_ONLY


# how far (values below, ancestors above) one ``enter_tp`` may be hoisted
_HOIST_REACH, _HOIST_DEPTH = 256, 8


def _numel(node: fx.Node) -> int | None:
    """Elements of ``node``'s value; None when not a known number (tokens per expert), and a hoist
    is then judged by count alone."""
    val = node.meta.get("val")
    try:
        return int(val.numel()) if isinstance(val, torch.Tensor) else None
    except (TypeError, ValueError, RuntimeError):
        return None


def _regions(plan: LayoutPlan, useful: set[fx.Node]) -> list[set[fx.Node]]:
    """Connected idle sharded values (joined by uses that keep them sharded)."""
    idle = {v for v, lay in plan.layouts.items() if is_sharded(lay) and lay not in PARTIALS and v not in useful}
    return _components(idle, lambda value, user: not _gathers(plan, value, user))


def _components(members: set[fx.Node], joined) -> list[set[fx.Node]]:
    """Connected parts of ``members``, two values joined when one reads the other and
    ``joined(value, user)`` holds for that use."""
    components, seen = [], set()
    for start in members:
        if start in seen:
            continue
        component, frontier = set(), [start]
        while frontier:
            node = frontier.pop()
            if node in component:
                continue
            component.add(node)
            frontier += [u for u in node.users if u in members and joined(node, u)]
            frontier += [i for i in node.all_input_nodes if i in members and joined(i, node)]
        seen |= component
        components.append(component)
    return components


def _leaves_cut(plan: LayoutPlan, region: set[fx.Node]) -> bool:
    """Whether the region reaches the model's output and leaves it cut (a DTensor under loss
    parallelism), through cp's gather or a view on the way."""
    return any(consumer.op == "output" and any(step.kind == SHARDED_OUTPUT for step in steps)
               for (value, consumer), steps in plan.edges.items() if value in region)


def _gathers(plan: LayoutPlan, value: fx.Node, consumer: fx.Node) -> bool:
    return any(step.kind in (GATHER, GATHER_FOR_COLWISE) for step in plan.edges.get((value, consumer), ()))


def _exit_cost(plan: LayoutPlan, region: set[fx.Node]) -> int:
    """Collectives a region costs where it meets the replicated world: its values gathered, the
    replicated values entering it (``enter_tp``: a backward all-reduce; ``take_shard`` of one that
    carries a gradient: a backward all-gather), and the partial sums it makes by contracting its
    cut dim (a sum over heads, not a rowwise linear's: those regions are useful), each reduced."""
    gathered = {v for (v, c), steps in plan.edges.items() if v in region and _gathers(plan, v, c)}
    entered = {  # only where a gradient flows back through the reader (not into a no-grad region)
        v for (v, c), steps in plan.edges.items()
        if c in region and c in plan.carries_grad and any(step.kind == ENTER_TP for step in steps)
    }
    taken = {
        v for (v, c), steps in plan.edges.items()
        if c in region and v in plan.carries_grad and any(step.kind == TAKE_SHARD for step in steps)
    }
    return len(gathered) + len(entered) + len(taken) + len(_contractions(plan, region))


def _contractions(plan: LayoutPlan, region: set[fx.Node]) -> list[fx.Node]:
    """The partial sums a region makes by contracting its cut dim, each once."""
    return list(dict.fromkeys(user for value in region for user in value.users if plan.layouts.get(user) in PARTIALS))


def _useful(plan: LayoutPlan, sites: Sites) -> set[fx.Node]:
    """Sharded values on a path to a rowwise linear's input, or to a grouped convolution's
    that reads its cut filters (SqueezeBERT's output ``Conv1d(groups=4)``): such a convolution
    ends the region as a rowwise one does, its cut output channels gathered instead of its partial
    sums reduced."""
    useful: set[fx.Node] = set()
    frontier = [s.input for s in (*sites.linears, *sites.experts) if plan.roles[s.weight_fqn] == ROWWISE]
    frontier += [node.args[0] for node, (_, role) in plan.convolutions.items() if role == ROWWISE]
    frontier += [node.args[0] for node in grouped_on_cut_input(plan)]
    while frontier:
        value = frontier.pop()
        if value in useful or not is_sharded(plan.layouts.get(value)):
            continue
        useful.add(value)
        for source in value.all_input_nodes:
            if not _gathers(plan, source, value):
                frontier.append(source)
    return useful


def grouped_on_cut_input(plan: LayoutPlan) -> list[fx.Node]:
    """Grouped convolutions of several channels per group (block-diagonal linears, not depthwise
    per-channel work) that read a channel-cut input with filters stored cut over tp."""
    found = []
    for node, layout in plan.layouts.items():
        conv = layout_rules.Convolution.of(node) if layout == 1 else None
        if (conv is not None and conv.groups != 1 and plan.layouts.get(conv.input) == 1
                and isinstance(conv.weight, fx.Node) and conv.weight.target in plan.sharded_params
                and (conv.channels_per_group or 1) > 1):
            found.append(node)
    return found


def closed_by_grouped_convolution(plan: LayoutPlan, value: fx.Node, closing: set[fx.Node]) -> bool:
    """Whether gathering the cut ``value`` ends its region as a rowwise reduction would: every
    cut value it is computed from (not across a gather) starts at one of the ``closing``
    convolutions (:func:`grouped_on_cut_input`: SqueezeBERT's output ``Conv1d(groups=4)`` then its
    residual add), none at a colwise output that a rowwise layer should have read."""
    if not closing:
        return False
    seen, frontier, reached = set(), [value], False
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in closing:
            reached = True
            continue
        cut_inputs = [i for i in node.all_input_nodes
                      if is_sharded(plan.layouts.get(i)) and plan.layouts.get(i) not in PARTIALS
                      and not _gathers(plan, i, node)]
        if not cut_inputs:
            return False  # a cut value made another way: its gather is a break
        frontier += cut_inputs
    return reached


def _ndim(node: fx.Node) -> int:
    return node.meta["val"].dim()


def _linear_role(site: LinearSite, input_layout, roles, fixed_roles, tied: bool) -> Role:
    if fixed_roles is not None:
        role = fixed_roles.get(site.weight_fqn)
        allowed = (VOCAB_PARALLEL, REPLICATE) if tied else (COLWISE, ROWWISE, REPLICATE)
        if role not in allowed:
            raise ValueError(
                f"autoshard: plan gives linear weight '{site.weight_fqn}' role {role!r}; "
                f"expected one of {', '.join(repr(r) for r in allowed)}"
            )
        return role
    if tied:
        return roles.get(site.weight_fqn, VOCAB_PARALLEL)  # the embedding may have decided replicate
    return ROWWISE if input_layout == _ndim(site.input) - 1 else COLWISE


def _indivisible(site, role: Role, tp: int) -> Indivisible | None:
    """Why ``site`` cannot take ``role`` on ``tp`` ranks (a dim that does not divide, or a share
    its kernel cannot read), or None."""
    if role == REPLICATE or tp == 1:
        return None
    if isinstance(site, EmbeddingSite) and role == VOCAB_PARALLEL:
        size, what = site.num_embeddings, "vocabulary rows"
    elif isinstance(site, EmbeddingSite):
        size, what = site.embedding_dim, "embedding dim"
    elif role in COLWISE_LIKE:
        size, what = site.out_features, "output features"
    else:
        size, what = site.in_features, "input features"
    multiple, kernel = (site.multiple, site.kernel) if isinstance(site, ExpertSite) else (1, "")
    indivisible = Indivisible(what, size, tp, multiple, kernel)
    return None if indivisible.fits(tp) else indivisible


def _check_roles_cover_sites(fixed_roles, sites: Sites) -> None:
    if fixed_roles is None:
        return
    missing = [s.weight_fqn for s in sites.all if s.weight_fqn not in fixed_roles]
    if missing:
        raise ValueError(f"autoshard: the plan has no role for weights {missing}")
