"""The two cuts of the emitted graph, each by itself: blocks (partition) and pipeline stages.

:func:`~autoshard.passes.partition.partition` turns the flat graph into a root graph calling one
GraphModule per block (an FSDP unit), and :func:`~autoshard.passes.stage_graphs.split_stages` cuts
that root into pipeline stages along a block -> stage map. Both are otherwise only exercised end to
end (plans, proofs, training on ranks), where a lost node or a value sent to the wrong stage shows up
far from its cause. Here each cut is checked on small graphs: which nodes land where, which values
cross, and that the cut code, run as plain torch on a tp-free graph, computes exactly what the uncut
graph does. Single process, no process group.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from autoshard.core.options import PlanOptions
from autoshard.driver import planning
from autoshard.passes.capture import capture, find_blocks
from autoshard.passes.partition import callable_blocks, partition
from autoshard.passes.stage_graphs import split_stages, stitched
from autoshard.plans.block_owners import owner_block, unit_of_node
from examples.models import Llama, LlamaConfig

BLOCKS = tuple(f"layers.{i}" for i in range(4))
TWO_BY_TWO = {"layers.0": 0, "layers.1": 0, "layers.2": 1, "layers.3": 1}
ONE_EACH = {block: i for i, block in enumerate(BLOCKS)}
TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))


def _ids() -> torch.Tensor:
    ids = torch.randint(1, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    ids[:, -3:] = 0  # padding: the mask is not all ones
    return ids


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x, mask, table):
        return x + self.fc(self.norm(x) + table) * mask


class TinyStack(nn.Module):
    """Embedding, four identical blocks, norm and head. Every block reads a padding mask made from
    the ids and a constant table sliced to the sequence."""

    def __init__(self, tied: bool = False, dim: int = 16, vocab: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in BLOCKS)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.register_buffer("table", torch.randn(64, dim), persistent=False)

    def mask_and_table(self, ids):
        return (ids != 0).unsqueeze(-1).to(torch.float32), self.table[: ids.shape[1]]

    def forward(self, ids):
        mask, table = self.mask_and_table(ids)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, mask, table)
        return self.head(self.norm(x))


class Reentrant(TinyStack):
    """``layers.0`` runs again after the other blocks, which read its first output and feed its second."""

    def forward(self, ids):
        mask, table = self.mask_and_table(ids)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, mask, table)
        x = self.layers[0](x, mask, table)
        return self.head(self.norm(x))


def _captured(model_class=TinyStack, **kwargs):
    torch.manual_seed(0)
    model = model_class(**kwargs)
    return model, capture(model, (_ids(),))


@pytest.fixture(scope="module")
def tiny():
    return _captured()


@pytest.fixture(scope="module")
def tiny_parts(tiny):
    _, captured = tiny
    return partition(captured.gm, captured.block_fqns)


@pytest.fixture(scope="module")
def llama_tp():
    """A 4-block Llama planned and emitted for tp=2 through the driver: the flat emitted graph (with
    its tp collectives) and its partition, as :func:`plan_pipeline` gets them."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(num_layers=4))
    axes = planning.mesh_axes({"tp": 2})
    planned = planning.plan_result(model, axes, (TOKENS,), None, None, PlanOptions())
    emitted = planning.emit(planned, axes, PlanOptions())
    return planned, emitted.parts


def _calls(root: fx.GraphModule) -> list[str]:
    return [n.target for n in root.graph.nodes if n.op == "call_module"]


def _unit(node: fx.Node, blocks) -> str:
    """The unit partition puts a flat node in: a parameter read by its owner, other code by its module stack."""
    if node.op in ("placeholder", "output"):
        return ""
    if node.op == "get_attr":
        return owner_block(node.target, blocks) or ""
    return unit_of_node(node, blocks)


def _own_nodes(gm: fx.GraphModule) -> set[str]:
    return {n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")}


def _param_reads(gm: fx.GraphModule, params) -> set[str]:
    return {n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target in params}


# partition


def test_the_root_calls_each_block_once_in_order(tiny, tiny_parts, llama_tp):
    _, captured = tiny
    assert captured.block_fqns == BLOCKS
    assert _calls(tiny_parts.root) == list(BLOCKS) and list(tiny_parts.blocks) == list(BLOCKS)
    planned, parts = llama_tp
    assert planned.captured.block_fqns == BLOCKS
    assert _calls(parts.root) == list(BLOCKS) and list(parts.blocks) == list(BLOCKS)
    for root in (tiny_parts.root, parts.root):  # each block's output feeds the next block
        calls = [n for n in root.graph.nodes if n.op == "call_module"]
        assert all(calls[i] in calls[i + 1].all_input_nodes for i in range(3))


def test_each_block_graph_holds_exactly_its_blocks_nodes_and_the_root_the_rest(tiny, tiny_parts, llama_tp):
    planned, parts = llama_tp
    for flat, split in ((tiny[1].gm, tiny_parts), (planned.captured.gm, parts)):
        units = {n.name: _unit(n, BLOCKS) for n in flat.graph.nodes if n.op not in ("placeholder", "output")}
        for block, sub in split.blocks.items():
            assert _own_nodes(sub) == {name for name, unit in units.items() if unit == block}
        calls = {n.name for n in split.root.graph.nodes if n.op == "call_module"}
        assert _own_nodes(split.root) - calls == {name for name, unit in units.items() if unit == ""}
    # the tp code's collectives added inside a block are in that block's graph
    collectives = [n for n in parts.blocks["layers.2"].graph.nodes if "autoshard" in str(n.target)]
    assert collectives and all(_unit(n, BLOCKS) == "layers.2" for n in collectives)


def test_a_block_module_owns_the_models_parameters_under_their_relative_names(tiny, tiny_parts):
    model, _ = tiny
    for block, sub in tiny_parts.blocks.items():
        assert type(sub).__name__ == "Block"
        original = dict(model.get_submodule(block).named_parameters())
        held = dict(sub.named_parameters())
        assert held.keys() == original.keys() == {"norm.weight", "norm.bias", "fc.weight", "fc.bias"}
        assert all(held[name] is original[name] for name in held)
    assert _param_reads(tiny_parts.root, dict(model.named_parameters())) == {
        "embed.weight", "norm.weight", "norm.bias", "head.weight"}


@pytest.mark.parametrize("build, inputs", [
    (TinyStack, _ids()),
    (lambda: Llama(LlamaConfig(num_layers=4)), TOKENS),
])
def test_the_partitioned_root_computes_exactly_the_flat_graph(build, inputs):
    torch.manual_seed(0)
    model = build()
    captured = capture(model, (inputs,))
    parts = partition(captured.gm, captured.block_fqns)
    assert len(parts.blocks) == 4
    with torch.no_grad():
        assert torch.equal(parts.root(inputs), captured.gm(inputs))


def test_a_node_belongs_to_the_first_block_in_its_module_stack(tiny):
    _, captured = tiny
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    assert unit_of_node(by_name["embedding"], BLOCKS) == ""
    norms = [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.layer_norm.default]
    assert [unit_of_node(n, BLOCKS) for n in norms] == [*BLOCKS, ""]  # the final norm is the root's
    assert unit_of_node(norms[1], ("layers.0", "layers.2")) == ""  # a block left out is the root's
    assert owner_block("layers.1.fc.weight", BLOCKS) == "layers.1"
    assert owner_block("layers.1", BLOCKS) == "layers.1" and owner_block("layers", BLOCKS) is None


def _interleaved(feeds_back: bool) -> fx.GraphModule:
    """``b``'s two ops, with a root op reading the first; with ``feeds_back`` the second reads it too."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    first = graph.call_function(torch.relu, (x,))
    outside = graph.call_function(torch.neg, (first,))
    second = graph.call_function(torch.add, (first, outside if feeds_back else x))
    graph.output((second, outside))
    for node in (first, second):
        node.meta["nn_module_stack"] = {"b": ("b", "Block")}
    gm = fx.GraphModule(nn.Module(), graph)
    gm._in_spec = gm._out_spec = None  # partition copies a captured graph's calling convention
    return gm


def test_a_block_whose_result_comes_back_through_the_root_is_not_callable():
    assert callable_blocks(_interleaved(feeds_back=False), ("b",)) == ("b",)
    assert callable_blocks(_interleaved(feeds_back=True), ("b",)) == ()
    x = torch.randn(3)
    for feeds_back, blocks in ((False, ("b",)), (True, ())):
        gm = _interleaved(feeds_back)
        parts = partition(gm, blocks)
        assert _calls(parts.root) == list(blocks)
        assert all(torch.equal(a, b) for a, b in zip(parts.root(x), gm(x), strict=True))
    with pytest.raises(AssertionError, match="a block is not callable"):
        partition(_interleaved(feeds_back=True), ("b",))


def test_a_block_that_runs_twice_stays_in_the_root_and_computes_the_same():
    model, captured = _captured(Reentrant)
    assert find_blocks(model) == BLOCKS
    assert callable_blocks(captured.gm, BLOCKS) == captured.block_fqns == BLOCKS[1:]
    parts = partition(captured.gm, captured.block_fqns)
    assert _calls(parts.root) == list(BLOCKS[1:])
    block_0 = {f"layers.0.{name}" for name, _ in model.layers[0].named_parameters()}
    assert _param_reads(parts.root, block_0) == block_0
    twice = [n for n in parts.root.graph.nodes if n.target is torch.ops.aten.layer_norm.default]
    assert [unit_of_node(n, BLOCKS) for n in twice] == ["layers.0", "layers.0", ""]
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(parts.root(ids), captured.gm(ids))
        assert torch.allclose(parts.root(ids), model(ids), atol=1e-6)


# split_stages


def test_two_stages_take_the_embedding_with_the_first_blocks_and_the_head_with_the_last(llama_tp):
    planned, parts = llama_tp
    params = frozenset(planned.plan.params)
    split = split_stages(parts, TWO_BY_TWO, 2, params)
    first, last = split.stages
    assert first.blocks == ("layers.0", "layers.1") and last.blocks == ("layers.2", "layers.3")
    assert _param_reads(first.module, params) == {"tok_embeddings.weight"}
    assert _param_reads(last.module, params) == {"norm.weight", "output.weight"}
    assert any(n.target is torch.ops.aten.embedding.default for n in first.module.graph.nodes)
    assert not any(n.target is torch.ops.aten.rms_norm.default for n in first.module.graph.nodes)
    # the hidden state alone crosses; the rotary tables are sliced again by each stage
    assert split.carried == (("layers_1",),)
    assert first.receives == ("tokens",) and first.sends == last.receives == ("layers_1",) and last.sends == ()
    for stage in split.stages:
        assert {"rope_cos", "rope_sin"} <= {n.target for n in stage.module.graph.nodes if n.op == "get_attr"}


def test_every_parameter_lives_on_exactly_one_stage(tiny, tiny_parts, llama_tp):
    planned, parts = llama_tp
    model, _ = tiny
    cases = [(parts, frozenset(planned.plan.params), TWO_BY_TWO, 2),
             (tiny_parts, frozenset(n for n, _ in model.named_parameters()), TWO_BY_TWO, 2),
             (tiny_parts, frozenset(n for n, _ in model.named_parameters()), ONE_EACH, 4)]
    for split_parts, params, stage_of_block, count in cases:
        split = split_stages(split_parts, stage_of_block, count, params)
        held = [set(stage.params) for stage in split.stages]
        assert sum(len(h) for h in held) == len(params) and set().union(*held) == params
        for fqn in params:
            block = owner_block(fqn, BLOCKS)
            if block is not None:
                assert fqn in held[stage_of_block[block]]
        assert all(_param_reads(stage.module, params) <= held[stage.index] for stage in split.stages)


@pytest.mark.parametrize("stage_of_block, count", [(TWO_BY_TWO, 2), (ONE_EACH, 4), (dict.fromkeys(BLOCKS, 0), 1)])
def test_the_stitched_stages_compute_exactly_the_unsplit_root(tiny, tiny_parts, stage_of_block, count):
    model, _ = tiny
    split = split_stages(tiny_parts, stage_of_block, count, frozenset(n for n, _ in model.named_parameters()))
    whole = stitched(split, tiny_parts.root)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(whole(ids), tiny_parts.root(ids))


def test_the_stitched_stages_of_a_captured_llama_compute_exactly_its_root():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(num_layers=4))
    captured = capture(model, (TOKENS,))
    parts = partition(captured.gm, captured.block_fqns)
    split = split_stages(parts, TWO_BY_TWO, 2, frozenset(n for n, _ in model.named_parameters()))
    with torch.no_grad():
        assert torch.equal(stitched(split, parts.root)(TOKENS), parts.root(TOKENS))


def test_the_stitched_stages_of_dp_code_emitted_by_the_driver_compute_exactly_the_flat_code():
    """dp alone puts no collective in the code, so it runs as plain torch once each weight is stored
    as the plan says (transposed where the emitted code multiplies by ``W.T``)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(num_layers=4))
    with torch.no_grad():
        expected = model(TOKENS)
    axes = planning.mesh_axes({"dp": 2})
    planned = planning.plan_result(model, axes, (TOKENS,), None, None, PlanOptions())
    parts = planning.emit(planned, axes, PlanOptions()).parts
    split = split_stages(parts, TWO_BY_TWO, 2, frozenset(planned.plan.params))
    params = dict(model.named_parameters())
    transposed = [fqn for fqn, entry in planned.plan.params.items() if entry.transposed]
    assert "output.weight" in transposed
    with torch.no_grad():
        for fqn in transposed:
            params[fqn].data = params[fqn].data.t().contiguous()
        flat = planned.captured.gm(TOKENS)
        assert torch.equal(parts.root(TOKENS), flat)
        assert torch.equal(stitched(split, parts.root)(TOKENS), flat)
    assert torch.allclose(flat, expected, atol=1e-5)


def test_a_mask_made_from_the_inputs_crosses_every_boundary_and_a_constant_none(tiny_parts):
    params = frozenset(n for n, _ in tiny_parts.root.named_parameters())
    split = split_stages(tiny_parts, ONE_EACH, 4, params)
    first_call = next(n for n in tiny_parts.root.graph.nodes if n.op == "call_module")
    read = {arg.target: arg for arg in first_call.args}
    mask, table = read[torch.ops.aten.to.dtype], read[torch.ops.aten.slice.Tensor]
    assert table.all_input_nodes[0].target == "table"
    assert split.carried == tuple((mask.name, f"layers_{k}") for k in range(3))
    for k, stage in enumerate(split.stages):
        assert stage.blocks == (f"layers.{k}",)
        assert stage.receives == (("ids",) if k == 0 else split.carried[k - 1])
        assert stage.sends == (split.carried[k] if k < 3 else ())
        nodes = list(stage.module.graph.nodes)
        assert "table" in {n.target for n in nodes if n.op == "get_attr"}  # sliced by every stage
        assert any(n.target is torch.ops.aten.slice.Tensor for n in nodes)
        made_here = any(n.target is torch.ops.aten.ne.Scalar for n in nodes)
        assert made_here == (k == 0)
    for stage in split.stages[1:3]:  # a stage in between hands the mask on as a node of its own
        (sent,) = [n for n in stage.module.graph.nodes if n.op == "output"]
        handed = sent.args[0][0]
        assert handed.target is torch.ops.aten.alias.default and handed.args[0].name == mask.name


def test_a_tied_embedding_and_head_on_two_stages_is_refused_naming_the_parameter():
    model, captured = _captured(tied=True)
    assert captured.aliases == {"head.weight": "embed.weight"}
    parts = partition(captured.gm, captured.block_fqns)
    params = frozenset(n for n, _ in model.named_parameters())
    assert params == frozenset(captured.param_shapes) and "head.weight" not in params
    with pytest.raises(NotImplementedError, match=r"parameter 'embed\.weight' is read on pipeline stages \[0, 1\]"):
        split_stages(parts, TWO_BY_TWO, 2, params)


def test_a_tied_parameter_is_held_by_the_one_stage_when_all_its_readers_are_there():
    """Every block on the last stage: the embedding runs there with the head, and the first stage
    only hands the ids on."""
    model, captured = _captured(tied=True)
    parts = partition(captured.gm, captured.block_fqns)
    params = frozenset(n for n, _ in model.named_parameters())
    split = split_stages(parts, dict.fromkeys(BLOCKS, 1), 2, params)
    first, last = split.stages
    assert split.carried == (("ids",),) and first.blocks == () and first.params == ()
    assert "embed.weight" in last.params and set(last.params) == params
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(stitched(split, parts.root)(ids), parts.root(ids))


def test_stages_out_of_the_blocks_order_are_refused(tiny_parts):
    params = frozenset(n for n, _ in tiny_parts.root.named_parameters())
    backwards = {"layers.0": 1, "layers.1": 1, "layers.2": 0, "layers.3": 0}
    with pytest.raises(ValueError, match="runs on pipeline stage 0 but reads a value computed on stage 1"):
        split_stages(tiny_parts, backwards, 2, params)
