"""A-OKVQA -> training parquet: the library behind ``data_prep/prepare_aokvqa_for_trl.py``.

Input is A-OKVQA in its Hub schema (``HuggingFaceM4/A-OKVQA``): a Hub name (loaded with
``datasets.load_dataset``), a local copy of the Hub repository (``<dir>/data/train-00000-of-0000N.parquet``
...), a directory saved with ``save_to_disk``, or parquet files / a glob in the same schema. Output is one
parquet file per split under ``out_dir`` (``train.parquet``, ``validation.parquet`` and, with
``subset_size=N``, ``sample_N.parquet``) with the columns

    image        Image feature, bytes embedded, always decodes to an RGB PIL image
                 (``images``, a list of them, when the source holds an ``images`` list per row: TRL's
                 multi-image column; a row with a missing or unreadable image in its list is skipped whole)
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
   half-written parquet under a final name. The prep never writes into its source (``out_dir`` may not be the
   source folder, lie inside it, or hold a source file under an output's name), and it marks its outputs
   (``.trl_mdi_prep.json``): ``overwrite`` replaces those and refuses any other file of the same name.
4. Images that are already RGB keep their original bytes (no JPEG re-compression); other modes are
   converted (RGBA / LA / palette-with-transparency composited on white, 16-bit and other high-depth
   modes scaled to 8 bits: ``trl_mdi.data.pixels``) and re-encoded, as JPEG
   (quality 95) when the source was JPEG and lossless PNG otherwise.
5. Duplicate question ids inside a split keep their first row; the rest are skipped and counted, which also
   makes a directory holding two copies of the same split harmless.

Layout: `schema` (columns, skip reasons, errors), `convert` (one row and its image), `sources` (reading the
input), `output` (atomic files and the reports); ``prepare_aokvqa``, here, wires them together.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable, Iterable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from .convert import ImageDecodeError, convert_row, image_value_bytes, to_rgb_image_bytes
from .output import (
    OUTPUT_MARKER,
    PrepReport,
    SplitReport,
    commit,
    fsync,
    is_output_name,
    marked_outputs,
    remove_quietly,
    sample_name,
    temp_path,
    write_parquet_atomic,
    write_sample,
)
from .schema import (
    AOKVQA_SCHEMA,
    DEFAULT_SPLITS,
    HUB_DATASET,
    IMAGE_COLUMN,
    IMAGES_COLUMN,
    LETTERS,
    OUTPUT_COLUMNS,
    REQUIRED_COLUMNS,
    SKIP_BAD_CHOICES,
    SKIP_BAD_IMAGE,
    SKIP_BAD_LABEL,
    SKIP_BAD_QUESTION,
    SKIP_DUPLICATE_ID,
    SKIP_LABEL_RANGE,
    SKIP_MISSING_ID,
    SKIP_MISSING_IMAGE,
    SKIP_MISSING_LABEL,
    SKIP_NOT_IN_ID_FILE,
    SKIP_TOO_MANY_CHOICES,
    SPLITS,
    DataPrepError,
    EmptyResultError,
    MissingColumnsError,
    OutDirNotEmptyError,
    aokvqa_features,
    format_prompt,
    format_schema,
    image_column_of,
    output_columns,
    output_features,
    read_columns,
)
from .sources import SplitSource, check_columns, open_source, split_of_filename

__all__ = [
    # schema
    "HUB_DATASET", "SPLITS", "DEFAULT_SPLITS", "LETTERS", "AOKVQA_SCHEMA", "REQUIRED_COLUMNS", "OUTPUT_COLUMNS",
    "IMAGE_COLUMN", "IMAGES_COLUMN", "image_column_of", "read_columns", "output_columns",
    "SKIP_NOT_IN_ID_FILE", "SKIP_DUPLICATE_ID", "SKIP_MISSING_ID", "SKIP_MISSING_LABEL", "SKIP_BAD_LABEL",
    "SKIP_LABEL_RANGE", "SKIP_BAD_CHOICES", "SKIP_TOO_MANY_CHOICES", "SKIP_BAD_QUESTION", "SKIP_MISSING_IMAGE",
    "SKIP_BAD_IMAGE",
    "DataPrepError", "MissingColumnsError", "EmptyResultError", "OutDirNotEmptyError",
    "aokvqa_features", "output_features", "format_schema", "format_prompt",
    # convert
    "ImageDecodeError", "image_value_bytes", "to_rgb_image_bytes", "convert_row",
    # sources
    "SplitSource", "split_of_filename", "open_source", "check_columns",
    # output
    "write_parquet_atomic", "SplitReport", "PrepReport", "OUTPUT_MARKER", "marked_outputs",
    # here
    "read_question_ids", "prepare_aokvqa",
]  # fmt: skip

def read_question_ids(path: str) -> list[str]:
    """Question ids from a text file, one per line; blank lines and ``#`` comments are ignored. DataPrepError (one
    line) for a file that cannot be read or is not UTF-8 text (a parquet or an image given by mistake)."""
    try:
        with open(path, encoding="utf-8") as fh:
            ids = [line.split("#", 1)[0].strip() for line in fh]
    except UnicodeDecodeError as e:
        raise DataPrepError(f"question_id_file {path!r} is not a text file (byte {e.object[e.start:e.start + 1].hex()} "
                            f"at offset {e.start} is not UTF-8): give a text file of question ids, one per line") from None
    except OSError as e:
        raise DataPrepError(f"cannot read question_id_file {path!r}: {e.strerror or e}") from None
    ids = list(dict.fromkeys(i for i in ids if i))
    if not ids:
        raise DataPrepError(f"question_id_file {path!r} holds no ids")
    return ids


def _check_out_dir(out_dir: str, overwrite: bool, dataset_path: str, writes: Sequence[str] = ()) -> None:
    """Refuse, before anything is read or written, an ``out_dir`` that is a file, that is or lies inside the source,
    that holds a source file the outputs would replace, or that is not empty (without ``overwrite``); with
    ``overwrite``, one holding a file this run would replace (``writes``) that the prep's marker does not list as its
    own earlier output."""
    if os.path.isfile(out_dir):
        raise OutDirNotEmptyError(f"out_dir {out_dir!r} is a file")
    source = _source_problem(dataset_path, out_dir)
    if source:
        raise OutDirNotEmptyError(source)
    if not os.path.isdir(out_dir):
        return
    entries = sorted(os.listdir(out_dir))
    if entries and not overwrite:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise OutDirNotEmptyError(
            f"out_dir {out_dir!r} already contains {len(entries)} entries ({shown}); "
            "pass --overwrite (overwrite=True) to replace this script's outputs there"
        )
    foreign = sorted(set(writes) & set(entries) - marked_outputs(out_dir))
    if foreign:
        raise OutDirNotEmptyError(
            f"out_dir {out_dir!r} holds {', '.join(foreign)}, which this script did not write there (its marker "
            f"{OUTPUT_MARKER} does not list {'them' if len(foreign) > 1 else 'it'}): --overwrite replaces only the script's "
            "own earlier outputs. Move those files away (an output of this script from before it marked its outputs: "
            "delete it), or choose another --out_dir"
        )


def _source_problem(dataset_path: str, out_dir: str) -> str | None:
    """Why writing into ``out_dir`` would write into the source (None: it would not): ``out_dir`` is the source
    folder or lies inside it (the next read of the source would take the outputs for source splits), or a source file
    sits in ``out_dir`` under a name the prep writes."""
    out = os.path.realpath(out_dir)
    if os.path.isdir(dataset_path):
        src = os.path.realpath(dataset_path)
        if out == src or out.startswith(src.rstrip(os.sep) + os.sep):
            where = "is the source folder" if out == src else f"lies inside the source folder {dataset_path!r}"
            return (f"out_dir {out_dir!r} {where}: the prep never writes into its source. Choose an --out_dir "
                    "outside it, e.g. a sibling folder")
        return None
    files = [dataset_path] if os.path.isfile(dataset_path) else glob.glob(dataset_path, recursive=True) \
        if glob.has_magic(dataset_path) else []
    hit = [f for f in files if os.path.dirname(os.path.realpath(f)) == out and is_output_name(os.path.basename(f))]
    if hit:
        return (f"out_dir {out_dir!r} holds the source file(s) {', '.join(map(repr, hit))}, which the outputs would "
                "replace: the prep never writes into its source. Choose another --out_dir")
    return None


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
    image_column: str,
    tmp_path: str,
    wanted_ids: set[str] | None,
    found_ids: set[str],
    batch_size: int,
    log: Callable[[str], None],
) -> SplitReport:
    report = SplitReport(name=source.name)
    start = time.perf_counter()
    seen: set[str] = set()
    next_progress = 5000
    schema = output_features(image_column).arrow_schema
    with pq.ParquetWriter(tmp_path, schema) as writer:
        for rows, base_dir in source.batches(read_columns(image_column), batch_size):
            out_rows = []
            for row in rows:
                report.rows_in += 1
                out, reason = _check_and_convert(row, base_dir, image_column, wanted_ids, found_ids, seen)
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


def _check_and_convert(row, base_dir, image_column, wanted_ids, found_ids, seen):
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
    out, reason = convert_row(row, base_dir, image_column)
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
        out_dir: output directory; created if missing; must be empty unless ``overwrite``, and outside the source.
        splits: splits to convert (``"val"`` means ``"validation"``; comma-separated items are split).
        question_id_file: keep only the ids listed there (one per line); ids not found are reported.
        subset_size: also write ``sample_<N>.parquet``, N rows drawn from the converted train split.
        seed: seed of that draw (the same seed and input give byte-identical files).
        overwrite: allow a non-empty ``out_dir``; earlier outputs of this function there (those its marker
            lists) are replaced (and stale ones such as an old ``sample_<M>.parquet`` removed); other files are left
            alone, and one this run would replace that the marker does not list is an error.
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
    writes = [f"{name}.parquet" for name in split_names]
    writes += [f"{sample_name(subset_size)}.parquet"] if subset_size is not None else []
    _check_out_dir(out_dir, overwrite, dataset_path, writes)
    wanted = read_question_ids(question_id_file) if question_id_file else None

    sources = open_source(dataset_path, log)
    absent = [s for s in split_names if s not in sources]
    if absent:
        raise DataPrepError(f"split(s) {absent} not found in {dataset_path!r}; it has {sorted(sources)}")
    # Check every split's columns before converting any, so a bad file fails in seconds, not after train.
    image_columns = {}
    for name in split_names:
        image_columns[name] = check_columns(sources[name])
        several = " (several images per row: the output keeps the 'images' list)" if image_columns[name] != "image" else ""
        log(f"{name}: reading {sources[name].num_rows} rows from {sources[name].description}{several}")

    os.makedirs(out_dir, exist_ok=True)
    temps: dict[str, str] = {}
    found: set[str] = set()
    reports: dict[str, SplitReport] = {}
    try:
        for name in split_names:
            temps[name] = temp_path(os.path.join(out_dir, f"{name}.parquet"))
            reports[name] = _convert_split(sources[name], image_columns[name], temps[name], wanted, found, batch_size,
                                           log)
            if reports[name].rows_out == 0:
                remove_quietly(temps.pop(name))
        total = sum(r.rows_out for r in reports.values())
        if total == 0:
            raise EmptyResultError(
                "no usable rows: nothing written.\n" + "\n".join(r.describe() for r in reports.values())
            )
        if subset_size is not None:
            train_rows = reports["train"].rows_out
            if subset_size > train_rows:
                raise DataPrepError(f"subset_size {subset_size} exceeds the {train_rows} usable train rows")
            name = sample_name(subset_size)
            temps[name] = temp_path(os.path.join(out_dir, f"{name}.parquet"))
            write_sample(temps["train"], temps[name], subset_size, seed, batch_size)
        for path in temps.values():
            fsync(path)
        files = commit(out_dir, temps, source=dataset_path)
    except BaseException:
        for path in temps.values():
            remove_quietly(path)
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
