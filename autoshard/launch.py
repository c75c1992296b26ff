"""Run a function on N local processes that form one gloo/NCCL process group.

Used by the demo, the benchmark and the distributed tests: on a machine
without a launcher, ``spawn(fn, world_size=4)`` stands in for ``torchrun``.
Each rank calls ``fn(rank, world_size, *args)`` with the default process
group initialized; the return values come back to the caller, rank-ordered.
An exception on any rank is re-raised in the caller with its traceback.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(
    fn,
    world_size: int = 4,
    args: tuple = (),
    backend: str = "gloo",
    threads_per_rank: int = 1,
    timeout: datetime.timedelta | None = None,
) -> list:
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _run,
            args=(world_size, port, backend, threads_per_rank, timeout, out_dir, fn, args),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"{rank}.pkl"), "rb") as f:
                ok, value = pickle.load(f)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results.append(value)
    return results


def _run(rank, world_size, port, backend, threads, timeout, out_dir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    try:
        result = (True, fn(rank, world_size, *args))
    except BaseException:  # reported to the caller with the rank's traceback
        result = (False, traceback.format_exc())
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
