"""Higher-order regions of the captured graph, inlined into one flat ATen graph.

``torch.export`` keeps two context managers of ordinary model code as higher-order ops
whose body is a submodule: ``torch.autocast(...)`` (a decorator or a ``with`` block that
keeps rotary tables or a norm in float32) becomes ``wrap_with_autocast(device, dtype,
enabled, cache_enabled, body, *args)``, and ``torch.no_grad()`` / ``torch.enable_grad()``
(HF rotary embeddings are decorated with ``@torch.no_grad()``) becomes
``wrap_with_set_grad_enabled(enabled, body, *args)``.

Every later pass reads ATen ops node by node; a region would hide its ops from the layout
rules (attention whose q and k pass through one is computed whole or gathered), from
the FLOP count and from the simulations on meta, which would run the body as a
whole. So capture inlines each region, keeping what it means:

* **autocast**: the casts autocast makes inside the region at run time are written into
  the graph as ``aten.to.dtype`` nodes (found by running each op of the body on its
  traced values under the region's autocast state and recording the casts autocast
  applies to its inputs). A region that disables autocast adds no cast: its ops compute
  in the dtypes their inputs have, as the graph already says. The sharded model runs the
  dtypes captured; mixed precision is FSDP2's ``mp_policy``, not an outer autocast.
* **grad mode**: a region that turns gradients off makes values no gradient flows
  through; its outputs are ``detach``ed where they leave it, which gives the same values
  and gradients (and keeps nothing for backward once the outputs are detached). A region
  that turns gradients on inside a training forward changes nothing and is inlined as is.
  A write into a parameter inside a no-grad region (a ``@torch.no_grad()`` method clamping a
  learned scale in place) is its functional twin, and later code reads the written value
  with the parameter's gradient passing through it, as eager code reads the parameter itself.
  The stored parameter keeps its value, as under FSDP2, whose forward writes land on the
  gathered copy of a parameter: each forward writes again what it reads.

Regions nest (an autocast region inside a no-grad one); the outer is inlined first and its
body's regions in turn. Any other higher-order op is refused by name and source line.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch._higher_order_ops.wrap import wrap_with_autocast, wrap_with_set_grad_enabled
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.core.errors import source_line

aten = torch.ops.aten


def inline_regions(gm: fx.GraphModule) -> int:
    """Inline every autocast and grad-mode region of ``gm``'s graph in place; returns how many.

    Raises ``NotImplementedError`` for any other higher-order op, naming it and the first
    source line of its body.
    """
    inlined = 0
    while (node := next((n for n in gm.graph.nodes if isinstance(n.target, HigherOrderOperator)), None)) is not None:
        if node.target is wrap_with_autocast:
            device, dtype, enabled, _cache, body, *args = node.args
            autocast = (device, dtype) if enabled else None
            outputs = _inline_body(gm, node, body, args, autocast)
        elif node.target is wrap_with_set_grad_enabled:
            enabled, body, *args = node.args
            written: dict[fx.Node, fx.Node] = {}
            outputs = _inline_body(gm, node, body, args, None, None if enabled else written)
            if not enabled:
                outputs = [_written_through(gm.graph, node, out, written) if out in written.values()
                           else _detached(gm.graph, node, out) for out in outputs]
        else:
            raise NotImplementedError(
                f"autoshard: the captured graph holds the higher-order op {node.target.name()} at "
                f"{_region_line(gm, node)}; autoshard plans through autocast and grad-mode regions "
                f"(torch.autocast, torch.no_grad) only"
            )
        _replace_outputs(gm, node, outputs)
        inlined += 1
    return inlined


def _inline_body(gm: fx.GraphModule, node: fx.Node, body_node: fx.Node, args, autocast,
                 written: dict[fx.Node, fx.Node] | None = None) -> list:
    """Copy the region's body before ``node``, its placeholders bound to ``args``; returns
    the copies of its outputs. Under an enabled ``autocast`` the casts it makes are added.

    ``written`` (a no-grad region's): an op writing in place into a parameter (``@torch.no_grad()``
    code clamping a learned scale, ``p.clamp_(0, 1)``) is copied as its functional twin, and
    ``written`` maps the parameter to the value it holds after the write; later reads in the body
    read that value. Run with gradients on, the in-place write would be refused on a leaf."""
    body = _attribute(gm, body_node.target)
    graph = gm.graph
    env: dict[fx.Node, object] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, args, strict=True))
    current: dict[fx.Node, fx.Node] = {}  # a written parameter -> its value now

    def read(inner: fx.Node):
        value = env[inner]
        return current.get(value, value) if isinstance(value, fx.Node) else value

    outputs = []
    with graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                outputs = list(pytree.tree_leaves(fx.node.map_arg(inner.args[0], read)))
                break
            if inner.op == "get_attr":  # a nested region's body: held by gm under a fresh name
                copied = graph.get_attr(_adopt(gm, _attribute(body, inner.target), inner.target))
                copied.meta = dict(inner.meta)
            else:
                copied = graph.node_copy(inner, read)
                target = _functional_twin(gm, copied) if written is not None else None
                if target is not None:
                    parameter = env[inner.args[0]]
                    copied.target = target
                    current[parameter] = written[parameter] = copied
                if autocast is not None and isinstance(copied.target, torch._ops.OpOverload):
                    _write_autocast_casts(graph, copied, *autocast)
            env[inner] = copied
    return outputs


def _functional_twin(gm: fx.GraphModule, node: fx.Node):
    """The out-of-place overload of ``node``'s op when it writes in place into a parameter
    (``aten.clamp_.default`` -> ``aten.clamp.default``), else None."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    first = node.args[0]
    while first.op == "call_function" and first.target in (aten.detach.default, aten.alias.default):
        first = first.args[0]
    if first.op != "get_attr" or not isinstance(_attribute(gm, first.target), nn.Parameter):
        return None
    name = node.target._schema.name.split("::")[-1]
    packet = getattr(aten, name.rstrip("_"), None) if name.endswith("_") else None
    return getattr(packet, node.target._overloadname, None) if packet is not None else None


def _written_through(graph: fx.Graph, region: fx.Node, value: fx.Node, written: dict) -> fx.Node:
    """A parameter written in place inside a no-grad region, as later code reads it: the written
    value, through which the gradient reaches the parameter as it does in eager code (the code reads
    the parameter itself): ``p + (new - p).detach()``."""
    parameter = next(p for p, new in written.items() if new is value)
    with graph.inserting_before(region):
        step = graph.call_function(aten.sub.Tensor, (value, parameter))
        frozen = graph.call_function(aten.detach.default, (step,))
        through = graph.call_function(aten.add.Tensor, (parameter, frozen))
    val = value.meta["val"]
    for made in (step, frozen, through):
        made.meta = {**{k: v for k, v in value.meta.items() if k in ("nn_module_stack", "stack_trace")},
                     "val": val.detach()}
    return through


def _write_autocast_casts(graph: fx.Graph, node: fx.Node, device: str, dtype: torch.dtype) -> None:
    """Give ``node`` the casts autocast applies to its tensor inputs at run time, as
    ``aten.to.dtype`` nodes before it (recorded on the traced values, see :class:`_CastRecorder`)."""
    inputs = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
    values = {a: a.meta.get("val") for a in inputs}
    fake_mode = detect_fake_mode(list(values.values()))
    if not values or fake_mode is None or not all(isinstance(v, torch.Tensor) for v in values.values()):
        return
    recorder = _CastRecorder({id(v) for v in values.values()})
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: values.get(a, a))
    with fake_mode, torch.autocast(device_type=device, dtype=dtype), recorder:
        node.target(*args, **kwargs)
    for source, value in values.items():
        target = recorder.casts.get(id(value))
        if target is None or target == value.dtype:
            continue
        with graph.inserting_before(node):
            cast = graph.call_function(aten.to.dtype, (source, target))
        with fake_mode:
            cast.meta = {**{k: v for k, v in source.meta.items() if k != "val"}, **_site(node),
                         "val": value.to(target)}
        node.replace_input_with(source, cast)


class _CastRecorder(TorchDispatchMode):
    """Records the dtype autocast casts each watched tensor to before the op runs."""

    def __init__(self, watched: set[int]):
        super().__init__()
        self.watched = watched
        self.casts: dict[int, torch.dtype] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._to_copy.default and args and id(args[0]) in self.watched and "dtype" in kwargs:
            self.casts.setdefault(id(args[0]), kwargs["dtype"])
        return func(*args, **kwargs)


def _detached(graph: fx.Graph, region: fx.Node, value):
    """``value`` as it leaves a no-grad region: detached, so no gradient flows through it."""
    if not isinstance(value, fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
        return value
    with graph.inserting_before(region):
        detached = graph.create_node("call_function", aten.detach.default, (value,), name=f"{value.name}_detached")
    detached.meta = {**{k: v for k, v in value.meta.items() if k in ("nn_module_stack", "stack_trace")},
                     "val": value.meta["val"].detach()}
    return detached


def _replace_outputs(gm: fx.GraphModule, region: fx.Node, outputs: list) -> None:
    """Point the region's ``getitem`` users at the inlined outputs, then drop the region and
    its body."""
    graph = gm.graph
    for user in list(region.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
    assert not region.users, f"region {region.name} still has users {list(region.users)}"
    body = region.args[4] if region.target is wrap_with_autocast else region.args[1]
    graph.erase_node(region)
    if isinstance(body, fx.Node) and not body.users:
        graph.erase_node(body)
        if not any(n.op == "get_attr" and n.target == body.target for n in graph.nodes):
            delattr(gm, body.target)


def _site(node: fx.Node) -> dict:
    return {k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta}


def _region_line(gm: fx.GraphModule, node: fx.Node) -> str:
    """The source line of the region: its own, or that of the first body op that has one."""
    line = source_line(node)
    if line != "?":
        return line
    for arg in node.args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            body = _attribute(gm, arg.target)
            if isinstance(body, fx.GraphModule):
                for inner in body.graph.nodes:
                    if source_line(inner) != "?":
                        return source_line(inner)
    return "?"


def _attribute(module, target: str):
    value = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _adopt(gm: fx.GraphModule, value, name: str) -> str:
    """Hold ``value`` on ``gm`` under a name not yet taken, derived from ``name``."""
    base = name.replace(".", "_")
    fresh, k = base, 0
    while hasattr(gm, fresh):
        k += 1
        fresh = f"{base}_{k}"
    setattr(gm, fresh, value)
    return fresh
