"""Scalars and text the loop logs (TensorBoard tags by prefix, units in the name).

``rollout/<policy>/...``: reward_mean, reward_std, success_rate (overall and
``success_rate_<part>``), zero_std_group_share (groups whose scored rewards carry no GRPO
signal: :func:`~mrl_lightning.objectives.group_filter.groups_with_signal`, a NaN reward being
"not scored", docs/reliability.md), completion_length_tokens, truncated_share. ``eval/<policy>/...``: greedy success on held-out prompts per part
(``success_<part>``), and ``success_strong`` / ``success_weak`` averaged over the parts
the policy started good / weak at; with k sampled completions per held-out prompt also
``mean_at_k_<part>`` and ``pass_at_k_<part>`` (:func:`pass_at_k`).
"""

from __future__ import annotations

from typing import Callable

import torch

from mrl_lightning.metrics import Mean, Moments
from mrl_lightning.mwra.rng import sampling_rng, stream_seed
from mrl_lightning.mwra.sharding import full_weights
from mrl_lightning.objectives.group_filter import groups_with_signal


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021, eq. 1).

    ``pass@k = 1 - C(n - c, k) / C(n, k)``, computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``
    (the paper's numerically stable form): the chance that k of the n samples drawn
    without replacement hold at least one correct one. With k = n it is 1 when c > 0, else 0.

    Args:
        n: Samples drawn for the prompt, >= 1.
        c: Correct ones among them, 0 <= c <= n.
        k: Attempts allowed, 1 <= k <= n.

    Returns:
        The estimate, in [0, 1].

    Raises:
        ValueError: ``n``, ``c`` or ``k`` out of range.
    """
    if not (n >= 1 and 0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}) needs n >= 1, 0 <= c <= n and 1 <= k <= n.")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def rollout_metrics(scored, policy) -> dict[str, float]:
    """Scalars describing one policy's scored rollouts on this rank.

    Each says how it pools over the policy's ranks (:mod:`mrl_lightning.metrics`): rates are
    means weighted by their completions (or prompts), the reward std is recomputed from the
    pooled moments, so a group of ranks logs what one rank on the whole batch would.

    ``zero_std_group_share`` is the share of the B groups (``rewards`` is ``[B, G]``) without a
    GRPO signal: a NaN reward is "not scored" (docs/reliability.md) and is left out, so a group
    has no signal when its scored rewards are all equal or fewer than two of them are scored,
    the groups whose advantages are exactly 0 and that dynamic sampling drops (docs/grpo.md).
    """
    p = scored.policy
    rewards = scored.rewards
    valid = rewards[~torch.isnan(rewards)]
    r = scored.rollouts
    n, b = float(rewards.numel()), float(rewards.shape[0])
    out = {
        f"rollout/{p}/reward_mean": Mean(float(valid.mean()) if valid.numel() else float("nan"), valid.numel()),
        f"rollout/{p}/reward_std": Moments.of(valid.double().tolist(),
                                              std=float(valid.std()) if valid.numel() > 1 else 0.0),
        f"rollout/{p}/success_rate": Mean(float(scored.success.float().mean()), n),
        f"rollout/{p}/zero_std_group_share": Mean(float((~groups_with_signal(rewards)).float().mean()), b),
        f"rollout/{p}/completion_length_tokens": Mean(float(r.completion_mask.sum(1).float().mean()), n),
        f"rollout/{p}/truncated_share": Mean(float(r.truncated.float().mean()), n),
        f"rollout/{p}/nan_reward_share": Mean(float(torch.isnan(rewards).float().mean()), n),
        f"rollout/{p}/prompts_truncated_share": Mean(float(getattr(policy, "last_prompts_truncated_share", 0.0)), b),
    }
    parts: dict[str, list[int]] = {}
    for row, item in enumerate(scored.items):
        parts.setdefault(item.part, []).append(row)
    for part, rows in parts.items():
        out[f"rollout/{p}/success_rate_{part}"] = Mean(float(scored.success[rows].float().mean()),
                                                       len(rows) * scored.num_generations)
    return out


def eval_counts(
    system,
    eval_items: dict[str, list],
    policies: list[str],
    num_samples: int,
    eval_num_generations: int,
    seed_for_part: Callable[..., int],
    shard_indices: Callable[[str, int], list[int]] = lambda name, n: list(range(n)),
) -> tuple[dict, dict[str, list]]:
    """Successes on held-out prompts of the given policies, as sums and counts.

    Args:
        system: The :class:`~mrl_lightning.loop.system.MutualRL`.
        eval_items: Part name -> held-out prompts.
        policies: Policies to evaluate (this rank's).
        num_samples: Greedy completions of each part's first ``num_samples`` prompts kept for the
            policy's text table (:func:`sample_tables`; each rank keeps those of its share).
        eval_num_generations: k sampled completions per prompt (0 = greedy only).
        seed_for_part: ``(policy, part) -> seed`` of the sampled evaluation's stream, and
            ``(policy, part, i) -> seed`` of the part's i-th prompt (its completions' own seed).
        shard_indices: ``(policy, n) -> the positions of this rank's share`` of a part's n prompts
            (data-parallel evaluation).

    Returns:
        ``counts[policy][kind][part] = (successes, completions)`` with kind ``greedy`` or
        ``sampled``; with k > 0 also ``counts[policy]["per_prompt"][part] = (successes of
        each prompt, k)`` (for pass@k after the ranks' prompts are merged); and
        ``samples[policy]``: ``(part index, position, table row)`` of this rank's sample completions.
    """
    counts: dict = {}
    samples: dict[str, list] = {}
    for name in policies:
        policy = system.policies[name]
        rows: list[tuple[int, int, str]] = []
        greedy, sampled, per_prompt = {}, {}, {}
        # a sharded policy is gathered once, on every rank of its group, even one with no prompt of a part
        with full_weights(getattr(policy, "model", None)):
            for part_index, (part, items) in enumerate(eval_items.items()):
                positions = shard_indices(name, len(items))
                mine = [items[i] for i in positions]
                if not mine:
                    continue
                rate, texts = system.greedy_success(policy, mine)
                greedy[part] = (rate * len(mine), len(mine))
                if eval_num_generations > 0:  # each prompt from its own seed: the evaluating rank does not matter
                    seeds = [seed_for_part(name, part, i) for i in positions]
                    with sampling_rng(seed_for_part(name, part)):
                        hits = system.rollout_n(policy, mine, eval_num_generations,
                                                prompt_seeds=seeds).sum(dim=1).tolist()
                    sampled[part] = (float(sum(hits)), len(mine) * eval_num_generations)
                    per_prompt[part] = ([int(h) for h in hits], eval_num_generations)
                shown = [j for j, pos in enumerate(positions) if pos < num_samples]
                if shown:
                    _, _, ok = system.score([texts[j] for j in shown], [mine[j] for j in shown])
                    for j, good in zip(shown, ok.tolist()):
                        prompt = policy.render_prompt(mine[j]).replace("\n", "\\n").replace("|", "\\|")
                        rows.append((part_index, positions[j], f"| {part} | {prompt} | {texts[j]!r} | {good} |"))
        counts[name] = {"greedy": greedy, "sampled": sampled or greedy}
        if per_prompt:
            counts[name]["per_prompt"] = per_prompt
        samples[name] = rows
    return counts, samples


def sample_tables(per_rank: list[dict[str, list]]) -> dict[str, str]:
    """One markdown table per policy from :func:`eval_counts` samples of every rank, rows in part then
    prompt order, so any placement shows the same prompts (each part's first ``num_samples``)."""
    rows: dict[str, list] = {}
    for samples in per_rank:
        for name, part_rows in samples.items():
            rows.setdefault(name, []).extend(part_rows)
    return {name: "\n".join(["| part | prompt | completion | correct |", "|---|---|---|---|"]
                            + [row for _, _, row in sorted(found)]) for name, found in rows.items()}


def merge_eval_counts(per_rank: list[dict]) -> dict:
    """Sum :func:`eval_counts` results of several ranks (per-prompt successes: concatenated in rank order).

    Raises:
        ValueError: two ranks sampled a different k for one policy and part.
    """
    out: dict = {}
    for counts in per_rank:
        for name, kinds in counts.items():
            for kind, parts in kinds.items():
                if kind == "per_prompt":
                    for part, (hits, k) in parts.items():
                        seen, k_seen = out.setdefault(name, {}).setdefault(kind, {}).get(part, ([], k))
                        if k_seen != k:
                            raise ValueError(f"policy {name!r}, part {part!r}: ranks sampled k={k_seen} and k={k} "
                                             "completions per prompt; every rank must use the same k.")
                        out[name][kind][part] = (seen + list(hits), k)
                    continue
                for part, (hits, total) in parts.items():
                    h, t = out.setdefault(name, {}).setdefault(kind, {}).get(part, (0.0, 0))
                    out[name][kind][part] = (h + hits, t + total)
    return out


def eval_metrics_from_counts(system, counts: dict) -> dict[str, float]:
    """Evaluation scalars per policy and part, and weak/strong averages.

    ``eval/<p>/greedy_success_<part>``: greedy decoding. ``eval/<p>/success_<part>``: mean
    success of k sampled completions per held-out prompt (the expected reward GRPO
    optimizes), or the greedy number when k = 0. With k > 0, over the held-out prompts:
    ``eval/<p>/mean_at_k_<part>``, the mean of each prompt's share of correct samples, and
    ``eval/<p>/pass_at_k_<part>``, the mean of :func:`pass_at_k` (n = k: the share of prompts
    with at least one correct sample). ``_strong`` / ``_weak`` of each average the parts the
    policy started strong / weak at.
    """
    metrics: dict[str, float] = {}
    for name, kinds in counts.items():
        policy = system.policies[name]
        rates = {kind: {part: hits / total for part, (hits, total) in parts.items() if total}
                 for kind, parts in kinds.items() if kind != "per_prompt"}
        for part, (hits, k) in kinds.get("per_prompt", {}).items():
            if hits:
                rates.setdefault("mean_at_k", {})[part] = sum(h / k for h in hits) / len(hits)
                rates.setdefault("pass_at_k", {})[part] = sum(pass_at_k(k, h, k) for h in hits) / len(hits)
        strong = [p for p in (policy.strong_parts or []) if p in rates["greedy"]]
        weak = [p for p in rates["greedy"] if p not in strong]
        kinds_out = [("success", rates["sampled"]), ("greedy_success", rates["greedy"])]
        kinds_out += [(kind, rates[kind]) for kind in ("mean_at_k", "pass_at_k") if kind in rates]
        for prefix, values in kinds_out:
            for part, value in values.items():
                metrics[f"eval/{name}/{prefix}_{part}"] = value
            if strong:
                metrics[f"eval/{name}/{prefix}_strong"] = sum(values[p] for p in strong) / len(strong)
            if strong and weak:
                metrics[f"eval/{name}/{prefix}_weak"] = sum(values[p] for p in weak) / len(weak)
    return metrics


def eval_metrics(
    system, eval_items: dict[str, list], num_samples: int, eval_num_generations: int = 0, seed: int = 0
) -> tuple[dict[str, float], dict[str, str]]:
    """Evaluate every policy in this process (one rank; see :func:`eval_counts`)."""
    counts, samples = eval_counts(system, eval_items, list(system.policies), num_samples, eval_num_generations,
                                  lambda name, part, *position: stream_seed(seed, name, "eval", part, *position))
    return eval_metrics_from_counts(system, counts), sample_tables([samples])


def evaluate_on_workers(system, eval_items: dict[str, list], workers, num_samples: int, eval_num_generations: int,
                        seed_for_part: Callable[..., int]) -> tuple[dict[str, float], list[tuple[str, str]]]:
    """Evaluate this rank's policies on its shard of the held-out prompts, merged over every rank.

    Args:
        system: The :class:`~mrl_lightning.loop.system.MutualRL`.
        eval_items: Part name -> held-out prompts.
        workers: This rank's :class:`~mrl_lightning.mwra.Workers` (its policies, shards, the gather).
        num_samples: Greedy completions of each part's first prompts kept as a text table per policy.
        eval_num_generations: k sampled completions per prompt (0 = greedy only).
        seed_for_part: ``(policy, part[, i]) -> seed`` (:func:`eval_counts`).

    Returns:
        The scalars of :func:`eval_metrics_from_counts` (the same on every rank), and
        ``(policy, markdown table)`` per policy, in the system's policy order, the same in every placement
        (:func:`sample_tables`).
    """
    counts, samples = eval_counts(system, eval_items, workers.local_policies, num_samples, eval_num_generations,
                                  seed_for_part, shard_indices=workers.shard_indices)
    gathered = workers.all_gather((counts, samples), "eval")
    metrics = eval_metrics_from_counts(system, merge_eval_counts([c for c, _ in gathered]))
    tables = sample_tables([s for _, s in gathered])
    return metrics, [(name, tables[name]) for name in system.policies if name in tables]


def eval_summary(metrics: dict[str, float], full_up_to: int = 3) -> str:
    """The console's ``[eval]`` line: every policy's sampled strong / weak success and its weak greedy one.

    One entry per policy, in the order of ``metrics``, joined by `` | ``. Up to ``full_up_to``
    policies each reads ``gpt2 strong 0.87 weak 0.03 (greedy 0.03)``; more are written
    ``gpt2 0.87/0.03 (0.03)`` after one legend, ``strong/weak (greedy weak):``, so the line
    stays short. A policy without strong parts (``strong_parts`` unset) shows its sampled
    success per part instead (``add 0.50 sub 0.10``); a missing value is left out.

    Args:
        metrics: The evaluation scalars of :func:`eval_metrics_from_counts` (other tags are ignored).
        full_up_to: Most policies written out in words.

    Returns:
        One line, no line break.
    """
    names: list[str] = []
    for key in metrics:
        head, _, rest = key.partition("/")
        name = rest.split("/", 1)[0]
        if head == "eval" and "/" in rest and name not in names:
            names.append(name)
    compact = len(names) > full_up_to
    entries = []
    for name in names:
        strong, weak, greedy = (metrics.get(f"eval/{name}/{tag}")
                                for tag in ("success_strong", "success_weak", "greedy_success_weak"))
        if strong is None:
            prefix = f"eval/{name}/success_"
            parts = [f"{k[len(prefix):]} {v:.2f}" for k, v in metrics.items()
                     if k.startswith(prefix) and k[len(prefix):] not in ("strong", "weak")]
            entries.append(" ".join([name, *parts]))
        elif compact:
            shown = f"{strong:.2f}" + (f"/{weak:.2f}" if weak is not None else "")
            entries.append(f"{name} {shown}" + (f" ({greedy:.2f})" if greedy is not None else ""))
        else:
            words = [name, f"strong {strong:.2f}"]
            words += [f"weak {weak:.2f}"] if weak is not None else []
            words += [f"(greedy {greedy:.2f})"] if greedy is not None else []
            entries.append(" ".join(words))
    line = " | ".join(entries)
    return f"strong/weak (greedy weak): {line}" if compact else line


def evaluate_step(trainer, model, datamodule) -> None:
    """Evaluate every policy ``trainer`` runs on this rank at its ``global_step``: log the scalars and the sample
    completions (rank 0), hand them to ``on_eval_end``, print the one-line summary (docs/loop.md, "Evaluation")."""
    from mrl_lightning.mwra.process import release_free_memory
    from mrl_lightning.update.policy_update import sampling_precision

    w, step = trainer.workers, trainer.global_step
    with w.phase("eval"):
        def seed(name: str, part: str, *position: int) -> int:  # position: the prompt's place in the part
            return stream_seed(trainer._run_seed(), name, "eval", step, part, *position)

        with sampling_precision(trainer.fabric, [model.policies[name] for name in w.local_policies]):
            metrics, samples = evaluate_on_workers(model, datamodule.eval_items(), w, trainer.num_sample_completions,
                                                   trainer.eval_num_generations, seed)
        release_free_memory()
    trainer.last_eval = metrics
    trainer.fabric.call("on_eval_end", trainer.ctx, model, metrics)
    trainer.fabric.log_dict(metrics, step=step)
    if trainer.is_global_zero:
        for name, text in samples:
            trainer.logger.experiment.add_text(f"samples/{name}", text, global_step=step)
    trainer.print(f"[eval] step {step}: {eval_summary(metrics)}")
