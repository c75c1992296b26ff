"""Transpose: rewrite every linear site onto its stored weight.

The materialized weights are stored so that tp always shards dim 1 (see
:mod:`passes.placements`), hence:

* colwise   ``y = x @ W_t  (+ b)``      with ``W_t [in, out]`` (``aten.matmul``)
* rowwise   ``y = reduce_partial(x @ W.T) (+ b)`` with ``W [out, in]``
  (``aten.linear``); the bias is added once, after the all-reduce. Without a
  bias the product stays partial here and is reduced where it is read whole
* vocab_parallel (a tied LM head ``[vocab, dim]``): ``linear(x, W)`` on this
  rank's vocabulary rows, colwise over the vocabulary; its embedding use
  becomes a lookup masked to those rows, closed by ``reduce_partial``
* replicate the op is left as the user wrote it.

A site's ``node`` keeps its identity as the site's full output, so edges
recorded by earlier passes stay valid; new nodes are inserted before it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autoshard.core.errors import describe
from autoshard.core.sharding import Role
from autoshard.passes.discover import EmbeddingSite, LinearSite, Sites
from autoshard.passes.layout_plan import COLWISE, ROWWISE, VOCAB_PARALLEL, LayoutPlan, RowwiseExit
from autoshard.passes.partition import made_like
from autoshard.runtime import collectives
from autoshard.runtime.whole_sections import MATMUL_INPUT_GRAD_SCALED

aten = torch.ops.aten


def rewrite_linears(
    gm: fx.GraphModule,
    sites: Sites,
    layout_plan: LayoutPlan,
    tp_group: str | None,
    tp: int = 1,
    reduce_dtype: torch.dtype | None = None,
) -> None:
    """Each rowwise output leaves as ``layout_plan.rowwise_exit`` says: all-reduced,
    reduce-scattered over the sequence (sequence parallelism), or a partial sum reduced where a
    consumer needs the total (the ``reduce`` edges of :mod:`autoshard.passes.redistribute`, so two of them
    may share one all-reduce). ``reduce_dtype``: the dtype every sum of partial values is
    taken in (mixed precision)."""
    roles = layout_plan.roles
    for site in sites.linears:
        role = roles[site.weight_fqn]
        if role in (COLWISE, ROWWISE, VOCAB_PARALLEL):
            exit_ = layout_plan.rowwise_exit(site)
            group = None if exit_ is RowwiseExit.PARTIAL else tp_group
            _rewrite(gm.graph, site, role, group, exit_ is RowwiseExit.REDUCE_SCATTER, reduce_dtype,
                     layout_plan.fused, tp)
    if tp_group is not None:
        for site in sites.embeddings:
            if roles[site.weight_fqn] == VOCAB_PARALLEL:
                _rewrite_vocab_parallel_lookup(gm.graph, site, tp_group, site.num_embeddings // tp, reduce_dtype)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()


def _rewrite(
    graph: fx.Graph, site: LinearSite, role: Role, tp_group: str | None, scatter: bool = False, reduce_dtype=None,
    fused_by_site: dict | None = None, tp: int = 1,
) -> None:
    sums = (reduce_dtype,) if reduce_dtype is not None else ()
    fused_by_site = fused_by_site or {}
    node = site.node
    x = _current_input(site)
    folded_bias = site.output is not node  # bias added by a separate `add` the site owns
    bias = site.bias_node if site.bias_node is not None and not folded_bias else None
    with graph.inserting_before(node):
        weight = site.weight_node
        if site.weight_cast is not None:  # the user's cast, on the stored weight
            cast = site.weight_cast
            weight = graph.call_function(cast.target, (weight, *cast.args[1:]), dict(cast.kwargs))
            _inherit(weight, cast, f"{cast.name}_stored")
        fused = fused_by_site.get(site.weight_fqn) if role == COLWISE else None
        if fused is not None and fused.whole and tp > 1:
            product = _whole_sections_product(graph, node, x, weight, fused, tp)
        elif role == COLWISE:
            product = graph.call_function(aten.matmul.default, (x, weight))
        else:  # rowwise [out, in], or the tied head [vocab, dim] cut over its vocabulary rows
            product = graph.call_function(aten.linear.default, (x, weight))
        _inherit(product, node, f"{node.name}_local")
        if role == ROWWISE and tp_group is not None:
            if scatter:
                reduced = graph.call_function(collectives.REDUCE_SCATTER_PARTIAL, (product, 1, tp_group, *sums))
                if bias is not None:  # added on this rank's rows only: its gradient is partial
                    bias = graph.call_function(collectives.ENTER_TP, (bias, tp_group, *sums))
                    _inherit(bias, node, f"{site.bias_node.name}_enter_tp")
            else:
                reduced = graph.call_function(collectives.REDUCE_PARTIAL, (product, tp_group, *sums))
            _inherit(reduced, node, f"{node.name}_reduced")
            product = reduced
    if bias is not None:
        node.target, node.args, node.kwargs = aten.add.Tensor, (product, bias), {}
    else:
        node.replace_all_uses_with(product)
        graph.erase_node(node)


def _whole_sections_product(graph: fx.Graph, node: fx.Node, x: fx.Node, weight: fx.Node, fused, tp: int) -> fx.Node:
    """A colwise product whose fused sections are partly whole on every rank (k/v heads fewer than tp).

    The stored local weight holds, section by section, this rank's share of a cut section or all of
    a whole one (:class:`~autoshard.plans.plan.FusedSections`). Each run of alike sections is one matmul,
    and the runs are put back side by side. ``x`` enters tp (its gradient is summed over the ranks),
    which is right for the cut sections' partial input-gradient; a whole section's is whole on every
    rank, so it enters that sum as ``1 / tp`` of itself (``matmul_input_grad_scaled``)."""
    local = fused.local_sizes(tp)
    runs, start = [], 0
    for i, size in enumerate(local):
        whole = i in fused.whole
        if runs and runs[-1][0] == whole:
            runs[-1] = (whole, runs[-1][1], start + size)
        else:
            runs.append((whole, start, start + size))
        start += size
    parts = []
    for whole, begin, end in runs:
        columns = graph.call_function(aten.slice.Tensor, (weight, -1, begin, end))
        _inherit(columns, node, f"{node.name}_{'whole' if whole else 'cut'}_columns")
        if whole:
            part = graph.call_function(MATMUL_INPUT_GRAD_SCALED, (x, columns, 1.0 / tp))
        else:
            part = graph.call_function(aten.matmul.default, (x, columns))
        _inherit(part, node, f"{node.name}_{'whole' if whole else 'cut'}")
        parts.append(part)
    if len(parts) == 1:
        return parts[0]
    product = graph.call_function(aten.cat.default, (parts, -1))
    _inherit(product, node, f"{node.name}_sections")
    return product


def _rewrite_vocab_parallel_lookup(
    graph: fx.Graph, site: EmbeddingSite, tp_group: str, rows: int, reduce_dtype=None
) -> None:
    """``embedding(W, ids)`` on this rank's vocabulary rows: masked, then all-reduced.

    A ``padding_idx`` names a global row, and the lookup now reads local rows (every
    rank's row 0 is some other token): the local lookup takes none, and the padding
    tokens' rows are detached instead, so their gradient stays zero exactly as the
    model's own embedding keeps it, on every rank, whatever the ids."""
    node = site.node
    ids = node.args[1]
    padding_idx = _padding_idx(node)
    if len(node.args) > 3 and node.args[3]:
        raise NotImplementedError(
            f"autoshard: {describe(node)} scales gradients by token frequency (scale_grad_by_freq=True), "
            f"which a vocabulary cut over tp cannot count locally; untie the embedding or turn it off"
        )
    with graph.inserting_before(node):
        shard_ids = graph.call_function(collectives.VOCAB_SHARD_IDS, (ids, rows, tp_group))
        _inherit(shard_ids, node, f"{node.name}_shard_ids")
        local_ids = graph.call_function(operator.getitem, (shard_ids, 0))
        _inherit(local_ids, node, f"{node.name}_local_ids")
        in_shard = graph.call_function(operator.getitem, (shard_ids, 1))
        _inherit(in_shard, node, f"{node.name}_in_shard")
    node.args = (node.args[0], local_ids, *node.args[2:])
    if padding_idx is not None:
        node.args = (node.args[0], local_ids, -1, *node.args[3:])
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "padding_idx"}
    last = node
    with graph.inserting_before(node.next):  # in creation order, right after the lookup
        if padding_idx is not None:
            is_pad = graph.call_function(aten.eq.Scalar, (ids, padding_idx))
            _inherit(is_pad, node, f"{node.name}_is_padding")
            is_pad_rows = graph.call_function(aten.unsqueeze.default, (is_pad, -1))
            _inherit(is_pad_rows, node, f"{node.name}_padding_rows")
            detached = graph.call_function(aten.detach.default, (node,))
            _inherit(detached, node, f"{node.name}_detached")
            last = graph.call_function(aten.where.self, (is_pad_rows, detached, node))
            _inherit(last, node, f"{node.name}_no_padding_grad")
        masked = graph.call_function(aten.mul.Tensor, (last, in_shard))
        _inherit(masked, node, f"{node.name}_masked")
        sums = (reduce_dtype,) if reduce_dtype is not None else ()
        reduced = graph.call_function(collectives.REDUCE_PARTIAL, (masked, tp_group, *sums))
        _inherit(reduced, node, f"{node.name}_reduced")
    inside = {masked, last} | ({last.args[1]} if last is not node else set())
    node.replace_all_uses_with(reduced, delete_user_cb=lambda user: user not in inside)


def _padding_idx(node: fx.Node) -> int | None:
    """The global padding row of an ``aten.embedding`` node, or None."""
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
    return value if isinstance(value, int) and value >= 0 else None


def _current_input(site: LinearSite) -> fx.Node:
    """The site's input as it reads now: possibly a redistribute inserted by `layouts`."""
    node = site.node
    if node.target == aten.addmm.default:
        return node.args[1]
    return node.args[0]


def _inherit(new: fx.Node, old: fx.Node, name: str) -> None:
    new._rename(name)
    made_like(new, old)
