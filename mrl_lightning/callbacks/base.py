"""The hook bus: callbacks the multi-module loop calls by name (docs/loop.md).

The loop calls ``fabric.call(hook, ...)`` and every callback that defines the hook
answers, in list order. Hooks, in the order one step calls them:

``setup(trainer, system, datamodule)``
    once, after the policies are built, before step 1 (and before a checkpoint loads).
``on_fit_start(trainer, system)``
``on_rollouts_end(trainer, system, scored)``
    the exchange point: ``scored`` maps policy name -> :class:`ScoredRollouts` for the
    policies *this rank* runs (its share of the step's prompts); SEE sends its records to
    every rank here (``trainer.workers.exchange``).
``on_compose_batch(trainer, system, policy, batch)``
    once per policy this rank runs: probes add to :class:`TrainBatch` (advantages,
    auxiliary losses, loss normalizers in ``batch.counts``, metrics). Probes run in
    callback-list order. ``system.policies`` holds every policy's tokenizer on every
    rank, but only this rank's policies have a model.
``on_train_step_end(trainer, system, metrics)``
    after the update of every policy this rank runs; ``metrics`` holds this rank's
    scalars of the step; add scalars to it to log them (they are combined over ranks at
    each log step).
``on_eval_end(trainer, system, metrics)``
``on_fit_end(trainer, system)``

Callbacks with state implement ``state_dict`` / ``load_state_dict``; their
``state_key`` keeps two instances of one class apart in a checkpoint.
"""

from __future__ import annotations

from typing import Any


class MRLCallback:
    """Base class of mrl-lightning callbacks (all hooks optional)."""

    @property
    def state_key(self) -> str:
        """Key of this callback's state in a checkpoint (class name by default)."""
        return type(self).__name__

    def config_errors(self, trainer, system) -> list[str]:
        """Problems with this callback in this run, checked before any model is built."""
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None

    def merge_rank_states(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """One state from this callback's ``state_dict`` on every rank (rank order), for the checkpoint.

        The default keeps rank 0's: right for state every rank holds alike (SEE's exchange,
        which every rank receives in full). A callback whose state is split by policy or
        by prompt across ranks overrides this to merge the parts.
        """
        return states[0]
