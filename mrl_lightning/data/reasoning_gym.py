"""Prompt data from reasoning-gym procedural tasks (SPEC 1 step 1).

A *part* is one named slice of the task (e.g. addition vs subtraction) built from one
reasoning-gym dataset with its own generator config. Each step yields ``batch_size``
prompts drawn evenly (by ``weight``) from the parts. Prompt ids are stable strings
``"<part>/<index>"`` shared by every policy, so experience about one prompt can be
matched across policies (SPEC 5). The data position is a counter per part plus an
epoch number; each epoch's order is a permutation seeded by (seed, part, epoch), so
``state_dict`` / ``load_state_dict`` resume the exact same stream.

Evaluation prompts come from a separate generator seed, and any training prompt whose
question also appears in the evaluation set is dropped, so evaluation is held out.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import numpy as np

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


@dataclass
class PromptItem:
    """One prompt as every policy sees it (before its own template).

    Attributes:
        prompt_id: Stable id ``"<part>/<index>"``.
        question: Task text.
        answer: Reference answer text.
        part: Name of the task part.
        entry: The reasoning-gym entry (for its verifier).
    """

    prompt_id: str
    question: str
    answer: str
    part: str
    entry: dict[str, Any]


def _seed_for(*keys: Any) -> int:
    digest = hashlib.sha256("/".join(map(str, keys)).encode()).digest()
    return int.from_bytes(digest[:4], "little")


class ReasoningGymDataModule(pl.LightningDataModule):
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
        super().__init__()
        import reasoning_gym

        errors = []
        parts = [p if isinstance(p, TaskPart) else TaskPart(**p) for p in parts]
        if not parts:
            errors.append("data.parts is empty; give at least one TaskPart.")
        names = [p.name for p in parts]
        if len(set(names)) != len(names):
            errors.append(f"data.parts names must be unique; got {names}.")
        known = set(reasoning_gym.factory.DATASETS)
        for p in parts:
            if p.dataset not in known:
                errors.append(f"data.parts[{p.name}].dataset={p.dataset!r} is not a reasoning-gym dataset; "
                              f"e.g. basic_arithmetic, chain_sum, countdown.")
            if p.weight <= 0:
                errors.append(f"data.parts[{p.name}].weight={p.weight} must be > 0.")
        for key, value in (("batch_size", batch_size), ("train_size", train_size), ("eval_size", eval_size)):
            if value < 1:
                errors.append(f"data.{key}={value} must be >= 1.")
        if parts and batch_size < len(parts):
            errors.append(f"data.batch_size={batch_size} is smaller than the number of parts ({len(parts)}).")
        if errors:
            raise ConfigError("Invalid data config:\n  - " + "\n  - ".join(errors))
        self.parts = parts
        self.batch_size = batch_size
        self.train_size = train_size
        self.eval_size = eval_size
        self.seed = seed
        self._train: dict[str, list[PromptItem]] = {}
        self._eval: dict[str, list[PromptItem]] = {}
        self._position = {p.name: {"epoch": 0, "cursor": 0} for p in parts}
        self._order: dict[str, np.ndarray] = {}
        self._order_key: dict[str, tuple] = {}

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
            evals = self._generate(part, _seed_for(self.seed, part.name, "eval"), self.eval_size, "e")
            held = {e.question for e in evals}
            train = [
                x for x in self._generate(part, _seed_for(self.seed, part.name, "train"), self.train_size, "")
                if x.question not in held
            ]
            if not train:
                raise ValueError(f"data.parts[{part.name}]: every training prompt is also an eval prompt; "
                                 "raise train_size or widen the generator config.")
            self._eval[part.name], self._train[part.name] = evals, train

    def _split(self) -> dict[str, int]:
        total = sum(p.weight for p in self.parts)
        counts = {p.name: int(self.batch_size * p.weight / total) for p in self.parts}
        rest = self.batch_size - sum(counts.values())
        for p in sorted(self.parts, key=lambda p: -p.weight)[:rest]:
            counts[p.name] += 1
        return counts

    def _permutation(self, part: str, epoch: int) -> np.ndarray:
        key = (part, epoch)
        if self._order_key.get(part) != key:
            rng = np.random.default_rng(_seed_for(self.seed, part, "epoch", epoch))
            self._order[part] = rng.permutation(len(self._train[part]))
            self._order_key[part] = key
        return self._order[part]

    def next_batch(self) -> list[PromptItem]:
        """The next B prompts of the training stream (advances the data position)."""
        self.setup()
        out: list[PromptItem] = []
        for name, count in self._split().items():
            pos = self._position[name]
            for _ in range(count):
                order = self._permutation(name, pos["epoch"])
                out.append(self._train[name][int(order[pos["cursor"]])])
                pos["cursor"] += 1
                if pos["cursor"] >= len(order):
                    pos["epoch"], pos["cursor"] = pos["epoch"] + 1, 0
        return out

    def eval_items(self) -> dict[str, list[PromptItem]]:
        """Held-out evaluation prompts by part name."""
        self.setup()
        return self._eval

    def train_items(self, part: str) -> list[PromptItem]:
        """All training prompts of one part (used by warm-start recipes).

        Raises:
            KeyError: unknown part name (lists the valid ones).
        """
        self.setup()
        if part not in self._train:
            raise KeyError(f"part {part!r} is unknown; valid: {sorted(self._train)}")
        return self._train[part]

    def fingerprint(self) -> str:
        """Short hash of everything that determines the generated prompts."""
        text = repr([(p.name, p.dataset, sorted(p.config.items()), p.weight) for p in self.parts])
        return hashlib.sha256(f"{text}|{self.train_size}|{self.eval_size}|{self.seed}".encode()).hexdigest()[:12]

    def state_dict(self) -> dict[str, Any]:
        """Data position per part (epoch and cursor)."""
        return {"position": {k: dict(v) for k, v in self._position.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the data position.

        Raises:
            ValueError: the checkpoint's parts differ from this config's parts.
        """
        pos = state_dict["position"]
        if set(pos) != set(self._position):
            raise ValueError(f"checkpoint data parts {sorted(pos)} differ from config parts {sorted(self._position)}.")
        self._position = {k: {"epoch": int(v["epoch"]), "cursor": int(v["cursor"])} for k, v in pos.items()}
