"""Image perturbations I -> I' for TPRL's token visual dependency, on PIL images before the processor.

VPPO (github.com/huaixuheqing/VPPO-RL, verl/workers/perc_utils.py) scores each completion token by how much
its log-probability moves when the image is perturbed; its default perturbation is random patch blackening
(14 px cells, each blacked with probability 0.5). Gaussian noise, blur and a full mask exist there unused;
we keep them for ablations, with VPPO's defaults (noise std 189 on a 0-255 scale, blur radius 6). Our
"grayscale" (not in VPPO) removes the colour and keeps every shape and brightness: for questions about colour, the
perturbation that removes what is asked and nothing else (issue 44). Our "black" blacks the whole image; "grey" fills it with mid-grey (128, 128, 128), as VPPO's full mask does. "grey"
is also the counterfactual image of ``trl_mdi.counterfactual``: same size, so the processor gives the same image
tokens at the same positions, and no colour or edge of the real image leaks through.

Cells are in the ORIGINAL image's pixels: the processor resizes afterwards (Qwen2.5-VL's dynamic
resolution), so a 14 px cell need not line up with a 14 px vision patch. VPPO does the same.

Determinism: ``perturb_images`` draws each image's randomness from its own generator, seeded by
``numpy.random.SeedSequence(seed, spawn_key=(step, row, j))``: never from global RNG state, so the same
(seed, step, row, j) gives the same I' in any process, in any order, after a resume.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageFilter

PERTURBATIONS = ("patch_blackening", "gaussian_noise", "blur", "black", "grey", "grayscale")
DEFAULT_PERTURBATION = "patch_blackening"
DEFAULT_PATCH_SIZE = 14  # VPPO
DEFAULT_PROB = 0.5  # VPPO
DEFAULT_NOISE_STD = 189.0  # VPPO's add_gaussian_noise default, in 0-255 units: destroys most detail
DEFAULT_BLUR_RADIUS = 6.0  # VPPO's gaussian_blur default (PIL radius = Gaussian sigma in pixels)
GREY = (128, 128, 128)  # the "grey" kind's fill: VPPO's full-mask value, the middle of the 0-255 range


def check_perturbation(
    kind: str = DEFAULT_PERTURBATION,
    *,
    patch_size: int = DEFAULT_PATCH_SIZE,
    prob: float = DEFAULT_PROB,
    noise_std: float = DEFAULT_NOISE_STD,
    blur_radius: float = DEFAULT_BLUR_RADIUS,
) -> None:
    """Raise ValueError naming the first bad argument; all parameters are checked whatever the kind.

    Valid: ``kind`` in PERTURBATIONS, integer ``patch_size >= 1``, ``prob`` in [0, 1], ``noise_std >= 0``,
    ``blur_radius >= 0`` (finite). Config classes can call this in ``__post_init__``.

    >>> check_perturbation("noise")
    Traceback (most recent call last):
    ...
    ValueError: unknown perturbation kind 'noise'; valid kinds: patch_blackening, gaussian_noise, blur, black, grey, grayscale
    >>> check_perturbation(prob=1.5)
    Traceback (most recent call last):
    ...
    ValueError: prob must be in [0, 1], got 1.5
    """
    if kind not in PERTURBATIONS:
        raise ValueError(f"unknown perturbation kind {kind!r}; valid kinds: {', '.join(PERTURBATIONS)}")
    if isinstance(patch_size, bool) or not isinstance(patch_size, (int, np.integer)) or patch_size < 1:
        raise ValueError(f"patch_size must be an integer >= 1, got {patch_size!r}")
    if not _is_real(prob) or not 0.0 <= prob <= 1.0:
        raise ValueError(f"prob must be in [0, 1], got {prob!r}")
    if not _is_real(noise_std) or not 0.0 <= noise_std < math.inf:
        raise ValueError(f"noise_std must be finite and >= 0, got {noise_std!r}")
    if not _is_real(blur_radius) or not 0.0 <= blur_radius < math.inf:
        raise ValueError(f"blur_radius must be finite and >= 0, got {blur_radius!r}")


def _is_real(x: Any) -> bool:
    return (
        not isinstance(x, bool) and isinstance(x, (int, float, np.integer, np.floating)) and not math.isnan(x)
    )


def _rng(generator: np.random.Generator | int | None) -> np.random.Generator:
    if isinstance(generator, np.random.Generator):
        return generator
    if generator is None or (isinstance(generator, (int, np.integer)) and not isinstance(generator, bool)):
        return np.random.default_rng(generator)  # None: fresh OS entropy, i.e. NOT reproducible
    raise TypeError(
        f"generator must be a numpy Generator, an int seed or None, got {type(generator).__name__}"
    )


def patch_blackening_mask(
    height: int, width: int, patch_size: int, prob: float, rng: np.random.Generator
) -> np.ndarray:
    """Pixel mask (height, width), True where blacked: cells of ``patch_size`` px, each on with prob ``prob``.

    The grid starts at the top-left corner; edge cells are partial (ceil(H/ps) x ceil(W/ps) cells). One
    uniform draw per cell, row-major, ``draw < prob`` (VPPO's order and rule: prob 0 -> none, 1 -> all).

    >>> patch_blackening_mask(3, 5, 2, 0.5, np.random.default_rng(0)).astype(int)
    array([[0, 0, 1, 1, 1],
           [0, 0, 1, 1, 1],
           [1, 1, 0, 0, 0]])
    """
    rows, cols = math.ceil(height / patch_size), math.ceil(width / patch_size)
    cells = rng.random((rows, cols)) < prob
    return np.repeat(np.repeat(cells, patch_size, axis=0), patch_size, axis=1)[:height, :width]


def perturb_image(
    img: Image.Image,
    kind: str = DEFAULT_PERTURBATION,
    *,
    patch_size: int = DEFAULT_PATCH_SIZE,
    prob: float = DEFAULT_PROB,
    noise_std: float = DEFAULT_NOISE_STD,
    blur_radius: float = DEFAULT_BLUR_RADIUS,
    generator: np.random.Generator | int | None = None,
) -> Image.Image:
    """Return a perturbed RGB copy of ``img`` (same size); the input is never modified.

    kinds:
      * ``patch_blackening``: cells of ``patch_size`` px (edge cells partial) set to 0, each independently
        with probability ``prob`` (VPPO's default I': 14 px, 0.5);
      * ``gaussian_noise``: ``clip(round(x + N(0, noise_std)), 0, 255)`` per pixel and channel;
      * ``blur``: PIL Gaussian blur of radius ``blur_radius`` (no randomness);
      * ``black``: an all-black image (no randomness);
      * ``grey``: a uniform mid-grey image, every pixel ``GREY`` (no randomness);
      * ``grayscale``: PIL's luminance ``L = (299 R + 587 G + 114 B) / 1000`` in all three channels: the colour
        gone, shapes and brightness kept (no randomness).

    Non-RGB input (L, RGBA, P, ...) is converted to RGB first, as the VLM processors do; alpha is dropped.
    ``generator``: a numpy Generator (consumed), an int seed, or None for fresh OS entropy (not
    reproducible; use ``perturb_images`` for seeded batches).

    >>> img = Image.new("RGB", (4, 2), (200, 100, 50))
    >>> out = perturb_image(img, patch_size=2, prob=0.5, generator=0)
    >>> out.size, out.mode, np.asarray(out)[:, :, 0].tolist()
    ((4, 2), 'RGB', [[200, 200, 0, 0], [200, 200, 0, 0]])
    >>> np.asarray(perturb_image(img, "black")).max()
    np.uint8(0)
    >>> perturb_image(img, "grey").getextrema()
    ((128, 128), (128, 128), (128, 128))
    >>> perturb_image(img, "grayscale").getpixel((0, 0))  # 0.299 * 200 + 0.587 * 100 + 0.114 * 50 = 124.3
    (124, 124, 124)
    """
    check_perturbation(kind, patch_size=patch_size, prob=prob, noise_std=noise_std, blur_radius=blur_radius)
    if not isinstance(img, Image.Image):
        raise TypeError(f"img must be a PIL.Image.Image, got {type(img).__name__}")
    rgb = img if img.mode == "RGB" else img.convert("RGB")
    if kind == "black":
        return Image.new("RGB", rgb.size, (0, 0, 0))
    if kind == "grey":
        return Image.new("RGB", rgb.size, GREY)
    if kind == "grayscale":
        return rgb.convert("L").convert("RGB")
    if kind == "blur":
        return rgb.filter(ImageFilter.GaussianBlur(radius=blur_radius))
    rng = _rng(generator)
    arr = np.array(rgb)  # (H, W, 3) uint8, a copy
    if kind == "patch_blackening":
        arr[patch_blackening_mask(arr.shape[0], arr.shape[1], patch_size, prob, rng)] = 0
    else:  # gaussian_noise
        noisy = arr.astype(np.float32) + rng.normal(0.0, noise_std, arr.shape).astype(np.float32)
        arr = np.clip(np.rint(noisy), 0, 255).astype(np.uint8)
    return Image.fromarray(arr)  # uint8 (H, W, 3) -> RGB


def image_generator(seed: int, step: int, row: int, index: int = 0) -> np.random.Generator:
    """The generator for image ``index`` of batch row ``row`` at ``step``: SeedSequence(seed, spawn_key=...).

    A pure function of its arguments (no global state, no Python ``hash`` salt), stable across processes,
    platforms and resumes. All arguments must be integers >= 0.

    >>> float(image_generator(0, 1, 2).random()) == float(image_generator(0, 1, 2).random())
    True
    """
    for name, v in (("seed", seed), ("step", step), ("row", row), ("index", index)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
    return np.random.default_rng(
        np.random.SeedSequence(int(seed), spawn_key=(int(step), int(row), int(index)))
    )


def perturb_images(
    images: Sequence[Any],
    kind: str = DEFAULT_PERTURBATION,
    *,
    seed: int,
    step: int,
    row_offset: int = 0,
    patch_size: int = DEFAULT_PATCH_SIZE,
    prob: float = DEFAULT_PROB,
    noise_std: float = DEFAULT_NOISE_STD,
    blur_radius: float = DEFAULT_BLUR_RADIUS,
) -> list[Any]:
    """Perturb a batch of image rows deterministically per (seed, step, row, image index).

    ``images`` holds one entry per rollout: a PIL image, a list/tuple of PIL images (several images in one
    prompt), or None / [] (no image: returned unchanged). The result has the same structure (lists for
    list/tuple rows). Image j of row i uses ``image_generator(seed, step, row_offset + i, j)``, so a bare image
    and a one-image list give the same I'.

    ``step`` must differ between generation rounds (e.g. the trainer's global step, or its count of
    generation calls) or every round reuses the same masks. ``row_offset``: the global index of this
    process's first row (process_index * rows_per_process), so processes draw different masks for
    different rollouts instead of repeating one pattern.

    >>> img = Image.new("RGB", (28, 28), (255, 255, 255))
    >>> a = perturb_images([img, None, [img, img], []], seed=0, step=3)
    >>> [type(r).__name__ for r in a], a[2][0].tobytes() == a[2][1].tobytes()
    (['Image', 'NoneType', 'list', 'list'], False)
    >>> perturb_images([img], seed=0, step=3)[0].tobytes() == perturb_images([[img]], seed=0, step=3)[0][0].tobytes()
    True
    """
    check_perturbation(kind, patch_size=patch_size, prob=prob, noise_std=noise_std, blur_radius=blur_radius)
    image_generator(
        seed, step, row_offset
    )  # validates seed, step and row_offset even for an image-free batch
    params = dict(patch_size=patch_size, prob=prob, noise_std=noise_std, blur_radius=blur_radius)

    def one(img: Any, row: int, j: int) -> Image.Image:
        return perturb_image(img, kind, generator=image_generator(seed, step, row, j), **params)

    out: list[Any] = []
    for i, entry in enumerate(images):
        row = row_offset + i
        if entry is None:
            out.append(None)
        elif isinstance(entry, (list, tuple)):
            out.append([one(img, row, j) for j, img in enumerate(entry)])
        else:
            out.append(one(entry, row, 0))
    return out
