"""Normalize: the graph rewrites made before propagation, so that it plans the graph as it runs.

* **Buffers filled by slices are concatenations.** ``k = x.new_empty(...)``, then
  ``k[..., :a].copy_(p)`` and ``k[..., a:].copy_(r)`` (DeepSeek's ``expand_kv``) is
  ``cat([p, r], -1)``: one functional op with a layout rule, where an empty buffer in the
  shape of a cut value has none.
* **A dense convolution's bias apart.** ``conv(x, w, b)`` with ``groups=1`` is
  ``conv(x, w) + b`` over the channel dim, so that cut rowwise over its input channels the
  bias is added once, after the partial sums are reduced.
* **No global size for ``repeat_interleave``.** Its ``output_size`` hint is dropped, so that
  the op cut over the repeated dim needs no local one.
* **Scatters into zeros by constant indices are concatenations.** ``zeros.index_copy_(dim, idx,
  src)`` with a constant ``idx`` (litgpt's LoRA ``zero_pad``) is the ``cat`` of ``src``'s slices and
  zeros for the columns it skips.
* **Partial sums first.** ``x + attn(h) + mlp(h)`` is ``(x + a) + m`` in the graph; a chain
  of adds is regrouped so that the outputs of linears are summed first, ``x + (a + m)``:
  two rowwise outputs then add as partial sums and are all-reduced once (a parallel block). Their
  biases were added apart before discover (:func:`weights_on_the_right`), so they are added after
  the partial sums (GPT-NeoX's biased ``mlp + attn + x``).
* **Fused sections** (:func:`~autoshard.passes.sections.split_fused_outputs`): a fused q|k|v
  output with a section whose heads do not divide by tp becomes one ``fused_split``, whose
  layout rule keeps that section whole on every rank and cuts the others.
* **Grouped-query attention on tp** (:func:`~autoshard.passes.decompose.expand_gqa_for_tp`):
  where q's heads divide by tp and k/v's do not, k and v are repeated per q head so that
  tp cuts them like q.

The one rewrite left to propagation is a norm over a width it shards, which depends on
the layouts it finds (see :func:`~autoshard.passes.propagate.propagate`).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from autoshard.passes.decompose import expand_gqa_for_tp
from autoshard.passes.discover import Sites
from autoshard.passes.layout_rules import Convolution
from autoshard.passes.partition import made_like, made_node
from autoshard.passes.sections import constant_tensor, split_fused_outputs
from autoshard.plans.block_owners import BlockOwners


def normalize(gm: fx.GraphModule, sites: Sites, tp: int) -> None:
    """Rewrite ``gm`` in place (see the module docstring); ``sites`` are unchanged."""
    _filled_buffers_as_cat(gm.graph)
    _index_copied_zeros_as_cat(gm)
    _sum_partials_first(gm, sites)
    if tp > 1:
        _convolution_bias_apart(gm.graph)
        _repeat_interleave_without_output_size(gm.graph)
        split_fused_outputs(gm, sites, tp)
        expand_gqa_for_tp(gm.graph, tp)


def weights_on_the_right(gm: fx.GraphModule, param_shapes: dict[str, tuple[int, ...]]) -> list[fx.Node]:
    """``W @ x`` with ``W`` a 2-D parameter on the left (Mamba's ``dt_proj.weight @ dt.transpose(1,
    2)``) is ``(x.mT @ W.T).mT``: rewritten as that linear between two transposes, so that it is a
    linear site like any other (discover runs after this). Returns the new linears.

    Also, before discover, two linears' biases are added apart: a bias computed rather than a
    parameter (:func:`_computed_bias_apart`), and the bias of a linear summed with other linears
    (:func:`_summed_biases_apart`)."""
    _computed_bias_apart(gm.graph, param_shapes)
    _summed_biases_apart(gm.graph, param_shapes)
    graph = gm.graph
    rewritten = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.matmul.default:
            continue
        weight, x = node.args[:2]
        if not (isinstance(weight, fx.Node) and weight.op == "get_attr" and len(param_shapes.get(weight.target, ()))
                == 2 and isinstance(x, fx.Node) and x.meta["val"].dim() >= 2):
            continue
        with graph.inserting_before(node):
            if x.target == torch.ops.aten.transpose.int and sorted(d % x.meta["val"].dim() for d in x.args[1:3]) == [
                    x.meta["val"].dim() - 2, x.meta["val"].dim() - 1]:
                rows = x.args[0]  # already the transpose of what the linear reads
            else:
                rows = graph.call_function(torch.ops.aten.transpose.int, (x, -1, -2))
                made_like(rows, node)
                rows.meta["val"] = x.meta["val"].transpose(-1, -2)
            linear = graph.call_function(torch.ops.aten.linear.default, (rows, weight))
            made_like(linear, node)
            linear.meta["val"] = node.meta["val"].transpose(-1, -2)
            back = graph.call_function(torch.ops.aten.transpose.int, (linear, -1, -2))
            made_like(back, node, also=("val",))
        node.replace_all_uses_with(back)
        graph.erase_node(node)
        rewritten.append(linear)
    if rewritten:
        graph.eliminate_dead_code()
    return rewritten


_PURE_VIEWS = frozenset((
    torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.permute.default,
    torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.expand.default,
    torch.ops.aten.slice.Tensor, torch.ops.aten.select.int, torch.ops.aten.flatten.using_ints,
    torch.ops.aten.unflatten.int, torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype,
    torch.ops.aten.alias.default,
))


def repeated_views_merged(gm: fx.GraphModule, block_fqns) -> int:
    """A view (or dtype cast) the code takes twice of one value, for linears, is one value:
    ``mm(x.reshape(-1, d), W1)`` and ``mm(x.reshape(-1, d), W3)`` read the same rows. Merged, the
    linears that read it are seen to share their input, as ``linear(x, W1)`` and ``linear(x, W3)``
    are, and enter tp once together; kept apart, each would look like its own input. Only views read
    by matmuls alone are merged (a view also read by replicated work, a router beside the experts,
    keeps its own, so tp is entered below it), and only views of one FSDP unit's code, so no node
    moves to another block. Returns how many nodes were merged away."""
    owners = BlockOwners(block_fqns)
    seen: dict[tuple, fx.Node] = {}
    merged = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _PURE_VIEWS or not _read_by_matmuls(node):
            continue
        try:
            key = (node.target, _hashable(node.args), _hashable(node.kwargs), owners.of_node(node))
        except TypeError:
            continue  # an argument that is not plain data
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
            merged += 1
    return merged


_LAST_DIM_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
                   torch.ops.aten.unflatten.int)


def unbound_views_as_splits(graph: fx.Graph) -> int:
    """``x.view(..., n, *rest).unbind(d)`` with ``d`` the first dim the view made of ``x``'s last
    dim (a fused k|v taken apart as ``kv.view(b, s, 2, heads, d).unbind(2)``, a gate|up as
    ``unflatten(-1, (2, hidden)).unbind(-2)``) is ``x.split(width // n, -1)``, each piece viewed as
    ``rest``: the same columns, taken apart along the dim a projection's output is cut on. A fused
    output read by a split has sections (:mod:`autoshard.passes.sections`); read by an unbind of a
    new dim, it would have none. Returns how many were rewritten."""
    rewritten = 0
    for unbind in [n for n in graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.unbind.int]:
        found = _unbound_view(unbind)
        if found is None:
            continue
        x, n, rest = found
        width = x.meta["val"].shape[-1]
        with graph.inserting_before(unbind):
            split = made_node(graph, torch.ops.aten.split.Tensor, (x, width // n, -1), unbind,
                          tuple(x.meta["val"].split(width // n, -1)))
        for item in list(unbind.users):
            i = item.args[1]
            with graph.inserting_before(item):
                piece = made_node(graph, operator.getitem, (split, i), item, split.meta["val"][i])
                shaped = piece
                if len(rest) != 1:
                    shaped = made_node(graph, torch.ops.aten.unflatten.int, (piece, -1, list(rest)), item,
                                   item.meta["val"])
            item.replace_all_uses_with(shaped)
            graph.erase_node(item)
        view = unbind.args[0]
        graph.erase_node(unbind)
        if not view.users:
            graph.erase_node(view)
        rewritten += 1
    return rewritten


def _unbound_view(unbind: fx.Node):
    """``(x, n, rest)`` when ``unbind`` takes apart, along its first new dim, a view of ``x`` that only
    split ``x``'s last dim into ``(n, *rest)``, and every use of the unbind is an index into it."""
    view, dim = unbind.args[0], unbind.args[1] if len(unbind.args) > 1 else unbind.kwargs.get("dim", 0)
    if not (isinstance(view, fx.Node) and view.op == "call_function" and view.target in _LAST_DIM_VIEWS
            and len(view.users) == 1 and isinstance(view.args[0], fx.Node)):
        return None
    if not all(u.op == "call_function" and u.target is operator.getitem for u in unbind.users):
        return None
    x_val, v_val = view.args[0].meta.get("val"), view.meta.get("val")
    if not (isinstance(x_val, torch.Tensor) and isinstance(v_val, torch.Tensor)) or x_val.dim() < 1:
        return None
    lead = x_val.dim() - 1
    if dim < 0:
        dim += v_val.dim()
    if dim != lead or list(v_val.shape[:lead]) != list(x_val.shape[:lead]):
        return None
    n, rest = v_val.shape[lead], tuple(v_val.shape[lead + 1:])
    if not all(isinstance(d, int) for d in (n, *rest, x_val.shape[-1])) or n * math.prod(rest) != x_val.shape[-1]:
        return None
    return view.args[0], n, rest


_MATMULS = frozenset((torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.matmul.default,
                      torch.ops.aten.linear.default))


def _read_by_matmuls(node: fx.Node) -> bool:
    return bool(node.users) and all(u.op == "call_function" and u.target in _MATMULS for u in node.users)


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_hashable(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    hash(value)
    return value


def _computed_bias_apart(graph: fx.Graph, param_shapes: dict[str, tuple[int, ...]]) -> None:
    """``linear(x, W, b)`` with ``W`` a 2-D parameter and ``b`` a computed value, not a parameter (EVA's
    fused q|k|v bias ``cat((q_bias, k_bias, v_bias))`` with ``k_bias`` a zeros buffer), is
    ``linear(x, W) + b``: the linear is then a site like any other, and the bias an operand of an add
    whose layout rules cut it as the linear's output is cut (a cat of sections piece by piece)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.linear.default:
            continue
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        weight = node.args[1] if len(node.args) > 1 else None
        if not (isinstance(bias, fx.Node) and isinstance(weight, fx.Node)) or bias.op == "get_attr" \
                or weight.op != "get_attr" or len(param_shapes.get(weight.target, ())) != 2:
            continue
        out = node.meta.get("val")
        if not isinstance(out, torch.Tensor) or not isinstance(bias.meta.get("val"), torch.Tensor):
            continue
        with graph.inserting_before(node):
            bare = made_node(graph, torch.ops.aten.linear.default, (node.args[0], weight), node, out)
            added = made_node(graph, torch.ops.aten.add.Tensor, (bare, bias), node, out)
        node.replace_all_uses_with(added)
        graph.erase_node(node)


def _summed_biases_apart(graph: fx.Graph, param_shapes: dict[str, tuple[int, ...]]) -> None:
    """In a sum of two or more linears' outputs (GPT-NeoX's parallel residual ``mlp + attn + x``), a
    linear's bias is added apart, ``linear(x, W) + b``: a sum is the same in any order, so
    :func:`_sum_partials_first` then adds the products first and the biases after them. Cut rowwise,
    the products add as partial sums and are all-reduced once, and each bias is added once to the
    total; with the bias inside, each product would be reduced before its bias, one all-reduce each."""
    for node in list(graph.nodes):
        if not _is_plain_add(node) or any(_is_plain_add(u) and len(node.users) == 1 for u in node.users):
            continue  # start from the last add of a chain
        terms, _ = _add_chain(node)
        products = [t for t in terms if _weight_linear(t, param_shapes) and _same_shape(t, node)]
        if len(products) < 2:
            continue
        for product in products:
            bias = product.args[2] if len(product.args) > 2 else product.kwargs.get("bias")
            if not isinstance(bias, fx.Node) or bias.op != "get_attr" or len(product.users) != 1:
                continue
            with graph.inserting_before(product):
                bare = made_node(graph, torch.ops.aten.linear.default, product.args[:2], product, product.meta["val"])
                added = made_node(graph, torch.ops.aten.add.Tensor, (bare, bias), product, product.meta["val"])
            product.replace_all_uses_with(added)
            graph.erase_node(product)


def _weight_linear(node, param_shapes) -> bool:
    """``aten.linear(x, W, ...)`` with ``W`` a 2-D parameter read as it is stored."""
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target == torch.ops.aten.linear.default
            and isinstance(node.args[1], fx.Node) and node.args[1].op == "get_attr"
            and len(param_shapes.get(node.args[1].target, ())) == 2)


_FRESH_BUFFERS = (torch.ops.aten.new_empty.default, torch.ops.aten.empty.memory_format,
                  torch.ops.aten.new_zeros.default, torch.ops.aten.zeros.default)


def _filled_buffers_as_cat(graph: fx.Graph) -> None:
    """A fresh buffer whose every element is written by ``copy_`` into slices along one dim before
    anything reads it becomes the ``cat`` of the written values (each broadcast to its slice and
    cast to the buffer's dtype, as ``copy_`` does). A buffer written in part, along several dims,
    or read before it is full is left alone."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for buffer in [n for n in graph.nodes if n.op == "call_function" and n.target in _FRESH_BUFFERS]:
        fill = _slice_fill(buffer, order)
        if fill is None:
            continue
        dim, writes = fill
        last = max((copy for _, copy in writes), key=order.__getitem__)
        want = buffer.meta["val"]
        pieces = []
        with graph.inserting_before(last.next):  # in the order made (inserting_after reverses it)
            for view, copy in writes:
                piece, shape = copy.args[1], tuple(view.meta["val"].shape)
                if tuple(piece.meta["val"].shape) != shape:
                    piece = made_node(graph, torch.ops.aten.expand.default, (piece, list(shape)), copy,
                                  piece.meta["val"].expand(shape))
                if piece.meta["val"].dtype != want.dtype:
                    piece = made_node(graph, torch.ops.aten.to.dtype, (piece, want.dtype), copy,
                                  piece.meta["val"].to(want.dtype))
                pieces.append(piece)
            cat = made_node(graph, torch.ops.aten.cat.default, (pieces, dim), last, want)
        for view, copy in writes:
            graph.erase_node(copy)
            graph.erase_node(view)
        buffer.replace_all_uses_with(cat)
        graph.erase_node(buffer)


_INDEX_COPIES = (torch.ops.aten.index_copy_.default, torch.ops.aten.index_copy.default)


def _index_copied_zeros_as_cat(gm: fx.GraphModule) -> None:
    """A fresh zeros buffer whose one use is ``index_copy_(buffer, dim, index, src)`` with a constant
    ``index`` (litgpt's LoRA ``zero_pad``: the q and v updates placed in the q|k|v columns, k's left
    zero) becomes the ``cat`` along ``dim`` of ``src``'s slices and zeros for the columns it skips,
    in column order: each run of consecutive columns taken from consecutive ``src`` columns is one
    slice. A functional op with a layout rule, where a scatter by constant indices has none."""
    graph, changed = gm.graph, False
    for copy in [n for n in graph.nodes if n.op == "call_function" and n.target in _INDEX_COPIES]:
        buffer, dim, index, src = copy.args[:4]
        if not (isinstance(buffer, fx.Node) and buffer.op == "call_function" and len(buffer.users) == 1
                and buffer.target in (torch.ops.aten.new_zeros.default, torch.ops.aten.zeros.default)
                and isinstance(src, fx.Node) and isinstance(dim, int)):
            continue
        columns = _constant_of(gm, index)
        want, got = buffer.meta.get("val"), src.meta.get("val")
        if columns is None or not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor) \
                or want.dtype != got.dtype or columns.dim() != 1:
            continue
        dim %= want.dim()
        size = want.shape[dim]
        columns = [int(c) % size for c in columns.tolist()] if isinstance(size, int) else None
        if not columns or len(set(columns)) != len(columns) or len(columns) != got.shape[dim]:
            continue
        runs = []  # (first column, first src column, length), in column order
        for j, c in sorted(enumerate(columns), key=lambda pair: pair[1]):
            if runs and runs[-1][0] + runs[-1][2] == c and runs[-1][1] + runs[-1][2] == j:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((c, j, 1))
        pieces, at = [], 0
        with graph.inserting_before(copy):
            for c, j, length in runs + [(size, None, 0)]:
                if c > at:  # columns no src column is copied to: zeros
                    shape = list(want.shape)
                    shape[dim] = c - at
                    pieces.append(made_node(graph, torch.ops.aten.new_zeros.default, (src, shape), copy,
                                        want.narrow(dim, at, c - at)))
                if length:
                    pieces.append(made_node(graph, torch.ops.aten.slice.Tensor, (src, dim, j, j + length), copy,
                                        got.narrow(dim, j, length)))
                at = c + length
            cat = made_node(graph, torch.ops.aten.cat.default, (pieces, dim), copy, want)
        copy.replace_all_uses_with(cat)
        graph.erase_node(copy)
        graph.erase_node(buffer)
        changed = True
    if changed:
        graph.eliminate_dead_code()


def _constant_of(gm: fx.GraphModule, node) -> torch.Tensor | None:
    """The integer tensor constant ``node`` reads (through copies and detaches), or None."""
    value = constant_tensor(gm, node)
    return None if value is None or value.is_floating_point() else value


def _slice_fill(buffer: fx.Node, order: dict[fx.Node, int]):
    """``(dim, [(slice, copy_), ...] in slice order)`` when ``buffer`` is tiled by written slices
    along ``dim`` and read only after the last write; else None."""
    val = buffer.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    writes, readers = [], []
    for user in buffer.users:
        copy = next(iter(user.users), None) if len(user.users) == 1 else None
        if (user.target == torch.ops.aten.slice.Tensor and user.args[0] is buffer and copy is not None
                and copy.target == torch.ops.aten.copy_.default and copy.args[0] is user and not copy.users
                and isinstance(copy.args[1], fx.Node)):
            writes.append((user, copy))
        else:
            readers.append(user)
    if not writes:
        return None
    dims, spans = set(), []
    for view, _ in writes:
        dim, start, end, step = (list(view.args[1:]) + [0, None, None, 1][len(view.args) - 1:])[:4]
        start = 0 if start is None else start
        size = val.shape[dim] if isinstance(dim, int) else None
        if not (isinstance(size, int) and isinstance(start, int) and step == 1):
            return None
        end = size if end is None else end
        if not isinstance(end, int):
            return None
        dims.add(dim % val.dim())
        spans.append((max(0, min(start + size if start < 0 else start, size)),
                      max(0, min(end + size if end < 0 else end, size))))
    if len(dims) != 1:
        return None
    dim = dims.pop()
    ranked = sorted(zip(spans, writes, strict=True), key=lambda pair: pair[0])
    covered = 0
    for (start, end), _ in ranked:
        if start != covered or end <= start:
            return None
        covered = end
    last = max(order[copy] for _, copy in writes)
    if covered != val.shape[dim] or any(order[reader] < last for reader in readers):
        return None
    return dim, [pair for _, pair in ranked]




def _convolution_bias_apart(graph: fx.Graph) -> None:
    """A dense convolution (``groups=1``) with a bias becomes the convolution without it, plus the
    bias broadcast over the spatial dims: cut rowwise over its input channels, each rank's partial
    sum must not add the bias, which is added once the sum is reduced."""
    for node in list(graph.nodes):
        conv = Convolution.of(node)
        if conv is None or len(node.args) < 3 or not isinstance(conv.bias, fx.Node) or conv.groups != 1 \
                or conv.transposed:
            continue
        bias, out = conv.bias, node.meta["val"]
        shape = [out.shape[1]] + [1] * (out.dim() - 2)
        with graph.inserting_before(node):
            bare = made_node(graph, node.target, (node.args[0], node.args[1], None, *node.args[3:]), node, out)
            view = made_node(graph, torch.ops.aten.view.default, (bias, shape), node, bias.meta["val"].view(shape))
            added = made_node(graph, torch.ops.aten.add.Tensor, (bare, view), node, out)
        node.replace_all_uses_with(added)
        graph.erase_node(node)


def _repeat_interleave_without_output_size(graph: fx.Graph) -> None:
    """``repeat_interleave(x, r, dim, output_size=n)``: ``n`` only spares a device sync, and is the
    global size; without it the op's local form on a cut ``dim`` (each rank's groups repeated to its
    heads, Mamba-2's B and C) needs no local size."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.repeat_interleave.self_int \
                and "output_size" in node.kwargs:
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "output_size"}


def _sum_partials_first(gm: fx.GraphModule, sites: Sites) -> None:
    """``x + attn(h) + mlp(h)`` is ``(x + a) + m`` in the graph: regroup a chain of adds
    so that the outputs of linears are summed first, ``x + (a + m)``. Two rowwise
    outputs then add as partial sums and are all-reduced once (a parallel block)."""
    linear_outputs = {s.output for s in sites.linears}
    graph = gm.graph
    for node in list(graph.nodes):
        if not _is_plain_add(node) or any(_is_plain_add(u) and len(node.users) == 1 for u in node.users):
            continue  # start from the last add of a chain
        terms, chain = _add_chain(node)
        products = [t for t in terms if t in linear_outputs and _same_shape(t, node)]
        if len(products) < 2 or len(chain) != len(terms) - 1:
            continue
        others = [t for t in terms if t not in products]
        with graph.inserting_before(node):
            total = products[0]
            for product in products[1:] + others:
                total = _add(graph, total, product, node)
        node.replace_all_uses_with(total)
        for old in chain:
            graph.erase_node(old)


def _add_chain(last: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(terms, adds) of the sum ending at ``last``: adds read only by the next add of the chain."""
    terms, chain, frontier = [], [], [last]
    while frontier:
        value = frontier.pop()
        if _is_plain_add(value) and (value is last or len(value.users) == 1) and _same_shape(value, last):
            chain.append(value)
            frontier += reversed(value.args)
        else:
            terms.append(value)
    return terms, chain


def _is_plain_add(node) -> bool:
    return (
        isinstance(node, fx.Node) and node.op == "call_function" and node.target == torch.ops.aten.add.Tensor
        and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args)
        and node.kwargs.get("alpha", 1) == 1
    )


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape and (
        va.dtype == vb.dtype)


def _add(graph: fx.Graph, a: fx.Node, b: fx.Node, like: fx.Node) -> fx.Node:
    new = graph.call_function(torch.ops.aten.add.Tensor, (a, b))
    made_like(new, like, also=("val",))
    return new
