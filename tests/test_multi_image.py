"""Multi-image rows end to end (issue 18): an A-OKVQA-style source with an ``images`` list per row is prepared
(the list kept), loaded and trained by the command line, and the live logs say how many images each prompt had and
draw one attention-map panel row per image."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from fixtures.testing import shape_image
from trl_mdi.aokvqa import prepare_aokvqa
from trl_mdi.cli.command import main
from trl_mdi.diagnostics import live

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
SOURCE_SCHEMA = pa.schema([("question_id", pa.string()), ("images", pa.list_(IMAGE)), ("question", pa.string()),
                           ("choices", pa.list_(pa.string())), ("correct_choice_idx", pa.int64())])


def _png(img: Image.Image) -> dict:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


def _wide(seed: int) -> Image.Image:
    out = Image.new("RGB", (112, 56), (255, 255, 255))
    out.paste(shape_image(56, seed), (56, 0))
    return out


def _source(root: Path, n: int = 8) -> Path:
    """Rows with 2 images (a square and a wide one) or 3: "which picture ..." questions over the list."""
    rows = []
    for i in range(n):
        images = [shape_image(56, i), _wide(100 + i)] + ([shape_image(56, 200 + i)] if i % 2 else [])
        rows.append({"question_id": f"m{i}", "images": [_png(x) for x in images],
                     "question": f"Which of the {len(images)} pictures shows the widest scene?",
                     "choices": ["the first", "the second", "the third", "none"], "correct_choice_idx": 1})
    (root / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=SOURCE_SCHEMA), root / "data" / "train-00000-of-00001.parquet")
    return root


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "gemma3"])
def test_multi_image_rows_train_and_log_one_map_row_per_image(tiny_vlm_dir, tmp_path, monkeypatch, arch):
    prepared = tmp_path / "prepared"
    report = prepare_aokvqa(str(_source(tmp_path / "src")), str(prepared), splits=["train"], log=lambda *_: None)
    assert report.splits["train"].rows_out == 8
    drawn = []
    real = live.render_image_maps

    def spy(images, masses, grids, out_path, title=None, **kwargs):
        drawn.append((len(images), [len(m["all"]) for m in masses], [h * w for h, w in grids], kwargs["captions"]))
        return real(images, masses, grids, out_path, title, **kwargs)

    monkeypatch.setattr(live, "render_image_maps", spy)
    logs = tmp_path / "logs"
    code = main([
        "--model_name_or_path", str(tiny_vlm_dir(arch)), "--dataset_path", str(prepared),
        "--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--per_device_train_batch_size", "4",
        "--num_generations", "2", "--max_completion_length", "6", "--report_to", "none", "--use_cpu", "true",
        "--save_strategy", "no", "--logging_steps", "1", "--attention_map_every_n_steps", "1",
        "--attention_maps_per_step", "4", "--log_full_rollouts_per_step", "1", "--seed", "0",
        "--rollout_log_path", str(logs / "r.md"), "--attention_diag_log_path", str(logs / "a.md"),
    ])
    assert code == 0
    # Two steps x four rollouts, each with a map of 2 or 3 image rows whose masses fit each image's token grid.
    assert len(drawn) == 8 and {n for n, *_ in drawn} == {2, 3}
    for n, lengths, grid_tokens, captions in drawn:
        assert lengths == grid_tokens
        if arch == "qwen2_5_vl":  # square and wide images: different grids (Gemma 3 resizes both to one square)
            assert len(set(grid_tokens)) == 2
        shares = [float(re.search(r"· (\d+)% of the image attention", c).group(1)) for c in captions]
        assert len(shares) == n and abs(sum(shares) - 100) <= n
    attention = (logs / "a.md").read_text()
    links = re.findall(r"!\[attention map, step (\d+), rollout (\d+)\]\(([^)]+)\)", attention)
    assert len(links) == 8
    for (_, _, rel), (n, *_) in zip(links, drawn):
        # title, then per image a caption, the segment captions and 160-pixel-high panels, then the legend.
        assert Image.open(logs / rel).height == 18 + n * (18 + 18 + 160) + 18
    rollouts = (logs / "r.md").read_text()
    assert re.search(r"\*\*Prompt\*\* · [23] image\(s\)", rollouts)
    assert "| rollouts by images in the prompt | 2 images: " in rollouts
