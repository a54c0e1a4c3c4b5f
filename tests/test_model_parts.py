"""``trl_mdi.attention.model_parts``: the hidden state collected at chosen positions over whole or chunked forwards is
the backbone's own, and ``choice_logits`` (hidden state through the LM head's rows of the choice letters) equals the
full logits gathered at the letter position, NaN where there is no position or candidate."""

from __future__ import annotations

import math

import pytest
import torch

from fixtures.testing import shape_image
from trl_mdi.attention.model_parts import HiddenStates, choice_logits, gathered_parameters, hidden_states_at
from trl_mdi.batch import encode_prompts, policy_batch

QUESTION = "What colour is the shape in the image?\nA. red\nB. green\nC. blue\nD. yellow"


@pytest.fixture(scope="module")
def tiny():
    from fixtures.tiny import build_tiny_vlm

    return build_tiny_vlm("qwen2_5_vl")


def _batch(proc):
    """Three rollouts of different prompt and completion lengths (left-padded prompts, right-padded completions), two
    with an image."""
    prompts = [[{"role": "user", "content": QUESTION}], [{"role": "user", "content": "Shape?"}],
               [{"role": "user", "content": QUESTION + "\nLook closely."}]]
    images = [[shape_image(56, 0)], [], [shape_image(56, 2)]]
    completions = ["<think>x</think>\nAnswer: B", "red", "<think>round</think>\nAnswer: C"]
    tok = proc.tokenizer
    prompt_ids, fields = encode_prompts(proc, prompts, images)
    ids = [tok.encode(c, add_special_tokens=False) for c in completions]
    return policy_batch(prompt_ids, ids, pad_token_id=tok.pad_token_id, multimodal=fields), ids


def test_choice_logits_equal_the_full_logits_at_the_letter(tiny):
    model, proc = tiny
    batch, ids = _batch(proc)
    c, length = batch.logits_to_keep, batch.input_ids.shape[1]
    letters = proc.tokenizer.convert_tokens_to_ids(["ĠA", "ĠB", "ĠC", "ĠD"])
    positions = torch.tensor([len(ids[0]) - 1, -1, 2])  # row 1: no answer letter
    candidates = torch.tensor([letters, letters, letters[:3] + [-1]])  # row 2: three choices
    with torch.no_grad(), hidden_states_at(model.base_model, positions, c) as hidden:
        logits = model(**batch.model_inputs(), use_cache=False).logits.double()
    got = choice_logits(model, hidden.result(), candidates)
    assert got.dtype == torch.float32 and got.shape == (3, 4) and not got.requires_grad
    for row, t in enumerate(positions.tolist()):
        for k, token in enumerate(candidates[row].tolist()):
            if t < 0 or token < 0:
                assert math.isnan(got[row, k]), (row, k)
            else:  # the logit the full head gives at L - C - 1 + t, which predicts completion token t
                assert got[row, k].item() == pytest.approx(logits[row, length - c - 1 + t, token].item(), abs=1e-5)
    assert torch.isfinite(got[0]).all() and got[0].unique().numel() == 4  # four distinct letters: not vacuous


def test_hidden_states_are_collected_in_row_order_over_chunked_forwards(tiny):
    """TRL's log-prob path runs a batch in chunks: the rows collected chunk after chunk are the whole forward's."""
    model, proc = tiny
    batch, _ = _batch(proc)
    c = batch.logits_to_keep
    positions = torch.tensor([0, 1, c - 1])
    inputs = batch.model_inputs()
    with torch.no_grad():
        with hidden_states_at(model.base_model, positions, c) as whole:
            model(**inputs, use_cache=False)
        full = model.base_model(**inputs, use_cache=False).last_hidden_state
        # Chunks of 2 and 1 rows; the image tensors are split with the rows they belong to (row 0: the first image)
        per_image = inputs["pixel_values"].shape[0] // 2
        first = {**inputs, "input_ids": inputs["input_ids"][:2], "attention_mask": inputs["attention_mask"][:2],
                 "pixel_values": inputs["pixel_values"][:per_image], "image_grid_thw": inputs["image_grid_thw"][:1]}
        last = {**inputs, "input_ids": inputs["input_ids"][2:], "attention_mask": inputs["attention_mask"][2:],
                "pixel_values": inputs["pixel_values"][per_image:], "image_grid_thw": inputs["image_grid_thw"][1:]}
        for extra in ("mm_token_type_ids",):
            if extra in inputs:
                first[extra], last[extra] = inputs[extra][:2], inputs[extra][2:]
        with hidden_states_at(model.base_model, positions, c) as chunked:
            model(**first, use_cache=False)
            model(**last, use_cache=False)
    length = batch.input_ids.shape[1]
    want = torch.stack([full[row, length - c - 1 + t] for row, t in enumerate(positions.tolist())])
    assert [h.shape[0] for h in chunked] == [2, 1]
    torch.testing.assert_close(whole.result(), want)
    torch.testing.assert_close(chunked.result(), want, atol=1e-5, rtol=1e-5)


def test_nothing_collected_and_no_head_are_clear_errors():
    with pytest.raises(RuntimeError, match="collected nothing.*base_model"):
        HiddenStates().result()

    class Headless(torch.nn.Module):
        def get_output_embeddings(self):
            return None

    with pytest.raises(ValueError, match="Headless has no output embeddings"):
        choice_logits(Headless(), torch.zeros(1, 2), torch.zeros(1, 1, dtype=torch.long))


def test_gathered_parameters_without_deepspeed_leaves_them_as_they_are():
    weight = torch.nn.Parameter(torch.arange(4.0))
    with gathered_parameters([weight, None]) as (full, bias):
        assert full is weight and bias is None and weight.tolist() == [0.0, 1.0, 2.0, 3.0]
