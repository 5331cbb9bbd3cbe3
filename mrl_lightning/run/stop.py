"""How a run stops: one message per error, printed by the rank that had it; the other ranks stop quietly.

A run of several workers used to end in a traceback from every rank, the last line often a
misleading one from a rank that merely lost its peer (gloo's "Connection closed by peer",
"rank 1 waited at the eval collective"). :func:`stop_run` decides, on the rank where an
exception ended the loop, what that rank prints and with which exit status it ends:

- bad input (a ``ConfigError`` or ``CheckpointError`` in the cause chain): ``mrl:
  configuration error`` and its message (field, value, fix), naming the rank, its
  policies and the phase when there are several ranks; status 2.
- a full disk (``OSError(ENOSPC)`` in the cause chain: a checkpoint, ``config.yaml``, a
  log): ``mrl: disk full`` on one line naming the file and the disk, what is left to
  resume from and what to do (:func:`disk_full_line`); status 2, as for bad input: the user
  fixes it outside the code, and nothing half-written is left (:func:`mrl_lightning.run.checkpoint.atomic_write`).
- Ctrl-C (``KeyboardInterrupt``): rank 0 prints the interrupted line
  (:func:`~mrl_lightning.loop.progress.interrupted_line`), the other ranks nothing; status 130.
- a failed or timed-out collective (:class:`~mrl_lightning.mwra.CollectiveError`: a peer
  failed, ended or hangs), or rank 0 interrupted by its launcher's watch because a worker
  ended: a worker (rank 1..N-1 of a launched run) prints nothing and ends with status 3
  (the peer that failed printed its own error, or rank 0 speaks for the run). Rank 0
  prints nothing when the worker that ended printed its own error (its status becomes the
  run's), the interrupted line when it was interrupted, else one line naming the rank and
  how it ended (status 1). Under torchrun or SLURM (no launcher here) every rank prints
  its own line.
- any other exception: ``mrl: worker error`` / ``mrl: error`` with the rank, phase,
  step, type and message on one line, the traceback written to a file; status 1.

``MRL_TRACEBACK=1`` prints the traceback too. Rank 0 decides from its launcher's watch
(:class:`~mrl_lightning.mwra.launcher.WorkerWatch`) and waits up to :data:`PEER_WAIT_S`
for a worker's status before speaking for it.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mrl_lightning.errors import ConfigError
from mrl_lightning.mwra.launcher import EXIT_PEER_STOPPED, exit_status_text
from mrl_lightning.mwra.workers import CollectiveError, WorkerError
from mrl_lightning.writable import disk_full_in, free_space_text

PEER_WAIT_S = 5.0
INTERRUPT_WAIT_S = 5.0
EXIT_CONFIG, EXIT_ERROR, EXIT_INTERRUPTED = 2, 1, 130


class RunStopped(Exception):
    """The run stopped and said so (or stayed quiet on purpose); ``mrl`` exits with :attr:`code`."""

    def __init__(self, code: int) -> None:
        super().__init__(f"the run stopped with exit status {code}")
        self.code = code


def config_error_in(exc: BaseException | None) -> ConfigError | None:
    """The ConfigError in ``exc``'s cause/context chain, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ConfigError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def write_traceback(exc: BaseException, folder: str | Path | None, rank: int = 0) -> Path | None:
    """``exc``'s traceback in ``<folder>/traceback_rank<r>.txt`` (a temporary folder when None); None if unwritable."""
    text = "".join(traceback.format_exception(exc))
    path = None
    try:
        path = Path(folder or tempfile.mkdtemp(prefix="mrl_error_")) / f"traceback_rank{rank}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError:
        if path is not None and path.is_file():
            path.unlink(missing_ok=True)  # no empty file left (a full disk)
        return None
    return path


def error_line(exc: BaseException, where: str = "", traceback_dir: str | Path | None = None, rank: int = 0,
               phase: tuple[str, int] | None = None) -> str:
    """The message printed for an error that is not bad input: what failed, where (``phase``: the loop's
    phase and step), and where its traceback is."""
    if isinstance(exc, WorkerError):
        text = f"mrl: worker error: {exc}"
    else:
        at = f" in phase {phase[0]!r} at step {phase[1]}" if phase else ""
        text = f"mrl: error{where}{at}: {type(exc).__name__}: {exc}"
    if os.environ.get("MRL_TRACEBACK", "").strip() in ("1", "true", "yes"):
        return "".join(traceback.format_exception(exc)) + text
    path = write_traceback(exc, traceback_dir, rank)
    return text + (f" (traceback: {path}; MRL_TRACEBACK=1 prints it)" if path else "")


def disk_full_line(error: OSError, ctx: "StopContext") -> str:
    """``mrl: disk full[ (rank r: policies)][ in phase 'p' at step k]:`` and what failed, what is left and what to
    do, one line (the rank when there are several).

    The message of :func:`~mrl_lightning.run.checkpoint.atomic_write` says it all; a bare ``ENOSPC``
    from elsewhere (a log, a traceback) gets the file when the error names it, the run folder's
    disk and the checkpoint to resume from (``ctx.last_checkpoint``) or "start the run again".
    """
    at = f" in phase {ctx.stopped_in[0]!r} at step {ctx.stopped_in[1]}" if ctx.stopped_in else ""
    who = ""
    if ctx.world_size > 1:
        policies = ", ".join(ctx.policies_of(ctx.rank))
        who = f" (rank {ctx.rank}" + (f": {policies}" if policies else "") + ")"
    text = error.strerror or ""
    if not text.startswith("No space left on device while writing"):
        file = f" while writing {error.filename}" if error.filename else ""
        disk = free_space_text(error.filename or ctx.traceback_dir or ".")
        last = ctx.last_checkpoint
        then = (f"resume with --ckpt_path {shlex.quote(str(last))} (intact)" if last is not None and last.exists()
                else "start the run again (no checkpoint of it was written)")
        text = (f"No space left on device{file}" + (f" ({disk})" if disk else "") + ". Free disk space (or move "
                f"trainer.default_root_dir to a disk with room), then {then}.")
    return f"mrl: disk full{who}{at}: {text}"


def config_error_text(error: ConfigError, where: str = "") -> str:
    """``mrl: configuration error[ (where)]:`` and the message."""
    return f"mrl: configuration error{where}:\n{error}"


@dataclass
class StopContext:
    """What :func:`stop_run` needs to know about the rank that is stopping.

    Attributes:
        rank: This process's global rank.
        world_size: Ranks in the run.
        launched_worker: This process is a worker started by an ``mrl`` launcher (it may stay quiet:
            the launcher's rank 0 speaks for the run).
        watch: Rank 0's watch of the workers it launched (None elsewhere, and under torchrun / SLURM).
        interrupted_line: The line Ctrl-C prints (:func:`~mrl_lightning.loop.progress.interrupted_line`).
        policies_of: Rank -> the policies it runs (for messages about another rank).
        traceback_dir: Where tracebacks of unexpected errors are written (the run folder).
        last_checkpoint: The run's ``last.ckpt`` (named when another rank's end stops the run).
        stopped_in: The loop's phase and step the exception left (:attr:`Workers.stopped_in
            <mrl_lightning.mwra.Workers.stopped_in>`), None before the loop.
        err: Prints a line to stderr.
        out: Prints a line to stdout (the interrupted line goes where the run's progress went).
    """

    rank: int = 0
    world_size: int = 1
    launched_worker: bool = False
    watch: object | None = None
    interrupted_line: Callable[[], str] = lambda: "\nInterrupted."
    policies_of: Callable[[int], list[str]] = lambda rank: []
    traceback_dir: str | Path | None = None
    last_checkpoint: Path | None = None
    stopped_in: tuple[str, int] | None = None
    err: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))
    out: Callable[[str], None] = field(default=lambda line: print(line, flush=True))


def stop_run(exc: BaseException, ctx: StopContext) -> int:
    """Print what this rank has to say about ``exc`` (table in the module docstring); return the exit status.

    Ctrl-C is ignored while it runs (a second Ctrl-C must not interrupt the message), the
    launcher's watch is told the main thread is stopping on its own, and the workers rank 0
    launched that are still running are ended once it has decided (as they would be when it
    exits: :mod:`mrl_lightning.lifeline`); after Ctrl-C, which reached them too, they get up to
    :data:`INTERRUPT_WAIT_S` to end on their own first (a recipe's half-built cache folder is
    removed on the way out).
    """
    watch = ctx.watch
    if watch is not None:
        watch.stopping = True
    handler = _ignore_sigint()
    code = EXIT_ERROR
    try:
        code = _decide(exc, ctx)
        return code
    finally:
        if watch is not None:
            if code == EXIT_INTERRUPTED:
                watch.wait_for_exits(INTERRUPT_WAIT_S)
            for proc in watch.procs:
                if proc.poll() is None:
                    proc.kill()
        if handler is not None:
            signal.signal(signal.SIGINT, handler)


def _ignore_sigint():
    try:
        return signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        return None


def _where(ctx: StopContext, exc: BaseException) -> str:
    """`` (rank r: policies, phase 'p')`` for an error raised in one rank's phase of a run of several, else ""."""
    if ctx.world_size <= 1 or not isinstance(exc, WorkerError):
        return ""
    policies = ", ".join(ctx.policies_of(ctx.rank))
    phase = getattr(exc, "phase", "") if isinstance(exc, WorkerError) else ""
    return f" (rank {ctx.rank}" + (f": {policies}" if policies else "") + (f", phase {phase!r}" if phase else "") + ")"


def _decide(exc: BaseException, ctx: StopContext) -> int:
    watch = ctx.watch
    if watch is not None:
        watch.poll()
    failed = watch.failed if watch is not None else None
    interrupted = isinstance(exc, KeyboardInterrupt)
    if interrupted and (failed is None or failed[1] == EXIT_INTERRUPTED):
        if ctx.rank == 0:
            ctx.out(ctx.interrupted_line())
        return EXIT_INTERRUPTED
    if not interrupted and not isinstance(exc, CollectiveError):
        error = config_error_in(exc)
        if error is not None:
            ctx.err(config_error_text(error, _where(ctx, exc)))
            return EXIT_CONFIG
        full = disk_full_in(exc)
        if full is not None:
            ctx.err(disk_full_line(full, ctx))
            return EXIT_CONFIG
        if failed is None:  # this rank's own error (not one a worker's end caused here)
            ctx.err(error_line(exc, _where(ctx, exc), ctx.traceback_dir, ctx.rank, ctx.stopped_in))
            return EXIT_ERROR
    # A collective failed, or a worker ended and the watch interrupted rank 0: another rank ended or hangs.
    if watch is not None:
        failed = failed or watch.wait_for_failure(PEER_WAIT_S)
        if failed is not None:
            return _for_worker(failed, exc, ctx)
    elif ctx.launched_worker:
        return EXIT_PEER_STOPPED  # rank 0 speaks for the run (or the peer that failed did)
    ctx.err(f"mrl: worker error: {exc}")
    return EXIT_ERROR


def _for_worker(failed: tuple[int, int], exc: BaseException, ctx: StopContext) -> int:
    """Rank 0 after worker ``failed = (rank, status)`` ended: quiet when it spoke, else one line for it."""
    rank, code = failed
    if code in (EXIT_CONFIG, EXIT_ERROR):
        return code  # it printed its own message
    if code == EXIT_INTERRUPTED:
        ctx.out(ctx.interrupted_line())
        return EXIT_INTERRUPTED
    who = f"rank {rank} ({', '.join(ctx.policies_of(rank))})"
    if code == EXIT_PEER_STOPPED and isinstance(exc, CollectiveError):
        ctx.err(f"mrl: worker error: {exc}")
    elif code == EXIT_PEER_STOPPED:
        ctx.err(f"mrl: worker error: {who} stopped: a collective with rank 0 failed or timed out "
                "(trainer.collective_timeout_s); rank 0 was busy elsewhere.")
    else:
        cause = (" (killed from outside, or by the kernel's out-of-memory killer: see `dmesg`)"
                 if code == -signal.SIGKILL else "")
        last = ctx.last_checkpoint
        resume = (f"resume with --ckpt_path {shlex.quote(str(last))} (intact)" if last is not None and last.exists()
                  else "no checkpoint was written yet")
        ctx.err(f"mrl: worker error: {who} ended with {exit_status_text(code)}{cause} and printed no error of its "
                f"own; the run stops: {resume}.")
    return EXIT_ERROR
