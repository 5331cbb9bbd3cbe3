"""Checks on how a policy turns questions into prompt tokens (template, chat template, truncation).

Two things can make a policy unable to see its question, and neither raises on its own:

- a template that renders the same prompt for different questions: a chat template that
  drops the user turn, or a ``max_prompt_length`` so small that left truncation keeps only
  the template's end, the same for every question. :func:`prompt_collision_errors`
  renders two unlike questions with the policy's own template, chat template and
  truncation and reports a config error when the token ids come out equal; it runs as
  soon as the tokenizer is loaded, before any model is built (for a tokenizer made by a
  recipe, once the recipe has made it).
- a prompt longer than ``max_prompt_length``: its ids are cut from the left (the start of
  the question is lost, the template's end kept, as TRL truncates). :func:`note_prompt_lengths`
  counts such prompts (``rollout/<policy>/prompts_truncated_share`` per step, and
  ``prompts_truncated`` on the policy in all) and warns once per policy.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

PROBE_QUESTIONS = ("What is 12 + 7?", "Name the capital of France, in one word.")


def prompt_collision_errors(policy) -> list[str]:
    """Config errors when two unlike questions give the same prompt ids under ``policy``.

    Args:
        policy: A :class:`~mrl_lightning.policy.PolicyModule` whose ``tokenizer`` is set.

    Returns:
        Error messages naming the field, the value and the fix (empty when prompts differ).
    """
    p = f"policy {policy.policy_name!r}"
    texts = [policy.render_prompt(SimpleNamespace(question=q)) for q in PROBE_QUESTIONS]
    if texts[0] == texts[1]:
        where = ("its tokenizer's chat template (chat_template: true)" if getattr(policy, "chat_template", False)
                 else f"prompt_template={policy.prompt_template!r}")
        return [f"{p}: {where} renders the same prompt {texts[0][:120]!r} for the questions {PROBE_QUESTIONS[0]!r} "
                f"and {PROBE_QUESTIONS[1]!r}: the question never reaches the model. Use a template that places "
                "the question (a chat template must render the user message)."]
    ids = policy.encode_prompts(texts)
    if ids[0] == ids[1]:
        tail = policy.tokenizer.decode(ids[0])
        full = len(policy.tokenizer(texts[0], add_special_tokens=False)["input_ids"])
        return [f"{p}: max_prompt_length={policy.max_prompt_length} cuts every prompt to its last "
                f"{len(ids[0])} tokens, {tail!r}, which are the same for every question (a rendered question here "
                f"is {full} tokens). Raise max_prompt_length above the template's own length."]
    return []


def note_prompt_lengths(policy, lengths: list[int]) -> None:
    """Count the prompts longer than ``max_prompt_length`` (they are cut) and warn once per policy.

    Counts only prompts sent to a built model (rollouts and evaluation), not the config
    check's probe prompts.

    Args:
        policy: The policy encoding the prompts.
        lengths: Token counts of the prompts before truncation.
    """
    if policy.model is None or not lengths:
        return
    over = [n for n in lengths if n > policy.max_prompt_length]
    policy.prompts_truncated = getattr(policy, "prompts_truncated", 0) + len(over)
    policy.last_prompts_truncated_share = len(over) / len(lengths)
    if over and not getattr(policy, "_warned_prompt_truncation", False):
        policy._warned_prompt_truncation = True
        name = policy.policy_name
        warnings.warn(f"policy {name!r}: a prompt of {max(over)} tokens is longer than max_prompt_length="
                      f"{policy.max_prompt_length}; its ids are cut from the left (the start of the question is "
                      f"lost). Counted in rollout/{name}/prompts_truncated_share; warned once. Raise "
                      "max_prompt_length to keep whole prompts.", stacklevel=3)
