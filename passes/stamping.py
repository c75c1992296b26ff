"""Stamping: a walk decides a written stack's template block once and stamps it on the copies.

:mod:`~autoshard.passes.reuse_blocks` writes blocks ``2 .. N-1`` of a stack as copies of
block 1 (the *template*). Propagation decides each node from what its inputs were given and
from the graph around it, so a copy whose code is the template's and whose inputs arrive as
the template's did is decided exactly as the template: the walk visits the template's code,
records what that wrote (roles, layouts, redistributions, local arguments, notes) and writes
the same for each copy, with the copy's nodes and parameter names in place of the template's.
A deep stack then costs the walk one block's decisions, not one per block.

What makes a copy's decisions the template's is checked, not assumed:

* its code is the template's, node by node (:func:`find_copies`, on the graph as the walk
  finds it, after normalizing and after any norm written out): the same ops, arguments,
  values (shapes, dtypes), numbers of users and walk facts (sites, gradient flow), and its
  parameters are the template's under the copy's names;
* what it reads from outside its code arrives as the template's did (:meth:`Stamper.fits`): the
  same root values, or values that are replicated (so no walk back into the previous block
  starts from them), read alike; and what earlier walks revised in it is what they revised
  in the template;
* the template wrote nothing outside its own code and what it reads (:meth:`Stamper.record`).

A copy that fails a check is visited node by node like the rest of the graph.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable
from typing import Protocol

import torch
import torch.fx as fx

from autoshard.plans.block_owners import BlockOwners


class Key(enum.Enum):
    """How a piece of walk state is keyed, so a template's entry can be moved to a copy."""

    NODE = enum.auto()  # a value
    EDGE = enum.auto()  # (producer, consumer)
    FQN = enum.auto()  # a parameter


@dataclasses.dataclass(frozen=True)
class BlockCode:
    """One block's code as a walk meets it: ``nodes``, contiguous in graph order, from the block's
    first op to its last (its parameter reads at the top of the graph are not in it).
    For a copy, ``outside`` maps each value the template's code reads from outside it to the
    value this copy's code reads in its place."""

    block: str
    nodes: tuple[fx.Node, ...]
    outside: dict[fx.Node, fx.Node] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Copies:
    """The template's code and the copies found to be the same code."""

    template: BlockCode
    copies: tuple[BlockCode, ...]


def find_copies(graph: fx.Graph, template: str, copies: tuple[str, ...], facts: Callable) -> Copies | None:
    """The blocks of ``copies`` whose code is ``template``'s, or None when none is.

    ``facts(node)`` is what the walk knows of a node besides the graph (its site, whether a
    gradient flows through it): equal for a node and its copy, up to names."""
    code = _block_code(graph, (template, *copies))
    if template not in code:
        return None
    model = code[template]
    index = {n: i for i, n in enumerate(model)}
    found = []
    for block in copies:
        nodes = code.get(block)
        if nodes is None or len(nodes) != len(model):
            continue
        outside = _Matcher(model, index, nodes, _renamer(template, block), facts).match()
        if outside is not None:
            found.append(BlockCode(block, tuple(nodes), outside))
    return Copies(BlockCode(template, tuple(model)), tuple(found)) if found else None


def _block_code(graph: fx.Graph, blocks: tuple[str, ...]) -> dict[str, list[fx.Node]]:
    """Each block's code, from its first op to its last, where nothing of another unit is between."""
    owners = BlockOwners(blocks)
    spans: dict[str, list[int]] = {}
    nodes = list(graph.nodes)
    units = []
    for i, node in enumerate(nodes):
        unit = owners.of_path(node.target) if node.op == "get_attr" else owners.of_node(node)
        units.append(unit)
        if unit and node.op == "call_function":
            spans.setdefault(unit, [i, i])[1] = i
    code = {}
    for block, (first, last) in spans.items():
        if all(unit == block for unit in units[first:last + 1]):
            code[block] = nodes[first:last + 1]
    return code


def _renamer(template: str, block: str) -> Callable[[str], str | None]:
    """A template parameter's FQN as the copy's (None for a name outside the template)."""
    prefix = template + "."

    def rename(fqn: str) -> str | None:
        return block + "." + fqn[len(prefix):] if fqn.startswith(prefix) else None

    return rename


class _Matcher:
    """Matches a copy's code against the template's, node by node, collecting ``outside``."""

    def __init__(self, model, index, nodes, rename, facts):
        self.model, self.index, self.nodes, self.rename, self.facts = model, index, nodes, rename, facts
        self.mine = set(nodes)
        self.outside: dict[fx.Node, fx.Node] = {}
        self.compared: dict[tuple[int, int], bool] = {}

    def node(self, a) -> fx.Node | None:
        """The copy's node for the template's ``a`` (in its code, or read from outside it)."""
        i = self.index.get(a)
        return self.nodes[i] if i is not None else self.outside.get(a)

    def match(self) -> dict[fx.Node, fx.Node] | None:
        for t, c in zip(self.model, self.nodes, strict=True):
            if not (self.same_op(t, c) and self.same_arg(t.args, c.args) and self.same_arg(t.kwargs, c.kwargs)
                    and _same_val(t.meta.get("val"), c.meta.get("val")) and self.same_users(t, c)):
                return None
        for t, c in zip(self.model, self.nodes, strict=True):
            if not self.same_fact(self.facts(t), self.facts(c)):
                return None
        if not all(x is y or (self.same_op(x, y) and _same_val(x.meta.get("val"), y.meta.get("val")))
                   for x, y in self.outside.items()):
            return None
        return self.outside

    def same_op(self, t: fx.Node, c: fx.Node) -> bool:
        if t.op != c.op:
            return False
        return self.rename(t.target) == c.target if t.op == "get_attr" else t.target == c.target

    def same_arg(self, a, b) -> bool:
        if isinstance(a, fx.Node):
            if not isinstance(b, fx.Node):
                return False
            i = self.index.get(a)
            if i is not None:
                return self.nodes[i] is b
            return b not in self.mine and self.outside.setdefault(a, b) is b
        if type(a) is not type(b):
            return False
        if isinstance(a, (tuple, list)):
            return len(a) == len(b) and all(map(self.same_arg, a, b))
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(self.same_arg(a[k], b[k]) for k in a)
        if isinstance(a, slice):
            return self.same_arg((a.start, a.stop, a.step), (b.start, b.stop, b.step))
        if isinstance(a, torch.SymInt):
            return a is b
        return a == b

    def same_users(self, t: fx.Node, c: fx.Node) -> bool:
        return len(t.users) == len(c.users) and all(
            self.nodes[self.index[u]] in c.users for u in t.users if u in self.index)

    def same_fact(self, a, b) -> bool:
        """``a`` of the template equals ``b`` of the copy, with nodes and parameter names mapped;
        each pair of dataclasses (a site and its copy's) is compared once."""
        if a is b:
            return True
        if isinstance(a, fx.Node):
            return isinstance(b, fx.Node) and self.node(a) is b
        if type(a) is not type(b):
            return False
        if isinstance(a, (tuple, list)):
            return len(a) == len(b) and all(map(self.same_fact, a, b))
        if isinstance(a, str):
            return a == b or self.rename(a) == b
        fields = _fields(type(a))
        if fields is None:
            return a == b
        pair = (id(a), id(b))
        if pair not in self.compared:
            self.compared[pair] = all(self.same_fact(getattr(a, f), getattr(b, f)) for f in fields)
        return self.compared[pair]


@functools.cache
def _fields(kind: type) -> tuple[str, ...] | None:
    """The field names of a dataclass type, or None for any other type."""
    return tuple(f.name for f in dataclasses.fields(kind)) if dataclasses.is_dataclass(kind) else None


def _same_val(a, b) -> bool:
    """Whether two ``meta["val"]`` describe the same value (a copy shares the template's, or has
    its own of the same shape, dtype, strides and gradient)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and (a.shape, a.dtype, a.stride(), a.requires_grad, a.device, a.layout) == (
            b.shape, b.dtype, b.stride(), b.requires_grad, b.device, b.layout)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_val(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return False
    return type(a) is type(b) and a == b


@dataclasses.dataclass(frozen=True)
class Arrival:
    """What a block's code may read of a value from outside it: its layout as stored and as its
    consumers see it, whether a gradient flows back through it, whether its arguments were made
    local, how many ops read it and whether it is a trainable parameter."""

    layout: object
    seen: object
    carries_grad: bool
    local_args: bool
    readers: int
    trainable: bool

    @property
    def replicated(self) -> bool:
        return self.layout is None and self.seen is None


class Walk(Protocol):
    """What :class:`Stamper` needs of a propagation walk."""

    def visit(self, node: fx.Node) -> None: ...

    def state(self) -> dict[str, dict | set]: ...

    def arrival(self, value: fx.Node) -> Arrival: ...

    def revised_in(self, nodes: tuple[fx.Node, ...], fqns: tuple[str, ...]) -> tuple: ...

    def stamped_value(self, name: str, key, value): ...


@dataclasses.dataclass(frozen=True)
class Stamp:
    """What a walk wrote while visiting the template's code: per piece of state, the entries it
    added or changed (in the order it first wrote them) and the members it added; with what
    the code read from outside (``arrivals``, as they were before the visit) and what earlier
    walks had revised in it (``revised``)."""

    writes: dict[str, tuple[tuple[object, object, bool], ...]]  # (key, value, whether the value holds nodes)
    added: dict[str, tuple[object, ...]]
    arrivals: dict[fx.Node, Arrival]
    revised: tuple


class Stamper:
    """Decides, node by node as a walk meets them, which nodes the walk need not visit: at the
    template's first node it visits the template's code and records its :class:`Stamp`; at a
    copy's first node it stamps the copy when the copy :meth:`fits`, else the walk visits it.

    ``kinds`` says how each piece of the walk's state is keyed; ``stamped`` lists the copies
    stamped."""

    def __init__(self, walk: Walk, copies: Copies, kinds: dict[str, Key]):
        self.walk, self.copies, self.kinds = walk, copies, kinds
        self.index = {n: i for i, n in enumerate(copies.template.nodes)}
        self.starts: dict[fx.Node, BlockCode | None] = {code.nodes[0]: code for code in copies.copies}
        self.starts[copies.template.nodes[0]] = None
        self.outside = tuple(dict.fromkeys(x for code in copies.copies for x in code.outside))
        get_attrs = (*self.outside, *copies.template.nodes)
        self.params = tuple(n.target for n in get_attrs if n.op == "get_attr" and n.target.startswith(
            copies.template.block + "."))
        self.decided: set[fx.Node] = set()
        self.stamp: Stamp | None = None
        self.stamped: list[str] = []

    def handles(self, node: fx.Node) -> bool:
        """Whether ``node`` is decided without the walk visiting it."""
        if node in self.decided:
            return True
        if node not in self.starts:
            return False
        code = self.starts[node]
        if code is None:
            self.record()
            return True
        if self.stamp is None or not self.fits(code):
            return False
        self.apply(code)
        return True

    def record(self) -> None:
        """Visit the template's code and keep what it wrote, unless it wrote to something no copy
        has its own of (a value outside its code that it does not read, a parameter of another
        block)."""
        walk, template = self.walk, self.copies.template
        arrivals = {x: walk.arrival(x) for x in self.outside}
        revised = walk.revised_in(template.nodes, self.params)
        state = walk.state()
        before = {name: (dict(v) if isinstance(v, dict) else set(v)) for name, v in state.items()}
        for node in template.nodes:
            walk.visit(node)
        self.decided.update(template.nodes)
        writes, added = {}, {}
        for name, now in state.items():
            old = before[name]
            if isinstance(now, dict):
                if any(k not in now for k in old):
                    return
                writes[name] = tuple((k, v, _holds_nodes(v)) for k, v in now.items()
                                     if k not in old or _changed(v, old[k]))
                keys = [k for k, _, _ in writes[name]]
            else:
                if old - now:
                    return
                added[name] = keys = tuple(now - old)
            if not all(self.in_template(k, self.kinds[name]) for k in keys):
                return
        self.stamp = Stamp(writes, added, arrivals, revised)

    def in_template(self, key, kind: Key) -> bool:
        if kind is Key.NODE:
            return key in self.index or key in self.outside
        if kind is Key.EDGE:
            return all(self.in_template(k, Key.NODE) for k in key)
        return isinstance(key, str) and key.startswith(self.copies.template.block + ".")

    def fits(self, code: BlockCode) -> bool:
        """Whether ``code`` reads from outside what the template read and was revised by earlier
        walks as the template was. A value it reads that is not the template's own must be
        replicated, so that no decision follows it back into the block before."""
        stamp, walk = self.stamp, self.walk
        rename = _renamer(self.copies.template.block, code.block)
        if walk.revised_in(code.nodes, tuple(rename(f) for f in self.params)) != stamp.revised:
            return False
        for x, y in code.outside.items():
            arrival = stamp.arrivals[x]
            if walk.arrival(y) != arrival or (x is not y and not arrival.replicated):
                return False
        return True

    def apply(self, code: BlockCode) -> None:
        """Write the template's entries for ``code``: keys and node arguments mapped to the copy's."""
        rename = _renamer(self.copies.template.block, code.block)

        def node(n: fx.Node) -> fx.Node:
            i = self.index.get(n)
            return code.nodes[i] if i is not None else code.outside[n]

        def key(k, kind: Key):
            if kind is Key.NODE:
                return node(k)
            if kind is Key.EDGE:
                return node(k[0]), node(k[1])
            return rename(k)

        state = self.walk.state()
        for name, entries in self.stamp.writes.items():
            target, kind = state[name], self.kinds[name]
            for k, value, holds_nodes in entries:
                mapped = key(k, kind)
                value = _map_nodes(value, node) if holds_nodes else value
                target[mapped] = self.walk.stamped_value(name, mapped, value)
        for name, members in self.stamp.added.items():
            state[name].update(key(m, self.kinds[name]) for m in members)
        self.decided.update(code.nodes)
        self.stamped.append(code.block)


def _changed(new, old) -> bool:
    return new is not old and new != old


def _holds_nodes(value) -> bool:
    if isinstance(value, fx.Node):
        return True
    if isinstance(value, (tuple, list)):
        return any(map(_holds_nodes, value))
    if isinstance(value, dict):
        return any(map(_holds_nodes, value.values()))
    return False


def _map_nodes(value, node: Callable[[fx.Node], fx.Node]):
    """``value`` with every node in it (through tuples, lists and dicts) replaced by ``node(n)``;
    containers without nodes are kept as they are."""
    if isinstance(value, fx.Node):
        return node(value)
    if isinstance(value, (tuple, list)):
        mapped = [_map_nodes(v, node) for v in value]
        if all(m is v for m, v in zip(mapped, value, strict=True)):
            return value
        return type(value)(mapped)
    if isinstance(value, dict):
        mapped = {k: _map_nodes(v, node) for k, v in value.items()}
        return value if all(mapped[k] is value[k] for k in value) else type(value)(mapped)
    return value
