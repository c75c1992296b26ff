"""Every spelling of ``tests/spellings.py`` planned and proven on 2x2, tp=4 and tp=8, fp32 and bf16.

For each run: proven or not (and why), the tp collectives per block against the family's
reference spelling on the same mesh and dtype, and the breaks the plan names (op and line).
Writes ``benchmarks/results/spellings.json`` and prints the summary and every run that is not
proven or costs more than its reference.

    python benchmarks/spellings.py [--combined N] [--workers N] [--family NAME ...]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MESHES = {"2x2": {"dp": 2, "tp": 2}, "tp4": {"tp": 4}, "tp8": {"tp": 8}}
DTYPES = ("fp32", "bf16")


def run_one(spelling, mesh_name: str, dtype: str) -> dict:
    """One plan and proof, as a JSON-able record."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import autoshard
    from autoshard.core.errors import InternalError

    options = {}
    if dtype == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    record = {"spelling": spelling.name, "family": spelling.family, "mesh": mesh_name, "dtype": dtype}
    start = time.perf_counter()
    try:
        proof = autoshard.check(spelling.build(), MESHES[mesh_name], example_inputs=spelling.inputs(), **options)
        plan = proof.plan
        blocks = [u for u in plan.units if u]
        record.update(
            status="proven" if proof.ok else "failed",
            collectives={u: plan.num_tp_collectives(u) for u in blocks},
            breaks=[list(b) for b in plan.breaks],
            why=None if proof.ok else str(proof)[:2000],
        )
    except InternalError:
        record.update(status="internal", why=traceback.format_exc()[-3000:])
    except (ValueError, NotImplementedError) as err:
        record.update(status="refused", why=f"{type(err).__name__}: {err}"[:3000])
    except Exception:  # noqa: BLE001 - a crash is a result to report, not to stop on
        record.update(status="crash", why=traceback.format_exc()[-3000:])
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def _job(args):
    return run_one(*args)


def score(records: list[dict]) -> dict:
    """Each run against its family's reference spelling on the same mesh and dtype."""
    from tests.spellings import FAMILIES

    reference = {}
    for r in records:
        if r["spelling"] == FAMILIES[r["family"]].reference(r["family"]).name:
            reference[(r["family"], r["mesh"], r["dtype"])] = r
    for r in records:
        ref = reference.get((r["family"], r["mesh"], r["dtype"]))
        if r["status"] != "proven" or ref is None or ref["status"] != "proven":
            r["at_reference"] = False
            continue
        r["reference_collectives"] = max(ref["collectives"].values(), default=0)
        r["at_reference"] = _at_reference(r, ref)
    total = len(records)
    return {
        "runs": total,
        "spellings": len({r["spelling"] for r in records}),
        "proven": sum(r["status"] == "proven" for r in records),
        "internal": sum(r["status"] == "internal" for r in records),
        "crash": sum(r["status"] == "crash" for r in records),
        "refused": sum(r["status"] == "refused" for r in records),
        "failed": sum(r["status"] == "failed" for r in records),
        "at_reference": sum(r["at_reference"] for r in records),
    }


def _at_reference(run: dict, ref: dict) -> bool:
    """As many FSDP blocks as the reference, each at most the reference's tp collectives and keeping
    tp where the reference does (a block computed whole, with no collective at all, is no cheaper:
    its work and weights are whole on every rank), and no more breaks."""
    mine, theirs = list(run["collectives"].values()), list(ref["collectives"].values())
    if len(mine) != len(theirs) or len(run["breaks"]) > len(ref["breaks"]):
        return False
    return all(c == r == 0 or 0 < c <= r for c, r in zip(mine, theirs, strict=True))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--combined", type=int, default=20, help="random combinations per family")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--family", action="append", default=None)
    parser.add_argument("--mesh", action="append", default=None, choices=sorted(MESHES))
    parser.add_argument("--dtype", action="append", default=None, choices=DTYPES)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "spellings.json"))
    args = parser.parse_args(argv)
    from tests.spellings import FAMILIES, spellings

    families = args.family or list(FAMILIES)
    jobs = [(s, m, d) for f in families for s in spellings(f, args.combined)
            for m in (args.mesh or MESHES) for d in (args.dtype or DTYPES)]
    start = time.perf_counter()
    if args.workers > 1:
        with multiprocessing.get_context("spawn").Pool(args.workers, maxtasksperchild=50) as pool:
            records = pool.map(_job, jobs, chunksize=4)
    else:
        records = [_job(j) for j in jobs]
    summary = score(records) | {"seconds": round(time.perf_counter() - start, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "runs": records}, indent=1))
    for r in records:
        if r["status"] != "proven":
            print(f"{r['status']:9} {r['mesh']:4} {r['dtype']} {r['spelling']}\n    {(r['why'] or '')[-600:]}")
        elif not r["at_reference"]:
            print(f"costly    {r['mesh']:4} {r['dtype']} {r['spelling']}: {r['collectives']} vs "
                  f"{r.get('reference_collectives')}; breaks {r['breaks'][:1]}")
    print(json.dumps(summary))
    ok = summary["internal"] == 0 and summary["proven"] == summary["runs"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
