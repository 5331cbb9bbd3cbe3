"""The plan's memory terms of one policy, worked out by hand (docs/mwra.md, "The memory model"): Hugging
Face sampling keeps every step's logits (two float32 copies of [N, L, V] at its end), an evaluation call
the same for a part's held-out prompts, an update's micro-batch five copies of its completion logits
taken whole (four of one chunk when taken in chunks), foreach AdamW one temporary per trained parameter,
a gzipped checkpoint write two copies of its largest tensor, a tokenizer the plan has not seen yet (a
recipe's) 3.5 KiB per token on every CPU worker; a vLLM policy samples in its engine's memory, a loaded
tokenizer is in the measured footprint already, and no checkpoint is gathered on rank 0."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mrl_lightning.mwra.plan import (
    GIB,
    ModelShape,
    PolicyPlacement,
    policy_memory_parts,
    policy_memory_terms,
    worker_memory_gib,
)

SHAPE = ModelShape("llama", params=10_000, vocab=1000, hidden=8, layers=1, heads=1)


def _policy(**kw):
    base = dict(num_generations=2, micro_batch_size=None, max_prompt_length=3, max_completion_length=4, beta=0.0,
                tokenizer=None, rollout_engine="hf", gradient_checkpointing=False, fsdp=False)
    return SimpleNamespace(**{**base, **kw})


def _row(name, ranks, device="cpu", *, states, memory, tokenizer=0.0, checkpoint=0.0):
    return PolicyPlacement(name, "llama", 1, 1, ranks, device, "s", "32-true", 1, memory_gib=memory,
                           states_gib=states, tokenizer_gib=tokenizer, checkpoint_gib=checkpoint)


def test_terms_of_a_recipe_policy_sampling_with_hugging_face():
    # N = 2 x 1 prompt, micro = N = 2, P = 3, L = 4, s = 7, V = 1000, h = q = kv = 8, MLP i = 4h = 32
    terms = policy_memory_terms(SHAPE, _policy(), 1)
    # 16 bytes a parameter: weights 4, gradient 4 (kept between updates), two AdamW moments 8
    assert (terms["weights"], terms["gradients"], terms["moments"], terms["reference"]) == (40_000, 40_000, 80_000, 0)
    assert terms["states"] == 16 * 10_000
    # foreach AdamW's step: sqrt of the second moments, 4 bytes a trained parameter
    assert terms["optimizer_step"] == 4 * 10_000
    # the tokenizer, built after the plan: 3584 bytes a token
    assert terms["tokenizer"] == 3584 * 1000
    # a checkpoint's part: 4 bytes of weight + 8 of AdamW moments a parameter; written plainly, it streams
    assert terms["checkpoint"] == 12 * 10_000 and terms["checkpoint_write"] == 0
    # a layer keeps 4 * (9h + 5q + 4kv + 4i) = 4 * 272 = 1088 bytes a token over the prompt once (3 tokens) and
    # both completions (8), plus the prompt's keys and values gathered to both rows: 2 * 7 * 2 * 8 * 4 = 896;
    # logits 5 copies * 4 bytes * [2, 5, 1000]; the head's gradient 4 * 1000 * 8
    assert terms["activations"] == 11 * 1088 + 896 + 200_000 + 32_000 == 244_864
    # KV cache 2 (it grows by concatenation) * 2 rows * 7 * 1 layer * 2 (keys, values) * 8 * 4 = 1792; one step's
    # scores 6 copies * 4 * [2, 1000]; no kept logits (the engine reads each step's log-probs as it samples)
    assert terms["kv_cache"] == 1792 + 48_000 == 49_792
    assert terms["eval_sampling"] == 0  # no held-out prompts counted
    # a probe's term backpropagates apart from the GRPO gradient it keeps: a second gradient (4 bytes a trained
    # parameter), one demo row's layer (3 + 4 tokens, no prompt sharing with one row: 7 * 1088), the head's gradient
    # and that row's logits (5 copies of [1, 5, 1000])
    assert terms["aux_backward"] == 4 * 10_000 + 7 * 1088 + 32_000 + 5 * 4 * 5_000 == 179_616
    assert policy_memory_parts(SHAPE, _policy(), 1) == (160_000, 244_864)


def test_an_evaluation_call_samples_a_parts_prompts_times_its_generations_at_once():
    terms = policy_memory_terms(SHAPE, _policy(), 1, eval_prompts_per_rank=50, eval_generations=8)
    # 400 rows: KV 2 * 400 * 7 * 1 * 2 * 8 * 4 = 358,400; one step's scores 4 * 400 * 1000 * 6 = 9,600,000
    assert terms["eval_sampling"] == 358_400 + 9_600_000
    assert policy_memory_parts(SHAPE, _policy(), 1, eval_prompts_per_rank=50, eval_generations=8)[1] == 9_958_400
    greedy = policy_memory_terms(SHAPE, _policy(), 1, eval_prompts_per_rank=50, eval_generations=0)
    assert greedy["eval_sampling"] == (358_400 + 9_600_000) / 8  # one completion each


def test_grouped_query_attention_keeps_a_narrower_kv_cache():
    gqa = ModelShape(**{**vars(SHAPE), "kv_width": 2})  # e.g. 1 key/value head of size 2 beside a width of 8
    assert policy_memory_terms(gqa, _policy(), 1)["kv_cache"] == 1792 // 4 + 48_000


def test_logits_taken_in_chunks_count_four_copies_of_one_chunk():
    chunked = _policy(logprob_chunk_elements=3_000)  # above it, chunks of 3 positions x V = 1000
    # [2, 5, 1000] = 10,000 logits > 3,000: 4 copies * 4 bytes * 3,000 in place of 5 * 4 * 10,000
    assert policy_memory_terms(SHAPE, chunked, 1)["activations"] == 244_864 - 200_000 + 4 * 4 * 3_000
    whole = _policy(logprob_chunk_elements=10_000)  # at or below the threshold: taken whole, as before
    assert policy_memory_terms(SHAPE, whole, 1)["activations"] == 244_864
    # the call decides on rows x L x V (2 x 4 x 1000 = 8,000, not the 10,000 logits it holds), as the plan does
    at_call = _policy(logprob_chunk_elements=8_000)
    assert policy_memory_terms(SHAPE, at_call, 1)["activations"] == 244_864
    assert policy_memory_terms(SHAPE, _policy(logprob_chunk_elements=7_999), 1)["activations"] == \
        244_864 - 200_000 + 4 * 4 * 7_000


def test_a_forward_without_shared_prompts_runs_every_row_over_prompt_and_completion():
    plain = policy_memory_terms(SHAPE, _policy(share_prompt_forward=False), 1)
    assert plain["activations"] == 2 * 7 * 1088 + 200_000 + 32_000  # 14 tokens, no gathered cache
    eager = ModelShape(**{**vars(SHAPE), "eager_attention": True})  # scores and their softmax: 2 * [2, 1, 7, 7]
    assert policy_memory_terms(eager, _policy(), 1)["activations"] == 244_864 + 2 * 1 * 49 * 2 * 4


def test_a_second_gradient_or_the_optimizer_step_can_be_a_policys_largest_transient():
    big = ModelShape("llama", params=100_000_000, vocab=100, hidden=8, layers=1, heads=1)
    terms = policy_memory_terms(big, _policy(), 1)
    # a probe term's gradient beside the GRPO one (4 bytes a parameter, one demo row's layer, the head's
    # gradient) is above foreach AdamW's sqrt temporary (4 bytes a parameter)
    assert terms["optimizer_step"] == 4 * 100_000_000
    assert terms["aux_backward"] == 4 * 100_000_000 + 7 * 1088 + 4 * 100 * 8 + 5 * 4 * 500
    states, peak = policy_memory_parts(big, _policy(), 1)
    assert (states, peak) == (16 * 100_000_000, terms["aux_backward"])
    # the fused kernel has no temporary; the second gradient is the peak still
    fused = policy_memory_terms(big, _policy(fused_optimizer=True), 1)
    assert fused["optimizer_step"] == 0 and policy_memory_parts(big, _policy(fused_optimizer=True), 1)[1] == \
        fused["aux_backward"]


def test_a_gzipped_checkpoint_write_holds_two_copies_of_the_largest_tensor():
    shape = ModelShape(**{**vars(SHAPE), "state_shapes": {"embed": (1000, 8), "head.bias": (1000,)}})
    assert policy_memory_terms(shape, _policy(), 1, compress=True)["checkpoint_write"] == 2 * 4 * 8000
    assert policy_memory_terms(shape, _policy(), 1, compress=False)["checkpoint_write"] == 0
    sharded = policy_memory_terms(shape, _policy(fsdp=True), 1, shards=2)  # full tensors gathered in the group
    assert sharded["checkpoint_write"] == sharded["checkpoint"] == 12 * 10_000


def test_a_loaded_tokenizer_and_a_vllm_engine_leave_their_terms_out():
    terms = policy_memory_terms(SHAPE, _policy(tokenizer=object(), rollout_engine="vllm"), 1)
    assert terms["tokenizer"] == 0     # the footprint measured at plan time holds the tokenizer
    assert terms["kv_cache"] == 1792   # vLLM keeps no [N, V] scores or [N, L, V] logits in this process


def test_a_lora_checkpoint_part_is_the_adapter_and_its_moments():
    adapter = ModelShape(**{**vars(SHAPE), "trainable": 100})
    assert policy_memory_terms(adapter, _policy(), 1)["checkpoint"] == 4 * 100 + 8 * 100


def test_at_a_large_vocabulary_the_logits_are_most_of_the_update():
    # the benchmark's qwen: 38.5 M parameters, V = 131,072, width 256, 4 layers, 4 heads, 2 prompts x 4
    shape = ModelShape("qwen2", params=38_540_000, vocab=131_072, hidden=256, layers=4, heads=4)
    policy = _policy(num_generations=4, micro_batch_size=4, max_prompt_length=432, max_completion_length=128)
    terms = policy_memory_terms(shape, policy, 2)
    # N = 8, s = 560: KV 2 * 8 * 560 * 4 layers * 2 * 256 * 4 = 73,400,320; one step's scores 4 * 8 * V * 6
    assert terms["kv_cache"] == 73_400_320 + 25_165_824
    # micro 4 (one prompt): 432 + 4 * 128 = 944 tokens of 4 * (9 + 5 + 4 + 16) * 256 = 34,816 bytes, the prompt's
    # cache gathered to 4 rows 4 * 560 * 2 * 256 * 4; logits 5 * 4 * [4, 129, V]; the head's gradient 4 * V * 256
    layers = 4 * (944 * 34_816 + 4_587_520)
    assert terms["activations"] == layers + 5 * 4 * 4 * 129 * 131_072 + 4 * 131_072 * 256 == 1_636_696_064
    assert terms["activations"] > terms["kv_cache"]


def test_cpu_workers_add_every_tokenizer_and_their_own_largest_transient():
    rows = [_row("a", (0,), states=1.0, memory=1.5, tokenizer=0.25, checkpoint=0.2),
            _row("b", (1,), states=0.5, memory=2.5, tokenizer=0.125, checkpoint=0.3)]
    # rank 0: footprint 0.5 + both tokenizers 0.375 + (states 1.0 + its phase 0.5) and 10% allocator slack: no
    # other rank's checkpoint part arrives
    assert worker_memory_gib(rows, 0, 0.5) == pytest.approx(0.5 + 0.375 + 1.1 * (1.0 + 0.5))
    # rank 1: 0.5 + 0.375 + 1.1 * (0.5 + 2.0)
    assert worker_memory_gib(rows, 1, 0.5) == pytest.approx(0.5 + 0.375 + 1.1 * (0.5 + 2.0))
    on_gpu = [_row(r.policy, r.ranks, "cuda", states=r.states_gib, memory=r.memory_gib, tokenizer=r.tokenizer_gib,
                   checkpoint=r.checkpoint_gib) for r in rows]
    assert worker_memory_gib(on_gpu, 0, 0.0) == pytest.approx(1.1 * 1.5)  # host memory is not the GPU's


def test_plan_rows_carry_the_tokenizer_and_checkpoint_terms():
    from mrl_lightning.mwra.placement import build_placement
    from mrl_lightning.mwra.plan import build_plan

    placement = build_placement("disjoint", None, ["a", "b"], 2)
    policies = {"a": _policy(), "b": _policy(tokenizer=object())}
    rows = build_plan(placement, {"a": SHAPE, "b": SHAPE}, policies, 1, "cpu", "s", "32-true", 1)
    assert [r.tokenizer_gib * GIB for r in rows] == [3584 * 1000, 0.0]
    assert [r.checkpoint_gib * GIB for r in rows] == [12 * 10_000, 12 * 10_000]


def test_sampling_beside_the_update_keeps_a_second_copy_of_the_weights_and_adds_the_two_transients():
    from mrl_lightning.mwra.memory import largest_transient

    plain = policy_memory_terms(SHAPE, _policy(), 1)
    beside = policy_memory_terms(SHAPE, _policy(), 1, sampler_copy=True)
    # trainer.async_rollouts: the sampler view's float32 copy of the whole model stays resident
    assert beside["sampler_copy"] == 4 * 10_000 and beside["states"] == plain["states"] + 40_000
    # the next batch's sampling runs during the update: its transient and the update's largest coexist
    assert beside["update_beside_sampling"] == plain["kv_cache"] + plain["activations"] == 49_792 + 244_864
    assert largest_transient(beside) == ("update + sampling beside it", 294_656)
    assert "sampler_copy" not in plain and "update_beside_sampling" not in plain  # a plan without it is unchanged
