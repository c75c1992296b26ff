"""Golden snapshots: compare text to ``tests/golden/<name>``; ``--update-golden`` rewrites."""

from __future__ import annotations

import difflib
import os

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")


def check_golden(name: str, text: str, update: bool) -> None:
    path = os.path.join(GOLDEN_DIR, name)
    text = text.rstrip() + "\n"
    if update:
        os.makedirs(GOLDEN_DIR, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        return
    if not os.path.exists(path):
        raise AssertionError(f"no golden file {path}; run `make golden` (pytest --update-golden) to create it")
    with open(path) as f:
        expected = f.read()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), path, "actual"))
        raise AssertionError(f"{name} changed; if intended, run `make golden`:\n{diff}")
