"""Models shipped as custom code (a folder with its own configuration / modeling files and an ``auto_map``), read,
checked and measured the way TRL loads them, with ``trust_remote_code``: on the offline stand-ins of
``fixtures.custom_code``: a VLM whose attention goes through transformers' attention interface and whose config names
its parts its own way (``vit_config``, ``image_token_index``), the same VLM with a decoder that computes its own
softmax, and a causal LM that does (TRL's ``tiny-RemoteForCausalLM``).

The last tests build ``MDIGRPOTrainer`` on them: the run plan reads the config with the config's
``trust_remote_code`` and, once the model is loaded, asks ``probe_support(model)`` whether its attention can be
measured (metrics off with one warning where not).
"""

from __future__ import annotations

import json
import logging
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    PretrainedConfig,
    Qwen2Config,
)

from fixtures.custom_code import save_tiny_remote_lm, save_tiny_remote_vlm
from fixtures.testing import eager_masses, grpo_batch, shape_image, zen_image_dataset
from fixtures.tiny import TINY_ARCHS
from trl_mdi.attention import image_token_ids, measure_modality_attention
from trl_mdi.attention.model_facts import image_token_problem, load_model_config, model_facts, vision_part
from trl_mdi.attention.probe import probe_support
from trl_mdi.cli.arguments import ModelCheckError
from trl_mdi.cli.checks import check_image_token, check_vlm
from trl_mdi.cli.command import main


@pytest.fixture(scope="module")
def remote_vlm(tmp_path_factory):
    return save_tiny_remote_vlm(tmp_path_factory.mktemp("remote") / "vlm")


@pytest.fixture(scope="module")
def softmax_vlm(tmp_path_factory):
    return save_tiny_remote_vlm(tmp_path_factory.mktemp("remote") / "softmax-vlm", own_attention=True)


@pytest.fixture(scope="module")
def remote_lm(tmp_path_factory):
    return save_tiny_remote_lm(tmp_path_factory.mktemp("remote") / "lm")


def _load(path, attn=None):
    kwargs = {"attn_implementation": attn} if attn else {}  # the default: sdpa where the classes declare it
    return AutoModelForImageTextToText.from_pretrained(path, trust_remote_code=True, dtype=torch.float32,
                                                       **kwargs).eval()


# ------------------------------------------------------------------------------------------------ loading
@pytest.mark.parametrize("which, auto_class, class_name", [
    ("remote_vlm", AutoModelForImageTextToText, "TinyRemoteVLForConditionalGeneration"),
    ("softmax_vlm", AutoModelForImageTextToText, "TinySoftmaxVLForConditionalGeneration"),
    ("remote_lm", AutoModelForCausalLM, "RemoteForCausalLM"),
])
def test_custom_code_loads_only_with_trust_remote_code(request, which, auto_class, class_name):
    path = request.getfixturevalue(which)
    assert "auto_map" in json.loads((path / "config.json").read_text())
    for load in (AutoConfig.from_pretrained, auto_class.from_pretrained):
        with pytest.raises(ValueError, match="contains custom code"):
            load(path, trust_remote_code=False)
    model = auto_class.from_pretrained(path, trust_remote_code=True)
    assert type(model).__name__ == class_name and type(model).__module__.startswith("transformers_modules")


def test_load_model_config_reads_what_trl_passes(remote_lm):
    """GRPOConfig.trust_remote_code, as TRL applies it: setdefault into model_init_kwargs, which win."""
    with pytest.raises(ValueError, match="contains custom code"):
        load_model_config(str(remote_lm), None)
    assert load_model_config(str(remote_lm), None, trust_remote_code=True).model_type == "tiny_remote_lm"
    assert load_model_config(str(remote_lm), {"trust_remote_code": True}).model_type == "tiny_remote_lm"
    with pytest.raises(ValueError, match="contains custom code"):
        load_model_config(str(remote_lm), {"trust_remote_code": False}, trust_remote_code=True)


# --------------------------------------------------------------------------------------------- model facts
def test_model_facts_find_the_image_token_of_a_custom_vlm(remote_vlm):
    saved = json.loads((remote_vlm / "config.json").read_text())
    assert "image_token_id" not in saved and "vision_config" not in saved and "vit_config" in saved
    processor = AutoProcessor.from_pretrained(remote_vlm)
    token = processor.image_token_id
    facts = model_facts(AutoConfig.from_pretrained(remote_vlm, trust_remote_code=True))
    assert facts.is_vlm and facts.image_token_ids == (token,) and facts.vision_part == "vit_config"
    assert facts.image_token_source == "config.image_token_index" and facts.image_token_problem is None
    assert facts.num_layers == 2 and facts.measured_layers == (0, 1)


def test_model_facts_read_the_image_token_from_the_processor_or_say_what_is_missing(remote_vlm, remote_lm):
    processor = AutoProcessor.from_pretrained(remote_vlm)
    bare = AutoConfig.from_pretrained(remote_vlm, trust_remote_code=True, image_token_index=None)  # no image token
    facts = model_facts(bare)
    assert not facts.is_vlm and facts.has_vision and facts.image_token_ids == ()
    assert "vision part ('vit_config')" in facts.image_token_problem
    assert "image_token_id, video_token_id, image_token_index, img_context_token_id" in facts.image_token_problem
    assert "no processor was given" in facts.image_token_problem
    facts = model_facts(bare, processor)  # the processor's own image_token_id (and video_token_id)
    assert facts.image_token_ids[0] == processor.image_token_id and facts.is_vlm and facts.image_token_problem is None
    assert facts.image_token_source == "Qwen2VLProcessor.image_token_id"
    # A processor that only names its token: looked up in its tokenizer, as the processor expands it.
    named = SimpleNamespace(image_token="<|image_pad|>", tokenizer=processor.tokenizer)
    assert model_facts(bare, named).image_token_ids == (processor.image_token_id,)
    nothing = SimpleNamespace(image_token="<not-a-token>", tokenizer=processor.tokenizer)
    assert "processor (SimpleNamespace) names no image_token" in model_facts(bare, nothing).image_token_problem
    # A text-only model stays text-only even if its tokenizer holds an image token (Qwen's do).
    text = model_facts(AutoConfig.from_pretrained(remote_lm, trust_remote_code=True), processor)
    assert not text.is_vlm and not text.has_vision and text.image_token_problem is None


@pytest.mark.parametrize("name", ["vision_config", "visual", "vit_config", "vision_tower_config", "img_processor",
                                  "visual_tokenizer_config"])
def test_a_vision_part_is_found_under_any_of_its_usual_names(name):
    assert vision_part(PretrainedConfig(**{name: {"hidden_size": 8}}, text_config={"hidden_size": 8})) == name
    assert vision_part(PretrainedConfig(**{name: Qwen2Config()})) == name


def test_a_text_config_has_no_vision_part():
    assert vision_part(Qwen2Config(rope_scaling={"type": "linear", "factor": 2.0})) is None
    assert vision_part(PretrainedConfig(image_size=224, vision_feature_layer=-1)) is None  # not sub-configs


# ----------------------------------------------------------------------------------------------- the probe
def test_probe_support_on_custom_models(remote_vlm, softmax_vlm, remote_lm):
    assert probe_support(_load(remote_vlm)) is None
    reason = probe_support(_load(softmax_vlm))
    assert reason == ("TinySoftmaxVLForConditionalGeneration computes attention itself (its attention modules "
                      "(RemoteAttention) do not dispatch through transformers' attention interface), so the probe "
                      "cannot measure it")
    reason = probe_support(AutoModelForCausalLM.from_pretrained(remote_lm, trust_remote_code=True))
    assert reason.startswith("RemoteForCausalLM computes attention itself")


class _LinearAttention(torch.nn.Module):  # no softmax, no attention interface (a hybrid model's linear mixer)
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx

    def forward(self, x):
        return x


class _InterfaceAttention(_LinearAttention):
    def forward(self, x):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"]


class _HybridModel(torch.nn.Module):
    def __init__(self, layer_types):
        super().__init__()
        self.config = PretrainedConfig(num_hidden_layers=2, layer_types=layer_types)
        self.layers = torch.nn.ModuleList([_LinearAttention(self.config, 0), _InterfaceAttention(self.config, 1)])


def test_probe_support_skips_the_layers_the_probe_skips_anyway():
    assert probe_support(_HybridModel(["linear_attention", "full_attention"])) is None
    reason = probe_support(_HybridModel(["full_attention", "full_attention"]))
    assert reason.startswith("_HybridModel computes attention itself (its attention modules (_LinearAttention)")


def test_probe_support_through_peft(remote_vlm):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_load(remote_vlm), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert probe_support(model) is None


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_probe_support_on_every_tiny_family(arch, tiny_vlm_dir):
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir(arch), dtype=torch.float32)
    assert probe_support(model) is None
    # Their facts are unchanged by the wider image-token lookup: the ids the probe's layout reads from the config.
    facts = model_facts(model.config, AutoProcessor.from_pretrained(tiny_vlm_dir(arch)))
    assert facts.image_token_ids == tuple(image_token_ids(model.config)) and facts.vision_part == "vision_config"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_probe_on_a_custom_vlm_equals_eager(remote_vlm, attn):
    processor = AutoProcessor.from_pretrained(remote_vlm)
    batch = grpo_batch(processor, ["What colour is the shape in the image? Answer with a letter.", "How many shapes?",
                                   "Shape?"], [shape_image(56, 1), None, shape_image(56, 2)], [5, 2, 7], seed=3)
    res = measure_modality_attention(_load(remote_vlm, attn), **batch)
    ref, groups = eager_masses(_load(remote_vlm, "eager"), batch)
    assert res.layers == [0, 1] and ref.shape[1] == 2
    got = torch.stack([res.image, res.prompt_text, res.completion, res.special], dim=-1)[:, res.layers]
    err = (got.double() - ref).abs().max().item()
    assert err < 1e-5, f"max |probe - eager| = {err:.2e}"
    assert res.n_image.tolist() == groups[..., 0].sum(1).tolist() and res.n_image[0] > 0 and res.n_image[1] == 0


# ------------------------------------------------------------------------------------------ the entry point
def test_check_vlm_takes_a_custom_vlm_with_trust_remote_code_only(remote_vlm, remote_lm):
    with pytest.raises(ModelCheckError, match="contains custom code") as err:
        check_vlm(str(remote_vlm))
    assert "--trust_remote_code" in str(err.value) and "not a vision-language model" not in str(err.value)
    config = check_vlm(str(remote_vlm), trust_remote_code=True)
    assert config.model_type == "tiny_remote_vl" and vision_part(config) == "vit_config"
    with pytest.raises(ModelCheckError, match="is not a vision-language model"):
        check_vlm(str(remote_lm), trust_remote_code=True)


def test_check_image_token_says_which_attribute_is_missing(remote_vlm):
    processor = AutoProcessor.from_pretrained(remote_vlm)
    check_image_token(AutoConfig.from_pretrained(remote_vlm, trust_remote_code=True), processor)
    bare = AutoConfig.from_pretrained(remote_vlm, trust_remote_code=True, image_token_index=None)
    with pytest.raises(ModelCheckError, match=f'TRL.s GRPOTrainer reads model.config.image_token_id: add '
                       f'"image_token_id": {processor.image_token_id}'):
        check_image_token(bare, processor)
    with pytest.raises(ModelCheckError, match="none of the attributes image_token_id, .* names its image"):
        check_image_token(bare, SimpleNamespace(tokenizer=processor.tokenizer))
    assert image_token_problem(Qwen2Config()) is None  # text-only: nothing to find


def test_entry_point_dry_run_on_a_custom_vlm(capsys, remote_vlm, prepared_aokvqa_dir, tmp_path):
    args = ["--model_name_or_path", str(remote_vlm), "--dataset_path", str(prepared_aokvqa_dir),
            "--output_dir", str(tmp_path / "out"), "--dry_run"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "contains custom code" in err and "--trust_remote_code" in err
    assert main(args + ["--trust_remote_code"]) == 0
    out = capsys.readouterr().out
    assert "dry run" in out and "tiny_remote_vl" in out


# ------------------------------------------------------------------------------------------------ training
def spread_reward(completions, **kwargs):
    return [float(len(c[0]["content"] if isinstance(c, list) else c) % 7) for c in completions]


def mdi_reward(completions, mdi, **kwargs):
    return [0.0 if m is None else m for m in mdi]


def grpo_args(tmp_path, **overrides):
    from trl import GRPOConfig

    kw = dict(output_dir=str(tmp_path), learning_rate=0.1, per_device_train_batch_size=3, num_generations=3,
              max_completion_length=8, report_to="none", use_cpu=True, bf16=False, max_steps=2, logging_steps=1,
              save_strategy="no", disable_tqdm=True, seed=0, trust_remote_code=True)
    kw.update(overrides)
    return GRPOConfig(**kw)


def _train(trainer):
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    unchanged = [n for n, p in before.items() if torch.equal(p, trainer.model.get_parameter(n))]
    assert not unchanged, f"parameters that did not change: {unchanged[:8]}"
    return [h for h in trainer.state.log_history if "loss" in h]


def test_a_custom_vlm_through_the_attention_interface_trains_measured(remote_vlm, tmp_path):
    from trl_mdi import MDIGRPOTrainer

    trainer = MDIGRPOTrainer(model=str(remote_vlm), reward_funcs=spread_reward, args=grpo_args(tmp_path),
                             train_dataset=zen_image_dataset(12))
    assert type(trainer.model).__name__ == "TinyRemoteVLForConditionalGeneration"
    logs = _train(trainer)
    values = [h["attention/mdi"] for h in logs if "attention/mdi" in h]
    assert values and all(math.isfinite(v) and v > 0 for v in values)


def test_a_custom_vlm_with_its_own_softmax_trains_with_metrics_off_and_says_why(softmax_vlm, tmp_path, caplog):
    from trl_mdi import MDIGRPOTrainer

    with caplog.at_level(logging.WARNING):
        trainer = MDIGRPOTrainer(model=str(softmax_vlm), reward_funcs=spread_reward, args=grpo_args(tmp_path),
                                 train_dataset=zen_image_dataset(12))
    why = [r.getMessage() for r in caplog.records if "computes attention itself" in r.getMessage()]
    assert len(why) == 1 and "TinySoftmaxVLForConditionalGeneration" in why[0] and "attention metrics" in why[0]
    logs = _train(trainer)
    assert not any(k.startswith("attention/") for h in logs for k in h)


def test_a_reward_reading_attention_fails_before_training_with_the_reason(softmax_vlm, tmp_path):
    from trl_mdi import MDIGRPOTrainer

    with pytest.raises(ValueError, match="mdi_reward.*computes attention itself|computes attention itself.*mdi_reward"):
        MDIGRPOTrainer(model=str(softmax_vlm), reward_funcs=[spread_reward, mdi_reward], args=grpo_args(tmp_path),
                       train_dataset=zen_image_dataset(12))


def test_the_default_stack_loses_mdi_balance_where_the_probe_cannot_measure(softmax_vlm, tmp_path):
    """Chosen defaults (an MDIGRPOConfig, no reward): the 4:1:1 stack is decided before the model loads; on a model
    whose attention cannot be measured it keeps mc_idx and think_format, as on a text-only model, in the plan and in
    TRL's own reward lists alike."""
    from trl_mdi import MDIGRPOConfig, MDIGRPOTrainer
    from trl_mdi.rewards import think_format

    args = MDIGRPOConfig.from_grpo_config(grpo_args(tmp_path))  # the user's own MDIGRPOConfig...
    args.reward_funcs = ["mc_idx", "think_format", "mdi_balance"]  # ...whose reward_funcs hold its default stack
    rows = zen_image_dataset(12).map(lambda r, i: {"label_idx": i % 2, "choices": ["red", "blue"]}, with_indices=True)
    trainer = MDIGRPOTrainer(model=str(softmax_vlm), args=args, train_dataset=rows)
    assert trainer.run_plan.reward_names == ("mc_idx", think_format.__name__)
    assert trainer.reward_func_names == list(trainer.run_plan.reward_names)
    assert trainer.reward_weights.tolist() == [4.0, 1.0] and len(trainer.reward_processing_classes) == 2
    assert trainer.run_plan.attention_metrics is False and "computes attention itself" in trainer.run_plan.attention_why
    assert args.compute_attention_metrics is None  # the user's config is left as the user made it


def test_reliance_signals_need_no_probe_on_a_model_it_cannot_measure(softmax_vlm, tmp_path, monkeypatch):
    """The reliance signals are log-probabilities, not attention: on the VLM that computes its own softmax (metrics
    off) they are computed and logged; answer_image_attention is absent. The first batch's visual_gain (scored before
    any optimizer step) equals the profile's reference on a fresh copy of the checkpoint, and so does its metric."""
    from test_reliance_trainer import capture

    from trl_mdi import MDIGRPOConfig, MDIGRPOTrainer
    from trl_mdi.profile.reference import reference_signals

    seen = capture(monkeypatch)  # per batch: the rollouts the counterfactual forward saw, then their signals
    args = MDIGRPOConfig.from_grpo_config(grpo_args(tmp_path))
    args.reliance_signals = True
    trainer = MDIGRPOTrainer(model=str(softmax_vlm), reward_funcs=spread_reward, args=args,
                             train_dataset=zen_image_dataset(12))
    assert trainer.run_plan.counterfactual and not trainer.run_plan.attention_metrics
    logs = _train(trainer)
    assert all("reliance/visual_gain" in h for h in logs) and not any("reliance/answer_image_attention" in h
                                                                       for h in logs)
    first = seen[0]
    want = reference_signals(_load(softmax_vlm), AutoProcessor.from_pretrained(softmax_vlm, trust_remote_code=True),
                             first["prompts"], [[row["image"]] for row in first["inputs"]], first["completions"],
                             args.counterfactual_image, attention=False, temperature=args.temperature)
    assert want["visual_gain"].abs().max() > 1e-4  # the image matters to this model: the comparison is not vacuous
    torch.testing.assert_close(first["signals"]["visual_gain"].double(), want["visual_gain"].double(), atol=1e-5,
                               rtol=0)
    assert logs[0]["reliance/visual_gain"] == pytest.approx(want["visual_gain"].mean().item(), abs=1e-5)
