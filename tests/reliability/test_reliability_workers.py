"""Two-worker runs that stop (docs/reliability.md, "Stopping"): slow, each a real ``mrl fit --trainer.devices 2``.

Rank 0 is the ``mrl`` process (the launcher), rank 1 a subprocess it starts. Each test
runs the command in a session of its own and checks what a user sees: the exit status, one
message from the rank that had the error (no traceback, no gloo noise after it), and that
no process of the session is left a few seconds after the command ended. Run them with
``pytest -m slow tests/reliability/test_reliability_workers.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mrl_lightning.run.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
E2E = REPO / "tests" / "e2e"
TWO = ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.placement", "disjoint"]
LEFT_BOUND_S = 10.0


def _session(sid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":
                    out.append(int(entry.name))
    return out


class Run:
    """``mrl`` (or a wrapper script) in a new session; output in files (a leftover must not hold a pipe)."""

    def __init__(self, *args: str, script: list[str] | None = None) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(E2E), str(REPO)]), OMP_NUM_THREADS="1")
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        command = [sys.executable, *(script or ["-m", "mrl_lightning.cli"]), *args]
        # SIGINT as a terminal gives it: a test run started in the background (nohup, &) passes SIGINT on
        # ignored, and Python then installs no KeyboardInterrupt handler, so a Ctrl-C test could not fail or pass
        self.proc = subprocess.Popen(command, stdout=self.out, stderr=self.err, env=env, text=True,
                                     start_new_session=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.left: list[int] = []

    def finish(self, timeout: float = 300) -> Run:
        """Wait for the command, then up to LEFT_BOUND_S for its session to empty; kill what is left."""
        try:
            self.proc.wait(timeout=timeout)
        finally:
            deadline = time.monotonic() + LEFT_BOUND_S
            while (left := _session(self.proc.pid)) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.left = left
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.out.seek(0), self.err.seek(0)
        self.stdout, self.stderr = self.out.read(), self.err.read()
        return self

    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def _config(write_tiny_config, **trainer):
    return write_tiny_config(modify=lambda c: c["trainer"].update(**trainer))


def _one_message(run: Run, start: str) -> None:
    text = run.stdout + run.stderr
    assert "Traceback" not in text, run.stderr[-3000:]
    mine = [line for line in run.lines() if line.startswith("mrl:")]
    assert len(mine) == 1 and mine[0].startswith(start), run.stderr[-3000:]
    assert run.lines()[-1] == mine[0] or start.startswith("mrl: configuration error"), run.stderr[-3000:]
    assert "Connection closed by peer" not in text and "waited" not in mine[0]
    assert not run.left, f"processes left {LEFT_BOUND_S} s after the command ended: {run.left}"


def test_an_error_on_rank_one_is_printed_once_by_rank_one(write_tiny_config):
    config = _config(write_tiny_config, max_steps=5, version="fault", callbacks=[
        {"class_path": "mrl_lightning.callbacks.SharedExperienceExchange"},
        {"class_path": "e2e_faults.FaultOnRank", "init_args": {"rank": 1, "step": 3}}])
    run = Run("fit", "--config", str(config), *TWO).finish()
    assert run.proc.returncode == 1
    _one_message(run, "mrl: worker error: rank 1 (llama) failed in phase 'compose' at step 3: RuntimeError: "
                      "injected fault (traceback: ")
    assert load_checkpoint(config.parent / "runs" / "fault" / "checkpoints" / "last.ckpt")["counters"][
        "global_step"] == 2


def test_a_config_error_found_on_rank_one_after_the_build_exits_two(write_tiny_config):
    config = _config(write_tiny_config, max_steps=3, version="late", callbacks=[
        {"class_path": "e2e_faults.FaultOnRank", "init_args": {"rank": 1, "at_setup": True, "config": True}}])
    run = Run("fit", "--config", str(config), *TWO).finish()
    assert run.proc.returncode == 2
    _one_message(run, "mrl: configuration error (rank 1: llama, phase 'build'):")
    assert run.lines()[-1] == "injected: FaultOnRank.config=true on this rank; set it to false."


@pytest.mark.parametrize("phase, step, delay", [("build", 0, 3.0), ("rollout", 2, 0), ("update", 2, 0),
                                                 ("checkpoint", 2, 0), ("eval", 0, 0)])
def test_ctrl_c_in_any_phase_prints_one_hint_and_leaves_no_process(write_tiny_config, tmp_path, phase, step, delay):
    def modify(cfg):
        cfg["trainer"].update(max_steps=4, version=phase)
        if phase == "build":  # a warm-start long enough to be interrupted in
            for policy, part in zip(cfg["model"]["policies"], ("add", "sub")):
                policy["init_args"]["model"]["init_args"].update(warm_start_part=part, warm_start_steps=5000,
                                                                 warm_start_target=1.01)
                policy["init_args"].pop("strong_parts")

    config = write_tiny_config(modify=modify)
    run = Run(str(phase), str(step), str(delay), "--", "fit", "--config", str(config), *TWO,
              script=[str(E2E / "e2e_interrupt.py")]).finish()
    assert run.proc.returncode == 130, run.stderr[-3000:]
    assert "Traceback" not in run.stdout + run.stderr, run.stderr[-3000:]
    hints = [line for line in run.stdout.splitlines() if line.startswith("Interrupted")]
    assert len(hints) == 1, run.stdout[-3000:]
    expected = {"build": "Interrupted while the models were built", "eval": "Interrupted during the evaluation",
                "checkpoint": "Interrupted while the checkpoint of step 2 was written"}.get(
        phase, f"Interrupted during step {step} ({phase})")
    assert hints[0].startswith(expected), hints[0]
    assert not [line for line in run.lines() if line.startswith("mrl:")], run.stderr[-3000:]
    assert not run.left, f"processes left {LEFT_BOUND_S} s after Ctrl-C: {run.left}"
    last = config.parent / "runs" / phase / "checkpoints" / "last.ckpt"
    if phase in ("rollout", "update", "checkpoint"):
        assert load_checkpoint(last)["counters"]["global_step"] == 1  # the last good checkpoint is intact
    cache = config.parent / "cache" / "models"
    assert not list(cache.glob(".building-*")), "an interrupted warm-start left a half-built cache folder"


def _wait_for(run: Run, text: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run.proc.poll() is None:
        run.out.seek(0), run.err.seek(0)
        if text in run.out.read() + run.err.read():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared")


@pytest.mark.parametrize("moment", ["Initializing distributed: GLOBAL_RANK: 1", "[eval] step 0"])
def test_sigkill_of_the_launcher_leaves_no_worker_behind(write_tiny_config, moment):
    config = _config(write_tiny_config, max_steps=50, version="killed")
    run = Run("fit", "--config", str(config), *TWO)
    _wait_for(run, moment)  # rank 1 exists from the first moment on: it printed that line itself
    assert len(_session(run.proc.pid)) == 2
    run.proc.send_signal(signal.SIGKILL)
    run.finish()
    assert run.proc.returncode == -signal.SIGKILL
    assert not run.left, f"a worker outlived its launcher by more than {LEFT_BOUND_S} s: {run.left}"


def test_a_worker_killed_from_outside_is_named_by_rank_zero(write_tiny_config):
    config = _config(write_tiny_config, max_steps=200, version="lost")
    run = Run("fit", "--config", str(config), *TWO)
    last = config.parent / "runs" / "lost" / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 240
    while not last.exists() and time.monotonic() < deadline and run.proc.poll() is None:
        time.sleep(0.05)
    (worker,) = [pid for pid in _session(run.proc.pid) if pid != run.proc.pid]
    os.kill(worker, signal.SIGKILL)
    start = time.monotonic()
    run.finish()
    assert time.monotonic() - start < 60
    assert run.proc.returncode == 1
    _one_message(run, "mrl: worker error: rank 1 (llama) ended with signal SIGKILL")
    assert f"resume with --ckpt_path {last} (intact)" in run.lines()[-1]
    load_checkpoint(last)
