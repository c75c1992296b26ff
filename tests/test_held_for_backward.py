"""``held_for_backward``, the benchmark's and the training tests' memory figure, on one process.

It must count what autograd keeps alive and nothing else: not a buffer whose last
reference another thread drops (gloo's worker thread does that to every
collective's buffers), which a profiler counting the calling thread's allocations
takes for held.
"""

from __future__ import annotations

import threading

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tests.parity import alive_bytes, held_for_backward

BATCH, DIM = 32, 8
FLOAT_BYTES = 4


class SquaredReLU(nn.Module):
    """``relu(lin(x)) ** 2`` written as ``r * r``: autograd keeps ``r`` (and nothing else it creates)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.lin(x).relu()
        return r * r


class HandsOffABuffer(SquaredReLU):
    """Makes a buffer and has another thread drop its last reference, as gloo's worker
    thread drops a collective's buffers once the caller has its result."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        box, dropped = [x * 3], threading.Event()
        threading.Thread(target=_drop, args=(box, dropped)).start()
        dropped.wait()
        return super().forward(x)


class CheckpointedTwice(nn.Module):
    """Two checkpointed ``SquaredReLU``: the second keeps the first's output to recompute from."""

    def __init__(self):
        super().__init__()
        self.first, self.second = SquaredReLU(), SquaredReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.first, x, use_reentrant=False)
        return checkpoint(self.second, h, use_reentrant=False)


def _drop(box: list, dropped: threading.Event) -> None:
    box.pop()
    dropped.set()


ACTIVATION_BYTES = BATCH * DIM * FLOAT_BYTES


def test_held_is_what_autograd_keeps():
    assert held_for_backward(SquaredReLU(), torch.randn(BATCH, DIM)) == ACTIVATION_BYTES


def test_a_buffer_another_thread_frees_is_not_alive():
    module, x = HandsOffABuffer(), torch.randn(BATCH, DIM)
    assert alive_bytes(module, x, grad=False) == ACTIVATION_BYTES  # the output only
    assert held_for_backward(module, x) == ACTIVATION_BYTES


def test_checkpointing_holds_its_kept_inputs():
    assert held_for_backward(CheckpointedTwice(), torch.randn(BATCH, DIM)) == ACTIVATION_BYTES
