"""The handover of a model's parameters to the sharded modules one compile backend made.

Dynamo keeps the model's parameter objects (guards check their type and shape
on every call), so they cannot become the sharded DTensors in place. Once a
graph is sharded, :meth:`Handover.take` records, for this backend only, which
sharded parameter replaces each of the model's parameters, and the model's
parameters are released: their storage is freed at the graph's first call
(:func:`release`), their metadata stays, so guards hold.

Nothing is hooked behind the user's back. What reads the model's parameters
is handed over explicitly (:meth:`Handover.attach`):

* an optimizer built from ``model.parameters()``: a step pre-hook on *that*
  optimizer replaces each released parameter in its param groups by its
  sharded parameter, on every ``step()`` (it may be attached before the first
  call, when nothing is sharded yet);
* the model itself: each of its modules that owns parameters saves and loads
  their shards through its ``state_dict`` hooks, so ``model.state_dict()``
  and ``model.load_state_dict()`` keep working.

An optimizer built from ``model.parameters()`` and *not* attached fails
loudly instead of training nothing: a released parameter's ``.grad`` is a
:class:`ReleasedGradient`, whose use raises a ``RuntimeError`` naming
``backend.attach``, so the optimizer's first ``step()`` raises before it
changes anything. It is not repointed silently: nothing leads from a
parameter to the optimizers holding it but a hook on every optimizer of the
process or a scan of every live object, and an optimizer first touches a
released parameter (reading its gradient) inside its step, after it gathered
its parameters: too late to swap them. The marker is put back at each
backward (:func:`keep_gradients_released`), after a ``zero_grad()`` cleared
it.

A graph dynamo captures again over the same parameters with the same code runs
the same sharded module (:meth:`Handover.sharded_before`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._guards import TracingContext
from torch.utils.weak import WeakIdKeyDictionary

from autoshard.runtime.quantized_gather import master_values
from autoshard.runtime.state_dict import StoredLayout


@dataclasses.dataclass(frozen=True)
class Sharded:
    """What became of one released model parameter."""

    param: nn.Parameter  # the sharded parameter that replaces it
    fqn: str  # its FQN in ``module`` (the model's own)
    code: str  # code of the dynamo graph it was sharded in
    module: fx.GraphModule  # that graph's sharded module
    layout: StoredLayout  # how that module stores it (for the model's own state dict)


class Handover:
    """One backend's map from the model's released parameters to their shards."""

    def __init__(self):
        self._sharded: WeakIdKeyDictionary = WeakIdKeyDictionary()  # model parameter -> Sharded

    def take(self, sharded: fx.GraphModule, originals: dict[str, nn.Parameter], code: str) -> None:
        """Record that the model's parameters ``originals`` (by FQN) are now ``sharded``'s,
        the module made from the dynamo graph ``code``."""
        plan = sharded.autoshard_plan
        layout = StoredLayout.of(plan, plan.mesh.get("tp", 1))
        for fqn, param in sharded.named_parameters(remove_duplicate=False):
            self._sharded[originals[fqn]] = Sharded(param, fqn, code, sharded, layout)

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor in self._sharded

    def attach(self, target):
        """Hand over an optimizer or the model: see the module doc. Returns ``target``."""
        if isinstance(target, torch.optim.Optimizer):
            target.register_step_pre_hook(self._repoint_optimizer)
        elif isinstance(target, nn.Module):
            for module in target.modules():
                if module._parameters and not getattr(module, "_autoshard_state_dict_hooked", False):
                    module._autoshard_state_dict_hooked = True
                    # partials: torch marks a state-dict hook with an attribute, which a bound method refuses
                    module.register_state_dict_post_hook(functools.partial(Handover._save_shards, self))
                    module.register_load_state_dict_pre_hook(functools.partial(Handover._load_shards, self))
                    module.register_load_state_dict_post_hook(_forget_loaded_shards)
        else:
            raise ValueError(
                f"autoshard backend: attach() takes a torch.optim.Optimizer or the compiled nn.Module, "
                f"got {type(target).__name__}"
            )
        return target

    def sharded_before(self, inputs, example_inputs, code: str) -> fx.GraphModule | None:
        """The sharded module of an earlier capture of this very graph; None if none of its parameters
        is sharded.

        Dynamo captures a graph again when a guard fails: grad mode (an evaluation
        under ``torch.no_grad()``), or new input shapes. The same code over the
        same parameters is served by the same sharded module; anything else would
        have to be planned from full weights that are gone, and is refused.
        """
        params = [(fqn, value) for kind, fqn, value in zip(inputs.kinds, inputs.fqns, example_inputs, strict=True)
                  if kind == "parameter"]
        earlier = [(fqn, self._sharded[value]) for fqn, value in params if value in self._sharded]
        if not earlier:
            released = [fqn for fqn, value in params if value.untyped_storage().nbytes() == 0 and value.numel()]
            if released:
                raise ValueError(
                    f"autoshard backend: '{released[0]}' was released by another autoshard backend (its "
                    f"storage is freed); compile each model with one backend object, "
                    f"torch.compile(model, backend=autoshard.backend(mesh))"
                )
            return None
        modules = {id(sharded.module) for _, sharded in earlier}
        if len(earlier) == len(params) and len(modules) == 1 and all(sharded.code == code for _, sharded in earlier):
            return earlier[0][1].module
        raise NotImplementedError(
            f"autoshard backend: '{earlier[0][0]}' was sharded for an earlier graph and dynamo captured a "
            f"different graph reading it (a graph break with reads of it on both sides, a recompile for new "
            f"input shapes, or another code path); keep each parameter's reads within one graph and call the "
            f"compiled model with the input shapes of its first call"
        )

    def _repoint_optimizer(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        """Replace released model parameters in ``optimizer`` by their sharded parameters."""
        for group in optimizer.param_groups:
            params = group["params"]
            for i, param in enumerate(params):
                sharded = self._sharded.get(param)
                if sharded is None:
                    continue
                if optimizer.state.get(param):
                    raise RuntimeError(
                        f"autoshard backend: the optimizer holds state for '{sharded.fqn}' as it was "
                        f"before sharding; build the optimizer before the first step or after the first call"
                    )
                params[i] = sharded.param

    def _released(self, module: nn.Module):
        """(local name, its Sharded) of ``module``'s released parameters."""
        for name, param in module._parameters.items():
            sharded = self._sharded.get(param) if param is not None else None
            if sharded is not None:
                yield name, sharded

    def _save_shards(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
        """Each released parameter's shard in the original layout (a DTensor, as ``autoshard``'s own
        state dict gives) under the user's key."""
        for name, sharded in self._released(module):
            if prefix + name in state_dict:  # else kept out by the module
                master = master_values(sharded.param.detach())
                state_dict[prefix + name] = sharded.layout.to_original(sharded.fqn, master)

    def _load_shards(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                     error_msgs):
        """Send each value of a released parameter to its shard; the freed parameter is left out of
        the copy (it would write into freed storage)."""
        loaded = []
        for name, sharded in self._released(module):
            value = state_dict.pop(prefix + name, None)
            if value is None:
                continue
            sharded.module.load_state_dict({sharded.fqn: value}, strict=False)
            loaded.append(prefix + name)
        module._autoshard_loaded = loaded


def release(params: dict[str, nn.Parameter]) -> list[tuple[nn.Parameter, ReleasedGradient]]:
    """Free the storage of the model's parameters (by FQN) and mark their gradients released.

    Their metadata (guarded by dynamo) stays. A gradient left from before
    sharding is replaced too: an optimizer stepping with it would write into
    the freed storage. Buffers are kept: they are small, and another graph may
    read them too.

    Returns:
        (parameter, its :class:`ReleasedGradient`) for each trained parameter,
        for :func:`keep_gradients_released`.
    """
    marked = []
    for fqn, param in params.items():
        param.detach().untyped_storage().resize_(0)
        if param.requires_grad:
            grad = param.grad if isinstance(param.grad, ReleasedGradient) else ReleasedGradient(param, fqn)
            marked.append((param, grad))
    keep_gradients_released(marked)
    return marked


def keep_gradients_released(marked: list[tuple[nn.Parameter, ReleasedGradient]]) -> None:
    """Put each released parameter's :class:`ReleasedGradient` back where ``zero_grad()`` set it to None."""
    for param, grad in marked:
        if param.grad is not grad:
            param.grad = grad


def released_message(fqn: str) -> str:
    return (
        f"autoshard backend: '{fqn}' is the model's own parameter, which the compiled model took over at its "
        f"first call and released: it no longer trains, and its gradient is on its shard. Hand an optimizer "
        f"built from model.parameters() over with backend.attach(optimizer), or build it from "
        f"backend.parameters() after the first call; read gradients (clipping, logging) from backend.parameters()"
    )


class ReleasedGradient(torch.Tensor):
    """The ``.grad`` of a released model parameter: using it raises a ``RuntimeError`` naming ``backend.attach``.

    Optimizers skip a parameter whose gradient is None, so an optimizer that
    was not attached would step nothing and say nothing. Every torch
    optimizer reads ``p.grad.is_sparse`` before it creates state or touches
    the parameter, so the error comes at its first ``step()``, before
    anything changed (stepping the released parameter itself would write into
    freed storage). It holds no data: a tensor subclass with the parameter's
    metadata, as the ``.grad`` setter requires.

    Two uses are not errors. Zeroing it (``zero_grad(set_to_none=False)`` of
    the model or of an attached optimizer before its first step) does
    nothing. While dynamo traces (the model captured again, e.g. under
    ``torch.no_grad()``), it reads each parameter's gradient's metadata to
    build fake tensors; that is allowed.
    """

    fqn: str

    @staticmethod
    def __new__(cls, param: nn.Parameter, fqn: str):
        grad = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, strides=param.stride(), dtype=param.dtype, device=param.device, requires_grad=False
        )
        grad.fqn = fqn
        return grad

    def __repr__(self) -> str:
        return f"ReleasedGradient('{self.fqn}': the gradient is on its shard, in backend.parameters())"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if TracingContext.try_get() is not None:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func == torch.Tensor.grad_fn.__get__:
            return None
        if func in (torch.Tensor.zero_, torch.Tensor.requires_grad_, torch.Tensor.detach_):
            return args[0]
        raise RuntimeError(released_message(_first_released(args, kwargs).fqn))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(released_message(_first_released(args, kwargs).fqn))


def _first_released(args, kwargs) -> ReleasedGradient:
    return next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, ReleasedGradient))


def _forget_loaded_shards(module, incompatible_keys) -> None:
    """The keys the pre-hook took were loaded into shards: not missing."""
    for key in getattr(module, "_autoshard_loaded", ()):
        if key in incompatible_keys.missing_keys:
            incompatible_keys.missing_keys.remove(key)
    module._autoshard_loaded = []
