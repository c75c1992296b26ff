"""Run a function on N local processes that form one gloo/NCCL process group.

Used by the demo, the benchmark and the distributed tests: on a machine
without a launcher, ``spawn(fn, world_size=4)`` stands in for ``torchrun``,
and uses torchrun's own machinery (``torch.distributed.launcher``'s elastic
agent) to start, watch and stop the ranks. Each rank calls
``fn(rank, world_size, *args)`` with the default process group initialized;
the return values come back to the caller, rank-ordered. When a rank raises
or dies, the agent stops the others at once and the caller gets
:class:`RankFailed` with that rank's traceback (or exit code).

Ranks start from a fork server that has imported torch and autoshard once
(``start_method="forkserver"``), not from fresh interpreters: a fresh rank
spends ~5 s importing, four of them on two cores ~7 s, which every later
:func:`spawn` of a process (the test suite runs ~17) then saves. The server is
single-threaded and has run no op, so forking it is safe; each rank gets the
caller's environment as it is at this call (the server's is from its start).
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import socket
import time
import traceback
import uuid

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


class RankFailed(RuntimeError):
    """A rank of a :func:`spawn` raised (its traceback is the message) or died (its exit code)."""

    def __init__(self, rank: int, detail: str):
        super().__init__(f"rank {rank} failed: {detail}")
        self.rank = rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Tries at hosting the rendezvous store: the port :func:`free_port` found may be taken again before the
# agent binds it (another job on the machine), and then a new port is drawn
_STORE_TRIES = 5


def spawn(
    fn,
    world_size: int = 4,
    args: tuple = (),
    backend: str = "gloo",
    threads_per_rank: int = 1,
    timeout: datetime.timedelta | None = None,
    start_method: str = "forkserver",
) -> list:
    if start_method == "forkserver":
        # takes effect when this process first starts its server; a no-op afterwards
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(_PRELOAD))
    quiet = logging.getLogger("torch.distributed.elastic")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the agent's INFO lines on every start
    try:
        caller_env = dict(os.environ) if start_method == "forkserver" else None
        results = _launch(world_size, start_method, fn, args, backend, threads_per_rank, timeout, caller_env)
    except ChildFailedError as err:
        # the rank that failed on its own, not one whose collective broke because a peer left
        rank, failure = min(err.failures.items(), key=lambda kv: (_IN_COLLECTIVE in _failure_text(kv[1]), kv[0]))
        raise RankFailed(rank, _failure_text(failure)) from None
    finally:
        quiet.setLevel(level)
    return [results[rank] for rank in range(world_size)]


def _launch(world_size: int, start_method: str, *rank_args):
    """The ranks started by torch's elastic agent around a rendezvous store this process hosts.

    The store is hosted here or the launch fails (``is_host``): left to guess, the agent that cannot
    bind the port joins whatever store holds it as a client, and two jobs on one machine whose ports
    collide would then share one store's keys and wire their ranks to each other. A port taken between
    :func:`free_port` and the bind is drawn again, before any rank has started."""
    for attempt in range(_STORE_TRIES):
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=world_size,
            run_id=f"autoshard-{uuid.uuid4().hex[:8]}",
            rdzv_backend="c10d",
            rdzv_endpoint=f"127.0.0.1:{free_port()}",
            rdzv_configs={"is_host": True},
            max_restarts=0,
            monitor_interval=0.1,
            start_method=start_method,
        )
        try:
            return elastic_launch(config, _rank_main)(*rank_args)
        except RendezvousConnectionError:
            if attempt == _STORE_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _failure_text(failure) -> str:
    """The rank's traceback when it raised (recorded by ``@record``), else its exit code."""
    message = failure.message
    if isinstance(message, dict):
        extra = message.get("extraInfo", {})
        return extra.get("py_callstack") or message.get("message") or str(message)
    return f"exit code {failure.exitcode}"  # it died without raising (killed, os._exit): no traceback


class PeerFailed(RuntimeError):
    """This rank's collective failed, most likely because another rank failed first."""


_IN_COLLECTIVE = PeerFailed.__name__
_PEER_GRACE_SECONDS = 1.0  # ten of the agent's polls
_PRELOAD = ("torch", "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.pipelining",
            "autoshard", __name__)
# In a rank forked from the server: the server's environment (from when it started), which the
# agent's variables (RANK, MASTER_PORT, ...) were then written over.
_ENVIRONMENT_AT_IMPORT = dict(os.environ)


def _take_caller_environment(caller_env: dict[str, str]) -> None:
    """Make this rank's environment the caller's at :func:`spawn` time plus the agent's variables,
    as a spawned interpreter's would be (the fork server's environment may be older)."""
    agent = {k: v for k, v in os.environ.items() if _ENVIRONMENT_AT_IMPORT.get(k) != v}
    if "TORCHELASTIC_RUN_ID" not in agent:  # a server started elsewhere: this module came in after the agent
        for key, value in caller_env.items():
            os.environ.setdefault(key, value)
        return
    os.environ.clear()
    os.environ.update(caller_env)
    os.environ.update(agent)
_DISTRIBUTED_DIR = os.path.dirname(dist.__file__) + os.sep


def _use_own_accelerator(backend: str) -> None:
    """Under an accelerator's backend (NCCL), make this rank's accelerator the current device
    (its ``LOCAL_RANK``), as torchrun users do: tensors made on "cuda" then land on the rank's
    own GPU, not every rank on GPU 0."""
    if not torch.accelerator.is_available():
        return
    accelerator = torch.accelerator.current_accelerator()
    if backend == dist.get_default_backend_for_device(accelerator):
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))


@record
def _rank_main(fn, args, backend, threads, timeout, caller_env):
    if caller_env is not None:
        _take_caller_environment(caller_env)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(threads)
    _use_own_accelerator(backend)
    dist.init_process_group(backend, timeout=timeout)
    try:
        result = fn(rank, world_size, *args)
    except Exception as err:
        # no destroy_process_group here: it can wait on peers, and the traceback must be out first
        frames = traceback.extract_tb(err.__traceback__)
        if frames and frames[-1].filename.startswith(_DISTRIBUTED_DIR):
            # the agent reports the first rank it finds dead: let the peer that raised be that one
            time.sleep(_PEER_GRACE_SECONDS)
            raise PeerFailed(f"{type(err).__name__} in a collective: {err}") from err
        raise
    dist.destroy_process_group()
    return result
