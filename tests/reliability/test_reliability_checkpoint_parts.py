"""A checkpoint as a manifest plus one part per policy (docs/loop.md, "Checkpoints"; docs/reliability.md).

:func:`~mrl_lightning.run.state.save_run_checkpoint` is driven here with fake workers and
two tiny policies, so every file operation it makes can be interrupted in turn: a kill at any
moment must leave a ``last.ckpt`` whose parts are all of its own step and load.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from mrl_lightning.run.checkpoint import CheckpointError, load_checkpoint, load_policy_parts
from mrl_lightning.mwra.placement import Placement
from mrl_lightning.run.state import part_file, save_run_checkpoint


class _Policy:
    use_peft = False

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(8, 4)

    def weights_state_dict(self):
        return self.model.state_dict()


class _Workers:
    """One process running every policy; records what it would send to rank 0."""

    def __init__(self, names: list[str]) -> None:
        self.placement = Placement(mode="colocated", groups={n: (0,) for n in names}, world_size=1)
        self.local_policies, self.sent = list(names), []

    def is_leader(self, name: str) -> bool:
        return True

    def gather_to_zero(self, obj, what):
        self.sent.append(obj)
        return [obj]

    def barrier(self, what):
        pass


class _Callback:
    state_key = "counter"

    def state_dict(self):
        return {"n": 1}

    def merge_rank_states(self, states):
        return states[0]


def _save(folder: Path, step: int, policies: dict, keep: int = 2, workers=None, compress: bool = False) -> Path:
    workers = workers or _Workers(list(policies))
    optimizers = {n: torch.optim.AdamW(p.model.parameters(), lr=0.1) for n, p in policies.items()}
    for name, p in policies.items():  # a step, so the optimizer has moments to save
        p.model.weight.grad = torch.full_like(p.model.weight, float(step))
        optimizers[name].step()
    return save_run_checkpoint(folder, step, workers=workers, policies=policies, optimizers=optimizers,
                               callbacks=[_Callback()], counters={"global_step": step}, data_state={"position": {}},
                               compress=compress, keep=keep)


def _policies() -> dict:
    return {"a": _Policy(0), "b/odd name": _Policy(1)}


def test_each_policy_has_a_part_of_its_own_and_rank_zero_receives_no_weights(tmp_path):
    policies, workers = _policies(), _Workers(["a", "b/odd name"])
    _save(tmp_path, 1, policies, workers=workers)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "last.ckpt", "step=1.ckpt", "step=1.parts", "step=1.parts/a.pt", "step=1.parts/b%2Fodd%20name.pt"]
    manifest = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert manifest["parts"] == {"a": {"file": part_file(1, "a")}, "b/odd name": {"file": part_file(1, "b/odd name")}}
    assert "policies" not in manifest
    sent = [t for t in _tensors(workers.sent)]  # the small state: RNG states only, no weight or moment
    assert sent and all(t.dtype == torch.uint8 for t in sent)
    state = load_checkpoint(tmp_path / "step=1.ckpt")
    for name, p in policies.items():
        assert torch.equal(state["policies"][name]["model"]["weight"], p.model.weight)
        assert state["fingerprint"]["policies"][name]["shapes"] == {"weight": [4, 8], "bias": [4]}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def test_old_steps_lose_their_parts_with_their_step_files(tmp_path):
    policies = _policies()
    for step in (1, 2, 3):
        _save(tmp_path, step, policies, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=2.ckpt", "step=2.parts",
                                                           "step=3.ckpt", "step=3.parts"]
    assert load_checkpoint(tmp_path / "step=2.ckpt")["counters"]["global_step"] == 2


class _Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (no ``except Exception`` catches it)."""


WRITE_OPERATIONS = 10  # per part: torch.save, os.replace; the manifest's two; link + rename; unlink, rmtree


@pytest.mark.parametrize("kill_at", range(WRITE_OPERATIONS + 1))
def test_a_kill_at_any_file_operation_leaves_a_whole_checkpoint(tmp_path, monkeypatch, kill_at):
    """Step 2 is written after step 1 (keep 1, so step 1's files are removed): the run is killed at its
    ``kill_at``-th file operation (mid-file for a ``torch.save``). last.ckpt must then load with every
    part of its own step, step 1 or step 2, and so must every step file left."""
    policies = _policies()
    _save(tmp_path, 1, policies, keep=1)
    calls = []

    def killing(name, real):
        def op(*args, **kwargs):
            calls.append(name)
            if len(calls) - 1 == kill_at:
                if name == "torch.save":  # half a file on disk, then the kill
                    args[1].write(b"\x00" * 100)
                raise _Killed(name)
            return real(*args, **kwargs)
        return op

    monkeypatch.setattr(os, "replace", killing("os.replace", os.replace))  # the module both files use
    monkeypatch.setattr(os, "link", killing("os.link", os.link))
    monkeypatch.setattr(shutil, "rmtree", killing("rmtree", shutil.rmtree))
    monkeypatch.setattr(Path, "unlink", killing("unlink", Path.unlink))
    monkeypatch.setattr(torch, "save", killing("torch.save", torch.save))
    try:
        _save(tmp_path, 2, policies, keep=1)
        killed = False
    except _Killed:
        killed = True
    monkeypatch.undo()
    assert killed == (kill_at < WRITE_OPERATIONS) and len(calls) == min(kill_at + 1, WRITE_OPERATIONS), calls
    last = load_checkpoint(tmp_path / "last.ckpt")
    assert last["counters"]["global_step"] in (1, 2)
    for step_file in tmp_path.glob("step=*.ckpt"):
        assert load_checkpoint(step_file)["counters"]["global_step"] == int(step_file.stem.split("=")[1])


def test_a_manifest_never_takes_a_part_of_another_step(tmp_path):
    policies = _policies()
    _save(tmp_path, 1, policies, keep=5)
    _save(tmp_path, 2, policies, keep=5)
    shutil.copy(tmp_path / "step=1.parts" / "a.pt", tmp_path / "step=2.parts" / "a.pt")  # a stray older part
    with pytest.raises(CheckpointError, match=r"is not the part the manifest names \(policy 'a', step 2; "
                                              r"the file holds \('a', 1\)\)"):
        load_checkpoint(tmp_path / "last.ckpt")


def test_a_part_removed_after_its_manifest_was_read_is_named_with_the_fix(tmp_path):
    policies = _policies()
    _save(tmp_path, 1, policies, keep=1)
    state = load_checkpoint(tmp_path / "last.ckpt", policies=())
    assert state["policies"] == {} and list(state["parts"]) == ["a", "b/odd name"]
    _save(tmp_path, 2, policies, keep=1)  # the run moved on: step 1's parts are gone
    with pytest.raises(CheckpointError, match="replaced by a newer checkpoint while it was read") as info:
        load_policy_parts(state, ["a"], tmp_path / "last.ckpt")
    assert info.value.replaced
    assert load_checkpoint(tmp_path / "last.ckpt")["counters"]["global_step"] == 2
    (tmp_path / "step=2.parts" / "a.pt").unlink()
    with pytest.raises(CheckpointError, match=r"is missing\. A checkpoint is its manifest \(last.ckpt\) and its "
                                              r"folder step=2.parts/ beside it: copy or keep both\.$"):
        load_checkpoint(tmp_path / "last.ckpt")


def test_a_single_file_checkpoint_of_format_two_still_resumes_exactly(write_tiny_config):
    """A checkpoint as versions 1-2 wrote it (every policy in one file) resumes as the parts of version 3 do."""
    from mrl_lightning.run.checkpoint import atomic_save
    from mrl_lightning.cli import main

    straight = write_tiny_config("a.yaml", modify=lambda c: c["trainer"].update(max_steps=2, version="straight"))
    assert main(["fit", "--config", str(straight)]) == 0
    folder = straight.parent / "runs" / "straight" / "checkpoints"
    old = load_checkpoint(folder / "step=1.ckpt")
    old.pop("parts")
    old["version"] = 2
    atomic_save(old, straight.parent / "old.ckpt")
    resumed = write_tiny_config("b.yaml", modify=lambda c: c["trainer"].update(max_steps=2, version="resumed"))
    assert main(["fit", "--config", str(resumed), "--ckpt_path", str(straight.parent / "old.ckpt")]) == 0
    a = load_checkpoint(folder / "last.ckpt")
    b = load_checkpoint(straight.parent / "runs" / "resumed" / "checkpoints" / "last.ckpt")
    for name, part in a["policies"].items():
        for key, value in part["model"].items():
            assert torch.equal(b["policies"][name]["model"][key], value), f"{name}.{key}"
    assert a["counters"] == b["counters"] and a["callbacks"] == b["callbacks"]


def test_a_manifest_copied_without_its_parts_is_refused_when_read_alone_before_any_build(tmp_path):
    # the check before the build reads the manifest only (policies=()): a missing part is named there, once,
    # not later by every worker as it restores
    _save(tmp_path / "run", 1, _policies(), keep=1)
    (tmp_path / "alone").mkdir()
    shutil.copy(tmp_path / "run" / "last.ckpt", tmp_path / "alone" / "last.ckpt")
    with pytest.raises(CheckpointError, match=r"of policy 'a' .* is missing\. A checkpoint is its manifest \(last.ckpt\) "
                                              r"and its folder step=1.parts/ beside it: copy or keep both\.$"):
        load_checkpoint(tmp_path / "alone" / "last.ckpt", policies=())
    assert load_checkpoint(tmp_path / "run" / "last.ckpt", policies=())["policies"] == {}


@pytest.mark.parametrize("compress", [False, True])
def test_a_truncated_part_is_named_before_any_build_with_the_earlier_checkpoints_to_resume_from(tmp_path, compress):
    """The check before the build (the manifest alone, ``policies=()``) reads each part's structure: a part cut
    short is named there, with the checkpoints that do not name it; last.ckpt, which names the same part, is not
    offered."""
    policies = _policies()
    for step in (1, 2):
        _save(tmp_path, step, policies, keep=2, compress=compress)
    part = tmp_path / "step=2.parts" / "a.pt"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    for given in ("last.ckpt", "step=2.ckpt"):
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(tmp_path / given, policies=())
        msg = str(info.value)
        assert msg.startswith(f"the part of policy 'a' of ckpt_path={str(tmp_path / given)!r} ({part}) cannot be "
                              "read: "), msg
        assert "truncated" in msg and "\n" not in msg
        assert msg.endswith(f"Resume from an earlier checkpoint: --ckpt_path {tmp_path / 'step=1.ckpt'} (the "
                            "readable checkpoints in its folder that do not name this part: step=1.ckpt)."), msg
    (tmp_path / "step=1.ckpt").unlink()
    with pytest.raises(CheckpointError, match=r"no other checkpoint in .* names another step: restore the file from a "
                                              r"copy, or start the run again without --ckpt_path\.$"):
        load_checkpoint(tmp_path / "last.ckpt", policies=())


def test_every_rename_of_a_checkpoint_file_is_followed_by_a_flush_of_its_folder(tmp_path, monkeypatch):
    """A rename is an entry of the folder: until the folder is flushed a crash can undo it on some file systems.
    Each ``os.replace`` of a part, a manifest or the step file's link is followed by an fsync of its folder (and a
    new parts folder's by one of the checkpoints folder); the step files' removal is flushed before any part goes."""
    import stat

    policies = _policies()
    _save(tmp_path, 1, policies, keep=1)
    events = []
    real_fsync, real_replace, real_rmtree, real_unlink = os.fsync, os.replace, shutil.rmtree, Path.unlink

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            events.append(("fsync_dir", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", lambda src, dst: (events.append(("replace", Path(dst))), real_replace(src, dst)))
    monkeypatch.setattr(shutil, "rmtree", lambda p, **k: (events.append(("rmtree", Path(p))), real_rmtree(p, **k)))
    monkeypatch.setattr(Path, "unlink", lambda p, *a: (events.append(("unlink", p)), real_unlink(p, *a)))
    _save(tmp_path, 2, policies, keep=1)
    monkeypatch.undo()
    replaced = [i for i, (kind, _) in enumerate(events) if kind == "replace"]
    assert len(replaced) == 4, events  # two parts, the manifest, the step file's link
    for i in replaced:
        assert events[i + 1] == ("fsync_dir", events[i][1].parent), events[i:i + 2]
    first_part = replaced[0]  # step=2.parts/ was made for it: its entry in the checkpoints folder is flushed too
    assert events[first_part + 2] == ("fsync_dir", tmp_path), events[first_part:first_part + 3]
    unlinked = events.index(("unlink", tmp_path / "step=1.ckpt"))
    removed = events.index(("rmtree", tmp_path / "step=1.parts"))
    assert ("fsync_dir", tmp_path) in events[unlinked + 1:removed], events[unlinked:removed + 1]


def test_a_killed_checkpoints_parts_go_at_the_next_save_but_nothing_a_manifest_names(tmp_path):
    """Parts folders no manifest names (a checkpoint killed after its parts, before its manifest) are removed
    at the run's next save; a folder that a manifest kept by hand names stays, and so does one of a later step
    (it could only be a writer's still at work)."""
    policies = _policies()
    _save(tmp_path, 1, policies, keep=1)
    shutil.copy(tmp_path / "step=1.ckpt", tmp_path / "best.ckpt")  # kept by hand: it names step=1.parts/
    (tmp_path / "step=2.parts").mkdir()  # killed after one part, and mid-way through the next
    shutil.copy(tmp_path / "step=1.parts" / "a.pt", tmp_path / "step=2.parts" / "a.pt")
    (tmp_path / "step=2.parts" / ".b%2Fodd%20name.pt.0123456789ab.tmp").write_bytes(b"\0" * 100)
    (tmp_path / "step=9.parts").mkdir()
    _save(tmp_path, 3, policies, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.ckpt", "last.ckpt", "step=1.parts", "step=3.ckpt",
                                                           "step=3.parts", "step=9.parts"]
    assert load_checkpoint(tmp_path / "best.ckpt")["counters"]["global_step"] == 1
    assert load_checkpoint(tmp_path / "last.ckpt")["counters"]["global_step"] == 3
