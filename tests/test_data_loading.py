"""trl_mdi.data.load_training_data: every source kind, the eval split, image checks and each bad-input error.

All in-process on small files written here (or the prepared synthetic A-OKVQA fixture); nothing touches the Hub.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import datasets
import pytest
from PIL import Image

from trl_mdi.data import (
    DEFAULT_SYSTEM_PROMPT,
    DROP_NOT_FOUND,
    DROP_TOO_LARGE,
    DataArguments,
    DatasetError,
    load_training_data,
    parse_data_files,
    prepare_image,
)

datasets.disable_progress_bars()


def quiet(*_args, **_kwargs) -> None:
    """Log sink for calls whose messages the test does not read."""


def png(size=(8, 8), mode="RGB", color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color if mode == "RGB" else None).save(buf, format="PNG")
    return buf.getvalue()


def mc_rows(n: int, size=(8, 8)) -> dict[str, list]:
    """n rows in the prep script's output schema, images as {bytes, path}."""
    return {
        "image": [{"bytes": png(size), "path": None} for _ in range(n)],
        "prompt": [f"Question {i}?\nA. red\nB. blue" for i in range(n)],
        "label_idx": [i % 2 for i in range(n)],
    }


def write_parquet(path: Path, rows: dict[str, list]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    ds = datasets.Dataset.from_dict(rows)
    if "image" in rows and isinstance(rows["image"][0], dict):
        ds = ds.cast_column("image", datasets.Image())
    ds.to_parquet(str(path))
    return path


def load(need_eval=False, **kwargs):
    return load_training_data(DataArguments(**kwargs), need_eval=need_eval, seed=0, log=quiet)


# ---------------------------------------------------------------------------------------------- source kinds


def test_directory_of_split_files(prepared_aokvqa_dir):
    data = load(dataset_path=str(prepared_aokvqa_dir), need_eval=True)
    assert data.train.num_rows == 64 and data.eval.num_rows == 16
    assert data.train_split == "train" and data.eval_split.startswith("validation")
    assert "train (64 rows)" in data.splits_found and "validation (16 rows)" in data.splits_found
    row = data.train[0]
    assert row["prompt"][0] == {"role": "system", "content": DEFAULT_SYSTEM_PROMPT}
    assert row["prompt"][1]["role"] == "user" and "\nA. " in row["prompt"][1]["content"]
    assert row["image"].mode == "RGB"
    assert {"label_idx", "choices", "question_id"} <= set(data.train.column_names)


def test_sample_split_and_custom_system_prompt(tmp_path):
    write_parquet(tmp_path / "train.parquet", mc_rows(6))
    write_parquet(tmp_path / "sample_3.parquet", mc_rows(3))
    data = load(dataset_path=str(tmp_path), dataset_train_split="sample_3", system_prompt="Be brief.")
    assert data.train.num_rows == 3 and data.eval is None
    assert data.train[0]["prompt"][0] == {"role": "system", "content": "Be brief."}
    no_system = load(dataset_path=str(tmp_path), system_prompt="")
    assert [m["role"] for m in no_system.train[0]["prompt"]] == ["user"]


def test_single_parquet_file(tmp_path):
    path = write_parquet(tmp_path / "anything.parquet", mc_rows(5))
    data = load(dataset_path=str(path))
    assert data.train.num_rows == 5 and data.train_split == "train"


def test_save_to_disk_folder(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(mc_rows(4)),
                               "validation": datasets.Dataset.from_dict(mc_rows(2))})
    dd = dd.cast_column("image", datasets.Image())
    dd.save_to_disk(str(tmp_path / "saved"))
    data = load(dataset_path=str(tmp_path / "saved"), need_eval=True)
    assert (data.train.num_rows, data.eval.num_rows) == (4, 2)
    assert data.source.startswith("save_to_disk")


@pytest.mark.parametrize("form", ["pairs", "json"])
def test_data_files(tmp_path, form):
    write_parquet(tmp_path / "a" / "tr.parquet", mc_rows(4))
    write_parquet(tmp_path / "b" / "ev.parquet", mc_rows(2))
    spec = ("train=a/tr.parquet,validation=b/ev.parquet" if form == "pairs"
            else json.dumps({"train": ["a/tr.parquet"], "validation": "b/ev.parquet"}))
    data = load(dataset_path=str(tmp_path), data_files=spec, need_eval=True)
    assert (data.train.num_rows, data.eval.num_rows) == (4, 2)


def test_parse_data_files_forms():
    assert parse_data_files("x.parquet") == {"train": ["x.parquet"]}
    assert parse_data_files("train=a,train=b") == {"train": ["a", "b"]}
    with pytest.raises(DatasetError, match="JSON"):
        parse_data_files('{"train": ')


# -------------------------------------------------------------------------------------------------- eval split


@pytest.mark.parametrize("size, expected", [(0.25, 16), (10, 10)])
def test_eval_split_carved_from_train(prepared_aokvqa_dir, size, expected):
    data = load(dataset_path=str(prepared_aokvqa_dir), eval_split_size=size, need_eval=True)
    assert data.eval.num_rows == expected and data.train.num_rows == 64 - expected
    assert "carved out of train" in data.eval_split
    ids = set(data.train["question_id"])
    assert not ids & set(data.eval["question_id"])  # a real split: no row in both


def test_eval_needed_but_absent(tmp_path):
    write_parquet(tmp_path / "train.parquet", mc_rows(4))
    with pytest.raises(DatasetError, match=r"no eval split.*--eval_split_size"):
        load(dataset_path=str(tmp_path), need_eval=True)


def test_eval_flags_without_evaluation(prepared_aokvqa_dir):
    with pytest.raises(DatasetError, match="evaluation is off"):
        load(dataset_path=str(prepared_aokvqa_dir), eval_split_size=0.1)


# ------------------------------------------------------------------------------------------------------- images


def test_large_images_dropped_and_counted(tmp_path):
    rows = mc_rows(5)
    rows["image"][1] = {"bytes": png((1500, 20)), "path": None}
    rows["image"][3] = {"bytes": png((20, 1025)), "path": None}
    write_parquet(tmp_path / "train.parquet", rows)
    data = load(dataset_path=str(tmp_path))
    assert data.train.num_rows == 3
    assert data.reports[0].dropped == {DROP_TOO_LARGE: 2}
    assert "2 of 5 dropped" in data.reports[0].describe()
    assert load(dataset_path=str(tmp_path), max_image_side=0).train.num_rows == 5  # 0: no limit


def test_non_rgb_images_converted(tmp_path):
    rows = mc_rows(3)
    rows["image"] = [{"bytes": png(mode="L"), "path": None}, {"bytes": png(mode="RGBA"), "path": None},
                     {"bytes": png(mode="P"), "path": None}]
    write_parquet(tmp_path / "train.parquet", rows)
    assert [im.mode for im in load(dataset_path=str(tmp_path)).train["image"]] == ["RGB"] * 3


def test_tiny_and_unusual_mode_images_load_as_rgb(tmp_path):
    """1x1 images and 16-bit grey, 1-bit and LA images load, converted to RGB (kept passing)."""
    rows = mc_rows(4)
    rows["image"] = [{"bytes": png((1, 1)), "path": None}, {"bytes": png((1, 1), mode="I;16"), "path": None},
                     {"bytes": png((3, 2), mode="1"), "path": None}, {"bytes": png((2, 3), mode="LA"), "path": None}]
    write_parquet(tmp_path / "train.parquet", rows)
    data = load(dataset_path=str(tmp_path))
    assert data.train.num_rows == 4 and not data.reports[0].dropped
    assert [(im.mode, im.size) for im in data.train["image"]] == [("RGB", (1, 1)), ("RGB", (1, 1)), ("RGB", (3, 2)),
                                                                   ("RGB", (2, 3))]


def test_relative_image_paths_resolved_against_dataset_root(tmp_path, monkeypatch):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png((6, 4)))
    (tmp_path / "imgs" / "b.png").write_bytes(png((4, 6)))
    lines = [{"image": "imgs/a.png", "problem": "How wide?", "solution": "6"},
             {"image": "imgs/b.png", "problem": "How tall?", "solution": "6"},
             {"image": "imgs/missing.png", "problem": "?", "solution": "0"}]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    monkeypatch.chdir(tmp_path / "data")  # the working directory must not matter
    data = load(dataset_path=str(tmp_path))
    assert [im.size for im in data.train["image"]] == [(6, 4), (4, 6)]
    assert data.reports[0].dropped == {DROP_NOT_FOUND: 1}
    assert data.prompt_column == "problem"  # math VQA: prompt text from `problem`, `solution` kept for accuracy
    assert data.train[0]["prompt"][-1] == {"role": "user", "content": "How wide?"}
    assert data.train["solution"] == ["6", "6"]


def test_images_list_column(tmp_path):
    rows = mc_rows(2)
    rows["images"] = [[{"bytes": png(), "path": None}], []]
    del rows["image"]
    ds = datasets.Dataset.from_dict(rows).cast_column("images", datasets.List(datasets.Image()))
    ds.to_parquet(str(tmp_path / "train.parquet"))
    data = load(dataset_path=str(tmp_path))
    assert data.image_column == "images"
    assert [len(x) for x in data.train["images"]] == [1, 0]
    assert data.reports[0].without_image == 1


def test_prepare_image_cells(tmp_path):
    (tmp_path / "x.png").write_bytes(png((3, 3)))
    assert prepare_image(None) == (None, None)
    assert prepare_image("x.png", [str(tmp_path)])[0]["bytes"] == png((3, 3))
    assert prepare_image(Image.new("RGB", (2, 2)))[1] is None
    assert prepare_image(b"not an image")[1] == "unreadable image"


# --------------------------------------------------------------------------------------------------- bad input


def test_path_does_not_exist(tmp_path):
    (tmp_path / "prepared").mkdir()
    with pytest.raises(DatasetError, match=r"does not exist.*holds: prepared/.*did you mean .*prepared'\?"):
        load(dataset_path=str(tmp_path / "prepraed"))


def test_directory_without_usable_split(tmp_path):
    write_parquet(tmp_path / "notes.parquet", mc_rows(2))
    with pytest.raises(DatasetError, match=r"no usable split.*notes\.parquet"):
        load(dataset_path=str(tmp_path))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("hi")
    with pytest.raises(DatasetError, match=r"no usable split.*holds: readme\.txt"):
        load(dataset_path=str(tmp_path / "empty"))


def test_train_split_not_found_lists_splits(tmp_path):
    write_parquet(tmp_path / "validation.parquet", mc_rows(2))
    with pytest.raises(DatasetError, match=r"no split 'train'.*validation \(2 rows\)"):
        load(dataset_path=str(tmp_path))


def test_hub_name_offline_is_a_clear_error():
    with pytest.raises(DatasetError, match="Hugging Face Hub"):
        load(dataset_path="no-such-org/no-such-dataset")


def test_missing_image_column(tmp_path):
    rows = mc_rows(2)
    del rows["image"]
    write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(DatasetError, match=r"no image column: expected 'image'.*'images'"):
        load(dataset_path=str(tmp_path))


def test_missing_prompt_column(tmp_path):
    rows = mc_rows(2)
    rows["question"] = rows.pop("prompt")
    write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(DatasetError, match=r"no prompt column: expected 'prompt'.*'problem'"):
        load(dataset_path=str(tmp_path))




# ---------------------------------------------------------------------- issue 38, item 5: caught at load, by id


def choice_rows(n: int) -> dict[str, list]:
    """n rows as the prep script writes them: prompt, four choices, label_idx and question_id."""
    rows = mc_rows(n)
    rows["choices"] = [["red", "blue", "green", "yellow"] for _ in range(n)]
    rows["question_id"] = [f"q{i}" for i in range(n)]
    return rows


def test_non_ascii_and_control_characters_in_questions_and_choices_load_unchanged(tmp_path):
    """Kept passing (issue 38's "Must show"): accents, CJK, emoji, a right-to-left mark, an ANSI escape and NUL in a
    question and its choices pass the load and the choice checks and reach TRL's prompt byte for byte (the logs escape
    control characters where they show them: test_logs.py::test_clean_removes_controls_normalises_newlines_and_caps)."""
    rows = choice_rows(3)
    choices = ["rouge", "青", "🟩", "gelb\x00"]
    rows["prompt"][1] = "Qu'est-ce que c'est ? 这是什么 🐱 \u200f\x07\x1b[31m\n" + "\n".join(
        f"{letter}. {c}" for letter, c in zip("ABCD", choices))
    rows["choices"][1] = choices
    write_parquet(tmp_path / "train.parquet", rows)
    data = load(dataset_path=str(tmp_path))
    assert data.train.num_rows == 3 and not data.reports[0].dropped
    assert data.train[1]["prompt"][-1] == {"role": "user", "content": rows["prompt"][1]}
    assert data.train[1]["choices"] == choices


def test_label_outside_the_choices_is_an_error_naming_the_question_id(tmp_path):
    """Before: label_idx 7 on a 4-choice row passed the load and failed only when sampled, with a long traceback."""
    rows = choice_rows(4)
    rows["label_idx"][2] = 7
    write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(DatasetError) as e:
        load(dataset_path=str(tmp_path))
    assert str(e.value).startswith("row 2 of split 'train' (question_id 'q2') has label_idx 7 but only 4 choices "
                                   "(A to D): the label must be 0 to 3"), e.value
    rows["label_idx"][2], rows["label_idx"][3] = 1, -1  # negative: also outside
    write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(DatasetError, match=r"question_id 'q3'\) has label_idx -1 but only 4 choices"):
        load(dataset_path=str(tmp_path))


def test_choice_holding_a_choice_marker_is_an_error(tmp_path):
    """Before: a choice "blue\\nB. green" made a prompt with two "B." lines, silently."""
    rows = choice_rows(3)
    rows["choices"][1] = ["red", "blue\nB. green", "grey", "black"]
    write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(DatasetError, match=r"row 1 of split 'train' \(question_id 'q1'\) has choice B .* two 'B\.' "
                                           r"lines"):
        load(dataset_path=str(tmp_path))


def test_duplicate_choices_are_an_error_counting_every_row(tmp_path):
    rows = choice_rows(8)
    for i in (2, 5, 6):
        rows["choices"][i] = ["red", "blue", "Red", "yellow"]
    write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(DatasetError) as e:
        load(dataset_path=str(tmp_path))
    message = str(e.value)
    assert message.startswith("row 2 of split 'train' (question_id 'q2') has the same choice twice: A and C are both "
                              "'red'") and "3 rows of 'train' have such a problem" in message, message
    assert "\n" not in message


def test_choice_checks_on_the_trainer_path():
    """The trainer refuses the same rows when it is handed a dataset directly (no entry point, no prepare_split)."""
    from trl_mdi.data import check_choices

    check_choices([{"choices": ["a", "b"], "label_idx": 1}, {"choices": ["a", "b"], "label_idx": None}])
    with pytest.raises(DatasetError, match=r"row 1 .*question_id 'x'.*label_idx 2 but only 2 choices"):
        check_choices([{"choices": ["a", "b"], "label_idx": 1}, {"choices": ["a", "b"], "label_idx": 2,
                                                                 "question_id": "x"}])
    check_choices(datasets.Dataset.from_dict({"prompt": ["no choices column"], "label_idx": [9]}))


@pytest.mark.parametrize("kind", ["parquet", "parquet_no_row_group", "jsonl", "save_to_disk"])
def test_empty_split_says_empty(tmp_path, kind):
    """Before: Arrow's "BatchSize must be greater than 0" (or a bare StopIteration for json)."""
    import pyarrow.parquet as pq

    empty = datasets.Dataset.from_dict(mc_rows(2)).cast_column("image", datasets.Image()).select([])
    if kind == "parquet":
        empty.to_parquet(str(tmp_path / "train.parquet"))
    elif kind == "parquet_no_row_group":
        pq.write_table(empty.data.table.slice(0, 0), str(tmp_path / "train.parquet"))
    elif kind == "jsonl":
        (tmp_path / "train.jsonl").write_text("")
    else:
        datasets.DatasetDict({"train": empty}).save_to_disk(str(tmp_path / "saved"))
    path = tmp_path / "saved" if kind == "save_to_disk" else tmp_path
    expected = r"split\(s\) 'train' are empty" if kind == "save_to_disk" else r"split 'train'.* is empty.*--dataset_"
    with pytest.raises(DatasetError, match=expected) as e:
        load(dataset_path=str(path))
    assert "BatchSize" not in str(e.value) and "\n" not in str(e.value)


def test_oversized_image_says_too_large_and_the_limit(tmp_path, monkeypatch):
    """Before: an image over PIL's decompression-bomb limit (a 20000x20000 one) was dropped as "unreadable". The
    limit is lowered here so that a 40x40 image stands for it."""
    from PIL import Image as PILImage

    from trl_mdi.data import DROP_TOO_MANY_PIXELS

    rows = mc_rows(3)
    rows["image"][1] = {"bytes": png((40, 40)), "path": None}
    write_parquet(tmp_path / "train.parquet", rows)
    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 500)  # PIL refuses over 2 x 500 = 1000 pixels; 40x40 = 1600
    data = load(dataset_path=str(tmp_path))
    assert data.train.num_rows == 2 and data.reports[0].dropped == {DROP_TOO_MANY_PIXELS: 1}
    line = data.reports[0].describe()
    assert "1 image too large to open" in line and "[limit: 1000 pixels, twice PIL.Image.MAX_IMAGE_PIXELS" in line
    assert "unreadable" not in line
    monkeypatch.undo()
    rows["image"][1] = {"bytes": png((1500, 20)), "path": None}  # over max_image_side: the limit is named too
    write_parquet(tmp_path / "train.parquet", rows)
    line = load(dataset_path=str(tmp_path)).reports[0].describe()
    assert "1 image too large (longer side over max_image_side) [limit: longer side <= 1024 px" in line, line
