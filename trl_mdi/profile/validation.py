"""Validating a per-rollout reliance signal against labels on your own data: does it pick out the answers that came
from the wording?

A rollout is *prior-following* when its answer comes from the language prior rather than the image. Benchmarks
with designed conflicts (the image contradicts what the wording suggests) label it directly; elsewhere the general
rule ``prior_following`` labels it from the blind answer (the model's greedy answer with the counterfactual image),
and ``label_agreement`` measures what that rule is worth where both exist.

A signal is then judged by:

* ``auroc``: the probability that a random prior-following rollout is ranked as more prior-following by the
  signal than a random other rollout (ties 1/2); 0.5 = the signal does not see it. ``signal_table`` orients each
  signal first (``default_direction``: the signal table's ``direction``, ``trl_mdi.signals``): an image-reliance
  signal (``visual_gain``) points to prior-following when LOW, a text-dominance signal (``mdi``) when HIGH, so an
  AUROC below 0.5 there means the signal points the other way.
* ``bootstrap_auroc``: its percentile interval, over rollouts resampled within each class, or with
  ``prompt_ids`` over resampled prompts (``prompt_bootstrap``: the rollouts of one prompt are not independent, so a
  rollout bootstrap understates the interval when much of the spread lies between prompts).
* ``within_prompt_auroc``: the AUROC over pairs of rollouts of the same prompt only: what GRPO's group-relative
  advantage can see; the pooled ``auroc`` also credits a signal that only tells prompts apart.
* ``within_group_variance_share``: how much of the signal's variance lies between rollouts of the same prompt,
  the only part GRPO's group-relative advantage can use as a reward.
* ``common_rollouts``: the rollouts on which every compared signal is defined; ``signal_table`` scores every signal
  on that one set and reports each signal's n before the restriction.

The statistics that judge a training variant against its baseline over seeds (paired differences, the t interval,
the verdict) are the benchmarks' own: ``benchmarks/stats.py``.

Inputs are array-likes (lists, numpy arrays, CPU tensors); outputs are Python floats, dicts and strings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from scipy import stats

LOW, HIGH = "low", "high"
"""Directions: the signal's value at which a rollout is prior-following."""
ROLLOUTS, PROMPTS = "rollouts", "prompts"
"""What a bootstrap resamples: rollouts (within each class) or prompts (clusters, every rollout of a drawn one)."""


def default_direction(name: str) -> str | None:
    """Where a signal named ``name`` points to prior-following by default: ``"low"``, ``"high"`` or None (unknown).

    The signal table's answer (``trl_mdi.signals.direction``: the entry's ``direction``, per-segment names such as
    ``mdi_late`` or ``aei_image_early`` included), so a signal added to the table is oriented here with no edit:

    * low: image-reliance signals, the image's share of the evidence: ``visual_gain``, ``answer_visual_gain``,
      ``answer_image_attention``, ``aei_image*`` (attention efficiency of image keys), ``image_mass``;
    * high: text-dominance and blind signals: ``mdi`` and ``mdi_<segment>`` (MDI > 1 means text dominates, so a
      prior-following rollout is expected to have a HIGH MDI), ``aei_text*``, ``blind_agrees``;
    * None: a name outside the table, and the entries without a direction, such as ``mdi_balance`` and
      ``mdi_group_score`` (peaked at MDI = 1, not monotone in text dominance): pass their direction explicitly.

    >>> [default_direction(n) for n in ("visual_gain", "mdi_late", "blind_agrees", "mdi_balance", "entropy")]
    ['low', 'high', 'high', None, None]
    """
    # Imported here, not at the top: the table imports torch and the attention package, and this module's
    # statistics work on plain arrays without them.
    from ..signals import direction

    return direction(name)


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


def _u_share(pos: np.ndarray, neg: np.ndarray, axis: int = -1) -> np.ndarray:
    """The Mann-Whitney U of ``pos`` against ``neg`` over ``n_pos * n_neg``, along ``axis`` (batches broadcast)."""
    u = stats.mannwhitneyu(pos, neg, axis=axis, method="asymptotic").statistic
    return u / (pos.shape[axis] * neg.shape[axis])


def auroc(scores: Any, labels: Any) -> float:
    """P(score of a random positive > score of a random negative), ties counting 1/2.

    The Mann-Whitney U statistic (``scipy.stats.mannwhitneyu``) over ``n_pos * n_neg``; from average ranks r,
    ``AUROC = (sum_{i positive} r_i - n_pos (n_pos + 1) / 2) / (n_pos n_neg)``. ``labels``: True = positive
    (prior-following); rollouts with a NaN score or an unknown label (None / NaN) are dropped. NaN when a class
    is empty.

    >>> auroc([0.1, 0.4, 0.35, 0.8], [False, False, True, True])
    0.75
    >>> auroc([1.0, 1.0, float("nan")], [True, False, True])
    0.5
    """
    s, y = _paired(scores, labels)
    if y.all() or not y.any():
        return math.nan
    return float(_u_share(s[y], s[~y]))


def bootstrap_auroc(scores: Any, labels: Any, n_boot: int = 1000, seed: int = 0, level: float = 0.95, *,
                    prompt_ids: Any = None) -> tuple[float, float, float]:
    """``(auroc, low, high)``: the AUROC and its percentile bootstrap interval at ``level``.

    With ``prompt_ids`` (one per rollout), the resamples draw PROMPTS: ``prompt_bootstrap`` over the prompts that
    keep a usable rollout (a score and a known label), the pooled AUROC recomputed on each resample (every copy of a
    positive against every copy of a negative); a resample that draws one class only is left out. Use it whenever
    several rollouts share a prompt: they are not independent, and the rollout bootstrap below then understates
    the interval. Computed without re-ranking: from the (P, P) matrix of wins between the positives of one prompt
    and the negatives of another, a resample drawing prompt a ``w_a`` times has AUROC
    ``w' W w / ((w . n_pos) (w . n_neg))``. Same draws as ``prompt_bootstrap`` with the same seed.

    Without ``prompt_ids``, ``scipy.stats.bootstrap`` (``method="percentile"``) over the two classes: each resample
    draws ``n_pos`` positives and ``n_neg`` negatives with replacement from their own class (stratified, so both
    classes are always present and the class balance is fixed); the interval is the ``(1 - level) / 2`` and
    ``(1 + level) / 2`` quantiles (linear interpolation) of the resampled AUROCs. Deterministic per seed: with
    ``rng = numpy.random.default_rng(seed)``, scipy draws the positives' indices ``rng.integers(0, n_pos, (n_boot,
    n_pos))`` first, then the negatives' likewise. A class of one rollout is the same in every resample: it is
    held fixed (scipy resamples only classes of two or more; numpy draws nothing for a class of one either). NaN
    triple when a class is empty.
    """
    _check_resampling(n_boot, level)
    if prompt_ids is not None:
        s, y, p, n_prompts = _clean_clusters(scores, labels, prompt_ids)
        low, high, _ = _prompt_bootstrap_auroc(s, y, p, n_prompts, n_boot, seed, level)
        return auroc(s, y), low, high
    s, y = _paired(scores, labels)
    pos, neg = s[y], s[~y]
    if pos.size == 0 or neg.size == 0:
        return math.nan, math.nan, math.nan
    value = float(_u_share(pos, neg))
    resampled = [c for c in (pos, neg) if c.size > 1]
    if not resampled:
        return value, value, value

    def statistic(*drawn: np.ndarray, axis: int = -1) -> np.ndarray:
        drawn_pos = drawn[0] if pos.size > 1 else pos
        drawn_neg = drawn[-1] if neg.size > 1 else neg
        return _u_share(drawn_pos, drawn_neg, axis=axis)

    ci = stats.bootstrap(resampled, statistic, n_resamples=n_boot, confidence_level=level, method="percentile",
                         rng=np.random.default_rng(seed), vectorized=True).confidence_interval
    return value, float(ci.low), float(ci.high)


# ---------------------------------------------------------------------------------------------------------------
# Resampling prompts, not rollouts
# ---------------------------------------------------------------------------------------------------------------


def _check_resampling(n_boot: Any, level: Any) -> None:
    if isinstance(n_boot, bool) or not isinstance(n_boot, (int, np.integer)) or n_boot < 1:
        raise ValueError(f"n_boot must be an integer >= 1, got {n_boot!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")


def _prompt_index(prompt_ids: Any, n: int) -> tuple[np.ndarray, int]:
    """Each rollout's prompt as an index 0..P-1 into the sorted distinct ids, and P."""
    g = _numpy(prompt_ids).ravel()
    if g.size != n:
        raise ValueError(f"prompt_ids has {g.size} entries for {n} rollouts: give one prompt id per rollout")
    _, index = np.unique(g, return_inverse=True)
    index = index.ravel().astype(np.int64)
    return index, int(index.max()) + 1 if index.size else 0


def _prompt_draws(n_prompts: int, n_boot: int, seed: int) -> np.ndarray:
    """(n_boot, P) prompt indices: ``numpy.random.default_rng(seed).integers(0, P, (n_boot, P))``."""
    return np.random.default_rng(seed).integers(0, n_prompts, (n_boot, n_prompts))


def _draw_counts(draws: np.ndarray, n_prompts: int) -> np.ndarray:
    """(n_boot, P) float: how many times each prompt was drawn in each resample."""
    n_boot = draws.shape[0]
    flat = (draws + (np.arange(n_boot, dtype=np.int64) * n_prompts)[:, None]).ravel()
    return np.bincount(flat, minlength=n_boot * n_prompts).reshape(n_boot, n_prompts).astype(float)


def _interval(values: np.ndarray, level: float) -> tuple[float, float, int]:
    """Percentile interval of the finite resampled values, and how many were undefined (NaN)."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return math.nan, math.nan, int(values.size)
    low, high = np.quantile(finite, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(low), float(high), int(values.size - finite.size)


def prompt_bootstrap(statistic: Callable[..., Any], arrays: Sequence[Any], prompt_ids: Any, *, n_boot: int = 1000,
                     seed: int = 0, level: float = 0.95, pass_prompts: bool = False) -> dict[str, Any]:
    """A percentile bootstrap interval of ``statistic`` that resamples PROMPTS (clusters), not rollouts.

    The rollouts of one prompt are not independent (they share the image, the question and the model's reading of
    both), so resampling rollouts as if they were understates the interval when much of a value's spread lies
    between prompts. Here each resample draws P prompts with replacement from the P distinct ``prompt_ids``; every
    rollout of a drawn prompt comes along, and a prompt drawn twice counts twice. With ``theta*_b`` the statistic on
    resample b, the interval is the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles (numpy's linear
    interpolation) of the finite ``theta*_b``; a resample on which the statistic is undefined (NaN, e.g. an AUROC
    with one class drawn) is left out and counted in ``n_undefined``.

    ``arrays``: per-rollout array-likes, each aligned with ``prompt_ids``; ``statistic(*resampled_arrays)`` returns a
    number (``statistic(*resampled_arrays, resampled_prompt_ids)`` with ``pass_prompts=True``: the ids are the
    draw's position 0..P-1, so a prompt drawn twice is two prompts, as a within-prompt statistic must see it).
    Deterministic per seed: the prompts, sorted by id, are drawn as
    ``numpy.random.default_rng(seed).integers(0, P, (n_boot, P))``. Returns ``value`` (the statistic on the data),
    ``low``, ``high``, ``level``, ``n_boot``, ``n_prompts``, ``n_undefined``.

    >>> d = prompt_bootstrap(np.mean, [[1.0, 1.0, 3.0, 3.0]], ["p", "p", "q", "q"], n_boot=200)
    >>> d["value"], d["low"], d["high"], d["n_prompts"]
    (2.0, 1.0, 3.0, 2)

    (Resampling the four rollouts instead would give means at 1.5 and 2.5 too, and a narrower interval.)

    Why not a library: ``scipy.stats.bootstrap`` resamples observations, each sample's on its own or paired rows
    across samples, never clusters of varying size; the rollout bootstrap of ``bootstrap_auroc`` is its.
    """
    _check_resampling(n_boot, level)
    cols = [_numpy(a) for a in arrays]
    if not cols:
        raise ValueError("prompt_bootstrap needs at least one per-rollout array to resample")
    n = cols[0].shape[0] if cols[0].ndim else 0
    for i, c in enumerate(cols):
        if c.ndim == 0 or c.shape[0] != n:
            raise ValueError(f"arrays[{i}] has {c.size if c.ndim else 0} rollouts, arrays[0] has {n}: align them")
    index, n_prompts = _prompt_index(prompt_ids, n)

    def call(parts: list[np.ndarray], ids: np.ndarray) -> float:
        out = statistic(*parts, ids) if pass_prompts else statistic(*parts)
        return float(out)

    value = call(cols, index)
    if n_prompts == 0:
        return {"value": value, "low": math.nan, "high": math.nan, "level": level, "n_boot": n_boot,
                "n_prompts": 0, "n_undefined": n_boot}
    order = np.argsort(index, kind="stable")  # rollouts grouped by prompt, in their original order within it
    sizes = np.bincount(index, minlength=n_prompts)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    thetas = np.empty(n_boot)
    for b, drawn in enumerate(_prompt_draws(n_prompts, n_boot, seed)):
        lengths = sizes[drawn]
        total = int(lengths.sum())
        # the k-th rollout of the j-th drawn prompt: order[starts[drawn[j]] + k]
        first = np.repeat(starts[drawn] - (np.cumsum(lengths) - lengths), lengths)
        rows = order[first + np.arange(total)]
        ids = np.repeat(np.arange(n_prompts), lengths)
        thetas[b] = call([c[rows] for c in cols], ids)
    low, high, undefined = _interval(thetas, level)
    return {"value": value, "low": low, "high": high, "level": level, "n_boot": n_boot, "n_prompts": n_prompts,
            "n_undefined": undefined}


def _dense_ranks(s: np.ndarray) -> tuple[np.ndarray, int]:
    values, inverse = np.unique(s, return_inverse=True)
    return inverse.ravel().astype(np.int64), int(values.size)


def _pooled_auroc_by_prompt(s: np.ndarray, y: np.ndarray, p: np.ndarray, n_prompts: int) -> np.ndarray:
    """(P, P) ``W[a, b]``: sum over positives i of prompt a and negatives j of prompt b of 1[s_i > s_j] + 1/2 1[=].

    A resample drawing prompt a ``w_a`` times has pooled AUROC ``w' W w / ((w . n_pos) (w . n_neg))``: every copy of
    a positive meets every copy of a negative, those of the same prompt included, as in the resampled data.
    """
    rank, k = _dense_ranks(s)
    neg_keys = np.sort(p[~y] * k + rank[~y])  # negatives ordered by (prompt, value)
    pos_rank, pos_prompt = rank[y], p[y]
    base = np.arange(n_prompts, dtype=np.int64) * k
    first = np.searchsorted(neg_keys, base, side="left")  # where each prompt's negatives start
    w = np.zeros((n_prompts, n_prompts))
    chunk = max(1, 4_000_000 // max(n_prompts, 1))  # bounds the (chunk, P) temporaries
    for at in range(0, pos_rank.size, chunk):
        r = pos_rank[at:at + chunk, None]
        below = np.searchsorted(neg_keys, base + r, side="left") - first  # negatives of each prompt strictly below
        tied_or_below = np.searchsorted(neg_keys, base + r, side="right") - first
        np.add.at(w, pos_prompt[at:at + chunk], (below + tied_or_below) / 2.0)
    return w


def _clean_clusters(scores: Any, labels: Any, prompt_ids: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Scores, boolean labels and prompt indices of the usable rollouts (a score and a known label), re-indexed
    over the prompts that keep at least one."""
    s, y_all = _scores(scores), _labels(labels)
    if s.shape != y_all.shape:
        raise ValueError(f"scores and labels differ in length: {s.size} vs {y_all.size}")
    g = _numpy(prompt_ids).ravel()
    if g.size != s.size:
        raise ValueError(f"prompt_ids has {g.size} entries for {s.size} rollouts: give one prompt id per rollout")
    keep = ~np.isnan(s) & ~np.isnan(y_all)
    p, n_prompts = _prompt_index(g[keep], int(keep.sum()))
    return s[keep], y_all[keep].astype(bool), p, n_prompts


def _prompt_bootstrap_auroc(s: np.ndarray, y: np.ndarray, p: np.ndarray, n_prompts: int, n_boot: int, seed: int,
                            level: float) -> tuple[float, float, int]:
    if n_prompts == 0 or y.all() or not y.any():
        return math.nan, math.nan, n_boot
    w_pp = _pooled_auroc_by_prompt(s, y, p, n_prompts)
    counts = _draw_counts(_prompt_draws(n_prompts, n_boot, seed), n_prompts)
    n_pos = np.bincount(p[y], minlength=n_prompts)
    n_neg = np.bincount(p[~y], minlength=n_prompts)
    with np.errstate(invalid="ignore", divide="ignore"):
        aucs = ((counts @ w_pp) * counts).sum(axis=1) / ((counts @ n_pos) * (counts @ n_neg))
    return _interval(aucs, level)


# ---------------------------------------------------------------------------------------------------------------
# Within-prompt AUROC: what GRPO's group-relative advantage sees
# ---------------------------------------------------------------------------------------------------------------


def _within_parts(s: np.ndarray, y: np.ndarray, p: np.ndarray, n_prompts: int) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt: wins (positive above negative, ties 1/2) and pairs (n_pos * n_neg), over same-prompt pairs."""
    rank, k = _dense_ranks(s)
    neg_keys = np.sort(p[~y] * k + rank[~y])
    key = p[y] * k + rank[y]
    below = np.searchsorted(neg_keys, key, side="left") - np.searchsorted(neg_keys, p[y] * k, side="left")
    tied_or_below = np.searchsorted(neg_keys, key, side="right") - np.searchsorted(neg_keys, p[y] * k, side="left")
    wins = np.bincount(p[y], weights=(below + tied_or_below) / 2.0, minlength=n_prompts)
    pairs = np.bincount(p[y], minlength=n_prompts) * np.bincount(p[~y], minlength=n_prompts)
    return wins, pairs.astype(float)


def within_prompt_auroc(scores: Any, labels: Any, prompt_ids: Any, *, direction: str = HIGH, n_boot: int = 0,
                        seed: int = 0, level: float = 0.95) -> dict[str, Any]:
    """The AUROC over pairs of rollouts of the SAME prompt with different labels, pooled over prompts.

        AUROC_within = sum_p sum_{i pos in p, j neg in p} (1[s_i > s_j] + 1/2 1[s_i = s_j]) / sum_p n_pos,p n_neg,p

    the probability that a positive outranks a negative of its own prompt (ties 1/2), with prompts weighted by
    their number of such pairs (a prompt with 4 positives and 4 negatives weighs 16, one with 7 and 1 weighs 7).
    GRPO's group-relative advantage sees only these differences; the pooled ``auroc`` also ranks rollouts of
    different prompts against each other, so a signal that only tells prompts apart can score high there and 0.5
    here. ``direction``: where positives lie, as in ``signal_table``: ``"high"`` scores as given, ``"low"`` negates
    them first. Rollouts with a NaN score or an unknown label are dropped; a prompt left with one class gives no
    pair.

    Returns ``auroc`` (NaN without a pair), ``pairs``, ``prompts`` (prompts with at least one pair), ``rollouts``
    (rollouts in those prompts), and with ``n_boot`` >= 1 the ``prompt_bootstrap`` interval ``low``, ``high`` at
    ``level`` (resampling every prompt with a usable rollout; NaN with ``n_boot=0``), with ``n_undefined``.

    >>> scores, labels = [0.9, 0.1, 0.5, 0.2, 0.8, 0.3], [1, 0, 1, 0, 0, 1]
    >>> d = within_prompt_auroc(scores, labels, ["a", "a", "b", "b", "b", "b"])
    >>> d["auroc"], d["pairs"], d["prompts"], round(auroc(scores, labels), 3)
    (0.6, 5, 2, 0.778)

    (Prompt a: 0.9 > 0.1; prompt b: 0.5 and 0.3 each beat 0.2 and lose to 0.8: 3 wins of 5 pairs. The pooled
    AUROC also counts 0.9 of prompt a against 0.2 and 0.8 of prompt b: 7 of 9.)
    """
    if direction not in (LOW, HIGH):
        raise ValueError(f"direction must be 'low' or 'high' (where positives lie), got {direction!r}")
    if n_boot:
        _check_resampling(n_boot, level)
    s, y, p, n_prompts = _clean_clusters(scores, labels, prompt_ids)
    if direction == LOW:
        s = -s
    wins, pairs = _within_parts(s, y, p, n_prompts)
    total = float(pairs.sum())
    with_pairs = pairs > 0
    out = {"auroc": float(wins.sum() / total) if total else math.nan, "pairs": int(total),
           "prompts": int(with_pairs.sum()), "rollouts": int(with_pairs[p].sum()), "low": math.nan, "high": math.nan,
           "level": level, "n_undefined": 0}
    if n_boot and n_prompts:
        counts = _draw_counts(_prompt_draws(n_prompts, n_boot, seed), n_prompts)
        with np.errstate(invalid="ignore", divide="ignore"):
            out["low"], out["high"], out["n_undefined"] = _interval((counts @ wins) / (counts @ pairs), level)
    return out


# ---------------------------------------------------------------------------------------------------------------
# One common set of rollouts
# ---------------------------------------------------------------------------------------------------------------


def common_rollouts(signals: Mapping[str, Any], labels: Any = None) -> dict[str, Any]:
    """The rollouts on which every signal is defined, so that a table compares signals on the same rollouts.

    Signals that need a strict answer line (``answer_visual_gain``, ``answer_image_attention``) are undefined on
    rollouts without one, while MDI is defined everywhere: scored each on its own rollouts, two AUROCs answer two
    different questions. ``signals``: name -> per-rollout values, NaN or None where undefined. With ``labels``, a
    rollout also needs a known label (not None / NaN).

    Returns ``mask`` (a boolean numpy array over rollouts), ``n`` (its count), ``n_total`` (rollouts given) and
    ``n_defined``: name -> rollouts on which that signal is defined (and labelled, with ``labels``) before the
    restriction, so a reader sees which signal shrinks the set.

    >>> d = common_rollouts({"mdi": [1.0, 2.0, 3.0, 4.0], "gain": [0.5, None, 0.1, 0.2]}, [1, 0, None, 0])
    >>> d["mask"].tolist(), d["n"], d["n_defined"]
    ([True, False, False, True], 2, {'mdi': 3, 'gain': 2})
    """
    if not signals:
        raise ValueError("common_rollouts needs at least one signal")
    arrays = {name: _scores(values) for name, values in signals.items()}
    sizes = {name: x.size for name, x in arrays.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"signals differ in length: {sizes}; give every signal one value per rollout")
    n_total = next(iter(sizes.values()))
    known = np.ones(n_total, dtype=bool)
    if labels is not None:
        y = _labels(labels)
        if y.size != n_total:
            raise ValueError(f"labels has {y.size} entries for {n_total} rollouts")
        known = ~np.isnan(y)
    defined = {name: ~np.isnan(x) & known for name, x in arrays.items()}
    mask = np.logical_and.reduce(list(defined.values()))
    return {"mask": mask, "n": int(mask.sum()), "n_total": int(n_total),
            "n_defined": {name: int(d.sum()) for name, d in defined.items()}}


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
                 level: float = 0.95, common: bool = True, resample: str = PROMPTS) -> list[dict[str, Any]]:
    """One row per signal: how well it separates prior-following rollouts (``labels`` True) from the others.

    ``signals``: name -> per-rollout values (NaN / None = not measured), all aligned with ``labels`` (True =
    prior-following, None/NaN = unknown) and ``groups`` (the prompt each rollout answers). ``directions``: name ->
    ``"low"`` / ``"high"``, the value at which a rollout is prior-following; names missing there take
    ``default_direction``, and a name without either is a ValueError (a guessed direction could flip the
    conclusion). The AUROC is computed on the oriented signal (``-x`` for ``"low"``), so 1 = perfect, 0.5 = blind,
    < 0.5 = the signal points the other way.

    ``common`` (default): every signal is scored on the same rollouts, those where every signal given has a value
    and the label is known (``common_rollouts``), so the rows compare; ``n_defined`` says on how many each signal
    was defined before that restriction (pass only the signals you mean to compare: one defined on few rollouts
    shrinks the set for all). ``common=False``: each signal on its own rollouts. ``resample``: ``"prompts"``
    (default: ``bootstrap_auroc`` with ``prompt_ids=groups``, since the rollouts of one prompt are not independent)
    or ``"rollouts"`` (the stratified rollout bootstrap: narrower, and too narrow when the signal varies mostly
    between prompts).

    Row keys: ``signal``, ``direction``, ``n`` (rollouts scored: with a value and a label, in the common set when
    ``common``), ``n_prior`` (of them prior-following), ``n_defined`` (rollouts with a value and a label before the
    common restriction), ``auroc`` (pooled over prompts), ``low``, ``high`` (its bootstrap interval at ``level``),
    ``level``, ``resample``, ``within_auroc`` / ``within_low`` / ``within_high`` (``within_prompt_auroc``: pairs of
    rollouts of the same prompt only, prompt-bootstrap interval), ``within_pairs``, ``within_prompts``,
    ``within_group_share`` (``within_group_variance_share`` over every rollout with a value, labelled or not: with
    ``common``, over the rollouts where every signal has one), ``mean_prior`` and ``mean_other`` (the raw signal's
    mean on each scored class; NaN for an empty class).
    """
    if resample not in (PROMPTS, ROLLOUTS):
        raise ValueError(f"resample must be 'prompts' or 'rollouts', got {resample!r}")
    directions = dict(directions or {})
    y_all = _labels(labels)
    g_all = _numpy(groups).ravel()
    if g_all.shape != y_all.shape:
        raise ValueError(f"labels and groups differ in length: {y_all.size} vs {g_all.size}")
    resolved, values = {}, {}
    for name, raw in signals.items():
        direction = directions.get(name, default_direction(name))
        if direction not in (LOW, HIGH):
            raise ValueError(f"signal {name!r}: direction must be 'low' or 'high' (where prior-following rollouts "
                             f"lie), got {direction!r}; pass directions={{{name!r}: 'low' | 'high'}}")
        x = _scores(raw)
        if x.shape != y_all.shape:
            raise ValueError(f"signal {name!r} has {x.size} values for {y_all.size} labels")
        resolved[name], values[name] = direction, x
    n_defined = {name: int((~np.isnan(x) & ~np.isnan(y_all)).sum()) for name, x in values.items()}
    if common and values:
        scored = common_rollouts(values, y_all)["mask"]
        valued = common_rollouts(values)["mask"]
    rows = []
    for name, x in values.items():
        direction = resolved[name]
        share_x = x
        if common:
            x, share_x = np.where(scored, x, np.nan), np.where(valued, x, np.nan)
        oriented = -x if direction == LOW else x
        value, low, high = bootstrap_auroc(oriented, y_all, n_boot=n_boot, seed=seed, level=level,
                                           prompt_ids=g_all if resample == PROMPTS else None)
        within = within_prompt_auroc(oriented, y_all, g_all, n_boot=n_boot, seed=seed, level=level)
        known = ~np.isnan(x) & ~np.isnan(y_all)
        prior, other = x[known & (y_all == 1)], x[known & (y_all == 0)]
        rows.append({
            "signal": name, "direction": direction, "n": int(known.sum()), "n_prior": int(prior.size),
            "n_defined": n_defined[name], "auroc": value, "low": low, "high": high, "level": level,
            "resample": resample, "within_auroc": within["auroc"], "within_low": within["low"],
            "within_high": within["high"], "within_pairs": within["pairs"], "within_prompts": within["prompts"],
            "within_group_share": within_group_variance_share(share_x, g_all),
            "mean_prior": float(prior.mean()) if prior.size else math.nan,
            "mean_other": float(other.mean()) if other.size else math.nan,
        })
    return rows


def _fmt(x: float, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def format_signal_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """``signal_table``'s rows as a Markdown table (NaN shown as n/a).

    Rows from an older ``signal_table`` (without the within-prompt AUROC or ``n_defined``) print without those
    columns; ``n (prior-following)`` then reads ``n (prior) of n_defined`` where the common set left rollouts out.

    >>> print(format_signal_table([{"signal": "visual_gain", "direction": "low", "n": 40, "n_prior": 10,
    ...     "auroc": 0.81, "low": 0.7, "high": 0.9, "level": 0.95, "within_group_share": 0.6,
    ...     "mean_prior": 0.02, "mean_other": float("nan")}]))
    | signal | prior-following when | n (prior-following) | AUROC [95% CI] | within-group variance share | mean, prior-following | mean, other |
    |---|---|---|---|---|---|---|
    | visual_gain | low | 40 (10) | 0.810 [0.700, 0.900] | 0.600 | 0.020 | n/a |
    """
    level = rows[0]["level"] if rows else 0.95
    within = any("within_auroc" in r for r in rows)
    by = {PROMPTS: ", prompts resampled", ROLLOUTS: ", rollouts resampled"}.get(rows[0].get("resample") if rows
                                                                               else None, "")
    head = ["signal", "prior-following when", "n (prior-following)", f"AUROC [{level:.0%} CI{by}]"]
    if within:
        head.append(f"within-prompt AUROC [{level:.0%} CI] (pairs, prompts)")
    head += ["within-group variance share", "mean, prior-following", "mean, other"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        n = f"{r['n']} ({r['n_prior']})"
        if r.get("n_defined", r["n"]) != r["n"]:
            n += f" of {r['n_defined']}"
        cells = [r["signal"], r["direction"], n, f"{_fmt(r['auroc'])} [{_fmt(r['low'])}, {_fmt(r['high'])}]"]
        if within:
            cells.append(f"{_fmt(r.get('within_auroc'))} [{_fmt(r.get('within_low'))}, "
                         f"{_fmt(r.get('within_high'))}] ({r.get('within_pairs', 0)}, {r.get('within_prompts', 0)})")
        cells += [_fmt(r["within_group_share"]), _fmt(r["mean_prior"]), _fmt(r["mean_other"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
