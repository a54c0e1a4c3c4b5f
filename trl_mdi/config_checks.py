"""Validation of the fields MDIGRPOConfig adds to GRPOConfig: run at construction (and when a plain GRPOConfig is
upgraded), so a bad flag fails with a clear error before any model loads."""

from __future__ import annotations

from .answer_format import compile_answer_pattern
from .tprl.formulas import PERCEPTION_SIGNALS, validate_scaling_min, validate_top_p
from .tprl.perturb import check_perturbation

TEXT_KEY_CHOICES = ("all", "content")


def validate_added_fields(args) -> None:
    """Check every added field of ``args`` (an MDIGRPOConfig) and fill the defaults that depend on others
    (``perturbation_seed`` from ``seed``, a space-separated ``reward_funcs`` string split)."""
    if not args.mdi_balance_ratio > 1.0:
        raise ValueError(f"mdi_balance_ratio must be > 1 (balance uses log R), got {args.mdi_balance_ratio}")
    if args.compute_attention_metrics not in (None, True, False):
        raise ValueError(f"compute_attention_metrics must be True, False or None (auto), got "
                         f"{args.compute_attention_metrics!r}")
    if args.attention_text_keys not in TEXT_KEY_CHOICES:
        raise ValueError(
            f"attention_text_keys must be one of {TEXT_KEY_CHOICES}, got {args.attention_text_keys!r}"
        )
    from .signals import check_segment_spec

    try:
        # Syntax and names only: the layer count is known once the model is, where ranges are checked again.
        check_segment_spec(args.attention_layer_segments)
    except ValueError as e:
        raise ValueError(f"attention_layer_segments: {e}") from None
    validate_top_p(args.top_p_entropy_tokens, "top_p_entropy_tokens")
    validate_top_p(args.top_p_perception_tokens, "top_p_perception_tokens")
    validate_scaling_min(args.trajectory_scaling_min, "trajectory_scaling_min")
    try:
        check_perturbation(args.perception_perturbation, patch_size=args.perturbation_patch_size,
                           prob=args.perturbation_prob, noise_std=args.perturbation_noise_std,
                           blur_radius=args.perturbation_blur_radius)
    except ValueError as e:
        raise ValueError(f"perception_perturbation: {e}") from None
    if args.perception_signal not in PERCEPTION_SIGNALS:
        raise ValueError(f"perception_signal must be one of {PERCEPTION_SIGNALS}, got {args.perception_signal!r}")
    if args.on_bad_image not in ("skip", "error"):
        raise ValueError(f"on_bad_image must be 'skip' or 'error', got {args.on_bad_image!r}")
    if args.filter_low > args.filter_high:
        raise ValueError(f"filter_low ({args.filter_low}) must be <= filter_high ({args.filter_high})")
    for name in ("log_prompt_preview_chars", "log_completion_preview_chars", "log_full_rollouts_per_step",
                 "attention_map_every_n_steps", "attention_maps_per_step"):
        if getattr(args, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(args, name)}")
    compile_answer_pattern(args.answer_pattern)
    if args.perturbation_seed is None:
        args.perturbation_seed = args.seed
    if isinstance(args.reward_funcs, str):
        args.reward_funcs = args.reward_funcs.split()
    if args.reward_funcs is not None:
        from .rewards import resolve_rewards

        # Resolve now so that unknown names, failing imports and weight-count mismatches fail at construction.
        resolve_rewards(list(args.reward_funcs), args.reward_weights)
