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
    """An RGB PIL image from what datasets stores with decode=False ({bytes, path}), a path, or a PIL image."""
    from io import BytesIO

    from PIL import Image

    from .pixels import to_rgb

    if value is None:
        return value
    if isinstance(value, Image.Image):
        return to_rgb(value)
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        img = Image.open(BytesIO(data)) if data is not None else Image.open(path)
    else:
        img = Image.open(value)
    img.load()  # decode now: a truncated file fails here, not inside the processor
    return to_rgb(img)  # as the data prep converts it: 16-bit scaled to 8, transparency on white


class ImageRefusedError(ValueError):
    """The processor refuses an image of this size or shape (its own words, from :class:`ProcessorImageCheck`)."""


UNUSUAL_SHAPE_RATIO, UNUSUAL_SHAPE_SIDE = 10, 64
"""An image with a side ratio over 10:1 or a side under 64 px is also run through the image processor (on a blank image
of its size) by :class:`ProcessorImageCheck`: the shapes processors refuse, where their token count may not say so."""


class ProcessorImageCheck:
    """Whether a processor takes an image of a given size, asked of the processor itself before any batch holds it,
    and how many tokens the image takes in the prompt. ``check(size)``: None, or why the processor refuses a
    ``(width, height)`` image.

    Without this, an image the family's processor refuses (Qwen2.5-VL: "absolute aspect ratio must be smaller than
    200" for a 1000x4 image) passes every data check and fails inside TRL's prompt encoding, after the weights load,
    where ``on_bad_image`` cannot catch it. The verdict, per size (cached):

    1. the processor's own count of the image's tokens (``_get_num_multimodal_tokens``, the hook vLLM sizes prompts
       with, where the processor has one): an error there is the refusal, with the processor's message (the limit in
       its own words); no token at all is a refusal too;
    2. for a shape far from a photo's (a side under ``UNUSUAL_SHAPE_SIDE`` px or a ratio over
       ``UNUSUAL_SHAPE_RATIO``:1), the image processor run on a blank image of that size: any error it raises (Pixtral
       refuses a 2x300 image while its token count takes it).

    ``key``: a digest of the processor's class and image settings, for the data load's cache (a different budget is a
    different verdict).
    """

    def __init__(self, processor):
        self.processor = processor
        self.image_processor = getattr(processor, "image_processor", None)
        self._count = getattr(processor, "_get_num_multimodal_tokens", None)
        self._verdicts: dict[tuple[int, int], tuple[str | None, int | None]] = {}

    @property
    def key(self) -> str:
        import hashlib
        import json

        settings = self.image_processor.to_dict() if hasattr(self.image_processor, "to_dict") else {}
        blob = json.dumps([type(self.processor).__name__, settings], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def __call__(self, size: tuple[int, int]) -> str | None:
        return self._verdict(size)[0]

    def image_tokens(self, size: tuple[int, int]) -> int | None:
        """Tokens a ``(width, height)`` image takes in the prompt (its markers included), by the processor's own
        count; None where the processor has no count or refuses the size."""
        return self._verdict(size)[1]

    def _verdict(self, size: tuple[int, int]) -> tuple[str | None, int | None]:
        size = (int(size[0]), int(size[1]))
        if size not in self._verdicts:
            self._verdicts[size] = self._ask(size)
        return self._verdicts[size]

    def _ask(self, size: tuple[int, int]) -> tuple[str | None, int | None]:
        width, height = size
        name = type(self.image_processor or self.processor).__name__
        tokens = None
        if self._count is not None:
            try:
                tokens = int(self._count(image_sizes=[(height, width)]).num_image_tokens[0])
            except Exception as e:  # the processor's own refusal (a ValueError for Qwen-VL's aspect ratio)
                return f"{name} refuses a {width}x{height} image: {' '.join(str(e).split())}", None
            if tokens <= 0:
                return f"{name} gives a {width}x{height} image no image token", None
        unusual = min(size) < UNUSUAL_SHAPE_SIDE or max(size) > UNUSUAL_SHAPE_RATIO * min(size)
        if unusual and self.image_processor is not None:
            from PIL import Image

            try:
                self.image_processor(images=[Image.new("RGB", size)], return_tensors="pt")
            except Exception as e:
                return f"{name} refuses a {width}x{height} image: {' '.join(str(e).split())}", None
        return None, tokens


def decode_row_images(inputs: list[dict], check: Callable[[tuple[int, int]], str | None] | None = None
                      ) -> dict[int, str]:
    """Decode every row's image(s) in place; an unreadable one, or one ``check`` (``ProcessorImageCheck``) refuses, is
    replaced by a black image. Returns ``{row: error}``.

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
                for img in (row[key] if isinstance(row[key], list) else [row[key]]):
                    refused = check(img.size) if check is not None and img is not None else None
                    if refused:
                        raise ImageRefusedError(refused)
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
    of all of them (gathered, so that none is left waiting in a collective). All processes must call it. A row's
    error is its decoder's, or the processor's refusal (``ImageRefusedError``, with the processor's limit)."""
    described = [f"{inputs[i].get('question_id', i)!r} ({e})" for i, e in errors.items()]
    if policy == "error":
        reports = [r for r in gather_object([f"row {d}" for d in described]) if r]
        if reports:
            raise RuntimeError(f"unreadable image(s) in the training data, or image(s) the processor refuses "
                               f"({len(reports)}): " + "; ".join(reports)
                               + ". Fix or drop these rows, or set on_bad_image='skip' to skip them.")
    elif described:
        logger.warning("skipping %d rollout(s) with an unreadable image or one the processor refuses: %s",
                       len(described), "; ".join(described))


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
