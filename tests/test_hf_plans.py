"""Golden plans of the Hugging Face models, and models as they load with ``use_cache`` on
(no process group needed)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch.distributed.tensor import Replicate, Shard

import autoshard
from autoshard.passes.capture import capture
from tests.hf_cases import CASES, VOCAB, _gpt2, bart_with_cache, llama_with_cache
from tests.parity import rel_error


def test_gpt2_vocabulary_that_does_not_divide_is_replicated_and_explained():
    ids = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    plan = autoshard.plan(_gpt2(vocab=50257), {"dp": 2, "tp": 2}, example_inputs=(ids,))
    table = plan.params["transformer.wte.weight"]
    assert (table.role, dict(table.placements)) == ("replicate", {"dp": Shard(0), "tp": Replicate()})
    assert "vocabulary rows (50257) do not divide by the tp axis size 2" in table.note
    assert "tied with lm_head.weight" in table.note
    assert plan.params["transformer.h.0.attn.c_attn.weight"].sections == (64, 64, 64)


@pytest.mark.parametrize("name", list(CASES))
def test_hf_plan_snapshot(name, autoshard_snapshot):
    case = CASES[name]
    ids, kwargs = case.inputs(batch=2)
    plan = autoshard.plan(case.build(), {"dp": 2, "tp": 2}, example_inputs=(ids,), example_kwargs=kwargs)
    assert str(plan) + "\n" == autoshard_snapshot


# --- models as they load: use_cache on -------------------------------------------------------

WITH_CACHE = {"llama": (llama_with_cache, False), "bart": (bart_with_cache, True)}


def _with_cache_inputs(encoder_decoder: bool):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
    return ids, ({"decoder_input_ids": torch.randint(0, VOCAB, (2, 8), generator=gen)} if encoder_decoder else {})


@pytest.mark.parametrize("name", WITH_CACHE)
def test_a_model_with_its_cache_on_is_captured_without_it_and_left_untouched(name):
    """Captured with use_cache=False: the graph is the one of the same model configured without
    a cache, called as the model is (no use_cache argument), returning the model's output type
    with the same values (``out.logits``, ``out[0]``) and no cache."""
    build, encoder_decoder = WITH_CACHE[name]
    torch.manual_seed(0)
    model = build()
    ids, kwargs = _with_cache_inputs(encoder_decoder)
    before = {key: value.clone() for key, value in model.state_dict().items()}

    captured = capture(model, (ids,), kwargs)
    without_cache = copy.deepcopy(model)
    without_cache.config.use_cache = False
    assert captured.gm.code == capture(without_cache, (ids,), kwargs).gm.code
    with torch.no_grad():
        got, loaded = captured.gm(ids, **kwargs), model(ids, **kwargs)
    assert type(got) is type(loaded)
    assert list(got.keys()) == [key for key in loaded.keys() if key != "past_key_values"]
    assert isinstance(loaded.past_key_values, transformers.Cache) and got.past_key_values is None
    for key in got.keys():
        assert rel_error(got[key], loaded[key]) <= 1e-6, key
    assert rel_error(got[0], loaded.logits) <= 1e-6

    assert model.config.use_cache
    assert list(model.state_dict()) == list(before)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_llama_with_its_cache_on_is_proven_with_the_plan_of_one_without():
    torch.manual_seed(0)
    ids, _ = _with_cache_inputs(encoder_decoder=False)
    proof = autoshard.check(llama_with_cache(), {"dp": 2, "tp": 2}, example_inputs=(ids,))
    assert proof.ok, str(proof)
    assert str(proof.plan) == str(autoshard.plan(CASES["llama"].build(), {"dp": 2, "tp": 2}, example_inputs=(ids,)))


def test_a_cache_asked_for_is_refused_in_one_line_naming_what_to_set():
    ids, _ = _with_cache_inputs(encoder_decoder=False)
    with pytest.raises(ValueError) as raised:
        autoshard.plan(llama_with_cache(), {"tp": 2}, example_inputs=(ids,), example_kwargs={"use_cache": True})
    message = str(raised.value)
    assert "\n" not in message, message
    assert "DynamicCache" in message and "pass use_cache=False or set model.config.use_cache = False" in message
