"""Faults around checkpoints and the exchange log (docs/reliability.md, "Checkpoints and the exchange log")."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

from mrl_lightning.builders import materialize
from mrl_lightning.run import checkpoint as ckpt
from mrl_lightning.run.checkpoint import FORMAT_VERSION, CheckpointError, atomic_save, load_checkpoint
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


ROOM = "free disk space (or move trainer.default_root_dir to a disk with room)"


def _stop_line(err: str) -> str:
    """The one ``mrl:`` line the run stopped with (nothing else of it on stderr: no traceback)."""
    lines = [line for line in err.splitlines() if line.startswith("mrl:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _file_of(obj) -> tuple[str, int]:
    """``("part" | "manifest", step)`` of what torch.save is asked to write."""
    if obj.get("format") == ckpt.PART_FORMAT:
        return "part", obj["step"]
    return "manifest", obj["counters"]["global_step"]


def _full_disk_at(monkeypatch, step: int, fails: str = "part", room: int = 3_000) -> list[tuple[str, int]]:
    """torch.save meets a full disk half-way through the first file of kind ``fails`` of the checkpoint of
    ``step`` (a policy's part, or the manifest); the files saved, in order."""
    real_save, saves = torch.save, []

    def save(obj, fh, *args, **kwargs):
        saves.append(_file_of(obj))
        target = _FullDisk(fh, room) if saves[-1] == (fails, step) and saves.count((fails, step)) == 1 else fh
        return real_save(obj, target, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save)
    return saves


@pytest.mark.parametrize("fails", ["part", "manifest"])
def test_disk_full_mid_checkpoint_keeps_the_last_good_one_loadable(write_tiny_config, monkeypatch, capsys, fails):
    config = write_tiny_config(modify=lambda c: c["trainer"].update(max_steps=2, version="full", keep_checkpoints=5))
    saves = _full_disk_at(monkeypatch, step=2, fails=fails)
    assert main(["fit", "--config", str(config)]) == 2  # one line: what is left and what to do
    monkeypatch.undo()
    line = _stop_line(capsys.readouterr().err)
    folder = _run_dir(config, "full") / "checkpoints"
    last = folder / "last.ckpt"
    assert saves[:3] == [("part", 1), ("part", 1), ("manifest", 1)]
    assert saves[-1] == (fails, 2)  # nothing was written after the failed file
    failed = folder / "step=2.parts" / "gpt2.pt" if fails == "part" else last
    assert line.startswith(f"mrl: disk full in phase 'checkpoint' at step 2: No space left on device while writing "
                           f"{failed} (") and " bytes free); " in line, line
    assert line.endswith(f"the partial file was removed and the previous last.ckpt is untouched: {ROOM}, then resume "
                         f"with --ckpt_path {last}."), line
    # no partial file left; a manifest that failed leaves its step's parts, which no manifest names
    left = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    parts_of_1 = ["step=1.parts", "step=1.parts/gpt2.pt", "step=1.parts/llama.pt"]
    parts_of_2 = ["step=2.parts", "step=2.parts/gpt2.pt", "step=2.parts/llama.pt"] if fails == "manifest" else []
    assert left == sorted(["last.ckpt", "step=1.ckpt", *parts_of_1, *parts_of_2])
    assert not list(folder.parent.glob("traceback_*"))
    assert load_checkpoint(last)["counters"]["global_step"] == 1
    resumed = write_tiny_config("b.yaml", modify=lambda c: c["trainer"].update(max_steps=2, version="resumed"))
    assert main(["fit", "--config", str(resumed), "--ckpt_path", str(last)]) == 0


def test_disk_full_at_the_first_checkpoint_says_there_is_nothing_to_resume(write_tiny_config, monkeypatch, capsys):
    config = write_tiny_config(modify=lambda c: c["trainer"].update(max_steps=2, version="first"))
    _full_disk_at(monkeypatch, step=1)
    assert main(["fit", "--config", str(config)]) == 2
    line = _stop_line(capsys.readouterr().err)
    folder = _run_dir(config, "first") / "checkpoints"
    assert f"while writing {folder / 'step=1.parts' / 'gpt2.pt'} (" in line, line
    assert line.endswith(f"); the partial file was removed and no earlier last.ckpt exists, so this run cannot be "
                         f"resumed: {ROOM}, then start the run again."), line
    assert "--ckpt_path" not in line and list(folder.iterdir()) == []


def test_disk_full_while_config_yaml_is_written_leaves_no_file_and_no_run_folder(write_tiny_config, monkeypatch,
                                                                                   capsys):
    import os

    config = write_tiny_config(modify=lambda c: c["trainer"].update(version="cfg"))
    real_fsync = os.fsync

    def fsync(fd):  # the disk fills up after the config checks (the build wrote a cache on it): the first write fails
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", fsync)
    assert main(["fit", "--config", str(config)]) == 2
    monkeypatch.setattr(os, "fsync", real_fsync)
    run = _run_dir(config, "cfg")
    line = _stop_line(capsys.readouterr().err)
    assert line.startswith(f"mrl: disk full: No space left on device while writing {run / 'config.yaml'} ("), line
    assert line.endswith("the partial file was removed and no step was trained: free disk space (or give "
                         "--trainer.default_root_dir a folder on a disk with room), then run the same command "
                         "again."), line
    assert not run.exists()  # no 0-byte config.yaml, no empty run folder: the same command starts version 'cfg' again


@pytest.fixture
def tiny_disk(tmp_path):
    """``tiny_disk(size, fill=0)``: a tmpfs of ``size`` mounted in ``tmp_path`` with ``fill`` bytes of it used
    (root only: skipped where it cannot be mounted; the portable tests above patch the write instead)."""
    import os
    import shutil
    import subprocess

    mounted = []

    def mount(size: str, fill: int = 0) -> Path:
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a tmpfs needs root")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                              text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(folder)
        if fill:
            (folder / "filler").write_bytes(b"\0" * fill)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=False)


def test_a_run_folder_on_a_64k_disk_stops_at_its_first_checkpoint_with_one_line(write_tiny_config, tiny_disk, capsys):
    disk = tiny_disk("64k")
    config = write_tiny_config(modify=lambda c: c["trainer"].update(default_root_dir=str(disk), version="v"))
    assert main(["fit", "--config", str(config)]) == 2
    line = _stop_line(capsys.readouterr().err)
    assert line.startswith(f"mrl: disk full in phase 'checkpoint' at step 1: No space left on device while writing "
                           f"{disk / 'v' / 'checkpoints' / 'step=1.parts'}/"), line
    assert " (64 KiB disk, " in line, line
    assert line.endswith("no earlier last.ckpt exists, so this run cannot be resumed: " + ROOM
                         + ", then start the run again."), line
    assert list((disk / "v" / "checkpoints").iterdir()) == [] and (disk / "v" / "config.yaml").stat().st_size > 0


def test_a_full_disk_is_refused_before_any_build_and_nothing_is_written(write_tiny_config, tiny_disk, capsys,
                                                                        monkeypatch):
    disk = tiny_disk("64k", fill=64 * 1024)
    config = write_tiny_config(modify=lambda c: c["trainer"].update(default_root_dir=str(disk)))
    monkeypatch.setattr("mrl_lightning.recipes.tiny.TinyCausalLM.materialize",
                        lambda *a, **k: pytest.fail("built a model on a full disk"))
    assert main(["fit", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert (f"trainer.default_root_dir={str(disk)!r} cannot be written (no space left on device at {str(disk)!r} "
            "(64 KiB disk, 0 bytes free)); ") in err, err
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]


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
    with pytest.raises(CheckpointError, match="is not a checkpoint of mrl-lightning: it is gzipped, but what it "
                                              "holds begins with") as info:
        load_checkpoint(path)
    assert "weights_only" not in str(info.value) and "arbitrary code" not in str(info.value)


@pytest.mark.parametrize("content", [b"hello\n", b"step: 48\nnot a checkpoint\n" * 10, b""])
def test_a_file_that_is_no_checkpoint_says_so_plainly(tmp_path, content):
    """A text file given as --ckpt_path: what was expected and what the file is, not torch's ``KeyError: 101``."""
    path = tmp_path / "notes.txt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    msg = str(info.value)
    assert "KeyError" not in msg and "\n" not in msg, msg
    if content:
        assert msg.startswith(f"ckpt_path={str(path)!r} is not a checkpoint of mrl-lightning: it begins with "
                              f"{content[:16]!r}; a checkpoint is what mrl fit writes in <run folder>/checkpoints/ "
                              "(last.ckpt or step=<k>.ckpt), a torch.save file, plain or gzipped."), msg
    else:
        assert msg.startswith(f"ckpt_path={str(path)!r} cannot be read: it is empty (0 bytes)"), msg


def test_truncated_compressed_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_save(_adam_like_state(), path, compress=True)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="cannot be read: its gzip stream ends before its end marker: the file "
                                              "is truncated"):
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
