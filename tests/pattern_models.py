"""Small models written the way public model code writes each tp-sensitive pattern.

Each is a 2-block transformer (dim 64, 4 heads, vocab 128) whose blocks differ from
:mod:`examples.models` in one pattern only, spelled as the code it imitates:

* :class:`InterleavedRope`: GPT-J / Meta-Llama style "rotate every two" rotary
  embeddings with strided slices and ``torch.stack(..., -1).flatten(-2)``.
* :class:`RepeatInterleaveGQA`: grouped-query attention with
  ``k.repeat_interleave(n_rep, dim=1)`` and manual ``torch.matmul`` attention.
* :class:`AlibiBias`: an additive ALiBi bias (a buffer of slopes) on the scores,
  and a relative-position bias table passed as ``attn_mask`` to SDPA.
* :class:`BaddbmmAttention`: attention on ``[b*h, s, d]`` with ``baddbmm`` / ``bmm``.
* :class:`WideQKNorm`: OLMo-2 style q/k RMSNorm over the full projected width
  ``[b, s, h*d]`` before the view to heads.
* :class:`ParallelBlock`: GPT-J / PaLM parallel residual
  ``x + attn(ln(x)) + mlp(ln(x))``.
* :class:`CustomFunctionMLP`: an activation written as a ``torch.autograd.Function``.
* :class:`ExpertsMoE`: mixture of experts with 3-D expert weights
  (``[num_experts, out, in]``) used by indexing and ``bmm``, and by a loop over experts.
* :class:`SharedExpertMoE`: DeepSeek-V3's routed experts plus a shared expert on one input.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 128


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = VOCAB
    dim: int = 64
    heads: int = 4
    kv_heads: int = 4
    ffn: int = 128
    layers: int = 2
    max_seq: int = 64

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


class SwiGLU(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class QKVAttention(nn.Module):
    """Projections shared by the attention variants; ``attend`` is the variant."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, *extra):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_kv, self.head_dim)
        v = self.wv(x).view(b, s, self.n_kv, self.head_dim)
        out = self.attend(q, k, v, *extra)  # [b, s, h, d]
        return self.wo(out.reshape(b, s, -1))

    def attend(self, q, k, v, *extra):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class Block(nn.Module):
    def __init__(self, cfg: Config, attention: type[QKVAttention], mlp: type[nn.Module] = SwiGLU):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim)
        self.attention = attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        self.feed_forward = mlp(cfg)

    def forward(self, x, *extra):
        h = x + self.attention(self.attention_norm(x), *extra)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """Embedding, blocks, final norm, LM head; ``extra()`` gives what blocks also read."""

    def __init__(self, cfg: Config, block):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def extra(self, tokens):
        return ()

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        extra = self.extra(tokens)
        for layer in self.layers:
            h = layer(h, *extra)
        return self.output(self.norm(h))


# --- interleaved rotary -------------------------------------------------------------


def rotate_every_two(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class InterleavedRopeAttention(QKVAttention):
    def attend(self, q, k, v, sin, cos):
        q = q * cos + rotate_every_two(q) * sin
        k = k * cos + rotate_every_two(k) * sin
        return super().attend(q, k, v)


class InterleavedRope(Decoder):
    def __init__(self, cfg: Config = Config()):
        super().__init__(cfg, lambda c: Block(c, InterleavedRopeAttention))
        inv_freq = 1.0 / 10000 ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.max_seq).float(), inv_freq)
        self.register_buffer("sin", angles.sin().repeat_interleave(2, dim=-1), persistent=False)
        self.register_buffer("cos", angles.cos().repeat_interleave(2, dim=-1), persistent=False)

    def extra(self, tokens):
        s = tokens.shape[1]
        return self.sin[None, :s, None, :], self.cos[None, :s, None, :]


# --- GQA by repeat_interleave, manual matmul attention --------------------------------


class RepeatInterleaveAttention(QKVAttention):
    def attend(self, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        n_rep = self.n_heads // self.n_kv
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        s = q.shape[2]
        causal = torch.full((s, s), float("-inf"), device=q.device).triu(1)
        probs = F.softmax(scores + causal, dim=-1)
        return torch.matmul(probs, v).transpose(1, 2)


class RepeatInterleaveGQA(Decoder):
    def __init__(self, cfg: Config = Config(kv_heads=2)):
        super().__init__(cfg, lambda c: Block(c, RepeatInterleaveAttention))


# --- additive attention biases ---------------------------------------------------------


def alibi_slopes(heads: int) -> torch.Tensor:
    start = 2 ** (-8 / heads)
    return torch.tensor([start ** (i + 1) for i in range(heads)])


class AlibiAttention(QKVAttention):
    def attend(self, q, k, v, alibi):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) * self.head_dim**-0.5
        scores = scores + alibi  # [1, h, s, s] from a replicated table
        probs = scores.softmax(dim=-1)
        return (probs @ v).transpose(1, 2)


class RelPosSDPAAttention(QKVAttention):
    def attend(self, q, k, v, alibi):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=alibi).transpose(1, 2)


class AlibiBias(Decoder):
    """ALiBi on manual attention; ``sdpa=True`` passes the bias as SDPA's ``attn_mask``."""

    def __init__(self, cfg: Config = Config(), sdpa: bool = False):
        attention = RelPosSDPAAttention if sdpa else AlibiAttention
        super().__init__(cfg, lambda c: Block(c, attention))
        self.register_buffer("slopes", alibi_slopes(cfg.heads), persistent=False)

    def extra(self, tokens):
        s = tokens.shape[1]
        pos = torch.arange(s, device=tokens.device)
        distance = (pos[None, :] - pos[:, None]).float()
        causal = torch.full((s, s), float("-inf"), device=tokens.device).triu(1)
        return ((self.slopes[:, None, None] * distance + causal)[None],)


# --- baddbmm attention -------------------------------------------------------------------


class BaddbmmAttention(QKVAttention):
    def attend(self, q, k, v):
        b, s, h, d = q.shape
        q, k, v = (t.transpose(1, 2).reshape(b * h, s, d) for t in (q, k, v))
        causal = torch.full((s, s), float("-inf"), device=q.device).triu(1).expand(b * h, s, s)
        scores = torch.baddbmm(causal, q, k.transpose(1, 2), beta=1.0, alpha=d**-0.5)
        out = torch.bmm(scores.softmax(-1), v)
        return out.view(b, h, s, d).transpose(1, 2)


class BaddbmmModel(Decoder):
    def __init__(self, cfg: Config = Config()):
        super().__init__(cfg, lambda c: Block(c, BaddbmmAttention))


class EinsumAttention(QKVAttention):
    """Attention in ``torch.einsum`` (PEGASUS-X, ProphetNet, Mamba-2's chunked scan): scores over
    ``b, h, q, k``, a position bias from a per-position table shared by every head, and the
    weighted values, the heads kept as a letter of every product."""

    def attend(self, q, k, v):
        b, s, h, d = q.shape
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * d**-0.5
        positions = torch.arange(s, dtype=q.dtype)
        bias = torch.einsum("q,k->qk", positions, -positions.new_ones(s)).tril() * 0.01
        causal = torch.full((s, s), float("-inf"), dtype=q.dtype).triu(1)
        return torch.einsum("bhqk,bkhd->bqhd", (scores + bias + causal).softmax(-1), v)


class EinsumModel(Decoder):
    def __init__(self, cfg: Config = Config()):
        super().__init__(cfg, lambda c: Block(c, EinsumAttention))


# --- q/k norm over the full projected width (OLMo-2) ---------------------------------------


class WideQKNormAttention(QKVAttention):
    """OLMo-2's q/k RMSNorm over the full projected width; ``norm=nn.LayerNorm`` is ESMC's and
    Persimmon-style centred one (its mean over the cut width reduced before ``x - mean``)."""

    def __init__(self, cfg: Config, norm: type[nn.Module] = nn.RMSNorm):
        super().__init__(cfg)
        self.q_norm = norm(cfg.heads * cfg.head_dim)
        self.k_norm = norm(cfg.kv_heads * cfg.head_dim)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_norm(self.wq(x)).view(b, s, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).view(b, s, self.n_kv, self.head_dim)
        v = self.wv(x).view(b, s, self.n_kv, self.head_dim)
        return self.wo(self.attend(q, k, v).reshape(b, s, -1))


class WideQKNorm(Decoder):
    def __init__(self, cfg: Config = Config(), norm: type[nn.Module] = nn.RMSNorm):
        super().__init__(cfg, lambda c: Block(c, lambda c2: WideQKNormAttention(c2, norm)))


# --- parallel block ---------------------------------------------------------------------------


class ParallelResidualBlock(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.dim)
        self.attn = QKVAttention(cfg)
        self.mlp = SwiGLU(cfg)

    def forward(self, x):
        h = self.ln(x)
        return x + self.attn(h) + self.mlp(h)


class ParallelBlock(Decoder):
    def __init__(self, cfg: Config = Config()):
        super().__init__(cfg, ParallelResidualBlock)


# --- custom autograd.Function --------------------------------------------------------------


class SiLUFunction(torch.autograd.Function):
    """SiLU with a hand-written backward, as fused-activation code writes it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * s * (1 + x * (1 - s))


class WrongGradSiLU(torch.autograd.Function):
    """A straight-through estimator: its backward is not the derivative of its forward."""

    @staticmethod
    def forward(ctx, x):
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class FunctionSwiGLU(SwiGLU):
    function = SiLUFunction

    def forward(self, x):
        return self.w2(self.function.apply(self.w1(x)) * self.w3(x))


class StraightThroughSwiGLU(FunctionSwiGLU):
    function = WrongGradSiLU


class CustomFunctionMLP(Decoder):
    def __init__(self, cfg: Config = Config(), straight_through: bool = False):
        mlp = StraightThroughSwiGLU if straight_through else FunctionSwiGLU
        super().__init__(cfg, lambda c: Block(c, QKVAttention, mlp))


# --- mixture of experts with 3-D expert weights ----------------------------------------------


class Experts(nn.Module):
    """``gate_up_proj [E, 2*ffn, dim]`` and ``down_proj [E, dim, ffn]``, as Hugging Face stores them."""

    def __init__(self, cfg: Config, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * cfg.ffn, cfg.dim) / cfg.dim**0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, cfg.dim, cfg.ffn) / cfg.ffn**0.5)


class IndexedExperts(Experts):
    """Each (token, choice) pair gathers its expert's weights and runs one ``bmm``."""

    def forward(self, x, top_idx, top_w):
        tokens, k = top_idx.shape
        xs = x.repeat_interleave(k, dim=0)  # [tokens*k, dim]
        ids = top_idx.reshape(-1)
        h = torch.bmm(self.gate_up_proj[ids], xs.unsqueeze(-1)).squeeze(-1)
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
        out = torch.bmm(self.down_proj[ids], h.unsqueeze(-1)).squeeze(-1)
        out = out * top_w.reshape(-1, 1)
        return out.view(tokens, k, -1).sum(dim=1)


class LoopExperts(Experts):
    """A loop over every expert with dense routing weights (zero where not chosen)."""

    def forward(self, x, top_idx, top_w):
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
        dense = dense.scatter(1, top_idx, top_w)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            out = out + F.linear(F.silu(gate) * up, self.down_proj[e]) * dense[:, e : e + 1]
        return out


class GroupedExperts(Experts):
    """torchtitan's ``GroupedExperts``: the (token, choice) rows sorted by expert, then one
    ``torch._grouped_mm`` per weight over each expert's run of rows (``offs``: where each run
    ends), in bf16 as the kernel requires."""

    def forward(self, x, top_idx, top_w):
        tokens, k = top_idx.shape
        ids = top_idx.reshape(-1)
        order = ids.argsort(stable=True)
        rows = x.repeat_interleave(k, dim=0)[order]
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).scatter_add(
            0, ids, torch.ones_like(ids))
        offsets = counts.cumsum(0).to(torch.int32)
        h = torch._grouped_mm(rows.bfloat16(), self.gate_up_proj.bfloat16().transpose(-2, -1), offs=offsets)
        gate, up = h.float().chunk(2, dim=-1)
        h = F.silu(gate) * up
        out = torch._grouped_mm(h.bfloat16(), self.down_proj.bfloat16().transpose(-2, -1), offs=offsets).float()
        out = torch.empty_like(out).index_copy(0, order, out)  # back to (token, choice) order
        out = out * top_w.reshape(-1, 1)
        return out.view(tokens, k, -1).sum(dim=1)


class BatchedExperts(nn.Module):
    """Llama-4's ``Llama4TextExperts``: weights ``[E, dim, 2*ffn]`` and ``[E, ffn, dim]`` read whole
    by one ``bmm`` each, the tokens scattered into ``[E, tokens, dim]`` by their routing weights
    (every token visits every expert, weighted; zero where not chosen)."""

    def __init__(self, cfg: Config, num_experts: int):
        super().__init__()
        self.num_experts, self.dim = num_experts, cfg.dim
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, cfg.dim, 2 * cfg.ffn) / cfg.dim**0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, cfg.ffn, cfg.dim) / cfg.ffn**0.5)

    def forward(self, x, top_idx, top_w):
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype).scatter(1, top_idx, top_w)
        hidden_states = (x[None] * dense.t()[:, :, None]).view(self.num_experts, -1, self.dim)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        next_states = torch.bmm(up * F.silu(gate), self.down_proj)
        return next_states.sum(dim=0)


class InterleavedExperts(nn.Module):
    """gpt-oss's experts: weights stored ``[E, in, out]`` with a bias per expert, the gate and the
    linear unit interleaved in ``gate_up_proj``'s outputs (``gate_up[..., ::2]``,
    ``gate_up[..., 1::2]``), a clamped SwiGLU; each (token, choice) row picks its expert's weights
    and biases and runs one ``bmm``."""

    def __init__(self, cfg: Config, num_experts: int, alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, cfg.dim, 2 * cfg.ffn) / cfg.dim**0.5)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(num_experts, 2 * cfg.ffn) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(num_experts, cfg.ffn, cfg.dim) / cfg.ffn**0.5)
        self.down_proj_bias = nn.Parameter(torch.randn(num_experts, cfg.dim) * 0.02)

    def _apply_gate(self, gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x, top_idx, top_w):
        tokens, k = top_idx.shape
        rows = x.repeat_interleave(k, dim=0).unsqueeze(1)  # [tokens*k, 1, dim]
        ids = top_idx.reshape(-1)
        gate_up = torch.bmm(rows, self.gate_up_proj[ids]).squeeze(1) + self.gate_up_proj_bias[ids]
        h = self._apply_gate(gate_up).unsqueeze(1)
        out = torch.bmm(h, self.down_proj[ids]).squeeze(1) + self.down_proj_bias[ids]
        out = out * top_w.reshape(-1, 1)
        return out.view(tokens, k, -1).sum(dim=1)


class ParallelExperts(nn.Module):
    """JetMoE's (and ScatterMoE's) ``ParallelExperts``: weights ``[E, out, in]``, the rows grouped
    by expert split by their counts, one ``F.linear`` per expert, the outputs concatenated."""

    def __init__(self, num_experts: int, input_size: int, output_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.randn(num_experts, output_size, input_size) / input_size**0.5)

    def forward(self, inputs, expert_size):
        pieces = inputs.split(expert_size, dim=0)
        return torch.cat([F.linear(pieces[i], self.weight[i]) for i in range(self.num_experts)], dim=0)


class ConcatenatedExpertsMoE(nn.Module):
    """JetMoE's MoE: tokens sorted by expert, ``input_linear`` giving gate|up per expert (then
    ``chunk(2, dim=-1)`` of the concatenated outputs), ``output_linear``, the gates applied, and the
    rows added back per token into zeros by ``index_add``, plus a bias."""

    def __init__(self, cfg: Config, num_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(cfg.dim, num_experts, bias=False)
        self.input_linear = ParallelExperts(num_experts, cfg.dim, 2 * cfg.ffn)
        self.output_linear = ParallelExperts(num_experts, cfg.ffn, cfg.dim)
        self.bias = nn.Parameter(torch.zeros(cfg.dim))

    def forward(self, x):
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        logits = self.router(flat).float()
        top_logits, top_idx = logits.topk(self.top_k, dim=1)
        top_gates = torch.softmax(top_logits, dim=1).type_as(flat)
        expert_size = torch.zeros_like(logits).scatter(1, top_idx, 1).long().sum(0).tolist()
        _, index_sorted = top_idx.flatten().sort(0)
        batch_index = index_sorted.div(self.top_k, rounding_mode="trunc")
        batch_gates = top_gates.flatten()[index_sorted]
        hidden = self.input_linear(flat[batch_index], expert_size)
        gate, up = hidden.chunk(2, dim=-1)
        out = self.output_linear(F.silu(gate) * up, expert_size) * batch_gates[:, None]
        merged = torch.zeros((b * s, d), dtype=out.dtype, device=out.device).index_add(0, batch_index, out)
        return merged.view(b, s, d) + self.bias


class MoEFeedForward(nn.Module):
    def __init__(self, cfg: Config, experts: type[nn.Module], num_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(cfg.dim, num_experts, bias=False)
        self.experts = experts(cfg, num_experts)

    def forward(self, x):
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        probs = self.router(flat).softmax(dim=-1)
        top_w, top_idx = probs.topk(self.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return self.experts(flat, top_idx, top_w).view(b, s, d)


class ExpertsMoE(Decoder):
    def __init__(self, cfg: Config = Config(), loop: bool = False, experts: type[nn.Module] | None = None):
        experts = experts or (LoopExperts if loop else IndexedExperts)
        super().__init__(cfg, lambda c: Block(c, QKVAttention, lambda c2: MoEFeedForward(c2, experts)))


# --- DeepSeek-V3's MoE: routed experts and a shared expert on one normed input ---------------


class SigmoidTopkRouter(nn.Module):
    """DeepSeek-V3's router: a bare weight applied in float32, sigmoid scores, the top k picked
    and renormalized."""

    def __init__(self, cfg: Config, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.randn(num_experts, cfg.dim) / cfg.dim**0.5)

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        scores = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32)).sigmoid()
        topk_weights, topk_indices = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_indices, topk_weights


class GatedMLP(nn.Module):
    def __init__(self, dim: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, intermediate, bias=False)
        self.up_proj = nn.Linear(dim, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SharedExpertMoE(nn.Module):
    """``experts(x) + shared_experts(x)``: the routed experts read the flattened input, the shared
    expert (a gated MLP of ``moe_intermediate_size * n_shared_experts``, often narrower than the
    model) the input as it came, and the router, computed whole, reads it too."""

    def __init__(self, cfg: Config, shared_ffn: int, num_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.gate = SigmoidTopkRouter(cfg, num_experts, top_k)
        self.experts = IndexedExperts(cfg, num_experts)
        self.shared_experts = GatedMLP(cfg.dim, shared_ffn)

    def forward(self, hidden_states):
        residuals = hidden_states
        orig_shape = hidden_states.shape
        topk_indices, topk_weights = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        hidden_states = self.experts(hidden_states, topk_indices, topk_weights.type(hidden_states.dtype))
        hidden_states = hidden_states.view(*orig_shape)
        return hidden_states + self.shared_experts(residuals)


# --- gated attention (Qwen3-Next, AXK-2): q_proj gives each head its query and an output gate --


class GatedQueryAttention(QKVAttention):
    """Each head's query and output gate from one projection (``view(b, s, heads, q + v)``, then
    ``split``), values narrower than queries (latent attention's ``v_head_dim``); the attention
    output scaled by ``sigmoid(gate.float())`` and cast back, so in bf16 the gate section is read
    through a cast to float32."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.v_dim = cfg.head_dim // 2
        self.wq = nn.Linear(cfg.dim, cfg.heads * (cfg.head_dim + self.v_dim), bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.v_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.v_dim, cfg.dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        query_gate = self.wq(x).view(b, s, self.n_heads, self.head_dim + self.v_dim)
        q, gate = torch.split(query_gate, [self.head_dim, self.v_dim], dim=-1)
        gate = gate.reshape(b, s, -1)
        k = self.wk(x).view(b, s, self.n_kv, self.head_dim)
        v = self.wv(x).view(b, s, self.n_kv, self.v_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        out = out.transpose(1, 2).reshape(b, s, -1)
        out = (out * torch.sigmoid(gate.float())).to(out.dtype)
        return self.wo(out)


# --- Meta's reference Llama: complex rotary, repeat_kv by expand, contiguous().view ------------


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class ReferenceAttention(QKVAttention):
    def forward(self, x, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = repeat_kv(xk, self.n_heads // self.n_kv)
        values = repeat_kv(xv, self.n_heads // self.n_kv)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = F.softmax((scores + mask).float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class ReferenceLlama(Decoder):
    """Meta's llama/model.py: rotary as complex numbers (``view_as_complex``), GQA by
    ``expand`` + ``reshape``, heads merged by ``transpose(1, 2).contiguous().view``, the causal
    mask built in the forward; 2 kv heads, so kv heads < tp from tp=4 on."""

    def __init__(self, cfg: Config = Config(kv_heads=2)):
        super().__init__(cfg, lambda c: Block(c, ReferenceAttention))
        self.register_buffer("freqs_cis", precompute_freqs_cis(cfg.head_dim, cfg.max_seq * 2), persistent=False)

    def extra(self, tokens):
        seqlen = tokens.shape[1]
        mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device)
        return self.freqs_cis[:seqlen], torch.triu(mask, diagonal=1)


# --- tensors created without a device: rotary computed in the forward ------------------------


class ArangeRopeAttention(QKVAttention):
    def attend(self, q, k, v):
        s, d = q.shape[1], self.head_dim
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        angles = torch.outer(torch.arange(s).float(), inv_freq)
        cos = torch.cat([angles.cos(), angles.cos()], -1)[None, :, None, :].to(q.dtype)
        sin = torch.cat([angles.sin(), angles.sin()], -1)[None, :, None, :].to(q.dtype)

        def rotate_half(x):
            return torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)

        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)


class ArangeRope(Decoder):
    """Rotary tables built in the forward with ``torch.arange(...)`` and no ``device=`` (CPU
    tensors whatever the model is on), as much research code does."""

    def __init__(self, cfg: Config = Config(kv_heads=2)):
        super().__init__(cfg, lambda c: Block(c, ArangeRopeAttention))


# --- a fused wqkv that saves and loads as wq/wk/wv through its own state-dict hooks ----------


class FusedQKVAttention(QKVAttention):
    """One ``wqkv`` projection; state dicts carry ``wq``/``wk``/``wv`` (torchtitan's Llama-3
    keeps checkpoints compatible this way): a post-save hook splits, a load pre-hook fuses."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        del self.wq, self.wk, self.wv
        self.sections = [cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim]
        self.wqkv = nn.Linear(cfg.dim, sum(self.sections), bias=False)
        self._register_state_dict_hook(FusedQKVAttention._split_qkv)
        self._register_load_state_dict_pre_hook(self._fuse_qkv)

    @staticmethod
    def _split_qkv(module, state_dict, prefix, local_metadata):
        fused = state_dict.pop(prefix + "wqkv.weight")
        for name, part in zip(("wq", "wk", "wv"), fused.split(module.sections, dim=0), strict=True):
            state_dict[prefix + f"{name}.weight"] = part

    def _fuse_qkv(self, state_dict, prefix, *args):
        names = [prefix + f"{n}.weight" for n in ("wq", "wk", "wv")]
        if all(n in state_dict for n in names):
            state_dict[prefix + "wqkv.weight"] = torch.cat([state_dict.pop(n) for n in names], dim=0)

    def forward(self, x, *extra):
        b, s, _ = x.shape
        q, k, v = self.wqkv(x).split(self.sections, dim=-1)
        q = q.view(b, s, self.n_heads, self.head_dim)
        k = k.view(b, s, self.n_kv, self.head_dim)
        v = v.view(b, s, self.n_kv, self.head_dim)
        return self.wo(self.attend(q, k, v).reshape(b, s, -1))


class FusedQKV(Decoder):
    def __init__(self, cfg: Config = Config()):
        super().__init__(cfg, lambda c: Block(c, FusedQKVAttention))


# --- keys assembled in a buffer filled slice by slice (MiniCPM3 / DeepSeek-V2 style) ------------


class SliceFilledAttention(QKVAttention):
    """Keys assembled as MLA code does: ``key_states = k_pe.new_empty(...)``, then
    ``key_states[..., :n] = k_nope`` (per head) and ``key_states[..., n:] = k_pe`` (one part shared
    by every head, expanded). The buffer is written in place after it is made, so whatever reads
    it must read it after the writes."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.w_pe = nn.Linear(cfg.dim, cfg.head_dim // 2, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        half = self.head_dim // 2
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        k_pe = self.w_pe(x).view(b, 1, s, half).expand(b, self.n_kv, s, half)
        keys = k_pe.new_empty(b, self.n_kv, s, self.head_dim)
        keys[:, :, :, :half] = k[..., :half]
        keys[:, :, :, half:] = k_pe
        out = F.scaled_dot_product_attention(q, keys, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SliceFilledKeys(Decoder):
    def __init__(self, cfg: Config = Config()):
        super().__init__(cfg, lambda c: Block(c, SliceFilledAttention))


# --- a padding mask broadcast with expand_as and applied in place (XLM / Flaubert style) -----


class ExpandAsMaskAttention(QKVAttention):
    """``mask = (mask == 0).view(b, 1, 1, -1).expand_as(scores)`` then ``scores.masked_fill_(mask,
    min)``: ``expand_as`` takes the scores' shape as each rank holds them (heads cut)."""

    def attend(self, q, k, v, keep):
        b = q.shape[0]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        masked = (keep == 0).view(b, 1, 1, -1).expand_as(scores)
        scores.masked_fill_(masked, torch.finfo(scores.dtype).min)
        return torch.matmul(F.softmax(scores.float(), dim=-1).type_as(scores), v).transpose(1, 2)


class ExpandAsMask(Decoder):
    def __init__(self, cfg: Config = Config()):
        super().__init__(cfg, lambda c: Block(c, ExpandAsMaskAttention))

    def extra(self, tokens):
        return ((tokens % 7) != 0).long(),  # a padding mask of the ids


# --- q|k|v fused the vision way: one reshape to (3, heads, head_dim), permute, unbind ----------


class VisionQKVAttention(nn.Module):
    """timm's ``Attention`` (ViT, DeiT, ...): ``qkv = Linear(dim, 3 * dim)`` with a bias,
    ``qkv(x).reshape(B, N, 3, H, hd).permute(2, 0, 3, 1, 4).unbind(0)``, SDPA, ``proj``."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.num_heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, cfg.dim * 3)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class VisionMlp(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class VisionFusedQKV(Decoder):
    def __init__(self, cfg: Config = Config()):
        super().__init__(cfg, lambda c: Block(c, VisionQKVAttention, VisionMlp))


class VisionBlock(nn.Module):
    """timm's ViT block: pre-norm layer norms around the fused-qkv attention and the GELU MLP."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = VisionQKVAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = VisionMlp(cfg)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class AttentionPool(nn.Module):
    """SigLIP's attention-pooling head: a learned probe attends to every patch, then a residual
    MLP runs on the one pooled position (a sequence of length 1)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.num_heads = cfg.heads
        self.probe = nn.Parameter(torch.randn(1, 1, cfg.dim) * 0.02)
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.kv = nn.Linear(cfg.dim, 2 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm = nn.LayerNorm(cfg.dim)
        self.mlp = VisionMlp(cfg)

    def forward(self, x):
        B, N, C = x.shape
        heads, hd = self.num_heads, C // self.num_heads
        q = self.q(self.probe.expand(B, -1, -1)).reshape(B, 1, heads, hd).transpose(1, 2)
        k, v = self.kv(x).reshape(B, N, 2, heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        pooled = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, 1, C))
        pooled = pooled + self.mlp(self.norm(pooled))
        return pooled[:, 0]


class VisionTransformer(nn.Module):
    """A ViT as timm writes it: a strided-conv patch embedding, ``flatten(2).transpose(1, 2)``,
    a class token concatenated in front (``cls`` pooling: 17 positions for 16 patches, a length no
    tp divides) or an attention-pooling head over the patches alone (``map``), learned position
    embeddings, pre-norm blocks, a final norm and a linear classifier."""

    def __init__(self, cfg: Config = Config(), image: int = 16, patch: int = 4, classes: int = 10,
                 pool: str = "cls"):
        super().__init__()
        self.pool = pool
        self.patch_embed = nn.Conv2d(3, cfg.dim, kernel_size=patch, stride=patch)
        patches = (image // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim)) if pool == "cls" else None
        self.pos_embed = nn.Parameter(torch.randn(1, patches + (pool == "cls"), cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.attn_pool = AttentionPool(cfg) if pool == "map" else None
        self.head = nn.Linear(cfg.dim, classes)

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        if self.cls_token is not None:
            x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = x + self.pos_embed
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return self.head(x[:, 0] if self.attn_pool is None else self.attn_pool(x))


class EmbeddingMixBlock(nn.Module):
    """modded-nanogpt's block: it mixes the embedding ``x0`` back into the stream with learned
    scalars before attention (a value every block reads, computed before the first), and its
    attention skips padded keys by a mask made from the token ids."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.5]))
        self.attention_norm = nn.RMSNorm(cfg.dim)
        self.attention = QKVAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        self.feed_forward = SwiGLU(cfg)

    def forward(self, x, x0, keep):
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        x = x + self.attention(self.attention_norm(x), keep)
        return x + self.feed_forward(self.ffn_norm(x))


class PaddedKeysAttention(QKVAttention):
    def attend(self, q, k, v, keep):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(self.n_heads // self.n_kv, dim=1) for t in (k, v))
        mask = keep[:, None, None, :]  # [b, 1, 1, s]: attend to real tokens only
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


class EmbeddingMixDecoder(Decoder):
    """Every block reads the embedding and a padding mask: both cross every pipeline boundary."""

    def __init__(self, cfg: Config = Config(layers=4), pad: int = 0):
        super().__init__(cfg, lambda c: _with_attention(EmbeddingMixBlock(c), PaddedKeysAttention(c)))
        self.pad = pad

    def forward(self, tokens):
        x0 = F.rms_norm(self.tok_embeddings(tokens), (self.cfg.dim,))
        keep = tokens != self.pad
        h = x0
        for layer in self.layers:
            h = layer(h, x0, keep)
        return self.output(self.norm(h))


def _with_attention(block: nn.Module, attention: nn.Module) -> nn.Module:
    block.attention = attention
    return block


# --- multi-head latent attention (DeepSeek-V2/V3) ------------------------------------------------


class LatentAttention(nn.Module):
    """DeepSeek-V3's MLA as its reference code writes it: keys and values from a compressed
    latent (``wkv_a`` -> norm -> ``wkv_b``), and one rotary key part shared by every head,
    ``k = torch.cat([k_nope, k_pe.expand(-1, -1, H, -1)], dim=-1)``."""

    def __init__(self, cfg: Config, kv_lora: int = 32, nope: int = 16, rope: int = 8, v_dim: int = 16):
        super().__init__()
        self.heads, self.kv_lora, self.nope, self.rope, self.v_dim = cfg.heads, kv_lora, nope, rope, v_dim
        self.wq = nn.Linear(cfg.dim, cfg.heads * (nope + rope), bias=False)
        self.wkv_a = nn.Linear(cfg.dim, kv_lora + rope, bias=False)
        self.kv_norm = nn.RMSNorm(kv_lora)
        self.wkv_b = nn.Linear(kv_lora, cfg.heads * (nope + v_dim), bias=False)
        self.wo = nn.Linear(cfg.heads * v_dim, cfg.dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.nope + self.rope)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope], dim=-1)
        kv = self.wkv_a(x)
        kv, k_pe = torch.split(kv, [self.kv_lora, self.rope], dim=-1)
        cos = torch.cos(torch.arange(s, dtype=x.dtype))[None, :, None, None]
        q_pe, k_pe = q_pe * cos, k_pe.unsqueeze(2) * cos  # a stand-in for the rotary embedding
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(b, s, self.heads, self.nope + self.v_dim)
        k_nope, v = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.heads, -1)], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class LatentAttentionModel(Decoder):
    def __init__(self, cfg: Config = Config()):
        super().__init__(cfg, lambda c: Block(c, LatentAttention))


def hf_rotate_half(x):
    """transformers' ``rotate_half``: the halves of the last dim swapped, the first negated."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_interleave(q, k, cos, sin):
    """transformers' ``apply_rotary_pos_emb_interleave``: pairs de-interleaved by a view, a transpose
    and a reshape to the shapes read off the inputs, then the usual rotation."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return q * cos + hf_rotate_half(q) * sin, k * cos + hf_rotate_half(k) * sin


class LowRankLatentAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention as transformers writes it: q through a low-rank
    pair (``q_a_proj`` -> RMSNorm -> ``q_b_proj``); one ``kv_a_proj_with_mqa`` for the kv latent
    and a rotary key shared by every head (one head, interleaved rope); keys assembled in a buffer
    (``new_empty``, then each part copied into a slice, the shared part expanded to the heads)."""

    def __init__(self, cfg: Config, q_lora: int = 16, kv_lora: int = 16, nope: int = 8, rope: int = 8,
                 v_dim: int = 8):
        super().__init__()
        self.heads, self.kv_lora, self.nope, self.rope, self.v_dim = cfg.heads, kv_lora, nope, rope, v_dim
        self.q_a_proj = nn.Linear(cfg.dim, q_lora, bias=False)
        self.q_a_layernorm = nn.RMSNorm(q_lora)
        self.q_b_proj = nn.Linear(q_lora, cfg.heads * (nope + rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.dim, kv_lora + rope, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(kv_lora)
        self.kv_b_proj = nn.Linear(kv_lora, cfg.heads * (nope + v_dim), bias=False)
        self.o_proj = nn.Linear(cfg.heads * v_dim, cfg.dim, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def expand_kv(self, kv_nope, k_rot):
        batch, _, seq, _ = kv_nope.shape
        kv = self.kv_b_proj(kv_nope).view(batch, seq, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, value_states = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        k_rot = k_rot.expand(-1, k_nope.shape[1], -1, -1)
        key_states = kv.new_empty(*kv.shape[:-1], self.nope + self.rope)
        key_states[..., : self.nope].copy_(k_nope)
        key_states[..., self.nope :].copy_(k_rot)
        return key_states, value_states

    def forward(self, x):
        batch, seq, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, seq, -1, self.nope + self.rope).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [self.nope, self.rope], dim=-1)
        kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_lora, self.rope], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope).view(batch, 1, seq, self.kv_lora)
        k_rot = k_rot.view(batch, 1, seq, self.rope)
        freqs = torch.outer(torch.arange(seq, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[None]
        q_rot, k_rot = rope_interleave(q_rot, k_rot, emb.cos().to(x.dtype), emb.sin().to(x.dtype))
        query_states = torch.cat((q_pass, q_rot), dim=-1)
        key_states, value_states = self.expand_kv(kv_nope, k_rot)
        out = F.scaled_dot_product_attention(query_states, key_states, value_states, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class LowRankLatentAttentionModel(Decoder):
    def __init__(self, cfg: Config = Config(heads=8, kv_heads=8)):
        super().__init__(cfg, lambda c: Block(c, LowRankLatentAttention))


# --- adaLN-Zero modulation (DiT, SD3, Flux): per-sample shift, scale and gate from a condition -----


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class AdaLNBlock(nn.Module):
    """DiT's block: ``adaLN_modulation = Sequential(SiLU(), Linear(dim, 6 * dim))`` on the
    condition, chunked into shift/scale/gate for attention and MLP around affine-free norms."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, elementwise_affine=False, eps=1e-6)
        self.attn = VisionQKVAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim, elementwise_affine=False, eps=1e-6)
        self.mlp = VisionMlp(cfg)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cfg.dim, 6 * cfg.dim))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class AdaLNDecoder(Decoder):
    """Blocks conditioned on a timestep embedding (sinusoids -> Linear -> SiLU -> Linear), the
    timestep read from the first token so the model takes token ids like the others."""

    def __init__(self, cfg: Config = Config()):
        super().__init__(cfg, AdaLNBlock)
        self.t_embedder = nn.Sequential(nn.Linear(32, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim))

    def extra(self, tokens):
        t = (tokens[:, :1] % 10).float()
        freqs = torch.exp(-torch.arange(16, dtype=torch.float32) / 16)
        return self.t_embedder(torch.cat([torch.cos(t * freqs), torch.sin(t * freqs)], dim=-1)),


# --- one weight read by several linears ------------------------------------------------------


class ReusedEmbedderDiT(Decoder):
    """DiT's wiring: block 0 holds the timestep embedder, and the output head calls it again
    for its own adaLN shift and scale on the final affine-free norm."""

    def __init__(self, cfg: Config = Config()):
        super().__init__(cfg, AdaLNBlock)
        self.layers[0].t_embedder = nn.Sequential(nn.Linear(32, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim))
        self.norm = nn.LayerNorm(cfg.dim, elementwise_affine=False, eps=1e-6)
        self.final_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cfg.dim, 2 * cfg.dim))

    def timestep(self, tokens):
        t = (tokens[:, :1] % 10).float()
        freqs = torch.exp(-torch.arange(16, dtype=torch.float32) / 16)
        return self.layers[0].t_embedder(torch.cat([torch.cos(t * freqs), torch.sin(t * freqs)], dim=-1))

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        c = self.timestep(tokens)
        for layer in self.layers:
            h = layer(h, c)
        shift, scale = self.final_modulation(self.timestep(tokens)).chunk(2, dim=1)
        return self.output(modulate(self.norm(h), shift, scale))


class SharedLayerDecoder(Decoder):
    """ALBERT's cross-layer sharing: one block's weights run at every depth."""

    def __init__(self, cfg: Config = Config()):
        super().__init__(dataclasses.replace(cfg, layers=1), lambda c: Block(c, QKVAttention))
        self.depth = cfg.layers

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for _ in range(self.depth):
            h = self.layers[0](h)
        return self.output(self.norm(h))


class PostNormBlock(nn.Module):
    """ALBERT's layer: attention and MLP, each added to its input and then layer-normed."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.attention = QKVAttention(cfg)
        self.attention_norm = nn.LayerNorm(cfg.dim)
        self.ffn = nn.Linear(cfg.dim, cfg.ffn)
        self.ffn_output = nn.Linear(cfg.ffn, cfg.dim)
        self.output_norm = nn.LayerNorm(cfg.dim)

    def forward(self, x):
        x = self.attention_norm(x + self.attention(x))
        return self.output_norm(x + self.ffn_output(F.gelu(self.ffn(x))))


class FactorizedSharedLayer(Decoder):
    """ALBERT: a narrow embedding normed and mapped up to the hidden size by a linear whose output
    the one shared layer reads first; the layer then reads its own normed output at every depth."""

    def __init__(self, cfg: Config = Config(heads=8, kv_heads=8), embedding: int = 32):
        super().__init__(dataclasses.replace(cfg, layers=1), PostNormBlock)
        self.depth = cfg.layers
        self.tok_embeddings = nn.Embedding(cfg.vocab, embedding)
        self.embedding_norm = nn.LayerNorm(embedding)
        self.embedding_hidden_mapping_in = nn.Linear(embedding, cfg.dim)

    def forward(self, tokens):
        h = self.embedding_hidden_mapping_in(self.embedding_norm(self.tok_embeddings(tokens)))
        for _ in range(self.depth):
            h = self.layers[0](h)
        return self.output(self.norm(h))


# --- fused projections whose k/v heads are fewer than tp ranks --------------------------------

GQA = Config(heads=8, kv_heads=2)  # 8 q heads of width 8 share 2 kv heads: kv heads < tp from tp=4 on


class GroupedFusedQKVAttention(nn.Module):
    """torchtitan's ``FusedQKVLinear``: one ``wqkv`` whose output is grouped per kv head (the group's
    q heads, then its k and its v), viewed to ``(kv groups, heads_per_kv + 2, head_dim)`` and split
    along that dim; attention by SDPA with ``enable_gqa``."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.head_dim, self.heads_per_kv = cfg.head_dim, cfg.heads // cfg.kv_heads
        self.wqkv = nn.Linear(cfg.dim, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x):
        bs, seqlen, _ = x.shape
        qkv = self.wqkv(x).view(bs, seqlen, -1, self.heads_per_kv + 2, self.head_dim)
        xq, xk, xv = torch.split(qkv, [self.heads_per_kv, 1, 1], dim=-2)
        xq, xk, xv = (t.reshape(bs, seqlen, -1, self.head_dim).contiguous() for t in (xq, xk, xv))
        xq, xk, xv = (t.transpose(1, 2) for t in (xq, xk, xv))
        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class GroupedFusedQKV(Decoder):
    def __init__(self, cfg: Config = GQA):
        super().__init__(cfg, lambda c: Block(c, GroupedFusedQKVAttention))


def hf_repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """transformers' ``repeat_kv``: [b, kv, s, d] -> [b, kv * n_rep, s, d] by expand + reshape."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class SlicedFusedQKVAttention(nn.Module):
    """Phi-3's attention: one ``qkv_proj`` sliced into q, k, v at column offsets, each viewed to
    heads; k/v repeated per q head as transformers' SDPA path does."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.head_dim, self.num_heads, self.num_kv = cfg.head_dim, cfg.heads, cfg.kv_heads
        op_size = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.dim, op_size, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, hidden_states):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        qkv = self.qkv_proj(hidden_states)
        query_pos = self.num_heads * self.head_dim
        query_states = qkv[..., :query_pos]
        key_states = qkv[..., query_pos : query_pos + self.num_kv * self.head_dim]
        value_states = qkv[..., query_pos + self.num_kv * self.head_dim :]
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)
        n_rep = self.num_heads // self.num_kv
        key_states, value_states = hf_repeat_kv(key_states, n_rep), hf_repeat_kv(value_states, n_rep)
        out = F.scaled_dot_product_attention(query_states, key_states, value_states, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(*input_shape, -1).contiguous())


class SlicedFusedQKV(Decoder):
    def __init__(self, cfg: Config = GQA):
        super().__init__(cfg, lambda c: Block(c, SlicedFusedQKVAttention))


class InsertedDimMultiQueryAttention(nn.Module):
    """GPT-BigCode's multi-query attention: ``c_attn`` gives q and one head of k and v, split after
    an inserted heads dim (``unsqueeze(1).split(...)``); k and v broadcast over the q heads."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.head_dim, self.embed_dim = cfg.head_dim, cfg.heads * cfg.head_dim
        self.c_attn = nn.Linear(cfg.dim, self.embed_dim + 2 * cfg.head_dim)
        self.c_proj = nn.Linear(self.embed_dim, cfg.dim)

    def forward(self, hidden_states):
        input_shape = hidden_states.shape[:-1]
        query, key, value = self.c_attn(hidden_states).unsqueeze(1).split(
            (self.embed_dim, self.head_dim, self.head_dim), dim=3)
        query = query.view(*input_shape, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
        return self.c_proj(out.transpose(1, 2).reshape(*input_shape, -1).contiguous())


class InsertedDimMultiQuery(Decoder):
    def __init__(self, cfg: Config = Config(heads=8, kv_heads=1)):
        super().__init__(cfg, lambda c: Block(c, InsertedDimMultiQueryAttention))


class IndexedMultiQueryAttention(nn.Module):
    """Falcon's multi-query attention: ``query_key_value`` viewed to ``heads + 2`` heads, q the first
    ``heads`` (a slice), k and v one head each by index lists (``qkv[..., [-2], :]``); SDPA
    broadcasts the one kv head over the q heads."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.num_heads, self.head_dim = cfg.heads, cfg.head_dim
        self.query_key_value = nn.Linear(cfg.dim, (cfg.heads + 2) * cfg.head_dim, bias=False)
        self.dense = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, hidden_states):
        batch_size, seq_length, _ = hidden_states.shape
        fused_qkv = self.query_key_value(hidden_states).view(batch_size, seq_length, self.num_heads + 2,
                                                               self.head_dim)
        query, key, value = fused_qkv[..., :-2, :], fused_qkv[..., [-2], :], fused_qkv[..., [-1], :]
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(batch_size, seq_length, -1))


class IndexedMultiQuery(Decoder):
    def __init__(self, cfg: Config = Config(heads=8, kv_heads=1)):
        super().__init__(cfg, lambda c: Block(c, IndexedMultiQueryAttention))



# --- a parallel block summed in place ------------------------------------------------------


class GeluMLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.dense_4h_to_h = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


def dropout_add(x: torch.Tensor, residual: torch.Tensor, prob: float, training: bool) -> torch.Tensor:
    out = F.dropout(x, p=prob, training=training)
    return residual + out


class InPlaceParallelBlock(nn.Module):
    """Falcon's decoder layer: attention and MLP read one LayerNorm's output, the attention output
    is added into the MLP output in place (``mlp_output += attention_output``), then the residual."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.dim)
        self.self_attention = QKVAttention(cfg)
        self.mlp = GeluMLP(cfg)

    def forward(self, hidden_states):
        residual = hidden_states
        attention_layernorm_out = self.input_layernorm(hidden_states)
        attention_output = self.self_attention(attention_layernorm_out)
        mlp_output = self.mlp(attention_layernorm_out)
        mlp_output += attention_output
        return dropout_add(mlp_output, residual, 0.0, training=self.training)


class InPlaceParallel(Decoder):
    def __init__(self, cfg: Config = Config(heads=8, kv_heads=8)):
        super().__init__(cfg, InPlaceParallelBlock)



# --- diffusers' DiT and Flux blocks -----------------------------------------------------------


class AdaLayerNormZero(nn.Module):
    """diffusers' ``AdaLayerNormZero``: ``emb = self.linear(self.silu(emb))``, chunked in 6, the norm
    modulated with ``[:, None]`` indexing."""

    def __init__(self, dim: int):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(dim, 6 * dim, bias=True)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, emb):
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        x = self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class DiffusersAttention(nn.Module):
    """diffusers' ``Attention`` with its default processor: ``to_q/to_k/to_v``, heads by
    ``unflatten``, per-head RMSNorm of q and k (Flux), SDPA, ``to_out`` unless ``pre_only``."""

    def __init__(self, cfg: Config, pre_only: bool = False, qk_norm: bool = False):
        super().__init__()
        self.heads = cfg.heads
        self.to_q = nn.Linear(cfg.dim, cfg.dim)
        self.to_k = nn.Linear(cfg.dim, cfg.dim)
        self.to_v = nn.Linear(cfg.dim, cfg.dim)
        self.norm_q = nn.RMSNorm(cfg.head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.norm_k = nn.RMSNorm(cfg.head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.to_out = None if pre_only else nn.ModuleList([nn.Linear(cfg.dim, cfg.dim), nn.Dropout(0.0)])

    def forward(self, hidden_states):
        query = self.to_q(hidden_states).unflatten(-1, (self.heads, -1))
        key = self.to_k(hidden_states).unflatten(-1, (self.heads, -1))
        value = self.to_v(hidden_states).unflatten(-1, (self.heads, -1))
        query, key = self.norm_q(query), self.norm_k(key)
        hidden_states = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2),
                                                       value.transpose(1, 2))
        hidden_states = hidden_states.transpose(1, 2).flatten(2, 3)
        if self.to_out is not None:
            hidden_states = self.to_out[1](self.to_out[0](hidden_states))
        return hidden_states


class DiffusersFeedForward(nn.Module):
    """diffusers' ``FeedForward`` with ``GELU(approximate="tanh")``: ``net = [GELU(proj), Dropout, Linear]``."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.proj = nn.Linear(cfg.dim, cfg.ffn)
        self.out = nn.Linear(cfg.ffn, cfg.dim)

    def forward(self, x):
        return self.out(F.gelu(self.proj(x), approximate="tanh"))


class DiTBlock(nn.Module):
    """diffusers' ``BasicTransformerBlock`` with ``norm_type="ada_norm_zero"`` (DiT)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.norm1 = AdaLayerNormZero(cfg.dim)
        self.attn1 = DiffusersAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim, elementwise_affine=False, eps=1e-6)
        self.ff = DiffusersFeedForward(cfg)

    def forward(self, hidden_states, emb):
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb)
        attn_output = gate_msa.unsqueeze(1) * self.attn1(norm_hidden_states)
        hidden_states = attn_output + hidden_states
        norm_hidden_states = self.norm2(hidden_states)
        norm_hidden_states = norm_hidden_states * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        ff_output = gate_mlp.unsqueeze(1) * self.ff(norm_hidden_states)
        return ff_output + hidden_states


class TimestepConditioned(nn.Module):
    """Token embedding, blocks conditioned on a timestep embedding (sinusoids of the first token ->
    Linear -> SiLU -> Linear), then diffusers' output head: ``proj_out_1(silu(conditioning)).chunk(2)``
    shifting and scaling the last norm, ``proj_out_2``."""

    def __init__(self, cfg: Config, block):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.time_embedding = nn.Sequential(nn.Linear(32, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim))
        self.layers = nn.ModuleList(block(cfg) for _ in range(cfg.layers))
        self.norm_out = nn.LayerNorm(cfg.dim, elementwise_affine=False, eps=1e-6)
        self.proj_out_1 = nn.Linear(cfg.dim, 2 * cfg.dim)
        self.proj_out_2 = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, tokens):
        hidden_states = self.tok_embeddings(tokens)
        t = (tokens[:, :1] % 10).float()
        freqs = torch.exp(-torch.arange(16, dtype=torch.float32) / 16)
        conditioning = self.time_embedding(torch.cat([torch.cos(t * freqs), torch.sin(t * freqs)], dim=-1))
        for layer in self.layers:
            hidden_states = layer(hidden_states, conditioning)
        shift, scale = self.proj_out_1(F.silu(conditioning)).chunk(2, dim=1)
        hidden_states = self.norm_out(hidden_states) * (1 + scale[:, None]) + shift[:, None]
        return self.proj_out_2(hidden_states)


class DiffusersDiT(TimestepConditioned):
    def __init__(self, cfg: Config = Config(heads=8, kv_heads=8)):
        super().__init__(cfg, DiTBlock)


class AdaLayerNormZeroSingle(nn.Module):
    """diffusers' ``AdaLayerNormZeroSingle``: shift, scale and gate from ``linear(silu(emb)).chunk(3)``."""

    def __init__(self, dim: int):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(dim, 3 * dim, bias=True)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, emb):
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
        return self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None], gate_msa


class FluxSingleBlock(nn.Module):
    """diffusers' ``FluxSingleTransformerBlock``: attention (no output projection) and an MLP read one
    modulated norm in parallel; their outputs are concatenated on the feature dim and projected
    by one ``proj_out``."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.norm = AdaLayerNormZeroSingle(cfg.dim)
        self.proj_mlp = nn.Linear(cfg.dim, cfg.ffn)
        self.act_mlp = nn.GELU(approximate="tanh")
        self.proj_out = nn.Linear(cfg.dim + cfg.ffn, cfg.dim)
        self.attn = DiffusersAttention(cfg, pre_only=True, qk_norm=True)

    def forward(self, hidden_states, temb):
        residual = hidden_states
        norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
        mlp_hidden_states = self.act_mlp(self.proj_mlp(norm_hidden_states))
        attn_output = self.attn(norm_hidden_states)
        hidden_states = torch.cat([attn_output, mlp_hidden_states], dim=2)
        gate = gate.unsqueeze(1)
        hidden_states = gate * self.proj_out(hidden_states)
        return residual + hidden_states


class FluxSingleStream(TimestepConditioned):
    def __init__(self, cfg: Config = Config(heads=8, kv_heads=8)):
        super().__init__(cfg, FluxSingleBlock)



# --- a state-space mixer (Mamba) ------------------------------------------------------------


class MambaMixer(nn.Module):
    """transformers' ``MambaMixer`` in its torch path: ``in_proj`` to a gated pair over channels
    ``[b, 2 * d_inner, s]``, a depthwise causal ``conv1d`` over channels (``groups=d_inner``),
    ``x_proj`` to the step size, B and C, ``dt_proj.weight @ time_step`` (the weight on the left),
    a selective scan per channel with ``A`` and ``D`` per channel, ``out_proj``."""

    def __init__(self, cfg: Config, d_state: int = 8, d_conv: int = 4, expand: int = 2):
        super().__init__()
        self.d_inner, self.d_state, self.dt_rank = expand * cfg.dim, d_state, cfg.dim // 16
        self.in_proj = nn.Linear(cfg.dim, 2 * self.d_inner, bias=False)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(self.d_inner, 1))
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, cfg.dim, bias=False)

    def forward(self, hidden_states):
        seq_len = hidden_states.shape[1]
        projected_states = self.in_proj(hidden_states).transpose(1, 2)
        A = -torch.exp(self.A_log.float())
        hidden_states_b_c, gate = projected_states.chunk(2, dim=1)
        hidden_states_b_c = F.silu(F.conv1d(hidden_states_b_c, self.conv1d.weight.squeeze(1).unsqueeze(1),
                                            self.conv1d.bias, padding=self.conv1d.padding[0],
                                            groups=self.d_inner)[:, :, :seq_len])
        time_step, B, C = self.split_steps(self.x_proj(hidden_states_b_c.transpose(1, 2)))
        time_step = self.dt_proj.weight @ time_step.transpose(1, 2)
        dt = F.softplus(time_step + self.dt_proj.bias.float()[..., None])
        discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
        deltaB_u = dt[:, :, :, None] * B[:, None, :, :].float() * hidden_states_b_c[:, :, :, None].float()
        ssm_state = torch.zeros(hidden_states_b_c.shape[0], self.d_inner, self.d_state)
        scan_outputs = []
        for i in range(seq_len):
            ssm_state = discrete_A[:, :, i, :] * ssm_state + deltaB_u[:, :, i, :]
            scan_outputs.append(torch.matmul(ssm_state.to(C.dtype), C[:, i, :].unsqueeze(-1))[:, :, 0])
        scan_output = torch.stack(scan_outputs, dim=-1)
        scan_output = (scan_output + hidden_states_b_c * self.D[None, :, None]) * F.silu(gate)
        scan_output = scan_output.to(hidden_states.dtype)
        return self.out_proj(scan_output.transpose(1, 2))

    def split_steps(self, projected):
        return torch.split(projected, [self.dt_rank, self.d_state, self.d_state], dim=-1)


class MambaBlock(nn.Module):
    def __init__(self, cfg: Config, mixer: type[nn.Module] = MambaMixer):
        super().__init__()
        self.norm = nn.RMSNorm(cfg.dim)
        self.mixer = mixer(cfg)

    def forward(self, x):
        return x + self.mixer(self.norm(x))


class Mamba(Decoder):
    def __init__(self, cfg: Config = Config(heads=8, kv_heads=8)):  # no attention: heads do not matter
        super().__init__(cfg, MambaBlock)


class WeightlessRMSNorm(nn.Module):
    """FalconMamba's norm of the step size, B and C: no weight, computed in float32, cast back
    with ``type_as``."""

    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x)


class NormedMambaMixer(MambaMixer):
    """FalconMamba's mixer: the step size, B and C each go through a weightless RMSNorm after
    the split."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.dt_norm, self.b_norm, self.c_norm = WeightlessRMSNorm(), WeightlessRMSNorm(), WeightlessRMSNorm()

    def split_steps(self, projected):
        time_step, B, C = super().split_steps(projected)
        return self.dt_norm(time_step), self.b_norm(B), self.c_norm(C)


class NormedMamba(Decoder):
    def __init__(self, cfg: Config = Config(heads=8, kv_heads=8)):
        super().__init__(cfg, lambda c: MambaBlock(c, NormedMambaMixer))


# --- Mamba-2 (Mamba-2, Bamba, Falcon-H1, Granite-4 hybrid, Nemotron-H, Zamba2) -------------------


class GatedGroupRMSNorm(nn.Module):
    """transformers' ``MambaRMSNormGated``: times ``silu(gate)``, then an RMSNorm over each of
    ``n_groups`` groups of the width (the whole width for one group)."""

    def __init__(self, dim: int, group_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size

    def forward(self, hidden_states, gate):
        dtype = hidden_states.dtype
        hidden_states = hidden_states.float() * F.silu(gate.float())
        *prefix, width = hidden_states.shape
        grouped = hidden_states.view(*prefix, width // self.group_size, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * grouped.view(*prefix, width).to(dtype)


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``segment_sum``: ``out[..., i, j] = sum(x[..., j + 1 : i + 1])`` below the
    diagonal, ``-inf`` above it."""
    length = x.size(-1)
    x = x[..., None].expand(*x.size(), length)
    x = x.masked_fill(~torch.tril(torch.ones(length, length, dtype=torch.bool), diagonal=-1), 0)
    sums = torch.cumsum(x, dim=-2)
    return sums.masked_fill(~torch.tril(torch.ones(length, length, dtype=torch.bool), diagonal=0), -torch.inf)


class Mamba2Mixer(nn.Module):
    """transformers' ``Mamba2Mixer`` in its torch path: ``in_proj`` to gate | x,B,C | dt, a depthwise
    causal ``conv1d`` over x|B|C (``groups=conv_dim``), a split into x (heads), B and C (``n_groups``
    groups, each shared by its heads, repeated to them), the chunked scan (one chunk: the sequence)
    with ``A``, ``D`` and ``dt_bias`` per head, a gated norm and ``out_proj``."""

    def __init__(self, cfg: Config, n_groups: int = 1, d_state: int = 16, d_conv: int = 4):
        super().__init__()
        self.heads, self.head_dim, self.n_groups, self.d_state = cfg.heads, 2 * cfg.dim // cfg.heads, n_groups, d_state
        self.intermediate = self.heads * self.head_dim
        self.conv_dim = self.intermediate + 2 * n_groups * d_state
        self.in_proj = nn.Linear(cfg.dim, self.intermediate + self.conv_dim + self.heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, padding=d_conv - 1)
        self.dt_bias = nn.Parameter(torch.rand(self.heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GatedGroupRMSNorm(self.intermediate, self.intermediate // n_groups)
        self.out_proj = nn.Linear(self.intermediate, cfg.dim, bias=False)

    def forward(self, hidden_states):
        batch, seq_len, _ = hidden_states.shape
        projected = self.scale_sections(self.in_proj(hidden_states))
        A = -torch.exp(self.A_log.float())
        gate, hidden_states_b_c, dt = projected.split([self.intermediate, self.conv_dim, self.heads], dim=-1)
        weight = self.conv1d.weight.squeeze(1)  # transformers' causal_conv1d_fn: in the weight's dtype and back
        convolved = F.conv1d(hidden_states_b_c.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1),
                             self.conv1d.bias, padding=self.conv1d.padding[0], groups=self.conv_dim)
        hidden_states_b_c = F.silu(convolved[:, :, :seq_len]).to(hidden_states_b_c.dtype).transpose(1, 2)
        x, B, C = torch.split(hidden_states_b_c, [self.intermediate, self.n_groups * self.d_state,
                                                  self.n_groups * self.d_state], dim=-1)
        x = x.view(batch, seq_len, self.heads, self.head_dim).float()
        B = B.view(batch, seq_len, self.n_groups, self.d_state).float()
        C = C.view(batch, seq_len, self.n_groups, self.d_state).float()
        B = B.repeat_interleave(self.heads // self.n_groups, dim=2, output_size=self.heads)
        C = C.repeat_interleave(self.heads // self.n_groups, dim=2, output_size=self.heads)
        dt = F.softplus(dt + self.dt_bias)  # [b, s, heads]
        D_residual = self.D[..., None] * x
        x = x * dt[..., None]
        A = (A * dt).permute(0, 2, 1)  # [b, heads, s]
        L = torch.exp(segment_sum(A))  # [b, heads, l, s]
        G = torch.einsum("blhn,bshn->blsh", C, B)
        M = G * L.permute(0, 2, 3, 1)
        y = torch.einsum("blsh,bshp->blhp", M, x) + D_residual
        y = self.norm(y.reshape(batch, seq_len, -1), gate)
        return self.out_proj(y.to(hidden_states.dtype))

    def scale_sections(self, projected):
        return projected


class MupMamba2Mixer(Mamba2Mixer):
    """Falcon-H1's mixer: ``in_proj``'s output times a buffer holding one muP multiplier per section
    (gate, x, B, C, dt), before the split."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        groups = self.n_groups * self.d_state
        sizes = (self.intermediate, self.intermediate, groups, groups, self.heads)
        vector = torch.cat([torch.full((n,), m) for n, m in zip(sizes, (1.0, 0.5, 2.0, 0.25, 1.5), strict=True)])
        self.register_buffer("mup_vector", vector.view(1, 1, -1), persistent=False)

    def scale_sections(self, projected):
        return projected * self.mup_vector


class Mamba2(Decoder):
    def __init__(self, cfg: Config = Config(heads=8, kv_heads=8), n_groups: int = 1, mixer=Mamba2Mixer):
        super().__init__(cfg, lambda c: MambaBlock(c, lambda c2: mixer(c2, n_groups) if n_groups != 1 else mixer(c2)))


# --- LoRA adapters (PEFT, Zamba2's shared blocks) -------------------------------------------------


class LoRALinear(nn.Module):
    """PEFT's ``lora.Linear``: the base projection plus ``lora_B(lora_A(dropout(x))) * scaling``."""

    def __init__(self, in_features: int, out_features: int, rank: int = 4, alpha: float = 8.0):
        super().__init__()
        self.base_layer = nn.Linear(in_features, out_features, bias=False)
        self.lora_A = nn.Linear(in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)  # PEFT starts it at zero; trained, it is not
        self.dropout = nn.Dropout(0.0)
        self.scaling = alpha / rank

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


class LoRAAttention(QKVAttention):
    """LoRA on q and v, PEFT's default targets for Llama-style attention."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.wq = LoRALinear(cfg.dim, cfg.heads * cfg.head_dim)
        self.wv = LoRALinear(cfg.dim, cfg.kv_heads * cfg.head_dim)


class LoRAFusedMLP(nn.Module):
    """Phi-3's fused ``gate_up_proj`` (then ``chunk(2)``) with LoRA, as Zamba2's shared blocks add
    their adapters to it, and ``down_proj`` with LoRA (PEFT's ``all-linear``)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.gate_up_proj = LoRALinear(cfg.dim, 2 * cfg.ffn)
        self.down_proj = LoRALinear(cfg.ffn, cfg.dim)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LoRADecoder(Decoder):
    def __init__(self, cfg: Config = Config(heads=8, kv_heads=8)):
        super().__init__(cfg, lambda c: Block(c, LoRAAttention, LoRAFusedMLP))


# --- relative logits per head from a shared table (Inkling) -----------------------------------


class RelativeLogitsAttention(QKVAttention):
    """Inkling's attention bias: each head's ``relative_states`` ([b, s, heads, d_rel], from its own
    projection) times one trained table of bias-vs-distance profiles ``proj [d_rel, extent]``
    shared by every head, gathered at each query-key distance and added to the scores."""

    def __init__(self, cfg: Config, d_rel: int = 8, extent: int = 16):
        super().__init__(cfg)
        self.d_rel, self.extent = d_rel, extent
        self.wr = nn.Linear(cfg.dim, cfg.heads * d_rel, bias=False)
        self.proj = nn.Parameter(torch.randn(d_rel, extent) / d_rel**0.5)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        relative_states = self.wr(x).view(b, s, self.n_heads, self.d_rel)
        rel_logits = (relative_states @ self.proj).transpose(1, 2)  # [b, heads, s, extent]
        positions = torch.arange(s)
        distance = (positions[:, None] - positions[None, :])[None, None, :, :]
        index = distance.clamp(0, self.extent - 1).expand(*rel_logits.shape[:2], -1, -1)
        bias = rel_logits.gather(-1, index).masked_fill((distance < 0) | (distance >= self.extent), 0.0)
        scores = q @ k.transpose(-1, -2) / self.head_dim**0.5 + bias
        scores = scores.masked_fill(distance < 0, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2)
        return self.wo(out.reshape(b, s, -1))


class RelativeLogits(Decoder):
    def __init__(self, cfg: Config = Config(heads=8, kv_heads=8)):
        super().__init__(cfg, lambda c: Block(c, RelativeLogitsAttention))


# --- zero-centred and learned per-head parameters (Gemma, Apertus) ------------------------------


class ZeroCentredRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight stored as an offset from 1 and applied as ``1 + w`` in float32."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim) * 0.1)

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (y * (1.0 + self.weight.float())).type_as(x)


class ZeroCentredQKNormAttention(QKVAttention):
    """Gemma-3's attention: per-head q and k norms whose weights are read as ``1 + w``, and fewer
    k/v heads than q heads given to SDPA as they are (``enable_gqa``)."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.q_norm = ZeroCentredRMSNorm(cfg.head_dim)
        self.k_norm = ZeroCentredRMSNorm(cfg.head_dim)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_norm(self.wq(x).view(b, s, self.n_heads, self.head_dim))
        k = self.k_norm(self.wk(x).view(b, s, self.n_kv, self.head_dim))
        v = self.wv(x).view(b, s, self.n_kv, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
        return self.wo(out.reshape(b, s, -1))


class LearnedActivationMLP(nn.Module):
    """Apertus's xIELU MLP: an activation with two learned scalars, each read through
    ``softplus`` by every element of the cut hidden width."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.dim, bias=False)
        self.alpha_p = nn.Parameter(torch.tensor([0.6]))
        self.alpha_n = nn.Parameter(torch.tensor([0.4]))

    def forward(self, x):
        h = self.up_proj(x)
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = 0.5 + F.softplus(self.alpha_n)
        negative = alpha_n * (torch.expm1(torch.clamp(h, max=0.0)) - h) + 0.5 * h
        h = torch.where(h > 0, alpha_p * h * h + 0.5 * h, negative)
        return self.down_proj(h)


class ZeroCentredQKNorm(Decoder):
    def __init__(self, cfg: Config = Config(heads=8, kv_heads=2)):
        super().__init__(cfg, lambda c: Block(c, ZeroCentredQKNormAttention, LearnedActivationMLP))


# --- gated DeltaNet (Qwen3-Next, Qwen3.5, Kimi-Linear, OLMo-Hybrid) ------------------------------


def causal_conv1d_fn(hidden_states, weight, bias, activation=True):
    """transformers' torch fallback: a depthwise ``conv1d`` over ``[b, channels, s]`` with
    ``groups`` read off the input, padded on the left by its length, then SiLU."""
    _, hidden_size, seq_len = hidden_states.shape
    out = F.conv1d(hidden_states, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1,
                   groups=hidden_size)[:, :, :seq_len]
    return F.silu(out) if activation else out


class GatedRMSNorm(nn.Module):
    """``Qwen3NextRMSNormGated``: an RMSNorm over each head's values, times ``silu(gate)``."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states, gate):
        variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + 1e-6)
        return (self.weight * hidden_states * F.silu(gate.float())).to(gate.dtype)


class GatedDeltaNet(nn.Module):
    """A gated DeltaNet layer as transformers writes its torch path. q, k and v come either from
    separate projections concatenated (``torch.cat((query, key, value), dim=-1)``, Qwen3-Next,
    Kimi-Linear) or from one fused ``in_proj_qkv`` (Qwen3.5); a depthwise causal conv runs over
    their channels and ``torch.split`` takes them back; per head a decay ``g`` from ``A_log`` and
    ``dt_bias``, a chunk's decay mask (``cumsum``, ``tril``, ``exp``) and the gated product; the
    output normed per head on rows folded from ``[b, s, heads, d]``, gated by a flat projection
    reshaped the same way (OLMo-Hybrid)."""

    def __init__(self, cfg: Config, fused: bool, head_dim: int = 8, d_conv: int = 4):
        super().__init__()
        self.heads, self.head_dim, self.fused = cfg.heads, head_dim, fused
        width = cfg.heads * head_dim
        if fused:
            self.in_proj_qkv = nn.Linear(cfg.dim, 3 * width, bias=False)
        else:
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(cfg.dim, width, bias=False) for _ in range(3))
        self.g_proj = nn.Linear(cfg.dim, width, bias=False)
        self.b_proj = nn.Linear(cfg.dim, cfg.heads, bias=False)
        self.a_proj = nn.Linear(cfg.dim, cfg.heads, bias=False)
        self.conv1d = nn.Conv1d(3 * width, 3 * width, d_conv, groups=3 * width, padding=d_conv - 1)
        self.A_log = nn.Parameter(torch.log(torch.linspace(1, 4, cfg.heads)))
        self.dt_bias = nn.Parameter(torch.ones(cfg.heads))
        self.o_norm = GatedRMSNorm(head_dim)
        self.o_proj = nn.Linear(width, cfg.dim, bias=False)

    def forward(self, hidden_states):
        batch_size, seq_len, _ = hidden_states.shape
        width = self.heads * self.head_dim
        if self.fused:
            mixed_qkv = self.in_proj_qkv(hidden_states)
        else:
            query, key, value = (p(hidden_states) for p in (self.q_proj, self.k_proj, self.v_proj))
            mixed_qkv = torch.cat((query, key, value), dim=-1)
        mixed_qkv = causal_conv1d_fn(mixed_qkv.transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias)
        query, key, value = torch.split(mixed_qkv.transpose(1, 2), [width, width, width], dim=-1)
        query, key, value = (x.reshape(batch_size, seq_len, -1, self.head_dim).transpose(1, 2)
                             for x in (query, key, value))
        beta = self.b_proj(hidden_states).sigmoid().transpose(1, 2)
        g = (-self.A_log.float().exp() * F.softplus(self.a_proj(hidden_states).float() + self.dt_bias)).transpose(1, 2)
        dtype = query.dtype  # the chunked rule runs in float32, as transformers' does
        query, key, value, beta = (t.float() for t in (query, key, value, beta))
        query, key = F.normalize(query, dim=-1), F.normalize(key, dim=-1)
        decay = g.cumsum(dim=-1)
        mask = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).tril().exp().tril()
        attn = (query @ key.transpose(-1, -2)) * mask
        output = (attn @ (value * beta.unsqueeze(-1))).transpose(1, 2).to(dtype)
        gate = self.g_proj(hidden_states)
        output = output.reshape(-1, self.head_dim)
        gate = gate.reshape(-1, self.head_dim)
        output = self.o_norm(output, gate)
        return self.o_proj(output.reshape(batch_size, seq_len, -1))


class GatedDeltaNetModel(Decoder):
    def __init__(self, cfg: Config = Config(heads=8, kv_heads=8), fused: bool = False):
        super().__init__(cfg, lambda c: Block(c, lambda c2: GatedDeltaNet(c2, fused)))


# --- dense convolutions over channels (diffusers' ResnetBlock2D) ------------------------------


class ResnetBlock2D(nn.Module):
    """diffusers' ``ResnetBlock2D``: GroupNorm, SiLU, a 3x3 ``conv1``, GroupNorm, SiLU, a 3x3
    ``conv2``, plus the input; here on the token stream folded into a ``[b, C, 4, 4]`` image.
    ``conv1`` is colwise over its output channels and ``conv2`` rowwise over its input channels,
    the GroupNorm between them cut with its groups."""

    def __init__(self, cfg: Config, groups: int = 8):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cfg.dim)
        self.conv1 = nn.Conv2d(cfg.dim, cfg.dim, kernel_size=3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cfg.dim)
        self.conv2 = nn.Conv2d(cfg.dim, cfg.dim, kernel_size=3, padding=1)

    def forward(self, x):
        b, s, c = x.shape
        image = x.transpose(1, 2).reshape(b, c, 4, s // 4)
        hidden = self.conv1(F.silu(self.norm1(image)))
        hidden = self.conv2(F.silu(self.norm2(hidden)))
        return x + hidden.reshape(b, c, s).transpose(1, 2)


class ConvNeXtLayer(nn.Module):
    """transformers' ``ConvNextLayer`` on the token stream folded into a ``[b, C, 4, s/4]`` image: a
    7x7 depthwise conv on the whole stream, a channels-last LayerNorm, then a pointwise MLP
    (linears over the channels), scaled per channel, plus the input."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.dwconv = nn.Conv2d(cfg.dim, cfg.dim, kernel_size=7, padding=3, groups=cfg.dim)
        self.layernorm = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.pwconv1 = nn.Linear(cfg.dim, cfg.ffn)
        self.pwconv2 = nn.Linear(cfg.ffn, cfg.dim)
        self.layer_scale_parameter = nn.Parameter(1e-1 * torch.ones(cfg.dim))

    def forward(self, x):
        b, s, c = x.shape
        image = x.transpose(1, 2).reshape(b, c, 4, s // 4)
        features = self.dwconv(image).permute(0, 2, 3, 1)  # [b, 4, s/4, C]
        features = self.pwconv2(F.gelu(self.pwconv1(self.layernorm(features))))
        features = (self.layer_scale_parameter * features).permute(0, 3, 1, 2)
        return x + features.reshape(b, c, s).transpose(1, 2)


class ConvNeXt(Decoder):
    def __init__(self, cfg: Config = Config(heads=8, kv_heads=8)):  # no attention: heads do not matter
        super().__init__(cfg, ConvNeXtLayer)


class ConvResnet(Decoder):
    def __init__(self, cfg: Config = Config(heads=8, kv_heads=8)):  # no attention: heads do not matter
        super().__init__(cfg, ResnetBlock2D)


# --- grouped 1x1 convolutions in place of linears (SqueezeBERT) --------------------------------


class ChannelsLayerNorm(nn.LayerNorm):
    """A LayerNorm over the channels of ``[b, C, s]``, as SqueezeBERT's: permuted there and back."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 1)).permute(0, 2, 1)


class GroupedConvAttention(nn.Module):
    """SqueezeBERT's self-attention on ``[b, C, s]``: q, k and v are ``Conv1d(kernel_size=1,
    groups=g)``, block-diagonal linears over the channels, each group read from its own input
    channels; heads are views of the channels."""

    def __init__(self, cfg: Config, groups: int):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.query = nn.Conv1d(cfg.dim, cfg.dim, kernel_size=1, groups=groups)
        self.key = nn.Conv1d(cfg.dim, cfg.dim, kernel_size=1, groups=groups)
        self.value = nn.Conv1d(cfg.dim, cfg.dim, kernel_size=1, groups=groups)

    def forward(self, x):
        b, _, s = x.shape
        q = self.query(x).view(b, self.heads, self.head_dim, s).permute(0, 1, 3, 2)  # [b, h, s, d]
        k = self.key(x).view(b, self.heads, self.head_dim, s)  # [b, h, d, s]
        v = self.value(x).view(b, self.heads, self.head_dim, s).permute(0, 1, 3, 2)
        probs = torch.softmax(torch.matmul(q, k) / math.sqrt(self.head_dim), dim=-1)
        context = torch.matmul(probs, v).permute(0, 1, 3, 2).contiguous()  # [b, h, d, s]
        return context.view(b, -1, s)


class GroupedConvBlock(nn.Module):
    """SqueezeBERT's module: grouped q/k/v, a dense ``post_attention`` conv, then a grouped
    ``intermediate`` and ``output`` conv pair, each sublayer post-normed over the channels."""

    def __init__(self, cfg: Config, groups: int = 8):
        super().__init__()
        self.attention = GroupedConvAttention(cfg, groups)
        self.post_attention = nn.Conv1d(cfg.dim, cfg.dim, kernel_size=1)
        self.attention_norm = ChannelsLayerNorm(cfg.dim)
        self.intermediate = nn.Conv1d(cfg.dim, cfg.ffn, kernel_size=1, groups=groups)
        self.output = nn.Conv1d(cfg.ffn, cfg.dim, kernel_size=1, groups=groups)
        self.output_norm = ChannelsLayerNorm(cfg.dim)

    def forward(self, h):
        x = h.permute(0, 2, 1)  # [b, C, s]
        x = self.attention_norm(self.post_attention(self.attention(x)) + x)
        x = self.output_norm(self.output(F.gelu(self.intermediate(x))) + x)
        return x.permute(0, 2, 1)


class GroupedConvEncoder(Decoder):
    """Blocks of grouped convolutions after a BERT embedding (normed before the first block)."""

    def __init__(self, cfg: Config = Config(heads=8, kv_heads=8)):
        super().__init__(cfg, GroupedConvBlock)
        self.embedding_norm = nn.LayerNorm(cfg.dim)

    def forward(self, tokens):
        h = self.embedding_norm(self.tok_embeddings(tokens))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# --- a weight projecting a constant table per head (Funnel, Transformer-XL) ---------------------


class ProjectedPositionAttention(QKVAttention):
    """Funnel's relative positional attention: a sinusoid table projected per head by a 3-D weight
    (``einsum("td,dnh->tnh", r, r_kernel)``), scored against the queries with their own bias, and
    a padding mask made ``type_as`` the embeddings."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.r_kernel = nn.Parameter(torch.randn(cfg.dim, cfg.heads, cfg.head_dim) * 0.02)
        self.r_r_bias = nn.Parameter(torch.randn(cfg.heads, cfg.head_dim) * 0.02)

    def attend(self, q, k, v, position_embeds, attention_mask):
        scale = 1.0 / math.sqrt(self.head_dim)
        q = q * scale
        content = torch.einsum("bind,bjnd->bnij", q, k)
        r_head = torch.einsum("td,dnh->tnh", position_embeds, self.r_kernel)
        positional = torch.einsum("binh,tnh->bnit", q + self.r_r_bias * scale, r_head)
        score = content + positional - 1e6 * (1 - attention_mask[:, None, None])
        return torch.einsum("bnij,bjnd->bind", torch.softmax(score, dim=-1), v)


class ProjectedPositions(Decoder):
    def __init__(self, cfg: Config = Config(heads=8, kv_heads=8)):
        super().__init__(cfg, lambda c: Block(c, ProjectedPositionAttention))

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        seq = torch.arange(tokens.shape[1], dtype=torch.float32, device=tokens.device)
        freq = 1.0 / 10000 ** (torch.arange(0, self.cfg.dim, 2, device=tokens.device) / self.cfg.dim)
        angles = seq[:, None] * freq[None]
        position_embeds = torch.cat([angles.sin(), angles.cos()], dim=-1)
        attention_mask = (tokens != 0).type_as(h)
        for layer in self.layers:
            h = layer(h, position_embeds, attention_mask)
        return self.output(self.norm(h))


# --- a depthwise conv over the heads of the values (Nystromformer) ---------------------------------


class ConvSkipAttention(QKVAttention):
    """Nystromformer's value skip: a depthwise ``Conv2d`` over the heads of ``v`` (``[b, h, s, d]``)
    along the sequence, added to the attention output. Its kernel (65 x 1 in Nystromformer's config,
    33 x 1 here) is longer than short inputs; at tp = heads each rank convolves one head alone."""

    def __init__(self, cfg: Config, kernel: int = 33):
        super().__init__(cfg)
        self.conv = nn.Conv2d(cfg.kv_heads, cfg.kv_heads, (kernel, 1), padding=(kernel // 2, 0), bias=False,
                              groups=cfg.kv_heads)

    def attend(self, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v) + self.conv(v)
        return out.transpose(1, 2)


# --- ConvBERT's mixed attention: a span conv whose kernels a linear makes from every head -----------


class SpanConvAttention(nn.Module):
    """ConvBERT's mixed attention (``head_ratio=2``: half the heads attend, each half as wide): the
    attention heads beside a dynamic span conv whose kernels ``conv_kernel_layer`` computes from every
    head's channels of ``key_conv(x) * query(x)``, applied per head to the unfolded ``conv_out_layer``
    values; both concatenated per head, then one output projection."""

    def __init__(self, cfg: Config, kernel: int = 9):
        super().__init__()
        self.heads = cfg.heads // 2
        self.head_dim = cfg.dim // self.heads // 2
        width = self.heads * self.head_dim
        self.kernel = kernel
        self.query = nn.Linear(cfg.dim, width)
        self.key = nn.Linear(cfg.dim, width)
        self.value = nn.Linear(cfg.dim, width)
        self.depthwise = nn.Conv1d(cfg.dim, cfg.dim, kernel, padding=kernel // 2, groups=cfg.dim, bias=False)
        self.pointwise = nn.Conv1d(cfg.dim, width, 1, bias=False)
        self.key_conv_bias = nn.Parameter(torch.zeros(width, 1))
        self.conv_kernel_layer = nn.Linear(width, self.heads * kernel)
        self.conv_out_layer = nn.Linear(cfg.dim, width)
        self.dense = nn.Linear(2 * width, cfg.dim)

    def forward(self, x):
        b, s, _ = x.shape
        width = self.heads * self.head_dim
        key_conv = (self.pointwise(self.depthwise(x.transpose(1, 2))) + self.key_conv_bias).transpose(1, 2)
        mixed_query = self.query(x)
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2)
                   for t in (mixed_query, self.key(x), self.value(x)))
        conv_kernel = self.conv_kernel_layer(key_conv * mixed_query)
        conv_kernel = torch.softmax(torch.reshape(conv_kernel, [-1, self.kernel, 1]), dim=1)
        conv_out = self.conv_out_layer(x).transpose(1, 2).contiguous().unsqueeze(-1)
        conv_out = F.unfold(conv_out, kernel_size=[self.kernel, 1], padding=[self.kernel // 2, 0])
        conv_out = conv_out.transpose(1, 2).reshape(b, -1, width, self.kernel)
        conv_out = torch.matmul(torch.reshape(conv_out, [-1, self.head_dim, self.kernel]), conv_kernel)
        context = F.scaled_dot_product_attention(q, k, v).permute(0, 2, 1, 3)
        conv_out = torch.reshape(conv_out, [b, -1, self.heads, self.head_dim])
        return self.dense(torch.cat([context, conv_out], 2).reshape(b, s, 2 * width))


# --- code as other libraries write it (an autocast or no-grad region, layers in a ModuleDict, a buffer
# made in forward, torch's MultiheadAttention, a head tied through an attribute, frozen weights) -----


def interleaved_rope_fp32(q, k, seq: int):
    """Meta-Llama style rotary on interleaved pairs, its table built in float32 from ``arange``."""
    d = q.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=q.device).float() / d))
    freqs = torch.outer(torch.arange(seq, device=q.device).float(), inv_freq)
    cos, sin = freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]

    def rotate(t):
        t = t.float()
        even, odd = t[..., 0::2], t[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)

    return rotate(q).type_as(q), rotate(k).type_as(k)


class AutocastRopeAttention(QKVAttention):
    """The rotary embedding kept in float32 by an autocast-disabled region (a ``with`` block)."""

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_kv, self.head_dim)
        v = self.wv(x).view(b, s, self.n_kv, self.head_dim)
        with torch.autocast(device_type=x.device.type, enabled=False):
            q, k = interleaved_rope_fp32(q, k, s)
        return self.wo(self.attend(q, k, v).reshape(b, s, -1))


class AutocastRope(Decoder):
    def __init__(self, cfg: Config = Config()):
        super().__init__(cfg, lambda c: Block(c, AutocastRopeAttention))


class OuterRopeGQAAttention(QKVAttention):
    """Grouped-query attention (SDPA's ``enable_gqa``) with the rotary table built inside from
    ``arange`` and ``outer`` on interleaved pairs: k and v have fewer heads than q."""

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_kv, self.head_dim)
        v = self.wv(x).view(b, s, self.n_kv, self.head_dim)
        q, k = interleaved_rope_fp32(q, k, s)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class OuterRopeGQA(Decoder):
    def __init__(self, cfg: Config = Config(kv_heads=2)):
        super().__init__(cfg, lambda c: Block(c, OuterRopeGQAAttention))


class AutocastScoresAttention(QKVAttention):
    """Attention scores computed under an enabled bfloat16 autocast region inside the forward."""

    def attend(self, q, k, v, *extra):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        causal = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool, device=q.device).tril()
        probs = scores.float().masked_fill(~causal, float("-inf")).softmax(-1).to(v.dtype)
        return (probs @ v).transpose(1, 2)


class AutocastScores(Decoder):
    def __init__(self, cfg: Config = Config()):
        super().__init__(cfg, lambda c: Block(c, AutocastScoresAttention))


class NoGradRotaryTable(nn.Module):
    """A rotary table made under ``@torch.no_grad()``, as Hugging Face's rotary embeddings are."""

    def __init__(self, head_dim: int):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x):
        freqs = torch.outer(torch.arange(x.shape[1], device=x.device).float(), self.inv_freq)
        return freqs.cos(), freqs.sin()


class TableRopeAttention(QKVAttention):
    def attend(self, q, k, v, cos, sin):
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]

        def rotate(t):
            even, odd = t[..., 0::2], t[..., 1::2]
            return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)

        return super().attend(rotate(q), rotate(k), v)


class NoGradRope(Decoder):
    def __init__(self, cfg: Config = Config()):
        super().__init__(cfg, lambda c: Block(c, TableRopeAttention))
        self.rotary = NoGradRotaryTable(cfg.head_dim)

    def extra(self, tokens):
        return self.rotary(self.tok_embeddings.weight[tokens])


class NanoCausalSelfAttention(nn.Module):
    """nanoGPT's attention: one fused ``c_attn`` split into q, k, v, a causal bias registered on
    the first call (older GPT code caches its mask so), biases on every linear."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.n_head, self.n_embd = cfg.heads, cfg.dim
        self.c_attn = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.c_proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x):
        B, T, C = x.size()
        if getattr(self, "bias", None) is None or self.bias.shape[-1] < T:
            self.register_buffer("bias", torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device)),
                                 persistent=False)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.bias[:T, :T], float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoMLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim)
        self.attn = NanoCausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim)
        self.mlp = NanoMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT: its layers in ``transformer.h`` inside a ``ModuleDict`` with the embeddings and the
    last norm; the head tied to the token embedding."""

    def __init__(self, cfg: Config = Config()):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab, cfg.dim),
            wpe=nn.Embedding(cfg.max_seq, cfg.dim),
            drop=nn.Dropout(0.0),
            h=nn.ModuleList([NanoBlock(cfg) for _ in range(cfg.layers)]),
            ln_f=nn.LayerNorm(cfg.dim),
        ))
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class TorchMHABlock(nn.Module):
    """Pre-norm block on ``nn.MultiheadAttention`` (its packed ``in_proj_weight``)."""

    def __init__(self, cfg: Config, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.ln_1 = nn.LayerNorm(cfg.dim)
        self.attn = nn.MultiheadAttention(cfg.dim, cfg.heads, batch_first=batch_first)
        self.ln_2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn), nn.GELU(), nn.Linear(cfg.ffn, cfg.dim))
        mask = torch.triu(torch.full((cfg.max_seq, cfg.max_seq), float("-inf")), 1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        seq = x.shape[1] if self.batch_first else x.shape[0]
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask[:seq, :seq], need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TorchMHA(nn.Module):
    """A decoder of ``TorchMHABlock`` in an ``nn.Sequential``; ``batch_first=False`` runs it
    sequence-first, as torch's default layout is."""

    def __init__(self, cfg: Config = Config(), batch_first: bool = True):
        super().__init__()
        self.cfg, self.batch_first = cfg, batch_first
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.Sequential(*[TorchMHABlock(cfg, batch_first) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = self.blocks(h if self.batch_first else h.transpose(0, 1))
        return self.head(self.ln_f(h if self.batch_first else h.transpose(0, 1)))


class TwoNormParallelBlock(nn.Module):
    """GPT-NeoX's parallel residual: attention and MLP read two norms of one input and are summed
    with it, ``mlp + attn + x``."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.dim)
        self.post_attention_layernorm = nn.LayerNorm(cfg.dim)
        self.attention = QKVAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn, bias=False), nn.GELU(),
                                 nn.Linear(cfg.ffn, cfg.dim, bias=False))

    def forward(self, x):
        attn = self.attention(self.input_layernorm(x))
        mlp = self.mlp(self.post_attention_layernorm(x))
        return mlp + attn + x


class TwoNormParallel(Decoder):
    def __init__(self, cfg: Config = Config()):
        super().__init__(cfg, TwoNormParallelBlock)


class AttributeTiedDecoder(Decoder):
    """The head reads the embedding's weight through a module held as a plain attribute."""

    def __init__(self, cfg: Config = Config()):
        super().__init__(cfg, lambda c: Block(c, QKVAttention))
        del self.output
        self.__dict__["_tied_embedding"] = self.tok_embeddings  # not a submodule: no second FQN

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return F.linear(self.norm(h), self._tied_embedding.weight)


class FrozenEmbeddingDecoder(Decoder):
    """The token embedding, the attention norms and ``wq`` frozen (``requires_grad=False``)."""

    def __init__(self, cfg: Config = Config()):
        super().__init__(cfg, lambda c: Block(c, QKVAttention))
        self.tok_embeddings.weight.requires_grad_(False)
        for layer in self.layers:
            layer.attention_norm.weight.requires_grad_(False)
            layer.attention.wq.weight.requires_grad_(False)


# code as other libraries write it: builder and tp collectives per block at the minimum (by block where
# they differ); with kv heads fewer than tp one more (k and v whole, their gradients gathered)
class PaddingBranchBlock(TorchMHABlock):
    """``TorchMHABlock`` reading a key padding mask, or none."""

    def forward(self, x, padding_mask=None):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, key_padding_mask=padding_mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class PaddingBranchEncoder(nn.Module):
    """fair-esm's encoder: ``padding_mask = tokens.eq(padding_idx)``, padded positions zeroed, then
    ``if not padding_mask.any(): padding_mask = None``, a Python branch on a tensor's value that
    ``torch.export`` cannot trace for every input."""

    padding_idx = 1

    def __init__(self, cfg: Config = Config()):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dim, padding_idx=self.padding_idx)
        self.layers = nn.ModuleList(PaddingBranchBlock(cfg, batch_first=True) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, tokens):
        padding_mask = tokens.eq(self.padding_idx)
        x = self.embed_tokens(tokens)
        x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
        if not padding_mask.any():
            padding_mask = None
        for layer in self.layers:
            x = layer(x, padding_mask)
        return self.lm_head(self.norm(x))


LIBRARY_PATTERNS: dict[str, tuple] = {
    "outer_rope_gqa": (OuterRopeGQA, 4),
    "autocast_rope": (AutocastRope, 4),
    "autocast_scores": (AutocastScores, 4),
    "no_grad_rope": (NoGradRope, 4),
    "nanogpt": (NanoGPT, 4),
    "torch_mha": (TorchMHA, 4),
    "torch_mha_seq_first": (lambda cfg=Config(): TorchMHA(cfg, batch_first=False), 4),
    "two_norm_parallel": (TwoNormParallel, 3),
    "attribute_tied": (AttributeTiedDecoder, 4),
    # block 0 reads the frozen embedding: no gradient of its input to reduce
    "frozen_embedding": (FrozenEmbeddingDecoder, {"layers.0": 3, "layers.1": 4}),
    # captured for the branch its example takes (tests/test_own_models.py: both ways)
    "padding_branch": (PaddingBranchEncoder, 4),
}


PATTERNS = {
    "interleaved_rope": InterleavedRope,
    "repeat_interleave_gqa": RepeatInterleaveGQA,
    "alibi_bias": AlibiBias,
    "sdpa_bias_mask": lambda: AlibiBias(sdpa=True),
    "baddbmm_attention": BaddbmmModel,
    "einsum_attention": EinsumModel,
    "wide_qk_norm": WideQKNorm,
    "wide_qk_layernorm": lambda: WideQKNorm(norm=nn.LayerNorm),
    "parallel_block": ParallelBlock,
    "custom_function": CustomFunctionMLP,
    "moe_indexed": ExpertsMoE,
    "moe_loop": lambda: ExpertsMoE(loop=True),
    "moe_grouped_mm": lambda: ExpertsMoE(experts=GroupedExperts),
    "moe_batched_bmm": lambda: ExpertsMoE(experts=BatchedExperts),
    "moe_interleaved": lambda: ExpertsMoE(Config(heads=8, kv_heads=8), experts=InterleavedExperts),
    "moe_concatenated_experts": lambda: Decoder(Config(heads=8, kv_heads=8),
                                                lambda c: Block(c, QKVAttention, ConcatenatedExpertsMoE)),
    "gated_query_attention": lambda: Decoder(Config(heads=8, kv_heads=8), lambda c: Block(c, GatedQueryAttention)),
    "moe_shared_expert": lambda: Decoder(
        Config(heads=8, kv_heads=8), lambda c: Block(c, QKVAttention, lambda c2: SharedExpertMoE(c2, c2.ffn))),
    "moe_narrow_shared_expert": lambda: Decoder(
        Config(heads=8, kv_heads=8),
        lambda c: Block(c, LowRankLatentAttention, lambda c2: SharedExpertMoE(c2, c2.dim // 2))),
    "vision_fused_qkv": VisionFusedQKV,
    "latent_attention": LatentAttentionModel,
    "low_rank_latent_attention": LowRankLatentAttentionModel,
    "gated_deltanet": GatedDeltaNetModel,
    "conv_resnet": ConvResnet,
    "convnext_layer": ConvNeXt,
    "gated_deltanet_fused": lambda: GatedDeltaNetModel(fused=True),
    "adaln_modulation": AdaLNDecoder,
    "reused_embedder": ReusedEmbedderDiT,
    "shared_layer": SharedLayerDecoder,
    "reference_llama": ReferenceLlama,
    "arange_rope": ArangeRope,
    "fused_qkv_hooks": FusedQKV,
    "slice_filled_keys": SliceFilledKeys,
    "expand_as_mask": ExpandAsMask,
    "grouped_fused_qkv": GroupedFusedQKV,
    "sliced_fused_qkv": SlicedFusedQKV,
    "inserted_dim_multi_query": InsertedDimMultiQuery,
    "indexed_multi_query": IndexedMultiQuery,
    "in_place_parallel": InPlaceParallel,
    "diffusers_dit": DiffusersDiT,
    "flux_single_stream": FluxSingleStream,
    "mamba_mixer": Mamba,
    "normed_mamba_mixer": NormedMamba,
    "mamba2_mixer": Mamba2,
    "mamba2_mixer_groups": lambda: Mamba2(n_groups=8),
    "mup_mamba2_mixer": lambda: Mamba2(mixer=MupMamba2Mixer),
    "lora_adapters": LoRADecoder,
    "relative_logits": RelativeLogits,
    "zero_centred_qk_norm": ZeroCentredQKNorm,
    "grouped_conv_block": GroupedConvEncoder,
    "projected_positions": ProjectedPositions,
    "factorized_shared_layer": FactorizedSharedLayer,
    "conv_value_skip": lambda: Decoder(Config(), lambda c: Block(c, ConvSkipAttention)),
    "span_conv_attention": lambda: Decoder(Config(), lambda c: Block(c, SpanConvAttention)),
}


# patterns whose rows per expert come from the data (``.tolist()``): their plans hold symbolic
# sizes, so they predict how many collectives run but not their bytes
DATA_DEPENDENT_ROWS = frozenset({"moe_concatenated_experts"})


# tp collectives per block (each ``layers.*`` unit) per training step, forward + backward: the
# analytic minimum. A sequential block 2 + 2 (attention output and MLP output all-reduced forward,
# one input gradient per colwise group backward); a parallel block 1 + 1 (one normed input, one
# sum of partial outputs); a norm over a sharded width adds its statistics all-reduce, forward
# and backward (wide q/k norms: 2 norms x 2). A mixture-of-experts block: its experts' gate|up
# (colwise) and down (rowwise) cost what a dense MLP does, 1 + 1, with a narrow router computed
# whole, whether the experts are picked per token (bmm) or run as one grouped GEMM. Top-k
# outputs gathered per (token, choice) are reduced before their routing weights multiply them;
# a loop over experts multiplies each expert's partial output by its routing weight instead, so
# the routing weights' gradient is a sum over the tp-sharded width: one more all-reduce, in
# backward (reducing each expert's output first would cost one per expert).
MINIMUM: dict[str, int | dict[str, int]] = {
    "einsum_attention": 4,
    "interleaved_rope": 4,
    "repeat_interleave_gqa": 4,
    "alibi_bias": 4,
    "sdpa_bias_mask": 4,
    "baddbmm_attention": 4,
    "wide_qk_norm": 8,
    # the same with layer norms: each also all-reduces its mean, forward and backward (2 x 2 more)
    "wide_qk_layernorm": 12,
    "parallel_block": 2,
    "custom_function": 4,
    "moe_indexed": 4,
    "moe_loop": 5,
    "moe_grouped_mm": 4,
    # Llama-4's experts read whole by one bmm each: colwise gate|up, rowwise down, as a dense MLP
    "moe_batched_bmm": 4,
    # gpt-oss's experts: gate and up interleaved in gate_up's columns, so each rank's contiguous
    # share holds whole pairs and slices them as one device does; the per-row gate_up bias picked by
    # expert id is cut with those columns, down's bias added once its output is reduced
    "moe_interleaved": 4,
    # JetMoE's experts: one linear per expert, outputs concatenated over rows, then split into gate
    # and up: input_linear stores its columns in sections as a fused gate|up does; output_linear's
    # partial rows added back into zeros stay partial, reduced once
    "moe_concatenated_experts": 4,
    # DeepSeek-V3's MoE: the routed experts read the flattened input, the shared expert the input as
    # it came, the router (computed whole) the same value: both sharded readers enter tp at that one
    # value, so its gradient is all-reduced once (1); the experts' partial rows, scaled by their
    # routing weights, and the shared expert's partial output are summed, then reduced once (1); the
    # routing weights' gradient is a sum over the cut width (1): attention's 2 and 3
    "moe_shared_expert": 5,
    # the same beside DeepSeek's low-rank latent attention (its down-projections computed whole, 4),
    # with a shared expert narrower than the model: its gate and up are narrowing linears that a
    # plan comparison computing the latent down-projections whole takes along; cut again together,
    # they keep the shared expert cut and no block breaks, at no more collectives
    "moe_narrow_shared_expert": 7,
    # q|gate per head from one projection, the gate read through a cast: a dense block's 4
    "gated_query_attention": 4,
    "reference_llama": 4,
    "arange_rope": 4,
    "fused_qkv_hooks": 4,
    "expand_as_mask": 4,
    "vision_fused_qkv": 4,
    # the latent path (wkv_a, narrowing) is computed whole, replicated work between the normed input
    # and the cut heads: the input's gradient is summed once for wq and the latent path, and the
    # latent path's weights (wkv_a, kv_norm), whose gradients are then partial, in the block's
    # bucket (1 more than a dense block)
    "latent_attention": 5,
    # transformers' DeepSeek-V3 code: both down-projections (q_a_proj, kv_a_proj_with_mqa) computed
    # whole, q_b_proj and kv_b_proj colwise over heads; as above, the kv latent's and the shared
    # rotary key's gradients are each all-reduced, and the q latent's too
    "low_rank_latent_attention": 6,
    # q|k|v through a depthwise conv and back (its channels stored in sections): a dense block's 4,
    # and the per-head output norm's weight, read by every rank's heads: its gradient all-reduced
    "gated_deltanet": 5,
    # conv1 and conv2 cut over channels like a pair of linears, the GroupNorm between them cut with
    # its groups: one forward all-reduce, one backward (as a parallel block's 2)
    "conv_resnet": 2,
    # the depthwise conv computed whole on the replicated stream (per-channel work: a choice, no
    # break), the pointwise MLP colwise then rowwise, the layer scale applied after the reduction
    "convnext_layer": 2,
    "gated_deltanet_fused": 5,
    "adaln_modulation": 4,  # the per-sample modulation computed whole (passes/alternatives.py)
    # block 0 also holds the timestep embedder, run twice (for the blocks and for the head), each
    # run colwise then rowwise: one forward all-reduce per run (its sinusoid input has no gradient)
    "reused_embedder": {"layers.0": 6, "layers.1": 4},
    "shared_layer": {"layers.0": 8},  # one block's weights run twice: 4 per run
    # one fused q|k|v whose k/v heads (2, or 1) are fewer than tp: k and v computed whole and cut
    # per q head, their gradients gathered in one more collective (kv heads % tp adds it, as for
    # separate projections)
    "grouped_fused_qkv": 4,
    "sliced_fused_qkv": 4,
    "inserted_dim_multi_query": 4,
    "indexed_multi_query": 4,
    "in_place_parallel": 2,  # a parallel block: one input gradient, one sum of both partial outputs
    "diffusers_dit": 4,  # the modulation computed whole (passes/alternatives.py), as for adaln_modulation
    # attention and MLP in parallel, concatenated into one proj_out: one input gradient, one output;
    # the per-head q/k RMSNorm weights read by every rank's heads: their gradients all-reduced
    # together, once per block (1 more)
    "flux_single_stream": 3,
    # in_proj's input gradient, x_proj's and out_proj's outputs, and one all-reduce of x_proj's
    # output gradient: the step size, B and C (each read whole by every rank's channels) enter tp
    # together at the split
    "mamba_mixer": 4,
    # the same with a weightless norm on each piece after the split: the norms are replicated
    # work, so the pieces still enter tp together at the split
    "normed_mamba_mixer": 4,
    # 4, and one all-reduce for the block's replicated parameters read by cut values: the q/k
    # norm weights (read as 1 + w) and the activation's two scalars (read through softplus)
    "zero_centred_qk_norm": 5,
    # Mamba-2 with one group of B and C (shared by every head, held whole): in_proj's input gradient,
    # out_proj's output, the gated norm's statistic over the cut width (2), and B.C computed whole
    # for every head and cut per rank's heads, its gradient all-gathered (1)
    "mamba2_mixer": 5,
    "mup_mamba2_mixer": 5,
    # a group per head: B and C cut with the heads, the norm per group: a dense MLP's 2
    "mamba2_mixer_groups": 2,
    # LoRA on q, v, the fused gate|up and down: on the colwise bases each lora_A computed whole, each
    # lora_B colwise (on gate|up in its base's sections), the adapters' input entering tp with the
    # bases'; on down lora_A rowwise and lora_B computed whole on its partial output, reduced with
    # the base's. The weights whose gradients are then partial are summed in the block's bucket (1)
    "lora_adapters": 5,
    # a dense block's 4, and the shared relative-logits table applied whole to each rank's heads:
    # its gradient, a sum over the ranks' heads, all-reduced (1)
    "relative_logits": 5,
    # grouped q/k/v and intermediate convs read their own groups' channels: each takes its chunk of
    # the replicated input, its gradient all-gathered (1 each); the dense post_attention conv is
    # rowwise (1 all-reduce); the grouped output conv closes the MLP, its cut channels all-gathered (1)
    "grouped_conv_block": 4,
    # a dense block's 4: the weight projecting the table is cut with the heads it makes, and so is
    # the queries' per-head bias; the mask made like the embeddings carries no gradient
    "projected_positions": 4,
    # one post-norm layer run twice, 4 per run; it reads the mapped-up embedding cut first: its q/k/v
    # stay colwise (their weights are shared with the later run on the normed stream), so that cut
    # input is gathered for them, its gradient reduce-scattered: the input gradient's one collective
    "factorized_shared_layer": {"layers.0": 8},
    # the depthwise conv over v's heads cut with them (one head per rank at tp=4): a dense block's 4
    "conv_value_skip": 4,
    # ConvBERT's mixed attention computed whole (cut per head, the span-conv kernels made from every
    # head's channels would be reduced and cut back per head: more than they save); its output
    # projection, whose cut output alone would be gathered, computed whole too: the MLP's 2
    "span_conv_attention": 2,
}


def block_minimum(name: str, block: str) -> int:
    """The minimum of ``MINIMUM`` for one ``layers.*`` block of pattern ``name``."""
    minimum = MINIMUM[name]
    return minimum[block] if isinstance(minimum, dict) else minimum



# --- diffusers' DiT as it is wired: the timestep and class-label embedder inside every block ---------


class CombinedTimestepLabelEmbeddings(nn.Module):
    """diffusers' ``CombinedTimestepLabelEmbeddings``: sinusoids -> ``TimestepEmbedding`` (Linear, SiLU,
    Linear) plus ``LabelEmbedding``'s ``embedding_table`` (``num_classes + 1`` rows: the last one is
    classifier-free guidance's dropped label), summed."""

    def __init__(self, num_classes: int, dim: int):
        super().__init__()
        self.timestep_embedder = nn.Sequential(nn.Linear(32, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.embedding_table = nn.Embedding(num_classes + 1, dim)

    def forward(self, timestep, class_labels, hidden_dtype=None):
        freqs = torch.exp(-torch.arange(16, dtype=torch.float32) / 16)
        t = timestep[:, None].float() * freqs
        timesteps_proj = torch.cat([torch.cos(t), torch.sin(t)], dim=-1)
        timesteps_emb = self.timestep_embedder(timesteps_proj.to(dtype=hidden_dtype))
        return timesteps_emb + self.embedding_table(class_labels)


class LabelAdaLayerNormZero(AdaLayerNormZero):
    """``AdaLayerNormZero(dim, num_embeddings)``: the block embeds timestep and label itself,
    ``emb = self.linear(self.silu(self.emb(timestep, class_labels)))``."""

    def __init__(self, dim: int, num_classes: int):
        super().__init__(dim)
        self.emb = CombinedTimestepLabelEmbeddings(num_classes, dim)

    def forward(self, x, timestep, class_labels):
        return super().forward(x, self.emb(timestep, class_labels, hidden_dtype=x.dtype))


class LabelDiTBlock(DiTBlock):
    def __init__(self, cfg: Config, num_classes: int = 10):
        super().__init__(cfg)
        self.norm1 = LabelAdaLayerNormZero(cfg.dim, num_classes)

    def forward(self, hidden_states, timestep, class_labels):
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, timestep, class_labels)
        hidden_states = gate_msa.unsqueeze(1) * self.attn1(norm_hidden_states) + hidden_states
        norm_hidden_states = self.norm2(hidden_states) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return gate_mlp.unsqueeze(1) * self.ff(norm_hidden_states) + hidden_states


class LabelConditionedDiT(nn.Module):
    """diffusers' ``DiTTransformer2DModel``: every block embeds the timestep and the class label
    (a table of 11 rows, fewer than its features), and the output head calls block 0's embedder
    again, ``self.transformer_blocks[0].norm1.emb(timestep, class_labels)``, for its shift and scale."""

    def __init__(self, cfg: Config = Config(heads=8, kv_heads=8)):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(LabelDiTBlock(cfg) for _ in range(cfg.layers))
        self.norm_out = nn.LayerNorm(cfg.dim, elementwise_affine=False, eps=1e-6)
        self.proj_out_1 = nn.Linear(cfg.dim, 2 * cfg.dim)
        self.proj_out_2 = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, tokens):
        hidden_states = self.tok_embeddings(tokens)
        timestep, class_labels = tokens[:, 0] % 10, tokens[:, 1] % 10
        for layer in self.layers:
            hidden_states = layer(hidden_states, timestep, class_labels)
        conditioning = self.layers[0].norm1.emb(timestep, class_labels, hidden_dtype=hidden_states.dtype)
        shift, scale = self.proj_out_1(F.silu(conditioning)).chunk(2, dim=1)
        hidden_states = self.norm_out(hidden_states) * (1 + scale[:, None]) + shift[:, None]
        return self.proj_out_2(hidden_states)


PATTERNS["label_conditioned_dit"] = LabelConditionedDiT
# each block's timestep embedder colwise then rowwise (1: its sinusoid input has no gradient), its
# 11-row label table computed whole (a lookup: no collective), the modulation computed whole, the
# attention and MLP 4; block 0's embedder runs again for the output head (1 more)
MINIMUM["label_conditioned_dit"] = {"layers.0": 6, "layers.1": 5}


# --- timm's EVA: a fused q|k|v whose bias is a concatenation, k's a zeros buffer ----------------------


class EvaAttention(nn.Module):
    """timm's ``EvaAttention`` with ``qkv_fused=True``: ``qkv`` has no bias of its own, the bias is
    ``torch.cat((self.q_bias, self.k_bias, self.v_bias))`` with ``k_bias`` a non-persistent zeros
    buffer, passed to ``F.linear(x, weight=self.qkv.weight, bias=qkv_bias)``; heads by
    ``reshape(B, N, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)``."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.num_heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.q_bias = nn.Parameter(torch.randn(cfg.dim) * 0.02)
        self.register_buffer("k_bias", torch.zeros(cfg.dim), persistent=False)
        self.v_bias = nn.Parameter(torch.randn(cfg.dim) * 0.02)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
        q, k, v = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


PATTERNS["eva_concatenated_qkv_bias"] = lambda: Decoder(Config(heads=8, kv_heads=8),
                                                        lambda c: Block(c, EvaAttention))
# a dense block's 4: q_bias and v_bias stored cut with their sections, the zeros buffer cut per rank
MINIMUM["eva_concatenated_qkv_bias"] = 4


# --- GPT-NeoX's parallel residual with biases on the rowwise linears ---------------------------------


class BiasedTwoNormParallelBlock(TwoNormParallelBlock):
    """GPT-NeoX's block as it ships (``bias=True`` everywhere): ``mlp + attn + x`` where attention's
    output projection and the MLP's down projection each add a bias."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.attention.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=True)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn), nn.GELU(), nn.Linear(cfg.ffn, cfg.dim))


PATTERNS["biased_two_norm_parallel"] = lambda: Decoder(Config(), BiasedTwoNormParallelBlock)
# as without biases: both norms' input gradients (2) and one all-reduce of the two partial outputs
# summed before their biases are added (1)
MINIMUM["biased_two_norm_parallel"] = 3


# --- litgpt's LoRALinear: the adapters as matmuls by transposed parameters ----------------------------


class LitLoRALinear(nn.Module):
    """litgpt's ``LoRALinear``: ``lora = (x @ self.lora_A.transpose(0, 1) @ self.lora_B.transpose(0, 1))
    * self.scaling`` added to ``self.linear(x)``; the adapters are parameters read by matmuls."""

    def __init__(self, in_features: int, out_features: int, r: int = 4, lora_alpha: float = 8.0):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.lora_A = nn.Parameter(torch.randn(r, in_features) / math.sqrt(in_features))
        self.lora_B = nn.Parameter(torch.randn(out_features, r) * 0.02)  # litgpt starts it at zero; trained, it is not
        self.scaling = lora_alpha / r

    def forward(self, x):
        pretrained = self.linear(x)
        lora = (x @ self.lora_A.transpose(0, 1) @ self.lora_B.transpose(0, 1)) * self.scaling
        return pretrained + lora


class LitLoRAAttention(QKVAttention):
    """LoRA on q, v and the output projection (litgpt's ``lora_query``, ``lora_value``, ``lora_projection``)."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.wq = LitLoRALinear(cfg.dim, cfg.heads * cfg.head_dim)
        self.wv = LitLoRALinear(cfg.dim, cfg.kv_heads * cfg.head_dim)
        self.wo = LitLoRALinear(cfg.heads * cfg.head_dim, cfg.dim)


class LitLoRAMLP(SwiGLU):
    """litgpt's ``LLaMAMLP`` with ``lora_mlp``: LoRA on ``fc_1``, ``fc_2`` and ``proj``."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.w1 = LitLoRALinear(cfg.dim, cfg.ffn)
        self.w3 = LitLoRALinear(cfg.dim, cfg.ffn)
        self.w2 = LitLoRALinear(cfg.ffn, cfg.dim)


PATTERNS["litgpt_lora_adapters"] = lambda: Decoder(Config(heads=8, kv_heads=8),
                                                   lambda c: Block(c, LitLoRAAttention, LitLoRAMLP))
# as PEFT's adapters (lora_adapters): on the rowwise wo and w2, lora_A rowwise and lora_B computed whole
# on its partial input, reduced with its base; the adapters' partial weight gradients in one bucket (1)
MINIMUM["litgpt_lora_adapters"] = 5


class GroupedEvaAttention(nn.Module):
    """EVA's concatenated q|k|v bias on a grouped-query fused projection: ``F.linear(x, qkv.weight,
    torch.cat((q_bias, k_bias, v_bias)))`` with ``k_bias`` a zeros buffer, then
    ``split([q, kv, kv], -1)``; with kv heads fewer than tp, k and v (and their bias pieces) whole."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.dim, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.q_bias = nn.Parameter(torch.randn(cfg.heads * cfg.head_dim) * 0.02)
        self.register_buffer("k_bias", torch.zeros(cfg.kv_heads * cfg.head_dim), persistent=False)
        self.v_bias = nn.Parameter(torch.randn(cfg.kv_heads * cfg.head_dim) * 0.02)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = F.linear(x, weight=self.qkv.weight, bias=torch.cat((self.q_bias, self.k_bias, self.v_bias)))
        kv_size = self.n_kv * self.head_dim
        q, k, v = qkv.split([self.n_heads * self.head_dim, kv_size, kv_size], dim=-1)
        q = q.view(B, N, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, N, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(B, N, self.n_kv, self.head_dim).transpose(1, 2)
        x = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


PATTERNS["grouped_concatenated_qkv_bias"] = lambda: Decoder(Config(heads=8, kv_heads=2),
                                                            lambda c: Block(c, GroupedEvaAttention))
# a dense block's 4 (one more where kv heads are fewer than tp: k and v whole, their bias pieces read
# whole, the zeros buffer's too)
MINIMUM["grouped_concatenated_qkv_bias"] = 4


# --- DeepSeek-V3.2's sparse-attention indexer: per-head scores weighted and summed over heads ---------


class HeadWeightedIndexerAttention(QKVAttention):
    """A lightning indexer as DeepSeek-V3.2 writes it: under ``@torch.no_grad()``, every index head
    scores each key with ``relu(q_h . k)``, a per-token head weight mixes them
    (``weights.unsqueeze(-2) @ scores``: the heads contracted), and each query attends only to its
    top-k causal keys."""

    def __init__(self, cfg: Config, topk: int = 8):
        super().__init__(cfg)
        self.topk = topk
        self.index_q = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=False)
        self.index_k = nn.Linear(cfg.dim, cfg.head_dim, bias=False)
        self.index_weights = nn.Linear(cfg.dim, cfg.heads, bias=False)

    @torch.no_grad()
    def select(self, x):
        b, s, _ = x.shape
        q = self.index_q(x).view(b, s, self.n_heads, self.head_dim)
        k = self.index_k(x)  # [b, s, d]: one key head
        scores = F.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)))  # [b, s, h, t]
        weights = self.index_weights(x) * self.n_heads ** -0.5  # [b, s, h]
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [b, s, t]
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        index_scores = index_scores.masked_fill(~causal, float("-inf"))
        chosen = index_scores.topk(min(self.topk, s), dim=-1).indices
        selected = torch.zeros(b, s, s, dtype=torch.bool, device=x.device).scatter(-1, chosen, True)
        return selected & causal

    def attend(self, q, k, v, *extra):
        raise AssertionError("forward attends itself")

    def forward(self, x):
        b, s, _ = x.shape
        mask = self.select(x).unsqueeze(1)  # [b, 1, s, t]
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


PATTERNS["head_weighted_indexer"] = lambda: Decoder(Config(heads=8, kv_heads=8),
                                                    lambda c: Block(c, HeadWeightedIndexerAttention))
# a dense block's 4: the indexer makes no gradient (its region is no-grad), and its projections are
# small enough to compute whole (cut, its head-weighted sum would be one all-reduce more)
MINIMUM["head_weighted_indexer"] = 4
