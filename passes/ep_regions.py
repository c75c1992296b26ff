"""Expert parallelism in the graph: which experts the ``ep`` ranks can split whole, and the
rewrite that sends each row to the rank holding its expert and brings the result back.

An MoE layer's experts, as :mod:`autoshard.passes.experts` finds them, are expert sites that share
one routing: every ``W[ids]`` pick of one ``ids`` (Hugging Face's ``batched_mm``, gpt-oss), or every
grouped GEMM of one ``offs`` (``torch._grouped_mm`` and transformers' fallback for it: torchtitan's
``GroupedExperts``, transformers' ``grouped_mm``). Between its first matmul's input rows and its last
matmul's output, the layer's code must treat rows alone: each row computed from its own row only
(pointwise ops, casts, splits of the features, views that keep the rows). That stretch is the
layer's *region*; a row can then be computed on any rank that holds its expert:

* before the region, :func:`~autoshard.runtime.token_dispatch.ep_dispatch` sends the rows to the
  ranks of their experts (expert-major on arrival) and gives the region the local expert ids (for
  ``W[ids]``) or offsets (for a grouped GEMM);
* the region runs unchanged on this rank's ``E / ep`` experts;
* after it, :func:`~autoshard.runtime.token_dispatch.ep_combine` brings each output row back to
  the place its input row had. Routing, top-k, the weighting and the sum over choices, shared
  experts and any load-balancing loss stay the model's own code, before and after.

A layer ep cannot take is named with the reason (a loop over experts reads every token on every
expert, a dense routing, a value that leaves the experts mid-way), and its experts stay as tp
plans them. Records hold node names and parameter FQNs, not nodes: the plan is data, and the
rewrite finds the layer again on the graph it is given.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from autoshard.core.errors import describe
from autoshard.passes.experts import (
    _GROUPED_MM_EQUIVALENTS,
    ExpertSite,
    _op_name,
    example_value,
    find_expert_sites,
)
from autoshard.passes.partition import made_like
from autoshard.plans.ep_choice import ExpertLayer
from autoshard.runtime.collectives import ENTER_TP, REDUCE_PARTIAL
from autoshard.runtime.token_dispatch import EP_COMBINE, EP_DISPATCH

aten = torch.ops.aten

# ops that keep rows apart: the row dim 0 is kept, each output row read from the same input row
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_KEEPS_ROWS = frozenset({
    aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.clone.default, aten.alias.default,
    aten.contiguous.default, aten.detach.default, operator.getitem,
    # tp's sums over the features: every tp rank of an ep rank routes the same rows, so they arrive
    # alike and the sums stay row by row
    REDUCE_PARTIAL, ENTER_TP,
})
_DIM_OPS = {  # op -> the position of its dim argument (default 0 is the rows, which none may touch)
    aten.split.Tensor: 2, aten.split_with_sizes.default: 2, aten.chunk.default: 2, aten.slice.Tensor: 1,
    aten.select.int: 1, aten.narrow.default: 1, aten.unsqueeze.default: 1, aten.squeeze.dim: 1,
    aten.unbind.int: 1,
}


def expert_layers(gm: fx.GraphModule, param_shapes: dict[str, tuple[int, ...]]) -> tuple[ExpertLayer, ...]:
    """Every MoE layer of ``gm`` (its expert sites grouped by their routing), in graph order."""
    layers = []
    for members, routing in _grouped_sites(gm, param_shapes):
        found = _region(members, routing, param_shapes)
        layers.append(_layer(members, routing, param_shapes, found))
    return tuple(layers)


def _grouped_sites(gm, param_shapes) -> list[tuple[list[ExpertSite], tuple[str, fx.Node | None]]]:
    """Expert sites grouped by routing: ``(("indexed", ids) | ("grouped", offs) | (why not, None))``."""
    groups: dict[object, list[ExpertSite]] = {}
    routing: dict[object, tuple[str, fx.Node | None]] = {}
    for site in find_expert_sites(gm, param_shapes):
        form, node = _routing_of(site)
        key = node if node is not None else site.weight_fqn.rpartition(".")[0]
        groups.setdefault(key, []).append(site)
        routing.setdefault(key, (form, node))
    return [(members, routing[key]) for key, members in groups.items()]


def _routing_of(site: ExpertSite) -> tuple[str, fx.Node | None]:
    node = site.node
    if node.target == aten._grouped_mm.default or _op_name(node) in _GROUPED_MM_EQUIVALENTS:
        offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
        if isinstance(offs, fx.Node):
            return "grouped", offs
        return "a grouped GEMM without offsets groups nothing by expert", None
    first = site.chain[0] if site.chain else None
    if first is not None and first.target == aten.index.Tensor:
        ids = first.args[1][0]
        rows = example_value(site.input).shape[0]
        if example_value(ids).dim() == 1 and example_value(ids).shape[0] == rows:
            return "indexed", ids
        return f"its expert ids {describe(ids)} are not one id per row of the matmul's input", None
    if first is not None and first.target == aten.select.int:
        return ("a loop over experts runs every expert on every token (the routing is a weight, not a choice of "
                "rank); ep needs each row routed to one expert: W[ids] or a grouped GEMM"), None
    return "every expert reads every token (a dense routing): ep needs each row routed to one expert", None


@dataclasses.dataclass
class _Region:
    """The rows' stretch of one layer: ``nodes`` (graph order, the experts' parameter reads and picks by
    the routing included), ``entry`` (the rows every matmul reads), ``exit`` (the last value computed
    row by row: the last matmul's output, or past it through an expert bias), the expert parameters it
    reads; or why not (``refused``)."""

    nodes: list[fx.Node] = dataclasses.field(default_factory=list)
    entry: fx.Node | None = None
    exit: fx.Node | None = None
    params: tuple[str, ...] = ()
    refused: str = ""


def _region(members: list[ExpertSite], routing, param_shapes) -> _Region:
    form, key = routing
    if key is None:
        return _Region(refused=form)
    order = {n: i for i, n in enumerate(members[0].node.graph.nodes)}
    entry = _rows_source(members)
    ends = [s.node for s in members]
    if entry is None:
        return _Region(refused=f"the experts' matmuls read other rows than {describe(members[0].input)}'s")
    chains = {n for s in members for n in s.chain}
    region = _between(entry, ends) | chains
    params, extra = set(s.weight_fqn for s in members), set()
    num_experts = example_value(members[0].weight_node).shape[0]
    for node in list(region):
        for arg in node.all_input_nodes:
            if arg not in region:
                region |= _picked(arg, key, num_experts, param_shapes)
    for node in sorted(region, key=order.get):
        why = _why_not_rows(node, region, entry, key, members, extra, param_shapes)
        if why:
            return _Region(refused=why)
    params |= extra
    region = _through_the_exit(region, ends[-1] if len(ends) == 1 else max(ends, key=order.get), entry, key,
                               members, extra, param_shapes, num_experts)
    params |= extra
    exits = [n for n in region if any(u not in region for u in n.users)]
    if len(exits) != 1:
        leaving = ", ".join(describe(n) for n in sorted(exits, key=order.get) if n is not exits[-1])
        return _Region(refused=f"values leave the experts before their last matmul ({leaving})")
    nodes = sorted(region | {n for n in _expert_reads(region, params)}, key=order.get)
    return _Region(nodes=nodes, entry=entry, exit=exits[0], params=tuple(sorted(params)))


def _through_the_exit(region, last, entry, key, members, extra, param_shapes, num_experts) -> set[fx.Node]:
    """``region`` grown past its last matmul through row-wise ops that read only the rows and the
    experts' own parameters picked by the routing (an expert bias ``b[ids]`` added after the down
    projection), so those parameters are split with the experts; it stops at the first value from
    outside (the routing weights) or op that mixes rows."""
    exit_node = last
    while len(exit_node.users) == 1:
        user = next(iter(exit_node.users))
        grown = set(region) | {user}
        for arg in user.all_input_nodes:
            if arg not in grown:
                grown |= _picked(arg, key, num_experts, param_shapes)
        found: set[str] = set()
        if any(_why_not_rows(n, grown, entry, key, members, found, param_shapes) for n in grown - region):
            break
        if user.op != "call_function" or user.target == operator.getitem:
            break
        region, exit_node = grown, user
        extra |= found
    return region


def _picked(node: fx.Node, key: fx.Node, num_experts: int, param_shapes) -> set[fx.Node]:
    """``node`` and what computes it, if it is an expert parameter picked row by row by the routing
    (gpt-oss's ``gate_up_proj_bias[ids]``, read as a lookup), through casts and views; else empty."""
    if node.target in (aten.index.Tensor, aten.embedding.default):
        source, index = node.args[0], node.args[1]
        by_key = index is key if node.target == aten.embedding.default else list(index) == [key]
        if by_key and source.op == "get_attr" and source.target in param_shapes and (
                param_shapes[source.target][0] == num_experts):
            return {node}
        return set()
    if node.op == "call_function" and node.target in _KEEPS_ROWS | set(_VIEWS) and node.args:
        inner = _picked(node.args[0], key, num_experts, param_shapes) if isinstance(node.args[0], fx.Node) else set()
        return inner | {node} if inner and len(node.all_input_nodes) == 1 else set()
    return set()


def _rows_source(members: list[ExpertSite]) -> fx.Node | None:
    """The rows every matmul of the layer reads: the first matmul's input, or the value it is cast or
    copied from when the others read their own cast of it (torchtitan's ``x.bfloat16()`` per matmul)."""
    candidate = members[0].input
    while candidate is not None:
        if all(_descends(s.input, candidate) for s in members):
            return candidate
        inputs = candidate.all_input_nodes
        keeps = candidate.op == "call_function" and candidate.target in _KEEPS_ROWS and len(inputs) == 1
        candidate = inputs[0] if keeps else None
    return None


def _descends(node: fx.Node, ancestor: fx.Node) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is ancestor:
            return True
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return False


def _between(entry: fx.Node, ends: list[fx.Node]) -> set[fx.Node]:
    """Nodes on a path from ``entry`` (exclusive) to any of ``ends`` (inclusive)."""
    below, todo = set(), list(entry.users)
    while todo:
        n = todo.pop()
        if n not in below:
            below.add(n)
            todo.extend(n.users)
    above, todo = set(), list(ends)
    while todo:
        n = todo.pop()
        if n not in above and n in below:
            above.add(n)
            todo.extend(n.all_input_nodes)
    return above


def _expert_reads(region: set[fx.Node], params: set[str]) -> list[fx.Node]:
    return [a for n in region for a in n.all_input_nodes if a.op == "get_attr" and a.target in params]


def _why_not_rows(node, region, entry, key, members, extra: set[str], param_shapes) -> str:
    """Why ``node`` does not keep rows apart ("" when it does); expert parameters picked by the
    routing (a per-expert bias ``b[ids]``) are added to ``extra``."""
    if any(node is s.node for s in members) or node.op == "get_attr":
        return ""
    picked = node.target == aten.index.Tensor and list(node.args[1]) == [key] or (
        node.target == aten.embedding.default and node.args[1] is key)  # ``b[ids]`` read as a lookup
    if picked:
        source = node.args[0]
        if source.op == "get_attr" and example_value(source).shape[0] == example_value(members[0].weight_node).shape[0]:
            extra.add(source.target)
            return ""
        if source in region:
            return ""
    for arg in node.all_input_nodes:
        if arg in region or arg is entry or arg is key:
            continue
        if arg.op == "get_attr" and arg.target in {s.weight_fqn for s in members}:
            continue
        if arg.op == "get_attr" and arg.target in param_shapes:
            return (f"{describe(node)} reads parameter '{arg.target}' among the experts' rows: each rank would "
                    "see only the rows routed to it")
        if _carries_rows(arg, entry):
            return f"{describe(node)} reads {describe(arg)}, a value from outside the experts, row by row"
    val = example_value(node)
    if node.op != "call_function":
        return f"{describe(node)} is not an op on rows"
    if node.target in _KEEPS_ROWS:
        return ""
    if node.target in _VIEWS:
        source = example_value(node.args[0])
        if isinstance(val, torch.Tensor) and val.dim() and source.dim() and val.shape[0] == source.shape[0]:
            return ""
        return f"{describe(node)} reshapes across the rows"
    if node.target in _DIM_OPS:
        position = _DIM_OPS[node.target]
        dim = node.args[position] if len(node.args) > position else node.kwargs.get("dim", 0)
        source = example_value(node.args[0])
        if isinstance(dim, int) and dim % max(source.dim(), 1) != 0:
            return ""
        return f"{describe(node)} cuts or moves the rows"
    if node.target in (aten.transpose.int,):
        if 0 not in {d % val.dim() for d in node.args[1:3]}:
            return ""
        return f"{describe(node)} moves the rows"
    if node.target == aten.permute.default and node.args[1][0] % val.dim() == 0:
        return ""
    if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags:
        return ""
    return f"{describe(node)} has no rule that keeps rows apart"


def _carries_rows(arg: fx.Node, entry: fx.Node) -> bool:
    """Whether ``arg`` has as many leading rows as the entry (a per-row value from outside)."""
    val, rows = example_value(arg), example_value(entry).shape[0]
    return isinstance(val, torch.Tensor) and val.dim() > 0 and val.shape[0] == rows and rows > 1


def _layer(members: list[ExpertSite], routing, param_shapes, found: _Region) -> ExpertLayer:
    first = members[0]
    weights = found.params or tuple(sorted({s.weight_fqn for s in members}))
    module = _common_module(weights)
    return ExpertLayer(
        module=module,
        weights=weights,
        num_experts=int(param_shapes[first.weight_fqn][0]),
        form=routing[0] if not found.refused else "",
        rows=int(example_value(first.input).shape[0]),
        itemsize=example_value(first.input).dtype.itemsize,
        shapes=tuple(tuple(param_shapes[w]) for w in weights),
        gemms=tuple((s.in_features, s.out_features) for s in members),
        line=describe(first.node),
        refused=found.refused,
    )


def _common_module(fqns) -> str:
    parts = [f.split(".")[:-1] for f in fqns]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


# --- the rewrite --------------------------------------------------------------------------


def dispatch_experts(gm: fx.GraphModule, param_shapes: dict[str, tuple[int, ...]],
                     layers: tuple[frozenset[str], ...], ep: int, group_name: str,
                     outlined: frozenset[str] = frozenset()) -> int:
    """Rewrite every MoE layer of ``layers`` (each the expert weights of one layer the plan splits
    over ep) so its rows travel to their experts' ranks and back; returns how many were rewritten.
    The graph's expert weights are read as this rank's ``E / ep`` experts. A layer whose experts'
    module is in ``outlined`` has its experts' code moved into a GraphModule at that module's path,
    called between the dispatch and the combine: the unit FSDP cuts the experts by over the data
    axes ep leaves (see :func:`owns_its_module`)."""
    rewritten = 0
    for members, routing in _grouped_sites(gm, param_shapes):
        planned = next((weights for weights in layers if members[0].weight_fqn in weights), None)
        if planned is None:
            continue
        found = _region(members, routing, param_shapes)
        assert not found.refused and set(found.params) == planned, (
            f"the emitted code's MoE layer reads {sorted(found.params)} ({found.refused or 'rows kept apart'}); "
            f"the plan splits {sorted(planned)}")
        _rewrite(gm, found, routing, int(param_shapes[members[0].weight_fqn][0]), ep, group_name)
        module = _common_module(found.params)
        if module in outlined:
            _outline(gm, [n for n in gm.graph.nodes if n in set(found.nodes)], found.exit, module)
        rewritten += 1
    gm.graph.lint()
    gm.recompile()
    return rewritten


def owns_its_module(weights, param_fqns) -> str:
    """The experts' module path when it holds these weights and no other parameter (Hugging Face's
    ``mlp.experts``, torchtitan's ``moe.experts``): its code can become one module FSDP cuts the
    experts by; else ``""`` (the weights sit beside a router or other weights)."""
    module = _common_module(weights)
    if not module:
        return ""
    inside = {f for f in param_fqns if f.startswith(module + ".")}
    return module if inside == set(weights) else ""


def _outline(gm: fx.GraphModule, nodes: list[fx.Node], exit_node: fx.Node, module: str) -> None:
    """Move ``nodes`` (the experts' code and their parameter reads, graph order) into a GraphModule
    registered at ``module`` (replacing the container that held the parameters), called in their
    place with the values they read and returning ``exit_node``'s value."""
    members = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in members))
    assert all(u in members for n in nodes if n is not exit_node for u in n.users), "a value leaves the experts"
    graph = fx.Graph()
    env = {}
    for value in inputs:
        env[value] = graph.placeholder(value.name)
        env[value].meta.update(value.meta)
    attrs, prefix = {}, module + "."
    for node in nodes:
        copied = graph.node_copy(node, lambda a: env[a])
        if node.op == "get_attr":
            copied.target = node.target[len(prefix):]
            attrs[copied.target] = _fetch(gm, node.target)
        env[node] = copied
    graph.output(env[exit_node])
    experts = fx.GraphModule(attrs, graph, class_name=_class_of(exit_node, module))
    gm.add_submodule(module, experts)
    with gm.graph.inserting_after(exit_node):
        call = gm.graph.call_module(module, tuple(inputs))
    made_like(call, exit_node)
    call.meta["val"] = exit_node.meta.get("val")
    exit_node.replace_all_uses_with(call, delete_user_cb=lambda user: user not in members)
    for node in reversed(nodes):
        gm.graph.erase_node(node)
    call._rename(module.replace(".", "_"))


def _fetch(gm: fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _class_of(node: fx.Node, module: str) -> str:
    """The experts module's own class name, read from ``nn_module_stack``."""
    for path, type_name in (node.meta.get("nn_module_stack") or {}).values():
        if path == module:
            return str(type_name).rsplit(".", 1)[-1].strip("'>")
    return "Experts"


def _rewrite(gm: fx.GraphModule, found: _Region, routing, num_experts: int, ep: int, group_name: str) -> None:
    form, key = routing
    graph = gm.graph
    region = set(found.nodes)
    position = {n: i for i, n in enumerate(graph.nodes)}
    first = next(n for n in graph.nodes if n in region and n.op != "get_attr")
    with graph.inserting_after(max(found.entry, key, key=position.get)):
        dispatch = graph.call_function(EP_DISPATCH, (found.entry, key, num_experts, group_name, 1.0 / ep,
                                                     form == "grouped"))
    made_like(dispatch, first)
    parts = []
    for i in range(7):
        with graph.inserting_after(parts[-1] if parts else dispatch):
            parts.append(graph.call_function(operator.getitem, (dispatch, i)))
        made_like(parts[-1], first)
    local_rows, local_ids, local_offsets, order, arrival, send, receive = parts
    local_key = local_offsets if form == "grouped" else local_ids
    for node in found.nodes:
        if node.op == "get_attr":
            continue
        node.args = fx.map_arg(node.args, lambda a: local_rows if a is found.entry else local_key if a is key else a)
        node.kwargs = fx.map_arg(node.kwargs,
                                 lambda a: local_rows if a is found.entry else local_key if a is key else a)
        if node.target in _VIEWS:
            shape = list(node.args[1])
            node.args = (node.args[0], [-1, *shape[1:]], *node.args[2:])
    position = {n: i for i, n in enumerate(graph.nodes)}
    _after(receive, [n for n in found.nodes if n.op != "get_attr" and position[n] < position[dispatch]])
    exit_users = [u for u in found.exit.users if u not in region]
    with graph.inserting_after(found.exit):
        combine = graph.call_function(EP_COMBINE, (found.exit, order, arrival, send, receive, group_name, 1.0 / ep))
    made_like(combine, found.exit)
    for user in exit_users:
        user.replace_input_with(found.exit, combine)


def _after(anchor: fx.Node, nodes: list[fx.Node]) -> None:
    """Move ``nodes`` (in their order) to just after ``anchor``: region nodes the graph computed
    before the dispatch now read what it delivers."""
    for node in reversed(nodes):
        anchor.append(node)
