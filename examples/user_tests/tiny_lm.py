"""The model of this example project: a small decoder, written the way a team's own model code is.

RMSNorm, rotary positions, grouped-query attention (2 key/value heads for 8
query heads, so tp=4 and tp=8 cut fewer kv heads than ranks), a SwiGLU MLP and a
language-model head tied to the token embedding.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int = 512
    hidden: int = 128
    layers: int = 2
    heads: int = 8
    kv_heads: int = 2
    mlp_hidden: int = 256
    max_positions: int = 64
    mlp_extra_linear: bool = False  # a deliberate model change: see README.md


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.max_positions = max_positions

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(seq_len, device=self.inv_freq.device).float()
        freqs = torch.outer(positions, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.hidden // cfg.heads
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_hidden, cfg.hidden, bias=False)
        self.extra_proj = nn.Linear(cfg.mlp_hidden, cfg.mlp_hidden, bias=False) if cfg.mlp_extra_linear else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        if self.extra_proj is not None:
            h = h + self.extra_proj(h)
        return self.down_proj(h)


class Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.rotary = RotaryEmbedding(cfg.hidden // cfg.heads, cfg.max_positions)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(tokens.shape[1])
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


def build_model(cfg: TinyLMConfig | None = None) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(cfg or TinyLMConfig())


def example_tokens(batch: int = 2, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, TinyLMConfig.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
