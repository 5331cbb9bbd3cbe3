"""The vLLM rollout engine against an in-process double of the vLLM calls it makes (docs/rollout.md).

The default test run has no vLLM (its environment is the project's; vLLM's CPU build lives in
``.venv-vllm`` and ``tests/real_vllm`` runs the engine against it). ``vllm_double``
reproduces, from vLLM 0.32 / 0.33's source and runs of the CPU build, exactly what the engine
calls: ``LLM.generate`` with ``SamplingParams(n, temperature, top_p, top_k, max_tokens,
logprobs, seed, stop_token_ids)``, the ``logprobs_mode`` switch, the prefix cache,
``collective_rpc("reload_weights", ...)``, and TRL's ``VLLMClient`` for server mode, which
only the double covers. It samples from its own copy of a tiny GPT-2, so a weight push that
is missing, late or partial shows up as a log-prob difference against the training model.
"""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import pytest
import torch
from vllm_double import FakeLLM, FakeSamplingParams, FakeVLLMClient

from mrl_lightning.builders import build_policy
from mrl_lightning.update.batch import TrainBatch
from mrl_lightning.errors import ConfigError
from mrl_lightning.policy import PolicyModule
from mrl_lightning.update.policy_update import policy_update
from mrl_lightning.rewards.base import RewardFunction
from mrl_lightning.rollout import HFGenerateEngine
from mrl_lightning.rollout.base import RolloutBatch
from mrl_lightning.rollout.vllm_engine import Sample, VLLMEngine
from mrl_lightning.builders.engines import build_vllm_engine
from mrl_lightning.loop.system import MutualRL
from mrl_lightning.thl import decode_completion

PROMPTS = ["Calculate 1 + 2.", "What is 7 - 5?\nAnswer:", "ab"]
G, L = 4, 6


@pytest.fixture(autouse=True)
def vllm_installed(monkeypatch):
    """The config check looks for the vllm package; the double stands in for it here."""
    monkeypatch.setattr("mrl_lightning.rollout.options.missing_packages", lambda mode: [])


def _policy(folder, **kwargs) -> PolicyModule:
    args = dict(name="p", model=str(folder), num_generations=G, max_completion_length=L, temperature=0.7,
                rollout_engine="vllm")
    args.update(kwargs)
    policy = PolicyModule(**args)
    build_policy(policy)
    return policy


def _fake_factory(built: list):
    def factory(policy, **kwargs):
        llm = FakeLLM(**kwargs)
        built.append(llm)
        return llm, FakeSamplingParams
    return factory


def _engine(policy, **kwargs) -> tuple[VLLMEngine, FakeLLM]:
    built: list[FakeLLM] = []
    engine = build_vllm_engine(policy, [policy], len(PROMPTS), factory=_fake_factory(built), device_memory_gib=80.0,
                               **kwargs)
    return engine, built[0]


def _generate(engine, policy, seed=1, **kwargs):
    torch.manual_seed(seed)
    args = dict(num_generations=G, max_completion_length=L, temperature=policy.temperature)
    args.update(kwargs)
    return engine.generate(policy.model, policy.tokenizer, policy.encode_prompts(PROMPTS),
                           weights_version=policy.optimizer_steps_taken, **args)


def _trainer_logprobs(policy, out) -> torch.Tensor:
    with torch.no_grad():
        logp, _ = policy.completion_logprobs(out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
    return logp


def _checksum(model) -> float:
    """Float64 sum of every parameter weighted by its position (a permutation changes it too)."""
    total = 0.0
    for p in model.parameters():
        flat = p.detach().double().flatten()
        total += float((flat * torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64)).sum())
    return total


# ---------------------------------------------------------------- contract and settings
def test_engine_is_built_for_the_tempered_distribution_with_the_policys_lengths(tiny_lm_dir):
    policy = _policy(tiny_lm_dir, max_prompt_length=32, vllm_gpu_memory_utilization=0.4, vllm_dtype="bfloat16")
    _, llm = _engine(policy)
    kw = llm.init_kwargs
    assert kw["logprobs_mode"] == "processed_logprobs"  # vLLM's default "raw_logprobs" ignores temperature
    assert kw["generation_config"] == "vllm"  # the model's generation_config.json sets no default sampling
    assert kw["max_model_len"] == 32 + L
    assert kw["gpu_memory_utilization"] == 0.4 and kw["dtype"] == "bfloat16"
    assert kw["model"] == str(tiny_lm_dir) and kw["distributed_executor_backend"] == "external_launcher"


def test_engine_returns_the_rollout_contract(tiny_lm_dir):
    policy = _policy(tiny_lm_dir)
    engine, llm = _engine(policy)
    out = _generate(engine, policy)
    n = len(PROMPTS) * G
    assert isinstance(out, RolloutBatch) and out.sampling_logprobs is not None
    assert out.prompt_ids.shape[0] == out.completion_ids.shape[0] == n
    assert out.completion_ids.shape == out.completion_mask.shape == out.old_logprobs.shape
    # Only the policy's settings reach vLLM, one request per prompt with its own seed.
    (params,) = llm.calls
    assert [(p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.logprobs) for p in params] == \
        [(G, 0.7, 1.0, 0, L, 0)] * len(PROMPTS)
    assert [p.seed - params[0].seed for p in params] == [0, G, 2 * G]
    eos, pad = policy.tokenizer.eos_token_id, policy.tokenizer.pad_token_id
    assert set(out.finish_reasons) == {"stop", "length"}  # the fixture's EOS is likely: both occur
    for row in range(n):
        m = out.completion_mask[row]
        ids = out.completion_ids[row]
        k = int(m.sum())
        assert m[:k].all() and not m[k:].any()  # a prefix
        assert (ids[k:] == pad).all() and (out.old_logprobs[row, k:] == 0).all()
        if out.finish_reasons[row] == "stop":
            assert ids[k - 1] == eos and (ids[: k - 1] != eos).all()  # through the first EOS
        else:
            assert k == L and (ids[:k] != eos).all()
        assert out.completion_texts[row] == decode_completion(policy.tokenizer, ids[m].tolist(), errors="replace")
    assert torch.equal(out.old_logprobs, out.sampling_logprobs)
    assert (out.prompt_mask.sum(1).tolist()) == [len(x) for x in policy.encode_prompts(PROMPTS) for _ in range(G)]


def test_sampling_log_probs_match_the_trainers_before_any_update(tiny_lm_dir):
    policy = _policy(tiny_lm_dir, temperature=1.3)
    engine, _ = _engine(policy)
    out = _generate(engine, policy, temperature=1.3)
    delta = (_trainer_logprobs(policy, out) - out.sampling_logprobs)[out.completion_mask]
    assert delta.abs().max() < 1e-4


def test_same_seed_same_rollouts(tiny_lm_dir):
    policy = _policy(tiny_lm_dir)
    engine, _ = _engine(policy)
    a, b = _generate(engine, policy, seed=7), _generate(engine, policy, seed=7)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, _generate(engine, policy, seed=8).completion_ids)


def test_greedy_asks_vllm_for_one_completion_and_repeats_it(tiny_lm_dir):
    policy = _policy(tiny_lm_dir)
    engine, llm = _engine(policy)
    out = _generate(engine, policy, num_generations=2, do_sample=False)
    assert [(p.n, p.temperature) for p in llm.calls[-1]] == [(1, 0.0)] * len(PROMPTS)  # vLLM refuses greedy n > 1
    assert torch.equal(out.completion_ids[0::2], out.completion_ids[1::2])


def test_an_aborted_request_is_an_error_naming_the_policy(tiny_lm_dir):
    policy = _policy(tiny_lm_dir)

    class Aborting:
        def sample(self, prompt_ids, n, seeds, *args):
            return [[Sample([5], [-1.0], "abort")] * n for _ in prompt_ids]

        def push_weights(self, model):
            pass

    with pytest.raises(RuntimeError, match="policy 'p': vLLM ended a completion with finish_reason='abort'"):
        _generate(VLLMEngine(Aborting()), policy, policy_name="p")


# ------------------------------------------------------------------- tempered log-probs
CORPUS = ["Calculate 12 + 34.\nAnswer: 46", "What is 7 - 5?\nAnswer: 2"]
LOGIT_A, LOGIT_EOS = 3.0, -20.0


def _constant_logits_lm(folder):
    """A GPT-2 whose logits are the same at every position: ``LOGIT_A`` for "4", ``LOGIT_EOS``
    for EOS, 0 for every other token (all weights 0 but ``ln_f.bias = e_0`` and column 0 of
    the tied embedding, so the last hidden state is ``e_0`` and logits are that column)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from mrl_lightning.recipes.tokenizers import train_char_level

    tok = train_char_level(CORPUS, folder)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=8, n_layer=1, n_head=2, n_positions=64,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.transformer.wte.weight[tok.convert_tokens_to_ids("4"), 0] = LOGIT_A
        model.transformer.wte.weight[tok.eos_token_id, 0] = LOGIT_EOS
    model.save_pretrained(str(folder))
    return tok


def test_log_probs_are_of_the_tempered_distribution_at_temperature_one_half(tmp_path):
    tok = _constant_logits_lm(tmp_path)
    v, a = len(tok), tok.convert_tokens_to_ids("4")
    # By hand, T = 0.5: logits / T are 6 for "4", -40 for EOS, 0 for the v - 2 others.
    log_z = math.log((v - 2) + math.exp(LOGIT_A / 0.5) + math.exp(LOGIT_EOS / 0.5))
    expected = {"A": LOGIT_A / 0.5 - log_z, "other": 0.0 - log_z}
    raw_a = LOGIT_A - math.log((v - 2) + math.exp(LOGIT_A) + math.exp(LOGIT_EOS))  # what raw_logprobs would say
    assert abs(expected["A"] - raw_a) > 0.5
    policy = _policy(tmp_path, temperature=0.5, pad_token="</s>")
    engine, _ = _engine(policy)
    hf = HFGenerateEngine()
    for out in (_generate(engine, policy, temperature=0.5),
                hf.generate(policy.model, policy.tokenizer, policy.encode_prompts(PROMPTS), num_generations=G,
                            max_completion_length=L, temperature=0.5)):
        m = out.completion_mask
        ids, lps = out.completion_ids[m], out.old_logprobs[m]
        assert (ids == a).any() and (ids != a).any()  # both cases sampled (P("4") is about 0.59)
        want = torch.where(ids == a, torch.tensor(expected["A"]), torch.tensor(expected["other"]))
        assert torch.allclose(lps, want, atol=1e-5), (lps, want)


# ------------------------------------------------------------------------------ weights
def _large_step(policy, out, lr_scale: float = 1.0):
    """One AdamW step at the policy's (large) learning rate on the rollouts' likelihood."""
    opt = policy.configure_optimizers()
    logp, _ = policy.completion_logprobs(out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
    (-(logp * out.completion_mask).sum()).backward()
    opt.step()
    opt.zero_grad()


def test_engine_weights_equal_the_policys_after_a_large_learning_rate_step(tiny_lm_dir):
    policy = _policy(tiny_lm_dir, learning_rate=0.5)
    engine, llm = _engine(policy)
    out = _generate(engine, policy)
    assert engine.pushes == 1
    assert _checksum(llm.hf) == _checksum(policy.model)
    before = _checksum(policy.model)
    _large_step(policy, out)
    assert abs(_checksum(policy.model) - before) > 1.0  # the step moved the weights a lot
    assert _checksum(llm.hf) != _checksum(policy.model)  # not pushed yet: nothing sampled since
    out = _generate(engine, policy)
    assert engine.pushes == 2
    assert _checksum(llm.hf) == _checksum(policy.model)
    engine_params = dict(llm.hf.named_parameters())
    for name, p in policy.model.named_parameters():
        assert torch.equal(engine_params[name], p), name
    # The prompt KV computed with the old weights was dropped: sampling matches the new model.
    delta = (_trainer_logprobs(policy, out) - out.sampling_logprobs)[out.completion_mask]
    assert delta.abs().max() < 1e-4
    _generate(engine, policy)
    assert engine.pushes == 2  # unchanged weights are not pushed again


def test_without_a_prefix_cache_reset_the_double_would_sample_stale_prompts(tiny_lm_dir):
    # The power of the previous test: push the weights but skip the reset, and the prompt
    # KV from before the step makes the sampler disagree with the trainer.
    policy = _policy(tiny_lm_dir, learning_rate=0.5)
    engine, llm = _engine(policy)
    out = _generate(engine, policy)
    _large_step(policy, out)
    llm.reset_prefix_cache = lambda *a, **k: True
    out = _generate(engine, policy)
    delta = (_trainer_logprobs(policy, out) - out.sampling_logprobs)[out.completion_mask]
    assert delta.abs().max() > 1e-2


def test_loading_a_checkpoint_into_the_model_is_pushed_too(tiny_lm_dir):
    policy = _policy(tiny_lm_dir)
    engine, llm = _engine(policy)
    _generate(engine, policy)
    state = {k: v + 0.25 for k, v in policy.model.state_dict().items()}
    policy.model.load_state_dict(state)
    _generate(engine, policy)
    assert engine.pushes == 2 and _checksum(llm.hf) == _checksum(policy.model)


# ------------------------------------------------------------------------------ server
def test_server_mode_samples_and_pushes_through_the_client(tiny_lm_dir):
    policy = _policy(tiny_lm_dir, vllm_mode="server", learning_rate=0.5)
    client = FakeVLLMClient(FakeLLM(str(tiny_lm_dir)))
    engine = build_vllm_engine(policy, [policy], len(PROMPTS), factory=lambda p: client)
    out = _generate(engine, policy)
    assert set(out.finish_reasons) == {"stop", "length"}
    delta = (_trainer_logprobs(policy, out) - out.sampling_logprobs)[out.completion_mask]
    assert delta.abs().max() < 1e-4
    _large_step(policy, out)
    _generate(engine, policy)
    assert _checksum(client.llm.hf) == _checksum(policy.model)


def test_server_with_raw_log_probs_is_refused_with_the_fix(tiny_lm_dir):
    policy = _policy(tiny_lm_dir, vllm_mode="server")
    client = FakeVLLMClient(FakeLLM(str(tiny_lm_dir)), logprobs_mode="raw_logprobs")
    with pytest.raises(ConfigError, match="--logprobs-mode processed_logprobs"):
        build_vllm_engine(policy, [policy], len(PROMPTS), factory=lambda p: client)


# ------------------------------------------------------------------ through the update
class HasTwo(RewardFunction):
    name, strict = "has_2", True

    def __call__(self, completions, items):
        return [1.0 if "2" in c else 0.0 for c in completions]


FLOAT32_UNIT_ROUNDOFF = 2.0 ** -24


def _logprob_rounding_bound(policy, rollouts) -> float:
    """How far two float32 evaluations of these rollouts' log-probs may differ by rounding alone (nats).

    A log-prob ``z_t - logsumexp(z)`` is read off the logits ``z_v = sum_k h_k W_vk``, a dot product of
    the width ``d`` whose float32 forward error is at most ``gamma_d * S`` (Higham, "Accuracy and
    Stability of Numerical Algorithms", 2nd ed., eq. 3.5: ``gamma_d = d u / (1 - d u)``, ``u = 2^-24``)
    with ``S = sum_k |h_k W_vk|``, its magnitude, taken at its largest over the batch and the vocabulary.
    The hidden state's own rounding (layer-normed, of order 1) reaches the logits through the same
    ``|W|``: one more ``gamma_d * S``. The log-prob reads two logit-sized values (``z_t`` and the
    log-sum-exp, a convex mix of the ``z_v`` plus a rounding of its own far smaller), and the sampler and
    the trainer each round on their own: ``2 * 2 * 2 * gamma_d * S``. Measured: at most 1/17 of it over
    80 runs (40 seeds, steps 0 and 1; also under ``ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE``).
    """
    head = policy.model.get_output_embeddings()
    seen = []
    hook = head.register_forward_hook(lambda module, args, out: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            policy.completion_logprobs(rollouts.prompt_ids, rollouts.prompt_mask, rollouts.completion_ids,
                                       rollouts.completion_mask)
    finally:
        hook.remove()
    magnitude = max(float((h.abs() @ head.weight.detach().abs().T).max()) for h in seen)
    d = head.weight.shape[1]
    gamma = d * FLOAT32_UNIT_ROUNDOFF / (1 - d * FLOAT32_UNIT_ROUNDOFF)
    return 8 * gamma * magnitude


def test_update_rescores_rollouts_and_logs_the_importance_ratio(tiny_lm_dir):
    from lightning.fabric import Fabric

    from mrl_lightning.data.items import PromptItem

    policy = _policy(tiny_lm_dir, learning_rate=0.5)
    system = MutualRL([policy], reward_funcs=[HasTwo()])
    built: list[FakeLLM] = []
    system.engines["p"] = build_vllm_engine(policy, [policy], 3, factory=_fake_factory(built), device_memory_gib=80.0)
    assert system.engine_for(policy, 3) is system.engines["p"]
    items = [PromptItem(f"q{i}", q, "2", "add", {}) for i, q in enumerate(PROMPTS)]
    fabric = Fabric(accelerator="cpu", devices=1)
    wrapped, opt = fabric.setup(policy.model, policy.configure_optimizers())
    for step in range(2):
        scored = system.rollout(policy, items, seed=step)
        r = scored.rollouts
        sampled = r.old_logprobs
        tol = _logprob_rounding_bound(policy, r)
        assert tol < 1e-2  # a missing or late push moves these log-probs by tens of nats (lr 0.5)
        batch = TrainBatch(scored, torch.randn(len(items), G))
        metrics = policy_update(policy, batch, wrapped, fabric, opt)
        # The trainer's own log-probs became the old ones; the sampler matched them (same weights, up to the
        # rounding of two float32 evaluations: its incremental decoding against the trainer's padded batch).
        assert r.old_logprobs is not sampled and (r.old_logprobs[~r.completion_mask] == 0).all()
        assert metrics["rollout/p/abs_delta_logp_max"] <= tol
        assert abs(metrics["rollout/p/is_ratio_mean"] - 1.0) <= math.expm1(tol)
        assert metrics["rollout/p/is_ratio_max"] - 1.0 <= math.expm1(tol)
        assert 1.0 - metrics["rollout/p/is_ratio_min"] <= -math.expm1(-tol)
        # The first inner iteration recomputes the old log-probs' own forward (same rows, weights, slices): exact.
        assert metrics["train/p/ratio_max"] == 1.0
    assert system.engines["p"].pushes == 2  # the step-1 rollout saw the step-0 update
    assert _checksum(built[0].hf) != _checksum(policy.model)  # step 1's update: pushed at the next rollout


def test_rollouts_of_the_hf_engine_are_not_rescored(tiny_lm_dir):
    policy = _policy(tiny_lm_dir, rollout_engine="hf")
    system = MutualRL([policy], reward_funcs=[HasTwo()])
    assert system.engine_for(policy, 3) is system.engine
    out = HFGenerateEngine().generate(policy.model, policy.tokenizer, policy.encode_prompts(PROMPTS),
                                      num_generations=G, max_completion_length=L, temperature=0.7)
    assert getattr(out, "sampling_logprobs", None) is None
    batch = TrainBatch(SimpleNamespace(rollouts=out), torch.zeros(len(PROMPTS), G))
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    wrapped, opt = fabric.setup(policy.model, policy.configure_optimizers())
    metrics = policy_update(policy, batch, wrapped, fabric, opt)
    assert not any(k.startswith("rollout/") for k in metrics)


def test_vllm_runs_only_where_the_installed_build_runs(tiny_lm_dir, monkeypatch):
    policy = _policy(tiny_lm_dir)  # on the CPU
    monkeypatch.setattr("mrl_lightning.builders.engines.vllm_device_type", lambda: "cuda")
    with pytest.raises(ConfigError, match="installed vLLM build is for, 'cuda', but the policy is on cpu"):
        build_vllm_engine(policy, [policy], 3)
    monkeypatch.setattr("mrl_lightning.builders.engines.vllm_device_type", lambda: "")
    with pytest.raises(ConfigError, match="'none it can find', but the policy is on cpu.*trainer.accelerator: cpu"):
        build_vllm_engine(policy, [policy], 3)


def test_a_server_on_vllms_cpu_build_is_refused_naming_nccl(tiny_lm_dir, monkeypatch):
    policy = _policy(tiny_lm_dir, vllm_mode="server")
    monkeypatch.setattr("mrl_lightning.builders.engines.vllm_device_type", lambda: "cpu")
    with pytest.raises(ConfigError, match="vllm_mode: server sends weights over NCCL"):
        build_vllm_engine(policy, [policy], 3)


def test_without_vllm_the_build_names_the_install(tiny_lm_dir, monkeypatch):
    policy = _policy(tiny_lm_dir)
    monkeypatch.setitem(sys.modules, "vllm.platforms", None)  # import fails, with or without vllm installed
    with pytest.raises(ConfigError, match=r"needs the vllm package.*pip install -e '\.\[vllm\]'"):
        build_vllm_engine(policy, [policy], 3)


def test_a_fused_optimizer_step_through_the_update_is_pushed(tiny_lm_dir):
    # A fused AdamW step advances no version counter (torch 2.13); the update counts its steps.
    from lightning.fabric import Fabric

    policy = _policy(tiny_lm_dir, learning_rate=0.5)
    engine, llm = _engine(policy)
    out = _generate(engine, policy)
    fabric = Fabric(accelerator="cpu", devices=1)
    opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=0.5, fused=True)
    wrapped, opt = fabric.setup(policy.model, opt)
    versions = [p._version for p in policy.model.parameters()]
    policy_update(policy, TrainBatch(SimpleNamespace(rollouts=out), torch.randn(len(PROMPTS), G)), wrapped, fabric, opt)
    assert [p._version for p in policy.model.parameters()] == versions  # what made the count necessary
    assert _checksum(llm.hf) != _checksum(policy.model)
    _generate(engine, policy)
    assert engine.pushes == 2 and _checksum(llm.hf) == _checksum(policy.model)


def test_a_lora_policys_engine_serves_the_merged_weights_after_a_step(tiny_lm_dir):
    """vLLM holds the base model's names: a LoRA policy pushes W + alpha / r * B A (every name known to it)."""
    pytest.importorskip("peft")
    from lightning.fabric import Fabric

    policy = _policy(tiny_lm_dir, learning_rate=0.5, use_peft=True, lora_r=4, lora_target_modules=["c_attn"])
    engine, llm = _engine(policy)
    out = _generate(engine, policy)
    fabric = Fabric(accelerator="cpu", devices=1)
    wrapped, opt = fabric.setup(policy.model, policy.configure_optimizers())
    policy_update(policy, TrainBatch(SimpleNamespace(rollouts=out), torch.randn(len(PROMPTS), G)), wrapped, fabric, opt)
    _generate(engine, policy)
    assert engine.pushes == 2
    import copy

    expected = copy.deepcopy(policy.model).merge_and_unload()
    assert _checksum(llm.hf) == pytest.approx(_checksum(expected), rel=1e-12)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_lm_dir))
    assert _checksum(llm.hf) != pytest.approx(_checksum(base), rel=1e-9)  # the step reached the engine
