"""Small mixtures of experts from Hugging Face (random weights, nothing downloaded) for expert
parallelism: Qwen3-MoE (64 experts, top 8), Mixtral (8 experts, top 2) and DeepSeek-V3 (64 routed
experts, top 8 of 4 groups, one shared expert, the first layer dense). Each in transformers' default
experts implementation (on CPU its grouped GEMM is the opaque ``transformers::grouped_mm_fallback``
op over rows sorted by expert) or ``batched_mm`` (each row picks its expert's weights, ``W[ids]``).
"""

from __future__ import annotations

import torch
import transformers as hf

from tests.hf_cases import _DECODER, VOCAB


def _implementation(impl: str | None) -> dict:
    return {"experts_implementation": impl} if impl else {}


def qwen3_moe(impl: str | None = None, layers: int = 2) -> torch.nn.Module:
    config = hf.Qwen3MoeConfig(**_DECODER | {"num_hidden_layers": layers}, head_dim=16, num_experts=64,
                               num_experts_per_tok=8, moe_intermediate_size=32, decoder_sparse_step=1,
                               mlp_only_layers=[], norm_topk_prob=True)
    return hf.Qwen3MoeForCausalLM._from_config(config, **_implementation(impl))


def mixtral(impl: str | None = None, layers: int = 2) -> torch.nn.Module:
    config = hf.MixtralConfig(**_DECODER | {"num_hidden_layers": layers}, num_local_experts=8, num_experts_per_tok=2)
    return hf.MixtralForCausalLM._from_config(config, **_implementation(impl))


def deepseek_v3(impl: str | None = None, layers: int = 2) -> torch.nn.Module:
    config = hf.DeepseekV3Config(
        **{**_DECODER, "num_key_value_heads": 4, "num_hidden_layers": layers}, n_routed_experts=64,
        num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=8,
        topk_group=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        rope_interleave=False,
    )
    return hf.DeepseekV3ForCausalLM._from_config(config, **_implementation(impl))


MOE_MODELS = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "deepseek_v3": deepseek_v3}


def titan_qwen3_moe() -> torch.nn.Module:
    """torchtitan 0.3.0's own Qwen3-MoE (8 experts, top 2, its ``GroupedExperts``: ``torch._grouped_mm``
    in bf16 over the rows its local dispatcher sorts by expert, a fused ``wqkv``), built from its own
    layer helper at this file's size with SDPA attention (torchtitan imports stubbed as
    :mod:`tests.corpus` stubs them; ``make test-long`` installs torchtitan without its dependencies)."""
    from tests.corpus import install_stubs

    install_stubs("torchtitan")
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention

    dim, head_dim = 64, 16
    layers = qwen3._build_qwen3_moe_layers(
        fuse_qkv=True, n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, moe_hidden_dim=32,
        num_experts=8, top_k=2, attn_backend="flex", rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1e6),
        moe_comm_backend="standard")
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = qwen3.Qwen3Model.Config(
        vocab_size=VOCAB, dim=dim, norm=qwen3._qwen3_norm(dim), layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=qwen3._LINEAR_INIT))
    model = config.build()
    with torch.no_grad():
        model.init_weights()
    return model


def tokens(batch: int = 8, seq: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=gen), torch.randint(0, VOCAB, (batch, seq), generator=gen)
