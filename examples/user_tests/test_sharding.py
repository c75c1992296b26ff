"""How TinyLM is sharded, tested in one process: plan, collectives, code and numerics.

Each test proves the sharded step against the unsharded model (``assert_close``)
and compares the plan, the predicted collectives and each block's code with the
snapshot under ``__snapshots__/`` (``pytest --snapshot-update`` rewrites it).
"""

import pytest
from tiny_lm import build_model, example_tokens


@pytest.mark.autoshard_meshes({"dp": 2, "tp": 2}, {"dp": 2, "tp": 4}, {"tp": 8})
def test_tiny_lm_shards(autoshard_check, autoshard_snapshot):
    report = autoshard_check(build_model(), example_inputs=(example_tokens(),))
    report.assert_close()
    assert report.snapshot() == autoshard_snapshot


def test_tiny_lm_with_sequence_parallelism(autoshard_check, autoshard_snapshot):
    report = autoshard_check(build_model(), {"dp": 2, "tp": 4}, example_inputs=(example_tokens(),),
                             sequence_parallel=True)
    report.assert_close()
    assert report.snapshot() == autoshard_snapshot
