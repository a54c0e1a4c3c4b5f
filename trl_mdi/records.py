"""The small records that carry one generation batch through MDIGRPOTrainer's overrides.

TRL's pipeline gives no channel between its stages (the no-grad log-prob forward, ``_calculate_rewards``, the
advantages computed inline after it), so the trainer holds exactly one :class:`BatchRecord` while a training step
(or an evaluation batch) runs, set and cleared in ``try/finally``. Everything else flows through arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import ModalityAttention


@dataclass
class PolicyForward:
    """What the policy forward over prompt + completion measured (TRL's old-log-prob forward, or the trainer's own).

    Local rows, TRL's order. ``logps``/``entropies`` are filled only when TPRL needs them.
    """

    attention: ModalityAttention | None = None
    logps: torch.Tensor | None = None  # (B, C) log-probs of the completion under the real image
    entropies: torch.Tensor | None = None  # (B, C) token entropies of the generation-time policy
    visual_dependency: torch.Tensor | None = None  # (B, C) s_t from the perturbed image, zero for rows without one
    image_attention: torch.Tensor | None = None  # (B, C) a_t, image mass of the position choosing each token
    has_image: torch.Tensor | None = None  # (B,) bool

    def perception(self, signal: str) -> torch.Tensor | None:
        """The per-token visual dependency TPRL ranks by: ``"perturbation"`` (s_t) or ``"attention"`` (a_t)."""
        return self.visual_dependency if signal == "perturbation" else self.image_attention


@dataclass
class ScoredRollouts:
    """What ``_calculate_rewards`` saw and TRL computed from it, kept for filtering and the live logs."""

    rewards: torch.Tensor  # (N_global, F) per reward function, NaN for unreadable images and None rewards
    bad: torch.Tensor  # (N_global,) bool: rollouts of an unreadable image
    signals: dict[str, torch.Tensor] | None  # local per-rollout signals (trl_mdi.signals) the rewards read
    prompts: list  # local rows
    completions: list
    lengths: list[int]


@dataclass
class StepTiming:
    """Wall seconds of one generation batch: generating, and the trainer's own scoring (probe, perturbed forward)."""

    started: float = 0.0
    rewards_started: float = 0.0
    scoring: float = 0.0
    rides_trl_forward: bool = False  # scoring time is then inside TRL's forward, before rewards_started

    @property
    def generation(self) -> float:
        inside = self.scoring if self.rides_trl_forward else 0.0
        return max(self.rewards_started - self.started - inside, 0.0)


@dataclass
class BatchRecord:
    """The one per-batch channel. ``map_rows`` is the request (local rows whose per-image-token attention the probe
    keeps, for attention maps); the rest is filled as TRL's stages run."""

    map_rows: list[int] = field(default_factory=list)
    bad_rows: torch.Tensor | None = None  # (B,) bool: local rows whose image could not be decoded
    forward: PolicyForward | None = None  # set once the policy forward ran: never run a second one
    scored: ScoredRollouts | None = None
    timing: StepTiming = field(default_factory=StepTiming)
    tokens: float = 0.0  # prompt + completion tokens of the generation batch, all processes
    samples: float = 0.0
    in_training_forward: bool = False  # the probe measures in the training forward (no forward before the rewards)

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
class PendingMeasurement:
    """A generation batch whose attention is measured in the training forward, slice by slice (TRL shuffles and splits
    the batch; each slice carries its rows' local indices). Complete once every row has been measured; then its
    metrics and live logs are written. ``out`` keeps what the logs need of TRL's output (advantages gathered,
    completion ids and mask, local)."""

    step: int
    inputs: list[dict]
    record: BatchRecord
    out: dict[str, torch.Tensor]
    parts: list[tuple[list[int], ModalityAttention]] = field(default_factory=list)
    active_rows: list[int] | None = None  # the slice being trained now (set around its loss computation)

    @property
    def complete(self) -> bool:
        return sum(len(rows) for rows, _ in self.parts) == len(self.inputs)

    def slice_map_rows(self) -> list[int]:
        """Positions in the active slice of the rows the attention maps want."""
        return [i for i, row in enumerate(self.active_rows or []) if row in self.record.map_rows]

    def attention(self) -> ModalityAttention:
        """The whole batch's result, rows back in generation order."""
        rows = [r for part_rows, _ in self.parts for r in part_rows]
        order = sorted(range(len(rows)), key=rows.__getitem__)
        return ModalityAttention.cat([a for _, a in self.parts]).take(order)
