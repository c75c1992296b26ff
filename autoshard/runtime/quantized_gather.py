"""The tensor FSDP2 all-gathers block-quantized: a master-weight shard with FSDP2's extension hooks.

FSDP2 looks for ``fsdp_pre_all_gather``/``fsdp_post_all_gather`` on the local
tensor of each parameter it shards (the tp-local tensor of a DTensor). A
:class:`QuantizedGatherWeight` wraps that tensor: for every op it is the plain
fp32 master shard underneath (the optimizer, ``state_dict``, gradient
clipping see ordinary values), except that

* ops FSDP2 uses to cut, pad and move the shard (``split``, ``slice``,
  ``new_zeros``, ``copy_``, ``view``, ...) keep the wrapper, so the shard FSDP2
  holds still carries the hooks;
* before each all-gather, ``fsdp_pre_all_gather`` quantizes the rank's tile
  block by block (:func:`autoshard.plans.block_quant.quantize_blocks`) and hands
  FSDP2 two tensors, the values as ``uint8`` bytes (gloo cannot gather float8;
  NCCL moves the same bytes) and the fp32 scales; FSDP2 gathers them with the
  other parameters of the unit in one collective;
* after it, ``fsdp_post_all_gather`` dequantizes the gathered blocks into the
  unsharded weight in the compute dtype (``param_dtype`` under mixed
  precision). The matmul's gradient with respect to that weight is
  reduce-scattered as usual: gradients are never quantized.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from autoshard.plans.block_quant import BlockQuant, dequantize_blocks, quantize_blocks

_aten = torch.ops.aten

# Ops whose result is still this parameter's shard (FSDP2 cutting, padding, moving, allocating it):
# the result keeps the hooks. Any other op returns plain tensors.
_KEEPS_WRAPPER = frozenset({
    _aten.split.Tensor, _aten.split_with_sizes.default, _aten.chunk.default, _aten.slice.Tensor,
    _aten.view.default, _aten._unsafe_view.default, _aten.as_strided.default, _aten.alias.default,
    _aten.detach.default, _aten.new_zeros.default, _aten.new_empty.default, _aten.empty_like.default,
    _aten.copy_.default, _aten.clone.default, _aten._to_copy.default, _aten._pin_memory.default,
})


class QuantizedGatherWeight(torch.Tensor):
    """A master-weight shard (``data``) that FSDP2 all-gathers quantized with ``spec``."""

    data_: torch.Tensor
    spec: BlockQuant

    @staticmethod
    def __new__(cls, data: torch.Tensor, spec: BlockQuant):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device=data.device, layout=data.layout, requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor, spec: BlockQuant):
        self.data_ = data
        self.spec = spec

    def __repr__(self) -> str:
        return f"QuantizedGatherWeight({self.spec.label()}, {self.data_!r})"

    def __tensor_flatten__(self):
        return ["data_"], self.spec

    @staticmethod
    def __tensor_unflatten__(inner, spec, outer_size, outer_stride):
        return QuantizedGatherWeight(inner["data_"], spec)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spec = None

        def unwrap(t: QuantizedGatherWeight) -> torch.Tensor:
            nonlocal spec
            spec = t.spec
            return t.data_

        out = func(*pytree.tree_map_only(cls, unwrap, args), **pytree.tree_map_only(cls, unwrap, kwargs))
        if func not in _KEEPS_WRAPPER:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, spec), out)

    # --- FSDP2's all-gather extension ---------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        values, scales = quantize_blocks(self.data_, self.spec)
        return (values.view(torch.uint8), scales), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        values, scales = all_gather_outputs
        weight = dequantize_blocks(values.view(self.spec.dtype), scales, self.spec, param_dtype)
        if out is not None:  # later all-gathers refill the unsharded weight of the first
            target = out.to_local() if isinstance(out, DTensor) else out
            # as FSDP2's own copy-out: the refill (before backward) must not look like an in-place
            # change of a tensor forward saved, which autograd would refuse
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(target):
                target.copy_(weight)
            return None
        return weight, (weight,)


def wrap_for_quantized_gather(param: nn.Parameter, spec: BlockQuant) -> nn.Parameter:
    """``param`` (a tp DTensor or a plain tensor) with its local shard wrapped, before ``fully_shard``."""
    if isinstance(param, DTensor):
        local = QuantizedGatherWeight(param.to_local().detach(), spec)
        wrapped = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                     shape=param.shape, stride=param.stride())
    else:
        wrapped = QuantizedGatherWeight(param.detach(), spec)
    return nn.Parameter(wrapped, requires_grad=param.requires_grad)


def master_values(value: torch.Tensor) -> torch.Tensor:
    """``value`` without the gather hooks: the same master shard as a plain tensor (or a DTensor
    over one), sharing its storage, for state dicts and checkpoints. Other tensors pass through."""
    if isinstance(value, DTensor) and isinstance(value._local_tensor, QuantizedGatherWeight):
        return DTensor.from_local(value._local_tensor.data_, value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    if isinstance(value, QuantizedGatherWeight):
        return value.data_
    return value
