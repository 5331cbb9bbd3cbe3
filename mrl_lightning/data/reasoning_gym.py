"""Prompt data from reasoning-gym procedural tasks (docs/default.md).

A *part* is one named slice of the task (e.g. addition vs subtraction) built from one
reasoning-gym dataset with its own generator config. Each step yields ``batch_size``
prompts drawn evenly (by ``weight``) from the parts. Prompt ids are stable strings
``"<part>/<index>"`` shared by every policy, so experience about one prompt can be
matched across policies (docs/see.md). The data position is a counter per part plus an
epoch number; each epoch's order is a permutation seeded by (seed, part, epoch), so
``state_dict`` / ``load_state_dict`` resume the exact same stream.

Evaluation is held out by question (docs/default.md, "The task"): each part's evaluation prompts
come from a separate generator seed, are distinct by :func:`~mrl_lightning.data.question_keys.question_key`
(commuted ``+`` / ``*`` operands are one question), and every training prompt, of any part, whose key is an
evaluation key is dropped. A part whose question space cannot hold its ``eval_size`` distinct
questions, or whose training rows are mostly held out, is refused at setup. Success intervals
are then over distinct questions (``eval_question_counts``).
"""

from __future__ import annotations

import difflib
import hashlib
from dataclasses import dataclass, field
from typing import Any

from mrl_lightning.data.items import PromptItem
from mrl_lightning.data.question_keys import EXPRESSION_DATASETS, question_key
from mrl_lightning.data.stream import PromptDataModule, seed_for, stream_config_errors
from mrl_lightning.errors import ConfigError

EVAL_DRAWS_PER_QUESTION = 20  # generator draws allowed per distinct evaluation question asked for
MAX_HELD_OUT_SHARE = 0.5  # refused above this share of a part's generated training rows held out


@dataclass
class TaskPart:
    """One part of the task.

    Attributes:
        name: Short name used in prompt ids and log tags (e.g. "add").
        dataset: reasoning-gym dataset name (e.g. "basic_arithmetic").
        config: Keyword arguments for ``reasoning_gym.create_dataset`` (no seed/size).
        weight: Relative share of each batch.
        eval_size: Distinct evaluation questions of this part; None = the module's ``eval_size``
            (a small question space, e.g. 1-digit products, holds fewer).
    """

    name: str
    dataset: str
    config: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0
    eval_size: int | None = None


class ReasoningGymDataModule(PromptDataModule):
    """Procedural prompts with verifiers from reasoning-gym.

    Args:
        parts: The task parts (at least one; names unique).
        batch_size: Prompts per step, B (>= number of parts).
        train_size: Generated training prompts per part.
        eval_size: Distinct held-out evaluation questions per part (a part's own
            ``eval_size`` overrides it).
        seed: Generator seed; evaluation uses a derived seed.

    Raises:
        ConfigError: no parts, duplicate part names, unknown reasoning-gym dataset,
            non-positive sizes or weights (all problems reported at once).
    """

    def __init__(
        self,
        parts: list[TaskPart],
        batch_size: int = 16,
        train_size: int = 5000,
        eval_size: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, seed)
        import reasoning_gym

        errors = []
        parts = [p if isinstance(p, TaskPart) else TaskPart(**p) for p in parts]
        errors.extend(stream_config_errors(parts, batch_size, "TaskPart"))
        known = set(reasoning_gym.factory.DATASETS)
        for p in parts:
            if p.dataset not in known:
                near = difflib.get_close_matches(p.dataset, sorted(known), n=3, cutoff=0.6)
                errors.append(f"data.parts[{p.name}].dataset={p.dataset!r} is not a reasoning-gym dataset; "
                              + (f"did you mean {' or '.join(map(repr, near))}?" if near else
                                 "e.g. basic_arithmetic, chain_sum, countdown."))
            elif unknown := _unknown_options(reasoning_gym.factory.DATASETS[p.dataset][1], p.config):
                key, options = unknown
                near = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
                errors.append(f"data.parts[{p.name}].config: {key!r} is not an option of reasoning-gym "
                              f"{p.dataset!r}; " + (f"did you mean {near[0]!r}? " if near else "")
                              + f"its options: {options}.")
            else:
                try:  # a 1-item dataset checks the generator config cheaply
                    reasoning_gym.create_dataset(p.dataset, seed=0, size=1, **p.config)
                except Exception as exc:  # noqa: BLE001 - reported as a config error with its cause
                    errors.append(f"data.parts[{p.name}].config={p.config!r} is not valid for reasoning-gym "
                                  f"{p.dataset!r}: {type(exc).__name__}: {exc}")
        for key, value in (("train_size", train_size), ("eval_size", eval_size)):
            if value < 1:
                errors.append(f"data.{key}={value} must be >= 1.")
        errors += [f"data.parts[{p.name}].eval_size={p.eval_size} must be >= 1 (or null: data.eval_size)."
                   for p in parts if p.eval_size is not None and p.eval_size < 1]
        if errors:
            raise ConfigError("Invalid data config:\n  - " + "\n  - ".join(errors))
        self.parts = parts
        self.train_size = train_size
        self.eval_size = eval_size

    # ------------------------------------------------------------------ building
    def _eval_size(self, part: TaskPart) -> tuple[int, str]:
        """The part's count of distinct evaluation questions and the field that sets it."""
        if part.eval_size is not None:
            return part.eval_size, f"data.parts[{part.name}].eval_size"
        return self.eval_size, "data.eval_size"

    def _generate(self, part: TaskPart, seed: int, size: int, tag: str) -> list[PromptItem]:
        import reasoning_gym

        ds = reasoning_gym.create_dataset(part.dataset, seed=seed, size=size, **part.config)
        return [
            PromptItem(f"{part.name}/{tag}{i}", e["question"], str(e["answer"]), part.name, e)
            for i, e in enumerate(ds)
        ]

    def _held_out(self, part: TaskPart) -> list[PromptItem]:
        """The part's evaluation prompts: the first ``eval_size`` distinct questions of its eval seed.

        Raises:
            ConfigError: the generator gave fewer distinct questions in
                ``EVAL_DRAWS_PER_QUESTION * eval_size`` draws (its question space is too small).
        """
        import reasoning_gym

        size, field_name = self._eval_size(part)
        draws = EVAL_DRAWS_PER_QUESTION * size
        ds = reasoning_gym.create_dataset(part.dataset, seed=seed_for(self.seed, part.name, "eval"), size=draws,
                                          **part.config)
        evals: dict[str, PromptItem] = {}
        for i in range(draws):
            e = ds[i]
            evals.setdefault(question_key(e["question"], e.get("metadata")),
                             PromptItem(f"{part.name}/e{i}", e["question"], str(e["answer"]), part.name, e))
            if len(evals) == size:
                return list(evals.values())
        raise ConfigError(
            f"{field_name}={size} but part {part.name!r} has only {len(evals)} distinct questions in {draws} draws "
            f"(commuted + and * operands count once): lower {field_name} to about {max(1, len(evals) // 3)} "
            f"(a third, leaving the rest to training) or widen data.parts[{part.name}].config (e.g. max_digits).")

    def setup(self, stage: str | None = None) -> None:
        """Generate the evaluation and training prompts (idempotent; rules in the module docstring).

        Raises:
            ConfigError: a part cannot hold its distinct evaluation questions, or holding them
                out drops more than ``MAX_HELD_OUT_SHARE`` of its training rows (or all of them).
        """
        if self._train:
            return
        evals_of = {part.name: self._held_out(part) for part in self.parts}
        # every part's evaluation keys: parts that share a question space (two arithmetic parts) must not
        # train on each other's held-out questions either
        held = {question_key(x.question, x.entry.get("metadata")) for evals in evals_of.values() for x in evals}
        for part in self.parts:
            evals = evals_of[part.name]
            generated = self._generate(part, seed_for(self.seed, part.name, "train"), self.train_size, "")
            train = [x for x in generated if question_key(x.question, x.entry.get("metadata")) not in held]
            dropped = len(generated) - len(train)
            if not train or dropped > MAX_HELD_OUT_SHARE * len(generated):
                size, field_name = self._eval_size(part)
                raise ConfigError(
                    f"data.parts[{part.name}]: holding out the evaluation questions ({len(evals)} its own) drops {dropped} of "
                    f"its {len(generated)} training rows (more than {MAX_HELD_OUT_SHARE:.0%}): its question space is "
                    f"mostly held out; lower {field_name}={size} or widen data.parts[{part.name}].config.")
            self._eval[part.name], self._train[part.name] = evals, train
        self.check_prompt_ids()
        self.log_eval_questions()

    def fingerprint(self) -> str:
        """Short hash of everything that determines the generated prompts."""
        text = repr([(p.name, p.dataset, sorted(p.config.items()), p.weight)
                     + ((p.eval_size,) if p.eval_size is not None else ()) for p in self.parts])
        # evaluation distinct by question_key, training without any part's keys; v3 keys other datasets than
        # EXPRESSION_DATASETS by their text (v2 by an expression that is not the question), so only they move
        version = 2 if all(p.dataset in EXPRESSION_DATASETS for p in self.parts) else 3
        held_out = f"|held-out-by-key-v{version}"
        return hashlib.sha256(f"{text}|{self.train_size}|{self.eval_size}|{self.seed}{held_out}".encode()
                              ).hexdigest()[:12]


def _unknown_options(config_class, config: dict) -> tuple[str, list[str]] | None:
    """The first key of ``config`` that the dataset's config dataclass has no field for, and its fields; None when
    every key is one (or the class is no dataclass: its own error then says what is wrong)."""
    import dataclasses

    if not dataclasses.is_dataclass(config_class):
        return None
    options = [f.name for f in dataclasses.fields(config_class)]
    bad = [k for k in config if k not in options]
    return (bad[0], options) if bad else None
