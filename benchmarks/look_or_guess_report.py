"""Look or guess (issue 30), the reports: the warm-up check's (printed) and the RESULTS.md section of the
experiment, from stored records only (no model)."""

from __future__ import annotations

import math
from collections import defaultdict

from benchmarks.look_or_guess_evaluation import (
    MIN_DETECTION_PAIRS,
    best_within_row,
    detection_tables,
    detection_verdict,
    steadiest_signal,
)
from benchmarks.look_or_guess_runs import code_label
from benchmarks.look_or_guess_task import TEST_SPLIT
from benchmarks.look_or_guess_variants import (
    BASELINE,
    DETECTION_SIGNALS,
    EXPECTED,
    GOAL_CLEAN,
    GOAL_CONFLICT_GAIN,
    GOAL_PLAIN,
    GOAL_WITHIN_AUROC,
    RELIANCE,
    ExperimentSettings,
    experiment_variants,
)
from benchmarks.results import result_args
from benchmarks.stats import format_paired_difference, paired_seed_difference, verdict
from fixtures.synthetic.look_or_guess import GUESS, LOOK, OTHER, STYLES
from trl_mdi.profile.validation import format_signal_table

SECTION = "## Look or guess"
OUTPUT_ONLY_FLAGS = ("--work_dir", "--results", "--workers")

def _f(x, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def report_warmup_check(result: dict, warm: dict | None = None) -> str:
    """The warm-up check as a short Markdown report."""
    m, g, s = result["sampled"], result["greedy"], result["settings"]
    lines = ["## Look or guess: warm-up check", ""]
    if warm:
        r = warm["recipe"]
        lines += [f"Warm-up: {r['n_train']} `look_or_guess` rows, conflict rate {r['conflict_rate']}, look share "
                  f"{r.get('look_share')}, styles redrawn every epoch, {r['epochs']:g} SFT epochs of the tiny "
                  f"{r['arch']} ({warm.get('num_params')} parameters), {warm.get('sft_steps')} steps in "
                  f"{warm.get('seconds')} s, mean loss {_f(warm.get('train_loss'))}.", ""]
    lines += [f"Held out: {m['prompts']} validation prompts (conflict rate {s['eval_conflict_rate']}) x {s['samples']} "
              f"completions sampled at temperature 1 ({m['rollouts']} rollouts), greedy beside; "
              f"{result['seconds']:.0f} s.", "",
              "| rows | n | look rate | guess rate | other | look: follows | look: accuracy | guess: follows | "
              "guess: answers prior | accuracy | clean |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, label in (("all", "all"), ("conflict", "conflict"), ("plain", "non-conflict")):
        x = m[name]
        lines.append(f"| {label} | {x['n']} | {_f(x['look_rate'])} | {_f(x['guess_rate'])} | {_f(x['other_rate'])} | "
                     f"{_f(x[LOOK]['follows'])} | {_f(x[LOOK]['accuracy'])} | {_f(x[GUESS]['follows'])} | "
                     f"{_f(x[GUESS]['answers_prior'])} | {_f(x['accuracy'])} | {_f(x['clean'])} |")
    d = m["conflict_decomposition"]
    lines += ["", f"Prompts whose {s['samples']} samples hold both styles: {_f(m['both_styles'])} (conflict "
              f"{_f(m['both_styles_conflict'])}, non-conflict {_f(m['both_styles_plain'])}). Conflict accuracy "
              f"{_f(m['conflict']['accuracy'])} = look {_f(d[LOOK])} + guess {_f(d[GUESS])} + other {_f(d[OTHER])} "
              "(rate x accuracy). Greedy: look rate "
              f"{_f(g['all']['look_rate'])} (conflict {_f(g['conflict']['look_rate'])}), conflict accuracy "
              f"{_f(g['conflict']['accuracy'])}, non-conflict {_f(g['plain']['accuracy'])}, clean {_f(g['all']['clean'])}.",
              "", "Goals: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in result["goals"].items()) + ".",
              "", f"Where the image enters: mean per-token gain log p(y_t | image) - log p(y_t | {s['counterfactual']} "
              "image) at each completion position counted from the end (clean rollouts; token: the most frequent "
              "one there, with its share).", "",
              "| position | look: token | look: mean gain | n | guess: token | guess: mean gain | n |",
              "|---:|---|---:|---:|---|---:|---:|"]
    p = result["positions"]
    positions = sorted(set(p[LOOK]["positions"]) | set(p[GUESS]["positions"]))
    for pos in positions:
        cells = []
        for st in STYLES:
            c = p[st]["positions"].get(pos)
            cells += ["", "", "0"] if c is None else [f"`{c['token']!r}` {c['token_share']:.2f}", f"{c['mean']:+.3f}",
                                                      str(c["n"])]
        lines.append(f"| {pos} | " + " | ".join(cells) + " |")
    lines += ["", "At the colour word (the token before `</think>`): look " + _f(p[LOOK]["colour_word"]) + ", guess "
              + _f(p[GUESS]["colour_word"]) + "; mean |gain| at every other position: look " + _f(p[LOOK]["elsewhere"])
              + ", guess " + _f(p[GUESS]["elsewhere"]) + ".", "",
              "| rows | style | n | visual_gain (mean) | visual_gain (sum) | answer_visual_gain |",
              "|---|---|---:|---:|---:|---:|"]
    for name, label in (("conflict", "conflict"), ("plain", "non-conflict")):
        for st in STYLES:
            x = result["signals"][name][st]
            lines.append(f"| {label} | {st} | {x['n']} | {_f(x['visual_gain'])} | {_f(x['visual_gain_sum'])} | "
                         f"{_f(x['answer_visual_gain'])} |")
    lines += ["", "Examples: " + "; ".join(f"{k}: `{v!r}`" for k, v in result["examples"].items() if v)]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ the report


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and isinstance(x, (int, float)) and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def _spread(xs, digits: int = 3) -> str:
    """``mean ± sd`` over seeds (sample sd; one value: the value)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return "—"
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return f"{m:.{digits}f} ± {sd:.{digits}f}"


def by_variant(runs: list[dict]) -> dict[str, list[dict]]:
    out = defaultdict(list)
    for r in runs:
        out[r["variant"]].append(r)
    return {k: sorted(v, key=lambda r: r["seed"]) for k, v in out.items()}


def variant_verdicts(groups: dict[str, list[dict]], metric: str = "conflict") -> dict[str, dict]:
    """Per variant other than the baseline: the paired difference of its final ``metric`` to the baseline's, seed by
    seed (``paired_seed_difference``), and ``benchmarks.stats.verdict`` with issue 30's goals (difference >= +0.30
    with the interval above 0, non-conflict >= 0.98, clean >= 0.9; means over seeds)."""
    base = {r["seed"]: r["final"][metric] for r in groups.get(BASELINE, [])}
    out = {}
    for name, rs in groups.items():
        if name == BASELINE:
            continue
        d = paired_seed_difference({r["seed"]: r["final"][metric] for r in rs}, base)
        plain = _mean(r["final"]["plain"] for r in rs)
        clean = _mean(r["final"]["clean"] for r in rs)
        v = verdict(d, min_effect=GOAL_CONFLICT_GAIN,
                    goals=[("non-conflict", plain, ">=", GOAL_PLAIN), ("clean format", clean, ">=", GOAL_CLEAN)])
        out[name] = {"difference": d, "verdict": v, "plain": plain, "clean": clean}
    return out


def trajectory(rs: list[dict], key: str = "rewards/look_rate/mean", window: int = 5) -> list[tuple[int, float]]:
    """The mean over seeds of a logged per-step metric, averaged over consecutive windows of ``window`` steps (one
    step holds only prompts_per_step x num_generations rollouts): ``[(last step of the window, mean), ...]``."""
    steps = max((len(r["steps"]) for r in rs), default=0)
    out = []
    for lo in range(0, steps, window):
        vals = [x.get(key) for r in rs for x in r["steps"][lo:lo + window]]
        out.append((min(lo + window, steps), _mean(vals)))
    return out


def _cell(x, digits: int = 3) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _auc_cell(row: dict | None, within: bool) -> str:
    if not row:
        return "—"
    k = "within_" if within else ""
    return f"{_cell(row.get(k + 'auroc'))} [{_cell(row.get(k + 'low'))}, {_cell(row.get(k + 'high'))}]"


def report(*, choice: dict | None, warm: dict | None, runs: list[dict], s: ExperimentSettings, recipe,
           argv: list[str], missing: list[str], failed: list[tuple[str, str]], code: dict, minutes: float | None,
           workers: int, threads: int, load: float | None = None, variants: dict | None = None) -> str:
    """The RESULTS.md section, from stored records only (no model): the design, the warm-up, the dev-split choice,
    per variant the held-out figures and paired verdicts, the look-rate trajectories, the detection tables and
    the goals, then what did not finish; one function per part, in that order."""
    groups = by_variant(runs)
    names = [n for n in s.variants if n in groups]
    variants = variants or experiment_variants(choice["form"] if choice else "visual_gain")
    verdicts = variant_verdicts(groups)
    models = ([("warm-up", warm)] if warm and warm.get("detection") else []) + [
        (f"{variants[r['variant']].label}, seed {r['seed']}", r) for n in names for r in groups[n] if r.get("detection")]
    tables = {label: detection_tables(rec["detection"]["records"], s.n_boot) for label, rec in models}
    L = [*header_lines(warm, runs, argv, code), *design_lines(s, recipe), *warmup_lines(warm, s),
         *choice_lines(choice, s), *expected_lines(s, variants),
         *variant_lines(groups, names, variants, verdicts, warm, s), *trajectory_lines(groups, names, variants),
         *detection_lines(models, tables, s), *goal_lines(names, variants, verdicts, models, tables, choice, s),
         *status_lines(runs, s, missing, failed, minutes, workers, threads, load)]
    return "\n".join(L).rstrip() + "\n"


def header_lines(warm: dict | None, runs: list[dict], argv: list[str], code: dict) -> list[str]:
    """The title, the command that reproduces the records and the code versions they came from."""
    L = []
    codes = sorted({code_label(r.get("code")) for r in runs + ([warm] if warm else [])})
    L = [SECTION, ""]
    args = result_args(argv, OUTPUT_ONLY_FLAGS)
    args = ["experiment" if a == "report" else a for a in args]  # the command that produces these records
    cmd = " ".join(["python -m benchmarks.look_or_guess", *args])
    L += [f"Reproduce: `{cmd}` (resumable: finished runs are JSON files in `--work_dir`; `report` rewrites this "
          "section from them). Code: " + ", ".join(f"`{c}`" for c in codes or [code_label(code)])
          + (f" (this report: `{code_label(code)}`)" if codes and code_label(code) not in codes else "") + ".", ""]
    return L


def design_lines(s: ExperimentSettings, recipe) -> list[str]:
    """The experiment's design, in one paragraph."""
    L = []
    L += ["Design (issue 30 items 2-3). Task: the prior-colour questions answered by a short chain of thought in one of "
          "two styles of equal length per object: *look* (`<think> the shape is red</think>`, the colour read off the "
          "image) or *guess* (`<think> a tomato is red</think>`, the object's usual colour), each rollout's style "
          "read from its own text (no model signal). Warm-up: "
          f"{recipe.n_train} rows, conflict rate {recipe.conflict_rate}, styles drawn afresh every epoch, "
          f"{recipe.epochs:g} SFT epochs of the tiny Qwen2-VL. GRPO (`MDIGRPOTrainer`) from it on training rows "
          f"WITHOUT conflicts ({s.n_pool}-row pool, conflict rate {s.pool_conflict_rate}: guessing is never wrong, "
          "so the answer and format rewards cannot tell the styles apart), "
          f"{s.steps} steps x {s.prompts_per_step} prompts x {s.num_generations} rollouts, lr {s.learning_rate}, "
          f"max_completion_length {s.max_completion_length}, counterfactual `{s.counterfactual}`, seeds "
          f"{', '.join(map(str, s.seeds))} for every variant (same steps, same seeds). Every run logs its rollouts' "
          "look rate per step (a zero-weight reward, `fixtures.synthetic.look_or_guess.look_rate`). Held out: the "
          f"TEST split (`{TEST_SPLIT}`, {s.n_test} prompts, conflict rate {s.test_conflict_rate}; nothing was chosen "
          f"on it), {s.eval_samples} completions per prompt sampled at temperature 1, greedy beside; on conflict rows "
          "only the look style is right. Choices were made on the DEVELOPMENT split (validation rows at the training "
          "conflict rate) or fixed in advance: the reward form (below), the clip (the registry's: 0.5 nats per token "
          "for the mean, 4 nats for the sum), weight 1 beside 4:1 (the default stack's), the counterfactual kind (below), "
          "the steps (the time budget).", ""]
    return L


def warmup_lines(warm: dict | None, s: ExperimentSettings) -> list[str]:
    """The warm-up model's figures on the test split."""
    L = []
    if warm:
        w = warm["eval"]["sampled"]
        g = warm["eval"]["greedy"]
        L += ["### Warm-up (test split, sampled at temperature 1)", "",
              "| rows | n | look rate | guess rate | other | look: accuracy | guess: accuracy | guess: answers prior | "
              "accuracy | clean |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for k, label in (("all", "all"), ("conflict", "conflict"), ("plain", "non-conflict")):
            x = w[k]
            L.append(f"| {label} | {x['n']} | {_cell(x['look_rate'])} | {_cell(x['guess_rate'])} | "
                     f"{_cell(x['other_rate'])} | {_cell(x[LOOK]['accuracy'])} | {_cell(x[GUESS]['accuracy'])} | "
                     f"{_cell(x[GUESS]['answers_prior'])} | {_cell(x['accuracy'])} | {_cell(x['clean'])} |")
        L += ["", f"Both styles among a prompt's {s.eval_samples} samples: {_cell(w['both_styles'])}. Greedy: look rate "
              f"{_cell(g['all']['look_rate'])}, conflict accuracy {_cell(g['conflict']['accuracy'])}, non-conflict "
              f"{_cell(g['plain']['accuracy'])}.", ""]
    else:
        L += ["Warm-up figures on the test split: not finished.", ""]
    return L


def choice_lines(choice: dict | None, s: ExperimentSettings) -> list[str]:
    """The development split's choice of the counterfactual kind and the reward's form."""
    L = []
    if choice and choice.get("tables"):
        L += ["### The counterfactual and the reward form, chosen on the development split", "",
              f"{choice['rollouts']} rollouts of the warm-up ({choice['prompts']} dev prompts x {s.dev_samples}, one "
              f"GRPO group each; look rate {_cell(choice['look_rate'])}, both styles in {_cell(choice['both_styles'])} "
              "of groups), each counterfactual kind's and form's reward against the style (look = positive):", "",
              "| counterfactual | form | clip | within-prompt AUROC of the reward [95% CI] (pairs) | of the raw gain | "
              "zero-spread groups | mean reward, look | mean reward, guess | look rollouts at the clip |",
              "|---|---|---:|---|---:|---:|---:|---:|---:|"]
        for kind, table in choice["tables"].items():
            for f, t in table.items():
                L.append(f"| {kind} | {f} | {t['clip']:g} | {_cell(t['within_auroc'])} [{_cell(t['low'])}, "
                         f"{_cell(t['high'])}] ({t['pairs']}) | {_cell(t['raw_within_auroc'])} | "
                         f"{_cell(t['zero_spread'])} | {_cell(t['reward_look'])} | {_cell(t['reward_guess'])} | "
                         f"{_cell(t['saturated_look'])} |")
        where = choice.get("where")
        if where:
            L += ["", "Where the image enters, on these rollouts (clean ones): mean per-token gain at the colour word "
                  f"(the token before `</think>`): look {_cell(where[LOOK]['colour_word'])}, guess "
                  f"{_cell(where[GUESS]['colour_word'])} nats; mean |gain| at every other position: look "
                  f"{_cell(where[LOOK]['elsewhere'])}, guess {_cell(where[GUESS]['elsewhere'])}."]
        L += ["", f"Chosen: counterfactual `{choice['kind']}`: {choice['why_kind']}; reward `{choice['form']}`: "
              f"{choice['why']}. TPRL's perturbation: `{choice['tprl_perturbation']}`.", ""]
    return L


def expected_lines(s: ExperimentSettings, variants: dict) -> list[str]:
    """Each variant's expected outcome, stated before the runs."""
    L = []
    L += ["### Expected outcomes, stated before the runs", ""]
    L += [f"- **{variants[n].label}**: {EXPECTED[n]}" for n in s.variants]
    L += [""]
    return L


def variant_lines(groups: dict[str, list[dict]], names: list[str], variants: dict, verdicts: dict, warm: dict | None,
                  s: ExperimentSettings) -> list[str]:
    """The held-out figures per variant, with the paired difference to the baseline and its verdict."""
    L = []
    L += [f"### Held-out figures per variant (test split, {s.eval_samples} samples per prompt at T=1; mean ± sd over "
          "seeds)", "",
          "| variant | seeds | conflict accuracy | = look rate x look accuracy | + guess rate x guess accuracy | "
          "non-conflict accuracy | clean format | look rate (all rows) | greedy: conflict / non-conflict | "
          "Δ conflict vs answer + format, paired [95% CI] | verdict |", "|---|---:|---|---|---|---|---|---|---|---|---|"]
    if warm:
        f = warm["final"]
        L.append(f"| warm-up (step 0) | — | {_cell(f['conflict'])} | {_cell(f['look_rate_conflict'])} x "
                 f"{_cell(f['look_acc_conflict'])} | {_cell(f['guess_rate_conflict'])} x {_cell(f['guess_acc_conflict'])}"
                 f" | {_cell(f['plain'])} | {_cell(f['clean'])} | {_cell(f['look_rate'])} | "
                 f"{_cell(f['greedy_conflict'])} / {_cell(f['greedy_plain'])} | | |")
    for n in names:
        rs = groups[n]
        fin = [r["final"] for r in rs]
        v = verdicts.get(n)
        L.append(f"| {variants[n].label} | {len(rs)} | {_spread([x['conflict'] for x in fin])} | "
                 f"{_spread([x['look_rate_conflict'] for x in fin], 2)} x {_spread([x['look_acc_conflict'] for x in fin], 2)}"
                 f" | {_spread([x['guess_rate_conflict'] for x in fin], 2)} x "
                 f"{_spread([x['guess_acc_conflict'] for x in fin], 2)} | {_spread([x['plain'] for x in fin])} | "
                 f"{_spread([x['clean'] for x in fin])} | {_spread([x['look_rate'] for x in fin])} | "
                 f"{_cell(_mean(x['greedy_conflict'] for x in fin))} / {_cell(_mean(x['greedy_plain'] for x in fin))} | "
                 + (f"{format_paired_difference(v['difference'])} | {v['verdict']['text']} |" if v else "baseline | |"))
    others = [(variants[n].label, r["eval"]["examples"][OTHER][0]) for n in names for r in groups[n][:1]
              if r.get("eval", {}).get("examples", {}).get(OTHER)]
    if others:
        L += ["", "Most frequent sampled text in neither style (the first seed's test rollouts, with its count): "
              + "; ".join(f"{lab}: `{t!r}` ({c})" for lab, (t, c) in others) + "."]
    L += ["", "Verdict: `benchmarks.stats.verdict`: \"shown\" only when the paired 95% t interval over seeds lies above 0, "
          f"the mean difference reaches +{GOAL_CONFLICT_GAIN:.2f}, non-conflict accuracy >= {GOAL_PLAIN} and clean "
          f"format >= {GOAL_CLEAN} (means over seeds). A mid-run evaluation: "
          + ("at step " + str(s.steps // 2) + " (in the run records)." if s.eval_mid else "none (cut for time)."), ""]
    return L


def trajectory_lines(groups: dict[str, list[dict]], names: list[str], variants: dict) -> list[str]:
    """The training rollouts' look rate per window of steps, and the rewards' zero-spread shares."""
    L = []
    if groups:
        traj = {n: trajectory(groups[n]) for n in names}
        ends = [e for e, _ in next(iter(traj.values()))]
        L += ["### Look rate of the training rollouts, per step (mean over seeds, windows of 5 steps)", "",
              "| variant | " + " | ".join(f"≤{e}" for e in ends) + " |", "|---|" + "---:|" * len(ends)]
        for n in names:
            L.append(f"| {variants[n].label} | " + " | ".join(_cell(v, 2) for _, v in traj[n]) + " |")
        L += ["", "Zero-spread share during training (groups of a step in which a reward ties; mean over steps and "
              "seeds): where answer and format tie, only the third reward can move the style.", "",
              "| variant | mc_idx | think_format | third reward |", "|---|---:|---:|---|"]
        for n in names:
            def zs(reward, rs=groups[n]):
                return _mean(x.get(f"rewards/{reward}/zero_spread_frac") for r in rs for x in r["steps"])
            third = variants[n].rewards[2] if len(variants[n].rewards) > 4 else None
            L.append(f"| {variants[n].label} | {_cell(zs('mc_idx'))} | {_cell(zs('think_format'))} | "
                     + (f"{third}: {_cell(zs(third))}" if third else "—") + " |")
        L += [""]
    return L


def detection_lines(models: list[tuple[str, dict]], tables: dict, s: ExperimentSettings) -> list[str]:
    """The detection tables: which signal tells the styles apart, on the warm-up and every measured model."""
    L = []
    if models:
        wl = models[0][0]
        t = tables[wl]
        L += ["### Which signal sees the style (the detection table)", "",
              f"Rollouts sampled at T=1 ({s.detect_samples} per prompt, first {s.detect_prompts} test prompts), every "
              "signal from plain forwards (`trl_mdi.profile.reference.measure_reliance`, counterfactual "
              f"`{s.counterfactual}`), against the style label: guess = positive (it follows the prior), look = "
              "negative, rollouts in neither style left out; one common set of rollouts per table (n per signal: "
              "before the restriction), prompts resampled for the 95% intervals, within-prompt AUROC over pairs of "
              "rollouts of the same prompt (what GRPO's groups can use). Oriented as the signal table says "
              "(`visual_gain` low = guess, MDI high = guess).", ""]
        for key, title in (("plain", "non-conflict rows (the detection goal)"), ("conflict", "conflict rows"),
                           ("conflict_answer", "conflict rows, against the language-prior answer label (the answer "
                            "is the object's usual colour)")):
            if key in t:
                L += [f"{wl}, {title}:", "", format_signal_table(t[key]), ""]
        if len(models) > 1:
            L += ["Every model, non-conflict rows: within-prompt AUROC [95% CI] (pooled AUROC below it in the "
                  "next table).", "", "| signal | " + " | ".join(lab for lab, _ in models) + " |",
                  "|---|" + "---|" * len(models)]
            for sig in DETECTION_SIGNALS:
                row = [next((r for r in tables[lab].get("plain", []) if r["signal"] == sig), None) for lab, _ in models]
                L.append(f"| {sig} | " + " | ".join(_auc_cell(r, True) for r in row) + " |")
            L += ["", "| signal (pooled AUROC) | " + " | ".join(lab for lab, _ in models) + " |",
                  "|---|" + "---|" * len(models)]
            for sig in DETECTION_SIGNALS:
                row = [next((r for r in tables[lab].get("plain", []) if r["signal"] == sig), None) for lab, _ in models]
                L.append(f"| {sig} | " + " | ".join(_auc_cell(r, False) for r in row) + " |")
            L += ["", "n (guess) on the common set: " + "; ".join(
                f"{lab}: {tables[lab]['plain'][0]['n']} ({tables[lab]['plain'][0]['n_prior']})"
                for lab, _ in models if tables[lab].get("plain")) + ".", ""]
    else:
        L += ["Detection table: not finished.", ""]
    return L


def goal_lines(names: list[str], variants: dict, verdicts: dict, models: list[tuple[str, dict]], tables: dict,
               choice: dict | None, s: ExperimentSettings) -> list[str]:
    """Issue 30's goals as they came out (training, detection, the controls), and what was tried where one missed."""
    L = []
    L += ["### Goals, as they came out", ""]
    reliance_names_ = [n for n in names if n not in (BASELINE, "answer_visual_gain", "tprl_counterfactual")]
    best = max((n for n in reliance_names_ if n in verdicts),
               key=lambda n: verdicts[n]["difference"]["mean"] if not math.isnan(verdicts[n]["difference"]["mean"])
               else -math.inf, default=None)
    if best:
        v = verdicts[best]
        L.append(f"- Training: best reliance variant **{variants[best].label}**: Δ conflict "
                 f"{format_paired_difference(v['difference'])} (goal >= +{GOAL_CONFLICT_GAIN:.2f}, interval above 0), "
                 f"non-conflict {_cell(v['plain'])} (goal >= {GOAL_PLAIN}), clean {_cell(v['clean'])} (goal >= "
                 f"{GOAL_CLEAN}): **{v['verdict']['text']}**.")
    else:
        L.append("- Training: no reliance variant with paired seeds finished.")
    for label, _ in models:
        row = best_within_row(tables[label].get("plain"))
        sig, a = (None, math.nan) if row is None else (row["signal"], row["within_auroc"])
        L.append(f"- Detection, {label}: best within-prompt AUROC on non-conflict rows {_cell(a)} ({sig}; goal >= "
                 f"{GOAL_WITHIN_AUROC}, its interval too, on >= {MIN_DETECTION_PAIRS} pairs): "
                 f"**{detection_verdict(row)}**.")
    if models:
        sig, worst = steadiest_signal({lab: tables[lab].get("plain") for lab, _ in models})
        every = len(models) > 1 and worst >= GOAL_WITHIN_AUROC
        L.append(f"- Detection, one signal on the warm-up and every trained model measured: {sig}, lowest "
                 f"within-prompt AUROC {_cell(worst)} over the {len(models)} models: **{'met' if every else 'not met'}**"
                 + ("" if len(models) > 1 else " (no trained model measured yet)") + ".")
    for n in ("answer_visual_gain", "tprl_counterfactual"):
        if n in verdicts:
            d = verdicts[n]["difference"]
            moved = d["n"] >= 2 and not (d["low"] <= 0.0 <= d["high"])
            L.append(f"- Control {variants[n].label}: Δ conflict {format_paired_difference(d)}; expected no "
                     "difference (rewards tie between the styles): "
                     + ("**not as expected: the interval excludes 0**." if moved else "as expected, none shown."))
    # The goals' lines that missed (the lines above these hold neither phrase).
    misses = [line for line in L if "not met" in line or "not shown" in line]
    if misses or not best:
        L.append(f"- Tried: reward `{choice['form'] if choice else RELIANCE}` ({choice['why'] if choice else 'no form'}), "
                 "clip the registry's (0.5 nats per token mean / 4 nats sum), weight 1 beside mc_idx 4 and "
                 f"think_format 1, counterfactual `{s.counterfactual}`, chains of 13 to 16 tokens (the two styles of "
                 f"equal length per object), {s.steps} steps at lr {s.learning_rate}; what the signals show is in the "
                 "look-rate trajectory (is the style moving?), the zero-spread share (does the reward tie inside "
                 "groups?) and the detection tables above (does the signal still separate the styles?).")
    L.append("")
    return L


def status_lines(runs: list[dict], s: ExperimentSettings, missing: list[str], failed: list[tuple[str, str]],
                 minutes: float | None, workers: int, threads: int, load: float | None) -> list[str]:
    """How many runs finished, their times, and what did not finish or failed."""
    L = []
    done_jobs = len(runs)
    L += [f"Runs finished: {done_jobs} of {len(s.variants) * len(s.seeds)}"
          + (f"; wall time {minutes:.1f} min on {workers} worker(s) x {threads} thread(s)" if minutes else "")
          + (f", load average {load:.1f} at the end" if load is not None else "")
          + (f"; step time median {_median([x for r in runs for x in r['step_seconds']]):.2f} s" if runs else "")
          + (f"; the runs' own wall times (GRPO, evaluation, detection) sum to "
             f"{sum(r.get('wall_seconds', 0.0) for r in runs) / 60:.1f} min" if runs else "")
          + "."]
    if missing:
        L.append("Not finished (rerun the command above to finish them): " + ", ".join(missing) + ".")
    if failed:
        L.append("Failed: " + "; ".join(f"{k}: {e}" for k, e in failed) + ".")
    return L


def _median(xs) -> float:
    xs = sorted(xs)
    if not xs:
        return math.nan
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2
