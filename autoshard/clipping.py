"""Gradient clipping over a sharded module, counting every value once.

``torch.nn.utils.clip_grad_norm_`` over DTensor gradients computes the norm of each gradient's
global tensor. That is the single-device norm for every parameter autoshard stores with plain
placements, but not for a fused projection whose k/v sections are held whole on every tp rank
(``[q|k*|v*]`` in the plan, :class:`~autoshard.plan.FusedSections`): its global stored tensor
holds those columns once per rank, so they would count ``tp`` times. :func:`clip_grad_norm_`
weighs each stored value by how many copies of it exist, replicas over a mesh axis included,
and so returns the single-device norm for every plan.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of ``module`` (an ``autoshard`` result) so that their norm is at most
    ``max_norm``; returns the norm before scaling, the same on every rank."""
    plan = getattr(module, "autoshard_plan", None)
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    params = [(name, p) for name, p in module.named_parameters() if p.grad is not None]
    total, mesh = None, None
    for name, param in params:
        grad = param.grad
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            local = grad.to_local().float()
            weight = _copies_weight(plan, name, grad)
            copies = math.prod(mesh.size(i) for i, p in enumerate(grad.placements) if isinstance(p, Replicate))
        else:
            local, weight, copies = grad.float(), None, 1
        if inf:
            part = local.abs().max() if local.numel() else local.new_zeros(())
        else:
            powered = local.abs() ** norm_type
            part = (powered * weight).sum() if weight is not None else powered.sum()
            part = part / copies
        total = part if total is None else (torch.maximum(total, part) if inf else total + part)
    if total is None:
        return torch.zeros((), device="cpu")
    if mesh is not None:
        for dim in range(mesh.ndim):  # summed (or maxed) over every mesh axis in turn: over the mesh
            dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=mesh.get_group(dim))
    norm = total if inf else total ** (1.0 / norm_type)
    scale = min(1.0, float(max_norm) / (float(norm) + 1e-6))
    if scale < 1.0:
        for _, param in params:
            param.grad.mul_(scale)
    return norm


def _copies_weight(plan, name: str, grad: DTensor) -> torch.Tensor | None:
    """``1 / tp`` on the local columns of whole fused sections (stored once per tp rank), else None."""
    entry = plan.params.get(name) if plan is not None else None
    if entry is None or not entry.whole_sections or "tp" not in grad.device_mesh.mesh_dim_names:
        return None
    tp = grad.device_mesh.size(grad.device_mesh.mesh_dim_names.index("tp"))
    placement = grad.placements[grad.device_mesh.mesh_dim_names.index("tp")]
    if not isinstance(placement, Shard):
        return None
    fused = entry.fused
    weights = torch.cat([torch.full((size,), 1.0 / tp, device="cpu") if i in fused.whole
                         else torch.ones(size // tp, device="cpu")
                         for i, size in enumerate(fused.sizes)])
    shape = [1] * grad.ndim
    shape[placement.dim] = -1
    local = grad.to_local()
    weights = weights.to(local.device).view(shape)
    return weights.expand_as(local)
