"""MDIGRPOTrainer as a drop-in for GRPOTrainer: package API, plain GRPOConfig, layer segments on every depth, and
observing (attention metrics + logs) never changing the run it observes."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, TrainingArguments
from trl import GRPOConfig, GRPOTrainer

import trl_mdi
from fixtures.testing import stock_grpo_values
from trl_mdi import MDIGRPOConfig, MDIGRPOTrainer


def spread_reward(completions, **kwargs):
    """A reward with spread inside every group that reads no attention field."""
    return [float(len(c[0]["content"] if isinstance(c, list) else c) % 7) for c in completions]


def grpo_kwargs(tmp_path, **overrides):
    kw = dict(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none",
              per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=2, logging_steps=1,
              save_strategy="no", seed=0, learning_rate=1e-2, disable_tqdm=True)
    kw.update(overrides)
    return kw


# GRPOConfig's values where MDIGRPOConfig's defaults differ (issue 43), so that a run here compares with stock
# GRPOTrainer's: a random tiny model never stops within 8 tokens, and with mask_truncated_completions every completion
# would leave the loss (nothing would train, and TRL's masked forward leaves the probe nothing to measure).
TRL_LOSS = stock_grpo_values()


def mdi_args(tmp_path, **overrides):
    return MDIGRPOConfig(**grpo_kwargs(tmp_path, rollout_log_path=str(tmp_path / "logs" / "rollouts.md"),
                                       attention_diag_log_path=str(tmp_path / "logs" / "attention.md"),
                                       **{**TRL_LOSS, **overrides}))


def logged(trainer) -> list[dict]:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs, "no training step was logged"
    return logs


# ------------------------------------------------------------------------------------------------- package API
def test_package_root_exports_the_public_names():
    assert sorted(trl_mdi.__all__) == sorted(trl_mdi._EXPORTS)
    for name in trl_mdi.__all__:
        assert getattr(trl_mdi, name) is not None, name
    from trl_mdi.attention import measure_modality_attention
    from trl_mdi.trainer import MDIGRPOTrainer as Trainer

    assert trl_mdi.MDIGRPOTrainer is Trainer and trl_mdi.measure_modality_attention is measure_modality_attention
    assert issubclass(trl_mdi.MDIGRPOConfig, GRPOConfig) and issubclass(trl_mdi.MDIGRPOTrainer, GRPOTrainer)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        trl_mdi.nope  # noqa: B018


# ------------------------------------------------------------------------------------------------- GRPOConfig
def test_plain_grpo_config_is_upgraded_keeping_its_state(tiny_vlm_dir, grpo_train_dataset, tmp_path, caplog):
    # steps_per_generation and generation_batch_size are both filled by GRPOConfig.__post_init__: re-validating the
    # copied values would raise, so the upgrade must keep the initialised state as it is.
    args = GRPOConfig(**grpo_kwargs(tmp_path, steps_per_generation=2, gradient_accumulation_steps=2, beta=0.04))
    with caplog.at_level(logging.INFO, logger="trl_mdi.config"):
        trainer = MDIGRPOTrainer(str(tiny_vlm_dir("qwen2_5_vl")), reward_funcs=[spread_reward], args=args,
                                 train_dataset=grpo_train_dataset)
    assert [r.getMessage() for r in caplog.records if r.name == "trl_mdi.config"] == [
        "MDIGRPOTrainer: upgraded the GRPOConfig to an MDIGRPOConfig (added fields at their defaults)"]
    assert isinstance(trainer.args, MDIGRPOConfig)
    for name in ("steps_per_generation", "generation_batch_size", "gradient_accumulation_steps", "beta",
                 "learning_rate", "num_generations", "output_dir", "seed"):
        assert getattr(trainer.args, name) == getattr(args, name), name
    assert trainer.run_plan.attention_metrics is True  # None resolved: a VLM gets attention metrics
    assert trainer.args.attention_layer_segments == "thirds" and trainer.args.perturbation_seed == args.seed
    trainer.train()
    assert "attention/mdi" in logged(trainer)[0]


def test_config_that_is_not_a_grpo_config_is_a_clear_error(tiny_vlm_dir, grpo_train_dataset, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(TypeError, match=r"args must be a trl.GRPOConfig or an MDIGRPOConfig, got TrainingArguments"):
        MDIGRPOTrainer(str(tiny_vlm_dir("qwen2_5_vl")), reward_funcs=[spread_reward], args=args,
                       train_dataset=grpo_train_dataset)


# ------------------------------------------------------------------------------------------------- segments
class SegmentReward:
    """Reads the MDI of the segments a test expects and records them."""

    __name__ = "segment_reward"

    def __init__(self, names):
        self.names, self.seen = names, []
        # The signature names the fields, as a user's reward would: the trainer checks them at construction.
        params = ", ".join(f"mdi_{n}" for n in names)
        ns: dict = {}
        exec(f"def call(completions, {params}, **kwargs): return completions, [{params}]", ns)  # noqa: S102
        self._call = ns["call"]
        import inspect

        self.__signature__ = inspect.signature(ns["call"])

    def __call__(self, completions, **kwargs):
        _, values = self._call(completions, **kwargs)
        self.seen.append(values)
        return [0.0] * len(completions)


@pytest.mark.parametrize("num_layers, expected", [(1, ["middle"]), (2, ["early", "late"])])
def test_thirds_on_shallow_models_give_the_segments_that_exist(tiny_vlm_dir, grpo_train_dataset, tmp_path,
                                                                 num_layers, expected):
    model = str(tiny_vlm_dir("qwen2_5_vl", num_layers=num_layers))
    missing = next(n for n in ("early", "middle", "late") if n not in expected)
    with pytest.raises(ValueError, match=f"needs column\\(s\\) \\['mdi_{missing}'\\]"):
        MDIGRPOTrainer(model, reward_funcs=[spread_reward, SegmentReward([missing])], args=mdi_args(tmp_path),
                       train_dataset=grpo_train_dataset)
    reward = SegmentReward(expected)
    trainer = MDIGRPOTrainer(model, reward_funcs=[spread_reward, reward], args=mdi_args(tmp_path, max_steps=1),
                             train_dataset=grpo_train_dataset)
    trainer.train()
    log = logged(trainer)[0]
    assert all(v is not None and v > 0 for values in reward.seen for seg in values for v in seg)
    means = {k for k in log if k.startswith("attention/mdi_") and k.count("/") == 1}  # not the /p10 ... spreads
    assert means == {f"attention/mdi_{n}" for n in [*expected, "balance"]}
    text = (tmp_path / "logs" / "attention.md").read_text()
    assert all(f"MDI {n}" in text for n in expected) and f"MDI {missing}" not in text


@pytest.mark.parametrize("spec", ["balance:0-1", "group_score:0", "all:0"])
def test_segment_names_that_collide_with_fields_are_refused(spec):
    with pytest.raises(ValueError, match="attention_layer_segments: segment name .* reserved"):
        MDIGRPOConfig(output_dir="x", use_cpu=True, bf16=False, attention_layer_segments=spec)


def test_segment_ranges_are_checked_against_the_model(tiny_vlm_dir, grpo_train_dataset, prepared_aokvqa_dir, tmp_path,
                                                      capsys):
    model = tiny_vlm_dir("qwen2_5_vl")  # 3 text layers
    with pytest.raises(ValueError, match=r"early:0-99.*3 text layers.*names layers \[3, 4"):
        MDIGRPOTrainer(str(model), reward_funcs=[spread_reward], args=mdi_args(tmp_path, attention_layer_segments="early:0-99"),
                       train_dataset=grpo_train_dataset)
    from trl_mdi.cli.command import main

    # The dry run makes the trainer's own run plan, so it stops on the same error.
    code = main([str(a) for a in ("--model_name_or_path", model, "--dataset_path", prepared_aokvqa_dir,
                                      "--output_dir", tmp_path / "o", "--attention_layer_segments", "early:0-99",
                                      "--dry_run")])
    err = capsys.readouterr().err
    assert code == 2 and "attention_layer_segments" in err and "names layers [3, 4" in err


# ------------------------------------------------------------------------------------------------- observing
@pytest.fixture(scope="module")
def dropout_model_dir(tiny_vlm_dir, tmp_path_factory):
    """The tiny Qwen2.5-VL with attention dropout 0.1: a forward in train mode draws random numbers."""
    src = tiny_vlm_dir("qwen2_5_vl")
    config = AutoConfig.from_pretrained(src)
    config.text_config.attention_dropout = 0.1
    out = tmp_path_factory.mktemp("dropout")
    AutoModelForImageTextToText.from_pretrained(src, config=config).save_pretrained(out)
    from transformers import AutoProcessor

    AutoProcessor.from_pretrained(src).save_pretrained(out)
    return out


def _params_after(trainer) -> dict[str, torch.Tensor]:
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_observing_does_not_change_the_run(dropout_model_dir, grpo_train_dataset, tmp_path):
    """Same seed, a reward that reads no attention field, dropout 0.1: metrics + logs + maps on or off, identical
    parameters after 3 steps (without the forked RNG around the probe's forward they differ by ~0.04)."""
    on = MDIGRPOTrainer(str(dropout_model_dir), reward_funcs=[spread_reward],
                        args=mdi_args(tmp_path / "on", max_steps=3, attention_map_every_n_steps=1),
                        train_dataset=grpo_train_dataset)
    assert on.run_plan.attention_metrics
    after_on = _params_after(on)
    assert "attention/mdi" in logged(on)[0] and (tmp_path / "on" / "logs" / "attention.md").exists()
    off = MDIGRPOTrainer(str(dropout_model_dir), reward_funcs=[spread_reward],
                         args=mdi_args(tmp_path / "off", max_steps=3, compute_attention_metrics=False,
                                       realtime_rollout_logging=False),
                         train_dataset=grpo_train_dataset)
    after_off = _params_after(off)
    initial = AutoModelForImageTextToText.from_pretrained(dropout_model_dir).state_dict()
    assert any(not torch.equal(after_on[n], initial[n]) for n in after_on), "the run did not train"
    for name in after_on:
        assert torch.equal(after_on[name], after_off[name]), name


def test_with_metrics_off_the_update_equals_stock_grpo(dropout_model_dir, grpo_train_dataset, tmp_path):
    # Each trainer is built right before it trains: Trainer seeds the RNG at construction, not in train().
    ours = MDIGRPOTrainer(str(dropout_model_dir), reward_funcs=[spread_reward],
                          args=mdi_args(tmp_path / "ours", max_steps=3, compute_attention_metrics=False,
                                        realtime_rollout_logging=False),
                          train_dataset=grpo_train_dataset)
    after_ours = _params_after(ours)
    stock = GRPOTrainer(str(dropout_model_dir), reward_funcs=[spread_reward],
                        args=GRPOConfig(**grpo_kwargs(tmp_path / "stock", max_steps=3)), train_dataset=grpo_train_dataset)
    after_stock = _params_after(stock)
    for name in after_ours:
        assert torch.equal(after_ours[name], after_stock[name]), name
    assert logged(ours)[-1]["loss"] == pytest.approx(logged(stock)[-1]["loss"], abs=0, rel=0)



def test_the_default_stack_stands_in_where_the_config_names_it(tiny_vlm_dir, tmp_path):
    """Issue 43: the rewards follow values a user can read. The trainer's reward_funcs argument wins; without it, the
    config's reward_funcs, whose MDIGRPOConfig default is the 4:1:1 stack; a plain GRPOConfig (upgraded: no
    reward_funcs) or reward_funcs=None leaves the rewards to GRPOTrainer (its own "No reward source" error)."""
    from transformers import AutoProcessor

    from trl_mdi.run_plan import RewardsFrom, plan_run

    path = str(tiny_vlm_dir("qwen2_5_vl"))
    processor = AutoProcessor.from_pretrained(path)
    config = mdi_args(tmp_path)
    assert config.reward_funcs == ["mc_idx", "think_format", "mdi_balance"] and config.reward_weights is None
    chosen = plan_run(path, processor, None, config, {})
    assert chosen.reward_names == ("mc_idx", "think_format", "mdi_balance")
    assert chosen.reward_weights == (4.0, 1.0, 1.0) and chosen.rewards_from is RewardsFrom.DEFAULT_STACK
    assert "[the default stack]" in chosen.describe()
    assert plan_run(path, processor, [], config, {}).reward_names == chosen.reward_names
    mine = plan_run(path, processor, [spread_reward], config, {})
    assert mine.reward_names == ("spread_reward",) and mine.rewards_from is RewardsFrom.ARGUMENT
    named = plan_run(path, processor, None, mdi_args(tmp_path, reward_funcs=["mc_idx"]), {})
    assert named.reward_names == ("mc_idx",) and named.rewards_from is RewardsFrom.CONFIG
    for args in (MDIGRPOConfig.from_grpo_config(GRPOConfig(**grpo_kwargs(tmp_path))), mdi_args(tmp_path, reward_funcs=None)):
        plan = plan_run(path, processor, None, args, {})
        assert plan.reward_funcs == () and plan.rewards_from is RewardsFrom.NONE
        assert plan.rewards_from.startswith("none given")
