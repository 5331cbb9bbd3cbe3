"""MRLTrainer: the multi-module Fabric loop running SPEC 1 for N policies.

One Fabric instance drives every policy; each policy's model and optimizer are set up
with ``fabric.setup`` and updated in turn. Callbacks answer named hooks through
``fabric.call`` (see :mod:`mrl_lightning.callbacks.base` for the hook list and order).

Counters are separate and named (STYLE): ``rollout_step`` (rollout phases done),
``global_step`` (training steps done; ``max_steps`` bounds it; each is one SPEC 1
step in which every policy makes ``num_iterations`` optimizer steps),
``optimizer_steps[policy]`` and ``samples_seen`` (completions sampled, all policies).

Run folder ``<default_root_dir>/version_<n>/``: ``config.yaml`` (resolved config),
TensorBoard events, ``checkpoints/step=<k>.ckpt`` and ``checkpoints/last.ckpt``.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger

from mrl_lightning.batch import TrainBatch
from mrl_lightning.callbacks.base import MRLCallback
from mrl_lightning.checkpoint import (
    CheckpointError,
    atomic_save,
    check_compatible,
    load_checkpoint,
    rng_state,
    set_rng_state,
)
from mrl_lightning.errors import ConfigError
from mrl_lightning.mwra import build_plan, format_plan, validate_plan
from mrl_lightning.objectives.grpo import group_advantages
from mrl_lightning.policy import policy_update
from mrl_lightning.progress import RunProgress
from mrl_lightning.reporting import eval_metrics, rollout_metrics

CUMULATIVE = {"train/samples_seen"}


class MRLTrainer:
    """Trainer for :class:`~mrl_lightning.system.MutualRL` (LightningCLI ``--trainer.*``).

    Args:
        max_steps: Training steps to run (SPEC 1 steps; budgets in steps, not time).
        accelerator: Fabric accelerator ("auto", "cpu", "cuda", ...).
        devices: Fabric devices.
        strategy: Fabric strategy ("auto", "ddp", "fsdp", "deepspeed").
        precision: Fabric precision ("32-true", "bf16-mixed", ...).
        default_root_dir: Runs are written to ``<default_root_dir>/version_<n>``.
        callbacks: SEE, probes and other hooks, called in list order.
        log_every_n_steps: Scalars are averaged over and logged every this many steps.
        eval_every_n_steps: Greedy evaluation on held-out prompts (also at start and end).
        checkpoint_every_n_steps: Checkpoint period (also at the end); 0 = only at the end.
        keep_checkpoints: How many ``step=*.ckpt`` files to keep (``last.ckpt`` always).
        num_sample_completions: Sample completions per policy logged as text at each eval.
        eval_num_generations: k sampled completions per held-out prompt for
            ``eval/<p>/success_*`` (mean success); 0 = greedy only. Greedy success is always
            logged as ``eval/<p>/greedy_success_*``.
        enable_progress_bar: Show a progress display on the console.
        num_threads: ``torch.set_num_threads`` for the run; None leaves torch's default.
        version: Run folder name suffix; None = next free ``version_<n>``.

    Raises:
        ValueError: invalid values (all at once).
    """

    def __init__(
        self,
        max_steps: int = 1000,
        accelerator: str = "auto",
        devices: int | str = 1,
        strategy: str = "auto",
        precision: str = "32-true",
        default_root_dir: str = "runs",
        callbacks: list[MRLCallback] | None = None,
        log_every_n_steps: int = 10,
        eval_every_n_steps: int = 100,
        checkpoint_every_n_steps: int = 500,
        keep_checkpoints: int = 2,
        num_sample_completions: int = 4,
        eval_num_generations: int = 8,
        enable_progress_bar: bool = True,
        num_threads: int | None = None,
        version: int | str | None = None,
    ) -> None:
        errors = []
        for key, value in (("max_steps", max_steps), ("log_every_n_steps", log_every_n_steps),
                           ("eval_every_n_steps", eval_every_n_steps), ("keep_checkpoints", keep_checkpoints)):
            if value < 1:
                errors.append(f"trainer.{key}={value} must be >= 1.")
        if eval_num_generations < 0:
            errors.append(f"trainer.eval_num_generations={eval_num_generations} must be >= 0 (0 = greedy only).")
        if checkpoint_every_n_steps < 0:
            errors.append(f"trainer.checkpoint_every_n_steps={checkpoint_every_n_steps} must be >= 0.")
        if num_threads is not None and num_threads < 1:
            errors.append(f"trainer.num_threads={num_threads} must be >= 1 or null.")
        if errors:
            raise ConfigError("Invalid trainer config:\n  - " + "\n  - ".join(errors))
        self.max_steps = max_steps
        self.callbacks: list[MRLCallback] = list(callbacks or [])
        self.log_every_n_steps, self.eval_every_n_steps = log_every_n_steps, eval_every_n_steps
        self.checkpoint_every_n_steps, self.keep_checkpoints = checkpoint_every_n_steps, keep_checkpoints
        self.num_sample_completions, self.enable_progress_bar = num_sample_completions, enable_progress_bar
        self.eval_num_generations = eval_num_generations
        self.num_threads = num_threads
        self.default_root_dir = default_root_dir
        self.precision = precision
        self.logger = TensorBoardLogger(root_dir=default_root_dir, name="", version=version)
        self.fabric = Fabric(accelerator=accelerator, devices=devices, strategy=strategy, precision=precision,
                             callbacks=self.callbacks, loggers=[self.logger])
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

    # -------------------------------------------------------------------- fitting
    def fit(self, model, datamodule, ckpt_path: str | None = None) -> None:
        """Run SPEC 1 until ``max_steps`` (resuming from ``ckpt_path`` if given).

        Raises:
            ValueError: configuration problems found before any model is built.
            FileNotFoundError: ``ckpt_path`` does not exist.
        """
        errors = [e for cb in self.callbacks for e in cb.config_errors(self, model)]
        if errors:
            raise ConfigError("Invalid callbacks config:\n  - " + "\n  - ".join(errors))
        checkpoint = load_checkpoint(ckpt_path) if ckpt_path else None
        if checkpoint is not None:
            check_compatible(checkpoint, list(model.policies), self.max_steps)
        self._check_run_folder()
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        self.fabric.launch()
        datamodule.setup("fit")
        for policy in model.policies.values():
            policy.build(datamodule, cache_log=self.print)
            wrapped, opt = self.fabric.setup(policy.model, policy.configure_optimizers())
            self._modules[policy.policy_name] = (wrapped, opt)
            self.optimizer_steps.setdefault(policy.policy_name, 0)
            if policy.ref_model is not None:
                policy.ref_model.to(self.fabric.device)
        plan = build_plan(model, self.fabric, self.precision)
        validate_plan(plan, self.fabric.device)
        self.print("Resource plan (MWRA):\n" + format_plan(plan))
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
            last = Path(self.log_dir) / "checkpoints" / "last.ckpt"
            self.logger.finalize("interrupted")
            hint = f"resume with --ckpt_path {last}" if last.exists() else "no checkpoint was written yet"
            self.print(f"\nInterrupted during step {self.global_step + 1}; {hint}.")
            raise SystemExit(130) from None
        if self.global_step % self.eval_every_n_steps:
            self._evaluate(model, datamodule)
        self.save_checkpoint(model, datamodule)
        self.fabric.call("on_fit_end", self, model)
        self.logger.finalize("success")

    def _loop(self, model, datamodule) -> None:
        totals: dict[str, list[float]] = defaultdict(list)
        with RunProgress(self.max_steps, self.global_step, enabled=self.enable_progress_bar) as progress:
            while self.global_step < self.max_steps:
                metrics = self.training_step(model, datamodule)
                for key, value in metrics.items():
                    if key in CUMULATIVE or key.startswith("exchange/"):
                        totals[key] = [value]  # counters: log the latest value, not a window mean
                    else:
                        totals[key].append(value)
                progress.update(self.global_step, metrics, self.last_eval)
                if self.global_step % self.log_every_n_steps == 0:
                    self.fabric.log_dict({k: sum(v) / len(v) for k, v in totals.items()}, step=self.global_step)
                    totals.clear()
                if self.global_step % self.eval_every_n_steps == 0:
                    self._evaluate(model, datamodule)
                    progress.update(self.global_step, metrics, self.last_eval)
                if self.checkpoint_every_n_steps and self.global_step % self.checkpoint_every_n_steps == 0 \
                        and self.global_step < self.max_steps:
                    self.save_checkpoint(model, datamodule)

    def training_step(self, model, datamodule) -> dict[str, float]:
        """One SPEC 1 step for every policy; returns the step's scalars."""
        start = time.perf_counter()
        items = datamodule.next_batch()
        scored, metrics = {}, {}
        for name, policy in model.policies.items():
            t0 = time.perf_counter()
            scored[name] = model.rollout(policy, items)
            metrics.update(rollout_metrics(scored[name], policy))
            metrics[f"rollout/{name}/gen_time_s"] = time.perf_counter() - t0
            self.samples_seen += scored[name].rewards.numel()
        self.rollout_step += 1
        self.fabric.call("on_rollouts_end", self, model, scored)
        for name, policy in model.policies.items():
            t0 = time.perf_counter()
            batch = TrainBatch(scored[name], group_advantages(scored[name].rewards, policy.scale_rewards))
            self.fabric.call("on_compose_batch", self, model, policy, batch)
            wrapped, opt = self._modules[name]
            metrics.update(policy_update(policy, batch, wrapped, self.fabric, opt))
            metrics.update(batch.metrics)
            self.optimizer_steps[name] += policy.num_iterations
            metrics[f"train/{name}/update_time_s"] = time.perf_counter() - t0
        self.global_step += 1
        metrics["train/step_time_s"] = time.perf_counter() - start
        metrics["train/samples_seen"] = float(self.samples_seen)
        self.fabric.call("on_train_step_end", self, model, metrics)
        return metrics

    def _evaluate(self, model, datamodule) -> None:
        metrics, samples = eval_metrics(model, datamodule.eval_items(), self.num_sample_completions,
                                        self.eval_num_generations, seed=self.global_step)
        self.last_eval = metrics
        self.fabric.call("on_eval_end", self, model, metrics)
        self.fabric.log_dict(metrics, step=self.global_step)
        if self.is_global_zero:
            for name, text in samples.items():
                self.logger.experiment.add_text(f"samples/{name}", text, global_step=self.global_step)
        summary = "  ".join(f"{k.split('/', 1)[1]}={v:.2f}" for k, v in metrics.items()
                            if k.endswith(("/success_weak", "/success_strong", "greedy_success_weak")))
        self.print(f"[eval] step {self.global_step}: {summary}")

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, model, datamodule) -> Path:
        """Write ``step=<k>.ckpt`` and ``last.ckpt`` atomically; prune old ones."""
        folder = Path(self.log_dir) / "checkpoints"
        state = {
            "format": "mrl-lightning", "version": 1,
            "counters": {"global_step": self.global_step, "rollout_step": self.rollout_step,
                         "samples_seen": self.samples_seen, "optimizer_steps": dict(self.optimizer_steps)},
            "policies": {name: {"model": p.model.state_dict(), "optimizer": self._modules[name][1].state_dict()}
                         for name, p in model.policies.items()},
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
            "data": datamodule.state_dict(),
            "rng": rng_state(),
        }
        path = folder / f"step={self.global_step}.ckpt"
        if self.is_global_zero:
            # last.ckpt first, so it is never older than a step file; the step file is a hard
            # link to the same bytes, put in place atomically too.
            last = folder / "last.ckpt"
            atomic_save(state, last)
            tmp = folder / f".{path.name}.link"
            if tmp.exists():
                tmp.unlink()
            os.link(last, tmp)
            os.replace(tmp, path)
            old = sorted(folder.glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
            for stale in old[: -self.keep_checkpoints]:
                stale.unlink()
        self.fabric.barrier()
        return path

    def _load(self, state: dict[str, Any], model, datamodule) -> None:
        for name, policy in model.policies.items():
            try:
                policy.model.load_state_dict(state["policies"][name]["model"])
            except RuntimeError as exc:
                raise CheckpointError(
                    f"policy {name!r}: the checkpoint's weights do not fit the configured model "
                    f"({str(exc).splitlines()[0]} ...); resume with the config the checkpoint was made with."
                ) from exc
            self._modules[name][1].load_state_dict(state["policies"][name]["optimizer"])
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
        set_rng_state(state["rng"])

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
