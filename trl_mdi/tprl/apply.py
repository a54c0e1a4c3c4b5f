"""TPRL applied to TRL's output: token masks into the loss mask, trajectory multipliers into the advantages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .formulas import (
    combine_masks,
    fit_width,
    permute_valid,
    placebo_generator,
    random_token_mask,
    rank_correlation,
    sequence_mean,
    top_p_token_mask,
    trajectory_scaling,
)

Gather = Callable[[torch.Tensor], torch.Tensor]  # concatenates a tensor over processes (the trainer's gather)


def _kept_fraction(mask: torch.Tensor, completion_mask: torch.Tensor, gather: Gather) -> float:
    kept = torch.stack([(mask & completion_mask.bool()).sum(), completion_mask.sum()]).float()
    kept, total = gather(kept[None]).sum(0).tolist()
    return kept / total if total else 0.0


def apply_tprl(out: dict[str, Any], args, *, entropies: torch.Tensor | None, perception: torch.Tensor | None,
               has_image: torch.Tensor, gather: Gather, process_index: int, step: int = 0) -> dict[str, float]:
    """TGF masks into the loss mask (TRL's tool_mask) and TAS multipliers into the advantages; returns tprl/*.

    ``entropies`` and ``perception`` (the per-token perception signal, either kind) are (B, C) per local completion
    token (None when their filter is off),
    ``has_image`` (B,); ``args`` holds the TPRL switches and fractions. The mask enters the loss mask only: with
    loss_type "dapo" the normaliser (num_items_in_batch, counted before filtering) is unchanged, as in VPPO, so kept
    tokens get exactly the gradient they had. Rows without an image have s_t = 0: the perception filter keeps all
    their tokens and TAS leaves them at alpha = 1.

    With ``args.tprl_placebo`` (an experiment control) the perception filter keeps as many tokens per row, chosen at
    random (``random_token_mask``, drawn per (seed, ``step``, process)), and the TAS multipliers are permuted over
    the batch's valid rows (``permute_valid``, drawn per (seed, ``step``): the same on every process); the entropy
    filter and every forward are unchanged.
    """
    metrics: dict[str, float] = {}
    completion_mask = out["completion_mask"]
    width = completion_mask.shape[1]
    has_image = has_image.to(completion_mask.device)
    entropy_mask = perception_mask = None
    if args.enable_entropy_filtering:
        entropy_mask = top_p_token_mask(fit_width(entropies, width), completion_mask, args.top_p_entropy_tokens)
        metrics["tprl/entropy_token_fraction"] = _kept_fraction(entropy_mask, completion_mask, gather)
    s_t = fit_width(perception, width) if perception is not None else None
    placebo = getattr(args, "tprl_placebo", False)  # absent on a namespace holding the TPRL switches only
    seed = (args.perturbation_seed if args.perturbation_seed is not None else args.seed) if placebo else 0
    if args.enable_perception_filtering:
        if placebo:  # stream 1 + process: each process's rows draw their own tokens
            perception_mask = random_token_mask(completion_mask, args.top_p_perception_tokens,
                                                placebo_generator(seed, step, 1 + process_index))
        else:
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
        alpha = scaling.alpha
        if placebo:  # stream 0: one permutation of the gathered batch, the same on every process
            alpha = permute_valid(alpha, scaling.valid, placebo_generator(seed, step, 0))
        start = process_index * len(seq)
        out["advantages"] = out["advantages"] * alpha[start : start + len(seq)].to(out["advantages"].device)
        metrics["tprl/scaling_factor_mean"] = float(scaling.alpha[valid].mean()) if valid.any() else 1.0
        metrics["tprl/scaling_factor_min"] = float(scaling.alpha.min())
        metrics["tprl/scaling_factor_max"] = float(scaling.alpha.max())
    return metrics


def signal_rank_corr(perturbation: torch.Tensor, attention: torch.Tensor, completion_mask: torch.Tensor,
                     has_image: torch.Tensor, gather: Gather) -> float:
    """``tprl/signal_rank_corr``: Spearman's rho between the two perception signals (s_t from the perturbed image,
    a_t from attention) over each sequence's valid completion tokens, averaged over the rows with an image of the
    batch gathered from every process. Rows where rho is undefined (fewer than 2 tokens, a constant signal) are left
    out of the mean; NaN when no row has one."""
    width = completion_mask.shape[1]
    rho = rank_correlation(fit_width(perturbation, width).cpu(), fit_width(attention, width).cpu(),
                           completion_mask.cpu())
    rho[~has_image.cpu().bool()] = float("nan")
    rho = gather(rho.float().to(completion_mask.device)).cpu()
    rho = rho[~rho.isnan()]
    return float(rho.mean()) if len(rho) else float("nan")
