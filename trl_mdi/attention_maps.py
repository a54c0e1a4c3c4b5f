"""What a live-log attention map is drawn from: each image's token grid, and a rollout's attention over its image
tokens cut per image and averaged per layer segment (the drawing itself is :mod:`trl_mdi.logs.maps`).

A row's image tokens come one image after another, in the order of its images, each image's tokens row-major over
its token grid. The grid is known for two layouts:

- Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5: ``image_grid_thw = (1, gh, gw)`` per image, merged ``merge_size`` x
  ``merge_size`` into a ``(gh / merge, gw / merge)`` grid: any size and aspect ratio.
- Gemma 3 without pan-and-scan: every image is resized to one square and pooled to ``image_seq_length`` tokens, a
  ``sqrt(n) x sqrt(n)`` grid (the projector average-pools the vision tower's row-major patch grid).

Other layouts (LLaVA-NeXT's any-resolution tiles with newline tokens, SmolVLM's image splitting, Gemma 4's variable
budgets) are not a single grid per image: those families are logged without maps rather than with wrong ones.
"""

from __future__ import annotations

import math
from typing import Any

from .logs.maps import split_per_image, token_grid_hw


def image_token_grids(processing_class, images: list) -> list[tuple[int, int]] | None:
    """The token grid (h, w) of each of a row's images, in order; None when the family's layout is not a single
    row-major grid per image (see the module docstring)."""
    image_processor = getattr(processing_class, "image_processor", None)
    merge = getattr(image_processor, "merge_size", None)
    if merge is not None:
        grids = image_processor(images=images, return_tensors="pt")["image_grid_thw"]
        return [token_grid_hw(g, merge) for g in grids]
    n = getattr(processing_class, "image_seq_length", None)
    if type(processing_class).__name__ == "Gemma3Processor" and n and not getattr(image_processor, "do_pan_and_scan",
                                                                                      False):
        side = math.isqrt(int(n))
        if side * side == n:
            return [(side, side)] * len(images)
    return None


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
    (:func:`image_token_grids`, :func:`~trl_mdi.logs.maps.split_per_image`), averaged over each segment's layers;
    its share is its summed mass over the row's, averaged over the measured layers. A row whose grids do not add up
    to its image tokens (a truncated prompt, a layout that is not a plain grid) gets no map rather than a wrong one.
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
