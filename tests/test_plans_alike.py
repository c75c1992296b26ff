"""Every rank plans byte for byte alike: the plan and the emitted code do not depend on the process.

Each rank plans on its own, in its own process: Python's string hashing is seeded per process and
objects (graph nodes among them) sit at other addresses, so anything that orders work by a set's
iteration can emit the collectives of one rank in another order, or of other sizes, than its peer's,
and the job stops in a collective that does not match ("4096 vs 2048 bytes"). ``autoshard()`` checks
that ranks agree on the parameters' placements before it runs (``autoshard/driver/agreement.py``);
this checks the whole plan and every op of the emitted code, in processes with different hash seeds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# model, mesh: what each process plans (tests/spellings.py's families, tests/pattern_models.py's MoE)
CASES = (
    ("spelling:llama_gqa", {"tp": 4}),
    ("spelling:llama_mqa", {"dp": 2, "tp": 2}),
    ("spelling:per_head", {"tp": 4}),
    ("spelling:channels", {"dp": 2, "tp": 2}),
    ("pattern:moe_indexed", {"dp": 2, "tp": 2}),
    # its bf16 grouped GEMMs once planned by what freed memory held (tests/test_rule_checks_alike.py)
    ("pattern:moe_grouped_mm", {"dp": 2, "tp": 2}),
)

_SCRIPT = r"""
import hashlib, json, sys
import torch
from autoshard.core.options import PlanOptions
from autoshard.driver import planning
from tests.pattern_models import PATTERNS
from tests.spellings import FAMILIES

for name, sizes in json.loads(sys.argv[1]):
    kind, what = name.split(":")
    torch.manual_seed(0)
    if kind == "spelling":
        spelling = FAMILIES[what].reference(what)
        model, inputs = spelling.build(), spelling.inputs()
    else:
        model, inputs = PATTERNS[what](), (torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)),)
    axes, options = planning.mesh_axes(sizes), PlanOptions()
    planned = planning.plan_result(model, axes, inputs, None, None, options)
    parts = planning.emit(planned, axes, options).parts
    code = [parts.root.code] + [parts.blocks[b].code for b in sorted(parts.blocks)]
    text = str(planned.plan) + json.dumps(planned.plan.to_dict(), sort_keys=False) + "".join(code)
    print(name, hashlib.sha256(text.encode()).hexdigest(), flush=True)
"""


def _digests(hash_seed: int) -> list[str]:
    import json

    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(CASES)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split("\n")


def test_processes_with_other_hash_seeds_plan_and_emit_alike():
    first, second = _digests(1), _digests(2)
    assert len([line for line in first if line]) == len(CASES), first
    for a, b in zip(first, second, strict=True):
        assert a == b, f"the plan or the emitted code differs between processes: {a} vs {b}"
