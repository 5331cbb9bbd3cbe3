"""How a run stops (docs/reliability.md, "Stopping"): one message per error, quiet peers, no worker left behind.

Fast tests of the parts: the lifeline that ties a worker to its launcher (real processes,
no torch), the launcher's watch of its workers (real processes), what each rank prints and
exits with (:func:`mrl_lightning.run.stop.stop_run`), and Ctrl-C in a one-process run.
The multi-process runs are in ``test_reliability_workers.py`` (slow).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mrl_lightning.run.checkpoint import CheckpointError
from mrl_lightning.cli import main
from mrl_lightning.errors import ConfigError
from mrl_lightning.lifeline import LAUNCHER_PID_ENV, tie_to_launcher
from mrl_lightning.mwra.launcher import EXIT_PEER_STOPPED, WorkerWatch
from mrl_lightning.mwra.workers import CollectiveError, WorkerError
from mrl_lightning.run.stop import StopContext, stop_run

REPO = Path(__file__).resolve().parents[2]
WORKER = textwrap.dedent("""
    import sys, time
    from mrl_lightning.lifeline import tie_to_launcher
    assert tie_to_launcher()
    print("tied", flush=True)
    time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_worker_dies_within_a_second_of_its_launcher_killed_with_sigkill(tmp_path):
    # The "launcher" starts a worker the way WorkerLauncher does (its pid in MRL_LAUNCHER_PID), prints the
    # worker's pid, and sleeps; SIGKILL gives it no chance to clean up.
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, subprocess, sys, time
        env = dict(os.environ, {LAUNCHER_PID_ENV}=str(os.getpid()), PYTHONPATH={str(REPO)!r})
        worker = subprocess.Popen([sys.executable, "-c", {WORKER!r}], env=env, stdout=subprocess.PIPE, text=True)
        assert worker.stdout.readline().strip() == "tied"
        print(worker.pid, flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    worker = int(launcher.stdout.readline())
    assert _alive(worker)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 1.0
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        assert not _alive(worker), "the worker outlived its launcher by more than 1 s"
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


def test_a_worker_whose_launcher_is_already_gone_ends_at_once():
    # MRL_LAUNCHER_PID names a process that is not this worker's parent: the launcher died before the
    # worker could tie itself to it (the worker was reparented), so it must not start at all.
    env = dict(os.environ, **{LAUNCHER_PID_ENV: "999999999"}, PYTHONPATH=str(REPO))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL and "tied" not in proc.stdout
    assert time.monotonic() - start < 30


def test_a_process_that_no_launcher_started_is_not_tied(monkeypatch):
    monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
    assert tie_to_launcher() is False
    monkeypatch.setenv(LAUNCHER_PID_ENV, str(os.getpid()))  # the launcher itself
    assert tie_to_launcher() is False


class _Proc:
    """A finished worker for the watch (``poll`` gives its status)."""

    def __init__(self, code):
        self.code, self.killed = code, False

    def poll(self):
        return self.code

    def kill(self):
        self.killed = True


def _context(watch=None, rank=0, launched=False, world=2, **kwargs):
    lines = {"err": [], "out": []}
    ctx = StopContext(rank=rank, world_size=world, launched_worker=launched, watch=watch,
                      interrupted_line=lambda: "Interrupted during step 3 (update); resume with --ckpt_path x.",
                      policies_of=lambda r: ["gpt2"] if r == 0 else ["llama"], err=lines["err"].append,
                      out=lines["out"].append, **kwargs)
    return ctx, lines


def _failed_watch(code):
    watch = WorkerWatch([_Proc(code)])
    watch.poll()
    return watch


def test_a_config_error_prints_its_message_once_with_status_two():
    ctx, lines = _context(world=1)
    assert stop_run(ConfigError("trainer.max_steps=0 must be >= 1."), ctx) == 2
    assert lines == {"err": ["mrl: configuration error:\ntrainer.max_steps=0 must be >= 1."], "out": []}


def test_a_config_error_in_one_ranks_phase_names_the_rank_and_phase():
    wrapped = WorkerError("rank 1 (llama) failed in phase 'build' at step 0: CheckpointError: ...", 1, "build", 0)
    wrapped.__cause__ = CheckpointError("policy 'llama': the checkpoint's weights do not fit the configured model")
    ctx, lines = _context(rank=1, launched=True)
    assert stop_run(wrapped, ctx) == 2
    assert lines["err"] == ["mrl: configuration error (rank 1: llama, phase 'build'):\npolicy 'llama': the "
                            "checkpoint's weights do not fit the configured model"]


def test_ctrl_c_prints_the_hint_on_rank_zero_only():
    ctx, lines = _context()
    assert stop_run(KeyboardInterrupt(), ctx) == 130
    assert lines == {"err": [], "out": ["Interrupted during step 3 (update); resume with --ckpt_path x."]}
    ctx, lines = _context(rank=1, launched=True)
    assert stop_run(KeyboardInterrupt(), ctx) == 130
    assert lines == {"err": [], "out": []}


def test_a_worker_that_loses_its_peer_at_a_collective_stays_quiet():
    ctx, lines = _context(rank=1, launched=True)
    lost = CollectiveError("rank 1 (llama) waited 0.1 s at the exchange collective ... Connection closed by peer", 1)
    assert stop_run(lost, ctx) == EXIT_PEER_STOPPED
    assert lines == {"err": [], "out": []}


@pytest.mark.parametrize("code", [1, 2])
def test_rank_zero_is_quiet_and_takes_the_status_of_a_worker_that_printed_its_own_error(code):
    watch = _failed_watch(code)
    for exc in (CollectiveError("rank 0 (gpt2) waited 0.1 s at the eval collective ...", 0),
                KeyboardInterrupt(),  # the watch interrupted the main thread
                RuntimeError("[gloo] Connection closed by peer")):  # a peer's end seen outside a collective
        ctx, lines = _context(watch=watch)
        assert stop_run(exc, ctx) == code
        assert lines == {"err": [], "out": []}


def test_rank_zero_names_a_worker_that_a_signal_ended(tmp_path):
    watch = _failed_watch(-signal.SIGKILL)
    last = tmp_path / "last.ckpt"
    last.write_bytes(b"x")
    ctx, lines = _context(watch=watch, last_checkpoint=last)
    assert stop_run(CollectiveError("rank 0 (gpt2) waited ...", 0), ctx) == 1
    assert len(lines["err"]) == 1 and lines["err"][0].startswith("mrl: worker error: rank 1 (llama) ended with "
                                                                 "signal SIGKILL")
    assert f"--ckpt_path {last}" in lines["err"][0]


def test_rank_zero_prints_the_hint_when_a_worker_was_interrupted():
    ctx, lines = _context(watch=_failed_watch(130))
    assert stop_run(KeyboardInterrupt(), ctx) == 130
    assert lines["out"] == ["Interrupted during step 3 (update); resume with --ckpt_path x."]


def test_rank_zero_speaks_for_a_collective_that_timed_out_while_every_worker_runs():
    class Running(_Proc):
        def poll(self):
            return None

    watch = WorkerWatch([Running(None)])
    ctx, lines = _context(watch=watch)
    start = time.monotonic()
    timeout = CollectiveError("rank 0 (gpt2) waited 5.0 s at the metrics collective in phase 'metrics', step 2", 0)
    assert stop_run(timeout, ctx) == 1
    assert time.monotonic() - start < 10  # waits for a worker's status a few seconds at most
    assert lines["err"] == [f"mrl: worker error: {timeout}"] and watch.procs[0].killed


def test_any_other_error_is_one_line_with_the_traceback_in_a_file(tmp_path):
    try:
        raise OSError(errno.EIO, "Input/output error")
    except OSError as exc:
        error = exc
    ctx, lines = _context(world=1, traceback_dir=tmp_path, stopped_in=("checkpoint", 2))
    assert stop_run(error, ctx) == 1
    (line,) = lines["err"]
    assert line.startswith("mrl: error in phase 'checkpoint' at step 2: OSError: [Errno 5] Input/output error")
    assert "\n" not in line and "Traceback" not in line
    assert "Traceback (most recent call last)" in (tmp_path / "traceback_rank0.txt").read_text()


@pytest.mark.parametrize("checkpoint", [True, False], ids=["after-a-checkpoint", "before-any"])
def test_a_full_disk_anywhere_is_one_line_naming_the_file_and_what_to_resume_with_status_two(tmp_path, checkpoint):
    last = tmp_path / "checkpoints" / "last.ckpt"
    if checkpoint:
        last.parent.mkdir()
        last.write_bytes(b"ckpt")
    log = tmp_path / "exchange.jsonl"
    try:  # a bare ENOSPC, as a log's write raises it, behind another error
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(log))
        except OSError:
            raise RuntimeError("the exchange log could not be appended")
    except RuntimeError as exc:
        error = exc
    ctx, lines = _context(world=1, traceback_dir=tmp_path, stopped_in=("exchange", 7), last_checkpoint=last)
    assert stop_run(error, ctx) == 2
    (line,) = lines["err"]
    then = (f"resume with --ckpt_path {last} (intact)" if checkpoint
            else "start the run again (no checkpoint of it was written)")
    assert line.startswith("mrl: disk full in phase 'exchange' at step 7: No space left on device while writing "
                           f"{log} ("), line
    assert line.endswith(f" bytes free). Free disk space (or move trainer.default_root_dir to a disk with room), then "
                         f"{then}."), line
    assert not list(tmp_path.glob("traceback_*"))  # the line says it all; no file is written on the full disk


def test_the_watch_interrupts_the_main_thread_when_a_worker_fails(monkeypatch):
    monkeypatch.setattr("mrl_lightning.mwra.launcher.GRACE_S", 120.0)  # never ends pytest, whatever happens
    # Python's own SIGINT handler, as in a terminal: a test run in a background job (nohup, &) inherits SIGINT
    # ignored, the case of the next test
    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(2)"])
    watch = WorkerWatch([proc])
    try:
        with pytest.raises(KeyboardInterrupt):
            watch.start()
            time.sleep(30)
    finally:
        watch.stopping = True  # as stop_run sets it: the watch would otherwise end this process
        signal.signal(signal.SIGINT, sigint)
    assert watch.failed == (1, 2)


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")
def test_the_watch_interrupts_the_main_thread_also_where_sigint_is_ignored(monkeypatch):
    from mrl_lightning.mwra.launcher import _interrupt_on_sigusr1

    monkeypatch.setattr("mrl_lightning.mwra.launcher.GRACE_S", 120.0)
    sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under nohup or in a background job
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"])
    watch = WorkerWatch([proc])
    previous = _interrupt_on_sigusr1(watch)
    try:
        assert watch.signal == signal.SIGUSR1
        with pytest.raises(KeyboardInterrupt):
            watch.start()
            time.sleep(30)
    finally:
        watch.stopping = True
        signal.signal(signal.SIGINT, sigint)
        signal.signal(signal.SIGUSR1, previous if previous is not None else signal.SIG_DFL)
    assert watch.failed == (1, 1)


def test_ctrl_c_in_a_one_process_run_prints_the_hint_once_without_a_traceback(write_tiny_config, monkeypatch, capsys):
    from mrl_lightning.update import policy_update as update

    real, calls = update.policy_update, []

    def interrupted(*args, **kwargs):  # Ctrl-C lands in the second step's update
        calls.append(1)
        if len(calls) == 3:  # two policies a step
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr("mrl_lightning.loop.policy_step.policy_update", interrupted)
    config = write_tiny_config(modify=lambda c: c["trainer"].update(max_steps=3, version="ctrl_c"))
    assert main(["fit", "--config", str(config)]) == 130
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    last = config.parent / "runs" / "ctrl_c" / "checkpoints" / "last.ckpt"
    assert captured.out.count("Interrupted") == 1
    assert f"Interrupted during step 2 (update); resume with --ckpt_path {last}" in captured.out
    assert last.exists()


class _FitCliImportedUnderCtrlC(type(sys)):
    """A stand-in ``mrl_lightning.commands.fit`` whose import Ctrl-C interrupts (as in the first seconds of ``mrl fit``,
    while torch and Lightning are imported)."""

    def __getattr__(self, name):
        if name != "MRLCLI":
            raise AttributeError(name)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)  # the handler runs by here
        except KeyboardInterrupt:  # Python's own: raised inside torch's import, it leaves torch half-initialized
            self.interrupted_inside = True
            raise
        return lambda args=None: pytest.fail("the run went on after Ctrl-C during the import")


@pytest.mark.parametrize("worker", [False, True], ids=["launcher", "launched-worker"])
def test_ctrl_c_while_torch_is_imported_prints_the_hint_once_without_a_traceback(monkeypatch, capsys, worker):
    stand_in = _FitCliImportedUnderCtrlC("mrl_lightning.commands.fit")
    monkeypatch.setitem(sys.modules, "mrl_lightning.commands.fit", stand_in)
    monkeypatch.setattr("mrl_lightning.cli.is_launched_worker", lambda: worker)
    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        assert main(["fit", "--config", "unused.yaml"]) == 130
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back after the import
    finally:
        signal.signal(signal.SIGINT, sigint)
    assert not getattr(stand_in, "interrupted_inside", False)
    captured = capsys.readouterr()
    assert captured.err == ""
    # the launcher speaks for the run; a worker it launched had the same Ctrl-C and stays quiet
    assert captured.out == ("" if worker else "\nInterrupted before training started; nothing was written.\n")


def test_a_worker_ended_by_ctrl_c_ends_a_blocked_launcher_with_the_hint():
    # the launcher's main thread blocked where no signal reaches it (the process group's set-up waiting for the
    # worker): here it ignores the watch's signal and sleeps
    script = textwrap.dedent("""
        import signal, subprocess, sys, time
        from mrl_lightning.mwra.launcher import WorkerWatch
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        watch = WorkerWatch([subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(130)"])])
        watch.start()
        time.sleep(60)
    """)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 130
    assert time.monotonic() - start < 30  # INTERRUPT_GRACE_S (3 s) after the worker ended, not the 60 s sleep
    assert proc.stdout == "\nInterrupted before training started; nothing was written.\n"
    assert proc.stderr == ""
