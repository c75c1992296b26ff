"""The format of a blockwise-quantized all-gather (:class:`BlockQuant`): an option the user gives,
so it lives with the options; the math and the plan's per-weight decision are in
:mod:`autoshard.plans.block_quant`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

ON_UNALIGNED = ("unquantized", "error")

# dtype -> (short name, largest value, relative rounding error of one element)
_FORMATS: dict[torch.dtype, tuple[str, float, float]] = {
    torch.float8_e4m3fn: ("fp8", torch.finfo(torch.float8_e4m3fn).max, 2.0**-4),  # 3 mantissa bits
    torch.float8_e5m2: ("fp8e5m2", torch.finfo(torch.float8_e5m2).max, 2.0**-3),  # 2 mantissa bits
    torch.int8: ("int8", 127.0, 0.0),  # absolute: half a step of amax / 127
}


@dataclasses.dataclass(frozen=True)
class BlockQuant:
    """Quantize each rank's tile block by block for FSDP's all-gather.

    ``dtype``: ``torch.float8_e4m3fn`` (default), ``torch.float8_e5m2`` or
    ``torch.int8``. ``block``: an int for square blocks or a ``(rows, cols)``
    pair, on the stored tensor's last two dims (``[in, out]`` for a colwise
    weight). ``on_unaligned``: a weight whose tile does not divide by the
    block is gathered ``"unquantized"`` (the plan says so), or raises
    (``"error"``) naming the parameter, its tile and the block.
    """

    dtype: torch.dtype = torch.float8_e4m3fn
    block: int | tuple[int, int] = 128
    on_unaligned: str = "unquantized"

    def __post_init__(self) -> None:
        if self.dtype not in _FORMATS:
            names = ", ".join(f"torch.{str(d).removeprefix('torch.')}" for d in _FORMATS)
            raise ValueError(f"autoshard: BlockQuant dtype must be one of {names}, got {self.dtype}")
        rows, cols = self.shape
        if not (isinstance(rows, int) and isinstance(cols, int) and rows > 0 and cols > 0):
            raise ValueError(f"autoshard: BlockQuant block must be a positive int or (rows, cols), got {self.block!r}")
        if self.on_unaligned not in ON_UNALIGNED:
            raise ValueError(
                f"autoshard: BlockQuant on_unaligned must be 'unquantized' or 'error', got {self.on_unaligned!r}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        block = self.block
        return (block, block) if isinstance(block, int) else tuple(block)

    @property
    def max_value(self) -> float:
        return _FORMATS[self.dtype][1]

    @property
    def name(self) -> str:
        return _FORMATS[self.dtype][0]

    def label(self) -> str:
        """``fp8 128x128``: how the plan names this format."""
        rows, cols = self.shape
        return f"{self.name} {rows}x{cols}"

    def block_error_bound(self, amax: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The largest ``|dequantized - master|`` in a block whose largest magnitude is ``amax``:
        the format's rounding (relative for floats, half a step for int8) plus the cast of the
        dequantized value to ``out_dtype``."""
        relative = _FORMATS[self.dtype][2]
        rounding = amax * relative if relative else amax / self.max_value / 2
        return rounding + amax * torch.finfo(out_dtype).eps / 2

    def to_dict(self) -> dict[str, str]:
        rows, cols = self.shape
        return {"dtype": str(self.dtype).removeprefix("torch."), "block": f"{rows}x{cols}",
                "on_unaligned": self.on_unaligned}

    @classmethod
    def from_dict(cls, data: Mapping[str, str]) -> BlockQuant:
        rows, cols = (int(n) for n in str(data["block"]).split("x"))
        return cls(getattr(torch, str(data["dtype"])), (rows, cols), str(data.get("on_unaligned", "unquantized")))
