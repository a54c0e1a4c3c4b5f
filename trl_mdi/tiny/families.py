"""Configs and processors of the tiny Qwen3.5 (dense and MoE), Gemma 3 and LLaVA-NeXT models: parts 3 and 4
of the build described in `trl_mdi.tiny`, for the families whose text decoders are not plain full-attention
stacks (Qwen3.5, Gemma 3) or whose image features are laid out differently (LLaVA-NeXT). Gemma 4 is in
`gemma4_family`.

- qwen3_5: `Qwen3_5ForConditionalGeneration`; text layers mix Gated DeltaNet linear attention with
  full attention (`full_attention_interval`); Qwen3-VL's processor classes, as the checkpoints ship.
  Without flash-linear-attention / causal-conv1d installed, transformers runs the linear layers with
  its pure-PyTorch reference code (it logs a warning once): correct, and fast enough at this size.
- qwen3_5_moe: `Qwen3_5MoeForConditionalGeneration`, qwen3_5 with a sparse MoE block in every text layer:
  `num_experts` routed experts (top `num_experts_per_tok`) plus one sigmoid-gated shared expert, all
  `moe_intermediate_size` wide. Same tokenizer, processor, template and RoPE as qwen3_5.
- gemma3: `Gemma3ForConditionalGeneration` with a tiny SigLIP tower; text layers mix sliding-window
  and full attention (`full_attention_interval`, `sliding_window`); the projector average-pools
  GEMMA3_POOL x GEMMA3_POOL patches into one image token.
- llava_next: `LlavaNextForConditionalGeneration` with a tiny CLIP tower and a Llama text decoder;
  one tile for square images, so an image costs 2*g*g + g tokens (g = image_size / patch: the base
  view, the tile, one newline token per tile row).
"""

from __future__ import annotations

import math

from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessor,
    Gemma3Processor,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessor,
    LlavaNextProcessor,
    PreTrainedTokenizerFast,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
)

from .archs import llama_text_config, qwen_processor, qwen_token_ids, text_config_sizes, vit_config_sizes
from .sizes import GEMMA3_POOL, HYBRID_LAYER_KIND, QWEN_MERGE_SIZE, QWEN_PATCH_SIZE, TinyVLMSize

MODEL_CLASSES = {
    "qwen3_5": Qwen3_5ForConditionalGeneration,
    "gemma3": Gemma3ForConditionalGeneration,
    "llava_next": LlavaNextForConditionalGeneration,
    "qwen3_5_moe": Qwen3_5MoeForConditionalGeneration,
}


def hybrid_layer_types(arch: str, num_layers: int, full_attention_interval: int) -> list[str]:
    """`text_config.layer_types` of a hybrid arch: layer i is "full_attention" iff
    i % full_attention_interval == full_attention_interval - 1.

    The others are the arch's cheap kind ("linear_attention" for qwen3_5 and qwen3_5_moe,
    "sliding_attention" for gemma3 and gemma4). This is transformers' own rule for these families
    (default intervals 4 for Qwen3.5, 6 for Gemma).
    """
    cheap = HYBRID_LAYER_KIND[arch]
    return [
        "full_attention" if i % full_attention_interval == full_attention_interval - 1 else cheap
        for i in range(num_layers)
    ]


def qwen3_5_rope(head_dim: int) -> dict:
    """Qwen3.5's rope_parameters for a tiny head_dim: partial rotary, interleaved 3D (t, h, w) sections.

    The real models rotate a quarter of each 256-wide head (partial_rotary_factor 0.25) and split its
    32 frequencies [11, 11, 10]; with tiny heads a quarter leaves too few frequencies for three
    sections, so the factor grows (0.25 from head_dim 24, 0.5 from 12, else 1.0). Factors are powers of
    two, so int(head_dim * factor) is exact.
    """
    factor = 0.25 if head_dim >= 24 else 0.5 if head_dim >= 12 else 1.0
    half = int(head_dim * factor) // 2
    t = math.ceil(half / 3)
    h = math.ceil((half - t) / 2)
    return {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": factor,
        "mrope_section": [t, h, half - t - h],
        "mrope_interleaved": True,
    }


def _qwen3_5_parts(arch: str, size: TinyVLMSize, tok: PreTrainedTokenizerFast) -> tuple[dict, dict]:
    """(text_config, vision_config) entries that Qwen3.5 and Qwen3.5-MoE share."""
    head_dim = size.hidden_size // size.num_heads
    text = {
        **text_config_sizes(size, tok),
        "head_dim": head_dim,  # stored explicitly (default 256)
        "layer_types": hybrid_layer_types(arch, size.num_layers, size.full_attention_interval),
        # Gated DeltaNet layers: key heads like the KV heads, value heads like the query heads.
        "linear_num_key_heads": size.num_kv_heads,
        "linear_num_value_heads": size.num_heads,
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "rope_parameters": qwen3_5_rope(head_dim),
        "bos_token_id": tok.pad_token_id,  # as for the other Qwen archs: <|endoftext|>, never in prompts
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "dtype": "float32",
    }
    vision = {
        "depth": size.vision_depth,
        "hidden_size": size.vision_hidden_size,
        "intermediate_size": size.vision_intermediate_size,
        "num_heads": size.vision_num_heads,
        "patch_size": QWEN_PATCH_SIZE[arch],
        "spatial_merge_size": QWEN_MERGE_SIZE,
        "temporal_patch_size": 2,
        "out_hidden_size": size.hidden_size,
        "num_position_embeddings": 64,  # learned 8x8 grid, interpolated to the real grid (as Qwen3-VL)
        "dtype": "float32",
    }
    return text, vision


def _qwen3_5_config(size: TinyVLMSize, tok: PreTrainedTokenizerFast) -> Qwen3_5Config:
    text, vision = _qwen3_5_parts("qwen3_5", size, tok)
    return Qwen3_5Config(text_config=text, vision_config=vision, dtype="float32", **qwen_token_ids(tok))


def _qwen3_5_moe_config(size: TinyVLMSize, tok: PreTrainedTokenizerFast) -> Qwen3_5MoeConfig:
    text, vision = _qwen3_5_parts("qwen3_5_moe", size, tok)
    del text["intermediate_size"]  # no dense MLP: every layer's MLP is the MoE block below
    # The shared expert is as wide as a routed one, as in the real models (512 each in 35B-A3B).
    text |= {
        "num_experts": size.num_experts,
        "num_experts_per_tok": size.num_experts_per_tok,
        "moe_intermediate_size": size.moe_intermediate_size,
        "shared_expert_intermediate_size": size.moe_intermediate_size,
    }
    return Qwen3_5MoeConfig(text_config=text, vision_config=vision, dtype="float32", **qwen_token_ids(tok))


def _gemma3_config(size: TinyVLMSize, tok: PreTrainedTokenizerFast) -> Gemma3Config:
    head_dim = size.hidden_size // size.num_heads
    text = {
        **text_config_sizes(size, tok),
        "head_dim": head_dim,  # stored explicitly (default 256)
        "query_pre_attn_scalar": head_dim,  # queries scaled by head_dim**-0.5, as in the real models
        "layer_types": hybrid_layer_types("gemma3", size.num_layers, size.full_attention_interval),
        # Only feeds the BC attribute _sliding_window_pattern (else 6); layer_types is what counts.
        "sliding_window_pattern": size.full_attention_interval,
        "sliding_window": size.sliding_window,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "dtype": "float32",
    }
    vision = {
        "model_type": "siglip_vision_model",
        **vit_config_sizes(size),
        # Gemma 3 reads the tower's last hidden state: a pooling head would be dead weight that never
        # gets a gradient (and fails "every trainable parameter changed" checks).
        "vision_use_head": False,
        "dtype": "float32",
    }
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=_gemma3_image_tokens(size),
        boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),  # config.image_token_id
        dtype="float32",
    )


def _gemma3_image_tokens(size: TinyVLMSize) -> int:
    return (size.image_size // size.image_patch_size // GEMMA3_POOL) ** 2


def _gemma3_processor(size: TinyVLMSize, tok: PreTrainedTokenizerFast, chat_template: str) -> Gemma3Processor:
    image_processor = Gemma3ImageProcessor(size={"height": size.image_size, "width": size.image_size})
    # image_seq_length must equal the model's mm_tokens_per_image: the processor writes that many soft tokens.
    return Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=chat_template,
        image_seq_length=_gemma3_image_tokens(size),
    )


def _llava_next_pinpoints(size: TinyVLMSize) -> list[list[int]]:
    # One tile for square images, two for 1:2 / 2:1 ones: the real grids go up to 672x672 (4 tiles).
    s = size.image_size
    return [[s, s], [s, 2 * s], [2 * s, s]]


def _llava_next_config(size: TinyVLMSize, tok: PreTrainedTokenizerFast) -> LlavaNextConfig:
    vision = {
        "model_type": "clip_vision_model",
        **vit_config_sizes(size),
        "projection_dim": size.vision_hidden_size,  # unused by the tower; keeps the config tidy
        "dtype": "float32",
    }
    return LlavaNextConfig(
        text_config=llama_text_config(size, tok),
        vision_config=vision,
        image_token_index=tok.convert_tokens_to_ids("<image>"),  # also readable as config.image_token_id
        image_grid_pinpoints=_llava_next_pinpoints(size),
        # As the real checkpoints: features of the second-to-last CLIP layer, CLS token dropped (so the
        # last CLIP layer gets no gradient; TRL's own tests skip the vision tower for this reason).
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        image_seq_length=(size.image_size // size.image_patch_size) ** 2,
        tie_word_embeddings=False,
        dtype="float32",
    )


def _llava_next_processor(
    size: TinyVLMSize, tok: PreTrainedTokenizerFast, chat_template: str
) -> LlavaNextProcessor:
    s = size.image_size
    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": s},
        crop_size={"height": s, "width": s},
        image_grid_pinpoints=_llava_next_pinpoints(size),
    )
    return LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=size.image_patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token, which the "default" strategy drops again
        chat_template=chat_template,
    )


def config_and_processor(arch: str, size: TinyVLMSize, tok: PreTrainedTokenizerFast, chat_template: str):
    """(config, processor) of one of the archs in `MODEL_CLASSES`."""
    if arch == "qwen3_5":
        return _qwen3_5_config(size, tok), qwen_processor(arch, size, tok, chat_template)
    if arch == "qwen3_5_moe":
        return _qwen3_5_moe_config(size, tok), qwen_processor(arch, size, tok, chat_template)
    if arch == "gemma3":
        return _gemma3_config(size, tok), _gemma3_processor(size, tok, chat_template)
    return _llava_next_config(size, tok), _llava_next_processor(size, tok, chat_template)
