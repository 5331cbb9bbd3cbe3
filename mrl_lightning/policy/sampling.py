"""A policy's completions of prompts through a rollout engine (docs/loop.md, step 2).

One way for every caller that samples a policy (training rollouts, evaluation, greedy or
sampled): the prompts rendered in the policy's template and encoded with its tokenizer,
the engine's ``generate`` with the policy's sampling settings on its full weights (a
sharded policy samples on its gathered weights, docs/mwra.md), a sampling error on NaN or
inf logits named after the policy, and, for training, every counted log-prob checked
finite (docs/reliability.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mrl_lightning.model.numerics import check_finite_logprobs, named_sampling_errors
from mrl_lightning.mwra.sharding import full_weights
from mrl_lightning.rollout.base import RolloutBatch, RolloutEngine

if TYPE_CHECKING:
    from mrl_lightning.policy.module import PolicyModule


def sample(policy: PolicyModule, engine: RolloutEngine, items: list, num_generations: int, *, greedy: bool = False,
           prompt_seeds: list[int] | None = None, check_finite: bool = False) -> tuple[list[str], RolloutBatch]:
    """``num_generations`` completions of each item from ``policy`` through ``engine``.

    Args:
        policy: The :class:`~mrl_lightning.policy.PolicyModule` (its model built).
        engine: Its rollout engine (the loop's Hugging Face engine or the policy's vLLM engine).
        items: The B prompts (:class:`~mrl_lightning.data.items.PromptItem`).
        num_generations: Completions per prompt (G).
        greedy: Greedy decoding (``do_sample=False``); otherwise the policy's ``temperature``,
            ``top_p``, ``top_k`` and, on the Hugging Face engine, its ``sampling_draw``.
        prompt_seeds: One seed per item for its completions' draws (sampling only); None =
            the process's stream.
        check_finite: Raise when a counted token's sampling log-prob is NaN or inf.

    Returns:
        ``(the B rendered prompts, the rollouts: [B * G] rows, prompt-major)``.

    Raises:
        NonFiniteError: sampling met NaN or inf logits, or ``check_finite`` found a
            non-finite log-prob (the message names the policy and what to do).
        ConfigError: ``chat_template`` and the tokenizer has no chat template.
    """
    prompts, ids = policy.prompt_ids(items)
    if greedy:
        settings = {"do_sample": False}
    else:
        settings = {"temperature": policy.temperature, "top_p": policy.top_p, "top_k": policy.top_k,
                    "prompt_seeds": prompt_seeds}
        if policy.rollout_engine == "hf":  # another engine samples with its own sampler
            settings["sampling_draw"] = policy.sampling_draw
    with full_weights(policy.model), named_sampling_errors(policy.policy_name):
        out = engine.generate(policy.model, policy.tokenizer, ids, num_generations=num_generations,
                              max_completion_length=policy.max_completion_length,
                              weights_version=policy.optimizer_steps_taken, stop_token_ids=policy.stop_token_ids,
                              **policy.stop_kwargs, **settings)
        if check_finite:
            check_finite_logprobs(policy.policy_name, out.old_logprobs, out.completion_mask)
    return prompts, out
