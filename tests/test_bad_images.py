"""One unreadable image in the middle of a run: skipped and counted, or a clear error, never a crash mid-loader."""

import pytest
import torch
from datasets import Dataset, Image
from test_trainer import make_args, spread_reward

from trl_mdi.trainer import MDIGRPOTrainer


@pytest.fixture(scope="module")
def corrupted(grpo_train_dataset):
    """The training rows with row 1's image bytes truncated (a file damaged on disk after validation)."""
    ds = grpo_train_dataset.cast_column("image", Image(decode=False))
    rows = ds.to_list()
    rows[1]["image"] = {"bytes": rows[1]["image"]["bytes"][:40], "path": None}
    damaged = Dataset.from_list(rows, features=ds.features).cast_column("image", Image())
    return damaged, rows[1]["question_id"]


def test_unreadable_image_is_skipped_and_counted(tiny_vlm_dir, corrupted, tmp_path):
    corrupted, qid = corrupted
    trainer = MDIGRPOTrainer(str(tiny_vlm_dir("qwen2_5_vl")), reward_funcs=[spread_reward],
                             args=make_args(tmp_path, max_steps=1, per_device_train_batch_size=8),
                             train_dataset=corrupted)
    trainer.model.train()
    batch = None
    for b in trainer.get_train_dataloader():
        if any(x["question_id"] == qid for x in b):
            batch = b
            break
    assert batch is not None
    bad = [i for i, x in enumerate(batch) if x["question_id"] == qid]
    out = trainer._generate_and_score_completions(batch)
    assert (out["advantages"][bad] == 0).all()
    assert (out["tool_mask"][bad] == 0).all()  # out of the update
    good = [i for i in range(len(batch)) if i not in bad]
    assert out["tool_mask"][good].bool().any()
    assert trainer._metrics["train"]["data/bad_images"][-1] == len(bad)
    # And a whole run over the damaged data completes.
    trainer.train()
    assert trainer.state.global_step == 1


def test_skipped_rollouts_are_shown_as_skipped_in_the_rollout_log(tiny_vlm_dir, corrupted, tmp_path):
    """Issue 38: the step summary counted an unreadable image's rollouts as reward 0; they are shown as skipped, with
    no reward, and left out of the step's means. (mdi_balance makes the probe measure before the rewards, so the
    batch is logged as soon as it is scored.)"""
    corrupted, qid = corrupted
    trainer = MDIGRPOTrainer(str(tiny_vlm_dir("qwen2_5_vl")), reward_funcs=[spread_reward, "mdi_balance"],
                             args=make_args(tmp_path, max_steps=1, per_device_train_batch_size=8),
                             train_dataset=corrupted)
    trainer.model.train()
    batch = next(b for b in trainer.get_train_dataloader() if any(x["question_id"] == qid for x in b))
    bad = [i for i, x in enumerate(batch) if x["question_id"] == qid]
    trainer._generate_and_score_completions(batch)
    log = (tmp_path / "logs" / "rollouts.md").read_text()
    summary = log.split("### Step summary", 1)[1]
    assert f"| skipped (unreadable image: out of the update and of these means) | {len(bad)} |" in summary, summary
    if bad[0] < 2:  # among the rollouts written in full
        assert f"### Rollout {bad[0]} · group {bad[0] // 4} · reward — · advantage 0 · skipped (unreadable image)" \
            in log, log


def test_unreadable_image_can_stop_the_run_with_a_clear_error(tiny_vlm_dir, corrupted, tmp_path):
    corrupted, qid = corrupted
    trainer = MDIGRPOTrainer(str(tiny_vlm_dir("qwen2_5_vl")), reward_funcs=[spread_reward],
                             args=make_args(tmp_path, max_steps=1, per_device_train_batch_size=8,
                                            on_bad_image="error"),
                             train_dataset=corrupted)
    for b in trainer.get_train_dataloader():
        if any(x["question_id"] == qid for x in b):
            with pytest.raises(RuntimeError, match=rf"unreadable image.*{qid}.*on_bad_image='skip'"):
                trainer._generate_and_score_completions(b)
            return
    pytest.fail("the damaged row never came up")


def test_on_bad_image_is_validated(tmp_path):
    from trl_mdi.config import MDIGRPOConfig

    with pytest.raises(ValueError, match="on_bad_image must be"):
        MDIGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, on_bad_image="ignore")
    assert torch.is_grad_enabled()
