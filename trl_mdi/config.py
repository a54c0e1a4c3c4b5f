"""MDIGRPOConfig: GRPOConfig plus the fields of the attention probe and the reward stack."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from .metrics import layer_segments

TEXT_KEY_CHOICES = ("all", "content")


def _reward_names_help() -> str:
    # Generated from the registry so the CLI help never drifts from what exists.
    from .rewards import DEFAULT_REWARD_WEIGHTS, DEFAULT_REWARDS, reward_help

    return (
        "Reward functions by name (default: "
        + " ".join(DEFAULT_REWARDS)
        + f" with reward_weights {' '.join(f'{w:g}' for w in DEFAULT_REWARD_WEIGHTS)}), or custom ones by import "
        "path 'package.module:function'. Available:\n" + reward_help()
    )


@dataclass
class MDIGRPOConfig(GRPOConfig):
    r"""
    Configuration of [`MDIGRPOTrainer`]: every [`trl.GRPOConfig`] field, plus the ones below.

    Parameters:
        > Attention probe (MDI / AEI)

        compute_attention_metrics (`bool`, *optional*, defaults to `True`):
            Measure, after each generation, the attention of the generated tokens on image vs text keys for every
            rollout (exact, O(L) memory; one no-grad forward of the policy per generation batch, or none when TRL
            already runs one for the old log-probs). Feeds the `mdi*` reward fields and the `attention/*` metrics.
        mdi_balance_ratio (`float`, *optional*, defaults to `2.0`):
            R in `balance = clip(1 - |log MDI| / log R, 0, 1)`. Must be > 1. Balance is non-zero only for MDI in
            (1/R, R).
        attention_layer_segments (`str`, *optional*, defaults to `"thirds"`):
            How text layers are grouped for per-segment MDI / AEI: `"thirds"` (early / middle / late) or explicit
            inclusive ranges such as `"early:0-3,middle:4-7,late:8-11"` (negative indices count from the end).
        attention_text_keys (`str`, *optional*, defaults to `"all"`):
            Which prompt keys count as text: `"all"` (every non-image prompt token, chat-template special tokens and
            system prompt included) or `"content"` (special tokens and the system turn are reported separately).

        > Reward stack

        reward_funcs (`list[str]`, *optional*):
            Reward function names from the registry (`trl_mdi.rewards`) or import paths `pkg.module:function`, used
            when the trainer is built without `reward_funcs`. Defaults to `mc_idx think_format mdi_balance` with
            `reward_weights` 4 1 1 when neither is given.
    """

    compute_attention_metrics: bool = field(
        default=True,
        metadata={
            "help": "Measure per-rollout attention of generated tokens on image vs text (MDI, AEI) after each "
            "generation: exact, O(L) memory, at most one extra no-grad forward per generation batch."
        },
    )
    mdi_balance_ratio: float = field(
        default=2.0,
        metadata={"help": "R in balance = clip(1 - |log MDI| / log R, 0, 1); must be > 1."},
    )
    attention_layer_segments: str = field(
        default="thirds",
        metadata={
            "help": "Layer segments for per-segment MDI/AEI: 'thirds' (early/middle/late) or inclusive ranges "
            "like 'early:0-3,middle:4-7,late:8-11' (negative indices count from the end)."
        },
    )
    attention_text_keys: str = field(
        default="all",
        metadata={
            "help": "Which prompt keys count as text: 'all' (special tokens and system prompt included) or "
            "'content' (those reported separately as 'special').",
            "choices": list(TEXT_KEY_CHOICES),
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions by name or 'pkg.module:function' (see the list in the README)."},
    )

    def __post_init__(self):
        super().__post_init__()
        # Validate here, at construction, so a bad flag fails before any model is loaded.
        if not self.mdi_balance_ratio > 1.0:
            raise ValueError(f"mdi_balance_ratio must be > 1 (balance uses log R), got {self.mdi_balance_ratio}")
        if self.attention_text_keys not in TEXT_KEY_CHOICES:
            raise ValueError(
                f"attention_text_keys must be one of {TEXT_KEY_CHOICES}, got {self.attention_text_keys!r}"
            )
        try:
            # Syntax only: the layer count is known once the model is, where ranges are checked again.
            layer_segments(10_000, self.attention_layer_segments)
        except ValueError as e:
            raise ValueError(f"attention_layer_segments: {e}") from None
        if isinstance(self.reward_funcs, str):
            self.reward_funcs = self.reward_funcs.split()
        if self.reward_funcs is not None:
            from .rewards import resolve_rewards

            # Resolve now so that unknown names, failing imports and weight-count mismatches fail at construction.
            resolve_rewards(list(self.reward_funcs), self.reward_weights)
