"""Importance weights for a sampler that is not the trainer (TRL ``vllm_importance_sampling_*``),
their place in the GRPO loss, the vLLM settings' checks and the colocated memory share.

Every expected value is worked out by hand in the test from log-ratios chosen to be logs
of simple numbers (ln 2, ln 0.5, ln 4, ln 1.5).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.errors import ConfigError
from mrl_lightning.objectives.grpo import grpo_loss
from mrl_lightning.policy import PolicyModule
from mrl_lightning.rollout.sampler_correction import importance_weights, sampler_mismatch_metrics
from mrl_lightning.builders.engines import colocated_memory_share
from mrl_lightning.model.source import ModelRecipe

LN = math.log
SAMPLER = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
# trainer - sampler: row 0 = [ln 2, ln 0.5, ln 4]; row 1 = [ln 1.5, 0, 5 (not counted)].
DIFF = torch.tensor([[LN(2), LN(0.5), LN(4)], [LN(1.5), 0.0, 5.0]])
TRAINER = SAMPLER + DIFF
MASK = torch.tensor([[True, True, True], [True, True, False]])


def _w(mode, clip_max=3.0, clip_min=None):
    return importance_weights(TRAINER, SAMPLER, MASK, mode, clip_max, clip_min)


def test_token_truncate_caps_each_ratio_and_leaves_uncounted_tokens_at_one():
    # [2, 0.5, 4 -> 3] and [1.5, 1, (not counted) 1]
    assert torch.allclose(_w("token_truncate"), torch.tensor([[2.0, 0.5, 3.0], [1.5, 1.0, 1.0]]))


def test_token_truncate_with_a_floor():
    # clip_min 0.6: 0.5 -> 0.6; 1 stays 1.
    assert torch.allclose(_w("token_truncate", 3.0, 0.6), torch.tensor([[2.0, 0.6, 3.0], [1.5, 1.0, 1.0]]))


def test_token_mask_zeroes_ratios_outside_the_bounds():
    assert torch.allclose(_w("token_mask"), torch.tensor([[2.0, 0.5, 0.0], [1.5, 1.0, 1.0]]))
    assert torch.allclose(_w("token_mask", 3.0, 0.6), torch.tensor([[2.0, 0.0, 0.0], [1.5, 1.0, 1.0]]))


def test_sequence_modes_use_one_ratio_per_row_from_the_counted_tokens():
    # Row 0: ln 2 + ln 0.5 + ln 4 = ln 4 -> 4; row 1: ln 1.5 + 0 (the uncounted 5 is left out) -> 1.5.
    assert torch.allclose(_w("sequence_truncate"), torch.tensor([[3.0], [1.5]]))
    assert torch.allclose(_w("sequence_mask"), torch.tensor([[0.0], [1.5]]))
    assert torch.allclose(_w("sequence_truncate", None, 2.0), torch.tensor([[4.0], [2.0]]))


def test_a_token_the_sampler_could_not_score_gets_weight_one():
    sampler = SAMPLER.clone()
    sampler[0, 0] = float("nan")
    w = importance_weights(TRAINER, sampler, MASK, "token_truncate", 3.0, None)
    assert w[0, 0] == 1.0 and torch.isfinite(w).all()


def test_metrics_by_hand():
    m = sampler_mismatch_metrics("p", TRAINER, SAMPLER, MASK, _w("token_truncate"))
    # |diff| over counted tokens: ln 2, ln 2, ln 4, ln 1.5, 0 -> mean (4 ln 2 + ln 1.5) / 5; max ln 4.
    assert m["rollout/p/abs_delta_logp"] == pytest.approx((4 * LN(2) + LN(1.5)) / 5, abs=1e-6)
    assert m["rollout/p/abs_delta_logp_max"] == pytest.approx(LN(4), abs=1e-6)
    # weights applied over counted tokens: 2, 0.5, 3, 1.5, 1 -> mean 8 / 5.
    assert m["rollout/p/is_ratio_mean"] == pytest.approx(1.6, abs=1e-6)
    assert m["rollout/p/is_ratio_min"] == pytest.approx(0.5) and m["rollout/p/is_ratio_max"] == pytest.approx(3.0)
    seq = sampler_mismatch_metrics("p", TRAINER, SAMPLER, MASK, _w("sequence_truncate"))
    assert seq["rollout/p/is_ratio_mean"] == pytest.approx((3.0 + 1.5) / 2)
    assert "rollout/p/is_ratio_mean" not in sampler_mismatch_metrics("p", TRAINER, SAMPLER, MASK, None)


def test_weights_multiply_the_surrogate_but_not_the_kl_term():
    logp = torch.zeros(1, 2, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([1.0])
    w = torch.tensor([[2.0, 0.5]])
    # ratio 1, A = 1: surrogate -1 per token, times w -> [-2, -0.5]; dapo: sum / 2 tokens = -1.25.
    out = grpo_loss(logp, logp.detach(), adv, mask, loss_type="dapo", sampler_weights=w)
    assert float(out.loss.detach()) == pytest.approx(-1.25, abs=1e-6)
    # beta 0.1 with ref - logp = ln 2: k3 = 2 - ln 2 - 1 per token, not weighted:
    # (-2 + 0.1 k3 - 0.5 + 0.1 k3) / 2 = -1.25 + 0.1 (1 - ln 2).
    out = grpo_loss(logp, logp.detach(), adv, mask, loss_type="dapo", beta=0.1, ref_logp=logp.detach() + LN(2),
                    sampler_weights=w)
    assert float(out.loss.detach()) == pytest.approx(-1.25 + 0.1 * (1 - LN(2)), abs=1e-6)
    out.loss.backward()
    # d/d logp_0 of -w_0 * A * exp(logp - old) / 2 = -1 (plus the KL's (logp - ref) * beta / 2 = -0.1 ln 2 / 2)
    assert float(logp.grad[0, 0]) == pytest.approx(-1.0 - 0.1 * LN(2) / 2, abs=1e-6)


@pytest.mark.parametrize(("mode", "clip_max", "clip_min", "message"), [
    ("tokens", 3.0, None, "vllm_importance_sampling_mode='tokens'; valid"),
    ("token_truncate", None, None, "both are null"),
    ("token_mask", 2.0, 2.0, "clip_min=2.0 must be below"),
    ("token_mask", -1.0, None, "clip_max=-1.0 must be > 0"),
])
def test_bad_weight_settings_raise_before_any_work(mode, clip_max, clip_min, message):
    with pytest.raises(ValueError, match=message):
        importance_weights(TRAINER, SAMPLER, MASK, mode, clip_max, clip_min)


# --------------------------------------------------------------------- policy options
@pytest.fixture
def vllm_installed(monkeypatch):
    monkeypatch.setattr("mrl_lightning.rollout.options.missing_packages", lambda mode: [])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rollout_engine": "vlm"}, "rollout_engine='vlm'; valid: \\['hf', 'vllm'\\]"),
    ({"vllm_mode": "remote"}, "vllm_mode='remote'; valid: \\['colocate', 'server'\\]"),
    ({"vllm_gpu_memory_utilization": 1.5}, "vllm_gpu_memory_utilization=1.5 must be in \\(0, 1\\)"),
    ({"vllm_server_port": 0}, "vllm_server_port=0"),
    ({"vllm_importance_sampling_mode": "seq"}, "vllm_importance_sampling_mode='seq'"),
])
def test_bad_vllm_options_are_config_errors(tiny_lm_dir, vllm_installed, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        PolicyModule(name="p", model=str(tiny_lm_dir), **{"rollout_engine": "vllm", **kwargs})


def test_vllm_without_the_package_names_the_install_command(tiny_lm_dir, monkeypatch):
    monkeypatch.setattr("mrl_lightning.rollout.options.missing_packages", lambda mode: ["vllm"])
    with pytest.raises(ConfigError, match=r"needs \['vllm'\], not installed here.*pip install -e '\.\[vllm\]'"):
        PolicyModule(name="p", model=str(tiny_lm_dir), rollout_engine="vllm")
    PolicyModule(name="p", model=str(tiny_lm_dir))  # the HF engine needs nothing more


# ----------------------------------------------------------------------- memory share
class _ConfigOnly(ModelRecipe):
    """A recipe whose model config is a placeholder (the memory terms are stubbed)."""

    def model_config(self):
        return object()


def _p(name, engine="vllm", mode="colocate", share=None):
    return SimpleNamespace(policy_name=name, rollout_engine=engine, vllm_mode=mode, vllm_gpu_memory_utilization=share,
                           model_source=_ConfigOnly())


@pytest.fixture
def ten_gib_each(monkeypatch):
    """Every policy's training estimate is 10 GiB: 4 resident + 6 of update activations, no KV cache."""
    monkeypatch.setattr("mrl_lightning.mwra.plan.model_shape", lambda config: None)
    monkeypatch.setattr("mrl_lightning.mwra.plan.policy_memory_terms",
                        lambda shape, policy, prompts: {"states": 4 * 2**30, "activations": 6 * 2**30, "kv_cache": 0.0})


def test_share_splits_what_training_leaves_between_colocated_engines(ten_gib_each):
    # (1 - (10 + 10 + 1 reserve) / 80) / 2 = 0.36875 each
    assert colocated_memory_share([_p("a"), _p("b")], 8, 80.0) == pytest.approx({"a": 0.36875, "b": 0.36875})
    # a hand-set share is taken off first: 1 - 21 / 80 - 0.3 = 0.4375
    assert colocated_memory_share([_p("a", share=0.3), _p("b")], 8, 80.0) == pytest.approx({"b": 0.4375})
    # an HF policy's training counts, it gets no share: (1 - 31 / 80) / 2 = 0.30625
    shares = colocated_memory_share([_p("a"), _p("b"), _p("c", engine="hf")], 8, 80.0)
    assert shares == pytest.approx({"a": 0.30625, "b": 0.30625})
    # a server engine takes nothing on this device: (1 - 21 / 80) = 0.7375
    assert colocated_memory_share([_p("a"), _p("b", mode="server")], 8, 80.0) == pytest.approx({"a": 0.7375})
    # capped at 0.9: 1 - 11 / 200 = 0.945
    assert colocated_memory_share([_p("a")], 8, 200.0) == pytest.approx({"a": 0.9})


def test_a_share_below_five_percent_is_a_config_error_with_the_numbers(ten_gib_each):
    # 1 - (20 + 1) / 22 < 0
    with pytest.raises(ConfigError, match=r"training is estimated at 20\.0 GiB.*trainer\.placement: disjoint"):
        colocated_memory_share([_p("a"), _p("b")], 8, 22.0)


def test_a_vllm_policys_training_estimate_leaves_out_the_hf_sampling_kv_cache(monkeypatch):
    monkeypatch.setattr("mrl_lightning.mwra.plan.model_shape", lambda config: None)
    gib = 2**30
    monkeypatch.setattr("mrl_lightning.mwra.plan.policy_memory_terms",
                        lambda shape, policy, prompts: {"states": 2 * gib, "activations": 1 * gib, "kv_cache": 8 * gib})
    # vLLM samples in its own memory: 2 + 1 = 3 GiB of training, 1 - (3 + 1 reserve) / 20 = 0.8.
    assert colocated_memory_share([_p("a")], 8, 20.0) == pytest.approx({"a": 0.8})
    # an HF policy beside it also samples with HF's KV cache: 2 + max(1, 8) = 10; 1 - (3 + 10 + 1) / 20 = 0.3.
    assert colocated_memory_share([_p("a"), _p("b", engine="hf")], 8, 20.0) == pytest.approx({"a": 0.3})


def test_the_share_uses_the_plans_own_estimate_of_states_and_update_activations(monkeypatch):
    """With the plan's real estimate (no stub): the vLLM share leaves room for the update's
    activations, not only for the resident states."""
    from mrl_lightning.mwra.plan import ModelShape, policy_memory_terms

    shape = ModelShape("qwen2", params=494_000_000, vocab=151_936, hidden=896, layers=24, heads=14)
    monkeypatch.setattr("mrl_lightning.mwra.plan.model_shape", lambda config: shape)
    policy = _p("a")
    policy.num_generations, policy.micro_batch_size, policy.beta = 8, 2, 0.0
    policy.max_prompt_length, policy.max_completion_length = 512, 512
    terms = policy_memory_terms(shape, policy, 64)
    assert terms["activations"] > 0.1 * terms["states"]  # not negligible: leaving it out over-sizes vLLM
    expected = 1 - ((terms["states"] + terms["activations"]) / 2**30 + 1.0) / 141.0
    assert colocated_memory_share([policy], 64, 141.0) == pytest.approx({"a": expected})


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_the_update_takes_old_log_probs_and_weights_from_its_own_first_forward(tiny_lm_dir, mode):
    """No pass of its own: micro-batch by micro-batch, the first iteration's forward gives the old
    log-probs (a no-grad pass at the same weights gives the same bits) and the weights of the whole batch."""
    from mrl_lightning.update.batch import TrainBatch
    from mrl_lightning.builders import build_policy
    from mrl_lightning.rollout import HFGenerateEngine
    from mrl_lightning.update.policy_update import policy_update

    policy = PolicyModule(name="p", model=str(tiny_lm_dir), temperature=0.7, num_generations=3,
                          max_completion_length=5, micro_batch_size=2, num_iterations=2,
                          vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=1.2)
    build_policy(policy)
    torch.manual_seed(3)
    out = HFGenerateEngine().generate(policy.model, policy.tokenizer, policy.encode_prompts(["ab", "7 - 5?"]),
                                      num_generations=3, max_completion_length=5, temperature=0.7)
    with torch.no_grad():  # what a scoring pass of its own computed, micro-batch by micro-batch
        expected = torch.cat([policy.completion_logprobs(out.prompt_ids[i:i + 2], out.prompt_mask[i:i + 2],
                                                         out.completion_ids[i:i + 2], out.completion_mask[i:i + 2])[0]
                              for i in range(0, 6, 2)])
    expected = torch.where(out.completion_mask, expected, torch.zeros_like(expected))
    shift = torch.linspace(-0.3, 0.3, out.old_logprobs.numel()).view(out.old_logprobs.shape)
    out.sampling_logprobs = out.old_logprobs + shift  # a sampler that disagrees, so the weights are not 1
    weights = importance_weights(expected, out.sampling_logprobs, out.completion_mask, mode, 1.2, None)
    calls = []
    original = policy.completion_logprobs
    policy.completion_logprobs = lambda *a, **k: calls.append(1) or original(*a, **k)
    fabric = SimpleNamespace(backward=lambda loss: loss.backward(),
                             clip_gradients=lambda m, o, max_norm: torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm))
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.1)
    metrics = policy_update(policy, TrainBatch(SimpleNamespace(rollouts=out), torch.randn(2, 3)), policy.model,
                            fabric, optimizer)
    assert len(calls) == 3 * 2  # 3 micro-batches x 2 iterations: no scoring pass of its own
    assert torch.equal(out.old_logprobs, expected)
    flat = weights.flatten() if mode.startswith("sequence") else weights[out.completion_mask]
    assert metrics["rollout/p/is_ratio_mean"] == pytest.approx(float(flat.mean()), abs=1e-7)
    assert metrics["rollout/p/is_ratio_min"] == pytest.approx(float(flat.min()), abs=1e-7) and float(flat.min()) < 1
    assert metrics["train/p/ratio_max"] > 1.0  # the second iteration moved off the first's old log-probs
