"""What each probe adds to a training step of the embedded default.

    python benchmarks/probe_overhead.py --steps 150 --rounds 3 --out runs/bench_probe_overhead

Runs ``configs/default.yaml`` under each probe snippet (``callbacks/none.yaml``,
``sgt.yaml``, ``xgrpo.yaml``, ``prp.yaml``), one after the other, in one process with
``--threads`` threads (colocated, so the step time is the sum of both policies' work and
nothing waits on another process), same seed, no evaluation or checkpoint inside the
timed window, and all of that ``--rounds`` times (a change of the machine's speed during
the invocation then hits every arm alike). It prints, per arm (medians over rounds):

- the seconds per step (wall time between the logged steps ``--skip`` and ``--steps``, from
  TensorBoard) and the ratio to the same round's ``none``, ``t_arm / t_none - 1``. The arms
  train differently (that is what probes do), so their completions differ in length, and
  separate runs see the machine at different speeds: on this CPU this A/B figure moves by
  +-20% from round to round;
- the probe's **own** time, measured inside its run: SEE publishing the step's records
  (``train/exchange_time_s``), the probes composing each policy's batch
  (``train/<p>/compose_time_s``) and their loss terms' forward, backward and share bound
  (``train/<p>/aux_loss_time_s``), as a share of the rest of the same steps, ``own / (step -
  own)``. Both come from the same steps, so the machine's speed cancels. Targets: SGT and
  XGRPO at most 5%. The three parts are printed too. On SGT's fused steps its loss term has
  no passes of its own: its time is the padding, its loss and an upper bound on its rows' part
  of the shared pass (``mrl_lightning/update/policy_update.py``);
- PRP: the cost of one pooled peer sample relative to one own sample, from its own time,
  ``(own / pooled per step) / ((step - own) / own samples per step)`` (target: at most
  1.3), and from the A/B times, ``((t_prp - t_none) / pooled) / (t_none / own samples)``.

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


OWN_TIME_TAGS = ("compose_time_s", "aux_loss_time_s")


def own_seconds(scalars: dict, skip: int) -> tuple[float, float]:
    """(the probes' own seconds per step, the step's seconds) over the windows after ``skip``.

    Own time: ``train/exchange_time_s`` (SEE publishing the step's records) plus, for every
    policy, ``train/<p>/compose_time_s`` (the probes composing its batch) and
    ``train/<p>/aux_loss_time_s`` (the probes' loss terms: forward, backward, share bound).
    Both are measured in the same steps of the same run, so a change of the machine's
    speed moves them together.
    """
    total = mean(after(scalars["train/exchange_time_s"], skip))
    total += sum(per_step(scalars, tag, skip) for tag in OWN_TIME_TAGS)
    return total, mean(after(scalars["train/step_time_s"], skip))


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
    print(f"\nsteps {args.skip + 1}-{args.steps}, 1 process x {args.threads} threads, {args.rounds} round(s); medians "
          "over rounds. 'own' = the probe's own time inside its run (exchange + compose + auxiliary loss terms)")
    print(f"{'arm':11s} {'s/step':>7s} {'vs none (per round)':>34s} {'own s/step':>11s} {'own overhead (per round)':>34s}")
    for arm in args.arms:
        t = statistics.median(x[arm] for x in times)
        overheads = [x[arm] / x["none"] - 1.0 for x in times]
        parts = [own_seconds(rd[arm], args.skip) for rd in rounds]  # (own s/step, step s/step) per round
        owns = [o / (step - o) for o, step in parts]
        row = {"s_per_step": t, "overhead": statistics.median(overheads), "overhead_per_round": overheads,
               "own_s_per_step": statistics.median(o for o, _ in parts), "own_overhead": statistics.median(owns),
               "own_overhead_per_round": owns}
        print(f"{arm:11s} {t:7.3f} {100 * row['overhead']:+6.1f}% (" + ", ".join(f"{100 * o:+.1f}%" for o in overheads)
              + f")  {row['own_s_per_step']:11.4f} {100 * row['own_overhead']:+6.1f}% ("
              + ", ".join(f"{100 * o:+.1f}%" for o in owns) + ")")
        row["own_parts_s_per_step"] = {  # medians over rounds: SEE publishing, composing, loss terms
            "exchange": statistics.median(mean(after(rd[arm]["train/exchange_time_s"], args.skip)) for rd in rounds),
            **{tag: statistics.median(per_step(rd[arm], tag, args.skip) for rd in rounds) for tag in OWN_TIME_TAGS}}
        print("       own: " + ", ".join(f"{k} {1000 * v:.1f} ms" for k, v in row["own_parts_s_per_step"].items()))
        if arm.startswith("sgt"):
            row["transfers_per_step"] = statistics.median(per_step(rd[arm], "transfers", args.skip) for rd in rounds)
            print(f"       {row['transfers_per_step']:.1f} transfers per step")
        if arm == "prp":
            costs, own_costs = [], []
            for rd, x, (o, step) in zip(rounds, times, parts):
                pooled = per_step(rd[arm], "peers_pooled", args.skip)
                costs.append(((x[arm] - x["none"]) / pooled) / (x["none"] / own) if pooled else float("nan"))
                own_costs.append((o / pooled) / ((step - o) / own) if pooled else float("nan"))
            row["pooled_per_step"] = statistics.median(per_step(rd[arm], "peers_pooled", args.skip) for rd in rounds)
            row["cost_per_pooled_vs_own"] = statistics.median(costs)
            row["cost_per_pooled_vs_own_per_round"] = costs
            row["own_cost_per_pooled_vs_own"] = statistics.median(own_costs)
            row["own_cost_per_pooled_vs_own_per_round"] = own_costs
            print(f"       {row['pooled_per_step']:.0f} pooled peer samples per step; one costs "
                  f"{row['own_cost_per_pooled_vs_own']:.2f}x an own sample (own time; per round "
                  + ", ".join(f"{c:.2f}x" for c in own_costs) + f"), {row['cost_per_pooled_vs_own']:.2f}x "
                  "(vs none; per round " + ", ".join(f"{c:.2f}x" for c in costs) + ")")
        summary["arms"][arm] = row
    (args.out / "probe_overhead.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
