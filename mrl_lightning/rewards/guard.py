"""What a reward function returns is checked before it can reach an advantage.

A reward function is user code (TRL's ``reward_funcs`` contract): it gets N completion
texts and their prompts and returns N numbers. :func:`checked_rewards` turns that into an
``[N]`` float32 tensor or stops the run with an error that names the function:

==========================================  ===============================================
returned                                    result
==========================================  ===============================================
N ints / floats / bools (NumPy and 0-d      used as they are
tensors too), a list, tuple, array or
1-D tensor of them
NaN                                         "not scored": left out of its group's mean and
                                            std, advantage 0 (``docs/grpo.md``)
``None`` for an entry                       NaN, as TRL reads ``None`` ("does not apply")
``+inf`` / ``-inf``                         :class:`RewardError`: an infinite reward makes
                                            its group's mean infinite and every advantage
                                            of the group NaN
a ``str`` or another non-number             :class:`RewardError` (a numeric string is not
                                            parsed: it usually means a bug upstream)
a different number of values, or None       :class:`RewardError`
or a non-sequence as the whole result
an exception                                :class:`RewardError` naming the function, the
                                            exception chained as its cause
==========================================  ===============================================

A reward function that may hang is wrapped in :class:`TimeLimitedReward`: past its
``timeout_s`` a call scores NaN, is counted and warned about, and the run goes on.
"""

from __future__ import annotations

import math
import numbers
import threading
import warnings
from typing import Any

import torch

from mrl_lightning.data.items import PromptItem
from mrl_lightning.errors import ConfigError
from mrl_lightning.rewards.base import RewardFunction


class RewardError(ValueError):
    """A reward function raised, or returned something that is not N finite numbers (or NaN / None)."""


def _describe(func: Any) -> str:
    name = getattr(func, "name", None)
    cls = type(func).__name__
    return f"reward function {name!r} ({cls})" if name and name != cls else f"reward function {cls}"


def _as_float(value: Any) -> float | None:
    """``value`` as a float, or None when it is not a number (str, list, object...)."""
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, (bool, numbers.Real)) or type(value).__module__ == "numpy" and hasattr(value, "item"):
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    return None


def checked_rewards(func: RewardFunction, completions: list[str], items: list[PromptItem]) -> torch.Tensor:
    """Call one reward function and check what it returns (table in the module docstring).

    Args:
        func: The reward function.
        completions: N completion texts.
        items: N prompts (one per completion).

    Returns:
        ``[N]`` float32 rewards, NaN = not scored.

    Raises:
        RewardError: the function raised, or returned a wrong count, a non-number or an
            infinite value (the message names the function, the entry, the value and the fix).
    """
    n = len(completions)
    who = _describe(func)
    try:
        raw = func(completions, items)
    except RewardError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of user code is named, then re-raised
        raise RewardError(f"{who} raised {type(exc).__name__}: {exc} (scoring {n} completions, first prompt "
                          f"{items[0].prompt_id if items else None!r}). Fix the function, or make it return NaN "
                          "(or None) for completions it cannot score.") from exc
    if isinstance(raw, torch.Tensor) or type(raw).__module__ == "numpy":
        raw = raw.tolist() if getattr(raw, "ndim", 1) else [raw.item()]
    if raw is None or isinstance(raw, (str, bytes, dict)) or not hasattr(raw, "__len__"):
        raise RewardError(f"{who} returned {type(raw).__name__} {str(raw)[:80]!r}; it must return a list of "
                          f"{n} numbers, one per completion (NaN or None = not scored).")
    if len(raw) != n:
        raise RewardError(f"{who} returned {len(raw)} values for {n} completions; it must return exactly one per "
                          "completion, in order (NaN or None for those it cannot score).")
    out = []
    for i, value in enumerate(raw):
        number = _as_float(value)
        if number is None:
            raise RewardError(f"{who} returned {type(value).__name__} {str(value)[:80]!r} at index {i} (prompt "
                              f"{items[i].prompt_id!r}); rewards must be numbers: convert it with float(), or return "
                              "NaN (or None) for a completion it cannot score.")
        if math.isinf(number):
            raise RewardError(f"{who} returned {number} at index {i} (prompt {items[i].prompt_id!r}); an infinite "
                              "reward makes its group's mean infinite and every advantage in the group NaN. Return "
                              "a finite reward (clip it), or NaN / None if the completion cannot be scored.")
        out.append(number)
    return torch.tensor(out, dtype=torch.float32)


class TimeLimitedReward(RewardFunction):
    """Any reward function under a wall-clock bound per call: past it the call scores NaN.

    On the main thread of a process the call is interrupted by a timer signal
    (:func:`mrl_lightning.rewards.math_verify.deadline`), which stops Python code (a loop,
    a regex that backtracks for ever, a sympy simplification) but not C code that never
    returns to the interpreter, nor code that catches ``BaseException``. Elsewhere the call
    runs in a helper thread that is abandoned when it runs over (it keeps running in the
    background). Either way the run goes on: every completion of a call that ran over
    scores NaN (not scored: advantage 0), ``timeouts`` counts such calls, and a warning
    names the function (on the 1st, 2nd, 4th, 8th... timeout). For a verifier that can
    hang in C code, run it in a process pool (``MathVerifyReward(executor="process")``).

    Args:
        reward: The reward function to bound (its ``name``, ``version`` and ``strict`` are kept).
        timeout_s: Wall-clock limit of one call, seconds (> 0).

    Raises:
        ConfigError: ``timeout_s <= 0`` or ``reward`` is not a RewardFunction.
    """

    def __init__(self, reward: RewardFunction, timeout_s: float = 30.0) -> None:
        errors = []
        if not isinstance(reward, RewardFunction):
            errors.append(f"TimeLimitedReward.reward={reward!r} is not a RewardFunction; give one by class_path.")
        if not timeout_s > 0:
            errors.append(f"TimeLimitedReward.timeout_s={timeout_s} must be > 0 (seconds).")
        if errors:
            raise ConfigError("Invalid reward config:\n  - " + "\n  - ".join(errors))
        self.reward, self.timeout_s = reward, float(timeout_s)
        self.name, self.version, self.strict = reward.name, reward.version, reward.strict
        self.calls = 0
        self.timeouts = 0

    def __call__(self, completions: list[str], items: list[PromptItem]) -> list[float]:
        self.calls += 1
        if threading.current_thread() is threading.main_thread():
            from mrl_lightning.rewards.math_verify import CheckTimeout, deadline

            try:
                with deadline(self.timeout_s):
                    return self.reward(completions, items)
            except CheckTimeout:
                return self._timed_out(len(completions))
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = self.reward(completions, items)
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
                box["error"] = exc

        worker = threading.Thread(target=run, name=f"reward-{self.name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            return self._timed_out(len(completions))
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _timed_out(self, n: int) -> list[float]:
        self.timeouts += 1
        if self.timeouts & (self.timeouts - 1) == 0:  # 1, 2, 4, 8, ...
            warnings.warn(f"reward function {self.name!r} ran past timeout_s={self.timeout_s} s; its {n} completions "
                          f"score NaN (not scored) and the run goes on. Timeouts so far: {self.timeouts} of "
                          f"{self.calls} calls. If this repeats, fix the function or raise timeout_s.", stacklevel=3)
        return [math.nan] * n
