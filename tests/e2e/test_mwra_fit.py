"""MWRA end to end: ``mrl fit`` on two gloo worker processes against one process (docs/mwra.md).

Each multi-process run is a real ``mrl fit --trainer.devices 2 --trainer.strategy ddp``
launched by Fabric (rank 1 is a second process). The two tiny policies run disjoint (one
rank each) and must reproduce the colocated one-process run exactly: same completions,
same weights, same exchange. Checkpoints resume across placements both ways.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from mrl_lightning.run.checkpoint import load_checkpoint

REPO = Path(__file__).resolve().parents[2]
DISJOINT = ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.placement", "disjoint"]


def _mrl(config: Path, *extra: str, timeout: float = 240, command: str = "fit",
         omp_num_threads: str | None = "1") -> subprocess.CompletedProcess:
    """Run ``mrl <command>`` (``fit``) in a new session; return when the main process (rank 0) ends, then kill
    leftovers. ``omp_num_threads``: the ``OMP_NUM_THREADS`` it runs with, None = unset.

    Output goes to files, not pipes: a rank that outlives rank 0 would hold a pipe open.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "e2e"), str(REPO)]),
               OMP_NUM_THREADS=omp_num_threads or "")
    if omp_num_threads is None:
        del env["OMP_NUM_THREADS"]
    args = [sys.executable, "-m", "mrl_lightning.cli", command, "--config", str(config), *extra]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(args, stdout=out, stderr=err, env=env, text=True, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the other ranks, if any are left
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(args, code, out.read(), err.read())


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"mrl fit failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def _ckpt(config: Path, version: str, name: str = "last.ckpt") -> dict:
    return load_checkpoint(config.parent / "runs" / version / "checkpoints" / name)


def _assert_same_run(a: dict, b: dict, what: str) -> None:
    assert a["counters"] == b["counters"], what
    for name in a["policies"]:
        for key, value in a["policies"][name]["model"].items():
            torch.testing.assert_close(b["policies"][name]["model"][key], value, rtol=0, atol=1e-5,
                                       msg=f"{what}: {name}.{key}")
    # The exchange holds every record of every step: completions (texts, token ids, log-probs) agree.
    ra = a["callbacks"]["SharedExperienceExchange"]["exchange"]["records"]
    rb = b["callbacks"]["SharedExperienceExchange"]["exchange"]["records"]
    texts_a = [rec["completion_text"] for _, rec in ra if "completion_text" in rec]  # records are [seq, record]
    assert texts_a, f"{what}: no completion in the exchange to compare"
    assert texts_a == [rec["completion_text"] for _, rec in rb if "completion_text" in rec], f"{what}: completions differ"
    assert a["callbacks"] == b["callbacks"], f"{what}: exchange / probe state differs"
    assert a["data"] == b["data"]


def write_stepwise_config(folder: Path, max_steps: int) -> Path:
    """The tiny config with a checkpoint every step (all kept), one thread per worker, every SEE record type."""
    import yaml

    from e2e_configs import tiny_config

    cfg = tiny_config(folder / "cache", folder / "runs")
    cfg["trainer"].update(max_steps=max_steps, keep_checkpoints=10, num_threads=1)
    cfg["trainer"]["callbacks"][0]["init_args"] = {"record_types": ["rollout", "group_stats", "success"]}
    config = folder / "tiny.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Straight runs of 4 steps (checkpoint every step): colocated 1 process and disjoint 2 processes."""
    config = write_stepwise_config(tmp_path_factory.mktemp("mwra"), max_steps=4)
    _ok(_mrl(config, "--trainer.version", "colocated"))
    _ok(_mrl(config, "--trainer.version", "disjoint", *DISJOINT))
    return config


def test_disjoint_two_processes_reproduce_the_colocated_run(runs):
    for step in (3, 4):
        name = f"step={step}.ckpt" if step < 4 else "last.ckpt"
        colocated, disjoint = _ckpt(runs, "colocated", name), _ckpt(runs, "disjoint", name)
        _assert_same_run(colocated, disjoint, f"step {step}")
    # each policy's part is a file of its own beside the manifest, which holds no weights (docs/loop.md)
    folder = runs.parent / "runs" / "disjoint" / "checkpoints"
    manifest = load_checkpoint(folder / "last.ckpt", policies=())
    assert manifest["policies"] == {} and manifest["parts"] == {
        name: {"file": f"step=4.parts/{name}.pt"} for name in ("gpt2", "llama")}
    assert all((folder / entry["file"]).is_file() for entry in manifest["parts"].values())
    disjoint = _ckpt(runs, "disjoint")
    assert disjoint["placement"] == {"mode": "disjoint", "groups": {"gpt2": [0], "llama": [1]}}
    # Every rank's generator states are in the checkpoint (CUDA ones where a GPU is visible).
    assert len(disjoint["rng"]["ranks"]) == 2
    assert all(isinstance(r["torch"], torch.Tensor) and "cuda" in r for r in disjoint["rng"]["ranks"])
    assert disjoint["counters"]["optimizer_steps"] == {"gpt2": 4, "llama": 4}
    # Tied weights (GPT-2's wte / lm_head) stay one storage after the gather, as colocated.
    for ckpt in (_ckpt(runs, "colocated"), disjoint):
        model = ckpt["policies"]["gpt2"]["model"]
        assert (model["transformer.wte.weight"].untyped_storage().data_ptr()
                == model["lm_head.weight"].untyped_storage().data_ptr())


def test_per_worker_timings_and_memory_are_logged(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs.parent / "runs" / "disjoint"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for policy in ("gpt2", "llama"):
        for tag in ("rollout_s", "update_s", "wait_s", "peak_memory_gib"):
            assert f"mwra/{policy}/{tag}" in tags
        peak = events.Scalars(f"mwra/{policy}/peak_memory_gib")[-1].value
        assert 0.1 < peak < 8.0, f"{policy}: implausible peak memory {peak} GiB"


@pytest.mark.parametrize("source, target", [("disjoint", "colocated"), ("colocated", "disjoint")])
def test_resume_across_placements_continues_identically(runs, source, target):
    mid = runs.parent / "runs" / source / "checkpoints" / "step=2.ckpt"
    version = f"{source}-to-{target}"
    extra = DISJOINT if target == "disjoint" else []
    _ok(_mrl(runs, "--trainer.version", version, "--ckpt_path", str(mid), *extra))
    _assert_same_run(_ckpt(runs, source), _ckpt(runs, version), f"{source} -> {target}")


def test_a_worker_that_raises_ends_the_run_naming_rank_and_phase(write_config):
    config = write_config(modify=lambda c: c["trainer"].update(max_steps=5, collective_timeout_s=60, callbacks=[
        {"class_path": "mrl_lightning.callbacks.SharedExperienceExchange"},
        {"class_path": "e2e_faults.FaultOnRank", "init_args": {"rank": 1, "step": 3}}]))
    start = time.perf_counter()
    proc = _mrl(config, "--trainer.version", "fault", *DISJOINT)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 1
    assert "rank 1 (llama) failed in phase 'compose' at step 3" in proc.stderr
    assert "injected fault" in proc.stderr
    # one message, from the rank that failed; no traceback, no gloo error of the other rank after it
    assert "Traceback" not in proc.stderr and [l for l in proc.stderr.splitlines() if l.strip()][-1].startswith(
        "mrl: worker error: rank 1 (llama)")
    assert elapsed < 60 + 30, f"the run took {elapsed:.0f} s to end after the fault"
    last = load_checkpoint(config.parent / "runs" / "fault" / "checkpoints" / "last.ckpt")
    assert last["counters"]["global_step"] == 2  # the last good checkpoint, loadable


def test_a_worker_that_hangs_times_out_instead_of_hanging(write_config):
    config = write_config(modify=lambda c: c["trainer"].update(max_steps=4, collective_timeout_s=5, callbacks=[
        {"class_path": "mrl_lightning.callbacks.SharedExperienceExchange"},
        {"class_path": "e2e_faults.FaultOnRank", "init_args": {"rank": 1, "step": 2, "sleep_s": 120}}]))
    start = time.perf_counter()
    proc = _mrl(config, "--trainer.version", "hang", *DISJOINT, timeout=100)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 1
    assert "rank 0 (gpt2) waited" in proc.stderr and "step 2" in proc.stderr, proc.stderr[-3000:]
    assert "raise trainer.collective_timeout_s" in proc.stderr and "Traceback" not in proc.stderr
    assert elapsed < 60, f"the run took {elapsed:.0f} s to end with a 5 s collective timeout"


def test_placement_cost_prints_its_predictions_both_workers_run_the_choice_and_a_resume_keeps_it(tmp_path):
    """Rank 0 calibrates and hands its choice to rank 1 (a disagreement would deadlock or fail); the resume reads
    the placement from the checkpoint instead of calibrating again (docs/mwra.md, "Placement by cost")."""
    config = write_stepwise_config(tmp_path, max_steps=2)
    first = _mrl(config, "--trainer.version", "cost", "--trainer.devices", "2", "--trainer.placement", "cost")
    _ok(first)
    head = next(line for line in first.stdout.splitlines() if line.startswith("placement cost: "))
    mode = head.split(":", 1)[1].split(",")[0].strip()
    assert mode in ("colocated", "disjoint") and "to pin it: --trainer.placement " + mode in head
    chosen = [line for line in first.stdout.splitlines() if line.startswith("  * ")]
    assert len(chosen) == 1 and chosen[0].startswith(f"  * {mode} (") and "s a step" in chosen[0]
    assert "one process on" in first.stdout and f"placement: {mode}, 2 worker(s)" in first.stdout
    assert _ckpt(config, "cost")["placement"]["mode"] == mode
    resumed = _mrl(config, "--trainer.version", "cost_resumed", "--trainer.devices", "2", "--trainer.placement",
                   "cost", "--trainer.max_steps", "3", "--ckpt_path",
                   str(config.parent / "runs" / "cost" / "checkpoints" / "last.ckpt"))
    _ok(resumed)
    assert f"placement cost: {mode}, the placement the checkpoint resumed was written under" in resumed.stdout
    assert "calibrated in" not in resumed.stdout


@pytest.mark.slow  # the default test run is near its 10-minute budget; CI runs -m slow in its own step
def test_placement_cost_with_fsdp_policies_chooses_among_the_placements_fsdp_accepts(tmp_path):
    """auto's disjoint split gives each FSDP policy one rank, which FSDP refuses: cost must check the placement it
    chooses, not auto's (here only colocated passes)."""
    proc = _mrl(REPO / "configs" / "default.yaml", "--config", str(REPO / "configs" / "fsdp.yaml"),
                "--trainer.placement", "cost", "--trainer.max_steps", "1", "--trainer.eval_every_n_steps", "0",
                "--trainer.checkpoint_every_n_steps", "0", "--trainer.default_root_dir", str(tmp_path / "runs"))
    _ok(proc)
    chosen = [line for line in proc.stdout.splitlines() if line.startswith("  * ")]
    assert len(chosen) == 1 and chosen[0].startswith("  * colocated (gpt2: 2, llama: 2)")
    assert "    disjoint" not in proc.stdout  # refused by FSDP's sharding check, so not a candidate


@pytest.mark.slow
def test_dropout_in_the_update_does_not_tie_a_policy_to_its_placement(tmp_path):
    """Each policy's compose and update draw from their own stream (run seed, policy, "update", step): with
    dropout on, one process (the updates in turn) equals two workers; from the one stream of a process they
    differed (found by ``mrl replay``, docs/see.md "Replay")."""
    import yaml

    config = write_stepwise_config(tmp_path, max_steps=3)
    cfg = yaml.safe_load(config.read_text())
    for policy, drop in zip(cfg["model"]["policies"], ({"resid_pdrop": 0.2, "attn_pdrop": 0.2},
                                                       {"attention_dropout": 0.2})):
        policy["init_args"]["disable_dropout"] = False
        policy["init_args"]["model"]["init_args"]["config_overrides"] = drop
    config.write_text(yaml.safe_dump(cfg))
    _ok(_mrl(config, "--trainer.version", "one"))
    _ok(_mrl(config, "--trainer.version", "two", *DISJOINT))
    _assert_same_run(_ckpt(config, "one"), _ckpt(config, "two"), "dropout: one process vs two workers")
    for policy in cfg["model"]["policies"]:
        policy["init_args"]["disable_dropout"] = True
    off_config = tmp_path / "off.yaml"
    off_config.write_text(yaml.safe_dump(cfg))
    _ok(_mrl(off_config, "--trainer.version", "off"))
    off = _ckpt(config, "off")["policies"]["gpt2"]["model"]
    assert any(not v.equal(off[k]) for k, v in _ckpt(config, "one")["policies"]["gpt2"]["model"].items()), \
        "the dropout config trained as without dropout"
