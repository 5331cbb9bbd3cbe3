"""Step scalars that say how they combine: over a policy's ranks, and over a log window.

A metric is produced as a plain ``float`` or as one of the kinds below, chosen where it is
produced (the producer knows what the number is; the loop and MWRA do not):

=================  =========================================  ===================================
kind               across the ranks that report it (a step)   over a log window (its steps)
=================  =========================================  ===================================
plain ``float``    mean                                       mean
:class:`Sum`       sum (counts; loss parts already divided    mean
                   by the group's totals)
:class:`Mean`      mean weighted by its ``weight`` (rates     mean
                   over tokens, sequences, prompts)
:class:`Max`       max                                        max
:class:`Min`       min                                        min
:class:`Moments`   recomputed from pooled n, sum, sum of      mean
                   squares (a std, Bessel-corrected)
:class:`Ratio`     pooled numerator over pooled denominator   mean
                   (a share of counts, e.g. boundary agreement)
:class:`ESS`       recomputed from the pooled weights (an     mean
                   effective sample share)
:class:`Global`    the first rank's (the same on every rank:  the last step's
                   run-wide counters, what SEE holds)
=================  =========================================  ===================================

A tag reported by one rank only is taken as it is. Every kind is a ``float`` subclass, so
a value reads, compares and logs as the number it is; the kind travels with it through
``torch.distributed``'s object collectives (pickling keeps the subclass and its fields).
Formulas: weighted mean ``sum(w_r x_r) / sum(w_r)``; pooled std
``sqrt((S2 - S1^2 / n) / (n - 1))`` over the ranks' ``n``, ``S1 = sum x``, ``S2 = sum x^2``;
ratio ``sum(num_r) / sum(den_r)``; effective sample share ``(sum w)^2 / (n sum w^2)`` of
importance weights ``w = exp(log w)``, pooled from each rank's ``(n, m, sum e^(lw-m),
sum e^(2(lw-m)))`` with ``m`` its largest log-weight (scale-free, so no overflow).
"""

from __future__ import annotations

import math
from collections.abc import Iterable


class Sum(float):
    """A count (or a loss part already divided by the group's totals): summed over ranks."""


class Max(float):
    """A maximum: the largest over ranks."""


class Min(float):
    """A minimum: the smallest over ranks."""


class Global(float):
    """A run-wide value every rank holds alike (cumulative counters, SEE's counters).

    Over ranks: the first rank's; over a log window: the last step's (a counter, not a rate).
    """


class Mean(float):
    """A mean over ``weight`` units (tokens, sequences, prompts): weighted over ranks.

    Args:
        value: The mean on this rank.
        weight: How many units it averages (>= 0); a rank with weight 0 does not count.
    """

    def __new__(cls, value: float, weight: float = 1.0) -> Mean:
        obj = super().__new__(cls, value)
        obj.weight = float(weight)
        return obj


class Moments(float):
    """A standard deviation (Bessel) that is recomputed from pooled moments over ranks.

    Build it with :meth:`of`; ``n``, ``total`` (sum) and ``total_sq`` (sum of squares) travel with it.
    """

    def __new__(cls, value: float, n: float = 0.0, total: float = 0.0, total_sq: float = 0.0) -> Moments:
        obj = super().__new__(cls, value)
        obj.n, obj.total, obj.total_sq = float(n), float(total), float(total_sq)
        return obj

    @classmethod
    def of(cls, values: Iterable[float], std: float | None = None) -> Moments:
        """The std of ``values`` with their moments.

        Args:
            values: The samples (finite floats).
            std: The std to report on this rank (e.g. computed by torch, for bit-equality with
                an earlier log); None = computed here. 0 for fewer than 2 values.
        """
        xs = [float(x) for x in values]
        n, s1, s2 = float(len(xs)), math.fsum(xs), math.fsum(x * x for x in xs)
        return cls(_pooled_std(n, s1, s2) if std is None else std, n, s1, s2)


class Ratio(float):
    """A share of two counts, ``num / den``; over ranks the pooled ``sum num / sum den``.

    Args:
        num: This rank's numerator.
        den: This rank's denominator (> 0 for the value to be defined).
        empty: The value when the pooled denominator is 0.
    """

    def __new__(cls, num: float, den: float = 1.0, empty: float = 0.0) -> Ratio:  # den 1: unpickling gives the value
        obj = super().__new__(cls, num / den if den else empty)
        obj.num, obj.den, obj.empty = float(num), float(den), float(empty)
        return obj


class ESS(float):
    """Effective sample share of importance weights, ``(sum w)^2 / (n sum w^2)`` in (0, 1].

    Build it with :meth:`of`; it carries ``n``, ``m`` (the largest log-weight) and the sums of
    ``exp(lw - m)`` and ``exp(2 (lw - m))`` so that ranks pool exactly.
    """

    def __new__(cls, value: float, n: float = 0.0, m: float = 0.0, s1: float = 0.0, s2: float = 0.0) -> ESS:
        obj = super().__new__(cls, value)
        obj.n, obj.m, obj.s1, obj.s2 = float(n), float(m), float(s1), float(s2)
        return obj

    @classmethod
    def of(cls, log_weights, value: float | None = None) -> ESS:
        """From a 1-D tensor of log-weights; ``value`` overrides the reported number (bit-equality)."""
        n = int(log_weights.numel())
        if n == 0:
            return cls(0.0)
        m = float(log_weights.max())
        w = (log_weights - m).exp()
        s1, s2 = float(w.sum()), float((w * w).sum())
        return cls(s1 * s1 / (s2 * n) if value is None else value, n, m, s1, s2)


def _pooled_ess(values: list) -> ESS:
    parts = [v for v in values if getattr(v, "n", 0.0) > 0]
    if not parts:
        return ESS(0.0)
    top = max(v.m for v in parts)
    s1 = sum(v.s1 * math.exp(v.m - top) for v in parts)
    s2 = sum(v.s2 * math.exp(2.0 * (v.m - top)) for v in parts)
    n = sum(v.n for v in parts)
    return ESS(s1 * s1 / (s2 * n), n, top, s1, s2)


def _pooled_std(n: float, s1: float, s2: float) -> float:
    if n < 2:
        return 0.0
    return math.sqrt(max(s2 - s1 * s1 / n, 0.0) / (n - 1.0))


def _combine(values: list[float]) -> float:
    first = values[0]
    if isinstance(first, Global):
        return first
    if isinstance(first, Sum):
        return Sum(sum(values))
    if isinstance(first, Max):
        return Max(_extreme(max, values))
    if isinstance(first, Min):
        return Min(_extreme(min, values))
    if isinstance(first, Mean):
        weights = [getattr(v, "weight", 1.0) for v in values]
        total = sum(weights)
        if total <= 0:
            return Mean(sum(values) / len(values), 0.0)
        return Mean(sum(w * v for w, v in zip(weights, values) if w > 0) / total, total)
    if isinstance(first, Ratio):
        num = sum(getattr(v, "num", 0.0) for v in values)
        den = sum(getattr(v, "den", 0.0) for v in values)
        return Ratio(num, den, getattr(first, "empty", 0.0))
    if isinstance(first, ESS):
        return _pooled_ess(values)
    if isinstance(first, Moments):
        n = sum(getattr(v, "n", 0.0) for v in values)
        s1 = sum(getattr(v, "total", 0.0) for v in values)
        s2 = sum(getattr(v, "total_sq", 0.0) for v in values)
        return Moments(_pooled_std(n, s1, s2), n, s1, s2)
    return sum(values) / len(values)


def combine_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from several ranks, each tag combined by its kind (module docstring).

    Args:
        per_rank: Each rank's metrics of the same step, in rank order.

    Returns:
        Tag -> combined value (a tag reported by one rank: its value as it is).
    """
    values: dict[str, list[float]] = {}
    for metrics in per_rank:
        for key, value in metrics.items():
            values.setdefault(key, []).append(value)
    return {key: vals[0] if len(vals) == 1 else _combine(vals) for key, vals in values.items()}


def _extreme(pick, values) -> float:
    """``max`` / ``min`` of floats, NaN when any is NaN (Python's would depend on where the NaN sits)."""
    values = [float(v) for v in values]
    return math.nan if any(v != v for v in values) else float(pick(values))


def window_reduce(steps: list[dict[str, float]]) -> dict[str, float]:
    """A log window's metrics: each tag's mean over the steps that report it; a :class:`Max` the
    largest, a :class:`Min` the smallest of those steps (a bound must show its worst step), a
    :class:`Global` the last.

    Args:
        steps: The window's per-step metrics (already combined over ranks), oldest first.

    Returns:
        Tag -> plain float, ready to log.
    """
    values: dict[str, list[float]] = {}
    for metrics in steps:
        for key, value in metrics.items():
            values.setdefault(key, []).append(value)
    out = {}
    for key, vals in values.items():
        last = vals[-1]
        if isinstance(last, Global):
            out[key] = float(last)
        elif isinstance(last, Max):
            out[key] = _extreme(max, vals)
        elif isinstance(last, Min):
            out[key] = _extreme(min, vals)
        else:
            out[key] = sum(vals) / len(vals)
    return out
