"""Predicted communication of one training step, from the plan alone.

``plan.predicted_comm()`` returns ``{axis: {kind: (num_collectives, wire_bytes)}}``
for one steady-state step (forward, backward, optimizer step) at the shapes the
plan was made with, counted as :class:`~autoshard.adapters.comm_stats.CollectiveCounter`
counts a running step (ring-model wire bytes per rank), without running anything:

* **tp**: every collective the plan records (its kind, direction and the
  elements and dtype of the tensor it moves, kept in the record), shared ones
  once. Every activation travels in the dtype it was captured in (``param_dtype``
  under mixed precision, or what the model casts them to); sums of partial values
  too, only their adding is in the policy's ``reduce_dtype``, which on more than
  two tp ranks makes a sum an all-to-all and (for an all-reduce) an all-gather.
* **FSDP** (``dp`` or ``dp_shard``): per FSDP unit, one all-gather before
  forward and, for a block that reshards after forward, one before backward;
  one reduce-scatter of its gradients. Each parameter counts its local shard
  padded as FSDP2 pads it (dim ``k`` rounded up to a multiple of the shard
  degree), in ``param_dtype`` / ``reduce_dtype`` under mixed precision, and a
  weight with a quantized all-gather as its 1-byte values plus one fp32 scale
  per block. A parameter replicated over dp adds one gradient all-reduce per
  dp axis. Under HSDP each unit's reduced shard is all-reduced once over
  ``dp_replicate``. On a mesh with a ``cp`` or ``ep`` axis FSDP shards over ``dp x cp`` (``dp x ep``)
  flattened and its traffic is reported as ``fsdp``; each layer's experts split over ep are one FSDP
  unit over the data axes ep leaves (reported under those axes' name, ``dp``), or, where their module
  holds other weights too, kept whole there with their gradients all-reduced.
* **ep**: per MoE layer split over ep, at balanced routing: the per-expert counts, then the rows out
  and the results back in forward, their gradients back and out in backward (five all-to-alls, each
  rank keeping ``1 / ep`` of what it routes).
* **cp**: every collective the sequence cut records (``plan.context``): per
  all-gather of keys, values or an output the bytes of the whole tensor (its tp
  shard under tp) and, where a gradient flows back, a reduce-scatter as large;
  an all-reduce of a loss's sum or count, twice where a gradient flows.
* The optimizer step of any ``torch.optim`` optimizer on the sharded
  parameters communicates nothing (gradient clipping would).

Activation checkpointing is not modelled (``"full"`` re-runs forward tp
collectives that checkpointing does not stop early).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from autoshard.core.mesh import CP, DP_REPLICATE, EP, TP, MeshAxes, axes_from_sizes, dp_choice
from autoshard.core.sharding import REPLICATED, WIRE_KINDS, Wire, rank_shape, sharded_by_fsdp, sum_on_wire, widens

KINDS = (Wire.ALL_REDUCE, Wire.ALL_GATHER, Wire.REDUCE_SCATTER, Wire.ALL_TO_ALL)


def _ring(kind: str, nbytes: float, ranks: int) -> float:
    if ranks <= 1:
        return 0.0
    share = (ranks - 1) / ranks
    return 2 * share * nbytes if kind == Wire.ALL_REDUCE else share * nbytes


class Tally:
    """Collectives of one training step per mesh axis and kind: counts and ring wire bytes per rank
    (the plan's prediction adds to one; the one-process proof adds what the emitted code runs)."""

    def __init__(self):
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.bytes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def add(self, axis: str, kind: str, nbytes: float, ranks: int, times: int = 1) -> None:
        if ranks <= 1:
            return  # a collective over one rank is not run (FSDP2 on a dp axis of size 1)
        self.counts[axis][kind] += times
        self.bytes[axis][kind] += times * _ring(kind, nbytes, ranks)

    def result(self) -> dict[str, dict[str, tuple[int, int]]]:
        return {axis: {kind: (n, int(round(self.bytes[axis][kind]))) for kind, n in kinds.items()}
                for axis, kinds in self.counts.items()}


def predicted_comm(plan, *, reshard_after_forward: bool = True,
                   master_dtype: torch.dtype = torch.float32) -> dict[str, dict[str, tuple[int, int]]]:
    """See the module docstring. ``reshard_after_forward`` is ``autoshard``'s option of that name;
    ``master_dtype`` the parameters' dtype (the plan records shapes, not dtypes, of parameters)."""
    axes = axes_from_sizes(dict(plan.mesh))
    param_dtype, reduce_dtype = _policy_dtypes(plan)
    tally = Tally()
    if axes.has_tp:
        for sends in _tp_sends(plan, reduce_dtype, axes.tp).values():
            for kind, nbytes in sends:
                tally.add(TP, kind, nbytes, axes.tp)
    if axes.has_dp:
        _fsdp(plan, axes, tally, reshard_after_forward, master_dtype, param_dtype, reduce_dtype)
    for kind, nbytes in (plan.context.collectives if plan.context is not None else ()):  # the sequence cut over cp
        tally.add(CP, kind, nbytes, axes.cp)
    for layer in plan.experts:  # the rows of each MoE layer split over ep, at balanced routing
        for kind, nbytes in layer.exchanges(axes.ep):
            tally.add(EP, kind, nbytes, axes.ep)
    return tally.result()


def tp_traffic_by_unit(plan) -> dict[str, tuple[int, int]] | None:
    """``{unit: (tp collectives, wire bytes)}`` per training step, or None when the plan has no
    tp axis or does not record collective sizes (a version-1 plan, symbolic shapes)."""
    axes = axes_from_sizes(dict(plan.mesh))
    if not axes.has_tp:
        return None
    try:
        sends_by_unit = _tp_sends(plan, _policy_dtypes(plan)[1], axes.tp)
    except ValueError:
        return None
    traffic = {}
    for unit in plan.units:
        tally = Tally()
        for kind, nbytes in sends_by_unit.get(unit, ()):
            tally.add(TP, kind, nbytes, axes.tp)
        kinds = tally.result().get(TP, {})
        traffic[unit] = (sum(n for n, _ in kinds.values()), sum(b for _, b in kinds.values()))
    return traffic


def _policy_dtypes(plan) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(param_dtype, reduce_dtype)`` of the plan's mixed-precision policy (None without one)."""
    mp = plan.mixed_precision
    param_dtype = getattr(torch, mp["param_dtype"]) if mp.get("param_dtype") else None
    reduce_dtype = getattr(torch, mp["reduce_dtype"]) if mp.get("reduce_dtype") else param_dtype
    return param_dtype, reduce_dtype


def _tp_sends(plan, reduce_dtype, tp: int) -> dict[str, list[tuple[str, int]]]:
    """Per FSDP unit, each tp collective a step runs: ``(kind, bytes of the tensor it moves)``."""
    records = [(entry.unit, c) for entry in plan.params.values() for c in entry.collectives]
    records += [(plan.unit_of_activation(i), a) for i, a in enumerate(plan.activations)]
    sends: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for unit, record in records:
        if not record.runs:
            continue
        if record.legacy_text or not record.numel:
            raise ValueError(
                "autoshard: predicted_comm needs each collective's size, which this plan does not record "
                "(a version-1 plan, or symbolic shapes); plan again with static example inputs"
            )
        # captured in param_dtype under mixed precision; sums travel in it too (only their
        # adding is in reduce_dtype, which on more than two ranks takes two collectives)
        moved = getattr(torch, record.dtype)
        widened = widens(moved, reduce_dtype)
        sends[unit] += [(wire, record.numel * moved.itemsize) for kind in WIRE_KINDS[record.kind]
                        for wire in sum_on_wire(kind, widened, tp)]
    return sends


def _fsdp(plan, axes: MeshAxes, tally: Tally, reshard: bool, master, param_dtype, reduce_dtype) -> None:
    # with a cp axis FSDP runs on dp x cp flattened: its traffic is "fsdp", apart from the cp ops' own
    shard_axis, shards = ("fsdp" if axes.has_cp or len(axes.fsdp_axes) > 1 else axes.shard_axis), axes.fsdp_degree
    gathered_dtype = param_dtype or master
    reduced_dtype = reduce_dtype or master
    spec = plan.quant_spec()
    sharded_by_unit = defaultdict(list)
    for fqn, entry in plan.params.items():
        if sharded_by_fsdp(entry.placements) and fqn not in plan.ep_weights():
            sharded_by_unit[entry.unit].append(entry)
    for unit in plan.units:
        gathered = reduced = 0.0
        for entry in sharded_by_unit[unit]:
            numel = math.prod(rank_shape(entry, axes))
            if spec is not None and entry.gather is not None and entry.gather.quantized:
                blocks = math.prod(entry.gather.tile[:-2]) * math.prod(entry.gather.blocks)
                gathered += numel * spec.dtype.itemsize + blocks * torch.float32.itemsize
            else:
                gathered += numel * gathered_dtype.itemsize
            reduced += numel * reduced_dtype.itemsize
        if not reduced:
            continue  # nothing FSDP-managed in this unit
        gathers = 2 if unit and reshard else 1  # the root keeps its parameters until backward
        tally.add(shard_axis, Wire.ALL_GATHER, shards * gathered, shards, gathers)
        tally.add(shard_axis, Wire.REDUCE_SCATTER, shards * reduced, shards)
        if axes.is_hsdp:
            tally.add(DP_REPLICATE, Wire.ALL_REDUCE, reduced, axes.replicas)
    experts, ranks = plan.ep_weights(), math.prod(axes.size(a) for a in axes.expert_fsdp_axes)
    ep_axis = "_".join(axes.expert_fsdp_axes)  # the data axes ep leaves, as one
    for layer in plan.experts:  # a layer's experts as their own FSDP unit over those axes
        if layer.choice == "ep" and layer.fsdp:
            entries = [plan.params[f] for f in layer.weights if sharded_by_fsdp(plan.params[f].placements)]
            gathered = sum(math.prod(rank_shape(e, axes)) for e in entries) * (param_dtype or master).itemsize
            reduced = sum(math.prod(rank_shape(e, axes)) for e in entries) * (reduce_dtype or master).itemsize
            tally.add(ep_axis, Wire.ALL_GATHER, ranks * gathered, ranks, 2 if reshard else 1)
            tally.add(ep_axis, Wire.REDUCE_SCATTER, ranks * reduced, ranks)
            if axes.is_hsdp:
                tally.add(DP_REPLICATE, Wire.ALL_REDUCE, reduced, axes.replicas)
    for fqn, entry in plan.params.items():
        if fqn in experts:
            if not sharded_by_fsdp(entry.placements) or dp_choice(entry.placements) == entry.placements.get(EP):
                # kept whole over the data axes ep leaves: its gradient all-reduced over them
                tally.add(ep_axis, Wire.ALL_REDUCE, math.prod(rank_shape(entry, axes)) * master.itemsize, ranks)
        elif dp_choice(entry.placements) == REPLICATED:
            numel = math.prod(rank_shape(entry, axes))
            for axis in reversed(axes.dp_axes):
                tally.add(axis, Wire.ALL_REDUCE, numel * master.itemsize, axes.size(axis))
