"""Expert parallelism in one process: which MoE layers ep splits and why, the plan's record, and the
refusals, on the spellings experts are written in.

The multi-rank runs (tests/test_expert_parallel.py) train these layers; here each spelling is
planned on ``{"dp": 2, "ep": 2}`` and the experts' placements, choices and refusals are read back.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import autoshard
from autoshard.core.sharding import placements_text
from autoshard.plans.ep_choice import ExpertLayer, choose
from autoshard.plans.plan import Plan
from tests import pattern_models as pm
from tests.moe_cases import MOE_MODELS
from tests.moe_cases import tokens as hf_tokens

TOKENS = torch.randint(0, pm.Config().vocab, (2, 8), generator=torch.Generator().manual_seed(0))


def _plan(experts, sizes=None) -> Plan:
    torch.manual_seed(0)
    return autoshard.plan(pm.ExpertsMoE(pm.Config(), experts=experts), sizes or {"dp": 2, "ep": 2},
                          example_inputs=(TOKENS,))


@pytest.mark.parametrize("experts", ["IndexedExperts", "GroupedExperts", "InterleavedExperts"])
def test_routed_experts_are_split_whole_over_ep(experts):
    plan = _plan(getattr(pm, experts))
    assert [c.choice for c in plan.experts] == ["ep", "ep"]
    split = plan.ep_weights()
    names = {"gate_up_proj", "down_proj"} | ({"gate_up_proj_bias", "down_proj_bias"} if experts == "InterleavedExperts"
                                             else set())
    assert split == {f"layers.{i}.feed_forward.experts.{n}" for i in range(2) for n in names}
    assert all(c.fsdp for c in plan.experts)  # each layer's experts module is their own FSDP unit over dp
    for fqn in split:
        assert placements_text(plan.params[fqn].placements) == {"dp": "S(1)", "ep": "S(0)"}, fqn
    dense = plan.params["layers.0.attention.wq.weight"]
    assert placements_text(dense.placements) == {"dp": "S(0)", "ep": "S(0)"}  # FSDP over dp x ep, as any data axis
    assert "experts layers.0.feed_forward.experts: ep (" in str(plan)


def test_with_tp_the_experts_keep_their_tp_cut():
    plan = _plan(pm.IndexedExperts, {"ep": 2, "tp": 2})
    entry = plan.params["layers.0.feed_forward.experts.gate_up_proj"]
    assert placements_text(entry.placements)["ep"] == "S(0)"
    assert placements_text(entry.placements)["tp"] in ("S(1)", "S(2)")


def test_the_choice_says_both_costs_and_the_cheaper_wins():
    layer = ExpertLayer(module="moe.experts", weights=("moe.experts.w1", "moe.experts.w2"), num_experts=64,
                        form="grouped", rows=8192 * 8, itemsize=2, shapes=((64, 2048, 1536), (64, 768, 2048)),
                        gemms=((2048, 1536), (768, 2048)), line="x")
    many_tokens = choose(layer, {"dp": 2, "ep": 4}, 2)
    assert many_tokens.choice == "ep" and many_tokens.ep_bytes < many_tokens.dp_bytes
    moved = 2 * layer.rows * (2048 + 2048) * 2 * 3 // 4  # rows out and back, forward and backward
    assert many_tokens.ep_bytes >= moved
    few_weights = choose(ExpertLayer(**{**layer.__dict__, "shapes": ((64, 8, 8), (64, 8, 8))}), {"ep": 4}, 2)
    assert few_weights.choice == "dp" and "fewer bytes than sending the rows" in few_weights.why
    assert "16 of 64 experts" in many_tokens.why


def test_a_loop_over_experts_is_refused_by_line():
    with pytest.raises(NotImplementedError, match=r"ep cannot split any MoE layer.*a loop over experts.*pattern_"):
        _plan(pm.LoopExperts)


def test_dense_routing_is_refused_by_line():
    with pytest.raises(NotImplementedError, match=r"every expert reads every token \(a dense routing\)"):
        autoshard.plan(pm.ExpertsMoE(pm.Config(), experts=pm.BatchedExperts), {"ep": 2}, example_inputs=(TOKENS,))


def test_experts_ep_does_not_divide_are_refused_by_name():
    with pytest.raises(ValueError, match=r"ep=8 does not divide the experts of layers.0.feed_forward.experts: 4 "
                                         r"experts, at node 'bmm'"):
        _plan(pm.IndexedExperts, {"ep": 8})


def test_a_model_without_experts_is_refused():
    with pytest.raises(ValueError, match=r"has an 'ep' axis \(ep=2\) and the model has no experts"):
        autoshard.plan(pm.Decoder(pm.Config(), lambda c: pm.Block(c, pm.QKVAttention, pm.SwiGLU)), {"ep": 2},
                       example_inputs=(TOKENS,))


def test_a_value_leaving_the_experts_midway_keeps_them_whole_with_the_reason():
    class Leaky(pm.IndexedExperts):
        def forward(self, x, top_idx, top_w):
            tokens, k = top_idx.shape
            xs = x.repeat_interleave(k, dim=0)
            ids = top_idx.reshape(-1)
            h = torch.bmm(self.gate_up_proj[ids], xs.unsqueeze(-1)).squeeze(-1)
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
            out = torch.bmm(self.down_proj[ids], h.unsqueeze(-1)).squeeze(-1) + h.mean() * 0
            return (out * top_w.reshape(-1, 1)).view(tokens, k, -1).sum(dim=1)

    with pytest.raises(NotImplementedError, match=r"has no rule that keeps rows apart|values leave the experts"):
        _plan(Leaky)


def test_the_plan_keeps_its_expert_choices_through_a_dict():
    plan = _plan(pm.GroupedExperts)
    again = Plan.from_dict(plan.to_dict())
    assert again == plan and again.experts == plan.experts
    with pytest.raises(ValueError, match=r"split over ep is decided by cost on the mesh it is planned for"):
        plan.for_mesh({"dp": 4})


MESHES = [{"ep": 4}, {"dp": 2, "ep": 2}, {"ep": 2, "tp": 2}, {"dp": 2, "ep": 2, "tp": 2}]
SAMPLE = [("IndexedExperts", m) for m in MESHES] + [("InterleavedExperts", MESHES[2]), ("GroupedExperts", MESHES[1])]


@pytest.mark.parametrize(("experts", "sizes"), SAMPLE)
def test_every_ep_rank_is_simulated_on_its_own_batch(experts, sizes):
    """The proof runs every ep x tp rank, each routing its own batch, the all-to-alls between them:
    five per layer and step (counts, rows out and back, their gradients back and out)."""
    _proven(experts, sizes)


@pytest.mark.long
@pytest.mark.parametrize(("experts", "sizes"), [(e, m) for e in ("GroupedExperts", "InterleavedExperts")
                                                for m in MESHES if (e, m) not in SAMPLE])
def test_every_ep_rank_is_simulated_on_every_mesh(experts, sizes):
    _proven(experts, sizes)


@pytest.mark.parametrize(("experts", "sizes"), [("IndexedExperts", {"ep": 2, "cp": 2}),
                                                ("GroupedExperts", {"ep": 2, "cp": 2, "tp": 2}),
                                                ("InterleavedExperts", {"dp": 2, "ep": 2, "cp": 2})])
def test_ep_with_cp_is_simulated_on_the_ep_x_cp_x_tp_grid(experts, sizes):
    """Each ep rank on its own batch, each cp rank of it on its sequence chunks: every cp rank routes
    its own positions' tokens and exchanges them within its ep group; an expert's gradient is summed
    over cp (its FSDP unit's average) and held to its experts' rows of the reference's."""
    _proven(experts, sizes)


def test_an_expert_pick_by_ids_cut_along_the_sequence_stays_cut():
    """``W[ids]`` with ``ids`` cut over cp (each rank's tokens' choices) is cut as the ids are, as an
    embedding is: no gather of the ids and no re-cut of the picked weights, and ep finds the pick
    next to its matmul."""
    torch.manual_seed(0)
    plan = autoshard.plan(pm.ExpertsMoE(pm.Config(), experts=pm.IndexedExperts), {"cp": 2}, example_inputs=(TOKENS,))
    assert plan.context.gathered_whole == (), plan.context.gathered_whole
    plan = autoshard.plan(pm.ExpertsMoE(pm.Config(), experts=pm.IndexedExperts), {"ep": 2, "cp": 2},
                          example_inputs=(TOKENS,))
    assert [c.choice for c in plan.experts] == ["ep", "ep"] and all(c.fsdp for c in plan.experts)


def _proven(experts, sizes):
    torch.manual_seed(0)
    proof = autoshard.check(pm.ExpertsMoE(pm.Config(), experts=getattr(pm, experts)), sizes, example_inputs=(TOKENS,))
    assert proof.ok, str(proof)
    assert proof.ep == sizes["ep"] and proof.ep_collectives["all_to_all"][0] == 2 * 5
    plan = proof.plan
    assert proof.ep_collectives["all_to_all"][1] > 0 and plan.predicted_comm()["ep"]["all_to_all"][0] == 10
    if experts == "GroupedExperts":
        assert proof.exact == "float32"  # the grouped GEMM has no float64 kernel: judged by a float32 run


def _emitted(sizes):
    from autoshard.core.mesh import axes_from_sizes
    from autoshard.core.options import Options
    from autoshard.driver.planning import emit, plan_result

    torch.manual_seed(0)
    model = pm.ExpertsMoE(pm.Config(), experts=pm.IndexedExperts)
    axes, options = axes_from_sizes(sizes), Options().plan_options()
    planned = plan_result(model, axes, (TOKENS,), None, None, options, keep_reference=True)
    return model, axes, planned, emit(planned, axes, options, keep_planned=True)


def _prove(model, axes, planned, emitted):
    from autoshard.driver.planning import prove_grid

    return prove_grid(planned, model, (TOKENS,), None, axes, emitted)


def test_a_misordered_exchange_is_caught():
    """The second layer's combine puts its rows back by its order reversed: the same rows, in the
    wrong places."""
    from autoshard.runtime.token_dispatch import EP_COMBINE, EP_DISPATCH

    model, axes, planned, emitted = _emitted({"ep": 2})
    assert _prove(model, axes, planned, emitted).ok
    nodes = [n for gm in emitted.parts.root.modules() if isinstance(gm, torch.fx.GraphModule) for n in gm.graph.nodes]
    combines = [n for n in nodes if n.target is EP_COMBINE]
    assert len(combines) == 2 == len([n for n in nodes if n.target is EP_DISPATCH])
    block = combines[1].graph.owning_module
    order = next(u for u in combines[1].args[1].args[0].users if u.args[1] == 3)  # this layer's own order
    with block.graph.inserting_after(order):
        flipped = block.graph.call_function(torch.ops.aten.flip.default, (order, [0]))
    combines[1].replace_input_with(order, flipped)
    block.recompile()
    proof = _prove(model, axes, planned, emitted)
    assert not proof.ok and any(m.what.startswith("output") and not m.ok for m in proof.outputs)


def test_a_dropped_combine_is_caught():
    from autoshard.proof.simulate import EmittedCodeError
    from autoshard.runtime.token_dispatch import EP_COMBINE

    model, axes, planned, emitted = _emitted({"ep": 2})
    block = next(gm for gm in emitted.parts.root.modules() if isinstance(gm, torch.fx.GraphModule)
                 and any(n.target is EP_COMBINE for n in gm.graph.nodes))
    combine = next(n for n in block.graph.nodes if n.target is EP_COMBINE)
    combine.replace_all_uses_with(combine.args[0])
    block.graph.erase_node(combine)
    block.recompile()
    try:
        proof = _prove(model, axes, planned, emitted)
    except EmittedCodeError:
        return  # the rows this rank's experts computed are not the rows it routed: shapes differ
    assert not proof.ok


@pytest.mark.parametrize("name", sorted(MOE_MODELS))
@pytest.mark.parametrize("impl", [None, "batched_mm"])
def test_hugging_face_experts_are_split_over_ep(name, impl):
    torch.manual_seed(0)
    model = MOE_MODELS[name](impl)
    ids, _ = hf_tokens(batch=2)
    plan = autoshard.plan(model, {"dp": 2, "ep": 2}, example_inputs=(ids,))
    assert plan.experts and all(c.choice == "ep" for c in plan.experts), [c.line_text() for c in plan.experts]
    experts = [n for n, p in model.named_parameters() if p.dim() == 3]
    assert set(experts) == plan.ep_weights()
    shared = [fqn for fqn in plan.params if "shared_experts" in fqn]
    assert all("ep" not in str(plan.params[f].note) for f in shared)  # a shared expert stays a dense MLP


def test_the_mesh_order_puts_ep_between_the_data_axes_and_tp():
    from torch.distributed.device_mesh import DeviceMesh  # noqa: F401  (the names are what is checked)

    from autoshard.core.mesh import accepted

    assert accepted(("dp", "ep")) and accepted(("ep", "tp")) and accepted(("dp", "ep", "tp"))
    assert accepted(("pp", "ep", "cp", "tp")) and accepted(("dp_replicate", "dp_shard", "ep", "cp"))
    assert not accepted(("ep", "dp")) and not accepted(("tp", "ep")) and not accepted(("cp", "ep"))


@pytest.mark.parametrize("sizes", [{"pp": 2, "ep": 2, "tp": 2}, {"pp": 2, "dp": 2, "ep": 2}])
def test_pipeline_stages_split_their_experts_over_ep(sizes):
    """A pp mesh plans its stages on the stage mesh: each MoE layer's experts split over the stage's ep,
    with the layer's block on one stage; the stages called in order are proven against the unsharded
    model with every ep (x tp) rank simulated on its own batch (five all-to-alls per layer and
    microbatch). Planning the stages' crossings runs the code on fake tensors, where the rows an
    expert receives are data: the crossing is the combine's output, of its input's shape."""
    torch.manual_seed(0)
    proof = autoshard.check(pm.ExpertsMoE(pm.Config(), experts=pm.IndexedExperts), sizes, example_inputs=(TOKENS,))
    assert proof.ok, str(proof)
    plan = proof.plan
    assert proof.ep == 2 and proof.ep_collectives["all_to_all"][0] == 2 * 5
    assert [c.choice for c in plan.experts] == ["ep", "ep"]
    stage_of = {unit: stage.index for stage in plan.pipeline.stages for unit in stage.units}
    assert [stage_of[c.module.rsplit(".feed_forward", 1)[0]] for c in plan.experts] == [0, 1]
    for fqn in plan.ep_weights():
        assert plan.params[fqn].placements["ep"] == Shard(0), fqn
    (_, hidden, _, _), = plan.pipeline.sends  # one microbatch row of 8 positions, 64 wide, float32
    assert hidden == 1 * 8 * 64 * 4, plan.pipeline.sends
