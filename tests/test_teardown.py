"""A gloo group's workers get a grace period before the interpreter finalizes
(``autoshard/runtime/teardown.py``): registered once, run at a normal exit and at an exit by an
exception alike, and only under gloo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import atexit, sys, tempfile, time
import torch, torch.distributed as dist
from autoshard.runtime import teardown

dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
teardown.GRACE_SECONDS = 0.5
start = []
atexit.register(lambda: print(f"grace {time.monotonic() - start[0]:.2f}", flush=True))  # runs last
teardown.let_gloo_workers_finish()
teardown.let_gloo_workers_finish()  # once per process, however often autoshard() runs
atexit.register(lambda: start.append(time.monotonic()))  # runs first
t = torch.ones(4)
dist.all_reduce(t)  # the script's last collective is its last line
if sys.argv[1] == "raises":
    raise RuntimeError("a step failed")
"""


@pytest.mark.parametrize("how", ["returns", "raises"])
def test_the_exit_waits_for_gloo_workers_once(how):
    done = subprocess.run([sys.executable, "-c", _SCRIPT, how], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert (done.returncode != 0) == (how == "raises"), done.stderr[-2000:]
    waited = float(done.stdout.split("grace ")[1])
    assert 0.5 <= waited < 1.0, done.stdout  # one grace period, not two
