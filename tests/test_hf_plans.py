"""Golden plans of the Hugging Face models (no process group needed)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autoshard
from tests.hf_cases import CASES, _gpt2


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
