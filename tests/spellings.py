"""The same blocks written in many spellings: a generator of models that compute one function.

A plan must follow what an op does to a cut dim, not how the code writes it. So each block
family here is one piece of math (a Llama-style decoder block, a mixture of experts, a tied
output head, ...) and a set of *axes* of spelling: how a linear is written (``nn.Linear``,
``F.linear``, ``@``, ``matmul``, ``einsum`` with and without ``...``, ``tensordot``, ``mm`` on a
flattened input, a weight stored ``[in, out]``), how heads are split and merged (``view``,
``reshape``, ``unflatten``, ``einops.rearrange``), transposed (``transpose``, ``permute``,
``movedim``), how a fused projection is cut apart (``split``, ``chunk``, slicing, ``unbind``),
how kv heads are repeated, how rotary embeddings, norms and attention are written, and in which
container the blocks sit. A :class:`Spelling` picks one option per axis; :func:`spellings` lists
every option of every axis against the family's reference, then seeded random combinations.

Every spelling of a family computes the reference's function (same parameters, same values,
checked on one device by ``tests/test_spellings.py``), so its plan must cost the reference's tp
collectives per block with no break, and it must be proven. ``benchmarks/spellings.py`` runs the
whole set and reports the spellings that cost more, with the op and line the plan names.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Callable

import einops
import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, HEADS, HEAD_DIM, HIDDEN, SEQ, BATCH = 64, 8, 8, 128, 16, 2


@dataclasses.dataclass(frozen=True)
class Spelling:
    """One way of writing a family's block: ``choices`` maps each axis to its option."""

    family: str
    choices: tuple[tuple[str, str], ...]

    @property
    def name(self) -> str:
        return self.family + ":" + ",".join(f"{a}={o}" for a, o in self.choices)

    def __getitem__(self, axis: str) -> str:
        return dict(self.choices)[axis]

    def build(self) -> nn.Module:
        """The model, its parameters drawn from a fixed seed (the same for every spelling of a family)."""
        return FAMILIES[self.family].build(self)

    def inputs(self) -> tuple:
        return FAMILIES[self.family].inputs()


@dataclasses.dataclass(frozen=True)
class Family:
    """A block's math, its spelling axes (the first option of each is the reference) and a builder."""

    axes: dict[str, tuple[str, ...]]
    build: Callable[[Spelling], nn.Module]
    inputs: Callable[[], tuple]
    kv_heads: int = HEADS

    def reference(self, name: str) -> Spelling:
        return Spelling(name, tuple((axis, options[0]) for axis, options in self.axes.items()))


def spellings(family: str, combined: int = 0, seed: int = 0) -> list[Spelling]:
    """The reference, each option of each axis alone, then ``combined`` seeded random combinations
    of every axis (without repeats)."""
    fam = FAMILIES[family]
    ref = fam.reference(family)
    out = [ref]
    for axis, options in fam.axes.items():
        for option in options[1:]:
            out.append(Spelling(family, tuple((a, option if a == axis else o) for a, o in ref.choices)))
    rng = random.Random(seed)
    seen = {s.choices for s in out}
    total = math.prod(len(o) for o in fam.axes.values())
    while combined and len(seen) < total:
        choices = tuple((axis, rng.choice(options)) for axis, options in fam.axes.items())
        if _valid(family, dict(choices)) and choices not in seen:
            seen.add(choices)
            out.append(Spelling(family, choices))
            combined -= 1
    return [s for s in out if _valid(family, dict(s.choices))]


def _valid(family: str, choices: dict) -> bool:
    """Options that only exist together: an ``unbind`` of q|k|v needs as many kv heads as q heads."""
    kv = FAMILIES[family].kv_heads
    if choices.get("qkv") in ("fused_unbind", "fused_chunk") and kv != HEADS:
        return False
    return not (choices.get("kv_repeat", "sdpa_gqa") != "sdpa_gqa" and kv == HEADS)


# ---------------------------------------------------------------------------------------------
# linears


def drawn(d_out: int, d_in: int) -> torch.Tensor:
    """A weight ``[out, in]`` drawn from the global generator: every spelling draws the same ones in
    the same order, whatever it then stores."""
    return torch.randn(d_out, d_in) / math.sqrt(d_in)


class Weight(nn.Module):
    """A linear's weight ``[out, in]``, read as the spelling writes the product. ``in_out`` spellings
    store it ``[in, out]`` (GPT-2's ``Conv1D``), the others ``[out, in]`` (``nn.Linear``): the values
    are the same either way, so every spelling computes one function."""

    def __init__(self, spelling: str, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.spelling = spelling
        d_out, d_in = weight.shape
        if spelling == "module":
            state = torch.get_rng_state()  # nn.Linear's own init draws nothing the other spellings draw
            self.linear = nn.Linear(d_in, d_out, bias=bias is not None)
            torch.set_rng_state(state)
            with torch.no_grad():
                self.linear.weight.copy_(weight)
                if bias is not None:
                    self.linear.bias.copy_(bias)
            return
        self.weight = nn.Parameter(weight.t().contiguous() if spelling in IN_OUT else weight.clone())
        self.bias = None if bias is None else nn.Parameter(bias.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spelling
        if s == "module":
            return self.linear(x)
        w, b = self.weight, self.bias
        if s == "functional":
            return F.linear(x, w, b)
        if s == "addmm" and b is not None:
            return torch.addmm(b, x.reshape(-1, x.shape[-1]), w.t()).view(*x.shape[:-1], -1)
        if s in ("matmul_t", "addmm"):
            y = x @ w.T
        elif s == "matmul_fn":
            y = torch.matmul(x, w.transpose(0, 1))
        elif s == "mm_flat":
            y = torch.mm(x.reshape(-1, x.shape[-1]), w.t()).view(*x.shape[:-1], -1)
        elif s == "einsum":
            y = torch.einsum("bsd,od->bso", x, w) if x.dim() == 3 else torch.einsum("...d,od->...o", x, w)
        elif s == "einsum_ellipsis":
            y = torch.einsum("...d,od->...o", x, w)
        elif s == "einsum_weight_first":
            y = torch.einsum("od,...d->...o", w, x)
        elif s == "tensordot":
            y = torch.tensordot(x, w, dims=([x.dim() - 1], [1]))
        elif s == "in_out":
            y = x @ w
        elif s == "in_out_einsum":
            y = torch.einsum("...i,io->...o", x, w)
        elif s == "in_out_matmul":
            y = torch.matmul(x, w)
        else:
            raise ValueError(s)
        return y if b is None else y + b


IN_OUT = ("in_out", "in_out_einsum", "in_out_matmul")
LINEARS = ("module", "functional", "matmul_t", "matmul_fn", "einsum", "einsum_ellipsis", "einsum_weight_first",
           "tensordot", "mm_flat", "addmm", "in_out", "in_out_einsum", "in_out_matmul")


# ---------------------------------------------------------------------------------------------
# attention pieces


def split_heads(x: torch.Tensor, heads: int, how: str) -> torch.Tensor:
    """``[b, s, h*d] -> [b, s, h, d]``."""
    b, s, _ = x.shape
    if how == "view":
        return x.view(b, s, heads, -1)
    if how == "reshape":
        return x.reshape(b, s, heads, x.shape[-1] // heads)
    if how == "unflatten":
        return x.unflatten(-1, (heads, -1))
    if how == "rearrange":
        return einops.rearrange(x, "b s (h d) -> b s h d", h=heads)
    raise ValueError(how)


def to_heads_first(x: torch.Tensor, how: str) -> torch.Tensor:
    """``[b, s, h, d] -> [b, h, s, d]``."""
    if how == "transpose":
        return x.transpose(1, 2)
    if how == "permute":
        return x.permute(0, 2, 1, 3)
    if how == "movedim":
        return x.movedim(2, 1)
    if how == "swapaxes":
        return x.swapaxes(1, 2)
    raise ValueError(how)


def merge_heads(x: torch.Tensor, how: str) -> torch.Tensor:
    """``[b, h, s, d] -> [b, s, h*d]``."""
    b, h, s, d = x.shape
    if how == "reshape":
        return x.transpose(1, 2).reshape(b, s, h * d)
    if how == "contiguous_view":
        return x.transpose(1, 2).contiguous().view(b, s, -1)
    if how == "flatten":
        return x.permute(0, 2, 1, 3).flatten(2)
    if how == "rearrange":
        return einops.rearrange(x, "b h s d -> b s (h d)")
    raise ValueError(how)


def rope_tables(seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(seq).float(), inv)  # [s, d/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, how: str) -> torch.Tensor:
    """Rotary embedding on ``[b, h, s, d]``, rotating pairs ``(x[2i], x[2i+1])``: one function,
    written over real pairs, as a complex multiply, over halves of a de-interleaved copy, or into a
    buffer filled slice by slice. The
    tables (float32 buffers) are cast to ``x``'s dtype, as models do to run under bf16."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if how == "pairs":
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    if how == "complex":
        z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        rot = torch.polar(torch.ones_like(cos.float()), torch.atan2(sin.float(), cos.float()))
        return torch.view_as_real(z * rot).flatten(-2).type_as(x)
    if how == "unflatten_pairs":
        pairs = x.unflatten(-1, (-1, 2))
        x1, x2 = pairs.unbind(-1)
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if how == "filled_buffer":  # each pair's two halves copied into a fresh buffer, as DeepSeek-V3 builds its keys
        x1, x2 = x[..., ::2], x[..., 1::2]
        out = x.new_empty(*x1.shape, 2)
        out[..., :1].copy_((x1 * cos - x2 * sin).unsqueeze(-1))
        out[..., 1:].copy_((x1 * sin + x2 * cos).unsqueeze(-1))
        return out.flatten(-2)
    raise ValueError(how)


def repeat_kv(x: torch.Tensor, n: int, how: str) -> torch.Tensor:
    """``[b, kv, s, d] -> [b, kv*n, s, d]``, each kv head for ``n`` consecutive q heads."""
    if n == 1 or how == "sdpa_gqa":
        return x
    if how == "repeat_interleave":
        return x.repeat_interleave(n, dim=1)
    if how == "expand_reshape":
        b, kv, s, d = x.shape
        return x[:, :, None, :, :].expand(b, kv, n, s, d).reshape(b, kv * n, s, d)
    if how == "einops_repeat":
        return einops.repeat(x, "b kv s d -> b (kv n) s d", n=n)
    raise ValueError(how)


def attend(q, k, v, how: str) -> torch.Tensor:
    """Causal attention on ``[b, h, s, d]`` (k/v with fewer heads only for ``sdpa`` with GQA)."""
    if how == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    s = q.shape[-2]
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    if how == "softmax":
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~mask, float("-inf"))
        return scores.softmax(-1) @ v
    if how == "einsum":
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
        scores = scores + torch.zeros(s, s, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        return torch.einsum("bhqk,bhkd->bhqd", F.softmax(scores, dim=-1), v)
    raise ValueError(how)


def norm(x: torch.Tensor, weight: torch.Tensor, how: str) -> torch.Tensor:
    """RMS norm over the last dim, several ways."""
    if how == "rms_hand":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    if how == "rms_fn":
        return F.rms_norm(x, (x.shape[-1],), weight, eps=1e-6)
    if how == "rms_float":
        h = x.float()
        return (h * torch.rsqrt(h.square().mean(dim=-1, keepdim=True) + 1e-6)).type_as(x) * weight
    if how == "rms_norm_div":
        return weight * (x / torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6))
    raise ValueError(how)


# ---------------------------------------------------------------------------------------------
# the Llama-style block


class Attention(nn.Module):
    def __init__(self, sp: Spelling, kv_heads: int):
        super().__init__()
        self.sp, self.kv = sp, kv_heads
        lin, how = sp["linear"], sp["qkv"]
        q, k, v = drawn(HEADS * HEAD_DIM, DIM), drawn(kv_heads * HEAD_DIM, DIM), drawn(kv_heads * HEAD_DIM, DIM)
        if how == "separate":
            self.wq, self.wk, self.wv = Weight(lin, q), Weight(lin, k), Weight(lin, v)
        elif how == "kv_fused":
            self.wq, self.wkv = Weight(lin, q), Weight(lin, torch.cat([k, v]))
        elif how == "grouped":
            per_group = [w.view(kv_heads, -1, DIM) for w in (q, k, v)]
            self.wqkv = Weight(lin, torch.cat(per_group, dim=1).reshape(-1, DIM))
        else:
            self.wqkv = Weight(lin, torch.cat([q, k, v]))
        self.wo = Weight(lin, drawn(DIM, HEADS * HEAD_DIM))
        cos, sin = rope_tables(SEQ, HEAD_DIM)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def project(self, x):
        """q, k, v as ``[b, s, heads, d]``."""
        sp, how, kv, q_width = self.sp, self.sp["qkv"], self.kv, HEADS * HEAD_DIM
        kv_width = kv * HEAD_DIM
        if how == "separate":
            return (split_heads(self.wq(x), HEADS, sp["heads"]), split_heads(self.wk(x), kv, sp["heads"]),
                    split_heads(self.wv(x), kv, sp["heads"]))
        if how == "kv_fused":
            k, v = self.wkv(x).view(*x.shape[:-1], 2, kv, HEAD_DIM).unbind(2)
            return split_heads(self.wq(x), HEADS, sp["heads"]), k, v
        qkv = self.wqkv(x)
        if how == "fused_split":
            q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        elif how == "fused_slice":
            q, k, v = qkv[..., :q_width], qkv[..., q_width:q_width + kv_width], qkv[..., q_width + kv_width:]
        elif how == "fused_chunk":
            q, k, v = qkv.chunk(3, dim=-1)
        elif how == "fused_unbind":
            return qkv.view(*x.shape[:-1], 3, HEADS, HEAD_DIM).unbind(2)
        elif how == "grouped":
            # each kv group's q heads, k and v stored together (GPT-NeoX / Megatron's grouped layout)
            group = HEADS // kv
            g = qkv.view(*x.shape[:-1], kv, group + 2, HEAD_DIM)
            q, k, v = g.split([group, 1, 1], dim=-2)
            return q.reshape(*x.shape[:-1], HEADS, HEAD_DIM), k.squeeze(-2), v.squeeze(-2)
        else:
            raise ValueError(how)
        return split_heads(q, HEADS, sp["heads"]), split_heads(k, kv, sp["heads"]), split_heads(v, kv, sp["heads"])

    def forward(self, x):
        sp = self.sp
        q, k, v = (to_heads_first(t, sp["transpose"]) for t in self.project(x))
        q, k = (apply_rope(t, self.cos, self.sin, sp["rope"]) for t in (q, k))
        k, v = (repeat_kv(t, HEADS // self.kv, sp["kv_repeat"]) for t in (k, v))
        if sp["attention"] != "sdpa" and k.shape[1] != HEADS:
            k, v = (t.repeat_interleave(HEADS // self.kv, dim=1) for t in (k, v))
        return self.wo(merge_heads(attend(q, k, v, sp["attention"]), sp["merge"]))


class MLP(nn.Module):
    def __init__(self, sp: Spelling):
        super().__init__()
        self.sp, lin = sp, sp["linear"]
        gate, up, down = drawn(HIDDEN, DIM), drawn(HIDDEN, DIM), drawn(DIM, HIDDEN)
        if sp["mlp"] in ("swiglu", "swiglu_functional"):
            self.w1, self.w3 = Weight(lin, gate), Weight(lin, up)
        else:
            self.w13 = Weight(lin, torch.cat([gate, up]))
        self.w2 = Weight(lin, down)

    def forward(self, x):
        how = self.sp["mlp"]
        if how == "swiglu":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        if how == "swiglu_functional":
            gate = self.w1(x)
            return self.w2(gate * torch.sigmoid(gate) * self.w3(x))
        fused = self.w13(x)
        if how == "fused_chunk":
            gate, up = fused.chunk(2, dim=-1)
        elif how == "fused_split":
            gate, up = torch.split(fused, HIDDEN, dim=-1)
        elif how == "fused_slice":
            gate, up = fused[..., :HIDDEN], fused[..., HIDDEN:]
        elif how == "fused_unbind":
            gate, up = fused.unflatten(-1, (2, HIDDEN)).unbind(-2)
        else:
            raise ValueError(how)
        return self.w2(F.silu(gate) * up)


class LlamaBlock(nn.Module):
    def __init__(self, sp: Spelling, kv_heads: int):
        super().__init__()
        self.sp = sp
        self.attention_norm = nn.Parameter(1 + 0.1 * torch.randn(DIM))
        self.ffn_norm = nn.Parameter(1 + 0.1 * torch.randn(DIM))
        self.attention, self.feed_forward = Attention(sp, kv_heads), MLP(sp)

    def forward(self, x):
        how = self.sp["norm"]
        h = x + self.attention(norm(x, self.attention_norm, how))
        return h + self.feed_forward(norm(h, self.ffn_norm, how))


class Stack(nn.Module):
    """Blocks in a container, called as the spelling says."""

    def __init__(self, sp: Spelling, make_block: Callable[[], nn.Module], depth: int = 2):
        super().__init__()
        self.how = sp["container"]
        blocks = [make_block() for _ in range(depth)]
        if self.how == "module_list":
            self.layers = nn.ModuleList(blocks)
        elif self.how == "module_dict":
            self.layers = nn.ModuleDict({f"block{i}": b for i, b in enumerate(blocks)})
        elif self.how == "sequential":
            self.layers = nn.Sequential(*blocks)
        elif self.how == "nested":
            self.stages = nn.ModuleList([nn.ModuleDict({"block": b}) for b in blocks])
        elif self.how == "closure":
            self.layers = nn.ModuleList(blocks)
            self.calls = [lambda x, b=b: b(x) for b in self.layers]
        else:
            raise ValueError(self.how)
        self.final_norm = nn.Parameter(torch.ones(DIM))

    def forward(self, x):
        return self.finish(self.run(x))

    def finish(self, x):
        return F.rms_norm(x, (DIM,), self.final_norm, eps=1e-6)

    def run(self, x):
        if self.how in ("module_list", "sequential") and isinstance(self.layers, nn.Sequential):
            x = self.layers(x)
        elif self.how == "module_list":
            for block in self.layers:
                x = block(x)
        elif self.how == "module_dict":
            for block in self.layers.values():
                x = block(x)
        elif self.how == "nested":
            for stage in self.stages:
                x = stage["block"](x)
        else:
            for call in self.calls:
                x = call(x)
        return x


LLAMA_AXES = {
    "linear": LINEARS,
    "heads": ("view", "reshape", "unflatten", "rearrange"),
    "transpose": ("transpose", "permute", "movedim", "swapaxes"),
    "merge": ("reshape", "contiguous_view", "flatten", "rearrange"),
    "rope": ("pairs", "complex", "unflatten_pairs", "filled_buffer"),
    "attention": ("sdpa", "softmax", "einsum"),
    "norm": ("rms_hand", "rms_fn", "rms_float", "rms_norm_div"),
    "mlp": ("swiglu", "swiglu_functional", "fused_chunk", "fused_split", "fused_slice", "fused_unbind"),
    "container": ("module_list", "module_dict", "sequential", "nested", "closure"),
}


def _llama(kv_heads: int, qkv: tuple[str, ...], kv_repeat: tuple[str, ...]) -> Family:
    axes = dict(LLAMA_AXES, qkv=qkv, kv_repeat=kv_repeat)

    def build(sp: Spelling) -> nn.Module:
        torch.manual_seed(0)
        return Stack(sp, lambda: LlamaBlock(sp, kv_heads))

    return Family(axes, build, lambda: (torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1)),),
                  kv_heads)


MHA_QKV = ("separate", "fused_split", "fused_slice", "fused_chunk", "fused_unbind", "kv_fused", "grouped")
GQA_QKV = ("separate", "fused_split", "fused_slice", "kv_fused", "grouped")
KV_REPEATS = ("sdpa_gqa", "repeat_interleave", "expand_reshape", "einops_repeat")

# ---------------------------------------------------------------------------------------------
# a language model whose output head is its embedding (tied), one MLP block between


VOCAB = 96


class TiedLM(nn.Module):
    """Embedding, one pre-norm MLP block, a final norm and the embedding read again as the head,
    written as the spelling says."""

    def __init__(self, sp: Spelling):
        super().__init__()
        self.sp = sp
        self.embed = nn.Embedding(VOCAB, DIM)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(VOCAB, DIM) * 0.5)
        self.layers = nn.ModuleList([MLPBlock(sp) for _ in range(2)])
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(DIM))
        if sp["head"] == "module":
            state = torch.get_rng_state()
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            torch.set_rng_state(state)
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        how = self.sp["lookup"]
        if how == "module":
            x = self.embed(tokens)
        elif how == "functional":
            x = F.embedding(tokens, self.embed.weight)
        elif how == "index":
            x = self.embed.weight[tokens]
        else:
            raise ValueError(how)
        for layer in self.layers:
            x = layer(x)
        x = norm(x, self.norm, "rms_hand")
        w, head = self.embed.weight, self.sp["head"]
        if head == "functional":
            return F.linear(x, w)
        if head == "module":
            return self.head(x)
        if head == "matmul_t":
            return x @ w.T
        if head == "matmul_fn":
            return torch.matmul(x, w.t())
        if head == "einsum":
            return torch.einsum("bsd,vd->bsv", x, w)
        if head == "cast":
            return (x.float() @ w.float().T).type_as(x)
        raise ValueError(head)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, how: str) -> torch.Tensor:
    """Layer norm over the last dim, several ways."""
    if how == "module_fn":
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps=1e-5)
    if how == "hand":
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5) * weight + bias
    if how == "var":
        mean = x.mean(dim=-1, keepdim=True)
        return (x - mean) * torch.rsqrt(x.var(dim=-1, keepdim=True, unbiased=False) + 1e-5) * weight + bias
    if how == "var_mean":
        var, mean = torch.var_mean(x, dim=-1, keepdim=True, correction=0)
        return torch.addcmul(bias, (x - mean) * (var + 1e-5).rsqrt(), weight)
    raise ValueError(how)


class MLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(layer_norm(x))))`` with biases."""

    def __init__(self, sp: Spelling):
        super().__init__()
        self.sp, lin = sp, sp["linear"]
        self.norm_weight = nn.Parameter(1 + 0.1 * torch.randn(DIM))
        self.norm_bias = nn.Parameter(0.1 * torch.randn(DIM))
        self.fc1 = Weight(lin, drawn(HIDDEN, DIM), 0.1 * torch.randn(HIDDEN))
        self.fc2 = Weight(lin, drawn(DIM, HIDDEN), 0.1 * torch.randn(DIM))

    def forward(self, x):
        h = layer_norm(x, self.norm_weight, self.norm_bias, self.sp["layer_norm"])
        how = self.sp["activation"]
        h = self.fc1(h)
        if how == "gelu":
            h = F.gelu(h)
        elif how == "module":
            h = nn.GELU()(h)
        elif how == "erf":
            h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
        else:
            raise ValueError(how)
        return x + self.fc2(h)


def _tied() -> Family:
    axes = {"head": ("functional", "module", "matmul_t", "matmul_fn", "einsum", "cast"),
            "lookup": ("module", "functional", "index"),
            "linear": ("module", "functional", "einsum", "in_out", "addmm", "tensordot"),
            "layer_norm": ("module_fn", "hand", "var", "var_mean"),
            "activation": ("gelu", "module", "erf")}

    def build(sp: Spelling) -> nn.Module:
        torch.manual_seed(0)
        return TiedLM(sp)

    return Family(axes, build,
                  lambda: (torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)),))


# ---------------------------------------------------------------------------------------------
# per-head projections and a chunkwise recurrence over heads


class PerHeadBlock(nn.Module):
    """A block whose heads each carry their own small projection ``W [heads, d, d]`` (block-diagonal
    over heads, as per-head q/k transforms and multi-head state-space mixers store them), then a
    chunkwise linear recurrence over the sequence per head, then the output projection."""

    CHUNK = 4

    def __init__(self, sp: Spelling):
        super().__init__()
        self.sp, lin = sp, sp["linear"]
        self.w_in = Weight(lin, drawn(HEADS * HEAD_DIM, DIM))
        self.per_head = nn.Parameter(torch.randn(HEADS, HEAD_DIM, HEAD_DIM) / math.sqrt(HEAD_DIM))
        self.decay_logit = nn.Parameter(torch.randn(HEADS))
        self.w_out = Weight(lin, drawn(DIM, HEADS * HEAD_DIM))
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(DIM))

    def project(self, x):
        """``[b, s, h, d] x W[h, o, d] -> [b, s, h, o]``."""
        w, how = self.per_head, self.sp["per_head"]
        if how == "einsum":
            return torch.einsum("bshd,hod->bsho", x, w)
        if how == "einsum_ellipsis":
            return torch.einsum("...hd,hod->...ho", x, w)
        if how == "matmul":
            return (x.unsqueeze(-2) @ w.transpose(-1, -2)).squeeze(-2)
        if how == "bmm":
            b, s, h, d = x.shape
            y = torch.bmm(x.permute(2, 0, 1, 3).reshape(h, b * s, d), w.transpose(1, 2))
            return y.view(h, b, s, -1).permute(1, 2, 0, 3)
        if how == "sum":
            return (x.unsqueeze(-2) * w).sum(-1)
        raise ValueError(how)

    def recur(self, v, decay):
        """``state_t = decay * state_{t-1} + v_t`` per head over ``[b, s, h, d]``, in chunks."""
        how, b, s, h, d = self.sp["recurrence"], *v.shape
        if how == "cumsum":  # vectorized: the same sum, written as a weighted cumulative sum
            t = torch.arange(s, dtype=v.dtype)
            weights = decay[None, None, :] ** (t[:, None, None] - t[None, :, None])  # [t, u, h]
            mask = (t[:, None] >= t[None, :]).to(v.dtype)[..., None]
            return torch.einsum("tuh,buhd->bthd", weights * mask, v)
        state = v.new_zeros(b, h, d)
        outs = []
        out_buffer = v.new_zeros(b, s, h, d) if how == "index_put" else None
        for start in range(0, s, self.CHUNK):
            chunk = v[:, start:start + self.CHUNK]
            steps = []
            for i in range(chunk.shape[1]):
                state = decay[None, :, None] * state + chunk[:, i]
                steps.append(state)
            block = torch.stack(steps, dim=1)
            if how == "index_put":
                out_buffer[:, start:start + self.CHUNK] = block
            else:
                outs.append(block)
        if how == "index_put":
            return out_buffer
        if how == "stack":
            return torch.stack(outs, dim=1).flatten(1, 2)
        if how == "cat":
            return torch.cat(outs, dim=1)
        raise ValueError(how)

    def forward(self, x):
        h = norm(x, self.norm, "rms_hand")
        v = split_heads(self.w_in(h), HEADS, self.sp["heads"])
        v = self.project(v)
        v = self.recur(v, torch.sigmoid(self.decay_logit))
        return x + self.w_out(v.flatten(2))


def _per_head() -> Family:
    axes = {"per_head": ("einsum", "einsum_ellipsis", "matmul", "bmm", "sum"),
            "recurrence": ("stack", "cat", "index_put", "cumsum"),
            "linear": ("module", "functional", "einsum", "in_out", "mm_flat"),
            "heads": ("view", "reshape", "unflatten", "rearrange"),
            "container": ("module_list", "module_dict", "sequential", "nested", "closure")}

    def build(sp: Spelling) -> nn.Module:
        torch.manual_seed(0)
        return Stack(sp, lambda: PerHeadBlock(sp))

    return Family(axes, build, lambda: (torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1)),))


# ---------------------------------------------------------------------------------------------
# a convolutional block over channels: [b, c, h, w]


class ChannelBlock(nn.Module):
    """``x + pw2(gelu(pw1(norm_over_channels(x))))`` on a ``[b, c, h, w]`` map, pointwise
    projections over channels written as 1x1 convolutions, einsums or linears on a channels-last
    view."""

    def __init__(self, sp: Spelling):
        super().__init__()
        self.sp = sp
        self.norm_weight = nn.Parameter(1 + 0.1 * torch.randn(DIM))
        self.norm_bias = nn.Parameter(0.1 * torch.randn(DIM))
        self.w1, self.b1 = nn.Parameter(drawn(HIDDEN, DIM)), nn.Parameter(0.1 * torch.randn(HIDDEN))
        self.w2, self.b2 = nn.Parameter(drawn(DIM, HIDDEN)), nn.Parameter(0.1 * torch.randn(DIM))

    def pointwise(self, x, w, b):
        how = self.sp["pointwise"]
        if how == "conv":
            return F.conv2d(x, w[:, :, None, None], b)
        if how == "einsum":
            return torch.einsum("bchw,oc->bohw", x, w) + b[:, None, None]
        if how == "channels_last":
            return F.linear(x.permute(0, 2, 3, 1), w, b).permute(0, 3, 1, 2)
        if how == "movedim":
            return (x.movedim(1, -1) @ w.T + b).movedim(-1, 1)
        raise ValueError(how)

    def forward(self, x):
        how = self.sp["channel_norm"]
        if how == "hand":
            mean = x.mean(1, keepdim=True)
            var = (x - mean).pow(2).mean(1, keepdim=True)
            h = (x - mean) / torch.sqrt(var + 1e-5) * self.norm_weight[:, None, None] + self.norm_bias[:, None, None]
        elif how == "permuted":
            h = F.layer_norm(x.permute(0, 2, 3, 1), (DIM,), self.norm_weight, self.norm_bias, 1e-5).permute(0, 3, 1, 2)
        else:
            raise ValueError(how)
        return x + self.pointwise(F.gelu(self.pointwise(h, self.w1, self.b1)), self.w2, self.b2)


def _channels() -> Family:
    axes = {"pointwise": ("conv", "einsum", "channels_last", "movedim"),
            "channel_norm": ("hand", "permuted"),
            "container": ("module_list", "module_dict", "sequential", "nested", "closure")}

    def build(sp: Spelling) -> nn.Module:
        torch.manual_seed(0)
        return ChannelStack(sp)

    return Family(axes, build, lambda: (torch.randn(BATCH, DIM, 4, 4, generator=torch.Generator().manual_seed(1)),))


class ChannelStack(Stack):
    def __init__(self, sp: Spelling):
        super().__init__(sp, lambda: ChannelBlock(sp))

    def finish(self, x):
        return F.rms_norm(x.movedim(1, -1), (DIM,), self.final_norm, eps=1e-6)  # over channels


FAMILIES: dict[str, Family] = {
    "llama_mha": _llama(HEADS, MHA_QKV, ("sdpa_gqa",)),
    "llama_gqa": _llama(2, GQA_QKV, KV_REPEATS),
    "llama_mqa": _llama(1, GQA_QKV, KV_REPEATS),
    "tied_lm": _tied(),
    "per_head": _per_head(),
    "channels": _channels(),
}


def all_spellings(combined_per_family: int = 20, seed: int = 0) -> list[Spelling]:
    """Every family's one-axis spellings and ``combined_per_family`` combinations each."""
    return list(itertools.chain.from_iterable(spellings(f, combined_per_family, seed) for f in FAMILIES))
