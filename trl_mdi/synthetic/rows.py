"""Generating synthetic A-OKVQA rows in memory: the vocabularies, the balanced plan of kinds and answer
letters, and the questions (design choices 1 to 6 of `trl_mdi.synthetic`; the shapes are drawn by `draw`, the
language-prior kinds' objects and conflict plan are in `prior`).
"""

from __future__ import annotations

import hashlib
import io
import random
from collections.abc import Mapping, Sequence
from typing import Any

from PIL import Image, ImageDraw

from .draw import big_box, draw_shape, grid_boxes
from .prior import (
    PRIOR_COLORS,
    PRIOR_KINDS,
    PRIOR_OBJECTS,
    conflict_plan,
    prior_object,
    prior_question,
    prior_rationales,
)

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 60),
    "blue": (40, 80, 230),
    "yellow": (245, 215, 20),
    "purple": (140, 50, 180),
    "orange": (250, 130, 15),
}
SHAPES = ("circle", "square", "triangle", "diamond", "star", "cross")
PLURALS = {
    "circle": "circles",
    "square": "squares",
    "triangle": "triangles",
    "diamond": "diamonds",
    "star": "stars",
    "cross": "crosses",
}
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
# Neutral greys: no shape colour can be confused with the background.
BACKGROUNDS = ((255, 255, 255), (205, 205, 205), (75, 75, 75))
DEFAULT_KINDS = ("color", "shape", "count")  # the kinds only the image answers
KINDS = DEFAULT_KINDS + PRIOR_KINDS
OPTION_ORDERS = ("shuffled", "fixed")
NUM_CHOICES = 4  # A-OKVQA always offers four
SPLITS = ("train", "validation", "test")

_QUESTION_TEMPLATES = {
    "color": (
        "What color is the {shape}?",
        "What is the color of the {shape} in the image?",
        "Which color is the {shape} painted?",
    ),
    "shape": (
        "Which shape is drawn in the image?",
        "What shape is the {color} object?",
        "What kind of shape can you see?",
    ),
    "count": (
        "How many {plural} are in the image?",
        "How many {color} {plural} can you count?",
        "What is the number of {plural} shown?",
    ),
}
_ID_ALPHABET = "23456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"  # A-OKVQA-like 22-char ids


# ------------------------------------------------------------------------------------------------ plan


def _vocabulary(kind: str, max_count: int) -> list[str]:
    if kind == "color":
        return list(COLORS)
    if kind == "prior_color":
        return list(PRIOR_COLORS)
    if kind == "shape":
        return list(SHAPES)
    return [str(i) for i in range(1, max_count + 1)]


def _resolve_kinds(kinds: Sequence[str] | Mapping[str, float]) -> dict[str, float]:
    weights = dict(kinds) if isinstance(kinds, Mapping) else {k: 1.0 for k in kinds}
    unknown = [k for k in weights if k not in KINDS]
    if unknown or not weights:
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {list(weights)}")
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"kind weights must be >= 0 with a positive sum, got {weights}")
    return weights


def _kind_plan(n: int, weights: dict[str, float], rng: random.Random) -> list[str]:
    """Exact shares by largest remainder (so 'color=1,shape=1' on 10 rows is 5/5), then shuffled."""
    total = sum(weights.values())
    quotas = {k: n * w / total for k, w in weights.items()}
    counts = {k: int(q) for k, q in quotas.items()}
    by_remainder = sorted(weights, key=lambda k: (-(quotas[k] - counts[k]), list(weights).index(k)))
    for k in by_remainder[: n - sum(counts.values())]:
        counts[k] += 1
    plan = [k for k in weights for _ in range(counts[k])]
    rng.shuffle(plan)
    return plan


def _letter_plan(plan: list[str], rng: random.Random) -> list[int]:
    """Answer positions: one global A,B,C,D cycle dealt kind by kind, shuffled inside each kind."""
    letters = [0] * len(plan)
    counter = 0
    for kind in dict.fromkeys(plan):
        rows = [i for i, k in enumerate(plan) if k == kind]
        dealt = [(counter + j) % NUM_CHOICES for j in range(len(rows))]
        counter += len(rows)
        rng.shuffle(dealt)
        for i, letter in zip(rows, dealt):
            letters[i] = letter
    return letters


def _question_id(seed: int, split: str, index: int) -> str:
    digest = int.from_bytes(
        hashlib.sha256(f"synthetic-aokvqa/{seed}/{split}/{index}".encode()).digest(), "big"
    )
    chars = []
    for _ in range(22):
        digest, r = divmod(digest, len(_ID_ALPHABET))
        chars.append(_ID_ALPHABET[r])
    return "".join(chars)


# ------------------------------------------------------------------------------------------------ rows


def _choices(rng: random.Random, answer: str, vocab: list[str], letter: int, option_order: str) -> list[str]:
    if option_order == "fixed":
        return vocab[:NUM_CHOICES]
    choices = rng.sample([v for v in vocab if v != answer], NUM_CHOICES - 1)
    choices.insert(letter, answer)
    return choices


def _make_row(rng, kind, letter, *, image_size, max_count, option_order, blank, conflict=False):
    vocab = _vocabulary(kind, max_count)
    # In "fixed" order the options are the first four values and the answer is the one at `letter`;
    # in "shuffled" order the answer is uniform over the vocabulary and placed at `letter`.
    answer = vocab[letter] if option_order == "fixed" else rng.choice(vocab)
    background = rng.choice(BACKGROUNDS)
    obj = None
    if kind == "prior_color":
        # The object, not the drawn shape, carries the prior: the shape is drawn independently of it.
        obj = prior_object(answer, conflict, rng)
        shape, color = rng.choice(SHAPES), answer
        boxes = [big_box(rng, image_size)]
    elif kind == "color":
        shape, color = rng.choice(SHAPES), answer
        boxes = [big_box(rng, image_size)]
    elif kind == "shape":
        shape, color = answer, rng.choice(list(COLORS))
        boxes = [big_box(rng, image_size)]
    else:
        shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
        boxes = grid_boxes(rng, image_size, int(answer), max_count)
    if obj is not None:
        question = prior_question(obj, rng)
    else:
        question = rng.choice(_QUESTION_TEMPLATES[kind]).format(shape=shape, color=color, plural=PLURALS[shape])
    choices = _choices(rng, answer, vocab, letter, option_order)
    if kind == "count":
        word = NUMBER_WORDS[int(answer)] if int(answer) < len(NUMBER_WORDS) else answer
        direct = [answer] * 7 + [word] * 3
        rng.shuffle(direct)
        noun = shape if answer == "1" else PLURALS[shape]
        rationales = [
            f"There {'is' if answer == '1' else 'are'} {answer} {noun} in the picture.",
            f"Counting the {color} {PLURALS[shape]} gives {word}.",
            f"The image shows {word} {noun}.",
        ]
    elif obj is not None:
        direct, rationales = [answer] * 10, prior_rationales(obj, answer)
    elif kind == "color":
        direct = [answer] * 10
        rationales = [
            f"The {shape} in the image is {answer}.",
            f"The only shape drawn is colored {answer}.",
            f"Its fill color is {answer}.",
        ]
    else:
        direct = [answer] * 10
        rationales = [
            f"The object in the picture is a {answer}.",
            f"The {color} shape has the outline of a {answer}.",
            f"A single {color} {answer} is drawn.",
        ]

    image = Image.new("RGB", (image_size, image_size), background)
    if not blank:
        draw = ImageDraw.Draw(image)
        for box in boxes:
            draw_shape(draw, shape, box, COLORS[color])
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return {
        "image": {"bytes": buf.getvalue(), "path": None},
        "question": question,
        "choices": choices,
        "correct_choice_idx": choices.index(answer),
        "direct_answers": direct,
        "difficult_direct_answer": kind == "count",
        "rationales": rationales,
        # In memory only (the A-OKVQA parquet schema has no such columns): whether the image contradicts the
        # prior the question's wording carries, and that prior answer (None for kinds without a prior).
        "conflict": bool(conflict),
        "prior_answer": PRIOR_OBJECTS[obj] if obj is not None else None,
    }


def generate_synthetic_rows(
    n: int,
    *,
    split: str = "train",
    image_size: int = 56,
    seed: int = 0,
    kinds: Sequence[str] | Mapping[str, float] = DEFAULT_KINDS,
    option_order: str = "shuffled",
    max_count: int = 4,
    blank_images: bool = False,
    labelled: bool | None = None,
    conflict_rate: float = 0.2,
) -> list[dict[str, Any]]:
    """Generate ``n`` A-OKVQA rows in memory (image as ``{"bytes": png, "path": None}``).

    Args:
        n: number of rows.
        split: split name; seeds the split's own random stream and the question ids.
        image_size: side of the square images in pixels (>= 16).
        seed: base seed; the same arguments give identical rows.
        kinds: question kinds, equal mix (``("color", "count")``) or weighted (``{"color": 3, "shape": 1}``).
        option_order: ``"shuffled"`` (four options drawn from the kind's vocabulary, answer at a balanced
            letter) or ``"fixed"`` (each kind always offers its first four values in order).
        max_count: largest answer of count questions (>= 4, so four distinct options exist).
        blank_images: draw only the background (same questions, options and labels).
        labelled: keep labels; default False for ``split == "test"`` (correct_choice_idx,
            direct_answers and rationales are then None, as in the real test split).
        conflict_rate: share of each language-prior kind's rows (``prior_color``) whose image contradicts the
            prior (exact: ``round(rate * rows)``, spread over the answer letters); other kinds ignore it.

    Besides the A-OKVQA columns, every row has ``conflict`` (True on a prior kind's conflict row) and
    ``prior_answer`` (the answer the wording suggests, None for kinds without a prior); both None when unlabelled.
    They live in memory only: ``rows_to_table`` and the parquet files keep the exact A-OKVQA schema.
    """
    if option_order not in OPTION_ORDERS:
        raise ValueError(f"option_order must be one of {OPTION_ORDERS}, got {option_order!r}")
    if image_size < 16:
        raise ValueError(f"image_size must be >= 16, got {image_size}")
    if max_count < NUM_CHOICES:
        raise ValueError(f"max_count must be >= {NUM_CHOICES} so that count questions have four options")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    weights = _resolve_kinds(kinds)
    labelled = split != "test" if labelled is None else labelled
    rng = random.Random(f"synthetic-aokvqa/{seed}/{split}")
    plan = _kind_plan(n, weights, rng)
    letters = _letter_plan(plan, rng)
    conflicts = conflict_plan(plan, letters, conflict_rate, rng)
    rows = []
    for i, (kind, letter, conflict) in enumerate(zip(plan, letters, conflicts)):
        row = _make_row(
            rng,
            kind,
            letter,
            image_size=image_size,
            max_count=max_count,
            option_order=option_order,
            blank=blank_images,
            conflict=conflict,
        )
        if not labelled:
            row.update(correct_choice_idx=None, direct_answers=None, rationales=None, conflict=None, prior_answer=None)
        rows.append({"question_id": _question_id(seed, split, i), **row})
    return rows
