"""The profile's reliance section: a ``RelianceMeasurement`` (``trl_mdi.profile.reference``) summarised per
counterfactual kind, its Markdown, and one picture per signal (distributions per model).

Summary per kind, over the rows that have an image:

* accuracy with the image (rollout 0: the greedy answer, or the given completion's) and with the counterfactual (the
  blind answer: the greedy answer to the counterfactual prompt); their difference is MMStar's multimodal gain;
* same-answer rate: the share of rows whose rollout-0 answer (where one parses) the blind answer repeats;
* per-signal means over every rollout with a value;
* with gold answers, ``trl_mdi.profile.validation.signal_table`` against the general rule (prior-following: the answer is the
  blind answer and not the gold one; other: the answer is the gold one; any other wrong answer is left out), and,
  where rows carry their own prior label (``conflict`` + ``prior_idx``: :func:`data_prior_label`), against that
  label too, with ``label_agreement`` between the rule and the data. Groups are rows (GRPO's prompts).

The signals are the signal table's (``trl_mdi.signals``): every counterfactual entry the measurement carries
(``reliance_names``, in table order; a new entry appears in the summary, the Markdown and the pictures with no edit
here), its AUROC direction and its glossary line from the table, and the probe's ``mdi`` / ``mdi_<segment>`` beside
them. A signal without a direction (``Signal.direction`` None) gets its means and picture but no AUROC row.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import signals as S
from ..diagnostics.markdown import code_span, escape_inline
from .reference import RelianceMeasurement
from .validation import format_signal_table, label_agreement, prior_following, signal_table

_HOW_TO_READ_START = (
    "Each rollout (prompt + completion, teacher-forced) is scored with the real image I and with the counterfactual "
    "I' in plain no-grad forwards; g_t = log p(y_t | I) - log p(y_t | I') is the per-token visual gain (nats).")
_HOW_TO_READ_END = (
    "*Accuracy* is rollout 0's (greedy, or the given completion) against the gold letter; *with the counterfactual* "
    "it is the blind answer's (the greedy answer to the counterfactual prompt); *multimodal gain* = the difference "
    "(MMStar); *same answer* = share of rows whose answer the blind answer repeats. In the AUROC tables 1 = the "
    "signal ranks every prior-following rollout as more prior-following than every other, 0.5 = it does not see "
    "them; against the general rule, built from the blind answer, blind_agrees scores high by construction.")


def how_to_read(names: Sequence[str] | None = None) -> str:
    """The section's reading guide: how rollouts are scored, each counterfactual signal's glossary line (the table's
    ``help``; ``names`` default: every counterfactual signal of the table), and what the numbers mean."""
    names = S.reliance_names() if names is None else names
    lines = [f"**{n}**: {S.signal_of(n).help}." for n in names if S.signal_of(n) is not None]
    return " ".join([_HOW_TO_READ_START, *lines, _HOW_TO_READ_END])


def picture_file(name: str) -> str:
    """The file of a counterfactual signal's picture: ``reliance_<name>.png``."""
    return f"reliance_{name}.png"


def _kind_signals(m: RelianceMeasurement | Mapping[str, Any], kind: str) -> list[str]:
    """The counterfactual signals the rollouts carry for ``kind``, in table order."""
    rollouts = m.rollouts if isinstance(m, RelianceMeasurement) else m["rollouts"]
    carried = set().union(*(r["signals"].get(kind, {}) for r in rollouts)) if rollouts else set()
    return [n for n in S.reliance_names() if n in carried]


def data_prior_label(answer: str | None, gold: str | None, prior: str | None, conflict: bool | None) -> bool | None:
    """The data's own label of a rollout on a designed conflict row (the image contradicts what the wording suggests):
    True (prior-following) when it answers the prior's letter, False (image-following) when it answers the gold one,
    None otherwise (another letter, no answer, or not a conflict row).

    >>> [data_prior_label(answer, "A", "D", True) for answer in ("D", "A", "B")]
    [True, False, None]
    >>> data_prior_label("A", "A", "A", False) is None
    True
    """
    if not conflict or answer is None or gold is None or prior is None:
        return None
    return True if answer == prior else False if answer == gold else None


def _mean(values: Sequence[Any]) -> float | None:
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return sum(xs) / len(xs) if xs else None


def _rate(flags: Sequence[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def _finite(x: float) -> float | None:
    return None if x is None or math.isnan(x) else x


def summarize_reliance(m: RelianceMeasurement, *, n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """The numbers of the section (see the module doc); NaN and undefined values are None.

    Per kind: ``means`` of every counterfactual signal the rollouts carry (table order) and, with gold answers, the
    AUROC tables over those with a direction in the table (``trl_mdi.signals.direction``) and the probe's
    ``mdi*`` (``attention_means``: their means, the same for every kind)."""
    prompts = m.prompts
    imaged = [p for p in prompts if p["has_image"]]
    gold = [p for p in imaged if p["gold"] is not None]
    roll = [r for r in m.rollouts if prompts[r["prompt"]]["has_image"]]
    attention_names = [n for n in (roll[0] if roll else {}) if n.startswith("mdi")]
    groups = [r["prompt"] for r in roll]
    data = [data_prior_label(r["answer"], prompts[r["prompt"]]["gold"], prompts[r["prompt"]]["prior"],
                             prompts[r["prompt"]]["conflict"]) for r in roll]
    has_data = m.data_labels and any(d is not None for d in data)
    out: dict[str, Any] = {
        "rows": len(prompts), "rows_with_image": len(imaged), "rows_with_gold": len(gold), "rollouts": len(roll),
        "samples_per_row": m.samples, "skipped": len(m.skipped), "seconds": m.seconds,
        "data_labels": {"rollouts": sum(d is not None for d in data), "prior_following": sum(d is True for d in data)}
        if has_data else None,
        "attention_means": {n: _mean([r[n] for r in roll]) for n in attention_names}, "kinds": {}}
    for kind in m.kinds:
        answered = [p for p in imaged if p["answer"] is not None]
        acc_image = _rate([p["answer"] == p["gold"] for p in gold])
        acc_cf = _rate([p["blind"][kind] == p["gold"] for p in gold])
        names = _kind_signals(m, kind)
        means = {n: _mean([r["signals"][kind].get(n) for r in roll]) for n in names}
        # The AUROC tables: the probe's MDI and every counterfactual signal whose table entry says where
        # prior-following rollouts lie (the others have no orientation to score).
        directions = {n: S.direction(n) for n in [*attention_names, *names]}
        scored = {n: [r[n] for r in roll] for n in attention_names if directions[n] is not None}
        scored.update({n: [r["signals"][kind].get(n) for r in roll] for n in names if directions[n] is not None})
        directions = {n: directions[n] for n in scored}
        entry: dict[str, Any] = {
            "accuracy_image": acc_image, "accuracy_counterfactual": acc_cf,
            "multimodal_gain": None if acc_image is None else acc_image - acc_cf,
            "same_answer_rate": _rate([p["blind"][kind] == p["answer"] for p in answered]),
            "blind_answered": _rate([p["blind"][kind] is not None for p in imaged]),
            "means": means,
            "rule_table": None, "data_table": None, "agreement": None}
        if gold:
            raw = [prior_following(r["answer"], prompts[r["prompt"]]["blind"][kind], prompts[r["prompt"]]["gold"])
                   for r in roll]
            rule = [True if f else False if r["answer"] is not None and r["answer"] == prompts[r["prompt"]]["gold"]
                    else None for f, r in zip(raw, roll)]
            entry["rule_table"] = signal_table(scored, rule, groups, directions=directions, n_boot=n_boot, seed=seed)
            if has_data:
                entry["data_table"] = signal_table(scored, data, groups, directions=directions, n_boot=n_boot,
                                                   seed=seed)
                entry["agreement"] = label_agreement(raw, data)
        out["kinds"][kind] = entry
    return out


# ---------------------------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------------------------


def _f(value, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    text = format(value, spec)
    return text.replace("-", "+" if "+" in spec else "", 1) if float(text) == 0 else text


def render_reliance(models: Sequence[Mapping[str, Any]], settings: Mapping[str, Any]) -> list[str]:
    """The section's Markdown lines: settings, a summary table over models and kinds, the pictures, and per model and
    kind the AUROC tables (``models``: the report's model entries, each with ``reliance["summary"]``)."""
    # The labels are shown as text (trl_mdi.diagnostics.markdown), never as markup.
    entries = [(escape_inline(m["label"]), m["reliance"]["summary"]) for m in models if m.get("reliance")]
    if not entries:
        return []
    kinds = settings["counterfactual_image"]
    first = entries[0][1]
    # Columns: every counterfactual signal any model carries under any kind, in table order
    carried = {n for _, s in entries for k in s["kinds"].values() for n in k["means"]}
    names = [n for n in S.reliance_names() if n in carried]
    lines = ["## Reliance on the image", "",
             f"Counterfactual image(s): {', '.join(code_span(k) for k in kinds)} (drawn with seed {settings['seed']}, "
             f"step 0, row = the row's index) · {first['rows_with_image']} rows with an image "
             f"({first['rows_with_gold']} with a gold answer) × (1 + {settings['samples_per_row']} sampled) rollouts · "
             "completions "
             + ("from column " + repr(settings["completion_column"]) + " (rollout 0)"
                if settings["completion_column"] else f"of up to {settings['max_new_tokens']} tokens"), "",
             how_to_read(names), "",
             "| model | counterfactual | accuracy, image | accuracy, counterfactual | multimodal gain | same answer "
             "without the image | " + " | ".join(names) + " |",
             "|---|---|---:|---:|---:|---:|" + "---:|" * len(names)]
    for label, s in entries:
        for kind, k in s["kinds"].items():
            lines.append(f"| {label} | {code_span(kind)} | {_f(k['accuracy_image'])} | {_f(k['accuracy_counterfactual'])} | "
                         f"{_f(k['multimodal_gain'], '+.3f')} | {_f(k['same_answer_rate'])} | "
                         + " | ".join(_f(k["means"].get(n), _mean_format(n)) for n in names) + " |")
    mdi_names = list(first["attention_means"])
    if mdi_names:
        lines += ["", "Attention of the same rollouts (the counterfactual plays no part): means over rollouts.", "",
                  "| model | " + " | ".join(mdi_names) + " |", "|---|" + "---:|" * len(mdi_names)]
        lines += [f"| {label} | " + " | ".join(_f(s["attention_means"].get(n)) for n in mdi_names) + " |"
                  for label, s in entries]
    lines.append("")
    lines += [f"![{name} per model]({picture_file(name)})" for name in names]
    lines.append("")
    for label, s in entries:
        for kind, k in s["kinds"].items():
            if k["rule_table"] is None:
                continue
            lines += [f"### {label} · {code_span(kind)}: which signal sees prior-following rollouts", "",
                      "Against the general rule (prior-following: the answer is the blind answer and not the gold one; "
                      "other: the gold answer):", "", format_signal_table(k["rule_table"]), ""]
            if k["data_table"] is not None:
                a = k["agreement"]
                lines += ["Against the data's own label (conflict rows; prior-following: the prior's letter, other: "
                          f"the gold letter; {s['data_labels']['rollouts']} rollouts, "
                          f"{s['data_labels']['prior_following']} prior-following):", "",
                          format_signal_table(k["data_table"]), "",
                          f"The general rule against the data's label: agreement {_f(a['agreement'])}, Cohen's kappa "
                          f"{_f(a['kappa'])}, precision {_f(a['precision'])}, recall {_f(a['recall'])} over {a['n']} "
                          f"rollouts labelled by both (tp {a['tp']}, fp {a['fp']}, fn {a['fn']}, tn {a['tn']}).", ""]
    return lines


def _mean_format(name: str) -> str:
    """A signal's mean in the tables: a rate for a 0/1 flag (``Signal.flag``), a signed number otherwise."""
    signal = S.signal_of(name)
    return ".3f" if signal is not None and signal.flag else "+.4f"


def summary_line(label: str, summary: Mapping[str, Any]) -> list[str]:
    """What the command prints per model: accuracy with and without the image and the mean signals, per kind."""
    return [f"  {label}  reliance `{kind}`: accuracy {_f(k['accuracy_image'])} with the image, "
            f"{_f(k['accuracy_counterfactual'])} with the counterfactual (gain {_f(k['multimodal_gain'], '+.3f')}), "
            f"same answer {_f(k['same_answer_rate'])}"
            + "".join(f", {n} {_f(v, _mean_format(n))}" for n, v in k["means"].items())
            for kind, k in summary["kinds"].items()]


# ---------------------------------------------------------------------------------------------------------------
# Pictures
# ---------------------------------------------------------------------------------------------------------------


def signal_values(reliance: Mapping[str, Any], name: str, kind: str | None) -> list[float]:
    """One signal's finite values over the rollouts with an image (``kind`` None for the kind-independent ones);
    ``reliance``: a model's ``{"prompts", "rollouts"}`` (a ``RelianceMeasurement``'s, as the report holds them)."""
    prompts = reliance["prompts"]
    out = []
    for r in reliance["rollouts"]:
        if not prompts[r["prompt"]]["has_image"]:
            continue
        v = r["signals"].get(kind, {}).get(name) if kind is not None else r.get(name)
        if v is not None and math.isfinite(v):
            out.append(float(v))
    return out


def plot_distributions(panels: Mapping[str, Mapping[str, Sequence[float]]], path: str | Path, *, title: str,
                       ylabel: str, rate: bool = False) -> Path:
    """One panel per key of ``panels`` (a counterfactual kind), in each one box per model (``{model: values}``: the
    quartiles, whiskers at 1.5 IQR, the mean as a dot), or, with ``rate``, one bar per model of the values' mean (a
    0/1 signal); a dashed line at 0; the title wraps to the figure's width. Saves a PNG and returns ``Path(path)``."""
    from matplotlib.figure import Figure

    n = max(len(panels), 1)
    fig = Figure(figsize=(min(max(3.4 * n + 1.2, 5.0), 16.0), 4.0), dpi=100, layout="constrained")
    axes = fig.subplots(1, n, sharey=True, squeeze=False)[0]
    colours = [f"C{i}" for i in range(10)]
    for ax, (panel, per_model) in zip(axes, panels.items()):
        labels = list(per_model)
        for i, label in enumerate(labels):
            values = [float(v) for v in per_model[label] if math.isfinite(float(v))]
            colour = colours[i % len(colours)]
            if not values:
                ax.annotate("no value", (i + 1, 0), ha="center", fontsize=7, color="0.4")
                continue
            if rate:
                mean = sum(values) / len(values)
                ax.bar([i + 1], [mean], color=colour, width=0.6)
                ax.annotate(f"{mean:.2f}\n(n={len(values)})", (i + 1, mean), ha="center", va="bottom", fontsize=7)
            else:
                box = ax.boxplot([values], positions=[i + 1], widths=0.6, patch_artist=True, showfliers=True,
                                 medianprops={"color": "black"})
                for patch in box["boxes"]:
                    patch.set(facecolor=colour, alpha=0.45)
                ax.plot([i + 1], [sum(values) / len(values)], "o", color=colour, markersize=5)
        ax.axhline(0.0, color="0.35", linestyle="--", linewidth=1.0)
        ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=8, rotation=15 if len(labels) > 2 else 0)
        ax.set_xlim(0.4, len(labels) + 0.6)
        ax.set_title(panel, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel(ylabel)
    if rate:
        axes[0].set_ylim(0, 1.15)
    # About 11 characters of a 10-point title per inch: a long title (a glossary line) wraps inside the figure
    fig.suptitle(textwrap.fill(title, int(fig.get_figwidth() * 11)), fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _same_for_every_kind(models: Mapping[str, Mapping[str, Any]], name: str, kinds: Sequence[str]) -> bool:
    """Whether a signal has one value per rollout whatever the counterfactual (``answer_image_attention`` reads the
    probe over the real image only): then its picture has one panel, not one per kind."""
    if len(kinds) < 2:
        return False
    for reliance in models.values():
        for r in reliance["rollouts"]:
            values = [r["signals"].get(k, {}).get(name) for k in kinds]
            values = [None if v is None or math.isnan(float(v)) else float(v) for v in values]
            if any(v != values[0] for v in values):
                return False
    return True


def plot_reliance(models: Mapping[str, Mapping[str, Any]], kinds: Sequence[str], out: str | Path) -> dict[str, Path]:
    """The section's pictures in ``out``, one per counterfactual signal the rollouts carry (``picture_file``), titled
    with its glossary line: ``models`` maps each model's label to its ``{"prompts", "rollouts"}``. One panel per
    kind (one in all for a signal that is the same under every kind); a 0/1 flag is drawn as a rate."""
    out = Path(out)
    names = [n for n in S.reliance_names() if any(n in _kind_signals(r, k) for r in models.values() for k in kinds)]
    paths = {}
    for name in names:
        signal = S.signal_of(name)
        if _same_for_every_kind(models, name, kinds):
            panels = {"any counterfactual": {label: signal_values(r, name, kinds[0]) for label, r in models.items()}}
        else:
            panels = {f"counterfactual: {k}": {label: signal_values(r, name, k) for label, r in models.items()}
                      for k in kinds}
        file = picture_file(name)
        paths[file] = plot_distributions(panels, out / file, title=f"{name}: {signal.help}",
                                         ylabel="share of rollouts" if signal.flag else name, rate=signal.flag)
    return paths
