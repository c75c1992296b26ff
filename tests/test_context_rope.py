"""Context parallelism follows every value built from sequence positions, however the code builds it.

Rotary tables as public code writes them: Meta's reference Llama (``torch.outer`` of ``arange(s)`` and
the inverse frequencies, interleaved pairs rotated with ``x[..., 0::2]`` and
``torch.stack(..., -1).flatten(-2)``, or complex numbers with ``torch.polar`` and ``view_as_complex``),
``einsum("i,j->ij")``, a broadcast product ``t[:, None] * inv[None, :]``, Hugging Face's
``rotate_half`` over ``cat((freqs, freqs), -1)``, and positions taken from the data, which the cut
reaches before the table is built. Each is proven on one process (every cp rank simulated) against
one device, on ``cp4``, ``dp2 x cp2`` and ``cp2 x tp2``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from tests.pattern_models import VOCAB, Block, Config, Decoder, QKVAttention

CFG = Config(kv_heads=2)  # dim 64, 4 heads over 2 kv heads, vocab 128, 2 layers
MESHES = ({"cp": 4}, {"dp": 2, "cp": 2}, {"cp": 2, "tp": 2})
TOL = 1e-5


def _tokens(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))


def _proven(model, mesh, tokens):
    proof = autoshard.check(model, mesh, example_inputs=(tokens,))
    assert proof.ok, proof
    assert proof.outputs and proof.gradients
    worst = max(m.error for m in (*proof.outputs, *proof.gradients))
    assert worst <= TOL, f"{worst:.2e} from one device"
    predicted = proof.plan.predicted_comm()
    assert predicted["cp"] == proof.cp_collectives  # what the simulated ranks ran
    if "tp" in mesh:
        assert predicted["tp"] == proof.tp_collectives
    return proof


# --- rotary tables built inside attention, as public code writes them ------------------------------


class MetaRopeAttention(QKVAttention):
    """Meta-Llama style: the table built here from ``arange(s)`` with ``torch.outer``, applied to
    interleaved pairs."""

    def freqs(self, s, device):
        d = self.head_dim
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device).float() / d))
        return torch.outer(torch.arange(s, device=device).float(), inv_freq)

    def rotate(self, q, k, s, device):
        freqs = self.freqs(s, device)
        cos, sin = freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]

        def rot(t):
            t1, t2 = t[..., 0::2], t[..., 1::2]
            return torch.stack((t1 * cos - t2 * sin, t1 * sin + t2 * cos), -1).flatten(-2)

        return rot(q), rot(k)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, -1)
        k = self.wk(x).view(b, s, self.n_kv, -1)
        v = self.wv(x).view(b, s, self.n_kv, -1)
        q, k = self.rotate(q, k, s, x.device)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class AutocastRopeAttention(MetaRopeAttention):
    """The same rotation in float32 inside an autocast-disabled region."""

    def rotate(self, q, k, s, device):
        with torch.autocast(device_type=device.type, enabled=False):
            q, k = super().rotate(q.float(), k.float(), s, device)
        return q, k


class EinsumRopeAttention(MetaRopeAttention):
    def freqs(self, s, device):
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim))
        t = torch.arange(s, device=device).float()
        return torch.einsum("i,j->ij", t, inv_freq)


class BroadcastRopeAttention(MetaRopeAttention):
    def freqs(self, s, device):
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim))
        t = torch.arange(s, device=device, dtype=torch.float32)
        return t[:, None] * inv_freq[None, :]


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis, x):
    shape = [d if i == 1 or i == x.ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class ComplexRopeAttention(MetaRopeAttention):
    """Meta's ``precompute_freqs_cis`` (``torch.polar``) for this sequence, and ``apply_rotary_emb``."""

    def rotate(self, q, k, s, device):
        return apply_rotary_emb(q, k, precompute_freqs_cis(self.head_dim, s).to(device))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class RotateHalfAttention(QKVAttention):
    """Hugging Face style on ``[b, h, s, d]``: ``cat((freqs, freqs), -1)`` and ``rotate_half``, the
    positions cast with ``type_as(x)``."""

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, -1).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv, -1).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv, -1).transpose(1, 2)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, device=x.device).float() / self.head_dim))
        t = torch.arange(s, device=x.device).type_as(x)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None, :, :], emb.sin()[None, None, :, :]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


def _decoder(attention):
    return lambda: Decoder(CFG, lambda c: Block(c, attention))


# --- tables built outside attention --------------------------------------------------------------


class MetaFreqsCisAttention(QKVAttention):
    def forward(self, x, freqs_cis):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, -1)
        k = self.wk(x).view(b, s, self.n_kv, -1)
        v = self.wv(x).view(b, s, self.n_kv, -1)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class MetaLlama(Decoder):
    """Meta's Transformer: a complex ``freqs_cis`` for twice the longest sequence, sliced per call."""

    def __init__(self, cfg: Config = CFG):
        super().__init__(cfg, lambda c: Block(c, MetaFreqsCisAttention))
        self.register_buffer("freqs_cis", precompute_freqs_cis(cfg.head_dim, cfg.max_seq * 2), persistent=False)

    def extra(self, tokens):
        return (self.freqs_cis[: tokens.shape[1]],)


class DataPositionAttention(QKVAttention):
    """ChatGLM-style learnable inverse frequencies, read with positions taken from the data: the cut
    enters the positions where they meet the parameter, and the table is built from cut positions
    (``einsum``, ``torch.polar``, complex rotation)."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.inv_freq = nn.Parameter(1.0 / (10000 ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)))

    def forward(self, x, position_ids):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, -1)
        k = self.wk(x).view(b, s, self.n_kv, -1)
        v = self.wv(x).view(b, s, self.n_kv, -1)
        freqs = torch.einsum("bs,d->bsd", position_ids.float(), self.inv_freq)
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs)[:, :, None, :]  # [b, s, 1, d / 2]
        q_ = torch.view_as_complex(q.float().reshape(b, s, self.n_heads, -1, 2))
        k_ = torch.view_as_complex(k.float().reshape(b, s, self.n_kv, -1, 2))
        q = torch.view_as_real(q_ * freqs_cis).flatten(3).type_as(x)
        k = torch.view_as_real(k_ * freqs_cis).flatten(3).type_as(x)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class DataPositions(Decoder):
    def __init__(self, cfg: Config = CFG, pad_id: int = -1):
        super().__init__(cfg, lambda c: Block(c, DataPositionAttention))
        self.pad_id = pad_id

    def extra(self, tokens):
        return ((tokens != self.pad_id).long().cumsum(-1) - 1,)  # positions as from a padding mask


MODELS = {
    "meta_outer_interleaved": _decoder(MetaRopeAttention),
    "autocast_disabled": _decoder(AutocastRopeAttention),
    "einsum": _decoder(EinsumRopeAttention),
    "broadcast_product": _decoder(BroadcastRopeAttention),
    "complex_polar": _decoder(ComplexRopeAttention),
    "hf_rotate_half": _decoder(RotateHalfAttention),
    "meta_freqs_cis_buffer": MetaLlama,
    "positions_from_data": DataPositions,
}


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(f"{a}{n}" for a, n in m.items()))
@pytest.mark.parametrize("name", list(MODELS))
def test_rotary_tables_are_proven_on_cp_meshes(name, mesh):
    torch.manual_seed(0)
    proof = _proven(MODELS[name](), mesh, _tokens())
    assert len(proof.plan.context.attention) == 2
    assert proof.plan.context.gathered_whole == ()  # no position table read whole: each rank builds its own


def test_positions_from_data_are_cut_before_the_table_is_built():
    from autoshard.passes.capture import capture
    from autoshard.passes.cut_sequence import cut_sequence

    torch.manual_seed(0)
    captured = capture(DataPositions(), (_tokens(),), {}, None, None, True)
    cut_sequence(captured.gm, 16, 4, "cp", set(captured.param_shapes))
    einsums = [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.einsum.default]
    assert len(einsums) == 2
    for node in einsums:  # [batch, seq / cp, head_dim / 2]: built from this rank's positions only
        assert tuple(node.meta["val"].shape) == (2, 4, 8)
        assert node.args[1][0].target is torch.ops.aten.index_select.default


# --- the rules, one op each ---------------------------------------------------------------------


class PositionOps(nn.Module):
    """Not public code: each op's rule on a cut operand, proven. ``t`` holds one value per position
    (cut on dim 0); ``outer`` keeps it on either side, a matmul of a whole matrix with it keeps it on
    the output's columns, ``repeat`` and ``tile`` of the cut dim hold it several times over, and an
    ``einsum`` with an ellipsis keeps the sequence's subscript."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.w = nn.Parameter(torch.randn(dim // 2))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)                                    # [b, s, 16]
        s = h.shape[1]
        t = h.mean(-1)[0]                                         # [s]
        rows = torch.cat([torch.outer(t, self.w), torch.outer(self.w, t).t()], -1)  # [s, 16]
        cols = (self.w[:, None] @ t[None, :]).t()                 # [s, 8]
        twice = cols.repeat(2, 1).view(2, s, -1).sum(0)           # [s, 8]
        tiled = torch.tile(twice, (1, 2))                         # [s, 16]
        mixed = torch.einsum("...sd,s->...sd", h, t.sigmoid())    # [b, s, 16]
        return self.head(mixed + rows + tiled)


@pytest.mark.parametrize("mesh", [{"cp": 4}, {"cp": 2, "tp": 2}], ids=["cp4", "cp2xtp2"])
def test_outer_einsum_matmul_and_repeat_keep_the_cut(mesh):
    torch.manual_seed(0)
    proof = _proven(PositionOps(), mesh, _tokens())
    assert proof.plan.context.gathered_whole == ()


class DifferentlyCut(nn.Module):
    """Two operands of one sum cut along the same dim in different ways: ``pairs`` holds each position's
    two halves next to each other (a view merged them in), ``twice`` the whole sequence twice over
    (``repeat``). ``twice`` is read whole and indexed as ``pairs`` is cut."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)                                    # [b, s, 16]
        b, s, d = h.shape
        pairs = h.reshape(b, 2 * s, d // 2)                       # [b, 2s, 8]: position p at 2p, 2p + 1
        twice = h.repeat(1, 2, 1)[..., : d // 2]                  # [b, 2s, 8]: position p at p, s + p
        return self.head((pairs + twice).reshape(b, s, d))


def test_operands_cut_differently_are_read_whole_and_indexed_alike():
    torch.manual_seed(0)
    _proven(DifferentlyCut(), {"cp": 4}, _tokens())


# --- an op the cut cannot follow --------------------------------------------------------------


@torch.library.custom_op("test_context_rope::fused_rotary", mutates_args=())
def fused_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A fused rotary kernel (as flash-attn's or Liger's): opaque to autoshard."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


@fused_rotary.register_fake
def _(x, cos, sin):
    return torch.empty_like(x)


class FusedRopeAttention(MetaRopeAttention):
    def rotate(self, q, k, s, device):
        freqs = self.freqs(s, device)
        cos, sin = freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]
        return fused_rotary(q, cos, sin), fused_rotary(k, cos, sin)


def test_an_opaque_rotary_kernel_is_refused_naming_it():
    """What an opaque op does along the sequence is unknown (which rows of the table each row reads):
    the cut cannot follow it, and the error names the node and its source line."""
    model = _decoder(FusedRopeAttention)()
    tokens = _tokens()
    model(tokens)  # runs on one device
    named = r"no rule for node 'fused_rotary' \(fused_rotary\.default\) at test_context_rope\.py:\d+ `"
    with pytest.raises(NotImplementedError, match=named):
        autoshard.plan(model, {"cp": 2}, example_inputs=(tokens,))


class RolledPositions(nn.Module):
    """``torch.roll(h, 2, 1)``: shifts before dims, both positional."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens):
        return self.head(torch.roll(self.embed(tokens), 2, 1))


def test_an_op_mixing_positions_is_read_by_its_argument_names():
    """``roll(x, shifts, dims)``'s dims are its third argument (its second is how far): rolled along the
    sequence, it reads its input whole."""
    torch.manual_seed(0)
    proof = _proven(RolledPositions(), {"cp": 2}, _tokens())
    assert proof.plan.context.gathered_whole == (("roll", "roll.default along the sequence"),)


# --- attention outputs and norms as torchtune and x-transformers write them ------------------------


class TorchtuneAttention(QKVAttention):
    """torchtune's ``MultiHeadAttention.forward``: ``[b, h, s, d]`` after SDPA, then
    ``output.transpose(1, 2).contiguous().view(b, s_x, -1)``. SDPA returns a layout whose transpose
    is contiguous already, so torch.export drops ``.contiguous()``; the cut's causal attention returns
    ``[b, h, s, d]`` contiguous, on which the view cannot be a view: it becomes a reshape."""

    def forward(self, x):
        b, s_x, _ = x.shape
        q = self.wq(x).view(b, s_x, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s_x, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s_x, self.n_kv, self.head_dim).transpose(1, 2)
        output = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        output = output.transpose(1, 2).contiguous().view(b, s_x, -1)
        return self.wo(output)


class QKNormAttention(QKVAttention):
    """x-transformers' ``attn_qk_norm``: ``F.normalize(t, dim=-1) * scale * gamma`` on ``[b, h, s, d]``
    queries and keys. ``F.normalize`` divides by ``norm(keepdim=True).clamp_min(eps).expand_as(t)``:
    an ``expand_as`` of a value cut along the sequence to the shape of another, cut alike."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.q_gamma = nn.Parameter(torch.rand(self.head_dim) + 0.5)
        self.k_gamma = nn.Parameter(torch.rand(self.head_dim) + 0.5)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, -1).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv, -1).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv, -1).transpose(1, 2)
        q, k = F.normalize(q, dim=-1) * 4.0 * self.q_gamma, F.normalize(k, dim=-1) * 4.0 * self.k_gamma
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=1.0)
        return self.wo(o.transpose(1, 2).contiguous().view(b, s, -1))


class ExpandAsWhole(Decoder):
    """``expand_as`` with one side whole: a padding gate from the token ids (whole, ``[b, s, 1]``)
    expanded to the hidden states (cut), and each position's mean (cut) expanded to the shape of a
    position table (whole, ``[b, s, dim]``)."""

    def __init__(self, cfg: Config = CFG):
        super().__init__(cfg, lambda c: Block(c, QKNormAttention))
        self.pos = nn.Parameter(torch.randn(cfg.max_seq, cfg.dim) * 0.02)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        b, s = tokens.shape
        gate = (tokens != 0).unsqueeze(-1).to(h.dtype)                    # whole, holding the sequence
        table = self.pos[:s].unsqueeze(0).expand(b, -1, -1)               # whole, [b, s, dim]
        h = h * gate.expand_as(h) + h.mean(-1, keepdim=True).expand_as(table) * 0.1
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


EXPORTED_MODELS = {
    "torchtune_contiguous_view": _decoder(TorchtuneAttention),
    "xtransformers_qk_norm": _decoder(QKNormAttention),
    "expand_as_one_side_whole": ExpandAsWhole,
}


@pytest.mark.parametrize("mesh", [{"cp": 2}, {"cp": 4}, {"cp": 2, "tp": 2}], ids=["cp2", "cp4", "cp2xtp2"])
@pytest.mark.parametrize("name", list(EXPORTED_MODELS))
def test_contiguous_views_and_expand_as_are_proven(name, mesh):
    torch.manual_seed(0)
    proof = _proven(EXPORTED_MODELS[name](), mesh, _tokens())
    assert len(proof.plan.context.attention) == 2
    assert proof.plan.context.gathered_whole == ()


def test_a_view_the_local_layout_cannot_take_becomes_a_reshape():
    """The attention output's view (export dropped the ``.contiguous()`` before it) is a reshape in the
    cut graph; the views the local layout can take stay views."""
    from autoshard.passes.capture import capture
    from autoshard.passes.cut_sequence import cut_sequence

    torch.manual_seed(0)
    captured = capture(_decoder(TorchtuneAttention)(), (_tokens(),), {}, None, None, True)
    before = {n.name: n.target for n in captured.gm.graph.nodes}
    assert torch.ops.aten.contiguous.default not in before.values()  # what the bug needs: export dropped it
    cut_sequence(captured.gm, 16, 2, "cp", set(captured.param_shapes))
    changed = [n for n in captured.gm.graph.nodes if before.get(n.name) is torch.ops.aten.view.default
               and n.target is torch.ops.aten.reshape.default]
    assert len(changed) == 2  # one per layer: the attention output
    for node in changed:
        assert node.args[0].target is torch.ops.aten.transpose.int
        assert tuple(node.meta["val"].shape) == (2, 8, 64)
    assert any(n.target is torch.ops.aten.view.default for n in captured.gm.graph.nodes)


def test_errors_leaving_the_cut_are_named():
    """Nothing torch or Python raises leaves the cut unwrapped: an op torch cannot run on the local
    shapes is a ``NotImplementedError`` naming it and its source line; a failure at a node the cut
    inserted, or inside a rule, an ``InternalError`` naming the node."""
    from autoshard.core.errors import InternalError
    from autoshard.passes import cut_sequence as context
    from autoshard.passes.capture import capture
    from autoshard.passes.local_shapes import refresh_shapes

    torch.manual_seed(0)

    def captured():
        return capture(_decoder(TorchtuneAttention)(), (_tokens(),), {}, None, None, True).gm

    gm = captured()
    context.cut_sequence(gm, 16, 2, "cp", set())  # no parameter: nothing is cut, shapes stay whole
    view = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default)
    view.args = (view.args[0], [3, -1, 7])  # as if a rule had left the shape of another length
    with pytest.raises(NotImplementedError, match=r"cannot run node 'view\w*' \(view.default\) at "
                                                  r"test_context_rope\.py:\d+ `.*`.*RuntimeError"):
        refresh_shapes(gm)
    with pytest.raises(InternalError, match=r"stage 'cut the sequence' at node 'view\w*'"):
        refresh_shapes(gm, {view})  # a node the cut inserted: autoshard's bug

    def broken_rule(self, node):
        raise ValueError("zip() argument 2 is longer than argument 1")  # Python's, not a refusal

    gm = captured()
    params = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(context._Rewriter, "_norm", broken_rule)
        with pytest.raises(InternalError, match=r"at node 'rms_norm\w*' .*ValueError: zip\(\)"):
            context.cut_sequence(gm, 16, 2, "cp", params)
