"""The columns a split must have (an image column, a prompt column, the label columns the rewards read),
found or explained, the choices a row may have (no more than the choice letters A to Z), and DatasetError, the error
for data the user must fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..answer_format import LETTERS, too_many_choices

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


CHOICES_COLUMN = "choices"
"""The multiple-choice column: one list of choice texts per row, choice k named by ``LETTERS[k]``."""


def check_choice_counts(ds: Any, split: str = "train") -> None:
    """DatasetError when a row of ``ds`` has more choices than there are choice letters (``LETTERS``, A to Z).

    Checked at data load because nothing later can recover: the rewards' parser has no letter for choice 27, the
    blind answer would be chosen among the first 26 only, and the run would stop at the first batch holding such a
    row. The error names the split, the first offending rows (index and ``question_id`` where there is one), the
    count, the limit and the fix. ``ds``: a ``datasets.Dataset`` (read column-wise, no row decoding) or a list of row
    dicts; a dataset without a ``choices`` column passes, and so does a streaming one, whose rows cannot be read
    ahead (``trl_mdi.answer_tokens.answer_tokens`` still refuses such a row when it reaches a batch).
    """
    counts = _choice_counts(ds)
    if counts is None:
        return
    over = [i for i, n in enumerate(counts) if n > len(LETTERS)]
    if not over:
        return
    first = over[0]
    ids = _question_ids(ds, over[:5])
    rows = ", ".join(f"{i}" + (f" (question_id {q!r})" if q is not None else "") for i, q in zip(over[:5], ids))
    where = f"row {first} of split {split!r}" + (f" (question_id {ids[0]!r})" if ids[0] is not None else "")
    message = too_many_choices(counts[first], where)
    if len(over) > 1:
        message += f". {len(over)} rows of {split!r} have more than {len(LETTERS)} choices: rows {rows}" + \
            (", ..." if len(over) > 5 else "")
    raise DatasetError(message)


def _choice_counts(ds: Any) -> list[int] | None:
    """Choices per row (0 for a null), or None without a ``choices`` column or for a streaming dataset."""
    if isinstance(ds, list):
        if not any(isinstance(r, dict) and CHOICES_COLUMN in r for r in ds):
            return None
        return [len(r.get(CHOICES_COLUMN) or ()) if isinstance(r, dict) else 0 for r in ds]
    import pyarrow as pa
    import pyarrow.compute as pc
    from datasets import Dataset

    if not isinstance(ds, Dataset) or CHOICES_COLUMN not in ds.column_names:  # an IterableDataset streams its rows
        return None
    column = ds.with_format("arrow")[CHOICES_COLUMN]  # the arrow column, after any select/shuffle indices
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)
            or pa.types.is_fixed_size_list(column.type)):
        return None  # not a list per row: no choices to count (the rewards read a list)
    return [n or 0 for n in pc.list_value_length(column).to_pylist()]


def _question_ids(ds: Any, rows: list[int]) -> list[Any]:
    if isinstance(ds, list):
        return [ds[i].get("question_id") if isinstance(ds[i], dict) else None for i in rows]
    if "question_id" not in (getattr(ds, "column_names", None) or ()):
        return [None] * len(rows)
    only = ds.select_columns(["question_id"])  # no image decoding for the ids
    return [only[i]["question_id"] for i in rows]
