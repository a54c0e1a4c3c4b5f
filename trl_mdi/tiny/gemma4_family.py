"""Config and processor of the tiny Gemma 4 model: parts 3 and 4 of the build described in `trl_mdi.tiny`.

- gemma4: `Gemma4ForConditionalGeneration` (what `AutoModelForImageTextToText` maps model_type "gemma4" to)
  with `Gemma4Processor`. Shaped like the small checkpoints (gemma-4-E2B/E4B): text layers mix
  sliding-window and full attention (`full_attention_interval`, `sliding_window`; transformers forces the
  last layer to full attention), full-attention layers use heads twice as wide with proportional RoPE on a
  quarter of them, per-layer embeddings (PLE) feed every layer, logits are soft-capped at 30, causal
  attention over image tokens too (no bidirectional vision mask). Left at their defaults (off): KV sharing
  across layers, the MoE block, attention_k_eq_v. No audio tower (audio_config None).
- Vision: Gemma 4's own tower (2D axial RoPE, learned x/y position tables) on `image_patch_size` patches,
  averaged GEMMA4_POOL x GEMMA4_POOL into one image token.
- Image tokens: the image processor only accepts soft-token budgets of 70, 140, 280, 560 or 1120 per image
  and resizes every image to the largest aspect-preserving size whose pooled grid fits the budget. We take
  70, the smallest, so a square image of any size becomes 8 x 8 = 64 image tokens (side 8 * pool * patch
  pixels); fewer would need the processor's check bypassed.
- Token ids: `config.image_token_id` is <|image|>, which is also what the template writes and what the
  processor expands (to <|image> + n x <|image|> + <image|>), so `processor.image_token_id` equals it too.
  The processor also returns `mm_token_type_ids` (1 on image tokens), which the model accepts.
"""

from __future__ import annotations

import math

from transformers import (
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4ImageProcessor,
    Gemma4Processor,
    Gemma4VideoProcessor,
    PreTrainedTokenizerFast,
)
from transformers.models.gemma4 import Gemma4AudioFeatureExtractor

from .archs import text_config_sizes, token_ids
from .families import hybrid_layer_types
from .sizes import GEMMA4_MAX_SOFT_TOKENS, GEMMA4_POOL, TinyVLMSize

MODEL_CLASSES = {"gemma4": Gemma4ForConditionalGeneration}

# The real models' full-attention heads are twice as wide as their sliding ones (512 vs 256).
_GLOBAL_HEAD_DIM_FACTOR = 2
_FINAL_LOGIT_SOFTCAP = 30.0  # as the real configs
# What a square image costs: the largest square pooled grid within the budget.
SQUARE_IMAGE_TOKENS = math.isqrt(GEMMA4_MAX_SOFT_TOKENS) ** 2


# The config's token-id entries, as {config key: token}.
_CONFIG_TOKENS = {
    "image_token_id": "<|image|>",
    "boi_token_id": "<|image>",
    "eoi_token_id": "<image|>",
    "video_token_id": "<|video|>",
    "audio_token_id": "<|audio|>",
    "boa_token_id": "<|audio>",
    "eoa_token_index": "<audio|>",  # sic: transformers' name
}


def _gemma4_config(size: TinyVLMSize, tok: PreTrainedTokenizerFast) -> Gemma4Config:
    head_dim = size.hidden_size // size.num_heads
    text = {
        **text_config_sizes(size, tok),
        "head_dim": head_dim,  # sliding layers (default 256)
        "global_head_dim": _GLOBAL_HEAD_DIM_FACTOR * head_dim,  # full-attention layers (default 512)
        "layer_types": hybrid_layer_types("gemma4", size.num_layers, size.full_attention_interval),
        "sliding_window": size.sliding_window,
        "final_logit_softcapping": _FINAL_LOGIT_SOFTCAP,
        # Per-layer embeddings: a small embedding of the token for every layer (default 262144 x 256 each).
        "vocab_size_per_layer_input": len(tok),
        "hidden_size_per_layer_input": size.hidden_size // 4,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,  # also what image positions are embedded as before the merge
        "dtype": "float32",
    }
    vision_head_dim = size.vision_hidden_size // size.vision_num_heads
    vision = {
        "hidden_size": size.vision_hidden_size,
        "intermediate_size": size.vision_intermediate_size,
        "num_hidden_layers": size.vision_depth,
        "num_attention_heads": size.vision_num_heads,
        "num_key_value_heads": size.vision_num_heads,
        "head_dim": vision_head_dim,  # default 64
        "patch_size": size.image_patch_size,
        "pooling_kernel_size": GEMMA4_POOL,
        # Rows of the learned x and y position tables (default 10240): enough for the longest side the
        # processor can produce, 70 pooled cells of GEMMA4_POOL patches.
        "position_embedding_size": GEMMA4_MAX_SOFT_TOKENS * GEMMA4_POOL,
        "dtype": "float32",
    }
    return Gemma4Config(
        text_config=text, vision_config=vision, dtype="float32", **token_ids(tok, _CONFIG_TOKENS)
    )


def _gemma4_processor(size: TinyVLMSize, tok: PreTrainedTokenizerFast, chat_template: str) -> Gemma4Processor:
    shape = {
        "patch_size": size.image_patch_size,
        "max_soft_tokens": GEMMA4_MAX_SOFT_TOKENS,
        "pooling_kernel_size": GEMMA4_POOL,
    }
    # The processor requires all four parts; the audio feature extractor (no weights) keeps its defaults.
    return Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessor(**shape),
        tokenizer=tok,
        video_processor=Gemma4VideoProcessor(**shape),
        chat_template=chat_template,
        # Informational only: the processor counts each image's tokens from its resized size.
        image_seq_length=SQUARE_IMAGE_TOKENS,
    )


def config_and_processor(arch: str, size: TinyVLMSize, tok: PreTrainedTokenizerFast, chat_template: str):
    """(config, processor) of one of the archs in `MODEL_CLASSES`."""
    return _gemma4_config(size, tok), _gemma4_processor(size, tok, chat_template)
