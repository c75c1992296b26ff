"""The attention work of each cp rank, read from a graph cut over cp run on simulated ranks: how
evenly the balanced chunks spread attention's FLOPs (the proof of the cut itself is
:mod:`autoshard.proof.grid_proof`)."""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autoshard.proof.rank_grid import RankGrid
from autoshard.proof.simulate import PerRank, RankSimulator
from autoshard.runtime.context_ops import CP_CAUSAL_ATTENTION


@dataclasses.dataclass(frozen=True)
class AttentionWork:
    """Attention FLOPs each cp rank runs in one forward, read from the emitted code's SDPA calls:
    ``executed`` counts every (query, key) pair a call computes, ``useful`` only those its mask
    lets through (``4 * head_dim`` FLOPs per pair and head: scores and the weighted sum)."""

    executed: tuple[float, ...]
    useful: tuple[float, ...]

    @staticmethod
    def spread(values) -> float:
        """Largest deviation from the mean, relative to it."""
        mean = sum(values) / len(values)
        return max(abs(v - mean) for v in values) / mean

    @staticmethod
    def ratio(values) -> float:
        """Most over least."""
        return max(values) / min(values)


def attention_work(cut: fx.GraphModule, cp: int, inputs: list, weights: dict) -> AttentionWork:
    """Run ``cut`` on ``cp`` simulated ranks (no gradients) and count each rank's attention FLOPs."""
    executed, useful = [0.0] * cp, [0.0] * cp
    sdpa = torch.ops.aten.scaled_dot_product_attention.default

    class Counting(RankSimulator):
        def call_function(self, target, args, kwargs):
            if target is CP_CAUSAL_ATTENTION:  # chunk c reads (c + 1) L keys, the last L causally
                q = args[0].values[0]
                chunk, batch_heads = q.shape[-2] // 2, q.numel() // (q.shape[-2] * q.shape[-1])
                for rank in range(self.ranks):
                    for c in (rank, 2 * cp - 1 - rank):
                        executed[rank] += 4 * batch_heads * q.shape[-1] * chunk * (c + 1) * chunk
                        useful[rank] += 4 * batch_heads * q.shape[-1] * (c * chunk + (chunk + 1) / 2) * chunk
            if target is sdpa:
                from autoshard.proof.simulate import on_rank

                for rank in range(self.ranks):
                    a, k = on_rank(args, rank), on_rank(kwargs, rank)
                    q, key = a[0], a[1]
                    mask = a[3] if len(a) > 3 else k.get("attn_mask")
                    causal = a[5] if len(a) > 5 else k.get("is_causal", False)
                    pairs = q.shape[-2] * key.shape[-2]
                    batch_heads = q.numel() // (q.shape[-2] * q.shape[-1])
                    seen = pairs
                    if mask is not None:
                        seen = mask.expand(*q.shape[:-1], key.shape[-2]).float().sum().item() / batch_heads
                        if mask.dtype != torch.bool:
                            seen = (mask.expand(*q.shape[:-1], key.shape[-2]) > -torch.inf).float().sum().item() \
                                / batch_heads
                    elif causal:
                        seen = torch.ones(q.shape[-2], key.shape[-2]).tril().sum().item()
                    flops = 4 * batch_heads * q.shape[-1]
                    executed[rank] += flops * pairs
                    useful[rank] += flops * seen
            return super().call_function(target, args, kwargs)

    params = {name: PerRank([w.detach()] * cp) for name, w in weights.items()}
    with torch.no_grad():
        Counting(cut, RankGrid.of(cp=cp), params.get).run(*inputs)
    return AttentionWork(tuple(executed), tuple(useful))
