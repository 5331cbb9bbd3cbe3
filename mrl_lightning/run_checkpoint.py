"""What a run's checkpoint holds, how the ranks assemble and restore it, and its run folder (docs/loop.md).

A checkpoint holds, per policy, its model (every weight, or a LoRA policy's adapter only:
:meth:`~mrl_lightning.policy.PolicyModule.weights_state_dict`; an FSDP policy's full tensors,
gathered in its group) and optimizer state (from the policy's group leader), every callback's state (merged over ranks by the callback,
:meth:`~mrl_lightning.callbacks.base.MRLCallback.merge_rank_states`), the data position,
the counters, every rank's RNG states, the placement, and a fingerprint of the config
(each policy's family, kind, LoRA alpha and parameter shapes, the data parts) that a resume compares
with its own config before building anything
(:func:`~mrl_lightning.checkpoint.check_compatible`). Rank 0 writes ``last.ckpt``
atomically (:func:`mrl_lightning.checkpoint.atomic_save`) and hard-links ``step=<k>.ckpt``
to it; the others wait at a barrier. Only weights-only-loadable values go in
(tensors, numbers, strings, containers); policy states cross ranks as ``torch.save`` bytes
so tied weights stay one storage.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

from mrl_lightning.checkpoint import FORMAT_VERSION, CheckpointError, atomic_save, atomic_write
from mrl_lightning.errors import ConfigError
from mrl_lightning.mwra import rng_state, set_rng_state
from mrl_lightning.mwra.sharding import full_state, is_sharded, load_full_state
from mrl_lightning.writable import write_problem


def check_run_folder(log_dir: str, root_dir: str | None = None) -> None:
    """Refuse a run folder that already holds a run, or that cannot be written.

    Args:
        log_dir: The run folder (``<default_root_dir>/version_<n>``).
        root_dir: ``trainer.default_root_dir`` (named in the message when the folder cannot be written).

    Raises:
        ConfigError: ``log_dir`` already has a config.yaml, or no file can be created there
            (a read-only mount, no permission, a path through a file).
    """
    if (Path(log_dir) / "config.yaml").exists():
        raise ConfigError(f"the run folder {log_dir} already holds a run (config.yaml); pick another "
                          "--trainer.version, leave it unset for the next free version_<n>, or remove the folder.")
    problem = write_problem(log_dir)
    if problem is not None:
        field = f"trainer.default_root_dir={root_dir!r}" if root_dir is not None else f"the run folder {log_dir!r}"
        raise ConfigError(f"{field} cannot be written ({problem}); the run folder, its checkpoints and logs go "
                          "there. Give a folder you can write: --trainer.default_root_dir <folder>.")


def save_run_checkpoint(folder: Path, step: int, *, workers, policies: dict, optimizers: dict, callbacks: list,
                        counters: dict[str, Any], data_state: dict, compress: bool, keep: int) -> Path:
    """Gather the run's state from every rank; rank 0 writes ``last.ckpt`` and ``step=<step>.ckpt``.

    Args:
        folder: ``<run folder>/checkpoints``.
        step: The global step (names the step file).
        workers: This rank's :class:`~mrl_lightning.mwra.Workers`.
        policies: Policy name -> :class:`~mrl_lightning.policy.PolicyModule`.
        optimizers: Policy name -> its optimizer, for the policies this rank runs.
        callbacks: The callbacks, in list order.
        counters: The loop's counters (``global_step``, ``rollout_step``, ``samples_seen``, ``optimizer_steps``).
        data_state: The data module's ``state_dict()``.
        compress: gzip the file (lossless).
        keep: Step files kept besides ``last.ckpt``.

    Returns:
        The step file's path (on every rank).
    """
    path = folder / f"step={step}.ckpt"
    states, families = {}, {}
    for name in workers.local_policies:
        if is_sharded(policies[name].model):  # FSDP: every rank of the group gathers the full tensors
            part = {"model": full_state(policies[name].model.state_dict()),
                    "optimizer": full_state(optimizers[name].state_dict())}
        elif workers.is_leader(name):
            part = {"model": to_cpu(policies[name].weights_state_dict()), "optimizer": to_cpu(optimizers[name].state_dict())}
        else:
            continue
        if workers.is_leader(name):
            states[name] = part
            families[name] = getattr(getattr(policies[name].model, "config", None), "model_type", None)
    local = {"policies": states, "callbacks": {cb.state_key: cb.state_dict() for cb in callbacks}, "rng": rng_state(),
             "families": families}
    if workers.distributed:  # torch.save keeps tied weights one storage; pickling for the gather would not
        local["policies"] = {name: _pack(part) for name, part in local["policies"].items()}
    gathered = workers.gather_to_zero(local, "checkpoint")
    if gathered is not None and workers.distributed:
        for g in gathered:
            g["policies"] = {name: _unpack(part) for name, part in g["policies"].items()}
    if gathered is not None:
        state = {
            "format": "mrl-lightning", "version": FORMAT_VERSION, "counters": counters,
            "policies": {name: part for g in gathered for name, part in g["policies"].items()},
            "callbacks": {cb.state_key: cb.merge_rank_states([g["callbacks"][cb.state_key] for g in gathered])
                          for cb in callbacks},
            "data": data_state,
            "rng": {"ranks": [g["rng"] for g in gathered]},
            "placement": {"mode": workers.placement.mode,
                          "groups": {k: list(v) for k, v in workers.placement.groups.items()}},
        }
        families = {name: family for g in gathered for name, family in g["families"].items()}
        state["fingerprint"] = {  # compared with the config before a resume builds anything (check_compatible)
            "policies": {name: {"family": families.get(name), "adapter": bool(policies[name].use_peft),
                                "lora_alpha": float(policies[name].lora_alpha) if policies[name].use_peft else None,
                                "shapes": {key: list(value.shape) for key, value in part["model"].items()}}
                         for name, part in state["policies"].items()},
            "data_parts": sorted(data_state.get("position", {})),
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
    old = sorted(folder.glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    for stale in old[: -keep]:
        stale.unlink()


def restore_run_checkpoint(state: dict[str, Any], *, workers, policies: dict, optimizers: dict, callbacks: list,
                           datamodule, rank: int, note: Callable[[str], None]) -> dict[str, Any]:
    """Load a checkpoint's policies (this rank's), optimizers, callbacks, data position and RNG state.

    Args:
        state: A loaded checkpoint (:func:`mrl_lightning.checkpoint.load_checkpoint`).
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
        CheckpointError: a policy's weights do not fit the configured model.
    """
    for name in workers.local_policies:
        saved, optimizer = state["policies"][name], optimizers[name]
        # the saved param groups carry the writer's settings: this config's learning_rate, weight_decay and
        # foreach are kept (the moments and step counts are the checkpoint's), so a resume applies the lr it logs
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
    ranks = state["rng"]["ranks"]
    for line in set_rng_state(ranks[rank] if rank < len(ranks) else ranks[0]):
        note(f"Note: {line}")
    return state["counters"]


_CONFIG_SETTINGS = ("lr", "weight_decay", "foreach")
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


def _pack(state: dict[str, Any]) -> bytes:
    """``state`` as ``torch.save`` bytes: tensors that share storage (tied embeddings) stay shared."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _unpack(data: bytes) -> dict[str, Any]:
    """Inverse of :func:`_pack` (tensors and plain containers only)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def write_run_files(log_dir: str, config_text: str | None, system, datamodule) -> None:
    """The run folder's own files, written by rank 0 at the start of a run (docs/loop.md, "Run folder and logs").

    ``config.yaml`` (the resolved config) is written atomically (:func:`~mrl_lightning.checkpoint.atomic_write`):
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
