"""The ranks a proof simulates side by side: an N-D grid named by mesh axes.

A proof runs every rank of the mesh axes that cut values inside one step (``ep``, ``cp`` and
``tp``) in one process. The grid numbers them
row-major in the mesh's axis order, as a ``DeviceMesh`` does: on ``cp x tp`` rank ``i`` is cp
rank ``i // tp`` and tp rank ``i % tp``. A collective of one axis combines the values of the
ranks that differ only in that axis's coordinate (:meth:`RankGrid.groups`), as the axis's
process groups do on a real mesh. Axes whose ranks never talk within a step (dp, pp) are not
on the grid: FSDP2's collectives are its own, and pipeline stages run one after another.
"""

from __future__ import annotations

import dataclasses
import math

from autoshard.core.mesh import _ORDER


@dataclasses.dataclass(frozen=True)
class RankGrid:
    """``sizes``: ``(axis, size)`` pairs in mesh order; an axis of size 1 is left out."""

    sizes: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, **sizes: int) -> RankGrid:
        """The grid of ``sizes`` (``RankGrid.of(cp=2, tp=4)``), its axes put in mesh order."""
        unknown = set(sizes) - set(_ORDER)
        assert not unknown, f"not mesh axes: {sorted(unknown)}"
        return cls(tuple((axis, sizes[axis]) for axis in _ORDER if sizes.get(axis, 1) > 1))

    @property
    def ranks(self) -> int:
        return math.prod(n for _, n in self.sizes)

    def size(self, axis: str) -> int:
        return dict(self.sizes).get(axis, 1)

    def coordinate(self, rank: int, axis: str) -> int:
        """``rank``'s index along ``axis`` (0 for an axis not on the grid)."""
        inner = 1
        for name, n in reversed(self.sizes):
            if name == axis:
                return (rank // inner) % n
            inner *= n
        return 0

    def groups(self, axis: str) -> list[list[int]]:
        """The ranks of each process group of ``axis``: those that share every other coordinate,
        ordered by their ``axis`` coordinate (a group's rank order on a real mesh)."""
        if axis not in dict(self.sizes):
            return [[r] for r in range(self.ranks)]
        others = [name for name, _ in self.sizes if name != axis]
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.ranks):
            key = tuple(self.coordinate(rank, name) for name in others)
            groups.setdefault(key, []).append(rank)
        return [groups[key] for key in sorted(groups)]

    def ranks_where(self, **coordinates: int) -> list[int]:
        """The ranks at the given coordinates (``ranks_where(tp=1)``: every rank of tp rank 1)."""
        return [r for r in range(self.ranks) if all(self.coordinate(r, a) == c for a, c in coordinates.items())]

    def __iter__(self):
        return iter(range(self.ranks))
