"""What one policy trains on in one step, and the hook payloads (docs/loop.md).

Shapes: B prompts, G completions per prompt, N = B*G, L completion length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from mrl_lightning.data.items import PromptItem
from mrl_lightning.rollout.hf_generate import RolloutBatch

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


class AuxiliaryLoss(Protocol):
    """A loss term a probe adds to a policy's step (e.g. SGT's transfer term).

    Called once per inner iteration; returns the scalar loss (already weighted) and
    metrics to log under the policy's name.
    """

    name: str

    def __call__(self, policy: PolicyModule, model) -> tuple[Tensor, dict[str, float]]: ...


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
    """

    scored: ScoredRollouts
    advantages: Tensor
    aux_losses: list[AuxiliaryLoss] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    group_counts: dict[str, float] | None = None

    def total(self, key: str) -> float:
        """``group_counts[key]`` once summed over the group, else this rank's ``counts[key]``."""
        source = self.group_counts if self.group_counts is not None else self.counts
        return float(source.get(key, 0.0))
