r"""Prompt data from real math datasets: GSM8K, MATH and alike (docs/answers.md).

A *part* is one task (e.g. "gsm8k") with a training source and, optionally, an evaluation
source of its own: one dataset split each, read with Hugging Face ``datasets`` from a local
JSON / JSONL file (``load_dataset("json", data_files=...)``) or a hub dataset id with a
config and split (:class:`~mrl_lightning.data.sources.MathSource`: fields, split slices,
answer extraction). Train on one split, evaluate on another:

```yaml
- name: gsm8k
  path: openai/gsm8k            # the training source: the part's own fields
  config_name: main
  split: train
  answer_pattern: '####\s*(.+?)\s*$'
  eval_size: 0                  # with eval_source: rows drawn from it, 0 = every row
  eval_source: {path: openai/gsm8k, config_name: main, split: test, answer_pattern: '####\s*(.+?)\s*$'}
```

The public interface is that of :class:`~mrl_lightning.data.reasoning_gym.ReasoningGymDataModule`,
so ``MRLTrainer`` drives either unchanged: ``next_batch`` yields B prompts split across
parts by ``weight``; ``eval_items`` gives the held-out prompts by part; ``state_dict``
holds the data position. Differences from that module:

- Training prompt ids are ``"<part>/<row index>"``, the 0-based row in the loaded split
  (after its slice). Evaluation rows taken from the same source keep that id (they are
  disjoint from the training rows); rows of an ``eval_source`` are ``"<part>/eval/<row>"``.
- Without ``eval_source``, ``eval_size`` rows per part are held out *of the training source*,
  chosen by a permutation seeded by (seed, part). With it, the evaluation rows are the
  eval source's (``eval_size`` of them by the same permutation, or all when 0) and every
  training row stays in training.
- Evaluation rows are distinct questions (:func:`~mrl_lightning.data.question_keys.question_key`: the text,
  whitespace normalized): a source that repeats a question
  evaluates it once (the permutation skips the repeat; with ``eval_size: 0`` its first row
  is kept), so intervals are over distinct questions (``eval_question_counts``).
- In both cases a training row whose question (by the same key) is any evaluation question (of any
  part) is dropped, so evaluation stays held out even when a training set contains test
  questions; the count is warned about and kept in ``overlap_dropped``.
- Rows whose answer cannot be extracted are dropped and counted in ``dropped`` (a warning
  names the part and source); a source left empty is an error.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass, fields

import numpy as np

from mrl_lightning.data.items import PromptItem
from mrl_lightning.data.question_keys import question_key
from mrl_lightning.data.sources import MathSource, read_source, source_errors
from mrl_lightning.data.stream import PromptDataModule, seed_for, stream_config_errors
from mrl_lightning.errors import ConfigError



def _key(item: PromptItem) -> str:
    """The question ``item`` asks, for held-out evaluation: its text, whitespace normalized
    (``question_key``; "What is 3 + 3?" and "What is 3  +  3? " are one question)."""
    return question_key(item.question, item.entry.get("metadata"))

@dataclass
class MathPart:
    """One task of the data: its training source, and where it is evaluated.

    Attributes:
        name: Short name used in prompt ids and log tags (e.g. "gsm8k"); no "/".
        path: The training source's file or hub dataset id (:class:`MathSource` ``path``).
        split: The training source's split, with an optional slice (``MathSource.split``).
        config_name: The training source's hub config (``MathSource.config_name``).
        question_field: The training source's question column.
        answer_field: The training source's answer or solution column.
        answer_pattern: How its answer is read (``MathSource.answer_pattern``).
        answer_extract: ``pattern`` or ``last_boxed`` (``MathSource.answer_extract``).
        eval_size: Without ``eval_source``: rows of the training source held out for
            evaluation (0 = no evaluation of this part). With it: rows drawn from the eval
            source (0 = every row).
        weight: Relative share of each training batch.
        eval_source: Where this part is evaluated, a :class:`MathSource` of its own (e.g. the
            test split while training on the train split); None = rows held out of the
            training source.
    """

    name: str
    path: str
    split: str = "train"
    config_name: str | None = None
    question_field: str = "question"
    answer_field: str = "answer"
    answer_pattern: str = ""
    answer_extract: str = "pattern"
    eval_size: int = 0
    weight: float = 1.0
    eval_source: MathSource | None = None

    def __post_init__(self) -> None:
        if isinstance(self.eval_source, dict):
            self.eval_source = MathSource(**self.eval_source)

    @property
    def source(self) -> MathSource:
        """The training source as a :class:`MathSource`."""
        return MathSource(**{f.name: getattr(self, f.name) for f in fields(MathSource)})

    @property
    def is_local(self) -> bool:
        """True when the training source is a local file rather than a hub dataset id."""
        return self.source.is_local

    @property
    def local_path(self):
        """The training source's path with ``~`` expanded."""
        return self.source.local_path


def _part_errors(part: MathPart) -> list[str]:
    """Problems with one part found without loading anything."""
    p = f"data.parts[{part.name}]"
    errors = []
    if not part.name or "/" in part.name:
        errors.append(f"{p}.name={part.name!r} must be non-empty and contain no '/' (it prefixes prompt ids).")
    if part.eval_size < 0:
        errors.append(f"{p}.eval_size={part.eval_size} must be >= 0.")
    errors.extend(source_errors(part.source, p))
    if part.eval_source is not None:
        if not isinstance(part.eval_source, MathSource):
            errors.append(f"{p}.eval_source must be a mapping of MathSource fields (path, split, question_field, "
                          f"answer_field, answer_pattern, answer_extract); got {part.eval_source!r}.")
        else:
            errors.extend(source_errors(part.eval_source, f"{p}.eval_source"))
            if part.eval_source == part.source:
                errors.append(f"{p}.eval_source is the training source itself (path={part.path!r}, "
                              f"split={part.split!r}): every evaluation row would be a training question. Name "
                              "another split (e.g. split: test, or slices such as 'test[:20]' / 'test[20:]'), "
                              "or drop eval_source to hold eval_size rows out of the training source.")
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
        self.overlap_dropped: dict[str, int] = {}

    # ------------------------------------------------------------------ loading
    def _items(self, part: MathPart, source: MathSource, where: str, id_prefix: str) -> list[PromptItem]:
        """Every usable row of one of the part's sources, in order, with ids ``id_prefix + "<row>"``.

        Raises:
            ConfigError: see :func:`~mrl_lightning.data.sources.read_source`.
        """
        rows, dropped = read_source(source, where)
        self.dropped[part.name] = self.dropped.get(part.name, 0) + dropped
        if dropped:
            how = ("answer_extract='last_boxed' found no box" if source.answer_extract == "last_boxed"
                   else f"answer answer_pattern={source.answer_pattern!r} could not extract")
            warnings.warn(f"{where}: dropped {dropped} of {len(rows) + dropped} rows whose {how} "
                          f"({source.describe()}).", stacklevel=2)
        described = source.describe()
        return [PromptItem(f"{id_prefix}{index}", question, answer, part.name,
                           {"row": index, "source": described, "fields": row, "metadata": {"part": part.name}})
                for index, question, answer, row in rows]

    def _held_out(self, part: MathPart, items: list[PromptItem], where: str) -> set[int]:
        """Positions of the evaluation rows among ``items``: the first ``eval_size`` distinct questions
        (by :func:`_key`) in a permutation seeded by (seed, part); every distinct question when ``eval_size``
        is 0. A source that repeats a question (same text in two rows) so never evaluates it twice.

        Raises:
            ConfigError: fewer distinct questions than ``eval_size``.
        """
        order = np.random.default_rng(seed_for(self.seed, part.name, "eval")).permutation(len(items))
        if not part.eval_size:
            order = range(len(items))
        taken: dict[str, int] = {}
        for i in order:
            taken.setdefault(_key(items[int(i)]), int(i))
            if len(taken) == part.eval_size:
                break
        if part.eval_size and len(taken) < part.eval_size:
            raise ConfigError(f"{where}.eval_size={part.eval_size} but its evaluation rows hold only {len(taken)} "
                              f"distinct questions (the source repeats some); lower eval_size.")
        return set(taken.values())

    def setup(self, stage: str | None = None) -> None:
        """Load every part's sources and set its evaluation rows apart (idempotent).

        Raises:
            ConfigError: see :meth:`_items`; eval_size leaves no training row, asks for more
                rows than an eval source has, or every training row is an evaluation question.
        """
        if self._train:
            return
        train_all, eval_all = {}, {}
        for part in self.parts:
            where = f"data.parts[{part.name}]"
            items = self._items(part, part.source, where, f"{part.name}/")
            if part.eval_source is None:
                if part.eval_size >= len(items):
                    raise ConfigError(f"{where}.eval_size={part.eval_size} leaves no training row "
                                      f"({len(items)} usable rows); lower eval_size.")
                held = self._held_out(part, items, where) if part.eval_size else set()
                eval_all[part.name] = [x for i, x in enumerate(items) if i in held]
                train_all[part.name] = [x for i, x in enumerate(items) if i not in held]
                continue
            evals = self._items(part, part.eval_source, f"{where}.eval_source", f"{part.name}/eval/")
            if part.eval_size > len(evals):
                raise ConfigError(f"{where}.eval_size={part.eval_size} but its eval_source has {len(evals)} usable "
                                  f"rows ({part.eval_source.describe()}); lower eval_size, or set it to 0 to "
                                  "evaluate on every row.")
            held = self._held_out(part, evals, where)
            evals = [x for i, x in enumerate(evals) if i in held]
            eval_all[part.name], train_all[part.name] = evals, items
        questions = {_key(x) for xs in eval_all.values() for x in xs}
        self.overlap_dropped = {}
        for part in self.parts:
            kept = [x for x in train_all[part.name] if _key(x) not in questions]
            self.overlap_dropped[part.name] = len(train_all[part.name]) - len(kept)
            if not kept:
                raise ConfigError(f"data.parts[{part.name}]: every training row's question is also an evaluation "
                                  "question; train on another split or evaluate on fewer rows (eval_size).")
            if self.overlap_dropped[part.name]:
                warnings.warn(f"data.parts[{part.name}]: dropped {self.overlap_dropped[part.name]} training rows "
                              "whose question is also an evaluation question (the training source holds evaluation "
                              "questions); evaluation stays held out.", stacklevel=2)
            train_all[part.name] = kept
        self._eval, self._train = eval_all, train_all
        self.check_prompt_ids()
        self.log_eval_questions()

    # ------------------------------------------------------------------ identity and resume
    def fingerprint(self) -> str:
        """Short hash of the config and of each local file's bytes (what determines the prompts).

        A part without ``eval_source`` and with the default ``answer_extract`` hashes as it did
        before those options existed, so warm-start caches built on it stay valid.
        """
        h = hashlib.sha256(f"{self.seed}".encode())
        for p in self.parts:
            h.update(repr((p.name, p.path, p.split, p.config_name, p.question_field, p.answer_field,
                           p.answer_pattern, p.eval_size, p.weight)).encode())
            sources = [p.source]
            if p.answer_extract != "pattern":
                h.update(f"answer_extract={p.answer_extract}".encode())
            if p.eval_source is not None:
                h.update(repr(("eval_source", *(getattr(p.eval_source, f.name) for f in fields(MathSource))))
                         .encode())
                sources.append(p.eval_source)
            for source in sources:
                if source.is_local and source.local_path.is_file():
                    h.update(hashlib.sha256(source.local_path.read_bytes()).digest())
        return h.hexdigest()[:12]
