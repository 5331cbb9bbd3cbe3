"""GPU check: the GPU path end to end on small local models, with timings, memory and sanity checks.

    bash scripts/gpu_check.sh            # or: .venv/bin/python scripts/gpu_check.py --out runs/gpu_check

For a GPU owner, on a machine with at least one CUDA device, from the repository root
after the README's install command. It installs nothing and needs no hub: the policies
are the two tiny local models of ``configs/gsm8k_tiny.yaml`` (GPT-2 / byte-level BPE and
Llama / SentencePiece-style BPE, built from configs by the recipe) on the GSM8K / MATH500
samples shipped in ``tests/data_samples``, with math-verify rewards and SGT: the same
data, templates, verifier and probe as ``configs/gsm8k_math_qwen_llama.yaml``. It runs,
for ``--steps`` steps each, in ``bf16-mixed``:

1. one GPU, colocated (both policies on GPU 0, in turn);
2. with two GPUs or more: one policy per GPU (``--trainer.devices 2 --trainer.strategy ddp
   --trainer.placement disjoint``);
3. where ``vllm`` is importable: the vLLM rollout engine check (``scripts/gpu_check_vllm.py``);
4. chat stops on every engine (HF generate, vLLM colocated, vLLM server on a second GPU) and
   ``configs/three_families.yaml`` on each engine (``scripts/gpu_check_chat.py``).

Never run on a GPU (no GPU was available while it was written): this script and every check
it calls. Their logic ran on a CPU only: ``--dry-run-on-cpu``, the vLLM check and the chat
stops against vLLM's CPU build and the double (tests/rollout/test_gpu_check_script.py,
tests/real_vllm). Estimated at under 10 minutes on one GPU, not measured.

It prints the resource plan (in each run's log), step time, per worker and phase the
seconds (``mwra/<policy>/rollout_s``, ``update_s``, ``wait_s``), rollout tokens per
second and the CUDA allocator's peak memory, and exits non-zero when a check fails: a
run that does not finish, or an importance ratio at the first update away from 1 by more
than ``--ratio-tolerance`` (sampling and training must score with the same weights and
precision).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from mwra import mean, read, seconds_per_step  # noqa: E402  (benchmarks/mwra.py)


def fit(out: Path, name: str, steps: int, extra: list[str], accelerator: str = "cuda",
        precision: str = "bf16-mixed") -> Path | None:
    args = [sys.executable, "-m", "mrl_lightning.cli", "fit", "--config", str(REPO / "configs" / "gsm8k_tiny.yaml"),
            "--trainer.accelerator", accelerator, "--trainer.precision", precision, "--trainer.max_steps", str(steps),
            "--trainer.eval_every_n_steps", str(steps + 1), "--trainer.checkpoint_every_n_steps", "0",
            "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(out / name), "--trainer.version", "run", *extra]
    print(f"\n== {name}: {' '.join(args[3:])}", flush=True)
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.call(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    plan = [line for line in (out / f"{name}.log").read_text().splitlines() if "est. GiB" in line or "placement:" in line]
    print("\n".join(plan[:2]))
    if code != 0:
        print(f"FAIL {name}: mrl fit exited with {code}; see {out / f'{name}.log'}")
        return None
    return out / name / "run"


def report(name: str, folder: Path, ratio_tolerance: float) -> list[str]:
    """Print a run's numbers; return the failed checks."""
    scalars, failures = read(folder), []
    print(f"{name}: {seconds_per_step(scalars, 2):.3f} s per step")
    print(f"  {'policy':8s} {'rollout_s':>9s} {'update_s':>9s} {'wait_s':>7s} {'tok/s':>8s} {'peak GiB':>9s} "
          f"{'ratio@1 (min-max)':>18s}")
    for tag in sorted(t for t in scalars if t.startswith("mwra/") and t.endswith("/rollout_s")):
        p = tag.split("/")[1]
        phase = {k: mean([x[2] for x in scalars[f"mwra/{p}/{k}"][1:]]) for k in ("rollout_s", "update_s", "wait_s")}
        tok_s = mean([x[2] for x in scalars[f"mwra/{p}/rollout_tokens_per_s"][1:]])
        peak = scalars[f"mwra/{p}/peak_memory_gib"][-1][2]
        low, high = scalars[f"train/{p}/ratio_min"][0][2], scalars[f"train/{p}/ratio_max"][0][2]
        print(f"  {p:8s} {phase['rollout_s']:9.3f} {phase['update_s']:9.3f} {phase['wait_s']:7.3f} {tok_s:8.0f} "
              f"{peak:9.2f} {low:.4f}-{high:.4f}")
        if max(abs(low - 1.0), abs(high - 1.0)) > ratio_tolerance:
            failures.append(f"{name}/{p}: importance ratios at the first update span {low:.4f}-{high:.4f}, more "
                            f"than {ratio_tolerance} from 1 (sampling and training disagree)")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_check")
    parser.add_argument("--ratio-tolerance", type=float, default=1e-2)
    parser.add_argument("--dry-run-on-cpu", action="store_true",
                        help="run the same script on the CPU (float32, two processes) to check the script itself")
    args = parser.parse_args(argv)
    import torch

    accelerator, precision = ("cpu", "32-true") if args.dry_run_on_cpu else ("cuda", "bf16-mixed")
    if args.dry_run_on_cpu:
        gpus = 2
        print("dry run on the CPU: numbers are not GPU numbers.")
    elif not torch.cuda.is_available():
        print("no CUDA device is visible: this check needs a GPU.")
        return 2
    else:
        gpus = torch.cuda.device_count()
        print(f"{gpus} GPU(s): {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    args.out.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    runs = [("colocated_1gpu", ["--trainer.devices", "1"])]
    if gpus >= 2:
        runs.append(("disjoint_2gpu", ["--trainer.devices", "2", "--trainer.strategy", "ddp",
                                       "--trainer.placement", "disjoint"]))
    else:
        print("one GPU: the two-GPU disjoint run is skipped.")
    for name, extra in runs:
        folder = fit(args.out, name, args.steps, extra, accelerator, precision)
        failures += [f"{name}: run failed"] if folder is None else report(name, folder, args.ratio_tolerance)
    if importlib.util.find_spec("vllm") is not None and (REPO / "scripts" / "gpu_check_vllm.py").exists():
        code = subprocess.call([sys.executable, str(REPO / "scripts" / "gpu_check_vllm.py"), "--out",
                                str(args.out / "vllm")], cwd=REPO)
        if code:
            failures.append(f"vLLM engine check exited with {code}")
    else:
        print("vllm is not importable (or scripts/gpu_check_vllm.py is absent): the vLLM engine check is skipped.")
    chat = [sys.executable, str(REPO / "scripts" / "gpu_check_chat.py"), "--out", str(args.out / "chat"),
            "--steps", str(min(args.steps, 5))] + (["--dry-run-on-cpu"] if args.dry_run_on_cpu else [])
    if subprocess.call(chat, cwd=REPO):
        failures.append("chat stop / three-family check failed (see above)")
    print("\n" + ("\n".join(f"FAIL {f}" for f in failures) if failures else "all GPU checks passed"))
    print("(this script has never run on a GPU: see its docstring for what ran where)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
