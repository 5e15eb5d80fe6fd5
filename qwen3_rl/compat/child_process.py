"""Helper processes that do not outlive the process that forked them (megatron patch 0005).

megatron-core's checkpoint writer keeps a ``multiprocessing`` manager process per training process for its
write results (``megatron/core/dist_checkpointing/strategies/filesystem_async.py`` ``_get_write_results_queue``,
forked at the first checkpoint save and kept). A fork inherits every open file of the Ray worker, the worker's
connection to its raylet included. When the worker process is killed (OOM killer, a device fault), the orphaned
manager keeps that connection open: Ray never sees the worker exit, never fails the task with
``ActorDiedError``, and the run hangs with the surviving ranks waiting in a collective. A manager started by
:func:`manager_bound_to_parent` is killed by the kernel as soon as its parent dies (Linux
``prctl(PR_SET_PDEATHSIG, SIGKILL)``), closing the inherited connection with it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from multiprocessing.context import BaseContext
from multiprocessing.managers import SyncManager

__all__ = ["exit_with_parent", "manager_bound_to_parent"]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def exit_with_parent(parent_pid: int) -> None:
    """Run first in a forked child: ask the kernel for SIGKILL when the parent dies; exit at once if it already has.

    The death signal follows the *thread* that forked the child; megatron forks from the thread that runs the save
    (the Ray actor's main thread for verl's synchronous workers). No-op off Linux.

    Raises:
        OSError: ``prctl`` refused the request.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent_pid:  # the parent died before the request was in place
        os._exit(0)


def manager_bound_to_parent(ctx: BaseContext) -> SyncManager:
    """``ctx.Manager()`` whose server process dies with the calling process (started, ready to use)."""
    manager = SyncManager(ctx=ctx)
    manager.start(initializer=exit_with_parent, initargs=(os.getpid(),))
    return manager
