"""Count collectives and their wire bytes, per mesh axis.

``CollectiveCounter`` is a ``TorchDispatchMode``: it sees every collective that
reaches the dispatcher, whether autoshard's graph issued it (functional
collectives inside the ``autoshard::*`` ops), FSDP2 (c10d ``_allgather_base_`` /
``_reduce_scatter_base_``) or DTensor. The ``autoshard::*`` ops are counted as the collective they run in forward
(their backward collectives are functional collectives and counted as such).
Each is attributed to the mesh axis whose
process group it ran on, so tp and dp traffic are reported apart.

Wire bytes are what one rank sends under the ring algorithm, the usual cost
model for bandwidth-bound collectives on ``p`` ranks:

* all-reduce of ``N`` bytes: ``2 (p-1)/p * N``
* all-gather producing ``N`` bytes, reduce-scatter consuming ``N`` bytes,
  all-to-all of ``N`` bytes: ``(p-1)/p * N``
* broadcast / scatter of ``N`` bytes: ``(p-1)/p * N``

An all-to-all whose split sizes are known (expert parallelism's rows: ``autoshard::ep_dispatch`` and
``ep_combine``, and the functional ``all_to_all_single`` their backwards run) counts the bytes it
actually sends to other ranks, which the ring model's ``(p-1)/p * N`` equals when routing is balanced.
Each dispatch also keeps the rows each of this rank's experts received (:meth:`expert_rows`): the
load imbalance of that step.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

import autoshard.runtime.collectives  # noqa: F401  (defines torch.ops.autoshard.*)
import autoshard.runtime.context_ops  # noqa: F401  (defines torch.ops.autoshard.cp_*)
import autoshard.runtime.token_dispatch  # noqa: F401  (defines torch.ops.autoshard.ep_*)
from autoshard.core.sharding import Wire, sum_on_wire, widens

_funcol = torch.ops._c10d_functional
_c10d = torch.ops.c10d

# op overload packet -> (kind, index of the process-group/name argument)
_AUTOSHARD = {
    torch.ops.autoshard.reduce_partial: (Wire.ALL_REDUCE, 1),
    torch.ops.autoshard.gather_shards: (Wire.ALL_GATHER, 2),
    torch.ops.autoshard.reduce_scatter_partial: (Wire.REDUCE_SCATTER, 2),
    torch.ops.autoshard.gather_for_colwise: (Wire.ALL_GATHER, 2),
    torch.ops.autoshard.cp_gather: (Wire.ALL_GATHER, 3),
    torch.ops.autoshard.cp_all_reduce: (Wire.ALL_REDUCE, 2),
}
_FUNCTIONAL = {
    _funcol.all_reduce: (Wire.ALL_REDUCE, 2),
    _funcol.all_gather_into_tensor: (Wire.ALL_GATHER, 2),
    _funcol.reduce_scatter_tensor: (Wire.REDUCE_SCATTER, 3),
    _funcol.all_to_all_single: (Wire.ALL_TO_ALL, 3),
    # the in-place and out= forms inductor lowers them to
    _funcol.all_reduce_: (Wire.ALL_REDUCE, 2),
    _funcol.all_gather_into_tensor_out: (Wire.ALL_GATHER, 2),
    _funcol.reduce_scatter_tensor_out: (Wire.REDUCE_SCATTER, 3),
}
_C10D = {
    _c10d.allreduce_: (Wire.ALL_REDUCE, 1),
    _c10d._allgather_base_: (Wire.ALL_GATHER, 2),
    _c10d.allgather_: (Wire.ALL_GATHER, 2),
    _c10d._reduce_scatter_base_: (Wire.REDUCE_SCATTER, 2),
    _c10d.reduce_scatter_: (Wire.REDUCE_SCATTER, 2),
    _c10d.broadcast_: ("broadcast", 1),
    _c10d.alltoall_base_: (Wire.ALL_TO_ALL, 2),
}


@dataclasses.dataclass(frozen=True)
class CollectiveStats:
    """Collectives seen on one mesh axis."""

    axis: str
    counts: dict[str, int]
    wire_bytes: int

    @property
    def num_collectives(self) -> int:
        return sum(self.counts.values())


def _size_of(group_name: str) -> int:
    return dist.get_world_size(_resolve_process_group(group_name))


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _dtype(t) -> torch.dtype | None:
    if isinstance(t, (list, tuple)):
        return _dtype(t[0]) if t else None
    return t.dtype if isinstance(t, torch.Tensor) else None


def _sent_elsewhere(rows: torch.Tensor, splits, group_name: str) -> float:
    """Bytes of ``rows`` (split ``splits`` rows per destination rank) that leave this rank."""
    splits = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
    me = dist.get_rank(_resolve_process_group(group_name))
    row_bytes = rows[0].numel() * rows.element_size() if rows.shape[0] else 0
    return float((sum(splits) - splits[me]) * row_bytes)


def _wire_bytes(kind: str, nbytes: int, group_size: int) -> float:
    if group_size <= 1:
        return 0.0
    share = (group_size - 1) / group_size
    return 2 * share * nbytes if kind == Wire.ALL_REDUCE else share * nbytes


class CollectiveCounter(TorchDispatchMode):
    """Record collectives per mesh axis while active.

    ``axes`` maps an axis name to its process group, e.g.
    ``{name: mesh.get_group(name) for name in mesh.mesh_dim_names}``.
    Collectives on any other group are recorded under ``"other"``.
    """

    def __init__(self, axes: dict[str, dist.ProcessGroup]):
        super().__init__()
        self._axis_by_group_name = {g.group_name: a for a, g in axes.items()}
        self._size_by_axis = {a: g.size() for a, g in axes.items()}
        self._counts: dict[str, Counter] = {a: Counter() for a in axes}
        self._bytes: dict[str, float] = {a: 0.0 for a in axes}
        self._dtypes: dict[str, Counter] = {a: Counter() for a in axes}
        self._bytes_by_kind: dict[str, Counter] = {a: Counter() for a in axes}
        self._expert_rows: list[list[int]] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Off while dynamo compiles, on while compiled code runs.

        Dynamo refuses to trace under a dispatch mode that wants every eager
        op; compiled graphs still call their collectives through the
        dispatcher, so they are counted.
        """
        return True

    def _record(self, kind: str, group, payload, dtype: torch.dtype | None = None, wire: float | None = None) -> None:
        if not isinstance(group, str):  # c10d ops carry the ProcessGroup as a ScriptObject
            group = dist.ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else group
            group = group.group_name
        axis = self._axis_by_group_name.get(group, "other")
        self._counts.setdefault(axis, Counter())[kind] += 1
        size = self._size_by_axis.get(axis) or _size_of(group)
        nbytes = _nbytes(payload)
        if dtype is not None and isinstance(payload, torch.Tensor):
            nbytes = payload.numel() * dtype.itemsize
        sent = _wire_bytes(kind, nbytes, size) if wire is None else wire
        self._bytes[axis] = self._bytes.get(axis, 0.0) + sent
        self._bytes_by_kind.setdefault(axis, Counter())[kind] += sent
        dtype = dtype or _dtype(payload)
        self._dtypes.setdefault(axis, Counter())[(kind, str(dtype).removeprefix("torch."))] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet is torch.ops.autoshard.cp_causal_attention:  # all-gathers k and v inside
            for local in args[1:3]:  # the gathered tensor's size, on meta: nothing allocated
                self._record(Wire.ALL_GATHER, args[4],
                             torch.empty(local.numel() * args[3], dtype=local.dtype, device="meta"))
        elif packet in _AUTOSHARD:  # its collective runs below this mode: count the op itself
            kind, group_index = _AUTOSHARD[packet]
            payload = out if kind == Wire.ALL_GATHER else args[0]
            # a sum added in the op's reduce_dtype (mixed precision) travels in its own dtype, on
            # more than two ranks as an all-to-all (and an all-gather): autoshard.runtime.collectives
            reduce_dtype = args[group_index + 1] if len(args) > group_index + 1 else kwargs.get("reduce_dtype")
            widened = widens(payload.dtype, reduce_dtype)
            for wire in sum_on_wire(kind, widened, _size_of(args[group_index])):
                self._record(wire, args[group_index], payload)
        elif packet is torch.ops.autoshard.ep_dispatch:
            rows, num_experts, group = args[0], args[2], args[3]
            self._record(Wire.ALL_TO_ALL, group, torch.empty(num_experts, dtype=torch.int64, device="meta"))
            self._record(Wire.ALL_TO_ALL, group, rows, wire=_sent_elsewhere(rows, out[5], group))
            self._expert_rows.append(torch.diff(out[2], prepend=out[2].new_zeros(1)).tolist())
        elif packet is torch.ops.autoshard.ep_combine:
            rows, group = args[0], args[5]
            self._record(Wire.ALL_TO_ALL, group, rows, wire=_sent_elsewhere(rows, args[4], group))
        elif packet is _funcol.all_to_all_single and args[2]:  # its input's rows per destination
            self._record(Wire.ALL_TO_ALL, args[3], args[0], wire=_sent_elsewhere(args[0], args[2], args[3]))
        elif packet in _FUNCTIONAL:
            kind, group_index = _FUNCTIONAL[packet]
            payload = out if kind == Wire.ALL_GATHER else args[0]
            self._record(kind, args[group_index], payload)
        elif packet in _C10D:
            kind, group_index = _C10D[packet]
            payload = args[0]  # output tensor(s) for gathers, input for the rest
            if kind == Wire.REDUCE_SCATTER:
                payload = args[1]
            self._record(kind, args[group_index], payload)
        return out

    def stats(self) -> dict[str, CollectiveStats]:
        return {
            axis: CollectiveStats(axis, dict(counts), int(round(self._bytes.get(axis, 0.0))))
            for axis, counts in self._counts.items()
        }

    def wire_bytes(self, axis: str, kind: str) -> int:
        """Wire bytes per rank of one kind of collective on ``axis`` (ring model)."""
        return int(round(self._bytes_by_kind.get(axis, Counter())[kind]))

    def dtypes(self, axis: str) -> dict[tuple[str, str], int]:
        """``(kind, dtype name) -> count`` of the collectives on ``axis``."""
        return dict(self._dtypes.get(axis, Counter()))

    def expert_rows(self) -> list[list[int]]:
        """Per expert-parallel dispatch seen, the rows each of this rank's experts received (in
        order); their spread over the ranks of a step is its load imbalance."""
        return [list(rows) for rows in self._expert_rows]

    def count(self, axis: str) -> int:
        return sum(self._counts.get(axis, Counter()).values())
