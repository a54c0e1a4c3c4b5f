"""``DataArguments``: the data flags of the entry point (TrlParser dataclass), and the eval-split fallbacks."""

from __future__ import annotations

import dataclasses

from .prepare import DEFAULT_MAX_IMAGE_SIDE, DEFAULT_SYSTEM_PROMPT

EVAL_SPLIT_CANDIDATES = ("validation", "val", "eval", "dev", "test")
"""Split names used for evaluation when --dataset_eval_split is not given, first present wins."""


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

    def __post_init__(self):
        # Typed and ranged like the training config's numbers (a YAML list or a negative side would otherwise fail
        # deep inside the image checks, or drop every row).
        from ..config import NumberRule, check_number

        self.max_image_side = check_number(NumberRule("max_image_side", int, 0, example="1024",
                                                      why="0 keeps every image"), self.max_image_side)
        self.eval_split_size = check_number(NumberRule("eval_split_size", float, 0, example="0.05",
                                                       why="a fraction in (0, 1), a row count, or 0: the data's eval "
                                                       "split"), self.eval_split_size)
