"""Gradient clipping over a sharded module, counting every value once.

``torch.nn.utils.clip_grad_norm_`` over DTensor gradients computes the norm of each gradient's
global tensor. That is the single-device norm for every parameter autoshard stores with plain
placements, but not for a fused projection whose k/v sections are held whole on every tp rank
(``[q|k*|v*]`` in the plan, :class:`~autoshard.plans.plan.FusedSections`): its global stored tensor
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
from torch.utils.weak import WeakIdKeyDictionary


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so that their norm is at most ``max_norm``; returns
    the norm before scaling, the same on every rank. Torch's signature and meaning:
    ``parameters`` is an iterable of tensors (``sharded.parameters()``), one tensor, or a module
    (an ``autoshard`` result: its parameters; a ``Pipeline``: the norm over all its stages, see
    ``Pipeline.clip_grad_norm_``). ``error_if_nonfinite`` raises on a NaN or infinite
    norm, as torch does; ``foreach`` is accepted and has no effect (the norm is summed per tensor).
    """
    del foreach
    if isinstance(parameters, nn.Module) and hasattr(parameters, "pipeline_stages"):  # a norm over every stage
        return parameters.clip_grad_norm_(max_norm, norm_type)
    if isinstance(parameters, nn.Module):
        parameters = parameters.parameters()
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    elif not hasattr(parameters, "__iter__"):
        raise TypeError(
            f"autoshard.clip_grad_norm_: parameters must be an iterable of tensors (model.parameters()), a "
            f"tensor or a module, not {type(parameters).__name__}"
        )
    params = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    total, mesh = None, None
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            local = grad.to_local().float()
            weight = _copies_weight(_ENTRIES.get(param), grad)
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
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"autoshard.clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite "
            f"({float(norm)}), so they cannot be clipped; pass error_if_nonfinite=False to clip anyway"
        )
    scale = min(1.0, float(max_norm) / (float(norm) + 1e-6))
    if scale < 1.0:
        for param in params:
            param.grad.mul_(scale)
    return norm


# each parameter of an autoshard result -> its plan entry (weak: gone with the module)
_ENTRIES = WeakIdKeyDictionary()


def remember_entries(module: nn.Module, plan) -> None:
    """Let :func:`clip_grad_norm_` find the plan entry of each of ``module``'s parameters when it is
    handed the parameters alone (``sharded.parameters()``), as torch's clipping is."""
    for name, param in module.named_parameters():
        entry = plan.params.get(name)
        if entry is not None:
            _ENTRIES[param] = entry


def _copies_weight(entry, grad: DTensor) -> torch.Tensor | None:
    """``1 / tp`` on the local columns of whole fused sections (stored once per tp rank), else None."""
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
