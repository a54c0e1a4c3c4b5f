"""How often each reward returned None ("not applicable") and NaN (a failure), told apart before TRL merges them.

TRL turns a reward's None into NaN as soon as the function returns (``GRPOTrainer._calculate_rewards``), and then
treats both alike: ``nansum`` counts them as 0 in the rollout's weighted total, and the per-reward mean
(``rewards/<name>/mean``) leaves them out. So a reward that fails on some rollouts reads as a healthy mean and
silently pulls those rollouts' advantages down. The two are told apart here, where the reward's own return value
is still at hand:

- ``count_outcomes``: (None count, non-finite count) of one reward's return value, pure.
- ``RewardTally``: wraps a batch's reward callables (each keeps its ``__name__``, so TRL names it the same) and
  records those counts for every call.
- ``outcome_metrics``: the counts of a whole generation batch as ``rewards/<name>/none_frac`` and
  ``rewards/<name>/nan_frac``.

None is "not applicable" by design (the reliance rewards return it where there is no answer line): counted, never
warned about. NaN or an infinite value is a reward failing: counted, and the trainer warns once per reward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["count_outcomes", "RewardTally", "outcome_metrics"]


def count_outcomes(values: Sequence) -> tuple[int, int]:
    """``(n_none, n_nonfinite)`` of one reward's return value: how many rollouts it found not applicable (None)
    and how many it failed to score (NaN or an infinity, which TRL's ``nansum`` would carry into the total).

    >>> count_outcomes([1.0, None, float("nan"), 0.0, None, float("inf")])
    (2, 2)
    >>> count_outcomes([])
    (0, 0)
    """
    n_none = n_bad = 0
    for v in values:
        if v is None:
            n_none += 1
        else:
            try:
                n_bad += not math.isfinite(float(v))
            except (TypeError, ValueError):  # not a number at all: TRL's tensor conversion will say so
                pass
    return n_none, n_bad


class _Counted:
    """One reward callable, counting the None and non-finite values it returns into ``tally`` (picklable, named)."""

    def __init__(self, func: Callable, index: int, tally: RewardTally):
        self.func, self.index, self.tally = func, index, tally
        self.__name__ = getattr(func, "__name__", type(func).__name__)

    def __call__(self, *args, **kwargs):
        out = self.func(*args, **kwargs)
        n_none, n_bad = count_outcomes(out)
        self.tally.counts[self.index] = (n_none, n_bad, len(out))
        return out


class RewardTally:
    """The reward callables of one generation batch, wrapped so each call's None and non-finite counts are kept.

    ``funcs``: what to score with (reward models, ``torch.nn.Module``, and async functions are left as they are:
    TRL calls them differently, and a model's logits are never None); ``counts[i]``: ``(n_none, n_nonfinite, n)`` of
    function i's last call, ``(0, 0, 0)`` for one not wrapped or not called.

    >>> tally = RewardTally([lambda completions, **kw: [None, 1.0, float("nan")]])
    >>> tally.funcs[0](completions=["a", "b", "c"])
    [None, 1.0, nan]
    >>> tally.counts
    [(1, 1, 3)]
    """

    def __init__(self, funcs: Sequence[Callable]):
        import torch
        from trl.trainer.utils import is_async_callable  # TRL's own test, so we skip exactly what it awaits

        self.counts: list[tuple[int, int, int]] = [(0, 0, 0)] * len(funcs)
        self.funcs = [
            f if isinstance(f, torch.nn.Module) or is_async_callable(f) else _Counted(f, i, self)
            for i, f in enumerate(funcs)
        ]


def outcome_metrics(names: Sequence[str], counts) -> dict[str, float]:
    """``rewards/<name>/none_frac`` and ``rewards/<name>/nan_frac`` from per-reward counts summed over processes.

    ``counts``: one ``(n_none, n_nonfinite, n)`` per reward (a sequence or an (F, 3) tensor). A reward with no
    counted rollout (a reward model, or no call) gets no entry.

    >>> outcome_metrics(["mc_idx", "gain_reward"], [(0, 0, 8), (2, 1, 8)])
    {'rewards/mc_idx/none_frac': 0.0, 'rewards/mc_idx/nan_frac': 0.0, \
'rewards/gain_reward/none_frac': 0.25, 'rewards/gain_reward/nan_frac': 0.125}
    """
    out = {}
    for name, (n_none, n_bad, n) in zip(names, [tuple(float(x) for x in row) for row in counts]):
        if n > 0:
            out[f"rewards/{name}/none_frac"] = n_none / n
            out[f"rewards/{name}/nan_frac"] = n_bad / n
    return out
