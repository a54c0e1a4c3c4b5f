"""Turning prepared rows into what GRPOTrainer consumes: conversational prompts plus an image column.

``to_conversational`` maps one row; ``load_training_data`` does the whole job for examples/scripts/grpo_vlm.py:

1. ``open_dataset`` resolves ``DataArguments`` to a ``DatasetDict`` without reading rows: a folder of data files
   (the split of each file read from its name), one data file, a ``save_to_disk`` folder, ``--data_files`` or a Hub
   name. A source that does not exist or has no usable split fails with what was found there.
2. The image column (``image`` or ``images``) and the prompt column (``prompt``, else ``problem``) are found, or the
   error names the expected columns.
3. ``prepare_split`` makes one pass over each used split: relative image paths are resolved against the dataset
   root, images whose longer side exceeds ``max_image_side`` or that cannot be read are dropped and counted, non-RGB
   images are converted to RGB, and the prompt text becomes TRL's conversational form with the system prompt.
4. The eval set is the data's eval split or is carved out of train (``--eval_split_size``).
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import difflib
import glob
import io
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Think inside <think>...</think>, then give the final line 'Answer: X'."
)
"""The system prompt of the training script: asks for a <think> block and a final 'Answer: X' line, which is
what think_format_reward and mc_idx_reward check."""


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


# ------------------------------------------------------------------------------------------- data arguments

IMAGE_COLUMNS = ("image", "images")
"""Image columns TRL reads: ``image`` (one image per row) or ``images`` (a list per row)."""
PROMPT_COLUMNS = ("prompt", "problem")
"""Prompt text columns, in order of preference: ``prompt`` (A-OKVQA prep output) or ``problem`` (math VQA)."""
LABEL_COLUMNS = {"label_idx": "mc_idx (A-OKVQA prep output)", "solution": "accuracy (math VQA)"}
"""Label columns the registry rewards read, and which reward reads each."""
EVAL_SPLIT_CANDIDATES = ("validation", "val", "eval", "dev", "test")
"""Split names used for evaluation when --dataset_eval_split is not given, first present wins."""
DATA_FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}
"""File extensions read from a directory or --data_files, and the ``datasets`` builder of each."""
DEFAULT_MAX_IMAGE_SIDE = 1024

DROP_TOO_LARGE = "image larger than max_image_side"
DROP_NOT_FOUND = "image file not found"
DROP_UNREADABLE = "unreadable image"
_DROP = "_trl_mdi_drop"  # temporary column: why a row is dropped ("" to keep it)
_NO_IMAGE = "(no image)"  # kept, but counted


class DatasetError(ValueError):
    """A problem with the training data that the user must fix; the script prints it without a traceback."""


@dataclasses.dataclass
class DataArguments:
    """Where the training data comes from and how rows become GRPO prompts (flags of examples/scripts/grpo_vlm.py)."""

    _argument_group_name = "data"

    dataset_path: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Training data: a local directory of data files (parquet/jsonl/json/csv; the split of each file "
            "is read from its name: train, validation/val, test, sample_N, also under data/ or <split>/), a single "
            "data file, a folder written by save_to_disk, or a Hub dataset name."
        },
    )
    data_files: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": 'Data files per split: "train=a.parquet,validation=b.parquet", a JSON mapping '
            '\'{"train": ["a.parquet"], "validation": "b.parquet"}\', or one path or glob (the train split). '
            "Relative paths are resolved against --dataset_path when it is a directory; with --dataset_name they "
            "select files of that Hub dataset."
        },
    )
    dataset_name: str | None = dataclasses.field(
        default=None,
        metadata={"help": "Hub dataset name loaded with datasets.load_dataset (alternative to --dataset_path)."},
    )
    dataset_config: str | None = dataclasses.field(
        default=None, metadata={"help": "Configuration name of a Hub dataset (the `name` of load_dataset)."}
    )
    dataset_train_split: str = dataclasses.field(
        default="train", metadata={"help": "Split to train on, e.g. sample_200 for the prep script's sample."}
    )
    dataset_eval_split: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Split to evaluate on when eval_strategy is not 'no'. Default: the first present of "
            + ", ".join(EVAL_SPLIT_CANDIDATES)
            + "."
        },
    )
    eval_split_size: float = dataclasses.field(
        default=0.0,
        metadata={
            "help": "Carve the eval set out of the train split instead: a fraction in (0, 1) or a row count >= 1 "
            "(seeded by --seed). 0: use the data's eval split."
        },
    )
    image_column: str | None = dataclasses.field(
        default=None, metadata={"help": "Image column (default: 'image', else 'images' holding a list per row)."}
    )
    prompt_column: str | None = dataclasses.field(
        default=None, metadata={"help": "Prompt text column (default: 'prompt', else 'problem')."}
    )
    max_image_side: int = dataclasses.field(
        default=DEFAULT_MAX_IMAGE_SIDE,
        metadata={
            "help": "Drop rows with an image whose longer side exceeds this many pixels (0: keep all); the number "
            "dropped is reported. Resizing for the model is the processor's job (--max_pixels)."
        },
    )
    system_prompt: str | None = dataclasses.field(
        default=DEFAULT_SYSTEM_PROMPT,
        metadata={"help": "System prompt of every conversation; '' for none."},
    )


@dataclasses.dataclass
class SplitReport:
    """What happened to one split on its way to the trainer."""

    name: str
    rows_in: int
    rows_out: int
    dropped: dict[str, int]
    without_image: int = 0

    def describe(self) -> str:
        line = f"{self.name}: {self.rows_out} rows"
        if self.dropped:
            reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(self.dropped.items()))
            line += f" ({sum(self.dropped.values())} of {self.rows_in} dropped: {reasons})"
        if self.without_image:
            line += f"; {self.without_image} rows have no image (kept, they get no MDI)"
        return line


@dataclasses.dataclass
class TrainingData:
    """The datasets handed to the trainer and how they were obtained."""

    train: Any
    eval: Any | None
    source: str
    splits_found: str
    train_split: str
    eval_split: str | None
    prompt_column: str
    image_column: str
    reports: list[SplitReport]

    def describe(self) -> list[tuple[str, str]]:
        """(key, value) lines for the effective-configuration printout."""
        lines = [
            ("source", self.source),
            ("splits found", self.splits_found),
            ("train split", self.train_split),
            ("eval split", self.eval_split or "none"),
            ("columns", f"prompt text from '{self.prompt_column}', images from '{self.image_column}'"),
        ]
        lines += [("rows", r.describe()) for r in self.reports]
        return lines


# ------------------------------------------------------------------------------------------------- sources


def split_of_file(path: str) -> str | None:
    """The split a data file belongs to, from its name or its parent folder: train, validation, test or sample_N.

    >>> split_of_file("out/sample_200.parquet"), split_of_file("data/train-00000-of-00002.parquet")
    ('sample_200', 'train')
    >>> split_of_file("x/val.jsonl"), split_of_file("test/0000.parquet"), split_of_file("notes.parquet")
    ('validation', 'test', None)
    """
    from .aokvqa import split_of_filename

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

            try:
                return load_dataset(builder, data_files={"train": paths}, split="train")
            except Exception as e:  # datasets raises many kinds for a corrupt or mismatched file
                raise DatasetError(f"{what}: cannot load split {split!r} from {_short(paths)}: "
                                   f"{type(e).__name__}: {e}") from e

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


def _looks_like_hub_id(name: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name)) and not name.endswith(tuple(DATA_FILE_BUILDERS))


def _load_hub(name: str, config: str | None, data_files=None):
    from datasets import Dataset, DatasetDict, load_dataset

    try:
        loaded = load_dataset(name, name=config, data_files=data_files)
    except Exception as e:  # offline, unknown name, no access, ...: one message that says what was tried
        raise DatasetError(
            f"cannot load {name!r} from the Hugging Face Hub ({type(e).__name__}: {e}). For local data pass "
            "--dataset_path DIR (a folder of parquet files, e.g. the output of data_prep/prepare_aokvqa_for_trl.py)."
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


# ------------------------------------------------------------------------------------------------- columns


def _pick_column(columns: Sequence[str], explicit: str | None, candidates: Sequence[str], what: str, expected: str,
                 split: str, flag: str) -> str:
    if explicit:
        if explicit not in columns:
            raise DatasetError(f"split {split!r} has no column {explicit!r} ({flag}); its columns: {list(columns)}")
        return explicit
    for c in candidates:
        if c in columns:
            return c
    raise DatasetError(
        f"split {split!r} has no {what} column: expected {expected}, or name yours with {flag}. "
        f"Its columns: {list(columns)}"
    )


def image_column_of(columns: Sequence[str], explicit: str | None = None, split: str = "train") -> str:
    return _pick_column(columns, explicit, IMAGE_COLUMNS, "image",
                        "'image' (one image per row: a datasets Image, bytes or a file path) or 'images' (a list)",
                        split, "--image_column")


def prompt_column_of(columns: Sequence[str], explicit: str | None = None, split: str = "train") -> str:
    try:
        return _pick_column(columns, explicit, PROMPT_COLUMNS, "prompt",
                            "'prompt' (A-OKVQA prep output: question and lettered choices) or 'problem' (math VQA, "
                            "with 'solution')", split, "--prompt_column")
    except DatasetError as e:
        if {"question", "correct_choice_idx"} <= set(columns):
            raise DatasetError(f"{e}. This looks like raw A-OKVQA: convert it first with "
                               "data_prep/prepare_aokvqa_for_trl.py") from None
        raise


def check_label_columns(reward_funcs: Sequence[Callable], columns: Sequence[str], split: str = "train") -> None:
    """Raise DatasetError when a reward needs a dataset column (label) the split lacks, naming the label columns."""
    from .rewards import check_reward_columns

    try:
        check_reward_columns(reward_funcs, columns)
    except ValueError as e:
        labels = "; ".join(f"'{c}' for {r}" for c, r in LABEL_COLUMNS.items())
        raise DatasetError(
            f"split {split!r}: {e} Label columns: {labels}. For math data with 'solution' use "
            "--reward_funcs accuracy think_format mdi_balance --reward_weights 4 1 1."
        ) from None


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

    from .aokvqa import ImageDecodeError, to_rgb_image_bytes

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
    """Images resolved, checked and RGB, prompts conversational: ``(dataset, SplitReport)``."""
    from datasets import Image, List, Value

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
    return ds, SplitReport(name, rows_in, ds.num_rows, dropped, status.get(_NO_IMAGE, 0))


# ------------------------------------------------------------------------------------------------ together


def _eval_size(size: float, train_rows: int) -> int | float:
    if 0 < size < 1:
        return float(size)
    if size >= 1 and float(size).is_integer():
        if size >= train_rows:
            raise DatasetError(f"--eval_split_size {int(size)} leaves no training rows (train has {train_rows})")
        return int(size)
    raise DatasetError(f"--eval_split_size must be a fraction in (0, 1) or a whole row count >= 1, got {size}")


def load_training_data(args: DataArguments, *, need_eval: bool = False, seed: int = 42,
                       log: Callable[[str], None] = print) -> TrainingData:
    """Load, check and convert the training data (and the eval data when ``need_eval``).

    Raises DatasetError (a ValueError) naming what was found when the source does not exist, holds no usable split,
    lacks an image or prompt column, or loses every row to the image checks. ``need_eval`` is whether the trainer
    evaluates (eval_strategy != "no"): then the eval set comes from ``--eval_split_size`` (carved out of train) or
    the data's eval split, and its absence is an error.
    """
    if args.eval_split_size < 0:
        raise DatasetError(f"--eval_split_size must be >= 0, got {args.eval_split_size}")
    if not need_eval and (args.eval_split_size or args.dataset_eval_split):
        flag = "--eval_split_size" if args.eval_split_size else "--dataset_eval_split"
        raise DatasetError(f"{flag} is set but evaluation is off (eval_strategy 'no'): add --eval_strategy steps "
                           "--eval_steps N, or drop the flag")
    raw, source, roots = open_dataset(args, log)
    shown = raw.describe()
    train_name = args.dataset_train_split
    if train_name not in raw:
        raise DatasetError(f"no split {train_name!r} in {source}; splits found: {shown}. "
                           "Choose one with --dataset_train_split")
    eval_name = None
    if need_eval and not args.eval_split_size:
        if args.dataset_eval_split:
            if args.dataset_eval_split not in raw:
                raise DatasetError(f"no split {args.dataset_eval_split!r} (--dataset_eval_split) in {source}; "
                                   f"splits found: {shown}")
            eval_name = args.dataset_eval_split
        else:
            eval_name = next((c for c in EVAL_SPLIT_CANDIDATES if c in raw and c != train_name), None)
            if eval_name is None:
                raise DatasetError(
                    f"evaluation is on (eval_strategy is not 'no') but {source} has no eval split (splits found: "
                    f"{shown}): pass --eval_split_size 0.05 to carve one out of train, --dataset_eval_split NAME, "
                    "or --eval_strategy no"
                )
    used = [train_name] + ([eval_name] if eval_name else [])
    columns = {name: raw[name].column_names for name in used}
    image_col = image_column_of(columns[train_name], args.image_column, train_name)
    prompt_col = prompt_column_of(columns[train_name], args.prompt_column, train_name)
    for name in used[1:]:
        image_column_of(columns[name], image_col, name)
        prompt_column_of(columns[name], prompt_col, name)
    system_prompt = args.system_prompt or None
    prepared, reports = {}, []
    for name in used:
        prepared[name], report = prepare_split(raw[name], name, image_column=image_col, prompt_column=prompt_col,
                                               roots=roots, max_image_side=args.max_image_side,
                                               system_prompt=system_prompt)
        reports.append(report)
        if report.rows_out == 0:
            raise DatasetError(f"split {name!r} of {source}: no usable rows left. {report.describe()}")
    train, eval_ds = prepared[train_name], prepared.get(eval_name)
    eval_desc = f"{eval_name} ({eval_ds.num_rows} rows)" if eval_ds is not None else None
    if need_eval and args.eval_split_size:
        size = _eval_size(args.eval_split_size, train.num_rows)
        parts = train.train_test_split(test_size=size, seed=seed, shuffle=True)
        train, eval_ds = parts["train"], parts["test"]
        eval_desc = f"carved out of {train_name}: {eval_ds.num_rows} rows (--eval_split_size {args.eval_split_size:g})"
    return TrainingData(train=train, eval=eval_ds, source=source, splits_found=shown, train_split=train_name,
                        eval_split=eval_desc, prompt_column=prompt_col, image_column=image_col, reports=reports)
