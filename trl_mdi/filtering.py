"""Online group filtering: groups whose mean reward is outside a range leave the update."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Gather = Callable[[torch.Tensor], torch.Tensor]


def filter_column(key: str, names: list[str]) -> int | None:
    """Index of the reward named ``key`` among ``names`` (the names TRL logs, ``rewards/<name>/mean``: a registry
    reward's is its registry name); None for ``reward``, the weighted total. ValueError naming the rewards when
    ``key`` matches none.

    >>> filter_column("mc_idx", ["mc_idx", "think_format"]), filter_column("reward", [])
    (0, None)
    """
    if key == "reward":
        return None
    matches = [i for i, n in enumerate(names) if n == key]
    if not matches:
        raise ValueError(f"filter_key {key!r} is not one of the rewards {list(names)} (or 'reward' for the weighted "
                         "total)")
    return matches[0]


def group_filter_keep(rewards_per_func: torch.Tensor, weights: torch.Tensor, names: list[str], key: str,
                      low: float, high: float, num_generations: int) -> torch.Tensor:
    """(N,) bool: rows whose group's mean of reward ``key`` lies in ``[low, high]`` (NaN rewards ignored).

    ``key`` is a reward's name (``mc_idx``) or ``reward`` for the weighted total. A group whose values are all NaN is dropped (nothing to learn from it).

    >>> r = torch.tensor([[1.], [1.], [0.], [1.], [0.], [0.]])
    >>> group_filter_keep(r, torch.ones(1), ["mc_idx"], "mc_idx", 0.01, 0.99, 2).tolist()
    [False, False, True, True, False, False]
    """
    column = filter_column(key, names)
    if column is None:
        values = (rewards_per_func * weights.to(rewards_per_func.device)).nansum(dim=1)
        values[torch.isnan(rewards_per_func).all(dim=1)] = float("nan")
    else:
        values = rewards_per_func[:, column]
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
