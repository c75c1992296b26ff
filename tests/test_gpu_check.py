"""``benchmarks/gpu_check.sh`` runs on this machine: its CPU parts pass, and it says what it skipped."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_runs_its_cpu_parts_and_names_what_it_skips():
    result = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env={**os.environ, "PYTHON": sys.executable},
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith("gpu_check: passed"), summary
    assert "gemm ratio worst" in result.stdout
    assert "max |loss - reference|" in result.stdout  # the bf16 demo ran and compared with fp32
    if not torch.cuda.is_available():
        assert "skipped: 1-GPU demo and GEMM on CUDA (no CUDA device)" in summary, summary
