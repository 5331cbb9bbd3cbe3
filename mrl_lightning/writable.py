"""Whether a folder can be written, found by trying, whether an error is a full disk, whether a file is whole,
and a folder's entries flushed to disk (docs/reliability.md).

Permission bits do not answer it: root ignores them, and a read-only mount, a full disk or
a path through a file refuse writes whatever they say. :func:`write_problem` finds the
nearest folder of the path that exists and writes a byte to a temporary file in it (an
empty file needs no free block: a full disk accepts it), so nothing is left behind and no
folder is created by asking. :func:`disk_full_in` finds ``ENOSPC`` behind another error
(torch's zip writer hides it), for the one line a full disk gets (:mod:`mrl_lightning.run.stop`).
:func:`file_damage` tells a truncated checkpoint file from a whole one by its structure alone,
and a file of another kind (a text file) from both; :func:`fsync_dir` makes a rename in a folder
durable (docs/loop.md, "Checkpoints").
"""

from __future__ import annotations

import errno
import gzip
import os
import shutil
import tempfile
import zipfile
import zlib
from pathlib import Path

GZIP_MAGIC, ZIP_MAGIC = b"\x1f\x8b", b"PK\x03\x04"
"""The first bytes of a gzipped file, and of a ``torch.save`` file (a zip archive)."""


def file_damage(path: str | os.PathLike) -> tuple[str, str] | None:
    """What keeps ``path`` from being a whole ``torch.save`` file, plain or gzipped, found from its structure
    (nothing is unpickled): a plain file's zip directory, which ``torch.save`` writes at the end (a truncated
    file has none), or a gzipped file's stream read to its end marker (its length and CRC checked on the way).

    Returns:
        None when the file looks whole (also for a pickle, ``torch.save``'s format before zip: torch tells);
        else ``(kind, why)``: ``("damaged", "its zip directory ... is missing: the file is truncated")``, or
        ``("foreign", "it begins with b'hello'")`` for a file of another kind.
    """
    with open(path, "rb") as fh:
        head = fh.read(4)
        if head[:2] == GZIP_MAGIC:
            fh.seek(0)
            try:
                with gzip.GzipFile(fileobj=fh, mode="rb") as stream:
                    inner = stream.read(4)
                    while stream.read(1 << 24):
                        pass
            except EOFError:
                return "damaged", "its gzip stream ends before its end marker: the file is truncated"
            except (OSError, zlib.error) as exc:
                return "damaged", f"its gzip stream is corrupted ({exc})"
            if inner != ZIP_MAGIC:
                return "foreign", (f"it is gzipped, but what it holds begins with {inner!r}, not as a torch.save "
                                   "file does")
            return None
        if head == ZIP_MAGIC:
            try:
                zipfile.ZipFile(fh).close()
            except (zipfile.BadZipFile, OSError, ValueError):
                return "damaged", ("its zip directory, which torch.save writes at the end of the file, is missing: the "
                                   "file is truncated")
            return None
        if not head:
            return "damaged", "it is empty (0 bytes): the file is truncated"
        if head[:1] == b"\x80":
            return None
        fh.seek(0)
        return "foreign", f"it begins with {fh.read(16)!r}"


def fsync_dir(folder: str | os.PathLike) -> None:
    """Flush ``folder``'s entries to disk, so that a file renamed, linked or created in it stays after a crash.

    ``os.replace`` and ``os.link`` change the folder, not the file: POSIX makes them durable only by an
    fsync of the folder, and until then a power cut can undo them on some file systems, leaving the old
    name or none. A file system that cannot flush a folder (``EINVAL``: some network and FUSE file systems) is
    left as it is; any other error is raised.
    """
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def write_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` (a folder, existing or to be created) cannot be written, or None when it can.

    Returns:
        E.g. ``"read-only file system at '/mnt/ro'"``, ``"no space left on device at '/mnt/full'
        (64 KiB disk, 0 bytes free)"`` or ``"'/data/file.txt' is a file, not a
        folder"``; None when a file could be created and written.
    """
    target = Path(path).expanduser().absolute()
    probe = target
    while not probe.exists():
        if probe.parent == probe:
            return f"no part of {str(target)!r} exists"
        probe = probe.parent
    if not probe.is_dir():
        return f"{str(probe)!r} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=probe, buffering=0) as fh:
            fh.write(b"\0")
    except OSError as exc:
        full = f" ({free_space_text(probe)})" if exc.errno == errno.ENOSPC else ""
        virtual = file_system_type(probe) if exc.errno in (errno.ENOENT, errno.EACCES, errno.EPERM) else None
        if virtual in VIRTUAL_FILE_SYSTEMS:  # the kernel's own files: "no such file" would name the wrong cause
            return (f"{str(probe)!r} is on a {virtual} file system, where the kernel's own files live: no file can be "
                    "made there")
        return f"{(exc.strerror or type(exc).__name__).lower()} at {str(probe)!r}{full}"
    return None


VIRTUAL_FILE_SYSTEMS = frozenset({"proc", "sysfs", "devpts", "cgroup", "cgroup2", "debugfs", "securityfs",
                                  "configfs", "tracefs", "pstore", "bpf", "mqueue", "fusectl"})
"""File system types (``/proc/self/mounts``) whose folders show the kernel's state and take no new files."""


def file_system_type(path: str | os.PathLike, mounts: str = "/proc/self/mounts") -> str | None:
    """The type (``ext4``, ``proc``, ``tmpfs``) of the mount holding ``path`` (the deepest mount point above it);
    None where ``mounts`` (the kernel's table of mounts) cannot be read (not Linux)."""
    target = os.path.realpath(path)
    best, kind = "", None
    try:
        with open(mounts, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):  # the deepest mount point; the last mounted on ties
                    best, kind = point, fields[2]
    except OSError:
        return None
    return kind


def disk_full_in(exc: BaseException | None) -> OSError | None:
    """The ``OSError(ENOSPC)`` that is ``exc`` or that it was raised from (its cause or context chain), or None.

    torch.save's zip writer hides a failed write: its cleanup raises a ``RuntimeError``
    ("unexpected pos ...") whose context is the ``OSError`` of the write.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def free_space_text(path: str | os.PathLike) -> str:
    """``"64 KiB disk, 0 bytes free"``: the disk holding ``path`` (its nearest existing folder); "" if unknown."""
    probe = Path(path).expanduser().absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return ""
    return f"{_size(usage.total)} disk, {usage.free:,} bytes free"


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:g} {unit}" if unit == "bytes" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} TiB"
