"""Verify: the materialized module is exactly what the plan says.

FSDP2 and DTensor choose placements themselves (FSDP2 would silently use
``_StridedShard`` if a tp placement ever landed on dim 0), so after
materializing we read every parameter back and compare its mesh, placements
and stored shape with the plan. A mismatch is a bug in autoshard, reported
with the parameter's FQN rather than surfacing later as wrong numerics.
"""

from __future__ import annotations

import torch.fx as fx
from torch.distributed.tensor import DTensor

from autoshard.core.mesh import MeshAxes
from autoshard.core.sharding import REPLICATED, placements_text
from autoshard.plans.plan import Plan


def verify(sharded: fx.GraphModule, plan: Plan, axes: MeshAxes) -> None:
    for fqn, entry in plan.params.items():
        param = sharded.get_parameter(fqn)
        if tuple(param.shape) != entry.stored_shape:
            raise RuntimeError(
                f"autoshard internal error: '{fqn}' is stored as {list(param.shape)}, "
                f"the plan says {list(entry.stored_shape)}"
            )
        got = _placements_by_axis(param, axes)
        want = {axis: entry.placements[axis] for axis in axes.names}
        if got != want:
            raise RuntimeError(
                f"autoshard internal error: '{fqn}' has placements {placements_text(got)}, the plan says "
                f"{placements_text(want)}"
            )


def _placements_by_axis(param, axes: MeshAxes) -> dict:
    """``{"dp": Shard(0), "tp": Shard(1)}``; an axis the tensor is not on counts as replicated."""
    got = {axis: REPLICATED for axis in axes.names}
    # FSDP's one axis over the data axes flattened (MeshAxes.dp_mesh), and the experts' over those ep
    # leaves (MeshAxes.expert_dp_mesh)
    flattened = {"_".join(group): group for group in (axes.fsdp_axes, axes.expert_fsdp_axes) if len(group) > 1}
    if isinstance(param, DTensor):
        pairs = list(zip(param.device_mesh.mesh_dim_names, param.placements, strict=True))
        for axis, placement in sorted(pairs, key=lambda pair: pair[0] in flattened):  # a flattened axis last
            for name in flattened.get(axis, (axis,)):
                got[name] = placement
    return got
