"""What a run's checkpoint holds, how the ranks write and restore it, and its run folder (docs/loop.md).

A checkpoint is a manifest, ``last.ckpt`` (hard-linked as ``step=<k>.ckpt``), and one part
file per policy, ``step=<k>.parts/<policy>.pt``. A part holds the policy's model (every
weight, or a LoRA policy's adapter only: :meth:`~mrl_lightning.policy.PolicyModule.weights_state_dict`;
an FSDP policy's full tensors, gathered in its group) and optimizer state, and is written by
the policy's group leader itself: no policy's state crosses to rank 0. The manifest holds
what is small and shared: every callback's state (merged over ranks by the callback,
:meth:`~mrl_lightning.callbacks.base.MRLCallback.merge_rank_states`), the data position, the
counters, every rank's RNG states, the placement, the parts' file names and a fingerprint of
the config (each policy's family, kind, LoRA alpha and parameter shapes, the data parts) that a resume
compares with its own config before building anything
(:func:`~mrl_lightning.run.checkpoint.check_compatible`); rank 0 gathers it and writes it.

Order, so that a reader never sees a manifest naming parts of two steps, and a kill at any
moment leaves the previous checkpoint whole: every leader writes its parts atomically
(:func:`mrl_lightning.run.checkpoint.atomic_save`) into the new step's own folder; only then
does it send its small state to rank 0 (so rank 0 has it only once every part is on disk);
rank 0 writes the manifest atomically over ``last.ckpt``, links the step file to it, and
only then removes the step files beyond ``keep_checkpoints`` and the parts folders no
remaining manifest names; the others wait at a barrier. Only weights-only-loadable values
go in (tensors, numbers, strings, containers).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from urllib.parse import quote
from typing import Any, Callable

import torch

from mrl_lightning.run.checkpoint import (FORMAT_VERSION, PART_FORMAT, CheckpointError, atomic_save, atomic_write,
                                       load_policy_parts, read_manifest)
from mrl_lightning.errors import ConfigError
from mrl_lightning.mwra import rng_state, set_rng_state
from mrl_lightning.mwra.sharding import full_state, is_sharded, load_full_state
from mrl_lightning.writable import fsync_dir, write_problem


def check_run_folder(log_dir: str, root_dir: str | None = None) -> None:
    """Refuse a run folder that already holds a run, or that cannot be written.

    Args:
        log_dir: The run folder (``<default_root_dir>/version_<n>``).
        root_dir: ``trainer.default_root_dir`` (named in the message when the folder cannot be written).

    Raises:
        ConfigError: ``log_dir`` already has a config.yaml, or no file can be created there
            (a read-only mount, no permission, a path through a file).
    """
    if root_dir is not None and not str(root_dir).strip():
        raise ConfigError(f"trainer.default_root_dir={root_dir!r} is empty: the run folder would be made in the current "
                          "folder, and the printed paths would be relative to it. Give a folder: "
                          "--trainer.default_root_dir runs/<name> (or leave it unset for 'runs').")
    if (Path(log_dir) / "config.yaml").exists():
        raise ConfigError(f"the run folder {log_dir} already holds a run (config.yaml); pick another "
                          "--trainer.version, leave it unset for the next free version_<n>, or remove the folder.")
    problem = write_problem(log_dir)
    if problem is not None:
        field = f"trainer.default_root_dir={root_dir!r}" if root_dir is not None else f"the run folder {log_dir!r}"
        raise ConfigError(f"{field} cannot be written ({problem}); the run folder, its checkpoints and logs go "
                          "there. Give a folder you can write: --trainer.default_root_dir <folder>.")


def complete_run_line(ckpt_path: str | None, max_steps: int) -> str | None:
    """The line that says a resumed run has nothing to train, or None when it has.

    A job killed after its last checkpoint and requeued (SLURM preemption) runs the same
    command again, ``--ckpt_path`` at ``trainer.max_steps``: the run is complete, and ``mrl
    fit`` says so and ends with status 0 before any model is built or run folder made, as
    Lightning's ``fit`` stops at ``max_steps`` (docs/loop.md, "Resuming: what the config may
    change"). Only the manifest is read.

    Args:
        ckpt_path: ``--ckpt_path``, or None (a new run: never complete).
        max_steps: ``trainer.max_steps``.

    Returns:
        ``The run is complete: ckpt_path='...' is at step 48, which is trainer.max_steps; nothing
        to train (...)`` when the checkpoint's step is ``max_steps``; None otherwise (a step
        beyond ``max_steps`` is refused later, by :func:`~mrl_lightning.run.checkpoint.check_compatible`).

    Raises:
        CheckpointError: ``ckpt_path`` is empty (``--ckpt_path ''``, what an unset ``$CKPT`` gives:
            it would start a new run silently), or the manifest is missing or unreadable.
    """
    if ckpt_path is not None and not str(ckpt_path).strip():
        raise CheckpointError(f"ckpt_path={ckpt_path!r} is empty: give a checkpoint to resume from "
                              "(--ckpt_path <run>/checkpoints/last.ckpt), or leave --ckpt_path out to start a new run.")
    if not ckpt_path:
        return None
    step = int(read_manifest(ckpt_path)["counters"]["global_step"])
    if step != max_steps:
        return None
    return (f"The run is complete: ckpt_path={str(ckpt_path)!r} is at step {step}, which is trainer.max_steps; "
            f"nothing to train (set --trainer.max_steps above {step} to train further).")


def part_file(step: int, policy: str) -> str:
    """A policy's part file of the checkpoint at ``step``, relative to the checkpoints folder
    (``step=<k>.parts/<policy>.pt``; characters other than letters, digits, ``-``, ``_`` and
    ``.`` are %-escaped, so any policy name gives one file of its own)."""
    return f"step={step}.parts/{quote(policy, safe='')}.pt"


def save_run_checkpoint(folder: Path, step: int, *, workers, policies: dict, optimizers: dict, callbacks: list,
                        counters: dict[str, Any], data_state: dict, compress: bool, keep: int) -> Path:
    """Write the run's checkpoint at ``step``: each policy's part from its group leader, the manifest from rank 0.

    The order is the module docstring's: parts, then the small state to rank 0, then the
    manifest, then the removal of what no kept checkpoint names.

    Args:
        folder: ``<run folder>/checkpoints`` (shared by every rank: on several nodes, a shared file system).
        step: The global step (names the step file and its parts folder).
        workers: This rank's :class:`~mrl_lightning.mwra.Workers`.
        policies: Policy name -> :class:`~mrl_lightning.policy.PolicyModule`.
        optimizers: Policy name -> its optimizer, for the policies this rank runs.
        callbacks: The callbacks, in list order.
        counters: The loop's counters (``global_step``, ``rollout_step``, ``samples_seen``, ``optimizer_steps``).
        data_state: The data module's ``state_dict()``.
        compress: gzip the files (lossless).
        keep: Step files kept besides ``last.ckpt``.

    Returns:
        The step file's path (on every rank).

    Raises:
        OSError: a file could not be written (disk full: :func:`~mrl_lightning.run.checkpoint.atomic_save`);
            the previous checkpoint is left whole.
    """
    path = folder / f"step={step}.ckpt"
    written = {}
    for name in workers.local_policies:
        if is_sharded(policies[name].model):  # FSDP: every rank of the group gathers the full tensors
            part = {"model": full_state(policies[name].model.state_dict()),
                    "optimizer": full_state(optimizers[name].state_dict())}
        elif workers.is_leader(name):
            part = {"model": to_cpu(policies[name].weights_state_dict()), "optimizer": to_cpu(optimizers[name].state_dict())}
        else:
            continue
        if workers.is_leader(name):
            file = part_file(step, name)
            try:
                atomic_save({"format": PART_FORMAT, "version": FORMAT_VERSION, "policy": name, "step": step, **part},
                            folder / file, compress=compress, checkpoint=folder / "last.ckpt")
            except BaseException:
                with contextlib.suppress(OSError):  # leave no empty folder of a step never written
                    (folder / file).parent.rmdir()
                raise
            written[name] = {"file": file, "family": getattr(getattr(policies[name].model, "config", None),
                                                              "model_type", None),
                             "shapes": {key: list(value.shape) for key, value in part["model"].items()}}
        del part
    local = {"parts": written, "callbacks": {cb.state_key: cb.state_dict() for cb in callbacks}, "rng": rng_state()}
    gathered = workers.gather_to_zero(local, "checkpoint")  # each rank sends once its parts are on disk
    if gathered is not None:
        found = {name: entry for g in gathered for name, entry in g["parts"].items()}
        order = [name for name in workers.placement.groups if name in found]
        state = {
            "format": "mrl-lightning", "version": FORMAT_VERSION, "counters": counters,
            "parts": {name: {"file": found[name]["file"]} for name in order},
            "callbacks": {cb.state_key: cb.merge_rank_states([g["callbacks"][cb.state_key] for g in gathered])
                          for cb in callbacks},
            "data": data_state,
            "rng": {"ranks": [g["rng"] for g in gathered]},
            "placement": {"mode": workers.placement.mode,
                          "groups": {k: list(v) for k, v in workers.placement.groups.items()}},
            "fingerprint": {  # compared with the config before a resume builds anything (check_compatible)
                "policies": {name: {"family": found[name]["family"], "adapter": bool(policies[name].use_peft),
                                    "lora_alpha": float(policies[name].lora_alpha) if policies[name].use_peft else None,
                                    "shapes": found[name]["shapes"]} for name in order},
                "data_parts": sorted(data_state.get("position", {})),
            },
        }
        _write(state, folder, path, compress, keep)
    workers.barrier("checkpoint")
    return path


def _write(state: dict[str, Any], folder: Path, path: Path, compress: bool, keep: int) -> None:
    # last.ckpt first, so it is never older than a step file; the step file is a hard
    # link to the same bytes, put in place atomically too.
    last = folder / "last.ckpt"
    atomic_save(state, last, compress=compress)
    tmp = folder / f".{path.name}.link"
    if tmp.exists():
        tmp.unlink()
    os.link(last, tmp)
    os.replace(tmp, path)
    fsync_dir(folder)
    old = sorted(folder.glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    for stale in old[: -keep]:
        stale.unlink()  # the manifest first: a step file never names a removed part
    fsync_dir(folder)  # ... also after a crash: the removals are on disk before any part goes
    remove_orphan_parts(folder, state, int(state["counters"]["global_step"]))


def remove_orphan_parts(folder: Path, state: dict[str, Any], step: int) -> None:
    """Remove the parts folders of this run's checkpoints folder that no manifest names (docs/loop.md, "Checkpoints").

    A removed step's parts, and those a checkpoint killed or stopped after its parts and before its
    manifest left (``step=<k>.parts/`` with whole parts or a ``.tmp`` one). Never one a manifest in
    ``folder`` names: ``state``'s (just written), a step file's (by its name) or any other ``*.ckpt``'s
    (a copy kept by hand: read for its ``parts``; one that cannot be read keeps every folder); nor
    one of a step at or after ``step``, which only a writer still at work could be filling.

    Args:
        folder: ``<run folder>/checkpoints``.
        state: The manifest just written as ``last.ckpt``.
        step: Its step.
    """
    named = {Path(entry["file"]).parent.name for entry in state["parts"].values()}
    named |= {f"{p.stem}.parts" for p in folder.glob("step=*.ckpt")}
    for kept in folder.glob("*.ckpt"):
        if kept.name != "last.ckpt" and not kept.name.startswith("step="):
            try:
                named |= {Path(entry["file"]).parent.name for entry in read_manifest(kept).get("parts", {}).values()}
            except (CheckpointError, AttributeError, KeyError, TypeError):
                return  # what it names is unknown: nothing is removed
    for parts in folder.glob("step=*.parts"):
        k = parts.name[len("step="):-len(".parts")]
        if parts.name not in named and k.isdigit() and int(k) < step:
            shutil.rmtree(parts, ignore_errors=True)


def restore_run_checkpoint(state: dict[str, Any], path: str | Path, *, workers, policies: dict, optimizers: dict,
                           callbacks: list, datamodule, rank: int, note: Callable[[str], None]) -> dict[str, Any]:
    """Load a checkpoint's policies (this rank's), optimizers, callbacks, data position and RNG state.

    Args:
        state: A loaded checkpoint (:func:`mrl_lightning.run.checkpoint.load_checkpoint`; its manifest suffices).
        path: The file ``state`` was read from (``--ckpt_path``): its parts are named relative to its folder.
        workers: This rank's :class:`~mrl_lightning.mwra.Workers`.
        policies: Policy name -> policy (built).
        optimizers: Policy name -> its optimizer, for this rank's policies.
        callbacks: The callbacks.
        datamodule: The data module.
        rank: This process's global rank (its RNG state; rank 0's for a rank the checkpoint lacks).
        note: Prints a line (different callbacks, RNG notes).

    Returns:
        The checkpoint's counters.

    Raises:
        CheckpointError: a part of this rank's policies is missing, unreadable or of another
            step (:func:`~mrl_lightning.run.checkpoint.load_policy_parts`), or a policy's weights do
            not fit the configured model.

    Only this rank's policies' parts are read; each is dropped from ``state`` once loaded
    (the model holds a copy of its weights, the optimizer the moments themselves), so no
    second copy outlives the restore.
    """
    load_policy_parts(state, list(workers.local_policies), path)
    for name in workers.local_policies:
        saved, optimizer = state["policies"].pop(name), optimizers[name]
        # the saved param groups carry the writer's settings: this config's learning_rate, weight_decay,
        # foreach and fused are kept (the moments and step counts are the checkpoint's), so a resume
        # applies the lr it logs
        settings = [{key: group[key] for key in _CONFIG_SETTINGS if key in group} for group in optimizer.param_groups]
        try:
            if is_sharded(policies[name].model):  # full tensors in the checkpoint: each rank takes its shard
                load_full_state(policies[name].model, optimizer, saved["model"], saved["optimizer"])
            else:
                policies[name].load_weights_state_dict(saved["model"])
        except RuntimeError as exc:
            raise CheckpointError(
                f"policy {name!r}: the checkpoint's weights do not fit the configured model "
                f"({str(exc).splitlines()[0]} ...); resume with the config the checkpoint was made with."
            ) from exc
        if not is_sharded(policies[name].model):
            # the config's settings go into the saved groups before the load: torch places each parameter's
            # `step` by the group's fused / capturable setting as it loads (on the device for a fused group)
            for group, kept in zip(saved["optimizer"].get("param_groups", []), settings):
                group.update(kept)
            optimizer.load_state_dict(saved["optimizer"])
        for group, kept in zip(optimizer.param_groups, settings):
            group.update(kept)
    missing = [cb.state_key for cb in callbacks if cb.state_key not in state["callbacks"]]
    dropped = [key for key in state["callbacks"] if key not in {cb.state_key for cb in callbacks}]
    if missing or dropped:
        note(f"Warning: resuming with different callbacks: state for {dropped} is dropped, {missing} start fresh.")
    for cb in callbacks:
        if cb.state_key in state["callbacks"]:
            cb.load_state_dict(state["callbacks"][cb.state_key])
    datamodule.load_state_dict(state["data"])
    state["policies"].clear()  # a single-file checkpoint holds every rank's policies: none is needed any more
    ranks = state["rng"]["ranks"]
    for line in set_rng_state(ranks[rank] if rank < len(ranks) else ranks[0]):
        note(f"Note: {line}")
    return state["counters"]


_CONFIG_SETTINGS = ("lr", "weight_decay", "foreach", "fused")
"""Optimizer settings a resume takes from its config, not from the checkpoint (docs/loop.md, "Resuming")."""


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor on the CPU (CPU tensors are not copied)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def write_run_files(log_dir: str, config_text: str | None, system, datamodule) -> None:
    """The run folder's own files, written by rank 0 at the start of a run (docs/loop.md, "Run folder and logs").

    ``config.yaml`` (the resolved config) is written atomically (:func:`~mrl_lightning.run.checkpoint.atomic_write`):
    on a full disk no file is left, nor the run folder when this made it (docs/reliability.md, row 33b).
    ``model_sources.json`` holds what each policy built from a recipe that records it (a GGUF file, its sha256
    and quantization, the converted folder; docs/real_models.md).

    Raises:
        OSError: a file cannot be written (a full disk: the partial file removed).
    """
    folder = Path(log_dir)
    if config_text is not None:
        made = not folder.exists()
        text = config_text.encode("utf-8")
        try:
            atomic_write(folder / "config.yaml", lambda fh: fh.write(text), lambda: (
                "no step was trained: free disk space (or give --trainer.default_root_dir a folder on a disk with "
                "room), then run the same command again."))
        except OSError:
            if made:
                with contextlib.suppress(OSError):
                    folder.rmdir()  # still empty: the next run takes this version, as if none had started
            raise
    sources = {name: prov for name, p in system.policies.items()
               if (prov := getattr(p.model_source, "provenance", lambda *a: None)(p, datamodule))}
    if sources:
        os.makedirs(log_dir, exist_ok=True)
        (folder / "model_sources.json").write_text(json.dumps(sources, indent=2))
