"""Whether a folder can be written, found by trying (docs/reliability.md, "Configuration").

Permission bits do not answer it: root ignores them, and a read-only mount, a full disk or
a path through a file refuse writes whatever they say. :func:`write_problem` finds the
nearest folder of the path that exists and creates (and removes) a temporary file in it,
so nothing is left behind and no folder is created by asking.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` (a folder, existing or to be created) cannot be written, or None when it can.

    Returns:
        E.g. ``"read-only file system at '/mnt/ro'"`` or ``"'/data/file.txt' is a file, not a
        folder"``; None when a file could be created.
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
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        return f"{(exc.strerror or type(exc).__name__).lower()} at {str(probe)!r}"
    return None
