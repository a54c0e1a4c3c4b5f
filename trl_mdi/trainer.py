"""MDIGRPOTrainer: TRL's GRPOTrainer that measures, per rollout, how much the generated tokens attend to the image.

Departures from ``trl.GRPOTrainer`` (everything else is inherited unchanged; docs/differences.md has one line per
interception):

1. **A run plan** (``trl_mdi.run_plan``): everything decided at construction (rewards and weights, attention metrics
   and why, segments, where the probe measures, the extra forwards) in one frozen record, printed at start.
2. **Attention probe** (``trl_mdi.attention``): every rollout measured per layer, exact, in O(L) memory. It rides on
   TRL's no-grad old-log-prob forward when TRL runs one, on TRL's training forward when nothing reads it before the
   loss, else on one extra no-grad forward through TRL's own log-prob path (``RunPlan.placement``).
3. **Per-rollout signals** (``trl_mdi.signals``): ``mdi``, ``mdi_<segment>``, ``mdi_balance``, AEI... added to the
   rows TRL hands to reward functions (None without image tokens), and logged as ``attention/*``.
4. **Reliance signals** (``trl_mdi.counterfactual``, docs/reliance.md): when asked, one more no-grad forward of the
   same rollouts with a counterfactual image gives ``visual_gain``, ``answer_visual_gain``, ``blind_agrees``:
   whether the answer would have been the same without the image; logged as ``reliance/*``, readable by rewards.
5. **Rewards by name** (``trl_mdi.rewards``): registry names or import paths; without a ``reward_funcs`` argument,
   the config's ``reward_funcs`` (``MDIGRPOConfig``'s default: the 4:1:1 stack; a plain ``GRPOConfig`` has none,
   so GRPOTrainer decides); every reward's inputs checked at construction; each reward's None ("not applicable")
   and NaN (a failure) counted apart before TRL merges them (``rewards/<name>/none_frac``, ``nan_frac``; a NaN
   warned about once per reward).
6. **TPRL** (``trl_mdi.tprl``): token masks into TRL's loss mask, trajectory multipliers into the advantages, from a
   per-token perception signal: ``perturbation`` (one forward with perturbed images) or ``attention`` (the probe).
7. **Online group filtering** and **unreadable images**: such rollouts leave the update; images on some processes
   only: a dummy vision pass (``trl_mdi.vision_pass``).
8. **Live diagnostics** (``trl_mdi.diagnostics``): Markdown logs, attention maps, console summary; ``perf/*``; with
   ``log_completions``, every per-rollout signal as a column of TRL's completions table (parquet, wandb, trackio),
   laid under TRL's rows in ``log()``, and the table's images gathered on every process.
9. **Observing changes nothing**: the extra forwards run no-grad in a forked RNG, on every process.
10. **vLLM colocate** (``trl_mdi.vllm_prompts``): the engine gets one placeholder per image (TRL 1.16 hands it the
    processor's expanded ids, which vLLM expands again), and its cached image features are dropped before each
    weight sync.
11. **Nothing lost under faults**: one run per ``output_dir`` (``trl_mdi.run_lock``, taken before the weights load);
    checkpoints whole or refused (``trl_mdi.checkpoints``: a failed save removes its folder and names the cause, a
    resume checks the checkpoint first and ``true`` picks the newest whole one); a resume restores every saved
    tensor, converted as ``from_pretrained`` converts it, or refuses (``_load_from_checkpoint``,
    ``_load_best_model``: transformers' own load skips the conversion); a resumed run continues its own Markdown
    logs, and a crash or SIGTERM writes its last line there (``train``; with ``save_on_sigterm`` the processes agree
    to save a whole checkpoint first, ``trl_mdi.preemption``).

TRL offers no channel between its stages (its old-log-prob forward, ``_calculate_rewards``, the advantages), so the
trainer holds exactly two per-batch records, each set and cleared in ``try/finally``: ``_record`` while a generation
batch is scored, and ``_pending`` while a batch measured in the training forward waits for its last slice (like
TRL's own ``_buffered_inputs``). Everything else flows through arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import textwrap
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate.utils import DistributedType, gather_object
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from . import checkpoints
from . import signals as S
from .answer_tokens import answer_tokens
from .attention import ModalityAttention, probe_attention, trailing_completion_layout
from .attention.model_facts import (
    LOGIT_SCALE_UNUSED,
    expert_count_for_trl,
    load_model_config,
    processor_for_trl,
    typed_system_problem,
    unwrap_model,
)
from .attention.model_parts import choice_logits, hidden_states_at
from .batch import (
    check_counterfactual_encodes,
    completion_token_types,
    encode_prompts,
    merge_prompt_encodings,
    pad_rows,
    policy_batch,
    rng_untouched,
    tile_counts,
)
from .config import MDIGRPOConfig, output_dir_model_problem
from .counterfactual import NO_IMAGE, counterfactual_prompts
from .data.columns import check_choices
from .data.images import (
    ProcessorImageCheck,
    check_images_per_row,
    decode_row_images,
    lazy_images,
    report_bad_images,
    row_images,
)
from .diagnostics import (
    BatchLog,
    ConsoleSummaryCallback,
    LiveDiagnostics,
    escape_inline,
    image_evidence,
    perception_strips,
    write_batch,
)
from .diagnostics.completions_table import (
    CompletionColumns,
    TableBatch,
    column_names,
    table_columns,
    table_prompts,
)
from .diagnostics.writers import marked_completion
from .filtering import apply_group_filter, group_filter_keep
from .preemption import Preempted, PreemptionCallback, any_process, preempted_message, watch_sigterm
from .rewards import RewardTally, ThinkFormatReward, outcome_metrics, zero_spread_fraction
from .rewards.inputs import dataset_columns
from .run_lock import lock_output_dir
from .run_plan import (
    ProbePlacement,
    RunPlan,
    check_filter_key,
    check_world_size,
    effective_config,
    load_processing_class,
    plan_run,
)
from .tprl import apply_tprl, fit_width, perturbation_signal, signal_rank_corr
from .vision_pass import drop_empty_image_inputs, images_on_some_processes_only, vision_pass_for_run
from .vllm_prompts import (
    colocated_vlm,
    drop_stale_image_features,
    engine_prompt_ids,
    suppress_image_tokens,
)
from .vllm_server import bound_requests, check_server_images, server_mode, server_url, wait_for_server

logger = logging.get_logger(__name__)

ROLLOUT_KEY = "trl_mdi_rollout"  # (B,) local row indices carried through TRL's shuffle and split into slices


# ------------------------------------------------------------------------------------------------ per-batch records
@dataclass
class PromptEncoding:
    """TRL's own encoding of a batch's prompts (``_tokenize_prompts``): an extra forward needs no second processor
    call."""

    ids: list  # per row, the prompt's token ids
    multimodal: dict  # the processor's image fields (pixel_values, image_grid_thw, ...)


@dataclass
class ScoredRollouts:
    """What ``_calculate_rewards`` saw and TRL computed from it, kept for filtering and the live logs."""

    rewards: torch.Tensor  # (N_global, F) per reward function, NaN for unreadable images and None rewards
    bad: torch.Tensor  # (N_global,) bool: rollouts of an unreadable image
    prompts: list  # local rows
    completions: list
    lengths: list[int]


@dataclass
class StepTiming:
    """Wall seconds of one generation batch: generating, and the trainer's own scoring (probe, extra forwards).
    ``scoring_in_generation`` is the part of ``scoring`` spent inside TRL's forward, before ``rewards_started``."""

    started: float = 0.0
    rewards_started: float = 0.0
    scoring: float = 0.0
    scoring_in_generation: float = 0.0

    @property
    def generation(self) -> float:
        return max(self.rewards_started - self.started - self.scoring_in_generation, 0.0)


@dataclass
class BatchRecord:
    """One generation batch between TRL's stages. ``map_rows`` is the request (local rows whose per-image-token
    attention the probe keeps, for attention maps); the rest is filled as TRL's stages run. Where the probe measures
    is the run plan's (``RunPlan.batch_placement``): the record holds what was measured, never where."""

    step: int = 0  # the optimizer step this batch feeds
    map_rows: list[int] = field(default_factory=list)
    bad_rows: torch.Tensor | None = None  # (B,) bool: local rows whose image could not be decoded
    has_image: torch.Tensor | None = None  # (B,) bool: local rows with an image
    encoded: PromptEncoding | None = None
    completion_mask: torch.Tensor | None = None  # (B, C) the generated tokens, right-padded: what signals average
    forward: S.PolicyForward | None = None  # set once the policy forward ran: never run a second one
    counterfactual: S.CounterfactualForward | None = None
    signals: S.BatchSignals | None = None  # the per-rollout values, once the forwards that feed them ran
    scored: ScoredRollouts | None = None
    timing: StepTiming = field(default_factory=StepTiming)
    tokens: float = 0.0  # prompt + completion tokens of the generation batch, all processes
    samples: float = 0.0
    mixed: bool = False  # images on some processes only

    @property
    def generated(self) -> bool:
        """Whether a generation batch ran under this record (a training step without one only updates)."""
        return self.timing.started > 0.0

    def perf(self, wall: float) -> dict[str, float]:
        """perf/* of a training step that took ``wall`` seconds: the update's share and, if it generated, throughput.

        >>> r = BatchRecord(timing=StepTiming(started=1.0, rewards_started=3.0, scoring=0.5), tokens=100, samples=8)
        >>> r.perf(4.0)
        {'perf/update_seconds': 1.5, 'perf/tokens_per_second': 25.0, 'perf/samples_per_second': 2.0}
        """
        if not self.generated:
            return {"perf/update_seconds": wall}
        return {"perf/update_seconds": max(wall - self.timing.generation - self.timing.scoring, 0.0),
                "perf/tokens_per_second": self.tokens / wall, "perf/samples_per_second": self.samples / wall}


@dataclass
class MeasuredSlice:
    """One training slice measured in the training forward: its rows (local indices), the probe's result, and the
    completion's log-probs (detached)."""

    rows: list[int]
    attention: ModalityAttention | None
    logps: torch.Tensor


@dataclass
class PendingMeasurement:
    """A generation batch measured in the training forward, slice by slice (TRL shuffles and splits the batch; each
    slice carries its rows' local indices). Complete once every row has been measured; then its signals, metrics and
    live logs are written. ``out`` keeps what the logs need of TRL's output (advantages gathered, completion ids and
    mask, local)."""

    inputs: list[dict]
    record: BatchRecord
    out: dict[str, torch.Tensor]
    table: TableBatch | None = None  # its rows in TRL's completions table, filled once measured (log_completions)
    slices: list[MeasuredSlice] = field(default_factory=list)
    active_rows: list[int] | None = None  # the slice being trained now (set around its loss computation)

    @property
    def complete(self) -> bool:
        return sum(len(s.rows) for s in self.slices) == len(self.inputs)

    def slice_map_rows(self) -> list[int]:
        """Positions in the active slice of the rows the attention maps want."""
        return [i for i, row in enumerate(self.active_rows or []) if row in self.record.map_rows]

    def forward(self) -> S.PolicyForward:
        """The whole batch's measurement, rows back in generation order."""
        rows = [r for s in self.slices for r in s.rows]
        order = sorted(range(len(rows)), key=rows.__getitem__)
        logps = torch.cat([s.logps for s in self.slices])[order]
        parts = [s.attention for s in self.slices]
        attention = ModalityAttention.cat(parts).take(order) if parts[0] is not None else None
        return S.PolicyForward.measured(attention, logps.shape[1], logps=logps)


# ------------------------------------------------------------------------------------------------ the trainer

def _first_prompt_has_system(dataset) -> bool:
    """Whether the dataset's first conversational prompt has a system turn (True when it cannot be read: warn)."""
    try:
        prompt = next(iter(dataset))["prompt"]
    except Exception:  # noqa: BLE001 - no dataset, no prompt column, an unreadable first row
        return dataset is not None
    return isinstance(prompt, list) and any(isinstance(m, dict) and m.get("role") == "system" for m in prompt)


@contextlib.contextmanager
def fused_head_as_the_model_computes(model_type: str):
    """While TRL builds its trainer, make its fused LM head score log-probs as the model's own forward computes logits.

    TRL 1.16's ``GRPOTrainer.__init__`` patches the model with a fused LM head (``trl.trainer.utils.add_fused_lm_head``)
    that computes every log-prob it trains on from ``hidden @ W`` times the text config's ``logit_scale``. A family in
    ``LOGIT_SCALE_UNUSED`` samples (``generate``) from unscaled logits, so TRL's log-probs came from another
    distribution than the one that generated the completions (the tiny Aya Vision, with Cohere 2's default scale
    0.0625: up to 0.3 nat off per token). Inside this context TRL's patch reads a scale of 1 for such a model;
    the config keeps its value (saved checkpoints and vLLM read it). Other families: nothing changes.
    """
    if model_type not in LOGIT_SCALE_UNUSED:
        yield
        return
    from trl.trainer import grpo_trainer

    original = grpo_trainer.add_fused_lm_head

    def add_fused_lm_head(model, *args, **kwargs):
        text_config = model.config.get_text_config()
        scale = getattr(text_config, "logit_scale", None)
        text_config.logit_scale = 1.0  # read once, when TRL builds the head
        try:
            return original(model, *args, **kwargs)
        finally:
            text_config.logit_scale = scale

    grpo_trainer.add_fused_lm_head = add_fused_lm_head
    try:
        yield
    finally:
        grpo_trainer.add_fused_lm_head = original


class MDIGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that measures, per rollout, how much the generated tokens attend to the image vs the text.

    A drop-in: same arguments as ``trl.GRPOTrainer``; ``args`` may be a plain ``GRPOConfig`` (upgraded, the added
    fields at their defaults) or an :class:`~trl_mdi.MDIGRPOConfig`. ``trainer.run_plan`` says what the run does.

    Model card: named "MDI-GRPO"; it cites GRPO's paper as TRL does (DeepSeekMath), and its citation block adds the
    two papers whose methods this trainer adds: MDI/AEI (text dominance) and VPPO (token perception, TPRL).
    """

    _tag_names = ["trl", "grpo", "trl_mdi"]
    _name = "MDI-GRPO"
    _paper = {
        **GRPOTrainer._paper,
        # docstyle-ignore
        "citation": GRPOTrainer._paper["citation"] + "\n" + textwrap.dedent("""\
            @article{wu2025language,
                title        = {{When Language Overrules: Revealing Text Dominance in Multimodal Large Language Models}},
                author       = {Huyu Wu and Meng Tang and Xinhan Zheng and Haiyun Jiang},
                year         = 2025,
                eprint       = {arXiv:2508.10552},
            }
            @inproceedings{huang2026spotlight,
                title        = {{Spotlight on Token Perception for Multimodal Reinforcement Learning}},
                author       = {Siyuan Huang and others},
                year         = 2026,
                booktitle    = {The Fourteenth International Conference on Learning Representations, {ICLR} 2026},
                eprint       = {arXiv:2510.09285},
            }"""),
    }

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, *, run_plan: RunPlan | None = None, **kwargs):
        """``run_plan``: a plan already made by :func:`trl_mdi.run_plan.plan_run` for this model, processor, config
        and data (the entry point's, which it printed): the trainer follows it instead of deciding again. The
        rewards are then the plan's (``reward_funcs`` must be None) and ``processing_class`` the one it read."""
        if args is None:  # as GRPOTrainer: its defaults, no rewards from the config
            name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "model")
            args = GRPOConfig(f"{str(name).split('/')[-1]}-GRPO")
        config = MDIGRPOConfig.from_grpo_config(args)
        # One run per output_dir, before any weight loads: the main process locks it for the trainer's lifetime (the
        # OS drops the lock if the process dies).
        problem = output_dir_model_problem(config.output_dir, model)  # the model folder is not ours to overwrite
        if problem:
            raise ValueError(problem)
        self.run_lock = lock_output_dir(config.output_dir) if config.process_index == 0 else None
        if self.run_lock is not None:
            weakref.finalize(self, self.run_lock.release)
        evals = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval_dataset", eval_dataset)]
        for split, ds in [("train_dataset", train_dataset), *evals]:
            if ds is not None:
                check_choices(ds, split)  # too many choices, a label outside them...: the data's error, now
        if run_plan is not None:
            if reward_funcs is not None or kwargs.get("processing_class") is None:
                raise ValueError("run_plan: a plan already decided the rewards with one processor; pass that "
                                 "processing_class and no reward_funcs (or no run_plan, and the trainer decides)")
            plan = run_plan
        else:
            # Decide, then build TRL: the processor is loaded here as TRL would load it, so that the plan reads its
            # chat template. A model whose config cannot be read fails here with transformers' own error.
            model_config = load_model_config(model, config.model_init_kwargs, trust_remote_code=config.trust_remote_code)
            if kwargs.get("processing_class") is None:
                kwargs["processing_class"] = load_processing_class(model, config)
            plan = plan_run(model, kwargs["processing_class"], reward_funcs, config,
                            dataset_columns(train_dataset, eval_dataset), model_config=model_config)
        kwargs["processing_class"] = processor_for_trl(kwargs["processing_class"])  # Mistral 3: text as lists
        config = effective_config(config, plan)
        check_server_images(config, kwargs["processing_class"], plan.facts)
        if server_mode(config) and config.process_index == 0:  # TRL's own wait can hang on a silent server
            wait_for_server(server_url(config), config.vllm_server_timeout, model=plan.model_name)
        if (problem := typed_system_problem(kwargs["processing_class"])) and _first_prompt_has_system(train_dataset):
            logger.warning(f"The training prompts have a system turn, but the processor's {problem}.")
        self._record: BatchRecord | None = None
        self._pending: PendingMeasurement | None = None
        self._nan_warned: set[str] = set()  # rewards already warned about returning NaN: once per reward and run
        # Our columns of TRL's completions table, batch by batch, laid under TRL's rows at each log() (TRL's deques
        # hold one generation batch of rows).
        self.completion_columns = CompletionColumns(config.generation_batch_size) if config.log_completions else None
        # The format check the rewards, the clean-format metric and the logs share (one definition everywhere).
        self.answer_format = ThinkFormatReward(config.answer_pattern, think_prefilled=plan.think_prefilled)
        # Built before the weights load: a log path that cannot be written fails before any model work.
        self.live_logs = (
            LiveDiagnostics(config, is_main_process=config.process_index == 0, reward_names=list(plan.reward_names),
                            num_generations=config.num_generations, model_name=plan.model_name,
                            layers=plan.facts.describe_layers() if plan.attention_metrics else None,
                            segments=list(plan.segments))
            if config.realtime_rollout_logging else None
        )
        launch_world = int(os.environ.get("WORLD_SIZE", "1"))  # TRL's colocated vLLM resets it to accelerate's view
        with fused_head_as_the_model_computes(plan.facts.model_type):  # Aya Vision: TRL's head would scale its logits
            super().__init__(model, reward_funcs=list(plan.reward_funcs) if plan.reward_funcs else reward_funcs,
                             args=config, train_dataset=lazy_images(train_dataset),
                             eval_dataset=lazy_images(eval_dataset), **kwargs)
        check_filter_key(config, self.reward_func_names)
        check_world_size(self.accelerator.num_processes, self.accelerator.distributed_type != DistributedType.NO,
                         launch_world)
        self.add_callback(ConsoleSummaryCallback(config.colorize_output, self.reward_func_names))
        if self.live_logs is not None:
            self.add_callback(self.live_logs)  # closes the log files when training ends
        self.run_plan = self._plan_with_loaded_model(plan)
        if self.accelerator.is_main_process:
            logger.info(self.run_plan.describe())

    def _plan_with_loaded_model(self, plan: RunPlan) -> RunPlan:
        """The only changes made after ``super().__init__``: they need what TRL has just loaded. The plan is read
        again off the loaded model (``RunPlan.with_model``): the lines that waited for the weights are decided, and a
        model that turns out otherwise than its class built without weights (another attention implementation, an
        attention the probe cannot measure) revises the plan with a warning rather than run on a wrong one. Should
        the probe turn out unable to measure the model, the default stack's mdi_balance leaves TRL's four parallel
        reward lists (tests/test_trl_contract.py pins them) and attention-only settings are switched off in the
        trainer's copy of the config and the live logs. Then the hooks the plan asks for are installed: the guard
        for empty image inputs, the dummy vision pass, vLLM's bias against image tokens, and (vLLM server mode) a time
        limit on every request of TRL's client (``trl_mdi.vllm_server``); a MoE text config gets the expert count
        under the name TRL's forward reads (``expert_count_for_trl``: GLM-4.5V)."""
        loaded = plan.with_model(self.model, self.processing_class)
        if loaded == plan:
            loaded = plan  # the plan as decided (and printed) before the weights loaded
        elif plan.complete:
            logger.warning("MDIGRPOTrainer: the loaded model differs from its class built without weights; the run "
                           "follows the plan read off the loaded model:\n%s", loaded.describe())
        # Mixed data: a slice of text-only rows is a text-only forward (TRL hands it empty image tensors), and under
        # ZeRO-3 / DDP image-less processes run the vision tower on a dummy, times zero.
        if plan.facts.is_vlm:
            drop_empty_image_inputs(self.model)
        expert_count_for_trl(self.model)  # GLM-4.5V: the MoE expert count under the name TRL's forward reads
        if colocated_vlm(self.args, plan.facts):
            # TRL keeps the engine from sampling image placeholders under HF generate only (suppress_image_tokens says
            # why); its engine's own copy of the kwargs, never the user's config.
            self.vllm_generation.generation_kwargs = suppress_image_tokens(self.vllm_generation.generation_kwargs,
                                                                           plan.facts.image_token_ids)
        if server_mode(self.args) and self.accelerator.is_main_process:  # TRL's client is the main process's
            bound_requests(self.vllm_generation.vllm_client.session, self.args.vllm_server_request_timeout,
                           server_url(self.args))
        self.vision_pass = (vision_pass_for_run(self.model, self.processing_class, self.accelerator.num_processes,
                                                plan.facts.is_vlm, logger.info) if loaded.vision_pass else None)
        if loaded.counterfactual:
            check_counterfactual_encodes(self.processing_class, self.args.counterfactual_image,
                                         self.chat_template_kwargs, self.chat_template)
        if loaded.reward_names != plan.reward_names:  # the default stack lost mdi_balance: metrics are off
            keep = [i for i, n in enumerate(self.reward_func_names) if n in loaded.reward_names]
            self.reward_funcs = [self.reward_funcs[i] for i in keep]
            self.reward_func_names = [self.reward_func_names[i] for i in keep]
            self.reward_processing_classes = [self.reward_processing_classes[i] for i in keep]
            self.reward_weights = self.reward_weights[keep]
        if not loaded.attention_metrics and plan.attention_metrics:
            self.args.compute_attention_metrics = False  # the trainer's own copy of the config, not the user's
            if self.live_logs is not None:
                self.live_logs.attention = None
        return loaded

    # ------------------------------------------------------------------------------------ faults: resume, crash, save
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs):
        """``Trainer.train``, after checking the checkpoint (``trl_mdi.checkpoints.resolve_resume``: refused, before
        it loads, if it lacks what resuming needs; ``True`` / ``"true"``: the newest whole one) and pointing the live
        logs at the ones it recorded; an exception inside training writes "Run stopped" and why as the logs' last
        lines, then propagates. SIGTERM (``trl_mdi.preemption``) raises :class:`~trl_mdi.preemption.Preempted` at
        once, or with ``save_on_sigterm`` after the step in progress and a whole checkpoint saved by every
        process."""
        checkpoint, notes = checkpoints.resolve_resume(resume_from_checkpoint, self.args.output_dir,
                                                       allow_partial=self.args.allow_partial_resume)
        for note in notes:
            logger.warning(note)
        if checkpoint is not None:
            # Before its weights load: a run whose settings differ is refused by name; one already at its end stops.
            checkpoints.check_resume_matches(checkpoint, self._resume_record())
            if (done := checkpoints.already_trained(checkpoint, self.args.max_steps,
                                                    self.args.num_train_epochs)) is not None:
                return self._nothing_to_train(checkpoint, *done)
        if checkpoint is not None and self.live_logs is not None:
            self.live_logs.continue_logs(checkpoints.recorded_logs(checkpoint))
        with watch_sigterm(self.args.save_on_sigterm, lambda: self.state.global_step) as sigterm:
            stop = None
            if sigterm.installed and self.args.save_on_sigterm:
                gather = self._gather_cpu if self.accelerator.num_processes > 1 else None
                stop = PreemptionCallback(sigterm, lambda flag: any_process(flag, gather), self._warn_main,
                                          on_stop=self._stopped_on_sigterm)
                self.add_callback(stop)
            try:
                out = super().train(resume_from_checkpoint=checkpoint, trial=trial, **kwargs)
            except BaseException as caught:
                e = sigterm.as_raised(caught)  # a SIGTERM the interrupted code rewrapped still ends the run as one
                if self.live_logs is not None:
                    self.live_logs.stopped(self.state.global_step, e)
                    self.live_logs.close()
                if e is caught:
                    raise
                raise e from caught
            finally:
                if stop is not None:
                    self.remove_callback(stop)
        if stop is not None and (exit_ := stop.outcome()) is not None:
            # End the run as SIGTERM would have (status 143), never as if training had finished (a script would go on
            # to its final save_model / push_to_hub).
            self.accelerator.end_training()  # trackers finished, the process group destroyed
            if self.run_lock is not None:
                self.run_lock.release()
            raise exit_
        return out

    def _stopped_on_sigterm(self, step: int, signal_step: int | None) -> Preempted:
        """save_on_sigterm, once checkpoint-``step`` is saved on every process: the logs' last lines and the console
        say so; the exception ``train`` raises once the Trainer has finished."""
        folder = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        stop = Preempted(preempted_message(signal_step, step, folder), checkpoint=folder)
        if self.live_logs is not None:
            self.live_logs.stopped(step, stop)
        self._warn_main(str(stop))
        return stop

    def _resume_record(self) -> dict:
        """What a resume from this run's checkpoints must match (``trl_mdi.checkpoints.resume_record``)."""
        return checkpoints.resume_record(unwrap_model(self.model).config, self.args,
                                         processes=self.accelerator.num_processes,
                                         deepspeed=self.is_deepspeed_enabled, reward_names=self.run_plan.reward_names,
                                         reward_weights=self.run_plan.reward_weights)

    def _nothing_to_train(self, checkpoint: str, step: int, message: str) -> TrainOutput:
        """A resume from a checkpoint already at this run's end: no step, no save; said on the console. The model
        takes the checkpoint's weights (outside DeepSpeed / FSDP, which load theirs only while training), so that a
        script's save_model after train() writes the trained model, not the base one."""
        self._warn_main(message)
        if not (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            self._load_from_checkpoint(checkpoint)
        elif self.accelerator.is_main_process:
            logger.warning(f"The trainer's model still holds the weights it was built with: load {checkpoint} to use "
                           "the trained ones.")
        return TrainOutput(global_step=step, training_loss=float("nan"), metrics={})

    def _warn_main(self, message: str) -> None:
        if self.accelerator.is_main_process:
            logger.warning(message)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # transformers reloads a checkpoint's whole-model weights with load_state_dict(strict=False) and no key
        # conversion, but save_pretrained wrote them in the Hub layout: most tensors kept their old values behind a
        # warning (Qwen2.5-VL 68 of 69, LLaVA 1.5 all). Loaded here as from_pretrained converts them, or refused
        # (trl_mdi.checkpoints.load_full_weights); a LoRA adapter stays transformers' (PEFT's load), then checked.
        target = model if model is not None else self.model
        if self._loads_whole_weights(resume_from_checkpoint, target):
            checkpoints.load_full_weights(unwrap_model(target), resume_from_checkpoint)
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        if not self.is_fsdp_enabled:
            checkpoints.check_adapter_loaded(target, resume_from_checkpoint)

    def _load_best_model(self):
        # load_best_model_at_end: transformers' load has the same fault as a resume's (_load_from_checkpoint above).
        best = self.state.best_model_checkpoint
        if self._loads_whole_weights(best, self.model):
            logger.info(f"Loading best model from {best} (score: {self.state.best_metric}).")
            checkpoints.load_full_weights(unwrap_model(self.model), best)
            return
        super()._load_best_model()
        if not (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            checkpoints.check_adapter_loaded(self.model, best)

    def _loads_whole_weights(self, folder: str, model) -> bool:
        """Whether the trainer loads ``folder``'s weights itself: whole-model weights into a model held whole by this
        process. DeepSpeed resumes from its own ``global_step*/`` shards, FSDP from its own files, PEFT loads its
        adapter: those stay transformers'."""
        return (not (self.is_deepspeed_enabled or self.is_fsdp_enabled) and not checkpoints.is_peft_model(model)
                and checkpoints.holds_full_weights(folder))

    def _save_checkpoint(self, model, trial):
        # Whole or absent (trl_mdi.checkpoints): a stale marker goes first, the marker is written once every process
        # has saved, and a save that fails removes its folder and says why (tests/test_trl_contract.py pins the path).
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        try:
            if self.args.should_save:
                checkpoints.clear_marker(folder)
            super()._save_checkpoint(model, trial)
            self.accelerator.wait_for_everyone()
            if self.args.should_save:
                checkpoints.mark_complete(folder, logs=self.live_logs.log_paths() if self.live_logs else None,
                                          resume=self._resume_record())
        except Exception as e:
            raise checkpoints.save_failure(folder, e, remove=self.args.should_save) from e

    # ------------------------------------------------------------------------------------ TRL's stages, intercepted
    def training_step(self, model, inputs, num_items_in_batch):
        # The step owns the batch record, so that the perf split below sees what its generation (if any) measured.
        self._record = record = BatchRecord()
        start = time.perf_counter()
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._record = None
        for name, value in record.perf(time.perf_counter() - start).items():
            self._metrics["train"][name].append(value)
        return loss

    def _generate_and_score_completions(self, inputs):
        owned = self._record is None  # evaluation batches arrive without a training step around them
        record = self._record = self._record or BatchRecord()
        try:
            self._prepare_batch(inputs, record)
            # TRL 1.16 gathers the batch's images for its completions table only on processes that have some (and
            # only when some have): with images on some processes only, that gather would pair with another
            # collective, and a batch without images would leave the image column out of step with the rows. The
            # trainer gathers them itself, on every process, every batch of a VLM (tests/test_trl_contract.py pins
            # TRL's condition and its _logs["images"]).
            own_images = self.log_multimodal and (record.mixed or
                                                  (self.log_completions and self.run_plan.facts.is_vlm))
            log_multimodal, self.log_multimodal = self.log_multimodal, self.log_multimodal and not own_images
            try:
                out = super()._generate_and_score_completions(inputs)
            finally:
                self.log_multimodal = log_multimodal
            if own_images and self.log_completions:
                self._logs["images"].extend(gather_object([row_images(x) for x in inputs]))
            self._finish_batch(out, inputs, record)
            return out
        finally:
            if owned:
                self._record = None

    def _tokenize_prompts(self, prompts):
        if self.run_plan.facts.unpadded_batch_problem and len(prompts) > 1:
            # PaliGemma's processor cannot encode TRL's unpadded batch (ModelFacts.unpadded_batch_problem): one prompt
            # at a time, merged as TRL merges its per-prompt encodings.
            out = merge_prompt_encodings([super(MDIGRPOTrainer, self)._tokenize_prompts([p]) for p in prompts])
        else:
            out = super()._tokenize_prompts(prompts)
        # A processor's labels (PaliGemma's) are no model input of TRL's: generation would get them as a per-token field.
        out = (out[0], out[1], {k: v for k, v in out[2].items() if k != "labels"})
        record = self._record
        if record is not None and record.encoded is None:
            record.encoded = PromptEncoding(ids=out[0], multimodal=out[2])
        return out

    def _generate(self, prompts):
        # TRL 1.16's 8-tuple (tests/test_trl_contract.py pins it).
        prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images = super()._generate(
            prompts)
        if images is not None and any(imgs is None for imgs in images):
            # TRL gives None for a row without an image and hands the list to the processor, which rejects None: a
            # batch mixing rows with and without images would crash. Per-row lists ([img] / []) work. (The dataset's
            # image column gets the same fix in _prepare_batch, for batches in which TRL sees no image at all.)
            images = [imgs if imgs is not None else [] for imgs in images]
        return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        # vLLM's colocated engine expands image placeholders itself: hand it one per image; and it would reuse image
        # features computed before the weight sync TRL is about to run (trl_mdi.vllm_prompts says why for both). TRL
        # keeps, returns and scores its own expanded prompt_ids; only the engine's copy changes.
        if colocated_vlm(self.args, self.run_plan.facts):
            prompt_ids = engine_prompt_ids(prompt_ids, self.run_plan.facts.image_token_ids[0])
            if self.state.global_step != self._last_loaded_step:  # TRL's own condition for the sync
                drop_stale_image_features(self.vllm_generation)
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        # TRL 1.16 extends token_type_ids with zeros over the completion; PaliGemma reads 0 as its bidirectional prefix,
        # so the completion's types are set to what generation gave them (``ModelFacts.completion_token_type``).
        kwargs["token_type_ids"] = completion_token_types(kwargs.get("token_type_ids"), logits_to_keep,
                                                          self.run_plan.facts.completion_token_type)
        kwargs.pop("labels", None)  # PaliGemma's processor returns labels, which TRL passes on and its forward refuses
        # The probe rides on the TRL forward the plan puts it in (``_rides_here``); any other call is TRL's forward
        # unchanged.
        rides = self._rides_here(model)
        if rides is None:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              *args, **kwargs)
        record, pending = self._record, self._pending
        if rides is ProbePlacement.TRL_FORWARD and self.args.enable_entropy_filtering:
            kwargs["compute_entropy"] = True  # the fused head returns it at no extra forward
        start = time.perf_counter()
        map_rows = record.map_rows if rides is ProbePlacement.TRL_FORWARD else pending.slice_map_rows()
        with self._probe(map_rows, logits_to_keep) as probe:
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                             *args, **kwargs)
        attention = probe.result() if probe is not None else None
        if rides is ProbePlacement.TRL_FORWARD:
            seconds = time.perf_counter() - start
            record.timing.scoring += seconds
            record.timing.scoring_in_generation += seconds
            record.forward = S.PolicyForward.measured(attention, logits_to_keep, logps=out[0], entropies=out[1])
        else:
            pending.slices.append(MeasuredSlice(pending.active_rows, attention, out[0].detach()))
            pending.active_rows = None  # one measurement per slice
        return out

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        record, mode = self._record, self._mode()
        if record is not None:
            record.timing.rewards_started = start = time.perf_counter()
            record.completion_mask = pad_rows(completion_ids_list, 0, "right")[1]
            self._forwards_before_rewards(record, inputs, prompts, completion_ids_list)
            if record.forward is not None:  # else measured in the training forward: completed in compute_loss
                record.signals = self._batch_signals(record, mode)
                self._hand_to_rewards(inputs, record.signals)
            record.timing.scoring += time.perf_counter() - start
        # TRL turns a reward's None into NaN as soon as it returns, so None ("not applicable") and NaN (a failure)
        # can only be told apart on the reward's own return value: the batch's rewards are scored through counting
        # wrappers, put back at once.
        tally, funcs = RewardTally(self.reward_funcs), self.reward_funcs
        self.reward_funcs = tally.funcs
        try:
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            self.reward_funcs = funcs
        self._log_reward_outcomes(tally, mode)
        clean = self.accelerator.gather(torch.tensor(self.answer_format(completions, [x.get("choices") for x in inputs]),
                                                     device=self.accelerator.device))  # NCCL gathers device tensors
        self._metrics[mode]["completions/clean_format_frac"].append(float(clean.mean()))
        if record is not None:
            bad = self.accelerator.gather(record.bad_rows.to(rewards.device))
            # Rollouts of an unreadable image are unscorable: NaN rewards give them advantage 0 and keep them out
            # of their group's baseline (TRL's own rule); the loss mask drops them after.
            rewards[bad] = float("nan")
            record.scored = ScoredRollouts(rewards=rewards, bad=bad, prompts=prompts, completions=completions,
                                           lengths=[len(c) for c in completion_ids_list])
        group = self._group_size(mode)
        if group and rewards.shape[0] % group == 0:
            for name, value in zip(self.reward_func_names, zero_spread_fraction(rewards, group).tolist()):
                self._metrics[mode][f"rewards/{name}/zero_spread_frac"].append(value)
        return rewards

    def _log_reward_outcomes(self, tally: RewardTally, mode: str) -> None:
        """``rewards/<name>/none_frac`` and ``nan_frac`` of the generation batch (all processes), and one warning per
        reward, the first time it returns NaN (None is by design and never warned about)."""
        counts = self.accelerator.gather(torch.tensor([tally.counts], dtype=torch.float32,  # MPS has no float64
                                                      device=self.accelerator.device)).sum(dim=0)
        metrics = outcome_metrics(self.reward_func_names, counts.tolist())
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)
        for name, (_, n_bad, n) in zip(self.reward_func_names, counts.tolist()):
            if n_bad and name not in self._nan_warned:
                self._nan_warned.add(name)
                if self.accelerator.is_main_process:
                    logger.warning(
                        "reward %s returned NaN (or an infinite value) for %d of %d rollouts at step %d. TRL counts "
                        "such a value as 0 in the rollout's weighted total (lowering its advantage) and leaves it out "
                        "of rewards/%s/mean; return None where the reward does not apply. Counted in "
                        "rewards/%s/nan_frac; warned once per reward.", name, int(n_bad), int(n),
                        self.state.global_step, name, name)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # A batch measured in the training forward: each slice at its first pass (the key is popped, so later passes
        # over the buffered slice are not measured again); the batch is finished once its last slice has trained.
        rows, pending = inputs.pop(ROLLOUT_KEY, None), self._pending
        if rows is None or pending is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        pending.active_rows = rows.tolist()
        try:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            pending.active_rows = None
        if pending.complete:
            self._pending = None
            record = pending.record
            record.forward = pending.forward()
            record.signals = self._batch_signals(record, "train")
            if pending.table is not None:
                pending.table.columns.update(self._table_columns(record.signals, pending.out))
            if self.live_logs is not None:
                self._write_live_logs(pending.inputs, record, pending.out)
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # TRL writes its completions table (parquet, wandb, trackio) from _logs in this call: our per-rollout columns
        # join its "extra" columns here, under TRL's rows (tests/test_trl_contract.py pins _logs and log()).
        rows = self._logs["prompt"]
        if self.completion_columns is not None:
            columns = self.completion_columns.columns(len(rows))
            for name, shown in column_names(columns, self.reward_func_names).items():
                self._logs["extra"][shown] = deque(columns[name], maxlen=rows.maxlen)
        prompts = (table_prompts(rows, text="wandb" in (self.args.report_to or []))
                   if self.log_completions and self.accelerator.is_main_process else None)
        if prompts is None:
            return super().log(logs, start_time)
        self._logs["prompt"] = deque(prompts, maxlen=rows.maxlen)  # for this table only (table_prompts says why)
        try:
            super().log(logs, start_time)
        finally:
            self._logs["prompt"] = rows

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None):
        # TRL fills its card's Markdown template with these names as they are (the heading, a link's text): the output
        # folder's name and the dataset's go in as text (trl_mdi.diagnostics.markdown), never as markup.
        return super().create_model_card(model_name=None if model_name is None else escape_inline(model_name),
                                         dataset_name=None if dataset_name is None else escape_inline(dataset_name),
                                         tags=tags)

    # ------------------------------------------------------------------------------------ one generation batch
    def _rides_here(self, model) -> ProbePlacement | None:
        """Whether this call of TRL's log-prob path is the forward the plan measures the batch in, and which:
        TRL's no-grad old-log-prob forward of the policy (the first of the batch; a reference model's, or the policy
        with its adapter off for the KL term, comes later or is another model), or a training slice's first pass."""
        record, pending = self._record, self._pending
        if (record is not None and record.forward is None and model is self.model and not torch.is_grad_enabled()
                and self.run_plan.batch_placement(self._mode()) is ProbePlacement.TRL_FORWARD):
            return ProbePlacement.TRL_FORWARD
        if pending is not None and pending.active_rows is not None and torch.is_grad_enabled():
            return ProbePlacement.TRAINING_FORWARD
        return None

    def _prepare_batch(self, inputs: list[dict], record: BatchRecord) -> None:
        """Before TRL generates: decode the images (a bad one is reported, never fatal by default), pick the rows the
        attention maps want, start the clock."""
        record.step = self.state.global_step + 1  # the optimizer step this batch feeds
        # An image the processor refuses (its size or shape) is a bad image too, caught here rather than inside TRL.
        errors = decode_row_images(inputs, check=ProcessorImageCheck(self.processing_class))
        report_bad_images(inputs, errors, self.args.on_bad_image, gather_object)
        check_images_per_row(inputs, self.run_plan.facts, gather_object)
        zero3 = self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        record.mixed = images_on_some_processes_only(inputs, self.accelerator, zero3=zero3,
                                                     has_vision_pass=self.vision_pass is not None)
        if any(x.get("image", 0) is None for x in inputs) and not any("images" in x for x in inputs):
            # Same fix as _generate's for the dataset's image column, which TRL uses when a batch holds no image.
            for x in inputs:
                x["images"] = [x["image"]] if x.get("image") is not None else []
        record.bad_rows = torch.tensor([i in errors for i in range(len(inputs))])
        record.has_image = torch.tensor([bool(row_images(x)) for x in inputs])
        if self.live_logs and self.live_logs.is_main and self.live_logs.wants_maps(record.step):
            rows = [i for i, x in enumerate(inputs) if row_images(x)]  # one panel row per image of a prompt
            record.map_rows = rows[: self.args.attention_maps_per_step]
        record.timing = StepTiming(started=time.perf_counter())

    def _finish_batch(self, out: dict[str, Any], inputs: list[dict], record: BatchRecord) -> None:
        """After TRL scored the batch: unreadable images and online filtering out of the update, TPRL into the loss
        mask and advantages, perf metrics, then the live logs (now, or once the training forward measured it)."""
        mode = self._mode()
        scored = record.scored
        if scored.bad.any():
            apply_group_filter(out, ~self._local(scored.bad, len(inputs)).to(out["advantages"].device),
                               self.accelerator.gather)
        self._metrics[mode]["data/bad_images"].append(float(scored.bad.sum()))
        if self.args.online_filtering:
            keep = group_filter_keep(scored.rewards, self.reward_weights, self.reward_func_names, self.args.filter_key,
                                     self.args.filter_low, self.args.filter_high, self._group_size(mode))
            apply_group_filter(out, self._local(keep, len(inputs)), self.accelerator.gather)
            self._metrics[mode]["filter/groups_dropped_frac"].append(1.0 - float(keep.float().mean()))
        forward = record.forward
        if self.args.uses_tprl:
            self._log(mode, apply_tprl(out, self.args, entropies=forward.entropies,
                                       perception=forward.perception.get(self.args.perception_signal),
                                       has_image=record.has_image, gather=self.accelerator.gather,
                                       process_index=self.accelerator.process_index, step=record.step))
        if self.args.perception_signal_compare and forward is not None:
            self._metrics[mode]["tprl/signal_rank_corr"].append(signal_rank_corr(
                forward.perception["perturbation"], forward.perception["attention"], out["completion_mask"],
                record.has_image, self.accelerator.gather))
        record.tokens = float(self.accelerator.gather(out["prompt_mask"].sum() + out["completion_mask"].sum()).sum())
        record.samples = float(len(inputs) * self.accelerator.num_processes)
        # TRL has just appended this batch's rows to its completions table: ours follow, now or once measured.
        table = self.completion_columns.add(int(record.samples)) if self.completion_columns is not None else None
        self._metrics[mode]["perf/generation_seconds"].append(record.timing.generation)
        self._metrics[mode]["perf/scoring_seconds"].append(record.timing.scoring)
        if self.run_plan.batch_placement(mode) is ProbePlacement.TRAINING_FORWARD:
            # Tag TRL's output with row indices (they survive its shuffle) and hold the batch until every slice
            # has been measured in compute_loss.
            out[ROLLOUT_KEY] = torch.arange(len(inputs), device=out["advantages"].device)
            kept = {"advantages": self.accelerator.gather(out["advantages"]), "completion_ids": out["completion_ids"],
                    "completion_mask": out["completion_mask"]}
            self._pending = PendingMeasurement(inputs, record, kept, table)
            return
        if table is not None and record.signals is not None:
            table.columns.update(self._table_columns(record.signals, out))
        if self.live_logs is not None:
            self._write_live_logs(inputs, record, out)

    def _forwards_before_rewards(self, record: BatchRecord, inputs, prompts, completion_ids_list) -> None:
        """Before the rewards: the policy forward the rewards and TPRL read (TRL's, already measured, or one extra
        no-grad forward where the plan says so), the counterfactual forward, the perception signals."""
        plan = self.run_plan
        if plan.batch_placement(self._mode()) is ProbePlacement.EXTRA_FORWARD:
            record.forward = self._extra_forward(record.map_rows, self._policy_batch(record.encoded, prompts, inputs,
                                                                                     completion_ids_list))
        if plan.counterfactual:
            record.counterfactual = self._counterfactual_forward(inputs, prompts, completion_ids_list,
                                                                 record.completion_mask)
        forward = record.forward
        if forward is None:
            if plan.batch_placement(self._mode()) is ProbePlacement.TRL_FORWARD:
                raise RuntimeError("the run plan measures in TRL's old-log-prob forward, but TRL ran none for this "
                                   "batch: TRL's condition for it changed (tests/test_trl_contract.py pins it)")
            return
        if self.args.uses_perturbed_forward:
            forward.perception["perturbation"] = self._perturbation_signal(
                inputs, prompts, completion_ids_list, forward.logps, record.has_image, record.counterfactual)
        if "attention" in forward.perception:  # no image: nothing to depend on, as for the perturbation signal
            forward.perception["attention"] *= record.has_image.to(forward.perception["attention"])[:, None]

    def _batch_signals(self, record: BatchRecord, mode: str) -> S.BatchSignals:
        """The one place a batch's per-rollout values are assembled (``trl_mdi.signals``), from the policy forward's
        record and the counterfactual forward's, whichever stage completes them (before the rewards, or once the last
        training slice has been measured); logged as attention/* and reliance/*. Every process calls it."""
        if record.forward.attention is not None:
            S.check_measured_layers(record.forward.attention, self.run_plan.facts.measured_layers)
        n = len(record.has_image)
        signals = S.batch_signals(record.forward, record.counterfactual, completion_mask=record.completion_mask,
                                  has_image=record.has_image, segments_spec=self.args.attention_layer_segments,
                                  balance_ratio=self.args.mdi_balance_ratio, gather=self._gather_cpu,
                                  local=lambda t: self._local(t, n), group_size=self._group_size(mode))
        self._log(mode, signals.metrics)
        return signals

    @staticmethod
    def _hand_to_rewards(inputs: list[dict], signals: S.BatchSignals) -> None:
        """Hand the per-rollout reward fields to the reward functions: TRL passes every key of its row dicts to
        each reward as a named argument (its only channel to them), so the fields are added to the rows."""
        for row, fields in zip(inputs, signals.reward_rows()):
            row.update(fields)

    def _table_columns(self, signals: S.BatchSignals, out: dict[str, Any]) -> dict[str, list]:
        """This batch's columns of TRL's completions table: every per-rollout value, gathered in TRL's order, and
        with the counterfactual, each completion with its image-evidence tokens marked as the rollout log marks them
        (None without an image). Every process takes part (the texts are gathered)."""
        evidence = None
        if signals.counterfactual is not None:
            rows = image_evidence(signals.counterfactual.token_gain, out["completion_ids"], out["completion_mask"],
                                  self._tokenizer, rows=len(out["completion_ids"]))
            has_image = signals.counterfactual.has_image.tolist()
            evidence = gather_object([marked_completion(e, markdown=False) if seen else None
                                      for e, seen in zip(rows, has_image)])
        return table_columns(signals.gathered, evidence)

    # ------------------------------------------------------------------------------------ the trainer's own forwards
    def _policy_batch(self, encoded: PromptEncoding | None, prompts, inputs, completion_ids_list,
                      with_images: bool = True):
        """Prompt + completion as TRL lays out its log-prob forward, from TRL's own prompt encoding when there is one
        (a ``rollout_func`` bypasses it: the prompts are encoded again, as TRL encodes them). ``with_images=False``:
        the prompts hold no image (the counterfactual without the image)."""
        prompt_ids, fields = (encoded.ids, encoded.multimodal) if encoded is not None else encode_prompts(
            self.processing_class, prompts, chat_template_kwargs=self.chat_template_kwargs,
            chat_template=self.chat_template, facts=self.run_plan.facts)
        images = [row_images(x) for x in inputs] if with_images else []
        batch = policy_batch(prompt_ids, completion_ids_list, pad_token_id=self._tokenizer.pad_token_id,
                             multimodal=fields, num_images=[len(i) for i in images] if any(images) else None,
                             pad_to_multiple_of=self.pad_to_multiple_of, device=self.accelerator.device,
                             facts=self.run_plan.facts)
        return dataclasses.replace(batch, num_tiles=tile_counts(self.processing_class, images, batch.multimodal))

    @contextlib.contextmanager
    def _probe(self, map_rows: list[int], completion_length: int):
        """The attention probe over a forward whose last ``completion_length`` positions are the completion; yields
        None with attention metrics off."""
        if not self.run_plan.attention_metrics:
            yield None
            return
        tokenizer = self._tokenizer if self.args.attention_text_keys == "content" else None
        layout = trailing_completion_layout(completion_length, list(self.run_plan.facts.image_token_ids), tokenizer)
        with probe_attention(self.model, layout, map_rows, self.run_plan.token_layers) as state:
            yield state

    def _policy_logps(self, layout) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One no-grad policy forward through TRL's own log-prob path (same chunking, fused head).

        It runs in the model's current mode, as TRL's own old-log-prob forward does (so with dropout > 0 it draws
        dropout masks), inside a forked RNG: the random stream the training step sees afterwards is the one it would
        have seen without this forward, so observing never changes the run. Every rank runs it (same number of
        chunks): ZeRO-3 needs all ranks in every gather.
        """
        batch_size = (self.args.per_device_train_batch_size if self._mode() == "train"
                      else self.args.per_device_eval_batch_size)
        inputs = layout.logp_inputs()
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs), \
                rng_untouched(self.accelerator.device):
            logps, entropies, _ = super()._get_per_token_logps_and_entropies(
                self.model, inputs.pop("input_ids"), inputs.pop("attention_mask"), inputs.pop("logits_to_keep"),
                batch_size=batch_size, compute_entropy=self.args.enable_entropy_filtering, **inputs)
        return logps, entropies

    def _extra_forward(self, map_rows: list[int], layout) -> S.PolicyForward:
        """The one extra no-grad forward: attention probe (with the attention signal when asked) and, when TPRL needs
        them, log-probs under the real image (the perturbation signal) and entropies (the entropy filter)."""
        completion_length = layout.logits_to_keep
        needs_head = self.args.uses_perturbed_forward or self.args.enable_entropy_filtering or self.run_plan.counterfactual
        if not needs_head:
            # Only attention is wanted: let the LM head score one position per row instead of the whole completion
            # (TRL's fused head skips positions whose label is -100). At Qwen's 152k vocabulary the head is about a
            # tenth of the forward's FLOPs; the probe still measures every completion token.
            layout = dataclasses.replace(layout, logits_to_keep=1)
        with self._probe(map_rows, completion_length) as probe:
            logps, entropies = self._policy_logps(layout)
        attention = probe.result() if probe is not None else None
        return S.PolicyForward.measured(attention, completion_length, *((logps, entropies) if needs_head else ()))

    def _perturbation_signal(self, inputs, prompts, completion_ids_list, logps: torch.Tensor, has_image: torch.Tensor,
                             counterfactual: S.CounterfactualForward | None) -> torch.Tensor:
        """s_t from one no-grad forward with perturbed images (re-encoded: other pixels, same token positions); the
        counterfactual forward's log-probs when it used the same perturbation (``RunPlan.shared_counterfactual``)."""
        if self.run_plan.shared_counterfactual:
            aug_logps = counterfactual.logps
        else:
            aug_prompts = self._counterfactual_prompts(inputs, prompts, self.args.perception_perturbation)
            aug_logps, _ = self._policy_logps(self._policy_batch(None, aug_prompts, inputs, completion_ids_list))
        s_t = perturbation_signal(fit_width(logps, aug_logps.shape[1]), aug_logps)
        # Rows without an image have no visual dependency to measure: 0, and the masks leave them unfiltered.
        return s_t * has_image.to(s_t.device)[:, None]

    def _counterfactual_prompts(self, inputs, prompts, kind: str) -> list:
        """The batch's prompts with each row's images replaced by its counterfactual of ``kind``, drawn per (seed,
        step, rollout) so that resumed runs and every process draw the same."""
        a = self.args
        step = self.state.global_step if self.model.training else 10**9 + self.state.global_step
        return counterfactual_prompts(
            prompts, [row_images(x) for x in inputs], kind, seed=a.perturbation_seed, step=step,
            row_offset=self.accelerator.process_index * len(inputs), patch_size=a.perturbation_patch_size,
            prob=a.perturbation_prob, noise_std=a.perturbation_noise_std, blur_radius=a.perturbation_blur_radius)

    def _counterfactual_forward(self, inputs, prompts, completion_ids_list,
                                completion_mask: torch.Tensor) -> S.CounterfactualForward:
        """The reliance signals' one extra no-grad forward: the same rollouts with the counterfactual image
        (``counterfactual_image``), keeping the completion's log-probs and, at the position that chose each answer
        letter, the logits of the row's choice letters (read off the backbone's hidden state through the LM head's
        rows of those letters: no (B, C, vocabulary) logits)."""
        kind = self.args.counterfactual_image
        cf_prompts = self._counterfactual_prompts(inputs, prompts, kind)
        layout = self._policy_batch(None, cf_prompts, inputs, completion_ids_list, with_images=kind != NO_IMAGE)
        ids = pad_rows(completion_ids_list, self._tokenizer.pad_token_id, "right")[0]
        answers = answer_tokens(self._tokenizer, ids, completion_mask, [x.get("choices") for x in inputs],
                                self.answer_format.answer_pattern)
        with hidden_states_at(unwrap_model(self.model).base_model, answers.letter_position,
                              layout.logits_to_keep) as hidden:
            logps, _ = self._policy_logps(layout)
        letters = choice_logits(self.model, hidden.result(), answers.candidates)
        return S.CounterfactualForward(logps=logps, choice_logits=letters, answers=answers)

    # ------------------------------------------------------------------------------------ small pieces
    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    def _group_size(self, mode: str) -> int:
        return self.num_generations if mode == "train" else self.num_generations_eval

    def _local(self, gathered: torch.Tensor, n_local: int) -> torch.Tensor:
        """This process's slice of a tensor gathered from every process (rows in process order)."""
        start = self.accelerator.process_index * n_local
        return gathered[start : start + n_local]

    def _log(self, mode: str, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)

    def _gather_cpu(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (rows first) concatenated over every process, on the CPU (gathered on the accelerator's device)."""
        return self.accelerator.gather(t.to(self.accelerator.device)).cpu()

    def _write_live_logs(self, inputs: list[dict], record: BatchRecord, out: dict[str, Any]) -> None:
        """Gather this batch's rollouts (all ranks take part) and append them to the live logs (main process)."""
        forward = record.forward
        attention = forward.attention if forward is not None else None
        scores = forward.perception.get(self.args.perception_signal) if forward is not None else None
        strips = None
        if scores is not None and self.accelerator.process_index == 0:  # the first rows are the fully printed ones
            strips = perception_strips(scores, out["completion_ids"], out["completion_mask"], self._tokenizer,
                                       top_p=self.args.top_p_perception_tokens, signal=self.args.perception_signal,
                                       rows=self.args.log_full_rollouts_per_step)
        evidence = None
        counterfactual = record.signals.counterfactual if record.signals is not None else None
        if counterfactual is not None and self.accelerator.process_index == 0:
            evidence = image_evidence(counterfactual.token_gain, out["completion_ids"], out["completion_mask"],
                                      self._tokenizer, rows=self.args.log_full_rollouts_per_step)
        scored = record.scored
        log = BatchLog(step=record.step, epoch=float(self.state.epoch or 0.0), rows=inputs, prompts=scored.prompts,
                         completions=scored.completions, completion_lengths=scored.lengths, rewards=scored.rewards,
                         advantages=self.accelerator.gather(out["advantages"]), reward_names=self.reward_func_names,
                         reward_weights=self.reward_weights,
                         signals=record.signals.local if record.signals is not None else None,
                         metrics=record.signals.metrics if record.signals is not None else None, attention=attention,
                         map_rows=record.map_rows, strips=strips, evidence=evidence, skipped=scored.bad)
        write_batch(self.live_logs, log, processing_class=self.processing_class, answer_format=self.answer_format)
