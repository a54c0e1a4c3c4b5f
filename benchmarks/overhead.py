"""Step-time overhead of MDIGRPOTrainer over stock GRPOTrainer, measured side by side in one process.

    .venv/bin/python -m benchmarks.overhead            # completions of 32 and 128 tokens, ~10 min on 2 cores
    .venv/bin/python -m benchmarks.overhead --quick    # fewer rounds
    .venv/bin/python -m benchmarks.overhead --log_completions   # every variant writes TRL's completions table

Same tiny Qwen2.5-VL (built offline, deeper and wider than the test one), same synthetic A-OKVQA data, same seed
for every variant:

    stock          trl.GRPOTrainer; rewards mc_idx 4 + think_format 1
    metrics_only   MDIGRPOTrainer, attention metrics and live Markdown logs (maps every 10 steps) on, the same two
                   rewards: nothing reads the attention before the loss, so the probe measures inside TRL's
                   training forward (no extra forward)
    extra_forward  MDIGRPOTrainer with the default 4:1:1 stack (mc_idx, think_format, mdi_balance), logs on:
                   mdi_balance reads MDI before the loss, so the probe runs its one extra no-grad forward

With ``--log_completions`` every variant (stock too) writes TRL's completions table each step (``log_completions=True``,
the per-rollout signals as its columns): its own section, "Trainer overhead with log_completions".

Variants run in alternating rounds (stock, metrics_only, extra_forward, stock, ...) so that machine load hits them
alike. Per round and length, each variant's median step wall time (first step of each run dropped as warm-up) is
divided by stock's in the same round: the figure is the median of these paired ratios over rounds, with their
min-max. The section "Trainer overhead" of benchmarks/RESULTS.md is replaced with the table.

With vLLM generating (TRL's colocate mode on vLLM's CPU build, in the environment `make test-vllm` builds):

    .venv-vllm/bin/python -m benchmarks.overhead --vllm          # 4 seeds, 5-7 min on 2 shared cores

    stock          trl.GRPOTrainer as shipped; rewards mc_idx 4 + think_format 1
    stock_fixed    the same with the engine fixes MDIGRPOTrainer applies (fixtures.vllm_baseline): one image
                   placeholder per image in the engine's prompt, cached image features dropped before each weight
                   sync. Stock alone samples from a corrupted prompt and stale image features (trl_mdi.vllm_prompts),
                   so mdi / stock mixes the fixes' price with observing's; mdi / stock_fixed is observing's alone
    mdi            MDIGRPOTrainer built without reward_funcs: the default 4:1:1 stack (mc_idx, think_format,
                   mdi_balance), attention metrics and live logs on; mdi_balance reads MDI before the loss, and the
                   probe rides TRL's importance-sampling forward (no extra forward)

One run per variant and seed, the order rotating from seed to seed (seed k starts with the k-th variant); each run starts
its own engine (not timed) and times whole steps (from one step's start to the next one's: generation, weight sync,
scoring, loss, backward, optimizer, logging) after warm-up steps. The rollouts are the same only up to the first
update (mdi_balance changes the advantages). Each step is timed by the wall clock (the target's measure) and by the
process's CPU time (the colocated engine runs in this process), which other jobs' load disturbs less. Reported: the
ratio of the pooled median step times (and of their lower quartiles: the steps that waited least for a core) with a
bootstrap interval (steps resampled within each run), the per-seed ratios, the policy forwards per step counted by a
hook on the policy, and where each variant's step time goes. One torch thread (``--threads``). The section "Trainer
overhead under vLLM" of benchmarks/RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from benchmarks.results import replace_section, result_args, set_offline_env

set_offline_env()
if "--vllm" in sys.argv[1:]:
    # vLLM reads its environment once, at import, and TRL imports it with the trainer: set it before anything else.
    from fixtures import vllm_cpu

    vllm_cpu.set_env()
    # One thread for vLLM's own OpenMP kernels too (torch.set_num_threads covers torch's): see --threads.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402
from transformers import AutoConfig, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from benchmarks.stats import paired_seed_difference  # noqa: E402
from fixtures.synthetic import write_synthetic_aokvqa  # noqa: E402
from fixtures.tiny import save_tiny_vlm  # noqa: E402
from trl_mdi.aokvqa import prepare_aokvqa  # noqa: E402
from trl_mdi.config import MDIGRPOConfig, redeclared_grpo_fields  # noqa: E402
from trl_mdi.data import to_conversational  # noqa: E402
from trl_mdi.rewards import mc_idx, mdi_balance, think_format  # noqa: E402
from trl_mdi.trainer import MDIGRPOTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Trainer overhead: MDIGRPOTrainer vs GRPOTrainer"
VLLM_SECTION = "## Trainer overhead under vLLM: MDIGRPOTrainer vs GRPOTrainer"
MODEL = dict(num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=4, intermediate_size=768)
# GRPOConfig's values of the fields whose default MDIGRPOConfig sets (epsilon_high, mask_truncated_completions, ...):
# every arm, stock and ours, runs the same GRPO, as they did before MDIGRPOConfig carried its own defaults (issue 43).
STOCK_GRPO = {f.name: GRPOConfig.__dataclass_fields__[f.name].default for f in redeclared_grpo_fields()}


class StepTimer(TrainerCallback):
    """Wall and process CPU time of each training step (CPU time: what other jobs' load disturbs less), and the
    no-grad log-prob forwards of the policy in each (TRL's and the trainer's share GRPOTrainer's method, counted
    while ``counting()`` is on; generation's decoding forwards are not log-prob forwards)."""

    def __init__(self):
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.no_grad_forwards: list[int] = []

    @contextlib.contextmanager
    def counting(self):
        original = GRPOTrainer._get_per_token_logps_and_entropies
        timer = self

        def counted(trainer, model, *args, **kwargs):
            if timer.no_grad_forwards and not torch.is_grad_enabled() and model is trainer.model:
                timer.no_grad_forwards[-1] += 1
            return original(trainer, model, *args, **kwargs)

        GRPOTrainer._get_per_token_logps_and_entropies = counted
        try:
            yield self
        finally:
            GRPOTrainer._get_per_token_logps_and_entropies = original

    def on_step_begin(self, args, state, control, **kwargs):
        self.no_grad_forwards.append(0)
        self._t, self._cpu = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t)
        self.cpu_times.append(time.process_time() - self._cpu)


def tiny_model_and_data(work: Path):
    """The benchmark's tiny Qwen2.5-VL (``MODEL``) and its prepared synthetic colour questions, in chat form."""
    model_dir = save_tiny_vlm("qwen2_5_vl", work / "model", **MODEL)
    write_synthetic_aokvqa(work / "src", n_train=256, n_validation=8, n_test=8, seed=0, num_shards=1)
    prepare_aokvqa(work / "src", work / "prepared", log=lambda *x: None)
    dataset = load_dataset("parquet", data_files=str(work / "prepared" / "train.parquet"), split="train")
    return model_dir, dataset.map(to_conversational)


def run(variant: str, model_dir: Path, dataset, work: Path, steps: int, completion_length: int,
        log_completions: bool = False) -> tuple[list[float], list[float], list[int]]:
    """Wall and CPU step times (first step dropped) and no-grad log-prob forwards per step of one run of ``variant``."""
    common = dict(
        output_dir=str(work / variant), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=8,
        num_generations=4, max_completion_length=completion_length, max_steps=steps, logging_steps=1, save_strategy="no", seed=0,
        learning_rate=1e-5, disable_tqdm=True, gradient_checkpointing=False, log_completions=log_completions,
        **STOCK_GRPO,
    )
    rewards = [mc_idx, think_format]
    if variant == "stock":
        trainer = GRPOTrainer(str(model_dir), reward_funcs=rewards, args=GRPOConfig(**common, reward_weights=[4, 1]),
                              train_dataset=dataset)
    else:
        weights = [4.0, 1.0] if variant == "metrics_only" else [4.0, 1.0, 1.0]
        args = MDIGRPOConfig(
            **common, compute_attention_metrics=True, realtime_rollout_logging=True, reward_weights=weights,
            rollout_log_path=str(work / variant / "rollouts.md"),
            attention_diag_log_path=str(work / variant / "attention.md"),
        )
        if variant == "extra_forward":
            rewards = [*rewards, mdi_balance]
        trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=rewards, args=args, train_dataset=dataset)
        expected = "training_forward" if variant == "metrics_only" else "extra_forward"
        assert trainer.run_plan.placement == expected, (variant, trainer.run_plan.placement)
    timer = StepTimer()
    trainer.add_callback(timer)
    with timer.counting():
        trainer.train()
    if log_completions:
        assert (work / variant / "completions").is_dir(), "log_completions wrote no completions table"
    # the first step pays one-off costs (allocator, kernel selection)
    return timer.times[1:], timer.cpu_times[1:], timer.no_grad_forwards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Step times on this shared VM drift by tens of percent between minutes: many short alternating rounds, paired.
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per run (default 10, with --vllm too, after its --warmup steps)")
    parser.add_argument("--completion_lengths", type=int, nargs="+", default=None,
                        help="max_completion_length values to measure (the random model always writes all of them; "
                        "default 32 128; with --vllm one length, default 32)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 5 steps (with --vllm: 1 seed, 4 steps, prints only)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    parser.add_argument("--log_completions", action="store_true",
                        help="every variant writes TRL's completions table (log_completions=True); its own section")
    parser.add_argument("--vllm", action="store_true",
                        help="vLLM generating (colocate, CPU): stock GRPOTrainer vs MDIGRPOTrainer's default stack; "
                        "run with .venv-vllm/bin/python")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3],
                        help="with --vllm: one run per variant and seed, the order alternating")
    parser.add_argument("--warmup", type=int, default=2, help="with --vllm: untimed steps at the start of each run "
                        "(the first one also warms the engine up: 25-55 s on this machine)")
    parser.add_argument("--threads", type=int, default=1,
                        help="with --vllm: torch threads (default 1: on a loaded 2-core machine two threads made "
                        "steps 10-20x slower, each tiny kernel waiting on a descheduled partner thread)")
    a = parser.parse_args()
    if a.vllm:
        return main_vllm(a)
    a.steps = a.steps or 10
    a.completion_lengths = a.completion_lengths or [32, 128]
    if a.quick:
        a.rounds, a.steps = 2, 5
    torch.set_num_threads(2)
    started = time.time()
    variants = ("stock", "metrics_only", "extra_forward")
    times: dict[tuple[int, str], list[float]] = {(c, v): [] for c in a.completion_lengths for v in variants}
    forwards: dict[str, Counter] = {v: Counter() for v in variants}
    cpu_ratios: dict[tuple[int, str], list[float]] = {(c, v): [] for c in a.completion_lengths for v in variants}
    ratios: dict[tuple[int, str], list[float]] = {(c, v): [] for c in a.completion_lengths for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir, dataset = tiny_model_and_data(work)
        for r in range(a.rounds):
            for c in a.completion_lengths:
                medians, cpu = {}, {}
                for variant in variants:
                    t, t_cpu, counts = run(variant, model_dir, dataset, work / f"r{r}_c{c}", a.steps, c,
                                           a.log_completions)
                    forwards[variant].update(counts)
                    times[(c, variant)].extend(t)
                    medians[variant], cpu[variant] = statistics.median(t), statistics.median(t_cpu)
                    ratios[(c, variant)].append(medians[variant] / medians.get("stock", medians[variant]))
                    cpu_ratios[(c, variant)].append(cpu[variant] / cpu.get("stock", cpu[variant]))
                    print(f"round {r} completion {c} {variant:13s} median step {medians[variant]:.3f} s "
                          f"ratio {ratios[(c, variant)][-1]:.3f}", flush=True)

    def mark(c: int, v: str) -> str:
        if v == "stock":
            return ""
        target = 1.05 if v == "metrics_only" else 1.15
        return " ✓" if statistics.median(ratios[(c, v)]) <= target else " ✗"

    rows = [
        f"| {c} | {v} | {len(times[(c, v)])} | {statistics.median(times[(c, v)]):.3f} "
        f"| {statistics.median(ratios[(c, v)]):.3f}{mark(c, v)} | {min(ratios[(c, v)]):.3f} - {max(ratios[(c, v)]):.3f} "
        f"| {statistics.median(cpu_ratios[(c, v)]):.3f} |"
        for c in a.completion_lengths for v in variants
    ]
    lengths = " ".join(str(c) for c in a.completion_lengths)
    section = SECTION.replace(":", " with log_completions:") if a.log_completions else SECTION
    per_step = "; ".join(f"`{v}` " + ", ".join(f"{n} ({k} steps)" for n, k in sorted(forwards[v].items()))
                         for v in variants)
    body = "\n".join([
        section,
        "",
        f"Reproduce: `.venv/bin/python -m benchmarks.overhead{''.join(' ' + x for x in result_args(sys.argv[1:], ()))}`"
        " (from the repository root; "
        f"{(time.time() - started) / 60:.1f} min).",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"`torch.set_num_threads(2)`, Python {platform.python_version()}; load average (1 min) at the end "
        f"{os.getloadavg()[0]:.2f}.",
        f"- Model: tiny Qwen2.5-VL built offline ({', '.join(f'{k}={v}' for k, v in MODEL.items())}), float32, CPU.",
        f"- Run: per_device_train_batch_size 8, num_generations 4, max_completion_length {lengths} (the random model "
        "never stops early, so every completion has that length), lr 1e-5, no gradient checkpointing. Rewards: "
        "mc_idx 4 + think_format 1 for `stock` and `metrics_only`; the same + mdi_balance 1 for `extra_forward`.",
        f"- {a.rounds} alternating rounds x {a.steps} steps per variant and length; first step of each run dropped. "
        "Per round, median step time of the variant / stock's in the same round; the table gives the median of those "
        "paired ratios and their min - max over rounds. Targets: metrics_only <= 1.05, extra_forward <= 1.15.",
        *(["- `log_completions=True` in every variant, stock included: TRL's completions table written each step "
           "(parquet), with the per-rollout signals as columns in the MDIGRPOTrainer variants."]
          if a.log_completions else []),
        f"- No-grad log-prob forwards of the policy per training step (counted on GRPOTrainer's log-prob method, "
        f"which TRL's forwards and the trainer's share): {per_step}. CPU-time ratio: the same paired ratio of the "
        "process's CPU time per step, which other jobs' load disturbs less than wall time.",
        "",
        "| completion tokens | variant | steps | median step s | ratio to stock (median of rounds) | ratio min - max "
        "| CPU-time ratio to stock (median of rounds) |",
        "|---:|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "`metrics_only`: attention metrics and live logs on, no reward reads them: the probe measures inside TRL's "
        "training forward (`tests/test_training_forward_probe.py` checks: no extra forward, same masses, identical "
        "parameters). `extra_forward`: a reward reads MDI before the loss, so the probe runs one extra no-grad "
        "forward per generation batch (its LM head scores one position per row). The extra forward costs about "
        "what the training forward does, so its share of a step falls as generation grows with the completion "
        "length.",
        "",
    ])
    print(body)
    if not a.no_write:
        replace_section(section, body)


# ------------------------------------------------------------------------------------------------ vLLM (colocate)


def lower_quartile(values: list[float]) -> float:
    """The 25th percentile, interpolated between the sorted values (at position ``0.25 * (n - 1)``, counting from 0):
    on a loaded machine, the steps that waited least for a core."""
    values = sorted(values)
    if not values:
        raise ValueError("lower_quartile needs at least one value")
    position = 0.25 * (len(values) - 1)
    below = math.floor(position)
    above = min(below + 1, len(values) - 1)
    return values[below] + (position - below) * (values[above] - values[below])


def bootstrap_ratio(num_runs: list[list[float]], den_runs: list[list[float]], stat=statistics.median,
                    resamples: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``stat(pooled num) / stat(pooled den)`` (``stat``: the median by default).

    Each resample draws every run's values with replacement from that run alone (as many as it has), so every run
    keeps its share of the pool: the interval reflects the step-to-step spread inside runs, not a reshuffling of
    runs (a slow run stays one run). The bounds are the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of
    the resampled ratios (lower: the value at index ``floor(q * resamples)``, upper: ``ceil(q * resamples) - 1`` of
    the sorted ratios).
    """
    if not num_runs or not den_runs or not all(num_runs) or not all(den_runs):
        raise ValueError("bootstrap_ratio needs at least one run per side, each with at least one value")
    rng = random.Random(seed)

    def pooled(runs: list[list[float]]) -> float:
        return stat([x for run in runs for x in rng.choices(run, k=len(run))])

    ratios = sorted(pooled(num_runs) / pooled(den_runs) for _ in range(resamples))
    tail = (1 - level) / 2
    return ratios[math.floor(tail * resamples)], ratios[math.ceil((1 - tail) * resamples) - 1]


class StepProfile(TrainerCallback):
    """What each training step cost. ``starts`` / ``cpu_starts``: the wall clock and the process's CPU time (all its
    threads: the colocated engine runs in this process) when each step began; a step's time is the gap to the next
    one's start, so it holds everything the loop does for that step (generation, weight sync, scoring, loss,
    backward, optimizer, logging and the trainer's log files). CPU time counts the work done, wall time also the
    waits for a core other jobs hold. ``no_grad`` / ``grad``: the policy forwards a pre-hook on the policy module saw
    in the step, by grad mode. ``phases`` / ``cpu_phases``: wall / CPU seconds per step in the methods wrapped by
    :meth:`time_phase` (nested phases overlap: each is its own total)."""

    def __init__(self, model: torch.nn.Module):
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []
        self.no_grad: list[int] = []
        self.grad: list[int] = []
        self.phases: list[dict[str, float]] = []
        self.cpu_phases: list[dict[str, float]] = []
        self.completion_tokens: list[int] = []
        model.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        if self.starts:  # only forwards inside the training loop
            (self.grad if torch.is_grad_enabled() else self.no_grad)[-1] += 1

    def on_step_begin(self, args, state, control, **kwargs):
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())
        self.no_grad.append(0)
        self.grad.append(0)
        self.completion_tokens.append(0)
        self.phases.append(defaultdict(float))
        self.cpu_phases.append(defaultdict(float))

    def time_phase(self, owner, name: str, label: str, no_grad_only: bool = False) -> None:
        """Shadow ``owner.name`` with a wrapper adding its wall and CPU time to the current step's ``label``; with
        ``no_grad_only``, only calls made with grad off count (TRL's scoring forward, not the loss forward)."""
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.starts or (no_grad_only and torch.is_grad_enabled()):
                return method(*args, **kwargs)
            start, cpu_start = time.perf_counter(), time.process_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.phases[-1][label] += time.perf_counter() - start
                self.cpu_phases[-1][label] += time.process_time() - cpu_start

        setattr(owner, name, timed)

    def count_completion_tokens(self, vllm_generation) -> None:
        """Add the tokens each ``vllm_generation.generate`` call returns (TRL 1.16: (prompt_ids, completion_ids, ...))
        to the current step's count: generation time grows with them, and the variants' rollouts part after the
        first update, so a difference in generate time may be a difference in what was generated."""
        generate = vllm_generation.generate

        def counted(*args, **kwargs):
            out = generate(*args, **kwargs)
            if self.starts:
                self.completion_tokens[-1] += sum(len(ids) for ids in out[1])
            return out

        vllm_generation.generate = counted

    def timed_steps(self, warmup: int) -> list[int]:
        """Indices of the steps after ``warmup`` whose time is known (a next step started)."""
        return list(range(warmup, len(self.starts) - 1))

    def step_time(self, i: int, cpu: bool = False) -> float:
        starts = self.cpu_starts if cpu else self.starts
        return starts[i + 1] - starts[i]


VLLM_VARIANTS = ("stock", "stock_fixed", "mdi")
# (numerator, denominator, what the ratio shows): the target compares mdi with stock as shipped.
VLLM_RATIOS = (("mdi", "stock", "the target: MDIGRPOTrainer vs stock as shipped"),
               ("mdi", "stock_fixed", "observing's part: vs stock with the same engine fixes"),
               ("stock_fixed", "stock", "the engine fixes' part"))
# Phases of a step (labels of StepProfile.time_phase); "loop rest" = step time - generate and score - loss forward.
PHASES = ("generate and score", "  vLLM generate", "  weight sync", "  no-grad policy forward", "  rewards",
          "loss forward", "loop rest (backward, optimizer, logging)")


def run_vllm(variant: str, model_dir: Path, dataset, work: Path, seed: int, warmup: int, steps: int,
             completion_length: int) -> tuple[StepProfile, float]:
    """One run of ``warmup + steps + 1`` steps (the last one only closes the timing of the one before); returns its
    profile and the seconds the trainer took to build (model load and engine start, not timed as steps)."""
    # TRL keeps the image placeholder out of HF generate's samples (suppress_tokens) but not out of vLLM's; the
    # random tiny model samples it within a few steps, and the policy forward then fails ("Image features and image
    # tokens do not match"). Both variants get the same bias against it.
    image_token_id = AutoConfig.from_pretrained(model_dir).image_token_id
    common = dict(
        output_dir=str(work / variant), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=8,
        num_generations=4, max_completion_length=completion_length, max_steps=warmup + steps + 1, logging_steps=1,
        save_strategy="no", seed=seed, learning_rate=1e-5, disable_tqdm=True, gradient_checkpointing=False,
        generation_kwargs={"logit_bias": {image_token_id: -100.0}}, **vllm_cpu.VLLM_CPU_ARGS, **STOCK_GRPO,
    )
    # Imported here: it imports vLLM, which only --vllm runs have (set up by then: vllm_cpu.set_env at the top).
    from fixtures.vllm_baseline import PromptFixedGRPOTrainer

    start = time.perf_counter()
    if variant in ("stock", "stock_fixed"):
        cls = GRPOTrainer if variant == "stock" else PromptFixedGRPOTrainer
        trainer = cls(str(model_dir), reward_funcs=[mc_idx, think_format],
                      args=GRPOConfig(**common, reward_weights=[4, 1]), train_dataset=dataset)
    else:
        args = MDIGRPOConfig(**common, compute_attention_metrics=True, realtime_rollout_logging=True,
                             rollout_log_path=str(work / variant / "rollouts.md"),
                             attention_diag_log_path=str(work / variant / "attention.md"))
        trainer = MDIGRPOTrainer(str(model_dir), args=args, train_dataset=dataset)  # no reward_funcs: the default
        plan = trainer.run_plan
        stack = (plan.reward_names, tuple(plan.reward_weights or ()), str(plan.placement))
        assert stack == (("mc_idx", "think_format", "mdi_balance"), (4.0, 1.0, 1.0),
                         "trl_forward"), stack
    build_s = time.perf_counter() - start
    profile = StepProfile(trainer.model)
    trainer.add_callback(profile)
    profile.time_phase(trainer, "_generate_and_score_completions", "generate and score")
    profile.count_completion_tokens(trainer.vllm_generation)
    profile.time_phase(trainer.vllm_generation, "generate", "  vLLM generate")
    profile.time_phase(trainer.vllm_generation, "sync_weights", "  weight sync")
    profile.time_phase(trainer, "_get_per_token_logps_and_entropies", "  no-grad policy forward", no_grad_only=True)
    profile.time_phase(trainer, "_calculate_rewards", "  rewards")
    profile.time_phase(trainer, "compute_loss", "loss forward")
    trainer.train()
    del trainer  # one engine at a time: free this one before the next run builds its own
    gc.collect()
    return profile, build_s


def _run_in_child(threads: int, *args) -> tuple[StepProfile, float]:
    torch.set_num_threads(threads)
    vllm_cpu.install()
    return run_vllm(*args)


def run_isolated(threads: int, *args) -> tuple[StepProfile, float]:
    """:func:`run_vllm` in a fresh process of its own (spawned: it re-imports this module with the same argv, so the
    vLLM environment is set as here). Why: a finished run's engine was not freed in this process (its 1 GiB KV cache
    stayed: 24 runs exhausted the machine's memory and the 20th engine failed to start), and a fresh process also
    keeps one run's allocator and caches out of the next one's times."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run_in_child, threads, *args).result()


def main_vllm(a: argparse.Namespace) -> None:
    steps = a.steps or 10
    seeds = a.seeds
    if a.quick:
        steps, seeds = 4, seeds[:1]
        a.warmup = min(a.warmup, 2)
    if a.completion_lengths and len(a.completion_lengths) != 1:
        raise SystemExit("--vllm measures one completion length: pass one value to --completion_lengths")
    completion_length = (a.completion_lengths or [32])[0]
    torch.set_num_threads(a.threads)  # for the report's line; each run sets its own (run_isolated)
    import vllm

    started, load_start = time.time(), os.getloadavg()[0]
    runs: dict[str, list[StepProfile]] = {v: [] for v in VLLM_VARIANTS}
    builds: dict[str, list[float]] = {v: [] for v in VLLM_VARIANTS}
    loads: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir, dataset = tiny_model_and_data(work)
        for k, seed in enumerate(seeds):
            for j in range(len(VLLM_VARIANTS)):  # rotated: each variant runs first, second and last in turn
                variant = VLLM_VARIANTS[(k + j) % len(VLLM_VARIANTS)]
                loads.append(os.getloadavg()[0])
                profile, build_s = run_isolated(a.threads, variant, model_dir, dataset, work / f"s{seed}", seed,
                                                a.warmup, steps, completion_length)
                runs[variant].append(profile)
                builds[variant].append(build_s)
                t = [profile.step_time(i) for i in profile.timed_steps(a.warmup)]
                c = [profile.step_time(i, cpu=True) for i in profile.timed_steps(a.warmup)]
                every = " ".join(f"{profile.step_time(i):.2f}/{profile.step_time(i, cpu=True):.2f}"
                                 for i in range(len(profile.starts) - 1))
                print(f"seed {seed} {variant:11s} median step {statistics.median(t):.3f} s wall, "
                      f"{statistics.median(c):.3f} s CPU over {len(t)} timed steps (build {build_s:.0f} s, load "
                      f"{loads[-1]:.2f}; every step's wall/CPU s, warm-up first: {every})", flush=True)
    load_end = os.getloadavg()[0]

    def times(profile: StepProfile, cpu: bool = False) -> list[float]:
        return [profile.step_time(i, cpu) for i in profile.timed_steps(a.warmup)]

    def median_of(v: str, cpu: bool = False) -> float:
        return statistics.median(x for p in runs[v] for x in times(p, cpu))

    def ratio_row(num: str, den: str, cpu: bool, stat) -> str:
        ratio = stat([x for p in runs[num] for x in times(p, cpu)]) / stat([x for p in runs[den] for x in times(p, cpu)])
        lo, hi = bootstrap_ratio([times(p, cpu) for p in runs[num]], [times(p, cpu) for p in runs[den]], stat)
        per_seed = [stat(times(m, cpu)) / stat(times(s, cpu)) for m, s in zip(runs[num], runs[den])]
        # Over seeds: the runs' own spread (engine start, machine load) that resampling steps within a run misses.
        d = paired_seed_difference([math.log(stat(times(p, cpu))) for p in runs[num]],
                                   [math.log(stat(times(p, cpu))) for p in runs[den]])
        over_seeds = (f"{math.exp(d['mean']):.3f} [{math.exp(d['low']):.3f} - {math.exp(d['high']):.3f}]"
                      if d["n"] >= 2 else f"{math.exp(d['mean']):.3f} (1 seed)")
        what = {(False, statistics.median): "wall time, median (the target's measure)",
                (False, lower_quartile): "wall time, lower quartile (the steps that waited least)",
                (True, statistics.median): "CPU time, median",
                (True, lower_quartile): "CPU time, lower quartile"}[(cpu, stat)]
        mark = f" {'✓' if ratio <= 1.05 else '✗'}" if num == "mdi" else ""
        return (f"| {num} / {den} | {what} | {ratio:.3f}{mark} | {lo:.3f} - {hi:.3f} | {over_seeds} | "
                f"{', '.join(f'{r:.3f}' for r in per_seed)} |")

    def forwards(v: str) -> str:
        counts = Counter((p.no_grad[i], p.grad[i]) for p in runs[v] for i in p.timed_steps(a.warmup))
        return "; ".join(f"{ng} no-grad + {g} grad in {n} steps" for (ng, g), n in sorted(counts.items()))

    def phase(v: str, label: str, cpu: bool) -> float:
        per_step = []
        for p in runs[v]:
            for i in p.timed_steps(a.warmup):
                ph = (p.cpu_phases if cpu else p.phases)[i]
                if label.startswith("loop rest"):
                    per_step.append(p.step_time(i, cpu) - ph["generate and score"] - ph["loss forward"])
                else:
                    per_step.append(ph[label])
        return statistics.median(per_step)

    seeds_text = " ".join(str(s) for s in seeds)
    rows = []
    for v in VLLM_VARIANTS:
        wall = [x for p in runs[v] for x in times(p)]
        tokens = [p.completion_tokens[i] for p in runs[v] for i in p.timed_steps(a.warmup)]
        rows.append(f"| {v} | {len(wall)} | {statistics.median(wall):.3f} | {min(wall):.3f} - {max(wall):.3f} | "
                    f"{median_of(v, cpu=True):.3f} | {statistics.mean(tokens):.1f} | "
                    f"{statistics.median(builds[v]):.0f} | {forwards(v)} |")
    phase_rows = [f"| {label.strip()}{' (inside the above)' if label.startswith('  ') else ''} | "
                  + " | ".join(f"{phase(v, label, False):.3f}" for v in VLLM_VARIANTS) + " | "
                  + " | ".join(f"{phase(v, label, True):.3f}" for v in VLLM_VARIANTS) + " | "
                  f"{phase('stock_fixed', label, True) - phase('stock', label, True):+.3f} | "
                  f"{phase('mdi', label, True) - phase('stock_fixed', label, True):+.3f} |" for label in PHASES]
    body = "\n".join([
        VLLM_SECTION,
        "",
        f"Reproduce: `.venv-vllm/bin/python -m benchmarks.overhead{''.join(' ' + x for x in result_args(sys.argv[1:], ()))}`"
        " (from the repository root, in the environment `make test-vllm` builds; "
        f"{(time.time() - started) / 60:.1f} min).",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"vLLM {vllm.__version__} (CPU build), `torch.set_num_threads({torch.get_num_threads()})`, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, Python {platform.python_version()}; "
        f"load average (1 min) {load_start:.2f} at the start, {min(loads):.2f} - {max(loads):.2f} at the runs' "
        f"starts, {load_end:.2f} at the end (the machine is shared: other jobs' load is in every time).",
        f"- Model: tiny Qwen2.5-VL built offline ({', '.join(f'{k}={v}' for k, v in MODEL.items())}), float32 in "
        "the policy and the engine (`fixtures.vllm_cpu`: the CPU harness keeps linear weights loadable for TRL's "
        "weight sync), CPU.",
        f"- Run: TRL colocate mode (`{', '.join(f'{k}={v}' for k, v in vllm_cpu.VLLM_CPU_ARGS.items())}`), "
        f"per_device_train_batch_size 8, num_generations 4, max_completion_length {completion_length}, lr 1e-5, "
        "no gradient checkpointing, TRL's vLLM importance-sampling correction on (its default: one no-grad policy "
        "forward per generation batch). `stock`: `trl.GRPOTrainer` as shipped, rewards mc_idx 4 + think_format 1. "
        "`stock_fixed`: the same with the engine fixes `MDIGRPOTrainer` applies (`fixtures.vllm_baseline`): one "
        "image placeholder per image in the engine's prompt (stock hands vLLM the processor's expanded ids, which "
        "vLLM expands again: huggingface/trl#6294) and the engine's cached image features dropped before each "
        "weight sync (stock generates from features of the weights before the update). "
        "`mdi`: `MDIGRPOTrainer` built without `reward_funcs` (the default stack mc_idx 4 + think_format 1 + "
        "mdi_balance 1; probe placement `trl_forward`: it rides TRL's importance-sampling forward), attention "
        "metrics and live Markdown logs on. All three: vLLM sampling with `logit_bias` -100 on the image placeholder "
        "(TRL suppresses it in HF generate but not under vLLM; the random model samples it and the policy forward "
        "then fails). One torch / OpenMP thread: with two, on this loaded machine, steps took 10-20x longer.",
        f"- Seeds {seeds_text}: one run per variant and seed, the order rotating (seed k starts with variant k of "
        f"{', '.join(VLLM_VARIANTS)}). "
        f"Each run: trainer build and engine start (not timed), {a.warmup} warm-up steps, {steps} timed steps; a "
        "step's time runs from its start to the next step's start (generation, weight sync, scoring, loss, "
        "backward, optimizer, logging). The rollouts agree only up to the first update (mdi_balance changes the "
        "advantages). Target: mdi / stock <= 1.05.",
        "",
        "| variant | timed steps | median step s (wall) | min - max s (wall) | median step s (CPU) | completion tokens "
        "per step (mean) | build s (model + engine, untimed) | policy forwards per step (hook on the policy) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
        "Ratios of the pooled step times' median (or lower quartile), with a 95% bootstrap interval (steps resampled "
        "within each run), over seeds (the geometric mean of the per-seed ratios with a paired 95% t interval: "
        "exp of mean and interval of log(num run's statistic) - log(den run's), one pair per seed; it holds the "
        f"run-to-run spread the bootstrap does not) and per seed (the two runs' ratio, seeds {seeds_text}); target "
        "for mdi <= 1.05. "
        + "; ".join(f"{n} / {d}: {why}" for n, d, why in VLLM_RATIOS) + ":",
        "",
        "| ratio | measure | value | 95% interval (bootstrap over steps) | over seeds [95% t interval] | per seed |",
        "|---|---|---:|---:|---:|---|",
        *[ratio_row(n, d, cpu, stat) for n, d, _ in VLLM_RATIOS for cpu in (False, True)
          for stat in (statistics.median, lower_quartile)],
        "",
        "Wall time includes the waits for a core that other jobs on the machine hold, and their load moves from "
        "minute to minute; CPU time counts the work this process did (the colocated engine included), which such "
        "load inflates less (but still: each preemption costs the process its caches). The lower quartile keeps the "
        "steps that were least disturbed.",
        "",
        "Where a step's time goes (median seconds per step over the timed steps; indented phases are parts of "
        "'generate and score'; 'loop rest' = the step minus 'generate and score' and 'loss forward'):",
        "",
        "| phase | " + " | ".join(f"{v} wall s" for v in VLLM_VARIANTS) + " | "
        + " | ".join(f"{v} CPU s" for v in VLLM_VARIANTS) + " | fixes: stock_fixed - stock CPU s | observing: mdi - "
        "stock_fixed CPU s |",
        "|---|" + "---:|" * (2 * len(VLLM_VARIANTS) + 2),
        *phase_rows,
        "",
    ])
    print(body)
    if not a.no_write and not a.quick:
        replace_section(VLLM_SECTION, body)


if __name__ == "__main__":
    sys.exit(main())
