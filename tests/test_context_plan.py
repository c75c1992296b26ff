"""Context parallelism in one process: the sequence cut over cp, proven over simulated cp ranks.

Every model here is unmodified code (this project's example Llama, Hugging Face decoders, small
modules written the way public code writes attention). Training on real ranks is in
``tests/test_context_parallel.py``; the full parity matrix in ``make cp-parity``.
"""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers as hf

import autoshard
from autoshard import Plan
from autoshard.passes.capture import capture
from autoshard.passes.cut_sequence import cut_sequence
from autoshard.proof.context_proof import attention_work
from autoshard.runtime.context_ops import local_positions, to_global_order, to_rank_order
from examples.models import Llama, LlamaConfig
from tests import hf_cases

MESHES = ({"cp": 4}, {"dp": 2, "cp": 2}, {"cp": 2, "tp": 2}, {"dp": 2, "cp": 2, "tp": 2}, {"cp": 2, "tp": 4},
          {"cp": 2, "tp": 8}, {"dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 2})


def _ids(vocab: int, batch: int = 3, seq: int = 48, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _proven(model, mesh, ids, kwargs=None, **options):
    proof = autoshard.check(model, mesh, example_inputs=(ids,), example_kwargs=kwargs, **options)
    assert proof.ok, proof
    assert proof.outputs and proof.gradients
    return proof


def test_positions_are_balanced_and_gathers_restore_sequence_order():
    seq, cp = 32, 4
    ranks = [local_positions(r, cp, seq) for r in range(cp)]
    assert ranks[0].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    assert ranks[3].tolist() == [12, 13, 14, 15, 16, 17, 18, 19]
    assert sorted(torch.cat(ranks).tolist()) == list(range(seq))
    whole = torch.arange(seq).float().view(1, seq, 1)
    gathered = torch.cat([whole[:, p] for p in ranks], dim=1)  # what an all-gather of the ranks' parts holds
    assert torch.equal(to_global_order(gathered, 1, cp), whole)
    assert torch.equal(to_rank_order(whole, 1, cp), gathered)


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(f"{a}{n}" for a, n in m.items()))
def test_example_llama_is_proven_on_every_cp_mesh(mesh):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(max_seq_len=64, num_heads=8))  # 8 heads over 2 kv heads: fewer kv heads than tp
    proof = _proven(model, mesh, _ids(256))
    plan = proof.plan
    # one result type on every axis: the cp ranks are counted beside the tp ones
    assert isinstance(proof, autoshard.Proof) and (proof.cp, proof.tp) == (mesh["cp"], mesh.get("tp", 1))
    assert str(proof).startswith(f"autoshard proof on cp={mesh['cp']} x tp={mesh.get('tp', 1)}: proven")
    assert plan.context.cp == mesh["cp"] and len(plan.context.attention) == 2
    predicted = plan.predicted_comm()
    assert predicted["cp"] == proof.cp_collectives  # what the simulated ranks ran, cp x tp ones included
    if "tp" in mesh:
        assert predicted["tp"] == proof.tp_collectives
        assert "tp breaks: 0 of 2 blocks" in str(plan)  # kv heads fewer than tp=4 included


@pytest.mark.parametrize("mesh", [m for m in MESHES if "tp" in m],
                         ids=lambda m: "x".join(f"{a}{n}" for a, n in m.items()))
def test_sequence_parallelism_composes_with_cp(mesh):
    """Inside each cp rank's share of the sequence, tp cuts the residual stream over the sequence
    between blocks: every rowwise all-reduce a reduce-scatter, every colwise input an all-gather."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(max_seq_len=64, num_heads=8))
    proof = _proven(model, mesh, _ids(256), sequence_parallel=True)
    predicted = proof.plan.predicted_comm()
    assert predicted["tp"] == proof.tp_collectives and predicted["cp"] == proof.cp_collectives
    assert predicted["tp"]["reduce_scatter"][0] >= 4 and predicted["tp"]["all_gather"][0] >= 4, predicted["tp"]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["lp", "lp_sp"])
@pytest.mark.parametrize("mesh", [{"cp": 2, "tp": 2}, {"dp": 2, "cp": 4, "tp": 2}], ids=["cp2xtp2", "dp2xcp4xtp2"])
def test_loss_parallelism_composes_with_cp(mesh, sequence_parallel):
    """The logits leave cut over the vocabulary on tp (gathered over cp, or left cut there too):
    the LM head stays colwise and no tp all-gather of the logits is planned or run."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(max_seq_len=64, num_heads=8))
    proof = _proven(model, mesh, _ids(256, seq=64), loss_parallel=True, sequence_parallel=sequence_parallel)
    head = proof.plan.params["output.weight"]
    assert head.role == "colwise" and any("loss parallel" in str(c) for c in head.collectives), head
    assert proof.plan.predicted_comm()["tp"] == proof.tp_collectives


@pytest.mark.parametrize(("family", "mesh"), [("_llama", {"cp": 4}), ("_qwen2", {"dp": 2, "cp": 2}),
                                              ("_mistral", {"cp": 2, "tp": 2})], ids=lambda x: str(x))
def test_hugging_face_decoders_are_proven_unmodified(family, mesh):
    """Each family on one mesh here; every family on every mesh in ``make cp-parity``."""
    torch.manual_seed(0)
    _proven(getattr(hf_cases, family)(), mesh, _ids(hf_cases.VOCAB))


def test_encoder_with_a_pooler_and_a_mixture_of_experts():
    """BERT: bidirectional attention under a padding mask, a pooler reading position 0 (read whole);
    Qwen3-MoE: top-k routing over experts keeps the cut, the experts' token dispatch reads it whole."""
    torch.manual_seed(0)
    ids = _ids(hf_cases.VOCAB, batch=2, seq=32)
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0
    _proven(hf_cases._bert(), {"cp": 2}, ids, {"attention_mask": mask})
    proof = _proven(hf_cases._qwen3_moe(), {"cp": 2, "tp": 2}, ids)
    assert all("index.Tensor" in why for _, why in proof.plan.context.gathered_whole)


def test_hugging_face_loss_from_labels_padding_mask_and_eager_attention():
    torch.manual_seed(0)
    ids = _ids(hf_cases.VOCAB, batch=2, seq=32)
    labels = ids.clone()
    labels[0, :5] = -100  # ignored tokens: the mean divides by the tokens that count, over every rank
    proof = _proven(hf_cases._llama(), {"cp": 4}, ids, {"labels": labels})
    assert proof.cp_collectives["all_reduce"][0] == 3  # the loss sum and count, and the sum's gradient
    mask = torch.ones_like(ids)
    mask[1, -6:] = 0
    _proven(hf_cases._qwen2(), {"cp": 2}, ids, {"attention_mask": mask})
    eager = hf.LlamaForCausalLM(hf.LlamaConfig(**hf_cases._DECODER, attn_implementation="eager"))
    _proven(eager, {"cp": 4}, ids)


def test_outputs_left_cut_are_proven_at_each_ranks_positions():
    torch.manual_seed(0)
    ids = _ids(hf_cases.VOCAB, batch=2, seq=32)
    proof = _proven(hf_cases._llama(), {"cp": 2, "tp": 2}, ids, {"labels": ids}, context_output="local")
    assert proof.plan.context.output_cuts == (None, 1)  # the loss whole, the logits cut
    assert proof.cp_collectives["all_gather"][0] == 4  # keys and values of 2 blocks; no logits gathered
    with pytest.raises(ValueError, match="context_output configures context parallelism"):
        autoshard.plan(hf_cases._llama(), {"tp": 2}, example_inputs=(ids,), context_output="local")


def test_bf16_is_judged_by_a_float64_run_of_the_same_code():
    """Chunked attention rounds differently in bf16; the same ranks run in float64 match to rounding."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(max_seq_len=64)).to(torch.bfloat16)
    proof = _proven(model, {"cp": 2, "tp": 2}, _ids(256, batch=2, seq=32))
    measures = (*proof.outputs, *proof.gradients)
    assert all(m.sharded is not None and m.sharded <= 1e-9 for m in measures)
    assert max(m.error for m in measures) > 1e-4  # bf16 itself differs: a bound of 1e-9 there would fail


class AlibiAttention(nn.Module):
    """Attention written out (matmul, softmax, matmul) with an ALiBi bias built from ``arange``."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        slopes = torch.tensor([2.0 ** (-8 * (i + 1) / heads) for i in range(heads)])
        self.register_buffer("slopes", slopes, persistent=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        pos = torch.arange(s, device=x.device)
        distance = (pos[None, :] - pos[:, None]).float()
        bias = self.slopes[:, None, None] * distance  # [heads, s, s]
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads) + bias
        scores = scores.masked_fill(~causal, float("-inf"))
        out = F.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


class AlibiLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(AlibiAttention(dim) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(self.norm(h))
        return self.head(h)


def test_alibi_bias_and_causal_mask_use_global_positions():
    torch.manual_seed(0)
    proof = _proven(AlibiLM(), {"cp": 4}, _ids(64, batch=2, seq=32))
    assert proof.cp_collectives["all_gather"][0] == 5  # keys and values of 2 blocks, and the output


class PrefixSum(nn.Module):
    """A running mean over the sequence (a cumulative sum along it) between two linears."""

    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.mix(self.embed(ids))
        steps = torch.arange(1, ids.shape[1] + 1, device=ids.device).view(1, -1, 1)
        return self.head(torch.cumsum(h, dim=1) / steps)


def test_an_op_mixing_positions_reads_its_input_whole_and_the_plan_says_so():
    torch.manual_seed(0)
    ids = _ids(64, batch=2, seq=16)
    plan = _proven(PrefixSum(), {"cp": 2}, ids).plan
    assert [name for name, _ in plan.context.gathered_whole] == ["cumsum"]
    assert "read whole (all-gathered): cumsum: cumsum.default along the sequence" in str(plan)
    assert Plan.from_dict(plan.to_dict()).context == plan.context


class RunningMax(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.head(torch.cummax(self.embed(ids), dim=1).values)


def test_bad_input_is_refused_with_a_clear_error():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(max_seq_len=64))
    with pytest.raises(ValueError, match=r"sequence length 20 .* does not divide by 8"):
        autoshard.plan(model, {"cp": 4}, example_inputs=(_ids(256, seq=20),))
    with pytest.raises(NotImplementedError, match=r"no rule for node 'cummax' .* at test_context_plan.py:\d+"):
        autoshard.plan(RunningMax(), {"cp": 2}, example_inputs=(_ids(64, seq=16),))
    with pytest.raises(NotImplementedError, match=r"context_output='local' with a pp axis: torch's schedule hands"):
        autoshard.plan(model, {"pp": 2, "cp": 2}, example_inputs=(torch.cat([_ids(256, seq=16)] * 2),),
                       context_output="local")


def test_hsdp_with_cp_shards_parameters_over_dp_shard_and_cp():
    torch.manual_seed(0)
    plan = autoshard.plan(Llama(LlamaConfig(max_seq_len=64)), {"dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 2},
                          example_inputs=(_ids(256, seq=16),))
    wq = plan.params["layers.0.attention.wq.weight"]
    assert {a: str(p) for a, p in wq.placements.items()} == {"dp_replicate": "R", "dp_shard": "S(0)", "cp": "S(0)",
                                                              "tp": "S(1)"}
    assert "fsdp" in plan.predicted_comm() and "cp" in plan.predicted_comm()


def test_causal_attention_work_is_balanced_over_ranks():
    """Each rank's attention FLOPs, read from the emitted code, against a contiguous cut's."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(max_seq_len=512))
    ids = _ids(256, batch=1, seq=512)
    work = {}
    for balanced in (True, False):
        captured = capture(model, (ids,), {}, None, None, True)
        cut_sequence(captured.gm, 512, 4, "cp", set(captured.param_shapes), balanced=balanced)
        weights = {n.target: operator.attrgetter(n.target)(captured.gm) for n in captured.gm.graph.nodes
                   if n.op == "get_attr" and isinstance(operator.attrgetter(n.target)(captured.gm), torch.Tensor)}
        work[balanced] = attention_work(captured.gm, 4, [ids], weights)
    assert work[True].spread(work[True].useful) <= 0.05
    assert work[True].spread(work[True].executed) <= 0.05
    assert work[False].ratio(work[False].useful) > 6.5  # 1/2 : 3/2 : 5/2 : 7/2 of the diagonal blocks
    assert sum(work[True].executed) < 0.8 * sum(work[False].executed)  # the first chunk reads half the keys


def test_a_broken_cp_gather_is_caught_at_the_node_it_feeds(monkeypatch):
    """A plan broken on purpose: the first gather of keys over cp hands each rank its own part
    repeated instead of every rank's. The proof fails and names the first node whose value differs
    from one device's at the rank's positions, with its source line."""
    from autoshard.axes.cp_axis import ContextAxis
    from autoshard.runtime.context_ops import CP_GATHER

    cut = ContextAxis.cut

    def broken(self, captured, axes, options, example_inputs):
        plan = cut(self, captured, axes, options, example_inputs)
        graph = captured.gm.graph
        gather = next(n for n in graph.nodes if n.target is CP_GATHER)
        x, dim, cp = gather.args[:3]
        with graph.inserting_after(gather):
            repeated = graph.call_function(torch.ops.aten.cat.default, ([x] * cp, dim))
        gather.replace_all_uses_with(repeated, delete_user_cb=lambda user: user is not repeated)
        repeated.meta = dict(gather.meta)
        graph.erase_node(gather)
        captured.gm.recompile()
        return plan

    monkeypatch.setattr(ContextAxis, "cut", broken)
    torch.manual_seed(0)
    proof = autoshard.check(hf_cases._llama(), {"cp": 2}, example_inputs=(_ids(hf_cases.VOCAB, seq=16),))
    assert not proof.ok
    assert proof.first_divergence and "modeling_llama.py" in proof.first_divergence, proof.first_divergence
    assert "cp rank 1" in proof.first_divergence or "cp rank 0" in proof.first_divergence


def test_a_buffer_filled_slice_by_slice_is_cut_as_the_cat_it_is():
    """Rotary pairs written into a fresh buffer by ``copy_`` into its slices (as DeepSeek-V3 builds its
    keys) are captured as their cat: cut as the reference spelling is, with its cp collectives."""
    from tests.spellings import FAMILIES, Spelling

    ref = FAMILIES["llama_gqa"].reference("llama_gqa")
    filled = Spelling("llama_gqa", tuple((a, "filled_buffer" if a == "rope" else o) for a, o in ref.choices))
    x = ref.inputs()[0]
    proofs = [_proven(s.build(), {"cp": 2}, x) for s in (ref, filled)]
    assert proofs[1].plan.context.gathered_whole == proofs[0].plan.context.gathered_whole == ()
    assert proofs[1].cp_collectives == proofs[0].cp_collectives
    graph = capture(filled.build(), (x,)).gm.graph
    assert not [n for n in graph.nodes if n.target is torch.ops.aten.copy_.default]


class _GroupLimitedRouter(nn.Module):
    """DeepSeek-V3's group-limited routing, as written there: the best groups' mask built by an in-place
    ``scatter_`` into ``zeros_like`` of the group scores, along the groups (not the tokens)."""

    def __init__(self, dim: int = 32, experts: int = 8, groups: int = 4):
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.groups = groups

    def forward(self, x):
        scores = self.gate(x).sigmoid()  # [b, s, E]
        grouped = scores.view(*scores.shape[:-1], self.groups, -1)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1)  # [b, s, G]
        top_groups = group_scores.topk(2, dim=-1)[1]
        mask = torch.zeros_like(group_scores)
        mask.scatter_(-1, top_groups, 1)
        kept = (grouped * mask.unsqueeze(-1)).flatten(-2)
        picked = kept.gather(-1, kept.topk(2, dim=-1)[1])
        return self.out(x * picked.sum(-1, keepdim=True))


def test_a_mask_scattered_along_another_dim_than_the_sequence_keeps_its_cut():
    """``scatter_`` and ``gather`` along the experts' dim keep each token's entries on its cp rank: no
    gather of the sequence."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    proof = autoshard.check(_GroupLimitedRouter(), {"cp": 2}, example_inputs=(x,))
    assert proof.ok, proof
    assert proof.plan.context.gathered_whole == (), proof.plan.context.gathered_whole
