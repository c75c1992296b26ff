"""Transpose: rewrite every linear site onto its stored weight.

The materialized weights are stored so that tp always shards dim 1 (see
:mod:`passes.placements`), hence:

* colwise   ``y = x @ W_t  (+ b)``      with ``W_t [in, out]`` (``aten.matmul``)
* rowwise   ``y = reduce_partial(x @ W.T) (+ b)`` with ``W [out, in]``
  (``aten.linear``); the bias is added once, after the all-reduce
* replicate the op is left as the user wrote it.

A site's ``node`` keeps its identity as the site's full output, so edges
recorded by earlier passes stay valid; new nodes are inserted before it.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from autoshard.passes.discover import LinearSite, Sites
from autoshard.passes.propagate import COLWISE, ROWWISE

from autoshard import collectives

aten = torch.ops.aten


def rewrite_linears(gm: fx.GraphModule, sites: Sites, roles: dict[str, str], tp_group: str | None) -> None:
    for site in sites.linears:
        role = roles[site.weight_fqn]
        if role in (COLWISE, ROWWISE):
            _rewrite(gm.graph, site, role, tp_group)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()


def _rewrite(graph: fx.Graph, site: LinearSite, role: str, tp_group: str | None) -> None:
    node = site.node
    x = _current_input(site)
    folded_bias = site.output is not node  # bias added by a separate `add` the site owns
    bias = site.bias_node if site.bias_node is not None and not folded_bias else None
    with graph.inserting_before(node):
        if role == COLWISE:
            product = graph.call_function(aten.matmul.default, (x, site.weight_node))
        else:
            product = graph.call_function(aten.linear.default, (x, site.weight_node))
        _inherit(product, node, f"{node.name}_local")
        if role == ROWWISE and tp_group is not None:
            reduced = graph.call_function(collectives.REDUCE_PARTIAL, (product, tp_group))
            _inherit(reduced, node, f"{node.name}_reduced")
            product = reduced
    if bias is not None:
        node.target, node.args, node.kwargs = aten.add.Tensor, (product, bias), {}
    else:
        node.replace_all_uses_with(product)
        graph.erase_node(node)


def _current_input(site: LinearSite) -> fx.Node:
    """The site's input as it reads now: possibly a redistribute inserted by `layouts`."""
    node = site.node
    if node.target == aten.addmm.default:
        return node.args[1]
    return node.args[0]


def _inherit(new: fx.Node, old: fx.Node, name: str) -> None:
    new._rename(name)
    new.meta.update({k: old.meta[k] for k in ("nn_module_stack", "stack_trace") if k in old.meta})
