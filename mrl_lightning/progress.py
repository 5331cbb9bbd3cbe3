"""Console output of the loop: the progress display (rich) and the lines that end a run."""

from __future__ import annotations

import shlex
from pathlib import Path

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
    """A rich progress bar over training steps with the latest key numbers.

    Args:
        total: ``max_steps``.
        start: Steps already done (after a resume).
        enabled: False disables all output.
    """

    def __init__(self, total: int, start: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(), TextColumn("<"),
            TimeRemainingColumn(), TextColumn("{task.description}"), console=Console(stderr=True),
            disable=not enabled,
        )
        self.task = self.progress.add_task("", total=total, completed=start)

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
            else f"no checkpoint was written yet ({every}; lower it to lose fewer steps)")
    where = {"build": f"while the models were built (a recipe's warm-start included), before step {step + 1}",
             "eval": f"during the evaluation at step {step}",
             "checkpoint": f"while the checkpoint of step {step} was written (the previous one is intact)",
             "finish": f"while the run was finishing, after its last step ({step})",
             None: f"during step {step + 1}"}.get(phase, f"during step {step + 1} ({phase})")
    return f"\nInterrupted {where}; {hint}."


def done_line(step: int, last_checkpoint: Path, root_dir: str) -> str:
    """What a finished run prints: its last checkpoint, how to continue, where the logs are (paths shell-quoted)."""
    last = shlex.quote(str(last_checkpoint))
    return (f"Done at step {step}. Checkpoint: {last} (continue to a larger trainer.max_steps with --ckpt_path "
            f"{last}). Logs: tensorboard --logdir {shlex.quote(str(root_dir))}")
