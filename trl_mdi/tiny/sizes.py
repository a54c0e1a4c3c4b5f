"""What `build_tiny_vlm` and `build_tiny_text_model` can build: the architectures, the size knobs, and their checks.

`resolve_size` fills the per-arch knobs (image sizes, layer counts, attention layout) and checks that the
sizes fit together and fit the architecture; `resolve_text_size` does the same for the text-only models.
Every failure is a ValueError that names the fix.
"""

from __future__ import annotations

import dataclasses
from typing import Any

TINY_ARCHS: tuple[str, ...] = (
    "qwen2_5_vl",
    "qwen2_vl",
    "qwen3_vl",
    "smolvlm",
    "qwen3_5",
    "gemma3",
    "llava_next",
)
"""Architectures `build_tiny_vlm` knows; Qwen2.5-VL is the one the project targets first."""

TEXT_TASKS: tuple[str, ...] = ("causal_lm", "sequence_classification")
"""Tasks `build_tiny_text_model` knows: a Qwen2 causal LM (policy) or a one-logit Qwen2 reward model."""

# Vision patch sizes of the real checkpoints; the processor and the vision tower must agree on them.
QWEN_PATCH_SIZE = {"qwen2_5_vl": 14, "qwen2_vl": 14, "qwen3_vl": 16, "qwen3_5": 16}
QWEN_MERGE_SIZE = 2
SMOLVLM_SCALE_FACTOR = 2  # Idefics3 pixel shuffle: scale_factor**2 patches become one image token
GEMMA3_POOL = 2  # Gemma 3's projector average-pools GEMMA3_POOL x GEMMA3_POOL patches into one image token

# The archs whose images are resized to one fixed square (image_size), and their (image_size, patch) defaults.
_FIXED_IMAGE_DEFAULTS = {"gemma3": (32, 8), "llava_next": (32, 16), "smolvlm": (32, 8)}
# Archs that mix a cheap layer kind with full (softmax, global) attention, and the cheap kind's name.
HYBRID_LAYER_KIND = {"qwen3_5": "linear_attention", "gemma3": "sliding_attention"}
_DEFAULT_NUM_LAYERS = {"qwen3_5": 4, "gemma3": 4}  # with interval 2: two full-attention layers
_DEFAULT_FULL_ATTENTION_INTERVAL = 2
_DEFAULT_SLIDING_WINDOW = 512


@dataclasses.dataclass(frozen=True)
class TinyVLMSize:
    """Size knobs of a tiny VLM; every field can be overridden by keyword (or CLI flag).

    The defaults give about 0.2-0.35M parameters and 4 image tokens per 56x56 or 64x64 image (10 for
    llava_next, whose image features carry one newline token per row).
    """

    num_layers: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Text decoder layers. Default 3 (one per early/middle/late segment); 4 for qwen3_5 and gemma3, "
            "so that full_attention_interval 2 gives two full-attention layers."
        },
    )
    hidden_size: int = dataclasses.field(default=64, metadata={"help": "Text hidden size."})
    num_heads: int = dataclasses.field(
        default=4,
        metadata={
            "help": "Text attention heads; must divide hidden_size (qwen3_5: also its linear-attention value heads)."
        },
    )
    num_kv_heads: int = dataclasses.field(
        default=2,
        metadata={
            "help": "Text key/value heads (GQA); must divide num_heads (qwen3_5: also its linear-attention key heads)."
        },
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
            "Default (2*patch*2)**2, i.e. 4 image tokens (56x56 for Qwen2/2.5-VL, 64x64 for Qwen3-VL/Qwen3.5)."
        },
    )
    image_size: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "SmolVLM, Gemma 3, LLaVA-NeXT: side the image is resized to. Image tokens: (image_size/patch/2)**2 "
            "(smolvlm, gemma3); 2*g*g + g with g = image_size/patch for a square image (llava_next). Default 32."
        },
    )
    image_patch_size: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "SmolVLM, Gemma 3, LLaVA-NeXT: vision patch side in pixels. Default 8 (llava_next: 16)."
        },
    )
    full_attention_interval: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "qwen3_5 and gemma3 only: text layer i (from 0) uses full attention iff i + 1 is a "
            "multiple of it; the others are linear attention (qwen3_5, Gated DeltaNet) or sliding-window "
            "attention (gemma3). Default 2; a value above num_layers gives no full-attention layer at all."
        },
    )
    sliding_window: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "gemma3 only: how many most recent tokens (itself included) a sliding-attention layer's query "
            f"sees. Default {_DEFAULT_SLIDING_WINDOW}; set it below the prompt length to cut the image off."
        },
    )


@dataclasses.dataclass(frozen=True)
class TinyTextSize:
    """Size knobs of a tiny text-only Qwen2 model (`build_tiny_text_model`); about 0.1M parameters by default."""

    num_layers: int = dataclasses.field(default=2, metadata={"help": "Decoder layers."})
    hidden_size: int = dataclasses.field(default=64, metadata={"help": "Hidden size."})
    num_heads: int = dataclasses.field(
        default=4, metadata={"help": "Attention heads; must divide hidden_size."}
    )
    num_kv_heads: int = dataclasses.field(
        default=2, metadata={"help": "Key/value heads; must divide num_heads."}
    )
    intermediate_size: int = dataclasses.field(default=128, metadata={"help": "MLP width."})
    max_position_embeddings: int = dataclasses.field(
        default=8192, metadata={"help": "Longest sequence (RoPE)."}
    )


def _fail(problem: str, fix: str) -> None:
    raise ValueError(f"{problem}. Fix: {fix}.")


def check_arch(arch: str) -> None:
    if arch not in TINY_ARCHS:
        _fail(f"unknown tiny VLM arch {arch!r}", f"use one of {', '.join(TINY_ARCHS)}")


def check_text_task(task: str) -> None:
    if task not in TEXT_TASKS:
        _fail(f"unknown tiny text model task {task!r}", f"use one of {', '.join(TEXT_TASKS)}")


def _check_divides(size: Any, whole: str, part: str, fix: str) -> None:
    if getattr(size, whole) % getattr(size, part):
        _fail(f"{whole} {getattr(size, whole)} is not divisible by {part} {getattr(size, part)}", fix)


def _merge(cls: type, overrides: dict[str, Any], what: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        _fail(f"unknown {what} knob(s) {unknown}", f"use only {sorted(known)}")
    return cls(**overrides)


def _check_positive_ints(size: Any) -> None:
    for f in dataclasses.fields(size):
        value = getattr(size, f.name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            _fail(
                f"{f.name} must be a positive integer, got {value!r}", f"pass e.g. {f.name}={f.default or 1}"
            )


def _check_text_shape(size: Any, rotary_min_head_dim: int) -> None:
    """The text-decoder checks every arch shares: heads divide evenly, head_dim fits rotary embeddings."""
    _check_divides(
        size, "hidden_size", "num_heads",
        "choose num_heads that divides hidden_size (e.g. hidden_size=256 with num_heads=8)",
    )  # fmt: skip
    _check_divides(
        size, "num_heads", "num_kv_heads",
        "choose num_kv_heads that divides num_heads (e.g. num_heads=8 with num_kv_heads=2)",
    )  # fmt: skip
    head_dim = size.hidden_size // size.num_heads
    if head_dim % 2 or head_dim < rotary_min_head_dim:
        _fail(
            f"text head_dim = hidden_size/num_heads = {head_dim} is too small or odd for rotary embeddings",
            "make hidden_size/num_heads even and at least 8 (e.g. hidden_size=64, num_heads=4 gives 16)",
        )


def resolve_text_size(overrides: dict[str, Any]) -> TinyTextSize:
    """Merge overrides into the `TinyTextSize` defaults and validate them."""
    size = _merge(TinyTextSize, overrides, "text model size")
    _check_positive_ints(size)
    _check_text_shape(size, rotary_min_head_dim=8)
    return size


def _fill_arch_defaults(arch: str, size: TinyVLMSize) -> TinyVLMSize:
    """Reject knobs that do not apply to `arch` and fill the per-arch defaults of those that do."""
    is_qwen = arch in QWEN_PATCH_SIZE
    if is_qwen and (size.image_size is not None or size.image_patch_size is not None):
        _fail(
            f"image_size/image_patch_size apply to gemma3, llava_next and smolvlm only, not {arch}",
            "set min_pixels/max_pixels instead",
        )
    if not is_qwen and (size.min_pixels is not None or size.max_pixels is not None):
        _fail(f"min_pixels/max_pixels apply to the Qwen archs only, not {arch}", "set image_size instead")
    if arch not in HYBRID_LAYER_KIND and size.full_attention_interval is not None:
        _fail(
            f"full_attention_interval applies to {' and '.join(HYBRID_LAYER_KIND)} only, not {arch}",
            f"drop it: every {arch} text layer uses full attention",
        )
    if arch != "gemma3" and size.sliding_window is not None:
        _fail(f"sliding_window applies to gemma3 only, not {arch}", "drop it, or build arch gemma3")

    filled: dict[str, Any] = {}
    if size.num_layers is None:
        filled["num_layers"] = _DEFAULT_NUM_LAYERS.get(arch, 3)
    if is_qwen:
        unit = (QWEN_PATCH_SIZE[arch] * QWEN_MERGE_SIZE) ** 2  # pixels per image token
        filled["min_pixels"] = unit if size.min_pixels is None else size.min_pixels
        filled["max_pixels"] = 4 * unit if size.max_pixels is None else size.max_pixels
    else:
        default_side, default_patch = _FIXED_IMAGE_DEFAULTS[arch]
        filled["image_size"] = default_side if size.image_size is None else size.image_size
        filled["image_patch_size"] = default_patch if size.image_patch_size is None else size.image_patch_size
    if arch in HYBRID_LAYER_KIND and size.full_attention_interval is None:
        filled["full_attention_interval"] = _DEFAULT_FULL_ATTENTION_INTERVAL
    if arch == "gemma3" and size.sliding_window is None:
        filled["sliding_window"] = _DEFAULT_SLIDING_WINDOW
    return dataclasses.replace(size, **filled)


def resolve_size(arch: str, overrides: dict[str, Any]) -> TinyVLMSize:
    """Merge overrides into the defaults, fill the per-arch knobs and validate everything."""
    size = _fill_arch_defaults(arch, _merge(TinyVLMSize, overrides, "size"))
    _check_positive_ints(size)
    is_qwen = arch in QWEN_PATCH_SIZE
    _check_text_shape(size, rotary_min_head_dim=8 if is_qwen else 2)

    _check_divides(
        size,
        "vision_hidden_size",
        "vision_num_heads",
        "choose vision_num_heads that divides vision_hidden_size",
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
        unit = (QWEN_PATCH_SIZE[arch] * QWEN_MERGE_SIZE) ** 2
        if size.min_pixels < unit or size.max_pixels < size.min_pixels:
            _fail(
                f"need {unit} <= min_pixels <= max_pixels, got min_pixels={size.min_pixels}, max_pixels={size.max_pixels}",
                f"one image token covers {unit} pixels; set max_pixels to n_tokens * {unit}",
            )
        return size

    grid, rem = divmod(size.image_size, size.image_patch_size)
    if arch == "llava_next":
        if rem:
            _fail(
                f"image_size {size.image_size} is not a multiple of image_patch_size {size.image_patch_size}",
                "e.g. image_size=32 with image_patch_size=16 (10 image tokens) or 8 (36 image tokens)",
            )
        return size
    factor, what = (SMOLVLM_SCALE_FACTOR, "pixel-shuffle") if arch == "smolvlm" else (GEMMA3_POOL, "pooling")
    if rem or grid % factor:
        _fail(
            f"image_size {size.image_size} must be image_patch_size {size.image_patch_size} times a multiple "
            f"of the {what} factor {factor}",
            "e.g. image_size=32 with image_patch_size=8, or image_size=64 with image_patch_size=8",
        )
    return size
