"""Images that were silently wrong, stale or failing late (issue 42, item 4).

1. 16-bit and other high-depth images are scaled to 8 bits, not clipped (they came out white or two-tone), on each of
   the three paths an image takes: the A-OKVQA prep, the data load of the entry point, the trainer's decoding. Checked
   against reference values worked out by hand from ``trl_mdi.data.pixels``' rule.
2. An image whose size or shape the family's processor refuses (Qwen2.5-VL: aspect ratio 200 or more) is caught at
   load, in the processor's own words: dropped and counted under ``on_bad_image=skip``, an error naming the row under
   ``error``; mid-run (a dataset handed to the trainer), skipped and counted as a bad image, never the processor's
   traceback after the weights loaded.
3. Images named by path are read again when their file changes (the data load's cache knows their size and
   modification time), and the data load writes nothing into a ``save_to_disk`` source.
"""

from __future__ import annotations

import io
import os

import datasets
import numpy as np
import pytest
from PIL import Image

from trl_mdi.data import DROP_REFUSED, DataArguments, DatasetError, load_training_data
from trl_mdi.data.images import ProcessorImageCheck, decode_row_images

datasets.disable_progress_bars()

# --------------------------------------------------------------------------------------------- high-depth modes
# Pixel values and the 8-bit values they must become (trl_mdi.data.pixels.high_depth_to_8bit's rule, by hand).
I16 = ([0, 257 * 10, 257 * 100, 32896, 65535], [0, 10, 100, 128, 255])  # v / 257
F_UNIT = ([0.0, 0.5, 0.25, 1.0, float("nan")], [0, 128, 64, 255, 0])  # v * 255 (0.5 * 255 = 127.5 rounds to 128)
I_WIDE = ([-1000, 0, 1000, 3000, 99000], [0, 3, 5, 10, 255])  # its own range, -1000..99000, over 0..255


def encoded(mode: str, values: list, fmt: str) -> bytes:
    img = Image.new(mode, (len(values), 1))
    for x, v in enumerate(values):
        img.putpixel((x, 0), v)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


HIGH_DEPTH = {  # name: (encoded bytes, the mode PIL opens them in, expected 8-bit values)
    "png_16bit": (encoded("I;16", I16[0], "PNG"), "I;16", I16[1]),
    "tiff_16bit_big_endian": (encoded("I;16B", I16[0], "TIFF"), "I;16B", I16[1]),
    "tiff_float": (encoded("F", F_UNIT[0], "TIFF"), "F", F_UNIT[1]),
    "tiff_int32": (encoded("I", I_WIDE[0], "TIFF"), "I", I_WIDE[1]),
}


def grey(img: Image.Image) -> list[int]:
    """The image's pixels, each checked grey (r == g == b), as one value each."""
    rgb = np.asarray(img.convert("RGB"))[0]
    assert img.mode == "RGB" and (rgb == rgb[:, :1]).all(), rgb
    return rgb[:, 0].tolist()


def test_the_reference_files_open_in_their_high_depth_modes():
    for name, (data, mode, _) in HIGH_DEPTH.items():
        assert Image.open(io.BytesIO(data)).mode == mode, name


def test_high_depth_images_scale_to_8_bits_in_the_prep(tmp_path):
    from test_data_prep import raw_row, write_raw_split

    from trl_mdi.aokvqa import prepare_aokvqa

    write_raw_split(tmp_path / "src", "train", [raw_row(k, image=v[0]) for k, v in HIGH_DEPTH.items()])
    prepare_aokvqa(str(tmp_path / "src"), str(tmp_path / "out"), splits=["train"], log=lambda *a: None)
    ds = datasets.load_dataset("parquet", data_files=str(tmp_path / "out" / "train.parquet"), split="train",
                               cache_dir=str(tmp_path / "cache"))
    got = {r["question_id"]: grey(r["image"]) for r in ds}
    assert got == {name: want for name, (_, _, want) in HIGH_DEPTH.items()}


def test_high_depth_images_scale_to_8_bits_in_the_data_load(tmp_path):
    rows = {"image": [{"bytes": v[0], "path": None} for v in HIGH_DEPTH.values()], "prompt": ["Q?"] * len(HIGH_DEPTH),
            "question_id": list(HIGH_DEPTH)}
    datasets.Dataset.from_dict(rows).to_parquet(tmp_path / "train.parquet")
    data = load_training_data(DataArguments(dataset_path=str(tmp_path)), log=lambda *a: None)
    got = {r["question_id"]: grey(r["image"]) for r in data.train}
    assert got == {name: want for name, (_, _, want) in HIGH_DEPTH.items()}


def test_high_depth_images_scale_to_8_bits_in_the_trainers_decoding(tmp_path):
    (tmp_path / "f.png").write_bytes(HIGH_DEPTH["png_16bit"][0])
    rows = [{"image": {"bytes": data, "path": None}} for data, _, _ in HIGH_DEPTH.values()]
    rows.append({"images": [{"bytes": None, "path": str(tmp_path / "f.png")}]})  # by path, in a list
    rows.append({"image": Image.open(io.BytesIO(HIGH_DEPTH["tiff_16bit_big_endian"][0]))})  # a PIL image as it is
    assert decode_row_images(rows) == {}
    got = [grey(r["image"]) for r in rows[:4]] + [grey(rows[4]["images"][0]), grey(rows[5]["image"])]
    assert got == [want for _, _, want in HIGH_DEPTH.values()] + [I16[1], I16[1]]


# ------------------------------------------------------------------------------- sizes the processor refuses
SHAPES = [(56, 48), (1000, 4), (4, 1000), (2, 300), (300, 2), (100, 4), (1, 1)]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "glm4v", "idefics3", "smolvlm", "gemma3",
                                  "llava", "llava_next", "llava_onevision", "internvl", "mistral3", "gemma4"])
def test_the_check_refuses_what_the_processor_refuses_and_nothing_else(arch):
    """For each family, the check's verdict on a size is what the processor does with a prompt holding such an image:
    it refuses exactly the sizes the processor raises on (Qwen-VL and GLM: aspect ratio 200 or more, in their words;
    Pixtral: a 2 px side), and nothing else."""
    from fixtures.tiny import build_tiny_vlm

    _, processor = build_tiny_vlm(arch)
    check = ProcessorImageCheck(processor)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                              "text": "Q?"}]}],
                                         add_generation_prompt=True)
    for size in SHAPES:
        try:
            processor(text=[text], images=[[Image.new("RGB", size)]], return_tensors="pt")
            error = None
        except Exception as e:
            error = e
        verdict = check(size)
        assert (verdict is not None) == (error is not None), (arch, size, verdict, error)
        if error is not None and "aspect ratio" in str(error):
            assert str(error).split(",")[0] in verdict  # the processor's own limit, in its words


def png(size, color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def mc_rows(sizes) -> dict:
    n = len(sizes)
    return {"image": [{"bytes": png(s), "path": None} for s in sizes], "prompt": ["What colour?\nA. red\nB. blue"] * n,
            "label_idx": [0] * n, "choices": [["red", "blue"]] * n, "question_id": [f"q{i}" for i in range(n)]}


@pytest.fixture(scope="module")
def qwen_processor(tiny_vlm_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_vlm_dir("qwen2_5_vl"))


def test_a_refused_image_is_dropped_and_counted_at_load_or_an_error_naming_it(tmp_path, qwen_processor):
    datasets.Dataset.from_dict(mc_rows([(56, 48), (1000, 4), (48, 56)])).to_parquet(tmp_path / "train.parquet")
    args = DataArguments(dataset_path=str(tmp_path))
    data = load_training_data(args, log=lambda *a: None, image_check=ProcessorImageCheck(qwen_processor))
    report = data.reports[0]
    assert data.train["question_id"] == ["q0", "q2"] and report.dropped == {DROP_REFUSED: 1}
    assert report.refused == ["question_id 'q1': Qwen2VLImageProcessor refuses a 1000x4 image: absolute aspect ratio "
                              "must be smaller than 200, got 250.0"]
    assert "1 image the processor refuses" in report.describe() and "must be smaller than 200" in report.describe()
    with pytest.raises(DatasetError, match=r"1 image\(s\) the processor refuses: question_id 'q1': .*aspect ratio must"
                                           r" be smaller than 200.*on_bad_image is 'error'"):
        load_training_data(args, log=lambda *a: None, image_check=ProcessorImageCheck(qwen_processor),
                           on_bad_image="error")


def test_the_entry_point_drops_a_refused_image_before_the_model_loads(capsys, tiny_vlm_dir, tmp_path):
    from trl_mdi.cli.command import main

    datasets.Dataset.from_dict(mc_rows([(56, 48), (1000, 4), (48, 56), (56, 56)])).to_parquet(
        tmp_path / "train.parquet")
    common = ["--model_name_or_path", str(tiny_vlm_dir("qwen2_5_vl")), "--dataset_path", str(tmp_path),
              "--output_dir", str(tmp_path / "out"), "--dry_run", "--per_device_train_batch_size", "4",
              "--num_generations", "4"]
    assert main(common) == 0
    out = capsys.readouterr().out
    assert "train: 3 rows (1 of 4 dropped: 1 image the processor refuses" in out, out
    assert main(common + ["--on_bad_image", "error"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: split 'train' of ") and "question_id 'q1'" in err and "smaller than 200" in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def with_a_refused_image(grpo_train_dataset):
    """The training rows with row 1's image a 1000x4 one (the processor's aspect-ratio limit is 200)."""
    rows = grpo_train_dataset.cast_column("image", datasets.Image(decode=False)).to_list()
    rows[1]["image"] = {"bytes": png((1000, 4)), "path": None}
    ds = datasets.Dataset.from_list(rows, features=grpo_train_dataset.cast_column(
        "image", datasets.Image(decode=False)).features).cast_column("image", datasets.Image())
    return ds, rows[1]["question_id"]


@pytest.mark.parametrize("policy", ["skip", "error"])
def test_a_refused_image_mid_run_is_a_bad_image(tiny_vlm_dir, with_a_refused_image, tmp_path, policy):
    """A dataset handed to the trainer directly (no data load): the refused image's rollouts are skipped and counted
    (skip), or every process stops naming the row and the processor's limit (error). Before: the processor's
    ValueError from inside TRL's prompt encoding, whatever on_bad_image said."""
    from test_trainer import make_args, spread_reward

    from trl_mdi.trainer import MDIGRPOTrainer

    ds, qid = with_a_refused_image
    trainer = MDIGRPOTrainer(str(tiny_vlm_dir("qwen2_5_vl")), reward_funcs=[spread_reward],
                             args=make_args(tmp_path, max_steps=1, per_device_train_batch_size=8,
                                            on_bad_image=policy), train_dataset=ds)
    trainer.model.train()
    batch = next(b for b in trainer.get_train_dataloader() if any(x["question_id"] == qid for x in b))
    bad = [i for i, x in enumerate(batch) if x["question_id"] == qid]
    if policy == "error":
        with pytest.raises(RuntimeError, match=rf"{qid}.*absolute aspect ratio must be smaller than 200.*"
                                               r"on_bad_image='skip'"):
            trainer._generate_and_score_completions(batch)
        return
    out = trainer._generate_and_score_completions(batch)
    assert (out["advantages"][bad] == 0).all() and (out["tool_mask"][bad] == 0).all()
    assert trainer._metrics["train"]["data/bad_images"][-1] == len(bad)


# -------------------------------------------------------------------------------------- images named by path
def test_an_image_file_replaced_between_two_loads_is_read_again(tmp_path):
    (tmp_path / "img").mkdir()
    image = tmp_path / "img" / "a.png"
    image.write_bytes(png((8, 8), (255, 0, 0)))
    rows = mc_rows([(8, 8)])
    rows["image"] = ["img/a.png"]
    datasets.Dataset.from_dict(rows).to_parquet(tmp_path / "train.parquet")
    args = DataArguments(dataset_path=str(tmp_path))
    assert load_training_data(args, log=lambda *a: None).train[0]["image"].getpixel((0, 0)) == (255, 0, 0)
    stamp = image.stat().st_mtime_ns
    image.write_bytes(png((8, 8), (0, 0, 255)))
    os.utime(image, ns=(stamp + 2_000_000_000, stamp + 2_000_000_000))  # a later time, whatever the clock's grain
    assert load_training_data(args, log=lambda *a: None).train[0]["image"].getpixel((0, 0)) == (0, 0, 255)
    # Unchanged files: the cache is used (the same prepared file, not a second pass).
    first = load_training_data(args, log=lambda *a: None).train.cache_files
    assert first == load_training_data(args, log=lambda *a: None).train.cache_files


def test_the_data_load_writes_nothing_into_a_save_to_disk_source(tmp_path):
    rows = mc_rows([(8, 8), (8, 8)])
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(tmp_path / "saved")
    before = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "saved").rglob("*"))
    data = load_training_data(DataArguments(dataset_path=str(tmp_path / "saved")), log=lambda *a: None)
    assert data.train.num_rows == 2
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "saved").rglob("*")) == before

