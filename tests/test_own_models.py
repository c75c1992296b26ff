"""Model code as other libraries write it: regions, containers, lazy buffers, frozen weights.

Each pattern of ``LIBRARY_PATTERNS`` (tests/pattern_models.py) is proven in one process on 2x2,
tp=4 and tp=8 (8 heads), with no tp break and exactly its analytic minimum of tp collectives per
block, and the user's model is the same after planning and proving as before (every parameter,
buffer and module attribute). The capture pieces they rely on are tested by themselves: regions
inlined with their dtype and grad-mode meaning, blocks found in nested containers, and torch's
calling convention for ``clip_grad_norm_``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._ops import HigherOrderOperator
from torch.distributed.fsdp import MixedPrecisionPolicy

import autoshard
from autoshard.passes.capture import capture, find_blocks
from tests.fingerprint import assert_unchanged, fingerprint
from tests.pattern_models import (
    LIBRARY_PATTERNS,
    VOCAB,
    AutocastScores,
    Config,
    NanoGPT,
    NoGradRope,
    PaddingBranchEncoder,
)
from tests.plan_invariants import assert_breaks_complete

TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
OTHER_TOKENS = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(3))
MESHES = {"2x2": {"dp": 2, "tp": 2}, "tp4": {"tp": 4}, "tp8": {"tp": 8}}
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _build(name: str, mesh: dict):
    """The pattern; for tp=8 with 8 heads (2 kv heads where the pattern groups its queries)."""
    build, _ = LIBRARY_PATTERNS[name]
    torch.manual_seed(0)
    if mesh.get("tp") != 8:
        return build()
    grouped = build().cfg.kv_heads < build().cfg.heads
    return build(Config(heads=8, kv_heads=2 if grouped else 8))


def _minimum(name: str, block: str) -> int:
    minimum = LIBRARY_PATTERNS[name][1]
    return minimum[block] if isinstance(minimum, dict) else minimum


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", sorted(LIBRARY_PATTERNS))
def test_library_pattern_is_proven_at_its_minimum_and_leaves_the_model_as_it_was(name, mesh):
    model = _build(name, MESHES[mesh])
    before = fingerprint(model)
    proof = autoshard.check(model, MESHES[mesh], example_inputs=(TOKENS,))
    assert proof.ok, str(proof)
    plan = proof.plan
    assert not plan.breaks, plan.breaks_line()
    assert_breaks_complete(plan)
    blocks = [u for u in plan.units if u]
    assert len(blocks) == model.cfg.layers, plan.units
    for block in blocks:
        minimum = _minimum(name, block) + (model.cfg.kv_heads % MESHES[mesh]["tp"] != 0)
        assert plan.num_tp_collectives(block) == minimum, (block, str(plan))
    assert proof.tp_collectives == plan.predicted_comm()["tp"]
    assert_unchanged(before, fingerprint(model))
    model(TOKENS)  # the user's own forward still runs (nanoGPT's then registers its mask, as it does unsharded)


@pytest.mark.parametrize("name", ["autocast_rope", "autocast_scores", "attribute_tied", "nanogpt", "torch_mha"])
def test_library_pattern_is_proven_in_bf16_on_other_inputs(name):
    model = _build(name, MESHES["2x2"])
    proof = autoshard.check(model, MESHES["2x2"], example_inputs=(OTHER_TOKENS,), mp_policy=BF16)
    assert proof.ok, str(proof)
    assert not proof.plan.breaks, proof.plan.breaks_line()


# --- regions ---------------------------------------------------------------------------------------


def _region_ops(gm) -> list:
    return [n for n in gm.graph.nodes if isinstance(n.target, HigherOrderOperator)]


def test_an_enabled_autocast_region_is_inlined_with_the_casts_it_makes():
    """Scores under ``autocast(cpu, bfloat16)``: the matmul reads bf16 casts of q and k, written
    into the graph, and the captured graph gives the model's values."""
    model = AutocastScores()
    captured = capture(model, (TOKENS,))
    assert not _region_ops(captured.gm)
    matmuls = [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.matmul.default
               and n.meta["val"].dtype == torch.bfloat16]
    assert len(matmuls) == model.cfg.layers
    for matmul in matmuls:
        assert all(a.target is torch.ops.aten.to.dtype and a.args[1] == torch.bfloat16 for a in matmul.args)
    torch.testing.assert_close(captured.gm(TOKENS), model(TOKENS), rtol=0, atol=0)


def test_a_no_grad_region_is_inlined_and_its_outputs_carry_no_gradient():
    model = NoGradRope()
    captured = capture(model, (TOKENS,))
    assert not _region_ops(captured.gm)
    detached = [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.detach.default]
    assert len(detached) == 2  # cos and sin leave the region
    torch.testing.assert_close(captured.gm(TOKENS), model(TOKENS), rtol=0, atol=0)


class ClampedScaleBlock(nn.Module):
    """A learned scale kept in range by a ``@torch.no_grad()`` method that clamps it in place inside
    the forward, as public code keeps temperatures and gates in range."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)
        self.scale = nn.Parameter(torch.linspace(0.5, 2.5, 32))

    @torch.no_grad()
    def _keep_in_range(self):
        self.scale.clamp_(0.0, 1.5)

    def forward(self, x):
        self._keep_in_range()
        return x + self.fc2(F.gelu(self.fc1(x * self.scale)))


class ClampedScales(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([ClampedScaleBlock() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_parameter_written_in_place_under_no_grad_is_read_as_written_and_still_trained():
    """The write inside the no-grad region is kept as its functional twin: the forward reads the
    clamped values, the gradient reaches the parameter as eager autograd gives it (the code reads
    the parameter itself after the write), and the user's parameter is not written."""
    torch.manual_seed(0)
    model, x = ClampedScales(), torch.randn(2, 8, 32)
    before = model.layers[0].scale.detach().clone()
    proof = autoshard.check(model, {"dp": 2, "tp": 2}, example_inputs=(x,))
    assert proof.ok, proof
    assert torch.equal(model.layers[0].scale.detach(), before)
    captured = capture(model, (x,))
    assert not _region_ops(captured.gm)
    assert not any(getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable
                   for n in captured.gm.graph.nodes)
    eager = copy.deepcopy(model)
    eager(x).sum().backward()  # clamps eager's own copy, then differentiates through the clamped scale
    params = dict(captured.gm.named_parameters())
    for p in params.values():
        p.grad = None
    captured.gm(x).sum().backward()
    torch.testing.assert_close(captured.gm(x), eager(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(params["layers.0.scale"].grad, eager.layers[0].scale.grad)


class NestedRegions(nn.Module):
    """A bf16 autocast region inside a no-grad one, and an fp32 region inside that."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.table = nn.Linear(16, 16)

    def forward(self, x):
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                scale = self.table(x)  # bf16
                with torch.autocast("cpu", enabled=False):
                    scale = scale.float().sigmoid()
        return self.proj(x) * scale


def test_nested_regions_are_inlined_each_with_its_own_meaning():
    model = NestedRegions()
    x = torch.randn(4, 16)
    captured = capture(model, (x,))
    assert not _region_ops(captured.gm)
    linears = [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    weights = {n.args[1].target if n.args[1].op == "get_attr" else n.args[1].args[0].target: n for n in linears}
    assert weights["table.weight"].args[1].target is torch.ops.aten.to.dtype  # the cast autocast makes
    assert weights["table.weight"].meta["val"].dtype == torch.bfloat16
    assert weights["proj.weight"].meta["val"].dtype == torch.float32
    assert sum(n.target is torch.ops.aten.detach.default for n in captured.gm.graph.nodes) == 1
    torch.testing.assert_close(captured.gm(x), model(x), rtol=0, atol=0)
    captured.gm(x).sum().backward()
    assert captured.gm.get_parameter("table.weight").grad is None


class CondModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: self.proj(t), lambda t: self.proj(t) * 2, (x,))


def test_a_higher_order_op_no_rule_covers_is_refused_by_name_and_line():
    model = CondModel()
    before = fingerprint(model)
    with pytest.raises(NotImplementedError, match=r"higher-order op cond at test_own_models\.py:\d+"):
        autoshard.plan(model, {"tp": 2}, example_inputs=(torch.randn(4, 16),))
    assert_unchanged(before, fingerprint(model))


# --- data-dependent branches ---------------------------------------------------------------------


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded_example", "padded_example"])
def test_a_branch_on_a_tensors_value_is_taken_as_the_example_takes_it_and_checked(padded):
    """fair-esm's ``if not padding_mask.any(): padding_mask = None``: captured for the example's way
    (export alone stops there), proven on 2x2 and tp=4, and an input that goes the other way is
    stopped by name and line, not run down a path the capture never saw."""
    model = PaddingBranchEncoder()
    example = TOKENS.clone()
    other = TOKENS.clone()
    (example if padded else other)[:, -3:] = PaddingBranchEncoder.padding_idx
    before = fingerprint(model)
    for mesh in ("2x2", "tp4"):
        proof = autoshard.check(model, MESHES[mesh], example_inputs=(example,))
        assert proof.ok, str(proof)
        assert not proof.plan.breaks, proof.plan.breaks_line()
        # fresh token ids hold the padding row: only the padded example's branch accepts them
        assert proof.inputs == "fresh" if padded else proof.inputs.startswith("the example's"), proof.inputs
    assert_unchanged(before, fingerprint(model))
    captured = capture(model, (example,))
    assert len(captured.branches) == 1 and "pattern_models.py" in captured.branches[0], captured.branches
    assert torch.equal(captured.gm(example), model(example))
    with pytest.raises(RuntimeError, match=r"take the branch at pattern_models\.py:\d+ `if not padding_mask"):
        captured.gm(other)


def test_a_branch_on_a_tensors_value_is_refused_by_line_on_the_meta_device():
    with torch.device("meta"):
        model = PaddingBranchEncoder()
    with pytest.raises(ValueError, match=r"pattern_models\.py:\d+.*data-dependent"):
        autoshard.plan(model, MESHES["2x2"], example_inputs=(TOKENS,))


class Float32BufferInBf16(nn.Module):
    """A float32 buffer (a rotary or scale table) multiplied into activations: under bf16 parameters
    the product is float32, and the next matmul meets a bf16 weight, as FSDP2 itself runs it."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.register_buffer("table", torch.linspace(0.5, 1.5, 32))

    def forward(self, x):
        return self.down(self.up(x) * self.table)


def test_mixed_precision_on_a_float32_buffer_is_refused_naming_the_buffer_and_the_fix():
    model = Float32BufferInBf16()
    refused = r"keeps table in another dtype\. Pass buffer_dtype=torch\.bfloat16"
    with pytest.raises((ValueError, NotImplementedError), match=refused):
        autoshard.check(model, MESHES["2x2"], example_inputs=(torch.randn(4, 16),), mp_policy=BF16)
    # the fix it names: the buffers held and computed in bf16, as FSDP1's buffer_dtype did
    proof = autoshard.check(model, MESHES["2x2"], example_inputs=(torch.randn(4, 16),), mp_policy=BF16,
                            buffer_dtype=torch.bfloat16)
    assert proof.ok, str(proof)
    assert model.table.dtype == torch.float32  # the user's model keeps its own
    model.table.data = model.table.data.to(torch.bfloat16)  # or cast by hand
    assert autoshard.check(model, MESHES["2x2"], example_inputs=(torch.randn(4, 16),), mp_policy=BF16).ok
    with pytest.raises(ValueError, match="buffer_dtype casts buffers under mixed precision; pass mp_policy"):
        autoshard.plan(model, MESHES["2x2"], example_inputs=(torch.randn(4, 16),), buffer_dtype=torch.bfloat16)


class MaskedZeroBlock(nn.Module):
    """x-transformers' attention ends with ``einx.where('b n, b n d, -> b n d', mask, out, 0.)``,
    which makes the ``0.`` a float32 tensor of shape (1, 1, 1): under bf16 parameters the block
    returns float32 (a dimensioned float32 operand wins type promotion)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x, mask):
        out = self.down(torch.relu(self.up(x)))
        return x + torch.where(mask[..., None], out, torch.zeros(1, 1, 1))


class MaskedZeroEncoder(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 2):
        super().__init__()
        self.layers = nn.ModuleList([MaskedZeroBlock(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 32)

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)


def test_a_block_returning_float32_under_bf16_is_refused_naming_the_op_and_output_dtype():
    model = MaskedZeroEncoder()
    x, mask = torch.randn(4, 8, 16), torch.rand(4, 8) > 0.3
    refused = (r"node 'linear_4' .* fails in the captured graph.*Its float32 operand is made float32 by node "
               r"'where_1' .*test_own_models\.py:\d+ `return x \+ torch\.where.*\(in block 'layers\.1'\).*"
               r"output_dtype=torch\.bfloat16")
    with pytest.raises(NotImplementedError, match=refused):
        autoshard.check(model, MESHES["2x2"], example_inputs=(x, mask), mp_policy=BF16)
    # the fix it names: FSDP2 casts each unit's outputs, and capture casts them where FSDP2 does
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.bfloat16)
    proof = autoshard.check(model, MESHES["2x2"], example_inputs=(x, mask), mp_policy=policy)
    assert proof.ok, str(proof)
    # the input enters tp at the up projection, its gradient summed back (none for the user's input), and
    # the down projection's partial sums are reduced once
    assert not proof.plan.breaks and [proof.plan.num_tp_collectives(f"layers.{i}") for i in (0, 1)] == [1, 2]
    assert proof.plan.mixed_precision["output_dtype"] == "bfloat16"
    graph = capture(model, (x, mask), compute_dtype=torch.bfloat16, output_dtype=torch.bfloat16).gm.graph
    narrowed = [n for n in graph.nodes if n.target is torch.ops.aten.to.dtype
                and n.args[0].meta["val"].dtype == torch.float32 and n.args[1] == torch.bfloat16]
    assert len(narrowed) == 2, graph  # each block's float32 output
    # and the model's own unit: its outputs handed on in float32 (a loss computed wide)
    head = nn.Linear(16, 8)
    graph = capture(head, (x,), compute_dtype=torch.bfloat16, output_dtype=torch.float32).gm.graph
    (logits,) = graph.output_node().args[0]
    assert logits.target is torch.ops.aten.to.dtype and logits.meta["val"].dtype == torch.float32


def test_cast_forward_inputs_false_leaves_each_blocks_inputs_as_they_come():
    model = MaskedZeroEncoder()
    x, mask = torch.randn(4, 8, 16), torch.rand(4, 8) > 0.3

    def casts(cast_inputs: bool) -> int:
        gm = capture(model, (x, mask), compute_dtype=torch.bfloat16, cast_inputs=cast_inputs).gm
        return sum(n.target is torch.ops.aten.to.dtype and n.args[0].op == "placeholder" for n in gm.graph.nodes)

    assert casts(True) >= 1  # the float32 input cast on its way into the first block
    assert casts(False) == 0  # FSDP2 with cast_forward_inputs=False: the float32 input meets bf16 as it is
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    with pytest.raises(NotImplementedError, match="does not run on these inputs and options, unsharded"):
        autoshard.check(model, MESHES["2x2"], example_inputs=(x, mask), mp_policy=policy)


# --- blocks --------------------------------------------------------------------------------------


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)


def test_blocks_are_found_in_a_stack_inside_a_namespace_of_unlike_modules():
    assert find_blocks(NanoGPT()) == ("transformer.h.0", "transformer.h.1")
    plan = autoshard.plan(NanoGPT(), {"dp": 2, "tp": 2}, example_inputs=(TOKENS,))
    assert plan.units == ("", "transformer.h.0", "transformer.h.1")  # the embeddings and ln_f in the root
    assert plan.params["transformer.wte.weight"].unit == "" and plan.params["transformer.ln_f.weight"].unit == ""


def test_a_sequential_model_keeps_its_embedding_and_head_in_the_root():
    model = nn.Sequential(nn.Embedding(8, 4), Layer(), Layer(), Layer(), nn.LayerNorm(4), nn.Linear(4, 8))
    assert find_blocks(model) == ("1", "2", "3")


def test_every_stack_is_found_and_a_module_dict_of_like_layers_is_one():
    model = nn.Module()
    model.encoder = nn.Module()
    model.encoder.layers = nn.ModuleList([Layer(), Layer()])
    model.decoder = nn.Module()
    model.decoder.layers = nn.ModuleDict({"0": Layer(), "1": Layer()})  # torchtitan keeps its layers so
    assert find_blocks(model) == ("encoder.layers.0", "encoder.layers.1", "decoder.layers.0", "decoder.layers.1")


def test_pairs_of_layers_in_a_module_list_are_blocks_and_a_patch_embedding_is_not():
    """vit-pytorch: ``layers = ModuleList([ModuleList([attention, feed_forward]), ...])`` called as
    ``for attn, ff in self.layers``; its patch embedding a ``Sequential`` of unlike leaves."""
    model = nn.Module()
    model.to_patch_embedding = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4), nn.LayerNorm(4))
    model.layers = nn.ModuleList([nn.ModuleList([Layer(), Layer()]) for _ in range(2)])
    assert find_blocks(model) == ("layers.0.0", "layers.0.1", "layers.1.0", "layers.1.1")


class PlainTie:
    """torchtune's ``TiedLinear``: a plain object (no module) holding the embedding."""

    def __init__(self, embedding: nn.Embedding):
        self.tied_module = embedding

    def __call__(self, x):
        return nn.functional.linear(x, self.tied_module.weight)


class PlainTiedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                     for _ in range(2)])
        self.output = PlainTie(self.embed)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h)
        return self.output(h)


class ClosureTiedModel(PlainTiedModel):
    """x-transformers: the logits computed by a lambda that closes over the embedding."""

    def __init__(self):
        super().__init__()
        self.output = lambda h: h @ self.embed.weight.t()


@pytest.mark.parametrize("model_class", [PlainTiedModel, ClosureTiedModel])
def test_a_weight_tied_through_an_object_or_a_closure_is_read_in_bf16_under_mixed_precision(model_class):
    torch.manual_seed(0)
    model = model_class()
    before = fingerprint(model)
    proof = autoshard.check(model, {"dp": 2, "tp": 2}, example_inputs=(TOKENS,), mp_policy=BF16)
    assert proof.ok, str(proof)
    assert_unchanged(before, fingerprint(model))


def test_a_stack_of_leaf_layers_is_still_one_block_per_layer():
    assert find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))) == ("0", "2")
    assert find_blocks(nn.Sequential(nn.Linear(4, 4))) == ("0",)


# --- clipping ------------------------------------------------------------------------------------


def test_clip_grad_norm_takes_torchs_arguments():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    twin = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    twin.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    model(x).sum().backward()
    twin(x).sum().backward()
    got = autoshard.clip_grad_norm_(model.parameters(), 0.1, norm_type=2.0, error_if_nonfinite=True, foreach=None)
    want = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1)
    torch.testing.assert_close(got, want)
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad)
    model[0].weight.grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        autoshard.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    with pytest.raises(TypeError, match="iterable of tensors"):
        autoshard.clip_grad_norm_(1.0, 1.0)


# --- frozen weights --------------------------------------------------------------------------------


def test_a_plan_names_the_frozen_parameters_and_the_gradients_a_rank_holds():
    from autoshard.plans.plan import Plan
    from tests.pattern_models import FrozenEmbeddingDecoder

    model = FrozenEmbeddingDecoder()
    plan = autoshard.plan(model, {"dp": 2, "tp": 2}, example_inputs=(TOKENS,))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert set(plan.frozen) == frozen and len(frozen) == 5
    values, gradients = plan.values_per_rank()
    # a rank's quarter of the embedding (128 x 64) and of each wq (64 x 64), half of each norm (64, whole over tp)
    assert values - gradients == 128 * 64 // 4 + 2 * 64 * 64 // 4 + 2 * 64 // 2
    assert f"frozen: 5 of {len(plan.params)} parameters" in str(plan)
    assert Plan.from_dict(plan.to_dict()).frozen == plan.frozen
