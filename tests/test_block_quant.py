"""Blockwise quantization in one process: the format's math, the plan's per-weight decisions,
and the wrapper FSDP2 gathers through (its hooks called directly, as FSDP2 calls them)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import autoshard
from autoshard import BlockQuant, Plan
from autoshard.plans.block_quant import block_amax, dequantize_blocks, quantize_blocks
from autoshard.runtime.quantized_gather import QuantizedGatherWeight, master_values, wrap_for_quantized_gather
from examples.models import Llama, LlamaConfig, MLPStack
from tests.cases import FEATURES, TOKENS

FORMATS = [BlockQuant(torch.float8_e4m3fn, 16), BlockQuant(torch.float8_e5m2, (8, 16)), BlockQuant(torch.int8, 16)]


@pytest.mark.parametrize("spec", FORMATS, ids=lambda s: s.label())
def test_every_block_is_within_the_format_bound(spec):
    """Blocks of very different magnitudes (1e-4 .. 1e3) and an all-zero block: each block's
    error is within its own bound, so one block's outlier cannot spoil another's precision."""
    torch.manual_seed(0)
    rows, cols = spec.shape
    x = torch.randn(4 * rows, 3 * cols)
    scale = torch.logspace(-4, 3, 12).reshape(4, 3).repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    x = x * scale
    x[:rows, :cols] = 0
    values, scales = quantize_blocks(x, spec)
    assert values.dtype == spec.dtype and scales.shape == (4, 3) and scales.dtype == torch.float32
    back = dequantize_blocks(values, scales, spec, torch.float32)
    bound = spec.block_error_bound(block_amax(x, spec))
    error = block_amax(back - x, spec)
    assert (error <= bound).all(), (error / bound.clamp_min(1e-30)).max()
    assert torch.equal(back[:rows, :cols], x[:rows, :cols])
    assert error.max() > 0  # quantized, not passed through


def test_stacked_weights_are_blocked_per_leading_index():
    spec = BlockQuant(torch.float8_e4m3fn, 8)
    x = torch.randn(3, 16, 8)
    x[1] *= 1000
    values, scales = quantize_blocks(x, spec)
    assert scales.shape == (3, 2, 1)
    assert (scales[1] > 100 * scales[0]).all()
    back = dequantize_blocks(values, scales, spec, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    assert ((back.float() - x).abs().amax(dim=(1, 2)) <= spec.block_error_bound(x.abs().amax(dim=(1, 2)),
                                                                               torch.bfloat16)).all()


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="dtype must be one of"):
        BlockQuant(torch.float16)
    with pytest.raises(ValueError, match="positive int or"):
        BlockQuant(block=(0, 128))
    with pytest.raises(ValueError, match="on_unaligned must be"):
        BlockQuant(on_unaligned="skip")
    with pytest.raises(ValueError, match="must be an autoshard.BlockQuant"):
        autoshard.plan(MLPStack(), {"dp": 2}, example_inputs=(FEATURES,), all_gather_quant="fp8")


def test_the_plan_shows_each_tile_and_its_blocks():
    plan = autoshard.plan(Llama(LlamaConfig()), {"dp": 2, "tp": 2}, example_inputs=(TOKENS,),
                          all_gather_quant=BlockQuant(block=16))
    wq = plan.params["layers.0.attention.wq.weight"]  # stored [64, 64] (T): tile [32, 32]
    assert wq.gather.tile == (32, 32) and wq.gather.blocks == (2, 2)
    assert plan.params["layers.0.attention_norm.weight"].gather is None  # 1-D: never quantized
    text = str(plan)
    assert "all-gather" in text.splitlines()[1]
    assert "fp8 16x16: 2x2 blocks per tile 32x32" in text
    assert "all-gather quantized: fp8 16x16 (float8_e4m3fn" in text and "for 16 of 16 weights" in text
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_an_unaligned_tile_is_gathered_unquantized_and_said_so():
    """hidden 40 on 2x2: fc1's tile is [32/2, 40/2] = [16, 20], which 8x8 blocks do not tile;
    the head's (replicated over tp) [16/2, 32] they do."""
    plan = autoshard.plan(MLPStack(hidden=40), {"dp": 2, "tp": 2}, example_inputs=(FEATURES,),
                          all_gather_quant=BlockQuant(block=8))
    fc1 = plan.params["blocks.0.fc1.weight"].gather
    assert not fc1.quantized and fc1.tile == (16, 20)
    assert "unquantized: tile 16x20 does not divide into 8x8 blocks" in str(plan)
    assert plan.params["head.weight"].gather.blocks == (1, 4)
    assert plan.params["blocks.0.fc1.bias"].gather is None


def test_on_unaligned_error_names_the_parameter_its_tile_and_the_block():
    model = MLPStack(hidden=40)
    with pytest.raises(ValueError, match=r"'blocks\.0\.fc1\.weight' has tile 16x20 per rank .* 8x8 blocks"):
        autoshard.plan(model, {"dp": 2, "tp": 2}, example_inputs=(FEATURES,),
                       all_gather_quant=BlockQuant(block=8, on_unaligned="error"))


def test_what_is_not_gathered_is_not_quantized():
    """No dp axis (tp-only): nothing is gathered. A colwise bias is replicated over dp, and a
    dim 0 that does not divide by dp is padded by FSDP: both gathered as stored."""
    tp_only = autoshard.plan(MLPStack(), {"tp": 4}, example_inputs=(FEATURES,), all_gather_quant=BlockQuant(block=8))
    assert not any(p.gather and p.gather.quantized for p in tp_only.params.values())
    assert "not all-gathered (no FSDP sharding)" in str(tp_only)
    padded = autoshard.plan(MLPStack(dim=30, hidden=60, out=12), {"dp": 4}, example_inputs=(torch.randn(2, 5, 30),),
                            all_gather_quant=BlockQuant(block=2))
    assert "stored dim 0 (30) does not divide by dp=4" in padded.params["blocks.0.fc1.weight"].gather.reason


def test_retargeting_decides_the_blocks_again():
    plan = autoshard.plan(Llama(LlamaConfig()), {"dp": 2, "tp": 2}, example_inputs=(TOKENS,),
                          all_gather_quant=BlockQuant(block=32))
    wk = "layers.0.attention.wk.weight"  # stored [64, 32]: tile [32, 16] on 2x2, [16, 32] on dp=4
    assert not plan.params[wk].gather.quantized
    moved = plan.for_mesh({"dp": 2})
    assert moved.params[wk].gather.quantized and moved.params[wk].gather.tile == (32, 32)
    fresh = autoshard.plan(Llama(LlamaConfig()), {"dp": 2}, example_inputs=(TOKENS,),
                           all_gather_quant=BlockQuant(block=32))
    assert moved == fresh


def test_the_wrapper_is_the_master_shard_to_every_other_op():
    """Optimizer updates, copies and views act on the master values; only FSDP's hooks quantize."""
    spec = BlockQuant(block=4)
    master = torch.randn(8, 8)
    param = wrap_for_quantized_gather(nn.Parameter(master.clone()), spec)
    assert isinstance(param.data, QuantizedGatherWeight)
    assert isinstance(param[:4], QuantizedGatherWeight) and isinstance(torch.chunk(param, 2)[1], QuantizedGatherWeight)
    param.grad = torch.ones(8, 8)
    torch.optim.SGD([param], lr=0.5).step()
    assert torch.equal(master_values(param.detach()), master - 0.5)
    assert type(param.detach() * 2) is torch.Tensor  # arithmetic gives plain tensors

    (values, scales), _ = param.fsdp_pre_all_gather(None, param.shape, param.stride(), None, None)
    assert values.dtype == torch.uint8 and scales.shape == (2, 2)
    weight, inner = param.fsdp_post_all_gather((values, scales), None, torch.bfloat16)
    assert weight.dtype == torch.bfloat16 and inner == (weight,)
    bound = spec.block_error_bound(block_amax(master - 0.5, spec), torch.bfloat16)
    assert (block_amax(weight.float() - (master - 0.5), spec) <= bound).all()
    refill = torch.zeros_like(weight)
    param.fsdp_post_all_gather((values, scales), None, torch.bfloat16, out=refill)
    assert torch.equal(refill, weight)
