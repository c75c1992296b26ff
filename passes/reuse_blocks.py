"""Trace a stack of identical blocks once: export two, write the others from the second.

``torch.export`` spends nearly all of a large model's planning time tracing
the same block again and again (a 32-block Llama: ~90%). When the blocks are
children ``0 .. N-1`` of one ``nn.ModuleList`` and every block from the third
on has the second block's structure (class, parameter and buffer names,
shapes, dtypes, and every plain attribute of every submodule), only a twin
holding the first two blocks is exported. Block ``k`` is then the second
block's nodes copied with its parameters read under ``…k…`` and its
inputs taken from block ``k-1`` where the second block takes them from the
first. Nodes are renamed as export names them (each op's name, then ``_1``,
``_2``, ... in graph order), so the graph, and every stage after it, is what
tracing all ``N`` blocks gives; the tests check the emitted code is identical.

Anything this does not recognize (a forward that does per-block work outside
the blocks, blocks that differ, the two traced blocks' code differing) returns
``None`` with the reason, and the caller traces in full. One assumption: an
int attribute holding a block's own position (Hugging Face's ``layer_idx``)
changes nothing in the graph beyond what blocks 0 and 1 already show; a model
whose forward treats, say, its last block specially by that index is traced
in full with ``trace_blocks_once=False``.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.fx as fx
import torch.nn as nn

from autoshard.plans.block_owners import owner_block

_HOOK_DICTS = re.compile(r"^_(forward|backward|state_dict|load_state_dict)\w*(hooks|hooks_\w+)$")


@dataclasses.dataclass(frozen=True)
class Stack:
    """``container.0 .. container.{count-1}`` are the blocks; ``0`` and ``1`` are traced."""

    container: str
    count: int

    def block(self, k: int) -> str:
        return f"{self.container}.{k}"


def find_stack(model: nn.Module, blocks: tuple[str, ...]) -> tuple[Stack | None, str]:
    """The stack whose blocks past the first two can be written instead of traced, or why not
    (``""`` when the blocks are not an ``nn.ModuleList`` stack at all)."""
    if len(blocks) < 3:
        return None, ""
    container = blocks[0].rpartition(".")[0]
    expected = tuple(f"{container}.{k}" if container else str(k) for k in range(len(blocks)))
    if not container or blocks != expected:
        return None, ""  # not one stack: nothing to reuse, nothing to report
    module = model.get_submodule(container)
    if type(module) is not nn.ModuleList or len(module) != len(blocks):
        return None, ""
    second = module[1]
    for k in range(2, len(module)):
        why = _difference(second, module[k], k)
        if why:
            return None, f"block '{container}.{k}' differs from '{container}.1': {why}"
    return Stack(container, len(blocks)), ""


def _difference(a: nn.Module, b: nn.Module, k: int, path: str = "") -> str:
    """How block ``k`` (``b``) differs from block 1 (``a``), or ``""``. An int attribute that is
    1 in block 1 and ``k`` in block ``k`` is the block's own position (Hugging Face's
    ``layer_idx``, used to index a KV cache), not a difference."""
    if type(a) is not type(b):
        return f"{path or 'the block'} is {type(b).__name__}, not {type(a).__name__}"
    if list(a._modules) != list(b._modules):
        return f"{path or 'the block'} has children {list(b._modules)}, not {list(a._modules)}"
    for kind in ("_parameters", "_buffers"):
        left, right = getattr(a, kind), getattr(b, kind)
        if list(left) != list(right):
            return f"{path or 'the block'} has {kind[1:]} {list(right)}, not {list(left)}"
        for name, x in left.items():
            y = right[name]
            if (x is None) != (y is None) or (x is not None and (
                    x.shape != y.shape or x.dtype != y.dtype or x.requires_grad != y.requires_grad)):
                return f"'{path + name}' is {_spec(y)}, not {_spec(x)}"
    for name, value in vars(a).items():
        if name in ("_parameters", "_buffers", "_modules") or _HOOK_DICTS.match(name):
            continue
        if isinstance(value, torch.Tensor) or name not in vars(b):
            continue
        other = vars(b)[name]
        if type(value) is int and type(other) is int and (value, other) == (1, k):
            continue
        try:
            same = bool(value == other) if not callable(value) else value is other
        except Exception:  # noqa: BLE001  (an attribute that cannot be compared is a difference)
            same = False
        if not same:
            return f"attribute '{path + name}' is {other!r}, not {value!r}"
    for name, child in a._modules.items():
        if child is not None:
            why = _difference(child, b._modules[name], k, f"{path}{name}.")
            if why:
                return why
    return ""


def _spec(t) -> str:
    return "None" if t is None else f"{tuple(t.shape)} {t.dtype}"


def with_two_blocks(twin: nn.Module, stack: Stack) -> nn.Module:
    """``twin`` (a twin made for this: its dicts are its own) holding only blocks 0 and 1."""
    container = twin.get_submodule(stack.container)
    container._modules = {k: v for k, v in container._modules.items() if k in ("0", "1")}
    return twin


def _unit(node: fx.Node, stack: Stack) -> int | None:
    """Which traced block (0 or 1) computes ``node``, or None for the rest (export's guard call
    included, whatever module stack it carries)."""
    if node.op in ("placeholder", "output", "call_module"):
        return None
    if node.op == "get_attr":
        paths = [node.target]
    else:
        paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
    for k in (0, 1):
        if any(owner_block(p, (stack.block(k),)) for p in paths):
            return k
    return None


def _runs(nodes: list[fx.Node], units: dict[fx.Node, int | None], k: int) -> list[list[fx.Node]]:
    runs, current = [], []
    for node in nodes:
        if units[node] == k:
            current.append(node)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def _same_op(a: fx.Node, b: fx.Node, stack: Stack) -> bool:
    if a.op != b.op:
        return False
    if a.op == "get_attr":
        return a.target.replace(stack.block(0), stack.block(1), 1) == b.target
    return a.target == b.target


def synthesize(graph: fx.Graph, stack: Stack) -> tuple[fx.Graph | None, str]:
    """The graph of all ``stack.count`` blocks from the two-block ``graph``, or ``(None, why)``."""
    nodes = list(graph.nodes)
    units = {n: _unit(n, stack) for n in nodes}
    first = [n for n in nodes if units[n] == 0]
    second = [n for n in nodes if units[n] == 1]
    if len(first) != len(second) or not all(_same_op(a, b, stack) for a, b in zip(first, second, strict=True)):
        return None, "the two traced blocks are not the same code"
    runs0, runs1 = _runs(nodes, units, 0), _runs(nodes, units, 1)
    if [len(r) for r in runs0] != [len(r) for r in runs1]:
        return None, "the two traced blocks interleave differently with the rest of the forward"
    compute = [r for r in runs1 if r[0].op != "get_attr"]
    if len(compute) != 1 or any(n.op == "get_attr" for n in compute[0]):
        return None, "the second block's code is not one contiguous piece"
    between = _between(nodes, units)
    if between:
        return None, f"the forward runs '{between.name}' between the blocks (per-block code outside them)"
    counterpart = dict(zip(first, second, strict=True))  # block 0's node -> block 1's
    strides, why = _name_strides(counterpart)
    if why:
        return None, why
    if any(n.op == "get_attr" and n.name != n.target.replace(".", "_") for n in second):
        return None, "the second block's parameters are not named after their FQNs"

    writer = _Writer(fx.Graph())
    writer.graph._codegen = graph._codegen  # export's pytree calling convention
    env: dict[fx.Node, fx.Node] = {}  # every original node -> its node in the new graph
    copies: list[dict[fx.Node, fx.Node]] = [{} for _ in range(stack.count)]  # block k: block-1 node -> copy
    last_run_end = {run[-1]: run for run in runs1}

    def lookup_after_blocks(node: fx.Node) -> fx.Node:
        """Root code after the stack reads the last block where it read block 1."""
        if units.get(node) == 1 and copies[stack.count - 1]:
            return copies[stack.count - 1][node]
        return env[node]

    after_stack = False
    for node in nodes:
        name = _Numbering.of(node.name, strides).shifted(stack.count - 2) if after_stack else node.name
        env[node] = writer.copy(node, lookup_after_blocks if units[node] is None else env.__getitem__, name)
        if node in last_run_end:
            run = last_run_end[node]
            numbering = [_Numbering.of(n.name, strides) for n in run]
            for k in range(2, stack.count):
                _copy_run(writer, run, k, stack, env, copies, counterpart, numbering)
            after_stack = after_stack or run[0].op != "get_attr"
    writer.graph.lint()
    if writer.collided:
        return None, "the written blocks' node names would collide"
    return writer.graph, ""


@dataclasses.dataclass
class _Writer:
    """Appends copies of nodes to ``graph``, each under the name export would give it.

    Every node is created once, under its final name (a graph never frees a name, so renaming
    in place could not give a node a name another node had held). ``collided``: some name was
    already taken, so the graph is not the one tracing every block gives.
    """

    graph: fx.Graph
    collided: bool = False

    def copy(self, node: fx.Node, arg, name: str, module_stack: dict | None = None) -> fx.Node:
        """``node`` with its inputs mapped by ``arg``, named ``name``, with its meta (and
        ``module_stack`` as its ``nn_module_stack``, when given).

        The arguments are set on the node made: they are export's, and ``create_node`` would
        walk each one again for a symbolic int it warns about (a third of writing a node)."""
        copied = self.graph.create_node(node.op, node.target, name=name, type_expr=node.type)
        if node.args:
            copied.args = fx.map_arg(node.args, arg)
        if node.kwargs:
            copied.kwargs = fx.map_arg(node.kwargs, arg)
        copied.meta.update(node.meta)  # in place: setting an attribute of a node re-files it in its graph
        if module_stack is not None:
            copied.meta["nn_module_stack"] = module_stack
        self.collided = self.collided or copied.name != name
        return copied


def _split_name(name: str) -> tuple[str, int]:
    match = re.fullmatch(r"(.*)_(\d+)", name)
    return (match[1], int(match[2])) if match else (name, 0)


def _name_strides(counterpart: dict[fx.Node, fx.Node]) -> tuple[dict[str, int], str]:
    """Per op name, how far export's numbering advances from one block to the next (block 1's
    number minus block 0's, the same for every node of that name, nodes export dropped
    included), or why the two blocks are not numbered alike."""
    strides: dict[str, int] = {}
    for a, b in counterpart.items():
        if a.op == "get_attr":
            continue
        (base_a, num_a), (base_b, num_b) = _split_name(a.name), _split_name(b.name)
        if base_a != base_b or strides.setdefault(base_a, num_b - num_a) != num_b - num_a:
            return {}, f"nodes '{a.name}' and '{b.name}' are not numbered like the rest of their blocks"
    return strides, ""


@dataclasses.dataclass(frozen=True)
class _Numbering:
    """A node's name as export would number it with more blocks traced before it: export numbers
    each op's nodes in graph order, so every block traced earlier adds that op's ``stride``."""

    name: str
    base: str
    number: int
    stride: int

    @classmethod
    def of(cls, name: str, strides: dict[str, int]) -> _Numbering:
        base, number = _split_name(name)
        return cls(name, base, number, strides.get(base, 0))

    def shifted(self, blocks: int) -> str:
        """The name had ``blocks`` more blocks been traced before this node."""
        if not self.stride or blocks <= 0:
            return self.name
        number = self.number + blocks * self.stride
        return self.base if number == 0 else f"{self.base}_{number}"


def _between(nodes, units) -> fx.Node | None:
    """A root call between block 0's and block 1's code: per-iteration work the copies would miss."""
    compute = [i for i, n in enumerate(nodes) if units[n] is not None and n.op != "get_attr"]
    in_first = [i for i in compute if units[nodes[i]] == 0]
    in_second = [i for i in compute if units[nodes[i]] == 1]
    if not in_first or not in_second:
        return None
    last0, first1 = max(in_first), min(in_second)
    return next((nodes[i] for i in range(last0 + 1, first1) if nodes[i].op == "call_function"), None)


def _copy_run(writer: _Writer, run, k: int, stack: Stack, env, copies, counterpart, numbering) -> None:
    """Append block ``k``'s copy of block 1's ``run``: parameters read under block ``k``'s FQNs
    and named after them, every other node numbered as if ``k - 1`` blocks came before block 1
    (``numbering``: of each node of the run)."""
    previous = copies[k - 1] if k > 2 else env  # block k-1's node for each block-1 node
    mine = copies[k]

    def arg(node: fx.Node) -> fx.Node:
        if node in mine:
            return mine[node]
        if node in counterpart:  # block 1 reads block 0 here: block k reads block k-1
            return previous[counterpart[node]]
        return env[node]

    for node, name in zip(run, numbering, strict=True):
        module_stack = _module_stack_for_block(node.meta.get("nn_module_stack"), stack.block(1), stack.block(k))
        if node.op == "get_attr":
            target = node.target.replace(stack.block(1), stack.block(k), 1)
            copied = writer.copy(node, arg, target.replace(".", "_"), module_stack)
            copied.target = target
        else:
            copied = writer.copy(node, arg, name.shifted(k - 1), module_stack)
        mine[node] = copied


def _module_stack_for_block(stack: dict | None, old: str, new: str) -> dict | None:
    """A node's ``nn_module_stack`` with block ``old``'s modules as block ``new``'s (None without one)."""
    if not stack:
        return None
    moved = {}
    for key, (path, kind) in stack.items():
        if path == old or path.startswith(old + "."):
            path = new + path[len(old):]
            key = key.replace(old, new, 1)
        moved[key] = (path, kind)
    return moved
