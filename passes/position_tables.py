"""Position tables: this rank's positions as the cut graph reads them.

The cut inserts this rank's global positions once, after the inputs (``cp_positions``). What is
read at those positions besides a value indexed along its own sequence dim (the entries of a dim a
view merged the sequence into, the keys each local query sees under a causal mask) is a table made
from them once, next to them, and read by every layer.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten


class PositionTables:
    """The tables of positions a cut graph reads, cached on the walk (a mixin of
    :class:`autoshard.passes.cut_sequence._Rewriter`)."""

    def _index_for(self, before: int, after: int) -> fx.Node:
        """This rank's entries of a dim of ``before * seq * after``, as an index (cached)."""
        key = (before, after)
        if key not in self.indices:
            index = self.positions
            if before > 1 or after > 1:
                index = self._insert(self.positions.next, _merged_index, (self.positions, self.seq, before, after),
                                     owner=self.positions)
            self.indices[key] = index
        return self.indices[key]

    def _causal_mask(self, start: int, end: int, keys: int) -> fx.Node:
        """Whether local queries ``start:end`` see each of the first ``keys`` keys; made once, next
        to the positions, and read by every layer."""
        key = (start, end, keys)
        if key not in self.masks:
            anchor = self.positions.next
            rows = self._insert(anchor, aten.slice.Tensor, (self.positions, 0, start, end), owner=self.positions)
            self.masks[key] = self._insert(anchor, _causal_mask, (rows, keys), owner=self.positions)
        return self.masks[key]


@torch.fx.wrap
def _merged_index(positions: torch.Tensor, seq: int, before: int, after: int) -> torch.Tensor:
    """This rank's entries of a dim of ``before * seq * after`` (a view merged the sequence in)."""
    outer = torch.arange(before, device=positions.device).unsqueeze(1) * seq + positions.unsqueeze(0)
    inner = torch.arange(after, device=positions.device)
    return (outer.unsqueeze(-1) * after + inner).flatten()


@torch.fx.wrap
def _causal_mask(positions: torch.Tensor, keys: int) -> torch.Tensor:
    """``[len(positions), keys]``: query at global position ``p`` sees keys ``0..p``."""
    return positions.unsqueeze(1) >= torch.arange(keys, device=positions.device).unsqueeze(0)
