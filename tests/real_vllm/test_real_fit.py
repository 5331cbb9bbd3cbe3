"""End to end on real vLLM (its CPU build): ``mrl fit`` of ``configs/default.yaml`` for 5 steps
with both policies on ``rollout_engine: vllm`` (docs/rollout.md, "Real vLLM on a CPU").

The shipped config as it is, except: ``rollout_engine: vllm`` and ``vllm_dtype: float32`` on
both policies (float32 on both sides, so the sampler/trainer mismatch correction must see a
ratio of 1), 5 steps, logs every step and paths under the test's folder. Two runs:

- one worker process (``trainer.devices: 1``, both engines in one process, as the config's
  own comment offers), in this process: the loop's builder is only wrapped, to keep a handle
  on the real ``vllm.LLM`` engines it built and compare their tensors with the trained ones;
- the config's own two worker processes (``devices: 2``, one policy and one engine each, each
  vLLM on ``external_launcher`` inside the workers' gloo group), as a subprocess: checked
  through its TensorBoard scalars and its exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not importable: these tests run in the vLLM venv "
                                          "(docs/rollout.md, 'Real vLLM on a CPU')")

import torch  # noqa: E402
import yaml  # noqa: E402

from mrl_lightning.cli import main  # noqa: E402
from mrl_lightning.rollout.vllm_engine import ColocatedVLLM  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STEPS = 5


def _config(tmp_path: Path, devices: int) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    assert cfg["trainer"]["devices"] == 2  # the shipped default: two worker processes
    cfg["trainer"].update(max_steps=STEPS, devices=devices, default_root_dir=str(tmp_path / "runs"),
                          log_every_n_steps=1, checkpoint_every_n_steps=STEPS, enable_progress_bar=False)
    for p in cfg["model"]["policies"]:
        p["init_args"].update(rollout_engine="vllm", vllm_dtype="float32")
        recipe = p["init_args"]["model"]["init_args"]
        recipe.update(prebuilt=str(REPO / recipe["prebuilt"]), cache_dir=str(tmp_path / "cache"))
    path = tmp_path / "default_vllm.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_mrl_fit_runs_the_default_for_5_steps_with_both_policies_on_real_vllm(tmp_path, monkeypatch, measured):
    from safetensors.torch import load_file

    import mrl_lightning.loop.system as system

    built = []
    real_build = system.build_vllm_engine

    def recording_build(policy, policies, prompts_per_rank):
        engine = real_build(policy, policies, prompts_per_rank)
        built.append((policy, engine))
        return engine

    monkeypatch.setattr(system, "build_vllm_engine", recording_build)
    config = _config(tmp_path, devices=1)
    start = time.perf_counter()
    assert main(["fit", "--config", str(config)]) == 0
    seconds = time.perf_counter() - start

    assert sorted(p.policy_name for p, _ in built) == ["gpt2", "llama"]  # one real engine each
    for policy, engine in built:
        assert isinstance(engine.backend, ColocatedVLLM) and isinstance(engine.backend.llm, vllm.LLM)
        assert engine.pushes >= STEPS  # the weights of every step reached the engine before it sampled again
        # Training moved the weights away from the shipped ones, and vLLM holds the moved ones.
        shipped = load_file(str(REPO / "models" / "default" / policy.policy_name / "model.safetensors"))
        ours = dict(policy.model.named_parameters())
        moved = [n for n, t in shipped.items() if n in ours and not torch.equal(ours[n].detach(), t)]
        assert len(moved) == len([n for n in shipped if n in ours]), f"{policy.policy_name}: unchanged tensors"
        theirs = engine.backend.named_parameters()
        same_shape = [n for n in moved if n in theirs and theirs[n].shape == ours[n].shape]
        assert same_shape and all(torch.equal(theirs[n], ours[n].detach()) for n in same_shape)

    measured(f"mrl fit configs/default.yaml, {STEPS} steps, both policies on vLLM (float32), one process: "
             f"{seconds:.0f} s; " + _check_scalars(tmp_path))


def _check_scalars(tmp_path: Path) -> str:
    """Assert a unit ratio at every step and both evaluations for each policy; return a summary."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = [p.parent for p in (tmp_path / "runs").glob("*/config.yaml")]
    events = EventAccumulator(str(run))
    events.Reload()
    lines = []
    for name in ("gpt2", "llama"):
        ratio = [s.value for s in events.Scalars(f"rollout/{name}/is_ratio_mean")]
        delta = [s.value for s in events.Scalars(f"rollout/{name}/abs_delta_logp_max")]
        assert len(ratio) == STEPS and all(abs(r - 1.0) < 1e-4 for r in ratio), ratio
        assert all(d < 1e-4 for d in delta), delta
        assert [s.step for s in events.Scalars(f"eval/{name}/pass_at_k_add")] == [0, STEPS]
        lines.append(f"{name}: ratio mean {min(ratio):.6f}-{max(ratio):.6f}, max |delta logp| {max(delta):.1e}")
    return "; ".join(lines)


def test_mrl_fit_runs_the_default_in_its_two_worker_processes_on_real_vllm(tmp_path, measured):
    config = _config(tmp_path, devices=2)
    # Without the torchrun variables the engines of earlier tests set in this process (its vLLM
    # still holds that MASTER_PORT): the workers choose their own.
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher} | {"OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    with open(tmp_path / "out.log", "w") as out:
        proc = subprocess.run([sys.executable, "-m", "mrl_lightning.cli", "fit", "--config", str(config)],
                              stdout=out, stderr=subprocess.STDOUT, env=env, timeout=600)
    seconds = time.perf_counter() - start
    log = (tmp_path / "out.log").read_text()
    assert proc.returncode == 0, log[-5000:]
    evals = [line for line in log.splitlines() if line.startswith("[eval] step")]
    assert len(evals) == 2 and all("gpt2" in line and "llama" in line for line in evals), evals
    measured(f"mrl fit configs/default.yaml, {STEPS} steps, both policies on vLLM (float32), two worker "
             f"processes: {seconds:.0f} s; " + _check_scalars(tmp_path) + "; " + " / ".join(evals))
