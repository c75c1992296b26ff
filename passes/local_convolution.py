"""Local convolutions of one channel: run as a grouped convolution over the batch.

A depthwise (or grouped) convolution whose groups tp deals out leaves each rank its share of
the groups (Nystromformer's ``Conv2d(heads, heads, (65, 1), groups=heads)`` over the values: at
tp = heads, one head per rank). When that share is one group of one channel, the local op is a
dense convolution of one input and one output channel, and ATen's CPU convolution takes oneDNN's
dense path for it, whose backward crashes (or spins) when the kernel is longer than the input
(measured with torch 2.13: ``[2, 1, 16, 16]`` by a ``65 x 1`` kernel, ``groups=1``). The same
filter applied as a grouped convolution runs on every backend:

    y = conv(x, w, b, groups=1)                    x [n, 1, *s], w [1, 1, *k], b [1]
      = conv(x.flatten(0, 1)[None], w.expand(n, 1, *k), b.expand(n), groups=n)[0][:, None]

each of the ``n`` batch rows a channel of its own, convolved by the one filter (its gradient the
sum over the rows, as autograd of ``expand`` gives). Exact in any dtype: each output element is
the same dot product.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.passes.layout_rules import Convolution
from autoshard.passes.partition import made_like

aten = torch.ops.aten


def fold_single_channel_convolutions(graph: fx.Graph, convolutions, tp: int) -> list[fx.Node]:
    """Rewrite each convolution among ``convolutions`` (nodes whose local arguments are set, their
    weights cut over ``tp`` on dim 0; other nodes are passed over) that convolves one channel by
    one filter in one group into the grouped form above; returns the rewritten ones.
    The node keeps its name and users: it becomes the last view of the folded result."""
    folded = []
    for node in convolutions:
        conv = Convolution.of(node)
        if conv is None or conv.transposed or conv.groups != 1 or conv.channels_per_group != 1:
            continue
        weight = conv.weight.meta.get("val") if isinstance(conv.weight, fx.Node) else None
        if weight is None or int(weight.shape[0]) != tp:
            continue  # a rank's share is not one filter
        with graph.inserting_before(node):
            def call(target, args, kwargs=None, origin=node):
                new = graph.call_function(target, args, kwargs)
                made_like(new, origin)
                return new

            rows = call(aten.sym_size.int, (conv.input, 0))
            channels = call(aten.unsqueeze.default, (call(aten.flatten.using_ints, (conv.input, 0, 1)), 0))
            filters = call(aten.expand.default, (conv.weight, [rows] + [-1] * (weight.dim() - 1)))
            bias = call(aten.expand.default, (conv.bias, [rows])) if isinstance(conv.bias, fx.Node) else conv.bias
            args, kwargs = list(node.args), dict(node.kwargs)
            args[0], args[1] = channels, filters
            if len(args) > 2:
                args[2] = bias
            elif "bias" in kwargs:
                kwargs["bias"] = bias
            args[conv.groups_position] = rows  # groups is positional: a rule set it to the local count
            grouped = call(node.target, tuple(args), kwargs)
            grouped.meta.update({k: v for k, v in node.meta.items() if k not in grouped.meta and k != "val"})
            squeezed = call(aten.squeeze.dim, (grouped, 0))
        node.target, node.args, node.kwargs = aten.unsqueeze.default, (squeezed, 1), {}
        folded.append(node)
    return folded
