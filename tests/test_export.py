"""Plan export: ``plan.to_parallelize_plan()`` applied by hand, and ``plan.to_hf_tp_plan()``.

On a fake 4-rank process group in this process: ``parallelize_module`` with the
exported styles must cut every weight it can express exactly as autoshard does
(same placements, same local shape), and list the others with a reason.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import autoshard
from examples.models import Llama, LlamaConfig, MLPStack, RawLinearNet
from tests.cases import FEATURES, TOKENS
from tests.hf_cases import CASES

MODELS = {
    "llama": (lambda: Llama(LlamaConfig(num_heads=8, num_kv_heads=4)), TOKENS),
    "mlp_stack": (MLPStack, FEATURES),
    "raw_linear": (RawLinearNet, FEATURES),
    "hf_phi3": (CASES["phi3"].build, CASES["phi3"].inputs(batch=2)[0]),
    "hf_qwen3": (CASES["qwen3"].build, CASES["qwen3"].inputs(batch=2)[0]),
}


@pytest.mark.parametrize("name", MODELS)
def test_the_exported_plan_applied_by_hand_cuts_each_expressed_weight_alike(fake_world, name):
    build, inputs = MODELS[name]
    torch.manual_seed(0)
    model = build()
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    sharded = autoshard.autoshard(copy.deepcopy(model), mesh, example_inputs=(inputs,))
    plan = sharded.autoshard_plan
    exported = plan.to_parallelize_plan(model)
    inferred = plan.to_parallelize_plan()  # module types inferred from the plan: as the model has them
    assert {k: repr(v) for k, v in inferred.styles.items()} == {k: repr(v) for k, v in exported.styles.items()}
    assert inferred.not_expressed == exported.not_expressed
    by_hand = parallelize_module(copy.deepcopy(model), mesh, dict(exported.styles))
    ours, theirs = dict(sharded.named_parameters()), dict(by_hand.named_parameters())
    expressed = 0
    for fqn, entry in plan.params.items():
        if fqn in exported.not_expressed or entry.role == "replicate":
            continue
        expressed += 1
        assert tuple(theirs[fqn].placements) == tuple(ours[fqn].placements), fqn
        assert theirs[fqn].to_local().shape == ours[fqn].to_local().shape, fqn
    for fqn, why in exported.not_expressed.items():
        entry = plan.params[fqn]
        if fqn.rpartition(".")[0] in exported.styles and entry.transposed and not entry.sections:
            # the same output columns per rank, stored [out, in] instead of [in, out]
            assert theirs[fqn].to_local().shape == ours[fqn].to_local().t().shape, fqn
        assert why
    assert expressed or exported.not_expressed


def test_what_no_style_can_say_is_named_with_why():
    phi3 = CASES["phi3"]
    plan = autoshard.plan(phi3.build(), {"tp": 2}, example_inputs=(phi3.inputs(batch=2)[0],))
    exported = plan.to_parallelize_plan()
    qkv = next(f for f in plan.params if f.endswith("qkv_proj.weight"))
    assert "fused sections" in exported.not_expressed[qkv]
    assert qkv.removesuffix(".weight") not in exported.styles
    raw = autoshard.plan(RawLinearNet(), {"tp": 2}, example_inputs=(FEATURES,)).to_parallelize_plan()
    assert "no nn.Linear or nn.Embedding owns it" in raw.not_expressed["w_in"] and not raw.styles
    qwen3 = CASES["qwen3"]
    plan = autoshard.plan(qwen3.build(), {"tp": 2}, example_inputs=(qwen3.inputs(batch=2)[0],))
    norms = [f for f, p in plan.params.items() if p.role == "sharded"]
    for fqn in norms:
        assert "read sharded by an op" in plan.to_parallelize_plan().not_expressed[fqn]


def test_a_gathered_colwise_output_is_exported_replicated():
    plan = autoshard.plan(Llama(LlamaConfig()), {"tp": 2}, example_inputs=(TOKENS,))
    head = plan.to_parallelize_plan().styles["output"]
    assert isinstance(head, ColwiseParallel) and str(head.output_layouts) == "(Replicate(),)"
    assert plan.to_hf_tp_plan()["output"] == "colwise_rep"


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_the_hf_tp_plan_agrees_with_the_models_own(name):
    """autoshard plans each decoder layer exactly as the model family's hand-written tp_plan."""
    case = CASES[name]
    model = case.build()
    ids, kwargs = case.inputs(batch=2)
    plan = autoshard.plan(model, {"dp": 2, "tp": 2}, example_inputs=(ids,), example_kwargs=kwargs)
    exported = plan.to_hf_tp_plan(model)
    prefix = model.base_model_prefix
    theirs = {f"{prefix}.{k}": v for k, v in model.config.base_model_tp_plan.items() if ".*." in k}
    ours = {k: v for k, v in exported.items() if ".*." in k}
    assert ours == theirs
