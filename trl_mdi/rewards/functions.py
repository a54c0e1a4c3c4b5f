"""The reward functions: ``mc_idx``, ``think_format``, ``mdi_balance``, ``mdi_group``, the reliance rewards
(``visual_gain`` and its forms, ``guarded_visual_gain``) and ``accuracy`` (TRL's ``accuracy_reward``). Each is named
by its registry name: TRL logs a reward under its ``__name__`` (``rewards/<name>/mean``)."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

from trl.rewards import accuracy_reward

from ..answer_format import DEFAULT_ANSWER_PATTERN, clean_format, compile_answer_pattern, hedged_letters
from .parsing import LETTERS, completion_text, extract_choice_letter

__all__ = ["GuardedVisualGainReward", "ThinkFormatReward", "accuracy", "guarded_visual_gain", "bind_think_format", "parse_mc_answer", "mc_idx", "mdi_balance", "mdi_group",
           "think_format_lenient", "think_format"]


def _label_index(label: Any) -> int | None:
    """An int label index, or None for a missing one (None or NaN)."""
    if label is None:
        return None
    if isinstance(label, bool):
        raise ValueError(f"label_idx must be an int index (0 = A), got {label!r}")
    try:
        value = float(label)
    except (TypeError, ValueError):
        raise ValueError(f"label_idx must be an int index (0 = A), got {label!r}") from None
    if math.isnan(value):
        return None
    if not value.is_integer():
        raise ValueError(f"label_idx must be an int index (0 = A), got {label!r}")
    return int(value)


def parse_mc_answer(text: str, num_choices: int = 10) -> tuple[str | None, str | None]:
    """(the letter ``mc_idx`` scores, what the logs show): the tolerant parser's letter, or None with "A/B" shown when
    the answer hedges (``trl_mdi.answer_format.hedged_letters``).

    >>> parse_mc_answer("<think>x</think> Answer: A or B", 4), parse_mc_answer("Answer: C", 4)
    ((None, 'A/B'), ('C', 'C'))
    """
    hedged = hedged_letters(text, num_choices)
    if len(hedged) > 1:
        return None, "/".join(hedged)  # "A or B" answers nothing
    letter = extract_choice_letter(text, num_choices)
    return letter, letter


def mc_idx(
    completions: list,
    label_idx: list,
    choices: list | None = None,
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs,
) -> list[float | None]:
    """Multiple-choice accuracy: 1.0 when the parsed answer letter is the label's, else 0.0.

    ``label_idx`` holds int indices (0 = A); a None or NaN label gives None (not applicable). When
    the dataset has a ``choices`` column (A-OKVQA does), only its first ``len(choices)`` letters can
    be answers, which rules out stray "E".."J"; without it, A-J. Parsing: ``extract_choice_letter``. An answer
    that hedges scores 0: the last answer statement (or, without one, the answer text) names two or more letters
    ("Answer: A or B", "A B"; ``trl_mdi.answer_format.hedged_letters``); a correction that ends on one letter is
    read as that letter.
    A label outside the allowed letters is a data error and raises ValueError. Inside the trainer, the
    parsed letters go to the completions table as column "parsed_choice".

    >>> mc_idx(["Answer: B", [{"role": "assistant", "content": "I'd say A."}], "B", "Answer: A or B"],
    ...               [1, 1, None, 1])
    [1.0, 0.0, None, 0.0]
    """
    if len(label_idx) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(label_idx)} label_idx values")
    rewards: list[float | None] = []
    parsed: list[str | None] = []
    for i, (completion, raw_label) in enumerate(zip(completions, label_idx)):
        row_choices = choices[i] if choices is not None else None
        num_choices = len(row_choices) if row_choices is not None and len(row_choices) > 0 else 10
        letter, shown = parse_mc_answer(completion_text(completion), num_choices)
        parsed.append(shown)
        label = _label_index(raw_label)
        if label is None:
            rewards.append(None)
            continue
        if not 0 <= label < num_choices:
            raise ValueError(
                f"label_idx {label} of row {i} is outside 0..{num_choices - 1} ({num_choices} choices)"
            )
        rewards.append(1.0 if letter == LETTERS[label] else 0.0)
    if log_extra is not None:
        log_extra("parsed_choice", [p or "" for p in parsed])
    return rewards


# ---------------------------------------------------------------------------------------------------
# Format
# ---------------------------------------------------------------------------------------------------

_THINK_FORMAT = re.compile(r"\s*<think>(.*?)</think>(.*)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ThinkFormatReward:
    """Think format: 1.0 when the completion is in the format the system prompt asks, else 0.0.

    One non-empty ``<think>...</think>`` block, then, after optional whitespace, a final line that fully matches
    ``answer_pattern`` (default ``Answer: X``, X a letter valid for the row's ``choices``, or any capital letter
    where the row has none), and nothing but whitespace after it (``trl_mdi.answer_format.clean_format``). With
    ``think_prefilled`` (the chat template opens ``<think>`` in the prompt, as Qwen3 thinking templates do) the
    completion's own ``</think>`` closes the block. The trainer binds ``answer_pattern`` from
    ``MDIGRPOConfig.answer_pattern`` and ``think_prefilled`` from the chat template.

    Why strict: a reward that pays for any text after ``</think>`` lets GRPO drift to junk such as
    ``Answer" A`` or ``AnswerYou A`` that the answer parser still reads (seen in the demo before this reward).
    The lenient reward remains as ``think_format_lenient``.

    >>> ThinkFormatReward()(["<think>It is red.</think>\\nAnswer: A", "<think>It is red.</think>\\nAnswers A"],
    ...                     choices=[["red", "blue"]] * 2)
    [1.0, 0.0]
    """

    answer_pattern: str = DEFAULT_ANSWER_PATTERN
    think_prefilled: bool = False
    __name__ = "think_format"  # TRL logs rewards/<__name__>/...

    def __post_init__(self):
        compile_answer_pattern(self.answer_pattern)  # a bad pattern fails at construction

    def __call__(self, completions: list, choices: list | None = None, **kwargs) -> list[float]:
        pattern = compile_answer_pattern(self.answer_pattern)
        rows = choices if choices is not None else [None] * len(completions)
        return [1.0 if clean_format(completion_text(c), pattern, ch, think_prefilled=self.think_prefilled) else 0.0
                for c, ch in zip(completions, rows)]


think_format = ThinkFormatReward()


def bind_think_format(reward_funcs: list, **settings) -> list:
    """The reward list with every reward that checks the format (``ThinkFormatReward``, ``GuardedVisualGainReward``)
    replaced by a copy holding ``settings`` (answer_pattern, think_prefilled): the registry's default instances are
    never changed."""
    bound = (ThinkFormatReward, GuardedVisualGainReward)
    return [dataclasses.replace(f, **settings) if isinstance(f, bound) else f for f in reward_funcs]


def think_format_lenient(completions: list, **kwargs) -> list[float]:
    """Lenient think format: 1.0 for one non-empty <think>...</think> block followed by any non-empty text.

    The completion must open with ``<think>`` (leading whitespace allowed), hold exactly one ``<think>`` and one
    ``</think>``, some reasoning between them and some answer text after them. It pays for answers in any shape
    (``Answer" A`` included): use ``think_format`` (the default) unless a free-form answer is wanted.

    >>> think_format_lenient(["<think>It is red.</think>Answer: A", "<think></think>Answer: A",
    ...                              [{"role": "assistant", "content": "Answer: A"}]])
    [1.0, 0.0, 0.0]
    """
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        m = _THINK_FORMAT.fullmatch(text)
        ok = (
            m is not None
            and text.count("<think>") == 1
            and text.count("</think>") == 1
            and m.group(1).strip() != ""
            and m.group(2).strip() != ""
        )
        rewards.append(1.0 if ok else 0.0)
    return rewards


def accuracy(completions: list, solution: list, **kwargs) -> list[float | None]:
    """Math accuracy: TRL's ``accuracy_reward`` (math-verify: 1.0 when the answer equals ``solution``), None where the
    gold answer does not parse.

    Under the registry's name: TRL's function is named ``accuracy_reward``, and TRL logs a reward by its name.
    """
    return accuracy_reward(completions, solution, **kwargs)


# ---------------------------------------------------------------------------------------------------
# MDI rewards
# ---------------------------------------------------------------------------------------------------


def _optional_float(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def mdi_balance(completions: list, mdi_balance: list, **kwargs) -> list[float | None]:
    """MDI balance: 2 * balance - 1, with balance = clip(1 - |log MDI| / log R, 0, 1) (docs/rewards.md).

    ``mdi_balance`` is computed per rollout by the trainer (``trl_mdi.attention.metrics.mdi_balance``) and
    passed as a list of float or None; None or NaN (no image tokens, hence no MDI) stays None.
    Balance is 0 for every MDI outside (1/R, R), so with typical MDI of 5-17 this reward is -1 for the
    whole group and carries no GRPO signal; see ``mdi_group``.

    >>> mdi_balance(["a", "b", "c"], [1.0, 0.0, None])
    [1.0, -1.0, None]
    """
    if len(mdi_balance) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(mdi_balance)} mdi_balance values")
    out = []
    for value in mdi_balance:
        value = _optional_float(value)
        out.append(None if value is None else 2.0 * value - 1.0)
    return out


def mdi_group(completions: list, mdi_group_score: list, **kwargs) -> list[float | None]:
    """Group-relative MDI balance: the trainer's group_relative_mdi_score, in [-1, 1], None when NaN.

    >>> mdi_group(["a", "b", "c"], [1.0, -1.0, float("nan")])
    [1.0, -1.0, None]
    """
    if len(mdi_group_score) != len(completions):
        raise ValueError(
            f"got {len(completions)} completions but {len(mdi_group_score)} mdi_group_score values"
        )
    return [_optional_float(value) for value in mdi_group_score]


ANSWER_GAIN_CLIP = 4.0
"""G of ``answer_visual_gain``: gains are paid up to G nats (a 55-fold likelier answer with the image)."""


def _clipped_gain(completions: list, values: list, clip: float, name: str) -> list[float | None]:
    if len(values) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(values)} {name} values")
    out = []
    for value in values:
        value = _optional_float(value)
        out.append(None if value is None else min(max(value, 0.0), clip) / clip)
    return out


def answer_visual_gain(completions: list, answer_visual_gain: list, **kwargs) -> list[float | None]:
    """Pays the answer's visual gain: ``clip(g, 0, G) / G`` with ``g = log p(answer | I) - log p(answer | I')``
    (the trainer's ``answer_visual_gain``, summed over the answer letter's tokens, in nats) and ``G =
    ANSWER_GAIN_CLIP``; None where the rollout has no answer line or no image.

    Why clipped: maximising a counterfactual gap without bound invites "KL hacking" (PAPO): the policy can widen
    the gap with junk that makes the counterfactual improbable. The clip caps what the gap can earn, a rollout
    without an answer line earns nothing here (None), and the strict format reward keeps the answer line honest;
    watch ``reliance/answer_rate``, the completion entropy and the clip ratio for the failure's early signs
    (docs/reliance.md).

    >>> answer_visual_gain(["a", "b", "c", "d"], [2.0, -1.0, 9.0, None])
    [0.5, 0.0, 1.0, None]
    """
    return _clipped_gain(completions, answer_visual_gain, ANSWER_GAIN_CLIP, "answer_visual_gain")


VISUAL_GAIN_CLIP = 0.5
"""G of ``visual_gain`` (nats per completion token)."""

VISUAL_GAIN_SUM_CLIP = 4.0
"""G of ``visual_gain_sum`` (nats over the completion)."""


def visual_gain(completions: list, visual_gain: list, **kwargs) -> list[float | None]:
    """Pays the completion's visual gain: ``clip(g, 0, G) / G`` with ``g`` the trainer's ``visual_gain``, the mean
    over completion tokens of ``log p(y_t | I) - log p(y_t | I')`` (nats per token), ``G = VISUAL_GAIN_CLIP``; None
    without an image. Unlike ``answer_visual_gain`` it sees the image's evidence where a chain of thought takes it in
    (a colour read off the image), not only at the answer letter, which follows the chain in both passes. Clipped
    for the reason ``answer_visual_gain`` gives (docs/reliance.md).

    >>> visual_gain(["a", "b", "c", "d"], [0.25, -0.1, 3.0, None])
    [0.5, 0.0, 1.0, None]
    """
    return _clipped_gain(completions, visual_gain, VISUAL_GAIN_CLIP, "visual_gain")


def visual_gain_sum(completions: list, visual_gain_sum: list, **kwargs) -> list[float | None]:
    """The sum form of ``visual_gain``: ``clip(g, 0, G) / G`` with ``g`` the trainer's ``visual_gain_sum``
    (nats over the completion), ``G = VISUAL_GAIN_SUM_CLIP``: a long chain that reads the image once is not diluted,
    but a longer chain can also collect more.

    >>> visual_gain_sum(["a", "b"], [2.0, None])
    [0.5, None]
    """
    return _clipped_gain(completions, visual_gain_sum, VISUAL_GAIN_SUM_CLIP, "visual_gain_sum")


def answer_visual_gain_group(completions: list, answer_visual_gain_group_score: list,
                                    **kwargs) -> list[float | None]:
    """Group-relative answer visual gain: the rank of ``answer_visual_gain`` inside the prompt's group, in [-1, 1]
    (the trainer's ``answer_visual_gain_group_score``, ranked over the group gathered from every process; the
    largest gain gets 1), None where undefined. Only the order counts, so weight it as ``mdi_group``.

    >>> answer_visual_gain_group(["a", "b"], [1.0, float("nan")])
    [1.0, None]
    """
    if len(answer_visual_gain_group_score) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(answer_visual_gain_group_score)} "
                         "answer_visual_gain_group_score values")
    return [_optional_float(value) for value in answer_visual_gain_group_score]


# ---------------------------------------------------------------------------------------------------
# The guarded reliance reward
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GuardedVisualGainReward:
    """Guarded reliance reward: the largest token gain the image gave a right, well-formed rollout, in flat steps.

    With ``g = visual_gain_max`` (the trainer's per-rollout max over completion tokens of ``g_t = log p(y_t | I) -
    log p(y_t | I')``, in nats), thresholds ``t_k = dead_zone + k (saturation - dead_zone) / (steps - 1)`` for
    ``k = 0 .. steps-1``::

        r = 0                                  if the answer is wrong (mc_idx 0) or the format is not clean
                                               (think_format 0)
        r = #{k : g >= t_k} / steps            otherwise: 0 below ``dead_zone``, 1 from ``saturation`` on
        r = None                               no label (mc_idx's None) or no gain (no image: g None / NaN)

    Why each part (docs/rewards.md, "The guarded reliance reward"):

    - **Gate.** It pays only where the answer and format earn their own rewards, so no reliance reward can buy a
      wrong or malformed rollout an advantage over a right one.
    - **Where the answer is decided.** The largest token gain is the token the image made likeliest (a colour word
      read off the image): a shortened or reshaped chain does not raise it, where the completion mean
      ``visual_gain`` rises when words are dropped (benchmarks/RESULTS.md, Look or guess).
    - **Saturation** at the gain an honest looking rollout earns, so there is nothing to win by pushing the gain
      further (PAPO's "KL hacking").
    - **Dead zone and steps.** TRL scales each group's rewards by their std (``scale_rewards="group"``, the
      default), so any consistent difference, however small, becomes a full advantage where the other rewards tie.
      The reward is flat below ``dead_zone``, flat from ``saturation`` on, and constant between thresholds: two
      rollouts whose gains lie between the same two thresholds earn equal rewards, and a group whose gains all lie
      there gets zero advantage from it. Numerical noise (~1e-3 nats) can move a rollout only across a threshold it
      already sits on.

    The defaults were set on the look-or-guess development split (800 rollouts of the warm-up, counterfactual
    ``none``; benchmarks/RESULTS.md, "Look or guess, replication"): the look style's largest token gain has median
    0.51 nats (quartiles 0.21 and 5.2), the guess style's 99th percentile is 0.07 nats. So ``dead_zone`` 0.1 (above
    99% of guessing rollouts, 20x numerical noise) and ``saturation`` 0.5 (the median honest look). On your own
    model, look at ``reliance/visual_gain_max`` in a short run and set them the same way.

    ``answer_pattern`` / ``think_prefilled`` are bound by the trainer as for ``think_format``.

    >>> r = GuardedVisualGainReward()
    >>> ok = "<think> the shape is red</think>\\nAnswer: A"
    >>> r([ok, ok, ok, ok, ok], visual_gain_max=[0.05, 0.2, 0.4, 0.6, 3.0], label_idx=[0] * 5)
    [0.0, 0.3333333333333333, 0.6666666666666666, 1.0, 1.0]
    >>> r([ok, "<think> red</think>\\nAnswer: B", "Answer: A", ok], visual_gain_max=[3.0, 3.0, 3.0, None],
    ...   label_idx=[0, 0, 0, 0])
    [1.0, 0.0, 0.0, None]
    """

    dead_zone: float = 0.1
    saturation: float = 0.5
    steps: int = 3
    answer_pattern: str = DEFAULT_ANSWER_PATTERN
    think_prefilled: bool = False
    __name__ = "guarded_visual_gain"  # TRL logs rewards/<__name__>/...

    def __post_init__(self):
        if not (math.isfinite(self.dead_zone) and math.isfinite(self.saturation)) or not (
                0 <= self.dead_zone < self.saturation):
            raise ValueError(f"guarded_visual_gain needs 0 <= dead_zone < saturation (finite, nats), got dead_zone="
                             f"{self.dead_zone!r}, saturation={self.saturation!r}; e.g. dead_zone=0.1, saturation=0.5")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"guarded_visual_gain needs steps >= 1 (an int), got {self.steps!r}; e.g. steps=3")
        compile_answer_pattern(self.answer_pattern)

    @property
    def thresholds(self) -> list[float]:
        """The gains (nats) at which the reward steps up: ``dead_zone`` ... ``saturation``."""
        if self.steps == 1:
            return [self.saturation]
        width = (self.saturation - self.dead_zone) / (self.steps - 1)
        # Rounded: 0.1 + 0.2 is 0.30000000000000004, which would put a gain of exactly 0.3 below its threshold.
        return [round(self.dead_zone + k * width, 12) for k in range(self.steps - 1)] + [self.saturation]

    def level(self, gain: float) -> float:
        """The reward of a right, well-formed rollout with largest token gain ``gain`` (nats)."""
        return sum(gain >= t for t in self.thresholds) / self.steps

    def __call__(self, completions: list, visual_gain_max: list, label_idx: list, choices: list | None = None,
                 **kwargs) -> list[float | None]:
        if len(visual_gain_max) != len(completions):
            raise ValueError(f"got {len(completions)} completions but {len(visual_gain_max)} visual_gain_max values")
        right = mc_idx(completions, label_idx, choices=choices)
        clean = ThinkFormatReward(self.answer_pattern, self.think_prefilled)(completions, choices=choices)
        out: list[float | None] = []
        for answer, form, value in zip(right, clean, visual_gain_max):
            gain = _optional_float(value)
            if answer is None or gain is None:
                out.append(None)
            elif answer == 0.0 or form == 0.0:
                out.append(0.0)
            else:
                out.append(self.level(gain))
        return out


guarded_visual_gain = GuardedVisualGainReward()
