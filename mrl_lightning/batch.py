"""What one policy trains on in one step, and the hook payloads (docs/loop.md).

Shapes: B prompts, G completions per prompt, N = B*G, L completion length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

from mrl_lightning.data.items import PromptItem
from mrl_lightning.rollout.base import RolloutBatch

if TYPE_CHECKING:
    from mrl_lightning.policy import PolicyModule


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

    def own_prompt_ids(self, b: int) -> list[int]:
        """Prompt ``b``'s token ids as this policy's own rollouts had them (left padding removed):
        rendered, encoded and truncated by the policy itself, BOS and template head kept."""
        row = b * self.num_generations
        return self.rollouts.prompt_ids[row][self.rollouts.prompt_mask[row]].tolist()


class AuxiliaryLoss:
    """A loss term a probe adds to a policy's step (SGT's transfer term, PRP's peer term).

    Called once per inner iteration of the update (:mod:`mrl_lightning.update`), after the
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
    """

    scored: ScoredRollouts
    advantages: Tensor
    aux_losses: list[AuxiliaryLoss] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    group_counts: dict[str, float] | None = None
    group_terms: list[tuple[str, float | None, float | None]] | None = None

    def total(self, key: str) -> float:
        """``group_counts[key]`` once summed over the group, else this rank's ``counts[key]``."""
        source = self.group_counts if self.group_counts is not None else self.counts
        return float(source.get(key, 0.0))
