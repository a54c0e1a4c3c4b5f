"""TPRL on look or guess with conflict rows (issue 44): the experiment's design. The task, the arms, every GRPO
setting a run depends on, the keys a finished run is found by, and the development-split rules that choose the
conflict rate, the steps, TPRL's perturbation and the attention signal's layer segment.

The task (``fixtures.synthetic.look_or_guess``, kind ``look_or_guess_long``): the prior-colour questions answered by a
chain of 42 to 45 tokens in one of two styles of equal length per object, *look* ("... I use the image: the shape in
the image here is blue. It is the answer.") or *guess* ("... I use the name: its color is red. ..."), each rollout's
style read from its text. The GRPO pool holds conflict rows at a low rate: there the prior's answer is wrong and
only a looking chain is right, so the answer reward sometimes tells looking from guessing, and credit assignment
decides how fast the policy learns to look. Held out: the TEST split (``look_or_guess_test``, 200 prompts, half
conflict rows), 4 samples per prompt at temperature 1, at the midpoint and the end of every run.

The arms (:data:`ARMS`): A answer + format (``mc_idx`` 4, ``think_format`` 1); T = A + TPRL as the seeds configure it
(entropy and perception filtering at 0.2, trajectory reweighting min 0.8, ``perception_signal="perturbation"``);
T_att = T with ``perception_signal="attention"``; P = T's placebo (``tprl_placebo``: T's entropy mask and forwards,
the perception mask's tokens at random, the multipliers permuted); M = A + ``mdi_balance`` 1 (the default 4:1:1
stack). Every GRPO setting is written out in :func:`grpo_config`, none left to a library default.

Development-split rules, fixed before any development run (committed first; ``benchmarks/README.md`` says so), on
the development split only (validation rows; never the test split) and development seeds
:data:`DEV_SEEDS` (not the plan's):

- D1 warm-up: :class:`fixtures.warmup.LookOrGuessRecipe` of the long kind (400 rows, conflict rate 0.5, styles
  redrawn every epoch), checked on 200 validation prompts x 4 samples against the short kind's goals
  (``look_or_guess_task.warmup_check``). The first of 8, 12, 16 epochs that meets every goal is the warm-up; its
  weights' SHA-256 is the plan's (``benchmarks.environment.weights_sha256``).
- D2 TPRL's perturbation: on the warm-up's rollouts of 100 validation prompts x 8 (temperature 1, conflict rate 0.5),
  per rollout S_i = mean_t s_t under each candidate of :data:`PERTURBATION_CANDIDATES`; the candidate with the
  highest within-prompt AUROC of S_i for look against guess (:func:`pick_by_auroc`); within 0.005 of it, the larger
  share of look rollouts whose colour word the perception filter keeps; still tied, the listed order (VPPO's
  patch blackening first). ``none`` cannot be TPRL's perturbation (it is no image).
- D3 the attention segment of T_att: on the same rollouts, the within-prompt AUROC of the mean a_t per segment of
  :data:`SEGMENT_CANDIDATES`, the same rule (tie: the listed order, the library's default ``late`` first); the best
  is taken even below 0.5, and the record says so.
- D0 learning rate (added before its runs, after the timing pilot's A run at the replication's 3e-4 left 40% of
  its chains in neither style after 20 steps, against the warm-up's 9%: the chains three times longer than the
  replication's drift out of both styles, and the style read from the text is the experiment's truth):
  :func:`pick_learning_rate`, the largest of :data:`LR_CANDIDATES` whose A run of :data:`PILOT_STEPS` steps (seed 900,
  rate 0.2) ends with a neither-style share on the development split at most :data:`NEITHER_DRIFT` above the
  warm-up's; none: the smallest.
- D4 steps: a timing pilot (A and T, :data:`PILOT_STEPS` steps, seed 900, evaluated once) measures the training
  seconds per step of A and T and the seconds per evaluation, as CPU seconds of the run's own process (one
  thread: a run's cost on a core of its own; amended before the pilot ran, when the machine's load average from
  other sessions' tests reached 12 on 2 cores, which would have made wall-clock figures several times too long;
  the wall-clock figures are recorded beside); :func:`steps_for_budget` takes the largest multiple of 20 (at most
  200) whose projected 80 runs (16 seeds x A, T, T_att, P, M; T_att and M costed as T: one extra forward each at
  most; two evaluations per run) fit :data:`BUDGET_HOURS` hours on 2 workers.
- D5 conflict rate: A at those steps on the 4 development seeds at each rate of :data:`RATE_CANDIDATES`, evaluated
  on 200 validation prompts (conflict rate 0.5) at the end (the candidates were first 0.1, 0.2, 0.3; the timing
  pilot's A run, evaluated on the development split for its time, ended at conflict accuracy 0.77 after 20 steps at
  rate 0.2, so at the budget's several times more steps those rates would all leave A near its ceiling: the
  candidates became 0.025, 0.05, 0.1, 0.2 before any D5 run finished); :func:`pick_rate`: the rate whose mean final conflict
  accuracy lies in [0.40, 0.75] nearest its middle 0.575 (none inside: the nearest to the interval, said so).
  Nothing of T, T_att, P or M is evaluated on the development split: their outcomes choose nothing.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from benchmarks.look_or_guess_task import fingerprint
from fixtures.synthetic.look_or_guess import CHAINS, LONG_MAX_COMPLETION_LENGTH, LOOK_OR_GUESS_LONG

DEV_SEEDS = (900, 901, 902, 903)
"""GRPO seeds of the development runs: never the plan's (which are fresh, e.g. 200-215)."""
PILOT_STEPS = 20
PERTURBATION_CANDIDATES = ("patch_blackening", "grayscale", "black", "grey", "blur", "gaussian_noise")
"""D2's candidates, VPPO's default first (``trl_mdi.tprl.perturb``; its parameters: 14 px, probability 0.5,
noise std 189, blur radius 6). ``none`` (the image removed) is not a perturbation."""
SEGMENT_CANDIDATES = ("late", "middle", "early", "all")
"""D3's candidates: the thirds of the measured layers (``attention_layer_segments="thirds"``) and all of them."""
RATE_CANDIDATES = (0.025, 0.05, 0.1, 0.2)
"""D5's conflict rates of the GRPO pool (first committed as 0.1, 0.2, 0.3; lowered before any D5 run finished: see
rule D5)."""
RATE_BAND = (0.40, 0.75)
LR_CANDIDATES = (3e-4, 1e-4, 3e-5)
"""D0's learning rates, the replication's first."""
NEITHER_DRIFT = 0.10
"""D0: the most the neither-style share may rise over the warm-up's in the 20-step pilot (the hacking line's size)."""
BUDGET_HOURS = 4.5
ARM_NAMES = ("A", "T", "T_att", "P", "M")
TIE = 0.005


@dataclasses.dataclass
class TprlSettings:
    """Everything one run of the experiment depends on besides its arm and seed (the plan's values once the
    development split has chosen ``steps``, ``pool_conflict_rate``, ``perturbation`` and ``attention_segment``)."""

    kind: str = LOOK_OR_GUESS_LONG
    steps: int = 100  # D4
    pool_conflict_rate: float = 0.2  # D5
    perturbation: str = "patch_blackening"  # D2
    attention_segment: str = "late"  # D3
    prompts_per_step: int = 4
    num_generations: int = 8
    learning_rate: float = 3e-4  # the replication's
    lr_scheduler_type: str = "linear"
    max_completion_length: int = LONG_MAX_COMPLETION_LENGTH
    eval_split: str = "test"  # "test" (the plan's runs) or "dev" (development runs: validation rows)
    n_eval: int = 200  # held-out prompts, half of them conflict rows
    eval_conflict_rate: float = 0.5
    eval_samples: int = 4  # completions per held-out prompt at temperature 1 (the greedy one beside)
    eval_mid: bool = True  # held-out evaluation at the midpoint too
    # TPRL as the seeds configure it (shared/seeds/mtrl_tprl_readme.md; VPPO's config values)
    top_p_entropy_tokens: float = 0.2
    top_p_perception_tokens: float = 0.2
    trajectory_scaling_min: float = 0.8
    perturbation_patch_size: int = 14
    perturbation_prob: float = 0.5
    mdi_balance_ratio: float = 2.0
    # GRPO, every setting the runs depend on (issue 43 is changing MDIGRPOConfig's defaults: none is inherited)
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0
    scale_rewards: str = "group"
    multi_objective_aggregation: str = "sum_then_normalize"
    num_iterations: int = 1
    steps_per_generation: int = 1
    gradient_accumulation_steps: int = 1
    mask_truncated_completions: bool = True
    importance_sampling_level: str = "token"
    top_entropy_quantile: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    warmup_steps: int = 0
    optim: str = "adamw_torch"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    shuffle_dataset: bool = True
    disable_dropout: bool = False

    @property
    def n_pool(self) -> int:
        """GRPO rows: each seen once (``steps x prompts_per_step``), ``round(pool_conflict_rate x n_pool)`` of them
        conflict rows, the same rows for every arm and seed (in a seeded order)."""
        return self.steps * self.prompts_per_step

    @property
    def mid_step(self) -> int | None:
        return self.steps // 2 if self.eval_mid and self.steps >= 2 else None


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm: its label, rewards and weights (the style loggers added with weight 0), and TPRL's signal (None:
    off) and placebo switch."""

    name: str
    label: str
    rewards: tuple[str, ...]
    weights: tuple[float, ...]
    tprl: str | None = None
    placebo: bool = False


ARMS: dict[str, Arm] = {
    "A": Arm("A", "A: answer + format", ("mc_idx", "think_format"), (4.0, 1.0)),
    "T": Arm("T", "T: + TPRL (perturbation)", ("mc_idx", "think_format"), (4.0, 1.0), "perturbation"),
    "T_att": Arm("T_att", "T_att: + TPRL (attention)", ("mc_idx", "think_format"), (4.0, 1.0), "attention"),
    "P": Arm("P", "P: T's placebo", ("mc_idx", "think_format"), (4.0, 1.0), "perturbation", placebo=True),
    "M": Arm("M", "M: + mdi_balance (4:1:1)", ("mc_idx", "think_format", "mdi_balance"), (4.0, 1.0, 1.0)),
}


def grpo_config(arm: Arm, seed: int, s: TprlSettings, out: Path):
    """The ``MDIGRPOConfig`` of one run: CPU, float32, no checkpoints, every step logged, attention metrics on (the
    probe rides in the training forward where nothing reads it first), no reliance signals, every GRPO setting of
    ``s`` written out. TPRL arms: entropy and perception filters and trajectory reweighting as ``s`` says, with
    ``arm.tprl`` as the perception signal (the perturbation: ``s.perturbation``; the attention: ``s.attention_segment``)
    and ``arm.placebo`` as ``tprl_placebo``."""
    from trl_mdi.config import MDIGRPOConfig

    loggers = CHAINS[s.kind].loggers
    tprl = {}
    if arm.tprl is not None:
        tprl = dict(enable_entropy_filtering=True, top_p_entropy_tokens=s.top_p_entropy_tokens,
                    enable_perception_filtering=True, top_p_perception_tokens=s.top_p_perception_tokens,
                    enable_trajectory_reweighting=True, trajectory_scaling_min=s.trajectory_scaling_min,
                    perception_signal=arm.tprl, perception_perturbation=s.perturbation,
                    perturbation_patch_size=s.perturbation_patch_size, perturbation_prob=s.perturbation_prob,
                    perception_attention_segment=s.attention_segment, tprl_placebo=arm.placebo)
    return MDIGRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True,
        seed=seed, data_seed=seed, max_steps=s.steps, logging_steps=1,
        per_device_train_batch_size=s.prompts_per_step * s.num_generations, num_generations=s.num_generations,
        max_completion_length=s.max_completion_length, learning_rate=s.learning_rate,
        lr_scheduler_type=s.lr_scheduler_type, warmup_steps=s.warmup_steps, optim=s.optim,
        adam_beta1=s.adam_beta1, adam_beta2=s.adam_beta2, adam_epsilon=s.adam_epsilon, weight_decay=s.weight_decay,
        max_grad_norm=s.max_grad_norm, loss_type=s.loss_type, epsilon=s.epsilon, epsilon_high=s.epsilon_high,
        beta=s.beta, scale_rewards=s.scale_rewards, multi_objective_aggregation=s.multi_objective_aggregation,
        num_iterations=s.num_iterations, steps_per_generation=s.steps_per_generation,
        gradient_accumulation_steps=s.gradient_accumulation_steps,
        mask_truncated_completions=s.mask_truncated_completions,
        importance_sampling_level=s.importance_sampling_level, top_entropy_quantile=s.top_entropy_quantile,
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, repetition_penalty=s.repetition_penalty,
        shuffle_dataset=s.shuffle_dataset, disable_dropout=s.disable_dropout, gradient_checkpointing=False,
        reward_funcs=[*arm.rewards, *loggers], reward_weights=[*arm.weights, *(0.0,) * len(loggers)],
        compute_attention_metrics=True, attention_layer_segments="thirds", mdi_balance_ratio=s.mdi_balance_ratio,
        reliance_signals=False, realtime_rollout_logging=False, attention_map_every_n_steps=0, **tprl,
    )


def run_key(s: TprlSettings, arm: Arm, seed: int, environment: dict, warmup_sha256: str) -> str:
    """What a finished run is found by: every setting, the arm, the seed, the environment's key
    (``benchmarks.environment.environment_key``: float path, threads, CPU capability, library versions) and the
    warm-up's weights hash. A record with another key is rerun, never reused."""
    return fingerprint(dataclasses.asdict(s), dataclasses.asdict(arm), seed, environment, warmup_sha256)


# ------------------------------------------------------------------------------------ development-split rules


def pick_by_auroc(aurocs: dict[str, float], order: tuple[str, ...],
                  second: dict[str, float] | None = None) -> tuple[str, str]:
    """D2 / D3: the candidate with the highest within-prompt AUROC (NaN: never chosen while another has a value);
    within :data:`TIE` of the best, the highest ``second`` (D2: the share of look rollouts whose colour word the
    perception filter keeps); still tied, the first in ``order``. Returns (choice, why).

    >>> pick_by_auroc({"a": 0.70, "b": 0.90, "c": 0.898}, ("a", "b", "c"))[0]
    'b'
    >>> pick_by_auroc({"a": 0.90, "b": 0.898}, ("a", "b"), second={"a": 0.5, "b": 0.9})[0]
    'b'
    >>> pick_by_auroc({"late": 0.3, "early": 0.3}, ("late", "early"))[0]
    'late'
    """
    scored = {k: v for k, v in aurocs.items() if k in order and v is not None and not math.isnan(v)}
    if not scored:
        return order[0], "no candidate had a within-prompt AUROC: the first listed"
    best = max(scored.values())
    near = [k for k in order if k in scored and scored[k] >= best - TIE]
    if second and len(near) > 1:
        top = max(second.get(k, -math.inf) for k in near)
        near = [k for k in near if second.get(k, -math.inf) >= top - 1e-12]
    choice = near[0]
    others = ", ".join(f"{k} {scored[k]:.3f}" for k in order if k in scored and k != choice)
    return choice, (f"within-prompt AUROC {scored[choice]:.3f} (others: {others or 'none'})"
                    + (" - below 0.5: the signal ranks the styles backwards" if scored[choice] < 0.5 else ""))


def projected_hours(steps: int, step_seconds: dict[str, float], eval_seconds: float, overhead_seconds: float,
                    seeds: int = 16, workers: int = 2, evaluations: int = 2) -> float:
    """D4's projection: 80 runs' wall time in hours on ``workers`` workers, each run ``steps x`` its arm's seconds per
    step, plus ``evaluations`` held-out evaluations and a fixed ``overhead_seconds`` (model load, trainer set-up).
    ``step_seconds`` holds A's and T's; T_att and M are costed as T (one extra forward at most), P as T.

    >>> round(projected_hours(100, {"A": 2.0, "T": 3.0}, 60.0, 20.0), 2)
    4.67
    """
    per_arm = {"A": step_seconds["A"], "T": step_seconds["T"], "T_att": step_seconds["T"], "P": step_seconds["T"],
               "M": step_seconds["T"]}
    total = sum(steps * t + evaluations * eval_seconds + overhead_seconds for t in per_arm.values()) * seeds
    return total / workers / 3600.0


def steps_for_budget(step_seconds: dict[str, float], eval_seconds: float, overhead_seconds: float,
                     budget_hours: float = BUDGET_HOURS, cap: int = 200, multiple: int = 20) -> int:
    """D4: the largest multiple of ``multiple`` steps, at most ``cap``, whose :func:`projected_hours` fits
    ``budget_hours`` (at least ``multiple``).

    >>> steps_for_budget({"A": 2.0, "T": 3.0}, 60.0, 20.0)
    80
    """
    steps = multiple
    while steps + multiple <= cap and projected_hours(steps + multiple, step_seconds, eval_seconds,
                                                      overhead_seconds) <= budget_hours:
        steps += multiple
    return steps


def pick_rate(final_conflict: dict[float, float], band: tuple[float, float] = RATE_BAND) -> tuple[float, str]:
    """D5: the conflict rate whose baseline mean final conflict accuracy lies in ``band`` nearest its middle; with
    none inside, the rate nearest the band (ties: the lower rate). Returns (rate, why).

    >>> pick_rate({0.1: 0.45, 0.2: 0.62, 0.3: 0.81})[0]
    0.2
    >>> pick_rate({0.1: 0.30, 0.2: 0.35})
    (0.2, 'none of the rates ends in [0.40, 0.75]: 0.2 is nearest (0.350)')
    """
    lo, hi = band
    middle = (lo + hi) / 2
    inside = {r: v for r, v in final_conflict.items() if lo <= v <= hi}
    if inside:
        rate = min(sorted(inside), key=lambda r: abs(inside[r] - middle))
        return rate, (f"mean final conflict accuracy {inside[rate]:.3f}, in [{lo:.2f}, {hi:.2f}] nearest "
                      f"{middle:.3f} (" + ", ".join(f"rate {r:g}: {v:.3f}" for r, v in sorted(final_conflict.items()))
                      + ")")
    rate = min(sorted(final_conflict), key=lambda r: max(lo - final_conflict[r], final_conflict[r] - hi))
    return rate, (f"none of the rates ends in [{lo:.2f}, {hi:.2f}]: {rate:g} is nearest "
                  f"({final_conflict[rate]:.3f})")


def pick_learning_rate(neither: dict[float, float], warmup_neither: float,
                       order: tuple[float, ...] = LR_CANDIDATES) -> tuple[float, str]:
    """D0: the first rate of ``order`` (largest first) whose pilot's neither-style share is at most
    ``warmup_neither + NEITHER_DRIFT``; none: the last. ``neither``: rate -> the share (rates not tried are absent).

    >>> pick_learning_rate({3e-4: 0.40, 1e-4: 0.15}, 0.09)
    (0.0001, 'neither-style share 0.150 after the pilot, at most 0.090 + 0.10 (3e-4: 0.400)')
    >>> pick_learning_rate({3e-4: 0.40, 1e-4: 0.30, 3e-5: 0.25}, 0.09)[0]
    3e-05
    """
    limit = warmup_neither + NEITHER_DRIFT
    tried = [r for r in order if r in neither]
    for rate in tried:
        if neither[rate] <= limit + 1e-12:
            others = ", ".join(f"{_lr(r)}: {neither[r]:.3f}" for r in tried if r != rate)
            return rate, (f"neither-style share {neither[rate]:.3f} after the pilot, at most {warmup_neither:.3f} + "
                          f"{NEITHER_DRIFT:.2f}" + (f" ({others})" if others else ""))
    return order[-1], (f"no rate kept the neither-style share within {warmup_neither:.3f} + {NEITHER_DRIFT:.2f} ("
                       + ", ".join(f"{_lr(r)}: {neither[r]:.3f}" for r in tried) + "): the smallest")


def _lr(rate: float) -> str:
    """``3e-4`` for 0.0003."""
    mantissa, exponent = f"{rate:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def settings_dict(s: TprlSettings) -> dict[str, Any]:
    """``s`` as a dict with its derived values (``n_pool``, ``mid_step``), for records and reports."""
    return {**dataclasses.asdict(s), "n_pool": s.n_pool, "mid_step": s.mid_step}
