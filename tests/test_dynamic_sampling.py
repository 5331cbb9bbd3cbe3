"""DAPO's dynamic sampling: the group filter, the policy's own extra draws, and the draw rule over ranks (docs/grpo.md).

The loop's part (:func:`~mrl_lightning.loop.dynamic_sampling.sample_until_full`) runs here on a
real data module with a scripted ``rollout`` (rewards all equal for some prompts) and
fake workers: one rank, and two ranks as two threads meeting at the group's gather, which
must draw the same extra batches and keep the same groups as one rank. End to end (``mrl
fit`` on one and two processes, resume): tests/e2e/test_dynamic_sampling_fit.py.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.update.batch import ScoredRollouts, TrainBatch
from mrl_lightning.data.reasoning_gym import ReasoningGymDataModule, TaskPart
from mrl_lightning.loop.dynamic_sampling import sample_until_full
from mrl_lightning.objectives.group_filter import first_kept, groups_with_signal
from mrl_lightning.rollout.base import RolloutBatch

G = 2
NAN = float("nan")
CONFIG = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, allow_parentheses=False, allow_negation=False)


def _data(batch_size=4):
    return ReasoningGymDataModule([TaskPart("add", "basic_arithmetic", dict(CONFIG, operators=["+"])),
                                   TaskPart("sub", "basic_arithmetic", dict(CONFIG, operators=["-"]))],
                                  batch_size=batch_size, train_size=60, eval_size=4, seed=0)


def test_groups_with_equal_rewards_have_no_signal():
    rewards = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [NAN, 1.0, 1.0], [NAN, NAN, 1.0], [0.2, 0.7, NAN]])
    assert groups_with_signal(rewards).tolist() == [False, True, False, False, True]
    assert first_kept([7, 2, 5, 0], 3) == [0, 2, 5]
    with pytest.raises(ValueError, match="rewards must be"):
        groups_with_signal(torch.zeros(4))


def test_extra_batches_are_a_pure_function_of_seed_policy_step_and_draw():
    dm = _data()
    shared = dm.next_batch()
    position = dm.state_dict()
    exclude = {x.prompt_id for x in shared}
    a = dm.extra_batch("llama", 3, 1, exclude)
    assert [x.prompt_id for x in a] == [x.prompt_id for x in _data().extra_batch("llama", 3, 1, exclude)]
    assert dm.state_dict() == position  # the shared stream's position is untouched
    assert [x.part for x in a] == ["add", "add", "sub", "sub"]  # split over parts as a shared batch is
    assert not exclude & {x.prompt_id for x in a}
    others = [dm.extra_batch("gpt2", 3, 1, exclude), dm.extra_batch("llama", 4, 1, exclude),
              dm.extra_batch("llama", 3, 2, exclude)]
    assert all([x.prompt_id for x in o] != [x.prompt_id for x in a] for o in others)
    plain = _data()
    plain.next_batch()
    assert [x.prompt_id for x in dm.next_batch()] == [x.prompt_id for x in plain.next_batch()]


def _scored(items, flat: set[str]) -> ScoredRollouts:
    """Scripted rollouts: rewards all 0 for prompts in ``flat``, else [0, 1]."""
    n = len(items) * G
    rewards = torch.tensor([[0.0, 0.0] if x.prompt_id in flat else [0.0, 1.0] for x in items]).reshape(-1, G)
    ids = torch.ones(n, 2, dtype=torch.long)
    rollouts = RolloutBatch(ids, torch.ones(n, 2, dtype=torch.bool), ids, torch.ones(n, 2, dtype=torch.bool),
                            torch.zeros(n, 2), ["stop"] * n, [x.prompt_id for x in items for _ in range(G)])
    return ScoredRollouts("p", list(items), rollouts, rewards.reshape(-1, 1), rewards, rewards > 0,
                          [x.question for x in items], rewards.reshape(-1))


class _System:
    def __init__(self, flat):
        self.flat, self.calls = flat, []

    def rollout(self, policy, items, prompt_seeds=None, seed=None):
        self.calls.append(([x.prompt_id for x in items], list(prompt_seeds)))
        return _scored(items, self.flat)


class _Group:
    """A policy's group of ``size`` ranks as threads: ``group_gather`` meets at a barrier."""

    def __init__(self, size):
        self.size, self.slots, self.barrier = size, [None] * size, threading.Barrier(size)

    def workers(self, index):
        group = self

        class W:
            def group_size(self, name):
                return group.size

            def group_index(self, name):
                return index

            def group_gather(self, name, obj):
                group.slots[index] = obj
                group.barrier.wait()
                out = list(group.slots)
                group.barrier.wait()
                return out
        return W()


def _run(size, flat, cap=3, batch_size=4):
    """sample_until_full on ``size`` ranks of one group; per rank (kept prompt ids in draw order, rollout calls)."""
    dm = _data(batch_size)
    items = dm.next_batch()
    policy = SimpleNamespace(policy_name="p", max_num_gen_batches=cap, tokenizer=SimpleNamespace(pad_token_id=0))
    group, results = _Group(size), [None] * size

    def rank(index):
        system = _System(flat)
        first = system.rollout(policy, items[index::size], prompt_seeds=[0] * len(items[index::size]))
        scored, keep, metrics, extra = sample_until_full(system, policy, dm, group.workers(index), items, first,
                                                         run_seed=0, rollout_step=5)
        results[index] = (scored, keep, metrics, extra, system.calls[1:])

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return items, results


def _flat_every_third():
    dm = _data()
    ids = [x.prompt_id for part in ("add", "sub") for x in dm.train_items(part)]
    return {pid for i, pid in enumerate(sorted(ids)) if i % 3 == 0}


def test_one_rank_draws_until_the_batch_is_full_and_keeps_the_first_groups_with_a_signal():
    flat = _flat_every_third()
    items, [(scored, keep, metrics, extra, calls)] = _run(1, flat)
    assert calls, "the shared batch had no group without a signal: nothing to draw"
    kept = [x.prompt_id for x, k in zip(scored.items, keep.tolist()) if k]
    with_signal = [x.prompt_id for x in scored.items if x.prompt_id not in flat]
    assert kept == with_signal[:4] and len(kept) == 4  # the first B in draw order, the shared batch first
    assert scored.items[:4] == items
    assert extra == len(scored.items) - 4 == 4 * len(calls)
    assert float(metrics["rollout/p/num_gen_batches"]) == 1 + len(calls)
    assert float(metrics["rollout/p/train_groups"]) == 4
    dropped = sum(x.prompt_id in flat for x in scored.items)
    assert float(metrics["rollout/p/filtered_group_share"]) == pytest.approx(dropped / len(scored.items))


def test_the_cap_stops_the_draws_and_the_step_trains_on_the_groups_it_has():
    dm = _data()
    every = {x.prompt_id for part in ("add", "sub") for x in dm.train_items(part)}
    items, [(scored, keep, metrics, extra, calls)] = _run(1, every, cap=3)
    assert len(calls) == 2 and extra == 8  # 3 generation batches in all, then it stops
    assert not keep.any() and float(metrics["rollout/p/train_groups"]) == 0
    batch = TrainBatch(scored, torch.zeros(scored.rewards.shape), keep=keep).for_update()
    assert batch.scored.rollouts.completion_ids.shape[0] == 0  # the GRPO term gets no row; the probes got all 12


@pytest.mark.parametrize("batch_size", [4, 3])
def test_two_ranks_draw_the_same_batches_and_keep_the_same_groups_as_one(batch_size):
    flat = _flat_every_third()
    _, [one] = _run(1, flat, batch_size=batch_size)
    _, two = _run(2, flat, batch_size=batch_size)
    assert one[4], "no extra batch drawn"
    order = [x.prompt_id for x in one[0].items]
    kept_one = {x.prompt_id for x, k in zip(one[0].items, one[1].tolist()) if k}
    kept_two = {x.prompt_id for r in two for x, k in zip(r[0].items, r[1].tolist()) if k}
    assert kept_two == kept_one
    # the ranks' shards interleave back into one rank's draw order (position q on rank q mod 2)
    merged = [None] * len(order)
    for index, r in enumerate(two):
        for j, x in enumerate(r[0].items):
            merged[index + 2 * j] = x.prompt_id
    assert merged == order
    seeds_one = dict(zip(*[sum((c[k] for c in one[4]), []) for k in (0, 1)]))
    seeds_two = dict(zip(*[sum((c[k] for r in two for c in r[4]), []) for k in (0, 1)]))
    assert seeds_two == seeds_one  # each extra prompt sampled from the same seed, whichever rank holds it
    assert all(r[3] == one[3] for r in two)  # every rank knows the group's extra prompts
