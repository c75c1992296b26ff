"""A rank's share of a grouped convolution that is one group of one channel runs folded over the
batch (passes/local_convolution.py): the same values and gradients as the convolution it replaces,
on shapes where ATen's CPU dense path for one channel crashes in backward (kernel longer than the
input), and nothing else rewritten."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import autoshard
from autoshard.core.sharding import Role
from autoshard.passes.layout_rules import CONVOLUTIONS
from autoshard.passes.local_convolution import fold_single_channel_convolutions
from tests.pattern_models import VOCAB as PATTERN_VOCAB
from tests.pattern_models import Block, Config, ConvSkipAttention, Decoder

aten = torch.ops.aten


def _conv_graph(x, w, b, groups):
    def conv(x, w, b):
        if x.dim() == 3:
            return aten.conv1d.default(x, w, b, [1], [w.shape[-1] // 2], [1], groups)
        return aten.conv2d.default(x, w, b, [1, 1], [w.shape[-2] // 2, 0], [1, 1], groups)

    return make_fx(conv)(x, w, b)


def _convolutions(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target in CONVOLUTIONS]


@pytest.mark.parametrize("shape, kernel, bias", [
    ((2, 1, 16, 8), (33, 1), False),  # Nystromformer's value skip at one head per rank
    ((3, 1, 12), (9,), True),  # a depthwise conv1d at one channel per rank, its bias cut with it
    ((1, 1, 16, 4), (5, 1), False),  # a batch of one: one group
], ids=["conv2d_long_kernel", "conv1d_bias", "batch_of_one"])
def test_a_one_channel_convolution_folded_over_the_batch_keeps_values_and_gradients(shape, kernel, bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    w = torch.randn((1, 1, *kernel), generator=gen)
    b = torch.randn(1, generator=gen) if bias else None
    gm = _conv_graph(x, w, b, 1)
    for node in _convolutions(gm):  # the weight as the graph's meta gives it: the share of tp=4
        node.args[1].meta["val"] = torch.empty(4, 1, *kernel)
    folded = fold_single_channel_convolutions(gm.graph, _convolutions(gm), tp=4)
    gm.recompile()
    assert len(folded) == 1 and folded[0].target == aten.unsqueeze.default
    (grouped,) = _convolutions(gm)
    assert grouped.args[-1] is not None and isinstance(grouped.args[-1], fx.Node)  # groups = the batch

    leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
    got = gm(*leaves, *(() if bias else (None,)))
    got.backward(torch.ones_like(got))
    with torch.backends.mkldnn.flags(enabled=False):  # the reference, off the crashing path
        ref_leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
        conv = torch.nn.functional.conv1d if x.dim() == 3 else torch.nn.functional.conv2d
        padding = kernel[0] // 2 if x.dim() == 3 else (kernel[0] // 2, 0)
        expected = conv(ref_leaves[0], ref_leaves[1], ref_leaves[2] if bias else None, padding=padding)
        expected.backward(torch.ones_like(expected))
    torch.testing.assert_close(got, expected)
    for leaf, ref in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(leaf.grad, ref.grad)


def test_only_a_share_of_one_filter_in_one_group_is_folded():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 2, 16, 8, generator=gen), torch.randn(2, 1, 5, 1, generator=gen)
    gm = _conv_graph(x, w, None, 2)  # two groups per rank: the grouped path already
    assert fold_single_channel_convolutions(gm.graph, _convolutions(gm), tp=4) == []
    gm = _conv_graph(x[:, :1], w[:1], None, 1)  # one group, but the weight's dim 0 is not tp's share
    assert fold_single_channel_convolutions(gm.graph, _convolutions(gm), tp=4) == []


def test_a_depthwise_conv_over_one_head_per_rank_is_cut_with_the_heads_on_tp8():
    """Nystromformer's value skip with 8 heads on tp=8: the conv's filters are cut with the heads
    (one per rank), the block at a dense block's 4 with no break; the proof's backward runs the
    folded convolution, where the one-channel dense path would crash (kernel 33 > 16 tokens)."""
    model = Decoder(Config(heads=8, kv_heads=8), lambda c: Block(c, ConvSkipAttention))
    tokens = torch.randint(0, PATTERN_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    proof = autoshard.check(model, {"tp": 8}, example_inputs=(tokens,))
    assert proof.ok, str(proof)
    plan = proof.plan
    assert not plan.breaks, plan.breaks_line()
    conv = plan.params["layers.0.attention.conv.weight"]
    assert conv.role == Role.SHARDED and conv.sharded_dim("tp") == 0, str(plan)
    assert [plan.num_tp_collectives(b) for b in ("layers.0", "layers.1")] == [4, 4]
