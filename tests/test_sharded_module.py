"""The sharded GraphModule on real gloo ranks: placements, collectives, state dicts, plans.

One 4-process group runs every check.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel

import autoshard
from autoshard.adapters.comm_stats import CollectiveCounter
from examples.models import Llama, LlamaConfig, MLPStack
from tests.distributed import distributed_tests
from tests.parity import assert_parity, dp_slice, full, lm_loss, mean_over_dp, mse_loss, rel_error, train_both


def _llama(num_layers=2, tp=2):
    """Both head counts divide by ``tp`` (4 kv heads for tp=4), the clean GQA case."""
    torch.manual_seed(0)
    heads = {"num_heads": 4, "num_kv_heads": 2} if tp <= 2 else {"num_heads": 8, "num_kv_heads": 4}
    return Llama(LlamaConfig(num_layers=num_layers, **heads)), torch.randint(0, 256, (4, 16))


def _shard_llama(mesh, num_layers=2):
    tp = mesh.size(mesh.mesh_dim_names.index("tp")) if "tp" in mesh.mesh_dim_names else 1
    model, tokens = _llama(num_layers, tp)
    local = dp_slice(tokens, mesh)
    return model, autoshard.autoshard(model, mesh, example_inputs=(local,)), local


def check_placements_2x2(ctx):
    _, sharded, _ = _shard_llama(ctx.mesh_2d)
    mlp = autoshard.autoshard(MLPStack(), ctx.mesh_2d, example_inputs=(torch.randn(2, 5, 32),))
    for fqn, p in [*sharded.named_parameters(), *mlp.named_parameters()]:
        assert isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("dp", "tp"), fqn
        assert not any("Strided" in type(pl).__name__ for pl in p.placements), (fqn, p.placements)
        if p.dim() == 2 and fqn != "head.weight":
            assert tuple(p.placements) == (Shard(0), Shard(1)), (fqn, p.placements)
            assert p.to_local().numel() * 4 == p.numel(), fqn  # a quarter of every weight
    # the head narrows (16 outputs of 32 inputs) and feeds the output: computed whole over tp
    assert tuple(mlp.get_parameter("head.weight").placements) == (Shard(0), Replicate())
    get = sharded.get_parameter
    assert sharded.layers[1].attention.wq.weight is get("layers.1.attention.wq.weight")  # indexable like the model
    assert tuple(get("layers.0.attention_norm.weight").placements) == (Shard(0), Replicate())
    assert tuple(mlp.get_parameter("blocks.0.fc1.bias").placements) == (Replicate(), Shard(0))  # colwise
    assert tuple(mlp.get_parameter("blocks.0.fc2.bias").placements) == (Shard(0), Replicate())  # rowwise
    # colwise weights are stored [in, out], rowwise [out, in]
    assert tuple(get("layers.0.attention.wk.weight").shape) == (64, 32)
    assert tuple(get("layers.0.feed_forward.w1.weight").shape) == (64, 128)
    assert tuple(get("layers.0.feed_forward.w2.weight").shape) == (64, 128)
    assert tuple(get("output.weight").shape) == (64, 256)


def check_placements_1d(ctx):
    _, tp_only, _ = _shard_llama(ctx.mesh_tp)
    _, dp_only, _ = _shard_llama(ctx.mesh_dp)
    for fqn, p in tp_only.named_parameters():
        if p.dim() == 2:
            assert tuple(p.placements) == (Shard(1),), (fqn, p.placements)
    for fqn, p in dp_only.named_parameters():
        assert tuple(p.placements) == (Shard(0),), (fqn, p.placements)


def check_parameter_memory_is_a_quarter(ctx):
    """Parameters, gradients and AdamW state: every weight cut 4 ways; only the small
    norm weights are whole on each tp rank (cut over dp only)."""
    model, sharded, local = _shard_llama(ctx.mesh_2d)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    norm_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
    expected = (full_bytes - norm_bytes) // 4 + norm_bytes // 2
    assert expected / full_bytes < 0.26

    def local_bytes(tensors):
        return sum(t.to_local().numel() * t.element_size() for t in tensors)

    assert local_bytes(sharded.parameters()) == expected
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    lm_loss(sharded(local), local).backward()
    assert local_bytes(p.grad for p in sharded.parameters()) == expected
    optimizer.step()
    for key in ("exp_avg", "exp_avg_sq"):
        assert local_bytes(optimizer.state[p][key] for p in sharded.parameters()) == expected, key


def _count_step(sharded, local, mesh):
    axes = {name: mesh.get_group(name) for name in mesh.mesh_dim_names}
    with CollectiveCounter(axes) as forward:
        loss = sharded(local).float().pow(2).mean()
    with CollectiveCounter(axes) as backward:
        loss.backward()
    return forward, backward


def check_tp_collectives_per_block(ctx):
    """2 forward + 2 backward tp all-reduces per block; the embedding adds one forward
    all-gather, the LM head one forward all-gather and one backward all-reduce."""
    per_layers = {}
    for num_layers in (2, 3):
        _, sharded, local = _shard_llama(ctx.mesh_2d, num_layers)
        for _ in range(2):  # the same on every step
            forward, backward = _count_step(sharded, local, ctx.mesh_2d)
            fwd, bwd = forward.stats()["tp"].counts, backward.stats()["tp"].counts
            assert fwd == {"all_reduce": 2 * num_layers, "all_gather": 2}, fwd
            assert bwd == {"all_reduce": 2 * num_layers + 1}, bwd
        per_layers[num_layers] = forward.count("tp") + backward.count("tp")
    assert per_layers[3] - per_layers[2] == 4


def check_dp_collectives_per_unit(ctx):
    """FSDP2 per unit: all-gather before forward, again before backward (blocks),
    one reduce-scatter of gradients; nothing else on dp."""
    _, sharded, local = _shard_llama(ctx.mesh_2d, num_layers=2)
    forward, backward = _count_step(sharded, local, ctx.mesh_2d)
    assert forward.stats()["dp"].counts == {"all_gather": 3}
    assert backward.stats()["dp"].counts == {"all_gather": 2, "reduce_scatter": 3}


def check_tp_only_and_dp_only_collectives(ctx):
    _, sharded, local = _shard_llama(ctx.mesh_tp)
    forward, backward = _count_step(sharded, local, ctx.mesh_tp)
    assert forward.stats()["tp"].counts == {"all_reduce": 4, "all_gather": 2}
    assert backward.stats()["tp"].counts == {"all_reduce": 5}
    _, sharded, local = _shard_llama(ctx.mesh_dp)
    forward, backward = _count_step(sharded, local, ctx.mesh_dp)
    assert set(forward.stats()) == {"dp"} and set(backward.stats()) == {"dp"}


def check_state_dict_in_original_layout(ctx):
    model, sharded, _ = _shard_llama(ctx.mesh_2d)
    original = model.state_dict()
    state = sharded.state_dict()
    assert list(state) == list(original)  # same keys, same order
    for key, value in state.items():
        assert isinstance(value, DTensor), key
        assert torch.equal(value.full_tensor(), original[key]), key


def check_load_full_state_dict(ctx):
    model, sharded, local = _shard_llama(ctx.mesh_2d)
    torch.manual_seed(1)
    other = type(model)(model.cfg)
    sharded.load_state_dict(other.state_dict())
    for key, value in sharded.state_dict().items():
        assert torch.equal(value.full_tensor(), other.state_dict()[key]), key
    torch.testing.assert_close(sharded(local), other(local), rtol=1e-5, atol=1e-5)
    # a sharded state dict loads back too (DTensors in the original layout)
    again = autoshard.autoshard(model, ctx.mesh_2d, example_inputs=(local,))
    again.load_state_dict(sharded.state_dict())
    torch.testing.assert_close(again(local), other(local), rtol=1e-5, atol=1e-5)


def check_model_state_dict_hooks_are_kept(ctx):
    """A model that saves its fused wqkv as wq/wk/wv through its own hooks: the sharded module's
    state dict has those keys and values, and loads the model's state dict back."""
    from tests.pattern_models import FusedQKV

    torch.manual_seed(0)
    model = FusedQKV()
    tokens = dp_slice(torch.randint(0, 128, (4, 16)), ctx.mesh_2d)
    sharded = autoshard.autoshard(model, ctx.mesh_2d, example_inputs=(tokens,))
    original = model.state_dict()
    state = sharded.state_dict()
    assert "layers.0.attention.wq.weight" in original and set(state) == set(original)
    for key, value in state.items():
        assert torch.equal(full(value), original[key]), key
    torch.manual_seed(1)
    other = FusedQKV()
    sharded.load_state_dict(other.state_dict())
    torch.testing.assert_close(sharded(tokens), other(tokens), rtol=1e-5, atol=1e-5)


def check_load_state_dict_rejects_wrong_shapes(ctx):
    model, sharded, _ = _shard_llama(ctx.mesh_2d)
    bad = model.state_dict()
    bad["layers.0.attention.wq.weight"] = torch.zeros(64, 32)
    with pytest.raises(RuntimeError, match="layers.0.attention.wq.weight"):
        sharded.load_state_dict(bad)


def check_ranks_that_initialized_differently_agree(ctx):
    torch.manual_seed(100 + ctx.rank)  # a different model on every rank
    model = MLPStack()
    sharded = autoshard.autoshard(model, ctx.mesh_2d, example_inputs=(torch.randn(2, 5, 32),))
    reference = [None]
    if ctx.rank == 0:
        reference = [model.state_dict()]
    dist.broadcast_object_list(reference, src=0)
    for key, value in sharded.state_dict().items():
        assert torch.equal(full(value), reference[0][key]), key


def check_edited_plan_is_applied(ctx):
    """Leaving one block's feed-forward unsharded on tp: numerics hold, 2 tp collectives fewer."""
    model, tokens = _llama()
    targets = torch.randint(0, 256, (4, 16))
    local = dp_slice(tokens, ctx.mesh_2d)
    data = autoshard.plan(model, ctx.mesh_2d, example_inputs=(local,)).to_dict()
    for name in ("w1", "w2", "w3"):
        entry = data["params"][f"layers.0.feed_forward.{name}.weight"]
        entry.update(role="replicate", transposed=False, placements={"dp": "S(0)", "tp": "R"})
    edited = autoshard.Plan.from_dict(data)
    sharded = autoshard.autoshard(copy.deepcopy(model), ctx.mesh_2d, example_inputs=(local,), plan=edited)
    w1 = sharded.get_parameter("layers.0.feed_forward.w1.weight")
    assert tuple(w1.placements) == (Shard(0), Replicate()) and tuple(w1.shape) == (128, 64)
    forward, backward = _count_step(sharded, local, ctx.mesh_2d)
    assert forward.count("tp") + backward.count("tp") == 4 * 2 + 3 - 2
    run = train_both(model, ctx.mesh_2d, tokens, targets, lm_loss, shard_kwargs={"plan": edited})
    assert_parity(run, loss_tol=1e-5, param_tol=1e-5)


def check_rowwise_after_a_replicated_linear_takes_its_shard(ctx):
    """A plan making fc1 replicate leaves fc2 rowwise on a replicated input: the graph
    takes the local chunk (no forward communication) and numerics still hold."""
    torch.manual_seed(0)
    model, x, y = MLPStack(), torch.randn(8, 5, 32), torch.randn(8, 5, 16)
    data = autoshard.plan(model, ctx.mesh_2d, example_inputs=(dp_slice(x, ctx.mesh_2d),)).to_dict()
    for fqn in ("blocks.0.fc1.weight", "blocks.0.fc1.bias"):
        data["params"][fqn].update(role="replicate", transposed=False, placements={"dp": "S(0)", "tp": "R"})
    run = train_both(model, ctx.mesh_2d, x, y, mse_loss, shard_kwargs={"plan": autoshard.Plan.from_dict(data)})
    applied = run.sharded.autoshard_plan
    assert [a for a in applied.activations if a.kind == "take-shard"], applied.activations
    assert "take_shard" in run.sharded.get_submodule("blocks.0").code
    assert_parity(run, loss_tol=1e-5, param_tol=1e-5)


def check_loss_parallel_matches_the_gathered_loss(ctx):
    """Logits stay vocab-sharded (a DTensor, never gathered) into a vocab-parallel
    cross entropy; 3 SGD steps equal single-device training."""
    mesh = ctx.mesh_2d
    model, tokens = _llama()
    targets = torch.randint(0, 256, (4, 16))
    reference = copy.deepcopy(model)
    local, local_targets = dp_slice(tokens, mesh), dp_slice(targets, mesh)
    sharded = autoshard.autoshard(model, mesh, example_inputs=(local,), loss_parallel=True)
    assert "loss parallel" in str(sharded.autoshard_plan.params["output.weight"].collectives[-1])
    opt_s = torch.optim.SGD(sharded.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(reference.parameters(), lr=0.1)
    axes = {a: mesh.get_group(a) for a in mesh.mesh_dim_names}
    for _ in range(3):
        with CollectiveCounter(axes) as forward:
            logits = sharded(local)
        assert isinstance(logits, DTensor) and tuple(logits.placements) == (Shard(2),)
        assert forward.stats()["tp"].counts.get("all_gather", 0) == 1  # the embedding only
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), local_targets.flatten())
            loss.backward()
        opt_s.step()
        opt_s.zero_grad()
        want = lm_loss(reference(tokens), targets)
        want.backward()
        opt_r.step()
        opt_r.zero_grad()
        got = mean_over_dp(loss.full_tensor(), mesh)
        assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item()), (got.item(), want.item())
    for key, value in sharded.state_dict().items():
        assert rel_error(full(value), reference.state_dict()[key]) <= 1e-5, key


def check_symbolic_batch_and_sequence(ctx):
    """Captured once with symbolic batch and sequence: every size runs the same graph,
    matches the model, and trains like it."""
    from torch.export import Dim

    mesh = ctx.mesh_2d
    model, tokens = _llama()
    reference = copy.deepcopy(model)
    dynamic = ({0: Dim("batch", min=1, max=64), 1: Dim("seq", min=2, max=64)},)
    sharded = autoshard.autoshard(model, mesh, example_inputs=(dp_slice(tokens, mesh),), dynamic_shapes=dynamic)
    assert str(sharded.autoshard_plan) == str(autoshard.plan(model, mesh, example_inputs=(tokens[:2],)))
    optimizer_s = torch.optim.SGD(sharded.parameters(), lr=0.1)
    optimizer_r = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch, seq in ((4, 16), (6, 9), (2, 33)):
        tokens = torch.randint(0, 256, (batch, seq))
        targets = torch.randint(0, 256, (batch, seq))
        local, local_targets = dp_slice(tokens, mesh), dp_slice(targets, mesh)
        loss = lm_loss(sharded(local), local_targets)
        loss.backward()
        optimizer_s.step()
        optimizer_s.zero_grad()
        want = lm_loss(reference(tokens), targets)
        want.backward()
        optimizer_r.step()
        optimizer_r.zero_grad()
        got = mean_over_dp(loss, mesh).item()
        assert abs(got - want.item()) <= 1e-5 * abs(want.item()), (batch, seq, got, want.item())
    for key, value in sharded.state_dict().items():
        assert rel_error(full(value), reference.state_dict()[key]) <= 1e-5, key


def check_sequence_parallel(ctx):
    """Norms and residuals sharded over the sequence: per block 2 all-gathers and 2
    reduce-scatters forward, the mirror backward plus one all-reduce of both norm weights'
    gradients; 3 SGD steps equal single-device training."""
    mesh = ctx.mesh_2d
    model, tokens = _llama()
    targets = torch.randint(0, 256, (4, 16))
    _, sharded, local = _shard_llama(mesh)
    sharded = autoshard.autoshard(model, mesh, example_inputs=(local,), sequence_parallel=True)
    forward, backward = _count_step(sharded, local, mesh)
    # forward: the embedding output, the head's input and its logits add 3 all-gathers
    assert forward.stats()["tp"].counts == {"all_gather": 2 * 2 + 3, "reduce_scatter": 2 * 2}, forward.stats()
    # backward: per block 2 reduce-scatters, 2 all-gathers, 1 all-reduce for its 2 norm weights;
    # the final norm's weight, the head's input and the embedding's sequence shard add 1 + 1 + 1
    assert backward.stats()["tp"].counts == {"reduce_scatter": 2 * 2 + 1, "all_gather": 2 * 2 + 1,
                                             "all_reduce": 2 * 1 + 1}, backward.stats()
    run = train_both(model, mesh, tokens, targets, lm_loss, shard_kwargs={"sequence_parallel": True})
    assert_parity(run, loss_tol=1e-5, param_tol=1e-5)


def check_optimizer_built_after_an_evaluation_forward(ctx):
    """FSDP2 keeps the root gathered after forward; an evaluation forward must release it,
    or an optimizer built from ``parameters()`` then would train gathered copies."""
    torch.manual_seed(0)
    model = MLPStack()
    reference = copy.deepcopy(model)
    x, target = torch.randn(2, 5, 32), torch.randn(2, 5, 16)
    sharded = autoshard.autoshard(model, ctx.mesh_2d, example_inputs=(dp_slice(x, ctx.mesh_2d),))
    with torch.no_grad():
        sharded(dp_slice(x, ctx.mesh_2d))
    for p in sharded.parameters():  # released: each rank holds only its shard
        shards = math.prod(n for n, pl in zip(p.device_mesh.shape, p.placements, strict=True) if isinstance(pl, Shard))
        assert p.to_local().numel() * shards == p.numel()
    opt_s = torch.optim.SGD(sharded.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        mse_loss(sharded(dp_slice(x, ctx.mesh_2d)), dp_slice(target, ctx.mesh_2d)).backward()
        mse_loss(reference(x), target).backward()
        for opt in (opt_s, opt_r):
            opt.step()
            opt.zero_grad()
    ref_state = reference.state_dict()
    for fqn, value in sharded.state_dict().items():
        assert rel_error(full(value), ref_state[fqn], 1e-2) <= 1e-5, fqn


CHECKS = [
    check_placements_2x2,
    check_placements_1d,
    check_parameter_memory_is_a_quarter,
    check_tp_collectives_per_block,
    check_dp_collectives_per_unit,
    check_tp_only_and_dp_only_collectives,
    check_state_dict_in_original_layout,
    check_load_full_state_dict,
    check_model_state_dict_hooks_are_kept,
    check_load_state_dict_rejects_wrong_shapes,
    check_ranks_that_initialized_differently_agree,
    check_edited_plan_is_applied,
    check_rowwise_after_a_replicated_linear_takes_its_shard,
    check_loss_parallel_matches_the_gathered_loss,
    check_symbolic_batch_and_sequence,
    check_sequence_parallel,
    check_optimizer_built_after_an_evaluation_forward,
]


outcomes, test_sharded_module = distributed_tests(CHECKS)
