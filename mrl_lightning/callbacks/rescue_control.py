"""The control for rescue, fed by SGT and by the control arm (docs/probes.md; :mod:`mrl_lightning.probes.ledger`)."""

from __future__ import annotations

from mrl_lightning.metrics import Ratio
from mrl_lightning.probes.ledger import RescueLedger, weak_draws


def note_rescue_control(ctx, ledger: RescueLedger, policy, batch, marked_rows: set[int], tag: str,
                        marked_name: str) -> None:
    """Feed this step's weak-part draws of ``policy`` to ``ledger`` and log its two later-solved shares.

    On a group of several ranks every rank's additions are gathered first, so each rank holds
    the ledger one rank on the whole batch would. Logged under ``tag``:
    ``later_solved_share_<marked_name>`` and ``later_solved_share_not_rescued``
    (:mod:`mrl_lightning.probes.ledger`), once a prompt of the class was drawn again.
    """
    name = policy.policy_name
    draws = weak_draws(batch.scored.items, batch.scored.success, getattr(policy, "strong_parts", None), marked_rows)
    additions = ledger.step_additions(name, draws)
    workers = getattr(ctx, "workers", None)
    if workers is not None and workers.group_size(name) > 1:
        parts = workers.group_gather(name, additions)
        additions = tuple([x for part in parts for x in part[k]] for k in range(4))
    ledger.apply(name, *additions)
    for cls, label in (("marked", marked_name), ("unmarked", "not_rescued")):
        solved, redrawn = ledger.shares(name).get(cls, (0, 0))
        if redrawn:
            batch.metrics[f"{tag}/later_solved_share_{label}"] = Ratio(solved, redrawn)
