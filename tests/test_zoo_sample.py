"""A sample of the zoo (``tests/zoo.py``, transformers' own model classes shrunk generically),
each captured once and proven in one process on 2x4 and tp=8.

``make zoo`` proves every family on five meshes; this sample keeps ``make test`` honest on
families written by others: decoders with GQA, tied and scaled embeddings, ALiBi, parallel
blocks, fused projections, encoders with padding masks, encoder-decoders, vision transformers
and mixtures of experts with transformers' default experts implementation. Each must be proven
(outputs and every gradient against the unsharded graph, fresh inputs), its simulated tp
collectives must equal the plan's prediction, and on 2x4 its blocks must cost alike (but an
encoder-decoder's, whose decoder blocks also attend to the encoder).
"""

from __future__ import annotations

import pytest
import torch

from autoshard.core.options import DEFAULT_OPTIONS
from autoshard.driver import planning
from tests.plan_invariants import assert_breaks_complete
from tests.zoo import ZooCase

SAMPLE = [
    ZooCase("llama", "decoder", "LlamaForCausalLM"),
    ZooCase("mistral", "decoder", "MistralForCausalLM"),
    ZooCase("gemma2", "decoder", "Gemma2ForCausalLM"),
    ZooCase("qwen3", "decoder", "Qwen3ForCausalLM"),
    ZooCase("olmo2", "decoder", "Olmo2ForCausalLM"),
    ZooCase("phi3", "decoder", "Phi3ForCausalLM"),
    ZooCase("bloom", "decoder", "BloomForCausalLM"),
    ZooCase("gpt_neox", "decoder", "GPTNeoXForCausalLM"),
    ZooCase("falcon", "decoder", "FalconForCausalLM"),
    ZooCase("gpt2", "decoder", "GPT2LMHeadModel"),
    ZooCase("bert", "encoder", "BertModel"),
    ZooCase("roberta", "encoder", "RobertaModel"),
    ZooCase("t5", "encoder-decoder", "T5ForConditionalGeneration"),
    ZooCase("bart", "encoder-decoder", "BartForConditionalGeneration"),
    ZooCase("vit", "vision", "ViTForImageClassification"),
    ZooCase("mixtral", "moe", "MixtralForCausalLM"),
    ZooCase("qwen3_moe", "moe", "Qwen3MoeForCausalLM"),
]
MESHES = {"2x4": {"dp": 2, "tp": 4}, "tp8": {"tp": 8}}


@pytest.mark.parametrize("case", SAMPLE, ids=lambda c: c.family)
def test_zoo_family_is_proven(case):
    torch.manual_seed(0)
    model = case.build()
    args, kwargs = case.inputs()
    captured = None
    for name, sizes in MESHES.items():
        axes = planning.mesh_axes(sizes)
        if captured is None:
            captured = planning.capture_for(model, args, kwargs, DEFAULT_OPTIONS, axes)
        proof = planning.prove_on(model, axes, args, kwargs, DEFAULT_OPTIONS, captured=captured)
        assert proof.ok, f"{case.family} on {name}: {proof}"
        assert proof.tp_collectives == proof.plan.predicted_comm().get("tp", {}), (case.family, name)
        assert_breaks_complete(proof.plan)
        if name == "2x4" and case.kind != "encoder-decoder":  # whose encoder and decoder blocks differ
            blocks = [u for u in proof.plan.units if u]
            per_block = {proof.plan.num_tp_collectives(b) for b in blocks}
            assert len(per_block) == 1, (case.family, per_block)
