"""Language-prior questions: the text names an object with a canonical colour, the image usually agrees.

``prior_color`` asks "What color is the banana?" about one big drawn shape. Each of four objects has a canonical
colour, one per colour of the fixed option list (A. red B. green C. blue D. yellow). On most rows the shape is
drawn in the object's canonical colour; on *conflict* rows it is drawn in one of the three other colours. The
answer is always the colour in the image. A model that reads the question and ignores the image is right on every
non-conflict row and wrong on every conflict row: that gap, and accuracy on blank images, measure its reliance
on the language prior.

The drawn shape is drawn at random from all shapes, independently of the object, so only the object's *name*
(the text) carries the prior; nothing in the image says which object it is.

This module is a leaf (the generator in ``rows`` calls it): the object table, the conflict plan and the question
text of the prior kinds.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

PRIOR_OBJECTS: dict[str, str] = {
    "tomato": "red",
    "grass": "green",
    "sky": "blue",
    "banana": "yellow",
}
"""Object named in the question -> its canonical colour (the language prior). No name contains a colour word
("blueberry" would be " blue" + "berry" for the tiny tokenizer, a lexical cue rather than a prior), and each starts
with its own token there (" t", " g", " s", " b")."""
PRIOR_KINDS = ("prior_color",)
PRIOR_COLORS = ("red", "green", "blue", "yellow")  # the option vocabulary: the canonical colours, in fixed order

_QUESTION_TEMPLATES = (
    "What color is the {obj}?",
    "What is the color of the {obj} in the image?",
    "Which color is the {obj} painted?",
)


def conflict_plan(plan: Sequence[str], letters: Sequence[int], rate: float, rng: random.Random) -> list[bool]:
    """Which rows are conflict rows: ``round(rate * n)`` of the ``n`` rows of each prior kind, spread over the
    answer letters as evenly as the counts allow (largest remainder), chosen at random inside each letter.

    Spreading by letter keeps conflict and non-conflict rows each letter-balanced, so accuracy on either subset
    cannot be gained by preferring a letter. Rows of other kinds are never conflict rows. Draws from ``rng`` only
    when ``plan`` holds a prior kind, so the rows of the other kinds do not change.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"conflict_rate must be in [0, 1], got {rate}")
    conflict = [False] * len(plan)
    for kind in PRIOR_KINDS:
        rows = [i for i, k in enumerate(plan) if k == kind]
        if not rows:
            continue
        by_letter: dict[int, list[int]] = {}
        for i in rows:
            by_letter.setdefault(letters[i], []).append(i)
        total = round(rate * len(rows))
        quotas = {letter: total * len(ix) / len(rows) for letter, ix in sorted(by_letter.items())}
        counts = {letter: int(q) for letter, q in quotas.items()}
        by_remainder = sorted(quotas, key=lambda letter: (-(quotas[letter] - counts[letter]), letter))
        for letter in by_remainder[: total - sum(counts.values())]:
            counts[letter] += 1
        for letter, ix in sorted(by_letter.items()):
            for i in rng.sample(ix, counts[letter]):
                conflict[i] = True
    return conflict


def prior_object(answer: str, conflict: bool, rng: random.Random) -> str:
    """The object the question names: one whose canonical colour is ``answer`` (the image's colour), or, on a
    conflict row, one of the objects whose canonical colour differs from it."""
    if conflict:
        return rng.choice([obj for obj, color in PRIOR_OBJECTS.items() if color != answer])
    return next(obj for obj, color in PRIOR_OBJECTS.items() if color == answer)


def prior_question(obj: str, rng: random.Random) -> str:
    """One question about ``obj``'s colour (templates drawn at random)."""
    return rng.choice(_QUESTION_TEMPLATES).format(obj=obj)


def prior_rationales(obj: str, answer: str) -> list[str]:
    """Three A-OKVQA-style rationales; a conflict row's say the object is drawn in an unusual colour."""
    usual = PRIOR_OBJECTS[obj]
    if usual == answer:
        return [f"The {obj} in the image is {answer}.", f"It is drawn {answer}, its usual color.",
                f"Its fill color is {answer}."]
    return [f"The {obj} in the image is {answer}.", f"It is drawn {answer}, not its usual {usual}.",
            f"Its fill color is {answer}."]
