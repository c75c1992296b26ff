"""Demo: train a small Llama sharded by autoshard over a ("dp", "tp") mesh.

Run from the repository root:

    python examples/train_llama.py                    # spawns dp*tp local CPU ranks (gloo)
    python examples/train_llama.py --replicate 2      # HSDP: ("dp_replicate", "dp_shard", "tp") = (2, 2, 2)
    python examples/train_llama.py --compile aot_eager  # torch.compile with autoshard's backend
    python examples/train_llama.py --all-gather-quant fp8  # FSDP all-gathers fp8 blocks
    torchrun --nproc-per-node 4 examples/train_llama.py --device cuda

Rank 0 prints the sharding plan, then trains the sharded model next to a
single-process reference (a copy of the model taken before sharding, trained
on the global batch) and shows both losses on a progress bar. At the end it
prints how much parameter memory each rank holds and the worst loss
difference; the process exits with status 1 if that difference exceeds
``PARITY_TOLERANCE`` (relative), so ``make demo`` fails loudly when sharding
stops reproducing single-device training.
"""

from __future__ import annotations

import os
import sys

# `python examples/train_llama.py` puts examples/ on sys.path, not the root.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import argparse  # noqa: E402
import copy  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from tqdm import tqdm  # noqa: E402

import autoshard  # noqa: E402
from autoshard.adapters.launch import spawn  # noqa: E402
from examples.models import Llama, LlamaConfig  # noqa: E402

PARITY_TOLERANCE = 1e-4  # max |loss - reference| / |reference| over the run
BF16_TOLERANCE = 3e-2  # the same, for a bf16 run against the fp32 reference
QUANT_TOLERANCE = 3e-2  # the same, for a quantized all-gather against the unquantized reference

CONFIG = LlamaConfig(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden=128)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a small Llama sharded by autoshard (FSDP over dp x tensor parallel over tp) "
        "and check its loss against a single-process reference. Without a launcher it spawns "
        "dp*tp local processes; under torchrun it uses the launcher's processes.",
    )
    parser.add_argument("--dp", type=int, default=2, help="data-parallel (FSDP) mesh size (default: 2)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel mesh size (default: 2)")
    parser.add_argument(
        "--replicate", type=int, default=1,
        help="HSDP: replicas of each FSDP shard group; >1 builds the mesh (dp_replicate, dp_shard, tp) = "
        "(replicate, dp, tp) (default: 1, plain FSDP over dp)",
    )
    parser.add_argument("--steps", type=int, default=20, help="training steps (default: 20)")
    parser.add_argument("--batch", type=int, default=8, help="global batch size in sequences (default: 8)")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default: 32)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the model and the data (default: 0)")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cpu (gloo, 1 thread per rank) or cuda (nccl, one GPU per rank) (default: cpu)",
    )
    parser.add_argument(
        "--compile", choices=("none", "aot_eager", "inductor"), default="none",
        help="shard with torch.compile(model, backend=autoshard.backend(mesh, compiler=...)) instead of "
        "autoshard.autoshard (default: none)",
    )
    parser.add_argument(
        "--bf16", action="store_true",
        help="bf16 mixed precision: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32); the "
        f"loss is then compared with the fp32 reference at {BF16_TOLERANCE:.0e} relative",
    )
    parser.add_argument(
        "--all-gather-quant", choices=("none", "fp8", "int8"), default="none",
        help="quantize FSDP's all-gather block by block (autoshard.BlockQuant, blocks of --quant-block) "
        "(default: none)",
    )
    parser.add_argument("--quant-block", type=int, default=16,
                        help="square block size for --all-gather-quant (default: 16, fits the demo's tiles)")
    parser.add_argument(
        "--activation-checkpointing", choices=("none", "full", "selective"), default="none",
        help="recompute each block in backward (full) or all but its matmuls and collectives (selective)",
    )
    args = parser.parse_args(argv)
    if args.batch % (args.dp * args.replicate):
        parser.error(f"--batch {args.batch} must be divisible by --dp x --replicate = {args.dp * args.replicate}")
    if args.seq_len > CONFIG.max_seq_len:
        parser.error(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {CONFIG.max_seq_len}")
    return args


# --- data ---------------------------------------------------------------------------------------


def token_rule(seed: int) -> torch.Tensor:
    """A fixed random permutation of the vocabulary: token ``t`` is always followed by ``rule[t]``.

    A rule the model can actually learn makes the loss drop visibly within
    a few steps, which a purely random stream would not.
    """
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(CONFIG.vocab_size, generator=gen)


def global_batch(rule: torch.Tensor, step: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's (inputs, targets), identical on every rank: random starts, then follow ``rule``.

    Seeded by the step, so no rank needs to communicate to agree on the data.
    """
    gen = torch.Generator().manual_seed(args.seed * 100_003 + step)
    tokens = torch.empty(args.batch, args.seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(CONFIG.vocab_size, (args.batch,), generator=gen)
    for t in range(args.seq_len):
        tokens[:, t + 1] = rule[tokens[:, t]]
    return tokens[:, :-1].to(args.device), tokens[:, 1:].to(args.device)


def dp_slice(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's share of the global batch; the tp ranks of one data-parallel coordinate
    (one dp rank, or one (dp_replicate, dp_shard) pair under HSDP) get the same share."""
    index, count = autoshard.data_parallel_rank(mesh)
    return tensor.chunk(count)[index]


# --- training -----------------------------------------------------------------------------------


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def mean_over_dp(loss: torch.Tensor, mesh: DeviceMesh) -> float:
    """The global-batch loss: dp slices are equal-sized, so it is the mean of the local means."""
    total = loss.detach().clone()
    for axis in mesh.mesh_dim_names:
        if axis != "tp":
            dist.all_reduce(total, group=mesh.get_group(axis))
    return total.item() / autoshard.data_parallel_rank(mesh)[1]


def train_step(model, optimizer, inputs, targets) -> torch.Tensor:
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


class Progress:
    """Rank 0's progress with ``tqdm``: a live bar on a terminal; in a log (not a terminal)
    one line per step, so the losses stay readable in CI output."""

    def __init__(self, steps: int):
        self.interactive = sys.stdout.isatty()
        self.bar = tqdm(total=steps, desc="training", unit="step", file=sys.stdout, disable=not self.interactive)

    def update(self, step: int, loss: float, reference: float) -> None:
        stats = f"loss {loss:.4f}  reference {reference:.4f}  |diff| {abs(loss - reference):.1e}"
        if self.interactive:
            self.bar.set_postfix_str(stats, refresh=False)
            self.bar.update(1)
        else:
            print(f"step {step}/{self.bar.total}  {stats}", flush=True)

    def close(self) -> None:
        self.bar.close()


# --- memory report ------------------------------------------------------------------------------


def param_bytes(module) -> int:
    """Bytes of parameters this rank actually stores (a DTensor's local shard only)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def memory_report(sharded, full_bytes: int, mesh: DeviceMesh, rank: int) -> str | None:
    """Gather every rank's parameter bytes; rank 0 gets the table, the others ``None``.

    ``sharded`` is anything with ``parameters()``: the sharded module, or the compile backend.
    """
    mine = (rank, tuple(mesh.get_coordinate()), param_bytes(sharded))
    everyone = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    if rank != 0:
        return None
    sharding = mesh.size() // (mesh["dp_replicate"].size() if "dp_replicate" in mesh.mesh_dim_names else 1)
    names = ",".join(mesh.mesh_dim_names)
    lines = [f"parameter memory per rank (full model: {full_bytes:,} bytes; ideal fraction "
             f"1/(dp*tp) = {1 / sharding:.3f})",
             f"{'rank':>4}  {f'({names})':>{len(names) + 2}}  {'bytes':>9}  {'fraction':>8}"]
    for r, coordinate, nbytes in everyone:
        where = f"({','.join(map(str, coordinate))})"
        lines.append(f"{r:>4}  {where:>{len(names) + 2}}  {nbytes:>9,}  {nbytes / full_bytes:>8.3f}")
    return "\n".join(lines)


# --- the per-rank program -----------------------------------------------------------------------


def main_fn(rank: int, world_size: int, args: argparse.Namespace) -> dict | None:
    """Run on every rank; rank 0 returns the parity result the launcher turns into an exit code."""
    if world_size != world_size_of(args):
        raise ValueError(f"world size {world_size} != replicate*dp*tp = {args.replicate}*{args.dp}*{args.tp}")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if args.replicate > 1:
        mesh = init_device_mesh(args.device, (args.replicate, args.dp, args.tp),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    else:
        mesh = init_device_mesh(args.device, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(args.seed)  # every rank builds the same model
    model = Llama(CONFIG).to(args.device)
    reference = copy.deepcopy(model) if rank == 0 else None
    full_bytes = param_bytes(model)

    rule = token_rule(args.seed)
    inputs, _ = global_batch(rule, 0, args)
    example = (dp_slice(inputs, mesh),)
    if rank == 0:
        print(autoshard.plan(model, mesh, example_inputs=example), flush=True)
    options = {}
    if args.bf16:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if args.activation_checkpointing != "none":
        options["activation_checkpointing"] = args.activation_checkpointing
    if args.all_gather_quant != "none":
        dtype = torch.float8_e4m3fn if args.all_gather_quant == "fp8" else torch.int8
        options["all_gather_quant"] = autoshard.BlockQuant(dtype, args.quant_block)
    if args.compile == "none":
        sharded = trained = autoshard.autoshard(model, mesh, example_inputs=example, **options)
        optimizer = torch.optim.AdamW(sharded.parameters(), lr=args.lr)
    else:  # sharded on the first call; the attached optimizer steps the shards
        trained = autoshard.backend(mesh, compiler=args.compile, **options)
        sharded = torch.compile(model, backend=trained)
        optimizer = trained.attach(torch.optim.AdamW(model.parameters(), lr=args.lr))
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr) if rank == 0 else None
    progress = Progress(args.steps) if rank == 0 else None
    if rank == 0:
        print(f"\ntraining {args.steps} steps on {args.batch}x{args.seq_len} tokens per step "
              f"({' x '.join(f'{a}={n}' for a, n in zip(mesh.mesh_dim_names, mesh.shape, strict=True))}, "
              f"{args.device}"
              f"{'' if args.compile == 'none' else ', compiled with ' + args.compile})", flush=True)
    max_diff = max_rel = 0.0
    start = time.perf_counter()
    for step in range(args.steps):
        inputs, targets = global_batch(rule, step, args)
        local = train_step(sharded, optimizer, dp_slice(inputs, mesh), dp_slice(targets, mesh))
        loss = mean_over_dp(local, mesh)
        if rank == 0:
            ref_loss = train_step(reference, ref_optimizer, inputs, targets).item()
            diff = abs(loss - ref_loss) if math.isfinite(loss - ref_loss) else math.inf  # NaN must fail
            max_diff, max_rel = max(max_diff, diff), max(max_rel, diff / abs(ref_loss))
            progress.update(step + 1, loss, ref_loss)
    elapsed = time.perf_counter() - start

    report = memory_report(trained, full_bytes, mesh, rank)
    if rank != 0:
        return None
    progress.close()
    print(f"{args.steps} steps in {elapsed:.1f} s\n\n{report}\n")
    print(f"max |loss - reference| = {max_diff:.2e} (relative {max_rel:.2e}, tolerance {tolerance(args):.0e})",
          flush=True)
    return {"max_abs_diff": max_diff, "max_rel_diff": max_rel}


def world_size_of(args: argparse.Namespace) -> int:
    return args.replicate * args.dp * args.tp


def tolerance(args: argparse.Namespace) -> float:
    if args.all_gather_quant != "none":
        return QUANT_TOLERANCE
    return BF16_TOLERANCE if args.bf16 else PARITY_TOLERANCE


# --- launching ----------------------------------------------------------------------------------


def under_launcher() -> bool:
    """torchrun (or any launcher) exports RANK and WORLD_SIZE; a plain ``python`` run does not."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_in_launcher_process(args: argparse.Namespace) -> dict | None:
    """This process is one rank started by torchrun: join the group and run ``main_fn``."""
    if args.device == "cpu":
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        return main_fn(dist.get_rank(), dist.get_world_size(), args)
    finally:
        dist.destroy_process_group()


def run_spawned(args: argparse.Namespace) -> dict | None:
    """No launcher: start replicate*dp*tp local processes; rank 0's result comes back here."""
    backend = "nccl" if args.device == "cuda" else "gloo"
    return spawn(main_fn, world_size=world_size_of(args), args=(args,), backend=backend)[0]


if __name__ == "__main__":
    cli_args = parse_args()
    result = run_in_launcher_process(cli_args) if under_launcher() else run_spawned(cli_args)
    if result is not None and result["max_rel_diff"] > tolerance(cli_args):
        print(f"FAILED: the sharded loss differs from the reference by {result['max_rel_diff']:.2e} "
              f"(relative) > {tolerance(cli_args):.0e}", file=sys.stderr)
        raise SystemExit(1)
