"""syrupy's storage for autoshard snapshots: one plain ``.txt`` file per test.

A snapshot is long (a plan table and every unit's code) and is reviewed in a
pull request, so each test gets its own file of plain text, not one entry of a
shared ``.ambr`` file with quoting: ``__snapshots__/<test file>/<test
name>[<mesh>].txt``. syrupy finds, compares, diffs, writes (``pytest
--snapshot-update``) and reports unused files as it does for its own
extensions.
"""

from __future__ import annotations

from syrupy.extensions.single_file import SingleFileSnapshotExtension, WriteMode


class AutoshardSnapshotExtension(SingleFileSnapshotExtension):
    """Stores ``report.snapshot()`` (or a :class:`~autoshard.testing.report.Report`) as text."""

    file_extension = "txt"
    _write_mode = WriteMode.TEXT

    def serialize(self, data, *, exclude=None, include=None, matcher=None) -> str:
        snapshot = getattr(data, "snapshot", None)
        if callable(snapshot):
            data = snapshot()
        if not isinstance(data, str):
            raise TypeError(
                f"autoshard_snapshot stores text: compare it with report.snapshot(), got {type(data).__name__}"
            )
        return data
