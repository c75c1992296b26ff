"""A fresh buffer filled slice by slice is captured as the cat it is (passes/filled_buffers.py), and
left as written whenever it is not exactly one."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autoshard.passes.capture import capture

aten = torch.ops.aten


class _Filled(nn.Module):
    """``w`` wide output filled from two halves of ``x @ W``; ``how`` bends one rule of a cat."""

    def __init__(self, how: str):
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.how = how

    def forward(self, x):
        h = self.proj(x)
        a, b = h[..., :4], h[..., 4:]
        fresh = h.new_zeros if self.how in ("zeros", "read_between") else h.new_empty
        out = fresh(*h.shape[:-1], 8)
        if self.how == "read_between":
            out[..., :4].copy_(a)
            early = out.sum()
            out[..., 4:].copy_(b)
            return out * 2 + early
        if self.how == "gap":
            out[..., :3].copy_(a[..., :3])
            out[..., 4:].copy_(b)
            out[..., 3:4].fill_(0.0)
            return out * 2
        if self.how == "broadcast":
            out[..., :4].copy_(a)
            out[..., 4:].copy_(b[..., :1])  # copy_ broadcasts its source over the slice
            return out * 2
        if self.how == "cast":
            out[..., :4].copy_(a.double())
            out[..., 4:].copy_(b)
            return out * 2
        out[..., 4:].copy_(b)  # written in any order
        out[..., :4].copy_(a)
        return out * 2


def _ops(model, x):
    gm = capture(model, (x,)).gm
    return [n.target for n in gm.graph.nodes if n.op == "call_function"], gm


@pytest.mark.parametrize(("how", "as_cat"), [("fill", True), ("zeros", True), ("broadcast", True),
                                             ("read_between", False), ("gap", False), ("cast", False)])
def test_a_buffer_becomes_a_cat_only_when_it_is_exactly_one(how, as_cat):
    """Tiled by copies in any order (a fresh or zeroed buffer, a source ``copy_`` broadcasts): a cat.
    Read before the last copy, left with a gap, or written from another dtype: left as written."""
    torch.manual_seed(0)
    model, x = _Filled(how), torch.randn(2, 3, 8)
    ops, gm = _ops(model, x)
    assert (aten.cat.default in ops, aten.copy_.default in ops) == (as_cat, not as_cat), ops
    torch.testing.assert_close(gm(x), model(x))
