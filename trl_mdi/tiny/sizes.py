"""What `build_tiny_vlm` and `build_tiny_text_model` can build: the architectures, the size knobs, and their checks.

`resolve_text_size` merges and checks the text-only models' sizes here; `resolve.resolve_size` fills the
per-arch knobs of a VLM (image sizes, layer counts, attention layout, MoE routing) and checks that the sizes
fit together and fit the architecture. Every failure is a ValueError that names the fix.
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
    "qwen3_5_moe",
    "gemma4",
)
"""Architectures `build_tiny_vlm` knows; Qwen2.5-VL is the one the project targets first."""

TEXT_TASKS: tuple[str, ...] = ("causal_lm", "sequence_classification")
"""Tasks `build_tiny_text_model` knows: a Qwen2 causal LM (policy) or a one-logit Qwen2 reward model."""

# Vision patch sizes of the real checkpoints; the processor and the vision tower must agree on them.
QWEN_PATCH_SIZE = {"qwen2_5_vl": 14, "qwen2_vl": 14, "qwen3_vl": 16, "qwen3_5": 16, "qwen3_5_moe": 16}
QWEN_MERGE_SIZE = 2
SMOLVLM_SCALE_FACTOR = 2  # Idefics3 pixel shuffle: scale_factor**2 patches become one image token
GEMMA3_POOL = 2  # Gemma 3's projector average-pools GEMMA3_POOL x GEMMA3_POOL patches into one image token
# Gemma 4's vision pooler averages GEMMA4_POOL x GEMMA4_POOL patches into one image token (the real models: 3).
GEMMA4_POOL = 2
# Gemma 4's image processor accepts a soft-token budget of 70, 140, 280, 560 or 1120 only; we take the smallest,
# and every image is resized to the largest aspect-preserving size within it: 8 x 8 = 64 tokens if square.
GEMMA4_MAX_SOFT_TOKENS = 70

# The archs whose images are resized to one fixed square (image_size), and their (image_size, patch) defaults.
FIXED_IMAGE_DEFAULTS = {"gemma3": (32, 8), "llava_next": (32, 16), "smolvlm": (32, 8)}
# Archs that mix a cheap layer kind with full (softmax, global) attention, and the cheap kind's name.
HYBRID_LAYER_KIND = {
    "qwen3_5": "linear_attention",
    "gemma3": "sliding_attention",
    "qwen3_5_moe": "linear_attention",
    "gemma4": "sliding_attention",
}
SLIDING_WINDOW_ARCHS = ("gemma3", "gemma4")
MOE_ARCHS = ("qwen3_5_moe",)
# With interval 2: two full-attention layers.
DEFAULT_NUM_LAYERS = {"qwen3_5": 4, "gemma3": 4, "qwen3_5_moe": 4, "gemma4": 4}
DEFAULT_FULL_ATTENTION_INTERVAL = 2
DEFAULT_SLIDING_WINDOW = 512
DEFAULT_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
GEMMA4_DEFAULT_PATCH = 4  # a square image is resized to 8 * GEMMA4_POOL * patch = 64 pixels a side


@dataclasses.dataclass(frozen=True)
class TinyVLMSize:
    """Size knobs of a tiny VLM; every field can be overridden by keyword (or CLI flag).

    The defaults give about 0.2-0.35M parameters and 4 image tokens per 56x56 or 64x64 image (10 for
    llava_next, whose image features carry one newline token per row; 64 for gemma4, whose processor has a
    70-token minimum budget per image).
    """

    num_layers: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Text decoder layers. Default 3 (one per early/middle/late segment); 4 for the hybrid archs "
            "(qwen3_5, gemma3, qwen3_5_moe, gemma4), so that full_attention_interval 2 gives two full-attention layers."
        },
    )
    hidden_size: int = dataclasses.field(default=64, metadata={"help": "Text hidden size."})
    num_heads: int = dataclasses.field(
        default=4,
        metadata={
            "help": "Text attention heads; must divide hidden_size (qwen3_5, qwen3_5_moe: also their linear-attention value heads)."
        },
    )
    num_kv_heads: int = dataclasses.field(
        default=2,
        metadata={
            "help": "Text key/value heads (GQA); must divide num_heads (qwen3_5, qwen3_5_moe: also their linear-attention key heads)."
        },
    )
    intermediate_size: int = dataclasses.field(
        default=128, metadata={"help": "Text MLP width (qwen3_5_moe: unused, see moe_intermediate_size)."}
    )
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
            "help": "SmolVLM, Gemma 3, LLaVA-NeXT, Gemma 4: vision patch side in pixels. Default 8 (llava_next: 16; "
            f"gemma4: {GEMMA4_DEFAULT_PATCH}, where images are resized to 8 * {GEMMA4_POOL} * patch pixels a side "
            "if square)."
        },
    )
    full_attention_interval: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "qwen3_5, gemma3, qwen3_5_moe and gemma4 only: text layer i (from 0) uses full attention iff "
            "i + 1 is a multiple of it; the others are linear attention (qwen3_5, qwen3_5_moe: Gated DeltaNet) or "
            "sliding-window attention (gemma3, gemma4). Default 2; a value above num_layers gives no full-attention "
            "layer at all (gemma4: not allowed, its last layer must be full attention)."
        },
    )
    sliding_window: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "gemma3 and gemma4 only: how many most recent tokens (itself included) a sliding-attention "
            f"layer's query sees. Default {DEFAULT_SLIDING_WINDOW}; set it below the prompt length to cut the image off."
        },
    )
    num_experts: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": f"qwen3_5_moe only: routed experts per MoE layer. Default {DEFAULT_MOE['num_experts']}."
        },
    )
    num_experts_per_tok: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "qwen3_5_moe only: experts each token is routed to (top-k); at most num_experts. "
            f"Default {DEFAULT_MOE['num_experts_per_tok']}."
        },
    )
    moe_intermediate_size: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "qwen3_5_moe only: MLP width of each routed expert and of the shared expert. "
            f"Default {DEFAULT_MOE['moe_intermediate_size']}."
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


def fail(problem: str, fix: str) -> None:
    raise ValueError(f"{problem}. Fix: {fix}.")


def check_arch(arch: str) -> None:
    if arch not in TINY_ARCHS:
        fail(f"unknown tiny VLM arch {arch!r}", f"use one of {', '.join(TINY_ARCHS)}")


def check_text_task(task: str) -> None:
    if task not in TEXT_TASKS:
        fail(f"unknown tiny text model task {task!r}", f"use one of {', '.join(TEXT_TASKS)}")


def check_divides(size: Any, whole: str, part: str, fix: str) -> None:
    if getattr(size, whole) % getattr(size, part):
        fail(f"{whole} {getattr(size, whole)} is not divisible by {part} {getattr(size, part)}", fix)


def merge(cls: type, overrides: dict[str, Any], what: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        fail(f"unknown {what} knob(s) {unknown}", f"use only {sorted(known)}")
    return cls(**overrides)


def check_positive_ints(size: Any) -> None:
    for f in dataclasses.fields(size):
        value = getattr(size, f.name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            fail(
                f"{f.name} must be a positive integer, got {value!r}", f"pass e.g. {f.name}={f.default or 1}"
            )


def check_text_shape(size: Any, rotary_min_head_dim: int) -> None:
    """The text-decoder checks every arch shares: heads divide evenly, head_dim fits rotary embeddings."""
    check_divides(
        size, "hidden_size", "num_heads",
        "choose num_heads that divides hidden_size (e.g. hidden_size=256 with num_heads=8)",
    )  # fmt: skip
    check_divides(
        size, "num_heads", "num_kv_heads",
        "choose num_kv_heads that divides num_heads (e.g. num_heads=8 with num_kv_heads=2)",
    )  # fmt: skip
    head_dim = size.hidden_size // size.num_heads
    if head_dim % 2 or head_dim < rotary_min_head_dim:
        fail(
            f"text head_dim = hidden_size/num_heads = {head_dim} is too small or odd for rotary embeddings",
            "make hidden_size/num_heads even and at least 8 (e.g. hidden_size=64, num_heads=4 gives 16)",
        )


def resolve_text_size(overrides: dict[str, Any]) -> TinyTextSize:
    """Merge overrides into the `TinyTextSize` defaults and validate them."""
    size = merge(TinyTextSize, overrides, "text model size")
    check_positive_ints(size)
    check_text_shape(size, rotary_min_head_dim=8)
    return size
