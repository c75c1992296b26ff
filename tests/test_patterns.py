"""Model code written the way public code writes it keeps tensor parallelism.

Every pattern of :mod:`tests.pattern_models`, in one process on 2x2 and tp=4: proven against
the unsharded model (outputs and every gradient, fresh inputs), no tp break, and exactly the
analytic minimum of tp collectives per block, as planned and as the emitted code runs them.
One 4-process gloo group (2x2) trains three of them end to end, where FSDP and real collectives
take part: loss and every parameter after 3 SGD steps equal the single-device run (<= 1e-5),
and the tp collectives of a step are measured.
"""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.comm_stats import CollectiveCounter
from tests.distributed import distributed_tests
from tests.parity import assert_parity, dp_slice, lm_loss, train_both
from tests.pattern_models import PATTERNS, VOCAB
from tests.plan_invariants import assert_breaks_complete

# tp collectives per block per training step (forward + backward), the analytic minimum:
# a sequential block 2 + 2 (attention output and MLP output all-reduced forward, one input
# gradient per colwise group backward); a parallel block 1 + 1 (one normed input, one sum
# of partial outputs); a norm over a sharded width adds its statistics all-reduce, forward
# and backward (wide q/k norms: 2 norms x 2). A mixture-of-experts block: its experts' gate|up
# (colwise) and down (rowwise) cost what a dense MLP does, 1 + 1, with a narrow router computed
# whole. Top-k outputs gathered per (token, choice) are reduced before their routing weights
# multiply them; a loop over experts multiplies each expert's partial output by its routing
# weight instead, so the routing weights' gradient is a sum over the tp-sharded width: one
# more all-reduce, in backward (reducing each expert's output first would cost one per expert).
MINIMUM = {
    "interleaved_rope": 4,
    "repeat_interleave_gqa": 4,
    "alibi_bias": 4,
    "sdpa_bias_mask": 4,
    "baddbmm_attention": 4,
    "wide_qk_norm": 8,
    "parallel_block": 2,
    "custom_function": 4,
    "moe_indexed": 4,
    "moe_loop": 5,
    "reference_llama": 4,
    "arange_rope": 4,
    "fused_qkv_hooks": 4,
    "expand_as_mask": 4,
    "vision_fused_qkv": 4,
    # the latent path (wkv_a, narrowing) is computed whole: the gradients of the latent and of the
    # rotary key shared by all heads are each all-reduced in backward (2 more than a dense block)
    "latent_attention": 6,
    "adaln_modulation": 4,  # the per-sample modulation computed whole (passes/alternatives.py)
}
# trained end to end on real gloo ranks: a dense block, the partial-sum regrouping, experts, and
# q|k|v fused the vision way, latent attention and adaLN modulation
END_TO_END = ("interleaved_rope", "wide_qk_norm", "moe_loop", "vision_fused_qkv", "latent_attention",
              "adaln_modulation")
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
    minimum = MINIMUM[name] + (model.cfg.kv_heads % mesh["tp"] != 0)
    for block in (u for u in plan.units if u.startswith("layers.")):
        got = plan.num_tp_collectives(block)
        assert got == minimum, f"{name}: {block} plans {got} tp collectives, minimum {minimum}"
    ran = sum(n for n, _ in proof.tp_collectives.values())
    assert ran == plan.num_tp_collectives(), (name, proof.tp_collectives, str(plan))
    assert proof.tp_collectives == plan.predicted_comm()["tp"]


def _make_check(name: str):
    def check(ctx):
        mesh = ctx.mesh_2d
        torch.manual_seed(0)
        model = PATTERNS[name]()
        tokens = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
        targets = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
        run = train_both(model, mesh, tokens, targets, lm_loss, optimizer="sgd", steps=3)
        assert_parity(run, loss_tol=1e-5, param_tol=1e-5)

        plan = run.sharded.autoshard_plan
        assert not plan.breaks, f"{name}: tp stops inside blocks: {plan.breaks_line()}"
        assert plan.breaks_line() == f"tp breaks: 0 of {len(plan.units) - 1} blocks"
        if name == "custom_function":
            assert len(plan.functions) == 1 and "SiLUFunction" in plan.functions[0], plan.functions
        for block in (u for u in plan.units if u.startswith("layers.")):
            got = plan.num_tp_collectives(block)
            assert got == MINIMUM[name], f"{name}: {block} plans {got} tp collectives, minimum {MINIMUM[name]}"
        axes = {a: mesh.get_group(a) for a in mesh.mesh_dim_names}
        local = dp_slice(tokens, mesh)
        with CollectiveCounter(axes) as step:
            lm_loss(run.sharded(local), dp_slice(targets, mesh)).backward()
        assert step.count("tp") == plan.num_tp_collectives(), (name, step.stats(), str(plan))

    check.__name__ = check.__qualname__ = f"check_{name}"
    check.__module__ = __name__
    return check


CHECKS = [_make_check(name) for name in END_TO_END]

outcomes, test_pattern = distributed_tests(CHECKS)
