"""Measuring attention inside TRL's training forward, when nothing needs it before the loss (metrics and logs only).

A mixin of the trainer (``class MDIGRPOTrainer(TrainingForwardProbe, PolicyForwards, GRPOTrainer)``). TRL shuffles a
generation batch and splits it into ``steps_per_generation`` slices; each slice carries its rows' local indices
(``ROLLOUT_KEY``) and is measured in the grad-enabled ``_get_per_token_logps_and_entropies`` of its first pass, whose
weights are the generating policy's. The model's own kernels compute the loss; the probe adds a detached measurement
beside them (``trl_mdi.attention.probe``). Once the batch's last slice has trained, its signals go into the metrics
and its rows into the live logs (``PendingMeasurement`` in ``trl_mdi.records``). Where this runs is decided at start
(``trl_mdi.drop_in.probe_placement``).
"""

from __future__ import annotations

from typing import Any

import torch

from .records import BatchRecord, PendingMeasurement, PolicyForward

ROLLOUT_KEY = "trl_mdi_rollout"  # (B,) local row indices carried through TRL's shuffle and split into slices


class TrainingForwardProbe:
    """Needs the trainer's ``_pending`` (None between batches), ``accelerator``, ``live_logs``, ``_maybe_probe``,
    ``_attach_signals`` and ``_write_live_logs``."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # Popped, so that a slice is measured once: at its first pass (later passes reuse the buffered dict).
        rows = inputs.pop(ROLLOUT_KEY, None)
        pending = self._pending
        if rows is None or pending is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        pending.active_rows = rows.tolist()
        try:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            pending.active_rows = None
        if pending.complete:
            self._pending = None
            self._finish_measurement(pending)
        return loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        pending = self._pending
        if pending is None or pending.active_rows is None or not torch.is_grad_enabled():
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              *args, **kwargs)
        with self._maybe_probe(pending.slice_map_rows(), logits_to_keep) as state:
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                             *args, **kwargs)
        pending.parts.append((pending.active_rows, state.result()))
        pending.active_rows = None  # one forward per slice
        return out

    def _measure_in_training(self, out: dict[str, Any], step: int, inputs: list[dict], record: BatchRecord) -> None:
        """Tag TRL's output with row indices and hold the batch until its slices have been measured."""
        out[ROLLOUT_KEY] = torch.arange(len(inputs), device=out["advantages"].device)  # survives TRL's shuffle
        kept = {"advantages": self.accelerator.gather(out["advantages"]), "completion_ids": out["completion_ids"],
                "completion_mask": out["completion_mask"]}
        self._pending = PendingMeasurement(step, inputs, record, kept)

    def _finish_measurement(self, pending: PendingMeasurement) -> None:
        """A batch measured in the training forward: its signals into the metrics, then its live logs (all ranks)."""
        pending.record.forward = PolicyForward(attention=pending.attention())
        pending.record.scored.signals = self._attach_signals(pending.record.forward.attention, pending.inputs, "train")
        if self.live_logs is not None:
            self._write_live_logs(pending.step, pending.inputs, pending.record, pending.out)
