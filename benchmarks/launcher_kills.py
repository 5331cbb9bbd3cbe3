"""SIGKILL the launcher of a 2-worker ``mrl fit`` at random moments: no worker may outlive it, every resume exact.

    python benchmarks/launcher_kills.py --kills 12 --max-steps 20 --seed 0 --out /tmp/launcher_kills

``mrl fit --trainer.devices 2`` runs rank 0 in the ``mrl`` process (the launcher) and rank 1
as a subprocess it starts. A launcher killed with SIGKILL runs no cleanup; before
``mrl_lightning.lifeline`` its worker waited at the rendezvous or its next collective for up
to 30 minutes, reparented to init. What this benchmark does:

1. Writes the tiny two-family config of the end-to-end tests (``tests/e2e/e2e_configs.py``)
   with a checkpoint every step, the SEE exchange log on (one absolute ``log_path``) and two
   workers (``--trainer.devices 2 --trainer.strategy ddp``, one policy each).
2. Runs it for one step (a warm-up that builds the tiny models into the cache, so that the
   reference's start-up is that of the runs it times), then once without interruption (the
   reference), and times it.
3. Runs it again and kills the launcher with SIGKILL ``--kills`` times, each at a moment drawn
   uniformly over the first 90% of the run's expected length (the reference's start-up, then
   its time per step for the steps left), so start-up (imports, parsing, spawning rank 1, the
   rendezvous, building the models) is hit about as often as training is; with
   ``--training-share p`` a share p of the kills is drawn over the training part only. Every run starts in
   a session of its own; after a kill the session's processes are listed every 50 ms until
   none is left: the time that takes is reported per kill, and a process still alive after
   ``--bound-s`` seconds is a leftover (killed, and the benchmark fails).
4. After each kill, resumes from the newest checkpoint that loads among all run folders (or
   starts over when there is none, removing the exchange log the killed run began: a new run
   appends to an absolute ``log_path``), again on two workers; when a run finishes, compares its
   final checkpoint with the reference's (counters, weights, optimizer states, the exchange,
   probe state, data position, every rank's RNG states: exactly) and the exchange log,
   record by record.

Rank 0 writes the phase it enters to a marker file (``startup``, ``launch`` when it starts
rank 1 and meets it at the rendezvous, then the loop's phases: ``build``, ``rollout``, ...),
so each kill reports where the launcher died. Exit status 0 when no process was left after
the bound, every resume succeeded and the final state and log equal the reference's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos import E2E, compare, newest_loadable, read_marker, write_config  # noqa: E402

TWO_WORKERS = ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.placement", "disjoint"]


def child(marker: str, argv: list[str]) -> int:
    """``mrl fit`` with rank 0 marking the phase it enters (``--child MARKER -- ARGS``; rank 1 runs it too)."""
    from contextlib import contextmanager

    from mrl_lightning.lifeline import is_launched_worker

    if is_launched_worker():  # rank 1: no marks
        from mrl_lightning.cli import main

        return main(argv)
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def mark(text: str) -> None:
        os.pwrite(fd, text.encode().ljust(64), 0)

    mark("startup 0")
    from mrl_lightning.mwra import launcher, workers

    launch = launcher.WorkerLauncher.launch

    def marked_launch(self, function, *args, **kwargs):
        mark("launch 0")
        return launch(self, function, *args, **kwargs)

    phase = workers.Workers.phase

    @contextmanager
    def marked_phase(self, name, step=None):
        with phase(self, name, step):
            mark(f"{name} {self.step}")
            yield

    launcher.WorkerLauncher.launch = marked_launch
    workers.Workers.phase = marked_phase
    from mrl_lightning.cli import main

    return main(argv)


def session_pids(sid: int) -> list[int]:
    """Processes of session ``sid`` (the killed launcher's workers, if any are left)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: the session; zombies are gone already
            out.append(int(entry.name))
    return out


def start(config: Path, marker: Path, version: str, ckpt: Path | None, log: Path,
          extra: list[str] = ()) -> subprocess.Popen:
    argv = ["fit", "--config", str(config), "--trainer.version", version, *TWO_WORKERS, *extra]
    if ckpt is not None:
        argv += ["--ckpt_path", str(ckpt)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(E2E), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    with log.open("a") as fh:
        fh.write(f"\n===== {version}: {' '.join(argv)}\n")
    return subprocess.Popen([sys.executable, __file__, "--child", str(marker), "--", *argv], env=env,
                            stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True)


def run(out: Path, kills: int, max_steps: int, seed: int, bound_s: float, training_share: float = 0.0) -> dict:
    from mrl_lightning.run.checkpoint import load_checkpoint
    from mrl_lightning.exchange import read_log, record_key

    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    straight_log = out / "straight.jsonl"
    straight_cfg = write_config(out, out / "runs", max_steps, straight_log)
    chains = 0

    def new_chain() -> tuple[Path, Path, Path]:
        # a run of kills and resumes from step 0; a new one (own folder, log and config) when the last one ended
        # before `kills` kills (it finished between two kills, or a kill came after its last checkpoint)
        nonlocal chains
        chains += 1
        log = out / f"chaos{chains}.jsonl"
        return out / f"runs_chaos{chains}", log, write_config(out, out / f"runs_chaos{chains}", max_steps, log)

    root, chaos_log, chaos_cfg = new_chain()
    console = out / "console.log"

    # a warm-up fills the model cache, so the reference's start-up (which times the kills) is a resume's
    if start(straight_cfg, out / "marker_warmup", "warmup", None, console, ["--trainer.max_steps", "1"]).wait():
        raise SystemExit(f"the warm-up run failed; see {console}")
    straight_log.unlink(missing_ok=True)
    t0, startup_s = time.monotonic(), None
    proc = start(straight_cfg, out / "marker_straight", "straight", None, console)
    while proc.poll() is None:
        if startup_s is None and read_marker(out / "marker_straight")[0] == "rollout":
            startup_s = time.monotonic() - t0
        time.sleep(0.01)
    if proc.returncode != 0:
        raise SystemExit(f"the uninterrupted run failed (exit {proc.returncode}); see {console}")
    straight_s = time.monotonic() - t0
    startup_s = startup_s or straight_s / 2
    reference = load_checkpoint(out / "runs" / "straight" / "checkpoints" / "last.ckpt")
    print(f"uninterrupted 2-worker run: {max_steps} steps in {straight_s:.1f} s ({startup_s:.1f} s to the first "
          "rollout)")

    events, attempt, ckpt, resume_step, final, finished = [], 0, None, 0, None, []
    while True:
        marker = out / f"marker_{attempt}"
        marker.write_bytes(b"")
        if ckpt is None and chaos_log.exists():  # starting over: a new run appends to an absolute log_path
            chaos_log.unlink()
        proc = start(chaos_cfg, marker, f"v{attempt}", ckpt, console)
        if len(events) >= kills:
            if proc.wait() != 0:
                raise SystemExit(f"the final run failed (exit {proc.returncode}); see {console}")
            final = root / f"v{attempt}" / "checkpoints" / "last.ckpt"
            break
        # a moment in this run's expected length (start-up, then the steps it has left), its last tenth spared
        expected = startup_s + (straight_s - startup_s) * (max_steps - max(resume_step, 0)) / max_steps
        train_s = 0.9 * expected - startup_s
        if train_s > 1.0 and rng.random() < training_share:  # aimed at training (rollout, update, checkpoint, ...)
            at = rng.uniform(startup_s, startup_s + train_s)
        else:
            at = rng.uniform(0.5, 0.9 * expected)
        deadline = time.monotonic() + at
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        if proc.poll() is not None:  # finished (or failed) before the moment came
            if proc.returncode != 0:
                raise SystemExit(f"run v{attempt} failed on its own (exit {proc.returncode}); see {console}")
            final = root / f"v{attempt}" / "checkpoints" / "last.ckpt"
            print(f"run v{attempt} finished before its kill at {at:.1f} s")
            finished.append((final, chaos_log))
            attempt += 1
            root, chaos_log, chaos_cfg = new_chain()
            ckpt, resume_step = None, 0
            continue
        before = session_pids(proc.pid)
        hit, hit_step = read_marker(marker)
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        gone_s, left = None, []
        while time.monotonic() - killed_at < bound_s:
            left = session_pids(proc.pid)
            if not left:
                gone_s = time.monotonic() - killed_at
                break
            time.sleep(0.05)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        ckpt, resume_step, broken = newest_loadable(root)
        events.append({"kill": len(events) + 1, "at_s": round(at, 2), "phase_hit": hit, "step_hit": hit_step,
                       "processes_before": len(before), "all_gone_s": None if gone_s is None else round(gone_s, 2),
                       "leftovers": left, "resume_from_step": resume_step, "unloadable_checkpoints": broken})
        print(f"kill {len(events):2d} at {at:5.1f} s: launcher in {hit or '?':10s} step {hit_step:3d}, "
              f"{len(before)} process(es); all gone after "
              f"{'%.2f s' % gone_s if gone_s is not None else 'NO (leftovers %s)' % left}"
              f" -> {'resume from step %d' % resume_step if ckpt else 'start over'}")
        attempt += 1
        if ckpt is not None and resume_step >= max_steps:  # killed after its last checkpoint: nothing left to run
            finished.append((ckpt, chaos_log))
            if len(events) >= kills:
                final = ckpt
                break
            root, chaos_log, chaos_cfg = new_chain()
            ckpt, resume_step = None, 0
    ends = finished + [(final, chaos_log)]  # every chain that reached max_steps, the last one included
    diffs = [d for done, _ in ends for d in compare(reference, load_checkpoint(done))]
    straight_records = [record_key(r) for r in read_log(str(straight_log))]
    logs_equal = all([record_key(r) for r in read_log(str(log))] == straight_records for _, log in ends)
    chaos_records = [record_key(r) for r in read_log(str(chaos_log))]
    gone = [e["all_gone_s"] for e in events if e["all_gone_s"] is not None]
    summary = {
        "command": f"python benchmarks/launcher_kills.py --kills {kills} --max-steps {max_steps} --seed {seed}"
                   f" --training-share {training_share}",
        "bound_s": bound_s, "kills": len(events), "uninterrupted_s": round(straight_s, 1),
        "phases_hit": dict(Counter(e["phase_hit"] for e in events)),
        "kills_with_two_processes": sum(e["processes_before"] >= 2 for e in events),
        "leftovers": sum(len(e["leftovers"]) for e in events),
        "max_all_gone_s": max(gone, default=None),
        "final_state_equal": not diffs, "state_differences": diffs[:20],
        "exchange_log_equal": logs_equal, "chains": chains,
        "exchange_log_records": [len(straight_records), len(chaos_records)],
        "events": events,
    }
    (out / "launcher_kills.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=12, help="SIGKILLs of the launcher (>= 10 for the claim)")
    parser.add_argument("--max-steps", type=int, default=20, help="training steps of the tiny config")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument("--bound-s", type=float, default=60.0, help="seconds a worker may outlive its launcher")
    parser.add_argument("--training-share", type=float, default=0.0,
                        help="share of the kills aimed at training only (after the reference's start-up); the "
                             "others are drawn over the whole run")
    parser.add_argument("--out", type=Path, default=None, help="folder for runs and the summary (default: temp)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="mrl_launcher_kills_"))
    summary = run(out, args.kills, args.max_steps, args.seed, args.bound_s, args.training_share)
    print(json.dumps({k: v for k, v in summary.items() if k != "events"}, indent=2))
    ok = (summary["kills"] >= args.kills and summary["leftovers"] == 0 and summary["final_state_equal"]
          and summary["exchange_log_equal"])
    print(f"{'PASS' if ok else 'FAIL'}: {summary['kills']} launcher kills, {summary['leftovers']} process(es) left "
          f"after {args.bound_s:.0f} s (slowest exit {summary['max_all_gone_s']} s), final state "
          f"{'equal' if summary['final_state_equal'] else 'DIFFERENT'}, exchange log "
          f"{'equal' if summary['exchange_log_equal'] else 'DIFFERENT'}; results in {out / 'launcher_kills.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
