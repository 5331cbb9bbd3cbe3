"""Launching the workers of one node and watching them (docs/reliability.md, "Stopping").

:class:`WorkerLauncher` is Lightning's subprocess launcher (rank 0 runs in the launching
``mrl`` process, ranks 1..N-1 are ``mrl`` started again as its subprocesses, with
``LOCAL_RANK`` set) with two changes:

- each worker is told the launcher's pid (``MRL_LAUNCHER_PID``), so it can tie itself to
  the launcher and die with it (:mod:`mrl_lightning.lifeline`): a launcher killed with
  SIGKILL leaves no worker behind;
- the launcher watches its workers with its own thread (:class:`WorkerWatch`) instead of
  Lightning's. Lightning's SIGKILLs every process, the launcher included, once a worker
  exits with a non-zero status: the command then ends with status -9 and without a word,
  whatever the worker said. Here a worker that stops on an error prints its own message and
  exits with its own status (2: bad input, 1: other errors, 130: interrupted, 3: stopped
  because a collective with a peer failed); the watch records it and interrupts the
  launcher's main thread (SIGUSR1 to it, raising ``KeyboardInterrupt``, so that ``nohup``
  or a background job, where SIGINT is ignored, are interrupted too), which stops quietly
  with that status (:func:`mrl_lightning.run.stop.stop_run`). A main thread that does not
  answer within :data:`GRACE_S` (blocked in C code) is ended by the watch itself. A worker
  that ended on Ctrl-C (status 130 or SIGINT) means the launcher had the same Ctrl-C: if
  its main thread is blocked (in the process group's set-up, waiting for that worker), the
  watch prints the run's interrupted line (:attr:`WorkerWatch.interrupted_line`) after
  :data:`INTERRUPT_GRACE_S` and ends it with status 130, as any other Ctrl-C.
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

from mrl_lightning.lifeline import INTERRUPTED_AT_START, LAUNCHER_PID_ENV

POLL_S = 0.25
GRACE_S = 10.0
INTERRUPT_GRACE_S = 3.0
INTERRUPTED_STATUSES = (130, -signal.SIGINT)
EXIT_PEER_STOPPED = 3
"""Status of a worker that stopped because a collective with another rank failed (it printed nothing)."""


def exit_status_text(code: int) -> str:
    """``"exit status 2"`` or, for a process a signal ended, ``"signal SIGKILL"``."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


class WorkerWatch(threading.Thread):
    """Polls the launcher's workers; the first one to end with a non-zero status interrupts the main thread.

    Attributes:
        exits: Rank -> exit status of every worker that has ended (negative: the signal that ended it).
        failed: ``(rank, status)`` of the first worker that ended with a non-zero status, or None.
        stopping: Set by the main thread once it is stopping on its own: the watch then interrupts nothing.
        interrupted_line: What the watch prints when it ends a main thread that Ctrl-C could not
            reach (the run sets it once it has started: :func:`mrl_lightning.loop.progress.interrupted_line`).
    """

    def __init__(self, procs: list, on_timeout: Callable[[int, int], None] | None = None) -> None:
        super().__init__(name="mrl-worker-watch", daemon=True)
        self.procs = procs
        self.exits: dict[int, int] = {}
        self.failed: tuple[int, int] | None = None
        self.stopping = False
        self.on_timeout = on_timeout
        self.signal = signal.SIGINT  # what interrupts the main thread (WorkerLauncher: SIGUSR1)
        self.interrupted_line: Callable[[], str] = lambda: INTERRUPTED_AT_START
        self._lock = threading.Lock()

    def poll(self) -> dict[int, int]:
        """Record the workers that have ended since the last poll; returns :attr:`exits`."""
        with self._lock:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and rank not in self.exits:
                    self.exits[rank] = code
                    if code != 0 and self.failed is None:
                        self.failed = (rank, code)
            return dict(self.exits)

    def run(self) -> None:
        while len(self.poll()) < len(self.procs):
            if self.failed is not None and not self.stopping:
                self._interrupt_main()
                return
            time.sleep(POLL_S)
        if self.failed is not None and not self.stopping:
            self._interrupt_main()

    def _interrupt_main(self) -> None:
        # A KeyboardInterrupt in the main thread, which reads `failed`. A real signal to that thread also
        # ends a blocking call it is in (a sleep, a socket wait); _thread.interrupt_main would not.
        if hasattr(signal, "pthread_kill"):
            signal.pthread_kill(threading.main_thread().ident, self.signal)
        else:
            _thread.interrupt_main()
        rank, code = self.failed
        interrupted = code in INTERRUPTED_STATUSES
        deadline = time.monotonic() + (INTERRUPT_GRACE_S if interrupted else GRACE_S)
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            if self.stopping:  # the main thread took it; it ends the process itself
                return
        try:  # a closed stdout / stderr (the reader of a pipe gone) must not keep the process alive
            if interrupted:
                print(self.interrupted_line(), flush=True)
            elif self.on_timeout is not None:
                self.on_timeout(rank, code)
        finally:
            os._exit(130 if interrupted else code if code in (1, 2, 130) else 1)

    def wait_for_exits(self, timeout_s: float) -> dict[int, int]:
        """Poll until every worker has ended or ``timeout_s`` passed; returns :attr:`exits`."""
        deadline = time.monotonic() + timeout_s
        while len(self.poll()) < len(self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.poll()

    def wait_for_failure(self, timeout_s: float) -> tuple[int, int] | None:
        """Poll until a worker has ended with a non-zero status, every worker ended, or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while self.failed is None and len(self.poll()) < len(self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.poll()
        return self.failed


def _interrupt_on_sigusr1(watch: WorkerWatch):
    """Let the watch interrupt the main thread with SIGUSR1 (a KeyboardInterrupt there), also when SIGINT is
    ignored (``nohup``, a background job); returns the handler it replaced, or None when it left SIGUSR1 alone
    (taken by someone else, or not the main thread)."""
    if not hasattr(signal, "SIGUSR1") or threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:
        return None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    watch.signal = signal.SIGUSR1
    return previous


def _timeout_line(rank: int, code: int) -> None:
    print(f"mrl: worker error: rank {rank} ended ({exit_status_text(code)}) and rank 0 did not stop within "
          f"{GRACE_S:.0f} s; it is stopped now.", file=sys.stderr, flush=True)


class WorkerLauncher(_SubprocessScriptLauncher):
    """Lightning's one-node subprocess launcher with workers tied to it and its own watch (module docstring).

    Attributes:
        watch: The :class:`WorkerWatch` of the workers this launcher started (None before
            :meth:`launch`, and in a process that started none: a worker, or a run whose
            cluster environment starts the processes, such as torchrun or SLURM).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.watch: WorkerWatch | None = None
        self._previous_handler = None

    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        """Start the workers (each told this process's pid), the watch, then call ``function``."""
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
            try:
                self._call_children_scripts()
            finally:
                os.environ.pop(LAUNCHER_PID_ENV, None)
            self.watch = WorkerWatch(self.procs, on_timeout=_timeout_line)
            self._previous_handler = _interrupt_on_sigusr1(self.watch)
            self.watch.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def join(self, timeout_s: float) -> dict[int, int]:
        """At the end of a run: wait up to ``timeout_s`` for the workers to exit, then kill those left.

        Returns:
            Rank -> exit status.
        """
        if self.watch is None:
            return {}
        self.watch.stopping = True
        exits = self.watch.wait_for_exits(timeout_s)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        if self._previous_handler is not None:
            signal.signal(signal.SIGUSR1, self._previous_handler)
        return exits
