"""Block-quantized FSDP all-gather on real gloo ranks, against a single device.

One 4-process group: the 2x2 mesh for most checks, the tp=4 and dp=4 meshes
for "tp-only is unaffected" and "dp-only is quantized". The example Llama has
width 64, so its tiles are 32 wide on 2x2 and 16x16 blocks fit them (128x128
blocks are for real widths; see the benchmark's alignment table).
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import autoshard
from autoshard import BlockQuant
from autoshard.adapters.comm_stats import CollectiveCounter
from autoshard.plans.block_quant import block_amax, dequantize_blocks, quantize_blocks
from autoshard.runtime.quantized_gather import QuantizedGatherWeight
from examples.models import Llama, LlamaConfig, MLPStack
from tests.distributed import distributed_tests
from tests.parity import assert_parity, dp_slice, full, lm_loss, rel_error, train_both

FP8 = BlockQuant(torch.float8_e4m3fn, 16)
INT8 = BlockQuant(torch.int8, 16)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (8, 16), generator=gen), torch.randint(0, 256, (8, 16), generator=gen)


def _llama() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig())


def _shard(model, mesh, **options):
    return autoshard.autoshard(model, mesh, example_inputs=(dp_slice(_batch()[0], mesh),), **options)


def _quantized(plan) -> dict[str, bool]:
    """Every 2-D parameter: whether its all-gather is quantized."""
    return {fqn: p.gather.quantized for fqn, p in plan.params.items() if p.gather is not None}


def _seen_by_matmuls(sharded, mesh) -> dict[str, torch.Tensor]:
    """The full (stored-layout) weights each FSDP unit's forward computes with: read right after
    FSDP2's pre-forward all-gather, by a hook that runs after FSDP2's own."""
    plan = sharded.autoshard_plan
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for unit in plan.units:
        module = sharded.get_submodule(unit)
        prefix = f"{unit}." if unit else ""
        names = [fqn[len(prefix):] for fqn, p in plan.params.items() if p.unit == unit and p.gather is not None]

        def record(module, args, prefix=prefix, names=names):
            for name in names:
                seen[prefix + name] = full(module.get_parameter(name).detach()).clone()

        hooks.append(module.register_forward_pre_hook(record))
    tokens, targets = _batch()
    lm_loss(sharded(dp_slice(tokens, mesh)), dp_slice(targets, mesh)).backward()
    for hook in hooks:
        hook.remove()
    for p in sharded.parameters():
        p.grad = None
    return seen


def _check_seen_within_bound(sharded, mesh, spec, compute_dtype=torch.float32):
    quantized = _quantized(sharded.autoshard_plan)
    masters = {fqn: full(sharded.get_parameter(fqn).detach()) for fqn in quantized}
    seen = _seen_by_matmuls(sharded, mesh)
    assert set(seen) == set(quantized)
    for fqn, weight in seen.items():
        master = masters[fqn]
        if not quantized[fqn]:
            assert torch.equal(weight, master.to(weight.dtype)), f"{fqn} is gathered unquantized"
            continue
        error = block_amax(weight.float() - master, spec)
        bound = spec.block_error_bound(block_amax(master, spec), compute_dtype)
        assert (error <= bound).all(), (fqn, (error / bound).max().item())
        assert error.max() > 0, f"{fqn} was not quantized"


def check_matmuls_see_each_block_within_the_format_bound(ctx):
    """fp8 and int8, fp32 and bf16 compute: every block of every gathered weight within its bound."""
    for spec, policy in ((FP8, None), (INT8, None), (FP8, BF16)):
        options = {"mp_policy": policy} if policy else {}
        sharded = _shard(_llama(), ctx.mesh_2d, all_gather_quant=spec, **options)
        assert all(_quantized(sharded.autoshard_plan).values())
        _check_seen_within_bound(sharded, ctx.mesh_2d, spec, torch.bfloat16 if policy else torch.float32)


def _dp_gather_bytes(sharded, mesh) -> int:
    tokens, targets = _batch()
    axes = {a: mesh.get_group(a) for a in mesh.mesh_dim_names}
    with CollectiveCounter(axes) as counter:
        lm_loss(sharded(dp_slice(tokens, mesh)).float(), dp_slice(targets, mesh)).backward()
    for p in sharded.parameters():
        p.grad = None
    return counter.wire_bytes("dp", "all_gather")


def check_all_gather_bytes_shrink_four_fold(ctx):
    """dp all-gather wire bytes of one step: fp8 <= 0.30x of fp32, fp8 over bf16 <= 0.55x of bf16."""
    mesh = ctx.mesh_2d
    fp32 = _dp_gather_bytes(_shard(_llama(), mesh), mesh)
    fp8 = _dp_gather_bytes(_shard(_llama(), mesh, all_gather_quant=FP8), mesh)
    int8 = _dp_gather_bytes(_shard(_llama(), mesh, all_gather_quant=INT8), mesh)
    bf16 = _dp_gather_bytes(_shard(_llama(), mesh, mp_policy=BF16), mesh)
    bf16_fp8 = _dp_gather_bytes(_shard(_llama(), mesh, mp_policy=BF16, all_gather_quant=FP8), mesh)
    assert fp8 <= 0.30 * fp32 and int8 == fp8, (fp8, int8, fp32)
    assert bf16_fp8 <= 0.55 * bf16, (bf16_fp8, bf16)


def _fake_quantized(model, plan, spec):
    """``model`` with each weight the plan quantizes replaced by what the matmuls see: its stored
    layout quantized and dequantized on the same block grid (blocks never cross tiles)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for fqn, entry in plan.params.items():
            if entry.gather is not None and entry.gather.quantized:
                weight = model.get_parameter(fqn)
                stored = weight.t() if entry.transposed else weight
                seen = dequantize_blocks(*quantize_blocks(stored, spec), spec, torch.float32)
                weight.copy_(seen.t() if entry.transposed else seen)
    return model


def _grads(model, tokens, targets) -> dict[str, torch.Tensor]:
    lm_loss(model(tokens), targets).backward()
    return {fqn: full(p.grad) for fqn, p in model.named_parameters()}


def check_first_step_gradients_are_those_at_the_dequantized_weights(ctx):
    """Gradients are reduce-scattered unquantized: the first step's gradients equal one device's
    at the dequantized weights (<= 1e-5), and differ from those at the master weights only by
    what quantization moved."""
    mesh = ctx.mesh_2d
    model = _llama()
    sharded = _shard(model, mesh, all_gather_quant=FP8)
    plan = sharded.autoshard_plan
    tokens, targets = _batch()
    got = _grads(sharded, dp_slice(tokens, mesh), dp_slice(targets, mesh))
    at_seen = _grads(_fake_quantized(model, plan, FP8), tokens, targets)
    at_master = _grads(copy.deepcopy(model), tokens, targets)
    worst_seen = worst_master = 0.0
    for fqn, grad in got.items():
        entry = plan.params[fqn]
        grad = grad.t() if entry.transposed else grad
        worst_seen = max(worst_seen, rel_error(grad, at_seen[fqn]))
        worst_master = max(worst_master, rel_error(grad, at_master[fqn]))
    assert worst_seen <= 1e-5, worst_seen
    assert worst_master > 10 * worst_seen, (worst_master, worst_seen)  # the quantization is what differs


def check_twenty_adamw_steps_follow_one_device(ctx):
    """Losses of 20 AdamW steps within 2% of the unquantized single-device run, fp8 and int8;
    master weights stay fp32 and state_dict() holds them as plain tensors."""
    tokens, targets = _batch()
    for spec in (FP8, INT8):
        run = train_both(_llama(), ctx.mesh_2d, tokens, targets, lm_loss, optimizer="adamw", lr=1e-3,
                         adam_eps=1e-6, steps=20, shard_kwargs={"all_gather_quant": spec})
        assert_parity(run, loss_tol=2e-2, param_tol=None)
        assert all(p.dtype == torch.float32 for p in run.sharded.parameters())
        for key, value in run.sharded.state_dict().items():
            assert not isinstance(getattr(value, "_local_tensor", value), QuantizedGatherWeight), key


def check_tp_only_mesh_is_unaffected(ctx):
    """tp=4 has no all-gather: the same code, no wrapped weight, the same outputs bit for bit."""
    mesh = ctx.mesh_tp
    plain, quant = _shard(_llama(), mesh), _shard(_llama(), mesh, all_gather_quant=FP8)
    assert quant.code == plain.code
    assert not any(_quantized(quant.autoshard_plan).values())
    assert not any(isinstance(p.to_local(), QuantizedGatherWeight) for p in quant.parameters())
    tokens = dp_slice(_batch()[0], mesh)
    assert torch.equal(quant(tokens), plain(tokens))


def check_dp_only_mesh_is_quantized(ctx):
    """dp=4, no tp: tiles [in/4, out], quantized; bytes <= 0.30x, weights within the bound."""
    mesh = ctx.mesh_dp
    quant = _shard(_llama(), mesh, all_gather_quant=FP8)
    assert all(_quantized(quant.autoshard_plan).values())
    assert _dp_gather_bytes(quant, mesh) <= 0.30 * _dp_gather_bytes(_shard(_llama(), mesh), mesh)
    _check_seen_within_bound(quant, mesh, FP8)


def check_an_unaligned_weight_is_gathered_exactly(ctx):
    """hidden 40 on 2x2 with 8x8 blocks: fc1/fc2 tiles 16x20 are gathered as stored (bit-equal),
    the head's are quantized; the plan says which."""
    torch.manual_seed(0)
    spec = BlockQuant(torch.float8_e4m3fn, 8)
    model = MLPStack(hidden=40)
    x = torch.randn(4, 5, 32)
    sharded = autoshard.autoshard(model, ctx.mesh_2d, example_inputs=(dp_slice(x, ctx.mesh_2d),),
                                  all_gather_quant=spec)
    quantized = _quantized(sharded.autoshard_plan)
    assert quantized["head.weight"] and not quantized["blocks.0.fc1.weight"]
    assert "does not divide into 8x8 blocks" in str(sharded.autoshard_plan)
    masters = {fqn: full(sharded.get_parameter(fqn).detach()) for fqn in quantized}
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, prefix=prefix: seen.update(
        {prefix + n: full(p.detach()).clone() for n, p in m.named_parameters() if prefix + n in quantized}))
        for prefix, m in (("", sharded), *((f"blocks.{i}.", b) for i, b in enumerate(sharded.blocks)))]
    sharded(dp_slice(x, ctx.mesh_2d)).sum().backward()
    for hook in hooks:
        hook.remove()
    assert torch.equal(seen["blocks.0.fc1.weight"], masters["blocks.0.fc1.weight"])
    error = block_amax(seen["head.weight"] - masters["head.weight"], spec)
    assert (error <= spec.block_error_bound(block_amax(masters["head.weight"], spec))).all() and error.max() > 0


CHECKS = [
    check_matmuls_see_each_block_within_the_format_bound,
    check_all_gather_bytes_shrink_four_fold,
    check_first_step_gradients_are_those_at_the_dequantized_weights,
    check_twenty_adamw_steps_follow_one_device,
    check_tp_only_mesh_is_unaffected,
    check_dp_only_mesh_is_quantized,
    check_an_unaligned_weight_is_gathered_exactly,
]

outcomes, test_check = distributed_tests(CHECKS)
