"""Per-architecture configs and processors of the first four tiny VLMs: parts 3 and 4 of the build
described in `trl_mdi.tiny` (Qwen3.5, Gemma 3 and LLaVA-NeXT are in `families`).

The three Qwen archs share one config builder and one processor builder (Qwen3.5 reuses the
processor one); SmolVLM (an Idefics3 model) has its own. Sizes come from a validated `TinyVLMSize`,
token ids from the tiny tokenizer.
"""

from __future__ import annotations

from typing import Any

from transformers import (
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessor,
    Idefics3Processor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from .sizes import QWEN_MERGE_SIZE, QWEN_PATCH_SIZE, SMOLVLM_SCALE_FACTOR, TinyVLMSize

MODEL_CLASSES = {
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen2_vl": Qwen2VLForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
    "smolvlm": Idefics3ForConditionalGeneration,  # SmolVLM (v1) checkpoints are Idefics3 models
}


def mrope_section(arch: str, head_dim: int) -> list[int]:
    """Split head_dim/2 rotary frequencies over (time, height, width), in the real models' proportions.

    transformers' default ([16, 24, 24] for Qwen2/2.5-VL, [24, 20, 20] for Qwen3-VL) assumes
    head_dim 128; with any other head_dim the split no longer sums to head_dim/2 and RoPE breaks.
    """
    half = head_dim // 2
    # Qwen2/2.5-VL: height and width get 3/8 of the frequencies each; Qwen3-VL (interleaved): 5/16.
    spatial = max(1, half * 5 // 16) if arch == "qwen3_vl" else max(1, half * 3 // 8)
    return [half - 2 * spatial, spatial, spatial]


def token_ids(tok: PreTrainedTokenizerFast, tokens: dict[str, str]) -> dict[str, int]:
    """{config key: token} as {config key: the token's id in `tok`}, in the same order."""
    return {key: tok.convert_tokens_to_ids(token) for key, token in tokens.items()}


def qwen_token_ids(tok: PreTrainedTokenizerFast) -> dict[str, int]:
    return token_ids(
        tok,
        {
            "image_token_id": "<|image_pad|>",
            "video_token_id": "<|video_pad|>",
            "vision_start_token_id": "<|vision_start|>",
            "vision_end_token_id": "<|vision_end|>",
        },
    )


def text_config_sizes(size: TinyVLMSize, tok: PreTrainedTokenizerFast) -> dict[str, Any]:
    """The text-decoder entries that every arch's config spells the same way."""
    return {
        "vocab_size": len(tok),
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_layers,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "max_position_embeddings": size.max_position_embeddings,
    }


def llama_text_config(size: TinyVLMSize, tok: PreTrainedTokenizerFast) -> dict[str, Any]:
    """The text_config of the archs whose decoder is a plain Llama (smolvlm, llava_next)."""
    return {
        "model_type": "llama",
        **text_config_sizes(size, tok),
        "rms_norm_eps": 1e-5,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def vit_config_sizes(size: TinyVLMSize) -> dict[str, Any]:
    """The vision_config entries that the ViT-style towers (SigLIP, CLIP, Idefics3's) spell the same way."""
    return {
        "hidden_size": size.vision_hidden_size,
        "intermediate_size": size.vision_intermediate_size,
        "num_hidden_layers": size.vision_depth,
        "num_attention_heads": size.vision_num_heads,
        "image_size": size.image_size,
        "patch_size": size.image_patch_size,
    }


def _qwen_config(arch: str, size: TinyVLMSize, tok: PreTrainedTokenizerFast):
    head_dim = size.hidden_size // size.num_heads
    text = {
        **text_config_sizes(size, tok),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0 if arch != "qwen3_vl" else 5_000_000.0,
            "mrope_section": mrope_section(arch, head_dim),
        },
        # The defaults are the real 150k-vocab ids, out of range here. Like the real configs, bos
        # is <|endoftext|> (which is also our pad token); Qwen prompts never start with it.
        "bos_token_id": tok.pad_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "dtype": "float32",
    }
    vision: dict[str, Any] = {
        "depth": size.vision_depth,
        "num_heads": size.vision_num_heads,
        "patch_size": QWEN_PATCH_SIZE[arch],
        "spatial_merge_size": QWEN_MERGE_SIZE,
        "temporal_patch_size": 2,
        "dtype": "float32",
    }
    if arch == "qwen2_vl":
        # Qwen2-VL names the vision width embed_dim; its hidden_size is the merger's output, i.e.
        # the text hidden size.
        vision |= {
            "embed_dim": size.vision_hidden_size,
            "hidden_size": size.hidden_size,
            "mlp_ratio": size.vision_intermediate_size // size.vision_hidden_size,
        }
        config_cls = Qwen2VLConfig
    elif arch == "qwen2_5_vl":
        vision |= {
            "hidden_size": size.vision_hidden_size,
            "intermediate_size": size.vision_intermediate_size,
            "out_hidden_size": size.hidden_size,
            # The real 32-block tower uses full attention in every 4th block, windowed elsewhere.
            "fullatt_block_indexes": sorted({*range(3, size.vision_depth, 4), size.vision_depth - 1}),
        }
        config_cls = Qwen2_5_VLConfig
    else:
        text["head_dim"] = head_dim  # Qwen3-VL stores head_dim explicitly (default 128)
        # Deepstack: features of a few intermediate vision blocks are added to the first text
        # layers (the real 27-block tower taps 3 of them); keep it to blocks before the last.
        taps = min(3, size.vision_depth - 1, size.num_layers)
        vision |= {
            "hidden_size": size.vision_hidden_size,
            "intermediate_size": size.vision_intermediate_size,
            "out_hidden_size": size.hidden_size,
            # Learned absolute positions on an 8x8 grid, bilinearly interpolated to the real grid.
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [(k + 1) * size.vision_depth // (taps + 1) - 1 for k in range(taps)],
        }
        config_cls = Qwen3VLConfig
    return config_cls(text_config=text, vision_config=vision, dtype="float32", **qwen_token_ids(tok))


def qwen_processor(arch: str, size: TinyVLMSize, tok: PreTrainedTokenizerFast, chat_template: str):
    patch = QWEN_PATCH_SIZE[arch]
    pixels = {"shortest_edge": size.min_pixels, "longest_edge": size.max_pixels}
    image_processor = Qwen2VLImageProcessor(
        size=pixels, patch_size=patch, merge_size=QWEN_MERGE_SIZE, temporal_patch_size=2
    )
    # The processors refuse to be built without a video processor, even if we never pass videos.
    # Qwen3.5 (dense and MoE) checkpoints ship Qwen3-VL's processor classes.
    if arch in ("qwen3_vl", "qwen3_5", "qwen3_5_moe"):
        video_processor = Qwen3VLVideoProcessor(
            size=pixels, patch_size=patch, merge_size=QWEN_MERGE_SIZE, temporal_patch_size=2,
            cap_pixels_per_frame=True,  # the announced future default; silences a warning per call
        )  # fmt: skip
        processor_cls = Qwen3VLProcessor
    else:
        video_processor = Qwen2VLVideoProcessor(
            size=pixels, patch_size=patch, merge_size=QWEN_MERGE_SIZE, temporal_patch_size=2
        )
        processor_cls = Qwen2_5_VLProcessor if arch == "qwen2_5_vl" else Qwen2VLProcessor
    return processor_cls(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=chat_template,
    )


def _smolvlm_config(size: TinyVLMSize, tok: PreTrainedTokenizerFast):
    return Idefics3Config(
        text_config=llama_text_config(size, tok),
        vision_config={**vit_config_sizes(size), "dtype": "float32"},
        scale_factor=SMOLVLM_SCALE_FACTOR,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )


def _smolvlm_processor(size: TinyVLMSize, tok: PreTrainedTokenizerFast, chat_template: str):
    # No splitting: every image becomes one global image_size x image_size view, so its token cost
    # is fixed (image_seq_len) instead of growing with the input resolution.
    image_processor = Idefics3ImageProcessor(
        do_image_splitting=False,
        size={"longest_edge": size.image_size},
        max_image_size={"longest_edge": size.image_size},
    )
    image_seq_len = (size.image_size // size.image_patch_size // SMOLVLM_SCALE_FACTOR) ** 2
    return Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        image_seq_len=image_seq_len,
        chat_template=chat_template,
    )


def config_and_processor(arch: str, size: TinyVLMSize, tok: PreTrainedTokenizerFast, chat_template: str):
    """(config, processor) of one of the archs in `MODEL_CLASSES`."""
    if arch == "smolvlm":
        return _smolvlm_config(size, tok), _smolvlm_processor(size, tok, chat_template)
    return _qwen_config(arch, size, tok), qwen_processor(arch, size, tok, chat_template)
