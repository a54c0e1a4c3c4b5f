"""The columns a split must have (an image column, a prompt column, the label columns the rewards read),
found or explained, and DatasetError, the error for data the user must fix.
"""

from __future__ import annotations

from collections.abc import Sequence

IMAGE_COLUMNS = ("image", "images")
"""Image columns TRL reads: ``image`` (one image per row) or ``images`` (a list per row)."""
PROMPT_COLUMNS = ("prompt", "problem")
"""Prompt text columns, in order of preference: ``prompt`` (A-OKVQA prep output) or ``problem`` (math VQA)."""
"""Label columns the registry rewards read, and which reward reads each."""


class DatasetError(ValueError):
    """A problem with the training data that the user must fix; the script prints it without a traceback."""


def _pick_column(columns: Sequence[str], explicit: str | None, candidates: Sequence[str], what: str, expected: str,
                 split: str, flag: str) -> str:
    if explicit:
        if explicit not in columns:
            raise DatasetError(f"split {split!r} has no column {explicit!r} ({flag}); its columns: {list(columns)}")
        return explicit
    for c in candidates:
        if c in columns:
            return c
    raise DatasetError(
        f"split {split!r} has no {what} column: expected {expected}, or name yours with {flag}. "
        f"Its columns: {list(columns)}"
    )


def image_column_of(columns: Sequence[str], explicit: str | None = None, split: str = "train") -> str:
    return _pick_column(columns, explicit, IMAGE_COLUMNS, "image",
                        "'image' (one image per row: a datasets Image, bytes or a file path) or 'images' (a list)",
                        split, "--image_column")


def prompt_column_of(columns: Sequence[str], explicit: str | None = None, split: str = "train") -> str:
    try:
        return _pick_column(columns, explicit, PROMPT_COLUMNS, "prompt",
                            "'prompt' (A-OKVQA prep output: question and lettered choices) or 'problem' (math VQA, "
                            "with 'solution')", split, "--prompt_column")
    except DatasetError as e:
        if {"question", "correct_choice_idx"} <= set(columns):
            raise DatasetError(f"{e}. This looks like raw A-OKVQA: convert it first with trl_mdi.aokvqa.prepare_aokvqa "
                               "(data_prep/prepare_aokvqa_for_trl.py in the repository)") from None
        raise
