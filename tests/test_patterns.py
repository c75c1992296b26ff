"""Model code written the way public code writes it keeps tensor parallelism.

Every pattern of :mod:`tests.pattern_models`, in one process on 2x2 and tp=4: proven against
the unsharded model (outputs and every gradient, fresh inputs), no tp break, and exactly the
analytic minimum of tp collectives per block, as planned and as the emitted code runs them.
One 4-process gloo group trains the patterns of other libraries end to end on 2x2 and on tp=4,
and three more on 2x2, where FSDP and real collectives take part: loss and every parameter
after 3 SGD steps equal the single-device run (<= 1e-5; bf16 grouped experts 2e-3), and the
tp collectives of a step are exactly the plan's.
"""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.adapters.comm_stats import CollectiveCounter
from autoshard.core.sharding import Role
from tests.distributed import distributed_tests
from tests.parity import assert_parity, dp_slice, lm_loss, train_both
from tests.pattern_models import DATA_DEPENDENT_ROWS, MINIMUM, PATTERNS, VOCAB, block_minimum
from tests.plan_invariants import assert_breaks_complete

# trained end to end on real gloo ranks, on 2x2 (dp x tp) and on tp=4: a dense block, the
# partial-sum regrouping and experts (2x2), and the patterns of other libraries on both meshes
END_TO_END = (("interleaved_rope", "2d"), ("wide_qk_norm", "2d"), ("moe_loop", "2d")) + tuple(
    (name, mesh) for name in ("vision_fused_qkv", "latent_attention", "adaln_modulation", "moe_grouped_mm",
                              "reused_embedder", "shared_layer") for mesh in ("2d", "tp")) + (
    # a fused q|k|v whose k/v sections are stored whole on every tp rank: 2 kv heads on tp=4, 1 on tp=2
    ("grouped_fused_qkv", "tp"), ("indexed_multi_query", "2d"),
    # a concatenation of sharded sections read by one rowwise linear (its input rows permuted)
    ("flux_single_stream", "2d"),
    # a state-space mixer: channel-cut conv, scan and parameters, the weight-on-the-left dt_proj
    ("mamba_mixer", "tp"),
    # q|k|v concatenated through a depthwise conv and split back: the conv stores its channels in sections
    ("gated_deltanet", "2d"),
    # dense convolutions cut over channels: weights stored cut on dim 0 or 1, FSDP on the other
    ("conv_resnet", "2d"),
    # Mamba-2's x|B|C through a depthwise conv with B and C whole on every rank (in_proj's columns and
    # the conv's channels stored in sections), a per-section constant cut in the stored order
    ("mup_mamba2_mixer", "2d"),
    # LoRA adapters: lora_A whole, lora_B colwise (in its base's fused sections), their weights' partial
    # gradients summed with the block's bucket
    ("lora_adapters", "2d"),
    # grouped 1x1 convs (SqueezeBERT): each rank takes its chunk of the replicated input for its groups,
    # the output conv's cut channels gathered at the block's end
    ("grouped_conv_block", "2d"),
    # routed and shared experts entering tp at the one input a router computed whole also reads
    ("moe_shared_expert", "2d"),
    # a depthwise conv over the values' heads, one head per rank: its local conv folded over the batch
    ("conv_value_skip", "tp"),
    # a fused q|k|v bias concatenated from parameters and a zeros buffer: q_bias and v_bias stored cut
    ("eva_concatenated_qkv_bias", "2d"),
    # a parallel residual whose rowwise biases are added after the one all-reduce of both partial sums
    ("biased_two_norm_parallel", "2d"))
WHOLE_SECTIONS = {"grouped_fused_qkv", "indexed_multi_query", "mup_mamba2_mixer"}
# stored in sections: the state dict reloads into the single-device layout, clipping sees the true norm
RELOADED = WHOLE_SECTIONS | {"gated_deltanet"}
# the grouped experts multiply in bfloat16 (the kernel's dtype): one device sums each expert's
# down projection in one bf16 result, tp ranks each round their partial sum to bf16 first
# gated DeltaNet's decay mask is exp of cumulative sums: the reordered tp sums' rounding reaches
# the k/v projections' updates at ~2e-5 after 3 steps (its one-process proof holds at 1e-4)
PARITY_TOLERANCE = {"moe_grouped_mm": 2e-3, "gated_deltanet": 1e-4}
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("mesh", [{"dp": 2, "tp": 2}, {"tp": 4}], ids=["2x2", "tp4"])
@pytest.mark.parametrize("name", sorted(MINIMUM))
def test_pattern_is_proven_at_its_minimum(name, mesh):
    torch.manual_seed(0)
    model = PATTERNS[name]()
    proof = autoshard.check(model, mesh, example_inputs=(TOKENS,))
    assert proof.ok, str(proof)
    plan = proof.plan
    assert not plan.breaks, f"{name}: tp stops inside blocks: {plan.breaks_line()}"
    assert_breaks_complete(plan)
    if name == "custom_function":
        assert len(plan.functions) == 1 and "SiLUFunction" in plan.functions[0], plan.functions
    # fewer kv heads than tp: k and v are computed whole and cut per q head; their gradients
    # travel in one all-gather more (tests/test_kv_heads.py)
    blocks = [u for u in plan.units if u.startswith("layers.")]
    assert blocks, plan.units
    for block in blocks:
        got, minimum = plan.num_tp_collectives(block), block_minimum(name, block)
        minimum += model.cfg.kv_heads % mesh["tp"] != 0
        assert got == minimum, f"{name}: {block} plans {got} tp collectives, minimum {minimum}"
    ran = sum(n for n, _ in proof.tp_collectives.values())
    assert ran == plan.num_tp_collectives(), (name, proof.tp_collectives, str(plan))
    if name not in DATA_DEPENDENT_ROWS:
        assert proof.tp_collectives == plan.predicted_comm()["tp"]


class SharedTwice(torch.nn.Module):
    """One weight in two linears, the second reading the first's sharded output."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 32, bias=False)
        self.b = torch.nn.Linear(32, 32, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("mesh", [{"dp": 2, "tp": 2}, {"tp": 4}], ids=["2x2", "tp4"])
def test_a_weight_read_by_two_linears_is_one_decision_kept_at_both_reads(mesh):
    """The first read decides colwise; the second keeps it and gathers its input (one layout
    cannot be colwise for one read and rowwise for the other: the shards differ)."""
    proof = autoshard.check(SharedTwice(), mesh, example_inputs=(torch.randn(4, 32),))
    assert proof.ok, str(proof)
    (entry,) = proof.plan.params.values()
    assert entry.role == Role.COLWISE
    assert proof.plan.num_tp_collectives() == 3  # the second read's input gathered, its gradient summed back


def test_a_final_modulation_in_a_unit_of_its_own_is_computed_whole_as_in_the_root():
    """DiT's final layer modulates the last norm with ``Sequential(SiLU(), Linear(dim, 2 * dim))``,
    its own FSDP unit. It runs once per step, so its extra work is weighed against the model's,
    not against its own: computed whole, the head stays colwise and no logits are all-reduced."""
    plan = autoshard.plan(PATTERNS["reused_embedder"](), {"dp": 2, "tp": 2}, example_inputs=(TOKENS,))
    assert "final_modulation.1" in plan.units
    assert plan.params["final_modulation.1.weight"].role == Role.REPLICATE
    assert "computed whole, the plan's tp collectives are" in plan.params["final_modulation.1.weight"].note
    assert plan.params["output.weight"].role == Role.COLWISE
    assert plan.num_tp_collectives("final_modulation.1") == 0


def _make_check(name: str, mesh_name: str):
    def check(ctx):
        mesh = getattr(ctx, f"mesh_{mesh_name}")
        torch.manual_seed(0)
        model = PATTERNS[name]()
        tokens = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
        targets = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
        run = train_both(model, mesh, tokens, targets, lm_loss, optimizer="sgd", steps=3)
        tolerance = PARITY_TOLERANCE.get(name, 1e-5)
        assert_parity(run, loss_tol=tolerance, param_tol=tolerance)

        plan = run.sharded.autoshard_plan
        assert not plan.breaks, f"{name}: tp stops inside blocks: {plan.breaks_line()}"
        assert plan.breaks_line() == f"tp breaks: 0 of {len(plan.units) - 1} blocks"
        if name == "custom_function":
            assert len(plan.functions) == 1 and "SiLUFunction" in plan.functions[0], plan.functions
        tp = mesh["tp"].size()
        for block in (u for u in plan.units if u.startswith("layers.")):
            got, minimum = plan.num_tp_collectives(block), block_minimum(name, block)
            minimum += model.cfg.kv_heads % tp != 0
            assert got == minimum, f"{name}: {block} plans {got} tp collectives, minimum {minimum}"
        axes = {a: mesh.get_group(a) for a in mesh.mesh_dim_names}
        local = dp_slice(tokens, mesh)
        with CollectiveCounter(axes) as step:
            lm_loss(run.sharded(local), dp_slice(targets, mesh)).backward()
        assert step.count("tp") == plan.num_tp_collectives(), (name, step.stats(), str(plan))
        if name in RELOADED:
            # whole sections are stored once per tp rank, a conv's channels section by section: the
            # state dict has each column once, in order, and loading the single-device weights back
            # gives its outputs
            if name in WHOLE_SECTIONS:
                assert any(p.whole_sections for p in plan.params.values()), str(plan)
            else:
                assert plan.params["layers.0.attention.conv1d.weight"].sections == (64, 64, 64), str(plan)
            run.sharded.load_state_dict(run.reference.state_dict())
            with torch.no_grad():
                expected = run.reference(tokens)
                got = run.sharded(local)
            torch.testing.assert_close(got, dp_slice(expected, mesh), rtol=1e-5, atol=1e-5)
            # and gradient clipping counts each column once: the single-device norm
            run.sharded.zero_grad()
            run.reference.zero_grad()
            lm_loss(run.sharded(local), dp_slice(targets, mesh)).backward()
            lm_loss(run.reference(tokens), targets).backward()
            expected_norm = torch.nn.utils.clip_grad_norm_(run.reference.parameters(), 1e9)
            norm = autoshard.clip_grad_norm_(run.sharded, 1e9)
            torch.testing.assert_close(norm, expected_norm, rtol=1e-5, atol=0)

    check.__name__ = check.__qualname__ = f"check_{name}_{mesh_name}"
    check.__module__ = __name__
    return check


CHECKS = [_make_check(name, mesh_name) for name, mesh_name in END_TO_END]

outcomes, test_pattern = distributed_tests(CHECKS)
