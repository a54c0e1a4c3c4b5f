"""Preparing a split for the trainer (step 3 of `trl_mdi.data`): images resolved, checked and made RGB,
prompts turned into TRL's conversational form with the system prompt.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from ..answer_format import DEFAULT_SYSTEM_PROMPT  # built from the answer format it asks for
from .columns import DatasetError, check_choices

DEFAULT_MAX_IMAGE_SIDE = 1024

DROP_TOO_LARGE = "image too large (longer side over max_image_side)"
DROP_TOO_MANY_PIXELS = "image too large to open (over PIL's decompression-bomb limit)"
DROP_NOT_FOUND = "image file not found"
DROP_UNREADABLE = "unreadable image"
DROP_REFUSED = "image the processor refuses (its size or shape)"
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
    refused: list[str] = dataclasses.field(default_factory=list)  # the first rows the processor refuses, and why

    def describe(self) -> str:
        line = f"{self.name}: {self.rows_out} rows"
        if self.dropped:
            reasons = ", ".join(f"{n} {reason}" + (f" [limit: {self.limits[reason]}]" if reason in self.limits else "")
                                + (f" (e.g. {self.refused[0]})" if reason == DROP_REFUSED and self.refused else "")
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


def prepare_image(value: Any, roots: Sequence[str] = (), max_side: int = DEFAULT_MAX_IMAGE_SIDE,
                  check: Callable[[tuple[int, int]], str | None] | None = None):
    """One image cell -> ``({"bytes": ..., "path": None}, None)``, ``(None, None)`` for no image, or ``(None, reason)``.

    The cell may be a ``{bytes, path}`` dict (a datasets Image), raw bytes, a file path (relative paths are looked up
    in ``roots``) or a PIL image. Only the header is read to get the size and mode; an image ``check`` refuses
    (``trl_mdi.data.images.ProcessorImageCheck``: the processor would refuse its size or shape) gives the reason
    ``"<DROP_REFUSED>: <the processor's words>"``; non-RGB images are converted (16-bit scaled to 8 bits,
    transparency on white: ``trl_mdi.data.pixels.to_rgb``, as the prep script does) and re-encoded.
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
    refused = check(size) if check is not None else None
    if refused:
        return None, f"{DROP_REFUSED}: {refused}"
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
                  max_image_side: int = DEFAULT_MAX_IMAGE_SIDE, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
                  image_check=None):
    """Images resolved, checked and RGB, prompts conversational: ``(dataset, SplitReport)``.

    DatasetError first, before any image is read, when a row has more choices than the choice letters A to Z name,
    a label outside its choices, a duplicate choice or a choice marker inside a choice (``check_choices``): the
    training data and the profile's rows both come through here. ``image_check``
    (``trl_mdi.data.images.ProcessorImageCheck``): rows with an image the processor refuses are dropped and counted
    under ``DROP_REFUSED``, the first few named in ``SplitReport.refused``.

    The result is cached by ``datasets`` under a fingerprint that holds, besides the data and these settings, the
    size and modification time of every image file the rows name by path: an image file replaced since the last
    load is read again. The cache files go to ``datasets``' cache folder, never into the source (a ``save_to_disk``
    folder would otherwise receive them)."""
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
                img, why = prepare_image(v, roots, max_image_side, image_check)
                if why:
                    images, reason = [], why
                    break
                if img is not None:
                    images.append(img)
            status = reason or ("" if images else _NO_IMAGE)
            return {image_column: images, _DROP: status}
        img, why = prepare_image(example[image_column], roots, max_image_side, image_check)
        return {image_column: img, _DROP: why or ("" if img is not None else _NO_IMAGE)}

    features = ds.features.copy()
    features[image_column] = List(Image()) if is_list else Image()
    features[_DROP] = Value("string")
    rows_in = ds.num_rows
    fingerprint = _prepared_fingerprint(ds, image_column, is_list, roots, max_image_side, image_check)
    ds = ds.map(convert, features=features, desc=f"checking images of {name}", new_fingerprint=fingerprint,
                **_cache_outside_source(ds, fingerprint))
    statuses = list(ds[_DROP])
    status = collections.Counter(DROP_REFUSED if s.startswith(DROP_REFUSED) else s for s in statuses)
    dropped = {reason: n for reason, n in status.items() if reason not in ("", _NO_IMAGE)}
    limits = drop_limits(max_image_side)
    refused = [i for i, s in enumerate(statuses) if s.startswith(DROP_REFUSED)]
    if refused:
        limits[DROP_REFUSED] = "the processor's own, in its words below"
        ids = ds.select_columns(["question_id"])[refused[:5]]["question_id"] if "question_id" in ds.column_names \
            else [None] * len(refused[:5])
        refused = [(f"question_id {q!r}" if q is not None else f"row {i}") + ": "
                   + statuses[i][len(DROP_REFUSED) + 2:] for i, q in zip(refused[:5], ids)]
    if dropped:
        ds = ds.filter(lambda s: s in ("", _NO_IMAGE), input_columns=_DROP, desc=f"dropping rows of {name}")
    ds = ds.remove_columns(_DROP)
    ds = ds.map(_prompt_messages, fn_kwargs={"system_prompt": system_prompt, "column": prompt_column},
                desc=f"building prompts of {name}")
    return ds, SplitReport(name, rows_in, ds.num_rows, dropped, status.get(_NO_IMAGE, 0), limits=limits,
                           refused=refused)


_PREPARED_VERSION = "2"  # bump when convert() changes what it writes: older cache files are then not reused


def _prepared_fingerprint(ds, image_column: str, is_list: bool, roots: Sequence[str], max_image_side: int,
                          image_check) -> str:
    """The fingerprint of ``prepare_split``'s image pass: the input's own (``datasets``' fingerprint: its files and
    the operations on them), the settings, the image check's key, and the size and modification time of every image
    file a row names by path (``datasets`` knows none of these files, so without them a replaced image would be
    served from the cache)."""
    stats = [(p, *_file_stamp(_resolve_path(p, roots))) for p in _image_paths(ds, image_column, is_list)]
    blob = json.dumps([_PREPARED_VERSION, getattr(ds, "_fingerprint", None), image_column, is_list, list(roots),
                       max_image_side, getattr(image_check, "key", None) if image_check is not None else None, stats],
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _image_paths(ds, image_column: str, is_list: bool) -> list[str]:
    """The image paths of the column's cells that hold a path and no bytes, read from the Arrow column (no image
    bytes are copied)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = ds.with_format("arrow")[image_column]
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if is_list:
        column = pc.list_flatten(column)
    if pa.types.is_struct(column.type):
        names = [column.type.field(i).name for i in range(column.type.num_fields)]
        if "path" not in names:
            return []
        paths = pc.struct_field(column, "path")
        if "bytes" in names:
            paths = pc.if_else(pc.is_valid(pc.struct_field(column, "bytes")), pa.scalar(None, paths.type), paths)
        return [p for p in paths.to_pylist() if p]
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return [p for p in column.to_pylist() if p]
    return []


def _file_stamp(path: str | None) -> tuple[int, int] | tuple[None, None]:
    """(size, modification time in ns) of a file, (None, None) when it is not there."""
    try:
        st = os.stat(path) if path else None
    except OSError:
        st = None
    return (st.st_size, st.st_mtime_ns) if st else (None, None)


def _cache_outside_source(ds, fingerprint: str) -> dict[str, str]:
    """``map`` keyword arguments that keep its cache file out of the source: ``datasets`` writes a map's cache next
    to the input's files, which for a ``save_to_disk`` folder is the user's dataset. Inputs already in ``datasets``'
    cache folder, or held in memory, keep the default."""
    import datasets

    files = [f["filename"] for f in getattr(ds, "cache_files", None) or []]
    if not files:
        return {}
    cache_root = os.path.realpath(datasets.config.HF_DATASETS_CACHE)
    folder = os.path.realpath(os.path.dirname(files[0]))
    if os.path.commonpath([folder, cache_root]) == cache_root:
        return {}
    out = os.path.join(cache_root, "trl_mdi_prepared")
    os.makedirs(out, exist_ok=True)
    return {"cache_file_name": os.path.join(out, f"images-{fingerprint}.arrow")}


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
