"""A tiny synthetic A-OKVQA: drawn shapes whose questions can only be answered from the image.

The writer lays files out like a local copy of the Hub dataset ``HuggingFaceM4/A-OKVQA``::

    <out_dir>/README.md                                  dataset card: dataset_info + configs YAML
    <out_dir>/data/train-00000-of-00002.parquet          exact A-OKVQA columns and types
    <out_dir>/data/validation-00000-of-00001.parquet
    <out_dir>/data/test-00000-of-00001.parquet           labels null, like the real test split

so ``data_prep/prepare_aokvqa_for_trl.py`` (and ``datasets.load_dataset``) read it exactly as the real one.

Question kinds (``kinds``, an equal mix or ``{kind: weight}``):

    color  one big shape on a neutral background: "What color is the triangle?"
    shape  one big shape: "Which shape is drawn in the image?"
    count  1..max_count small copies of one shape, at most one per grid cell: "How many ...?"

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
   not change the validation rows.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import math
import os
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import yaml
from PIL import Image, ImageDraw

from trl_mdi.aokvqa import aokvqa_features, write_parquet_atomic

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 60),
    "blue": (40, 80, 230),
    "yellow": (245, 215, 20),
    "purple": (140, 50, 180),
    "orange": (250, 130, 15),
}
SHAPES = ("circle", "square", "triangle", "diamond", "star", "cross")
PLURALS = {
    "circle": "circles",
    "square": "squares",
    "triangle": "triangles",
    "diamond": "diamonds",
    "star": "stars",
    "cross": "crosses",
}
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
# Neutral greys: no shape colour can be confused with the background.
BACKGROUNDS = ((255, 255, 255), (205, 205, 205), (75, 75, 75))
KINDS = ("color", "shape", "count")
DEFAULT_KINDS = KINDS
OPTION_ORDERS = ("shuffled", "fixed")
NUM_CHOICES = 4  # A-OKVQA always offers four
SPLITS = ("train", "validation", "test")

_QUESTION_TEMPLATES = {
    "color": (
        "What color is the {shape}?",
        "What is the color of the {shape} in the image?",
        "Which color is the {shape} painted?",
    ),
    "shape": (
        "Which shape is drawn in the image?",
        "What shape is the {color} object?",
        "What kind of shape can you see?",
    ),
    "count": (
        "How many {plural} are in the image?",
        "How many {color} {plural} can you count?",
        "What is the number of {plural} shown?",
    ),
}
_ID_ALPHABET = "23456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"  # A-OKVQA-like 22-char ids


def _vocabulary(kind: str, max_count: int) -> list[str]:
    if kind == "color":
        return list(COLORS)
    if kind == "shape":
        return list(SHAPES)
    return [str(i) for i in range(1, max_count + 1)]


def _resolve_kinds(kinds: Sequence[str] | Mapping[str, float]) -> dict[str, float]:
    weights = dict(kinds) if isinstance(kinds, Mapping) else {k: 1.0 for k in kinds}
    unknown = [k for k in weights if k not in KINDS]
    if unknown or not weights:
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {list(weights)}")
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"kind weights must be >= 0 with a positive sum, got {weights}")
    return weights


def _kind_plan(n: int, weights: dict[str, float], rng: random.Random) -> list[str]:
    """Exact shares by largest remainder (so 'color=1,shape=1' on 10 rows is 5/5), then shuffled."""
    total = sum(weights.values())
    quotas = {k: n * w / total for k, w in weights.items()}
    counts = {k: int(q) for k, q in quotas.items()}
    by_remainder = sorted(weights, key=lambda k: (-(quotas[k] - counts[k]), list(weights).index(k)))
    for k in by_remainder[: n - sum(counts.values())]:
        counts[k] += 1
    plan = [k for k in weights for _ in range(counts[k])]
    rng.shuffle(plan)
    return plan


def _letter_plan(plan: list[str], rng: random.Random) -> list[int]:
    """Answer positions: one global A,B,C,D cycle dealt kind by kind, shuffled inside each kind."""
    letters = [0] * len(plan)
    counter = 0
    for kind in dict.fromkeys(plan):
        rows = [i for i, k in enumerate(plan) if k == kind]
        dealt = [(counter + j) % NUM_CHOICES for j in range(len(rows))]
        counter += len(rows)
        rng.shuffle(dealt)
        for i, letter in zip(rows, dealt):
            letters[i] = letter
    return letters


def _question_id(seed: int, split: str, index: int) -> str:
    digest = int.from_bytes(
        hashlib.sha256(f"synthetic-aokvqa/{seed}/{split}/{index}".encode()).digest(), "big"
    )
    chars = []
    for _ in range(22):
        digest, r = divmod(digest, len(_ID_ALPHABET))
        chars.append(_ID_ALPHABET[r])
    return "".join(chars)


def _shape_polygon(shape: str, box: tuple[int, int, int, int]) -> list[tuple[float, float]] | None:
    x0, y0, x1, y1 = box
    cx, cy, w, h = (x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0
    if shape == "triangle":
        return [(cx, y0), (x1, y1), (x0, y1)]
    if shape == "diamond":
        return [(cx, y0), (x1, cy), (cx, y1), (x0, cy)]
    if shape == "star":
        points = []
        for i in range(10):
            # Inner radius half the outer one: a fat star keeps enough pixels to show its colour at 56 px.
            radius = (w / 2, h / 2) if i % 2 == 0 else (w / 4, h / 4)
            angle = -math.pi / 2 + i * math.pi / 5
            points.append((cx + radius[0] * math.cos(angle), cy + radius[1] * math.sin(angle)))
        return points
    if shape == "cross":
        a, b = w / 3, h / 3
        return [
            (x0 + a, y0),
            (x0 + 2 * a, y0),
            (x0 + 2 * a, y0 + b),
            (x1, y0 + b),
            (x1, y0 + 2 * b),
            (x0 + 2 * a, y0 + 2 * b),
            (x0 + 2 * a, y1),
            (x0 + a, y1),
            (x0 + a, y0 + 2 * b),
            (x0, y0 + 2 * b),
            (x0, y0 + b),
            (x0 + a, y0 + b),
        ]
    return None


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill) -> None:
    """Draw one filled ``shape`` (one of SHAPES) inside ``box`` = (x0, y0, x1, y1)."""
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon(_shape_polygon(shape, box), fill=fill)


def _big_box(rng: random.Random, size: int) -> tuple[int, int, int, int]:
    side = rng.randint(int(0.55 * size), int(0.85 * size))
    x0, y0 = rng.randint(0, size - side), rng.randint(0, size - side)
    return (x0, y0, x0 + side - 1, y0 + side - 1)


def _grid_boxes(rng: random.Random, size: int, count: int, max_count: int) -> list[tuple[int, int, int, int]]:
    grid = max(2, math.ceil(math.sqrt(max_count)))
    cell = size / grid
    boxes = []
    # A margin inside each cell keeps neighbours apart: two touching squares would read as one rectangle.
    pad = max(1, round(0.08 * cell))
    for c in sorted(rng.sample(range(grid * grid), count)):
        side = max(3, rng.randint(int(0.5 * cell), int(0.75 * cell)))
        cx0, cy0 = int((c % grid) * cell) + pad, int((c // grid) * cell) + pad
        slack = max(0, int(cell) - 2 * pad - side)
        x0, y0 = cx0 + rng.randint(0, slack), cy0 + rng.randint(0, slack)
        boxes.append((x0, y0, x0 + side - 1, y0 + side - 1))
    return boxes


def _choices(rng: random.Random, answer: str, vocab: list[str], letter: int, option_order: str) -> list[str]:
    if option_order == "fixed":
        return vocab[:NUM_CHOICES]
    choices = rng.sample([v for v in vocab if v != answer], NUM_CHOICES - 1)
    choices.insert(letter, answer)
    return choices


def _make_row(rng, kind, letter, *, image_size, max_count, option_order, blank):
    vocab = _vocabulary(kind, max_count)
    # In "fixed" order the options are the first four values and the answer is the one at `letter`;
    # in "shuffled" order the answer is uniform over the vocabulary and placed at `letter`.
    answer = vocab[letter] if option_order == "fixed" else rng.choice(vocab)
    background = rng.choice(BACKGROUNDS)
    if kind == "color":
        shape, color = rng.choice(SHAPES), answer
        boxes = [_big_box(rng, image_size)]
    elif kind == "shape":
        shape, color = answer, rng.choice(list(COLORS))
        boxes = [_big_box(rng, image_size)]
    else:
        shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
        boxes = _grid_boxes(rng, image_size, int(answer), max_count)
    question = rng.choice(_QUESTION_TEMPLATES[kind]).format(shape=shape, color=color, plural=PLURALS[shape])
    choices = _choices(rng, answer, vocab, letter, option_order)
    if kind == "count":
        word = NUMBER_WORDS[int(answer)] if int(answer) < len(NUMBER_WORDS) else answer
        direct = [answer] * 7 + [word] * 3
        rng.shuffle(direct)
        noun = shape if answer == "1" else PLURALS[shape]
        rationales = [
            f"There {'is' if answer == '1' else 'are'} {answer} {noun} in the picture.",
            f"Counting the {color} {PLURALS[shape]} gives {word}.",
            f"The image shows {word} {noun}.",
        ]
    elif kind == "color":
        direct = [answer] * 10
        rationales = [
            f"The {shape} in the image is {answer}.",
            f"The only shape drawn is colored {answer}.",
            f"Its fill color is {answer}.",
        ]
    else:
        direct = [answer] * 10
        rationales = [
            f"The object in the picture is a {answer}.",
            f"The {color} shape has the outline of a {answer}.",
            f"A single {color} {answer} is drawn.",
        ]

    image = Image.new("RGB", (image_size, image_size), background)
    if not blank:
        draw = ImageDraw.Draw(image)
        for box in boxes:
            draw_shape(draw, shape, box, COLORS[color])
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return {
        "image": {"bytes": buf.getvalue(), "path": None},
        "question": question,
        "choices": choices,
        "correct_choice_idx": choices.index(answer),
        "direct_answers": direct,
        "difficult_direct_answer": kind == "count",
        "rationales": rationales,
    }


def generate_synthetic_rows(
    n: int,
    *,
    split: str = "train",
    image_size: int = 56,
    seed: int = 0,
    kinds: Sequence[str] | Mapping[str, float] = DEFAULT_KINDS,
    option_order: str = "shuffled",
    max_count: int = 4,
    blank_images: bool = False,
    labelled: bool | None = None,
) -> list[dict[str, Any]]:
    """Generate ``n`` A-OKVQA rows in memory (image as ``{"bytes": png, "path": None}``).

    Args:
        n: number of rows.
        split: split name; seeds the split's own random stream and the question ids.
        image_size: side of the square images in pixels (>= 16).
        seed: base seed; the same arguments give identical rows.
        kinds: question kinds, equal mix (``("color", "count")``) or weighted (``{"color": 3, "shape": 1}``).
        option_order: ``"shuffled"`` (four options drawn from the kind's vocabulary, answer at a balanced
            letter) or ``"fixed"`` (each kind always offers its first four values in order).
        max_count: largest answer of count questions (>= 4, so four distinct options exist).
        blank_images: draw only the background (same questions, options and labels).
        labelled: keep labels; default False for ``split == "test"`` (correct_choice_idx,
            direct_answers and rationales are then None, as in the real test split).
    """
    if option_order not in OPTION_ORDERS:
        raise ValueError(f"option_order must be one of {OPTION_ORDERS}, got {option_order!r}")
    if image_size < 16:
        raise ValueError(f"image_size must be >= 16, got {image_size}")
    if max_count < NUM_CHOICES:
        raise ValueError(f"max_count must be >= {NUM_CHOICES} so that count questions have four options")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    weights = _resolve_kinds(kinds)
    labelled = split != "test" if labelled is None else labelled
    rng = random.Random(f"synthetic-aokvqa/{seed}/{split}")
    plan = _kind_plan(n, weights, rng)
    letters = _letter_plan(plan, rng)
    rows = []
    for i, (kind, letter) in enumerate(zip(plan, letters)):
        row = _make_row(
            rng,
            kind,
            letter,
            image_size=image_size,
            max_count=max_count,
            option_order=option_order,
            blank=blank_images,
        )
        if not labelled:
            row.update(correct_choice_idx=None, direct_answers=None, rationales=None)
        rows.append({"question_id": _question_id(seed, split, i), **row})
    return rows


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
    )
    for split, paths in result["files"].items():
        print(f"{split}: {result['rows'][split]} rows in {len(paths)} file(s): {', '.join(paths)}")
    print(f"card: {result['readme']}")
    return result


if __name__ == "__main__":
    main()
