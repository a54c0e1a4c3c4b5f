"""Per-layer attention statistics from the probe's per-row result: per layer and per segment, mean and spread over
rows, MDI as a ratio of means, the curves the plots draw, and the comparison of several models.

Pure functions of a ``ModalityAttention`` (and of their own outputs), so both readers import them from here without
importing each other: the profile command (``trl_mdi.profile``) and the trainer's live logs
(``trl_mdi.diagnostics.live``).

Which rows count. The rows that carry an MDI are the *measured* ones: at least one measured query and at least one
image key. Rows without image tokens have no MDI (the index is undefined there) and rows without a measured query
have no mass at all; both are counted, never averaged in.

The aggregate MDI of a layer (or segment) over rows is the project's convention, a ratio of means:

    MDI = (mean_r A_T / mean_r n_T) / (mean_r A_O / mean_r n_O)

with A_T, A_O the prompt-text and image masses of row r and n_T, n_O its key counts (``trl_mdi.attention.metrics``).
A row whose image mass is exactly 0 (a sliding window that hides every image key) enters the means with its 0, so
the aggregate stays finite; its own per-row MDI is +inf, which is counted (``rows_mdi_inf``) and left out of the
per-row spread (25th / 50th / 75th percentiles of the finite per-row MDIs) instead of being averaged as inf.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..signals import as_python
from . import metrics as M
from .result import ModalityAttention


def _summary(a_t: torch.Tensor, a_o: torch.Tensor, a_c: torch.Tensor, n_t: torch.Tensor, n_o: torch.Tensor) -> dict:
    """Mean and spread over rows of one layer (or segment): per-row masses (R,) and key counts (R,)."""
    out: dict[str, Any] = {"rows": int(a_t.numel())}
    for name, x in (("image", a_o), ("prompt_text", a_t), ("completion", a_c)):
        x = x.double()
        out[name] = as_python(x.mean()) if x.numel() else None
        out[f"{name}_std"] = as_python(x.std(unbiased=False)) if x.numel() else None
    if not a_t.numel():
        return {**out, "mdi": None, "aei_text": None, "aei_image": None, "rows_mdi_inf": 0, "mdi_p25": None,
                "mdi_median": None, "mdi_p75": None, "aei_image_std": None}
    mean = lambda x: x.double().mean().reshape(1)  # noqa: E731
    out["mdi"] = as_python(M.mdi(mean(a_t), mean(a_o), mean(n_t), mean(n_o))[0])
    aei_t, aei_o = M.aei(mean(a_t), mean(a_o), mean(n_t), mean(n_o))
    out["aei_text"], out["aei_image"] = as_python(aei_t[0]), as_python(aei_o[0])
    per_row = M.mdi(a_t, a_o, n_t, n_o).double()
    out["rows_mdi_inf"] = int(torch.isinf(per_row).sum())
    finite = per_row[torch.isfinite(per_row)]
    q = torch.quantile(finite, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)) if finite.numel() else None
    out["mdi_p25"], out["mdi_median"], out["mdi_p75"] = (None, None, None) if q is None else map(as_python, q)
    row_aei_o = M.aei(a_t, a_o, n_t, n_o)[1].double()
    row_aei_o = row_aei_o[torch.isfinite(row_aei_o)]
    out["aei_image_std"] = as_python(row_aei_o.std(unbiased=False)) if row_aei_o.numel() else None
    return out


def row_counts(att: ModalityAttention) -> dict[str, int]:
    """How many rows were profiled, and how many carry an MDI, have no image token, or had no measured query."""
    valid, has_image = att.valid, att.has_image
    return {"profiled": int(valid.numel()), "measured": int((valid & has_image).sum()),
            "without_image_tokens": int((valid & ~has_image).sum()), "unmeasured": int((~valid).sum())}


def layer_profile(att: ModalityAttention, segments: str | dict | None = "thirds") -> dict[str, Any]:
    """Per measured layer and per segment: masses (mean, std), MDI (ratio of means), per-row MDI quartiles, the
    number of rows whose image mass is 0 there, and AEI (text, image), over the measured rows (see module doc)."""
    rows = att.valid & att.has_image
    a_t, a_o, a_c = att.prompt_text[rows], att.image[rows], att.completion[rows]
    n_t, n_o = att.n_prompt_text[rows], att.n_image[rows]
    layers = [{"layer": i, **_summary(a_t[:, i], a_o[:, i], a_c[:, i], n_t, n_o)} for i in att.layers]
    segs = {}
    for name, idx in att.segments(segments).items():
        seg = [M.segment_mean(x, idx) for x in (a_t, a_o, a_c)]
        segs[name] = {"layers": idx, **_summary(*seg, n_t, n_o)}
    return {"num_layers": att.num_layers, "measured_layers": att.layers, "rows": row_counts(att),
            "mean_image_tokens": as_python(n_o.double().mean()) if n_o.numel() else None,
            "mean_prompt_text_tokens": as_python(n_t.double().mean()) if n_t.numel() else None,
            "mean_measured_queries": as_python(att.n_queries[rows].double().mean()) if rows.any() else None,
            "layers": layers, "segments": segs}


def mdi_curve(profile: dict[str, Any]) -> dict[str, list[float]]:
    """The plain arrays ``trl_mdi.diagnostics.plots.plot_mdi_by_layer`` draws, from a ``layer_profile``: layers, MDI,
    and the per-row 25th / 75th percentiles as the band (None -> NaN)."""
    return _curves(profile, mdi="mdi", low="mdi_p25", high="mdi_p75")


def mass_curve(profile: dict[str, Any]) -> dict[str, list[float]]:
    """The plain arrays ``trl_mdi.diagnostics.plots.plot_mass_by_layer`` draws, from a ``layer_profile``."""
    return _curves(profile, image="image", prompt_text="prompt_text", completion="completion")


def _curves(profile: dict[str, Any], **columns: str) -> dict[str, list[float]]:
    """``layers`` and, per name, the per-layer column ``columns[name]`` of a ``layer_profile`` (None -> NaN)."""
    rows = profile["layers"]
    return {"layers": [r["layer"] for r in rows],
            **{name: [math.nan if r[key] is None else float(r[key]) for r in rows] for name, key in columns.items()}}


def _ratio(a, b) -> float | None:
    return None if a is None or b is None or b == 0 or math.isinf(b) else a / b


def compare(profiles: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every model against the first: per layer when all have the same measured layers (same depth), else by the
    segments they all have. Differences are ``model - first`` for masses and ``model / first`` for MDI (a ratio,
    as MDI is read on a log scale)."""
    labels = list(profiles)
    if len(labels) < 2:
        return {}
    base_label, base = labels[0], profiles[labels[0]]
    same_depth = all(p["num_layers"] == base["num_layers"] and p["measured_layers"] == base["measured_layers"]
                     for p in profiles.values())
    common = [s for s in base["segments"] if all(s in p["segments"] for p in profiles.values())]

    def diff(a: dict, b: dict) -> dict:
        d = lambda k: None if a[k] is None or b[k] is None else b[k] - a[k]  # noqa: E731
        return {"image": d("image"), "prompt_text": d("prompt_text"), "completion": d("completion"),
                "mdi_base": a["mdi"], "mdi": b["mdi"], "mdi_ratio": _ratio(b["mdi"], a["mdi"])}

    out: dict[str, Any] = {"base": base_label, "by": "layer" if same_depth else "segment", "models": {}}
    for label in labels[1:]:
        p = profiles[label]
        entry = {"segments": {s: diff(base["segments"][s], p["segments"][s]) for s in common}}
        if same_depth:
            entry["layers"] = [{"layer": a["layer"], **diff(a, b)} for a, b in zip(base["layers"], p["layers"])]
        out["models"][label] = entry
    return out
