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
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

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
        if axis not in ("tp", "cp"):  # tp and cp ranks hold the same loss
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
    """Bytes a forward leaves alive for backward: the storages the forward with autograd
    creates and keeps alive to its end, minus those of the same forward without (outputs).

    Liveness is read from weak references to the storages, not from the profiler's
    allocation events: a collective's buffer is also referenced by the gloo work that
    sent it, and when gloo's worker thread drops the last reference the profiler
    records no free (it records on the profiling thread only), so a net of its events
    counts such buffers as held, at random per rank and run (and a free of memory
    gathered before the forward, a root resharded after a forward without autograd,
    as negative). Checkpointing's kept inputs and saved outputs are created by the
    forward and stay alive, so they count."""
    alive_bytes(module, *inputs, grad=True)  # the first call allocates once-only state (FSDP's buffers)
    held = alive_bytes(module, *inputs, grad=True) - alive_bytes(module, *inputs, grad=False)
    for p in module.parameters():
        p.grad = None
    return held


def alive_bytes(module, *inputs, grad: bool) -> int:
    """Bytes of the storages created during ``module(*inputs)`` that are alive when it returns."""
    with torch.set_grad_enabled(grad), _NewStorages() as created:
        out = module(*inputs)
    total = _settled(created.alive_bytes)
    del out
    return total


def _settled(read, interval_s: float = 0.002, stable_reads: int = 5, timeout_s: float = 1.0) -> int:
    """``read()`` once it returns the same value ``stable_reads`` times in a row.

    A collective's buffers stay alive until the backend's worker thread lets go of
    the work that sent them, a moment after the caller has its result; the last
    collectives of a forward may still be held when it returns."""
    value, same, deadline = read(), 1, time.monotonic() + timeout_s
    while same < stable_reads and time.monotonic() < deadline:
        time.sleep(interval_s)
        latest = read()
        same = same + 1 if latest == value else 1
        value = latest
    return value


class _NewStorages(TorchDispatchMode):
    """Weak references to every storage an op returns that none of its inputs holds.

    Weak, so watching keeps nothing alive; an op's inputs' storages are excluded, so
    views, in-place ops and ``out=`` writes into existing buffers (parameters, FSDP's
    gathered weights) are not counted as created. Tensor subclasses (DTensor, an
    ``AsyncCollectiveTensor``) are read through to the plain tensors holding data.
    """

    def __init__(self):
        super().__init__()
        self.created: dict[StorageWeakRef, None] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {s._cdata for s in _storages((args, kwargs))}
        for storage in _storages(out):
            if storage._cdata not in given:
                self.created.setdefault(StorageWeakRef(storage), None)
        return out

    def alive_bytes(self) -> int:
        alive = (torch.UntypedStorage._new_with_weak_ptr(ref.cdata) for ref in self.created if not ref.expired())
        return sum(storage.nbytes() for storage in alive)


def _storages(tree) -> list[torch.UntypedStorage]:
    """The untyped storages holding the data of the tensors in ``tree``."""
    found = []
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            found.extend(_data_storages(leaf))
    return found


def _data_storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """A wrapper subclass holds no data of its own: its inner tensors do."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = (getattr(tensor, name) for name in names)
        return [s for t in inner if isinstance(t, torch.Tensor) for s in _data_storages(t)]
    return [tensor.untyped_storage()]


def hf_loss(output, targets):
    """A Hugging Face causal LM's loss on its ``logits`` (the output is its ModelOutput)."""
    return lm_loss(output.logits, targets)


@dataclasses.dataclass
class PipelineRun:
    """A pipeline trained next to one device: per step (pipeline, reference) losses, parameters'
    relative errors after the last step, and (with clipping) the gradient norms both measured."""

    pipeline: object
    optimizer: torch.optim.Optimizer
    batches: list
    local: object  # the dp slice of a global tensor on this rank
    losses: list[tuple[float, float]]
    param_errors: dict[str, float]
    norms: list[tuple[float, float]]

    def assert_parity(self, *, loss_tol: float, param_tol: float | None) -> None:
        for got, want in self.losses:
            assert abs(got - want) <= loss_tol * abs(want), self.losses
        if param_tol is not None:
            worst = max(self.param_errors.items(), key=lambda kv: kv[1])
            assert worst[1] <= param_tol, worst


def train_pipeline_both(build, mesh, loss_fn, *, schedule: str, microbatches: int, optimizer: str,
                        steps: int = 3, batch: int = 8, seq: int = 16, padding_mask: bool = False,
                        clip: float | None = None, accumulate: int = 1, check: bool = False,
                        shard_kwargs: dict | None = None) -> PipelineRun:
    """Train ``build()`` through :func:`autoshard.autoshard` on a pp ``mesh`` and on one device.

    Every rank draws the same global batches (``batch`` rows per dp rank) and trains on its dp slice;
    the reference trains on the whole batch. ``accumulate`` steps of the pipeline (dp sync off but
    for the last) make one optimizer step, as ``accumulate`` summed losses do on one device.
    ``clip``: both clip their gradients to that fraction of one device's first norm; ``shard_kwargs``
    go to ``autoshard`` too (``loss_parallel=True``)."""
    from autoshard.adapters.checkpoint import full_state_dict

    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    index, count = dp_rank_and_size(mesh)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or model.cfg.vocab_size
    gen = torch.Generator().manual_seed(7)
    rows = batch * count
    batches = [tuple(torch.randint(0, vocab, (rows, seq), generator=gen) for _ in range(2))
               for _ in range(steps * accumulate)]
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[::2, seq - 3:] = 0

    def local(t):
        return t.chunk(count)[index]

    def kwargs(global_mask):
        return {"attention_mask": global_mask} if padding_mask else {}

    pipe = autoshard.autoshard(model, mesh, example_inputs=(local(batches[0][0]),), example_kwargs=kwargs(local(mask)),
                               loss_fn=loss_fn, microbatches=microbatches, schedule=schedule, check=check,
                               **(shard_kwargs or {}))

    def make(params):
        if optimizer in ("sgd", "sgd-momentum"):
            return torch.optim.SGD(params, lr=0.1, momentum=0.9 if optimizer == "sgd-momentum" else 0.0)
        return torch.optim.AdamW(params, lr=1e-2, eps=1e-6)

    opt, ref_opt = make(pipe.parameters()), make(reference.parameters())
    losses, norms, limit = [], [], None
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        got = want = 0.0
        for i, (tokens, targets) in enumerate(batches[step * accumulate:(step + 1) * accumulate]):
            if accumulate > 1:
                pipe.set_requires_gradient_sync(i == accumulate - 1)
            got += pipe.step(local(tokens), local(targets), kwargs=kwargs(local(mask))).item()
            ref_loss = loss_fn(reference(tokens, **kwargs(mask)), targets)
            ref_loss.backward()
            want += ref_loss.item()
        if accumulate > 1:
            pipe.set_requires_gradient_sync(True)
        if clip is not None:
            if limit is None:
                limit = clip * torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
            want_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), limit).item()
            norms.append((pipe.clip_grad_norm_(limit).item(), want_norm))
        opt.step()
        ref_opt.step()
        losses.append((got, want))
    state = full_state_dict(pipe)
    errors = {k: rel_error(v, reference.state_dict()[k]) for k, v in state.items()}
    return PipelineRun(pipe, opt, batches, local, losses, errors, norms)
