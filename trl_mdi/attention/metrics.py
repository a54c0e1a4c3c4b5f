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

Layer segments: masses are averaged over the measured layers of a segment first, then the ratios are
taken (a ratio of means is stable; a mean of per-layer ratios is dominated by the layer with the least
image attention). Only softmax-attention layers are measured: a hybrid model's linear-attention layers
have no attention weights and are left out of every segment. Rows without image tokens have no MDI: NaN,
never a made-up 1.0. A segment whose image mass is exactly 0 (a sliding window that hides every image key)
has MDI = +inf, which the balance reward scores as fully unbalanced.

Everything here works on tensors of any leading shape and never reads a model.
"""

from __future__ import annotations

import math
import re

import torch

DEFAULT_SEGMENTS = "thirds"
SEGMENT_NAMES_THIRDS = ("early", "middle", "late")


def _parse_segments(num_layers: int, spec: str | dict[str, list[int]] | None) -> dict[str, list[int]] | None:
    """Explicit segments in the model's layer numbering; None for ``"thirds"`` (formed over measured layers)."""
    spec = DEFAULT_SEGMENTS if spec is None else spec
    segments: dict[str, list[int]] = {}
    if isinstance(spec, dict):
        segments = {str(k): [int(i) for i in v] for k, v in spec.items()}
    elif spec == "thirds":
        return None
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
            if m.group(1) in segments:
                raise ValueError(f"layer segment {m.group(1)!r} appears twice in {spec!r}")
            segments[m.group(1)] = list(range(lo, hi + 1))
    else:
        raise TypeError(f"layer segment spec must be 'thirds', a string or a dict, got {type(spec).__name__}")
    for name, layers in segments.items():
        check_segment_name(name)
        if not layers:
            raise ValueError(f"layer segment {name!r} is empty (model has {num_layers} layers)")
        bad = [i for i in layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(
                f"layer segment {name!r} names layers {bad} but the model has {num_layers} layers (0-{num_layers - 1})"
            )
    return segments


def check_segment_name(name: str) -> None:
    """ValueError for the one name this module reserves: ``all`` is the segment of every measured layer.

    (Names that would collide with other per-rollout fields are refused by ``trl_mdi.signals``.)
    """
    if name == "all":
        raise ValueError("segment name 'all' is reserved: it always covers every measured layer")


def explicit_segment_names(spec: str | dict[str, list[int]] | None) -> list[str]:
    """The names an explicit spec declares ([] for ``"thirds"``, whose names depend on the layer count).

    >>> explicit_segment_names("early:0-3,late:-2--1"), explicit_segment_names("thirds")
    (['early', 'late'], [])
    """
    return list(_parse_segments(10**6, spec) or {})


def token_segment_layers(num_layers: int, spec, measured_layers: list[int], name: str) -> tuple[int, ...]:
    """The measured layers of segment ``name`` under ``spec``, for per-token image mass (the attention perception
    signal); a model without that segment (thirds of 1 or 2 measured layers, an explicit spec without it) falls back
    to ``all``, said in one warning.

    >>> token_segment_layers(6, "thirds", list(range(6)), "late")
    (4, 5)
    """
    import logging

    segments = layer_segments(num_layers, spec, measured_layers)
    if name not in segments:
        logging.getLogger("trl_mdi").warning(
            "the attention perception signal averages over segment %r, which this model does not have (segments: "
            "%s): using all measured layers (%s) instead", name, ", ".join(segments),
            ", ".join(map(str, segments["all"])))
        name = "all"
    return tuple(segments[name])


def layer_segments(
    num_layers: int, spec: str | dict[str, list[int]] | None = None, measured: list[int] | None = None
) -> dict[str, list[int]]:
    """Map segment names to the *measured* layer indices they average over, always including ``"all"``.

    ``measured`` lists the layers that carry a measurement (softmax-attention layers: a hybrid model's
    linear-attention layers have none); ``None`` means every layer. Indices are always the model's own.

    ``spec`` is one of:
      * ``"thirds"`` (default): early / middle / late as three contiguous, near-equal blocks *of the measured
        layers* (sizes differ by at most one). With 1 or 2 measured layers some thirds are empty and are
        left out (2 layers: early, late; 1 layer: middle), so only segments that exist are named;
      * a string ``"early:0-3,middle:4-7,late:8-11"`` of inclusive ranges in the model's layer numbering
        (negative indices count from the end, ``"late:-4--1"``) or single layers (``"first:0"``); unmeasured
        layers inside a range are skipped (``skipped_layers`` lists them);
      * a dict ``{name: [layer indices]}``.

    Raises ValueError naming the bad part when an index is out of range, a segment is empty, names only
    unmeasured layers, or its name is reserved (``RESERVED_SEGMENT_NAMES``).

    >>> layer_segments(7)
    {'early': [0, 1], 'middle': [2, 3, 4], 'late': [5, 6], 'all': [0, 1, 2, 3, 4, 5, 6]}
    >>> layer_segments(12, "early:0-1,late:-2--1")["late"]
    [10, 11]
    >>> layer_segments(2)
    {'early': [0], 'late': [1], 'all': [0, 1]}
    >>> layer_segments(8, measured=[3, 7])  # hybrid: full attention on every 4th layer
    {'early': [3], 'late': [7], 'all': [3, 7]}
    >>> layer_segments(8, "early:0-3,late:4-7", measured=[1, 3, 5, 7])
    {'early': [1, 3], 'late': [5, 7], 'all': [1, 3, 5, 7]}
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    measured = list(range(num_layers)) if measured is None else sorted(int(i) for i in measured)
    if not measured:
        raise ValueError(
            f"none of the model's {num_layers} text layers runs softmax attention, so no layer can be measured "
            "(a model made of linear-attention / recurrent layers only); turn compute_attention_metrics off"
        )
    explicit = _parse_segments(num_layers, spec)
    segments: dict[str, list[int]] = {}
    if explicit is None:  # thirds of the measured layers
        n = len(measured)
        bounds = [round(n * k / 3) for k in range(4)]
        for name, lo, hi in zip(SEGMENT_NAMES_THIRDS, bounds[:-1], bounds[1:]):
            if hi > lo:
                segments[name] = measured[lo:hi]
    else:
        keep = set(measured)
        for name, layers in explicit.items():
            kept = [i for i in layers if i in keep]
            if not kept:
                raise ValueError(
                    f"layer segment {name!r} names layers {layers}, none of which runs softmax attention (measured "
                    f"layers: {measured}); choose ranges that include some of them"
                )
            segments[name] = kept
    segments["all"] = measured
    return segments


def skipped_layers(num_layers: int, spec: str | dict[str, list[int]] | None, measured: list[int]) -> dict[str, list[int]]:
    """Per explicit segment, the unmeasured (e.g. linear-attention) layers its range names but cannot average.

    >>> skipped_layers(8, "early:0-3,late:4-7", measured=[1, 3, 5, 7])
    {'early': [0, 2], 'late': [4, 6]}
    >>> skipped_layers(8, "thirds", measured=[1, 3, 5, 7])
    {}
    """
    explicit = _parse_segments(num_layers, spec) or {}
    keep = set(measured)
    return {name: [i for i in layers if i not in keep] for name, layers in explicit.items()
            if any(i not in keep for i in layers)}


def segment_names(num_layers: int, spec: str | dict[str, list[int]] | None, measured: list[int] | None = None) -> list[str]:
    """The segment names a model really has (``"all"`` excluded): the one list metrics, reward fields and logs use.

    >>> segment_names(2, "thirds"), segment_names(1, "thirds"), segment_names(12, "thirds")
    (['early', 'late'], ['middle'], ['early', 'middle', 'late'])
    """
    return [n for n in layer_segments(num_layers, spec, measured) if n != "all"]


def check_segment_spec(spec: str | dict[str, list[int]] | None) -> None:
    """Syntax and names only, before the model is known (ranges are checked against the model later)."""
    _parse_segments(10**6, spec)


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
    """Balance score ``clip(1 - |log MDI| / log R, 0, 1)`` (docs/concepts.md).

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
