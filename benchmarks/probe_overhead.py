"""What each probe adds to a training step of the embedded default.

    python benchmarks/probe_overhead.py --steps 150 --out runs/bench_probe_overhead

Runs ``configs/default.yaml`` under each probe snippet (``callbacks/none.yaml``,
``sgt.yaml``, ``xgrpo.yaml``, ``prp.yaml``), one after the other, in one process with
``--threads`` threads (colocated, so the step time is the sum of both policies' work and
nothing waits on another process), same seed, no evaluation or checkpoint inside the
timed window. It prints each arm's seconds per step (wall time between the logged steps
``--skip`` and ``--steps``, from TensorBoard) and its overhead over ``none``:

- SGT and XGRPO: ``t_arm / t_none - 1`` (target: at most 5%);
- PRP: the cost of one pooled peer sample relative to one own sample,
  ``((t_prp - t_none) / pooled per step) / (t_none / own samples per step)`` (target: at
  most 1.3).

The arms train differently (that is what probes do), so the completions they sample
differ in length; the overheads are therefore of the order of a few percent of noise.
Time it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from mwra import mean, read, seconds_per_step  # noqa: E402  (benchmarks/mwra.py)

ARMS = ("none", "sgt", "xgrpo", "prp")


def run(arm: str, out: Path, steps: int, threads: int) -> Path:
    args = [sys.executable, "-m", "mrl_lightning.cli", "fit", "--config", str(REPO / "configs" / "default.yaml"),
            "--config", str(REPO / "callbacks" / f"{arm}.yaml"), "--trainer.devices", "1",
            "--trainer.placement", "colocated", "--trainer.num_threads", str(threads),
            "--trainer.max_steps", str(steps), "--trainer.eval_every_n_steps", str(steps + 1),
            "--trainer.checkpoint_every_n_steps", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(out / arm),
            "--trainer.version", "run"]
    print(f"[{arm}] {' '.join(args[3:])}", flush=True)
    with open(out / f"{arm}.log", "w") as log:
        if subprocess.call(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO):
            raise SystemExit(f"[{arm}] mrl fit failed; see {out / f'{arm}.log'}")
    return out / arm / "run"


def per_step(scalars: dict, suffix: str, skip: int) -> float:
    """Sum over policies of the mean per-step value of ``<prefix>/<policy>/<suffix>`` tags."""
    tags = [t for t in scalars if t.endswith("/" + suffix)]
    return sum(mean([x[2] for x in scalars[t] if x[0] >= skip]) for t in tags)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_probe_overhead")
    args = parser.parse_args(argv)
    if "none" not in args.arms:
        parser.error("--arms must include none (the baseline)")
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"--out {args.out} is not empty; pick a new folder.")
    args.out.mkdir(parents=True, exist_ok=True)
    scalars = {arm: read(run(arm, args.out, args.steps, args.threads)) for arm in args.arms}
    base = seconds_per_step(scalars["none"], args.skip)
    seen = scalars["none"]["train/samples_seen"]
    own = (seen[-1][2] - seen[0][2]) / (seen[-1][0] - seen[0][0])  # own completions per step, all policies
    summary = {"none_s_per_step": base, "arms": {}}
    print(f"\nseconds per step (steps {args.skip}-{args.steps}, 1 process x {args.threads} threads):")
    for arm in args.arms:
        t = seconds_per_step(scalars[arm], args.skip)
        row = {"s_per_step": t, "overhead": t / base - 1.0}
        line = f"  {arm:6s} {t:.3f} s  ({100 * (t / base - 1.0):+.1f}% vs none)"
        if arm == "sgt":
            row["transfers_per_step"] = per_step(scalars[arm], "transfers", args.skip)
            line += f", {row['transfers_per_step']:.1f} transfers per step"
        if arm == "prp":
            pooled = per_step(scalars[arm], "peers_pooled", args.skip)
            row["pooled_per_step"] = pooled
            row["cost_per_pooled_vs_own"] = ((t - base) / pooled) / (base / own) if pooled else float("nan")
            line += (f", {pooled:.0f} pooled peer samples per step; one costs "
                     f"{row['cost_per_pooled_vs_own']:.2f}x an own sample")
        summary["arms"][arm] = row
        print(line)
    (args.out / "probe_overhead.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
