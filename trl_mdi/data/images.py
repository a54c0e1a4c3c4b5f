"""Images as the trainer reads them from rows: the image list of a row, decoding with a bad-row report, and datasets
whose image columns stay undecoded until the trainer decodes them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)


def row_images(row: dict) -> list:
    """A row's images as a list, as TRL reads them: the `images` column first, else `image` (None -> [])."""
    if "images" in row:
        return list(row["images"] or [])
    return [row["image"]] if row.get("image") is not None else []


def _decode(value):
    """A PIL image from what datasets stores with decode=False ({bytes, path}), a path, or a PIL image."""
    from io import BytesIO

    from PIL import Image

    if value is None or isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        img = Image.open(BytesIO(data)) if data is not None else Image.open(path)
    else:
        img = Image.open(value)
    img.load()  # decode now: a truncated file fails here, not inside the processor
    return img.convert("RGB") if img.mode != "RGB" else img


def decode_row_images(inputs: list[dict]) -> dict[int, str]:
    """Decode every row's image(s) in place; an unreadable one is replaced by a black image. Returns ``{row: error}``.

    The trainer keeps datasets from decoding images (decode=False) so that one unreadable image surfaces here,
    where it can be skipped and counted (or reported on every process at once), instead of raising inside the
    data loader of one process while the others wait for it. Rows get no extra key: TRL hands every key of the
    first row to the reward functions.
    """
    from PIL import Image

    errors: dict[int, str] = {}
    for i, row in enumerate(inputs):
        for key in ("image", "images"):
            if key not in row:
                continue
            try:
                row[key] = ([_decode(v) for v in row[key]] if isinstance(row[key], list) else _decode(row[key]))
            except Exception as e:  # any decoder error: PIL raises several kinds
                # A black stand-in keeps the batch's shapes and the vision tower's work the same on every process
                # (ZeRO-3 gathers its weights on all ranks); the row's rollouts are dropped from the update anyway.
                blank = Image.new("RGB", (56, 56))
                row[key] = [blank] if key == "images" else blank
                errors[i] = f"{type(e).__name__}: {e}"
    return errors


def lazy_images(dataset):
    """The dataset with its image column(s) left undecoded, so the trainer decodes them (see decode_row_images)."""
    from datasets import Dataset, Image, List

    if not isinstance(dataset, Dataset):
        return dataset  # dicts of datasets and iterable datasets are passed through unchanged
    for col in ("image", "images"):
        feature = dataset.features.get(col)
        if isinstance(feature, Image) and feature.decode:
            dataset = dataset.cast_column(col, Image(decode=False))
        elif isinstance(feature, List) and isinstance(feature.feature, Image) and feature.feature.decode:
            dataset = dataset.cast_column(col, List(Image(decode=False)))
    return dataset


def report_bad_images(inputs: list[dict], errors: dict[int, str], policy: str, gather_object: Callable) -> None:
    """``on_bad_image``: "skip" warns about the skipped rows; "error" stops every process at once, naming the rows
    of all of them (gathered, so that none is left waiting in a collective). All processes must call it."""
    described = [f"{inputs[i].get('question_id', i)!r} ({e})" for i, e in errors.items()]
    if policy == "error":
        reports = [r for r in gather_object([f"row {d}" for d in described]) if r]
        if reports:
            raise RuntimeError(f"unreadable image(s) in the training data ({len(reports)}): " + "; ".join(reports)
                               + ". Fix or drop these rows, or set on_bad_image='skip' to skip them.")
    elif described:
        logger.warning("skipping %d rollout(s) with an unreadable image: %s", len(described), "; ".join(described))


def check_images_per_row(inputs: list[dict], facts, gather_object: Callable) -> None:
    """Stop every process at once, with the reason, when a prompt holds more images than the family takes under TRL,
    or none where the family needs one (``ModelFacts.images_per_row_problem``), before TRL hands the batch to the
    model, which would fail with a bare shape error or a garbled prompt. ``facts`` is the same on every process, so
    all of them gather or none does."""
    if not (getattr(facts, "one_image_per_row", None) or getattr(facts, "image_in_every_prompt", None)):
        return
    problem = facts.images_per_row_problem([len(row_images(x)) for x in inputs])
    problems = [p for p in gather_object([problem]) if p]
    if problems:
        raise ValueError(problems[0])


def images_per_process(inputs: list[dict], gather: Callable, device) -> list[bool]:
    """Per process, whether its part of the batch holds any image. All processes must call it (one gather)."""
    has = torch.tensor([float(any(row_images(x) for x in inputs))], device=device)
    return [bool(f) for f in gather(has).tolist()]


def check_images_on_every_rank(flags: list[bool]) -> None:
    """Under ZeRO-3 without the dummy vision pass (``trl_mdi.vision_pass``), a batch with images on some processes
    and none on others would hang: say so instead. ``flags``: ``images_per_process``.

    The vision tower's sharded weights are gathered collectively, so a process whose batch has no image would never
    join the gather the others wait in.
    """
    if any(flags) and not all(flags):
        raise RuntimeError(
            "ZeRO-3: this generation batch has images on some processes and none on others "
            f"(per process: {[int(f) for f in flags]}), and this model cannot take the dummy vision pass that keeps "
            "processes in step (see the start-up log for why). The vision tower would run on some ranks only and "
            "the sharded-weight gathers would wait forever. Mix text-only and image rows so every per-device batch "
            "holds at least one image, or train text-only data with DDP / ZeRO-2."
        )
