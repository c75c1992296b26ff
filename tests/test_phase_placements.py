"""The placements phase and the materialize phase, each tested by itself, in one process.

``passes/placements.py`` (``build_plan``) decides every parameter's role, stored layout and
placement per mesh axis; ``autoshard/runtime/materialize.py`` (``materialize``) turns the
emitted graphs and that plan into the sharded module. The stages before each are run with the
project's own driver (``plan_result``, ``emit``) only to make their inputs, and the assertions
are on what the phase under test returns: a wrong placement fails here as "this weight got
that placement", not as a numerics mismatch in a multi-rank run.

Materialize runs on the fake 4-rank process group (``fake_world``), as rank 0 of a 2x2 mesh.
Its collectives are no-ops, but nothing that places a shard communicates: ``distribute_tensor``
(``src_data_rank=None``) and FSDP2 cut each rank's shard from the tensor they are given, and
the broadcast from rank 0 leaves rank 0's values as they are. So rank 0's local shards are
real values, compared with the slices of the user's weights they must hold.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoshard.core.mesh import axes_from_sizes
from autoshard.core.options import PlanOptions
from autoshard.core.sharding import Role
from autoshard.driver.planning import emit, mesh_axes, plan_result
from autoshard.passes.placements import build_plan
from autoshard.plans.plan import Plan
from autoshard.runtime.materialize import materialize
from tests.test_bad_input import assert_untouched, snapshot

R, S0, S1 = Replicate(), Shard(0), Shard(1)
DIM, HIDDEN, VOCAB = 16, 32, 64
FEATURES = torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(0))
TOKENS = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


class Block(nn.Module):
    """``up`` is colwise (``Linear(16, 32)``, weight ``[32, 16]``), ``down`` rowwise."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, HIDDEN)
        self.down = nn.Linear(HIDDEN, dim)

    def forward(self, x):
        return x + self.down(F.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    """Two blocks and a head of 8 outputs, too narrow to cut: computed whole on the stream."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TiedLM(nn.Module):
    """An embedding tied to the LM head, and a persistent and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((DIM,), 0.5))
        self.register_buffer("offset", torch.arange(float(DIM)), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens) * self.scale + self.offset
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Mixing(nn.Module):
    """``mix [32, k]`` scales the colwise output per hidden channel: read sharded over tp on its dim 0."""

    def __init__(self, k: int):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.mix = nn.Parameter(torch.randn(HIDDEN, k))
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(F.relu((self.up(x).unsqueeze(-1) * self.mix).sum(-1)))


class MixingStack(nn.Module):
    def __init__(self, k: int):
        super().__init__()
        self.blocks = nn.ModuleList(Mixing(k) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _plan(model: nn.Module, sizes: dict[str, int], inputs: tuple, dp_placements=None) -> Plan:
    """``build_plan`` on the captured graph, sites and layouts the driver's earlier stages give."""
    axes = axes_from_sizes(sizes)
    planned = plan_result(model, axes, inputs, None, None, PlanOptions())
    return build_plan(planned.captured, planned.sites, planned.layout_plan, axes, dp_placements)


@pytest.fixture(scope="module")
def stack_plan() -> Plan:
    return _plan(Stack(), {"dp": 2, "tp": 2}, (FEATURES,))


# --- placements ----------------------------------------------------------------------------


def test_a_colwise_weight_is_stored_in_out_and_cut_dp_dim_0_tp_dim_1(stack_plan):
    up = stack_plan.params["blocks.0.up.weight"]
    assert (up.role, up.shape, up.transposed, up.stored_shape) == (Role.COLWISE, (32, 16), True, (16, 32))
    assert up.placements == {"dp": S0, "tp": S1}
    assert list(up.placements) == ["dp", "tp"]
    assert up.unit == "blocks.0"


def test_a_rowwise_weight_keeps_out_in_and_is_cut_dp_dim_0_tp_dim_1(stack_plan):
    down = stack_plan.params["blocks.0.down.weight"]
    assert (down.role, down.shape, down.transposed, down.stored_shape) == (Role.ROWWISE, (16, 32), False, (16, 32))
    assert down.placements == {"dp": S0, "tp": S1}


def test_a_colwise_bias_is_cut_by_tp_and_replicated_over_dp_a_rowwise_bias_the_reverse(stack_plan):
    up_bias, down_bias = stack_plan.params["blocks.0.up.bias"], stack_plan.params["blocks.0.down.bias"]
    assert (up_bias.role, up_bias.transposed, up_bias.placements) == (Role.COLWISE_BIAS, False, {"dp": R, "tp": S0})
    assert (down_bias.role, down_bias.transposed, down_bias.placements) == (
        Role.ROWWISE_BIAS, False, {"dp": S0, "tp": R})


def test_replicated_weights_are_whole_over_tp_and_fsdp_sharded_on_dim_0(stack_plan):
    for fqn in ("blocks.0.norm.weight", "blocks.0.norm.bias", "head.weight", "head.bias"):
        entry = stack_plan.params[fqn]
        assert (entry.role, entry.transposed, entry.placements) == (Role.REPLICATE, False, {"dp": S0, "tp": R}), fqn
    head = stack_plan.params["head.weight"]
    assert head.unit == "" and head.note.startswith("replicated over tp: its 8 outputs (fewer than its 16 inputs)")
    assert stack_plan.breaks == ()  # kept whole by choice: no block's matmul reads a weight whole


def test_every_parameter_of_every_block_has_an_entry_in_its_unit(stack_plan):
    expected = [f"blocks.{i}.{m}.{p}" for i in range(2) for m, p in
                [("norm", "weight"), ("norm", "bias"), ("up", "weight"), ("up", "bias"), ("down", "weight"),
                 ("down", "bias")]] + ["head.weight", "head.bias"]
    assert list(stack_plan.params) == expected
    assert stack_plan.units == ("", "blocks.0", "blocks.1")
    assert [stack_plan.params[f].unit for f in expected] == ["blocks.0"] * 6 + ["blocks.1"] * 6 + ["", ""]


def test_fsdp_keeps_dim_0_when_it_does_not_divide_and_notes_the_padding():
    plan = _plan(Block(dim=6), {"dp": 4, "tp": 2}, (torch.randn(2, 8, 6),))
    up = plan.params["up.weight"]
    assert (up.stored_shape, up.placements) == ((6, 32), {"dp": S0, "tp": S1})
    assert up.note == "stored dim 0 (6) does not divide by dp=4: FSDP2 pads the last shard"
    assert plan.params["norm.weight"].placements == {"dp": S0, "tp": R}
    assert plan.params["norm.weight"].note == "stored dim 0 (6) does not divide by dp=4: FSDP2 pads the last shard"
    assert plan.params["up.bias"].note == ""  # replicated over dp: nothing to pad


@pytest.mark.parametrize("k, dp", [(4, S1), (3, R)], ids=["dim_1_divides", "no_other_dim_divides"])
def test_a_parameter_tp_cuts_on_dim_0_gives_fsdp_its_first_other_dim_that_divides(k, dp):
    plan = _plan(MixingStack(k), {"dp": 2, "tp": 2}, (FEATURES,))
    mix = plan.params["blocks.0.mix"]
    assert (mix.role, mix.shape, mix.transposed) == (Role.SHARDED, (32, k), False)
    assert mix.placements == {"dp": dp, "tp": S0}
    assert mix.note == "read sharded by one op over its tp-sharded dim 0: stored cut over tp"


def test_a_dp_placement_given_per_parameter_overrides_that_parameter_alone(stack_plan):
    plan = _plan(Stack(), {"dp": 2, "tp": 2}, (FEATURES,), {"blocks.0.up.weight": R})
    assert plan.params["blocks.0.up.weight"].placements == {"dp": R, "tp": S1}
    assert plan.params["blocks.1.up.weight"].placements == {"dp": S0, "tp": S1}
    others = {f: e.placements for f, e in plan.params.items() if f != "blocks.0.up.weight"}
    assert others == {f: e.placements for f, e in stack_plan.params.items() if f != "blocks.0.up.weight"}


def test_frozen_parameters_are_listed_and_placed_as_trained_ones(stack_plan):
    model = Stack()
    model.blocks[0].up.requires_grad_(False)
    plan = _plan(model, {"dp": 2, "tp": 2}, (FEATURES,))
    assert plan.frozen == ("blocks.0.up.bias", "blocks.0.up.weight")
    assert stack_plan.frozen == ()
    assert {f: (e.role, e.transposed, e.placements) for f, e in plan.params.items()} == {
        f: (e.role, e.transposed, e.placements) for f, e in stack_plan.params.items()}


def test_a_table_tied_to_the_head_is_one_vocab_parallel_entry_tp_on_rows_fsdp_on_dim_1():
    plan = _plan(TiedLM(), {"dp": 2, "tp": 2}, (TOKENS,))
    table = plan.params["embed.weight"]
    assert "head.weight" not in plan.params
    assert (table.role, table.shape, table.transposed) == (Role.VOCAB_PARALLEL, (64, 16), False)
    assert table.placements == {"dp": S1, "tp": S0}
    assert table.why.tied_with == ("head.weight",)


def test_hsdp_replicates_every_parameter_over_dp_replicate_and_shards_over_dp_shard():
    plan = _plan(Stack(), {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, (FEATURES,))
    up = plan.params["blocks.0.up.weight"]
    assert list(up.placements) == ["dp_replicate", "dp_shard", "tp"]
    assert up.placements == {"dp_replicate": R, "dp_shard": S0, "tp": S1}
    assert plan.params["blocks.0.up.bias"].placements == {"dp_replicate": R, "dp_shard": R, "tp": S0}
    assert plan.params["blocks.0.down.bias"].placements == {"dp_replicate": R, "dp_shard": S0, "tp": R}
    assert all(e.placements["dp_replicate"] == R for e in plan.params.values())


@pytest.mark.parametrize("sizes", [{"dp": 2, "cp": 2, "tp": 2}, {"cp": 2, "tp": 2}], ids=["dp_cp_tp", "cp_tp"])
def test_with_a_cp_axis_fsdp_shards_over_dp_and_cp_alike(sizes):
    plan = _plan(Stack(), sizes, (FEATURES,))
    fsdp = [a for a in sizes if a != "tp"]
    assert plan.params["blocks.0.up.weight"].placements == {**dict.fromkeys(fsdp, S0), "tp": S1}
    assert plan.params["blocks.0.up.bias"].placements == {**dict.fromkeys(fsdp, R), "tp": S0}
    assert plan.params["blocks.0.norm.weight"].placements == {**dict.fromkeys(fsdp, S0), "tp": R}
    for fqn, entry in plan.params.items():
        assert list(entry.placements) == list(sizes), fqn
        assert len({entry.placements[a] for a in fsdp}) == 1, fqn  # one choice, on the flattened axis


def test_a_mesh_without_tp_or_without_dp_has_only_its_own_axes():
    dp_only = _plan(Stack(), {"dp": 4}, (FEATURES,))
    assert dp_only.params["blocks.0.up.weight"].placements == {"dp": S0}
    assert dp_only.params["blocks.0.up.weight"].transposed  # one stored layout whatever the mesh
    assert dp_only.params["blocks.0.down.weight"].placements == {"dp": S0}
    tp_only = _plan(Stack(), {"tp": 4}, (FEATURES,))
    assert tp_only.params["blocks.0.up.weight"].placements == {"tp": S1}
    assert tp_only.params["blocks.0.up.bias"].placements == {"tp": S0}
    assert tp_only.params["blocks.0.down.bias"].placements == {"tp": R}


# --- materialize ---------------------------------------------------------------------------


@dataclasses.dataclass
class Materialized:
    model: nn.Module
    before: dict  # the model as it was when materialize was called (tests.test_bad_input.snapshot)
    plan: Plan
    sharded: nn.Module


def _materialize(model: nn.Module, mesh, inputs: tuple) -> Materialized:
    """Plan and emit as ``autoshard.autoshard`` does, then materialize on ``mesh``."""
    axes, options = mesh_axes(mesh), PlanOptions()
    planned = plan_result(model, axes, inputs, None, None, options)
    emitted = emit(planned, axes, options)
    before = snapshot(model)
    sharded = materialize(emitted.parts, model, planned.plan, axes, planned.captured.aliases)
    return Materialized(model, before, planned.plan, sharded)


@pytest.fixture(scope="module")
def tied_2x2(fake_world) -> Materialized:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = TiedLM()
    return _materialize(model, mesh, (TOKENS,))


def _original(model: nn.Module, fqn: str) -> torch.Tensor:
    return model.get_parameter(fqn).detach()


# Rank 0 is coordinate 0 on dp and on tp: it holds the first chunk of every dim a placement cuts.
RANK0_SHARDS = [
    # (fqn, placements (dp, tp), stored shape, rank 0's local shape, its slice of the stored original)
    ("blocks.0.up.weight", (S0, S1), (16, 32), (8, 16), (slice(0, 8), slice(0, 16))),
    ("blocks.0.up.bias", (R, S0), (32,), (16,), (slice(0, 16),)),
    ("blocks.0.down.weight", (S0, S1), (16, 32), (8, 16), (slice(0, 8), slice(0, 16))),
    ("blocks.0.down.bias", (S0, R), (16,), (8,), (slice(0, 8),)),
    ("blocks.1.norm.weight", (S0, R), (16,), (8,), (slice(0, 8),)),
    ("embed.weight", (S1, S0), (64, 16), (32, 8), (slice(0, 32), slice(0, 8))),
]


@pytest.mark.parametrize("fqn, placements, stored, local, where", RANK0_SHARDS, ids=[r[0] for r in RANK0_SHARDS])
def test_rank_0_holds_the_slice_of_the_stored_weight_its_placements_name(tied_2x2, fqn, placements, stored, local,
                                                                         where):
    param = tied_2x2.sharded.get_parameter(fqn)
    entry = tied_2x2.plan.params[fqn]
    assert isinstance(param, DTensor) and tuple(param.placements) == placements
    assert tuple(param.shape) == stored == entry.stored_shape
    original = _original(tied_2x2.model, fqn)
    original = original.t() if entry.transposed else original
    assert tuple(param.to_local().shape) == local
    assert torch.equal(param.to_local(), original[where])


def test_a_colwise_linear_16_to_32_is_stored_transposed_16_by_32_and_rank_0_holds_8_by_16(tied_2x2):
    weight = tied_2x2.sharded.get_parameter("blocks.0.up.weight")
    original = _original(tied_2x2.model, "blocks.0.up.weight")  # [out, in] = [32, 16]
    assert tuple(original.shape) == (32, 16) and tuple(weight.shape) == (16, 32)
    assert torch.equal(weight.to_local(), original[:16, :8].t())


def test_every_parameter_is_a_dtensor_on_the_whole_mesh_with_exactly_the_plans_placements(tied_2x2):
    sharded, plan = tied_2x2.sharded, tied_2x2.plan
    assert [name for name, _ in sharded.named_parameters()] == list(plan.params)
    for fqn, entry in plan.params.items():
        param = sharded.get_parameter(fqn)
        assert isinstance(param, DTensor), fqn
        assert param.device_mesh.mesh_dim_names == ("dp", "tp"), fqn
        assert tuple(param.placements) == (entry.placements["dp"], entry.placements["tp"]), fqn
        assert tuple(param.shape) == entry.stored_shape, fqn
        assert param.requires_grad, fqn


def test_a_tied_weight_is_one_parameter_under_both_names(tied_2x2):
    sharded = tied_2x2.sharded
    assert sharded.get_parameter("head.weight") is sharded.get_parameter("embed.weight")
    names = [name for name, _ in sharded.named_parameters(remove_duplicate=False)]
    assert names == [name for name, _ in tied_2x2.model.named_parameters(remove_duplicate=False)]
    assert len(list(sharded.parameters())) == len(tied_2x2.plan.params)


def test_buffers_are_plain_tensor_copies_persistent_as_in_the_model(tied_2x2):
    sharded, model = tied_2x2.sharded, tied_2x2.model
    for name in ("scale", "offset"):
        copy, original = sharded.get_buffer(name), model.get_buffer(name)
        assert type(copy) is torch.Tensor, name
        assert copy is not original and copy.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
        assert torch.equal(copy, original), name
    assert "scale" in sharded.state_dict() and "offset" not in sharded.state_dict()


def test_fsdp2_wraps_the_root_and_each_block_and_containers_keep_their_type(tied_2x2):
    sharded = tied_2x2.sharded
    assert isinstance(sharded, FSDPModule)
    assert isinstance(sharded.blocks, nn.ModuleList) and len(sharded.blocks) == 2
    assert all(isinstance(block, FSDPModule) for block in sharded.blocks)
    assert not isinstance(sharded.blocks[0].up, FSDPModule)  # one unit per block, not per linear


def test_the_graphs_read_each_parameter_locally_and_name_a_transposed_read_t(tied_2x2):
    code = tied_2x2.sharded.blocks[0].code
    assert "up_weight_t = self.up.weight" in code and "up_weight_t_local = up_weight_t.to_local()" in code
    assert "down_weight = self.down.weight" in code and "down_weight_local = down_weight.to_local()" in code
    assert "down_weight_t" not in code
    assert "embed_weight_local = embed_weight.to_local()" in tied_2x2.sharded.code


def test_the_state_dict_has_the_models_keys_and_original_layouts(tied_2x2):
    sharded, model = tied_2x2.sharded, tied_2x2.model
    state, original = sharded.state_dict(), model.state_dict()
    assert list(state) == list(original)
    for key, value in state.items():
        assert tuple(value.shape) == tuple(original[key].shape), key
    up = state["blocks.0.up.weight"]  # the stored [16, 32] seen as [32, 16]: placements swap dims
    assert tuple(up.placements) == (S1, S0)
    assert torch.equal(up.to_local(), original["blocks.0.up.weight"][:16, :8])


def test_the_users_model_is_not_modified_and_shares_no_storage(tied_2x2):
    assert_untouched(tied_2x2.model, tied_2x2.before)
    for fqn in tied_2x2.plan.params:
        local = tied_2x2.sharded.get_parameter(fqn).to_local()
        assert local.untyped_storage().data_ptr() != _original(tied_2x2.model, fqn).untyped_storage().data_ptr(), fqn


def test_a_frozen_parameter_stays_frozen_and_is_placed_as_planned(fake_world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Stack()
    # up.bias is replicated over dp (a colwise bias): frozen, it gets no gradient to average over dp
    model.blocks[0].up.requires_grad_(False)
    model.blocks[0].down.requires_grad_(False)
    done = _materialize(model, mesh, (FEATURES,))
    assert_untouched(model, done.before)
    frozen = {name for name, p in done.sharded.named_parameters() if not p.requires_grad}
    assert frozen == {"blocks.0.up.weight", "blocks.0.up.bias", "blocks.0.down.weight", "blocks.0.down.bias"}
    weight = done.sharded.get_parameter("blocks.0.up.weight")
    assert tuple(weight.placements) == (S0, S1) and tuple(weight.to_local().shape) == (8, 16)
    assert torch.equal(weight.to_local(), model.blocks[0].up.weight.detach()[:16, :8].t())


def test_on_a_tp_only_mesh_parameters_are_tp_dtensors_and_nothing_is_fsdp(fake_world):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    done = _materialize(Stack(), mesh, (FEATURES,))
    assert not any(isinstance(m, FSDPModule) for m in done.sharded.modules())
    weight = done.sharded.get_parameter("blocks.0.up.weight")
    assert weight.device_mesh.mesh_dim_names == ("tp",) and tuple(weight.placements) == (S1,)
    assert tuple(weight.to_local().shape) == (16, 8)
    assert torch.equal(weight.to_local(), done.model.blocks[0].up.weight.detach()[:8].t())
    for fqn, entry in done.plan.params.items():
        assert tuple(done.sharded.get_parameter(fqn).placements) == (entry.placements["tp"],), fqn
