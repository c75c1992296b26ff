"""The corpus: model code from libraries other than transformers, planned and proven in one process.

For each case of ``tests/corpus.py`` (timm, x-transformers, torchtune, peft, torchtitan, litgpt,
open_clip, diffusers, fair-esm, vit-pytorch; tiny sizes, random weights) the model is built once
in its own process and, on each run, planned and proven without a process group (the zoo's
``planning.capture_for`` / ``planning.prove_on`` pair; ``autoshard.check`` on a ``cp`` mesh):

* fp32 on 2x2 (``dp=2 x tp=2``) and tp=4;
* bf16 mixed precision (``param_dtype=bfloat16, reduce_dtype=float32``) on 2x2;
* context parallelism on cp=2, for decoders.

One row per case and run: ``proven``, ``refused`` (the error a user gets), ``not captured``
(torch.export's refusal, wrapped by autoshard), ``PROOF FAILED`` (a plan the proof caught),
``INTERNAL`` (an error inside autoshard, or torch's own error escaping a pass unwrapped, with the
deepest autoshard frame of its traceback), or ``model fails unsharded`` (the model's own forward
fails under the option, as autoshard's capture runs it); tp collectives per
block (the distinct values) next to each block's analytic minimum (``benchmarks/zoo.py``'s
``block_minimum``), every break of a block's tp sharding with its cause (``plan.breaks``), and
whether the user's model was changed (``tests/fingerprint.py``: every parameter, buffer, plain
tensor and module attribute, before and after the run; the first difference is named). The
printed table marks ``rN``: N weight matrices tp keeps whole (``replicated_matrices`` in the
JSON), which a block without breaks can still have (an attention computed whole on every rank).

Then every case trains on 4 gloo ranks (``benchmarks/corpus_parity.py``: 2x2, 3 SGD steps against
one device within 1e-5, and a strict state-dict round trip both ways; ``--no-parity`` skips it).

Each case runs in a spawned process of its own with a timeout (``--timeout``, default 180 s);
rows finished before a timeout are kept. The summary gives, by library, the runs proven,
internal errors, models changed and runs with no tp break, in fp32, bf16 and cp. Run from the
repository root: ``python benchmarks/corpus.py`` (``make corpus``, also run by ``make zoo``);
results go to ``benchmarks/results/corpus.json``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import multiprocessing
import os
import sys
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.zoo import _UNSHARDED_FAILS_TEXT, UNSHARDED_FAILS, _options, block_cells, block_minimum, named_fix  # noqa: E402

MESHES = {"2x2": {"dp": 2, "tp": 2}, "tp4": {"tp": 4}, "cp2": {"cp": 2}}
# (mesh, option) runs of every case; cp runs only for decoders
RUNS = (("2x2", "fp32"), ("tp4", "fp32"), ("2x2", "bf16"), ("cp2", "fp32"))
CP_KINDS = ("decoder",)
TIMEOUT_S = 180
AUTOSHARD_DIRS = tuple(os.path.join(ROOT, d) + os.sep for d in ("autoshard", "passes"))


def _runs_for(case) -> list[tuple[str, str]]:
    return [(mesh, option) for mesh, option in RUNS if "cp" not in MESHES[mesh] or case.kind in CP_KINDS]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:300]


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the errors it was raised from (``__cause__``, else ``__context__``), innermost last."""
    chain = [err]
    while (inner := chain[-1].__cause__ or chain[-1].__context__) is not None and inner not in chain:
        chain.append(inner)
    return chain


def _frame_text(f) -> str:
    path = os.path.relpath(f.filename, ROOT) if f.filename.startswith(ROOT) else f.filename.split("site-packages/")[-1]
    return f"{path}:{f.lineno} {f.name}"


def _autoshard_frame(err: BaseException) -> str:
    """The deepest frame inside autoshard/ or passes/ (``path:line function``) of the innermost error
    of the chain that has one (an ``InternalError`` wraps the error a pass raised), or ''."""
    for inner in reversed(_chain(err)):
        frames = [f for f in traceback.extract_tb(inner.__traceback__) if f.filename.startswith(AUTOSHARD_DIRS)]
        if frames:
            return _frame_text(frames[-1])
    return ""


def _deepest_frame(err: BaseException) -> str:
    """The deepest frame of the innermost error of the chain (it may be torch's or a library's)."""
    inner = _chain(err)[-1]
    frames = traceback.extract_tb(inner.__traceback__)
    return f"{type(inner).__name__} at {_frame_text(frames[-1])}" if frames else ""


def _replicated_matrices(plan) -> list[str]:
    """Weight matrices (both dims >= 16, so not a class token or a LoRA factor) that tp keeps whole."""
    return [name for name, entry in plan.params.items()
            if name.endswith("weight") and len(entry.shape) == 2 and min(entry.shape) >= 16
            and entry.role.value == "replicate"]


def run_one(model, case, mesh_name: str, option: str, args: tuple, kwargs: dict, captures: dict) -> dict:
    """One run: planned and proven on ``mesh_name`` under ``option``; never raises."""
    import torch

    import autoshard
    from autoshard.core.errors import InternalError
    from autoshard.driver import planning
    from autoshard.passes.capture import CaptureError
    from autoshard.proof.proof import ProofError

    row = {"mesh": mesh_name, "option": option}
    sizes = MESHES[mesh_name]
    options = _options(option)
    start = time.perf_counter()
    try:
        if "cp" in sizes:
            proof = autoshard.check(model, sizes, example_inputs=args, example_kwargs=kwargs,
                                    mp_policy=options.mp_policy)
            plan = proof.plan
            row["cp_collectives"] = {k: v[0] for k, v in getattr(proof, "cp_collectives", {}).items()}
        else:
            axes = planning.mesh_axes(sizes)
            key = (option, axes.has_dp and options.mp_policy is not None)
            if key not in captures:
                captures[key] = planning.capture_for(model, args, kwargs, options.for_tp(axes.has_tp), axes)
            if option == "fp32":
                captures["fp32-captured"] = True
            proof = planning.prove_on(model, axes, args, kwargs, options, captured=captures[key])
            plan = proof.plan
        blocks = [u for u in plan.units if u]
        row |= {
            "status": "proven" if proof.ok else "PROOF FAILED",
            "blocks": len(blocks),
            "per_block": sorted({plan.num_tp_collectives(b) for b in blocks}) if "tp" in sizes else [],
            "minimum": sorted({block_minimum(plan, b) for b in blocks}) if "tp" in sizes else [],
            "breaks": [list(b) for b in plan.breaks],
            "units": blocks,
            "tp_matrices": sum(e.role.value in ("colwise", "rowwise", "vocab_parallel") for e in plan.params.values()),
            "replicated_matrices": _replicated_matrices(plan) if "tp" in sizes else [],
            "broken": len({u for u, _ in plan.breaks}),
            "max_error": max(proof.max_output_error, proof.max_gradient_error)
            if hasattr(proof, "max_output_error") else
            max((m.error for m in (*proof.outputs, *proof.gradients)), default=0.0),
            "detail": "" if proof.ok else str(proof).splitlines()[-1].strip()[:300],
        }
    except CaptureError as err:
        # under an option, a model fp32 captures fails in the option's own run; else export refuses it
        status = UNSHARDED_FAILS if option != "fp32" and captures.get("fp32-captured") else "not captured"
        row |= {"status": status, "detail": _first_line(err), "raised_at": _autoshard_frame(err),
                "cause": _first_line(err.__cause__) if err.__cause__ else "",
                "names_fix": named_fix(str(err))}
    except (InternalError, ProofError) as err:
        row |= {"status": "INTERNAL", "detail": f"{type(err).__name__}: {_first_line(err)}",
                "raised_at": _autoshard_frame(err), "deepest": _deepest_frame(err)}
    except (ValueError, NotImplementedError) as err:
        if str(err).startswith(_UNSHARDED_FAILS_TEXT):
            status = UNSHARDED_FAILS
            row["names_fix"] = named_fix(str(err))
        elif str(err).startswith("autoshard"):
            status = "refused"
        else:  # torch's own error escaping a pass (a rewritten graph torch cannot run): not a refusal
            status = "INTERNAL"
        row |= {"status": status, "detail": _first_line(err) if status != "INTERNAL" else
                f"{type(err).__name__} (not wrapped): {_first_line(err)}",
                "raised_at": _autoshard_frame(err), "deepest": _deepest_frame(err)}
    except Exception as err:  # noqa: BLE001 - the corpus reports what a user would see
        row |= {"status": "INTERNAL", "detail": f"{type(err).__name__}: {_first_line(err)}",
                "raised_at": _autoshard_frame(err), "deepest": _deepest_frame(err)}
    finally:
        torch.set_default_dtype(torch.float32)
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def _child(case_id: str, conn) -> None:
    """One case in its own process: each finished row is sent at once (a timeout keeps them)."""
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    import torch

    from tests.corpus import CASES
    from tests.fingerprint import fingerprint, first_difference

    case = next(c for c in CASES if c.id == case_id)
    try:
        model = case.build()
        args, kwargs = case.inputs()
        params = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        conn.send(("built", {"params": params, "trainable": trainable}))
    except Exception as err:  # noqa: BLE001
        conn.send(("build_error", f"{type(err).__name__}: {_first_line(err)} [{_deepest_frame(err)}]"))
        conn.close()
        return
    captures = {}
    for mesh_name, option in _runs_for(case):
        torch.manual_seed(0)
        before = fingerprint(model)
        row = run_one(model, case, mesh_name, option, args, kwargs, captures)
        try:
            difference = first_difference(before, fingerprint(model))
        except Exception as err:  # noqa: BLE001 - a model the run left unreadable is changed too
            difference = f"fingerprint failed after the run: {type(err).__name__}: {_first_line(err)}"
        row["changed"] = difference is not None
        row["change"] = difference or ""
        if row["status"] == UNSHARDED_FAILS and row.get("names_fix"):
            # the model's own forward fails under FSDP2's policy: run again with the fix the error names
            fixed = run_one(model, case, mesh_name, row["names_fix"], args, kwargs, captures)
            row["with_named_fix"] = fixed["status"]
            row["changed"] = row["changed"] or first_difference(before, fingerprint(model)) is not None
        conn.send(("row", row))
    conn.send(("done", None))
    conn.close()


def run_case(case, timeout: float) -> dict:
    """Start ``case``'s process and collect its rows (blocking); see :func:`run_cases`."""
    return run_cases([case], timeout, jobs=1)[0]


def run_cases(cases, timeout: float, jobs: int = 2, on_result=None) -> list[dict]:
    """Every case in a spawned process of its own, ``jobs`` at a time, each killed after ``timeout`` s."""
    ctx = multiprocessing.get_context("spawn")
    pending = list(cases)
    running = {}  # case id -> (process, conn, result, started)
    results = []
    while pending or running:
        while pending and len(running) < jobs:
            case = pending.pop(0)
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(case.id, child), daemon=True)
            proc.start()
            child.close()
            result = {"library": case.library, "name": case.name, "kind": case.kind,
                      "features": list(case.features), "rows": []}
            running[case.id] = (proc, parent, result, time.perf_counter())
        time.sleep(0.2)
        for case_id, (proc, conn, result, started) in list(running.items()):
            finished = False
            try:
                while conn.poll():
                    what, value = conn.recv()
                    if what == "row":
                        result["rows"].append(value)
                    elif what == "built":
                        result |= value
                    elif what == "build_error":
                        result["build_error"] = value
                        finished = True
                    elif what == "done":
                        finished = True
            except EOFError:  # the process died
                finished = True
                if not proc.is_alive() and proc.exitcode:
                    result["crash"] = f"process exited with code {proc.exitcode}"
            elapsed = time.perf_counter() - started
            if not finished and elapsed > timeout:
                proc.kill()
                result["timeout"] = f"killed after {timeout:.0f} s"
                finished = True
            if not finished and not proc.is_alive():
                while conn.poll():  # rows sent just before it ended
                    what, value = conn.recv()
                    if what == "row":
                        result["rows"].append(value)
                result["crash"] = f"process exited with code {proc.exitcode}"
                finished = True
            if finished:
                if "timeout" in result or "crash" in result:  # the runs it did not reach
                    status = "TIMEOUT" if "timeout" in result else "CRASH"
                    done = {(row["mesh"], row["option"]) for row in result["rows"]}
                    case = next(c for c in cases if c.id == case_id)
                    result["rows"] += [{"mesh": mesh, "option": option, "status": status,
                                        "detail": result.get("timeout") or result.get("crash"), "seconds": 0.0}
                                       for mesh, option in _runs_for(case) if (mesh, option) not in done]
                proc.join(5)
                conn.close()
                result["seconds"] = round(elapsed, 1)
                del running[case_id]
                results.append(result)
                if on_result:
                    on_result(result)
    return results


# ----------------------------------------------------------------------------------------------- report


def _print_case(result: dict) -> None:
    head = f"{result['library']:<16}{result['name']:<26}"
    if "build_error" in result:
        print(f"{head}not built: {result['build_error']}", flush=True)
        return
    for row in result["rows"]:
        per_block, broken = block_cells(row)
        changed = "CHANGED" if row.get("changed") else "-"
        if row.get("replicated_matrices"):
            broken += f" r{len(row['replicated_matrices'])}"
        detail = row.get("detail") or (row["breaks"][0][1] if row.get("breaks") else "")
        print(f"{head}{row['mesh']:<5}{row['option']:<6}{row['status']:<14}{per_block:>14}{broken:>9} {changed:<8}"
              f"{row['seconds']:>5.1f}s  {detail[:100]}", flush=True)


def _print_parity(case_id: str, row: dict) -> None:
    errors = (f"loss {row['loss_error']:.1e} params {row['param_error']:.1e}" if "loss_error" in row else "")
    print(f"{case_id:<42}{row['status']:<12}{errors:<30}{row.get('detail', '')[:100]}", flush=True)


def _parity_summary(results: list[dict]) -> list[str]:
    rows = [(r, r["parity"]) for r in results if "parity" in r]
    if not rows:
        return []
    counts = collections.Counter(p["status"] for _, p in rows)
    proven = [p for r, p in rows if any(row["mesh"] == "2x2" and row["option"] == "fp32" and row["status"] == "proven"
                                        for row in r["rows"])]
    worst = max((max(p.get("loss_error", 0), p.get("param_error", 0)) for _, p in rows if p["status"] == "trained"),
                default=0.0)
    return [f"trained on 4 gloo ranks (2x2, fp32, 3 SGD steps, strict round trip): {len(rows)} cases, "
            + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            + f"; of the {len(proven)} proven on 2x2 fp32, trained {sum(p['status'] == 'trained' for p in proven)}"
            + f"; worst error of those trained {worst:.1e}"]


def _summary(results: list[dict]) -> list[str]:
    built = [r for r in results if "build_error" not in r]
    lines = [f"corpus: {len(results)} cases from {len({r['library'] for r in results})} libraries, "
             f"{len(built)} built; {sum(len(r['rows']) for r in built)} runs"
             + (f"; {sum('timeout' in r for r in results)} cases timed out" if any('timeout' in r for r in results)
                else "")]
    groups = (("fp32", lambda row: row["option"] == "fp32" and row["mesh"] != "cp2"),
              ("bf16", lambda row: row["option"] == "bf16"),
              ("cp2", lambda row: row["mesh"] == "cp2"))
    for title, keep in groups:
        rows = [row for r in built for row in r["rows"] if keep(row)]
        counts = collections.Counter(row["status"] for row in rows)
        changed = sum(row.get("changed", False) for row in rows)
        unbroken = sum(row.get("broken") == 0 for row in rows)
        runnable = len(rows) - counts[UNSHARDED_FAILS]  # the zoo's measure: runs whose model runs without autoshard
        share = f" ({counts['proven']} of {runnable} runs whose model runs unsharded, " \
                f"{100 * counts['proven'] / runnable:.0f}%)" if runnable else ""
        lines.append(f"{title}: {len(rows)} runs, proven {counts['proven']}{share}, refused {counts['refused']}, "
                     f"not captured {counts['not captured']}, proof failed {counts['PROOF FAILED']}, "
                     f"internal {counts['INTERNAL']}, model fails unsharded {counts[UNSHARDED_FAILS]}"
                     + (f", timed out {counts['TIMEOUT']}" if counts["TIMEOUT"] else "")
                     + (f", crashed {counts['CRASH']}" if counts["CRASH"] else "") + "; "
                     f"models changed {changed}" + (f"; no tp break {unbroken}" if title != "cp2" else "")
                     + (f"; of those failing unsharded, proven with the fix the error names (buffer_dtype or "
                        f"output_dtype) {fixed}"
                        if (fixed := sum(row.get("with_named_fix") == "proven" for row in rows)) else ""))
    lines += _parity_summary(results)
    lines.append("by library (proven / internal / changed / no tp break, of runs):")
    for library in sorted({r["library"] for r in results}):
        mine = [r for r in results if r["library"] == library]
        parts = []
        for title, keep in groups:
            rows = [row for r in mine for row in r["rows"] if keep(row)]
            if not rows:
                continue
            proven = sum(row["status"] == "proven" for row in rows)
            internal = sum(row["status"] == "INTERNAL" for row in rows)
            changed = sum(row.get("changed", False) for row in rows)
            text = f"{title} {proven}/{internal}/{changed}"
            if title != "cp2":
                text += f"/{sum(row.get('broken') == 0 for row in rows)}"
            parts.append(f"{text} of {len(rows)}")
        not_built = sum("build_error" in r for r in mine)
        lines.append(f"  {library:<16} {len(mine)} cases: " + "; ".join(parts)
                     + (f"; {not_built} not built" if not_built else ""))
    return lines


def _source() -> str:
    """The commit of autoshard the corpus ran on, ``+dirty`` when autoshard/ or passes/ have local changes."""
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "autoshard", "passes"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def _versions() -> dict:
    from importlib import metadata

    from tests.corpus import CASES

    out = {}
    for name in sorted({c.library for c in CASES} | {"torch", "transformers"}):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--libraries", default="", help="comma-separated libraries; all by default")
    parser.add_argument("--cases", default="", help="comma-separated case ids (library:name); all by default")
    parser.add_argument("--kinds", default="", help="comma-separated kinds; all by default")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per case")
    parser.add_argument("--no-parity", action="store_true", help="prove only; no training on 4 gloo ranks")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "corpus.json"))
    args = parser.parse_args()

    from tests.corpus import corpus_cases

    cases = corpus_cases(args.libraries.split(",") if args.libraries else None,
                         args.kinds.split(",") if args.kinds else None)
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c.id in wanted]
    started = time.perf_counter()
    source = _source()
    results = run_cases(cases, args.timeout, args.jobs, on_result=_print_case)
    order = {c.id: i for i, c in enumerate(cases)}
    results.sort(key=lambda r: order[f"{r['library']}:{r['name']}"])
    if not args.no_parity:
        from benchmarks.corpus_parity import train_cases

        print("\ntrained on 4 gloo ranks (2x2, 3 SGD steps against one device, strict state-dict round trip):")
        trained = train_cases(cases, on_row=_print_parity)
        for result in results:
            result["parity"] = trained[f"{result['library']}:{result['name']}"]
    summary = _summary(results)
    versions = _versions()
    print()
    print("\n".join(summary))
    print(f"({len(cases)} cases in {time.perf_counter() - started:.0f} s; autoshard {source}; "
          + ", ".join(f"{k} {v}" for k, v in versions.items()) + f"; {datetime.date.today().isoformat()})")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": datetime.date.today().isoformat(), "autoshard": source, "versions": versions,
                   "summary": summary,
                   "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
