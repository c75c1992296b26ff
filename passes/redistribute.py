"""Layouts: insert the tp redistributes the layout plan asks for.

Each ``(value, consumer)`` edge of the :class:`~passes.layout_plan.LayoutPlan`
becomes a short chain of ``autoshard::*`` collective nodes (see
:mod:`autoshard.runtime.collectives`). Chains are shared: all consumers needing the
same steps on the same value read one node, so a value is gathered once and
q/k/v share one ``enter_tp``. Views whose sharded dim shrinks get their local
shape arguments.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx

from autoshard.passes.layout_plan import ENTER_ONLY, GATHER, GATHER_FOR_COLWISE, TAKE_SHARD, LayoutPlan
from autoshard.passes.layout_rules import Strided
from autoshard.passes.local_convolution import fold_single_channel_convolutions
from autoshard.passes.partition import made_like
from autoshard.runtime import collectives
from autoshard.runtime.whole_sections import TAKE_SECTIONS

aten = torch.ops.aten
# the steps that move a ``Strided`` dim (a reduction leaves no dim to stride)
_STRIDED_KINDS = (GATHER, TAKE_SHARD, GATHER_FOR_COLWISE)

def insert_redistributes(
    gm: fx.GraphModule, plan: LayoutPlan, group_name: str, reduce_dtype: torch.dtype | None = None
) -> None:
    """Insert the collective nodes of every edge; sums of partial values in ``reduce_dtype``."""
    graph = gm.graph
    for node, args in plan.new_args.items():
        node.args = args
    fold_single_channel_convolutions(graph, plan.new_args, plan.tp)
    position = {node: i for i, node in enumerate(graph.nodes)}
    readers: dict[tuple, list[fx.Node]] = defaultdict(list)
    for (value, consumer), steps in plan.edges.items():
        for i in range(len(steps)):
            readers[(value, steps[: i + 1])].append(consumer)
    made: dict[tuple, fx.Node] = {}
    written = _written_in_place(graph)
    for bucket in plan.enter_tp_buckets():
        with graph.inserting_before(bucket.first):
            entered = graph.call_function(collectives.ENTER_TPS, ([*bucket.values], group_name, reduce_dtype))
            entered._rename(f"{bucket.first.name}_entered")
            _inherit_meta(entered, bucket.first)
            for i, value in enumerate(bucket.values):
                item = graph.call_function(operator.getitem, (entered, i))
                item._rename(f"{value.name}_entered")
                _inherit_meta(item, bucket.first)
                made[(value, ENTER_ONLY)] = item
    for bucket in plan.take_shard_buckets():
        with graph.inserting_before(bucket.first):
            cuts = graph.call_function(collectives.TAKE_SHARDS, ([*bucket.values], bucket.dim, group_name))
            cuts._rename(f"{bucket.first.name}_shards")
            _inherit_meta(cuts, bucket.first)
            for i, (value, consumer) in enumerate(zip(bucket.values, bucket.consumers, strict=True)):
                cut = graph.call_function(operator.getitem, (cuts, i))
                cut._rename(f"{value.name}_shard")
                _inherit_meta(cut, bucket.first)
                made[(value, plan.edges[(value, consumer)])] = cut
    for (value, consumer), steps in plan.edges.items():
        current = value
        for i, step in enumerate(steps):
            key = (value, steps[: i + 1])
            if key not in made:
                first_reader = min(readers[key], key=position.__getitem__)
                made[key] = _insert_step(graph, current, step, group_name, first_reader, plan.tp, reduce_dtype,
                                         late=current in written)
            current = made[key]
        consumer.replace_input_with(value, current)
    graph.lint()


def _insert_step(
    graph: fx.Graph, value: fx.Node, step, group_name: str, first_reader: fx.Node, tp: int, reduce_dtype=None,
    late: bool = False,
) -> fx.Node:
    """The collective node for ``step`` on ``value``, placed after the value it reads.

    A parameter or graph input is read at the top of the graph, so its
    collective goes right before its first reader instead, inside the same
    block: a block's parameters exist unsharded only during the block's call.
    So does a ``late`` value, one written in place after it is made (a buffer
    filled slice by slice): its collective must read it once it is written.
    """
    at_top = value.op in ("placeholder", "get_attr") or late
    origin = first_reader if at_top else value
    # before the node after ``value``: a chain of several nodes lands in creation order
    with graph.inserting_before(first_reader if at_top else value.next):
        if isinstance(step.dim, Strided):
            node = _strided_step(graph, value, step, group_name, reduce_dtype)
        elif step.sections is not None:  # a constant cut as a fused projection stores its sections
            sections = step.sections
            node = graph.call_function(TAKE_SECTIONS, (value, step.dim, list(sections.runs), list(sections.sizes),
                                                       list(sections.whole), group_name))
        else:
            args = (value, group_name) if step.dim is None else (value, step.dim, group_name)
            if reduce_dtype is not None and step.kind.sums_partials:
                args += (reduce_dtype,)  # a sum of partial values, forward or backward
            node = graph.call_function(collectives.op_of(step.kind), args)
            if step.average:  # a mean over the sharded dim: sum of means / tp
                node._rename(f"{value.name}_summed")
                with graph.inserting_after(node):
                    node = graph.call_function(aten.div.Tensor, (node, tp))
    node._rename(f"{value.name}_{step.kind.node_suffix}")
    made = node
    while made is not value:  # the step is a chain on its first argument; all of it runs in origin's unit
        _inherit_meta(made, origin)
        made = made.args[0]
    return node


def _written_in_place(graph: fx.Graph) -> set[fx.Node]:
    """Values an in-place op writes (``x[..., :n] = y`` is ``copy_`` on a slice of ``x``): the
    written view and every value it is a view of."""
    written = set()
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable or not node.args:
            continue
        value = node.args[0]
        while isinstance(value, fx.Node) and value not in written:
            written.add(value)
            value = value.args[0] if _is_view(value) else None
    return written


def _is_view(node: fx.Node) -> bool:
    """An ATen view op: its result aliases its first argument (``slice``, ``select``, ``view``...)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.returns or not node.args:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _inherit_meta(new: fx.Node, origin: fx.Node) -> None:
    made_like(new, origin)


def _strided_step(graph: fx.Graph, value: fx.Node, step, group_name: str, reduce_dtype=None) -> fx.Node:
    """Gather or take a ``Strided(dim, k)`` shard (or gather one for colwise linears, its gradient
    reduce-scattered): dim ``dim`` seen as ``[k, n]``, with ``n`` cut over tp, so the collective
    works on dim ``dim + 1`` of that view. (A sequence cut merged with the batch, ``reshape(-1,
    hidden)`` under sequence parallelism, is such a dim.)"""
    assert step.kind in _STRIDED_KINDS, f"no strided form of {step.kind}"
    dim, runs = step.dim.dim, step.dim.split_factor
    split = graph.call_function(aten.unflatten.int, (value, dim, [runs, -1]))
    args = (split, dim + 1, group_name)
    if reduce_dtype is not None and step.kind.sums_partials:
        args += (reduce_dtype,)
    moved = graph.call_function(collectives.op_of(step.kind), args)
    return graph.call_function(aten.flatten.using_ints, (moved, dim, dim + 1))
