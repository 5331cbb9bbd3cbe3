"""PromptDataModule: the prompt stream every data module shares (docs/loop.md).

Subclasses fill ``self._train`` and ``self._eval`` (part name -> PromptItems) in
``setup()``; this base turns them into the training stream. Each step yields
``batch_size`` prompts split across parts by ``weight`` (floor of B * w / sum w, the
rest to the largest weights). The data position is an (epoch, cursor) pair per part and
each epoch's order is a permutation seeded by (seed, part, epoch), so
``state_dict`` / ``load_state_dict`` resume the exact same stream.
"""

from __future__ import annotations

import hashlib
from typing import Any

import lightning.pytorch as pl
import numpy as np

from mrl_lightning.data.items import PromptItem


def seed_for(*keys: Any) -> int:
    """A 32-bit seed derived from ``keys`` (stable across runs and machines)."""
    digest = hashlib.sha256("/".join(map(str, keys)).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def stream_config_errors(parts: list, batch_size: int, part_class: str) -> list[str]:
    """Problems every data module shares: no parts, duplicate names, weights, batch size."""
    errors = []
    if not parts:
        errors.append(f"data.parts is empty; give at least one {part_class}.")
    names = [p.name for p in parts]
    if len(set(names)) != len(names):
        errors.append(f"data.parts names must be unique; got {names}.")
    errors += [f"data.parts[{p.name}].weight={p.weight} must be > 0." for p in parts if p.weight <= 0]
    if batch_size < 1:
        errors.append(f"data.batch_size={batch_size} must be >= 1.")
    elif parts and batch_size < len(parts):
        errors.append(f"data.batch_size={batch_size} is smaller than the number of parts ({len(parts)}).")
    return errors


class PromptDataModule(pl.LightningDataModule):
    """Base of prompt data modules: weighted batches, held-out eval, resumable position.

    Subclasses set ``self.parts`` (objects with ``name`` and ``weight``), call
    ``super().__init__(batch_size, seed)`` and implement ``setup`` and ``fingerprint``.

    Args:
        batch_size: Prompts per step, B.
        seed: Seeds every permutation.
    """

    parts: list

    def __init__(self, batch_size: int, seed: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.seed = seed
        self._train: dict[str, list[PromptItem]] = {}
        self._eval: dict[str, list[PromptItem]] = {}
        self._position: dict[str, dict[str, int]] = {}
        self._order: dict[str, np.ndarray] = {}
        self._order_key: dict[str, tuple] = {}

    def _positions(self) -> dict[str, dict[str, int]]:
        if not self._position:
            self._position = {p.name: {"epoch": 0, "cursor": 0} for p in self.parts}
        return self._position

    def fingerprint(self) -> str:  # pragma: no cover - every subclass overrides
        """Short hash of everything that determines the prompts."""
        raise NotImplementedError

    def _split(self) -> dict[str, int]:
        total = sum(p.weight for p in self.parts)
        counts = {p.name: int(self.batch_size * p.weight / total) for p in self.parts}
        rest = self.batch_size - sum(counts.values())
        for p in sorted(self.parts, key=lambda p: -p.weight)[:rest]:
            counts[p.name] += 1
        return counts

    def _permutation(self, part: str, epoch: int) -> np.ndarray:
        if self._order_key.get(part) != (part, epoch):
            rng = np.random.default_rng(seed_for(self.seed, part, "epoch", epoch))
            self._order[part] = rng.permutation(len(self._train[part]))
            self._order_key[part] = (part, epoch)
        return self._order[part]

    def check_prompt_ids(self) -> None:
        """Refuse one prompt id naming two different prompts (subclasses call it at the end of ``setup``).

        SEE records, probes and evaluation match experience across policies by prompt id,
        so an id must name one prompt: a second item with the same id and another question
        or answer (anywhere in the training or evaluation prompts) would let one prompt's
        verified successes be trained on as another's. The same prompt listed twice under
        one id is allowed (it is simply drawn more often).

        Raises:
            ConfigError: names the id, both prompts (part and question) and the fix.
        """
        from mrl_lightning.errors import ConfigError

        self._ids_checked = True
        seen: dict[str, PromptItem] = {}
        clashes = []
        for split in (self._train, self._eval):
            for items in split.values():
                for item in items:
                    first = seen.setdefault(item.prompt_id, item)
                    if first is not item and (first.question, first.answer) != (item.question, item.answer):
                        clashes.append((item.prompt_id, first, item))
        if clashes:
            pid, a, b = clashes[0]
            raise ConfigError(
                f"data: prompt id {pid!r} names two different prompts: part {a.part!r} {a.question[:60]!r} "
                f"(answer {a.answer!r}) and part {b.part!r} {b.question[:60]!r} (answer {b.answer!r}); "
                f"{len(clashes)} such id(s) in all. Prompt ids must be unique per prompt (SEE and the probes "
                f"match experience by id): make the data module build ids from a unique key, e.g. "
                f"'<part>/<row index>'.")

    def next_batch(self) -> list[PromptItem]:
        """The next B prompts of the training stream (advances the data position)."""
        self.setup()
        if not getattr(self, "_ids_checked", False):  # a subclass whose setup does not check
            self.check_prompt_ids()
        out: list[PromptItem] = []
        positions = self._positions()
        for name, count in self._split().items():
            pos = positions[name]
            for _ in range(count):
                order = self._permutation(name, pos["epoch"])
                out.append(self._train[name][int(order[pos["cursor"]])])
                pos["cursor"] += 1
                if pos["cursor"] >= len(order):
                    pos["epoch"], pos["cursor"] = pos["epoch"] + 1, 0
        return out

    def extra_batch(self, stream: str, step: int, draw: int, exclude: set[str]) -> list[PromptItem]:
        """Up to B more training prompts for one policy's dynamic sampling (docs/grpo.md, "Dynamic sampling").

        A pure function of (data seed, ``stream``, ``step``, ``draw``): each part's count is its
        share of a batch (as :meth:`next_batch` splits B), taken in the order of a permutation of
        the part seeded by those keys, skipping prompt ids in ``exclude`` (the step's prompts so
        far). It neither reads nor advances the data position, so the shared stream every policy
        sees stays where it is, and a resumed run (or another placement) draws the same prompts
        with nothing to checkpoint.

        Args:
            stream: The drawing policy's name.
            step: The rollout step.
            draw: Which extra batch of the step (1 = the first after the shared batch).
            exclude: Prompt ids already in this step's batches.

        Returns:
            The prompts, part by part; fewer than B when a part has too few prompts left.
        """
        self.setup()
        out: list[PromptItem] = []
        for name, count in self._split().items():
            items = self._train[name]
            rng = np.random.default_rng(seed_for(self.seed, "extra", stream, step, draw, name))
            order = rng.permutation(len(items))
            taken = [items[int(i)] for i in order if items[int(i)].prompt_id not in exclude]
            out.extend(taken[:count])
        return out

    def eval_items(self) -> dict[str, list[PromptItem]]:
        """Held-out evaluation prompts by part name (parts without any are left out)."""
        self.setup()
        return {name: items for name, items in self._eval.items() if items}

    def eval_question_counts(self) -> dict[str, int]:
        """Distinct evaluation questions by part (:func:`~mrl_lightning.data.question_keys.question_key`).

        Success intervals are over these, not over rows (docs/default.md, "The task"); both data
        modules make every evaluation row of a part a distinct question.
        """
        from mrl_lightning.data.question_keys import question_key

        return {name: len({question_key(x.question, x.entry.get("metadata")) for x in items})
                for name, items in self.eval_items().items()}

    def log_eval_questions(self) -> None:
        """Say once (rank zero, at the end of ``setup``) how many distinct questions each part evaluates on."""
        from lightning.pytorch.utilities import rank_zero_info

        counts = ", ".join(f"{name} {n}" for name, n in self.eval_question_counts().items())
        if counts:
            rank_zero_info(f"data: held-out evaluation questions (distinct, none trained on) per part: {counts}")

    def train_items(self, part: str) -> list[PromptItem]:
        """All training prompts of one part.

        Raises:
            KeyError: unknown part name (lists the valid ones).
        """
        self.setup()
        if part not in self._train:
            raise KeyError(f"part {part!r} is unknown; valid: {sorted(self._train)}")
        return self._train[part]

    def state_dict(self) -> dict[str, Any]:
        """Data position per part (epoch and cursor)."""
        return {"position": {k: dict(v) for k, v in self._positions().items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the data position.

        Raises:
            ValueError: the checkpoint's parts differ from this config's parts.
        """
        pos = state_dict["position"]
        if set(pos) != set(self._positions()):
            raise ValueError(f"checkpoint data parts {sorted(pos)} differ from config parts "
                             f"{sorted(self._positions())}.")
        self._position = {k: {"epoch": int(v["epoch"]), "cursor": int(v["cursor"])} for k, v in pos.items()}
