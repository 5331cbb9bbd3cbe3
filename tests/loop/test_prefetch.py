"""``trainer.async_rollouts`` (docs/mwra.md, "Rollouts during the update"): its refusals, its resume check, and the
sampler view (a copy of the weights taken before the update; the policy's own model untouched)."""

from __future__ import annotations

import types

import pytest
import torch

from mrl_lightning.errors import ConfigError
from mrl_lightning.loop.prefetch import Prefetch, async_errors, check_resume_async


def _policy(**over):
    values = dict(filter_groups=False, fsdp=False, rollout_engine="hf", vllm_importance_sampling_correction=True)
    values.update(over)
    return types.SimpleNamespace(**values)


def test_settings_async_rollouts_cannot_sample_beside_are_refused_one_line_each():
    assert async_errors(False, {"a": _policy(fsdp=True)}) == []
    assert async_errors(True, {"a": _policy(), "b": _policy()}) == []
    lines = async_errors(True, {"a": _policy(filter_groups=True), "b": _policy(fsdp=True),
                                "c": _policy(rollout_engine="vllm"), "d": _policy(vllm_importance_sampling_correction=False)})
    assert len(lines) == 4 and all(line.startswith("trainer.async_rollouts=true") for line in lines)
    assert "policy 'a' has filter_groups: true" in lines[0] and "policy 'b' has fsdp: true" in lines[1]
    assert "policy 'c' has rollout_engine: vllm" in lines[2] and "--trainer.async_rollouts false" in lines[2]
    assert "policy 'd' has vllm_importance_sampling_correction: false" in lines[3]


def test_a_resume_must_keep_async_rollouts():
    check_resume_async({"async_rollouts": True}, True, "x.ckpt")
    check_resume_async({}, False, "x.ckpt")
    with pytest.raises(ConfigError, match="async_rollouts=false, but x.ckpt was written with async_rollouts=true.*"
                                          "--trainer.async_rollouts true"):
        check_resume_async({"async_rollouts": True}, False, "x.ckpt")
    with pytest.raises(ConfigError, match="--trainer.async_rollouts false"):
        check_resume_async({}, True, "x.ckpt")


class _Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Linear(3, 2)
        self.model.register_buffer("scale", torch.ones(2))
        self.tokenizer = {"vocab": [1, 2]}
        self.temperature = 1.0


def test_a_sampler_view_holds_a_copy_of_the_weights_of_its_moment():
    policy = _Policy()
    policy.model.weight.grad = torch.ones_like(policy.model.weight)
    prefetch = Prefetch(enabled=True)
    view = prefetch.views({"p": policy})["p"]
    assert view.model is not policy.model and policy.model is policy._modules["model"]  # the policy keeps its own
    assert view.tokenizer is not policy.tokenizer and view.tokenizer == policy.tokenizer
    assert view.model.weight.equal(policy.model.weight) and view.model.weight.grad is None
    assert not view.model.weight.requires_grad and policy.model.weight.requires_grad
    with torch.no_grad():  # the update moves the policy's weights: the view keeps the ones it was taken with
        policy.model.weight.add_(1.0)
        policy.model.scale.mul_(3.0)
    assert not view.model.weight.equal(policy.model.weight)
    policy.temperature = 0.5
    again = prefetch.views({"p": policy})["p"]  # the next step's view: the same copy, refreshed, settings now
    assert again.model is view.model and again.model.weight.equal(policy.model.weight)
    assert again.model.scale.equal(policy.model.scale) and again.temperature == 0.5 and view.temperature == 1.0


def test_an_error_in_the_sampler_thread_is_raised_on_the_loop_s_thread(monkeypatch):
    prefetch = Prefetch(enabled=True)
    prefetch.batch = 2

    def fail(*_):
        raise RuntimeError("sampling failed")

    monkeypatch.setattr("mrl_lightning.loop.prefetch.sample_batch", fail)
    prefetch._run(())
    with pytest.raises(RuntimeError, match="sampling failed"):
        prefetch.take(2)
    assert prefetch.batch is None and prefetch.take(2) is None


def test_the_update_picks_no_attention_kernel_while_a_sampler_thread_runs():
    """The math-kernel choice of the auxiliary passes (``sdpa_kernel``) is process-wide: beside a sampler thread it
    would change what that thread's ``generate`` computes, at moments that depend on timing."""
    import contextlib

    from lightning.fabric.plugins.precision.amp import MixedPrecision

    from mrl_lightning.update.policy_update import term_attention

    fabric = types.SimpleNamespace(device=torch.device("cpu"), strategy=types.SimpleNamespace(
        precision=MixedPrecision("bf16-mixed", "cpu")))
    terms = [types.SimpleNamespace(pass_shape=lambda: (2, 40))]
    policy = _Policy()
    assert not isinstance(term_attention(fabric, terms, policy), contextlib.nullcontext)  # the math kernel
    Prefetch(enabled=True).views({"p": policy})
    assert policy.sampling_beside_update is True
    assert isinstance(term_attention(fabric, terms, policy), contextlib.nullcontext)


def test_prompts_the_sampler_view_cut_are_counted_on_the_policy():
    from mrl_lightning.policy.checks import note_prompt_lengths

    policy = _Policy()
    policy.max_prompt_length, policy.policy_name, policy.prompts_truncated = 4, "p", 1
    prefetch = Prefetch(enabled=True)
    prefetch._policies = {"p": policy}
    prefetch._views = views = prefetch.views({"p": policy})
    with pytest.warns(UserWarning, match="longer than max_prompt_length=4"):
        note_prompt_lengths(views["p"], [3, 9, 7])  # what prompt_ids does on the sampler's thread
    prefetch.batch, prefetch._result = 2, ([], {}, {}, {}, {})
    prefetch.take(2)
    assert policy.prompts_truncated == 3 and policy._warned_prompt_truncation is True
