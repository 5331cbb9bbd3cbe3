"""Placement by cost against measurement: what ``trainer.placement: cost`` predicts for each placement of one config,
and what each placement then takes (docs/mwra.md, "Placement by cost").

    python benchmarks/mwra_cost.py --config configs/real_small.yaml --steps 20 --out benchmarks/results/mwra_cost
    python benchmarks/mwra_cost.py --out benchmarks/results/mwra_cost --read-only     # the table again

Runs ``mrl fit`` once per placement of the config's ranks, one after the other, with the same seed and steps
(benchmarks/pace.py's arms: evaluation only at step 0 and at the end, no checkpoint inside):

- ``cost``: ``--trainer.placement cost``: its plan holds the predictions of every placement (the calibration's
  lines), and it runs the one chosen;
- ``colocated`` or ``disjoint``, whichever ``cost`` did not choose, on the same ranks;
- ``one_process``: ``--trainer.devices 1`` (every core's threads), the plan's comparison line.

Measured seconds a step are ``train/elapsed_s``'s between the first logged step and the last (pace.py), and each
policy's rollout and update its ``mwra/<policy>/rollout_s`` and ``update_s`` averaged over the same steps (a
colocated update holds the gradient all-reduce, and the wait for the other rank, as the prediction's all-reduce
term does). Writes ``cost.md`` and ``cost.json`` under ``--out``. Time it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pace  # noqa: E402 - benchmarks/pace.py: one arm's run and its summary

LINE = re.compile(r"^(?:  \* |    )(?:for comparison, )?(disjoint|colocated|one process)(?: on \d+ threads)? \((.*?)\): "
                  r"([\d.]+) s a step \[sampling \+ update \(\+ all-reduce\): (.*)\]")
PHASE = re.compile(r"(\S+) ([\d.]+) \+ ([\d.]+)(?: \+ ([\d.]+))? s")


def predictions(log: str) -> dict[str, dict]:
    """The plan's prediction lines of a ``--trainer.placement cost`` run: placement -> step and phases."""
    out = {}
    for line in log.splitlines():
        found = LINE.match(line)
        if found:
            mode, _, step, phases = found.groups()
            out[mode.replace(" ", "_")] = {
                "chosen": line.startswith("  * "), "s_per_step": float(step),
                "policies": {p: {"sampling_s": float(s), "update_s": float(u) + float(a or 0.0)}
                             for p, s, u, a in PHASE.findall(phases)}}
    if not out:
        raise SystemExit("the cost arm's log holds no prediction: did it run with --trainer.placement cost?")
    return out


def report(out: Path) -> str:
    predicted = predictions((out / "cost.log").read_text())
    chosen = next(mode for mode, p in predicted.items() if p["chosen"])
    arms = {"cost": chosen, **{name: name for name in ("colocated", "disjoint", "one_process")
                               if name != chosen and (out / name).is_dir()}}
    measured = {mode: pace.summarize(pace.read_run(out / arm), str(out / arm)) for arm, mode in arms.items()}
    rows = ["| placement | predicted s / step | measured s / step (steps 2-N) | predicted / measured |",
            "|---|---|---|---|"]
    for mode, m in sorted(measured.items(), key=lambda kv: kv[1]["s_per_step"]):
        p = predicted.get(mode, {}).get("s_per_step", float("nan"))
        mark = " (chosen)" if mode == chosen else ""
        rows.append(f"| {mode}{mark} | {p:.2f} | {m['s_per_step']:.2f} | {p / m['s_per_step']:.2f} |")
    rows += ["", "| placement | policy | sampling: predicted / measured (s) | update: predicted / measured (s) |",
             "|---|---|---|---|"]
    for mode, m in measured.items():
        for policy, v in m["policies"].items():
            p = predicted.get(mode, {}).get("policies", {}).get(policy, {})
            rows.append(f"| {mode} | {policy} | {p.get('sampling_s', float('nan')):.2f} / {v['rollout_s']:.2f} | "
                        f"{p.get('update_s', float('nan')):.2f} / {v['update_s']:.2f} |")
    order_p = sorted(measured, key=lambda mode: predicted.get(mode, {}).get("s_per_step", float("inf")))
    order_m = sorted(measured, key=lambda mode: measured[mode]["s_per_step"])
    text = "\n".join(rows) + (f"\n\nFastest predicted: {order_p[0]}; fastest measured: {order_m[0]} "
                              f"({'the same' if order_p[0] == order_m[0] else 'the prediction chose wrong'}).\n")
    (out / "cost.md").write_text(text)
    (out / "cost.json").write_text(json.dumps({"predicted": predicted, "measured": measured}, indent=2,
                                              sort_keys=True))
    return text


# what the calibration predicts: one step of every policy a round, in lockstep (whatever the config's pace)
LOCKSTEP = ["--trainer.max_lag", "0", "--trainer.steps_per_round", "null"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/real_small.yaml", help="the config (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per placement (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the runs, cost.md and cost.json")
    parser.add_argument("--read-only", action="store_true", help="read the runs already in --out")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps {args.steps}: give at least 3 (the first step is left out of the timing)")
    if args.read_only:
        if not (args.out / "cost.log").is_file():
            parser.error(f"--out {str(args.out)!r} holds no cost run: --read-only reads an earlier invocation's")
        print(report(args.out))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    pace.run_arm("cost", args.config, args.steps, args.out, ["--trainer.placement", "cost",
                                                             "--trainer.log_every_n_steps", "1", *LOCKSTEP])
    chosen = next(mode for mode, p in predictions((args.out / "cost.log").read_text()).items() if p["chosen"])
    other = "disjoint" if chosen == "colocated" else "colocated"
    pace.run_arm(other, args.config, args.steps, args.out, ["--trainer.placement", other,
                                                           "--trainer.log_every_n_steps", "1", *LOCKSTEP])
    pace.run_arm("one_process", args.config, args.steps, args.out, ["--trainer.devices", "1",
                                                                   "--trainer.log_every_n_steps", "1", *LOCKSTEP])
    print(report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
