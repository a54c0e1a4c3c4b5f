"""The guarded reliance reward (``guarded_visual_gain``): its gate, steps, saturation, missing values, config errors,
its binding by the trainer, and what TRL's own advantage code makes of it.

The last tests run stock ``GRPOTrainer._generate_and_score_completions`` (TRL's sum-then-normalise, group-scaled
advantages) on scripted completions with per-rollout gains injected, so the property the reward is built for (equal
rewards inside a band give zero advantage) is checked against the code that trains, not against a copy of it.
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from trl_mdi import rewards as R
from trl_mdi.rewards import GuardedVisualGainReward, guarded_visual_gain

RIGHT = "<think> the shape is red</think>\nAnswer: A"  # right for label 0, clean format
NAN = float("nan")


def test_wrong_or_malformed_rollouts_get_zero_whatever_their_gain():
    completions = [RIGHT, "<think> the shape is red</think>\nAnswer: B", "Answer: A",
                   "<think> the shape is red</think>\nAnswer: A or B", "<think></think>\nAnswer: A",
                   "<think> red</think>\nAnswer: A\nmore"]
    out = guarded_visual_gain(completions, visual_gain_max=[5.0] * 6, label_idx=[0] * 6)
    assert out == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_steps_dead_zone_and_saturation():
    assert guarded_visual_gain.thresholds == pytest.approx([0.1, 0.3, 0.5])  # the registry's
    r = GuardedVisualGainReward(dead_zone=0.5, saturation=1.5, steps=3)
    assert r.thresholds == [0.5, 1.0, 1.5]
    gains = [-2.0, 0.0, 0.2, 0.4999, 0.5, 0.99, 1.0, 1.49, 1.5, 1.6, 3.0, 40.0]
    out = r([RIGHT] * len(gains), visual_gain_max=gains, label_idx=[0] * len(gains))
    third = 1 / 3
    assert out == pytest.approx([0, 0, 0, 0, third, third, 2 * third, 2 * third, 1, 1, 1, 1])
    # Inside the dead zone, inside a step and beyond saturation, different gains earn the same reward.
    assert len(set(out[:4])) == 1 and len(set(out[4:6])) == 1 and len(set(out[8:])) == 1
    # Monotone and bounded.
    assert out == sorted(out) and min(out) == 0.0 and max(out) == 1.0


def test_one_step_is_a_threshold():
    r = GuardedVisualGainReward(dead_zone=0.0, saturation=1.0, steps=1)
    assert r.thresholds == [1.0]
    assert r([RIGHT] * 3, visual_gain_max=[0.99, 1.0, 7.0], label_idx=[0] * 3) == [0.0, 1.0, 1.0]


def test_none_and_nan():
    out = guarded_visual_gain([RIGHT] * 5, visual_gain_max=[None, NAN, 2.0, 2.0, 2.0],
                                     label_idx=[0, 0, None, NAN, 0])
    assert out == [None, None, None, None, 1.0]
    # A wrong answer without a gain (no image) is not applicable, not 0: nothing was measured.
    assert guarded_visual_gain(["Answer: B"], visual_gain_max=[None], label_idx=[0]) == [None]
    with pytest.raises(ValueError, match="visual_gain_max"):
        guarded_visual_gain([RIGHT, RIGHT], visual_gain_max=[1.0], label_idx=[0, 0])


@pytest.mark.parametrize("kwargs, match", [
    ({"dead_zone": 0.5, "saturation": 0.5}, "dead_zone < saturation"),
    ({"dead_zone": -0.1}, "dead_zone < saturation"),
    ({"saturation": math.inf}, "finite"),
    ({"steps": 0}, "steps >= 1"),
    ({"steps": 2.0}, "steps >= 1"),
    ({"answer_pattern": "Answer: ("}, "answer_pattern|pattern"),
])
def test_bad_settings_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GuardedVisualGainReward(**kwargs)


def test_registry_binding_and_pickling():
    assert R.REWARD_REGISTRY["guarded_visual_gain"] is guarded_visual_gain
    assert R.required_reward_inputs(guarded_visual_gain) == ("visual_gain_max", "label_idx")
    bound = R.bind_think_format([guarded_visual_gain], answer_pattern=r"Final: (?P<letter>[A-Z])",
                                think_prefilled=True)[0]
    assert bound.answer_pattern == r"Final: (?P<letter>[A-Z])" and bound.think_prefilled
    assert guarded_visual_gain.answer_pattern != bound.answer_pattern  # the registry's instance unchanged
    # The bound copy reads the bound format: a prefilled think block, the run's answer line.
    assert bound([" the shape is red</think>\nFinal: A"], visual_gain_max=[2.0], label_idx=[0]) == [1.0]
    assert pickle.loads(pickle.dumps(bound)) == bound
    assert bound.__name__ == "guarded_visual_gain"


# ---------------------------------------------------------------------------------------------------
# Through TRL's advantage code
# ---------------------------------------------------------------------------------------------------


class InjectedGains:
    """A reward that calls ``reward`` with the next batch's per-rollout gains (a list per call) in place of the
    trainer's counterfactual forward, so a test sets the gains a group holds."""

    def __init__(self, reward, field: str, batches: list[list[float]]):
        self.reward, self.field, self.batches = reward, field, list(batches)
        self.__name__ = reward.__name__

    def __call__(self, completions, label_idx, choices=None, **kwargs):
        gains = self.batches.pop(0)
        assert len(gains) == len(completions)
        if self.field == "visual_gain_max":
            return self.reward(completions, visual_gain_max=gains, label_idx=label_idx, choices=choices)
        return self.reward(completions, **{self.field: gains})


def scripted_right_completions(monkeypatch):
    """TRL's generation replaced by RIGHT (then EOS) for every rollout: answer and format rewards tie in every group."""

    def generate(trainer, prompt_ids, images, multimodal_fields, num_generations):
        tok = trainer.processing_class.tokenizer
        ids = tok(RIGHT, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return [list(ids) for _ in prompt_ids], None

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", generate)


def advantages(tiny_vlm_dir, grpo_train_dataset, tmp_path, reward, field, gains, **config) -> torch.Tensor:
    n_prompts = len(gains) // 4
    rows = grpo_train_dataset.filter(lambda r: r["label_idx"] == 0).select(range(n_prompts))  # RIGHT is right for all
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none",
                      per_device_train_batch_size=len(gains), num_generations=4, max_completion_length=16, max_steps=1,
                      seed=0, disable_tqdm=True, **config)
    trainer = GRPOTrainer(str(tiny_vlm_dir("qwen2_5_vl")), args=args, train_dataset=rows,
                          reward_funcs=[R.mc_idx, R.think_format, InjectedGains(reward, field, [gains])])
    trainer.model.train()
    out = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    per_func = torch.tensor(trainer._metrics["train"]["rewards/mc_idx/mean"])
    assert per_func[-1] == 1.0  # the answer reward ties (all right): only the third reward can move anything
    return out["advantages"]


def test_a_group_inside_one_step_gets_zero_advantage_through_trl(tiny_vlm_dir, grpo_train_dataset, tmp_path,
                                                                  monkeypatch):
    scripted_right_completions(monkeypatch)
    # Group 1: every gain in the dead zone; group 2: every gain inside one step; group 3: every gain past
    # saturation. Weights 4:1:1, TRL's defaults (sum then normalise, scale_rewards="group": the group's std + 1e-4
    # divides).
    gains = [0.0, 0.02, 0.05, 0.099, 0.3, 0.35, 0.4, 0.49, 0.5, 0.7, 2.5, 4.0]
    adv = advantages(tiny_vlm_dir, grpo_train_dataset, tmp_path, guarded_visual_gain, "visual_gain_max", gains,
                     reward_weights=[4.0, 1.0, 1.0])
    assert adv.shape == (12,)
    assert torch.equal(adv, torch.zeros(12))


def test_a_group_across_steps_does_get_advantage_through_trl(tiny_vlm_dir, grpo_train_dataset, tmp_path,
                                                              monkeypatch):
    # The control of the test above: looking (0.6 nats) vs not (0.01) inside a group is what the reward is for.
    scripted_right_completions(monkeypatch)
    gains = [0.01, 0.01, 0.6, 0.6, 0.05, 0.35, 0.35, 3.0]
    adv = advantages(tiny_vlm_dir, grpo_train_dataset, tmp_path, guarded_visual_gain, "visual_gain_max", gains,
                     reward_weights=[4.0, 1.0, 1.0])
    assert (adv[:2] < -0.5).all() and (adv[2:4] > 0.5).all()
    assert adv[4] < adv[5] == adv[6] < adv[7]


def test_the_hazard_it_guards_against_a_tiny_difference_becomes_a_full_advantage(tiny_vlm_dir, grpo_train_dataset,
                                                                                tmp_path, monkeypatch):
    # The shipped mean form: gains that differ by 2e-4 nats per token, everything else tied. Group scaling divides by
    # the group's std + 1e-4, so the difference becomes most of a unit advantage (docs/rewards.md, group scaling).
    scripted_right_completions(monkeypatch)
    gains = [0.1000, 0.1001, 0.1002, 0.1003] * 2
    adv = advantages(tiny_vlm_dir, grpo_train_dataset, tmp_path, R.visual_gain, "visual_gain", gains,
                     reward_weights=[4.0, 1.0, 1.0])
    assert adv.abs().max() > 0.5
    # scale_rewards="none" leaves the difference at its size: ~1e-4 of advantage.
    scripted_right_completions(monkeypatch)
    adv_none = advantages(tiny_vlm_dir, grpo_train_dataset, tmp_path / "none", R.visual_gain, "visual_gain",
                          gains, reward_weights=[4.0, 1.0, 1.0], scale_rewards="none")
    assert adv_none.abs().max() < 1e-3
