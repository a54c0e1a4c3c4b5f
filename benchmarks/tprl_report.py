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
    lr = record["learning_rate"]
    L += ["", "## D0 learning rate", "",
          f"A at each rate for 20 steps (seed {record['dev_seeds'][0]}, rate 0.2), evaluated on the development split; "
          f"the warm-up's neither-style share there: {lr['warmup_neither']:.3f}.", "",
          "| learning rate | neither-style share | conflict accuracy | look rate | most frequent neither text |",
          "|---:|---:|---:|---:|---|"]
    for rate, v in lr["tried"].items():
        ex = (v.get("examples") or {}).get("other") or [["—", 0]]
        L.append(f"| {rate} | {_f(v['final']['neither'])} | {_f(v['final']['conflict'])} | {_f(v['final']['look'])} | "
                 f"`{ex[0][0]!r}` ({ex[0][1]}) |")
    L += ["", f"**Chosen: {lr['chosen']:g}** ({lr['why']})."]
    p = record["pilot"]
    L += ["", "## D4 steps (time budget)", "",
          f"Timing pilot ({p['settings']['steps']} steps, seed {record['dev_seeds'][0]}, one run at a time), CPU seconds "
          "of the run's process (one thread): per training step (median) "
          + ", ".join(f"{k} {v:.2f}" for k, v in p["step_seconds"].items())
          + f"; one held-out evaluation {p['eval_seconds']:.1f}; the rest of a run {p['overhead_seconds']:.1f}. Wall "
          "clock beside (load average at start and end: " + ", ".join(f"{k} {v}" for k, v in p["load"].items())
          + "): per step " + ", ".join(f"{k} {v:.2f} s" for k, v in p["wall_step_seconds"].items())
          + ", evaluation " + ", ".join(f"{v:.1f} s" for v in p["wall_eval_seconds"]) + ", whole runs "
          + ", ".join(f"{k} {v:.0f} s" for k, v in p["wall_seconds"].items()) + ".",
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
              "steps", "pool_conflict_rate", "n_pool", "learning_rate", "perturbation", "attention_segment",
              "mid_step")) + "."]
    return "\n".join(L) + "\n"


# ------------------------------------------------------------------------------------ the plan's results


def load_runs(work: Path) -> list[dict]:
    """Every finished run record in ``work/runs`` (with a final evaluation), sorted by arm and seed."""
    runs = [json.loads(p.read_text()) for p in sorted((work / "runs").glob("*.json"))]
    return sorted((r for r in runs if r.get("final")), key=lambda r: (r["arm"], r["seed"]))


def by_seed(runs: list[dict], arm: str, outcome: str, at: str = "final") -> dict[int, float]:
    """seed -> the outcome of ``arm``'s runs, at the end (``at="final"``) or the midpoint (``"mid"``)."""
    out = {}
    for r in runs:
        if r["arm"] != arm:
            continue
        values = r.get("final") if at == "final" else (r.get("mid") or {}).get("outcomes")
        if values is not None and values.get(outcome) is not None:
            out[r["seed"]] = values[outcome]
    return out


def analyse(runs: list[dict]) -> dict:
    """Every test of the results: the primary family (T, T_att, M vs A on conflict accuracy at the last step,
    ``holm_family``: Holm over the three, each rejected only when its t interval at its level and the exact
    sign-flip test agree), the placebo comparisons (T vs P, T_att vs P at 95%), each arm's secondary differences with
    A at 95% (every outcome, and conflict accuracy at the midpoint), and each arm's verdict (``tprl_verdict``)."""
    primary = holm_family({x: (by_seed(runs, x, "conflict"), by_seed(runs, "A", "conflict")) for x in PRIMARY})
    secondary = {x: {o: paired_seed_difference(by_seed(runs, x, o), by_seed(runs, "A", o)) for o in OUTCOMES}
                 for x in ("T", "T_att", "P", "M")}
    for x in secondary:
        secondary[x]["mid_conflict"] = paired_seed_difference(by_seed(runs, x, "conflict", "mid"),
                                                              by_seed(runs, "A", "conflict", "mid"))
    placebo = {x: paired_seed_difference(by_seed(runs, x, "conflict"), by_seed(runs, p, "conflict"))
               for x, p in PLACEBO.items()}
    verdicts = {x: tprl_verdict(primary[x], neither=secondary[x]["neither"],
                                noninferiority=[("non-conflict accuracy", secondary[x]["plain"]),
                                                ("clean format", secondary[x]["clean"])],
                                placebo=placebo.get(x)) for x in PRIMARY}
    return {"primary": primary, "secondary": secondary, "placebo": placebo, "verdicts": verdicts}


def power_table(primary: dict, effects=(0.10, 0.15, 0.20), sims: int = 2000) -> dict:
    """Per primary comparison: the observed sd of its seed-paired differences, and the power (``paired_power``) at
    its own Holm level and at the family's first level (alpha / 3) to detect each of ``effects`` with that sd."""
    out = {}
    first = min(p["alpha"] for p in primary.values())
    for x, p in primary.items():
        d = p["difference"]
        if d["n"] < 2 or not d["sd"] > 0:
            out[x] = None
            continue
        out[x] = {"sd": d["sd"], "n": d["n"], "alpha": p["alpha"],
                  "at_level": {e: paired_power(d["sd"], d["n"], e, p["alpha"], sims=sims) for e in effects},
                  "at_first": {e: paired_power(d["sd"], d["n"], e, first, sims=sims) for e in effects}}
    return out


def learning_curve(runs: list[dict], arm: str, windows: int = 10) -> list[float]:
    """The look rate of ``arm``'s training rollouts per window of steps (``windows`` equal windows), mean over steps
    in the window and over seeds."""
    per_seed = []
    for r in runs:
        if r["arm"] == arm:
            per_seed.append([x.get("rewards/long_look_rate/mean") for x in r["steps"]])
    if not per_seed:
        return []
    steps = max(len(s) for s in per_seed)
    size = max(1, math.ceil(steps / windows))
    out = []
    for lo in range(0, steps, size):
        vals = [v for s in per_seed for v in s[lo:lo + size] if v is not None]
        out.append(statistics.fmean(vals) if vals else math.nan)
    return out


def style_accuracy(runs: list[dict], arm: str, style: str) -> dict[str, list[float]]:
    """``arm``'s held-out conflict rows at the last step, per seed: the share of rollouts in ``style`` (``look``,
    ``guess`` or ``other``, the reader's *neither*) and their accuracy (seeds with no such rollout give no accuracy).
    Descriptive, not in the plan: it says whether the neither-style chains answer from the image (a look chain the
    reader cannot parse) or from the name, which the hacking rule (the neither-style share) cannot tell."""
    share, acc = [], []
    for r in runs:
        rows = ((r.get("eval") or {}).get("sampled") or {}).get("conflict")
        if r["arm"] != arm or not rows or not rows.get("n"):
            continue
        part = rows.get(style) or {}
        share.append(part.get("n", 0) / rows["n"])
        if part.get("n"):
            acc.append(part["accuracy"])
    return {"share": share, "accuracy": acc}


def busy_time(runs: list[dict]) -> tuple[float, int]:
    """The seconds in which at least one run was going (the union of the runs' [start, end] intervals) and the
    number of sittings: stretches of that union separated by a gap of an hour or more. The span from the first start
    to the last end would count the nights between sittings.

    A gap of two minutes stays in the sitting but is not busy time; one of two hours starts another sitting:

    >>> busy_time([{"started_at": 0, "ended_at": 10}, {"started_at": 5, "ended_at": 20},
    ...            {"started_at": 140, "ended_at": 150}, {"started_at": 7350, "ended_at": 7360}])
    (40, 2)
    """
    total, sittings, end = 0, 0, None
    for lo, hi in sorted((r["started_at"], r["ended_at"]) for r in runs):
        if end is None or lo > end:
            sittings += end is None or lo - end >= 3600
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total, sittings


def plan_commit(results: Path) -> str | None:
    """The commit that added :data:`PLAN_END` to ``results`` (the plan commit), or None outside git or before it."""
    import subprocess

    try:
        out = subprocess.run(["git", "log", "--format=%h", "--reverse", "-S", PLAN_END, "--", results.name],
                             cwd=results.parent, capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    return out[0] if out else None


def code_labels(runs: list[dict]) -> str:
    """The code versions the runs came from, each with its count."""
    from benchmarks.look_or_guess_runs import code_label

    counts = Counter(code_label(r.get("code")) for r in runs)
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{k} ({n} runs)" for k, n in counts.most_common()) or "unknown"


def report(runs: list[dict], results: Path, *, workers: int = 2, sims: int = 2000) -> str:
    """The results written below the plan's closing line: how the runs were made, per-arm figures, the primary family,
    the placebo and secondary comparisons, the verdicts, the learning curves, the power and the per-seed values."""
    s = runs[0]["settings"] if runs else TprlSettings().__dict__
    seeds = sorted({r["seed"] for r in runs})
    counts = {x: sum(r["arm"] == x for r in runs) for x in ARMS}
    missing = [f"{x}-s{seed}" for seed in seeds for x in ARMS if not any(r["arm"] == x and r["seed"] == seed
                                                                           for r in runs)]
    plan = plan_commit(results)
    code = code_labels(runs)
    shas = Counter(r.get("warmup_sha256", "unknown")[:16] for r in runs)
    busy, sittings = busy_time(runs)
    same = plan is not None and "," not in code and code.startswith(plan) and "dirty" not in code
    L = ["", "### Results", "",
         "Reproduce: `python -m benchmarks.tprl_look_or_guess experiment --work_dir DIR --warmup_sha256 "
         f"{next(iter(shas), 'HASH')} --steps {s['steps']} --pool_conflict_rate {s['pool_conflict_rate']:g} "
         f"--learning_rate {s['learning_rate']:g} --perturbation {s['perturbation']} --attention_segment "
         f"{s['attention_segment']} --seeds "
         f"{' '.join(map(str, seeds))}` (resumable), then `python -m benchmarks.tprl_look_or_guess report --work_dir "
         "DIR` rewrites these results (never the plan).", "",
         f"Runs: code `{code}`; the plan commit `{plan or 'unknown'}`"
         + (" (the runs ran from that clean commit: the plan was committed before any of them)" if same else
            " (not the runs' code: see the code versions)") + f"; {sum(counts.values())} runs ("
         + ", ".join(f"{x} {n}" for x, n in counts.items()) + f"), seeds {', '.join(map(str, seeds)) or '—'}"
         + (f"; {busy / 3600:.1f} h of the machine on {workers} workers, in {sittings} sitting(s)" if busy else "")
         + (f"; missing: {', '.join(missing)}" if missing else "; nothing was cut from the plan") + ".",
         "Warm-up weights sha256 (first 16 hex digits): " + ", ".join(f"`{k}` ({n} runs)" for k, n in shas.items())
         + f". Environment: {describe_environment([r.get('environment') or {} for r in runs])}.",
         f"Settings: {s['steps']} steps x {s['prompts_per_step']} prompts x {s['num_generations']} rollouts, pool of "
         f"{s['n_pool']} rows at conflict rate {s['pool_conflict_rate']:g}, learning rate {s['learning_rate']:g}, "
         f"completions up to {s['max_completion_length']} tokens; held out: {s['n_eval']} test prompts (conflict rate "
         f"{s['eval_conflict_rate']:g}) x {s['eval_samples']} samples at T=1, at step {s['mid_step']} and "
         f"{s['steps']}; TPRL: entropy and perception top-p {s['top_p_entropy_tokens']:g} / "
         f"{s['top_p_perception_tokens']:g}, trajectory min {s['trajectory_scaling_min']:g}, perturbation "
         f"`{s['perturbation']}`, attention segment `{s['attention_segment']}`; GRPO: loss `{s['loss_type']}`, "
         f"epsilon {s['epsilon']:g} / {s['epsilon_high']:g}, beta {s['beta']:g}, scale_rewards `{s['scale_rewards']}`, "
         f"{s['num_iterations']} iteration, mask_truncated_completions {s['mask_truncated_completions']}."]
    cpus = {x: [r["cpu_seconds"] for r in runs if r["arm"] == x and r.get("cpu_seconds")] for x in ARMS}
    if any(cpus.values()):
        # CPU time, not wall time: a run's wall time also counts what else shared the machine and any pause
        L.append("CPU time per run (mean over seeds): " + ", ".join(
            f"{x} {statistics.fmean(v) / 60:.1f} min" for x, v in cpus.items() if v) + ".")
    L += ["", "Per arm (held-out test split at the last step; mean ± sd over seeds):", "",
          "| arm | runs | conflict accuracy | conflict accuracy at the midpoint | non-conflict accuracy | clean format "
          "| neither-style share | guess rate (conflict rows) | look rate |", "|---|---:|---|---|---|---|---|---|---|"]
    for x, arm in ARMS.items():
        rs = [r for r in runs if r["arm"] == x]
        L.append(f"| {arm.label} | {len(rs)} | {_ms(by_seed(runs, x, 'conflict').values())} | "
                 f"{_ms(by_seed(runs, x, 'conflict', 'mid').values())} | "
                 + " | ".join(_ms(by_seed(runs, x, o).values()) for o in ("plain", "clean", "neither", "guess", "look"))
                 + " |")
    styles = {x: {st: style_accuracy(runs, x, st) for st in ("look", "guess", "other")} for x in ARMS}
    if any(v["share"] for st in styles.values() for v in st.values()):
        L += ["", "What each style answers on the conflict rows at the last step (descriptive, not in the plan: the "
              "neither-style share is the hacking alarm, and this says whether those chains answer from the image, "
              "as a look chain the reader cannot parse would, or from the name); share of the conflict rollouts and "
              "the accuracy of that style, mean ± sd over seeds:", "",
              "| arm | look: share | look: accuracy | guess: share | guess: accuracy | neither: share | "
              "neither: accuracy |", "|---|---|---|---|---|---|---|"]
        for x in ARMS:
            if styles[x]["other"]["share"]:
                L.append(f"| {x} | " + " | ".join(f"{_ms(styles[x][st]['share'])} | {_ms(styles[x][st]['accuracy'])}"
                                                   for st in ("look", "guess", "other")) + " |")
    res = analyse(runs)
    L += ["", "Primary (conflict accuracy at the last step, paired by seed; Holm over T, T_att and M vs A, two-sided: "
          "the comparison with the smallest sign-flip p at 0.05/3, the next at 0.05/2, the last at 0.05, each only "
          "if the one before was rejected; rejected only when the t interval at the level and the exact sign-flip "
          "test agree):", "",
          "| comparison | Holm rank | level | mean difference [interval at the level] | sign-flip p (exact) | result |",
          "|---|---:|---:|---|---:|---|"]
    for x in PRIMARY:
        p = res["primary"][x]
        d = p["difference"]
        result = ("shown: higher" if p["shown"] else "shown: lower" if p["rejected"] else "not shown")
        L.append(f"| {x} vs A | {p['rank'] + 1} | {round(100 * (1 - p['alpha']), 2):g}% | {_interval(d)} "
                 f"({d['n']} seeds) | {_f(p['p'], 4)} | {result}: {p['text']} |")
    sec = res["secondary"]
    L += ["", "Secondary (95% paired t intervals, not corrected for multiplicity): the placebo comparisons, and each "
          "arm minus A (non-inferiority: the lower bound at or above -0.03):", "",
          "| comparison | conflict accuracy |", "|---|---|"]
    for x, p in PLACEBO.items():
        L.append(f"| {x} vs {p} | {_interval(res['placebo'][x])} ({res['placebo'][x]['n']} seeds) |")
    L += ["", "| arm - A | conflict at the midpoint | non-conflict accuracy (≥ -0.03?) | clean format (≥ -0.03?) | "
          "neither-style share | guess rate (conflict rows) | look rate |", "|---|---|---|---|---|---|---|"]
    for x in ("T", "T_att", "P", "M"):
        ni = [f"{_interval(sec[x][o])} ({'holds' if sec[x][o].get('low', -1) >= -0.03 else 'fails'})"
              for o in ("plain", "clean")]
        L.append(f"| {x} - A | {_interval(sec[x]['mid_conflict'])} | {ni[0]} | {ni[1]} | {_interval(sec[x]['neither'])} "
                 f"| {_interval(sec[x]['guess'])} | {_interval(sec[x]['look'])} |")
    L += ["", "Verdicts, by the decision rules (`benchmarks.stats.tprl_verdict`):", ""]
    for x in PRIMARY:
        v = res["verdicts"][x]
        L.append(f"- **{ARMS[x].label}: {v['verdict']}** (rule {v['rule']}; " + "; ".join(v["reasons"]) + ").")
    curves = {x: learning_curve(runs, x) for x in ARMS}
    width = max((len(c) for c in curves.values()), default=0)
    if width:
        size = math.ceil(s["steps"] / width)
        L += ["", f"Learning curve: look rate of the training rollouts per window of {size} steps (mean over steps and "
              "seeds):", "", "| arm | " + " | ".join(f"≤{min((i + 1) * size, s['steps'])}" for i in range(width)) + " |",
              "|---|" + "---:|" * width]
        for x, c in curves.items():
            if c:
                L.append(f"| {x} | " + " | ".join(_f(v, 2) for v in c) + " |")
    power = power_table(res["primary"], sims=sims)
    L += ["", f"Power (simulated, {sims} experiments per cell: normal paired differences with the observed sd, the "
          "t interval and the exact sign-flip test agreeing at the level) to detect a difference in conflict accuracy "
          "of +0.10 / +0.15 / +0.20:", "",
          "| comparison | seeds | paired sd | at its Holm level | at the first level (0.05/3) |", "|---|---:|---:|---|---|"]
    for x, pw in power.items():
        if pw is None:
            L.append(f"| {x} vs A | — | — | — | — |")
            continue
        L.append(f"| {x} vs A | {pw['n']} | {pw['sd']:.3f} | "
                 + " / ".join(f"{v:.2f}" for v in pw["at_level"].values()) + f" (at {pw['alpha']:.4g}) | "
                 + " / ".join(f"{v:.2f}" for v in pw["at_first"].values()) + " |")
    L += ["", "Per seed, conflict accuracy at the last step:", "", "| seed | " + " | ".join(ARMS) + " |",
          "|---:|" + "---:|" * len(ARMS)]
    for seed in seeds:
        L.append(f"| {seed} | " + " | ".join(_f(by_seed(runs, x, "conflict").get(seed)) for x in ARMS) + " |")
    return "\n".join(L) + "\n"


def write_results(results: Path, body: str) -> None:
    """Write ``body`` below :data:`PLAN_END` in ``results``: the plan (everything up to and including that line)
    is kept byte for byte, the text after it up to the next ``##`` section (the previous results) is replaced, and
    every later section is kept. ValueError when the file holds no plan (:data:`SECTION` and :data:`PLAN_END`)."""
    import re

    text = results.read_text(encoding="utf-8")
    if SECTION not in text or PLAN_END not in text or text.index(PLAN_END) < text.index(SECTION):
        raise ValueError(f"{results} holds no pre-registered TPRL plan ({SECTION!r} closed by {PLAN_END!r}): commit the "
                         "plan before writing results")
    end = text.index(PLAN_END) + len(PLAN_END)
    after = text[end:]
    nxt = re.search(r"^## ", after, re.M)
    rest = after[nxt.start():] if nxt else ""
    results.write_text(text[:end] + "\n" + body.strip("\n") + "\n" + ("\n" + rest if rest else ""), encoding="utf-8")
