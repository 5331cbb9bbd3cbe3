"""Console output of the loop: the progress display (rich) and the lines that end a run."""

from __future__ import annotations

import datetime
import shlex
import time
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class RunProgress:
    """The run's progress on stderr: a rich bar over training steps with the latest key numbers on a terminal;
    in a pipe or a file (``| tee run.log``, a batch job's log), where a bar would show only at the end, one
    plain line at most every ``line_every_s`` seconds and at the last step (docs/loop.md, "Progress").

    Args:
        total: ``max_steps``.
        start: Steps already done (after a resume).
        enabled: False disables all output.
        line_every_s: Least seconds between two plain lines (not a terminal only).
        console: Where it goes; None = stderr.
        clock: Seconds, monotonic (tests pass their own).
    """

    def __init__(self, total: int, start: int = 0, enabled: bool = True, line_every_s: float = 30.0,
                 console: Console | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled, self.total, self.start, self.line_every_s, self.clock = enabled, total, start, line_every_s, clock
        self.console = console or Console(stderr=True)
        self.lines = enabled and not (self.console.is_terminal or self.console.is_jupyter)  # a notebook: its widget
        self.progress = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(), TextColumn("<"),
            TimeRemainingColumn(), TextColumn("{task.description}"), console=self.console,
            disable=not enabled or self.lines,
        )
        self.task = self.progress.add_task("", total=total, completed=start)
        self.started = self.last_line = clock()
        self.printed = start  # the step of the last plain line

    def __enter__(self) -> RunProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, metrics: dict[str, float], last_eval: dict[str, float]) -> None:
        parts = []
        for key, value in metrics.items():
            if key.startswith("rollout/") and key.endswith("/reward_mean"):
                parts.append(f"{key.split('/')[1]} r={value:.2f}")
        for key, value in last_eval.items():
            if key.endswith("/success_weak"):
                parts.append(f"{key.split('/')[1]} weak={value:.2f}")
        self.progress.update(self.task, completed=step, description=" ".join(parts))
        now = self.clock()
        if self.lines and step > self.printed and (now - self.last_line >= self.line_every_s or step >= self.total):
            self.last_line, self.printed = now, step
            self.console.print(self._line(step, now, " ".join(parts)), highlight=False, markup=False,
                               soft_wrap=True)

    def _line(self, step: int, now: float, numbers: str) -> str:
        """``step 120/5000 (2%) 0:01:03 elapsed, 0:42:51 left | gpt2 r=0.45 ...``: the time left at this run's rate."""
        elapsed = now - self.started
        left = elapsed / (step - self.start) * (self.total - step)
        clock = lambda seconds: str(datetime.timedelta(seconds=round(seconds)))  # noqa: E731
        return (f"step {step}/{self.total} ({100 * step // max(self.total, 1)}%) {clock(elapsed)} elapsed, "
                f"{clock(left)} left" + (f" | {numbers}" if numbers else ""))


def interrupted_line(step: int, last_checkpoint: Path, checkpoint_every_n_steps: int,
                     phase: str | None = None) -> str:
    """What Ctrl-C prints: where it stopped and the ``--ckpt_path`` to resume from (shell-quoted).

    Args:
        step: Training steps done (``global_step``).
        last_checkpoint: The run's ``last.ckpt`` (it may not exist yet).
        checkpoint_every_n_steps: The checkpoint period (named in the hint).
        phase: The loop's phase Ctrl-C stopped (``build``, ``rollout``, ``update``, ``checkpoint``,
            ``eval``, ..., ``finish``: after the last step); None = not known.
    """
    every = f"trainer.checkpoint_every_n_steps: {checkpoint_every_n_steps}"
    hint = (f"resume with --ckpt_path {shlex.quote(str(last_checkpoint))} (the newest checkpoint; the steps after "
            f"it are run again, as often as {every} says)" if last_checkpoint.exists()
            else f"no checkpoint was written yet ({every}; lower it to lose fewer steps)"
            + (f"; {shlex.quote(str(last_checkpoint.parent.parent))} holds only this run's config and logs (delete "
               "it, or keep it to read them)" if last_checkpoint.parent.parent.is_dir() else ""))
    where = {"build": f"while the models were built (a recipe's warm-start included), before step {step + 1}",
             "eval": f"during the evaluation at step {step}",
             "checkpoint": f"while the checkpoint of step {step} was written (the previous one is intact)",
             "finish": f"while the run was finishing, after its last step ({step})",
             None: f"during step {step + 1}"}.get(phase, f"during step {step + 1} ({phase})")
    return f"\nInterrupted {where}; {hint}."


def done_line(step: int, last_checkpoint: Path, root_dir: str, replay: bool = False) -> str:
    """What a finished run prints: its last checkpoint, how to continue, where the logs are (paths shell-quoted).
    A replay's cannot go beyond the run's log: no way on is offered (docs/see.md, "Replay")."""
    last = shlex.quote(str(last_checkpoint))
    on = "a replay's: it holds the policies trained again" if replay else \
        f"continue to a larger trainer.max_steps with --ckpt_path {last}"
    return f"Done at step {step}. Checkpoint: {last} ({on}). Logs: tensorboard --logdir {shlex.quote(str(root_dir))}"


def stop_context(trainer, watch):
    """The :class:`~mrl_lightning.run.stop.StopContext` of ``trainer``'s rank: what ``mrl`` says when the run stops."""
    from mrl_lightning.lifeline import is_launched_worker
    from mrl_lightning.run.stop import StopContext

    placement = trainer.ctx.placement
    stopped_in = trainer.workers.stopped_in if trainer.workers is not None else None
    if stopped_in is None and trainer.global_step >= trainer.max_steps:
        stopped_in = ("finish", trainer.global_step)
    return StopContext(
        rank=trainer.fabric.global_rank, world_size=trainer.fabric.world_size, launched_worker=is_launched_worker(),
        watch=watch, policies_of=placement.policies_on if placement is not None else (lambda rank: []),
        interrupted_line=lambda: interrupted_line(trainer.global_step, trainer.last_checkpoint_path,
                                                  trainer.checkpoint_every_n_steps, stopped_in and stopped_in[0]),
        traceback_dir=trainer.log_dir if Path(trainer.log_dir).is_dir() else None, stopped_in=stopped_in,
        last_checkpoint=trainer.last_checkpoint_path)
