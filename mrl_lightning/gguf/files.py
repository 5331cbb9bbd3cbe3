"""A GGUF file read without loading it: is it one, what it is, its sha256 (docs/real_models.md).

GGUF (llama.cpp's format, specified in the ggml repository's ``gguf.md``) starts
with the magic ``b"GGUF"``, a version (2 or 3), the tensor count and the metadata count (both
uint64, little-endian), then the metadata: key (uint64 length + UTF-8 bytes), value type
(uint32), value. :func:`read_header` reads that far and stops at the keys it was asked for,
so learning a file's architecture, name and quantization takes milliseconds even for a file
whose tokenizer arrays hold 262,144 strings (the ``gguf`` package's ``GGUFReader`` parses
every value: 2.6 s for SmolLM2-135M here). The tensor table (each tensor's storage type) is
read with ``gguf.GGUFReader`` at conversion time only (:func:`tensor_types`).

``general.file_type`` is llama.cpp's ``LlamaFileType``: the quantization the file was written
as a whole ("Q4_1", "Q4_K_M", ...; some tensors keep other types, e.g. norms in F32).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from collections import Counter
from pathlib import Path

from mrl_lightning.errors import ConfigError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
# fixed-size value types of the GGUF spec: uint8, int8, uint16, int16, uint32, int32, float32, bool,
# (8 = string, 9 = array), uint64, int64, float64
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# llama.cpp's LlamaFileType values (gguf-py constants.py, gguf 0.19), for files read without gguf installed
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              32: "BF16"}
_SHA_CACHE: dict[tuple[str, int, int], str] = {}


class GGUFFileError(ConfigError):
    """A GGUF file that is missing, unreadable, not GGUF, or damaged (the message names it and the fix)."""


def read_header(path: str | Path, keys: tuple[str, ...] = ("general.architecture", "general.name",
                                                          "general.file_type")) -> dict:
    """The scalar metadata ``keys`` of a GGUF file (string and number values), plus its version.

    Reads the header and the metadata in order and stops once every key in ``keys`` was seen;
    arrays are skipped, not read.

    Args:
        path: The ``.gguf`` file.
        keys: Metadata keys to return; those absent from the file are absent from the result.

    Returns:
        ``{"version": int, "tensor_count": int, key: value, ...}``.

    Raises:
        GGUFFileError: the file is missing, is not a GGUF (wrong magic or version), or its
            metadata ends early (a truncated or damaged file).
    """
    path = Path(path)
    if not path.is_file():
        raise GGUFFileError(f"{str(path)!r} is not an existing file.")
    try:
        with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            return _parse(blob, path, set(keys))
    except ValueError as exc:  # mmap of an empty file
        raise GGUFFileError(f"{str(path)!r} is not a GGUF file ({exc}).") from exc
    except (struct.error, IndexError, UnicodeDecodeError) as exc:
        raise GGUFFileError(f"{str(path)!r} starts as a GGUF file but its metadata ends early or is damaged "
                            f"({type(exc).__name__}: {exc}); the file is incomplete or corrupt: fetch it "
                            "again.") from exc


def _parse(blob, path: Path, wanted: set[str]) -> dict:
    if blob[:4] != MAGIC:
        raise GGUFFileError(f"{str(path)!r} is not a GGUF file: it starts with {bytes(blob[:4])!r}, not {MAGIC!r}. "
                            "Give a .gguf file written by llama.cpp or the gguf package.")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in VERSIONS:
        raise GGUFFileError(f"{str(path)!r} is GGUF version {version}; versions {list(VERSIONS)} can be read.")
    out: dict = {"version": version, "tensor_count": tensor_count}
    pos = 24
    for _ in range(kv_count):
        if wanted <= set(out):
            break
        key, pos = _string(blob, pos)
        (kind,), pos = struct.unpack_from("<I", blob, pos), pos + 4
        if kind == _ARRAY:
            (item_kind, count), pos = struct.unpack_from("<IQ", blob, pos), pos + 12
            pos = _skip_array(blob, pos, item_kind, count)
        elif kind == _STRING:
            value, pos = _string(blob, pos)
            if key in wanted:
                out[key] = value
        elif kind in _FIXED:
            (value,) = struct.unpack_from(_FIXED[kind], blob, pos)
            pos += struct.calcsize(_FIXED[kind])
            if key in wanted:
                out[key] = value
        else:
            raise struct.error(f"unknown metadata value type {kind} for key {key!r}")
    return out


def _string(blob, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", blob, pos)
    end = pos + 8 + n
    if end > len(blob):
        raise struct.error(f"a string of {n} bytes at byte {pos} runs past the end of the file")
    return bytes(blob[pos + 8:end]).decode("utf-8"), end


def _skip_array(blob, pos: int, kind: int, count: int) -> int:
    if kind in _FIXED:
        return pos + count * struct.calcsize(_FIXED[kind])
    if kind != _STRING:
        raise struct.error(f"arrays of value type {kind} are not skipped here")
    for _ in range(count):  # each string: its uint64 length, then its bytes
        (n,) = struct.unpack_from("<Q", blob, pos)
        pos += 8 + n
    return pos


def file_type_name(header: dict) -> str:
    """``general.file_type`` as llama.cpp names it ("Q4_1", "Q4_K_M"), or "unknown" when absent."""
    value = header.get("general.file_type")
    if value is None:
        return "unknown"
    return FILE_TYPES.get(int(value), f"file_type {value}")


def sha256_of(path: str | Path) -> str:
    """Hex sha256 of a file, computed once per process for a given (path, size, modification time)."""
    path = Path(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _SHA_CACHE:
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        _SHA_CACHE[key] = digest.hexdigest()
    return _SHA_CACHE[key]


def tensor_types(path: str | Path) -> dict[str, int]:
    """How many tensors of each storage type the file holds, e.g. ``{"Q4_1": 210, "F32": 61, "Q8_0": 1}``
    (``gguf.GGUFReader``; seconds for a large tokenizer).

    Raises:
        GGUFFileError: the ``gguf`` package cannot read the file (damaged or truncated).
    """
    import gguf

    try:
        reader = gguf.GGUFReader(os.fspath(path))
    except Exception as exc:  # noqa: BLE001 - any reader failure is a damaged file, named with its cause
        raise GGUFFileError(f"{str(path)!r} could not be read by the gguf package ({type(exc).__name__}: {exc}); "
                            "the file is incomplete or corrupt: fetch it again.") from exc
    return dict(Counter(t.tensor_type.name for t in reader.tensors).most_common())
