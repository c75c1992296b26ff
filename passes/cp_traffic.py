"""Cp traffic: the bytes each cp collective of a cut graph moves in one training step.

Counted on the graph the cut wrote (its gathers, all-reduces and causal attentions), once tp has
planned it, for the plan's predicted communication; a collective moves backward only where a
gradient flows.
"""

from __future__ import annotations

import torch.fx as fx

from autoshard.passes.sequence_ops import val_of
from autoshard.runtime.context_ops import CP_ALL_REDUCE, CP_CAUSAL_ATTENTION, CP_GATHER


def cp_traffic(gm: fx.GraphModule, layouts: dict, tp: int) -> tuple[tuple[str, int], ...]:
    """``(kind, bytes)`` of each cp collective one training step runs, forward and backward, for
    :func:`autoshard.plans.predict.predicted_comm`: a gather's bytes are those of the whole tensor it
    makes (its tp shard under tp), its backward reduce-scatters as many; an all-reduce's backward is
    one more where a gradient flows."""
    from autoshard.passes.gradient_flow import carries_grad

    carries = carries_grad(gm)
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is CP_CAUSAL_ATTENTION:
            for local in node.args[1:3]:  # k and v: gathered, and in backward gathered again and reduce-scattered
                value = val_of(local)
                nbytes = value.numel() * value.element_size() * node.args[3]
                if isinstance(layouts.get(node), int):
                    nbytes //= tp
                out.append(("all_gather", nbytes))
                if local in carries:
                    out += [("all_gather", nbytes), ("reduce_scatter", nbytes)]
            continue
        if node.op != "call_function" or node.target not in (CP_GATHER, CP_ALL_REDUCE):
            continue
        value = val_of(node)
        nbytes = value.numel() * value.element_size()
        if isinstance(layouts.get(node), int):
            nbytes //= tp
        forward, backward = ("all_gather", "reduce_scatter") if node.target is CP_GATHER else ("all_reduce",) * 2
        out.append((forward, nbytes))
        if node.args[0] in carries:
            out.append((backward, nbytes))
    return tuple(out)
