"""Tiny offline Qwen3.5, Gemma 3 and LLaVA-NeXT VLMs, and the tiny text-only Qwen2 models.

Build, save, reload through the Auto classes, count image tokens, run a left-padded batch forward and
a short generate, stay deterministic; the hybrid archs' layer layouts and Gemma 3's sliding window.
"""

import json

import pytest
import torch
from PIL import Image
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoProcessor,
    AutoTokenizer,
)

from trl_mdi import tiny
from trl_mdi.tiny import (
    SYSTEM_PROMPT,
    TINY_ARCHS,
    build_tiny_text_model,
    build_tiny_vlm,
    save_tiny_text_model,
)

FAMILIES = ("qwen3_5", "gemma3", "llava_next")
EXPECTED = {
    # arch: (model class, processor class, image placeholder token, image tokens per square image)
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "Qwen3VLProcessor", "<|image_pad|>", 4),
    "gemma3": ("Gemma3ForConditionalGeneration", "Gemma3Processor", "<image_soft_token>", 4),
    "llava_next": ("LlavaNextForConditionalGeneration", "LlavaNextProcessor", "<image>", 10),
}
# What each official template writes around the generation prompt.
TEMPLATE_MARKS = {
    "qwen3_5": (
        "<|vision_start|><|image_pad|><|vision_end|>",
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    ),
    "gemma3": ("<bos><start_of_turn>user\n<start_of_image>", "<end_of_turn>\n<start_of_turn>model\n"),
    "llava_next": ("[INST] <image>\n", " [/INST]"),
}
QUESTION = "What colour is the circle?"


def _messages(with_system: bool):
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
    system = {"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}
    return [system, user] if with_system else [user]


def _image(side: int, colour=(255, 0, 0)) -> Image.Image:
    return Image.new("RGB", (side, side), colour)


def _load(path):
    return AutoModelForImageTextToText.from_pretrained(path), AutoProcessor.from_pretrained(path)


def test_tiny_archs_lists_the_new_families():
    assert TINY_ARCHS[:4] == ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "smolvlm")  # the old order is kept
    assert set(FAMILIES) <= set(TINY_ARCHS)


@pytest.mark.parametrize("arch", FAMILIES)
def test_build_save_reload_batch_forward_generate(arch, tiny_vlm_dir):
    model_cls, processor_cls, image_token, tokens_per_image = EXPECTED[arch]
    path = tiny_vlm_dir(arch)
    model, processor = _load(path)
    assert type(model).__name__ == model_cls and type(processor).__name__ == processor_cls
    assert 100_000 < model.num_parameters() < 1_000_000
    assert model.num_parameters() == json.loads((path / "tiny_vlm.json").read_text())["num_params"]
    assert model.dtype == torch.float32 and model.config._attn_implementation == "sdpa"
    tok = processor.tokenizer
    assert tok.padding_side == "left" and tok.pad_token_id is not None and tok.eos_token_id is not None
    image_id = tok.convert_tokens_to_ids(image_token)
    assert image_id != tok.unk_token_id
    assert model.config.image_token_id == image_id
    if arch == "llava_next":
        assert model.config.image_token_index == image_id

    texts = [processor.apply_chat_template(_messages(s), add_generation_prompt=True) for s in (False, True)]
    start, end = TEMPLATE_MARKS[arch]
    assert start in texts[0] and texts[0].endswith(end)
    assert SYSTEM_PROMPT in texts[1]

    images = [[_image(56)], [_image(64, (0, 0, 255))]]
    batch = processor(text=texts, images=images, return_tensors="pt", padding=True, padding_side="left")
    mask = batch["attention_mask"]
    assert mask[0].sum() < mask[1].sum(), "the row without a system prompt is shorter, so it gets padded"
    assert not mask[0, 0] and mask[:, -1].all(), "padding must be on the left"
    said = processor._get_num_multimodal_tokens(image_sizes=[[56, 56], [64, 64]]).num_image_tokens
    assert said == [tokens_per_image] * 2
    assert (batch["input_ids"] == model.config.image_token_id).sum(dim=1).tolist() == said
    if arch == "gemma3":  # the processor's image_token_id is the begin-of-image token, one per image
        assert processor.image_token_id == tok.convert_tokens_to_ids("<start_of_image>") != image_id
        assert (batch["input_ids"] == processor.image_token_id).sum(dim=1).tolist() == [1, 1]

    # The folder's processor tokenizes exactly like the one the model was built with.
    _, built_processor = build_tiny_vlm(arch)
    rebuilt = built_processor(
        text=texts, images=images, return_tensors="pt", padding=True, padding_side="left"
    )
    assert torch.equal(rebuilt["input_ids"], batch["input_ids"])

    with torch.no_grad():
        logits = model(**batch).logits
        assert logits.shape == (2, batch["input_ids"].shape[1], len(tok))
        assert torch.isfinite(logits).all()
        for row in range(2):  # left padding changes nothing: each row matches its unpadded run
            alone = processor(text=[texts[row]], images=[images[row]], return_tensors="pt")
            torch.testing.assert_close(logits[row, -1], model(**alone).logits[0, -1], atol=1e-4, rtol=1e-4)

    torch.manual_seed(0)
    out = model.generate(**batch, max_new_tokens=4, do_sample=True)
    prompt_len = batch["input_ids"].shape[1]
    assert torch.equal(out[:, :prompt_len], batch["input_ids"])
    assert 1 <= out.shape[1] - prompt_len <= 4


@pytest.mark.parametrize("arch", FAMILIES)
def test_same_seed_same_weights(arch):
    rng_before = torch.random.get_rng_state()
    sd_a, sd_b, sd_c = (build_tiny_vlm(arch, seed=s)[0].state_dict() for s in (3, 3, 4))
    assert torch.equal(torch.random.get_rng_state(), rng_before), "building must not consume the global RNG"
    assert sd_a.keys() == sd_b.keys()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    assert not all(torch.equal(sd_a[k], sd_c[k]) for k in sd_a)


def test_qwen3_5_layer_types_mix_linear_and_full_attention():
    model, _ = build_tiny_vlm("qwen3_5")
    text_config = model.config.text_config
    assert text_config.layer_types == ["linear_attention", "full_attention"] * 2
    layers = model.model.language_model.layers
    assert [hasattr(layer, "linear_attn") for layer in layers] == [True, False, True, False]
    rope = text_config.rope_parameters  # tiny heads (16): half the head rotates, in 3 interleaved sections
    assert rope["partial_rotary_factor"] == 0.5 and rope["mrope_section"] == [2, 1, 1]

    model, _ = build_tiny_vlm("qwen3_5", num_layers=6, full_attention_interval=3)
    linear, full = "linear_attention", "full_attention"
    assert model.config.text_config.layer_types == [linear, linear, full] * 2

    # No full-attention layer at all is allowed (so callers can test how they handle it), and it runs
    # without a cache. (With one, i.e. model(...) in eval mode by default or generate, transformers 5.23
    # raises "`get_seq_length` can only be called on Attention layers": its hybrid cache needs one.)
    model, processor = build_tiny_vlm("qwen3_5", full_attention_interval=5)
    assert model.config.text_config.layer_types == ["linear_attention"] * 4
    assert all(hasattr(layer, "linear_attn") for layer in model.model.language_model.layers)
    text = processor.apply_chat_template(_messages(False), add_generation_prompt=True)
    with torch.no_grad():
        out = model(**processor(text=[text], images=[[_image(64)]], return_tensors="pt"), use_cache=False)
    assert torch.isfinite(out.logits).all()


def test_qwen3_5_rope_matches_the_real_split_at_head_dim_256():
    rope = tiny.families.qwen3_5_rope(256)
    assert rope["partial_rotary_factor"] == 0.25 and rope["mrope_section"] == [11, 11, 10]
    for head_dim in (8, 10, 16, 24, 32, 64):
        rope = tiny.families.qwen3_5_rope(head_dim)
        assert sum(rope["mrope_section"]) == int(head_dim * rope["partial_rotary_factor"]) // 2
        assert min(rope["mrope_section"]) >= 1


def test_gemma3_layer_types_and_sliding_window(tiny_vlm_dir):
    model, processor = _load(tiny_vlm_dir("gemma3", sliding_window=8))
    text_config = model.config.text_config
    assert text_config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert text_config.sliding_window == 8  # survives save + reload (no bidirectional halving)
    assert build_tiny_vlm("gemma3")[0].config.text_config.sliding_window == 512
    every_third, _ = build_tiny_vlm("gemma3", num_layers=6, full_attention_interval=3)
    sliding, full = "sliding_attention", "full_attention"
    assert every_third.config.text_config.layer_types == [sliding, sliding, full] * 2

    # The window is live: with the same weights, a prompt longer than 8 tokens gives other logits with
    # window 8 than with window 512; a prompt of at most 8 tokens gives the same ones.
    wide, _ = build_tiny_vlm("gemma3")
    text = processor.apply_chat_template(_messages(True), add_generation_prompt=True)
    long_inputs = processor(text=[text], images=[[_image(64)]], return_tensors="pt")
    assert long_inputs["input_ids"].shape[1] > 8
    short_ids = processor.tokenizer(" red circle", return_tensors="pt")
    assert short_ids["input_ids"].shape[1] <= 8
    with torch.no_grad():
        assert not torch.allclose(model(**long_inputs).logits[0, -1], wide(**long_inputs).logits[0, -1])
        torch.testing.assert_close(model(**short_ids).logits, wide(**short_ids).logits)


def test_llava_next_non_square_image_costs_what_the_processor_says(tiny_vlm_dir):
    model, processor = _load(tiny_vlm_dir("llava_next"))
    text = processor.apply_chat_template(_messages(False), add_generation_prompt=True)
    wide = Image.new("RGB", (64, 32), (0, 255, 0))  # two tiles side by side
    inputs = processor(text=[text], images=[[wide]], return_tensors="pt")
    expected = processor._get_num_multimodal_tokens(image_sizes=[[32, 64]]).num_image_tokens[0]
    assert expected > EXPECTED["llava_next"][3]
    assert int((inputs["input_ids"] == model.config.image_token_index).sum()) == expected
    assert inputs["pixel_values"].shape == (1, 3, 3, 32, 32)  # base view + 2 tiles
    assert inputs["input_ids"][0, 0] == processor.tokenizer.bos_token_id  # <s> added, as Llama tokenizers do
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).logits).all()


@pytest.mark.parametrize(
    ("arch", "overrides", "message"),
    [
        ("qwen2_5_vl", {"full_attention_interval": 2}, "applies to qwen3_5 and gemma3 only"),
        ("qwen3_5", {"sliding_window": 8}, "sliding_window applies to gemma3 only"),
        ("qwen3_5", {"full_attention_interval": 0}, "positive integer"),
        ("gemma3", {"sliding_window": -1}, "positive integer"),
        ("gemma3", {"image_size": 40}, "pooling"),
        ("gemma3", {"min_pixels": 1024}, "Qwen archs only"),
        ("llava_next", {"image_size": 40}, "not a multiple of image_patch_size"),
        ("qwen3_5", {"image_size": 32}, "gemma3, llava_next and smolvlm only"),
    ],
)
def test_invalid_family_requests_raise_value_error(arch, overrides, message):
    with pytest.raises(ValueError, match=message):
        build_tiny_vlm(arch, **overrides)


def test_text_models_save_reload_generate_and_score(tmp_path):
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
    assert "--full_attention_interval" in capsys.readouterr().out

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
