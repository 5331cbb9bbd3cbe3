"""Atomic checkpoints holding only weights-only-loadable values (docs/loop.md, "Checkpoints").

A checkpoint holds only tensors, numbers, strings, lists, tuples and dicts (no custom
classes), so it loads with ``torch.load(weights_only=True)``: :func:`load_checkpoint` reads
``--ckpt_path`` that way before any model is built (LightningCLI's own read is skipped,
``fit_cli``). Writes go to a temporary file in the same
folder, are flushed to disk, then renamed over the target, so a crash mid-write never
corrupts the last good checkpoint. With ``compress`` the file is the same ``torch.save``
bytes through gzip (zlib level 1): lossless, so resume stays exact; :func:`load_checkpoint`
tells the two apart by the gzip magic bytes, so either kind resumes whatever the setting.
"""

from __future__ import annotations

import errno
import gzip
import io
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from mrl_lightning.errors import ConfigError


GZIP_MAGIC = b"\x1f\x8b"


def atomic_save(obj: Any, path: str | Path, compress: bool = False) -> None:
    """``torch.save`` to ``path`` atomically (temp file + fsync + rename).

    Args:
        obj: Weights-only-loadable values (tensors, numbers, strings, containers).
        path: Target file; its folder is created.
        compress: Write the bytes through gzip (zlib level 1). Lossless; float32 weights and
            AdamW moments shrink by ~11% (docs/loop.md, "Checkpoints"), at ~25-30 MB/s of
            checkpoint on one core of the reference CPU.

    Raises:
        OSError: the disk filled up mid-write (``ENOSPC``; the message names the file, says
            the previous checkpoint is untouched and how to resume), or any other write error.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            if compress:
                with gzip.GzipFile(fileobj=fh, mode="wb", compresslevel=1, mtime=0) as stream:
                    torch.save(obj, stream)
            else:
                torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if _disk_full(exc):  # disk full mid-file: name the file and the fix
            kept = f"the previous {path.name} is untouched" if path.exists() else f"no earlier {path.name} exists"
            raise OSError(errno.ENOSPC, f"No space left on device while writing {path}; the partial file was "
                          f"removed and {kept}. Free disk space (or move default_root_dir), then resume with "
                          f"--ckpt_path {path.parent / 'last.ckpt'}.") from exc
        raise


def _disk_full(exc: BaseException | None) -> bool:
    """True when ``exc`` or an exception it was raised from is ``OSError(ENOSPC)``.

    torch.save's zip writer hides a failed write: its cleanup raises a ``RuntimeError``
    ("unexpected pos ...") whose context is the ``OSError`` of the write.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


FORMAT_VERSION = 2
"""Version 2: ``rng`` holds every rank's generator states (``{"ranks": [...]}``) and
``placement`` the ranks per policy; version 1 (one process) is read too."""


class CheckpointError(ConfigError):
    """``--ckpt_path`` cannot be resumed from (missing, unreadable or from another config)."""


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`atomic_save` (weights-only).

    Raises:
        CheckpointError: no file at ``path``, a folder, a truncated / corrupted file, or a
            file that is not an mrl-lightning checkpoint (each says how to fix it).
    """
    path = Path(path).expanduser()
    hint = "Checkpoints are written to <run folder>/checkpoints/ (e.g. runs/default/version_0/checkpoints/last.ckpt)."
    if path.is_dir():
        raise CheckpointError(f"ckpt_path={str(path)!r} is a folder; give a .ckpt file in it. {hint}")
    if not path.is_file():
        raise CheckpointError(f"ckpt_path={str(path)!r} does not exist. {hint}")
    try:
        with open(path, "rb") as fh:
            compressed = fh.read(2) == GZIP_MAGIC
        if compressed:  # written with compress=True: the torch.save bytes, gzipped
            with gzip.open(path, "rb") as stream:
                state = torch.load(io.BytesIO(stream.read()), map_location="cpu", weights_only=True)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same advice
        first = str(exc).splitlines()[0] if str(exc) else "empty or truncated file"
        if "weights_only" in first:  # torch's advice to unpickle arbitrary code is never right for a checkpoint
            first = "its contents are not a weights-only torch.save file"
        raise CheckpointError(
            f"ckpt_path={str(path)!r} could not be read ({type(exc).__name__}: {first}). "
            "It is truncated, corrupted or not an mrl-lightning checkpoint; resume from another file in the same "
            "checkpoints/ folder (step=<k>.ckpt or last.ckpt)."
        ) from exc
    if not isinstance(state, dict) or state.get("format") != "mrl-lightning":
        raise CheckpointError(f"ckpt_path={str(path)!r} is not an mrl-lightning checkpoint (no 'format' marker). {hint}")
    version = state.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"ckpt_path={str(path)!r} has checkpoint format version {version!r}, newer than this "
                              f"mrl-lightning reads ({FORMAT_VERSION}); upgrade mrl-lightning to resume from it.")
    if version == 1:  # one process: its RNG state becomes rank 0's
        state["rng"] = {"ranks": [dict(state["rng"], cuda=[])]}
    return state


def check_compatible(state: dict[str, Any], policy_names: list[str], max_steps: int) -> None:
    """Cheap checks of a loaded checkpoint against the config, before any model is built.

    Raises:
        CheckpointError: policy names differ, or ``max_steps`` is not above the checkpoint's step.
    """
    saved = sorted(state["policies"])
    if saved != sorted(policy_names):
        raise CheckpointError(f"the checkpoint holds policies {saved} but model.policies names {sorted(policy_names)}; "
                              "resume with the config the checkpoint was made with (its run folder's config.yaml).")
    step = int(state["counters"]["global_step"])
    if max_steps <= step:
        raise CheckpointError(f"trainer.max_steps={max_steps} is not above the checkpoint's step {step}; "
                              f"set --trainer.max_steps to more than {step} to continue training.")
