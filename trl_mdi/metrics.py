"""Modality-attention metrics as pure tensor functions: MDI, AEI, MDI balance, layer segments.

Definitions (Wu et al., "When Language Overrules", arXiv 2508.10552), per rollout and per layer:

    A_T, A_O   attention mass the measured query tokens put on text keys T and on image keys O
               (averaged over heads, then over query tokens)
    n_T, n_O   number of text keys and of image keys

    P_T   = A_T / (A_T + A_O)                  attention share of text
    Q_T   = n_T / (n_T + n_O)                  token share of text
    AEI_T = P_T / Q_T,  AEI_O = P_O / Q_O      attention efficiency (1 = proportional to token count)
    MDI   = (A_T / n_T) / (A_O / n_O) = AEI_T / AEI_O
            > 1: text dominates, < 1: vision dominates

Layer segments: masses are averaged over the layers of a segment first, then the ratios are taken
(a ratio of means is stable; a mean of per-layer ratios is dominated by the layer with the least image
attention). Rows without image tokens have no MDI: NaN, never a made-up 1.0.

Everything here works on tensors of any leading shape and never reads a model.
"""

from __future__ import annotations

import math
import re

import torch

DEFAULT_SEGMENTS = "thirds"
SEGMENT_NAMES_THIRDS = ("early", "middle", "late")


def layer_segments(num_layers: int, spec: str | dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Map segment names to layer indices, always including ``"all"``.

    ``spec`` is one of:
      * ``"thirds"`` (default): early / middle / late as three contiguous, near-equal blocks
        (sizes differ by at most one; with fewer than 3 layers a segment may be empty and is dropped);
      * a string ``"early:0-3,middle:4-7,late:8-11"`` of inclusive layer ranges (negative indices count
        from the end, ``"late:-4--1"``) or single layers (``"first:0"``);
      * a dict ``{name: [layer indices]}``.

    Raises ValueError naming the bad part when an index is out of range or a segment is empty.

    >>> layer_segments(7)
    {'early': [0, 1], 'middle': [2, 3, 4], 'late': [5, 6], 'all': [0, 1, 2, 3, 4, 5, 6]}
    >>> layer_segments(12, "early:0-1,late:-2--1")["late"]
    [10, 11]
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    spec = DEFAULT_SEGMENTS if spec is None else spec
    segments: dict[str, list[int]] = {}
    if isinstance(spec, dict):
        segments = {str(k): [int(i) for i in v] for k, v in spec.items()}
    elif spec == "thirds":
        bounds = [round(num_layers * k / 3) for k in range(4)]
        for name, lo, hi in zip(SEGMENT_NAMES_THIRDS, bounds[:-1], bounds[1:]):
            if hi > lo:
                segments[name] = list(range(lo, hi))
    elif isinstance(spec, str):
        for part in filter(None, (p.strip() for p in spec.split(","))):
            m = re.fullmatch(r"([A-Za-z_][\w]*):(-?\d+)(?:-(-?\d+))?", part)
            if not m:
                raise ValueError(
                    f"bad layer segment {part!r} in {spec!r}: expected 'name:first-last' (inclusive) or "
                    f"'name:index', e.g. 'early:0-3,middle:4-7,late:8-11', or 'thirds'"
                )
            lo = int(m.group(2))
            hi = int(m.group(3)) if m.group(3) is not None else lo
            lo, hi = (lo + num_layers if lo < 0 else lo), (hi + num_layers if hi < 0 else hi)
            segments[m.group(1)] = list(range(lo, hi + 1))
    else:
        raise TypeError(f"layer segment spec must be 'thirds', a string or a dict, got {type(spec).__name__}")
    for name, layers in segments.items():
        if name == "all":
            raise ValueError("segment name 'all' is reserved: it always covers every layer")
        if not layers:
            raise ValueError(f"layer segment {name!r} is empty (model has {num_layers} layers)")
        bad = [i for i in layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(
                f"layer segment {name!r} names layers {bad} but the model has {num_layers} layers (0-{num_layers - 1})"
            )
    segments["all"] = list(range(num_layers))
    return segments


def segment_mean(per_layer: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """Mean over the given layers of a (..., num_layers) tensor: ``mean_{l in layers} x[..., l]``."""
    return per_layer[..., layers].mean(dim=-1)


def aei(
    text_mass: torch.Tensor, image_mass: torch.Tensor, n_text: torch.Tensor, n_image: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention efficiency index of text and of image keys.

    ``AEI_T = P_T / Q_T`` and ``AEI_O = P_O / Q_O`` with ``P_T = A_T / (A_T + A_O)``,
    ``Q_T = n_T / (n_T + n_O)`` (and likewise for O). Rows without image tokens get NaN for both,
    as do rows whose text and image masses are both zero.

    >>> t, o = aei(torch.tensor([0.6]), torch.tensor([0.2]), torch.tensor([30]), torch.tensor([10]))
    >>> round(t.item(), 4), round(o.item(), 4)
    (1.0, 1.0)
    """
    text_mass, image_mass = text_mass.double(), image_mass.double()
    n_text, n_image = n_text.double(), n_image.double()
    total_mass = text_mass + image_mass
    total_tokens = n_text + n_image
    p_t, p_o = text_mass / total_mass, image_mass / total_mass
    q_t, q_o = n_text / total_tokens, n_image / total_tokens
    undefined = (n_image <= 0) | (n_text <= 0) | (total_mass <= 0)
    nan = torch.full_like(p_t, math.nan)
    return torch.where(undefined, nan, p_t / q_t).float(), torch.where(undefined, nan, p_o / q_o).float()


def mdi(
    text_mass: torch.Tensor, image_mass: torch.Tensor, n_text: torch.Tensor, n_image: torch.Tensor
) -> torch.Tensor:
    """Modality dominance index ``MDI = (A_T / n_T) / (A_O / n_O)``.

    NaN where there are no image tokens (or no text tokens): the index is undefined there and must not
    pose as balanced. ``+inf`` where image tokens exist but receive exactly zero attention.

    >>> mdi(torch.tensor([0.6, 0.5]), torch.tensor([0.2, 0.0]), torch.tensor([30, 10]), torch.tensor([10, 0]))
    tensor([1., nan])
    """
    text_mass, image_mass = text_mass.double(), image_mass.double()
    n_text, n_image = n_text.double(), n_image.double()
    value = (text_mass / n_text) / (image_mass / n_image)
    undefined = (n_image <= 0) | (n_text <= 0)
    return torch.where(undefined, torch.full_like(value, math.nan), value).float()


def mdi_balance(mdi_value: torch.Tensor, ratio: float = 2.0) -> torch.Tensor:
    """Balance score of the product brief: ``clip(1 - |log MDI| / log R, 0, 1)``.

    1 at MDI = 1 (attention per token equal for text and image), 0 for MDI outside ``(1/R, R)``.
    NaN stays NaN (no image: no balance). ``R`` must be > 1.

    >>> mdi_balance(torch.tensor([1.0, 2 ** 0.5, 4.0, float("nan")]), 2.0)
    tensor([1.0000, 0.5000, 0.0000,    nan])
    """
    if not ratio > 1.0:
        raise ValueError(f"mdi_balance ratio must be > 1, got {ratio}")
    score = 1.0 - mdi_value.double().log().abs() / math.log(ratio)
    return score.clamp(0.0, 1.0).float()


def segment_metrics(
    text_mass: torch.Tensor,
    image_mass: torch.Tensor,
    n_text: torch.Tensor,
    n_image: torch.Tensor,
    segments: dict[str, list[int]],
) -> dict[str, dict[str, torch.Tensor]]:
    """MDI and AEI per segment from per-layer masses of shape (B, num_layers) and counts of shape (B,).

    Returns ``{segment: {"mdi", "aei_text", "aei_image", "text_mass", "image_mass"}}``, each (B,).
    Masses are averaged over the segment's layers before the ratios are taken.
    """
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, layers in segments.items():
        a_t, a_o = segment_mean(text_mass, layers), segment_mean(image_mass, layers)
        aei_t, aei_o = aei(a_t, a_o, n_text, n_image)
        out[name] = {
            "mdi": mdi(a_t, a_o, n_text, n_image),
            "aei_text": aei_t,
            "aei_image": aei_o,
            "text_mass": a_t,
            "image_mass": a_o,
        }
    return out
