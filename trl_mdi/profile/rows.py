"""The rows a profile measures: one split opened and prepared as the entry point does (``trl_mdi.data``), sampled,
and checked to hold images, all before any weight is loaded."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..data import (
    EVAL_SPLIT_CANDIDATES,
    DatasetError,
    image_column_of,
    open_dataset,
    prepare_split,
    prompt_column_of,
)
from ..data.images import lazy_images
from .arguments import ProfileArguments


@dataclasses.dataclass
class ProfileRows:
    """The prepared rows (``prompt`` conversational, images under ``image`` or ``images``) and how they were got."""

    dataset: Any
    source: str
    split: str
    image_key: str  # "image" (one per row) or "images" (a list), the keys trl_mdi.data.images decodes
    completion_column: str | None
    rows_in_split: int
    dropped: dict[str, int]  # reason -> rows dropped while preparing (unreadable, not found, too large)
    without_image: int

    def describe(self) -> str:
        """One line for logs and the report."""
        line = f"{self.source}, split {self.split!r}: {self.dataset.num_rows} of {self.rows_in_split} rows"
        if self.dropped:
            line += " (dropped: " + ", ".join(f"{n} {why}" for why, n in sorted(self.dropped.items())) + ")"
        return line


def pick_split(names: list[str], requested: str | None, source: str, shown: str) -> str:
    """``--split``, else the first eval-like split present, else ``train``, else the only split.

    >>> pick_split(["train", "validation"], None, "d", ""), pick_split(["sample_200"], None, "d", "")
    ('validation', 'sample_200')
    """
    if requested is not None:
        if requested not in names:
            raise DatasetError(f"no split {requested!r} (--split) in {source}; splits found: {shown}")
        return requested
    for name in (*EVAL_SPLIT_CANDIDATES, "train"):
        if name in names:
            return name
    if len(names) == 1:
        return names[0]
    raise DatasetError(f"{source} has no validation or train split (splits found: {shown}): choose one with --split")


def load_profile_rows(args: ProfileArguments, log: Callable[[str], None] = print) -> ProfileRows:
    """Open ``args.data``, pick the split, sample ``num_samples`` rows with ``seed``, and prepare them.

    DatasetError when the data cannot be opened, the split lacks an image or prompt column (or the completion
    column), or no sampled row is left with an image.
    """
    raw, source, roots = open_dataset(args.data, log)
    split = pick_split(list(raw), args.split, source, raw.describe())
    ds = raw[split]
    image_col = image_column_of(ds.column_names, args.data.image_column, split)
    prompt_col = prompt_column_of(ds.column_names, args.data.prompt_column, split)
    if args.completion_column and args.completion_column not in ds.column_names:
        raise DatasetError(f"split {split!r} has no column {args.completion_column!r} (--completion_column); its "
                           f"columns: {ds.column_names}")
    rows_in = ds.num_rows
    if args.num_samples and args.num_samples < rows_in:
        # Sampled before preparing, so a large split is never converted whole; the same rows for every model.
        ds = ds.shuffle(seed=args.seed).select(range(args.num_samples))
    ds, report = prepare_split(ds, split, image_column=image_col, prompt_column=prompt_col, roots=roots,
                               max_image_side=args.data.max_image_side, system_prompt=args.data.system_prompt or None)
    if ds.num_rows == report.without_image:
        raise DatasetError(
            f"split {split!r} of {source}: none of the {report.rows_in} sampled rows has a usable image "
            f"({report.describe()}); an attention profile measures attention on images. Give a split with images "
            "(--split, --image_column)")
    image_key = "images" if image_col == "images" or _is_list(ds.features[image_col]) else "image"
    if image_col != image_key:
        if image_key in ds.column_names:
            ds = ds.remove_columns(image_key)  # the chosen --image_column wins over a same-named other column
        ds = ds.rename_column(image_col, image_key)
    # Images left undecoded, so that one that fails to decode is skipped and counted at batch time.
    return ProfileRows(dataset=lazy_images(ds), source=source, split=split, image_key=image_key,
                       completion_column=args.completion_column, rows_in_split=rows_in, dropped=report.dropped,
                       without_image=report.without_image)


def _is_list(feature) -> bool:
    from datasets import List

    return isinstance(feature, (List, list))
