"""Where a math part's rows come from: one dataset split, its fields, and how its final answer is read.

A :class:`MathSource` names a local JSON / JSONL file or a hub dataset, the split to read
(``datasets``' split syntax, with an optional slice: ``train``, ``test[:100]``,
``train[10%:]``), the question and answer columns, and how the final answer is taken out
of the answer column (docs/answers.md):

- ``answer_extract: pattern`` (default): the first group of ``answer_pattern`` searched in
  the field (GSM8K's ``####\\s*(.+?)\\s*$``), or the whole field stripped when the pattern
  is "" (MATH500's bare ``answer`` column);
- ``answer_extract: last_boxed``: the content of the field's last ``\\boxed{...}`` (or
  ``\\fbox{...}``), braces matched, for datasets that carry a worked solution only (the
  MATH training split's ``solution`` column). A regex cannot match nested braces such as
  ``\\boxed{\\frac{1}{2}}``, hence a rule of its own.

Rows whose answer cannot be extracted are dropped and counted.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mrl_lightning.errors import ConfigError

LOCAL_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
ANSWER_EXTRACTS = ("pattern", "last_boxed")
# one split name and at most one slice, as ``datasets`` reads it: "test", "train[:100]", "test[10%:50%]"
_SPLIT = re.compile(r"^([A-Za-z0-9_.-]+)(\[(-?\d+%?)?:(-?\d+%?)?\])?$")
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


@dataclass
class MathSource:
    """One dataset split with questions and reference answers.

    Attributes:
        path: A local ``.json`` / ``.jsonl`` file (a path ending so, or starting with ".", "/"
            or "~"; relative paths resolve from the working directory, normally the repo
            root), or else a hub dataset id or dataset folder (e.g. "openai/gsm8k").
        split: Split to read, in ``datasets``' syntax with an optional slice ("test",
            "train[:1000]", "test[50%:]"). For a local file the name is the split the file
            is loaded as, and the slice applies to its rows.
        config_name: Hub dataset config (e.g. "main" for openai/gsm8k); unused for files.
        question_field: Column holding the question text.
        answer_field: Column holding the reference answer or worked solution.
        answer_pattern: With ``answer_extract: pattern``, a regex whose first group is the
            final answer, searched in the answer field (multiline); "" = the whole field,
            stripped. A plain ``str``, not ``str | None``: jsonargparse reads a ``str | None``
            value that starts with "#" (as GSM8K's does) as a YAML comment, i.e. None.
        answer_extract: ``pattern`` (``answer_pattern`` above) or ``last_boxed`` (the content
            of the field's last ``\\boxed{...}``, braces matched: MATH's worked solutions).
    """

    path: str
    split: str = "test"
    config_name: str | None = None
    question_field: str = "question"
    answer_field: str = "answer"
    answer_pattern: str = ""
    answer_extract: str = "pattern"

    @property
    def is_local(self) -> bool:
        """True when ``path`` names a local file rather than a hub dataset id."""
        p = self.path
        return p.endswith(LOCAL_SUFFIXES) or p.startswith((".", "/", "~")) or os.path.isabs(p)

    @property
    def local_path(self) -> Path:
        """``path`` with ``~`` expanded (relative paths stay relative to the working directory)."""
        return Path(self.path).expanduser()

    @property
    def split_name(self) -> str:
        """The split's name without its slice (``"test[:100]"`` -> ``"test"``)."""
        return self.split.split("[", 1)[0]

    def describe(self) -> str:
        """Where the rows come from, for prompt entries and messages."""
        return str(self.local_path) + f":{self.split}" if self.is_local else \
            f"{self.path}:{self.config_name}:{self.split}"


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``, braces matched.

    Escaped braces ``\\{`` and ``\\}`` inside the box are content, not delimiters
    (``\\boxed{\\{1, 2\\}}`` gives ``\\{1, 2\\}``). ``\\boxed 5`` (no brace) gives the
    token after it, up to a space or ``$``.

    Args:
        text: A worked solution.

    Returns:
        The box's content, stripped; None when there is no box, it is empty or never closes.
    """
    starts = [m.end() for m in _BOX.finditer(text)]
    if not starts:
        return None
    i = starts[-1]
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        token = re.match(r"[^\s$]+", text[i:])
        return token.group(0) if token else None
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == "\\":  # an escaped character (\{, \}, \\) never opens or closes the box
            j += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip() or None
        j += 1
    return None


def extract_answer(source: MathSource, raw: Any) -> str | None:
    """The final answer of one row's answer field, or None when it cannot be read (:class:`MathSource`)."""
    text = str(raw)
    if source.answer_extract == "last_boxed":
        return last_boxed(text)
    if not source.answer_pattern:
        return text.strip() or None
    match = re.search(source.answer_pattern, text, flags=re.MULTILINE)
    return match.group(1).strip() if match and match.group(1).strip() else None


def source_errors(source: MathSource, where: str) -> list[str]:
    """Problems with one source found without loading anything.

    Args:
        source: The source.
        where: The config path that names it, e.g. ``"data.parts[gsm8k]"`` or
            ``"data.parts[gsm8k].eval_source"``.
    """
    errors = []
    if source.answer_extract not in ANSWER_EXTRACTS:
        errors.append(f"{where}.answer_extract={source.answer_extract!r}; valid: {list(ANSWER_EXTRACTS)} "
                      "(pattern: answer_pattern's first group; last_boxed: the last \\boxed{...} of a solution).")
    elif source.answer_extract == "last_boxed" and source.answer_pattern:
        errors.append(f"{where}.answer_pattern={source.answer_pattern!r} is unused with answer_extract: last_boxed; "
                      "drop answer_pattern, or set answer_extract: pattern.")
    if source.answer_pattern:
        try:
            if re.compile(source.answer_pattern).groups < 1:
                errors.append(f"{where}.answer_pattern={source.answer_pattern!r} has no capture group; wrap the "
                              r"answer in one, e.g. '####\s*(.+?)\s*$'.")
        except re.error as exc:
            errors.append(f"{where}.answer_pattern={source.answer_pattern!r} is not a valid regex ({exc}).")
    if not _SPLIT.match(source.split):
        errors.append(f"{where}.split={source.split!r} is not a split name with an optional slice; write e.g. "
                      "'train', 'test[:100]' or 'train[10%:]'.")
    if source.is_local and not source.local_path.is_file():
        errors.append(f"{where}.path={source.path!r} is not an existing file (resolved to "
                      f"{source.local_path.resolve()} from {os.getcwd()}). Run from the repo root, give an "
                      "absolute path, or give a hub dataset id with config_name and split "
                      "(e.g. path: openai/gsm8k, config_name: main, split: test).")
    return errors


def json_file_problem(path: Path) -> str | None:
    """The first line of a local JSON / JSONL file that is not valid, as a message; None if all are.

    A ``.jsonl`` file must hold one JSON object per non-empty line; a ``.json`` file one
    JSON document. Read only after ``datasets`` failed to load the file, to say where.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as fh:
        if ".jsonl" not in str(path):
            try:
                json.load(fh)
            except json.JSONDecodeError as exc:
                return f"file {str(path)!r} line {exc.lineno} column {exc.colno} is not valid JSON ({exc.msg})."
            return None
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                return (f"file {str(path)!r} line {lineno} is not valid JSON ({exc.msg} at column {exc.colno}): "
                        f"{line.strip()[:80]!r}.")
            if not isinstance(row, dict):
                return f"file {str(path)!r} line {lineno} is a JSON {type(row).__name__}, not an object: {line.strip()[:80]!r}."
    return None


def load_rows(source: MathSource, where: str):
    """The source's split (sliced) as a ``datasets.Dataset``.

    Args:
        source: The source.
        where: Its config path, for messages.

    Raises:
        ConfigError: ``datasets`` is not installed, a local file has an invalid line, the
            slice is out of range, or the hub dataset cannot be loaded.
    """
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError("MathDataModule needs the `datasets` package: "
                          "pip install 'mrl-lightning[math]'.") from exc
    if source.is_local:
        try:
            return datasets.load_dataset("json", data_files={source.split_name: str(source.local_path)},
                                         split=source.split)
        except ValueError as exc:  # a slice the file's rows cannot give
            if json_file_problem(source.local_path) is None:
                raise ConfigError(f"{where}.split={source.split!r} cannot be read from {source.path!r} "
                                  f"({exc}); fix the slice.") from exc
            raise ConfigError(f"{where}.path={source.path!r}: {json_file_problem(source.local_path)} Fix or delete "
                              "that line (each line of a .jsonl file is one JSON object).") from exc
        except Exception as exc:  # datasets says only "An error occurred while generating the dataset"
            problem = json_file_problem(source.local_path)
            if problem is None:
                raise
            raise ConfigError(f"{where}.path={source.path!r}: {problem} Fix or delete that line "
                              "(each line of a .jsonl file is one JSON object).") from exc
    try:
        return datasets.load_dataset(source.path, source.config_name, split=source.split)
    except Exception as exc:  # reported as a config error with its cause
        raise ConfigError(
            f"{where}: hub dataset path={source.path!r} config_name={source.config_name!r} "
            f"split={source.split!r} could not be loaded ({type(exc).__name__}: {exc}). Without hub access, "
            "download the split as JSONL and give its local path.") from exc


def read_source(source: MathSource, where: str) -> tuple[list[tuple[int, str, str, dict]], int]:
    """Every usable row of a source, in order: ``(row index, question, answer, row)``.

    Args:
        source: The source.
        where: Its config path, for messages.

    Returns:
        The rows whose answer could be extracted, and how many rows were dropped.

    Raises:
        ConfigError: see :func:`load_rows`; a field is missing (lists the columns), or no
            row has an extractable answer.
    """
    rows = load_rows(source, where)
    if len(rows) == 0:
        raise ConfigError(f"{where}.split={source.split!r} gives no rows of {source.path!r}; widen the slice "
                          "or name another split.")
    missing = [f"{k}={getattr(source, k)!r}" for k in ("question_field", "answer_field")
               if getattr(source, k) not in rows.column_names]
    if missing:
        raise ConfigError(f"{where}: {', '.join(missing)} not in {source.path!r}; "
                          f"its columns are {rows.column_names}.")
    usable = []
    for index, row in enumerate(rows):
        answer = extract_answer(source, row[source.answer_field])
        if answer is not None:
            usable.append((index, str(row[source.question_field]), answer, dict(row)))
    if not usable:
        how = (f"answer_extract='last_boxed' found no \\boxed{{...}} in {source.answer_field!r}"
               if source.answer_extract == "last_boxed" else
               f"answer_pattern={source.answer_pattern!r} matched no row of {source.answer_field!r}")
        raise ConfigError(f"{where}: {how} in {source.path!r} (split {source.split!r}); fix the extraction "
                          "(answer_extract, answer_pattern) or answer_field.")
    return usable, len(rows) - len(usable)
