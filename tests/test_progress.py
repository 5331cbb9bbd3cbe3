"""The run's progress where stderr is not a terminal: plain lines, rate-limited (docs/loop.md, "Progress")."""

from __future__ import annotations

import io

from rich.console import Console

from mrl_lightning.loop.progress import RunProgress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run(console: Console, total: int, start: int, seconds_per_step: float, every: float = 30.0) -> list[str]:
    clock = Clock()
    with RunProgress(total, start, console=console, line_every_s=every, clock=clock) as progress:
        for step in range(start + 1, total + 1):
            clock.now += seconds_per_step
            progress.update(step, {"rollout/gpt2/reward_mean": 0.25 * (step % 3)}, {"eval/gpt2/success_weak": 0.5})
            progress.update(step, {}, {})  # the loop's second call after an evaluation: no second line
    return console.file.getvalue().splitlines()


def test_a_pipe_gets_a_line_at_most_every_interval_and_at_the_last_step():
    lines = _run(Console(file=io.StringIO(), force_terminal=False, width=200), total=10, start=0,
                 seconds_per_step=12.0)
    # 12 s a step, a line at least 30 s after the previous one: steps 3, 6, 9, then the last step
    assert lines == [
        "step 3/10 (30%) 0:00:36 elapsed, 0:01:24 left | gpt2 r=0.00 gpt2 weak=0.50",
        "step 6/10 (60%) 0:01:12 elapsed, 0:00:48 left | gpt2 r=0.00 gpt2 weak=0.50",
        "step 9/10 (90%) 0:01:48 elapsed, 0:00:12 left | gpt2 r=0.00 gpt2 weak=0.50",
        "step 10/10 (100%) 0:02:00 elapsed, 0:00:00 left | gpt2 r=0.25 gpt2 weak=0.50",
    ]


def test_after_a_resume_the_rate_counts_this_runs_steps_only():
    lines = _run(Console(file=io.StringIO(), force_terminal=False, width=200), total=8, start=6, seconds_per_step=40.0)
    assert lines == ["step 7/8 (87%) 0:00:40 elapsed, 0:00:40 left | gpt2 r=0.25 gpt2 weak=0.50",
                     "step 8/8 (100%) 0:01:20 elapsed, 0:00:00 left | gpt2 r=0.50 gpt2 weak=0.50"]


def test_a_terminal_gets_the_bar_not_the_lines():
    out = "\n".join(_run(Console(file=io.StringIO(), force_terminal=True, width=200), total=4, start=0,
                         seconds_per_step=40.0))
    assert "elapsed," not in out and "4/4" in out


def test_disabled_prints_nothing_anywhere():
    for terminal in (False, True):
        console = Console(file=io.StringIO(), force_terminal=terminal, width=200)
        with RunProgress(3, 0, enabled=False, console=console, clock=Clock()) as progress:
            progress.update(3, {"rollout/gpt2/reward_mean": 1.0}, {})
        assert console.file.getvalue() == ""


def test_ctrl_c_before_the_first_checkpoint_names_the_run_folder_it_leaves(tmp_path):
    from mrl_lightning.loop.progress import interrupted_line

    run = tmp_path / "version_0"
    run.mkdir()
    line = interrupted_line(19, run / "checkpoints" / "last.ckpt", 20, "update")
    assert line.endswith(f"no checkpoint was written yet (trainer.checkpoint_every_n_steps: 20; lower it to lose "
                         f"fewer steps); {run} holds only this run's config and logs (delete it, or keep it to read "
                         "them).")
    assert "holds only" not in interrupted_line(0, tmp_path / "absent" / "checkpoints" / "last.ckpt", 20, "build")
