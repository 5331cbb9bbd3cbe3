"""NoSharing callback: the control arm "none" (docs/probes.md).

Independent GRPO per policy: same loop, same logs, nothing crosses between policies.
It exists so that the control is chosen the same way as every probe
(``--config callbacks/none.yaml``) and logs ``probe/none/<policy>/transfers`` = 0.
"""

from __future__ import annotations

from mrl_lightning.callbacks.base import MRLCallback
from mrl_lightning.metrics import Sum


class NoSharing(MRLCallback):
    """Control arm: no experience is shared."""

    def on_compose_batch(self, ctx, system, policy, batch) -> None:
        batch.metrics[f"probe/none/{policy.policy_name}/transfers"] = Sum(0.0)
