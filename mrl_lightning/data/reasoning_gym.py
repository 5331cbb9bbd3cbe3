"""Prompt data from reasoning-gym procedural tasks (docs/default.md).

A *part* is one named slice of the task (e.g. addition vs subtraction) built from one
reasoning-gym dataset with its own generator config. Each step yields ``batch_size``
prompts drawn evenly (by ``weight``) from the parts. Prompt ids are stable strings
``"<part>/<index>"`` shared by every policy, so experience about one prompt can be
matched across policies (docs/see.md). The data position is a counter per part plus an
epoch number; each epoch's order is a permutation seeded by (seed, part, epoch), so
``state_dict`` / ``load_state_dict`` resume the exact same stream.

Evaluation prompts come from a separate generator seed, and any training prompt whose
question also appears in the evaluation set is dropped, so evaluation is held out.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from mrl_lightning.data.items import PromptItem
from mrl_lightning.data.stream import PromptDataModule, seed_for, stream_config_errors
from mrl_lightning.errors import ConfigError


@dataclass
class TaskPart:
    """One part of the task.

    Attributes:
        name: Short name used in prompt ids and log tags (e.g. "add").
        dataset: reasoning-gym dataset name (e.g. "basic_arithmetic").
        config: Keyword arguments for ``reasoning_gym.create_dataset`` (no seed/size).
        weight: Relative share of each batch.
    """

    name: str
    dataset: str
    config: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0


class ReasoningGymDataModule(PromptDataModule):
    """Procedural prompts with verifiers from reasoning-gym.

    Args:
        parts: The task parts (at least one; names unique).
        batch_size: Prompts per step, B (>= number of parts).
        train_size: Generated training prompts per part.
        eval_size: Held-out evaluation prompts per part.
        seed: Generator seed; evaluation uses a derived seed.

    Raises:
        ValueError: no parts, duplicate part names, unknown reasoning-gym dataset,
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
                errors.append(f"data.parts[{p.name}].dataset={p.dataset!r} is not a reasoning-gym dataset; "
                              f"e.g. basic_arithmetic, chain_sum, countdown.")
            else:
                try:  # a 1-item dataset checks the generator config cheaply
                    reasoning_gym.create_dataset(p.dataset, seed=0, size=1, **p.config)
                except Exception as exc:  # noqa: BLE001 - reported as a config error with its cause
                    errors.append(f"data.parts[{p.name}].config={p.config!r} is not valid for reasoning-gym "
                                  f"{p.dataset!r}: {type(exc).__name__}: {exc}")
        for key, value in (("train_size", train_size), ("eval_size", eval_size)):
            if value < 1:
                errors.append(f"data.{key}={value} must be >= 1.")
        if errors:
            raise ConfigError("Invalid data config:\n  - " + "\n  - ".join(errors))
        self.parts = parts
        self.train_size = train_size
        self.eval_size = eval_size

    # ------------------------------------------------------------------ building
    def _generate(self, part: TaskPart, seed: int, size: int, tag: str) -> list[PromptItem]:
        import reasoning_gym

        ds = reasoning_gym.create_dataset(part.dataset, seed=seed, size=size, **part.config)
        return [
            PromptItem(f"{part.name}/{tag}{i}", e["question"], str(e["answer"]), part.name, e)
            for i, e in enumerate(ds)
        ]

    def setup(self, stage: str | None = None) -> None:
        """Generate the training and evaluation prompts (idempotent)."""
        if self._train:
            return
        for part in self.parts:
            evals = self._generate(part, seed_for(self.seed, part.name, "eval"), self.eval_size, "e")
            held = {e.question for e in evals}
            train = [
                x for x in self._generate(part, seed_for(self.seed, part.name, "train"), self.train_size, "")
                if x.question not in held
            ]
            if not train:
                raise ValueError(f"data.parts[{part.name}]: every training prompt is also an eval prompt; "
                                 "raise train_size or widen the generator config.")
            self._eval[part.name], self._train[part.name] = evals, train
        self.check_prompt_ids()

    def fingerprint(self) -> str:
        """Short hash of everything that determines the generated prompts."""
        text = repr([(p.name, p.dataset, sorted(p.config.items()), p.weight) for p in self.parts])
        return hashlib.sha256(f"{text}|{self.train_size}|{self.eval_size}|{self.seed}".encode()).hexdigest()[:12]
