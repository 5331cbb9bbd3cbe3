"""NoSharing callback: the control arm "none" (docs/probes.md).

Independent GRPO per policy: same loop, same logs, nothing crosses between policies.
It exists so that the control is chosen the same way as every probe
(``--config callbacks/none.yaml``) and logs ``probe/none/<policy>/transfers`` = 0.

It also keeps the control for rescue (:mod:`mrl_lightning.probes.ledger`): when an exchange
is listed before it (SEE publishing successes; ``callbacks/none.yaml`` lists one, whose
records nothing trains on), each weak-part prompt that SGT *would* have rescued (own success
rate at most ``kappa``, a peer's verified success for it within ``max_staleness`` steps) is
marked, and ``probe/none/<p>/later_solved_share_would_be_rescued`` and
``later_solved_share_not_rescued`` are logged as SGT logs its own two
(``later_solved_share_rescued``): the same split with nothing transferred.
"""

from __future__ import annotations

from typing import Any

from mrl_lightning.callbacks.base import MRLCallback, exchange_step
from mrl_lightning.callbacks.rescue_control import note_rescue_control
from mrl_lightning.errors import ConfigError
from mrl_lightning.exchange import SuccessRecord
from mrl_lightning.metrics import Sum
from mrl_lightning.probes.ledger import RescueLedger, merge_ledger_states
from mrl_lightning.probes.sgt import rescue_set


class NoSharing(MRLCallback):
    """Control arm: no experience is shared.

    Args:
        kappa: For the would-be rescue set: a prompt counts when the policy's own success rate
            is at most kappa (set it to SGT's, ``callbacks/sgt.yaml``: 0.5).
        max_staleness: Peer successes at most this many rollout steps old count (SGT's option).

    Raises:
        ConfigError: ``kappa`` outside [0, 1] or a negative ``max_staleness``.
    """

    is_control = True

    def __init__(self, kappa: float = 0.0, max_staleness: int | None = None) -> None:
        errors = []
        if not 0.0 <= kappa <= 1.0:
            errors.append(f"NoSharing.kappa={kappa} must be in [0, 1] (SGT's kappa, e.g. 0.5).")
        if max_staleness is not None and max_staleness < 0:
            errors.append(f"NoSharing.max_staleness={max_staleness} must be >= 0 or null.")
        if errors:
            raise ConfigError("\n".join(errors))
        self.kappa, self.max_staleness = kappa, max_staleness
        self.ledger = RescueLedger()

    @property
    def see_reads(self) -> dict[str, int | None]:
        """Record type read from SEE -> how many steps back (checked by SharedExperienceExchange)."""
        return {"success": self.max_staleness}

    def on_compose_batch(self, ctx, system, policy, batch) -> None:
        name = policy.policy_name
        tag = f"probe/none/{name}"
        batch.metrics[f"{tag}/transfers"] = Sum(0.0)
        services = getattr(ctx, "services", None) or {}
        if "exchange" not in services:  # no exchange listed: no control
            return
        items = batch.scored.items
        records = services["exchange"].query(SuccessRecord, receiver=name, step=exchange_step(ctx),
                                             prompt_ids=[x.prompt_id for x in items], max_staleness=self.max_staleness)
        peer: dict[str, list[str]] = {}
        for rec in records:
            peer.setdefault(rec.prompt_id, []).append(rec.completion_text)
        would_be = rescue_set(batch.scored.success, [x.prompt_id for x in items], peer, self.kappa)
        note_rescue_control(ctx, self.ledger, policy, batch, set(would_be), tag, "would_be_rescued")

    def state_dict(self) -> dict[str, Any]:
        return {"ledger": self.ledger.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.ledger = RescueLedger()
        if "ledger" in state_dict:
            self.ledger.load_state_dict(state_dict["ledger"])

    def merge_rank_states(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """Each rank holds its policies' ledger: the unions."""
        return {"ledger": merge_ledger_states([s["ledger"] for s in states if "ledger" in s])}
