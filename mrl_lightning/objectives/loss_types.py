"""The GRPO family's per-token policy terms, one class per ``loss_type`` (docs/grpo.md, "Loss types").

Each class is one unit: its per-token term, the aggregation it uses, the importance
sampling levels a config may pair it with, the options it reads (TRL ``GRPOConfig`` names,
with TRL 1.16's defaults as its ``__init__`` defaults) and the statistics it logs under
TRL's names. :data:`LOSS_TYPES` selects a class by name; :func:`build_loss_type` builds one
from a policy's options. Everything here is a pure function of tensors.

Shapes: N sequences, L completion length. ``coef`` is the importance weight
``exp(log pi_theta - log pi_old)`` at the chosen level: ``[N, L]`` per token
(``importance_sampling_level: token``) or ``[N, 1]`` per sequence (``sequence``, GSPO: the
exponential of the mean log-ratio over the sequence's counted tokens). ``advantages`` are
``[N, 1]`` or ``[N, L]`` float32; log-probs are float32 nats; ``completion_mask`` is
``[N, L]`` bool, True = counted.

Sources of the formulas (TRL 1.16 ``GRPOTrainer._compute_loss`` computes the same):

- clipped ratio (grpo, bnpo, dr_grpo, dapo, luspo): PPO's ``-min(w A, clip(w, 1 - eps,
  1 + eps_high) A)``; ``delta`` caps the unclipped ``w`` (two-sided clipping, INTELLECT-2).
- cispo: ``-sg(min(w, eps_high)) A log pi`` (MiniMax-M1; ScaleRL's eps_max).
- sapo: ``-sigmoid(tau (w - 1)) 4 / tau A``, tau by the advantage's sign (SAPO paper).
- vespo: ``-sg(phi(W)) A log pi``, ``phi(W) = exp(lambda + k log W - lambda W)`` of the
  sequence ratio ``W`` (VESPO paper), k and lambda by the advantage's sign.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import ClassVar

import torch
from torch import Tensor

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# Every option a loss type may read, with TRL 1.16's GRPOConfig default (a test reads TRL's own).
OPTION_DEFAULTS: dict[str, float | None] = {
    "epsilon": 0.2, "epsilon_high": None, "delta": None,
    "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05,
    "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0,
}
_LENGTH_WEIGHTED = ("it sums per-token terms, which weights each sequence by its completion length instead of "
                    "optimizing the per-sequence objective (TRL's warning); for GSPO set loss_type: grpo (or sapo, "
                    "luspo) with importance_sampling_level: sequence")


class LossType:
    """Base of the loss types: the per-token policy term of one ``loss_type``.

    Attributes:
        name: The ``loss_type`` value (TRL's).
        aggregation: How the per-token losses become a scalar (:data:`AGGREGATIONS`).
        levels: The ``importance_sampling_level`` values a config may pair it with.
        level_advice: Why the other level is refused, and the fix (TRL's reason).
        folds_sampler_weights: The term takes the sampler-correction weights into its own
            weight (VESPO) instead of being multiplied by them.
    """

    name: ClassVar[str] = ""
    aggregation: ClassVar[str] = "token_mean"
    levels: ClassVar[tuple[str, ...]] = ("token",)
    level_advice: ClassVar[str] = _LENGTH_WEIGHTED
    folds_sampler_weights: ClassVar[bool] = False

    def per_token(self, coef: Tensor, log_ratio: Tensor, logp: Tensor, advantages: Tensor, completion_mask: Tensor,
                  sampler_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy term per token and the statistics it logs.

        Args:
            coef: ``[N, L]`` or ``[N, 1]`` float32 importance weight (with grad).
            log_ratio: ``[N, L]`` float32 nats, ``log pi_theta - log pi_old`` per token (with grad).
            logp: ``[N, L]`` float32 nats under the current policy (with grad).
            advantages: ``[N, 1]`` or ``[N, L]`` float32.
            completion_mask: ``[N, L]`` bool, True = counted.
            sampler_weights: ``[N, L]`` or ``[N, 1]`` float32 sampler-correction weights, used
                only by a type that :attr:`folds_sampler_weights`.

        Returns:
            ``(loss, stats)``: ``[N, L]`` or ``[N, 1]`` float32 (broadcast over L by the caller);
            stats by TRL's tag name, each ``[N, L]`` (a share over counted tokens) or ``[N, 1]``
            (a mean over sequences).
        """
        raise NotImplementedError

    @classmethod
    @functools.cache
    def reads(cls) -> tuple[str, ...]:
        """The options (TRL names) this type's ``__init__`` takes."""
        return tuple(p for p in inspect.signature(cls.__init__).parameters if p != "self")


class GRPO(LossType):
    """Clipped importance ratio, each sequence's mean then the mean over sequences (TRL ``grpo``).

    Args:
        epsilon: Lower clip, ``w >= 1 - epsilon`` (TRL ``epsilon``).
        epsilon_high: Upper clip ``1 + epsilon_high``; None = ``epsilon`` (TRL ``epsilon_high``).
        delta: Cap on the unclipped branch's ``w`` (two-sided clipping; TRL ``delta``); None = off.
    """

    name, aggregation, levels = "grpo", "sequence_mean", ("token", "sequence")

    def __init__(self, epsilon: float = 0.2, epsilon_high: float | None = None, delta: float | None = None) -> None:
        self.epsilon, self.delta = epsilon, delta
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high

    def per_token(self, coef, log_ratio, logp, advantages, completion_mask, sampler_weights=None):
        clipped = torch.clamp(coef, 1.0 - self.epsilon, 1.0 + self.epsilon_high)
        if self.delta is not None:
            coef = torch.clamp(coef, max=self.delta)
        loss = -torch.min(coef * advantages, clipped * advantages)
        return loss, {"clip_ratio_low": (coef < 1.0 - self.epsilon) & (advantages < 0),
                      "clip_ratio_high": (coef > 1.0 + self.epsilon_high) & (advantages > 0)}


class BNPO(GRPO):
    """The clipped ratio, summed over counted tokens / the batch's counted tokens (TRL ``bnpo``)."""

    name, aggregation, levels = "bnpo", "token_mean", ("token",)


class DrGRPO(GRPO):
    """The clipped ratio, summed / (sequences * ``max_completion_length``) (TRL ``dr_grpo``, Dr. GRPO)."""

    name, aggregation, levels = "dr_grpo", "fixed_length", ("token",)


class DAPO(GRPO):
    """The clipped ratio, summed / the step's counted tokens (TRL ``dapo``, the default; DAPO paper)."""

    name, aggregation, levels = "dapo", "token_mean", ("token",)


class LUSPO(GRPO):
    """GSPO's sequence-level clipped ratio with each sequence's loss summed over its tokens (TRL ``luspo``).

    The sum (not the mean) scales a sequence's loss by its length (LUSPO paper); then the mean
    over sequences.
    """

    name, aggregation, levels = "luspo", "sequence_sum", ("sequence",)
    level_advice = ("LUSPO is a sequence-level loss: TRL's GRPOConfig says it requires importance_sampling_level"
                    "='sequence' (the paper's setup); set importance_sampling_level: sequence")


class CISPO(LossType):
    """Clipped importance-sampling weight times the log-prob (TRL ``cispo``, MiniMax-M1).

    ``l_t = -sg(min(w, epsilon_high)) A log pi_theta(t)``: the weight is capped and detached,
    so every token keeps a gradient (none is clipped away); aggregated as ``dapo``.

    Args:
        epsilon: TRL's ``epsilon_high`` default when ``epsilon_high`` is None (not read otherwise).
        epsilon_high: The cap on the weight, eps_max (TRL ``epsilon_high``; ScaleRL uses 5.0).
    """

    name, aggregation = "cispo", "token_mean"

    def __init__(self, epsilon: float = 0.2, epsilon_high: float | None = None) -> None:
        self.cap = epsilon if epsilon_high is None else epsilon_high

    def per_token(self, coef, log_ratio, logp, advantages, completion_mask, sampler_weights=None):
        weight = torch.clamp(coef, max=self.cap).detach()
        return -weight * advantages * logp, {"cispo_clip_ratio": (coef > self.cap) & (advantages > 0)}


class SAPO(LossType):
    """A smooth sigmoid gate instead of the clip (TRL ``sapo``, Soft Adaptive Policy Optimization).

    ``l_t = -sigmoid(tau (w - 1)) * 4 / tau * A`` with ``tau = sapo_temperature_pos`` where
    A > 0, else ``sapo_temperature_neg``; its gradient in w is ``4 sigma'(tau (w - 1)) A``,
    1 at w = 1 and fading as w leaves 1. Aggregated as ``grpo``.

    Args:
        sapo_temperature_pos: tau for positive advantages (TRL, default 1.0).
        sapo_temperature_neg: tau for the others (TRL, default 1.05).
    """

    name, aggregation, levels = "sapo", "sequence_mean", ("token", "sequence")

    def __init__(self, sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05) -> None:
        self.pos, self.neg = sapo_temperature_pos, sapo_temperature_neg

    def per_token(self, coef, log_ratio, logp, advantages, completion_mask, sampler_weights=None):
        tau = torch.where(advantages > 0, self.pos, self.neg)
        return -torch.sigmoid(tau * (coef - 1)) * 4 / tau * advantages, {}


class VESPO(LossType):
    """A Gamma-shaped weight of the sequence ratio times the log-prob (TRL ``vespo``, VESPO paper).

    ``l_t = -sg(phi(W)) A log pi_theta(t)`` with ``log W = sum_t m_t clamp(log_ratio_t, -20, 20)``
    (plus the sampler-correction weights' log, each clamped to ``[log 1e-8, 20]``), ``log W``
    clamped to ``[log 1e-8, 20]``, and ``phi(W) = exp(lambda + k log W - lambda W)``
    (``phi(1) = 1``; NaN or inf read as 0), ``(k, lambda)`` = ``(vespo_k_pos, vespo_lambda_pos)``
    where A >= 0, else the ``_neg`` pair; lambda is floored at 1e-4. Aggregated as ``dapo``.
    The sequence weight is built here from the token ratios, whatever the importance level.

    Args:
        vespo_k_pos: k for A >= 0 (TRL, default 2.0).
        vespo_lambda_pos: lambda for A >= 0 (TRL, default 3.0).
        vespo_k_neg: k for A < 0 (TRL, default 3.0).
        vespo_lambda_neg: lambda for A < 0 (TRL, default 2.0).
    """

    name, aggregation, folds_sampler_weights = "vespo", "token_mean", True
    level_advice = ("VESPO computes its own sequence-level weight from the token ratios (TRL: importance_sampling_"
                    "level should be 'token', the default); set importance_sampling_level: token")

    def __init__(self, vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0,
                 vespo_lambda_neg: float = 2.0) -> None:
        self.k_pos, self.lambda_pos, self.k_neg, self.lambda_neg = vespo_k_pos, vespo_lambda_pos, vespo_k_neg, \
            vespo_lambda_neg

    @torch.no_grad()
    def sequence_weight(self, advantages: Tensor, log_ratio: Tensor, completion_mask: Tensor,
                        sampler_weights: Tensor | None) -> Tensor:
        """``[N, 1]`` float32 ``phi(W)``, detached (the formula in the class docstring)."""
        low = math.log(1e-8)
        log_w = (torch.clamp(log_ratio, -20.0, 20.0) * completion_mask).sum(dim=-1, keepdim=True)
        if sampler_weights is not None:
            log_w = log_w + torch.clamp(torch.log(sampler_weights), low, 20.0).sum(dim=-1, keepdim=True)
        log_w = torch.clamp(log_w, low, 20.0)
        nonneg = advantages >= 0
        k = torch.where(nonneg, self.k_pos, self.k_neg)
        lam = torch.where(nonneg, self.lambda_pos, self.lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)

    def per_token(self, coef, log_ratio, logp, advantages, completion_mask, sampler_weights=None):
        phi = self.sequence_weight(advantages, log_ratio, completion_mask, sampler_weights)
        return -phi * advantages * logp, {"vespo/phi_seq_mean": phi}


LOSS_TYPES: dict[str, type[LossType]] = {cls.name: cls for cls in (GRPO, BNPO, DrGRPO, DAPO, CISPO, SAPO, LUSPO,
                                                                      VESPO)}


def build_loss_type(name: str, **options: float | None) -> LossType:
    """The loss type ``name`` with the options it reads taken from ``options`` (others ignored, as TRL does).

    Args:
        name: A ``loss_type`` of :data:`LOSS_TYPES`.
        **options: Any of :data:`OPTION_DEFAULTS`'s names.

    Raises:
        ValueError: unknown ``name`` or an option name outside :data:`OPTION_DEFAULTS`.
    """
    if name not in LOSS_TYPES:
        raise ValueError(f"loss_type={name!r} is not supported; valid: {list(LOSS_TYPES)}")
    unknown = sorted(set(options) - set(OPTION_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown loss option(s) {unknown}; valid: {list(OPTION_DEFAULTS)}")
    cls = LOSS_TYPES[name]
    return cls(**{k: v for k, v in options.items() if k in cls.reads()})


def importance_weights(log_ratio: Tensor, completion_mask: Tensor, level: str = "token") -> Tensor:
    """``exp`` of the per-token log-ratio (``token``) or of its mean over counted tokens (``sequence``, GSPO).

    Args:
        log_ratio: ``[N, L]`` float32 nats, ``log pi_theta - log pi_old``.
        completion_mask: ``[N, L]`` bool, True = counted.
        level: ``token`` or ``sequence`` (TRL ``importance_sampling_level``; GSPO paper).

    Returns:
        ``[N, L]`` or ``[N, 1]`` float32, differentiable.

    Raises:
        ValueError: unknown ``level``.
    """
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        mask = completion_mask.to(log_ratio.dtype)
        return torch.exp(((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1))
    raise ValueError(f"importance_sampling_level={level!r} is not supported; valid: {list(IMPORTANCE_SAMPLING_LEVELS)}")
