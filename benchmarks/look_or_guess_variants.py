"""Look or guess (issue 30), the GRPO experiment's design: the variants (the arms, their rewards and the outcome
each is expected to give), the experiment's settings, issue 30's goals and the keys a finished job is found by.

GRPO from the warm-up on training rows WITHOUT conflicts (guessing is never wrong there, so the answer and format
rewards cannot tell the styles apart), evaluated on held-out rows WITH conflicts (only the look style is right
there); and which per-rollout signal sees the style (the detection table). To add an arm: its entry in
:func:`experiment_variants` and :data:`EXPECTED` (and in :data:`VARIANT_NAMES` to run it by default).
"""

from __future__ import annotations

import dataclasses

from benchmarks.look_or_guess_task import fingerprint
from benchmarks.variants import COUNTERFACTUAL, Variant
from fixtures.synthetic.look_or_guess import MAX_COMPLETION_LENGTH

BASELINE = "answer_format"
RELIANCE = "visual_gain"
"""The reliance-reward variant: pays the completion's visual gain (mean or sum form, chosen on the dev split)."""
GAIN_FORMS = ("visual_gain", "visual_gain_sum")
OTHER_FORM = "visual_gain_other_form"
GUARDED = "guarded_visual_gain"
PLACEBO = "placebo_guarded"
"""The replication's arms C and D (benchmarks/RESULTS.md, "Look or guess, replication")."""
"""Optional (``--variants``): the reliance reward in the form the development split did NOT choose."""
STYLE_LOGGERS = ("fixtures.synthetic.look_or_guess:look_rate", "fixtures.synthetic.look_or_guess:guess_rate")
"""Zero-weight 'rewards' in every run: TRL logs ``rewards/look_rate/mean`` (the look rate of each step's rollouts)
and ``rewards/guess_rate/mean``; a zero weight changes no advantage."""
DETECTION_SIGNALS = ("mdi", "mdi_late", "answer_image_attention", "visual_gain", "visual_gain_sum", "visual_gain_max",
                     "answer_visual_gain", "blind_agrees", "answer_logprob")
"""The per-rollout signals of the detection table, in table order (``answer_logprob``: the confidence baseline)."""
# Issue 30's goals.
GOAL_CONFLICT_GAIN, GOAL_PLAIN, GOAL_CLEAN, GOAL_WITHIN_AUROC = 0.30, 0.98, 0.90, 0.95

EXPECTED = {
    "answer_format": "the baseline. Both styles are right on every training row, of one length per object and in "
                     "the same format, so the answer and format rewards tie between them: nothing pushes the style, "
                     "and the look rate drifts only by chance (or towards whichever style is written cleaner).",
    "mdi_balance": "pays attention balance, not reading: unless MDI differs between the styles (the detection table "
                   "says whether it does), it ties as the baseline does, and moves the style no more.",
    RELIANCE: "the reliance push: a look rollout's colour word gains nats from the image (the warm-up check's "
              "per-position gains), a guess rollout's nothing, so the reward separates the styles inside a group "
              "where the other rewards "
              "tie; the look rate should rise, and conflict accuracy with it (towards the look style's accuracy).",
    "answer_visual_gain": "control: the answer letter follows the chain in both passes (the counterfactual pass "
                          "reads the same chain), so its gain is ~0 for both styles: the reward ties, as the "
                          "baseline.",
    OTHER_FORM: "the reliance reward in the form the development split did not choose, added after seed 0's "
                "training log of the chosen form showed the style moving away from both look and guess late in the "
                "run (a completion-level reward can be raised by the text's shape as well as by reading). The mean form "
                "pays the gain per token, so a shorter or reshaped chain with the same gain earns more; the sum form "
                "pays the gain over the chain (clipped at 4 nats), which a shorter chain does not raise. Expected "
                "with the sum form: the look rate rises as with the mean form, with fewer rollouts in neither style.",
    "tprl_counterfactual": "control: TPRL only rescales the advantages of tokens (by the counterfactual's per-token "
                           "gain); where the rewards tie the advantage is 0 and stays 0, so it cannot move the style: "
                           "as the baseline.",
    GUARDED: "the replication's arm C (benchmarks/RESULTS.md, \"Look or guess, replication\"): the reliance reward paid "
             "only where the answer and the format pay, on the token the image decided, saturated with a dead zone; "
             "expected to move the style towards looking with fewer rollouts in neither style than visual_gain.",
    PLACEBO: "the replication's arm D: the guarded reward's values permuted within each group, no link to the rollout "
             "that earned them: expected as the baseline (a push here is advantage noise, not the image).",
}


def experiment_variants(gain_form: str, tprl_perturbation: str | None = None) -> dict:
    """The variants (``benchmarks.variants.Variant``), every one with the two zero-weight style loggers. ``gain_form``:
    the reliance reward's registry name (``visual_gain``: clip(mean g, 0, 0.5) / 0.5, or ``visual_gain_sum``:
    clip(sum g, 0, 4) / 4), chosen on the development split (:func:`choose_reward`). ``tprl_perturbation``: TPRL's
    perturbed image, None = the runs' counterfactual kind (a kind name where that kind is ``"none"``)."""
    if gain_form not in GAIN_FORMS:
        raise ValueError(f"gain_form must be one of {GAIN_FORMS}, got {gain_form!r}")
    log_w = (0.0,) * len(STYLE_LOGGERS)
    other = next(f for f in GAIN_FORMS if f != gain_form)

    def v(label, rewards, weights, tprl=None, perturbation=None):
        return Variant(label, (*rewards, *STYLE_LOGGERS), (*weights, *log_w), tprl, perturbation, all_seeds=True)

    return {
        BASELINE: v("answer + format only", ("mc_idx", "think_format"), (4.0, 1.0)),
        "mdi_balance": v("+ mdi_balance (4:1:1)", ("mc_idx", "think_format", "mdi_balance"), (4.0, 1.0, 1.0)),
        RELIANCE: v(f"+ {gain_form} (4:1:1)", ("mc_idx", "think_format", gain_form), (4.0, 1.0, 1.0)),
        "answer_visual_gain": v("+ answer_visual_gain (4:1:1, control)",
                                ("mc_idx", "think_format", "answer_visual_gain"), (4.0, 1.0, 1.0)),
        "tprl_counterfactual": v("+ TPRL, counterfactual as perturbation (control)", ("mc_idx", "think_format"),
                                 (4.0, 1.0), "perturbation", tprl_perturbation or COUNTERFACTUAL),
        OTHER_FORM: v(f"+ {other} (4:1:1, the other form)", ("mc_idx", "think_format", other), (4.0, 1.0, 1.0)),
        GUARDED: v("+ guarded_visual_gain (4:1:1)", ("mc_idx", "think_format", GUARDED), (4.0, 1.0, 1.0)),
        # The placebo's config names the guarded reward; run_one hands the trainer PlaceboGuardedReward in its place.
        PLACEBO: v("placebo: + guarded_visual_gain permuted within groups (4:1:1)",
                   ("mc_idx", "think_format", GUARDED), (4.0, 1.0, 1.0)),
    }


VARIANT_NAMES = (BASELINE, "mdi_balance", RELIANCE, "answer_visual_gain", "tprl_counterfactual")
"""The default variants."""
ALL_VARIANTS = (*VARIANT_NAMES, OTHER_FORM, GUARDED, PLACEBO)
REPLICATION_ARMS = {"A": BASELINE, "B": RELIANCE, "C": GUARDED, "D": PLACEBO}
"""The pre-registered replication's arms (benchmarks/RESULTS.md): A the baseline, B visual_gain as shipped, C the
guarded reward, D its placebo."""
REPLICATION_SEEDS = tuple(range(100, 116))



def _lp():
    """benchmarks/language_prior.py (its Variant, grpo_config and write_json are reused): imported on first use, as
    it imports the trainer."""
    import language_prior

    return language_prior


@dataclasses.dataclass
class ExperimentSettings:
    # GRPO steps per run (every variant, every seed): 50 fits 25 runs into the hour on 2 shared cores (pilots: 1 to
    # 3.5 s a step at load average 5 to 8, 25 to 35 s per test evaluation, 40 to 75 s per detection measurement).
    steps: int = 50
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    variants: tuple[str, ...] = VARIANT_NAMES
    gain_form: str = "auto"  # the reliance reward's form; auto: chosen on the development split
    n_pool: int = 400  # training rows (no conflict row): steps x prompts_per_step of them are drawn
    pool_conflict_rate: float = 0.0
    n_test: int = 200  # test prompts, half of them conflict rows
    test_conflict_rate: float = 0.5
    eval_samples: int = 4  # completions sampled per test prompt at temperature 1 (greedy beside)
    eval_mid: bool = False  # also evaluate at the middle step
    n_dev: int = 100  # development prompts (the choice of the gain form), no conflict rows as in training
    dev_samples: int = 8  # one GRPO group per prompt
    detect_prompts: int = 200  # test prompts of the detection table (both row kinds)
    detect_samples: int = 4
    detect_seeds: tuple[int, ...] = (0,)  # trained models measured for the detection table
    n_boot: int = 1000
    learning_rate: float = 3e-4  # language_prior.py's (1e-3 broke non-conflict rows there)
    lr_scheduler_type: str = "linear"
    prompts_per_step: int = 4
    num_generations: int = 8
    max_completion_length: int = MAX_COMPLETION_LENGTH
    # The runs' counterfactual image; auto: chosen on the development split among dev_kinds (black, the trainer's
    # default, first). Resolved before any run: the run records hold the kind used.
    counterfactual: str = "auto"
    dev_kinds: tuple[str, ...] = ("black", "grey", "gaussian_noise", "blur", "patch_blackening", "none")
    reliance_everywhere: bool = True  # reliance signals logged in every run (reliance/* comparable across variants)
    # Runs (of the reliance arms) whose test rollouts are scored per token for the colour-word table
    position_seeds: tuple[int, ...] = ()


RUN_INDEPENDENT = ("seeds", "variants", "detect_seeds", "gain_form", "position_seeds")
"""Settings that decide nothing inside one run (which runs exist; the chosen form enters through the variant)."""


def run_key(s: ExperimentSettings, recipe, variant, seed: int, threads: int, environment: dict | None = None) -> str:
    """The key a finished run is found by. ``environment`` (``benchmarks.environment.environment_key``: float path,
    CPU capability, key library versions), given, enters it, so a record made in another environment is rerun."""
    return fingerprint({k: v for k, v in dataclasses.asdict(s).items() if k not in RUN_INDEPENDENT},
                       dataclasses.asdict(recipe), dataclasses.asdict(variant), seed, threads, *_env(environment))


def _env(environment: dict | None) -> tuple:
    # no environment: the key of the records made before environments were keyed (issue 44), unchanged
    return (environment,) if environment else ()


def warmup_key(s: ExperimentSettings, recipe, threads: int, environment: dict | None = None) -> str:
    return fingerprint(dataclasses.asdict(recipe), {k: getattr(s, k) for k in (
        "n_test", "test_conflict_rate", "eval_samples", "detect_prompts", "detect_samples", "counterfactual",
        "max_completion_length")}, threads, *_env(environment))


def choice_key(s: ExperimentSettings, recipe, threads: int, environment: dict | None = None) -> str:
    return fingerprint(dataclasses.asdict(recipe), {k: getattr(s, k) for k in (
        "n_dev", "dev_samples", "pool_conflict_rate", "counterfactual", "dev_kinds", "gain_form",
        "max_completion_length", "n_boot")}, threads, *_env(environment))
