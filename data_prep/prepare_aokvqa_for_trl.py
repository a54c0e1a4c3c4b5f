"""Prepare A-OKVQA for GRPO training: parquet files with image, prompt, label_idx, choices, question_id.
A source holding several images per row as an ``images`` list (TRL's multi-image column) keeps the list.

The logic lives in ``trl_mdi.aokvqa.prepare_aokvqa``; this script only parses arguments.

Examples (from the repository root, with the package installed)::

    # Online: the Hub dataset
    python data_prep/prepare_aokvqa_for_trl.py --dataset_path HuggingFaceM4/A-OKVQA --out_dir data/aokvqa

    # Offline: a local copy (here a synthetic one), a 64-row training sample, seed 0
    python -m fixtures.synthetic --out /tmp/aokvqa_synth
    python data_prep/prepare_aokvqa_for_trl.py --dataset_path /tmp/aokvqa_synth \\
        --out_dir /tmp/aokvqa_prepared --subset_size 64 --seed 0

    # Only the questions listed in ids.txt (one per line), replacing an earlier output
    python data_prep/prepare_aokvqa_for_trl.py --dataset_path /tmp/aokvqa_synth \\
        --out_dir /tmp/aokvqa_prepared --question_id_file ids.txt --overwrite

Exit status: 0 on success, 2 on a problem with the input or the output directory (message on stderr).
"""

from __future__ import annotations

import argparse
import sys

from trl_mdi.aokvqa import DEFAULT_SPLITS, HUB_DATASET, DataPrepError, prepare_aokvqa


def build_parser() -> argparse.ArgumentParser:
    """The script's argument parser."""
    parser = argparse.ArgumentParser(
        description="Convert A-OKVQA (Hub name, local directory or parquet files) into training parquet.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--dataset_path",
        default=HUB_DATASET,
        help="Hub dataset name, local directory (e.g. a Hub snapshot), parquet file or glob",
    )
    parser.add_argument("--out_dir", required=True, help="output directory for <split>.parquet files")
    parser.add_argument(
        "--question_id_file",
        default=None,
        help="text file of question ids to keep, one per line; unknown ids are reported",
    )
    parser.add_argument(
        "--subset_size",
        type=int,
        default=None,
        help="also write sample_N.parquet: N rows sampled from the converted train split",
    )
    parser.add_argument("--seed", type=int, default=42, help="seed of the --subset_size sample")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="allow a non-empty --out_dir and replace this script's earlier outputs there",
    )
    parser.add_argument(
        "--splits",
        nargs="+",
        default=list(DEFAULT_SPLITS),
        help="splits to convert (space or comma separated; 'test' has no labels in A-OKVQA)",
    )
    parser.add_argument("--batch_size", type=int, default=256, help="rows per read batch / row group")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the conversion; return the process exit status."""
    args = build_parser().parse_args(argv)
    try:
        prepare_aokvqa(
            args.dataset_path,
            args.out_dir,
            splits=args.splits,
            question_id_file=args.question_id_file,
            subset_size=args.subset_size,
            seed=args.seed,
            overwrite=args.overwrite,
            batch_size=args.batch_size,
        )
    except DataPrepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
