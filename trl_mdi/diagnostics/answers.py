"""What the logs show of a rollout's task: the gold answer, the parsed answer, the format verdict, and which rewards
say whether it is right. Read from the rows, the answer format and the reward names; nothing here assumes
multiple choice.

* A **multiple-choice row** carries a label (``label_idx``, 0 = A) or ``choices``: the answer the run asks for is
  a letter (``trl_mdi.answer_format``). Its gold answer is the label's letter and choice (``B (red)``), its parsed
  answer the letter ``mc_idx`` reads (``A/B`` for a hedge, None for no letter) and its format verdict the answer
  format's (one think block, then the asked answer line).
* Any other row (math, free-form) gets no parsed answer and no format verdict; its gold answer is its ``solution``
  column (the column TRL's ``accuracy_reward`` reads) when it has one.

The rollout log shows a parsed / gold / format column only when some rollout of the step has one
(``RolloutLogWriter``), so a run on free-form rows has no multiple-choice columns.

The **accuracy rewards** (whose value > 0 marks a rollout right) are those named ``mc_idx*`` or ``accuracy*``; the
console shows their mean, or the first reward's when no reward is named so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ..answer_format import LETTERS
from ..rewards import parse_mc_answer

ACCURACY_PREFIXES = ("mc_idx", "accuracy")
"""Rewards named with one of these prefixes say whether a rollout is right (> 0)."""

SOLUTION_COLUMN = "solution"
"""The gold answer of a row without a multiple-choice label (TRL's ``accuracy_reward`` reads the same column)."""


def accuracy_rewards(reward_names: Sequence[str]) -> tuple[str, ...]:
    """The rewards that say whether a rollout is right.

    >>> accuracy_rewards(["mc_idx", "think_format", "mdi_balance"])
    ('mc_idx',)
    >>> accuracy_rewards(["my_reward"])
    ()
    """
    return tuple(n for n in reward_names if n.startswith(ACCURACY_PREFIXES))


def console_reward_keys(reward_names: Sequence[str]) -> tuple[str, ...]:
    """The reward metrics the console summary shows: the accuracy rewards' means, else the first reward's.

    >>> console_reward_keys(["mc_idx", "think_format"]), console_reward_keys(["my_math", "fmt"])
    (('rewards/mc_idx/mean',), ('rewards/my_math/mean',))
    """
    shown = accuracy_rewards(reward_names) or tuple(reward_names[:1])
    return tuple(f"rewards/{n}/mean" for n in shown)


def _label(row: dict) -> int | None:
    label = row.get("label_idx")
    if label is None or (isinstance(label, float) and math.isnan(label)):
        return None
    return int(label)


def _choices(row: dict) -> list:
    choices = row.get("choices")
    return list(choices) if choices is not None else []


def is_multiple_choice(row: dict) -> bool:
    """Whether the row asks for a letter: it carries a ``label_idx`` or ``choices``.

    >>> is_multiple_choice({"label_idx": 1, "choices": ["a", "b"]}), is_multiple_choice({"solution": "4"})
    (True, False)
    """
    return _label(row) is not None or len(_choices(row)) > 0


def gold_answer(row: dict) -> str | None:
    """The row's gold answer as the logs show it: ``'B (red)'`` from ``label_idx`` and ``choices`` (the letter alone
    without choices), else the ``solution`` column as text; None when the row has neither.

    >>> gold_answer({"label_idx": 1, "choices": ["blue", "red"]}), gold_answer({"label_idx": 2})
    ('B (red)', 'C')
    >>> gold_answer({"solution": "\\\\frac{1}{3}"}), gold_answer({"label_idx": None, "choices": ["a"]})
    ('\\\\frac{1}{3}', None)
    """
    label = _label(row)
    if label is not None:
        choices = _choices(row)
        letter = LETTERS[label] if 0 <= label < len(LETTERS) else str(label)
        return f"{letter} ({choices[label]})" if 0 <= label < len(choices) else letter
    solution = row.get(SOLUTION_COLUMN)
    return None if solution is None else str(solution)


def answer_fields(text: str, row: dict, answer_format: Callable[..., list[float]] | None = None) -> dict[str, Any]:
    """The task fields of one rollout record: ``answer`` (gold), ``parsed`` and ``format_ok``, each present only where
    it applies (see the module docstring). ``answer_format`` is the run's format check
    (``trl_mdi.rewards.ThinkFormatReward``: ``answer_format(texts, choices=...)`` -> 1.0 / 0.0).

    >>> answer_fields("<think>x</think> Answer: A or B", {"label_idx": 0, "choices": ["red", "blue"]})
    {'answer': 'A (red)', 'parsed': 'A/B'}
    >>> answer_fields("<think>x</think> \\\\boxed{4}", {"solution": "4"}), answer_fields("4", {})
    ({'answer': '4'}, {})
    """
    if not is_multiple_choice(row):
        gold = gold_answer(row)
        return {} if gold is None else {"answer": gold}
    choices = _choices(row)
    out = {"answer": gold_answer(row), "parsed": parse_mc_answer(text, len(choices) or 10)[1]}
    if answer_format is not None:
        out["format_ok"] = bool(answer_format([text], choices=[choices or None])[0])
    return out
