"""Frozen weights trained on real gloo ranks: LoRA with peft, and a model with a frozen embedding.

On 2x2 (dp x tp) and on tp=4, with ``check="auto"`` (the one-process proof runs first and compares
only the gradients the model computes), against one device: the loss and every trained weight
after 3 AdamW steps, and every trained weight after 3 SGD steps, within 1e-5; every frozen weight
unchanged with no ``.grad``; ``clip_grad_norm_(sharded.parameters(), ...)`` the single-device norm. One 4-process gloo
group runs every check of this file.
"""

from __future__ import annotations

import torch

import autoshard
from tests.distributed import distributed_tests
from tests.parity import dp_slice, hf_loss, lm_loss, train_both
from tests.pattern_models import VOCAB, FrozenEmbeddingDecoder

HF_VOCAB = 256


def _peft_llama():
    import transformers as hf
    from peft import LoraConfig, get_peft_model

    config = hf.LlamaConfig(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    model = get_peft_model(hf.LlamaForCausalLM(config), lora)
    for name, param in model.named_parameters():  # adapters start at zero: give them values to train from
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return model


def _built(build):
    torch.manual_seed(0)
    return build()


def _check_frozen_training(build, mesh, vocab, loss_fn):
    model = _built(build)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert frozen and trained
    tokens = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(1))
    original = model.state_dict()
    # AdamW as transformers' Trainer runs it by default (lr 5e-5, eps 1e-8): its normalized step
    # moves an entry by about lr whatever its gradient's size, so a gradient's last-bit rounding
    # shows in a weight in proportion to lr; the Trainer's rate keeps that far below 1e-5
    adamw = train_both(model, mesh, tokens, targets, loss_fn, optimizer="adamw", lr=5e-5, adam_eps=1e-8, steps=3,
                       shard_kwargs={"check": "auto"})
    for step, (got, want) in enumerate(adamw.losses):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)
    for name in trained:
        assert adamw.param_errors[name] <= 1e-5, (name, adamw.param_errors[name])
    run = train_both(_built(build), mesh, tokens, targets, loss_fn, optimizer="sgd", steps=3,
                     shard_kwargs={"check": "auto"})
    sharded = dict(run.sharded.named_parameters())
    assert {n for n, p in sharded.items() if not p.requires_grad} == frozen
    for name in trained:
        assert run.param_errors[name] <= 1e-5, (name, run.param_errors[name])
    for name in frozen:
        assert sharded[name].grad is None, name
        assert adamw.param_errors[name] == 0.0 and run.param_errors[name] == 0.0, name  # the model's layout
        assert torch.equal(run.reference.state_dict()[name], original[name]), name
    # clipping with torch's arguments: the single-device norm of the trained gradients
    run.sharded.zero_grad()
    run.reference.zero_grad()
    loss_fn(run.sharded(dp_slice(tokens, mesh)), dp_slice(targets, mesh)).backward()
    loss_fn(run.reference(tokens), targets).backward()  # FSDP averages the dp ranks' gradients: the batch's
    expected = torch.nn.utils.clip_grad_norm_(run.reference.parameters(), 1e9)
    got = autoshard.clip_grad_norm_(run.sharded.parameters(), 1e9)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


def check_peft_lora_2x2(ctx):
    _check_frozen_training(_peft_llama, ctx.mesh_2d, HF_VOCAB, hf_loss)


def check_peft_lora_tp4(ctx):
    _check_frozen_training(_peft_llama, ctx.mesh_tp, HF_VOCAB, hf_loss)


def check_frozen_embedding_2x2(ctx):
    _check_frozen_training(FrozenEmbeddingDecoder, ctx.mesh_2d, VOCAB, lm_loss)


def check_frozen_embedding_tp4(ctx):
    _check_frozen_training(FrozenEmbeddingDecoder, ctx.mesh_tp, VOCAB, lm_loss)


outcomes, test_frozen_training = distributed_tests(
    [check_peft_lora_2x2, check_peft_lora_tp4, check_frozen_embedding_2x2, check_frozen_embedding_tp4])
