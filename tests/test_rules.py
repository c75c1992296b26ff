"""Pass-level tests of layout propagation, in one process and without a process group.

Each rule case traces a few ops the way public model code writes them and asks the
planner's rules (autoshard's own, then DTensor's op strategies) for the layout every
op gives, starting from the given input layouts on tp=2. A broken rule fails here as
"op X with input layout Y gave Z", not as a parity number in a 4-process test.
Layouts: ``None`` replicated, ``d`` sharded on dim d, ``P`` (``Partial.SUM``) a sum over ranks;
``GATHER`` means some op had no comm-free rule and its sharded input is gathered.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import autoshard
from autoshard.core.sharding import Step
from autoshard.passes import layout_rules
from autoshard.passes.capture import capture
from autoshard.passes.discover import Sites
from autoshard.passes.experts import find_expert_sites
from autoshard.passes.propagate import Propagation
from tests.pattern_models import PATTERNS

GATHER = "gather"
P = layout_rules.PARTIAL


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _layout_through(fn, shapes, layouts, tp: int = 2):
    """The layout of ``fn``'s output when its inputs have ``layouts``, as propagation decides it
    op by op; ``GATHER`` when an op had to read an input whole (no rule keeps it sharded)."""
    gm = torch.export.export(_Fn(fn), tuple(torch.randn(s) for s in shapes), strict=False).graph_module
    walk = Propagation(gm, Sites(linears=(), embeddings=()), tp)
    walk.layouts.update(zip([n for n in gm.graph.nodes if n.op == "placeholder"], layouts, strict=True))
    for node in gm.graph.nodes:
        if node.op == "output":
            out = node.args[0][0] if isinstance(node.args[0], (list, tuple)) else node.args[0]
            return walk.layouts[out]
        if node.op != "call_function":
            continue
        walk.visit(node)
        made_whole = [step for (_, consumer), steps in walk.edges.items() if consumer is node for step in steps
                      if step.kind in (Step.GATHER, Step.REDUCE)]
        if made_whole:
            return GATHER
    raise AssertionError("no output")


def _interleaved_rope(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _repeat_kv(k):
    b, h, s, d = k.shape
    return k[:, :, None].expand(b, h, 2, s, d).reshape(b, h * 2, s, d)


def _complex_rope(x):
    return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))).flatten(3)


HEADS = (2, 4, 8, 16)  # [batch, heads, seq, head_dim], heads sharded: layout 1
RULE_CASES = [
    # (name, fn, input shapes, input layouts, expected output layout)
    ("strided slice keeps heads", lambda x: x[..., ::2], [HEADS], [1], 1),
    ("interleaved rope (stack + flatten)", _interleaved_rope, [HEADS], [1], 1),
    ("repeat_interleave on heads", lambda k: k.repeat_interleave(2, dim=1), [HEADS], [1], 1),
    ("repeat_kv (expand + reshape)", _repeat_kv, [HEADS], [1], 1),
    ("view_as_complex rope on [b, s, h, d]", _complex_rope, [(2, 8, 4, 16)], [2], 2),
    ("scores + replicated bias", lambda s, b: s + b, [(2, 4, 8, 8), (1, 4, 8, 8)], [1, None], 1),
    ("q @ k^T on heads", lambda q, k: q @ k.transpose(-1, -2), [HEADS, HEADS], [1, 1], 1),
    ("baddbmm on heads flattened into batch", lambda b, q, k: torch.baddbmm(b, q, k.transpose(1, 2)),
     [(8, 8, 8), (8, 8, 16), (8, 8, 16)], [0, 0, 0], 0),
    ("softmax over keys", lambda s: s.softmax(dim=-1), [(2, 4, 8, 8)], [1], 1),
    ("softmax over the sharded dim", lambda s: s.softmax(dim=1), [(2, 4, 8, 8)], [1], GATHER),
    ("cumsum over the sharded dim", lambda x: x.cumsum(-1), [(2, 8, 64)], [2], GATHER),
    ("roll over seq", lambda x: x.roll(1, dims=2), [HEADS], [1], 1),
    ("sum over the sharded dim is partial", lambda x: x.sum(-1), [(2, 8, 64)], [2], P),
    ("partial times replicated stays partial", lambda p, w: p * w, [(8, 64), (8, 1)], [P, None], P),
    ("partial plus partial stays partial", lambda a, b: a + b, [(8, 64), (8, 64)], [P, P], P),
    ("a nonlinear op of a partial has no rule", lambda p: p.exp(), [(8, 64)], [P], GATHER),
    ("zeros plus partial stays partial", lambda x, p: torch.zeros_like(x) + p, [(8, 64), (8, 64)], [None, P], P),
    # DeepSeek-V3.2's indexer: per-head scores weighted and summed over heads, the heads contracted
    ("head-weighted sum of scores, both cut", lambda w, s: w.unsqueeze(-2) @ s, [(2, 8, 4), (2, 8, 4, 8)], [2, 2], P),
    ("head-weighted sum, weights whole", lambda w, s: w.unsqueeze(-2) @ s, [(2, 8, 4), (2, 8, 4, 8)], [None, 2], P),
    ("head-weighted sum, scores whole", lambda w, s: w.unsqueeze(-2) @ s, [(2, 8, 4), (2, 8, 4, 8)], [2, None], P),
    ("a @ b with a's rows and b's rows cut", lambda a, b: a @ b, [(2, 8, 8), (2, 8, 8)], [1, 1], GATHER),
]


@pytest.mark.parametrize("name,fn,shapes,layouts,expected", RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_layout_rule(name, fn, shapes, layouts, expected):
    got = _layout_through(fn, shapes, layouts)
    assert got == expected, f"{name}: input layouts {layouts} gave {got}, expected {expected}"


# --- expert discovery ---------------------------------------------------------------------


class _Experts(nn.Module):
    def __init__(self, forward, shape=(4, 32, 16)):
        super().__init__()
        self.w = nn.Parameter(torch.randn(*shape))
        self.fn = forward

    def forward(self, x, ids):
        return self.fn(self.w, x, ids)


EXPERT_CASES = [
    # (name, forward(w, x [8, 16], ids [8]), w shape, expected (out_dim, in_dim) per site or None)
    ("bmm(W[ids], x[..., None]) on [E, out, in]",
     lambda w, x, ids: torch.bmm(w[ids], x.unsqueeze(-1)).squeeze(-1), (4, 32, 16), [(1, 2)]),
    ("bmm(x[:, None], W[ids]) on [E, in, out]",
     lambda w, x, ids: torch.bmm(x.unsqueeze(1), w[ids]).squeeze(1), (4, 16, 32), [(2, 1)]),
    ("F.linear(x, W[e]) in a loop",
     lambda w, x, ids: sum(F.linear(x, w[e]) for e in range(2)), (4, 32, 16), [(1, 2), (1, 2)]),
    ("x @ W[e].T", lambda w, x, ids: x @ w[0].T, (4, 32, 16), [(1, 2)]),
    ("x @ W[e] on [E, in, out]", lambda w, x, ids: x @ w[1], (4, 16, 32), [(2, 1)]),
    ("a weight also read whole is no expert weight",
     lambda w, x, ids: F.linear(x, w[0]) * w.mean(), (4, 32, 16), None),
    ("bmm(x.view(E, -1, in), W) on [E, in, out]: every expert at once",
     lambda w, x, ids: torch.bmm(x.view(4, -1, 16), w), (4, 16, 32), [(2, 1)]),
    ("the whole stack on the left of a bmm is no expert pick",
     lambda w, x, ids: torch.bmm(w, x.view(4, 16, -1)), (4, 32, 16), None),
]


@pytest.mark.parametrize("name,forward,shape,expected", EXPERT_CASES, ids=[c[0] for c in EXPERT_CASES])
def test_expert_sites(name, forward, shape, expected):
    x, ids = torch.randn(8, 16), torch.randint(0, 4, (8,))
    captured = capture(_Experts(forward, shape), (x, ids), {}, None)
    sites = find_expert_sites(captured.gm, captured.param_shapes)
    got = [(s.out_dim, s.in_dim) for s in sites] or None
    assert got == expected, f"{name}: found {got}"


# --- a mixture-of-experts layer, planned --------------------------------------------------


@pytest.mark.parametrize("name,per_block", [("moe_indexed", 4), ("moe_loop", 5)])
def test_moe_plan(name, per_block):
    """Experts cut like linears on clean blocks, the router computed whole, and the tp
    collectives per block at the minimum (see tests/test_patterns.py for why the loop costs 5)."""
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    plan = autoshard.plan(PATTERNS[name](), {"dp": 2, "tp": 2}, example_inputs=(tokens,))
    gate_up = plan.params["layers.0.feed_forward.experts.gate_up_proj"]
    down = plan.params["layers.0.feed_forward.experts.down_proj"]
    router = plan.params["layers.0.feed_forward.router.weight"]
    assert (gate_up.placements, gate_up.sections) == ({"dp": Shard(0), "tp": Shard(1)}, (128, 128))
    assert "experts' colwise weight" in gate_up.note and not gate_up.transposed
    assert down.placements == {"dp": Shard(0), "tp": Shard(2)} and "experts' rowwise weight" in down.note
    assert router.role == "replicate" and "computed whole" in router.note
    assert not plan.breaks
    assert [plan.num_tp_collectives(b) for b in plan.units[1:]] == [per_block, per_block]


def test_values_of_a_no_grad_region_carry_no_gradient():
    """DeepSeek-V3.2's ``@torch.no_grad()`` indexer, inlined: its projections read trainable weights,
    but nothing it computes reaches the loss except through top-k indices, so no value in it is
    planned to carry a gradient (no backward collective, and a region that ends in a sum over heads
    may stay cut). The attention beside it carries one as usual."""
    from autoshard.passes.gradient_flow import carries_grad

    model = PATTERNS["head_weighted_indexer"]()
    captured = capture(model, (torch.randint(0, 128, (2, 16)),), {}, None)
    carries = carries_grad(captured.gm)
    matmuls = [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.matmul.default]
    indexer = [n for n in matmuls if "select" in str(n.meta.get("stack_trace", ""))]
    assert indexer and not any(n in carries for n in indexer), indexer
    linears = {n.args[1].target if n.args[1].op == "get_attr" else n.args[1].name: n
               for n in captured.gm.graph.nodes if n.target is torch.ops.aten.linear.default}
    assert [name for name, n in linears.items() if n in carries and "index" in name] == []
    assert any(n in carries for name, n in linears.items() if "wq" in name)


class _ScanInto(nn.Module):
    """A recurrent scan as gated DeltaNet and Kimi write it: each step's output written into a
    preallocated tensor (``o[:, i] = ...``), which the output projection reads."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        v = self.proj(x)
        o = torch.zeros_like(v)
        for i in range(x.shape[1]):
            o[:, i] = v[:, i] * 2
        return self.out(o)


def test_a_value_written_into_a_tensor_the_output_reads_carries_a_gradient():
    from autoshard.passes.gradient_flow import carries_grad

    captured = capture(_ScanInto(), (torch.randn(2, 4, 8),), {}, None)
    carries = carries_grad(captured.gm)
    linears = [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert len(linears) == 2 and all(n in carries for n in linears), [(n.name, n in carries) for n in linears]


# --- a bmm over a stacked parameter: per-head product or experts --------------------------------


class _StackedBmm(nn.Module):
    """``bmm`` of an input made two ways with a whole ``[4, 16, 16]`` stack: heads split from a
    projection's features (a per-head product) or groups split from the rows (experts)."""

    def __init__(self, heads_from_features: bool):
        super().__init__()
        self.heads_from_features = heads_from_features
        self.proj = nn.Linear(64, 64)
        self.stack = nn.Parameter(torch.randn(4, 16, 16))

    def forward(self, x):  # x [b, s, 64]
        y = self.proj(x)
        b, s, _ = y.shape
        if self.heads_from_features:
            rows = y.view(b, s, 4, 16).permute(2, 0, 1, 3).reshape(4, b * s, 16)
        else:
            rows = y.reshape(b * s, 64)[:, :16].reshape(4, -1, 16)
        return torch.bmm(rows, self.stack.transpose(1, 2)).sum()


@pytest.mark.parametrize("heads_from_features", [True, False], ids=["per-head", "experts"])
def test_a_bmm_is_per_head_only_when_its_batch_dim_splits_features(heads_from_features):
    from autoshard.passes.contractions import contractions_as_linears

    captured = capture(_StackedBmm(heads_from_features), (torch.randn(2, 8, 64),), {}, None)
    contractions_as_linears(captured.gm, captured.param_shapes)
    targets = {n.target for n in captured.gm.graph.nodes if n.op == "call_function"}
    assert (torch.ops.aten.einsum.default in targets) == heads_from_features
    assert (torch.ops.aten.bmm.default in targets) != heads_from_features
    sites = find_expert_sites(captured.gm, captured.param_shapes)
    assert [s.weight_fqn for s in sites] == ([] if heads_from_features else ["stack"])
