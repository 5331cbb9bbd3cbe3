"""math-verify as a strict reward function for GSM8K / MATH prompts.

The reward is 1.0 when math-verify finds the completion's final answer equal to the
prompt's reference answer (``PromptItem.answer``), 0.0 otherwise, and NaN ("no score")
when the reference itself cannot be parsed or the check ran out of time. Being exact, it
is ``strict`` and its successes may be shared with other policies as verified successes.

Final answer: found by math-verify's own extractors, plus the few rules the library
misses (``<answer>`` tags, GSM8K ``####`` lines, escaped dollars, plain-text tuples); see
:mod:`mrl_lightning.rewards.answers` and ``docs/answers.md``.

Time bound. Each (reference, completion) check runs under a wall-clock deadline of
``answer_timeout_s`` (``signal.setitimer``; past it the check scores NaN), and a call
never runs past ``timeout_s`` in all. math-verify's own ``signal.alarm`` timeouts are
turned off, since they would cancel that timer and score a timed-out check 0.0 rather
than NaN. Measured here: ``\\boxed{9^{9^{9^9}}}``, ``\\boxed{(10^{8})!}``, a 10,000-digit
power and 5,000 nested braces are all interrupted at the deadline. A hang in C code that
never returns to the interpreter cannot be interrupted by a signal; in the process pool
the call's ``timeout_s`` then ends it by terminating the workers.

Where it runs. Timers and signals belong to the main thread of a process (math-verify's
own ``signal.alarm`` raises in any other thread). Measured here (2 cores, 64 checks = 8
prompts x G 8): in-process 17-27 ms; a 2-worker process pool 16-32 ms per call once
started, and 0.06-0.14 s to start with ``fork`` (math-verify is imported in the parent
first, so workers inherit sympy), about 2.5 s with ``spawn`` from a bare script, and more
under ``mrl``: a spawned worker re-runs ``__main__``'s imports and unpickling
``score_pairs`` imports this package, i.e. torch and lightning (~10 s here). So
``executor="auto"`` (default) verifies in-process on the main thread and in a process
pool from any other thread; ``executor="process"`` always uses the pool. The pool is
created on first use, reused, and started with ``fork`` where available: its workers
run only math-verify, never CUDA or OpenMP, which is what makes forking a process that
uses them acceptable (Python >= 3.12 warns about forking a threaded process; pass
``start_method: spawn`` to avoid fork at the start-up cost above). A broken or timed-out
pool yields NaN for its unfinished checks, its workers are terminated, and a new pool
starts on the next call.
"""

from __future__ import annotations

import math
import multiprocessing
import signal
import threading
import time
import warnings
import weakref
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from importlib.metadata import version

from mrl_lightning.data.items import PromptItem
from mrl_lightning.errors import ConfigError
from mrl_lightning.rewards.answers import answers_match, parse_final_answer, parse_reference
from mrl_lightning.rewards.base import RewardFunction

EXECUTORS = ("auto", "process")
REFIRE_S = 0.05
"""Seconds between a deadline's repeated signals once it has passed (one may be swallowed)."""


class CheckTimeout(BaseException):
    """A check ran past its deadline.

    A ``BaseException``, like math-verify's own timeout, so that the library's and sympy's
    ``except Exception`` handlers let it through instead of reading it as "not equal".
    """


@contextmanager
def deadline(seconds: float):
    """Raise :class:`CheckTimeout` in the block after ``seconds`` of wall-clock time.

    Uses ``signal.setitimer(ITIMER_REAL)``; the previous SIGALRM handler and a running
    timer of the caller are restored afterwards (the latter shortened by the time spent).
    The timer fires again every :data:`REFIRE_S` seconds until the block has ended, and a
    block whose deadline fired raises at its end: a handler's exception can land in a
    garbage-collector callback or a ``__del__``, where Python only prints it and the block
    runs on (CI saw a 5,000-brace parse run 30 s past its deadline that way).

    Args:
        seconds: Deadline, > 0.

    Raises:
        CheckTimeout: the block ran past the deadline.
        ValueError: not called from the main thread of the process (signals are delivered
            only there).
    """
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("deadline() needs the main thread of a process (signal.setitimer); "
                         "from another thread, score in a process pool (MathVerifyReward(executor='process')).")

    fired = False

    def _raise(signum, frame):
        nonlocal fired
        fired = True
        raise CheckTimeout(f"check ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, _raise)
    start = time.monotonic()
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, seconds, REFIRE_S)
    try:
        yield
        if fired:  # the handler's exception was swallowed inside the block
            raise CheckTimeout(f"check ran past {seconds} s")
    finally:
        try:  # nested, so that a signal landing in this cleanup still restores the handler
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, previous)
            if outer_delay > 0:
                left = max(outer_delay - (time.monotonic() - start), 1e-3)
                signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


def score_pairs(pairs: list[tuple[str, str]], answer_timeout_s: float, timeout_s: float) -> list[float]:
    """Check (reference, completion) pairs with math-verify, each under a deadline.

    Must run on the main thread of its process (this one or a pool worker). A reference
    is parsed once per call.

    Args:
        pairs: ``(reference answer, completion text)``.
        answer_timeout_s: Wall-clock limit of one check (parse both, verify), seconds.
        timeout_s: Limit of the whole call; checks left when it is spent score NaN.

    Returns:
        One float per pair: 1.0 equal, 0.0 not (or no answer found), NaN when the
        reference cannot be parsed or the check ran out of time.

    Raises:
        ValueError: called off the main thread of its process.
    """
    golds: dict[str, list | None] = {}
    out = []
    end = time.monotonic() + timeout_s
    for gold, completion in pairs:
        budget = min(answer_timeout_s, end - time.monotonic())
        score = math.nan
        if budget > 0:
            try:
                with deadline(budget):
                    if gold not in golds:
                        golds[gold] = None  # a reference that times out stays unscorable in this call
                        golds[gold] = parse_reference(gold)
                    if golds[gold]:
                        score = 1.0 if answers_match(golds[gold], parse_final_answer(completion)) else 0.0
            except CheckTimeout:
                score = math.nan
        out.append(score)
    return out


def _terminate(pool: ProcessPoolExecutor) -> None:
    """Stop a pool now, killing workers stuck in a check.

    ``shutdown`` alone leaves a stuck worker running (and the interpreter's exit waits for
    it). The worker processes are read from the pool's ``_processes`` mapping, the one
    place the standard library keeps them before Python 3.14's ``terminate_workers``.
    """
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()


class MathVerifyReward(RewardFunction):
    """1.0 when math-verify accepts the completion's final answer, else 0.0; NaN = no score.

    Args:
        executor: "auto" (in-process on the main thread, a process pool elsewhere) or
            "process" (always the pool).
        max_workers: Pool processes.
        start_method: multiprocessing start method of the pool; None = "fork" where
            available, else the platform default.
        answer_timeout_s: Wall-clock limit of one check (seconds); past it that
            completion scores NaN. A normal check takes about 0.5 ms.
        timeout_s: Wall-clock limit of one call (seconds): checks not done by then score
            NaN, and pool workers still busy are terminated (a new pool starts next call).

    Raises:
        ConfigError: unknown executor or start method, max_workers < 1, a timeout <= 0
            (all problems at once).
    """

    def __init__(
        self,
        executor: str = "auto",
        max_workers: int = 2,
        start_method: str | None = None,
        answer_timeout_s: float = 2.0,
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
        for key, value in (("answer_timeout_s", answer_timeout_s), ("timeout_s", timeout_s)):
            if value <= 0:
                errors.append(f"MathVerifyReward.{key}={value} must be > 0 (seconds).")
        if errors:
            raise ConfigError("Invalid reward config:\n  - " + "\n  - ".join(errors))
        self.name = "math_verify"
        self.version = (f"math-verify=={version('math-verify')};"
                        "extract=answer-tag>boxed>hashes>latex,expr;plain-tuples;no-score-on-timeout")
        self.strict = True
        self.executor, self.max_workers = executor, max_workers
        self.start_method = start_method
        self.answer_timeout_s, self.timeout_s = answer_timeout_s, timeout_s
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def __call__(self, completions: list[str], items: list[PromptItem]) -> list[float]:
        """Score completions against their prompts' reference answers.

        Args:
            completions: N completion texts.
            items: N prompts (``len(items) == len(completions)``).

        Returns:
            N floats in {0.0, 1.0} or NaN (reference unreadable, or out of time).

        Raises:
            ValueError: lengths differ.
        """
        pairs = [(item.answer, text) for text, item in zip(completions, items, strict=True)]
        if not pairs:
            return []
        if self.executor == "auto" and threading.current_thread() is threading.main_thread():
            return score_pairs(pairs, self.answer_timeout_s, self.timeout_s)
        return self._score_in_pool(pairs)

    def _get_pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                from mrl_lightning.rewards.answers import _library

                _library()  # math-verify and sympy imported once here, inherited by forked workers
                context = multiprocessing.get_context(self.start_method)
                self._pool = ProcessPoolExecutor(self.max_workers, mp_context=context)
                # stopped with this reward or at exit, before interpreter teardown
                weakref.finalize(self, _terminate, self._pool)
            return self._pool

    def _score_in_pool(self, pairs: list[tuple[str, str]]) -> list[float]:
        pool = self._get_pool()
        size = math.ceil(len(pairs) / self.max_workers)
        chunks = [pairs[i:i + size] for i in range(0, len(pairs), size)]
        end = time.monotonic() + self.timeout_s + 1.0  # the workers stop themselves at timeout_s
        out: list[float] = []
        failed: list[str] = []
        try:
            futures = [pool.submit(score_pairs, chunk, self.answer_timeout_s, self.timeout_s) for chunk in chunks]
        except BrokenProcessPool as exc:
            futures, failed = [], [type(exc).__name__]
        for chunk, future in zip(chunks, futures):
            try:
                out.extend(future.result(timeout=max(end - time.monotonic(), 0.0)))
            except (BrokenProcessPool, FutureTimeout) as exc:
                failed.append(type(exc).__name__)
                out.extend([math.nan] * len(chunk))
        if failed or len(out) != len(pairs):
            warnings.warn(f"MathVerifyReward: pool failed ({', '.join(sorted(set(failed)))}); "
                          f"{len(pairs) - len(out) + sum(map(math.isnan, out))} of {len(pairs)} completions scored "
                          "NaN; its workers were stopped and a new pool starts on the next call.", stacklevel=2)
            self.close(wait=False)
            out.extend([math.nan] * (len(pairs) - len(out)))
        return out

    def close(self, wait: bool = True) -> None:
        """Shut the process pool down (a later call starts a new one).

        Args:
            wait: Wait for idle workers to exit; False terminates them, busy or not.
        """
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is None:
            return
        if wait:
            pool.shutdown(wait=True, cancel_futures=True)
        else:
            _terminate(pool)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_pool"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
