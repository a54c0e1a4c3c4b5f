"""A-OKVQA -> training parquet: the library behind ``data_prep/prepare_aokvqa_for_trl.py``.

Input is A-OKVQA in its Hub schema (``HuggingFaceM4/A-OKVQA``): a Hub name (loaded with
``datasets.load_dataset``), a local copy of the Hub repository (``<dir>/data/train-00000-of-0000N.parquet``
...), a directory saved with ``save_to_disk``, or parquet files / a glob in the same schema. Output is one
parquet file per split under ``out_dir`` (``train.parquet``, ``validation.parquet`` and, with
``subset_size=N``, ``sample_N.parquet``) with the columns

    image        Image feature, bytes embedded, always decodes to an RGB PIL image
    prompt       the question, then one line per choice: "A. ...", "B. ...", ...
    label_idx    int, index of the correct choice
    choices      list of str
    question_id  str

Design choices, and why:

1. Images are read by us, with PIL, inside a try block: ``datasets`` decodes lazily and a single corrupt
   JPEG would otherwise raise deep inside an iteration, after minutes of work. A row whose image does not
   decode is skipped and counted, never fatal.
2. Rows are checked cheapest-first (question id filter, label, choices, question, then image), so the
   unlabelled test split (~6.7k rows) costs no image decoding at all.
3. Nothing in ``out_dir`` changes until every split has been converted: each output is written to a
   hidden temporary file in ``out_dir`` and moved into place with ``os.replace`` at the end. A crash or a
   validation error (empty result, too large a subset) leaves the previous outputs untouched and never a
   half-written parquet under a final name.
4. Images that are already RGB keep their original bytes (no JPEG re-compression); other modes are
   converted (RGBA / LA / palette-with-transparency composited on white) and re-encoded, as JPEG
   (quality 95) when the source was JPEG and lossless PNG otherwise.
5. Duplicate question ids inside a split keep their first row; the rest are skipped and counted, which also
   makes a directory holding two copies of the same split harmless.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import io
import os
import random
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image as PILImage

HUB_DATASET = "HuggingFaceM4/A-OKVQA"
SPLITS = ("train", "validation", "test")
DEFAULT_SPLITS = ("train", "validation")
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

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

# Skip reasons, one constant each so counts are keyed consistently.
SKIP_NOT_IN_ID_FILE = "not in question_id_file"
SKIP_DUPLICATE_ID = "duplicate question_id"
SKIP_MISSING_ID = "missing question_id"
SKIP_MISSING_LABEL = "missing label (correct_choice_idx is null)"
SKIP_BAD_LABEL = "label is not an integer"
SKIP_LABEL_RANGE = "label out of range"
SKIP_BAD_CHOICES = "bad choices (need 2-26 non-empty strings)"
SKIP_BAD_QUESTION = "empty question"
SKIP_MISSING_IMAGE = "missing image"
SKIP_BAD_IMAGE = "undecodable image"

_OUTPUT_NAME_RE = re.compile(r"^(train|validation|test|sample_\d+)\.parquet$")
_TEMP_PREFIX = ".prep-"


class DataPrepError(ValueError):
    """Input or output problem that the user must fix; the CLI prints it without a traceback."""


class MissingColumnsError(DataPrepError):
    """The source lacks columns this conversion needs."""


class EmptyResultError(DataPrepError):
    """No usable row survived the conversion."""


class OutDirNotEmptyError(DataPrepError):
    """The output directory already holds files and ``overwrite`` was not given."""


class ImageDecodeError(ValueError):
    """An image value could not be read or converted to RGB."""


# --------------------------------------------------------------------------------------------- schema


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


def output_features():
    """The ``datasets.Features`` of the prepared parquet files (see the module docstring)."""
    from datasets import Features, Image, List, Value

    return Features(
        {
            "image": Image(),
            "prompt": Value("string"),
            "label_idx": Value("int64"),
            "choices": List(Value("string")),
            "question_id": Value("string"),
        }
    )


def format_schema() -> str:
    """The expected input schema as one readable line per column, for error messages."""
    return "\n".join(
        f"  {name}: {kind}{'  (required)' if name in REQUIRED_COLUMNS else ''}"
        for name, kind in AOKVQA_SCHEMA.items()
    )


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
    (transparency composited on white) and re-encoded. Raises ImageDecodeError for anything PIL cannot
    fully decode (truncated files, non-images, decompression bombs).
    """
    try:
        with PILImage.open(io.BytesIO(data)) as img:
            # load() forces a full decode: open() alone only reads the header, so a truncated JPEG passes it.
            img.load()
            if img.mode == "RGB":
                return data
            source_format = img.format
            rgb = _composite_to_rgb(img)
        buf = io.BytesIO()
        if source_format == "JPEG":
            rgb.save(buf, format="JPEG", quality=95)
        else:
            rgb.save(buf, format="PNG")
        return buf.getvalue()
    except Exception as exc:  # PIL raises many types (OSError, SyntaxError, DecompressionBombError, ...)
        raise ImageDecodeError(f"{type(exc).__name__}: {exc}") from exc


def _composite_to_rgb(img: PILImage.Image) -> PILImage.Image:
    has_alpha = img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        img.mode == "P" and "transparency" in img.info
    )
    if not has_alpha:
        return img.convert("RGB")
    rgba = img.convert("RGBA")
    # White, not black: transparent regions of icons and scans are meant to be seen on paper.
    background = PILImage.new("RGB", rgba.size, (255, 255, 255))
    background.paste(rgba, mask=rgba.getchannel("A"))
    return background


# ------------------------------------------------------------------------------------------ row check


def convert_row(row: dict[str, Any], base_dir: str | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """Turn one A-OKVQA row into an output row, or explain why it is skipped.

    Returns ``(output_row, None)`` or ``(None, reason)`` with reason one of the ``SKIP_*`` constants.
    Checks run cheapest first, so unlabelled rows never pay for image decoding.
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
        or not 2 <= len(choices) <= len(LETTERS)
        or not all(isinstance(c, str) and c.strip() for c in choices)
    ):
        return None, SKIP_BAD_CHOICES
    if not 0 <= label < len(choices):
        return None, SKIP_LABEL_RANGE
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        return None, SKIP_BAD_QUESTION
    try:
        raw = image_value_bytes(row.get("image"), base_dir)
        if raw is None:
            return None, SKIP_MISSING_IMAGE
        image_bytes = to_rgb_image_bytes(raw)
    except ImageDecodeError:
        return None, SKIP_BAD_IMAGE
    return (
        {
            "image": {"bytes": image_bytes, "path": None},
            "prompt": format_prompt(question, choices),
            "label_idx": label,
            "choices": [c.strip() for c in choices],
            "question_id": str(row["question_id"]),
        },
        None,
    )


# -------------------------------------------------------------------------------------------- sources


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
            "A-OKVQA schema, e.g. one written by `python -m trl_mdi.synthetic`)."
        ) from exc
    return _datasets_split_sources(dataset_dict, dataset_path)


def check_columns(source: SplitSource) -> None:
    """Raise MissingColumnsError naming the missing columns and the expected schema."""
    for origin, columns in source.columns_by_origin.items():
        missing = [c for c in REQUIRED_COLUMNS if c not in columns]
        if missing:
            raise MissingColumnsError(
                f"split {source.name!r} ({origin}) is missing column(s) {missing}; it has {sorted(columns)}.\n"
                f"Expected the A-OKVQA schema ({HUB_DATASET}):\n{format_schema()}"
            )


# --------------------------------------------------------------------------------------------- output


def write_parquet_atomic(table: pa.Table, path: str, **write_kwargs) -> str:
    """Write ``table`` to ``path`` through a temporary file in the same directory and ``os.replace``.

    Readers therefore see either the old file or the complete new one, never a truncated parquet.
    """
    tmp = _temp_path(path)
    try:
        pq.write_table(table, tmp, **write_kwargs)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise
    return path


def _temp_path(final_path: str) -> str:
    directory, name = os.path.split(os.path.abspath(final_path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f"{_TEMP_PREFIX}{name}.", suffix=".tmp")
    os.close(fd)
    # mkstemp creates files 0600; outputs should get the usual permissions, as open() would give them.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    return tmp


def _fsync(path: str) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


@dataclasses.dataclass
class SplitReport:
    """What happened to one split: rows read, written, and skipped per reason (with example ids)."""

    name: str
    rows_in: int = 0
    rows_out: int = 0
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    examples: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    path: str | None = None
    seconds: float = 0.0

    @property
    def rows_considered(self) -> int:
        """Rows read minus those dropped by the question-id filter."""
        return self.rows_in - self.skipped[SKIP_NOT_IN_ID_FILE]

    @property
    def unlabelled(self) -> bool:
        """True when the split has rows and none of them carries a label (A-OKVQA's test split)."""
        return self.rows_considered > 0 and self.skipped[SKIP_MISSING_LABEL] == self.rows_considered

    def describe(self) -> str:
        """One human-readable line (two with skip details)."""
        if self.unlabelled:
            return (
                f"split {self.name!r} has no labels (correct_choice_idx is null in all {self.rows_considered} rows): "
                "skipped, nothing written"
            )
        head = f"{self.name}: {self.rows_out} of {self.rows_in} rows written"
        head += f" -> {self.path}" if self.path else " (nothing written)"
        head += f" in {self.seconds:.1f}s"
        if not self.skipped:
            return head
        details = "; ".join(
            f"{count} {reason}"
            + (f" (e.g. {', '.join(self.examples[reason])})" if self.examples.get(reason) else "")
            for reason, count in self.skipped.most_common()
        )
        return f"{head}\n    skipped {sum(self.skipped.values())}: {details}"


@dataclasses.dataclass
class PrepReport:
    """Result of :func:`prepare_aokvqa`: per-split reports, the sample, and question-id file misses."""

    source: str
    out_dir: str
    splits: dict[str, SplitReport]
    files: dict[str, str]
    sample_rows: int | None = None
    ids_requested: int | None = None
    ids_not_found: list[str] = dataclasses.field(default_factory=list)

    @property
    def rows(self) -> dict[str, int]:
        """Rows written per output file name (without extension)."""
        return {name: pq.ParquetFile(path).metadata.num_rows for name, path in self.files.items()}

    def describe(self) -> str:
        """The multi-line summary the CLI prints."""
        lines = [f"source: {self.source}", f"out_dir: {self.out_dir}"]
        lines += [report.describe() for report in self.splits.values()]
        if self.sample_rows is not None:
            lines.append(
                f"{_sample_name(self.sample_rows)}: {self.sample_rows} rows sampled from train -> "
                f"{self.files[_sample_name(self.sample_rows)]}"
            )
        if self.ids_requested is not None:
            lines.append(_describe_missing_ids(self.ids_requested, self.ids_not_found, list(self.splits)))
        return "\n".join(lines)


def _describe_missing_ids(requested: int, not_found: list[str], splits: list[str]) -> str:
    if not not_found:
        return f"question_id_file: all {requested} ids found"
    shown = ", ".join(not_found[:5]) + (", ..." if len(not_found) > 5 else "")
    return f"question_id_file: {len(not_found)} of {requested} ids not found in splits {splits}: {shown}"


def _sample_name(n: int) -> str:
    return f"sample_{n}"


def read_question_ids(path: str) -> list[str]:
    """Question ids from a text file, one per line; blank lines and ``#`` comments are ignored."""
    with open(path, encoding="utf-8") as fh:
        ids = [line.split("#", 1)[0].strip() for line in fh]
    ids = list(dict.fromkeys(i for i in ids if i))
    if not ids:
        raise DataPrepError(f"question_id_file {path!r} holds no ids")
    return ids


def _check_out_dir(out_dir: str, overwrite: bool) -> None:
    if os.path.isfile(out_dir):
        raise OutDirNotEmptyError(f"out_dir {out_dir!r} is a file")
    if not os.path.isdir(out_dir):
        return
    entries = sorted(os.listdir(out_dir))
    if entries and not overwrite:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise OutDirNotEmptyError(
            f"out_dir {out_dir!r} already contains {len(entries)} entries ({shown}); "
            "pass --overwrite (overwrite=True) to replace this script's outputs there"
        )


def _normalise_splits(splits: Iterable[str]) -> list[str]:
    aliases = {"val": "validation"}
    names = []
    for item in splits:
        for name in str(item).split(","):
            name = aliases.get(name.strip(), name.strip())
            if name and name not in names:
                names.append(name)
    if not names:
        raise DataPrepError("no splits requested")
    return names


def _convert_split(
    source: SplitSource,
    tmp_path: str,
    schema: pa.Schema,
    wanted_ids: set[str] | None,
    found_ids: set[str],
    batch_size: int,
    log: Callable[[str], None],
) -> SplitReport:
    report = SplitReport(name=source.name)
    start = time.perf_counter()
    seen: set[str] = set()
    next_progress = 5000
    with pq.ParquetWriter(tmp_path, schema) as writer:
        for rows, base_dir in source.batches(REQUIRED_COLUMNS, batch_size):
            out_rows = []
            for row in rows:
                report.rows_in += 1
                out, reason = _check_and_convert(row, base_dir, wanted_ids, found_ids, seen)
                if out is None:
                    report.skipped[reason] += 1
                    examples = report.examples.setdefault(reason, [])
                    if len(examples) < 3 and row.get("question_id") and reason != SKIP_NOT_IN_ID_FILE:
                        examples.append(str(row["question_id"]))
                else:
                    out_rows.append(out)
            if out_rows:
                writer.write_table(pa.Table.from_pylist(out_rows, schema=schema))
                report.rows_out += len(out_rows)
            if report.rows_in >= next_progress:
                log(f"  {source.name}: {report.rows_in}/{source.num_rows} rows read")
                next_progress += 5000
    report.seconds = time.perf_counter() - start
    return report


def _check_and_convert(row, base_dir, wanted_ids, found_ids, seen):
    qid = row.get("question_id")
    if qid is None or str(qid) == "":
        return None, SKIP_MISSING_ID
    qid = str(qid)
    if wanted_ids is not None:
        if qid not in wanted_ids:
            return None, SKIP_NOT_IN_ID_FILE
        found_ids.add(qid)
    if qid in seen:
        return None, SKIP_DUPLICATE_ID
    out, reason = convert_row(row, base_dir)
    if out is not None:
        seen.add(qid)
    return out, reason


def prepare_aokvqa(
    dataset_path: str,
    out_dir: str,
    *,
    splits: Sequence[str] = DEFAULT_SPLITS,
    question_id_file: str | None = None,
    subset_size: int | None = None,
    seed: int = 42,
    overwrite: bool = False,
    batch_size: int = 256,
    log: Callable[[str], None] = print,
) -> PrepReport:
    """Convert A-OKVQA at ``dataset_path`` into training parquet files under ``out_dir``.

    Args:
        dataset_path: Hub name (e.g. ``HuggingFaceM4/A-OKVQA``), local directory, parquet file or glob.
        out_dir: output directory; created if missing; must be empty unless ``overwrite``.
        splits: splits to convert (``"val"`` means ``"validation"``; comma-separated items are split).
        question_id_file: keep only the ids listed there (one per line); ids not found are reported.
        subset_size: also write ``sample_<N>.parquet``, N rows drawn from the converted train split.
        seed: seed of that draw (the same seed and input give byte-identical files).
        overwrite: allow a non-empty ``out_dir``; earlier outputs of this function there are replaced
            (and stale ones such as an old ``sample_<M>.parquet`` removed); other files are left alone.
        batch_size: rows per read batch and per written row group.
        log: where progress and the final summary go (``print`` by default).

    Returns:
        A :class:`PrepReport`. Raises :class:`DataPrepError` (missing columns, missing split, empty
        result, non-empty ``out_dir``, bad ``subset_size``) before anything in ``out_dir`` is replaced.
    """
    split_names = _normalise_splits(splits)
    if subset_size is not None:
        if subset_size <= 0:
            raise DataPrepError(f"subset_size must be positive, got {subset_size}")
        if "train" not in split_names:
            raise DataPrepError("subset_size samples from the train split: add 'train' to splits")
    _check_out_dir(out_dir, overwrite)
    wanted = read_question_ids(question_id_file) if question_id_file else None

    sources = open_source(dataset_path, log)
    absent = [s for s in split_names if s not in sources]
    if absent:
        raise DataPrepError(f"split(s) {absent} not found in {dataset_path!r}; it has {sorted(sources)}")
    # Check every split's columns before converting any, so a bad file fails in seconds, not after train.
    for name in split_names:
        check_columns(sources[name])
        log(f"{name}: reading {sources[name].num_rows} rows from {sources[name].description}")

    os.makedirs(out_dir, exist_ok=True)
    schema = output_features().arrow_schema
    temps: dict[str, str] = {}
    found: set[str] = set()
    reports: dict[str, SplitReport] = {}
    try:
        for name in split_names:
            temps[name] = _temp_path(os.path.join(out_dir, f"{name}.parquet"))
            reports[name] = _convert_split(sources[name], temps[name], schema, wanted, found, batch_size, log)
            if reports[name].rows_out == 0:
                _remove_quietly(temps.pop(name))
        total = sum(r.rows_out for r in reports.values())
        if total == 0:
            raise EmptyResultError(
                "no usable rows: nothing written.\n" + "\n".join(r.describe() for r in reports.values())
            )
        if subset_size is not None:
            train_rows = reports["train"].rows_out
            if subset_size > train_rows:
                raise DataPrepError(f"subset_size {subset_size} exceeds the {train_rows} usable train rows")
            name = _sample_name(subset_size)
            temps[name] = _temp_path(os.path.join(out_dir, f"{name}.parquet"))
            _write_sample(temps["train"], temps[name], subset_size, seed, batch_size)
        for path in temps.values():
            _fsync(path)
        files = _commit(out_dir, temps)
    except BaseException:
        for path in temps.values():
            _remove_quietly(path)
        raise
    for name, report in reports.items():
        report.path = files.get(name)
    result = PrepReport(
        source=dataset_path,
        out_dir=out_dir,
        splits=reports,
        files=files,
        sample_rows=subset_size,
        ids_requested=len(wanted) if wanted is not None else None,
        ids_not_found=[i for i in wanted if i not in found] if wanted is not None else [],
    )
    log(result.describe())
    return result


def _write_sample(train_path: str, out_path: str, n: int, seed: int, batch_size: int) -> None:
    source = pq.ParquetFile(train_path)
    # Sorted indices keep the source order, so the sample is a stable sub-sequence of train.parquet.
    chosen = sorted(random.Random(seed).sample(range(source.metadata.num_rows), n))
    # Batch by batch: the real train split is about 1 GB of JPEG bytes, no need to hold it all.
    with pq.ParquetWriter(out_path, source.schema_arrow) as writer:
        start, cursor = 0, 0
        for batch in source.iter_batches(batch_size=batch_size):
            end = start + batch.num_rows
            local = []
            while cursor < n and chosen[cursor] < end:
                local.append(chosen[cursor] - start)
                cursor += 1
            if local:
                writer.write_table(pa.Table.from_batches([batch]).take(pa.array(local, type=pa.int64())))
            start = end


def _commit(out_dir: str, temps: dict[str, str]) -> dict[str, str]:
    files = {}
    for name, tmp in temps.items():
        final = os.path.join(out_dir, f"{name}.parquet")
        os.replace(tmp, final)
        files[name] = final
    # Outputs of an earlier run that this run did not produce (e.g. sample_100 after --subset_size 50)
    # would otherwise sit next to fresh files and be mistaken for them. Leftover temp files of a crashed
    # run go too. Anything else in out_dir is not ours and stays.
    kept = {os.path.basename(p) for p in files.values()}
    for entry in os.listdir(out_dir):
        ours = _OUTPUT_NAME_RE.match(entry) or entry.startswith(_TEMP_PREFIX)
        if ours and entry not in kept:
            _remove_quietly(os.path.join(out_dir, entry))
    return files
