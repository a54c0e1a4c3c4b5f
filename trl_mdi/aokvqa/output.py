"""What the prep leaves behind: parquet files that appear whole or not at all (design choice 3 of
`trl_mdi.aokvqa`), and the report of what happened to each split.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import re
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq

from .schema import SKIP_MISSING_LABEL, SKIP_NOT_IN_ID_FILE

_OUTPUT_NAME_RE = re.compile(r"^(train|validation|test|sample_\d+)\.parquet$")
_TEMP_PREFIX = ".prep-"
OUTPUT_MARKER = ".trl_mdi_prep.json"
"""The file the prep leaves in ``out_dir`` listing the outputs it wrote there: ``--overwrite`` replaces or removes
those and no other file (a ``train.parquet`` it did not write is refused, never replaced)."""


# ---------------------------------------------------------------------------------------------- files


def write_parquet_atomic(table: pa.Table, path: str, **write_kwargs) -> str:
    """Write ``table`` to ``path`` through a temporary file in the same directory and ``os.replace``.

    Readers therefore see either the old file or the complete new one, never a truncated parquet.
    """
    tmp = temp_path(path)
    try:
        pq.write_table(table, tmp, **write_kwargs)
        fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise
    return path


def temp_path(final_path: str) -> str:
    directory, name = os.path.split(os.path.abspath(final_path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f"{_TEMP_PREFIX}{name}.", suffix=".tmp")
    os.close(fd)
    # mkstemp creates files 0600; outputs should get the usual permissions, as open() would give them.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    return tmp


def fsync(path: str) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def write_sample(train_path: str, out_path: str, n: int, seed: int, batch_size: int) -> None:
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


def is_output_name(name: str) -> bool:
    """Whether ``name`` is a file name the prep writes (``train.parquet``, ``sample_200.parquet``, ...)."""
    return bool(_OUTPUT_NAME_RE.match(name))


def marked_outputs(out_dir: str) -> set[str]:
    """The outputs the prep's marker in ``out_dir`` lists (its earlier outputs there); empty without a marker."""
    try:
        with open(os.path.join(out_dir, OUTPUT_MARKER), encoding="utf-8") as fh:
            files = json.load(fh).get("files", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {f for f in files if isinstance(f, str) and is_output_name(f)}


def _write_marker(out_dir: str, names: set[str], source: str) -> None:
    path = os.path.join(out_dir, OUTPUT_MARKER)
    tmp = temp_path(path)
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"written_by": "trl_mdi.aokvqa.prepare_aokvqa", "source": str(source), "files": sorted(names)}, fh,
                  indent=1)
    os.replace(tmp, path)


def commit(out_dir: str, temps: dict[str, str], source: str = "") -> dict[str, str]:
    """Move the finished outputs into place and mark them as the prep's own (``OUTPUT_MARKER``); remove the prep's earlier
    outputs there that this run did not produce. Nothing the marker does not list is replaced or removed."""
    earlier = marked_outputs(out_dir)
    names = {f"{name}.parquet" for name in temps}
    # Listed before they appear: a crash part-way leaves every output of ours marked as ours.
    _write_marker(out_dir, earlier | names, source)
    files = {}
    for name, tmp in temps.items():
        final = os.path.join(out_dir, f"{name}.parquet")
        os.replace(tmp, final)
        files[name] = final
    # Earlier outputs this run did not produce (e.g. sample_100 after --subset_size 50) would otherwise sit next to
    # fresh files and be mistaken for them; leftover temp files of a crashed run go too. Anything else stays.
    for entry in os.listdir(out_dir):
        if (entry in earlier and entry not in names) or entry.startswith(_TEMP_PREFIX):
            remove_quietly(os.path.join(out_dir, entry))
    _write_marker(out_dir, names, source)
    return files


# -------------------------------------------------------------------------------------------- reports


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
                f"{sample_name(self.sample_rows)}: {self.sample_rows} rows sampled from train -> "
                f"{self.files[sample_name(self.sample_rows)]}"
            )
        if self.ids_requested is not None:
            lines.append(_describe_missing_ids(self.ids_requested, self.ids_not_found, list(self.splits)))
        return "\n".join(lines)


def _describe_missing_ids(requested: int, not_found: list[str], splits: list[str]) -> str:
    if not not_found:
        return f"question_id_file: all {requested} ids found"
    shown = ", ".join(not_found[:5]) + (", ..." if len(not_found) > 5 else "")
    return f"question_id_file: {len(not_found)} of {requested} ids not found in splits {splits}: {shown}"


def sample_name(n: int) -> str:
    return f"sample_{n}"
