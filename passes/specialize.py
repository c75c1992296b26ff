"""Data-dependent branches, taken the way the example input takes them.

Model code branches on a tensor's value in Python (fair-esm:
``if not padding_mask.any(): padding_mask = None``). ``torch.export`` cannot trace such a
branch for every input and stops with ``GuardOnDataDependentSymNode``. ``torch.export.
draft_export`` traces the same forward with the example's real values alongside: it takes each
such branch as the example takes it and writes a runtime assert of that outcome into the graph
(``aten._assert_scalar``). That is what a user gets from eager PyTorch on the example, plus a
check that another input would go the same way.

autoshard captures that way only when plain export fails on such a branch, never on the meta
device (no values to take a branch by), and only when the data-dependent branches are all that
failed. Each assert's message is rewritten to name the user's line and what to do, since the one
export writes (``Runtime assertion failed for expression Ne(u0, 1)``) names only a symbol. The
proof of such a graph runs the example's own inputs when fresh ones take another branch (see
:func:`autoshard.proof.proof.prove`). Under data parallelism each rank tests its own batch shard, as
the user's model does under FSDP.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import types

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from autoshard.core.errors import source_line

_ASSERT = torch.ops.aten._assert_scalar.default


def guards_on_data(err: BaseException) -> bool:
    """Whether ``err`` (or what it wraps) is export stopping at a branch on a tensor's value."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, GuardOnDataDependentSymNode):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


@contextlib.contextmanager
def unreported_data_guards():
    """Around plain export: a stop at a branch on a tensor's value is handled here (or reported as
    an error naming the line), so what export prints of it (a warning and the partial graph on
    stderr) is dropped when the caller marks the stop ``handled``; anything else printed stays."""
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    drop = _DropMessage("Unable to find user code corresponding to")
    printed = io.StringIO()
    stop = types.SimpleNamespace(handled=False)
    logger.addFilter(drop)
    try:
        with contextlib.redirect_stderr(printed):
            yield stop
    finally:
        logger.removeFilter(drop)
        if not stop.handled:
            sys.stderr.write(printed.getvalue())


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def export_specialized(module: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes):
    """``module`` exported with its data-dependent branches taken as the example takes them, or
    ``None`` when anything else failed too (an op without a fake kernel: the caller's error stands)."""
    with _quiet("torch.export._draft_export", "torch.fx.experimental.symbolic_shapes"):
        exported = torch.export.draft_export(module, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    report = getattr(exported, "_report", None)
    failures = getattr(report, "failures", ())
    if any(getattr(f.failure_type, "name", "") != "DATA_DEPENDENT_ERROR" for f in failures):
        return None
    return exported


def name_branches(graph: fx.Graph, model_name: str) -> tuple[str, ...]:
    """Rewrite each runtime assert's message to say which line of the user's code branched and
    what to do; the lines, once each, in graph order."""
    lines = []
    for node in graph.nodes:
        if node.target is not _ASSERT:
            continue
        line = source_line(node)
        node.args = (node.args[0], (
            f"autoshard captured {model_name} for inputs that take the branch at {line} the way the example "
            f"input took it, and this input takes the other: capture with an example that takes this branch, "
            f"or write it without a Python `if` on a tensor's value (torch.where, or torch.cond)"))
        if line not in lines:
            lines.append(line)
    return tuple(lines)


@contextlib.contextmanager
def _quiet(*logger_names: str):
    """``draft_export`` logs the graph and a page-long warning for every specialization; the
    graph's asserts say it."""
    loggers = [logging.getLogger(name) for name in logger_names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
