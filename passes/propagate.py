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
import operator

import torch
import torch.fx as fx

from autoshard.core.errors import describe
from autoshard.core.options import DEFAULT_OPTIONS, PlanOptions
from autoshard.core.sharding import Indivisible, Role
from autoshard.passes import dtensor_rules, gradient_flow, layout_rules
from autoshard.passes.decompose import NORMS, decompose_norm
from autoshard.passes.discover import EmbeddingSite, LinearSite, Sites
from autoshard.passes.experts import ExpertSite
from autoshard.passes.fused_projections import (
    SUMS,
    cat_of_sections,
    fused_origins,
    heads_of,
    section_dim_after,
    source_param,
)
from autoshard.passes.idle_regions import Revisions
from autoshard.passes.layout_plan import (
    COLWISE,
    COLWISE_LIKE,
    ENTER_TP,
    GATHER,
    GATHER_FOR_COLWISE,
    PARTIAL,
    PARTIAL_AVG,
    PARTIALS,
    REDUCE,
    REPLICATE,
    ROWWISE,
    SEQ_DIM,
    SHARDED_OUTPUT,
    TAKE_SHARD,
    VOCAB_PARALLEL,
    LayoutPlan,
    Redistribute,
    is_sharded,
)
from autoshard.passes.layout_rules import Layout
from autoshard.passes.op_dims import SIZED_VIEWS, dim_before, ndim_of, norm_dim
from autoshard.passes.shared_collectives import hoist_enter_tp, hoist_take_shard, share_gathers
from autoshard.passes.stamping import Arrival, Copies, Key, Stamper, find_copies
from autoshard.plans.plan import FusedSections

_aten = torch.ops.aten


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
    carries_grad = gradient_flow.carries_grad(gm)
    copies = block_copies(gm.graph, sites, carries_grad, written)
    revised = Revisions(sites, may_replicate=roles is None, whole=whole, colwise=colwise)
    while True:
        plan = Propagation(gm, sites, tp, roles, options, carries_grad, revised, copies).run()
        norms = _norms_over_sharded_width(plan, sites)
        if norms:
            for norm in norms:
                decompose_norm(gm.graph, norm)
            carries_grad = gradient_flow.carries_grad(gm)
            copies = block_copies(gm.graph, sites, carries_grad, written)
            continue
        if not revised.learn(plan):
            return dataclasses.replace(plan, gathered_early=revised.gathered_early, block_fqns=tuple(block_fqns))


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
        share_gathers(self.edges)
        hoist_take_shard(self.edges, self.layouts, self.new_args, self.tp)
        hoist_enter_tp(self.edges, self.layouts, self.carries_grad)
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
            self.layouts[node] = self.layouts[site.output] = ndim_of(site.output) - 1
        elif role == ROWWISE:
            if site.weight_fqn in self.input_sections:
                self.fused[site.weight_fqn] = self.input_sections[site.weight_fqn]
            self.require(site.input, node, ndim_of(site.input) - 1)
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
        if (not self._whole_weight_may_read(site) or not isinstance(layout, int) or layout == ndim_of(site.input) - 1
                or (self.options.sequence_parallel and layout == SEQ_DIM)  # the stream: gathered for colwise
                or ndim_of(node) != ndim_of(site.input)):
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
            if user.target in SUMS and len(user.all_input_nodes) == 2:
                other = next(i for i in user.all_input_nodes if i is not value)
                if self.layouts.get(other) != PARTIAL:
                    return False
                break
            scalar = user.target in (_aten.mul.Tensor, _aten.div.Tensor) and user.all_input_nodes == [value]
            if not (scalar or user.target in SIZED_VIEWS):
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
        self.layouts[node] = ndim_of(node) - 1 if role == COLWISE else None  # vocab_parallel: reduced at once
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
            if self.options.loss_parallel and isinstance(lay, int) and lay == ndim_of(value) - 1:
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
                or decision.output != ndim_of(node) - 1 or _indivisible(site, ROWWISE, self.tp) is not None):
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
        weight = source_param(conv.weight, self.param_fqns) if isinstance(conv.weight, fx.Node) else None
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
                if (user.target != _aten.split_with_sizes.default or norm_dim(along, ndim_of(value)) != dim
                        or tuple(user.args[1]) != sizes):
                    return None
                self.section_splits[user] = sizes
                for fqn in params:
                    self.fused[fqn] = FusedSections(sizes)
                return decision
            moved = section_dim_after(user, value, dim, self.param_fqns, self.tp)
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
        if not isinstance(dim, int) or norm_dim(along, ndim_of(value)) != dim:
            return None
        chain = self._channel_chain(value)
        if chain is None:
            return None
        piece, convolutions = chain
        outer = piece.args[0]
        if outer.target != _aten.split_with_sizes.default or outer not in self.new_args:
            return None
        source, outer_sizes, index = outer.args[0], tuple(outer.args[1]), piece.args[1]
        origins = fused_origins(source, self.layouts, self.output_site, self.param_fqns, readers=len(source.users))
        sizes = tuple(node.args[1])
        if (not origins or len(origins) != 1 or origins[0][1]
                or self.fused.get(origins[0][0].weight_fqn) != FusedSections(outer_sizes)
                or sum(sizes) != outer_sizes[index]):
            return None
        site = origins[0][0]
        pieces = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        whole = tuple(j for j, size in enumerate(sizes) if size % self.tp or heads_of(pieces.get(j), size) % self.tp)
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
        it alone (what :func:`section_dim_after` accepts: transposes, slices of other dims,
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
            moved = section_dim_after(node, source, self.layouts[source], self.param_fqns, self.tp)
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
        origins = fused_origins(value, self.layouts, self.output_site, self.param_fqns, readers=len(value.users))
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
                    chain = cat_of_sections(other, steps[0].dim, fused, self.tp) if len(steps) == 1 else None
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
            if node.target in SIZED_VIEWS:
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
            before = dim_before(node, source, dim, self.tp)
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
        leading = max(ndim_of(i) for i in indices)
        before = dim - leading + len(indices)
        return (source, before) if dim >= leading and len(indices) <= before < ndim_of(source) else None

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


def _dense_convolution_weight(node: fx.Node, param_fqns) -> str | None:
    """The parameter FQN of a dense convolution's weight (``groups=1``, not transposed, no bias:
    normalize adds a bias apart), read directly; else None."""
    conv = layout_rules.Convolution.of(node)
    if conv is None or conv.groups != 1 or conv.bias is not None or conv.transposed:
        return None
    weight = conv.weight
    return weight.target if isinstance(weight, fx.Node) and weight.op == "get_attr" and weight.target in param_fqns \
        else None


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
        if not isinstance(lay, int) or lay < ndim_of(x) - len(node.args[1]) or _symbolic(x):
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
    src_dim = dim - (len(sizes) - ndim_of(source))
    broadcast = src_dim < 0 or source.meta["val"].shape[src_dim] == 1
    if not broadcast or not isinstance(sizes[dim], int) or sizes[dim] % tp:
        return False
    sizes[dim] //= tp
    new_args[value] = (source, sizes, *value.args[2:])
    layouts[value] = wanted
    return True


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
    return ROWWISE if input_layout == ndim_of(site.input) - 1 else COLWISE


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
