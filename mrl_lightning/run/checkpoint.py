"""Atomic checkpoints holding only weights-only-loadable values (docs/loop.md, "Checkpoints").

A checkpoint holds only tensors, numbers, strings, lists, tuples and dicts (no custom
classes), so it loads with ``torch.load(weights_only=True)``: :func:`load_checkpoint` reads
``--ckpt_path`` that way before any model is built (LightningCLI's own read is skipped,
``fit_cli``). Writes go to a temporary file in the same
folder, are flushed to disk, then renamed over the target (:func:`atomic_write`, which
writes the run's ``config.yaml`` too), so a crash or a full disk mid-write never corrupts
the last good checkpoint nor leaves a partial file. With ``compress`` the file is the same
``torch.save`` bytes through gzip (zlib level 1): lossless, so resume stays exact; :func:`load_checkpoint`
tells the two apart by the gzip magic bytes, so either kind resumes whatever the setting.

Layout (format version 3): ``last.ckpt`` / ``step=<k>.ckpt`` is the checkpoint's *manifest*
(counters, callbacks, data, RNG, placement, fingerprint and ``parts``: policy name ->
its part file); each policy's weights and optimizer state are a *part* of their own,
``step=<k>.parts/<policy>.pt``, written by the policy's group leader
(:mod:`mrl_lightning.run.state`). A part names its policy and step, and every part
is complete on disk before the manifest that names it is renamed into place, so a
manifest never names parts of another step or a part still being written.
:func:`load_checkpoint` reads the manifest and the parts asked for; versions 1 and 2 (one
file holding every policy) still load.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import io
import os
import secrets
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch

from mrl_lightning.errors import ConfigError
from mrl_lightning.writable import GZIP_MAGIC, disk_full_in, file_damage, free_space_text, fsync_dir


def atomic_save(obj: Any, path: str | Path, compress: bool = False, checkpoint: str | Path | None = None) -> None:
    """``torch.save`` to ``path`` atomically (temp file + fsync + rename: :func:`atomic_write`).

    Args:
        obj: Weights-only-loadable values (tensors, numbers, strings, containers).
        path: Target file; its folder is created.
        compress: Write the bytes through gzip (zlib level 1). Lossless; float32 weights and
            AdamW moments shrink by ~11% (docs/loop.md, "Checkpoints"), at ~25-30 MB/s of
            checkpoint on one core of the reference CPU.
        checkpoint: The manifest (``last.ckpt``) this file is a part of, named in the disk-full
            message; None = ``path`` itself.

    Raises:
        OSError: the disk filled up mid-write (``ENOSPC``; the message names the file and the
            disk, says whether an earlier ``path`` is there to resume from, untouched, and what to
            do: docs/reliability.md, row 33), or any other write error.
    """
    def write(fh) -> None:
        if compress:
            with gzip.GzipFile(fileobj=fh, mode="wb", compresslevel=1, mtime=0) as stream:
                torch.save(obj, stream)
        else:
            torch.save(obj, fh)

    path = Path(path)
    last = Path(checkpoint) if checkpoint is not None else path  # the file a resume names (a part's manifest)
    room = "free disk space (or move trainer.default_root_dir to a disk with room)"
    atomic_write(path, write, lambda: (
        f"the previous {last.name} is untouched: {room}, then resume with --ckpt_path {last}." if last.exists() else
        f"no earlier {last.name} exists, so this run cannot be resumed: {room}, then start the run again."))


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None], if_full: Callable[[], str]) -> None:
    """``write(fh)`` to ``path`` atomically: a temporary file in the same folder, flushed to disk, renamed over
    it, and the folder flushed so the rename survives a crash (:func:`~mrl_lightning.writable.fsync_dir`).

    Args:
        path: Target file; its folder is created.
        write: Writes the bytes to the open binary file.
        if_full: What exists and what to do, for the message when the disk fills up
            (called after the partial file is removed; e.g. "the previous last.ckpt is untouched: ...").

    Raises:
        OSError: ``ENOSPC`` (the disk filled up mid-write: ``path`` was not touched, the partial
            file is removed; the message names the file, the disk and ``if_full()``), or any other
            write error (the partial file removed too).
    """
    path = Path(path)
    made = not path.parent.is_dir()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)  # the rename itself on disk (and the folder's own entry, when made here)
        if made:
            fsync_dir(path.parent.parent)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if disk_full_in(exc) is not None:  # disk full mid-file: name the file, what is left and the fix
            disk = free_space_text(path.parent)
            raise OSError(errno.ENOSPC, f"No space left on device while writing {path} ({disk}); the partial file "
                          f"was removed and {if_full()}") from exc
        raise


FORMAT_VERSION = 3
"""Version 3: a manifest plus one part file per policy (``parts``; module docstring). Version 2:
one file, ``rng`` holding every rank's generator states (``{"ranks": [...]}``) and ``placement``
the ranks per policy; version 1 (one process). All three are read."""

PART_FORMAT = "mrl-lightning-part"
"""The ``format`` marker of a policy's part file."""

_HINT = "Checkpoints are written to <run folder>/checkpoints/ (e.g. runs/default/version_0/checkpoints/last.ckpt)."


class CheckpointError(ConfigError):
    """``--ckpt_path`` cannot be resumed from (missing, unreadable or from another config)."""


def _read(path: Path, what: str, manifest: Path | None = None, step: int | None = None) -> Any:
    """``torch.load`` (weights-only) of a plain or gzipped file; any failure is :func:`_unreadable`'s error."""
    try:
        return _torch_load(path)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same advice
        raise _unreadable(path, what, manifest or path, step, exc) from exc


def _torch_load(path: Path) -> Any:
    with open(path, "rb") as fh:
        compressed = fh.read(2) == GZIP_MAGIC
    if compressed:  # written with compress=True: the torch.save bytes, gzipped
        with gzip.open(path, "rb") as stream:
            return torch.load(io.BytesIO(stream.read()), map_location="cpu", weights_only=True)
    return torch.load(path, map_location="cpu", weights_only=True)


def _unreadable(path: Path, what: str, manifest: Path, step: int | None, exc: Exception | None = None
                ) -> CheckpointError:
    """The error for ``path`` that cannot be read: what is wrong with it (:func:`~mrl_lightning.writable.file_damage`)
    and the checkpoints of its folder to resume from instead, those that do not name this file
    (docs/reliability.md, "Checkpoints and the exchange log")."""
    damage = file_damage(path)
    if damage is not None and damage[0] == "foreign" and step is None:  # the manifest given: no part of ours
        return CheckpointError(f"{what} is not a checkpoint of mrl-lightning: {damage[1]}; a checkpoint is what mrl "
                               "fit writes in <run folder>/checkpoints/ (last.ckpt or step=<k>.ckpt), a torch.save "
                               "file, plain or gzipped. Give --ckpt_path one of those.")
    if damage is not None:
        why = damage[1]
    else:  # whole as a file, yet torch could not read it
        first = str(exc).splitlines()[0] if exc is not None and str(exc) else "no detail"
        if "weights_only" in first:  # torch's advice to unpickle arbitrary code is never right for a checkpoint
            first = "its contents are not a weights-only torch.save file"
        why = f"{type(exc).__name__}: {first}; it is truncated, corrupted or not an mrl-lightning checkpoint"
    others = []  # the checkpoints beside the manifest that read and name another step's parts
    for other in manifest.parent.glob("*.ckpt"):
        with contextlib.suppress(Exception):  # an unreadable one is no way out: left unnamed
            if not (manifest.exists() and os.path.samefile(other, manifest)) and file_damage(other) is None:
                k = int(_torch_load(other)["counters"]["global_step"])
                if k != step:
                    others.append((k, other))
    if not others:
        return CheckpointError(f"{what} cannot be read: {why}. There is no other checkpoint in {manifest.parent} "
                               "that names another step: restore the file from a copy, or start the run again "
                               "without --ckpt_path.")
    others.sort(key=lambda o: (o[0], o[1].name != "last.ckpt"))
    which = "that do not name this part" if step is not None else "besides this one"
    earlier = "an earlier" if step is not None and others[-1][0] < step else "another"
    return CheckpointError(f"{what} cannot be read: {why}. Resume from {earlier} checkpoint: --ckpt_path "
                           f"{others[-1][1]} (the readable checkpoints in its folder {which}: "
                           f"{', '.join(o[1].name for o in others)}).")


def load_checkpoint(path: str | Path, policies: list[str] | tuple[str, ...] | None = None) -> dict[str, Any]:
    """Load a checkpoint written by :mod:`mrl_lightning.run.state` (weights-only; docs/loop.md, "Checkpoints").

    Args:
        path: ``last.ckpt`` or ``step=<k>.ckpt`` (a manifest, or an older single file).
        policies: The policies whose parts to load into ``state["policies"]`` (names the
            checkpoint does not hold are ignored); None = every policy, ``()`` = the manifest
            only (:func:`load_policy_parts` loads parts later). A single-file checkpoint holds
            every policy whatever is asked.

    Returns:
        The checkpoint: ``counters``, ``policies`` (name -> ``{"model", "optimizer"}``, those
        loaded), ``callbacks``, ``data``, ``rng``, ``placement``, ``fingerprint`` and, from
        version 3, ``parts``.

    Raises:
        CheckpointError: no file at ``path``, a folder, a truncated / corrupted file, a file that
            is not an mrl-lightning checkpoint, or a part missing or of another step (each says
            how to fix it).
    """
    path = Path(path).expanduser()
    for attempt in range(3):
        state = _load_manifest(path)
        try:
            load_policy_parts(state, checkpoint_policies(state) if policies is None else list(policies), path)
            if policies is not None and not list(policies):  # the manifest only: its parts must be there still
                check_parts_present(state, path)
            return state
        except CheckpointError as exc:
            # the run replaced this manifest and removed the parts it named while we read them: read it again
            if not getattr(exc, "replaced", False) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _load_manifest(path: Path) -> dict[str, Any]:
    field = f"ckpt_path={str(path)!r}"
    if path.is_dir():
        raise CheckpointError(f"{field} is a folder; give a .ckpt file in it. {_HINT}")
    try:
        state = _read(path, field)
    except FileNotFoundError:
        raise CheckpointError(f"{field} does not exist. {_HINT}") from None
    if not isinstance(state, dict) or state.get("format") != "mrl-lightning":
        raise CheckpointError(f"{field} is not an mrl-lightning checkpoint (no 'format' marker). {_HINT}")
    version = state.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{field} has checkpoint format version {version!r}, newer than this "
                              f"mrl-lightning reads ({FORMAT_VERSION}); upgrade mrl-lightning to resume from it.")
    if version == 1:  # one process: its RNG state becomes rank 0's
        state["rng"] = {"ranks": [dict(state["rng"], cuda=[])]}
    state.setdefault("policies", {})
    return state


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The checkpoint at ``path``, its manifest alone: no part is read, nor checked to be there.

    ``mrl fit`` reads its step before anything else of a resume (a checkpoint at exactly
    ``trainer.max_steps`` is a complete run: docs/loop.md, "Resuming: what the config may change");
    a save reads the manifests kept beside its own for the parts they name.

    Raises:
        CheckpointError: ``path`` is missing, unreadable or not a checkpoint (as :func:`load_checkpoint`).
    """
    return _load_manifest(Path(path).expanduser())


def checkpoint_policies(state: dict[str, Any]) -> list[str]:
    """The policy names a checkpoint holds (its parts' from version 3, else its ``policies``), in its order."""
    return list(state["parts"]) if isinstance(state.get("parts"), dict) else list(state["policies"])


def _missing_part(manifest: Path, state: dict[str, Any], name: str) -> CheckpointError:
    """The error for policy ``name``'s part file of ``manifest`` not being there."""
    file = manifest.parent / state["parts"][name]["file"]
    replaced = _replaced(manifest, state)
    error = CheckpointError(
        f"the part of policy {name!r} of ckpt_path={str(manifest)!r} ({file}) is missing. A checkpoint is its "
        f"manifest ({manifest.name}) and its folder {Path(state['parts'][name]['file']).parent}/ beside it: copy "
        "or keep both" + ("; this manifest was replaced by a newer checkpoint while it was read, read it again."
                          if replaced else "."))
    error.replaced = replaced
    return error


def check_parts_present(state: dict[str, Any], path: str | Path) -> None:
    """Every part file the manifest names is there and whole: the check before any build, on every rank.

    Each part's structure is read, nothing unpickled (:func:`~mrl_lightning.writable.file_damage`: a plain
    file's zip directory at its end; a gzipped file's stream to its end marker, the one cost that grows
    with the part), so a truncated part stops the run before a model is built or a run folder made.

    Raises:
        CheckpointError: a part file is missing, or truncated / not a checkpoint file (as
            :func:`load_policy_parts` would say, later), with the earlier checkpoints to resume from.
    """
    parts = state.get("parts")
    if not isinstance(parts, dict):
        return
    manifest = Path(path).expanduser()
    for name in parts:
        file = manifest.parent / parts[name]["file"]
        if not file.is_file():
            raise _missing_part(manifest, state, name)
        if file_damage(file) is not None:
            raise _unreadable(file, f"the part of policy {name!r} of ckpt_path={str(manifest)!r} ({file})", manifest,
                              int(state["counters"]["global_step"]))


def load_policy_parts(state: dict[str, Any], names: list[str], path: str | Path) -> None:
    """Load the named policies' part files into ``state["policies"]`` (already there: left as they are).

    Args:
        state: A checkpoint from :func:`load_checkpoint` (its ``parts``).
        names: Policy names; those the checkpoint does not hold are skipped.
        path: The manifest ``state`` was read from (its parts are named relative to its folder).

    Raises:
        CheckpointError: a part file is missing (with ``replaced`` True when the manifest at
            ``path`` is no longer ``state``'s: its run wrote a newer checkpoint and removed the
            old parts), unreadable, or of another policy or step than the manifest names.
    """
    parts = state.get("parts")
    if not isinstance(parts, dict):
        return  # a single file: every policy is in it
    manifest = Path(path).expanduser()
    step = int(state["counters"]["global_step"])
    for name in names:
        if name in state["policies"] or name not in parts:
            continue
        file = manifest.parent / parts[name]["file"]
        what = f"the part of policy {name!r} of ckpt_path={str(manifest)!r} ({file})"
        try:
            part = _read(file, what, manifest, step)
        except FileNotFoundError:
            raise _missing_part(manifest, state, name) from None
        if not isinstance(part, dict) or part.get("format") != PART_FORMAT or part.get("policy") != name \
                or int(part.get("step", -1)) != step:
            got = (part.get("policy"), part.get("step")) if isinstance(part, dict) else None
            raise CheckpointError(f"{what} is not the part the manifest names (policy {name!r}, step {step}; the file "
                                  f"holds {got}); resume from another step=<k>.ckpt in the same folder.")
        state["policies"][name] = {"model": part["model"], "optimizer": part["optimizer"]}


def _replaced(manifest: Path, state: dict[str, Any]) -> bool:
    """Whether the manifest at ``manifest`` now names other parts or another step than ``state``."""
    try:
        now = _read(manifest, str(manifest))
    except (FileNotFoundError, CheckpointError):
        return True
    return now.get("parts") != state.get("parts") or now.get("counters") != state.get("counters")


def fingerprint(state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint says about the config that made it: policy names, each policy's family and
    parameter shapes, whether it holds a LoRA adapter (and its ``lora_alpha``, written since it was
    added), the data parts.

    Read from the checkpoint's ``fingerprint`` entry (written since it was added), else
    derived from the weights and the data position it holds (older checkpoints).

    Returns:
        ``{"policies": {name: {"family": str | None, "adapter": bool, "shapes": {param: [dims]}}},
        "data_parts": [names]}``.
    """
    if isinstance(state.get("fingerprint"), dict):
        return state["fingerprint"]
    policies = {}
    for name, part in state.get("policies", {}).items():
        weights = part.get("model", {}) if isinstance(part, dict) else {}
        policies[name] = {"family": None, "adapter": any("lora_" in key for key in weights),
                          "shapes": {key: list(value.shape) for key, value in weights.items()
                                     if isinstance(value, torch.Tensor)}}
    return {"policies": policies, "data_parts": sorted(state.get("data", {}).get("position", {}))}


def shape_differences(saved: dict[str, list[int]], expected: dict[str, tuple[int, ...]],
                      open_size: int | None = None) -> list[str]:
    """How a checkpoint's parameter shapes differ from a configured model's (empty when they fit).

    Args:
        saved: Parameter name -> shape in the checkpoint.
        expected: Parameter name -> shape of the configured model (counted on the meta device).
        open_size: A size known only once the model is built (a recipe's vocabulary, counted
            at the size asked for: its tokenizer is trained at build time and may stop below
            it): an expected dimension of this size accepts any size.
    """
    missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    out = []
    if missing:
        out.append(f"{len(missing)} parameter(s) of this config are not in the checkpoint, e.g. {missing[:2]}")
    if extra:
        out.append(f"{len(extra)} parameter(s) of the checkpoint are not in this config, e.g. {extra[:2]}")

    def fits(have: list[int], want: tuple[int, ...]) -> bool:
        return len(have) == len(want) and all(
            h == w or (open_size is not None and w == open_size and h >= 1) for h, w in zip(have, want))

    differ = [key for key in sorted(set(saved) & set(expected)) if not fits(list(saved[key]), tuple(expected[key]))]
    if differ:
        key = differ[0]
        out.append(f"{len(differ)} parameter(s) differ in shape, e.g. {key} is {list(saved[key])} in the checkpoint "
                   f"and {list(expected[key])} in this config")
    return out


def check_compatible(state: dict[str, Any], policy_names: list[str], max_steps: int, *,
                     data_parts: list[str] | None = None, models: dict[str, dict[str, Any]] | None = None,
                     path: str | Path | None = None) -> None:
    """Checks of a loaded checkpoint against the config, before any model is built.

    Args:
        state: The loaded checkpoint.
        policy_names: ``model.policies`` names.
        max_steps: ``trainer.max_steps``.
        data_parts: The data module's part names (None: not checked).
        models: Policy name -> ``{"family": ..., "adapter": bool, "lora_alpha": float | None,
            "shapes": {param: shape}, "open_size": int | None}`` of the configured model (policies
            left out are not checked; ``open_size``: :func:`shape_differences`; ``lora_alpha`` is
            compared when both sides have one, older checkpoints have none).
        path: The checkpoint's file (named in the message, with its run folder's config.yaml).

    Raises:
        CheckpointError: policy names, data parts, a model's family, kind (full / LoRA adapter),
            LoRA ``lora_alpha`` or parameter shapes differ (all differences at once), or ``max_steps``
            is below the checkpoint's step. At exactly its step nothing is refused: the run is complete
            (:func:`read_manifest`; docs/loop.md, "Resuming: what the config may change").
    """
    made_with = (str(Path(path).expanduser().absolute().parent.parent / "config.yaml") if path is not None
                 else "its run folder's config.yaml")
    field = f"ckpt_path={str(path)!r}" if path is not None else "the checkpoint"
    saved = sorted(checkpoint_policies(state))
    if saved != sorted(policy_names):  # a replay's checkpoint holds the policies it trained (docs/see.md, "Replay")
        fix = (f"it is a replay's: resume it with mrl replay --policies {saved}, or from one of the run's checkpoints"
               if set(saved) < set(policy_names) else f"resume with the config the checkpoint was made with ({made_with})")
        raise CheckpointError(f"the checkpoint holds policies {saved} but model.policies names {sorted(policy_names)}; {fix}.")
    found = fingerprint(state)
    problems = []
    if data_parts is not None and found.get("data_parts") and sorted(found["data_parts"]) != sorted(data_parts):
        problems.append(f"data.parts: the checkpoint's parts are {sorted(found['data_parts'])}, this config's "
                        f"{sorted(data_parts)}")
    for name, want in (models or {}).items():
        have = found["policies"].get(name, {})
        if have.get("family") and want.get("family") and have["family"] != want["family"]:
            problems.append(f"policy {name!r}: the checkpoint holds a {have['family']} model, this config builds a "
                            f"{want['family']} model")
            continue
        if bool(have.get("adapter")) != bool(want.get("adapter")):
            kinds = ("a LoRA adapter", "every weight")
            problems.append(f"policy {name!r}: the checkpoint holds {kinds[0] if have.get('adapter') else kinds[1]}, "
                            f"this config trains {kinds[0] if want.get('adapter') else kinds[1]} (use_peft)")
            continue
        if None not in (have.get("lora_alpha"), want.get("lora_alpha")) and have["lora_alpha"] != want["lora_alpha"]:
            problems.append(f"policy {name!r}: the checkpoint's LoRA adapter has lora_alpha={have['lora_alpha']:g}, "
                            f"this config lora_alpha={want['lora_alpha']:g} (the adapter's output is scaled by "
                            "lora_alpha / lora_r: the resumed model would not be the saved one)")
        if want.get("shapes") is not None and have.get("shapes"):
            for line in shape_differences(have["shapes"], want["shapes"], want.get("open_size")):
                problems.append(f"policy {name!r}: {line}")
    if problems:
        raise CheckpointError(f"{field} does not fit this config:\n  - " + "\n  - ".join(problems)
                              + f"\nResume with the config the checkpoint was made with ({made_with}), or start "
                              "a new run without --ckpt_path.")
    step = int(state["counters"]["global_step"])
    if max_steps < step:  # at exactly max_steps the run is complete: the trainer says so and trains nothing
        raise CheckpointError(f"trainer.max_steps={max_steps} is below the checkpoint's step {step}; set "
                              f"--trainer.max_steps to {step} (the run is complete there) or more to continue "
                              "training from it.")
