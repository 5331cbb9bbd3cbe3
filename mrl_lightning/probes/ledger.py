"""The control for rescue: do rescued weak-part prompts get solved later more often than the others? (docs/probes.md)

A policy's *weak-part* prompts (task parts it did not start good at) come round again in
later epochs of the data. :class:`RescueLedger` splits those re-draws in two by the prompt's
history before the re-draw: **marked** (SGT transferred a peer's verified success to it at an
earlier draw, or, under ``none``, it *would* have been: its own group's success rate was at
most kappa while a peer had a verified success for it) and **unmarked** (drawn before, never
marked). For each class it keeps the prompts re-drawn while in that class and those whose
own group solved them (one success of G) at such a re-draw:

    later_solved_share(class) = |solved(class)| / |redrawn(class)|

So the two shares cover the same part and the same epochs; their difference under SGT,
against the same difference under ``none`` (where nothing is transferred and the marked
class holds the would-be rescues), is what rescue adds beyond what the policy learns anyway.
Plain Python sets, no trainer: the callbacks (``SuccessGatedTransfer``, ``NoSharing``) feed it.
"""

from __future__ import annotations

import zlib
from typing import Any

CLASSES = ("marked", "unmarked")


def _pack(ids: set[str]) -> bytes:
    return zlib.compress("\n".join(sorted(ids)).encode("utf-8"), 9)


def _unpack(data: bytes) -> set[str]:
    text = zlib.decompress(data).decode("utf-8")
    return set(text.split("\n")) if text else set()


class RescueLedger:
    """Per policy: weak-part prompts seen, marked, and re-drawn / solved by class (module docstring)."""

    def __init__(self) -> None:
        self.seen: dict[str, set[str]] = {}
        self.marked: dict[str, set[str]] = {}
        self.redrawn: dict[str, dict[str, set[str]]] = {}
        self.solved: dict[str, dict[str, set[str]]] = {}

    def step_additions(self, policy: str, draws: list[tuple[str, bool, bool]]) -> tuple[list, list, list, list]:
        """This step's additions from its weak-part draws, without applying them.

        Args:
            policy: The policy.
            draws: ``(prompt id, own group solved it now, marked now)`` of each weak-part draw,
                batch order (a prompt twice in one batch: the second draw is not a re-draw).

        Returns:
            ``(seen, marked, redrawn, solved)``: prompt ids newly seen and newly marked, and
            ``(class, prompt id)`` pairs re-drawn and solved; for :meth:`apply`, after merging
            those of every rank of the policy when it runs on several.
        """
        seen, marked = self.seen.get(policy, set()), self.marked.get(policy, set())
        new_seen, new_marked, redrawn, solved = [], [], [], []
        for pid, solved_now, marked_now in draws:
            if pid in seen:  # drawn at an earlier step: a re-draw, classed by its history
                cls = "marked" if pid in marked else "unmarked"
                redrawn.append((cls, pid))
                if solved_now:
                    solved.append((cls, pid))
            new_seen.append(pid)
            if marked_now:
                new_marked.append(pid)
        return new_seen, new_marked, redrawn, solved

    def apply(self, policy: str, seen: list, marked: list, redrawn: list, solved: list) -> None:
        """Add :meth:`step_additions` (of one rank, or every rank's merged) to ``policy``'s ledger."""
        self.seen.setdefault(policy, set()).update(seen)
        self.marked.setdefault(policy, set()).update(marked)
        for pairs, into in ((redrawn, self.redrawn), (solved, self.solved)):
            by_class = into.setdefault(policy, {c: set() for c in CLASSES})
            for cls, pid in pairs:
                by_class[cls].add(pid)

    def shares(self, policy: str) -> dict[str, tuple[int, int]]:
        """Class -> ``(solved, re-drawn)`` prompt counts of ``policy`` (classes without a re-draw left out)."""
        redrawn, solved = self.redrawn.get(policy, {}), self.solved.get(policy, {})
        return {c: (len(solved.get(c, set()) & redrawn[c]), len(redrawn[c])) for c in CLASSES
                if redrawn.get(c)}

    def state_dict(self) -> dict[str, Any]:
        """Every set, packed (zlib of sorted, newline-joined ids; weights-only loadable)."""
        return {"seen": {p: _pack(v) for p, v in self.seen.items()},
                "marked": {p: _pack(v) for p, v in self.marked.items()},
                "redrawn": {p: {c: _pack(v) for c, v in d.items()} for p, d in self.redrawn.items()},
                "solved": {p: {c: _pack(v) for c, v in d.items()} for p, d in self.solved.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.seen = {p: _unpack(v) for p, v in state["seen"].items()}
        self.marked = {p: _unpack(v) for p, v in state["marked"].items()}
        self.redrawn = {p: {c: _unpack(v) for c, v in d.items()} for p, d in state["redrawn"].items()}
        self.solved = {p: {c: _unpack(v) for c, v in d.items()} for p, d in state["solved"].items()}


def merge_ledger_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One :meth:`RescueLedger.state_dict` from several ranks' (each holds its policies'): the unions."""
    merged = RescueLedger()
    for state in states:
        part = RescueLedger()
        part.load_state_dict(state)
        for policy in part.seen:
            merged.apply(policy, list(part.seen[policy]), list(part.marked.get(policy, ())),
                         [(c, pid) for c, ids in part.redrawn.get(policy, {}).items() for pid in ids],
                         [(c, pid) for c, ids in part.solved.get(policy, {}).items() for pid in ids])
    return merged.state_dict()


def weak_draws(items: list, own_success, strong_parts: list[str] | None, marked_rows: set[int]) -> list:
    """``(prompt id, solved now, marked now)`` of the weak-part rows of a batch.

    Args:
        items: The batch's B prompts (``.prompt_id``, ``.part``).
        own_success: ``[B, G]`` bool, the policy's own successes.
        strong_parts: The parts the policy started good at; None or empty = no weak part known
            (nothing is recorded).
        marked_rows: Rows rescued (or, under ``none``, would have been) this step.
    """
    if not strong_parts:
        return []
    solved = own_success.any(dim=1).tolist()
    return [(item.prompt_id, bool(solved[b]), b in marked_rows) for b, item in enumerate(items)
            if item.part not in strong_parts]
