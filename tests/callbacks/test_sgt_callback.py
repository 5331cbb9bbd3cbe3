"""SuccessGatedTransfer callback (docs/probes.md): repeated successes, the later-solved share, rank merging.

Every case is a few steps on a hand-made exchange; expected values are counted by hand.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.update.batch import TrainBatch
from mrl_lightning.callbacks.sgt import SuccessGatedTransfer
from mrl_lightning.callbacks.sgt_terms import pack_ids, unpack_ids
from mrl_lightning.data.items import PromptItem
from mrl_lightning.exchange import SuccessRecord
from mrl_lightning.exchange.buffer import ExperienceExchange

SHARE = "probe/sgt/me/rescued_later_solved_share"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from mrl_lightning.recipes.tokenizers import train_char_level

    return train_char_level(["Calculate 12 + 34.\nAnswer: 46", "What is 7 - 5?"], tmp_path_factory.mktemp("sgt_cb"))


def _success(pid: str, step: int, text: str = " 46", source: str = "peer") -> SuccessRecord:
    return SuccessRecord(prompt_id=pid, source=source, step=step, completion_text=text, reward=1.0,
                         verifier="rg_exact", verifier_version="test")


def _compose(probe, exchange, tokenizer, step: int, own: dict[str, bool],
             strong_parts: list[str] | None = None) -> dict[str, float]:
    """One on_compose_batch for receiver "me" at ``step``; ``own[pid]`` = it solved pid itself (its part: add)."""
    trainer = SimpleNamespace(exchange=exchange, rollout_step=step)
    policy = SimpleNamespace(policy_name="me", tokenizer=tokenizer, max_prompt_length=64,
                             end_of_turn_id=tokenizer.eos_token_id, strong_parts=strong_parts)
    items = [PromptItem(pid, "q", "a", "add", {}) for pid in own]
    success = torch.tensor([[solved, False] for solved in own.values()])
    prompt = "12 + 34?\nAnswer:"
    scored = SimpleNamespace(items=items, success=success, prompt_texts=[prompt] * len(items),
                             own_prompt_ids=lambda b: tokenizer(prompt)["input_ids"])
    batch = TrainBatch(scored=scored, advantages=torch.zeros(len(items), 2))
    probe.on_compose_batch(trainer, None, policy, batch)
    return batch.metrics


def test_success_repeated_at_step_20_is_transferred_with_a_5_step_window(tokenizer):
    # The peer solved add/7 at step 1 and again, same text, at step 20. With SGT's max_staleness 5
    # only records of steps >= 15 count at step 20: the step-20 record must be held.
    exchange = ExperienceExchange()
    exchange.publish([_success("add/7", 1)])
    exchange.publish([_success("add/7", 20)])
    metrics = _compose(SuccessGatedTransfer(max_staleness=5), exchange, tokenizer, 20, {"add/7": False})
    assert metrics["probe/sgt/me/rescue_set_size"] == 1.0
    assert metrics["probe/sgt/me/transfers"] == 1.0


def test_success_repeated_at_step_20_is_transferred_under_the_exchange_window_of_2(tokenizer):
    # Step 20's success refreshes the step-1 one (the loop advances first; either order keeps it).
    exchange = ExperienceExchange(max_staleness=2)
    exchange.publish([_success("add/7", 1)])
    exchange.publish([_success("add/7", 20)])
    exchange.advance(20)
    metrics = _compose(SuccessGatedTransfer(), exchange, tokenizer, 20, {"add/7": False})
    assert metrics["probe/sgt/me/transfers"] == 1.0


def test_later_solved_share_counts_only_rescued_prompts_seen_again(tokenizer):
    exchange = ExperienceExchange()
    exchange.publish([_success(pid, 1) for pid in ("A", "B", "C")])
    probe = SuccessGatedTransfer()
    # Step 1: A and B rescued. Nothing rescued was seen again yet: no value, so no tag.
    m1 = _compose(probe, exchange, tokenizer, 1, {"A": False, "B": False})
    assert m1["probe/sgt/me/rescue_set_size"] == 2.0 and SHARE not in m1
    # Step 2: C rescued. Still no rescued prompt seen again.
    m2 = _compose(probe, exchange, tokenizer, 2, {"C": False})
    assert SHARE not in m2
    # Step 3: A seen again and solved on-policy. Seen again: {A}; solved: {A} -> 1 / 1 = 1.0
    # (dividing by all rescued prompts {A, B, C} would give 1/3).
    m3 = _compose(probe, exchange, tokenizer, 3, {"A": True})
    assert m3[SHARE] == 1.0
    # Step 4: B seen again, still unsolved (and rescued again). Seen again {A, B}, solved {A}: 0.5.
    m4 = _compose(probe, exchange, tokenizer, 4, {"B": False})
    assert m4[SHARE] == 0.5
    state = {k: v for k, v in _ids(probe.state_dict()).items() if k not in ("ledger", "bound")}
    assert state == {"rescued": {"me": ["A", "B", "C"]}, "seen_after_rescue": {"me": ["A", "B"]},
                     "solved_after_rescue": {"me": ["A"]}}


def test_a_prompt_no_demo_reached_is_not_rescued(tokenizer, monkeypatch):
    # A's only peer success fails THL's round trip: nothing is trained on, so A is not rescued, and
    # when A is solved later it counts among the prompts not rescued. B's success retokenizes.
    import dataclasses

    import mrl_lightning.callbacks.sgt as sgt_callback

    real = sgt_callback.retokenize
    monkeypatch.setattr(sgt_callback, "retokenize", lambda *a, **k: dataclasses.replace(
        real(*a, **k), round_trip_ok=False) if a[2] == " 4" else real(*a, **k))
    exchange = ExperienceExchange()
    exchange.publish([_success("A", 1, " 4"), _success("B", 1)])
    probe = SuccessGatedTransfer()
    m1 = _compose(probe, exchange, tokenizer, 1, {"A": False, "B": False}, strong_parts=["sub"])
    assert (m1["probe/sgt/me/retokenize_failures"], m1["probe/sgt/me/transfers"],
            m1["probe/sgt/me/rescue_set_size"]) == (1.0, 1.0, 1.0)
    assert probe.rescued["me"] == {"B"} and probe.ledger.marked["me"] == {"B"}
    m2 = _compose(probe, exchange, tokenizer, 2, {"A": True}, strong_parts=["sub"])
    assert float(m2["probe/sgt/me/later_solved_share_not_rescued"]) == 1.0
    assert SHARE not in m2


def test_a_receiver_of_weight_0_gets_no_transfer_and_no_rescue(tokenizer):
    exchange = ExperienceExchange()
    exchange.publish([_success("B", 1)])
    probe = SuccessGatedTransfer(lambda_per_policy={"me": 0.0})
    metrics = _compose(probe, exchange, tokenizer, 1, {"B": False})
    assert (metrics["probe/sgt/me/transfers"], metrics["probe/sgt/me/rescue_set_size"]) == (0.0, 0.0)
    assert probe.rescued["me"] == set()


def _ids(state):
    """A state's packed id sets as sorted lists."""
    return {key: {policy: sorted(unpack_ids(ids)) for policy, ids in per_policy.items()}
            for key, per_policy in state.items()}


def test_packed_state_is_small_exact_and_loads_with_weights_only():
    import io

    ids = {f"sub/{i}" for i in range(5000)}
    packed = pack_ids(ids)
    buffer = io.BytesIO()
    torch.save({"rescued": {"a": packed}}, buffer)
    assert buffer.tell() < 5 * len(ids)  # a list of the same ids takes ~18 bytes each
    buffer.seek(0)
    assert unpack_ids(torch.load(buffer, weights_only=True)["rescued"]["a"]) == ids
    assert unpack_ids(pack_ids(set())) == set() and unpack_ids(["A", "B"]) == {"A", "B"}
    with pytest.raises(ValueError, match="holds a newline"):
        pack_ids({"bad\nid"})


def test_a_prompt_solved_before_any_rescue_is_not_counted(tokenizer):
    exchange = ExperienceExchange()
    exchange.publish([_success("A", 1)])
    probe = SuccessGatedTransfer()
    m1 = _compose(probe, exchange, tokenizer, 1, {"A": True})  # solved by itself: not rescued
    m2 = _compose(probe, exchange, tokenizer, 2, {"A": True})
    assert SHARE not in m1 and SHARE not in m2
    assert _ids(probe.state_dict())["rescued"] == {"me": []}


def test_state_round_trip_keeps_the_share(tokenizer):
    exchange = ExperienceExchange()
    exchange.publish([_success(pid, 1) for pid in ("A", "B")])
    probe = SuccessGatedTransfer()
    _compose(probe, exchange, tokenizer, 1, {"A": False, "B": False})
    _compose(probe, exchange, tokenizer, 2, {"A": True})
    resumed = SuccessGatedTransfer()
    resumed.load_state_dict(probe.state_dict())
    # Step 3: B seen again, unsolved: seen {A, B}, solved {A} -> 0.5 in both.
    assert _compose(resumed, exchange, tokenizer, 3, {"B": False})[SHARE] == 0.5
    assert _compose(probe, exchange, tokenizer, 3, {"B": False})[SHARE] == 0.5


def test_merge_rank_states_takes_the_union_per_policy():
    # Worker 0 runs policy "a" on prompts A, B; worker 1 runs "a" on C and all of policy "b".
    w0 = {"rescued": {"a": ["A", "B"]}, "seen_after_rescue": {"a": ["A"]}, "solved_after_rescue": {"a": ["A"]}}
    w1 = {"rescued": {"a": ["C", "A"], "b": ["X"]}, "seen_after_rescue": {"a": ["C"], "b": ["X"]},
          "solved_after_rescue": {"a": [], "b": ["X"]}}
    probe = SuccessGatedTransfer()
    merged = probe.merge_rank_states([w0, w1])
    assert {k: v for k, v in _ids(merged).items() if k not in ("ledger", "bound")} == {
        "rescued": {"a": ["A", "B", "C"], "b": ["X"]},
        "seen_after_rescue": {"a": ["A", "C"], "b": ["X"]},
        "solved_after_rescue": {"a": ["A"], "b": ["X"]},
    }
    assert w0["rescued"] == {"a": ["A", "B"]}  # inputs untouched
    probe.load_state_dict(merged)
    assert probe.rescued == {"a": {"A", "B", "C"}, "b": {"X"}}
    # One worker's state merges to itself.
    assert {k: v for k, v in _ids(probe.merge_rank_states([w0])).items() if k not in ("ledger", "bound")} == w0


def test_merge_rank_states_reads_old_states_and_rejects_bad_input():
    old = {"rescued": {"a": ["A", "B"]}, "solved_after_rescue": {"a": ["B"]}}  # no seen_after_rescue
    probe = SuccessGatedTransfer()
    assert _ids(probe.merge_rank_states([old]))["seen_after_rescue"] == {"a": ["B"]}
    with pytest.raises(ValueError, match=r"states=\[\] is empty"):
        probe.merge_rank_states([])
    with pytest.raises(ValueError, match=r"states\[1\] has no \['rescued'\]"):
        probe.merge_rank_states([old, {"solved_after_rescue": {}}])


class _ThreadGroup:
    """Two ranks of one policy's group as two threads: ``group_gather`` exchanges objects at a barrier."""

    def __init__(self, size: int = 2):
        import threading

        self.size, self.barrier, self.slots = size, threading.Barrier(size), [None] * size

    def rank(self, r: int):
        group = self

        class _Workers:
            local_policies = ["me"]

            def group_size(self, name):
                return group.size

            def group_index(self, name):
                return r

            def group_gather(self, name, obj):
                group.slots[r] = obj
                group.barrier.wait()
                out = list(group.slots)
                group.barrier.wait()
                return out

        return _Workers()


def _compose_rows(probe, exchange, tokenizer, rows, workers=None):
    """on_compose_batch for receiver "me" on one rank's rows ``[(pid, solved)]``; its metrics and terms."""
    trainer = SimpleNamespace(exchange=exchange, rollout_step=1, workers=workers)
    policy = SimpleNamespace(policy_name="me", tokenizer=tokenizer, max_prompt_length=64,
                             end_of_turn_id=tokenizer.eos_token_id)
    items = [PromptItem(pid, "q", "a", "add", {}) for pid, _ in rows]
    success = torch.tensor([[solved, False] for _, solved in rows])
    prompt = "12 + 34?\nAnswer:"
    scored = SimpleNamespace(items=items, success=success, prompt_texts=[prompt] * len(items),
                             own_prompt_ids=lambda b: tokenizer(prompt)["input_ids"])
    batch = TrainBatch(scored=scored, advantages=torch.zeros(len(items), 2))
    probe.on_compose_batch(trainer, None, policy, batch)
    return batch


@pytest.mark.parametrize("first_solved", [False, True], ids=["first-draw-eligible", "second-draw-eligible"])
def test_a_prompt_drawn_twice_is_rescued_once_per_group_across_ranks(tokenizer, first_solved):
    """Batch [A, A, B, C], every prompt solved by the peer. One rank rescues A once (at its first eligible
    draw): 3 demos, A weighs 1/3. Two ranks hold strided shards [A, B] and [A, C]: together they must
    rescue the same draws, so 3 demos in the group, not 4 (A trained on twice, the mean's denominator grown)."""
    import threading

    exchange = ExperienceExchange()
    exchange.publish([_success(pid, 1) for pid in ("A", "B", "C")])
    batch_rows = [("A", first_solved), ("A", False), ("B", False), ("C", False)]
    one = _compose_rows(SuccessGatedTransfer(), exchange, tokenizer, batch_rows)
    assert one.metrics["probe/sgt/me/transfers"] == 3.0 and one.counts["sgt_demos"] == 3.0
    rescued_at = 1 if first_solved else 0

    group, out = _ThreadGroup(), {}

    def rank(r):
        out[r] = _compose_rows(SuccessGatedTransfer(), exchange, tokenizer, batch_rows[r::2], group.rank(r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert set(out) == {0, 1}
    assert sum(out[r].counts["sgt_demos"] for r in range(2)) == 3.0
    assert sum(out[r].metrics["probe/sgt/me/rescue_set_size"] for r in range(2)) == 3.0
    # A's demo sits on the rank holding its first eligible draw (position 0 on rank 0, position 1 on rank 1)
    assert out[rescued_at].counts["sgt_demos"] == 2.0 and out[1 - rescued_at].counts["sgt_demos"] == 1.0


def test_the_bound_state_after_a_resume_comes_from_the_rank_that_updates_its_receiver():
    """Two workers, one receiver each, adaptive bound. After a resume both hold both receivers' states;
    each then updates only its own. The next checkpoint must hold each receiver's live state, not the
    frozen copy the other worker loaded (a second resume would otherwise bring a stale bound back)."""
    loaded = {"a": {"level": 0.5, "reference": 0.6}, "b": {"level": 0.4, "reference": 0.4}}
    workers = []
    for mine in ("a", "b"):
        probe = SuccessGatedTransfer(max_grad_share=0.6, max_grad_share_low=0.2)
        probe.setup(SimpleNamespace(workers=SimpleNamespace(local_policies=[mine])), None, None)
        probe.load_state_dict({"rescued": {}, "solved_after_rescue": {}, "bound": loaded})
        probe.bound.track(probe.bound_state[mine], 100, successes=1.0, count=4.0)  # this worker's receiver moves on
        workers.append(probe)
    live = {mine: dict(w.bound_state[mine]) for mine, w in zip("ab", workers)}
    assert live["a"] != loaded["a"] and live["b"] != loaded["b"]
    merged = workers[0].merge_rank_states([w.state_dict() for w in workers])
    assert merged["bound"] == live
    # a checkpoint of the removed fused mode (scale, measured_at) loads without them
    again = SuccessGatedTransfer(max_grad_share=0.3)
    again.load_state_dict({"rescued": {}, "solved_after_rescue": {},
                           "bound": {"a": {"level": None, "reference": None, "scale": 0.25, "measured_at": 100}}})
    assert again.bound_state == {"a": {"level": None, "reference": None}}


def test_an_out_of_range_share_bound_is_said_once_and_a_negative_weight_names_only_itself():
    from mrl_lightning.errors import ConfigError

    with pytest.raises(ConfigError) as share:
        SuccessGatedTransfer(max_grad_share=1.5)
    assert str(share.value).count("max_grad_share=1.5") == 1 and "\n" not in str(share.value)
    with pytest.raises(ConfigError) as weight:
        SuccessGatedTransfer(lambda_per_policy={"a": -1.0, "b": 1.0})
    assert "{'a': -1.0}" in str(weight.value) and "'b'" not in str(weight.value)


def _bounds_as_the_loop_feeds_them(probe, tokenizer, strong_success: list[bool]) -> list[float]:
    """The step's bound at each step of a run, the loop's way: ``rollout_step`` is 1 at the first compose
    (the loop counts the rollout phase before composing); one strong-part prompt a step, solved or not."""
    bounds = []
    for step, solved in enumerate(strong_success, start=1):
        metrics = _compose(probe, ExperienceExchange(), tokenizer, step, {f"add/{step}": solved}, strong_parts=["add"])
        bounds.append(metrics["probe/sgt/me/grad_share_bound"])
    return bounds


def test_the_adaptive_reference_of_one_step_is_the_first_step_the_loop_runs(tokenizer):
    # Strong part 1.0 at the first step (success 1 of the 2 completions: rate 0.5), then 0.0. With
    # reference_steps 1 and ema 1, the reference is the first step's 0.5; the level then drops to 0:
    # a 100% drop, past adaptive_drop, so the bound falls to the low bound from the second step on.
    probe = SuccessGatedTransfer(max_grad_share=0.6, max_grad_share_low=0.2, adaptive_drop=0.1, adaptive_ema=1.0,
                                 adaptive_reference_steps=1)
    assert _bounds_as_the_loop_feeds_them(probe, tokenizer, [True, False, False, False]) == pytest.approx(
        [0.6, 0.2, 0.2, 0.2])


def test_the_adaptive_reference_spans_exactly_its_steps(tokenizer):
    # Success rates 0.0, 0.5, 0.0, 0.0 with reference_steps 2: the reference is the best of the first two
    # steps, 0.5 (taken over one step too few it would be 0.0, leaving the bound at the start forever).
    probe = SuccessGatedTransfer(max_grad_share=0.6, max_grad_share_low=0.2, adaptive_drop=0.5, adaptive_ema=1.0,
                                 adaptive_reference_steps=2)
    bounds = _bounds_as_the_loop_feeds_them(probe, tokenizer, [False, True, False, False])
    assert probe.bound_state["me"]["reference"] == pytest.approx(0.5)
    assert bounds == pytest.approx([0.6, 0.6, 0.2, 0.2])


def test_the_schedule_gives_its_start_at_the_first_step_and_its_final_after_ramp_steps(tokenizer):
    probe = SuccessGatedTransfer(max_grad_share=0.3, max_grad_share_final=0.6, max_grad_share_ramp_steps=2)
    assert _bounds_as_the_loop_feeds_them(probe, tokenizer, [False] * 4) == pytest.approx([0.3, 0.45, 0.6, 0.6])
