"""Golden plans of the Hugging Face models (no process group needed)."""

from __future__ import annotations

import pytest

import autoshard
from tests.golden import check_golden
from tests.hf_cases import CASES


@pytest.mark.parametrize("name", list(CASES))
def test_hf_plan_golden(name, update_golden):
    case = CASES[name]
    ids, kwargs = case.inputs(batch=2)
    plan = autoshard.plan(case.build(), {"dp": 2, "tp": 2}, example_inputs=(ids,), example_kwargs=kwargs)
    check_golden(f"plan_hf_{name}_2x2.txt", str(plan), update_golden)
