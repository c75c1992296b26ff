"""Capture: an ``nn.Module`` and example inputs to one flat ATen graph.

We capture with ``torch.export.export(strict=False)`` and unlift it
(``ExportedProgram.module()``): parameters and buffers become ``get_attr``
nodes named by their original FQNs, ``nn.Linear`` stays ``aten.linear``, and
every node carries ``meta["val"]`` (shapes), ``nn_module_stack`` and a
``stack_trace``. ATen is the one IR every later pass reads; the torch.compile
backend feeds its dynamo graph through the same export.

The user's model is only read: the captured module refers to the model's own
parameter tensors, and no later pass writes to them.
"""

from __future__ import annotations

import dataclasses
import os
import traceback

import torch
import torch.fx as fx
import torch.nn as nn


@dataclasses.dataclass(frozen=True)
class CapturedGraph:
    """A flat ATen GraphModule and what later passes need to know of the model.

    ``block_fqns`` are the modules that become one FSDP unit each (see
    :func:`find_blocks`), in forward order.
    """

    gm: fx.GraphModule
    param_shapes: dict[str, tuple[int, ...]]
    block_fqns: tuple[str, ...]


class CaptureError(ValueError):
    """The model could not be captured as one graph."""


def capture(model: nn.Module, args: tuple, kwargs: dict | None = None) -> CapturedGraph:
    _refuse_tied_parameters(model)
    try:
        exported = torch.export.export(model, tuple(args), kwargs or {}, strict=False)
    except Exception as err:  # export raises many types; the user needs one
        raise CaptureError(
            f"autoshard: could not capture {type(model).__name__} with torch.export "
            f"(strict=False) at {_user_frame(err)}: {type(err).__name__}: {_first_lines(str(err))}"
        ) from err
    unlifted = exported.module()
    graph = unlifted.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
    graph.eliminate_dead_code()
    gm = fx.GraphModule(unlifted, graph, class_name=type(model).__name__)
    param_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return CapturedGraph(gm, param_shapes, find_blocks(model))


def find_blocks(model: nn.Module) -> tuple[str, ...]:
    """The repeated blocks of ``model``: FSDP units, one all-gather each.

    They are the children, holding parameters, of the outermost
    ``ModuleList``/``ModuleDict``/``Sequential`` containers (``layers.0``,
    ``model.layers.3``, ``h.11``...), which is where transformer and MLP-stack
    code keeps its layers. Everything else stays with the root unit.
    """
    blocks: list[str] = []
    containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            if isinstance(child, containers):
                blocks.extend(
                    f"{fqn}.{n}" for n, c in child.named_children() if any(True for _ in c.parameters())
                )
            else:
                visit(f"{fqn}.", child)

    if isinstance(model, containers):
        return tuple(n for n, c in model.named_children() if any(True for _ in c.parameters()))
    visit("", model)
    return tuple(blocks)


def _refuse_tied_parameters(model: nn.Module) -> None:
    """One tensor under two FQNs needs one layout valid for both uses: not supported yet."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for tied in names.values():
        if len(tied) > 1:
            raise NotImplementedError(
                f"autoshard: parameters {', '.join(repr(n) for n in tied)} are one tensor "
                f"(tied weights); tied weights are not supported"
            )


def _user_frame(err: BaseException) -> str:
    """``file.py:12 `code``` of the innermost traceback frame outside torch, or ``"?"``."""
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not os.path.abspath(f.filename).startswith(torch_dir)]
    frames = [f for f in frames if os.path.abspath(f.filename) != os.path.abspath(__file__)]
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno} `{(frame.line or '').strip()}`"


def _first_lines(text: str, n: int = 6) -> str:
    lines = text.strip().splitlines()
    return "\n".join(lines[:n]) + ("\n..." if len(lines) > n else "")
