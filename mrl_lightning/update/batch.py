"""What one policy trains on in one step, and the hook payloads (docs/loop.md).

Shapes: B prompts, G completions per prompt, N = B*G, L completion length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mrl_lightning.data.items import PromptItem
from mrl_lightning.rollout.base import RolloutBatch, concat_rollouts

if TYPE_CHECKING:
    from mrl_lightning.policy.module import PolicyModule


@dataclass
class ScoredRollouts:
    """One policy's rollouts for the step's prompts, scored by the verifiers.

    Attributes:
        policy: Policy name.
        items: The B prompts.
        rollouts: N = B*G completions, prompt-major (row = b*G + g).
        rewards_per_func: ``[N, F]`` float32, NaN = not scored.
        rewards: ``[B, G]`` float32 combined reward (NaN only if every function was NaN).
        success: ``[B, G]`` bool, reward of the strict verifier >= success_threshold.
        prompt_texts: B rendered prompts in this policy's template.
        verifier_rewards: ``[N]`` float32, the strict verifier's reward per completion.
    """

    policy: str
    items: list[PromptItem]
    rollouts: RolloutBatch
    rewards_per_func: Tensor
    rewards: Tensor
    success: Tensor
    prompt_texts: list[str]
    verifier_rewards: Tensor

    @property
    def num_generations(self) -> int:
        return self.rewards.shape[1]

    def select_groups(self, groups: list[int]) -> ScoredRollouts:
        """The groups (prompts) ``groups`` of this batch, in that order."""
        g = self.num_generations
        rows = [b * g + k for b in groups for k in range(g)]
        index = torch.tensor(groups, dtype=torch.long)
        return ScoredRollouts(self.policy, [self.items[b] for b in groups], self.rollouts.select_rows(rows),
                              self.rewards_per_func[torch.tensor(rows, dtype=torch.long)], self.rewards[index],
                              self.success[index], [self.prompt_texts[b] for b in groups],
                              self.verifier_rewards[torch.tensor(rows, dtype=torch.long)])

    def own_prompt_ids(self, b: int) -> list[int]:
        """Prompt ``b``'s token ids as this policy's own rollouts had them (left padding removed):
        rendered, encoded and truncated by the policy itself, BOS and template head kept."""
        row = b * self.num_generations
        return self.rollouts.prompt_ids[row][self.rollouts.prompt_mask[row]].tolist()


def concat_scored(parts: list[ScoredRollouts], pad_id: int) -> ScoredRollouts:
    """One policy's scored rollouts of several generation batches, their groups one after another.

    Raises:
        ValueError: ``parts`` is empty.
    """
    if not parts:
        raise ValueError("concat_scored needs at least one ScoredRollouts.")
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return ScoredRollouts(first.policy, [x for p in parts for x in p.items],
                          concat_rollouts([p.rollouts for p in parts], pad_id),
                          torch.cat([p.rewards_per_func for p in parts]), torch.cat([p.rewards for p in parts]),
                          torch.cat([p.success for p in parts]), [t for p in parts for t in p.prompt_texts],
                          torch.cat([p.verifier_rewards for p in parts]))


class AuxiliaryLoss:
    """A loss term a probe adds to a policy's step (SGT's transfer term, PRP's peer term).

    Called once per inner iteration of the update (:mod:`mrl_lightning.update.policy_update`), after the
    GRPO backward; it runs its own forward over its own rows, and its gradient is kept apart
    so that its share of the update is measured, logged and bounded on every step
    (:mod:`mrl_lightning.objectives.aux_share`).

    Attributes:
        name: Short name; metrics go under ``probe/<name>/<policy>/``. Terms of one name are
            summed before their share is measured.
        max_grad_share: Bound in (0, 1) on the term's share of the update,
            ``||g_term|| / (||g_grpo|| + ||g_term||)``; None = no bound.
        grad_share_floor: The least GRPO gradient norm the bound is measured against
            (``max(||g_grpo||, floor)``); None = the GRPO gradient's own norm, so the share of
            the applied update never exceeds the bound (docs/probes.md, "Bound").
    """

    name: str = "aux"
    max_grad_share: float | None = None
    grad_share_floor: float | None = None

    def __call__(self, policy: PolicyModule, model, totals: dict[str, float]) -> tuple[Tensor, dict[str, float]]:
        """The term's scalar loss (already weighted) and metrics to log.

        Args:
            policy: The policy being updated.
            model: The (Fabric-wrapped) model to run forward passes with.
            totals: The batch's loss normalizers summed over the policy's ranks
                (:attr:`TrainBatch.group_counts`: ``sequences``, ``tokens`` and the probes' own).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")

    def pass_shape(self) -> tuple[int, int] | None:
        """``(rows, tokens of its longest row)`` of the term's own forward pass, or None when not known in advance
        (the update picks the attention kernel of short passes by it: :func:`mrl_lightning.update.policy_update.term_attention`)."""
        return None


@dataclass
class TrainBatch:
    """Policy i's training batch, composed by the probes from its own rollouts + SEE.

    Attributes:
        scored: The policy's own scored rollouts.
        advantages: ``[B, G]`` float32 (GRPO group advantages; probes may replace them).
        aux_losses: Extra loss terms added by probes.
        metrics: Scalars probes want logged (full tag, e.g. ``probe/sgt/transfers``).
        counts: This rank's loss normalizers by name: the loop sets ``sequences`` and
            ``tokens`` (counted completion tokens); probes add their own (e.g. SGT's
            ``sgt_demos``). Summed over the policy's group of ranks into ``group_counts``.
        group_counts: ``counts`` summed over the policy's ranks, set by the loop after the
            probes composed the batch and before the update; None until then (= ``counts``
            on one rank). Losses divide by these, so k data-parallel ranks give the
            gradient of one rank on the whole batch.
        group_terms: ``(name, max_grad_share, grad_share_floor)`` of the auxiliary terms on any
            of the policy's ranks, in one order, set by the loop with ``group_counts`` on a group
            of several ranks (each rank then reduces every term's gradient, also one it has
            none of); None = this rank's terms.
        keep: ``[B]`` bool, the groups the GRPO term trains on (dynamic sampling: groups with a
            signal, the first ``data.batch_size`` of the step; docs/grpo.md); None = every group.
            ``counts`` hold the kept groups' rows only; the probes see every group.
    """

    scored: ScoredRollouts
    advantages: Tensor
    aux_losses: list[AuxiliaryLoss] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    group_counts: dict[str, float] | None = None
    group_terms: list[tuple[str, float | None, float | None]] | None = None
    keep: Tensor | None = None

    def for_update(self) -> TrainBatch:
        """This batch with only the :attr:`keep` groups' own rows and advantages (itself when ``keep`` is None);
        auxiliary terms, metrics and counts are shared."""
        if self.keep is None:
            return self
        groups = [int(b) for b in torch.nonzero(self.keep).flatten()]
        return TrainBatch(self.scored.select_groups(groups), self.advantages[torch.tensor(groups, dtype=torch.long)],
                          self.aux_losses, self.metrics, self.counts, self.group_counts, self.group_terms)

    def total(self, key: str) -> float:
        """``group_counts[key]`` once summed over the group, else this rank's ``counts[key]``."""
        source = self.group_counts if self.group_counts is not None else self.counts
        return float(source.get(key, 0.0))
