"""fixtures.warmup: the supervised warm start and the held-out accuracy helper (fast; no learning guarantee).

The learning itself (accuracy rising under GRPO, the blank-image control at chance) is measured by
benchmarks/learning_curve.py, which takes minutes; here we only check the pieces it and `make demo` rely on.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from fixtures.warmup import (
    WarmupRecipe,
    evaluate_accuracy,
    main,
    score_completions,
    sft_dataset,
    synthetic_dataset,
    target_completion,
    warm_start,
)
from trl_mdi.rewards import extract_choice_letter, mc_idx, think_format

# A smaller model than the benchmark's, trained hard on a few examples: enough to learn the answer format.
SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vision_depth=1,
             vision_hidden_size=32, vision_num_heads=2, vision_intermediate_size=64)


def test_score_completions_hand_made():
    completions = [
        "<think> image</think>\nAnswer: A",  # right, clean
        [{"role": "assistant", "content": "<think> image</think>\nAnswer: B"}],  # wrong (label C), clean
        "<think> image</think> D",  # right, lenient format ok, not clean (no "Answer:")
        "Answer: B",  # right, no think block
        "no idea",  # no letter
    ]
    r = score_completions(completions, [0, 2, 3, 1, 0], ended=[True, True, True, True, False])
    assert r.accuracy == pytest.approx(3 / 5)
    assert r.format_rate == pytest.approx(3 / 5)
    assert r.clean_rate == pytest.approx(2 / 5)
    assert r.answered_rate == pytest.approx(4 / 5)
    assert r.letters == {"A": 1, "B": 2, "D": 1, "": 1}
    # Same verdicts as the rewards GRPO trains on.
    assert [x == 1.0 for x in mc_idx(completions, [0, 2, 3, 1, 0])] == [True, False, True, True, False]
    assert sum(think_format(completions)) == 2  # the asked format: "<think> image</think> D" is not it
    # A clean answer that did not stop at end-of-sequence is not clean; the letter still counts.
    r = score_completions(["<think> image</think>\nAnswer: A"], [0], ended=[False])
    assert (r.accuracy, r.clean_rate) == (1.0, 0.0)
    # Letters beyond the row's choices are not answers.
    assert score_completions(["Answer: E"], [0], num_choices=4).answered_rate == 0.0
    with pytest.raises(ValueError, match="2 completions but 1 labels"):
        score_completions(["A", "B"], [0])


def test_target_completion_fits_grpo_budget(tiny_vlm_dir):
    """The warm-up target must fit max_completion_length=8 with its end-of-sequence token, and score 1 + 1."""
    from transformers import AutoProcessor

    tok = AutoProcessor.from_pretrained(tiny_vlm_dir("qwen2_vl")).tokenizer
    text = target_completion("red", 3)
    assert len(tok(text, add_special_tokens=False)["input_ids"]) + 1 <= 8
    assert think_format([text]) == [1.0]
    assert extract_choice_letter(text, 4) == "D"
    assert "red" not in text  # the default reasoning does not give the answer away
    assert "red" in target_completion("red", 0, think="{answer}")


class _ScriptedModel(torch.nn.Module):
    """Stands in for a VLM: `generate` appends a scripted completion per row and records its arguments."""

    def __init__(self, tokenizer, image_token_id, answers):
        super().__init__()
        self.tok, self.answers, self.calls = tokenizer, list(answers), []
        self.config = SimpleNamespace(image_token_id=image_token_id)
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return self.anchor.device

    def generate(self, input_ids, **kwargs):
        self.calls.append({"training": self.training, **{k: v for k, v in kwargs.items() if not torch.is_tensor(v)}})
        rows = []
        for _ in range(input_ids.shape[0]):
            ids = self.tok(self.answers.pop(0), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            rows.append(ids)
        width = max(map(len, rows))
        pad = [r + [self.tok.pad_token_id] * (width - len(r)) for r in rows]
        return torch.cat([input_ids, torch.tensor(pad)], dim=1)


def test_evaluate_accuracy_hand_made(tiny_vlm_dir):
    """Prompts rendered with their image, greedy, image token suppressed, scored per row, mode restored."""
    from transformers import AutoProcessor

    model_dir = tiny_vlm_dir("qwen2_vl")
    processor = AutoProcessor.from_pretrained(model_dir)
    ds = synthetic_dataset(5, split="validation", seed=3)
    labels = ds["label_idx"]
    letters = "ABCD"
    answers = [f"<think> image</think>\nAnswer: {letters[y]}" for y in labels[:3]]  # 3 right
    answers.append(f"<think> image</think>\nAnswer: {letters[(labels[3] + 1) % 4]}")  # wrong
    answers.append("<think> image</think>")  # no letter
    model = _ScriptedModel(processor.tokenizer, 7, answers)
    model.train()
    result = evaluate_accuracy(model, processor, ds, batch_size=2, max_new_tokens=8)
    assert result.accuracy == pytest.approx(3 / 5)
    assert result.answered_rate == pytest.approx(4 / 5)
    assert result.clean_rate == pytest.approx(4 / 5)
    assert result.completions == answers
    assert len(model.calls) == 3  # batches of 2, 2, 1
    assert all(c["do_sample"] is False and c["suppress_tokens"] == [7] and not c["training"] for c in model.calls)
    assert model.training  # restored


@pytest.fixture
def one_thread():
    """Tiny models gain little from a second thread and lose a lot when other jobs share the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_warm_start_saves_a_model_that_answers(tmp_path, one_thread):
    """A warm-up on a handful of examples: saved, reloaded, and its greedy answers parse (not a learning test)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    recipe = WarmupRecipe(model_size=SMALL, n_train=8, epochs=30, learning_rate=3e-3, batch_size=4)
    out = tmp_path / "warm"
    model, processor, info = warm_start(recipe, out, log=lambda *_: None)
    assert info["sft_steps"] == 60 and info["recipe"]["n_train"] == 8
    assert json.loads((out / "warmup.json").read_text())["recipe"]["think"] == "image"

    held_out = synthetic_dataset(8, split="validation")
    before = evaluate_accuracy(model, processor, held_out, max_new_tokens=8)
    reloaded = AutoModelForImageTextToText.from_pretrained(out)
    after = evaluate_accuracy(reloaded, AutoProcessor.from_pretrained(out), held_out, max_new_tokens=8)
    assert after.completions == before.completions  # what was saved is what was trained
    assert after.answered_rate == 1.0, after.completions
    assert after.format_rate == 1.0, after.completions
    # The same data GRPO reads: prompt, image, label and choices for the rewards; SFT adds the target completion.
    assert {"prompt", "image", "label_idx", "choices"} <= set(held_out.column_names)
    assert sft_dataset(held_out).column_names == ["image", "prompt", "completion"]


def test_cli_evaluate_scores_a_saved_model(tmp_path, one_thread, capsys):
    """`--evaluate DIR` (the demo's before/after line) scores the same held-out rows as the library call."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    recipe = WarmupRecipe(model_size=SMALL, n_train=8, epochs=30, learning_rate=3e-3, batch_size=4)
    out = tmp_path / "warm"
    warm_start(recipe, out, log=lambda *_: None)
    expected = evaluate_accuracy(AutoModelForImageTextToText.from_pretrained(out), AutoProcessor.from_pretrained(out),
                                 synthetic_dataset(8, split="validation"))
    assert main(["--evaluate", str(out), "--n_eval", "8", "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert f"held-out greedy (8 validation questions) of {out}: {expected.summary()}" in printed, printed
    assert main(["--evaluate", str(tmp_path), "--n_eval", "8"]) == 2  # no config.json there
    assert "no config.json" in capsys.readouterr().err


def test_cli_refuses_non_empty_out(tmp_path, capsys):
    (tmp_path / "x").write_text("keep me")
    assert main(["--out", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "new"), "--kinds", "color", "--option_order", "fixed", "--epochs", "0"]) == 2
