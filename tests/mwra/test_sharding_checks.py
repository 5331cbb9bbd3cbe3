"""FSDP options before any model is built (docs/mwra.md "FSDP inside a policy's group"): refusals and the plan's memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mrl_lightning.mwra import build_placement
from mrl_lightning.mwra.plan import ModelShape, memory_options, policy_memory_terms
from mrl_lightning.mwra.sharding import sharding_errors

SHAPE = ModelShape(family="llama", params=1_000_000, vocab=1000, hidden=64, layers=2, heads=4)


def _policy(**kw):
    base = dict(fsdp=True, use_peft=False, micro_batch_size=None, num_generations=4, max_prompt_length=16,
                max_completion_length=8, beta=0.0, gradient_checkpointing=False, rollout_engine="hf")
    return SimpleNamespace(**{**base, **kw})


def test_a_one_rank_group_and_an_uneven_micro_batched_batch_are_refused_with_the_fix():
    placement = build_placement("disjoint", {"a": 1, "b": 2}, ["a", "b"], 3)
    errors = sharding_errors(placement, {"a": _policy(), "b": _policy(micro_batch_size=2)}, batch_size=5)
    assert len(errors) == 2
    assert "policy 'a'" in errors[0] and "2 or more ranks" in errors[0] and "fsdp: false" in errors[0]
    assert "policy 'b'" in errors[1] and "data.batch_size (5)" in errors[1]
    assert sharding_errors(placement, {"a": _policy(fsdp=False), "b": _policy(micro_batch_size=2)}, 6) == []


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_a_sharded_policy_holds_one_kth_of_its_states_reference_included(beta):
    # unsharded, the same forward (prompts are not shared by a sharded policy's forward)
    whole = policy_memory_terms(SHAPE, _policy(fsdp=False, beta=beta, share_prompt_forward=False), prompts_per_rank=2)
    shard = policy_memory_terms(SHAPE, _policy(beta=beta), prompts_per_rank=2, shards=4)
    assert shard["states"] == pytest.approx(whole["states"] / 4)
    assert whole["states"] == (8 if beta else 4) * SHAPE.params + 12 * SHAPE.params
    assert shard["activations"] == whole["activations"]
    assert memory_options(_policy(), None, 4) == "FSDP/4"
