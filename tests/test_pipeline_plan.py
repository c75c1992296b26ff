"""Pipeline plans in one process: the split, what crosses each boundary, the stitched proof, errors.

Training on real ranks (schedules, parity, checkpoints, measured sends) is in
``tests/test_pipeline.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard import Plan
from autoshard.axes.pp_axis import plan_pipeline
from autoshard.core.options import PipelineOptions, PlanOptions
from autoshard.driver import planning
from autoshard.driver.entry_points import INNER
from autoshard.plans.stage_costs import UnitCost, balance, equal_split, schedule_of
from examples.models import Llama, LlamaConfig
from tests import hf_cases
from tests.pattern_models import EmbeddingMixDecoder

TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))


def _llama(layers: int = 4, vocab: int = 256) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(num_layers=layers, vocab_size=vocab))


def _pplan(model, sizes, inputs=(TOKENS,), kwargs=None, loss_parallel=False, **pipelined):
    pipelined = {"split" if k == "pp_split" else k: v for k, v in ({"microbatches": 2} | pipelined).items()}
    return plan_pipeline(INNER, model, planning.mesh_axes(sizes), inputs, kwargs, None,
                         PlanOptions(loss_parallel=loss_parallel), PipelineOptions(**pipelined), keep_reference=True)


def test_plan_lists_the_stages_and_survives_a_round_trip():
    plan = autoshard.plan(_llama(), {"pp": 2, "dp": 2, "tp": 2}, example_inputs=(TOKENS,), microbatches=2)
    stages = plan.pipeline.stages
    assert [s.units for s in stages] == [("layers.0", "layers.1"), ("layers.2", "layers.3")]
    assert [s.rank for s in stages] == [0, 1] and [s.in_flight for s in stages] == [2, 1]
    assert dict(plan.mesh) == {"pp": 2, "dp": 2, "tp": 2}
    assert stages[1].flops > stages[0].flops  # the LM head's matmul runs on the last stage
    assert Plan.from_dict(plan.to_dict()) == plan
    text = str(plan)
    assert "pipeline: 2 stages (balanced), schedule 1F1B, 2 microbatches" in text
    assert "stage 1 (pp rank 1): layers.2 .. layers.3 (2 blocks)" in text


def test_a_heavy_head_moves_blocks_off_the_last_stage():
    """A 4096-word head on 8 small blocks: the balanced split gives the last stage fewer blocks than
    torchtitan's equal split, and its slowest stage is cheaper."""
    model = _llama(layers=8, vocab=4096)
    tokens = torch.randint(0, 4096, (4, 16))
    balanced = autoshard.plan(model, {"pp": 4, "tp": 2}, example_inputs=(tokens,), microbatches=4)
    blocks = tuple(f"layers.{i}" for i in range(8))
    equal = autoshard.plan(model, {"pp": 4, "tp": 2}, example_inputs=(tokens,), microbatches=4,
                           pp_split=equal_split(blocks, 4))
    assert equal.pipeline.chosen == "given" and [len(s.units) for s in equal.pipeline.stages] == [2, 2, 2, 2]
    assert len(balanced.pipeline.stages[-1].units) < 2
    slowest = max(s.flops for s in balanced.pipeline.stages)
    assert slowest < 0.9 * max(s.flops for s in equal.pipeline.stages)
    # and no other split of the blocks into 4 contiguous runs has a cheaper slowest stage
    pplan = _pplan(model, {"pp": 4, "tp": 2}, inputs=(tokens,), microbatches=4)
    flops = [c.flops for c in pplan.costs]
    best = min(max(sum(flops[a:b]) for a, b in zip((0, *cuts), (*cuts, 8), strict=True))
               for cuts in itertools.combinations(range(1, 8), 3))
    assert slowest == pytest.approx(best)


def test_memory_per_rank_bounds_every_stage():
    """The split is the cheapest slowest stage among the splits whose every stage fits (checked against
    all splits), where the cheapest unbounded one does not fit; 1F1B's first stage holds the most
    microbatches, so it takes fewer of the activation-heavy blocks."""
    flops = [1.0] * 6 + [3.0]  # six blocks, the last with the head
    costs = [UnitCost(f"layers.{i}", f, param_bytes=100, activation_bytes=1000) for i, f in enumerate(flops)]
    schedule = schedule_of("1F1B", 4, pp=3)  # in flight: 3, 2 and 1 microbatches

    def memory(run, stage):
        return len(run) * (100 * 4 + 1000 * schedule.in_flight(stage, 3))

    def splits():
        for a, b in itertools.combinations(range(1, 7), 2):
            yield [costs[:a], costs[a:b], costs[b:]]

    free = balance(costs, schedule, pp=3)
    assert [len(r) for r in free] == [3, 3, 1]  # 3 FLOPs each
    limit = 7000  # the first stage fits two blocks (6800 bytes), not three (10200)
    bounded = balance(costs, schedule, pp=3, memory_per_rank=limit)
    fitting = [runs for runs in splits() if all(memory(r, i) <= limit for i, r in enumerate(runs))]
    best = min(max(sum(c.flops for c in r) for r in runs) for runs in fitting)
    runs = [[c for c in costs if c.unit in run] for run in bounded]
    assert all(memory(r, i) <= limit for i, r in enumerate(runs))
    assert max(sum(c.flops for c in r) for r in runs) == best and [len(r) for r in bounded][0] <= 2
    with pytest.raises(ValueError, match=r"no split of the 7 blocks into 3 stages fits memory_per_rank=1000 bytes"):
        balance(costs, schedule, pp=3, memory_per_rank=1000)


def test_values_every_block_reads_cross_every_boundary_and_the_stitched_stages_prove():
    """The embedding (mixed into every block) and a padding mask made from the ids are computed
    before the first block and read by all: both are carried through each stage, the mask as bool
    (no gradient); the stages run in order prove exactly against the model."""
    torch.manual_seed(0)
    model = EmbeddingMixDecoder()
    tokens = torch.randint(0, 128, (4, 16))
    tokens[::2, -3:] = 0
    pplan = _pplan(model, {"pp": 4, "tp": 2}, inputs=(tokens,), microbatches=4)
    carried = pplan.split.carried
    assert len(carried) == 3 and all(len(c) == 3 for c in carried)  # the stream, the embedding, the mask
    kinds = sorted((str(pplan.crossings[n].dtype), pplan.crossings[n].requires_grad) for n in carried[1])
    assert kinds == [("torch.bool", False), ("torch.float32", True), ("torch.float32", True)]
    proof = autoshard.check(model, {"pp": 4, "tp": 2}, example_inputs=(tokens,), microbatches=4)
    assert proof.ok, str(proof)
    assert proof.max_output_error < 1e-5 and proof.max_gradient_error < 1e-5


def test_constants_are_recomputed_by_each_stage_not_sent():
    """The rotary tables sliced to the sequence depend on no input: each stage slices its own."""
    pplan = _pplan(_llama(), {"pp": 2, "tp": 2})
    assert len(pplan.split.carried[0]) == 1  # the hidden state alone
    for stage in pplan.split.stages:
        reads = {n.target for n in stage.module.graph.nodes if n.op == "get_attr"}
        assert {"rope_cos", "rope_sin"} <= reads
    first, last = pplan.split.stages
    assert "tok_embeddings.weight" in first.params and "output.weight" in last.params
    assert not set(first.params) & set(last.params)


def _swap_two_float_inputs_of_the_last_stage(pplan) -> None:
    """Break the cut on purpose: the last stage reads its first two float inputs the other way round."""
    last = pplan.split.stages[-1]
    floats = [n for n in last.module.graph.nodes
              if n.op == "placeholder" and pplan.crossings[n.name].dtype == torch.float32]
    a, b = floats[:2]
    a_users, b_users = list(a.users), list(b.users)
    for user in a_users:
        user.replace_input_with(a, b)
    for user in b_users:
        user.replace_input_with(b, a)
    last.module.recompile()


def test_a_stage_cut_that_loses_a_value_fails_the_proof():
    """Hand the last stage its two inputs swapped: the stitched proof fails, naming a node."""
    from autoshard.axes.pp_axis import prove_pipeline

    torch.manual_seed(0)
    model = EmbeddingMixDecoder(Config2())
    tokens = torch.randint(1, 128, (4, 16))
    pplan = _pplan(model, {"pp": 2, "tp": 2}, inputs=(tokens,), microbatches=2)
    _swap_two_float_inputs_of_the_last_stage(pplan)
    proof = prove_pipeline(INNER, pplan, model, planning.mesh_axes({"pp": 2, "tp": 2}))
    assert not proof.ok and "node" in str(proof)


@pytest.mark.parametrize("sizes", [{"pp": 2, "cp": 2, "tp": 2}, {"pp": 2, "dp": 2, "cp": 2}, {"pp": 2, "cp": 4},
                                   {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 2}],
                         ids=["pp2xcp2xtp2", "pp2xdp2xcp2", "pp2xcp4", "pp2xhsdp2x2xcp2xtp2"])
def test_pipeline_stages_with_context_parallelism_are_proven_on_the_cp_grid(sizes):
    """Each stage is the stage mesh's cp code: the first keeps its cp rank's positions of the
    whole microbatch, the hidden states cross at their cp-local length, the last gathers the logits
    whole. The stages called in order are proven on every cp x tp rank, the loss's gradients
    summed over cp as FSDP's average over dp x cp takes them."""
    torch.manual_seed(0)
    model = hf_cases.small_llama_4_blocks()
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    proof = autoshard.check(model, sizes, example_inputs=(tokens,), microbatches=2)
    assert proof.ok, str(proof)
    assert (proof.cp, proof.tp) == (sizes["cp"], sizes.get("tp", 1)) and proof.cp_collectives
    plan = proof.plan
    assert dict(plan.mesh) == sizes and plan.context.seq == 16 and len(plan.pipeline.stages) == 2
    # one microbatch of 2 rows: the hidden states' gradient sent back at 16 / cp positions, 64 wide
    (_, _, back_messages, back_bytes), = plan.pipeline.sends
    assert (back_messages, back_bytes) == (1, 2 * (16 // sizes["cp"]) * 64 * 4), plan.pipeline.sends


@pytest.mark.parametrize("sizes", [{"pp": 2, "tp": 2}, {"pp": 2, "cp": 2, "tp": 2}], ids=["pp2xtp2", "pp2xcp2xtp2"])
def test_loss_parallelism_through_the_stages_leaves_the_logits_cut_over_tp(sizes):
    """With loss_parallel the last stage returns the logits cut over tp, as without pp: the proof
    compares each tp rank's chunk of the vocabulary, and the last stage's code ends in the DTensor."""
    from autoshard.runtime.collectives import as_sharded_dtensor

    torch.manual_seed(0)
    proof = autoshard.check(_llama(), sizes, example_inputs=(TOKENS,), microbatches=2, loss_parallel=True)
    assert proof.ok, str(proof)
    pplan = _pplan(_llama(), sizes, inputs=(TOKENS,), microbatches=2, loss_parallel=True)
    (logits,) = pplan.split.stages[-1].module.graph.output_node().args[0]
    assert logits.target is as_sharded_dtensor and logits.args[1] == 2


def test_swapped_stage_values_under_context_parallelism_are_caught_at_a_node():
    """The last stage handed two of its float inputs swapped, on pp2 x cp2 x tp2: the cp grid's proof
    of the stitched stages fails and names the first node whose value differs."""
    from autoshard.axes.pp_axis import prove_pipeline

    torch.manual_seed(0)
    model = EmbeddingMixDecoder(Config2())
    tokens = torch.randint(1, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    sizes = {"pp": 2, "cp": 2, "tp": 2}
    pplan = _pplan(model, sizes, inputs=(tokens,), microbatches=2)
    assert prove_pipeline(INNER, pplan, model, planning.mesh_axes(sizes)).ok
    _swap_two_float_inputs_of_the_last_stage(pplan)
    proof = prove_pipeline(INNER, pplan, model, planning.mesh_axes(sizes))
    assert not proof.ok
    divergence = proof.first_divergence or ""
    assert re.match(r"node '\w+' \(.*\) at pattern_models\.py:\d+ .*differs from the reference's", divergence), \
        str(proof)


def Config2():
    from tests.pattern_models import Config

    return Config(layers=2)


def test_hugging_face_llama_with_a_padding_mask_proves_in_stages():
    model = hf_cases._llama()
    ids, kwargs = hf_cases.HFCase("llama", hf_cases._llama, uses_mask=True).inputs(batch=4)
    proof = autoshard.check(model, {"pp": 2, "dp": 2, "tp": 2}, example_inputs=(ids,), example_kwargs=kwargs,
                            microbatches=2)
    assert proof.ok, str(proof)
    assert proof.max_output_error < 1e-5


def test_a_parameter_read_on_two_stages_is_refused_by_name():
    model = hf_cases._llama_tied()
    ids = torch.randint(0, 128, (4, 16))
    with pytest.raises(NotImplementedError, match=r"parameter 'model.embed_tokens.weight' is read on pipeline "
                                                   r"stages \[0, 1\].*Untie it"):
        autoshard.plan(model, {"pp": 2, "tp": 2}, example_inputs=(ids,), microbatches=2)


@pytest.mark.parametrize("change, message", [
    (dict(microbatches=3), r"dp-local batch \(4 rows.*does not divide into microbatches=3"),
    (dict(schedule="Zigzag"), r"schedule 'Zigzag' is not one of torch.distributed.pipelining's"),
    (dict(pp_split=["layers.1", "layers.9"]), r"pp_split names \['layers.9'\], which are not blocks"),
    (dict(pp_split=["layers.1", "layers.2"]), r"pp_split gives 3 stages \(2 split points\), the mesh and schedule "
                                              r"run 2"),
    (dict(pp_split=["layers.0"]), r"must name each stage's first block in forward order"),
    (dict(schedule="1F1B", microbatches=1), r"1F1B needs at least as many microbatches as stages \(2\), got 1"),
    (dict(schedule="Interleaved1F1B", microbatches=4), r"8 pipeline stages \(pp=4 x 2 per rank\) need at least as "
                                                        r"many blocks; the model has 4"),
])
def test_bad_pipeline_options_get_clear_errors(change, message):
    sizes = {"pp": 4, "tp": 2} if change.get("schedule") == "Interleaved1F1B" else {"pp": 2, "tp": 2}
    options = dict(microbatches=2) | change
    with pytest.raises(ValueError, match=message):
        autoshard.plan(_llama(), sizes, example_inputs=(TOKENS,), **options)


def test_pipeline_options_without_a_pp_axis_and_a_pp_mesh_without_a_loss(fake_world):
    model = _llama()
    with pytest.raises(ValueError, match=r"microbatches configure pipeline stages, and this mesh has no 'pp' axis"):
        autoshard.plan(model, {"dp": 2, "tp": 2}, example_inputs=(TOKENS,), microbatches=2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"trains through a schedule that runs the loss on the last stage: pass "
                                         r"loss_fn"):
        autoshard.autoshard(model, mesh, example_inputs=(TOKENS,), microbatches=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_schedule_name_is_taken_in_any_case_and_interleaving_lays_stages_out_looped():
    plan = autoshard.plan(_llama(layers=4), {"pp": 2, "tp": 2}, example_inputs=(TOKENS,), microbatches=2,
                          schedule="interleaved1f1b")
    assert plan.pipeline.schedule.name == "Interleaved1F1B"
    assert [s.rank for s in plan.pipeline.stages] == [0, 1, 0, 1]
    plan = autoshard.plan(_llama(layers=4), {"pp": 2, "tp": 2}, example_inputs=(TOKENS,), microbatches=4,
                          schedule="ZBVZeroBubble")
    assert [s.rank for s in plan.pipeline.stages] == [0, 1, 1, 0]
    assert dataclasses.asdict(plan.pipeline.schedule) == {"name": "ZBVZeroBubble", "microbatches": 4,
                                                          "stages_per_rank": 2}


@pytest.mark.parametrize("sizes", [{"pp": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 2}, {"pp": 2, "dp": 4},
                                   {"pp": 4}])
def test_every_pp_mesh_shape_plans_and_proves(sizes):
    """HSDP, dp alone and pp alone below the stages: the stage plan is the sub-mesh's, the stitched
    stages prove."""
    model = _llama()
    proof = autoshard.check(model, sizes, example_inputs=(TOKENS,), microbatches=4)
    assert proof.ok, str(proof)
    assert dict(proof.plan.mesh) == sizes
    stage_axes = {a: n for a, n in sizes.items() if a != "pp"}
    flat = autoshard.plan(model, stage_axes or {"dp": 1}, example_inputs=(TOKENS[:1],)) if stage_axes else None
    if flat is not None:
        assert {f: p.placements for f, p in proof.plan.params.items()} == {f: p.placements for f, p in
                                                                            flat.params.items()}
