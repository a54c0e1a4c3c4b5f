"""Preparing a split for the trainer (step 3 of `trl_mdi.data`): images resolved, checked and made RGB,
prompts turned into TRL's conversational form with the system prompt.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import os
from collections.abc import Sequence
from typing import Any

from ..answer_format import DEFAULT_SYSTEM_PROMPT  # built from the answer format it asks for
from .columns import DatasetError, check_choices

DEFAULT_MAX_IMAGE_SIDE = 1024

DROP_TOO_LARGE = "image too large (longer side over max_image_side)"
DROP_TOO_MANY_PIXELS = "image too large to open (over PIL's decompression-bomb limit)"
DROP_NOT_FOUND = "image file not found"
DROP_UNREADABLE = "unreadable image"
_DROP = "_trl_mdi_drop"  # temporary column: why a row is dropped ("" to keep it)
_NO_IMAGE = "(no image)"  # kept, but counted


def to_conversational(example: dict[str, Any], system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
                      prompt_column: str = "prompt") -> dict[str, Any]:
    """Map a row with a text prompt to TRL's conversational form.

    TRL requires conversational prompts for multimodal training: it inserts the row's image into the first user
    message itself (``prepare_multimodal_messages``), so the image stays in its own ``image`` column.

    >>> to_conversational({"prompt": "Q?"}, "Be brief.")["prompt"]
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Q?'}]
    """
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": example[prompt_column]})
    return {"prompt": messages}


@dataclasses.dataclass
class SplitReport:
    """What happened to one split on its way to the trainer."""

    name: str
    rows_in: int
    rows_out: int
    dropped: dict[str, int]
    without_image: int = 0
    limits: dict[str, str] = dataclasses.field(default_factory=dict)  # reason -> the limit that dropped those rows

    def describe(self) -> str:
        line = f"{self.name}: {self.rows_out} rows"
        if self.dropped:
            reasons = ", ".join(f"{n} {reason}" + (f" [limit: {self.limits[reason]}]" if reason in self.limits else "")
                                for reason, n in sorted(self.dropped.items()))
            line += f" ({sum(self.dropped.values())} of {self.rows_in} dropped: {reasons})"
        if self.without_image:
            line += f"; {self.without_image} rows have no image (kept, they get no MDI)"
        return line


# -------------------------------------------------------------------------------------------------- images


def _resolve_path(path: str, roots: Sequence[str]) -> str | None:
    path = os.path.expanduser(path)
    if os.path.isabs(path):
        return path if os.path.isfile(path) else None
    for root in roots:
        candidate = os.path.join(root, path)
        if os.path.isfile(candidate):
            return candidate
    return None


def prepare_image(value: Any, roots: Sequence[str] = (), max_side: int = DEFAULT_MAX_IMAGE_SIDE):
    """One image cell -> ``({"bytes": ..., "path": None}, None)``, ``(None, None)`` for no image, or ``(None, reason)``.

    The cell may be a ``{bytes, path}`` dict (a datasets Image), raw bytes, a file path (relative paths are looked up
    in ``roots``) or a PIL image. Only the header is read to get the size and mode; non-RGB images are converted
    (transparency on white, as the prep script does) and re-encoded.
    """
    from PIL import Image as PILImage

    from ..aokvqa import ImageDecodeError, to_rgb_image_bytes

    if value is None:
        return None, None
    data = None
    if isinstance(value, PILImage.Image):
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        data = buf.getvalue()
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    elif isinstance(value, dict) and value.get("bytes"):
        data = bytes(value["bytes"])
    else:
        path = value.get("path") if isinstance(value, dict) else value
        if not path:
            return None, None
        if not isinstance(path, str):
            return None, DROP_UNREADABLE
        resolved = _resolve_path(path, roots)
        if resolved is None:
            return None, DROP_NOT_FOUND
        with open(resolved, "rb") as fh:
            data = fh.read()
    try:
        with PILImage.open(io.BytesIO(data)) as img:  # lazy: reads the header only
            size, mode = img.size, img.mode
    except PILImage.DecompressionBombError:  # a readable header, too many pixels: say so, not "unreadable"
        return None, DROP_TOO_MANY_PIXELS
    except Exception:  # PIL raises several types for non-images
        return None, DROP_UNREADABLE
    if max_side and max(size) > max_side:
        return None, DROP_TOO_LARGE
    if mode != "RGB":
        try:
            data = to_rgb_image_bytes(data)
        except ImageDecodeError:
            return None, DROP_UNREADABLE
    return {"bytes": data, "path": None}, None


# ------------------------------------------------------------------------------------------------- prompts


def _prompt_messages(example: dict[str, Any], system_prompt: str | None, column: str) -> dict[str, Any]:
    value = example[column]
    if isinstance(value, str):
        return to_conversational(example, system_prompt, column)
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        # Already conversational: add the system prompt only when the conversation has none.
        if system_prompt and not (value and value[0]["role"] == "system"):
            value = [{"role": "system", "content": system_prompt}, *value]
        return {"prompt": value}
    raise DatasetError(f"prompt column {column!r} holds {type(value).__name__}, expected text or a message list")


def prepare_split(ds, name: str, *, image_column: str, prompt_column: str, roots: Sequence[str] = (),
                  max_image_side: int = DEFAULT_MAX_IMAGE_SIDE, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT):
    """Images resolved, checked and RGB, prompts conversational: ``(dataset, SplitReport)``.

    DatasetError first, before any image is read, when a row has more choices than the choice letters A to Z name,
    a label outside its choices, a duplicate choice or a choice marker inside a choice (``check_choices``): the
    training data and the profile's rows both come through here."""
    from datasets import Image, List, Value

    check_choices(ds, name)
    feature = ds.features[image_column]
    is_list = isinstance(feature, (List, list))
    # decode=False hands us the stored {bytes, path}: no decoding by datasets, relative paths stay relative.
    if isinstance(feature, Image):
        ds = ds.cast_column(image_column, Image(decode=False))
    elif is_list and isinstance(getattr(feature, "feature", None), Image):
        ds = ds.cast_column(image_column, List(Image(decode=False)))
    roots = [os.path.abspath(r) for r in roots]

    def convert(example):
        if is_list:
            images, reason = [], ""
            for v in example[image_column] or []:
                img, why = prepare_image(v, roots, max_image_side)
                if why:
                    images, reason = [], why
                    break
                if img is not None:
                    images.append(img)
            status = reason or ("" if images else _NO_IMAGE)
            return {image_column: images, _DROP: status}
        img, why = prepare_image(example[image_column], roots, max_image_side)
        return {image_column: img, _DROP: why or ("" if img is not None else _NO_IMAGE)}

    features = ds.features.copy()
    features[image_column] = List(Image()) if is_list else Image()
    features[_DROP] = Value("string")
    rows_in = ds.num_rows
    ds = ds.map(convert, features=features, desc=f"checking images of {name}")
    status = collections.Counter(ds[_DROP])
    dropped = {reason: n for reason, n in status.items() if reason not in ("", _NO_IMAGE)}
    if dropped:
        ds = ds.filter(lambda s: s in ("", _NO_IMAGE), input_columns=_DROP, desc=f"dropping rows of {name}")
    ds = ds.remove_columns(_DROP)
    ds = ds.map(_prompt_messages, fn_kwargs={"system_prompt": system_prompt, "column": prompt_column},
                desc=f"building prompts of {name}")
    return ds, SplitReport(name, rows_in, ds.num_rows, dropped, status.get(_NO_IMAGE, 0),
                           limits=drop_limits(max_image_side))


def drop_limits(max_image_side: int) -> dict[str, str]:
    """The limit behind each size-related drop reason, for ``SplitReport.describe``: the longer side allowed, and
    PIL's decompression-bomb limit (twice ``PIL.Image.MAX_IMAGE_PIXELS``; PIL refuses to open a larger image)."""
    from PIL import Image as PILImage

    limits = {}
    if max_image_side:
        limits[DROP_TOO_LARGE] = f"longer side <= {max_image_side} px (--max_image_side; 0 keeps all)"
    if PILImage.MAX_IMAGE_PIXELS:
        limits[DROP_TOO_MANY_PIXELS] = (f"{2 * PILImage.MAX_IMAGE_PIXELS} pixels, twice PIL.Image.MAX_IMAGE_PIXELS; "
                                        "shrink the image, or raise that limit if you trust the file")
    return limits
