"""The probe's result: ``ModalityAttention``, and the key groups it reports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import metrics as M

GROUPS = ("image", "prompt_text", "completion", "special")
IMAGE, PROMPT_TEXT, COMPLETION, SPECIAL = range(len(GROUPS))


# --------------------------------------------------------------------------------------------------
# Result
# --------------------------------------------------------------------------------------------------
@dataclass
class ModalityAttention:
    """Per-row, per-layer attention mass of the measured queries on each key group.

    Masses are averaged over heads, then over the row's measured query tokens. For each layer and valid
    row, ``image + prompt_text + completion + special == 1``. ``special`` is zero unless special tokens
    and the system prompt were excluded from text (``text_keys="content"``).

    Attributes:
        image, prompt_text, completion, special: float32 tensors of shape (B, num_layers).
        n_image, n_prompt_text, n_special, n_completion: key counts per row, shape (B,).
        n_queries: measured query tokens per row, shape (B,). Rows with 0 are invalid: their masses are
            NaN and ``valid`` is False.
        image_token_mass: for rows listed in ``image_map_rows`` when measuring, a dict
            row -> (num_layers, n_image) tensor of the mass on each individual image token (attention maps).
        measured_layers: indices of the layers that were measured (their attention function ran): every
            softmax-attention layer. A hybrid model's linear-attention layers have no attention weights: their
            masses are NaN and every segment, ``"all"`` included, is formed over the measured layers only.
            ``None`` (a result built by hand) means every layer.
        query_image_mass: when asked for (``token_segment`` / ``token_layers``), (B, L): at every measured query
            and at the position just before each, that position's attention mass on image keys, averaged over heads
            and over ``token_layers``; 0 elsewhere. Position p's logits choose token p + 1, so
            ``query_image_mass[:, p - 1]`` is how much the model looked at the image when it chose token p
            (``completion_image_attention`` aligns it to the completion).
    """

    image: torch.Tensor
    prompt_text: torch.Tensor
    completion: torch.Tensor
    special: torch.Tensor
    n_image: torch.Tensor
    n_prompt_text: torch.Tensor
    n_special: torch.Tensor
    n_completion: torch.Tensor
    n_queries: torch.Tensor
    image_token_mass: dict[int, torch.Tensor] = field(default_factory=dict)
    measured_layers: tuple[int, ...] | None = None
    query_image_mass: torch.Tensor | None = None  # (B, L) per query token, mean over heads and token_layers
    token_layers: tuple[int, ...] | None = None

    @property
    def num_layers(self) -> int:
        return self.image.shape[1]

    @property
    def layers(self) -> list[int]:
        """The measured layer indices (every layer when ``measured_layers`` is None)."""
        return list(range(self.num_layers)) if self.measured_layers is None else list(self.measured_layers)

    def segments(self, spec: str | dict | None = None) -> dict[str, list[int]]:
        """``{segment: measured layers}`` for this result (see :func:`trl_mdi.metrics.layer_segments`)."""
        return M.layer_segments(self.num_layers, spec, self.layers)

    def image_blind_layers(self) -> torch.Tensor:
        """Per row, measured layers where the image gets exactly zero attention though the row has image keys.

        A sliding-window layer whose window hides every image key from the measured queries (long prompts, Gemma 3)
        has image mass 0 by construction; a segment made of such layers only has MDI = +inf. (B,) long.
        """
        image = self.image[:, self.layers]
        blind = (image == 0) & self.has_image[:, None] & self.valid[:, None]
        return blind.sum(dim=1)

    @property
    def valid(self) -> torch.Tensor:
        """Rows that had at least one measured query token."""
        return self.n_queries > 0

    @property
    def has_image(self) -> torch.Tensor:
        return self.n_image > 0

    def segment_metrics(self, segments: str | dict | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """MDI / AEI per layer segment (see :func:`trl_mdi.metrics.segment_metrics`); text = prompt text."""
        seg = self.segments(segments)
        return M.segment_metrics(self.prompt_text, self.image, self.n_prompt_text, self.n_image, seg)

    def completion_image_attention(self, completion_length: int) -> torch.Tensor:
        """(B, C): per completion token t of a forward whose last C positions are the completion, the image mass of
        the position that chose it, ``a_t = query_image_mass[:, L - C - 1 + t]`` (heads and ``token_layers``
        averaged). Values at padded completion positions mean nothing: mask with the completion mask. The attention
        perception signal of TPRL (``perception_signal="attention"``)."""
        if self.query_image_mass is None:
            raise ValueError("no per-token image mass was measured: pass token_segment / token_layers to the probe")
        length = self.query_image_mass.shape[1]
        if not 0 < completion_length < length:
            raise ValueError(f"completion_length must be in [1, {length - 1}], got {completion_length}")
        return self.query_image_mass[:, length - completion_length - 1 : length - 1]

    @staticmethod
    def _row_fields() -> list[str]:
        """The fields indexed by row alone (the rest: maps keyed by row, per-layer facts, the optional (B, L) map)."""
        extras = ("image_token_mass", "measured_layers", "query_image_mass", "token_layers")
        return [f for f in ModalityAttention.__dataclass_fields__ if f not in extras]

    def take(self, rows: Sequence[int]) -> ModalityAttention:
        """The result for ``rows`` (new row i = old row ``rows[i]``), attention maps re-keyed to the new rows."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        new_of = {int(old): new for new, old in enumerate(index.tolist())}
        names = ModalityAttention._row_fields()
        return ModalityAttention(
            **{n: getattr(self, n)[index] for n in names},
            image_token_mass={new_of[k]: v for k, v in self.image_token_mass.items() if k in new_of},
            measured_layers=self.measured_layers, token_layers=self.token_layers,
            query_image_mass=self.query_image_mass[index] if self.query_image_mass is not None else None,
        )

    @staticmethod
    def cat(parts: Sequence[ModalityAttention]) -> ModalityAttention:
        """Concatenate results along the batch (row indices of attention maps are shifted)."""
        maps: dict[int, torch.Tensor] = {}
        offset = 0
        for p in parts:
            maps.update({offset + k: v for k, v in p.image_token_mass.items()})
            offset += p.image.shape[0]
        measured = {p.measured_layers for p in parts}
        if len(measured) > 1:
            raise ValueError(f"cannot concatenate results measured on different layers: {sorted(measured, key=str)}")
        names = ModalityAttention._row_fields()
        tokens = None
        if all(p.query_image_mass is not None for p in parts):
            width = max(p.query_image_mass.shape[1] for p in parts)
            tokens = torch.cat([torch.nn.functional.pad(p.query_image_mass, (0, width - p.query_image_mass.shape[1]))
                                for p in parts])
        return ModalityAttention(
            **{n: torch.cat([getattr(p, n) for p in parts]) for n in names}, image_token_mass=maps,
            measured_layers=measured.pop(), query_image_mass=tokens,
            token_layers=parts[0].token_layers if tokens is not None else None,
        )
