"""Small example models autoshard is tested and demonstrated on.

* :class:`Llama`: a Llama-style decoder (RMSNorm, rotary embeddings, grouped-
  query attention, SwiGLU feed-forward), written like torchtitan's.
* :class:`MLPStack`: residual MLP blocks with LayerNorm and biased linears.
* :class:`RawLinearNet`: linears written on raw parameters with ``F.linear``,
  ``x @ W``, ``torch.matmul(x, W.t())`` and ``torch.addmm``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    ffn_hidden: int = 128
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` is ``[batch, seq, heads, head_dim]``; cos/sin are ``[seq, head_dim]``."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.dim // cfg.num_heads
        self.wq = nn.Linear(cfg.dim, cfg.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.num_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.num_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.num_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig = LlamaConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.dim // cfg.num_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(F.gelu(self.fc1(self.norm(x)))))


class MLPStack(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 64, num_blocks: int = 3, out: int = 16, dropout: float = 0.0):
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(dim, hidden, dropout) for _ in range(num_blocks))
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class RawLinearNet(nn.Module):
    """Linears on raw parameters, in every spelling autoshard recognizes.

    ``w_in`` is stored ``[out, in]`` and used with ``F.linear``; ``w_mid`` is
    stored ``[in, out]`` and used as ``x @ w_mid`` (rowwise: autoshard stores
    it transposed); ``w_gate`` is ``[out, in]`` used as ``x @ w_gate.t()``;
    ``w_out`` is ``[in, out]`` in an ``addmm``.
    """

    def __init__(self, dim: int = 32, hidden: int = 64, out: int = 16):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(hidden, dim) / dim**0.5)
        self.b_in = nn.Parameter(torch.randn(hidden) * 0.1)
        self.w_gate = nn.Parameter(torch.randn(hidden, dim) / dim**0.5)
        self.w_mid = nn.Parameter(torch.randn(hidden, dim) / hidden**0.5)
        self.b_mid = nn.Parameter(torch.randn(dim) * 0.1)
        self.w_out = nn.Parameter(torch.randn(dim, out) / dim**0.5)
        self.b_out = nn.Parameter(torch.zeros(out))
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.w_in, self.b_in)
        g = torch.matmul(x, self.w_gate.t())
        y = (torch.tanh(h) * torch.sigmoid(g)) @ self.w_mid + self.b_mid
        y = (x + y) * self.scale
        flat = y.reshape(-1, y.shape[-1])
        return torch.addmm(self.b_out, flat, self.w_out).view(*x.shape[:-1], -1)


class GatedScaleNet(nn.Module):
    """A replicated, trainable value broadcast into a sharded region.

    ``scale`` (computed from the replicated input and a parameter) multiplies
    the colwise output across its sharded hidden dim, so its gradient from
    that product is a sum over the whole hidden dim: on one tp rank, a partial
    sum that must be all-reduced before it flows back.
    """

    def __init__(self, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.gain = nn.Parameter(torch.ones(dim))
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt((x * self.gain).pow(2).mean(-1, keepdim=True) + 1e-6)
        return x + self.down(F.silu(self.up(x)) * scale)


class CumulativeMLP(nn.Module):
    """An op with no tp layout rule (a cumulative sum over the hidden dim) between
    the two linears of an MLP: the hidden activations must be gathered first."""

    def __init__(self, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.cumsum(F.gelu(self.up(x)), dim=-1) / 8.0)
