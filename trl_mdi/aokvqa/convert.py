"""One A-OKVQA row -> one output row: label, choices and question checked first (cheap), then the image read
and made RGB (design choices 1, 2 and 4 of `trl_mdi.aokvqa`).
"""

from __future__ import annotations

import io
import os
from typing import Any

from PIL import Image as PILImage

from ..data.pixels import to_rgb
from .schema import (
    IMAGE_COLUMN,
    IMAGES_COLUMN,
    LETTERS,
    SKIP_BAD_CHOICES,
    SKIP_BAD_IMAGE,
    SKIP_BAD_LABEL,
    SKIP_BAD_QUESTION,
    SKIP_LABEL_RANGE,
    SKIP_MISSING_IMAGE,
    SKIP_MISSING_LABEL,
    SKIP_TOO_MANY_CHOICES,
    format_prompt,
)


class ImageDecodeError(ValueError):
    """An image value could not be read or converted to RGB."""


# --------------------------------------------------------------------------------------------- images


def image_value_bytes(value: Any, base_dir: str | None = None) -> bytes | None:
    """Raw encoded bytes of an image cell: a ``{bytes, path}`` dict, raw bytes, or a file path.

    Returns None when the cell holds no image. A path is resolved against ``base_dir`` when relative
    (the directory of the parquet file it came from). Raises ImageDecodeError when a path is unreadable.
    """
    if value is None:
        return None
    if isinstance(value, PILImage.Image):
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value) or None
    path = None
    if isinstance(value, dict):
        if value.get("bytes"):
            return bytes(value["bytes"])
        path = value.get("path")
    elif isinstance(value, str):
        path = value
    if not path:
        return None
    if base_dir and not os.path.isabs(path):
        path = os.path.join(base_dir, path)
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ImageDecodeError(f"cannot read image file {path!r}: {exc}") from exc


def to_rgb_image_bytes(data: bytes) -> bytes:
    """Validate encoded image bytes and return bytes that decode to an RGB image.

    RGB images come back unchanged. Grayscale, CMYK, palette, RGBA and the like are converted
    (transparency composited on white; 16-bit and other high-depth modes scaled to 8 bits:
    ``trl_mdi.data.pixels.to_rgb``) and re-encoded. Raises ImageDecodeError for anything PIL cannot
    fully decode (truncated files, non-images, decompression bombs).
    """
    try:
        with PILImage.open(io.BytesIO(data)) as img:
            # load() forces a full decode: open() alone only reads the header, so a truncated JPEG passes it.
            img.load()
            if img.mode == "RGB":
                return data
            source_format = img.format
            rgb = to_rgb(img)
        buf = io.BytesIO()
        if source_format == "JPEG":
            rgb.save(buf, format="JPEG", quality=95)
        else:
            rgb.save(buf, format="PNG")
        return buf.getvalue()
    except Exception as exc:  # PIL raises many types (OSError, SyntaxError, DecompressionBombError, ...)
        raise ImageDecodeError(f"{type(exc).__name__}: {exc}") from exc


# ------------------------------------------------------------------------------------------ row check


def convert_row(row: dict[str, Any], base_dir: str | None = None,
                image_column: str = IMAGE_COLUMN) -> tuple[dict[str, Any] | None, str | None]:
    """Turn one A-OKVQA row into an output row, or explain why it is skipped.

    Returns ``(output_row, None)`` or ``(None, reason)`` with reason one of the ``SKIP_*`` constants.
    Checks run cheapest first, so unlabelled rows never pay for image decoding. With ``image_column="images"`` the
    row holds a list of images and the output row keeps the list, in order; the row is skipped when the list is
    empty or any entry is missing (``SKIP_MISSING_IMAGE``) or unreadable (``SKIP_BAD_IMAGE``): dropping one image
    would silently change what the question refers to ("the second picture").
    """
    label = row.get("correct_choice_idx")
    if label is None or (isinstance(label, float) and label != label):  # NaN: pandas' null for ints
        return None, SKIP_MISSING_LABEL
    if isinstance(label, bool) or not isinstance(label, (int, float)) or int(label) != label:
        return None, SKIP_BAD_LABEL
    label = int(label)
    choices = row.get("choices")
    if (
        not isinstance(choices, (list, tuple))
        or len(choices) < 2
        or not all(isinstance(c, str) and c.strip() for c in choices)
    ):
        return None, SKIP_BAD_CHOICES
    if len(choices) > len(LETTERS):  # the prompt could not letter choice 27; the trainer's data load refuses it too
        return None, SKIP_TOO_MANY_CHOICES
    if not 0 <= label < len(choices):
        return None, SKIP_LABEL_RANGE
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        return None, SKIP_BAD_QUESTION
    value = row.get(image_column)
    if image_column == IMAGES_COLUMN:
        values = list(value) if isinstance(value, (list, tuple)) else [] if value is None else [value]
    else:
        values = [value]
    try:
        raws = [image_value_bytes(v, base_dir) for v in values]
        if not raws or any(raw is None for raw in raws):
            return None, SKIP_MISSING_IMAGE
        images = [{"bytes": to_rgb_image_bytes(raw), "path": None} for raw in raws]
    except ImageDecodeError:
        return None, SKIP_BAD_IMAGE
    return (
        {
            image_column: images if image_column == IMAGES_COLUMN else images[0],
            "prompt": format_prompt(question, choices),
            "label_idx": label,
            "choices": [c.strip() for c in choices],
            "question_id": str(row["question_id"]),
        },
        None,
    )
