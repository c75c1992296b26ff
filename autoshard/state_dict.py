"""State dicts in the original model's layout.

The sharded module registers every parameter under its original FQN, but
colwise weights are stored transposed. Two hooks on the root hide that:

* ``state_dict()``: each transposed entry is returned as ``value.t()``. On a
  DTensor that is a view that swaps the placements (``(S(0), S(1))`` on
  ``[in, out]`` becomes ``(S(1), S(0))`` on ``[out, in]``), so no data moves
  and ``full_tensor()`` has the original shape and layout.
* ``load_state_dict(sd)``: each incoming entry is transposed back if needed
  and, when it is a plain (full) tensor, cut into this rank's shard of the
  parameter's DTensor layout (every rank holds the full value, so no
  communication). DTensor entries are redistributed by ``copy_``.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor


def install_state_dict_hooks(root: nn.Module, transposed: frozenset[str]) -> None:
    def to_original_layout(module, state_dict, prefix, local_metadata):
        for fqn in transposed:
            key = prefix + fqn
            if key in state_dict:
                state_dict[key] = state_dict[key].t()

    def to_stored_layout(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        params = dict(module.named_parameters())
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


