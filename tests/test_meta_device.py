"""Models built on the meta device: planned and sharded without their full weights.

A model built under ``torch.device("meta")`` is sharded like any other; only
each rank's local shards are allocated (uninitialized), and
``load_state_dict`` fills them. The checks compare it with the same model
built on CPU and sharded the ordinary way: same placements and local shapes,
bit-identical outputs and AdamW training after loading. One 4-process group
runs every distributed check; planning needs no process group.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import autoshard
from examples.models import Llama, LlamaConfig, MLPStack, rotary_tables
from tests.distributed import distributed_tests
from tests.hf_cases import CASES, main_output
from tests.parity import dp_slice, full, hf_loss, lm_loss, mse_loss

CFG = LlamaConfig()


def _llama_pair():
    """The Llama example built on CPU (seed 0) and on meta, its rotary tables filled."""
    torch.manual_seed(0)
    on_cpu = Llama(CFG)
    with torch.device("meta"):
        on_meta = Llama(CFG)
    on_meta.rope_cos, on_meta.rope_sin = rotary_tables(CFG.dim // CFG.num_heads, CFG.max_seq_len, CFG.rope_theta)
    return on_cpu, on_meta


def _assert_same_layout(got, want):
    got_params, want_params = dict(got.named_parameters()), dict(want.named_parameters())
    assert list(got_params) == list(want_params)
    for fqn, want_param in want_params.items():
        param = got_params[fqn]
        assert param.device == want_param.device, (fqn, param.device)
        assert tuple(param.placements) == tuple(want_param.placements), (fqn, param.placements)
        assert param.shape == want_param.shape, fqn
        assert param.to_local().shape == want_param.to_local().shape, fqn


def _assert_same_state(got, want):
    want_state = want.state_dict()
    for key, value in got.state_dict().items():
        assert torch.equal(full(value), full(want_state[key])), key


def _train_together(sharded, twin, local, targets, loss_fn, steps=3):
    """AdamW on both; every loss must be identical."""
    opt_a = torch.optim.AdamW(sharded.parameters(), lr=1e-2, weight_decay=0.1)
    opt_b = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        losses = []
        for model, opt in ((sharded, opt_a), (twin, opt_b)):
            loss = loss_fn(model(local), targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1], (step, losses)


def check_llama_on_meta_trains_like_the_cpu_built_model(ctx):
    mesh = ctx.mesh_2d
    on_cpu, on_meta = _llama_pair()
    tokens, targets = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    local, local_targets = dp_slice(tokens, mesh), dp_slice(targets, mesh)
    rope_cos = on_meta.rope_cos
    reference = autoshard.autoshard(on_cpu, mesh, example_inputs=(local,))
    sharded = autoshard.autoshard(on_meta, mesh, example_inputs=(local,))
    assert all(p.is_meta for p in on_meta.parameters())  # the user's model is untouched
    assert on_meta.rope_cos is rope_cos
    assert str(sharded.autoshard_plan) == str(reference.autoshard_plan)
    _assert_same_layout(sharded, reference)
    for name, buffer in sharded.named_buffers():
        assert torch.equal(buffer, reference.get_buffer(name)), name
    for gm in sharded.modules():  # tensors the forward creates are not on meta
        if hasattr(gm, "code"):
            assert "'meta'" not in gm.code, gm.code
    sharded.load_state_dict(on_cpu.state_dict())
    _assert_same_state(sharded, reference)
    assert torch.equal(sharded(local), reference(local))
    _train_together(sharded, reference, local, local_targets, lm_loss)
    _assert_same_state(sharded, reference)


def check_no_full_size_tensor_is_allocated(ctx):
    """Every tensor allocated on a real device while sharding is at most one local
    shard; each parameter's storage is exactly its shard."""
    mesh = ctx.mesh_2d
    _, on_meta = _llama_pair()
    local = dp_slice(torch.randint(0, 256, (4, 16)), mesh)
    with _RealAllocations() as allocations:
        sharded = autoshard.autoshard(on_meta, mesh, example_inputs=(local,))
    params = dict(sharded.named_parameters())
    largest_full = max(p.numel() for p in on_meta.parameters())
    largest_shard = max(p.to_local().numel() for p in params.values())
    assert largest_shard * 4 == largest_full
    assert allocations.sizes, "the allocation hook saw nothing"
    assert max(allocations.sizes) <= largest_shard, (max(allocations.sizes), largest_shard)
    full_bytes = sum(p.numel() * p.element_size() for p in on_meta.parameters())
    norm_bytes = sum(p.numel() * p.element_size() for n, p in on_meta.named_parameters() if "norm" in n)
    expected = (full_bytes - norm_bytes) // 4 + norm_bytes // 2  # norm weights are cut over dp only
    stored = sum(p.to_local().untyped_storage().nbytes() for p in params.values())
    assert stored == sum(p.to_local().numel() * p.element_size() for p in params.values()) == expected
    assert all(p.device.type == "cpu" for p in params.values())


class _RealAllocations(TorchDispatchMode):
    """Sizes (elements) of the tensors ops return on a real device, a DTensor's local part."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, DTensor):
                tensor = tensor.to_local()
            if isinstance(tensor, torch.Tensor) and not isinstance(tensor, FakeTensor) and not tensor.is_meta:
                self.sizes.append(tensor.numel())
        return out


def check_load_sharded_state_dict(ctx):
    """A sharded state dict (DTensors) of a CPU-built model loads into the meta-built one."""
    mesh = ctx.mesh_2d
    _, on_meta = _llama_pair()
    torch.manual_seed(7)
    other = Llama(CFG)
    local = dp_slice(torch.randint(0, 256, (4, 16)), mesh)
    source = autoshard.autoshard(other, mesh, example_inputs=(local,))
    sharded = autoshard.autoshard(on_meta, mesh, example_inputs=(local,))
    sharded.load_state_dict(source.state_dict())
    _assert_same_state(sharded, source)
    assert torch.equal(sharded(local), source(local))
    torch.testing.assert_close(sharded(local), other(local), rtol=1e-5, atol=1e-5)


def check_one_axis_meshes_and_colwise_biases(ctx):
    """tp-only and dp-only meshes; an MLP whose colwise biases stay out of FSDP (their
    gradients averaged by a hook that must survive the allocation)."""
    for mesh in (ctx.mesh_tp, ctx.mesh_dp):
        on_cpu, on_meta = _llama_pair()
        local = dp_slice(torch.randint(0, 256, (4, 16)), mesh)
        reference = autoshard.autoshard(on_cpu, mesh, example_inputs=(local,))
        sharded = autoshard.autoshard(on_meta, mesh, example_inputs=(local,))
        _assert_same_layout(sharded, reference)
        sharded.load_state_dict(on_cpu.state_dict())
        assert torch.equal(sharded(local), reference(local)), mesh.mesh_dim_names
    mesh = ctx.mesh_2d
    torch.manual_seed(0)
    on_cpu = MLPStack()
    with torch.device("meta"):
        on_meta = MLPStack()
    x, y = dp_slice(torch.randn(8, 5, 32), mesh), dp_slice(torch.randn(8, 5, 16), mesh)
    reference = autoshard.autoshard(on_cpu, mesh, example_inputs=(x,))
    sharded = autoshard.autoshard(on_meta, mesh, example_inputs=(x,))
    _assert_same_layout(sharded, reference)
    sharded.load_state_dict(on_cpu.state_dict())
    _train_together(sharded, reference, x, y, mse_loss)
    _assert_same_state(sharded, reference)


class GainMLP(nn.Module):
    """An MLP scaled by a persistent buffer: its value comes from the state dict."""

    def __init__(self, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x))) * self.gain


def check_persistent_buffers_come_from_the_state_dict(ctx):
    mesh = ctx.mesh_2d
    torch.manual_seed(0)
    on_cpu = GainMLP()
    with torch.device("meta"):
        on_meta = GainMLP()
    x = dp_slice(torch.randn(8, 5, 32), mesh)
    sharded = autoshard.autoshard(on_meta, mesh, example_inputs=(x,))
    gain = sharded.get_buffer("gain")
    assert gain.device.type == "cpu" and gain.shape == (32,)
    assert on_meta.gain.is_meta
    sharded.load_state_dict(on_cpu.state_dict())
    assert torch.equal(sharded.get_buffer("gain"), on_cpu.gain)
    assert torch.equal(sharded.state_dict()["gain"], on_cpu.gain)
    torch.testing.assert_close(sharded(x), on_cpu(x), rtol=1e-5, atol=1e-5)


def check_hf_llama_needs_its_rotary_buffer_filled(ctx):
    """HF's ``inv_freq`` is a non-persistent buffer: refused while on meta; once filled
    (from a rotary module built on CPU), the tied HF Llama shards, loads and matches."""
    mesh = ctx.mesh_2d
    case = CASES["llama_tied"]
    torch.manual_seed(0)
    on_cpu = case.build().eval()
    with torch.device("meta"):
        on_meta = case.build().eval()
    ids, _ = case.inputs()
    local = dp_slice(ids, mesh)
    with pytest.raises(ValueError, match=r"'model\.rotary_emb\.inv_freq'"):
        autoshard.autoshard(on_meta, mesh, example_inputs=(local,))
    assert on_meta.model.rotary_emb.inv_freq.is_meta
    on_meta.model.rotary_emb.inv_freq = type(on_meta.model.rotary_emb)(config=on_meta.config).inv_freq
    sharded = autoshard.autoshard(on_meta, mesh, example_inputs=(local,))
    assert sharded.get_parameter("lm_head.weight") is sharded.get_parameter("model.embed_tokens.weight")
    for gm in sharded.modules():
        if hasattr(gm, "code"):
            assert "'meta'" not in gm.code, gm.code
    sharded.load_state_dict(on_cpu.state_dict())
    reference = autoshard.autoshard(on_cpu, mesh, example_inputs=(local,))
    _assert_same_layout(sharded, reference)
    assert torch.equal(main_output(sharded(local)), main_output(reference(local)))
    torch.testing.assert_close(main_output(sharded(local)), main_output(on_cpu(local)), rtol=1e-5, atol=1e-5)


def check_hf_llama_on_meta_shards_on_a_pipeline(ctx):
    """Built on meta, as a model too large for one host is sharded: Hugging Face Llama (its rotary
    table made in a no-grad region) plans and shards on pp=2 x tp=2 and, filled from the CPU-built
    model's state dict, a 1F1B step over 2 microbatches gives one device's loss and leaves no
    tensor on meta."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    case = CASES["llama"]
    torch.manual_seed(0)
    on_cpu = case.build()
    with torch.device("meta"):
        on_meta = case.build()
    on_meta.model.rotary_emb.inv_freq = type(on_meta.model.rotary_emb)(config=on_meta.config).inv_freq
    ids, _ = case.inputs()
    targets = torch.randint(0, on_cpu.config.vocab_size, ids.shape, generator=torch.Generator().manual_seed(1))
    pipe = autoshard.autoshard(on_meta, mesh, example_inputs=(ids,), loss_fn=hf_loss, microbatches=2,
                               schedule="1F1B")
    assert all(p.is_meta for p in on_meta.parameters())
    pipe.load_state_dict(on_cpu.state_dict())
    assert not any(t.is_meta for t in [*pipe.parameters(), *pipe.module.buffers()])
    loss = pipe.step(ids, targets)
    torch.testing.assert_close(loss, hf_loss(on_cpu(ids), targets).detach(), rtol=1e-5, atol=1e-6)


def check_unfilled_non_persistent_buffers_are_refused(ctx):
    with torch.device("meta"):
        on_meta = Llama(CFG)
    local = dp_slice(torch.randint(0, 256, (4, 16)), ctx.mesh_2d)
    with pytest.raises(ValueError, match=r"non-persistent buffer\(s\) 'rope_cos', 'rope_sin' are on the meta"):
        autoshard.autoshard(on_meta, ctx.mesh_2d, example_inputs=(local,))
    assert on_meta.rope_cos.is_meta


CHECKS = [
    check_hf_llama_on_meta_shards_on_a_pipeline,
    check_llama_on_meta_trains_like_the_cpu_built_model,
    check_no_full_size_tensor_is_allocated,
    check_load_sharded_state_dict,
    check_one_axis_meshes_and_colwise_biases,
    check_persistent_buffers_come_from_the_state_dict,
    check_hf_llama_needs_its_rotary_buffer_filled,
    check_unfilled_non_persistent_buffers_are_refused,
]


outcomes, test_meta_device = distributed_tests(CHECKS)


def test_meta_model_plans_like_the_cpu_model():
    """Planning reads shapes only: a meta model's plan is the CPU-built one's."""
    tokens = torch.randint(0, 256, (2, 16))
    on_cpu, on_meta = _llama_pair()
    with torch.device("meta"):
        bare = Llama(CFG)  # planning needs no buffer values either
    want = str(autoshard.plan(on_cpu, {"dp": 2, "tp": 2}, example_inputs=(tokens,)))
    assert str(autoshard.plan(on_meta, {"dp": 2, "tp": 2}, example_inputs=(tokens,))) == want
    assert str(autoshard.plan(bare, {"dp": 2, "tp": 2}, example_inputs=(tokens,))) == want
    dynamic = ({0: torch.export.Dim("batch", min=1, max=64), 1: torch.export.Dim("seq", min=2, max=64)},)
    symbolic = autoshard.plan(bare, {"dp": 2, "tp": 2}, example_inputs=(tokens,), dynamic_shapes=dynamic)
    assert str(symbolic) == want


@pytest.mark.parametrize("mesh", [{"pp": 2, "cp": 2, "tp": 2}, {"pp": 2, "dp": 2, "cp": 2}, {"cp": 2, "tp": 2}],
                         ids=["pp2xcp2xtp2", "pp2xdp2xcp2", "cp2xtp2"])
def test_a_hugging_face_llama_on_meta_plans_every_axis_as_built_on_the_cpu(mesh):
    """Pipeline stages with context parallelism plan from shapes alone too: the stage shapes run the
    cp x tp grid on fake tensors, so a model too large for one host plans on meta as on the CPU."""
    from tests import hf_cases

    tokens = torch.randint(0, 128, (4, 16))
    torch.manual_seed(0)
    on_cpu = hf_cases.small_llama_4_blocks()
    with torch.device("meta"):
        on_meta = hf_cases.small_llama_4_blocks()
    pipelined = {"microbatches": 2} if "pp" in mesh else {}
    want = autoshard.plan(on_cpu, mesh, example_inputs=(tokens,), **pipelined)
    # the example on the CPU, and on meta as well (how a model too large for one host is planned)
    for example in (tokens, tokens.to("meta")):
        got = autoshard.plan(on_meta, mesh, example_inputs=(example,), **pipelined)
        assert got.params == want.params and got.units == want.units and got.context == want.context
        assert got.context.seq == 16
        if "pp" in mesh:  # the same stages, sending the same values; the activation estimate differs: on meta
            # export keeps each attention output's `.contiguous()` copy, a no-op it drops on the CPU
            # (docs/pipeline.md)
            assert [s.units for s in got.pipeline.stages] == [s.units for s in want.pipeline.stages]
            assert got.pipeline.sends == want.pipeline.sends


def test_suggest_mesh_ranks_pipelined_meshes_of_a_model_and_example_on_meta():
    """Every candidate of 8 ranks, pipelined ones included, is planned from shapes alone: the stage
    shapes of an example on meta run as fakes on the host's device, where the graph's tables live."""
    from tests import hf_cases

    with torch.device("meta"):
        on_meta = hf_cases.small_llama_4_blocks()
    tokens = torch.randint(0, 128, (8, 16), device="meta")
    suggestion = autoshard.suggest_mesh(on_meta, 8, example_inputs=(tokens,), links=autoshard.Links(intra_gbps=100.0),
                                        flops_per_second=1e12, verbose=False)
    assert any("pp" in c.mesh for c in suggestion.candidates), suggestion
    assert all(p.is_meta for p in on_meta.parameters())


def test_partly_meta_model_is_refused():
    torch.manual_seed(0)
    model = Llama(CFG)
    with torch.device("meta"):
        model.output = torch.nn.Linear(CFG.dim, CFG.vocab_size, bias=False)
    wanted = r"'output\.weight' is on the meta device but 'tok_embeddings\.weight' is on cpu"
    with pytest.raises(ValueError, match=wanted):
        autoshard.plan(model, {"dp": 2, "tp": 2}, example_inputs=(torch.randint(0, 256, (2, 16)),))
