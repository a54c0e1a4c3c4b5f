"""Reward functions for GRPO on vision-language models, their registry, and two pure group helpers.

Every reward follows TRL's signature ``fn(completions, <named columns or trainer fields>, **kwargs)
-> list[float | None]``; ``None`` means "not applicable to this rollout" (TRL turns it into NaN and
leaves it out of that reward). Completions may be strings or message lists
``[{"role": "assistant", "content": ...}]``; ``completion_text`` reads both.

    name          function              needs                        returns
    mc_idx        mc_idx_reward         dataset column label_idx     1 / 0, None without a label
    think_format  think_format_reward   -                            1 / 0
    mdi_balance   mdi_balance_reward    trainer field mdi_balance    2 * balance - 1 in [-1, 1]
    mdi_group     mdi_group_reward      trainer field mdi_group_score  group-relative, in [-1, 1]
    accuracy      accuracy_reward       dataset column solution      TRL's math-verify reward

A reward states what it needs as named parameters without defaults; ``required_reward_inputs`` reads
them from the signature, so a custom reward given by import path is checked the same way
(``check_reward_columns``) and a plain GRPOTrainer that does not provide ``mdi_balance`` fails loudly.

Pure tensor helpers the trainer calls: ``group_relative_mdi_score`` (computes ``mdi_group_score``) and
``zero_spread_fraction`` (logged as ``rewards/<name>/zero_spread_frac``).
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
import unicodedata
from collections.abc import Callable, Sequence
from typing import Any

import torch
from trl.rewards import accuracy_reward

__all__ = [
    "DEFAULT_REWARDS",
    "DEFAULT_REWARD_WEIGHTS",
    "REQUIRED_COLUMNS",
    "REWARD_REGISTRY",
    "TRAINER_FIELDS",
    "accuracy_reward",
    "check_reward_columns",
    "completion_text",
    "extract_choice_letter",
    "group_relative_mdi_score",
    "mc_idx_reward",
    "mdi_balance_reward",
    "mdi_group_reward",
    "required_reward_inputs",
    "resolve_rewards",
    "reward_help",
    "think_format_reward",
    "zero_spread_fraction",
]

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

# Keyword arguments GRPOTrainer passes to every reward itself; they are never dataset columns.
TRL_PROVIDED = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
)

# Per-rollout values our trainer computes and adds to every input row before the rewards run.
TRAINER_FIELDS: tuple[str, ...] = ("mdi_balance", "mdi_group_score")


# ---------------------------------------------------------------------------------------------------
# Completion text
# ---------------------------------------------------------------------------------------------------


def completion_text(completion: Any) -> str:
    """The text of one completion: a string, one message dict, or a list of messages.

    For messages, the contents of the assistant messages (a message without a role counts as one)
    are joined by newlines; a content given as parts ``[{"type": "text", "text": ...}]`` is joined too.

    >>> completion_text("Answer: B")
    'Answer: B'
    >>> completion_text([{"role": "assistant", "content": [{"type": "text", "text": "Answer: B"}]}])
    'Answer: B'
    """
    if isinstance(completion, str):
        return completion
    messages = [completion] if isinstance(completion, dict) else list(completion)
    texts = []
    for message in messages:
        if message.get("role", "assistant") != "assistant":
            continue
        content = message.get("content") or ""
        if not isinstance(content, str):
            content = "".join(p.get("text") or "" for p in content if p.get("type", "text") == "text")
        texts.append(content)
    return "\n".join(texts)


# ---------------------------------------------------------------------------------------------------
# Multiple-choice answer parsing
# ---------------------------------------------------------------------------------------------------

# A choice letter: optionally opened by a bracket, never glued to a letter, digit, apostrophe or hyphen
# on its right ("Answer: It", "I'm", "A-frame" are not letters). Checked right after the letter, so
# trailing spaces cannot be used to slip past it.
_LETTER = r"[(\[]?\s*([A-Za-z])(?![A-Za-z0-9'’\-])"
# Separators between a keyword and its letter: spaces, colons, markdown emphasis and headers, quotes.
_SEP = r"[\s:=*_\"'`>#\-]*"
_COPULA = (
    r"(?:(?:is|was|would\s+be|should\s+be|must\s+be|will\s+be)(?![A-Za-z])"
    r"(?:\s+(?:likely|probably|clearly|therefore|thus|definitely))?|应该是|应为|是|为|选)"
)
_OPTION = r"(?:(?:option|choice)(?![A-Za-z])|选项|选择|选)"

# Tier 1, explicit answer statements: "Answer: X", "Final answer: X", "the answer is (c)", "答案：X",
# "答案是X", "\boxed{X}".
_TIER_ANSWER = (
    re.compile(
        rf"(?<![A-Za-z])(?:answer(?![A-Za-z])|答案){_SEP}(?:{_COPULA}{_SEP})?(?:{_OPTION}{_SEP})?{_LETTER}",
        re.IGNORECASE,
    ),
    re.compile(rf"\\boxed\{{\s*(?:\\text(?:bf)?\{{\s*)?{_LETTER}"),
)
# Tier 2, option mentions: "option C", "the correct choice is b", "选项 X", "故选B".
_TIER_OPTION = (re.compile(rf"(?<![A-Za-z]){_OPTION}{_SEP}(?:{_COPULA}{_SEP})?{_LETTER}", re.IGNORECASE),)
# Tier 3, a standalone capital letter: "(B)", "B." at line start, "**C**", "... so D".
_TIER_STRAY = (re.compile(r"(?<![A-Za-z0-9'’\-])([A-Z])(?![A-Za-z0-9'’\-])"),)
_TIERS = (_TIER_ANSWER, _TIER_OPTION, _TIER_STRAY)

# A or I followed on the same line by a lowercase word is the article / the pronoun ("A cat is ...",
# "I think ..."), unless that word is one that follows a choice letter ("A is correct", "A or B").
_NEXT_WORD = re.compile(r"[ \t]+([a-z]+)")
_LETTER_FOLLOWERS = frozenset(
    "is was seems appears looks matches fits and or vs versus because since".split()
)
_THINK_CLOSE = "</think>"


def _is_word_not_letter(text: str, letter: str, end: int) -> bool:
    if letter not in "AaIi":
        return False
    m = _NEXT_WORD.match(text, end)
    return m is not None and m.group(1) not in _LETTER_FOLLOWERS


def _last_letter(text: str, valid: str) -> str | None:
    """The last valid letter of the highest tier that has one."""
    for tier in _TIERS:
        best: tuple[int, str] | None = None
        for pattern in tier:
            for m in pattern.finditer(text):
                letter = m.group(1)
                if letter.upper() in valid and not _is_word_not_letter(text, letter, m.end(1)):
                    if best is None or m.start(1) > best[0]:
                        best = (m.start(1), letter.upper())
        if best is not None:
            return best[1]
    return None


def extract_choice_letter(text: str, num_choices: int = 10) -> str | None:
    """The multiple-choice letter a completion answers with, or None when it names none.

    Text is NFKC-normalised first (full-width "Ａ", "：", "（Ｂ）" become "A", ":", "(B)"). Candidates come
    in three tiers; the LAST candidate of the highest non-empty tier wins, so a corrected answer
    ("Answer: A ... final answer: C") counts as C and an explicit answer beats any stray letter:

    1. explicit answer statements: "Answer: X", "Final answer: X", "the answer is c", "**Answer:** (B)",
       "答案：X", "答案: X", "答案是X", "\\boxed{X}" (the letter may be lowercase here);
    2. option mentions: "option C", "the correct choice is b", "选项 X", "故选B";
    3. a standalone capital letter: "(B)", "B." at line start, "**C**", "... so D".

    A letter counts only when no letter, digit, apostrophe or hyphen is glued to it ("It", "I'm",
    "A-frame" are not answers) and when it lies in the first ``num_choices`` letters.

    Article rule: "A" (or "a") followed on the same line by a lowercase word is the English article,
    and "I" followed by one is the pronoun ("A cat sits", "I think", "the answer is a dog"), except
    when that word is one that follows a choice letter: is, was, seems, appears, looks, matches, fits,
    and, or, vs, versus, because, since ("A is correct", "A or B"). Other capitals never read as words,
    so "B cat" is B. A letter closed by punctuation ("A.", "(A)", "A,") is always a letter.
    Known misreads in tier 3: initials and abbreviations ("J. Smith", "E. coli", "D.C.").

    Think block: when the text after the last "</think>" names a letter (any tier), only that text is
    read; otherwise the whole text is (the model may have answered only inside its reasoning, or
    been cut off before closing it).

    >>> extract_choice_letter("<think>B looks wrong, so not B.</think>\\nAnswer: (c)", num_choices=4)
    'C'
    >>> extract_choice_letter("A cat sits on a mat. I think the right one is D.")
    'D'
    >>> extract_choice_letter("答案：Ｂ"), extract_choice_letter("No idea.")
    ('B', None)
    """
    if not 1 <= num_choices <= len(LETTERS):
        raise ValueError(f"num_choices must be in 1..{len(LETTERS)}, got {num_choices}")
    valid = LETTERS[:num_choices]
    text = unicodedata.normalize("NFKC", text)
    if _THINK_CLOSE in text:
        letter = _last_letter(text.rsplit(_THINK_CLOSE, 1)[1], valid)
        if letter is not None:
            return letter
    return _last_letter(re.sub(r"</?think>", " ", text), valid)


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


def mc_idx_reward(
    completions: list,
    label_idx: list,
    choices: list | None = None,
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs,
) -> list[float | None]:
    """Multiple-choice accuracy: 1.0 when the parsed answer letter is the label's, else 0.0.

    ``label_idx`` holds int indices (0 = A); a None or NaN label gives None (not applicable). When
    the dataset has a ``choices`` column (A-OKVQA does), only its first ``len(choices)`` letters can
    be answers, which rules out stray "E".."J"; without it, A-J. Parsing: ``extract_choice_letter``.
    A label outside the allowed letters is a data error and raises ValueError. Inside the trainer, the
    parsed letters go to the completions table as column "parsed_choice".

    >>> mc_idx_reward(["Answer: B", [{"role": "assistant", "content": "I'd say A."}], "B"], [1, 1, None])
    [1.0, 0.0, None]
    """
    if len(label_idx) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(label_idx)} label_idx values")
    rewards: list[float | None] = []
    parsed: list[str | None] = []
    for i, (completion, raw_label) in enumerate(zip(completions, label_idx)):
        row_choices = choices[i] if choices is not None else None
        num_choices = len(row_choices) if row_choices is not None and len(row_choices) > 0 else 10
        letter = extract_choice_letter(completion_text(completion), num_choices)
        parsed.append(letter)
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


def think_format_reward(completions: list, **kwargs) -> list[float]:
    """Think format: 1.0 for one non-empty <think>...</think> block followed by a non-empty answer.

    The completion must open with ``<think>`` (leading whitespace allowed), hold exactly one
    ``<think>`` and one ``</think>``, some reasoning between them and some answer text after them.

    Why not TRL's ``trl.rewards.think_format_reward``: it fits our templates in one respect (Qwen2.5-VL,
    Qwen3-VL and SmolVLM do not prefill "<think>", so the model writes the opening tag), but it pays
    1.0 for an empty ``<think></think>``, for a completion that stops right after ``</think>`` and for
    a stray second ``</think>``: exactly the shortcuts a policy learns when format is rewarded.
    It also reads only message lists. With a template that prefills "<think>" into the prompt
    (Qwen3.5 thinking), every completion here scores 0; ``zero_spread_fraction`` makes that visible.

    >>> think_format_reward(["<think>It is red.</think>Answer: A", "<think></think>Answer: A",
    ...                      [{"role": "assistant", "content": "Answer: A"}]])
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


# ---------------------------------------------------------------------------------------------------
# MDI rewards
# ---------------------------------------------------------------------------------------------------


def _optional_float(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def mdi_balance_reward(completions: list, mdi_balance: list, **kwargs) -> list[float | None]:
    """MDI balance (product brief): 2 * balance - 1, with balance = clip(1 - |log MDI| / log R, 0, 1).

    ``mdi_balance`` is computed per rollout by the trainer (``trl_mdi.metrics.mdi_balance``) and
    passed as a list of float or None; None or NaN (no image tokens, hence no MDI) stays None.
    Balance is 0 for every MDI outside (1/R, R), so with typical MDI of 5-17 this reward is -1 for the
    whole group and carries no GRPO signal; see ``mdi_group_reward``.

    >>> mdi_balance_reward(["a", "b", "c"], [1.0, 0.0, None])
    [1.0, -1.0, None]
    """
    if len(mdi_balance) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(mdi_balance)} mdi_balance values")
    out = []
    for value in mdi_balance:
        value = _optional_float(value)
        out.append(None if value is None else 2.0 * value - 1.0)
    return out


def mdi_group_reward(completions: list, mdi_group_score: list, **kwargs) -> list[float | None]:
    """Group-relative MDI balance: the trainer's group_relative_mdi_score, in [-1, 1], None when NaN.

    >>> mdi_group_reward(["a", "b", "c"], [1.0, -1.0, float("nan")])
    [1.0, -1.0, None]
    """
    if len(mdi_group_score) != len(completions):
        raise ValueError(
            f"got {len(completions)} completions but {len(mdi_group_score)} mdi_group_score values"
        )
    return [_optional_float(value) for value in mdi_group_score]


def _groups(x: torch.Tensor, num_generations: int) -> torch.Tensor:
    if num_generations < 1 or x.shape[0] % num_generations:
        raise ValueError(
            f"{x.shape[0]} rollouts do not split into groups of num_generations={num_generations}"
        )
    return x.reshape(x.shape[0] // num_generations, num_generations, *x.shape[1:])


def group_relative_mdi_score(mdi: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Rank-based MDI balance within each group of rollouts of the same prompt, in [-1, 1].

    Why: the brief's reward ``2 * clip(1 - |log MDI| / log R, 0, 1) - 1`` is the same -1 for every
    MDI outside (1/R, R). Typical MDI is 5-17, so usually the whole group sits outside, the reward is
    constant within the group and its GRPO advantage is zero: no signal. Ranking |log MDI| inside the
    group always separates rollouts, whatever the absolute level.

    ``mdi`` is (N,) with the ``num_generations`` rollouts of one prompt consecutive (TRL's sampler
    order; gather across processes first, groups can span them). Within a group, with rank_i the
    0-based ascending rank of |log MDI_i| among the valid rollouts (ties get their average rank):

        score_i = 1 - 2 * rank_i / (n_valid - 1)

    so the most balanced rollout gets 1, the least -1, and the scores of a group sum to zero. NaN MDI
    (no image tokens) or a negative one gets NaN and is left out of the ranking; a group with one
    valid rollout gives it 0. MDI 0 or inf count as maximally unbalanced (|log MDI| = inf, tied).
    Only the order matters: a tiny MDI difference earns the full spread, so weight it accordingly.

    >>> group_relative_mdi_score(torch.tensor([8.0, 2.0, 16.0, 4.0, 5.0, 5.0, float("nan"), 1.0]), 4)
    tensor([-0.3333,  1.0000, -1.0000,  0.3333, -0.5000, -0.5000,     nan,  1.0000])
    """
    if mdi.dim() != 1:
        raise ValueError(f"mdi must be 1-D (N,), got shape {tuple(mdi.shape)}")
    x = _groups(mdi.double().log().abs(), num_generations)  # (groups, G)
    valid = ~x.isnan()
    xi, xj, valid_j = x.unsqueeze(-1), x.unsqueeze(-2), valid.unsqueeze(-2)
    below = ((xj < xi) & valid_j).sum(-1).double()
    tied = ((xj == xi) & valid_j).sum(-1).double()  # counts itself when valid
    rank = below + (tied - 1) / 2
    n_valid = valid.sum(-1, keepdim=True).double()
    score = torch.where(n_valid > 1, 1 - 2 * rank / (n_valid - 1).clamp(min=1), torch.zeros_like(rank))
    score = torch.where(valid, score, torch.full_like(score, math.nan))
    dtype = mdi.dtype if mdi.is_floating_point() else torch.float32
    return score.reshape(-1).to(dtype)


def zero_spread_fraction(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Per reward function, the fraction of groups in which it carries no GRPO signal, (N, F) -> (F,).

    A group has zero spread for a function when all its non-NaN values are equal. A group with one
    non-NaN value or none counts as zero spread too: it cannot rank its rollouts (TRL gives such
    values zero advantage). The denominator is all groups; with no groups the result is NaN.
    Rollouts of a prompt are consecutive, as in ``group_relative_mdi_score``.

    >>> nan = float("nan")
    >>> r = torch.tensor([[1.0, -1.0], [0.0, -1.0], [1.0, nan], [1.0, nan]])
    >>> zero_spread_fraction(r, 2)
    tensor([0.5000, 1.0000])
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be 2-D (N, num_funcs), got shape {tuple(rewards.shape)}")
    r = _groups(rewards.double(), num_generations)  # (groups, G, F)
    valid = ~r.isnan()
    hi = torch.where(valid, r, torch.full_like(r, -math.inf)).amax(dim=1)
    lo = torch.where(valid, r, torch.full_like(r, math.inf)).amin(dim=1)
    flat = (valid.sum(dim=1) <= 1) | (hi == lo)  # (groups, F)
    return flat.float().mean(dim=0)


# ---------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------

REWARD_REGISTRY: dict[str, Callable[..., list[float | None]]] = {
    "mc_idx": mc_idx_reward,
    "think_format": think_format_reward,
    "mdi_balance": mdi_balance_reward,
    "mdi_group": mdi_group_reward,
    "accuracy": accuracy_reward,
}
DEFAULT_REWARDS: tuple[str, ...] = ("mc_idx", "think_format", "mdi_balance")
DEFAULT_REWARD_WEIGHTS: tuple[float, ...] = (4.0, 1.0, 1.0)

# Dataset column each registry reward reads (tests check these agree with the signatures).
REQUIRED_COLUMNS: dict[str, str] = {"mc_idx": "label_idx", "accuracy": "solution"}


def required_reward_inputs(reward_func: Callable) -> tuple[str, ...]:
    """Named inputs a reward needs: its parameters without defaults, minus what TRL always passes.

    Each is either a trainer field (``TRAINER_FIELDS``) or a dataset column.

    >>> required_reward_inputs(mc_idx_reward), required_reward_inputs(mdi_balance_reward)
    (('label_idx',), ('mdi_balance',))
    """
    params = inspect.signature(reward_func).parameters.values()
    return tuple(
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in TRL_PROVIDED
    )


def check_reward_columns(reward_funcs: Sequence[Callable], column_names: Sequence[str]) -> None:
    """Raise ValueError when a reward needs a dataset column the dataset lacks (trainer fields aside).

    >>> check_reward_columns([mc_idx_reward, mdi_balance_reward], ["prompt", "image", "label_idx"])
    """
    available = set(column_names)
    problems = []
    for fn in reward_funcs:
        missing = [c for c in required_reward_inputs(fn) if c not in TRAINER_FIELDS and c not in available]
        if missing:
            problems.append(f"reward {fn.__name__!r} needs column(s) {missing}")
    if problems:
        raise ValueError("; ".join(problems) + f". The dataset has columns {sorted(available)}.")


def _import_reward(path: str) -> Callable:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"bad reward import path {path!r}: expected 'pkg.module:function'")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except Exception as e:  # a module may fail at import with any error; report it, keep the chain
        raise ValueError(f"cannot load reward {path!r}: {type(e).__name__}: {e}") from e
    if inspect.isclass(target):
        raise TypeError(f"reward {path!r} is a class; point to an instance of it (or to a function)")
    if not callable(target):
        raise TypeError(f"reward {path!r} is a {type(target).__name__}, not a callable")
    if not isinstance(getattr(target, "__name__", None), str):
        raise TypeError(f"reward {path!r} has no __name__ (TRL names its metrics rewards/<__name__>/...)")
    return target


def resolve_rewards(
    names: Sequence[str], weights: Sequence[float] | None = None
) -> tuple[list[Callable], list[float]]:
    """Reward callables and weights for registry names or import paths ``"pkg.module:function"``.

    ``weights=None`` gives 1.0 each (TRL's convention; the config's default is
    ``DEFAULT_REWARD_WEIGHTS``). Raises ValueError for an unknown name (listing the registry), a
    weight count that differs from the reward count, an import path that fails to load (with the
    original error), two rewards with the same ``__name__`` (their metrics would collide) and an
    empty list; TypeError for a target that is not a named callable.

    >>> fns, w = resolve_rewards(["mc_idx", "mdi_balance"], [4.0, 1.0])
    >>> [f.__name__ for f in fns], w
    (['mc_idx_reward', 'mdi_balance_reward'], [4.0, 1.0])
    """
    if not names:
        raise ValueError(f"no reward functions given; the default is {list(DEFAULT_REWARDS)}")
    funcs = []
    for name in names:
        name = name.strip()
        if name in REWARD_REGISTRY:
            funcs.append(REWARD_REGISTRY[name])
        elif ":" in name:
            funcs.append(_import_reward(name))
        else:
            raise ValueError(
                f"unknown reward {name!r}. Registry names: {', '.join(REWARD_REGISTRY)}. "
                f"For your own reward give its import path 'pkg.module:function', a callable "
                f"fn(completions, <dataset columns>, **kwargs) -> list[float | None]."
            )
    seen: dict[str, str] = {}
    for name, fn in zip(names, funcs):
        if fn.__name__ in seen:
            raise ValueError(f"rewards {seen[fn.__name__]!r} and {name!r} share the name {fn.__name__!r}")
        seen[fn.__name__] = name
    if weights is None:
        return funcs, [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(f"got {len(weights)} reward weights for {len(funcs)} reward functions {list(names)}")
    return funcs, [float(w) for w in weights]


def default_reward_stack(names: Sequence | None, weights: Sequence[float] | None) -> tuple[list, list[float] | None]:
    """The rewards and weights a run uses: the given ones, else the 4:1:1 stack.

    The default weights apply only when the names are the default stack and no weights were given, so a user's
    ``reward_weights`` is never replaced.

    >>> default_reward_stack(None, None)
    (['mc_idx', 'think_format', 'mdi_balance'], [4.0, 1.0, 1.0])
    >>> default_reward_stack(["mc_idx"], None)
    (['mc_idx'], None)
    """
    names = list(names) if names else list(DEFAULT_REWARDS)
    if weights is None and names == list(DEFAULT_REWARDS):
        return names, list(DEFAULT_REWARD_WEIGHTS)
    return names, (list(weights) if weights is not None else None)


def _first_doc_line(fn: Callable) -> str:
    doc = inspect.getdoc(fn) or ""
    return next((line.strip() for line in doc.splitlines() if line.strip()), "(no description)")


def reward_help() -> str:
    """CLI help for the reward options, generated from ``REWARD_REGISTRY`` so it cannot drift.

    >>> print(reward_help().splitlines()[1])
      mc_idx        Multiple-choice accuracy: 1.0 when the parsed answer letter is the label's, else 0.0. [dataset column: label_idx]
    """
    width = max(len(name) for name in REWARD_REGISTRY) + 2
    lines = [
        f"Reward functions by registry name (default: {' '.join(DEFAULT_REWARDS)}, "
        f"weights {' '.join(str(w) for w in DEFAULT_REWARD_WEIGHTS)}):"
    ]
    for name, fn in REWARD_REGISTRY.items():
        needs = required_reward_inputs(fn)
        columns = [n for n in needs if n not in TRAINER_FIELDS]
        fields = [n for n in needs if n in TRAINER_FIELDS]
        notes = ([f"dataset column: {', '.join(columns)}"] if columns else []) + (
            [f"computed by the trainer: {', '.join(fields)}"] if fields else []
        )
        suffix = f" [{'; '.join(notes)}]" if notes else ""
        lines.append(f"  {name:<{width}}{_first_doc_line(fn)}{suffix}")
    lines.append(
        "Or your own reward by import path 'pkg.module:function': "
        "fn(completions, <dataset columns>, **kwargs) -> list[float | None]."
    )
    return "\n".join(lines)


def resolve_reward_funcs(names: list, weights: list[float] | None) -> list:
    """Registry names and 'pkg.module:function' paths -> functions, for a trainer's ``reward_funcs``.

    Callables and strings that look like Hub model ids (``org/name``, which TRL loads as reward models itself)
    pass through unchanged.
    """
    if weights is not None and len(weights) != len(names):
        raise ValueError(
            f"{len(names)} reward functions but {len(weights)} reward_weights: give one weight per reward "
            f"({', '.join(map(reward_name, names))})"
        )
    out = []
    for r in names:
        if isinstance(r, str) and (r in REWARD_REGISTRY or ":" in r or "/" not in r):
            out.extend(resolve_rewards([r], None)[0])
        else:
            out.append(r)
    return out


def reward_name(r) -> str:
    """The name TRL logs a reward under (``rewards/<name>/mean``)."""
    return r if isinstance(r, str) else getattr(r, "__name__", type(r).__name__)

