"""The pre-registered look-or-guess replication (benchmarks/RESULTS.md, "Look or guess, replication: pre-registered
plan and results"): its report, written below the plan's closing line, and the earlier section's verdicts re-stated
under the corrected rules.

The plan's text is never written here: :func:`write_results` keeps everything up to and including
:data:`PLAN_END` as it is in RESULTS.md and replaces only what follows it, and :func:`plan_text` /
:func:`plan_commit` let the tests compare that text with the commit that added it.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
from collections import Counter
from pathlib import Path

from benchmarks.look_or_guess_evaluation import headline
from benchmarks.stats import holm_family, paired_seed_difference, replication_verdict

SECTION = "## Look or guess, replication: pre-registered plan and results"
PLAN_END = "<!-- end of the pre-registered plan: results below -->"
ARMS = {"A": "answer_format", "B": "visual_gain", "C": "guarded_visual_gain", "D": "placebo_guarded"}
LABELS = {"A": "A: answer + format", "B": "B: + visual_gain (as shipped)", "C": "C: + guarded_visual_gain",
          "D": "D: placebo (C's values permuted within groups)"}
EARLIER = ("mdi_balance", "visual_gain", "answer_visual_gain", "tprl_counterfactual", "visual_gain_other_form")
"""The earlier section's comparisons with answer + format (its 'visual_gain_other_form' is visual_gain_sum)."""


# ------------------------------------------------------------------------------------ the records


def load_runs(work: Path) -> list[dict]:
    """Every finished run record in ``work/runs`` (the JSON files the runs wrote), sorted by variant and seed."""
    runs = [json.loads(p.read_text()) for p in sorted((work / "runs").glob("*.json"))]
    return sorted((r for r in runs if r.get("eval")), key=lambda r: (r["variant"], r["seed"]))


def code_labels(runs: list[dict] | None) -> str:
    """The code versions the runs came from (``look_or_guess_runs.code_label``), each with its count."""
    from benchmarks.look_or_guess_runs import code_label

    counts = Counter(code_label(r.get("code")) for r in runs or [])
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{k} ({n} runs)" for k, n in counts.most_common()) or "unknown"


# ------------------------------------------------------------------------------------ the outcomes of one run


def outcomes(run: dict) -> dict[str, float]:
    """The plan's outcomes of one run, from its held-out evaluation (sampled rollouts of the test split):
    ``look_or_guess_evaluation.headline``'s ``conflict`` (accuracy on conflict rows), ``plain`` (non-conflict
    accuracy), ``clean`` (clean format, all rows), ``guess`` (its guess rate on conflict rows) and ``look`` (look
    rate, all rows), and ``neither`` (the share in neither style, all rows), which the headline does not hold."""
    h = headline(run["eval"])
    return {"conflict": h["conflict"], "plain": h["plain"], "clean": h["clean"], "guess": h["guess_rate_conflict"],
            "look": h["look_rate"], "neither": run["eval"]["sampled"]["all"]["other_rate"]}


def by_seed(runs: list[dict], variant: str, outcome: str) -> dict[int, float]:
    """seed -> the outcome, for the runs of ``variant``."""
    return {r["seed"]: outcomes(r)[outcome] for r in runs if r["variant"] == variant}


# ------------------------------------------------------------------------------------ the analysis


def analyse(runs: list[dict]) -> dict:
    """Every test the plan names, from the runs: the primary family (B vs A, C vs A: ``holm_family``), C vs D, the
    secondary differences to A at 95% for B and C, and each reward arm's verdict (``replication_verdict``)."""
    a = ARMS["A"]
    primary = holm_family({x: (by_seed(runs, ARMS[x], "conflict"), by_seed(runs, a, "conflict")) for x in "BC"})
    secondary = {x: {o: paired_seed_difference(by_seed(runs, ARMS[x], o), by_seed(runs, a, o))
                     for o in ("plain", "clean", "neither", "guess", "look")} for x in "BC"}
    placebo = paired_seed_difference(by_seed(runs, ARMS["C"], "conflict"), by_seed(runs, ARMS["D"], "conflict"))
    verdicts = {x: replication_verdict(
        primary[x], neither=secondary[x]["neither"],
        noninferiority=[("non-conflict accuracy", secondary[x]["plain"]), ("clean format", secondary[x]["clean"])],
        placebo=placebo if x == "C" else None) for x in "BC"}
    return {"primary": primary, "secondary": secondary, "placebo": placebo, "verdicts": verdicts}


def restate(runs: list[dict]) -> dict:
    """The earlier section's five comparisons with answer + format under the corrected rules: Holm over the five
    (t interval and sign-flip agreeing), non-inferiority margins for non-conflict accuracy and clean format, the
    neither-style rule; no placebo (it had none)."""
    base = "answer_format"
    present = [v for v in EARLIER if any(r["variant"] == v for r in runs)]
    primary = holm_family({v: (by_seed(runs, v, "conflict"), by_seed(runs, base, "conflict")) for v in present})
    out = {}
    for v in present:
        diff = {o: paired_seed_difference(by_seed(runs, v, o), by_seed(runs, base, o))
                for o in ("plain", "clean", "neither")}
        out[v] = {"primary": primary[v], **diff, "verdict": replication_verdict(
            primary[v], neither=diff["neither"],
            noninferiority=[("non-conflict accuracy", diff["plain"]), ("clean format", diff["clean"])])}
    return out


# ------------------------------------------------------------------------------------ the text


def _f(x, digits: int = 3, sign: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def _ms(values) -> str:
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return "—"
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def _interval(d: dict, digits: int = 3) -> str:
    if d.get("n", 0) < 2:
        return "—"
    return f"{_f(d['mean'], digits, True)} [{_f(d['low'], digits, True)}, {_f(d['high'], digits, True)}]"


def _level(alpha: float) -> str:
    return f"{round(100 * (1 - alpha), 2):g}%"


def plan_commit(results: Path) -> str | None:
    """The commit that added the plan's closing line to ``results`` (the plan commit), or None outside git."""
    try:
        out = subprocess.run(["git", "log", "--format=%h", "--reverse", "-S", PLAN_END, "--", results.name],
                             cwd=results.parent, capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    return out[0] if out else None


def plan_text(markdown: str) -> str:
    """The plan: the section's heading through its closing line, as written in ``markdown``."""
    start = markdown.index(SECTION)
    end = markdown.index(PLAN_END, start) + len(PLAN_END)
    return markdown[start:end]


def colour_word_table(run: dict, label: str, offsets=range(-3, 3)) -> list[str]:
    """Rows of the colour-word table for one run's test rollouts (``colour_word_gains``), one per style."""
    rows = []
    for style, name in (("look", "look"), ("guess", "guess"), ("other", "neither")):
        c = run["colour_word"].get(style, {})
        cells = []
        for k in offsets:
            o = c.get("offsets", {}).get(str(k)) or c.get("offsets", {}).get(k)
            cells.append(f"{o['mean']:+.3f} (`{o['token'].strip() or repr(o['token'])}`)" if o else "—")
        rows.append(f"| {label} | {name} | {c.get('rollouts', 0)} ({c.get('aligned', 0)}) | " + " | ".join(cells)
                    + f" | {_f(c.get('visual_gain'))} | {_f(c.get('guarded_visual_gain'))} |")
    return rows


def report(*, runs: list[dict], choice: dict | None, earlier: list[dict] | None, code: str, plan: str | None,
           earlier_code: str | None, minutes: float | None, workers: int, missing: list[str]) -> str:
    """The results, written below the plan's closing line."""
    L = ["", "### Results", ""]
    seeds = sorted({r["seed"] for r in runs})
    counts = {x: sum(r["variant"] == ARMS[x] for r in runs) for x in ARMS}
    same = plan is not None and code.startswith(plan)
    if minutes is None and runs and all("started_at" in r and "ended_at" in r for r in runs):
        minutes = (max(r["ended_at"] for r in runs) - min(r["started_at"] for r in runs)) / 60  # first start to last end
    L.append("Reproduce: `python -m benchmarks.look_or_guess replicate --work_dir DIR` (resumable), then "
             "`python -m benchmarks.look_or_guess replication-report --work_dir DIR --earlier EARLIER_DIR` rewrites "
             "these results (never the plan).")
    L += ["", f"Runs: code `{code}`; the plan commit `{plan or 'unknown'}`"
          + (" (the runs ran from that clean commit: the plan was committed before any of them)" if same else
             " (committed before the runs)") + f"; {sum(counts.values())} runs ("
          + ", ".join(f"{x} {n}" for x, n in counts.items()) + f"), seeds {seeds[0] if seeds else '—'} to "
          f"{seeds[-1] if seeds else '—'}" + (f"; {minutes:.1f} min on {workers} workers" if minutes else "")
          + (f"; missing: {', '.join(missing)}" if missing else "; nothing was cut from the plan") + "."]
    if choice and choice.get("guarded"):
        g = choice["guarded"]
        L += ["", f"Development split, before the runs ({choice.get('rollouts')} rollouts of the warm-up, counterfactual "
              f"`{choice.get('kind')}`): the largest token gain and what `guarded_visual_gain` pays (thresholds "
              f"{', '.join(f'{t:g}' for t in g['thresholds'])} nats).", "",
              "| style | n | largest token gain: 10% / 25% / 50% / 75% / 90% / 99% | share at 0 / 1/3 / 2/3 / 1 | "
              "mean reward |", "|---|---:|---|---|---:|"]
        for style, name in (("look", "look"), ("guess", "guess"), ("other", "neither")):
            x = g.get(style, {})
            if not x.get("n"):
                L.append(f"| {name} | 0 | — | — | — |")
                continue
            lv = x["levels"]
            shares = " / ".join(f"{lv.get(k, 0.0):.2f}" for k in ("0.0", "0.3333", "0.6667", "1.0"))
            L.append(f"| {name} | {x['n']} | {' / '.join(f'{q:.3f}' for q in x['quantiles'])} | {shares} | "
                     f"{_f(x['mean'])} |")
    L += ["", "Per arm (test split, 4 samples per prompt at T=1; mean ± sd over seeds):", "",
          "| arm | runs | conflict accuracy | non-conflict accuracy | clean format | neither-style share | "
          "guess rate (conflict rows) | look rate |", "|---|---:|---|---|---|---|---|---|"]
    for x, name in ARMS.items():
        rs = [outcomes(r) for r in runs if r["variant"] == name]
        L.append(f"| {LABELS[x]} | {len(rs)} | " + " | ".join(_ms([o[k] for o in rs]) for k in (
            "conflict", "plain", "clean", "neither", "guess", "look")) + " |")
    res = analyse(runs)
    L += ["", "Primary (conflict accuracy, paired by seed; Holm over the two: the comparison with the smaller "
          "sign-flip p at 0.025, the other at 0.05 only if the first is rejected):", "",
          "| comparison | Holm rank | level | mean difference [interval at the level] | sign-flip p (exact) | "
          "result |", "|---|---:|---:|---|---:|---|"]
    for x in "BC":
        p = res["primary"][x]
        L.append(f"| {x} vs A | {p['rank'] + 1} | {_level(p['alpha'])} | {_interval(p['difference'])} "
                 f"({p['difference']['n']} seeds) | {_f(p['p'], 4)} | "
                 f"{'shown' if p['shown'] else 'rejected, lower' if p['rejected'] else 'not shown'}: {p['text']} |")
    s = res["secondary"]
    L += ["", "Secondary (95% paired t intervals, not corrected for multiplicity):", "",
          "| comparison | conflict accuracy vs placebo | non-conflict accuracy (≥ -0.03?) | clean format (≥ -0.03?) | "
          "neither-style share | guess rate (conflict rows) | look rate |", "|---|---|---|---|---|---|---|"]
    for x in "BC":
        pl = _interval(res["placebo"]) if x == "C" else "(no placebo arm)"
        ni = [f"{_interval(s[x][o])} ({'holds' if s[x][o]['low'] >= -0.03 else 'fails'})" for o in ("plain", "clean")]
        L.append(f"| {x} vs A | {pl} | {ni[0]} | {ni[1]} | {_interval(s[x]['neither'])} | {_interval(s[x]['guess'])} "
                 f"| {_interval(s[x]['look'])} |")
    L += ["", "Verdicts, by the pre-registered rules (`benchmarks.stats.replication_verdict`):", ""]
    for x in "BC":
        v = res["verdicts"][x]
        L.append(f"- **{LABELS[x]}: {v['verdict']}** (rule {v['rule']}; " + "; ".join(v["reasons"]) + ").")
    pos = [r for r in runs if r.get("colour_word") and r["variant"] in (ARMS["B"], ARMS["C"])]
    if pos:
        L += ["", "Where the gain sits: per style, the mean per-token gain g_t (nats, counterfactual `none`) at each "
              "position counted from the colour word (0: the token before `</think>`, in every style; a text without "
              "`</think>` is not aligned), with the token most often there, and the mean reward each style earns, on "
              "the test rollouts of the first seed (computed inside the run; trained models are not kept):", "",
              "| run | style | rollouts (aligned) | -3 | -2 | -1 | 0: colour word | +1 | +2 | visual_gain pays | "
              "guarded_visual_gain pays |", "|---|---|---|---|---|---|---|---|---|---:|---:|"]
        for r in sorted(pos, key=lambda r: r["variant"] != ARMS["B"]):
            L += colour_word_table(r, f"{'B' if r['variant'] == ARMS['B'] else 'C'}, seed {r['seed']}")
    L += ["", "Per seed, conflict accuracy:", "", "| seed | " + " | ".join(ARMS) + " |",
          "|---:|" + "---:|" * len(ARMS)]
    for seed in seeds:
        L.append(f"| {seed} | " + " | ".join(_f(by_seed(runs, ARMS[x], "conflict").get(seed)) for x in ARMS) + " |")
    if earlier:
        L += restated_text(earlier, earlier_code)
    return "\n".join(L) + "\n"


def restated_text(runs: list[dict], code: str | None) -> list[str]:
    """The earlier section's verdicts under the corrected rules (its per-seed values, rerun from its recorded code
    version)."""
    base = by_seed(runs, "answer_format", "conflict")
    L = ["", "### The earlier section re-stated under the corrected rules", "",
         f"Its 30 runs rerun from its recorded code version (`{code or 'unknown'}`, a clean clone; answer + format "
         f"conflict accuracy {_ms(base.values())} as in its table), then tested as the plan above tests: Holm over "
         "its five comparisons with answer + format, a paired t interval and an exact sign-flip test agreeing, "
         "non-inferiority margins (lower 95% bound ≥ -0.03) instead of its absolute bars, the neither-style rule. "
         "With 5 seeds the sign-flip test cannot go below p = 0.0625, so no comparison can be shown at any Holm "
         "level: these are the corrected statements, not new results.", "",
         "| variant | Holm rank | level | Δ conflict [interval at the level] | sign-flip p | non-conflict Δ [95%] | "
         "clean Δ [95%] | neither-style Δ [95%] | verdict |", "|---|---:|---:|---|---:|---|---|---|---|"]
    for v, x in restate(runs).items():
        p = x["primary"]
        L.append(f"| {v} | {p['rank'] + 1} | {_level(p['alpha'])} | {_interval(p['difference'])} | {_f(p['p'], 4)} | "
                 f"{_interval(x['plain'])} | {_interval(x['clean'])} | {_interval(x['neither'])} | "
                 f"{x['verdict']['verdict']} |")
    return L


NOTE = "### Note added after the results: the per-seed figures depend on the machine"
"""The heading of the note below the results (issue 44), written by hand: rewriting the results keeps it."""


def write_results(results: Path, body: str) -> None:
    """Replace what follows the plan's closing line in ``results`` with ``body``; the plan, the :data:`NOTE` below the
    results (when there is one) and every other section stay as they are. Raises ValueError when the plan is not
    there (commit the plan first)."""
    text = results.read_text()
    if SECTION not in text or PLAN_END not in text:
        raise ValueError(f"{results} holds no pre-registered plan ({SECTION!r} ... {PLAN_END!r}): commit it first")
    start = text.index(SECTION)
    end = text.index(PLAN_END, start) + len(PLAN_END)
    nxt = text.find("\n## ", end)
    rest = "" if nxt < 0 else text[nxt:]
    region = text[end:] if nxt < 0 else text[end:nxt]
    note = region[region.index(NOTE):].rstrip("\n") + "\n" if NOTE in region else ""
    results.write_text(text[:end] + "\n" + body.rstrip("\n") + "\n" + ("\n" + note if note else "") + rest)
