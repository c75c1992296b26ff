"""FSDP2's mixed-precision casts written into a graph dynamo traced, for the compile backend.

Eager ``autoshard()`` captures a model under ``mp_policy`` as FSDP2 runs it: parameters in
``param_dtype``, each FSDP unit's inputs cast by hooks on its module. The compile backend gets
dynamo's graph instead, traced in float32 with no modules to hook, so the same casts are written
into the graph at the block boundaries the nodes' module stacks draw (:func:`cast_as_fsdp_units`).
What the float32 trace fixed and the graph cannot recover, a dtype taken from the input's, is
refused by line.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.core.errors import source_line
from autoshard.plans.block_owners import BlockOwners


def cast_as_fsdp_units(gm: fx.GraphModule, kinds: tuple[str, ...], blocks: tuple[str, ...],
                       policy) -> tuple[fx.Node, ...]:
    """Write into ``gm`` the casts FSDP2's ``MixedPrecisionPolicy`` makes at every FSDP unit, so that
    the replayed graph is captured as it runs: each block's floating inputs (values computed outside
    it) cast to ``param_dtype`` (``cast_forward_inputs``), and with ``output_dtype`` each floating
    value leaving a block, and each of the graph's outputs, cast to it. The graph replays dynamo's
    nodes, never the blocks' ``forward``, so FSDP2's hooks cannot be run on it; the casts take
    each block's module stack, so partitioning keeps them in the block FSDP2 runs them in.
    ``kinds``: per placeholder, "input", "parameter" or "buffer" (the backend's ``GraphInputs``).

    Returns the casts the trace fixed on values made from buffers and constants alone (a rotary table
    built from ``torch.arange`` cast to the input's dtype): left as traced, they are named by
    :func:`refusal_for_casts` if the capture then meets mixed dtypes."""
    placeholders = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), kinds, strict=True))
    ambiguous = _refuse_casts_fixed_at_trace(gm, placeholders, policy.param_dtype)
    owners = BlockOwners(blocks)
    model_tensors = {n for n, kind in placeholders.items() if kind != "input"}

    def floating(node) -> bool:
        value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
        return isinstance(value, torch.Tensor) and value.is_floating_point() and node not in model_tensors

    def cast(value: fx.Node, dtype, stack, cache, before: fx.Node) -> fx.Node:
        if (value, dtype) not in cache:
            with gm.graph.inserting_before(before):
                made = gm.graph.call_method("to", (value, dtype))
            made.meta.update({k: v for k, v in value.meta.items() if k != "nn_module_stack"})
            made.meta["nn_module_stack"] = stack
            made.meta["example_value"] = value.meta["example_value"].to(dtype)
            cache[(value, dtype)] = made
        return cache[(value, dtype)]

    entering: dict = {}
    leaving: dict = {}
    inputs_to = policy.param_dtype if policy.cast_forward_inputs else None
    for node in list(gm.graph.nodes):
        if node.op in ("placeholder", "output"):
            continue
        unit = owners.of_node(node)
        for value in node.all_input_nodes:
            source = owners.of_node(value) if value.op != "placeholder" else ""
            if source == unit or not floating(value):
                continue
            arrives = value
            if policy.output_dtype is not None and source:  # the unit it leaves casts it
                arrives = cast(arrives, policy.output_dtype, value.meta.get("nn_module_stack"), leaving, node)
            if inputs_to is not None and unit:  # the unit it enters casts it
                arrives = cast(arrives, inputs_to, node.meta.get("nn_module_stack"), entering.setdefault(unit, {}),
                               node)
            node.replace_input_with(value, arrives)
    if policy.output_dtype is not None:
        output = gm.graph.output_node()
        output.args = fx.node.map_aggregate(output.args, lambda v: cast(v, policy.output_dtype,
                                                                        v.meta.get("nn_module_stack"), leaving, output)
                                            if floating(v) else v)
    gm.graph.lint()
    gm.recompile()
    return ambiguous


_CASTS = frozenset({"to", "float", "type", "type_as", "double"})


def _refuse_casts_fixed_at_trace(gm: fx.GraphModule, placeholders: dict[fx.Node, str],
                                 compute_dtype: torch.dtype) -> tuple[fx.Node, ...]:
    """Refuse a dtype cast that was a no-op when dynamo traced the model in float32.

    ``h.to(input_dtype)`` (casting back after a float32 norm) and ``h.to(torch.float32)`` (an
    upcast) both trace as ``.to(torch.float32)`` on a float32 value: the graph fixes the dtype, and
    under ``mp_policy`` one of them must run in ``compute_dtype`` as FSDP2 runs the eager code. The
    graph cannot say which, so the backend refuses rather than run it in the wrong dtype. A cast of
    a value made from buffers and constants only is left alone, FSDP2 leaving buffers as they are,
    and returned: whether it was meant to follow the input's dtype shows only if the capture fails."""
    # values the policy computes in compute_dtype: those computed from parameters or inputs
    narrowed: set[fx.Node] = {n for n, kind in placeholders.items() if kind != "buffer"}
    left = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if any(a in narrowed for a in node.all_input_nodes):
            narrowed.add(node)
        if node.op != "call_method" or node.target not in _CASTS:
            continue
        value, made = node.args[0].meta.get("example_value"), node.meta.get("example_value")
        if (isinstance(value, torch.Tensor) and isinstance(made, torch.Tensor) and value.is_floating_point()
                and made.dtype == value.dtype and torch.finfo(made.dtype).bits > torch.finfo(compute_dtype).bits):
            if node.args[0] not in narrowed:
                left.append(node)
                continue
            raise refusal_for_casts((node,), compute_dtype, made.dtype)
    return tuple(left)


def refusal_for_casts(casts: tuple[fx.Node, ...], compute_dtype: torch.dtype,
                      traced_dtype: torch.dtype = torch.float32) -> NotImplementedError:
    """The refusal naming ``casts``, dtype casts dynamo's float32 trace fixed, by line."""
    where = "; ".join(source_line(node) for node in casts)
    return NotImplementedError(
        f"autoshard.backend: mp_policy computes in {compute_dtype}, and dynamo traced this model in "
        f"{traced_dtype}, fixing the dtype of the cast at {where} (a no-op when traced: a cast "
        f"back to the input's dtype and an upcast look the same). Shard eagerly and compile the result, "
        f"torch.compile(autoshard.autoshard(model, mesh, example_inputs=..., mp_policy=...)), which "
        f"captures the model in {compute_dtype} as FSDP2 runs it"
    )
