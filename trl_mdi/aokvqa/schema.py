"""The A-OKVQA schemas: the Hub dataset's columns (input), the prepared parquet's columns (output), the
reasons a row is skipped, and the errors the prep raises.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..answer_format import LETTERS  # the one definition of the choice letters, A to Z; re-exported

HUB_DATASET = "HuggingFaceM4/A-OKVQA"
SPLITS = ("train", "validation", "test")
DEFAULT_SPLITS = ("train", "validation")

# The Hub schema, as documented in shared/notes/algorithms.md section 5; quoted in error messages.
AOKVQA_SCHEMA: dict[str, str] = {
    "question_id": "string",
    "image": "Image ({bytes, path} struct)",
    "question": "string",
    "choices": "list of 4 strings",
    "correct_choice_idx": "int (null in the test split)",
    "direct_answers": "list of 10 strings",
    "difficult_direct_answer": "bool",
    "rationales": "list of 3 strings",
}
# The subset of the schema this conversion reads; the other columns may be absent.
REQUIRED_COLUMNS = ("question_id", "image", "question", "choices", "correct_choice_idx")
OUTPUT_COLUMNS = ("image", "prompt", "label_idx", "choices", "question_id")
# A source in the same schema may hold several images per row as an ``images`` list (TRL's multi-image column) in
# place of ``image``; the output then keeps the list. With both columns, ``images`` wins, as in TRL.
IMAGE_COLUMN, IMAGES_COLUMN = "image", "images"


def image_column_of(columns) -> str | None:
    """The image column a source uses: ``images`` (a list per row) if present, else ``image``; None if neither."""
    return IMAGES_COLUMN if IMAGES_COLUMN in columns else IMAGE_COLUMN if IMAGE_COLUMN in columns else None


def read_columns(image_column: str = IMAGE_COLUMN) -> tuple[str, ...]:
    """The columns the conversion reads from a source whose image column is ``image_column``."""
    return tuple(image_column if c == IMAGE_COLUMN else c for c in REQUIRED_COLUMNS)


def output_columns(image_column: str = IMAGE_COLUMN) -> tuple[str, ...]:
    """The prepared file's columns: :data:`OUTPUT_COLUMNS`, with ``images`` for a multi-image source."""
    return tuple(image_column if c == IMAGE_COLUMN else c for c in OUTPUT_COLUMNS)

# Skip reasons, one constant each so counts are keyed consistently.
SKIP_NOT_IN_ID_FILE = "not in question_id_file"
SKIP_DUPLICATE_ID = "duplicate question_id"
SKIP_MISSING_ID = "missing question_id"
SKIP_MISSING_LABEL = "missing label (correct_choice_idx is null)"
SKIP_BAD_LABEL = "label is not an integer"
SKIP_LABEL_RANGE = "label out of range"
SKIP_BAD_CHOICES = "bad choices (need 2 or more non-empty strings)"
# Its own reason, not "bad choices": the row is well formed, only longer than the letters that name its choices.
SKIP_TOO_MANY_CHOICES = (f"more than {len(LETTERS)} choices (the choice letters {LETTERS[0]} to {LETTERS[-1]} "
                         f"name {len(LETTERS)}; cut the choices to fit)")
SKIP_BAD_QUESTION = "empty question"
SKIP_MISSING_IMAGE = "missing image"
SKIP_BAD_IMAGE = "undecodable image"


class DataPrepError(ValueError):
    """Input or output problem that the user must fix; the CLI prints it without a traceback."""


class MissingColumnsError(DataPrepError):
    """The source lacks columns this conversion needs."""


class EmptyResultError(DataPrepError):
    """No usable row survived the conversion."""


class OutDirNotEmptyError(DataPrepError):
    """The output directory already holds files and ``overwrite`` was not given."""


def aokvqa_features():
    """The ``datasets.Features`` of the Hub A-OKVQA dataset (image as an ``Image`` feature)."""
    from datasets import Features, Image, List, Value

    return Features(
        {
            "question_id": Value("string"),
            "image": Image(),
            "question": Value("string"),
            "choices": List(Value("string")),
            "correct_choice_idx": Value("int64"),
            "direct_answers": List(Value("string")),
            "difficult_direct_answer": Value("bool"),
            "rationales": List(Value("string")),
        }
    )


def output_features(image_column: str = IMAGE_COLUMN):
    """The ``datasets.Features`` of the prepared parquet files (see the module docstring); ``images`` is a list of
    ``Image`` features."""
    from datasets import Features, Image, List, Value

    if image_column not in (IMAGE_COLUMN, IMAGES_COLUMN):
        raise ValueError(f"image_column must be {IMAGE_COLUMN!r} or {IMAGES_COLUMN!r}, got {image_column!r}")
    return Features(
        {
            image_column: Image() if image_column == IMAGE_COLUMN else List(Image()),
            "prompt": Value("string"),
            "label_idx": Value("int64"),
            "choices": List(Value("string")),
            "question_id": Value("string"),
        }
    )


def format_schema() -> str:
    """The expected input schema as one readable line per column, for error messages."""
    lines = [f"  {name}: {kind}{'  (required)' if name in REQUIRED_COLUMNS else ''}"
             for name, kind in AOKVQA_SCHEMA.items()]
    lines.insert(2, f"  {IMAGES_COLUMN}: list of Image  (may replace image: several images per row)")
    return "\n".join(lines)


def format_prompt(question: str, choices: Sequence[str]) -> str:
    """The question followed by one lettered choice per line.

    >>> print(format_prompt("What color is the circle?", ["red", "blue", "green", "yellow"]))
    What color is the circle?
    A. red
    B. blue
    C. green
    D. yellow
    """
    lines = [question.strip()]
    lines += [f"{LETTERS[i]}. {choice.strip()}" for i, choice in enumerate(choices)]
    return "\n".join(lines)
