"""The per-rollout signal table (trl_mdi/signals.py): its names, its values, and the two worked examples of
docs/signals.md (adding a signal is one table entry: a probe signal and a counterfactual one)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from PIL import Image

from trl_mdi import MDIGRPOConfig, MDIGRPOTrainer
from trl_mdi import signals as S
from trl_mdi.attention import ModalityAttention


def probe_result(b: int = 3, layers: int = 3) -> ModalityAttention:
    g = torch.Generator().manual_seed(0)
    image = torch.rand(b, layers, generator=g) * 0.3
    text = torch.rand(b, layers, generator=g) * 0.4
    completion = 1 - image - text
    n_image = torch.tensor([4] * (b - 1) + [0])  # the last row has no image
    image[-1] = 0.0
    return ModalityAttention(image=image, prompt_text=text, completion=completion, special=torch.zeros(b, layers),
                             n_image=n_image, n_prompt_text=torch.full((b,), 20), n_special=torch.zeros(b, dtype=torch.long),
                             n_completion=torch.full((b,), 5), n_queries=torch.full((b,), 5))


def test_names_are_unique_and_every_computed_signal_is_produced():
    names = [s.name for s in S.SIGNALS]
    assert len(names) == len(set(names))
    values = S.rollout_signals(probe_result(), "thirds", 2.0)
    expected = {n for s in S.SIGNALS if s.source == S.PROBE for n in S.expand(s, ["early", "middle", "late"])}
    assert set(values) == expected
    assert all(v.shape == (3,) for v in values.values())


def test_values_follow_the_formulas():
    res = probe_result()
    values = S.rollout_signals(res, "thirds", 2.0)
    seg = res.segment_metrics("thirds")
    torch.testing.assert_close(values["mdi_late"], seg["late"]["mdi"], equal_nan=True)
    a_t, a_o = res.prompt_text.mean(1), res.image.mean(1)
    expected = (a_t[0] / 20) / (a_o[0] / 4)
    assert values["mdi"][0].item() == pytest.approx(expected.item(), rel=1e-5)
    assert values["mdi_balance"][0].item() == pytest.approx(max(0.0, 1 - abs(math.log(expected)) / math.log(2)), abs=1e-5)
    rows = S.rollout_rows(values)
    assert rows[2]["mdi"] is None and rows[2]["aei_text"] is None and rows[2]["n_image"] == 0  # no image: None
    metrics = S.batch_metrics(values)
    assert metrics["attention/rows_without_image"] == pytest.approx(1 / 3)
    assert metrics["attention/mdi"] == pytest.approx(float(values["mdi"][:2].mean()))


def test_reward_fields_and_reserved_names_come_from_the_table():
    assert "mdi_late" in S.field_names(["late"], reward=True) and "image_mass" not in S.field_names([], reward=True)
    assert S.reward_field_pattern("mdi_anything") and not S.reward_field_pattern("image_mass")
    assert S.reserved_segment_names() == {"all", "balance", "group_score"}
    with pytest.raises(ValueError, match="segment name 'group_score' is reserved"):
        S.check_segment_spec("group_score:0")


WORKED_EXAMPLE = S.Signal("image_mass_{segment}", "attention mass on image keys in one layer segment",
                          lambda x: x.segment["image_mass"], reward=True, metric=True, log="image {segment}")


def test_worked_example_adds_a_reward_field(tiny_vlm_dir, grpo_train_dataset, tmp_path, monkeypatch):
    """docs/signals.md: one entry in SIGNALS makes `image_mass_late` a reward input equal to the late segment's image
    mass that the probe measures over each row alone, the metric `attention/image_mass_late`, an `image late` column
    of the attention log, and a glossary row."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from trl_mdi.attention import measure_modality_attention

    monkeypatch.setattr(S, "SIGNALS", (*S.SIGNALS, WORKED_EXAMPLE))
    seen: list[dict] = []

    def late_look_reward(completions, image_mass_late, prompts, completion_ids, **kwargs):
        images = kwargs.get("images") or [[image] for image in kwargs["image"]]
        seen.append({"values": list(image_mass_late), "prompts": prompts, "ids": [list(c) for c in completion_ids],
                     "images": images})
        return [None if m is None else 10.0 * m for m in image_mass_late]

    args = MDIGRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none",
                         per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=1,
                         logging_steps=1, save_strategy="no", realtime_rollout_logging=True,
                         rollout_log_path=str(tmp_path / "logs" / "rollouts.md"),
                         attention_diag_log_path=str(tmp_path / "logs" / "attention.md"))
    model_dir = tiny_vlm_dir("qwen2_5_vl")
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[late_look_reward], args=args, train_dataset=grpo_train_dataset)
    trainer.train()
    # The reward got, by name, each rollout's late image mass: the probe over a plain, unpadded batch of that row alone.
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    assert len(seen) == 1 and len(seen[0]["values"]) == 4 and None not in seen[0]["values"]
    want = []
    for prompt, ids, images in zip(seen[0]["prompts"], seen[0]["ids"], seen[0]["images"]):
        text = processor.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        enc = processor(text=[text], images=[images], return_tensors="pt")
        p = enc["input_ids"].shape[1]
        input_ids = torch.cat([enc["input_ids"], torch.tensor([ids])], dim=1)
        extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
        extra["mm_token_type_ids"] = torch.cat([extra["mm_token_type_ids"], torch.zeros(1, len(ids), dtype=torch.long)],
                                               dim=1)
        completion_mask = torch.cat([torch.zeros(1, p, dtype=torch.long), torch.ones(1, len(ids), dtype=torch.long)], 1)
        result = measure_modality_attention(model, input_ids, torch.ones_like(input_ids), completion_mask, **extra)
        want.append(float(result.segment_metrics("thirds")["late"]["image_mass"][0]))
    torch.testing.assert_close(torch.tensor(seen[0]["values"], dtype=torch.double),
                               torch.tensor(want, dtype=torch.double), atol=1e-6, rtol=0)
    assert all(0 < m < 1 for m in want)
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert log["attention/image_mass_late"] == pytest.approx(sum(want) / len(want), abs=1e-5)
    assert "rewards/late_look_reward/mean" in log
    # The attention log: an `image late` column (one row per rollout, in order) and its mean in the step summary.
    text = (tmp_path / "logs" / "attention.md").read_text()
    table = text.split("### Rollouts (4)\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header[-3:] == ["image early", "image middle", "image late"]
    column = header.index("image late")
    assert [float(row.strip("|").split("|")[column]) for row in table[2:]] == pytest.approx(want, abs=1e-4)
    summary = text.split("### Step summary", 1)[1]
    mean = re.search(r"^\| image late \| ([^|]+?) \|", summary, re.M)
    assert mean and float(mean.group(1)) == pytest.approx(sum(want) / len(want), abs=1e-4)
    assert "image late" not in (tmp_path / "logs" / "rollouts.md").read_text()
    assert ("attention/image_mass_<segment>", WORKED_EXAMPLE.help) in S.glossary()
    # A segment the model does not have (2 layers: early and late only) is refused at construction.

    def middle_look_reward(completions, image_mass_middle, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"needs column\(s\) \['image_mass_middle'\]"):
        MDIGRPOTrainer(str(tiny_vlm_dir("qwen2_5_vl", num_layers=2)), reward_funcs=[middle_look_reward], args=args,
                       train_dataset=grpo_train_dataset)


# docs/signals.md's counterfactual example. token_gain is NaN outside the completion and on rows without an image, and
# NaN > 0 is False: the helped tokens are divided by the row's valid tokens (not by the padded width), so a row with
# none gets 0 / 0 = NaN (undefined: None for the rewards, out of the metric's mean), not 0.
GAIN_TOKEN_SHARE = S.Signal(
    "gain_token_share", "share of the completion's tokens that the image made likelier (g_t > 0)",
    lambda x: (x.token_gain > 0).sum(1) / (~x.token_gain.isnan()).sum(1),
    source=S.COUNTERFACTUAL, reward=True, metric=True, log="gain share", direction=S.LOW)


def test_gain_token_share_counts_only_valid_tokens():
    """The example's formula on a hand-made record: padding and image-less rows are no token, a row with no valid
    token is NaN (the naive mean over the padded width would say 0.5, 0, 0 for rows 0, 1, 3)."""
    from trl_mdi.answer_tokens import AnswerTokens

    inf, nan = math.inf, math.nan
    logps = torch.tensor([[-1.0, -2.0, -0.5, 9.0], [-1.0, -1.0, -1.0, -1.0], [-3.0, -3.0, 0.0, 0.0],
                          [-1.0, -1.0, -1.0, -1.0], [-1.0, -2.0, 0.0, 0.0]])
    cf = torch.tensor([[-1.5, -1.0, -2.5, 0.0], [-2.0, -2.0, -2.0, -2.0], [-4.0, -inf, 0.0, 0.0],
                       [-2.0, -2.0, -2.0, -2.0], [-3.0, -1.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]])
    has_image = torch.tensor([True, False, True, True, True])
    none = torch.full((5,), -1)
    answers = AnswerTokens(span_mask=torch.zeros(5, 4, dtype=torch.bool), letter_position=none, answer_index=none,
                           candidates=torch.full((5, 1), -1), n_choices=torch.zeros(5, dtype=torch.long))
    record = S.CounterfactualInputs.of(S.PolicyForward(logps=logps), S.CounterfactualForward(cf, None, answers), mask,
                                       has_image)
    got = GAIN_TOKEN_SHARE.compute(record)
    # row 0: gains 0.5, -1, 2 (the 4th token is padding: its +9 is no gain); row 1: no image; row 2: 1 and
    # -3 - (-inf) = +inf, both helped; row 3: no completion token; row 4: gains 2, -1 (its padding would give -5)
    torch.testing.assert_close(got, torch.tensor([2 / 3, nan, 1.0, nan, 0.5]), equal_nan=True)
    assert S.counterfactual_signals(record).keys().isdisjoint({"gain_token_share"})  # not in the built-in table


def test_counterfactual_example_is_a_field_of_the_counterfactual_forward(monkeypatch):
    """The entry alone makes `gain_token_share` a reward field that needs the counterfactual forward (the run plan
    turns it on for a reward reading it), one of the values computed from that forward, and a rollout-log column."""
    monkeypatch.setattr(S, "SIGNALS", (*S.SIGNALS, GAIN_TOKEN_SHARE))
    assert S.reads_counterfactual("gain_token_share") and not S.reads_attention("gain_token_share")
    assert "gain_token_share" in S.reliance_names() and "gain_token_share" in S.counterfactual_fields()
    assert "gain_token_share" in S.provided_fields([], attention=False, counterfactual=True)
    assert "gain_token_share" not in S.provided_fields(["late"], attention=True, counterfactual=False)
    assert ("gain_token_share", "gain share") in S.rollout_log_columns()
    assert "gain_token_share" not in dict(S.log_columns(["late"]))


def test_worked_example_counterfactual_signal(tiny_vlm_dir, grpo_train_dataset, tmp_path, monkeypatch):
    """docs/signals.md: one counterfactual entry in SIGNALS makes `gain_token_share` a reward input equal to the
    share of completion tokens with g_t > 0 in two plain forwards (the real image and the black counterfactual), the
    metric `reliance/gain_token_share`, a `gain share` column and summary row of the rollout log, and a glossary
    row."""
    from test_reliance_trainer import plain_reference
    from test_trainer import make_args
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from trl_mdi.cli.config_doc import render_signal_glossary

    monkeypatch.setattr(S, "SIGNALS", (*S.SIGNALS, GAIN_TOKEN_SHARE))
    seen: list[dict] = []

    def gain_share_reward(completions, gain_token_share, prompts, completion_ids, **kwargs):
        images = kwargs.get("images") or [[image] for image in kwargs["image"]]
        seen.append({"values": list(gain_token_share), "prompts": prompts, "ids": [list(c) for c in completion_ids],
                     "images": images})
        return [None if s is None else s - 0.5 for s in gain_token_share]

    model_dir = tiny_vlm_dir("qwen2_5_vl")
    args = make_args(tmp_path, max_steps=1, realtime_rollout_logging=True, log_full_rollouts_per_step=1)
    assert args.counterfactual_image == "black"
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[gain_share_reward], args=args,
                             train_dataset=grpo_train_dataset)
    trainer.train()

    # The reward got, by name, each rollout's share of helped tokens, recomputed from two plain forwards of each row
    # alone. No g_t lies within the two computations' float32 difference of 0 (so no sign is in doubt).
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    assert len(seen) == 1 and len(seen[0]["values"]) == 4 and None not in seen[0]["values"]
    batch = seen[0]
    want, smallest = [], math.inf
    for prompt, ids, images in zip(batch["prompts"], batch["ids"], batch["images"]):
        black = [Image.new("RGB", img.size, (0, 0, 0)) for img in images]
        real, _ = plain_reference(model, processor, prompt, images, ids)
        cf, _ = plain_reference(model, processor, prompt, black, ids)
        gains = real - cf
        want.append(float((gains > 0).double().mean()))
        smallest = min(smallest, float(gains.abs().min()))
    assert smallest > 1e-5, smallest
    assert 0 < min(want) and max(want) < 1  # the image helped some tokens of each rollout, not all
    assert batch["values"] == pytest.approx(want, abs=1e-6)
    # The metric: the batch's mean.
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert log["reliance/gain_token_share"] == pytest.approx(sum(want) / len(want), abs=1e-6)
    # The rollout log: a `gain share` column for the rollouts in the table, and the summary's mean.
    text = (tmp_path / "logs" / "rollouts.md").read_text()
    table = text.split("### Other rollouts (3)\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert "gain share" in header
    column = header.index("gain share")
    cells = [float(row.strip("|").split("|")[column]) for row in table[2:]]
    assert cells == pytest.approx(want[1:], abs=1e-4)
    summary = dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", text.split("### Step summary", 1)[1], re.M))
    assert float(summary["gain share mean"]) == pytest.approx(sum(want) / len(want), abs=1e-4)
    # It is no attention-log column: the attention log reads the probe signals only.
    assert "gain share" not in (tmp_path / "logs" / "attention.md").read_text()
    # The glossary, and trl_mdi.profile.validation's direction.
    assert ("reliance/gain_token_share", GAIN_TOKEN_SHARE.help) in S.glossary()
    assert f"| `reliance/gain_token_share` | {GAIN_TOKEN_SHARE.help} |" in render_signal_glossary().splitlines()
    assert S.direction("gain_token_share") == S.LOW
