"""The project's own models through the plugin, as a user's suite would test them: each plan proven
against the unsharded model and snapshotted (``make golden`` rewrites the snapshots)."""

from __future__ import annotations

import pytest
import torch

from tests.cases import MODELS
from tests.hf_cases import CASES


@pytest.mark.autoshard_meshes({"dp": 2, "tp": 2}, {"tp": 4}, {"dp": 2, "tp": 8})
def test_example_llama(autoshard_check, autoshard_snapshot):
    build, inputs = MODELS["llama"]
    torch.manual_seed(0)
    report = autoshard_check(build(), example_inputs=inputs)
    report.assert_close()
    assert report.snapshot() == autoshard_snapshot


@pytest.mark.autoshard_meshes({"dp": 2, "tp": 4})
def test_hf_llama(autoshard_check, autoshard_snapshot):
    case = CASES["llama"]
    ids, kwargs = case.inputs(batch=2)
    report = autoshard_check(case.build(), example_inputs=(ids,), example_kwargs=kwargs)
    report.assert_close()
    assert report.snapshot() == autoshard_snapshot
