"""Partition: split the flat graph into one sub-GraphModule per block.

FSDP2 all-gathers a module's parameters in its forward pre-hook and frees them
after its forward, so per-block sharding needs per-block modules. Each block
(``layers.0``, ...) becomes a GraphModule registered at the block's own FQN
and owning the block's parameters under their relative names; the root graph
calls it. Parameter FQNs are therefore exactly the original ones. Nodes the
rewrite passes add inherit the ``nn_module_stack`` of the node they attach
to, so blocks found callable at capture stay callable.

A node belongs to the block in its ``nn_module_stack``; parameter reads
belong to the block owning the parameter. The root graph is re-ordered so
each block's nodes form one call (a stable topological order over blocks and
the remaining nodes). A block that cannot form one call (it runs twice, or
its nodes interleave with a dependency cycle through the root) stays in the
root graph: :func:`callable_blocks` leaves it out, so the plan shows its
parameters in the root unit.
"""

from __future__ import annotations

import heapq
import operator

import torch.fx as fx
import torch.nn as nn

from autoshard.plans.block_owners import BlockOwners
from autoshard.runtime.graph_parts import Partitioned


def callable_blocks(gm: fx.GraphModule, block_fqns: tuple[str, ...]) -> tuple[str, ...]:
    """The blocks of ``block_fqns`` that can each become one call; the others stay in the root.

    A block can be one call unless some node outside it both depends on the
    block and feeds it (the block runs twice, or interleaves with other code).
    """
    unit = _assign_units(gm, block_fqns)
    members: dict[str, set[fx.Node]] = {}
    for node, u in unit.items():
        if u:
            members.setdefault(u, set()).add(node)
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    return tuple(b for b in block_fqns if b in members and not _runs_around(members[b], index))


def _runs_around(members: set[fx.Node], index: dict[fx.Node, int]) -> bool:
    """Whether a node outside ``members`` depends on them and feeds them.

    Graph order is topological, so such a node comes after a use that leaves the block
    (an exit) and before an input that enters it (an entry): both searches stay between
    the first exit and the last entry. A block of a stack, whose exits all follow its
    entries, costs only its own edges, and checking every block stays linear in the graph
    instead of walking everything downstream and upstream of each block.
    """
    exits = {user for node in members for user in node.users if user not in members}
    entries = {arg for node in members for arg in node.all_input_nodes if arg not in members}
    if not exits or not entries:
        return False
    first_exit, last_entry = min(index[n] for n in exits), max(index[n] for n in entries)
    if first_exit > last_entry:
        return False
    after = _reach({n for n in exits if index[n] <= last_entry}, lambda n: n.users,
                   lambda n: index[n] <= last_entry)
    before = _reach({n for n in entries if index[n] >= first_exit}, lambda n: n.all_input_nodes,
                    lambda n: index[n] >= first_exit)
    return bool((after & before) - members)


def _reach(start: set[fx.Node], step, inside) -> set[fx.Node]:
    """``start`` and every node reached from it by ``step`` through nodes ``inside`` holds for."""
    seen: set[fx.Node] = set(start)
    frontier = list(start)
    while frontier:
        for nxt in step(frontier.pop()):
            if nxt not in seen and inside(nxt):
                seen.add(nxt)
                frontier.append(nxt)
    return seen


def partition(gm: fx.GraphModule, block_fqns: tuple[str, ...]) -> Partitioned:
    """``block_fqns`` must come from :func:`callable_blocks` on the same graph."""
    unit = _assign_units(gm, block_fqns)
    order = _block_order(gm, unit, block_fqns)

    root_graph = fx.Graph()
    root_graph._codegen = gm.graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    root_attrs: dict[str, object] = {}
    blocks: dict[str, fx.GraphModule] = {}
    for item in order:
        if isinstance(item, fx.Node):
            if item.op == "output":
                root_graph.output(fx.map_arg(item.args[0], lambda n: env[n]))
                continue
            env[item] = root_graph.node_copy(item, lambda n: env[n])
            if item.op in ("get_attr", "call_module"):  # a module: experts outlined for their own FSDP unit
                root_attrs[item.target] = _fetch(gm, item.target)
            continue
        block, nodes = item
        sub, inputs, outputs = _extract(gm, block, nodes)
        blocks[block] = sub
        root_attrs[block] = sub
        call = root_graph.call_module(block, tuple(env[i] for i in inputs))
        call._rename(block.replace(".", "_"))
        if len(outputs) == 1:
            env[outputs[0]] = call
        else:
            for i, out in enumerate(outputs):
                env[out] = root_graph.call_function(operator.getitem, (call, i))
                env[out]._rename(out.name)
    root = fx.GraphModule(root_attrs, root_graph, class_name=gm.__class__.__name__)
    for attr in ("_in_spec", "_out_spec"):
        setattr(root, attr, getattr(gm, attr))
    return Partitioned(root, blocks)


def _fetch(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def made_like(new: fx.Node, origin: fx.Node, also: tuple[str, ...] = ()) -> None:
    """A node a pass adds for ``origin``'s sake takes its module stack and source line (and the
    ``also`` meta keys): partitioning puts it in ``origin``'s block, and errors name the user's
    line. Every pass that adds nodes goes through this."""
    new.meta.update({k: origin.meta[k] for k in (*also, "nn_module_stack", "stack_trace") if k in origin.meta})


def made_node(graph: fx.Graph, target, args: tuple, like: fx.Node, val) -> fx.Node:
    """A ``call_function`` node of ``target`` inserted at the graph's insert point for ``like``'s sake
    (:func:`made_like`), with its value ``val`` as ``meta["val"]``."""
    new = graph.call_function(target, args)
    made_like(new, like)
    new.meta["val"] = val
    return new


def _assign_units(gm: fx.GraphModule, block_fqns) -> dict[fx.Node, str]:
    owners = BlockOwners(block_fqns)
    unit: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            unit[node] = ""
        elif node.op == "get_attr":
            unit[node] = owners.of_path(node.target)
        else:
            unit[node] = owners.of_node(node)
    # reads of a block parameter used only outside that block belong to the root
    for node in gm.graph.nodes:
        if node.op == "get_attr" and unit[node] and any(unit[u] != unit[node] for u in node.users):
            unit[node] = ""
    return unit


def _block_order(gm, unit, block_fqns) -> list:
    """Stable topological order of root nodes and whole blocks (by first appearance)."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    item_of = {n: (unit[n] if unit[n] in block_fqns else n) for n in nodes}
    members: dict[str, list[fx.Node]] = {}
    for n in nodes:
        if isinstance(item_of[n], str):
            members.setdefault(item_of[n], []).append(n)
    deps: dict[object, set] = {}
    for n in nodes:
        item = item_of[n]
        deps.setdefault(item, set())
        for inp in n.all_input_nodes:
            if item_of[inp] != item:
                deps[item].add(item_of[inp])
    users: dict[object, set] = {item: set() for item in deps}
    for item, ds in deps.items():
        for d in ds:
            users[d].add(item)
    first = {item: min(index[m] for m in members[item]) if isinstance(item, str) else index[item] for item in deps}
    pending = {item: len(ds) for item, ds in deps.items()}
    heap = [(first[item], id(item), item) for item, c in pending.items() if c == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, _, item = heapq.heappop(heap)
        order.append((item, members[item]) if isinstance(item, str) else item)
        for user in users[item]:
            pending[user] -= 1
            if pending[user] == 0:
                heapq.heappush(heap, (first[user], id(user), user))
    assert all(c == 0 for c in pending.values()), "a block is not callable: see callable_blocks"
    return order


def _extract(gm: fx.GraphModule, block: str, nodes: list[fx.Node]):
    """The block's own GraphModule, its external inputs and its outputs used outside."""
    member = set(nodes)
    inputs: list[fx.Node] = []
    for n in nodes:
        for inp in n.all_input_nodes:
            if inp not in member and inp not in inputs:
                inputs.append(inp)
    outputs = [n for n in nodes if any(u not in member for u in n.users)]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for inp in inputs:
        env[inp] = graph.placeholder(inp.name)
        env[inp].meta.update(inp.meta)
    attrs: dict[str, object] = {}
    prefix = block + "."
    for n in nodes:
        copied = graph.node_copy(n, lambda a: env[a])
        if n.op == "get_attr" or n.op == "call_module" and n.target.startswith(prefix):
            copied.target = n.target[len(prefix):]
            attrs[copied.target] = _fetch(gm, n.target)
        env[n] = copied
    graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    sub = fx.GraphModule(attrs or nn.Module(), graph, class_name=_class_name(nodes, block))
    return sub, inputs, outputs


def _class_name(nodes: list[fx.Node], block: str) -> str:
    """The block's own class name (``TransformerBlock``), read from ``nn_module_stack``."""
    for node in nodes:
        for path, type_name in (node.meta.get("nn_module_stack") or {}).values():
            if path == block:
                return str(type_name).rsplit(".", 1)[-1].strip("'>")
    return "Block"
