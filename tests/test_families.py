"""The probe on every supported VLM family against materialised eager attention, including the families whose
layers are not all alike: Qwen3.5 (hybrid: linear-attention layers have no attention weights) and Gemma 3 (sliding
windows that can hide every image key)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from fixtures.testing import eager_masses, family_params, grpo_batch, shape_image
from fixtures.tiny import TINY_ARCHS
from trl_mdi import signals as S
from trl_mdi.attention import image_token_ids, measure_modality_attention
from trl_mdi.attention.model_facts import ZERO3_TRAINING_PROBLEMS, model_facts, transformers_forward_problem


def rows_of(res, segments="thirds"):
    """Per-rollout plain dicts of a probe result, as the trainer builds them (trl_mdi.signals)."""
    return S.rollout_rows(S.rollout_signals(res, segments, 2.0))


MODEL_KEYS = ("input_ids", "attention_mask", "completion_mask")


def _load(path, attn=None):
    """The saved tiny model with its default attention (SDPA; eager for PaliGemma 2's soft-capped Gemma 2 decoder,
    which has no SDPA kernel), or ``attn``."""
    kwargs = {"attn_implementation": attn} if attn else {}
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def _batch(processor, facts=None):
    """Image + long prompt, text only, image + short prompt; completions of 5, 2, 7 tokens (both paddings vary). With
    the model's ``facts``: laid out as the trainer lays it out for that family (the completion's token types), and a
    family that takes no prompt without an image (PaliGemma) gets one in the middle row too."""
    text_only = None if facts is None or not facts.image_in_every_prompt else shape_image(84, 4)
    return grpo_batch(processor, ["What colour is the shape in the image? Answer with a letter.", "How many shapes?",
                                  "Shape?"], [shape_image(56, 1), text_only, shape_image(56, 2)], [5, 2, 7], seed=3,
                      facts=facts)


def _eager_masses(path, batch):
    """(B, n_softmax_layers, 4) masses from eager attention weights (Qwen3.5 returns maps for its softmax layers only)."""
    return eager_masses(_load(path, "eager"), batch)


@pytest.fixture(scope="module")
def family(request, tiny_vlm_dir):
    arch, kwargs = request.param
    path = tiny_vlm_dir(arch, **kwargs)
    return arch, path, _load(path), AutoProcessor.from_pretrained(path)


FAMILIES = [(a, {}) for a in TINY_ARCHS] + [("gemma3", {"sliding_window": 8}), ("aya_vision", {"sliding_window": 8})]


@pytest.mark.parametrize("family", FAMILIES, indirect=True, ids=[f"{a}{'-window8' if k else ''}" for a, k in FAMILIES])
def test_probe_equals_eager_on_every_family(family):
    arch, path, model, processor = family
    facts = model_facts(AutoConfig.from_pretrained(path))
    batch = _batch(processor, facts)
    res = measure_modality_attention(model, **batch)
    ref, groups = _eager_masses(path, batch)
    # The layers predicted from the config are the layers the probe really measured, and eager has a map for each.
    assert res.layers == list(facts.measured_layers) and len(res.layers) == ref.shape[1]
    got = torch.stack([res.image, res.prompt_text, res.completion, res.special], dim=-1)[:, res.layers]
    err = (got.double() - ref).abs().max().item()
    assert err < 1e-5, f"{arch}: max |probe - eager| = {err:.2e}"
    print(f"\n{arch}: max |probe - eager| = {err:.1e} over layers {res.layers}")
    unmeasured = [i for i in range(res.num_layers) if i not in res.layers]
    assert torch.isnan(res.image[:, unmeasured]).all()  # linear-attention layers carry no (made-up) mass
    text_only = not facts.image_in_every_prompt  # PaliGemma: an image in every row
    assert res.n_image.tolist() == groups[..., 0].sum(1).tolist() and (res.n_image[1] == 0) == text_only
    assert res.n_image[0] > 0 and res.n_queries.tolist() == [5, 2, 7]
    rows = rows_of(res)
    assert (rows[1]["mdi"] is None) == text_only and all(r["mdi"] is not None and r["mdi"] > 0 for r in (rows[0], rows[2]))
    # Every segment has a finite value wherever a row has image and generated tokens, hybrid models included (only
    # a window that hides the image, tested below, makes a segment +inf).
    if not res.image_blind_layers().any():
        for name, vals in res.segment_metrics().items():
            assert torch.isfinite(vals["mdi"][[0, 2]]).all(), (arch, name)


def test_soft_capped_attention_is_measured_with_its_cap(tiny_vlm_dir):
    """PaliGemma 2's Gemma 2 layers soft-cap their attention logits (s -> cap * tanh(s / cap), before the mask); the
    probe applies the same cap (``trl_mdi.attention.routes.attend``). The tiny model's logits stay far below the real
    cap (50), so here every layer's cap is 0.05, where it flattens the weights: the probe still equals eager attention
    within 1e-5, and its masses differ from those at the real cap by about 5e-4, fifty times that."""
    path = tiny_vlm_dir("paligemma")
    batch = _batch(AutoProcessor.from_pretrained(path), model_facts(AutoConfig.from_pretrained(path)))
    at_real_cap = measure_modality_attention(_load(path), **batch)
    model, eager = _load(path), _load(path, "eager")
    for layer in [*model.model.language_model.layers, *eager.model.language_model.layers]:
        layer.self_attn.attn_logit_softcapping = 0.05
    res = measure_modality_attention(model, **batch)
    ref, _ = eager_masses(eager, batch)
    got = torch.stack([res.image, res.prompt_text, res.completion, res.special], dim=-1)[:, res.layers]
    err = (got.double() - ref).abs().max().item()
    assert err < 1e-5, f"max |probe - eager| with the cap at 0.05 = {err:.2e}"
    assert (res.image - at_real_cap.image).abs().max() > 1e-4  # the cap bites (5e-4 here): ignoring it would show


def test_hybrid_model_is_measured_on_its_softmax_layers_only(tiny_vlm_dir):
    path = tiny_vlm_dir("qwen3_5")  # layer_types: linear, full, linear, full
    facts = model_facts(AutoConfig.from_pretrained(path))
    assert facts.layer_types == ("linear_attention", "full_attention") * 2 and facts.measured_layers == (1, 3)
    res = measure_modality_attention(_load(path), **_batch(AutoProcessor.from_pretrained(path)))
    assert res.segments() == {"early": [1], "late": [3], "all": [1, 3]}
    assert res.segments("first:0-1,second:2-3") == {"first": [1], "second": [3], "all": [1, 3]}
    with pytest.raises(ValueError, match=r"layer segment 'lin' names layers \[0\], none of which runs softmax"):
        res.segments("lin:0")
    table = S.rollout_signals(res, "thirds", 2.0)
    assert torch.isfinite(table["mdi"][[0, 2]]).all() and torch.isfinite(table["image_mass"][[0, 2]]).all()
    values = S.batch_metrics(table)
    assert math.isfinite(values["attention/mdi"]) and values["attention/rows_unmeasured"] == 0.0


def test_a_model_without_softmax_layers_is_a_clear_error(tiny_vlm_dir):
    path = tiny_vlm_dir("qwen3_5", num_layers=2, full_attention_interval=3)  # linear, linear
    facts = model_facts(AutoConfig.from_pretrained(path))
    assert facts.measured_layers == ()
    with pytest.raises(ValueError, match="none of its 2 text layers through softmax attention"):
        measure_modality_attention(_load(path), **_batch(AutoProcessor.from_pretrained(path)))


def test_a_sliding_window_that_hides_the_image_gives_inf_counted_not_silent(tiny_vlm_dir):
    """Gemma 3 with an 8-token window: the sliding layers (0 and 2) cannot see the image from any generated token."""
    path = tiny_vlm_dir("gemma3", sliding_window=8)
    facts = model_facts(AutoConfig.from_pretrained(path))
    assert facts.sliding_window == 8 and facts.layer_types[0] == "sliding_attention"
    res = measure_modality_attention(_load(path), **_batch(AutoProcessor.from_pretrained(path)))
    assert (res.image[[0, 2]][:, [0, 2]] == 0).all() and (res.image[[0, 2]][:, [1, 3]] > 0).all()
    assert res.image_blind_layers().tolist() == [2, 0, 2]
    seg = res.segment_metrics()  # thirds of 4 layers: early [0] (sliding), middle [1, 2], late [3]
    assert torch.isinf(seg["early"]["mdi"][[0, 2]]).all()
    assert torch.isfinite(seg["late"]["mdi"][[0, 2]]).all() and torch.isfinite(seg["all"]["mdi"][[0, 2]]).all()
    values = S.batch_metrics(S.rollout_signals(res, "thirds", 2.0))
    assert all(math.isfinite(v) for v in values.values()), values  # means leave inf rows out ...
    assert values["attention/rows_mdi_inf"] == pytest.approx(2 / 3)  # ... and count them
    assert values["attention/image_blind_layers"] == pytest.approx(4 / 3)
    assert rows_of(res)[0]["image_blind_layers"] == 2


def test_llava_next_measures_directly(tiny_vlm_dir):
    """LLaVA-NeXT passes input_ids positionally to its backbone: measure_modality_attention must still see them."""
    path = tiny_vlm_dir("llava_next")
    res = measure_modality_attention(_load(path), **_batch(AutoProcessor.from_pretrained(path)))
    assert res.n_image[0] > 0 and res.valid.all()


@pytest.mark.parametrize("arch, kwargs", [("qwen2_5_vl", {}), ("qwen3_5", {}), ("gemma3", {"sliding_window": 8})])
def test_per_query_image_mass_equals_eager(tiny_vlm_dir, arch, kwargs):
    """The per-token perception signal: each generated token's attention mass on image keys, averaged over heads
    and the late segment's measured layers, equals eager attention weights (1e-5), and is 0 at non-query positions."""
    path = tiny_vlm_dir(arch, **kwargs)
    batch = _batch(AutoProcessor.from_pretrained(path))
    res = measure_modality_attention(_load(path), **batch, token_segment="late")
    late = res.segments()["late"]
    assert res.token_layers == tuple(late) and res.query_image_mass.shape == batch["input_ids"].shape
    eager = _load(path, "eager")
    with torch.no_grad():
        out = eager(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_attentions=True,
                    **{k: v for k, v in batch.items() if k not in MODEL_KEYS})
    maps = dict(zip(res.layers, [a for a in out.attentions if a is not None]))  # eager maps of the measured layers
    img = torch.isin(batch["input_ids"], torch.tensor(image_token_ids(eager.config))) & batch["attention_mask"].bool()
    per_layer = [torch.einsum("bhqk,bk->bq", maps[layer].double(), img.double()) / maps[layer].shape[1] for layer in late]
    # Recorded at every generated token and at the position that chose the first one (the last prompt token).
    cm = batch["completion_mask"].bool()
    positions = (cm | torch.nn.functional.pad(cm[:, 1:], (0, 1))) & batch["attention_mask"].bool()
    assert (positions.sum(1) == cm.sum(1) + 1).all()
    ref = torch.stack(per_layer).mean(0) * positions
    err = (res.query_image_mass.double() - ref).abs().max().item()
    assert err < 1e-5, f"{arch}: max |probe - eager| = {err:.2e}"
    assert (res.query_image_mass[~positions] == 0).all()
    # The per-token values average to the layer mean the probe reports per row (same queries, same layers).
    row_mean = (res.query_image_mass * cm).sum(1) / res.n_queries.clamp(min=1)
    torch.testing.assert_close(row_mean, res.image[:, late].mean(1).nan_to_num(0.0), atol=1e-5, rtol=0)


def test_per_query_image_mass_falls_back_to_all_layers(tiny_vlm_dir, caplog):
    path = tiny_vlm_dir("qwen2_5_vl", num_layers=1)  # thirds of one layer: only "middle"
    batch = _batch(AutoProcessor.from_pretrained(path))
    with caplog.at_level(logging.WARNING, logger="trl_mdi"):  # the trainer's run plan says it in the same words
        res = measure_modality_attention(_load(path), **batch, token_segment="late")
    assert "segment 'late', which this model does not have" in caplog.text
    assert res.token_layers == (0,)
    assert measure_modality_attention(_load(path), **batch).query_image_mass is None  # only when asked for


# LLaVA-OneVision: several images in one row need the processor's batch_num_images, which TRL 1.16 drops.
TWO_IMAGE_ROWS_FAIL_UNDER_TRL = ("llava_onevision",)


@pytest.mark.parametrize("arch", family_params(TINY_ARCHS))
def test_two_image_row_equals_eager(tiny_vlm_dir, arch):
    """A row with two images next to a one-image row and a text-only row: every image token of the row counts, and
    the per-layer masses equal eager attention weights (1e-5)."""
    path = tiny_vlm_dir(arch)
    processor = AutoProcessor.from_pretrained(path)
    facts = model_facts(AutoConfig.from_pretrained(path))
    third = shape_image(84, 4) if facts.image_in_every_prompt else None  # PaliGemma: an image in every row
    batch = grpo_batch(processor, ["Compare the two shapes.", "Shape?", "No image here."],
                       [[shape_image(56, 1), shape_image(56, 2)], shape_image(56, 3), third], [4, 6, 3], seed=5,
                       facts=facts)
    if arch in TWO_IMAGE_ROWS_FAIL_UNDER_TRL:
        # The processor lays a multi-image row out without tiles and says so in batch_num_images, which TRL 1.16's
        # log-prob forward does not pass on (nor does the probe, which takes what TRL takes): the model then tiles
        # every image and its features outnumber the image tokens.
        with pytest.raises(ValueError, match="Image features and image tokens do not match"):
            measure_modality_attention(_load(path), **batch)
        return
    res = measure_modality_attention(_load(path), **batch)
    assert res.n_image[0] == 2 * res.n_image[1] > 0 and (res.n_image[2] == 0) == (third is None)
    ref, _ = _eager_masses(path, batch)
    got = torch.stack([res.image, res.prompt_text, res.completion, res.special], dim=-1)[:, list(res.layers)]
    err = (got.double() - ref.double()).nan_to_num(0.0).abs().max().item()
    assert err < 1e-5, f"{arch}: max |probe - eager| = {err:.2e}"


@pytest.mark.parametrize("arch", family_params(["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe",
                                                "gemma3", "llava", "glm4v", "qwen3_vl_moe", "mistral3", "lfm2_vl",
                                                "paligemma", "glm4v_moe", "gemma3n", "ovis2"]))
def test_per_image_maps_of_a_two_image_row_equal_eager(tiny_vlm_dir, arch):
    """The attention maps of a two-image row (images of different sizes): the probe's per-image-token masses equal
    eager attention weights token by token, and the per-image split the maps use (each image's token grid) cuts
    them exactly where the sequence's image-token runs are."""
    from PIL import Image

    from fixtures.testing import eager_group_masses
    from trl_mdi.diagnostics.maps import attention_map_records, image_token_grids, split_per_image

    path = tiny_vlm_dir(arch)
    processor = AutoProcessor.from_pretrained(path)
    wide = Image.new("RGB", (112, 56), (255, 255, 255))
    wide.paste(shape_image(56, 4), (56, 0))
    # LLaVA 1.5's processor centre-crops a square: its maps are drawn for square images only (a larger one here).
    images = [shape_image(56, 1), shape_image(112, 4) if arch == "llava" else wide]
    batch = grpo_batch(processor, ["Which picture shows more?", "Shape?"], [images, shape_image(56, 3)], [5, 3],
                       seed=7, facts=model_facts(AutoConfig.from_pretrained(path)))
    res = measure_modality_attention(_load(path), **batch, image_map_rows=[0])
    mass = res.image_token_mass[0]  # (layers, image tokens of row 0)
    # Eager reference: one key group per image token of row 0.
    ids = batch["input_ids"][0]
    img_pos = torch.isin(ids, torch.tensor(image_token_ids(AutoConfig.from_pretrained(path)))).nonzero().flatten()
    assert mass.shape[1] == len(img_pos)
    groups = torch.zeros(*batch["input_ids"].shape, len(img_pos))
    groups[0, img_pos, torch.arange(len(img_pos))] = 1
    with torch.no_grad():
        out = _load(path, "eager")(**{k: v for k, v in batch.items() if k != "completion_mask"},
                                   output_attentions=True)
    ref = eager_group_masses([a for a in out.attentions if a is not None], groups, batch["completion_mask"].bool())[0]
    err = (mass[list(res.layers)].double() - ref.double()).abs().max().item()
    assert err < 1e-5, f"{arch}: max |probe - eager| per image token = {err:.2e}"
    # The split: image k's grid tokens are the k-th contiguous run of image tokens in the sequence.
    grids = image_token_grids(processor, images)
    parts = split_per_image(mass, grids)
    last = torch.diff(img_pos) > 1  # an image's last token: the next image token is not next to it
    if arch == "mistral3":  # [IMG_BREAK] closes every row of [IMG] tokens; [IMG_END] closes the image
        marker = ids[img_pos + 1]
        last = marker[:-1] == processor.image_end_token_id
        for (h, w), run in zip(grids, torch.tensor_split(img_pos, last.nonzero().flatten() + 1)):
            row_ends = ids[run + 1].reshape(h, w)[:, -1].tolist()  # the token after each row's last [IMG]
            assert row_ends == [processor.image_break_token_id] * (h - 1) + [processor.image_end_token_id]
    runs = torch.tensor_split(img_pos, last.nonzero().flatten() + 1)
    if arch == "paligemma":  # every image's placeholders come first, one image after another: a single run
        assert len(runs) == 1
        runs = torch.split(img_pos, [h * w for h, w in grids])
    assert [p.shape[1] for p in parts] == [len(r) for r in runs] == [h * w for h, w in grids]
    # Qwen grids follow the size; Gemma 3, LLaVA, PaliGemma, Gemma 3n and Ovis2 (one view, crop_to_patches=False): a
    # square.
    if arch not in ("gemma3", "llava", "paligemma", "gemma3n", "ovis2"):
        assert parts[0].shape[1] != parts[1].shape[1]
    # What the live log draws: one entry per image, its masses from its own run, shares adding up to 1.
    (record,) = attention_map_records(res, [images, [shape_image(56, 3)]], [0], "thirds", processor)
    assert len(record["images"]) == len(record["segments"]) == 2 and len(record["captions"]) == 2
    late = res.segments("thirds")["late"]
    for k, run in enumerate(runs):
        start = int((img_pos < run[0]).sum())
        torch.testing.assert_close(record["segments"][k]["late"], mass[late, start : start + len(run)].mean(0))
    shares = [float(c.split("·")[1].split("%")[0]) for c in record["captions"]]
    assert abs(sum(shares) - 100) <= 1


@pytest.mark.parametrize("arch", ["idefics3", "llava_next", "gemma4", "smolvlm", "llava_onevision", "internvl",
                                  "aya_vision"])
def test_families_without_a_plain_token_grid_get_no_map(tiny_vlm_dir, arch):
    """No single row-major grid per image: no map rather than a wrong one. (InternVL: the tiles' grids, then the
    thumbnail's, one after another; LLaVA-OneVision: base view, tiles and newline tokens, as LLaVA-NeXT.)"""
    from trl_mdi.diagnostics.maps import attention_map_records, image_token_grids

    path = tiny_vlm_dir(arch)
    processor = AutoProcessor.from_pretrained(path)
    assert image_token_grids(processor, [shape_image(56, 1)]) is None
    batch = grpo_batch(processor, ["Shape?"], [shape_image(56, 1)], [3], seed=1)
    res = measure_modality_attention(_load(path), **batch, image_map_rows=[0])
    assert res.image_token_mass[0].numel() > 0
    assert attention_map_records(res, [[shape_image(56, 1)]], [0], "thirds", processor) == []


@pytest.mark.parametrize("arch, markers", [("glm4v", ("<|begin_of_image|>", "<|end_of_image|>")),
                                           ("glm4v_moe", ("<|begin_of_image|>", "<|end_of_image|>")),
                                           ("mistral3", ("[IMG_BREAK]", "[IMG_END]")),
                                           ("lfm2_vl", ("<|image_start|>", "<|image_end|>")),
                                           ("aya_vision", ("<|START_OF_IMG|>", "<|END_OF_IMG|>")),
                                           ("ovis2", ("<IMG_START>", "<IMG_END>"))])
def test_tokens_around_and_inside_an_image_run_are_text_keys(tiny_vlm_dir, arch, markers):
    """GLM-4.1V's begin / end-of-image tokens around its M-RoPE run and Pixtral's row-break / end tokens inside the run
    are facts of the model (``ModelFacts.image_marker_ids``), never image keys: the image group is exactly the
    placeholders that receive vision features; the markers count as prompt text, or as ``special`` under
    ``text_keys="content"`` (``trl_mdi.attention.model_facts.IMAGE_MARKER_ATTRIBUTES``)."""
    path = tiny_vlm_dir(arch)
    processor = AutoProcessor.from_pretrained(path)
    facts = model_facts(AutoConfig.from_pretrained(path), processor)
    marker_ids = processor.tokenizer.convert_tokens_to_ids(list(markers))
    assert set(marker_ids) <= set(facts.image_marker_ids) and not set(marker_ids) & set(facts.image_token_ids)
    batch = _batch(processor)
    ids, prompt = batch["input_ids"], batch["attention_mask"].bool() & ~batch["completion_mask"].bool()
    is_marker = torch.isin(ids, torch.tensor(marker_ids)) & prompt
    assert is_marker.sum(1).tolist() == [2, 0, 2]  # one of each per image; none in the text-only row
    placeholders = torch.isin(ids, torch.tensor(facts.image_token_ids)) & prompt
    model = _load(path)
    res = measure_modality_attention(model, **batch)
    assert res.n_image.tolist() == placeholders.sum(1).tolist()
    assert res.n_prompt_text.tolist() == (prompt & ~placeholders).sum(1).tolist()  # markers included
    content = measure_modality_attention(model, **batch, text_keys="content", tokenizer=processor.tokenizer)
    assert (content.n_special >= is_marker.sum(1)).all() and content.n_image.tolist() == res.n_image.tolist()


def test_a_family_transformers_cannot_load_under_zero3_is_refused_by_path_with_the_fix(tiny_vlm_dir, tmp_path,
                                                                                       monkeypatch):
    """Qwen3-VL-MoE under DeepSpeed ZeRO-3: transformers 5.23's ZeRO-3 loading path skips the experts' Transpose
    conversion, so TRL's load by path fails ("size mismatch for ...experts.down_proj"); the trainer says so at
    construction, before TRL loads anything, with the fix (load the model first and pass it; the every-family ZeRO-3
    launch trains it that way)."""
    from trl import GRPOConfig

    from fixtures.testing import zen_image_dataset
    from trl_mdi import MDIGRPOTrainer
    from trl_mdi import run_plan as run_plan_module  # the plan checks ZeRO-3 before any weight loads

    monkeypatch.setattr(run_plan_module, "is_deepspeed_zero3_enabled", lambda: True)
    path = str(tiny_vlm_dir("qwen3_vl_moe"))
    args = GRPOConfig(str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=2, num_generations=2)
    with pytest.raises(ValueError, match=r"\(qwen3_vl_moe\) cannot be loaded under DeepSpeed ZeRO-3 .* pass the model "
                                         r"object"):
        MDIGRPOTrainer(path, reward_funcs=[lambda **k: []], args=args, train_dataset=zen_image_dataset(2))


@pytest.mark.parametrize("arch", sorted(ZERO3_TRAINING_PROBLEMS))
def test_a_family_that_cannot_train_under_zero3_is_refused_with_the_fix(tiny_vlm_dir, tmp_path, monkeypatch, arch):
    """LFM2-VL under DeepSpeed ZeRO-3: its projector runs once per image tile, so processes with different numbers of
    tiles gather its weights a different number of times and the collectives stop matching (the every-family launch
    saw gloo's "Received data size doesn't match expected size" with an image on one process and the dummy pass on
    the other, and trained with four images on each). Refused at construction, by path and as an object, before TRL
    builds anything; without ZeRO-3 the same trainer builds."""
    from unittest import mock

    from trl import GRPOConfig, GRPOTrainer

    from fixtures.testing import zen_image_dataset
    from trl_mdi import MDIGRPOTrainer
    from trl_mdi import run_plan as run_plan_module  # the plan checks ZeRO-3 before any weight loads

    path = str(tiny_vlm_dir(arch))
    args = GRPOConfig(str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=2, num_generations=2)
    monkeypatch.setattr(run_plan_module, "is_deepspeed_zero3_enabled", lambda: True)
    for model in (path, AutoModelForImageTextToText.from_pretrained(path)):
        with mock.patch.object(GRPOTrainer, "__init__", side_effect=AssertionError("TRL was built")):
            with pytest.raises(ValueError, match=rf"'{arch}' cannot train under DeepSpeed ZeRO-3: .*once per image "
                                                 r"tile.* Fix: train it with ZeRO-2"):
                MDIGRPOTrainer(model, reward_funcs=[lambda **k: []], args=args, train_dataset=zen_image_dataset(2))
    monkeypatch.setattr(run_plan_module, "is_deepspeed_zero3_enabled", lambda: False)
    MDIGRPOTrainer(path, reward_funcs=[lambda **k: [0.0] * len(k["prompts"])], args=args,
                   train_dataset=zen_image_dataset(2))


def test_paligemma_trains_as_it_generates_and_refuses_text_only_prompts(tiny_vlm_dir, tmp_path, monkeypatch):
    """What PaliGemma needs under TRL 1.16, done by the trainer: prompts of different lengths on one process are encoded
    one at a time (its processor fails on TRL's unpadded batch, ``ModelFacts.unpadded_batch_problem``); every log-prob
    forward gets the completion's token_type_ids as 1, the causal suffix generation gave it (TRL's zeros would put it
    in the bidirectional prefix); the processor's labels, which TRL passes on to its old-log-prob forward
    (num_iterations=2), are dropped. A text-only prompt stops the run with the reason before generating."""
    from trl import GRPOConfig, GRPOTrainer

    from fixtures.testing import zen_image_dataset
    from trl_mdi import MDIGRPOTrainer

    seen = []
    original = GRPOTrainer._get_per_token_logps_and_entropies

    def spy(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        seen.append((attention_mask, kwargs["token_type_ids"], logits_to_keep, "labels" in kwargs))
        return original(self, model, input_ids, attention_mask, logits_to_keep, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", spy)

    def args(name):
        return GRPOConfig(str(tmp_path / name), use_cpu=True, report_to="none", per_device_train_batch_size=4,
                          num_generations=2, max_completion_length=4, max_steps=1, num_iterations=2,
                          save_strategy="no", disable_tqdm=True, logging_steps=1)

    path = str(tiny_vlm_dir("paligemma"))
    trainer = MDIGRPOTrainer(path, reward_funcs=[lambda completions, **k: [float(len(c[0]["content"]) % 3)
                                                                       for c in completions]],
                             args=args("images"), train_dataset=zen_image_dataset(4))
    trainer.train()
    assert len(seen) >= 2  # the old-log-prob forward and the training forward
    for mask, types, completion_length, labels in seen:
        prompt = mask[:, :-completion_length].bool()
        assert types[:, -completion_length:].eq(1).all() and types[:, :-completion_length][prompt].eq(0).all()
        assert not labels
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert math.isfinite(logs[0]["loss"]) and 0 < logs[0]["attention/mdi"] < float("inf")

    trainer = MDIGRPOTrainer(path, reward_funcs=[lambda completions, **k: [0.0] * len(completions)],
                             args=args("mixed"), train_dataset=zen_image_dataset(4, images_per_row=[1, 0]))
    with pytest.raises(ValueError, match=r"'paligemma' cannot take a prompt without an image .*PaliGemmaProcessor "
                                         r"refuses a batch without images"):
        trainer.train()


def test_glm4v_moe_trains_with_trls_load_balancing_loss(tiny_vlm_dir, tmp_path):
    """GLM-4.5V's text config names its expert count n_routed_experts, but TRL 1.16's fused forward reads num_experts
    for the MoE load-balancing loss it turns on from the config's router_aux_loss_coef: the trainer gives the loaded
    config that name (``model_facts.expert_count_for_trl``; without it every step stopped with an AttributeError).
    The loss is on, logged and finite, beside a finite attention/mdi."""
    from trl import GRPOConfig

    from fixtures.testing import zen_image_dataset
    from trl_mdi import MDIGRPOTrainer

    args = GRPOConfig(str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=4, max_steps=1, save_strategy="no", disable_tqdm=True, logging_steps=1)
    trainer = MDIGRPOTrainer(str(tiny_vlm_dir("glm4v_moe")), reward_funcs=[lambda completions, **k: [
        float(len(c[0]["content"]) % 3) for c in completions]], args=args, train_dataset=zen_image_dataset(2))
    text_config = trainer.model.config.text_config
    assert trainer.aux_loss_enabled and text_config.num_experts == text_config.n_routed_experts == 4
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert math.isfinite(logs[0]["aux_loss"]) and 0 < logs[0]["attention/mdi"] < float("inf")


def test_glm46v_is_glm4v_moe_under_another_class(tiny_vlm_dir, tmp_path):
    """transformers' glm46v type (``Glm46VForConditionalGeneration``: GLM-4.1V's model class building its text and
    vision parts from their own configs; ``Glm46VProcessor``: GLM-4.1V's processor) holds the tiny GLM-4.5V's decoder
    when given its text config: saved and reloaded through the Auto classes, its facts are GLM-4.5V's and the probe
    equals eager on the padded, mixed batch, all layers measured."""
    from transformers import Glm46VConfig, Glm46VForConditionalGeneration, Glm46VProcessor

    path = tiny_vlm_dir("glm4v_moe")
    config, processor = AutoConfig.from_pretrained(path), AutoProcessor.from_pretrained(path)
    ids = {key: getattr(config, key) for key in ("image_token_id", "video_token_id", "image_start_token_id",
                                                 "image_end_token_id", "video_start_token_id", "video_end_token_id")}
    glm46v = Glm46VConfig(text_config=config.text_config.to_dict(), vision_config=config.vision_config.to_dict(),
                          **ids)
    torch.manual_seed(0)
    Glm46VForConditionalGeneration(glm46v).save_pretrained(tmp_path)
    Glm46VProcessor(image_processor=processor.image_processor, tokenizer=processor.tokenizer,
                    video_processor=processor.video_processor, chat_template=processor.chat_template,
                    ).save_pretrained(tmp_path)
    model, processor = _load(tmp_path), AutoProcessor.from_pretrained(tmp_path)
    assert type(model).__name__ == "Glm46VForConditionalGeneration" and type(processor).__name__ == "Glm46VProcessor"
    assert type(model.model.language_model).__name__ == "Glm4vMoeTextModel"
    facts = model_facts(model.config, processor)
    assert facts.model_type == "glm46v" and facts.measured_layers == (0, 1, 2)
    assert (facts.image_token_ids, facts.image_marker_ids) == (tuple(ids.values())[:2], tuple(ids.values())[2:4])
    batch = _batch(processor, facts)
    res = measure_modality_attention(model, **batch)
    ref, _ = _eager_masses(tmp_path, batch)
    got = torch.stack([res.image, res.prompt_text, res.completion, res.special], dim=-1)[:, res.layers]
    assert res.layers == [0, 1, 2] and (got.double() - ref).abs().max().item() < 1e-5
    assert res.n_image[0] > 0 and res.n_image[1] == 0


def test_aya_vision_trains_on_the_log_probs_it_samples_from(tiny_vlm_dir, tmp_path):
    """AyaVisionForConditionalGeneration never applies its Cohere 2 text config's logit_scale, but TRL 1.16's fused LM
    head (every log-prob GRPO trains on) multiplies by it: the trainer builds TRL's head with the scale the model
    uses (``trl_mdi.trainer.fused_head_as_the_model_computes``), so the trained log-probs are the model's own forward's
    (0.3 nat off per token before; tests/test_reliance_trainer.py's signals failed that way). The config keeps its
    scale and TRL's function is left as it was."""
    from trl import GRPOConfig
    from trl.trainer import grpo_trainer

    from fixtures.testing import zen_image_dataset
    from trl_mdi import MDIGRPOTrainer

    original = grpo_trainer.add_fused_lm_head
    args = GRPOConfig(str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=4, max_steps=1, save_strategy="no", disable_tqdm=True)
    trainer = MDIGRPOTrainer(str(tiny_vlm_dir("aya_vision")), reward_funcs=[lambda completions, **k: [0.0] * len(
        completions)], args=args, train_dataset=zen_image_dataset(2))
    model, processor = trainer.model, trainer.processing_class
    assert grpo_trainer.add_fused_lm_head is original and model.config.text_config.logit_scale == 0.0625
    batch = grpo_batch(processor, ["What colour is the shape?"], [shape_image(56, 1)], [5], seed=2)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    extra = {k: v for k, v in batch.items() if k not in MODEL_KEYS}
    with torch.no_grad():
        fused = model(input_ids=ids, attention_mask=mask, **extra, labels=ids, fused_lm_head=True).log_probs
        own = torch.log_softmax(model(input_ids=ids, attention_mask=mask, **extra).logits[:, :-1].float(), -1)
    own = own.gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(fused[:, -5:], own[:, -5:], atol=1e-5, rtol=0)


def test_ovis2_with_crops_is_refused_at_construction_with_the_fix(tiny_vlm_dir, tmp_path):
    """Ovis2 with the converted checkpoints' crop_to_patches=True: TRL 1.16 recounts a cropped image's crops with
    image_processor(...)["num_patches"], which Ovis2's image processor does not return (seen: KeyError inside TRL's
    _generate_and_score_completions), so the trainer refuses that setting before TRL builds anything, naming the fix;
    with the fix (the tiny model's own setting) the same trainer builds."""
    from unittest import mock

    from trl import GRPOConfig, GRPOTrainer

    from fixtures.testing import zen_image_dataset
    from trl_mdi import MDIGRPOTrainer

    path = str(tiny_vlm_dir("ovis2"))
    processor = AutoProcessor.from_pretrained(path)
    assert processor.image_processor.crop_to_patches is False
    with pytest.raises(KeyError, match="num_patches"):  # what TRL 1.16 runs on a batch with a cropped image
        processor.image_processor.crop_to_patches = True
        processor.image_processor(images=[shape_image(84, 1)], crop_to_patches=True, return_tensors="pt")["num_patches"]
    args = GRPOConfig(str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=2, num_generations=2)
    with mock.patch.object(GRPOTrainer, "__init__", side_effect=AssertionError("TRL was built")):
        with pytest.raises(ValueError, match=r"'ovis2' cannot train with its image processor's crop_to_patches=True.*"
                                             r"KeyError: 'num_patches'.*Fix: processor.image_processor.crop_to_patches"
                                             r" = False"):
            MDIGRPOTrainer(path, processing_class=processor, reward_funcs=[lambda **k: []], args=args,
                           train_dataset=zen_image_dataset(2))
    processor.image_processor.crop_to_patches = False
    MDIGRPOTrainer(path, processing_class=processor, reward_funcs=[lambda **k: [0.0] * len(k["prompts"])], args=args,
                   train_dataset=zen_image_dataset(2))


def test_minicpmv4_6_is_measured_exactly_and_refused_by_the_trainer(tiny_vlm_dir, tmp_path):
    """MiniCPM-V 4.6 (transformers 5.24): the probe equals eager attention on its full-attention layers, given the
    processor's inputs (target_sizes with the batch's packed pixel_values); the trainer refuses the family at
    construction, before TRL builds anything, because TRL 1.16's forwards cannot feed it (no target_sizes; the packed
    images sliced per row). Stock GRPOTrainer on the same model stops at its first image batch (checked when this
    refusal was written: "unexpected keyword argument 'crop_to_patches'")."""
    from unittest import mock

    from trl import GRPOConfig, GRPOTrainer

    from fixtures.testing import zen_image_dataset
    from fixtures.tiny import BUILD_ONLY_ARCHS, TINY_ARCHS
    from trl_mdi import MDIGRPOTrainer
    from trl_mdi.batch import encode_prompts

    assert "minicpmv4_6" in BUILD_ONLY_ARCHS and "minicpmv4_6" not in TINY_ARCHS
    path = tiny_vlm_dir("minicpmv4_6")
    processor = AutoProcessor.from_pretrained(path)
    facts = model_facts(AutoConfig.from_pretrained(path), processor)
    assert facts.measured_layers == (1, 3)  # Qwen3.5's decoder: linear, full, linear, full
    batch = _batch(processor, facts)
    assert "target_sizes" not in batch  # not among the inputs TRL's log-prob forward takes
    prompts = ["What colour is the shape in the image? Answer with a letter.", "How many shapes?", "Shape?"]
    _, fields = encode_prompts(processor, [[{"role": "user", "content": p}] for p in prompts],
                               [[shape_image(56, 1)], [], [shape_image(56, 2)]])
    assert batch["pixel_values"].shape[0] == 1 and fields["target_sizes"].shape[0] == 2  # one packed sequence
    batch["target_sizes"] = fields["target_sizes"]
    res = measure_modality_attention(_load(path), **batch)
    ref, _ = _eager_masses(path, batch)
    got = torch.stack([res.image, res.prompt_text, res.completion, res.special], dim=-1)[:, res.layers]
    err = (got.double() - ref).abs().max().item()
    assert res.layers == [1, 3] and err < 1e-5, f"minicpmv4_6: max |probe - eager| = {err:.2e}"
    print(f"\nminicpmv4_6: max |probe - eager| = {err:.1e} over layers {res.layers}")
    assert res.n_image.tolist() == [4, 0, 4]

    args = GRPOConfig(str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=2, num_generations=2)
    with mock.patch.object(GRPOTrainer, "__init__", side_effect=AssertionError("TRL was built")):
        for model in (str(path), _load(path)):
            with pytest.raises(ValueError, match=r"'minicpmv4_6' cannot be trained with TRL 1.16's GRPOTrainer.*"
                                                 r"target_sizes.*newer than transformers 5.17"):
                MDIGRPOTrainer(model, reward_funcs=[lambda **k: []], args=args, train_dataset=zen_image_dataset(2))


def test_llava_maps_only_square_images(tiny_vlm_dir):
    """LLaVA 1.5's image processor centre-crops a square, so a non-square image's token grid covers only its middle:
    no map rather than one drawn over the whole image."""
    from PIL import Image

    from trl_mdi.diagnostics.maps import image_token_grids

    processor = AutoProcessor.from_pretrained(tiny_vlm_dir("llava"))
    assert image_token_grids(processor, [shape_image(56, 1), shape_image(112, 2)]) == [(4, 4), (4, 4)]
    assert image_token_grids(processor, [shape_image(56, 1), Image.new("RGB", (112, 56))]) is None


def test_only_glm4v_garbles_a_typed_system_message(tiny_vlm_dir):
    """TRL hands every message's content as typed blocks; GLM-4.1V's official template prints a system message's
    content as it is, so the prompt holds the list's repr (``model_facts.typed_system_problem``, which the trainer
    warns about at construction when the prompts have a system turn). Every other family's template reads the
    blocks; the tiny GLM-4.5V (glm4v_moe) carries GLM-4.1V's template (chat_templates/SOURCES.md), so it garbles too."""
    from trl_mdi.attention.model_facts import typed_system_problem

    garbled = {arch for arch in TINY_ARCHS
               if typed_system_problem(AutoProcessor.from_pretrained(tiny_vlm_dir(arch))) is not None}
    assert garbled == {"glm4v", "glm4v_moe"}


def test_the_trainer_warns_when_glm4v_would_garble_the_prompts_system_turn(tiny_vlm_dir, tmp_path, caplog):
    """The construction-time warning, only when the prompts have a system turn (the A-OKVQA prep writes one)."""
    import logging

    from datasets import Dataset

    from fixtures.testing import shape_image
    from trl_mdi import MDIGRPOConfig, MDIGRPOTrainer

    def dataset(system):
        turns = [{"role": "system", "content": "Answer with one letter."}] if system else []
        return Dataset.from_dict({"prompt": [turns + [{"role": "user", "content": "What colour?"}]] * 2,
                                  "image": [shape_image(56, 0)] * 2})

    for system in (True, False):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            MDIGRPOTrainer(str(tiny_vlm_dir("glm4v")), reward_funcs=[lambda **k: [0.0] * len(k["prompts"])],
                           args=MDIGRPOConfig(str(tmp_path / str(system)), use_cpu=True, report_to="none",
                                              per_device_train_batch_size=2, num_generations=2),
                           train_dataset=dataset(system))
        warned = [r.getMessage() for r in caplog.records if "typed system message" in r.getMessage()]
        assert len(warned) == int(system), (system, warned)


@pytest.mark.parametrize("chunk", [512, 8])
def test_llama4_is_measured_exactly_where_transformers_runs_it(tiny_vlm_dir, chunk):
    """Llama 4 (a build-only family: the trainer refuses it, see below) through the probe API on the padded, mixed
    batch. Where transformers runs its forward (below 5.24; tested on 5.23), the probe equals eager attention on every layer, the
    RoPE layers' chunked attention and the NoPE layers' global attention alike; with 8-token chunks, smaller than the
    prompt, the RoPE layers (0 and 2) show no generated token the image (mass 0, counted image-blind) while the NoPE
    layers (1 and 3) do. Where it does not (transformers 5.24: ``TRANSFORMERS_FORWARD_PROBLEMS``), the forward fails
    as the table says, in eager attention too."""
    path = tiny_vlm_dir("llama4", attention_chunk_size=chunk)
    facts = model_facts(AutoConfig.from_pretrained(path))
    assert facts.layer_types == ("chunked_attention", "full_attention") * 2 and facts.measured_layers == (0, 1, 2, 3)
    batch = _batch(AutoProcessor.from_pretrained(path), facts)
    if transformers_forward_problem("llama4") is not None:
        for attn in (None, "eager"):
            with pytest.raises(AttributeError, match="image_outputs"):
                _load(path, attn)(**batch)
        return
    res = measure_modality_attention(_load(path), **batch)
    ref, _ = _eager_masses(path, batch)
    got = torch.stack([res.image, res.prompt_text, res.completion, res.special], dim=-1)[:, res.layers]
    err = (got.double() - ref).abs().max().item()
    assert res.layers == [0, 1, 2, 3] and err < 1e-5, f"llama4: max |probe - eager| = {err:.2e}"
    if chunk == 8:
        assert (res.image[[0, 2]][:, [0, 2]] == 0).all() and (res.image[[0, 2]][:, [1, 3]] > 0).all()
        assert res.image_blind_layers().tolist() == [2, 0, 2]
    else:
        assert (res.image[[0, 2]] > 0).all() and res.image_blind_layers().tolist() == [0, 0, 0]


def test_llama4_training_is_refused_at_construction(tiny_vlm_dir, tmp_path):
    """TRL 1.16's log-prob forward (its fused LM head) runs ``model.base_model`` and reads ``last_hidden_state``;
    Llama4ForConditionalGeneration has no backbone module (its base_model_prefix "model" names no attribute, so
    base_model is the model itself), so the first training step of TRL's own GRPOTrainer stops with AttributeError
    (seen on transformers 5.23; on 5.24 its forward fails before that). The trainer refuses Llama 4 at construction,
    by path and as an object, before TRL builds anything, naming the reason and the fix."""
    from unittest import mock

    from trl import GRPOConfig, GRPOTrainer

    from fixtures.testing import zen_image_dataset
    from trl_mdi import MDIGRPOTrainer

    path = str(tiny_vlm_dir("llama4"))
    args = GRPOConfig(str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=2, num_generations=2)
    for given in (path, AutoModelForImageTextToText.from_pretrained(path)):
        with mock.patch.object(GRPOTrainer, "__init__", side_effect=AssertionError("TRL was built")):
            with pytest.raises(ValueError, match=r"'llama4' cannot be trained with TRL 1\.16's GRPOTrainer: .*"
                                                 r"last_hidden_state.* Fix: "):
                MDIGRPOTrainer(given, reward_funcs=[lambda **k: []], args=args, train_dataset=zen_image_dataset(2))


def test_gemma3n_shared_kv_layers_are_measured_exactly_window_included(tiny_vlm_dir):
    """Gemma 3n's last layers share K/V: layers 2 (sliding) and 3 (full) compute no keys or values and attend with
    those of the last earlier layer of their kind (0 and 1), each with its own query and its own kind's mask. The
    probe measures every layer, shared ones included, equal to eager attention; with an 8-token window, smaller than
    the prompt, the sliding layers (0 and the shared 2) show no generated token the image, the full ones (1 and the
    shared 3) do."""
    path = tiny_vlm_dir("gemma3n", sliding_window=8)
    config = AutoConfig.from_pretrained(path)
    assert config.text_config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    facts = model_facts(config)
    assert facts.layer_types == ("sliding_attention", "full_attention") * 2 and facts.measured_layers == (0, 1, 2, 3)
    model = _load(path)
    assert [hasattr(layer.self_attn, "k_proj") for layer in model.model.language_model.layers] == [True, True, False,
                                                                                                    False]
    batch = _batch(AutoProcessor.from_pretrained(path), facts)
    res = measure_modality_attention(model, **batch)
    ref, _ = _eager_masses(path, batch)
    got = torch.stack([res.image, res.prompt_text, res.completion, res.special], dim=-1)[:, res.layers]
    err = (got.double() - ref).abs().max().item()
    assert res.layers == [0, 1, 2, 3] and err < 1e-5, f"gemma3n: max |probe - eager| = {err:.2e}"
    assert (res.image[[0, 2]][:, [0, 2]] == 0).all() and (res.image[[0, 2]][:, [1, 3]] > 0).all()
    assert res.image_blind_layers().tolist() == [2, 0, 2]
