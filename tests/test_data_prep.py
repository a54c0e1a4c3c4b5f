"""Synthetic A-OKVQA writer and the A-OKVQA -> training parquet prep (fixtures.synthetic, trl_mdi.aokvqa).

Everything runs offline on data made here: the synthetic writer for the happy path, parquet files
hand-crafted with pyarrow for each kind of bad input.
"""

from __future__ import annotations

import collections
import doctest
import glob
import hashlib
import importlib
import io
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

# Before datasets is imported: no test may reach the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from fixtures import synthetic  # noqa: E402
from fixtures.synthetic import generate_synthetic_rows, write_synthetic_aokvqa  # noqa: E402
from trl_mdi import aokvqa  # noqa: E402
from trl_mdi.aokvqa import (  # noqa: E402
    DataPrepError,
    EmptyResultError,
    MissingColumnsError,
    OutDirNotEmptyError,
    prepare_aokvqa,
)

datasets.disable_progress_bars()
REPO_ROOT = Path(__file__).resolve().parents[1]
OUTPUT_COLUMNS = ["image", "prompt", "label_idx", "choices", "question_id"]
AOKVQA_COLUMNS = [
    "question_id",
    "image",
    "question",
    "choices",
    "correct_choice_idx",
    "direct_answers",
    "difficult_direct_answer",
    "rationales",
]


# ------------------------------------------------------------------------------------------- helpers


def quiet(_msg: str) -> None:
    """A log sink for prepare_aokvqa calls whose output the test does not read."""


def load_parquet(path, cache_dir):
    """Load one prepared file the way the training script does."""
    return datasets.load_dataset("parquet", data_files={"train": str(path)}, cache_dir=str(cache_dir))[
        "train"
    ]


def file_digests(directory) -> dict[str, str]:
    """sha256 of every file under directory, keyed by relative path."""
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "**", "*"), recursive=True)):
        if os.path.isfile(path):
            out[os.path.relpath(path, directory)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return out


def png_bytes(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


RAW_SCHEMA = pa.schema(
    [
        ("question_id", pa.string()),
        ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        ("question", pa.string()),
        ("choices", pa.list_(pa.string())),
        ("correct_choice_idx", pa.int64()),
        ("direct_answers", pa.list_(pa.string())),
        ("difficult_direct_answer", pa.bool_()),
        ("rationales", pa.list_(pa.string())),
    ]
)


def raw_row(qid, image=None, label=0, choices=("red", "green", "blue", "yellow"), question="What color?"):
    """One hand-made A-OKVQA row; image defaults to a valid 8x8 RGB PNG."""
    if image is None:
        image = png_bytes(Image.new("RGB", (8, 8), (200, 10, 10)))
    return {
        "question_id": qid,
        "image": None if image is False else {"bytes": image, "path": None},
        "question": question,
        "choices": list(choices) if choices is not None else None,
        "correct_choice_idx": label,
        "direct_answers": ["red"] * 10,
        "difficult_direct_answer": False,
        "rationales": ["a", "b", "c"],
    }


def write_raw_split(src_dir, split, rows, schema=RAW_SCHEMA):
    """Write rows as <src_dir>/data/<split>-00000-of-00001.parquet with a plain pyarrow schema."""
    data = Path(src_dir) / "data"
    data.mkdir(parents=True, exist_ok=True)
    path = data / f"{split}-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    """A small synthetic A-OKVQA copy shared by the round-trip tests (read-only)."""
    out = tmp_path_factory.mktemp("synth")
    write_synthetic_aokvqa(str(out), n_train=48, n_validation=16, n_test=12, num_shards=2, seed=0)
    return out


# ----------------------------------------------------------------------------------- synthetic writer


def test_synthetic_layout_schema_and_decoding(synth_dir, tmp_path):
    files = sorted(os.path.relpath(p, synth_dir) for p in glob.glob(f"{synth_dir}/data/*.parquet"))
    assert files == [
        "data/test-00000-of-00002.parquet",
        "data/test-00001-of-00002.parquet",
        "data/train-00000-of-00002.parquet",
        "data/train-00001-of-00002.parquet",
        "data/validation-00000-of-00002.parquet",
        "data/validation-00001-of-00002.parquet",
    ]
    expected = aokvqa.aokvqa_features()
    for path in files:
        schema = pq.read_schema(synth_dir / path)
        assert schema.names == AOKVQA_COLUMNS
        # The HF features metadata (what makes datasets decode the image column) and the arrow types.
        assert b"huggingface" in schema.metadata
        assert datasets.Features.from_arrow_schema(schema) == expected
        assert schema.field("correct_choice_idx").type == pa.int64()
        assert schema.field("image").type == pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    # The README's configs make the directory loadable as a dataset, like a Hub snapshot.
    dd = datasets.load_dataset(str(synth_dir), cache_dir=str(tmp_path / "cache"))
    assert {k: v.num_rows for k, v in dd.items()} == {"train": 48, "validation": 16, "test": 12}
    assert dd["train"].features == expected
    row = dd["train"][0]
    assert (
        isinstance(row["image"], Image.Image) and row["image"].mode == "RGB" and row["image"].size == (56, 56)
    )
    assert len(row["choices"]) == 4 and len(row["direct_answers"]) == 10 and len(row["rationales"]) == 3
    assert isinstance(row["correct_choice_idx"], int) and isinstance(row["difficult_direct_answer"], bool)
    assert set(dd["test"]["correct_choice_idx"]) == {None}
    assert len(set(dd["train"]["question_id"]) | set(dd["test"]["question_id"])) == 60  # unique ids


@pytest.mark.parametrize("option_order", ["shuffled", "fixed"])
def test_synthetic_answers_balanced_and_text_uninformative(option_order):
    rows = generate_synthetic_rows(48, seed=3, option_order=option_order)
    assert collections.Counter(r["correct_choice_idx"] for r in rows) == {0: 12, 1: 12, 2: 12, 3: 12}
    # Not divisible by 4: still within one of balanced.
    odd = collections.Counter(r["correct_choice_idx"] for r in generate_synthetic_rows(10, seed=3))
    assert max(odd.values()) - min(odd.values()) <= 1
    for row in rows:
        assert (
            len(set(row["choices"])) == 4
            and row["choices"][row["correct_choice_idx"]] in row["direct_answers"]
        )
    if option_order == "fixed":
        # Every question of a kind offers the same options in the same order: only the image can decide.
        options_by_kind = collections.defaultdict(set)
        for row in rows:
            kind = (
                "color"
                if row["choices"][0] == "red"
                else "shape"
                if row["choices"][0] == "circle"
                else "count"
            )
            options_by_kind[kind].add(tuple(row["choices"]))
        assert all(len(v) == 1 for v in options_by_kind.values()) and len(options_by_kind) == 3


def test_synthetic_text_alone_predicts_at_chance():
    """A text-only model (how often each option value at each letter was right) must not beat chance."""
    fit = generate_synthetic_rows(800, split="train", seed=2)
    held_out = generate_synthetic_rows(400, split="validation", seed=2)
    right, seen = collections.Counter(), collections.Counter()
    for row in fit:
        for pos, value in enumerate(row["choices"]):
            seen[value, pos] += 1
            right[value, pos] += pos == row["correct_choice_idx"]
    hits = 0
    for row in held_out:
        scores = [right[v, p] / max(1, seen[v, p]) for p, v in enumerate(row["choices"])]
        hits += scores.index(max(scores)) == row["correct_choice_idx"]
    assert hits / len(held_out) < 0.33  # chance is 0.25; a leak (e.g. "red" always at A) scores ~1


def test_synthetic_kind_mix_is_configurable():
    rows = generate_synthetic_rows(12, kinds={"color": 3, "count": 1})
    counts = collections.Counter(
        "count" if r["question"].startswith(("How many", "What is the number")) else "color" for r in rows
    )
    assert counts == {"color": 9, "count": 3}
    with pytest.raises(ValueError, match="kinds"):
        generate_synthetic_rows(4, kinds=("colour",))


def _non_background_pixels(img: Image.Image) -> dict[tuple[int, int], tuple[int, int, int]]:
    # Backgrounds are neutral greys and no shape colour is grey, so the most common grey is the background.
    background = next(
        c for c, _ in collections.Counter(img.getdata()).most_common() if c in synthetic.BACKGROUNDS
    )
    w, h = img.size
    return {
        (x, y): img.getpixel((x, y)) for x in range(w) for y in range(h) if img.getpixel((x, y)) != background
    }


def test_synthetic_images_carry_the_answer_and_blank_control_removes_it():
    rows = generate_synthetic_rows(24, seed=1, kinds=("color", "count"))
    blank = generate_synthetic_rows(24, seed=1, kinds=("color", "count"), blank_images=True)
    checked = collections.Counter()
    for row, ctrl in zip(rows, blank):
        img = Image.open(io.BytesIO(row["image"]["bytes"])).convert("RGB")
        answer = row["choices"][row["correct_choice_idx"]]
        shape_pixels = _non_background_pixels(img)
        if answer in synthetic.COLORS:
            assert set(shape_pixels.values()) == {synthetic.COLORS[answer]}
            assert (
                len(shape_pixels) > 0.08 * 56 * 56
            )  # one big shape (a thin star at the smallest size: ~10%)
            checked["color"] += 1
        else:
            occupied = {(x // 28, y // 28) for x, y in shape_pixels}  # 2x2 grid, one shape per cell
            assert len(occupied) == int(answer)
            checked["count"] += 1
        # The control keeps everything but the drawing.
        assert {k: v for k, v in ctrl.items() if k != "image"} == {
            k: v for k, v in row.items() if k != "image"
        }
        ctrl_img = Image.open(io.BytesIO(ctrl["image"]["bytes"]))
        assert len(set(ctrl_img.getdata())) == 1
    assert checked == {"color": 12, "count": 12}


def test_synthetic_is_byte_identical_for_a_fixed_seed(tmp_path):
    kwargs = dict(n_train=8, n_validation=4, n_test=4, num_shards=2)
    a = write_synthetic_aokvqa(str(tmp_path / "a"), seed=7, **kwargs)
    write_synthetic_aokvqa(str(tmp_path / "b"), seed=7, **kwargs)
    write_synthetic_aokvqa(str(tmp_path / "c"), seed=8, **kwargs)
    assert a["rows"] == {"train": 8, "validation": 4, "test": 4}
    assert file_digests(tmp_path / "a") == file_digests(tmp_path / "b")
    assert (
        file_digests(tmp_path / "a")["data/train-00000-of-00002.parquet"]
        != file_digests(tmp_path / "c")["data/train-00000-of-00002.parquet"]
    )
    # Each split has its own stream: more train rows leave validation unchanged.
    more = generate_synthetic_rows(4, split="validation", seed=7)
    assert more == generate_synthetic_rows(4, split="validation", seed=7)
    with pytest.raises(FileExistsError):
        write_synthetic_aokvqa(str(tmp_path / "a"), seed=7, **kwargs)


# ------------------------------------------------------------------------------------ prep round trip


def test_prep_round_trip_library(synth_dir, tmp_path):
    logs = []
    out = tmp_path / "out"
    report = prepare_aokvqa(
        str(synth_dir), str(out), splits=["train", "val", "test"], subset_size=12, seed=0, log=logs.append
    )
    assert sorted(os.listdir(out)) == [aokvqa.OUTPUT_MARKER, "sample_12.parquet", "train.parquet", "validation.parquet"]
    assert report.rows == {"train": 48, "validation": 16, "sample_12": 12}
    text = "\n".join(logs)
    assert "split 'test' has no labels (correct_choice_idx is null in all 12 rows): skipped" in text
    assert "train: 48 of 48 rows written" in text

    source = {
        r["question_id"]: r
        for r in datasets.load_dataset(
            str(synth_dir), split="train", cache_dir=str(tmp_path / "c0")
        ).remove_columns("image")
    }
    train = load_parquet(out / "train.parquet", tmp_path / "c1")
    assert train.column_names == OUTPUT_COLUMNS
    assert train.features == aokvqa.output_features()
    assert collections.Counter(train["label_idx"]) == {0: 12, 1: 12, 2: 12, 3: 12}
    for row in train:
        src = source[row["question_id"]]
        assert row["prompt"] == "\n".join(
            [src["question"]] + [f"{letter}. {c}" for letter, c in zip("ABCD", src["choices"])]
        )
        assert row["choices"] == src["choices"] and row["label_idx"] == src["correct_choice_idx"]
        assert isinstance(row["image"], Image.Image) and row["image"].mode == "RGB"
    sample = load_parquet(out / "sample_12.parquet", tmp_path / "c2")
    assert sample.num_rows == 12 and set(sample["question_id"]) <= set(train["question_id"])
    assert sample.features == aokvqa.output_features()  # images decode in the sample too
    assert isinstance(sample[0]["image"], Image.Image)
    # The sample keeps train order (a sorted draw), so it is a sub-sequence of train.parquet.
    train_ids = list(train["question_id"])
    positions = [train_ids.index(q) for q in sample["question_id"]]
    assert positions == sorted(positions)


def test_prep_cli_subprocess_matches_library_and_is_deterministic(synth_dir, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cli_out = tmp_path / "cli"
    proc = subprocess.run(
        [
            sys.executable,
            "data_prep/prepare_aokvqa_for_trl.py",
            "--dataset_path",
            str(synth_dir),
            "--out_dir",
            str(cli_out),
            "--subset_size",
            "10",
            "--seed",
            "5",
            "--splits",
            "train,validation",
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "train: 48 of 48 rows written" in proc.stdout and "sample_10: 10 rows sampled" in proc.stdout
    lib_out = tmp_path / "lib"
    prepare_aokvqa(str(synth_dir), str(lib_out), subset_size=10, seed=5, log=quiet)
    assert file_digests(cli_out) == file_digests(lib_out)  # same bytes from either entry point
    other = tmp_path / "other_seed"
    prepare_aokvqa(str(synth_dir), str(other), subset_size=10, seed=6, log=quiet)
    assert file_digests(other)["train.parquet"] == file_digests(lib_out)["train.parquet"]
    assert file_digests(other)["sample_10.parquet"] != file_digests(lib_out)["sample_10.parquet"]


def test_prep_reads_datasets_objects_without_decoding_images(tmp_path, monkeypatch):
    """The Hub code path (datasets.load_dataset) with a stand-in loader; a corrupt image must not crash it."""
    rows = [raw_row(f"q{i}", label=i % 4) for i in range(4)] + [raw_row("bad", image=b"not an image")]
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(rows, features=aokvqa.aokvqa_features()),
            "validation": datasets.Dataset.from_list(rows[:2], features=aokvqa.aokvqa_features()),
        }
    )
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda name, *a, **k: calls.append(name) or dd)
    report = prepare_aokvqa("HuggingFaceM4/A-OKVQA", str(tmp_path / "out"), log=quiet)
    assert calls == ["HuggingFaceM4/A-OKVQA"]
    assert report.rows == {"train": 4, "validation": 2}
    assert report.splits["train"].skipped == {aokvqa.SKIP_BAD_IMAGE: 1}

    def offline(name, *a, **k):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataPrepError, match="could not load 'HuggingFaceM4/A-OKVQA'.*--dataset_path DIR"):
        prepare_aokvqa("HuggingFaceM4/A-OKVQA", str(tmp_path / "out2"), log=quiet)
    # save_to_disk directories go through the same datasets path.
    dd.save_to_disk(str(tmp_path / "saved"))
    assert prepare_aokvqa(str(tmp_path / "saved"), str(tmp_path / "out3"), log=quiet).rows["train"] == 4


# ---------------------------------------------------------------------------------------- bad input


def test_missing_columns_error_names_them_and_the_schema(tmp_path):
    schema = pa.schema([f for f in RAW_SCHEMA if f.name not in ("image", "correct_choice_idx")])
    rows = [{k: v for k, v in raw_row("q0").items() if k in schema.names}]
    write_raw_split(tmp_path / "src", "train", rows, schema)
    write_raw_split(tmp_path / "src", "validation", [raw_row("v0")])
    with pytest.raises(MissingColumnsError) as info:
        prepare_aokvqa(str(tmp_path / "src"), str(tmp_path / "out"), log=quiet)
    message = str(info.value)
    assert "['image', 'correct_choice_idx']" in message and "split 'train'" in message
    assert "question_id: string" in message and "rationales: list of 3 strings" in message
    assert not (tmp_path / "out").exists()  # checked before anything is created


def test_corrupt_and_missing_images_are_skipped_and_reported(tmp_path):
    good = png_bytes(Image.new("RGB", (16, 16), (0, 0, 255)))
    rows = [
        raw_row("ok0", label=0),
        raw_row("ok1", label=1),
        raw_row("garbage", image=b"\x00\x01definitely not an image"),
        raw_row("truncated", image=good[: len(good) // 2]),
        raw_row("noimage", image=False),
        {**raw_row("badpath"), "image": {"bytes": None, "path": "does/not/exist.png"}},
        raw_row("ok2", label=2),
    ]
    write_raw_split(tmp_path / "src", "train", rows)
    logs = []
    report = prepare_aokvqa(str(tmp_path / "src"), str(tmp_path / "out"), splits=["train"], log=logs.append)
    split = report.splits["train"]
    assert split.rows_in == 7 and split.rows_out == 3
    assert split.skipped == {aokvqa.SKIP_BAD_IMAGE: 3, aokvqa.SKIP_MISSING_IMAGE: 1}
    assert set(split.examples[aokvqa.SKIP_BAD_IMAGE]) == {"garbage", "truncated", "badpath"}
    assert "skipped 4: 3 undecodable image" in "\n".join(logs)
    assert pq.read_table(tmp_path / "out" / "train.parquet")["question_id"].to_pylist() == [
        "ok0",
        "ok1",
        "ok2",
    ]


def test_missing_and_out_of_range_labels_are_skipped(tmp_path):
    rows = [
        raw_row("ok", label=3),
        raw_row("none", label=None),
        raw_row("big", label=4),
        raw_row("neg", label=-1),
        raw_row("short", label=2, choices=("a", "b")),
        raw_row("emptychoice", label=0, choices=("a", "", "c", "d")),
        raw_row("noquestion", question="  "),
    ]
    write_raw_split(tmp_path / "src", "train", rows)
    report = prepare_aokvqa(str(tmp_path / "src"), str(tmp_path / "out"), splits=["train"], log=quiet)
    assert report.splits["train"].skipped == {
        aokvqa.SKIP_MISSING_LABEL: 1,
        aokvqa.SKIP_LABEL_RANGE: 3,
        aokvqa.SKIP_BAD_CHOICES: 1,
        aokvqa.SKIP_BAD_QUESTION: 1,
    }
    assert report.rows == {"train": 1}


def test_float_labels_from_pandas_are_accepted(tmp_path):
    """Parquet written by pandas stores a nullable int column as double with NaN for null."""
    schema = RAW_SCHEMA.set(
        RAW_SCHEMA.get_field_index("correct_choice_idx"), pa.field("correct_choice_idx", pa.float64())
    )
    rows = [raw_row("a", label=1.0), raw_row("b", label=float("nan")), raw_row("c", label=1.5)]
    write_raw_split(tmp_path / "src", "train", rows, schema)
    report = prepare_aokvqa(str(tmp_path / "src"), str(tmp_path / "out"), splits=["train"], log=quiet)
    assert report.splits["train"].skipped == {aokvqa.SKIP_MISSING_LABEL: 1, aokvqa.SKIP_BAD_LABEL: 1}
    assert pq.read_table(tmp_path / "out" / "train.parquet")["label_idx"].to_pylist() == [1]


def test_unlabelled_test_split_alone_is_an_empty_result(tmp_path, synth_dir):
    logs = []
    with pytest.raises(EmptyResultError, match=r"no usable rows") as info:
        prepare_aokvqa(str(synth_dir), str(tmp_path / "out"), splits=["test"], log=logs.append)
    assert "split 'test' has no labels (correct_choice_idx is null in all 12 rows)" in str(info.value)
    assert os.listdir(tmp_path / "out") == []  # no file, no leftover temp


def test_empty_result_is_an_error_and_writes_nothing(tmp_path):
    write_raw_split(tmp_path / "src", "train", [raw_row("a", image=b"junk"), raw_row("b", label=9)])
    with pytest.raises(EmptyResultError) as info:
        prepare_aokvqa(str(tmp_path / "src"), str(tmp_path / "out"), splits=["train"], log=quiet)
    assert "1 undecodable image" in str(info.value) and "1 label out of range" in str(info.value)
    assert os.listdir(tmp_path / "out") == []


def test_out_dir_with_content_is_refused_unless_overwrite(tmp_path, synth_dir):
    out = tmp_path / "out"
    prepare_aokvqa(str(synth_dir), str(out), subset_size=40, log=quiet)  # an earlier output, with its sample_40
    (out / "notes.txt").write_text("mine")
    (out / "sample_99.parquet").write_bytes(b"a file of the user's that looks like an output")
    with pytest.raises(OutDirNotEmptyError, match="--overwrite"):
        prepare_aokvqa(str(synth_dir), str(out), log=quiet)
    prepare_aokvqa(str(synth_dir), str(out), overwrite=True, subset_size=4, log=quiet)
    # Our stale output (sample_40) is gone, the user's files stay (issue 42: even one named like an output, which the
    # prep's marker does not list), the new outputs are in place and marked as the prep's own.
    assert sorted(os.listdir(out)) == [aokvqa.OUTPUT_MARKER, "notes.txt", "sample_4.parquet", "sample_99.parquet",
                                       "train.parquet", "validation.parquet"]
    assert aokvqa.marked_outputs(str(out)) == {"sample_4.parquet", "train.parquet", "validation.parquet"}
    # An empty existing directory is fine without --overwrite.
    (tmp_path / "empty").mkdir()
    assert prepare_aokvqa(str(synth_dir), str(tmp_path / "empty"), log=quiet).rows["train"] == 48


def test_grayscale_rgba_palette_cmyk_images_become_rgb(tmp_path):
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 255))
    rgba.putpixel((0, 0), (0, 0, 0, 0))  # fully transparent black -> white after compositing
    pal_t = Image.new("P", (4, 4), 1)
    pal_t.putpalette([0, 0, 0, 0, 200, 0] + [0] * 762)
    pal_t.info["transparency"] = 0
    pal_t.putpixel((0, 0), 0)
    rgb_jpeg = png_bytes(Image.new("RGB", (8, 8), (10, 120, 200)), "JPEG")
    images = {
        "gray": png_bytes(Image.new("L", (4, 4), 77)),
        "gray_jpeg": png_bytes(Image.new("L", (8, 8), 77), "JPEG"),
        "rgba": png_bytes(rgba),
        "la": png_bytes(Image.new("LA", (4, 4), (50, 0))),
        "palette": png_bytes(Image.new("P", (4, 4), 0)),
        "palette_t": png_bytes(pal_t),
        "cmyk": png_bytes(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG"),
        "bw": png_bytes(Image.new("1", (4, 4), 1)),
        "rgb_jpeg": rgb_jpeg,
    }
    write_raw_split(tmp_path / "src", "train", [raw_row(k, image=v) for k, v in images.items()])
    prepare_aokvqa(str(tmp_path / "src"), str(tmp_path / "out"), splits=["train"], log=quiet)
    ds = load_parquet(tmp_path / "out" / "train.parquet", tmp_path / "cache")
    got = {r["question_id"]: r["image"] for r in ds}
    assert set(got) == set(images)
    assert all(img.mode == "RGB" for img in got.values())
    assert got["gray"].getpixel((1, 1)) == (77, 77, 77)
    assert got["rgba"].getpixel((0, 0)) == (255, 255, 255) and got["rgba"].getpixel((1, 1)) == (255, 0, 0)
    assert got["la"].getpixel((0, 0)) == (255, 255, 255)  # alpha 0 everywhere: all white
    assert got["palette_t"].getpixel((0, 0)) == (255, 255, 255) and got["palette_t"].getpixel((1, 1)) == (
        0,
        200,
        0,
    )
    assert got["gray_jpeg"].format == "JPEG" and got["rgba"].format == "PNG"
    r, g, b = got["cmyk"].getpixel((4, 4))
    assert r > 200 and g < 60 and b < 60  # CMYK (0, 255, 255, 0) is red
    # Already-RGB images keep their exact bytes: no JPEG re-compression.
    stored = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert next(r["image"]["bytes"] for r in stored if r["question_id"] == "rgb_jpeg") == rgb_jpeg


def test_question_id_file_filters_and_reports_unknown_ids(tmp_path):
    write_raw_split(tmp_path / "src", "train", [raw_row(f"t{i}", label=i % 4) for i in range(6)])
    write_raw_split(tmp_path / "src", "validation", [raw_row(f"v{i}") for i in range(3)])
    ids = tmp_path / "ids.txt"
    ids.write_text("t1\nt4\n\n# a comment\nv2  # trailing comment\nzz1\nzz2\nzz3\nzz4\nzz5\nzz6\nt1\n")
    logs = []
    report = prepare_aokvqa(
        str(tmp_path / "src"), str(tmp_path / "out"), question_id_file=str(ids), log=logs.append
    )
    assert report.rows == {"train": 2, "validation": 1}
    assert pq.read_table(tmp_path / "out" / "train.parquet")["question_id"].to_pylist() == ["t1", "t4"]
    assert report.ids_requested == 9 and report.ids_not_found == [f"zz{i}" for i in range(1, 7)]
    assert (
        "question_id_file: 6 of 9 ids not found in splits ['train', 'validation']: zz1, zz2, zz3, zz4, zz5, ..."
        in "\n".join(logs)
    )
    ids.write_text("nothing_matches\n")
    with pytest.raises(EmptyResultError):
        prepare_aokvqa(str(tmp_path / "src"), str(tmp_path / "out2"), question_id_file=str(ids), log=quiet)


def test_duplicate_ids_missing_split_and_bad_subset(tmp_path):
    write_raw_split(tmp_path / "src", "train", [raw_row("a"), raw_row("a", label=1), raw_row("b")])
    report = prepare_aokvqa(str(tmp_path / "src"), str(tmp_path / "out"), splits=["train"], log=quiet)
    assert report.splits["train"].skipped == {aokvqa.SKIP_DUPLICATE_ID: 1}
    assert pq.read_table(tmp_path / "out" / "train.parquet")["label_idx"].to_pylist() == [
        0,
        0,
    ]  # first "a" kept
    with pytest.raises(DataPrepError, match=r"split\(s\) \['validation'\] not found.*\['train'\]"):
        prepare_aokvqa(str(tmp_path / "src"), str(tmp_path / "o2"), log=quiet)
    with pytest.raises(DataPrepError, match="subset_size 5 exceeds the 2 usable train rows"):
        prepare_aokvqa(
            str(tmp_path / "src"), str(tmp_path / "o3"), splits=["train"], subset_size=5, log=quiet
        )
    assert os.listdir(tmp_path / "o3") == []


def test_a_crash_midway_leaves_previous_outputs_intact(tmp_path, synth_dir, monkeypatch):
    out = tmp_path / "out"
    prepare_aokvqa(str(synth_dir), str(out), log=quiet)
    before = file_digests(out)
    calls = {"n": 0}
    real_convert = aokvqa.convert_row

    def crash_on_validation(row, base_dir=None, image_column="image"):
        calls["n"] += 1
        if calls["n"] > 50:  # train (48 rows) converted, then the crash lands in validation
            raise RuntimeError("simulated crash")
        return real_convert(row, base_dir, image_column)

    monkeypatch.setattr(aokvqa, "convert_row", crash_on_validation)
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare_aokvqa(str(synth_dir), str(out), overwrite=True, subset_size=4, log=quiet)
    assert file_digests(out) == before  # old files untouched, no temp files left, no sample written


def test_write_parquet_atomic_never_leaves_a_partial_file(tmp_path, monkeypatch):
    path = tmp_path / "t.parquet"
    aokvqa.write_parquet_atomic(pa.table({"x": [1, 2]}), str(path))
    original = path.read_bytes()
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # what open() would give, not mkstemp's 0600

    def failing_write(table, where, **kwargs):
        Path(where).write_bytes(b"PAR1 half")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", failing_write)
    with pytest.raises(OSError, match="disk full"):
        aokvqa.write_parquet_atomic(pa.table({"x": [3]}), str(path))
    assert path.read_bytes() == original and os.listdir(tmp_path) == ["t.parquet"]


def _with_submodules(package) -> list:
    """The package and its submodules: the doctests sit next to the code, in the submodules."""
    names = [m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_")]
    return [package, *(importlib.import_module(f"{package.__name__}.{name}") for name in names)]


def test_doctests():
    for module in _with_submodules(aokvqa) + _with_submodules(synthetic):
        result = doctest.testmod(module)
        assert result.failed == 0
    assert sum(doctest.testmod(module).attempted for module in _with_submodules(aokvqa)) >= 3


def test_parquet_file_glob_and_flat_layouts_are_accepted(tmp_path):
    src = tmp_path / "flat"
    src.mkdir()
    pq.write_table(
        pa.Table.from_pylist([raw_row("t0"), raw_row("t1")], schema=RAW_SCHEMA), src / "train.parquet"
    )
    pq.write_table(pa.Table.from_pylist([raw_row("v0")], schema=RAW_SCHEMA), src / "val.parquet")
    pq.write_table(pa.Table.from_pylist([raw_row("x0")], schema=RAW_SCHEMA), src / "extra.parquet")
    logs = []
    report = prepare_aokvqa(str(src), str(tmp_path / "o1"), log=logs.append)
    assert report.rows == {"train": 2, "validation": 1}
    assert "ignoring 1 parquet file(s) of no known split" in "\n".join(logs) and "extra.parquet" in "\n".join(
        logs
    )
    report = prepare_aokvqa(str(src / "t*.parquet"), str(tmp_path / "o2"), splits=["train"], log=quiet)
    assert report.rows == {"train": 2}
    report = prepare_aokvqa(str(src / "val.parquet"), str(tmp_path / "o3"), splits=["validation"], log=quiet)
    assert report.rows == {"validation": 1}
    with pytest.raises(DataPrepError, match="cannot tell the split"):
        prepare_aokvqa(str(src / "extra.parquet"), str(tmp_path / "o4"), splits=["train"], log=quiet)
    with pytest.raises(DataPrepError, match="neither an existing local path nor a Hub dataset name"):
        prepare_aokvqa(str(tmp_path / "missing" / "dir" / "x"), str(tmp_path / "o5"), log=quiet)


# ------------------------------------------------------------------------------------------ multi-image rows
MULTI_SCHEMA = pa.schema([pa.field("images", pa.list_(RAW_SCHEMA.field("image").type)) if f.name == "image" else f
                          for f in RAW_SCHEMA])


def multi_row(qid, images, label=0):
    """An A-OKVQA-schema row holding an ``images`` list (TRL's multi-image column) instead of ``image``."""
    row = {k: v for k, v in raw_row(qid, label=label).items() if k != "image"}
    return {**row, "images": None if images is None else [{"bytes": b, "path": None} for b in images]}


def test_images_list_column_is_kept_in_order_and_loads_for_training(tmp_path):
    from trl_mdi.data import DataArguments, load_training_data

    red, green = (png_bytes(Image.new("RGB", (8, 8), c)) for c in ((255, 0, 0), (0, 255, 0)))
    gray = png_bytes(Image.new("L", (8, 8), 90))
    rows = [multi_row("two", [red, green]), multi_row("three", [green, gray, red], label=1),
            multi_row("one", [red]), multi_row("empty", []), multi_row("null", None),
            multi_row("one_bad", [red, b"not an image"])]
    write_raw_split(tmp_path / "src", "train", rows, MULTI_SCHEMA)
    logs = []
    report = prepare_aokvqa(str(tmp_path / "src"), str(tmp_path / "out"), splits=["train"], subset_size=2,
                            log=logs.append)
    split = report.splits["train"]
    assert split.rows_out == 3 and split.skipped == {aokvqa.SKIP_MISSING_IMAGE: 2, aokvqa.SKIP_BAD_IMAGE: 1}
    assert "keeps the 'images' list" in "\n".join(logs)
    train = load_parquet(tmp_path / "out" / "train.parquet", tmp_path / "cache")
    assert train.column_names == list(aokvqa.output_columns("images"))
    assert train.features == aokvqa.output_features("images")
    assert train["question_id"] == ["two", "three", "one"]
    pixels = [[img.convert("RGB").getpixel((0, 0)) for img in row] for row in train["images"]]
    assert pixels == [[(255, 0, 0), (0, 255, 0)], [(0, 255, 0), (90, 90, 90), (255, 0, 0)], [(255, 0, 0)]]
    assert all(img.mode == "RGB" for row in train["images"] for img in row)  # grayscale made RGB, in place
    sample = load_parquet(tmp_path / "out" / "sample_2.parquet", tmp_path / "cache")
    assert sample.features == aokvqa.output_features("images")
    data = load_training_data(DataArguments(dataset_path=str(tmp_path / "out")), need_eval=False, seed=0,
                              log=lambda *a, **k: None)
    assert data.image_column == "images"
    assert sorted(len(x) for x in data.train["images"]) == [1, 2, 3]


def test_files_of_one_split_disagreeing_on_the_image_column_is_an_error(tmp_path):
    red = png_bytes(Image.new("RGB", (8, 8), (255, 0, 0)))
    data = tmp_path / "src" / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([raw_row("a")], schema=RAW_SCHEMA), data / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist([multi_row("b", [red])], schema=MULTI_SCHEMA),
                   data / "train-00001-of-00002.parquet")
    with pytest.raises(aokvqa.DataPrepError, match="mixes image columns"):
        prepare_aokvqa(str(tmp_path / "src"), str(tmp_path / "out"), splits=["train"], log=quiet)
    assert not (tmp_path / "out").exists()
