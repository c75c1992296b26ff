"""Idle regions: what one walk learns for the next, by what its regions cost.

A sharded region that never reaches a rowwise linear gains nothing from staying cut, and a
region of partial sums may cost more reduced late than early. Neither is known while a walk
decides one node at a time: both are judged on the finished :class:`LayoutPlan`, by counting
the collectives a region costs as it is and revised (:class:`RegionCost`), and what pays is
handed to the next walk (:class:`Revisions`).
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from autoshard.core.errors import describe
from autoshard.passes import layout_rules
from autoshard.passes.discover import Sites
from autoshard.passes.layout_plan import (
    COLWISE,
    COLWISE_LIKE,
    ENTER_TP,
    GATHER,
    GATHER_FOR_COLWISE,
    PARTIALS,
    REDUCE,
    ROWWISE,
    SHARDED_OUTPUT,
    TAKE_SHARD,
    LayoutPlan,
    is_sharded,
)


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
