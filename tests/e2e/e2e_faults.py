"""Test-only callbacks that inject a fault on one rank (for the multi-process CLI tests)."""

import time

from mrl_lightning.callbacks.base import MRLCallback


class FaultOnRank(MRLCallback):
    """Raise (or sleep, with ``sleep_s``) on ``rank`` while composing the batch of step ``step``."""

    def __init__(self, rank: int = 1, step: int = 3, sleep_s: float = 0.0) -> None:
        self.rank, self.step, self.sleep_s = rank, step, sleep_s

    def on_compose_batch(self, ctx, system, policy, batch) -> None:
        if ctx.fabric.global_rank == self.rank and ctx.global_step + 1 == self.step:
            if self.sleep_s:
                time.sleep(self.sleep_s)
            else:
                raise RuntimeError("injected fault")
