"""Checks of a policy's GRPO, sampling, loss-type and dynamic-sampling options: ranges and choices.

Pure functions of the policy's fields, nothing built (docs/grpo.md, "Options"); called by
:func:`mrl_lightning.policy.checks.option_errors` at construction, before any model loads.
Each returns error messages naming the field, the value and the fix (empty when valid).
"""

from __future__ import annotations

import math


def grpo_option_errors(p: str, policy) -> list[str]:
    """Problems of a policy's name, sampling and GRPO options (ranges and choices; docs/grpo.md).

    Returns:
        Error messages naming the field, the value and the fix (empty when valid).
    """
    from mrl_lightning.objectives.grpo import LOSS_TYPE_NAMES, SCALE_REWARDS

    errors = []
    if not policy.policy_name or "/" in policy.policy_name:
        errors.append(f"{p}: name must be non-empty and contain no '/'.")
    if policy.num_generations < 2:
        errors.append(f"{p}: num_generations={policy.num_generations}; GRPO needs >= 2 completions per "
                      "prompt to form a group baseline. Set num_generations: 8 (or any >= 2).")
    for key in ("temperature", "top_p", "learning_rate", "weight_decay", "beta", "epsilon", "epsilon_high",
                "max_grad_norm"):
        value = getattr(policy, key)
        if value is not None and not math.isfinite(value):  # .nan / .inf in a YAML file pass every comparison
            errors.append(f"{p}: {key}={value} must be a finite number.")
    if not policy.temperature > 0:
        errors.append(f"{p}: temperature={policy.temperature} must be > 0.")
    if not 0 < policy.top_p <= 1:
        errors.append(f"{p}: top_p={policy.top_p} must be in (0, 1].")
    if policy.top_k < 0:
        errors.append(f"{p}: top_k={policy.top_k} must be >= 0 (0 = off).")
    for key in ("max_prompt_length", "max_completion_length", "num_iterations"):
        if getattr(policy, key) < 1:
            errors.append(f"{p}: {key}={getattr(policy, key)} must be >= 1.")
    if policy.micro_batch_size is not None and policy.micro_batch_size < 1:
        errors.append(f"{p}: micro_batch_size={policy.micro_batch_size} must be >= 1 or null.")
    if policy.logprob_chunk_elements is not None and policy.logprob_chunk_elements < 1:
        errors.append(f"{p}: logprob_chunk_elements={policy.logprob_chunk_elements} must be >= 1 (logits per "
                      "chunk; 16777216 = 64 MiB of float32) or null (always whole logits).")
    if policy.warmup_steps < 0:
        errors.append(f"{p}: warmup_steps={policy.warmup_steps} must be >= 0 (0 = no warm-up).")
    if policy.beta < 0:
        errors.append(f"{p}: beta={policy.beta} must be >= 0 (0 disables the KL term).")
    if policy.kl_log_ratio_clamp is not None and not policy.kl_log_ratio_clamp > 0:
        errors.append(f"{p}: kl_log_ratio_clamp={policy.kl_log_ratio_clamp} must be > 0 (nats; verl uses 20) "
                      "or null to turn the bound off.")
    if policy.epsilon < 0 or (policy.epsilon_high is not None and policy.epsilon_high < 0):
        errors.append(f"{p}: epsilon/epsilon_high must be >= 0; got {policy.epsilon}/{policy.epsilon_high}.")
    if policy.loss_type not in LOSS_TYPE_NAMES:
        errors.append(f"{p}: loss_type={policy.loss_type!r}; valid: {list(LOSS_TYPE_NAMES)}.")
    else:
        errors.extend(loss_type_errors(p, policy))
    if policy.scale_rewards not in SCALE_REWARDS:
        errors.append(f"{p}: scale_rewards={policy.scale_rewards!r}; valid: {list(SCALE_REWARDS)}.")
    if not policy.learning_rate > 0:
        errors.append(f"{p}: learning_rate={policy.learning_rate} must be > 0.")
    if not policy.weight_decay >= 0:
        errors.append(f"{p}: weight_decay={policy.weight_decay} must be >= 0 (AdamW's decay; 0 = none).")
    if policy.max_grad_norm is not None and not policy.max_grad_norm > 0:  # torch would flip every gradient
        errors.append(f"{p}: max_grad_norm={policy.max_grad_norm} must be > 0, or null for no clipping.")
    return errors


def loss_type_errors(p: str, policy) -> list[str]:
    """Problems of a policy's loss-type options and dynamic sampling (docs/grpo.md, "Options").

    An importance level the loss type is not meant for (TRL's reason), an option set away from
    TRL's default that the chosen loss type does not read (TRL would ignore it silently), values
    out of range, and ``filter_groups`` with what it cannot run beside.

    Returns:
        Error messages naming the field, the value and the fix (empty when valid).
    """
    from mrl_lightning.objectives.loss_types import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, OPTION_DEFAULTS

    errors, name = [], policy.loss_type
    kind, level = LOSS_TYPES[name], policy.importance_sampling_level
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        errors.append(f"{p}: importance_sampling_level={level!r}; valid: {list(IMPORTANCE_SAMPLING_LEVELS)}.")
    elif level not in kind.levels:
        errors.append(f"{p}: importance_sampling_level={level!r} with loss_type={name!r}: {kind.level_advice}.")
    for key, default in OPTION_DEFAULTS.items():
        value = getattr(policy, key)
        if value != default and key not in kind.reads():
            readers = [n for n, cls in LOSS_TYPES.items() if key in cls.reads()]
            errors.append(f"{p}: {key}={value!r} is read only by loss_type {readers}, not by loss_type={name!r} "
                          f"(TRL would ignore it); drop {key} or set loss_type to one of {readers}.")
    if policy.delta is not None and not policy.delta > 1.0:
        errors.append(f"{p}: delta={policy.delta} must be > 1 (the cap on the unclipped ratio; TRL recommends "
                      "more than 1 + epsilon_high, INTELLECT-2 uses 4) or null to turn two-sided clipping off.")
    cap = policy.epsilon if policy.epsilon_high is None else policy.epsilon_high
    if name == "cispo" and not cap > 1.0:
        errors.append(f"{p}: loss_type='cispo' caps the importance weight at epsilon_high={policy.epsilon_high} "
                      f"(null takes epsilon={policy.epsilon}), so even an on-policy token (weight 1) is capped to "
                      f"{cap}; set epsilon_high: 5.0 (ScaleRL's eps_max) or another value > 1.")
    for key in ("sapo_temperature_pos", "sapo_temperature_neg"):
        if not getattr(policy, key) > 0:
            errors.append(f"{p}: {key}={getattr(policy, key)} must be > 0 (TRL's default: {OPTION_DEFAULTS[key]}).")
    for key in ("vespo_lambda_pos", "vespo_lambda_neg"):  # below 1e-4 (0 too) floored at 1e-4, as TRL (docs/grpo.md)
        if not getattr(policy, key) >= 0:
            errors.append(f"{p}: {key}={getattr(policy, key)} must be >= 0 (values below 1e-4, 0 included, are floored "
                          f"at 1e-4 as in TRL; TRL's default: {OPTION_DEFAULTS[key]}).")
    for key in ("vespo_k_pos", "vespo_k_neg"):
        if getattr(policy, key) < 0:
            errors.append(f"{p}: {key}={getattr(policy, key)} must be >= 0 (TRL's default: {OPTION_DEFAULTS[key]}).")
    if vespo_sequence_correction(policy):
        errors.append(f"{p}: loss_type='vespo' folds the sampler correction into its own per-token weights, so "
                      f"vllm_importance_sampling_mode={policy.vllm_importance_sampling_mode!r} is refused (as TRL "
                      "refuses it); use token_truncate or token_mask, or vllm_importance_sampling_correction: false.")
    if not 0.0 <= policy.top_entropy_quantile <= 1.0:
        errors.append(f"{p}: top_entropy_quantile={policy.top_entropy_quantile} must be in [0, 1] (the share of "
                      "tokens by entropy that keep their policy term; 1 = all, the paper uses 0.2).")
    if policy.top_entropy_quantile < 1.0 and policy.fsdp:
        errors.append(f"{p}: top_entropy_quantile={policy.top_entropy_quantile} with fsdp=true is not supported (its "
                      "entropy pass runs one forward per prompt, and a sharded policy's ranks must run as many "
                      "each); set top_entropy_quantile: 1.0 or fsdp: false.")
    if policy.off_policy_mask_threshold is not None and not policy.off_policy_mask_threshold > 0:
        errors.append(f"{p}: off_policy_mask_threshold={policy.off_policy_mask_threshold} must be > 0 (nats, e.g. "
                      "0.5) or null to turn the off-policy sequence mask off.")
    errors.extend(dynamic_sampling_errors(p, policy))
    return errors


def vespo_sequence_correction(policy) -> bool:
    """True for VESPO with a sequence-level sampler correction (refused, as TRL refuses it)."""
    return (policy.loss_type == "vespo" and policy.vllm_importance_sampling_correction
            and str(policy.vllm_importance_sampling_mode).startswith("sequence"))


def dynamic_sampling_errors(p: str, policy) -> list[str]:
    """Problems of ``filter_groups`` / ``max_num_gen_batches`` (docs/grpo.md, "Dynamic sampling")."""
    errors, cap = [], policy.max_num_gen_batches
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        errors.append(f"{p}: max_num_gen_batches={cap!r} must be an integer >= 1 (generation batches per step, the "
                      "first included; 1 = no extra draws). verl's 0 (no limit) is refused: a policy whose every "
                      "group has equal rewards would never finish a step.")
    elif cap != 10 and not policy.filter_groups:
        errors.append(f"{p}: max_num_gen_batches={cap} has no effect without filter_groups: true; set "
                      "filter_groups: true or drop max_num_gen_batches.")
    if policy.filter_groups and policy.fsdp:
        errors.append(f"{p}: filter_groups=true with fsdp=true is not supported (the ranks of a sharded policy must "
                      "train on as many rows each, and filtering leaves them uneven); set one of them to false.")
    return errors
