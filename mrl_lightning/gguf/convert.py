"""A GGUF file converted once into an ordinary ``save_pretrained`` folder (docs/real_models.md).

transformers loads a GGUF file itself (``from_pretrained(folder, gguf_file=name)``, with the
``gguf`` package installed) and dequantizes every tensor to the dtype asked for: 17-42 s for
SmolLM2-135M and 42-116 s for Gemma 3 270M on one thread here, against seconds for a saved
folder. Such a model cannot be saved (``save_pretrained`` raises "The model is quantized with
gguf and is not serializable"), and its config carries the GGUF ``quantization_config``
(left in a saved folder, transformers' Trainer, and so TRL, refuses to fine-tune it as
"purely quantized"). :func:`convert_gguf` therefore, as measured in the project's field notes:

1. loads the tokenizer and the model (float32) from the file;
2. builds a fresh model of the same class from the config without ``quantization_config``
   and loads the state dict into it (strict: every key must match), keeping the file's
   generation config (its EOS id);
3. writes config, generation config, weights (``safetensors``; a tied head once, as
   ``save_pretrained`` writes it) and tokenizer into ``out`` (written directly rather than by
   ``save_pretrained``, which writes nothing on a rank other than 0 once
   ``torch.distributed`` is initialized, where a policy group's leader may be), and
   ``gguf_source.json``, the provenance: the file, its sha256, the quantization it was
   dequantized from, the versions that converted it.

The caller (:class:`~mrl_lightning.gguf.GGUFModel`) writes into a temporary folder beside the
cache entry and renames it, so an interrupted conversion never leaves a half-written entry.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Callable

from mrl_lightning.gguf.files import GGUFFileError, file_type_name, read_header, sha256_of, tensor_types

PROVENANCE = "gguf_source.json"
FORMAT = 1  # of the converted folder and its provenance; part of the cache key


@contextmanager
def quiet_bars() -> Iterator[None]:
    """transformers' progress bars off for the block (the dequantization bar writes hundreds of
    lines into a log); restored afterwards."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def convert_gguf(gguf_path: Path, out: Path, source: dict, log: Callable[[str], None] = print) -> dict:
    """Convert ``gguf_path`` into the folder ``out`` (created; it must not hold a model yet).

    Args:
        gguf_path: The ``.gguf`` file.
        out: The folder to write (a temporary one the caller renames).
        source: What the file is, recorded in the provenance (``{"kind": "package", "package": ...,
            "version": ...}`` or ``{"kind": "file"}``).
        log: Where the progress line goes.

    Returns:
        The provenance written to ``out/gguf_source.json``: ``{"format", "source", "file", "bytes",
        "sha256", "quantization": {"file_type", "tensor_types"}, "dequantized_to", "architecture",
        "model_class", "parameters", "vocab_size", "converted_with", "seconds", "created"}``.

    Raises:
        GGUFFileError: the file is not GGUF, or transformers / gguf cannot read it (damaged,
            truncated, or an architecture transformers does not load from GGUF).
    """
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    header = read_header(gguf_path)
    types = tensor_types(gguf_path)
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        with quiet_bars():
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - named with its cause: the file, not the caller, is at fault
        raise GGUFFileError(f"{str(gguf_path)!r} could not be loaded by transformers from GGUF "
                            f"({type(exc).__name__}: {str(exc)[:300]}); the file is damaged or of an architecture "
                            "transformers does not read from GGUF (its architecture: "
                            f"{header.get('general.architecture')!r}).") from exc
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a plain float32 model now (TRL refuses a "purely quantized" one)
    config.dtype = torch.float32
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.generation_config = loaded.generation_config
    del loaded
    out.mkdir(parents=True, exist_ok=True)
    fresh.config.save_pretrained(str(out))
    fresh.generation_config.save_pretrained(str(out))
    safetensors.torch.save_model(fresh, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out))
    provenance = {
        "format": FORMAT, "source": source, "file": str(gguf_path), "bytes": gguf_path.stat().st_size,
        "sha256": sha256_of(gguf_path),
        "quantization": {"file_type": file_type_name(header), "tensor_types": types},
        "dequantized_to": "float32", "architecture": header.get("general.architecture"),
        "name": header.get("general.name"), "model_class": type(fresh).__name__,
        "parameters": sum(p.numel() for p in fresh.parameters()),
        "vocab_size": fresh.config.get_text_config().vocab_size,
        "converted_with": {k: _version(k) for k in ("transformers", "gguf", "torch", "safetensors")},
        "seconds": round(time.perf_counter() - start, 1),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    (out / PROVENANCE).write_text(json.dumps(provenance, indent=2))  # last: its presence marks a whole folder
    log(f"converted {name} ({provenance['quantization']['file_type']}, {provenance['parameters'] / 1e6:.1f} M "
        f"parameters) to float32 in {provenance['seconds']:.0f} s")
    return provenance


def read_provenance(folder: Path) -> dict | None:
    """``folder/gguf_source.json`` as a dict, or None when the folder is not a finished conversion."""
    path = folder / PROVENANCE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def _version(name: str) -> str:
    try:
        return version(name)
    except Exception:  # noqa: BLE001 - recorded as unknown, never fatal
        return "unknown"


def host_label() -> str:
    """This host, for a temporary folder's name: its name's letters and digits (at most 16) and a short hash of
    the whole name, so that ``gpu-01`` and ``gpu01`` differ and the label is never digits alone."""
    import hashlib
    import socket

    name = socket.gethostname()
    return "h" + re.sub(r"[^A-Za-z0-9]", "", name)[:16] + hashlib.sha256(name.encode()).hexdigest()[:8]


def stale_temporaries(root: Path) -> list[Path]:
    """Temporary conversion folders under ``root`` whose process is gone (a killed conversion).

    Their names are ``.converting-<host>-<pid>-<random>`` (no part holds a ``-``: the host is
    :func:`host_label`, the random part ``tempfile``'s letters, digits and underscores); a folder of
    another host (a cache shared over the network) or whose pid is alive belongs to a conversion that
    may still be running and is left alone. ``.converting-<pid>-<random>`` (an older version, three
    parts) is this host's.
    """
    out, here = [], host_label()
    for path in root.glob(".converting-*"):
        parts = path.name.split("-")
        if len(parts) == 4:
            if parts[1] != here:
                continue
            pid_text = parts[2]
        elif len(parts) == 3:
            pid_text = parts[1]
        else:
            continue
        try:
            pid = int(pid_text)
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            out.append(path)
        except PermissionError:
            continue
    return out
