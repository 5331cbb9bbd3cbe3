"""Probe comparison on the embedded default (docs/probes.md, docs/default.md). Not a test.

Runs ``configs/default.yaml`` under every arm (default: none, PRP, XGRPO, SGT) with
several ``seed_everything`` values, each run a ``mrl fit`` subprocess with one thread
(``--parallel`` at a time), then reads every run's TensorBoard events and writes:

- ``runs.csv``: one row per (arm, seed, policy) with the final eval success (``eval/<p>/success_*``: mean of 8 sampled completions per held-out prompt)
  (overall = mean over task parts, weak part, strong part), the update variance
  (variance across steps of ``train/<p>/grad_norm``, the pre-clip gradient norm, logged
  every step) and, for PRP arms, the mean THL residual and importance-weight ESS;
- ``summary.csv`` and ``summary.md``: per (arm, policy) the mean and 95% interval over
  seeds (Student t, n - 1 degrees of freedom);
- ``probes.png``: final weak-part success per arm and policy (mean, 95% interval) and
  weak- and strong-part success over training (mean over seeds).

The warm-start is shared across arms and seeds: the TinyCausalLM recipe caches it by a
hash of the recipe (its own ``seed`` stays fixed), so only the first run builds it; a
one-step run builds it before the parallel runs start. ``seed_everything`` changes
sampling and data order only. Finished runs (``done.json``) are skipped on a rerun.

Arms: ``none``, ``prp`` (truncate), ``prp_clip``, ``prp_none`` (the PRP weight modes of
docs/probes.md, c = 2), ``xgrpo``, ``sgt``: each is ``callbacks/<snippet>.yaml`` stacked on the default.

Cost, measured on this 2-core CPU (default.yaml: B = 16, G = 8, two policies; two runs at a
time, one thread each): the default invocation (4 arms x 3 seeds x 500 steps) took 25.8 min;
a none / XGRPO / SGT run of 500 steps takes about 3.3 min, a PRP run (M = 4) about 4.7 min.
``--steps 1500`` is estimated at about 80 min. The ETA is printed after every run.

Usage::

    python benchmarks/probes.py --out runs/probes                  # 4 arms x 3 seeds x 500 steps, ~26 min
    python benchmarks/probes.py --steps 4 --seeds 0 --arms none prp --out /tmp/probes_smoke
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
ARMS = {  # arm -> (snippet, overrides of the probe's init_args)
    "none": ("none.yaml", {}),
    "prp": ("prp.yaml", {}),
    "prp_clip": ("prp.yaml", {"is_mode": "clip", "c": 2.0}),
    "prp_none": ("prp.yaml", {"is_mode": "none"}),
    "xgrpo": ("xgrpo.yaml", {}),
    "sgt": ("sgt.yaml", {}),
}
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def arm_snippet(arm: str, out: Path) -> Path:
    """The callbacks YAML of ``arm`` (written under ``out`` when it overrides options)."""
    snippet, overrides = ARMS[arm]
    path = REPO / "callbacks" / snippet
    if not overrides:
        return path
    config = yaml.safe_load(path.read_text())
    config["trainer"]["callbacks"][-1].setdefault("init_args", {}).update(overrides)
    target = out / "snippets" / f"{arm}.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(yaml.safe_dump(config, sort_keys=False))
    return target


def fit_command(config: Path, snippet: Path, seed: int, steps: int, eval_every: int, run_dir: Path,
                placement: str = "colocated") -> list[str]:
    """``mrl fit`` for one run, one thread per process, logging every step, checkpoint only at the end.

    ``placement="disjoint"`` runs each of the two policies in its own process (docs/mwra.md).
    """
    mrl = Path(sys.executable).with_name("mrl")
    cmd = [str(mrl), "fit", "--config", str(config), "--config", str(snippet), "--seed_everything", str(seed),
           "--trainer.max_steps", str(steps), "--trainer.eval_every_n_steps", str(eval_every),
           "--trainer.log_every_n_steps", "1", "--trainer.num_threads", "1",
           "--trainer.checkpoint_every_n_steps", "0", "--trainer.enable_progress_bar", "false",
           "--trainer.default_root_dir", str(run_dir), "--trainer.version", "0"]
    if placement == "disjoint":
        cmd += ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.placement", "disjoint"]
    else:  # one process (the config may ask for more)
        cmd += ["--trainer.devices", "1", "--trainer.placement", "colocated"]
    return cmd


def run_all(jobs: list[dict], parallel: int, timeout_s: float | None) -> None:
    """Run ``jobs`` (dicts with cmd, dir, name) ``parallel`` at a time; raise if any failed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    pending, running, failed = list(jobs), [], []
    start = time.perf_counter()
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            shutil.rmtree(job["dir"], ignore_errors=True)  # a rerun of an unfinished run starts clean
            job["dir"].mkdir(parents=True, exist_ok=True)
            log = open(job["dir"] / "fit.log", "w")
            job["proc"], job["log"], job["t0"] = subprocess.Popen(job["cmd"], cwd=REPO, env=env, stdout=log,
                                                                  stderr=subprocess.STDOUT), log, time.perf_counter()
            running.append(job)
            print(f"[{time.perf_counter() - start:7.0f} s] start {job['name']}", flush=True)
        time.sleep(1.0)
        for job in list(running):
            rc = job["proc"].poll()
            if rc is None and timeout_s and time.perf_counter() - job["t0"] > timeout_s:
                job["proc"].kill()
                rc = job["proc"].wait()
            if rc is None:
                continue
            running.remove(job)
            job["log"].close()
            seconds = time.perf_counter() - job["t0"]
            if rc == 0:
                (job["dir"] / "done.json").write_text(json.dumps({"seconds": seconds, "cmd": job["cmd"]}))
            else:
                failed.append(job["name"])
            finished = len(jobs) - len(pending) - len(running)
            eta = (time.perf_counter() - start) / finished * (len(jobs) - finished)
            print(f"[{time.perf_counter() - start:7.0f} s] {'done' if rc == 0 else f'FAILED rc={rc}'} "
                  f"{job['name']} ({seconds:.0f} s; {finished}/{len(jobs)} runs, about {eta / 60:.0f} min left; "
                  f"log {job['dir'] / 'fit.log'})", flush=True)
    if failed:
        raise RuntimeError(f"{len(failed)} run(s) failed: {failed}; see their fit.log.")


def read_run(run_dir: Path) -> tuple[dict[str, dict[str, float]], dict[str, list[tuple[int, float]]]]:
    """Per-policy final numbers of one run, and its weak-part eval curves.

    Returns:
        ``({policy: {metric: value}}, {policy: {"weak" | "strong": [(step, success)]}})``.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])

    def series(tag):
        return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in tags else []

    policies = sorted({t.split("/")[1] for t in tags if t.startswith("eval/")})
    out, curves = {}, {}
    for p in policies:
        parts = sorted(t for t in tags if t.startswith(f"eval/{p}/success_")
                       and t.rsplit("_", 1)[1] not in ("weak", "strong"))
        finals = [series(t)[-1][1] for t in parts]
        row = {"success_overall": sum(finals) / len(finals) if finals else math.nan}
        for name in ("weak", "strong"):
            values = series(f"eval/{p}/success_{name}")
            row[f"success_{name}"] = values[-1][1] if values else math.nan
            row[f"success_{name}_start"] = values[0][1] if values else math.nan
            row[f"success_{name}_min"] = min(v for _, v in values) if values else math.nan
        row["weak_rise"] = row["success_weak"] - row["success_weak_start"]
        row["strong_min_ratio"] = (row["success_strong_min"] / row["success_strong_start"]
                                   if row["success_strong_start"] else math.nan)
        # the control for rescue (mrl_lightning/probes/ledger.py): weak-part re-draws, rescued (under
        # none: would have been) or not; the last logged value is over the whole run
        marked = series(f"probe/sgt/{p}/later_solved_share_rescued") or \
            series(f"probe/none/{p}/later_solved_share_would_be_rescued")
        unmarked = series(f"probe/sgt/{p}/later_solved_share_not_rescued") or \
            series(f"probe/none/{p}/later_solved_share_not_rescued")
        row["later_solved_rescued"] = marked[-1][1] if marked else math.nan
        row["later_solved_not_rescued"] = unmarked[-1][1] if unmarked else math.nan
        row["later_solved_gap"] = row["later_solved_rescued"] - row["later_solved_not_rescued"]
        share = [v for _, v in series(f"probe/sgt/{p}/grad_share")]
        row["sgt_grad_share"] = sum(share) / len(share) if share else math.nan
        grad = [v for _, v in series(f"train/{p}/grad_norm")]
        mean = sum(grad) / len(grad) if grad else math.nan
        row["grad_norm_mean"] = mean
        row["update_variance"] = sum((g - mean) ** 2 for g in grad) / (len(grad) - 1) if len(grad) > 1 else math.nan
        for key, tag in (("thl_mass_moved", f"thl/prp/{p}/logprob_mass_moved"),
                         ("thl_boundary_agreement", f"thl/prp/{p}/boundary_agreement"),
                         ("thl_round_trip_failures", f"thl/prp/{p}/round_trip_failures"),
                         ("prp_ess", f"probe/prp/{p}/ess"), ("prp_peers_pooled", f"probe/prp/{p}/peers_pooled")):
            values = [v for _, v in series(tag)]
            row[key] = sum(values) / len(values) if values else math.nan
        out[p] = row
        curves[p] = {"weak": series(f"eval/{p}/success_weak"), "strong": series(f"eval/{p}/success_strong")}
    return out, curves


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of the 95% Student-t interval (nan half-width for n < 2)."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, T_975.get(n - 1, 1.96) * sd / math.sqrt(n)


SUMMARY_KEYS = ("success_overall", "success_weak", "success_strong", "update_variance", "thl_mass_moved",
                "thl_boundary_agreement", "prp_ess", "success_weak_start", "success_weak_min", "weak_rise",
                "success_strong_start", "success_strong_min", "strong_min_ratio", "sgt_grad_share",
                "later_solved_rescued", "later_solved_not_rescued", "later_solved_gap")
# What the embedded default must show under SGT (docs/default.md, "What it has to show"): the
# weak part rises on every seed; the strong part, paired with none on the same seed, dips no
# lower than none's own lowest evaluation minus PAIRED_TOLERANCE.
MIN_WEAK_RISE, MIN_STRONG_RATIO, PAIRED_TOLERANCE = 0.3, 0.85, 0.03
PAIRED_KEYS = ("success_strong_min", "success_overall", "success_weak", "later_solved_gap")


def paired(rows: list[dict], arm: str = "sgt", control: str = "none") -> list[dict]:
    """Per policy, the seed-paired differences ``arm - control`` of :data:`PAIRED_KEYS` (mean, 95% interval).

    Paired on the seed: both runs start from the same warm-start and see the same data order,
    so the difference removes what the seed does to both (GRPO's own dips of the strong part).

    Returns:
        One row per policy: ``seeds`` (paired), per key ``<key>_diff`` and ``<key>_diff_ci95``,
        ``<key>_diff_min`` (the smallest difference over the seeds).
    """
    out = []
    for policy in dict.fromkeys(r["policy"] for r in rows if r["arm"] == arm):
        mine = {r["seed"]: r for r in rows if r["arm"] == arm and r["policy"] == policy}
        theirs = {r["seed"]: r for r in rows if r["arm"] == control and r["policy"] == policy}
        seeds = sorted(set(mine) & set(theirs))
        if not seeds:
            continue
        row = {"policy": policy, "seeds": len(seeds)}
        for key in PAIRED_KEYS:
            diffs = [mine[s][key] - theirs[s][key] for s in seeds]
            row[f"{key}_diff"], row[f"{key}_diff_ci95"] = mean_ci(diffs)
            finite = [d for d in diffs if not math.isnan(d)]
            row[f"{key}_diff_min"] = min(finite) if finite else math.nan
        out.append(row)
    return out


def summarize(rows: list[dict], out: Path, meta: dict) -> list[dict]:
    """Write runs.csv, summary.csv and summary.md; return the summary rows."""
    with open(out / "runs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        for policy in dict.fromkeys(r["policy"] for r in rows if r["arm"] == arm):
            group = [r for r in rows if r["arm"] == arm and r["policy"] == policy]
            row = {"arm": arm, "policy": policy, "seeds": len(group)}
            for key in SUMMARY_KEYS:
                row[key], row[f"{key}_ci95"] = mean_ci([r[key] for r in group])
            summary.append(row)
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(summary[0]))
        writer.writeheader()
        writer.writerows(summary)

    def cell(row, key, digits=3):
        mean, half = row[key], row[f"{key}_ci95"]
        if math.isnan(mean):
            return "-"
        return f"{mean:.{digits}f}" + ("" if math.isnan(half) else f" ± {half:.{digits}f}")

    lines = [f"Probe comparison: {meta['command']}", "",
             f"{meta['steps']} steps, seeds {meta['seeds']}, wall time {meta['wall_s'] / 60:.1f} min. "
             "Mean ± 95% interval over seeds (Student t). Success = eval/<p>/success_* (mean of 8 sampled completions per held-out prompt) at the "
             "last step; update variance = variance across steps of train/<p>/grad_norm; THL moved = share "
             "of log-prob mass split inside chunks (PRP only).", "",
             "| arm | policy | seeds | success overall | success weak | success strong | update variance "
             "| THL moved | THL boundary agr. | PRP ESS |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        lines.append(f"| {r['arm']} | {r['policy']} | {r['seeds']} | {cell(r, 'success_overall')} | "
                     f"{cell(r, 'success_weak')} | {cell(r, 'success_strong')} | {cell(r, 'update_variance', 4)} | "
                     f"{cell(r, 'thl_mass_moved')} | {cell(r, 'thl_boundary_agreement')} | {cell(r, 'prp_ess')} |")
    lines += ["", "Each part over training (sampled success, held-out prompts): start (step 0), minimum over "
              "every evaluation, end; mean ± 95% interval over seeds.", "",
              "| arm | policy | weak start | weak min | weak end | weak rise | strong start | strong min | "
              "strong end | strong min / start | SGT grad share |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        lines.append(f"| {r['arm']} | {r['policy']} | {cell(r, 'success_weak_start')} | {cell(r, 'success_weak_min')} | "
                     f"{cell(r, 'success_weak')} | {cell(r, 'weak_rise')} | {cell(r, 'success_strong_start')} | "
                     f"{cell(r, 'success_strong_min')} | {cell(r, 'success_strong')} | "
                     f"{cell(r, 'strong_min_ratio', 2)} | {cell(r, 'sgt_grad_share', 2)} |")
    lines += ["", "The control for rescue: of the weak-part prompts drawn again in a later epoch, the share "
              "the policy's own group solved, for those rescued before (SGT; under none: those SGT would "
              "have rescued, own group failing while a peer succeeded) and for the others; the gap is "
              "rescued minus not rescued. Mean ± 95% interval over seeds.", "",
              "| arm | policy | later solved, rescued | later solved, not rescued | gap |", "|---|---|---|---|---|"]
    for r in summary:
        lines.append(f"| {r['arm']} | {r['policy']} | {cell(r, 'later_solved_rescued')} | "
                     f"{cell(r, 'later_solved_not_rescued')} | {cell(r, 'later_solved_gap')} |")
    arms = [a for a in dict.fromkeys(r["arm"] for r in rows) if a != "none"]
    if "none" in {r["arm"] for r in rows} and arms:
        lines += ["", "Paired on the seed, each arm minus none (mean ± 95% interval; smallest over seeds): the "
                  "strong part's lowest evaluation, the overall and weak-part success at the end, and the rescue "
                  "gap above.", "", "| arm | policy | seeds | strong lowest, diff | overall end, diff | "
                  "weak end, diff | rescue gap, diff |", "|---|---|---|---|---|---|---|"]
        for arm in arms:
            for r in paired(rows, arm):
                cells = [f"{r[f'{k}_diff']:+.3f} ± {r[f'{k}_diff_ci95']:.3f} (min {r[f'{k}_diff_min']:+.3f})"
                         if not math.isnan(r[f"{k}_diff_ci95"]) else f"{r[f'{k}_diff']:+.3f}" for k in PAIRED_KEYS]
                lines.append(f"| {arm} | {r['policy']} | {r['seeds']} | " + " | ".join(cells) + " |")
    for arm in [a for a in arms if a.startswith("sgt")]:
        lines += ["", *requirement_lines(rows, summary, arm=arm)]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return summary


def requirement_lines(rows: list[dict], summary: list[dict], arm: str = "sgt", control: str = "none") -> list[str]:
    """PASS / FAIL lines for what the default must show under ``arm`` against ``control``.

    Per policy: every seed's weak part rises by >= :data:`MIN_WEAK_RISE` (end - start); every
    seed's strong part stays >= :data:`MIN_STRONG_RATIO` x its start at every evaluation; the
    95% intervals over seeds of the final weak part under ``arm`` and ``control`` do not overlap.
    Each line gives the margin (how far from the threshold), so a miss says by how much.
    """
    by = {(r["arm"], r["policy"]): r for r in summary}
    out = [f"Requirements ({arm} against {control}):", ""]
    for policy in dict.fromkeys(r["policy"] for r in summary if r["arm"] == arm):
        mine = [r for r in rows if r["arm"] == arm and r["policy"] == policy]
        if not mine:
            continue
        rise = min(r["weak_rise"] for r in mine)
        ratio = min(r["strong_min_ratio"] for r in mine)
        out.append(f"- {policy}: weak rise >= {MIN_WEAK_RISE} on every seed: "
                   f"{'PASS' if rise >= MIN_WEAK_RISE else 'FAIL'} (smallest {rise:.3f}, margin {rise - MIN_WEAK_RISE:+.3f}; "
                   f"mean {by[(arm, policy)]['weak_rise']:.3f})")
        out.append(f"- {policy}: strong >= {MIN_STRONG_RATIO} x start at every evaluation, every seed: "
                   f"{'PASS' if ratio >= MIN_STRONG_RATIO else 'FAIL'} (smallest min/start {ratio:.3f}, margin "
                   f"{ratio - MIN_STRONG_RATIO:+.3f}; not paired: {control}'s own dips count against it)")
        pair = next((r for r in paired(rows, arm, control) if r["policy"] == policy), None)
        if pair is not None:
            worst = pair["success_strong_min_diff_min"]
            out.append(f"- {policy}: strong part's lowest evaluation no worse than {control}'s on the same seed "
                       f"(paired, within {PAIRED_TOLERANCE}): {'PASS' if worst >= -PAIRED_TOLERANCE else 'FAIL'} "
                       f"(worst seed {worst:+.3f}, margin {worst + PAIRED_TOLERANCE:+.3f})")
        if (control, policy) in by:
            a, c = by[(arm, policy)], by[(control, policy)]
            lo_a = a["success_weak"] - (0 if math.isnan(a["success_weak_ci95"]) else a["success_weak_ci95"])
            hi_c = c["success_weak"] + (0 if math.isnan(c["success_weak_ci95"]) else c["success_weak_ci95"])
            out.append(f"- {policy}: final weak part, {arm} interval above {control} interval: "
                       f"{'PASS' if lo_a > hi_c else 'FAIL'} ({arm} lower end {lo_a:.3f}, {control} upper end {hi_c:.3f}, "
                       f"gap {lo_a - hi_c:+.3f})")
    return out


def plot(summary: list[dict], curves: dict, out: Path) -> Path:
    """Bar chart of final weak-part success, and weak/strong success over steps (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(dict.fromkeys(r["arm"] for r in summary))
    policies = list(dict.fromkeys(r["policy"] for r in summary))
    fig, axes = plt.subplots(1, 1 + len(policies), figsize=(5 * (1 + len(policies)), 4))
    width = 0.8 / max(len(policies), 1)
    for k, policy in enumerate(policies):
        rows = {r["arm"]: r for r in summary if r["policy"] == policy}
        means = [rows[a]["success_weak"] if a in rows else math.nan for a in arms]
        errs = [0.0 if a not in rows or math.isnan(rows[a]["success_weak_ci95"]) else rows[a]["success_weak_ci95"]
                for a in arms]
        axes[0].bar([i + k * width for i in range(len(arms))], means, width, yerr=errs, capsize=3, label=policy)
    axes[0].set_xticks([i + width * (len(policies) - 1) / 2 for i in range(len(arms))], arms)
    axes[0].set_ylabel("final success, weak part (8 samples per prompt)")
    axes[0].set_title("weak part (mean, 95% interval)")
    axes[0].legend()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, policy in zip(axes[1:], policies):
        for i, arm in enumerate(arms):
            for part, style in (("weak", "-"), ("strong", ":")):
                runs = [c[part] for (a, p, _), c in curves.items() if a == arm and p == policy and c[part]]
                if not runs:
                    continue
                steps = [s for s, _ in runs[0]]
                stats = [mean_ci([run[j][1] for run in runs if j < len(run)]) for j in range(len(steps))]
                mean = [m for m, _ in stats]
                color = colors[i % len(colors)]
                ax.plot(steps, mean, style, marker="o", markersize=3, color=color, label=f"{arm} ({part})")
                if len(runs) > 1:  # 95% interval over seeds
                    ax.fill_between(steps, [m - h for m, h in stats], [m + h for m, h in stats], color=color,
                                    alpha=0.15, linewidth=0)
                if part == "strong" and arm == "sgt":  # the stability floor: 0.85 x the start
                    ax.axhline(MIN_STRONG_RATIO * mean[0], color=color, linewidth=0.8, linestyle="--", alpha=0.6)
        ax.set_title(f"{policy}: success over training (8 samples per prompt)")
        ax.set_xlabel("step")
        ax.set_ylabel("success (mean over seeds, 95% band)")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "probes.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500, help="training steps per run (default.yaml runs 2500)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seed_everything values")
    parser.add_argument("--arms", nargs="+", default=["none", "prp", "xgrpo", "sgt"], choices=sorted(ARMS))
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "probes", help="output folder")
    parser.add_argument("--parallel", type=int, default=2, help="runs at once (one thread each)")
    parser.add_argument("--eval-every", type=int, default=None, help="eval period; default steps // 5")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "default.yaml")
    parser.add_argument("--timeout-s", type=float, default=None, help="kill a run after this long")
    parser.add_argument("--placement", choices=["colocated", "disjoint"], default="colocated",
                        help="disjoint: each policy in its own process (2 processes a run; use --parallel 1)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.parallel < 1:
        parser.error(f"--steps={args.steps} and --parallel={args.parallel} must be >= 1.")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    eval_every = args.eval_every or max(1, args.steps // 5)
    start = time.perf_counter()
    jobs = []
    for seed in args.seeds:  # seed-major, so a partial run still covers every arm
        for arm in args.arms:
            run_dir = out / "runs" / arm / f"seed{seed}"
            if (run_dir / "done.json").is_file():
                print(f"skip {arm}/seed{seed}: done.json exists")
                continue
            cmd = fit_command(args.config, arm_snippet(arm, out), seed, args.steps, eval_every, run_dir,
                              args.placement)
            jobs.append({"name": f"{arm}/seed{seed}", "dir": run_dir, "cmd": cmd})
    if jobs:  # build (or find) the cached warm-start once, before runs race to build it
        warm = out / "warm_start"
        run_all([{"name": "warm-start", "dir": warm,
                  "cmd": fit_command(args.config, REPO / "callbacks" / "none.yaml", 0, 1, 1, warm)}], 1, None)
        run_all(jobs, args.parallel, args.timeout_s)
    rows, curves = [], {}
    for arm in args.arms:
        for seed in args.seeds:
            finals, parts = read_run(out / "runs" / arm / f"seed{seed}")
            for policy, values in finals.items():
                rows.append({"arm": arm, "seed": seed, "policy": policy, **values})
                curves[(arm, policy, seed)] = parts[policy]
    meta = {"command": "python benchmarks/probes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "steps": args.steps, "seeds": args.seeds, "wall_s": time.perf_counter() - start}
    summary = summarize(rows, out, meta)
    figure = plot(summary, curves, out)
    print((out / "summary.md").read_text())
    print(f"Wrote {out / 'runs.csv'}, {out / 'summary.csv'}, {out / 'summary.md'}, {figure} "
          f"in {meta['wall_s'] / 60:.1f} min.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
