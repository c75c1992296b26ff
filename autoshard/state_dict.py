"""State dicts in the original model's layout.

The sharded module registers every parameter under its original FQN, but
colwise weights are stored transposed and fused projections with their
output columns permuted. Two hooks on the root hide that:

* ``state_dict()``: each transposed entry is returned as ``value.t()``. On a
  DTensor that is a view that swaps the placements (``(S(0), S(1))`` on
  ``[in, out]`` becomes ``(S(1), S(0))`` on ``[out, in]``), so no data moves
  and ``full_tensor()`` has the original shape and layout. A fused entry is
  first all-gathered over tp and its columns put back in order (the one case
  that communicates: a permutation is not a placement).
* ``load_state_dict(sd)``: each incoming entry is brought to the stored layout
  (transposed, permuted) and, when it is a plain (full) tensor, cut into this
  rank's shard of the parameter's DTensor layout (every rank holds the full
  value, so no communication). DTensor entries are redistributed by ``copy_``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from autoshard.plan import Plan, section_order


def install_state_dict_hooks(root: nn.Module, plan: Plan, tp: int) -> None:
    transposed = {fqn for fqn, entry in plan.params.items() if entry.transposed}
    # a tied parameter is one vocab_parallel table: never transposed or permuted
    permuted = {
        fqn: (entry.sharded_dim("tp"), section_order(entry.sections, tp))
        for fqn, entry in plan.params.items()
        if entry.sections and tp > 1
    }

    def to_original_layout(module, state_dict, prefix, local_metadata):
        for fqn, (dim, order) in permuted.items():
            key = prefix + fqn
            if key in state_dict:
                state_dict[key] = _unpermute(state_dict[key], dim, torch.argsort(order))
        for fqn in transposed:
            key = prefix + fqn
            if key in state_dict:
                state_dict[key] = state_dict[key].t()

    def to_stored_layout(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        params = dict(module.named_parameters(remove_duplicate=False))  # tied names too
        for fqn, param in params.items():
            key = prefix + fqn
            if key not in state_dict:
                continue
            value = state_dict[key]
            if fqn in transposed:
                if value.dim() != 2:
                    errors.append(f"autoshard: '{key}' must be 2-D, got shape {list(value.shape)}")
                    continue
                value = value.t()
            if fqn in permuted:
                dim, order = permuted[fqn]
                value = value.full_tensor() if isinstance(value, DTensor) else value
                if value.shape[dim] != order.numel():
                    continue  # let nn.Module report the size mismatch
                value = value.index_select(dim, order.to(value.device))
            if isinstance(param, DTensor) and not isinstance(value, DTensor):
                if tuple(value.shape) != tuple(param.shape):
                    continue  # let nn.Module report the size mismatch with the original shape
                value = distribute_tensor(
                    value.detach().to(param.device).contiguous(),
                    param.device_mesh,
                    param.placements,
                    src_data_rank=None,
                )
            state_dict[key] = value

    root.register_state_dict_post_hook(to_original_layout)
    root.register_load_state_dict_pre_hook(to_stored_layout)


def _unpermute(value: torch.Tensor, dim: int, inverse: torch.Tensor) -> torch.Tensor:
    """Gather ``value`` over tp and undo the section permutation of ``dim``."""
    if not isinstance(value, DTensor):
        return value.index_select(dim, inverse.to(value.device))
    mesh = value.device_mesh
    placements = list(value.placements)
    placements[mesh.mesh_dim_names.index("tp")] = Replicate()
    gathered = value.redistribute(mesh, placements).to_local()
    local = gathered.index_select(dim, inverse.to(gathered.device))
    return DTensor.from_local(local, mesh, placements, shape=value.shape, stride=value.stride())
