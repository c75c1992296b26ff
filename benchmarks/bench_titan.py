"""Benchmark autoshard against torchtitan's own Llama-3 and its own ``parallelize_llama``.

``make bench-titan`` (``python benchmarks/bench_titan.py``) trains torchtitan 0.3.0's
Llama-3 model code (``torchtitan.models.llama3``: fused ``wqkv``, RMSNorm, complex RoPE,
SwiGLU FFN, untied LM head) at a tiny size (4 layers, dim 128, 8 heads, 4 kv heads, FFN 256,
vocabulary 256) twice from the same initial weights on the same batches: once parallelized
by torchtitan's ``parallelize_llama`` and once by ``autoshard.autoshard``. 4 CPU processes on
gloo, one launch per mesh running every variant: dp=2 x tp=2 and tp=4 (dp=1), each in fp32
and bf16, and tp=4 with 2 kv heads (``tp4-kv2``: fewer kv heads than tp ranks; torchtitan's config
check refuses it, so autoshard runs alone, against one device, its fused ``wqkv`` keeping k and v
whole on every rank) (FSDP2 ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on both
sides: torchtitan's ``training.mixed_precision_param``, autoshard's ``mp_policy``). A third
variant, autoshard with ``loss_parallel=True``, shows what keeping the logits vocabulary-sharded
(as torchtitan always does under tp) changes.

Per configuration it prints median step time, tp and dp collectives and ring wire bytes per
step by kind, held-for-backward bytes per block, and loss agreement over the 10 steps (against
torchtitan and against one device), then the tp collectives of one step of each side with
shape, dtype, wire bytes and the op or module that issued them (rank 0; ranks agree). All of
it goes to ``benchmarks/results/bench_titan.json``.

What was adapted to run torchtitan on this CPU machine, and why:

* Imports. torchtitan is installed with ``--no-deps`` (its dependencies pull CUDA wheels and
  data stacks). ``install_import_stubs`` puts inert modules in front of three imports the
  Llama-3 path reaches but never uses: ``tyro`` (CLI parsing; only ``Annotated`` metadata and
  a registry object are evaluated at import), ``torchtitan.distributed.minimal_async_ep.kernels``
  (triton kernels for MoE expert parallelism; the module is stubbed, not ``triton``, because a
  fake ``triton`` would make torch believe triton is available) and ``torchtitan.trainer``
  (the launcher, which needs torchdata, datasets, tokenizers, wandb and tensorboard;
  ``Decoder.Config.update_from_config`` imports it only for an ``isinstance`` check).
  ``torchvision`` is imported only by torchtitan's multimodal datasets, which this path does
  not reach, so it needs no stub.
* No Trainer. The Trainer needs a tokenizer, a dataloader and a GPU, so this file does what
  ``Trainer.__init__`` and ``forward_backward_step`` do for a dense model without pipeline
  parallelism: ``ParallelDims.from_config`` + ``build_mesh``, ``set_spmd_backend``,
  ``model_config.update_from_config``, build, ``parallelize_llama``, then per step
  ``CrossEntropyLoss(global_vocab_size=V)`` of the model's output divided by the global token
  count, backward, optimizer step.
* Config fields set: ``parallelism.tensor_parallel_degree`` = tp,
  ``data_parallel_shard_degree`` = dp, ``enable_sequence_parallel=False`` (autoshard's default
  is no sequence parallelism; torchtitan's is on), ``spmd_backend="partial_dtensor"``;
  ``training.mixed_precision_param`` = ``float32`` or ``bfloat16``,
  ``mixed_precision_reduce="float32"``; ``CompileConfig()`` (compile off), no activation
  checkpointing, no float8/quantization converters, no gradient clipping, plain
  ``torch.optim.AdamW(lr=1e-3)`` on both sides.
* ``spmd_backend``: torchtitan 0.3.0 defaults to ``"spmd_types"``, whose parameters are plain
  local tensors that a newer ``fully_shard`` turns into DTensors; torch 2.13's ``fully_shard``
  refuses them ("all parameters must be DTensors on the full SPMD mesh"). ``partial_dtensor``
  (DTensor on the tensor-parallel axis, FSDP2 on the dp axis) is the backend that runs on
  torch 2.13; it uses the same sharding configs (``set_llama3_sharding_config``).
* Attention: torchtitan's language-model configs accept only flex or varlen attention, which
  do not run on CPU eager; every layer's ``inner_attention`` is torchtitan's own
  ``ScaledDotProductAttention`` (causal), which ``get_attention_config`` no longer offers for
  language models. RoPE's ``max_seq_len`` is the training sequence length, as the Trainer sets it.
* Device: torchtitan's ``device_type`` is ``"cuda"`` when no accelerator is found;
  ``parallel_dims.device_type`` is set to ``"cpu"`` so ``build_mesh`` makes a CPU mesh.
* Gradient reduction: torchtitan sets FSDP's gradient divide factor to 1 (it divides the loss
  by the global token count), which FSDP2 implements with ``ReduceOp.PREMUL_SUM``; gloo has no
  PREMUL_SUM, so every FSDP module also gets ``set_force_sum_reduction_for_comms(True)`` (a
  plain SUM, the same values).
* Weights: the model is built on CPU and initialized by torchtitan's own ``init_weights`` under
  one seed before either side parallelizes it (the Trainer builds on meta and initializes after
  parallelizing), so both sides start from the same full weights.

Method: step = zero_grad + forward + loss + backward + AdamW step, each started after a
barrier; a step's time is the max over ranks; the median is over steps 2..10 (step 1 includes
FSDP's lazy initialization). Losses are the global-batch mean cross-entropy of each step before
its update. The single-device reference trains the unparallelized model on the global batch in
the driver process (fp32; a bf16 run's difference to it includes bf16 rounding). After the 10
steps one more step runs under ``CollectiveLog`` with autograd anomaly mode on (which records
each backward node's forward stack, used to name the op a backward collective belongs to);
then ``held_for_backward``. Wire bytes follow ``autoshard.adapters.comm_stats`` (ring model, per rank).
``CollectiveLog`` defers ops on DTensors to DTensor, so the collectives DTensor issues inside an
op (torchtitan's activations and gradients are DTensors: the redistributions its sharding rules
choose in backward, torch's loss parallelism) are counted too; a plain ``CollectiveCounter``
handles such an op with itself switched off and misses them (on torchtitan fp32 2x2: 34 of 58).
A collective on a group over the same ranks as an axis counts for that axis.
"""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from tests.corpus import install_stubs, titan_llama3_config  # noqa: E402


def install_import_stubs() -> None:
    """torchtitan's stubs (tests/corpus.py: ``tyro``, its async-EP kernels, ``torchtitan.trainer``);
    idempotent, and run at import so spawned ranks (which re-import this file) get them too."""
    install_stubs("torchtitan")


install_import_stubs()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.distributed_c10d import _resolve_process_group  # noqa: E402
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import loss_parallel  # noqa: E402

import autoshard  # noqa: E402
from autoshard.adapters.comm_stats import CollectiveCounter  # noqa: E402
from autoshard.adapters.launch import spawn  # noqa: E402
from benchmarks.bench_2d import comm_summary, fmt, max_over_ranks, quiet_known_warnings, ratio  # noqa: E402
from tests.parity import held_for_backward  # noqa: E402

NUM_LAYERS, DIM, NUM_HEADS, NUM_KV_HEADS, FFN_HIDDEN, VOCAB = 4, 128, 8, 4, 256, 256
GLOBAL_BATCH, SEQ_LEN = 8, 32
STEPS = 10
LR = 1e-3
SEED = 0
WORLD_SIZE = 4
# (dp, tp, kv heads): tp4-kv2 has fewer kv heads than tp ranks, which torchtitan refuses
MESHES = {"2x2": (2, 2, NUM_KV_HEADS), "tp4": (1, 4, NUM_KV_HEADS), "tp4-kv2": (1, 4, 2)}
DTYPES = ("fp32", "bf16")
VARIANTS = ("torchtitan", "autoshard", "autoshard_lp")
VARIANT_TITLES = {"torchtitan": "torchtitan", "autoshard": "autoshard", "autoshard_lp": "autoshard+lp"}
KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
SPAWN_TIMEOUT = datetime.timedelta(minutes=20)
DEFAULT_OUT = os.path.join(REPO_ROOT, "benchmarks", "results", "bench_titan.json")


# --------------------------------------------------------------------------- torchtitan's model


def parallelism_config(dp: int, tp: int):
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(tensor_parallel_degree=tp, data_parallel_shard_degree=dp,
                             enable_sequence_parallel=False, spmd_backend="partial_dtensor")


def model_config(dp: int, tp: int, kv_heads: int = NUM_KV_HEADS):
    """torchtitan's Llama-3 config helpers at a tiny size, SDPA attention, RoPE sized to the sequence.

    ``update_from_config`` validates that tp divides the (kv) heads and attaches torchtitan's
    sharding configs, as the Trainer does before building.
    """
    config = titan_llama3_config(dim=DIM, n_heads=NUM_HEADS, n_kv_heads=kv_heads, n_layers=NUM_LAYERS,
                                 hidden_dim=FFN_HIDDEN, vocab=VOCAB, seq=SEQ_LEN)
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism_config(dp, tp)))
    return config


def initial_model(dp: int, tp: int, kv_heads: int = NUM_KV_HEADS) -> torch.nn.Module:
    """The single-device model every variant starts from: torchtitan's own init under one seed."""
    torch.manual_seed(SEED)
    model = model_config(dp, tp, kv_heads).build()
    with torch.no_grad():
        model.init_weights()
    return model


# --------------------------------------------------------------------------- data and loss


def global_batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``index``, seeded by its index: every rank, variant and the reference see the same data."""
    gen = torch.Generator().manual_seed(10_000 + index)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=gen)
    targets = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=gen)
    return tokens, targets


def local_batch(index: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = global_batch(index)
    return tokens.chunk(dp)[dp_rank], targets.chunk(dp)[dp_rank]


def mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """In fp32, as torchtitan's loss computes it."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def single_device_losses(steps: int, kv_heads: int = NUM_KV_HEADS) -> list[float]:
    """The unparallelized model trained on the global batches: the losses both sides should reproduce."""
    model = initial_model(1, 1, kv_heads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for i in range(steps):
        tokens, targets = global_batch(i)
        optimizer.zero_grad(set_to_none=True)
        loss = mean_cross_entropy(model(tokens), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


# --------------------------------------------------------------------------- the two sides


@dataclasses.dataclass
class Side:
    """A parallelized model as the training loop sees it.

    ``loss`` is what backward starts from on this rank; ``dp_sum_scale`` turns the dp-sum of
    those into the global mean (torchtitan divides by the global token count, autoshard's
    loss is the local mean); ``groups`` name the mesh axes' process groups for counting.
    """

    module: torch.nn.Module
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    dp_sum_scale: float
    groups: dict[str, dist.ProcessGroup]
    dp_rank: int
    loss_context: Callable = lambda: _null_context()


class _null_context:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def build_torchtitan(model: torch.nn.Module, dp: int, tp: int, dtype: str) -> Side:
    """What the Trainer does for a dense model without pipeline parallelism (see the module docstring)."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import parallelize_llama

    parallel_dims_module.device_type = "cpu"
    parallelism = parallelism_config(dp, tp)
    parallel_dims = ParallelDims.from_config(parallelism, WORLD_SIZE)
    parallel_dims.build_mesh()
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    training = TrainingConfig(mixed_precision_param="bfloat16" if dtype == "bf16" else "float32",
                              mixed_precision_reduce="float32")
    with tempfile.TemporaryDirectory(prefix="bench_titan_") as dump_folder:
        model = parallelize_llama(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                  compile_config=CompileConfig(), ac_config=None, dump_folder=dump_folder)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    criterion = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=VOCAB))
    global_tokens = torch.tensor(float(GLOBAL_BATCH * SEQ_LEN))
    groups = {"tp": parallel_dims.get_mesh("tp").get_group(), "dp": parallel_dims.get_mesh("fsdp").get_group()}
    return Side(model, lambda out, targets: criterion(out, targets, global_tokens)[0], 1.0, groups,
                parallel_dims.get_mesh("fsdp").get_local_rank())


def build_autoshard(model: torch.nn.Module, dp: int, tp: int, dtype: str, lp: bool) -> Side:
    """``autoshard.autoshard`` on a ("dp", "tp") mesh; with ``lp`` the logits stay vocabulary-sharded."""
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bf16" else None
    example = local_batch(0, dp_rank, dp)[0]
    sharded = autoshard.autoshard(model, mesh, example_inputs=(example,), mp_policy=policy, loss_parallel=lp)
    groups = {"tp": mesh.get_group("tp"), "dp": mesh.get_group("dp")}
    return Side(sharded, mean_cross_entropy, 1.0 / dp, groups, dp_rank, loss_parallel if lp else _null_context)


def build_side(variant: str, dp: int, tp: int, dtype: str, kv_heads: int = NUM_KV_HEADS) -> Side:
    if variant == "torchtitan":
        model = initial_model(dp, tp, kv_heads)  # torchtitan's own config check: tp must divide the kv heads
        return build_torchtitan(model, dp, tp, dtype)
    model = initial_model(1, 1, kv_heads)  # the same model: autoshard needs no config of the mesh
    return build_autoshard(model, dp, tp, dtype, lp=variant == "autoshard_lp")


# --------------------------------------------------------------------------- naming each collective


_KEEP_FRAMES = (
    "torchtitan/models", "torchtitan/protocols", "torchtitan/components", "tensor/parallel/loss.py", "<eval_with_key",
)
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


class CollectiveLog(CollectiveCounter):
    """``CollectiveCounter`` that also keeps one record per collective: axis, kind, phase, shape,
    dtype on the wire, wire bytes, and the op or module that issued it.

    Forward: the innermost frames of the model's code on the Python stack (a frame of an
    autoshard GraphModule is named by its unit's FQN, a torchtitan module's redistribution by
    the module's FQN). Backward: the forward stack anomaly mode saved on the autograd node that
    runs, or, inside FSDP's post-backward, the parameter whose gradient FSDP redistributes.
    """

    def __init__(self, axes: dict[str, dist.ProcessGroup], model: torch.nn.Module):
        super().__init__(axes)
        self.records: list[dict] = []
        self._axis_groups = dict(axes)
        self._module_fqn = {id(m): (name or "<root>") for name, m in model.named_modules()}
        self._graph_fqn = {m.forward.__code__.co_filename: (name or "<root>") for name, m in model.named_modules()
                           if isinstance(m, torch.fx.GraphModule)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Defer ops on DTensors to DTensor, so that the collectives it issues inside an op (a
        redistribution its sharding rule needs, loss parallelism's sums) reach this mode as ops on
        plain tensors instead of running below it unseen. Other subclasses (the FakeTensors of
        DTensor's sharding propagation) are handled as before."""
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _record(self, kind: str, group, payload, dtype: torch.dtype | None = None) -> None:
        name = group if isinstance(group, str) else _group_name(group)
        if name not in self._axis_by_group_name:
            self._adopt_group(name)
        axis = self._axis_by_group_name.get(name, "other")
        before = self._bytes.get(axis, 0.0)
        super()._record(kind, group, payload, dtype)
        tensor = payload[0] if isinstance(payload, (list, tuple)) else payload
        node = torch._C._current_autograd_node()
        self.records.append({
            "axis": axis, "kind": kind, "phase": "fwd" if node is None else "bwd",
            "shape": list(tensor.shape), "dtype": str(dtype or tensor.dtype).removeprefix("torch."),
            "wire_bytes": int(round(self._bytes.get(axis, 0.0) - before)),
            "origin": self._origin(node),
        })

    def _adopt_group(self, name: str) -> None:
        """A group over the same ranks as an axis's counts as that axis: torchtitan builds its meshes
        again for each run, and DTensor may issue a collective on an earlier build's group."""
        ranks = dist.get_process_group_ranks(_resolve_process_group(name))
        for axis, group in self._axis_groups.items():
            if dist.get_process_group_ranks(group) == ranks:
                self._axis_by_group_name[name] = axis
                return

    def _origin(self, node) -> str:
        fsdp_grad = _fsdp_grad_param()
        if fsdp_grad is not None:
            return fsdp_grad
        if node is None:
            return self._forward_origin()
        frames = [m.groups() for m in map(_FRAME.search, node.metadata.get("traceback_", [])) if m]
        model_frames = [f for f in frames if f[0] in self._graph_fqn or "torchtitan/models" in f[0]]
        where = self._frame_text(*model_frames[-1]) if model_frames else "?"
        return f"grad of [{where}] ({node.name()})"

    def _forward_origin(self) -> str:
        """The innermost autoshard graph line, torchtitan module boundary, or model source line."""
        innermost, direction = None, "forward"
        frame = sys._getframe(3)
        while frame is not None:
            code = frame.f_code
            if code.co_name in ("_redistribute_inputs", "_redistribute_outputs"):
                direction = code.co_name.strip("_").replace("_", " ")
            owner = frame.f_locals.get("self") if code.co_name == "forward_with_redistribution" else None
            if id(owner) in self._module_fqn:
                return f"{self._module_fqn[id(owner)]}: torchtitan {direction}"
            text = self._frame_text(code.co_filename, str(frame.f_lineno), code.co_name,
                                    traceback.FrameSummary(code.co_filename, frame.f_lineno, code.co_name).line or "")
            if code.co_filename in self._graph_fqn:
                return text
            if innermost is None and _kept(code.co_filename):
                innermost = text
            frame = frame.f_back
        return innermost or "?"

    def _frame_text(self, filename: str, lineno: str, function: str, line: str) -> str:
        line = line.split(";")[0].strip()
        if filename in self._graph_fqn:
            return f"{self._graph_fqn[filename]}: {line}"
        return f"{filename.rsplit('/', 1)[-1]}:{lineno} {line}"


def _group_name(group) -> str:
    """c10d ops carry the process group as a ScriptObject, functional collectives by name."""
    if isinstance(group, torch.ScriptObject):
        group = dist.ProcessGroup.unbox(group)
    return group.group_name


def _kept(filename: str) -> bool:
    return any(k in filename for k in _KEEP_FRAMES)


def _fsdp_grad_param() -> str | None:
    """Inside FSDP's post-backward, the parameter whose gradient it redistributes (a tp collective)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_get_grad_inner_tensor":
            fsdp_param = frame.f_locals.get("self")
            grad = frame.f_locals.get("grad")
            placements = getattr(grad, "placements", "?")
            return f"FSDP post-backward: grad of {fsdp_param._param_fqn} {placements} -> param's tp placement"
        frame = frame.f_back
    return None


# --------------------------------------------------------------------------- per rank


def train(side: Side, optimizer, steps: int, dp: int) -> tuple[list[float], list[float]]:
    """``steps`` steps on batches 0.. (each after a barrier); returns step times and global mean losses."""
    times, local_losses = [], []
    for i in range(steps):
        tokens, targets = local_batch(i, side.dp_rank, dp)
        dist.barrier()
        start = time.perf_counter()
        loss = one_step(side, optimizer, tokens, targets)
        times.append(time.perf_counter() - start)
        local_losses.append(loss)
    losses = torch.stack(local_losses).double()
    dist.all_reduce(losses, group=side.groups["dp"])
    return times, (losses * side.dp_sum_scale).tolist()


def one_step(side: Side, optimizer, tokens, targets) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    with side.loss_context():
        loss = side.loss(side.module(tokens), targets)
        loss.backward()
    optimizer.step()
    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def logged_step(side: Side, optimizer, index: int, dp: int) -> CollectiveLog:
    """One more step, every collective recorded (anomaly mode keeps each backward node's forward stack)."""
    tokens, targets = local_batch(index, side.dp_rank, dp)
    with CollectiveLog(side.groups, side.module) as log, torch.autograd.detect_anomaly(check_nan=False):
        one_step(side, optimizer, tokens, targets)
    return log


def measure(variant: str, dp: int, tp: int, dtype: str, steps: int, kv_heads: int = NUM_KV_HEADS) -> dict | None:
    """Build, train, log one step, measure what backward holds; rank 0 returns the result (torchtitan's
    refusal of a mesh its config check rejects, as its error)."""
    try:
        side = build_side(variant, dp, tp, dtype, kv_heads)
    except (ValueError, AssertionError) as err:
        if variant != "torchtitan":
            raise
        return {"refused": f"{type(err).__name__}: {err}"} if dist.get_rank() == 0 else None
    optimizer = torch.optim.AdamW(side.module.parameters(), lr=LR)
    times, losses = train(side, optimizer, steps, dp)
    log = logged_step(side, optimizer, steps, dp)
    tokens = local_batch(steps + 1, side.dp_rank, dp)[0]
    held = held_for_backward(side.module, tokens)
    step_times = max_over_ranks(times)
    held_max = max_over_ranks([float(held)])[0]
    comm = comm_summary(log)
    comm_by_kind = {axis: {k: log.wire_bytes(axis, k) for k in KINDS} for axis in comm}
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, (comm, comm_by_kind))
    if dist.get_rank() != 0:
        return None
    plan = getattr(side.module, "autoshard_plan", None)
    return {
        "plan_tp_collectives_per_block": sorted({plan.num_tp_collectives(u) for u in plan.units if u})
        if plan is not None else None,
        "plan_breaks": plan.breaks_line() if plan is not None else None,
        "step_times_s": step_times,
        "step_time_median_s": statistics.median(step_times[1:]),
        "losses": losses,
        "comm_per_step": comm,
        "wire_bytes_by_kind": comm_by_kind,
        "comm_ranks_agree": all(r == every_rank[0] for r in every_rank),
        "held_bytes_per_block": held_max / NUM_LAYERS,
        "collectives": log.records,
    }


def run_mesh(rank: int, world_size: int, shape: tuple[int, int, int], dtypes: tuple[str, ...],
             variants: tuple[str, ...], steps: int) -> dict | None:
    """Every (dtype, variant) of one mesh in this one process group launch; the variants run in
    alternating order from one dtype to the next, so slow drift of the machine hits them alike."""
    quiet_known_warnings()
    dp, tp, kv_heads = shape
    results: dict[str, dict] = {}
    for i, dtype in enumerate(dtypes):
        results[dtype] = {}
        for variant in variants if i % 2 == 0 else reversed(variants):  # alternate against drift
            results[dtype][variant] = measure(variant, dp, tp, dtype, steps, kv_heads)
    return results if rank == 0 else None


# --------------------------------------------------------------------------- driver side


def loss_agreement(result: dict, torchtitan: dict | None, reference: list[float]) -> dict:
    """Max relative loss difference over the steps against torchtitan's and the single device's."""

    def worst(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))

    return {
        "vs_torchtitan": worst(result["losses"], torchtitan["losses"]) if torchtitan else None,
        "vs_single_device": worst(result["losses"], reference),
    }


def table_rows(columns: list[dict]) -> list[tuple[str, list, str]]:
    """(label, one value per column, value format) of a configuration's table."""

    def each(read):
        return [read(c) for c in columns]

    rows = [("step time median (ms)", each(lambda c: c["step_time_median_s"] * 1e3), "f1")]
    for axis in ("tp", "dp"):
        rows.append((f"{axis} collectives / step", each(lambda c, a=axis: c["comm_per_step"].get(a, {})
                                                         .get("num_collectives", 0)), "d"))
        for kind in KINDS:
            rows.append((f"  {axis} {kind}", each(lambda c, a=axis, k=kind: c["comm_per_step"].get(a, {})
                                                  .get("counts", {}).get(k, 0)), "d"))
        rows.append((f"{axis} wire bytes / step", each(lambda c, a=axis: c["comm_per_step"].get(a, {})
                                                       .get("wire_bytes", 0)), "d"))
        for kind in KINDS:
            rows.append((f"  {axis} {kind} bytes", each(lambda c, a=axis, k=kind: c["wire_bytes_by_kind"]
                                                        .get(a, {}).get(k, 0)), "d"))
    rows += [
        ("held for backward / block (bytes)", each(lambda c: c["held_bytes_per_block"]), "d"),
        ("final step loss", each(lambda c: c["losses"][-1]), "f6"),
        ("max rel loss diff vs torchtitan", each(lambda c: c["loss_agreement"]["vs_torchtitan"]), "e"),
        ("max rel loss diff vs 1 device", each(lambda c: c["loss_agreement"]["vs_single_device"]), "e"),
    ]
    return rows


LABEL_WIDTH, VALUE_WIDTH, RATIO_WIDTH = 34, 13, 8


def format_table(title: str, results: dict[str, dict]) -> str:
    """torchtitan first, then each autoshard variant with its ratio to torchtitan."""
    names = [n for n in VARIANTS if n in results]
    header = f"{title:<{LABEL_WIDTH}}{VARIANT_TITLES[names[0]]:>{VALUE_WIDTH}}"
    header += "".join(f"{VARIANT_TITLES[n]:>{VALUE_WIDTH}}{'/titan':>{RATIO_WIDTH}}" for n in names[1:])
    lines = [header, "-" * len(header)]
    for label, values, kind in table_rows([results[n] for n in names]):
        cells = f"{fmt(values[0], kind):>{VALUE_WIDTH}}"
        for value in values[1:]:
            r = ratio(value, values[0]) if kind != "e" else None
            cells += f"{fmt(value, kind):>{VALUE_WIDTH}}{(f'{r:.3f}' if r is not None else '-'):>{RATIO_WIDTH}}"
        lines.append(f"{label:<{LABEL_WIDTH}}{cells}")
    return "\n".join(lines)


def grouped_collectives(records: list[dict], axis: str = "tp") -> list[dict]:
    """One step's collectives on ``axis``, identical ones of every layer folded into one row (``layers.*``)."""
    groups: dict[tuple, dict] = {}
    for r in records:
        if r["axis"] != axis:
            continue
        origin = re.sub(r"layers\.\d+", "layers.*", r["origin"])
        origin = re.sub(r"(?<=[a-z])_\d+", "", origin)  # rms_norm_7_enter_tp -> rms_norm_enter_tp
        origin = re.sub(r"'\d+'", "tp", origin)  # the process group's name
        key = (r["phase"], r["kind"], tuple(r["shape"]), r["dtype"], origin)
        row = groups.setdefault(key, {"phase": r["phase"], "kind": r["kind"], "shape": r["shape"],
                                      "dtype": r["dtype"], "origin": origin, "count": 0, "wire_bytes": 0})
        row["count"] += 1
        row["wire_bytes"] += r["wire_bytes"]
    return list(groups.values())


def format_collectives(title: str, records: list[dict]) -> str:
    rows = grouped_collectives(records)
    total = sum(r["wire_bytes"] for r in rows)
    lines = [f"{title}: {sum(r['count'] for r in rows)} tp collectives, {total:,} wire bytes"]
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        lines.append(f"  {r['phase']} {r['kind']:<14} {r['count']:>2} x {shape:<12} {r['dtype']:<8} "
                     f"{r['wire_bytes']:>9,} B  {r['origin'][:140]}")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default=",".join(MESHES), help=f"comma-separated of {', '.join(MESHES)}")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated of {', '.join(DTYPES)}")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated of {', '.join(VARIANTS)} (torchtitan is always run first)")
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps per variant")
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON output path")
    args = parser.parse_args(argv)
    for name, allowed in (("meshes", MESHES), ("dtypes", DTYPES), ("variants", VARIANTS)):
        chosen = getattr(args, name).split(",")
        if not chosen or set(chosen) - set(allowed):
            parser.error(f"--{name} takes a comma-separated subset of {', '.join(allowed)}")
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is not timed)")
    return args


def config_section(args) -> dict:
    import torchtitan

    return {
        "model": "torchtitan.models.llama3.Llama3Model",
        "model_size": {"layers": NUM_LAYERS, "dim": DIM, "heads": NUM_HEADS, "kv_heads": NUM_KV_HEADS,
                       "ffn_hidden": FFN_HIDDEN, "vocab": VOCAB, "fused_qkv": True, "attention": "sdpa"},
        "global_batch": [GLOBAL_BATCH, SEQ_LEN],
        "steps": args.steps,
        "optimizer": {"name": "AdamW", "lr": LR},
        "torchtitan": {"version": getattr(torchtitan, "__version__", "0.3.0"), "spmd_backend": "partial_dtensor",
                       "enable_sequence_parallel": False, "compile": False, "activation_checkpointing": None},
        "bf16": "MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) on both sides",
        "torch_version": torch.__version__,
        "world_size": WORLD_SIZE,
        "threads_per_rank": 1,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    meshes = args.meshes.split(",")
    dtypes = tuple(args.dtypes.split(","))
    variants = ("torchtitan", *[v for v in args.variants.split(",") if v != "torchtitan"])
    start = time.perf_counter()
    references = {kv: single_device_losses(args.steps, kv) for kv in sorted({MESHES[m][2] for m in meshes})}
    report = {"config": config_section(args), "single_device_losses": references.get(NUM_KV_HEADS),
              "results": {}}
    for mesh in meshes:
        reference = references[MESHES[mesh][2]]
        per_dtype = spawn(run_mesh, WORLD_SIZE, (MESHES[mesh], dtypes, variants, args.steps), timeout=SPAWN_TIMEOUT)[0]
        for dtype, results in per_dtype.items():
            titan = results["torchtitan"] if "refused" not in results["torchtitan"] else None
            for result in results.values():
                if "refused" not in result:
                    result["loss_agreement"] = loss_agreement(result, titan, reference)
            if titan is not None:
                titan["loss_agreement"]["vs_torchtitan"] = None
            report["results"][f"{mesh} {dtype}"] = results
    report["wall_time_s"] = time.perf_counter() - start
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print_report(report, args.out)
    return report


def print_report(report: dict, out: str) -> None:
    for config, results in report["results"].items():
        dp, tp, kv_heads = MESHES[config.split()[0]]
        title = f"dp={dp} x tp={tp} {config.split()[1]}" + (f" kv={kv_heads}" if kv_heads != NUM_KV_HEADS else "")
        refused = results.get("torchtitan", {}).get("refused")
        if refused:
            print(f"\n{title}: torchtitan refuses this mesh ({refused[:160]})")
            results = {n: r for n, r in results.items() if n != "torchtitan"}
            for name, result in results.items():
                print(f"  {VARIANT_TITLES[name]}: {result['comm_per_step'].get('tp', {}).get('num_collectives', 0)} tp "
                      f"collectives / step ({result['plan_tp_collectives_per_block']} per block planned; "
                      f"{result['plan_breaks']}), max rel loss diff vs 1 device "
                      f"{result['loss_agreement']['vs_single_device']:.2e}")
            continue
        print(f"\n{format_table(title, results)}")
    for config, results in report["results"].items():
        print(f"\n== tp collectives of one step, {config} ==")
        for name in (n for n in VARIANTS if n in results and "refused" not in results[n]):
            print(format_collectives(VARIANT_TITLES[name], results[name]["collectives"]))
    print(f"\nwall time {report['wall_time_s']:.1f} s; JSON: {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
