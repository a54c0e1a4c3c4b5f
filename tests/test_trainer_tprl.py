"""TPRL wired into MDIGRPOTrainer: masks in the loss, advantages scaled, forwards counted."""

import pytest
import torch
from test_trainer import ForwardCounter, make_args, spread_reward
from trl import GRPOTrainer

from trl_mdi.trainer import MDIGRPOTrainer

TPRL_ALL = dict(enable_entropy_filtering=True, enable_perception_filtering=True, enable_trajectory_reweighting=True,
                top_p_entropy_tokens=0.25, top_p_perception_tokens=0.25)


@pytest.fixture(scope="module")
def model_dir(tiny_vlm_dir):
    return tiny_vlm_dir("qwen2_5_vl")


def test_all_three_parts_log_tprl_metrics_and_train(model_dir, grpo_train_dataset, tmp_path):
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], args=make_args(tmp_path, **TPRL_ALL),
                             train_dataset=grpo_train_dataset)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for key in ("tprl/entropy_token_fraction", "tprl/perception_token_fraction", "tprl/sensitivity_score_mean",
                "tprl/scaling_factor_mean", "tprl/scaling_factor_min", "tprl/scaling_factor_max"):
        assert key in logs[0], key
    # 8-token completions, top-p 0.25: each filter keeps ceil(0.25 * 8) = 2 of 8 tokens per sequence.
    assert logs[0]["tprl/entropy_token_fraction"] == pytest.approx(0.25)
    assert logs[0]["tprl/perception_token_fraction"] == pytest.approx(0.25)
    assert logs[0]["tprl/scaling_factor_mean"] == pytest.approx(1.0, abs=1e-5)
    assert logs[0]["tprl/scaling_factor_min"] <= 1.0 <= logs[0]["tprl/scaling_factor_max"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (dict(enable_perception_filtering=True), 2),  # probe forward (real image) + perturbed forward
        (dict(enable_perception_filtering=True, num_iterations=2), 2),  # TRL's old-logp forward + perturbed
        (dict(enable_entropy_filtering=True, compute_attention_metrics=False), 1),
        (dict(enable_trajectory_reweighting=True, compute_attention_metrics=False), 2),
    ],
    ids=["perception", "perception_num_iterations2", "entropy_only", "tas_without_attention"],
)
def test_never_a_third_forward(model_dir, grpo_train_dataset, tmp_path, monkeypatch, overrides, expected):
    counter = ForwardCounter(monkeypatch)
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], args=make_args(tmp_path, **overrides),
                             train_dataset=grpo_train_dataset)
    trainer.train()
    assert counter.per_generation and set(counter.per_generation) == {expected}, counter.per_generation


def test_masked_tokens_get_zero_gradient_and_kept_tokens_are_unchanged(model_dir, grpo_train_dataset, tmp_path,
                                                                        monkeypatch):
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                             args=make_args(tmp_path, max_steps=1, **TPRL_ALL), train_dataset=grpo_train_dataset)
    batch = next(iter(trainer.get_train_dataloader()))
    out = trainer._generate_and_score_completions(batch)
    keep = out["tool_mask"].bool() & out["completion_mask"].bool()
    assert 0 < keep.sum() < out["completion_mask"].sum()  # some tokens kept, some filtered
    captured = []
    original = GRPOTrainer._get_per_token_logps_and_entropies

    def spy(self, *args, **kwargs):
        logps, ent, aux = original(self, *args, **kwargs)
        if torch.is_grad_enabled():
            logps.retain_grad()
            captured.append(logps)
        return logps, ent, aux

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", spy)
    grads = {}
    assert torch.is_grad_enabled(), "a previous test left autograd disabled"
    for name, inputs in (("filtered", out), ("full", {k: v for k, v in out.items() if k != "tool_mask"})):
        captured.clear()
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, dict(inputs))
        loss.backward()
        grads[name] = captured[0].grad.detach().clone()
    filtered, full = grads["filtered"], grads["full"]
    assert torch.equal(filtered[~keep], torch.zeros_like(filtered[~keep]))  # exactly zero where masked
    assert full[~keep & out["completion_mask"].bool()].abs().sum() > 0  # ... and those tokens did have gradient
    torch.testing.assert_close(filtered[keep], full[keep], rtol=0, atol=1e-9)  # kept tokens: unchanged


def test_rows_without_image_are_not_filtered_and_are_counted(model_dir, grpo_train_dataset, tmp_path):
    ds = grpo_train_dataset.map(lambda ex, i: {"image": None if (i // 2) % 2 else ex["image"]}, with_indices=True)
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                             args=make_args(tmp_path, max_steps=1, per_device_train_batch_size=8, **TPRL_ALL),
                             train_dataset=ds)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()  # as during training: metrics go to the "train" bucket
    no_image = torch.tensor([x.get("image") is None for x in batch])
    assert no_image.any() and (~no_image).any()
    out = trainer._generate_and_score_completions(batch)
    # Entropy filtering still applies to them; perception cannot rank them, so it keeps all of their tokens.
    kept = out["tool_mask"].bool() & out["completion_mask"].bool()
    assert kept[no_image].sum() == out["completion_mask"][no_image].sum()
    assert kept[~no_image].sum() < out["completion_mask"][~no_image].sum()
    assert trainer._metrics["train"]["tprl/rows_without_image"][-1] == pytest.approx(no_image.float().mean().item())


def test_lora_with_tprl(model_dir, grpo_train_dataset, tmp_path):
    from peft import LoraConfig

    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], args=make_args(tmp_path, **TPRL_ALL),
                             train_dataset=grpo_train_dataset,
                             peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    assert "tprl/scaling_factor_mean" in trainer.state.log_history[0]


def test_perception_on_text_only_data_fails_at_start(model_dir, grpo_train_dataset, tmp_path):
    with pytest.raises(ValueError, match="has no 'image' or 'images' column"):
        MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                       args=make_args(tmp_path, enable_perception_filtering=True),
                       train_dataset=grpo_train_dataset.remove_columns(["image"]))


def test_the_placebo_trains_with_the_same_amount_of_filtering(model_dir, grpo_train_dataset, tmp_path):
    """tprl_placebo (issue 44's control arm): validated at construction, trains, keeps as many tokens per row as the
    real filters (the fractions below are T's) and the same multipliers' range, only not where the image was."""
    with pytest.raises(ValueError, match="tprl_placebo replaces what the perception signal decides"):
        make_args(tmp_path, enable_entropy_filtering=True, tprl_placebo=True)
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                             args=make_args(tmp_path, tprl_placebo=True, **TPRL_ALL), train_dataset=grpo_train_dataset)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[0]["tprl/perception_token_fraction"] == pytest.approx(0.25)
    assert logs[0]["tprl/scaling_factor_mean"] == pytest.approx(1.0, abs=1e-5)
