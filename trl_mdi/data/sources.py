"""Opening the training data (step 1 of `trl_mdi.data`): ``DataArguments`` resolved to its splits without
reading a row, or an error that says what was found where the data was expected.
"""

from __future__ import annotations

import collections
import collections.abc
import difflib
import glob
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

from .arguments import DataArguments
from .columns import DatasetError

DATA_FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}
"""File extensions read from a directory or --data_files, and the ``datasets`` builder of each."""


def split_of_file(path: str) -> str | None:
    """The split a data file belongs to, from its name or its parent folder: train, validation, test or sample_N.

    >>> split_of_file("out/sample_200.parquet"), split_of_file("data/train-00000-of-00002.parquet")
    ('sample_200', 'train')
    >>> split_of_file("x/val.jsonl"), split_of_file("test/0000.parquet"), split_of_file("notes.parquet")
    ('validation', 'test', None)
    """
    from ..aokvqa import split_of_filename

    stem = os.path.basename(path)
    match = re.match(r"^(sample_\d+)(?:$|[-._])", stem)
    if match:
        return match.group(1)
    ext = os.path.splitext(stem)[1]
    return split_of_filename(path[: -len(ext)] + ".parquet" if ext and ext != ".parquet" else path)


def parse_data_files(spec: str) -> dict[str, list[str]]:
    """``--data_files`` as ``{split: [paths]}``.

    >>> parse_data_files("train=a.parquet,validation=b.parquet")
    {'train': ['a.parquet'], 'validation': ['b.parquet']}
    >>> parse_data_files('{"train": ["a.jsonl", "b.jsonl"], "test": "c.jsonl"}')
    {'train': ['a.jsonl', 'b.jsonl'], 'test': ['c.jsonl']}
    >>> parse_data_files("a.parquet,b.parquet")
    {'train': ['a.parquet', 'b.parquet']}
    """
    spec = spec.strip()
    if spec[:1] in "{[\"":
        try:
            value = json.loads(spec)
        except json.JSONDecodeError as e:
            raise DatasetError(f"--data_files looks like JSON but does not parse: {e}") from None
        if isinstance(value, (str, list)):
            value = {"train": value}
        if not isinstance(value, dict):
            raise DatasetError(f"--data_files JSON must be a mapping split -> path(s), got {type(value).__name__}")
        out = {}
        for split, paths in value.items():
            paths = [paths] if isinstance(paths, str) else paths
            if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths) or not paths:
                raise DatasetError(f"--data_files: split {split!r} must map to a path or a list of paths")
            out[str(split)] = list(paths)
        return out
    out: dict[str, list[str]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        split, sep, path = item.partition("=")
        if not sep:
            split, path = "train", item
        if not split.strip() or not path.strip():
            raise DatasetError(f"--data_files: cannot read {item!r}; expected split=path")
        out.setdefault(split.strip(), []).append(path.strip())
    if not out:
        raise DatasetError("--data_files is empty")
    return out


def _builder_of(paths: Sequence[str], what: str) -> str:
    builders = set()
    for p in paths:
        ext = os.path.splitext(p)[1].lower()
        if ext not in DATA_FILE_BUILDERS:
            raise DatasetError(
                f"{what}: cannot read {p!r}: unknown file type {ext or '(none)'}; "
                f"supported: {', '.join(DATA_FILE_BUILDERS)}"
            )
        builders.add(DATA_FILE_BUILDERS[ext])
    if len(builders) > 1:
        raise DatasetError(f"{what}: files of one split must share a format, got {sorted(builders)}: {list(paths)}")
    return builders.pop()


class Splits(collections.abc.Mapping):
    """split name -> Dataset, each loaded on first access, so unused splits of a large folder are never converted."""

    def __init__(self, loaders: dict[str, Callable[[], Any]], rows: dict[str, int | None]):
        self._loaders, self._rows, self._loaded = loaders, rows, {}

    @classmethod
    def of(cls, dataset_dict) -> Splits:
        return cls({k: (lambda d=d: d) for k, d in dataset_dict.items()}, {k: d.num_rows for k, d in dataset_dict.items()})

    def __getitem__(self, name: str):
        if name not in self._loaded:
            self._loaded[name] = self._loaders[name]()
        return self._loaded[name]

    def __iter__(self):
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)

    def describe(self) -> str:
        """'train (64 rows), validation (16 rows)'; row counts only where known without loading."""
        return ", ".join(k + (f" ({n} rows)" if n is not None else "") for k, n in self._rows.items()) or "none"

    @property
    def rows(self) -> dict[str, int | None]:
        return dict(self._rows)


def _load_files(by_split: dict[str, list[str]], what: str) -> Splits:
    """Local files per split; splits may differ in format. Parquet row counts come from the file metadata."""
    import pyarrow.parquet as pq

    def loader(split: str, paths: list[str], builder: str):
        def load():
            from datasets import load_dataset

            # An empty split fails inside datasets with Arrow's "BatchSize must be greater than 0" (parquet) or a
            # bare StopIteration (json): say "empty" first. Parquet knows its row count; other files, their size.
            if rows.get(split) == 0 or (rows.get(split) is None and all(_is_empty_file(p) for p in paths)):
                raise DatasetError(f"{what}: split {split!r} is empty: {_short(paths)} hold(s) no rows. Write rows "
                                   "into it, or choose another split (--dataset_train_split / --dataset_eval_split)")
            try:
                ds = load_dataset(builder, data_files={"train": paths}, split="train")
            except Exception as e:  # datasets raises many kinds for a corrupt or mismatched file
                raise DatasetError(f"{what}: cannot load split {split!r} from {_short(paths)}: "
                                   f"{type(e).__name__}: {e}") from e
            if ds.num_rows == 0:
                raise DatasetError(f"{what}: split {split!r} is empty: {_short(paths)} hold(s) no rows. Write rows "
                                   "into it, or choose another split (--dataset_train_split / --dataset_eval_split)")
            return ds

        return load

    loaders, rows = {}, {}
    for split, paths in by_split.items():
        builder = _builder_of(paths, what)
        loaders[split] = loader(split, list(paths), builder)
        try:
            rows[split] = sum(pq.ParquetFile(p).metadata.num_rows for p in paths) if builder == "parquet" else None
        except Exception as e:
            raise DatasetError(f"{what}: {_short(paths)}: not readable parquet: {type(e).__name__}: {e}") from e
    return Splits(loaders, rows)


def _is_empty_file(path: str) -> bool:
    """Whether a data file holds nothing but white space (read only when it is small)."""
    try:
        if os.path.getsize(path) > 4096:
            return False
        with open(path, "rb") as fh:
            return not fh.read().strip()
    except OSError:
        return False


def _short(items: Sequence[str], limit: int = 5) -> str:
    return str(list(items[:limit]))[:-1] + (f", ... ({len(items)} in all)]" if len(items) > limit else "]")


def _listing(directory: str, limit: int = 12) -> str:
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return "(unreadable)"
    if not entries:
        return "(empty)"
    shown = [e + ("/" if os.path.isdir(os.path.join(directory, e)) else "") for e in entries[:limit]]
    return ", ".join(shown) + (f", ... ({len(entries)} entries)" if len(entries) > limit else "")


def _data_files_under(directory: str) -> list[str]:
    files = []
    for ext in DATA_FILE_BUILDERS:
        files += glob.glob(os.path.join(directory, "**", f"*{ext}"), recursive=True)
    # Hidden folders (.cache/ of huggingface_hub downloads, .git/) hold partial copies or nothing useful.
    return sorted(f for f in files if not any(p.startswith(".") for p in os.path.relpath(f, directory).split(os.sep)))


def _open_directory(path: str, log: Callable[[str], None]):
    from datasets import Dataset, DatasetDict, load_from_disk

    if os.path.exists(os.path.join(path, "dataset_dict.json")) or os.path.exists(os.path.join(path, "state.json")):
        try:
            loaded = load_from_disk(path)
        except Exception as e:
            empty = _empty_saved_splits(path)
            if empty:  # datasets cannot load a split saved with no rows (an IndexError): say which is empty
                raise DatasetError(f"save_to_disk folder {path!r}: split(s) {', '.join(map(repr, empty))} are empty "
                                   "(saved with 0 rows). Save them with rows, or drop them from the folder") from e
            raise DatasetError(f"cannot load the save_to_disk folder {path!r}: {type(e).__name__}: {e}") from e
        if isinstance(loaded, Dataset):
            loaded = DatasetDict({"train": loaded})
        return Splits.of(loaded), f"save_to_disk folder {path}"
    files = _data_files_under(path)
    if not files:
        raise DatasetError(
            f"no usable split in {path!r}: no data files ({', '.join(DATA_FILE_BUILDERS)}) and no save_to_disk "
            f"dataset there. It holds: {_listing(path)}"
        )
    by_split: dict[str, list[str]] = collections.defaultdict(list)
    unknown = []
    for f in files:
        split = split_of_file(os.path.relpath(f, path))
        if split:
            by_split[split].append(f)
        elif not f.endswith(".json"):  # a .json of no split is metadata (dataset_info.json, a model's config.json)
            unknown.append(f)
    rel = [os.path.relpath(f, path) for f in unknown]
    hint = "name files train.parquet, validation.parquet, sample_200.parquet, data/train-00000-of-00001.parquet, ..."
    if not by_split:
        raise DatasetError(f"no usable split in {path!r}: cannot tell the split of {rel[:8]}; {hint}")
    if unknown:
        log(f"ignoring {len(unknown)} data file(s) of no known split under {path}: {rel[:5]} ({hint})")
    return _load_files(dict(by_split), f"dataset_path {path}"), f"directory {path}"


def _empty_saved_splits(path: str) -> list[str]:
    """Splits of a save_to_disk folder that were saved with no rows (their state.json lists no data file)."""
    states = {"train": os.path.join(path, "state.json")}
    try:
        with open(os.path.join(path, "dataset_dict.json"), encoding="utf-8") as fh:
            states = {name: os.path.join(path, name, "state.json") for name in json.load(fh).get("splits", [])}
    except (OSError, ValueError, AttributeError):
        pass  # a single Dataset folder: its own state.json
    empty = []
    for name, state in states.items():
        try:
            with open(state, encoding="utf-8") as fh:
                if not json.load(fh).get("_data_files"):
                    empty.append(name)
        except (OSError, ValueError, AttributeError):
            continue
    return empty


def _looks_like_hub_id(name: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name)) and not name.endswith(tuple(DATA_FILE_BUILDERS))


def _load_hub(name: str, config: str | None, data_files=None):
    from datasets import Dataset, DatasetDict, load_dataset

    try:
        loaded = load_dataset(name, name=config, data_files=data_files)
    except Exception as e:  # offline, unknown name, no access, ...: one message that says what was tried
        raise DatasetError(
            f"cannot load {name!r} from the Hugging Face Hub ({type(e).__name__}: {e}). For local data pass "
            "--dataset_path DIR (a folder of parquet files, e.g. the output of trl_mdi.aokvqa.prepare_aokvqa)."
        ) from e
    if isinstance(loaded, Dataset):
        loaded = DatasetDict({"train": loaded})
    return Splits.of(loaded)


def open_dataset(args: DataArguments, log: Callable[[str], None] = print):
    """Resolve the data arguments to ``(DatasetDict, description, image roots)`` without touching any row.

    Image roots are the folders a relative image path is looked up in, first match wins: the dataset root
    (``--dataset_path`` when it is a folder, else the data file's folder), then the folders of the data files.
    """
    path, name = args.dataset_path, args.dataset_name
    if path and name:
        raise DatasetError("give either --dataset_path or --dataset_name, not both")
    if args.data_files:
        spec = parse_data_files(args.data_files)
        if name:
            return _load_hub(name, args.dataset_config, spec), f"{name} (data_files {spec})", []
        base = os.getcwd()
        if path:
            if not os.path.isdir(path):
                raise DatasetError(f"with --data_files, --dataset_path must be the folder they are relative to; "
                                   f"{path!r} is not a directory")
            base = path
        resolved: dict[str, list[str]] = {}
        missing = []
        for split, patterns in spec.items():
            for pattern in patterns:
                full = pattern if os.path.isabs(pattern) else os.path.join(base, pattern)
                matches = sorted(glob.glob(full)) if glob.has_magic(full) else ([full] if os.path.isfile(full) else [])
                if not matches:
                    missing.append(full)
                resolved.setdefault(split, []).extend(matches)
        if missing:
            where = sorted({os.path.dirname(m) or "." for m in missing})
            raise DatasetError(f"--data_files: not found: {missing}. " +
                               "; ".join(f"{d} holds: {_listing(d)}" for d in where if os.path.isdir(d)))
        roots = [base, *dict.fromkeys(os.path.dirname(os.path.abspath(p)) for ps in resolved.values() for p in ps)]
        return _load_files(resolved, "--data_files"), f"data_files {spec}", roots
    if path:
        path = os.path.expanduser(path)
        if os.path.isdir(path):
            ds, desc = _open_directory(path, log)
            return ds, desc, [path]
        if os.path.isfile(path):
            split = split_of_file(path) or "train"
            return _load_files({split: [path]}, f"dataset_path {path}"), f"file {path}", [os.path.dirname(path) or "."]
        if not _looks_like_hub_id(path) or os.path.isabs(path) or path.startswith("."):
            parent = os.path.dirname(os.path.abspath(path))
            while not os.path.isdir(parent) and parent != os.path.dirname(parent):
                parent = os.path.dirname(parent)
            close = difflib.get_close_matches(os.path.basename(path.rstrip(os.sep)), os.listdir(parent), n=1)
            hint = f"; did you mean {os.path.join(parent, close[0])!r}?" if close else ""
            raise DatasetError(f"dataset path {path!r} does not exist ({parent} holds: {_listing(parent)}){hint}")
        return _load_hub(path, args.dataset_config), f"Hub dataset {path}", []
    if name:
        return _load_hub(name, args.dataset_config), f"Hub dataset {name}", []
    raise DatasetError("no training data given: pass --dataset_path (folder, file, save_to_disk folder or Hub name), "
                       "--data_files or --dataset_name")
