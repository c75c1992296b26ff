"""Layouts: insert the tp redistributes the layout plan asks for.

Each ``(value, consumer)`` edge of the :class:`~passes.propagate.LayoutPlan`
becomes a short chain of ``autoshard::*`` collective nodes (see
:mod:`autoshard.collectives`). Chains are shared: all consumers needing the
same steps on the same value read one node, so a value is gathered once and
q/k/v share one ``enter_tp``. Views whose sharded dim shrinks get their local
shape arguments.
"""

from __future__ import annotations

from collections import defaultdict

import torch.fx as fx

from autoshard import collectives
from autoshard.passes.propagate import (
    ENTER_TP,
    GATHER,
    GATHER_FOR_COLWISE,
    SHARDED_OUTPUT,
    TAKE_SHARD,
    LayoutPlan,
)

_OP = {
    ENTER_TP: collectives.ENTER_TP,
    GATHER: collectives.GATHER_SHARDS,
    TAKE_SHARD: collectives.TAKE_SHARD,
    SHARDED_OUTPUT: collectives.as_sharded_dtensor,
    GATHER_FOR_COLWISE: collectives.GATHER_FOR_COLWISE,
}
_NAME = {
    ENTER_TP: "enter_tp",
    GATHER: "gathered",
    TAKE_SHARD: "shard",
    SHARDED_OUTPUT: "dtensor",
    GATHER_FOR_COLWISE: "gathered",
}


def insert_redistributes(gm: fx.GraphModule, plan: LayoutPlan, group_name: str) -> None:
    graph = gm.graph
    for node, args in plan.new_args.items():
        node.args = args
    position = {node: i for i, node in enumerate(graph.nodes)}
    readers: dict[tuple, list[fx.Node]] = defaultdict(list)
    for (value, consumer), steps in plan.edges.items():
        for i in range(len(steps)):
            readers[(value, steps[: i + 1])].append(consumer)
    made: dict[tuple, fx.Node] = {}
    for (value, consumer), steps in plan.edges.items():
        current = value
        for i, step in enumerate(steps):
            key = (value, steps[: i + 1])
            if key not in made:
                first_reader = min(readers[key], key=position.__getitem__)
                made[key] = _insert_step(graph, current, step, group_name, first_reader)
            current = made[key]
        consumer.replace_input_with(value, current)
    graph.lint()


def _insert_step(graph: fx.Graph, value: fx.Node, step, group_name: str, first_reader: fx.Node) -> fx.Node:
    """The collective node for ``step`` on ``value``, placed after the value it reads.

    A parameter or graph input is read at the top of the graph, so its
    collective goes right before its first reader instead, inside the same
    block: a block's parameters exist unsharded only during the block's call.
    """
    args = (value, group_name) if step.kind == ENTER_TP else (value, step.dim, group_name)
    at_top = value.op in ("placeholder", "get_attr")
    with graph.inserting_before(first_reader) if at_top else graph.inserting_after(value):
        node = graph.call_function(_OP[step.kind], args)
    node._rename(f"{value.name}_{_NAME[step.kind]}")
    origin = first_reader if at_top else value
    node.meta.update({k: origin.meta[k] for k in ("nn_module_stack", "stack_trace") if k in origin.meta})
    return node
