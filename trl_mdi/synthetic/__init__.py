"""A tiny synthetic A-OKVQA: drawn shapes whose questions can only be answered from the image (and, opt-in,
questions whose wording carries a language prior that the image sometimes contradicts).

The writer lays files out like a local copy of the Hub dataset ``HuggingFaceM4/A-OKVQA``::

    <out_dir>/README.md                                  dataset card: dataset_info + configs YAML
    <out_dir>/data/train-00000-of-00002.parquet          exact A-OKVQA columns and types
    <out_dir>/data/validation-00000-of-00001.parquet
    <out_dir>/data/test-00000-of-00001.parquet           labels null, like the real test split

so ``data_prep/prepare_aokvqa_for_trl.py`` (and ``datasets.load_dataset``) read it exactly as the real one.

Question kinds (``kinds``, an equal mix or ``{kind: weight}``; the default is the first three):

    color        one big shape on a neutral background: "What color is the triangle?"
    shape        one big shape: "Which shape is drawn in the image?"
    count        1..max_count small copies of one shape, at most one per grid cell: "How many ...?"
    prior_color  one big shape standing for an object with a canonical colour: "What color is the banana?";
                 drawn in that colour except on ``conflict_rate`` of the rows (see `prior`)

Why it is built this way:

1. The text never reveals the answer. With ``option_order="shuffled"`` the answer is drawn uniformly from
   the kind's vocabulary and the three distractors uniformly from the rest, so given the prompt every
   option is equally likely. With ``option_order="fixed"`` every question of a kind offers the same four
   options in the same order, so the prompt is constant per kind and only the image can decide.
2. Answer letters are exactly balanced over A-D when a split's size is divisible by 4 (and within one
   row per kind otherwise): a model cannot score above chance by preferring a letter.
3. It stays learnable for a ~1M-parameter model at 56x56 (4 image tokens in tiny VLM processors): colour
   and shape questions show one shape spanning 55-85% of the side; count questions place shapes on a
   grid whose cells (2x2 for max_count <= 4) line up with those tokens.
4. ``blank_images=True`` keeps every question, option and label and draws only the background: the
   control for "does the model look at the image". Random draws do not depend on the flag, so the two
   variants match row for row (same question ids).
5. Determinism: each split has its own ``random.Random`` seeded from (seed, split), images are PNG
   encoded without antialiasing, so a fixed seed gives byte-identical files, and changing n_train does
   not change the validation rows. Adding the prior kinds changed no row of the other kinds: their plan draws
   from the stream only when a prior kind is asked for.
6. The prior kinds break rule 1 on purpose: the object's name predicts the answer on every non-conflict row
   (tomato/red, grass/green, sky/blue, banana/yellow; options are those four colours) and the image
   decides only on conflict rows, where the answer is still the image's colour. Conflict rows are exactly
   ``round(conflict_rate * rows)`` of each prior kind, spread over the letters, so conflict and non-conflict rows
   are each letter-balanced (rule 2 holds on both subsets). The drawn shape is independent of the object, so the
   image carries no hint of the prior. Each in-memory row says ``conflict`` (bool) and ``prior_answer``; the
   parquet files keep the exact A-OKVQA schema and drop both (``trl_mdi.warmup.synthetic_dataset`` keeps them).

Layout: `rows` generates the rows in memory (`draw` draws their images, `prior` plans the language-prior kinds);
writing the files and the CLI are here.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import yaml

from trl_mdi.aokvqa import aokvqa_features, write_parquet_atomic

from .draw import draw_shape
from .prior import PRIOR_COLORS, PRIOR_KINDS, PRIOR_OBJECTS
from .rows import (
    BACKGROUNDS,
    COLORS,
    DEFAULT_KINDS,
    KINDS,
    NUM_CHOICES,
    NUMBER_WORDS,
    OPTION_ORDERS,
    PLURALS,
    SHAPES,
    SPLITS,
    generate_synthetic_rows,
)

__all__ = [
    "COLORS", "SHAPES", "PLURALS", "NUMBER_WORDS", "BACKGROUNDS", "KINDS", "DEFAULT_KINDS", "OPTION_ORDERS",
    "NUM_CHOICES", "SPLITS", "PRIOR_KINDS", "PRIOR_OBJECTS", "PRIOR_COLORS", "draw_shape", "generate_synthetic_rows",
    "rows_to_table", "write_synthetic_aokvqa", "main",
    "aokvqa_features", "write_parquet_atomic",
]  # fmt: skip

def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """An arrow table in the exact A-OKVQA schema (with the Hugging Face features metadata)."""
    return pa.Table.from_pylist(rows, schema=aokvqa_features().arrow_schema)


def _dataset_card(rows_per_split: dict[str, int], bytes_per_split: dict[str, int]) -> str:
    header = {
        "dataset_info": {
            "features": aokvqa_features()._to_yaml_list(),
            "splits": [
                {"name": s, "num_bytes": bytes_per_split[s], "num_examples": n}
                for s, n in rows_per_split.items()
            ],
            "dataset_size": sum(bytes_per_split.values()),
        },
        "configs": [
            {
                "config_name": "default",
                "data_files": [{"split": s, "path": f"data/{s}-*"} for s in rows_per_split],
            }
        ],
    }
    body = (
        "# Synthetic A-OKVQA\n\n"
        "Drawn shapes with colour / shape / count questions in the exact schema of "
        "HuggingFaceM4/A-OKVQA, written by `python -m trl_mdi.synthetic`. Test labels are null.\n"
    )
    return f"---\n{yaml.safe_dump(header, sort_keys=False)}---\n\n{body}"


_SHARD_RE = re.compile(r"^(train|validation|test)-\d{5}-of-\d{5}\.parquet$")


def write_synthetic_aokvqa(
    out_dir: str,
    *,
    n_train: int = 256,
    n_validation: int = 64,
    n_test: int = 64,
    image_size: int = 56,
    seed: int = 0,
    kinds: Sequence[str] | Mapping[str, float] = DEFAULT_KINDS,
    num_shards: int | Mapping[str, int] = 2,
    option_order: str = "shuffled",
    max_count: int = 4,
    blank_images: bool = False,
    overwrite: bool = False,
    conflict_rate: float = 0.2,
) -> dict[str, Any]:
    """Write a synthetic A-OKVQA laid out like a local copy of the Hub dataset.

    Files: ``<out_dir>/data/<split>-0000i-of-0000N.parquet`` per split (N = ``num_shards``, an int for all
    splits or a per-split mapping, capped at the split's row count; splits with 0 rows are not written)
    and ``<out_dir>/README.md``. Row content: see :func:`generate_synthetic_rows`. Refuses to replace an
    existing dataset in ``out_dir`` unless ``overwrite``.

    Returns:
        ``{"out_dir": ..., "readme": path, "files": {split: [paths]}, "rows": {split: count}}``.
    """
    data_dir = os.path.join(out_dir, "data")
    readme = os.path.join(out_dir, "README.md")
    existing = [f for f in (os.listdir(data_dir) if os.path.isdir(data_dir) else []) if _SHARD_RE.match(f)]
    if (existing or os.path.exists(readme)) and not overwrite:
        raise FileExistsError(f"{out_dir!r} already holds a dataset; pass overwrite=True (--overwrite)")
    os.makedirs(data_dir, exist_ok=True)
    sizes = {"train": n_train, "validation": n_validation, "test": n_test}
    files: dict[str, list[str]] = {}
    rows_written: dict[str, int] = {}
    bytes_written: dict[str, int] = {}
    for split, n in sizes.items():
        if n <= 0:
            continue
        table = rows_to_table(
            generate_synthetic_rows(
                n,
                split=split,
                image_size=image_size,
                seed=seed,
                kinds=kinds,
                option_order=option_order,
                max_count=max_count,
                blank_images=blank_images,
                conflict_rate=conflict_rate,
            )
        )
        shards = num_shards[split] if isinstance(num_shards, Mapping) else num_shards
        shards = max(1, min(int(shards), n))
        bounds = [round(i * n / shards) for i in range(shards + 1)]
        files[split] = []
        for i in range(shards):
            path = os.path.join(data_dir, f"{split}-{i:05d}-of-{shards:05d}.parquet")
            write_parquet_atomic(table.slice(bounds[i], bounds[i + 1] - bounds[i]), path, row_group_size=100)
            files[split].append(path)
        rows_written[split] = n
        bytes_written[split] = table.nbytes
    # Shards of an earlier, differently sharded run would be read as part of the new dataset.
    fresh = {os.path.basename(p) for paths in files.values() for p in paths}
    for name in existing:
        if name not in fresh:
            os.remove(os.path.join(data_dir, name))
    tmp = readme + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(_dataset_card(rows_written, bytes_written))
    os.replace(tmp, readme)
    return {"out_dir": out_dir, "readme": readme, "files": files, "rows": rows_written}


def _parse_kinds(items: Sequence[str]) -> dict[str, float]:
    weights: dict[str, float] = {}
    for item in items:
        for part in item.split(","):
            if part.strip():
                name, _, weight = part.partition("=")
                weights[name.strip()] = float(weight) if weight else 1.0
    return weights


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """CLI: ``python -m trl_mdi.synthetic --out DIR [--n_train 256 ...]``; prints what it wrote."""
    parser = argparse.ArgumentParser(prog="python -m trl_mdi.synthetic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory (a local 'Hub copy' of A-OKVQA)")
    parser.add_argument("--n_train", type=int, default=256)
    parser.add_argument("--n_validation", type=int, default=64)
    parser.add_argument("--n_test", type=int, default=64)
    parser.add_argument("--image_size", type=int, default=56)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kinds",
        nargs="+",
        default=list(DEFAULT_KINDS),
        help=f"question kinds from {KINDS}, optionally weighted: --kinds color=3 shape=1",
    )
    parser.add_argument("--num_shards", type=int, default=2, help="parquet files per split (capped at rows)")
    parser.add_argument("--option_order", choices=OPTION_ORDERS, default="shuffled")
    parser.add_argument("--max_count", type=int, default=4, help="largest answer of count questions (>= 4)")
    parser.add_argument("--blank_images", action="store_true", help="draw only the background (control)")
    parser.add_argument("--conflict_rate", type=float, default=0.2,
                        help="prior_color: share of rows whose image contradicts the object's usual colour")
    parser.add_argument("--overwrite", action="store_true", help="replace a dataset already in --out")
    args = parser.parse_args(argv)
    result = write_synthetic_aokvqa(
        args.out,
        n_train=args.n_train,
        n_validation=args.n_validation,
        n_test=args.n_test,
        image_size=args.image_size,
        seed=args.seed,
        kinds=_parse_kinds(args.kinds),
        num_shards=args.num_shards,
        option_order=args.option_order,
        max_count=args.max_count,
        blank_images=args.blank_images,
        overwrite=args.overwrite,
        conflict_rate=args.conflict_rate,
    )
    for split, paths in result["files"].items():
        print(f"{split}: {result['rows'][split]} rows in {len(paths)} file(s): {', '.join(paths)}")
    print(f"card: {result['readme']}")
    return result
