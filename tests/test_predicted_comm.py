"""``plan.predicted_comm()`` equals what one training step measures, exactly.

One 4-process group. For the example models on 2x2, tp=4 and dp=4 and four Hugging Face
families (GQA, q/k norms, experts, an encoder) on 2x2 and tp=4, in fp32 and (on 2x2) bf16 mixed
precision (and bf16 on 1x4, where a sum takes two collectives): the second step's
collectives, counted by ``CollectiveCounter`` over forward,
backward and an SGD step, per axis and kind, count and wire bytes, against the plan's
prediction made before running. The tp part of every other model of the matrix (all Hugging
Face families, every public-code pattern, the zoo sample) is checked in one process: the
proof tallies the collectives the emitted code runs (``tests/test_patterns.py``,
``tests/test_hf_models.py``, ``tests/test_zoo_sample.py``); FSDP's part does not depend on
the model's code, only on its parameters.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import autoshard
from autoshard.adapters.comm_stats import CollectiveCounter
from tests.cases import MODELS
from tests.distributed import distributed_tests
from tests.hf_cases import CASES
from tests.parity import dp_slice
from tests.pattern_models import PATTERNS, VOCAB

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _model_and_batch(name: str):
    torch.manual_seed(0)
    if name in PATTERNS:
        return PATTERNS[name](), torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0)), {}
    if name in MODELS:
        build, (example,) = MODELS[name]
        return build(), torch.cat([example, example]), {}  # 4 rows: one per dp rank on dp=4
    case = CASES[name]
    ids, kwargs = case.inputs(batch=4)
    return case.build(), ids, kwargs


def _measured(sharded, mesh, inputs, kwargs) -> dict:
    optimizer = torch.optim.SGD(sharded.parameters(), lr=0.01)
    axes = {a: mesh.get_group(a) for a in mesh.mesh_dim_names}
    for _ in range(2):  # the second step is the steady state (FSDP2 initializes lazily)
        counter = CollectiveCounter(axes)
        with counter:
            # a loss on every output, so every parameter gets a gradient (BERT's pooler too)
            outputs = [t for t in pytree.tree_leaves(sharded(inputs, **kwargs)) if isinstance(t, torch.Tensor)]
            sum(t.float().pow(2).mean() for t in outputs if t.is_floating_point()).backward()
            optimizer.step()
            optimizer.zero_grad()
    return {axis: {kind: (n, counter.wire_bytes(axis, kind)) for kind, n in stats.counts.items() if n}
            for axis, stats in counter.stats().items() if stats.num_collectives}


def _check_family(ctx, names, policies=(None, BF16), meshes=None):
    meshes = meshes or {"2x2": ctx.mesh_2d, "tp4": ctx.mesh_tp, "dp4": ctx.mesh_dp}
    misses = []
    for name in names:
        for mesh_name, mesh in meshes.items():
            # bf16 changes the dp part's dtype the same way on every dp mesh: measured on the first
            dp_meshes = [m for m in meshes.values() if "dp" in m.mesh_dim_names]
            for policy in policies if dp_meshes and mesh is dp_meshes[0] else (None,):
                model, ids, kwargs = _model_and_batch(name)
                local, local_kwargs = dp_slice(ids, mesh), {k: dp_slice(v, mesh) for k, v in kwargs.items()}
                sharded = autoshard.autoshard(model, mesh, example_inputs=(local,), example_kwargs=local_kwargs,
                                              mp_policy=policy)
                predicted = sharded.autoshard_plan.predicted_comm()
                measured = _measured(sharded, mesh, local, local_kwargs)
                if predicted != measured:
                    misses.append(f"{name} on {mesh_name} {'bf16' if policy else 'fp32'}: "
                                  f"predicted {predicted}, measured {measured}")
    assert not misses, "\n".join(misses)


def check_example_models(ctx):
    _check_family(ctx, list(MODELS))


def _with_tp(ctx) -> dict:
    """The meshes whose tp part depends on the model's code (FSDP's on dp=4 does not: the example
    models measure it)."""
    return {"2x2": ctx.mesh_2d, "tp4": ctx.mesh_tp}


def check_hf_decoders(ctx):
    _check_family(ctx, ["llama", "qwen3"], meshes=_with_tp(ctx))


def check_hf_moe_and_encoders(ctx):
    _check_family(ctx, ["qwen3_moe", "bert"], meshes=_with_tp(ctx))


def check_bf16_sums_on_four_tp_ranks(ctx):
    """On 4 tp ranks a bf16 partial sum added in fp32 runs as an all-to-all and an all-gather
    (autoshard.runtime.collectives), predicted as such: counts and bf16 wire bytes."""
    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
    _check_family(ctx, ["llama"], policies=(BF16,), meshes={"1x4": mesh})
    model, ids, _ = _model_and_batch("llama")
    plan = autoshard.plan(model, {"dp": 1, "tp": 4}, example_inputs=(ids,), mp_policy=BF16)
    tp = plan.predicted_comm()["tp"]
    assert "all_to_all" in tp and "all_reduce" not in tp, tp


def check_quantized_all_gather(ctx):
    """A quantized all-gather is predicted as its 1-byte values and fp32 scales."""
    mesh = ctx.mesh_2d
    model, ids, _ = _model_and_batch("llama")
    local = dp_slice(ids, mesh)
    sharded = autoshard.autoshard(model, mesh, example_inputs=(local,),
                                  all_gather_quant=autoshard.BlockQuant(torch.float8_e4m3fn, 16))
    assert sharded.autoshard_plan.predicted_comm() == _measured(sharded, mesh, local, {})


CHECKS = [check_example_models, check_hf_decoders, check_hf_moe_and_encoders, check_bf16_sums_on_four_tp_ranks,
          check_quantized_all_gather]

outcomes, test_check = distributed_tests(CHECKS)
