"""SGT arms on the embedded default: what keeps the strong part while the weak part rises (docs/probes.md). Not a test.

Each arm is ``configs/default.yaml`` with the SGT callback list and a few overrides (SGT
options, policy options by policy name), written to ``<out>/configs/<arm>.yaml`` and run
with ``mrl fit`` for every seed, one run at a time. Read from every run's TensorBoard
events, per arm and policy: sampled success on the held-out prompts of the weak and strong
part at the start, its minimum over the evaluations and at the end (``eval/<p>/success_*``),
and the transfer term's share of the gradient (``probe/sgt/<p>/grad_share``, mean over the
first 100 steps and over the run). Written: ``arms.csv`` (one row per arm, seed, policy),
``arms.md`` (the table), printed at the end.

Selection uses the training rollouts and these numbers on the held-out prompts are only
reported: the arms are compared on screening runs, the default is then checked on more seeds
with ``benchmarks/probes.py``.

The same runs are also summarized as ``benchmarks/probes.py`` does (``summary.md``: each arm
paired with ``none`` on the seed, the requirements, the control for rescue).

Usage::

    python benchmarks/sgt_arms.py --arms sgt_old none --steps 400 --eval-every 50 --out runs/sgt_arms
    python benchmarks/sgt_arms.py --arms none sgt_default sgt_sched sgt_adapt --seeds 0 1 2 --steps 2500 \
        --eval-every 100 --parallel 2 --out runs/sgt_arms_full
    python benchmarks/sgt_arms.py --list
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probes import REPO, mean_ci, read_run, run_all, summarize  # noqa: E402

SGT_CLASS = "mrl_lightning.callbacks.SuccessGatedTransfer"
# The SGT settings of configs/default.yaml before this study (lambda 0.3 / 1.0, kappa 0.5).
OLD = {"lambda_sgt": 0.3, "lambda_per_policy": {"llama": 1.0}, "kappa": 0.5}
WARMUP = {"warmup_steps": 100}
# The SGT settings the moving-bound arms start from (callbacks/sgt.yaml without its bound).
SGT_DEFAULT = {"lambda_sgt": 0.3, "lambda_per_policy": {"llama": 1.0}, "kappa": 0.5, "advantage_plus": 1.0,
               "max_transfers_per_prompt": 1, "max_staleness": None, "receivers": None, "transfer_mode": "nll"}
WU_KL = {"warmup_steps": 100, "beta": 0.1}
# arm -> {"probe": callbacks snippet, "sgt": SGT init_args (replacing the config's), "policies": {name: init_args}}
ARMS: dict[str, dict] = {
    "none": {"probe": "none.yaml"},
    "sgt_old": {"sgt": OLD},
    "sgt_default": {},  # whatever configs/default.yaml says now (= sgt_sched)
    # the default before the schedule: the share bounded at 0.3 throughout
    "sgt_fixed30": {"sgt": {**SGT_DEFAULT, "max_grad_share": 0.3}},
    # the transfer term's share of the gradient, bounded
    "sgt_share50": {"sgt": {**OLD, "max_grad_share": 0.5}},
    "sgt_share30": {"sgt": {**OLD, "max_grad_share": 0.3}},
    # its scale, lowered ten-fold (a constant, not a bound)
    "sgt_lam_tenth": {"sgt": {**OLD, "lambda_sgt": 0.03, "lambda_per_policy": {"llama": 0.1}}},
    # a KL anchor to the warm-started model (k3, TRL beta)
    "sgt_kl": {"sgt": OLD, "policies": {"gpt2": {"beta": 0.1}, "llama": {"beta": 0.1}}},
    # half the learning rates
    "sgt_lr_half": {"sgt": OLD, "policies": {"gpt2": {"learning_rate": 1.5e-4}, "llama": {"learning_rate": 1.0e-4}}},
    # a linear learning-rate warm-up (100 optimizer steps), with and without sharing
    "none_wu": {"probe": "none.yaml", "policies": {"gpt2": WARMUP, "llama": WARMUP}},
    "sgt_share30_wu": {"sgt": {**OLD, "max_grad_share": 0.3}, "policies": {"gpt2": WARMUP, "llama": WARMUP}},
    # transfers as extra samples of their prompt's GRPO group (verified reward, group advantages)
    "sgt_group": {"sgt": {"lambda_sgt": 1.0, "kappa": 0.5, "transfer_mode": "group"}},
    # bound + warm-up + a KL anchor to the warm-started model, and the same policies without sharing
    "sgt_s30_wu_kl": {"sgt": {**OLD, "max_grad_share": 0.3}, "policies": {"gpt2": WU_KL, "llama": WU_KL}},
    "none_wu_kl": {"probe": "none.yaml", "policies": {"gpt2": WU_KL, "llama": WU_KL}},
    # faster weak-part learning under the bound: a higher bound, twice the learning rates
    "sgt_s50_wu": {"sgt": {**OLD, "max_grad_share": 0.5}, "policies": {"gpt2": WARMUP, "llama": WARMUP}},
    "sgt_s30_wu_lr2": {"sgt": {**OLD, "max_grad_share": 0.3},
                       "policies": {"gpt2": {**WARMUP, "learning_rate": 6.0e-4},
                                    "llama": {**WARMUP, "learning_rate": 4.0e-4}}},
    # bounds that move (mrl_lightning/probes/sgt.py ShareBound), on the default's settings: a
    # schedule from 0.3 to 0.6 over the first 1,500 steps, and a bound that stays at 0.6 while the
    # receiver's strong-part rollouts hold and falls to 0.2 when they drop by 10% of their best
    # over the first 100 steps (moving average, rate 0.05)
    "sgt_sched": {"sgt": {**SGT_DEFAULT, "max_grad_share": 0.3, "max_grad_share_final": 0.6,
                          "max_grad_share_ramp_steps": 1500}},
    "sgt_adapt": {"sgt": {**SGT_DEFAULT, "max_grad_share": 0.6, "max_grad_share_low": 0.2, "adaptive_drop": 0.1,
                          "adaptive_ema": 0.05, "adaptive_reference_steps": 100}},
}


def merge(target: dict, overrides: dict) -> dict:
    """``overrides`` into ``target`` in place, dicts merged key by key (e.g. ``model: {init_args: {...}}``)."""
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
    return target


def arm_config(arm: str, base: Path, out: Path) -> Path:
    """``base`` with ``arm``'s callbacks and overrides, written to ``out/configs/<arm>.yaml``."""
    spec = ARMS[arm]
    config = yaml.safe_load(base.read_text())
    if "probe" in spec or "sgt" in spec:  # sgt_default keeps the base config's own callbacks (its per-policy SGT values)
        snippet = yaml.safe_load((REPO / "callbacks" / spec.get("probe", "sgt.yaml")).read_text())
        config["trainer"]["callbacks"] = copy.deepcopy(snippet["trainer"]["callbacks"])
    if "sgt" in spec:
        for cb in config["trainer"]["callbacks"]:
            if cb["class_path"] == SGT_CLASS:
                cb["init_args"] = dict(spec["sgt"])
    for policy in config["model"]["policies"]:
        merge(policy["init_args"], spec.get("policies", {}).get(policy["init_args"]["name"], {}))
    path = out / "configs" / f"{arm}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def fit_command(config: Path, seed: int, steps: int, eval_every: int, run_dir: Path, placement: str,
                threads: int = 2) -> list[str]:
    """``mrl fit`` for one run: logging every step, checkpoint only at the end."""
    mrl = Path(sys.executable).with_name("mrl")
    cmd = [str(mrl), "fit", "--config", str(config), "--seed_everything", str(seed),
           "--trainer.max_steps", str(steps), "--trainer.eval_every_n_steps", str(eval_every),
           "--trainer.log_every_n_steps", "1", "--trainer.checkpoint_every_n_steps", "0",
           "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run_dir),
           "--trainer.version", "0"]
    if placement == "disjoint":  # one process per policy, one thread each
        return cmd + ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.placement", "disjoint",
                      "--trainer.num_threads", "1"]
    return cmd + ["--trainer.devices", "1", "--trainer.placement", "colocated", "--trainer.num_threads", str(threads)]


def read_arm_run(run_dir: Path) -> dict[str, dict[str, float]]:
    """Per policy: weak/strong success at start, minimum, end; grad share; transfers."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])

    def values(tag):
        return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in tags else []

    def mean(xs):
        return sum(xs) / len(xs) if xs else math.nan

    out = {}
    for p in sorted({t.split("/")[1] for t in tags if t.startswith("eval/")}):
        row = {}
        for part in ("weak", "strong"):
            curve = values(f"eval/{p}/success_{part}")
            ys = [v for _, v in curve]
            row[f"{part}_start"], row[f"{part}_min"], row[f"{part}_end"] = (
                (ys[0], min(ys), ys[-1]) if ys else (math.nan,) * 3)
            row[f"{part}_min_step"] = curve[ys.index(min(ys))][0] if ys else math.nan
            row[f"{part}_curve"] = " ".join(f"{v:.2f}" for v in ys)
        share = values(f"probe/sgt/{p}/grad_share")
        row["grad_share_first100"] = mean([v for s, v in share if s <= 100])
        row["grad_share_mean"] = mean([v for _, v in share])
        row["transfers_per_step"] = mean([v for _, v in values(f"probe/sgt/{p}/transfers")])
        row["grad_norm_mean"] = mean([v for _, v in values(f"train/{p}/grad_norm")])
        out[p] = row
    return out


KEYS = ("weak_start", "weak_min", "weak_end", "strong_start", "strong_min", "strong_end", "grad_share_first100",
        "grad_share_mean", "transfers_per_step")


def table(rows: list[dict], meta: dict) -> str:
    """Markdown: per arm and policy, mean (± 95% interval over seeds when > 1) of :data:`KEYS`."""
    lines = [f"SGT arms: {meta['command']}", "",
             f"{meta['steps']} steps, seeds {meta['seeds']}, eval every {meta['eval_every']}, wall time "
             f"{meta['wall_s'] / 60:.1f} min. Sampled success on held-out prompts (8 samples per prompt); "
             "strong_min / strong_start >= 0.85 is the stability requirement.", "",
             "| arm | policy | seeds | weak start | weak min | weak end | strong start | strong min | strong end "
             "| strong min/start | grad share (first 100) | grad share (mean) | transfers/step |",
             "|" + "---|" * 13]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        for p in dict.fromkeys(r["policy"] for r in rows if r["arm"] == arm):
            group = [r for r in rows if r["arm"] == arm and r["policy"] == p]
            cells = []
            for key in KEYS:
                m, h = mean_ci([r[key] for r in group])
                cells.append("-" if math.isnan(m) else f"{m:.3f}" + ("" if math.isnan(h) else f" ± {h:.3f}"))
            ratio = mean_ci([r["strong_min"] / r["strong_start"] for r in group])[0]
            lines.append(f"| {arm} | {p} | {len(group)} | " + " | ".join(cells[:6]) + f" | {ratio:.2f} | "
                         + " | ".join(cells[6:]) + " |")
    lines += ["", "Curves (weak / strong, every evaluation):", ""]
    for r in rows:
        lines.append(f"- {r['arm']} seed {r['seed']} {r['policy']}: weak {r['weak_curve']} | strong {r['strong_curve']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=["none", "sgt_default"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--placement", choices=["disjoint", "colocated"], default="disjoint",
                        help="disjoint: one process per policy, one thread each (2 cores)")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "default.yaml")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "sgt_arms")
    parser.add_argument("--parallel", type=int, default=1,
                        help="runs at once; > 1 runs each colocated in one process with one thread (2 cores: 2)")
    parser.add_argument("--list", action="store_true", help="print the arms and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, spec in ARMS.items():
            print(f"{name}: {spec}")
        return 0
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        parser.error(f"--arms {unknown} unknown; valid: {sorted(ARMS)} (--list shows them).")
    out = args.out.resolve()
    start = time.perf_counter()
    jobs = []
    for seed in args.seeds:
        for arm in args.arms:
            run_dir = out / "runs" / arm / f"seed{seed}"
            if (run_dir / "done.json").is_file():
                print(f"skip {arm}/seed{seed}: done.json exists")
                continue
            placement = "colocated" if args.parallel > 1 else args.placement
            cmd = fit_command(arm_config(arm, args.config, out), seed, args.steps, args.eval_every, run_dir,
                              placement, threads=1 if args.parallel > 1 else 2)
            jobs.append({"name": f"{arm}/seed{seed}", "dir": run_dir, "cmd": cmd})
    run_all(jobs, args.parallel, None)
    rows = []
    for arm in args.arms:
        for seed in args.seeds:
            for policy, values in read_arm_run(out / "runs" / arm / f"seed{seed}").items():
                rows.append({"arm": arm, "seed": seed, "policy": policy, **values})
    meta = {"command": "python benchmarks/sgt_arms.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "steps": args.steps, "seeds": args.seeds, "eval_every": args.eval_every,
            "wall_s": time.perf_counter() - start}
    with open(out / "arms.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    text = table(rows, meta)
    (out / "arms.md").write_text(text)
    print(text)
    # The same runs through probes.py's summary: paired criterion against none, the control for rescue.
    probe_rows = [{"arm": "sgt" if arm == "sgt_default" else arm, "seed": seed, "policy": policy, **values}
                  for arm in args.arms for seed in args.seeds
                  for policy, values in read_run(out / "runs" / arm / f"seed{seed}")[0].items()]
    summarize(probe_rows, out, meta)
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
