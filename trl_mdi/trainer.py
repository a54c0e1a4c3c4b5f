"""MDIGRPOTrainer: TRL's GRPOTrainer plus per-rollout attention measurement and the MDI reward fields."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch
from accelerate.utils import gather_object
from transformers.utils import logging
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from .attention import (
    ModalityAttention,
    _forward_tensors,
    _layout,
    probe_attention,
    template_text_exclusion_mask,
)
from .attention.model_facts import load_model_config, model_facts
from .config import MDIGRPOConfig
from .diagnostics import (
    ConsoleSummaryCallback,
    LiveDiagnostics,
    attention_map_records,
    gather_rollout_records,
)
from .drop_in import model_segment_names, resolve_attention_metrics, reward_stack_for_model
from .perturb import perturb_images
from .rewards import (
    group_relative_mdi_score,
    resolve_reward_funcs,
    reward_name,
    zero_spread_fraction,
)
from .scoring import (
    ScoringSession,
    apply_group_filter,
    apply_tprl,
    attention_fields,
    attention_metric_values,
    attention_table,
    check_reward_inputs,
    decode_row_images,
    fit_width,
    float_or_none,
    group_filter_keep,
    lazy_images,
    rebuild_forward_inputs,
    row_images,
)
from .tprl import token_visual_dependency

logger = logging.get_logger(__name__)


@contextlib.contextmanager
def rng_untouched(device: torch.device):
    """Fork the CPU RNG (and the device's, on an accelerator) so a forward inside consumes no random numbers."""
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            yield
        return
    index = device.index if device.index is not None else getattr(torch, device.type).current_device()
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        yield


class MDIGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that measures, per rollout, how much the generated tokens attend to the image vs the text.

    Departures from `trl.GRPOTrainer` (everything else is inherited unchanged):

    1. **Attention probe after generation.** For every local rollout, the attention mass of the generated tokens
       on image / prompt-text / completion keys is measured per layer (`trl_mdi.attention`): exact, O(L) memory,
       with the SDPA kernel. The measurement rides on TRL's own no-grad policy forward when TRL runs one (old
       log-probs: misaligned gradient accumulation, or vLLM importance-sampling correction); otherwise the trainer
       runs exactly one no-grad forward of the policy over prompt + completion, through TRL's own log-prob forward
       (same chunking and multimodal inputs). Generation itself is untouched, so HF generate and vLLM both work.
    2. **Reward fields.** Each rollout's `mdi`, `mdi_balance`, `mdi_group_score`, `aei_text`, `aei_image` and the
       per-segment `mdi_<segment>` values are added to the inputs that TRL passes to reward functions, so a reward
       declares the field as a named argument (and fails loudly on a plain GRPOTrainer). Rollouts without image
       tokens get None. `mdi_group_score` is computed over whole groups gathered from all processes.
    3. **Rewards by name.** `reward_funcs` may be registry names or `pkg.module:function` paths; with none given,
       the 4:1:1 stack (mc_idx, think_format, mdi_balance; without mdi_balance on a text-only model). Required
       dataset columns are checked at construction.
    4. **Metrics.** `attention/*` (mean MDI per segment, AEI, mass shares, rows without image),
       `rewards/<name>/zero_spread_frac` (fraction of groups in which a reward has no spread, hence no signal),
       `perf/*` (generation / scoring / update seconds, tokens and samples per second), `tprl/*`, `filter/*` and
       `data/bad_images`, through TRL's metric path, so they reach every `report_to` tracker.
    5. **TPRL** (`enable_entropy_filtering`, `enable_perception_filtering`, `enable_trajectory_reweighting`):
       per-sequence top-p token masks multiplied into TRL's `tool_mask` (the loss mask only; the DAPO normaliser
       is counted before them), and advantages scaled by batch-global trajectory multipliers. Log-probs under
       the real image come from the forward of item 1; the perturbed-image forward is the only one TPRL adds.
    6. **Online group filtering** (`online_filtering`): groups whose mean `filter_key` reward is outside
       `[filter_low, filter_high]` get zero advantage, leave the loss mask, and leave the normaliser.
    7. **Live diagnostics** (`realtime_rollout_logging`): each generation batch, gathered from all processes, is
       appended by the main process to `training_logs/rollout_results_<run>.md` and
       `attention_diagnostics_<run>.md` (resume-aware), with attention-map PNGs; a console summary per log.
    8. **Robust data handling.** Image columns are decoded by the trainer, so an unreadable image is skipped
       and counted (or stops every process with one error: `on_bad_image`); batches mixing rows with and
       without images work (TRL 1.16 crashes on them); under ZeRO-3 a batch with images on some ranks only
       raises a clear error instead of hanging; a world size that accelerate failed to see is an error.
    9. **Drop-in for any model.** A plain `trl.GRPOConfig` is upgraded to an `MDIGRPOConfig`. What the probe can
       measure is read from the model's config before loading (`trl_mdi.attention.model_facts`): a text-only model
       trains as under GRPOTrainer (metrics off unless explicitly asked for, which is an error); a hybrid model is
       measured on its softmax-attention layers only, and segments are formed over those (`trl_mdi.drop_in`).
    10. **Observing changes nothing.** The probe's extra forwards run in a forked RNG: with dropout they draw masks,
       but the training step sees the random stream it would have seen without them.
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
        funcs = resolve_reward_funcs(list(names), args.reward_weights)
        resolve_attention_metrics(args, facts, funcs, user_named_rewards=named is not None)
        segment_names = model_segment_names(args, facts)
        check_reward_inputs(funcs, args, train_dataset, eval_dataset, segment_names)
        if args.uses_visual_dependency:
            for split, ds in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
                cols = getattr(ds, "column_names", None)
                if isinstance(cols, list) and not {"image", "images"} & set(cols):
                    raise ValueError(
                        f"enable_perception_filtering / enable_trajectory_reweighting measure how much each token "
                        f"depends on the image, but {split} has no 'image' or 'images' column (columns: {cols}). "
                        "Turn them off for text-only data."
                    )
        train_dataset, eval_dataset = lazy_images(train_dataset), lazy_images(eval_dataset)
        self._model_facts = facts  # fixed for the run: which layers the probe must find, the image token ids
        self._image_ids = list(facts.image_token_ids)
        self._probe_session: ScoringSession | None = None
        self._perf: dict[str, float] = {}
        self._diagnostics = (
            LiveDiagnostics(args, is_main_process=args.process_index == 0,
                            reward_names=[reward_name(f) for f in funcs], num_generations=args.num_generations,
                            model_name=model if isinstance(model, str) else getattr(model.config, "_name_or_path", ""),
                            layers=facts.describe_layers() if args.compute_attention_metrics else None)
            if args.realtime_rollout_logging else None
        )
        super().__init__(model, reward_funcs=funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, **kwargs)
        if args.online_filtering and args.filter_key != "reward":
            if not any(n in (args.filter_key, f"{args.filter_key}_reward") for n in self.reward_func_names):
                raise ValueError(f"filter_key {args.filter_key!r} is not one of the rewards {self.reward_func_names} "
                                 "(or 'reward' for the weighted total)")

        self.add_callback(ConsoleSummaryCallback(args.colorize_output))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and self.accelerator.num_processes != world:
            # Without a GPU accelerate finds no backend, reports one process per rank and every rank trains alone.
            raise RuntimeError(
                f"launched with WORLD_SIZE={world} but accelerate sees {self.accelerator.num_processes} process(es). "
                "On a machine without a GPU set ddp_backend='gloo' (and use_cpu=True for plain DDP; use_cpu=False "
                "with DeepSpeed); examples/scripts/grpo_vlm.py does this for you."
            )

    # --------------------------------------------------------------------------------------------- overrides
    def _generate(self, prompts):
        out = super()._generate(prompts)
        images = out[6]
        if images is not None and any(imgs is None for imgs in images):
            # TRL 1.16 gives None for a row without an image and hands the list to the processor, which rejects
            # None: a batch mixing rows with and without images would crash. Per-row lists ([img] / []) work.
            out = (*out[:6], [imgs if imgs is not None else [] for imgs in images], *out[7:])
        return out

    def _generate_and_score_completions(self, inputs):
        bad = self._check_images(inputs)
        self._check_image_presence_across_ranks(inputs)
        if any(x.get("image", 0) is None for x in inputs) and not any("images" in x for x in inputs):
            # Same fix for the dataset's image column, which TRL uses when a batch holds no image at all.
            for x in inputs:
                x["images"] = [x["image"]] if x.get("image") is not None else []
        step = self.state.global_step + 1  # the optimizer step this generation batch feeds
        session = ScoringSession(
            capture_in_trl_forward=self._trl_runs_policy_forward(),
            measure_attention=self.args.compute_attention_metrics,
            need_entropy=self.args.enable_entropy_filtering,
        )
        if self._diagnostics and self._diagnostics.is_main and self._diagnostics.wants_maps(step):
            rows = [i for i, x in enumerate(inputs) if len(row_images(x)) == 1]
            session.map_rows = rows[: self.args.attention_maps_per_step]
        session.bad_rows = bad
        self._probe_session = session
        start = time.perf_counter()
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self._probe_session = None
        mode = "train" if self.model.training else "eval"
        if session.bad_global is not None and session.bad_global.any():
            local = session.bad_global[self.accelerator.process_index * len(inputs):][: len(inputs)]
            apply_group_filter(out, ~local.to(out["advantages"].device), self.accelerator.gather)
        n_bad = float(session.bad_global.sum()) if session.bad_global is not None else 0.0
        self._metrics[mode]["data/bad_images"].append(n_bad)
        if self.args.online_filtering:
            self._filter_groups(out, session, mode)
        if self.args.uses_tprl:
            self._apply_tprl(out, session)
        generation = session.reward_start - start - (session.scoring_seconds if session.capture_in_trl_forward else 0)
        self._perf = {
            "generation": max(generation, 0.0),
            "scoring": session.scoring_seconds,
            "tokens": float(self.accelerator.gather(out["prompt_mask"].sum() + out["completion_mask"].sum()).sum()),
            "samples": float(len(inputs) * self.accelerator.num_processes),
        }
        self._metrics[mode]["perf/generation_seconds"].append(self._perf["generation"])
        self._metrics[mode]["perf/scoring_seconds"].append(session.scoring_seconds)
        if self._diagnostics is not None:
            self._write_diagnostics(step, session, out)
        return out

    def _check_image_presence_across_ranks(self, inputs) -> None:
        """Under ZeRO-3 a batch with images on some processes and none on others would hang: say so instead."""
        if self.accelerator.num_processes < 2 or not self.is_deepspeed_enabled:
            return
        if self.accelerator.state.deepspeed_plugin.zero_stage != 3:
            return
        has = torch.tensor([float(any(row_images(x) for x in inputs))], device=self.accelerator.device)
        flags = self.accelerator.gather(has)
        if 0 < flags.sum() < len(flags):
            raise RuntimeError(
                "ZeRO-3: this generation batch has images on some processes and none on others "
                f"(per process: {flags.int().tolist()}). The vision tower would run on some ranks only and the "
                "sharded-weight gathers would wait forever. Mix text-only and image rows so every per-device batch "
                "holds at least one image, or train text-only data with DDP / ZeRO-2."
            )

    def _check_images(self, inputs) -> list[int]:
        """Decode this batch's images; skip the unreadable ones or stop every process at once (on_bad_image)."""
        bad = decode_row_images(inputs)
        if self.args.on_bad_image == "error":
            reports = [r for r in gather_object([
                f"row {x.get('question_id', i)!r}: {x['_bad_image_error']}" for i, x in enumerate(inputs) if i in bad
            ]) if r]
            if reports:  # raised on every process together: none is left waiting in a collective
                raise RuntimeError(f"unreadable image(s) in the training data ({len(reports)}): " + "; ".join(reports)
                                   + ". Fix or drop these rows, or set on_bad_image='skip' to skip them.")
        elif bad:
            logger.warning("skipping %d rollout(s) with an unreadable image: %s", len(bad),
                           "; ".join(f"{inputs[i].get('question_id', i)!r} ({inputs[i]['_bad_image_error']})"
                                     for i in bad))
        return bad

    def training_step(self, model, inputs, num_items_in_batch):
        self._perf = {}
        start = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        wall = time.perf_counter() - start
        perf, metrics = self._perf, self._metrics["train"]
        if perf:  # this step generated: split its wall time, and count its throughput
            metrics["perf/update_seconds"].append(max(wall - perf["generation"] - perf["scoring"], 0.0))
            metrics["perf/tokens_per_second"].append(perf["tokens"] / wall)
            metrics["perf/samples_per_second"].append(perf["samples"] / wall)
        else:
            metrics["perf/update_seconds"].append(wall)
        return loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        session = self._probe_session
        if (
            session is None
            or not session.capture_in_trl_forward
            or session.scored
            or model is not self.model
            or torch.is_grad_enabled()
        ):
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              *args, **kwargs)
        # TRL's old-log-prob forward of the policy: measure inside it instead of running another one.
        if session.need_entropy:
            kwargs["compute_entropy"] = True  # the fused head returns it at no extra forward
        start = time.perf_counter()
        with self._maybe_probe(session, logits_to_keep) as state:
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                             *args, **kwargs)
        session.scoring_seconds += time.perf_counter() - start
        session.policy_logps, session.entropies, session.forward_done = out[0], out[1], True
        session.attention = state.result() if state is not None else None
        return out

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        session = self._probe_session
        if session is not None:
            session.reward_start = start = time.perf_counter()
            session.has_image = torch.tensor([bool(row_images(x)) for x in inputs])
            need_forward = session.measure_attention or self.args.uses_tprl
            if need_forward and not session.scored:
                self._scoring_forward(session, self._policy_forward_inputs(inputs, prompts, completion_ids_list))
            if self.args.uses_visual_dependency:
                self._visual_dependency(session, inputs, prompts, completion_ids_list)
            if session.attention is not None:
                self._attach_attention_fields(session.attention, inputs)
            session.scoring_seconds += time.perf_counter() - start
            session.batch = {"inputs": inputs, "prompts": prompts, "completions": completions,
                             "lengths": [len(c) for c in completion_ids_list]}
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if session is not None:
            local_bad = torch.zeros(len(inputs), dtype=torch.bool, device=rewards_per_func.device)
            local_bad[session.bad_rows] = True
            session.bad_global = self.accelerator.gather(local_bad)
            # Rollouts of an unreadable image are unscorable: NaN rewards give them advantage 0 and keep them out
            # of their group's baseline (TRL's own rule); the loss mask drops them after.
            rewards_per_func[session.bad_global] = float("nan")
            session.rewards_per_func = rewards_per_func
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        if num_generations and rewards_per_func.shape[0] % num_generations == 0:
            frac = zero_spread_fraction(rewards_per_func, num_generations)
            for name, value in zip(self.reward_func_names, frac.tolist()):
                self._metrics[mode][f"rewards/{name}/zero_spread_frac"].append(value)
        return rewards_per_func

    # -------------------------------------------------------------------------------------------- internals
    def _trl_runs_policy_forward(self) -> bool:
        """Whether TRL's _generate_and_score_completions runs a no-grad policy forward (old log-probs) this step.

        Mirrors TRL 1.16's condition; tests/test_trl_contract.py fails if TRL changes it.
        """
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or bool(
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _layout_fn(self, completion_length: int):
        """Per forward call: completion = the last `completion_length` positions; they are the measured queries."""
        tokenizer = self._tokenizer if self.args.attention_text_keys == "content" else None

        def layout_fn(kwargs):
            ids, am, mm = _forward_tensors(kwargs)
            region = torch.zeros_like(am, dtype=torch.bool)
            region[:, ids.shape[1] - completion_length:] = True
            excl = template_text_exclusion_mask(ids, tokenizer, self._image_ids) if tokenizer is not None else None
            return _layout(ids, am, region, self._image_ids, mm, excl, "completion")

        return layout_fn

    def _policy_forward_inputs(self, inputs, prompts, completion_ids_list) -> dict[str, Any]:
        return rebuild_forward_inputs(self.processing_class, self._tokenizer.pad_token_id, self.chat_template_kwargs,
                                      inputs, prompts, completion_ids_list, self.accelerator.device)

    @contextlib.contextmanager
    def _maybe_probe(self, session: ScoringSession, completion_length: int):
        if not session.measure_attention:
            yield None
            return
        with probe_attention(self.model, self._layout_fn(completion_length), session.map_rows) as state:
            yield state

    def _policy_logps(self, fwd: dict[str, Any], compute_entropy: bool = False, probe=None):
        """One no-grad policy forward through TRL's own log-prob path (same chunking, fused head).

        It runs in the model's current mode, as TRL's own old-log-prob forward does (so with dropout > 0 it draws
        dropout masks), inside a forked RNG: the random stream the training step sees afterwards is the one it would
        have seen without this forward, so observing never changes the run.
        """
        fwd = dict(fwd)
        mode = "train" if self.model.training else "eval"
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        input_ids, attention_mask, c_len = fwd.pop("input_ids"), fwd.pop("attention_mask"), fwd.pop("logits_to_keep")
        # Every rank runs this forward (same number of chunks): ZeRO-3 needs all ranks in every gather.
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs), \
                rng_untouched(self.accelerator.device):
            logps, entropies, _ = super()._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, c_len, batch_size=batch_size, compute_entropy=compute_entropy,
                **fwd,
            )
        return logps, entropies

    def _scoring_forward(self, session: ScoringSession, fwd: dict[str, Any]) -> None:
        """The one extra no-grad forward: attention probe and, for TPRL, log-probs under the real image, entropies."""
        completion_length = fwd["logits_to_keep"]
        if not self.args.uses_tprl:
            # Only the attention masses are wanted: let the LM head score one position per row instead of the whole
            # completion (TRL's fused head skips positions whose label is -100). At Qwen's 152k vocabulary the head
            # is about a tenth of the forward's FLOPs; the probe still measures every completion token.
            fwd = {**fwd, "logits_to_keep": 1}
        with self._maybe_probe(session, completion_length) as state:
            logps, entropies = self._policy_logps(fwd, compute_entropy=session.need_entropy)
        if self.args.uses_tprl:
            session.policy_logps, session.entropies = logps, entropies
        session.forward_done = True
        session.attention = state.result() if state is not None else None

    def _visual_dependency(self, session: ScoringSession, inputs, prompts, completion_ids_list) -> None:
        """s_t from one no-grad forward with perturbed images (the only other forward TPRL adds)."""
        a = self.args
        rows = [row_images(x) for x in inputs]
        step = self.state.global_step if self.model.training else 10**9 + self.state.global_step
        perturbed = perturb_images(
            rows, a.perception_perturbation, seed=a.perturbation_seed, step=step,
            row_offset=self.accelerator.process_index * len(inputs), patch_size=a.perturbation_patch_size,
            prob=a.perturbation_prob, noise_std=a.perturbation_noise_std, blur_radius=a.perturbation_blur_radius,
        )
        aug_inputs = [{**x, "images": imgs} for x, imgs in zip(inputs, perturbed)]
        fwd = self._policy_forward_inputs(aug_inputs, prompts, completion_ids_list)
        aug_logps, _ = self._policy_logps(fwd)
        logps = fit_width(session.policy_logps, aug_logps.shape[1])
        s_t = token_visual_dependency(logps, aug_logps)
        # Rows without an image have no visual dependency to measure: 0, and the masks leave them unfiltered.
        session.visual_dependency = s_t * session.has_image.to(s_t.device)[:, None]

    def _attach_attention_fields(self, attention: ModalityAttention, inputs: list[dict]) -> None:
        """Add per-rollout attention fields to every input row (TRL passes row keys to rewards) and log metrics."""
        expected = list(self._model_facts.measured_layers)
        if attention.layers != expected:  # the config's layer_types told us which layers would run softmax attention
            raise RuntimeError(
                f"the attention probe measured layers {attention.layers} but this {self._model_facts.model_type} "
                f"model's config predicts softmax attention in layers {expected}: its layer_types are not understood "
                "(please report it with the model id); set compute_attention_metrics=False to train without metrics"
            )
        local = attention_table(attention, self.args.attention_layer_segments, self.args.mdi_balance_ratio)
        keys = list(local)
        table = torch.stack([local[k].float() for k in keys], dim=1).to(self.accelerator.device)
        gathered = self.accelerator.gather(table)  # (N_global, K): groups can span processes
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        group_score = group_relative_mdi_score(gathered[:, keys.index("mdi")].cpu(), num_generations)
        start = self.accelerator.process_index * len(inputs)
        local["mdi_group_score"] = group_score[start : start + len(inputs)]
        fields = attention_fields([n for n in attention.segments(self.args.attention_layer_segments) if n != "all"])
        for i, row in enumerate(inputs):
            for k in fields:
                row[k] = float_or_none(local[k][i])
        for name, value in attention_metric_values(keys, gathered).items():
            self._metrics[mode][name].append(value)

    def _filter_groups(self, out: dict[str, Any], session: ScoringSession, mode: str) -> None:
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        keep = group_filter_keep(session.rewards_per_func, self.reward_weights, self.reward_func_names,
                                 self.args.filter_key, self.args.filter_low, self.args.filter_high, num_generations)
        start = self.accelerator.process_index * len(out["advantages"])
        apply_group_filter(out, keep[start : start + len(out["advantages"])], self.accelerator.gather)
        self._metrics[mode]["filter/groups_dropped_frac"].append(1.0 - float(keep.float().mean()))

    def _apply_tprl(self, out: dict[str, Any], session: ScoringSession) -> None:
        metrics = apply_tprl(out, session, self.args, self.accelerator.gather, self.accelerator.process_index)
        mode = "train" if self.model.training else "eval"
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)

    def _write_diagnostics(self, step: int, session: ScoringSession, out: dict[str, Any]) -> None:
        """Gather this batch's rollouts (all ranks take part) and append them to the live logs (main process)."""
        if not session.batch:
            return
        records = gather_rollout_records(session, self.args, self.reward_func_names, self.reward_weights,
                                         self.accelerator.gather(out["advantages"]))
        maps = attention_map_records(session, self.args, self.processing_class) if session.map_rows else []
        self._diagnostics.write(step, float(self.state.epoch or 0.0), records, maps, {})

