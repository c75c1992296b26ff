"""Blockwise-quantized FSDP all-gather: the format, the math and the plan's per-weight decision.

autoshard stores every linear weight as one clean tile per rank, ``[in/dp,
out/tp]``: both mesh axes cut different dims. A grid of ``rows x cols``
blocks (one fp32 scale per block) therefore lies inside a rank's tile as long
as the tile divides by the block, so each rank quantizes its own shard with no
scale shared across ranks, and FSDP's all-gather carries 1-byte values
instead of 4 (or 2). In the hand-written layout a colwise weight ``[out, in]``
is cut on dim 0 by both axes, a slab of ``out/(dp*tp)`` rows, which stops
holding whole blocks far sooner.

Only what FSDP gathers is quantized: the master weights, their gradients
(reduce-scattered unquantized) and the optimizer state never are. A weight is
quantized when FSDP shards its stored dim 0 evenly and its tile's last two dims
divide by the block; otherwise it is gathered as it is and the plan says why
(or, with ``on_unaligned="error"``, planning raises). 1-D parameters (norms,
biases) are never quantized. An N-D weight (stacked experts ``[E, out, in]``)
is blocked over its last two dims, per leading index.

The tensors that carry the hooks FSDP2 calls are in :mod:`autoshard.runtime.quantized_gather`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from autoshard.core.mesh import MeshAxes, dp_choice
from autoshard.core.quant_format import BlockQuant
from autoshard.core.sharding import placement_dim, shard_on, tp_local_shape

# --- the math ----------------------------------------------------------------------------------


def _blocked(x: torch.Tensor, spec: BlockQuant) -> torch.Tensor:
    """``[..., R, C]`` viewed as ``[..., R/br, br, C/bc, bc]``."""
    rows, cols = spec.shape
    *lead, r, c = x.shape
    return x.reshape(*lead, r // rows, rows, c // cols, cols)


def quantize_blocks(x: torch.Tensor, spec: BlockQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)``: ``x`` in ``spec.dtype`` block by block, and one fp32 scale per block
    (``block amax / dtype max``; an all-zero block gets a tiny scale and stays zero)."""
    blocks = _blocked(x.detach().float(), spec)
    amax = blocks.abs().amax(dim=(-3, -1))
    scales = amax.clamp_min(torch.finfo(torch.float32).tiny) / spec.max_value
    scaled = blocks / scales[..., :, None, :, None]
    if spec.dtype == torch.int8:
        values = scaled.round().clamp(-127, 127).to(torch.int8)
    else:
        values = scaled.clamp(-spec.max_value, spec.max_value).to(spec.dtype)
    return values.reshape(x.shape), scales


def dequantize_blocks(values: torch.Tensor, scales: torch.Tensor, spec: BlockQuant,
                      dtype: torch.dtype) -> torch.Tensor:
    blocks = _blocked(values.float(), spec) * scales[..., :, None, :, None]
    return blocks.reshape(values.shape).to(dtype)


def block_amax(x: torch.Tensor, spec: BlockQuant) -> torch.Tensor:
    """The largest magnitude of each block of ``x`` (``[..., R/br, C/bc]``)."""
    return _blocked(x.detach().float(), spec).abs().amax(dim=(-3, -1))


# --- the plan's decision -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TileQuant:
    """What FSDP's all-gather carries for one parameter: its tile (the stored piece one rank
    holds) and, when quantized, the block grid inside it; otherwise why not."""

    tile: tuple[int, ...]
    blocks: tuple[int, int] = ()
    reason: str = ""

    @property
    def quantized(self) -> bool:
        return bool(self.blocks)

    def describe(self, spec: BlockQuant) -> str:
        tile = "x".join(map(str, self.tile))
        if self.quantized:
            return f"{spec.label()}: {self.blocks[0]}x{self.blocks[1]} blocks per tile {tile}"
        return f"unquantized: {self.reason}"

    def to_dict(self) -> dict:
        return {"tile": list(self.tile), "blocks": list(self.blocks), "reason": self.reason}

    @classmethod
    def from_dict(cls, data: Mapping) -> TileQuant:
        return cls(tuple(int(n) for n in data["tile"]), tuple(int(n) for n in data.get("blocks", ())),
                   str(data.get("reason", "")))


def tile_quant(fqn: str, entry, axes: MeshAxes, spec: BlockQuant) -> TileQuant | None:
    """The decision for one plan entry (``None`` for a 1-D parameter: never quantized).

    Raises a ``ValueError`` naming the parameter, its tile and the block when
    the tile does not divide by the block and ``spec.on_unaligned == "error"``.
    """
    stored = tuple(entry.stored_shape)
    if len(stored) < 2:
        return None
    tile = tp_local_shape(entry, axes)
    choice = dp_choice(entry.placements)
    if choice is None or axes.fsdp_degree == 1:
        return TileQuant(tuple(tile), reason="not all-gathered (no FSDP sharding)")
    if choice != shard_on(0):
        dim = placement_dim(choice)
        why = "replicated over dp: not all-gathered" if dim is None else f"FSDP shards stored dim {dim}"
        return TileQuant(tuple(tile), reason=why)
    if stored[0] % axes.fsdp_degree:
        tile[0] = -(-stored[0] // axes.fsdp_degree)
        return TileQuant(tuple(tile), reason=f"stored dim 0 ({stored[0]}) does not divide by dp={axes.fsdp_degree}")
    tile[0] //= axes.fsdp_degree
    rows, cols = spec.shape
    if tile[-2] % rows or tile[-1] % cols:
        text = "x".join(map(str, tile))
        if spec.on_unaligned == "error":
            raise ValueError(
                f"autoshard: all_gather_quant: parameter '{fqn}' has tile {text} per rank (stored "
                f"{'x'.join(map(str, stored))} on mesh {axes.to_dict()}), which does not divide into "
                f"{rows}x{cols} blocks; choose a block that divides it, or on_unaligned='unquantized' "
                f"to gather it unquantized"
            )
        return TileQuant(tuple(tile), reason=f"tile {text} does not divide into {rows}x{cols} blocks")
    return TileQuant(tuple(tile), blocks=(tile[-2] // rows, tile[-1] // cols))


def with_quantized_gathers(plan, axes: MeshAxes, spec: BlockQuant | None):
    """``plan`` with each parameter's all-gather decided for ``spec`` on ``axes`` (pure data).

    ``spec=None`` clears the decisions: FSDP gathers every parameter as stored.
    """
    if spec is None:
        params = {fqn: dataclasses.replace(e, gather=None) for fqn, e in plan.params.items()}
        return dataclasses.replace(plan, params=params, all_gather_quant={})
    params = {fqn: dataclasses.replace(e, gather=tile_quant(fqn, e, axes, spec)) for fqn, e in plan.params.items()}
    return dataclasses.replace(plan, params=params, all_gather_quant=spec.to_dict())
