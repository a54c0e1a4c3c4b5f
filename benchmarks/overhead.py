"""Step-time overhead of MDIGRPOTrainer over stock GRPOTrainer, measured side by side in one process.

    .venv/bin/python benchmarks/overhead.py            # completions of 32 and 128 tokens, ~10 min on 2 cores
    .venv/bin/python benchmarks/overhead.py --quick    # fewer rounds

Same tiny Qwen2.5-VL (built offline, deeper and wider than the test one), same synthetic A-OKVQA data, same seed
for every variant:

    stock          trl.GRPOTrainer; rewards mc_idx 4 + think_format 1
    metrics_only   MDIGRPOTrainer, attention metrics and live Markdown logs (maps every 10 steps) on, the same two
                   rewards: nothing reads the attention before the loss, so the probe measures inside TRL's
                   training forward (no extra forward)
    extra_forward  MDIGRPOTrainer with the brief's 4:1:1 stack (mc_idx, think_format, mdi_balance), logs on:
                   mdi_balance reads MDI before the loss, so the probe runs its one extra no-grad forward

Variants run in alternating rounds (stock, metrics_only, extra_forward, stock, ...) so that machine load hits them
alike. Per round and length, each variant's median step wall time (first step of each run dropped as warm-up) is
divided by stock's in the same round: the figure is the median of these paired ratios over rounds, with their
min-max. The section "Trainer overhead" of benchmarks/RESULTS.md is replaced with the table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _results import replace_section, result_args, set_offline_env

set_offline_env()
# fixtures/ (tiny models, synthetic data, warm-up) is a folder of the checkout, not an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from fixtures.synthetic import write_synthetic_aokvqa  # noqa: E402
from fixtures.tiny import save_tiny_vlm  # noqa: E402
from trl_mdi.aokvqa import prepare_aokvqa  # noqa: E402
from trl_mdi.config import MDIGRPOConfig  # noqa: E402
from trl_mdi.data import to_conversational  # noqa: E402
from trl_mdi.rewards import mc_idx_reward, mdi_balance_reward, think_format_reward  # noqa: E402
from trl_mdi.trainer import MDIGRPOTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Trainer overhead: MDIGRPOTrainer vs GRPOTrainer"
MODEL = dict(num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=4, intermediate_size=768)


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t)


def run(variant: str, model_dir: Path, dataset, work: Path, steps: int, completion_length: int) -> list[float]:
    common = dict(
        output_dir=str(work / variant), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=8,
        num_generations=4, max_completion_length=completion_length, max_steps=steps, logging_steps=1, save_strategy="no", seed=0,
        learning_rate=1e-5, disable_tqdm=True, gradient_checkpointing=False,
    )
    rewards = [mc_idx_reward, think_format_reward]
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
            rewards = [*rewards, mdi_balance_reward]
        trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=rewards, args=args, train_dataset=dataset)
        expected = "training_forward" if variant == "metrics_only" else "extra_forward"
        assert trainer.run_plan.placement == expected, (variant, trainer.run_plan.placement)
    timer = StepTimer()
    trainer.add_callback(timer)
    trainer.train()
    return timer.times[1:]  # the first step pays one-off costs (allocator, kernel selection)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Step times on this shared VM drift by tens of percent between minutes: many short alternating rounds, paired.
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--completion_lengths", type=int, nargs="+", default=[32, 128],
                        help="max_completion_length values to measure (the random model always writes all of them)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 5 steps")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    a = parser.parse_args()
    if a.quick:
        a.rounds, a.steps = 2, 5
    torch.set_num_threads(2)
    started = time.time()
    variants = ("stock", "metrics_only", "extra_forward")
    times: dict[tuple[int, str], list[float]] = {(c, v): [] for c in a.completion_lengths for v in variants}
    ratios: dict[tuple[int, str], list[float]] = {(c, v): [] for c in a.completion_lengths for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = save_tiny_vlm("qwen2_5_vl", work / "model", **MODEL)
        write_synthetic_aokvqa(work / "src", n_train=256, n_validation=8, n_test=8, seed=0, num_shards=1)
        prepare_aokvqa(work / "src", work / "prepared", log=lambda *x: None)
        dataset = load_dataset("parquet", data_files=str(work / "prepared" / "train.parquet"), split="train")
        dataset = dataset.map(to_conversational)
        for r in range(a.rounds):
            for c in a.completion_lengths:
                medians = {}
                for variant in variants:
                    t = run(variant, model_dir, dataset, work / f"r{r}_c{c}", a.steps, c)
                    times[(c, variant)].extend(t)
                    medians[variant] = statistics.median(t)
                    ratios[(c, variant)].append(medians[variant] / medians.get("stock", medians[variant]))
                    print(f"round {r} completion {c} {variant:13s} median step {medians[variant]:.3f} s "
                          f"ratio {ratios[(c, variant)][-1]:.3f}", flush=True)

    def mark(c: int, v: str) -> str:
        if v == "stock":
            return ""
        target = 1.05 if v == "metrics_only" else 1.15
        return " ✓" if statistics.median(ratios[(c, v)]) <= target else " ✗"

    rows = [
        f"| {c} | {v} | {len(times[(c, v)])} | {statistics.median(times[(c, v)]):.3f} "
        f"| {statistics.median(ratios[(c, v)]):.3f}{mark(c, v)} | {min(ratios[(c, v)]):.3f} - {max(ratios[(c, v)]):.3f} |"
        for c in a.completion_lengths for v in variants
    ]
    lengths = " ".join(str(c) for c in a.completion_lengths)
    body = "\n".join([
        SECTION,
        "",
        f"Reproduce: `.venv/bin/python benchmarks/overhead.py{''.join(' ' + x for x in result_args(sys.argv[1:], ()))}`"
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
        "",
        "| completion tokens | variant | steps | median step s | ratio to stock (median of rounds) | ratio min - max |",
        "|---:|---|---:|---:|---:|---:|",
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
        replace_section(SECTION, body)


if __name__ == "__main__":
    sys.exit(main())
