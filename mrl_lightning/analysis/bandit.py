"""The tabular contextual bandit of docs/bandit.md: problem, policies, sampling and THL residual.

Objective. A finite stand-in for Mutual RL where every quantity the probes touch can be
computed exactly or sampled cheaply: contexts ``x`` (prompts), actions ``y`` (whole
completions), a verifier reward ``r(x, y)`` in {0, 1}, and two softmax policies
("families" A and B) with one logits table each. Family A starts good on the first half
of the contexts and near-zero on the second; family B the reverse (each good where the
other is weak).

How it departs from the LM setting, on purpose:

- A completion is one action, so token-level and sequence-level importance weights
  (PRP ``is_level``) coincide, and ``mu = 1`` on-policy steps make the PPO ratio 1 and the
  clip inactive for own samples: the GRPO update is the score-function estimator
  ``A_k * grad log pi(y_k | x)`` (docs/grpo.md with ``rho_t = 1``, ``beta = 0``).
- The logits table is the parameter, so ``grad_logits log pi(y | x) = onehot(y) - pi(. | x)``
  and each context's row is touched only by that context's samples.
- The THL residual (docs/thl.md) is modelled as the probability ``p`` that a transferred action
  arrives corrupted: replaced by an action drawn uniformly from all ``K`` (it may by chance
  be the original). The reward and the source's sampling log-prob travel with the record
  unchanged, since both were computed on the source side (docs/see.md).

Shapes: ``N`` contexts, ``K`` actions, ``G`` own samples per context, ``M`` peer samples
per context; ``...`` is any leading batch shape (Monte-Carlo draws, training replicas,
the policy axis of size 2). Probabilities are float64; log-probs are in nats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FAMILIES = ("A", "B")


@dataclass(frozen=True)
class BanditProblem:
    """A two-family contextual bandit with its initial policies.

    Attributes:
        reward: ``[N, K]`` float64 in {0, 1}: the verifier's reward for action ``y`` in context ``x``.
        init_logits: ``[2, N, K]`` float64: initial logits of families A (index 0) and B (index 1).
        weak: ``[2, N]`` bool, True = the context is in that family's weak half (near-zero
            initial mass on correct actions; the peer is strong there).
    """

    reward: np.ndarray
    init_logits: np.ndarray
    weak: np.ndarray

    @property
    def num_contexts(self) -> int:
        """Number of contexts ``N``."""
        return int(self.reward.shape[0])

    @property
    def num_actions(self) -> int:
        """Number of actions ``K``."""
        return int(self.reward.shape[1])


def make_problem(
    num_contexts: int,
    num_actions: int,
    *,
    seed: int,
    correct_per_context: int = 1,
    strong_prob: float = 0.9,
    weak_prob: float = 1e-3,
    logit_noise: float = 1.0,
) -> BanditProblem:
    """Builds the bandit and the two families' initial policies.

    Each context gets ``correct_per_context`` distinct correct actions chosen at random.
    Family A puts total mass ``strong_prob`` on the correct set of contexts
    ``x < N // 2`` and ``weak_prob`` on it elsewhere; family B the reverse. Inside the
    correct set and inside the wrong set, mass is split by ``softmax(logit_noise * z)`` with
    ``z ~ N(0, 1)``, so wrong actions are not uniform (a policy has favourite mistakes).

    Args:
        num_contexts: ``N``, at least 2 and even.
        num_actions: ``K``, greater than ``correct_per_context``.
        seed: Seed of the problem's own random stream (correct actions and logit noise).
        correct_per_context: Correct actions per context (reward 1), at least 1.
        strong_prob: Initial mass on correct actions in a family's strong half, in (0, 1).
        weak_prob: Initial mass on correct actions in its weak half, in (0, strong_prob).
        logit_noise: Standard deviation of the within-set logit noise, >= 0.

    Returns:
        The :class:`BanditProblem`.

    Raises:
        ValueError: an argument is outside the range given above (the message names it).
    """
    problems = []
    if num_contexts < 2 or num_contexts % 2:
        problems.append(f"num_contexts={num_contexts} must be an even number >= 2 (two halves)")
    if correct_per_context < 1:
        problems.append(f"correct_per_context={correct_per_context} must be >= 1")
    if num_actions <= correct_per_context:
        problems.append(
            f"num_actions={num_actions} must exceed correct_per_context={correct_per_context} "
            "so that wrong actions exist"
        )
    if not 0.0 < strong_prob < 1.0:
        problems.append(f"strong_prob={strong_prob} must be in (0, 1)")
    if not 0.0 < weak_prob < strong_prob:
        problems.append(f"weak_prob={weak_prob} must be in (0, strong_prob={strong_prob})")
    if logit_noise < 0:
        problems.append(f"logit_noise={logit_noise} must be >= 0")
    if problems:
        raise ValueError("make_problem: " + "; ".join(problems))

    rng = np.random.default_rng(np.random.SeedSequence([seed, 7001]))
    n, k = num_contexts, num_actions
    reward = np.zeros((n, k))
    for x in range(n):
        reward[x, rng.choice(k, size=correct_per_context, replace=False)] = 1.0
    correct = reward > 0
    half = np.arange(n) < n // 2
    weak = np.stack([~half, half])  # A weak on the second half, B on the first
    logits = np.empty((2, n, k))
    for i in range(2):
        noise = logit_noise * rng.standard_normal((n, k))
        mass = np.where(weak[i], weak_prob, strong_prob)[:, None]
        within_correct = _masked_softmax(noise, correct)
        within_wrong = _masked_softmax(noise, ~correct)
        probs = mass * within_correct + (1.0 - mass) * within_wrong
        logits[i] = np.log(probs)
    return BanditProblem(reward=reward, init_logits=logits, weak=weak)


def _masked_softmax(z: np.ndarray, mask: np.ndarray) -> np.ndarray:
    z = np.where(mask, z, -np.inf)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax over the last axis.

    Args:
        logits: ``[..., K]`` float64.

    Returns:
        ``[..., K]`` float64 probabilities summing to 1 over the last axis.
    """
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax over the last axis.

    Args:
        logits: ``[..., K]`` float64.

    Returns:
        ``[..., K]`` float64 log-probabilities, nats.
    """
    z = logits - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def sample_actions(
    probs: np.ndarray, num_samples: int, rng: np.random.Generator, batch: tuple[int, ...] = ()
) -> np.ndarray:
    """Draws ``num_samples`` actions per row by inverse-CDF sampling.

    Args:
        probs: ``[..., N, K]`` float64 probabilities.
        num_samples: Samples per row, ``G``.
        rng: Random generator (consumed: one uniform per sample).
        batch: Extra leading shape of independent draws from the same ``probs``
            (Monte-Carlo draws without copying the policy).

    Returns:
        ``[*batch, ..., N, G]`` int64 action indices.
    """
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random(tuple(batch) + probs.shape[:-1] + (num_samples,))
    # Number of CDF entries strictly below u == sampled index; clip guards rounding at 1.
    idx = (u[..., :, None] >= cdf[..., None, :]).sum(axis=-1)
    return np.minimum(idx, probs.shape[-1] - 1)


def gather_last(table: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``table[..., n, index[..., n, g]]``: per-row lookup of sampled actions.

    Args:
        table: ``[..., N, K]`` any dtype (probabilities, log-probs, rewards).
        index: ``[..., N, G]`` int64 action indices; leading shape broadcastable to ``table``'s.

    Returns:
        ``[..., N, G]`` values of ``table`` at those actions.
    """
    lead = np.broadcast_shapes(table.shape[:-2], index.shape[:-2])
    table = np.broadcast_to(table, lead + table.shape[-2:])
    index = np.broadcast_to(index, lead + index.shape[-2:])
    return np.take_along_axis(table, index, axis=-1)


def corrupt(
    actions: np.ndarray, residual: float, num_actions: int, rng: np.random.Generator
) -> np.ndarray:
    """The THL residual: each transferred action is replaced by a uniform one with prob ``residual``.

    Always consumes two arrays of random numbers of ``actions``' shape, whatever
    ``residual`` is, so runs that differ only in ``residual`` share their other draws.

    Args:
        actions: ``[..., N, M]`` int64 actions as the source sampled them.
        residual: Corruption probability ``p`` in [0, 1].
        num_actions: ``K``.
        rng: Random generator.

    Returns:
        ``[..., N, M]`` int64 actions as they arrive at the receiver.

    Raises:
        ValueError: ``residual`` is outside [0, 1].
    """
    if not 0.0 <= residual <= 1.0:
        raise ValueError(f"residual={residual} must be a probability in [0, 1]")
    hit = rng.random(actions.shape) < residual
    replacement = rng.integers(0, num_actions, size=actions.shape)
    return np.where(hit, replacement, actions)


def expected_reward(logits: np.ndarray, reward: np.ndarray) -> np.ndarray:
    """Exact expected reward per context, ``sum_y pi(y | x) r(x, y)``.

    Since rewards are {0, 1}, this is also the probability mass on correct actions: the
    "support" of docs/bandit.md.

    Args:
        logits: ``[..., N, K]`` float64.
        reward: ``[N, K]`` float64 in {0, 1}.

    Returns:
        ``[..., N]`` float64 in [0, 1].
    """
    return (softmax(logits) * reward).sum(axis=-1)


def half_means(per_context: np.ndarray, weak: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Means over each family's weak and strong contexts.

    Args:
        per_context: ``[..., 2, N]`` float64, one row per family.
        weak: ``[2, N]`` bool, True = weak context of that family.

    Returns:
        ``(weak_mean, strong_mean)``, each ``[..., 2]`` float64.
    """
    w = weak.astype(float)
    weak_mean = (per_context * w).sum(-1) / w.sum(-1)
    strong_mean = (per_context * (1 - w)).sum(-1) / (1 - w).sum(-1)
    return weak_mean, strong_mean
