"""Per-layer attention pictures from plain arrays: MDI by layer (log scale, one line per model, with a spread band)
and the stacked attention masses by layer.

Used by ``python -m trl_mdi.profile`` (``mdi_by_layer.png``, ``mass_by_layer.png``) and meant for any other caller
that has per-layer numbers (the training log's per-step picture): the inputs are plain sequences of floats, never
tensors or probe results, so a caller converts once and this module knows nothing about models. matplotlib is
imported on first use, and figures are drawn on a ``Figure`` of their own (no pyplot state), so drawing from a
training loop or a thread touches no global backend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

# Stacked masses, bottom to top: the image first, so its share reads off the x axis directly.
MASS_GROUPS = (("image", "image", "#d95f02"), ("prompt_text", "prompt text", "#7570b3"),
               ("completion", "completion", "#1b9e77"), ("special", "special / system", "#bbbbbb"))


def _finite_positive(values: Sequence[float] | None) -> list[float]:
    """Values a log axis can show; NaN (no measurement), inf (image mass 0) and <= 0 become NaN gaps."""
    if values is None:
        return []
    return [float(v) if v is not None and math.isfinite(float(v)) and float(v) > 0 else math.nan for v in values]


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def plot_mdi_by_layer(profiles: Mapping[str, Mapping[str, Sequence[float]]], path: str | Path, *,
                      title: str | None = None) -> Path:
    """Draw MDI per layer, one line per model, on a log axis, and save a PNG to ``path``.

    ``profiles`` maps a label (the legend entry) to plain arrays of equal length:

    * ``"layers"``: the layer indices (x);
    * ``"mdi"``: MDI per layer, ``MDI = (A_T / n_T) / (A_O / n_O)`` (> 1: text dominates, < 1: the image does);
    * ``"low"`` / ``"high"`` (optional): the spread drawn as a band around the line, e.g. the 25th and 75th
      percentiles of the per-row MDI.

    NaN (a layer without a measurement) and ``inf`` (image mass exactly 0) leave a gap rather than a made-up point.
    A dashed line marks MDI = 1 (attention per token equal for text and image). Returns ``Path(path)``.
    """
    fig = _figure(7.0, 4.2)
    ax = fig.add_subplot()
    drawn = 0
    for label, curve in profiles.items():
        layers = [int(i) for i in curve["layers"]]
        mdi = _finite_positive(curve["mdi"])
        if len(mdi) != len(layers):
            raise ValueError(f"{label!r}: {len(layers)} layers but {len(mdi)} MDI values")
        line = ax.plot(layers, mdi, marker="o", markersize=4, linewidth=1.8, label=label)[0]
        low, high = _finite_positive(curve.get("low")), _finite_positive(curve.get("high"))
        if low and high:
            ax.fill_between(layers, low, high, color=line.get_color(), alpha=0.18, linewidth=0)
        drawn += sum(math.isfinite(v) for v in mdi)
    ax.axhline(1.0, color="0.35", linestyle="--", linewidth=1.0)
    if drawn:
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        # Plain numbers (0.7, 2), not 7x10^-1, and MDI = 1 always in view: above it text dominates, below the image.
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        lo, hi = ax.get_ylim()
        ax.set_ylim(min(lo, 1 / 1.1), max(hi, 1.1))
    ax.set_xlabel("text layer")
    ax.set_ylabel("MDI (log scale)")
    ax.set_title(title or "Modality dominance by layer (band: 25th-75th percentile of rows)", fontsize=10)
    ax.annotate("text dominates", xy=(0.005, 0.98), xycoords="axes fraction", va="top", fontsize=8, color="0.35")
    ax.annotate("image dominates", xy=(0.005, 0.02), xycoords="axes fraction", va="bottom", fontsize=8,
                color="0.35")
    ax.grid(True, which="major", alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)
    if profiles:
        ax.legend(fontsize=8, loc="best")
    return _save(fig, path)


def plot_mass_by_layer(profiles: Mapping[str, Mapping[str, Sequence[float]]], path: str | Path, *,
                       title: str | None = None) -> Path:
    """Draw, per model, the attention mass of each layer stacked by key group, and save a PNG to ``path``.

    ``profiles`` maps a label (one panel each) to plain arrays of equal length: ``"layers"`` and the mean masses
    ``"image"``, ``"prompt_text"``, ``"completion"`` and optionally ``"special"``; per layer they sum to 1. NaN
    (an unmeasured layer) draws no bar. Returns ``Path(path)``.
    """
    n = max(len(profiles), 1)
    fig = _figure(min(max(3.2 * n + 1.5, 5.5), 16.0), 4.0)
    axes = fig.subplots(1, n, sharey=True, squeeze=False)[0]
    for ax, (label, curve) in zip(axes, profiles.items()):
        layers = [int(i) for i in curve["layers"]]
        bottom = [0.0] * len(layers)
        for key, name, colour in MASS_GROUPS:
            if key not in curve:
                continue
            values = [float(v) if v is not None and math.isfinite(float(v)) else 0.0 for v in curve[key]]
            if key == "special" and not any(values):
                continue  # zero unless special tokens were split from text: no legend entry for nothing
            ax.bar(layers, values, bottom=bottom, color=colour, label=name, width=0.8)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("text layer")
        ax.set_ylim(0, 1.0)
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0].set_ylabel("attention mass of the measured queries")
    if profiles:  # below the panels, where it hides no bar
        handles, names = axes[0].get_legend_handles_labels()
        fig.legend(handles, names, loc="outside lower center", ncols=len(names), fontsize=8, frameon=False)
    fig.suptitle(title or "Where the measured tokens look, by layer", fontsize=10)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
