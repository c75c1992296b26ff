"""Trace a stack of identical blocks once: the graph, plan and sharded code equal full tracing.

Single process (a fake 4-rank group for sharding). The example Llama and
Hugging Face Llama and GPT-2 with more than two blocks are captured both ways
and must give the same code; sharded on 2x2 they must give the same plan and
the same code in the root and every block. Stacks that cannot be written from
two traced blocks are traced in full, and the plan says why.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import transformers as hf
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.passes.capture import capture
from examples.models import Llama, LlamaConfig, MLPStack

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def _hf_llama():
    return hf.LlamaForCausalLM(hf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                                              use_cache=False))


def _hf_gpt2():
    return hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=128, n_embd=64, n_layer=4, n_head=4, n_positions=32,
                                            use_cache=False))


def _hf_qwen3_moe():
    return hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        use_cache=False))


STACKS = {
    "llama_4": (lambda: Llama(LlamaConfig(vocab_size=128, num_layers=4)), IDS),
    "mlp_stack_4": (lambda: MLPStack(num_blocks=4), torch.randn(2, 5, 32)),
    "hf_llama_5": (_hf_llama, IDS),
    "hf_gpt2_4": (_hf_gpt2, IDS),
    "hf_qwen3_moe_4": (_hf_qwen3_moe, IDS),
}


@pytest.mark.parametrize("name", STACKS)
def test_a_stack_traced_once_is_the_graph_traced_in_full(name):
    build, inputs = STACKS[name]
    torch.manual_seed(0)
    model = build()
    once, full = capture(model, (inputs,)), capture(model, (inputs,), trace_blocks_once=False)
    assert once.trace_note == ""
    assert once.gm.code == full.gm.code
    assert once.block_fqns == full.block_fqns and len(once.block_fqns) >= 3


@pytest.mark.parametrize("name", ["llama_4", "hf_llama_5", "hf_gpt2_4"])
def test_the_sharded_module_is_what_full_tracing_gives(fake_world, name):
    build, inputs = STACKS[name]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = build()
    once = autoshard.autoshard(model, mesh, example_inputs=(inputs,))
    full = autoshard.autoshard(model, mesh, example_inputs=(inputs,), trace_blocks_once=False)
    assert once.autoshard_plan == full.autoshard_plan
    assert str(once.autoshard_plan) == str(full.autoshard_plan)
    assert once.code == full.code
    for unit in once.autoshard_plan.units[1:]:
        assert once.get_submodule(unit).code == full.get_submodule(unit).code, unit


class _Halving(nn.Module):
    """Per-block work in the forward, outside the blocks: every block's output is halved."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) * 0.5
        return x


def _sliding_qwen2():
    return hf.Qwen2ForCausalLM(hf.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False, use_sliding_window=True, sliding_window=8,
        layer_types=["full_attention", "sliding_attention", "full_attention", "full_attention"]))


@pytest.mark.parametrize("build, inputs, why", [
    (_Halving, torch.randn(2, 16), "the forward runs 'mul' between the blocks"),
    (_sliding_qwen2, IDS, "attribute 'self_attn.layer_type' is 'full_attention', not 'sliding_attention'"),
])
def test_what_cannot_be_written_from_two_blocks_is_traced_in_full_and_said(build, inputs, why):
    torch.manual_seed(0)
    model = build()
    once = capture(model, (inputs,))
    assert why in once.trace_note
    assert once.gm.code == capture(model, (inputs,), trace_blocks_once=False).gm.code
    plan = autoshard.plan(model, {"dp": 2, "tp": 2}, example_inputs=(inputs,))
    assert f"capture: every block traced (not once for all): {once.trace_note}" in str(plan)


def test_a_deep_meta_model_plans_alike_both_ways():
    """Llama-3 8B shapes on meta, 6 blocks, {"dp": 128, "tp": 8}: the same plan either way."""
    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab_size=128256, dim=4096, num_layers=6, num_heads=32, num_kv_heads=8,
                                  ffn_hidden=14336, max_seq_len=64))
    tokens = torch.zeros(1, 64, dtype=torch.long)
    once = autoshard.plan(model, {"dp": 128, "tp": 8}, example_inputs=(tokens,))
    full = autoshard.plan(model, {"dp": 128, "tp": 8}, example_inputs=(tokens,), trace_blocks_once=False)
    assert once == full and str(once) == str(full)
    assert once.predicted_comm() == full.predicted_comm()
