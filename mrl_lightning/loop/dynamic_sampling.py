"""DAPO's dynamic sampling in the loop: extra generation batches for one policy (docs/grpo.md, "Dynamic sampling").

A policy with ``filter_groups: true`` trains only on groups whose rewards are not all equal
(:func:`~mrl_lightning.objectives.group_filter.groups_with_signal`). After its rollouts of
the step's shared batch, while fewer than B = ``data.batch_size`` of its groups have a signal
and it has used fewer than ``max_num_gen_batches`` generation batches, it draws another
batch of B prompts from its *own* draws of the data
(:meth:`~mrl_lightning.data.stream.PromptDataModule.extra_batch`) and samples them. Its GRPO
term then trains on the first B groups with a signal in draw order (the shared batch first),
as verl keeps the first ``train_batch_size``; when the cap is reached first, on the ones it
has; with none (and no probe term giving a gradient) the policy takes no optimizer step at all
(:func:`mrl_lightning.update.policy_update.empty_update`, ``train/<p>/empty_updates_skipped``).

Why the policy's own draws, not more prompts for every policy: every policy still sees the
step's same B prompts; the shared stream's position never depends on a policy's rewards, so
a policy that does not filter runs exactly as it would without a peer that does; and an
extra batch is a pure function of (data seed, policy, step, batch index), so nothing about it
is checkpointed and a resumed run, or another placement, draws the same prompts.

Exactness over ranks: a policy's k ranks split each generation batch by whole prompts,
strided over the step's draw order (position ``q`` of the concatenated batches goes to the
rank ``q mod k`` of the group, as the shared batch is split), so SEE's exchange puts every
record in the order one rank would; each prompt is sampled from its own seed (keyed by the
step, the batch and its place in it); the ranks agree on the next draw from the group's
gathered positions of kept groups. The rollouts of every batch go to ``on_rollouts_end``,
so SEE publishes them and SGT sees the dropped all-fail groups (its rescue set).

Logged under ``rollout/<p>/``: ``num_gen_batches`` (verl's name; 1 = no extra draw),
``filtered_group_share`` (share of the step's sampled groups dropped for equal rewards),
``train_groups`` (groups the GRPO term trains on; below B when the cap was reached).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mrl_lightning.update.batch import ScoredRollouts, concat_scored
from mrl_lightning.metrics import Max, Mean, Sum
from mrl_lightning.mwra import stream_seed
from mrl_lightning.objectives.group_filter import first_kept, groups_with_signal


def sample_until_full(system, policy, datamodule, workers, items: list, first: ScoredRollouts, *, run_seed: int,
                      rollout_step: int) -> tuple[ScoredRollouts, Tensor, dict[str, float], int]:
    """Extra generation batches for ``policy`` until B of its groups have a signal or the cap is reached.

    Args:
        system: The :class:`~mrl_lightning.loop.system.MutualRL` (``rollout``).
        policy: A policy with ``filter_groups`` set.
        datamodule: The prompt data module (``extra_batch``).
        workers: This rank's :class:`~mrl_lightning.mwra.Workers` (the policy's group).
        items: The step's shared batch of B prompts.
        first: This rank's scored rollouts of its shard of ``items``.
        run_seed: The run seed of the sampling streams.
        rollout_step: The rollout step (keys the draws and the seeds).

    Returns:
        ``(scored, keep, metrics, extra)``: this rank's scored rollouts of every generation batch
        (its shards, in draw order), ``[groups]`` bool of the groups the GRPO term trains on, the
        metrics of the module docstring, and the prompts drawn beyond the shared batch by the
        whole group.
    """
    name, limit = policy.policy_name, len(items)
    size, index = workers.group_size(name), workers.group_index(name)
    positions = list(range(index, limit, size))  # the shared batch's shard (Workers.shard_indices)
    parts, kept = [first], _gathered_kept(workers, name, first, positions)
    drawn, offset, batches = {x.prompt_id for x in items}, limit, 1
    while len(kept) < limit and batches < policy.max_num_gen_batches:
        extra = datamodule.extra_batch(name, rollout_step, batches, drawn)
        if not extra:
            break
        drawn |= {x.prompt_id for x in extra}
        mine = [i for i in range(len(extra)) if (offset + i) % size == index]
        part = None
        if mine:
            seeds = [stream_seed(run_seed, name, "rollout", rollout_step, "extra", batches, i) for i in mine]
            part = system.rollout(policy, [extra[i] for i in mine], prompt_seeds=seeds,
                                  seed=stream_seed(run_seed, name, "rollout", rollout_step, "extra", batches))
            parts.append(part)
        local = [offset + i for i in mine]
        kept += _gathered_kept(workers, name, part, local)
        positions += local
        offset, batches = offset + len(extra), batches + 1
    chosen = set(first_kept(kept, limit))
    keep = torch.tensor([q in chosen for q in positions], dtype=torch.bool)
    scored = concat_scored(parts, policy.tokenizer.pad_token_id)
    dropped = float((~groups_with_signal(scored.rewards)).sum())
    p = f"rollout/{name}"
    metrics = {f"{p}/num_gen_batches": float(batches), f"{p}/train_groups": Sum(float(keep.sum())),
               f"{p}/filtered_group_share": Mean(dropped / max(len(positions), 1), len(positions))}
    return scored, keep, metrics, offset - limit


def _gathered_kept(workers, name: str, scored: ScoredRollouts | None, positions: list[int]) -> list[int]:
    """The draw positions of the groups with a signal on every rank of ``name``'s group (this rank's are
    ``positions`` of ``scored``, None when it sampled none of this batch)."""
    mine = [] if scored is None else [q for q, ok in zip(positions, groups_with_signal(scored.rewards).tolist()) if ok]
    return [q for part in workers.group_gather(name, mine) for q in part]


def extra_samples(workers, extra_prompts: dict[str, int], policies: dict) -> int:
    """Completions the policies sampled beyond the shared batch this step, over every rank (``samples_seen``).

    Each rank knows the extra prompts of the policies it runs (the same on each rank of a
    group); the world gathers them so every rank counts every policy's.
    """
    merged: dict[str, int] = {}
    for part in workers.all_gather(extra_prompts, "dynamic sampling"):
        for name, count in part.items():
            merged[name] = max(merged.get(name, 0), count)
    return sum(count * policies[name].num_generations for name, count in merged.items())
