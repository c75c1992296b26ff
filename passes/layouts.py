"""Layouts: insert the tp redistributes the layout plan asks for.

Each ``(value, consumer)`` edge of the :class:`~passes.propagate.LayoutPlan`
becomes a short chain of ``autoshard::*`` collective nodes (see
:mod:`autoshard.collectives`). Chains are shared: all consumers needing the
same steps on the same value read one node, so a value is gathered once and
q/k/v share one ``enter_tp``. Views whose sharded dim shrinks get their local
shape arguments.
"""

from __future__ import annotations

import torch.fx as fx
from autoshard.passes.propagate import ENTER_TP, GATHER, TAKE_SHARD, LayoutPlan

from autoshard import collectives

_OP = {ENTER_TP: collectives.ENTER_TP, GATHER: collectives.GATHER_SHARDS, TAKE_SHARD: collectives.TAKE_SHARD}
_NAME = {ENTER_TP: "enter_tp", GATHER: "gathered", TAKE_SHARD: "shard"}


def insert_redistributes(gm: fx.GraphModule, plan: LayoutPlan, group_name: str) -> None:
    graph = gm.graph
    for node, args in plan.new_args.items():
        node.args = args
    made: dict[tuple, fx.Node] = {}
    for (value, consumer), steps in plan.edges.items():
        current = value
        for i, step in enumerate(steps):
            key = (value, steps[: i + 1])
            if key not in made:
                made[key] = _insert_step(graph, current, step, group_name)
            current = made[key]
        consumer.replace_input_with(value, current)
    graph.lint()


def _insert_step(graph: fx.Graph, value: fx.Node, step, group_name: str) -> fx.Node:
    anchor = value
    if value.op in ("placeholder", "get_attr"):
        anchor = next(n for n in graph.nodes if n.op not in ("placeholder", "get_attr")).prev
    args = (value, group_name) if step.kind == ENTER_TP else (value, step.dim, group_name)
    with graph.inserting_after(anchor):
        node = graph.call_function(_OP[step.kind], args)
    node._rename(f"{value.name}_{_NAME[step.kind]}")
    node.meta.update({k: value.meta[k] for k in ("nn_module_stack", "stack_trace") if k in value.meta})
    return node
