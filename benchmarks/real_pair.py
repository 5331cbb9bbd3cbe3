"""What the real pair learns: configs/real_small.yaml under SGT and under none, same seed (docs/real_models.md).

    python benchmarks/real_pair.py --steps 60 --out runs/real_pair
    python benchmarks/real_pair.py --steps 60 --arms none sgt prp xgrpo --seeds 0 1 2 --drop-checkpoints \
        --out runs/real_arms -- --trainer.precision 32-true     # the paired study (docs/results.md)
    python benchmarks/real_pair.py --steps 2 --arms sgt --out /tmp/real_pair_smoke     # a smoke run

Runs ``mrl fit --config configs/real_small.yaml`` (SmolLM2-135M-Instruct and Gemma 3 270M,
two worker processes) for ``--steps`` steps once per arm and seed, one run after the other,
seed by seed (so that the arms of a seed are done together; time them alone on the machine):
``sgt`` is the config as shipped, ``none``, ``prp`` and ``xgrpo`` stack ``callbacks/<arm>.yaml``
on it. With one seed a run lands in ``<out>/<arm>/run``, with several in
``<out>/<arm>/seed<k>``; ``--drop-checkpoints`` deletes a finished run's ``checkpoints/``
(4.6 GB of this pair; the events stay). A run already finished (its ``done`` marker) is
not run again and one stopped part-way starts over, so the command resumes a study that was stopped. Extra ``mrl fit`` arguments
go after ``--``. Then reads each run's TensorBoard events and writes ``summary.md`` /
``summary.json`` (printed too), per arm, seed and policy (the comparison over seeds with
intervals is ``benchmarks/real_arms.py``):

- greedy success on the held-out prompts of each part at the first and last evaluation
  (``eval/<p>/greedy_success_<part>``);
- what SGT moved: transfers received (``probe/sgt/<p>/transfers``, summed over steps; a
  policy receives its peer's verified successes), rescue-set sizes, the NLL of the
  transferred demos, the transfer's share of the update (mean and largest ``grad_share``,
  the bound), how many logged steps had a GRPO gradient of 0 (``grpo_grad_norm_min``: the
  strict bound then drops the transfer), and THL's residual on them (``thl/sgt/<p>/...``:
  boundary agreement, tokens per chunk, log-prob mass moved, round-trip failures);
- rewards of the step's rollouts (``rollout/<p>/reward_mean``, first and last tenth of steps);
- cost: seconds per step (``train/step_time_s``), each worker's peak memory
  (``mwra/<p>/peak_memory_gib``), SGT's own seconds (``aux_loss_time_s`` + ``compose_time_s``)
  against the step, and the wall time of ``mrl fit``.

Not a test: it needs the ``real`` extra and SmolLM2's package (docs/real_models.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARMS = {"sgt": [], **{arm: ["--config", str(REPO / "callbacks" / f"{arm}.yaml")] for arm in ("none", "prp", "xgrpo")}}
THL_KEYS = ("boundary_agreement", "tokens_per_chunk", "logprob_mass_moved", "round_trip_failures")


def run_arm(arm: str, steps: int, out: Path, extra: list[str], seed: int | None = None,
            version: str = "run") -> float:
    """``mrl fit`` of one arm (at ``seed``; None = the config's); returns its wall time in seconds."""
    seeded = [] if seed is None else ["--seed_everything", str(seed)]
    cmd = [sys.executable, "-m", "mrl_lightning.cli", "fit", "--config", str(REPO / "configs" / "real_small.yaml"),
           *ARMS[arm], *seeded, "--trainer.max_steps", str(steps), "--trainer.default_root_dir", str(out / arm),
           "--trainer.version", version, "--trainer.enable_progress_bar", "false", *extra]
    label = arm if seed is None else f"{arm} seed {seed}"
    print(f"[{label}] {' '.join(cmd[3:])}", flush=True)
    t0 = time.perf_counter()
    log_path = out / f"{arm}.log" if seed is None else out / f"{arm}_{version}.log"
    with open(log_path, "w") as log:
        code = subprocess.call(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                               env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    if code:
        raise SystemExit(f"[{label}] mrl fit failed ({code}); see {log_path}")
    return time.perf_counter() - t0


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _mean(values) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def summarize_arm(s: dict, policies: list[str], parts: list[str]) -> dict:
    """Per policy: the numbers of the module docstring from one run's scalars."""
    out = {}
    steps = [v for _, v in s.get("train/step_time_s", [])]
    for p in policies:
        row = {}
        for part in parts:
            curve = s.get(f"eval/{p}/greedy_success_{part}", [])
            row[f"greedy_{part}"] = (curve[0][1], curve[-1][1]) if curve else (math.nan, math.nan)
        rewards = [v for _, v in s.get(f"rollout/{p}/reward_mean", [])]
        tenth = max(1, len(rewards) // 10)
        row["reward_first_last_tenth"] = (_mean(rewards[:tenth]), _mean(rewards[-tenth:]))
        sgt = f"probe/sgt/{p}/"
        row["transfers_received"] = sum(v for _, v in s.get(sgt + "transfers", []))
        row["rescue_set_mean"] = _mean([v for _, v in s.get(sgt + "rescue_set_size", [])])
        row["demo_nll_nats"] = _mean([v for _, v in s.get(sgt + "nll_nats", [])])
        row["grad_share_mean"] = _mean([v for _, v in s.get(sgt + "grad_share", [])])
        row["grad_share_max"] = max((v for _, v in s.get(sgt + "grad_share_max", [])), default=math.nan)
        row["grad_share_bound"] = max((v for _, v in s.get(sgt + "grad_share_bound", [])), default=math.nan)
        row["steps_grpo_grad_0"] = sum(1 for _, v in s.get(sgt + "grpo_grad_norm_min", []) if v == 0.0)
        row["steps_with_transfer"] = len(s.get(sgt + "grad_share", []))
        for key in THL_KEYS:
            row[f"thl_{key}"] = _mean([v for _, v in s.get(f"thl/sgt/{p}/{key}", [])])
        own = [a + c for (_, a), (_, c) in zip(s.get(f"train/{p}/aux_loss_time_s", []),
                                              s.get(f"train/{p}/compose_time_s", []))]
        row["sgt_own_s_per_step"] = _mean(own)
        row["peak_memory_gib"] = max((v for _, v in s.get(f"mwra/{p}/peak_memory_gib", [])), default=math.nan)
        out[p] = row
    out["_step_time_s"] = _mean(steps)
    out["_exchange_time_s"] = _mean([v for _, v in s.get("train/exchange_time_s", [])])
    return out


def table(summary: dict, policies: list[str], parts: list[str]) -> str:
    lines = ["| arm | policy | " + " | ".join(f"greedy {part}: start -> end" for part in parts)
             + " | reward (first / last tenth) | transfers received | grad_share mean / max (bound) "
             "| steps with GRPO grad 0 | THL boundary agr. / moved | SGT own s (of step s) | peak GiB |",
             "|---" * (9 + len(parts)) + "|"]
    for arm, res in summary.items():
        if arm.startswith("_"):
            continue
        for p in policies:
            r = res[p]
            cells = [f"{r[f'greedy_{part}'][0]:.2f} -> {r[f'greedy_{part}'][1]:.2f}" for part in parts]
            lines.append(
                f"| {arm} | {p} | " + " | ".join(cells)
                + f" | {r['reward_first_last_tenth'][0]:.3f} / {r['reward_first_last_tenth'][1]:.3f}"
                + f" | {r['transfers_received']:.0f} | {r['grad_share_mean']:.3f} / {r['grad_share_max']:.3f}"
                  f" ({r['grad_share_bound']:.2f})"
                + f" | {r['steps_grpo_grad_0']} of {r['steps_with_transfer']}"
                + f" | {r['thl_boundary_agreement']:.3f} / {r['thl_logprob_mass_moved']:.3f}"
                + f" | {r['sgt_own_s_per_step']:.2f} ({res['_step_time_s']:.1f})"
                + f" | {r['peak_memory_gib']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps per arm")
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=["sgt", "none"])
    parser.add_argument("--seeds", nargs="+", type=int, default=None,
                        help="seeds (seed_everything); default: the config's, into <out>/<arm>/run")
    parser.add_argument("--drop-checkpoints", action="store_true", help="delete a finished run's checkpoints/")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "real_pair")
    parser.add_argument("--summarize-only", action="store_true", help="read the runs already in --out")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import yaml

    cfg = yaml.safe_load((REPO / "configs" / "real_small.yaml").read_text())
    policies = [p["init_args"]["name"] for p in cfg["model"]["policies"]]
    parts = [part["name"] for part in cfg["data"]["init_args"]["parts"]]
    walls = json.loads((args.out / "walls.json").read_text()) if (args.out / "walls.json").exists() else {}
    runs = [(arm, None, "run") for arm in args.arms] if args.seeds is None else \
        [(arm, seed, f"seed{seed}") for seed in args.seeds for arm in args.arms]
    for arm, seed, version in runs:
        label = arm if seed is None else f"{arm}/{version}"
        done = args.out / arm / version / "done"
        if args.summarize_only or done.exists():
            continue
        shutil.rmtree(done.parent, ignore_errors=True)  # a run stopped part-way starts over (it is deterministic)
        walls[label] = round(run_arm(arm, args.steps, args.out, extra, seed, version), 1)
        (args.out / "walls.json").write_text(json.dumps(walls))
        if args.drop_checkpoints:
            shutil.rmtree(args.out / arm / version / "checkpoints", ignore_errors=True)
        done.write_text(f"{walls[label]}\n")
    summary = {}
    for arm, seed, version in runs:
        label = arm if seed is None else f"{arm}/{version}"
        summary[label] = summarize_arm(scalars(args.out / arm / version), policies, parts)
        summary[label]["_wall_s"] = walls.get(label, math.nan)
    text = table(summary, policies, parts)
    walls_line = ", ".join(f"{label} {res['_wall_s']:.0f} s (exchange {res['_exchange_time_s']:.2f} s "
                           "a step)" for label, res in summary.items())
    (args.out / "summary.md").write_text(f"steps {args.steps}; wall: {walls_line}\n\n{text}\n")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"steps {args.steps}; wall: {walls_line}\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
