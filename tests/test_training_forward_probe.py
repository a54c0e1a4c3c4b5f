"""Metrics-only attention: measured inside TRL's training forward, at zero extra forwards, without changing the run."""

import logging
import re

import pytest
import torch
from test_trainer import ForwardCounter, RecordingReward, make_args, spread_reward

from trl_mdi import measure_modality_attention
from trl_mdi.trainer import MDIGRPOTrainer


@pytest.fixture(scope="module")
def model_dir(tiny_vlm_dir):
    return tiny_vlm_dir("qwen2_5_vl")


def _train(model_dir, dataset, tmp_path, rewards=(spread_reward,), **overrides):
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=list(rewards), args=make_args(tmp_path, **overrides),
                             train_dataset=dataset)
    trainer.train()
    return trainer


@pytest.mark.parametrize(
    "overrides",
    [{}, {"steps_per_generation": 2, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 2},
     {"num_iterations": 2, "gradient_accumulation_steps": 2, "steps_per_generation": 1}],
    ids=["aligned", "two_slices", "num_iterations2"],
)
def test_metrics_only_adds_no_forward_and_logs_every_batch(model_dir, grpo_train_dataset, tmp_path, monkeypatch,
                                                           caplog, overrides):
    counter = ForwardCounter(monkeypatch)
    with caplog.at_level(logging.INFO, logger="trl_mdi"):
        trainer = _train(model_dir, grpo_train_dataset, tmp_path, max_steps=2, **overrides)
    assert trainer.run_plan.placement == "training_forward"
    assert "nothing reads it before the loss" in trainer.run_plan.placement_why
    assert "probe placement" in caplog.text and re.search(r"extra forwards per batch +none", caplog.text)
    assert counter.per_generation and set(counter.per_generation) == {0}, counter.per_generation
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all("attention/mdi" in h for h in logs), logs
    text = (tmp_path / "logs" / "attention.md").read_text()
    # one block per generation batch, every rollout of it (4 per batch)
    assert text.count("<!-- trl_mdi:end step=") == len(counter.per_generation)


def test_a_consumer_before_the_loss_keeps_todays_forward_and_says_why(model_dir, grpo_train_dataset, tmp_path,
                                                                      caplog):
    with caplog.at_level(logging.INFO, logger="trl_mdi"):
        trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward, RecordingReward()],
                                 args=make_args(tmp_path), train_dataset=grpo_train_dataset)
    assert trainer.run_plan.placement == "extra_forward"
    assert "reward recording_reward reads mdi" in trainer.run_plan.placement_why
    assert "policy forward with the attention probe" in caplog.text  # the printed plan says which forward runs
    tprl = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                          args=make_args(tmp_path, enable_entropy_filtering=True), train_dataset=grpo_train_dataset)
    assert tprl.run_plan.placement == "extra_forward"


def test_masses_from_the_training_forward_equal_the_probe_on_the_same_rollouts(model_dir, grpo_train_dataset,
                                                                                tmp_path, monkeypatch):
    """Two shuffled slices per generation batch: reassembled in generation order, the masses equal
    measure_modality_attention (exact against eager attention in test_families) on the very rollouts."""
    checked, outputs = [], []
    original_finish = MDIGRPOTrainer._finish_batch

    def finish_batch(trainer, out, inputs, record):
        original_finish(trainer, out, inputs, record)
        outputs.append({k: v.clone() if torch.is_tensor(v) else v for k, v in out.items()})  # before TRL shuffles

    original_signals = MDIGRPOTrainer._batch_signals

    def batch_signals(trainer, record, mode):  # called once the batch's last slice has been measured
        got, out = record.forward.attention, outputs[-1]
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        completion = torch.cat([torch.zeros_like(out["prompt_mask"]), out["completion_mask"]], dim=1)
        mm = {k: out[k] for k in ("pixel_values", "image_grid_thw") if k in out}
        mm["mm_token_type_ids"] = out["mm_token_type_ids"]  # TRL's output already extends them over the completion
        assert mm["mm_token_type_ids"].shape == ids.shape
        with torch.no_grad():
            ref = measure_modality_attention(trainer.model, ids, mask, completion, **mm)
        for group in ("image", "prompt_text", "completion"):
            torch.testing.assert_close(getattr(got, group), getattr(ref, group), atol=1e-5, rtol=0, equal_nan=True)
        checked.append(len(ids))
        return original_signals(trainer, record, mode)

    monkeypatch.setattr(MDIGRPOTrainer, "_finish_batch", finish_batch)
    monkeypatch.setattr(MDIGRPOTrainer, "_batch_signals", batch_signals)
    _train(model_dir, grpo_train_dataset, tmp_path, max_steps=2, steps_per_generation=2,
           gradient_accumulation_steps=2, per_device_train_batch_size=2)
    assert checked == [4, 4]  # both slices measured before the optimizer step: under the generating weights


@pytest.mark.parametrize("gradient_checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_parameters_are_identical_with_the_probe_on_and_off(model_dir, grpo_train_dataset, tmp_path, monkeypatch,
                                                            gradient_checkpointing):
    calls = []
    import trl_mdi.attention.probe as probe

    original = probe._ProbeState.record

    def record(state, *args, **kwargs):
        calls.append(1)
        return original(state, *args, **kwargs)

    monkeypatch.setattr(probe._ProbeState, "record", record)
    params = {}
    for on in (False, True):
        trainer = _train(model_dir, grpo_train_dataset, tmp_path / str(on), max_steps=3,
                         compute_attention_metrics=on, gradient_checkpointing=gradient_checkpointing)
        params[on] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert params[False].keys() == params[True].keys()
    for name in params[False]:
        assert torch.equal(params[False][name], params[True][name]), name
    n_layers = trainer.model.config.get_text_config().num_hidden_layers
    assert len(calls) == 3 * n_layers  # one measured forward per batch: a checkpointed recompute is not measured


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_the_probe_leaves_the_models_own_attention_computing_the_outputs(model_dir, implementation):
    """Inside the probe the model's kernel and mask function compute every layer's output (bit for bit), and the
    masses do not depend on which implementation the model uses."""
    from test_families import _batch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    batch = _batch(AutoProcessor.from_pretrained(model_dir))
    model = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation=implementation).eval()
    inputs = {k: v for k, v in batch.items() if k != "completion_mask"}
    with torch.no_grad():
        plain = model(**inputs).logits
    res = measure_modality_attention(model, **batch)  # runs the probe's forward
    from trl_mdi.attention import probe_attention, trailing_completion_layout

    with torch.no_grad(), probe_attention(model, trailing_completion_layout(4, [model.config.image_token_id])):
        probed = model(**inputs).logits
    assert torch.equal(plain, probed)
    sdpa = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    torch.testing.assert_close(res.image, measure_modality_attention(sdpa, **batch).image, atol=1e-6, rtol=0,
                               equal_nan=True)
