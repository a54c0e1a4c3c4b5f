"""MDIGRPOTrainer: TRL's GRPOTrainer plus per-rollout attention measurement and the MDI reward fields."""

from __future__ import annotations

import time
from typing import Any

import torch
from accelerate.utils import gather_object
from transformers.utils import logging
from trl import GRPOTrainer

from . import signals as S
from .answer_format import template_prefills_think
from .attention import ModalityAttention
from .attention.model_facts import load_model_config, model_facts, unwrap_model
from .config import MDIGRPOConfig
from .data.images import (
    decode_row_images,
    lazy_images,
    report_bad_images,
    row_images,
)
from .diagnostics import ConsoleSummaryCallback, LiveDiagnostics, perception_strips, write_batch
from .drop_in import (
    check_filter_key,
    check_image_columns_for_tprl,
    check_world_size,
    model_segment_names,
    perception_token_layers,
    probe_placement,
    resolve_attention_metrics,
    reward_stack_for_model,
)
from .filtering import apply_group_filter, group_filter_keep
from .policy_forwards import PolicyForwards
from .records import BatchRecord, PendingMeasurement, PolicyForward, ScoredRollouts, StepTiming
from .rewards import (
    ThinkFormatReward,
    bind_think_format,
    resolve_reward_funcs,
    reward_name,
    zero_spread_fraction,
)
from .rewards.inputs import check_reward_inputs, dataset_columns
from .tprl import apply_tprl, signal_rank_corr
from .training_forward import TrainingForwardProbe
from .vision_pass import drop_empty_image_inputs, images_on_some_processes_only, vision_pass_for_run

logger = logging.get_logger(__name__)


class MDIGRPOTrainer(TrainingForwardProbe, PolicyForwards, GRPOTrainer):
    """GRPOTrainer that measures, per rollout, how much the generated tokens attend to the image vs the text.

    Departures from `trl.GRPOTrainer` (everything else is inherited unchanged; docs/differences.md has the
    details):

    1. **Attention probe** (`trl_mdi.attention`): every rollout measured per layer, exact, O(L) memory; it rides on
       TRL's own no-grad policy forward when TRL runs one, on TRL's training forward when nothing reads it before the
       loss, else one extra no-grad forward through TRL's log-prob path (`drop_in.probe_placement`).
    2. **Per-rollout signals** (`trl_mdi.signals`): `mdi`, `mdi_<segment>`, `mdi_balance`, `mdi_group_score`, AEI...
       added to the rows TRL hands to reward functions (None without image tokens), and logged as `attention/*`.
    3. **Rewards by name** (`trl_mdi.rewards`): registry names or import paths; the 4:1:1 stack by default; every
       reward's inputs checked at construction (`trl_mdi.rewards.inputs`).
    4. **TPRL** (`trl_mdi.tprl`): token masks into TRL's loss mask, trajectory multipliers into the advantages.
    5. **Online group filtering** (`trl_mdi.filtering`) and **unreadable images** (`trl_mdi.data.images`): such
       rollouts leave the update; images on some processes only: a dummy vision pass (`trl_mdi.vision_pass`).
    6. **Live diagnostics** (`trl_mdi.diagnostics`): Markdown logs, attention maps, console summary; `perf/*`.
    7. **Drop-in for any model** (`trl_mdi.drop_in`): a plain `GRPOConfig` is upgraded; what the probe can measure is
       read from the model's config before loading (text-only: metrics off; hybrid: softmax layers only).
    8. **Observing changes nothing**: the probe's extra forwards run in a forked RNG (`trl_mdi.forward`).

    One record (`trl_mdi.records.BatchRecord`) carries a batch between TRL's stages, set and cleared in try/finally
    (TRL offers no other channel); everything else flows through arguments.
    """

    _tag_names = ["trl", "grpo", "trl_mdi"]

    def __init__(self, model, reward_funcs=None, args: MDIGRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "model")
            args = MDIGRPOConfig(f"{str(name).split('/')[-1]}-MDI-GRPO")
        else:
            args = MDIGRPOConfig.from_grpo_config(args)  # a plain GRPOConfig works: the added fields take defaults
        # What the probe can measure on this model, from its config alone: the weights load inside super().__init__.
        facts = model_facts(load_model_config(model, args.model_init_kwargs))
        if reward_funcs is not None and not isinstance(reward_funcs, (list, tuple)):
            reward_funcs = [reward_funcs]
        named = reward_funcs if reward_funcs is not None else args.reward_funcs
        names, args.reward_weights = reward_stack_for_model(named, args.reward_weights, facts)
        # think_format pays for the format the prompt asks: bind this run's pattern (a fresh instance per trainer).
        funcs = bind_think_format(resolve_reward_funcs(list(names), args.reward_weights), answer_pattern=args.answer_pattern)
        resolve_attention_metrics(args, facts, funcs, user_named_rewards=named is not None)
        segment_names = model_segment_names(args, facts)
        check_reward_inputs(funcs, dataset_columns(train_dataset, eval_dataset),
                            attention=bool(args.compute_attention_metrics), segments=segment_names)
        check_image_columns_for_tprl(args, dataset_columns(train_dataset, eval_dataset))
        train_dataset, eval_dataset = lazy_images(train_dataset), lazy_images(eval_dataset)
        self._model_facts = facts  # fixed for the run: which layers the probe must find, the image token ids
        self._image_ids = list(facts.image_token_ids)
        self._token_layers = perception_token_layers(args, facts)  # layers a_t averages over; () when unused
        self._batch: BatchRecord | None = None  # the one per-batch channel between TRL's stages (records.py)
        # A batch measured in the training forward lives across micro-steps, like TRL's own _buffered_inputs.
        self._pending: PendingMeasurement | None = None
        self.live_logs = (
            LiveDiagnostics(args, is_main_process=args.process_index == 0,
                            reward_names=[reward_name(f) for f in funcs], num_generations=args.num_generations,
                            model_name=model if isinstance(model, str) else getattr(model.config, "_name_or_path", ""),
                            layers=facts.describe_layers() if args.compute_attention_metrics else None,
                            segments=segment_names)
            if args.realtime_rollout_logging else None
        )
        super().__init__(model, reward_funcs=funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, **kwargs)
        check_filter_key(args, self.reward_func_names)
        self.add_callback(ConsoleSummaryCallback(args.colorize_output))
        if self.live_logs is not None:
            self.add_callback(self.live_logs)  # closes the log files when training ends
        check_world_size(self.accelerator.num_processes)
        # The format check the rewards, the clean-format metric and the logs share (one definition everywhere).
        prefilled = template_prefills_think(self.processing_class, self.chat_template_kwargs)
        self._answer_format = ThinkFormatReward(args.answer_pattern, think_prefilled=prefilled)
        self.reward_funcs = bind_think_format(self.reward_funcs, think_prefilled=prefilled)
        # Mixed data: a slice of text-only rows is a text-only forward (TRL hands it empty image tensors), and under
        # ZeRO-3 / DDP image-less processes run the vision tower on a dummy, times zero.
        if facts.is_vlm:
            drop_empty_image_inputs(self.model)
        self._vision_pass = vision_pass_for_run(self.model, self.processing_class, self.accelerator.num_processes,
                                                facts.is_vlm, logger.info)
        attn = unwrap_model(self.model).config.get_text_config()._attn_implementation
        self._probe_placement = probe_placement(args, self.reward_funcs, attn, self._trl_runs_policy_forward())

    # --------------------------------------------------------------------------------------------- overrides
    def _generate(self, prompts):
        out = super()._generate(prompts)
        images = out[6]
        if images is not None and any(imgs is None for imgs in images):
            # TRL 1.16 gives None for a row without an image and hands the list to the processor, which rejects
            # None: a batch mixing rows with and without images would crash. Per-row lists ([img] / []) work.
            out = (*out[:6], [imgs if imgs is not None else [] for imgs in images], *out[7:])
        return out

    def training_step(self, model, inputs, num_items_in_batch):
        # The step owns the batch record, so that the perf split below sees what its generation (if any) measured.
        self._batch = record = BatchRecord()
        start = time.perf_counter()
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._batch = None
        for name, value in record.perf(time.perf_counter() - start).items():
            self._metrics["train"][name].append(value)
        return loss

    def _generate_and_score_completions(self, inputs):
        owned = self._batch is None  # evaluation batches arrive without a training step around them
        record = self._batch = self._batch or BatchRecord()
        try:
            return self._score_batch(inputs, record)
        finally:
            if owned:
                self._batch = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        record = self._batch
        if (record is None or not record.timing.rides_trl_forward or record.forward is not None
                or model is not self.model or torch.is_grad_enabled()):
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              *args, **kwargs)
        # TRL's old-log-prob forward of the policy: measure inside it instead of running another one.
        if self.args.enable_entropy_filtering:
            kwargs["compute_entropy"] = True  # the fused head returns it at no extra forward
        start = time.perf_counter()
        with self._maybe_probe(record.map_rows, logits_to_keep) as state:
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                             *args, **kwargs)
        record.timing.scoring += time.perf_counter() - start
        record.forward = self._measured_forward(state, logits_to_keep, logps=out[0], entropies=out[1])
        return out

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        record, mode, signals = self._batch, self._mode(), None
        if record is not None:
            record.timing.rewards_started = start = time.perf_counter()
            if ((self.args.compute_attention_metrics or self.args.uses_tprl) and record.forward is None
                    and not record.in_training_forward):
                fwd = self._policy_forward_inputs(inputs, prompts, completion_ids_list)
                record.forward = self._scoring_forward(record.map_rows, fwd)
            if record.forward is not None:
                record.forward.has_image = has_image = torch.tensor([bool(row_images(x)) for x in inputs])
                if self.args.uses_perturbed_forward:
                    record.forward.visual_dependency = self._visual_dependency(
                        inputs, prompts, completion_ids_list, record.forward.logps, has_image)
                if record.forward.image_attention is not None:  # no image: nothing to depend on, as for s_t
                    record.forward.image_attention *= has_image.to(record.forward.image_attention)[:, None]
                if record.forward.attention is not None:
                    signals = self._attach_signals(record.forward.attention, inputs, mode)
            record.timing.scoring += time.perf_counter() - start
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        clean = self.accelerator.gather(torch.tensor(self._answer_format(completions, [x.get("choices") for x in inputs]),
                                                     device=self.accelerator.device))  # NCCL gathers device tensors
        self._metrics[mode]["completions/clean_format_frac"].append(float(clean.mean()))
        if record is not None:
            bad = self.accelerator.gather(record.bad_rows.to(rewards.device))
            # Rollouts of an unreadable image are unscorable: NaN rewards give them advantage 0 and keep them out
            # of their group's baseline (TRL's own rule); the loss mask drops them after.
            rewards[bad] = float("nan")
            record.scored = ScoredRollouts(rewards=rewards, bad=bad, signals=signals, prompts=prompts,
                                           completions=completions, lengths=[len(c) for c in completion_ids_list])
        group = self._group_size(mode)
        if group and rewards.shape[0] % group == 0:
            for name, value in zip(self.reward_func_names, zero_spread_fraction(rewards, group).tolist()):
                self._metrics[mode][f"rewards/{name}/zero_spread_frac"].append(value)
        return rewards

    # -------------------------------------------------------------------------------------------- internals
    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    def _group_size(self, mode: str) -> int:
        return self.num_generations if mode == "train" else self.num_generations_eval

    def _local(self, gathered: torch.Tensor, n_local: int) -> torch.Tensor:
        """This process's slice of a tensor gathered from every process (rows in process order)."""
        start = self.accelerator.process_index * n_local
        return gathered[start : start + n_local]

    def _score_batch(self, inputs, record: BatchRecord) -> dict[str, Any]:
        """TRL's generation and scoring of one batch, with the images decoded first and TRL's output post-processed
        (unreadable images, online filtering, TPRL), the perf metrics and the live logs."""
        mode, step = self._mode(), self.state.global_step + 1  # the optimizer step this batch feeds
        errors = decode_row_images(inputs)
        report_bad_images(inputs, errors, self.args.on_bad_image, gather_object)
        zero3 = self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        mixed = images_on_some_processes_only(inputs, self.accelerator, has_vision_pass=self._vision_pass is not None,
                                              zero3=zero3)
        if any(x.get("image", 0) is None for x in inputs) and not any("images" in x for x in inputs):
            # Same fix as _generate's for the dataset's image column, which TRL uses when a batch holds no image.
            for x in inputs:
                x["images"] = [x["image"]] if x.get("image") is not None else []
        record.bad_rows = torch.tensor([i in errors for i in range(len(inputs))])
        if self.live_logs and self.live_logs.is_main and self.live_logs.wants_maps(step):
            rows = [i for i, x in enumerate(inputs) if row_images(x)]  # one panel row per image of a prompt
            record.map_rows = rows[: self.args.attention_maps_per_step]
        record.timing = StepTiming(started=time.perf_counter(), rides_trl_forward=self._trl_runs_policy_forward())
        record.in_training_forward = mode == "train" and self._probe_placement == "training_forward"
        # TRL 1.16 gathers the batch's images for its completion logs only on processes that have some: with images
        # on some processes only, that gather would pair with another collective. Skip image logging for such batches.
        log_multimodal, self.log_multimodal = self.log_multimodal, self.log_multimodal and not mixed
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self.log_multimodal = log_multimodal
        scored = record.scored
        if scored.bad.any():
            apply_group_filter(out, ~self._local(scored.bad, len(inputs)).to(out["advantages"].device),
                               self.accelerator.gather)
        self._metrics[mode]["data/bad_images"].append(float(scored.bad.sum()))
        if self.args.online_filtering:
            self._filter_groups(out, scored.rewards, mode)
        if self.args.uses_tprl:
            self._apply_tprl(out, record.forward, mode)
        if self.args.perception_signal_compare and record.forward is not None:
            self._metrics[mode]["tprl/signal_rank_corr"].append(signal_rank_corr(
                record.forward.visual_dependency, record.forward.image_attention, out["completion_mask"],
                record.forward.has_image, self.accelerator.gather))
        record.tokens = float(self.accelerator.gather(out["prompt_mask"].sum() + out["completion_mask"].sum()).sum())
        record.samples = float(len(inputs) * self.accelerator.num_processes)
        self._metrics[mode]["perf/generation_seconds"].append(record.timing.generation)
        self._metrics[mode]["perf/scoring_seconds"].append(record.timing.scoring)
        if record.in_training_forward:
            self._measure_in_training(out, step, inputs, record)
        elif self.live_logs is not None:
            self._write_live_logs(step, inputs, record, out)
        return out

    def _trl_runs_policy_forward(self) -> bool:
        """Whether TRL runs a no-grad policy forward (old log-probs): TRL 1.16's condition (test_trl_contract.py)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or bool(
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _attach_signals(self, attention: ModalityAttention, inputs: list[dict], mode: str) -> dict[str, torch.Tensor]:
        """This batch's per-rollout signals: added to the rows, logged as attention/*, returned for the live logs."""
        local, metrics = S.attach_signals(
            attention, inputs, segments_spec=self.args.attention_layer_segments,
            balance_ratio=self.args.mdi_balance_ratio, expected_layers=list(self._model_facts.measured_layers),
            gather=lambda t: self.accelerator.gather(t.to(self.accelerator.device)).cpu(),
            local=lambda t: self._local(t, len(inputs)), group_size=self._group_size(mode))
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)
        return local

    def _filter_groups(self, out: dict[str, Any], rewards: torch.Tensor, mode: str) -> None:
        keep = group_filter_keep(rewards, self.reward_weights, self.reward_func_names, self.args.filter_key,
                                 self.args.filter_low, self.args.filter_high, self._group_size(mode))
        apply_group_filter(out, self._local(keep, len(out["advantages"])), self.accelerator.gather)
        self._metrics[mode]["filter/groups_dropped_frac"].append(1.0 - float(keep.float().mean()))

    def _apply_tprl(self, out: dict[str, Any], forward: PolicyForward, mode: str) -> None:
        metrics = apply_tprl(out, self.args, entropies=forward.entropies,
                             visual_dependency=forward.perception(self.args.perception_signal),
                             has_image=forward.has_image, gather=self.accelerator.gather,
                             process_index=self.accelerator.process_index)
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)

    def _write_live_logs(self, step: int, inputs: list[dict], record: BatchRecord, out: dict[str, Any]) -> None:
        """Gather this batch's rollouts (all ranks take part) and append them to the live logs (main process)."""
        attention = record.forward.attention if record.forward is not None else None
        scores = record.forward.perception(self.args.perception_signal) if record.forward is not None else None
        strips = None
        if scores is not None and self.accelerator.process_index == 0:  # the first rows are the fully printed ones
            strips = perception_strips(scores, out["completion_ids"], out["completion_mask"], self._tokenizer,
                                       top_p=self.args.top_p_perception_tokens, signal=self.args.perception_signal,
                                       rows=self.args.log_full_rollouts_per_step)
        write_batch(self.live_logs, step, float(self.state.epoch or 0.0), inputs=inputs, scored=record.scored,
                    attention=attention, map_rows=record.map_rows, reward_names=self.reward_func_names,
                    reward_weights=self.reward_weights, advantages=self.accelerator.gather(out["advantages"]),
                    segments_spec=self.args.attention_layer_segments, processing_class=self.processing_class,
                    answer_format=self._answer_format, strips=strips)
