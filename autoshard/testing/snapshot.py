"""The snapshot text of a :class:`~autoshard.testing.report.Report`: stable across runs and machines.

A snapshot is reviewed as a diff in a pull request, so it holds what a
reviewer reads and nothing that changes when the sharding does not:

* the plan table (roles, stored shapes, placements, FSDP units, tp collectives
  per parameter and per unit, the notes that explain each decision);
* the predicted collectives of one training step per mesh axis and kind, with
  their ring wire bytes per rank;
* the code each FSDP unit runs; a block whose graph equals an earlier one's
  but for node names is written once ("same code as layers.0").

Left out or normalized: proof errors and timings (they vary with the machine
and the BLAS), source line numbers (a comment added above a layer would move
every note; the file and the source text stay), and process-group names.
"""

from __future__ import annotations

import re

import torch

from autoshard.testing.meshes import mesh_text

_LINE_NUMBER = re.compile(r"(\b[\w.-]+\.py):\d+\b")


def snapshot_text(report) -> str:
    """The snapshot of ``report`` (see the module docstring)."""
    header = [f"autoshard snapshot: {report.model} on {mesh_text(report.mesh)}"]
    if report.options:
        header.append("options: " + ", ".join(f"{k}={_option(v)}" for k, v in report.options.items()))
    sections = ["\n".join(header), _section("plan", str(report.plan)),
                _section("predicted collectives per training step", _comm_table(report.predicted_comm()))]
    seen: dict[str, str] = {}
    for unit in report.code:
        key = unit.structure or unit.code
        if key in seen:
            sections.append(f"== code: {unit.unit} ==\nsame code as {seen[key]} (names aside)")
            continue
        seen[key] = unit.unit
        sections.append(_section(f"code: {unit.unit}", unit.code))
    return normalize("\n\n".join(sections)) + "\n"


def normalize(text: str) -> str:
    """Drop source line numbers (``model.py:42`` becomes ``model.py``) and trailing spaces."""
    text = _LINE_NUMBER.sub(r"\1", text)
    return "\n".join(line.rstrip() for line in text.splitlines())


def _section(title: str, body: str) -> str:
    return f"== {title} ==\n{body.strip()}"


def _comm_table(comm: dict[str, dict[str, tuple[int, int]]]) -> str:
    rows = sorted((axis, kind, count, nbytes) for axis, kinds in comm.items()
                  for kind, (count, nbytes) in kinds.items() if count)  # sorted: a diff shows changes, not order
    if not rows:
        return "none"
    width = max(len("axis"), *(len(axis) for axis, *_ in rows))
    lines = [f"{'axis':<{width}}  {'kind':<14}  {'count':>5}  {'bytes per rank':>14}"]
    lines += [f"{axis:<{width}}  {kind:<14}  {count:>5}  {nbytes:>14,}" for axis, kind, count, nbytes in rows]
    return "\n".join(lines)


def _option(value) -> str:
    policy = getattr(value, "param_dtype", None), getattr(value, "reduce_dtype", None)
    if any(isinstance(d, torch.dtype) for d in policy):
        return f"MixedPrecisionPolicy(param_dtype={policy[0]}, reduce_dtype={policy[1]})"
    if type(value).__name__ == "Plan":
        return "a given plan"
    return repr(value)
