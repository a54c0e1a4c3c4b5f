"""The reviewer's statistics in ``trl_mdi.profile.validation``: the prompt bootstrap against an explicit resampling
loop and a coverage simulation, the within-prompt AUROC against a brute-force pair enumeration, the common rollout
set. The benchmarks' paired-seed statistics are tested in test_benchmark_stats.py."""

import itertools
import math

import numpy as np
import pytest

from trl_mdi.profile import validation as R

# --------------------------------------------------------------------------------------------- prompt bootstrap


def _loop_prompt_bootstrap(statistic, arrays, prompt_ids, n_boot, seed, level, pass_prompts=False):
    """Written out: the documented draws, each resample built by concatenating the drawn prompts' rollouts."""
    prompts = sorted(set(prompt_ids))
    members = {p: [i for i, q in enumerate(prompt_ids) if q == p] for p in prompts}
    draws = np.random.default_rng(seed).integers(0, len(prompts), (n_boot, len(prompts)))
    thetas = []
    for drawn in draws:
        rows = [i for k in drawn for i in members[prompts[k]]]
        ids = [j for j, k in enumerate(drawn) for _ in members[prompts[k]]]
        parts = [np.asarray(a)[rows] for a in arrays]
        thetas.append(float(statistic(*parts, np.asarray(ids)) if pass_prompts else statistic(*parts)))
    thetas = np.asarray(thetas)
    finite = thetas[np.isfinite(thetas)]
    low, high = np.quantile(finite, [(1 - level) / 2, (1 + level) / 2])
    return low, high, int(thetas.size - finite.size)


def _clustered(seed, n_prompts=40, per_prompt=8, between=2.0, within=1.0, effect=1.0):
    """Rollouts sharing a prompt: a prompt effect (sd ``between``) on every rollout of it, a label rate that varies
    by prompt, and a label effect ``effect``. Returns scores, labels, prompt ids."""
    rng = np.random.default_rng(seed)
    prompt = np.repeat(np.arange(n_prompts), per_prompt)
    rate = rng.beta(2, 2, n_prompts)[prompt]
    labels = rng.random(prompt.size) < rate
    scores = between * rng.normal(size=n_prompts)[prompt] + within * rng.normal(size=prompt.size) + effect * labels
    return scores, labels, prompt


def test_prompt_bootstrap_matches_an_explicit_loop():
    rng = np.random.default_rng(4)
    ids = [f"p{k}" for k in rng.integers(0, 9, 50)]  # uneven prompt sizes, string ids
    values = rng.normal(size=50)
    labels = rng.random(50) < 0.4
    got = R.prompt_bootstrap(np.mean, [values], ids, n_boot=150, seed=3, level=0.9)
    low, high, undefined = _loop_prompt_bootstrap(np.mean, [values], ids, 150, 3, 0.9)
    assert (got["low"], got["high"]) == pytest.approx((low, high), abs=1e-12)
    assert got["value"] == pytest.approx(values.mean()) and got["n_prompts"] == len(set(ids))
    assert got["n_undefined"] == undefined == 0 and got["n_boot"] == 150 and got["level"] == 0.9
    # a two-array statistic (the AUROC): the arrays travel together
    got = R.prompt_bootstrap(R.auroc, [values, labels], ids, n_boot=150, seed=3)
    assert (got["low"], got["high"], got["n_undefined"]) == pytest.approx(
        _loop_prompt_bootstrap(R.auroc, [values, labels], ids, 150, 3, 0.95), abs=1e-12)


def test_prompt_bootstrap_keeps_prompts_whole_and_counts_a_twice_drawn_prompt_twice():
    ids = [0, 0, 0, 1, 2, 2]  # sizes 3, 1, 2
    sizes = np.array([3, 1, 2])
    draws = np.random.default_rng(7).integers(0, 3, (40, 3))
    # the resample's size is the drawn prompts' sizes summed: every rollout of a drawn prompt comes along
    lengths = []
    R.prompt_bootstrap(lambda x: lengths.append(len(x)) or 0.0, [np.zeros(6)], ids, n_boot=40, seed=7)
    assert lengths[1:] == sizes[draws].sum(axis=1).tolist()  # lengths[0]: the statistic on the data itself
    # with pass_prompts, a prompt drawn twice arrives as two prompts: always 3 distinct ids, one per draw
    distinct = []
    R.prompt_bootstrap(lambda x, g: distinct.append(len(set(g.tolist()))) or 0.0, [np.zeros(6)], ids, n_boot=40,
                       seed=7, pass_prompts=True)
    assert distinct[1:] == [3] * 40


def test_prompt_bootstrap_leaves_out_undefined_resamples_and_is_deterministic():
    # prompt 0 all positives, prompt 1 all negatives: a resample drawing one prompt twice has no AUROC
    got = R.prompt_bootstrap(R.auroc, [[0.9, 0.8, 0.1, 0.2], [1, 1, 0, 0]], [0, 0, 1, 1], n_boot=200, seed=1)
    draws = np.random.default_rng(1).integers(0, 2, (200, 2))
    assert got["n_undefined"] == int((draws[:, 0] == draws[:, 1]).sum())
    assert got["low"] == got["high"] == got["value"] == 1.0
    a = R.prompt_bootstrap(np.mean, [np.arange(20.0)], np.arange(20) // 3, n_boot=100, seed=5)
    assert a == R.prompt_bootstrap(np.mean, [np.arange(20.0)], np.arange(20) // 3, n_boot=100, seed=5)
    assert a != R.prompt_bootstrap(np.mean, [np.arange(20.0)], np.arange(20) // 3, n_boot=100, seed=6)


def test_prompt_bootstrap_errors():
    with pytest.raises(ValueError, match="n_boot"):
        R.prompt_bootstrap(np.mean, [[1.0]], [0], n_boot=0)
    with pytest.raises(ValueError, match="level"):
        R.prompt_bootstrap(np.mean, [[1.0]], [0], level=95)
    with pytest.raises(ValueError, match=r"arrays\[1\] has 1 rollouts, arrays\[0\] has 2"):
        R.prompt_bootstrap(R.auroc, [[1.0, 2.0], [1]], [0, 1])
    with pytest.raises(ValueError, match="prompt_ids has 1 entries for 2 rollouts"):
        R.prompt_bootstrap(np.mean, [[1.0, 2.0]], [0])


def test_bootstrap_auroc_by_prompt_equals_the_generic_prompt_bootstrap():
    scores, labels, prompt = _clustered(2, n_prompts=25, per_prompt=6)
    scores = np.round(scores, 1)  # ties, within and across prompts
    scores[[3, 40]] = np.nan
    labels = labels.astype(object)
    labels[6:12] = None  # prompt 1 keeps no labelled rollout: it leaves the resampled set
    value, low, high = R.bootstrap_auroc(scores, labels, n_boot=300, seed=9, prompt_ids=prompt)
    keep = ~np.isnan(scores) & np.array([v is not None for v in labels])
    s, y, g = scores[keep], labels[keep].astype(bool), prompt[keep]
    generic = R.prompt_bootstrap(R.auroc, [s, y], g, n_boot=300, seed=9)
    assert value == pytest.approx(R.auroc(s, y)) == pytest.approx(generic["value"])
    assert (low, high) == pytest.approx((generic["low"], generic["high"]), abs=1e-12)
    assert generic["n_prompts"] == 24
    assert all(math.isnan(x) for x in R.bootstrap_auroc([1.0, 2.0], [True, True], prompt_ids=[0, 1]))


def test_resampling_prompts_widens_the_interval_where_prompts_differ():
    """Between-prompt variance 4 against 1 within (intraclass correlation 0.8), 8 rollouts per prompt: a rollout
    bootstrap treats 320 correlated rollouts as independent; the design effect 1 + 7 x 0.8 = 6.6 predicts the prompt
    interval of a mean sqrt(6.6) = 2.6 times wider."""
    scores, labels, prompt = _clustered(0)
    by_prompt = R.prompt_bootstrap(np.mean, [scores], prompt, n_boot=1000, seed=0)
    draws = np.random.default_rng(0).integers(0, scores.size, (1000, scores.size))
    by_rollout = np.quantile(scores[draws].mean(axis=1), [0.025, 0.975])
    ratio = (by_prompt["high"] - by_prompt["low"]) / (by_rollout[1] - by_rollout[0])
    assert 2.0 < ratio < 3.3, ratio
    # the AUROC too: the prompt effect moves which rollouts rank high
    _, rl, rh = R.bootstrap_auroc(scores, labels, n_boot=1000, seed=0)
    _, pl, ph = R.bootstrap_auroc(scores, labels, n_boot=1000, seed=0, prompt_ids=prompt)
    assert (ph - pl) > 1.5 * (rh - rl), (ph - pl, rh - rl)
    # with no prompt effect the two agree: the widening is the clustering, not the method
    flat, flat_labels, flat_prompt = _clustered(0, between=0.0)
    _, rl, rh = R.bootstrap_auroc(flat, flat_labels, n_boot=1000, seed=0)
    _, pl, ph = R.bootstrap_auroc(flat, flat_labels, n_boot=1000, seed=0, prompt_ids=flat_prompt)
    assert (ph - pl) / (rh - rl) == pytest.approx(1.0, abs=0.25)


def test_the_prompt_interval_covers_the_true_mean_and_the_rollout_interval_does_not():
    """60 data sets drawn around a known mean 0: the 95% prompt-bootstrap interval covers it about 95% of the time
    (a percentile interval over 30 prompts runs a little short), the rollout bootstrap's about half the time."""
    covered = {"prompts": 0, "rollouts": 0}
    for k in range(60):
        scores, _, prompt = _clustered(100 + k, n_prompts=30, effect=0.0)  # every rollout's true mean is 0
        p = R.prompt_bootstrap(np.mean, [scores], prompt, n_boot=300, seed=k)
        covered["prompts"] += p["low"] <= 0.0 <= p["high"]
        draws = np.random.default_rng(k).integers(0, scores.size, (300, scores.size))
        low, high = np.quantile(scores[draws].mean(axis=1), [0.025, 0.975])
        covered["rollouts"] += low <= 0.0 <= high
    assert covered["prompts"] >= 51, covered  # >= 0.85
    assert covered["rollouts"] <= 42, covered  # <= 0.70


# ------------------------------------------------------------------------------------------ within-prompt AUROC


def _brute_within(scores, labels, prompts):
    """Every pair (i, j) of the same prompt with labels 1 and 0 and both scores known: 1 if s_i > s_j, 1/2 if tied."""
    wins = pairs = 0.0
    used = set()
    for i, j in itertools.product(range(len(scores)), repeat=2):
        if prompts[i] != prompts[j] or labels[i] is None or labels[j] is None:
            continue
        if not (labels[i] and not labels[j]) or math.isnan(scores[i]) or math.isnan(scores[j]):
            continue
        pairs += 1
        wins += 1.0 if scores[i] > scores[j] else 0.5 if scores[i] == scores[j] else 0.0
        used.add(prompts[i])
    return wins / pairs if pairs else math.nan, int(pairs), used


@pytest.mark.parametrize("seed", range(4))
def test_within_prompt_auroc_matches_a_brute_force_pair_count(seed):
    rng = np.random.default_rng(seed)
    n = 70
    prompts = [f"q{k}" for k in rng.integers(0, 12, n)]
    scores = rng.integers(0, 5, n).astype(float)  # many ties
    labels = [bool(v) for v in rng.random(n) < 0.45]
    scores[rng.integers(0, n, 4)] = np.nan
    for i in rng.integers(0, n, 5):
        labels[i] = None
    d = R.within_prompt_auroc(scores, labels, prompts)
    want, pairs, used = _brute_within(scores.tolist(), labels, prompts)
    assert d["auroc"] == pytest.approx(want, abs=1e-12)
    assert (d["pairs"], d["prompts"]) == (pairs, len(used))
    usable = [not math.isnan(s) and y is not None for s, y in zip(scores, labels)]
    assert d["rollouts"] == sum(u and p in used for u, p in zip(usable, prompts))  # usable rollouts of those prompts
    # direction "low" is the brute force on the negated scores
    low = R.within_prompt_auroc(scores, labels, prompts, direction="low")
    assert low["auroc"] == pytest.approx(_brute_within((-scores).tolist(), labels, prompts)[0], abs=1e-12)


def test_within_prompt_auroc_is_blind_to_a_signal_that_only_tells_prompts_apart():
    """The score is the prompt's own number and positives are frequent on high-number prompts: the pooled AUROC is
    high, the within-prompt one exactly 1/2 (every same-prompt pair is a tie), as GRPO would see it."""
    prompt = np.repeat(np.arange(10), 6)
    labels = np.arange(60) % 6 < 1 + prompt // 2  # prompt k: 1 + k // 2 positives of 6
    scores = prompt.astype(float)
    assert R.auroc(scores, labels) > 0.7
    d = R.within_prompt_auroc(scores, labels, prompt)
    assert d["auroc"] == 0.5 and d["pairs"] == sum((1 + k // 2) * (5 - k // 2) for k in range(10))
    assert d["prompts"] == 10 and d["rollouts"] == 60


def test_within_prompt_auroc_weights_prompts_by_their_pairs():
    # prompt a: 1 positive above 3 negatives (3 pairs, all won); prompt b: 1 positive below 1 negative (1 pair, lost)
    d = R.within_prompt_auroc([5, 1, 2, 3, 0, 9], [1, 0, 0, 0, 1, 0], list("aaaabb"))
    assert d["auroc"] == 3 / 4 and d["pairs"] == 4  # not (1 + 0) / 2: a prompt weighs its pair count
    one_class = R.within_prompt_auroc([1, 2, 3], [1, 1, 0], ["a", "a", "b"])
    assert math.isnan(one_class["auroc"]) and one_class["pairs"] == 0 and one_class["prompts"] == 0
    with pytest.raises(ValueError, match="direction must be"):
        R.within_prompt_auroc([1, 2], [1, 0], [0, 0], direction="up")
    with pytest.raises(ValueError, match="prompt_ids has 1 entries for 2 rollouts"):
        R.within_prompt_auroc([1, 2], [1, 0], [0])


def test_within_prompt_interval_equals_the_generic_prompt_bootstrap():
    scores, labels, prompt = _clustered(5, n_prompts=20, per_prompt=8)
    d = R.within_prompt_auroc(scores, labels, prompt, n_boot=250, seed=4, level=0.9)
    generic = R.prompt_bootstrap(lambda s, y, g: R.within_prompt_auroc(s, y, g)["auroc"], [scores, labels], prompt,
                                 n_boot=250, seed=4, level=0.9, pass_prompts=True)
    assert d["auroc"] == pytest.approx(generic["value"])
    assert (d["low"], d["high"], d["n_undefined"]) == pytest.approx(
        (generic["low"], generic["high"], generic["n_undefined"]), abs=1e-12)
    assert d["low"] <= d["auroc"] <= d["high"]
    assert math.isnan(R.within_prompt_auroc(scores, labels, prompt)["low"])  # n_boot=0: no interval


# ------------------------------------------------------------------------------------------- common rollout set


def test_common_rollouts_by_hand():
    nan = float("nan")
    d = R.common_rollouts({"mdi": [1.0, 2.0, 3.0, 4.0, 5.0], "answer_visual_gain": [0.1, None, 0.3, nan, 0.5],
                           "blind_agrees": [1, 0, None, 1, 1]})
    assert d["mask"].tolist() == [True, False, False, False, True] and d["n"] == 2 and d["n_total"] == 5
    assert d["n_defined"] == {"mdi": 5, "answer_visual_gain": 3, "blind_agrees": 4}
    labelled = R.common_rollouts({"mdi": [1.0, 2.0, 3.0]}, [True, None, False])
    assert labelled["mask"].tolist() == [True, False, True] and labelled["n_defined"] == {"mdi": 2}
    with pytest.raises(ValueError, match="signals differ in length"):
        R.common_rollouts({"a": [1.0], "b": [1.0, 2.0]})
    with pytest.raises(ValueError, match="at least one signal"):
        R.common_rollouts({})


def test_signal_table_scores_every_signal_on_one_set_and_reports_n_per_signal():
    scores, labels, prompt = _clustered(3, n_prompts=30, per_prompt=6)
    rng = np.random.default_rng(3)
    mdi = scores + rng.normal(size=scores.size)  # defined everywhere
    gain = -scores
    gain[rng.random(scores.size) < 0.2] = np.nan  # undefined without an answer line
    labels = labels.astype(object)
    labels[:6] = None
    rows = R.signal_table({"mdi": mdi, "visual_gain": gain}, labels, prompt, n_boot=200, seed=2)
    by = {r["signal"]: r for r in rows}
    known = np.array([v is not None for v in labels])
    y = np.array([bool(v) if v is not None else False for v in labels])
    common = known & ~np.isnan(gain)
    assert by["mdi"]["n"] == by["visual_gain"]["n"] == common.sum()
    assert by["mdi"]["n_defined"] == known.sum() and by["visual_gain"]["n_defined"] == (known & ~np.isnan(gain)).sum()
    assert by["mdi"]["n_prior"] == (common & y).sum()
    assert by["mdi"]["auroc"] == pytest.approx(R.auroc(mdi[common], y[common]))
    assert by["visual_gain"]["auroc"] == pytest.approx(R.auroc(-gain[common], y[common]))
    assert by["mdi"]["mean_prior"] == pytest.approx(mdi[common & y].mean())
    valued = ~np.isnan(gain)  # the variance share: every rollout where every signal has a value, labelled or not
    assert by["mdi"]["within_group_share"] == pytest.approx(R.within_group_variance_share(mdi[valued], prompt[valued]))
    # the interval resamples prompts, and the within-prompt columns are within_prompt_auroc on the oriented signal
    r = by["visual_gain"]
    assert r["resample"] == "prompts"
    assert (r["auroc"], r["low"], r["high"]) == pytest.approx(
        R.bootstrap_auroc(-gain[common], y[common], n_boot=200, seed=2, prompt_ids=prompt[common]))
    w = R.within_prompt_auroc(-gain[common], y[common], prompt[common], n_boot=200, seed=2)
    assert (r["within_auroc"], r["within_low"], r["within_high"], r["within_pairs"], r["within_prompts"]) == \
        pytest.approx((w["auroc"], w["low"], w["high"], w["pairs"], w["prompts"]))
    # resample="rollouts" is the stratified rollout bootstrap
    rr = R.signal_table({"visual_gain": gain}, labels, prompt, n_boot=200, seed=2, resample="rollouts")[0]
    assert (rr["low"], rr["high"]) == pytest.approx(R.bootstrap_auroc(-gain[common], y[common], n_boot=200,
                                                                      seed=2)[1:])
    with pytest.raises(ValueError, match="resample must be 'prompts' or 'rollouts'"):
        R.signal_table({"mdi": mdi}, labels, prompt, resample="clusters")
    table = R.format_signal_table(rows)
    assert "AUROC [95% CI, prompts resampled]" in table and "within-prompt AUROC [95% CI] (pairs, prompts)" in table
    assert f"| mdi | high | {common.sum()} ({(common & y).sum()}) of {known.sum()} |" in table
    assert f"({r['within_pairs']}, {r['within_prompts']}) |" in table
