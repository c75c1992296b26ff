"""Hugging Face models sharded with a plain ``autoshard(model, mesh, ...)``.

In one process, every family on 2x2 and tp=4 (and with sequence parallelism on 2x2): proven
against the unsharded model (outputs and every gradient, fresh inputs) and the tp collectives
per block exactly as expected, planned and as the emitted code runs them. One 4-process gloo
group (2x2) runs four families end to end, where FSDP and real collectives take part: logits
against the single-device model, loss and every parameter after 3 AdamW steps, measured tp
collectives, and the trained weights loaded back. In the same group, a 4-block Llama on tp=4
replays ``autoshard.testing.check``'s proof: the same inputs and weights give every rank the
outputs, loss and gradients the one-process proof computed for that rank.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree

import autoshard
import autoshard.testing
from autoshard.adapters.comm_stats import CollectiveCounter
from tests.distributed import distributed_tests, remove_shared, shared_directory
from tests.hf_cases import CASES, VOCAB, llama_4_blocks, llama_4_blocks_tokens, main_output
from tests.parity import assert_parity, dp_slice, rel_error, train_both

# tp collectives per block per training step: 2 forward all-reduces (attention out,
# MLP out), 2 backward (one per colwise group); Qwen3's q/k norms read a replicated
# weight on sharded heads, whose gradients are all-reduced together: 1 more. Qwen3-MoE's experts
# cost what a dense MLP does (its router is computed whole), so it matches Qwen3.
PER_BLOCK = {
    "llama": 4, "llama_tied": 4, "mistral": 4, "qwen2": 4, "qwen3": 5, "qwen3_moe": 5, "phi3": 4, "gpt2": 4,
    "bert": 4,
}
# trained end to end on real gloo ranks: GQA, experts, Conv1D with a fused q|k|v and tied embeddings, an encoder
END_TO_END = ("llama", "qwen3_moe", "gpt2", "bert")
SEQUENCE_PARALLEL = ("llama", "qwen3", "bert")
LOGITS_TOL = 1e-5
LOSS_TOL = 1e-4
PARAM_TOL = 5e-4  # after AdamW (eps 1e-6), relative to max(|p|, 1e-2): see tests/parity.py


def _loss(output, targets):
    out = main_output(output)
    if targets.dtype == torch.long:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), targets.reshape(-1))
    return F.mse_loss(out, targets)


def _targets(case, ids):
    if hasattr(case.build(), "lm_head"):
        return torch.randint(0, VOCAB, ids.shape, generator=torch.Generator().manual_seed(1))
    return torch.randn(*ids.shape, 64, generator=torch.Generator().manual_seed(1))


def _make_check(name: str):
    case = CASES[name]

    def check(ctx):
        mesh = ctx.mesh_2d
        torch.manual_seed(0)
        model = case.build()
        ids, kwargs = case.inputs()
        local_ids = dp_slice(ids, mesh)
        local_kwargs = {k: dp_slice(v, mesh) for k, v in kwargs.items()}

        sharded = autoshard.autoshard(model, mesh, example_inputs=(local_ids,), example_kwargs=local_kwargs)
        with torch.no_grad():
            got = main_output(sharded(local_ids, **local_kwargs))
            want = main_output(model(local_ids, **local_kwargs))
        assert rel_error(got, want) <= LOGITS_TOL, f"{name}: output rel error {rel_error(got, want):.2e}"

        num_blocks = model.config.num_hidden_layers
        axes = {a: mesh.get_group(a) for a in mesh.mesh_dim_names}
        with CollectiveCounter(axes) as forward:
            outputs = sharded(local_ids, **local_kwargs).to_tuple()
        with CollectiveCounter(axes) as backward:
            sum(o.float().pow(2).mean() for o in outputs).backward()  # every output gets a gradient
        plan = sharded.autoshard_plan
        measured = forward.count("tp") + backward.count("tp")
        planned = plan.num_tp_collectives()
        assert measured == planned, (name, measured, planned, forward.stats(), backward.stats())
        for block in plan.units[1:]:
            got = plan.num_tp_collectives(block)
            assert got == PER_BLOCK[name], (name, block, got)
        assert len(plan.units) == num_blocks + 1

        torch.manual_seed(0)
        run = train_both(
            case.build(), mesh, ids, _targets(case, ids), _loss,
            optimizer="adamw", lr=1e-3, adam_eps=1e-6, scale_floor=1e-2, kwargs=kwargs,
        )
        assert_parity(run, loss_tol=LOSS_TOL, param_tol=PARAM_TOL)

        # the trained single-device weights load into the first sharded model (original layout in)
        sharded.load_state_dict(run.reference.state_dict())
        with torch.no_grad():
            got = main_output(sharded(local_ids, **local_kwargs))
            want = main_output(run.reference(local_ids, **local_kwargs))
        assert rel_error(got, want) <= LOGITS_TOL, f"{name}: after load_state_dict {rel_error(got, want):.2e}"

    check.__name__ = check.__qualname__ = f"check_{name}"
    check.__module__ = __name__
    return check


def _make_sequence_parallel_check(name: str):
    case = CASES[name]

    def check(ctx):
        torch.manual_seed(0)
        ids, kwargs = case.inputs()
        run = train_both(
            case.build(), ctx.mesh_2d, ids, _targets(case, ids), _loss,
            optimizer="adamw", lr=1e-3, adam_eps=1e-6, scale_floor=1e-2, kwargs=kwargs,
            shard_kwargs={"sequence_parallel": True},
        )
        code = run.sharded.get_submodule(run.sharded.autoshard_plan.units[1]).code
        assert code.count("reduce_scatter_partial") == 2 and code.count("gather_for_colwise") == 2
        assert_parity(run, loss_tol=LOSS_TOL, param_tol=PARAM_TOL)

    check.__name__ = check.__qualname__ = f"check_{name}_sequence_parallel"
    check.__module__ = __name__
    return check


@pytest.mark.parametrize("mesh", [{"dp": 2, "tp": 2}, {"tp": 4}], ids=["2x2", "tp4"])
@pytest.mark.parametrize("name", list(CASES))
def test_family_is_proven(name, mesh):
    case = CASES[name]
    torch.manual_seed(0)
    ids, kwargs = case.inputs(batch=2)
    proof = autoshard.check(case.build(), mesh, example_inputs=(ids,), example_kwargs=kwargs)
    assert proof.ok, str(proof)
    plan = proof.plan
    assert proof.tp_collectives == plan.predicted_comm()["tp"]
    assert sum(n for n, _ in proof.tp_collectives.values()) == plan.num_tp_collectives()
    if mesh["tp"] == 2:
        for block in plan.units[1:]:
            assert plan.num_tp_collectives(block) == PER_BLOCK[name], (name, block)


@pytest.mark.parametrize("name", SEQUENCE_PARALLEL)
def test_family_is_proven_with_sequence_parallelism(name):
    case = CASES[name]
    torch.manual_seed(0)
    ids, kwargs = case.inputs(batch=2)
    proof = autoshard.check(case.build(), {"dp": 2, "tp": 2}, example_inputs=(ids,), example_kwargs=kwargs,
                            sequence_parallel=True)
    assert proof.ok, str(proof)
    assert proof.tp_collectives["reduce_scatter"][0] > 0 and proof.tp_collectives == proof.plan.predicted_comm()["tp"]


def check_testing_proof_agrees_with_a_real_run(ctx):
    """``autoshard.testing.check`` at dp=2 x tp=4 proves the tp ranks' code; the 4 ranks here
    run that code for real (tp=4, gloo) on the proof's inputs and weights. Each rank's outputs,
    loss and local gradients equal what the proof computed for that rank, to 1e-5."""
    directory = shared_directory(ctx)
    path = os.path.join(directory, "values.pt")
    if ctx.rank == 0:
        report = autoshard.testing.check(llama_4_blocks(), {"dp": 2, "tp": 4},
                                         example_inputs=(llama_4_blocks_tokens(),), keep_values=True)
        report.assert_close()
        torch.save(report.values, path)
    dist.barrier()
    values = torch.load(path, weights_only=False)
    model = llama_4_blocks()
    model.load_state_dict(values.weights, strict=False)
    sharded = autoshard.autoshard(model, ctx.mesh_tp, example_inputs=values.args, example_kwargs=values.kwargs,
                                  check=False)
    outputs = pytree.tree_leaves(sharded(*values.args, **values.kwargs))
    rank = ctx.mesh_tp.get_local_rank("tp")
    loss = 0
    for i, (out, cotangent) in enumerate(zip(outputs, values.cotangents, strict=True)):
        if cotangent is None:
            continue
        assert rel_error(out.detach(), values.outputs[i][rank]) <= 1e-5, f"output {i}"
        loss = loss + (out.float() * cotangent.float()).sum()
    assert abs(loss.item() - values.losses[rank]) <= 1e-5 * abs(values.losses[rank]), (loss.item(), values.losses)
    loss.backward()
    for fqn, param in sharded.named_parameters():
        got, want = param.grad.to_local(), values.gradients[fqn][rank]
        assert rel_error(got, want) <= 1e-5, f"{fqn}: {rel_error(got, want):.2e}"
    assert len(values.gradients) == len(list(sharded.parameters())) == len(values.weights)
    remove_shared(ctx, directory)


CHECKS = [_make_check(name) for name in END_TO_END]
CHECKS += [_make_sequence_parallel_check(name) for name in ("llama", "bert")]
CHECKS += [check_testing_proof_agrees_with_a_real_run]

outcomes, test_hf_model = distributed_tests(CHECKS)
