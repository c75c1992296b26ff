"""The zoo: every transformers family autoshard can capture, planned and proven on five meshes.

For each family of ``tests/zoo.py`` (transformers' own model classes, shrunk generically: width
64, 2 layers, 4 heads, 2 kv heads where the config has them, vocabulary 256) the model is captured
once and, on each mesh, planned and proven in one process (``autoshard.check``: every tp rank of
the emitted code against the unsharded graph, forward and backward, on fresh inputs). One row per
family and mesh:

* ``proven``, or ``refused`` with the error a user gets (it names the op or parameter), or
  ``PROOF FAILED`` (a plan the proof caught: ``autoshard()`` refuses it with the node), or
  ``INTERNAL`` (an error inside a pass);
* tp collectives per block per training step (the distinct values over the blocks), each
  block's analytic minimum (:func:`block_minimum`: one forward all-reduce per partial sum the
  block must reduce, one backward all-reduce per input its sharded matmuls read, or as many as
  the forward ones if more, and one backward all-gather per attention whose kv heads are fewer
  than tp, and one backward all-reduce of the replicated weights its cut heads read, bucketed:
  a dense attention + MLP block's is 4, 5 with kv heads fewer than tp or q/k norms, a parallel
  block's 2), and every break of a block's tp sharding with its cause (``plan.breaks``).

The summary gives, by kind, the runs with no break and the runs at their analytic minimum, over
all runs and over the runs on meshes whose tp divides the model's attention heads (the zoo's
4 heads: 2x2, tp=4 and 2x4), where every block can be cut by heads.

Families ``torch.export`` cannot capture are counted apart with export's reason. Summary lines
give the percentages. ``--options`` adds bf16 mixed precision and sequence parallelism on a
subset. Run from the repository root: ``python benchmarks/zoo.py`` (``make zoo``); results go to
``benchmarks/results/zoo.json``.
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
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MESHES = {
    "2x2": {"dp": 2, "tp": 2},
    "tp4": {"tp": 4},
    "tp8": {"tp": 8},
    "2x4": {"dp": 2, "tp": 4},
    "hsdp": {"dp_replicate": 2, "dp_shard": 2, "tp": 2},
}
OPTION_MESHES = ("2x2", "2x4")
# a run whose model fails without autoshard under the option (the proof's unsharded graph, or the
# capture of the forward as FSDP2's mixed precision runs it): no plan to judge
UNSHARDED_FAILS = "model fails unsharded"
_UNSHARDED_FAILS_TEXT = "autoshard: the model as captured does not run on these inputs and options, unsharded"
DENSE_BLOCK_MINIMUM = 4


# the option an error on mixed dtypes names (its text) -> the run with it set
MIXED_DTYPE_FIXES = {"buffer_dtype=": "bf16_buffers", "output_dtype=": "bf16_outputs"}


def named_fix(message: str) -> str | None:
    """The run with the fix ``message`` (an error on mixed dtypes) names, if it names one."""
    return next((run for text, run in MIXED_DTYPE_FIXES.items() if text in message), None)


def _options(name: str):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from autoshard.core.options import PlanOptions

    if name in ("bf16", *MIXED_DTYPE_FIXES.values()):
        # bf16_buffers, bf16_outputs: with the buffers, or each block's outputs, in bf16 too (the fix an
        # error on mixed dtypes names)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                      output_dtype=torch.bfloat16 if name == "bf16_outputs" else None)
        return PlanOptions(mp_policy=policy, buffer_dtype=torch.bfloat16 if name == "bf16_buffers" else None)
    if name == "sequence_parallel":
        return PlanOptions(sequence_parallel=True)
    return PlanOptions()


def run_family(case, meshes: tuple[str, ...], option_names: tuple[str, ...]) -> dict:
    """One family: captured once per option set, then planned and proven on each mesh."""
    import torch

    from autoshard.core.errors import InternalError
    from autoshard.driver import planning
    from autoshard.passes.capture import CaptureError
    from autoshard.proof.proof import ProofError

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    rows = []
    start = time.perf_counter()
    try:
        model = case.build()
        args, kwargs = case.inputs()
    except Exception as err:  # the survey built it once; a second build failing is the zoo's problem
        return {"family": case.family, "kind": case.kind, "build_error": _first_line(err)}
    heads = _attention_heads(model)
    for option in option_names:
        options = _options(option)
        names = meshes if option == "fp32" else OPTION_MESHES
        captures = {}
        for mesh_name in names:
            axes = planning.mesh_axes(MESHES[mesh_name])
            row = {"mesh": mesh_name, "option": option}
            try:
                key = axes.has_dp and options.mp_policy is not None
                if key not in captures:
                    captures[key] = planning.capture_for(model, args, kwargs, options.for_tp(axes.has_tp), axes)
                proof = planning.prove_on(model, axes, args, kwargs, options, captured=captures[key])
                plan = proof.plan
                blocks = [u for u in plan.units if u]
                row |= {
                    "status": "proven" if proof.ok else "PROOF FAILED",
                    "per_block": sorted({plan.num_tp_collectives(b) for b in blocks}),
                    "above_minimum": sum(plan.num_tp_collectives(b) > block_minimum(plan, b) for b in blocks),
                    "minimum": sorted({block_minimum(plan, b) for b in blocks}),
                    "breaks": [list(b) for b in plan.breaks],
                    "heads_divide": heads % axes.tp == 0 if heads else None,
                    "blocks": len(blocks),
                    "broken": len({u for u, _ in plan.breaks}),
                    "first_break": plan.breaks[0][1] if plan.breaks else "",
                    "max_error": max(proof.max_output_error, proof.max_gradient_error),
                    # sequence parallelism: outputs cut over the sequence, and kept whole (a length tp
                    # does not divide)
                    "sequence_cut": sum(c.kind == "reduce-scatter" for p in plan.params.values()
                                        for c in p.collectives),
                    "sequence_whole": sum(p.why.sequence_whole is not None
                                          for p in plan.params.values()),
                    "detail": "" if proof.ok else str(proof).splitlines()[-1].strip(),
                }
            except CaptureError as err:
                if option == "fp32":
                    return {"family": case.family, "kind": case.kind, "export_error": _first_line(err)}
                # the model's own forward fails under the option (fp32 buffers a bf16 matmul cannot mix)
                row |= {"status": UNSHARDED_FAILS, "detail": _first_line(err)}
            except (InternalError, ProofError) as err:
                row |= {"status": "INTERNAL", "detail": _first_line(err)}
            except (ValueError, NotImplementedError) as err:
                status = UNSHARDED_FAILS if str(err).startswith(_UNSHARDED_FAILS_TEXT) else "refused"
                row |= {"status": status, "detail": _first_line(err)}
            except Exception as err:  # noqa: BLE001  (the zoo reports what a user would see)
                row |= {"status": "INTERNAL", "detail": f"{type(err).__name__}: {_first_line(err)}"}
            rows.append(row)
    return {"family": case.family, "kind": case.kind, "class": case.class_name, "rows": rows,
            "seconds": time.perf_counter() - start}


_HEAD_FIELDS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "n_heads")


def _attention_heads(model) -> int | None:
    """The attention heads the model's config gives (the first such field), if any."""
    config = getattr(model, "config", None)
    for field in _HEAD_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


_MATMUL_NAMES = ("linear", "matmul", "mm", "bmm", "addmm", "grouped_mm", "einsum")
# a value every head shares (MLA's one rotary key) broadcast over the cut heads: its gradient is
# summed over tp once, as a multi-query k/v's is
_BROADCASTS = ("expand",)


def block_minimum(plan, unit: str) -> int:
    """The analytic minimum of tp collectives per training step for block ``unit`` of ``plan``.

    Each rowwise output the block reduces is one forward all-reduce; each input its sharded
    matmuls read has its gradient all-reduced once in backward (reduce-scattered, when the input
    arrives cut and is gathered for them: a post-norm block reading the embedding), and so has a value every head
    shares (MLA's rotary key) broadcast over the cut heads; a partial sum reduced away from
    any weight (a norm's statistic over a cut width, experts' summed outputs) costs its forward
    all-reduce and one backward all-reduce of the gradient it spreads; an attention whose kv heads
    are fewer than tp gathers its k/v gradients once; replicated weights its cut heads read (q/k
    norm weights) have their partial gradients summed over tp in one all-reduce for the block.
    Breaks cost what this leaves out: gathers of activations and weights, and gradients entering
    tp at other ops.
    """
    outputs = inputs = sums = gathers = weights = 0
    for entry in plan.params.values():
        if entry.unit != unit:
            continue
        for c in entry.collectives:
            if c.runs and c.subject == "output" and str(c.direction) == "fwd" and "gather" not in c.kind:
                outputs += 1
            elif c.runs and c.subject == "input grad" and str(c.direction) == "bwd":
                inputs += 1
            elif c.runs and c.subject == "input" and c.kind == "all-gather+reduce-scatter":
                inputs += 1  # a cut input gathered for colwise linears: its reduce-scatter is the input grad's
            elif c.subject == "grad" and str(c.direction) == "bwd" and c.kind == "all-reduce":
                weights = 1  # replicated weights read by cut heads: their gradients summed in one bucket
    for i, c in enumerate(plan.activations):
        if not c.runs or plan.unit_of_activation(i) != unit:
            continue
        if str(c.direction) == "fwd" and c.subject.startswith("partial sum"):
            sums += 1
        elif str(c.direction) == "bwd" and c.kind == "all-reduce" and any(f"({m}" in c.cause.split("`")[0]
                                                                          for m in _MATMUL_NAMES + _BROADCASTS):
            inputs += 1
        elif c.kind == "take-shard":
            gathers += 1
    return outputs + inputs + 2 * sums + gathers + weights


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:300]


def _work(item):
    case, meshes, options = item
    return run_family(case, meshes, options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="", help="comma-separated kinds (decoder, encoder, ...); all by default")
    parser.add_argument("--families", default="", help="comma-separated families; all by default")
    parser.add_argument("--meshes", default=",".join(MESHES), help="comma-separated mesh names: " + ", ".join(MESHES))
    parser.add_argument("--options", action="store_true",
                        help=f"also bf16 and sequence parallelism on {', '.join(OPTION_MESHES)}")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "zoo.json"))
    args = parser.parse_args()

    import transformers

    from tests.zoo import skipped, zoo_cases

    cases = zoo_cases(args.kinds.split(",") if args.kinds else None)
    if args.families:
        wanted = set(args.families.split(","))
        cases = [c for c in cases if c.family in wanted]
    meshes = tuple(args.meshes.split(","))
    option_names = ("fp32", "bf16", "sequence_parallel") if args.options else ("fp32",)
    started = time.perf_counter()
    items = [(c, meshes, option_names) for c in cases]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(args.jobs, maxtasksperchild=8) as pool:
        results = []
        for result in pool.imap_unordered(_work, items):
            results.append(result)
            _print_family(result)
    results.sort(key=lambda r: (r["kind"], r["family"]))
    summary = _summary(results, meshes, option_names, skipped())
    print()
    print("\n".join(summary))
    print(f"({len(cases)} families in {time.perf_counter() - started:.0f} s, transformers {transformers.__version__}, "
          f"{datetime.date.today().isoformat()})")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": datetime.date.today().isoformat(), "transformers": transformers.__version__,
                   "summary": summary, "families": results}, f, indent=1)


def block_cells(row: dict) -> tuple[str, str]:
    """A row's tp collectives per block next to its minimum, and its broken blocks of all."""
    per_block = "/".join(map(str, row.get("per_block", []))) or "-"
    per_block += f" (min {'/'.join(map(str, row['minimum']))})" if row.get("minimum") else ""
    broken = f"{row['broken']}/{row['blocks']}" if "broken" in row else "-"
    return per_block, broken


def _print_family(result: dict) -> None:
    head = f"{result['kind']:<16}{result['family']:<28}"
    if "export_error" in result or "build_error" in result:
        print(f"{head}not captured: {result.get('export_error') or result.get('build_error')}", flush=True)
        return
    for row in result["rows"]:
        per_block, broken = block_cells(row)
        detail = row.get("detail") or row.get("first_break", "")
        print(f"{head}{row['mesh']:<6}{row['option']:<18}{row['status']:<14}{per_block:>16}{broken:>7}  {detail[:110]}",
              flush=True)


def _summary(results: list[dict], meshes, option_names, skips) -> list[str]:
    captured = [r for r in results if "rows" in r]
    not_captured = [r for r in results if "rows" not in r]
    rows = [row for r in captured for row in r["rows"] if row["option"] == "fp32"]
    status = collections.Counter(row["status"] for row in rows)
    everywhere = [r for r in captured if all(row["status"] == "proven" for row in r["rows"]
                                             if row["option"] == "fp32")]
    unbroken = [row for row in rows if row.get("broken") == 0]
    at_minimum = [row for row in rows if row.get("per_block") and max(row["per_block"]) <= DENSE_BLOCK_MINIMUM]
    lines = [
        f"zoo: {len(results)} families built, {len(captured)} captured by torch.export, "
        f"{len(not_captured)} not ({len(skips)} more not built by the generic configs)",
        f"proven on all {len(meshes)} meshes: {len(everywhere)} of {len(captured)} families "
        f"({_pct(len(everywhere), len(captured))})",
        f"family x mesh: {len(rows)} runs, proven {status['proven']} ({_pct(status['proven'], len(rows))}), "
        f"refused {status['refused']}, proof failed {status['PROOF FAILED']}, internal {status['INTERNAL']}",
        f"no tp break in any block: {len(unbroken)} of {len(rows)} runs ({_pct(len(unbroken), len(rows))}); "
        f"<= {DENSE_BLOCK_MINIMUM} tp collectives per block: {len(at_minimum)} ({_pct(len(at_minimum), len(rows))})",
    ]
    for option in option_names[1:]:
        opt_rows = [row for r in captured for row in r["rows"] if row["option"] == option]
        judged = [row for row in opt_rows if row["status"] != UNSHARDED_FAILS]
        counts = collections.Counter(row["status"] for row in judged)
        proven = counts["proven"]
        lines.append(f"{option}: {proven} of {len(judged)} runs proven ({_pct(proven, len(judged))}), "
                     f"refused {counts['refused']}, proof failed {counts['PROOF FAILED']}, internal "
                     f"{counts['INTERNAL']}; {len(opt_rows) - len(judged)} more runs whose model fails "
                     f"without autoshard under {option}")
        if option == "sequence_parallel":
            proven_rows = [row for row in judged if row["status"] == "proven"]
            whole = [row for row in proven_rows if row.get("sequence_whole")]
            uncut = [row for row in whole if not row.get("sequence_cut")]
            lines.append(f"  of those proven, {len(whole)} keep some outputs whole over tp (a sequence length tp "
                         f"does not divide), {len(uncut)} of them every output")
    lines += _by_kind_lines(captured)
    by_kind = collections.defaultdict(lambda: [0, 0])
    for r in captured:
        by_kind[r["kind"]][1] += 1
        by_kind[r["kind"]][0] += r in everywhere
    lines.append("by kind (proven everywhere / captured): "
                 + ", ".join(f"{k} {p}/{n}" for k, (p, n) in sorted(by_kind.items())))
    return lines


def _by_kind_lines(captured: list[dict]) -> list[str]:
    """fp32 runs with no break and at their analytic minimum, by kind: over every run, and over
    the runs whose tp divides the attention heads."""
    lines = []
    for title, keep in (("all runs", lambda row: True),
                        ("heads divide tp", lambda row: row.get("heads_divide") is True)):
        parts = []
        for kind in sorted({r["kind"] for r in captured}):
            rows = [row for r in captured if r["kind"] == kind for row in r["rows"]
                    if row["option"] == "fp32" and keep(row)]
            if not rows:
                continue
            unbroken = sum(row.get("broken") == 0 for row in rows)
            minimal = sum(row.get("above_minimum") == 0 for row in rows)
            parts.append(f"{kind} {len(rows)} runs: no break {_pct(unbroken, len(rows))}, "
                         f"at minimum {_pct(minimal, len(rows))}")
        lines.append(f"{title}: " + "; ".join(parts))
    return lines


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


if __name__ == "__main__":
    main()
