"""Learning check: does MDIGRPOTrainer with the 4:1:1 reward stack actually teach a tiny VLM to read images?

    .venv/bin/python -m benchmarks.learning_curve            # full run, ~18 min on 2 shared CPU cores (1 thread)
    .venv/bin/python -m benchmarks.learning_curve --quick    # smoke run, ~2 min, 30 GRPO steps (no targets); prints only unless --write

Embedded default, fully offline: a ~1.2M-parameter Qwen2-VL built with `fixtures.tiny` (random weights, seed 0) and
the synthetic A-OKVQA colour questions (`fixtures.synthetic`, kinds=color, option_order=fixed: every question offers
A. red B. green C. blue D. yellow, the answer letters are balanced, so only the image can tell them apart). Held-out
accuracy is greedy generation on 200 validation questions the model never trains on, scored with the reward's
own parser (`fixtures.warmup.evaluate_accuracy`), every `--eval_every` GRPO steps. Runs, in this order:

    warm-up + GRPO            SFT warm-up (trl.SFTTrainer, 200 labelled examples, `fixtures.warmup.warm_start`),
                              then MDIGRPOTrainer with mc_idx 4, think_format 1, mdi_balance 1; TPRL off
    warm-up + GRPO, TPRL on   the same warm-started weights, with entropy filtering, perception filtering and
                              trajectory reweighting all on
    blank images (control)    warm-up and GRPO on the same questions with blank images (synthetic blank_images),
                              scored on blank held-out images: must stay at chance
    pure GRPO, no warm-up     GRPO from the random model; expected to stall, `rewards/mc_idx/zero_spread_frac`
                              shows why (groups in which every rollout gets the same mc_idx reward teach nothing)

then the main and TPRL runs again with a second GRPO seed (same warm-up), so that their comparison is not one draw.
Recipe and why (from single-seed trials while this benchmark was built): the warm-up's reasoning text is a constant
("<think> image</think>"), so the letter is the model's own reading of the image and 6 SFT epochs stop near 0.6;
GRPO lr 3e-4 decays linearly to 0 (constant 3e-4 reached 1.0 and then oscillated down to 0.73);
mask_truncated_completions keeps cut-off completions out of the loss (without it the answer ran on as
"B B B B ..."); one torch thread (see --threads).

Outputs: benchmarks/learning_curve.png (accuracy, rewards, mean MDI and mc_idx zero-spread per step) and the section
"## Learning check" of benchmarks/RESULTS.md (only that section is replaced); `--json PATH` also dumps every
measured series. Every figure is measured in this run; nothing is carried over from earlier runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.results import replace_section, result_args, set_offline_env

set_offline_env()
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
# Idle OpenMP threads sleep instead of spinning: with --threads 2 on a shared machine, spinning threads that lose
# their core to another job made steps up to 35x slower in trials here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoProcessor  # noqa: E402
from transformers.trainer_callback import PrinterCallback, ProgressCallback  # noqa: E402

from benchmarks.callbacks import EvaluateEvery, every  # noqa: E402
from fixtures.tiny import save_tiny_vlm  # noqa: E402
from fixtures.warmup import WarmupRecipe, evaluate_accuracy, synthetic_dataset, warm_start  # noqa: E402
from trl_mdi.config import MDIGRPOConfig  # noqa: E402
from trl_mdi.diagnostics import ConsoleSummaryCallback  # noqa: E402
from trl_mdi.trainer import MDIGRPOTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Learning check"
CHANCE = 0.25
TARGET_ACC, TARGET_SECONDS, TARGET_GAIN, TARGET_BLANK = 0.90, 600.0, 0.30, 0.35

# Logged per GRPO step (TRL's metric names; attention/* and zero_spread_frac come from MDIGRPOTrainer).
STEP_KEYS = {
    "reward": "reward",
    "mc_idx": "rewards/mc_idx/mean",
    "think_format": "rewards/think_format/mean",
    "mdi_balance": "rewards/mdi_balance/mean",
    "mdi": "attention/mdi",
    "mc_idx_zero_spread": "rewards/mc_idx/zero_spread_frac",
    "clipped_ratio": "completions/clipped_ratio",
    "mean_length": "completions/mean_length",
}


@dataclasses.dataclass
class Settings:
    grpo_steps: int = 250
    eval_every: int = 10
    n_eval: int = 200
    n_grpo_pool: int = 2000
    seeds: tuple[int, ...] = (0, 1)  # GRPO seeds of the main and TPRL runs; the controls use the first
    learning_rate: float = 3e-4
    lr_scheduler_type: str = "linear"  # decays to 0 at the last step; constant 3e-4 oscillated (see RESULTS.md)
    reward_weights: tuple[float, float, float] = (4.0, 1.0, 1.0)  # mc_idx, think_format, mdi_balance
    per_device_train_batch_size: int = 32
    num_generations: int = 8
    max_completion_length: int = 8
    eval_max_new_tokens: int = 16


@dataclasses.dataclass
class Run:
    name: str
    kind: str  # "main", "tprl", "blank" or "pure"
    warmup: str  # "real", "blank" or "none"; "shared" once it reuses an earlier run's warm-up
    seed: int = 0
    blank: bool = False
    tprl: bool = False
    mask_truncated: bool = True
    warmup_acc: float | None = None
    warmup_seconds: float = 0.0
    warmup_info: dict | None = None
    start_acc: float = math.nan  # accuracy before GRPO (= warm-up accuracy, or the random model's)
    evals: list[dict] = dataclasses.field(default_factory=list)  # step, train_seconds, accuracy, ...
    steps: list[dict] = dataclasses.field(default_factory=list)  # per-step metrics (STEP_KEYS + tprl/*)
    grpo_seconds: float = 0.0
    eval_seconds: float = 0.0
    wall_seconds: float = 0.0
    load: tuple[float, float] = (math.nan, math.nan)
    final_eval: dict | None = None

    @property
    def key(self) -> str:
        return f"{self.kind}-s{self.seed}"


def recorder(run: Run, processor, held_out, settings: Settings, log) -> EvaluateEvery:
    """Held-out greedy accuracy every ``eval_every`` steps (its time kept out of the training time, summed in
    ``run.eval_seconds``) and per-step metrics, into ``run``."""

    def evaluate(model, step: int, elapsed: float) -> float:
        result = evaluate_accuracy(model, processor, held_out, max_new_tokens=settings.eval_max_new_tokens)
        run.eval_seconds += result.seconds
        run.evals.append(_eval_row(step, elapsed, result))
        log(f"  [{run.key}] step {step:4d}  {elapsed:6.1f} s  {result.summary()}  e.g. {result.completions[0]!r}")
        return result.seconds

    def record_step(step: int, logs: dict) -> None:
        row = {"step": step}
        for short, key in STEP_KEYS.items():
            row[short] = logs.get(key, math.nan)
        row.update({k: v for k, v in logs.items() if k.startswith("tprl/")})
        run.steps.append(row)

    return EvaluateEvery(evaluate, every(settings.eval_every), record_step=record_step)


def _eval_row(step: int, train_seconds: float, r) -> dict:
    return {"step": step, "train_seconds": round(train_seconds, 2), "accuracy": r.accuracy, "format": r.format_rate,
            "clean": r.clean_rate, "answered": r.answered_rate, "letters": r.letters,
            "example": r.completions[0] if r.completions else ""}


def grpo_config(run: Run, s: Settings, out: Path) -> MDIGRPOConfig:
    return MDIGRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True,
        seed=run.seed, max_steps=s.grpo_steps, logging_steps=1,
        per_device_train_batch_size=s.per_device_train_batch_size, num_generations=s.num_generations,
        max_completion_length=s.max_completion_length, learning_rate=s.learning_rate, lr_scheduler_type=s.lr_scheduler_type,
        beta=0.0, temperature=1.0, gradient_checkpointing=False, mask_truncated_completions=run.mask_truncated,
        reward_funcs=["mc_idx", "think_format", "mdi_balance"], reward_weights=list(s.reward_weights),
        compute_attention_metrics=True, realtime_rollout_logging=False, attention_map_every_n_steps=0,
        enable_entropy_filtering=run.tprl, enable_perception_filtering=run.tprl,
        enable_trajectory_reweighting=run.tprl,
    )


def run_grpo(run: Run, model_dir: Path, s: Settings, recipe: WarmupRecipe, work: Path, log) -> None:
    data = dict(seed=recipe.data_seed, kinds=recipe.kinds, option_order=recipe.option_order,
                image_size=recipe.image_size, blank_images=run.blank)
    held_out = synthetic_dataset(s.n_eval, split="validation", **data)
    # The GRPO prompt pool: labelled questions from another stream than the warm-up's 200 (seed + 1).
    pool = synthetic_dataset(s.n_grpo_pool, split="train", **{**data, "seed": recipe.data_seed + 1})
    processor = AutoProcessor.from_pretrained(model_dir)
    trainer = MDIGRPOTrainer(str(model_dir), args=grpo_config(run, s, work / f"grpo-{run.key}"), train_dataset=pool)
    for cb in (ConsoleSummaryCallback, PrinterCallback, ProgressCallback):  # keep the benchmark's output readable
        trainer.remove_callback(cb)
    start = evaluate_accuracy(trainer.model, processor, held_out, max_new_tokens=s.eval_max_new_tokens)
    run.start_acc = start.accuracy
    run.evals.append(_eval_row(0, 0.0, start))
    log(f"  [{run.key}] step    0  before GRPO: {start.summary()}  e.g. {start.completions[0]!r}")
    callback = recorder(run, processor, held_out, s, log)
    trainer.add_callback(callback)
    trainer.train()
    run.grpo_seconds = callback.train_seconds()
    run.final_eval = run.evals[-1]


def execute(run: Run, s: Settings, recipe: WarmupRecipe, work: Path, shared: dict, log) -> None:
    log(f"== {run.name}")
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    if run.warmup in ("real", "blank"):
        r = dataclasses.replace(recipe, blank_images=run.blank)
        model_dir = work / f"warm-{run.warmup}"
        if run.warmup in shared:  # the warm-up does not depend on the GRPO seed: done once
            model_dir, info = shared[run.warmup]
            run.warmup = "shared"
        else:
            _, _, info = warm_start(r, model_dir, log=lambda m: log(f"  [{run.key}] {m}"))
            shared[run.warmup] = (model_dir, info)
        run.warmup_seconds, run.warmup_info = info["seconds"], info
    else:
        model_dir = save_tiny_vlm(recipe.arch, work / "random", seed=recipe.model_seed, overwrite=True,
                                  **recipe.model_size)
    run_grpo(run, model_dir, s, recipe, work, log)
    if run.warmup != "none":
        run.warmup_acc = run.start_acc
    run.wall_seconds = time.perf_counter() - t0
    run.load = (load0, os.getloadavg()[0])


# --------------------------------------------------------------------------------------------------- reporting


def first_reaching(run: Run, threshold: float) -> dict | None:
    """The first evaluation after step 0 at or above ``threshold``."""
    return next((e for e in run.evals if e["step"] > 0 and e["accuracy"] >= threshold), None)


def stays_above(run: Run, threshold: float) -> dict | None:
    """The first evaluation from which every later one, to the end of the run, is at or above ``threshold``."""
    hit = None
    for e in run.evals[1:]:
        hit = (hit or e) if e["accuracy"] >= threshold else None
    return hit


def _hit_cells(r: Run, hit: dict | None) -> str:
    return f"{hit['step']} ({r.warmup_seconds + hit['train_seconds']:.0f} s)" if hit else "never"


def tail_mean(run: Run, key: str, n: int = 50) -> float:
    vals = [r[key] for r in run.steps[-n:] if r.get(key) is not None and math.isfinite(r[key])]
    return statistics.fmean(vals) if vals else math.nan


def head_mean(run: Run, key: str, n: int = 20) -> float:
    vals = [r[key] for r in run.steps[:n] if r.get(key) is not None and math.isfinite(r[key])]
    return statistics.fmean(vals) if vals else math.nan


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def table(runs: list[Run]) -> list[str]:
    lines = [
        "| run | acc. before GRPO | final acc. | best acc. | first ≥ 0.90: step (warm-up + GRPO time) "
        "| ≥ 0.90 from then to the end: step (time) | GRPO gain (final − before) | final format / clean "
        "| mc_idx zero-spread (first 20 → last 50 steps) | mean MDI (first 20 → last 50) | warm-up s | GRPO s "
        "| wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        fin = r.final_eval or {}
        lines.append(
            f"| {r.name} | {_f(r.start_acc)} | {_f(fin.get('accuracy'))} | "
            f"{_f(max(e['accuracy'] for e in r.evals[1:]) if len(r.evals) > 1 else None)} | "
            f"{_hit_cells(r, first_reaching(r, TARGET_ACC))} | {_hit_cells(r, stays_above(r, TARGET_ACC))} | "
            f"{_f(fin.get('accuracy', math.nan) - r.start_acc, '+.3f')} | "
            f"{_f(fin.get('format'), '.2f')} / {_f(fin.get('clean'), '.2f')} | "
            f"{_f(head_mean(r, 'mc_idx_zero_spread'), '.2f')} → {_f(tail_mean(r, 'mc_idx_zero_spread'), '.2f')} | "
            f"{_f(head_mean(r, 'mdi'), '.2f')} → {_f(tail_mean(r, 'mdi'), '.2f')} | "
            f"{_f(r.warmup_seconds, '.0f')}{' (shared)' if r.warmup == 'shared' else ''} | "
            f"{_f(r.grpo_seconds, '.0f')} | {_f(r.wall_seconds, '.0f')} |"
        )
    return lines


def targets(runs: list[Run]) -> list[str]:
    out = []
    for main in [r for r in runs if r.kind == "main"]:
        first, held = first_reaching(main, TARGET_ACC), stays_above(main, TARGET_ACC)
        t = main.warmup_seconds + held["train_seconds"] if held else math.inf
        fin = main.final_eval["accuracy"]
        where = (f"first reached at step {first['step']} "
                 f"({main.warmup_seconds + first['train_seconds']:.0f} s), held from step {held['step']} "
                 f"({t:.0f} s) to the end" if held else "not held to the end of the run")
        out.append(f"- Held-out greedy accuracy ≥ {TARGET_ACC:.2f} within {TARGET_SECONDS / 60:.0f} min, warm-up "
                   f"included ({main.name}): {where}; final {fin:.3f} "
                   f"{'✓' if t <= TARGET_SECONDS and fin >= TARGET_ACC else '✗'}")
        gain = fin - main.start_acc
        out.append(f"- GRPO adds ≥ {TARGET_GAIN:.2f} over the warm-up ({main.name}): {main.start_acc:.3f} → {fin:.3f}, "
                   f"{gain:+.3f} {'✓' if gain >= TARGET_GAIN else '✗'}")
    for blank in [r for r in runs if r.kind == "blank"]:
        accs = [e["accuracy"] for e in blank.evals]
        fin = blank.final_eval["accuracy"]
        out.append(f"- Blank-image control ≤ {TARGET_BLANK:.2f}: final {fin:.3f}, max over all evaluations "
                   f"{max(accs):.3f} {'✓' if max(accs) <= TARGET_BLANK else '✗'}")
    return out


def plot(runs: list[Run], path: Path, weights) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"main": "tab:blue", "tprl": "tab:orange", "blank": "tab:gray", "pure": "tab:red"}
    panels = [
        ("accuracy", "held-out greedy accuracy"),
        ("reward", "total reward ({:g}·mc_idx + {:g}·think_format + {:g}·mdi_balance)".format(*weights)),
        ("mc_idx", "mc_idx reward (mean of the step's rollouts)"),
        ("think_format", "think_format reward"),
        ("mdi", "mean MDI (text vs image attention per token; < 1: image-dominant)"),
        ("mc_idx_zero_spread", "mc_idx zero-spread fraction of groups"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(16, 9.5))
    for ax, (key, title) in zip(axes.flat, panels):
        for r in runs:
            c = colours.get(r.kind)
            ls = "-" if r.seed == runs[0].seed else "--"
            if key == "accuracy":
                ax.plot([e["step"] for e in r.evals], [e["accuracy"] for e in r.evals], marker="o", ls=ls, ms=3,
                        color=c, label=r.name)
                continue
            xs = [row["step"] for row in r.steps]
            ys = [row.get(key, math.nan) for row in r.steps]
            ax.plot(xs, ys, color=c, alpha=0.15, lw=0.7, ls=ls)
            ax.plot(xs, _rolling(ys, 10), color=c, lw=1.6, ls=ls, label=r.name)
        if key == "accuracy":
            ax.axhline(CHANCE, ls=":", color="k", lw=1, label="chance (0.25)")
            ax.axhline(TARGET_ACC, ls="--", color="green", lw=1, label="target 0.90")
            ax.set_ylim(-0.02, 1.02)
            handles, labels = ax.get_legend_handles_labels()
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"trl_mdi learning check: tiny Qwen2-VL, synthetic colour questions, rewards "
                 f"{':'.join(f'{w:g}' for w in weights)} (thin: per step, thick: 10-step rolling mean; "
                 "step 0 = before GRPO)", fontsize=11)
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rolling(ys: list[float], w: int) -> list[float]:
    out = []
    for i in range(len(ys)):
        window = [y for y in ys[max(0, i - w + 1) : i + 1] if y is not None and math.isfinite(y)]
        out.append(statistics.fmean(window) if window else math.nan)
    return out


def report(runs: list[Run], s: Settings, recipe: WarmupRecipe, argv: list[str], started: float, png: Path,
           loads: tuple[float, float]) -> str:
    size = ", ".join(f"{k}={v}" for k, v in recipe.model_size.items())
    info = next((r.warmup_info for r in runs if r.warmup_info), None) or {}
    cmd = " ".join(["-m benchmarks.learning_curve", *map(shlex.quote, result_args(argv, OUTPUT_ONLY_FLAGS))])
    lines = [
        SECTION,
        "",
        f"Reproduce: `.venv/bin/python {cmd}` (from the repository root; {(time.time() - started) / 60:.1f} min "
        "for all runs below). Plot: [learning_curve.png](learning_curve.png).",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, `torch.set_num_threads({torch.get_num_threads()})`, "
        f"Python {platform.python_version()}. Load average (1 min) {loads[0]:.2f} at start, {loads[1]:.2f} at "
        "end: the machine is shared, so wall times include other users' load.",
        f"- Model: `fixtures.tiny` {recipe.arch}, seed {recipe.model_seed}, {size}; "
        f"{info.get('num_params', 0):,} parameters, float32, 4 image tokens per {recipe.image_size}x{recipe.image_size} image.",
        f"- Data: `fixtures.synthetic` kinds={','.join(recipe.kinds)}, option_order={recipe.option_order} (every "
        "question offers A. red B. green C. blue D. yellow; letters balanced), rows converted by the prep script's "
        "`convert_row`, system prompt `DEFAULT_SYSTEM_PROMPT`. Warm-up: the first "
        f"{recipe.n_train} rows of split train (seed {recipe.data_seed}); GRPO prompts: a {s.n_grpo_pool}-row "
        f"labelled pool of split train (seed {recipe.data_seed + 1}); held-out: {s.n_eval} rows of split validation "
        f"(seed {recipe.data_seed}), the same questions drawn blank for the control.",
        f"- Warm-up (`fixtures.warmup.warm_start`, `trl.SFTTrainer`, loss on the completion only): target "
        f"`<think> {recipe.think}</think>\\nAnswer: X`, {recipe.epochs:g} epochs, lr {recipe.learning_rate:g} "
        f"{recipe.lr_scheduler_type}, batch {recipe.batch_size}, seed {recipe.train_seed}"
        f"{', ' + str(info.get('sft_steps')) + ' steps' if info else ''}.",
        f"- GRPO (`MDIGRPOTrainer`): rewards mc_idx {s.reward_weights[0]:g}, think_format {s.reward_weights[1]:g}, "
        f"mdi_balance {s.reward_weights[2]:g}; per_device_train_batch_size "
        f"{s.per_device_train_batch_size} = {s.per_device_train_batch_size // s.num_generations} prompts x "
        f"{s.num_generations} generations per step, max_completion_length {s.max_completion_length}, lr "
        f"{s.learning_rate:g} {s.lr_scheduler_type}, beta 0, temperature 1, loss_type dapo (TRL default), "
        f"mask_truncated_completions true (pure GRPO: false, see below), {s.grpo_steps} steps, GRPO seeds "
        f"{' and '.join(map(str, s.seeds))} for the main and TPRL runs (same warm-up), {s.seeds[0]} for the controls, "
        "attention metrics on, live Markdown logs off. TPRL run: enable_entropy_filtering, "
        "enable_perception_filtering, enable_trajectory_reweighting (defaults: top-p 0.2 / 0.2, beta_min 0.8, "
        "patch_blackening).",
        f"- Evaluation: greedy, max_new_tokens {s.eval_max_new_tokens}, suppress_tokens=[image_token_id], every "
        f"{s.eval_every} GRPO steps; accuracy by the mc_idx reward's rule (`parse_mc_answer`: a hedged answer such as "
        "'Answer: A or B' is wrong). 'format': the lenient think format (any text after </think>); 'clean': the format "
        "the prompt asks, by think_format's own rule (one think block, then a final line 'Answer: X', nothing "
        "after it), then end of sequence. Times "
        "exclude the evaluations (they add "
        + ", ".join(f"{r.eval_seconds:.0f} s" for r in runs) + " to the runs, in table order).",
        "",
        *table(runs),
        "",
        "Targets:",
        "",
        *targets(runs),
        "",
    ]
    on, off = [r for r in runs if r.kind == "tprl"], [r for r in runs if r.kind == "main"]
    if on and off:
        def summary(rs: list[Run]) -> str:
            held = [stays_above(r, TARGET_ACC) for r in rs]
            return (f"mean final accuracy {statistics.fmean(r.final_eval['accuracy'] for r in rs):.3f}, "
                    f"≥ {TARGET_ACC:.2f} held to the end in {sum(h is not None for h in held)}/{len(rs)} runs (from "
                    f"steps {', '.join(str(h['step']) if h else 'never' for h in held)}), mean mc_idx reward over all "
                    f"steps {statistics.fmean(tail_mean(r, 'mc_idx', len(r.steps)) for r in rs):.3f}, mean GRPO "
                    f"time {statistics.fmean(r.grpo_seconds for r in rs):.0f} s")

        lines += [f"TPRL on vs off (GRPO seeds {', '.join(str(r.seed) for r in on)}): on: {summary(on)}; off: "
                  f"{summary(off)}.", ""]
    for pure in [r for r in runs if r.kind == "pure"]:
        lines += [
            f"Pure GRPO from random weights: accuracy {pure.start_acc:.3f} → {pure.final_eval['accuracy']:.3f}; "
            f"clipped (no end-of-sequence) completions {_f(head_mean(pure, 'clipped_ratio'), '.2f')} in the first 20 "
            f"steps → {_f(tail_mean(pure, 'clipped_ratio'), '.2f')} in the last 50; mc_idx reward "
            f"{_f(head_mean(pure, 'mc_idx'), '.2f')} → {_f(tail_mean(pure, 'mc_idx'), '.2f')}; mc_idx zero-spread "
            f"{_f(head_mean(pure, 'mc_idx_zero_spread'), '.2f')} → {_f(tail_mean(pure, 'mc_idx_zero_spread'), '.2f')} "
            "(the fraction of groups whose rollouts all get the same mc_idx reward, hence zero advantage from the "
            "accuracy term). It runs with mask_truncated_completions false: a random model almost never emits "
            "end-of-sequence within 8 tokens, so with masking on every completion would be dropped from the loss "
            "and nothing could change at all.",
            "",
        ]
    lines += [
        "Per-run evaluations (step: accuracy):",
        "",
        *(f"- {r.name}: " + ", ".join(f"{e['step']}: {e['accuracy']:.3f}" for e in r.evals)
          + f". Last greedy answer: {r.final_eval['example']!r}" for r in runs),
        "",
    ]
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------------- main


RUNS = {
    "main": lambda seed: Run(f"warm-up + GRPO (seed {seed})", "main", "real", seed),
    "tprl": lambda seed: Run(f"warm-up + GRPO, TPRL on (seed {seed})", "tprl", "real", seed, tprl=True),
    "blank": lambda seed: Run(f"blank images, control (seed {seed})", "blank", "blank", seed, blank=True),
    "pure": lambda seed: Run(f"pure GRPO, no warm-up (seed {seed})", "pure", "none", seed, mask_truncated=False),
}
OUTPUT_ONLY_FLAGS = ("--json", "--work_dir", "--png", "--results")


def plan(kinds: list[str], seeds: tuple[int, ...]) -> list[Run]:
    """Every run of the first seed, then the main and TPRL runs of the other seeds (the controls run once)."""
    runs = [RUNS[k](seeds[0]) for k in RUNS if k in kinds]
    runs += [RUNS[k](seed) for seed in seeds[1:] for k in ("main", "tprl") if k in kinds]
    return runs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 30 GRPO steps per run, 100 held-out questions; "
                   "prints only unless --write")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="which runs (default all)")
    p.add_argument("--steps", type=int, help="GRPO steps per run (default 250; --quick 30)")
    p.add_argument("--eval_every", type=int, help="GRPO steps between evaluations (default 10)")
    p.add_argument("--n_eval", type=int, help="held-out questions (default 200; --quick 100)")
    p.add_argument("--learning_rate", type=float, help="GRPO learning rate (default 3e-4)")
    p.add_argument("--lr_scheduler_type", help="GRPO lr schedule (default linear)")
    p.add_argument("--prompts_per_step", type=int, help="prompts per GRPO step (default 4)")
    p.add_argument("--num_generations", type=int, help="completions per prompt (default 8)")
    p.add_argument("--reward_weights", type=float, nargs=3, metavar=("MC_IDX", "THINK_FORMAT", "MDI_BALANCE"),
                   help="weights of the 3 rewards (default 4 1 1)")
    p.add_argument("--seeds", type=int, nargs="+", help="GRPO seeds of the main and TPRL runs (default 0 1; --quick "
                   "0); the controls use the first. Warm-up and model seeds are the recipe's (0)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: for this 1M-parameter model a second thread gains at most ~1.5x "
                   "when the machine is idle and loses up to 35x when other jobs share the cores)")
    p.add_argument("--work_dir", help="keep models and trainer output here (default: a temporary folder)")
    p.add_argument("--json", help="also write every measured series to this JSON file")
    p.add_argument("--png", default=str(ROOT / "benchmarks" / "learning_curve.png"))
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="write the PNG and the RESULTS.md section (default unless --quick)")
    g.add_argument("--no-write", action="store_true", help="print only")
    a = p.parse_args(argv)
    s = Settings()
    if a.quick:
        s.grpo_steps, s.n_eval, s.seeds = 30, 100, (0,)
    s.seeds = tuple(a.seeds) if a.seeds else s.seeds
    s.grpo_steps = a.steps or s.grpo_steps
    s.eval_every = a.eval_every or s.eval_every
    s.n_eval = a.n_eval or s.n_eval
    s.learning_rate = a.learning_rate or s.learning_rate
    s.lr_scheduler_type = a.lr_scheduler_type or s.lr_scheduler_type
    s.num_generations = a.num_generations or s.num_generations
    s.per_device_train_batch_size = (a.prompts_per_step or s.per_device_train_batch_size // 8) * s.num_generations
    s.reward_weights = tuple(a.reward_weights) if a.reward_weights else s.reward_weights
    write = a.write or not (a.quick or a.no_write)

    torch.set_num_threads(a.threads)
    transformers.logging.set_verbosity_error()
    started = time.time()
    load_start = os.getloadavg()[0]

    def log(msg: str) -> None:
        print(f"[{time.time() - started:7.1f} s] {msg}", flush=True)

    recipe = WarmupRecipe()
    runs = plan(a.runs, s.seeds)
    with tempfile.TemporaryDirectory(prefix="learning_curve_") as tmp:
        work = Path(a.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        shared: dict[str, Any] = {}
        for run in runs:
            execute(run, s, recipe, work, shared, log)
    body = report(runs, s, recipe, argv, started, Path(a.png), (load_start, os.getloadavg()[0]))
    print("\n" + body)
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": dataclasses.asdict(s), "recipe": dataclasses.asdict(recipe),
                                            "runs": [dataclasses.asdict(r) for r in runs]}, indent=1, default=str))
    if write:
        plot(runs, Path(a.png), s.reward_weights)
        replace_section(SECTION, body, Path(a.results))
        print(f"wrote {a.png} and the section '{SECTION}' of {a.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
