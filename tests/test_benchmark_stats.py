"""The benchmarks' statistics in ``benchmarks.stats``: the t intervals against a printed table and against
RESULTS.md's stored figures, paired seed differences, the verdict's cases, the exact sign-flip test against
scipy's, and the module's doctests (``benchmarks/`` is outside pytest's doctest paths)."""

import doctest
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

import benchmarks.stats as R


def test_doctests():
    failed, tried = doctest.testmod(R)
    assert tried and not failed


# ----------------------------------------------------------------------------------------------- t intervals

# Student's t, two-sided 95% (the 0.975 quantile), from a printed table (3 decimals), df 1..30
T_975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def test_the_interval_takes_the_two_sided_t_quantile_of_n_minus_1_df():
    """The t quantile is scipy's; what is ours is asking for the right one: (1 + level) / 2 at n - 1 df."""
    for n, want in enumerate(T_975, start=2):
        d = R.paired_seed_difference(list(range(n)), [0.5 * s * s for s in range(n)])
        assert d["t"] == pytest.approx(want, abs=5e-4), n
        assert d["high"] - d["mean"] == pytest.approx(d["t"] * d["sd"] / math.sqrt(n), rel=1e-12)
    for level, n, want in [(0.90, 2, 6.314), (0.90, 5, 2.132), (0.90, 31, 1.697), (0.99, 5, 4.604),
                           (0.99, 11, 3.169), (0.8, 6, 1.476)]:
        assert R.paired_seed_difference([0.1 * s * s for s in range(n)], [0.0] * n, level=level)["t"] == \
            pytest.approx(want, abs=5e-4), (level, n)


def _results_table(heading: str, caption: str) -> list[list[str]]:
    """Rows (cells stripped) of the table under ``caption`` in RESULTS.md's section ``heading``."""
    text = (Path(__file__).resolve().parents[1] / "benchmarks" / "RESULTS.md").read_text()
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    block = section.split(caption, 1)[1].split("\n\n", 2)[1]  # the caption line ends, then the table
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.splitlines()[2:]]


def test_the_replications_intervals_follow_from_its_stored_per_seed_values():
    """The stored records and their figures: RESULTS.md's primary intervals (computed when the t quantile was
    hand-written) come out of the same section's per-seed table again, to the printed 3 decimals."""
    heading = "## Look or guess, replication: pre-registered plan and results"
    per_seed = _results_table(heading, "Per seed, conflict accuracy:")
    arm = {k: {int(r[0]): float(r[1 + i]) for r in per_seed} for i, k in enumerate("ABCD")}
    assert len(per_seed) == 16
    family = R.holm_family({"B vs A": (arm["B"], arm["A"]), "C vs A": (arm["C"], arm["A"])})
    primary = {r[0]: r for r in _results_table(heading, "Primary (conflict accuracy")}
    for name in ("B vs A", "C vs A"):
        assert R.format_paired_difference(family[name]["difference"]) == primary[name][3], name
    secondary = {r[0]: r for r in _results_table(heading, "Secondary (95% paired t")}
    vs_placebo = R.paired_seed_difference(arm["C"], arm["D"])
    assert R.format_paired_difference(vs_placebo).removesuffix(" (16 seeds)") == secondary["C vs A"][1]


# ------------------------------------------------------------------------------------- paired seed differences


def test_paired_seed_difference_by_hand():
    # per-seed differences 0.10, 0.05, 0.15, 0.00, 0.10: mean 0.08, sample variance 0.0032 (sum of squares
    # 0.0004 + 0.0009 + 0.0049 + 0.0064 + 0.0004 = 0.013, over 4 = 0.00325), t(0.975, 4) = 2.776
    variant = {0: 0.60, 1: 0.55, 2: 0.70, 3: 0.50, 4: 0.65}
    baseline = {0: 0.50, 1: 0.50, 2: 0.55, 3: 0.50, 4: 0.55}
    d = R.paired_seed_difference(variant, baseline)
    assert d["n"] == 5 and d["seeds"] == [0, 1, 2, 3, 4] and d["df"] == 4
    assert d["differences"] == pytest.approx([0.10, 0.05, 0.15, 0.00, 0.10])
    assert d["mean"] == pytest.approx(0.08) and d["sd"] == pytest.approx(math.sqrt(0.00325))
    half = 2.7764451 * math.sqrt(0.00325) / math.sqrt(5)
    assert d["se"] == pytest.approx(math.sqrt(0.00325 / 5))
    assert (d["low"], d["high"]) == pytest.approx((0.08 - half, 0.08 + half), abs=1e-6)
    assert d["low"] == pytest.approx(0.00922, abs=1e-5) and d["unpaired"] == []
    # 90%: t(0.95, 4) = 2.132
    d90 = R.paired_seed_difference(variant, baseline, level=0.9)
    assert d90["high"] - d90["mean"] == pytest.approx(2.1318468 * math.sqrt(0.00325 / 5), abs=1e-6)


def test_paired_seed_difference_pairs_by_seed_and_drops_the_rest():
    d = R.paired_seed_difference({3: 0.7, 1: 0.6, 5: None, 7: 0.9}, {1: 0.5, 3: 0.4, 5: 0.3, 9: 0.2})
    assert d["seeds"] == [1, 3] and d["differences"] == pytest.approx([0.1, 0.3])
    assert sorted(d["unpaired"]) == [5, 7, 9]
    assert d["t"] == pytest.approx(12.706, abs=5e-4)  # df = 1
    seq = R.paired_seed_difference([0.7, 0.8, float("nan")], [0.5, 0.5, 0.5])  # sequences: the index is the seed
    assert seq["seeds"] == [0, 1] and seq["unpaired"] == [2]
    one = R.paired_seed_difference({0: 0.7}, {0: 0.5})
    assert one["n"] == 1 and one["mean"] == pytest.approx(0.2) and math.isnan(one["low"]) and math.isnan(one["sd"])
    none = R.paired_seed_difference({}, {0: 0.5})
    assert none["n"] == 0 and math.isnan(none["mean"])


def test_format_paired_difference():
    d = R.paired_seed_difference({0: 0.60, 1: 0.55, 2: 0.70, 3: 0.50, 4: 0.65}, {0: 0.5, 1: 0.5, 2: 0.55, 3: 0.5, 4: 0.55})
    assert R.format_paired_difference(d) == f"+0.080 [+{d['low']:.3f}, +{d['high']:.3f}] (5 seeds)"
    assert R.format_paired_difference(d) == "+0.080 [+0.009, +0.151] (5 seeds)"  # 0.08 -+ 2.776 x 0.0255
    assert R.format_paired_difference(R.paired_seed_difference({}, {})) == "—"
    assert R.format_paired_difference(R.paired_seed_difference([0.3], [0.5]), digits=2) == "-0.20 (1 seed, no interval)"


# ------------------------------------------------------------------------------------------------ the verdict


def test_verdict_shown_only_when_the_interval_excludes_zero_and_every_goal_holds():
    d = R.paired_seed_difference({s: 0.8 + 0.01 * s for s in range(5)}, {s: 0.45 + 0.01 * (s % 2) for s in range(5)})
    assert d["low"] > 0.3
    goals = [("non-conflict", 0.99, ">=", 0.98), ("clean format", 0.95, ">=", 0.9)]
    v = R.verdict(d, min_effect=0.30, goals=goals)
    assert v == {"shown": True, "verdict": "shown", "reasons": [], "text": "shown"}


def test_verdict_mean_meeting_the_goal_with_an_interval_including_zero_is_not_shown():
    # the old report's "met": TPRL's mean +0.117 >= +0.10, but over 3 seeds the interval spans 0
    d = R.paired_seed_difference({0: 0.50, 1: 0.72, 2: 0.45}, {0: 0.43, 1: 0.43, 2: 0.46})
    assert d["mean"] == pytest.approx(0.1166667) and d["low"] < 0 < d["high"]
    v = R.verdict(d, min_effect=0.10)
    assert not v["shown"] and v["verdict"] == "not shown"
    assert v["reasons"] == [f"interval [{d['low']:.3f}, {d['high']:.3f}] includes 0"]
    assert v["text"] == f"not shown: interval [{d['low']:.3f}, {d['high']:.3f}] includes 0"


def test_verdict_side_goals_min_effect_and_direction():
    d = {"n": 5, "mean": 0.12, "low": 0.05, "high": 0.19}
    v = R.verdict(d, min_effect=0.30, goals=[("non-conflict", 0.95, ">=", 0.98), ("clean", None, ">=", 0.9),
                                             ("collapse rate", 0.1, "<", 0.05)])
    assert v["reasons"] == ["mean difference +0.120 < +0.3", "non-conflict 0.950 < 0.98", "clean not measured",
                            "collapse rate 0.100 >= 0.05"]
    assert R.verdict(d, goals=[("non-conflict", 0.98, ">=", 0.98)])["shown"]  # the threshold itself meets >=
    worse = {"n": 5, "mean": -0.1, "low": -0.15, "high": -0.05}
    assert R.verdict(worse)["reasons"] == ["interval [-0.150, -0.050] lies below 0: the variant is worse"]
    # direction "lower": a value the variant should reduce (e.g. the rate of prior-following answers)
    assert R.verdict(worse, direction="lower", min_effect=0.05)["text"] == "shown"
    assert R.verdict(d, direction="lower")["reasons"] == ["interval [0.050, 0.190] lies above 0: the variant is worse"]
    touching = R.verdict({"n": 5, "mean": 0.0, "low": 0.0, "high": 0.1})  # an end at 0 does not exclude it
    assert touching["reasons"] == ["interval [0.000, 0.100] includes 0"]
    assert R.verdict({"n": 1, "mean": 0.4, "low": float("nan"), "high": float("nan")})["reasons"] == [
        "1 paired seed: no interval (needs 2 or more)"]
    assert R.verdict(R.paired_seed_difference({}, {}))["reasons"] == ["no paired seeds"]
    with pytest.raises(ValueError, match="direction must be 'higher' or 'lower'"):
        R.verdict(d, direction="up")
    with pytest.raises(ValueError, match="goal 'x': op must be one of"):
        R.verdict(d, goals=[("x", 1.0, "=>", 0.5)])


# ---------------------------------------------------------------------- the replication's tests (issue 35)


def brute_force_sign_flip(d):
    import itertools

    observed = abs(sum(d))
    hits = sum(abs(sum(s * x for s, x in zip(signs, d))) >= observed - 1e-12
               for signs in itertools.product((-1, 1), repeat=len(d)))
    return hits / 2 ** len(d)


def test_sign_flip_is_exact():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 9, 12):
        for shift in (0.0, 0.5, 2.0):
            d = list(rng.normal(shift, 1.0, n))
            assert R.sign_flip_p(d) == pytest.approx(brute_force_sign_flip(d), abs=1e-12), (n, shift)
    # With 5 pairs all of one sign, the smallest p there is: 2 / 2^5.
    assert R.sign_flip_p([0.1, 0.2, 0.3, 0.4, 0.5]) == 0.0625
    assert R.sign_flip_p([0.1] * 16) == pytest.approx(2 / 2 ** 16)
    assert math.isnan(R.sign_flip_p([]))
    with pytest.raises(ValueError, match="finite"):
        R.sign_flip_p([0.1, float("nan")])
    with pytest.raises(ValueError, match="at most"):
        R.sign_flip_p([0.1] * (R.SIGN_FLIP_MAX_PAIRS + 1))


@pytest.mark.parametrize("decimals", [3, 1])  # 1 decimal: many assignments tie with the observed sum
def test_sign_flip_agrees_with_scipys_exact_permutation_test(decimals):
    rng = np.random.default_rng(4)
    for n in range(2, 14):  # scipy needs 2 or more
        d = np.round(rng.normal(0.1, 0.3, n), decimals)
        exact = scipy_stats.permutation_test((d,), lambda x, axis: x.mean(axis=axis), permutation_type="samples",
                                             n_resamples=np.inf, vectorized=True)
        assert R.sign_flip_p(d) == pytest.approx(exact.pvalue, abs=1e-12), (n, d)


def seeds(values, base=0.4):
    return {s: base + v for s, v in enumerate(values)}, {s: base for s in range(len(values))}


def test_holm_orders_by_p_and_stops_at_the_first_non_rejection():
    strong = seeds([0.30, 0.25, 0.35, 0.28, 0.32, 0.27, 0.31, 0.29])  # p = 2/256
    weak = seeds([0.30, -0.20, 0.25, 0.10, -0.05, 0.20, 0.15, -0.10])
    null = seeds([0.0] * 8)
    r = R.holm_family({"weak": weak, "strong": strong})
    assert r["strong"]["rank"] == 0 and r["strong"]["alpha"] == 0.025 and r["strong"]["shown"]
    assert r["weak"]["rank"] == 1 and r["weak"]["alpha"] == 0.05 and r["weak"]["reached"]
    assert not r["weak"]["rejected"]
    assert r["strong"]["difference"]["level"] == pytest.approx(0.975)
    # Step-down: when the first (smallest p) is not rejected, the next is not even tested, however strong alone.
    r = R.holm_family({"null": null, "a": seeds([0.3, 0.25, 0.2, 0.3, 0.1]), "b": seeds([0.3, 0.25, 0.2, 0.3, 0.1])})
    assert not any(x["rejected"] for x in r.values())  # 5 pairs: p >= 0.0625 > 0.05 / 3
    assert [x["reached"] for x in sorted(r.values(), key=lambda x: x["rank"])] == [True, False, False]
    assert "not tested" in min(r.values(), key=lambda x: -x["rank"])["text"]


def test_holm_needs_the_t_interval_and_the_sign_flip_to_agree():
    # 6 positive pairs and one large negative: the t interval includes 0 though the sign-flip p is small, and vice
    # versa for a tight mean with one sign exception.
    mixed = seeds([0.02, 0.03, 0.02, 0.03, 0.02, 0.03, 0.02, 0.03, -0.01, 0.02])
    one = R.holm_family({"x": mixed})["x"]
    d = one["difference"]
    t_excludes = d["low"] > 0
    assert t_excludes and one["p"] <= 0.05 and one["shown"]
    wild = seeds([0.9, 0.01, 0.01, 0.01, 0.01, 0.01])  # all positive: sign-flip p = 2/64, t interval includes 0
    w = R.holm_family({"x": wild})["x"]
    assert w["p"] == pytest.approx(2 / 64) and w["difference"]["low"] < 0 and not w["rejected"]
    worse = seeds([-0.3, -0.25, -0.35, -0.28, -0.32, -0.27, -0.31, -0.29])
    b = R.holm_family({"x": worse})["x"]
    assert b["rejected"] and not b["shown"]  # rejected on the wrong side: a harm, not "shown"


def primary(shown=True, low=0.1, high=0.5, mean=0.3):
    return {"shown": shown, "difference": {"mean": mean, "low": low, "high": high}, "text": "(test)"}


OK = {"mean": 0.0, "low": -0.02, "high": 0.02}
ABOVE = {"mean": 0.2, "low": 0.05, "high": 0.35}


@pytest.mark.parametrize("case, want, rule", [
    (dict(primary=primary(), neither={"mean": 0.02}, placebo=ABOVE), "shown", 4),
    (dict(primary=primary(), neither={"mean": 0.10}, placebo=ABOVE), "refuted: hacking", 1),  # at the line
    (dict(primary=primary(), neither={"mean": 0.099}, placebo=ABOVE), "shown", 4),
    (dict(primary=primary(), neither={"mean": 0.0}, placebo={"mean": 0.05, "low": -0.01, "high": 0.11}),
     "refuted: not from the image", 2),
    (dict(primary=primary(shown=False, low=-0.1), neither={"mean": 0.0}, placebo={"mean": 0, "low": -0.1, "high": 0.1}),
     "inconclusive", 5),  # rule 2 needs the primary shown
    (dict(primary=primary(shown=False, low=-0.2, high=0.149, mean=-0.02), neither={"mean": 0.0}, placebo=ABOVE),
     "refuted: too small", 3),
    (dict(primary=primary(low=0.01, high=0.14, mean=0.07), neither={"mean": 0.0}, placebo=ABOVE),
     "refuted: too small", 3),  # shown but small: refutation comes first
    (dict(primary=primary(), neither={"mean": 0.0}, placebo=ABOVE, ni={"mean": -0.02, "low": -0.031, "high": 0.0}),
     "inconclusive", 5),  # a non-inferiority margin fails
    (dict(primary=primary(), neither={"mean": 0.0}, placebo=None), "shown", 4),  # no placebo arm (B)
    (dict(primary=primary(), neither={"mean": float("nan")}, placebo=ABOVE), "shown", 4),  # unmeasured: no rule 1
])
def test_the_pre_registered_rules_in_their_order(case, want, rule):
    ni = case.pop("ni", OK)
    v = R.replication_verdict(case["primary"], neither=case["neither"],
                              noninferiority=[("non-conflict accuracy", OK), ("clean format", ni)],
                              placebo=case["placebo"])
    assert (v["verdict"], v["rule"]) == (want, rule)
    assert v["text"].startswith(want)


# ------------------------------------------------------------------------------------ TPRL's two-sided rules (issue 44)


def comparison(low, high, rejected=None, mean=None):
    """A holm_family entry: rejected means the interval at its level excludes 0 and the sign-flip agreed."""
    rejected = (low > 0 or high < 0) if rejected is None else rejected
    return {"rejected": rejected, "shown": rejected and low > 0, "text": "(test)",
            "difference": {"mean": (low + high) / 2 if mean is None else mean, "low": low, "high": high}}


BELOW = {"mean": -0.1, "low": -0.2, "high": -0.01}


@pytest.mark.parametrize("case, want, rule", [
    (dict(primary=comparison(0.1, 0.5), placebo=ABOVE), "shown: helps", 4),
    (dict(primary=comparison(0.1, 0.5), placebo=None), "shown: helps", 4),  # M: no placebo arm
    (dict(primary=comparison(0.1, 0.5), neither={"mean": 0.10}, placebo=ABOVE), "refuted: hacking", 1),  # at the line
    (dict(primary=comparison(-0.5, -0.1), neither={"mean": 0.12}), "refuted: hacking", 1),  # hacking first, even a harm
    (dict(primary=comparison(-0.5, -0.1)), "shown: harms", 2),
    (dict(primary=comparison(-0.5, -0.1), placebo=ABOVE), "shown: harms", 2),
    (dict(primary=comparison(0.1, 0.5), placebo={"mean": 0.05, "low": -0.01, "high": 0.11}),
     "refuted: not from the image", 3),
    (dict(primary=comparison(0.1, 0.5), placebo=BELOW), "refuted: not from the image", 3),
    (dict(primary=comparison(0.1, 0.5), placebo=ABOVE, ni={"mean": -0.02, "low": -0.031, "high": 0.0}),
     "inconclusive", 6),  # helps, but a margin fails
    (dict(primary=comparison(-0.14, 0.14)), "refuted: too small", 5),  # neither a help nor a harm of 0.15 fits
    (dict(primary=comparison(0.01, 0.12), placebo=ABOVE), "shown: helps", 4),  # small but shown: the label says shown
    (dict(primary=comparison(-0.2, 0.14)), "inconclusive", 6),  # a harm of 0.2 still fits
    (dict(primary=comparison(0.05, 0.3, rejected=False)), "inconclusive", 6),  # t excludes 0, the sign-flip disagreed
    (dict(primary=comparison(-0.3, -0.05, rejected=False)), "inconclusive", 6),
    (dict(primary=comparison(0.1, 0.5), neither={"mean": float("nan")}, placebo=ABOVE), "shown: helps", 4),
])
def test_tprl_rules_in_their_order(case, want, rule):
    ni = case.pop("ni", OK)
    v = R.tprl_verdict(case["primary"], neither=case.get("neither", {"mean": 0.0}),
                       noninferiority=[("non-conflict accuracy", OK), ("clean format", ni)],
                       placebo=case.get("placebo"))
    assert (v["verdict"], v["rule"]) == (want, rule)
    assert v["text"].startswith(want) and want in R.TPRL_VERDICTS


def test_tprl_verdict_from_holm_family_on_seeds():
    """End to end on hand-made seeds: a harm is labelled a harm, a help a help, noise neither."""
    base = {s: 0.5 for s in range(16)}
    up = {s: 0.5 + 0.2 + 0.02 * (s % 3) for s in range(16)}
    down = {s: 0.5 - 0.2 - 0.02 * (s % 3) for s in range(16)}
    noise = {s: 0.5 + (0.01 if s % 2 else -0.01) for s in range(16)}
    fam = R.holm_family({"up": (up, base), "down": (down, base), "noise": (noise, base)})
    same = R.paired_seed_difference(base, base)
    labels = {k: R.tprl_verdict(fam[k], neither={"mean": 0.0}, noninferiority=[("x", {"low": 0.0})])["verdict"]
              for k in fam}
    assert labels == {"up": "shown: helps", "down": "shown: harms", "noise": "refuted: too small"}
    assert same["n"] == 16


def test_paired_power_grows_with_seeds_and_effect_and_holds_its_level_under_the_null():
    p5 = R.paired_power(0.26, 5, 0.27, 0.05, sims=400)
    p16 = R.paired_power(0.26, 16, 0.27, 0.05, sims=400)
    assert p5 == 0.0  # 5 pairs: the exact sign-flip p cannot go below 2/32 = 0.0625 > 0.05
    assert p16 > 0.9
    assert R.paired_power(0.26, 16, 0.10, 0.05 / 3, sims=400) < R.paired_power(0.26, 16, 0.20, 0.05 / 3, sims=400)
    assert R.paired_power(0.26, 16, 0.0, 0.05, sims=1000) <= 0.08  # about alpha under the null
    with pytest.raises(ValueError, match="n must be"):
        R.paired_power(0.2, 1, 0.1, 0.05)
