"""MDIGRPOTrainer on tiny offline VLMs, single process on CPU."""

import dataclasses
import warnings

import pytest
import torch
from trl import GRPOTrainer

from trl_mdi.config import MDIGRPOConfig
from trl_mdi.trainer import MDIGRPOTrainer


def spread_reward(completions, **kwargs):
    """A reward with spread inside every group, so the policy gradient is not exactly zero."""
    return [float(len(c[0]["content"] if isinstance(c, list) else c) % 7) for c in completions]


class RecordingReward:
    """Records the attention fields it receives; returns the balance reward unchanged."""

    __name__ = "recording_reward"

    def __init__(self):
        self.calls = []

    def __call__(self, completions, mdi, mdi_balance, mdi_group_score, mdi_early, mdi_late, aei_text, **kwargs):
        self.calls.append(
            {"mdi": list(mdi), "balance": list(mdi_balance), "group": list(mdi_group_score),
             "early": list(mdi_early), "late": list(mdi_late), "aei_text": list(aei_text), "n": len(completions)}
        )
        return [0.0 if b is None else b for b in mdi_balance]


def make_args(tmp_path, **overrides):
    # mask_truncated_completions off (MDIGRPOConfig's default is on): a random tiny model never stops within 8 tokens,
    # so every completion would leave the loss and nothing would train.
    kw = dict(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4,
        num_generations=4, max_completion_length=8, max_steps=2, logging_steps=1, save_strategy="no", seed=0,
        learning_rate=1e-3, disable_tqdm=True, rollout_log_path=str(tmp_path / "logs" / "rollouts.md"),
        attention_diag_log_path=str(tmp_path / "logs" / "attention.md"), mask_truncated_completions=False,
    )
    kw.update(overrides)
    return MDIGRPOConfig(**kw)


class ForwardCounter:
    """Counts no-grad log-prob forwards of the policy per generation batch (TRL's and ours share one method)."""

    def __init__(self, monkeypatch):
        self.per_generation: list[int] = []
        self.scored_positions: list[int] = []  # logits_to_keep of each counted forward: what the LM head scores
        original_gen = GRPOTrainer._generate_and_score_completions
        original_fwd = GRPOTrainer._get_per_token_logps_and_entropies
        counter = self

        def gen(trainer, inputs):
            counter.per_generation.append(0)
            return original_gen(trainer, inputs)

        def fwd(trainer, model, *args, **kwargs):
            if not torch.is_grad_enabled() and model is trainer.model and counter.per_generation:
                counter.per_generation[-1] += 1
                counter.scored_positions.append(args[2] if len(args) > 2 else kwargs["logits_to_keep"])
            return original_fwd(trainer, model, *args, **kwargs)

        monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", gen)
        monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", fwd)


@pytest.fixture(scope="module")
def model_dir(tiny_vlm_dir):
    return tiny_vlm_dir("qwen2_5_vl")


def _metrics(trainer):
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs, "no training step was logged"
    return logs


def test_trains_logs_attention_and_hands_fields_to_rewards(model_dir, grpo_train_dataset, tmp_path):
    rec = RecordingReward()
    trainer = MDIGRPOTrainer(
        str(model_dir), reward_funcs=["mc_idx", "think_format", "mdi_balance", "mdi_group", spread_reward, rec],
        args=make_args(tmp_path), train_dataset=grpo_train_dataset,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)]
    assert changed, "no parameter changed"
    logs = _metrics(trainer)
    for key in ("attention/mdi", "attention/mdi_early", "attention/mdi_middle", "attention/mdi_late",
                "attention/aei_text", "attention/aei_image", "attention/image_mass", "attention/prompt_text_mass",
                "attention/rows_without_image", "rewards/mdi_balance/mean",
                "rewards/mc_idx/zero_spread_frac", "rewards/mdi_group/zero_spread_frac"):
        assert key in logs[0], key
    assert logs[0]["attention/rows_without_image"] == 0.0
    # Every rollout got its fields; they agree with each other (balance is clip(1 - |log mdi| / log R, 0, 1)).
    assert len(rec.calls) == 2 and rec.calls[0]["n"] == 4
    import math

    for call in rec.calls:
        for mdi, bal in zip(call["mdi"], call["balance"]):
            assert mdi is not None and mdi > 0
            assert bal == pytest.approx(max(0.0, min(1.0, 1 - abs(math.log(mdi)) / math.log(2.0))), abs=1e-5)
        # The group score is zero-mean within the (single, local) group.
        assert sum(call["group"]) == pytest.approx(0.0, abs=1e-5)
        assert all(v is not None for v in call["early"] + call["late"] + call["aei_text"])
    # The balance reward equals 2 * balance - 1 of what the recording reward saw.
    assert logs[0]["rewards/mdi_balance/mean"] == pytest.approx(
        sum(2 * b - 1 for b in rec.calls[0]["balance"]) / 4, abs=1e-4
    )


@pytest.mark.parametrize(
    "overrides, expected_extra",
    [
        ({}, 1),  # aligned steps: TRL runs no policy forward; the trainer runs exactly one
        ({"num_iterations": 2}, 0),  # TRL computes old log-probs: the probe rides on that forward
        ({"steps_per_generation": 2, "gradient_accumulation_steps": 2}, 1),
    ],
    ids=["aligned", "num_iterations2", "steps_per_generation2"],
)
def test_at_most_one_extra_forward_per_generation(model_dir, grpo_train_dataset, tmp_path, monkeypatch,
                                                  overrides, expected_extra):
    """A reward reads MDI before the loss: one no-grad forward measures it (tests/test_training_forward_probe.py
    covers the metrics-only case, which needs none)."""
    counts = {}
    for attention in (False, True):
        counter = ForwardCounter(monkeypatch)
        args = make_args(tmp_path / str(attention), compute_attention_metrics=attention, max_steps=2, **overrides)
        rewards = [spread_reward] + ([RecordingReward()] if attention else [])
        trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=rewards, args=args,
                                 train_dataset=grpo_train_dataset)
        trainer.train()
        assert counter.per_generation, "no generation happened"
        counts[attention] = counter.per_generation
        if attention and expected_extra:
            # Our own forward only measures attention: the LM head scores one position per row, not the completion
            # (the probe still measures every completion token: test_trains_logs_attention... checks the counts).
            assert set(counter.scored_positions) == {1}, counter.scored_positions
        monkeypatch.undo()
    stock, ours = counts[False], counts[True]
    assert len(stock) == len(ours)
    assert [o - s for s, o in zip(stock, ours)] == [expected_extra] * len(ours), (stock, ours)
    assert max(ours) == 1  # one no-grad policy forward per generation batch, whoever runs it


def test_lora_and_reference_model(model_dir, grpo_train_dataset, tmp_path):
    from peft import LoraConfig

    rec = RecordingReward()
    trainer = MDIGRPOTrainer(
        str(model_dir), reward_funcs=[spread_reward, rec], args=make_args(tmp_path, beta=0.1),
        train_dataset=grpo_train_dataset,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    trainer.train()
    logs = _metrics(trainer)
    assert "kl" in logs[0] and "attention/mdi" in logs[0]
    assert all(m is not None for call in rec.calls for m in call["mdi"])


def test_beta_with_separate_reference_model(model_dir, grpo_train_dataset, tmp_path):
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], args=make_args(tmp_path, beta=0.05),
                             train_dataset=grpo_train_dataset)
    trainer.train()
    logs = _metrics(trainer)
    assert "kl" in logs[0] and "attention/mdi_late" in logs[0]


def test_rows_without_image_get_none_and_are_counted(model_dir, grpo_train_dataset, tmp_path):
    # Every other prompt loses its image: with 4 generations per prompt and 4 rows per device, each step's batch
    # is one group; over the steps, both kinds of group appear.
    ds = grpo_train_dataset.map(lambda ex, i: {"image": ex["image"] if i % 2 == 0 else None}, with_indices=True)
    rec = RecordingReward()
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward, rec],
                             args=make_args(tmp_path, max_steps=4, per_device_train_batch_size=8),
                             train_dataset=ds)
    trainer.train()
    seen = [m for call in rec.calls for m in call["mdi"]]
    assert None in seen and any(m is not None for m in seen)
    # The balance is None (not a made-up 1.0) where there is no image.
    for call in rec.calls:
        for m, b in zip(call["mdi"], call["balance"]):
            assert (m is None) == (b is None)
    fractions = [h["attention/rows_without_image"] for h in _metrics(trainer)]
    assert any(0 < f < 1 for f in fractions) or (min(fractions) == 0 and max(fractions) > 0)


def test_scoring_path_needs_only_token_ids(model_dir, grpo_train_dataset, tmp_path):
    """vLLM (or any external generator) returns token ids only: the probe measures them all the same."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    fixed = processor.tokenizer.encode("<think> red </think> Answer: B", add_special_tokens=False)

    def rollout_func(prompts, trainer):
        # As a vLLM server would: the chat template plus the image placeholders expanded by the processor.
        prompt_ids = [processor.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)
                      ["input_ids"][0] for p in prompts]
        return {"prompt_ids": prompt_ids, "completion_ids": [fixed for _ in prompts],
                "logprobs": [[0.0] * len(fixed) for _ in prompts]}

    rec = RecordingReward()
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=["think_format", "mc_idx", rec],
                             args=make_args(tmp_path, max_steps=1), train_dataset=grpo_train_dataset,
                             rollout_func=rollout_func)
    trainer.train()
    logs = _metrics(trainer)
    assert logs[0]["rewards/think_format/mean"] == 1.0  # the external completion really was scored
    assert all(m is not None and m > 0 for m in rec.calls[0]["mdi"])


# ----------------------------------------------------------------------------------------------- bad input
def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="mdi_balance_ratio: got 1.0; it must be a finite number > 1"):
        MDIGRPOConfig(output_dir="x", mdi_balance_ratio=1.0, use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="attention_text_keys must be one of"):
        MDIGRPOConfig(output_dir="x", attention_text_keys="words", use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="attention_layer_segments"):
        MDIGRPOConfig(output_dir="x", attention_layer_segments="early=1", use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        MDIGRPOConfig(output_dir="x", reward_funcs=["mc_idx", "nope"], use_cpu=True, bf16=False)


def test_structured_outputs_with_importance_sampling_under_vllm_warns_at_construction():
    """vLLM's log-probs are taken after the regex mask (tests_vllm/test_trl_equivalents_vllm.py saw a ratio of 1e-30 and
    no parameter move): TRL's default correction then stalls training. A warning naming the fix; none without the
    regex, or with the correction off."""
    kw = dict(output_dir="x", use_cpu=True, bf16=False, use_vllm=True)
    with pytest.warns(UserWarning, match="vllm_importance_sampling_correction=False"):
        MDIGRPOConfig(**kw, vllm_structured_outputs_regex=r"<think>.*</think>")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        MDIGRPOConfig(**kw, vllm_structured_outputs_regex=r"<think>.*</think>", vllm_importance_sampling_correction=False)
        MDIGRPOConfig(**kw)


def test_a_launch_accelerate_does_not_run_as_one_is_refused(monkeypatch):
    """WORLD_SIZE=2 but accelerate sees one process (no GPU backend found), or two with no distributed type
    (ddp_backend='gloo' without use_cpu: its gathers return the rank's own rows, and TRL's advantages for rank 1 come
    out empty): each rank would train alone. tests_vllm/test_two_processes.py pins accelerate's side of the second."""
    from trl_mdi.run_plan import check_world_size

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 but accelerate sees 1 process\(es\)\. "):
        check_world_size(1)
    with pytest.raises(RuntimeError, match="2 process\\(es\\) with no distributed type.*use_cpu=True"):
        check_world_size(2, distributed=False)
    check_world_size(2, distributed=True)
    # The launch's WORLD_SIZE read before TRL's colocated vLLM overwrites the variable with accelerate's count.
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2"):
        check_world_size(1, world=2)
    check_world_size(1)


def test_trainer_input_errors(model_dir, grpo_train_dataset, tmp_path):
    with pytest.raises(ValueError, match="unknown reward 'mdi_balanse'.*Registry names"):
        MDIGRPOTrainer(str(model_dir), reward_funcs=["mdi_balanse"], args=make_args(tmp_path),
                       train_dataset=grpo_train_dataset)
    with pytest.raises(ValueError, match="3 reward weights for 2 reward functions"):
        MDIGRPOTrainer(str(model_dir), reward_funcs=["mc_idx", "think_format"],
                       args=make_args(tmp_path, reward_weights=[1.0, 2.0, 3.0]), train_dataset=grpo_train_dataset)
    with pytest.raises(ValueError, match="cannot load reward 'no_such_pkg.mod:fn'.*No module named"):
        MDIGRPOTrainer(str(model_dir), reward_funcs=["no_such_pkg.mod:fn"], args=make_args(tmp_path),
                       train_dataset=grpo_train_dataset)
    with pytest.raises(ValueError, match="label_idx"):
        MDIGRPOTrainer(str(model_dir), args=make_args(tmp_path),
                       train_dataset=grpo_train_dataset.remove_columns(["label_idx"]))
    with pytest.raises(ValueError, match="compute_attention_metrics=True"):
        MDIGRPOTrainer(str(model_dir), reward_funcs=["mdi_balance"],
                       args=make_args(tmp_path, compute_attention_metrics=False), train_dataset=grpo_train_dataset)


def test_default_stack_is_4_1_1(model_dir, grpo_train_dataset, tmp_path):
    trainer = MDIGRPOTrainer(str(model_dir), args=make_args(tmp_path), train_dataset=grpo_train_dataset)
    assert trainer.reward_func_names == ["mc_idx", "think_format", "mdi_balance"]
    assert trainer.reward_weights.tolist() == [4.0, 1.0, 1.0]


def test_the_plan_is_made_once_per_trainer_and_reads_the_model_config_once(model_dir, grpo_train_dataset, tmp_path):
    """Issue 43: one call of the plan function and one read of the model config by trl_mdi per trainer built from a
    path (the processor loaded as TRL would); a trainer handed a plan follows it and decides nothing again."""
    from fixtures.testing import CallCounter
    from trl_mdi.run_plan import plan_run

    with CallCounter(plan_run) as counted:
        trainer = MDIGRPOTrainer(str(model_dir), args=make_args(tmp_path / "a"), train_dataset=grpo_train_dataset)
    assert counted.calls == 1 and len(counted.config_reads) == 1, (counted.calls, counted.config_reads)
    # Every line decided before the weights loaded, none revised by the loaded model.
    assert trainer.run_plan.complete and trainer.run_plan.attn_implementation == "sdpa"
    plan = trainer.run_plan
    with CallCounter(plan_run) as counted:
        again = MDIGRPOTrainer(str(model_dir), args=make_args(tmp_path / "b"), train_dataset=grpo_train_dataset,
                               processing_class=trainer.processing_class, run_plan=plan)
    assert (counted.calls, counted.config_reads) == (0, [])
    assert again.run_plan is plan and again.reward_func_names == list(plan.reward_names)
    with pytest.raises(ValueError, match="run_plan: a plan already decided the rewards"):
        MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], args=make_args(tmp_path / "c"),
                       train_dataset=grpo_train_dataset, processing_class=trainer.processing_class, run_plan=plan)


def test_a_class_that_cannot_be_built_without_weights_leaves_its_lines_to_the_loaded_model(
        model_dir, grpo_train_dataset, tmp_path, monkeypatch):
    """The lines read off the model's modules say that they wait for the weights when its class cannot be built
    without them; the trainer then reads them off the loaded model, as the class would have told."""
    import trl_mdi.run_plan as run_plan

    def unbuildable(*args, **kwargs):
        raise RuntimeError("this class loads its weights in __init__")

    monkeypatch.setattr(run_plan, "model_skeleton", unbuildable)
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], args=make_args(tmp_path),
                             train_dataset=grpo_train_dataset)
    assert trainer.run_plan.complete and trainer.run_plan.placement == "training_forward"
    assert trainer.run_plan.attn_implementation == "sdpa" and trainer.run_plan.vision_pass is False
    from transformers import AutoProcessor

    early = run_plan.plan_run(str(model_dir), AutoProcessor.from_pretrained(model_dir), [spread_reward],
                              make_args(tmp_path), {})
    assert not early.complete and early.placement is None
    waiting = ("decided once the weights load (RuntimeError building the model's class without weights: this class "
               "loads its weights in __init__)")
    lines = {line.split("  ")[1].strip(): line for line in early.describe().splitlines()[1:]}
    assert all(lines[k].endswith(waiting) for k in ("attention implementation", "probe placement", "dummy vision pass"))
    monkeypatch.undo()
    assert dataclasses.replace(trainer.run_plan, reward_funcs=()) == dataclasses.replace(
        run_plan.plan_run(str(model_dir), trainer.processing_class, [spread_reward], make_args(tmp_path), {}),
        reward_funcs=())


def test_world_size_that_accelerate_missed_is_a_clear_error(model_dir, grpo_train_dataset, tmp_path, monkeypatch):
    # What a 2-process CPU launch without ddp_backend="gloo" looks like from inside one process.
    args = make_args(tmp_path, use_cpu=False)  # the GPU-style launch: accelerate then finds no backend
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 but accelerate sees 1 process.*ddp_backend='gloo'"):
        MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], args=args, train_dataset=grpo_train_dataset)


def test_trainer_measurement_equals_the_probe_on_the_same_rollouts(model_dir, grpo_train_dataset, tmp_path,
                                                                    monkeypatch):
    """What the trainer logs is `measure_modality_attention` (checked against eager attention in test_attention) on
    the very prompt + completion tokens it trained on, every completion token a query, although its own forward
    asks the LM head for a single position."""
    from trl_mdi.attention import measure_modality_attention

    checked = []
    original = MDIGRPOTrainer._extra_forward

    def extra_forward(trainer, map_rows, batch):
        forward = original(trainer, map_rows, batch)
        c_len = batch.logits_to_keep
        completion_mask = torch.zeros_like(batch.attention_mask)
        completion_mask[:, -c_len:] = batch.attention_mask[:, -c_len:]
        ref = measure_modality_attention(trainer.model, batch.input_ids, batch.attention_mask, completion_mask,
                                         **batch.multimodal)
        got = forward.attention
        assert got.n_queries.tolist() == completion_mask.sum(1).tolist() == ref.n_queries.tolist()
        for group in ("image", "prompt_text", "completion", "special"):
            torch.testing.assert_close(getattr(got, group), getattr(ref, group), atol=1e-6, rtol=0)
        checked.append(len(batch.input_ids))
        return forward

    monkeypatch.setattr(MDIGRPOTrainer, "_extra_forward", extra_forward)
    # A reward reads MDI, so the trainer measures in its own forward before the rewards.
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward, RecordingReward()],
                             args=make_args(tmp_path, max_steps=2),
                             train_dataset=grpo_train_dataset)
    trainer.train()
    assert checked == [4, 4], checked


def flaky_reward(completions, **kwargs):
    """NaN for the first rollout of every batch (a failing reward), None for the second (not applicable)."""
    return [float("nan") if i == 0 else None if i == 1 else 1.0 for i in range(len(completions))]


def test_nan_and_none_rewards_counted_apart_and_nan_warned_once(model_dir, grpo_train_dataset, tmp_path, caplog):
    """Issue 38, item 6: a reward's NaN is counted (rewards/<name>/nan_frac) and warned about once, with the reward's
    name; its None (not applicable, by design) is counted (none_frac) and never warned about."""
    import logging

    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=["mc_idx", flaky_reward], args=make_args(tmp_path),
                             train_dataset=grpo_train_dataset)
    with caplog.at_level(logging.WARNING, logger="trl_mdi.trainer"):
        trainer.train()
    logs = _metrics(trainer)
    assert len(logs) == 2
    for step in logs:
        assert step["rewards/flaky_reward/nan_frac"] == 0.25 and step["rewards/flaky_reward/none_frac"] == 0.25
        assert step["rewards/mc_idx/nan_frac"] == 0.0 and "rewards/mc_idx/none_frac" in step
    warned = [r.getMessage() for r in caplog.records if "returned NaN" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("reward flaky_reward returned NaN") and "1 of 4" in warned[0]
    assert trainer.reward_funcs[1] is flaky_reward  # the counting wrappers are gone after each batch
