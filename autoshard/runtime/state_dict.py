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

The rest of ``nn.Module``'s state-dict protocol is kept too, so that ``state_dict()``
has exactly the user's model's keys, in its order, and ``load_state_dict(strict=True)``
takes the model's own checkpoints (and the model takes the sharded module's, once its
DTensors are full tensors):

* **Extra state** (``get_extra_state`` / ``set_extra_state``, an ``<fqn>._extra_state``
  entry: fp8 scales, counters, a tokenizer's version). The sharded module runs none of
  the user's modules, so it keeps, for each module of the model that defines extra
  state, a **private copy** of that module: ``copy.deepcopy`` of it with its parameters
  on the meta device (no memory, and never an alias of the user's tensors); buffers
  and other attributes are copied as they are. The module at that FQN in the sharded
  module (created empty where the graph needed none) is given ``get_extra_state`` /
  ``set_extra_state`` that call the copy's, i.e. the user's own code, so torch's
  ``state_dict()`` / ``load_state_dict()`` save, check (missing / unexpected under
  ``strict``) and load the entry as for the user's module, and
  ``sharded.get_submodule(fqn).get_extra_state()`` answers. Why a copy and not the
  user's module: the user's model is never written (parameters and buffers are copied
  too), loading a checkpoint into the sharded module must not change the model it was
  built from, and two sharded modules of one model must not share state. Why not the
  value alone: ``set_extra_state`` may check, convert or spread the value over
  attributes, and ``get_extra_state`` then answers as the user's module would. Extra
  state is metadata, the same on every rank and not sharded: like parameters and
  buffers (``sync_module_states``), every rank takes the first rank's value when the
  module is built (one ``broadcast_object_list``, only for a model that has extra
  state), and its tensors stay plain tensors (DCP saves them once). A
  ``get_extra_state`` that reads parameter values sees the copy's meta tensors: extra
  state must not be derived from weights the sharded module holds as shards. A module
  that ``copy.deepcopy`` refuses keeps its value instead (a warning says so): loading
  replaces it, without calling ``set_extra_state``.
* **The model's state-dict hooks**, run by the root's hooks in torch's order with each
  module's prefix and its own ``local_metadata``: ``register_state_dict_pre_hook``
  (parents first, before anything is saved), ``register_state_dict_post_hook`` /
  ``_register_state_dict_hook`` (children first, after the layout is the original one;
  a returned dict counts for the model's root only, as in torch),
  ``register_load_state_dict_pre_hook`` / ``_register_load_state_dict_pre_hook``
  (parents first, before the entries are brought to the stored layout) and
  ``register_load_state_dict_post_hook`` (children first, after loading, with the
  incompatible keys to edit in place). A hook's ``module`` argument is the module's
  private copy where it has one, else the user's module itself: a hook that writes into
  it writes into the user's model.
* **Order**: entries come out in the model's own ``state_dict()`` order, also where a
  model hook renamed them (a fused ``wqkv`` saved as ``wq``, ``wk``, ``wv``).
  Non-persistent buffers are left out, as torch leaves them out.

Parametrized parameters (``torch.nn.utils.parametrize``, ``parametrizations.weight_norm``)
need nothing here: their tensors are parameters under the model's own FQNs
(``...parametrizations.weight.original0``), saved and loaded as any other.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable, Mapping

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


def install_state_dict_hooks(root: nn.Module, plan: Plan, tp: int, model: nn.Module | None = None,
                             broadcast: Callable[[list], None] | None = None,
                             aliases: Mapping[str, str] | None = None) -> None:
    """``model`` (the user's module) supplies the state dict ``_metadata`` (module versions), its
    key order, its state-dict hooks and its modules' extra state (see the module docstring).
    ``aliases`` (a tied name -> the plan's name) are saved and loaded in the original layout too:
    a stack registered under two names has its transposed weights under both.

    ``broadcast`` (given by ``materialize`` under ``sync_module_states``) replaces a list of
    objects in place by the first rank's: every rank then holds the first rank's extra state.
    """
    layout = StoredLayout.of(plan, tp)
    canonical = dict(aliases or {})
    names_of: dict[str, list[str]] = {}
    for alias, fqn in canonical.items():
        names_of.setdefault(fqn, []).append(alias)
    model_state = model.state_dict() if model is not None else None
    metadata = copy.deepcopy(getattr(model_state, "_metadata", None)) if model is not None else None
    order = {key: i for i, key in enumerate(model_state)} if model is not None else {}
    kept = keep_extra_state(root, model, broadcast) if model is not None else {}
    hooks = _model_hooks(model, kept)

    quantized = bool(plan.all_gather_quant)  # only then do shards carry the gather wrapper

    def run_save_pre_hooks(module, prefix, keep_vars):
        for name, owner, hook in hooks.save_pre:  # parents first, before anything is saved
            hook(owner, prefix + name, keep_vars)

    def to_original_layout(module, state_dict, prefix, local_metadata):
        if quantized:
            for key, value in state_dict.items():
                if not isinstance(value, nn.Parameter):  # keep_vars=True asks for the parameters themselves
                    state_dict[key] = master_values(value)
        for fqn in layout.changed:
            for name in (fqn, *names_of.get(fqn, ())):
                if prefix + name in state_dict:
                    state_dict[prefix + name] = layout.to_original(fqn, state_dict[prefix + name])
        if metadata is not None and hasattr(state_dict, "_metadata"):
            _use_original_metadata(state_dict._metadata, metadata, prefix)
        for name, owner, hook in hooks.save_post:  # the model's own, as its state_dict() runs them
            module_metadata = state_dict._metadata.get((prefix + name)[:-1], {}) if hasattr(
                state_dict, "_metadata") else {}
            result = hook(owner, state_dict, prefix + name, module_metadata)
            if result is not None and result is not state_dict and not name:  # torch: the root's result only
                state_dict.clear()
                state_dict.update(result)
        _in_model_order(state_dict, prefix, order)

    def to_stored_layout(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        metadata_of = getattr(state_dict, "_metadata", None)
        for name, owner, hook in hooks.load_pre:  # the model's own first: they bring its keys to its parameters'
            module_metadata = local_metadata if not name else (
                metadata_of.get((prefix + name)[:-1], {}) if metadata_of is not None else {})
            _call_load_pre_hook(hook, owner, state_dict, prefix + name, module_metadata, strict, missing,
                                unexpected, errors)
        params = dict(module.named_parameters(remove_duplicate=False))  # tied names too
        for fqn, param in params.items():
            key = prefix + fqn
            if key not in state_dict:
                continue
            value = layout.to_stored(canonical.get(fqn, fqn), state_dict[key], param)
            if isinstance(value, str):
                errors.append(f"autoshard: '{key}' {value}")
                continue
            state_dict[key] = value

    def run_load_post_hooks(module, incompatible_keys):
        for _, owner, hook in hooks.load_post:  # children first, after everything is loaded
            if hook(owner, incompatible_keys) is not None:
                raise AssertionError("a load_state_dict post-hook of the model returned a value: it must edit "
                                     "incompatible_keys in place (torch's rule)")

    if hooks.save_pre:
        root.register_state_dict_pre_hook(run_save_pre_hooks)
    root.register_state_dict_post_hook(to_original_layout)
    root.register_load_state_dict_pre_hook(to_stored_layout)
    if hooks.load_post:
        root.register_load_state_dict_post_hook(run_load_post_hooks)


# --- extra state ------------------------------------------------------------------------------


_EXTRA_STATE = "_autoshard_extra_state"  # the attribute of a sharded module holding its ExtraState


def defines_extra_state(module: nn.Module) -> tuple[bool, bool]:
    """Whether ``module``'s class overrides ``get_extra_state`` and ``set_extra_state`` (torch's test:
    it saves an ``_extra_state`` entry for the first and loads one for the second)."""
    cls = type(module)
    return (getattr(cls, "get_extra_state", nn.Module.get_extra_state) is not nn.Module.get_extra_state,
            getattr(cls, "set_extra_state", nn.Module.set_extra_state) is not nn.Module.set_extra_state)


class ExtraState:
    """The extra state the sharded module keeps for one module of the user's model.

    ``module``: a private copy of the user's module (``copy.deepcopy``, its parameters on meta) whose own
    ``get_extra_state`` / ``set_extra_state`` are called; ``None`` when the module could not be
    deep-copied, and ``value`` then holds the state itself.
    """

    def __init__(self, fqn: str, module: nn.Module):
        self.fqn = fqn
        self.value = None
        memo = _parameters_on_meta(module)
        try:
            self.module: nn.Module | None = copy.deepcopy(module, memo)
        except Exception as err:  # a module holding a process group, a stream, a lock, ...
            warnings.warn(
                f"autoshard: module '{fqn}' ({type(module).__name__}) cannot be deep-copied ({err!r}); the sharded "
                f"module keeps its extra state as a value, and load_state_dict replaces that value without calling "
                f"its set_extra_state", stacklevel=3)
            self.module = None
            self.value = _copied(module.get_extra_state()) if defines_extra_state(module)[0] else None

    def get(self):
        return self.module.get_extra_state() if self.module is not None else self.value

    def set(self, state) -> None:
        if self.module is not None:
            self.module.set_extra_state(state)
        else:
            self.value = state


def _get_extra_state(self):
    return self.__dict__[_EXTRA_STATE].get()


def _set_extra_state(self, state) -> None:
    self.__dict__[_EXTRA_STATE].set(state)


def keep_extra_state(root: nn.Module, model: nn.Module,
                     broadcast: Callable[[list], None] | None = None) -> dict[str, ExtraState]:
    """Give ``root`` the extra state of every module of ``model`` that defines it (FQN -> kept state).

    The module at that FQN under ``root`` gets ``get_extra_state`` / ``set_extra_state`` (its class is
    swapped for a subclass that has them; the object, which FSDP2 may hold, stays the same); a path
    the graphs need no module at is created (empty modules), in the model's order, when ``root``
    holds every parameter of the model. A root that holds only some of them (a pipeline stage) keeps
    the extra state of the modules it has. Modules that already keep theirs are left as they are.
    """
    owners = [(fqn, m) for fqn, m in model.named_modules() if any(defines_extra_state(m))]
    if not owners:
        return {}
    held = set(dict(root.named_parameters(remove_duplicate=False)))
    whole = all(fqn in held for fqn, _ in model.named_parameters(remove_duplicate=False))
    kept: dict[str, ExtraState] = {}
    fresh: list[ExtraState] = []
    for fqn, owner in owners:
        target = _module_at(root, fqn, model if whole else None)
        if target is None:
            continue
        if _EXTRA_STATE in target.__dict__:
            kept[fqn] = target.__dict__[_EXTRA_STATE]
            continue
        state = kept[fqn] = ExtraState(fqn, owner)
        fresh.append(state)
        saves, loads = defines_extra_state(owner)
        methods = {"__module__": type(target).__module__, "__qualname__": type(target).__qualname__}
        if saves:
            methods["get_extra_state"] = _get_extra_state
        if loads:
            methods["set_extra_state"] = _set_extra_state
        target.__class__ = type(type(target).__name__, (type(target),), methods)
        target.__dict__[_EXTRA_STATE] = state
    if broadcast is not None and fresh:
        _take_first_ranks(fresh, broadcast)
    return kept


def _parameters_on_meta(module: nn.Module) -> dict:
    """A ``copy.deepcopy`` memo that copies each parameter of ``module`` as a meta tensor of its shape."""
    memo: dict = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        if id(param) not in memo:
            memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    return memo


def _copied(value):
    try:
        return copy.deepcopy(value)
    except Exception:
        return value


def _module_at(root: nn.Module, fqn: str, model: nn.Module | None) -> nn.Module | None:
    """The module at ``fqn`` under ``root``; created (each missing level an empty module, placed
    among its siblings in the model's order) when ``model`` is given, else ``None`` if missing."""
    module = root
    path = ""
    for name in fqn.split(".") if fqn else ():
        path = f"{path}.{name}" if path else name
        child = module._modules.get(name)
        if child is None:
            if model is None:
                return None
            module.add_module(name, nn.Module())
            _follow_siblings(module, model.get_submodule(path.rpartition(".")[0]))
            child = module._modules[name]
        module = child
    return module


def _follow_siblings(module: nn.Module, original: nn.Module) -> None:
    """Order ``module``'s children as ``original``'s (others after them, as they were)."""
    rank = {name: i for i, name in enumerate(original._modules)}
    ordered = sorted(module._modules.items(), key=lambda kv: rank.get(kv[0], len(rank)))
    module._modules.clear()
    module._modules.update(ordered)


def _take_first_ranks(states: list[ExtraState], broadcast: Callable[[list], None]) -> None:
    """Every rank's kept extra state becomes the first rank's (one object broadcast for all)."""
    sent = [state.get() for state in states]
    values = list(sent)
    broadcast(values)
    for state, mine, value in zip(states, sent, values, strict=True):
        if value is not mine:  # the first rank keeps its own objects
            state.set(value)


# --- the model's hooks ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ModelHooks:
    """The model's state-dict hooks as ``(prefix, module, hook)``, each list in the order torch runs it."""

    save_pre: list  # register_state_dict_pre_hook: parents first
    save_post: list  # register_state_dict_post_hook / _register_state_dict_hook: children first
    load_pre: list  # (_)register_load_state_dict_pre_hook: parents first
    load_post: list  # register_load_state_dict_post_hook: children first


def _model_hooks(model: nn.Module | None, kept: Mapping[str, ExtraState] | None = None) -> _ModelHooks:
    """The model's own state-dict hooks, with each module's prefix and the module a hook is given.

    A model that stores one tensor and saves others (a fused ``wqkv`` saved as ``wq``,
    ``wk``, ``wv``) does so in these hooks; the sharded module, whose modules are graphs,
    runs them on its state dicts so they have the model's keys in both directions. The module
    passed to a hook is the private copy kept for the module's extra state, if it has one, else
    the user's module."""
    if model is None:
        return _ModelHooks([], [], [], [])
    kept = kept or {}
    modules = [(name, kept[name].module if name in kept and kept[name].module is not None else module, module)
               for name, module in model.named_modules(remove_duplicate=False)]

    def collect(attribute: str, parents_first: bool) -> list:
        ordered = modules if parents_first else list(reversed(modules))
        return [(f"{name}." if name else "", owner, hook) for name, owner, module in ordered
                for hook in getattr(module, attribute).values()]

    return _ModelHooks(
        save_pre=collect("_state_dict_pre_hooks", True),
        save_post=collect("_state_dict_hooks", False),
        load_pre=collect("_load_state_dict_pre_hooks", True),
        load_post=collect("_load_state_dict_post_hooks", False),
    )


def _call_load_pre_hook(hook, owner: nn.Module, *args) -> None:
    """A load pre-hook as torch calls it, with ``owner`` as the module a ``with_module`` hook takes."""
    if getattr(hook, "with_module", False) and callable(getattr(hook, "hook", None)):
        hook.hook(owner, *args)  # torch's _WrappedHook would pass the user's module
    else:
        hook(*args)


def _in_model_order(state_dict: dict, prefix: str, order: Mapping[str, int]) -> None:
    """Put the entries under ``prefix`` in the model's ``state_dict()`` order (others after, as they were)."""
    if not order:
        return
    mine = [key for key in state_dict if key.startswith(prefix)]
    last = len(order)
    ranked = sorted(mine, key=lambda key: order.get(key[len(prefix):], last))
    if ranked == mine:
        return
    values = {key: state_dict.pop(key) for key in mine}
    for key in ranked:
        state_dict[key] = values[key]


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
