"""Every tensor autoshard makes is on the mesh's device, whatever torch's default device is.

On a GPU a tensor made without ``device=`` lands on torch's default device, which
need not be the mesh's: a CPU zero meets CUDA gradients, NCCL refuses a CPU
probe, and training code that sets the default device to the GPU (to build its
model there) would move planning's CPU probes onto it. On CPU gloo ranks every
default is the mesh's device, so the rest of the suite cannot see this class of
fault. Here the model, the batches and the meshes are made on the CPU, then the
default device is set to ``meta``, a device no tensor of the run lives on: a
tensor made without a device fails loudly, as it would on a GPU. Autograd runs
backward with the default device switched off (on a GPU job too, where a
backward's tensor without a device is then on the CPU), so the mode also runs
autoshard's own backward code under it (:func:`elsewhere`).

One 4-process gloo group runs, in this mode: the tp collectives forward and
backward; 3 SGD steps on 2x2 (then a checkpoint saved and loaded), on tp=4
(fewer kv heads than tp) with loss and sequence parallelism, of a fused
projection, and in bf16 with its tp sums on 4 ranks (1x4); the block-quantized
all-gather; suggest_mesh's probes. Each is held to one device computed before
the default device changed. Planning and the proof need no process group: they
run in this process.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import types
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.parallel import loss_parallel as vocab_parallel_loss
from torch.utils._python_dispatch import TorchDispatchMode

import autoshard
from autoshard import BlockQuant
from autoshard.adapters import checkpoint, launch
from autoshard.advice import suggest
from autoshard.passes import dtensor_rules
from autoshard.runtime import collectives
from autoshard.runtime.quantized_gather import QuantizedGatherWeight
from examples.models import Llama, LlamaConfig
from tests.distributed import distributed_tests, remove_shared, shared_directory
from tests.parity import dp_slice, full, mean_over_dp, rel_error
from tests.pattern_models import VOCAB, CustomFunctionMLP, FusedQKV, InterleavedRope
from tests.test_quantized_gather import _fake_quantized

ELSEWHERE = "meta"  # the default device while autoshard runs: never the mesh's
STEPS = 3
TOL = 1e-5  # fp32 against one device: only the order of the sums differs
BF16_LOSS_TOL = 3e-2  # a bf16 run against the fp32 device (as tests/test_training.py)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
FP8 = BlockQuant(torch.float8_e4m3fn, 16)  # 16x16 blocks fit the example Llama's 2x2 tiles


@contextlib.contextmanager
def default_device(device: str):
    """torch's default device is ``device`` inside the block, and what it was after."""
    previous = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(previous)


def _under(device: str, fn):
    """``fn`` run with ``device`` the default device."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with default_device(device):
            return fn(*args, **kwargs)

    return call


@contextlib.contextmanager
def _backwards_under(device: str):
    """The collectives' backwards run with ``device`` the default device."""
    for op, backward, keep in collectives.AUTOGRAD:
        op.register_autograd(_under(device, backward), setup_context=keep)
    try:
        yield
    finally:
        for op, backward, keep in collectives.AUTOGRAD:
            op.register_autograd(backward, setup_context=keep)


@contextlib.contextmanager
def elsewhere():
    """The default device elsewhere, in forward and in autoshard's code that backward runs.

    Autograd runs each backward with torch's function modes off, and the default device is one:
    in a backward, a tensor made without a device is on the CPU, on a GPU job too. So the
    collectives' backwards, and the quantized gather's hooks (FSDP2 calls them before backward
    as well as before forward), are each run with the default device elsewhere too."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(default_device(ELSEWHERE))
        stack.enter_context(_backwards_under(ELSEWHERE))
        for name in ("fsdp_pre_all_gather", "fsdp_post_all_gather"):
            hook = getattr(QuantizedGatherWeight, name)
            stack.enter_context(mock.patch.object(QuantizedGatherWeight, name, _under(ELSEWHERE, hook)))
        yield


def _llama() -> Llama:
    """The example Llama: 4 heads and 2 kv heads, fewer than tp on the tp=4 meshes."""
    torch.manual_seed(0)
    return Llama(LlamaConfig())


def _batch(seed: int = 0, batch: int = 8, seq: int = 16, vocab: int = 256):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (batch, seq), generator=gen),
            torch.randint(0, vocab, (batch, seq), generator=gen))


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _loss(logits, targets) -> torch.Tensor:
    """Mean cross entropy; on vocabulary-sharded logits (a DTensor) inside ``loss_parallel()``."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@dataclasses.dataclass
class Trained:
    losses: list[float]
    state: dict[str, torch.Tensor]  # the weights after the last step, in the original layout


def _one_device(model, tokens, targets) -> Trained:
    """``STEPS`` SGD steps of a copy of ``model`` on the whole batch, on the CPU."""
    model = copy.deepcopy(model)
    optimizer = _sgd(model.parameters())
    losses = []
    for _ in range(STEPS):
        loss = _loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return Trained(losses, {key: value.detach().clone() for key, value in model.state_dict().items()})


def _train(sharded, optimizer, mesh, tokens, targets, steps: int = STEPS, vocab_parallel: bool = False) -> list[float]:
    """``steps`` SGD steps on this rank's dp slice of the batch; the losses averaged over dp."""
    local, local_targets = dp_slice(tokens, mesh), dp_slice(targets, mesh)
    losses = []
    for _ in range(steps):
        with vocab_parallel_loss() if vocab_parallel else contextlib.nullcontext():
            loss = _loss(sharded(local), local_targets)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_dp(full(loss), mesh).item())
    return losses


def _shard(model, mesh, tokens, **options):
    """``autoshard`` without its proof: the proof is one CPU process, run once in this process
    (:func:`test_the_proof_runs_on_the_cpu_whatever_the_default_device`), not on every rank."""
    return autoshard.autoshard(model, mesh, example_inputs=(dp_slice(tokens, mesh),), check=False, **options)


def _assert_trains_like(want: Trained, losses: list[float], state: dict, loss_tol: float = TOL,
                        param_tol: float | None = TOL) -> None:
    """``losses`` and ``state`` (a full state dict) are one device's."""
    for step, (got, expected) in enumerate(zip(losses, want.losses, strict=True)):
        assert abs(got - expected) <= loss_tol * abs(expected), f"step {step}: loss {got} vs one device {expected}"
    if param_tol is None:
        return
    for key, value in state.items():
        error = rel_error(value, want.state[key])
        assert value.device.type == "cpu" and error <= param_tol, f"{key} differs from one device: {error:.2e}"


def _trains_like_one_device(mesh, *, model=None, vocab: int = 256, loss_tol: float = TOL,
                            param_tol: float | None = TOL, **options):
    """3 SGD steps sharded with the default device elsewhere, against one device on the CPU
    (of the example Llama unless ``model`` is given, with ``vocab`` tokens)."""
    model = model if model is not None else _llama()
    tokens, targets = _batch(vocab=vocab)
    want = _one_device(model, tokens, targets)
    with elsewhere():
        sharded = _shard(model, mesh, tokens, **options)
        losses = _train(sharded, _sgd(sharded.parameters()), mesh, tokens, targets,
                        vocab_parallel=options.get("loss_parallel", False))
        _assert_trains_like(want, losses, checkpoint.full_state_dict(sharded), loss_tol, param_tol)
    return sharded


# --- the collectives ---------------------------------------------------------------------------


def _per_rank(size: int, shape, dtype=torch.float32) -> list[torch.Tensor]:
    """Every rank's value (each rank makes all of them, on the CPU: no exchange needed)."""
    return [(torch.randn(shape, generator=torch.Generator().manual_seed(100 + r)) * 3).to(dtype)
            for r in range(size)]


def _exact_sum(values: list[torch.Tensor]) -> torch.Tensor:
    """The sum of bf16 values in float64 (exact), rounded once to bf16."""
    return torch.stack([v.double() for v in values]).sum(0).to(values[0].dtype)


def _check_sums(values, rank: int, name: str) -> None:
    """bf16 partial sums added in fp32, whole and scattered, and a size no rank count divides."""
    size, mine, want = len(values), values[rank], _exact_sum(values)
    assert torch.equal(torch.ops.autoshard.reduce_partial(mine, name, torch.float32), want), size
    scattered = torch.ops.autoshard.reduce_scatter_partial(mine, 1, name, torch.float32)
    assert torch.equal(scattered, want.chunk(size, dim=1)[rank]), size
    odd = torch.ops.autoshard.reduce_partial(mine[:, :3, :7], name, torch.float32)
    assert torch.equal(odd, _exact_sum([v[:, :3, :7] for v in values])), size


def _check_backward_sums(values, rank: int, name: str) -> None:
    """``enter_tp``'s all-reduce and ``gather_for_colwise``'s reduce-scatter of bf16 gradients."""
    size, want = len(values), _exact_sum(values)
    x = torch.zeros_like(values[rank], requires_grad=True)
    torch.ops.autoshard.enter_tp(x, name, torch.float32).backward(values[rank])
    assert torch.equal(x.grad, want), size
    x = torch.zeros_like(values[rank].chunk(size, dim=1)[rank], requires_grad=True)
    torch.ops.autoshard.gather_for_colwise(x, 1, name, torch.float32).backward(values[rank])
    assert torch.equal(x.grad, want.chunk(size, dim=1)[rank]), size


def _check_gathers(values, rank: int, name: str) -> None:
    """``gather_shards`` and ``take_shard`` forward and backward (fp32: nothing is added)."""
    size = len(values)
    pieces = [v.chunk(size, dim=2)[r] for r, v in enumerate(values)]
    x = pieces[rank].clone().requires_grad_(True)
    gathered = torch.ops.autoshard.gather_shards(x, 2, name)
    assert torch.equal(gathered, torch.cat(pieces, dim=2)), size
    gathered.backward(values[0])
    assert torch.equal(x.grad, values[0].chunk(size, dim=2)[rank]), size
    whole = values[0].clone().requires_grad_(True)
    shard = torch.ops.autoshard.take_shard(whole, 2, name)
    shard.backward(pieces[rank])
    assert torch.equal(whole.grad, torch.cat(pieces, dim=2)), size


def _check_missing_gradient(values, rank: int, name: str) -> None:
    """``take_shards``' backward given no gradient for one of its outputs (v unused) gathers a zero."""
    size = len(values)
    k = values[rank].chunk(size, dim=1)[rank]
    saved = types.SimpleNamespace(dim=1, group_name=name, shapes=[tuple(k.shape)] * 2, dtypes=[k.dtype] * 2,
                                  devices=[k.device] * 2)
    grads, _, _ = collectives._take_shards_backward(saved, [k, None])
    assert torch.equal(grads[0], torch.cat([v.chunk(size, dim=1)[r] for r, v in enumerate(values)], dim=1)), size
    assert grads[1].device == k.device and torch.equal(grads[1], torch.zeros_like(values[0])), size


def _check_vocab_ids(ids, rank: int, size: int, name: str) -> None:
    rows = ids.numel() // size
    local, held = torch.ops.autoshard.vocab_shard_ids(ids, rows, name)
    mine = (ids >= rank * rows) & (ids < (rank + 1) * rows)
    assert torch.equal(held.squeeze(-1), mine), size
    assert torch.equal(local, torch.where(mine, ids - rank * rows, torch.zeros_like(ids))), size


def check_collectives_make_tensors_where_their_inputs_are(ctx):
    """Every tp collective on 2 and on 4 ranks, with the default device elsewhere: bf16 sums added
    in fp32 (on 4 ranks an all-to-all and an all-gather), exactly; gathers and cuts; a missing
    gradient of ``take_shards``; the ids of a vocabulary-sharded table."""
    for mesh in (ctx.mesh_2d, ctx.mesh_tp):
        group = mesh.get_group("tp")
        name, size, rank = group.group_name, group.size(), dist.get_rank(group)
        bf16, fp32 = _per_rank(size, (6, 8, 8), torch.bfloat16), _per_rank(size, (6, 8, 8))
        ids = torch.arange(32).view(2, 16)
        with elsewhere():
            _check_sums(bf16, rank, name)
            _check_backward_sums(bf16, rank, name)
            _check_gathers(fp32, rank, name)
            _check_missing_gradient(fp32, rank, name)
            _check_vocab_ids(ids, rank, size, name)


# --- training ----------------------------------------------------------------------------------


def check_tp4_with_loss_and_sequence_parallel_trains_like_one_device(ctx):
    """tp=4 with 2 kv heads (k and v computed whole and cut per query head, ``take_shards``), the
    residual stream sharded over the sequence and the logits over the vocabulary."""
    sharded = _trains_like_one_device(ctx.mesh_tp, loss_parallel=True, sequence_parallel=True)
    code = sharded.get_submodule("layers.0").code
    assert "take_shards" in code and "reduce_scatter_partial" in code


def check_fused_projection_trains_like_one_device(ctx):
    """A fused ``wqkv`` is stored with its columns permuted per tp rank (materialized through an
    index) and saved in the model's own keys (gathered back through its inverse)."""
    torch.manual_seed(0)
    sharded = _trains_like_one_device(ctx.mesh_2d, model=FusedQKV(), vocab=VOCAB)
    assert sharded.autoshard_plan.params["layers.0.attention.wqkv.weight"].sections


def check_bf16_with_tp_sums_on_four_ranks(ctx):
    """bf16 on 1x4: every tp sum is an all-to-all, an fp32 add and an all-gather; the losses
    follow the fp32 device within bf16's tolerance."""
    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
    sharded = _trains_like_one_device(mesh, loss_tol=BF16_LOSS_TOL, param_tol=None, mp_policy=BF16)
    assert "all_to_all" in sharded.autoshard_plan.predicted_comm()["tp"]


def check_block_quantized_gather(ctx):
    """fp8 blocks all-gathered with the default device elsewhere: the first step's gradients are
    one device's at the dequantized weights."""
    mesh = ctx.mesh_2d
    model = _llama()
    tokens, targets = _batch()
    with elsewhere():
        sharded = _shard(model, mesh, tokens, all_gather_quant=FP8)
        _loss(sharded(dp_slice(tokens, mesh)), dp_slice(targets, mesh)).backward()
        got = {fqn: full(p.grad) for fqn, p in sharded.named_parameters()}
    plan = sharded.autoshard_plan
    assert all(p.gather.quantized for p in plan.params.values() if p.gather is not None)
    reference = _fake_quantized(model, plan, FP8)
    _loss(reference(tokens), targets).backward()
    for fqn, grad in got.items():
        grad = grad.t() if plan.params[fqn].transposed else grad
        error = rel_error(grad, reference.get_parameter(fqn).grad)
        assert error <= TOL, f"{fqn}: {error:.2e}"


# --- checkpoints -------------------------------------------------------------------------------


@contextlib.contextmanager
def _dcp_on_the_cpu():
    """torch's DCP makes its own planning tensors (a DTensor shard's offsets) without a device. On
    a GPU job they land on the default device, which holds them fine; here the CPU is given back to
    ``dcp.save`` and ``dcp.load`` alone, so autoshard's code around them runs with the default
    device elsewhere."""
    with mock.patch.object(dcp, "save", _under("cpu", dcp.save)), \
            mock.patch.object(dcp, "load", _under("cpu", dcp.load)):
        yield


def check_2x2_trains_like_one_device_and_checkpoints(ctx):
    """3 SGD steps on 2x2 against one device; then a DCP checkpoint of the model and its SGD
    momentum, saved and loaded: loading brings every weight back bit for bit, and the step after
    the load repeats the step after the save."""
    mesh = ctx.mesh_2d
    model = _llama()
    tokens, targets = _batch()
    later = _batch(1)
    want = _one_device(model, tokens, targets)
    directory = shared_directory(ctx)
    try:
        with elsewhere(), _dcp_on_the_cpu():
            sharded = _shard(model, mesh, tokens)
            optimizer = _sgd(sharded.parameters())
            losses = _train(sharded, optimizer, mesh, tokens, targets)
            saved = checkpoint.full_state_dict(sharded)
            _assert_trains_like(want, losses, saved)
            checkpoint.save_checkpoint(directory, STEPS, sharded, optimizer)
            after_save = _train(sharded, optimizer, mesh, *later, steps=1)
            assert checkpoint.load_latest(directory, sharded, optimizer) == STEPS
            loaded = checkpoint.full_state_dict(sharded)
            after_load = _train(sharded, optimizer, mesh, *later, steps=1)
    finally:
        remove_shared(ctx, directory)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
    assert after_load == after_save, (after_load, after_save)  # the momentum came back too


# --- suggest_mesh ------------------------------------------------------------------------------


class _OutputDevices(TorchDispatchMode):
    """The device of every tensor an op returns while active."""

    def __init__(self):
        super().__init__()
        self.devices: set[torch.device] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.devices.update(t.device for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def check_suggest_mesh_probes_the_mesh_device(ctx):
    """suggest_mesh's FLOP and link probes run on the device the process group communicates on
    (the CPU under gloo), with the default device elsewhere: every op they run returns tensors
    there; the links measured are the same on every rank, and suggest_mesh ranks the meshes of 2
    ranks with them (pipeline stages included)."""
    model = _llama()
    tokens, _ = _batch()
    with elsewhere():
        device = suggest._probe_device()
        with _OutputDevices() as seen:
            rate = suggest._measure_flops(device)
            links = suggest._probe_links(device)
        suggestion = autoshard.suggest_mesh(model, 2, example_inputs=(tokens,), verbose=False)
    assert device == torch.device("cpu") and seen.devices == {device}, (device, seen.devices)
    assert 0 < rate < float("inf") and links.intra_gbps > 0, (rate, links)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (links, suggestion.links))
    assert all(pair == everyone[0] for pair in everyone), everyone
    assert {tuple(c.mesh.items()) for c in suggestion.candidates} == {(("dp", 2),), (("tp", 2),), (("pp", 2),)}, (
        suggestion)


CHECKS = [
    check_collectives_make_tensors_where_their_inputs_are,
    check_2x2_trains_like_one_device_and_checkpoints,
    check_tp4_with_loss_and_sequence_parallel_trains_like_one_device,
    check_fused_projection_trains_like_one_device,
    check_bf16_with_tp_sums_on_four_ranks,
    check_block_quantized_gather,
    check_suggest_mesh_probes_the_mesh_device,
]

outcomes, test_default_device = distributed_tests(CHECKS)


# --- in this process: planning and the proof -------------------------------------------------


def _forget_dtensor_answers() -> None:
    """Planning caches DTensor's answers per process; a cached one would hide how the probe that
    made it behaves under this default device."""
    dtensor_rules._answer_cached.cache_clear()
    dtensor_rules._MESHES.clear()


def _plan_text(model, mesh: dict, inputs, device: str) -> str:
    _forget_dtensor_answers()
    with default_device(device):
        return str(autoshard.plan(model, mesh, example_inputs=inputs))


@pytest.mark.parametrize("build", [InterleavedRope, CustomFunctionMLP])
def test_planning_ignores_the_default_device(build):
    """Plans whose making checks values are the same with the default device elsewhere as on the
    CPU: one that takes one of DTensor's rules (the interleaved rotary's ``stack``, accepted once
    it passes a check on random values; were those values made on the default device, the check
    would fail and the rule be declined without a word, leaving wq, wk and wv to all-gather their
    outputs and wo colwise), and one whose custom autograd.Function is checked against autograd
    with random cotangents."""
    torch.manual_seed(0)
    model = build()
    tokens, _ = _batch(batch=4, vocab=VOCAB)
    mesh = {"dp": 2, "tp": 2}
    assert _plan_text(model, mesh, (tokens,), ELSEWHERE) == _plan_text(model, mesh, (tokens,), "cpu")


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
def test_the_proof_runs_on_the_cpu_whatever_the_default_device(mixed):
    """The proof (one process, on the CPU by design) of the example Llama on 2x2 with the default
    device elsewhere; in bf16 it also runs the graph widened to float64."""
    model = _llama()
    tokens, _ = _batch(batch=4)
    _forget_dtensor_answers()
    policy = BF16 if mixed else None
    with default_device(ELSEWHERE):
        proof = autoshard.check(model, {"dp": 2, "tp": 2}, example_inputs=(tokens,), mp_policy=policy)
    assert proof.ok, str(proof)
    assert proof.exact == ("float64" if mixed else "")


# --- choosing the accelerator (mocked: the suite runs without one) ----------------------------


@contextlib.contextmanager
def _an_accelerator(index: int):
    """This process sees a CUDA accelerator whose current device is ``index``."""
    with mock.patch.object(torch.accelerator, "is_available", return_value=True), \
            mock.patch.object(torch.accelerator, "current_accelerator", return_value=torch.device("cuda")), \
            mock.patch.object(torch.accelerator, "current_device_index", return_value=index):
        yield


@pytest.mark.parametrize(("group", "want"), [
    (None, "cuda:1"),  # no group: the accelerator the ranks will use
    ("cuda:nccl", "cuda:1"),
    ("cpu:gloo,cuda:nccl", "cuda:1"),  # init_process_group() without a backend on a GPU machine
    ("cpu:gloo,cuda:gloo", "cpu"),  # gloo moves CPU tensors (and could CUDA ones): a CPU job
])
def test_suggest_mesh_probes_the_device_its_group_moves(group, want):
    with _an_accelerator(1), mock.patch.object(dist, "is_initialized", return_value=group is not None), \
            mock.patch.object(dist, "get_backend_config", return_value=group):
        assert suggest._probe_device() == torch.device(want)


@pytest.mark.parametrize(("backend", "want"), [("nccl", [3]), ("gloo", [])])
def test_spawned_ranks_use_their_own_accelerator_under_its_backend(backend, want, monkeypatch):
    """Under NCCL a spawned rank makes its own GPU (``LOCAL_RANK``) current before the group forms."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    chosen = []
    with _an_accelerator(0), mock.patch.object(torch.accelerator, "set_device_index", side_effect=chosen.append):
        launch._use_own_accelerator(backend)
    assert chosen == want
