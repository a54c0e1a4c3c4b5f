"""The probe's result: ``ModalityAttention``, and the key groups it reports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .. import metrics as M

GROUPS = ("image", "prompt_text", "completion", "special")
_IMAGE, _PROMPT_TEXT, _COMPLETION, _SPECIAL = range(len(GROUPS))


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

    @property
    def num_layers(self) -> int:
        return self.image.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """Rows that had at least one measured query token."""
        return self.n_queries > 0

    @property
    def has_image(self) -> torch.Tensor:
        return self.n_image > 0

    def segment_metrics(self, segments: str | dict | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """MDI / AEI per layer segment (see :func:`trl_mdi.metrics.segment_metrics`); text = prompt text."""
        seg = M.layer_segments(self.num_layers, segments)
        return M.segment_metrics(self.prompt_text, self.image, self.n_prompt_text, self.n_image, seg)

    def rows(self, segments: str | dict | None = None, balance_ratio: float = 2.0) -> list[dict[str, float | None]]:
        """Per-row plain-Python summaries (None where undefined), the form rewards and logs consume."""
        seg = self.segment_metrics(segments)
        balance = M.mdi_balance(seg["all"]["mdi"], balance_ratio)
        out = []
        for i in range(self.image.shape[0]):
            row: dict[str, float | None] = {}
            for name, vals in seg.items():
                row[f"mdi_{name}"] = _opt(vals["mdi"][i])
                row[f"aei_text_{name}"] = _opt(vals["aei_text"][i])
                row[f"aei_image_{name}"] = _opt(vals["aei_image"][i])
            row["mdi"] = row["mdi_all"]
            row["mdi_balance"] = _opt(balance[i])
            for g in GROUPS:
                row[f"{g}_mass"] = _opt(getattr(self, g)[i].mean())
            row["n_image"] = int(self.n_image[i])
            row["n_prompt_text"] = int(self.n_prompt_text[i])
            row["n_special"] = int(self.n_special[i])
            row["n_completion"] = int(self.n_completion[i])
            row["n_queries"] = int(self.n_queries[i])
            out.append(row)
        return out

    @staticmethod
    def cat(parts: Sequence[ModalityAttention]) -> ModalityAttention:
        """Concatenate results along the batch (row indices of attention maps are shifted)."""
        maps: dict[int, torch.Tensor] = {}
        offset = 0
        for p in parts:
            maps.update({offset + k: v for k, v in p.image_token_mass.items()})
            offset += p.image.shape[0]
        names = [f for f in ModalityAttention.__dataclass_fields__ if f != "image_token_mass"]
        return ModalityAttention(
            **{n: torch.cat([getattr(p, n) for p in parts]) for n in names}, image_token_mass=maps
        )


def _opt(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if v != v else v  # NaN -> None
