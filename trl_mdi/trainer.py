"""MDIGRPOTrainer: TRL's GRPOTrainer plus per-rollout attention measurement and the MDI reward fields."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from trl import GRPOTrainer
from trl.data_utils import apply_chat_template
from trl.models.utils import disable_gradient_checkpointing

from . import metrics as M
from .attention import ModalityAttention, _forward_tensors, _layout, image_token_ids, probe_attention, unwrap_model
from .attention import template_text_exclusion_mask
from .config import MDIGRPOConfig
from .rewards import (
    DEFAULT_REWARD_WEIGHTS,
    DEFAULT_REWARDS,
    REWARD_REGISTRY,
    check_reward_columns,
    group_relative_mdi_score,
    required_reward_inputs,
    resolve_rewards,
    zero_spread_fraction,
)

# Per-rollout fields handed to reward functions (named keyword arguments) when attention metrics are on.
ATTENTION_FIELDS = ("mdi", "mdi_balance", "mdi_group_score", "aei_text", "aei_image")

# Keys of the processor output that TRL's log-prob forward accepts (its keyword arguments).
_FORWARD_KEYS = (
    "pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
    "token_type_ids", "mm_token_type_ids", "image_position_ids",
)


@dataclass
class _ScoringSession:
    """What one call of _generate_and_score_completions learns about its rollouts.

    Lives only for the duration of that call (set and cleared in a try/finally), because TRL's pipeline offers no
    other channel between the log-prob forward and the reward computation.
    """

    capture_in_trl_forward: bool  # TRL runs a no-grad policy forward (old log-probs): measure inside it
    attention: ModalityAttention | None = None
    policy_logps: torch.Tensor | None = None  # (B, C) log-probs of the completion under the real image
    forwards: int = 0  # no-grad policy forwards made for measurement (for tests and metrics)


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
       the 4:1:1 stack (mc_idx, think_format, mdi_balance). Required dataset columns are checked at construction.
    4. **Metrics.** `attention/*` (mean MDI per segment, AEI, mass shares, rows without image) and
       `rewards/<name>/zero_spread_frac` (fraction of groups in which a reward has no spread, hence no signal),
       through TRL's metric path, so they reach every `report_to` tracker.
    """

    _tag_names = ["trl", "grpo", "trl_mdi"]

    def __init__(self, model, reward_funcs=None, args: MDIGRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "model")
            args = MDIGRPOConfig(f"{str(name).split('/')[-1]}-MDI-GRPO")
        elif not isinstance(args, MDIGRPOConfig):
            raise TypeError(f"args must be an MDIGRPOConfig, got {type(args).__name__}")
        names = reward_funcs if reward_funcs is not None else (args.reward_funcs or list(DEFAULT_REWARDS))
        if not isinstance(names, (list, tuple)):
            names = [names]
        if args.reward_weights is None and list(names) == list(DEFAULT_REWARDS):
            args.reward_weights = list(DEFAULT_REWARD_WEIGHTS)
        funcs = _resolve_reward_funcs(list(names), args.reward_weights)
        self._check_reward_inputs(funcs, args, train_dataset, eval_dataset)
        self._probe_session: _ScoringSession | None = None
        super().__init__(model, reward_funcs=funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, **kwargs)
        if args.compute_attention_metrics:
            base = unwrap_model(self.model)
            self._image_ids = image_token_ids(base.config)  # clear error for a model without an image token
            num_layers = base.config.get_text_config().num_hidden_layers
            try:
                M.layer_segments(num_layers, args.attention_layer_segments)  # ranges checked against the model
            except ValueError as e:
                raise ValueError(f"attention_layer_segments: {e}") from None

    # ------------------------------------------------------------------------------------------------ checks
    @staticmethod
    def _check_reward_inputs(funcs, args, train_dataset, eval_dataset) -> None:
        """Fail at construction, not at the first reward call, when a reward's inputs cannot exist."""
        funcs = [f for f in funcs if callable(f) and not isinstance(f, torch.nn.Module)]
        datasets = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval_dataset", eval_dataset)]
        for split, ds in [("train_dataset", train_dataset), *datasets]:
            cols = getattr(ds, "column_names", None)
            if not isinstance(cols, list):
                continue  # iterable datasets may not know their columns up front
            # Segment names are configurable, so every mdi_<name> counts as a trainer field here.
            trainer_fields = [*ATTENTION_FIELDS, *(f"mdi_{n}" for n in _segment_names(args))]
            try:
                check_reward_columns(funcs, [*cols, *trainer_fields] if args.compute_attention_metrics else cols)
            except ValueError as e:
                raise ValueError(f"{split}: {e} Add the column (data_prep/prepare_aokvqa_for_trl.py writes "
                                 "label_idx) or drop the reward.") from None
            clash = [c for c in cols if _is_attention_field(c)]
            if clash and args.compute_attention_metrics:
                raise ValueError(f"{split} has columns {clash} that the trainer fills with attention metrics: "
                                 "rename them")
        if not args.compute_attention_metrics:
            for f in funcs:
                needed = [n for n in required_reward_inputs(f) if _is_attention_field(n)]
                if needed:
                    raise ValueError(f"reward {_reward_name(f)!r} reads {needed}, which the trainer computes only "
                                     "with compute_attention_metrics=True")

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
        if any(x.get("image", 0) is None for x in inputs) and not any("images" in x for x in inputs):
            # Same fix for the dataset's image column, which TRL uses when a batch holds no image at all.
            for x in inputs:
                x["images"] = [x["image"]] if x.get("image") is not None else []
        if not self.args.compute_attention_metrics:
            return super()._generate_and_score_completions(inputs)
        self._probe_session = _ScoringSession(capture_in_trl_forward=self._trl_runs_policy_forward())
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._probe_session = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        session = self._probe_session
        if (
            session is None
            or not session.capture_in_trl_forward
            or session.attention is not None
            or model is not self.model
            or torch.is_grad_enabled()
        ):
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              *args, **kwargs)
        # TRL's old-log-prob forward of the policy: measure inside it instead of running another one.
        with probe_attention(model, self._layout_fn(logits_to_keep)) as state:
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                             *args, **kwargs)
        session.attention, session.policy_logps = state.result(), out[0]
        session.forwards += 1
        return out

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        session = self._probe_session
        if session is not None:
            if session.attention is None:
                self._measure_attention(session, inputs, prompts, completion_ids_list)
            self._attach_attention_fields(session.attention, inputs)
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
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
        """Prompt + completion tensors and multimodal kwargs, built as TRL builds them for its log-prob forward.

        Every generated token is measured, truncated completions included (TRL masks those out of the loss only).
        """
        device = self.accelerator.device
        if "images" in inputs[0]:
            images = [x.get("images") or [] for x in inputs]
        elif "image" in inputs[0]:
            images = [[x["image"]] if x.get("image") is not None else [] for x in inputs]
        else:
            images = None
        if images is not None and all(not imgs for imgs in images):
            images = None
        texts = [apply_chat_template({"prompt": p}, self.processing_class, **self.chat_template_kwargs)["prompt"]
                 for p in prompts]
        proc_kwargs = {"images": images} if images is not None else {}
        enc = self.processing_class(text=texts, padding=True, padding_side="left", return_tensors="pt", **proc_kwargs)
        enc = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in enc.items()}
        prompt_ids, prompt_mask = enc["input_ids"], enc["attention_mask"]
        c_len = max(1, max(len(c) for c in completion_ids_list))
        pad_id = self._tokenizer.pad_token_id
        completion_ids = torch.full((len(prompts), c_len), pad_id, dtype=prompt_ids.dtype, device=device)
        completion_mask = torch.zeros((len(prompts), c_len), dtype=prompt_mask.dtype, device=device)
        for i, ids in enumerate(completion_ids_list):
            completion_ids[i, : len(ids)] = torch.as_tensor(list(ids), dtype=prompt_ids.dtype)
            completion_mask[i, : len(ids)] = 1
        forward_kwargs = {k: v for k, v in enc.items() if k in _FORWARD_KEYS}
        for key in ("token_type_ids", "mm_token_type_ids"):
            if key in forward_kwargs:
                forward_kwargs[key] = torch.cat([forward_kwargs[key], forward_kwargs[key].new_zeros(completion_ids.shape)], 1)
        num_images = [len(imgs) if imgs else 0 for imgs in images] if images is not None else None
        return {
            "input_ids": torch.cat([prompt_ids, completion_ids], dim=1),
            "attention_mask": torch.cat([prompt_mask, completion_mask], dim=1),
            "logits_to_keep": c_len,
            "num_images": num_images,
            **forward_kwargs,
        }

    def _measure_attention(self, session: _ScoringSession, inputs, prompts, completion_ids_list) -> None:
        fwd = self._policy_forward_inputs(inputs, prompts, completion_ids_list)
        mode = "train" if self.model.training else "eval"
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        input_ids, attention_mask, c_len = fwd.pop("input_ids"), fwd.pop("attention_mask"), fwd.pop("logits_to_keep")
        # Every rank runs this forward (same number of chunks): ZeRO-3 needs all ranks in every gather.
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
            probe_attention(self.model, self._layout_fn(c_len)) as state,
        ):
            logps, _, _ = super()._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, c_len, batch_size=batch_size, **fwd
            )
        session.attention, session.policy_logps = state.result(), logps
        session.forwards += 1

    def _attach_attention_fields(self, attention: ModalityAttention, inputs: list[dict]) -> None:
        """Add per-rollout attention fields to every input row (TRL passes row keys to rewards) and log metrics."""
        seg = attention.segment_metrics(self.args.attention_layer_segments)
        balance = M.mdi_balance(seg["all"]["mdi"], self.args.mdi_balance_ratio)
        local = {
            "mdi": seg["all"]["mdi"],
            "mdi_balance": balance,
            "aei_text": seg["all"]["aei_text"],
            "aei_image": seg["all"]["aei_image"],
            **{f"mdi_{name}": vals["mdi"] for name, vals in seg.items() if name != "all"},
        }
        for g in ("image", "prompt_text", "completion", "special"):
            local[f"{g}_mass"] = getattr(attention, g).mean(dim=1)
        local["has_image"] = attention.has_image.float()
        local["measured"] = attention.valid.float()
        keys = list(local)
        device = self.accelerator.device
        table = torch.stack([local[k].float() for k in keys], dim=1).to(device)
        gathered = self.accelerator.gather(table)  # (N_global, K): groups can span processes
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        all_mdi = gathered[:, keys.index("mdi")]
        group_score = group_relative_mdi_score(all_mdi.cpu(), num_generations)
        start = self.accelerator.process_index * len(inputs)
        local["mdi_group_score"] = group_score[start : start + len(inputs)]
        for i, row in enumerate(inputs):
            for k in [*ATTENTION_FIELDS, *(f"mdi_{n}" for n in seg if n != "all")]:
                row[k] = _float_or_none(local[k][i])
        self._log_attention_metrics(mode, keys, gathered)

    def _log_attention_metrics(self, mode: str, keys: list[str], gathered: torch.Tensor) -> None:
        col = {k: gathered[:, i] for i, k in enumerate(keys)}
        metrics = self._metrics[mode]
        metrics["attention/rows_without_image"].append(float((col["has_image"] == 0).float().mean()))
        metrics["attention/rows_unmeasured"].append(float((col["measured"] == 0).float().mean()))
        for k in keys:
            if k in ("has_image", "measured"):
                continue
            v = col[k]
            v = v[torch.isfinite(v)]  # MDI is NaN without image and +inf when image keys get no attention
            if v.numel():
                metrics[f"attention/{k}"].append(float(v.mean()))


def _resolve_reward_funcs(names: list, weights: list[float] | None) -> list:
    """Registry names and 'pkg.module:function' paths -> functions; callables and other strings (reward model ids,
    which TRL loads itself) pass through unchanged."""
    if weights is not None and len(weights) != len(names):
        raise ValueError(
            f"{len(names)} reward functions but {len(weights)} reward_weights: give one weight per reward "
            f"({', '.join(map(_reward_name, names))})"
        )
    out = []
    for r in names:
        if isinstance(r, str) and (r in REWARD_REGISTRY or ":" in r or "/" not in r):
            out.extend(resolve_rewards([r], None)[0])
        else:
            out.append(r)
    return out


def _reward_name(r) -> str:
    return r if isinstance(r, str) else getattr(r, "__name__", type(r).__name__)


def _float_or_none(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if math.isnan(v) else v


def _segment_names(args) -> list[str]:
    return [n for n in M.layer_segments(10_000, args.attention_layer_segments) if n != "all"]


def _is_attention_field(name: str) -> bool:
    return name in ATTENTION_FIELDS or name.startswith("mdi_")

