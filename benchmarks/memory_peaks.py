"""Peak resident memory of every worker, phase by phase, against the resource plan's estimate (docs/mwra.md).

    python benchmarks/memory_peaks.py --config CONFIG [--out runs/bench_memory] [-- <more mrl fit arguments>]

Runs ``mrl fit`` through this file, so that every worker (rank 0 and the workers Fabric starts
with the same command line) records its own peak RSS in each of the loop's phases (``build``,
``rollout``, ``exchange``, ``compose``, ``update``, ``metrics``, ``eval``, ``checkpoint``) and
in ``setup`` (everything before the first phase: imports, config checks, the plan). The peak of
a phase is the kernel's high-water mark of the process's resident set (``VmHWM`` in
``/proc/self/status``), reset when the phase starts (writing ``5`` to ``/proc/self/clear_refs``,
Linux 4.0+): exact, with no sampling to miss a short spike (tracemalloc does not see torch's
allocations). A phase inside another counts toward both.

The run's checkpoints are removed afterwards (``--keep-checkpoints`` keeps them). Prints, per
worker: the plan's estimate (the printed plan's per-worker line), the run's peak
and the phase that set it, estimate / peak (the plan's contract: in [1, 1.5]), and every phase's
peak and the RSS it started from. A JSON summary goes to ``<out>/memory_peaks.json``. Memory
hardly depends on load; run it under ``flock /tmp/mrl_heavy.lock`` when the models are large.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENV = "MRL_MEMORY_PHASES"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


DETAIL = {  # --detail: calls inside the phases, recorded as "<phase>/<name>"
    "generate": ("mrl_lightning.rollout.hf_generate", "HFGenerateEngine", "generate"),
    "logprobs": ("mrl_lightning.policy", "PolicyModule", "completion_logprobs"),
    "backward": ("lightning.fabric", "Fabric", "backward"),
    "optimizer": ("torch.optim", "AdamW", "step"),
    "load": ("mrl_lightning.policy", "PolicyModule", "load_weights_state_dict"),
}


def fit_recording_phases(argv: list[str]) -> int:
    """``mrl fit`` with every worker appending ``phase step start_gib peak_gib`` per phase to ``$MRL_MEMORY_PHASES.rank<r>``
    (and, with ``$MRL_MEMORY_DETAIL`` set, the calls of :data:`DETAIL` inside them)."""
    import contextlib
    import functools
    import importlib

    from mrl_lightning.mwra import workers

    plain = workers.Workers.phase
    stack: list[list] = []  # per open record: [its name, its peak so far in GiB]
    prefix = os.environ[ENV]
    where = {"rank": 0, "step": 0, "setup": True}

    def reset() -> None:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")

    @contextlib.contextmanager
    def recorded(name: str):
        hwm = _status_kib("VmHWM") / 2**20
        if where["setup"]:  # everything before the first phase: imports, checks, the plan, the process group
            with open(f"{prefix}.rank{where['rank']}", "a") as fh:
                fh.write(f"setup 0 0.0000 {hwm:.4f}\n")
            where["setup"] = False
        if stack:
            stack[-1][1] = max(stack[-1][1], hwm)
            name = f"{stack[-1][0]}/{name}"
        start = _status_kib("VmRSS") / 2**20
        reset()
        stack.append([name, start])
        try:
            yield
        finally:
            peak = max(stack.pop()[1], _status_kib("VmHWM") / 2**20)
            with open(f"{prefix}.rank{where['rank']}", "a") as fh:
                fh.write(f"{name} {where['step']} {start:.4f} {peak:.4f}\n")
            if stack:
                stack[-1][1] = max(stack[-1][1], peak)
            reset()

    @contextlib.contextmanager
    def phase(self, name, step=None):
        where["rank"] = self.rank
        with recorded(name), plain(self, name, step):
            where["step"] = self.step
            yield

    workers.Workers.phase = phase
    if os.environ.get("MRL_MEMORY_DETAIL"):
        for label, (module, cls, method) in DETAIL.items():
            owner = getattr(importlib.import_module(module), cls)
            real = getattr(owner, method)

            def wrapped(*args, _real=real, _label=label, **kwargs):
                if not stack:  # outside the loop's phases (the plan, a build): not recorded
                    return _real(*args, **kwargs)
                with recorded(_label):
                    return _real(*args, **kwargs)

            setattr(owner, method, functools.wraps(real)(wrapped))
    from mrl_lightning.cli import main as cli_main

    return cli_main(argv)


def plan_estimates(log: str) -> list[float]:
    """The plan's estimated GiB per worker, in rank order, from the run's console output (empty if absent)."""
    match = re.search(r"estimated GiB per worker incl\..*?: (rank 0: .*)", log)
    return [float(x) for x in re.findall(r"rank \d+: ([0-9.]+)", match.group(1))] if match else []


def read_phases(prefix: Path) -> dict[int, list[tuple[str, int, float, float]]]:
    """Rank -> ``(phase, step, start GiB, peak GiB)`` rows, in the order the phases ended."""
    out = {}
    for path in sorted(prefix.parent.glob(prefix.name + ".rank*")):
        rank = int(path.name.rsplit("rank", 1)[1])
        out[rank] = [(a, int(b), float(c), float(d)) for a, b, c, d in
                     (line.split() for line in path.read_text().splitlines())]
    return out


def summarize(rows: dict[int, list], estimates: list[float]) -> list[dict]:
    """Per rank: the run's peak, the phase that set it, the plan's estimate and each phase's peak."""
    out = []
    for rank, phases in sorted(rows.items()):
        by_phase: dict[str, dict[str, float]] = {}
        for name, step, start, peak in phases:
            entry = by_phase.setdefault(name, {"peak_gib": 0.0, "start_gib": start, "step": step})
            if peak > entry["peak_gib"]:
                entry.update(peak_gib=peak, start_gib=start, step=step)
        top = max(by_phase, key=lambda k: by_phase[k]["peak_gib"])
        peak = by_phase[top]["peak_gib"]
        estimate = estimates[rank] if rank < len(estimates) else None
        out.append({"rank": rank, "peak_gib": peak, "peak_phase": f"{top} (step {by_phase[top]['step']})",
                    "plan_gib": estimate, "plan_over_peak": estimate / peak if estimate else None,
                    "phases": by_phase})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, action="append", help="mrl fit --config (repeatable)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_memory")
    parser.add_argument("--detail", action="store_true", help="also record sampling, log-probs, backward, "
                        "optimizer step and weight loading inside the phases")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep the run's checkpoints (removed by "
                        "default: the real pair's are 4.5 GB each)")
    parser.add_argument("rest", nargs="*", help="more mrl fit arguments (after --)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prefix = args.out / "phases"
    for old in args.out.glob("phases.rank*"):
        old.unlink()
    command = [sys.executable, str(Path(__file__).resolve()), "_fit", "fit"]
    for config in args.config:
        command += ["--config", str(config)]
    command += ["--trainer.default_root_dir", str(args.out / "runs"), *args.rest]
    env = {**os.environ, ENV: str(prefix), **({"MRL_MEMORY_DETAIL": "1"} if args.detail else {})}
    with open(args.out / "run.log", "w") as log:
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    text = (args.out / "run.log").read_text()
    if not args.keep_checkpoints:
        for folder in (args.out / "runs").glob("*/checkpoints"):
            shutil.rmtree(folder, ignore_errors=True)
    if code:
        raise SystemExit(f"mrl fit failed with exit code {code}; see {args.out / 'run.log'}")
    summary = summarize(read_phases(prefix), plan_estimates(text))
    (args.out / "memory_peaks.json").write_text(json.dumps(summary, indent=2))
    for r in summary:
        ratio = f"{r['plan_over_peak']:.2f}" if r["plan_over_peak"] else "?"
        print(f"rank {r['rank']}: plan {r['plan_gib']} GiB, peak {r['peak_gib']:.3f} GiB in {r['peak_phase']}, "
              f"plan/peak {ratio}")
        print("  " + ", ".join(f"{k} {v['peak_gib']:.2f} (from {v['start_gib']:.2f})" for k, v in r["phases"].items()))
    ok = all(r["plan_over_peak"] and 1.0 <= r["plan_over_peak"] <= 1.5 for r in summary)
    print(f"plan estimate within [1, 1.5] x the peak RSS on every worker: {ok}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["_fit"]:  # a worker of the run (and the other workers Fabric starts alike)
        sys.exit(fit_recording_phases(sys.argv[2:]))
    main()
