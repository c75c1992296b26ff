"""Planning without process groups: roles, placements, plan files, discovery."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import autoshard
from autoshard import Plan
from autoshard.core.sharding import Collective
from examples.models import CumulativeMLP, Llama, LlamaConfig, MLPStack, RawLinearNet
from tests.cases import FEATURES, MODELS, TOKENS

MESHES = {
    "2x2": {"dp": 2, "tp": 2}, "tp4": {"tp": 4}, "dp4": {"dp": 4},
    "hsdp_2x2x2": {"dp_replicate": 2, "dp_shard": 2, "tp": 2},
}


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("model_name", MODELS)
def test_plan_table_snapshot(model_name, mesh_name, autoshard_snapshot):
    build, inputs = MODELS[model_name]
    plan = autoshard.plan(build(), MESHES[mesh_name], example_inputs=inputs)
    assert str(plan) + "\n" == autoshard_snapshot


def test_llama_roles_and_placements():
    plan = autoshard.plan(Llama(LlamaConfig()), {"dp": 2, "tp": 2}, example_inputs=(TOKENS,))
    roles = {fqn: p.role for fqn, p in plan.params.items() if fqn.startswith("layers.0.")}
    assert roles == {
        "layers.0.attention_norm.weight": "replicate",
        "layers.0.attention.wq.weight": "colwise",
        "layers.0.attention.wk.weight": "colwise",
        "layers.0.attention.wv.weight": "colwise",
        "layers.0.attention.wo.weight": "rowwise",
        "layers.0.ffn_norm.weight": "replicate",
        "layers.0.feed_forward.w1.weight": "colwise",
        "layers.0.feed_forward.w2.weight": "rowwise",
        "layers.0.feed_forward.w3.weight": "colwise",
    }
    for fqn, p in plan.params.items():
        if len(p.shape) == 2:
            assert dict(p.placements) == {"dp": Shard(0), "tp": Shard(1)}, fqn
            assert p.transposed == (p.role == "colwise" and "embeddings" not in fqn), fqn
    assert plan.params["output.weight"].stored_shape == (64, 256)
    assert plan.params["tok_embeddings.weight"].stored_shape == (256, 64)
    assert plan.units == ("", "layers.0", "layers.1")


def test_plan_dict_round_trips_through_json():
    plan = autoshard.plan(MLPStack(), {"dp": 2, "tp": 2}, example_inputs=(FEATURES,))
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["version"] == 2
    assert data["mesh"] == {"dp": 2, "tp": 2}
    # block 1's: block 0 reads the model's input, which needs no gradient (its norm's weights enter tp)
    assert data["params"]["blocks.1.fc1.weight"] == {
        "role": "colwise",
        "shape": [64, 32],
        "transposed": True,
        "placements": {"dp": "S(0)", "tp": "S(1)"},
        "unit": "blocks.1",
        "collectives": [{
            "kind": "all-reduce", "direction": "bwd", "subject": "input grad", "cause": "", "shared_by": [
                "blocks.1.fc1.weight"], "counted": True, "over_sequence": False, "dim": None, "axis": "tp",
            "numel": 2 * 5 * 32, "dtype": "float32",  # the input [2, 5, 32] whose gradient is all-reduced
        }],
        "note": "",
        "sections": [],
    }
    assert Plan.from_dict(data) == plan
    assert str(Plan.from_dict(data)) == str(plan)


def test_a_version_1_plan_still_loads_applies_and_counts():
    """Version 1 wrote collectives as prose: they load as prose, count as they did, and the
    plan applies (its roles and placements are what matter)."""
    plan = autoshard.plan(Llama(LlamaConfig()), {"dp": 2, "tp": 2}, example_inputs=(TOKENS,))
    data = json.loads(json.dumps(plan.to_dict()))
    data["version"] = 1
    for entry in data["params"].values():
        entry["collectives"] = [str(Collective.from_dict(c)) for c in entry["collectives"]]
    data["activations"] = [str(Collective.from_dict(a)) for a in data["activations"]]
    old = Plan.from_dict(data)
    assert old.version == 2 and old.roles() == plan.roles()
    assert [old.num_tp_collectives(u) for u in old.units] == [plan.num_tp_collectives(u) for u in plan.units]
    assert str(old) == str(plan).split("\npredicted tp traffic")[0]  # prose records carry no sizes
    assert old.for_mesh({"dp": 4}).roles() == plan.for_mesh({"dp": 4}).roles()


@pytest.mark.parametrize(
    "data, message",
    [
        ({"version": 3, "mesh": {"tp": 2}, "params": {}}, "version 3"),
        ({"version": 1, "params": {}}, "no 'mesh'"),
        ({"version": 1, "mesh": {"tp": 2}, "params": {"w": {"role": "diagonal", "transposed": False,
                                                           "placements": {}}}}, "unknown role"),
        ({"version": 1, "mesh": {"tp": 2}, "params": {"w": {"role": "colwise"}}}, "'w' lacks"),
    ],
)
def test_bad_plan_dicts_are_rejected(data, message):
    with pytest.raises(ValueError, match=message):
        Plan.from_dict(data)


class _Spellings(nn.Module):
    """One linear in each spelling, chained so roles alternate colwise/rowwise."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)  # nn.Linear: colwise
        self.w_f = nn.Parameter(torch.randn(8, 16))  # F.linear [out, in]: rowwise
        self.w_at = nn.Parameter(torch.randn(8, 16))  # x @ W [in, out]: colwise
        self.w_mm = nn.Parameter(torch.randn(8, 16))  # torch.mm(x, W.t()) [out, in]: rowwise
        self.w_addmm = nn.Parameter(torch.randn(8, 16))  # addmm [in, out]: colwise
        self.b_addmm = nn.Parameter(torch.zeros(16))

    def forward(self, x):
        h = torch.relu(self.lin(x))
        h = F.linear(h, self.w_f)
        h = torch.relu(h @ self.w_at)
        h = torch.mm(h, self.w_mm.t())
        return torch.addmm(self.b_addmm, h, self.w_addmm)


def test_every_linear_spelling_is_discovered():
    plan = autoshard.plan(_Spellings(), {"tp": 2}, example_inputs=(torch.randn(3, 8),))
    got = {fqn: (p.role, p.transposed, p.placements["tp"]) for fqn, p in plan.params.items()}
    assert got == {
        "lin.weight": ("colwise", True, Shard(1)),
        "lin.bias": ("colwise_bias", False, Shard(0)),
        "w_f": ("rowwise", False, Shard(1)),
        "w_at": ("colwise", False, Shard(1)),
        "w_mm": ("rowwise", False, Shard(1)),
        "w_addmm": ("colwise", False, Shard(1)),
        "b_addmm": ("colwise_bias", False, Shard(0)),
    }


def test_x_at_w_used_rowwise_is_stored_transposed():
    plan = autoshard.plan(RawLinearNet(), {"dp": 2, "tp": 2}, example_inputs=(FEATURES,))
    mid = plan.params["w_mid"]
    assert (mid.role, mid.transposed, mid.stored_shape) == ("rowwise", True, (32, 64))


def test_embedding_and_head_are_planned_and_explained():
    plan = autoshard.plan(Llama(LlamaConfig()), {"dp": 2, "tp": 2}, example_inputs=(TOKENS,))
    emb, head = plan.params["tok_embeddings.weight"], plan.params["output.weight"]
    assert emb.role == "colwise" and "embedding" in emb.note
    assert [str(c) for c in emb.collectives] == ["fwd all-gather output"]
    assert [str(c) for c in head.collectives] == ["bwd all-reduce input grad", "fwd all-gather output"]
    gather = head.collectives[1]
    assert (gather.kind, gather.direction, gather.axis, gather.counted) == ("all-gather", "fwd", "tp", True)


def test_heads_that_do_not_divide_are_computed_whole_and_explained():
    """3 heads on tp=2: cut, wq's output would be gathered at the view to heads; computed whole it
    needs no collective, and its note names that view."""
    model = Llama(LlamaConfig(dim=48, num_heads=3, num_kv_heads=3))
    plan = autoshard.plan(model, {"dp": 2, "tp": 2}, example_inputs=(TOKENS,))
    wq = plan.params["layers.0.attention.wq.weight"]
    assert wq.role == "replicate" and "cut output alone is gathered whole for node 'view'" in wq.note, wq.note
    assert "(view.default) at models.py" in wq.note and "self.wq(x).view(bsz, seq, -1, self.head_dim)" in wq.note
    assert not plan.breaks


def test_an_op_without_a_layout_rule_is_named_with_its_line():
    plan = autoshard.plan(CumulativeMLP(), {"dp": 2, "tp": 2}, example_inputs=(FEATURES,))
    up = plan.params["up.weight"]  # cut, its output would be gathered for the cumsum: computed whole
    assert "(cumsum.default) at models.py" in up.note and "torch.cumsum" in up.note
    # its input is replicated after the gather, and it narrows: computed whole, with no collective
    down = plan.params["down.weight"]
    assert down.role == "replicate" and "fewer than its 64 inputs" in down.note and not down.collectives


def test_sequence_parallel_needs_a_sequence_that_divides_by_tp():
    from torch.export import Dim

    model = Llama(LlamaConfig())
    free = ({1: Dim("seq", min=2, max=64)},)
    with pytest.raises(ValueError, match=r"sequence length s\w* of node 'embedding'.* may not divide by 2; declare"):
        autoshard.plan(model, {"tp": 2}, example_inputs=(TOKENS,), dynamic_shapes=free, sequence_parallel=True)
    chunks = Dim("chunks", min=1, max=32)
    even = ({1: 2 * chunks},)
    plan = autoshard.plan(model, {"tp": 2}, example_inputs=(TOKENS,), dynamic_shapes=even, sequence_parallel=True)
    assert plan.params["layers.0.attention.wo.weight"].collectives[0].kind == "reduce-scatter"


class _SharedNormTwice(nn.Module):
    """``norms.0`` runs twice around a root op: it cannot be one FSDP call."""

    def __init__(self):
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(32), nn.LayerNorm(32)])
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        x = self.norms[0](x)
        x = self.norms[1](torch.relu(self.proj(x)))
        return self.norms[0](x)


def test_a_block_that_runs_twice_stays_in_the_root_unit(fake_world):
    plan = autoshard.plan(_SharedNormTwice(), {"dp": 2, "tp": 2}, example_inputs=(FEATURES,))
    assert plan.units == ("", "norms.1")
    assert plan.params["norms.0.weight"].unit == ""
    assert plan.params["norms.1.weight"].unit == "norms.1"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sharded = autoshard.autoshard(_SharedNormTwice(), mesh, example_inputs=(FEATURES,))
    assert isinstance(sharded.get_submodule("norms.1"), torch.fx.GraphModule)
    assert not isinstance(sharded.get_submodule("norms.0"), torch.fx.GraphModule)
    assert sharded.code.count("aten.layer_norm.default") == 2  # both calls of norms.0, in the root
    assert sharded(FEATURES).shape == FEATURES.shape


def test_dims_that_do_not_divide_by_dp_are_padded_and_explained():
    plan = autoshard.plan(MLPStack(dim=30, hidden=60, out=10), {"dp": 4}, example_inputs=(torch.randn(2, 5, 30),))
    fc1 = plan.params["blocks.0.fc1.weight"]
    assert fc1.placements == {"dp": Shard(0)} and fc1.stored_shape == (30, 60)
    assert fc1.note == "stored dim 0 (30) does not divide by dp=4: FSDP2 pads the last shard"
    assert plan.params["blocks.0.fc1.bias"].note == ""  # 60 divides by 4


def _llama_heads_divide_by_4():
    return Llama(LlamaConfig(num_heads=8, num_kv_heads=4))


RETARGET_MODELS = {
    "llama_8_heads": (_llama_heads_divide_by_4, (TOKENS,)),
    "mlp_stack": (MLPStack, (FEATURES,)),
    "raw_linear": (RawLinearNet, (FEATURES,)),
    "padded_mlp": (lambda: MLPStack(dim=30, hidden=60, out=12), (torch.randn(2, 5, 30),)),
}
RETARGETS = [
    ({"dp": 2, "tp": 2}, {"tp": 4}),
    ({"dp": 2, "tp": 2}, {"dp": 4}),
    ({"dp": 2, "tp": 2}, {"dp": 4, "tp": 1}),
    ({"tp": 4}, {"dp": 2, "tp": 2}),
    ({"tp": 2}, {"dp": 8}),
    ({"dp": 2, "tp": 2}, {"dp_replicate": 2, "dp_shard": 2, "tp": 2}),
    ({"dp_replicate": 2, "dp_shard": 2, "tp": 2}, {"dp": 2, "tp": 2}),
    ({"dp_replicate": 2, "dp_shard": 4, "tp": 2}, {"tp": 4}),
    ({"dp": 2, "tp": 2}, {"dp_replicate": 2, "dp_shard": 4}),
    ({"dp_replicate": 4, "dp_shard": 2}, {"dp": 8}),
]


@pytest.mark.parametrize("source, target", RETARGETS, ids=lambda m: "x".join(f"{a}{n}" for a, n in m.items()))
@pytest.mark.parametrize("model_name", RETARGET_MODELS)
def test_a_saved_plan_retargeted_equals_planning_afresh(model_name, source, target):
    """When planning afresh makes the same decisions, retargeting the saved JSON gives the same plan:
    placements, sections, collectives, notes (FSDP padding of 30 over dp=4 or 8 included)."""
    build, inputs = RETARGET_MODELS[model_name]
    saved = json.loads(json.dumps(autoshard.plan(build(), source, example_inputs=inputs).to_dict()))
    retargeted = Plan.from_dict(saved).for_mesh(target)
    fresh = autoshard.plan(build(), target, example_inputs=inputs)
    assert retargeted == fresh
    assert str(retargeted) == str(fresh)


def test_retargeting_keeps_edited_roles_and_dp_choices():
    plan = autoshard.plan(MLPStack(), {"dp": 2, "tp": 2}, example_inputs=(FEATURES,)).to_dict()
    plan["params"]["blocks.0.fc2.weight"].update(role="replicate", placements={"dp": "S(0)", "tp": "R"})
    plan["params"]["blocks.0.fc2.bias"].update(role="replicate")
    plan["params"]["blocks.1.fc1.weight"]["placements"]["dp"] = "R"
    moved = Plan.from_dict(plan).for_mesh({"dp": 1, "tp": 4})
    assert moved.mesh == {"dp": 1, "tp": 4}
    assert moved.params["blocks.0.fc2.weight"].role == "replicate"
    assert moved.params["blocks.0.fc2.weight"].placements == {"dp": Shard(0), "tp": Replicate()}
    assert moved.params["blocks.1.fc1.weight"].placements == {"dp": Replicate(), "tp": Shard(1)}
    assert moved.params["blocks.1.fc2.weight"].placements == {"dp": Shard(0), "tp": Shard(1)}
    assert moved.roles() == Plan.from_dict(plan).roles()
    dp_only = Plan.from_dict(plan).for_mesh({"dp": 4})
    assert dp_only.params["blocks.1.fc1.weight"].placements == {"dp": Replicate()}
    hsdp = Plan.from_dict(plan).for_mesh({"dp_replicate": 2, "dp_shard": 2, "tp": 2})
    assert hsdp.params["blocks.1.fc1.weight"].placements == {
        "dp_replicate": Replicate(), "dp_shard": Replicate(), "tp": Shard(1)}
    assert hsdp.params["blocks.0.fc2.weight"].placements == {
        "dp_replicate": Replicate(), "dp_shard": Shard(0), "tp": Replicate()}
    assert hsdp.for_mesh({"dp": 2, "tp": 2}) == Plan.from_dict(plan)
    assert all(not p.collectives and not p.sections for p in dp_only.params.values()) and not dp_only.activations


def test_a_dim_that_does_not_divide_by_the_new_tp_is_named():
    plan = autoshard.plan(MLPStack(hidden=66, out=12), {"dp": 2, "tp": 2}, example_inputs=(FEATURES,))
    with pytest.raises(ValueError) as err:
        plan.for_mesh({"tp": 4})
    message = str(err.value)
    assert "plan for mesh dp=2 x tp=2 cannot be used on tp=4" in message
    assert (
        "parameter 'blocks.0.fc1.weight' (colwise) has tp-sharded stored dim 1 of size 66, which does not divide "
        "by tp=4; parameter 'blocks.0.fc1.bias' (colwise_bias) has tp-sharded stored dim 0 of size 66"
    ) in message
    assert "(and 6 more)" in message  # fc2 of each block too; the head's 12 divides
    assert plan.for_mesh({"tp": 6}).params["blocks.0.fc1.weight"].placements == {"tp": Shard(1)}  # 66 = 6 * 11


def test_a_fused_section_that_does_not_divide_by_the_new_tp_is_named():
    plan = autoshard.plan(MLPStack(), {"tp": 2}, example_inputs=(FEATURES,)).to_dict()
    plan["params"]["blocks.0.fc1.weight"]["sections"] = [30, 34]  # 64 divides by 4, 30 and 34 do not
    fault = r"'blocks.0.fc1.weight' \(colwise\) has tp-sharded stored dim 1 fused from sections \[30\|34\]"
    with pytest.raises(ValueError, match=fault + r", which do not each divide by tp=4"):
        Plan.from_dict(plan).for_mesh({"tp": 4})


def test_a_weight_replicated_over_tp_stays_replicated_when_retargeted():
    """Retargeting never changes a role: the head (6 outputs) replicated on tp=4 stays so on tp=2."""
    plan = autoshard.plan(MLPStack(out=6), {"dp": 2, "tp": 4}, example_inputs=(FEATURES,))
    head = plan.params["head.weight"]
    assert head.role == "replicate" and "(6) do not divide by the tp axis size 4" in head.note
    moved = plan.for_mesh({"tp": 2}).params["head.weight"]
    assert moved.role == "replicate" and moved.placements == {"tp": Replicate()}
    assert moved.note == (
        "replicated over tp as planned for tp=4: its output features (6) do not divide by 4 "
        "(they do by 2: plan afresh to shard it)"
    )
    assert "tp axis size 8" in plan.for_mesh({"tp": 8}).params["head.weight"].note
    assert plan.for_mesh({"dp": 2}).params["head.weight"].note == ""  # the tp note goes with the tp axis
    padded = plan.for_mesh({"dp": 4}).params["head.weight"]  # stored [6, 32] as a replicated weight
    assert padded.note == "stored dim 0 (6) does not divide by dp=4: FSDP2 pads the last shard"


def test_a_plan_without_tp_is_not_retargeted_to_a_tp_mesh():
    plan = autoshard.plan(MLPStack(), {"dp": 4}, example_inputs=(FEATURES,))
    assert plan.for_mesh({"dp": 2}) == autoshard.plan(MLPStack(), {"dp": 2}, example_inputs=(FEATURES,))
    with pytest.raises(ValueError, match=r"plan for mesh dp=4 has no tp axis, so it cannot be used on dp=2 x tp=2"):
        plan.for_mesh({"dp": 2, "tp": 2})
    with pytest.raises(ValueError, match=r"split over ep is decided by cost on the mesh it is planned for \(dp=4\)"):
        plan.for_mesh({"ep": 2})
    with pytest.raises(ValueError, match=r"unknown mesh axes \['xp'\]"):
        plan.for_mesh({"xp": 2})
    with pytest.raises(ValueError, match=r"pipeline stages are planned for one mesh \(dp=4\).* plan afresh"):
        plan.for_mesh({"pp": 2, "dp": 2})
    with pytest.raises(ValueError, match=r"mesh axes \['dp', 'dp_shard'\] do not go together"):
        plan.for_mesh({"dp": 2, "dp_shard": 2})
    with pytest.raises(ValueError, match=r"mesh axes \['dp_shard'\] do not go together"):
        plan.for_mesh({"dp_shard": 2})


def test_a_retargeted_plan_is_applied(fake_world):
    model = _llama_heads_divide_by_4()
    saved = autoshard.plan(model, {"dp": 2, "tp": 2}, example_inputs=(TOKENS,)).to_dict()
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    sharded = autoshard.autoshard(model, mesh, example_inputs=(TOKENS,), plan=saved)
    assert sharded.autoshard_plan == autoshard.plan(model, {"tp": 4}, example_inputs=(TOKENS,))
    out_features, in_features = model.layers[0].attention.wk.weight.shape
    assert sharded.get_parameter("layers.0.attention.wk.weight").to_local().shape == (in_features, out_features // 4)


def test_heads_that_divide_by_the_old_tp_only_are_named_when_applied(fake_world):
    """2 kv heads divide by tp=2, not by 4: the plan's tables cannot tell, applying it does."""
    model = Llama(LlamaConfig())
    saved = autoshard.plan(model, {"dp": 2, "tp": 2}, example_inputs=(TOKENS,)).to_dict()
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    with pytest.raises(ValueError) as err:
        autoshard.autoshard(model, mesh, example_inputs=(TOKENS,), plan=saved)
    message = str(err.value)
    assert "plan for mesh dp=2 x tp=2 does not carry over to tp=4" in message
    assert "laid out differently on tp=4 than on tp=2" in message
    assert "'layers.0.attention.wk.weight' on tp=4: adds 'fwd all-gather output'" in message
    assert "ends at node 'view_1' (view.default) at models.py:63" in message
    assert "self.wk(x).view(bsz, seq, -1, self.head_dim)" in message
    assert "plan afresh with autoshard.plan(model, {'tp': 4}, ...)" in message


def test_heads_that_divide_by_the_new_tp_only_are_named_when_applied(fake_world):
    """The other way round: on tp=4 the 2 heads were gathered and wo made colwise;
    on tp=2 the heads stay sharded into that colwise wo, so the plan's layout does not hold.
    (k and v are as wide as their input, so they are gathered, not computed whole; the MLP is
    narrow, so computing the gathered projections whole is over the compute budget.)"""
    model = Llama(LlamaConfig(num_heads=2, num_kv_heads=2, ffn_hidden=16))
    saved = autoshard.plan(model, {"tp": 4}, example_inputs=(TOKENS,))
    assert saved.params["layers.0.attention.wo.weight"].role == "colwise"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"plan for mesh tp=4 does not carry over to dp=2 x tp=2: .* laid out "
                                         r"differently on tp=2 than on tp=4"):
        autoshard.autoshard(model, mesh, example_inputs=(TOKENS,), plan=saved)


def test_retargeting_keeps_inlined_functions_and_breaks():
    from tests.pattern_models import PATTERNS

    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    plan = autoshard.plan(PATTERNS["custom_function"](), {"tp": 2}, example_inputs=(tokens,))
    assert plan.functions and plan.for_mesh({"dp": 2, "tp": 2}).functions == plan.functions
    broken = autoshard.plan(Llama(LlamaConfig()), {"tp": 8}, example_inputs=(TOKENS,))  # 4 heads on tp=8
    assert broken.breaks and broken.for_mesh({"dp": 2, "tp": 8}).breaks == broken.breaks
    assert broken.for_mesh({"dp": 4}).breaks == ()  # no tp, nothing breaks


def _package_imports() -> dict[str, set[str]]:
    """Each module of the package (``autoshard`` and ``passes/``, installed as ``autoshard.passes``)
    -> the package's modules it imports, anywhere in it: at the top, inside functions or methods,
    ``from autoshard import x`` naming a module; only ``if TYPE_CHECKING:`` blocks are left out."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    files = {}
    for base, prefix in ((root / "autoshard", ("autoshard",)), (root / "passes", ("autoshard", "passes"))):
        for path in base.rglob("*.py"):
            parts = [*prefix, *path.relative_to(base).with_suffix("").parts]
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    deps = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(block.test) for sub in block.body for n in ast.walk(sub)}
        found = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                while target not in files and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in files and target != name and target != "autoshard":
                    found.add(target)
        deps[name] = found
    return deps


def test_modules_import_each_other_without_cycles():
    """The package's modules form a DAG, counting imports inside functions (inside one layer too,
    where the layer rule below allows either direction)."""
    deps = _package_imports()
    done: set[str] = set()

    def visit(name, path):
        if name in done:
            return
        for dep in sorted(deps.get(name, ())):
            assert dep not in path, "import cycle: " + " -> ".join([*path[path.index(dep):], dep])
            visit(dep, [*path, dep])
        done.add(name)

    for name in sorted(deps):
        visit(name, [name])


# docs/design.md's layers, bottom up; the door (``autoshard``, ``autoshard.api``, ``__main__``) above all
_LAYERS = ("core", "plans", "runtime", "passes", "proof", "axes", "driver", "advice", "testing", "adapters")


def _layer(module: str) -> int:
    parts = module.split(".")
    return _LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in _LAYERS else len(_LAYERS)


def test_no_module_imports_a_layer_above_its_own():
    """A layer imports only its own and the layers below it, counting imports inside functions:
    the vocabulary and the plan pull in no graph code, the runtime no pass, an adapter not the door."""
    upward = sorted(f"{name} -> {dep}" for name, deps in _package_imports().items() for dep in deps
                    if _layer(dep) > _layer(name))
    assert not upward, "imports up a layer:\n" + "\n".join(upward)


def _axis_mentions(path) -> list[str]:
    """Where the code of ``path`` names a mesh axis: an identifier, attribute, argument or keyword
    with an axis's name as one of its words (``has_tp``, ``CP``, ``dp_mesh``, ``pipeline``), or a
    string other than a docstring holding one as a word. Docstrings and comments may speak of axes."""
    import ast
    import re

    words = {"pp", "tp", "cp", "ep", "dp", "hsdp", "fsdp", "pipeline", "context", "expert", "experts"}
    word = re.compile(r"\b(" + "|".join(sorted(words)) + r")\b", re.IGNORECASE)
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if word.search(node.value):
                found.append(f"{path.name}:{node.lineno}: {node.value[:60]!r}")
            continue
        name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                else node.arg if isinstance(node, (ast.arg, ast.keyword)) else
                node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else
                (node.asname or node.name) if isinstance(node, ast.alias) else None)
        if name and words & {part.lower() for part in name.split("_")} | {name.lower().split(".")[-1]} & words:
            found.append(f"{path.name}:{node.lineno}: {name}")
    return found


def test_the_door_names_no_axis_and_the_driver_only_in_its_list():
    """Every axis lives in its own module of ``autoshard/axes``; the public door and the driver run
    them through their contract, naming none but in the driver's one list of them."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "autoshard"
    modules = [root / "api.py", *sorted(p for p in (root / "driver").glob("*.py") if p.name != "axis_list.py")]
    named = [hit for path in modules for hit in _axis_mentions(path)]
    assert not named, "the door or the driver names an axis:\n" + "\n".join(named)
    assert _axis_mentions(root / "axes" / "dp_axis.py"), "the check finds an axis where one is named"


def test_each_axis_is_one_module_that_imports_no_other_axis():
    """Adding an axis touches no other axis's module: each imports only the contract from the axes,
    and the driver's list holds one of each, in the mesh's order."""
    import ast
    import pathlib

    from autoshard.core.mesh import _ORDER
    from autoshard.driver.axis_list import AXES

    folder = pathlib.Path(__file__).resolve().parents[1] / "autoshard" / "axes"
    for path in folder.glob("*_axis.py"):
        imported = {node.module for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autoshard.axes")}
        assert imported <= {"autoshard.axes.contract"}, (path.name, imported)
    modules = sorted(type(axis).__module__.rsplit(".", 1)[1] for axis in AXES)
    assert modules == sorted(p.stem for p in folder.glob("*_axis.py")), modules
    names = [name for axis in AXES for name in axis.names]
    assert sorted(names) == sorted(_ORDER) and len(names) == len(set(names))
    assert [min(_ORDER.index(n) for n in axis.names) for axis in AXES] == sorted(
        min(_ORDER.index(n) for n in axis.names) for axis in AXES), "AXES is not in mesh order"


def test_the_package_is_grouped_by_layer_with_no_clashing_names():
    """``autoshard/`` holds the public door and one folder per layer; no two modules share a
    name, and no one-word name is the first word of another (``stages`` and ``stages``,
    ``layouts`` and ``layout_rules``, ``sections`` and ``section_ops`` read as one name)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "autoshard"
    top = sorted(p.stem for p in root.glob("*.py"))
    assert top == ["__init__", "__main__", "api"], top
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == ["adapters", "advice", "axes", "core", "driver", "plans", "proof", "runtime", "testing"], folders
    import tomllib

    packaged = tomllib.loads((root.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert sorted(packaged) == sorted(["autoshard", "autoshard.passes", *(f"autoshard.{f}" for f in folders)]), (
        "pyproject.toml's packages (what a wheel installs) are not the package's folders")
    stems = [p.stem for p in (*root.rglob("*.py"), *(root.parent / "passes").glob("*.py")) if p.stem != "__init__"]
    assert len(stems) == len(set(stems)), sorted(s for s in stems if stems.count(s) > 1)
    bare = {s.rstrip("s"): s for s in stems if "_" not in s.strip("_")}
    for stem in stems:
        word = stem.strip("_").split("_")[0].rstrip("s")
        assert "_" not in stem.strip("_") or word not in bare, f"{bare[word]} and {stem} read as one name"


def test_an_hsdp_plan_shows_the_replicate_axis():
    """HSDP: a column per axis, dp_replicate always R, the dp choice on dp_shard; JSON round trip."""
    plan = autoshard.plan(MLPStack(), {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, example_inputs=(FEATURES,))
    header = str(plan).splitlines()[1].split()
    assert header[3:6] == ["dp_replicate", "dp_shard", "tp"]
    assert all(p.placements["dp_replicate"] == Replicate() for p in plan.params.values())
    assert plan.params["blocks.0.fc1.weight"].placements == {
        "dp_replicate": Replicate(), "dp_shard": Shard(0), "tp": Shard(1)}
    assert plan.params["blocks.0.fc1.bias"].placements == {
        "dp_replicate": Replicate(), "dp_shard": Replicate(), "tp": Shard(0)}
    assert "dp_replicate: HSDP" in str(plan)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_hsdp_on_a_fake_world_places_replicate_then_shard(fake_world):
    """(dp_replicate, dp_shard) = (2, 2): FSDP2 gets the 2-D mesh; each rank takes one batch of four."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    sharded = autoshard.autoshard(MLPStack(), mesh, example_inputs=(FEATURES,))
    weight = sharded.get_parameter("blocks.0.fc1.weight")
    assert weight.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert tuple(weight.placements) == (Replicate(), Shard(0))
    assert autoshard.data_parallel_rank(mesh) == (0, 4)
    assert autoshard.data_parallel_rank(init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))) == (0, 1)


def test_the_plan_prints_each_units_predicted_tp_traffic():
    """The per-unit lines add up to predicted_comm's tp totals; 4 collectives per Llama block."""
    from autoshard.plans.predict import tp_traffic_by_unit

    plan = autoshard.plan(Llama(LlamaConfig()), {"dp": 2, "tp": 2}, example_inputs=(TOKENS,))
    traffic = tp_traffic_by_unit(plan)
    totals = plan.predicted_comm()["tp"]
    assert sum(n for n, _ in traffic.values()) == sum(n for n, _ in totals.values())
    assert sum(b for _, b in traffic.values()) == sum(b for _, b in totals.values())
    assert traffic["layers.0"][0] == traffic["layers.1"][0] == 4
    assert "predicted tp traffic per training step" in str(plan)
    assert tp_traffic_by_unit(autoshard.plan(Llama(LlamaConfig()), {"dp": 4}, example_inputs=(TOKENS,))) is None


class _SixWide(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 6, bias=False)
        self.down = nn.Linear(6, 16, bias=False)

    def forward(self, x):
        return self.down(F.relu(self.up(x)))


def test_why_a_weight_is_replicated_is_data_rendered_per_mesh():
    """The plan keeps the decision (6 output features do not divide by tp=4) as data in its JSON;
    retargeting renders the note for each mesh from that data, never from the note's text."""
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    plan = autoshard.plan(_SixWide(), {"dp": 2, "tp": 4}, example_inputs=(x,))
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["params"]["up.weight"]["why"] == {"indivisible": {"what": "output features", "size": 6, "tp": 4}}
    assert plan.params["up.weight"].note == (
        "replicated over tp: its output features (6) do not divide by the tp axis size 4")
    saved = Plan.from_dict(data)
    assert saved == plan
    assert saved.for_mesh({"dp": 1, "tp": 8}).params["up.weight"].note == (
        "replicated over tp: its output features (6) do not divide by the tp axis size 8")
    assert saved.for_mesh({"tp": 2}).params["up.weight"].note == (
        "replicated over tp as planned for tp=4: its output features (6) do not divide by 4 "
        "(they do by 2: plan afresh to shard it)")
    assert saved.for_mesh({"dp": 2}).params["up.weight"].note == ""
    # a plan saved before decisions were kept as data keeps its note's text
    del data["params"]["up.weight"]["why"]
    assert Plan.from_dict(data).params["up.weight"].why.about == plan.params["up.weight"].note


class _WholeWeightsBlock(nn.Module):
    """A block with three weights tp leaves whole: a linear whose 6 outputs do not divide by 4,
    a relative-position table read by indexing (as Swin's), and experts read by
    ``torch._grouped_mm`` whose share per rank (4 bf16 elements) the kernel cannot read."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.up = nn.Linear(dim, 32)
        self.down = nn.Linear(32, dim)
        self.odd = nn.Linear(dim, 6)
        self.rel_table = nn.Parameter(torch.randn(9, 2))
        self.experts = nn.Parameter(torch.randn(2, dim, dim) / 4)
        self.mix = nn.Conv1d(dim, dim, 3, padding=1)  # a token mixer, as ConvNeXt-style blocks have

    def forward(self, x):
        h = self.down(torch.relu(self.up(x)))
        offsets = torch.tensor([x.shape[0] // 2, x.shape[0]], dtype=torch.int32)
        h = h + torch._grouped_mm(x.bfloat16(), self.experts.bfloat16(), offs=offsets).float()
        h = h + self.mix(h.t().unsqueeze(0)).squeeze(0).t()
        return x + h + self.odd(h).sum(-1, keepdim=True) + self.rel_table[3, 1]


class _WholeWeightsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_WholeWeightsBlock(), _WholeWeightsBlock()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_block_never_claims_no_break_while_a_weight_of_it_is_whole_over_tp():
    """Every block weight of 2+ dims replicated over tp is a break (a matmul reads it whole) or a
    choice with its cost in the note (no matmul reads it, a narrow linear on the whole stream
    whose outputs do not divide, a convolution whose cut channels nothing reads cut); the proof
    holds either way."""
    from tests.plan_invariants import assert_breaks_complete

    proof = autoshard.check(_WholeWeightsNet(), {"dp": 2, "tp": 4}, example_inputs=(torch.randn(8, 16),))
    assert proof.ok, str(proof)
    plan = proof.plan
    assert_breaks_complete(plan)
    assert plan.breaks_line().startswith("tp breaks: 2 of 2 blocks")
    for block in ("blocks.0", "blocks.1"):
        where = {w.split("'")[1]: w for unit, w in plan.breaks if unit == block and w.startswith("'")}
        assert set(where) == {f"{block}.experts"}, plan.breaks
        # the token mixer is a dense conv: colwise over channels would leave them cut where the
        # residual reads them whole, so it is computed whole by choice, with why
        mix = plan.params[f"{block}.mix.weight"]
        assert "its output channels reach nothing that reads them cut" in mix.why.computed_whole, mix.note
        assert ("output features (16) cut 4 ways leave 4 per rank, not a multiple of the 8 elements _grouped_mm "
                "needs") in where[f"{block}.experts"]
        # 6 outputs of 16 inputs on the whole stream: nothing could cut it, and whole it costs no collective
        odd = plan.params[f"{block}.odd.weight"]
        assert "output features (6) do not divide by the tp axis size 4" in odd.note
        assert "computed whole it needs no collective" in odd.why.computed_whole
        table = plan.params[f"{block}.rel_table"]
        assert table.why.read_whole.endswith("no matmul: 18 elements kept whole on every tp rank"), table.note
        assert "(select.int)" in table.note
    assert Plan.from_dict(plan.to_dict()) == plan  # the choice survives JSON
    assert not plan.for_mesh({"dp": 8}).params["blocks.0.rel_table"].note.startswith("replicated over tp")


def test_a_per_sample_modulation_is_computed_whole_when_the_plan_costs_less():
    """adaLN: sharding the modulation would cut the normalized stream and turn attention and MLP
    the other way round; computed whole, each block costs the dense minimum, and the note says
    why with both totals. Attention projections (every token) are never tried whole."""
    from tests.pattern_models import PATTERNS, VOCAB

    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    plan = autoshard.plan(PATTERNS["adaln_modulation"](), {"tp": 4}, example_inputs=(tokens,))
    modulation = plan.params["layers.0.adaLN_modulation.1.weight"]
    assert modulation.placements["tp"] == Replicate()
    assert "computed whole, the plan's tp collectives are" in modulation.note, modulation.note
    kept, was = (int(n) for n in modulation.note.split("are ")[1].split(" instead of "))
    assert kept == plan.num_tp_collectives() < was
    assert plan.params["layers.0.attn.qkv.weight"].role == "colwise"
    assert plan.params["layers.0.attn.proj.weight"].role == "rowwise"
    assert not plan.breaks


class _TiedHeadWithBias(nn.Module):
    """An LM head tied to the embedding and carrying its own bias (ELECTRA's generator head)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)
        self.head = nn.Linear(32, 64)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(h + self.fc2(torch.relu(self.fc1(h))))


def test_a_vocabulary_parallel_head_keeps_its_bias_a_colwise_bias():
    """The table is cut over the vocabulary (tp) and dim 1 (FSDP); the head's 1-D bias is cut over
    the vocabulary by tp only (FSDP cannot cut a 1-D tensor on dim 1)."""
    proof = autoshard.check(_TiedHeadWithBias(), {"dp": 2, "tp": 2}, example_inputs=(torch.randint(0, 64, (2, 8)),))
    assert proof.ok, str(proof)
    plan = proof.plan
    assert plan.params["emb.weight"].role == "vocab_parallel"
    bias = plan.params["head.bias"]
    assert (bias.role, bias.placements) == ("colwise_bias", {"dp": Replicate(), "tp": Shard(0)})
    assert plan.predicted_comm()["tp"]  # sized on every entry's rank shape


def test_the_accepted_mesh_shapes_follow_from_the_axis_order():
    """Any axes in the order pp, dp_replicate, dp_shard, dp, ep, cp, tp (one data-parallel form) make a
    mesh; a combination not built yet is refused by name and reason, never by a list's omission."""
    from autoshard.core.mesh import _ORDER, MESH_SHAPES, NOT_YET, accepted, axes_from_sizes

    assert ("pp", "dp", "cp", "tp") in MESH_SHAPES and ("dp_replicate", "dp_shard", "cp", "tp") in MESH_SHAPES
    assert ("dp", "ep", "tp") in MESH_SHAPES and not accepted(("ep", "dp"))
    assert not accepted(("tp", "dp")) and not accepted(("dp", "dp_shard")) and not accepted(("dp_replicate", "tp"))
    for shape in MESH_SHAPES:
        sizes = dict.fromkeys(shape, 2)
        if any(axes <= set(shape) for axes in NOT_YET):
            with pytest.raises(NotImplementedError):
                axes_from_sizes(sizes)
        else:
            assert axes_from_sizes(sizes).names == shape
    assert len(MESH_SHAPES) == 47 and all(a in _ORDER for s in MESH_SHAPES for a in s)


def test_no_function_body_is_longer_than_80_lines():
    """A function of the package reads in one screen: its body (docstring aside) at most 80 lines."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    long_ones = []
    for path in sorted([*root.joinpath("autoshard").rglob("*.py"), *root.joinpath("passes").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            if body and body[-1].end_lineno - body[0].lineno + 1 > 80:
                long_ones.append(f"{path.relative_to(root)}:{node.lineno} {node.name}")
    assert not long_ones, long_ones
