"""Planning whose cost does not grow with depth, and gives what it gave before.

A stack written by :mod:`autoshard.passes.reuse_blocks` is walked once per
propagation walk and its decisions stamped on the copies: the layouts, edges,
roles and notes must be those of visiting every block, in the same order. Block
ownership and callability are found without scanning every block per node, and
the garbage collector is paused while planning and restored after. Single
process, no process group.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
import torch.fx as fx
import transformers as hf

import autoshard
from autoshard.core.options import PlanOptions
from autoshard.passes import gradient_flow
from autoshard.passes import propagate as propagation
from autoshard.passes.capture import capture, copy_graph_module, find_blocks
from autoshard.passes.discover import find_sites
from autoshard.passes.normalize import normalize
from autoshard.passes.partition import _assign_units, callable_blocks
from autoshard.passes.stamping import Key
from autoshard.plans.block_owners import owner_block
from examples.models import Llama, LlamaConfig, MLPStack

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
_HF = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
           use_cache=False)


def _hf_llama(blocks: int = 5):
    return hf.LlamaForCausalLM(hf.LlamaConfig(**_HF, num_hidden_layers=blocks))


def _hf_gpt2():
    return hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=128, n_embd=64, n_layer=4, n_head=4, n_positions=32,
                                            use_cache=False, bos_token_id=0, eos_token_id=0))


def _hf_qwen3_moe():
    return hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(
        **_HF, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=4, head_dim=16))


STACKS = {
    "llama_4": (lambda: Llama(LlamaConfig(vocab_size=128, num_layers=4)), IDS),
    "mlp_stack_4": (lambda: MLPStack(num_blocks=4), torch.randn(2, 8, 32)),
    "hf_llama_5": (_hf_llama, IDS),
    "hf_gpt2_4": (_hf_gpt2, IDS),
    "hf_qwen3_moe_4": (_hf_qwen3_moe, IDS),
}
OPTIONS = {
    "default": PlanOptions(),
    "loss_parallel": PlanOptions(loss_parallel=True),
    "sequence_parallel": PlanOptions(sequence_parallel=True),
}


def _by_name(value):
    """``value`` with every node replaced by its name, dicts kept in insertion order."""
    if isinstance(value, fx.Node):
        return value.name
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(_by_name(v) for v in value)
    if isinstance(value, dict):
        return tuple((_by_name(k), _by_name(v)) for k, v in value.items())
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(_by_name(v) for v in value))
    return value


def _walked(captured, tp: int, options: PlanOptions, written: tuple[str, ...]):
    """Propagation on a copy of the captured graph: the plan by node names, and the graph's code."""
    gm = copy_graph_module(captured.gm)
    sites = find_sites(gm, captured.param_shapes)
    normalize(gm, sites, tp)
    plan = propagation.propagate(gm, sites, tp, None, options, written=written)
    record = {f.name: _by_name(getattr(plan, f.name)) for f in dataclasses.fields(plan)}
    # filled from sets of regions: its order is no walk's
    record["gathered_early"] = sorted(record["gathered_early"])
    return record, gm.code


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", STACKS)
def test_stamping_the_copies_gives_the_walk_of_every_block(name, tp, option):
    build, inputs = STACKS[name]
    torch.manual_seed(0)
    captured = capture(build(), (inputs,))
    assert len(captured.written) >= 2
    stamped, visited = (_walked(captured, tp, OPTIONS[option], written) for written in (captured.written, ()))
    assert stamped[0] == visited[0]
    assert stamped[1] == visited[1]  # norms written out alike


def _stamped_blocks(build, inputs, tp: int, options: PlanOptions = OPTIONS["default"]) -> tuple[str, ...]:
    captured = capture(build(), (inputs,))
    gm = captured.gm
    sites = find_sites(gm, captured.param_shapes)
    normalize(gm, sites, tp)
    carries_grad = gradient_flow.carries_grad(gm)
    copies = propagation.block_copies(gm.graph, sites, carries_grad, captured.written)
    walk = propagation.Propagation(gm, sites, tp, None, options, carries_grad, copies=copies)
    walk.run()
    return walk.stamped


def test_a_written_stack_is_decided_once_and_stamped():
    torch.manual_seed(0)
    assert _stamped_blocks(_hf_llama, IDS, 4) == ("model.layers.2", "model.layers.3", "model.layers.4")
    # the residual stream arrives sharded over the sequence: each block is visited
    assert _stamped_blocks(_hf_llama, IDS, 4, PlanOptions(sequence_parallel=True)) == ()


def test_every_container_a_walk_writes_is_stamped():
    """A walk's state that stamping does not know of would be left out of every copy."""
    captured = capture(_hf_llama(3), (IDS,))
    walk = propagation.Propagation(captured.gm, find_sites(captured.gm, captured.param_shapes), 2)
    read_only = {"site_of", "expert_of", "owned", "output_site", "param_fqns"}
    containers = {name for name, value in vars(walk).items() if isinstance(value, (dict, set))}
    assert containers - read_only == set(propagation.STATE_KEYS)
    assert set(walk.state()) == set(propagation.STATE_KEYS)
    assert all(isinstance(kind, Key) for kind in propagation.STATE_KEYS.values())


def test_a_deep_model_plans_alike_written_or_traced():
    torch.manual_seed(0)
    model = _hf_llama(8)
    for options in ({}, {"loss_parallel": True}, {"sequence_parallel": True}):
        once = autoshard.plan(model, {"dp": 2, "tp": 4}, example_inputs=(IDS,), **options)
        full = autoshard.plan(model, {"dp": 2, "tp": 4}, example_inputs=(IDS,), trace_blocks_once=False, **options)
        assert once == full and str(once) == str(full)
        assert once.predicted_comm() == full.predicted_comm()


def test_the_owner_of_a_path_is_the_first_listed_block_holding_it():
    assert owner_block("a.b.c", ("a.b", "a")) == "a.b"
    assert owner_block("a.b.c", ("a", "a.b")) == "a"
    assert owner_block("a.b", ("a.b",)) == "a.b"
    assert owner_block("ab.c", ("a",)) is None
    assert owner_block("layers.10.mlp", ("layers.1", "layers.10")) == "layers.10"


def _runs_around_everywhere(gm: fx.GraphModule, blocks: tuple[str, ...]) -> tuple[str, ...]:
    """Callable blocks by searching everything downstream and upstream of each block."""
    unit = _assign_units(gm, blocks)

    def reach(start, step):
        seen, frontier = set(), list(start)
        while frontier:
            for nxt in step(frontier.pop()):
                if nxt not in seen:
                    seen.add(nxt)
                    frontier.append(nxt)
        return seen

    callable_ = []
    for block in blocks:
        members = {n for n, u in unit.items() if u == block}
        after, before = reach(members, lambda n: n.users), reach(members, lambda n: n.all_input_nodes)
        if members and not (after & before) - members:
            callable_.append(block)
    return tuple(callable_)


class _SharedNormTwice(torch.nn.Module):
    """``norms.0`` runs twice around a root op: it cannot be one call."""

    def __init__(self):
        super().__init__()
        self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(32), torch.nn.LayerNorm(32)])
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x):
        x = self.norms[0](x)
        x = self.norms[1](torch.relu(self.proj(x)))
        return self.norms[0](x)


@pytest.mark.parametrize("build, inputs", [
    (_SharedNormTwice, torch.randn(2, 5, 32)),
    (STACKS["hf_llama_5"][0], IDS),
    (STACKS["mlp_stack_4"][0], STACKS["mlp_stack_4"][1]),
])
def test_callable_blocks_are_those_a_search_of_the_whole_graph_finds(build, inputs):
    model = build()
    captured = capture(model, (inputs,), trace_blocks_once=False)
    blocks = find_blocks(model)
    assert callable_blocks(captured.gm, blocks) == _runs_around_everywhere(captured.gm, blocks)


def test_planning_pauses_the_garbage_collector_and_restores_it():
    seen = []
    model = MLPStack(num_blocks=3)
    model.register_forward_pre_hook(lambda module, args: seen.append(gc.isenabled()))
    x = torch.randn(2, 8, 32)
    assert gc.isenabled()
    autoshard.plan(model, {"tp": 2}, example_inputs=(x,))
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        autoshard.plan(model, {"tp": 2}, example_inputs=(x,))
        assert not gc.isenabled()  # a collector the caller paused stays paused
    finally:
        gc.enable()
