"""Materialize: real sharded parameters, FSDP2 per block, original-layout state dicts.

For each parameter of the plan: take the user's tensor, transpose it if the
plan stores it transposed, copy it (the user's model is never written), make
ranks agree (broadcast from rank 0, as DDP does), and wrap it as a DTensor on
the tp axis with its tp placement. Blocks and the root are then handed to
FSDP2's ``fully_shard`` on the dp axis, which adds ``Shard(0)``: every linear
weight ends as ``(Shard(0), Shard(1))``.

The graphs read each parameter through ``.to_local()``: FSDP2 hands the
forward a tp DTensor, the graph computes on the local block with explicit
tp collectives, and ``to_local``'s backward turns the local gradient back
into a tp DTensor for FSDP2 to reduce-scatter over dp.

Parameters with dp placement ``R`` (colwise biases, whose dim 0 is already
cut by tp) stay out of FSDP; their gradients are all-reduced (mean) over dp
right after they are accumulated.

A model built on the meta device has no values to copy. Its parameters are
wrapped and handed to FSDP2 on meta (both only cut shapes), and only then
is each rank's local shard allocated on the mesh's device, uninitialized
(``torch.empty``, as ``nn.Module.to_empty``): no full or tp-sized tensor is
ever allocated, nothing is broadcast, and ``load_state_dict`` fills the
values. Persistent buffers are allocated the same way (the state dict holds
them); a non-persistent buffer the forward reads (a rotary table) has a value
nowhere, so it must be filled on the model before sharding, or it is refused.

A module of the model with extra state (``get_extra_state``) is kept as a private copy
(``autoshard/runtime/state_dict.py``); its state, too, is the first rank's.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from autoshard.core.mesh import EP, TP, MeshAxes, dp_choice
from autoshard.core.meta_model import parameters_on_meta
from autoshard.core.sharding import sharded_by_fsdp
from autoshard.plans.plan import Plan
from autoshard.runtime.graph_parts import Partitioned
from autoshard.runtime.quantized_gather import wrap_for_quantized_gather
from autoshard.runtime.state_dict import install_state_dict_hooks


def materialize(
    part: Partitioned,
    model: nn.Module,
    plan: Plan,
    axes: MeshAxes,
    aliases: dict[str, str],
    *,
    sync_module_states: bool = True,
    reshard_after_forward: bool = True,
    mp_policy=None,
    device: torch.device | None = None,
) -> fx.GraphModule:
    """``device``: where the shards go when ``axes`` has no mesh (a pipeline stage of a pp-only
    mesh runs whole on its rank); else the mesh's device."""
    root = part.root
    _follow_module_order(root, model)
    device = device if axes.mesh is None else torch.device(axes.mesh.device_type)
    _copy_buffers(root, model, device, sync_module_states, axes)
    deferred = parameters_on_meta(model)  # shards are allocated after FSDP2 has cut them
    originals = dict(model.named_parameters())
    experts = plan.ep_weights()
    units = {c.module: c.weights for c in plan.experts if c.choice == "ep" and c.fsdp}  # experts FSDP cuts over dp
    whole_experts = experts - {fqn for weights in units.values() for fqn in weights}  # kept whole over dp
    for fqn, entry in plan.params.items():
        _set(root, fqn, _shard_param(originals[fqn], entry, axes, device, sync_module_states, fqn in experts))
    _wrap_quantized_gathers(root, plan)
    _tie(root, aliases, model)
    transposed = frozenset(f for f, e in plan.params.items() if e.transposed)
    replicated_dp = {fqn for fqn, e in plan.params.items() if not sharded_by_fsdp(e.placements)} - experts
    replicated_dp |= whole_experts
    cast_to = mp_policy.param_dtype if mp_policy is not None and axes.has_dp else None
    for prefix, gm in (("", root), *((f"{b}.", g) for b, g in part.blocks.items()),
                       *((f"{m}.", root.get_submodule(m)) for m in units)):
        _name_param_reads(gm, prefix, transposed)
        if axes.has_tp or experts:
            _read_params_locally(gm)
        if cast_to is not None:
            _cast_reads(gm, prefix, replicated_dp, cast_to)
    _create_tensors_on(root, device)
    if axes.has_dp:
        _apply_fsdp(root, part, plan, axes, replicated_dp, reshard_after_forward, mp_policy, tuple(units))
    if deferred:
        _allocate_local_shards(root, device)
        _tie(root, aliases)
    if axes.has_dp:
        _average_grads_over_dp(root, replicated_dp - experts, axes)
    _average_expert_grads(root, whole_experts, axes)
    sync = sync_module_states and not deferred and axes.mesh is not None and axes.mesh.size() > 1
    broadcast = (lambda values: _broadcast_objects_from_first_rank(values, axes)) if sync else None
    install_state_dict_hooks(root, plan, axes.tp, model, broadcast, aliases)  # extra state: its first rank's, if synced
    return root


def _follow_module_order(module: nn.Module, original: nn.Module) -> None:
    """Order children (and so ``state_dict`` keys) as in the user's model, and give
    plain containers the user's container type, so ``sharded.layers[0]`` works."""
    rank = {name: i for i, name in enumerate(original._modules)}
    ordered = sorted(module._modules.items(), key=lambda kv: rank.get(kv[0], len(rank)))
    module._modules.clear()
    module._modules.update(ordered)
    for name, child in list(module._modules.items()):
        if name not in original._modules or child is None:
            continue
        twin = original._modules[name]
        _follow_module_order(child, twin)
        if type(child) is not nn.Module or list(child._modules) != list(twin._modules):
            continue
        if isinstance(twin, nn.ModuleList):
            module._modules[name] = nn.ModuleList(child._modules.values())
        elif isinstance(twin, nn.ModuleDict):
            module._modules[name] = nn.ModuleDict(child._modules)


def _shard_param(original: torch.Tensor, entry, axes: MeshAxes, device, sync: bool, expert: bool = False
                 ) -> nn.Parameter:
    """A tp DTensor on ``device``, or on meta (shapes only) for a meta ``original``."""
    stored = original.detach()
    stored = stored.t() if entry.transposed else stored
    if entry.sections:
        stored = stored.index_select(entry.sharded_dim(TP), entry.fused.order(axes.tp, stored.device))
    if stored.is_meta:
        stored = stored.contiguous()
    else:
        stored = stored.to(device=device, copy=True).contiguous()
        if sync:
            _broadcast_from_first_rank(stored, axes)
    if expert:
        return nn.Parameter(_split_experts(stored, entry, axes), requires_grad=original.requires_grad)
    if axes.has_tp:
        tp = entry.placements[TP]
        if axes.has_dp and not sharded_by_fsdp(entry.placements):
            dp_replicated = [Replicate()] * (axes.mesh.ndim - 1)
            stored = distribute_tensor(stored, axes.mesh, [*dp_replicated, tp], src_data_rank=None)
        else:
            stored = distribute_tensor(stored, axes.submesh(TP), [tp], src_data_rank=None)
    return nn.Parameter(stored, requires_grad=original.requires_grad)


def _split_experts(stored: torch.Tensor, entry, axes: MeshAxes):
    """An expert weight split whole over ep (``Shard(0)``), cut over tp as planned: a DTensor on the
    ``(ep, tp)`` sub-mesh, replicated over the data axes ep leaves (see
    :mod:`autoshard.driver.ep_axis`)."""
    names = (EP, TP) if axes.has_tp else (EP,)
    mesh = axes.mesh[names] if axes.mesh.ndim > 1 else axes.mesh
    return distribute_tensor(stored, mesh, [entry.placements[a] for a in names], src_data_rank=None)


def _wrap_quantized_gathers(root: nn.Module, plan: Plan) -> None:
    """Give each weight the plan quantizes for FSDP's all-gather the hooks that do it."""
    spec = plan.quant_spec()
    if spec is None:
        return
    for fqn, entry in plan.params.items():
        if entry.gather is not None and entry.gather.quantized:
            _set(root, fqn, wrap_for_quantized_gather(root.get_parameter(fqn), spec))


def _tie(root: nn.Module, aliases: dict[str, str], model: nn.Module | None = None) -> None:
    """A tied parameter: the same Parameter under every name. A module the model registers under
    two names (a stack kept as ``self.layers`` and ``self.blocks``) is one module here too, so FSDP
    sees one unit holding its parameters, not a second module holding them again."""
    if model is not None:
        first: dict[int, str] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            canonical = first.setdefault(id(module), name)
            if canonical != name and _has_module(root, canonical) and not _has_module(root, name):
                *path, last = name.split(".")
                owner = root
                for part in path:
                    if not hasattr(owner, part):
                        owner.add_module(part, nn.Module())
                    owner = getattr(owner, part)
                owner.add_module(last, root.get_submodule(canonical))
    for alias, canonical in aliases.items():
        _set(root, alias, root.get_parameter(canonical))


def _has_module(root: nn.Module, fqn: str) -> bool:
    try:
        root.get_submodule(fqn)
    except AttributeError:
        return False
    return True


def _set(root: nn.Module, fqn: str, param: nn.Parameter) -> None:
    *path, name = fqn.split(".")
    owner = root
    for part in path:  # a tied name's module may not exist in the graph's modules yet
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    if name in owner._parameters:
        owner._parameters[name] = param
    else:
        owner.register_parameter(name, param)


def _copy_buffers(root: nn.Module, model: nn.Module, device, sync: bool, axes: MeshAxes) -> None:
    """Fresh copies of the buffers the graph reads, persistent exactly as in the model.

    Constants the capture lifted out of the forward (``torch.tensor(...)`` in
    the code) are buffers of the graph but not of the model: non-persistent,
    so ``state_dict()`` has the model's keys and nothing else.

    A persistent buffer on meta is allocated uninitialized, for
    ``load_state_dict`` to fill; a non-persistent one on meta is refused.
    """
    model_buffers = dict(model.named_buffers())
    persistent = set(model.state_dict(keep_vars=True))
    graph_buffers = [(fqn, model_buffers.get(fqn, buffer)) for fqn, buffer in root.named_buffers()]
    _refuse_buffers_without_values([fqn for fqn, b in graph_buffers if b.is_meta and fqn not in persistent])
    for fqn, buffer in graph_buffers:
        owner_path, _, name = fqn.rpartition(".")
        owner = root.get_submodule(owner_path)
        if buffer.is_meta:
            value = torch.empty_like(buffer, device=device)
        else:
            own = root.get_buffer(fqn)  # as the graph reads it: floating buffers in buffer_dtype, if given
            dtype = own.dtype if own.is_floating_point() and buffer.is_floating_point() else buffer.dtype
            value = buffer.detach().to(device=device, dtype=dtype, copy=True)
            if sync and value.is_floating_point():
                _broadcast_from_first_rank(value, axes)
        owner.register_buffer(name, value, persistent=fqn in persistent)


def _broadcast_from_first_rank(value: torch.Tensor, axes: MeshAxes) -> None:
    """Give every rank of the mesh the value of its first rank (DDP's ``sync_module_states``).

    A mesh that is the whole job takes one broadcast; one that covers part of it
    (the rest of the job runs another stage or another model) takes one per mesh
    axis, each from coordinate 0 of that axis: the ranks outside never join.
    """
    mesh = axes.mesh
    if mesh is None or mesh.size() == 1:  # a pp-only stage: its one rank holds it
        return
    if mesh.size() == dist.get_world_size():
        dist.broadcast(value, src=0)
        return
    for axis in mesh.mesh_dim_names:
        dist.broadcast(value, group=mesh.get_group(axis), group_src=0)


def _broadcast_objects_from_first_rank(values: list, axes: MeshAxes) -> None:
    """``values`` (picklable objects: the modules' extra state) replaced in place by the first rank's,
    over the same groups as :func:`_broadcast_from_first_rank`."""
    mesh = axes.mesh
    if mesh.size() == dist.get_world_size():
        dist.broadcast_object_list(values, src=0)
        return
    for axis in mesh.mesh_dim_names:
        dist.broadcast_object_list(values, group=mesh.get_group(axis), group_src=0)


def _refuse_buffers_without_values(fqns: list[str]) -> None:
    if fqns:
        raise ValueError(
            f"autoshard: non-persistent buffer(s) {', '.join(repr(f) for f in fqns)} are on the meta device: "
            f"the forward reads them but no state dict holds them, so they have no value anywhere. Fill them "
            f"on the model before autoshard (e.g. `model.get_submodule(path).name = tensor`, computed as the "
            f"module's __init__ does)"
        )


def _cast_reads(gm: fx.GraphModule, prefix: str, fqns: set[str], dtype: torch.dtype) -> None:
    """Cast each read of a floating parameter in ``fqns`` to ``dtype``.

    Under mixed precision FSDP2 casts the parameters it manages; the ones it
    ignores (replicated over dp, e.g. a colwise bias) would stay fp32 and turn
    every activation they touch back to fp32. The cast's backward returns the
    gradient in the parameter's own dtype, as FSDP2's does.
    """
    params = dict(gm.named_parameters())
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or prefix + node.target not in fqns or not params[node.target].is_floating_point():
            continue
        read = next((u for u in node.users if u.op == "call_method" and u.target == "to_local"), node)
        with gm.graph.inserting_after(read):
            cast = gm.graph.call_method("to", (read, dtype))
        read.replace_all_uses_with(cast, delete_user_cb=lambda user, cast=cast: user is not cast)
        cast._rename(f"{read.name}_{str(dtype).removeprefix('torch.')}")
        cast.meta.update({k: v for k, v in read.meta.items() if k != "val"})
    gm.graph.lint()
    gm.recompile()


def _create_tensors_on(root: fx.GraphModule, device: torch.device) -> None:
    """Tensors the forward creates (``torch.arange(..., device=x.device)``) on ``device``,
    not on the meta device a meta model was captured on; also inside nested graphs
    (the body of an autocast region)."""

    def place(arg):
        return device if isinstance(arg, torch.device) and arg.type == "meta" else arg

    for gm in root.modules():
        if isinstance(gm, fx.GraphModule):
            for node in gm.graph.nodes:
                node.args = pytree.tree_map(place, node.args)
                node.kwargs = pytree.tree_map(place, node.kwargs)
            gm.recompile()


def _allocate_local_shards(root: nn.Module, device: torch.device) -> None:
    """Every parameter still on meta becomes its local shard on ``device``, uninitialized.

    ``nn.Module._apply`` is what ``to_empty`` runs; FSDP2 modules re-register
    their sharded parameters after it. Buffers are real by now and kept.
    """
    with torch.no_grad():
        root._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)


def _name_param_reads(gm: fx.GraphModule, prefix: str, transposed: frozenset[str]) -> None:
    """Name each parameter read by its FQN relative to ``gm``, ``_t`` when stored transposed."""
    params = dict(gm.named_parameters())
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in params:
            suffix = "_t" if prefix + node.target in transposed else ""
            node._rename(node.target.replace(".", "_") + suffix)


def _read_params_locally(gm: fx.GraphModule) -> None:
    """Insert ``param.to_local()`` after every read of a DTensor parameter."""
    params = dict(gm.named_parameters())
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or not isinstance(params.get(node.target), DTensor):
            continue
        with gm.graph.inserting_after(node):
            local = gm.graph.call_method("to_local", (node,))
        node.replace_all_uses_with(local, delete_user_cb=lambda user, local=local: user is not local)
        local._rename(f"{node.name}_local")
        local.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    gm.graph.lint()


def _apply_fsdp(
    root, part: Partitioned, plan: Plan, axes: MeshAxes, replicated_dp: set, reshard: bool, mp_policy=None,
    expert_units: tuple[str, ...] = (),
):
    dp_mesh = axes.dp_mesh()  # 2-D under HSDP: FSDP2 shards over dp_shard, replicates over dp_replicate
    params = dict(root.named_parameters())
    ignored = {params[f] for f in replicated_dp if f in params}
    experts = plan.ep_weights()
    expert_shard_axis = axes.expert_fsdp_axes[0] if axes.expert_fsdp_axes else None
    dp_dim = {  # an expert's FSDP cut is on the data axes ep leaves, not on ep's whole experts
        params[fqn]: entry.placements.get(expert_shard_axis) if fqn in experts else dp_choice(entry.placements)
        for fqn, entry in plan.params.items()
        if sharded_by_fsdp(entry.placements)
    }

    def shard_dim(param):  # S(1) where tp already cuts dim 0 (a tied vocabulary table)
        return dp_dim.get(param)

    policy = {"mp_policy": mp_policy} if mp_policy is not None else {}

    for module in expert_units:  # each MoE layer's experts split over ep, cut by FSDP over the data axes ep leaves
        experts = root.get_submodule(module)
        own = {p for p in experts.parameters() if p in ignored}
        fully_shard(experts, mesh=axes.expert_dp_mesh(), reshard_after_forward=reshard, ignored_params=own or None,
                    shard_placement_fn=shard_dim, **policy)
    for gm in part.blocks.values():
        own = {p for p in gm.parameters() if p in ignored}
        fully_shard(gm, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=own or None,
                    shard_placement_fn=shard_dim, **policy)
    # The root keeps its parameters between forward and backward (FSDP2 default for the root):
    # the head runs first in backward and would re-gather immediately.
    fully_shard(root, mesh=dp_mesh, reshard_after_forward=False, ignored_params=ignored or None,
                shard_placement_fn=shard_dim, **policy)
    root.register_forward_hook(_reshard_after_inference)


def _reshard_after_inference(root: nn.Module, args, output) -> None:
    """Release the parameters kept gathered for a backward that a forward without autograd never has.

    While gathered, FSDP2 registers the gathered tensors as the module's
    parameters: an optimizer built from ``parameters()`` after an evaluation
    forward would train copies, silently. A forward with autograd on and no
    backward still leaves them gathered until the next backward (FSDP2's contract).
    """
    if not torch.is_grad_enabled():
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def _average_grads_over_dp(root: nn.Module, replicated_dp: set[str], axes: MeshAxes) -> None:
    """Gradients of the parameters FSDP2 ignores (dp placement ``R``), averaged as FSDP2's.

    Under HSDP the sum runs over ``dp_shard`` and then ``dp_replicate``, the
    order FSDP2 reduces its own gradients in, and is divided by both sizes. A
    frozen parameter (a LoRA base's colwise bias) has no gradient to average.
    """
    groups = axes.dp_groups()
    params = dict(root.named_parameters())
    for param in {params[f] for f in replicated_dp if f in params and params[f].requires_grad}:
        param.register_post_accumulate_grad_hook(lambda p, groups=groups: _average_grad(p, groups))


def _average_expert_grads(root: nn.Module, experts: set[str], axes: MeshAxes) -> None:
    """Gradients of the experts split over ep, averaged over the data axes ep leaves (each such
    rank holds the same experts and routed other tokens to them); over ep itself they already are
    (see :func:`autoshard.runtime.token_dispatch.ep_combine`'s ``grad_share``)."""
    if not experts or not axes.expert_fsdp_axes:
        return
    groups = axes.expert_dp_groups()
    params = dict(root.named_parameters())
    for param in {params[f] for f in experts if f in params and params[f].requires_grad}:
        param.register_post_accumulate_grad_hook(lambda p, groups=groups: _average_grad(p, groups))


def _average_grad(param: torch.Tensor, groups) -> None:
    grad = param.grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    for group in groups:
        dist.all_reduce(local, group=group)
    local.div_(math.prod(dist.get_world_size(g) for g in groups))
