"""Each FSDP block of a sharded module compiled; FSDP2's hooks stay around it, eager."""

from __future__ import annotations

import torch.fx as fx
from torch._dynamo.backends.registry import lookup_backend

from autoshard.runtime import token_dispatch
from autoshard.runtime.activation_checkpointing import checkpointed


def compile_blocks(sharded: fx.GraphModule, compiler: str, activation_checkpointing: str | None = None) -> None:
    """Compile each FSDP block's computation; FSDP2's hooks stay around it, eager.

    The compiled function sees plain tensors only: each parameter's
    ``to_local()`` runs eagerly before it (dynamo cannot trace DTensor's
    ``to_local`` backward), and its local tensors are passed in as inputs.
    With ``activation_checkpointing`` ("full" or "selective", as
    :mod:`autoshard.runtime.activation_checkpointing` runs eager blocks) the
    compiled function runs under ``torch.utils.checkpoint``: compiled once, at
    the first call and outside it, then recomputed in backward (the selective
    policy keeps the outputs of the matmuls and collectives it runs).

    A block whose experts exchange their rows over ep (:mod:`autoshard.runtime.token_dispatch`) runs
    eagerly: how many rows each rank receives is data, which the compilers' fake tensors have no size
    for, and the experts' own FSDP unit inside it needs its hooks around its call.
    """
    for fqn in sharded.autoshard_plan.units:
        block = sharded.get_submodule(fqn) if fqn else None
        if block is None or exchanges_rows(block):
            continue
        compiled = _LocalCompiled(block, compiler)
        block.forward = compiled if activation_checkpointing is None else _FirstCallOutside(
            compiled, checkpointed(compiled, activation_checkpointing))


def exchanges_rows(block: fx.GraphModule) -> bool:
    """Whether ``block``'s code sends rows to their experts' ranks (an ep dispatch)."""
    return any(n.target is token_dispatch.EP_DISPATCH for n in block.graph.nodes)


class _FirstCallOutside:
    """``wrapped`` from the second call on; the first call runs ``compiled`` itself, so that the
    compiler traces outside checkpointing's modes (and its first forward is an ordinary one)."""

    def __init__(self, compiled: "_LocalCompiled", wrapped):
        self.compiled, self.wrapped = compiled, wrapped

    def __call__(self, *args):
        if self.compiled.ready:
            return self.wrapped(*args)
        self.compiled.compile(*args)
        return self.wrapped(*args)


class _LocalCompiled:
    """``block.forward`` as a compiled function of (local parameter tensors, inputs).

    The compiler is called directly on the block's ATen graph, at the first
    call with that call's tensors as examples: nested ``torch.compile`` is
    inert while dynamo runs a compiled graph, and a direct call also skips a
    second bytecode trace.
    """

    def __init__(self, block: fx.GraphModule, compiler: str):
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        params = dict(block.named_parameters())
        # every parameter read is an input: a DTensor's local tensor (its ``to_local``), and a plain one
        # read as it is at the call (FSDP2 swaps the module's parameter between its shard and the
        # gathered tensor, so a reference kept now would be the shard)
        reads = [n for n in block.graph.nodes if n.op == "call_method" and n.target == "to_local"]
        reads += [n for n in block.graph.nodes if n.op == "get_attr" and n.target in params
                  and not all(u.op == "call_method" and u.target == "to_local" for u in n.users)]
        # (parameter name, whether its local tensor is read) per input
        self._reads = tuple((n.args[0].target, True) if n.op == "call_method" else (n.target, False) for n in reads)
        for node in reads:
            env[node] = graph.placeholder(node.name)
        for node in block.graph.nodes:
            if node in env or (node.op == "get_attr" and all(u in env for u in node.users)):
                continue
            env[node] = graph.node_copy(node, lambda n: env[n])
        (output,) = [n for n in graph.nodes if n.op == "output"]
        self._single_output = not isinstance(output.args[0], (tuple, list))
        if self._single_output:  # compilers take graphs returning tuples
            output.args = ((output.args[0],),)
        self._block = block
        self._local_graph = fx.GraphModule(block, graph)
        self._compiler = compiler
        self._compiled = None

    @property
    def ready(self) -> bool:
        return self._compiled is not None

    def _params(self) -> list:
        block = self._block
        return [block.get_parameter(name).to_local() if local else block.get_parameter(name)
                for name, local in self._reads]

    def compile(self, *args) -> None:
        """Compile for these inputs' metadata (the block's first call)."""
        self._compiled = lookup_backend(self._compiler)(self._local_graph, [*self._params(), *args])

    def __call__(self, *args):
        inputs = [*self._params(), *args]
        if self._compiled is None:
            self._compiled = lookup_backend(self._compiler)(self._local_graph, inputs)
        out = self._compiled(*inputs)
        return out[0] if self._single_output else out
