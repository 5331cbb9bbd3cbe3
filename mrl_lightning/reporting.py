"""Scalars and text the loop logs (TensorBoard tags by prefix, units in the name).

``rollout/<policy>/...``: reward_mean, reward_std, success_rate (overall and
``success_rate_<part>``), zero_std_group_share, completion_length_tokens,
truncated_share. ``eval/<policy>/...``: greedy success on held-out prompts per part
(``success_<part>``), and ``success_strong`` / ``success_weak`` averaged over the parts
the policy started good / weak at.
"""

from __future__ import annotations

import torch


def rollout_metrics(scored, policy) -> dict[str, float]:
    """Scalars describing one policy's scored rollouts."""
    p = scored.policy
    rewards = scored.rewards
    valid = rewards[~torch.isnan(rewards)]
    r = scored.rollouts
    out = {
        f"rollout/{p}/reward_mean": float(valid.mean()) if valid.numel() else float("nan"),
        f"rollout/{p}/reward_std": float(valid.std()) if valid.numel() > 1 else 0.0,
        f"rollout/{p}/success_rate": float(scored.success.float().mean()),
        f"rollout/{p}/zero_std_group_share": float(
            ((rewards.nan_to_num(-1.0).max(1).values - rewards.nan_to_num(-1.0).min(1).values) == 0).float().mean()
        ),
        f"rollout/{p}/completion_length_tokens": float(r.completion_mask.sum(1).float().mean()),
        f"rollout/{p}/truncated_share": float(r.truncated.float().mean()),
        f"rollout/{p}/nan_reward_share": float(torch.isnan(rewards).float().mean()),
    }
    parts: dict[str, list[int]] = {}
    for b, item in enumerate(scored.items):
        parts.setdefault(item.part, []).append(b)
    for part, rows in parts.items():
        out[f"rollout/{p}/success_rate_{part}"] = float(scored.success[rows].float().mean())
    return out


def eval_metrics(
    system, eval_items: dict[str, list], num_samples: int, eval_num_generations: int = 0, seed: int = 0
) -> tuple[dict[str, float], dict[str, str]]:
    """Evaluation scalars per policy and part, weak/strong averages, and sample tables.

    ``eval/<p>/greedy_success_<part>``: greedy decoding. With ``eval_num_generations`` k > 0,
    ``eval/<p>/success_<part>`` is the mean success of k sampled completions per held-out
    prompt (the expected reward GRPO optimizes); otherwise it equals the greedy number.
    ``success_strong`` / ``success_weak`` (and the ``greedy_`` ones) average the parts the
    policy started strong / weak at.
    """
    metrics: dict[str, float] = {}
    samples: dict[str, str] = {}
    for name, policy in system.policies.items():
        rows = ["| part | prompt | completion | correct |", "|---|---|---|---|"]
        greedy, sampled = {}, {}
        for part, items in eval_items.items():
            greedy[part], texts = system.greedy_success(policy, items)
            sampled[part] = (system.sampled_success(policy, items, eval_num_generations, seed)
                             if eval_num_generations > 0 else greedy[part])
            _, _, ok = system.score(texts[:num_samples], items[:num_samples])
            for item, text, good in zip(items[:num_samples], texts, ok.tolist()):
                prompt = policy.render_prompt(item).replace("\n", "\\n").replace("|", "\\|")
                rows.append(f"| {part} | {prompt} | {text!r} | {good} |")
        strong = [p for p in (policy.strong_parts or []) if p in greedy]
        weak = [p for p in greedy if p not in strong]
        for prefix, values in (("success", sampled), ("greedy_success", greedy)):
            for part, value in values.items():
                metrics[f"eval/{name}/{prefix}_{part}"] = value
            if strong:
                metrics[f"eval/{name}/{prefix}_strong"] = sum(values[p] for p in strong) / len(strong)
            if strong and weak:
                metrics[f"eval/{name}/{prefix}_weak"] = sum(values[p] for p in weak) / len(weak)
        samples[name] = "\n".join(rows)
    return metrics, samples
