"""Gloo's worker threads let go of their last work before the interpreter finalizes.

A gloo process group runs each collective on a worker thread (``pt_gloo_runloop``), which drops its
reference to the finished work, and so to the work's tensors, just after the caller's wait returns.
A tensor whose Python object died first is kept alive by its C++ side, and dropping it then
releases that Python object, which takes the GIL. When the script's last collective is also its
last line, the main thread may already be finalizing the interpreter: a thread that asks for the GIL
then is ended by ``pthread_exit``, whose forced unwind meets a ``noexcept`` frame of the worker,
and the process aborts (``terminate called without an active exception``, SIGABRT). torchrun then
reports the job failed after every step ran. A native backtrace of the aborting rank shows exactly
that: thread ``pt_gloo_runloop`` (Exiting) in ``__do_cancel`` -> ``_Unwind_ForcedUnwind`` ->
``std::terminate`` while the main thread is in ``Py_FinalizeEx``. Measured on 4-rank context-parallel
jobs launched by torchrun (cp4, dp2 x cp2): 2 runs of 38 aborted; 1 of 27 with
``destroy_process_group()`` at exit, which does not join the workers while a device mesh still holds
the group; 0 of 50 with this grace.

:func:`let_gloo_workers_finish` registers, once per process, an ``atexit`` handler that waits
:data:`GRACE_SECONDS` on a gloo default group. ``atexit`` runs while the interpreter is whole, so a
worker still dropping its last work does so with the GIL available. It is local (no collective, so
a rank whose peers are gone does not hang), costs a fraction of a second at exit, and does nothing
without a process group, or under another backend (the abort was measured under gloo only).
"""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist

# the worker's release is microseconds of work; the grace covers a thread not yet scheduled on a
# machine whose cores every rank keeps busy
GRACE_SECONDS = 0.2

_registered = False


def let_gloo_workers_finish() -> None:
    """Register the exit handler (see the module docstring); idempotent."""
    global _registered
    if _registered or not dist.is_initialized():
        return
    atexit.register(_grace_for_gloo_workers)
    _registered = True


def _grace_for_gloo_workers() -> None:
    if dist.is_initialized() and dist.get_backend() == "gloo":
        time.sleep(GRACE_SECONDS)
