"""Reading A-OKVQA: a Hub name, a local copy of the Hub repository, a ``save_to_disk`` folder or parquet files,
each resolved to its splits and read in batches without decoding any image.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import pyarrow.parquet as pq

from .schema import (
    HUB_DATASET,
    IMAGE_COLUMN,
    DataPrepError,
    MissingColumnsError,
    format_schema,
    image_column_of,
    read_columns,
)


@dataclasses.dataclass
class SplitSource:
    """One split of the input: where it comes from, its columns, and a batch iterator.

    ``batches(columns, batch_size)`` yields ``(rows, base_dir)`` with rows as a list of dicts and base_dir
    the directory relative image paths are resolved against (None for Hub data).
    """

    name: str
    description: str
    columns_by_origin: dict[str, list[str]]
    num_rows: int
    batches: Callable[[Sequence[str], int], Iterator[tuple[list[dict[str, Any]], str | None]]]


def split_of_filename(path: str) -> str | None:
    """The split a parquet file belongs to, from its name or its parent directory's name.

    Recognises the Hub layout (``data/train-00000-of-00002.parquet``, with or without a hash suffix),
    plain names (``validation.parquet``) and the parquet-converter layout (``default/test/0000.parquet``).

    >>> split_of_filename("data/train-00000-of-00002-d306bf3ad53b6618.parquet")
    'train'
    >>> split_of_filename("x/val.parquet"), split_of_filename("default/test/0000.parquet")
    ('validation', 'test')
    >>> split_of_filename("notes.parquet") is None
    True
    """
    aliases = {"train": "train", "validation": "validation", "val": "validation", "test": "test"}
    stem = os.path.basename(path)[: -len(".parquet")] if path.endswith(".parquet") else os.path.basename(path)
    match = re.match(r"^(train|validation|val|test)(?:$|[-._])", stem)
    if match:
        return aliases[match.group(1)]
    parent = os.path.basename(os.path.dirname(path))
    return aliases.get(parent)


def _parquet_split_sources(
    files: Iterable[str], origin: str, log: Callable[[str], None]
) -> dict[str, SplitSource]:
    by_split: dict[str, list[str]] = collections.defaultdict(list)
    unknown = []
    for path in sorted(files):
        split = split_of_filename(path)
        if split:
            by_split[split].append(path)
        else:
            unknown.append(path)
    if unknown:
        hint = (
            "name files like 'train-00000-of-00001.parquet', 'validation.parquet' or put them under 'test/'"
        )
        if not by_split:
            raise DataPrepError(f"{origin}: cannot tell the split of {unknown[:3]}; {hint}")
        log(
            f"ignoring {len(unknown)} parquet file(s) of no known split under {origin}: {unknown[:3]} ({hint})"
        )
    sources = {}
    for split, paths in by_split.items():
        columns = {path: pq.read_schema(path).names for path in paths}
        num_rows = sum(pq.ParquetFile(path).metadata.num_rows for path in paths)
        sources[split] = SplitSource(
            name=split,
            description=f"{len(paths)} parquet file(s) under {origin}",
            columns_by_origin=columns,
            num_rows=num_rows,
            batches=_parquet_batches(paths),
        )
    return sources


def _parquet_batches(paths: list[str]):
    def batches(columns: Sequence[str], batch_size: int):
        for path in paths:
            base_dir = os.path.dirname(os.path.abspath(path))
            # Streaming by record batch keeps memory at one batch of images, not the whole split.
            for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size, columns=list(columns)):
                yield batch.to_pylist(), base_dir

    return batches


def _datasets_split_sources(dataset_dict, origin: str) -> dict[str, SplitSource]:
    sources = {}
    for split, ds in dataset_dict.items():
        sources[split] = SplitSource(
            name=split,
            description=f"{origin} [{split}]",
            columns_by_origin={origin: list(ds.column_names)},
            num_rows=ds.num_rows,
            batches=_datasets_batches(ds),
        )
    return sources


def _datasets_batches(ds):
    def batches(columns: Sequence[str], batch_size: int):
        # The "arrow" format hands back the stored {bytes, path} structs: no image is decoded by datasets,
        # so a corrupt one reaches our own try block instead of raising mid-iteration.
        for table in ds.select_columns(list(columns)).with_format("arrow").iter(batch_size=batch_size):
            yield table.to_pylist(), None

    return batches


def open_source(dataset_path: str, log: Callable[[str], None] = print) -> dict[str, SplitSource]:
    """Resolve ``dataset_path`` to its splits without reading any row.

    Accepts a local directory (searched recursively for parquet files; or a ``save_to_disk`` directory),
    a parquet file, a glob of parquet files, or a Hub dataset name loaded with ``datasets.load_dataset``.
    """
    if os.path.isdir(dataset_path):
        if os.path.exists(os.path.join(dataset_path, "dataset_dict.json")):
            from datasets import load_from_disk

            return _datasets_split_sources(load_from_disk(dataset_path), dataset_path)
        files = glob.glob(os.path.join(dataset_path, "**", "*.parquet"), recursive=True)
        # Skip hidden paths (e.g. .cache/ of huggingface_hub downloads): they hold partial copies.
        files = [
            f
            for f in files
            if not any(p.startswith(".") for p in os.path.relpath(f, dataset_path).split(os.sep))
        ]
        if not files:
            raise DataPrepError(f"no parquet files found under directory {dataset_path!r}")
        return _parquet_split_sources(files, dataset_path, log)
    if os.path.isfile(dataset_path):
        return _parquet_split_sources([dataset_path], dataset_path, log)
    if glob.has_magic(dataset_path):
        files = glob.glob(dataset_path, recursive=True)
        if not files:
            raise DataPrepError(f"no files match {dataset_path!r}")
        return _parquet_split_sources(files, dataset_path, log)
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", dataset_path):
        raise DataPrepError(
            f"{dataset_path!r} is neither an existing local path nor a Hub dataset name (org/name)"
        )
    from datasets import load_dataset

    try:
        dataset_dict = load_dataset(dataset_path)
    except Exception as exc:
        raise DataPrepError(
            f"could not load {dataset_path!r} from the Hugging Face Hub ({type(exc).__name__}: {exc}). "
            "Offline? Pass a local copy with --dataset_path DIR (a directory of parquet files in the "
            "A-OKVQA schema, e.g. a local copy of the HuggingFaceM4/A-OKVQA dataset repository)."
        ) from exc
    return _datasets_split_sources(dataset_dict, dataset_path)


def check_columns(source: SplitSource) -> str:
    """The split's image column (``image``, or ``images`` holding a list per row); raises MissingColumnsError naming
    the missing columns and the expected schema, or DataPrepError when its files disagree on the image column."""
    found: dict[str, str] = {}
    for origin, columns in source.columns_by_origin.items():
        image_column = image_column_of(columns) or IMAGE_COLUMN
        missing = [c for c in read_columns(image_column) if c not in columns]
        if missing:
            raise MissingColumnsError(
                f"split {source.name!r} ({origin}) is missing column(s) {missing}; it has {sorted(columns)}.\n"
                f"Expected the A-OKVQA schema ({HUB_DATASET}):\n{format_schema()}"
            )
        found[origin] = image_column
    if len(set(found.values())) > 1:
        raise DataPrepError(
            f"split {source.name!r} mixes image columns across its files ({found}): every file of a split needs the "
            "same one ('image', or 'images' holding a list per row); convert the single-image files to an 'images' "
            "list of one, or prepare them as separate splits"
        )
    return next(iter(found.values()), IMAGE_COLUMN)
