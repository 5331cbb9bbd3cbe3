"""Append-only on-disk log of SEE records, for audit and replay (docs/see.md).

Two formats:

- ``"jsonl"``: one file, one record per line (:func:`~mrl_lightning.exchange.records.record_to_dict`
  as JSON). Each publish writes whole lines in one ``write`` call and flushes, so a crash
  can only leave the *last* line torn; earlier lines stay intact. A torn tail is dropped
  by :func:`read_log` (with a warning) and cut off before the next append (it never held a
  complete record).
- ``"parquet"``: a directory of ``part-NNNNNNNNNNNN.parquet`` files, one per publish call,
  each a table with columns ``record_type``, ``schema_version``, ``source``, ``prompt_id``,
  ``step`` and ``payload`` (the record's JSON). Needs ``pyarrow``.

The log records what was accepted by the exchange in publication order. A run resumed from
a checkpoint into the *same* log file (an absolute ``log_path``) first cuts off the records
published after that checkpoint by the run that stopped (:meth:`RecordLogWriter.rollback`,
called by ``ExperienceExchange.load_state_dict``): the resumed run publishes them again,
so the file ends up equal to the log of a run that never stopped. A relative ``log_path``
lives in the run folder, and a resumed run writes a new folder: each folder's log then
holds what that run accepted, from its start step to where it stopped.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Sequence

from mrl_lightning.exchange.records import Record, record_from_dict, record_to_dict

LOG_FORMATS = ("jsonl", "parquet")


def _require_pyarrow() -> Any:
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "log_format='parquet' needs pyarrow, which is not installed. Install it "
            "(`pip install pyarrow`) or use log_format='jsonl'."
        ) from err
    return pyarrow


def check_log_format(log_format: str) -> None:
    """Validate a log format name, and that its dependency is importable.

    Raises:
        ValueError: ``log_format`` is not one of ``"jsonl"``, ``"parquet"``.
        ImportError: ``"parquet"`` was asked for and ``pyarrow`` is not installed.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format={log_format!r} is not valid; valid: {list(LOG_FORMATS)}")
    if log_format == "parquet":
        _require_pyarrow()


class RecordLogWriter:
    """Appends batches of records to a log at ``path`` (see module docstring).

    Args:
        path: JSONL file path (``"jsonl"``) or directory (``"parquet"``). Parent
            directories are created.
        log_format: ``"jsonl"`` or ``"parquet"``.

    Raises:
        ValueError: unknown ``log_format``.
        ImportError: ``"parquet"`` without ``pyarrow``.
    """

    def __init__(self, path: str, log_format: str = "jsonl") -> None:
        check_log_format(log_format)
        self.path = os.fspath(path)
        self.log_format = log_format
        self._checked_tail = False
        if log_format == "jsonl":
            parent = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(parent, exist_ok=True)
        else:
            os.makedirs(self.path, exist_ok=True)

    def rollback(self, step: int) -> int:
        """Cut off every record with ``record.step > step`` (and a torn tail): a resume point.

        Records are appended in publication order with non-decreasing steps, so the cut is
        a suffix of the log. JSONL: the file is truncated after the last line of a step
        <= ``step``. Parquet: the parts holding later steps are removed.

        Args:
            step: The ``rollout_step`` of the checkpoint the exchange was restored from.

        Returns:
            How many records were cut off (a torn tail not counted).
        """
        if self.log_format == "jsonl":
            self._checked_tail = True
            return _cut_after_step(self.path, step)
        return _remove_parts_after_step(self.path, step)

    def append(self, records: Sequence[Record], first_seq: int) -> None:
        """Append ``records`` (already accepted, in publication order).

        Args:
            records: Records to write.
            first_seq: Exchange sequence number of ``records[0]`` (names Parquet parts).
        """
        if not records:
            return
        if self.log_format == "jsonl":
            self._append_jsonl(records)
        else:
            self._append_parquet(records, first_seq)

    def _append_jsonl(self, records: Sequence[Record]) -> None:
        if not self._checked_tail:
            _cut_torn_tail(self.path)
            self._checked_tail = True
        text = "".join(json.dumps(record_to_dict(r), sort_keys=True) + "\n" for r in records)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()

    def _append_parquet(self, records: Sequence[Record], first_seq: int) -> None:
        pa = _require_pyarrow()
        import pyarrow.parquet as pq

        dicts = [record_to_dict(r) for r in records]
        table = pa.table(
            {
                "record_type": [d["record_type"] for d in dicts],
                "schema_version": [d["schema_version"] for d in dicts],
                "source": [d["source"] for d in dicts],
                "prompt_id": [d["prompt_id"] for d in dicts],
                "step": [d["step"] for d in dicts],
                "payload": [json.dumps(d, sort_keys=True) for d in dicts],
            }
        )
        final = os.path.join(self.path, f"part-{first_seq:012d}.parquet")
        tmp = final + ".tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, final)  # a part is either whole or absent


def _cut_torn_tail(path: str) -> None:
    """Truncate a JSONL file after its last newline (drops a line torn by a crash)."""
    if not os.path.exists(path):
        return
    size = os.path.getsize(path)
    if size == 0:
        return
    with open(path, "rb+") as fh:
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return
        fh.seek(0)
        data = fh.read()
        keep = data.rfind(b"\n") + 1
        warnings.warn(
            f"exchange log {path!r} ends in a torn line ({size - keep} bytes, from an "
            "interrupted write); cutting it off before appending.",
            stacklevel=3,
        )
        fh.truncate(keep)


def _lines_last_first(fh, end: int, block: int):
    """``(offset, line)`` of every line of ``fh[:end]`` (no newline at ``end``), the last first."""
    pos, rest = end, b""
    while pos > 0:
        start = max(0, pos - block)
        fh.seek(start)
        parts = (fh.read(pos - start) + rest).split(b"\n")
        pos = start
        rest = parts.pop(0) if start > 0 else b""  # may begin before this block
        offset = start + len(rest) + (1 if start > 0 else 0)
        offsets = []
        for part in parts:
            offsets.append(offset)
            offset += len(part) + 1
        yield from zip(reversed(offsets), reversed(parts))
    if rest:
        yield 0, rest


def _cut_after_step(path: str, step: int, block: int = 1 << 20) -> int:
    """Truncate a JSONL log after its last line whose record has ``step <= step``.

    Reads backwards in blocks of ``block`` bytes, so only the cut suffix is parsed.

    Returns:
        The number of (complete) lines cut off.
    """
    if not os.path.exists(path):
        return 0
    _cut_torn_tail(path)
    size = os.path.getsize(path)
    cut, keep = 0, 0
    with open(path, "rb+") as fh:
        for offset, line in _lines_last_first(fh, max(size - 1, 0), block):
            if line.strip() and json.loads(line).get("step", 0) <= step:
                keep = offset + len(line) + 1
                break
            cut += line.strip() != b""
        if keep < size:
            fh.truncate(keep)
    return cut


def _remove_parts_after_step(path: str, step: int) -> int:
    """Remove the Parquet parts (newest first) whose records have ``step > step``."""
    _require_pyarrow()
    import pyarrow.parquet as pq

    removed = 0
    for name in sorted(os.listdir(path), reverse=True):
        if not (name.startswith("part-") and name.endswith(".parquet")):
            continue
        part = os.path.join(path, name)
        steps = pq.read_table(part, columns=["step"]).column("step").to_pylist()
        if steps and max(steps) <= step:
            break
        removed += len(steps)
        os.remove(part)
    return removed


def read_log(path: str, log_format: str | None = None) -> list[Record]:
    """Read every record of an exchange log back, in the order it was written.

    Args:
        path: The ``log_path`` given to the exchange.
        log_format: ``"jsonl"`` or ``"parquet"``; ``None`` infers it (directory ->
            parquet, file -> jsonl).

    Returns:
        The records, in publication order. A torn final JSONL line (a write cut by a
        crash; it has no trailing newline) is skipped with a warning naming the file.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: unknown ``log_format``, or a complete line that is not a valid record
            (message names the line number).
        ImportError: a Parquet log and no ``pyarrow``.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"exchange log {path!r} does not exist")
    if log_format is None:
        log_format = "parquet" if os.path.isdir(path) else "jsonl"
    check_log_format(log_format)
    if log_format == "parquet":
        return _read_parquet(path)
    out: list[Record] = []
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    # After split, the last element is "" when the file ends with a newline, else a torn line.
    if lines[-1]:
        warnings.warn(f"exchange log {path!r} ends in a torn line (line {len(lines)}, {len(lines[-1])} characters, "
                      "from a write cut by a crash); it is skipped: it never held a complete record.", stacklevel=2)
    for lineno, line in enumerate(lines[:-1], start=1):
        if not line.strip():
            continue
        try:
            out.append(record_from_dict(json.loads(line)))
        except (ValueError, TypeError) as err:
            raise ValueError(f"exchange log {path!r} line {lineno} is not a valid record: {err}") from err
    return out


def _read_parquet(path: str) -> list[Record]:
    _require_pyarrow()
    import pyarrow.parquet as pq

    out: list[Record] = []
    for name in sorted(os.listdir(path)):
        if not (name.startswith("part-") and name.endswith(".parquet")):
            continue
        table = pq.read_table(os.path.join(path, name), columns=["payload"])
        out.extend(record_from_dict(json.loads(p)) for p in table.column("payload").to_pylist())
    return out
