"""Filling and checking the size knobs of one tiny VLM arch: `resolve_size`.

It fills the per-arch knobs (image sizes, layer counts, attention layout, MoE routing) and checks that the
sizes fit together and fit the architecture. Every failure is a ValueError that names the fix. The knobs
themselves and the per-arch constants are in `sizes`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .sizes import (
    DEFAULT_FULL_ATTENTION_INTERVAL,
    DEFAULT_MOE,
    DEFAULT_NUM_LAYERS,
    DEFAULT_SLIDING_WINDOW,
    FIXED_IMAGE_DEFAULTS,
    GEMMA3_POOL,
    GEMMA4_DEFAULT_PATCH,
    HYBRID_LAYER_KIND,
    MOE_ARCHS,
    QWEN_MERGE_SIZE,
    QWEN_PATCH_SIZE,
    SLIDING_WINDOW_ARCHS,
    SMOLVLM_SCALE_FACTOR,
    TinyVLMSize,
    check_divides,
    check_positive_ints,
    check_text_shape,
    fail,
    merge,
)


def _names(items) -> str:
    """'a, b and c'."""
    items = list(items)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _reject_foreign_knobs(arch: str, size: TinyVLMSize) -> None:
    """Reject knobs that do not apply to `arch` (each message names the archs they do apply to)."""
    is_qwen = arch in QWEN_PATCH_SIZE
    fixed = _names(FIXED_IMAGE_DEFAULTS)
    if arch not in FIXED_IMAGE_DEFAULTS and size.image_size is not None:
        fix = "set image_patch_size instead" if arch == "gemma4" else "set min_pixels/max_pixels instead"
        fail(f"image_size applies to {fixed} only, not {arch}", fix)
    if is_qwen and size.image_patch_size is not None:
        patch_archs = _names([*FIXED_IMAGE_DEFAULTS, "gemma4"])
        fail(
            f"image_patch_size applies to {patch_archs} only, not {arch}", "set min_pixels/max_pixels instead"
        )
    if not is_qwen and (size.min_pixels is not None or size.max_pixels is not None):
        fix = "set image_patch_size instead" if arch == "gemma4" else "set image_size instead"
        fail(f"min_pixels/max_pixels apply to the Qwen archs only, not {arch}", fix)
    if arch not in HYBRID_LAYER_KIND and size.full_attention_interval is not None:
        fail(
            f"full_attention_interval applies to {_names(HYBRID_LAYER_KIND)} only, not {arch}",
            f"drop it: every {arch} text layer uses full attention",
        )
    if arch not in SLIDING_WINDOW_ARCHS and size.sliding_window is not None:
        archs = _names(SLIDING_WINDOW_ARCHS)
        fail(f"sliding_window applies to {archs} only, not {arch}", f"drop it, or build {archs}")
    if arch not in MOE_ARCHS and any(getattr(size, knob) is not None for knob in DEFAULT_MOE):
        fail(f"{'/'.join(DEFAULT_MOE)} apply to {_names(MOE_ARCHS)} only, not {arch}", "drop them")


def _fill_arch_defaults(arch: str, size: TinyVLMSize) -> TinyVLMSize:
    """Reject knobs that do not apply to `arch` and fill the per-arch defaults of those that do."""
    _reject_foreign_knobs(arch, size)
    filled: dict[str, Any] = {}
    if size.num_layers is None:
        filled["num_layers"] = DEFAULT_NUM_LAYERS.get(arch, 3)
    if arch in QWEN_PATCH_SIZE:
        unit = (QWEN_PATCH_SIZE[arch] * QWEN_MERGE_SIZE) ** 2  # pixels per image token
        filled["min_pixels"] = unit if size.min_pixels is None else size.min_pixels
        filled["max_pixels"] = 4 * unit if size.max_pixels is None else size.max_pixels
    elif arch == "gemma4":  # no fixed side: the processor resizes each image to its soft-token budget
        patch = size.image_patch_size
        filled["image_patch_size"] = GEMMA4_DEFAULT_PATCH if patch is None else patch
    else:
        default_side, default_patch = FIXED_IMAGE_DEFAULTS[arch]
        filled["image_size"] = default_side if size.image_size is None else size.image_size
        filled["image_patch_size"] = default_patch if size.image_patch_size is None else size.image_patch_size
    if arch in HYBRID_LAYER_KIND and size.full_attention_interval is None:
        filled["full_attention_interval"] = DEFAULT_FULL_ATTENTION_INTERVAL
    if arch in SLIDING_WINDOW_ARCHS and size.sliding_window is None:
        filled["sliding_window"] = DEFAULT_SLIDING_WINDOW
    if arch in MOE_ARCHS:
        filled |= {knob: default for knob, default in DEFAULT_MOE.items() if getattr(size, knob) is None}
    return dataclasses.replace(size, **filled)


def _check_family_layout(arch: str, size: TinyVLMSize) -> None:
    """The newer families' own constraints: MoE routing fits, Gemma 4 ends on a full-attention layer."""
    if arch in MOE_ARCHS and size.num_experts_per_tok > size.num_experts:
        fail(
            f"num_experts_per_tok {size.num_experts_per_tok} exceeds num_experts {size.num_experts}",
            "route each token to at most num_experts experts (e.g. num_experts=4, num_experts_per_tok=2)",
        )
    if arch == "gemma4" and size.num_layers % size.full_attention_interval:
        fail(
            f"Gemma 4's last text layer must use full attention (transformers forces it), but num_layers "
            f"{size.num_layers} is not a multiple of full_attention_interval {size.full_attention_interval}",
            "choose num_layers = k * full_attention_interval (e.g. num_layers=6, full_attention_interval=3)",
        )


def resolve_size(arch: str, overrides: dict[str, Any]) -> TinyVLMSize:
    """Merge overrides into the defaults, fill the per-arch knobs and validate everything."""
    size = _fill_arch_defaults(arch, merge(TinyVLMSize, overrides, "size"))
    check_positive_ints(size)
    is_qwen = arch in QWEN_PATCH_SIZE
    # Gemma 4's full-attention layers rotate a quarter of a head twice as wide: 8 keeps them rotating.
    check_text_shape(size, rotary_min_head_dim=8 if is_qwen or arch == "gemma4" else 2)
    _check_family_layout(arch, size)

    check_divides(
        size,
        "vision_hidden_size",
        "vision_num_heads",
        "choose vision_num_heads that divides vision_hidden_size",
    )
    vision_head_dim = size.vision_hidden_size // size.vision_num_heads
    # The Qwen and Gemma 4 vision towers split each head's rotary dims between the height and the width axis.
    if (is_qwen or arch == "gemma4") and vision_head_dim % 4:
        fail(
            f"vision head dim {vision_head_dim} is not a multiple of 4, which the {arch} 2D vision RoPE needs",
            "make vision_hidden_size/vision_num_heads a multiple of 4 (e.g. 32/2 = 16)",
        )
    if arch == "qwen2_vl" and size.vision_intermediate_size % size.vision_hidden_size:
        fail(
            f"Qwen2-VL sizes its vision MLP by an integer mlp_ratio, but vision_intermediate_size "
            f"{size.vision_intermediate_size} is not a multiple of vision_hidden_size {size.vision_hidden_size}",
            "set vision_intermediate_size to k * vision_hidden_size",
        )
    if is_qwen:
        unit = (QWEN_PATCH_SIZE[arch] * QWEN_MERGE_SIZE) ** 2
        if size.min_pixels < unit or size.max_pixels < size.min_pixels:
            fail(
                f"need {unit} <= min_pixels <= max_pixels, got min_pixels={size.min_pixels}, max_pixels={size.max_pixels}",
                f"one image token covers {unit} pixels; set max_pixels to n_tokens * {unit}",
            )
        return size
    if arch == "gemma4":  # any patch size works: the processor resizes to multiples of pool * patch
        return size

    grid, rem = divmod(size.image_size, size.image_patch_size)
    if arch == "llava_next":
        if rem:
            fail(
                f"image_size {size.image_size} is not a multiple of image_patch_size {size.image_patch_size}",
                "e.g. image_size=32 with image_patch_size=16 (10 image tokens) or 8 (36 image tokens)",
            )
        return size
    factor, what = (SMOLVLM_SCALE_FACTOR, "pixel-shuffle") if arch == "smolvlm" else (GEMMA3_POOL, "pooling")
    if rem or grid % factor:
        fail(
            f"image_size {size.image_size} must be image_patch_size {size.image_patch_size} times a multiple "
            f"of the {what} factor {factor}",
            "e.g. image_size=32 with image_patch_size=8, or image_size=64 with image_patch_size=8",
        )
    return size
