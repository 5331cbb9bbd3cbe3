"""MRLTrainer: the multi-module Fabric loop running the training step for N policies (docs/loop.md).

One Fabric instance per process. With one process every policy samples and updates in
turn (placement ``colocated``). With several (``--trainer.devices N --trainer.strategy ddp``,
``torchrun``, SLURM), the MWRA placement (docs/mwra.md) decides which policies each rank
runs: the loop asks :class:`~mrl_lightning.mwra.Workers` for this rank's policies and
prompts and never branches on the placement. Callbacks answer named hooks through
``fabric.call`` (see :mod:`mrl_lightning.callbacks.base` for the hook list and order).

Counters are separate and named: ``rollout_step`` (rollout phases done),
``global_step`` (training steps done; ``max_steps`` bounds it; in each every policy attempts
``num_iterations`` optimizer steps), ``optimizer_steps[policy]`` (those attempts, also the ones
skipped for a non-finite gradient or for want of anything to train on,
:func:`mrl_lightning.update.policy_update.empty_update`; AdamW's own step count holds those taken) and
``samples_seen`` (completions sampled, all policies, all ranks).

Run folder ``<default_root_dir>/version_<n>/``: ``config.yaml`` (resolved config),
``model_sources.json`` (what a GGUF-sourced policy loaded: file, sha256, quantization), TensorBoard events, ``checkpoints/step=<k>.ckpt`` and ``checkpoints/last.ckpt``.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.loggers import TensorBoardLogger

from mrl_lightning.builders import build_on_rank
from mrl_lightning.callbacks.base import HookContext, InContext, MRLCallback, collect_services
from mrl_lightning.loop.dynamic_sampling import extra_samples
from mrl_lightning.errors import ConfigError
from mrl_lightning.lifeline import is_launched_worker
from mrl_lightning.metrics import Global
from mrl_lightning.mwra import Workers, devices_present, resolve_devices
from mrl_lightning.mwra.plan import slow_cpu_bf16_line
from mrl_lightning.mwra.process import peak_memory_gib, release_free_memory
from mrl_lightning.config.preflight import check_before_build, make_fabric, trainer_errors
from mrl_lightning.loop.policy_step import (check_resume_steps_per_round, compose_and_update, rates, rates_line,
                                            round_counters, solo_steps, steps_per_round_errors)
from mrl_lightning.loop.pace import Pace, check_resume_lag, lag_errors, step_wait_metrics
from mrl_lightning.loop.prefetch import Prefetch, async_errors, check_resume_async, sample_batch
from mrl_lightning.loop.progress import RunProgress, done_line, stop_context
from mrl_lightning.loop.replay import Replay, ReplayLog
from mrl_lightning.loop.reporting import evaluate_step
from mrl_lightning.run.state import (complete_run_line, restore_run_checkpoint, save_run_checkpoint,
                                          write_run_files)



class MRLTrainer(Replay):
    """Trainer for :class:`~mrl_lightning.loop.system.MutualRL` (LightningCLI ``--trainer.*``).

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
            of ranks per policy, running at the same time), "auto" (disjoint when the
            ranks split evenly over the policies) or "cost" (the shortest step a short
            calibration predicts, docs/mwra.md "Placement by cost"); docs/mwra.md.
        policy_ranks: Ranks per policy for "disjoint", e.g. ``{gpt2: 1, llama: 1}``;
            None splits the ranks evenly.
        collective_timeout_s: A rank blocked this long in a collective (another rank
            failed or hangs) ends the run with an error naming the rank and phase. Must
            exceed the longest warm-start, since ranks wait for each other's.
        default_root_dir: Runs are written to ``<default_root_dir>/version_<n>``.
        callbacks: SEE, probes and other hooks, called in list order.
        log_every_n_steps: Scalars are averaged over and logged every this many steps.
        eval_every_n_steps: Evaluation period on held-out prompts (also at start and end); 0 = none at all.
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
        max_lag: Batches a policy may run ahead of its peers (docs/mwra.md, "Pace"): step s samples
            batch s and trains batch s - max_lag with every policy's records of it, so no rank waits
            at the exchange or for the logger until it is that far ahead; 0 = lockstep.
        async_rollouts: Sample the next batch on a thread beside each update, from the weights before it
            (docs/mwra.md, "Rollouts during the update"): every batch one update older (``max_lag + 1``), the
            same results however the two overlap; :mod:`mrl_lightning.loop.prefetch`.
        steps_per_round: Policy -> its training steps per exchange round, on average, from 1 to 64 (e.g. ``{smollm2:
            1.5}``): the extra ones are solo steps on its own prompts (:mod:`mrl_lightning.loop.policy_step`); null = 1
            each. Checked against the policies before any model is built.

    Raises:
        ConfigError: invalid values (all at once), an accelerator this machine does not have, or a
            precision Lightning would run as another on it (:mod:`mrl_lightning.config.preflight`).
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
        max_lag: int = 0,
        async_rollouts: bool = False,
        steps_per_round: dict[str, Any] | None = None,
    ) -> None:
        errors = trainer_errors(max_steps=max_steps, log_every_n_steps=log_every_n_steps,
                                eval_every_n_steps=eval_every_n_steps, keep_checkpoints=keep_checkpoints,
                                devices=devices, num_nodes=num_nodes, eval_num_generations=eval_num_generations,
                                checkpoint_every_n_steps=checkpoint_every_n_steps, num_threads=num_threads,
                                strategy=strategy, placement=placement, collective_timeout_s=collective_timeout_s,
                                accelerator=accelerator, num_sample_completions=num_sample_completions,
                                max_lag=max_lag)
        if errors:
            raise ConfigError("Invalid trainer config:\n  - " + "\n  - ".join(errors))
        fit = resolve_devices(accelerator, devices, placement, strategy, devices_present(), num_nodes, policy_ranks)
        if isinstance(fit, str):  # more GPUs asked than present, and the config's placement needs them
            raise ConfigError(fit)
        devices, placement, self.devices_note = fit.devices, fit.placement, fit.note  # docs/mwra.md, "One GPU"
        self.max_steps, self.max_lag, self.async_rollouts = max_steps, max_lag, async_rollouts
        self.steps_per_round, self.solo_rates = steps_per_round, {}  # the rates above 1, exact, once checked (_fit)
        self.callbacks: list[MRLCallback] = list(callbacks or [])
        self.log_every_n_steps, self.eval_every_n_steps = log_every_n_steps, eval_every_n_steps
        self.checkpoint_every_n_steps, self.keep_checkpoints = checkpoint_every_n_steps, keep_checkpoints
        self.compress_checkpoints = compress_checkpoints
        self.num_sample_completions, self.enable_progress_bar = num_sample_completions, enable_progress_bar
        self.eval_num_generations, self.num_threads = eval_num_generations, num_threads
        self.default_root_dir, self.precision = default_root_dir, precision
        self.placement_mode, self.policy_ranks = placement, policy_ranks
        self.collective_timeout_s, self.devices_per_node, self.seed = collective_timeout_s, devices, seed
        self.logger = TensorBoardLogger(root_dir=default_root_dir, name="", version=version)
        self.fabric = make_fabric(strategy, collective_timeout_s, accelerator=accelerator, devices=devices,
                                  num_nodes=num_nodes, precision=precision, callbacks=self.callbacks,
                                  loggers=[self.logger])
        slow = slow_cpu_bf16_line(self.fabric.device.type, getattr(self.fabric.strategy.precision, "precision",
                                                                    str(precision)))
        if slow and self.fabric.global_rank == 0 and not is_launched_worker():  # once, before any model is built
            warnings.warn(slow, stacklevel=2)
        self.ctx = HookContext(callbacks=self.callbacks, fabric=self.fabric, print=self.print, max_lag=max_lag)
        self.workers: Workers | None = None
        self.samples_seen, self.optimizer_steps = 0, {}  # completions sampled (all ranks); per policy
        self.config_text: str | None = None
        self.last_eval: dict[str, float] = {}
        self._modules: dict[str, tuple[Any, Any]] = {}
        self.replay_log: ReplayLog | None = None  # set by replay()
        self._sampled_after = 0  # updates done when the batch this step sampled was sampled

    global_step = InContext("Training steps done (``ctx.global_step``).")
    rollout_step = InContext("Rollout phases done (``ctx.rollout_step``).")

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
            model: The :class:`~mrl_lightning.loop.system.MutualRL` system of policies.
            datamodule: The prompt data module.
            ckpt_path: A checkpoint to resume from, e.g. ``<run>/checkpoints/last.ckpt``: training
                continues from its step up to ``trainer.max_steps``, exactly as an uninterrupted run
                would; None = start from step 0. A checkpoint at exactly ``max_steps`` is a complete
                run: one line says so and nothing is built or written (docs/loop.md, "Resuming: what
                the config may change").

        Raises:
            ConfigError: configuration or resource-plan problems, found before any model is built
                (:func:`mrl_lightning.config.preflight.check_before_build`).
            CheckpointError: ``ckpt_path`` is missing, unreadable, from another config or beyond ``max_steps``.
            WorkerError: a worker failed, or a collective failed or timed out (names the rank and phase).
            KeyboardInterrupt: Ctrl-C.

        Any exception leaves with ``mrl_stop``, a :class:`~mrl_lightning.run.stop.StopContext`
        of this rank, from which ``mrl`` prints one message on the rank that had the error and
        stays quiet on the others (:func:`mrl_lightning.run.stop.stop_run`).
        """
        try:
            self._fit(model, datamodule, ckpt_path)
        except (Exception, KeyboardInterrupt) as exc:
            watch = self._watch()
            if watch is not None:
                watch.stopping = True  # the launcher's watch interrupts nothing from here on
            with contextlib.suppress(Exception):
                self.logger.finalize("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
            with contextlib.suppress(Exception):  # never hide the exception behind one of its own
                exc.mrl_stop = stop_context(self, watch)
            raise

    def _watch(self):
        """Rank 0's watch of the workers it launched (None in a worker, one process, torchrun or SLURM)."""
        return getattr(getattr(self.fabric.strategy, "launcher", None), "watch", None)

    def _fit(self, model, datamodule, ckpt_path: str | None) -> None:
        complete = complete_run_line(ckpt_path, self.max_steps)
        if complete is not None:  # a requeued job of a finished run: nothing built, no run folder made
            self.print(complete)
            return
        errors = (lag_errors(self.max_lag, model.policies) + async_errors(self.async_rollouts, model.policies)
                  + steps_per_round_errors(self.steps_per_round, model.policies, self.async_rollouts))
        if errors:
            raise ConfigError("Invalid trainer config:\n  - " + "\n  - ".join(errors))
        self.solo_rates = rates(self.steps_per_round)
        try:
            checked = check_before_build(self, model, datamodule, ckpt_path)
        except ConfigError as exc:  # say that the devices were lowered, if they were
            raise (ConfigError(f"{exc}\n  ({self.devices_note})") if self.devices_note else exc) from exc.__cause__
        checkpoint = checked.checkpoint
        if checkpoint is not None:  # what each step reads depends on max_lag: refused before any model is built
            check_resume_lag(checkpoint.get("counters", {}), self.max_lag, ckpt_path, checked.placement)
            check_resume_async(checkpoint.get("counters", {}), self.async_rollouts, ckpt_path)
            check_resume_steps_per_round(checkpoint.get("counters", {}), self.steps_per_round, ckpt_path)
        self.fabric.launch()
        torch.set_num_threads(checked.threads)  # after: Lightning's launcher sets cores // processes without OMP_NUM_THREADS
        watch = self._watch()
        if watch is not None:  # what the watch prints if Ctrl-C cannot reach a blocked main thread
            watch.interrupted_line = lambda: stop_context(self, watch).interrupted_line()
        self.workers = w = Workers(checked.placement, self.fabric.global_rank, self.collective_timeout_s)
        if self.replay_log is not None:  # the logged policies run nowhere: their records come from the log
            w.local_policies, self.ctx.replay = [n for n in w.local_policies if n not in self.replay_log.logged], self.replay_log
        w.pace = self.pace = Pace(w, self.max_lag, self.collective_timeout_s, self.fabric.device, self.fabric.log_dict)
        self.pace.async_rollouts, self.prefetch = self.async_rollouts, Prefetch(self.async_rollouts, self.fabric.device)
        self.logger._version = w.broadcast_from_zero(self.logger.version, "run folder")
        self.ctx.workers, self.ctx.log_dir, self.ctx.is_global_zero = w, self.log_dir, self.is_global_zero
        self.print("Resource plan (MWRA):\n" + (f"{self.devices_note}\n" if self.devices_note else "") + checked.plan_text
                   + rates_line(self.steps_per_round))
        with w.phase("build"):
            self._modules = build_on_rank(model, datamodule, w, self.fabric, self.print_any_rank,
                                          resuming=checkpoint is not None)
            for name in model.policies:
                self.optimizer_steps.setdefault(name, 0)
            self.fabric.call("setup", self.ctx, model, datamodule)
            self.ctx.services = collect_services(self.callbacks)
            if checkpoint is not None:
                self._load(checkpoint, ckpt_path, model, datamodule)
                self.print(f"Resumed from {ckpt_path} at step {self.global_step}.")
            release_free_memory()
        if self.is_global_zero:
            write_run_files(self.log_dir, self.config_text, model, datamodule)
        self.print(f"Run folder: {self.log_dir}")
        self.fabric.call("on_fit_start", self.ctx, model)
        if self.global_step == 0 and self.eval_every_n_steps:
            evaluate_step(self, model, datamodule)
        self._loop(model, datamodule)
        if self.eval_every_n_steps and self.global_step % self.eval_every_n_steps:
            evaluate_step(self, model, datamodule)
        self.save_checkpoint(model, datamodule)
        self.fabric.call("on_fit_end", self.ctx, model)
        self.logger.finalize("success")
        self.print(done_line(self.global_step, self.last_checkpoint_path, self.default_root_dir, self.replay_log is not None))
        launcher = getattr(self.fabric.strategy, "launcher", None)
        if getattr(launcher, "watch", None) is not None:
            launcher.join(timeout_s=60.0)  # the workers finish their last steps; none outlives the run

    @property
    def last_checkpoint_path(self) -> Path:
        """``<run folder>/checkpoints/last.ckpt`` (written by :meth:`save_checkpoint`; may not exist yet)."""
        return Path(self.log_dir) / "checkpoints" / "last.ckpt"

    def _loop(self, model, datamodule) -> None:
        window: list[dict[str, float]] = []  # this rank's metrics of each step since the last log step
        shown: dict[str, float] = {}
        show = self.enable_progress_bar and self.is_global_zero
        with RunProgress(self.max_steps, self.global_step, enabled=show) as progress:
            while self.global_step < self.max_steps:
                metrics = self.training_step(model, datamodule)
                if metrics is None:  # with a lag, a step that only sampled (the first max_lag)
                    continue
                window.append(metrics)
                shown.update(metrics)
                if self.global_step % self.log_every_n_steps == 0 or self.global_step == self.max_steps:
                    # Ranks meet once per log window, not once per step (and with a lag, not at all: pace.py).
                    with self.workers.phase("metrics"):
                        for logged in self.pace.log_window(self.global_step, window):
                            shown.update(logged)
                    window = []
                progress.update(self.global_step, shown, self.last_eval)
                if self.eval_every_n_steps and self.global_step % self.eval_every_n_steps == 0:
                    self.prefetch.join()  # (the thread samples from copies; joined all the same)
                    evaluate_step(self, model, datamodule)
                    progress.update(self.global_step, shown, self.last_eval)
                if self.checkpoint_every_n_steps and self.global_step % self.checkpoint_every_n_steps == 0 \
                        and self.global_step < self.max_steps:
                    self.save_checkpoint(model, datamodule)
            for logged in self.pace.flush():  # rank 0, with a lag: the windows of the last steps
                shown.update(logged)
            progress.update(self.global_step, shown, self.last_eval)

    def training_step(self, model, datamodule) -> dict[str, float] | None:
        """One training step of every policy this rank runs (docs/loop.md); returns this rank's scalars of it.

        Rollouts (this rank's shard, per policy; a ``filter_groups`` policy's extra generation
        batches, :mod:`mrl_lightning.loop.dynamic_sampling`) -> ``on_rollouts_end`` (every batch's
        rollouts) -> per policy: plain GRPO advantages, ``on_compose_batch`` (every group), the
        kept groups only, the group's normalizers and term names, the update
        (:func:`mrl_lightning.update.policy_update.policy_update`); docs/architecture.md has the order.
        With ``max_lag`` L > 0 it samples the next batch and trains the one sampled L batches before
        (:class:`~mrl_lightning.loop.pace.Pace`); None for a step that only sampled.
        """
        w = self.workers
        start, before = self.pace.begin(), w.take_waits()  # before: the last log step's metric gather, ...
        metrics: dict[str, float] = {}
        if self.solo_rates and self.rollout_step < self.max_steps:  # a faster policy's own steps, first
            solo_steps(self, model, datamodule, metrics)
        sampled = self._sample(model, datamodule, metrics) if self.rollout_step < self.max_steps else None
        train = self.pace.queue(self.rollout_step, self.max_steps, sampled, self._sampled_after)
        if self.max_lag:  # the exchange's clock: the batch trained (lockstep: the batch sampled)
            self.ctx.trained_batch = train if train is not None else max(self.rollout_step - self.max_lag, 0)
        with w.phase("exchange"):
            t0 = time.perf_counter()
            self.fabric.call("on_rollouts_end", self.ctx, model, sampled[0] if sampled else {})
            metrics["train/exchange_time_s"] = time.perf_counter() - t0
        if self.async_rollouts and self.rollout_step < self.max_steps:  # the next batch, beside this update
            with w.phase("rollout", self.rollout_step + 1):
                self.prefetch.start(self, model, datamodule)
        if train is None:
            return None
        scored, keep = self.pace.take(train, metrics, self.global_step)
        self._train(model, scored, keep, metrics)
        metrics["train/step_time_s"] = time.perf_counter() - start
        metrics.update(step_wait_metrics(w.local_policies, before, w.take_waits(), metrics["train/step_time_s"],
                                         peak_memory_gib(self.fabric.device), self.pace))
        metrics["train/samples_seen"] = Global(self.samples_seen)
        self.fabric.call("on_train_step_end", self.ctx, model, metrics)
        return metrics

    def _sample(self, model, datamodule, metrics: dict[str, float]) -> tuple[dict, dict]:
        """The next batch's rollouts of this rank's policies, scored: ``({policy: ScoredRollouts}, {policy: kept})``
        (:func:`~mrl_lightning.loop.prefetch.sample_batch`; sampled during the last update with ``async_rollouts``)."""
        w = self.workers
        with w.phase("rollout", self.rollout_step + 1):
            ahead = self.prefetch.take(self.rollout_step + 1)  # None: not sampled ahead
            self._sampled_after = self.prefetch.sampled_after if ahead is not None else self.global_step
            if ahead is None:
                ahead = sample_batch(self, model, datamodule, datamodule.next_batch(), self.rollout_step,
                                     {name: model.policies[name] for name in w.local_policies})
            items, scored, keep, more, extra = ahead
            metrics.update(more)
            release_free_memory()  # sampling's freed [N, V] blocks back to the OS (docs/mwra.md, "The memory model")
            more = (extra_samples(w, extra, dict(model.policies))  # a world gather: its wait counts as rollout's
                    if any(p.filter_groups for p in model.policies.values()) else 0)
        self.rollout_step += 1
        self.samples_seen += sum(len(items) * p.num_generations for p in model.policies.values()) + more
        return scored, keep

    def _train(self, model, scored: dict, keep: dict, metrics: dict[str, float]) -> None:
        """Compose and update every policy this rank runs on ``scored``; count the step."""
        for name in self.workers.local_policies:
            compose_and_update(self, model, name, scored[name], keep.get(name), metrics, ("update", self.global_step))
        self.global_step += 1
        for name, policy in model.policies.items():  # every policy attempts its steps, on whichever ranks run it
            self.optimizer_steps[name] += policy.num_iterations

    def _run_seed(self) -> int:
        return int(self.seed) if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, model, datamodule) -> Path:
        """Every policy's state from its owner; rank 0 writes ``step=<k>.ckpt`` and ``last.ckpt`` atomically
        (:func:`mrl_lightning.run.state.save_run_checkpoint`)."""
        counters = {"global_step": self.global_step, "rollout_step": self.rollout_step,
                    "samples_seen": self.samples_seen, "optimizer_steps": dict(self.optimizer_steps),
                    **round_counters(self.steps_per_round)}
        with self.workers.phase("checkpoint"):
            counters.update(self.pace.counters())  # a lag's records still to be read
            counters.update(self.prefetch.counters(self.workers))  # the batch sampled ahead
        with self.workers.phase("checkpoint"):
            return save_run_checkpoint(Path(self.log_dir) / "checkpoints", self.global_step, workers=self.workers,
                                       policies=dict(model.policies), callbacks=self.callbacks,
                                       optimizers={name: opt for name, (_, opt) in self._modules.items()},
                                       counters=counters, data_state=datamodule.state_dict(),
                                       compress=self.compress_checkpoints, keep=self.keep_checkpoints)

    def _load(self, state: dict[str, Any], path: str, model, datamodule) -> None:
        c = restore_run_checkpoint(state, path, workers=self.workers, policies=dict(model.policies),
                                   optimizers={name: opt for name, (_, opt) in self._modules.items()},
                                   callbacks=self.callbacks, datamodule=datamodule, rank=self.fabric.global_rank,
                                   note=self.print)
        self.global_step, self.rollout_step, self.samples_seen = c["global_step"], c["rollout_step"], c["samples_seen"]
        self.optimizer_steps = dict(c["optimizer_steps"])
        self.pace.load(c)
        self.prefetch.load(c, self.workers, self.fabric.device, self.max_steps, self.print)
