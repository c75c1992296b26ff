"""User-facing error helpers: name the graph node and the user's source line."""

from __future__ import annotations

import contextlib
import os
import re
import traceback

import torch.fx as fx

_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(__import__(pkg).__file__)) + os.sep for pkg in ("torch", "autoshard")
) + (os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "passes") + os.sep,)
# (the last: a source checkout's passes/, which an editable install maps to autoshard.passes)


def user_frame(frames) -> str:
    """``file.py:42 `code``` of the innermost frame outside torch and autoshard, or ``"?"``.

    ``frames`` are ``traceback.FrameSummary``-like (``filename``, ``lineno``,
    ``line``), outermost first: the last one outside the libraries is the line
    the user wrote.
    """
    user = [f for f in frames  # neither the libraries' files nor code they generate (``<eval_with_key>.5``)
            if not f.filename.startswith("<") and not os.path.abspath(f.filename).startswith(_LIBRARY_DIRS)]
    if not user:
        return "?"
    frame = user[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno} `{(frame.line or '').strip()}`"


def source_line(node: fx.Node | None) -> str:
    """The user's source line that produced ``node`` ("file.py:42 `code`"), or ``"?"``,
    read from the ``stack_trace`` export records for every node."""
    trace = (node.meta.get("stack_trace") or "") if node is not None else ""
    lines = trace.strip().splitlines()
    frames = []
    for i, line in enumerate(lines):
        line = line.strip()
        if line.startswith('File "') and ", line " in line:
            path = line.split('"')[1]
            lineno = line.split(", line ")[1].split(",")[0]
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            frames.append(traceback.FrameSummary(path, int(lineno), "", line=code))
    return user_frame(frames)


def describe(node: fx.Node) -> str:
    """``node 'linear_3' (aten.linear.default) at model.py:42 `self.wq(x)```."""
    if node.op == "output":
        return "the model's output"
    target = getattr(node.target, "__name__", str(node.target)) if node.op == "call_function" else node.target
    return f"node '{node.name}' ({target}) at {source_line(node)}"


class InternalError(RuntimeError):
    """An error inside an autoshard stage that the user's input did not cause by itself:
    a bug to report, named with the stage, the node and its source line."""


@contextlib.contextmanager
def in_stage(stage: str, graph: fx.Graph | None = None):
    """Re-raise an unexpected error (from FX, torch or autoshard itself) inside ``stage`` as
    an :class:`InternalError` naming the stage and, when the message names a node of ``graph``,
    that node and its source line. Errors meant for the user (``ValueError``,
    ``NotImplementedError``) pass through unchanged."""
    try:
        yield
    except (ValueError, NotImplementedError, InternalError, KeyboardInterrupt):
        raise
    except Exception as err:
        where = _named_node(str(err), graph)
        raise InternalError(
            f"autoshard: internal error in stage '{stage}'{f' at {describe(where)}' if where else ''}: "
            f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}. "
            f"This is a bug in autoshard: please report it with the model's code"
        ) from err


def _named_node(message: str, graph: fx.Graph | None) -> fx.Node | None:
    """The first node of ``graph`` whose name the message quotes (FX quotes names as 'name')."""
    if graph is None:
        return None
    quoted = set(re.findall(r"'([A-Za-z_][A-Za-z0-9_]*)'", message))
    return next((n for n in graph.nodes if n.name in quoted), None)
