"""The control for rescue (mrl_lightning/probes/ledger.py): weak-part re-draws split by their history."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mrl_lightning.update.batch import TrainBatch
from mrl_lightning.callbacks import NoSharing, SharedExperienceExchange
from mrl_lightning.data.items import PromptItem
from mrl_lightning.exchange import SuccessRecord
from mrl_lightning.probes.ledger import RescueLedger, merge_ledger_states, weak_draws


def _step(ledger, draws):
    ledger.apply("p", *ledger.step_additions("p", draws))


def test_re_draws_are_classed_by_the_history_before_them_by_hand():
    ledger = RescueLedger()
    # epoch 1: a and b fail; a is rescued, b is not; c fails, not rescued
    _step(ledger, [("a", False, True), ("b", False, False), ("c", False, False)])
    assert ledger.shares("p") == {}  # nothing drawn again yet
    # epoch 2: a solved (rescued earlier), b solved (never rescued), c fails again and is rescued now
    _step(ledger, [("a", True, False), ("b", True, False), ("c", False, True)])
    assert ledger.shares("p") == {"marked": (1, 1), "unmarked": (1, 2)}  # marked: a solved; unmarked: b solved, c not
    # epoch 3: c, rescued at epoch 2, now counts as marked; it is solved
    _step(ledger, [("c", True, False)])
    assert ledger.shares("p") == {"marked": (2, 2), "unmarked": (1, 2)}  # marked {a, c}; unmarked {b, c}: b solved


def test_a_prompt_twice_in_one_batch_is_not_a_re_draw():
    ledger = RescueLedger()
    _step(ledger, [("a", False, False), ("a", True, False)])
    assert ledger.shares("p") == {}


def test_only_weak_parts_are_recorded_and_the_state_round_trips_and_merges():
    items = [PromptItem("s1", "q", "1", "add", {}), PromptItem("w1", "q", "1", "sub", {})]
    success = torch.tensor([[True, False], [False, False]])
    draws = weak_draws(items, success, ["add"], marked_rows={1})
    assert draws == [("w1", False, True)]
    assert weak_draws(items, success, None, set()) == []
    ledger = RescueLedger()
    _step(ledger, draws)
    _step(ledger, [("w1", True, False)])
    again = RescueLedger()
    again.load_state_dict(ledger.state_dict())
    assert again.shares("p") == ledger.shares("p") == {"marked": (1, 1)}
    other = RescueLedger()
    other.apply("q", ["x"], [], [("unmarked", "x")], [])
    merged = RescueLedger()
    merged.load_state_dict(merge_ledger_states([ledger.state_dict(), other.state_dict()]))
    assert merged.shares("p") == {"marked": (1, 1)} and merged.shares("q") == {"unmarked": (0, 1)}


def test_none_marks_the_prompts_sgt_would_have_rescued_and_logs_both_shares():
    see = SharedExperienceExchange(record_types=["success"])
    probe = NoSharing(kappa=0.0)
    policy = SimpleNamespace(policy_name="me", strong_parts=["add"])
    items = [PromptItem("w1", "q", "1", "sub", {}), PromptItem("w2", "q", "1", "sub", {})]

    def compose(step, success, peer_ids):
        see.exchange.publish([SuccessRecord(pid, "peer", step, " 1", 1.0, "exact", "1") for pid in peer_ids])
        ctx = SimpleNamespace(services={"exchange": see.exchange}, rollout_step=step, workers=None)
        batch = TrainBatch(SimpleNamespace(items=items, success=torch.tensor(success)), torch.zeros(2, 2))
        probe.on_compose_batch(ctx, None, policy, batch)
        return batch.metrics

    # step 1: both fail; a peer solved w1 only -> w1 would have been rescued, w2 not
    first = compose(1, [[False, False], [False, False]], ["w1"])
    assert first["probe/none/me/transfers"] == 0.0 and not any("later_solved" in k for k in first)
    # step 2 (the next epoch): w1 solved by its own group, w2 not
    second = compose(2, [[True, False], [False, False]], [])
    assert second["probe/none/me/later_solved_share_would_be_rescued"] == 1.0
    assert second["probe/none/me/later_solved_share_not_rescued"] == 0.0
