"""Attention maps: what a live-log map is drawn from, and the PNG itself (per-image-token attention mass as a heat
map over the image, in matplotlib's viridis). numpy, PIL and matplotlib's colormaps; the probe result and the
processor are read, never imported.

A row's image tokens come one image after another, in the order of its images, each image's tokens row-major over
its token grid. The grid is known for these layouts (:func:`image_token_grids`):

- Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5: ``image_grid_thw = (1, gh, gw)`` per image, merged ``merge_size`` x
  ``merge_size`` into a ``(gh / merge, gw / merge)`` grid (:func:`token_grid_hw`): any size and aspect ratio.
- Gemma 3 without pan-and-scan: every image is resized to one square and pooled to ``image_seq_length`` tokens, a
  ``sqrt(n) x sqrt(n)`` grid (the projector average-pools the vision tower's row-major patch grid). PaliGemma alike,
  every SigLIP patch one token; Gemma 3n alike, MobileNet-v5's fusion adapter output flattened row-major.
- LLaVA 1.5 (``LlavaProcessor``): a centre-cropped square, ``crop / patch`` tokens a side (the projector maps the
  CLIP patch grid token by token); square images only, since the crop hides the rest of any other.
- Mistral 3 (``PixtralProcessor``): each image is resized to multiples of ``patch_size * spatial_merge_size`` pixels
  and written as rows of ``[IMG]`` tokens, each row closed by ``[IMG_BREAK]`` (the last by ``[IMG_END]``); the
  projector merges the patch grid row-major, so the image's ``[IMG]`` tokens, markers left out (they are text keys),
  are its ``(H / (patch * merge), W / (patch * merge))`` grid. GLM-4.1V is the Qwen layout (``image_grid_thw``),
  between its begin/end-of-image tokens.
- LFM2-VL (``Lfm2VlProcessor``): an image within its token budget is one view at its own aspect ratio, its SigLIP2
  patch grid (``spatial_shapes``) pixel-unshuffled ``downsample_factor`` x ``downsample_factor`` row-major: a
  ``spatial_shapes / downsample_factor`` grid between ``<|image_start|>`` and ``<|image_end|>``. A tiled image (over
  its budget: tiles and a thumbnail, each its own grid) gets no map.
- Ovis2 (``Ovis2Processor``): an image its one square covers is resized to it, one view whose ViT patch grid is folded
  ``hidden_stride`` x ``hidden_stride`` row-major: a ``sqrt(image_seq_length)`` square grid of ``<IMG_ATOM>`` tokens
  between ``<IMG_START>`` and ``<IMG_GRID>``. A cropped image (a thumbnail and crops, each its own grid) gets no map.

Other layouts (LLaVA-NeXT's and LLaVA-OneVision's any-resolution tiles with newline tokens, Idefics3's and SmolVLM's
image splitting, InternVL's tiles followed by a thumbnail, each its own grid, Gemma 4's variable budgets) are not a
single grid per image: those families are logged without maps rather than with wrong ones.

:func:`attention_map_records` cuts a rollout's masses (``ModalityAttention.image_token_mass[row]``, (layers, image
tokens)) per image (:func:`split_per_image`) and averages them per layer segment; :func:`render_image_maps` draws one
panel row per image, one panel per segment.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

_RESAMPLE = {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR}
_BAR = 18  # height of the title / caption bar and of the legend strip, in pixels


def colormap(values: np.ndarray) -> np.ndarray:
    """matplotlib's viridis as RGB (uint8, shape ``values.shape + (3,)``) of values in [0, 1] (clipped; NaN as 0)."""
    from matplotlib import colormaps  # here, not at the top: importing the trainer does not load matplotlib

    return colormaps["viridis"](np.clip(np.nan_to_num(values, nan=0.0), 0.0, 1.0), bytes=True)[..., :3]


def token_grid_hw(image_grid_thw: Sequence[int] | Any, merge_size: int = 2) -> tuple[int, int]:
    """Token grid (h, w) of one image from its ``image_grid_thw`` row (Qwen2-VL / 2.5-VL / 3-VL).

    >>> token_grid_hw([1, 8, 12])
    (4, 6)
    """
    t, gh, gw = (int(x) for x in (image_grid_thw.tolist() if hasattr(image_grid_thw, "tolist") else image_grid_thw))
    if t != 1:
        raise ValueError(f"image_grid_thw {t, gh, gw}: only still images (t == 1) have a 2-D token grid")
    if gh % merge_size or gw % merge_size:
        raise ValueError(f"image_grid_thw {t, gh, gw} is not divisible by merge_size {merge_size}")
    return gh // merge_size, gw // merge_size


def split_per_image(token_mass: Any, grid_hws: Sequence[tuple[int, int]]) -> list[Any]:
    """Cut a row's per-image-token masses (last dim = the row's image tokens, images one after another) into one
    slice per image, image k taking ``h_k * w_k`` tokens of its token grid ``grid_hws[k]``.

    Raises ValueError when the counts do not add up to the row's image tokens (a truncated prompt, or grids that
    are not this row's).

    >>> [t.tolist() for t in split_per_image(__import__("torch").arange(6.0), [(1, 2), (2, 2)])]
    [[0.0, 1.0], [2.0, 3.0, 4.0, 5.0]]
    """
    counts = [int(h) * int(w) for h, w in grid_hws]
    if sum(counts) != token_mass.shape[-1]:
        raise ValueError(f"the row has {token_mass.shape[-1]} image tokens but its images' token grids "
                         f"{list(grid_hws)} hold {sum(counts)}")
    return list(token_mass.split(counts, dim=-1))


def _mass_array(token_mass: Any, grid_hw: tuple[int, int]) -> np.ndarray:
    if hasattr(token_mass, "detach"):  # torch tensor
        token_mass = token_mass.detach().float().cpu().numpy()
    mass = np.asarray(token_mass, dtype=np.float64)
    h, w = (int(x) for x in grid_hw)
    if h <= 0 or w <= 0:
        raise ValueError(f"grid_hw must be two positive ints, got {grid_hw}")
    if mass.ndim != 1:
        raise ValueError(
            f"token_mass must be 1-D (n_image_tokens,), got shape {mass.shape}; average the per-layer maps of "
            "ModalityAttention.image_token_mass over layers first, e.g. mass[layers].mean(0)"
        )
    if mass.size != h * w:
        raise ValueError(
            f"token_mass has {mass.size} values but the token grid {h}x{w} has {h * w} tokens; for Qwen2.5-VL "
            "pass (grid_h // merge_size, grid_w // merge_size) of the image's image_grid_thw (token_grid_hw), "
            "and only this image's tokens"
        )
    return mass.reshape(h, w)


def display_size(size: tuple[int, int], min_side: int = 224, max_side: int = 512) -> tuple[int, int]:
    """Size the overlay is drawn at: the image size, scaled up until its short side is ``min_side`` and down
    until its long side is at most ``max_side`` (the cap wins), aspect ratio kept.

    >>> display_size((56, 56)), display_size((2048, 1024)), display_size((300, 400))
    ((224, 224), (512, 256), (300, 400))
    """
    w, h = size
    scale = 1.0
    if min(w, h) < min_side:
        scale = min_side / min(w, h)
    scale = min(scale, max_side / max(w, h)) if max(w, h) * scale > max_side else scale
    return max(1, round(w * scale)), max(1, round(h * scale))


def _overlay(image: Image.Image, grid: np.ndarray, size: tuple[int, int], lo: float, hi: float,
             alpha: float, resample: str) -> Image.Image:
    norm = (grid - lo) / (hi - lo) if hi > lo else np.full_like(grid, 0.5)
    heat = Image.fromarray(np.nan_to_num(norm, nan=0.0).astype(np.float32)).resize(size, _RESAMPLE[resample])
    heat_rgb = Image.fromarray(colormap(np.asarray(heat)))
    base = image.convert("RGB").resize(size, Image.Resampling.BICUBIC) if image.size != size else image.convert("RGB")
    return Image.blend(base, heat_rgb, alpha)


def _font() -> ImageFont.ImageFont:
    return ImageFont.load_default()


def _caption(width: int, text: str) -> Image.Image:
    bar = Image.new("RGB", (width, _BAR), (255, 255, 255))
    ImageDraw.Draw(bar).text((3, 3), text, fill=(0, 0, 0), font=_font())
    return bar


def _legend(width: int, lo: float, hi: float) -> Image.Image:
    """A strip: 'min <lo>' | viridis gradient | 'max <hi>'."""
    strip = Image.new("RGB", (width, _BAR), (255, 255, 255))
    draw = ImageDraw.Draw(strip)
    left, right = f"min {lo:.3g}", f"max {hi:.3g}"
    lw, rw = draw.textlength(left, font=_font()), draw.textlength(right, font=_font())
    x0, x1 = int(lw) + 6, width - int(rw) - 6
    if x1 - x0 >= 8:
        gradient = colormap(np.linspace(0, 1, x1 - x0))[None].repeat(_BAR - 8, axis=0)
        strip.paste(Image.fromarray(gradient), (x0, 4))
    draw.text((2, 3), left, fill=(0, 0, 0), font=_font())
    draw.text((width - rw - 2, 3), right, fill=(0, 0, 0), font=_font())
    return strip


def _stack(parts: list[Image.Image]) -> Image.Image:
    out = Image.new("RGB", (max(p.width for p in parts), sum(p.height for p in parts)), (255, 255, 255))
    y = 0
    for p in parts:
        out.paste(p, (0, y))
        y += p.height
    return out


def _save(img: Image.Image, out_path: str | os.PathLike) -> Path:
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    img.save(out_path, format="PNG", optimize=True)
    return out_path


def render_attention_map(image: Image.Image, token_mass: Any, grid_hw: tuple[int, int], out_path: str | os.PathLike,
                         title: str | None = None, *, alpha: float = 0.55, resample: str = "bilinear",
                         legend: bool = True, min_side: int = 224, max_side: int = 512) -> Path:
    """Save a PNG of ``image`` overlaid with the attention mass of its tokens; returns the path.

    ``token_mass`` (n_image_tokens,) is reshaped row-major to ``grid_hw`` (ValueError unless n == h*w),
    normalised to its own min/max, upsampled (``"bilinear"`` or ``"nearest"``) to the display size
    (:func:`display_size` of the image) and alpha-blended. Layout top to bottom: optional title bar, the overlay,
    optional legend strip with the min and max mass.
    """
    grid = _mass_array(token_mass, grid_hw)
    if resample not in _RESAMPLE:
        raise ValueError(f"resample must be one of {sorted(_RESAMPLE)}, got {resample!r}")
    size = display_size(image.size, min_side, max_side)
    lo, hi = float(np.nanmin(grid)), float(np.nanmax(grid))
    parts = [_caption(size[0], title)] if title else []
    parts.append(_overlay(image, grid, size, lo, hi, alpha, resample))
    if legend:
        parts.append(_legend(size[0], lo, hi))
    return _save(_stack(parts), out_path)


def render_segment_maps(image: Image.Image, masses_per_segment: Mapping[str, Any], grid_hw: tuple[int, int],
                        out_path: str | os.PathLike, title: str | None = None, *, shared_scale: bool = True,
                        alpha: float = 0.55, resample: str = "bilinear", legend: bool = True,
                        min_side: int = 160, max_side: int = 320, gap: int = 4) -> Path:
    """One panel per layer segment (``{"early": mass, "middle": ..., ...}``), side by side, captioned.

    With ``shared_scale`` every panel uses the same min/max (panels comparable; one legend); otherwise each panel
    is normalised on its own and gets its own legend. One image of :func:`render_image_maps`.
    """
    return render_image_maps([image], [masses_per_segment], [grid_hw], out_path, title, shared_scale=shared_scale,
                             alpha=alpha, resample=resample, legend=legend, min_side=min_side, max_side=max_side,
                             gap=gap)


def render_image_maps(images: Sequence[Image.Image], masses_per_image: Sequence[Mapping[str, Any]],
                      grid_hws: Sequence[tuple[int, int]], out_path: str | os.PathLike, title: str | None = None, *,
                      captions: Sequence[str] | None = None, shared_scale: bool = True, alpha: float = 0.55,
                      resample: str = "bilinear", legend: bool = True, min_side: int = 160, max_side: int = 320,
                      gap: int = 4) -> Path:
    """One panel row per image of a rollout (a multi-image prompt), one panel per layer segment in each row.

    ``masses_per_image[k]`` maps segment -> image k's token masses (see :func:`split_per_image`), ``grid_hws[k]``
    is its token grid and ``captions[k]`` an optional line above its row. With ``shared_scale`` every panel of
    every image uses the same min/max, so a hotter image is one that took more attention per token.
    """
    if not (len(images) == len(masses_per_image) == len(grid_hws)) or not images:
        raise ValueError(f"need one mass dict and one grid per image, got {len(images)} image(s), "
                         f"{len(masses_per_image)} mass dict(s), {len(grid_hws)} grid(s)")
    if any(not m for m in masses_per_image):
        raise ValueError("masses_per_segment is empty: nothing to render")
    if captions is not None and len(captions) != len(images):
        raise ValueError(f"need one caption per image, got {len(captions)} for {len(images)} image(s)")
    grids = [{name: _mass_array(m, hw) for name, m in masses.items()} for masses, hw in zip(masses_per_image, grid_hws)]
    every = [g for per_image in grids for g in per_image.values()]
    glo, ghi = min(float(np.nanmin(g)) for g in every), max(float(np.nanmax(g)) for g in every)
    rows = []
    for k, (image, per_image) in enumerate(zip(images, grids)):
        size = display_size(image.size, min_side, max_side)
        panels = []
        for name, grid in per_image.items():
            lo, hi = (glo, ghi) if shared_scale else (float(np.nanmin(grid)), float(np.nanmax(grid)))
            parts = [_caption(size[0], str(name)), _overlay(image, grid, size, lo, hi, alpha, resample)]
            if legend and not shared_scale:
                parts.append(_legend(size[0], lo, hi))
            panels.append(_stack(parts))
        width = sum(p.width for p in panels) + gap * (len(panels) - 1)
        row = Image.new("RGB", (width, max(p.height for p in panels)), (255, 255, 255))
        x = 0
        for p in panels:
            row.paste(p, (x, 0))
            x += p.width + gap
        rows.append(_stack([_caption(width, captions[k]), row]) if captions is not None else row)
    width = max(r.width for r in rows)
    parts = ([_caption(width, title)] if title else []) + rows
    if legend and shared_scale:
        parts.append(_legend(width, glo, ghi))
    return _save(_stack(parts), out_path)


# ---------------------------------------------------------------------------------------------------
# What a map is drawn from
# ---------------------------------------------------------------------------------------------------
# Processors that resize every image to one square and write ``image_seq_length`` tokens, a row-major grid: Gemma 3
# (pooled patches; without pan-and-scan), PaliGemma (every SigLIP patch a token) and Gemma 3n (MobileNet-v5's fusion
# adapter output, (C, h, w) flattened over h * w).
_SQUARE_GRID_PROCESSORS = ("Gemma3Processor", "PaliGemmaProcessor", "Gemma3nProcessor")


def image_token_grids(processing_class, images: list) -> list[tuple[int, int]] | None:
    """The token grid (h, w) of each of a row's images, in order; None when the family's layout is not a single
    row-major grid per image (see the module docstring)."""
    image_processor = getattr(processing_class, "image_processor", None)
    merge = getattr(image_processor, "merge_size", None)
    if merge is not None:
        grids = image_processor(images=images, return_tensors="pt")["image_grid_thw"]
        return [token_grid_hw(g, merge) for g in grids]
    if type(processing_class).__name__ == "PixtralProcessor":
        side = int(processing_class.patch_size) * int(processing_class.spatial_merge_size)
        sizes = image_processor(images=images, patch_size=side, return_tensors="pt")["image_sizes"]
        return [(int(h) // side, int(w) // side) for h, w in sizes]
    n = getattr(processing_class, "image_seq_length", None)
    if (type(processing_class).__name__ in _SQUARE_GRID_PROCESSORS and n
            and not getattr(image_processor, "do_pan_and_scan", False)):
        side = math.isqrt(int(n))
        if side * side == n:
            return [(side, side)] * len(images)
    if type(processing_class).__name__ == "LlavaProcessor":
        return _llava_grids(processing_class, image_processor, images)
    if type(processing_class).__name__ == "Lfm2VlProcessor":
        return _lfm2_vl_grids(image_processor, images)
    if type(processing_class).__name__ == "Ovis2Processor":
        return _ovis2_grids(processing_class, image_processor, images)
    return None


def _ovis2_grids(processing_class, image_processor, images: list) -> list[tuple[int, int]] | None:
    """Ovis2: an image its square covers is one view, ``image_seq_length`` tokens in a row-major square (the ViT's
    patch grid folded ``hidden_stride`` x ``hidden_stride``). A larger one is cropped (its ``grids`` entry is not
    1 x 1): a thumbnail, then the crops, each its own grid: no map for a row holding such an image (None)."""
    n = int(getattr(processing_class, "image_seq_length", 0) or 0)
    side = math.isqrt(n)
    if side * side != n or n == 0:
        return None
    grids = image_processor(images=images, return_tensors="pt")["grids"]
    if any(int(rows) * int(cols) != 1 for rows, cols in grids):
        return None
    return [(side, side)] * len(images)


def _lfm2_vl_grids(image_processor, images: list) -> list[tuple[int, int]] | None:
    """LFM2-VL: an image within its token budget is one view, its SigLIP2 patch grid (``spatial_shapes``)
    pixel-unshuffled ``downsample_factor`` x ``downsample_factor`` row-major into its tokens. A larger one is cut into
    tiles plus a thumbnail, each its own grid: no map for a row holding such an image (None)."""
    info = image_processor(images=images, return_row_col_info=True, return_tensors="pt")
    if (info["image_rows"] * info["image_cols"] != 1).any():
        return None
    factor = int(image_processor.downsample_factor)
    return [(int(h) // factor, int(w) // factor) for h, w in info["spatial_shapes"]]


def _llava_grids(processing_class, image_processor, images: list) -> list[tuple[int, int]] | None:
    """LLaVA 1.5: every image becomes one fixed square (crop / patch tokens a side, row-major from the CLIP patch
    grid). Its image processor centre-crops that square out of the image, so the grid covers a non-square image's
    middle only: maps for square images only (None if any is not)."""
    crop = getattr(image_processor, "crop_size", None) or {}
    patch = getattr(processing_class, "patch_size", None)
    if not patch or crop.get("height") != crop.get("width") or not crop.get("height"):
        return None
    if any(getattr(img, "size", (0, 1))[0] != getattr(img, "size", (0, 1))[1] for img in images):
        return None
    side = int(crop["height"]) // int(patch)
    return [(side, side)] * len(images)


def map_record(index: int, images: list, token_mass_by_segment: list[dict[str, Any]],
               grid_hws: list[tuple[int, int]], shares: list[float] | None = None) -> dict:
    """What the main process needs to draw one rollout's attention map: per image, its segment masses and token
    grid, and (several images) a caption with its share of the row's image attention."""
    n = len(images)
    captions = None if n == 1 or shares is None else [
        f"image {k + 1} of {n} · {100 * share:.0f}% of the image attention (measured layers)"
        for k, share in enumerate(shares)]
    return {"index": index, "images": list(images), "segments": token_mass_by_segment, "captions": captions,
            "grid_hw": list(grid_hws)}


def attention_map_records(attention, images: list[list], map_rows: list[int], segments_spec,
                          processing_class) -> list[dict]:
    """Per-segment attention over the image tokens of the selected local rows, one panel row per image (main
    process).

    ``images`` are the local rows' image lists; ``map_rows`` the rows the probe kept per-image-token masses for
    (``ModalityAttention.image_token_mass``, (layers, image tokens)). Image k's masses are its slice of the row's
    (:func:`image_token_grids`, :func:`split_per_image`), averaged over each segment's layers; its share is its summed
    mass over the row's, averaged over the measured layers. A row whose grids do not add up to its image tokens (a
    truncated prompt, a layout that is not a plain grid) gets no map rather than a wrong one.
    """
    if attention is None:
        return []
    segments = attention.segments(segments_spec)
    maps = []
    for row in map_rows:
        mass = attention.image_token_mass.get(row)
        if mass is None or mass.numel() == 0 or not images[row]:
            continue
        try:
            grids = image_token_grids(processing_class, images[row])
            if grids is None:
                return []  # the family's layout has no grid: no row of this batch gets a map
            parts = split_per_image(mass, grids)
        except ValueError:
            continue
        per_image = [{name: part[layers].mean(dim=0) for name, layers in segments.items()} for part in parts]
        totals = [float(part[attention.layers].mean(dim=0).sum()) for part in parts]
        shares = [t / sum(totals) if sum(totals) > 0 else float("nan") for t in totals]
        maps.append(map_record(row, images[row], per_image, grids, shares))
    return maps
