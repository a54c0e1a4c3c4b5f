"""Which completion tokens carry the answer: token texts that survive byte-level BPE, the answer's token span, and
the choice letters' tokens in the sampled letter's surface form.

Used by the counterfactual signals (``trl_mdi.counterfactual``: the answer span's visual gain, the blind answer at
the letter's position) and by any per-token signal read on the answer alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .answer_format import DEFAULT_ANSWER_PATTERN, LETTERS, compile_answer_pattern, too_many_choices

_THINK_CLOSE = "</think>"
_STANDALONE_CAPITAL = re.compile(r"(?<![A-Za-z])[A-Z](?![A-Za-z])")
_DECODE_CONTEXT = 6  # tokens of left context when decoding one token; see completion_token_texts


def completion_token_texts(tokenizer: Any, completion_ids: Sequence[int] | torch.Tensor, *,
                           skip_special_tokens: bool = True) -> list[str]:
    """The text each completion token adds, such that ``"".join(texts) == tokenizer.decode(completion_ids)``.

    Pass the completion's real tokens only (its mask, not the padding). ``skip_special_tokens=True`` matches the
    completion text TRL hands to reward functions; skipped tokens get ``""``. A processor is accepted (its
    ``.tokenizer`` is used).

    Decoding token by token is wrong for byte-level BPE: a multi-byte character (é, 日, an emoji) split over
    several tokens decodes to replacement characters piece by piece. So each token's text is the decoded text of
    the tokens so far minus the text already given out, with a few tokens of left context (so tokenizers that
    drop a leading space at the start of a decode, like SentencePiece, still give the space), and a token whose
    text ends in an incomplete character gets ``""`` and hands its bytes on to the token that completes it.
    If a decoder still breaks the equality (one whose output is not prefix-stable), the texts are recomputed as
    differences of the full decoded prefixes, which satisfy it by construction (quadratic in C, so a fallback).
    """
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    ids = completion_ids.tolist() if hasattr(completion_ids, "tolist") else [int(i) for i in completion_ids]

    def decode(chunk: list[int]) -> str:
        return tok.decode(chunk, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    full = decode(ids)
    texts: list[str] = []
    start = done = 0  # decode window ids[start:]; ids[:done] have been given out
    for i in range(len(ids)):
        before, after = decode(ids[start:done]), decode(ids[start:i + 1])
        complete = not after.endswith("\ufffd") or i == len(ids) - 1
        if complete and after.startswith(before) and len(after) > len(before):
            texts.append(after[len(before):])
            done = i + 1
            start = max(0, done - _DECODE_CONTEXT)
        else:
            texts.append("")
    if "".join(texts) == full:
        return texts
    return _prefix_difference_texts(ids, decode, full)


def _prefix_difference_texts(ids: list[int], decode, full: str) -> list[str]:
    """Token texts from full prefixes: token i ends where decode(ids[:i+1]) stops agreeing with the full text."""
    ends, reached = [], 0
    for i in range(len(ids)):
        prefix = decode(ids[:i + 1]).rstrip("\ufffd")
        common = 0
        for a, b in zip(prefix, full):
            if a != b:
                break
            common += 1
        reached = max(reached, common)
        ends.append(reached)
    if ends:
        ends[-1] = len(full)
    starts = [0] + ends[:-1]
    return [full[s:e] for s, e in zip(starts, ends)]


def _last_nonempty_line(text: str) -> tuple[int, int] | None:
    """Character span [a, b) of the last non-empty line, after its last ``</think>`` if it holds one, surrounding
    whitespace excluded."""
    for m in reversed(list(re.finditer(r"[^\n]*", text))):
        line = m.group(0)
        cut = line.rfind(_THINK_CLOSE)
        offset = m.start()
        if cut >= 0:
            offset += cut + len(_THINK_CLOSE)
            line = line[cut + len(_THINK_CLOSE):]
        if line.strip():
            a = offset + (len(line) - len(line.lstrip()))
            return a, a + len(line.strip())
        if cut >= 0:  # "...</think>" ends the line: the answer, if any, is after it, not before
            return None
    return None


def answer_span(token_texts: Sequence[str], answer_pattern: str | re.Pattern | None = DEFAULT_ANSWER_PATTERN
                ) -> tuple[int, int] | None:
    """The half-open token range ``(start, end)`` of a completion that carries its answer, or None.

    ``token_texts``: the completion's tokens as text, one string per token (``completion_token_texts``); their
    concatenation is the completion. The answer is read from the completion's last non-empty line, surrounding
    whitespace stripped; when that line holds ``</think>``, only its part after the last ``</think>`` counts (as
    ``clean_format`` reads "<think>...</think> Answer: B"), and a line ending in ``</think>`` has no answer:

    * ``answer_pattern`` a regex (default ``DEFAULT_ANSWER_PATTERN``, ``Answer: (?P<letter>[A-Z])``; compiled by
      ``compile_answer_pattern``): the line must match it fully, as the format reward requires; the answer is
      the character span of its ``letter`` group. None when the line does not match (or the group is empty).
    * ``answer_pattern=None`` (free-form answers): the answer is the whole last non-empty line.

    The range holds every token whose text overlaps the answer's characters, plus any zero-length tokens just
    before it (the leading bytes of a multi-byte character, given out by the token that completes it). None for
    a completion without a non-empty line.

    >>> answer_span(["<think>", "ok", "</think>", "\\n", "Answer", ":", " B", "\\n"])
    (6, 7)
    >>> answer_span(["<think>", "ok", "</think>", "\\n", "Answer", ":", " B", " maybe"]) is None
    True
    >>> answer_span(["It", " is", "\\n", " a", " red", " circle", ".", "\\n"], None)
    (3, 7)
    """
    text = "".join(token_texts)
    line = _last_nonempty_line(text)
    if line is None:
        return None
    a, b = line
    if answer_pattern is not None:
        pattern = compile_answer_pattern(answer_pattern) if isinstance(answer_pattern, str) else answer_pattern
        m = pattern.fullmatch(text[a:b])
        if m is None or m.start("letter") < 0 or m.start("letter") == m.end("letter"):
            return None
        a, b = a + m.start("letter"), a + m.end("letter")
    start = end = None
    pos = 0
    for i, piece in enumerate(token_texts):
        lo, hi = pos, pos + len(piece)
        pos = hi
        if lo < b and hi > a:
            start = i if start is None else start
            end = i + 1
    while start > 0 and token_texts[start - 1] == "":
        start -= 1
    return start, end


def answer_span_mask(spans: Sequence[tuple[int, int] | None], num_tokens: int) -> torch.Tensor:
    """(B, C) bool mask, True on the tokens of each row's span (``answer_span``); an all-False row for None.

    >>> answer_span_mask([(1, 3), None], 4)
    tensor([[False,  True,  True, False],
            [False, False, False, False]])
    """
    mask = torch.zeros(len(spans), num_tokens, dtype=torch.bool)
    for row, span in enumerate(spans):
        if span is None:
            continue
        start, end = span
        if not 0 <= start < end <= num_tokens:
            raise ValueError(f"span {span} of row {row} is not a non-empty range inside [0, {num_tokens})")
        mask[row, start:end] = True
    return mask


def choice_letter_token_ids(tokenizer: Any, sampled_letter_token_id: int, letters: Sequence[str]
                            ) -> list[int] | None:
    """Token ids of the choice ``letters`` in the same surface form as the sampled answer-letter token.

    The sampled token's vocabulary string (``convert_ids_to_tokens``) must hold exactly one standalone capital
    letter (not next to another ASCII letter): ``"ĠB"`` (byte-level BPE, a leading space), ``"▁B"``
    (SentencePiece), ``"B"``. Each candidate is that string with the letter replaced, looked up with
    ``convert_tokens_to_ids``: ``"ĠB"`` -> ``"ĠA"``, ``"ĠB"``, ``"ĠC"``, ... Returns one id per letter, in the
    order of ``letters`` (the sampled letter's own id included, so index k is letter k), or None when the
    sampled token holds no or several standalone capitals, or some candidate is not a single vocabulary token.
    A processor is accepted (its ``.tokenizer`` is used).
    """
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    surface = tok.convert_ids_to_tokens(int(sampled_letter_token_id))
    if not isinstance(surface, str):
        return None
    found = list(_STANDALONE_CAPITAL.finditer(surface))
    if len(found) != 1:
        return None
    i = found[0].start()
    ids = []
    for letter in letters:
        if len(letter) != 1:
            raise ValueError(f"letters must be single characters, got {letter!r}")
        candidate = surface[:i] + letter + surface[i + 1:]
        tid = tok.convert_tokens_to_ids(candidate)
        if tid is None or tok.convert_ids_to_tokens(int(tid)) != candidate:  # unknown -> None or the unk id
            return None
        ids.append(int(tid))
    return ids


@dataclass(frozen=True)
class AnswerTokens:
    """Where each rollout of a batch wrote its answer (B rollouts, C completion tokens, K = the most choices).

    ``span_mask`` (B, C) bool: the answer span (``answer_span``); ``letter_position`` (B,) long: the completion
    index of the token holding the answer letter, -1 without one; ``answer_index`` (B,) long: the letter as an
    index into the choices (A = 0), -1 without one; ``candidates`` (B, K) long: the choice letters' token ids in the
    sampled letter's surface form (``choice_letter_token_ids``), -1 padding (a row without them can have no blind
    answer); ``n_choices`` (B,) long.
    """

    span_mask: torch.Tensor
    letter_position: torch.Tensor
    answer_index: torch.Tensor
    candidates: torch.Tensor
    n_choices: torch.Tensor


def answer_tokens(tokenizer: Any, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                  choices: Sequence[Sequence[str] | None], answer_pattern: str | re.Pattern | None
                  ) -> AnswerTokens:
    """The :class:`AnswerTokens` of a batch: each rollout's completion tokens (``completion_mask``) decoded as TRL
    decodes them, its answer read by the span rule (``answer_span``).

    A row with ``choices`` (multiple choice) reads its answer with ``answer_pattern``'s ``letter`` group; a row
    without (free-form rewards) takes its last non-empty line as the span and has no letter, so no blind answer.
    The choice letters are ``trl_mdi.answer_format.LETTERS`` (A to Z): a row with n choices gets the n candidates
    ``LETTERS[:n]``, whichever letter it answered, so ``candidates`` and ``n_choices`` always agree. ValueError for a
    row with more choices than letters (the data load refuses such rows, ``trl_mdi.data.check_choice_counts``; one
    that reaches here came in another way, and a blind answer among the first 26 choices would be wrong).
    """
    b, c = completion_ids.shape
    spans, positions, indices, candidates, counts = [], [], [], [], []
    for row in range(b):
        ids = completion_ids[row][completion_mask[row].bool()].tolist()
        texts = completion_token_texts(tokenizer, ids)
        row_choices = choices[row] if choices is not None else None
        n = len(row_choices) if row_choices is not None else 0
        if (error := too_many_choices(n, f"rollout {row} of the batch")) is not None:
            raise ValueError(error)
        span = answer_span(texts, answer_pattern if n else None) if ids else None
        position, index, cands = -1, -1, None
        if span is not None and n:
            position = span[1] - 1
            letter = "".join(texts[span[0]:span[1]]).strip()
            index = LETTERS.index(letter) if len(letter) == 1 and letter in LETTERS else -1
            cands = choice_letter_token_ids(tokenizer, ids[position], LETTERS[:n]) if index >= 0 else None
        spans.append(span)
        positions.append(position)
        indices.append(index)
        candidates.append(cands or [])
        counts.append(n if cands else 0)
    k = max([len(x) for x in candidates] + [1])
    cand = torch.full((b, k), -1, dtype=torch.long)
    for row, ids in enumerate(candidates):
        cand[row, : len(ids)] = torch.tensor(ids, dtype=torch.long) if ids else cand[row, :0]
    return AnswerTokens(span_mask=answer_span_mask(spans, c), letter_position=torch.tensor(positions),
                        answer_index=torch.tensor(indices), candidates=cand, n_choices=torch.tensor(counts))
