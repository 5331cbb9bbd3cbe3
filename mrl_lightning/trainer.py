"""MRLTrainer: the multi-module Fabric loop running the training step for N policies (docs/loop.md).

One Fabric instance per process. With one process every policy samples and updates in
turn (placement ``colocated``). With several (``--trainer.devices N --trainer.strategy ddp``,
``torchrun``, SLURM), the MWRA placement (docs/mwra.md) decides which policies each rank
runs: the loop asks :class:`~mrl_lightning.mwra.Workers` for this rank's policies and
prompts and never branches on the placement. Callbacks answer named hooks through
``fabric.call`` (see :mod:`mrl_lightning.callbacks.base` for the hook list and order).

Counters are separate and named: ``rollout_step`` (rollout phases done),
``global_step`` (training steps done; ``max_steps`` bounds it; in each every policy makes
``num_iterations`` optimizer steps), ``optimizer_steps[policy]`` and ``samples_seen``
(completions sampled, all policies, all ranks).

Run folder ``<default_root_dir>/version_<n>/``: ``config.yaml`` (resolved config),
TensorBoard events, ``checkpoints/step=<k>.ckpt`` and ``checkpoints/last.ckpt``.
"""

from __future__ import annotations

import os
import shlex
import time
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger

from mrl_lightning.batch import TrainBatch
from mrl_lightning.callbacks.base import MRLCallback
from mrl_lightning.checkpoint import FORMAT_VERSION, CheckpointError, atomic_save, check_compatible, load_checkpoint
from mrl_lightning.errors import ConfigError
from mrl_lightning.mwra import (
    PLACEMENTS,
    Workers,
    build_placement,
    build_plan,
    format_plan,
    model_shape,
    rng_state,
    set_rng_state,
    stream_seed,
    validate_resources,
)
from mrl_lightning.mwra.plan import GIB, process_rss_bytes
from mrl_lightning.mwra.strategy import PolicyGroupsStrategy
from mrl_lightning.objectives.grpo import group_advantages
from mrl_lightning.policy import loss_counts, policy_update
from mrl_lightning.progress import RunProgress
from mrl_lightning.reporting import eval_counts, eval_metrics_from_counts, merge_eval_counts, rollout_metrics

CUMULATIVE = {"train/samples_seen"}
FULL_PRECISION = ("32-true", "32", "64-true", "64")
STRATEGIES = ("auto", "ddp")


class MRLTrainer:
    """Trainer for :class:`~mrl_lightning.system.MutualRL` (LightningCLI ``--trainer.*``).

    Args:
        max_steps: Training steps to run (budgets in steps, not time).
        accelerator: Fabric accelerator ("auto", "cpu", "cuda", ...).
        devices: Processes (devices) per node; each is one MWRA worker.
        num_nodes: Nodes (multi-node runs start through torchrun or SLURM).
        strategy: "auto" (one process, or DDP-style processes when devices > 1) or "ddp".
            Multi-process runs use :class:`~mrl_lightning.mwra.strategy.PolicyGroupsStrategy`
            (Fabric's DDP launch and process group; gradients reduced per policy group).
        precision: Fabric precision ("32-true", "bf16-mixed", ...).
        placement: "colocated" (every policy on every rank, in turn), "disjoint" (one group
            of ranks per policy, running at the same time) or "auto" (disjoint when the
            ranks split evenly over the policies); docs/mwra.md.
        policy_ranks: Ranks per policy for "disjoint", e.g. ``{gpt2: 1, llama: 1}``;
            None splits the ranks evenly.
        collective_timeout_s: A rank blocked this long in a collective (another rank
            failed or hangs) ends the run with an error naming the rank and phase. Must
            exceed the longest warm-start, since ranks wait for each other's.
        default_root_dir: Runs are written to ``<default_root_dir>/version_<n>``.
        callbacks: SEE, probes and other hooks, called in list order.
        log_every_n_steps: Scalars are averaged over and logged every this many steps.
        eval_every_n_steps: Evaluation on held-out prompts (also at start and end).
        checkpoint_every_n_steps: Checkpoint period (also at the end); 0 = only at the end.
        keep_checkpoints: How many ``step=*.ckpt`` files to keep (``last.ckpt`` always).
        compress_checkpoints: gzip the checkpoint files (lossless, resume stays exact; ~11%
            smaller for float32 weights and AdamW moments, written at ~25-30 MB/s on one CPU
            core, so leave it off for models above a few hundred MB). Either kind resumes.
        num_sample_completions: Sample completions per policy logged as text at each eval.
        eval_num_generations: k sampled completions per held-out prompt for
            ``eval/<p>/success_*`` (mean success); 0 = greedy only. Greedy success is always
            logged as ``eval/<p>/greedy_success_*``.
        enable_progress_bar: Show a progress display on the console.
        num_threads: ``torch.set_num_threads`` per worker; None = ``OMP_NUM_THREADS`` when
            that is set to a positive integer, else the node's cores split evenly over its
            workers.
        version: Run folder name suffix; None = next free ``version_<n>``.
        seed: Run seed of the sampling streams; None = the CLI's ``seed_everything``.

    Raises:
        ConfigError: invalid values (all at once).
    """

    def __init__(
        self,
        max_steps: int = 1000,
        accelerator: str = "auto",
        devices: int = 1,
        num_nodes: int = 1,
        strategy: str = "auto",
        precision: str = "32-true",
        placement: str = "auto",
        policy_ranks: dict[str, int] | None = None,
        collective_timeout_s: float = 1800.0,
        default_root_dir: str = "runs",
        callbacks: list[MRLCallback] | None = None,
        log_every_n_steps: int = 10,
        eval_every_n_steps: int = 100,
        checkpoint_every_n_steps: int = 500,
        keep_checkpoints: int = 2,
        compress_checkpoints: bool = False,
        num_sample_completions: int = 4,
        eval_num_generations: int = 8,
        enable_progress_bar: bool = True,
        num_threads: int | None = None,
        version: int | str | None = None,
        seed: int | None = None,
    ) -> None:
        errors = []
        for key, value in (("max_steps", max_steps), ("log_every_n_steps", log_every_n_steps),
                           ("eval_every_n_steps", eval_every_n_steps), ("keep_checkpoints", keep_checkpoints),
                           ("devices", devices), ("num_nodes", num_nodes)):
            if value < 1:
                errors.append(f"trainer.{key}={value} must be >= 1.")
        if eval_num_generations < 0:
            errors.append(f"trainer.eval_num_generations={eval_num_generations} must be >= 0 (0 = greedy only).")
        if checkpoint_every_n_steps < 0:
            errors.append(f"trainer.checkpoint_every_n_steps={checkpoint_every_n_steps} must be >= 0.")
        if num_threads is not None and num_threads < 1:
            errors.append(f"trainer.num_threads={num_threads} must be >= 1 or null.")
        if strategy not in STRATEGIES:
            errors.append(f"trainer.strategy={strategy!r} is not supported: each policy's data parallelism runs over "
                          f"its own group of ranks (docs/mwra.md); valid: {list(STRATEGIES)}.")
        if placement not in PLACEMENTS:
            errors.append(f"trainer.placement={placement!r}; valid: {list(PLACEMENTS)}.")
        if not collective_timeout_s > 0:
            errors.append(f"trainer.collective_timeout_s={collective_timeout_s} must be > 0 seconds.")
        if errors:
            raise ConfigError("Invalid trainer config:\n  - " + "\n  - ".join(errors))
        self.max_steps = max_steps
        self.callbacks: list[MRLCallback] = list(callbacks or [])
        self.log_every_n_steps, self.eval_every_n_steps = log_every_n_steps, eval_every_n_steps
        self.checkpoint_every_n_steps, self.keep_checkpoints = checkpoint_every_n_steps, keep_checkpoints
        self.compress_checkpoints = compress_checkpoints
        self.num_sample_completions, self.enable_progress_bar = num_sample_completions, enable_progress_bar
        self.eval_num_generations = eval_num_generations
        self.num_threads = num_threads
        self.default_root_dir = default_root_dir
        self.precision = precision
        self.placement_mode, self.policy_ranks = placement, policy_ranks
        self.collective_timeout_s = collective_timeout_s
        self.devices_per_node = devices
        self.seed = seed
        self.logger = TensorBoardLogger(root_dir=default_root_dir, name="", version=version)
        kwargs = dict(accelerator=accelerator, devices=devices, num_nodes=num_nodes, precision=precision,
                      callbacks=self.callbacks, loggers=[self.logger])
        self.fabric = Fabric(strategy="auto" if strategy == "auto" else "ddp", **kwargs)
        if self.fabric.world_size > 1 or strategy == "ddp":
            self.fabric = Fabric(strategy=PolicyGroupsStrategy(timeout_s=collective_timeout_s), **kwargs)
        self.workers: Workers | None = None
        self.global_step = 0
        self.rollout_step = 0
        self.samples_seen = 0
        self.optimizer_steps: dict[str, int] = {}
        self.exchange = None
        self.config_text: str | None = None
        self.last_eval: dict[str, float] = {}
        self._modules: dict[str, tuple[Any, Any]] = {}

    # ------------------------------------------------------- LightningCLI contract
    @property
    def log_dir(self) -> str:
        """The run folder."""
        return self.logger.log_dir

    @property
    def is_global_zero(self) -> bool:
        return self.fabric.is_global_zero

    def print(self, *args: Any) -> None:
        self.fabric.print(*args)

    def print_any_rank(self, message: str) -> None:
        """Print from whichever rank has something to say (prefixed with the rank when there are several)."""
        print(message if self.fabric.world_size == 1 else f"[rank {self.fabric.global_rank}] {message}", flush=True)

    # -------------------------------------------------------------------- fitting
    def fit(self, model, datamodule, ckpt_path: str | None = None) -> None:
        """Train until ``max_steps`` (resuming from ``ckpt_path`` if given).

        Args:
            model: The :class:`~mrl_lightning.system.MutualRL` system of policies.
            datamodule: The prompt data module.
            ckpt_path: A checkpoint to resume from, e.g. ``<run>/checkpoints/last.ckpt``: training
                continues from its step up to ``trainer.max_steps`` (which must be above it),
                exactly as an uninterrupted run would; None = start from step 0.

        Raises:
            ConfigError: configuration or resource-plan problems, found before any model is built.
            CheckpointError: ``ckpt_path`` is missing, unreadable or from another config.
            WorkerError: a worker failed, or a collective failed or timed out (names the rank and phase).
        """
        errors = [e for cb in self.callbacks for e in cb.config_errors(self, model)]
        if errors:
            raise ConfigError("Invalid callbacks config:\n  - " + "\n  - ".join(errors))
        placement = build_placement(self.placement_mode, self.policy_ranks, list(model.policies),
                                    self.fabric.world_size)
        checkpoint = load_checkpoint(ckpt_path) if ckpt_path else None
        if checkpoint is not None:
            check_compatible(checkpoint, list(model.policies), self.max_steps)
        plan_text, threads = self._plan(placement, model, datamodule)
        if self.fabric.global_rank == 0:
            self._check_run_folder()
        torch.set_num_threads(threads)
        self.fabric.launch()
        self.workers = w = Workers(placement, self.fabric.global_rank, self.collective_timeout_s)
        self.logger._version = w.broadcast_from_zero(self.logger.version, "run folder")
        self.print("Resource plan (MWRA):\n" + plan_text)
        with w.phase("build"):
            self._build(model, datamodule, resuming=checkpoint is not None)
            self.fabric.call("setup", self, model, datamodule)
            if checkpoint is not None:
                self._load(checkpoint, model, datamodule)
                self.print(f"Resumed from {ckpt_path} at step {self.global_step}.")
        self._write_config()
        self.print(f"Run folder: {self.log_dir}")
        self.fabric.call("on_fit_start", self, model)
        if self.global_step == 0:
            self._evaluate(model, datamodule)
        try:
            self._loop(model, datamodule)
        except KeyboardInterrupt:
            last = self.last_checkpoint_path
            self.logger.finalize("interrupted")
            every = f"trainer.checkpoint_every_n_steps: {self.checkpoint_every_n_steps}"
            hint = (f"resume with --ckpt_path {shlex.quote(str(last))} (the newest checkpoint; the steps after it "
                    f"are run again, as often as {every} says)" if last.exists()
                    else f"no checkpoint was written yet ({every}; lower it to lose fewer steps)")
            self.print(f"\nInterrupted during step {self.global_step + 1}; {hint}.")
            raise SystemExit(130) from None
        if self.global_step % self.eval_every_n_steps:
            self._evaluate(model, datamodule)
        self.save_checkpoint(model, datamodule)
        self.fabric.call("on_fit_end", self, model)
        self.logger.finalize("success")
        last = shlex.quote(str(self.last_checkpoint_path))  # quoted: pastes into a shell
        self.print(f"Done at step {self.global_step}. Checkpoint: {last} (continue to a larger trainer.max_steps "
                   f"with --ckpt_path {last}). Logs: tensorboard --logdir {shlex.quote(str(self.default_root_dir))}")

    @property
    def last_checkpoint_path(self) -> Path:
        """``<run folder>/checkpoints/last.ckpt`` (written by :meth:`save_checkpoint`; may not exist yet)."""
        return Path(self.log_dir) / "checkpoints" / "last.ckpt"

    def _plan(self, placement, model, datamodule) -> tuple[str, int]:
        """Build, validate and format the resource plan (before any model is built)."""
        device = self.fabric.device.type
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = self.num_threads or _omp_threads() or max(1, cores // self.devices_per_node)
        shapes = {}
        for name, policy in model.policies.items():
            config = policy.model_config()
            shapes[name] = model_shape(config) if config is not None else None
        strategy = type(self.fabric.strategy).__name__
        rows = build_plan(placement, shapes, dict(model.policies), datamodule.batch_size, device, strategy,
                          self.precision, threads)
        framework = process_rss_bytes() / GIB if device == "cpu" else 0.0
        if device == "cuda" and torch.cuda.is_available():
            available, memory = torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory / GIB
        else:
            available = None
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB if device == "cpu" else None
        validate_resources(rows, placement, device=device, devices_per_node=self.devices_per_node,
                           available_devices=available, cores=cores, threads=threads,
                           threads_given=self.num_threads is not None, batch_size=datamodule.batch_size,
                           framework_gib=framework, device_memory_gib=memory)
        return format_plan(rows, placement, framework), threads

    def _build(self, model, datamodule, resuming: bool = False) -> None:
        """Materialize recipes (each policy's leader rank), load tokenizers everywhere, models where they run.

        ``resuming``: the policies' weights then come from the checkpoint, so a recipe's
        warm-start shortfall (said when the run first built it) is not repeated, except for a
        policy with ``beta > 0``, whose reference model is still the built one."""
        w = self.workers
        datamodule.setup("fit")
        for name, policy in model.policies.items():
            if w.is_leader(name):
                policy.materialize(datamodule, cache_log=self.print_any_rank, resuming=resuming)
        w.barrier("materialize")
        for name, policy in model.policies.items():
            local = name in w.local_policies
            # the cache lines were printed by the materializing rank above: not twice
            policy.build(datamodule, cache_log=lambda _msg: None, with_model=local)
            self.optimizer_steps.setdefault(name, 0)
            if not local:
                continue
            wrapped, opt = self.fabric.setup(policy.model, policy.configure_optimizers())
            w.broadcast_module(name, policy.model)
            self._modules[name] = (wrapped, opt)
            if policy.ref_model is not None:
                policy.ref_model.to(self.fabric.device)

    def _loop(self, model, datamodule) -> None:
        totals: dict[str, list[float]] = defaultdict(list)
        shown: dict[str, float] = {}
        show = self.enable_progress_bar and self.is_global_zero
        with RunProgress(self.max_steps, self.global_step, enabled=show) as progress:
            while self.global_step < self.max_steps:
                metrics = self.training_step(model, datamodule)
                for key, value in metrics.items():
                    if key in CUMULATIVE or key.startswith("exchange/"):
                        totals[key] = [value]  # counters: log the latest value, not a window mean
                    else:
                        totals[key].append(value)
                shown.update(metrics)
                if self.global_step % self.log_every_n_steps == 0:
                    # Ranks meet once per log window, not once per step: one synchronization fewer per step.
                    with self.workers.phase("metrics"):
                        window = self.workers.gather_metrics({k: sum(v) / len(v) for k, v in totals.items()})
                    self.fabric.log_dict(window, step=self.global_step)
                    shown.update(window)
                    totals.clear()
                progress.update(self.global_step, shown, self.last_eval)
                if self.global_step % self.eval_every_n_steps == 0:
                    self._evaluate(model, datamodule)
                    progress.update(self.global_step, shown, self.last_eval)
                if self.checkpoint_every_n_steps and self.global_step % self.checkpoint_every_n_steps == 0 \
                        and self.global_step < self.max_steps:
                    self.save_checkpoint(model, datamodule)

    def training_step(self, model, datamodule) -> dict[str, float]:
        """One training step of every policy this rank runs; returns this rank's scalars of the step.

        Scalars are combined over ranks once per log window (:meth:`_loop`), not every step.
        """
        w = self.workers
        start = time.perf_counter()
        items = datamodule.next_batch()
        scored, metrics = {}, {}
        with w.phase("rollout", self.global_step + 1):
            for name in w.local_policies:
                t0 = time.perf_counter()
                policy = model.policies[name]
                seed = stream_seed(self._run_seed(), name, "rollout", self.rollout_step, w.group_index(name))
                scored[name] = model.rollout(policy, w.shard(name, items), seed=seed)
                self._rescore_under_mixed_precision(scored[name].rollouts)
                metrics.update(rollout_metrics(scored[name], policy))
                elapsed = time.perf_counter() - t0
                metrics[f"rollout/{name}/gen_time_s"] = metrics[f"mwra/{name}/rollout_s"] = elapsed
                tokens = float(scored[name].rollouts.completion_mask.sum())
                metrics[f"mwra/{name}/rollout_tokens_per_s"] = tokens / max(elapsed, 1e-9)
        self.rollout_step += 1
        self.samples_seen += sum(len(items) * p.num_generations for p in model.policies.values())
        with w.phase("exchange"):
            t0 = time.perf_counter()
            self.fabric.call("on_rollouts_end", self, model, scored)
            metrics["train/exchange_time_s"] = time.perf_counter() - t0
        for name in w.local_policies:
            t0 = time.perf_counter()
            policy = model.policies[name]
            with w.phase("compose"):
                batch = self._new_batch(name, policy, scored[name])
                t1 = time.perf_counter()
                self.fabric.call("on_compose_batch", self, model, policy, batch)
                metrics[f"train/{name}/compose_time_s"] = time.perf_counter() - t1
                batch.group_counts = w.group_sum(name, batch.counts)
            with w.phase("update"):
                wrapped, opt = self._modules[name]
                metrics.update(policy_update(policy, batch, wrapped, self.fabric, opt,
                                             sync_gradients=partial(w.reduce_gradients, name)))
            metrics.update(batch.metrics)
            metrics[f"train/{name}/update_time_s"] = metrics[f"mwra/{name}/update_s"] = time.perf_counter() - t0
        self.global_step += 1
        for name, policy in model.policies.items():  # every policy steps, on whichever ranks run it
            self.optimizer_steps[name] += policy.num_iterations
        waited, peak = w.take_wait_s(), _peak_memory_gib(self.fabric.device)
        for name in w.local_policies:
            metrics[f"mwra/{name}/wait_s"], metrics[f"mwra/{name}/peak_memory_gib"] = waited, peak
        metrics["train/step_time_s"] = time.perf_counter() - start
        metrics["train/samples_seen"] = float(self.samples_seen)
        self.fabric.call("on_train_step_end", self, model, metrics)
        return metrics

    def _rescore_under_mixed_precision(self, rollouts) -> None:
        """Under mixed precision, let the update re-score the rollouts in its own precision.

        Sampling runs the bare float32 model while the update runs under Fabric's autocast
        (bf16 / fp16), so the two disagree by rounding and the first ratio is not 1. Marking
        the sampler's log-probs as ``sampling_logprobs`` makes the update score the
        rollouts once without gradient in its own precision, use those as the old
        log-probs, and correct the sampler/trainer mismatch as for any other engine
        (docs/rollout.md, ``rollout/<p>/is_ratio_*``, ``abs_delta_logp``).
        """
        if self.precision not in FULL_PRECISION and getattr(rollouts, "sampling_logprobs", None) is None:
            rollouts.sampling_logprobs = rollouts.old_logprobs.clone()

    def _new_batch(self, name: str, policy, scored) -> TrainBatch:
        """The policy's batch before the probes: plain GRPO advantages and this rank's loss normalizers."""
        batch_std = None
        if policy.scale_rewards == "batch" and self.workers.group_size(name) > 1:
            batch_std = self._group_reward_std(name, scored.rewards)
        advantages = group_advantages(scored.rewards, policy.scale_rewards, batch_std=batch_std)
        return TrainBatch(scored, advantages, counts=loss_counts(policy, scored.rollouts))

    def _group_reward_std(self, name: str, rewards: torch.Tensor) -> torch.Tensor:
        """Std (Bessel) of the valid rewards of ``name``'s whole batch, over its group of ranks."""
        valid = rewards[~torch.isnan(rewards)].double()
        moments = self.workers.group_sum(name, {"n": float(valid.numel()), "sum": float(valid.sum()),
                                                "sumsq": float(valid.pow(2).sum())})
        n = max(moments["n"], 1.0)
        var = max(moments["sumsq"] - moments["sum"] ** 2 / n, 0.0) / max(n - 1.0, 1.0)
        return torch.tensor(var, dtype=rewards.dtype).sqrt()

    def _run_seed(self) -> int:
        if self.seed is not None:
            return int(self.seed)
        return int(os.environ.get("PL_GLOBAL_SEED", 0))

    def _evaluate(self, model, datamodule) -> None:
        w = self.workers
        with w.phase("eval"):
            def seed(name: str, part: str) -> int:
                return stream_seed(self._run_seed(), name, "eval", self.global_step, part, w.group_index(name))

            counts, samples = eval_counts(model, datamodule.eval_items(), w.local_policies,
                                          self.num_sample_completions, self.eval_num_generations, seed,
                                          shard=w.shard, with_samples=w.is_leader)
            gathered = w.all_gather((counts, samples), "eval")
        metrics = eval_metrics_from_counts(model, merge_eval_counts([c for c, _ in gathered]))
        self.last_eval = metrics
        self.fabric.call("on_eval_end", self, model, metrics)
        self.fabric.log_dict(metrics, step=self.global_step)
        if self.is_global_zero:
            for _, rank_samples in gathered:
                for name, text in rank_samples.items():
                    self.logger.experiment.add_text(f"samples/{name}", text, global_step=self.global_step)
        summary = "  ".join(f"{k.split('/', 1)[1]}={v:.2f}" for k, v in metrics.items()
                            if k.endswith(("/success_weak", "/success_strong", "greedy_success_weak")))
        self.print(f"[eval] step {self.global_step}: {summary}")

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, model, datamodule) -> Path:
        """Gather every policy's state from its owner; rank 0 writes ``step=<k>.ckpt`` and ``last.ckpt`` atomically."""
        w = self.workers
        folder = Path(self.log_dir) / "checkpoints"
        path = folder / f"step={self.global_step}.ckpt"
        with w.phase("checkpoint"):
            local = {
                "policies": {name: {"model": _to_cpu(model.policies[name].model.state_dict()),
                                    "optimizer": _to_cpu(self._modules[name][1].state_dict())}
                             for name in w.local_policies if w.is_leader(name)},
                "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
                "rng": rng_state(),
            }
            if w.distributed:  # torch.save keeps tied weights one storage; pickling for the gather would not
                local["policies"] = {name: _pack(part) for name, part in local["policies"].items()}
            gathered = w.gather_to_zero(local, "checkpoint")
            if gathered is not None and w.distributed:
                for g in gathered:
                    g["policies"] = {name: _unpack(part) for name, part in g["policies"].items()}
            if gathered is not None:
                state = {
                    "format": "mrl-lightning", "version": FORMAT_VERSION,
                    "counters": {"global_step": self.global_step, "rollout_step": self.rollout_step,
                                 "samples_seen": self.samples_seen, "optimizer_steps": dict(self.optimizer_steps)},
                    "policies": {name: part for g in gathered for name, part in g["policies"].items()},
                    "callbacks": {cb.state_key: cb.merge_rank_states([g["callbacks"][cb.state_key] for g in gathered])
                                  for cb in self.callbacks},
                    "data": datamodule.state_dict(),
                    "rng": {"ranks": [g["rng"] for g in gathered]},
                    "placement": {"mode": w.placement.mode,
                                  "groups": {k: list(v) for k, v in w.placement.groups.items()}},
                }
                self._write_checkpoint(state, folder, path)
            w.barrier("checkpoint")
        return path

    def _write_checkpoint(self, state: dict[str, Any], folder: Path, path: Path) -> None:
        # last.ckpt first, so it is never older than a step file; the step file is a hard
        # link to the same bytes, put in place atomically too.
        last = folder / "last.ckpt"
        atomic_save(state, last, compress=self.compress_checkpoints)
        tmp = folder / f".{path.name}.link"
        if tmp.exists():
            tmp.unlink()
        os.link(last, tmp)
        os.replace(tmp, path)
        old = sorted(folder.glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
        for stale in old[: -self.keep_checkpoints]:
            stale.unlink()

    def _load(self, state: dict[str, Any], model, datamodule) -> None:
        for name in self.workers.local_policies:
            try:
                model.policies[name].model.load_state_dict(state["policies"][name]["model"])
            except RuntimeError as exc:
                raise CheckpointError(
                    f"policy {name!r}: the checkpoint's weights do not fit the configured model "
                    f"({str(exc).splitlines()[0]} ...); resume with the config the checkpoint was made with."
                ) from exc
            optimizer = self._modules[name][1]
            foreach = [group.get("foreach") for group in optimizer.param_groups]
            optimizer.load_state_dict(state["policies"][name]["optimizer"])
            for group, value in zip(optimizer.param_groups, foreach):  # the saved groups carry the writer's choice
                group["foreach"] = value
        missing = [cb.state_key for cb in self.callbacks if cb.state_key not in state["callbacks"]]
        dropped = [key for key in state["callbacks"] if key not in {cb.state_key for cb in self.callbacks}]
        if missing or dropped:
            self.print(f"Warning: resuming with different callbacks: state for {dropped} is dropped, "
                       f"{missing} start fresh.")
        for cb in self.callbacks:
            if cb.state_key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][cb.state_key])
        datamodule.load_state_dict(state["data"])
        c = state["counters"]
        self.global_step, self.rollout_step, self.samples_seen = c["global_step"], c["rollout_step"], c["samples_seen"]
        self.optimizer_steps = dict(c["optimizer_steps"])
        ranks = state["rng"]["ranks"]
        rank = self.fabric.global_rank
        for note in set_rng_state(ranks[rank] if rank < len(ranks) else ranks[0]):
            self.print(f"Note: {note}")

    def _check_run_folder(self) -> None:
        """Refuse to write into a run folder that already holds a run.

        Raises:
            ConfigError: ``<default_root_dir>/<version>`` already has a config.yaml.
        """
        if (Path(self.log_dir) / "config.yaml").exists():
            raise ConfigError(f"the run folder {self.log_dir} already holds a run (config.yaml); pick another "
                              "--trainer.version, leave it unset for the next free version_<n>, or remove the folder.")

    def _write_config(self) -> None:
        if self.config_text is not None and self.is_global_zero:
            os.makedirs(self.log_dir, exist_ok=True)
            Path(self.log_dir, "config.yaml").write_text(self.config_text)


def _to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor on the CPU (CPU tensors are not copied)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this worker so far: the CUDA allocator's peak on a GPU, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def _omp_threads() -> int | None:
    """``OMP_NUM_THREADS`` as a positive int, or None when unset or not one (threads per worker)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _pack(state: dict[str, Any]) -> bytes:
    """``state`` as ``torch.save`` bytes: tensors that share storage (tied embeddings) stay shared."""
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _unpack(data: bytes) -> dict[str, Any]:
    """Inverse of :func:`_pack` (tensors and plain containers only)."""
    import io

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
