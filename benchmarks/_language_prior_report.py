"""benchmarks/language_prior.py's report: the RESULTS.md section and the plot, from the runs' JSON records."""

from __future__ import annotations

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
from _results import result_args

SECTION = "## Language prior"
CHANCE = 0.25
HEAD, TAIL = 10, 20  # steps averaged for rollout metrics "before" (first) and "after" (last)
REWARD_NAMES = ("mc_idx", "think_format", "mdi_balance", "mdi_group")
OUTPUT_ONLY_FLAGS = ("--work_dir", "--png", "--results")


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
    """Mean over all steps of ``rewards/<reward>_reward/zero_spread_frac`` (NaN when the run lacks that reward)."""
    return _mean(r.get(f"rewards/{reward}_reward/zero_spread_frac") for r in run["steps"])


def by_variant(runs: list[dict], variants: dict) -> dict[str, list[dict]]:
    out = {name: sorted([r for r in runs if r["variant"] == name], key=lambda r: r["seed"]) for name in variants}
    return {k: v for k, v in out.items() if v}


def warmup_lines(warm: dict) -> list[str]:
    w, b = warm["eval"], warm["eval_blank"]
    return [
        "| warm-up model | conflict acc. | non-conflict acc. | conflict rows answered with the prior | blank images: "
        "non-conflict acc. | blank images: conflict acc. | MDI all (conflict / non-conflict rows) | MDI late |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| after {warm['sft_steps']} SFT steps | {w['conflict']:.3f} | {w['plain']:.3f} | {w['prior_follow']:.3f} | "
        f"{b['plain']:.3f} | {b['conflict']:.3f} | {w['mdi_all']:.3f} ({_f(w['mdi_all_conflict'])} / "
        f"{_f(w['mdi_all_plain'])}) | {w['mdi_late']:.3f} |",
    ]


def variant_table(groups: dict[str, list[dict]], variants: dict) -> list[str]:
    lines = [
        "| variant | seeds | conflict acc. (end) | Δ conflict vs answer+format, paired by seed | non-conflict acc. "
        "(end) | conflict rows answered with the prior (end) | blank non-conflict acc. (end) | held-out MDI all: "
        "start → end | held-out MDI late: start → end | rollout MDI all: first 10 → last 20 steps | rollout MDI "
        "late | s / step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {r["seed"]: r["evals"][-1]["conflict"] for r in groups.get("answer_format", [])}
    for name, rs in groups.items():
        fin = [r["evals"][-1] for r in rs]
        start = rs[0]["evals"][0]
        deltas = [r["evals"][-1]["conflict"] - base[r["seed"]] for r in rs if r["seed"] in base]
        lines.append(
            f"| {variants[name].label} | {','.join(str(r['seed']) for r in rs)} | {spread([e['conflict'] for e in fin])}"
            f" | {'—' if name == 'answer_format' or not deltas else spread(deltas, '+.3f')} | "
            f"{spread([e['plain'] for e in fin])} | {spread([e['prior_follow'] for e in fin])} | "
            f"{spread([r['blank_final']['plain'] for r in rs])} | "
            f"{_f(start['mdi_all'])} → {spread([e['mdi_all'] for e in fin])} | "
            f"{_f(start['mdi_late'])} → {spread([e['mdi_late'] for e in fin])} | "
            f"{_f(_mean(step_mean(r, 'attention/mdi', True) for r in rs))} → "
            f"{_f(_mean(step_mean(r, 'attention/mdi', False) for r in rs))} | "
            f"{_f(_mean(step_mean(r, 'attention/mdi_late', True) for r in rs))} → "
            f"{_f(_mean(step_mean(r, 'attention/mdi_late', False) for r in rs))} | "
            f"{spread([r['grpo_seconds'] / max(1, r['evals'][-1]['step']) for r in rs], '.2f')} |"
        )
    return lines


def spread_table(groups: dict[str, list[dict]], variants: dict) -> list[str]:
    lines = ["| variant | " + " | ".join(f"{n} zero-spread (all steps)" for n in REWARD_NAMES)
             + " | mdi_balance reward: first 10 → last 20 steps | tprl/signal_rank_corr |",
             "|---|" + "---:|" * (len(REWARD_NAMES) + 2)]
    for name, rs in groups.items():
        cells = [spread([zero_spread(r, n) for r in rs], ".2f") if n in variants[name].rewards else "—"
                 for n in REWARD_NAMES]
        bal = ("—" if "mdi_balance" not in variants[name].rewards else
               f"{_f(_mean(step_mean(r, 'rewards/mdi_balance_reward/mean', True) for r in rs), '.2f')} → "
               f"{_f(_mean(step_mean(r, 'rewards/mdi_balance_reward/mean', False) for r in rs), '.2f')}")
        corr = _mean(x.get("tprl/signal_rank_corr") for r in rs for x in r["steps"])
        lines.append(f"| {variants[name].label} | " + " | ".join(cells) + f" | {bal} | {_f(corr, '.2f')} |")
    return lines


def curve_lines(groups: dict[str, list[dict]], variants: dict) -> list[str]:
    out = []
    for name, rs in groups.items():
        steps = sorted({e["step"] for r in rs for e in r["evals"]})
        cells = []
        for st in steps:
            vals = [e["conflict"] for r in rs for e in r["evals"] if e["step"] == st]
            cells.append(f"{st}: {_mean(vals):.3f}")
        per_seed = ", ".join(f"seed {r['seed']} {r['evals'][-1]['conflict']:.3f}" for r in rs)
        out.append(f"- {variants[name].label}: {', '.join(cells)} (final per seed: {per_seed})")
    return out


def verdict(groups: dict[str, list[dict]], variants: dict, warm: dict) -> list[str]:
    """The comparison in words, every number computed here: each variant's paired gain on conflict rows against
    answer + format only, set against the baseline's own seed-to-seed spread, and whether MDI saw the prior."""
    base = {r["seed"]: r["evals"][-1]["conflict"] for r in groups.get("answer_format", [])}
    if len(base) < 2:
        return []
    sd = statistics.stdev(base.values())
    parts, beyond = [], []
    for name, rs in groups.items():
        d = [r["evals"][-1]["conflict"] - base[r["seed"]] for r in rs if r["seed"] in base and name != "answer_format"]
        if d:
            parts.append(f"{variants[name].label} {statistics.fmean(d):+.3f} (better on {sum(x > 0 for x in d)}/"
                         f"{len(d)} seeds)")
            if abs(statistics.fmean(d)) > sd:
                beyond.append(variants[name].label)
    w = warm["eval"]
    mdis = [e["mdi_all"] for rs in groups.values() for r in rs for e in r["evals"] if math.isfinite(e["mdi_all"])]
    return [
        f"Paired by seed, final conflict-row accuracy minus answer + format only's: {'; '.join(parts)}. The "
        f"baseline's own seed-to-seed sd is {sd:.3f}: "
        + (f"mean gains beyond it: {', '.join(beyond)}." if beyond else "no variant's mean difference exceeds it."),
        "",
        f"Held-out MDI (all layers) of every evaluation of every run lies in {min(mdis):.3f}–{max(mdis):.3f}; the "
        f"warm-up's is {w['mdi_all_conflict']:.3f} on conflict rows and {w['mdi_all_plain']:.3f} on non-conflict "
        "rows, while its accuracy there is "
        f"{w['conflict']:.3f} and {w['plain']:.3f}.",
        "",
    ]


def report(runs: list[dict], warm: dict, s, recipe, variants: dict, argv: list[str], started: float, failed: list,
           load_end: float, workers: int) -> str:
    """The section "## Language prior" of RESULTS.md, every number from ``runs`` and ``warm``."""
    groups = by_variant(runs, variants)
    size = ", ".join(f"{k}={v}" for k, v in recipe.model_size.items())
    cmd = " ".join(["benchmarks/language_prior.py", *map(shlex.quote, result_args(argv, OUTPUT_ONLY_FLAGS))])
    measured = warm["seconds"] + sum(r["wall_seconds"] for r in runs)
    stamps = [warm.get("started_at")] + [r.get("ended_at") for r in runs]
    last = max([t for t in stamps[1:] if t is not None], default=time.time())
    span = (f"{(max(stamps[1:]) - stamps[0]) / 60:.1f} min from the warm-up's start to the last run's end, "
            if runs and None not in stamps else "")
    loads = [x for r in runs for x in r["load"]]
    steps = max((r["evals"][-1]["step"] for r in runs), default=0)
    lines = [
        SECTION,
        "",
        f"Reproduce: `.venv/bin/python {cmd}` (from the repository root). Wall time: {span}"
        f"this invocation {(time.time() - started) / 60:.1f} min (a resumed invocation reuses finished runs); the "
        f"warm-up and the runs' own times add up to {measured / 60:.1f} min. Plot: "
        "[language_prior.png](language_prior.png).",
        "",
        f"- Date (the last run's end): {datetime.datetime.fromtimestamp(last, datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, `torch.set_num_threads({torch.get_num_threads()})`, Python "
        f"{platform.python_version()}; {workers} run(s) at a time, each in its own process. Load average (1 min) over the runs {_f(min(loads, default=math.nan), '.2f')}"
        f"–{_f(max(loads, default=math.nan), '.2f')}, {load_end:.2f} at the end: the machine is shared.",
        f"- Model: `trl_mdi.tiny` {recipe.arch}, seed {recipe.model_seed}, {size}; {warm.get('num_params', 0):,} "
        f"parameters, float32, 4 image tokens per {recipe.image_size}x{recipe.image_size} image.",
        f"- Task: `trl_mdi.synthetic` kind prior_color, option_order {recipe.option_order} (A. red B. green C. blue "
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
        f"variant pays for the probe), GRPO seeds {', '.join(map(str, s.seeds))}. Rewards per variant: "
        + "; ".join(f"{v.label}: " + ", ".join(f"{n} {w:g}" for n, w in zip(v.rewards, v.weights))
                    + (f", TPRL (entropy + perception filtering, trajectory reweighting, VPPO defaults) with "
                       f"perception_signal={v.tprl!r}" if v.tprl else "")
                    for k, v in variants.items() if k in groups) + ". The perturbation variant also computes the "
        "attention signal (perception_signal_compare) to log `tprl/signal_rank_corr`; it filters and reweights by "
        "the perturbation signal only.",
        f"- Evaluation: greedy, max_new_tokens {s.eval_max_new_tokens}, every {s.eval_every} steps; accuracy by "
        "the mc_idx reward's parser. Held-out MDI: `measure_modality_attention` on prompt + greedy answer (text = "
        "every non-image prompt token, layers in thirds), mean over rows; rollout MDI: the trainer's "
        "`attention/mdi` / `attention/mdi_late` on the rollouts it trained on. s / step: the run's GRPO wall time "
        "per step without evaluations; it moves with the machine's load (other users' jobs, the other worker), so "
        "compare it across variants with care; TPRL with the perturbation signal runs one extra forward per step.",
        "",
        "Prior reliance of the shared warm-up (chance 0.25):",
        "",
        *warmup_lines(warm),
        "",
        "Variants (mean ± sd [min–max] over seeds; start = the warm-up's row above):",
        "",
        *variant_table(groups, variants),
        "",
        "Reward signal: `rewards/<name>/zero_spread_frac`, the fraction of groups whose rollouts all got the same "
        "value of that reward (no GRPO signal from it), mean over steps and seeds:",
        "",
        *spread_table(groups, variants),
        "",
        "Held-out conflict-row accuracy by step (mean over seeds):",
        "",
        *curve_lines(groups, variants),
        "",
        *verdict(groups, variants, warm),
    ]
    if failed:
        lines += ["Failed runs (not in the tables): " + "; ".join(f"{n} seed {sd}: {e}" for n, sd, e in failed), ""]
    return "\n".join(lines)


def plot(runs: list[dict], variants: dict, path: Path) -> None:
    """Conflict-row accuracy, non-conflict accuracy and held-out MDI vs step: one line per variant (mean over
    seeds) with the min–max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = by_variant(runs, variants)
    panels = [("conflict", "held-out accuracy, conflict rows"), ("plain", "held-out accuracy, non-conflict rows"),
              ("mdi_all", "held-out MDI of greedy answers (all layers)")]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    for ax, (key, title) in zip(axes, panels):
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
    handles, labels = axes[0].get_legend_handles_labels()
    fig.suptitle("trl_mdi language-prior benchmark: tiny Qwen2-VL, prior_color questions (line: mean over seeds, "
                 "band: min–max; dotted: chance)", fontsize=11)
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
