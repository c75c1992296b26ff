"""One options object: ``autoshard.Options``, grouped, taken by plan(), check(), autoshard(),
autoshard.testing.check() and the compile backend, with today's keywords applied over it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import autoshard
from autoshard.core.options import KEYWORDS, SHARDING_KEYWORDS
from examples.models import Llama, LlamaConfig
from tests.cases import TOKENS

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def test_every_keyword_is_one_field_of_one_group_and_every_field_has_a_keyword():
    fields = {(group.name, f.name) for group in dataclasses.fields(autoshard.Options)
              for f in dataclasses.fields(group.type if isinstance(group.type, type)
                                          else getattr(autoshard, group.type))}
    assert set(KEYWORDS.values()) == fields
    assert len(set(KEYWORDS.values())) == len(KEYWORDS)


def test_keywords_and_the_grouped_object_give_the_same_plan():
    model = Llama(LlamaConfig())
    mesh = {"dp": 2, "tp": 2}
    by_keywords = autoshard.plan(model, mesh, example_inputs=(TOKENS,), sequence_parallel=True, mp_policy=BF16)
    grouped = autoshard.Options(tensor=autoshard.TensorOptions(sequence_parallel=True),
                                precision=autoshard.PrecisionOptions(mp_policy=BF16))
    assert autoshard.Options.of(sequence_parallel=True, mp_policy=BF16) == grouped
    assert autoshard.plan(model, mesh, example_inputs=(TOKENS,), options=grouped) == by_keywords
    # a keyword given with the object is applied over it
    over = autoshard.plan(model, mesh, example_inputs=(TOKENS,), options=grouped, sequence_parallel=False)
    assert over == autoshard.plan(model, mesh, example_inputs=(TOKENS,), mp_policy=BF16)
    assert over != by_keywords


def test_check_takes_the_same_object():
    model = Llama(LlamaConfig())
    options = autoshard.Options.of(loss_parallel=True)
    proof = autoshard.check(model, {"tp": 2}, example_inputs=(TOKENS,), options=options)
    assert proof.ok, str(proof)
    report = autoshard.testing.check(model, {"tp": 2}, example_inputs=(TOKENS,), options=options)
    assert report.options == {"loss_parallel": True}


@pytest.mark.parametrize("keyword", SHARDING_KEYWORDS)
def test_plan_and_check_refuse_what_only_sharding_does(keyword):
    for function in (autoshard.plan, autoshard.check):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
            function(Llama(LlamaConfig()), {"tp": 2}, example_inputs=(TOKENS,), **{keyword: None})


def test_an_unknown_keyword_or_a_wrong_object_is_a_type_error():
    with pytest.raises(TypeError, match=r"autoshard\(\) got an unexpected keyword argument 'sequence_paralel'"):
        autoshard.Options.of(sequence_paralel=True)
    with pytest.raises(TypeError, match="options must be an autoshard.Options, got dict"):
        autoshard.plan(Llama(LlamaConfig()), {"tp": 2}, example_inputs=(TOKENS,), options={"loss_parallel": True})


def test_pipeline_options_on_a_mesh_without_pp_are_refused_by_name():
    options = autoshard.Options(pipeline=autoshard.PipelineOptions(microbatches=4, split=("layers.1",)))
    with pytest.raises(ValueError, match="microbatches, pp_split configure pipeline stages"):
        autoshard.plan(Llama(LlamaConfig()), {"tp": 2}, example_inputs=(TOKENS,), options=options)


def test_the_compile_backend_takes_the_object():
    backend = autoshard.backend(None, compiler="eager", options=autoshard.Options.of(sequence_parallel=True),
                                reshard_after_forward=False)
    assert backend.options.tensor.sequence_parallel and not backend.options.sharding.reshard_after_forward
    grouped = autoshard.backend(None, options=autoshard.Options(sharding=autoshard.ShardingOptions(
        activation_checkpointing="selective")))
    assert grouped.options.sharding.activation_checkpointing == "selective"
    with pytest.raises(ValueError, match="activation_checkpointing must be None, 'full' or 'selective'"):
        autoshard.backend(None, options=autoshard.Options(sharding=autoshard.ShardingOptions(
            activation_checkpointing="blocks")))


def test_buffer_dtype_holds_the_sharded_modules_buffers_in_that_dtype(fake_world):
    """``buffer_dtype`` under ``mp_policy`` (FSDP1's ``MixedPrecision.buffer_dtype``): the sharded
    module's floating buffers are held in it; the user's model keeps its own."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.test_own_models import Float32BufferInBf16

    model = Float32BufferInBf16()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sharded = autoshard.autoshard(model, mesh, example_inputs=(torch.randn(4, 16),), mp_policy=BF16,
                                  buffer_dtype=torch.bfloat16, check=False)
    assert sharded.get_buffer("table").dtype == torch.bfloat16
    assert model.table.dtype == torch.float32
    assert autoshard.Options.of(buffer_dtype=torch.bfloat16).precision.buffer_dtype == torch.bfloat16
