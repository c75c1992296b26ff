"""Pass-level tests of the two phases that write the tp code, each run alone on a planned graph.

``insert_redistributes`` (``passes/redistribute.py``) turns the layout plan's edges into autoshard's
collective ops, and ``rewrite_linears`` (``passes/transpose.py``) rewrites every sharded linear onto
its stored weight (colwise ``x @ W_t + b``, rowwise ``reduce_partial(x @ W.T) + b``). Elsewhere they
run only inside ``emit``, behind partitioning and a proof, so a slip shows up as a parity number.
Here each phase runs by itself on the graph :func:`planning.plan_result` leaves for a tiny model,
and the test states what it wrote: which collectives, how many, between which nodes, with which
group name and reduce dtype, and that the code computes the model's output on every tp rank from
that rank's stored shards. No process group: ``_run_ranks`` runs the tp=2 ranks side by side, an
all-reduce summing them and an all-gather concatenating them.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from autoshard.core.options import PlanOptions
from autoshard.driver import planning
from autoshard.passes.redistribute import insert_redistributes
from autoshard.passes.transpose import rewrite_linears
from autoshard.runtime.collectives import ENTER_TP, GATHER_SHARDS, REDUCE_PARTIAL

aten = torch.ops.aten
GROUP = "tp_group_7"  # not the axis name, so a test sees the name given to the phase reach the ops
TP = 2


class _Mlp(nn.Module):
    def __init__(self, bias: bool = True):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32, bias=bias), nn.Linear(32, 16, bias=bias)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _GatedMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(16, 32, bias=False), nn.Linear(16, 32, bias=False)
        self.down = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _ReadWhole(nn.Module):
    """A colwise projection whose output two ops normalize over its features (the cut dim)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)

    def forward(self, x):
        h = self.proj(x)
        return h.softmax(-1), h.log_softmax(-1)


class _Heads(nn.Module):
    """Features viewed as 4 heads of 8, a per-head softmax, and the heads merged back."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.up(x).view(x.shape[0], 4, 8).softmax(-1)
        return self.down(h.reshape(x.shape[0], 32))


def _planned(model_cls, mesh=None, dtype=torch.float32):
    torch.manual_seed(0)
    model = model_cls().to(dtype)
    x = torch.randn(4, 16, dtype=dtype)
    planned = planning.plan_result(model, planning.mesh_axes(mesh or {"tp": TP}), (x,), None, None, PlanOptions())
    return model, x, planned


def _checked(gm: fx.GraphModule) -> fx.GraphModule:
    gm.graph.lint()
    gm.recompile()
    return gm


def _redistributed(planned, reduce_dtype=None) -> fx.GraphModule:
    insert_redistributes(planned.captured.gm, planned.layout_plan, GROUP, reduce_dtype)
    return _checked(planned.captured.gm)


def _rewritten(planned, tp_group=GROUP, reduce_dtype=None) -> fx.GraphModule:
    rewrite_linears(planned.captured.gm, planned.sites, planned.layout_plan, tp_group, planned.layout_plan.tp,
                    reduce_dtype)
    return _checked(planned.captured.gm)


def _collectives(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", "") == "autoshard"]


def _count(gm: fx.GraphModule) -> dict:
    return dict(collections.Counter(n.target for n in _collectives(gm)))


def _one(gm: fx.GraphModule, target) -> fx.Node:
    found = [n for n in gm.graph.nodes if n.target == target]
    assert len(found) == 1, f"expected one {target}, found {found}"
    return found[0]


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def _site(planned, weight_fqn: str):
    return next(s for s in planned.sites.linears if s.weight_fqn == weight_fqn)


def _shards(model: nn.Module, planned) -> list[dict[str, torch.Tensor]]:
    """Each tp rank's stored parameters: as the plan stores them (transposed or not), chunked on the
    dim it cuts over tp."""
    ranks = [{} for _ in range(TP)]
    for fqn, param in model.named_parameters():
        entry = planned.plan.params[fqn]
        stored = param.detach().t() if entry.transposed else param.detach()
        dim = entry.sharded_dim("tp")
        pieces = torch.chunk(stored, TP, dim=dim) if dim is not None else [stored] * TP
        for rank, piece in zip(ranks, pieces, strict=True):
            rank[fqn] = piece.contiguous()
    return ranks


def _run_ranks(gm: fx.GraphModule, shards: list[dict[str, torch.Tensor]], *inputs) -> list:
    """Every rank's outputs of ``gm``, the ranks run in lockstep node by node."""
    tp = len(shards)
    env: list[dict[fx.Node, object]] = [{} for _ in range(tp)]
    placeholders = iter(inputs)
    for node in gm.graph.nodes:
        if node.op == "output":
            return [fx.node.map_arg(node.args[0], values.__getitem__) for values in env]
        if node.op == "placeholder":
            value = next(placeholders)
            results = [value] * tp
        elif node.op == "get_attr":
            results = [rank[node.target] for rank in shards]
        else:
            calls = [(fx.node.map_arg(node.args, values.__getitem__), fx.node.map_arg(node.kwargs, values.__getitem__))
                     for values in env]
            if node.target == ENTER_TP:
                results = [args[0] for args, _ in calls]
            elif node.target == REDUCE_PARTIAL:
                results = [sum(args[0] for args, _ in calls)] * tp
            elif node.target == GATHER_SHARDS:
                results = [torch.cat([args[0] for args, _ in calls], dim=calls[0][0][1])] * tp
            else:
                assert getattr(node.target, "namespace", "") != "autoshard", f"no rank emulation for {node.target}"
                results = [node.target(*args, **kwargs) for args, kwargs in calls]
        for values, result in zip(env, results, strict=True):
            values[node] = result
    raise AssertionError("no output node")


# --- insert_redistributes ---------------------------------------------------------------------


def test_an_mlp_gets_one_enter_tp_right_before_its_colwise_linear_and_nothing_else():
    model, x, planned = _planned(_Mlp)
    gm = _redistributed(planned)
    assert _count(gm) == {ENTER_TP: 1}
    enter, linear = _one(gm, ENTER_TP), _site(planned, "up.weight").node
    assert enter.args == (_node(gm, "x"), GROUP)
    assert list(_node(gm, "x").users) == [enter] and list(enter.users) == [linear]
    assert enter.next is linear  # a graph input's collective waits for its first reader
    # the rowwise all-reduce of a biased linear is transpose's to write, not this phase's
    assert _site(planned, "down.weight").node.target is aten.linear.default
    torch.testing.assert_close(gm(x), model(x))  # enter_tp is the identity forward: nothing else moved


def test_colwise_linears_reading_one_input_share_one_enter_tp():
    _, _, planned = _planned(_GatedMlp)
    gm = _redistributed(planned)
    assert _count(gm) == {ENTER_TP: 1, REDUCE_PARTIAL: 1}
    enter = _one(gm, ENTER_TP)
    assert set(enter.users) == {_site(planned, "gate.weight").node, _site(planned, "up.weight").node}


def test_an_unbiased_rowwise_output_is_reduced_where_the_graph_output_reads_it():
    _, _, planned = _planned(_GatedMlp)
    gm = _redistributed(planned)
    down = _site(planned, "down.weight").node
    reduced = _one(gm, REDUCE_PARTIAL)
    assert reduced.args == (down, GROUP)
    assert list(down.users) == [reduced] and down.next is reduced
    assert list(reduced.users) == [next(iter(gm.graph.find_nodes(op="output")))]


def test_a_colwise_output_read_whole_by_two_ops_is_gathered_once_on_its_cut_dim():
    _, _, planned = _planned(_ReadWhole)
    gm = _redistributed(planned)
    assert _count(gm) == {ENTER_TP: 1, GATHER_SHARDS: 1}
    linear = _site(planned, "proj.weight").node
    gathered = _one(gm, GATHER_SHARDS)
    assert gathered.args == (linear, 1, GROUP)
    assert linear.next is gathered and list(linear.users) == [gathered]
    assert {n.target for n in gathered.users} == {aten.softmax.int, aten.log_softmax.int}


def test_views_of_a_cut_value_get_their_local_shapes():
    _, _, planned = _planned(_Heads)
    gm = _redistributed(planned)
    assert _count(gm) == {ENTER_TP: 1}
    view, reshape = _one(gm, aten.view.default), _one(gm, aten.reshape.default)
    assert view.args == (_site(planned, "up.weight").node, [4, 4 // TP, 8])
    assert reshape.args == (_node(gm, "softmax"), [4, 32 // TP])


def test_a_reduce_dtype_reaches_every_sum_of_partials_and_no_gather():
    _, _, planned = _planned(_GatedMlp, dtype=torch.bfloat16)
    gm = _redistributed(planned, reduce_dtype=torch.float32)
    assert _one(gm, ENTER_TP).args == (_node(gm, "x"), GROUP, torch.float32)
    assert _one(gm, REDUCE_PARTIAL).args == (_site(planned, "down.weight").node, GROUP, torch.float32)

    _, _, planned = _planned(_ReadWhole, dtype=torch.bfloat16)
    gm = _redistributed(planned, reduce_dtype=torch.float32)
    assert _one(gm, ENTER_TP).args == (_node(gm, "x"), GROUP, torch.float32)
    assert _one(gm, GATHER_SHARDS).args == (_site(planned, "proj.weight").node, 1, GROUP)


# --- rewrite_linears --------------------------------------------------------------------------


def test_a_colwise_linear_becomes_a_matmul_on_its_stored_transposed_weight_plus_its_bias():
    _, _, planned = _planned(_Mlp)
    up = planned.plan.params["up.weight"]
    assert (up.role, up.transposed, up.sharded_dim("tp")) == ("colwise", True, 1)
    site = _site(planned, "up.weight")
    _redistributed(planned)
    gm = _rewritten(planned)
    assert site.node.target is aten.add.Tensor  # the site's node stays its full output
    product, bias = site.node.args
    assert bias is site.bias_node
    assert product.target is aten.matmul.default
    assert product.args == (_one(gm, ENTER_TP), site.weight_node)
    assert not [n for n in gm.graph.nodes if n.target is aten.linear.default and site.weight_node in n.args]


def test_a_biased_rowwise_linear_is_all_reduced_before_its_bias_is_added_once():
    _, _, planned = _planned(_Mlp)
    down = planned.plan.params["down.weight"], planned.plan.params["down.bias"]
    assert [(p.role, p.transposed, p.sharded_dim("tp")) for p in down] == [("rowwise", False, 1),
                                                                           ("rowwise_bias", False, None)]
    site = _site(planned, "down.weight")
    _redistributed(planned)
    gm = _rewritten(planned)
    assert _count(gm) == {ENTER_TP: 1, REDUCE_PARTIAL: 1}
    assert site.node.target is aten.add.Tensor
    reduced, bias = site.node.args
    assert bias is site.bias_node and reduced is _one(gm, REDUCE_PARTIAL)
    local = reduced.args[0]
    assert reduced.args == (local, GROUP)
    assert local.target is aten.linear.default and local.args == (_node(gm, "relu"), site.weight_node)


def test_an_unbiased_rowwise_linear_stays_partial_for_the_reduce_already_at_its_reader():
    _, _, planned = _planned(_GatedMlp)
    site = _site(planned, "down.weight")
    gm = _redistributed(planned)
    before = _count(gm)
    gm = _rewritten(planned)
    assert _count(gm) == before == {ENTER_TP: 1, REDUCE_PARTIAL: 1}
    assert site.node not in gm.graph.nodes
    local = _one(gm, REDUCE_PARTIAL).args[0]
    assert local.target is aten.linear.default and local.args == (_node(gm, "mul"), site.weight_node)
    matmuls = [n for n in gm.graph.nodes if n.target is aten.matmul.default]
    assert [n.args[1].target for n in matmuls] == ["gate.weight", "up.weight"]
    assert all(n.args[0] is _one(gm, ENTER_TP) for n in matmuls)


def test_a_reduce_dtype_reaches_the_rowwise_all_reduce():
    _, _, planned = _planned(_Mlp, dtype=torch.bfloat16)
    _redistributed(planned, reduce_dtype=torch.float32)
    gm = _rewritten(planned, reduce_dtype=torch.float32)
    reduced = _one(gm, REDUCE_PARTIAL)
    assert reduced.args == (_node(gm, "linear_1_local"), GROUP, torch.float32)
    assert _one(gm, ENTER_TP).args == (_node(gm, "x"), GROUP, torch.float32)


@pytest.mark.parametrize("model_cls", [_Mlp, lambda: _Mlp(bias=False), _GatedMlp, _ReadWhole, _Heads],
                         ids=["mlp", "mlp_without_bias", "gated_mlp", "read_whole", "heads"])
def test_every_rank_of_the_rewritten_code_computes_the_model_output_from_its_shards(model_cls):
    model, x, planned = _planned(model_cls)
    shards = _shards(model, planned)
    _redistributed(planned)
    gm = _rewritten(planned)
    expected = model(x)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for rank, outputs in enumerate(_run_ranks(gm, shards, x)):
        assert len(outputs) == len(expected)
        for got, want in zip(outputs, expected, strict=True):
            torch.testing.assert_close(got, want, msg=lambda m, rank=rank: f"rank {rank}: {m}")


def test_the_reduce_is_what_makes_the_ranks_whole_each_alone_holds_a_partial_sum():
    model, x, planned = _planned(_Mlp)
    shards = _shards(model, planned)
    _redistributed(planned)
    gm = _rewritten(planned)
    reduced = _one(gm, REDUCE_PARTIAL)
    reduced.replace_all_uses_with(reduced.args[0])
    gm.graph.erase_node(reduced)
    (first,), (second,) = _run_ranks(_checked(gm), shards, x)
    expected = model(x)
    assert not torch.allclose(first, expected) and not torch.allclose(second, expected)
    torch.testing.assert_close(first + second - model.down.bias, expected)


def test_without_tp_the_rewrite_reads_the_stored_weights_and_adds_no_collective():
    model, x, planned = _planned(_Mlp, mesh={"dp": 2})
    assert planned.layout_plan.tp == 1
    gm = _rewritten(planned, tp_group=None)
    assert _count(gm) == {}
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [
        aten.matmul.default, aten.add.Tensor, aten.relu.default, aten.linear.default, aten.add.Tensor]
    stored = {fqn: (p.detach().t() if planned.plan.params[fqn].transposed else p.detach())
              for fqn, p in model.named_parameters()}
    assert stored["up.weight"].shape == (16, 32)
    out = torch.func.functional_call(gm, stored, (x,))
    torch.testing.assert_close(out, model(x))
