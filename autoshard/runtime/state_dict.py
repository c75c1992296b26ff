"""State dicts in the original model's layout.

The sharded module registers every parameter under its original FQN, but
colwise weights are stored transposed and fused projections with their
output columns permuted. :class:`StoredLayout` converts one entry between
the two layouts; two hooks on the root apply it to every state dict:

* ``state_dict()``: each transposed entry is returned as ``value.t()``. On a
  DTensor that is a view that swaps the placements (``(S(0), S(1))`` on
  ``[in, out]`` becomes ``(S(1), S(0))`` on ``[out, in]``), so no data moves
  and ``full_tensor()`` has the original shape and layout. A fused entry is
  first all-gathered over tp and its columns put back in order (the one case
  that communicates: a permutation is not a placement). The state dict's
  ``_metadata`` (module versions) is the original model's, so a saved full
  state dict is the one the model itself would save.
* ``load_state_dict(sd)``: each incoming entry is brought to the stored layout
  (transposed, permuted) and, when it is a plain (full) tensor, cut into this
  rank's shard of the parameter's DTensor layout (every rank holds the full
  value, so no communication). DTensor entries are redistributed by ``copy_``.

Optimizer state (``exp_avg``, ``momentum_buffer``) lives in the stored layout
too; ``autoshard.adapters.checkpoint`` converts it with the same :class:`StoredLayout`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from autoshard.plans.plan import Plan
from autoshard.runtime.quantized_gather import master_values


@dataclasses.dataclass(frozen=True)
class StoredLayout:
    """How each parameter's stored tensor differs from the original one.

    ``transposed``: FQNs stored as ``W.t()``. ``permuted``: FQN -> (stored dim, the original
    column of each stored one, the first stored column of each original one) of fused
    projections, whose whole sections are stored once per tp rank; a tied parameter is one
    vocab_parallel table and is never transposed or permuted.
    """

    transposed: frozenset[str]
    permuted: Mapping[str, tuple[int, torch.Tensor, torch.Tensor]]  # FQN -> (dim, order, inverse)
    original_shapes: Mapping[str, tuple[int, ...]]

    @classmethod
    def of(cls, plan: Plan, tp: int) -> StoredLayout:
        return cls(
            transposed=frozenset(fqn for fqn, entry in plan.params.items() if entry.transposed),
            permuted={
                fqn: (entry.sharded_dim("tp"), entry.fused.order(tp), entry.fused.inverse(tp))
                for fqn, entry in plan.params.items()
                if entry.sections and tp > 1
            },
            original_shapes={fqn: tuple(entry.shape) for fqn, entry in plan.params.items()},
        )

    @property
    def changed(self) -> tuple[str, ...]:
        """FQNs whose stored tensor is not the original one."""
        return tuple(fqn for fqn in self.original_shapes if self.is_changed(fqn))

    def is_changed(self, fqn: str) -> bool:
        return fqn in self.transposed or fqn in self.permuted

    def to_original(self, fqn: str, value: torch.Tensor) -> torch.Tensor:
        """Stored -> original layout (a view for a transpose; a tp gather for fused sections)."""
        if fqn in self.permuted:
            dim, _, inverse = self.permuted[fqn]
            value = _unpermute(value, dim, inverse)
        return value.t() if fqn in self.transposed else value

    def to_stored(self, fqn: str, value: torch.Tensor, param: torch.Tensor) -> torch.Tensor | str:
        """Original -> stored layout, as a DTensor laid out like ``param`` when ``value`` is plain.

        Returns an error message for a value of the wrong rank; a value of the
        wrong size is returned unconverted, for the caller to report with the original shape.
        """
        given = value
        if fqn in self.transposed:
            if value.dim() != 2:
                return f"must be 2-D, got shape {list(value.shape)}"
            value = value.t()
        if fqn in self.permuted:
            dim, order, inverse = self.permuted[fqn]
            value = value.full_tensor() if isinstance(value, DTensor) else value
            if value.shape[dim] != inverse.numel():
                return given
            value = value.index_select(dim, order.to(value.device))
        if isinstance(param, DTensor) and not isinstance(value, DTensor):
            if tuple(value.shape) != tuple(param.shape):
                return given
            value = distribute_tensor(
                value.detach().to(param.device).contiguous(),
                param.device_mesh,
                param.placements,
                src_data_rank=None,
            )
        return value


def install_state_dict_hooks(root: nn.Module, plan: Plan, tp: int, model: nn.Module | None = None) -> None:
    """``model`` (the user's module) supplies the state dict ``_metadata`` (module versions)."""
    layout = StoredLayout.of(plan, tp)
    metadata = copy.deepcopy(getattr(model.state_dict(), "_metadata", None)) if model is not None else None

    quantized = bool(plan.all_gather_quant)  # only then do shards carry the gather wrapper
    save_hooks, load_hooks = _model_hooks(model)

    def to_original_layout(module, state_dict, prefix, local_metadata):
        if quantized:
            for key, value in state_dict.items():
                if not isinstance(value, nn.Parameter):  # keep_vars=True asks for the parameters themselves
                    state_dict[key] = master_values(value)
        for fqn in layout.changed:
            key = prefix + fqn
            if key in state_dict:
                state_dict[key] = layout.to_original(fqn, state_dict[key])
        if metadata is not None and hasattr(state_dict, "_metadata"):
            _use_original_metadata(state_dict._metadata, metadata, prefix)
        for name, owner, hook in save_hooks:  # the model's own, as its state_dict() runs them
            result = hook(owner, state_dict, prefix + name, state_dict._metadata.get((prefix + name)[:-1], {})
                          if hasattr(state_dict, "_metadata") else {})
            if result is not None and result is not state_dict:
                state_dict.clear()
                state_dict.update(result)

    def to_stored_layout(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for name, hook in load_hooks:  # the model's own first: they bring its keys to its parameters'
            hook(state_dict, prefix + name, local_metadata, strict, missing, unexpected, errors)
        params = dict(module.named_parameters(remove_duplicate=False))  # tied names too
        for fqn, param in params.items():
            key = prefix + fqn
            if key not in state_dict:
                continue
            value = layout.to_stored(fqn, state_dict[key], param)
            if isinstance(value, str):
                errors.append(f"autoshard: '{key}' {value}")
                continue
            state_dict[key] = value

    root.register_state_dict_post_hook(to_original_layout)
    root.register_load_state_dict_pre_hook(to_stored_layout)


def _model_hooks(model: nn.Module | None) -> tuple[list, list]:
    """The model's own state-dict hooks, in the order its ``state_dict()`` and
    ``load_state_dict()`` run them, with each module's prefix: post-save hooks children
    first (``(prefix, module, hook)``), load pre-hooks parents first (``(prefix, hook)``).

    A model that stores one tensor and saves others (a fused ``wqkv`` saved as ``wq``,
    ``wk``, ``wv``) does so in these hooks; the sharded module, whose modules are graphs,
    runs them on its state dicts so they have the model's keys in both directions."""
    if model is None:
        return [], []
    modules = list(model.named_modules(remove_duplicate=False))
    save = [(f"{name}." if name else "", module, hook) for name, module in reversed(modules)
            for hook in module._state_dict_hooks.values()]
    load = [(f"{name}." if name else "", hook) for name, module in modules
            for hook in module._load_state_dict_pre_hooks.values()]
    return save, load


def _use_original_metadata(destination: dict, original: Mapping, prefix: str) -> None:
    """Replace the graph modules' entries under ``prefix`` by the user's model's, in its order."""
    here = prefix[:-1]
    for key in [k for k in destination if k == here or k.startswith(prefix)]:
        del destination[key]
    for key, value in original.items():
        destination[prefix + key if key else here] = dict(value)


def _unpermute(value: torch.Tensor, dim: int, inverse: torch.Tensor) -> torch.Tensor:
    """Gather ``value`` over tp and undo the section permutation of ``dim``."""
    if not isinstance(value, DTensor):
        return value.index_select(dim, inverse.to(value.device))
    mesh = value.device_mesh
    placements = list(value.placements)
    placements[mesh.mesh_dim_names.index("tp")] = Replicate()
    gathered = value.redistribute(mesh, placements).to_local()
    local = gathered.index_select(dim, inverse.to(gathered.device))  # whole sections: their first copy
    shape = list(value.shape)
    shape[dim] = inverse.numel()
    return DTensor.from_local(local, mesh, placements, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())
