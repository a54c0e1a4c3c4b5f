"""The per-rollout signal table (trl_mdi/signals.py): its names, its values, and the worked example of
docs/signals.md (adding a signal is one table entry)."""

from __future__ import annotations

import math

import pytest
import torch

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
    expected = {n for s in S.SIGNALS if s.compute is not None for n in S.expand(s, ["early", "middle", "late"])}
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
                          lambda x: x.segment["image_mass"], reward=True, metric=True)


def test_worked_example_adds_a_reward_field(tiny_vlm_dir, grpo_train_dataset, tmp_path, monkeypatch):
    """docs/signals.md: one entry in SIGNALS makes `image_mass_late` a reward input, a metric and a glossary row."""
    monkeypatch.setattr(S, "SIGNALS", (*S.SIGNALS, WORKED_EXAMPLE))
    seen: list[list] = []

    def late_look_reward(completions, image_mass_late, **kwargs):
        seen.append(list(image_mass_late))
        return [None if m is None else 10.0 * m for m in image_mass_late]

    checked = []
    original = S.rollout_signals

    def rollout_signals(attention, spec, ratio):
        values = original(attention, spec, ratio)
        late = attention.segment_metrics(spec)["late"]["image_mass"]
        torch.testing.assert_close(values["image_mass_late"], late.float())
        checked.append(True)
        return values

    monkeypatch.setattr(S, "rollout_signals", rollout_signals)
    args = MDIGRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none",
                         per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=1,
                         logging_steps=1, save_strategy="no", realtime_rollout_logging=False)
    model = str(tiny_vlm_dir("qwen2_5_vl"))
    trainer = MDIGRPOTrainer(model, reward_funcs=[late_look_reward], args=args, train_dataset=grpo_train_dataset)
    trainer.train()
    assert checked and seen and all(m is not None and 0 <= m <= 1 for m in seen[0])
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert "attention/image_mass_late" in log and "rewards/late_look_reward/mean" in log
    assert ("attention/image_mass_<segment>", WORKED_EXAMPLE.help) in S.glossary()
    # A segment the model does not have (2 layers: early and late only) is refused at construction.

    def middle_look_reward(completions, image_mass_middle, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"needs column\(s\) \['image_mass_middle'\]"):
        MDIGRPOTrainer(str(tiny_vlm_dir("qwen2_5_vl", num_layers=2)), reward_funcs=[middle_look_reward], args=args,
                       train_dataset=grpo_train_dataset)
