"""A script that never calls ``destroy_process_group`` has its gloo group torn down before the
interpreter finalizes (``autoshard/runtime/teardown.py``); one that calls it, or dies of an
exception, is left as it is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import atexit, os, sys, tempfile
import torch.distributed as dist
from autoshard.runtime.teardown import destroy_gloo_at_exit

store = tempfile.mktemp()
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
# registered first, so it runs last (atexit is last in, first out): what the handler left
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
destroy_gloo_at_exit()
destroy_gloo_at_exit()  # once per process however often autoshard() runs
how = sys.argv[1]
if how == "destroyed":
    dist.destroy_process_group()
elif how == "raises":
    raise RuntimeError("a step failed")
"""


@pytest.mark.parametrize(("how", "left"), [("left", "False"), ("destroyed", "False"), ("raises", "True")])
def test_a_gloo_group_left_at_exit_is_destroyed_on_a_normal_exit_only(how, left):
    done = subprocess.run([sys.executable, "-c", _SCRIPT, how], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert f"initialized at exit: {left}" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert (done.returncode != 0) == (how == "raises"), done.stderr[-2000:]
