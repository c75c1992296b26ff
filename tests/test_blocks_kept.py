"""tp kept through every block of code people run: fused projections with fewer k/v heads than tp,
multi-query attention, parallel blocks summed in place, and mixture-of-experts layers as
transformers runs them by default (its grouped-matmul fallback, float32 routers, 1-output gates).

All in one process: each plan proven against the unsharded model (outputs and every gradient,
fresh inputs), no tp break, and its tp collectives per block exactly the analytic minimum, on
tp=8 and, in bf16 mixed precision on other inputs, on dp=2 x tp=4. The
pattern models (tests/pattern_models.py) are also trained on real ranks in tests/test_patterns.py.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers as hf

import autoshard
from autoshard.core.sharding import Role
from tests.hf_cases import _DECODER, VOCAB
from tests.pattern_models import DATA_DEPENDENT_ROWS, PATTERNS, block_minimum
from tests.pattern_models import VOCAB as PATTERN_VOCAB
from tests.plan_invariants import assert_breaks_complete

TOKENS = torch.randint(0, PATTERN_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
IDS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
WHOLE_SECTION_PATTERNS = ("grouped_fused_qkv", "sliced_fused_qkv", "inserted_dim_multi_query", "indexed_multi_query")


def _proven(model, mesh, example, sized: bool = True):
    """The proven plan, with no break; ``sized``: its predicted bytes are what ran (else, rows per
    expert from the data: how many collectives ran)."""
    proof = autoshard.check(model, mesh, example_inputs=(example,))
    assert proof.ok, str(proof)
    assert not proof.plan.breaks, proof.plan.breaks_line()
    assert_breaks_complete(proof.plan)
    if sized:
        assert proof.tp_collectives == proof.plan.predicted_comm()["tp"]
    else:
        assert sum(n for n, _ in proof.tp_collectives.values()) == proof.plan.num_tp_collectives()
    return proof.plan


def _blocks(plan, prefix):
    return [u for u in plan.units if u.startswith(prefix)]


@pytest.mark.parametrize("name", WHOLE_SECTION_PATTERNS + ("in_place_parallel", "diffusers_dit", "flux_single_stream",
                                                           "mamba_mixer", "low_rank_latent_attention", "gated_deltanet",
                                                           "gated_deltanet_fused", "conv_resnet",
                                                           "normed_mamba_mixer", "zero_centred_qk_norm",
                                                           "mamba2_mixer", "mup_mamba2_mixer", "mamba2_mixer_groups",
                                                           "lora_adapters", "relative_logits", "grouped_conv_block",
                                                           "projected_positions", "factorized_shared_layer",
                                                           "moe_interleaved", "convnext_layer",
                                                           "moe_concatenated_experts", "moe_shared_expert",
                                                           "moe_narrow_shared_expert", "label_conditioned_dit",
                                                           "eva_concatenated_qkv_bias", "litgpt_lora_adapters",
                                                           "grouped_concatenated_qkv_bias"))
def test_the_patterns_are_proven_on_tp8_at_their_minimum(name):
    """8 q heads on tp=8: one q head per rank, k/v (2 heads, or 1) whole on every rank."""
    model = PATTERNS[name]()
    plan = _proven(model, {"tp": 8}, TOKENS, sized=name not in DATA_DEPENDENT_ROWS)
    for block in _blocks(plan, "layers."):
        minimum = block_minimum(name, block) + (model.cfg.kv_heads % 8 != 0)
        assert plan.num_tp_collectives(block) == minimum, (block, str(plan))


BF16_PATTERNS = WHOLE_SECTION_PATTERNS + (
    "in_place_parallel", "diffusers_dit", "flux_single_stream", "mamba_mixer", "low_rank_latent_attention",
    "gated_deltanet", "gated_deltanet_fused", "einsum_attention", "conv_resnet", "moe_batched_bmm",
    "normed_mamba_mixer", "zero_centred_qk_norm", "mup_mamba2_mixer", "mamba2_mixer_groups", "lora_adapters",
    "relative_logits", "grouped_conv_block", "projected_positions", "factorized_shared_layer", "moe_interleaved",
    "convnext_layer", "moe_concatenated_experts", "moe_shared_expert", "moe_narrow_shared_expert",
    "conv_value_skip", "span_conv_attention", "label_conditioned_dit", "biased_two_norm_parallel",
    "litgpt_lora_adapters")


@pytest.mark.parametrize("name", BF16_PATTERNS)
def test_the_patterns_are_proven_in_bf16_on_other_inputs_at_their_fp32_count(name):
    """bf16 parameters (fp32 reductions) on dp=2 x tp=4, with inputs of another batch and draw than
    the fp32 tests': proven (the proof tells rounding from a bug by one device's own bf16 error)
    and the same tp collectives per block as in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = PATTERNS[name]()
    tokens = torch.randint(0, PATTERN_VOCAB, (4, 16), generator=torch.Generator().manual_seed(7))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    proof = autoshard.check(model, {"dp": 2, "tp": 4}, example_inputs=(tokens,), mp_policy=mp_policy)
    assert proof.ok, str(proof)
    assert not proof.plan.breaks, proof.plan.breaks_line()
    for block in _blocks(proof.plan, "layers."):
        minimum = block_minimum(name, block) + (model.cfg.kv_heads % 4 != 0)
        assert proof.plan.num_tp_collectives(block) == minimum, (block, str(proof.plan))


def test_routed_and_shared_experts_enter_tp_once_beside_a_router_computed_whole():
    """DeepSeek-V3's MoE: the router reads the normed input whole, the routed experts its flattened
    view (repeated per choice) and the shared expert the input as it came. The two sharded readers
    enter tp at the one value and the router keeps reading it as it is: the shared expert's
    input-gradient all-reduce serves the routed experts too, none is left at the experts' bmm."""
    plan = _proven(PATTERNS["moe_shared_expert"](), {"tp": 4}, TOKENS)
    shared = plan.params["layers.0.feed_forward.shared_experts.gate_proj.weight"]
    assert [c.subject for c in shared.collectives if c.runs and c.direction == "bwd"] == ["input grad"]
    causes = [c.cause for i, c in enumerate(plan.activations) if c.runs and plan.unit_of_activation(i) == "layers.0"]
    assert not [cause for cause in causes if "bmm" in cause], causes
    assert plan.params["layers.0.feed_forward.gate.weight"].role == Role.REPLICATE


def test_a_narrow_shared_expert_is_cut_again_with_its_gate_and_up_together():
    """Beside DeepSeek's latent attention, the narrowing linears tried whole together are the latent
    down-projections and the narrow shared expert's gate and up. Cut alone, gate or up costs more
    (the other's output is then cut for it); cut together they keep the shared expert sharded, with
    no break at the same collectives."""
    plan = _proven(PATTERNS["moe_narrow_shared_expert"](), {"tp": 4}, TOKENS)
    shared = "layers.0.feed_forward.shared_experts."
    assert [plan.params[f"{shared}{n}.weight"].role for n in ("gate_proj", "up_proj", "down_proj")] == [
        Role.COLWISE, Role.COLWISE, Role.ROWWISE]
    assert plan.params["layers.0.attention.q_a_proj.weight"].role == Role.REPLICATE


@pytest.mark.parametrize("mesh", [{"dp": 2, "tp": 2}, {"tp": 4}], ids=["2x2", "tp4"])
def test_an_output_projection_whose_cut_output_alone_is_gathered_is_computed_whole(mesh):
    """ConvBERT's mixed attention is computed whole (its span-conv kernels mix every head). Its
    output projection, colwise on that replicated context, had its cut output gathered before the
    residual: a break paying an all-gather forward and an all-reduce backward to save a share of
    one matmul. Tried after the plan settles, it is computed whole; the LM head, whose output is
    the model's, stays colwise."""
    plan = _proven(PATTERNS["span_conv_attention"](), mesh, TOKENS)
    dense = plan.params["layers.0.attention.dense.weight"]
    assert dense.role == Role.REPLICATE and "cut output alone is gathered whole" in dense.note, dense.note
    assert plan.params["output.weight"].role == Role.COLWISE
    assert [plan.num_tp_collectives(b) for b in _blocks(plan, "layers.")] == [2, 2]


def test_a_concatenation_of_sections_is_read_by_a_rowwise_linear_with_its_input_rows_permuted():
    """Flux's single-stream block: cat([attention heads, MLP hidden], dim=2) -> proj_out. Each rank
    holds its share of both; proj_out stores its input rows the same way, so no gather."""
    plan = _proven(PATTERNS["flux_single_stream"](), {"tp": 4}, TOKENS)
    proj_out = plan.params["layers.0.proj_out.weight"]
    assert (proj_out.role, proj_out.sections) == (Role.ROWWISE, (64, 128))
    assert plan.params["layers.0.proj_out.bias"].sections == ()


def test_a_fused_projection_keeps_its_kv_sections_whole_and_its_q_section_cut():
    """torchtitan's grouped wqkv with 2 kv heads on tp=4: q|k|v read from groups of
    [4 q heads, k, v], stored as q cut over tp, then k and v whole on every rank."""
    plan = _proven(PATTERNS["grouped_fused_qkv"](), {"tp": 4}, TOKENS)
    entry = plan.params["layers.0.attention.wqkv.weight"]
    assert (entry.sections, entry.whole_sections) == ((64, 16, 16), (1, 2))
    # the q heads of kv group 0 are columns 0..31, its k 32..39, its v 40..47, then group 1
    assert entry.section_runs == (0, 32, 48, 80, 32, 40, 80, 88, 40, 48, 88, 96)
    assert entry.stored_shape == (64, 96 + 3 * 32) and entry.duplicated == 96
    assert "[64|16*|16*]" in str(plan)
    with pytest.raises(ValueError, match=r"the \* ones held whole on each of tp=4 ranks"):
        plan.for_mesh({"tp": 2})


def test_phi3_with_fewer_kv_heads_than_tp_plans_every_block_at_five():
    model = hf.Phi3ForCausalLM(hf.Phi3Config(**_DECODER, pad_token_id=0))
    plan = _proven(model, {"tp": 4}, IDS)
    assert {plan.num_tp_collectives(b) for b in _blocks(plan, "model.layers.")} == {5}
    assert plan.params["model.layers.0.self_attn.qkv_proj.weight"].whole_sections == (1, 2)


@pytest.mark.parametrize("family", ["falcon", "gpt_bigcode"])
def test_multi_query_attention_keeps_tp_on_2x2(family):
    """One kv head: computed whole, repeated per q head and cut (Falcon: a parallel block, 2 + 1)."""
    if family == "falcon":
        config = hf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 multi_query=True, parallel_attn=True, alibi=False, use_cache=False)
        model, expected = hf.FalconForCausalLM(config), 3
    else:
        config = hf.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, multi_query=True,
                                     n_positions=64, use_cache=False)
        model, expected = hf.GPTBigCodeForCausalLM(config), 5
    plan = _proven(model, {"dp": 2, "tp": 2}, IDS)
    blocks = _blocks(plan, "transformer.h.")
    assert blocks and {plan.num_tp_collectives(b) for b in blocks} == {expected}, str(plan)


def test_mixtral_with_its_default_experts_shards_experts_and_computes_its_router_whole():
    """transformers' default experts implementation runs ``transformers::grouped_mm_fallback`` on CPU
    under export, and its router casts its weight to float32: experts cut over tp, router whole by
    choice (noted), no break."""
    config = hf.MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2)
    plan = _proven(hf.MixtralForCausalLM(config), {"dp": 2, "tp": 2}, IDS)
    experts = plan.params["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts.role == Role.SHARDED and "grouped_mm_fallback" in experts.note
    router = plan.params["model.layers.0.mlp.gate.weight"]
    assert router.role == Role.REPLICATE and "computed whole, it needs no collective" in router.note


def test_a_one_output_gate_on_the_stream_is_whole_by_choice_not_a_break():
    config = hf.Qwen2MoeConfig(**_DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=32)
    plan = _proven(hf.Qwen2MoeForCausalLM(config), {"tp": 4}, IDS)
    gate = plan.params["model.layers.0.mlp.shared_expert_gate.weight"]
    assert gate.role == Role.REPLICATE and "computed whole it needs no collective" in gate.why.computed_whole


def test_a_low_rank_pair_computes_its_down_projection_whole_and_says_why():
    """transformers' DeepSeek-V3 attention: cut, q_a_proj's latent would need its norm's statistic
    all-reduced and would turn q_b_proj rowwise, its [tokens, heads * head_dim] output all-reduced
    and the heads whole. Compared as whole plans, the down-projections are computed whole."""
    plan = _proven(PATTERNS["low_rank_latent_attention"](), {"dp": 2, "tp": 2}, TOKENS)
    entry = plan.params["layers.0.attention.q_a_proj.weight"]
    assert entry.role == Role.REPLICATE
    found = re.search(r"a narrowing linear whose cut output a wider linear reads.*tp collectives are (\d+) "
                      r"instead of (\d+)", entry.note)
    assert found and int(found[1]) < int(found[2]), entry.note
    # the kv latent's region ends at its norm once q's is whole: a narrowing linear with an idle region
    assert plan.params["layers.0.attention.kv_a_proj_with_mqa.weight"].role == Role.REPLICATE
    for name in ("q_b_proj", "kv_b_proj"):
        assert plan.params[f"layers.0.attention.{name}.weight"].role == Role.COLWISE


def test_parameters_read_through_their_own_chain_join_the_block_bucket():
    """Gemma's ``1 + w`` q/k norm weights and xIELU's ``softplus(alpha)`` scalars: the replicated
    chain from each parameter is the same on every rank, so their partial gradients are summed at
    the parameters, all four in one all-reduce for the block."""
    plan = _proven(PATTERNS["zero_centred_qk_norm"](), {"dp": 2, "tp": 2}, TOKENS)
    bucket = [c for entry in plan.params.values() for c in entry.collectives
              if c.counted and c.subject == "grad" and c.shared_by and c.shared_by[0].startswith("layers.0.")]
    assert len(bucket) == 1
    assert set(bucket[0].shared_by) == {f"layers.0.{n}" for n in (
        "attention.q_norm.weight", "attention.k_norm.weight", "feed_forward.alpha_p", "feed_forward.alpha_n")}
    assert not [c for c in plan.activations if c.subject.startswith("grad of")]


@pytest.mark.parametrize("name", ["mamba_mixer", "normed_mamba_mixer"])
def test_the_pieces_of_a_split_enter_tp_together_at_the_split(name):
    """Mamba's step size, B and C, read whole by every rank's channels (dt_proj colwise, the scan),
    each through views or a weightless norm: one all-reduce of x_proj's output gradient, at the
    split, instead of one per piece."""
    plan = _proven(PATTERNS[name](), {"dp": 2, "tp": 2}, TOKENS)
    entered = [c for i, c in enumerate(plan.activations)
               if c.subject.startswith("grad of") and plan.unit_of_activation(i) == "layers.0"]
    assert len(entered) == 1 and "split" in entered[0].cause, entered
    assert not [c for c in plan.params["layers.0.mixer.dt_proj.weight"].collectives if c.runs]


def test_lora_adapters_keep_tp_and_every_rank_buckets_their_weights_in_graph_order():
    """PEFT-style LoRA on q, v, a fused gate|up (colwise bases) and down (a rowwise base). On a
    colwise base lora_A is computed whole (narrow) and lora_B is colwise, in its base's sections;
    the adapters' input enters tp with the bases', so the lora_A weights' gradients are partial.
    On the rowwise base lora_A is rowwise and lora_B computed whole on its partial output, reduced
    with the base's: its weight's gradient is partial. All are summed in the block's bucket. Every
    rank plans on its own: the bucket lays the gradients out in graph order, never a set's."""
    orders = set()
    for _ in range(3):
        plan = _proven(PATTERNS["lora_adapters"](), {"dp": 2, "tp": 2}, TOKENS)
        assert plan.params["layers.0.feed_forward.gate_up_proj.lora_B.weight"].sections == (128, 128)
        down = "layers.0.feed_forward.down_proj"
        assert (plan.params[f"{down}.lora_A.weight"].role, plan.params[f"{down}.lora_B.weight"].role) == (
            Role.ROWWISE, Role.REPLICATE)
        assert "reduced with the partial sum it is added to" in plan.params[f"{down}.lora_B.weight"].note
        bucket = [c for entry in plan.params.values() for c in entry.collectives
                  if c.counted and c.subject == "grad" and c.shared_by and c.shared_by[0].startswith("layers.0.")]
        assert len(bucket) == 1
        orders.add(bucket[0].shared_by)
    assert orders == {(*(f"layers.0.{m}.lora_A.weight" for m in (
        "attention.wq", "attention.wv", "feed_forward.gate_up_proj")), f"{down}.lora_B.weight")}


class _FilledBuffer(torch.nn.Module):
    """A buffer made with ``new_empty`` and written slice by slice (``tiles`` of the last dim)."""

    def __init__(self, tiles):
        super().__init__()
        self.tiles = tiles
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        out = y.new_empty(*y.shape[:-1], 10)
        for start, end in self.tiles:
            # a piece of the width it fills, or one column broadcast over it, in float64 (copy_ casts)
            out[..., start:end].copy_(y[..., : end - start] if end - start > 2 else y[..., :1].double())
        return out * 2


@pytest.mark.parametrize("tiles, rewritten", [(((0, 8), (8, 10)), True), (((8, 10), (0, 8)), True),
                                               (((0, 8),), False), (((0, 6), (5, 10)), False)],
                         ids=["in order", "out of order", "in part", "overlapping"])
def test_a_buffer_filled_slice_by_slice_is_planned_as_a_concatenation(tiles, rewritten):
    """Only a buffer whose every element is written before it is read becomes a cat (of the written
    values, broadcast to their slices); a buffer written in part or twice keeps its writes."""
    from autoshard.passes.capture import capture
    from autoshard.passes.normalize import _filled_buffers_as_cat

    model, x = _FilledBuffer(tiles), torch.randn(2, 3, 8)
    captured = capture(model, (x,))
    _filled_buffers_as_cat(captured.gm.graph)
    captured.gm.recompile()
    captured.gm.graph.lint()  # every node after its inputs
    ops = {n.target for n in captured.gm.graph.nodes}
    assert (torch.ops.aten.cat.default in ops) == rewritten
    assert (torch.ops.aten.copy_.default in ops) != rewritten
    if rewritten:
        torch.testing.assert_close(captured.gm(x)[0] if isinstance(captured.gm(x), tuple) else captured.gm(x),
                                   model(x))


def test_a_depthwise_conv_on_the_replicated_stream_is_computed_whole_by_choice():
    """ConvNeXt's 7x7 depthwise conv reads the whole stream: per-channel work, kept whole with a note
    saying why, not a break; the pointwise MLP after it is cut."""
    plan = _proven(PATTERNS["convnext_layer"](), {"tp": 4}, TOKENS)
    dwconv, pwconv1 = plan.params["layers.0.dwconv.weight"], plan.params["layers.0.pwconv1.weight"]
    assert dwconv.sharded_dim("tp") is None and "depthwise convolution" in dwconv.note
    assert pwconv1.sharded_dim("tp") is not None
