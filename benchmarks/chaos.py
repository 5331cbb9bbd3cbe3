"""Chaos: SIGKILL ``mrl fit`` at random moments, resume each time, and compare with a run that never stopped.

    python benchmarks/chaos.py --kills 12 --max-steps 30 --seed 0 --out /tmp/chaos
    python benchmarks/chaos.py --default --kills 4 --max-steps 48 --seed 0 --out /tmp/chaos_default
    python benchmarks/chaos.py --default --max-lag 2 --kills 3 --max-steps 200 --checkpoint-every 10 --out /tmp/chaos_lag
    python benchmarks/chaos.py --default --async-rollouts --kills 3 --max-steps 60 --out /tmp/chaos_async

What it does:

1. Writes the tiny two-family config of the end-to-end tests (``tests/e2e/e2e_configs.py``:
   a GPT-2 / byte-level BPE policy and a Llama / SentencePiece policy, SGT on SEE) with a
   checkpoint every step, or with ``--default`` the embedded default itself
   (``configs/default.yaml``: its two worker processes, SGT with its moving bound, the shipped
   models) with a checkpoint every ``--checkpoint-every`` steps (2); either with the SEE
   exchange log on (one absolute ``log_path``, so every resume appends to the same file).
2. Runs it once without interruption (the reference).
3. Runs it again and kills the process with SIGKILL ``--kills`` times. Each kill aims at
   one moment, in turn: a rollout, an update, a checkpoint write, an exchange-log append.
   The kill steps are drawn at random up front (sorted, from step 2 to the step before the
   last, so every kill has steps left to land in); a kill lands a random fraction of the
   phase's typical length after the phase starts, and a log-append kill the moment the log
   file is seen to grow (during or just after the write). After each kill the newest
   checkpoint that loads (``load_checkpoint``) among every run folder so far is resumed
   with ``--ckpt_path`` (a resume writes a new ``version_<n>`` folder).
4. When a resumed run finishes, compares its final checkpoint with the reference's
   (counters, every policy's weights and optimizer state, the SEE exchange and the SGT
   state, the data position, the RNG states: all exactly) and the exchange log, record by
   record.

How phases are seen. The child process is ``mrl fit`` run through
``mrl_lightning.cli.main`` with two read-only hooks: the loop's phase names
(``Workers.phase``: rollout, exchange, compose, update, checkpoint, eval, ...) and the
exchange log's append are written to a small marker file as they start. The parent polls
it every millisecond to time its kill, and reads it after the kill to report the phase
the process was really in. Nothing in the training path changes.

Exit status 0 when every resume succeeded and the final state and log equal the
reference's; 1 otherwise. ``--out`` keeps the runs and a ``chaos.json`` summary.
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

REPO = Path(__file__).resolve().parents[1]
E2E = REPO / "tests" / "e2e"
TARGETS = ("rollout", "update", "checkpoint", "log-append")
# A kill lands this long (uniform) after its target phase starts (seconds; a phase of the
# tiny config lasts ~5-60 ms, a log append well under 1 ms, so that one is killed at once).
DELAY_S = {"rollout": (0.0, 0.02), "update": (0.0, 0.02), "checkpoint": (0.0, 0.01), "log-append": (0.0, 0.0)}
# (the log-append kill is sent the moment the log file is seen to grow: during or just after the write)


# --------------------------------------------------------------------------- the child
def child(marker: str, argv: list[str]) -> int:
    """Run ``mrl fit`` with the phase hooks (``python benchmarks/chaos.py --child MARKER -- ARGS``)."""
    from contextlib import contextmanager

    from mrl_lightning.exchange import log as see_log
    from mrl_lightning.mwra import workers

    if os.environ.get("LOCAL_RANK", "0") != "0":  # a worker the launcher started: only rank 0 reports its phase
        from mrl_lightning.cli import main

        return main(argv)
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def mark(text: str) -> None:
        data = text.encode().ljust(64)
        os.pwrite(fd, data, 0)

    phase = workers.Workers.phase

    @contextmanager
    def marked_phase(self, name, step=None):
        previous = self.phase_name
        with phase(self, name, step):
            mark(f"{name} {self.step}")
            yield
        mark(f"{previous} {self.step}")

    append = see_log.RecordLogWriter.append

    def marked_append(self, records, first_seq):
        mark(f"log-append {records[0].step if records else -1}")
        append(self, records, first_seq)
        mark(f"exchange {records[0].step if records else -1}")

    workers.Workers.phase = marked_phase
    see_log.RecordLogWriter.append = marked_append
    from mrl_lightning.cli import main

    return main(argv)


# --------------------------------------------------------------------------- the parent
def write_config(folder: Path, root: Path, max_steps: int, log_path: Path, compress: bool = True,
                 default: bool = False, checkpoint_every: int = 1, max_lag: int = 0,
                 async_rollouts: bool = False, steps_per_round: dict | None = None) -> Path:
    import yaml

    if default:  # the embedded default, its paths made absolute (the child runs from anywhere)
        cfg = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
        cfg["trainer"]["default_root_dir"] = str(root)
        for policy in cfg["model"]["policies"]:
            recipe = policy["init_args"]["model"]["init_args"]
            recipe["prebuilt"], recipe["cache_dir"] = str(REPO / recipe["prebuilt"]), str(folder / "cache")
        cfg["trainer"]["callbacks"][0]["init_args"]["log_path"] = str(log_path)
    else:
        sys.path.insert(0, str(E2E))
        from e2e_configs import tiny_config

        cfg = tiny_config(folder / "cache", root)
        cfg["trainer"]["callbacks"][0]["init_args"] = {"log_path": str(log_path)}
    cfg["trainer"].update(max_steps=max_steps, checkpoint_every_n_steps=checkpoint_every, keep_checkpoints=3,
                          eval_every_n_steps=10_000, log_every_n_steps=5, enable_progress_bar=False,
                          compress_checkpoints=compress, max_lag=max_lag, async_rollouts=async_rollouts,
                          steps_per_round=steps_per_round)
    path = folder / f"chaos_{log_path.stem}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def read_marker(path: Path) -> tuple[str, int]:
    try:
        text = path.read_bytes().decode(errors="replace").strip()
        name, step = text.rsplit(" ", 1)
        return name, int(step)
    except (OSError, ValueError):
        return "", -1


def start(config: Path, marker: Path, version: str, ckpt: Path | None, log: Path) -> subprocess.Popen:
    argv = ["fit", "--config", str(config), "--trainer.version", version]
    if ckpt is not None:
        argv += ["--ckpt_path", str(ckpt)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(E2E), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, __file__, "--child", str(marker), "--", *argv], env=env,
                            stdout=log.open("a"), stderr=subprocess.STDOUT)


def newest_loadable(root: Path) -> tuple[Path | None, int, int]:
    """The loadable checkpoint of the highest step under ``root`` (every run folder).

    Returns:
        ``(path or None, its step or -1, how many checkpoint files failed to load)``.
    """
    from mrl_lightning.run.checkpoint import CheckpointError, load_checkpoint

    best, best_step, broken = None, -1, 0
    for path in sorted(root.glob("*/checkpoints/*.ckpt")):
        try:
            step = int(load_checkpoint(path)["counters"]["global_step"])
        except CheckpointError:
            broken += 1
            continue
        if step > best_step:
            best, best_step = path, step
    return best, best_step, broken


def compare(a: dict, b: dict, where: str = "") -> list[str]:
    """Paths at which two checkpoint states differ (tensors compared exactly)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where} keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in compare(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in compare(x, y, f"{where}[{i}]")]
    same = a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)
    return [] if same else [where]


def run_chaos(out: Path, kills: int, max_steps: int, seed: int, step_timeout_s: float, compress: bool = True,
              default: bool = False, checkpoint_every: int = 1, max_lag: int = 0,
              async_rollouts: bool = False, steps_per_round: dict | None = None) -> dict:
    from mrl_lightning.run.checkpoint import load_checkpoint
    from mrl_lightning.exchange import read_log, record_key

    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    straight_log, chaos_log = out / "straight.jsonl", out / "chaos.jsonl"
    chaos_root = out / "runs_chaos"
    straight_cfg = write_config(out, out / "runs", max_steps, straight_log, compress, default, checkpoint_every,
                                max_lag, async_rollouts, steps_per_round)
    chaos_cfg = write_config(out, chaos_root, max_steps, chaos_log, compress, default, checkpoint_every, max_lag,
                             async_rollouts, steps_per_round)
    console = out / "console.log"

    t0 = time.monotonic()
    proc = start(straight_cfg, out / "marker_straight", "straight", None, console)
    if proc.wait() != 0:
        raise SystemExit(f"the uninterrupted run failed (exit {proc.returncode}); see {console}")
    straight_s = time.monotonic() - t0
    reference = load_checkpoint(out / "runs" / "straight" / "checkpoints" / "last.ckpt")
    print(f"uninterrupted run: {max_steps} steps in {straight_s:.1f} s")

    events, resumes, attempt = [], 0, 0
    ckpt, resume_step = None, 0
    # kill steps drawn up front, in order, so that every kill has steps left to land in; from
    # the step after the first checkpoint (one exists to resume from: a run with none would start
    # over and its log would repeat what the killed run appended) to the step before the last
    plan = sorted(rng.randint(checkpoint_every + 1, max_steps - 1) for _ in range(kills))
    while True:
        marker = out / f"marker_{attempt}"
        marker.write_bytes(b"")
        proc = start(chaos_cfg, marker, f"v{attempt}", ckpt, console)
        if ckpt is not None:
            resumes += 1
        if len(events) >= kills:  # enough kills: let this one finish
            if proc.wait() != 0:
                raise SystemExit(f"the final resumed run failed (exit {proc.returncode}); see {console}")
            break
        target = TARGETS[len(events) % len(TARGETS)]
        step = max(plan[len(events)], resume_step + 1)
        deadline = time.monotonic() + 120 + step_timeout_s * (step - resume_step)
        killed = False
        while proc.poll() is None and time.monotonic() < deadline:
            name, at = read_marker(marker)  # `at`: the step in progress (a checkpoint follows its step)
            if target == "log-append" and name in ("exchange", "log-append") and at >= step:
                # an append lasts microseconds: watch the log itself and kill the moment it grows
                size = chaos_log.stat().st_size if chaos_log.exists() else 0
                while proc.poll() is None and (chaos_log.stat().st_size if chaos_log.exists() else 0) == size \
                        and read_marker(marker)[0] in ("exchange", "log-append"):
                    pass
                name = target
            if name == target and at >= step:
                lo, hi = DELAY_S[target]
                time.sleep(rng.uniform(lo, hi))
                tail_before = chaos_log.read_bytes()[-1:] if chaos_log.exists() else b""
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                hit, hit_step = read_marker(marker)
                ckpt, resume_step, broken = newest_loadable(chaos_root)
                torn = chaos_log.exists() and chaos_log.stat().st_size > 0 and chaos_log.read_bytes()[-1:] != b"\n"
                temps = len(list(chaos_root.glob("*/checkpoints/.*.tmp")))
                events.append({"kill": len(events) + 1, "target": target, "target_step": step, "phase_hit": hit,
                               "step_hit": hit_step, "resume_from_step": resume_step,
                               "resume_from": str(ckpt.relative_to(chaos_root)) if ckpt else None,
                               "unloadable_checkpoints": broken, "log_torn_tail": torn,
                               "partial_checkpoint_files": temps, "log_tail_before": tail_before.decode()})
                print(f"kill {len(events):2d}: aimed at {target:10s} step {step:3d}; hit {hit:10s} step {hit_step:3d}"
                      f" -> resume from step {resume_step}{' (log tail torn)' if torn else ''}")
                killed = True
                break
            time.sleep(0.001)
        if not killed:
            if proc.poll() is None:
                proc.kill()
                raise SystemExit(f"no {target} phase at step >= {step} within the time limit; see {console}")
            if proc.returncode != 0:
                raise SystemExit(f"run v{attempt} failed on its own (exit {proc.returncode}); see {console}")
            break  # finished before the moment came (target step past the end)
        attempt += 1
        if ckpt is not None and resume_step >= max_steps:
            break

    final_dir = chaos_root / f"v{attempt}" / "checkpoints" / "last.ckpt"
    final = load_checkpoint(final_dir if final_dir.exists() else ckpt)
    diffs = compare(reference, final)
    straight_records = [record_key(r) for r in read_log(str(straight_log))]
    chaos_records = [record_key(r) for r in read_log(str(chaos_log))]
    summary = {
        "compressed_checkpoints": compress,
        "command": f"python benchmarks/chaos.py {'--default ' if default else ''}--kills {kills} "
                   f"--max-steps {max_steps} --seed {seed} --checkpoint-every {checkpoint_every}"
                   + (f" --max-lag {max_lag}" if max_lag else "") + (" --async-rollouts" if async_rollouts else "")
                   + (f" --steps-per-round '{json.dumps(steps_per_round)}'" if steps_per_round else ""),
        "max_steps": max_steps, "kills": len(events), "resumes": resumes,
        "phases_hit": dict(Counter(e["phase_hit"] for e in events)),
        "targets": dict(Counter(e["target"] for e in events)),
        "log_torn_tails": sum(e["log_torn_tail"] for e in events),
        "partial_checkpoint_files": max((e["partial_checkpoint_files"] for e in events), default=0),
        "unloadable_checkpoints_seen": max((e["unloadable_checkpoints"] for e in events), default=0),
        "final_state_equal": not diffs, "state_differences": diffs[:20],
        "exchange_log_equal": straight_records == chaos_records,
        "exchange_log_records": [len(straight_records), len(chaos_records)],
        "uninterrupted_s": round(straight_s, 1), "events": events,
    }
    (out / "chaos.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=12, help="SIGKILLs at least (>= 10 for the reliability claim)")
    parser.add_argument("--max-steps", type=int, default=30, help="training steps of the tiny config")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--out", type=Path, default=None, help="folder for runs and chaos.json (default: a temp dir)")
    parser.add_argument("--step-timeout-s", type=float, default=5.0, help="patience per step before giving up")
    parser.add_argument("--default", action="store_true",
                        help="the embedded default (configs/default.yaml, two workers) instead of the tiny config")
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help="checkpoint period in steps (default: 1 for the tiny config, 2 with --default)")
    parser.add_argument("--max-lag", type=int, default=0,
                        help="trainer.max_lag: steps a policy may run ahead of its peers (docs/mwra.md, \"Pace\")")
    parser.add_argument("--async-rollouts", action="store_true",
                        help="trainer.async_rollouts: the next batch sampled beside each update (docs/mwra.md)")
    parser.add_argument("--steps-per-round", type=json.loads, default=None, metavar="JSON",
                        help="trainer.steps_per_round, e.g. '{\"gpt2\": 1.5}' (docs/mwra.md, \"Steps per round\")")
    parser.add_argument("--no-compress", dest="compress", action="store_false",
                        help="plain checkpoints (default: gzip-compressed, as in the embedded default)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="mrl_chaos_"))
    every = args.checkpoint_every or (2 if args.default else 1)
    summary = run_chaos(out, args.kills, args.max_steps, args.seed, args.step_timeout_s, args.compress, args.default,
                        every, args.max_lag, args.async_rollouts, args.steps_per_round)
    print(json.dumps({k: v for k, v in summary.items() if k != "events"}, indent=2))
    ok = summary["kills"] >= args.kills and summary["final_state_equal"] and summary["exchange_log_equal"]
    print(f"{'PASS' if ok else 'FAIL'}: {summary['kills']} kills, {summary['resumes']} resumes, final state "
          f"{'equal' if summary['final_state_equal'] else 'DIFFERENT'}, exchange log "
          f"{'equal' if summary['exchange_log_equal'] else 'DIFFERENT'}; results in {out / 'chaos.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
