"""The answer format the system prompt asks for, defined once: the instruction, the pattern, and their checks.

The default system prompt is built from ``DEFAULT_ANSWER_EXAMPLE`` and the default pattern matches that example
with X replaced by a letter (tests/test_answer_format.py checks them together), so the words the model is shown and
the rule the format reward pays for cannot drift apart.

The format (``clean_format``): one non-empty ``<think>...</think>`` block, then, after optional whitespace, one
final line that fully matches the answer pattern (default ``Answer: X``, X a capital letter valid for the row's
choices, or any capital letter where the row has none), and nothing but whitespace after it. When the chat template
already opens ``<think>`` in the prompt (thinking templates of the Qwen3 families), the completion starts inside the
block and its own ``</think>`` closes it.

The hedge rule (``hedged_letters``): the last answer statement after ``</think>`` (or, without one, the whole
answer text) must name one letter; "Answer: A or B" and "A B" name two and score 0 on ``mc_idx``. A correction that
ends on one letter ("Answer: A ... final answer: C") is C.
"""

from __future__ import annotations

import re
import unicodedata

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
"""The choice letters, A to Z: choice k of a row is ``LETTERS[k]``, so a row has at most ``len(LETTERS)`` = 26
choices. The one definition: the answer parser (``trl_mdi.rewards``), the format and hedge rules here, the A-OKVQA
prompts (``trl_mdi.aokvqa``), the answer tokens (``trl_mdi.answer_tokens``) and the evaluation read this object, and
the data loaders refuse a row with more choices (``too_many_choices``). It lives here because this module imports
nothing of the package, so every reader can import it without a cycle."""


def too_many_choices(n_choices: int, where: str) -> str | None:
    """The error message for a row with more choices than there are choice letters, or None when ``n_choices`` fits.

    ``where`` names the row (e.g. "row 7 of split 'train'"). One message for every reader that checks the limit
    (data load, the answer tokens), so the fix is stated the same way everywhere.

    >>> too_many_choices(26, "row 0") is None
    True
    >>> print(too_many_choices(27, "row 3 of split 'train'").split(" (")[0])
    row 3 of split 'train' has 27 choices, more than the 26 choice letters A to Z
    """
    if n_choices <= len(LETTERS):
        return None
    return (f"{where} has {n_choices} choices, more than the {len(LETTERS)} choice letters {LETTERS[0]} to "
            f"{LETTERS[-1]} (trl_mdi.answer_format.LETTERS): no answer letter could name choice {len(LETTERS) + 1} "
            f"and beyond. Drop those rows or cut their choices to {len(LETTERS)}, e.g. "
            f"dataset.filter(lambda row: len(row['choices']) <= {len(LETTERS)})")


DEFAULT_ANSWER_EXAMPLE = "Answer: X"
"""The final line the default system prompt shows the model (X stands for the letter)."""

DEFAULT_ANSWER_PATTERN = r"Answer: (?P<letter>[A-Z])"
"""Regex the final line must fully match; its group ``letter`` is the answer. Matches DEFAULT_ANSWER_EXAMPLE."""

DEFAULT_SYSTEM_PROMPT = (
    f"You are a helpful assistant. Think inside <think>...</think>, then give the final line '{DEFAULT_ANSWER_EXAMPLE}'."
)
"""The system prompt of the training script, built from the answer example above."""

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def compile_answer_pattern(pattern: str) -> re.Pattern:
    """Compile an answer pattern; ValueError unless it compiles and has a group named ``letter``.

    >>> compile_answer_pattern(r"Final: (?P<letter>[A-D])").pattern
    'Final: (?P<letter>[A-D])'
    """
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"answer_pattern {pattern!r} is not a valid regular expression: {e}") from None
    if "letter" not in compiled.groupindex:
        raise ValueError(f"answer_pattern {pattern!r} needs a named group (?P<letter>...) that captures the answer "
                         "letter, e.g. r'Answer: (?P<letter>[A-Z])'")
    return compiled


def valid_letters(choices) -> str:
    """The letters a row may answer with: one per choice, or A-Z when the row has no choices."""
    n = len(choices) if choices is not None and len(choices) > 0 else len(LETTERS)
    return LETTERS[: min(n, len(LETTERS))]


def clean_format(text: str, pattern: re.Pattern | str = DEFAULT_ANSWER_PATTERN, choices=None, *,
                 think_prefilled: bool = False) -> bool:
    """Whether a completion is in the asked format (see the module docstring).

    >>> clean_format("<think>It is red.</think>\\nAnswer: B", choices=["a", "b", "c", "d"])
    True
    >>> [clean_format(t) for t in ['<think> x</think>\\nAnswer" A', "<think> x</think>\\nAnswers A",
    ...                             "<think> x</think>\\nAnswer hexagon C", "<think> x</think>\\nA B"]]
    [False, False, False, False]
    >>> clean_format("It is red.</think>\\nAnswer: B", think_prefilled=True)
    True
    """
    pattern = compile_answer_pattern(pattern) if isinstance(pattern, str) else pattern
    if think_prefilled:
        if _THINK_OPEN in text or text.count(_THINK_CLOSE) != 1:
            return False
        think, _, rest = text.partition(_THINK_CLOSE)
    else:
        stripped = text.lstrip()
        if not stripped.startswith(_THINK_OPEN) or text.count(_THINK_OPEN) != 1 or text.count(_THINK_CLOSE) != 1:
            return False
        think, _, rest = stripped[len(_THINK_OPEN):].partition(_THINK_CLOSE)
    if not think.strip():
        return False
    m = pattern.fullmatch(rest.strip())
    return m is not None and m.group("letter") is not None and m.group("letter") in valid_letters(choices)


# Answer statements ("Answer: ...", "Final answer is ...", "答案：...") up to the end of their line.
_STATEMENT = re.compile(r"(?<![A-Za-z])(?:answer(?![A-Za-z])|答案)(?:(?!answer(?![A-Za-z])|答案)[^\n])*",
                        re.IGNORECASE)
# A standalone capital letter (not glued to letters, digits, apostrophes or hyphens).
_CAPITAL = re.compile(r"(?<![A-Za-z0-9'’\-])([A-Z])(?![A-Za-z0-9'’\-])")
# "A" / "I" followed by a lowercase word are the article / the pronoun, unless the word follows a choice letter.
_NEXT_WORD = re.compile(r"[ \t]+([a-z]+)")
_LETTER_FOLLOWERS = frozenset("is was seems appears looks matches fits and or vs versus because since".split())


def _letters_in(span: str, valid: str) -> list[str]:
    out = []
    for m in _CAPITAL.finditer(span):
        letter = m.group(1)
        if letter not in valid:
            continue
        if letter in "AI":
            word = _NEXT_WORD.match(span, m.end(1))
            if word is not None and word.group(1) not in _LETTER_FOLLOWERS:
                continue
        out.append(letter)
    return out


def hedged_letters(text: str, num_choices: int = 10) -> list[str]:
    """The distinct letters the deciding part of an answer names; more than one means the answer hedges.

    The deciding part is the last answer statement after ``</think>`` (up to its line end, the word "answer"
    itself excluded), or, when there is none, the whole answer text after ``</think>`` (the whole completion
    without a think block).

    >>> hedged_letters("<think>...</think>\\nAnswer: A or B", 4), hedged_letters("<think>.</think> A B", 4)
    (['A', 'B'], ['A', 'B'])
    >>> hedged_letters("Answer: A. On reflection, final answer: C", 4)
    ['C']
    """
    valid = LETTERS[:num_choices]
    text = unicodedata.normalize("NFKC", text)
    answer = text.rsplit(_THINK_CLOSE, 1)[1] if _THINK_CLOSE in text else text
    statements = list(_STATEMENT.finditer(answer))
    if statements:
        last = statements[-1].group(0)
        span = re.sub(r"^(?:answer|答案)", " ", last, flags=re.IGNORECASE)
    else:
        span = answer
    return list(dict.fromkeys(_letters_in(span, valid)))


def template_prefills_think(processing_class, chat_template_kwargs: dict | None = None) -> bool:
    """Whether the chat template opens ``<think>`` in the prompt itself (Qwen3 thinking templates), so that the
    completion starts inside the think block. Read from the template's own rendering of a one-turn prompt."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    template_owner = processing_class if getattr(processing_class, "chat_template", None) else tokenizer
    if getattr(template_owner, "chat_template", None) is None:
        return False
    try:
        text = template_owner.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                  add_generation_prompt=True, **(chat_template_kwargs or {}))
    except Exception:  # a template that needs other arguments: assume no prefill rather than fail the run
        return False
    return isinstance(text, str) and text.rstrip().endswith(_THINK_OPEN)
