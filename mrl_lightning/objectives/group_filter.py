"""DAPO's dynamic-sampling filter: which groups carry a GRPO signal (docs/grpo.md, "Dynamic sampling").

A group whose rewards are all equal has advantage exactly 0 for every completion
(:func:`~mrl_lightning.objectives.grpo.center_groups`), so it adds nothing to the GRPO
gradient but still counts in the loss normalizers; DAPO (and verl's ``filter_groups``)
drops such groups and samples more prompts until the batch is full. Shapes: B prompts,
G completions each; rewards float32, NaN = not scored.
"""

from __future__ import annotations

import torch
from torch import Tensor


def groups_with_signal(rewards: Tensor) -> Tensor:
    """``[B]`` bool: True where the group's scored rewards are not all equal (DAPO's kept groups).

    A group with fewer than two scored rewards has no signal either.

    Args:
        rewards: ``[B, G]`` float32 rewards (NaN = not scored).

    Raises:
        ValueError: ``rewards`` not 2-D.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, G]; got shape {tuple(rewards.shape)}")
    valid = ~torch.isnan(rewards)
    big = torch.finfo(rewards.dtype).max
    hi = torch.where(valid, rewards, torch.full_like(rewards, -big)).max(dim=1).values
    lo = torch.where(valid, rewards, torch.full_like(rewards, big)).min(dim=1).values
    return (valid.sum(dim=1) >= 2) & (hi > lo)


def first_kept(kept_positions: list[int], limit: int) -> list[int]:
    """The first ``limit`` kept positions in draw order (verl keeps the first ``train_batch_size`` groups).

    Args:
        kept_positions: Positions in the step's draw order (shared batch first, then each extra
            generation batch) of the groups with a signal, in any order.
        limit: B, the groups a full batch trains on.
    """
    return sorted(kept_positions)[:limit]
