"""What each probe adds to a training step of the embedded default.

    python benchmarks/probe_overhead.py --steps 150 --rounds 3 --out runs/bench_probe_overhead

Runs ``configs/default.yaml`` under each probe snippet (``callbacks/none.yaml``,
``sgt.yaml``, ``xgrpo.yaml``, ``prp.yaml``), one after the other, in one process with
``--threads`` threads (colocated, so the step time is the sum of both policies' work and
nothing waits on another process), same seed, no evaluation or checkpoint inside the
timed window, and all of that ``--rounds`` times (a change of the machine's speed during
the invocation then hits every arm alike). It prints each arm's seconds per step (wall time between the logged steps
``--skip`` and ``--steps``, from TensorBoard; the median over rounds) and its overhead over
``none`` (the median over rounds of the ratio to the same round's ``none``):

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
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from mwra import after, mean, read, seconds_per_step  # noqa: E402  (benchmarks/mwra.py)

ARMS = ("none", "sgt", "xgrpo", "prp")


def run(arm: str, out: Path, steps: int, threads: int, suffix: str = "") -> Path:
    args = [sys.executable, "-m", "mrl_lightning.cli", "fit", "--config", str(REPO / "configs" / "default.yaml"),
            "--config", str(REPO / "callbacks" / f"{arm}.yaml"), "--trainer.devices", "1",
            "--trainer.placement", "colocated", "--trainer.num_threads", str(threads),
            "--trainer.max_steps", str(steps), "--trainer.eval_every_n_steps", str(steps + 1),
            "--trainer.checkpoint_every_n_steps", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(out / f"{arm}{suffix}"),
            "--trainer.version", "run"]
    print(f"[{arm}{suffix}] {' '.join(args[3:])}", flush=True)
    with open(out / f"{arm}{suffix}.log", "w") as log:
        if subprocess.call(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO):
            raise SystemExit(f"[{arm}] mrl fit failed; see {out / f'{arm}{suffix}.log'}")
    return out / f"{arm}{suffix}" / "run"


def per_step(scalars: dict, suffix: str, skip: int) -> float:
    """Sum over policies of the mean per-step value of ``<prefix>/<policy>/<suffix>`` tags."""
    tags = [t for t in scalars if t.endswith("/" + suffix)]
    return sum(mean(after(scalars[t], skip)) for t in tags)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_probe_overhead")
    parser.add_argument("--rounds", type=int, default=3,
                        help="every arm in turn, this many times; overheads are medians of per-round ratios")
    args = parser.parse_args(argv)
    if "none" not in args.arms:
        parser.error("--arms must include none (the baseline)")
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"--out {args.out} is not empty; pick a new folder.")
    args.out.mkdir(parents=True, exist_ok=True)
    rounds = []  # none, sgt, xgrpo, prp, none, sgt, ...: a drift of the machine's speed hits every arm
    for r in range(args.rounds):
        suffix = f"_{r}" if args.rounds > 1 else ""
        rounds.append({arm: read(run(arm, args.out, args.steps, args.threads, suffix)) for arm in args.arms})
    seen = rounds[0]["none"]["train/samples_seen"]
    own = (seen[-1][2] - seen[0][2]) / (seen[-1][0] - seen[0][0])  # own completions per step, all policies
    times = [{arm: seconds_per_step(sc, args.skip) for arm, sc in rd.items()} for rd in rounds]
    base = statistics.median(t["none"] for t in times)
    summary = {"none_s_per_step": base, "rounds": args.rounds, "s_per_step_per_round": times, "arms": {}}
    print(f"\nseconds per step (steps {args.skip}-{args.steps}, 1 process x {args.threads} threads; medians over "
          f"{args.rounds} round(s), each arm against the same round's none):")
    for arm in args.arms:
        t = statistics.median(x[arm] for x in times)
        overheads = [x[arm] / x["none"] - 1.0 for x in times]
        overhead = statistics.median(overheads)
        row = {"s_per_step": t, "overhead": overhead, "overhead_per_round": overheads}
        line = (f"  {arm:6s} {t:.3f} s  ({100 * overhead:+.1f}% vs none; per round "
                + ", ".join(f"{100 * o:+.1f}%" for o in overheads) + ")")
        if arm == "sgt":
            row["transfers_per_step"] = statistics.median(per_step(rd[arm], "transfers", args.skip) for rd in rounds)
            line += f", {row['transfers_per_step']:.1f} transfers per step"
        if arm == "prp":
            costs = []
            for rd, x in zip(rounds, times):
                pooled = per_step(rd[arm], "peers_pooled", args.skip)
                costs.append(((x[arm] - x["none"]) / pooled) / (x["none"] / own) if pooled else float("nan"))
            row["pooled_per_step"] = statistics.median(per_step(rd[arm], "peers_pooled", args.skip) for rd in rounds)
            row["cost_per_pooled_vs_own"] = statistics.median(costs)
            row["cost_per_pooled_vs_own_per_round"] = costs
            line += (f", {row['pooled_per_step']:.0f} pooled peer samples per step; one costs "
                     f"{row['cost_per_pooled_vs_own']:.2f}x an own sample (per round "
                     + ", ".join(f"{c:.2f}x" for c in costs) + ")")
        summary["arms"][arm] = row
        print(line)
    (args.out / "probe_overhead.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
