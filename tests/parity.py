"""Train a sharded model next to its single-device reference and compare.

Every rank builds the same model (same seed) and the same *global* batch;
the reference trains on the whole batch, the sharded model on the rank's dp
slice (ranks of one dp group see the same slice). With mean losses and FSDP's
gradient averaging over dp the two runs take identical steps.

Errors are max-abs relative: ``max|a - b| / max|b|`` over a tensor, with
``max|b|`` floored at ``scale_floor`` when given. The floor is for
parameters whose exact gradient is zero (an attention key bias: softmax
ignores a shift shared by all keys); in floating point they carry rounding
noise of either sign, which Adam's ``m / sqrt(v)`` turns into full-size
steps, so only an absolute bound at the scale of the other parameters is
meaningful for them. For the same reason, runs that compare parameters after
AdamW use ``adam_eps`` well above gradient rounding noise (1e-6): with the
default 1e-8, every gradient entry of order 1e-8 flips to a step of +-lr on
rounding noise alone.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import autoshard


def rel_error(actual: torch.Tensor, expected: torch.Tensor, scale_floor: float = 1e-30) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(scale_floor)).item()


def full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def dp_rank_and_size(mesh) -> tuple[int, int]:
    return autoshard.data_parallel_rank(mesh)


def dp_slice(batch: torch.Tensor, mesh) -> torch.Tensor:
    rank, size = dp_rank_and_size(mesh)
    return batch.chunk(size)[rank]


def mean_over_dp(value: torch.Tensor, mesh) -> torch.Tensor:
    rank, size = dp_rank_and_size(mesh)
    if size == 1:
        return value.detach()
    total = value.detach().clone()
    for axis in mesh.mesh_dim_names:
        if axis != "tp":
            dist.all_reduce(total, group=mesh.get_group(axis))
    return total / size


@dataclasses.dataclass
class ParityRun:
    losses: list[tuple[float, float]]  # (sharded, reference) per step
    param_errors: dict[str, float]
    sharded: torch.nn.Module
    reference: torch.nn.Module


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def mse_loss(out, target):
    return F.mse_loss(out, target)


def train_both(
    model,
    mesh,
    inputs,
    targets,
    loss_fn,
    *,
    optimizer="sgd",
    steps=3,
    lr=None,
    adam_eps=1e-8,
    scale_floor=1e-30,
    kwargs=None,
    shard_kwargs=None,
) -> ParityRun:
    """``inputs``/``targets`` are the global batch (dim 0 split over dp); so is every
    tensor in ``kwargs`` (an attention mask). ``shard_kwargs`` go to ``autoshard``."""
    reference = copy.deepcopy(model)
    local_in, local_tgt = dp_slice(inputs, mesh), dp_slice(targets, mesh)
    kwargs = kwargs or {}
    local_kwargs = {k: dp_slice(v, mesh) for k, v in kwargs.items()}
    sharded = autoshard.autoshard(
        model, mesh, example_inputs=(local_in,), example_kwargs=local_kwargs, **(shard_kwargs or {})
    )
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=lr or 0.1),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=lr or 1e-2, weight_decay=0.1, eps=adam_eps),
    }[optimizer]
    opt_s, opt_r = make(sharded.parameters()), make(reference.parameters())
    losses = []
    for _ in range(steps):
        loss_s = loss_fn(sharded(local_in, **local_kwargs), local_tgt)
        loss_s.backward()
        opt_s.step()
        opt_s.zero_grad()
        loss_r = loss_fn(reference(inputs, **kwargs), targets)
        loss_r.backward()
        opt_r.step()
        opt_r.zero_grad()
        losses.append((mean_over_dp(loss_s, mesh).item(), loss_r.item()))
    ref_state = reference.state_dict()
    errors = {k: rel_error(full(v), ref_state[k], scale_floor) for k, v in sharded.state_dict().items()}
    return ParityRun(losses, errors, sharded, reference)


def assert_parity(run: ParityRun, *, loss_tol: float, param_tol: float | None) -> None:
    for step, (got, want) in enumerate(run.losses):
        err = abs(got - want) / max(abs(want), 1e-30)
        assert err <= loss_tol, f"step {step}: loss {got} vs reference {want} (rel error {err:.2e})"
    if param_tol is not None:
        worst = max(run.param_errors.items(), key=lambda kv: kv[1])
        assert worst[1] <= param_tol, f"parameter {worst[0]} differs from the reference: rel error {worst[1]:.2e}"


def held_for_backward(module, *inputs) -> int:
    """Bytes a forward leaves allocated for backward: the profiler's net CPU allocation over
    the forward with autograd, minus that of the same forward without (outputs, parameters
    kept gathered). Counted on the calling thread only: gloo's threads allocate too.
    Saved-tensor hooks cannot count this: checkpointing keeps its inputs and saved outputs
    outside them."""

    def net(grad: bool) -> int:
        with torch.set_grad_enabled(grad), torch.profiler.profile(profile_memory=True) as prof:
            out = module(*inputs)
        del out
        events = prof.events()
        main = max({e.thread for e in events}, key=[e.thread for e in events].count)
        return sum(e.self_cpu_memory_usage for e in events if e.thread == main)

    net(True)  # the first call allocates once-only state (FSDP's buffers)
    held = net(True) - net(False)
    for p in module.parameters():
        p.grad = None
    return held
