"""``python -m trl_mdi.profile``: the per-layer masses it reports are eager attention weights (1e-5) whatever the batch
size and padding; the command runs offline on two tiny models and writes its four files with the right numbers;
bad inputs fail before any weight is loaded; docs/profile.md's --help and commands are the real ones."""

from __future__ import annotations

import io
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from fixtures.testing import eager_masses, family_params, shape_image
from fixtures.tiny import TINY_ARCHS
from trl_mdi.attention import ModalityAttention, image_token_ids
from trl_mdi.data.images import decode_row_images
from trl_mdi.diagnostics.plots import plot_mass_by_layer, plot_mdi_by_layer
from trl_mdi.profile import layer_profile, main, parse_args
from trl_mdi.profile.arguments import HELP_WIDTH, build_parser
from trl_mdi.profile.measure import load_model, measure_batch, measure_rows

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "profile.md"
QUESTION = "What colour is the shape in the image?\nA. red\nB. green\nC. blue\nD. yellow"


def _load(path, attn=None):
    """Default attention (SDPA; eager for PaliGemma 2's soft-capped decoder, which has no SDPA kernel), or ``attn``."""
    from transformers import AutoModelForImageTextToText

    kwargs = {"attn_implementation": attn} if attn else {}
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def _processor(path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _rows_dataset(n_text_only: int = 1):
    """Rows as the profile prepares them: conversational prompts of different lengths, an image or none, and fixed
    completions of different lengths (both paddings vary within a batch)."""
    from datasets import Dataset

    from trl_mdi.data.images import lazy_images

    prompts = ["Shape?", QUESTION, "How many shapes are in the picture? Count them carefully.", "Colour?"]
    rows = {"prompt": [[{"role": "user", "content": p}] for p in prompts],
            "image": [shape_image(56, i) for i in range(len(prompts) - n_text_only)] + [None] * n_text_only,
            "completion": ["red", "<think> image</think>\nAnswer: B", "two shapes, I think", "blue blue blue blue"]}
    return lazy_images(Dataset.from_dict(rows))


def _eager_reference(eager, batch):
    """(B, layers, 4) masses from eager attention weights over exactly the tensors the profile measured."""
    return eager_masses(eager, batch)[0]


def _masses(att: ModalityAttention) -> torch.Tensor:
    return torch.stack([att.image, att.prompt_text, att.completion, att.special], dim=-1).double()


# ------------------------------------------------------------------------------------------- exactness


def test_profile_masses_equal_eager_across_batch_sizes_and_padding(tiny_vlm_dir):
    path = tiny_vlm_dir("qwen2_5_vl")
    model, processor, eager = _load(path), _processor(path), _load(path, "eager")
    ds = _rows_dataset()
    rows = [ds[i] for i in range(ds.num_rows)]
    decode_row_images(rows)
    # The reference: every row alone (no padding at all), eager attention weights materialised.
    ref = torch.cat([_eager_reference(eager, measure_batch(model, processor, [r], max_new_tokens=1,
                                                           completion_texts=[r["completion"]])[2]) for r in rows])
    errors = {}
    for batch_size in (1, 3, 4):  # 3: a full and a partial batch; 4: every row padded against the others
        got = measure_rows(model, processor, ds, batch_size=batch_size, completion_column="completion", progress=False)
        assert got.rows == [0, 1, 2, 3] and got.attention.n_image.tolist()[-1] == 0
        errors[batch_size] = (_masses(got.attention) - ref).abs().max().item()
    # --attn_implementation sets the attention the model generates with; the measurement is the probe's either way.
    loaded_eager = load_model(str(path), attn_implementation="eager", dtype="float32", device="cpu")
    got = measure_rows(loaded_eager, processor, ds, batch_size=4, completion_column="completion", progress=False)
    errors["eager model, 4"] = (_masses(got.attention) - ref).abs().max().item()
    print(f"\nmax |profile - eager| by batch size: {errors}")
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("arch", family_params(TINY_ARCHS))
def test_every_family_is_profiled_exactly(tiny_vlm_dir, arch):
    """Rendering, greedy generation and measurement on every family the probe supports (hybrid linear / sliding-window
    layers, LLaVA-NeXT, Gemma 4), against eager weights of the softmax layers, over a padded batch with a text-only row."""
    from transformers import AutoConfig

    from trl_mdi.attention.model_facts import model_facts

    path = tiny_vlm_dir(arch)
    ds = _rows_dataset()
    rows = [ds[i] for i in range(ds.num_rows)]
    if model_facts(AutoConfig.from_pretrained(path)).image_in_every_prompt:
        rows = rows[:3]  # PaliGemma takes no prompt without an image: the three image rows, still padded
    decode_row_images(rows)
    att, _, batch = measure_batch(_load(path), _processor(path), rows, max_new_tokens=4)
    ref = _eager_reference(_load(path, "eager"), batch)
    err = (_masses(att)[:, att.layers] - ref).abs().max().item()
    assert err < 1e-5, f"{arch}: max |profile - eager| = {err:.1e}"
    assert (att.n_image[:3] > 0).all() and (att.n_image[3:] == 0).all() and att.valid.all()


def test_generated_completions_are_measured_exactly(tiny_vlm_dir):
    """Greedy generation in a padded batch: the measured tensors, checked against eager weights, end each completion
    at its first end-of-sequence token, and the image placeholder is never generated."""
    path = tiny_vlm_dir("qwen2_5_vl")
    model, processor = _load(path), _processor(path)
    ds = _rows_dataset()
    rows = [ds[i] for i in range(3)]
    decode_row_images(rows)
    att, texts, batch = measure_batch(model, processor, rows, max_new_tokens=6)
    err = (_masses(att) - _eager_reference(_load(path, "eager"), batch)).abs().max().item()
    assert err < 1e-5, err
    assert len(texts) == 3 and att.valid.all() and (att.n_queries <= 6).all()
    completion = batch["input_ids"][batch["completion_mask"].bool()]
    assert not torch.isin(completion, torch.tensor(image_token_ids(model.config))).any()


# ------------------------------------------------------------------------------------------- the numbers


def test_layer_profile_counts_zero_image_rows_and_rows_without_image():
    """MDI is the ratio of mean masses; a row with image mass 0 at a layer is counted there, not averaged as inf; a
    row without image tokens is counted and left out."""
    t = lambda *rows: torch.tensor(rows, dtype=torch.float32)  # noqa: E731
    att = ModalityAttention(
        image=t([0.2, 0.1], [0.0, 0.3], [0.0, 0.0]), prompt_text=t([0.6, 0.7], [0.9, 0.5], [0.9, 0.9]),
        completion=t([0.2, 0.2], [0.1, 0.2], [0.1, 0.1]), special=torch.zeros(3, 2),
        n_image=torch.tensor([4, 8, 0]), n_prompt_text=torch.tensor([40, 20, 30]), n_special=torch.zeros(3),
        n_completion=torch.tensor([3, 3, 3]), n_queries=torch.tensor([3, 3, 3]))
    p = layer_profile(att)
    assert p["rows"] == {"profiled": 3, "measured": 2, "without_image_tokens": 1, "unmeasured": 0}
    layer0 = p["layers"][0]
    # rows 0 and 1 only: mean A_T 0.75, mean A_O 0.1, mean n_T 30, mean n_O 6
    assert layer0["mdi"] == pytest.approx((0.75 / 30) / (0.1 / 6), rel=1e-6)
    assert layer0["rows_mdi_inf"] == 1 and layer0["mdi_p25"] == layer0["mdi_p75"] == pytest.approx(0.6 / 40 / 0.05)
    assert layer0["image"] == pytest.approx(0.1) and layer0["image_std"] == pytest.approx(0.1)
    assert p["layers"][1]["rows_mdi_inf"] == 0 and math.isfinite(p["segments"]["all"]["mdi"])


def test_layer_stats_live_under_attention():
    """The per-layer statistics are pure over ModalityAttention: importing them pulls in neither the profile command
    nor the live logs (which import them in turn); ``trl_mdi.profile``'s names are the same functions, without a
    warning."""
    code = """
import sys, warnings
warnings.filterwarnings("error", message=".*trl_mdi")
import trl_mdi.attention.layer_stats as L
assert not {m for m in sys.modules if m.startswith(("trl_mdi.profile", "trl_mdi.diagnostics"))}
import trl_mdi.profile as P
assert all(getattr(P, n) is getattr(L, n) for n in ("layer_profile", "mdi_curve", "mass_curve", "compare"))
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_plots_take_plain_arrays(tmp_path):
    curves = {"a": {"layers": [0, 1, 2], "mdi": [0.5, float("inf"), 2.0], "low": [0.4, math.nan, 1.5],
                    "high": [0.7, math.nan, 3.0]}, "b": {"layers": [0, 1, 2], "mdi": [1.2, 1.1, math.nan]}}
    png = plot_mdi_by_layer(curves, tmp_path / "mdi.png")
    masses = {"a": {"layers": [0, 1], "image": [0.1, 0.2], "prompt_text": [0.8, 0.6], "completion": [0.1, 0.2]}}
    png2 = plot_mass_by_layer(masses, tmp_path / "sub" / "mass.png")
    for p in (png, png2):
        with Image.open(p) as img:
            assert img.size[0] >= 500 and len(img.convert("RGB").getcolors(1 << 20)) > 50
    with pytest.raises(ValueError, match="3 layers but 2 MDI values"):
        plot_mdi_by_layer({"x": {"layers": [0, 1, 2], "mdi": [1.0, 2.0]}}, tmp_path / "bad.png")


# ------------------------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def profile_data(tmp_path_factory):
    """A validation split of 8 rows: 5 good images, 1 text-only row, 1 row whose bytes are no image (dropped while
    preparing) and 1 truncated PNG (its header reads; decoding fails at batch time: skipped)."""
    from datasets import Dataset, Features, Value
    from datasets import Image as ImageFeature

    root = tmp_path_factory.mktemp("profile_data")
    good = [_png(shape_image(56, i)) for i in range(5)]
    images = [{"bytes": b, "path": None} for b in good]
    images += [None, {"bytes": b"not an image", "path": None}, {"bytes": good[0][:80], "path": None}]
    prompts = [QUESTION] * 8
    features = Features({"image": ImageFeature(), "prompt": Value("string"), "answer": Value("string")})
    Dataset.from_dict({"image": images, "prompt": prompts, "answer": ["<think> image</think>\nAnswer: A"] * 8},
                      features=features).to_parquet(root / "validation.parquet")
    # Outside root, or the folder scan would read it as root's train split.
    no_images = root.parent / f"{root.name}_no_images"
    no_images.mkdir()
    Dataset.from_dict({"prompt": prompts}).to_parquet(no_images / "train.parquet")
    return root


def run_profile(argv, capsys):
    code = main([*map(str, argv), "--no_progress"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_command_profiles_two_models_and_writes_every_file(tiny_vlm_dir, profile_data, tmp_path, capsys):
    a, b = tiny_vlm_dir("qwen2_5_vl"), tiny_vlm_dir("qwen2_5_vl", seed=1)
    out = tmp_path / "profile"
    code, stdout, stderr = run_profile(["--model_name_or_path", a, b, "--dataset_path", profile_data, "--out", out,
                                 "--max_new_tokens", 4, "--batch_size", 3], capsys)
    assert code == 0, stderr
    report = json.loads((out / "profile.json").read_text())
    assert report["data"]["dropped"] == {"unreadable image": 1} and report["data"]["skipped_rows"] == 1
    assert [m["label"] for m in report["models"]] == [a.name, b.name]  # folder names (distinct here)
    for m in report["models"]:
        p = m["profile"]
        assert p["rows"] == {"profiled": 6, "measured": 5, "without_image_tokens": 1, "unmeasured": 0}
        assert p["measured_layers"] == [0, 1, 2] and len(p["layers"]) == 3 and m["skipped"] == 1
        for row in p["layers"]:
            assert row["image"] + row["prompt_text"] + row["completion"] == pytest.approx(1.0, abs=1e-5)
            ratio = (row["prompt_text"] / p["mean_prompt_text_tokens"]) / (row["image"] / p["mean_image_tokens"])
            assert row["mdi"] == pytest.approx(ratio, rel=1e-5)  # the ratio of the mean masses
            assert row["mdi_p25"] <= row["mdi_median"] <= row["mdi_p75"] and row["rows"] == 5
        assert set(p["segments"]) == {"early", "middle", "late", "all"}
        assert [r["n_image"] > 0 for r in m["rows"]] == [True] * 5 + [False]
    cmp = report["comparison"]
    assert cmp["by"] == "layer" and cmp["base"] == a.name
    first, second = (m["profile"]["layers"] for m in report["models"])
    for row, x, y in zip(cmp["models"][b.name]["layers"], first, second):
        assert row["mdi_ratio"] == pytest.approx(y["mdi"] / x["mdi"]) and row["image"] == pytest.approx(y["image"] - x["image"])
    md = (out / "profile.md").read_text()
    assert md.count("| layer | image mass |") == 2 and "1 without image tokens (no MDI)" in md
    assert "1 unreadable image (dropped while preparing); 1 image(s) that failed to decode (skipped)" in md
    assert f"| 0 | {first[0]['image']:.3f} ± " in md and f"### {b.name} against {a.name}" in md
    for name in ("mdi_by_layer.png", "mass_by_layer.png"):
        with Image.open(out / name) as img:
            assert img.size[0] >= 600 and len(img.convert("RGB").getcolors(1 << 20)) > 100
    assert f"pictures: {out / 'mdi_by_layer.png'}" in stdout and "MDI early" in stdout


def test_models_of_different_depth_are_compared_by_segment(tiny_vlm_dir, profile_data, tmp_path, capsys):
    a, c = tiny_vlm_dir("qwen2_5_vl"), tiny_vlm_dir("qwen2_5_vl", num_layers=2)
    out = tmp_path / "p"
    code, _, stderr = run_profile(["--model_name_or_path", a, c, "--dataset_path", profile_data, "--split", "validation",
                            "--out", out, "--query_phase", "prompt", "--num_samples", 4], capsys)
    assert code == 0, stderr
    report = json.loads((out / "profile.json").read_text())
    cmp = report["comparison"]["models"][c.name]
    assert report["comparison"]["by"] == "segment" and "layers" not in cmp and set(cmp["segments"]) == {"early", "late", "all"}
    assert all(r["completion"] == "" for m in report["models"] for r in m["rows"])  # prompt phase: nothing generated
    assert "compared by layer segment" in (out / "profile.md").read_text()


@pytest.fixture
def no_weights(monkeypatch):
    """Fails the test if any model weights are loaded."""
    import transformers

    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("weights were loaded")

    for cls in (transformers.AutoModelForImageTextToText, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", refuse)
    return calls


def test_bad_inputs_fail_before_any_weight_is_loaded(tiny_vlm_dir, profile_data, tmp_path, capsys, no_weights):
    from fixtures.tiny import save_tiny_text_model

    vlm = tiny_vlm_dir("qwen2_5_vl")
    text_model = save_tiny_text_model(tmp_path / "text", "causal_lm")
    capsys.readouterr()  # the save's progress bar is not the command's output
    data = ["--dataset_path", profile_data, "--out", tmp_path / "o"]
    cases = [
        (["--model_name_or_path", vlm, text_model, *data], "is not a vision-language model"),
        (["--model_name_or_path", vlm, "--dataset_path", f"{profile_data}_no_images", "--out", tmp_path / "o"],
         "has no image column"),
        (["--model_name_or_path", vlm, *data, "--image_column", "answer"], "none of the 8 sampled rows has a usable image"),
        (["--model_name_or_path", vlm, *data, "--num_sample", "3"], "unknown flag(s): --num_sample (did you mean --num_samples?)"),
        (["--model_name_or_path", vlm, *data, "--completion_column", "nope"], "no column 'nope' (--completion_column)"),
        (["--model_name_or_path", vlm, *data, "--split", "train"], "no split 'train' (--split)"),
        (["--model_name_or_path", vlm, *data, "--layer_segments", "early:0-9"], "--layer_segments on"),
        (["--model_name_or_path", tmp_path / "missing", *data], "does not exist"),
        ([*data], "the following arguments are required: --model_name_or_path"),
        (["--model_name_or_path", vlm, vlm, *data], "more than once"),
        (["--model_name_or_path", vlm, *data, "--device", "nodevice"], "--device 'nodevice'"),
        (["--model_name_or_path", vlm, *data, "--attn_implementation", "bogus"], "is not one transformers knows"),
        (["--model_name_or_path", vlm, "--dataset_path", profile_data, "--out", Path(__file__) / "o"],
         "is a file, not a folder"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--model_name_or_path", vlm, *data, "--device", "cuda"], "has no CUDA device"))
    for argv, message in cases:
        code, _, stderr = run_profile(argv, capsys)
        assert code == 2 and message in stderr, (argv, stderr)
        # One message, no traceback (datasets may print its progress bars first)
        assert stderr.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in stderr
    assert no_weights == [] and not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------- the docs


def test_docs_show_the_real_help():
    help_text = build_parser(HELP_WIDTH).format_help().rstrip()
    assert f"```text\n$ python -m trl_mdi.profile --help\n{help_text}\n```" in DOC.read_text(), (
        "docs/profile.md's --help block differs from the parser: paste "
        f"`python -c 'from trl_mdi.profile import build_parser; print(build_parser({HELP_WIDTH}).format_help())'`")


def _documented_commands() -> list[list[str]]:
    """The flags of every trl_mdi.profile command in the bash blocks of README.md and docs/, and in demo.sh."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    blocks = [b for p in pages for b in re.findall(r"^[ \t]*```bash[^\n]*\n(.*?)^[ \t]*```", p.read_text(), re.S | re.M)]
    text = "\n".join([*blocks, (ROOT / "examples" / "demo.sh").read_text()])
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        if "trl_mdi.profile" in line and "--model_name_or_path" in line:
            tokens = shlex.split(line.split("trl_mdi.profile", 1)[1], comments=True)
            commands.append([t for t in tokens if t not in ("|", "&&")])
    return commands


def test_every_documented_command_line_parses():
    commands = _documented_commands()
    assert len(commands) >= 4, commands  # docs/profile.md (3), examples/demo.sh
    for flags in commands:
        args = parse_args(flags)
        assert args.model_name_or_path and args.out


@pytest.mark.e2e  # minutes-long (a launch of 2 processes or a whole command): make test-e2e, which CI runs
@pytest.mark.slow
def test_the_documented_commands_run(tmp_path):
    """docs/profile.md's runnable block, as tests/test_readme.py runs it: offline, writing under a temporary folder."""
    body = re.search(r"<!-- runnable -->\n```bash\n(.*?)^```", DOC.read_text(), re.S | re.M).group(1)
    venv_bin = ROOT / ".venv" / "bin"
    bin_dir = venv_bin if (venv_bin / "python").exists() else Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    scratch = tmp_path / "trl_mdi_readme"
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", body.replace("/tmp/trl_mdi_readme", str(scratch))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((scratch / "profile" / "profile.json").read_text())
    assert len(report["models"]) == 2 and report["comparison"]["by"] == "layer"
    assert (scratch / "profile" / "mdi_by_layer.png").stat().st_size > 10_000
