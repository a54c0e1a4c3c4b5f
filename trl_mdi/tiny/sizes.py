"""What `build_tiny_vlm` can build: the architectures, the size knobs, and their validation.

`_resolve_size` fills the per-arch image knobs and checks that the sizes fit together and fit the
architecture; every failure is a ValueError that names the fix.
"""

from __future__ import annotations

import dataclasses
from typing import Any

TINY_ARCHS: tuple[str, ...] = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "smolvlm")
"""Architectures `build_tiny_vlm` knows; Qwen2.5-VL is the one the project targets first."""

# Vision patch sizes of the real checkpoints; the processor and the vision tower must agree on them.
_QWEN_PATCH_SIZE = {"qwen2_5_vl": 14, "qwen2_vl": 14, "qwen3_vl": 16}
_QWEN_MERGE_SIZE = 2
_SMOLVLM_SCALE_FACTOR = 2  # Idefics3 pixel shuffle: scale_factor**2 patches become one image token


@dataclasses.dataclass(frozen=True)
class TinyVLMSize:
    """Size knobs of a tiny VLM; every field can be overridden by keyword (or CLI flag).

    The defaults give about 0.2M parameters and 4 image tokens per 56x56 or 64x64 image.
    """

    num_layers: int = dataclasses.field(default=3, metadata={"help": "Text decoder layers (3 = one per early/middle/late segment)."})
    hidden_size: int = dataclasses.field(default=64, metadata={"help": "Text hidden size."})
    num_heads: int = dataclasses.field(
        default=4, metadata={"help": "Text attention heads; must divide hidden_size."}
    )
    num_kv_heads: int = dataclasses.field(
        default=2, metadata={"help": "Text key/value heads (GQA); must divide num_heads."}
    )
    intermediate_size: int = dataclasses.field(default=128, metadata={"help": "Text MLP width."})
    vision_depth: int = dataclasses.field(default=2, metadata={"help": "Vision encoder blocks."})
    vision_hidden_size: int = dataclasses.field(default=32, metadata={"help": "Vision encoder width."})
    vision_num_heads: int = dataclasses.field(
        default=2, metadata={"help": "Vision attention heads; must divide vision_hidden_size."}
    )
    vision_intermediate_size: int = dataclasses.field(
        default=64,
        metadata={
            "help": "Vision MLP width (Qwen2-VL: must be a multiple of vision_hidden_size, its mlp_ratio)."
        },
    )
    max_position_embeddings: int = dataclasses.field(
        default=8192, metadata={"help": "Longest text sequence the config declares (RoPE, so no weights)."}
    )
    min_pixels: int | None = dataclasses.field(
        default=None,
        metadata={"help": "Qwen only: smallest image area after resizing, in pixels. Default (patch*2)**2."},
    )
    max_pixels: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Qwen only: largest image area after resizing, in pixels; image tokens = area / (patch*2)**2. "
            "Default (2*patch*2)**2, i.e. 4 image tokens (56x56 for Qwen2/2.5-VL, 64x64 for Qwen3-VL)."
        },
    )
    image_size: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "SmolVLM only: side the image is resized to; image tokens = (image_size/patch/2)**2. Default 32."
        },
    )
    image_patch_size: int | None = dataclasses.field(
        default=None, metadata={"help": "SmolVLM only: vision patch side in pixels. Default 8."}
    )


def _fail(problem: str, fix: str) -> None:
    raise ValueError(f"{problem}. Fix: {fix}.")


def _check_arch(arch: str) -> None:
    if arch not in TINY_ARCHS:
        _fail(f"unknown tiny VLM arch {arch!r}", f"use one of {', '.join(TINY_ARCHS)}")


def _check_divides(size: TinyVLMSize, whole: str, part: str, fix: str) -> None:
    if getattr(size, whole) % getattr(size, part):
        _fail(f"{whole} {getattr(size, whole)} is not divisible by {part} {getattr(size, part)}", fix)


def _resolve_size(arch: str, overrides: dict[str, Any]) -> TinyVLMSize:
    """Merge overrides into the defaults, fill the per-arch image knobs and validate everything."""
    known = {f.name for f in dataclasses.fields(TinyVLMSize)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        _fail(f"unknown size knob(s) {unknown}", f"use only {sorted(known)}")
    size = TinyVLMSize(**overrides)

    is_qwen = arch in _QWEN_PATCH_SIZE
    if is_qwen and (size.image_size is not None or size.image_patch_size is not None):
        _fail(
            f"image_size/image_patch_size apply to smolvlm only, not {arch}",
            "set min_pixels/max_pixels instead",
        )
    if not is_qwen and (size.min_pixels is not None or size.max_pixels is not None):
        _fail("min_pixels/max_pixels apply to the Qwen archs only, not smolvlm", "set image_size instead")
    if is_qwen:
        unit = (_QWEN_PATCH_SIZE[arch] * _QWEN_MERGE_SIZE) ** 2  # pixels per image token
        size = dataclasses.replace(
            size,
            min_pixels=unit if size.min_pixels is None else size.min_pixels,
            max_pixels=4 * unit if size.max_pixels is None else size.max_pixels,
        )
    else:
        size = dataclasses.replace(
            size,
            image_size=32 if size.image_size is None else size.image_size,
            image_patch_size=8 if size.image_patch_size is None else size.image_patch_size,
        )

    for f in dataclasses.fields(size):
        value = getattr(size, f.name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            _fail(
                f"{f.name} must be a positive integer, got {value!r}", f"pass e.g. {f.name}={f.default or 1}"
            )

    _check_divides(
        size, "hidden_size", "num_heads",
        "choose num_heads that divides hidden_size (e.g. hidden_size=256 with num_heads=8)",
    )  # fmt: skip
    _check_divides(
        size, "num_heads", "num_kv_heads",
        "choose num_kv_heads that divides num_heads (e.g. num_heads=8 with num_kv_heads=2)",
    )  # fmt: skip
    head_dim = size.hidden_size // size.num_heads
    if head_dim % 2 or (is_qwen and head_dim < 8):
        _fail(
            f"text head_dim = hidden_size/num_heads = {head_dim} is too small or odd for rotary embeddings",
            "make hidden_size/num_heads even and at least 8 (e.g. hidden_size=64, num_heads=4 gives 16)",
        )
    _check_divides(
        size, "vision_hidden_size", "vision_num_heads", "choose vision_num_heads that divides vision_hidden_size"
    )
    vision_head_dim = size.vision_hidden_size // size.vision_num_heads
    # The Qwen vision towers split each head's rotary half between the height and the width axis.
    if is_qwen and vision_head_dim % 4:
        _fail(
            f"vision head dim {vision_head_dim} is not a multiple of 4, which the Qwen 2D vision RoPE needs",
            "make vision_hidden_size/vision_num_heads a multiple of 4 (e.g. 32/2 = 16)",
        )
    if arch == "qwen2_vl" and size.vision_intermediate_size % size.vision_hidden_size:
        _fail(
            f"Qwen2-VL sizes its vision MLP by an integer mlp_ratio, but vision_intermediate_size "
            f"{size.vision_intermediate_size} is not a multiple of vision_hidden_size {size.vision_hidden_size}",
            "set vision_intermediate_size to k * vision_hidden_size",
        )
    if is_qwen:
        unit = (_QWEN_PATCH_SIZE[arch] * _QWEN_MERGE_SIZE) ** 2
        if size.min_pixels < unit or size.max_pixels < size.min_pixels:
            _fail(
                f"need {unit} <= min_pixels <= max_pixels, got min_pixels={size.min_pixels}, max_pixels={size.max_pixels}",
                f"one image token covers {unit} pixels; set max_pixels to n_tokens * {unit}",
            )
    else:
        grid, rem = divmod(size.image_size, size.image_patch_size)
        if rem or grid % _SMOLVLM_SCALE_FACTOR:
            _fail(
                f"image_size {size.image_size} must be image_patch_size {size.image_patch_size} times a multiple "
                f"of the pixel-shuffle factor {_SMOLVLM_SCALE_FACTOR}",
                "e.g. image_size=32 with image_patch_size=8, or image_size=64 with image_patch_size=8",
            )
    return size
