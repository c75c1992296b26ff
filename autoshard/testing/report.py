"""``autoshard.testing.check``: one model's plan, code and proof, in one process.

A team that parallelizes its own model wants CI to say when a model change
changes how it is sharded: the plan, what a step communicates, each block's
code, and whether the sharded step still computes what one device does. All of
it is made here without a process group or a GPU: the plan and the emitted
code are what :func:`autoshard.autoshard` would run on that mesh, and the
proof runs every tp rank of that code in this process
(:func:`autoshard.check`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

import torch.fx as fx
import torch.nn as nn

from autoshard.core.options import Options
from autoshard.driver import planning
from autoshard.plans.plan import Plan
from autoshard.proof.proof import Proof, ProofValues
from autoshard.testing.meshes import mesh_text
from autoshard.testing.snapshot import snapshot_text

ROOT = "<root>"


@dataclasses.dataclass(frozen=True)
class UnitCode:
    """The Python code one FSDP unit runs: the root graph (``<root>``) or one block's.
    ``structure`` is the graph with its node names left out: blocks of a stack have
    equal structures (their code differs only in names)."""

    unit: str
    code: str
    structure: str = dataclasses.field(default="", repr=False)

    @classmethod
    def of(cls, unit: str, gm: fx.GraphModule) -> UnitCode:
        number: dict[fx.Node, str] = {}
        lines = []
        for i, node in enumerate(gm.graph.nodes):
            number[node] = f"%{i}"
            args = fx.node.map_arg((node.args, node.kwargs), lambda n: number[n])
            target = "" if node.op == "placeholder" else getattr(node.target, "__name__", node.target)
            lines.append(f"{node.op} {target} {args}")
        return cls(unit, gm.code.strip(), "\n".join(lines))


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`check` found for one model on one mesh.

    ``plan`` is the plan :func:`autoshard.autoshard` would apply, ``code`` the code
    each FSDP unit runs (collectives included), ``proof`` the one-process proof of that
    code against the unsharded model (errors per output and gradient).
    """

    model: str  # the model's class name
    mesh: Mapping[str, int]
    options: Mapping[str, object]  # the options given that differ from autoshard's defaults
    plan: Plan
    code: tuple[UnitCode, ...]
    proof: Proof
    seconds: float
    reshard_after_forward: bool = True

    def predicted_comm(self) -> dict[str, dict[str, tuple[int, int]]]:
        """``{axis: {kind: (collectives, ring wire bytes per rank)}}`` of one training step."""
        return self.plan.predicted_comm(reshard_after_forward=self.reshard_after_forward)

    @property
    def values(self) -> ProofValues | None:
        """The tensors the proof ran (inputs, weights, every rank's outputs and gradients), when
        :func:`check` was asked to ``keep_values``."""
        return self.proof.values

    def assert_close(self, rtol: float | None = None) -> None:
        """Raise ``AssertionError`` unless the proof holds: every output and parameter gradient of
        the sharded code within what rounding allows (:mod:`autoshard.proof.rounding`), or, with
        ``rtol``, within ``rtol`` of the unsharded model's. The message names the worst errors and
        the first diverging node with its source line."""
        failing = self.proof.failures(rtol)
        if not failing:
            return
        worst = sorted(failing, key=lambda m: -(m.judged / max(m.allowed, 1e-300) if rtol is None else m.error))[:5]
        bound = f"rtol {rtol:.0e}" if rtol is not None else "what rounding allows"
        lines = [f"autoshard: {self.model} on {mesh_text(self.mesh)}: the sharded code differs from the "
                 f"unsharded model beyond {bound} in {len(failing)} of "
                 f"{len(self.proof.outputs) + len(self.proof.gradients)} outputs and gradients",
                 *(f"  {m.what}: {m.error:.2e}" if rtol is not None else f"  {m}" for m in worst)]
        if self.proof.first_divergence:
            lines.append(f"  first divergence: {self.proof.first_divergence}")
        elif rtol is not None:
            lines.append(f"  (pass rtol={rtol:.0e} to check() to locate the first diverging node)")
        raise AssertionError("\n".join(lines))

    def snapshot(self) -> str:
        """A stable text of the plan table, the predicted collectives and bytes, and each unit's
        code, for a snapshot test. Proof errors and timings are left out (they vary by machine);
        source line numbers and process-group names are normalized away."""
        return snapshot_text(self)

    def __str__(self) -> str:
        return (f"autoshard.testing report: {self.model} on {mesh_text(self.mesh)} ({self.seconds:.2f} s)\n"
                f"{self.plan}\n\n{self.proof}")


def check(
    model: nn.Module,
    mesh: Mapping[str, int],
    *,
    example_inputs: tuple,
    example_kwargs: dict | None = None,
    seed: int = 0,
    rtol: float | None = None,
    keep_values: bool = False,
    plan: Plan | Mapping | None = None,
    options: Options | None = None,
    **keywords,
) -> Report:
    """Plan ``model`` for ``mesh`` (axis sizes, e.g. ``{"dp": 2, "tp": 4}``), emit its code and
    prove it, in this process: no process group, no GPU.

    ``options`` and the keywords are :func:`autoshard.autoshard`'s (one
    :class:`~autoshard.core.options.Options`), so what a training script passes can be passed
    here. ``seed`` and ``rtol`` are the proof's (:func:`autoshard.check`); ``keep_values`` keeps
    the tensors the proof ran in ``report.values``, to replay them in a real run.

    Example::

        report = autoshard.testing.check(model, {"dp": 2, "tp": 4}, example_inputs=(tokens,))
        report.assert_close()
        print(report.snapshot())
    """
    start = time.perf_counter()
    if not isinstance(mesh, Mapping):
        raise ValueError(
            f"autoshard.testing.check: `mesh` is a dict of axis sizes such as {{'dp': 2, 'tp': 4}} (nothing runs "
            f"on a real mesh here), got {type(mesh).__name__}"
        )
    chosen = Options.of(options, caller="autoshard.testing.check", **keywords)
    axes = planning.mesh_axes(mesh)
    checked = planning.checked_on(model, axes, example_inputs, example_kwargs, chosen.plan_options(), plan=plan,
                                  seed=seed, rtol=rtol, keep_values=keep_values)
    parts = checked.emitted.parts
    code = (UnitCode.of(ROOT, parts.root), *(UnitCode.of(fqn, block) for fqn, block in parts.blocks.items()))
    changed = ({"plan": plan} if plan is not None else {}) | chosen.changed()
    return Report(type(model).__name__, dict(axes.to_dict()), changed, checked.proof.plan, code, checked.proof,
                  time.perf_counter() - start, chosen.sharding.reshard_after_forward)
