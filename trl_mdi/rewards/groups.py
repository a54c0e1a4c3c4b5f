"""Pure tensor helpers over GRPO groups: ``group_relative_mdi_score`` and ``zero_spread_fraction``."""

from __future__ import annotations

import math

import torch

__all__ = ["group_relative_mdi_score", "zero_spread_fraction"]


def _groups(x: torch.Tensor, num_generations: int) -> torch.Tensor:
    if num_generations < 1 or x.shape[0] % num_generations:
        raise ValueError(
            f"{x.shape[0]} rollouts do not split into groups of num_generations={num_generations}"
        )
    return x.reshape(x.shape[0] // num_generations, num_generations, *x.shape[1:])


def group_relative_mdi_score(mdi: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Rank-based MDI balance within each group of rollouts of the same prompt, in [-1, 1].

    Why: the brief's reward ``2 * clip(1 - |log MDI| / log R, 0, 1) - 1`` is the same -1 for every
    MDI outside (1/R, R). Typical MDI is 5-17, so usually the whole group sits outside, the reward is
    constant within the group and its GRPO advantage is zero: no signal. Ranking |log MDI| inside the
    group always separates rollouts, whatever the absolute level.

    ``mdi`` is (N,) with the ``num_generations`` rollouts of one prompt consecutive (TRL's sampler
    order; gather across processes first, groups can span them). Within a group, with rank_i the
    0-based ascending rank of |log MDI_i| among the valid rollouts (ties get their average rank):

        score_i = 1 - 2 * rank_i / (n_valid - 1)

    so the most balanced rollout gets 1, the least -1, and the scores of a group sum to zero. NaN MDI
    (no image tokens) or a negative one gets NaN and is left out of the ranking; a group with one
    valid rollout gives it 0. MDI 0 or inf count as maximally unbalanced (|log MDI| = inf, tied).
    Only the order matters: a tiny MDI difference earns the full spread, so weight it accordingly.

    >>> group_relative_mdi_score(torch.tensor([8.0, 2.0, 16.0, 4.0, 5.0, 5.0, float("nan"), 1.0]), 4)
    tensor([-0.3333,  1.0000, -1.0000,  0.3333, -0.5000, -0.5000,     nan,  1.0000])
    """
    if mdi.dim() != 1:
        raise ValueError(f"mdi must be 1-D (N,), got shape {tuple(mdi.shape)}")
    x = _groups(mdi.double().log().abs(), num_generations)  # (groups, G)
    valid = ~x.isnan()
    xi, xj, valid_j = x.unsqueeze(-1), x.unsqueeze(-2), valid.unsqueeze(-2)
    below = ((xj < xi) & valid_j).sum(-1).double()
    tied = ((xj == xi) & valid_j).sum(-1).double()  # counts itself when valid
    rank = below + (tied - 1) / 2
    n_valid = valid.sum(-1, keepdim=True).double()
    score = torch.where(n_valid > 1, 1 - 2 * rank / (n_valid - 1).clamp(min=1), torch.zeros_like(rank))
    score = torch.where(valid, score, torch.full_like(score, math.nan))
    dtype = mdi.dtype if mdi.is_floating_point() else torch.float32
    return score.reshape(-1).to(dtype)


def zero_spread_fraction(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Per reward function, the fraction of groups in which it carries no GRPO signal, (N, F) -> (F,).

    A group has zero spread for a function when all its non-NaN values are equal. A group with one
    non-NaN value or none counts as zero spread too: it cannot rank its rollouts (TRL gives such
    values zero advantage). The denominator is all groups; with no groups the result is NaN.
    Rollouts of a prompt are consecutive, as in ``group_relative_mdi_score``.

    >>> nan = float("nan")
    >>> r = torch.tensor([[1.0, -1.0], [0.0, -1.0], [1.0, nan], [1.0, nan]])
    >>> zero_spread_fraction(r, 2)
    tensor([0.5000, 1.0000])
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be 2-D (N, num_funcs), got shape {tuple(rewards.shape)}")
    r = _groups(rewards.double(), num_generations)  # (groups, G, F)
    valid = ~r.isnan()
    hi = torch.where(valid, r, torch.full_like(r, -math.inf)).amax(dim=1)
    lo = torch.where(valid, r, torch.full_like(r, math.inf)).amin(dim=1)
    flat = (valid.sum(dim=1) <= 1) | (hi == lo)  # (groups, F)
    return flat.float().mean(dim=0)
