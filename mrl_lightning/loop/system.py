"""MutualRL: the LightningModule that holds every policy and the shared verifiers.

Policies are listed in YAML, one ``class_path`` each, and held in an ``nn.ModuleDict``
by name. Rewards are computed on text by the reward functions (docs/grpo.md), so they
are the same for every policy; ``success`` comes only from a *strict* verifier
(success = reward >= tau from a verifier that checked it; docs/grpo.md).
"""

from __future__ import annotations

import contextlib

import lightning.pytorch as pl
import torch

from mrl_lightning.update.batch import ScoredRollouts
from mrl_lightning.errors import ConfigError
from mrl_lightning.mwra.rng import sampling_rng
from mrl_lightning.objectives.grpo import combine_rewards
from mrl_lightning.policy.module import PolicyModule
from mrl_lightning.policy.sampling import sample
from mrl_lightning.rewards import ReasoningGymAccuracy, RewardFunction, checked_rewards
from mrl_lightning.rollout.base import RolloutEngine
from mrl_lightning.rollout.hf_generate import HFGenerateEngine
from mrl_lightning.builders.engines import build_vllm_engine


class MutualRL(pl.LightningModule):
    """Several policies trained together.

    Args:
        policies: Two or more policies with unique names (one is allowed for a
            single-policy GRPO baseline).
        reward_funcs: Verifiers whose weighted sum is the reward (TRL ``reward_funcs``);
            default: reasoning-gym strict accuracy.
        reward_weights: One weight per reward function (TRL ``reward_weights``).
        success_threshold: tau; a completion is a success when the strict verifier's
            reward >= tau (docs/grpo.md).
        success_verifier: Name of the strict reward function that decides success;
            None = the first strict one.

    Raises:
        ConfigError: no policies, duplicate names, an empty ``reward_funcs``, weights of the wrong length, a
            ``success_threshold`` outside (0, 1], or no strict verifier (all reported at once).
    """

    def __init__(
        self,
        policies: list[PolicyModule],
        reward_funcs: list[RewardFunction] | None = None,
        reward_weights: list[float] | None = None,
        success_threshold: float = 1.0,
        success_verifier: str | None = None,
    ) -> None:
        super().__init__()
        empty = reward_funcs is not None and not list(reward_funcs)  # [] was replaced by the default, unrecorded
        reward_funcs = [ReasoningGymAccuracy()] if reward_funcs is None else list(reward_funcs)
        errors = []
        if empty:
            errors.append("model.reward_funcs is empty; list at least one reward function, or leave the key out "
                          "for reasoning-gym's strict accuracy (ReasoningGymAccuracy).")
        if not policies:
            errors.append("model.policies is empty; list at least one PolicyModule.")
        names = [p.policy_name for p in policies]
        if len(set(names)) != len(names):
            errors.append(f"model.policies names must be unique; got {names}.")
        if reward_weights is not None and len(reward_weights) != len(reward_funcs):
            errors.append(f"model.reward_weights has {len(reward_weights)} entries for {len(reward_funcs)} "
                          "reward functions; give one weight per function.")
        strict = [f for f in reward_funcs if f.strict]
        if success_verifier is not None:
            strict = [f for f in strict if f.name == success_verifier]
        if not 0.0 < success_threshold <= 1.0:  # NaN fails too
            errors.append(f"model.success_threshold={success_threshold} must be in (0, 1]: rewards are in [0, 1] "
                          "(a strict verifier's 1.0 is an exactly right answer), so above 1 no completion is ever a "
                          "success and at 0 every one is; e.g. --model.success_threshold 1.0.")
        if not strict and not empty:
            errors.append(f"model: no strict reward function named {success_verifier!r} to decide success; "
                          f"strict ones: {[f.name for f in reward_funcs if f.strict]}.")
        if errors:
            raise ConfigError("Invalid model config:\n  - " + "\n  - ".join(errors))
        self.policies = torch.nn.ModuleDict({p.policy_name: p for p in policies})
        self.reward_funcs = reward_funcs
        self.reward_weights = torch.tensor(reward_weights or [1.0] * len(reward_funcs), dtype=torch.float32)
        self.success_threshold = success_threshold
        self.verifier = strict[0]
        self.verifier_index = reward_funcs.index(self.verifier)
        self.engine: RolloutEngine = HFGenerateEngine()
        self.engines: dict[str, RolloutEngine] = {}  # policy name -> its vLLM engine, built at its first rollout

    def engine_for(self, policy: PolicyModule, prompts_per_rank: int) -> RolloutEngine:
        """The rollout engine of ``policy``: the shared Hugging Face engine, or its own vLLM engine.

        A vLLM engine is built at the policy's first rollout, after every model of this
        process is built (its memory share counts them; docs/rollout.md). Put an engine in
        ``engines[name]`` beforehand to use another one (tests use an in-process double).

        Raises:
            ConfigError: the vLLM engine cannot be placed (see
                :func:`~mrl_lightning.builders.engines.build_vllm_engine`).
        """
        if policy.rollout_engine != "vllm":
            return self.engine
        name = policy.policy_name
        if name not in self.engines:
            mine = [p for p in self.policies.values() if p.model is not None]
            self.engines[name] = build_vllm_engine(policy, mine, prompts_per_rank)
        return self.engines[name]

    def score(self, completions: list[str], items: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Score texts with every reward function.

        Returns:
            ``([N, F] rewards per function, [N] combined reward, [N] bool success)``.
        """
        cols = [checked_rewards(f, completions, items) for f in self.reward_funcs]  # RewardError on bad values
        per_func = torch.stack(cols, dim=1)
        success = per_func[:, self.verifier_index] >= self.success_threshold  # NaN compares False
        return per_func, combine_rewards(per_func, self.reward_weights), success

    @torch.no_grad()
    def rollout(self, policy: PolicyModule, items: list, seed: int | None = None,
                prompt_seeds: list[int] | None = None) -> ScoredRollouts:
        """One policy's rollouts (docs/loop.md steps 2-3): render, sample G each, verify.

        Args:
            policy: The policy (its model must be built).
            items: The B prompts.
            seed: Seed of this call's own sampling stream (:func:`mrl_lightning.mwra.sampling_rng`:
                every generator is restored afterwards); None samples from the process's stream.
            prompt_seeds: One seed per item: each prompt's completions are drawn from its own
                seed, whatever else this call samples (the loop keys them by the prompt's place in
                the step's batch, so the rank that samples it does not matter); None = drawn from
                the stream above.
        """
        with sampling_rng(seed) if seed is not None else contextlib.nullcontext():  # a first vLLM build too
            engine = self.engine_for(policy, len(items))
            prompts, out = sample(policy, engine, items, policy.num_generations, prompt_seeds=prompt_seeds,
                                  check_finite=True)
        repeated = [x for x in items for _ in range(policy.num_generations)]
        per_func, rewards, success = self.score(out.completion_texts, repeated)
        shape = (len(items), policy.num_generations)
        return ScoredRollouts(policy.policy_name, items, out, per_func, rewards.view(shape),
                              success.view(shape), prompts, per_func[:, self.verifier_index])

    @torch.no_grad()
    def greedy_success(self, policy: PolicyModule, items: list) -> tuple[float, list[str]]:
        """Share of ``items`` solved by greedy decoding, and the completions."""
        _, out = sample(policy, self.engine_for(policy, len(items)), items, 1, greedy=True)
        _, _, success = self.score(out.completion_texts, items)
        return float(success.float().mean()), out.completion_texts

    @torch.no_grad()
    def sampled_success(self, policy: PolicyModule, items: list, num_samples: int, seed: int) -> float:
        """Mean success of ``num_samples`` completions per item at the policy's sampling settings.

        This is the expected reward GRPO optimizes, estimated on held-out prompts; it is far
        less noisy than greedy success on the same prompts. Sampling runs in its own stream
        seeded by ``seed`` (:func:`mrl_lightning.mwra.sampling_rng`, which restores the CPU
        generator and every CUDA device's), so evaluation neither consumes nor reseeds any
        training stream (resume stays exact) and is reproducible.
        """
        with sampling_rng(seed):
            scored = self.rollout_n(policy, items, num_samples)
        return float(scored.float().mean())

    def rollout_n(self, policy: PolicyModule, items: list, num_samples: int,
                  prompt_seeds: list[int] | None = None) -> torch.Tensor:
        """``[B, num_samples]`` bool success of sampled completions (``prompt_seeds``: as :meth:`rollout`)."""
        _, out = sample(policy, self.engine_for(policy, len(items)), items, num_samples, prompt_seeds=prompt_seeds)
        repeated = [x for x in items for _ in range(num_samples)]
        _, _, success = self.score(out.completion_texts, repeated)
        return success.view(len(items), num_samples)
