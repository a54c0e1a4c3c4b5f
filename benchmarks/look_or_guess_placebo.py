"""The replication's arm D (benchmarks/RESULTS.md, "Look or guess, replication"): ``guarded_visual_gain``'s values
permuted within each group. Its own module because it imports TRL (through ``trl_mdi.rewards``), which a benchmark
imports only after its offline settings: the runs import it when they build a run's rewards."""

from __future__ import annotations

import dataclasses

import numpy as np

from trl_mdi.rewards import GuardedVisualGainReward


@dataclasses.dataclass(frozen=True)
class PlaceboGuardedReward(GuardedVisualGainReward):
    """``guarded_visual_gain``'s values for the batch, then permuted at random within each group of ``group_size``
    consecutive rollouts (TRL's sampler puts a prompt's rollouts together), a fresh permutation per group and step
    from ``numpy.random.default_rng([seed, step])``: every group keeps its values, none is linked to the rollout that
    earned it. A subclass, so that the trainer binds the answer format to it as to the real reward."""

    seed: int = 0
    group_size: int = 8
    __name__ = "placebo_guarded_visual_gain_reward"

    def __call__(self, completions: list, visual_gain_max: list, label_idx: list, choices: list | None = None,
                 trainer_state=None, **kwargs) -> list:
        values = super().__call__(completions, visual_gain_max, label_idx, choices=choices)
        if len(values) % self.group_size:
            raise ValueError(f"{len(values)} rollouts are not whole groups of {self.group_size}")
        step = int(getattr(trainer_state, "global_step", 0) or 0)
        rng = np.random.default_rng([self.seed, step])
        out = []
        for lo in range(0, len(values), self.group_size):
            group = values[lo:lo + self.group_size]
            out.extend(group[i] for i in rng.permutation(len(group)))
        return out
