"""A training variant of a benchmark (the rewards and weights one GRPO run trains with, TPRL on or off) and the
``MDIGRPOConfig`` of such a run on the CPU: written once for the language-prior and look-or-guess benchmarks."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

COUNTERFACTUAL = "counterfactual"
"""``Variant.perturbation`` value: TPRL's perturbed image is the runs' counterfactual kind (``--counterfactual``)."""
RELIANCE_REWARDS = frozenset({"answer_visual_gain", "answer_visual_gain_group"})
"""Rewards that read the reliance signals (they turn the counterfactual forward on whatever the flag says)."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """One arm of a benchmark: its label in the report, reward names and weights, and TPRL's settings."""

    label: str
    rewards: tuple[str, ...]
    weights: tuple[float, ...]
    tprl: str | None = None  # the perception signal, with TPRL on
    perturbation: str | None = None  # TPRL's perturbed image: None = the trainer's default, COUNTERFACTUAL = the runs'
    all_seeds: bool = False  # runs on every seed of --seeds; the others on the first --seeds_other

    @property
    def reads_reliance(self) -> bool:
        return bool(RELIANCE_REWARDS & set(self.rewards))


def grpo_config(variant: Variant, seed: int, s: Any, out: Path):
    """The ``MDIGRPOConfig`` of one run of ``variant``: CPU, float32, no checkpoints, every step logged, attention
    metrics on. ``s``: the benchmark's settings (``steps``, ``prompts_per_step``, ``num_generations``,
    ``max_completion_length``, ``learning_rate``, ``lr_scheduler_type``, ``counterfactual``, ``reliance_everywhere``).
    """
    # Imported here: trl_mdi.config imports TRL, which a benchmark imports only after its offline settings.
    from trl_mdi.config import MDIGRPOConfig

    # Every run computes the reliance signals (one no-grad forward with the counterfactual image per step) so that
    # the live reliance/* metrics compare across variants; a reward reading them turns them on in any case.
    extra = dict(reliance_signals=s.reliance_everywhere or variant.reads_reliance, counterfactual_image=s.counterfactual)
    if variant.tprl is not None:
        extra.update(enable_entropy_filtering=True, enable_perception_filtering=True,
                     enable_trajectory_reweighting=True, perception_signal=variant.tprl)
        if variant.perturbation is not None:
            # The counterfactual as TPRL's perturbed image: the trainer runs one forward for both.
            extra["perception_perturbation"] = s.counterfactual if variant.perturbation == COUNTERFACTUAL \
                else variant.perturbation
        elif variant.tprl == "perturbation":
            # Also the attention signal, free here (the probe runs anyway): logs tprl/signal_rank_corr, how well
            # the probe's per-token image attention ranks tokens as the perturbed forward does. Trains the same.
            extra["perception_signal_compare"] = True
    return MDIGRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True,
        seed=seed, max_steps=s.steps, logging_steps=1,
        per_device_train_batch_size=s.prompts_per_step * s.num_generations, num_generations=s.num_generations,
        max_completion_length=s.max_completion_length, learning_rate=s.learning_rate,
        lr_scheduler_type=s.lr_scheduler_type, beta=0.0, temperature=1.0, gradient_checkpointing=False,
        mask_truncated_completions=True, reward_funcs=list(variant.rewards), reward_weights=list(variant.weights),
        compute_attention_metrics=True, realtime_rollout_logging=False, attention_map_every_n_steps=0, **extra,
    )
