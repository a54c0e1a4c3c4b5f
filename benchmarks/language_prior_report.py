"""benchmarks/language_prior.py's report: the RESULTS.md section and the plot, from the runs' JSON records."""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import shlex
import statistics
import time
from pathlib import Path

import torch
import transformers

from benchmarks.language_prior_eval import KIND_SIGNALS, SIGNALS
from benchmarks.results import describe_version, result_args
from benchmarks.stats import format_paired_difference, paired_seed_difference
from benchmarks.stats import verdict as paired_verdict
from trl_mdi.config import MDIGRPOConfig

SECTION = "## Language prior"
CHANCE = 0.25
HEAD, TAIL = 10, 20  # steps averaged for rollout metrics "before" (first) and "after" (last)
REWARD_NAMES = ("mc_idx", "think_format", "mdi_balance", "mdi_group", "answer_visual_gain")
OUTPUT_ONLY_FLAGS = ("--work_dir", "--png", "--results")
BASELINE = "answer_format"
BUDGET_MINUTES = 60  # issue 25: the whole benchmark on 2 cores
# Issue 25's goals.
GOAL_AUROC = {"answer_visual_gain": 0.95, "blind_agrees": 0.90}  # with the default counterfactual
GOAL_CONFLICT_GAIN, GOAL_PLAIN, GOAL_CLEAN = 0.10, 0.98, 0.90
SIGNAL_LABELS = {"mdi": "MDI all", "mdi_late": "MDI late", "answer_image_attention": "answer_image_attention",
                 "visual_gain": "visual_gain", "answer_visual_gain": "answer_visual_gain",
                 "blind_agrees": "blind_agrees"}
LIVE = (("reliance/blind_agree_rate", "blind_agree_rate", ".2f"), ("reliance/answer_visual_gain", "answer_visual_gain",
                                                                    "+.2f"),
        ("reliance/visual_gain", "visual_gain", "+.3f"), ("reliance/answer_rate", "answer_rate", ".2f"),
        ("completions/mean_length", "completion length", ".1f"), ("entropy", "entropy", ".2f"))


def _finite(xs) -> list[float]:
    return [x for x in xs if x is not None and isinstance(x, (int, float)) and math.isfinite(x)]


def _mean(xs) -> float:
    xs = _finite(xs)
    return statistics.fmean(xs) if xs else math.nan


def _f(x, fmt: str = ".3f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def spread(xs, fmt: str = ".3f") -> str:
    """``mean ± sd [min–max]`` over seeds (sd: sample standard deviation; one value: just the value)."""
    xs = _finite(xs)
    if not xs:
        return "—"
    if len(xs) == 1:
        return format(xs[0], fmt)
    return (f"{format(statistics.fmean(xs), fmt)} ± {format(statistics.stdev(xs), fmt.lstrip('+'))} "
            f"[{format(min(xs), fmt)}–{format(max(xs), fmt)}]")


def step_mean(run: dict, key: str, head: bool) -> float:
    """Mean of a logged metric over the first HEAD or the last TAIL GRPO steps of a run."""
    rows = run["steps"][:HEAD] if head else run["steps"][-TAIL:]
    return _mean(r.get(key) for r in rows)


def zero_spread(run: dict, reward: str) -> float:
    """Mean over all steps of ``rewards/<reward>/zero_spread_frac`` (NaN when the run lacks that reward)."""
    return _mean(r.get(f"rewards/{reward}/zero_spread_frac") for r in run["steps"])


def by_variant(runs: list[dict], variants: dict) -> dict[str, list[dict]]:
    out = {name: sorted([r for r in runs if r["variant"] == name], key=lambda r: r["seed"]) for name in variants}
    return {k: v for k, v in out.items() if v}


def final(run: dict) -> dict:
    return run["evals"][-1]


def paired(groups: dict[str, list[dict]], name: str, key: str) -> list[float]:
    """Per seed, the run's final held-out ``key`` minus the baseline's (answer + format only) on the same seed."""
    base = {r["seed"]: final(r)[key] for r in groups.get(BASELINE, [])}
    return [final(r)[key] - base[r["seed"]] for r in groups.get(name, []) if r["seed"] in base]


def paired_difference(groups: dict[str, list[dict]], name: str, key: str) -> dict:
    """``benchmarks.stats.paired_seed_difference`` of a variant's final held-out ``key`` against the baseline's,
    seed by seed: the mean difference with its 95% t interval over the paired seeds."""
    return paired_seed_difference({r["seed"]: final(r)[key] for r in groups.get(name, [])},
                                  {r["seed"]: final(r)[key] for r in groups.get(BASELINE, [])})


def training_goal(groups: dict[str, list[dict]], name: str) -> tuple[bool, str] | None:
    """Issue 25's training goal for a variant, as ``benchmarks.stats.verdict`` reads it: "shown" only when the
    paired conflict-accuracy difference to the baseline has its 95% interval above 0 and its mean >= +0.10, and the
    variant's non-conflict accuracy >= 0.98 and clean format >= 0.9 (means over its seeds); otherwise "not shown"
    with every failed condition (a mean that reaches +0.10 with an interval that includes 0 is not shown: over 3 to
    5 seeds it is as likely seed noise). None for the baseline or without paired seeds."""
    d = paired_difference(groups, name, "conflict")
    if name == BASELINE or not d["n"]:
        return None
    plain = _mean(final(r)["plain"] for r in groups[name])
    clean = _mean(final(r)["clean"] for r in groups[name])
    v = paired_verdict(d, min_effect=GOAL_CONFLICT_GAIN, goals=[("non-conflict", plain, ">=", GOAL_PLAIN),
                                                                ("clean", clean, ">=", GOAL_CLEAN)])
    return v["shown"], v["text"]


def warmup_lines(warm: dict) -> list[str]:
    w, b = warm["eval"], warm["eval_blank"]
    return [
        "| warm-up model | conflict acc. | non-conflict acc. | clean format | conflict rows answered with the prior | "
        "blank images: non-conflict acc. | blank images: conflict acc. | MDI all (conflict / non-conflict rows) | "
        "MDI late |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| after {warm['sft_steps']} SFT steps | {w['conflict']:.3f} | {w['plain']:.3f} | {_f(w.get('clean'))} | "
        f"{w['prior_follow']:.3f} | {b['plain']:.3f} | {b['conflict']:.3f} | {w['mdi_all']:.3f} "
        f"({_f(w['mdi_all_conflict'])} / {_f(w['mdi_all_plain'])}) | {w['mdi_late']:.3f} |",
    ]


def accuracy_table(groups: dict[str, list[dict]], variants: dict) -> list[str]:
    """Issue 25's training numbers: conflict, non-conflict and clean-format rates at the end, each with its paired
    difference from the baseline (mean [95% t interval] over the paired seeds), and the verdict."""
    lines = [
        "| variant | seeds | conflict acc. | Δ conflict vs baseline (paired) | non-conflict acc. | Δ non-conflict "
        "(paired) | clean format | Δ clean (paired) | verdict: Δ conflict ≥ +0.10 with its interval above 0, "
        "non-conflict ≥ 0.98, clean ≥ 0.9 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, rs in groups.items():
        fin = [final(r) for r in rs]
        cells = []
        for key in ("conflict", "plain", "clean"):
            d = paired_difference(groups, name, key)
            cells += [spread([e[key] for e in fin]), "—" if name == BASELINE else format_paired_difference(d)]
        goal = training_goal(groups, name)
        lines.append(f"| {variants[name].label} | {','.join(str(r['seed']) for r in rs)} | " + " | ".join(cells)
                     + f" | {'(baseline)' if name == BASELINE else '—' if goal is None else goal[1]} |")
    return lines


def variant_table(groups: dict[str, list[dict]], variants: dict) -> list[str]:
    lines = [
        "| variant | conflict rows answered with the prior (end) | blank non-conflict acc. (end) | held-out MDI all: "
        "start → end | held-out MDI late: start → end | rollout MDI all: first 10 → last 20 steps | rollout MDI "
        "late | s / step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rs in groups.items():
        fin = [final(r) for r in rs]
        start = rs[0]["evals"][0]
        lines.append(
            f"| {variants[name].label} | {spread([e['prior_follow'] for e in fin])} | "
            f"{spread([r['blank_final']['plain'] for r in rs])} | "
            f"{_f(start['mdi_all'])} → {spread([e['mdi_all'] for e in fin])} | "
            f"{_f(start['mdi_late'])} → {spread([e['mdi_late'] for e in fin])} | "
            f"{_f(_mean(step_mean(r, 'attention/mdi', True) for r in rs))} → "
            f"{_f(_mean(step_mean(r, 'attention/mdi', False) for r in rs))} | "
            f"{_f(_mean(step_mean(r, 'attention/mdi_late', True) for r in rs))} → "
            f"{_f(_mean(step_mean(r, 'attention/mdi_late', False) for r in rs))} | "
            f"{spread([r['grpo_seconds'] / max(1, final(r)['step']) for r in rs], '.2f')} |"
        )
    return lines


def live_table(groups: dict[str, list[dict]], variants: dict) -> list[str]:
    """The trainer's live reliance/* metrics (and the completion length and entropy, where a policy gaming a
    counterfactual gap shows first), first 10 -> last 20 steps, mean over seeds."""
    lines = ["| variant | " + " | ".join(label for _, label, _ in LIVE) + " |", "|---|" + "---:|" * len(LIVE)]
    for name, rs in groups.items():
        cells = [f"{_f(_mean(step_mean(r, key, True) for r in rs), fmt)} → "
                 f"{_f(_mean(step_mean(r, key, False) for r in rs), fmt)}" for key, _, fmt in LIVE]
        lines.append(f"| {variants[name].label} | " + " | ".join(cells) + " |")
    return lines


def spread_table(groups: dict[str, list[dict]], variants: dict) -> list[str]:
    own = ("mdi_balance", "answer_visual_gain")
    lines = ["| variant | " + " | ".join(f"{n} zero-spread (all steps)" for n in REWARD_NAMES)
             + " | " + " | ".join(f"{n} reward: first 10 → last 20 steps" for n in own) + " | tprl/signal_rank_corr |",
             "|---|" + "---:|" * (len(REWARD_NAMES) + len(own) + 1)]
    for name, rs in groups.items():
        cells = [spread([zero_spread(r, n) for r in rs], ".2f") if n in variants[name].rewards else "—"
                 for n in REWARD_NAMES]
        for n in own:
            key = f"rewards/{n}/mean"
            cells.append("—" if n not in variants[name].rewards else
                         f"{_f(_mean(step_mean(r, key, True) for r in rs), '.2f')} → "
                         f"{_f(_mean(step_mean(r, key, False) for r in rs), '.2f')}")
        corr = _mean(x.get("tprl/signal_rank_corr") for r in rs for x in r["steps"])
        lines.append(f"| {variants[name].label} | " + " | ".join(cells) + f" | {_f(corr, '.2f')} |")
    return lines


def curve_lines(groups: dict[str, list[dict]], variants: dict) -> list[str]:
    out = []
    for name, rs in groups.items():
        steps = sorted({e["step"] for r in rs for e in r["evals"]})
        cells = []
        for st in steps:
            vals = [e["conflict"] for r in rs for e in r["evals"] if e["step"] == st]
            cells.append(f"{st}: {_mean(vals):.3f}")
        per_seed = ", ".join(f"seed {r['seed']} {final(r)['conflict']:.3f}" for r in rs)
        out.append(f"- {variants[name].label}: {', '.join(cells)} (final per seed: {per_seed})")
    return out


# ------------------------------------------------------------------------------------------------- reliance


def _auc(row: dict | None) -> str:
    if not row or row.get("auroc") is None:
        return "—"
    return f"{row['auroc']:.3f} [{_f(row.get('low'))}, {_f(row.get('high'))}]"


def _within(row: dict | None) -> str:
    """The within-prompt AUROC with its prompt-bootstrap interval (rows measured before it existed: "—")."""
    if not row or row.get("within_auroc") is None:
        return "—"
    return f"{row['within_auroc']:.3f} [{_f(row.get('within_low'))}, {_f(row.get('within_high'))}]"


def _n(row: dict) -> str:
    """``n (prior-following)``, with ``of n_defined`` where the common set left some of the signal's rollouts out."""
    text = f"{row['n']} ({row['n_prior']})"
    return text + (f" of {row['n_defined']}" if row.get("n_defined", row["n"]) != row["n"] else "")


EXTRA_SIGNALS = ("visual_gain_sum", "visual_gain_max", "answer_logprob")
"""Signals of the table the report shows with the runs' counterfactual only (the warm-up's full table)."""


def _agreement(a: dict | None) -> str:
    if not a or not a.get("n"):
        return "—"
    return f"{_f(a['agreement'])} (κ {_f(a['kappa'], '.2f')}, n {a['n']})"


PICK_SIGNAL = "answer_visual_gain"
"""The signal whose within-prompt AUROC ranks the counterfactual kinds on the development split: the one a reward
reads (``answer_visual_gain``), within prompts since GRPO's group-relative advantage compares rollouts of one
prompt only."""
PICK_RULE = (f"the highest within-prompt AUROC of {PICK_SIGNAL} on the development split, at the 3 decimals shown; "
             "ties go to the trainer's default kind, then to the higher pooled AUROC, then to the earlier kind in "
             "the table; a kind without a within-prompt AUROC is never picked")


def pick_kind(dev: dict | None, default: str) -> tuple[str | None, list[tuple[str, float, float]]]:
    """The counterfactual kind the development split picks by ``PICK_RULE``, and every kind's
    ``(kind, within-prompt AUROC, pooled AUROC)`` of ``PICK_SIGNAL`` in rank order (NaN where undefined). ``None``
    (and an empty ranking) without a development measurement, None also when no kind has a within-prompt AUROC.

    >>> dev = {"kinds": {"grey": {"table": {"answer_visual_gain": {"within_auroc": 0.9104, "auroc": 0.95}}},
    ...                  "black": {"table": {"answer_visual_gain": {"within_auroc": 0.9096, "auroc": 0.90}}},
    ...                  "none": {"table": {}}}}
    >>> pick_kind(dev, "black")[0]  # 0.910 and 0.910 at 3 decimals: the default wins the tie
    'black'
    >>> pick_kind(dev, "none")[0]
    'grey'
    """
    if not dev or not dev.get("kinds"):
        return None, []

    def value(kind: str, key: str) -> float:
        x = ((dev["kinds"][kind].get("table") or {}).get(PICK_SIGNAL) or {}).get(key)
        return math.nan if x is None else float(x)

    order = list(dev["kinds"])
    rows = [(kind, value(kind, "within_auroc"), value(kind, "auroc")) for kind in order]

    def key(row):
        kind, within, pooled = row
        return (not math.isnan(within), round(within, 3) if not math.isnan(within) else -1.0, kind == default,
                round(pooled, 3) if not math.isnan(pooled) else -1.0, -order.index(kind))

    ranked = sorted(rows, key=key, reverse=True)
    return (ranked[0][0] if not math.isnan(ranked[0][1]) else None), ranked


def warm_reliance_lines(rel: dict | None, s, *, pick: str | None = None, dev: bool = False) -> list[str]:
    """The warm-up model's AUROC tables on one split: the kind-independent signals once, then one row per
    counterfactual kind (the runs' kind and the development split's ``pick`` marked), then, on the test rows, every
    counterfactual signal in full for the pick and for the runs' kind. ``dev``: the development split's
    measurement, where the kind is chosen (its per-kind table only; the signals are reported on the test rows)."""
    split = "development split" if dev else "test rows"
    if not rel:
        return [f"No reliance measurement of the warm-up model on the {split} in this invocation.", ""]
    lab = rel.get("labelled") or {}
    kinds = rel["kinds"]
    first = next(iter(kinds.values()), {"table": {}})
    if dev:
        lines = [
            f"{rel['prompts']} conflict prompts of the development split x {rel['samples']} sampled completions = "
            f"{rel['rollouts']} rollouts, {lab.get('rollouts', 0)} labelled by the data "
            f"({lab.get('prior_following', 0)} prior-following); measured in {rel['seconds']:.0f} s, scored as on "
            "the test rows below.",
        ]
    else:
        lines = [
            f"{rel['prompts']} held-out conflict prompts x {rel['samples']} completions sampled at temperature 1 (up to "
            f"{s.max_completion_length} tokens, as GRPO samples) = {rel['rollouts']} rollouts, "
            f"{lab.get('rollouts', 0)} labelled by the data ({lab.get('prior_following', 0)} prior-following: they answer "
            "the object's usual colour; the others answer the drawn colour; other answers and no answer are left out); "
            f"measured in {rel['seconds']:.0f} s. Every signal is scored on one common set of rollouts, those on which "
            "every signal of the table is defined (the answer-span signals need a strict answer line; n: the common set "
            "(of it prior-following), 'of N': the rollouts on which that signal alone was defined and labelled). AUROC: "
            "how well the signal ranks prior-following above image-following rollouts (1 perfect, 0.5 blind, < 0.5 the "
            "other way), pooled over prompts; within-prompt AUROC: the same over pairs of rollouts of one prompt only "
            "(what GRPO's group-relative advantage can see; pairs, prompts with a pair); both with a 95% interval from a "
            f"bootstrap over prompts ({rel.get('n_boot', s.n_boot)} resamples drawing the prompts with replacement, "
            "every rollout of a drawn prompt coming along: the rollouts of a prompt are not independent). Within-group share: the part of the "
            "signal's variance between rollouts of one prompt. Signals that do not depend on the counterfactual:",
            "",
            "| signal | prior-following when | n (prior-following) | AUROC [95% CI] | within-prompt AUROC [95% CI] | "
            "within-group variance share | mean, prior-following | mean, image-following |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
    for name in () if dev else SIGNALS:  # the kind-independent signals: reported on the test rows
        r = first["table"].get(name)
        if name in KIND_SIGNALS or r is None:
            continue
        lines.append(f"| {SIGNAL_LABELS[name]} | {r['direction']} | {_n(r)} | {_auc(r)} | {_within(r)} | "
                     f"{_f(r['within_group_share'])} | {_f(r['mean_prior'])} | {_f(r['mean_other'])} |")
    lines += [
        "",
        f"Per counterfactual kind, {split} (blind acc.: the greedy answer with the counterfactual image against the gold one; "
        "same answer: the share of prompts whose greedy answer the blind one repeats; rule vs data: how often the "
        "general rule, prior-following = the blind answer and not the gold one, agrees with the data's label, with "
        "Cohen's κ; means: prior-following / image-following rollouts):",
        "",
        "| counterfactual | blind acc. | same answer | rule vs data label | visual_gain AUROC | answer_visual_gain "
        "AUROC | blind_agrees AUROC | within-prompt AUROC (vg / avg / ba) | within-group share (vg / avg / ba) | "
        "visual_gain means | answer_visual_gain means | blind_agrees means |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, k in kinds.items():
        t = k["table"]
        shares = " / ".join(_f((t.get(n) or {}).get("within_group_share"), ".2f") for n in KIND_SIGNALS)
        fmt = {n: ".3f" if n == "blind_agrees" else "+.3f" for n in KIND_SIGNALS}
        means = [f"{_f((t.get(n) or {}).get('mean_prior'), fmt[n])} / {_f((t.get(n) or {}).get('mean_other'), fmt[n])}"
                 for n in KIND_SIGNALS]
        marks = [m for m, on in (("the runs'", kind == s.counterfactual), ("the dev pick", kind == pick)) if on]
        mark = f" ({', '.join(marks)})" if marks else ""
        within = " / ".join(_f((t.get(n) or {}).get("within_auroc")) for n in KIND_SIGNALS)
        lines.append(f"| `{kind}`{mark} | {_f(k['accuracy_counterfactual'])} | {_f(k['same_answer_rate'])} | "
                     f"{_agreement(k['agreement'])} | " + " | ".join(_auc(t.get(n)) for n in KIND_SIGNALS)
                     + f" | {within} | {shares} | " + " | ".join(means) + " |")
    if rel.get("unusable"):
        lines += ["", "Left out (the processor cannot encode them): "
                  + "; ".join(f"`{k}`: {e}" for k, e in rel["unusable"].items())]
    for kind in [] if dev else dict.fromkeys(k for k in (pick, s.counterfactual) if k in kinds):
        t = kinds[kind]["table"]
        names = [n for n in (*KIND_SIGNALS, *EXTRA_SIGNALS) if n in t]
        who = " and ".join(w for w, on in (("the development split's pick", kind == pick),
                                            ("the runs' counterfactual", kind == s.counterfactual)) if on)
        lines += [
            "",
            f"The counterfactual signals with `{kind}` ({who}) in full, test rows, on the same "
            "common set (the MDI rows above are on it too; visual_gain_sum: the completion's summed gain; "
            "visual_gain_max: its largest per-token gain; answer_logprob: the answer's log-probability with the image, a confidence baseline a reliance signal "
            "must beat):",
            "",
            f"| signal (`{kind}`) | prior-following when | n (prior-following) | AUROC [95% CI] | "
            "within-prompt AUROC [95% CI] | within-prompt pairs, prompts | within-group variance share | mean, "
            "prior-following | mean, image-following |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
            *(f"| {SIGNAL_LABELS.get(n, n)} | {t[n]['direction']} | {_n(t[n])} | {_auc(t[n])} | {_within(t[n])} | "
              f"{t[n].get('within_pairs', '—')}, {t[n].get('within_prompts', '—')} | "
              f"{_f(t[n]['within_group_share'])} | {_f(t[n]['mean_prior'])} | {_f(t[n]['mean_other'])} |"
              for n in names),
        ]
    return lines + [""]


FIXED_EARLIER = (
    "Fixed in earlier issues, not tuned here (from the git history, `git log -S`): the reward weights 4:1:1 "
    "(answer : format : third reward, the trainer's default stack since d4e031a, never changed); "
    "answer_visual_gain's clip `ANSWER_GAIN_CLIP` = 4 nats (1c6c0f4, issue 25: set with the reward, as a cap on "
    "what a counterfactual gap can earn against gap hacking as PAPO describes; never changed since); 120 GRPO steps "
    "per run (36af564, issue 15, never changed; set with the pool's conflict rate 0.5, lr 3e-4 and the warm-up's "
    "conflict rate 0.05 in trials of the answer + format baseline alone, which read its held-out conflict accuracy "
    "on the validation rows of that time, the same generator arguments as these test rows, before any reliance "
    "signal or reward existed: these rows saw the baseline's trials, no variant's and no signal's). The trainer's "
    "default counterfactual `black` was itself chosen (c2c59ea) on this benchmark's earlier measurement over every "
    "kind on these same test rows, so the runs' kind is not free of that selection; the development split's pick is."
)
"""Where the settings the test rows could have been tuned on came from (read from the git history, not measured)."""


def selection_lines(dev: dict | None, rel: dict | None, s) -> list[str]:
    """What was chosen on which rows: the development split (its rows, how they were made disjoint from the test
    rows, the rule and its pick with the ranking there) and what was fixed before (``FIXED_EARLIER``)."""
    default = _default_counterfactual()
    pick, ranked = pick_kind(dev, default)
    head = ("Chosen where. Two splits of the same generator: the test rows (the first "
            f"{(rel or {}).get('prompts', s.reliance_prompts)} conflict rows of the {s.n_eval} held-out rows, split "
            "validation), on which every figure below is reported and nothing is chosen, and a development split, "
            "on which the counterfactual kind of the reported reliance signals is ranked")
    if not dev:
        return [head + ". No development-split measurement in this invocation: no kind was picked.", "",
                FIXED_EARLIER, ""]
    rows = (f"{head}: split `{dev.get('split', 'dev')}` (the generator's own random stream for it; question ids "
            f"carry the split's name), {s.n_dev} rows drawn at conflict rate {s.eval_conflict_rate:g} less the "
            f"{dev.get('excluded', '—')} whose image (its PNG bytes) also occurs in the test rows, the GRPO pool or "
            f"the warm-up's rows ({dev.get('rows', '—')} kept); its first {dev['prompts']} conflict rows, "
            f"{dev['samples']} sampled completions each, measured like the test rows.")
    ranking = (f"Rule: {PICK_RULE}. Ranking (within-prompt / pooled AUROC of {PICK_SIGNAL}): "
               + ", ".join(f"`{k}` {_f(w)} / {_f(a)}" for k, w, a in ranked) + ". ")
    if pick is None:
        ranking += "No kind has a within-prompt AUROC on the development split: no kind was picked."
    else:
        ranking += (f"The development split picks `{pick}`; the runs' counterfactual is `{s.counterfactual}`"
                    + (" (the trainer's default)" if s.counterfactual == default else "")
                    + f": {'it is' if pick == s.counterfactual else 'it is not'} the pick. The runs keep their "
                    "kind (changing it would change every run); the test tables below report every kind, the "
                    "pick's and the runs' marked.")
    return [rows, "", ranking, "", FIXED_EARLIER, ""]


def end_reliance_lines(groups: dict[str, list[dict]], variants: dict, s) -> list[str]:
    """The same measurement at the end of every run (the runs' counterfactual only): AUROC mean ± sd over seeds, and
    the signals' means over the sampled rollouts."""
    rows = {n: [r["reliance_end"] for r in rs if r.get("reliance_end")] for n, rs in groups.items()}
    if not any(rows.values()):
        return ["No end-of-run reliance measurement in this invocation.", ""]
    ex = next(m for ms in rows.values() for m in ms)
    lines = [
        f"At the end of every run, with the runs' counterfactual `{s.counterfactual}` only: {ex['prompts']} held-out "
        f"conflict prompts x {ex['samples']} sampled completions per run; AUROC against the data's label, mean ± sd "
        "over seeds (each run's own 95% prompt-bootstrap interval is in its JSON record, with its per-rollout "
        "records); every signal on the run's common set of rollouts; n: that set per run (of it prior-following), "
        "mean over seeds.",
        "",
        "| variant | n (prior-following) | " + " | ".join(f"{SIGNAL_LABELS[n]} AUROC" for n in SIGNALS)
        + " | answer_visual_gain within-prompt AUROC | rule vs data label | visual_gain mean | answer_visual_gain "
        "mean | blind_agrees mean |",
        "|---|---:|" + "---:|" * (len(SIGNALS) + 5),
    ]
    for name, ms in rows.items():
        if not ms:
            continue
        ks = [m["kinds"][s.counterfactual] for m in ms]
        common = [(k["table"].get("mdi") or {}) for k in ks]
        n = _mean(r.get("n") for r in common)
        n_prior = _mean(r.get("n_prior") for r in common)
        aucs = [_spread_sd([(k["table"].get(sig) or {}).get("auroc") for k in ks]) for sig in SIGNALS]
        aucs.append(_spread_sd([(k["table"].get("answer_visual_gain") or {}).get("within_auroc") for k in ks]))
        agree = _spread_sd([(k["agreement"] or {}).get("agreement") for k in ks])
        means = [_spread_sd([k["means"].get(sig) for k in ks], "+.3f" if sig != "blind_agrees" else ".3f")
                 for sig in KIND_SIGNALS]
        lines.append(f"| {variants[name].label} | {_f(n, '.0f')} ({_f(n_prior, '.0f')}) | " + " | ".join(aucs)
                     + f" | {agree} | " + " | ".join(means) + " |")
    return lines + [""]


def _spread_sd(xs, fmt: str = ".3f") -> str:
    """``mean ± sd`` over seeds (one value: the value)."""
    xs = _finite(xs)
    if not xs:
        return "—"
    return format(xs[0], fmt) if len(xs) == 1 else \
        f"{format(statistics.fmean(xs), fmt)} ± {format(statistics.stdev(xs), fmt.lstrip('+'))}"


def _goal_verdict(row: dict | None, goal: float) -> str:
    return ("—" if not row or row.get("auroc") is None else "NOT met" if row["auroc"] < goal
            else "met" if (row.get("low") is not None and row["low"] >= goal)
            else "met by the point estimate only (its interval reaches below)")


def _default_counterfactual() -> str:
    return next(f.default for f in dataclasses.fields(MDIGRPOConfig) if f.name == "counterfactual_image")


def goal_lines(groups: dict[str, list[dict]], variants: dict, rel: dict | None, s,
               dev: dict | None = None) -> list[str]:
    """Issue 25's goals, each with the measured number and whether it is met: the AUROCs on the test rows (``rel``)
    with the runs' counterfactual and, where it differs, with the kind the development split (``dev``) picks; which
    kinds meet both goals is read on the development split only (the test rows choose nothing)."""
    out = ["Goals (issue 25), as measured (warm-up: the test rows; kinds are chosen on the development split):", ""]
    kind = s.counterfactual
    default = _default_counterfactual()
    pick, _ = pick_kind(dev, default)
    which = "the trainer's default" if kind == default else f"--counterfactual; the trainer's default is `{default}`"
    k = (rel or {}).get("kinds", {}).get(kind)
    for sig, goal in GOAL_AUROC.items():
        row = (k or {}).get("table", {}).get(sig)
        ends = [((r.get("reliance_end") or {}).get("kinds", {}).get(kind) or {}).get("table", {}).get(sig, {})
                .get("auroc") for rs in groups.values() for r in rs]
        out.append(f"- {sig} AUROC ≥ {goal:.2f} with the runs' counterfactual `{kind}` ({which}): warm-up "
                   f"{_auc(row)}: {_goal_verdict(row, goal)}; at the end of the runs "
                   f"{_spread_sd(ends)} (mean ± sd over all runs).")
        if pick is not None and pick != kind:
            row = ((rel or {}).get("kinds", {}).get(pick) or {}).get("table", {}).get(sig)
            out.append(f"- {sig} AUROC ≥ {goal:.2f} with the development split's pick `{pick}` (not the runs'): "
                       f"warm-up {_auc(row)}: {_goal_verdict(row, goal)}; not measured at the end of the runs.")
    if dev and dev.get("kinds"):
        both = [kd for kd, v in dev["kinds"].items()
                if all((v["table"].get(sig) or {}).get("auroc") is not None and v["table"][sig]["auroc"] >= g
                       for sig, g in GOAL_AUROC.items())]
        out.append(f"- Kinds meeting both AUROC goals on the development split: "
                   f"{', '.join(f'`{kd}`' for kd in both) if both else 'none'}.")
    if rel and rel.get("kinds"):
        mdi = (next(iter(rel["kinds"].values()))["table"].get("mdi") or {})
        out.append(f"- MDI (all layers) beside them, test rows: AUROC {_auc(mdi)}, within-prompt {_within(mdi)}, on the same "
                   f"common set of {mdi.get('n', '—')} rollouts.")
    for name in groups:
        goal = training_goal(groups, name)
        if goal is not None:
            out.append(f"- Training, {variants[name].label}: {goal[1]} "
                       f"(non-conflict {_f(_mean(final(r)['plain'] for r in groups[name]))}, clean "
                       f"{_f(_mean(final(r)['clean'] for r in groups[name]))}).")
    return out + [""]


def comparison_lines(groups: dict[str, list[dict]], variants: dict, warm: dict) -> list[str]:
    """The comparison in words, every number computed here: each variant's paired difference in final conflict-row
    accuracy against answer + format only, with its 95% t interval over the paired seeds, which intervals exclude 0
    (either sign), the baseline's own seed-to-seed sd beside them, and whether MDI saw the prior."""
    base = {r["seed"]: final(r)["conflict"] for r in groups.get(BASELINE, [])}
    if len(base) < 2:
        return []
    sd = statistics.stdev(base.values())
    parts, excluding = [], []
    for name in groups:
        if name == BASELINE:
            continue
        d = paired_difference(groups, name, "conflict")
        if d["n"]:
            better = sum(x > 0 for x in d["differences"])
            parts.append(f"{variants[name].label} {format_paired_difference(d)}, better on {better}/{d['n']}")
            if d["n"] >= 2 and not d["low"] <= 0.0 <= d["high"]:
                excluding.append(variants[name].label)
    w = warm["eval"]
    mdis = [e["mdi_all"] for rs in groups.values() for r in rs for e in r["evals"] if math.isfinite(e["mdi_all"])]
    return [
        f"Paired by seed, final conflict-row accuracy minus answer + format only's (mean [95% t interval] over the "
        f"paired seeds): {'; '.join(parts)}. "
        + (f"Intervals that exclude 0: {', '.join(excluding)}." if excluding
           else "Every interval includes 0: no variant is shown to change conflict accuracy at this scale.")
        + f" The baseline's own seed-to-seed sd is {sd:.3f}.",
        "",
        f"Held-out MDI (all layers) of every evaluation of every run lies in {min(mdis):.3f}–{max(mdis):.3f}; the "
        f"warm-up's is {w['mdi_all_conflict']:.3f} on conflict rows and {w['mdi_all_plain']:.3f} on non-conflict "
        "rows, while its accuracy there is "
        f"{w['conflict']:.3f} and {w['plain']:.3f}.",
        "",
    ]


def budget_line(s, span_minutes: float | None, runs: list[dict], workers: int) -> str:
    """What issue 25 asked that this invocation's settings cut, and the wall time against the 60-minute budget."""
    cuts = [f"the end-of-run reliance measurement uses the runs' counterfactual `{s.counterfactual}` only (the "
            "warm-up's covers every kind)"]
    if s.end_samples < 8 or s.reliance_prompts < 200:
        measured = [r["reliance_end"] for r in runs if r.get("reliance_end")]
        # Its cost is about proportional to the rollouts (greedy + samples per prompt): what 8 samples would add.
        extra = sum(m["seconds"] * (8 - m["samples"]) / (m["samples"] + 1) for m in measured) / max(1, workers)
        cuts.append(f"{s.reliance_prompts} prompts x {s.end_samples} samples at the end of each run, for time"
                    + (f" (8 samples would have added about {extra / 60:.1f} min of wall time here)"
                       if measured and s.end_samples < 8 else ""))
    if s.warmup_samples < 8 or s.reliance_prompts < 200:
        cuts.append(f"{s.reliance_prompts} prompts x {s.warmup_samples} samples on the warm-up model (issue: at "
                    "least 200 x 8)")
    if len(s.seeds) < 5 or s.seeds_other < 3:
        cuts.append(f"{len(s.seeds)} seed(s) for the baseline and answer_visual_gain, "
                    f"{min(s.seeds_other, len(s.seeds))} for the others (issue: 5 and 3)")
    if s.steps < 120:
        cuts.append(f"{s.steps} GRPO steps per run (before: 120)")
    if s.counterfactual == "none" and "tprl_counterfactual" not in s.variants:
        cuts.append("TPRL with the counterfactual as its perturbation is left out: the counterfactual `none` removes "
                    "the image, and TPRL's perturbation must be an image")
    if not s.reliance_everywhere:
        cuts.append("the reliance signals are computed in training only where a reward reads them (one forward per "
                    "step saved elsewhere), so the live reliance/* columns are empty for the other variants")
    wall = "" if span_minutes is None else (
        f" This invocation's jobs took {span_minutes:.1f} min from the warm-up's start to the last job's end: "
        + ("within it." if span_minutes <= BUDGET_MINUTES else "OVER it."))
    return (f"Budget: the whole benchmark under {BUDGET_MINUTES} min on 2 cores (issue 25).{wall} Cut from the "
            "issue's asks: " + "; ".join(cuts) + ".")


def code_lines(runs: list[dict], warm: dict, warm_rel: dict | None, version: dict | None,
               dev_rel: dict | None = None) -> list[str]:
    """The code version every result came from (``results.code_version`` of the files that decide a result), and
    the jobs that came from another one (reused with --reuse_other_code) by name."""
    jobs = [("warm-up", warm), *((["warm-up reliance (test rows)", warm_rel],) if warm_rel else ()),
            *((["warm-up reliance (development split)", dev_rel],) if dev_rel else ()),
            *((r.get("key") or f"{r['variant']}-s{r['seed']}", r) for r in runs)]
    other: dict[str, list[str]] = {}
    for label, record in jobs:
        stored = record.get("code_version")
        if stored != version:
            other.setdefault(describe_version(stored) if stored else "an unrecorded code version (measured "
                             "before the version was stored)", []).append(label)
    line = (f"- Code: {describe_version(version)} (git; uncommitted changes counted in trl_mdi/, fixtures/, the "
            "benchmark's own files and pyproject.toml), part of every job's fingerprint: a stored job from other "
            "code is rerun unless --reuse_other_code")
    if not other:
        return [line + "; every figure below came from this version."]
    return [line + ". Reused from another version (--reuse_other_code): "
            + "; ".join(f"{', '.join(labels)}: {v}" for v, labels in other.items()) + "."]


def report(runs: list[dict], warm: dict, warm_rel: dict | None, s, recipe, variants: dict, argv: list[str],
           started: float, failed: list, load_end: float, workers: int, version: dict | None = None,
           dev_rel: dict | None = None) -> str:
    """The section "## Language prior" of RESULTS.md, every number from ``runs``, ``warm``, ``warm_rel`` (the
    warm-up's reliance on the test rows) and ``dev_rel`` (on the development split, where the kind is chosen)."""
    groups = by_variant(runs, variants)
    pick, _ = pick_kind(dev_rel, _default_counterfactual())
    size = ", ".join(f"{k}={v}" for k, v in recipe.model_size.items())
    cmd = " ".join(["-m benchmarks.language_prior", *map(shlex.quote, result_args(argv, OUTPUT_ONLY_FLAGS))])
    measured = warm["seconds"] + sum(r["wall_seconds"] for r in runs) + (warm_rel or {}).get("seconds", 0.0) \
        + (dev_rel or {}).get("seconds", 0.0)
    ends = [r.get("ended_at") for r in runs] + [m.get("ended_at") for m in (warm_rel, dev_rel) if m]
    last = max([t for t in ends if t is not None], default=time.time())
    span_minutes = ((last - warm["started_at"]) / 60 if ends and None not in ends and warm.get("started_at")
                    else None)
    span = f"{span_minutes:.1f} min from the warm-up's start to the last job's end, " if span_minutes else ""
    loads = [x for r in runs for x in r["load"]]
    steps = max((final(r)["step"] for r in runs), default=0)
    seeds_line = (f"GRPO seeds {', '.join(map(str, s.seeds))} for "
                  + ", ".join(variants[n].label for n in groups if variants[n].all_seeds)
                  + f", the first {min(s.seeds_other, len(s.seeds))} for the others")
    lines = [
        SECTION,
        "",
        f"Reproduce: `.venv/bin/python {cmd}` (from the repository root). Wall time: {span}"
        f"this invocation {(time.time() - started) / 60:.1f} min (a resumed invocation reuses finished jobs); the "
        f"warm-up, its reliance measurements and the runs' own times add up to {measured / 60:.1f} min. Plot: "
        "[language_prior.png](language_prior.png).",
        "",
        budget_line(s, span_minutes, runs, workers),
        "",
        f"- Date (the last job's end): {datetime.datetime.fromtimestamp(last, datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, `torch.set_num_threads({torch.get_num_threads()})`, Python "
        f"{platform.python_version()}; "
        + f"{workers} job(s) at a time, each in its own process. Load average (1 min) over "
        f"the runs {_f(min(loads, default=math.nan), '.2f')}–{_f(max(loads, default=math.nan), '.2f')}, "
        f"{load_end:.2f} at the end: the machine is shared.",
        *code_lines(runs, warm, warm_rel, version, dev_rel),
        f"- Model: `fixtures.tiny` {recipe.arch}, seed {recipe.model_seed}, {size}; {warm.get('num_params', 0):,} "
        f"parameters, float32, 4 image tokens per {recipe.image_size}x{recipe.image_size} image.",
        f"- Task: `fixtures.synthetic` kind prior_color, option_order {recipe.option_order} (A. red B. green C. blue "
        "D. yellow), objects tomato/red, grass/green, sky/blue, banana/yellow; the answer is the image's colour. "
        f"Warm-up: {recipe.n_train} rows of split train (seed {recipe.data_seed}), conflict rate "
        f"{recipe.conflict_rate:g}, target `<think> {recipe.think}</think>\\nAnswer: X`, {recipe.epochs:g} epochs, "
        f"lr {recipe.learning_rate:g} {recipe.lr_scheduler_type}, batch {recipe.batch_size} "
        f"({warm['sft_steps']} SFT steps, {warm['seconds']:.0f} s), shared by every run. GRPO prompts: "
        f"{s.n_pool} rows of split train (seed {recipe.data_seed + 1}), conflict rate {s.pool_conflict_rate:g}. "
        f"Held-out: {s.n_eval} rows of split validation (seed {recipe.data_seed}), conflict rate "
        f"{s.eval_conflict_rate:g} ({round(s.n_eval * s.eval_conflict_rate)} conflict rows), and the same rows blank.",
        f"- GRPO (`MDIGRPOTrainer`): {steps} steps per run, {s.prompts_per_step} prompts x {s.num_generations} "
        f"generations per step, max_completion_length {s.max_completion_length}, lr {s.learning_rate:g} "
        f"{s.lr_scheduler_type}, beta 0, temperature 1, mask_truncated_completions, attention metrics on (every "
        "variant pays for the probe), "
        + ("reliance signals on in every run (`reliance_signals=True`: one no-grad forward with the counterfactual "
           "image per step, in every variant, so that the live reliance/* metrics compare)" if s.reliance_everywhere
           else "reliance signals on only where a reward reads them")
        + f", counterfactual image `{s.counterfactual}`; {seeds_line}. Rewards per variant: "
        + "; ".join(f"{v.label}: " + ", ".join(f"{n} {w:g}" for n, w in zip(v.rewards, v.weights))
                    + (f", TPRL (entropy + perception filtering, trajectory reweighting, VPPO defaults) with "
                       f"perception_signal={v.tprl!r}" if v.tprl else "")
                    + (f", perception_perturbation=`{s.counterfactual}` (the counterfactual: one forward serves TPRL "
                       "and the reliance signals)" if v.perturbation else "")
                    for k, v in variants.items() if k in groups) + "."
        + (" The perturbation-signal variant (VPPO's patch blackening) also computes the attention signal "
           "(perception_signal_compare) to log `tprl/signal_rank_corr`; it filters and reweights by the perturbation "
           "signal only." if "tprl_perturbation" in groups else ""),
        f"- Evaluation: greedy, max_new_tokens {s.eval_max_new_tokens}, every {s.eval_every} steps; accuracy by "
        "the mc_idx reward's parser; clean format: the completion is exactly `<think>...</think>\\nAnswer: X` and "
        "ends at end of sequence. Held-out MDI: `measure_modality_attention` on prompt + greedy answer (text = "
        "every non-image prompt token, layers in thirds), mean over rows; rollout MDI: the trainer's "
        "`attention/mdi` / `attention/mdi_late` on the rollouts it trained on. s / step: the run's GRPO wall time "
        "per step without evaluations; it moves with the machine's load (other users' jobs, the other worker), so "
        "compare it across variants with care; TPRL with the perturbation signal runs one extra forward per step "
        "(none more for the counterfactual-as-perturbation variant: it shares the reliance forward).",
        f"- Reliance: `trl_mdi.profile.reference.measure_reliance` (plain no-grad forwards, real and counterfactual "
        "image, on the held-out conflict rows) summarised by `trl_mdi.profile.reliance_report.summarize_reliance` "
        f"(`trl_mdi.profile.validation.signal_table`: every signal on one common set of rollouts, pooled and "
        f"within-prompt AUROC, {s.n_boot} bootstrap resamples over prompts; and `label_agreement`), over "
        "the sampled rollouts only (the greedy one gives each prompt's answer for the blind-answer rule).",
        "",
        "Prior reliance of the shared warm-up (chance 0.25):",
        "",
        *warmup_lines(warm),
        "",
        "Which per-rollout signal sees prior-following answers: the warm-up model.",
        "",
        *selection_lines(dev_rel, warm_rel, s),
        "Development split (the choice of the counterfactual kind; nothing on it is reported as a result):",
        "",
        *warm_reliance_lines(dev_rel, s, pick=pick, dev=True),
        "Test rows (the report; nothing chosen on them):",
        "",
        *warm_reliance_lines(warm_rel, s, pick=pick),
        "Variants at the end: accuracy and format (mean ± sd [min–max] over seeds; paired: each seed minus the "
        "baseline's same seed):",
        "",
        *accuracy_table(groups, variants),
        "",
        "Prior, blank images, MDI and time (start = the warm-up's row above):",
        "",
        *variant_table(groups, variants),
        "",
        "Live reliance signals of the rollouts each run trained on (the trainer's reliance/* metrics), first 10 → "
        "last 20 steps, mean over seeds; a policy gaming a counterfactual gap shows as a falling answer_rate and a "
        "rising completion length or entropy:",
        "",
        *live_table(groups, variants),
        "",
        *end_reliance_lines(groups, variants, s),
        "Reward signal: `rewards/<name>/zero_spread_frac`, the fraction of groups whose rollouts all got the same "
        "value of that reward (no GRPO signal from it), mean over steps and seeds:",
        "",
        *spread_table(groups, variants),
        "",
        "Held-out conflict-row accuracy by step (mean over seeds):",
        "",
        *curve_lines(groups, variants),
        "",
        *goal_lines(groups, variants, warm_rel, s, dev_rel),
        *comparison_lines(groups, variants, warm),
    ]
    if failed:
        lines += ["Failed jobs (not in the tables): " + "; ".join(f"{k}: {e}" for k, e in failed), ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- time projection


def _median(xs) -> float:
    xs = _finite(xs)
    return statistics.median(xs) if xs else math.nan


def projection_lines(runs: list[dict], warm: dict, warm_rel: dict | None, s, full, recipe, full_recipe,
                     variants: dict, workers: int, dev_rel: dict | None = None) -> list[str]:
    """The full benchmark's projected wall time from this (quick) invocation's own timings: per variant, its median
    GRPO step time (the first step left out: it pays one-off costs), its held-out evaluation time per row and its
    end-of-run reliance time per rollout, scaled to ``full``'s steps, rows and rollouts, plus its setup time
    (model load, trainer construction); the warm-up's SFT scaled by epochs; the jobs then scheduled on ``workers``
    in the order the benchmark submits them (each to the first free worker); the warm-up's reliance measurements
    (test rows, development split) scaled per rollout."""
    groups = by_variant(runs, variants)
    if not groups:
        return ["Projection: no finished run to time."]
    evals_full = math.ceil(full.steps / full.eval_every) + 1  # every eval_every steps (and the last), + the blank one
    per_run, notes = {}, []
    for name, rs in groups.items():
        step = _median(x for r in rs for x in r["step_seconds"][1:])
        e_row = _mean((sum(e["seconds"] for e in r["evals"][1:]) + r["blank_final"]["seconds"])
                      / (len(r["evals"]) * s.n_eval) for r in rs)
        rel = [r["reliance_end"] for r in rs if r.get("reliance_end")]
        rel_roll = _mean(m["seconds"] / (m["prompts"] * (m["samples"] + 1)) for m in rel) if rel else 0.0
        setup = _mean(r["wall_seconds"] - r["grpo_seconds"] - r["eval_seconds"] - r["blank_final"]["seconds"]
                      - (r.get("reliance_end") or {}).get("seconds", 0.0) for r in rs)
        train = step * full.steps
        ev = e_row * full.n_eval * evals_full
        rl = rel_roll * full.reliance_prompts * (full.end_samples + 1)
        per_run[name] = setup + train + ev + rl
        notes.append(f"  {name}: {step:.2f} s/step x {full.steps} = {train / 60:.1f} min, evals {e_row * 1000:.0f} ms/row"
                     f" x {full.n_eval} x {evals_full} = {ev / 60:.1f} min, end reliance {rel_roll * 1000:.0f} ms/rollout"
                     f" x {full.reliance_prompts * (full.end_samples + 1)} = {rl / 60:.1f} min, setup {setup:.0f} s: "
                     f"{per_run[name] / 60:.1f} min per run x {len(full.seeds_for(name))} seeds")
    sft = warm["seconds"] * full_recipe.epochs / recipe.epochs
    e_row0 = _mean((sum(e["seconds"] for e in r["evals"][1:]) + r["blank_final"]["seconds"])
                   / (len(r["evals"]) * s.n_eval) for r in runs)
    warm_total = sft + 2 * e_row0 * full.n_eval
    jobs = []
    for label, m in (("warm-up reliance, test rows", warm_rel), ("warm-up reliance, development split", dev_rel)):
        if m:
            kinds = max(len(m["kinds"]), 1)
            w_roll = m["seconds"] / (m["prompts"] * (m["samples"] + 1))
            jobs.append(w_roll * full.reliance_prompts * (full.warmup_samples + 1))
            notes.append(f"  {label}: {w_roll * 1000:.0f} ms/rollout ({kinds} kinds) x "
                         f"{full.reliance_prompts * (full.warmup_samples + 1)} = {jobs[-1] / 60:.1f} min")
    missing = [n for n in full.variants if n not in per_run]
    for seed in full.seeds:
        for name in full.variants:
            if seed in full.seeds_for(name) and name in per_run:
                jobs.append(per_run[name])
    free = [0.0] * max(1, workers)
    for d in jobs:
        i = free.index(min(free))
        free[i] += d
    total = warm_total + max(free)
    return [f"Projected full benchmark ({len(jobs)} jobs on {workers} workers, from this invocation's timings, "
            f"machine load {os.getloadavg()[0]:.2f}): {total / 60:.1f} min wall (warm-up {warm_total / 60:.1f} min, "
            f"then {max(free) / 60:.1f} min of jobs; budget {BUDGET_MINUTES} min)"
            + (f"; variants not timed here, left out: {', '.join(missing)}" if missing else "") + ":", *notes]


# ---------------------------------------------------------------------------------------------------- plot


def plot(runs: list[dict], warm_rel: dict | None, s, variants: dict, path: Path, dev_rel: dict | None = None) -> None:
    """Top: conflict-row accuracy, non-conflict accuracy and held-out MDI vs step, one line per variant (mean over
    seeds) with the min–max band. Bottom: the live reliance/blind_agree_rate and reliance/answer_visual_gain of the
    rollouts trained on (10-step running mean, mean over seeds), and the warm-up model's AUROC per signal and
    counterfactual kind with its 95% interval, on the test rows (* the runs' kind, † the development split's pick)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = by_variant(runs, variants)
    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    panels = [("conflict", "held-out accuracy, conflict rows"), ("plain", "held-out accuracy, non-conflict rows"),
              ("mdi_all", "held-out MDI of greedy answers (all layers)")]
    for ax, (key, title) in zip(axes[0], panels):
        for i, (name, rs) in enumerate(groups.items()):
            steps = sorted({e["step"] for r in rs for e in r["evals"]})
            vals = [[e[key] for r in rs for e in r["evals"] if e["step"] == st] for st in steps]
            colour = f"C{i}"
            ax.plot(steps, [_mean(v) for v in vals], marker="o", ms=3, color=colour,
                    label=f"{variants[name].label} ({len(rs)} seeds)")
            ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=colour, alpha=0.15, lw=0)
        if key != "mdi_all":
            ax.axhline(CHANCE, ls=":", color="k", lw=1)
            ax.set_ylim(-0.02, 1.02)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step (0 = shared warm-up)")
        ax.grid(alpha=0.3)
    for ax, (key, title) in zip(axes[1][:2], [("reliance/blind_agree_rate", "rollouts: reliance/blind_agree_rate"),
                                             ("reliance/answer_visual_gain", "rollouts: reliance/answer_visual_gain")]):
        for i, rs in enumerate(groups.values()):
            n = max((len(r["steps"]) for r in rs), default=0)
            per_step = [_mean(r["steps"][j].get(key) for r in rs if j < len(r["steps"])) for j in range(n)]
            smooth = [_mean(per_step[max(0, j - 9): j + 1]) for j in range(n)]
            ax.plot(range(1, n + 1), smooth, color=f"C{i}")
        ax.set_title(f"{title} (counterfactual `{s.counterfactual}`, 10-step mean)", fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    ax = axes[1][2]
    if warm_rel and warm_rel.get("kinds"):
        kinds = list(warm_rel["kinds"])
        width = 0.8 / len(SIGNALS)
        for j, sig in enumerate(SIGNALS):
            rows = [warm_rel["kinds"][k]["table"].get(sig) or {} for k in kinds]
            xs = [i + (j - (len(SIGNALS) - 1) / 2) * width for i in range(len(kinds))]
            ys = [r.get("auroc") if r.get("auroc") is not None else math.nan for r in rows]
            err = [[max(0.0, y - (r.get("low") or y)) for y, r in zip(ys, rows)],
                   [max(0.0, (r.get("high") or y) - y) for y, r in zip(ys, rows)]]
            ax.bar(xs, ys, width, yerr=err, capsize=2, label=SIGNAL_LABELS[sig], color=f"C{j}")
        for goal in sorted(set(GOAL_AUROC.values())):
            ax.axhline(goal, ls="--", color="0.4", lw=0.8)
        ax.axhline(0.5, ls=":", color="k", lw=1)
        pick, _ = pick_kind(dev_rel, _default_counterfactual())
        ax.set_xticks(range(len(kinds)), [k + ("*" if k == s.counterfactual else "") + ("†" if k == pick else "")
                                          for k in kinds], fontsize=8, rotation=20)
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=7, loc="lower right", ncol=2)
    ax.set_title("warm-up model, test rows: AUROC for prior-following, by counterfactual (* the runs', † dev pick)",
                 fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.suptitle("trl_mdi language-prior benchmark: tiny Qwen2-VL, prior_color questions (line: mean over seeds, "
                 "band: min–max; dotted: chance)", fontsize=11)
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    fig.savefig(path, dpi=100)
    plt.close(fig)
