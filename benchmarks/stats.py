"""The benchmarks' statistics for judging a training variant against its baseline over seeds.

A variant is judged by ``paired_seed_difference`` (per-seed differences against the baseline run with the same seed,
and a Student t interval, its quantile from ``scipy.stats.t``; ``format_paired_difference`` writes it as a table
cell) and
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
from scipy import stats as scipy_stats


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
        t = float(scipy_stats.t.ppf((1.0 + level) / 2.0, n - 1))
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


# ---------------------------------------------------------------------------------------------------------------
# The pre-registered replication's tests: exact sign-flip, Holm, and the decision rules (benchmarks/RESULTS.md)
# ---------------------------------------------------------------------------------------------------------------

SIGN_FLIP_MAX_PAIRS = 22
"""The exact test enumerates 2^n sign assignments: 22 pairs is 4.2 million, about a second."""


def sign_flip_p(differences: Sequence[float]) -> float:
    """Exact two-sided sign-flip test of a zero mean paired difference (Fisher's paired permutation test).

    Under the null each seed's difference is as likely to have either sign, so with ``d`` the ``n`` paired
    differences::

        p = #{s in {-1, +1}^n : |sum_i s_i d_i| >= |sum_i d_i|} / 2^n

    (all ``2^n`` assignments, the observed one included, so ``p >= 2 / 2^n`` for a nonzero mean: with 5 pairs no
    result can go below 0.0625). Ties count as at least as extreme (a relative tolerance of 1e-9 absorbs rounding).
    NaN without pairs; ValueError past ``SIGN_FLIP_MAX_PAIRS``.

    Why not a library: ``scipy.stats.permutation_test((d,), statistic, permutation_type="samples",
    n_resamples=numpy.inf)`` computes the same exact p (tests/test_benchmark_stats.py checks that they agree), but
    it lists every assignment as Python tuples (``itertools.product``) before evaluating them: at 20 pairs it took
    6 s and 1.3 GB here, against 0.14 s for this enumeration of the assignments as the bits of ``0 .. 2^n - 1``,
    evaluated 65,536 at a time in numpy, and 22 pairs would need about 4 times that.

    >>> sign_flip_p([0.1, 0.2, 0.3, 0.4, 0.5])
    0.0625
    >>> round(sign_flip_p([0.3, -0.1, 0.2, 0.25, 0.1, 0.4, -0.05, 0.2]), 4)
    0.0469
    >>> sign_flip_p([0.0, 0.0, 0.0])
    1.0
    """
    d = np.asarray([float(x) for x in differences], dtype=np.float64)
    n = d.size
    if n == 0:
        return math.nan
    if not np.isfinite(d).all():
        raise ValueError("sign_flip_p needs finite paired differences (pair the seeds first: paired_seed_difference)")
    if n > SIGN_FLIP_MAX_PAIRS:
        raise ValueError(f"{n} pairs: the exact test enumerates 2^{n} assignments; at most {SIGN_FLIP_MAX_PAIRS}")
    observed = abs(d.sum())
    tolerance = 1e-9 * max(1.0, float(np.abs(d).sum()))
    count = 0
    chunk = 1 << min(n, 16)
    bits = np.arange(n, dtype=np.int64)
    for start in range(0, 1 << n, chunk):
        codes = np.arange(start, start + chunk, dtype=np.int64)[:, None]
        signs = 1.0 - 2.0 * ((codes >> bits) & 1)
        count += int((np.abs(signs @ d) >= observed - tolerance).sum())
    return count / float(1 << n)


def holm_family(pairs: Mapping[str, tuple[Mapping[Any, Any], Mapping[Any, Any]]], *,
                alpha: float = 0.05) -> dict[str, dict[str, Any]]:
    """Holm's step-down over a family of paired comparisons, each tested by a t interval AND an exact sign-flip
    test that must agree.

    Holm's step-down alone is a few lines; no library does this family: scipy has none (its
    ``false_discovery_control`` is Benjamini-Hochberg), and here a rejection also needs the t interval to agree.

    ``pairs``: name -> (variant by seed, comparator by seed). The comparisons are ordered by their sign-flip p; the
    k-th (from 0) of ``m`` is tested at ``alpha_k = alpha / (m - k)`` (two comparisons at 0.05: 0.025, then 0.05),
    and only while every earlier one was rejected. A comparison is **rejected** when it is reached, its
    ``1 - alpha_k`` t interval (``paired_seed_difference``) excludes 0 and its sign-flip p is at or below
    ``alpha_k``; **shown** when rejected with the interval above 0 (the variant raises the outcome).

    Per name: ``rank``, ``alpha`` (its Holm level), ``p`` (sign-flip), ``reached``, ``rejected``, ``shown``,
    ``difference`` (``paired_seed_difference`` at level ``1 - alpha``) and ``text`` (why, in words).

    >>> up = {s: 0.5 + 0.1 * (s % 3) for s in range(8)}
    >>> base = {s: 0.4 for s in range(8)}
    >>> r = holm_family({"a": (up, base), "b": (base, base)})
    >>> r["a"]["shown"], r["a"]["alpha"], r["b"]["shown"], r["b"]["alpha"]
    (True, 0.025, False, 0.05)
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    first = {k: paired_seed_difference(v, b) for k, (v, b) in pairs.items()}
    p = {k: sign_flip_p(d["differences"]) if d["n"] else math.nan for k, d in first.items()}
    order = sorted(pairs, key=lambda k: (math.isnan(p[k]), p[k]))
    m, reached, out = len(order), True, {}
    for rank, k in enumerate(order):
        a = alpha / (m - rank)
        d = paired_seed_difference(*pairs[k], level=1.0 - a)
        excludes = d["n"] >= 2 and (d["low"] > 0 or d["high"] < 0)
        rejected = reached and excludes and p[k] <= a
        span = (f"{round(100 * (1 - a), 2):g}% interval [{d['low']:+.3f}, {d['high']:+.3f}], sign-flip p = "
                f"{p[k]:.4f} vs {a:.4g}" if d["n"] >= 2 else f"{d['n']} paired seeds")
        if not reached:
            text = f"not tested (an earlier comparison of the family was not rejected): {span}"
        elif rejected:
            text = f"rejected: {span}"
        else:
            text = f"not rejected: {span}"
        out[k] = {"rank": rank, "alpha": a, "p": p[k], "reached": reached, "rejected": rejected,
                  "shown": rejected and d["low"] > 0, "difference": d, "text": text}
        reached = rejected
    return out


NEITHER_RISE = 0.10
"""Decision rule 1: a rise of the neither-style share by this much (mean over seeds) is hacking."""
TOO_SMALL = 0.15
"""Decision rule 3: an effect whose interval's upper bound lies below this is too small to matter."""
NONINFERIORITY_MARGIN = -0.03
"""Non-inferiority: the lower bound of the 95% interval of (arm - baseline) at or above this."""


def replication_verdict(primary: Mapping[str, Any], *, neither: Mapping[str, Any],
                        noninferiority: Sequence[tuple[str, Mapping[str, Any]]],
                        placebo: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The pre-registered decision rules (benchmarks/RESULTS.md, "Look or guess, replication"), in their order; the
    first that applies is the verdict.

    ``primary``: the arm's entry of ``holm_family`` (vs the baseline). ``neither``: ``paired_seed_difference`` of the
    neither-style share (arm - baseline). ``noninferiority``: (label, ``paired_seed_difference`` at 95%) for each
    margin. ``placebo``: ``paired_seed_difference`` at 95% of the arm vs its placebo, or None (no placebo arm).

    1. "refuted: hacking": the neither-style share rises by ``NEITHER_RISE`` or more (mean);
    2. "refuted: not from the image" (with a placebo): the primary comparison is shown while the placebo interval
       includes 0;
    3. "refuted: too small": the primary interval's upper bound lies below ``TOO_SMALL``;
    4. "shown": the primary comparison is shown, every non-inferiority lower bound is at or above
       ``NONINFERIORITY_MARGIN``, and (with a placebo) its interval lies above 0;
    5. "inconclusive" otherwise.

    A value that was not measured (NaN) makes no rule apply that needs it. Returns ``verdict``, ``rule`` (1-5),
    ``reasons`` (every rule's check, in words) and ``text``.

    >>> pri = {"shown": True, "difference": {"mean": 0.3, "low": 0.1, "high": 0.5}, "text": "rejected"}
    >>> ok = {"mean": 0.0, "low": -0.02, "high": 0.02}
    >>> replication_verdict(pri, neither={"mean": 0.02}, noninferiority=[("non-conflict", ok)],
    ...                     placebo={"mean": 0.2, "low": 0.05, "high": 0.35})["verdict"]
    'shown'
    >>> replication_verdict(pri, neither={"mean": 0.2}, noninferiority=[("non-conflict", ok)])["verdict"]
    'refuted: hacking'
    """
    def num(x: Any) -> float:
        return math.nan if x is None else float(x)

    diff = primary["difference"]
    high = num(diff.get("high"))
    rise = num(neither.get("mean"))
    reasons = [f"neither-style share {rise:+.3f} (hacking at >= +{NEITHER_RISE:g})",
               f"primary: {primary.get('text', '')}"]
    placebo_includes = placebo_above = False
    if placebo is not None:
        lo, hi = num(placebo.get("low")), num(placebo.get("high"))
        placebo_includes = lo <= 0.0 <= hi
        placebo_above = lo > 0.0
        reasons.append(f"vs placebo {num(placebo.get('mean')):+.3f} [{lo:+.3f}, {hi:+.3f}]")
    margins_hold = True
    for label, d in noninferiority:
        lo = num(d.get("low"))
        holds = lo >= NONINFERIORITY_MARGIN
        margins_hold = margins_hold and holds
        reasons.append(f"{label} {num(d.get('mean')):+.3f}, lower bound {lo:+.3f} "
                       f"{'>=' if holds else '<'} {NONINFERIORITY_MARGIN:+g}")
    if rise >= NEITHER_RISE:
        verdict_, rule = "refuted: hacking", 1
    elif placebo is not None and primary["shown"] and placebo_includes:
        verdict_, rule = "refuted: not from the image", 2
    elif high < TOO_SMALL:
        verdict_, rule = "refuted: too small", 3
    elif primary["shown"] and margins_hold and (placebo is None or placebo_above):
        verdict_, rule = "shown", 4
    else:
        verdict_, rule = "inconclusive", 5
    return {"verdict": verdict_, "rule": rule, "reasons": reasons, "text": f"{verdict_} ({'; '.join(reasons)})"}


# ---------------------------------------------------------------------------------------------------------------
# TPRL on look or guess with conflict rows (issue 44): two-sided verdicts (harm as well as help), and power
# ---------------------------------------------------------------------------------------------------------------

TPRL_VERDICTS = ("refuted: hacking", "shown: harms", "refuted: not from the image", "shown: helps",
                 "refuted: too small", "inconclusive")
"""The labels of :func:`tprl_verdict`, in the order its rules are taken."""


def tprl_verdict(primary: Mapping[str, Any], *, neither: Mapping[str, Any],
                 noninferiority: Sequence[tuple[str, Mapping[str, Any]]],
                 placebo: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The decision rules for one arm X against the baseline A (issue 44), taken in order; the first that applies is
    the verdict. Two-sided: a harm is a verdict too.

    ``primary``: X's entry of ``holm_family`` (conflict accuracy, X vs A, its interval at its Holm level; rejected
    only when that interval excludes 0 AND the exact sign-flip p is at or below the level). ``neither``:
    ``paired_seed_difference`` of the neither-style share (X - A). ``noninferiority``: (label,
    ``paired_seed_difference`` at 95%) per margin. ``placebo``: ``paired_seed_difference`` at 95% of X vs its
    placebo (T and T_att vs P), or None (no placebo: M).

    1. "refuted: hacking": the neither-style share rises by ``NEITHER_RISE`` or more (mean over seeds);
    2. "shown: harms": the primary comparison is rejected with its interval below 0;
    3. "refuted: not from the image" (with a placebo): rejected above 0 while the placebo interval does not lie
       above 0 (X does not beat its placebo);
    4. "shown: helps": rejected above 0, every non-inferiority lower bound at or above ``NONINFERIORITY_MARGIN``
       and (with a placebo) the placebo interval above 0;
    5. "refuted: too small": the primary interval lies inside (-``TOO_SMALL``, +``TOO_SMALL``): neither a help
       nor a harm of that size fits the data;
    6. "inconclusive" otherwise (e.g. a help that fails a margin: the reasons say which).

    Returns ``verdict``, ``rule`` (1-6), ``reasons`` (every check, in words) and ``text``.

    >>> pri = {"rejected": True, "shown": True, "difference": {"mean": 0.3, "low": 0.1, "high": 0.5}, "text": "ok"}
    >>> ok = {"mean": 0.0, "low": -0.02, "high": 0.02}
    >>> tprl_verdict(pri, neither={"mean": 0.0}, noninferiority=[("plain", ok)],
    ...              placebo={"mean": 0.2, "low": 0.05, "high": 0.35})["verdict"]
    'shown: helps'
    >>> harm = {"rejected": True, "shown": False, "difference": {"mean": -0.3, "low": -0.5, "high": -0.1}, "text": ""}
    >>> tprl_verdict(harm, neither={"mean": 0.0}, noninferiority=[("plain", ok)])["verdict"]
    'shown: harms'
    """
    def num(x: Any) -> float:
        return math.nan if x is None else float(x)

    diff = primary["difference"]
    low, high = num(diff.get("low")), num(diff.get("high"))
    rise = num(neither.get("mean"))
    rejected = bool(primary.get("rejected"))
    above, below = rejected and low > 0.0, rejected and high < 0.0
    reasons = [f"neither-style share {rise:+.3f} (hacking at >= +{NEITHER_RISE:g})",
               f"primary: {primary.get('text', '')}"]
    placebo_above = False
    if placebo is not None:
        lo, hi = num(placebo.get("low")), num(placebo.get("high"))
        placebo_above = lo > 0.0
        reasons.append(f"vs placebo {num(placebo.get('mean')):+.3f} [{lo:+.3f}, {hi:+.3f}]")
    margins_hold = True
    for label, d in noninferiority:
        lo = num(d.get("low"))
        holds = lo >= NONINFERIORITY_MARGIN
        margins_hold = margins_hold and holds
        reasons.append(f"{label} {num(d.get('mean')):+.3f}, lower bound {lo:+.3f} "
                       f"{'>=' if holds else '<'} {NONINFERIORITY_MARGIN:+g}")
    if rise >= NEITHER_RISE:
        verdict_, rule = "refuted: hacking", 1
    elif below:
        verdict_, rule = "shown: harms", 2
    elif placebo is not None and above and not placebo_above:
        verdict_, rule = "refuted: not from the image", 3
    elif above and margins_hold and (placebo is None or placebo_above):
        verdict_, rule = "shown: helps", 4
    elif -TOO_SMALL < low and high < TOO_SMALL:
        verdict_, rule = "refuted: too small", 5
    else:
        verdict_, rule = "inconclusive", 6
    return {"verdict": verdict_, "rule": rule, "reasons": reasons, "text": f"{verdict_} ({'; '.join(reasons)})"}


def paired_power(sd: float, n: int, effect: float, alpha: float, *, sims: int = 2000, seed: int = 0) -> float:
    """The power of the primary test on ``n`` seed-paired differences: the share of ``sims`` simulated experiments
    (differences i.i.d. Normal(``effect``, ``sd``), drawn from ``numpy.random.default_rng(seed)``) in which the
    two-sided ``1 - alpha`` paired t interval (``scipy.stats.t`` quantile) excludes 0 AND the exact sign-flip p
    (:func:`sign_flip_p`'s enumeration of all 2^n sign assignments) is at or below ``alpha``: what ``holm_family``
    asks of a comparison at its level.

    >>> paired_power(0.26, 5, 0.27, 0.05, sims=200) < 0.5 < paired_power(0.26, 16, 0.27, 0.025, sims=200)
    True
    """
    from scipy import stats as sps

    if n < 2 or n > SIGN_FLIP_MAX_PAIRS:
        raise ValueError(f"n must be in [2, {SIGN_FLIP_MAX_PAIRS}], got {n}")
    if not sd > 0:
        raise ValueError(f"sd must be > 0, got {sd!r}")
    rng = np.random.default_rng(seed)
    d = rng.normal(effect, sd, size=(sims, n))
    mean, se = d.mean(1), d.std(1, ddof=1) / math.sqrt(n)
    t = float(sps.t.ppf(1.0 - alpha / 2.0, n - 1))
    by_t = (mean - t * se > 0) | (mean + t * se < 0)
    bits = np.arange(n, dtype=np.int64)
    signs = 1.0 - 2.0 * ((np.arange(1 << n, dtype=np.int64)[:, None] >> bits) & 1)  # (2^n, n)
    hits = 0
    for lo in range(0, sims, 64):
        chunk = d[lo:lo + 64]
        observed = np.abs(chunk.sum(1))
        tolerance = 1e-9 * np.maximum(1.0, np.abs(chunk).sum(1))
        p = (np.abs(signs @ chunk.T) >= observed - tolerance).mean(0)
        hits += int((by_t[lo:lo + 64] & (p <= alpha)).sum())
    return hits / sims
