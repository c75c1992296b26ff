"""User errors raise a clear ValueError/NotImplementedError and leave the model as it was."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import autoshard
from examples.models import Llama, LlamaConfig, MLPStack
from tests.cases import FEATURES, TOKENS


def snapshot(model: nn.Module) -> dict:
    return {
        "params": {n: (p, p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()},
        "buffers": {n: (b, b.clone()) for n, b in model.named_buffers()},
        "hooks": [(m._forward_hooks.copy(), m._forward_pre_hooks.copy(), m._state_dict_hooks.copy())
                  for m in model.modules()],
        "classes": [type(m) for m in model.modules()],
        "training": [m.training for m in model.modules()],
    }


def assert_untouched(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["params"].keys() == before["params"].keys()
    for name, (tensor, value, requires_grad) in before["params"].items():
        now, _, now_requires_grad = after["params"][name]
        assert now is tensor, f"parameter {name} was replaced"
        assert torch.equal(now.detach(), value), f"parameter {name} was modified"
        assert now_requires_grad == requires_grad
    for name, (tensor, value) in before["buffers"].items():
        assert after["buffers"][name][0] is tensor and torch.equal(tensor, value), name
    assert after["hooks"] == before["hooks"]
    assert after["classes"] == before["classes"]
    assert after["training"] == before["training"]


@contextlib.contextmanager
def leaves_untouched(model: nn.Module):
    before = snapshot(model)
    yield
    assert_untouched(model, before)


@pytest.fixture
def mesh_2x2(fake_world):
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


class Narrow(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 30)  # 30 output features do not divide by tp=4
        self.down = nn.Linear(30, 32)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_output_features_not_divisible_by_tp(fake_world):
    model = Narrow()
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    with leaves_untouched(model), pytest.raises(ValueError) as err:
        autoshard.autoshard(model, mesh, example_inputs=(FEATURES,), on_indivisible="error")
    message = str(err.value)
    assert "'up.weight'" in message and "[30, 32]" in message
    assert "output features (30)" in message and "tp axis size 4" in message
    assert "test_bad_input.py" in message and "self.up(x)" in message  # the user's source line


def test_plan_reports_the_same_error_without_a_mesh():
    with pytest.raises(ValueError, match=r"'up.weight' \(shape \[30, 32\]\)"):
        autoshard.plan(Narrow(), {"tp": 4}, example_inputs=(FEATURES,), on_indivisible="error")


def test_by_default_an_indivisible_weight_is_replicated_and_explained():
    plan = autoshard.plan(Narrow(), {"tp": 4}, example_inputs=(FEATURES,))
    up, down = plan.params["up.weight"], plan.params["down.weight"]
    assert (up.role, up.placements["tp"]) == ("replicate", Replicate())
    assert up.note == "replicated over tp: its output features (30) do not divide by the tp axis size 4"
    # down's input is then replicated: it is colwise, and its output gathered
    assert (down.role, down.placements["tp"]) == ("colwise", Shard(1))


def test_a_user_plan_asking_for_an_indivisible_layout_is_an_error(fake_world):
    model = Narrow()
    data = autoshard.plan(model, {"tp": 4}, example_inputs=(FEATURES,)).to_dict()
    data["params"]["up.weight"].update(role="colwise", transposed=True, placements={"tp": "S(1)"})
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    with leaves_untouched(model), pytest.raises(ValueError, match=r"'up.weight' \(shape \[30, 32\]\) is colwise"):
        autoshard.autoshard(model, mesh, example_inputs=(FEATURES,), plan=data)


@pytest.mark.parametrize(
    "shape, names, message",
    [
        ((2, 2), ("data", "model"), r"mesh_dim_names=\('data', 'model'\)"),
        ((2, 2), ("tp", "dp"), r"\('dp', 'tp'\) \(dp outer\)"),
        ((4,), ("batch",), r"mesh_dim_names=\('batch',\)"),
        ((2, 2), ("dp_shard", "tp"), r"\('dp_replicate', 'dp_shard', 'tp'\)"),
    ],
)
def test_mesh_without_expected_axis_names(fake_world, shape, names, message):
    model = MLPStack()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    with leaves_untouched(model), pytest.raises(ValueError, match=message):
        autoshard.autoshard(model, mesh, example_inputs=(FEATURES,))


def test_mesh_that_is_not_a_device_mesh():
    with pytest.raises(ValueError, match="must be a torch.distributed DeviceMesh"):
        autoshard.autoshard(MLPStack(), [[0, 1], [2, 3]], example_inputs=(FEATURES,))


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)

    def forward(self, x):
        if x.sum() > 0:  # control flow on a tensor value: captured the way the example goes
            return self.a(x)
        return self.b(x)


def test_a_branch_on_a_tensor_value_is_captured_as_the_example_goes_and_said_so(mesh_2x2):
    model = DataDependent()
    example = FEATURES.abs()  # its sum is positive: the branch reads `a`
    with leaves_untouched(model):
        plan = autoshard.plan(model, mesh_2x2, example_inputs=(example,))
    assert len(plan.branches) == 1 and "x.sum() > 0" in plan.branches[0], plan.branches
    assert "taken as the example input took them" in str(plan)
    assert "b.weight" in plan.params  # the branch not taken keeps its parameters, unread
    with pytest.raises(ValueError, match="could not capture DataDependent.*x.sum\\(\\) > 0"):
        with torch.device("meta"):
            meta_model = DataDependent()
        autoshard.plan(meta_model, mesh_2x2, example_inputs=(example,))  # no values to take a branch by


def test_example_inputs_must_be_a_tuple(mesh_2x2):
    with pytest.raises(ValueError, match="`example_inputs` must be a tuple"):
        autoshard.autoshard(MLPStack(), mesh_2x2, example_inputs=FEATURES)


class ReadCrossed(nn.Module):
    """One weight read as ``[out, in]`` by a linear and as ``[in, out]`` by a matmul: no single
    tp layout fits both reads."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32, bias=False)

    def forward(self, x):
        return torch.relu(self.a(x)) @ self.a.weight


def test_a_weight_read_two_ways_is_refused_by_name(mesh_2x2):
    model = ReadCrossed()
    with leaves_untouched(model), pytest.raises(NotImplementedError) as err:
        autoshard.autoshard(model, mesh_2x2, example_inputs=(FEATURES,))
    assert "'a.weight' (shape [32, 32]) is used by 2 linear/embedding ops" in str(err.value)
    assert "test_bad_input.py" in str(err.value) and "self.a(x)" in str(err.value)


def test_plan_without_tp_for_a_tp_mesh_is_rejected(mesh_2x2):
    model = MLPStack()
    plan = autoshard.plan(model, {"dp": 4}, example_inputs=(FEATURES,))
    with leaves_untouched(model), pytest.raises(ValueError, match=r"plan for mesh dp=4 has no tp axis"):
        autoshard.autoshard(model, mesh_2x2, example_inputs=(FEATURES,), plan=plan)


def test_plan_for_another_model_is_rejected(mesh_2x2):
    plan = autoshard.plan(MLPStack(num_blocks=2), {"dp": 2, "tp": 2}, example_inputs=(FEATURES,))
    with pytest.raises(ValueError, match=r"missing from plan: \['blocks.2.fc1.bias'"):
        autoshard.autoshard(MLPStack(num_blocks=3), mesh_2x2, example_inputs=(FEATURES,), plan=plan)


def test_inconsistent_plan_edit_is_explained(mesh_2x2):
    model = Llama(LlamaConfig())
    data = autoshard.plan(model, {"dp": 2, "tp": 2}, example_inputs=(TOKENS,)).to_dict()
    data["params"]["layers.0.feed_forward.w1.weight"]["role"] = "replicate"  # placements left stale
    with leaves_untouched(model), pytest.raises(ValueError) as err:
        autoshard.autoshard(model, mesh_2x2, example_inputs=(TOKENS,), plan=data)
    assert "'layers.0.feed_forward.w1.weight' is inconsistent" in str(err.value)
    assert "implies role='replicate', transposed=False, placements={'dp': 'S(0)', 'tp': 'R'}" in str(err.value)


def test_unknown_role_in_plan(mesh_2x2):
    data = autoshard.plan(MLPStack(), {"dp": 2, "tp": 2}, example_inputs=(FEATURES,)).to_dict()
    data["params"]["blocks.0.fc1.weight"]["role"] = "rowwise_bias"
    with pytest.raises(ValueError, match="role 'rowwise_bias'; expected one of 'colwise', 'rowwise', 'replicate'"):
        autoshard.autoshard(MLPStack(), mesh_2x2, example_inputs=(FEATURES,), plan=data)


def test_call_with_another_input_shape_names_the_input(mesh_2x2):
    sharded = autoshard.autoshard(Llama(LlamaConfig()), mesh_2x2, example_inputs=(TOKENS,))
    assert sharded(TOKENS).shape == (2, 16, 256)
    with pytest.raises(ValueError, match=r"input 'tokens' has shape \[2, 8\].*sharded for shape \[2, 16\]"):
        sharded(TOKENS[:, :8])


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return torch.sign(w)

    @staticmethod
    def backward(ctx, grad):
        return grad


class CustomFunctionOnWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 32))
        self.out = nn.Linear(64, 32)

    def forward(self, x):
        return self.out(torch.relu(x @ _StraightThrough.apply(self.w).t()))


def test_custom_autograd_function_on_a_weight_is_refused(mesh_2x2):
    model = CustomFunctionOnWeight()
    with leaves_untouched(model), pytest.raises(NotImplementedError) as err:
        autoshard.autoshard(model, mesh_2x2, example_inputs=(FEATURES,))
    message = str(err.value)
    assert "custom autograd.Function _StraightThrough" in message
    assert "max relative difference" in message  # measured on the example inputs
    assert "test_bad_input.py" in message and "_StraightThrough.apply(self.w)" in message
    assert torch.autograd.Function.apply.__func__.__qualname__ == "Function.apply"  # restored


def test_unknown_activation_checkpointing_mode(mesh_2x2):
    with pytest.raises(ValueError, match="activation_checkpointing must be None, 'full' or 'selective', got 'all'"):
        autoshard.autoshard(MLPStack(), mesh_2x2, example_inputs=(FEATURES,), activation_checkpointing="all")


def test_mixed_precision_needs_a_dp_axis(fake_world):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    tp_only = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    with pytest.raises(ValueError, match="mp_policy is applied by FSDP2 on the dp axis"):
        autoshard.autoshard(MLPStack(), tp_only, example_inputs=(FEATURES,),
                            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))


def test_the_compile_backend_refuses_an_unknown_checkpointing_mode_when_made():
    with pytest.raises(ValueError, match="activation_checkpointing must be None, 'full' or 'selective', got 'all'"):
        autoshard.backend(None, activation_checkpointing="all")


def test_the_compile_backend_refuses_a_pipeline_mesh_by_name(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    with pytest.raises(NotImplementedError, match=r"pipeline stages \(a 'pp' axis\).*autoshard.autoshard\("):
        autoshard.backend(mesh)
