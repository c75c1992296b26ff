"""Each FSDP block of a sharded module compiled; FSDP2's hooks stay around it, eager."""

from __future__ import annotations

import torch.fx as fx
from torch._dynamo.backends.registry import lookup_backend

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
    """
    for fqn in sharded.autoshard_plan.units:
        if fqn:
            block = sharded.get_submodule(fqn)
            compiled = _LocalCompiled(block, compiler)
            block.forward = compiled if activation_checkpointing is None else _FirstCallOutside(
                compiled, checkpointed(compiled, activation_checkpointing))


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
        reads = [n for n in block.graph.nodes if n.op == "call_method" and n.target == "to_local"]
        self._param_names = tuple(n.args[0].target for n in reads)
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

    def compile(self, *args) -> None:
        """Compile for these inputs' metadata (the block's first call)."""
        inputs = [*(self._block.get_parameter(name).to_local() for name in self._param_names), *args]
        self._compiled = lookup_backend(self._compiler)(self._local_graph, inputs)

    def __call__(self, *args):
        block = self._block
        inputs = [*(block.get_parameter(name).to_local() for name in self._param_names), *args]
        if self._compiled is None:
            self._compiled = lookup_backend(self._compiler)(self._local_graph, inputs)
        out = self._compiled(*inputs)
        return out[0] if self._single_output else out
