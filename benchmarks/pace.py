"""Pace benchmark: lockstep against a lag, and one process against one worker per policy, on one config.

    python benchmarks/pace.py --config configs/real_small.yaml --steps 20 --out benchmarks/results/concurrent \
        --arm lockstep="--trainer.max_lag 0 --trainer.steps_per_round null --trainer.placement disjoint" \
        --arm one_process="--trainer.max_lag 0 --trainer.steps_per_round null --trainer.devices 1" \
        --arm shipped=""
    python benchmarks/pace.py --out benchmarks/results/pace --read-only     # the tables and figure again

Runs ``mrl fit`` once per arm, one after the other, with the same seed, step budget and
evaluation (at step 0 and at the end; no checkpoint inside the window), and reads each run's
TensorBoard scalars:

- seconds per training step, from ``train/elapsed_s`` (seconds since the first step began, at
  each update's end, the latest over ranks; model building and the first evaluation are before it): the whole run's, ``elapsed_s`` at the last update
  over the updates, which every arm spends on the same work (a lag's pipeline fill and drain
  included: N batches sampled, N trained); and between the first update and the last, the
  issue's measure, which for a lag of L leaves L samplings out of the window (the fill before
  update 1), so it flatters a lag by about L rollouts over N - 1 steps;
- each worker's idle share over the same steps: its ``mwra/<p>/wait_s`` over
  ``rollout_s + update_s + solo_s + wait_s`` (``update_s`` less the group waits it holds; ``solo_s``: the solo
  steps of ``trainer.steps_per_round``), and each policy's training steps per 100 s (rounds plus ``solo/<p>/steps``) (docs/mwra.md, "Logged per worker"), and where it waited;
- the balanced bound of the baseline arm: its one-thread phase times (rollout + update, every
  policy) summed and divided over the workers, plus its exchange's own time (less its wait);
- each arm's final evaluation, side by side.

It writes ``pace.md`` (the tables), ``pace.json`` and ``timeline.png`` (one panel per arm: each
worker's rollout, update and waits step by step, drawn from its phase times) under ``--out``, and
a simulation of the lockstep arm's measured phase times under other lags (:func:`simulate`).
Time it alone: another busy process on the cores slows every arm and the ratios mean nothing.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("rollout_s", "update_s", "solo_s", "wait_s", "wait_exchange_s", "wait_update_s", "wait_log_s")


def run_arm(name: str, config: str, steps: int, out: Path, extra: list[str]) -> float:
    """One ``mrl fit`` into ``<out>/<name>``; returns its wall seconds (start-up included)."""
    args = [sys.executable, "-m", "mrl_lightning.cli", "fit", "--config", config, "--trainer.max_steps", str(steps),
            "--trainer.eval_every_n_steps", str(steps), "--trainer.checkpoint_every_n_steps", "0",
            "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(out), "--trainer.version", name, *extra]
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.call(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    if code != 0:
        raise SystemExit(f"arm {name!r} failed (exit {code}); see {out / f'{name}.log'}")
    for ckpt in (out / name / "checkpoints").glob("**/*"):  # the end checkpoint is not what this measures
        if ckpt.is_file():
            ckpt.unlink()
    return time.perf_counter() - start


def read_run(folder: Path) -> dict:
    """A run's scalars: ``{tag: {step: value}}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def policies_of(scalars: dict) -> list[str]:
    return sorted({tag.split("/")[1] for tag in scalars if tag.startswith("mwra/") and tag.endswith("/rollout_s")})


def summarize(scalars: dict, where: str = "") -> dict:
    """Seconds per step, idle shares and phase sums of one run (module docstring)."""
    elapsed = scalars.get("train/elapsed_s")
    if not elapsed or len(elapsed) < 2:
        raise SystemExit(f"{where or 'a run'} has fewer than two logged train/elapsed_s steps: nothing to time; run more "
                         "steps than trainer.log_every_n_steps (or add --trainer.log_every_n_steps 1 to each arm)")
    steps = sorted(elapsed)
    window = steps[1:]  # logged steps after the first: the first step's one-off costs left out
    # logged steps may be every log_every_n_steps-th: divide by steps, not by logged points
    out = {"steps": steps[-1], "s_per_step": (elapsed[steps[-1]] - elapsed[steps[0]]) / (steps[-1] - steps[0]),
           "s_per_step_whole": elapsed[steps[-1]] / steps[-1], "policies": {}}
    for p in policies_of(scalars):
        sums = {phase: sum(scalars.get(f"mwra/{p}/{phase}", {}).get(s, 0.0) for s in window) for phase in PHASES}
        # update_s holds the group's waits; solo_s is trainer.steps_per_round's solo steps (sampling and update)
        busy = sums["rollout_s"] + sums["update_s"] + sums["solo_s"] - sums["wait_update_s"]
        # training steps the policy took between the first logged step and the last: one a round, plus its solo
        # steps (a logged value is its window's mean: times the steps it stands for)
        solo = scalars.get(f"solo/{p}/steps", {})
        taken = (steps[-1] - steps[0]) + sum(solo.get(s, 0.0) * (s - prev) for prev, s in zip(steps, window))
        seconds = elapsed[steps[-1]] - elapsed[steps[0]]
        out["policies"][p] = {**{k: v / len(window) for k, v in sums.items()},
                              "idle_share": sums["wait_s"] / max(busy + sums["wait_s"], 1e-9),
                              "steps_per_100_s": 100.0 * taken / max(seconds, 1e-9)}
    exchange = scalars.get("train/exchange_time_s", {})
    waited = max((out["policies"][p]["wait_exchange_s"] for p in out["policies"]), default=0.0)
    # the exchange's own work: its time less the wait for the slowest rank in it (on the rank that waited most)
    out["exchange_s"] = max(sum(exchange.get(s, 0.0) for s in window) / len(window) - waited, 0.0)
    out["eval"] = {tag: values[max(values)] for tag, values in scalars.items()
                   if tag.startswith("eval/") and "success" in tag}
    return out


def balanced_bound(summary: dict, workers: int) -> float:
    """The policies' one-thread work (rollout + update) summed and spread over ``workers``, plus the exchange."""
    work = sum(p["rollout_s"] + p["update_s"] + p["solo_s"] - p["wait_update_s"] for p in summary["policies"].values())
    return work / workers + summary["exchange_s"]


def simulate(rollout: dict[str, list[float]], update: dict[str, list[float]], max_lag: int) -> float:
    """Seconds per step of disjoint workers with these phase times under ``max_lag`` (no other cost).

    Worker p samples batch s (``rollout[p][s]``) as soon as its step s - 1 ends, and trains batch
    s - L once it has sampled batch s and every worker has sampled batch s - L; lockstep (L = 0)
    also meets at every step's end (the log gather). Returns the last update's time over the steps.
    """
    names, n = list(rollout), len(next(iter(rollout.values())))
    sampled = {p: [0.0] * (n + max_lag + 1) for p in names}  # time batch b's sampling ended
    end = {p: 0.0 for p in names}
    last_update = 0.0
    for step in range(1, n + max_lag + 1):
        for p in names:
            if step <= n:
                sampled[p][step] = end[p] + rollout[p][step - 1]
        for p in names:
            batch = step - max_lag
            begin = sampled[p][step] if step <= n else end[p]
            if batch >= 1:
                ready = max(sampled[q][batch] for q in names)
                end[p] = max(begin, ready) + update[p][batch - 1]
            else:
                end[p] = begin
        if max_lag == 0:
            meet = max(end.values())
            end = {p: meet for p in names}
        last_update = max(end.values())
    return last_update / n


def simulate_beside(rollout: dict[str, list[float]], update: dict[str, list[float]]) -> float:
    """Seconds per step of disjoint workers with these phase times under ``async_rollouts`` (``max_lag`` 0), where
    sampling never slows the update (a sampler on devices of its own: the most overlap can give).

    Batch 1 is sampled first; then each step starts once every worker's batch is sampled and the last step has
    met, trains it, and samples the next batch from the update's start on. Returns the last update's time over
    the steps.
    """
    names, n = list(rollout), len(next(iter(rollout.values())))
    sampled, t = {p: rollout[p][0] for p in names}, 0.0
    for step in range(1, n + 1):
        start = max(t, max(sampled.values()))
        sampled = {p: start + (rollout[p][step] if step < n else 0.0) for p in names}
        t = max(start + update[p][step - 1] for p in names)
    return t / n


def _trainer(folder: Path) -> dict:
    import yaml

    config = folder / "config.yaml"
    return (yaml.safe_load(config.read_text()).get("trainer", {}) or {}) if config.is_file() else {}


def _one_process(folder: Path) -> bool:
    return bool(_trainer(folder)) and _trainer(folder).get("devices", 1) == 1


def _async(folder: Path) -> bool:
    return bool(_trainer(folder).get("async_rollouts", False))


def lanes(scalars: dict, serial: bool, beside: bool) -> tuple[list[str], list[tuple[str, str, float, float]]]:
    """The timeline's rows and bars ``(row, phase, left, width)`` of one arm, from its phase times (:func:`timeline`).

    ``serial``: one process (its policies take turns on one row); ``beside``: ``async_rollouts`` (a sampler-thread
    row per worker: the next batch's rollouts start as the updates do; the loop waits for them at the next step).
    """
    names = policies_of(scalars)
    rows = ["one process"] if serial else names
    rows = [r for row in rows for r in ((row, f"{row}: sampler thread") if beside else (row,))]
    t = {row: 0.0 for row in rows}
    bars: list[tuple[str, str, float, float]] = []
    steps = sorted(scalars[f"mwra/{names[0]}/rollout_s"])

    def bar(row: str, phase: str, width: float, left: float | None = None) -> None:
        left = t[row] if left is None else left
        if width > 0:
            bars.append((row, phase, left, width))
            t[row] = left + width

    for i, step in enumerate(steps):
        span = step - (steps[i - 1] if i else 0)  # steps this logged point stands for
        nxt = steps[i + 1] if i + 1 < len(steps) else None

        def get(p: str, tag: str, at: int = step) -> float:
            return scalars.get(f"mwra/{p}/{tag}", {}).get(at, 0.0) * span

        if beside:  # the loop joins the thread, exchanges, starts the next batch's sampling, then trains
            lane_of = {p: rows[0] if serial else p for p in names}
            joined: set[str] = set()
            for p, row in lane_of.items():
                if i == 0:
                    bar(row, "rollout_s", get(p, "rollout_s"))  # the first batch: sampled before the update
                if row not in joined:  # waiting for the thread's batch (once a step on each row)
                    joined.add(row)
                    bar(row, "other_wait", t[f"{row}: sampler thread"] - t[row])
                bar(row, "wait_exchange_s", get(p, "wait_exchange_s"))
            launch = {row: t[row] for row in joined}  # the next batch's sampling starts before the updates
            for p, row in lane_of.items():
                thread = f"{row}: sampler thread"
                if nxt is not None:
                    bar(thread, "rollout_s", get(p, "rollout_s", nxt), left=max(t[thread], launch[row]))
            for p, row in lane_of.items():
                bar(row, "update_s", get(p, "update_s"))
            continue
        for p in names:
            row = rows[0] if serial else p
            widths = {"solo_s": get(p, "solo_s"), "rollout_s": get(p, "rollout_s"),
                      "wait_exchange_s": get(p, "wait_exchange_s"),
                      "update_s": get(p, "update_s"), "other_wait": get(p, "wait_s") - get(p, "wait_exchange_s")}
            for phase, width in widths.items():
                bar(row, phase, width)
    return rows, bars


def timeline(runs: dict[str, dict], path: Path, folders: dict[str, Path] | None = None) -> None:
    """One panel per arm, on one time axis: each worker's rollout, exchange wait, update and other waits, step after
    step, from its phase times (a one-process arm is one row: its policies take turns). A run logged every few steps
    has window means, drawn as wide as their window. An ``async_rollouts`` arm has a second lane per worker, its
    sampler thread: the next batch's rollouts start as the updates do, and the loop waits for them at the next step
    (a reconstruction from the phase times, which do not say how the two threads slowed each other)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"rollout_s": "#4c72b0", "wait_exchange_s": "#bbbbbb", "update_s": "#dd8452", "other_wait": "#dddddd",
              "solo_s": "#55a868"}
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.3 + 1.6 * len(runs)), squeeze=False, sharex=True)
    for ax, (arm, scalars) in zip(axes[:, 0], runs.items()):
        serial = folders is not None and _one_process(folders[arm])
        beside = folders is not None and _async(folders[arm])  # rollouts on a thread beside the update
        rows, bars = lanes(scalars, serial, beside)
        for row, phase, left, width in bars:
            ax.barh(rows.index(row), width, left=left, color=colors[phase], edgecolor="white", linewidth=0.3)
        ax.set_yticks(range(len(rows)), rows)
        steps = sorted(scalars[f"mwra/{policies_of(scalars)[0]}/rollout_s"])
        sparse = any(b - a > 1 for a, b in zip(steps, steps[1:]))
        lagged = "pace/staleness_steps" in scalars and not (folders is not None and _async(folders[arm])
                                                            and not _trainer(folders[arm]).get("max_lag"))
        ax.set_title(arm + (" (logged every few steps: window means)" if sparse else "")
                     + (" (the first max_lag steps, which only sample, are not logged: not drawn)" if lagged else ""),
                     loc="left", fontsize=10)
    axes[-1, 0].set_xlabel("seconds from the first step (each worker's phases, step after step)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["rollout", "waiting at the exchange", "update (compose included)",
                         "other waits (log gather; the sampler thread's batch)",
                         "solo steps (trainer.steps_per_round)"],
               loc="upper right", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out: Path, arms: list[str], walls: dict[str, float]) -> str:
    runs = {arm: read_run(out / arm) for arm in arms}
    summaries = {arm: summarize(s, str(out / arm)) for arm, s in runs.items()}
    base = arms[0]
    lines = ["| arm | s / step, whole run | vs " + base + " | s / step, steps 2-N | vs " + base + " | idle share per "
             "worker (wait over rollout + update + solo + wait) | training steps per 100 s per policy (vs " + base
             + ") | waits a step: exchange / update / log (s) | wall incl. start-up |", "|---|---|---|---|---|---|---|---|---|"]
    for arm, s in summaries.items():
        idle = ", ".join(f"{p} {v['idle_share']:.0%}" for p, v in s["policies"].items())
        waits = ", ".join(f"{p} {v['wait_exchange_s']:.2f} / {v['wait_update_s']:.2f} / {v['wait_log_s']:.2f}"
                          for p, v in s["policies"].items())
        ratio = s["s_per_step"] / summaries[base]["s_per_step"]
        base_rates = {p: v["steps_per_100_s"] for p, v in summaries[base]["policies"].items()}
        rates = ", ".join(f"{p} {v['steps_per_100_s']:.1f} ({v['steps_per_100_s'] / base_rates[p]:.2f}x)"
                          for p, v in s["policies"].items() if p in base_rates)
        whole = s["s_per_step_whole"] / summaries[base]["s_per_step_whole"]
        lines.append(f"| {arm} | {s['s_per_step_whole']:.2f} | {whole:.2f}x | {s['s_per_step']:.2f} | {ratio:.2f}x | "
                     f"{idle} | {rates} | {waits} | {walls.get(arm, float('nan')):.0f} s |")
    phases = ["", "| arm | worker | rollout s | update s | solo steps s | wait s |", "|---|---|---|---|---|---|"]
    for arm, s in summaries.items():
        phases += [f"| {arm} | {p} | {v['rollout_s']:.2f} | {v['update_s']:.2f} | {v['solo_s']:.2f} | {v['wait_s']:.2f} |"
                   for p, v in s["policies"].items()]
    tags = sorted({t for s in summaries.values() for t in s["eval"]})
    evals = ["", "| evaluation at the end | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    evals += [f"| `{t}` | " + " | ".join(f"{summaries[a]['eval'].get(t, float('nan')):.3f}" for a in arms) + " |"
              for t in tags]
    ref = runs[base]
    names = policies_of(ref)
    steps = sorted(ref[f"mwra/{names[0]}/rollout_s"])
    # a round's solo steps (trainer.steps_per_round) come before its sampling: counted with it
    rollout = {p: [ref[f"mwra/{p}/rollout_s"][s] + ref.get(f"mwra/{p}/solo_s", {}).get(s, 0.0) for s in steps]
               for p in names}
    update = {p: [ref[f"mwra/{p}/update_s"][s] - ref.get(f"mwra/{p}/wait_update_s", {}).get(s, 0.0) for s in steps]
              for p in names}
    sim = {lag: simulate(rollout, update, lag) for lag in (0, 1, 2, 4)}
    beside = simulate_beside(rollout, update)
    bound = balanced_bound(summaries[base], len(names))
    text = "\n".join(lines + phases + evals) + (
        f"\n\nBalanced bound of {base} (its one-thread work spread over {len(names)} workers, plus its exchange): "
        f"{bound:.2f} s a step.\n\nSimulated from {base}'s phase times (disjoint workers, no exchange cost), seconds "
        "a step: " + ", ".join(f"max_lag {lag}: {v:.2f}" for lag, v in sim.items()) + f"; async_rollouts (max_lag 0, "
        f"sampling never slowing the update, as on devices of its own): {beside:.2f}.\n")
    (out / "pace.md").write_text(text)
    (out / "pace.json").write_text(json.dumps({"arms": summaries, "walls_s": walls, "balanced_bound_s": bound,
                                               "simulated_s_per_step": sim, "simulated_async_rollouts_s_per_step":
                                               beside}, indent=2, sort_keys=True))
    timeline(runs, out / "timeline.png", {arm: out / arm for arm in arms})
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/real_small.yaml", help="the config every arm runs (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per arm (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the runs, pace.md, pace.json, timeline.png")
    parser.add_argument("--arm", action="append", default=[], metavar="NAME=ARGS",
                        help="an arm: its name and its mrl fit arguments; the first is the baseline")
    parser.add_argument("--read-only", action="store_true", help="read the runs already in --out")
    args = parser.parse_args(argv)
    arms = {}
    for spec in args.arm:
        name, sep, extra = spec.partition("=")
        if not sep or not name:
            parser.error(f"--arm {spec!r}: give NAME=ARGS, e.g. --arm lag2='--trainer.max_lag 2'")
        if name in arms:
            parser.error(f"--arm {name!r} is given twice; give each arm its own name")
        try:
            arms[name] = shlex.split(extra)
        except ValueError as exc:
            parser.error(f"--arm {spec!r}: its arguments do not split as a shell would ({exc}); check the quotes")
    if args.read_only and not args.out.is_dir():
        parser.error(f"--out {str(args.out)!r} does not exist: --read-only reads the runs of an earlier invocation")
    if not args.read_only and not arms:
        parser.error("give at least one --arm (or --read-only)")
    args.out.mkdir(parents=True, exist_ok=True)
    walls_file = args.out / "walls.json"
    walls = json.loads(walls_file.read_text()) if walls_file.is_file() else {}
    if args.read_only:
        names = list(walls) or sorted(p.name for p in args.out.iterdir() if p.is_dir())
        if not names:
            parser.error(f"--out {str(args.out)!r} holds no run to read")
    else:
        for name, extra in arms.items():
            walls[name] = run_arm(name, args.config, args.steps, args.out, extra)
            walls_file.write_text(json.dumps(walls, indent=2))
        names = list(arms)
    print(report(args.out, names, walls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
