"""The benchmarks' statistics for judging a training variant against its baseline over seeds.

A variant is judged by ``paired_seed_difference`` (per-seed differences against the baseline run with the same seed,
and a t interval from ``student_t_quantile``; ``format_paired_difference`` writes it as a table cell) and
``verdict``: "shown" only when the interval excludes 0 on the goal's side and every other goal holds.

These are the statistics of a training experiment (several seeds per variant), so they live with the benchmarks;
the statistics that validate a signal against labels on one model's rollouts are ``trl_mdi.profile.validation``.
Inputs are Mappings (seed -> value) or sequences indexed by seed; outputs are Python floats, dicts and strings.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def _t_two_sided_mass(t: float, df: int) -> float:
    """``A(t | df) = P(|T| <= t)`` for Student's t with an integer ``df`` (Abramowitz & Stegun 26.7.3-4).

    With ``theta = atan(t / sqrt(df))`` and ``c = cos(theta)``:
    odd df: ``(2 / pi) (theta + sin(theta) (c + 2/3 c^3 + ... + (2 4 ... (df-3)) / (1 3 ... (df-2)) c^(df-2)))``
    (``2 theta / pi`` for df = 1); even df: ``sin(theta) (1 + 1/2 c^2 + ... + (1 3 ... (df-3)) / (2 4 ... (df-2))
    c^(df-2))``. Exact finite sums: no special function needed (scipy is not a dependency).
    """
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:
        series, term = 0.0, math.cos(theta)
        for k in range(1, (df - 1) // 2 + 1):  # (df - 1) / 2 terms: c, 2/3 c^3, ...
            series += term
            term *= (2 * k) / (2 * k + 1) * c2
        return 2.0 / math.pi * (theta + math.sin(theta) * series)
    series, term = 0.0, 1.0
    for k in range(1, df // 2 + 1):  # df / 2 terms: 1, 1/2 c^2, ...
        series += term
        term *= (2 * k - 1) / (2 * k) * c2
    return math.sin(theta) * series


def student_t_quantile(p: float, df: int) -> float:
    """The ``p``-quantile of Student's t distribution with ``df`` (an integer >= 1) degrees of freedom.

    Solves ``P(|T| <= t) = 2p - 1`` (``_t_two_sided_mass``, exact for integer df) by bisection to 1e-12 relative;
    symmetric: ``q(1 - p) = -q(p)``. For a two-sided 95% interval take ``p = 0.975``.

    >>> [round(student_t_quantile(0.975, df), 3) for df in (1, 4, 30)]
    [12.706, 2.776, 2.042]
    """
    if isinstance(df, bool) or not isinstance(df, (int, np.integer)) or df < 1:
        raise ValueError(f"df must be an integer >= 1 (the number of paired seeds minus 1), got {df!r}")
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p!r}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    target = 2.0 * p - 1.0
    low, high = 0.0, 1.0
    while _t_two_sided_mass(high, df) < target:
        low, high = high, 2.0 * high
    for _ in range(200):
        mid = (low + high) / 2.0
        if _t_two_sided_mass(mid, df) < target:
            low = mid
        else:
            high = mid
        if high - low <= 1e-12 * high:
            break
    return (low + high) / 2.0


def _by_seed(values: Mapping[Any, Any] | Sequence[Any]) -> dict[Any, float]:
    items = values.items() if isinstance(values, Mapping) else enumerate(values)
    return {seed: math.nan if v is None else float(v) for seed, v in items}


def paired_seed_difference(variant_by_seed: Mapping[Any, Any] | Sequence[Any],
                           baseline_by_seed: Mapping[Any, Any] | Sequence[Any], *,
                           level: float = 0.95) -> dict[str, Any]:
    """Paired differences by seed: the variant minus the baseline run with the same seed, and a t interval.

        d_s = variant_s - baseline_s,  mean = sum_s d_s / n,  sd = sqrt(sum_s (d_s - mean)^2 / (n - 1)),
        interval = mean -+ t_{(1 + level) / 2, n - 1} sd / sqrt(n)

    Pairing removes what a seed does to both runs (the same prompts drawn, the same sampling noise early on), so
    the interval is about the difference the variant makes, not about how much runs vary. ``variant_by_seed`` /
    ``baseline_by_seed``: seed -> final value (a Mapping), or sequences indexed by seed. Only seeds with a finite
    value on both sides are paired; the others are listed in ``unpaired``. With fewer than 2 pairs ``sd`` and the
    interval are NaN.

    Returns ``n``, ``seeds``, ``differences`` (per paired seed, in seed order), ``mean``, ``sd``, ``se``, ``df``,
    ``t`` (the quantile used), ``low``, ``high``, ``level``, ``unpaired``.

    >>> d = paired_seed_difference({0: 3, 1: 5, 2: 4, 3: 6, 4: 2}, {0: 1, 1: 2, 2: 2, 3: 3, 4: 1})
    >>> d["differences"], d["mean"], round(d["sd"], 4), round(d["t"], 3), round(d["low"], 3), round(d["high"], 3)
    ([2.0, 3.0, 2.0, 3.0, 1.0], 2.2, 0.8367, 2.776, 1.161, 3.239)
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    variant, baseline = _by_seed(variant_by_seed), _by_seed(baseline_by_seed)
    both = [s for s in variant if s in baseline and math.isfinite(variant[s]) and math.isfinite(baseline[s])]
    try:
        both = sorted(both)
    except TypeError:  # seeds of mixed types: keep the variant's order
        pass
    unpaired = [s for s in list(variant) + [s for s in baseline if s not in variant] if s not in both]
    diffs = [variant[s] - baseline[s] for s in both]
    n = len(diffs)
    mean = statistics.fmean(diffs) if n else math.nan
    out = {"n": n, "seeds": both, "differences": diffs, "mean": mean, "sd": math.nan, "se": math.nan,
           "df": n - 1 if n else 0, "t": math.nan, "low": math.nan, "high": math.nan, "level": level,
           "unpaired": unpaired}
    if n >= 2:
        sd = statistics.stdev(diffs)
        t = student_t_quantile((1.0 + level) / 2.0, n - 1)
        se = sd / math.sqrt(n)
        out.update(sd=sd, se=se, t=t, low=mean - t * se, high=mean + t * se)
    return out


def format_paired_difference(difference: Mapping[str, Any], digits: int = 3) -> str:
    """``paired_seed_difference``'s dict as a table cell: ``mean [low, high] (n seeds)``, signed; "—" without pairs.

    >>> format_paired_difference({"n": 5, "mean": 0.049, "low": -0.021, "high": 0.119, "level": 0.95})
    '+0.049 [-0.021, +0.119] (5 seeds)'
    >>> format_paired_difference({"n": 1, "mean": 0.2, "low": float("nan"), "high": float("nan")})
    '+0.200 (1 seed, no interval)'
    """
    n = int(difference.get("n", 0))
    mean = difference.get("mean", math.nan)
    if not n or mean is None or math.isnan(mean):
        return "—"
    low, high = difference.get("low", math.nan), difference.get("high", math.nan)
    if n < 2 or low is None or high is None or math.isnan(low) or math.isnan(high):
        return f"{mean:+.{digits}f} ({n} seed{'s' if n != 1 else ''}, no interval)"
    return f"{mean:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}] ({n} seeds)"


_NEGATED = {">=": "<", ">": "<=", "<=": ">", "<": ">="}
_HOLDS = {">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b, "<": lambda a, b: a < b}


def verdict(difference: Mapping[str, Any], *, direction: str = "higher", min_effect: float = 0.0,
            goals: Sequence[tuple[str, Any, str, float]] = (), digits: int = 3) -> dict[str, Any]:
    """"shown" only when the paired interval excludes 0 on the goal's side AND every other goal holds.

    ``difference``: ``paired_seed_difference``'s dict. ``direction``: ``"higher"`` (the variant should raise the
    value: the interval must lie above 0) or ``"lower"`` (below 0). ``min_effect``: the size the mean difference
    must also reach, on the same side (e.g. 0.30 for "conflict accuracy >= the baseline's + 0.30"; 0 = any).
    ``goals``: other conditions, each ``(label, value, op, threshold)`` with op one of ``>=``, ``>``, ``<=``, ``<``
    (e.g. ``("non-conflict", 0.95, ">=", 0.98)``); a value that is None or NaN fails as "not measured".

    A mean that meets the goal while the interval includes 0 is "not shown": over a few seeds such a mean is as
    likely to come from seed noise as from the variant. Returns ``shown`` (bool), ``verdict`` ("shown" / "not
    shown"), ``reasons`` (every failed condition, in words) and ``text`` ("shown", or "not shown: " + the reasons).

    >>> d = {"n": 5, "mean": 0.045, "low": -0.02, "high": 0.11}
    >>> verdict(d, goals=[("non-conflict", 0.95, ">=", 0.98)], digits=2)["text"]
    'not shown: interval [-0.02, 0.11] includes 0; non-conflict 0.95 < 0.98'
    >>> verdict({"n": 5, "mean": 0.4, "low": 0.31, "high": 0.49}, min_effect=0.3)["text"]
    'shown'
    """
    if direction not in ("higher", "lower"):
        raise ValueError(f"direction must be 'higher' or 'lower' (the side the variant should move the value to), "
                         f"got {direction!r}")
    sign = 1.0 if direction == "higher" else -1.0
    n, mean = int(difference.get("n", 0)), difference.get("mean", math.nan)
    low, high = difference.get("low", math.nan), difference.get("high", math.nan)

    def num(x: Any) -> float:
        return math.nan if x is None else float(x)

    mean, low, high = num(mean), num(low), num(high)
    reasons = []
    if n < 2 or math.isnan(low) or math.isnan(high):
        reasons.append("no paired seeds" if n == 0 else
                       f"{n} paired seed{'s' if n != 1 else ''}: no interval (needs 2 or more)")
    else:
        span = f"[{low:.{digits}f}, {high:.{digits}f}]"
        if low <= 0.0 <= high:
            reasons.append(f"interval {span} includes 0")
        elif sign * low < 0 and sign * high < 0:  # the whole interval on the wrong side
            reasons.append(f"interval {span} lies {'below' if sign > 0 else 'above'} 0: the variant is worse")
    if min_effect and not sign * mean >= abs(min_effect):  # NaN fails too
        goal = sign * abs(min_effect)
        reasons.append(f"mean difference {mean:+.{digits}f} {'<' if sign > 0 else '>'} {goal:+g}"
                       if not math.isnan(mean) else "mean difference not measured")
    for label, value, op, threshold in goals:
        if op not in _HOLDS:
            raise ValueError(f"goal {label!r}: op must be one of {sorted(_HOLDS)}, got {op!r}")
        value = num(value)
        if math.isnan(value):
            reasons.append(f"{label} not measured")
        elif not _HOLDS[op](value, threshold):
            reasons.append(f"{label} {value:.{digits}f} {_NEGATED[op]} {threshold:g}")
    shown = not reasons
    return {"shown": shown, "verdict": "shown" if shown else "not shown", "reasons": reasons,
            "text": "shown" if shown else "not shown: " + "; ".join(reasons)}
