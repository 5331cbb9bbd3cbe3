"""The hook bus: callbacks the multi-module loop calls by name (SPEC 1).

The loop calls ``fabric.call(hook, ...)`` and every callback that defines the hook
answers, in list order. Hooks, in the order one step calls them:

``setup(trainer, system, datamodule)``
    once, after the policies are built, before step 1 (and before a checkpoint loads).
``on_fit_start(trainer, system)``
``on_rollouts_end(trainer, system, scored)``
    SPEC 1 step 4: ``scored`` maps policy name -> :class:`ScoredRollouts`; SEE publishes here.
``on_compose_batch(trainer, system, policy, batch)``
    SPEC 1 step 5, once per policy: probes add to :class:`TrainBatch` (advantages,
    auxiliary losses, metrics). Probes run in callback-list order.
``on_train_step_end(trainer, system, metrics)``
    after every policy's update; add scalars to ``metrics`` to log them.
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
