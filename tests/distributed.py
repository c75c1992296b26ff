"""Run many checks in one gloo group (4 ranks, or 8 for HSDP), report each as its own test.

Spawning ranks costs ~15 s (mostly imports), so each test file spawns once:
the ranks build their meshes, run every check of the file in order and
report per check ``None`` (passed) or the failing rank's traceback. A check
that raises on one rank while the others wait in a collective surfaces as
the gloo timeout of the others, which is set short.
"""

from __future__ import annotations

import dataclasses
import datetime
import shutil
import sys
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoshard.adapters.launch import spawn


@dataclasses.dataclass
class Context:
    """The meshes of one job: a 4-rank job has the first three, an 8-rank job the others."""

    rank: int
    world_size: int
    mesh_2d: DeviceMesh | None = None  # ("dp", "tp") = (2, 2): the 4-rank job, or ranks 0-3 of 8
    mesh_tp: DeviceMesh | None = None  # ("tp",) = (4,)
    mesh_dp: DeviceMesh | None = None  # ("dp",) = (4,)
    mesh_hsdp: DeviceMesh | None = None  # ("dp_replicate", "dp_shard", "tp") = (2, 2, 2)
    mesh_hsdp_dp: DeviceMesh | None = None  # ("dp_replicate", "dp_shard") = (2, 4)
    group_2d: dist.ProcessGroup | None = None  # 8 ranks: the group of mesh_2d's ranks (0-3)

    @property
    def in_2d(self) -> bool:
        """Whether this rank is one of ``mesh_2d``'s (every rank of a 4-rank job)."""
        return self.rank < 4


def _context(rank: int, world_size: int) -> Context:
    if world_size == 4:
        return Context(
            rank,
            world_size,
            mesh_2d=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
            mesh_tp=init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)),
            mesh_dp=init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)),
        )
    assert world_size == 8, world_size
    return Context(
        rank,
        world_size,
        # every rank builds the 4-rank mesh (its groups are created collectively); ranks 4-7 never use it
        mesh_2d=DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp")),
        mesh_hsdp=init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp")),
        mesh_hsdp_dp=init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_replicate", "dp_shard")),
        group_2d=dist.new_group([0, 1, 2, 3]),
    )


def shared_directory(ctx: Context) -> str:
    """One fresh directory every rank sees (rank 0 creates it)."""
    path = [tempfile.mkdtemp(prefix="autoshard-") if ctx.rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def remove_shared(ctx: Context, path: str) -> None:
    """Remove ``path`` once every rank is done with it."""
    dist.barrier()
    if ctx.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _run_all(rank: int, world_size: int, checks) -> dict[str, str | None]:
    ctx = _context(rank, world_size)
    outcomes = {}
    for check in checks:
        # shown only when the group fails: a rank that aborts (gloo) returns no traceback, this names its check
        print(f"rank {rank}: {check.__name__}", file=sys.stderr, flush=True)
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


def distributed_tests(checks, world_size: int = 4):
    """``(fixture, test)`` for a test file: one spawn for the file, one test per check.

    Bind both at module level: ``outcomes, test_checks = distributed_tests(CHECKS)``.
    Checks made by a factory are also set as attributes of their module, so the
    spawned ranks can unpickle them by name.
    """
    for check in checks:
        setattr(sys.modules[check.__module__], check.__name__, check)

    @pytest.fixture(scope="module")
    def outcomes():
        return run_checks(checks, world_size)

    @pytest.mark.parametrize("name", [c.__name__ for c in checks])
    def test_check(outcomes, name):
        outcomes.assert_passed(name)

    return outcomes, test_check
