"""Contract with TRL internals that MDIGRPOTrainer relies on. If TRL changes one of these, this file fails
first and names what moved, instead of the trainer silently measuring the wrong thing."""

import inspect

import pytest
import torch
from trl import GRPOTrainer

from trl_mdi.config import MDIGRPOConfig
from trl_mdi.trainer import MDIGRPOTrainer, PromptEncoding


def _params(fn):
    return list(inspect.signature(fn).parameters)


def test_overridden_method_signatures():
    assert _params(GRPOTrainer._generate_and_score_completions) == ["self", "inputs"]
    assert _params(GRPOTrainer._calculate_rewards) == ["self", "inputs", "prompts", "completions", "completion_ids_list"]
    assert _params(GRPOTrainer._generate) == ["self", "prompts"]
    assert _params(GRPOTrainer._tokenize_prompts) == ["self", "prompts"]
    assert _params(GRPOTrainer._generate_single_turn) == ["self", "prompt_ids", "images", "multimodal_fields",
                                                          "num_generations", "has_tool_images"]
    assert _params(GRPOTrainer.compute_loss) == ["self", "model", "inputs", "return_outputs", "num_items_in_batch"]
    assert _params(GRPOTrainer.training_step) == ["self", "model", "inputs", "num_items_in_batch"]
    logp = _params(GRPOTrainer._get_per_token_logps_and_entropies)
    assert logp[:5] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep"]
    # The multimodal keyword arguments our own forward passes through.
    for name in ("batch_size", "num_images", "pixel_values", "image_grid_thw", "pixel_attention_mask",
                 "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids"):
        assert name in logp, name


def test_the_fused_head_builder_we_wrap_is_where_we_wrap_it():
    """``trl_mdi.trainer.fused_head_as_the_model_computes`` (Aya Vision's unapplied logit scale) swaps
    ``trl.trainer.grpo_trainer.add_fused_lm_head`` while GRPOTrainer builds: if TRL moves or renames it, the swap
    would silently do nothing."""
    import inspect

    from trl.trainer import grpo_trainer

    assert callable(grpo_trainer.add_fused_lm_head)
    assert "add_fused_lm_head(" in inspect.getsource(grpo_trainer.GRPOTrainer.__init__)


def test_model_card_names_we_escape():
    """MDIGRPOTrainer.create_model_card escapes the names TRL puts into the model card's Markdown: TRL's signature,
    and the one name GRPOTrainer passes at every checkpoint (the output folder's)."""
    assert _params(GRPOTrainer.create_model_card) == ["self", "model_name", "dataset_name", "tags"]
    assert "self.create_model_card(model_name=model_name)" in inspect.getsource(GRPOTrainer._save_checkpoint)


def test_generate_returns_its_8_tuple_and_encodes_prompts_once():
    src = inspect.getsource(GRPOTrainer._generate)
    assert "return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images" in src
    # The trainer keeps _tokenize_prompts' encoding for its extra forwards (trl_mdi.batch): it must be TRL's one
    # encoding of the batch's prompts, (prompt_ids, images, multimodal_fields), skipped only with a rollout_func.
    assert "prompt_ids, images, multimodal_fields = self._tokenize_prompts(prompts)" in src
    assert "return prompt_ids, images, multimodal_fields" in inspect.getsource(GRPOTrainer._tokenize_prompts)


def test_vllm_gets_the_ids_we_fix_and_trl_scores_its_own():
    """trl_mdi.vllm_prompts: the trainer changes the prompt ids _generate_single_turn hands vLLM (colocate mode), and
    nothing else. That is right only while (1) TRL hands vLLM those very ids with the images, as raw token ids
    (colocate mode: vLLM expands the placeholders itself), (2) TRL drops the prompt ids vLLM returns and scores the
    ids _tokenize_prompts made, and (3) server mode places image features on the runs of image tokens of TRL's
    expanded ids (so the trainer leaves them expanded there). Also: TRL syncs the weights at the top of
    _generate_single_turn when the step moved, the condition under which the trainer drops vLLM's cached image
    features first; and the sampling kwargs the trainer biases against image tokens are the engine's own copy."""
    from trl.generation.vllm_generation import VLLMGeneration

    flat = lambda fn: " ".join(inspect.getsource(fn).split())  # noqa: E731 (whitespace-insensitive source)
    single = flat(GRPOTrainer._generate_single_turn)
    assert ("_, completion_ids, logprobs, _ = self.vllm_generation.generate( prompts=prompt_ids, images=images, "
            "num_generations=num_generations,") in single
    # The trainer drops vLLM's cached image features under TRL's own sync condition, just before TRL syncs.
    assert ('if self.use_vllm: # Sync weights if training step changed if self.state.global_step != '
            'self._last_loaded_step: with profiling_context(self, "sync_weights"): '
            'self.vllm_generation.sync_weights() self._last_loaded_step = self.state.global_step') in single
    gen = flat(VLLMGeneration.generate)
    assert 'row = {"prompt_token_ids": ids}' in gen
    assert 'row["multi_modal_data"] = {"image": img_list if len(img_list) > 1 else img_list[0]}' in gen
    assert "self._place_features(prompt_features, prompt_ids)" in gen and 'elif self.mode == "colocate":' in gen
    assert "if prompt_ids[offset] == image_token_id:" in flat(VLLMGeneration._place_features)
    # The image-token bias (vllm_prompts.suppress_image_tokens) reaches the colocated engine only while TRL keeps its
    # own copy of the sampling kwargs on the VLLMGeneration object and merges it into SamplingParams at each call.
    assert "self.generation_kwargs = generation_kwargs or {}" in flat(VLLMGeneration.__init__)
    assert ("generation_kwargs.update(self.generation_kwargs)" in gen
            and "sampling_params = SamplingParams(**generation_kwargs)" in gen)
    # The prompt ids _generate returns, hence those TRL's forward scores, are _tokenize_prompts', not the
    # single-turn call's (its rebinding of prompt_ids is local to our override).
    outer = flat(GRPOTrainer._generate)
    assert ("prompt_ids, images, multimodal_fields = self._tokenize_prompts(prompts) num_generations = "
            "self.num_generations if mode == \"train\" else self.num_generations_eval completion_ids, logprobs = "
            "self._generate_single_turn( prompt_ids, images, multimodal_fields, num_generations )") in outer
    assert "return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images" in (
        outer)


def test_old_logps_condition_is_the_one_we_mirror():
    src = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "generate_every = self.args.steps_per_generation * self.num_iterations" in src
    assert "self.args.gradient_accumulation_steps % generate_every != 0 or (" in src
    assert "self.use_vllm and self.vllm_importance_sampling_correction" in src
    # Rewards are computed after the no-grad block, from the (mutable) input rows.
    assert src.index("old_per_token_logps, _, _ = self._get_per_token_logps_and_entropies(") < src.index(
        "rewards_per_func = self._calculate_rewards(inputs, prompts, completions, completion_ids_list)"
    )
    assert 'keys = [key for key in inputs[0] if key not in ["prompt", "completion", "completion_ids"]]' in (
        inspect.getsource(GRPOTrainer._calculate_rewards)
    )



def test_rewards_are_read_from_self_reward_funcs_and_none_becomes_nan_there():
    """MDIGRPOTrainer._calculate_rewards counts each reward's None and NaN by swapping ``self.reward_funcs`` for
    counting wrappers around super()'s call (trl_mdi.rewards.RewardTally): TRL must read the list from ``self`` inside
    that method, zipped with the other parallel lists, and turn None into NaN only after the function returned."""
    src = inspect.getsource(GRPOTrainer._calculate_rewards)
    assert "zip(self.reward_funcs, self.reward_processing_classes, self.reward_func_names, strict=True)" in src
    assert "output_reward_func = [reward if reward is not None else torch.nan for reward in output_reward_func]" in src


def test_trl_extends_token_type_ids_with_zeros_and_passes_the_processors_labels_on():
    """What the trainer's PaliGemma fixes answer (``_tokenize_prompts`` and ``_get_per_token_logps_and_entropies``):
    TRL 1.16 extends the prompt's token_type_ids with zeros over the completion (PaliGemma's bidirectional prefix
    type; the trainer sets them to 1), keeps every processor output but the ids and mask as a forward keyword (its
    labels among them; the trainer drops them) and tokenizes a batch's prompts in one unpadded call."""
    gen = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "[token_type_ids, token_type_ids.new_zeros(completion_ids.shape)], dim=1" in gen
    assert 'forward_kwargs = {k: v for k, v in prompt_inputs.items() if k not in ["input_ids", "attention_mask"]}' in gen
    tokenize = inspect.getsource(GRPOTrainer._tokenize_prompts)
    assert 'multimodal_fields = {k: v for k, v in tokenized.items() if k not in ("input_ids", "attention_mask")}' in tokenize
    assert "conversation=prompts," in tokenize


def test_tool_mask_only_enters_the_loss_mask():
    """TPRL's token masks are multiplied into TRL's tool_mask: it must reach the loss mask and nothing else."""
    src = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]' in src
    assert "attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)" in src
    # Metrics-only attention is measured in the training forward: compute_loss must reach _compute_loss, and that the
    # grad-enabled log-prob forward (no separate fused/Liger loss path that would bypass it), and the slice dict's
    # extra keys must survive TRL's shuffle and split (tensors with a batch dimension do).
    assert "return self._compute_loss(model, inputs)" in inspect.getsource(GRPOTrainer.compute_loss)
    assert "= self._get_per_token_logps_and_entropies(" in src
    prepare = inspect.getsource(GRPOTrainer._prepare_inputs)
    assert "generation_batch = shuffle_sequence_dict(generation_batch)" in prepare
    assert "split_tensor_dict(generation_batch, self.args.steps_per_generation)" in prepare
    # The DAPO normaliser is counted at generation time, before our filtering.
    gen = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "num_items_in_batch = self.accelerator.gather(loss_mask.sum()).sum()" in gen


# InternVL and LFM2-VL: tile-indexed pixel_values, whose per-row tile counts TRL recomputes (num_tiles); LFM2-VL tiles
# an image only when it is far over its token budget (256 pixels a side here, 2 x 2 tiles and a thumbnail).
@pytest.mark.parametrize("arch, side", [("qwen2_5_vl", None), ("gemma3", None), ("idefics3", None), ("internvl", None),
                                        ("lfm2_vl", None), ("lfm2_vl", 256)])
def test_forward_inputs_match_what_trl_passes(tiny_vlm_dir, grpo_train_dataset, tmp_path, monkeypatch, arch, side):
    """With num_iterations=2 TRL runs its own old-log-prob forward: the trainer's batch builder must lay out exactly
    its inputs, both from TRL's own prompt encoding (``_tokenize_prompts``, the usual path) and from the prompts
    encoded again (the path of a ``rollout_func``, which bypasses TRL's encoding)."""
    if side is not None:  # the same prompts with larger images
        from fixtures.testing import shape_image

        grpo_train_dataset = grpo_train_dataset.select(range(8)).map(
            lambda row, i: {"image": shape_image(side, i)}, with_indices=True)
    args = MDIGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4,
        num_generations=4, max_completion_length=6, max_steps=1, num_iterations=2, save_strategy="no",
        mask_truncated_completions=False, disable_tqdm=True,
    )
    trainer = MDIGRPOTrainer(str(tiny_vlm_dir(arch)), reward_funcs=["mdi_balance"], args=args,
                             train_dataset=grpo_train_dataset)
    seen = {}
    original = GRPOTrainer._get_per_token_logps_and_entropies
    original_rewards = MDIGRPOTrainer._calculate_rewards

    def spy(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        if not torch.is_grad_enabled() and "trl" not in seen:
            seen["trl"] = {"input_ids": input_ids, "attention_mask": attention_mask, "logits_to_keep": logits_to_keep,
                           **kwargs}
        return original(self, model, input_ids, attention_mask, logits_to_keep, **kwargs)

    original_tokenize = GRPOTrainer._tokenize_prompts

    def tokenize_spy(self, prompts):
        out = original_tokenize(self, prompts)
        seen.setdefault("encoded", PromptEncoding(out[0], out[2]))  # what the trainer keeps of TRL's own encoding
        return out

    def rewards_spy(self, inputs, prompts, completions, completion_ids_list):
        seen.setdefault("ours", self._policy_batch(seen["encoded"], prompts, inputs, completion_ids_list))
        seen.setdefault("again", self._policy_batch(None, prompts, inputs, completion_ids_list))
        return original_rewards(self, inputs, prompts, completions, completion_ids_list)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", spy)
    monkeypatch.setattr(MDIGRPOTrainer, "_calculate_rewards", rewards_spy)
    monkeypatch.setattr(GRPOTrainer, "_tokenize_prompts", tokenize_spy)
    trainer.train()
    trl_in = seen["trl"]
    for name in ("ours", "again"):
        ours = seen[name].logp_inputs()
        keys = {k for k, v in trl_in.items() if torch.is_tensor(v)}
        assert keys == {k for k, v in ours.items() if torch.is_tensor(v)}, (name, keys)
        for key in keys:
            assert torch.equal(trl_in[key], ours[key]), (name, key)
        assert trl_in["logits_to_keep"] == ours["logits_to_keep"]
        assert trl_in["num_images"] == ours["num_images"]
        assert trl_in.get("num_tiles") == ours["num_tiles"], name


# reward_funcs / reward_weights / reward_processing_classes with reward_func_names: TRL's four parallel reward lists,
# which MDIGRPOTrainer._plan_with_loaded_model trims when the default stack loses mdi_balance after the model loaded.
@pytest.mark.parametrize("attr", ["_metrics", "reward_func_names", "reward_funcs", "reward_weights",
                                  "reward_processing_classes", "num_generations", "num_generations_eval",
                                  "use_vllm", "vllm_importance_sampling_correction", "num_iterations", "_tokenizer",
                                  "chat_template_kwargs"])
def test_trainer_attributes_we_read(tiny_vlm_dir, grpo_train_dataset, tmp_path, attr):
    args = MDIGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none",
                         per_device_train_batch_size=4, num_generations=4, max_steps=1)
    trainer = _trainer_cache.get("t") or MDIGRPOTrainer(str(tiny_vlm_dir("qwen2_5_vl")), args=args,
                                                       train_dataset=grpo_train_dataset)
    _trainer_cache["t"] = trainer
    assert hasattr(trainer, attr), f"GRPOTrainer no longer has {attr!r}"


_trainer_cache: dict = {}


def test_transformers_generation_encoding_step_we_wrap():
    """trl_mdi.vision_pass wraps transformers' generate-time image encoding (the dummy vision pass runs there on
    image-less processes): its name, its argument and what it returns must stay, or ZeRO-3 generation of mixed
    batches would hang instead of failing here."""
    from transformers.generation.utils import GenerationMixin

    step = GenerationMixin._prepare_multimodal_encoder_kwargs_for_generation
    assert _params(step) == ["self", "model_kwargs"]
    assert "return self._prepare_multimodal_encoder_kwargs_for_generation(model_kwargs)" in inspect.getsource(
        GenerationMixin)
    src = inspect.getsource(step)
    assert 'model_kwargs.setdefault("mm_encoder_outputs", {})' in src
    assert 'model_kwargs["mm_encoder_outputs"][modality] = encoder_fn(**encoder_kwargs)' in src


def test_trl_loads_the_processor_as_the_trainer_does_before_it():
    """MDIGRPOTrainer loads the processor before building TRL (the plan reads its chat template), the way
    GRPOTrainer.__init__ would load it when none is given: if TRL changes how, this fails first."""
    src = inspect.getsource(GRPOTrainer.__init__)
    call = src[src.index("if processing_class is None:"):]
    call = call[: call.index("\n\n")]  # the if-block, up to the blank line after it
    for part in ("AutoProcessor.from_pretrained(", "get_config_model_id(model.config)", "revision=model_revision",
                 'truncation_side="left"', 'padding_side="left"', "trust_remote_code=args.trust_remote_code"):
        assert part in call, part
    assert 'model_revision = model_init_kwargs.get("revision")' in src


def test_what_the_run_plan_reads_before_trl_is_built():
    """trl_mdi.run_plan decides before GRPOTrainer.__init__ runs (issue 43): (1) whether TRL runs its old-log-prob
    forward, from the config values TRL copies onto itself (``trl_runs_policy_forward``); (2) what only the model's
    modules tell, from the class TRL's ``create_model_from_path`` loads (``model_facts.trl_model_class``) built with
    the ``attn_implementation`` and ``dtype`` TRL passes it (``model_skeleton``)."""
    from trl.trainer import grpo_trainer

    init = inspect.getsource(GRPOTrainer.__init__)
    for line in ("self.num_iterations = args.num_iterations", "self.use_vllm = args.use_vllm",
                 "self.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction",
                 "model = create_model_from_path(model, **model_init_kwargs)"):
        assert line in init, line
    loader = inspect.getsource(grpo_trainer.create_model_from_path)
    for part in ('dtype = kwargs.get("dtype", "float32")',
                 "architecture = getattr(transformers, config.architectures[0], None)",
                 "for candidate in (AutoModelForImageTextToText, AutoModelForCausalLM):",
                 "if candidate.__name__ in auto_map:", "architecture = AutoModelForCausalLM",
                 "model = architecture.from_pretrained(model_id, **kwargs)"):
        assert part in loader, part


@pytest.mark.parametrize("attn_implementation", [None, "eager"])
def test_the_model_class_built_without_weights_reads_as_the_loaded_model(tiny_vlm_dir, attn_implementation):
    """On every tiny family (and its attention implementation forced to eager): what the plan reads off the class built
    on the meta device (``model_skeleton``) is what the model TRL loads tells: the attention implementation, whether
    the probe can measure it, whether the dummy vision pass can hook it."""
    from transformers import AutoConfig, AutoProcessor
    from trl.trainer.utils import create_model_from_path

    from fixtures.tiny import TINY_ARCHS
    from trl_mdi.attention.model_facts import attention_implementation, model_skeleton
    from trl_mdi.attention.probe import probe_support
    from trl_mdi.vision_pass import vision_pass_problem

    def read(model, processor):
        return attention_implementation(model), probe_support(model), vision_pass_problem(model, processor)

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    for arch in TINY_ARCHS:
        path = str(tiny_vlm_dir(arch))
        processor = AutoProcessor.from_pretrained(path)
        skeleton = model_skeleton(path, AutoConfig.from_pretrained(path), kwargs)
        assert next(skeleton.parameters()).device.type == "meta", arch
        loaded = create_model_from_path(path, **kwargs)
        assert type(skeleton) is type(loaded), arch
        assert read(skeleton, processor) == read(loaded, processor), arch
        if attn_implementation:
            assert attention_implementation(loaded) == attn_implementation, arch


def test_the_model_class_is_built_without_weights_under_zero3_too(tiny_vlm_dir):
    """Under a ZeRO-3 config transformers builds a model inside deepspeed.zero.Init (its parameters partitioned
    across the processes: a collective). The skeleton must stay whole and on meta, built as inside an active
    zero.Init (transformers' ``set_zero3_state``), whose flag ``_from_config`` reads."""
    from transformers import AutoConfig, PreTrainedModel
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    from trl_mdi.attention.model_facts import model_skeleton

    assert "and not _is_ds_init_called" in inspect.getsource(PreTrainedModel._from_config)
    path = str(tiny_vlm_dir("qwen2_5_vl"))
    zero3 = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        assert is_deepspeed_zero3_enabled()
        skeleton = model_skeleton(path, AutoConfig.from_pretrained(path))
    finally:
        del zero3
    assert not is_deepspeed_zero3_enabled()
    assert {p.device.type for p in skeleton.parameters()} == {"meta"}
    assert not any(hasattr(p, "ds_id") for p in skeleton.parameters())  # never partitioned


def test_the_processor_loaded_first_is_the_one_trl_would_load(tiny_vlm_dir, tmp_path):
    from transformers import AutoProcessor

    from trl_mdi.run_plan import load_processing_class

    path = str(tiny_vlm_dir("qwen2_5_vl"))
    args = MDIGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    ours = load_processing_class(path, args)
    trls = AutoProcessor.from_pretrained(path, truncation_side="left", padding_side="left")
    assert type(ours) is type(trls)
    assert ours.tokenizer.padding_side == trls.tokenizer.padding_side == "left"
    assert ours.tokenizer.truncation_side == trls.tokenizer.truncation_side == "left"
    assert ours.tokenizer.get_vocab() == trls.tokenizer.get_vocab() and ours.chat_template == trls.chat_template


def test_what_the_fault_handling_relies_on():
    """Issue 38 (trl_mdi.checkpoints, the trainer's train and _save_checkpoint, LiveDiagnostics.on_train_begin):
    (1) _save_checkpoint(model, trial) writes <_get_output_dir(trial)>/checkpoint-<global_step>, the folder the
    override marks complete or removes; trainer_state.json is written after the optimizer, scheduler and RNG states;
    (2) train(resume_from_checkpoint, trial, ...) replaces True by get_last_checkpoint (the highest number, whole or
    not), which the override resolves first; (3) a checkpoint without optimizer.pt or scheduler.pt loads neither,
    silently (a fresh Adam): why both are required; (4) callbacks' on_train_begin runs after the checkpoint's state
    loaded, so the live logs open at the checkpoint's step; (5) the file names the checks look for."""
    import transformers.trainer as T
    from transformers import Trainer

    assert _params(Trainer._save_checkpoint) == ["self", "model", "trial"]
    # TRL's own override writes one more file into the same folder after transformers' trainer_state.json (so that
    # file is not the last one written: the marker, written after super(), is).
    assert _params(GRPOTrainer._save_checkpoint) == ["self", "model", "trial"]
    trl_save = inspect.getsource(GRPOTrainer._save_checkpoint)
    assert trl_save.index("super()._save_checkpoint(model, trial)") < trl_save.index(
        'output_dir = os.path.join(self._get_output_dir(trial=trial), checkpoint_folder)')
    assert _params(Trainer.train)[:3] == ["self", "resume_from_checkpoint", "trial"]
    save = inspect.getsource(Trainer._save_checkpoint)
    for line in ('checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"',
                 "run_dir = self._get_output_dir(trial=trial)", "output_dir = os.path.join(run_dir, checkpoint_folder)"):
        assert line in save, line
    order = ["self._save_optimizer_and_scheduler(output_dir)", "self._save_rng_state(output_dir)",
             "self.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))"]
    assert sorted(order, key=save.index) == order
    assert "resume_from_checkpoint = get_last_checkpoint(args.output_dir)" in inspect.getsource(Trainer.train)
    load = inspect.getsource(Trainer._load_optimizer_and_scheduler)
    assert "if checkpoint_file_exists and os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):" in load
    loop = inspect.getsource(Trainer._inner_training_loop)
    assert loop.index("self._init_training_state(") < loop.index("self.callback_handler.on_train_begin(")
    assert "TrainerState.load_from_json(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME))" in \
        inspect.getsource(Trainer._init_training_state)
    assert (T.TRAINER_STATE_NAME, T.OPTIMIZER_NAME, T.SCHEDULER_NAME) == ("trainer_state.json", "optimizer.pt",
                                                                        "scheduler.pt")
    assert T.PREFIX_CHECKPOINT_DIR == "checkpoint"


def test_tokenize_prompts_keeps_pad_tokens_which_aya_vision_needs_the_trainers_copy_for(tiny_vlm_dir):
    """TRL 1.16's ``_tokenize_prompts`` keeps each row's ``input_ids`` as its prompt, reading no attention mask.
    ``AyaVisionProcessor`` defaults its text to ``padding=True``, so in a batch whose images cost different numbers of
    tiles the shorter prompt comes back led by pad tokens, which generation and every log-prob forward would attend
    to; ``processor_for_trl``'s copy returns each prompt unpadded, as TRL expects (the user's processor untouched)."""
    from types import SimpleNamespace

    from PIL import Image
    from transformers import AutoProcessor

    from fixtures.testing import shape_image
    from trl_mdi.attention.model_facts import processor_for_trl

    processor = AutoProcessor.from_pretrained(tiny_vlm_dir("aya_vision"))
    pad = processor.tokenizer.pad_token_id
    # A square image: 4 tiles and a global view; a 32-pixel one: the global view alone.
    prompts = [[{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "What colour is the shape?"}]}]
               for image in (shape_image(56, 1), Image.new("RGB", (32, 32)))]

    def tokenize(proc):
        trl_self = SimpleNamespace(_is_vlm=True, environment_factories=None, tools=None, chat_template=None,
                                   chat_template_kwargs={}, processing_class=proc)
        return GRPOTrainer._tokenize_prompts(trl_self, prompts)[0]

    padded = tokenize(processor)
    assert len(padded[0]) == len(padded[1]) and padded[1][0] == pad and pad not in padded[0]
    unpadded = tokenize(processor_for_trl(processor))
    assert unpadded[0] == padded[0] and unpadded[1] == [t for t in padded[1] if t != pad]
    assert processor.text_kwargs == {"padding_side": "left", "padding": True}  # the user's object as it was


def test_tokenize_prompts_takes_text_as_lists_which_pixtral_needs_the_trainers_copy_for(tiny_vlm_dir, tmp_path):
    """TRL 1.16's ``_tokenize_prompts`` tokenizes a whole batch in one ``apply_chat_template`` call, unpadded, and
    keeps ``input_ids`` as lists. ``PixtralProcessor`` (Mistral 3) defaults its text to ``return_tensors="pt"``, so a
    batch of prompts of different lengths fails there; the trainer hands TRL ``processor_for_trl``'s copy, which
    returns lists (the user's processor untouched)."""
    from types import SimpleNamespace

    from transformers import AutoProcessor

    from fixtures.testing import shape_image
    from trl_mdi.attention.model_facts import processor_for_trl

    processor = AutoProcessor.from_pretrained(tiny_vlm_dir("mistral3"))
    prompts = [[{"role": "user", "content": [{"type": "image", "image": shape_image(56, 1)},
                                             {"type": "text", "text": "What colour is the shape in the image?"}]}],
               [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]]

    def tokenize(proc):
        trl_self = SimpleNamespace(_is_vlm=True, environment_factories=None, tools=None, chat_template=None,
                                   chat_template_kwargs={}, processing_class=proc)
        return GRPOTrainer._tokenize_prompts(trl_self, prompts)

    with pytest.raises(ValueError, match="Unable to create tensor"):
        tokenize(processor)
    prompt_ids, images, fields = tokenize(processor_for_trl(processor))
    assert all(isinstance(ids, list) for ids in prompt_ids) and len(prompt_ids[0]) != len(prompt_ids[1])
    assert images[1] is None and fields["pixel_values"].shape[0] == 1
    assert processor.text_kwargs == {"return_tensors": "pt"}  # the user's object as it was
    from fixtures.testing import zen_image_dataset

    trainer = MDIGRPOTrainer(str(tiny_vlm_dir("mistral3")), processing_class=processor, reward_funcs=[lambda **k: []],
                             args=MDIGRPOConfig(str(tmp_path), use_cpu=True, report_to="none",
                                                per_device_train_batch_size=2, num_generations=2),
                             train_dataset=zen_image_dataset(2))
    assert "return_tensors" not in trainer.processing_class.text_kwargs


def test_completions_table_is_written_from_logs_at_log_time():
    """trl_mdi.diagnostics.completions_table: the trainer lays its per-rollout columns into ``_logs["extra"]`` just
    before ``GRPOTrainer.log`` and extends ``_logs["images"]`` itself. Right only while TRL (1) keeps the table's rows
    in ``_logs``, deques sized to the generation batch, (2) appends each generation batch's rows, gathered from every
    process in process order, inside _generate_and_score_completions, (3) gathers the images there only when
    ``log_multimodal`` is on (the trainer turns it off around that call and gathers them on every process), and (4)
    builds the parquet and the wandb / trackio tables in ``log()`` from ``_logs``, every ``extra`` column included."""
    flat = lambda fn: " ".join(inspect.getsource(fn).split())  # noqa: E731 (whitespace-insensitive source)
    init = flat(GRPOTrainer.__init__)
    for key in ("images", "prompt", "completion", "advantages"):
        assert f'"{key}": deque(maxlen=args.generation_batch_size)' in init, key
    assert '"extra": defaultdict(lambda: deque(maxlen=args.generation_batch_size))' in init
    gen = flat(GRPOTrainer._generate_and_score_completions)
    assert 'self._logs["prompt"].extend(gather_object(prompts))' in gen
    assert 'self._logs["advantages"].extend(all_process_advantages.tolist())' in gen
    assert ('if images is not None and self.log_multimodal: self._logs["images"].extend(gather_object(images))'
            in gen)
    log = flat(GRPOTrainer.log)
    assert '"prompt": [strip_images_from_messages(messages) for messages in self._logs["prompt"]]' in log
    assert '**self._logs["extra"], "advantage": self._logs["advantages"], }' in log
    assert "df_base.to_parquet(" in log and 'images_raw = self._logs["images"] or []' in log
    assert 'logging_backend.log({"completions": logging_backend.Table(dataframe=df)})' in log
    assert _params(GRPOTrainer.log) == ["self", "logs", "start_time"]


def test_what_the_weight_loading_overrides_rely_on():
    """Issue 42 (MDIGRPOTrainer._load_from_checkpoint / _load_best_model, trl_mdi.checkpoints.load_full_weights):
    (1) transformers' Trainer loads a checkpoint's whole-model weights with ``load_state_dict(state_dict, False)``,
    without the key conversion ``save_pretrained`` reverted (the fault the overrides replace; should transformers fix
    it, this fails and the overrides can go); (2) train() calls _load_from_checkpoint(checkpoint) only outside
    DeepSpeed and FSDP, before accelerate wraps the model, and DeepSpeed resumes from its own shards in
    _inner_training_loop; _load_best_model loads DeepSpeed's shards itself; (3) save_pretrained writes the reverted
    layout; (4) the loader the trainer calls is from_pretrained's own: convert_and_load_state_dict_in_model(model,
    state_dict, load_config) with the model's conversion mapping, returning (loading info, offload index), the info
    naming missing, unexpected and mismatched keys and conversion errors; tied weights listed in
    ``all_tied_weights_keys``."""
    import dataclasses

    from transformers import PreTrainedModel, Trainer
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils.loading_report import LoadStateDictInfo

    flat = lambda fn: " ".join(inspect.getsource(fn).split())  # noqa: E731 (whitespace-insensitive source)
    assert _params(Trainer._load_from_checkpoint) == ["self", "resume_from_checkpoint", "model"]
    assert _params(Trainer._load_best_model) == ["self"]
    for fn in (Trainer._load_from_checkpoint, Trainer._load_best_model):
        assert flat(fn).count("load_result = model.load_state_dict(state_dict, False)") == 1, fn.__name__
    assert "load_result = load_sharded_checkpoint(model, resume_from_checkpoint, strict=is_sagemaker_mp_enabled())" \
        in flat(Trainer._load_from_checkpoint)
    assert "elif _is_peft_model(model):" in flat(Trainer._load_from_checkpoint)
    train = flat(Trainer.train)
    assert ("if not is_sagemaker_mp_enabled() and not self.is_deepspeed_enabled and not self.is_fsdp_enabled: "
            "self._load_from_checkpoint(resume_from_checkpoint)") in train
    assert train.index("self._load_from_checkpoint(resume_from_checkpoint)") < train.index("inner_training_loop(")
    assert ("if self.is_deepspeed_enabled: deepspeed_load_checkpoint( self.model_wrapped, resume_from_checkpoint, "
            "load_module_strict=not _is_peft_model(self.model) )") in flat(Trainer._prepare_for_training)
    assert ("if self.args.load_best_model_at_end and self.state.best_model_checkpoint is not None: "
            "self._load_best_model()") in flat(Trainer._finalize_training)
    assert "if self.is_deepspeed_enabled: deepspeed_load_checkpoint(" in flat(Trainer._load_best_model)
    assert "state_dict = revert_weight_conversion(model_to_save, state_dict)" in flat(PreTrainedModel.save_pretrained)
    assert _params(convert_and_load_state_dict_in_model)[:3] == ["model", "state_dict", "load_config"]
    assert "return loading_info, disk_offload_index" in inspect.getsource(convert_and_load_state_dict_in_model)
    assert "model._weight_conversions = model_specific_conversions" in flat(convert_and_load_state_dict_in_model)
    assert _params(get_model_conversion_mapping)[0] == "model"
    assert "weight_mapping" in {f.name for f in dataclasses.fields(LoadStateDictConfig)}
    assert {"missing_keys", "unexpected_keys", "mismatched_keys", "conversion_errors"} <= {
        f.name for f in dataclasses.fields(LoadStateDictInfo)}
    assert "self.all_tied_weights_keys = self.get_expanded_tied_weights_keys(" in flat(PreTrainedModel.post_init)


def test_what_save_on_sigterm_relies_on():
    """trl_mdi.preemption.PreemptionCallback: (1) a callback's on_step_end runs, after every optimizer step, before
    transformers decides to save, and ``control.should_save`` set there saves that step's checkpoint through
    _save_checkpoint (the override that marks it whole), then on_save runs; (2) ``should_training_stop`` then ends
    the loop; (3) the callback handler hands on_train_begin the model (the tests' parameter digest reads it)."""
    from transformers import Trainer
    from transformers.trainer_callback import CallbackHandler

    flat = lambda fn: " ".join(inspect.getsource(fn).split())  # noqa: E731 (whitespace-insensitive source)
    epoch = flat(Trainer._run_epoch)
    assert epoch.index("self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)") < \
        epoch.index("self._maybe_log_save_evaluate(") < epoch.index(
            "if self.control.should_epoch_stop or self.control.should_training_stop: break")
    save = flat(Trainer._maybe_log_save_evaluate)
    assert ("if self.control.should_save: self._save_checkpoint(model, trial) self.control = "
            "self.callback_handler.on_save(self.args, self.state, self.control)") in save
    assert "model=self.model" in flat(CallbackHandler.call_event)


def test_what_the_resume_checks_read():
    """trl_mdi.checkpoints.already_trained reads trainer_state.json's global_step, max_steps and num_train_epochs (the
    TrainerState fields transformers saves); resume_record reads GRPOConfig's batch fields, steps_per_generation
    filled in by its __post_init__; train() returns TRL's TrainOutput(global_step, training_loss, metrics)."""
    import dataclasses

    from transformers import TrainerState
    from transformers.trainer_utils import TrainOutput

    assert {"global_step", "max_steps", "num_train_epochs"} <= {f.name for f in dataclasses.fields(TrainerState)}
    assert TrainOutput._fields == ("global_step", "training_loss", "metrics")
    args = MDIGRPOConfig("out", use_cpu=True, bf16=False, per_device_train_batch_size=2, num_generations=2,
                         gradient_accumulation_steps=3)
    assert (args.steps_per_generation, args.num_iterations) == (3, 1)


def test_server_mode_requests_go_through_the_clients_session():
    """trl_mdi.vllm_server: the trainer bounds every request of TRL's vLLM client by wrapping the client's
    ``requests.Session`` (``trainer.vllm_generation.vllm_client.session``), and waits for the server itself before TRL
    builds the client. That covers every request only while (1) the client is that attribute, built in server mode,
    (2) every request but the start-up health check goes through ``self.session`` (the health check, ``requests.get``,
    is what wait_for_server runs first, with a timeout), (3) the session's retries live on its mounted adapters, and
    (4) TRL places one run of image tokens per image (what check_server_images refuses otherwise)."""
    from trl.generation import vllm_client, vllm_generation

    assert "self.vllm_client = VLLMClient(" in inspect.getsource(vllm_generation.VLLMGeneration._init_vllm)
    client = inspect.getsource(vllm_client.VLLMClient)
    assert "self.session = requests.Session()" in client
    assert "HTTPAdapter(max_retries=retry_strategy" in client and 'self.session.mount("http://", adapter)' in client
    assert client.count("requests.get(") == 1 and client.count("requests.post(") == 0
    assert "requests.get(url)" in inspect.getsource(vllm_client.VLLMClient.check_server)
    place = inspect.getsource(vllm_generation.VLLMGeneration._place_features)
    assert "The prompt must contain one run of image tokens per image." in place
