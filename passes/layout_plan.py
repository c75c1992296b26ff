"""The layout plan: propagation's decisions, as data the later passes read.

A :class:`LayoutPlan` holds each site's role, each value's tp layout (replicated, cut on a dim,
or a partial sum) and the :class:`Redistribute` steps a consumer needs done to a value before
reading it. Redistribute, transpose, placements and the axes read a plan without running a walk,
so the plan and its vocabulary (roles, steps, layouts) live apart from the walk that makes it
(:mod:`autoshard.passes.propagate`).
"""

from __future__ import annotations

import dataclasses
import enum

import torch.fx as fx

from autoshard.core.sharding import Indivisible, Role, Step
from autoshard.passes import layout_rules
from autoshard.passes.discover import LinearSite
from autoshard.passes.layout_rules import Layout, Strided
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


@dataclasses.dataclass(frozen=True)
class Redistribute:
    """What a consumer needs done to a value before reading it: ``kind`` on ``dim`` (the sharded
    dim gathered or cut; none for a sum); ``average`` for a reduced partial mean; ``sections``: a
    cut that follows a fused projection's stored sections (a constant along its output)."""

    kind: Step
    dim: int | Strided | None = None
    average: bool = False
    sections: FusedSections | None = None


ENTER_ONLY = (Redistribute(ENTER_TP),)


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


def is_sharded(layout) -> bool:
    """Whether a value of ``layout`` differs across tp ranks: cut or partial (a tuple-valued
    node's layout, per output)."""
    if isinstance(layout, tuple):
        return any(lay is not None for lay in layout)
    return layout is not None
