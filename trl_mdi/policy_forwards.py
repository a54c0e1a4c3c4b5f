"""The forwards MDIGRPOTrainer runs on its own, beside TRL's: the probe forward and the perturbed-image forward.

A mixin of the trainer (``class MDIGRPOTrainer(PolicyForwards, GRPOTrainer)``), so ``super()`` here is
GRPOTrainer: both forwards go through TRL's own log-prob path (same chunking, fused LM head, multimodal inputs),
never through the trainer's override of it. Each runs no-grad, on every process (ZeRO-3 gathers need all ranks),
inside a forked RNG (observing never changes the run). The trainer decides *when* they run; this module is *how*.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from trl.models.utils import disable_gradient_checkpointing

from .attention import probe_attention, trailing_completion_layout
from .data.images import row_images
from .forward import fit_width, rebuild_forward_inputs, rng_untouched
from .records import PolicyForward
from .tprl import perturb_images, token_visual_dependency


class PolicyForwards:
    """Needs the GRPOTrainer attributes it reads: model, args, accelerator, state, processing_class, _tokenizer,
    chat_template_kwargs, and the trainer's _mode(), _image_ids and _token_layers."""

    def _policy_forward_inputs(self, inputs, prompts, completion_ids_list) -> dict[str, Any]:
        return rebuild_forward_inputs(self.processing_class, self._tokenizer.pad_token_id, self.chat_template_kwargs,
                                      inputs, prompts, completion_ids_list, self.accelerator.device)

    @contextlib.contextmanager
    def _maybe_probe(self, map_rows: list[int], completion_length: int):
        if not self.args.compute_attention_metrics:
            yield None
            return
        tokenizer = self._tokenizer if self.args.attention_text_keys == "content" else None
        layout = trailing_completion_layout(completion_length, self._image_ids, tokenizer)
        with probe_attention(self.model, layout, map_rows, self._token_layers) as state:
            yield state

    def _measured_forward(self, state, completion_length: int, logps=None, entropies=None) -> PolicyForward:
        """What a probed policy forward gives: the attention result and, when TPRL ranks by attention, a_t (B, C)."""
        attention = state.result() if state is not None else None
        image_attention = None
        if attention is not None and attention.query_image_mass is not None:
            image_attention = attention.completion_image_attention(completion_length)
        return PolicyForward(attention=attention, logps=logps, entropies=entropies, image_attention=image_attention)

    def _policy_logps(self, fwd: dict[str, Any], compute_entropy: bool = False):
        """One no-grad policy forward through TRL's own log-prob path (same chunking, fused head).

        It runs in the model's current mode, as TRL's own old-log-prob forward does (so with dropout > 0 it draws
        dropout masks), inside a forked RNG: the random stream the training step sees afterwards is the one it would
        have seen without this forward, so observing never changes the run.
        """
        fwd = dict(fwd)
        batch_size = (self.args.per_device_train_batch_size if self._mode() == "train"
                      else self.args.per_device_eval_batch_size)
        input_ids, attention_mask, c_len = fwd.pop("input_ids"), fwd.pop("attention_mask"), fwd.pop("logits_to_keep")
        # Every rank runs this forward (same number of chunks): ZeRO-3 needs all ranks in every gather.
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs), \
                rng_untouched(self.accelerator.device):
            logps, entropies, _ = super()._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, c_len, batch_size=batch_size, compute_entropy=compute_entropy,
                **fwd,
            )
        return logps, entropies

    def _scoring_forward(self, map_rows: list[int], fwd: dict[str, Any]) -> PolicyForward:
        """The one extra no-grad forward: attention probe (with a_t for TPRL by attention) and, when TPRL needs them,
        log-probs under the real image (the perturbation signal) and entropies (the entropy filter)."""
        completion_length = fwd["logits_to_keep"]
        needs_head = self.args.uses_perturbed_forward or self.args.enable_entropy_filtering
        if not needs_head:
            # Only attention is wanted (masses, a_t): let the LM head score one position per row instead of the whole
            # completion (TRL's fused head skips positions whose label is -100). At Qwen's 152k vocabulary the head
            # is about a tenth of the forward's FLOPs; the probe still measures every completion token.
            fwd = {**fwd, "logits_to_keep": 1}
        with self._maybe_probe(map_rows, completion_length) as state:
            logps, entropies = self._policy_logps(fwd, compute_entropy=self.args.enable_entropy_filtering)
        if not needs_head:
            return self._measured_forward(state, completion_length)
        return self._measured_forward(state, completion_length, logps, entropies)

    def _visual_dependency(self, inputs, prompts, completion_ids_list, logps: torch.Tensor,
                           has_image: torch.Tensor) -> torch.Tensor:
        """s_t from one no-grad forward with perturbed images (the only other forward TPRL adds)."""
        a = self.args
        rows = [row_images(x) for x in inputs]
        step = self.state.global_step if self.model.training else 10**9 + self.state.global_step
        perturbed = perturb_images(
            rows, a.perception_perturbation, seed=a.perturbation_seed, step=step,
            row_offset=self.accelerator.process_index * len(inputs), patch_size=a.perturbation_patch_size,
            prob=a.perturbation_prob, noise_std=a.perturbation_noise_std, blur_radius=a.perturbation_blur_radius,
        )
        aug_inputs = [{**x, "images": imgs} for x, imgs in zip(inputs, perturbed)]
        aug_logps, _ = self._policy_logps(self._policy_forward_inputs(aug_inputs, prompts, completion_ids_list))
        s_t = token_visual_dependency(fit_width(logps, aug_logps.shape[1]), aug_logps)
        # Rows without an image have no visual dependency to measure: 0, and the masks leave them unfiltered.
        return s_t * has_image.to(s_t.device)[:, None]
