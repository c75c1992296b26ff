"""Stages: split the partitioned root graph into pipeline stages.

The root graph (:mod:`autoshard.passes.partition`) calls the blocks in order with the root's own
code around them. Given which stage runs each block (contiguous runs, in graph order), every
root node goes to a stage by one rule each:

* the model's inputs enter at the first stage, its outputs leave the last;
* a block's call, and the items taken from its result, run on the block's stage;
* a value computed from constants alone (a rotary table sliced to the sequence, a causal mask
  built from ``arange``) is computed again by each stage that reads it: it costs an op, where
  sending it costs a transfer per microbatch and boundary;
* a parameter is read on the one stage that uses it; one read on two stages (an embedding
  tied to the LM head on the last stage) is refused, naming it and its readers;
* any other root node runs where the graph reads it: on the earliest stage of its users (the
  embedding with the first block, the final norm, head and loss with the last), and never
  before the stage of a value it reads.

A value computed on one stage and read on a later one (the hidden state, and also a mask or
position ids made from the inputs, a residual that skips a block) crosses every boundary in
between: each stage in between takes it and hands it on (torch's multi-stage schedules send
only to the next stage). Each stage is a GraphModule taking the values it receives as positional
tensors and returning those it sends, in graph order; the first takes the model's flat inputs, the
last returns its flat outputs.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autoshard.core.errors import describe
from autoshard.runtime.graph_parts import Partitioned, StageGraph, StageSplit

_RANDOM = frozenset({torch.ops.aten.rand.default, torch.ops.aten.randn.default, torch.ops.aten.randint.default,
                     torch.ops.aten.bernoulli.default, torch.ops.aten.native_dropout.default})


def split_stages(part: Partitioned, stage_of_block: dict[str, int], stages: int,
                 params: frozenset[str]) -> StageSplit:
    """Cut ``part``'s root graph into ``stages`` GraphModules; ``stage_of_block`` gives every block's
    stage (non-decreasing in graph order), ``params`` the trainable parameter FQNs."""
    root = part.root
    nodes = list(root.graph.nodes)
    last = stages - 1
    free = _computed_from_constants(nodes, params)
    stage = _assign(nodes, stage_of_block, free, params, last)
    carried = _carried(nodes, stage, free, stages)
    built = []
    for index in range(stages):
        receives = tuple(n.name for n in nodes if n.op == "placeholder") if index == 0 else carried[index - 1]
        module, blocks, held = _stage_module(root, nodes, index, stage, free, carried, last, params)
        own = {fqn for fqn in params if any(fqn.startswith(b + ".") for b in blocks)}
        built.append(StageGraph(index, module, blocks, receives, carried[index] if index < last else (),
                                tuple(sorted(own | held))))
    return StageSplit(tuple(built), carried)


def _computed_from_constants(nodes, params: frozenset[str]) -> set[fx.Node]:
    """Root nodes whose value depends on no input and no parameter (each stage recomputes them)."""
    free: set[fx.Node] = set()
    for node in nodes:
        if node.op == "get_attr":
            if node.target not in params:
                free.add(node)
        elif (node.op == "call_function" and node.target not in _RANDOM
              and all(a in free for a in node.all_input_nodes)):
            free.add(node)
    return free


def _assign(nodes, stage_of_block, free, params, last) -> dict[fx.Node, int | None]:
    """Each root node's stage (None for the values every stage recomputes)."""
    fixed: dict[fx.Node, int] = {}
    for node in nodes:
        if node.op == "placeholder":
            fixed[node] = 0
        elif node.op == "output":
            fixed[node] = last
        elif node.op == "call_module":
            fixed[node] = stage_of_block[node.target]
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in fixed \
                and node.args[0].op == "call_module":
            fixed[node] = fixed[node.args[0]]
    earliest: dict[fx.Node, int] = {}
    for node in nodes:
        if node in free or (node.op == "get_attr" and node.target in params):
            continue
        lowest = max((earliest[a] for a in node.all_input_nodes if a in earliest), default=0)
        if node in fixed and fixed[node] < lowest:
            raise ValueError(f"autoshard: {describe(node)} runs on pipeline stage {fixed[node]} but reads a value "
                             f"computed on stage {lowest}: the stages must follow the graph's order of blocks")
        earliest[node] = fixed.get(node, lowest)
    stage: dict[fx.Node, int | None] = {}
    for node in reversed(nodes):
        if node in free:
            stage[node] = None
        elif node.op == "get_attr" and node.target in params:
            readers = sorted({stage[u] for u in node.users})
            if len(readers) > 1:
                raise NotImplementedError(
                    f"autoshard: parameter '{node.target}' is read on pipeline stages {readers} ("
                    + "; ".join(describe(u) for u in node.users) + "): a parameter lives on one stage. Untie it "
                    "(an LM head of its own instead of the embedding's table), or give a split (pp_split) that "
                    "keeps its readers on one stage")
            stage[node] = readers[0] if readers else 0
        elif node in fixed:
            stage[node] = fixed[node]
        else:
            users = [stage[u] for u in node.users if stage[u] is not None]
            stage[node] = max(earliest[node], min(users)) if users else earliest[node]
    return stage


def _carried(nodes, stage, free, stages) -> tuple[tuple[str, ...], ...]:
    """``carried[k]``: the values computed on stage ``k`` or before and read after it, in graph order."""
    carried: list[list[str]] = [[] for _ in range(stages - 1)]
    for node in nodes:
        if node in free or stage[node] is None or node.op in ("output", "get_attr"):
            continue
        if node.op == "call_module" and any(u.target is operator.getitem for u in node.users):
            continue  # its items cross, not the tuple
        readers = [stage[u] for u in node.users if stage[u] is not None]
        for boundary in range(stage[node], max(readers, default=stage[node])):
            carried[boundary].append(node.name)
    return tuple(tuple(c) for c in carried)


def _needed_free(nodes, index, stage, free) -> set[fx.Node]:
    """The recomputed values the stage's own nodes read, with what they are computed from."""
    needed: set[fx.Node] = set()
    frontier = [a for n in nodes if stage[n] == index for a in n.all_input_nodes if a in free]
    while frontier:
        node = frontier.pop()
        if node not in needed:
            needed.add(node)
            frontier += node.all_input_nodes
    return needed


def _stage_module(root, nodes, index, stage, free, carried, last, params):
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_name = {n.name: n for n in nodes}
    attrs: dict[str, object] = {}
    if index == 0:
        for node in nodes:
            if node.op == "placeholder":
                env[node] = graph.node_copy(node)
    else:
        for name in carried[index - 1]:
            env[by_name[name]] = graph.placeholder(name)
            env[by_name[name]].meta = dict(by_name[name].meta)
    needed = _needed_free(nodes, index, stage, free)
    blocks, held = [], set()
    output = None
    for node in nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            output = node
            continue
        if not (stage[node] == index or node in needed):
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
        if node.op in ("get_attr", "call_module"):
            attrs[node.target] = _fetch(root, node.target)
        if node.op == "call_module":
            blocks.append(node.target)
        if node.op == "get_attr" and node.target in params:
            held.add(node.target)
    if index == last:
        graph.output(fx.map_arg(output.args[0], lambda n: env[n]))
    else:
        sent = []
        for name in carried[index]:
            value = env[by_name[name]]
            if value.op == "placeholder":  # handed on: a node of its own, so autograd sends its gradient back
                value = graph.call_function(torch.ops.aten.alias.default, (value,))
                value.meta = dict(by_name[name].meta)
            sent.append(value)
        graph.output(tuple(sent))
    graph.lint()
    return fx.GraphModule(attrs, graph, class_name=f"Stage{index}"), tuple(blocks), held


def _fetch(module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


def stitched(split: StageSplit, root: fx.GraphModule) -> fx.GraphModule:
    """The stages called one after another as one GraphModule taking and returning what ``root``
    does: what a proof runs to show the cut loses and changes nothing. Each stage is marked as
    holding the model's own FQNs (:attr:`HOLDS_MODEL_FQNS`), so its parameters are found by them."""
    graph = fx.Graph()
    graph._codegen = root.graph._codegen
    env: dict[str, fx.Node] = {}
    for node in root.graph.nodes:
        if node.op == "placeholder":
            env[node.name] = graph.node_copy(node)
    output = next(n for n in root.graph.nodes if n.op == "output")
    flat_outputs = list(output.args[0])
    attrs = {}
    last = len(split.stages) - 1
    results: list[fx.Node] = []
    for stage in split.stages:
        name = f"stage{stage.index}"
        setattr(stage.module, HOLDS_MODEL_FQNS, True)
        attrs[name] = stage.module
        call = graph.call_module(name, tuple(env[v] for v in stage.receives))
        sends = stage.sends if stage.index < last else tuple(range(len(flat_outputs)))
        for i, value in enumerate(sends):
            item = graph.call_function(operator.getitem, (call, i))
            if stage.index < last:
                env[value] = item
            else:
                results.append(item)
    graph.output(type(output.args[0])(results) if isinstance(output.args[0], (list, tuple)) else results[0])
    module = fx.GraphModule(attrs, graph, class_name="StitchedStages")
    for attr in ("_in_spec", "_out_spec"):
        if hasattr(root, attr):
            setattr(module, attr, getattr(root, attr))
    return module


HOLDS_MODEL_FQNS = "holds_model_fqns"  # a stage module reads parameters by the model's FQNs, not under its name
