"""MWRA benchmark: the embedded default colocated (1 process) vs disjoint (1 process per policy).

    python benchmarks/mwra.py --steps 300 --rounds 3 --out runs/bench_mwra

runs ``mrl fit --config configs/default.yaml`` twice, one after the other, with the same
seed and step budget, and that ``--rounds`` times (colocated, disjoint, colocated, ...: a
change of the machine's speed during the invocation then hits both placements alike) (no evaluation or checkpoint inside the window, so only training
steps are timed):

- colocated: one process, ``--trainer.num_threads`` = all cores (2 here), the policies'
  phases in turn;
- disjoint: ``--trainer.devices <policies> --trainer.strategy ddp --trainer.placement disjoint``,
  one single-threaded worker process per policy, running at the same time.

It prints the seconds per training step of each (wall time between the logged steps
``--skip`` and ``--steps``, read from TensorBoard, so start-up and warm-start are not
counted; the median over rounds, and each round's), their ratio, each worker's time per phase (``mwra/<policy>/rollout_s``,
``update_s``, ``wait_s``) and how far the two runs' reward curves agree (the runs use
different thread counts, so float rounding differs and sampled tokens part ways after a
while; the curves should still agree in level). A JSON summary goes to ``<out>/mwra.json``.
Time it alone: another busy process on the cores makes both runs slower and the ratio
meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(name: str, out: Path, steps: int, extra: list[str]) -> tuple[Path, float]:
    """One ``mrl fit`` of the default; returns its run folder and wall seconds."""
    args = [sys.executable, "-m", "mrl_lightning.cli", "fit", "--config", str(REPO / "configs" / "default.yaml"),
            "--trainer.max_steps", str(steps), "--trainer.eval_every_n_steps", str(steps + 1),
            "--trainer.checkpoint_every_n_steps", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(out / name),
            "--trainer.version", "run", *extra]
    print(f"[{name}] {' '.join(args[3:])}", flush=True)
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.call(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    seconds = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"[{name}] mrl fit failed with exit code {code}; see {out / f'{name}.log'}")
    return out / name / "run", seconds


def read(folder: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Every scalar tag: list of (step, wall_time, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.wall_time, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def seconds_per_step(scalars: dict, skip: int) -> float:
    """Wall seconds per step from the first logged step >= ``skip`` to the last one.

    Raises:
        SystemExit: fewer than two logged steps from ``skip`` on (a run too short for its log interval).
    """
    series = [x for x in scalars["train/step_time_s"] if x[0] >= skip]
    if len(series) < 2:
        raise SystemExit(f"only {len(series)} logged step(s) at or after --skip {skip}: run more --steps (values are "
                         "logged every log_every_n_steps steps, 10 in the default).")
    (s0, t0, _), (s1, t1, _) = series[0], series[-1]
    return (t1 - t0) / (s1 - s0)


def after(series: list[tuple[int, float, float]], skip: int) -> list[float]:
    """Values logged for windows that start after step ``skip`` (a value logged at step k is the
    mean over the log interval ending at k, so the window ending at ``skip`` is left out)."""
    return [x[2] for x in series if x[0] > skip]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def agreement(a: list[tuple[int, float, float]], b: list[tuple[int, float, float]], window: int = 50) -> dict:
    """How two reward curves agree: the last step up to which they are identical, and
    |difference| of their means over windows of ``window`` steps.

    Each point is one logged value (the mean over ``log_every_n_steps`` steps, 10 in the default).
    """
    va, vb = {x[0]: x[2] for x in a}, {x[0]: x[2] for x in b}
    steps = sorted(set(va) & set(vb))
    first_diff = next((s for s in steps if va[s] != vb[s]), None)
    identical_to = max((s for s in steps if first_diff is None or s < first_diff), default=0)
    buckets: dict[int, tuple[list[float], list[float]]] = {}
    for s in steps:
        buckets.setdefault((s - 1) // window, ([], []))
        buckets[(s - 1) // window][0].append(va[s])
        buckets[(s - 1) // window][1].append(vb[s])
    diffs = [abs(mean(x) - mean(y)) for x, y in buckets.values()]
    return {"identical_to_step": identical_to, "window_steps": window, "window_mean_abs_diff": mean(diffs),
            "window_max_abs_diff": max(diffs), "mean_a": mean([va[s] for s in steps]),
            "mean_b": mean([vb[s] for s in steps])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument("--skip", type=int, default=10, help="first steps left out of the timing")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_mwra")
    parser.add_argument("--policies", type=int, default=2, help="policies in the default config")
    parser.add_argument("--rounds", type=int, default=3,
                        help="colocated then disjoint, this many times; the step times are medians over rounds")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"--out {args.out} is not empty; pick a new folder.")
    args.out.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    colocated_args = ["--trainer.devices", "1", "--trainer.placement", "colocated", "--trainer.num_threads", str(cores)]
    disjoint_args = ["--trainer.devices", str(args.policies), "--trainer.strategy", "ddp", "--trainer.placement",
                     "disjoint", "--trainer.num_threads", str(max(1, cores // args.policies))]
    rounds = []  # colocated, disjoint, colocated, ...: a drift of the machine's speed hits both placements
    for r in range(args.rounds):
        suffix = f"_{r}" if args.rounds > 1 else ""
        colocated, t_colo = run(f"colocated{suffix}", args.out, args.steps, colocated_args)
        disjoint, t_disj = run(f"disjoint{suffix}", args.out, args.steps, disjoint_args)
        rounds.append({"colocated": colocated, "disjoint": disjoint, "wall_s": {"colocated": t_colo, "disjoint": t_disj}})
    for r in rounds:
        r["scalars"] = {k: read(r[k]) for k in ("colocated", "disjoint")}
        r["s_per_step"] = {k: seconds_per_step(v, args.skip) for k, v in r["scalars"].items()}
    step_a = statistics.median(r["s_per_step"]["colocated"] for r in rounds)
    step_b = statistics.median(r["s_per_step"]["disjoint"] for r in rounds)
    per_round = [r["s_per_step"]["colocated"] / r["s_per_step"]["disjoint"] for r in rounds]
    a, b = rounds[0]["scalars"]["colocated"], rounds[0]["scalars"]["disjoint"]
    summary = {"steps": args.steps, "cores": cores, "rounds": args.rounds, "colocated_s_per_step": step_a,
               "disjoint_s_per_step": step_b, "speedup": step_a / step_b, "speedup_per_round": per_round,
               "s_per_step_per_round": [r["s_per_step"] for r in rounds],
               "wall_s": [r["wall_s"] for r in rounds], "phases": {}, "reward_agreement": {}}
    print(f"\nseconds per training step (steps {args.skip + 1}-{args.steps}, {cores} cores; median of {args.rounds} "
          "alternating round(s)):")
    print(f"  colocated, 1 process x {cores} threads : {step_a:.3f}   per round: "
          + ", ".join(f"{r['s_per_step']['colocated']:.3f}" for r in rounds))
    print(f"  disjoint, {args.policies} processes x {max(1, cores // args.policies)} thread(s): {step_b:.3f}   per round: "
          + ", ".join(f"{r['s_per_step']['disjoint']:.3f}" for r in rounds))
    print("  speed-up per round: " + ", ".join(f"{x:.2f}x" for x in per_round))
    print(f"  disjoint speed-up: {step_a / step_b:.2f}x\n")
    if args.rounds > 1:
        print("per worker and reward curves: the first round")
    print(f"{'run':10s} {'policy':8s} {'rollout_s':>10s} {'update_s':>10s} {'wait_s':>8s} {'peak GiB':>9s}")
    for label, scalars in (("colocated", a), ("disjoint", b)):
        for tag in sorted(t for t in scalars if t.startswith("mwra/") and t.endswith("/rollout_s")):
            policy = tag.split("/")[1]
            row = {k: mean(after(scalars[f"mwra/{policy}/{k}"], args.skip))
                   for k in ("rollout_s", "update_s", "wait_s")}
            row["peak_memory_gib"] = scalars[f"mwra/{policy}/peak_memory_gib"][-1][2]
            summary["phases"].setdefault(label, {})[policy] = row
            print(f"{label:10s} {policy:8s} {row['rollout_s']:10.3f} {row['update_s']:10.3f} {row['wait_s']:8.3f} "
                  f"{row['peak_memory_gib']:9.2f}")
    print("\nreward curves (rollout/<policy>/reward_mean), colocated vs disjoint:")
    for tag in sorted(t for t in a if t.startswith("rollout/") and t.endswith("/reward_mean")):
        agree = agreement(a[tag], b[tag])
        summary["reward_agreement"][tag] = agree
        print(f"  {tag}: identical up to step {agree['identical_to_step']}; {agree['window_steps']}-step means differ by "
              f"{agree['window_mean_abs_diff']:.3f} on average (max {agree['window_max_abs_diff']:.3f}); "
              f"run means {agree['mean_a']:.3f} vs {agree['mean_b']:.3f}")
    (args.out / "mwra.json").write_text(json.dumps(summary, indent=2))
    print(f"\nsummary: {args.out / 'mwra.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
