"""Any decoded image as the 8-bit RGB image a processor expects: the one conversion the data prep, the data load and
the trainer's image decoding share (``to_rgb``).

Why not PIL's ``convert("RGB")`` alone: for the single-channel high-depth modes (``I;16`` and its byte orders, ``I``,
``F``) it clips every value above 255 to 255, so a 16-bit greyscale PNG (the usual output of scanners, microscopes and
depth sensors) comes out white or two-tone. Those modes are scaled to 8 bits first, by the rule of
:func:`high_depth_to_8bit`. Multi-channel 16-bit files (RGB, RGBA, grey with alpha) PIL already opens as 8-bit.
Transparency is laid on white, as a page shows it.
"""

from __future__ import annotations

from typing import Any

HIGH_DEPTH_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")
"""PIL's single-channel modes with more than 8 bits per pixel (16-bit unsigned, 32-bit signed, 32-bit float)."""

_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


def high_depth_to_8bit(img: Any) -> Any:
    """A high-depth single-channel image (``HIGH_DEPTH_MODES``) as an 8-bit greyscale one (mode ``L``).

    The rule, per mode (``v`` a pixel value, the result rounded to the nearest integer):

    * ``I;16``, ``I;16L``, ``I;16B``, ``I;16N`` (16 bits unsigned): ``v / 257``, i.e. ``v * 255 / 65535``: 0 stays 0,
      65535 becomes 255, ``257 * k`` becomes ``k``.
    * ``I`` (32-bit integers) and ``F`` (32-bit floats), whose range the mode does not say, by the range of the image's
      values: within [0, 1] (``F`` only: a float image in unit range) ``v * 255``; within [0, 255] as they are; within
      [0, 65535] (a 16-bit file PIL opened as ``I``) ``v / 257``; otherwise the image's own minimum to maximum
      stretched over 0 to 255. NaN counts as 0.

    >>> from PIL import Image
    >>> img = Image.new("I;16", (3, 1)); img.putpixel((1, 0), 257 * 100); img.putpixel((2, 0), 65535)
    >>> [high_depth_to_8bit(img).getpixel((x, 0)) for x in range(3)]
    [0, 100, 255]
    """
    import numpy as np
    from PIL import Image

    values = np.asarray(img).astype(np.float64)
    values = np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
    if img.mode.startswith("I;16"):
        scaled = values / 257.0
    else:
        lo, hi = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
        if img.mode == "F" and lo >= 0 and hi <= 1:
            scaled = values * 255.0
        elif lo >= 0 and hi <= 255:
            scaled = values
        elif lo >= 0 and hi <= 65535:
            scaled = values / 257.0
        else:
            scaled = (values - lo) * (255.0 / (hi - lo))  # hi > lo: a constant image is within one range above
    return Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8), mode="L")


def to_rgb(img: Any) -> Any:
    """``img`` (a decoded PIL image) as an RGB image: RGB as it is, high-depth modes scaled to 8 bits
    (:func:`high_depth_to_8bit`), transparency (RGBA, LA, palette with a transparent colour...) laid on white, every
    other mode (L, 1, P, CMYK, YCbCr...) by PIL's conversion.

    >>> from PIL import Image
    >>> to_rgb(Image.new("I;16B", (1, 1), 65535)).getpixel((0, 0)), to_rgb(Image.new("LA", (1, 1), (0, 0))).getpixel((0, 0))
    ((255, 255, 255), (255, 255, 255))
    """
    from PIL import Image

    if img.mode == "RGB":
        return img
    if img.mode in HIGH_DEPTH_MODES:
        return high_depth_to_8bit(img).convert("RGB")
    if not (img.mode in _ALPHA_MODES or (img.mode == "P" and "transparency" in img.info)):
        return img.convert("RGB")
    rgba = img.convert("RGBA")
    # White, not black: transparent regions of icons and scans are meant to be seen on paper.
    background = Image.new("RGB", rgba.size, (255, 255, 255))
    background.paste(rgba, mask=rgba.getchannel("A"))
    return background
