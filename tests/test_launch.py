"""The local launcher: results in rank order; a rank that raises or dies stops the others at once
and is reported with its traceback or exit code."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from autoshard.adapters.launch import RankFailed, spawn


def _sum_of_ranks(rank, world_size, offset):
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank + offset, total.item()


def _rank_one_raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank one cannot go on")
    dist.barrier()  # the others wait here for rank 1, which never comes
    time.sleep(600)


def _rank_two_dies(rank, world_size):
    if rank == 2:
        os._exit(3)
    time.sleep(600)


def test_results_come_back_in_rank_order():
    assert spawn(_sum_of_ranks, 3, (10,)) == [(10, 3.0), (11, 3.0), (12, 3.0)]


def test_a_rank_that_raises_is_reported_with_its_traceback_and_the_others_stop():
    start = time.monotonic()
    with pytest.raises(RankFailed) as err:
        spawn(_rank_one_raises, 3)
    assert time.monotonic() - start < 60  # not the barrier's or the sleep's timeout
    assert err.value.rank == 1
    assert "ValueError: rank one cannot go on" in str(err.value)
    assert "_rank_one_raises" in str(err.value)  # the rank's traceback


def test_a_rank_that_dies_is_reported_with_its_exit_code():
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 2 failed: exit code 3"):
        spawn(_rank_two_dies, 3)
    assert time.monotonic() - start < 60


def _environment(rank, world_size):
    return os.environ.get("AUTOSHARD_LAUNCH_PROBE"), os.environ["RANK"]


def test_ranks_see_the_callers_environment_at_each_call(monkeypatch):
    """Ranks fork from a server started at the first call, whose environment is that call's; each
    rank still sees the caller's environment at its own call, with the agent's RANK over it."""
    monkeypatch.setenv("AUTOSHARD_LAUNCH_PROBE", "first")
    assert spawn(_environment, 2) == [("first", "0"), ("first", "1")]
    monkeypatch.setenv("AUTOSHARD_LAUNCH_PROBE", "second")
    assert spawn(_environment, 2) == [("second", "0"), ("second", "1")]
    monkeypatch.delenv("AUTOSHARD_LAUNCH_PROBE")
    assert spawn(_environment, 2) == [(None, "0"), (None, "1")]


def test_a_store_port_taken_before_the_agent_binds_it_is_drawn_again(monkeypatch):
    """The rendezvous store is hosted by this process or not at all: a port another socket holds is
    never joined as a client (two jobs would share one store and wire their ranks together); a new
    port is drawn and the ranks run as usual."""
    import socket

    from autoshard.adapters import launch

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    drawn = [held.getsockname()[1]]
    real = launch.free_port

    def first_taken():
        port = drawn.pop() if drawn else real()
        return port

    monkeypatch.setattr(launch, "free_port", first_taken)
    try:
        assert spawn(_sum_of_ranks, 2, (0,)) == [(0, 1.0), (1, 1.0)]
    finally:
        held.close()
    assert not drawn
