"""Faults around checkpoints and the exchange log (docs/reliability.md, "Checkpoints and the exchange log")."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

from mrl_lightning.builders import materialize
from mrl_lightning import checkpoint as ckpt
from mrl_lightning.checkpoint import FORMAT_VERSION, CheckpointError, atomic_save, load_checkpoint
from mrl_lightning.cli import main
from mrl_lightning.exchange import read_log, record_key


def _run_dir(config: Path, version: str) -> Path:
    return config.parent / "runs" / version


class _FullDisk:
    """A file whose writes fail with ENOSPC once ``room`` bytes are written (the rest of the first write lands)."""

    def __init__(self, fh, room: int):
        self.fh, self.room = fh, room

    def write(self, data) -> int:
        if len(data) > self.room:
            self.fh.write(bytes(data[: self.room]))
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.fh.write(data)

    def __getattr__(self, name):
        return getattr(self.fh, name)


@pytest.mark.parametrize("fails", ["part", "manifest"])
def test_disk_full_mid_checkpoint_keeps_the_last_good_one_loadable(write_tiny_config, monkeypatch, capsys, fails):
    config = write_tiny_config(modify=lambda c: c["trainer"].update(max_steps=2, version="full", keep_checkpoints=5))
    real_save = torch.save
    saves = []

    def save(obj, fh, *args, **kwargs):  # the second checkpoint's first part (or its manifest) meets a full disk
        kind = "part" if obj.get("format") == ckpt.PART_FORMAT else "manifest"
        step = obj["step"] if kind == "part" else obj["counters"]["global_step"]
        saves.append((kind, step))
        target = _FullDisk(fh, room=3_000) if (kind, step) == (fails, 2) and saves.count((kind, 2)) == 1 else fh
        return real_save(obj, target, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save)
    assert main(["fit", "--config", str(config)]) == 1  # one message, no traceback
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    err = capsys.readouterr().err
    folder = _run_dir(config, "full") / "checkpoints"
    assert saves[:3] == [("part", 1), ("part", 1), ("manifest", 1)] and "Traceback" not in err
    assert saves[-1] == (fails, 2)  # nothing was written after the failed file
    assert "mrl: error in phase 'checkpoint' at step 2: OSError: [Errno 28]" in err
    failed = folder / "step=2.parts" / "gpt2.pt" if fails == "part" else folder / "last.ckpt"
    assert f"while writing {failed}" in err and "previous last.ckpt is untouched" in err
    assert f"--ckpt_path {folder / 'last.ckpt'}" in err
    # no partial file left; a manifest that failed leaves its step's parts, which no manifest names
    left = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    parts_of_1 = ["step=1.parts", "step=1.parts/gpt2.pt", "step=1.parts/llama.pt"]
    parts_of_2 = ["step=2.parts", "step=2.parts/gpt2.pt", "step=2.parts/llama.pt"] if fails == "manifest" else []
    assert left == sorted(["last.ckpt", "step=1.ckpt", *parts_of_1, *parts_of_2])
    assert load_checkpoint(folder / "last.ckpt")["counters"]["global_step"] == 1
    resumed = write_tiny_config("b.yaml", modify=lambda c: c["trainer"].update(max_steps=2, version="resumed"))
    assert main(["fit", "--config", str(resumed), "--ckpt_path", str(folder / "last.ckpt")]) == 0


@pytest.mark.parametrize("compress", [False, True])
def test_atomic_save_leaves_no_partial_file_and_keeps_the_old_one(tmp_path, monkeypatch, compress):
    path = tmp_path / "last.ckpt"
    atomic_save({"format": "mrl-lightning", "version": FORMAT_VERSION, "x": torch.zeros(10)}, path, compress=compress)
    real_save = torch.save
    monkeypatch.setattr(ckpt.torch, "save", lambda obj, fh: real_save(obj, _FullDisk(fh, room=100)))
    with pytest.raises(OSError, match="No space left on device while writing"):
        atomic_save({"x": torch.randn(100_000)}, path, compress=compress)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    assert torch.equal(load_checkpoint(path)["x"], torch.zeros(10))


def _adam_like_state() -> dict:
    """Float32 weights and AdamW moments of a trained-looking layer (mantissas are noise)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 128, generator=g) * 0.02
    return {"format": "mrl-lightning", "version": FORMAT_VERSION, "counters": {"global_step": 7},
            "policies": {"p": {"model": {"w": w, "tied": w},
                               "optimizer": {"exp_avg": torch.randn(256, 128, generator=g) * 1e-3,
                                             "exp_avg_sq": torch.rand(256, 128, generator=g) * 1e-6}}}}


def test_compressed_checkpoint_is_smaller_and_loads_bit_for_bit(tmp_path):
    state = _adam_like_state()
    plain, packed = tmp_path / "plain.ckpt", tmp_path / "packed.ckpt"
    atomic_save(state, plain)
    atomic_save(state, packed, compress=True)
    assert packed.read_bytes()[:2] == b"\x1f\x8b" and plain.read_bytes()[:2] != b"\x1f\x8b"
    assert packed.stat().st_size < 0.95 * plain.stat().st_size
    back = load_checkpoint(packed)
    assert back["counters"] == {"global_step": 7}
    for part in ("model", "optimizer"):
        for key, value in state["policies"]["p"][part].items():
            assert torch.equal(back["policies"]["p"][part][key], value), f"{part}.{key} changed"
    assert back["policies"]["p"]["model"]["w"].data_ptr() == back["policies"]["p"]["model"]["tied"].data_ptr()


def test_gzip_of_random_bytes_is_a_clear_error_without_torch_unsafe_advice(tmp_path):
    import gzip

    path = tmp_path / "last.ckpt"
    path.write_bytes(gzip.compress(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                                 dtype=torch.uint8).numpy().tobytes()))
    with pytest.raises(CheckpointError, match="truncated, corrupted") as info:
        load_checkpoint(path)
    assert "weights_only" not in str(info.value) and "arbitrary code" not in str(info.value)


def test_truncated_compressed_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_save(_adam_like_state(), path, compress=True)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated, corrupted"):
        load_checkpoint(path)


def test_checkpoint_from_a_newer_format_is_refused_naming_the_upgrade(tmp_path):
    path = tmp_path / "future.ckpt"
    torch.save({"format": "mrl-lightning", "version": FORMAT_VERSION + 1, "counters": {}}, path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    msg = str(info.value)
    assert f"format version {FORMAT_VERSION + 1}" in msg and f"({FORMAT_VERSION})" in msg and "upgrade" in msg


def test_newer_checkpoint_stops_the_cli_before_any_model_is_built(write_tiny_config, tmp_path, capsys, monkeypatch):
    path = tmp_path / "future.ckpt"
    torch.save({"format": "mrl-lightning", "version": FORMAT_VERSION + 1, "counters": {}}, path)
    monkeypatch.setattr("mrl_lightning.recipes.tiny.TinyCausalLM.materialize",
                        lambda *a, **k: pytest.fail("built a model before reading the checkpoint"))
    assert main(["fit", "--config", str(write_tiny_config()), "--ckpt_path", str(path)]) == 2
    assert "newer than this mrl-lightning reads" in capsys.readouterr().err


def test_exchange_log_with_a_torn_last_line_reads_back_without_it_and_warns(tmp_path):
    from mrl_lightning.exchange import ExperienceExchange, SuccessRecord

    path = tmp_path / "see.jsonl"
    records = [SuccessRecord(f"add/{i}", "gpt2", i, f" {i}", 1.0, "exact", "1") for i in range(3)]
    ExperienceExchange(log_path=str(path)).publish(records)
    with open(path, "a") as fh:
        fh.write(json.dumps({"record_type": "success", "prompt_id": "add/9"})[:25])  # killed mid-append
    with pytest.warns(UserWarning, match=r"see.jsonl' ends in a torn line \(line 4, 25 characters"):
        back = read_log(str(path))
    assert [record_key(r) for r in back] == [record_key(r) for r in records]


def _log_config(c, log, version, max_steps):
    c["trainer"].update(max_steps=max_steps, version=version, keep_checkpoints=10)
    c["trainer"]["callbacks"][0]["init_args"] = {"log_path": str(log)}


def test_resuming_into_the_same_exchange_log_gives_the_log_of_an_unbroken_run(write_tiny_config, tmp_path):
    straight_log, shared_log = tmp_path / "straight.jsonl", tmp_path / "shared.jsonl"
    straight = write_tiny_config("a.yaml", modify=lambda c: _log_config(c, straight_log, "straight", 3))
    assert main(["fit", "--config", str(straight)]) == 0
    first = write_tiny_config("b.yaml", modify=lambda c: _log_config(c, shared_log, "first", 3))
    assert main(["fit", "--config", str(first)]) == 0  # runs past step 1; its step 2-3 records are in the log
    with open(shared_log, "a") as fh:
        fh.write('{"record_type": "rollout", "prompt_id": "add/')  # and it died mid-append
    resumed = write_tiny_config("c.yaml", modify=lambda c: _log_config(c, shared_log, "resumed", 3))
    step1 = _run_dir(first, "first") / "checkpoints" / "step=1.ckpt"
    assert main(["fit", "--config", str(resumed), "--ckpt_path", str(step1)]) == 0
    assert [record_key(r) for r in read_log(str(shared_log))] == [record_key(r) for r in read_log(str(straight_log))]


def test_a_recipe_cache_miss_leaves_the_random_generators_as_a_hit_does(tmp_path):
    """A resumed process finds the recipe cached; the first one built it: both must continue from one RNG state."""
    import random

    import numpy as np

    from mrl_lightning.data import ReasoningGymDataModule
    from mrl_lightning.policy import PolicyModule
    from mrl_lightning.recipes import TinyCausalLM

    data = ReasoningGymDataModule(parts=[{"name": "add", "dataset": "basic_arithmetic", "config": {
        "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}}],
        batch_size=2, train_size=20, eval_size=4)
    data.setup()
    recipe = TinyCausalLM(family="gpt2", tokenizer_kind="byte_level_bpe", vocab_size=300, hidden_size=32,
                          num_layers=1, num_heads=2, cache_dir=str(tmp_path / "cache"))
    policy = PolicyModule(name="p", model=recipe)
    for _ in ("miss", "hit"):
        torch.manual_seed(123), random.seed(123), np.random.seed(123)
        materialize(policy, data, cache_log=lambda msg: None)
        assert torch.equal(torch.get_rng_state(), torch.manual_seed(123).get_state())
        assert random.random() == random.Random(123).random()
        assert np.random.random() == np.random.RandomState(123).random_sample()
