"""Validating a per-rollout reliance signal against labels: does it pick out the answers that came from the wording?

A rollout is *prior-following* when its answer comes from the language prior rather than the image. Benchmarks
with designed conflicts (the image contradicts what the wording suggests) label it directly; elsewhere the general
rule ``prior_following`` labels it from the blind answer (the model's greedy answer with the counterfactual image),
and ``label_agreement`` measures what that rule is worth where both exist.

A signal is then judged by:

* ``auroc``: the probability that a random prior-following rollout is ranked as more prior-following by the
  signal than a random other rollout (ties 1/2); 0.5 = the signal does not see it. ``signal_table`` orients each
  signal first (``DIRECTIONS``): an image-reliance signal (``visual_gain``) points to prior-following when LOW, a
  text-dominance signal (``mdi``) when HIGH, so an AUROC below 0.5 there means the signal points the other way.
* ``bootstrap_auroc``: its percentile interval over rollouts resampled within each class.
* ``within_group_variance_share``: how much of the signal's variance lies between rollouts of the same prompt,
  the only part GRPO's group-relative advantage can use as a reward.

Inputs are array-likes (lists, numpy arrays, CPU tensors); outputs are Python floats, dicts and strings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

LOW, HIGH = "low", "high"
"""Directions: the signal's value at which a rollout is prior-following."""

_LOW_NAMES = ("visual_gain", "answer_visual_gain", "answer_image_attention")
_HIGH_NAMES = ("blind_agrees",)


def default_direction(name: str) -> str | None:
    """Where a signal named ``name`` points to prior-following by default: ``"low"``, ``"high"`` or None (unknown).

    * low: image-reliance signals, the image's share of the evidence: ``visual_gain``, ``answer_visual_gain``,
      ``answer_image_attention``, and ``aei_image*`` (attention efficiency of image keys);
    * high: text-dominance and blind signals: ``mdi`` and ``mdi_<segment>`` (MDI > 1 means text dominates, so a
      prior-following rollout is expected to have a HIGH MDI), ``aei_text*``, ``blind_agrees``;
    * None: anything else, including ``mdi_balance`` and ``mdi_group_score`` (peaked at MDI = 1, not monotone in
      text dominance): pass their direction explicitly.

    >>> [default_direction(n) for n in ("visual_gain", "mdi_late", "blind_agrees", "mdi_balance")]
    ['low', 'high', 'high', None]
    """
    if name in _LOW_NAMES or name.startswith("aei_image"):
        return LOW
    if name in _HIGH_NAMES or name.startswith("aei_text"):
        return HIGH
    if name.startswith("mdi") and name not in ("mdi_balance", "mdi_group_score"):
        return HIGH
    return None


# ---------------------------------------------------------------------------------------------------------------
# Array helpers
# ---------------------------------------------------------------------------------------------------------------


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _scores(x: Any) -> np.ndarray:
    arr = _numpy(x)
    if arr.dtype == object:
        arr = np.array([math.nan if v is None else float(v) for v in arr.ravel()], dtype=float)
    return arr.astype(float).ravel()


def _labels(x: Any) -> np.ndarray:
    """Labels as floats 1.0 / 0.0, NaN where unknown (None or NaN)."""
    arr = _scores(x)
    known = ~np.isnan(arr)
    if not np.all((arr[known] == 0) | (arr[known] == 1)):
        raise ValueError("labels must be booleans (True = prior-following), 0/1, or None/NaN for unknown")
    return arr


def _paired(scores: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    s, y = _scores(scores), _labels(labels)
    if s.shape != y.shape:
        raise ValueError(f"scores and labels differ in length: {s.size} vs {y.size}")
    keep = ~np.isnan(s) & ~np.isnan(y)
    return s[keep], y[keep].astype(bool)


# ---------------------------------------------------------------------------------------------------------------
# AUROC and its bootstrap interval
# ---------------------------------------------------------------------------------------------------------------


def _average_ranks(x: np.ndarray) -> np.ndarray:
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    last = np.cumsum(counts)  # 1-based rank of the last member of each run of equal values
    return (last - (counts - 1) / 2.0)[inverse]


def auroc(scores: Any, labels: Any) -> float:
    """P(score of a random positive > score of a random negative), ties counting 1/2.

    The Mann-Whitney U statistic over ``n_pos * n_neg``, from average ranks r:
    ``AUROC = (sum_{i positive} r_i - n_pos (n_pos + 1) / 2) / (n_pos n_neg)``. ``labels``: True = positive
    (prior-following); rollouts with a NaN score or an unknown label (None / NaN) are dropped. NaN when a class
    is empty.

    >>> auroc([0.1, 0.4, 0.35, 0.8], [False, False, True, True])
    0.75
    >>> auroc([1.0, 1.0, float("nan")], [True, False, True])
    0.5
    """
    s, y = _paired(scores, labels)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    u = _average_ranks(s)[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def bootstrap_auroc(scores: Any, labels: Any, n_boot: int = 1000, seed: int = 0, level: float = 0.95
                    ) -> tuple[float, float, float]:
    """``(auroc, low, high)``: the AUROC and its percentile bootstrap interval at ``level``.

    Each resample draws ``n_pos`` positives and ``n_neg`` negatives with replacement from their own class
    (stratified, so both classes are always present and the class balance is fixed); the interval is the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles (numpy's linear interpolation) of the resampled AUROCs.
    Deterministic per seed: ``rng = numpy.random.default_rng(seed)`` draws the positives' indices
    ``rng.integers(0, n_pos, (n_boot, n_pos))`` first, then the negatives' likewise.

    Vectorised: with the negatives sorted once, a resample's count of drawn negatives below (and tied with) each
    positive is a cumulative sum of its draw counts, so no resample is ranked again: O(n_boot * n). NaN triple
    when a class is empty.
    """
    if isinstance(n_boot, bool) or not isinstance(n_boot, (int, np.integer)) or n_boot < 1:
        raise ValueError(f"n_boot must be an integer >= 1, got {n_boot!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    s, y = _paired(scores, labels)
    pos, neg = s[y], s[~y]
    n_pos, n_neg = pos.size, neg.size
    if n_pos == 0 or n_neg == 0:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    draw_pos = rng.integers(0, n_pos, (n_boot, n_pos))
    draw_neg = rng.integers(0, n_neg, (n_boot, n_neg))

    order = np.argsort(neg, kind="stable")
    neg_sorted = neg[order]
    rank_of = np.empty(n_neg, dtype=np.int64)
    rank_of[order] = np.arange(n_neg)
    offsets = (np.arange(n_boot, dtype=np.int64) * n_neg)[:, None]
    counts = np.bincount((rank_of[draw_neg] + offsets).ravel(), minlength=n_boot * n_neg).reshape(n_boot, n_neg)
    below = np.zeros((n_boot, n_neg + 1), dtype=np.int64)  # below[b, k]: drawn negatives among the k smallest
    np.cumsum(counts, axis=1, out=below[:, 1:])
    lo = np.searchsorted(neg_sorted, pos, side="left")  # negatives strictly below each positive
    hi = np.searchsorted(neg_sorted, pos, side="right")  # ... below or tied
    per_pos = (below[:, lo] + below[:, hi]) / 2.0  # (n_boot, n_pos): wins + ties / 2 of each original positive
    aucs = np.take_along_axis(per_pos, draw_pos, axis=1).sum(axis=1) / (n_pos * n_neg)
    low, high = np.quantile(aucs, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return auroc(s, y), float(low), float(high)


# ---------------------------------------------------------------------------------------------------------------
# How much of a signal GRPO can use
# ---------------------------------------------------------------------------------------------------------------


def within_group_variance_share(values: Any, groups: Any) -> float:
    """Share of the total variance that lies within groups (GRPO only sees differences inside a prompt's group).

        share = sum_g sum_{i in g} (x_i - mean_g)^2 / sum_i (x_i - mean)^2

    1 = all the spread is between rollouts of the same prompt; 0 = the signal is constant within every group
    (a reward built on it gives zero advantage). NaN values are dropped with their group entries; a group left
    with one value contributes 0. NaN when the total is 0 (0/0) or nothing is left.

    >>> within_group_variance_share([1.0, 3.0, 5.0, 7.0], [0, 0, 1, 1])
    0.2
    >>> within_group_variance_share([1.0, 1.0, float("nan")], ["a", "b", "b"])
    nan
    """
    x = _scores(values)
    g = _numpy(groups).ravel()
    if g.shape != x.shape:
        raise ValueError(f"values and groups differ in length: {x.size} vs {g.size}")
    keep = ~np.isnan(x)
    x, g = x[keep], g[keep]
    if x.size == 0:
        return math.nan
    _, inverse = np.unique(g, return_inverse=True)
    inverse = inverse.ravel()
    means = np.bincount(inverse, weights=x) / np.bincount(inverse)
    within = float(((x - means[inverse]) ** 2).sum())
    total = float(((x - x.mean()) ** 2).sum())
    return within / total if total > 0 else math.nan


# ---------------------------------------------------------------------------------------------------------------
# Labels without a designed benchmark
# ---------------------------------------------------------------------------------------------------------------


def prior_following(answer: Any, blind_answer: Any, gold: Any) -> bool | None:
    """The general rule: prior-following when the answer equals the blind answer and differs from the gold one.

    ``blind_answer``: the model's greedy answer to the same prompt with the counterfactual image (None when it
    gave none: then no rollout equals it). None when ``answer`` is None (nothing to judge) or ``gold`` is None
    (the rule cannot tell a wrong blind answer from a right one).

    >>> prior_following("B", "B", "A"), prior_following("B", "B", "B"), prior_following("C", "B", "A")
    (True, False, False)
    >>> prior_following(None, "B", "A") is None
    True
    """
    if answer is None or gold is None:
        return None
    return answer == blind_answer and answer != gold


def label_agreement(rule_labels: Sequence[bool | None], data_labels: Sequence[bool | None]) -> dict[str, Any]:
    """How well the rule's labels (``prior_following``) agree with a dataset's own prior-following labels.

    Pairs with a None on either side are dropped (``n_dropped``). Returns ``n``, ``agreement`` (share of equal
    labels), ``kappa`` (Cohen's: agreement beyond what the two base rates give by chance; NaN when chance
    agreement is 1), and, taking the data labels as the truth, the 2x2 counts ``tp`` (both True), ``fp`` (rule
    True, data False), ``fn``, ``tn``, with ``precision = tp / (tp + fp)`` and ``recall = tp / (tp + fn)`` (NaN
    when undefined).

    >>> d = label_agreement([True, True, False, False, None], [True, False, False, False, True])
    >>> d["n"], d["agreement"], d["tp"], d["fp"], d["fn"], d["tn"], d["n_dropped"]
    (4, 0.75, 1, 1, 0, 2, 1)
    """
    if len(rule_labels) != len(data_labels):
        raise ValueError(f"rule_labels and data_labels differ in length: {len(rule_labels)} vs {len(data_labels)}")
    pairs = [(bool(r), bool(d)) for r, d in zip(rule_labels, data_labels) if r is not None and d is not None]
    tp = sum(r and d for r, d in pairs)
    fp = sum(r and not d for r, d in pairs)
    fn = sum(d and not r for r, d in pairs)
    tn = sum(not r and not d for r, d in pairs)
    n = len(pairs)

    def ratio(a: float, b: float) -> float:
        return a / b if b else math.nan

    agreement = ratio(tp + tn, n)
    chance = ratio((tp + fp) * (tp + fn) + (fn + tn) * (fp + tn), n * n)
    kappa = ratio(agreement - chance, 1.0 - chance) if n and chance < 1.0 else math.nan
    return {"n": n, "agreement": agreement, "kappa": kappa, "precision": ratio(tp, tp + fp),
            "recall": ratio(tp, tp + fn), "tp": tp, "fp": fp, "fn": fn, "tn": tn,
            "n_dropped": len(rule_labels) - n}


# ---------------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------------


def signal_table(signals: Mapping[str, Any], labels: Any, groups: Any, *,
                 directions: Mapping[str, str] | None = None, n_boot: int = 1000, seed: int = 0,
                 level: float = 0.95) -> list[dict[str, Any]]:
    """One row per signal: how well it separates prior-following rollouts (``labels`` True) from the others.

    ``signals``: name -> per-rollout values (NaN = not measured), all aligned with ``labels`` (True =
    prior-following, None/NaN = unknown) and ``groups`` (the prompt each rollout answers). ``directions``: name ->
    ``"low"`` / ``"high"``, the value at which a rollout is prior-following; names missing there take
    ``default_direction``, and a name without either is a ValueError (a guessed direction could flip the
    conclusion). The AUROC is computed on the oriented signal (``-x`` for ``"low"``), so 1 = perfect, 0.5 = blind,
    < 0.5 = the signal points the other way.

    Row keys: ``signal``, ``direction``, ``n`` (rollouts with a value and a label), ``n_prior`` (of them
    prior-following), ``auroc``, ``low``, ``high`` (``bootstrap_auroc`` at ``level``), ``level``,
    ``within_group_share`` (``within_group_variance_share`` over every rollout with a value, labelled or not),
    ``mean_prior`` and ``mean_other`` (the raw signal's mean on each class; NaN for an empty class).
    """
    directions = dict(directions or {})
    y_all = _labels(labels)
    g_all = _numpy(groups).ravel()
    if g_all.shape != y_all.shape:
        raise ValueError(f"labels and groups differ in length: {y_all.size} vs {g_all.size}")
    rows = []
    for name, values in signals.items():
        direction = directions.get(name, default_direction(name))
        if direction not in (LOW, HIGH):
            raise ValueError(f"signal {name!r}: direction must be 'low' or 'high' (where prior-following rollouts "
                             f"lie), got {direction!r}; pass directions={{{name!r}: 'low' | 'high'}}")
        x = _scores(values)
        if x.shape != y_all.shape:
            raise ValueError(f"signal {name!r} has {x.size} values for {y_all.size} labels")
        oriented = -x if direction == LOW else x
        value, low, high = bootstrap_auroc(oriented, y_all, n_boot=n_boot, seed=seed, level=level)
        known = ~np.isnan(x) & ~np.isnan(y_all)
        prior, other = x[known & (y_all == 1)], x[known & (y_all == 0)]
        rows.append({
            "signal": name, "direction": direction, "n": int(known.sum()), "n_prior": int(prior.size),
            "auroc": value, "low": low, "high": high, "level": level,
            "within_group_share": within_group_variance_share(x, g_all),
            "mean_prior": float(prior.mean()) if prior.size else math.nan,
            "mean_other": float(other.mean()) if other.size else math.nan,
        })
    return rows


def _fmt(x: float, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def format_signal_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """``signal_table``'s rows as a Markdown table (NaN shown as n/a).

    >>> print(format_signal_table([{"signal": "visual_gain", "direction": "low", "n": 40, "n_prior": 10,
    ...     "auroc": 0.81, "low": 0.7, "high": 0.9, "level": 0.95, "within_group_share": 0.6,
    ...     "mean_prior": 0.02, "mean_other": float("nan")}]))
    | signal | prior-following when | n (prior-following) | AUROC [95% CI] | within-group variance share | mean, prior-following | mean, other |
    |---|---|---|---|---|---|---|
    | visual_gain | low | 40 (10) | 0.810 [0.700, 0.900] | 0.600 | 0.020 | n/a |
    """
    level = rows[0]["level"] if rows else 0.95
    lines = [f"| signal | prior-following when | n (prior-following) | AUROC [{level:.0%} CI] | "
             "within-group variance share | mean, prior-following | mean, other |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['signal']} | {r['direction']} | {r['n']} ({r['n_prior']}) | {_fmt(r['auroc'])} "
                     f"[{_fmt(r['low'])}, {_fmt(r['high'])}] | {_fmt(r['within_group_share'])} | "
                     f"{_fmt(r['mean_prior'])} | {_fmt(r['mean_other'])} |")
    return "\n".join(lines)
