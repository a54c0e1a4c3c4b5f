"""Tiny offline VLMs: build, save, reload through the Auto classes, generate, stay deterministic; the CLI, and
the tiny text-only Qwen2 models (the later VLM families are in test_tiny_families.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from fixtures import tiny
from fixtures.tiny import SYSTEM_PROMPT, TINY_ARCHS, build_tiny_text_model, build_tiny_vlm, save_tiny_vlm

REPO_ROOT = Path(__file__).resolve().parents[1]

EXPECTED_CLASSES = {
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"),
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLProcessor"),
    "idefics3": ("Idefics3ForConditionalGeneration", "Idefics3Processor"),
}
IMAGE_TOKEN = {
    "qwen2_5_vl": "<|image_pad|>",
    "qwen2_vl": "<|image_pad|>",
    "qwen3_vl": "<|image_pad|>",
    "idefics3": "<image>",
}
# The first four archs; Qwen3.5, Gemma 3 and LLaVA-NeXT have their own tests in test_tiny_families.py.
CORE_ARCHS = tuple(EXPECTED_CLASSES)


def _load(path: Path):
    return AutoModelForImageTextToText.from_pretrained(path), AutoProcessor.from_pretrained(path)


def _prompt(processor, question: str, with_image: bool) -> str:
    content = ([{"type": "image"}] if with_image else []) + [{"type": "text", "text": question}]
    messages = [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]},
        {"role": "user", "content": content},
    ]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _image(colour=(255, 0, 0), side: int = 64) -> Image.Image:
    return Image.new("RGB", (side, side), colour)


@pytest.mark.parametrize("arch", CORE_ARCHS)
def test_build_save_reload_generate(arch, tiny_vlm_dir):
    model, processor = _load(tiny_vlm_dir(arch))
    model_cls, processor_cls = EXPECTED_CLASSES[arch]
    assert type(model).__name__ == model_cls
    assert type(processor).__name__ == processor_cls
    assert 100_000 < model.num_parameters() < 1_000_000
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"

    tok = processor.tokenizer
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN[arch])
    assert model.config.image_token_id == image_id
    if arch != "idefics3":
        for key, token in [
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        ]:
            assert getattr(model.config, key) == tok.convert_tokens_to_ids(token), key
        assert tok.image_token == "<|image_pad|>" and tok.video_token == "<|video_pad|>"
    assert tok.padding_side == "left"
    assert tok.pad_token_id is not None and tok.eos_token_id is not None

    text = _prompt(processor, "What colour is the circle in the image?", with_image=True)
    assert SYSTEM_PROMPT in text
    inputs = processor(text=[text], images=[_image()], return_tensors="pt")
    prompt_ids = inputs["input_ids"][0]
    assert int((prompt_ids == image_id).sum()) == 4  # the default resolution gives 4 image tokens

    # GRPOTrainer suppresses the image placeholder when it samples, so the policy never learns to
    # avoid it: every other generate call has to suppress it too.
    max_new = 8
    out = model.generate(
        **inputs, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, suppress_tokens=[image_id],
        return_dict_in_generate=True, output_scores=True,
    )  # fmt: skip
    new_ids = out.sequences[0, prompt_ids.shape[0] :]
    assert torch.equal(out.sequences[0, : prompt_ids.shape[0]], prompt_ids)
    assert new_ids.shape[0] == max_new
    assert image_id not in new_ids.tolist()
    assert all(step[0, image_id] == -float("inf") for step in out.scores)


@pytest.mark.parametrize("arch", CORE_ARCHS)
def test_mixed_batch_with_left_padding_matches_single_rows(arch, tiny_vlm_dir):
    """A row with an image and a row without, left-padded together, behave as when run alone."""
    model, processor = _load(tiny_vlm_dir(arch))
    image_id = model.config.image_token_id
    texts = [
        _prompt(processor, "What colour is the shape?", with_image=True),
        _prompt(
            processor, "How many shapes are in the image? A. 1 B. 2 C. 3 D. 4 Answer: A", with_image=False
        ),
    ]
    img = _image((0, 0, 255))
    # Idefics3 wants images grouped per row; the Qwen processors take a flat list over the batch.
    images = [[img], []] if arch == "idefics3" else [img]
    batch = processor(text=texts, images=images, padding=True, return_tensors="pt")
    mask = batch["attention_mask"]
    lengths = mask.sum(dim=1)
    assert lengths[0] != lengths[1], "the two prompts should differ in length so that padding happens"
    assert bool(mask[:, -1].all()), "padding must be on the left"
    short = int(lengths.argmin())
    assert not bool(mask[short, 0])

    singles = [
        processor(text=[texts[0]], images=[img], return_tensors="pt"),
        processor(text=[texts[1]], return_tensors="pt"),
    ]
    with torch.no_grad():
        batched_logits = model(**batch).logits[:, -1]
        for row, single in enumerate(singles):
            alone = model(**single).logits[0, -1]
            torch.testing.assert_close(batched_logits[row], alone, atol=1e-4, rtol=1e-4)

    max_new = 6
    out = model.generate(
        **batch, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, suppress_tokens=[image_id]
    )
    new_ids = out[:, batch["input_ids"].shape[1] :]
    assert new_ids.shape == (2, max_new)
    assert not bool((new_ids == image_id).any())


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "idefics3"])  # the two tokenizer families
def test_vocabulary_is_cheap(arch):
    tok = tiny._build_tokenizer(arch, tiny._chat_template(arch), model_max_length=8192)
    assert len(tok) < 600
    for text in [" A", " B", " C", " D", "<think>", "</think>"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == 1, (text, tok.convert_ids_to_tokens(ids))
    words = [
        *tiny.COLOURS,
        *tiny.SHAPES,
        "colour",
        "color",
        "shape",
        "shapes",
        "many",
        "are",
        "in",
        "the",
        "image",
    ]
    for word in words:
        assert len(tok.encode(" " + word, add_special_tokens=False)) == 1, word
    for text in ["What", "How", "Answer", *"0123456789"]:
        assert len(tok.encode(text, add_special_tokens=False)) == 1, text
    # "<think>" must survive skip_special_tokens: the format reward reads it from decoded text.
    completion = "<think>The circle is red.</think>\nAnswer: A"
    ids = tok.encode(completion, add_special_tokens=False)
    assert len(ids) <= 12
    assert tok.decode(ids, skip_special_tokens=True) == completion
    assert tok.decode(tok.encode(SYSTEM_PROMPT, add_special_tokens=False)) == SYSTEM_PROMPT


def test_same_seed_same_model_and_tokenizer(tmp_path):
    rng_before = torch.random.get_rng_state()
    model_a, proc_a = build_tiny_vlm("qwen2_5_vl", seed=3)
    model_b, _ = build_tiny_vlm("qwen2_5_vl", seed=3)
    model_c, _ = build_tiny_vlm("qwen2_5_vl", seed=4)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "building must not consume the global RNG"

    sd_a, sd_b, sd_c = model_a.state_dict(), model_b.state_dict(), model_c.state_dict()
    assert sd_a.keys() == sd_b.keys()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    assert not all(torch.equal(sd_a[k], sd_c[k]) for k in sd_a)

    dirs = [save_tiny_vlm("qwen2_5_vl", tmp_path / name, seed=3) for name in ("a", "b")]
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "processor_config.json"):
        assert (dirs[0] / name).read_bytes() == (dirs[1] / name).read_bytes(), name


def test_bigger_qwen_sizes_for_benchmarks():
    """The benchmark shape: 8 layers, hidden 256, 8 heads, and 16 image tokens per 112x112 image."""
    model, processor = build_tiny_vlm(
        "qwen2_5_vl", num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=2, intermediate_size=512,
        vision_hidden_size=64, vision_num_heads=4, max_pixels=16 * 28 * 28,
    )  # fmt: skip
    text_config = model.config.text_config
    assert text_config.num_hidden_layers == 8 and text_config.hidden_size == 256
    assert sum(text_config.rope_parameters["mrope_section"]) == (256 // 8) // 2
    text = _prompt(processor, "What colour is the shape?", with_image=True)
    inputs = processor(text=[text], images=[_image(side=112)], return_tensors="pt")
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 16
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], len(processor.tokenizer))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("head_dim", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_section_fits_head_dim(arch, head_dim):
    section = tiny.mrope_section(arch, head_dim)
    assert sum(section) == head_dim // 2
    assert min(section) >= 1
    if arch == "qwen2_5_vl" and head_dim == 128:
        assert section == [16, 24, 24]  # the real Qwen2.5-VL split
    if arch == "qwen3_vl" and head_dim == 128:
        assert section == [24, 20, 20]  # the real Qwen3-VL split


@pytest.mark.parametrize(
    ("arch", "overrides", "message"),
    [
        ("llava_1_5", {}, "unknown tiny VLM arch 'llava_1_5'.*qwen2_5_vl, qwen2_vl, qwen3_vl, idefics3"),
        ("qwen2_5_vl", {"hidden_size": 65}, "not divisible by num_heads"),
        ("qwen2_5_vl", {"num_heads": 4, "num_kv_heads": 3}, "not divisible by num_kv_heads"),
        ("qwen2_5_vl", {"hidden_size": 16, "num_heads": 4}, "head_dim"),
        ("qwen2_5_vl", {"vision_hidden_size": 24, "vision_num_heads": 4}, "multiple of 4"),
        ("qwen2_vl", {"vision_intermediate_size": 48}, "mlp_ratio"),
        ("qwen2_5_vl", {"max_pixels": 100}, "min_pixels <= max_pixels"),
        ("qwen2_5_vl", {"num_layer": 3}, "unknown size knob.*num_layer"),
        ("qwen2_5_vl", {"num_layers": 0}, "positive integer"),
        ("idefics3", {"min_pixels": 784}, "Qwen archs only"),
        ("qwen3_vl", {"image_size": 64}, r"image_size applies to gemma3, llava_next, idefics3, smolvlm\b.* only"),
        ("idefics3", {"image_size": 40}, "pixel-shuffle"),
    ],
)
def test_invalid_requests_raise_value_error(arch, overrides, message):
    with pytest.raises(ValueError, match=message):
        build_tiny_vlm(arch, **overrides)


def test_save_refuses_non_empty_dir_unless_overwrite(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(FileExistsError, match="overwrite"):
        save_tiny_vlm("qwen2_5_vl", out)
    assert (out / "stale.txt").exists()

    save_tiny_vlm("qwen2_5_vl", out, overwrite=True, num_layers=1)
    assert not (out / "stale.txt").exists()
    assert json.loads((out / "tiny_vlm.json").read_text())["size"]["num_layers"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"], "temporary folders were left behind"


def test_cli_writes_a_reloadable_model(tmp_path, tiny_vlm_dir):
    out = tmp_path / "cli-model"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "fixtures.tiny", "--arch", "qwen2_5_vl", "--out", str(out), "--num_layers", "3"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "processor_config.json",
        "chat_template.jinja",
    ):
        assert (out / name).is_file(), name
    meta = json.loads((out / "tiny_vlm.json").read_text())
    assert f"{meta['num_params']:,} parameters" in result.stdout and str(out) in result.stdout
    assert json.loads((out / "config.json").read_text())["text_config"]["num_hidden_layers"] == 3

    # Built in another process, the same (arch, seed, sizes) must give byte-identical weights and
    # tokenizer: the BPE trainer and the weight init must not depend on per-process hash seeds.
    same = tiny_vlm_dir("qwen2_5_vl", num_layers=3)
    for name in ("tokenizer.json", "model.safetensors"):
        assert (out / name).read_bytes() == (same / name).read_bytes(), name


def test_cli_rejects_unknown_arch_and_bad_sizes(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tiny.main(["--arch", "llava_1_5", "--out", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "llava_1_5" in err and all(arch in err for arch in TINY_ARCHS)

    assert tiny.main(["--arch", "qwen2_5_vl", "--out", str(tmp_path / "y"), "--hidden_size", "65"]) == 2
    assert "num_heads" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()


def test_text_models_save_reload_generate_and_score(tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from fixtures.tiny import save_tiny_text_model

    lm_dir = save_tiny_text_model(tmp_path / "lm", "causal_lm", seed=1)
    rm_dir = save_tiny_text_model(tmp_path / "rm", "sequence_classification", seed=1)
    lm, rm = (
        AutoModelForCausalLM.from_pretrained(lm_dir),
        AutoModelForSequenceClassification.from_pretrained(rm_dir),
    )
    tok = AutoTokenizer.from_pretrained(lm_dir)
    assert type(lm).__name__ == "Qwen2ForCausalLM" and type(rm).__name__ == "Qwen2ForSequenceClassification"
    assert type(tok).__name__ == "Qwen2Tokenizer" and tok.padding_side == "left"
    assert 10_000 < lm.num_parameters() < 1_000_000 and rm.config.num_labels == 1
    assert rm.config.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert json.loads((rm_dir / "tiny_text_model.json").read_text())["task"] == "sequence_classification"

    # The folder reloads to what was built, tokenizer included.
    built_lm, built_tok = build_tiny_text_model("causal_lm", seed=1)
    assert all(torch.equal(v, lm.state_dict()[k]) for k, v in built_lm.state_dict().items())
    assert type(built_tok).__name__ == "Qwen2Tokenizer"

    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in ("Red?", "What colour is the circle in the image? Answer: A")
    ]
    assert prompts[0].startswith("<|im_start|>system\n") and prompts[0].endswith("<|im_start|>assistant\n")
    assert built_tok(prompts)["input_ids"] == tok(prompts)["input_ids"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    assert not batch["attention_mask"][0, 0] and batch["attention_mask"][:, -1].all()

    out = lm.generate(**batch, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape == (2, batch["input_ids"].shape[1] + 5)
    with torch.no_grad():
        scores = rm(**batch).logits
        assert scores.shape == (2, 1) and torch.isfinite(scores).all()
        for row, prompt in enumerate(prompts):  # the score reads each row's last real token
            torch.testing.assert_close(scores[row], rm(**tok([prompt], return_tensors="pt")).logits[0])
    assert not torch.allclose(scores[0], scores[1])


def test_text_model_checks_and_cli(tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown tiny text model task"):
        build_tiny_text_model("reward")
    with pytest.raises(ValueError, match="unknown text model size knob.*vision_depth"):
        build_tiny_text_model(vision_depth=2)
    a, _ = build_tiny_text_model("sequence_classification", seed=0, num_layers=1)
    b, _ = build_tiny_text_model("sequence_classification", seed=0, num_layers=1)
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())

    with pytest.raises(SystemExit) as exit_info:  # every size flag's help renders
        tiny.main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--full_attention_interval" in help_text and "--num_experts_per_tok" in help_text

    out = tmp_path / "reward"
    assert tiny.main(["--text_task", "sequence_classification", "--out", str(out), "--num_layers", "1"]) == 0
    assert "parameters" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    assert tiny.main(["--text_task", "causal_lm", "--out", str(tmp_path / "x"), "--vision_depth", "1"]) == 2
    assert "vision_depth" in capsys.readouterr().err and not (tmp_path / "x").exists()

    out = tmp_path / "gemma"
    assert tiny.main(["--arch", "gemma3", "--out", str(out), "--sliding_window", "8"]) == 0
    assert json.loads((out / "config.json").read_text())["text_config"]["sliding_window"] == 8
    with pytest.raises(SystemExit):  # --arch and --text_task exclude each other
        tiny.main(["--arch", "gemma3", "--text_task", "causal_lm", "--out", str(tmp_path / "y")])
