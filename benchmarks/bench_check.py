"""How long ``autoshard.testing.check`` takes on one CPU core: a 4-block Hugging Face Llama at dp=2 x tp=4.

``python benchmarks/bench_check.py`` (``make bench-check``) pins this process to
one core (``sched_setaffinity`` and one torch thread), builds the model of
``tests/hf_cases.llama_4_blocks`` (vocabulary 32000, hidden 256, 8 heads of which
4 kv heads, 4 blocks; 19.3M parameters) with a batch of 1x128 tokens, and times
``--repeats`` checks in this process: the first pays torch.export's one-time
warm-up, the others are what each further test in a suite costs. Each check is
the whole report: capture, plan, emitted code, prediction and the proof of all 4
tp ranks. The goal is at most 10 s for the first. JSON goes to
``benchmarks/results/bench_check.json`` unless ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

GOAL_SECONDS = 10.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_check.json"))
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    start = time.perf_counter()
    import torch

    torch.set_num_threads(1)
    import autoshard.testing
    from tests.hf_cases import llama_4_blocks, llama_4_blocks_tokens

    imported = time.perf_counter() - start
    model, tokens = llama_4_blocks(), llama_4_blocks_tokens()
    params = sum(p.numel() for p in model.parameters())
    runs = []
    for i in range(args.repeats):
        began = time.perf_counter()
        report = autoshard.testing.check(model, {"dp": 2, "tp": 4}, example_inputs=(tokens,))
        seconds = time.perf_counter() - began
        report.assert_close()
        runs.append({"seconds": round(seconds, 3), "proof_seconds": round(report.proof.seconds, 3),
                     "max_output_error": report.proof.max_output_error,
                     "max_gradient_error": report.proof.max_gradient_error})
        print(f"check {i + 1}: {seconds:.2f} s (proof {report.proof.seconds:.2f} s; output error "
              f"{report.proof.max_output_error:.1e}, gradient error {report.proof.max_gradient_error:.1e})")
    first = runs[0]["seconds"]
    verdict = "within" if first <= GOAL_SECONDS else "OVER"
    print(f"4-block Llama ({params / 1e6:.1f}M parameters, tokens 1x128) at dp=2 x tp=4 on one core: first check "
          f"{first:.2f} s ({verdict} the {GOAL_SECONDS:.0f} s goal), then {min(r['seconds'] for r in runs[1:]):.2f} s"
          if len(runs) > 1 else f"first check {first:.2f} s")
    print(f"imports (torch, transformers, autoshard) took {imported:.2f} s before that")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": "tests.hf_cases.llama_4_blocks", "parameters": params, "mesh": {"dp": 2, "tp": 4},
                   "cores": 1, "import_seconds": round(imported, 3), "runs": runs, "goal_seconds": GOAL_SECONDS},
                  f, indent=2)


if __name__ == "__main__":
    main()
