"""The handover of a model's parameters to the sharded module the compile backend made.

Dynamo keeps the model's parameter objects (guards check their type and shape
on every call), so they cannot become the sharded DTensors in place. Once a
graph is sharded (:func:`hand_over`):

* the model's parameters are released: their storage is freed at the first
  call (:func:`release`), their metadata stays, so guards hold;
* each released parameter maps to its sharded parameter (:data:`SHARDED`):
  an optimizer built from ``model.parameters()`` before the first call finds
  the sharded parameters on its next ``step()`` (a global optimizer step
  pre-hook, installed once), and the modules that own released parameters save
  and load their shards through ``state_dict`` hooks;
* a graph dynamo captures again over the same parameters with the same code
  runs the same sharded module (:func:`sharded_before`).
"""

from __future__ import annotations

import dataclasses
import gc

import torch
import torch.fx as fx
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from autoshard.quantized_gather import master_values
from autoshard.state_dict import StoredLayout


@dataclasses.dataclass(frozen=True)
class Sharded:
    """What became of one released model parameter."""

    param: nn.Parameter  # the sharded parameter that replaces it (read by the optimizer hook)
    code: str  # code of the dynamo graph it was sharded in
    module: fx.GraphModule  # that graph's sharded module
    layout: StoredLayout  # how that module stores it (for the model's own state dict)


# released model parameter -> its Sharded
SHARDED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_OPTIMIZER_HOOK = []


def _repoint_optimizer(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Replace released model parameters in ``optimizer`` by their sharded parameters."""
    for group in optimizer.param_groups:
        params = group["params"]
        for i, param in enumerate(params):
            sharded = SHARDED.get(param)
            if sharded is None:
                continue
            replacement = sharded.param
            if optimizer.state.get(param):
                raise RuntimeError(
                    f"autoshard backend: the optimizer holds state for '{replacement.autoshard_fqn}' as it was "
                    f"before sharding; build the optimizer before the first step or after the first call"
                )
            params[i] = replacement


def _install_optimizer_hook() -> None:
    if not _OPTIMIZER_HOOK:
        _OPTIMIZER_HOOK.append(register_optimizer_step_pre_hook(_repoint_optimizer))


def hand_over(sharded: fx.GraphModule, originals: dict[str, nn.Parameter], code: str, skip: tuple) -> None:
    """Map each of the model's parameters (``originals``, by FQN) to its sharded parameter in
    ``sharded`` (made from the dynamo graph ``code``); hook the optimizer step and the owners'
    state dicts. ``skip``: modules not to hook (the graph's own stand-in module)."""
    _install_optimizer_hook()
    plan = sharded.autoshard_plan
    layout = StoredLayout.of(plan, plan.mesh.get("tp", 1))
    for fqn, param in sharded.named_parameters(remove_duplicate=False):
        param.autoshard_fqn = fqn
        SHARDED[originals[fqn]] = Sharded(param, code, sharded, layout)
    _hook_owners_state_dicts({id(p) for p in originals.values()}, skip=skip)


def release(tensors: list[torch.Tensor]) -> None:
    """Free the storage of the model's parameters; their metadata (guarded by dynamo) stays.

    Buffers are kept: they are small, and another graph may read them too.
    """
    for tensor in tensors:
        tensor.detach().untyped_storage().resize_(0)


def sharded_before(inputs, example_inputs, code: str) -> fx.GraphModule | None:
    """The sharded module of an earlier capture of this very graph; None if none of its parameters is sharded.

    Dynamo captures a graph again when a guard fails: grad mode (an evaluation
    under ``torch.no_grad()``), or new input shapes. The same code over the
    same parameters is served by the same sharded module; anything else would
    have to be planned from full weights that are gone, and is refused.
    """
    params = [(fqn, value) for kind, fqn, value in zip(inputs.kinds, inputs.fqns, example_inputs, strict=True)
              if kind == "parameter"]
    earlier = [(fqn, SHARDED[value]) for fqn, value in params if value in SHARDED]
    if not earlier:
        return None
    modules = {id(sharded.module) for _, sharded in earlier}
    if len(earlier) == len(params) and len(modules) == 1 and all(sharded.code == code for _, sharded in earlier):
        return earlier[0][1].module
    raise NotImplementedError(
        f"autoshard backend: '{earlier[0][0]}' was sharded for an earlier graph and dynamo captured a different "
        f"graph reading it (a graph break with reads of it on both sides, a recompile for new input shapes, or "
        f"another code path); keep each parameter's reads within one graph and call the compiled model with "
        f"the input shapes of its first call"
    )


def _hook_owners_state_dicts(released: set[int], skip: tuple[nn.Module, ...]) -> None:
    """Make the user's own modules give and take their released parameters' shards.

    After sharding, the model's parameters are released (their storage freed),
    so ``model.state_dict()`` would return empty tensors and
    ``model.load_state_dict()`` would write into freed storage. The modules that
    own those parameters are found once (dynamo hands the backend tensors, not
    modules), and hooked: saving puts each parameter's shard in the original
    layout (a DTensor, as ``autoshard``'s own state dict gives) under the
    user's key; loading sends each value to its shard and keeps the freed
    parameter out of the copy. Existing checkpoint code keeps working.
    """
    for module in gc.get_objects():
        if not issubclass(type(module), nn.Module) or any(module is m for m in skip):  # type(): no weak proxies
            continue
        owns = any(p is not None and id(p) in released for p in module._parameters.values())
        if owns and not getattr(module, "_autoshard_state_dict_hooked", False):
            module._autoshard_state_dict_hooked = True
            module.register_state_dict_post_hook(_save_shards)
            module.register_load_state_dict_pre_hook(_load_shards)
            module.register_load_state_dict_post_hook(_forget_loaded_shards)


def _released(module: nn.Module):
    """(local name, its Sharded) of ``module``'s released parameters."""
    for name, param in module._parameters.items():
        sharded = SHARDED.get(param) if param is not None else None
        if sharded is not None:
            yield name, sharded


def _save_shards(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for name, sharded in _released(module):
        if prefix + name in state_dict:  # else kept out by the module
            master = master_values(sharded.param.detach())
            state_dict[prefix + name] = sharded.layout.to_original(sharded.param.autoshard_fqn, master)


def _load_shards(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    loaded = []
    for name, sharded in _released(module):
        value = state_dict.pop(prefix + name, None)
        if value is None:
            continue
        sharded.module.load_state_dict({sharded.param.autoshard_fqn: value}, strict=False)
        loaded.append(prefix + name)
    module._autoshard_loaded = loaded


def _forget_loaded_shards(module, incompatible_keys) -> None:
    """The keys the pre-hook took were loaded into shards: not missing."""
    for key in getattr(module, "_autoshard_loaded", ()):
        if key in incompatible_keys.missing_keys:
            incompatible_keys.missing_keys.remove(key)
    module._autoshard_loaded = []
