"""User-facing error helpers: name the graph node and the user's source line."""

from __future__ import annotations

import os

import torch.fx as fx

_TORCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__import__("torch").__file__)))


def source_line(node: fx.Node | None) -> str:
    """The user's source line that produced ``node`` ("file.py:42 `code`"), or ``"?"``.

    The stack trace export records runs from the model down into torch; the last
    frame outside the torch package is the line the user wrote.
    """
    trace = (node.meta.get("stack_trace") or "") if node is not None else ""
    frames = []
    lines = trace.strip().splitlines()
    for i, line in enumerate(lines):
        line = line.strip()
        if line.startswith('File "'):
            path = line.split('"')[1]
            lineno = line.split(", line ")[1].split(",")[0] if ", line " in line else "?"
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            frames.append((path, lineno, code))
    user = [f for f in frames if not os.path.abspath(f[0]).startswith(os.path.join(_TORCH_DIR, "torch"))]
    if not (user or frames):
        return "?"
    path, lineno, code = (user or frames)[-1]
    return f"{os.path.basename(path)}:{lineno} `{code}`"


def describe(node: fx.Node) -> str:
    """``node 'linear_3' (aten.linear.default) at model.py:42 `self.wq(x)```."""
    if node.op == "output":
        return "the model's output"
    target = getattr(node.target, "__name__", str(node.target)) if node.op == "call_function" else node.target
    return f"node '{node.name}' ({target}) at {source_line(node)}"
