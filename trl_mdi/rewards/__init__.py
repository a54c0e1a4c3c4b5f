"""Reward functions for GRPO on vision-language models, their registry, and two pure group helpers.

Every reward follows TRL's signature ``fn(completions, <named columns or trainer fields>, **kwargs)
-> list[float | None]``; ``None`` means "not applicable to this rollout" (TRL turns it into NaN and
leaves it out of that reward). Completions may be strings or message lists
``[{"role": "assistant", "content": ...}]``; ``completion_text`` reads both.

One name per reward: the registry key is the function's ``__name__``, so config, YAML, logs and metrics
(``rewards/<name>/mean``) all say the same.

    name                      needs                                         returns
    mc_idx                    dataset column label_idx                      1 / 0, None without a label
    think_format              row choices (optional)                        1 / 0: the asked format (answer_format)
    think_format_lenient      -                                             1 / 0: any text after </think>
    mdi_balance               trainer field mdi_balance                     2 * balance - 1 in [-1, 1]
    mdi_group                 trainer field mdi_group_score                 group-relative, in [-1, 1]
    accuracy                  dataset column solution                       TRL's math-verify accuracy_reward
    answer_visual_gain        trainer field answer_visual_gain              clip(g, 0, 4) / 4
    answer_visual_gain_group  trainer field answer_visual_gain_group_score  group-relative, in [-1, 1]
    visual_gain               trainer field visual_gain                     clip(g, 0, 0.5) / 0.5 (mean over it)
    visual_gain_sum           trainer field visual_gain_sum                 clip(g, 0, 4) / 4 (sum over it)
    guarded_visual_gain       trainer field visual_gain_max, label_idx      0, 1/3, 2/3, 1 (right and clean only)

A reward states what it needs as named parameters without defaults; ``required_reward_inputs`` reads
them from the signature, so a custom reward given by import path is checked the same way
(``trl_mdi.rewards.inputs.check_reward_inputs``) and a plain GRPOTrainer that does not provide ``mdi_balance``
fails loudly.

``zero_spread_fraction`` (logged as ``rewards/<name>/zero_spread_frac``) is a pure tensor helper the trainer calls;
``count_outcomes`` / ``RewardTally`` / ``outcome_metrics`` (``outcomes``) count the None and NaN values each reward
returns, before TRL merges them (``rewards/<name>/none_frac``, ``rewards/<name>/nan_frac``);
the per-rollout fields the MDI rewards read (``mdi_balance``, ``mdi_group_score``, ...) are computed in
``trl_mdi.signals``.

Layout: ``parsing`` (completion text, answer letters), ``functions`` (the rewards), ``groups`` (group
helpers), ``registry`` (names, defaults, resolution). Everything is re-exported here, so
``trl_mdi.rewards.<name>`` and import paths such as ``"trl_mdi.rewards:mc_idx"`` work.
"""

from .functions import (
    ANSWER_GAIN_CLIP,
    VISUAL_GAIN_CLIP,
    VISUAL_GAIN_SUM_CLIP,
    GuardedVisualGainReward,
    ThinkFormatReward,
    accuracy,
    answer_visual_gain,
    answer_visual_gain_group,
    bind_think_format,
    guarded_visual_gain,
    mc_idx,
    mdi_balance,
    mdi_group,
    parse_mc_answer,
    think_format,
    think_format_lenient,
    visual_gain,
    visual_gain_sum,
)
from .groups import zero_spread_fraction
from .outcomes import RewardTally, count_outcomes, outcome_metrics
from .parsing import LETTERS as LETTERS
from .parsing import completion_text, extract_choice_letter
from .registry import (
    DEFAULT_REWARD_WEIGHTS,
    DEFAULT_REWARDS,
    REQUIRED_COLUMNS,
    REWARD_REGISTRY,
    required_reward_inputs,
    resolve_rewards,
    reward_help,
)
from .registry import TRL_PROVIDED as TRL_PROVIDED
from .registry import default_reward_stack as default_reward_stack
from .registry import resolve_reward_funcs as resolve_reward_funcs
from .registry import reward_name as reward_name

__all__ = [
    "DEFAULT_REWARDS",
    "DEFAULT_REWARD_WEIGHTS",
    "REQUIRED_COLUMNS",
    "REWARD_REGISTRY",
    "ANSWER_GAIN_CLIP",
    "VISUAL_GAIN_CLIP",
    "VISUAL_GAIN_SUM_CLIP",
    "visual_gain",
    "visual_gain_sum",
    "GuardedVisualGainReward",
    "guarded_visual_gain",
    "accuracy",
    "answer_visual_gain_group",
    "answer_visual_gain",
    "completion_text",
    "extract_choice_letter",
    "mc_idx",
    "mdi_balance",
    "mdi_group",
    "required_reward_inputs",
    "resolve_rewards",
    "reward_help",
    "think_format",
    "think_format_lenient",
    "ThinkFormatReward",
    "bind_think_format",
    "parse_mc_answer",
    "zero_spread_fraction",
    "count_outcomes",
    "RewardTally",
    "outcome_metrics",
]
