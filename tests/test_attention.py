"""The attention probe against materialised eager attention weights, on every tiny architecture."""


import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from fixtures.testing import eager_group_masses, grpo_batch, shape_image
from trl_mdi import signals as S
from trl_mdi.attention import (
    PROBE_ATTN_IMPLEMENTATION,
    image_token_ids,
    measure_modality_attention,
    probe_attention,
    template_text_exclusion_mask,
)
from trl_mdi.attention.metrics import layer_segments

ARCHS = ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "idefics3"]
def rows_of(res, segments="thirds"):
    """Per-rollout plain dicts of a probe result, as the trainer builds them (trl_mdi.signals)."""
    return S.rollout_rows(S.rollout_signals(res, segments, 2.0))


MODEL_KEYS = ("input_ids", "attention_mask", "completion_mask")


def _load(path, attn="sdpa"):
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    return model.eval()


def _mixed_batch(processor, image_size=56):
    # Rows: image + long prompt, no image (text only), image + short prompt; completions of 5, 2, 7 tokens,
    # so both the left padding of prompts and the right padding of completions vary.
    return grpo_batch(
        processor,
        ["What colour is the shape in the image? Answer with a letter.", "How many shapes?", "Shape?"],
        [shape_image(image_size, 1), None, shape_image(image_size, 2)],
        [5, 2, 7],
        seed=3,
    )


def _mm(batch):
    return {k: v for k, v in batch.items() if k not in MODEL_KEYS}


def _reference_groups(model, batch, exclusion=None):
    ids, am, cm = batch["input_ids"], batch["attention_mask"].bool(), batch["completion_mask"].bool()
    img = torch.isin(ids, torch.tensor(image_token_ids(model.config))) & am
    pos = torch.arange(ids.shape[1])
    first = torch.where(cm, pos, ids.shape[1]).amin(dim=1, keepdim=True)
    comp = (pos >= first) & am
    prompt = am & ~comp & ~img
    special = prompt & exclusion if exclusion is not None else torch.zeros_like(prompt)
    return torch.stack([img, prompt & ~special, comp & ~img, special], dim=-1)


def _eager_reference(path, batch, query_mask, exclusion=None, model=None):
    eager = model if model is not None else _load(path, "eager")
    with torch.no_grad():
        out = eager(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_attentions=True, **_mm(batch)
        )
    groups = _reference_groups(eager, batch, exclusion)
    return eager_group_masses(out.attentions, groups, query_mask), groups


def _stack(res):
    return torch.stack([res.image, res.prompt_text, res.completion, res.special], dim=-1)


@pytest.fixture(scope="module", params=ARCHS)
def arch_setup(request, tiny_vlm_dir):
    path = tiny_vlm_dir(request.param)
    processor = AutoProcessor.from_pretrained(path)
    return request.param, path, _load(path), processor


def test_probe_matches_eager_attention(arch_setup):
    arch, path, model, processor = arch_setup
    batch = _mixed_batch(processor)
    res = measure_modality_attention(model, **batch)
    ref, groups = _eager_reference(path, batch, batch["completion_mask"].bool())
    got = _stack(res)
    assert got.shape == (3, model.config.get_text_config().num_hidden_layers, 4)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.sum(-1), torch.ones(got.shape[:2]), atol=1e-5, rtol=0)
    assert res.n_image.tolist() == groups[..., 0].sum(1).tolist()
    assert res.n_image[1] == 0 and res.n_image[0] > 0 and res.n_image[2] > 0
    assert res.n_prompt_text.tolist() == groups[..., 1].sum(1).tolist()
    assert res.n_queries.tolist() == [5, 2, 7]
    rows = rows_of(res)
    assert rows[1]["mdi"] is None and rows[1]["mdi_balance"] is None  # text-only row: no made-up 1.0
    assert rows[0]["mdi"] is not None and rows[0]["mdi"] > 0
    assert set(layer_segments(res.num_layers)) == {"early", "middle", "late", "all"}
    assert set(rows[0]) >= {f"{k}_{s}" for k in ("mdi", "aei_text", "aei_image") for s in ("early", "middle", "late")}
    assert set(rows[0]) >= {"mdi", "aei_text", "aei_image", "mdi_balance", "image_mass", "n_image", "n_queries"}


def test_probe_leaves_outputs_and_implementation_unchanged(arch_setup):
    arch, path, model, processor = arch_setup
    batch = _mixed_batch(processor)
    text_cfg = model.config.get_text_config()
    before = text_cfg._attn_implementation
    with torch.no_grad():
        plain = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **_mm(batch)).logits
        from trl_mdi.attention import token_layout  # the trainer's per-call layout path

        def layout_fn(kw):
            return token_layout(kw["input_ids"], kw["attention_mask"], batch["completion_mask"], image_token_ids(model.config),
                           None, None, "completion")

        with probe_attention(model, layout_fn) as state:
            assert text_cfg._attn_implementation == PROBE_ATTN_IMPLEMENTATION
            probed = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **_mm(batch)).logits
    assert text_cfg._attn_implementation == before
    assert torch.equal(plain, probed)
    assert state.result().image.shape[0] == 3
    # Exception-safe: an error inside the block restores the implementation and removes the hook.
    with pytest.raises(RuntimeError, match="boom"):
        with probe_attention(model, layout_fn):
            raise RuntimeError("boom")
    assert text_cfg._attn_implementation == before
    assert not model.base_model._forward_pre_hooks


def test_lora_wrapped_model_matches_eager(tiny_vlm_dir):
    from peft import LoraConfig, get_peft_model

    path = tiny_vlm_dir("qwen2_5_vl")
    processor = AutoProcessor.from_pretrained(path)
    torch.manual_seed(0)
    peft_model = get_peft_model(
        _load(path, "eager"), LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    ).eval()
    batch = _mixed_batch(processor)
    ref, _ = _eager_reference(path, batch, batch["completion_mask"].bool(), model=peft_model)
    peft_model.get_base_model().set_attn_implementation({"text_config": "sdpa"})
    res = measure_modality_attention(peft_model, **batch)
    torch.testing.assert_close(_stack(res).double(), ref, atol=1e-5, rtol=0)
    # The adapters change the attention: the LoRA numbers differ from the base model's.
    base = measure_modality_attention(_load(path), **batch)
    assert (_stack(base) - _stack(res)).abs().max() > 1e-4


def test_content_text_keys_move_specials_and_system_turn(tiny_vlm_dir):
    path = tiny_vlm_dir("qwen2_5_vl")
    processor = AutoProcessor.from_pretrained(path)
    model = _load(path)
    batch = _mixed_batch(processor)
    excl = template_text_exclusion_mask(batch["input_ids"], processor.tokenizer, image_token_ids(model.config))
    res = measure_modality_attention(model, **batch, text_keys="content", tokenizer=processor.tokenizer)
    ref, groups = _eager_reference(path, batch, batch["completion_mask"].bool(), exclusion=excl)
    torch.testing.assert_close(_stack(res).double(), ref, atol=1e-5, rtol=0)
    assert (res.n_special > 0).all() and (res.special > 0).all()
    start = processor.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert excl[batch["input_ids"] == start].all()
    # Prompt text now holds the user's words only: fewer keys than with text_keys="all".
    res_all = measure_modality_attention(model, **batch)
    assert (res.n_prompt_text < res_all.n_prompt_text).all()
    assert (res.n_prompt_text + res.n_special == res_all.n_prompt_text).all()


def test_prompt_phase_queries(tiny_vlm_dir):
    path = tiny_vlm_dir("qwen2_5_vl")
    processor = AutoProcessor.from_pretrained(path)
    model = _load(path)
    batch = _mixed_batch(processor)
    res = measure_modality_attention(model, **batch, query_phase="prompt")
    groups = _reference_groups(model, batch)
    pos = torch.arange(batch["input_ids"].shape[1])
    last_img = torch.where(groups[..., 0], pos, -1).amax(dim=1, keepdim=True)
    queries = groups[..., 1] & (pos > last_img)
    ref, _ = _eager_reference(path, batch, queries)
    torch.testing.assert_close(_stack(res).double(), ref, atol=1e-5, rtol=0)
    assert (res.completion.abs() < 1e-6).all()  # prompt queries cannot see the completion (causal)
    assert res.n_queries.tolist() == queries.sum(1).tolist()


def test_image_token_maps_sum_to_image_mass(tiny_vlm_dir):
    path = tiny_vlm_dir("qwen2_5_vl")
    processor = AutoProcessor.from_pretrained(path)
    model = _load(path)
    batch = _mixed_batch(processor)
    res = measure_modality_attention(model, **batch, image_map_rows=[0, 1])
    assert set(res.image_token_mass) == {0, 1}
    m0 = res.image_token_mass[0]
    assert m0.shape == (res.num_layers, int(res.n_image[0]))
    torch.testing.assert_close(m0.sum(-1), res.image[0], atol=1e-5, rtol=0)
    assert res.image_token_mass[1].numel() == 0  # the text-only row has no image tokens


def test_empty_completion_row_is_nan_and_flagged(tiny_vlm_dir):
    path = tiny_vlm_dir("qwen2_5_vl")
    processor = AutoProcessor.from_pretrained(path)
    model = _load(path)
    batch = _mixed_batch(processor)
    L = batch["input_ids"].shape[1]
    # Row 0's completion is masked out entirely (e.g. a truncated completion with mask_truncated_completions).
    c = batch["completion_mask"].clone()
    c[0] = 0
    batch["completion_mask"] = c
    res = measure_modality_attention(model, **batch)
    assert res.valid.tolist() == [False, True, True]
    assert torch.isnan(res.image[0]).all() and not torch.isnan(res.image[2]).any()
    assert rows_of(res)[0]["mdi"] is None
    assert batch["input_ids"].shape[1] == L


def test_text_only_batch_has_masses_but_no_mdi(tiny_vlm_dir):
    path = tiny_vlm_dir("qwen2_5_vl")
    processor = AutoProcessor.from_pretrained(path)
    model = _load(path)
    batch = grpo_batch(processor, ["Say hi.", "Count to three please."], [None, None], [3, 4])
    res = measure_modality_attention(model, **batch)
    assert (res.n_image == 0).all()
    assert (res.image == 0).all()
    torch.testing.assert_close(res.prompt_text + res.completion, torch.ones_like(res.image), atol=1e-5, rtol=0)
    assert all(r["mdi"] is None for r in rows_of(res))


def test_bad_inputs_give_clear_errors(tiny_vlm_dir):
    path = tiny_vlm_dir("qwen2_5_vl")
    processor = AutoProcessor.from_pretrained(path)
    model = _load(path)
    batch = _mixed_batch(processor)
    with pytest.raises(ValueError, match="completion_mask has shape"):
        measure_modality_attention(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"][:, 1:])
    with pytest.raises(ValueError, match="input_ids must be"):
        measure_modality_attention(model, batch["input_ids"][0], batch["attention_mask"][0], batch["completion_mask"][0])
    with pytest.raises(ValueError, match="query phase"):
        measure_modality_attention(model, **batch, query_phase="decode")
    with pytest.raises(ValueError, match="needs the tokenizer"):
        measure_modality_attention(model, **batch, text_keys="content")

    from transformers import Qwen2Config, Qwen2ForCausalLM

    text_lm = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1))
    ids = torch.randint(0, 64, (1, 6))
    with pytest.raises(ValueError, match="model type 'qwen2' has no image_token_id"):
        measure_modality_attention(text_lm, ids, torch.ones_like(ids), torch.ones_like(ids))


def test_generated_placeholder_tokens_are_not_image_keys(tiny_vlm_dir):
    path = tiny_vlm_dir("qwen2_5_vl")
    processor = AutoProcessor.from_pretrained(path)
    model = _load(path)
    batch = _mixed_batch(processor)
    before = measure_modality_attention(model, **batch)
    # The policy sampled a video placeholder token inside its completion (TRL does not suppress that one).
    ids = batch["input_ids"].clone()
    first = int(batch["completion_mask"][0].nonzero()[0])
    ids[0, first + 1] = model.config.video_token_id
    res = measure_modality_attention(model, **{**batch, "input_ids": ids})
    assert res.n_image.tolist() == before.n_image.tolist()
    assert res.n_completion.tolist() == before.n_completion.tolist()
