"""The columns a split must have (an image column, a prompt column, the label columns the rewards read),
found or explained, the choices a row may have (no more than the choice letters A to Z; no duplicates, no choice
markers inside a choice, a label among them), and DatasetError, the error for data the user must fix.
"""

from __future__ import annotations

import re
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


LABEL_COLUMN = "label_idx"
"""The index of the right choice in ``choices`` (None: no label; ``mc_idx`` then returns None)."""

_MARKER_LINE = re.compile(r"[\r\n]\s*([A-Z])[.)](\s|$)")  # a line of the text opening like a lettered choice


def choice_row_problem(choices: Any, label: Any) -> str | None:
    """What is wrong with one row's ``choices`` and ``label_idx`` (None: nothing), as the end of a sentence.

    The prompt shows choice k as the line ``LETTERS[k]. text`` and the rewards compare the parsed letter with
    ``label_idx``, so: the label must be a whole number naming one of the choices; two equal choices (same text up
    to case and spaces) would give one answer two letters; a choice holding a line that opens like a choice
    ("\\nB. ...") would show the model two "B." lines.

    >>> print(choice_row_problem(["red", "blue", "green", "yellow"], 7))
    has label_idx 7 but only 4 choices (A to D): the label must be 0 to 3
    >>> print(choice_row_problem(["red", "blue" + chr(10) + "B. green"], 0))
    has choice B ('blue\\nB. green') holding a line that opens like choice B: the prompt would show two 'B.' lines
    >>> print(choice_row_problem(["red", "Red "], 0))
    has the same choice twice: A and B are both 'red'
    >>> choice_row_problem(["red", "blue"], None) is None
    True
    """
    if not isinstance(choices, (list, tuple)):
        return None  # no choices to check (a math row, or a null)
    seen: dict[str, int] = {}
    for k, text in enumerate(choices):
        if not isinstance(text, str):
            continue
        letter = LETTERS[k] if k < len(LETTERS) else f"#{k + 1}"
        marker = _MARKER_LINE.search(text)
        if marker:
            shown = marker.group(1)
            what = (f"two '{shown}.' lines" if LETTERS.index(shown) < len(choices)
                    else f"a line '{shown}.' that is no choice")
            return (f"has choice {letter} ({text!r}) holding a line that opens like choice {shown}: the prompt "
                    f"would show {what}")
        key = " ".join(text.split()).casefold()
        if key in seen:
            return f"has the same choice twice: {LETTERS[seen[key]]} and {letter} are both {key!r}"
        seen[key] = k
    if label is None:
        return None
    n = len(choices)
    if isinstance(label, bool) or not isinstance(label, (int, float)) or float(label) != int(label):
        return f"has label_idx {label!r}, not a whole number: it must be the index of the right choice, 0 to {n - 1}"
    if not 0 <= int(label) < n:
        last = LETTERS[n - 1] if 0 < n <= len(LETTERS) else "?"
        return f"has label_idx {int(label)} but only {n} choices (A to {last}): the label must be 0 to {n - 1}"
    return None


def check_choice_rows(ds: Any, split: str = "train") -> None:
    """DatasetError when a row's choices or label cannot make a fair question (``choice_row_problem``): a label
    outside the choices, a duplicate choice, a choice holding a choice marker.

    Checked at data load, like ``check_choice_counts``, because later the row fails only when it is sampled (a
    label outside the choices raises deep in the answer tokens) or never fails at all (a duplicate or a second "B."
    line quietly makes the question unanswerable). The error names the first offending row by ``question_id`` and
    index, how many rows have a problem, and the fix. ``ds``: a ``datasets.Dataset`` (its ``choices`` and
    ``label_idx`` columns read without decoding a row) or a list of row dicts; without a ``choices`` column, or
    streamed, it passes.
    """
    columns = _choice_columns(ds)
    if columns is None:
        return
    choices, labels = columns
    bad = [(i, problem) for i, (c, y) in enumerate(zip(choices, labels))
           if (problem := choice_row_problem(c, y)) is not None]
    if not bad:
        return
    ids = _question_ids(ds, [i for i, _ in bad[:5]])
    first, problem = bad[0]
    where = f"row {first} of split {split!r}" + (f" (question_id {ids[0]!r})" if ids[0] is not None else "")
    message = f"{where} {problem}"
    if len(bad) > 1:
        rows = ", ".join(f"{i}" + (f" (question_id {q!r})" if q is not None else "") for (i, _), q in zip(bad, ids))
        message += f". {len(bad)} rows of {split!r} have such a problem: rows {rows}" + (", ..." if len(bad) > 5 else "")
    raise DatasetError(message + ". Fix or drop these rows (trl_mdi.data.choice_row_problem(choices, label_idx) "
                       "says what is wrong with one), e.g. dataset.filter(lambda r: choice_row_problem(r['choices'], "
                       "r['label_idx']) is None)")


def check_choices(ds: Any, split: str = "train") -> None:
    """Every choice check of a split at load: the count (``check_choice_counts``), then each row's choices and label
    (``check_choice_rows``). DatasetError naming the first bad row."""
    check_choice_counts(ds, split)
    check_choice_rows(ds, split)


def _choice_columns(ds: Any) -> tuple[list, list] | None:
    """(choices per row, label per row or None) or None without a ``choices`` column or for a streaming dataset."""
    if isinstance(ds, list):
        if not any(isinstance(r, dict) and CHOICES_COLUMN in r for r in ds):
            return None
        rows = [r if isinstance(r, dict) else {} for r in ds]
        return [r.get(CHOICES_COLUMN) for r in rows], [r.get(LABEL_COLUMN) for r in rows]
    from datasets import Dataset

    if not isinstance(ds, Dataset) or CHOICES_COLUMN not in ds.column_names:
        return None
    names = [CHOICES_COLUMN] + ([LABEL_COLUMN] if LABEL_COLUMN in ds.column_names else [])
    table = ds.select_columns(names).with_format("arrow")[:]  # no image decoding; select/shuffle indices applied
    choices = table.column(CHOICES_COLUMN).to_pylist()
    labels = table.column(LABEL_COLUMN).to_pylist() if LABEL_COLUMN in names else [None] * len(choices)
    return choices, labels
