"""``zero_spread_fraction``: how often a reward carries no GRPO signal inside a group."""

from __future__ import annotations

import math

import torch

from ..signals import split_groups

__all__ = ["zero_spread_fraction"]


def zero_spread_fraction(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Per reward function, the fraction of groups in which it carries no GRPO signal, (N, F) -> (F,).

    A group has zero spread for a function when all its non-NaN values are equal. A group with one
    non-NaN value or none counts as zero spread too: it cannot rank its rollouts (TRL gives such
    values zero advantage). The denominator is all groups; with no groups the result is NaN.
    Rollouts of a prompt are consecutive (TRL's sampler order).

    >>> nan = float("nan")
    >>> r = torch.tensor([[1.0, -1.0], [0.0, -1.0], [1.0, nan], [1.0, nan]])
    >>> zero_spread_fraction(r, 2)
    tensor([0.5000, 1.0000])
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be 2-D (N, num_funcs), got shape {tuple(rewards.shape)}")
    r = split_groups(rewards.double(), num_generations)  # (groups, G, F)
    valid = ~r.isnan()
    hi = torch.where(valid, r, torch.full_like(r, -math.inf)).amax(dim=1)
    lo = torch.where(valid, r, torch.full_like(r, math.inf)).amin(dim=1)
    flat = (valid.sum(dim=1) <= 1) | (hi == lo)  # (groups, F)
    return flat.float().mean(dim=0)
