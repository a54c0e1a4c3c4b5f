"""The probe's result: ``ModalityAttention``, and the key groups it reports."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import metrics as M

GROUPS = ("image", "prompt_text", "completion", "special")
IMAGE, PROMPT_TEXT, COMPLETION, SPECIAL = range(len(GROUPS))


def as_python(value) -> float | None:
    """One value of a result for rewards, logs and JSON: a float, or None where undefined (NaN).

    >>> as_python(torch.tensor(0.5)), as_python(float("nan"))
    (0.5, None)
    """
    v = float(value)
    return None if math.isnan(v) else v


# --------------------------------------------------------------------------------------------------
# Result
# --------------------------------------------------------------------------------------------------
@dataclass
class ModalityAttention:
    """Per-row, per-layer attention mass of the measured queries on each key group.

    Masses are averaged over heads, then over the row's measured query tokens. For each layer and valid
    row, ``image + prompt_text + completion + special == 1``. ``special`` is zero unless special tokens
    and the system prompt were excluded from text (``text_keys="content"``).

    MDI, AEI and the balance per row: :meth:`rows` (one plain dict per row, the names reward functions receive);
    as (B,) tensors per layer segment: :meth:`segment_metrics`.

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
            (``attention_signal`` aligns it to the completion).
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
        """``{segment: measured layers}`` for this result (see :func:`trl_mdi.attention.metrics.layer_segments`)."""
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
        """MDI / AEI per layer segment (see :func:`trl_mdi.attention.metrics.segment_metrics`); text = prompt text."""
        seg = self.segments(segments)
        return M.segment_metrics(self.prompt_text, self.image, self.n_prompt_text, self.n_image, seg)

    def rows(self, segments: str | dict | None = "thirds", balance_ratio: float = 2.0) -> list[dict[str, float | None]]:
        """One plain dict per row: MDI and AEI per layer segment and the MDI balance, under the names a reward
        function receives them (the trainer's per-rollout fields, ``mdi_group_score`` aside: it needs the group).

        With T = prompt-text keys, O = image keys, A = attention mass averaged over the segment's measured layers
        (then the ratio is taken), n = number of keys, R = ``balance_ratio``::

            mdi_<seg>         MDI   = (A_T / n_T) / (A_O / n_O)          > 1: text dominates, < 1: the image does
            aei_text_<seg>    AEI_T = P_T / Q_T,  P_T = A_T / (A_T + A_O),  Q_T = n_T / (n_T + n_O)
            aei_image_<seg>   AEI_O = P_O / Q_O
            mdi_balance       clip(1 - |log MDI| / log R, 0, 1) of the MDI over all measured layers

        ``<seg>`` is each segment of ``segments`` (``"thirds"``: ``early``, ``middle``, ``late``; an explicit spec:
        its names); over all measured layers the name has no suffix (``mdi``, ``aei_text``, ``aei_image``). The values
        are those of :meth:`segment_metrics` and :func:`trl_mdi.attention.metrics.mdi_balance`, as Python floats;
        ``None`` where undefined (a row without image tokens, or without a measured query); MDI is ``inf`` where the
        image gets exactly zero attention in a segment (a sliding window hiding every image key), and an infinite
        ``mdi`` has balance 0.

        >>> res = ModalityAttention(
        ...     image=torch.tensor([[0.25] * 3, [0.0] * 3]), prompt_text=torch.tensor([[0.5] * 3, [0.75] * 3]),
        ...     completion=torch.full((2, 3), 0.25), special=torch.zeros(2, 3), n_image=torch.tensor([16, 0]),
        ...     n_prompt_text=torch.tensor([16, 20]), n_special=torch.tensor([0, 0]), n_completion=torch.tensor([4, 4]),
        ...     n_queries=torch.tensor([4, 4]))
        >>> first, no_image = res.rows()
        >>> first["mdi"], first["mdi_late"], round(first["aei_text_early"], 4), first["mdi_balance"]
        (2.0, 2.0, 1.3333, 0.0)
        >>> no_image["mdi"], no_image["aei_image_middle"], no_image["mdi_balance"]
        (None, None, None)
        >>> res.rows(balance_ratio=4.0)[0]["mdi_balance"]
        0.5
        """
        per_segment = self.segment_metrics(segments)
        every = per_segment.pop("all")
        table = {  # the order of the trainer's reward fields (trl_mdi.signals)
            "mdi": every["mdi"], **{f"mdi_{name}": m["mdi"] for name, m in per_segment.items()},
            "aei_text": every["aei_text"], "aei_image": every["aei_image"],
            **{f"aei_text_{name}": m["aei_text"] for name, m in per_segment.items()},
            **{f"aei_image_{name}": m["aei_image"] for name, m in per_segment.items()},
            "mdi_balance": M.mdi_balance(every["mdi"], balance_ratio),
        }
        names = list(table)
        columns = [table[n].tolist() for n in names]
        return [{n: None if math.isnan(v) else v for n, v in zip(names, row)} for row in zip(*columns)]

    def attention_signal(self, completion_length: int) -> torch.Tensor:
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
