"""FLOPs of one forward's matmuls, grouped GEMMs and attention, from a node's value shapes.

A leaf both the mesh suggestion (``advice.suggest``) and pipeline stage costs
(``plans.stage_costs``) count with, so that neither imports the other.
"""

from __future__ import annotations

import torch

MATMULS = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default, torch.ops.aten.matmul.default, torch.ops.aten.linear.default,
}
ATTENTION = {torch.ops.aten.scaled_dot_product_attention.default}


def matmul_flops(node) -> float:
    """One forward's FLOPs of a matmul, grouped GEMM or attention node, from its values' shapes."""
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return 0.0
    if node.target in ATTENTION:
        q, k = (a.meta["val"] for a in node.args[:2])
        return 4.0 * q.numel() * k.shape[-2]  # q @ k^T and attn @ v
    with_bias = node.target in (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default)
    first = node.args[1] if with_bias else node.args[0]
    inner = first.meta["val"].shape[-1]
    return 2.0 * out.numel() * int(inner)
