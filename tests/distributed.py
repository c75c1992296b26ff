"""Run many checks in one 4-process gloo group, report each as its own test.

Spawning ranks costs ~15 s (mostly imports), so each test file spawns once:
the ranks build their meshes, run every check of the file in order and
report per check ``None`` (passed) or the failing rank's traceback. A check
that raises on one rank while the others wait in a collective surfaces as
the gloo timeout of the others, which is set short.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoshard.launch import spawn


@dataclasses.dataclass
class Context:
    rank: int
    world_size: int
    mesh_2d: DeviceMesh  # ("dp", "tp") = (2, 2)
    mesh_tp: DeviceMesh  # ("tp",) = (4,)
    mesh_dp: DeviceMesh  # ("dp",) = (4,)


def _run_all(rank: int, world_size: int, checks) -> dict[str, str | None]:
    ctx = Context(
        rank,
        world_size,
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
        init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)),
        init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)),
    )
    outcomes = {}
    for check in checks:
        torch.manual_seed(0)
        try:
            check(ctx)
            outcomes[check.__name__] = None
        except Exception:
            outcomes[check.__name__] = traceback.format_exc()
        dist.barrier()
    return outcomes


class Outcomes:
    def __init__(self, per_rank: list[dict[str, str | None]]):
        self.per_rank = per_rank

    def assert_passed(self, name: str) -> None:
        failures = [(r, o[name]) for r, o in enumerate(self.per_rank) if o.get(name, "not run") is not None]
        if failures:
            rank, text = failures[0]
            pytest.fail(f"{name} failed on rank(s) {[r for r, _ in failures]}; rank {rank}:\n{text}", pytrace=False)


def run_checks(checks, world_size: int = 4) -> Outcomes:
    return Outcomes(spawn(_run_all, world_size, (tuple(checks),), timeout=datetime.timedelta(seconds=120)))


def distributed_tests(checks):
    """``(fixture, test)`` for a test file: one spawn for the file, one test per check.

    Bind both at module level: ``outcomes, test_checks = distributed_tests(CHECKS)``.
    Checks made by a factory are also set as attributes of their module, so the
    spawned ranks can unpickle them by name.
    """
    for check in checks:
        setattr(sys.modules[check.__module__], check.__name__, check)

    @pytest.fixture(scope="module")
    def outcomes():
        return run_checks(checks)

    @pytest.mark.parametrize("name", [c.__name__ for c in checks])
    def test_check(outcomes, name):
        outcomes.assert_passed(name)

    return outcomes, test_check
