"""Test-only callbacks that inject a fault on one rank (for the multi-process CLI tests)."""

import time

from mrl_lightning.callbacks.base import MRLCallback
from mrl_lightning.errors import ConfigError


class FaultOnRank(MRLCallback):
    """Raise (or sleep, with ``sleep_s``) on ``rank`` while composing the batch of step ``step``.

    ``at_setup``: raise in the ``setup`` hook instead (the build phase, after the models are built);
    ``config``: raise a ConfigError (bad input found late) instead of a RuntimeError.
    """

    def __init__(self, rank: int = 1, step: int = 3, sleep_s: float = 0.0, at_setup: bool = False,
                 config: bool = False) -> None:
        self.rank, self.step, self.sleep_s, self.at_setup, self.config = rank, step, sleep_s, at_setup, config

    def _fail(self) -> None:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        elif self.config:
            raise ConfigError("injected: FaultOnRank.config=true on this rank; set it to false.")
        else:
            raise RuntimeError("injected fault")

    def setup(self, ctx, system, datamodule) -> None:
        if self.at_setup and ctx.fabric.global_rank == self.rank:
            self._fail()

    def on_compose_batch(self, ctx, system, policy, batch) -> None:
        if not self.at_setup and ctx.fabric.global_rank == self.rank and ctx.global_step + 1 == self.step:
            self._fail()
