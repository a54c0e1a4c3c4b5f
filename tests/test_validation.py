"""Reliance validation: AUROC and its bootstrap against brute force, variance shares, labels, the signal table."""

import itertools
import math

import numpy as np
import pytest
import torch

from trl_mdi.profile import validation as R


def _pairwise_auroc(scores, labels):
    """Brute force: every (positive, negative) pair, 1 for a win, 1/2 for a tie."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum((p > n) + 0.5 * (p == n) for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(5))
def test_auroc_matches_the_pairwise_count_with_ties(seed):
    rng = np.random.default_rng(seed)
    n = 60
    scores = rng.integers(0, 6, n).astype(float)  # few distinct values: many ties, within and across classes
    labels = rng.random(n) < 0.3
    assert R.auroc(scores, labels) == pytest.approx(_pairwise_auroc(scores, labels), abs=1e-12)
    cont = rng.normal(size=n) + labels  # continuous scores with some signal
    assert R.auroc(cont, labels) == pytest.approx(_pairwise_auroc(cont, labels), abs=1e-12)


def test_auroc_edges_nan_and_input_types():
    assert R.auroc([1, 2, 3, 4], [0, 0, 1, 1]) == 1.0
    assert R.auroc([4, 3, 2, 1], [0, 0, 1, 1]) == 0.0
    assert R.auroc([5, 5, 5, 5], [0, 1, 0, 1]) == 0.5
    assert math.isnan(R.auroc([1, 2], [True, True])) and math.isnan(R.auroc([], []))
    # NaN scores and unknown labels are dropped, not ranked
    assert R.auroc([1, float("nan"), 3, 0, 9], [False, True, True, None, None]) == 1.0
    assert R.auroc(torch.tensor([0.1, 0.9]), torch.tensor([False, True])) == 1.0
    assert R.auroc([-math.inf, math.inf, math.inf], [0, 1, 0]) == 0.75
    with pytest.raises(ValueError, match="labels must be booleans"):
        R.auroc([1, 2], [0, 2])
    with pytest.raises(ValueError, match="differ in length"):
        R.auroc([1, 2, 3], [0, 1])


def test_bootstrap_matches_brute_force_resamples():
    rng = np.random.default_rng(3)
    scores = np.round(rng.normal(size=45), 1)  # ties
    labels = rng.random(45) < 0.4
    scores[[2, 7]] = np.nan
    value, low, high = R.bootstrap_auroc(scores, labels, n_boot=200, seed=11, level=0.9)

    keep = ~np.isnan(scores)
    s, y = scores[keep], labels[keep]
    pos, neg = s[y], s[~y]
    draws = np.random.default_rng(11)  # the documented draw order: positives first, then negatives
    dp = draws.integers(0, pos.size, (200, pos.size))
    dn = draws.integers(0, neg.size, (200, neg.size))
    brute = [_pairwise_auroc(np.r_[pos[dp[b]], neg[dn[b]]], [True] * pos.size + [False] * neg.size)
             for b in range(200)]
    assert value == pytest.approx(_pairwise_auroc(s, y))
    assert (low, high) == pytest.approx(tuple(np.quantile(brute, [0.05, 0.95])), abs=1e-12)
    assert low <= value <= high


def test_bootstrap_is_deterministic_and_narrows_with_n():
    # No timing here (speed belongs to benchmarks): 2,000 rollouts x 1,000 resamples take ~0.03 s of CPU.
    rng = np.random.default_rng(0)
    labels = rng.random(2000) < 0.3
    scores = rng.normal(size=2000) + 0.8 * labels
    a = R.bootstrap_auroc(scores, labels, n_boot=1000, seed=5)
    assert a == R.bootstrap_auroc(scores, labels, n_boot=1000, seed=5)
    assert a != R.bootstrap_auroc(scores, labels, n_boot=1000, seed=6)
    small = R.bootstrap_auroc(scores[:200], labels[:200], n_boot=1000, seed=5)
    assert (a[2] - a[1]) < (small[2] - small[1])
    # true AUROC of N(0.8, 1) vs N(0, 1) is Phi(0.8 / sqrt 2) = 0.714: the 95% interval covers it
    assert a[1] < 0.714 < a[2]


def test_bootstrap_edges():
    assert all(math.isnan(x) for x in R.bootstrap_auroc([1.0, 2.0], [True, True]))
    one_each = R.bootstrap_auroc([1.0, 2.0], [False, True], n_boot=50)
    assert one_each == (1.0, 1.0, 1.0)  # stratified: every resample keeps both classes
    with pytest.raises(ValueError, match="n_boot"):
        R.bootstrap_auroc([1.0, 2.0], [False, True], n_boot=0)
    with pytest.raises(ValueError, match="level"):
        R.bootstrap_auroc([1.0, 2.0], [False, True], level=1.0)


def test_within_group_variance_share_against_a_loop():
    rng = np.random.default_rng(1)
    groups = np.repeat(np.arange(10), 8)
    values = rng.normal(size=80) + 3 * rng.normal(size=10)[groups]  # mostly between prompts
    values[[0, 17, 18]] = np.nan
    keep = ~np.isnan(values)
    x, g = values[keep], groups[keep]
    within = sum(((x[g == k] - x[g == k].mean()) ** 2).sum() for k in np.unique(g))
    total = ((x - x.mean()) ** 2).sum()
    assert R.within_group_variance_share(values, groups) == pytest.approx(within / total)
    assert R.within_group_variance_share(values, groups) < 0.5


def test_within_group_variance_share_edges():
    assert R.within_group_variance_share([1, 2, 3, 4], [0, 0, 0, 0]) == 1.0  # one group: all within
    assert R.within_group_variance_share([1, 1, 5, 5], ["p", "p", "q", "q"]) == 0.0  # constant per prompt
    assert R.within_group_variance_share([1, 5, 9], [0, 1, 2]) == 0.0  # singleton groups contribute 0
    assert math.isnan(R.within_group_variance_share([2, 2], [0, 1]))  # 0 / 0
    assert math.isnan(R.within_group_variance_share([float("nan")], [0]))
    with pytest.raises(ValueError, match="differ in length"):
        R.within_group_variance_share([1, 2], [0])


def test_prior_following_rule():
    assert R.prior_following("B", "B", "A") is True
    assert R.prior_following("A", "A", "A") is False  # the blind model knew it: not evidence of a prior
    assert R.prior_following("C", "B", "A") is False  # wrong, but not the blind answer
    assert R.prior_following("B", None, "A") is False
    assert R.prior_following(None, "B", "A") is None
    assert R.prior_following("B", "B", None) is None


def test_label_agreement_counts_and_rates():
    rule = [True, True, True, False, False, False, None, True]
    data = [True, True, False, True, False, False, True, None]
    d = R.label_agreement(rule, data)
    assert (d["n"], d["n_dropped"], d["tp"], d["fp"], d["fn"], d["tn"]) == (6, 2, 2, 1, 1, 2)
    assert d["agreement"] == pytest.approx(4 / 6)
    assert d["precision"] == pytest.approx(2 / 3) and d["recall"] == pytest.approx(2 / 3)
    # kappa from its definition: chance agreement p_e = P(rule T) P(data T) + P(rule F) P(data F)
    p_e = (3 / 6) * (3 / 6) + (3 / 6) * (3 / 6)
    assert d["kappa"] == pytest.approx((4 / 6 - p_e) / (1 - p_e))
    empty = R.label_agreement([None], [True])
    assert empty["n"] == 0 and math.isnan(empty["agreement"]) and math.isnan(empty["kappa"])
    assert math.isnan(R.label_agreement([False, False], [False, False])["precision"])
    with pytest.raises(ValueError, match="differ in length"):
        R.label_agreement([True], [True, False])


def test_signal_table_orients_each_signal_and_reports_classes():
    rng = np.random.default_rng(2)
    n = 120
    groups = np.repeat(np.arange(20), 6)
    labels = rng.random(n) < 0.35
    visual_gain = rng.normal(size=n) - 1.5 * labels  # low when prior-following
    mdi = rng.normal(size=n) + 1.5 * labels  # high when prior-following
    noise = rng.normal(size=n)
    visual_gain[5] = np.nan
    # common=False: each signal on its own rollouts (the common set is tested in test_validation_stats.py)
    rows = R.signal_table({"visual_gain": visual_gain, "mdi_late": mdi, "custom": noise}, labels, groups,
                          directions={"custom": "high"}, n_boot=200, seed=0, common=False)
    by = {r["signal"]: r for r in rows}
    assert [r["signal"] for r in rows] == ["visual_gain", "mdi_late", "custom"]
    assert by["visual_gain"]["direction"] == "low" and by["mdi_late"]["direction"] == "high"
    assert by["visual_gain"]["auroc"] == pytest.approx(R.auroc(-visual_gain, labels)) and by["visual_gain"]["auroc"] > 0.8
    assert by["mdi_late"]["auroc"] == pytest.approx(R.auroc(mdi, labels)) and by["mdi_late"]["auroc"] > 0.8
    assert by["visual_gain"]["n"] == n - 1 and by["mdi_late"]["n"] == n
    assert by["mdi_late"]["n_prior"] == labels.sum()
    r = by["visual_gain"]
    assert r["low"] <= r["auroc"] <= r["high"] and r["level"] == 0.95
    assert r["mean_prior"] == pytest.approx(np.nanmean(visual_gain[labels]))
    assert r["mean_other"] == pytest.approx(np.nanmean(visual_gain[~labels]))
    assert r["within_group_share"] == pytest.approx(R.within_group_variance_share(visual_gain, groups))
    # a caller's direction overrides the default: the same signal flipped gives 1 - AUROC
    flipped = R.signal_table({"visual_gain": visual_gain}, labels, groups, directions={"visual_gain": "high"},
                             n_boot=10, common=False)[0]
    assert flipped["auroc"] == pytest.approx(1 - r["auroc"])
    table = R.format_signal_table(rows)
    assert table.count("\n") == 4 and "| mdi_late | high | 120 (" in table


def test_signal_table_refuses_to_guess_a_direction():
    with pytest.raises(ValueError, match="signal 'mdi_balance': direction must be 'low' or 'high'"):
        R.signal_table({"mdi_balance": [0.1, 0.2]}, [True, False], [0, 0])
    with pytest.raises(ValueError, match="direction must be"):
        R.signal_table({"x": [0.1, 0.2]}, [True, False], [0, 0], directions={"x": "down"})
    with pytest.raises(ValueError, match="has 3 values for 2 labels"):
        R.signal_table({"mdi": [0.1, 0.2, 0.3]}, [True, False], [0, 0])


def test_default_directions():
    low = ["visual_gain", "answer_visual_gain", "answer_image_attention", "aei_image", "aei_image_late"]
    high = ["blind_agrees", "mdi", "mdi_early", "mdi_late", "aei_text", "aei_text_middle"]
    assert [R.default_direction(n) for n in low] == ["low"] * len(low)
    assert [R.default_direction(n) for n in high] == ["high"] * len(high)
    assert [R.default_direction(n) for n in ("mdi_balance", "mdi_group_score", "entropy")] == [None] * 3
