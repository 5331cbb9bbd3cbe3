"""math-verify as a strict reward function for GSM8K / MATH prompts (SPEC 0, SPEC 1 step 3, SPEC 8).

The reward is 1.0 when math-verify finds the completion's final answer equal to the
prompt's reference answer (``PromptItem.answer``), 0.0 otherwise, and NaN when the
reference itself cannot be parsed (the prompt cannot be scored). Being exact, it is
``strict`` and its successes may travel as SuccessRecords (SPEC 3.4, 5).

Final answer. math-verify's ``parse`` does not look inside ``<answer>`` tags
(FIELD_NOTES), so the answer is extracted first, by the first rule that finds one:

1. the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced;
2. the last ``<answer>...</answer>``;
3. the last ``#### x`` (GSM8K style), to the end of its line;
4. the last number in the text (``-1,234.5``, ``3/4``), so "The answer is 72." gives 72.

Both the answer and the reference are then handed to ``parse`` as ``\\boxed{...}``
(surrounding ``$`` stripped), which parsed all 500 MATH500 and 1,319 GSM8K references
here, including ``\\left( 3, \\frac{\\pi}{2} \\right)`` (bare, that one parses as ``3``).

Where it runs. math-verify bounds ``parse`` / ``verify`` with ``signal.alarm``, which
only the main thread may use: in any other thread the default timeouts raise
(FIELD_NOTES). Measured here (2 cores, 64 checks = 8 prompts x G 8): in-process 17-27 ms;
a 2-worker process pool 16-32 ms per call once started, and 0.06-0.14 s to start with
``fork`` (math-verify is imported in the parent first, so workers inherit sympy), about
2.5 s with ``spawn`` from a bare script, and more under ``mrl``: a spawned worker re-runs
``__main__``'s imports and unpickling ``score_pairs`` imports this package, i.e. torch and
lightning (~10 s here). So ``executor="auto"`` (default)
verifies in-process on the main thread, with the default timeouts, and in a process
pool from any other thread; ``executor="process"`` always uses the pool. The pool is
created on first use, reused, and started with ``fork`` where available: its workers
run only math-verify, never CUDA or OpenMP, which is what makes forking a process that
uses them acceptable (Python >= 3.12 warns about forking a threaded process; pass
``start_method: spawn`` to avoid fork at the start-up cost above). A broken or timed-out
pool yields NaN for its prompts and is rebuilt on the next call.
"""

from __future__ import annotations

import math
import multiprocessing
import re
import threading
import warnings
import weakref
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from importlib.metadata import version

from mrl_lightning.data.items import PromptItem
from mrl_lightning.errors import ConfigError
from mrl_lightning.rewards.base import RewardFunction

EXECUTORS = ("auto", "process")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_HASHES = re.compile(r"####\s*([^\n]+)")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces balance, else None."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def extract_final_answer(completion: str) -> str | None:
    """The completion's final answer by the first matching rule (module docstring, 1-4).

    Args:
        completion: Completion text.

    Returns:
        The answer text, stripped, or None when no rule finds one.
    """
    found = _last_boxed(completion)
    if found is None:
        tags = _ANSWER_TAG.findall(completion)
        found = tags[-1] if tags else None
    if found is None:
        hashes = _HASHES.findall(completion)
        found = hashes[-1] if hashes else None
    if found is None:
        numbers = _NUMBER.findall(completion)
        found = numbers[-1] if numbers else None
    if found is None or not found.strip():
        return None
    return found.strip()


def _as_boxed(answer: str) -> str:
    return "\\boxed{" + answer.strip().strip("$").strip() + "}"


def score_pairs(pairs: list[tuple[str, str | None]]) -> list[float]:
    """math-verify on (reference, extracted answer) pairs with the default timeouts.

    Must run on a main thread (of this process or of a pool worker). References are
    parsed once per call.

    Args:
        pairs: ``(reference answer, extracted answer or None)``.

    Returns:
        One float per pair: 1.0 equal, 0.0 not (or no answer), NaN reference unparseable.

    Raises:
        ValueError: called off a main thread (math-verify's ``signal.alarm`` timeouts).
    """
    from math_verify import parse, verify

    golds: dict[str, list] = {}
    out = []
    for gold, answer in pairs:
        if gold not in golds:
            golds[gold] = parse(_as_boxed(gold)) if gold and gold.strip() else []
        parsed_gold = golds[gold]
        if not parsed_gold:
            out.append(math.nan)
            continue
        parsed = parse(_as_boxed(answer)) if answer else []
        out.append(1.0 if parsed and verify(parsed_gold, parsed) else 0.0)
    return out


class MathVerifyReward(RewardFunction):
    """1.0 when math-verify accepts the completion's final answer, else 0.0; NaN = cannot score.

    Args:
        executor: "auto" (in-process on the main thread, a process pool elsewhere) or
            "process" (always the pool).
        max_workers: Pool processes.
        start_method: multiprocessing start method of the pool; None = "fork" where
            available, else the platform default.
        timeout_s: Wall-clock limit for one call's pool work; past it the call's
            prompts get NaN and the pool is rebuilt.

    Raises:
        ConfigError: unknown executor or start method, max_workers < 1, timeout_s <= 0.
    """

    def __init__(
        self,
        executor: str = "auto",
        max_workers: int = 2,
        start_method: str | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        methods = multiprocessing.get_all_start_methods()
        if start_method is None:
            start_method = "fork" if "fork" in methods else None
        errors = []
        if executor not in EXECUTORS:
            errors.append(f"MathVerifyReward.executor={executor!r}; valid: {list(EXECUTORS)}.")
        if start_method is not None and start_method not in methods:
            errors.append(f"MathVerifyReward.start_method={start_method!r}; valid here: {methods} or null.")
        if max_workers < 1:
            errors.append(f"MathVerifyReward.max_workers={max_workers} must be >= 1.")
        if timeout_s <= 0:
            errors.append(f"MathVerifyReward.timeout_s={timeout_s} must be > 0.")
        if errors:
            raise ConfigError("Invalid reward config:\n  - " + "\n  - ".join(errors))
        self.name = "math_verify"
        self.version = f"math-verify=={version('math-verify')};extract=boxed>answer-tag>hashes>last-number"
        self.strict = True
        self.executor, self.max_workers = executor, max_workers
        self.start_method, self.timeout_s = start_method, timeout_s
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def __call__(self, completions: list[str], items: list[PromptItem]) -> list[float]:
        """Score completions against their prompts' reference answers.

        Args:
            completions: N completion texts.
            items: N prompts (``len(items) == len(completions)``).

        Returns:
            N floats in {0.0, 1.0} or NaN.

        Raises:
            ValueError: lengths differ.
        """
        pairs = [(item.answer, extract_final_answer(text)) for text, item in zip(completions, items, strict=True)]
        if not pairs:
            return []
        if self.executor == "auto" and threading.current_thread() is threading.main_thread():
            return score_pairs(pairs)
        return self._score_in_pool(pairs)

    def _get_pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                import math_verify  # noqa: F401 - imported once here, inherited by forked workers

                context = multiprocessing.get_context(self.start_method)
                self._pool = ProcessPoolExecutor(self.max_workers, mp_context=context)
                # shut down with this reward or at exit, before interpreter teardown
                weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
            return self._pool

    def _score_in_pool(self, pairs: list[tuple[str, str | None]]) -> list[float]:
        pool = self._get_pool()
        size = math.ceil(len(pairs) / self.max_workers)
        chunks = [pairs[i:i + size] for i in range(0, len(pairs), size)]
        try:
            futures = [pool.submit(score_pairs, chunk) for chunk in chunks]
            return [x for f in futures for x in f.result(timeout=self.timeout_s)]
        except (BrokenProcessPool, FutureTimeout) as exc:
            warnings.warn(f"MathVerifyReward: pool failed ({type(exc).__name__}); {len(pairs)} completions "
                          "scored NaN, the pool is rebuilt on the next call.", stacklevel=2)
            self.close(wait=False)
            return [math.nan] * len(pairs)

    def close(self, wait: bool = True) -> None:
        """Shut the process pool down (a later call starts a new one)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=True)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_pool"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
