"""Sampling, training and Monte-Carlo measurement of each probe on the bandit (docs/bandit.md).

One stochastic update of a probe: both families sample ``G`` actions per context from
their current policies; the verifier scores them; transferred actions pass the THL
residual (PRP, SGT; XGRPO moves scalars only); each family applies its probe's update
rule from :mod:`mrl_lightning.analysis.updates` as receiver, with the other as peer.

Measured, for every probe:

- stability: ``E ||U - E U||^2`` (per context, summed over actions, mean over families) by
  Monte Carlo, with its standard error; share of draws whose step ``theta + lr * U``
  lowers the family's exact expected reward.
- the expected update ``E U``: its norm, cosine to the exact gradient of the expected
  reward, and its mean push on the correct logit of weak contexts.
- support and success over training: exact expected reward (= mass on correct actions)
  per family on its weak and strong halves, averaged over replicas, every step.

Common random numbers: every probe uses the same seeds, so arms differ by their rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mrl_lightning.analysis.bandit import (
    FAMILIES,
    BanditProblem,
    corrupt,
    expected_reward,
    gather_last,
    half_means,
    log_softmax,
    make_problem,
    sample_actions,
    softmax,
)
from mrl_lightning.analysis.config import BanditConfig, ProbeSpec
from mrl_lightning.analysis.updates import (
    grpo_update,
    prp_update,
    sgt_update,
    xgrpo_update,
)

_LOWER_TOL = 1e-12  # an expected-reward change below -tol counts as "lowered"
_MC_CHUNK = 500


@dataclass(frozen=True)
class Draw:
    """One sampling round of both families, seen from each family as receiver.

    Policy axis (size 2) sits just before ``N``; ``peer_*`` arrays are the other family's
    samples aligned to the receiver (family 0 receives family 1's and vice versa).

    Attributes:
        probs: ``[..., 2, N, K]`` float64 current policies.
        actions: ``[..., 2, N, G]`` int64 own samples.
        rewards: ``[..., 2, N, G]`` float64 their rewards.
        peer_source: ``[..., 2, N, M]`` int64 peer actions as sampled.
        peer_arrived: ``[..., 2, N, M]`` int64 peer actions after the THL residual.
        peer_rewards: ``[..., 2, N, M]`` float64 peer rewards.
        peer_logp: ``[..., 2, N, M]`` float64 nats, peer sampling log-probs.
    """

    probs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    peer_source: np.ndarray
    peer_arrived: np.ndarray
    peer_rewards: np.ndarray
    peer_logp: np.ndarray


def draw_samples(
    logits: np.ndarray, problem: BanditProblem, cfg: BanditConfig, rng: np.random.Generator,
    batch: tuple[int, ...] = (),
) -> Draw:
    """Samples both families' groups and the transfers between them.

    Args:
        logits: ``[..., 2, N, K]`` float64.
        problem: The bandit.
        cfg: Settings (``group_size``, ``peer_samples``, ``residual``).
        rng: Random generator; consumed identically whatever the probe.
        batch: Extra leading shape of independent draws at the same logits.

    Returns:
        The :class:`Draw`; sample arrays have shape ``[*batch, ..., 2, N, *]``.
    """
    probs = softmax(logits)
    actions = sample_actions(probs, cfg.group_size, rng, batch)
    rewards = gather_last(problem.reward, actions)
    logp = gather_last(log_softmax(logits), actions)
    m = cfg.peer_samples
    peer_source = np.flip(actions[..., :m], axis=-3)
    arrived = corrupt(peer_source, cfg.residual, problem.num_actions, rng)
    return Draw(
        probs=probs, actions=actions, rewards=rewards, peer_source=peer_source,
        peer_arrived=arrived, peer_rewards=np.flip(rewards[..., :m], axis=-3),
        peer_logp=np.flip(logp[..., :m], axis=-3),
    )


def _rule_none(d: Draw, spec: ProbeSpec, cfg: BanditConfig) -> np.ndarray:
    return grpo_update(d.probs, d.actions, d.rewards)


def _rule_prp(d: Draw, spec: ProbeSpec, cfg: BanditConfig) -> np.ndarray:
    return prp_update(
        d.probs, d.actions, d.rewards, d.peer_arrived, d.peer_rewards, d.peer_logp,
        is_mode=spec.is_mode, cap=cfg.is_cap, lambda_prp=cfg.lambda_prp,
    )


def _rule_xgrpo(d: Draw, spec: ProbeSpec, cfg: BanditConfig) -> np.ndarray:
    return xgrpo_update(
        d.probs, d.actions, d.rewards, d.peer_rewards, alpha=cfg.alpha, scale_source=cfg.scale_source
    )


def _rule_sgt(d: Draw, spec: ProbeSpec, cfg: BanditConfig) -> np.ndarray:
    return sgt_update(
        d.probs, d.actions, d.rewards, d.peer_source, d.peer_arrived, d.peer_rewards,
        lambda_sgt=cfg.lambda_sgt if spec.lambda_sgt is None else spec.lambda_sgt, kappa=cfg.kappa, max_demos=cfg.sgt_max_demos,
    )


UPDATE_RULES: dict[str, Callable[[Draw, ProbeSpec, BanditConfig], np.ndarray]] = {
    "none": _rule_none, "prp": _rule_prp, "xgrpo": _rule_xgrpo, "sgt": _rule_sgt,
}


def stochastic_update(
    spec: ProbeSpec, logits: np.ndarray, problem: BanditProblem, cfg: BanditConfig,
    rng: np.random.Generator, batch: tuple[int, ...] = (),
) -> np.ndarray:
    """One stochastic update of both families under ``spec``.

    Args:
        spec: The probe.
        logits: ``[..., 2, N, K]`` float64 current logits.
        problem: The bandit.
        cfg: Settings.
        rng: Random generator.
        batch: Extra leading shape of independent draws at the same logits.

    Returns:
        ``[*batch, ..., 2, N, K]`` float64 ascent directions (apply as ``logits + lr * U``).
    """
    return UPDATE_RULES[spec.kind](draw_samples(logits, problem, cfg, rng, batch), spec, cfg)


def measure_update(
    spec: ProbeSpec, logits: np.ndarray, problem: BanditProblem, cfg: BanditConfig,
    rng: np.random.Generator,
) -> dict[str, float]:
    """Monte-Carlo mean and variance of the update at fixed logits.

    Args:
        spec: The probe.
        logits: ``[2, N, K]`` float64 parameters to measure at.
        problem: The bandit.
        cfg: Settings (``mc_draws``, ``lr``).
        rng: Random generator.

    Returns:
        Floats, all per context (mean over contexts and both families):
        ``variance`` = ``E ||U[x] - E U[x]||^2`` over all contexts, ``variance_se`` its
        Monte-Carlo standard error; ``variance_weak`` / ``variance_weak_se`` and
        ``variance_strong`` on each family's weak / strong contexts; ``share_lowering`` and
        ``share_lowering_weak``: share of (draw, family, context) whose exact expected reward
        falls after ``logits + lr * U``; ``expected_norm`` and ``expected_norm_weak``:
        root-mean-square ``||E U[x]||``; ``noise_to_signal_weak`` =
        ``variance_weak / expected_norm_weak**2``; ``cos_to_gradient``: cosine of ``E U`` to
        the exact gradient of the expected reward; ``weak_push``: mean ``E U[x, y*]`` over
        weak contexts and their correct actions ``y*``.
    """
    chunks = []
    for start in range(0, cfg.mc_draws, _MC_CHUNK):
        d = min(_MC_CHUNK, cfg.mc_draws - start)
        chunks.append(stochastic_update(spec, logits, problem, cfg, rng, (d,)))
    u = np.concatenate(chunks)  # [D, 2, N, K]
    weak = problem.weak  # [2, N]
    mean = u.mean(axis=0)
    dev2 = ((u - mean) ** 2).sum(axis=-1)  # [D, 2, N]
    per_draw = dev2.mean(axis=(-1, -2))  # [D]
    per_draw_weak = ((dev2 * weak).sum(-1) / weak.sum(-1)).mean(-1)  # [D]
    var_strong = ((dev2 * ~weak).sum(-1) / (~weak).sum(-1)).mean()
    before = expected_reward(logits, problem.reward)  # [2, N]
    lowered = (expected_reward(logits + cfg.lr * u, problem.reward) - before) < -_LOWER_TOL
    sq_norm = (mean**2).sum(-1)  # [2, N]
    norm_weak2 = ((sq_norm * weak).sum(-1) / weak.sum(-1)).mean()
    probs = softmax(logits)
    grad = probs * (problem.reward - before[..., None])  # d E[r | x] / d logits[x, :]
    cos = (mean * grad).sum((-1, -2)) / (
        np.linalg.norm(mean.reshape(2, -1), axis=-1) * np.linalg.norm(grad.reshape(2, -1), axis=-1) + 1e-300)
    correct_mean = (mean * problem.reward).sum(-1) / problem.reward.sum(-1)  # [2, N]
    se = np.sqrt(len(per_draw))
    return {
        "variance": float(per_draw.mean()),
        "variance_se": float(per_draw.std(ddof=1) / se),
        "variance_weak": float(per_draw_weak.mean()),
        "variance_weak_se": float(per_draw_weak.std(ddof=1) / se),
        "variance_strong": float(var_strong),
        "share_lowering": float(lowered.mean()),
        "share_lowering_weak": float((lowered * weak).sum() / (lowered.shape[0] * weak.sum())),
        "expected_norm": float(np.sqrt(sq_norm.mean())),
        "expected_norm_weak": float(np.sqrt(norm_weak2)),
        "noise_to_signal_weak": float(per_draw_weak.mean() / max(norm_weak2, 1e-300)),
        "cos_to_gradient": float(cos.mean()),
        "weak_push": float(((correct_mean * weak).sum(-1) / weak.sum(-1)).mean()),
    }


def train(
    spec: ProbeSpec, problem: BanditProblem, cfg: BanditConfig, rng: np.random.Generator,
    measure_at: tuple[int, ...] = (),
) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """``cfg.steps`` SGD steps of ``cfg.replicas`` independent runs under ``spec``.

    Args:
        spec: The probe.
        problem: The bandit.
        cfg: Settings (``steps``, ``lr``, ``replicas``).
        rng: Random generator.
        measure_at: Steps whose replica-0 logits are returned (0 = initial).

    Returns:
        ``(curves, snapshots)``: ``curves`` ``[T + 1, R, 2, 2]`` float64, exact expected
        reward per step, replica, family and half (0 = weak, 1 = strong); ``snapshots``
        maps each step in ``measure_at`` to replica 0's ``[2, N, K]`` logits.
    """
    logits = np.broadcast_to(problem.init_logits, (cfg.replicas,) + problem.init_logits.shape).copy()
    curves = np.empty((cfg.steps + 1, cfg.replicas, 2, 2))
    snapshots = {}
    for t in range(cfg.steps + 1):
        weak_mean, strong_mean = half_means(expected_reward(logits, problem.reward), problem.weak)
        curves[t] = np.stack([weak_mean, strong_mean], axis=-1)
        if t in measure_at:
            snapshots[t] = logits[0].copy()
        if t < cfg.steps:
            logits += cfg.lr * stochastic_update(spec, logits, problem, cfg, rng)
    return curves, snapshots


def checkpoint_steps(cfg: BanditConfig) -> tuple[int, ...]:
    """Evenly spaced measurement steps from 0 to ``steps``, ``cfg.checkpoints`` of them."""
    return tuple(int(s) for s in np.unique(np.linspace(0, cfg.steps, cfg.checkpoints).round()))


def run_probe(spec: ProbeSpec, problem: BanditProblem, cfg: BanditConfig) -> dict:
    """Trains and measures one probe.

    Args:
        spec: The probe.
        problem: The bandit.
        cfg: Settings.

    Returns:
        A JSON-ready dict: the probe's identity, ``init`` (update measured at the shared
        initial logits), ``trajectory`` (one measurement per checkpoint of its own run),
        support and success numbers, and ``curves`` per family and half.
    """
    steps = checkpoint_steps(cfg)
    curves, snaps = train(spec, problem, cfg, np.random.default_rng([cfg.seed, 1]), steps)
    traj = []
    for i, t in enumerate(steps):
        m = measure_update(spec, snaps[t], problem, cfg, np.random.default_rng([cfg.seed, 2, i]))
        traj.append({"step": t, **m})
    mean_curve = curves.mean(axis=1)  # [T + 1, 2, 2]
    weak_final = mean_curve[-1, :, 0]
    hit = mean_curve[:, :, 0] >= cfg.support_threshold  # [T + 1, 2]
    first = [int(np.argmax(hit[:, f])) if hit[:, f].any() else None for f in range(2)]
    return {
        "name": spec.name, "kind": spec.kind, "is_mode": spec.is_mode,
        "lambda_sgt": (cfg.lambda_sgt if spec.lambda_sgt is None else spec.lambda_sgt) if spec.kind == "sgt" else None,
        "init": traj[0],
        "trajectory": traj,
        "variance_trajectory_mean": float(np.mean([m["variance"] for m in traj])),
        "share_lowering_trajectory_mean": float(np.mean([m["share_lowering"] for m in traj])),
        "support_weak_init": dict(zip(FAMILIES, map(float, mean_curve[0, :, 0]))),
        "support_weak_final": dict(zip(FAMILIES, map(float, weak_final))),
        "support_weak_final_mean": float(weak_final.mean()),
        "support_weak_final_replica_std": dict(zip(FAMILIES, map(float, curves[-1, :, :, 0].std(0)))),
        "success_strong_final": dict(zip(FAMILIES, map(float, mean_curve[-1, :, 1]))),
        "steps_to_support": dict(zip(FAMILIES, first)),
        "reaches_support": bool(all(s is not None for s in first) and (weak_final >= cfg.support_threshold).all()),
        "curves": {
            fam: {"weak": mean_curve[:, f, 0].tolist(), "strong": mean_curve[:, f, 1].tolist()}
            for f, fam in enumerate(FAMILIES)
        },
    }


def run_analysis(cfg: BanditConfig) -> dict:
    """The whole analysis: builds the bandit and runs every selected probe.

    Args:
        cfg: Settings (already validated by construction).

    Returns:
        JSON-ready dict with ``config``, ``problem`` (sizes and initial support) and
        ``probes`` (one :func:`run_probe` result per probe, in ``cfg.probes`` order).
    """
    problem = make_problem(
        cfg.num_contexts, cfg.num_actions, seed=cfg.seed, correct_per_context=cfg.correct_per_context,
        strong_prob=cfg.strong_prob, weak_prob=cfg.weak_prob, logit_noise=cfg.logit_noise,
    )
    weak0, strong0 = half_means(expected_reward(problem.init_logits, problem.reward), problem.weak)
    return {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()},
        "problem": {
            "families": list(FAMILIES),
            "weak_contexts": {f: np.flatnonzero(problem.weak[i]).tolist() for i, f in enumerate(FAMILIES)},
            "initial_weak_support": dict(zip(FAMILIES, map(float, weak0))),
            "initial_strong_success": dict(zip(FAMILIES, map(float, strong0))),
        },
        "probes": [run_probe(spec, problem, cfg) for spec in cfg.probe_specs],
    }
