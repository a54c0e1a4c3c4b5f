"""MDIGRPOConfig: GRPOConfig plus the fields of the attention probe and the reward stack."""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from dataclasses import dataclass, field

from transformers.utils import logging
from trl import GRPOConfig

from .answer_format import DEFAULT_ANSWER_PATTERN, compile_answer_pattern
from .rewards.registry import DEFAULT_REWARDS

logger = logging.get_logger(__name__)


def _reward_names_help() -> str:
    # Generated from the registry so the CLI help never drifts from what exists.
    from .rewards import DEFAULT_REWARD_WEIGHTS, reward_help

    return (
        "The run's rewards unless the trainer is given its own (registry names or import paths "
        "'package.module:function'; None: none, as with GRPOConfig); the default stack is weighted "
        f"{' '.join(f'{w:g}' for w in DEFAULT_REWARD_WEIGHTS)} when reward_weights is unset. Available:\n"
        + reward_help()
    )


def _grpo_help(name: str, ours: str) -> str:
    """The help of a GRPOConfig field whose default trl_mdi sets: why, then TRL's own text (never copied)."""
    return f"{ours} {GRPOConfig.__dataclass_fields__[name].metadata.get('help', '')}".strip()


@dataclass
class MDIGRPOConfig(GRPOConfig):
    r"""
    Configuration of [`MDIGRPOTrainer`]: every [`trl.GRPOConfig`] field, plus the ones below.

    Parameters:
        > Attention probe (MDI / AEI)

        compute_attention_metrics (`bool` or `None`, *optional*, defaults to `None`):
            Measure, after each generation, the attention of the generated tokens on image vs text keys for every
            rollout (exact, O(L) memory; inside TRL's old-log-prob or training forward when nothing reads it before
            the loss, else one no-grad forward per generation batch: docs/differences.md). Feeds the `mdi*` reward
            fields and the `attention/*` metrics.
            `None` (default): on for a vision-language model, off (with one warning) for a text-only one. `True` on
            a model without an image token is an error at construction.
        mdi_balance_ratio (`float`, *optional*, defaults to `2.0`):
            R in `balance = clip(1 - |log MDI| / log R, 0, 1)`. Must be > 1. Balance is non-zero only for MDI in
            (1/R, R).
        attention_layer_segments (`str`, *optional*, defaults to `"thirds"`):
            How text layers are grouped for per-segment MDI / AEI: `"thirds"` (early / middle / late thirds of the
            measured layers; on a 1- or 2-layer model only the thirds that exist) or explicit inclusive ranges in the
            model's layer numbering such as `"early:0-3,middle:4-7,late:8-11"` (negative indices count from the
            end). Only softmax-attention layers are measured: a hybrid model's linear-attention layers inside a
            range are skipped (and counted in the log header). Names `all`, `balance` and `group_score` are
            reserved.
        attention_text_keys (`str`, *optional*, defaults to `"all"`):
            Which prompt keys count as text: `"all"` (every non-image prompt token, chat-template special tokens and
            system prompt included) or `"content"` (special tokens and the system turn are reported separately).

        > TPRL: token gradient filtering (TGF) and trajectory advantage shaping (TAS), after VPPO

        enable_entropy_filtering (`bool`, *optional*, defaults to `False`):
            Per sequence, keep only the `ceil(top_p_entropy_tokens * L_i)` highest-entropy completion tokens in the
            policy-gradient loss (entropies of the generation-time policy). TRL's own `top_entropy_quantile`
            (a per-batch quantile) keeps working beside it.
        top_p_entropy_tokens (`float`, *optional*, defaults to `0.2`):
            Fraction in (0, 1] of each completion's tokens kept by the entropy filter.
        enable_perception_filtering (`bool`, *optional*, defaults to `False`):
            Per sequence, keep only the `ceil(top_p_perception_tokens * L_i)` tokens whose log-probability depends
            most on the image: `s_t = clamp(exp(d) - d - 1, 0, 10)`, `d = clamp(logp(I') - logp(I), -20, 20)`,
            with I' the perturbed image. Costs one extra no-grad forward per generation batch. With both filters
            on, a token is kept if either keeps it.
        top_p_perception_tokens (`float`, *optional*, defaults to `0.2`):
            Fraction in (0, 1] of each completion's tokens kept by the perception filter.
        enable_trajectory_reweighting (`bool`, *optional*, defaults to `False`):
            Scale each rollout's advantage by `alpha_i` from its mean perception signal, min-max normalised over
            the whole generation batch gathered from all processes (VPPO normalises per device); mean(alpha) = 1.
        trajectory_scaling_min (`float`, *optional*, defaults to `0.8`):
            beta_min in [0, 1]: the multiplier of the least visually dependent rollout.
        perception_signal (`str`, *optional*, defaults to `"perturbation"`):
            The per-token perception signal both use. `"perturbation"` (VPPO): `s_t` above, one extra no-grad
            forward with I'. `"attention"`: `a_t`, the image attention mass of the position that chose token t
            (mean over heads and the `perception_attention_segment` layers), from the probe's forward: no extra
            forward (none at all when TRL runs its old-log-prob forward).
        perception_attention_segment (`str`, *optional*, defaults to `"late"`):
            Layer segment `a_t` averages over; a segment the model lacks falls back to `all`, with a log line.
        perception_signal_compare (`bool`, *optional*, defaults to `False`):
            Compute both signals (costs the perturbed forward) and log `tprl/signal_rank_corr`, their per-sequence
            Spearman correlation over the completion tokens of rows with an image, averaged over rows.
        perception_perturbation (`str`, *optional*, defaults to `"patch_blackening"`):
            How I' is made from I, on the PIL image before the processor: `patch_blackening`, `gaussian_noise`,
            `blur`, `black`, `grey` or `grayscale` (the colour removed, shapes kept).
        perturbation_patch_size (`int`, *optional*, defaults to `14`), perturbation_prob (`float`, defaults to
        `0.5`), perturbation_noise_std (`float`, defaults to `189.0`), perturbation_blur_radius (`float`, defaults
        to `6.0`), perturbation_seed (`int`, *optional*, defaults to `seed`):
            Parameters of the perturbation; masks are drawn per (seed, step, rollout), so resumed runs continue
            deterministically.
        tprl_placebo (`bool`, *optional*, defaults to `False`):
            An experiment control, not a training method: TPRL's placebo. The entropy filter and every forward stay
            as configured, but the perception filter keeps as many tokens per completion chosen at random, and the
            trajectory multipliers are permuted at random over the batch's rollouts (drawn per seed and step). A
            TPRL effect comes from visual dependency only if TPRL beats its placebo (docs/tprl.md). Needs the
            perception filter or trajectory reweighting on.

        > Reliance: did the answer come from the image? (docs/reliance.md)

        reliance_signals (`bool`, *optional*, defaults to `False`):
            Compute, per rollout, the counterfactual signals of the signal table (`trl_mdi.signals`, source
            "counterfactual"; each one's line in the metric glossary of docs/logs.md) and log them (`reliance/*`,
            the rollout log): e.g. `visual_gain` (mean over the completion of `log p(y_t | I) - log p(y_t | I')`),
            `answer_visual_gain` (the same summed over the answer letter's tokens), `blind_agrees` (the
            counterfactual's most likely choice letter, at the position that chose the answer, is the rollout's);
            those that read the probe need attention metrics on. Costs one no-grad forward with the counterfactual
            image per generation batch. On by itself when a reward reads one of these fields.
        counterfactual_image (`str`, *optional*, defaults to `"black"`):
            I' of the reliance signals: `"none"` (the image removed: a text-only prompt) or a same-size image that
            keeps every token position: `black`, `grey` (uniform mid-grey), `grayscale` (the colour removed),
            `blur`, `gaussian_noise`, `patch_blackening` (their parameters are the `perturbation_*` fields). The default is the measured best
            (benchmarks/RESULTS.md, language prior: `black` and `none` separate prior-following rollouts best; `grey`,
            `blur` and noise keep or mimic a colour). When TPRL's perturbation signal
            uses the same kind (`perception_perturbation`), one forward serves both.

        > Faults (resume, preemption)

        allow_partial_resume (`bool`, *optional*, defaults to `False`):
            Resume from a checkpoint that lacks only `trainer_state.json`, `optimizer.pt` or `scheduler.pt` (that
            state restarts fresh, with a warning); otherwise such a checkpoint is refused before the weights load.
        save_on_sigterm (`bool`, *optional*, defaults to `False`):
            On SIGTERM, the processes agree at the end of the step in progress to save a whole checkpoint together,
            then stop (exit status 143, `trl_mdi.preemption.Preempted`). The scheduler must wait at least one step
            and one save between SIGTERM and SIGKILL (SLURM: `--signal=TERM@<seconds>`; `accelerate launch` with
            several processes: `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, 30 s by default). Off: SIGTERM stops the run at
            once, the logs' last lines saying so.

        > vLLM server mode (TRL's `vllm_mode="server"`)

        vllm_server_request_timeout (`float`, *optional*, defaults to `600.0`):
            Seconds each request to the vLLM server (image features, a generation, a weight sync) may wait for its
            answer; then the run stops with an error naming the server and the request, instead of waiting forever
            (TRL's client sets no timeout). A timed-out request is not retried: the server may still be working on
            it. `None`: no limit. Before the weights load, the main process waits up to TRL's `vllm_server_timeout`
            for the server to answer, and stops with the command that starts one if none does.

        > Online group filtering (online_filtering / filter_key / filter_low / filter_high)

        online_filtering (`bool`, *optional*, defaults to `False`):
            Drop from the update every group whose mean of `filter_key` lies outside `[filter_low, filter_high]`
            (all-right or all-wrong groups carry no signal): their advantages are zeroed, their tokens leave the
            loss mask, and the DAPO normaliser counts only the kept groups' tokens, as if the dropped groups had
            not been sampled. The batch shape stays the same (every process keeps its rows, ZeRO-3 stays in step).
        filter_key (`str`, *optional*, defaults to `"mc_idx"`):
            The reward whose group mean is tested: a reward's name (`mc_idx`, as in `rewards/mc_idx/mean`) or
            `reward` for the weighted total.
        filter_low (`float`, *optional*, defaults to `0.01`), filter_high (`float`, *optional*, defaults to `0.99`):
            Groups with a mean inside this closed range are kept.

        > Live diagnostics (Markdown logs for `tail -f training_logs/*.md`, console, attention maps)

        realtime_rollout_logging (`bool`, *optional*, defaults to `True`):
            Append every generation batch (gathered from all processes) to the rollout log and, with attention
            metrics on, to the attention log; written by the main process, flushed at once.
        rollout_log_path (`str`, *optional*):
            Defaults to `training_logs/rollout_results_<run>.md`, `<run>` = run_name or a timestamp.
        attention_diag_log_path (`str`, *optional*):
            Defaults to `training_logs/attention_diagnostics_<run>.md`.
        colorize_output (`bool`, *optional*, defaults to `True`):
            Colour the console summary (off anyway for NO_COLOR or non-TTY output).
        log_prompt_preview_chars (`int`, *optional*, defaults to `120`), log_completion_preview_chars (`int`,
        defaults to `2000`):
            How much of a prompt (table rows) and of a completion (full rollouts) is written.
        log_full_rollouts_per_step (`int`, *optional*, defaults to `2`):
            Rollouts per step written in full; the others get one table row each.
        attention_map_every_n_steps (`int`, *optional*, defaults to `10`), attention_maps_per_step (`int`,
        defaults to `2`):
            Draw attention-map PNGs (image with the completion's attention per image token, per segment) at step 1
            and every N steps for that many rollouts, linked from the attention log. 0 turns maps off.

        > Reward stack

        answer_pattern (`str`, *optional*, defaults to `r"Answer: (?P<letter>[A-Z])"`):
            The final line `think_format` pays for (a regex fully matching that line, with a group `letter`); the
            default matches the `Answer: X` that the default system prompt asks for (`trl_mdi.answer_format`).
            Change both together: a custom system prompt with the default pattern gets a warning.
        reward_funcs (`list[str]` or `None`, *optional*, defaults to `["mc_idx", "think_format", "mdi_balance"]`):
            The run's rewards when the trainer is built without its `reward_funcs` argument (that argument, when
            given, wins): registry names (`trl_mdi.rewards`) or import paths `pkg.module:function`. The default is
            the 4:1:1 stack: with `reward_weights` unset, the default stack's names are weighted 4 1 1 (any other
            list gets TRL's 1 each). `None`: no rewards from the config, as with a plain `GRPOConfig` (which has no
            such field): GRPOTrainer's own behaviour (an `environment_factory`'s `get_reward`, else TRL's "No reward
            source" error). `reward_weights` pairs with the rewards the run uses, so its count is checked when the
            trainer is built (and by the entry point before any weight loads).

        > GRPO settings whose default differs from `GRPOConfig`'s (DAPO's recommendations; a value you give wins)

        loss_type (`str`, *optional*, defaults to `"dapo"`):
            As in `GRPOConfig` (its default too in TRL 1.16): pinned here so that a TRL release cannot change it.
        epsilon_high (`float` or `None`, *optional*, defaults to `0.28`):
            DAPO's clip-higher upper bound (`GRPOConfig`: `None`, the same as `epsilon`). With
            `loss_type="cispo"` it is the clip of the importance weights, for which ScaleRL recommends `5.0`.
        mask_truncated_completions (`bool`, *optional*, defaults to `True`):
            A completion cut off at `max_completion_length` has no final answer: keep it out of the loss
            (`GRPOConfig`: `False`).
    """

    # GRPO settings with trl_mdi's defaults: DAPO's token-level loss, clip-higher and overlong filtering (Yu et al.,
    # "DAPO", arXiv 2503.14476). Redeclared fields keep GRPOConfig's place and help text; MDIGRPOConfig() in Python
    # and the entry point get the same run.
    loss_type: str = field(
        default="dapo",
        metadata={"help": _grpo_help("loss_type", "Pinned by trl_mdi, so that a TRL release cannot change it.")},
    )
    epsilon_high: float | None = field(
        default=0.28,
        metadata={"help": _grpo_help("epsilon_high", "DAPO's clip-higher upper bound (with loss_type cispo it clips the "
                                     "importance weights instead: ScaleRL recommends 5.0).")},
    )
    mask_truncated_completions: bool = field(
        default=True,
        metadata={"help": _grpo_help("mask_truncated_completions", "A completion cut off at max_completion_length has no "
                                     "final answer: keep it out of the loss.")},
    )

    compute_attention_metrics: bool | None = field(
        default=None,
        metadata={
            "help": "Measure per-rollout attention of generated tokens on image vs text (MDI, AEI) after each "
            "generation: exact, O(L) memory, at most one extra no-grad forward per generation batch (none when no "
            "reward or TPRL reads it before the loss: measured in the training forward). Default "
            "(unset): on for vision-language models, off for text-only ones."
        },
    )
    mdi_balance_ratio: float = field(
        default=2.0,
        metadata={"help": "R in balance = clip(1 - |log MDI| / log R, 0, 1); must be > 1."},
    )
    attention_layer_segments: str = field(
        default="thirds",
        metadata={
            "help": "Layer segments for per-segment MDI/AEI: 'thirds' (early/middle/late of the measured layers) "
            "or inclusive ranges like 'early:0-3,middle:4-7,late:8-11' (negative indices count from the end)."
        },
    )
    attention_text_keys: str = field(
        default="all",
        metadata={
            "help": "Which prompt keys count as text: 'all' (special tokens and system prompt included) or "
            "'content' (those reported separately as 'special').",
            "choices": ["all", "content"],  # TEXT_KEY_CHOICES
        },
    )
    enable_entropy_filtering: bool = field(
        default=False, metadata={"help": "TGF: keep only each completion's top-p highest-entropy tokens in the loss."}
    )
    top_p_entropy_tokens: float = field(
        default=0.2, metadata={"help": "Fraction in (0, 1] of each completion's tokens kept by the entropy filter."}
    )
    enable_perception_filtering: bool = field(
        default=False,
        metadata={"help": "TGF: keep only each completion's top-p most image-dependent tokens in the loss "
                  "(one extra no-grad forward with a perturbed image per generation batch)."},
    )
    top_p_perception_tokens: float = field(
        default=0.2, metadata={"help": "Fraction in (0, 1] of each completion's tokens kept by the perception filter."}
    )
    enable_trajectory_reweighting: bool = field(
        default=False,
        metadata={"help": "TAS: scale each rollout's advantage by its batch-normalised mean perception signal "
                  "(mean multiplier 1)."},
    )
    trajectory_scaling_min: float = field(
        default=0.8, metadata={"help": "TAS beta_min in [0, 1]: multiplier of the least image-dependent rollout."}
    )
    perception_signal: str = field(
        default="perturbation",
        metadata={"help": "Per-token perception signal for TPRL: 'perturbation' (VPPO, one extra forward with a "
                  "perturbed image) or 'attention' (image attention mass from the probe, no extra forward)."},
    )
    perception_attention_segment: str = field(
        default="late", metadata={"help": "Layer segment the 'attention' perception signal averages over."}
    )
    perception_signal_compare: bool = field(
        default=False,
        metadata={"help": "Compute both perception signals and log tprl/signal_rank_corr (their Spearman correlation)."},
    )
    perception_perturbation: str = field(
        default="patch_blackening",
        metadata={"help": "How the perturbed image is made: patch_blackening, gaussian_noise, blur, black, grey or "
                  "grayscale."},
    )
    perturbation_patch_size: int = field(default=14, metadata={"help": "patch_blackening: patch side in pixels."})
    perturbation_prob: float = field(default=0.5, metadata={"help": "patch_blackening: probability a patch is blacked."})
    perturbation_noise_std: float = field(default=189.0, metadata={"help": "gaussian_noise: std in 0-255 pixel units."})
    perturbation_blur_radius: float = field(default=6.0, metadata={"help": "blur: Gaussian blur radius in pixels."})
    perturbation_seed: int | None = field(
        default=None, metadata={"help": "Seed of the perturbation masks (default: the run's seed)."}
    )
    tprl_placebo: bool = field(
        default=False,
        metadata={"help": "Experiment control: TPRL's placebo (perception filter keeps as many random tokens, "
                  "trajectory multipliers permuted over the batch; entropy filter and forwards unchanged)."},
    )
    reliance_signals: bool = field(
        default=False,
        metadata={"help": "Compute and log the per-rollout counterfactual signals of the signal table (visual_gain, "
                  "answer_visual_gain, blind_agrees, ...: the glossary in docs/logs.md): one extra no-grad forward "
                  "with the counterfactual image per generation batch. On by itself when a reward reads one of them."},
    )
    counterfactual_image: str = field(
        default="black",
        metadata={"help": "The counterfactual image of the reliance signals: black (the measured best), none (image "
                  "removed), grey, grayscale, blur, gaussian_noise or patch_blackening (same size: token positions "
                  "kept)."},
    )
    on_bad_image: str = field(
        default="skip",
        metadata={"help": "An image that cannot be decoded mid-run: 'skip' (its rollouts leave the update, counted in "
                  "data/bad_images) or 'error' (every process stops with an error naming the rows)."},
    )
    vllm_server_request_timeout: float | None = field(
        default=600.0,
        metadata={"help": "vllm_mode='server': seconds each request to the vLLM server may wait for its answer before "
                  "the run stops with an error naming the server (None: wait forever, as TRL does). The wait for "
                  "the server to come up at start is TRL's vllm_server_timeout."},
    )
    allow_partial_resume: bool = field(
        default=False,
        metadata={"help": "Resume from a checkpoint that lacks trainer_state.json, optimizer.pt or scheduler.pt (each "
                  "then restarts fresh, with a warning). Off: such a checkpoint is refused before the weights load, "
                  "naming what is missing. Weights and cut files are never accepted."},
    )
    save_on_sigterm: bool = field(
        default=False,
        metadata={"help": "On SIGTERM (SLURM's --signal or time limit, a Kubernetes eviction), finish the optimizer "
                  "step in progress, save a whole checkpoint on every process, then stop (exit status 143); the time "
                  "limit must leave room for one step and one save (docs/training.md, Preemption). Off: SIGTERM "
                  "stops the run at once, with the logs' Run stopped line and no checkpoint."},
    )
    online_filtering: bool = field(
        default=False, metadata={"help": "Drop groups whose mean filter_key reward is outside [filter_low, filter_high]."}
    )
    filter_key: str = field(
        default="mc_idx", metadata={"help": "Reward tested by online_filtering: a reward name, or 'reward' (weighted total)."}
    )
    filter_low: float = field(default=0.01, metadata={"help": "online_filtering keeps groups with mean >= filter_low."})
    filter_high: float = field(default=0.99, metadata={"help": "online_filtering keeps groups with mean <= filter_high."})
    realtime_rollout_logging: bool = field(
        default=True,
        metadata={"help": "Append every generation batch to training_logs/*.md (rollouts and attention), live."},
    )
    rollout_log_path: str | None = field(
        default=None, metadata={"help": "Rollout log (default training_logs/rollout_results_<run>.md)."}
    )
    attention_diag_log_path: str | None = field(
        default=None, metadata={"help": "Attention log (default training_logs/attention_diagnostics_<run>.md)."}
    )
    colorize_output: bool = field(default=True, metadata={"help": "Colour the console summary (off for NO_COLOR / pipes)."})
    log_prompt_preview_chars: int = field(default=120, metadata={"help": "Prompt/completion characters per table row."})
    log_completion_preview_chars: int = field(
        default=2000, metadata={"help": "Completion characters written for a full rollout (then '... (N more chars)')."}
    )
    log_full_rollouts_per_step: int = field(default=2, metadata={"help": "Rollouts per step written in full."})
    attention_map_every_n_steps: int = field(
        default=10, metadata={"help": "Draw attention maps at step 1 and every N steps (0: never)."}
    )
    attention_maps_per_step: int = field(default=2, metadata={"help": "Rollouts per map step that get a map."})
    answer_pattern: str = field(
        default=DEFAULT_ANSWER_PATTERN,
        metadata={"help": "Regex the final answer line must fully match for think_format (group 'letter' is the "
                  "answer); the default matches the 'Answer: X' the default system prompt asks for."},
    )
    reward_funcs: list[str] | None = field(
        default_factory=lambda: list(DEFAULT_REWARDS),
        metadata={"help": _reward_names_help()},  # generated from the registry: cannot drift from it
    )

    @property
    def uses_perception_signal(self) -> bool:
        """Whether a per-token perception signal is used: the perception filter or trajectory reweighting reads it."""
        return self.enable_perception_filtering or self.enable_trajectory_reweighting

    @property
    def uses_perturbed_forward(self) -> bool:
        """Whether the perturbation signal is computed (one perturbed-image forward): used, or compared."""
        return (self.uses_perception_signal and self.perception_signal == "perturbation") or self.perception_signal_compare

    @property
    def uses_attention_signal(self) -> bool:
        """Whether the attention signal is computed (the probe records per-token image mass): used, or compared."""
        return (self.uses_perception_signal and self.perception_signal == "attention") or self.perception_signal_compare

    @property
    def shares_counterfactual_forward(self) -> bool:
        """Whether TPRL's perturbed image is the reliance signals' counterfactual (same kind, same seeds), so one
        forward serves both."""
        return self.uses_perturbed_forward and self.perception_perturbation == self.counterfactual_image

    @property
    def uses_tprl(self) -> bool:
        return self.enable_entropy_filtering or self.uses_perception_signal

    def __post_init__(self):
        # Types and ranges first: TRL's own __post_init__ does arithmetic on some of these (a YAML string or list
        # would fail there with a TypeError that names no field), and the trainer reads the rest only after the
        # weights load.
        check_field_values(self)
        super().__post_init__()
        validate_added_fields(self)

    @classmethod
    def from_grpo_config(cls, args: GRPOConfig) -> MDIGRPOConfig:
        """An MDIGRPOConfig with every field of ``args`` (a plain ``trl.GRPOConfig``) and the added fields at their
        defaults, built through the constructor so the added fields are validated like any other. ``reward_funcs``,
        which a GRPOConfig lacks, is None (no rewards from the config): the run takes its rewards as GRPOTrainer does.
        Every GRPOConfig field keeps the value ``args`` holds, those whose default trl_mdi sets included.

        ``generation_batch_size`` is left for ``GRPOConfig.__post_init__`` to derive again from
        ``steps_per_generation`` (it refuses both set); it derives the value ``args`` holds.
        """
        if isinstance(args, cls):
            return args
        if not isinstance(args, GRPOConfig):
            raise TypeError(
                f"args must be a trl.GRPOConfig or an MDIGRPOConfig, got {type(args).__name__}. Build one with "
                "MDIGRPOConfig(output_dir=..., ...) (every GRPOConfig field is accepted)."
            )
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
        values["generation_batch_size"] = None
        new = cls(**values, reward_funcs=None)
        logger.info("MDIGRPOTrainer: upgraded the %s to an MDIGRPOConfig (added fields at their defaults)",
                    type(args).__name__)
        return new


def redeclared_grpo_fields() -> list[dataclasses.Field]:
    """The ``GRPOConfig`` fields ``MDIGRPOConfig`` declares again with its own default (the recommended GRPO
    settings), in declaration order.

    >>> [(f.name, f.default) for f in redeclared_grpo_fields()]
    [('epsilon_high', 0.28), ('loss_type', 'dapo'), ('mask_truncated_completions', True)]
    """
    own = MDIGRPOConfig.__dict__.get("__annotations__", {})
    base = {f.name for f in dataclasses.fields(GRPOConfig)}
    return [f for f in dataclasses.fields(MDIGRPOConfig) if f.name in own and f.name in base]


TEXT_KEY_CHOICES = ("all", "content")


@dataclass(frozen=True)
class NumberRule:
    """The type and range one numeric config field must have, and a valid example for the error message."""

    name: str
    kind: type  # int or float (an int is accepted for a float field; a bool never)
    low: float | None = None  # None: unbounded
    high: float | None = None
    low_open: bool = False  # True: the bound itself is refused
    high_open: bool = False
    optional: bool = False  # None is allowed (the library then picks the value)
    example: str = "1"
    why: str = ""  # what the range means for GRPO, when the bare range would not say

    def requirement(self) -> str:
        """The rule in words: 'a whole number >= 1', 'a finite number in (0, 1]'."""
        what = "a whole number" if self.kind is int else "a finite number"
        if self.low is not None and self.high is not None:
            bounds = f" in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        elif self.low is not None:
            bounds = f" {'>' if self.low_open else '>='} {self.low:g}"
        elif self.high is not None:
            bounds = f" {'<' if self.high_open else '<='} {self.high:g}"
        else:
            bounds = ""
        return what + bounds + (" or None" if self.optional else "")

    def accepts(self, value: float) -> bool:
        """Whether the (already typed, finite) ``value`` lies in the range."""
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True


FIELD_RULES: tuple[NumberRule, ...] = (
    NumberRule("learning_rate", float, 0, low_open=True, example="1e-6"),
    NumberRule("beta", float, 0, example="0.0", why="the KL coefficient (0: no reference model)"),
    NumberRule("temperature", float, 0, low_open=True, example="1.0",
               why="GRPO samples several rollouts per prompt and compares them, so sampling must be on: greedy "
               "decoding (do_sample=False, temperature 0) would give every rollout of a group the same completion"),
    NumberRule("top_p", float, 0, 1, low_open=True, example="1.0"),
    NumberRule("top_k", int, 0, optional=True, example="0", why="0: no top-k cut"),
    NumberRule("min_p", float, 0, 1, optional=True, example="0.05"),
    NumberRule("repetition_penalty", float, 0, low_open=True, example="1.0"),
    NumberRule("max_completion_length", int, 1, optional=True, example="256",
               why="the new tokens each rollout may generate"),
    NumberRule("num_generations", int, 2, optional=True, example="8",
               why="GRPO's advantage compares the rollouts of a prompt with each other"),
    NumberRule("num_generations_eval", int, 1, optional=True, example="4"),
    NumberRule("num_iterations", int, 1, example="1"),
    NumberRule("epsilon", float, 0, low_open=True, example="0.2"),
    NumberRule("epsilon_high", float, 0, low_open=True, optional=True, example="0.28"),
    NumberRule("delta", float, 1, low_open=True, optional=True, example="4.0"),
    NumberRule("per_device_train_batch_size", int, 1, example="8"),
    NumberRule("per_device_eval_batch_size", int, 1, example="8"),
    NumberRule("gradient_accumulation_steps", int, 1, example="1"),
    NumberRule("num_train_epochs", float, 0, low_open=True, example="1"),
    NumberRule("max_steps", int, -1, example="200", why="-1: run num_train_epochs instead"),
    NumberRule("weight_decay", float, 0, example="0.0"),
    NumberRule("max_grad_norm", float, 0, example="1.0"),
    NumberRule("warmup_ratio", float, 0, 1, optional=True, example="0.1"),
    NumberRule("mdi_balance_ratio", float, 1, low_open=True, example="2.0", why="balance uses log R"),
    NumberRule("vllm_server_request_timeout", float, 0, low_open=True, optional=True, example="600",
               why="seconds a request to the vLLM server may wait (None: no limit)"),
    NumberRule("filter_low", float, example="0.01"),
    NumberRule("filter_high", float, example="0.99"),
)
"""Numeric fields the entry point takes and what each must hold, checked by ``check_field_values`` at construction.
Fields with a richer check of their own (the TPRL fractions, the perturbation parameters) keep it in
``validate_added_fields``."""


def _value_error(name: str, value, requirement: str, example: str) -> ValueError:
    # One line: the field, the value, what it must be and a value that works, in both spellings the entry point takes.
    return ValueError(f"{name}: got {value!r}; it must be {requirement}. Valid example: --{name} {example} "
                      f"(or '{name}: {example}' in a --config YAML)")


def _typed_number(rule: NumberRule, value):
    """``value`` as ``rule.kind``, or ValueError. Numeric strings are read as argparse would read the flag (a YAML
    '1e-6' without a dot is a string to PyYAML); lists, bools and non-numeric strings are refused."""
    if isinstance(value, str):
        try:
            value = float(value) if rule.kind is float or not value.strip().lstrip("+-").isdigit() else int(value)
        except ValueError:
            raise _value_error(rule.name, value, rule.requirement(), rule.example) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _value_error(rule.name, value, rule.requirement(), rule.example)
    if not math.isfinite(value):
        raise _value_error(rule.name, value, rule.requirement(), rule.example)
    if rule.kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise _value_error(rule.name, value, rule.requirement(), rule.example)
        return int(value)
    return float(value)


def check_number(rule: NumberRule, value):
    """``value`` checked against ``rule`` and converted to its type; ValueError naming the field, the value, the rule
    and a valid example otherwise.

    >>> check_number(NumberRule("top_p", float, 0, 1, low_open=True, example="1.0"), 1)
    1.0
    >>> check_number(NumberRule("num_generations", int, 2, example="8"), 1)
    Traceback (most recent call last):
    ...
    ValueError: num_generations: got 1; it must be a whole number >= 2. Valid example: --num_generations 8 (or 'num_generations: 8' in a --config YAML)
    """
    if value is None and rule.optional:
        return None
    typed = _typed_number(rule, value)
    if not rule.accepts(typed):
        requirement = rule.requirement() + (f" ({rule.why})" if rule.why else "")
        raise _value_error(rule.name, value, requirement, rule.example)
    return typed


def check_reward_weights(weights):
    """``reward_weights`` as a list of finite floats (None stays None: one each); ValueError naming the problem.

    A single number (YAML ``reward_weights: 4``) is refused rather than read as one weight: a stack of one reward is
    rare, and a lone number is more often a list whose brackets were forgotten. A non-finite weight would make every
    rollout's weighted total NaN or infinite (TRL prints it as ``xnan`` and trains on NaN advantages).

    >>> check_reward_weights([4, 1, 1])
    [4.0, 1.0, 1.0]
    >>> check_reward_weights([4, float("nan"), 1])
    Traceback (most recent call last):
    ...
    ValueError: reward_weights: got [4, nan, 1]; weight 2 (nan) is not a finite number. Valid example: --reward_weights 4 1 1 (or 'reward_weights: [4, 1, 1]' in a --config YAML)
    """
    example = "Valid example: --reward_weights 4 1 1 (or 'reward_weights: [4, 1, 1]' in a --config YAML)"
    if weights is None:
        return None
    if isinstance(weights, (str, bytes)) or not isinstance(weights, (list, tuple)):
        raise ValueError(f"reward_weights: got {weights!r}; it must be a list of numbers, one per reward function "
                         f"(in YAML, a list in brackets). {example}")
    out = []
    for i, w in enumerate(weights, 1):
        try:
            number = float(w) if isinstance(w, str) else w
        except ValueError:
            number = None
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ValueError(f"reward_weights: got {list(weights)!r}; weight {i} ({w!r}) is not a number. {example}")
        if not math.isfinite(number):
            raise ValueError(f"reward_weights: got {list(weights)!r}; weight {i} ({w!r}) is not a finite number. "
                             f"{example}")
        out.append(float(number))
    return out


def output_dir_problem(path) -> str | None:
    """Why ``output_dir`` cannot hold the run's checkpoints (None: it can), checked without writing anything.

    It must be a directory, or a path that can be created as one: no file in the way (the path itself or a parent)
    and a writable nearest existing parent. ``os.access`` also answers for root on a read-only filesystem or an
    immutable directory, where permission bits do not stop root.
    """
    if path is None:
        return None
    path = os.path.abspath(os.path.expanduser(str(path)))
    if os.path.exists(path) and not os.path.isdir(path):
        return f"output_dir {path!r} is a file, not a directory. Valid example: --output_dir runs/grpo (a folder)"
    existing = path
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        return (f"output_dir {path!r} cannot be created: {existing!r} is a file, not a directory. Valid example: "
                "--output_dir runs/grpo (a folder)")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "it" if existing == path else f"its nearest existing parent {existing!r}"
        return (f"output_dir {path!r} is not writable ({where} is read-only for this user). Valid example: "
                "--output_dir runs/grpo (a folder you can write)")
    return None


_MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_config.json")


def output_dir_model_problem(output_dir, model) -> str | None:
    """Why the run's saves into ``output_dir`` would destroy a model (None: they would not), checked before anything
    loads. ``model``: the path or Hub id the run loads, or a loaded model (its config's ``_name_or_path``).

    The final ``save_model`` writes ``config.json`` and the weights into ``output_dir`` itself, so ``output_dir`` may
    not be the model's folder or lie inside it, nor hold a model no trainer saved there (weights or a config without
    the ``training_args.bin`` a trainer's save writes beside them: a downloaded or hand-made model). A trainer's
    earlier output there is the run's own to replace, as in transformers.
    """
    if output_dir is None:
        return None
    out = os.path.realpath(os.path.expanduser(str(output_dir)))
    source = model if isinstance(model, (str, os.PathLike)) else getattr(getattr(model, "config", None),
                                                                         "_name_or_path", None)
    if source and os.path.isdir(os.path.expanduser(str(source))):
        folder = os.path.realpath(os.path.expanduser(str(source)))
        if out == folder or out.startswith(folder.rstrip(os.sep) + os.sep):
            where = "is the model's own folder" if out == folder else f"lies inside the model's folder {folder!r}"
            return (f"output_dir {str(output_dir)!r} {where}: the run's saves would overwrite or mix with the model it "
                    "trains from (model.safetensors, config.json). Valid example: --output_dir runs/grpo (a folder "
                    "outside the model's)")
    if os.path.isdir(out) and not os.path.exists(os.path.join(out, "training_args.bin")):
        found = [f for f in _MODEL_FILES if os.path.isfile(os.path.join(out, f))]
        if found:
            return (f"output_dir {str(output_dir)!r} holds a model no training run saved there ({', '.join(found)}, "
                    "and no training_args.bin): the run's final save would overwrite it. Valid example: --output_dir "
                    "runs/grpo (an empty or new folder); move that model elsewhere to train from it")
    return None


def check_field_values(args) -> None:
    """Check the types and ranges of the numeric fields (``FIELD_RULES``), ``reward_weights`` and ``output_dir``,
    converting the values in place (a YAML int for a float field, a numeric string); ValueError otherwise, one line
    naming the field, the value and a valid example. Runs before ``GRPOConfig.__post_init__``, so CLI flags and YAML
    keys (which TrlParser sets without argparse's type conversion) are checked alike, before any weight loads."""
    for rule in FIELD_RULES:
        if hasattr(args, rule.name):
            setattr(args, rule.name, check_number(rule, getattr(args, rule.name)))
    args.reward_weights = check_reward_weights(args.reward_weights)
    problem = output_dir_problem(getattr(args, "output_dir", None))
    if problem:
        raise ValueError(problem)


def validate_added_fields(args: MDIGRPOConfig) -> None:
    """Check every added field of ``args`` and fill the defaults that depend on others (``perturbation_seed`` from
    ``seed``, a space-separated ``reward_funcs`` string split), so a bad flag fails before any model loads."""
    from .signals import check_segment_spec
    from .tprl.formulas import PERCEPTION_SIGNALS, validate_scaling_min, validate_top_p
    from .tprl.perturb import check_perturbation

    # mdi_balance_ratio, filter_low / filter_high and the other numbers: typed and ranged by check_field_values.
    if args.compute_attention_metrics not in (None, True, False):
        raise ValueError(f"compute_attention_metrics must be True, False or None (auto), got "
                         f"{args.compute_attention_metrics!r}")
    if args.attention_text_keys not in TEXT_KEY_CHOICES:
        raise ValueError(
            f"attention_text_keys must be one of {TEXT_KEY_CHOICES}, got {args.attention_text_keys!r}"
        )
    try:
        # Syntax and names only: the layer count is known once the model is, where ranges are checked again.
        check_segment_spec(args.attention_layer_segments)
    except ValueError as e:
        raise ValueError(f"attention_layer_segments: {e}") from None
    validate_top_p(args.top_p_entropy_tokens, "top_p_entropy_tokens")
    validate_top_p(args.top_p_perception_tokens, "top_p_perception_tokens")
    validate_scaling_min(args.trajectory_scaling_min, "trajectory_scaling_min")
    try:
        check_perturbation(args.perception_perturbation, patch_size=args.perturbation_patch_size,
                           prob=args.perturbation_prob, noise_std=args.perturbation_noise_std,
                           blur_radius=args.perturbation_blur_radius)
    except ValueError as e:
        raise ValueError(f"perception_perturbation: {e}") from None
    if args.perception_signal not in PERCEPTION_SIGNALS:
        raise ValueError(f"perception_signal must be one of {PERCEPTION_SIGNALS}, got {args.perception_signal!r}")
    if args.tprl_placebo not in (True, False):
        raise ValueError(f"tprl_placebo must be True or False, got {args.tprl_placebo!r}")
    if args.tprl_placebo and not args.uses_perception_signal:
        raise ValueError("tprl_placebo replaces what the perception signal decides, but neither "
                         "enable_perception_filtering nor enable_trajectory_reweighting is on: turn one on (the "
                         "placebo of a TPRL run keeps that run's settings) or leave tprl_placebo off")
    from .counterfactual import counterfactual_kinds

    if args.counterfactual_image not in counterfactual_kinds():
        raise ValueError(f"counterfactual_image must be one of {', '.join(counterfactual_kinds())}, got "
                         f"{args.counterfactual_image!r}")
    if args.on_bad_image not in ("skip", "error"):
        raise ValueError(f"on_bad_image must be 'skip' or 'error', got {args.on_bad_image!r}")
    if args.filter_low > args.filter_high:
        raise ValueError(f"filter_low ({args.filter_low}) must be <= filter_high ({args.filter_high})")
    for name in ("log_prompt_preview_chars", "log_completion_preview_chars", "log_full_rollouts_per_step",
                 "attention_map_every_n_steps", "attention_maps_per_step"):
        if getattr(args, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(args, name)}")
    compile_answer_pattern(args.answer_pattern)
    if args.perturbation_seed is None:
        args.perturbation_seed = args.seed
    if isinstance(args.reward_funcs, str):
        args.reward_funcs = args.reward_funcs.split()
    if args.reward_funcs is not None:
        from .rewards import resolve_rewards

        # Resolve now so that unknown names and failing imports fail at construction. The weights pair with the
        # rewards the run uses, which the trainer's reward_funcs argument may replace: their count is the plan's check.
        resolve_rewards(list(args.reward_funcs))
    if (getattr(args, "use_vllm", False) and getattr(args, "vllm_structured_outputs_regex", None)
            and getattr(args, "vllm_importance_sampling_correction", False)):
        # TRL's setting, so a warning and not an error: with a policy that already writes the pattern the two
        # log-probs agree and the correction is harmless; with one that does not, training silently stalls.
        warnings.warn(
            "use_vllm with vllm_structured_outputs_regex and vllm_importance_sampling_correction (TRL's default): "
            "vLLM's sampling log-probs are taken after the regex mask, the policy's are not, so every token the "
            "pattern forces shrinks TRL's importance-sampling ratio (seen on a tiny model: a ratio of 1e-30 and no "
            "parameter moved in 2 steps). Unless the policy already writes the pattern, set "
            "vllm_importance_sampling_correction=False (--vllm_importance_sampling_correction false).",
            UserWarning, stacklevel=3)
