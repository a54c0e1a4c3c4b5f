"""TPRL: VPPO's token gradient filtering (TGF) and trajectory advantage shaping (TAS), for MDIGRPOTrainer.

Layout: ``formulas`` (pure tensor functions: token visual dependency, per-sequence top-p masks, trajectory
scaling), ``perturb`` (the seeded image perturbations I' that visual dependency is measured against), ``apply``
(the masks and multipliers applied to TRL's output). The names below are the package's public API.
"""

from .apply import apply_tprl, signal_rank_corr
from .formulas import (
    DEGENERATE_SPREAD,
    LOG_RATIO_CLAMP,
    PERCEPTION_SIGNALS,
    SCORE_CLAMP,
    TrajectoryScaling,
    average_ranks,
    combine_masks,
    fit_width,
    permute_valid,
    perturbation_signal,
    placebo_generator,
    random_token_mask,
    rank_correlation,
    sequence_mean,
    top_p_token_mask,
    trajectory_scaling,
    validate_scaling_min,
    validate_top_p,
)
from .perturb import PERTURBATIONS, check_perturbation, image_generator, perturb_image, perturb_images

__all__ = [
    "DEGENERATE_SPREAD", "LOG_RATIO_CLAMP", "PERCEPTION_SIGNALS", "PERTURBATIONS", "SCORE_CLAMP", "TrajectoryScaling",
    "apply_tprl", "average_ranks", "check_perturbation", "combine_masks", "fit_width", "image_generator", "perturb_image",
    "perturb_images", "permute_valid", "placebo_generator", "random_token_mask", "rank_correlation", "sequence_mean",
    "signal_rank_corr",
    "perturbation_signal", "top_p_token_mask", "trajectory_scaling", "validate_scaling_min", "validate_top_p",
]
