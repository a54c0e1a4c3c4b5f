"""What the trainer does with each generation batch between TRL's steps, as functions of explicit inputs.

The trainer (trl_mdi/trainer.py) only decides *when* these run; this module holds *what* they compute:
rebuilding TRL's forward inputs, the per-rollout attention fields handed to rewards (and the check, at
construction, that every reward's inputs will exist), and the TPRL update of TRL's output. ``gather`` arguments are ``accelerator.gather`` (identity in a single process).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from trl.data_utils import apply_chat_template

from . import metrics as M
from .attention import ModalityAttention
from .rewards import check_reward_columns, required_reward_inputs, reward_name
from .tprl import combine_masks, sequence_mean, top_p_token_mask, trajectory_scaling

# Per-rollout fields handed to reward functions (named keyword arguments) when attention metrics are on, besides
# one mdi_<segment> per layer segment.
ATTENTION_FIELDS = M.PER_ROLLOUT_FIELDS

# Keys of the processor output that TRL's log-prob forward accepts (its keyword arguments).
FORWARD_KEYS = (
    "pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
    "token_type_ids", "mm_token_type_ids", "image_position_ids",
)

Gather = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class ScoringSession:
    """What one call of _generate_and_score_completions learns about its rollouts.

    Lives only for the duration of that call (set and cleared in a try/finally), because TRL's pipeline offers no
    other channel between the log-prob forward and the reward computation.
    """

    capture_in_trl_forward: bool  # TRL runs a no-grad policy forward (old log-probs): measure inside it
    measure_attention: bool
    need_entropy: bool
    attention: ModalityAttention | None = None
    policy_logps: torch.Tensor | None = None  # (B, C) log-probs of the completion under the real image
    entropies: torch.Tensor | None = None  # (B, C) token entropies of the generation-time policy
    visual_dependency: torch.Tensor | None = None  # (B, C) s_t, zero for rows without an image
    has_image: torch.Tensor | None = None  # (B,) bool
    map_rows: list[int] = field(default_factory=list)  # local rows whose per-image-token attention is kept
    rewards_per_func: torch.Tensor | None = None  # (N_global, F), as TRL computed them
    batch: dict[str, Any] = field(default_factory=dict)  # prompts / completions / rows for the live logs
    scoring_seconds: float = 0.0
    reward_start: float = 0.0
    bad_rows: list[int] = field(default_factory=list)  # local rows whose image could not be decoded
    bad_global: torch.Tensor | None = None  # (N_global,) bool

    forward_done: bool = False  # the policy forward of this batch ran (TRL's or ours): never run a second one

    @property
    def scored(self) -> bool:
        return self.forward_done


# ------------------------------------------------------------------------------------------------ small helpers
def row_images(row: dict) -> list:
    """A row's images as a list, as TRL reads them: the `images` column first, else `image` (None -> [])."""
    if "images" in row:
        return list(row["images"] or [])
    return [row["image"]] if row.get("image") is not None else []


def fit_width(t: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad with zeros or cut (B, C) to (B, width): TRL may pad completions to a multiple of N."""
    if t.shape[1] >= width:
        return t[:, :width]
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def float_or_none(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if math.isnan(v) else v


def is_attention_field(name: str) -> bool:
    """Whether a reward input is computed by the attention probe (``mdi*`` / ``aei*``), not read from the data."""
    return name in ATTENTION_FIELDS or name.startswith(("mdi_", "aei_"))


def attention_fields(segment_names: list[str]) -> list[str]:
    """Every per-rollout field the trainer adds to input rows: the fixed ones and ``mdi_<segment>`` per segment."""
    return [*ATTENTION_FIELDS, *(f"mdi_{n}" for n in segment_names)]


def check_reward_inputs(funcs, args, train_dataset, eval_dataset, segment_names: list[str]) -> None:
    """Fail at construction, not at the first reward call, when a reward's inputs cannot exist.

    ``segment_names`` are the model's real segments (``trl_mdi.metrics.segment_names``): a reward may read
    ``mdi_<segment>`` for those only.
    """
    funcs = [f for f in funcs if callable(f) and not isinstance(f, torch.nn.Module)]
    datasets = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval_dataset", eval_dataset)]
    for split, ds in [("train_dataset", train_dataset), *datasets]:
        cols = getattr(ds, "column_names", None)
        if not isinstance(cols, list):
            continue  # iterable datasets may not know their columns up front
        trainer_fields = attention_fields(segment_names)
        try:
            check_reward_columns(funcs, [*cols, *trainer_fields] if args.compute_attention_metrics else cols)
        except ValueError as e:
            raise ValueError(f"{split}: {e} Add the column (data_prep/prepare_aokvqa_for_trl.py writes "
                             "label_idx) or drop the reward.") from None
        clash = [c for c in cols if is_attention_field(c)]
        if clash and args.compute_attention_metrics:
            raise ValueError(f"{split} has columns {clash} that the trainer fills with attention metrics: "
                             "rename them")
    if not args.compute_attention_metrics:
        for f in funcs:
            needed = [n for n in required_reward_inputs(f) if is_attention_field(n)]
            if needed:
                raise ValueError(f"reward {reward_name(f)!r} reads {needed}, which the trainer computes only "
                                 "with compute_attention_metrics=True")


def _decode(value):
    """A PIL image from what datasets stores with decode=False ({bytes, path}), a path, or a PIL image."""
    from io import BytesIO

    from PIL import Image

    if value is None or isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        img = Image.open(BytesIO(data)) if data is not None else Image.open(path)
    else:
        img = Image.open(value)
    img.load()  # decode now: a truncated file fails here, not inside the processor
    return img.convert("RGB") if img.mode != "RGB" else img


def decode_row_images(inputs: list[dict]) -> list[int]:
    """Decode every row's image(s) in place; an unreadable one is replaced by a black image. Returns those rows.

    The trainer keeps datasets from decoding images (decode=False) so that one unreadable image surfaces here,
    where it can be skipped and counted (or reported on every process at once), instead of raising inside the
    data loader of one process while the others wait for it.
    """
    from PIL import Image

    bad = []
    for i, row in enumerate(inputs):
        for key in ("image", "images"):
            if key not in row:
                continue
            try:
                row[key] = ([_decode(v) for v in row[key]] if isinstance(row[key], list) else _decode(row[key]))
            except Exception as e:  # any decoder error: PIL raises several kinds
                # A black stand-in keeps the batch's shapes and the vision tower's work the same on every process
                # (ZeRO-3 gathers its weights on all ranks); the row's rollouts are dropped from the update anyway.
                blank = Image.new("RGB", (56, 56))
                row[key] = [blank] if key == "images" else blank
                row["_bad_image_error"] = f"{type(e).__name__}: {e}"
                bad.append(i)
    return bad


# ------------------------------------------------------------------------------------------------ forward inputs
def rebuild_forward_inputs(processing_class, pad_token_id: int, chat_template_kwargs: dict, inputs: list[dict],
                           prompts: list, completion_ids_list: list, device) -> dict[str, Any]:
    """Prompt + completion tensors and multimodal kwargs, built as TRL 1.16 builds them for its log-prob forward.

    The chat-templated prompts go through the processor with the rows' images (left padding), completions are
    right-padded, token-type ids are extended with zeros over the completion. Every generated token is kept,
    truncated completions included (TRL masks those out of the loss only). tests/test_trl_contract.py checks that
    the result equals TRL's own inputs.
    """
    images = [row_images(x) for x in inputs]
    if all(not imgs for imgs in images):
        images = None
    texts = [apply_chat_template({"prompt": p}, processing_class, **chat_template_kwargs)["prompt"] for p in prompts]
    proc_kwargs = {"images": images} if images is not None else {}
    enc = processing_class(text=texts, padding=True, padding_side="left", return_tensors="pt", **proc_kwargs)
    enc = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in enc.items()}
    prompt_ids, prompt_mask = enc["input_ids"], enc["attention_mask"]
    c_len = max(1, max(len(c) for c in completion_ids_list))
    completion_ids = torch.full((len(prompts), c_len), pad_token_id, dtype=prompt_ids.dtype, device=device)
    completion_mask = torch.zeros((len(prompts), c_len), dtype=prompt_mask.dtype, device=device)
    for i, ids in enumerate(completion_ids_list):
        completion_ids[i, : len(ids)] = torch.as_tensor(list(ids), dtype=prompt_ids.dtype)
        completion_mask[i, : len(ids)] = 1
    forward_kwargs = {k: v for k, v in enc.items() if k in FORWARD_KEYS}
    for key in ("token_type_ids", "mm_token_type_ids"):
        if key in forward_kwargs:
            forward_kwargs[key] = torch.cat([forward_kwargs[key], forward_kwargs[key].new_zeros(completion_ids.shape)], 1)
    return {
        "input_ids": torch.cat([prompt_ids, completion_ids], dim=1),
        "attention_mask": torch.cat([prompt_mask, completion_mask], dim=1),
        "logits_to_keep": c_len,
        "num_images": [len(imgs) for imgs in images] if images is not None else None,
        **forward_kwargs,
    }


# ------------------------------------------------------------------------------------------------ attention fields
def attention_table(attention: ModalityAttention, segments: str, ratio: float) -> dict[str, torch.Tensor]:
    """Per-rollout (B,) values: MDI (all and per segment), balance, AEI, mass shares, image-blind layers, has_image,
    measured. Masses and segments cover the measured (softmax-attention) layers only."""
    seg = attention.segment_metrics(segments)
    table = {
        "mdi": seg["all"]["mdi"],
        "mdi_balance": M.mdi_balance(seg["all"]["mdi"], ratio),
        "aei_text": seg["all"]["aei_text"],
        "aei_image": seg["all"]["aei_image"],
        **{f"mdi_{name}": vals["mdi"] for name, vals in seg.items() if name != "all"},
    }
    for g in ("image", "prompt_text", "completion", "special"):
        table[f"{g}_mass"] = getattr(attention, g)[:, attention.layers].mean(dim=1)
    table["image_blind_layers"] = attention.image_blind_layers().float()
    table["has_image"] = attention.has_image.float()
    table["measured"] = attention.valid.float()
    return table


def attention_metric_values(keys: list[str], gathered: torch.Tensor) -> dict[str, float]:
    """attention/* metrics from the gathered (N_global, K) table: means over rollouts where finite.

    MDI is NaN without an image (counted in ``rows_without_image``) and +inf where a segment's layers give the image
    exactly zero attention (a sliding window hiding every image key): such rows leave the mean and are counted in
    ``attention/rows_mdi_inf`` (a row with +inf in any segment) so no mean is silently inf or NaN.
    """
    col = {k: gathered[:, i] for i, k in enumerate(keys)}
    values = {
        "attention/rows_without_image": float((col["has_image"] == 0).float().mean()),
        "attention/rows_unmeasured": float((col["measured"] == 0).float().mean()),
        # A row counts when any segment (or all layers) gives the image exactly zero attention: that MDI is +inf
        # and leaves its segment's mean.
        "attention/rows_mdi_inf": float(torch.stack([torch.isinf(col[k]) for k in keys if k.startswith("mdi")
                                                     and k not in ("mdi_balance", "mdi_group_score")]).any(0)
                                        .float().mean()),
    }
    for k in keys:
        if k in ("has_image", "measured"):
            continue
        v = col[k][torch.isfinite(col[k])]  # MDI is NaN without image and +inf when image keys get no attention
        if v.numel():
            values[f"attention/{k}"] = float(v.mean())
    return values


# ------------------------------------------------------------------------------------------------ TPRL
def _kept_fraction(mask: torch.Tensor, completion_mask: torch.Tensor, gather: Gather) -> float:
    kept = torch.stack([(mask & completion_mask.bool()).sum(), completion_mask.sum()]).float()
    kept, total = gather(kept[None]).sum(0).tolist()
    return kept / total if total else 0.0


def apply_tprl(out: dict[str, Any], session: ScoringSession, args, gather: Gather, process_index: int) -> dict:
    """TGF masks into the loss mask (TRL's tool_mask) and TAS multipliers into the advantages; returns tprl/*.

    The mask enters the loss mask only: with loss_type "dapo" the normaliser (num_items_in_batch, counted before
    filtering) is unchanged, as in VPPO, so kept tokens get exactly the gradient they had. Rows without an image
    have s_t = 0: the perception filter keeps all their tokens and TAS leaves them at alpha = 1.
    """
    metrics: dict[str, float] = {}
    completion_mask = out["completion_mask"]
    width = completion_mask.shape[1]
    has_image = session.has_image.to(completion_mask.device)
    entropy_mask = perception_mask = None
    if args.enable_entropy_filtering:
        entropy_mask = top_p_token_mask(fit_width(session.entropies, width), completion_mask, args.top_p_entropy_tokens)
        metrics["tprl/entropy_token_fraction"] = _kept_fraction(entropy_mask, completion_mask, gather)
    s_t = fit_width(session.visual_dependency, width) if session.visual_dependency is not None else None
    if args.enable_perception_filtering:
        perception_mask = top_p_token_mask(s_t, completion_mask, args.top_p_perception_tokens)
        perception_mask |= ~has_image[:, None]  # nothing to rank without an image: keep every token
        metrics["tprl/perception_token_fraction"] = _kept_fraction(perception_mask, completion_mask, gather)
    keep = combine_masks(entropy_mask, perception_mask)
    if keep is not None:
        tool_mask = out.get("tool_mask")
        keep = keep.to(completion_mask.dtype)
        out["tool_mask"] = keep if tool_mask is None else tool_mask * keep
    if s_t is None:
        return metrics
    seq = sequence_mean(s_t, completion_mask)
    table = gather(torch.stack([seq.float(), has_image.float()], dim=1))
    metrics["tprl/rows_without_image"] = float((table[:, 1] == 0).float().mean())
    if table[:, 1].any():
        metrics["tprl/sensitivity_score_mean"] = float(table[table[:, 1] > 0, 0].mean())
    if args.enable_trajectory_reweighting:
        # Normalised over the batch gathered from every process (VPPO normalises per device).
        valid = (table[:, 1] > 0) & (gather(completion_mask.sum(1)) > 0)
        scaling = trajectory_scaling(table[:, 0], args.trajectory_scaling_min, valid=valid)
        start = process_index * len(seq)
        out["advantages"] = out["advantages"] * scaling.alpha[start : start + len(seq)].to(out["advantages"].device)
        metrics["tprl/scaling_factor_mean"] = float(scaling.alpha[valid].mean()) if valid.any() else 1.0
        metrics["tprl/scaling_factor_min"] = float(scaling.alpha.min())
        metrics["tprl/scaling_factor_max"] = float(scaling.alpha.max())
    return metrics


# ------------------------------------------------------------------------------------------------ group filtering
def group_filter_keep(rewards_per_func: torch.Tensor, weights: torch.Tensor, names: list[str], key: str,
                      low: float, high: float, num_generations: int) -> torch.Tensor:
    """(N,) bool: rows whose group's mean of reward ``key`` lies in ``[low, high]`` (NaN rewards ignored).

    ``key`` is a reward name as TRL logs it (``mc_idx_reward``), the registry name (``mc_idx``), or ``reward`` for
    the weighted total. A group whose values are all NaN is dropped (nothing to learn from it).

    >>> r = torch.tensor([[1.], [1.], [0.], [1.], [0.], [0.]])
    >>> group_filter_keep(r, torch.ones(1), ["mc_idx_reward"], "mc_idx", 0.01, 0.99, 2).tolist()
    [False, False, True, True, False, False]
    """
    if key == "reward":
        values = (rewards_per_func * weights.to(rewards_per_func.device)).nansum(dim=1)
        values[torch.isnan(rewards_per_func).all(dim=1)] = float("nan")
    else:
        matches = [i for i, n in enumerate(names) if n in (key, f"{key}_reward")]
        if not matches:
            raise ValueError(f"filter_key {key!r} is not one of the rewards {names} (or 'reward' for the total)")
        values = rewards_per_func[:, matches[0]]
    means = torch.nanmean(values.view(-1, num_generations), dim=1)
    keep = (means >= low) & (means <= high)  # NaN means compare False: dropped
    return keep.repeat_interleave(num_generations)


def apply_group_filter(out: dict[str, Any], keep_local: torch.Tensor, gather: Gather) -> None:
    """Take dropped rows out of the update: zero advantage, out of the loss mask, out of the DAPO normaliser."""
    keep = keep_local.to(out["completion_mask"].device)
    out["advantages"] = torch.where(keep, out["advantages"], torch.zeros_like(out["advantages"]))
    row_mask = keep[:, None].to(out["completion_mask"].dtype)
    tool_mask = out.get("tool_mask")
    out["tool_mask"] = row_mask.expand_as(out["completion_mask"]).clone() if tool_mask is None else tool_mask * row_mask
    loss_mask = out["completion_mask"] * out["tool_mask"]
    # Counted before TPRL's token filters, which must leave the normaliser unchanged.
    out["num_items_in_batch"] = gather(loss_mask.sum()).sum().clamp(min=1)


def lazy_images(dataset):
    """The dataset with its image column(s) left undecoded, so the trainer decodes them (see decode_row_images)."""
    from datasets import Dataset, Image, List

    if not isinstance(dataset, Dataset):
        return dataset  # dicts of datasets and iterable datasets are passed through unchanged
    for col in ("image", "images"):
        feature = dataset.features.get(col)
        if isinstance(feature, Image) and feature.decode:
            dataset = dataset.cast_column(col, Image(decode=False))
        elif isinstance(feature, List) and isinstance(feature.feature, Image) and feature.feature.decode:
            dataset = dataset.cast_column(col, List(Image(decode=False)))
    return dataset

