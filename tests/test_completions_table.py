"""The per-rollout signals in TRL's completions table line up with TRL's own rows on every path that changes when the
signals exist: measured in the training forward over gradient-accumulation slices with online filtering (after TRL
flushed its own log_extra queue), and in TRL's old-log-prob forward with steps_per_generation > 1 (a generation batch
logged at two steps). Values against plain forwards: tests/test_reliance_trainer.py; trackers: tests/test_trackers.py;
2 processes with images on one only: tests/test_trainer_distributed.py; vLLM: tests_vllm/test_colocate.py."""

import pytest
from test_reliance_trainer import capture, completions_table
from test_trainer import make_args, spread_reward

from trl_mdi.diagnostics.completions_table import CompletionColumns
from trl_mdi.trainer import MDIGRPOTrainer


@pytest.mark.parametrize("overrides, placement, batches_per_step", [
    (dict(gradient_accumulation_steps=2, per_device_train_batch_size=2, max_steps=1, online_filtering=True,
          filter_key="spread_reward", filter_low=0.5, filter_high=100.0), "training_forward", [0]),
    (dict(steps_per_generation=2, per_device_train_batch_size=2), "trl_forward", [0, 0]),
], ids=["training-forward-accumulation-filtering", "trl-forward-steps-per-generation"])
def test_table_rows_line_up(tiny_vlm_dir, grpo_train_dataset, tmp_path, monkeypatch, overrides, placement,
                            batches_per_step):
    seen = capture(monkeypatch)
    trainer = MDIGRPOTrainer(str(tiny_vlm_dir("qwen2_5_vl")), reward_funcs=[spread_reward],
                             args=make_args(tmp_path, reliance_signals=True, log_completions=True, **overrides),
                             train_dataset=grpo_train_dataset)
    assert trainer.run_plan.placement == placement
    trainer.train()
    tok = trainer.processing_class.tokenizer
    for step, index in enumerate(batches_per_step, start=1):
        batch, table = seen[index], completions_table(trainer, step)
        # Each row is its rollout: TRL's completion text and the trainer's values for the same rollout.
        assert [c[0]["content"] for c in table["completion"]] == tok.batch_decode(batch["completions"],
                                                                                  skip_special_tokens=True)
        for name, values in batch["signals"].items():
            assert table[name].tolist() == pytest.approx(values.tolist(), nan_ok=True, rel=0, abs=0), (step, name)
        assert table["mdi"].notna().all() and table["visual_gain"].nunique() > 1


def test_columns_follow_trls_rows():
    """Batches still being measured read NaN (None for text); a batch TRL's deques no longer hold is dropped; a column
    a batch lacks reads NaN there."""
    table = CompletionColumns(capacity=6)  # TRL's deques: 6 rows
    first = table.add(4)
    first.columns.update({"mdi": [1.0, 2.0, 3.0, 4.0], "image_evidence": ["a", "b", "c", "d"]})
    second = table.add(4)
    assert len(table.batches) == 2
    got = table.columns(6)
    assert got["mdi"][:2] == [3.0, 4.0] and [str(v) for v in got["mdi"][2:]] == ["nan"] * 4
    assert got["image_evidence"] == ["c", "d", None, None, None, None]
    second.columns.update({"mdi": [5.0, 6.0, 7.0, 8.0]})
    assert table.columns(4)["mdi"] == [5.0, 6.0, 7.0, 8.0]
    table.add(4)
    assert len(table.batches) == 2 and table.batches[0] is second  # the first batch left TRL's table
