"""The experts' decision on a mesh with an ``ep`` axis: each MoE layer split whole over ep, or its
experts kept on every ep rank as data parallelism keeps the dense weights; predicted bytes and the
GEMM shapes of both, and the choice by cost.

What each choice moves per rank and training step (wire bytes, at balanced routing):

* **ep**: the dispatch and the combine of the layer's rows, forward and again backward (each rank
  keeps ``1 / ep`` of its rows and sends the rest), plus the per-expert counts; each rank holds its
  ``1 / ep`` of the experts whole, and their gradients are all-reduced over the data axes ep leaves.
* **dp** (the experts stay on every ep rank, cut by FSDP over the data axes including ep, as every
  dense weight is): no token moves, but every step all-gathers the experts' weights twice and
  reduce-scatters their gradients over the ``dp x ep`` ranks.

Tensor parallelism, where the mesh has it, cuts the experts' features the same way under both, so
its traffic is the same and is left out of the comparison. The cheaper choice wins; the record says
both numbers, both GEMM shapes (ep's grouped GEMM reads ``ep`` times the rows of each expert) and the
peak of expert weights a rank holds gathered.

Only layers whose code keeps rows apart between their first and last matmul can be split (see
:mod:`autoshard.passes.ep_regions`); the others are listed with the reason and stay ``dp``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

EP_CHOICE, DP_CHOICE = "ep", "dp"


@dataclasses.dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer's experts as found in the graph: data, no graph nodes.

    ``form`` is ``"indexed"`` (rows pick ``W[ids]``), ``"grouped"`` (rows sorted by expert, a grouped
    GEMM over ``offs``) or ``""`` when ep cannot take the layer (``refused`` says why). ``rows`` are
    the ``(token, choice)`` rows one rank routes in the example, ``itemsize`` their bytes per value,
    ``shapes`` each expert weight's shape (``[E, ...]``), ``gemms`` each matmul's ``(in, out)``
    features in order, ``line`` the first matmul's op and source line."""

    module: str
    weights: tuple[str, ...]
    num_experts: int
    form: str
    rows: int
    itemsize: int
    shapes: tuple[tuple[int, ...], ...]
    gemms: tuple[tuple[int, int], ...]
    line: str
    refused: str = ""


@dataclasses.dataclass(frozen=True)
class ExpertChoice:
    """The plan's decision for one MoE layer: ``choice`` (``"ep"`` or ``"dp"``) and ``why``."""

    module: str
    weights: tuple[str, ...]
    num_experts: int
    choice: str
    why: str
    ep_bytes: int = 0
    dp_bytes: int = 0
    ep_gemm: str = ""
    dp_gemm: str = ""
    line: str = ""
    # what one dispatch moves: the rows one rank routes, their width in and out, bytes per value
    rows: int = 0
    width_in: int = 0
    width_out: int = 0
    itemsize: int = 0
    # the experts' module (its path, holding these weights alone) is one FSDP unit over the data axes
    # ep leaves; else its experts are kept whole there and their gradients all-reduced
    fsdp: bool = False

    def exchanges(self, ep: int) -> list[tuple[str, int]]:
        """``(kind, bytes of the tensor)`` of each all-to-all one training step runs for this layer
        split over ``ep`` ranks: the per-expert counts, the rows out and back in forward, and their
        gradients back and out in backward."""
        if self.choice != EP_CHOICE or ep <= 1:
            return []
        rows_in, rows_out = self.rows * self.width_in * self.itemsize, self.rows * self.width_out * self.itemsize
        return [("all_to_all", self.num_experts * 8), ("all_to_all", rows_in), ("all_to_all", rows_out),
                ("all_to_all", rows_out), ("all_to_all", rows_in)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"weights": list(self.weights)}

    @classmethod
    def from_dict(cls, data: Mapping) -> ExpertChoice:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"autoshard: unknown keys {unknown} in a plan's expert layer")
        return cls(**{**data, "weights": tuple(data.get("weights", ()))})

    def line_text(self) -> str:
        head = f"experts {self.module or '<root>'}: {self.choice}"
        if self.ep_bytes or self.dp_bytes:
            head += f" (ep {self.ep_bytes:,} B, dp {self.dp_bytes:,} B per rank and step)"
        return f"{head}: {self.why}"


def choose(layer: ExpertLayer, sizes: Mapping[str, int], weight_itemsize: int,
           reshard_after_forward: bool = True) -> ExpertChoice:
    """``layer``'s choice on a mesh of ``sizes``, by predicted wire bytes per rank and step."""
    ep = sizes.get("ep", 1)
    if layer.refused:
        return _choice(layer, DP_CHOICE, f"ep cannot split this layer: {layer.refused}")
    if layer.num_experts % ep:
        return _choice(layer, DP_CHOICE, f"its {layer.num_experts} experts do not divide by ep={ep}")
    tp = sizes.get("tp", 1)
    others = math.prod(n for a, n in sizes.items() if a in ("dp", "dp_shard", "cp"))
    weights = sum(math.prod(s) for s in layer.shapes) * weight_itemsize // tp
    gathers = 3 if reshard_after_forward else 2
    dp_bytes = gathers * _ring(weights, others * ep)
    width = layer.gemms[0][0] + layer.gemms[-1][1]
    moved = 2 * layer.rows * width * layer.itemsize * (ep - 1) // ep  # dispatch and combine, forward and back
    counts = layer.num_experts * 8 * (ep - 1) // ep
    ep_bytes = moved + counts + 2 * _ring(weights // ep, others)  # its experts' gradients all-reduced over the rest
    per_expert = max(1, layer.rows // layer.num_experts)
    local = layer.num_experts // ep
    shapes = ", ".join(f"[{{rows}}, {i}] x [{i}, {o // tp}]" for i, o in layer.gemms[:2])
    ep_gemm = f"{local} experts per rank, each " + shapes.format(rows=per_expert * ep)
    dp_gemm = f"{layer.num_experts} experts per rank, each " + shapes.format(rows=per_expert)
    gemm = shapes.format(rows="rows")
    if ep_bytes <= dp_bytes:
        why = (f"the rows' all-to-all moves fewer bytes than gathering every expert on every rank "
               f"({ep_bytes:,} <= {dp_bytes:,}); each rank runs {local} of {layer.num_experts} experts, {gemm}")
        choice = EP_CHOICE
    else:
        why = (f"gathering the experts moves fewer bytes than sending the rows ({dp_bytes:,} < {ep_bytes:,}): "
               f"{layer.rows} rows of width {width} per rank against {weights:,} B of expert weights")
        choice = DP_CHOICE
    return dataclasses.replace(_choice(layer, choice, why), ep_bytes=ep_bytes, dp_bytes=dp_bytes,
                               ep_gemm=ep_gemm, dp_gemm=dp_gemm)


def _choice(layer: ExpertLayer, choice: str, why: str) -> ExpertChoice:
    return ExpertChoice(module=layer.module, weights=layer.weights, num_experts=layer.num_experts, choice=choice,
                        why=why, line=layer.line, rows=layer.rows, width_in=layer.gemms[0][0],
                        width_out=layer.gemms[-1][1], itemsize=layer.itemsize)


def _ring(nbytes: int, ranks: int) -> int:
    """Wire bytes per rank of one all-gather or reduce-scatter of ``nbytes`` over ``ranks``."""
    return nbytes * (ranks - 1) // ranks if ranks > 1 else 0
