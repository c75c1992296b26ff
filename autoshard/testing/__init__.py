"""Test how a model is sharded, in one process: no process group, no GPU.

    report = autoshard.testing.check(model, {"dp": 2, "tp": 4}, example_inputs=(tokens,))
    report.assert_close()            # the sharded step computes what one device does
    assert report.snapshot() == snapshot   # plan, predicted collectives, each unit's code

With the ``testing`` extra installed, pytest loads autoshard's plugin
(:mod:`autoshard.testing.plugin`): the ``autoshard_check`` and
``autoshard_snapshot`` fixtures and the ``autoshard_meshes`` marker.
``python -m autoshard check`` runs the same check from a shell.
"""

from autoshard.testing.report import Report, UnitCode, check
from autoshard.testing.snapshot import normalize, snapshot_text

__all__ = ["check", "Report", "UnitCode", "snapshot_text", "normalize"]
