"""Console progress display for the loop (rich)."""

from __future__ import annotations

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
