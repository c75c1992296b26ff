"""``python -m autoshard check``: plan, prove and snapshot a model from a shell.

    python -m autoshard check mypkg.model:build_model --mesh dp=2,tp=4 \\
        --input "randint(0, 32000, (1, 128))" --snapshot tests/autoshard_snapshots

``TARGET`` is ``module:attribute`` (or ``path/to/file.py:attribute``): a function
or class called with no arguments that returns the ``nn.Module``, or the module
itself. Each ``--input`` is one positional input, a Python expression over
torch's constructors (``randint``, ``randn``, ``rand``, ``zeros``, ``ones``,
``full``, ``arange``, ``tensor``, the dtypes, and ``torch``), evaluated after
``torch.manual_seed(--seed)``; ``--kwarg name=EXPR`` is a keyword input. Every
``--mesh`` is checked in turn (:func:`autoshard.testing.check`, one process).

It prints each plan and proof and the time taken. With ``--snapshot DIR`` each
mesh's snapshot is compared with ``DIR/<target>-<mesh>.txt``: written when
missing, a unified diff printed when it differs, rewritten with
``--snapshot-update``. Exit status: 0 when every proof holds and every snapshot
matches, 1 when a proof fails or a snapshot differs, 2 on a usage error (a
target that does not import, an input that does not evaluate, a mesh or model
autoshard refuses).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import os
import sys
import time

USAGE_ERROR = 2
MISMATCH = 1


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command != "check":
        parser.print_help()
        return USAGE_ERROR
    try:
        return _check(args)
    except _UsageError as err:
        print(f"autoshard check: error: {err}", file=sys.stderr)
        return USAGE_ERROR


class _UsageError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m autoshard", description="autoshard from the command line")
    commands = parser.add_subparsers(dest="command")
    check = commands.add_parser(
        "check", help="plan and prove a model on meshes in one process; compare snapshots",
        description="Plan, emit and prove a model's sharding in this process (no process group, no GPU).",
    )
    check.add_argument("target", help="module:attribute (or file.py:attribute) giving the model or a function "
                                      "returning it")
    check.add_argument("--mesh", action="append", required=True, metavar="dp=2,tp=4",
                       help="axis sizes; repeat to check several meshes")
    check.add_argument("--input", action="append", default=[], metavar="EXPR",
                       help='one positional input, e.g. "randint(0, 32000, (1, 128))"; repeat for more')
    check.add_argument("--kwarg", action="append", default=[], metavar="NAME=EXPR", help="one keyword input")
    check.add_argument("--sequence-parallel", action="store_true", help="autoshard's sequence_parallel")
    check.add_argument("--loss-parallel", action="store_true", help="autoshard's loss_parallel")
    check.add_argument("--bf16", action="store_true",
                       help="FSDP2 mixed precision: parameters and compute in bfloat16, reductions in float32")
    check.add_argument("--rtol", type=float, default=None, help="the proof's tolerance (default by dtype)")
    check.add_argument("--seed", type=int, default=0, help="seeds the inputs, weights and output gradients")
    check.add_argument("--snapshot", metavar="DIR", help="compare each mesh's snapshot with DIR/<target>-<mesh>.txt")
    check.add_argument("--snapshot-update", action="store_true", help="rewrite snapshots that differ")
    check.add_argument("--code", action="store_true", help="also print the whole snapshot (each unit's code)")
    return parser


def _check(args) -> int:
    start = time.perf_counter()
    meshes = [_mesh(m) for m in args.mesh]
    build = _target(args.target)
    import torch

    import autoshard.testing
    from autoshard.testing.meshes import mesh_id

    torch.manual_seed(args.seed)
    inputs = tuple(_evaluate(expr, "--input") for expr in args.input)
    kwargs = {}
    for item in args.kwarg:
        name, sep, expr = item.partition("=")
        if not sep or not name.isidentifier():
            raise _UsageError(f"--kwarg is written NAME=EXPR, got {item!r}")
        kwargs[name] = _evaluate(expr, f"--kwarg {name}")
    if not inputs and not kwargs:
        raise _UsageError("give the model's inputs with --input EXPR (and --kwarg NAME=EXPR)")
    model = _build(build, args.target)
    options = {"sequence_parallel": args.sequence_parallel, "loss_parallel": args.loss_parallel}
    if args.bf16:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    failed = 0
    for mesh in meshes:
        try:
            report = autoshard.testing.check(model, mesh, example_inputs=inputs, example_kwargs=kwargs or None,
                                             seed=args.seed, rtol=args.rtol, **options)
        except (ValueError, NotImplementedError) as err:
            raise _UsageError(f"{args.target} on {mesh_id(mesh)}: {err}") from None
        print(report.snapshot() if args.code else report.plan)
        print(report.proof)
        try:
            report.assert_close(args.rtol)
        except AssertionError as err:
            print(err)
            failed += 1
        if args.snapshot:
            failed += not _compare_snapshot(report.snapshot(), args.snapshot, args.target, mesh_id(mesh),
                                            args.snapshot_update)
        print(f"{args.target} on {mesh_id(mesh)}: checked in {report.seconds:.2f} s\n")
    verdict = "all proven" if not failed else f"{failed} failed"
    print(f"autoshard check: {len(meshes)} mesh(es), {verdict}, {time.perf_counter() - start:.2f} s in all")
    return MISMATCH if failed else 0


def _compare_snapshot(text: str, directory: str, target: str, mesh: str, update: bool) -> bool:
    name = target.replace(os.sep, ".").replace(":", "-")
    path = os.path.join(directory, f"{name}-{mesh}.txt")
    existed = os.path.exists(path)
    if existed:
        with open(path) as f:
            stored = f.read()
        if stored == text:
            print(f"snapshot {path}: unchanged")
            return True
        if not update:
            diff = difflib.unified_diff(stored.splitlines(True), text.splitlines(True), path, "now")
            print(f"snapshot {path} differs (rewrite it with --snapshot-update):\n{''.join(diff)}")
            return False
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(f"snapshot {path}: {'updated' if existed else 'written'}")
    return True


def _mesh(text: str) -> dict[str, int]:
    from autoshard.testing.meshes import parse_mesh

    try:
        return parse_mesh(text)
    except ValueError as err:
        raise _UsageError(str(err)) from None


def _target(target: str):
    module_name, sep, attribute = target.rpartition(":")
    if not sep or not module_name or not attribute:
        raise _UsageError(f"the target is written module:attribute (mypkg.model:build_model), got {target!r}")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
            if spec is None or not os.path.exists(module_name):
                raise ImportError(f"no file {module_name}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # as `python -m` does: modules in the working directory import
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise _UsageError(f"cannot import {module_name!r}: {err}") from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise _UsageError(f"{module_name!r} has no attribute {attribute!r}") from None


def _build(build, target: str):
    import torch.nn as nn

    if not isinstance(build, nn.Module) and not callable(build):
        raise _UsageError(f"{target} is a {type(build).__name__}, neither an nn.Module nor a function returning one")
    model = build if isinstance(build, nn.Module) else build()
    if not isinstance(model, nn.Module):
        raise _UsageError(f"{target} returned {type(model).__name__}, not an nn.Module")
    return model


def _evaluate(expr: str, what: str):
    import torch

    names = {name: getattr(torch, name) for name in
             ("randint", "randn", "rand", "zeros", "ones", "full", "arange", "tensor", "long", "int", "int32",
              "int64", "float", "float32", "float64", "bfloat16", "float16", "half", "bool")}
    try:
        return eval(expr, {"__builtins__": {}}, {"torch": torch, **names})
    except Exception as err:
        raise _UsageError(f"{what} {expr!r} does not evaluate: {type(err).__name__}: {err}") from None
