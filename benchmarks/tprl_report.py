"""TPRL on look or guess with conflict rows (issue 44): the reports. The warm-up's and the development split's
summaries (printed, and kept in /work/reports), and the plan's results, written below the plan's closing line in
benchmarks/RESULTS.md from the run records alone (no model).

The plan itself (its ``##`` section, written and committed before any of its runs) is never written here:
:func:`write_results` keeps everything up to and including :data:`PLAN_END` as it is and replaces only what follows
it, up to the next ``##`` section.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from pathlib import Path

from benchmarks.environment import describe_environment
from benchmarks.stats import holm_family, paired_power, paired_seed_difference, tprl_verdict
from benchmarks.tprl_design import ARMS, TprlSettings

SECTION = "## TPRL on look or guess with conflict rows: pre-registered plan and results"
"""The heading of the plan's section (the plan's author writes it with this heading)."""
PLAN_END = "<!-- end of the pre-registered TPRL plan: results below -->"
"""The line that closes the plan; the results go below it."""
PRIMARY = ("T", "T_att", "M")
"""The primary family: each against A, Holm over the three, two-sided."""
PLACEBO = {"T": "P", "T_att": "P"}
"""The secondary placebo comparisons (uncorrected 95%)."""
OUTCOMES = ("conflict", "plain", "clean", "neither", "guess", "look")
NAMES = {"conflict": "conflict accuracy", "plain": "non-conflict accuracy", "clean": "clean format",
         "neither": "neither-style share", "guess": "guess rate (conflict rows)", "look": "look rate"}


def _f(x, digits: int = 3, sign: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def _ms(values) -> str:
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return "—"
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def _interval(d: dict) -> str:
    if d.get("n", 0) < 2:
        return "—"
    return f"{_f(d['mean'], sign=True)} [{_f(d['low'], sign=True)}, {_f(d['high'], sign=True)}]"


# ------------------------------------------------------------------------------------ warm-up and development


def warmup_summary(w: dict) -> str:
    """The warm-up (``tprl_look_or_guess.warmup``'s dict) in a few lines: recipe, hash, its check."""
    info, c = w["info"], w.get("check")
    r = info["recipe"]
    lines = [f"Warm-up: {r['n_train']} `{r['kinds'][0]}` rows, conflict rate {r['conflict_rate']}, look share "
             f"{r.get('look_share')}, {r['epochs']:g} SFT epochs, {info.get('sft_steps')} steps in {info.get('seconds')} "
             f"s; weights sha256 `{info['weights_sha256']}`; folder {w['model_dir']}."]
    if c:
        m = c["sampled"]
        lines.append(
            f"Check ({m['prompts']} validation prompts x {c['settings']['samples']} at T=1): look rate "
            f"{_f(m['all']['look_rate'])}, guess {_f(m['all']['guess_rate'])}, neither {_f(m['all']['other_rate'])}; "
            f"look accuracy on conflict rows {_f(m['conflict']['look']['accuracy'])}, guess answers the prior there "
            f"{_f(m['conflict']['guess']['answers_prior'])}; conflict accuracy {_f(m['conflict']['accuracy'])}, "
            f"non-conflict {_f(m['plain']['accuracy'])}, clean {_f(m['all']['clean'])}; both styles in "
            f"{_f(m['both_styles'])} of prompts.")
        lines.append("Goals: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in c["goals"].items()) + ".")
    return "\n".join(lines)


def dev_summary(record: dict) -> str:
    """The development split's choices (rules D1-D5 of ``benchmarks/tprl_design.py``) and the figures behind them,
    as Markdown."""
    w, sig = record["warmup"], record["signals"]
    t = sig["tables"]
    L = ["# TPRL on look or guess: development-split choices (issue 44)", "",
         f"Code `{(record['code'] or {}).get('commit', 'unknown')[:12]}`"
         + (" + uncommitted changes" if (record["code"] or {}).get("dirty") else "")
         + f"; {describe_environment([record['environment']])}; development seeds "
         f"{', '.join(map(str, record['dev_seeds']))}; development split: validation rows (never the test split).",
         "", "## D1 warm-up", ""]
    for x in w["tried"]:
        L.append(f"- {x['epochs']} epochs (sha256 `{x['sha256'][:16]}`): " + "; ".join(
            f"{k}: {'met' if v else 'NOT met'}" for k, v in x["goals"].items()))
    L += ["", warmup_summary({"info": w["info"], "check": w["check"], "model_dir": w["model_dir"]}), "",
          f"**Chosen: {w['chosen_epochs']:g} epochs, weights sha256 `{w['sha256']}`.**", "",
          "## D2 TPRL's perturbation, D3 the attention segment", "",
          f"{sig['rollouts']} warm-up rollouts ({sig['prompts']} validation prompts x {sig['samples']}, T=1, conflict "
          f"rate 0.5; look rate {_f(sig['look_rate'])}, neither {_f(sig['other_rate'])}, both styles in "
          f"{_f(sig['both_styles'])} of prompts). Within-prompt AUROC of the trajectory score S_i = mean_t s_t "
          "(look = positive) [95% prompt bootstrap] (pairs):", "",
          "| perturbation | all rows | conflict rows | non-conflict rows | look colour word kept by the perception "
          "filter | mean S_i look / guess |", "|---|---|---:|---:|---:|---|"]
    for k, v in t["kinds"].items():
        a = v["all"]
        L.append(f"| {k} | {_f(a['auroc'])} [{_f(a['low'])}, {_f(a['high'])}] ({a['pairs']}) | "
                 f"{_f(v['conflict']['auroc'])} | {_f(v['plain']['auroc'])} | {_f(v['colour_kept_look'])} | "
                 f"{_f(v['S_look'], 4)} / {_f(v['S_guess'], 4)} |")
    L += ["", f"**Chosen perturbation: `{sig['perturbation']}`** ({sig['why_perturbation']}).", "",
          "Within-prompt AUROC of the mean attention signal a_t per layer segment (look = positive):", "",
          "| segment | all rows | conflict rows | non-conflict rows | mean a_t look / guess |", "|---|---|---:|---:|---|"]
    for k, v in t["segments"].items():
        a = v["all"]
        L.append(f"| {k} | {_f(a['auroc'])} [{_f(a['low'])}, {_f(a['high'])}] | {_f(v['conflict']['auroc'])} | "
                 f"{_f(v['plain']['auroc'])} | {_f(v['A_look'], 4)} / {_f(v['A_guess'], 4)} |")
    L += ["", f"**Chosen segment: `{sig['segment']}`** ({sig['why_segment']}).", "",
          "Where the chains decide: the branching token (after \" I use the\") and the colour word, per style: "
          "entropy, s_t under each perturbation, a_t per segment, and how often each TGF filter (top 20% per "
          "completion) keeps the token.", ""]
    kinds, segs = list(t["kinds"]), list(t["segments"])
    L += ["| position | style | n | token | entropy (kept) | " + " | ".join(f"s_t {k} (kept)" for k in kinds)
          + " | " + " | ".join(f"a_t {g}" for g in segs) + " |",
          "|---|---|---:|---|---|" + "---|" * (len(kinds) + len(segs))]
    for where in ("branch", "colour"):
        for style, cell in t["positions"][where].items():
            if not cell.get("n"):
                continue
            L.append(f"| {where} | {style} | {cell['n']} | `{cell['token']!r}` | {_f(cell['entropy'])} "
                     f"({_f(cell['entropy_kept'], 2)}) | "
                     + " | ".join(f"{_f(cell['s'][k], 4)} ({_f(cell['s_kept'][k], 2)})" for k in kinds) + " | "
                     + " | ".join(_f(cell["a"][g], 4) for g in segs) + " |")
    el = t["positions"].get("elsewhere_entropy", {})
    L += ["", "Mean entropy at every other position: " + ", ".join(f"{k} {_f(v)}" for k, v in el.items()) + "."]
    p = record["pilot"]
    L += ["", "## D4 steps (time budget)", "",
          f"Timing pilot ({p['settings']['steps']} steps, seed {record['dev_seeds'][0]}, one run at a time): training "
          "seconds per step (median) " + ", ".join(f"{k} {v:.2f}" for k, v in p["step_seconds"].items())
          + f"; one held-out evaluation {p['eval_seconds']:.1f} s; set-up {p['overhead_seconds']:.1f} s; load average "
          + ", ".join(f"{k} {v}" for k, v in p["load"].items()) + ".",
          f"**Chosen: {record['steps']['chosen']} steps** (projected {record['steps']['projected_hours']:.2f} h for "
          "80 runs on 2 workers, two evaluations each; T_att and M costed as T)."]
    L += ["", "## D5 conflict rate of the GRPO pool", "",
          f"A (answer + format) at {record['settings']['steps']} steps on the development seeds, evaluated on 200 "
          "validation prompts (conflict rate 0.5, 4 samples at T=1):", "",
          "| rate | seed | conflict accuracy (mid / end) | look rate (end) | neither (end) | non-conflict | clean | "
          "training look rate first 10 / last 10 steps | wall s |", "|---:|---:|---|---:|---:|---:|---:|---|---:|"]
    for rate, v in record["rates"].items():
        for r in v["runs"]:
            f, mid = r.get("final") or {}, r.get("mid") or {}
            lr = [x for x in r["look_rate"] if x is not None]
            L.append(f"| {rate} | {r['seed']} | {_f(mid.get('conflict'))} / {_f(f.get('conflict'))} | "
                     f"{_f(f.get('look'))} | {_f(f.get('neither'))} | {_f(f.get('plain'))} | {_f(f.get('clean'))} | "
                     f"{_f(statistics.fmean(lr[:10]) if lr else None, 2)} / "
                     f"{_f(statistics.fmean(lr[-10:]) if lr else None, 2)} | {r['wall_seconds']:.0f} |")
        L.append(f"| {rate} | mean | — / {_f(v['mean_conflict'])} | | | | | | |")
    L += ["", f"**Chosen rate: {record['rate']['chosen']:g}** ({record['rate']['why']}).", "",
          "Plan settings: " + ", ".join(f"{k}={record['settings'][k]}" for k in (
              "steps", "pool_conflict_rate", "n_pool", "perturbation", "attention_segment", "mid_step")) + "."]
    return "\n".join(L) + "\n"


# ------------------------------------------------------------------------------------ the plan's results


def load_runs(work: Path) -> list[dict]:
    """Every finished run record in ``work/runs`` (with a final evaluation), sorted by arm and seed."""
    runs = [json.loads(p.read_text()) for p in sorted((work / "runs").glob("*.json"))]
    return sorted((r for r in runs if r.get("final")), key=lambda r: (r["arm"], r["seed"]))
