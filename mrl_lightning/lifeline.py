"""A worker's tie to the process that launched it: the launcher dies, the worker follows (docs/reliability.md).

``mrl fit --trainer.devices N`` runs rank 0 in the ``mrl`` process itself (the launcher)
and starts ranks 1..N-1 as its subprocesses (:mod:`mrl_lightning.mwra.launcher`). A
launcher killed with SIGKILL runs no code of its own, so nothing it could do would tell
its workers; left alone, a worker waits at the start-up rendezvous or at its next
collective for as long as its timeout (10 minutes at start-up, ``collective_timeout_s``
after), reparented to init. A worker therefore ties itself to its launcher as the first
thing it does (:func:`tie_to_launcher`, called by :func:`mrl_lightning.cli.main` before
anything heavy is imported):

1. Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (through ``ctypes``): the kernel kills the
   worker the moment its parent exits, whatever the worker is doing (a collective, a
   warm-start, a checkpoint gather: a worker never writes a checkpoint, rank 0 does).
2. The parent's pid is then compared with the launcher's (``MRL_LAUNCHER_PID``, which the
   launcher sets for the workers it starts): a launcher that died before step 1 has already
   left the worker to init, and the worker ends at once.
3. Everywhere: a daemon thread compares the parent's pid with the launcher's every
   :data:`WATCH_PERIOD_S` seconds and kills the worker when they differ (the only guard on
   systems without ``PR_SET_PDEATHSIG``; on Linux a second one).

So a worker outlives its launcher by at most :data:`WATCH_PERIOD_S` (Linux: by the time
the kernel takes to deliver a signal). Only the standard library is imported here.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

INTERRUPTED_AT_START = "\nInterrupted before training started; nothing was written."  # Ctrl-C before a run's start

LAUNCHER_PID_ENV = "MRL_LAUNCHER_PID"
"""Environment variable the launcher sets, for the workers it starts, to its own pid."""

WATCH_PERIOD_S = 1.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def launcher_pid() -> int | None:
    """The pid of the process that started this one as a worker, or None when this process is no such worker."""
    value = os.environ.get(LAUNCHER_PID_ENV, "")
    if not value.isdigit() or int(value) == os.getpid():
        return None
    return int(value)


def is_launched_worker() -> bool:
    """True in a worker process started by an ``mrl`` launcher (ranks 1..N-1 of a one-node run)."""
    return launcher_pid() is not None


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _set_parent_death_signal() -> bool:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux; False where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def tie_to_launcher() -> bool:
    """Make this worker die with its launcher (module docstring); a no-op in any other process.

    Returns:
        True when this process is a launched worker (and is now tied to its launcher).
    """
    parent = launcher_pid()
    if parent is None:
        return False
    _set_parent_death_signal()
    if os.getppid() != parent:  # the launcher died before the prctl took effect
        _die()

    def watch() -> None:
        while True:
            time.sleep(WATCH_PERIOD_S)
            if os.getppid() != parent:
                _die()

    threading.Thread(target=watch, name="mrl-launcher-watch", daemon=True).start()
    return True
