"""torch.compile: the autoshard backend, and compiling a sharded module, on real gloo ranks.

One 4-process group runs every check. Most checks compile with ``aot_eager``
(inductor on CPU costs tens of seconds per graph); one uses inductor.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.optim.optimizer as optimizer_module
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor, Shard

import autoshard
from autoshard.adapters.backend import default_mesh
from examples.models import Llama, LlamaConfig, MLPStack
from tests.distributed import distributed_tests
from tests.parity import dp_slice, full, lm_loss, mean_over_dp, rel_error

STEPS = 5


class BrokenLlama(Llama):
    """The Llama-style model with a graph break between its two blocks (a print, a data-dependent branch)."""

    def forward(self, tokens):
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.layers[0](self.tok_embeddings(tokens), cos, sin)
        torch._dynamo.graph_break()
        h = self.layers[1](h, cos, sin)
        return self.output(self.norm(h))


def _global_batch():
    torch.manual_seed(1)
    return torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))


def _batch(mesh):
    tokens, targets = _global_batch()
    return dp_slice(tokens, mesh), dp_slice(targets, mesh)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _train(step_fn, optimizer, tokens, targets, mesh, steps=STEPS):
    losses = []
    for _ in range(steps):
        loss = lm_loss(step_fn(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_dp(loss, mesh).item())
    return losses


def _eager_reference(model, mesh, tokens, targets, steps=STEPS):
    sharded = autoshard.autoshard(copy.deepcopy(model), mesh, example_inputs=(tokens,))
    losses = _train(sharded, _adamw(sharded.parameters()), tokens, targets, mesh, steps)
    return sharded, losses


def _assert_same_training(losses, ref_losses, state, ref_state, tol):
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - want) <= tol * abs(want), f"step {step}: compiled loss {got} vs eager {want}"
    assert state.keys() >= ref_state.keys()  # the backend also lists the buffers the graph reads
    for fqn, value in ref_state.items():
        err = rel_error(full(state[fqn]), full(value), 1e-2)
        assert err <= tol, f"{fqn}: compiled and eager parameters differ by {err:.2e}"


@dataclasses.dataclass
class _LlamaRun:
    """A Llama-style model compiled with the backend (aot_eager), next to eager ``autoshard`` trained ``steps``."""

    mesh: object
    model: nn.Module
    backend: object
    compiled: nn.Module
    tokens: torch.Tensor
    targets: torch.Tensor
    ref: nn.Module
    ref_losses: list[float]

    @classmethod
    def start(cls, ctx, model_class, steps):
        torch._dynamo.reset()  # no cached graph of an earlier check's model
        mesh = ctx.mesh_2d
        tokens, targets = _batch(mesh)
        torch.manual_seed(0)
        model = model_class(LlamaConfig(num_layers=2))
        ref, ref_losses = _eager_reference(model, mesh, tokens, targets, steps)
        backend = autoshard.backend(mesh, compiler="aot_eager")
        compiled = torch.compile(model, backend=backend)
        return cls(mesh, model, backend, compiled, tokens, targets, ref, ref_losses)


def check_backend_trains_like_eager(ctx):
    """Optimizer built before the first call from model.parameters() and attached; 5 AdamW steps; no
    recompiles; nothing hooked process-wide."""
    run = _LlamaRun.start(ctx, Llama, STEPS)
    model, backend, compiled, tokens, targets, mesh = (
        run.model, run.backend, run.compiled, run.tokens, run.targets, run.mesh
    )
    optimizer = backend.attach(_adamw(model.parameters()))
    frames = []
    losses = []
    for _ in range(STEPS):
        losses += _train(compiled, optimizer, tokens, targets, mesh, steps=1)
        frames.append(counters["frames"]["total"])
    assert frames[1:] == frames[:1] * (STEPS - 1), f"dynamo compiled again after the first step: {frames}"
    assert len(backend.sharded) == 1
    # bit-identical in practice: the same graph runs the same kernels
    _assert_same_training(losses, run.ref_losses, backend.state_dict(), run.ref.state_dict(), tol=1e-6)
    assert backend.plan.to_dict() == run.ref.autoshard_plan.to_dict()

    # the optimizer now trains the shards; the model's own tensors are released
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for p in backend.parameters()}
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert not optimizer_module._global_optimizer_pre_hooks, "a process-wide optimizer hook"
    with pytest.raises(ValueError, match="attach.. takes a torch.optim.Optimizer or the compiled nn.Module"):
        backend.attach(model.parameters())
    wq = dict(backend.named_parameters())["layers.0.attention.wq.weight"]
    assert isinstance(wq, DTensor) and tuple(wq.placements) == (Shard(0), Shard(1)) and wq.shape == (64, 64)
    assert wq.to_local().shape == (32, 32)

    # an evaluation under no_grad (dynamo captures the graph again) runs the same shards
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens), run.ref(tokens), rtol=0, atol=0)
    assert len(backend.sharded) == 1
    # new shapes would need planning from the released full weights: refused, naming a parameter
    with pytest.raises(Exception, match="'tok_embeddings.weight' was sharded for an earlier graph"):
        compiled(tokens[:1])


def check_graph_breaks_each_get_the_eager_plan(ctx):
    run = _LlamaRun.start(ctx, BrokenLlama, steps=3)
    backend = run.backend
    optimizer = backend.attach(_adamw(run.model.parameters()))
    losses = _train(run.compiled, optimizer, run.tokens, run.targets, run.mesh, steps=3)
    assert len(backend.sharded) == 2, "one sharded module per graph"
    first, second = (set(s.autoshard_plan.params) for s in backend.sharded)
    assert "layers.0.attention.wq.weight" in first and "layers.1.attention.wq.weight" in second
    assert not first & second
    want = run.ref.autoshard_plan.params
    got = backend.plan.params
    assert got.keys() == want.keys()
    for fqn, entry in want.items():
        assert (got[fqn].role, got[fqn].transposed, dict(got[fqn].placements)) == (
            entry.role,
            entry.transposed,
            dict(entry.placements),
        ), fqn
    _assert_same_training(losses, run.ref_losses, backend.state_dict(), run.ref.state_dict(), tol=1e-6)


def check_registered_backend_name(ctx):
    torch._dynamo.reset()  # no cached graph of an earlier check's model
    mesh = ctx.mesh_2d
    tokens, _ = _batch(mesh)
    torch.manual_seed(0)
    model = MLPStack()
    x = torch.randn(2, 5, 32)
    eager = autoshard.autoshard(copy.deepcopy(model), mesh, example_inputs=(x,))
    opt_c, opt_e = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    options = {"mesh": mesh, "compiler": "aot_eager", "attach": [opt_c]}
    compiled = torch.compile(model, backend="autoshard", options=options)
    for module, opt in ((compiled, opt_c), (eager, opt_e)):
        module(x).square().mean().backward()
        opt.step()
    # the attached optimizer stepped the shards; no_grad captures again and finds them
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x), rtol=0, atol=0)


def check_default_mesh(ctx):
    with ctx.mesh_2d:
        assert default_mesh() is ctx.mesh_2d
    mesh = default_mesh()  # no LOCAL_WORLD_SIZE here: one host, all ranks tensor parallel
    assert mesh.mesh_dim_names == ("dp", "tp") and tuple(mesh.shape) == (1, 4)


def check_optimizer_state_from_before_is_refused(ctx):
    torch._dynamo.reset()  # no cached graph of an earlier check's model
    mesh = ctx.mesh_2d
    torch.manual_seed(0)
    model = MLPStack()
    x = torch.randn(2, 5, 32)
    optimizer = _adamw(model.parameters())
    model(x).sum().backward()
    optimizer.step()  # state for the full tensors, which sharding cannot carry over
    optimizer.zero_grad()
    backend = autoshard.backend(mesh, compiler="aot_eager")
    backend.attach(optimizer)
    compiled = torch.compile(model, backend=backend)
    compiled(x).sum().backward()
    with pytest.raises(RuntimeError, match="optimizer holds state for 'blocks.0.norm.weight'"):
        optimizer.step()


def _one_device_sgd(model, tokens, targets, steps, lr):
    """``model`` trained on one device with SGD on the global batch; returns the losses.

    Each step is checked to be exactly ``p - lr * grad`` with plain gradients,
    and the optimizer to carry no hook: an optimizer holding none of a compiled
    model's released parameters steps as it always does.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        assert all(type(p.grad) is torch.Tensor for p in model.parameters())
        expected = [torch.add(p.detach(), p.grad, alpha=-lr) for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        for p, want in zip(model.parameters(), expected, strict=True):
            assert torch.equal(p.detach(), want)
        losses.append(loss.item())
    assert not optimizer._optimizer_step_pre_hooks and not optimizer_module._global_optimizer_pre_hooks
    return losses


def check_an_optimizer_not_attached_fails_loudly(ctx):
    """torch.compile's usual order: the optimizer built from ``model.parameters()``, then the model
    compiled, and ``backend.attach`` forgotten. Its first ``step()`` raises naming ``backend.attach``
    (SGD, AdamW for-loop and foreach), without a change to the model or the optimizer's state, even
    with ``zero_grad()`` between forward and backward; attached then, 3 SGD steps on 2x2 equal one
    device's."""
    torch._dynamo.reset()  # no cached graph of an earlier check's model
    mesh, lr = ctx.mesh_2d, 0.1
    tokens, targets = _global_batch()
    local_tokens, local_targets = dp_slice(tokens, mesh), dp_slice(targets, mesh)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(num_layers=2))
    one_device = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    backend = autoshard.backend(mesh, compiler="aot_eager")
    compiled = torch.compile(model, backend=backend)

    loss = lm_loss(compiled(local_tokens), local_targets)
    optimizer.zero_grad()  # clears what the first call marked: the backward marks it again
    loss.backward()
    before = {fqn: full(value).clone() for fqn, value in backend.state_dict().items()}
    forgotten = [optimizer, torch.optim.AdamW(model.parameters()), torch.optim.AdamW(model.parameters(), foreach=True)]
    for unattached in forgotten:
        with pytest.raises(RuntimeError, match=r"'tok_embeddings.weight' .* backend\.attach\(optimizer\)"):
            unattached.step()
        assert not unattached.state
    with pytest.raises(RuntimeError, match=r"backend\.parameters\(\)"):
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for fqn, value in backend.state_dict().items():
        assert torch.equal(full(value), before[fqn]), f"{fqn} changed by a step that raised"

    backend.attach(optimizer)
    optimizer.step()
    optimizer.zero_grad()
    losses = [mean_over_dp(loss, mesh).item()]
    losses += _train(compiled, optimizer, local_tokens, local_targets, mesh, steps=2)
    model.zero_grad(set_to_none=False)  # zeroing a released gradient does nothing

    ref_losses = _one_device_sgd(one_device, tokens, targets, steps=3, lr=lr)
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: compiled loss {got} vs one device {want}"
    state = backend.state_dict()
    for fqn, value in one_device.named_parameters():
        err = rel_error(full(state[fqn]), value)
        assert err <= 1e-5, f"{fqn}: compiled and one-device parameters differ by {err:.2e}"


def check_compiling_a_sharded_module(ctx):
    """``torch.compile(autoshard(...))``: dynamo runs around FSDP2's hooks; same numbers as eager."""
    torch._dynamo.reset()  # no cached graph of an earlier check's model
    mesh = ctx.mesh_2d
    tokens, targets = _batch(mesh)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(num_layers=2))
    ref, ref_losses = _eager_reference(model, mesh, tokens, targets, steps=3)
    sharded = autoshard.autoshard(model, mesh, example_inputs=(tokens,))
    compiled = torch.compile(sharded, backend="aot_eager")
    losses = _train(compiled, _adamw(sharded.parameters()), tokens, targets, mesh, steps=3)
    _assert_same_training(losses, ref_losses, sharded.state_dict(), ref.state_dict(), tol=1e-6)


def check_inductor_backend(ctx):
    """Inductor generates its own kernels (fused, reordered): equal to eager within float rounding.

    SGD, not AdamW: Adam's normalized update turns a rounding-level gradient
    difference on a near-zero gradient into an lr-sized parameter difference.
    """
    torch._dynamo.reset()  # no cached graph of an earlier check's model
    mesh = ctx.mesh_2d
    torch.manual_seed(0)
    model = MLPStack()
    x = torch.randn(2, 5, 32)
    eager = autoshard.autoshard(copy.deepcopy(model), mesh, example_inputs=(x,))
    with torch.no_grad():
        target = torch.randn_like(eager(x))
    backend = autoshard.backend(mesh, compiler="inductor")
    compiled = torch.compile(model, backend=backend)
    opt_c, opt_e = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager))
    backend.attach(opt_c)
    for _ in range(2):
        for module, opt in ((compiled, opt_c), (eager, opt_e)):
            nn.functional.mse_loss(module(x), target).backward()
            opt.step()
            opt.zero_grad()
    state, ref_state = backend.state_dict(), eager.state_dict()
    for fqn, value in ref_state.items():
        err = rel_error(full(state[fqn]), full(value), 1e-2)
        assert err <= 1e-5, f"{fqn}: compiled and eager parameters differ by {err:.2e}"
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-6)


def check_the_models_own_state_dict_after_sharding(ctx):
    """``model.state_dict()`` / ``model.load_state_dict()`` on the user's module, after the backend
    sharded it and the model was attached: the shards in the original layout out, a single-device
    state dict in."""
    run = _LlamaRun.start(ctx, Llama, 2)
    model, compiled, tokens, targets, mesh = run.model, run.compiled, run.tokens, run.targets, run.mesh
    _train(compiled, run.backend.attach(_adamw(model.parameters())), tokens, targets, mesh, steps=2)
    run.backend.attach(model)
    saved = model.state_dict()
    ref_state = run.ref.state_dict()
    assert saved.keys() == ref_state.keys()
    for fqn, value in ref_state.items():
        assert saved[fqn].shape == value.shape, fqn  # original layout: [out, in], not stored [in, out]
        err = rel_error(full(saved[fqn]), full(value), 1e-2)
        assert err <= 1e-6, f"{fqn}: model.state_dict() differs from eager by {err:.2e}"
    assert isinstance(saved["layers.0.attention.wq.weight"], DTensor)

    torch.manual_seed(5)
    fresh = Llama(LlamaConfig(num_layers=2)).state_dict()  # a plain single-device checkpoint
    result = model.load_state_dict(fresh)
    assert not result.missing_keys and not result.unexpected_keys, result
    run.ref.load_state_dict(fresh)
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens), run.ref(tokens), rtol=1e-6, atol=1e-6)


def check_backend_with_mixed_precision_and_selective_checkpointing(ctx):
    """``autoshard.backend(mesh, mp_policy=..., activation_checkpointing="selective")``: the graph dynamo
    traced is captured as FSDP2 runs it (each block's inputs cast to bf16), each compiled block runs
    under selective checkpointing, and the compiled model trains like eager autoshard with the same
    options, loss and every parameter within 1e-5 over 3 AdamW steps."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch._dynamo.reset()
    mesh = ctx.mesh_2d
    tokens, targets = _batch(mesh)
    options = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                   activation_checkpointing="selective")
    torch.manual_seed(0)
    model = Llama(LlamaConfig(num_layers=2))
    eager = autoshard.autoshard(copy.deepcopy(model), mesh, example_inputs=(tokens,), **options)
    ref_losses = _train(lambda t: eager(t).float(), _adamw(eager.parameters()), tokens, targets, mesh, steps=3)
    backend = autoshard.backend(mesh, compiler="aot_eager", **options)
    compiled = torch.compile(model, backend=backend)
    losses = _train(lambda t: compiled(t).float(), backend.attach(_adamw(model.parameters())), tokens, targets, mesh,
                    steps=3)
    _assert_same_training(losses, ref_losses, backend.state_dict(), eager.state_dict(), tol=1e-5)
    (sharded,) = backend.sharded
    assert backend.plan.to_dict() == eager.autoshard_plan.to_dict()
    assert "mixed precision: parameters all-gathered and computed in bfloat16" in str(backend.plan)
    block = sharded.get_submodule("layers.0")
    assert block.forward.wrapped.func.__name__ == "_checkpointed", block.forward
    # selective recomputation keeps the compiled blocks' collective outputs: a step runs the plan's tp
    # collectives and not one more
    from autoshard.adapters.comm_stats import CollectiveCounter

    with CollectiveCounter({a: mesh.get_group(a) for a in mesh.mesh_dim_names}) as step:
        lm_loss(compiled(tokens).float(), targets).backward()
    assert step.count("tp") == backend.plan.num_tp_collectives(), (step.stats(), str(backend.plan))


def check_backend_on_cp2_tp2_trains_like_one_device(ctx):
    """The backend on a cp x tp mesh: the graph dynamo traced is cut over the sequence as eager
    autoshard cuts the model. 3 AdamW steps hold the loss within 1e-5 of one device; with full
    checkpointing of each compiled block, 3 SGD steps hold the loss and every parameter."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    tokens, targets = _global_batch()
    for checkpointing, optimizer_of in ((None, _adamw), ("full", lambda ps: torch.optim.SGD(ps, lr=0.1))):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Llama(LlamaConfig(num_layers=2))
        reference = copy.deepcopy(model)
        backend = autoshard.backend(mesh, compiler="aot_eager", activation_checkpointing=checkpointing)
        compiled = torch.compile(model, backend=backend)
        optimizer = backend.attach(optimizer_of(model.parameters()))
        ref_optimizer = optimizer_of(reference.parameters())
        for _ in range(3):
            loss, ref_loss = lm_loss(compiled(tokens), targets), lm_loss(reference(tokens), targets)
            loss.backward()
            ref_loss.backward()
            for opt in (optimizer, ref_optimizer):
                opt.step()
                opt.zero_grad()
            assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()), (loss.item(), ref_loss.item())
        assert backend.plan.context.seq == tokens.shape[1]
        if checkpointing is None:
            continue
        state = backend.state_dict()
        for fqn, value in reference.state_dict().items():
            err = rel_error(full(state[fqn]), value, 1e-2)
            assert err <= 1e-5, f"{fqn}: compiled and one device differ by {err:.2e} after 3 SGD steps"


def check_backend_with_a_quantized_all_gather(ctx):
    """``autoshard.backend(mesh, all_gather_quant=...)``: the compiled model gathers fp8 blocks and
    trains like eager autoshard with the same option; its plan says so."""
    torch._dynamo.reset()
    mesh = ctx.mesh_2d
    tokens, targets = _batch(mesh)
    spec = autoshard.BlockQuant(torch.float8_e4m3fn, 16)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(num_layers=2))
    eager = autoshard.autoshard(copy.deepcopy(model), mesh, example_inputs=(tokens,), all_gather_quant=spec)
    ref_losses = _train(eager, _adamw(eager.parameters()), tokens, targets, mesh, steps=2)
    backend = autoshard.backend(mesh, compiler="aot_eager", all_gather_quant=spec)
    compiled = torch.compile(model, backend=backend)
    losses = _train(compiled, backend.attach(_adamw(model.parameters())), tokens, targets, mesh, steps=2)
    for got, want in zip(losses, ref_losses, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, ref_losses)
    assert "all-gather quantized: fp8 16x16" in str(backend.plan)


def _dynamo_graph(model, *inputs):
    """The graph and example inputs dynamo hands a backend for ``model(*inputs)``."""
    got = {}

    def grab(gm, example_inputs):
        got["gm"], got["inputs"] = gm, example_inputs
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=grab)(*inputs)
    return got["gm"], got["inputs"]


def test_the_backends_graph_is_captured_in_bf16_with_fsdp2s_casts_at_each_block():
    """Dynamo traces in float32; under ``mp_policy`` the backend writes FSDP2's casts into the graph
    (each block's floating inputs to bf16: the residual stream and the rotary tables), so capture
    runs it in bf16 as FSDP2 runs eager code, and the one-process proof holds."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from autoshard.adapters.backend import _GraphAsModule, _user_fqn_paths, read_graph_inputs
    from autoshard.adapters.unit_casts import cast_as_fsdp_units
    from autoshard.passes.capture import find_blocks

    torch.manual_seed(0)
    gm, example = _dynamo_graph(Llama(LlamaConfig(num_layers=2)), torch.randint(0, 256, (2, 16)))
    inputs = read_graph_inputs(gm, example)
    _user_fqn_paths(gm)
    module = _GraphAsModule(gm, inputs, example)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cast_as_fsdp_units(gm, inputs.kinds, find_blocks(module), policy)
    casts = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "to"]
    assert len(casts) == 6 and all(n.args[1] == torch.bfloat16 for n in casts)  # h, cos, sin into 2 blocks
    proof = autoshard.check(module, {"dp": 2, "tp": 2}, example_inputs=(example[inputs.user_positions[0]],),
                            mp_policy=policy)
    assert proof.ok, str(proof)


def test_a_cast_dynamo_fixed_in_float32_is_refused_under_bf16_by_line():
    """Hugging Face's RMSNorm upcasts and casts back to its input's dtype: traced in float32 both are
    ``.to(torch.float32)``, and the graph cannot tell which runs in bf16 under the policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from autoshard.adapters.backend import _GraphAsModule, _user_fqn_paths, read_graph_inputs
    from autoshard.adapters.unit_casts import cast_as_fsdp_units
    from autoshard.passes.capture import find_blocks
    from tests import hf_cases

    torch.manual_seed(0)
    gm, example = _dynamo_graph(hf_cases.small_llama_4_blocks(), torch.randint(0, 128, (2, 16)))
    inputs = read_graph_inputs(gm, example)
    _user_fqn_paths(gm)
    module = _GraphAsModule(gm, inputs, example)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with pytest.raises(NotImplementedError, match=r"fixing the dtype of the cast at modeling_llama\.py:\d+ "
                                                  r"`hidden_states = hidden_states\.to\(torch\.float32\)`.*"
                                                  r"torch\.compile\(autoshard\.autoshard\("):
        cast_as_fsdp_units(gm, inputs.kinds, find_blocks(module), policy)


class ArangeRotaryBlock(torch.nn.Module):
    """Rotary tables built in the forward from ``torch.arange`` (no parameter, no buffer) and cast to
    the input's dtype, as many models write them: traced in float32 the cast is a no-op, and under
    bf16 the tables would stay float32 beside bf16 queries."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96, bias=False)
        self.out = torch.nn.Linear(32, 32, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 8).transpose(1, 3).unbind(2)
        angles = torch.arange(s, dtype=torch.float32)[:, None] / (10000 ** (torch.arange(0, 8, 2) / 8))
        cos, sin = angles.cos().repeat(1, 2).to(x.dtype), angles.sin().repeat(1, 2).to(x.dtype)
        q = q * cos + torch.cat((-q[..., 4:], q[..., :4]), -1) * sin
        k = k * cos + torch.cat((-k[..., 4:], k[..., :4]), -1) * sin
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(o.transpose(1, 2).reshape(b, s, 32))


class ArangeRotaryModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([ArangeRotaryBlock() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_table_cast_to_the_inputs_dtype_is_refused_under_bf16_by_line(fake_world):
    """A cast dynamo fixed in float32 on a value made from constants alone is left as traced (FSDP2
    leaves buffers as they are), and when the capture then meets mixed dtypes the backend refuses by
    that cast's line, naming the eager path, instead of surfacing the capture's dtype error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    x = torch.randn(2, 16, 32)
    gm, example = _dynamo_graph(ArangeRotaryModel(), x)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    backend = autoshard.backend(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), compiler="eager",
                                mp_policy=policy)
    with pytest.raises(NotImplementedError, match=r"fixing the dtype of the cast at test_compile\.py:\d+ "
                                                  r"`cos, sin = angles\.cos\(\)\.repeat\(1, 2\)\.to\(x\.dtype\).*"
                                                  r"torch\.compile\(autoshard\.autoshard\("):
        backend(gm, example)


def _against_one_device(mesh, model, x, steps=3):
    """The backend (aot_eager) trained ``steps`` SGD steps on this rank's slice of ``x`` next to one
    device on all of it: each step's loss over the data ranks, and every parameter after."""
    from autoshard.core.mesh import data_parallel_rank

    torch._dynamo.reset()
    reference = copy.deepcopy(model)
    index, count = data_parallel_rank(mesh)
    local = x.chunk(count)[index]
    backend = autoshard.backend(mesh, compiler="aot_eager")
    compiled = torch.compile(model, backend=backend)
    optimizer = backend.attach(torch.optim.SGD(model.parameters(), lr=0.5))
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(steps):
        loss = compiled(local).float().pow(2).mean()
        ref_loss = sum(reference(c).float().pow(2).mean() for c in x.chunk(count)) / count
        loss.backward()
        ref_loss.backward()
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
        got = mean_over_dp(loss.detach(), mesh).item()
        assert abs(got - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()), (got, ref_loss.item())
    state = backend.state_dict()
    for fqn, value in reference.state_dict().items():
        assert rel_error(full(state[fqn]), value, 1e-2) <= 1e-5, fqn
    return backend


def check_backend_on_a_dp_mesh_reads_each_gathered_parameter(ctx):
    """On a mesh without tp every parameter is a plain tensor inside a block: each compiled block
    reads the one FSDP2 gathered for this call, not the shard it held when it was built."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests import pattern_models as pm

    torch.manual_seed(0)
    model = pm.Decoder(pm.Config(), lambda cfg: pm.Block(cfg, pm.QKVAttention))
    x = torch.randint(0, pm.Config().vocab, (8, 8), generator=torch.Generator().manual_seed(1))
    backend = _against_one_device(init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)), model, x)
    assert all(isinstance(m.forward, _compiled_types()) for m in _blocks(backend))


def check_backend_on_an_ep_mesh_runs_the_exchanging_blocks_eagerly(ctx):
    """On ``dp x ep`` the blocks whose experts exchange rows run eagerly (the rows each rank receives
    are data: no compiler's fake tensor has their size); 3 SGD steps within 1e-5 of one device."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests import pattern_models as pm

    torch.manual_seed(0)
    model = pm.ExpertsMoE(pm.Config(), experts=pm.IndexedExperts)
    x = torch.randint(0, pm.Config().vocab, (8, 8), generator=torch.Generator().manual_seed(1))
    backend = _against_one_device(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep")), model, x)
    assert [c.choice for c in backend.plan.experts] == ["ep", "ep"]
    assert not any(isinstance(m.forward, _compiled_types()) for m in _blocks(backend))


def _blocks(backend):
    (sharded,) = backend.sharded
    return [sharded.get_submodule(unit) for unit in sharded.autoshard_plan.units if unit]


def _compiled_types():
    from autoshard.adapters.compiled_blocks import _FirstCallOutside, _LocalCompiled

    return (_LocalCompiled, _FirstCallOutside)


CHECKS = [
    check_backend_trains_like_eager,
    check_backend_on_a_dp_mesh_reads_each_gathered_parameter,
    check_backend_on_an_ep_mesh_runs_the_exchanging_blocks_eagerly,
    check_backend_with_mixed_precision_and_selective_checkpointing,
    check_backend_on_cp2_tp2_trains_like_one_device,
    check_backend_with_a_quantized_all_gather,
    check_the_models_own_state_dict_after_sharding,
    check_graph_breaks_each_get_the_eager_plan,
    check_registered_backend_name,
    check_default_mesh,
    check_optimizer_state_from_before_is_refused,
    check_an_optimizer_not_attached_fails_loudly,
    check_compiling_a_sharded_module,
    check_inductor_backend,
]

outcomes, test_check = distributed_tests(CHECKS)
