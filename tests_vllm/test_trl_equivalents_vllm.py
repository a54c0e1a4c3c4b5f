"""TRL's own vLLM tests of GRPOTrainer (huggingface/trl ``tests/test_grpo_trainer.py``), with MDIGRPOTrainer put in
place of GRPOTrainer, run with vLLM's CPU build generating in colocate mode.

TRL skips most of these in its CI ("We should add a mock for the vLLM server") or runs them only on a GPU, and uses
Qwen2.5-0.5B because its tiny models are "too small for vLLM". Here they run on CPU with the tiny offline models sized
for vLLM's CPU kernels (head_dim 64, ``VLLM_TINY_SIZE``) and the harness settings (``fixtures.vllm_cpu``). TRL 1.16
defaults ``vllm_mode`` to ``"colocate"``, so TRL's tests that set only ``use_vllm=True`` run colocate mode there too.

Mirrored, each with TRL's own checks (``train_loss`` logged, every trainable parameter moved; for LoRA the base
unchanged) and checks of ours where TRL's cannot tell a broken run from a working one:

- ``test_train_vllm``: also against stock ``GRPOTrainer`` under vLLM: identical parameters after 2 steps.
- ``test_train_vllm_and_peft``: also the engine's weights after the run are the policy's at the last sync, the LoRA
  adapter merged and the ``modules_to_save`` copies (``embed_tokens``, ``lm_head``) sent under the base names.
- ``test_train_vllm_structured_outputs``: also every completion is a prefix of a string the regex matches.
- ``test_train_vllm_importance_sampling_correction`` (3 clip settings): also the IS metrics were logged and show the
  engine's sampling log-probs equal the policy's (float32 engine: ratio 1 within 1e-3).
- ``test_train_vllm_with_additional_generation_kwargs``: also vLLM got the sampling settings.
- ``test_train_vlm_and_vllm``: Qwen2.5-VL, in colocate mode (TRL's uses server mode: impossible on CPU, see
  tests/test_trl_equivalents.py); also the attention metric was measured on vLLM's rollouts.
- ``test_vlm_processor_vllm_colocate_mode``: without TRL's 4-bit quantization (bitsandbytes is not in this
  environment; it only saved GPU memory there), with TRL's assertions.

What is not mirrored, and why: the comment "TRL's vLLM tests" in tests/test_trl_equivalents.py.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from fixtures import vllm_cpu
from fixtures.testing import zen_image_dataset
from trl_mdi import MDIGRPOTrainer

# TRL's zen "standard_prompt_only" prompts (its text tests' data set), offline.
ZEN_PROMPTS = ["Beautiful is better than", "Explicit is", "Simple is better", "Complex", "Flat is better than",
               "Sparse is better", "Readability", "Errors should never", "Unless explicitly"]

# A text policy vLLM's CPU kernels accept (head_dim 64; the main suite's tiny text models have 16), 2 layers.
VLLM_TEXT_SIZE = dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2)


def spread_reward(completions, **kwargs):
    """Stands in for TRL's length reward: a random tiny model rarely stops early, so every completion has the same
    length and a length reward has no spread inside a group (zero policy gradient, nothing would move)."""
    return [float(len(c[0]["content"] if isinstance(c, list) else c) % 7) for c in completions]


def trl_args(tmp_path, **overrides) -> GRPOConfig:
    """TRL's test settings (lr 0.1, 3 x 3, 8 tokens) on CPU, 2 steps, with the harness's engine settings."""
    kw = dict(output_dir=str(tmp_path), learning_rate=0.1, per_device_train_batch_size=3, num_generations=3,
              max_completion_length=8, report_to="none", use_cpu=True, bf16=False, max_steps=2, logging_steps=1,
              save_strategy="no", disable_tqdm=True, seed=0, **vllm_cpu.VLLM_CPU_ARGS)
    kw.update(overrides)
    return GRPOConfig(**kw)


@dataclass
class Run:
    """What one 2-step training run did, kept after its trainer (and engine) is freed."""

    before: dict[str, torch.Tensor]  # every parameter before training
    after: dict[str, torch.Tensor]  # the same, after
    trainable: set[str]  # the names of those that require grad
    logs: list[dict]  # the per-step log entries
    train_loss: float | None
    sampling_params: list = field(default_factory=list)  # vLLM SamplingParams of each generate call
    completion_ids: list[list[int]] = field(default_factory=list)  # every completion vLLM generated
    synced: list[dict[str, torch.Tensor]] = field(default_factory=list)  # policy state right after each weight sync
    engine: dict[str, torch.Tensor] = field(default_factory=dict)  # the engine's weights after the run
    texts: list[str] = field(default_factory=list)  # the completions, decoded by the trainer's tokenizer


def engine_model(trainer):
    return trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model


def train(build: Callable[[], GRPOTrainer]) -> Run:
    """Build a trainer (vLLM colocate) with ``build``, train it, recording what reached and came out of the engine,
    and free it: one engine at a time (each holds its KV cache until collected; the recording wrappers, attached to
    the engine, reference the trainer, so only a collection after the trainer's frame is gone frees it)."""
    run = _train(build())
    gc.collect()
    return run


def _train(trainer: GRPOTrainer) -> Run:
    assert trainer.use_vllm and trainer.vllm_generation.mode == "colocate"
    gen = trainer.vllm_generation
    llm_generate, sync = gen.llm.generate, gen.sync_weights
    params = dict(trainer.model.named_parameters())
    run = Run(before={n: p.detach().clone() for n, p in params.items()}, after={}, logs=[], train_loss=None,
              trainable={n for n, p in params.items() if p.requires_grad})

    def generate(prompts, sampling_params=None, *a, **kw):
        outputs = llm_generate(prompts, sampling_params, *a, **kw)
        run.sampling_params.append(sampling_params)
        run.completion_ids += [list(c.token_ids) for o in outputs for c in o.outputs]
        return outputs

    def sync_weights(*a, **kw):
        out = sync(*a, **kw)
        run.synced.append({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
        return out

    gen.llm.generate, gen.sync_weights = generate, sync_weights
    trainer.train()
    run.train_loss = trainer.state.log_history[-1]["train_loss"]
    run.logs = [h for h in trainer.state.log_history if "loss" in h]
    run.after = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run.engine = {n: p.detach().clone() for n, p in engine_model(trainer).named_parameters()}
    run.texts = trainer.processing_class.batch_decode(run.completion_ids, skip_special_tokens=True)
    return run


def assert_all_changed(run: Run, skip: tuple[str, ...] = ()) -> None:
    """TRL's check: every trainable parameter moved (``skip``: prefixes TRL's tiny models leave without gradient)."""
    assert run.train_loss is not None
    unchanged = [n for n in sorted(run.trainable) if not n.startswith(skip)
                 and torch.equal(run.before[n], run.after[n])]
    assert not unchanged, f"parameters that did not change: {unchanged[:8]}"


@pytest.fixture(scope="module")
def text_models(tmp_path_factory):
    """(policy, reward model): a causal LM sized for vLLM, and a one-logit sequence classifier standing in for
    trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5 (scored by transformers, never by vLLM)."""
    from fixtures.tiny import save_tiny_text_model

    root = tmp_path_factory.mktemp("text")
    return (save_tiny_text_model(root / "policy", "causal_lm", **VLLM_TEXT_SIZE),
            save_tiny_text_model(root / "reward", "sequence_classification", seed=1))


@pytest.fixture(scope="module")
def zen():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ZEN_PROMPTS})


def test_train_vllm(text_models, zen, tmp_path):
    """TRL's TestGRPOTrainerSlow::test_train_vllm (Qwen2.5-0.5B on a GPU there), and the same run under stock
    GRPOTrainer: on a text-only model the trainer adds nothing to TRL's run, so the parameters after 2 steps are
    identical, and the engine generated every batch."""
    policy, reward_model = text_models
    runs = {}
    for name, cls in (("stock", GRPOTrainer), ("mdi", MDIGRPOTrainer)):
        runs[name] = train(partial(cls, model=str(policy), reward_funcs=str(reward_model),
                                   args=trl_args(tmp_path / name), train_dataset=zen))
    assert_all_changed(runs["mdi"])
    assert len(runs["mdi"].sampling_params) == 2 and len(runs["mdi"].completion_ids) == 2 * 3
    stock, mdi = runs["stock"].after, runs["mdi"].after
    assert stock.keys() == mdi.keys()
    diff = max((mdi[n] - stock[n]).abs().max().item() for n in stock)
    assert diff == 0.0, f"parameters differ from stock GRPOTrainer's under vLLM by up to {diff:.3e}"
    assert [h["loss"] for h in runs["mdi"].logs] == [h["loss"] for h in runs["stock"].logs]


def test_train_vllm_and_peft(text_models, zen, tmp_path):
    """TRL's test_train_vllm_and_peft: LoRA on all linear layers plus ``modules_to_save=["embed_tokens",
    "lm_head"]`` ("non-default modules as it adds extra keys in state_dict that we need to handle"). TRL's checks: the
    base weights unchanged, the adapter's moved. Ours: what TRL sent the engine at the last sync is the policy of that
    moment, with the adapter merged into each adapted weight and the trained ``modules_to_save`` copies under the
    base names (a sync that sent the base weights, or the original copies, would leave the engine on them)."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    policy, reward_model = text_models
    model = AutoModelForCausalLM.from_pretrained(policy, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
    r, alpha = 8, 8  # PEFT's defaults
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules="all-linear", modules_to_save=["embed_tokens", "lm_head"])
    run = train(partial(MDIGRPOTrainer, model=model, reward_funcs=str(reward_model), args=trl_args(tmp_path),
                        train_dataset=zen, peft_config=config))
    assert run.train_loss is not None
    for n, param in run.before.items():
        if n in base_param_names:  # the base model's weights stay as they were
            torch.testing.assert_close(param, run.after[n], msg=f"Parameter {n} has changed.")
        elif "base_layer" not in n and "original_module" not in n:
            assert not torch.equal(param, run.after[n]), f"Parameter {n} has not changed."

    # The engine holds the policy of the last sync (before step 2's generation), merged.
    assert len(run.synced) == 2
    synced, engine = run.synced[-1], run.engine
    for saved in ("embed_tokens", "lm_head"):
        key = next(k for k in synced if f"{saved}.modules_to_save.default.weight" in k)
        original = key.replace("modules_to_save.default", "original_module")
        assert not torch.equal(synced[key], synced[original]), f"{saved}: its trained copy never moved"
        engine_key = "lm_head.weight" if saved == "lm_head" else "model.embed_tokens.weight"
        vocab = synced[key].shape[0]  # vLLM pads its vocabulary rows (to a multiple of 64) with zeros
        assert torch.equal(engine[engine_key][:vocab], synced[key]), f"engine {engine_key} is not the trained copy"
    checked = 0
    for engine_key, weight in engine.items():
        if not engine_key.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):  # vLLM fuses qkv, gate_up
            continue
        base = f"base_model.model.{engine_key.removesuffix('.weight')}.base_layer.weight"
        a = synced[base.replace("base_layer.weight", "lora_A.default.weight")]
        b = synced[base.replace("base_layer.weight", "lora_B.default.weight")]
        assert b.abs().max() > 0, f"{engine_key}: LoRA B still zero, a missing merge would go unseen"
        err = (weight - (synced[base] + (alpha / r) * b @ a)).abs().max().item()
        assert err < 1e-6, f"{engine_key}: engine differs from the merged policy weight by {err:.2e}"
        checked += 1
    assert checked == 2 * VLLM_TEXT_SIZE["num_layers"]


def test_train_vllm_structured_outputs(text_models, zen, tmp_path):
    """TRL's test_train_vllm_structured_outputs: vLLM generates under a regex (its structured-output backend on
    CPU). TRL checks only that training works; here every completion is also a prefix of a string the regex matches
    (the token budget cuts them short), which a random tiny model generating freely would not produce.

    32 completion tokens, not TRL's 8: the tiny byte-level tokenizer spells ``<reasoning>`` in 8 tokens (Qwen2.5's in
    about 3), so 8 tokens would be the forced tag in every completion, identical texts, zero advantage and no
    parameter moving.

    Importance-sampling correction off, unlike TRL's test (TRL 1.16 turns it on by default): TRL's colocate engine
    returns processed log-probs, taken after the regex's token mask, so every forced token is near-certain to the
    engine and not to the policy. With the correction on, the two differ by up to 6.7 per token, the sequence-level IS
    ratio falls to about 1e-30, and it scales the loss to zero: grad_norm 0, no parameter moves (seen here; it is
    TRL's, not the CPU build's, and TRL's own test would fail the same way, it is skipped in TRL's CI)."""
    import regex

    pattern = r"<reasoning>\n.*\n</reasoning>\n<answer>\n.*\n</answer>"
    policy, reward_model = text_models
    run = train(lambda: MDIGRPOTrainer(model=str(policy), reward_funcs=str(reward_model), train_dataset=zen,
                                       args=trl_args(tmp_path, vllm_structured_outputs_regex=pattern,
                                                     max_completion_length=32,
                                                     vllm_importance_sampling_correction=False)))
    assert_all_changed(run)
    texts = run.texts
    assert len(texts) == 2 * 3 and all(texts), texts
    off = [t for t in texts if regex.fullmatch(pattern, t, partial=True) is None]
    assert not off, f"completions outside the regex: {off}"


@pytest.mark.parametrize("clip_min, clip_max", [(None, 3.0), (0.5, None), (0.5, 5.0)])
def test_train_vllm_importance_sampling_correction(text_models, zen, tmp_path, clip_min, clip_max):
    """TRL's test_train_vllm_importance_sampling_correction (only max, the default; only min; both, IcePop). Also:
    the correction ran (its metrics logged at every step) on log-probs that agree: the float32 engine samples with
    the policy's own log-probs (text-only rows: 5e-7), so the ratio is 1 within 1e-3. A prompt or weight mismatch
    between engine and policy shows here as a ratio far from 1."""
    policy, reward_model = text_models
    args = trl_args(tmp_path, vllm_importance_sampling_correction=True,
                    vllm_importance_sampling_clip_min=clip_min, vllm_importance_sampling_clip_max=clip_max)
    run = train(lambda: MDIGRPOTrainer(model=str(policy), reward_funcs=str(reward_model), args=args,
                                       train_dataset=zen))
    assert_all_changed(run)
    assert len(run.logs) == 2
    for h in run.logs:
        assert h["sampling/sampling_logp_difference/max"] < 1e-4, h
        for stat in ("min", "mean", "max"):
            assert abs(h[f"sampling/importance_sampling_ratio/{stat}"] - 1.0) < 1e-3, h


def test_train_vllm_with_additional_generation_kwargs(text_models, zen, tmp_path):
    """TRL's test_train_vllm_with_additional_generation_kwargs; also: vLLM sampled with exactly those settings."""
    policy, reward_model = text_models
    sampling = dict(top_p=0.9, top_k=10, min_p=0.01, repetition_penalty=1.1)
    run = train(lambda: MDIGRPOTrainer(model=str(policy), reward_funcs=str(reward_model), train_dataset=zen,
                                       args=trl_args(tmp_path, **sampling)))
    assert_all_changed(run)
    assert len(run.sampling_params) == 2
    for params in run.sampling_params:
        got = {k: getattr(params, k) for k in sampling}
        assert got == pytest.approx(sampling), got
        assert params.max_tokens == 8


def test_train_vlm_and_vllm(tiny_vlm_dir, tmp_path):
    """TRL's test_train_vlm_and_vllm for Qwen2.5-VL (TRL's settings: 2 x 2, lr 0.1, 8 tokens), in colocate mode: TRL's
    runs server mode, which cannot train on CPU (tests/test_trl_equivalents.py says why). Gemma 3 and Gemma 4, its
    other two models, are not run: vLLM 0.31's processors fail on their tiny models (tests_vllm/test_prompt_ids.py).
    TRL checks every parameter moved; Qwen2.5-VL's vision tower is skipped as in the main suite's mirror (TRL's own
    test_training_vlm skips it: the tiny tower gets no gradient in 2 steps). Ours: vLLM generated both batches and
    the probe measured a positive image share on them. tests_vllm/test_colocate.py checks the rest: parameters equal
    stock GRPOTrainer's, the probe equals eager attention on vLLM's rollouts."""
    run = train(lambda: MDIGRPOTrainer(model=str(tiny_vlm_dir("qwen2_5_vl")), reward_funcs=spread_reward,
                                       args=trl_args(tmp_path, per_device_train_batch_size=2, num_generations=2),
                                       train_dataset=zen_image_dataset(4)))
    assert_all_changed(run, skip=("model.visual.",))
    assert len(run.sampling_params) == 2 and len(run.completion_ids) == 2 * 2
    mdi = [h["attention/mdi"] for h in run.logs]
    assert len(mdi) == 2 and all(v > 0 for v in mdi), mdi


def test_vlm_processor_vllm_colocate_mode(text_models, tiny_vlm_dir, tmp_path):
    """TRL's test_vlm_processor_vllm_colocate_mode: a causal LM with a VLM's processor (SmolVLM's) and LoRA builds a
    colocate engine, keeps vLLM on, keeps the image column and warns of no incompatibility. TRL's 4-bit quantization
    is left out (bitsandbytes is not in this environment; it only saved GPU memory there). The model is text-only, so
    the trainer's refusal of SmolVLM in colocate mode (a VLM's expanded prompt, huggingface/trl#6294) does not apply."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoProcessor

    policy, _ = text_models
    config = trl_args(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=2, num_generations=2,
                      max_completion_length=4, vllm_gpu_memory_utilization=0.05, logging_strategy="no")
    processor = AutoProcessor.from_pretrained(tiny_vlm_dir("idefics3"), use_fast=True, padding_side="left")
    assert hasattr(processor, "tokenizer") and hasattr(processor, "image_processor")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1, bias="none",
                      task_type="CAUSAL_LM")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = MDIGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(policy, dtype="float32"),
                                 reward_funcs=lambda completions, **kw: [1.0] * len(completions), args=config,
                                 train_dataset=Dataset.from_dict({"prompt": ZEN_PROMPTS}), processing_class=processor,
                                 peft_config=lora)
    try:
        assert trainer.use_vllm, "vLLM should be enabled for VLM processors in colocate mode"
        assert trainer.vllm_mode == "colocate"
        assert trainer.vllm_generation.llm is not None  # the engine was built
        if trainer._signature_columns is not None:
            assert "image" in trainer._signature_columns
        incompatible = [str(w.message) for w in caught if "does not support VLMs" in str(w.message)
                        or "not compatible" in str(w.message).lower()]
        assert not incompatible, incompatible
    finally:
        del trainer
        gc.collect()  # one engine at a time
