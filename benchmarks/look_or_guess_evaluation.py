"""Look or guess (issue 30), what is measured on a model: the development split's choice of the counterfactual
kind and the reward's form, the held-out figures of a trained model (style rates and accuracies), and the detection
table (which per-rollout signal tells the styles apart), with the verdicts on issue 30's detection goal.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict

from benchmarks.look_or_guess_task import (
    guarded_levels,
    label_rollouts,
    position_gains,
    sample_rollouts,
    score_rollouts,
    share,
    style_metrics,
)
from benchmarks.look_or_guess_variants import (
    DETECTION_SIGNALS,
    GAIN_FORMS,
    GOAL_WITHIN_AUROC,
    ExperimentSettings,
)
from fixtures.synthetic.look_or_guess import GUESS, LOOK, LOOK_OR_GUESS, OTHER, STYLES, read_style

# ------------------------------------------------------------------------------------ the choice (dev split)


def zero_spread_share(values, prompts) -> float:
    """Share of prompts whose rollouts all have the same value (GRPO's advantage from it is 0 there).

    >>> zero_spread_share([1.0, 1.0, 0.0, 0.5], [0, 0, 1, 1])
    0.5
    """
    groups = defaultdict(set)
    for v, p in zip(values, prompts):
        groups[p].add(round(float(v), 9))
    return share(len(g) == 1 for g in groups.values())


def gain_form_table(rollouts: list[dict], n_boot: int = 1000) -> dict:
    """Per form of the completion's gain (``visual_gain``: mean over tokens; ``visual_gain_sum``: sum), how well the
    REWARD it pays (clip(g, 0, G) / G, the registry's G) separates look from guess rollouts inside a prompt's group
    (``within_prompt_auroc``, look = positive, prompt-bootstrap interval), the raw gain's within-prompt AUROC, and
    the reward's zero-spread share over groups (every rollout of the group, either style or neither). ``rollouts``:
    labelled and scored (``label_rollouts``, ``score_rollouts``), sampled ones only."""
    from trl_mdi.profile.validation import HIGH, within_prompt_auroc
    from trl_mdi.rewards.functions import VISUAL_GAIN_CLIP, VISUAL_GAIN_SUM_CLIP

    clips = {"visual_gain": VISUAL_GAIN_CLIP, "visual_gain_sum": VISUAL_GAIN_SUM_CLIP}
    scored = [r for r in rollouts if r.get("gains") is not None]
    prompts = [r["prompt"] for r in scored]
    labels = [1 if r["style"] == LOOK else 0 if r["style"] == GUESS else None for r in scored]
    out = {}
    for form, clip in clips.items():
        raw = [r["visual_gain"] if form == "visual_gain" else sum(r["gains"]) for r in scored]
        reward = [min(max(g, 0.0), clip) / clip for g in raw]
        w = within_prompt_auroc(reward, labels, prompts, direction=HIGH, n_boot=n_boot)
        w_raw = within_prompt_auroc(raw, labels, prompts, direction=HIGH)
        look = [x for x, y in zip(reward, labels) if y == 1]
        guess = [x for x, y in zip(reward, labels) if y == 0]
        out[form] = {"clip": clip, "within_auroc": w["auroc"], "low": w["low"], "high": w["high"], "pairs": w["pairs"],
                     "prompts": w["prompts"], "raw_within_auroc": w_raw["auroc"],
                     "zero_spread": zero_spread_share(reward, prompts),
                     "reward_look": share(look), "reward_guess": share(guess),
                     "saturated_look": share(x >= 1.0 for x in look)}
    return out


def pick_gain_form(table: dict) -> tuple[str, str]:
    """The form with the higher within-prompt AUROC of its reward; within 0.005 of each other, the one with the
    smaller zero-spread share; still tied, the mean form (the registry's ``visual_gain``). Returns (form, why).

    >>> pick_gain_form({"visual_gain": {"within_auroc": 0.98, "zero_spread": 0.2},
    ...                 "visual_gain_sum": {"within_auroc": 0.99, "zero_spread": 0.1}})[0]
    'visual_gain_sum'
    >>> pick_gain_form({"visual_gain": {"within_auroc": 0.990, "zero_spread": 0.2},
    ...                 "visual_gain_sum": {"within_auroc": 0.992, "zero_spread": 0.2}})[0]
    'visual_gain'
    """
    a, b = table["visual_gain"], table["visual_gain_sum"]
    if abs(a["within_auroc"] - b["within_auroc"]) > 0.005:
        form = max(GAIN_FORMS, key=lambda f: table[f]["within_auroc"])
        return form, f"higher within-prompt AUROC of its reward ({table[form]['within_auroc']:.3f})"
    if abs(a["zero_spread"] - b["zero_spread"]) > 1e-9:
        form = min(GAIN_FORMS, key=lambda f: table[f]["zero_spread"])
        return form, (f"within-prompt AUROCs within 0.005 ({a['within_auroc']:.3f} vs {b['within_auroc']:.3f}); "
                      f"smaller zero-spread share ({table[form]['zero_spread']:.3f})")
    return "visual_gain", (f"tied on within-prompt AUROC ({a['within_auroc']:.3f} vs {b['within_auroc']:.3f}) and "
                           "zero-spread share: the mean form, the registry's default")


def pick_kind(tables: dict[str, dict], order: tuple[str, ...]) -> tuple[str, str]:
    """The counterfactual kind whose better reward form separates look from guess best inside groups (within-prompt
    AUROC of the reward); within 0.005 of the best, the smaller zero-spread share; still tied, the first in
    ``order`` (the trainer's default first). ``tables``: kind -> :func:`gain_form_table`. Returns (kind, why).

    >>> t = lambda a, z: {"visual_gain": {"within_auroc": a, "zero_spread": z},
    ...                   "visual_gain_sum": {"within_auroc": a, "zero_spread": z}}
    >>> pick_kind({"black": t(0.88, 0.0), "grey": t(0.99, 0.1), "none": t(0.992, 0.0)}, ("black", "grey", "none"))[0]
    'none'
    """
    if len(tables) == 1:  # one candidate (the kind was given): nothing to rank
        kind = next(iter(tables))
        return kind, "given by --counterfactual"
    best = {k: max(t[f]["within_auroc"] for f in GAIN_FORMS) for k, t in tables.items()}
    spread = {k: min(t[f]["zero_spread"] for f in GAIN_FORMS) for k, t in tables.items()}
    top = max(best.values())
    near = [k for k in order if k in tables and best[k] >= top - 0.005]
    kind = min(near, key=lambda k: (spread[k], order.index(k)))
    others = ", ".join(f"{k} {best[k]:.3f}" for k in order if k in tables and k != kind)
    return kind, (f"within-prompt AUROC of its reward {best[kind]:.3f} (others: {others or 'none'})"
                  + (f"; of the kinds within 0.005 of the best ({', '.join(near)}), the smallest zero-spread share "
                     f"({spread[kind]:.3f}) then the trainer's order" if len(near) > 1 else ""))


def choose_reward(model, processor, ds, s: ExperimentSettings, log=print) -> dict:
    """The development-split choice: ``s.dev_samples`` rollouts per dev prompt from the warm-up (one GRPO group),
    each labelled from its text and scored per token against every candidate counterfactual kind (``s.dev_kinds``
    when ``s.counterfactual`` is ``"auto"``, else that kind alone); per kind :func:`gain_form_table`; the kind by
    :func:`pick_kind`, the form by :func:`pick_gain_form` (``s.gain_form`` when given). TPRL's perturbation: the
    chosen kind, or the best pixel kind when the chosen one is ``"none"`` (TPRL perturbs an image)."""
    from trl_mdi.counterfactual import NO_IMAGE

    start = time.perf_counter()
    model.eval()
    rollouts = sample_rollouts(model, processor, ds, samples=s.dev_samples, max_new_tokens=s.max_completion_length,
                               seed=0, greedy=False)
    label_rollouts(rollouts, ds)
    kinds = tuple(s.dev_kinds) if s.counterfactual == "auto" else (s.counterfactual,)
    tables, scored = {}, {}
    for kind in kinds:
        rs = [dict(r) for r in rollouts]
        score_rollouts(model, processor, rs, ds, kind=kind)
        tables[kind], scored[kind] = gain_form_table(rs, s.n_boot), rs
        log(f"  dev split, counterfactual {kind}: " + "; ".join(
            f"{f}: within AUROC {t['within_auroc']:.3f}, zero spread {t['zero_spread']:.3f}"
            for f, t in tables[kind].items()))
    kind, why_kind = pick_kind(tables, kinds)
    form, why = (s.gain_form, "given by --gain_form") if s.gain_form != "auto" else pick_gain_form(tables[kind])
    pixel = [k for k in kinds if k != NO_IMAGE]
    tprl = kind if kind != NO_IMAGE else (pick_kind({k: tables[k] for k in pixel}, tuple(pixel))[0] if pixel
                                          else "black")
    m = style_metrics(rollouts)
    pos = position_gains(scored[kind], processor.tokenizer)
    guarded = guarded_levels(scored[kind], ds)
    log(f"  dev split: {len(rollouts)} rollouts, look rate {m['all']['look_rate']:.3f} -> counterfactual {kind}, "
        f"{form}; TPRL's perturbation {tprl}")
    return {"tables": tables, "kind": kind, "why_kind": why_kind, "form": form, "why": why, "tprl_perturbation": tprl,
            "rollouts": len(rollouts), "prompts": len(ds), "look_rate": m["all"]["look_rate"],
            "both_styles": m["both_styles"],
            "where": {st: {"colour_word": pos[st]["colour_word"], "elsewhere": pos[st]["elsewhere"],
                           "rollouts": pos[st]["rollouts"]} for st in STYLES},
            "guarded": guarded, "seconds": round(time.perf_counter() - start, 1)}


# ------------------------------------------------------------------------------------ held-out figures


def evaluate_styles(model, processor, ds, s: ExperimentSettings, seed: int = 0, keep: bool = False,
                    kind: str = LOOK_OR_GUESS) -> dict:
    """Held-out figures of one model on ``ds``: ``s.eval_samples`` completions per prompt at temperature 1 and the
    greedy one, labelled from their text (``kind``'s chains); ``sampled`` / ``greedy``: :func:`style_metrics`;
    ``records``: per rollout (prompt, sample, style, correct, clean, conflict) for recomputing."""
    start = time.perf_counter()
    was_training = model.training
    model.eval()
    try:
        rollouts = sample_rollouts(model, processor, ds, samples=s.eval_samples,
                                   max_new_tokens=s.max_completion_length, seed=seed)
    finally:
        model.train(was_training)
    label_rollouts(rollouts, ds, kind)
    return {"sampled": style_metrics([r for r in rollouts if r["sample"] > 0]),
            "greedy": style_metrics([r for r in rollouts if r["sample"] == 0]),
            "records": [[r["prompt"], r["sample"], r["style"], int(r["correct"]), int(r["clean"]), int(r["conflict"])]
                        for r in rollouts],
            # the most frequent sampled texts of each style: what a policy writes when it leaves both styles
            "examples": {st: Counter(r["text"] for r in rollouts if r["sample"] > 0 and r["style"] == st).most_common(3)
                         for st in (*STYLES, OTHER)},
            "seconds": round(time.perf_counter() - start, 1),
            **({"rollouts": rollouts} if keep else {})}  # with keep: the labelled rollouts (not saved)


def headline(ev: dict) -> dict:
    """The figures a variant is compared on, from :func:`evaluate_styles`: sampled conflict accuracy (and its
    decomposition), non-conflict accuracy, clean format, look rate (all rows), greedy conflict / non-conflict."""
    m, g = ev["sampled"], ev["greedy"]
    c = m["conflict"]
    return {"conflict": c["accuracy"], "plain": m["plain"]["accuracy"], "clean": m["all"]["clean"],
            "look_rate": m["all"]["look_rate"], "look_rate_conflict": c["look_rate"],
            "look_acc_conflict": c[LOOK]["accuracy"], "guess_rate_conflict": c["guess_rate"],
            "guess_acc_conflict": c[GUESS]["accuracy"], "other_rate_conflict": c["other_rate"],
            "greedy_conflict": g["conflict"]["accuracy"], "greedy_plain": g["plain"]["accuracy"],
            "greedy_look_rate": g["all"]["look_rate"]}


# ------------------------------------------------------------------------------------ detection


def detection_records(model, processor, ds, s: ExperimentSettings, seed: int = 0) -> dict:
    """Rollouts sampled from ``model`` on the first ``s.detect_prompts`` rows of ``ds`` (``s.detect_samples`` per
    prompt at temperature 1) and every per-rollout signal of :data:`DETECTION_SIGNALS` from plain forwards
    (``trl_mdi.profile.reference.measure_reliance``: the probe's MDI and the counterfactual pass against
    ``s.counterfactual``). One record per sampled rollout: ``prompt``, ``conflict``, ``style`` (its text's, the
    label), ``answers_prior`` and the signals (None where undefined)."""
    from trl_mdi.profile.reference import measure_reliance

    was_training = model.training
    model.eval()
    try:
        m = measure_reliance(model, processor, ds.select(range(min(s.detect_prompts, len(ds)))), [s.counterfactual],
                             samples=s.detect_samples, max_new_tokens=s.max_completion_length, batch_size=32,
                             seed=seed)
    finally:
        model.train(was_training)
    records = []
    for r in m.rollouts:
        if r["sample"] == 0:
            continue
        p = m.prompts[r["prompt"]]
        sig = r["signals"][s.counterfactual]
        values = {n: (r.get(n) if n.startswith("mdi") else sig.get(n)) for n in DETECTION_SIGNALS}
        records.append({"prompt": r["prompt"], "conflict": p["conflict"], "style": read_style(r["completion"]),
                        "answers_prior": r["answer"] is not None and r["answer"] == p["prior"],
                        **{n: None if v is None or (isinstance(v, float) and math.isnan(v)) else round(float(v), 6)
                           for n, v in values.items()}})
    return {"records": records, "seconds": round(m.seconds, 1), "prompts": len(m.prompts)}


def detection_tables(records: list[dict], n_boot: int = 1000, seed: int = 0) -> dict:
    """Per row kind (``plain``: non-conflict, the detection goal; ``conflict``), ``trl_mdi.profile.validation.signal_table``
    of every signal against the style label (guess = positive: it follows the prior; look = 0; other rollouts left
    out), on the common set of rollouts, prompts resampled; plus on conflict rows the same signals against the
    language-prior benchmark's answer label (``answer``: the answer is the object's usual colour)."""
    from trl_mdi.profile.validation import signal_table

    out = {}
    for name, keep in (("plain", False), ("conflict", True)):
        rs = [r for r in records if bool(r["conflict"]) == keep]
        if not rs:
            continue
        labels = [1 if r["style"] == GUESS else 0 if r["style"] == LOOK else None for r in rs]
        signals = {n: [math.nan if r.get(n) is None else r[n] for r in rs] for n in DETECTION_SIGNALS}
        out[name] = signal_table(signals, labels, [r["prompt"] for r in rs], n_boot=n_boot, seed=seed)
        if keep:
            answer = [1 if r["answers_prior"] else 0 for r in rs]
            out["conflict_answer"] = signal_table(signals, answer, [r["prompt"] for r in rs], n_boot=n_boot,
                                                  seed=seed)
    return out


def best_within(table: list[dict] | None) -> tuple[str | None, float]:
    """The signal with the highest within-prompt AUROC of a ``signal_table`` (NaN rows skipped)."""
    r = best_within_row(table)
    return (None, math.nan) if r is None else (r["signal"], r["within_auroc"])


def best_within_row(table: list[dict] | None) -> dict | None:
    """The ``signal_table`` row with the highest within-prompt AUROC (NaN rows skipped), or None."""
    rows = [r for r in table or [] if r.get("within_auroc") is not None and not math.isnan(r["within_auroc"])]
    return max(rows, key=lambda r: r["within_auroc"]) if rows else None


MIN_DETECTION_PAIRS = 20  # fewer look/guess pairs of one prompt than this: the prompt bootstrap cannot say much


def detection_verdict(row: dict | None, goal: float = GOAL_WITHIN_AUROC) -> str:
    """"met" only when the within-prompt AUROC's prompt-bootstrap interval lies at or above ``goal`` on at least
    ``MIN_DETECTION_PAIRS`` pairs; "too few pairs to tell" below that (a model that keeps 2 guessing rollouts gives
    a degenerate interval); else "not met".

    >>> detection_verdict({"within_auroc": 1.0, "within_low": 1.0, "within_pairs": 6})
    'too few pairs to tell (6 pairs)'
    >>> detection_verdict({"within_auroc": 0.982, "within_low": 0.959, "within_pairs": 223})
    'met'
    >>> detection_verdict({"within_auroc": 0.96, "within_low": 0.91, "within_pairs": 223})
    'not met (interval from 0.910)'
    """
    if row is None:
        return "not met (no pair)"
    if row.get("within_pairs", 0) < MIN_DETECTION_PAIRS:
        return f"too few pairs to tell ({row.get('within_pairs', 0)} pairs)"
    low = row.get("within_low", math.nan)
    if row["within_auroc"] >= goal and not math.isnan(low) and low >= goal:
        return "met"
    return "not met" if row["within_auroc"] < goal else f"not met (interval from {low:.3f})"


def steadiest_signal(tables: dict[str, list[dict] | None]) -> tuple[str | None, float]:
    """The signal whose LOWEST within-prompt AUROC over the models' tables is highest (the detection goal asks one
    signal to hold on the warm-up and on every trained model), with that lowest value; a model on which a signal
    has no pair (NaN), or a model whose table lacks it, counts as a miss for it. Ties go to the signal listed first.

    >>> steadiest_signal({"warm": [{"signal": "b", "within_auroc": 0.7}, {"signal": "a", "within_auroc": 0.9}],
    ...                   "run": [{"signal": "b", "within_auroc": 0.8}, {"signal": "a", "within_auroc": 0.7}]})
    ('b', 0.7)
    """
    # In the tables' own order (the detection signals'), not a set's: a set's order changes between processes, and
    # with it which of two tied signals max() named.
    names = list(dict.fromkeys(r["signal"] for table in tables.values() for r in table or []))
    scores = {n: math.inf for n in names}
    for table in tables.values():
        values = {r["signal"]: r.get("within_auroc") for r in table or []}
        for n in names:
            a = values.get(n)
            scores[n] = min(scores[n], -math.inf if a is None or math.isnan(a) else a)
    if not scores:
        return None, math.nan
    name = max(scores, key=scores.get)
    return name, scores[name] if math.isfinite(scores[name]) else math.nan
