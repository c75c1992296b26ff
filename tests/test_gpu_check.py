"""``benchmarks/gpu_check.sh`` runs on this machine: one line per check, every check it can run
here passes against one device, and the rest say why they were skipped."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import torch

from benchmarks.gpu_check import CHECKS, NAME_WIDTH, Failed, Measured, Skipped, combined

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_DEVICE_CHECKS = ("1 GPU bf16 eager (demo, 20 steps)", "1 GPU bf16 inductor (demo, 20 steps)")
LINE = re.compile(rf"^(.{{{NAME_WIDTH}}}) (PASS|FAIL|SKIP)  (.+)$")


def test_gpu_check_prints_one_line_per_check_and_passes_what_runs_here():
    result = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env={**os.environ, "PYTHON": sys.executable},
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    *lines, summary = result.stdout.strip().splitlines()
    checks = {}
    for line in lines:
        match = LINE.match(line)
        assert match, f"not a check's line: {line!r}"
        name, status, detail = match.group(1).rstrip(), match.group(2), match.group(3)
        assert name not in checks, f"{name} printed twice"
        checks[name] = (status, detail)
    gemm = next(name for name in checks if name.startswith("GEMM x @ W_t vs F.linear"))
    assert set(checks) == {*ONE_DEVICE_CHECKS, gemm, *CHECKS}, sorted(checks)
    assert checks[gemm][0] == "PASS" and "gemm ratio worst" in checks[gemm][1]
    for name in CHECKS:  # every multi-rank check runs on CPU gloo ranks, compared with one device
        status, detail = checks[name]
        assert status == "PASS" and "max rel error vs one device" in detail, (name, status, detail)
    assert "all-reduce 0.0e+00" in checks["bf16 tp sums: all-to-all + all-gather"][1]  # the fp32 sum, rounded once
    if not torch.cuda.is_available():
        assert all(checks[name] == ("SKIP", "no CUDA device") for name in ONE_DEVICE_CHECKS), checks
        assert summary == f"gpu_check: {1 + len(CHECKS)} passed, 0 failed, 2 skipped on 0 GPU(s)", summary


def test_a_check_passes_only_when_every_rank_is_within_its_bound():
    within = Measured({"loss": 1e-6, "weights": 2e-6}, 1e-4, "dp=2 x tp=2")
    assert combined([within, within]) == ("PASS", within.text())
    beyond = Measured({"loss": 1e-6, "weights": 2e-4}, 1e-4, "dp=2 x tp=2")
    status, detail = combined([within, beyond])
    assert status == "FAIL" and "weights 2.0e-04" in detail
    assert combined([Measured({"loss": math.nan, "weights": 0.0}, 1e-4, "dp=2 x tp=2"), within])[0] == "FAIL"
    failed = Failed("RuntimeError: the plan runs no reduce_scatter")
    assert combined([within, failed]) == ("FAIL", "rank 1: RuntimeError: the plan runs no reduce_scatter")
    assert combined([Skipped("needs 4 ranks")] * 2) == ("SKIP", "needs 4 ranks")
    exact = Measured({"all-reduce": 0.0}, 0.0, "tp=4")
    assert combined([exact]) == ("PASS", "tp=4: max rel error vs one device all-reduce 0.0e+00 (must be exact)")
    assert combined([exact, Measured({"all-reduce": 1e-9}, 0.0, "tp=4")])[0] == "FAIL"
