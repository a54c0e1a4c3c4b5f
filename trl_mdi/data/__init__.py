"""Turning prepared rows into what GRPOTrainer consumes: conversational prompts plus an image column.

``to_conversational`` maps one row; ``load_training_data`` does the whole job for examples/scripts/grpo_vlm.py:

1. ``open_dataset`` resolves ``DataArguments`` to a ``DatasetDict`` without reading rows: a folder of data files
   (the split of each file read from its name), one data file, a ``save_to_disk`` folder, ``--data_files`` or a Hub
   name. A source that does not exist or has no usable split fails with what was found there.
2. The image column (``image`` or ``images``) and the prompt column (``prompt``, else ``problem``) are found, or the
   error names the expected columns.
3. ``prepare_split`` makes one pass over each used split: a row with more choices than the choice letters A to Z,
   a label outside its choices, a duplicate choice or a choice marker inside a choice is an error naming its
   ``question_id`` (``check_choices``, before any image is read), an empty split is an error saying so, relative image paths are resolved against the
   dataset root, images whose longer side exceeds ``max_image_side``, that cannot be read, or that the run's
   processor would refuse (``trl_mdi.data.images.ProcessorImageCheck``) are dropped and counted, non-RGB images are
   converted to RGB (16-bit scaled to 8 bits: ``trl_mdi.data.pixels``), and the prompt text becomes TRL's
   conversational form with the system prompt. The result is cached, keyed also by the image files a row names by
   path (an image replaced on disk is read again), and no cache file is written into the source.
4. The eval set is the data's eval split or is carved out of train (``--eval_split_size``).

Layout: `sources` does step 1, `columns` step 2, `prepare` step 3 (and ``to_conversational``); ``DataArguments``
and ``load_training_data``, here, tie them together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .arguments import EVAL_SPLIT_CANDIDATES, DataArguments
from .columns import (
    CHOICES_COLUMN,
    IMAGE_COLUMNS,
    PROMPT_COLUMNS,
    DatasetError,
    check_choice_counts,
    check_choice_rows,
    check_choices,
    choice_row_problem,
    image_column_of,
    prompt_column_of,
)
from .prepare import (
    DEFAULT_MAX_IMAGE_SIDE,
    DEFAULT_SYSTEM_PROMPT,
    DROP_NOT_FOUND,
    DROP_REFUSED,
    DROP_TOO_LARGE,
    DROP_TOO_MANY_PIXELS,
    DROP_UNREADABLE,
    SplitReport,
    prepare_image,
    prepare_split,
    to_conversational,
)
from .sources import DATA_FILE_BUILDERS, Splits, open_dataset, parse_data_files, split_of_file

__all__ = [
    # columns
    "IMAGE_COLUMNS", "PROMPT_COLUMNS", "CHOICES_COLUMN", "DatasetError", "image_column_of", "prompt_column_of",
    "check_choice_counts", "check_choice_rows", "check_choices", "choice_row_problem",
    # sources
    "DATA_FILE_BUILDERS", "split_of_file", "parse_data_files", "Splits", "open_dataset",
    # prepare
    "DEFAULT_SYSTEM_PROMPT", "DEFAULT_MAX_IMAGE_SIDE", "DROP_TOO_LARGE", "DROP_TOO_MANY_PIXELS", "DROP_NOT_FOUND", "DROP_UNREADABLE",
    "DROP_REFUSED",
    "to_conversational", "SplitReport", "prepare_image", "prepare_split",
    # here
    "EVAL_SPLIT_CANDIDATES", "DataArguments", "TrainingData", "load_training_data",
]  # fmt: skip

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


def _eval_size(size: float, train_rows: int) -> int | float:
    if 0 < size < 1:
        return float(size)
    if size >= 1 and float(size).is_integer():
        if size >= train_rows:
            raise DatasetError(f"--eval_split_size {int(size)} leaves no training rows (train has {train_rows})")
        return int(size)
    raise DatasetError(f"--eval_split_size must be a fraction in (0, 1) or a whole row count >= 1, got {size}")


def load_training_data(args: DataArguments, *, need_eval: bool = False, seed: int = 42,
                       log: Callable[[str], None] = print, image_check=None,
                       on_bad_image: str = "skip") -> TrainingData:
    """Load, check and convert the training data (and the eval data when ``need_eval``).

    Raises DatasetError (a ValueError) naming what was found when the source does not exist, holds no usable split,
    lacks an image or prompt column, has a row with more than 26 choices (the letters A to Z), or loses every row to
    the image checks. ``need_eval`` is whether the trainer evaluates (eval_strategy != "no"): then the eval set comes
    from ``--eval_split_size`` (carved out of train) or the data's eval split, and its absence is an error.
    ``image_check`` (``trl_mdi.data.images.ProcessorImageCheck`` of the run's processor): rows with an image the
    processor would refuse are dropped and counted (``on_bad_image="skip"``), or are an error naming them (``"error"``).
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
        if raw[name].num_rows == 0:  # a save_to_disk or Hub split (data files are refused on loading, in sources)
            raise DatasetError(f"split {name!r} of {source} is empty (0 rows). Choose another split "
                               "(--dataset_train_split / --dataset_eval_split); splits found: " + shown)
        prepared[name], report = prepare_split(raw[name], name, image_column=image_col, prompt_column=prompt_col,
                                               roots=roots, max_image_side=args.max_image_side,
                                               system_prompt=system_prompt, image_check=image_check)
        reports.append(report)
        if on_bad_image == "error" and report.refused:
            n = report.dropped[DROP_REFUSED]
            raise DatasetError(f"split {name!r} of {source}: {n} image(s) the processor refuses: "
                               + "; ".join(report.refused) + (", ..." if n > len(report.refused) else "")
                               + ". on_bad_image is 'error': fix or drop these rows, or set on_bad_image 'skip' to "
                               "drop them at load (counted)")
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
