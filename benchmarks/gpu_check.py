"""What a GPU changes, checked against one device: one line per check.

On CPU gloo ranks every tensor lives on one device and gloo carries every
collective, so the test suite cannot see what differs on GPUs: NCCL's
collectives (and the all-to-all that adds bf16 tp sums in fp32 on more than two
ranks), fp8 blocks moved by FSDP's all-gather, inductor's kernels, checkpoints
written from device memory, and tensors made on torch's default device instead
of the mesh's. Each check here runs one of them on the job's ranks and compares
its numbers with the same computation on one device (this rank's, before
sharding). Rank 0 prints, per check, one line: its name, PASS / FAIL / SKIP,
and the largest relative error measured (``max|a - b| / max|b|``) with the
tolerance it is held to. The process exits 1 if any check failed.

    torchrun --nproc-per-node 8 benchmarks/gpu_check.py            # NCCL, one GPU per rank
    python benchmarks/gpu_check.py --ranks 4                         # local ranks, autoshard's launcher
    python benchmarks/gpu_check.py --device cpu --ranks 4            # gloo on CPU ranks (the test suite)

The ranks need an even count; the bf16 tp-sum checks need a multiple of 4 and
say SKIP otherwise. On CPU the compile check hands each block to dynamo's
``eager`` backend unless ``--compiler`` names another: inductor's C++ build takes
minutes there, and dynamo's capture, the backend's plan and the compiled blocks'
calling convention are what the check covers on CPU.
``benchmarks/gpu_check.sh`` runs this next to the one-device checks.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # `python benchmarks/gpu_check.py` puts benchmarks/ on sys.path, not the root

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import loss_parallel  # noqa: E402

import autoshard  # noqa: E402
from autoshard import BlockQuant  # noqa: E402
from autoshard.adapters import checkpoint  # noqa: E402
from autoshard.adapters.launch import spawn  # noqa: E402
from autoshard.plans.block_quant import dequantize_blocks, quantize_blocks  # noqa: E402
from examples.models import Llama, LlamaConfig  # noqa: E402

FP32_TOL = 1e-4  # fp32 against one device: only the order of the sums differs
COLLECTIVE_TOL = 1e-6  # one fp32 sum of a few values, added in another order
BF16_TOL = 3e-2  # a bf16 run against the fp32 device (as the demo)
STEPS = 2  # the second step runs on weights the optimizer wrote into the shards
SEQ = 16
CONFIG = LlamaConfig(num_heads=8, num_kv_heads=4)
FP8 = BlockQuant(torch.float8_e4m3fn, 16)  # 16x16 blocks fit the example Llama's tiles on 2x2
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
ELSEWHERE = "meta"  # a default device no tensor of the run lives on: one made without device= fails
NAME_WIDTH = 44


# --- outcomes ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Measured:
    """The largest relative error of each compared quantity against one device."""

    errors: dict[str, float]
    tolerance: float
    where: str  # the mesh (and path) measured

    @property
    def passed(self) -> bool:
        return all(math.isfinite(e) and e <= self.tolerance for e in self.errors.values())

    def worst(self, other: Measured) -> Measured:
        """The larger error of each quantity, a NaN counting as the largest."""
        larger = {k: max(v, other.errors[k], key=lambda e: math.inf if math.isnan(e) else e)
                  for k, v in self.errors.items()}
        return dataclasses.replace(self, errors=larger)

    def text(self) -> str:
        errors = ", ".join(f"{name} {error:.1e}" for name, error in self.errors.items())
        bound = f"tolerance {self.tolerance:.0e}" if self.tolerance else "must be exact"
        return f"{self.where}: max rel error vs one device {errors} ({bound})"


@dataclasses.dataclass(frozen=True)
class Skipped:
    reason: str


@dataclasses.dataclass(frozen=True)
class Failed:
    error: str


def line(name: str, status: str, detail: str) -> str:
    return f"{name:<{NAME_WIDTH}} {status:<4}  {detail}"


def combined(outcomes: list) -> tuple[str, str]:
    """One status and detail from every rank's outcome: a failure anywhere fails the check;
    otherwise the worst errors over the ranks."""
    failed = [(rank, o) for rank, o in enumerate(outcomes) if isinstance(o, Failed)]
    if failed:
        rank, first = failed[0]
        return "FAIL", f"rank {rank}: {first.error}"
    if all(isinstance(o, Skipped) for o in outcomes):
        return "SKIP", outcomes[0].reason
    worst = outcomes[0]
    for outcome in outcomes[1:]:
        worst = worst.worst(outcome)
    return ("PASS" if worst.passed else "FAIL"), worst.text()


# --- the job's meshes and data -----------------------------------------------------------------


@dataclasses.dataclass
class Context:
    """What every check reads: this rank, its device and the job's meshes."""

    rank: int
    world: int
    device: torch.device
    compiler: str
    directory: str  # seen by every rank, removed at the end
    mesh_2d: DeviceMesh  # (dp, tp) = (world / 2, 2)
    mesh_tp: DeviceMesh  # (tp,) = (world,)
    mesh_tp4: DeviceMesh | None  # (dp, tp) = (world / 4, 4), when 4 divides the world


def build_context(rank: int, world: int, args: argparse.Namespace) -> Context:
    if world < 2 or world % 2:
        raise ValueError(f"gpu_check needs an even number of ranks (2 or more), got {world}")
    kind = args.device
    mesh_tp4 = init_device_mesh(kind, (world // 4, 4), mesh_dim_names=("dp", "tp")) if world % 4 == 0 else None
    return Context(
        rank, world, _rank_device(kind), args.compiler, _shared_directory(args.checkpoint_dir, rank),
        mesh_2d=init_device_mesh(kind, (world // 2, 2), mesh_dim_names=("dp", "tp")),
        mesh_tp=init_device_mesh(kind, (world,), mesh_dim_names=("tp",)),
        mesh_tp4=mesh_tp4,
    )


def _rank_device(kind: str) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _shared_directory(parent: str | None, rank: int) -> str:
    """A fresh directory rank 0 makes under ``parent`` (the system's temporary directory by
    default: every rank of one host sees it), so no earlier checkpoint is found there."""
    path = [tempfile.mkdtemp(prefix="gpu-check-", dir=parent) if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _llama(ctx: Context) -> Llama:
    torch.manual_seed(0)  # every rank builds the same model
    return Llama(CONFIG).to(ctx.device)


def _batch(ctx: Context, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch every dp size of the job divides (2 sequences per rank)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.vocab_size, (2 * ctx.world, SEQ + 1), generator=gen)
    return tokens[:, :-1].to(ctx.device), tokens[:, 1:].to(ctx.device)


def _dp_slice(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    index, count = autoshard.data_parallel_rank(mesh)
    return tensor.chunk(count)[index]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _mean_over_dp(loss: torch.Tensor, mesh: DeviceMesh) -> float:
    total = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().clone()
    for axis in mesh.mesh_dim_names:
        if axis != "tp":
            dist.all_reduce(total, group=mesh.get_group(axis))
    return total.item() / autoshard.data_parallel_rank(mesh)[1]


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # momentum: optimizer state that checkpoints carry


@contextlib.contextmanager
def _default_device(device: str):
    previous = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(previous)


# --- training against one device ---------------------------------------------------------------


@dataclasses.dataclass
class Run:
    losses: list[float]
    state: dict[str, torch.Tensor]  # each parameter after the last step, by FQN


def _one_device(model, tokens, targets, steps: int = STEPS) -> Run:
    model = copy.deepcopy(model)
    optimizer = _sgd(model.parameters())
    losses = [_step(model, optimizer, tokens, targets).item() for _ in range(steps)]
    return Run(losses, {fqn: param.detach().clone() for fqn, param in model.named_parameters()})


def _step(model, optimizer, tokens, targets, vocab_parallel: bool = False) -> torch.Tensor:
    with loss_parallel() if vocab_parallel else contextlib.nullcontext():
        loss = _loss(model(tokens), targets)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def _sharded_steps(sharded, optimizer, mesh, tokens, targets, steps: int = STEPS,
                   vocab_parallel: bool = False) -> list[float]:
    local, local_targets = _dp_slice(tokens, mesh), _dp_slice(targets, mesh)
    return [_mean_over_dp(_step(sharded, optimizer, local, local_targets, vocab_parallel), mesh)
            for _ in range(steps)]


def _compared(want: Run, losses: list[float], state: dict | None, tolerance: float, where: str) -> Measured:
    """The losses (and, given ``state``, the weights after the last step) against one device's."""
    errors = {"loss": max(abs(g - w) / abs(w) for g, w in zip(losses, want.losses, strict=True))}
    if state is not None:
        errors["weights"] = max(_rel_error(_full(state[fqn]), value) for fqn, value in want.state.items())
    return Measured(errors, tolerance, where)


def _mesh_text(mesh: DeviceMesh) -> str:
    return " x ".join(f"{name}={size}" for name, size in zip(mesh.mesh_dim_names, mesh.shape, strict=True))


def _trains_like_one_device(ctx: Context, mesh: DeviceMesh, tolerance: float = FP32_TOL, weights: bool = True,
                            vocab_parallel: bool = False, tp_wire: str | None = None, **options) -> Measured:
    """``STEPS`` SGD steps sharded with ``options`` against one device; ``tp_wire``: a kind of tp
    collective the plan must run (the path the check is about)."""
    model = _llama(ctx)
    tokens, targets = _batch(ctx)
    want = _one_device(model, tokens, targets)
    sharded = autoshard.autoshard(model, mesh, example_inputs=(_dp_slice(tokens, mesh),), check=False, **options)
    on_wire = sharded.autoshard_plan.predicted_comm()["tp"]
    if tp_wire is not None and tp_wire not in on_wire:
        raise RuntimeError(f"the plan runs no {tp_wire} over tp (it runs {sorted(on_wire)})")
    losses = _sharded_steps(sharded, _sgd(sharded.parameters()), mesh, tokens, targets, vocab_parallel=vocab_parallel)
    where = _mesh_text(mesh) + (f", tp {tp_wire}" if tp_wire else "")
    return _compared(want, losses, sharded.state_dict() if weights else None, tolerance, where)


# --- the checks --------------------------------------------------------------------------------


def _per_rank_values(ctx: Context, size: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every tp rank's partial value (each rank makes all of them: one device's view of the job)."""
    return [(torch.randn(6, 8, 8, generator=torch.Generator().manual_seed(100 + r)) * 3).to(ctx.device, dtype)
            for r in range(size)]


def check_tp_collectives(ctx: Context) -> Measured:
    """Every tp collective autoshard emits, in fp32 over all ranks, forward and backward."""
    group = ctx.mesh_tp.get_group("tp")
    name, size, rank = group.group_name, group.size(), dist.get_rank(group)
    values = _per_rank_values(ctx, size, torch.float32)
    mine, total = values[rank], torch.stack(values).sum(0)
    pieces = [v.chunk(size, dim=2)[r] for r, v in enumerate(values)]
    ops = torch.ops.autoshard
    errors = {
        "all-reduce": _rel_error(ops.reduce_partial(mine, name), total),
        "reduce-scatter": _rel_error(ops.reduce_scatter_partial(mine, 1, name), total.chunk(size, dim=1)[rank]),
        "all-gather": _rel_error(ops.gather_shards(pieces[rank], 2, name), torch.cat(pieces, dim=2)),
    }
    x = torch.zeros_like(mine, requires_grad=True)
    ops.enter_tp(x, name).backward(mine)
    errors["all-reduce"] = max(errors["all-reduce"], _rel_error(x.grad, total))
    whole = values[0].clone().requires_grad_(True)
    ops.take_shard(whole, 2, name).backward(pieces[rank])
    errors["all-gather"] = max(errors["all-gather"], _rel_error(whole.grad, torch.cat(pieces, dim=2)))
    return Measured(errors, COLLECTIVE_TOL, f"tp={size}")


def check_bf16_tp_sums(ctx: Context) -> Measured | Skipped:
    """bf16 partial sums on 4 tp ranks: an all-to-all of the bf16 chunks, an fp32 add, an all-gather
    of the sums; exactly the fp32 sum of the same values on one device, rounded once."""
    if ctx.mesh_tp4 is None:
        return Skipped(f"needs a multiple of 4 ranks (have {ctx.world})")
    group = ctx.mesh_tp4.get_group("tp")
    name, size, rank = group.group_name, group.size(), dist.get_rank(group)
    values = _per_rank_values(ctx, size, torch.bfloat16)
    mine, total = values[rank], torch.stack(values).float().sum(0).to(torch.bfloat16)
    ops = torch.ops.autoshard
    errors = {
        "all-reduce": _rel_error(ops.reduce_partial(mine, name, torch.float32), total),
        "reduce-scatter": _rel_error(ops.reduce_scatter_partial(mine, 1, name, torch.float32),
                                     total.chunk(size, dim=1)[rank]),
    }
    x = torch.zeros_like(mine, requires_grad=True)
    ops.enter_tp(x, name, torch.float32).backward(mine)
    errors["backward all-reduce"] = _rel_error(x.grad, total)
    return Measured(errors, 0.0, f"tp={size}")


def check_fp32_training(ctx: Context) -> Measured:
    return _trains_like_one_device(ctx, ctx.mesh_2d)


def check_bf16_training_on_tp4(ctx: Context) -> Measured | Skipped:
    """bf16 mixed precision on tp=4, where every tp sum takes the all-to-all path; its losses
    against the fp32 device."""
    if ctx.mesh_tp4 is None:
        return Skipped(f"needs a multiple of 4 ranks (have {ctx.world})")
    return _trains_like_one_device(ctx, ctx.mesh_tp4, BF16_TOL, weights=False, tp_wire="all_to_all", mp_policy=BF16)


def check_quantized_all_gather(ctx: Context) -> Measured:
    """fp8 blocks through FSDP's all-gather: the first step's gradients are those one device
    computes at the weights dequantized from the same blocks."""
    mesh = ctx.mesh_2d
    model = _llama(ctx)
    tokens, targets = _batch(ctx)
    sharded = autoshard.autoshard(model, mesh, example_inputs=(_dp_slice(tokens, mesh),), check=False,
                                  all_gather_quant=FP8)
    plan = sharded.autoshard_plan
    quantized = sum(1 for p in plan.params.values() if p.gather is not None and p.gather.quantized)
    if not quantized:
        raise RuntimeError(f"no weight's tile on {_mesh_text(mesh)} holds whole {FP8.block}x{FP8.block} blocks")
    _loss(sharded(_dp_slice(tokens, mesh)), _dp_slice(targets, mesh)).backward()
    reference = _at_dequantized_weights(model, plan)
    _loss(reference(tokens), targets).backward()
    error = 0.0
    for fqn, param in sharded.named_parameters():
        grad = _full(param.grad)
        grad = grad.t() if plan.params[fqn].transposed else grad
        error = max(error, _rel_error(grad, reference.get_parameter(fqn).grad))
    return Measured({"gradients": error}, FP32_TOL, f"{_mesh_text(mesh)}, {quantized} weights gathered in fp8")


def _at_dequantized_weights(model, plan):
    """A copy of ``model`` whose quantized weights hold what the sharded matmuls read: the stored
    layout quantized and dequantized block by block (blocks never cross a rank's tile)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for fqn, entry in plan.params.items():
            if entry.gather is None or not entry.gather.quantized:
                continue
            weight = model.get_parameter(fqn)
            stored = weight.t() if entry.transposed else weight
            seen = dequantize_blocks(*quantize_blocks(stored, FP8), FP8, torch.float32)
            weight.copy_(seen.t() if entry.transposed else seen)
    return model


def check_compile_backend(ctx: Context) -> Measured:
    """``torch.compile`` with autoshard's backend, each block compiled by ``--compiler``."""
    mesh = ctx.mesh_2d
    model = _llama(ctx)
    tokens, targets = _batch(ctx)
    want = _one_device(model, tokens, targets)
    torch._dynamo.reset()
    backend = autoshard.backend(mesh, compiler=ctx.compiler)
    compiled = torch.compile(model, backend=backend)
    optimizer = backend.attach(_sgd(model.parameters()))
    losses = _sharded_steps(compiled, optimizer, mesh, tokens, targets)
    return _compared(want, losses, backend.state_dict(), FP32_TOL, f"{_mesh_text(mesh)}, {ctx.compiler}")


def check_checkpoint_across_meshes(ctx: Context) -> Measured:
    """A model and its SGD momentum saved on dp x tp after one step, loaded on tp only into a model
    initialized otherwise; one more step there gives one device's loss and weights."""
    model = _llama(ctx)
    first, second = _batch(ctx), _batch(ctx, seed=1)
    reference = copy.deepcopy(model)
    reference_optimizer = _sgd(reference.parameters())
    for batch in (first, second):
        _step(reference, reference_optimizer, *batch)
    with torch.no_grad():
        want_loss = _loss(reference(second[0]), second[1]).item()

    saved_on = ctx.mesh_2d
    sharded = autoshard.autoshard(model, saved_on, example_inputs=(_dp_slice(first[0], saved_on),), check=False)
    optimizer = _sgd(sharded.parameters())
    _sharded_steps(sharded, optimizer, saved_on, *first, steps=1)
    checkpoint.save_checkpoint(ctx.directory, 0, sharded, optimizer)
    mesh = ctx.mesh_tp
    torch.manual_seed(1)
    other = Llama(CONFIG).to(ctx.device)  # other weights: only the checkpoint can make it agree
    loaded = autoshard.autoshard(other, mesh, example_inputs=(_dp_slice(first[0], mesh),), check=False)
    loaded_optimizer = _sgd(loaded.parameters())
    if checkpoint.load_latest(ctx.directory, loaded, loaded_optimizer) != 0:
        raise RuntimeError(f"the checkpoint saved on {_mesh_text(saved_on)} did not load on {_mesh_text(mesh)}")
    _sharded_steps(loaded, loaded_optimizer, mesh, *second, steps=1)
    with torch.no_grad():
        loss = _mean_over_dp(_loss(loaded(_dp_slice(second[0], mesh)), _dp_slice(second[1], mesh)), mesh)
    state = loaded.state_dict()
    errors = {"loss": abs(loss - want_loss) / abs(want_loss),
              "weights": max(_rel_error(_full(state[fqn]), param) for fqn, param in reference.named_parameters())}
    return Measured(errors, FP32_TOL, f"saved on {_mesh_text(saved_on)}, loaded on {_mesh_text(mesh)}")


def check_sequence_and_loss_parallel(ctx: Context) -> Measured:
    return _trains_like_one_device(ctx, ctx.mesh_2d, vocab_parallel=True, tp_wire="reduce_scatter",
                                   sequence_parallel=True, loss_parallel=True)


def check_default_device_elsewhere(ctx: Context) -> Measured:
    """Sharded and trained with torch's default device set to ``meta``, never the mesh's: a
    tensor autoshard made without ``device=`` would fail (a CPU one would on a GPU)."""
    model = _llama(ctx)
    tokens, targets = _batch(ctx)
    want = _one_device(model, tokens, targets)
    mesh = ctx.mesh_2d
    with _default_device(ELSEWHERE):
        sharded = autoshard.autoshard(model, mesh, example_inputs=(_dp_slice(tokens, mesh),), check=False)
        losses = _sharded_steps(sharded, _sgd(sharded.parameters()), mesh, tokens, targets)
        state = {key: _full(value) for key, value in sharded.state_dict().items()}
    return _compared(want, losses, state, FP32_TOL, f"{_mesh_text(mesh)}, default device {ELSEWHERE}")


CHECKS = {
    "tp collectives (fp32)": check_tp_collectives,
    "bf16 tp sums: all-to-all + all-gather": check_bf16_tp_sums,
    "training fp32 (dp x tp)": check_fp32_training,
    "training bf16 (tp=4)": check_bf16_training_on_tp4,
    "quantized all-gather (fp8 blocks)": check_quantized_all_gather,
    "torch.compile backend": check_compile_backend,
    "checkpoint saved and loaded across meshes": check_checkpoint_across_meshes,
    "sequence + loss parallel": check_sequence_and_loss_parallel,
    "default device other than the mesh's": check_default_device_elsewhere,
}


# --- running -----------------------------------------------------------------------------------


def run_checks(rank: int, world: int, args: argparse.Namespace) -> int:
    """Every check on every rank; rank 0 prints one line per check and returns how many failed."""
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    ctx = build_context(rank, world, args)
    failures = 0
    try:
        for name, check in CHECKS.items():
            outcomes = [None] * world
            dist.all_gather_object(outcomes, _outcome(check, ctx))
            status, detail = combined(outcomes)
            failures += status == "FAIL"
            if rank == 0:
                print(line(name, status, detail), flush=True)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(ctx.directory, ignore_errors=True)
    return failures


def _outcome(check, ctx: Context):
    try:
        return check(ctx)
    except Exception as err:  # one line for the report; the check's own message says what broke
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return Failed(f"{type(err).__name__}: {first}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (NCCL, one GPU per rank) or cpu (gloo) (default: cuda when available)")
    parser.add_argument("--ranks", type=int, default=None,
                        help="local ranks to start without a launcher (default: every GPU, or 4 CPU ranks)")
    parser.add_argument("--compiler", choices=("inductor", "aot_eager", "eager"), default=None,
                        help="the compile check's compiler for each block (default: inductor on cuda, eager on cpu)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where the checkpoint check writes (in a fresh directory it removes after); "
                             "default: the system's temporary directory; for a job over several hosts, a "
                             "directory on a filesystem every rank sees")
    parser.add_argument("--skip", metavar="REASON", default=None,
                        help="run nothing: print every check's line as SKIP with this reason")
    args = parser.parse_args(argv)
    if args.compiler is None:
        args.compiler = "inductor" if args.device == "cuda" else "eager"
    if args.ranks is None:
        args.ranks = torch.cuda.device_count() if args.device == "cuda" else 4
    return args


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_in_launcher_process(args: argparse.Namespace) -> int:
    """One rank started by torchrun."""
    if args.device == "cpu":
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5))
    try:
        return run_checks(dist.get_rank(), dist.get_world_size(), args)
    finally:
        dist.destroy_process_group()


def run_spawned(args: argparse.Namespace) -> int:
    """No launcher: ``--ranks`` local processes through autoshard's launcher (torchrun's agent)."""
    backend = "nccl" if args.device == "cuda" else "gloo"
    return spawn(run_checks, world_size=args.ranks, args=(args,), backend=backend,
                 timeout=datetime.timedelta(minutes=5))[0]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.skip is not None:
        for name in CHECKS:
            print(line(name, "SKIP", args.skip))
        return 0
    failures = run_in_launcher_process(args) if under_launcher() else run_spawned(args)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
