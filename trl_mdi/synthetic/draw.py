"""Drawing the synthetic images: the shapes (polygons, circle) and where they go (one big shape, or a count laid out
on a grid whose cells line up with the tiny processors' image tokens; design choice 3 of `trl_mdi.synthetic`)."""

from __future__ import annotations

import math
import random

from PIL import ImageDraw


def _shape_polygon(shape: str, box: tuple[int, int, int, int]) -> list[tuple[float, float]] | None:
    x0, y0, x1, y1 = box
    cx, cy, w, h = (x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0
    if shape == "triangle":
        return [(cx, y0), (x1, y1), (x0, y1)]
    if shape == "diamond":
        return [(cx, y0), (x1, cy), (cx, y1), (x0, cy)]
    if shape == "star":
        points = []
        for i in range(10):
            # Inner radius half the outer one: a fat star keeps enough pixels to show its colour at 56 px.
            radius = (w / 2, h / 2) if i % 2 == 0 else (w / 4, h / 4)
            angle = -math.pi / 2 + i * math.pi / 5
            points.append((cx + radius[0] * math.cos(angle), cy + radius[1] * math.sin(angle)))
        return points
    if shape == "cross":
        a, b = w / 3, h / 3
        return [
            (x0 + a, y0),
            (x0 + 2 * a, y0),
            (x0 + 2 * a, y0 + b),
            (x1, y0 + b),
            (x1, y0 + 2 * b),
            (x0 + 2 * a, y0 + 2 * b),
            (x0 + 2 * a, y1),
            (x0 + a, y1),
            (x0 + a, y0 + 2 * b),
            (x0, y0 + 2 * b),
            (x0, y0 + b),
            (x0 + a, y0 + b),
        ]
    return None


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill) -> None:
    """Draw one filled ``shape`` (one of SHAPES) inside ``box`` = (x0, y0, x1, y1)."""
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon(_shape_polygon(shape, box), fill=fill)


def big_box(rng: random.Random, size: int) -> tuple[int, int, int, int]:
    """A random box for the one big shape of colour / shape questions (55-85% of the image side)."""
    side = rng.randint(int(0.55 * size), int(0.85 * size))
    x0, y0 = rng.randint(0, size - side), rng.randint(0, size - side)
    return (x0, y0, x0 + side - 1, y0 + side - 1)


def grid_boxes(rng: random.Random, size: int, count: int, max_count: int) -> list[tuple[int, int, int, int]]:
    """``count`` small boxes for a count question, at most one per cell of a grid sized for ``max_count``."""
    grid = max(2, math.ceil(math.sqrt(max_count)))
    cell = size / grid
    boxes = []
    # A margin inside each cell keeps neighbours apart: two touching squares would read as one rectangle.
    pad = max(1, round(0.08 * cell))
    for c in sorted(rng.sample(range(grid * grid), count)):
        side = max(3, rng.randint(int(0.5 * cell), int(0.75 * cell)))
        cx0, cy0 = int((c % grid) * cell) + pad, int((c // grid) * cell) + pad
        slack = max(0, int(cell) - 2 * pad - side)
        x0, y0 = cx0 + rng.randint(0, slack), cy0 + rng.randint(0, slack)
        boxes.append((x0, y0, x0 + side - 1, y0 + side - 1))
    return boxes


