"""Numerics on real gloo ranks: sharded training equals single-device training.

One 4-process group runs every check: three models (Llama-style, MLP stack,
raw-parameter linears) x three meshes (2x2, tp=4, dp=4) x two optimizers.
SGD: loss and every parameter after 3 steps within 1e-5 (max-abs relative);
AdamW: loss within 1e-4 for 3 steps.
"""

from __future__ import annotations

import copy

import torch

from examples.models import CumulativeMLP, GatedScaleNet, Llama, LlamaConfig, MLPStack, RawLinearNet
from tests.distributed import distributed_tests
from tests.parity import assert_parity, lm_loss, mse_loss, train_both


def _llama_case(heads=4, kv_heads=2):
    model = Llama(LlamaConfig(num_heads=heads, num_kv_heads=kv_heads))
    return model, torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16)), lm_loss


def _llama_tp4_case():
    """GQA with both head counts divisible by tp=4."""
    return _llama_case(heads=8, kv_heads=4)


def _llama_kv_heads_not_divisible_case():
    """2 kv heads on tp=4: the heads view has no sharded layout, attention runs gathered."""
    return _llama_case(heads=4, kv_heads=2)


def _mlp_case():
    return MLPStack(), torch.randn(8, 5, 32), torch.randn(8, 5, 16), mse_loss


def _raw_case():
    return RawLinearNet(), torch.randn(8, 5, 32), torch.randn(8, 5, 16), mse_loss


def _uneven_dp_case():
    """Dims (30, 60, 10) that do not divide by dp=4: FSDP2 pads its dim-0 shards."""
    return MLPStack(dim=30, hidden=60, out=10), torch.randn(8, 5, 30), torch.randn(8, 5, 10), mse_loss


def _odd_vocab_case():
    """Vocabulary 257 on tp=2: the LM head is replicated over tp (the plan says why)."""
    model = Llama(LlamaConfig(vocab_size=257))
    return model, torch.randint(0, 257, (4, 16)), torch.randint(0, 257, (4, 16)), lm_loss


def _three_heads_case():
    """3 heads on tp=2: the heads view has no sharded layout; q/k/v are gathered at once."""
    model = Llama(LlamaConfig(dim=48, num_heads=3, num_kv_heads=3))
    return model, torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16)), lm_loss


def _no_rule_case():
    return CumulativeMLP(), torch.randn(8, 5, 32), torch.randn(8, 5, 32), mse_loss


def _gated_scale_case():
    return GatedScaleNet(), torch.randn(8, 5, 32), torch.randn(8, 5, 32), mse_loss


CASES = {"llama": _llama_case, "mlp_stack": _mlp_case, "raw_linear": _raw_case}
MESHES = ("2d", "tp", "dp")
TP4_CASES = {"llama": _llama_tp4_case}  # per-mesh overrides of CASES


def _make_check(case: str, mesh_name: str, optimizer: str):
    def check(ctx):
        make = (TP4_CASES if mesh_name == "tp" else {}).get(case, CASES[case])
        model, inputs, targets, loss_fn = make()
        original = copy.deepcopy(model.state_dict())
        mesh = getattr(ctx, f"mesh_{mesh_name}")
        run = train_both(model, mesh, inputs, targets, loss_fn, optimizer=optimizer, steps=3)
        if optimizer == "sgd":
            assert_parity(run, loss_tol=1e-5, param_tol=1e-5)
        else:
            assert_parity(run, loss_tol=1e-4, param_tol=None)
        assert run.param_errors.keys() == original.keys()
        for key, value in model.state_dict().items():  # the user's model did not train along
            assert torch.equal(value, original[key]), f"user's model changed: {key}"

    check.__name__ = check.__qualname__ = f"check_{case}_{mesh_name}_{optimizer}"
    check.__module__ = __name__
    return check


CHECKS = [_make_check(c, m, o) for c in CASES for m in MESHES for o in ("sgd", "adamw")]
CASES["llama_kv2"] = _llama_kv_heads_not_divisible_case
CASES["uneven_dp"] = _uneven_dp_case
CASES["gated_scale"] = _gated_scale_case
CASES["odd_vocab"] = _odd_vocab_case
CASES["three_heads"] = _three_heads_case
CASES["no_rule"] = _no_rule_case
CHECKS += [
    _make_check("llama_kv2", "tp", "sgd"),
    _make_check("uneven_dp", "dp", "sgd"),
    _make_check("gated_scale", "2d", "sgd"),
    _make_check("odd_vocab", "2d", "sgd"),
    _make_check("three_heads", "2d", "sgd"),
    _make_check("no_rule", "2d", "sgd"),
]


outcomes, test_parity = distributed_tests(CHECKS)
