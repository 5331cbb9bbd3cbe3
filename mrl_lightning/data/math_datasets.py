"""Prompt data from real math datasets: GSM8K, MATH500 and alike (docs/answers.md).

A *part* is one dataset read with Hugging Face ``datasets``: a local JSON / JSONL file
(``load_dataset("json", data_files=...)``) or a hub dataset id with a config and split.
Each row gives a question (``question_field``) and a reference answer
(``answer_field``); ``answer_pattern`` pulls the final answer out of a worked solution
(GSM8K's answers end with ``#### 72``, so its pattern is ``####\\s*(.+?)\\s*$``;
MATH500 has a bare ``answer`` field and needs none).

The public interface is that of :class:`~mrl_lightning.data.reasoning_gym.ReasoningGymDataModule`,
so ``MRLTrainer`` drives either unchanged: ``next_batch`` yields B prompts split across
parts by ``weight``; ``eval_items`` gives the held-out prompts by part; ``state_dict``
holds the data position. Differences from that module:

- Prompt ids are ``"<part>/<row index>"``, the 0-based row in the loaded split, the same
  for training and evaluation rows (they are disjoint), so an id names one row of one file.
- Evaluation rows are held out *of the same file*: ``eval_size`` rows per part chosen by a
  permutation seeded by (seed, part); the remaining rows are the training stream, minus
  any whose question text equals an evaluation question.
- Rows whose answer the pattern cannot extract are dropped and counted in ``dropped``
  (a warning names the part); a part left empty is an error.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mrl_lightning.data.items import PromptItem
from mrl_lightning.data.stream import PromptDataModule, seed_for, stream_config_errors
from mrl_lightning.errors import ConfigError

LOCAL_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")


@dataclass
class MathPart:
    """One dataset of the task.

    Attributes:
        name: Short name used in prompt ids and log tags (e.g. "gsm8k"); no "/".
        path: A local ``.json`` / ``.jsonl`` file (a path ending so, or starting with ".", "/"
            or "~"; relative paths resolve from the working directory, normally the repo
            root), or else a hub dataset id or dataset folder (e.g. "openai/gsm8k").
        split: Split to read. For a local file it names the split the file is loaded as.
        config_name: Hub dataset config (e.g. "main" for openai/gsm8k); unused for files.
        question_field: Column holding the question text.
        answer_field: Column holding the reference answer or worked solution.
        answer_pattern: Regex whose first group is the final answer, searched in the
            answer field (multiline); "" = the whole field, stripped. A plain ``str``, not
            ``str | None``: jsonargparse reads a ``str | None`` value that starts with "#"
            (as GSM8K's does) as a YAML comment, i.e. None.
        eval_size: Rows of this part held out for evaluation (0 = none).
        weight: Relative share of each training batch.
    """

    name: str
    path: str
    split: str = "train"
    config_name: str | None = None
    question_field: str = "question"
    answer_field: str = "answer"
    answer_pattern: str = ""
    eval_size: int = 0
    weight: float = 1.0

    @property
    def is_local(self) -> bool:
        """True when ``path`` names a local file rather than a hub dataset id."""
        p = self.path
        return p.endswith(LOCAL_SUFFIXES) or p.startswith((".", "/", "~")) or os.path.isabs(p)

    @property
    def local_path(self) -> Path:
        """``path`` with ``~`` expanded (relative paths stay relative to the working directory)."""
        return Path(self.path).expanduser()


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


def _part_errors(part: MathPart) -> list[str]:
    """Problems with one part found without loading anything."""
    p = f"data.parts[{part.name}]"
    errors = []
    if not part.name or "/" in part.name:
        errors.append(f"{p}.name={part.name!r} must be non-empty and contain no '/' (it prefixes prompt ids).")
    if part.eval_size < 0:
        errors.append(f"{p}.eval_size={part.eval_size} must be >= 0.")
    if part.answer_pattern:
        try:
            if re.compile(part.answer_pattern).groups < 1:
                errors.append(f"{p}.answer_pattern={part.answer_pattern!r} has no capture group; wrap the "
                              r"answer in one, e.g. '####\s*(.+?)\s*$'.")
        except re.error as exc:
            errors.append(f"{p}.answer_pattern={part.answer_pattern!r} is not a valid regex ({exc}).")
    if part.is_local and not part.local_path.is_file():
        errors.append(f"{p}.path={part.path!r} is not an existing file (resolved to "
                      f"{part.local_path.resolve()} from {os.getcwd()}). Run from the repo root, give an "
                      "absolute path, or give a hub dataset id with config_name and split "
                      "(e.g. path: openai/gsm8k, config_name: main, split: test).")
    return errors


class MathDataModule(PromptDataModule):
    """Prompts from math datasets with reference answers (verified by math-verify).

    Args:
        parts: The datasets (at least one; names unique).
        batch_size: Prompts per step, B (>= number of parts).
        seed: Seeds the evaluation hold-out and each epoch's order.

    Raises:
        ConfigError: no parts, duplicate names, missing local files, bad patterns,
            non-positive weights or sizes (all problems reported at once, before loading).
    """

    def __init__(self, parts: list[MathPart], batch_size: int = 16, seed: int = 0) -> None:
        super().__init__(batch_size, seed)
        parts = [p if isinstance(p, MathPart) else MathPart(**p) for p in parts]
        errors = []
        errors.extend(stream_config_errors(parts, batch_size, "MathPart (name, path, ...)"))
        for part in parts:
            errors.extend(_part_errors(part))
        if errors:
            raise ConfigError("Invalid data config:\n  - " + "\n  - ".join(errors))
        self.parts = parts
        self.dropped: dict[str, int] = {}

    # ------------------------------------------------------------------ loading
    def _load_rows(self, part: MathPart):
        """The part's split as a ``datasets.Dataset``.

        Raises:
            ConfigError: ``datasets`` is not installed, or the hub dataset cannot be loaded.
        """
        try:
            import datasets
        except ImportError as exc:
            raise ConfigError("MathDataModule needs the `datasets` package: "
                              "pip install 'mrl-lightning[math]'.") from exc
        if part.is_local:
            try:
                return datasets.load_dataset("json", data_files={part.split: str(part.local_path)}, split=part.split)
            except Exception as exc:  # datasets says only "An error occurred while generating the dataset"
                problem = json_file_problem(part.local_path)
                if problem is None:
                    raise
                raise ConfigError(f"data.parts[{part.name}].path={part.path!r}: {problem} Fix or delete that line "
                                  "(each line of a .jsonl file is one JSON object).") from exc
        try:
            return datasets.load_dataset(part.path, part.config_name, split=part.split)
        except Exception as exc:  # reported as a config error with its cause
            raise ConfigError(
                f"data.parts[{part.name}]: hub dataset path={part.path!r} config_name={part.config_name!r} "
                f"split={part.split!r} could not be loaded ({type(exc).__name__}: {exc}). Without hub access, "
                "download the split as JSONL and give its local path.") from exc

    def _extract(self, part: MathPart, raw: Any) -> str | None:
        text = str(raw)
        if not part.answer_pattern:
            return text.strip() or None
        match = re.search(part.answer_pattern, text, flags=re.MULTILINE)
        return match.group(1).strip() if match and match.group(1).strip() else None

    def _items(self, part: MathPart) -> list[PromptItem]:
        """Every usable row of the part, in file order, with ids ``"<part>/<row>"``.

        Raises:
            ConfigError: a field is missing (lists the columns) or no row has an answer.
        """
        rows = self._load_rows(part)
        missing = [f"{k}={getattr(part, k)!r}" for k in ("question_field", "answer_field")
                   if getattr(part, k) not in rows.column_names]
        if missing:
            raise ConfigError(f"data.parts[{part.name}]: {', '.join(missing)} not in {part.path!r}; "
                              f"its columns are {rows.column_names}.")
        items = []
        source = str(part.local_path) if part.is_local else f"{part.path}:{part.config_name}:{part.split}"
        for index, row in enumerate(rows):
            answer = self._extract(part, row[part.answer_field])
            if answer is None:
                continue
            entry = {"row": index, "source": source, "fields": dict(row), "metadata": {"part": part.name}}
            items.append(PromptItem(f"{part.name}/{index}", str(row[part.question_field]), answer, part.name, entry))
        self.dropped[part.name] = len(rows) - len(items)
        if not items:
            raise ConfigError(f"data.parts[{part.name}]: answer_pattern={part.answer_pattern!r} matched no row of "
                              f"{part.answer_field!r} in {part.path!r}; fix the pattern or set it to ''.")
        if self.dropped[part.name]:
            warnings.warn(f"data.parts[{part.name}]: dropped {self.dropped[part.name]} of {len(rows)} rows "
                          f"whose answer answer_pattern={part.answer_pattern!r} could not extract.", stacklevel=2)
        return items

    def setup(self, stage: str | None = None) -> None:
        """Load every part and split off its evaluation rows (idempotent).

        Raises:
            ConfigError: see :meth:`_items`; or eval_size leaves no training row.
        """
        if self._train:
            return
        train_all, eval_all = {}, {}
        for part in self.parts:
            items = self._items(part)
            if part.eval_size >= len(items):
                raise ConfigError(f"data.parts[{part.name}].eval_size={part.eval_size} leaves no training row "
                                  f"({len(items)} usable rows); lower eval_size.")
            order = np.random.default_rng(seed_for(self.seed, part.name, "eval")).permutation(len(items))
            held = set(order[:part.eval_size].tolist())
            evals = [x for i, x in enumerate(items) if i in held]
            questions = {x.question for x in evals}
            train = [x for i, x in enumerate(items) if i not in held and x.question not in questions]
            eval_all[part.name], train_all[part.name] = evals, train
        self._eval, self._train = eval_all, train_all
        self.check_prompt_ids()

    # ------------------------------------------------------------------ identity and resume
    def fingerprint(self) -> str:
        """Short hash of the config and of each local file's bytes (what determines the prompts)."""
        h = hashlib.sha256(f"{self.seed}".encode())
        for p in self.parts:
            h.update(repr((p.name, p.path, p.split, p.config_name, p.question_field, p.answer_field,
                           p.answer_pattern, p.eval_size, p.weight)).encode())
            if p.is_local and p.local_path.is_file():
                h.update(hashlib.sha256(p.local_path.read_bytes()).digest())
        return h.hexdigest()[:12]
