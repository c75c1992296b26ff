"""Small Hugging Face models (random weights, nothing downloaded) and their inputs.

Every config is tiny (2 layers, hidden 64, 4 heads) with dropout off, so a
single-device run is the exact reference. Decoder-only families use
``use_cache=False``; :func:`llama_with_cache` and :func:`bart_with_cache` keep
transformers' default (on), as a model loads from a hub config.
"""

from __future__ import annotations

import dataclasses

import torch
import transformers as hf

VOCAB = 128
_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    use_cache=False,
    tie_word_embeddings=False,
)


@dataclasses.dataclass(frozen=True)
class HFCase:
    name: str
    build: object  # () -> nn.Module
    uses_mask: bool = False  # feeds an attention_mask with padding

    def inputs(self, batch: int = 4, seq: int = 16, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
        kwargs = {}
        if self.uses_mask:
            mask = torch.ones(batch, seq, dtype=torch.long)
            mask[::2, seq - 3 :] = 0  # right padding on every other sequence
            kwargs["attention_mask"] = mask
        return ids, kwargs


def _llama():
    return hf.LlamaForCausalLM(hf.LlamaConfig(**_DECODER))


def _llama_tied():
    """Input embedding and LM head are one parameter."""
    return hf.LlamaForCausalLM(hf.LlamaConfig(**{**_DECODER, "tie_word_embeddings": True}))


def _mistral():
    return hf.MistralForCausalLM(hf.MistralConfig(**_DECODER))


def _qwen2():
    return hf.Qwen2ForCausalLM(hf.Qwen2Config(**_DECODER))


def _qwen3():
    return hf.Qwen3ForCausalLM(hf.Qwen3Config(**_DECODER, head_dim=16))


def _qwen3_moe():
    """Every layer a mixture of 4 experts, top 2, stored as 3-D ``gate_up_proj`` / ``down_proj``.

    ``experts_implementation="batched_mm"`` gathers each (token, choice)'s expert weights and
    runs one ``bmm`` (export-friendly; the default on CPU is an opaque ``grouped_mm`` custom op).
    """
    config = hf.Qwen3MoeConfig(
        **_DECODER, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    )
    return hf.Qwen3MoeForCausalLM._from_config(config, experts_implementation="batched_mm")


def _phi3():
    """Fused q|k|v (GQA: unequal sections, read by slices) and gate|up (chunk)."""
    return hf.Phi3ForCausalLM(hf.Phi3Config(**_DECODER, pad_token_id=0))


def _gpt2(vocab: int = VOCAB):
    """Conv1D weights stored [in, out], a fused q|k|v projection, tied embeddings."""
    config = hf.GPT2Config(
        vocab_size=vocab,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return hf.GPT2LMHeadModel(config)


def _bert():
    config = hf.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return hf.BertModel(config)


def llama_with_cache() -> hf.LlamaForCausalLM:
    """The llama case with ``use_cache`` left at transformers' default (on): its forward
    returns a ``DynamicCache`` next to the logits."""
    config = hf.LlamaConfig(**{k: v for k, v in _DECODER.items() if k != "use_cache"})
    assert config.use_cache
    return hf.LlamaForCausalLM(config)


def bart_with_cache() -> hf.BartForConditionalGeneration:
    """An encoder-decoder with ``use_cache`` on (its default): the forward returns an
    ``EncoderDecoderCache`` between the logits and the encoder's last hidden state."""
    config = hf.BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )
    assert config.use_cache
    return hf.BartForConditionalGeneration(config)


def qwen2_4_blocks() -> hf.Qwen2ForCausalLM:
    """The qwen2 case with 4 blocks: enough for two pipeline stages on each of two ranks."""
    return hf.Qwen2ForCausalLM(hf.Qwen2Config(**{**_DECODER, "num_hidden_layers": 4}))


def small_llama_4_blocks() -> hf.LlamaForCausalLM:
    """The llama case with 4 blocks (2 kv heads of 4): two pipeline stages of two blocks each."""
    return hf.LlamaForCausalLM(hf.LlamaConfig(**{**_DECODER, "num_hidden_layers": 4}))


def llama_4_blocks() -> hf.LlamaForCausalLM:
    """A 4-block Llama at a Llama-2 vocabulary (32000), hidden 256, 8 heads of which 4 are kv
    heads: the model ``autoshard.testing.check`` is measured on (``benchmarks/bench_check.py``)."""
    torch.manual_seed(0)
    config = hf.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                            use_cache=False, tie_word_embeddings=False)
    return hf.LlamaForCausalLM(config)


def llama_4_blocks_tokens(batch: int = 1, seq: int = 128) -> torch.Tensor:
    return torch.randint(0, 32000, (batch, seq), generator=torch.Generator().manual_seed(0))


CASES = {
    case.name: case
    for case in (
        HFCase("llama", _llama),
        HFCase("llama_tied", _llama_tied),
        HFCase("mistral", _mistral),
        HFCase("qwen2", _qwen2),
        HFCase("qwen3", _qwen3),
        HFCase("qwen3_moe", _qwen3_moe),
        HFCase("phi3", _phi3),
        HFCase("gpt2", _gpt2),
        HFCase("bert", _bert, uses_mask=True),
    )
}


def main_output(output) -> torch.Tensor:
    """Logits of a causal LM, the last hidden state of an encoder."""
    return output.logits if hasattr(output, "logits") else output.last_hidden_state
