"""The GRPO family's loss and gradients equal TRL 1.16's ``GRPOTrainer._compute_loss`` (docs/grpo.md, "Equal to TRL").

TRL's own ``_compute_loss`` runs on a bare ``GRPOTrainer`` instance holding just the
attributes it reads (its ``args`` are ``GRPOConfig``'s own defaults with the case's values),
and TRL's own fused LM head scores a tiny GPT-2. Our side scores the same model through
:meth:`PolicyModule.completion_logprobs` (the shared-prompt forward, temperature 0.7) and
calls :func:`grpo_loss` per micro-batch with the whole batch's normalizers and the
update's top-entropy mask (:func:`~mrl_lightning.update.grpo_terms.top_entropy_mask`), as the
update does. Every loss type x importance level x beta x ``use_bias_correction_kl`` x micro-batch
split is compared, loss and every parameter's gradient, plus TRL's other knobs (``delta``,
``top_entropy_quantile``, ``off_policy_mask_threshold``, the vLLM correction).

TRL is driven with gradient accumulation over the same split (``steps_per_generation`` =
accumulation steps, ``num_items_in_batch`` = the batch's tokens). Where TRL's own number
depends on the split (``bnpo`` normalizes by each micro-batch's tokens; the entropy quantile
is taken per micro-batch) ours equals TRL on the whole batch at every split instead.
Tolerances hold on any CPU code path: checked with ``ATEN_CPU_CAPABILITY=default
MKL_CBWR=COMPATIBLE`` too.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from mrl_lightning.builders import build_policy  # noqa: E402
from mrl_lightning.objectives.grpo import grpo_loss  # noqa: E402
from mrl_lightning.objectives.loss_types import LOSS_TYPES, OPTION_DEFAULTS  # noqa: E402
from mrl_lightning.update.grpo_terms import top_entropy_mask  # noqa: E402
from mrl_lightning.policy import PolicyModule  # noqa: E402
from mrl_lightning.rollout.sampler_correction import importance_weights  # noqa: E402

B, G, P, L, TEMPERATURE = 4, 2, 5, 6, 0.7
N = B * G
LENGTHS = [6, 3, 5, 1, 6, 2, 4, 6]  # counted tokens per row: micro-batches hold different token counts
TRL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.default is not dataclasses.MISSING}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny GPT-2 policy, a batch of B prompts x G completions, and old / ref / sampler log-probs."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from mrl_lightning.recipes.tokenizers import train_char_level

    folder = tmp_path_factory.mktemp("trl_tiny_gpt2")
    tok = train_char_level(["Calculate 12 + 34.\nAnswer: 46", "What is 7 - 5?\nAnswer: 2"], folder)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, n_positions=32,
                               initializer_range=0.5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
                    ).save_pretrained(str(folder))
    policy = PolicyModule(name="p", model=str(folder), temperature=TEMPERATURE, num_generations=G,
                          max_completion_length=L)
    build_policy(policy)
    add_fused_lm_head(policy.model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))  # TRL's scoring
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, len(tok), (B, P), generator=gen).repeat_interleave(G, dim=0)  # no padding
    completions = torch.randint(3, len(tok), (N, L), generator=gen)
    mask = torch.arange(L).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)
    completions[~mask] = tok.pad_token_id
    with torch.no_grad():
        logp, _ = policy.completion_logprobs(prompts, torch.ones_like(prompts, dtype=torch.bool), completions, mask)
    noise = lambda scale: scale * torch.randn(N, L, generator=gen)  # noqa: E731
    return SimpleNamespace(
        policy=policy, prompts=prompts, completions=completions, mask=mask,
        advantages=torch.tensor([1.0, -0.7, 0.4, -1.3, 0.0, 0.9, -0.2, 1.5]),
        old=(logp + noise(0.3)) * mask, ref=(logp + noise(0.5)) * mask, sampler=(logp + noise(0.4)) * mask)


class _Accelerator:
    """What ``_compute_loss`` asks of accelerate on one process."""

    num_processes, is_main_process = 1, True

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def autocast(self):
        return contextlib.nullcontext()


def trl_loss(s, loss_type, level, beta, bias, split, **knobs):
    """TRL's ``_compute_loss`` over ``split`` micro-batches (gradient accumulation); returns (loss, grads)."""
    args = SimpleNamespace(**{**TRL_DEFAULTS, "loss_type": loss_type, "importance_sampling_level": level,
                              "beta": beta, "use_bias_correction_kl": bias, "steps_per_generation": split,
                              **{k: v for k, v in knobs.items() if k in TRL_DEFAULTS}})
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.__dict__.update(
        args=args, model=s.policy.model, accelerator=_Accelerator(), aux_loss_enabled=False, beta=beta,
        loss_type=loss_type, importance_sampling_level=level, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=args.off_policy_mask_threshold, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
        use_vllm="sampler_weights" in knobs, vllm_importance_sampling_correction=True, max_completion_length=L,
        current_gradient_accumulation_steps=split, _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)})
    s.policy.model.zero_grad(set_to_none=True)
    total = 0.0
    for sl in _slices(split):
        inputs = {"prompt_ids": s.prompts[sl], "prompt_mask": torch.ones_like(s.prompts[sl]),
                  "completion_ids": s.completions[sl], "completion_mask": s.mask[sl].long(),
                  "advantages": s.advantages[sl], "old_per_token_logps": s.old[sl],
                  "ref_per_token_logps": s.ref[sl], "sampling_per_token_logps": s.sampler[sl],
                  "num_items_in_batch": s.mask.sum().float()}
        if "sampler_weights" in knobs:
            inputs["importance_sampling_ratio"] = knobs["sampler_weights"][sl]
        loss = trainer._compute_loss(s.policy.model, inputs)
        loss.backward()
        total += float(loss.detach())
    return total, [p.grad.clone() for p in s.policy.model.parameters()]


def our_loss(s, loss_type, level, beta, bias, split, sampler_weights=None, top_entropy_quantile=1.0, **options):
    """:func:`grpo_loss` per micro-batch with the whole batch's normalizers; returns (loss, grads)."""
    ones = torch.ones_like(s.prompts, dtype=torch.bool)
    s.policy.top_entropy_quantile = top_entropy_quantile  # the update's no-grad pass, one quantile over the batch
    rollouts = SimpleNamespace(prompt_ids=s.prompts, prompt_mask=ones, completion_ids=s.completions,
                               completion_mask=s.mask)
    entropy_mask = top_entropy_mask(s.policy, rollouts, s.mask, s.policy.model, gather=None)
    s.policy.top_entropy_quantile = 1.0
    s.policy.model.zero_grad(set_to_none=True)
    total = 0.0
    for sl in _slices(split):
        logp, _ = s.policy.completion_logprobs(s.prompts[sl], ones[sl], s.completions[sl], s.mask[sl])
        out = grpo_loss(logp, s.old[sl], s.advantages[sl], s.mask[sl], loss_type=loss_type,
                        importance_sampling_level=level, beta=beta, use_bias_correction_kl=bias, ref_logp=s.ref[sl],
                        max_completion_length=L, num_sequences=N, num_tokens=float(s.mask.sum()),
                        sampler_weights=None if sampler_weights is None else sampler_weights[sl],
                        entropy_mask=None if entropy_mask is None else entropy_mask[sl], sampling_logp=s.sampler[sl],
                        **options)
        out.loss.backward()
        total += float(out.loss.detach())
    return total, [p.grad.clone() for p in s.policy.model.parameters()]


def _slices(split: int) -> list[slice]:
    size = N // split
    return [slice(i, i + size) for i in range(0, N, size)]


def assert_same(ours, trl, what):
    """Loss within 1e-5 relative; each gradient within 1e-4 relative plus 1e-5 of its tensor's largest entry.

    The two forwards differ by float32 rounding (shared-prompt pass against TRL's plain one),
    which shows as ~1e-6 on a gradient entry of a tensor whose entries reach ~2 (LUSPO's
    per-sequence sums): an absolute bound relative to the tensor's scale, not to each entry.
    """
    assert ours[0] == pytest.approx(trl[0], rel=1e-5, abs=1e-7), what
    assert sum(float(g.abs().sum()) for g in trl[1]) > 1e-4, f"{what}: no gradient to compare"
    for mine, theirs in zip(ours[1], trl[1]):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5 * float(theirs.abs().max()) + 1e-9,
                                   msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("beta, bias", [(0.0, True), (0.04, True), (0.04, False)])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
def test_loss_and_gradients_equal_trl_compute_loss(setup, loss_type, level, beta, bias, split):
    options = {"epsilon_high": 5.0} if loss_type == "cispo" else {"epsilon_high": 0.28}
    ours = our_loss(setup, loss_type, level, beta, bias, split, **options)
    trl_split = 1 if loss_type == "bnpo" else split  # TRL's bnpo divides by each micro-batch's own tokens
    assert_same(ours, trl_loss(setup, loss_type, level, beta, bias, trl_split, **options),
                f"{loss_type}/{level}/beta={beta}/bias={bias}/split={split}")


KNOBS = {
    "delta": dict(delta=1.1, epsilon_high=0.28),
    "top_entropy_quantile": dict(top_entropy_quantile=0.4),
    "off_policy_mask_threshold": dict(off_policy_mask_threshold=0.05),
    "vllm_correction": dict(sampler_weights="token_truncate"),
    "vllm_correction_mask": dict(sampler_weights="token_mask"),
    "sapo_vespo_options": dict(sapo_temperature_pos=2.0, sapo_temperature_neg=0.5, vespo_k_pos=1.5,
                               vespo_lambda_pos=2.5, vespo_k_neg=2.0, vespo_lambda_neg=1.0),
}


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("knob", sorted(KNOBS))
@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
def test_trl_knobs_give_trl_numbers(setup, loss_type, knob, split):
    options = dict(KNOBS[knob])
    if knob == "delta" and loss_type in ("cispo", "sapo", "vespo"):
        pytest.skip("delta is read by the clipped loss types only")
    if "sampler_weights" in options:  # the weights the update hands over (TRL computes the same from vLLM's)
        mode = options["sampler_weights"]
        options["sampler_weights"] = importance_weights(setup.old, setup.sampler, setup.mask, mode, clip_max=1.2,
                                                        clip_min=0.8)
    options.setdefault("epsilon_high", 5.0 if loss_type == "cispo" else None)
    level = "sequence" if loss_type == "luspo" else "token"
    ours = our_loss(setup, loss_type, level, 0.04, True, split, **options)
    trl_split = 1 if loss_type == "bnpo" or knob == "top_entropy_quantile" else split
    assert_same(ours, trl_loss(setup, loss_type, level, 0.04, True, trl_split, **options),
                f"{loss_type}/{knob}/split={split}")


@pytest.mark.parametrize("split", [1, 2])
def test_a_vespo_lambda_of_zero_is_floored_at_1e4_as_trl_floors_it(setup, split):
    """docs/grpo.md (VESPO): lambda 0 is accepted and floored at 1e-4, so phi(W) = exp(1e-4 + k log W - 1e-4 W),
    TRL's numbers (TRL clamps lambda at 1e-4 and runs)."""
    options = dict(vespo_lambda_pos=0.0, vespo_lambda_neg=0.0)
    ours = our_loss(setup, "vespo", "token", 0.04, True, split, **options)
    floored = our_loss(setup, "vespo", "token", 0.04, True, split, vespo_lambda_pos=1e-4, vespo_lambda_neg=1e-4)
    assert ours[0] == floored[0] and all(torch.equal(a, b) for a, b in zip(ours[1], floored[1]))
    assert_same(ours, trl_loss(setup, "vespo", "token", 0.04, True, split, **options), f"vespo/lambda=0/split={split}")


def test_the_options_default_to_trl_grpo_config_defaults():
    for key, value in OPTION_DEFAULTS.items():
        assert TRL_DEFAULTS[key] == value, key
    import inspect

    ours = {n: p.default for n, p in inspect.signature(PolicyModule.__init__).parameters.items()}
    for key in (*OPTION_DEFAULTS, "loss_type", "importance_sampling_level", "beta", "top_entropy_quantile",
                "off_policy_mask_threshold", "use_bias_correction_kl", "num_iterations", "scale_rewards",
                "mask_truncated_completions", "vllm_importance_sampling_correction",
                "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min"):
        assert ours[key] == TRL_DEFAULTS[key], key
