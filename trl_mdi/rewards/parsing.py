"""Completion text and multiple-choice answer parsing (``completion_text``, ``extract_choice_letter``)."""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from ..answer_format import LETTERS  # the one definition of the choice letters, A to Z; re-exported

__all__ = ["LETTERS", "completion_text", "extract_choice_letter"]


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
