"""Rollouts sampled while the update runs (``trainer.async_rollouts``; docs/mwra.md, "Rollouts during the update").

With ``async_rollouts`` the step that trains a batch also samples the next one, on a thread of its own, from
each policy's *sampler view*: the same policy with a copy of its model, refreshed from the weights just before
the update starts, and a copy of its tokenizer (a fast tokenizer is not safe to share between threads). The
update and the sampling overlap; every batch is therefore sampled one update earlier than without it, so it is
``max_lag + 1`` updates old when it is trained (TRL's ``max_staleness``), re-scored by the update and corrected
by the truncated importance ratio to the sampler (``vllm_importance_sampling_*``), as a lag's batches are.

What a batch holds does not depend on timing: the thread reads only its copies, draws only from the per-prompt
seeds (never the process's random stream, which the update's own stream forks), and the loop joins it before
the batch is read, before an evaluation and before a checkpoint, which holds the batch sampled ahead (it came
from weights no checkpoint keeps). ``MRL_ASYNC_ROLLOUTS_INLINE=1`` runs the same sampling before the update
instead of beside it: the same results, no overlap (the reference of the tests and of ``benchmarks/pace.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import threading
import time
import types
from typing import Any

import torch

from mrl_lightning.errors import ConfigError
from mrl_lightning.loop.dynamic_sampling import sample_until_full
from mrl_lightning.loop.pace import _shard_key, scored_from_state, scored_state
from mrl_lightning.loop.reporting import rollout_metrics
from mrl_lightning.mwra import stream_seed
from mrl_lightning.run.checkpoint import CheckpointError
from mrl_lightning.update.policy_update import mark_for_rescoring, sampling_precision

INLINE_ENV = "MRL_ASYNC_ROLLOUTS_INLINE"
FULL_PRECISION = ("32-true", "32", "64-true", "64")


def async_errors(async_rollouts: bool, policies: dict) -> list[str]:
    """Settings ``trainer.async_rollouts`` cannot sample beside the update (one line each)."""
    if not async_rollouts:
        return []
    why = {"filter_groups": "DAPO's dynamic sampling counts its extra prompts over every rank while it samples",
           "fsdp": "a sharded model has no whole copy to sample from",
           "vllm": "the vLLM engine samples from weights of its own"}
    found = [(name, key) for name, p in policies.items() for key, on in (
        ("filter_groups", p.filter_groups), ("fsdp", p.fsdp), ("vllm", p.rollout_engine == "vllm")) if on]
    return [f"trainer.async_rollouts=true samples beside the update, but policy {name!r} has "
            f"{'rollout_engine: vllm' if key == 'vllm' else key + ': true'} ({why[key]}); set "
            f"--trainer.async_rollouts false, or change that policy." for name, key in found] + [
        f"trainer.async_rollouts=true trains each batch an update after the weights that sampled it, but policy "
        f"{name!r} has vllm_importance_sampling_correction: false (nothing would correct for it); set it to true "
        "(the default) or --trainer.async_rollouts false (docs/mwra.md, \"Rollouts during the update\")."
        for name, p in policies.items() if not getattr(p, "vllm_importance_sampling_correction", True)]


def sample_batch(trainer, model, datamodule, items: list, rollout_step: int | str, policies: dict) -> tuple:
    """Sample and score this rank's share of batch ``rollout_step + 1`` for each of ``policies``.

    Args:
        trainer: The :class:`~mrl_lightning.loop.trainer.MRLTrainer` (its workers, fabric, precision, seed).
        model: The :class:`~mrl_lightning.loop.system.MutualRL` system (rollouts, verifiers).
        datamodule: The prompt data module (extra prompts of dynamic sampling).
        items: The batch's prompts.
        rollout_step: Rollout phases done before this batch (its seeds' step), or a solo step's key
            ``"solo/<round>/<index>"`` (:func:`mrl_lightning.loop.policy_step.solo_steps`).
        policies: Name -> the policy, or its sampler view (:class:`Prefetch`), for this rank's policies.

    Returns:
        ``(items, {policy: ScoredRollouts}, {policy: kept groups}, metrics, {policy: extra prompts})``.
    """
    w, seed = trainer.workers, trainer._run_seed()
    scored, keep, extra, metrics = {}, {}, {}, {}
    for name, policy in policies.items():
        t0 = time.perf_counter()
        positions = w.shard_indices(name, len(items))  # keyed by its place in the batch, not the rank
        seeds = [stream_seed(seed, name, "rollout", rollout_step, b) for b in positions]
        view = policy is not model.policies[name]  # a sampler view on its own thread: no process-wide stream
        with sampling_precision(trainer.fabric, [policy]):
            scored[name] = model.rollout(policy, [items[b] for b in positions], prompt_seeds=seeds,
                                         seed=None if view else stream_seed(seed, name, "rollout", rollout_step))
            if policy.filter_groups:  # DAPO's dynamic sampling: its own extra generation batches
                scored[name], keep[name], more, extra[name] = sample_until_full(
                    model, policy, datamodule, w, items, scored[name], run_seed=seed, rollout_step=rollout_step)
                metrics.update(more)
        if trainer.precision not in FULL_PRECISION or view:  # the update re-scores in its own precision/weights
            mark_for_rescoring(scored[name].rollouts)
        metrics.update(rollout_metrics(scored[name], policy))
        elapsed = time.perf_counter() - t0
        metrics[f"rollout/{name}/gen_time_s"] = metrics[f"mwra/{name}/rollout_s"] = elapsed
        tokens = float(scored[name].rollouts.completion_mask.sum())
        metrics[f"mwra/{name}/rollout_tokens_per_s"] = tokens / max(elapsed, 1e-9)
    return items, scored, keep, metrics, extra


class Prefetch:
    """The batch sampled ahead, on a thread beside the update (``trainer.async_rollouts``; module docstring).

    Args:
        enabled: ``trainer.async_rollouts``.
        device: This rank's device (a CUDA device samples on a stream of its own).
    """

    def __init__(self, enabled: bool, device=None) -> None:
        self.enabled, self.device = bool(enabled), device
        self.inline = os.environ.get(INLINE_ENV, "") == "1"
        self._copies: dict[str, tuple[torch.nn.Module, Any]] = {}  # name -> (model copy, tokenizer copy)
        self._thread: threading.Thread | None = None
        self._result: tuple | None = None
        self._error: BaseException | None = None
        self._stream = None
        self.batch: int | None = None  # the batch sampled ahead (1-based), while one is
        self.sampled_after = 0  # updates done when it was sampled
        self._views: dict[str, Any] = {}  # the sampler views of the batch being sampled, and their policies
        self._policies: dict[str, Any] = {}

    def views(self, policies: dict) -> dict:
        """Each policy's sampler view, its model copy refreshed with the policy's weights now."""
        out = {}
        for name, policy in policies.items():
            if name not in self._copies:
                model = copy.deepcopy(policy.model)
                for p in model.parameters():
                    p.grad = None
                    p.requires_grad_(False)
                self._copies[name] = (model, copy.deepcopy(policy.tokenizer))
            model, tokenizer = self._copies[name]
            with torch.no_grad():
                torch._foreach_copy_(list(model.parameters()), list(policy.model.parameters()))
                for mine, theirs in zip(model.buffers(), policy.model.buffers()):
                    mine.copy_(theirs)
            policy.sampling_beside_update = True  # the update picks no attention kernel (a process-wide choice)
            view = copy.copy(policy)  # the policy's settings now; its own module table, model and tokenizer
            view._modules = dict(policy._modules)
            view._modules["model"] = model
            view.tokenizer = tokenizer
            view.prompts_truncated = 0  # counted here, added to the policy's when the batch is taken
            out[name] = view
        return out

    def start(self, trainer, model, datamodule) -> None:
        """Draw the next batch's prompts and start sampling it beside the update about to run."""
        w = trainer.workers
        items = datamodule.next_batch()
        self._policies = {name: model.policies[name] for name in w.local_policies}
        self._views = views = self.views(self._policies)
        self.batch, self.sampled_after = trainer.rollout_step + 1, trainer.global_step
        args = (trainer, model, datamodule, items, trainer.rollout_step, views)
        if self.inline:
            self._run(args)
            return
        if self.device is not None and getattr(self.device, "type", "") == "cuda":
            self._stream = self._stream or torch.cuda.Stream(self.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the weights just copied
        self._thread = threading.Thread(target=self._run, args=(args,), name=f"mrl-sampler-{self.batch}", daemon=True)
        self._thread.start()

    def _run(self, args: tuple) -> None:
        try:
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    self._result = sample_batch(*args)
            else:
                self._result = sample_batch(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the loop's thread by join()
            self._error = exc

    def join(self) -> float:
        """Wait for the batch being sampled (if any); seconds waited. Raises what the sampling raised."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self._stream is not None:  # the loop's stream waits for the batch, and the allocator for the loop
                main = torch.cuda.current_stream(self.device)
                main.wait_stream(self._stream)
                for one in (self._result[1] if self._result is not None else {}).values():
                    for value in [*vars(one).values(), *vars(one.rollouts).values()]:
                        if isinstance(value, torch.Tensor) and value.is_cuda:
                            value.record_stream(main)
        if self._error is not None:
            error, self._error, self.batch, self._result = self._error, None, None, None
            raise error
        return time.perf_counter() - t0

    def take(self, batch: int) -> tuple | None:
        """The batch sampled ahead, if it is ``batch``: :func:`sample_batch`'s tuple and ``pace/sampler_wait_s``."""
        if self.batch != batch:
            return None
        waited = self.join()
        result, self.batch, self._result = self._result, None, None
        for name, view in self._views.items():  # what the view counted (checks.check_prompt_lengths), the policy's
            policy = self._policies[name]
            policy.prompts_truncated = getattr(policy, "prompts_truncated", 0) + view.prompts_truncated
            policy._warned_prompt_truncation = getattr(view, "_warned_prompt_truncation", False) or getattr(
                policy, "_warned_prompt_truncation", False)
        self._views = {}
        result[3]["pace/sampler_wait_s"] = waited
        return result

    # ------------------------------------------------------------- checkpoints
    def counters(self, workers) -> dict[str, Any]:
        """What a checkpoint adds: the setting and the batch sampled ahead, every rank's share (a collective)."""
        if not self.enabled:
            return {}
        self.join()
        mine = {}
        if self.batch is not None:
            items, scored = self._result[:2]
            mine = {_shard_key(workers, name): scored_state(one) for name, one in scored.items()}
            mine.update({f"{_shard_key(workers, name)}/prompts_truncated_share": float(
                getattr(self._views.get(name), "last_prompts_truncated_share", 0.0)) for name in scored})
            mine["items"] = [dataclasses.asdict(item) for item in items] if workers.rank == 0 else None
        parts: dict[str, Any] = {}
        for part in workers.gather_to_zero(mine, "checkpoint") or []:
            parts.update({key: value for key, value in part.items() if value is not None})
        return {"async_rollouts": True, "prefetched": {"batch": self.batch, "sampled_after": self.sampled_after,
                                                       "parts": parts} if self.batch is not None else {}}

    def load(self, counters: dict[str, Any], workers, device=None, max_steps: int = 0, note=print) -> None:
        """Take the batch sampled ahead from a checkpoint's counters (its ``rollout/*`` scalars computed again; its
        timings are not kept). A checkpoint at the end of its run holds none: the run extended from it samples its
        next batch from the weights after the last update, not before, so it differs from a run that was that
        long from the start (``note`` says so).

        Raises:
            CheckpointError: it was sampled on another number of ranks for a policy of this rank.
        """
        if self.enabled and not counters.get("prefetched") and int(counters.get("rollout_step", 0)) < max_steps:
            note(f"note: this checkpoint ended its run (trainer.async_rollouts samples nothing ahead at the last "
                 f"step): batch {int(counters.get('rollout_step', 0)) + 1} is sampled by the weights after update "
                 f"{counters.get('global_step')}, so this run is not the run that was {max_steps} steps long from "
                 "the start (docs/mwra.md, \"Rollouts during the update\").")
        from mrl_lightning.data.items import PromptItem
        from mrl_lightning.loop.pace import _shard_key, scored_from_state

        ahead = counters.get("prefetched") or {}
        if not ahead:
            return
        scored = {}
        for name in workers.local_policies:
            key = _shard_key(workers, name)
            if key not in ahead["parts"]:
                raise CheckpointError(f"the checkpoint holds batch {ahead['batch']} of {name!r} sampled ahead on another "
                                      f"placement (no part {key!r}); resume on the placement it was written with.")
            scored[name] = scored_from_state(ahead["parts"][key], device)
        items = [PromptItem(**item) for item in ahead["parts"]["items"]]
        self.batch, self.sampled_after = int(ahead["batch"]), int(ahead["sampled_after"])
        metrics = {}
        for name, one in scored.items():
            share = ahead["parts"].get(f"{_shard_key(workers, name)}/prompts_truncated_share", 0.0)
            metrics.update(rollout_metrics(one, types.SimpleNamespace(last_prompts_truncated_share=share)))
        self._result = (items, scored, {}, metrics, {})


def check_resume_async(counters: dict[str, Any], async_rollouts: bool, path: str | None) -> None:
    """Refuse, before any model is built, a checkpoint written with the other ``async_rollouts``.

    Raises:
        ConfigError: naming the setting, its value and the fix.
    """
    saved = bool(counters.get("async_rollouts", False))
    if saved != bool(async_rollouts):
        raise ConfigError(f"trainer.async_rollouts={str(async_rollouts).lower()}, but {path} was written with "
                          f"async_rollouts={str(saved).lower()}: which weights sample each batch depends on it. "
                          f"Resume with --trainer.async_rollouts {str(saved).lower()}.")
