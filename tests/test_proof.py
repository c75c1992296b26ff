"""The one-process proof (``autoshard.check``): every tp rank of the emitted code against the
unsharded captured graph, in this process, with no process group.

It proves the models of the test matrix on tp=2, 4 and 8 (kv heads fewer than tp, heads that
do not divide); it fails, naming the node and its source line, when a plan is broken on
purpose (a dropped all-reduce, a wrong cut, a dropped backward sum, a global shape left in
the code); and each bug it found has its regression here: a tied embedding with a padding
row (Gemma-2), an ALiBi bias cut head-strided (BLOOM), rotary tables built without a device
under mixed precision.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy

import autoshard
from autoshard.core.errors import InternalError, in_stage
from autoshard.core.options import DEFAULT_OPTIONS, PlanOptions
from autoshard.driver import planning
from autoshard.proof.proof import prove
from autoshard.runtime import collectives
from tests.cases import MODELS
from tests.pattern_models import PATTERNS, VOCAB, Block, Config, Decoder, QKVAttention, VisionTransformer

TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("name", ["llama", "mlp_stack", "raw_linear"])
def test_examples_are_proven(name, tp):
    build, inputs = MODELS[name]
    torch.manual_seed(0)
    proof = autoshard.check(build(), {"dp": 2, "tp": tp}, example_inputs=inputs)
    assert proof.ok, str(proof)
    assert proof.tp == tp
    assert len(proof.gradients) == len(list(build().parameters()))
    assert proof.max_output_error < 1e-5 and proof.max_gradient_error < 1e-5


@pytest.mark.parametrize("tp", [4, 8])  # 2x2 runs them on real gloo ranks (tests/test_patterns.py)
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_patterns_are_proven(name, tp):
    torch.manual_seed(0)
    proof = autoshard.check(PATTERNS[name](), {"tp": tp}, example_inputs=(TOKENS,))
    assert proof.ok, str(proof)


# --- plans broken on purpose: the proof names the node -------------------------------------


def _emitted(model, inputs, tp=2, options=DEFAULT_OPTIONS, dp=None):
    axes = planning.mesh_axes({"tp": tp} if dp is None else {"dp": dp, "tp": tp})
    planned = planning.plan_result(model, axes, inputs, None, None, options, keep_reference=True)
    return planning.emit(planned, axes, options, keep_planned=True)


def _break_first(emitted, target, change) -> None:
    for gm in emitted.parts.blocks.values():
        for node in gm.graph.nodes:
            if node.target is target:
                change(gm, node)
                gm.recompile()
                return
    raise AssertionError(f"no {target} in the emitted blocks")


def _drop(gm, node):
    node.replace_all_uses_with(node.args[0])
    gm.graph.erase_node(node)


def _llama():
    build, inputs = MODELS["llama"]
    torch.manual_seed(0)
    return build(), inputs


def test_dropped_all_reduce_is_named():
    model, inputs = _llama()
    emitted = _emitted(model, inputs)
    _break_first(emitted, collectives.REDUCE_PARTIAL, _drop)
    proof = prove(emitted.subject, model, inputs, None)
    assert not proof.ok and proof.max_output_error > 1e-2
    # the attention's partial output reaches the residual add unreduced
    assert proof.first_divergence.startswith("node 'add_2' (add.Tensor) at models.py:"), proof.first_divergence
    assert "its value" in proof.first_divergence
    with pytest.raises(autoshard.ProofError, match="first divergence: node 'add_2'"):
        proof.raise_if_failed()


def test_wrong_cut_is_named():
    """An all-reduce where the replicated input of q/k/v should pass unchanged: every rank now
    reads tp times its input, first visible at q's view to heads."""
    model, inputs = _llama()
    emitted = _emitted(model, inputs)
    _break_first(emitted, collectives.ENTER_TP, lambda gm, node: setattr(node, "target", collectives.REDUCE_PARTIAL))
    proof = prove(emitted.subject, model, inputs, None)
    assert not proof.ok
    assert proof.first_divergence.startswith("node 'view' (view.default) at models.py:"), proof.first_divergence


def test_dropped_backward_sum_is_named():
    """``enter_tp`` made a plain copy: the forward is right, the input gradient of q/k/v is one
    rank's partial sum, first wrong at the norm that feeds them."""
    model, inputs = _llama()
    emitted = _emitted(model, inputs)

    def plain_copy(gm, node):
        node.target, node.args = torch.ops.aten.clone.default, (node.args[0],)

    _break_first(emitted, collectives.ENTER_TP, plain_copy)
    proof = prove(emitted.subject, model, inputs, None)
    assert proof.max_output_error < 1e-5 and proof.max_gradient_error > 1e-2
    assert proof.first_divergence.startswith("node 'rms_norm' (rms_norm.default)"), proof.first_divergence
    assert "its gradient" in proof.first_divergence


def test_emitted_code_that_raises_is_named():
    model, inputs = _llama()
    emitted = _emitted(model, inputs)

    def global_shape(gm, node):
        node.args = (node.args[0], [2, 16, 4, 16])

    _break_first(emitted, torch.ops.aten.view.default, global_shape)
    proof = prove(emitted.subject, model, inputs, None)
    assert not proof.ok
    assert proof.first_divergence.startswith("node 'view' (view.default) at models.py:")
    assert "fails in the emitted code" in proof.first_divergence


# --- regressions of bugs the proof found ----------------------------------------------------


class TiedPaddedLM(nn.Module):
    """A tied, scaled embedding with a padding row, as Gemma writes it."""

    def __init__(self, vocab=256, dim=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, 128, bias=False)
        self.down = nn.Linear(128, dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.scale = dim**0.5

    def forward(self, ids):
        h = self.embed(ids) * self.scale
        h = h + self.down(torch.relu(self.up(self.norm(h))))
        return self.head(self.norm(h))


@pytest.mark.parametrize("tp", [2, 4])
def test_tied_embedding_with_padding_row_trains_every_row(tp):
    """Each rank's lookup reads local rows: a global padding_idx of 0 once froze every rank's
    first row (ids 64, 128, 192 on tp=4), whatever the example input held."""
    example = torch.full((2, 16), 5)  # no id near a slice edge: the proof draws its own
    proof = autoshard.check(TiedPaddedLM(), {"tp": tp}, example_inputs=(example,))
    assert proof.ok, str(proof)
    assert proof.error_of("gradient of 'embed.weight'") < 1e-5


def test_bloom_alibi_is_emitted_in_order():
    """BLOOM's ALiBi bias is cut head-strided (a three-node step) in front of baddbmm; the
    step's nodes once landed in reverse order and FX refused the graph."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4, use_cache=False)
    torch.manual_seed(0)
    for tp in (2, 4):
        proof = autoshard.check(transformers.BloomForCausalLM(config), {"tp": tp},
                                example_inputs=(torch.randint(0, 256, (2, 16)),))
        assert proof.ok, str(proof)


@pytest.mark.parametrize("name", ["arange_rope", "reference_llama", "parallel_block"])
def test_mixed_precision_is_proven(name):
    """bf16 capture of a forward that builds its rotary table with torch.arange and no device.
    Proven against float64: sharding costs about what one device's own bf16 rounding does."""
    torch.manual_seed(0)
    proof = autoshard.check(PATTERNS[name](), {"dp": 2, "tp": 4}, example_inputs=(TOKENS,), mp_policy=BF16)
    assert proof.ok, str(proof)
    assert proof.exact == "float64" and proof.precision_change is None
    assert 0 < proof.max_output_error < 3e-2
    assert all(m.one_device > 0 for m in (*proof.outputs, *proof.gradients))  # bf16 rounds on one device too
    assert proof.worst_factor < 2, str(proof)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_bf16_wide_norm_computes_as_aten_does(tp):
    """A q/k RMSNorm over the cut width is written out (passes/decompose.py). In bf16 it must
    compute as ATen's ``rms_norm``: statistics in float32 and float32's epsilon (``eps=None``).
    With bf16's epsilon (0.0078) it cost 2-5 times one device's error, under the old fixed 3e-2."""
    torch.manual_seed(0)
    proof = autoshard.check(PATTERNS["wide_qk_norm"](), {"dp": 2, "tp": tp}, example_inputs=(TOKENS,),
                            mp_policy=BF16)
    assert proof.ok, str(proof)
    assert proof.worst_factor < 2, str(proof)


# --- plans broken in bf16 code only: caught by the bf16 proof and named by node ----------------


def _bf16_emitted(name, tp=4):
    torch.manual_seed(0)
    model = PATTERNS[name]()
    return model, _emitted(model, (TOKENS,), tp, PlanOptions(mp_policy=BF16), dp=2)


def test_bf16_partial_sum_added_in_bf16_is_named():
    """A rowwise output's bf16 partial sums added in bf16 (rounded after every addition) where
    the plan adds tp sums in float32."""
    model, emitted = _bf16_emitted("reference_llama")
    _break_first(emitted, collectives.REDUCE_PARTIAL, lambda gm, node: setattr(node, "args", node.args[:2]))
    proof = prove(emitted.subject, model, (TOKENS,), None)
    assert not proof.ok
    assert proof.first_divergence.startswith("node 'linear_3_reduced'"), proof.first_divergence
    assert "adds bfloat16 partial sums in bfloat16, where the plan adds tp sums in float32" in proof.first_divergence
    with pytest.raises(autoshard.ProofError, match="precision: node 'linear_3_reduced'"):
        proof.raise_if_failed()


def test_cast_dropped_before_a_sum_is_named():
    """The float32 cast ahead of a norm's mean over the cut width dropped: the statistic is taken
    in bf16."""
    model, emitted = _bf16_emitted("wide_qk_norm")

    gm = next(iter(emitted.parts.blocks.values()))
    upcast = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.to.dtype and n.args[1] is torch.float32)
    _drop(gm, upcast)
    gm.recompile()
    proof = prove(emitted.subject, model, (TOKENS,), None)
    assert not proof.ok
    assert "computes in bfloat16 where the model's code computes in float32" in proof.first_divergence
    assert proof.first_divergence.startswith("node 'mul_tensor' (mul.Tensor)"), proof.first_divergence


def test_reduction_in_the_wrong_dtype_is_named():
    """Attention probabilities the model takes in float32 (``softmax(scores.float())``) taken in bf16."""
    model, emitted = _bf16_emitted("reference_llama")

    def softmax_in_bf16(gm, node):
        if next(iter(node.users)).target is torch.ops.aten.softmax.int:
            node.args = (node.args[0], torch.bfloat16)

    for gm in emitted.parts.blocks.values():
        for node in list(gm.graph.nodes):
            if node.target is torch.ops.aten.to.dtype:
                softmax_in_bf16(gm, node)
        gm.recompile()
    proof = prove(emitted.subject, model, (TOKENS,), None)
    assert not proof.ok
    assert "computes in bfloat16 where the model's code computes in float32" in proof.first_divergence
    assert "`scores = F.softmax((scores + mask).float(), dim=-1)" in proof.first_divergence, proof.first_divergence


def test_dropped_all_reduce_in_bf16_is_far_beyond_rounding():
    model, emitted = _bf16_emitted("reference_llama")
    _break_first(emitted, collectives.REDUCE_PARTIAL, _drop)
    proof = prove(emitted.subject, model, (TOKENS,), None)
    assert not proof.ok and proof.precision_change is None
    assert proof.worst_factor > 20, str(proof)  # right plans stay under 2
    assert proof.first_divergence.startswith("node 'add_1' (add.Tensor) at pattern_models.py:"), proof.first_divergence


def test_internal_errors_name_stage_and_node():
    model, inputs = _llama()
    planned = planning.plan_result(model, planning.mesh_axes({"tp": 2}), inputs, None, None, PlanOptions())
    graph = planned.captured.gm.graph
    with pytest.raises(InternalError, match=r"stage 'layouts' at node 'rms_norm' \(rms_norm.default\) at models.py"):
        with in_stage("layouts", graph):
            raise RuntimeError("Argument 'rms_norm' was used before it has been defined")
    with pytest.raises(ValueError, match="meant for the user"):
        with in_stage("layouts", graph):
            raise ValueError("meant for the user")


def test_check_option_is_validated(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, inputs = _llama()
    with pytest.raises(ValueError, match="check must be True, False or 'auto'"):
        autoshard.autoshard(model, mesh, example_inputs=inputs, check="always")


@pytest.mark.parametrize("tp", [2, 4])
def test_buffer_written_in_place_is_cut_after_the_writes(tp):
    """Keys assembled in a ``new_empty`` buffer slice by slice (MiniCPM3's MLA): the cut attention
    reads was once placed right after the buffer was made, before the writes filled it."""
    torch.manual_seed(0)
    proof = autoshard.check(PATTERNS["slice_filled_keys"](), {"tp": tp}, example_inputs=(TOKENS,))
    assert proof.ok, str(proof)


# --- sequence parallelism through a flattened MLP (OPT) -----------------------------------------


class FlattenedMLPBlock(nn.Module):
    """OPT's decoder layer: the MLP runs on ``reshape(-1, hidden)``, batch and sequence merged, and
    its residual add is viewed back. Under sequence parallelism each rank's rows of the merged dim
    are a strided subset (its sequence chunk of every batch row)."""

    def __init__(self, cfg):
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim)
        self.attention = QKVAttention(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg.dim)
        self.fc1 = nn.Linear(cfg.dim, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.dim)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        shape = h.shape
        h = h.reshape(-1, h.size(-1))
        residual = h
        h = self.fc2(F.relu(self.fc1(self.final_layer_norm(h))))
        return (residual + h).view(shape)


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_through_a_flattened_mlp(tp):
    """The MLP's input is gathered from its strided rows for the colwise fc1 and fc2's sum cut back
    to them; the gather was once emitted as a cut (OPT failed at its residual add)."""
    torch.manual_seed(0)
    model = Decoder(Config(), FlattenedMLPBlock)
    proof = autoshard.check(model, {"dp": 2, "tp": tp}, example_inputs=(TOKENS,), sequence_parallel=True)
    assert proof.ok, str(proof)
    assert proof.max_output_error < 1e-5 and proof.max_gradient_error < 1e-5
    assert proof.tp_collectives == proof.plan.predicted_comm()["tp"]


IMAGES = torch.randn(2, 3, 16, 16)


def _sequence_notes(plan) -> dict[str, str]:
    return {fqn: p.note for fqn, p in plan.params.items() if "sequence_parallel:" in p.note}


def _reduce_scatters(plan) -> int:
    return sum(c.kind == "reduce-scatter" for p in plan.params.values() for c in p.collectives)


def test_sequence_parallel_keeps_a_sequence_tp_does_not_divide_whole():
    """A ViT's class token makes 17 positions of 16 patches: no tp divides them. The rowwise
    outputs are all-reduced and kept whole, each noted, as a weight's dim that does not divide is;
    ``on_indivisible="error"`` refuses instead, naming the node."""
    torch.manual_seed(0)
    model = VisionTransformer(Config(heads=8), pool="cls")
    proof = autoshard.check(model, {"dp": 2, "tp": 4}, example_inputs=(IMAGES,), sequence_parallel=True)
    assert proof.ok, str(proof)
    assert proof.max_output_error < 1e-5 and proof.max_gradient_error < 1e-5
    notes = _sequence_notes(proof.plan)
    assert sorted(notes) == [f"blocks.{i}.{w}.weight" for i in (0, 1) for w in ("attn.proj", "mlp.fc2")]
    assert all("sequence length (17) does not divide by 4" in n for n in notes.values())
    assert _reduce_scatters(proof.plan) == 0
    assert proof.tp_collectives == proof.plan.predicted_comm()["tp"]
    assert _sequence_notes(autoshard.Plan.from_dict(proof.plan.to_dict())) == notes  # saved with the plan
    on_two = _sequence_notes(proof.plan.for_mesh({"tp": 2}))
    assert all("sequence length (17) does not divide by 2" in n for n in on_two.values())
    with pytest.raises(ValueError, match=r"sequence length 17 of node '\w+'.* may not divide by 4"):
        autoshard.plan(model, {"tp": 4}, example_inputs=(IMAGES,), sequence_parallel=True, on_indivisible="error")


@pytest.mark.parametrize("tp, policy", [(8, None), (4, MixedPrecisionPolicy(param_dtype=torch.bfloat16))])
def test_sequence_parallel_cuts_the_patches_and_keeps_a_pooled_position_whole(tp, policy):
    """SigLIP-style attention pooling over 16 patches: the blocks' stream is cut over the sequence,
    the pooled position (length 1) after it is kept whole; proven in fp32 and bf16."""
    torch.manual_seed(0)
    model = VisionTransformer(Config(heads=8), pool="map")
    images = torch.randn(3, 3, 16, 16)  # other than the example's batch
    proof = autoshard.check(model, {"dp": 2, "tp": tp}, example_inputs=(images,), sequence_parallel=True,
                            mp_policy=policy)
    assert proof.ok, str(proof)
    if policy is None:
        assert proof.max_output_error < 1e-5 and proof.max_gradient_error < 1e-5
    assert sorted(_sequence_notes(proof.plan)) == ["attn_pool.mlp.fc2.weight", "attn_pool.proj.weight"]
    assert _reduce_scatters(proof.plan) == 4  # attention and MLP of both blocks
    assert proof.tp_collectives == proof.plan.predicted_comm()["tp"]


# --- mixed precision: tensors a forward makes from data -----------------------------------------


class DataConstantsAttention(QKVAttention):
    """Tensors made from Python data inside the forward, as T5Gemma, DeBERTa, GPT-Neo and Falcon
    write them: a scale ``torch.tensor(d ** 0.5, dtype=...)``, a mask value made on the scores'
    device, and q/k/v split by index lists (``[..., [-2], :]``)."""

    def forward(self, x):
        b, s, _ = x.shape
        qkv = torch.cat([self.wq(x), self.wk(x), self.wv(x)], dim=-1).view(b, s, -1, self.head_dim)
        heads = self.n_heads
        q, k, v = qkv[:, :, :heads], qkv[:, :, [heads, heads + 1]], qkv[:, :, [-2, -1]]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(heads // self.n_kv, dim=1) for t in (k, v))
        scores = q @ k.transpose(-1, -2) / torch.tensor(self.head_dim ** 0.5, dtype=q.dtype)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        lowest = torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype, device=scores.device)
        probs = torch.where(causal, scores, lowest).softmax(-1)
        return self.wo((probs @ v).transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("tp", [2, 4])
def test_bf16_constants_made_from_data_keep_their_values(tp):
    """Mixed precision captures the forward with the weights in bf16. It once traced a twin on
    meta, where these tensors lost their values: T5Gemma, DeBERTa, GPT-Neo, CPM-Ant, XLM, TAPAS
    and Falcon could not be proven in bf16."""
    torch.manual_seed(0)
    model = Decoder(Config(kv_heads=2), lambda c: Block(c, DataConstantsAttention))
    proof = autoshard.check(model, {"dp": 2, "tp": tp}, example_inputs=(TOKENS,), mp_policy=BF16)
    assert proof.ok, str(proof)
    assert proof.worst_factor < 2, str(proof)


# --- rounding told apart from a wrong plan ---------------------------------------------------------


class NormedMLP(nn.Module):
    """A linear with a bias ahead of a training-mode batch norm over its features: the bias's
    gradient is zero in exact arithmetic (the norm removes every channel's mean), so on one device
    and on the tp ranks alike it is pure rounding noise."""

    def __init__(self, cfg):
        super().__init__()
        self.up = nn.Linear(cfg.dim, cfg.ffn)
        self.norm = nn.BatchNorm1d(cfg.ffn, track_running_stats=False)
        self.down = nn.Linear(cfg.ffn, cfg.dim)

    def forward(self, x):
        h = self.up(x)
        return self.down(F.gelu(self.norm(h.transpose(1, 2)).transpose(1, 2)))


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tp", [2, 4])
def test_a_gradient_zero_in_exact_arithmetic_never_fails_on_noise(tp, mixed):
    torch.manual_seed(0)
    model = Decoder(Config(), lambda c: Block(c, QKVAttention, NormedMLP))
    proof = autoshard.check(model, {"dp": 2, "tp": tp}, example_inputs=(TOKENS,), mp_policy=BF16 if mixed else None)
    assert proof.ok, str(proof)
    if mixed:
        bias = next(m for m in proof.gradients if m.what == "gradient of 'layers.0.feed_forward.up.bias'")
        assert bias.sharded is not None and bias.ok, str(bias)


def test_a_cancelling_sum_of_bf16_partials_is_rounding_only():
    """Doge's ``A`` (one decay per head, replicated over tp) gets its gradient as the sum of every
    rank's partial, each rounded to bf16 on its rank; the partials cancel, so their roundings are
    several times one device's single rounding of the sum. In float64 the sharded code agrees with
    the model to float64's rounding: the plan computes the model's function.

    How far the partials cancel depends on the draw and on the CPU's bf16 kernels, so the proof's
    draws (``seed``) are taken in turn until one goes beyond ``FACTOR``: every draw is proven, and
    that one as rounding only."""
    from autoshard.proof.rounding import FACTOR
    from tests.zoo import ZooCase

    case = ZooCase("doge", "decoder", "DogeForCausalLM")  # the zoo's shrunk config, without its survey
    torch.manual_seed(0)
    model = case.build()
    args, kwargs = case.inputs()
    for seed in range(8):
        proof = autoshard.check(model, {"dp": 2, "tp": 2}, example_inputs=args, example_kwargs=kwargs,
                                mp_policy=BF16, seed=seed)
        assert proof.ok, str(proof)
        beyond = [m for m in proof.gradients if m.factor > FACTOR]
        if beyond:
            break
    assert beyond, "no draw's partial sums cancelled beyond FACTOR"
    assert all(m.rounding_only and m.wide_sharded < 1e-12 for m in beyond), [str(m) for m in beyond]
    assert "self_attn.A" in beyond[0].what


def test_a_fused_section_read_through_a_cast_keeps_its_dtype_in_bf16():
    """AXK-2's ``q_gate_proj`` gives each head its query and an output gate; the gate's section
    is read as ``gate_states.float()``. Split back out of the fused projection, the section's
    node keeps that cast: in bf16 the gate is multiplied in float32, as the model's code does
    (a view in its place left it in bf16, and the proof named that node's precision)."""
    from tests.zoo import ZooCase

    case = ZooCase("axk2", "moe", "AXK2ForCausalLM", variant=1)  # the fallback the zoo needs for it
    torch.manual_seed(0)
    model = case.build()
    args, kwargs = case.inputs()
    proof = autoshard.check(model, {"dp": 2, "tp": 4}, example_inputs=args, example_kwargs=kwargs, mp_policy=BF16)
    assert proof.ok, str(proof)
    assert proof.precision_change is None, proof.precision_change
