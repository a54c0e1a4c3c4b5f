"""Tiny offline Qwen3.5 (dense and MoE), Gemma 3, LLaVA-NeXT, Gemma 4, SmolVLM (its own class), LLaVA 1.5,
LLaVA-OneVision and InternVL VLMs (the first four archs and the text-only models: test_tiny.py).

Build, save, reload through the Auto classes, count image tokens, run a left-padded batch forward and
a short generate (also with a row without image), stay deterministic; the hybrid archs' layer layouts,
Qwen3.5-MoE's experts, Gemma 3's and Gemma 4's sliding window, and the attention facts the probe relies on.
"""

import json

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from fixtures import tiny
from fixtures.tiny import SYSTEM_PROMPT, TINY_ARCHS, build_tiny_vlm
from trl_mdi.attention.model_facts import model_facts

FAMILIES = TINY_ARCHS[4:]  # the first four (the Qwen VLs, Idefics3) are tests/test_tiny.py's
assert set(TINY_ARCHS[:4]) == {"qwen2_5_vl", "qwen2_vl", "qwen3_vl", "idefics3"}
EXPECTED = {
    # arch: (model class, processor class, image placeholder token, image tokens per square image)
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "Qwen3VLProcessor", "<|image_pad|>", 4),
    "gemma3": ("Gemma3ForConditionalGeneration", "Gemma3Processor", "<image_soft_token>", 4),
    "llava_next": ("LlavaNextForConditionalGeneration", "LlavaNextProcessor", "<image>", 10),
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "Qwen3VLProcessor", "<|image_pad|>", 4),
    # Gemma4ImageProcessor's smallest budget is 70 soft tokens: any square image becomes an 8 x 8 grid.
    "gemma4": ("Gemma4ForConditionalGeneration", "Gemma4Processor", "<|image|>", 64),
    "smolvlm": ("SmolVLMForConditionalGeneration", "SmolVLMProcessor", "<image>", 4),
    "llava": ("LlavaForConditionalGeneration", "LlavaProcessor", "<image>", 16),  # a 4 x 4 grid
    "llava_onevision": ("LlavaOnevisionForConditionalGeneration", "LlavaOnevisionProcessor", "<image>", 10),
    # 2 x 2 tiles + a thumbnail, 4 tokens each (the processor also counts <img> and </img>: 22).
    "internvl": ("InternVLForConditionalGeneration", "InternVLProcessor", "<IMG_CONTEXT>", 20),
}
EXPECTED |= {
    "glm4v": ("Glm4vForConditionalGeneration", "Glm4vProcessor", "<|image|>", 4),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", "Qwen3VLProcessor", "<|image_pad|>", 4),
    # Two rows of two [IMG] tokens: [IMG] [IMG] [IMG_BREAK] [IMG] [IMG] [IMG_END].
    "mistral3": ("Mistral3ForConditionalGeneration", "PixtralProcessor", "[IMG]", 4),
}
EXPECTED |= {  # issue 45: the families users train first
    "lfm2_vl": ("Lfm2VlForConditionalGeneration", "Lfm2VlProcessor", "<image>", 4),  # 2 x 2, in <|image_start|> ... <|image_end|>
    "paligemma": ("PaliGemmaForConditionalGeneration", "PaliGemmaProcessor", "<image>", 4),  # 2 x 2 SigLIP patches
    "glm4v_moe": ("Glm4vMoeForConditionalGeneration", "Glm4vProcessor", "<|image|>", 4),  # GLM-4.1V's processor
    # 2 x 2 tiles + a global view, 4 tokens each (the processor also counts <|START_OF_IMG|>, <|END_OF_IMG|>,
    # TILE_GLOBAL and the four TILE_<i> labels: 27).
    "aya_vision": ("AyaVisionForConditionalGeneration", "AyaVisionProcessor", "<|IMG_PATCH|>", 20),
    # MobileNet-v5's fusion adapter set to a 2 x 2 grid, between <start_of_image> and <end_of_image>.
    "gemma3n": ("Gemma3nForConditionalGeneration", "Gemma3nProcessor", "<image_soft_token>", 4),
    # 4 x 4 ViT patches folded 2 x 2, in <IMG_START> ... <IMG_GRID> <IMG_END>
    "ovis2": ("Ovis2ForConditionalGeneration", "Ovis2Processor", "<IMG_ATOM>", 4),
}
# Gemma 3n's timm tower is the real MobileNet-v5 at full depth, and timm fixes its adapter's output at 2048 channels:
# about 4.1M parameters (fixtures/tiny/gemma3n_family.py says why it cannot be shallower).
MAX_PARAMETERS = {"gemma3n": 5_000_000}
# Gemma 2's soft-capped attention (PaliGemma 2's decoder) has no SDPA kernel: transformers loads it eager.
ATTN_IMPLEMENTATION = {"paligemma": "eager"}
# Tokens the processor counts per image besides the placeholder (InternVL: <img> and </img>; Mistral 3: its row
# markers).
EXTRA_COUNTED = {"internvl": 2, "mistral3": 2, "aya_vision": 7}  # Mistral 3: [IMG_BREAK] and [IMG_END]
# What each official template writes around the generation prompt.
TEMPLATE_MARKS = {
    "qwen3_5": (
        "<|vision_start|><|image_pad|><|vision_end|>",
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    ),
    "gemma3": ("<bos><start_of_turn>user\n<start_of_image>", "<end_of_turn>\n<start_of_turn>model\n"),
    "llava_next": ("[INST] <image>\n", " [/INST]"),
    "gemma4": ("<bos><|turn>user\n<|image|>", "<turn|>\n<|turn>model\n"),
    "smolvlm": ("<|im_start|>User:<image>What", "<end_of_utterance>\nAssistant:"),
    "llava": ("USER: <image>\nWhat", "? ASSISTANT:"),
    "llava_onevision": ("<|im_start|>user\n<image>\nWhat", "<|im_end|>\n<|im_start|>assistant\n"),
    "internvl": ("<|im_start|>user\n<IMG_CONTEXT>\nWhat", "<|im_end|>\n<|im_start|>assistant\n"),
}
TEMPLATE_MARKS["qwen3_5_moe"] = TEMPLATE_MARKS["qwen3_5"]
TEMPLATE_MARKS |= {
    "glm4v": ("[gMASK]<sop><|user|>\n<|begin_of_image|><|image|><|end_of_image|>", "<|assistant|>\n"),
    "qwen3_vl_moe": ("<|vision_start|><|image_pad|><|vision_end|>", "<|im_end|>\n<|im_start|>assistant\n"),
    "mistral3": ("[/SYSTEM_PROMPT][INST][IMG]", "[/INST]"),
}
TEMPLATE_MARKS |= {
    "lfm2_vl": ("<|startoftext|><|im_start|>user\n<image>What", "<|im_end|>\n<|im_start|>assistant\n"),
    # No roles: the images, then the text (the processor adds <bos> after the last image and the closing newline).
    "paligemma": ("<image>What colour", "circle?"),
    "gemma3n": ("<bos><start_of_turn>user\n<image_soft_token>What", "<end_of_turn>\n<start_of_turn>model\n"),
    # The converted checkpoints' template: a fixed system turn first, then ChatML with "<image>\n" per image.
    "ovis2": ("<|im_start|>user\n<image>\nWhat", "<|im_end|>\n<|im_start|>assistant\n"),
}
TEMPLATE_MARKS["glm4v_moe"] = TEMPLATE_MARKS["glm4v"]  # GLM-4.1V's template (chat_templates/SOURCES.md)
TEMPLATE_MARKS["aya_vision"] = ("<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|><image>What",
                                "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
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
    assert TINY_ARCHS[:4] == ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "idefics3")  # the old order is kept
    assert TINY_ARCHS[4:] == FAMILIES  # each later family appended after the earlier ones


@pytest.mark.parametrize("arch", FAMILIES)
def test_build_save_reload_batch_forward_generate(arch, tiny_vlm_dir):
    model_cls, processor_cls, image_token, tokens_per_image = EXPECTED[arch]
    path = tiny_vlm_dir(arch)
    model, processor = _load(path)
    assert type(model).__name__ == model_cls and type(processor).__name__ == processor_cls
    assert 100_000 < model.num_parameters() < MAX_PARAMETERS.get(arch, 1_000_000)
    assert model.num_parameters() == json.loads((path / "tiny_vlm.json").read_text())["num_params"]
    attn = model.config.get_text_config()._attn_implementation
    assert model.dtype == torch.float32 and attn == ATTN_IMPLEMENTATION.get(arch, "sdpa")
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
    if arch in ("glm4v", "glm4v_moe"):  # GLM-4.1V's template prints a typed system message as the list's repr (docs)
        assert "<|system|>\n[{'type': 'text', 'text': " in texts[1]
    else:
        assert SYSTEM_PROMPT in texts[1]
    if arch == "mistral3":  # no system message: the template writes Mistral Small's default one, dated today
        assert texts[0].startswith("<s>[SYSTEM_PROMPT]You are Mistral Small 3") and SYSTEM_PROMPT not in texts[0]

    images = [[_image(56)], [_image(64, (0, 0, 255))]]
    batch = processor(text=texts, images=images, return_tensors="pt", padding=True, padding_side="left")
    mask = batch["attention_mask"]
    short = 1 if arch == "mistral3" else 0  # Mistral 3's default system message is longer than ours
    assert mask[short].sum() < mask[1 - short].sum(), "the row with the shorter system turn gets padded"
    assert not mask[short, 0] and mask[:, -1].all(), "padding must be on the left"
    if arch == "mistral3":  # the processor counts the row markers too: one [IMG_BREAK] and one [IMG_END] per image
        for marker in ("[IMG_BREAK]", "[IMG_END]"):
            assert (batch["input_ids"] == tok.convert_tokens_to_ids(marker)).sum(dim=1).tolist() == [1, 1]
    if hasattr(processor, "_get_num_multimodal_tokens"):  # SmolVLMProcessor has no such method
        said = processor._get_num_multimodal_tokens(image_sizes=[[56, 56], [64, 64]]).num_image_tokens
        assert said == [tokens_per_image + EXTRA_COUNTED.get(arch, 0)] * 2
    assert (batch["input_ids"] == model.config.image_token_id).sum(dim=1).tolist() == [tokens_per_image] * 2
    if arch == "gemma3":  # the processor's image_token_id is the begin-of-image token, one per image
        assert processor.image_token_id == tok.convert_tokens_to_ids("<start_of_image>") != image_id
        assert (batch["input_ids"] == processor.image_token_id).sum(dim=1).tolist() == [1, 1]
    if arch == "gemma4":  # the placeholder is the soft token itself, wrapped in <|image> ... <image|>
        assert processor.image_token_id == image_id
        assert (batch["input_ids"] == tok.convert_tokens_to_ids("<|image>")).sum(dim=1).tolist() == [1, 1]
        assert torch.equal(batch["mm_token_type_ids"] == 1, batch["input_ids"] == image_id)

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

    # A row without image (images=[[img], []]) works too, and matches its run with no image in the batch.
    texts[1] = processor.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True
    )
    if model_facts(model.config).image_in_every_prompt:  # PaliGemma: refused by the processor (the trainer says so)
        with pytest.raises(ValueError, match="`images` are expected"):
            processor(text=texts[1:], return_tensors="pt")
        return
    mixed = processor(
        text=texts, images=[images[0], []], return_tensors="pt", padding=True, padding_side="left"
    )
    assert (mixed["input_ids"] == image_id).sum(dim=1).tolist() == [tokens_per_image, 0]
    with torch.no_grad():
        alone = model(**processor(text=texts[1:], return_tensors="pt")).logits[0, -1]
        torch.testing.assert_close(model(**mixed).logits[1, -1], alone, atol=1e-4, rtol=1e-4)
    assert model.generate(**mixed, max_new_tokens=4, do_sample=True).shape[0] == 2


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


def test_qwen3_5_moe_layers_and_experts():
    model, processor = build_tiny_vlm("qwen3_5_moe")
    assert model.config.text_config.layer_types == ["linear_attention", "full_attention"] * 2
    assert model.config.text_config.rope_parameters == tiny.families.qwen3_5_rope(16)  # qwen3_5's tiny RoPE
    for layer in model.model.language_model.layers:  # every layer's MLP: 4 routed experts + 1 shared, 32 wide
        assert layer.mlp.experts.gate_up_proj.shape == (4, 2 * 32, 64) and layer.mlp.gate.top_k == 2
        assert layer.mlp.shared_expert.down_proj.in_features == 32
    text = processor.apply_chat_template(_messages(False), add_generation_prompt=True)
    inputs = processor(text=[text], images=[[_image(64)]], return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs, output_router_logits=True)
    assert len(out.router_logits) == 4 and out.router_logits[0].shape == (inputs["input_ids"].shape[1], 4)
    assert torch.isfinite(out.aux_loss)  # the load-balancing loss trainers may add

    layers = build_tiny_vlm(
        "qwen3_5_moe",
        num_layers=6,
        full_attention_interval=3,
        num_experts=8,
        num_experts_per_tok=1,
        moe_intermediate_size=16,
    )[0].model.language_model.layers
    assert [hasattr(layer, "linear_attn") for layer in layers] == [True, True, False] * 2
    assert layers[0].mlp.experts.down_proj.shape == (8, 64, 16) and layers[0].mlp.gate.top_k == 1


def test_gemma4_layer_types_and_sliding_window(tiny_vlm_dir):
    model, processor = _load(tiny_vlm_dir("gemma4", sliding_window=8))
    sliding, full = "sliding_attention", "full_attention"
    assert model.config.text_config.layer_types == [sliding, full] * 2
    assert model.config.text_config.sliding_window == 8  # survives save + reload
    assert model.config.text_config.use_bidirectional_attention is None  # causal over images, as E2B/E4B
    # Full-attention layers have heads twice as wide, as the real models (512 vs 256).
    assert [layer.self_attn.head_dim for layer in model.model.language_model.layers] == [16, 32, 16, 32]
    every_third, _ = build_tiny_vlm("gemma4", num_layers=6, full_attention_interval=3)
    assert every_third.config.text_config.layer_types == [sliding, sliding, full] * 2

    # The window is live, as for Gemma 3: same weights, window 8 vs 512, long prompt differs, short does not.
    wide, _ = build_tiny_vlm("gemma4")
    text = processor.apply_chat_template(_messages(True), add_generation_prompt=True)
    long_inputs = processor(text=[text], images=[[_image(64)]], return_tensors="pt")
    short_ids = processor.tokenizer(" red circle", return_tensors="pt")
    assert short_ids["input_ids"].shape[1] <= 8 < long_inputs["input_ids"].shape[1]
    with torch.no_grad():
        assert not torch.allclose(model(**long_inputs).logits[0, -1], wide(**long_inputs).logits[0, -1])
        torch.testing.assert_close(model(**short_ids).logits, wide(**short_ids).logits)

    # Images keep their aspect ratio within the 70-token budget: a 2:1 image gets a 5 x 11 grid.
    inputs = processor(text=[text], images=[[Image.new("RGB", (64, 32))]], return_tensors="pt")
    assert processor._get_num_multimodal_tokens(image_sizes=[[32, 64]]).num_image_tokens == [55]
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 55
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).logits).all()


def test_lfm2_vl_conv_layers_and_tiles(tiny_vlm_dir):
    """LFM2-VL's decoder mixes gated short convolutions (no attention weights) with full attention; an image far over
    its token budget is tiled as the real processor tiles it (a marker per tile, a thumbnail), and gets no map."""
    from trl_mdi.diagnostics.maps import image_token_grids

    model, processor = _load(tiny_vlm_dir("lfm2_vl"))
    assert model.config.text_config.layer_types == ["conv", "full_attention"] * 2
    assert [layer.is_attention_layer for layer in model.model.language_model.layers] == [False, True, False, True]
    text = processor.apply_chat_template(_messages(False), add_generation_prompt=True)
    inputs = processor(text=[text], images=[[_image(256)]], return_tensors="pt")
    tokens = processor.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0].tolist())
    assert [t for t in tokens if t.startswith("<|img_")] == [
        "<|img_row_1_col_1|>", "<|img_row_1_col_2|>", "<|img_row_2_col_1|>", "<|img_row_2_col_2|>", "<|img_thumbnail|>"]
    assert tokens.count("<image>") == 5 * 4 and inputs["pixel_values"].shape[0] == 5  # 2 x 2 tiles + the thumbnail
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).logits).all()
    # One view within the budget: a row-major grid (spatial_shapes / 2); a tiled image: no map.
    assert image_token_grids(processor, [_image(56), Image.new("RGB", (112, 56))]) == [(2, 2), (1, 2)]
    assert image_token_grids(processor, [_image(56), _image(256)]) is None


def test_paligemma_prefix_is_bidirectional_and_its_suffix_causal(tiny_vlm_dir):
    """PaliGemma 2's layout: Gemma 2 layers alternating sliding and full attention with soft-capped logits; the prefix
    (token_type_ids 0: image, <bos>, prompt, newline) attends bidirectionally, the suffix (1: what it generates)
    causally. With TRL 1.16's zeros over the completion, completion tokens would see the ones after them: the
    trainer gives them 1 (``ModelFacts.completion_token_type``)."""
    model, processor = _load(tiny_vlm_dir("paligemma"))
    text = model.config.text_config
    assert text.layer_types == ["sliding_attention", "full_attention"] * 2 and text.use_bidirectional_attention
    assert (text.attn_logit_softcapping, text.final_logit_softcapping) == (50.0, 30.0)
    assert model_facts(model.config).completion_token_type == 1
    prompt = processor(text=[processor.apply_chat_template(_messages(False), add_generation_prompt=True)],
                       images=[[_image(56)]], return_tensors="pt")
    tokens = processor.tokenizer.convert_ids_to_tokens(prompt["input_ids"][0].tolist())
    assert tokens[:6] == ["<image>"] * 4 + ["<bos>", "What"] and tokens[-1] == "Ċ"  # <bos> after the images, "\n"
    assert prompt["token_type_ids"].eq(0).all()
    n = prompt["input_ids"].shape[1]
    completion = torch.tensor([[processor.tokenizer.convert_tokens_to_ids(t) for t in ("Ġred", "Ġcircle", "?")]])

    def logits(ids, suffix_type):
        types = torch.cat([prompt["token_type_ids"], torch.full_like(completion, suffix_type)], dim=1)
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=types,
                         pixel_values=prompt["pixel_values"]).logits[0]

    ids = torch.cat([prompt["input_ids"], completion], dim=1)
    changed_prompt, changed_last = ids.clone(), ids.clone()
    changed_prompt[0, n - 2] = processor.tokenizer.convert_tokens_to_ids("Ġsquare")  # the prompt's last word
    changed_last[0, -1] = processor.tokenizer.convert_tokens_to_ids("Ġblue")  # the completion's last token
    # Bidirectional prefix: the first text position reads the prompt's last word.
    assert not torch.allclose(logits(ids, 1)[4], logits(changed_prompt, 1)[4])
    # Causal suffix: the completion's first positions do not read its last token ...
    torch.testing.assert_close(logits(ids, 1)[: n + 2], logits(changed_last, 1)[: n + 2])
    # ... but with TRL's zeros they do: the completion joins the bidirectional prefix.
    assert not torch.allclose(logits(ids, 0)[n], logits(changed_last, 0)[n])


def test_ovis2_visual_tokenizer_indicator_tokens_and_crops(tiny_vlm_dir):
    """Ovis2's layout: each image token's embedding is a softmax over the visual vocabulary times the visual embedding
    table; the processor writes <IMG_START>, the atoms, <IMG_GRID>, <IMG_END>, whose embeddings are the table's last
    rows, the same for every image (text keys, ``ModelFacts.image_marker_ids``). The tiny model keeps one view per
    image (``crop_to_patches=False``, what the trainer requires under TRL 1.16); with the converted checkpoints'
    ``crop_to_patches=True`` a larger image becomes a thumbnail plus crops, and gets no map."""
    from trl_mdi.diagnostics.maps import image_token_grids

    model, processor = _load(tiny_vlm_dir("ovis2"))
    tok = processor.tokenizer
    vision = model.config.vision_config
    assert (vision.hidden_stride, vision.vocab_size, vision.tokenize_function) == (2, 64, "softmax")
    indicators = ["<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>"]
    assert list(model.config.visual_indicator_token_ids) == tok.convert_tokens_to_ids(indicators)
    facts = model_facts(model.config, processor)
    assert set(model.config.visual_indicator_token_ids) <= set(facts.image_marker_ids)
    assert facts.image_token_ids == (tok.convert_tokens_to_ids("<IMG_ATOM>"),)
    assert "<image>" not in tok.get_vocab() and processor.image_token_id is None  # as the real tokenizer: text only
    text = processor.apply_chat_template(_messages(False), add_generation_prompt=True)
    inputs = processor(text=[text], images=[[_image(56)]], return_tensors="pt")
    tokens = tok.convert_ids_to_tokens(inputs["input_ids"][0].tolist())
    start = tokens.index("<IMG_START>")
    assert tokens[start: start + 7] == ["<IMG_START>", *["<IMG_ATOM>"] * 4, "<IMG_GRID>", "<IMG_END>"]
    with torch.no_grad():  # the atoms' embeddings are probability-weighted rows of the visual table
        features = model.model.get_image_features(pixel_values=inputs["pixel_values"])
        table = model.model.visual_embeddings_table.weight
        assert features.pooler_output.shape == (1, 4, model.config.hidden_size)
        torch.testing.assert_close(features.visual_indicator_features, table[-5:])
    assert image_token_grids(processor, [_image(56), Image.new("RGB", (112, 56))]) == [(2, 2), (2, 2)]
    processor.image_processor.crop_to_patches = True  # the converted checkpoints' setting
    inputs = processor(text=[text], images=[[_image(84)]], return_tensors="pt")
    tokens = tok.convert_ids_to_tokens(inputs["input_ids"][0].tolist())
    assert inputs["pixel_values"].shape[0] == 5 and tokens.count("<IMG_ATOM>") == 5 * 4  # thumbnail + 2 x 2 crops
    assert tokens.count("<IMG_COL>") == 2 and tokens.count("<IMG_ROW>") == 1
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).logits).all()
    assert image_token_grids(processor, [_image(56)]) == [(2, 2)]  # covered by the square: one view
    assert image_token_grids(processor, [_image(56), _image(84)]) is None


def test_minicpmv4_6_builds_offline_from_the_cli_and_lays_out_its_images(tmp_path):
    """MiniCPM-V 4.6, built but not trained (``BUILD_ONLY_ARCHS``): ``python -m fixtures.tiny --arch minicpmv4_6``
    writes a folder the Auto classes reload; an image within the square is <image_id>N</image_id>, <image>, four
    <|image_pad|>, </image>; a larger one adds slices; all images of a batch are one packed pixel_values sequence
    with one target_sizes row per view."""
    assert tiny.main(["--arch", "minicpmv4_6", "--out", str(tmp_path / "m")]) == 0
    model, processor = _load(tmp_path / "m")
    assert type(model).__name__ == "MiniCPMV4_6ForConditionalGeneration"
    assert type(processor).__name__ == "MiniCPMV4_6Processor" and 100_000 < model.num_parameters() < 1_000_000
    assert model.config.text_config.layer_types == ["linear_attention", "full_attention"] * 2
    tok = processor.tokenizer
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    text = processor.apply_chat_template(_messages(False), add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>What" in text
    inputs = processor(text=[text, text], images=[[_image(56)], [_image(224)]])
    tokens = [tok.convert_ids_to_tokens(row.tolist()) for row in inputs["input_ids"]]
    start = tokens[0].index("<image_id>")
    assert tokens[0][start: start + 9] == ["<image_id>", "0", "</image_id>", "<image>", *["<|image_pad|>"] * 4,
                                           "</image>"]
    assert tokens[1].count("<slice>") == 4 and tokens[1].count("<|image_pad|>") == 5 * 4  # the view + 2 x 2 slices
    assert inputs["pixel_values"].shape[0] == 1 and inputs["target_sizes"].shape[0] == 1 + 5
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).logits).all()


@pytest.mark.parametrize(
    ("arch", "softmax_layers"), [("qwen3_5_moe", [1, 3]), ("gemma4", [0, 1, 2, 3]), ("qwen3_5", [1, 3])]
)
def test_eager_attention_maps_and_layer_idx(arch, softmax_layers, tiny_vlm_dir):
    """The attention probe's assumptions: one eager map per softmax-attention text layer, module.layer_idx."""
    path = tiny_vlm_dir(arch)
    model = AutoModelForImageTextToText.from_pretrained(path, attn_implementation="eager")
    processor = AutoProcessor.from_pretrained(path)
    layers = model.model.language_model.layers
    mixers = [getattr(layer, "self_attn", None) or layer.linear_attn for layer in layers]
    assert [mixer.layer_idx for mixer in mixers] == [*range(len(layers))]
    assert [i for i, layer in enumerate(layers) if hasattr(layer, "self_attn")] == softmax_layers
    text = processor.apply_chat_template(_messages(False), add_generation_prompt=True)
    inputs = processor(text=[text], images=[[_image(56)]], return_tensors="pt")
    with torch.no_grad():
        attentions = model(**inputs, output_attentions=True).attentions
    n = inputs["input_ids"].shape[1]
    assert len(attentions) == len(softmax_layers)  # text layers only: no vision-tower maps in the tuple
    for a in attentions:
        assert a.shape == (1, model.config.text_config.num_attention_heads, n, n)
        torch.testing.assert_close(a.sum(-1), torch.ones(1, a.shape[1], n))


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
        ("qwen2_5_vl", {"full_attention_interval": 2}, "to qwen3_5, gemma3, qwen3_5_moe, gemma4, lfm2_vl, paligemma, aya_vision, gemma3n, llama4 and minicpmv4_6 only"),
        ("qwen3_5", {"sliding_window": 8}, "sliding_window applies to gemma3, gemma4, paligemma, aya_vision and gemma3n only"),
        ("qwen3_5", {"full_attention_interval": 0}, "positive integer"),
        ("gemma3", {"sliding_window": -1}, "positive integer"),
        ("gemma3", {"image_size": 40}, "pooling"),
        ("gemma3", {"min_pixels": 1024}, "Qwen archs only"),
        ("llava_next", {"image_size": 40}, "not a multiple of image_patch_size"),
        ("qwen3_5", {"image_size": 32}, r"image_size applies to gemma3, llava_next, idefics3, smolvlm\b.* only, not qwen3_5"),
        ("llava", {"image_size": 36}, "not a multiple of image_patch_size"),
        ("internvl", {"image_size": 24}, "pixel-shuffle"),
        ("qwen3_5", {"num_experts": 4}, "apply to qwen3_5_moe, qwen3_vl_moe, glm4v_moe and llama4 only"),
        ("qwen3_5_moe", {"num_experts_per_tok": 5}, "exceeds num_experts 4"),
        ("qwen3_5_moe", {"image_patch_size": 8}, "image_patch_size applies to"),
        ("gemma4", {"image_size": 64}, "set image_patch_size instead"),
        ("gemma4", {"full_attention_interval": 3}, "last text layer must use full attention"),
        ("gemma4", {"vision_hidden_size": 24, "vision_num_heads": 4}, "2D vision RoPE"),
        ("gemma4", {"hidden_size": 16}, "head_dim"),
        ("mistral3", {"image_size": 40}, "patch-merge factor 2"),
        ("mistral3", {"min_pixels": 1024}, "set image_size instead"),
        ("glm4v", {"image_size": 32}, "set min_pixels/max_pixels instead"),
        ("qwen3_vl_moe", {"num_experts_per_tok": 5}, "exceeds num_experts 4"),
        ("lfm2_vl", {"image_size": 32}, "set image_patch_size instead"),
        ("qwen2_5_vl", {"attention_chunk_size": 8}, "attention_chunk_size applies to llama4 only"),
        ("llama4", {"image_patch_size": 3}, "16-pixel tile must be image_patch_size 3 times a multiple"),
        ("llama4", {"sliding_window": 8}, "sliding_window applies to gemma3, gemma4, paligemma, aya_vision and gemma3n only"),
        ("gemma3n", {"image_size": 32}, "gemma3n takes no image knob"),
        ("gemma3n", {"attention_chunk_size": 8}, "attention_chunk_size applies to llama4 only"),
        ("lfm2_vl", {"sliding_window": 8}, "sliding_window applies to gemma3, gemma4, paligemma, aya_vision and gemma3n only"),
        ("paligemma", {"image_size": 40}, "not a multiple of image_patch_size"),
        ("ovis2", {"image_size": 48}, "times a multiple of the hidden-stride factor 2"),
    ],
)
def test_invalid_family_requests_raise_value_error(arch, overrides, message):
    with pytest.raises(ValueError, match=message):
        build_tiny_vlm(arch, **overrides)


def test_glm4v_moe_layers_and_experts(tiny_vlm_dir):
    """GLM-4.5V's decoder as the real config lays it out: the first layer a dense MLP, every later one a sparse MoE
    block (routed experts plus one shared expert) whose router picks num_experts_per_tok of them; GLM-4.1V's tower."""
    model, processor = _load(tiny_vlm_dir("glm4v_moe"))
    text = model.config.text_config
    assert (text.first_k_dense_replace, text.n_routed_experts, text.num_experts_per_tok, text.n_shared_experts) == (
        1, 4, 2, 1)
    layers = model.model.language_model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["Glm4vMoeTextMLP"] + ["Glm4vMoeTextMoE"] * 2
    assert type(model.model.visual).__name__ == "Glm4vMoeVisionModel"
    text_in = processor.apply_chat_template(_messages(False), add_generation_prompt=True)
    inputs = processor(text=[text_in], images=[[_image(56)]], return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs, output_router_logits=True)
    assert torch.isfinite(out.logits).all() and len(out.router_logits) == 2  # one per MoE layer
    assert out.router_logits[0].shape[-1] == 4


def test_aya_vision_tiles_and_layers(tiny_vlm_dir):
    """Aya Vision's decoder alternates sliding-window (RoPE) and full attention (no positional embedding) layers; an
    image is cut into up to 4 tiles plus a global view (one tile, no global view, when it fits one), each view's 2 x 2
    image tokens after its label, all between <|START_OF_IMG|> and <|END_OF_IMG|>; such a layout gets no map."""
    from trl_mdi.diagnostics.maps import image_token_grids

    model, processor = _load(tiny_vlm_dir("aya_vision"))
    assert model.config.text_config.layer_types == ["sliding_attention", "full_attention"] * 2
    text = processor.apply_chat_template(_messages(False), add_generation_prompt=True)
    for image, labels in [(_image(56), ["TILE_1", "TILE_2", "TILE_3", "TILE_4", "TILE_GLOBAL"]),
                          (_image(32), ["TILE_GLOBAL"]), (Image.new("RGB", (64, 32)), ["TILE_1", "TILE_2", "TILE_GLOBAL"])]:
        inputs = processor(text=[text], images=[[image]], return_tensors="pt")
        tokens = processor.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0].tolist())
        run = tokens[tokens.index("<|START_OF_IMG|>"):tokens.index("<|END_OF_IMG|>") + 1]
        assert run == ["<|START_OF_IMG|>", *[t for label in labels for t in [label] + ["<|IMG_PATCH|>"] * 4],
                       "<|END_OF_IMG|>"], (image.size, run)
        assert inputs["pixel_values"].shape[0] == len(labels)
        with torch.no_grad():
            assert torch.isfinite(model(**inputs).logits).all()
    assert image_token_grids(processor, [_image(56)]) is None


def test_llama4_builds_with_its_processor_template_and_layer_kinds(tiny_vlm_dir):
    """Llama 4 (build-only: the trainer refuses it, tests/test_families.py): the saved folder reloads as the real
    classes; the instruct template renders; the processor expands <|image|> into one tile's 2 x 2 pixel-shuffled
    <|patch|> tokens (the model's image token) between <|image_start|><|image|> and <|image_end|>, with bfloat16 pixels;
    RoPE layers attend in chunks, every second layer is a global NoPE layer, and MoE alternates with dense MLPs."""
    from trl_mdi.batch import image_fields_for_model

    model, processor = _load(tiny_vlm_dir("llama4"))
    assert type(model).__name__ == "Llama4ForConditionalGeneration" and type(processor).__name__ == "Llama4Processor"
    assert 100_000 < model.num_parameters() < 1_000_000
    text = model.config.text_config
    assert text.layer_types == ["chunked_attention", "full_attention"] * 2 and text.no_rope_layers == [1, 0, 1, 0]
    assert text.attention_chunk_size == 512 and text.moe_layers == [1, 3]
    assert [type(layer.feed_forward).__name__ for layer in model.language_model.model.layers] == [
        "Llama4TextMLP", "Llama4TextMoe"] * 2
    rendered = processor.apply_chat_template(_messages(True), add_generation_prompt=True)
    assert rendered.startswith("<|begin_of_text|><|header_start|>system<|header_end|>\n\n" + SYSTEM_PROMPT)
    assert rendered.endswith(f"<|image|>{QUESTION}<|eot|><|header_start|>assistant<|header_end|>\n\n")
    inputs = processor(text=[rendered], images=[[_image(56)]], return_tensors="pt")
    tokens = processor.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0].tolist())
    start = tokens.index("<|image_start|>")
    assert tokens[start:start + 7] == ["<|image_start|>", "<|image|>", *["<|patch|>"] * 4, "<|image_end|>"]
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|patch|>")
    assert inputs["pixel_values"].dtype == torch.bfloat16 and inputs["pixel_values"].shape == (1, 3, 16, 16)
    # TRL's unbatched encoding: one bfloat16 tile stack per image, concatenated and cast as the model takes them.
    fields = processor.apply_chat_template([[{"role": "user", "content": [{"type": "image", "image": _image(56)}]}]] * 2,
                                           add_generation_prompt=True, tokenize=True, return_dict=True)
    assert isinstance(fields["pixel_values"], list) and len(fields["pixel_values"]) == 2
    pixels = image_fields_for_model(fields, processor, torch.float32)["pixel_values"]
    assert pixels.dtype == torch.float32 and pixels.shape == (2, 3, 16, 16)
    features = model.get_image_features(pixels).last_hidden_state  # the vision tower runs on every transformers
    assert features.shape[:2] == (2, 4) and torch.isfinite(features).all()
