"""Online group filtering: groups outside [filter_low, filter_high] leave the update entirely."""

import pytest
import torch
from test_trainer import make_args

from trl_mdi.trainer import MDIGRPOTrainer


def group_reward(completions, label_idx, **kwargs):
    """All-right for prompts whose answer is A, mixed (by completion length parity) for the others."""
    return [1.0 if lab == 0 else float(len(c[0]["content"]) % 2) for c, lab in zip(completions, label_idx)]


def test_dropped_groups_leave_advantages_loss_mask_and_normaliser(tiny_vlm_dir, grpo_train_dataset, tmp_path):
    args = make_args(tmp_path, per_device_train_batch_size=16, online_filtering=True, filter_key="group_reward",
                     filter_low=0.01, filter_high=0.99, realtime_rollout_logging=False)
    trainer = MDIGRPOTrainer(str(tiny_vlm_dir("qwen2_5_vl")), reward_funcs=[group_reward], args=args,
                             train_dataset=grpo_train_dataset)
    trainer.model.train()
    for batch in trainer.get_train_dataloader():  # a batch mixing all-right and mixed groups
        labels = torch.tensor([x["label_idx"] for x in batch])
        if (labels == 0).any() and (labels != 0).any():
            break
    out = trainer._generate_and_score_completions(batch)
    all_right = (labels == 0)
    assert all_right.any() and (~all_right).any(), "fixture should mix all-right and mixed groups"
    dropped = ~out["tool_mask"].bool().any(dim=1)
    assert dropped[all_right].all()  # every all-right group is dropped
    assert (out["advantages"][dropped] == 0).all()
    kept_tokens = (out["completion_mask"] * out["tool_mask"]).sum()
    assert int(out["num_items_in_batch"]) == int(kept_tokens)  # normaliser over kept groups only
    frac = trainer._metrics["train"]["filter/groups_dropped_frac"][-1]
    assert frac == pytest.approx(dropped.float().mean().item())


def test_filter_key_must_name_a_reward(tiny_vlm_dir, grpo_train_dataset, tmp_path):
    with pytest.raises(ValueError, match="filter_key 'accuracy' is not one of the rewards"):
        MDIGRPOTrainer(str(tiny_vlm_dir("qwen2_5_vl")), reward_funcs=[group_reward],
                       args=make_args(tmp_path, online_filtering=True, filter_key="accuracy"),
                       train_dataset=grpo_train_dataset)


def test_filter_range_is_validated(tmp_path):
    from trl_mdi.config import MDIGRPOConfig

    with pytest.raises(ValueError, match="filter_low"):
        MDIGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, filter_low=0.9, filter_high=0.1)
