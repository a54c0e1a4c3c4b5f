"""Tiny random-weight vision-language models, built fully offline.

Tests and CPU benchmarks need real model classes (the trainer and the attention probe touch their
internals), but the Hub is out of reach, so we assemble each model from parts:

1. a byte-level BPE tokenizer trained with `tokenizers` on a few KB of synthetic text that covers the
   vocabulary of our synthetic data (colours, shapes, digits, the system prompt, "Answer: X"), so
   those words cost one token each; special tokens come first, as in the real tokenizers;
2. the official chat template, read from trl's installed `chat_templates/` folder;
3. the real processor class (image processor + video processor for Qwen, Idefics3Processor for
   SmolVLM) sized so that a 56x56 or 64x64 image costs 4 image tokens by default;
4. the real `*ForConditionalGeneration` class with random weights drawn from a fixed seed.

Everything is deterministic for a given seed: two builds give identical weights and identical
tokenizer files, also across processes. Saved folders reload with
`AutoModelForImageTextToText.from_pretrained(dir)` and `AutoProcessor.from_pretrained(dir)`.

CLI:
    python -m trl_mdi.tiny --arch qwen2_5_vl --out /tmp/tiny-qwen2_5_vl [--seed 0] [--num_layers 8] ...
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
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

from .data import DEFAULT_SYSTEM_PROMPT  # noqa: E402

__all__ = ["TINY_ARCHS", "SYSTEM_PROMPT", "TinyVLMSize", "build_tiny_vlm", "save_tiny_vlm", "main"]

TINY_ARCHS: tuple[str, ...] = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "smolvlm")
"""Architectures `build_tiny_vlm` knows; Qwen2.5-VL is the one the project targets first."""

# The training script's system prompt: the tokenizer corpus includes it so it encodes to few tokens.
SYSTEM_PROMPT = DEFAULT_SYSTEM_PROMPT

# Colour and shape names our synthetic data draws from, and the multiple-choice letters.
COLOURS = tuple("red green blue yellow purple orange black white gray pink brown cyan".split())
SHAPES = tuple("circle square triangle star rectangle diamond hexagon pentagon cross heart".split())
LETTERS = ("A", "B", "C", "D")

# Strings that must encode to exactly one token: the reward parses the answer letter, and a letter
# split over two tokens would make the policy's choice depend on two sampling steps.
SINGLE_TOKEN_STRINGS = (" A", " B", " C", " D", "<think>", "</think>")

# Upper bound on BPE merges. The trainer stops earlier, once every word of the closed synthetic
# vocabulary is a single token, so every arch gets the same merges whatever its special tokens.
_MAX_BPE_MERGES = 320

_QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Idefics3Processor looks up <fake_token_around_image>, <image>, <global-img> and the 6x6
# <row_r_col_c> tags by name when it expands an image; <end_of_utterance> closes each chat turn.
_SMOLVLM_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<end_of_utterance>",
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
)

# Official templates shipped inside trl. Qwen2-VL has no file of its own: trl's README says Qwen2-VL
# ships a byte-identical template to Qwen2.5-VL, so it reuses qwen2_5_vl.jinja. SmolVLM (an
# Idefics3 model) uses smolvlm.jinja, the template SmolVLM checkpoints ship; idefics3.jinja is the
# Idefics3-8B-Llama3 one and starts with a Llama-3 <|begin_of_text|> token our tokenizer lacks.
_CHAT_TEMPLATE_FILES = {
    "qwen2_5_vl": "qwen2_5_vl.jinja",
    "qwen2_vl": "qwen2_5_vl.jinja",
    "qwen3_vl": "qwen3_vl.jinja",
    "smolvlm": "smolvlm.jinja",
}

_MODEL_CLASSES = {
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen2_vl": Qwen2VLForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
    "smolvlm": Idefics3ForConditionalGeneration,  # SmolVLM (v1) checkpoints are Idefics3 models
}

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

    if size.hidden_size % size.num_heads:
        _fail(
            f"hidden_size {size.hidden_size} is not divisible by num_heads {size.num_heads}",
            "choose num_heads that divides hidden_size (e.g. hidden_size=256 with num_heads=8)",
        )
    if size.num_heads % size.num_kv_heads:
        _fail(
            f"num_heads {size.num_heads} is not divisible by num_kv_heads {size.num_kv_heads}",
            "choose num_kv_heads that divides num_heads (e.g. num_heads=8 with num_kv_heads=2)",
        )
    head_dim = size.hidden_size // size.num_heads
    if head_dim % 2 or (is_qwen and head_dim < 8):
        _fail(
            f"text head_dim = hidden_size/num_heads = {head_dim} is too small or odd for rotary embeddings",
            "make hidden_size/num_heads even and at least 8 (e.g. hidden_size=64, num_heads=4 gives 16)",
        )
    if size.vision_hidden_size % size.vision_num_heads:
        _fail(
            f"vision_hidden_size {size.vision_hidden_size} is not divisible by vision_num_heads {size.vision_num_heads}",
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


# ---------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------


def _synthetic_corpus() -> list[str]:
    """Text that covers our synthetic data's vocabulary; fixed, so the tokenizer never varies.

    The answer letters rotate so " A".." D" are equally frequent; chat-template scaffolding words
    (system, user, Assistant, ...) are included so rendered prompts stay short.
    """
    lines = [SYSTEM_PROMPT] * 20
    # Role names open a line in both templates ("<|im_start|>assistant", "Assistant:"), so they are
    # trained both at the start of a sequence and after a space.
    for role in ("system", "user", "assistant", "System", "User", "Assistant"):
        lines += [f"{role}\n", f"{role}:", f"Picture 1: {role}"] * 10
    lines += ["0 1 2 3 4 5 6 7 8 9"] * 10
    for i, colour in enumerate(COLOURS):
        for j, shape in enumerate(SHAPES):
            letter = LETTERS[(i + j) % 4]
            count = (i * 3 + j) % 9 + 1
            options = "\n".join(f"{LETTERS[k]}. {COLOURS[(i + k) % len(COLOURS)]}" for k in range(4))
            lines += [
                f"What colour is the {shape} in the image?\n{options}",
                f"What color is the shape? What shape is in the image? It is a {colour} {shape}.",
                f"How many shapes are in the image? How many {colour} {shape}s are there? {count}",
                f"<think>The {shape} is {colour}. There are {count} shapes.</think>\nAnswer: {letter}",
                f"Answer: {letter}. The answer is {letter}, not {LETTERS[(i + j + 1) % 4]}.",
            ]
    return lines


def _train_bpe(special_tokens: tuple[str, ...]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # GPT-2 style byte-level pre-tokenization: every byte has a token, so nothing is ever unknown.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=len(special_tokens) + len(pre_tokenizers.ByteLevel.alphabet()) + _MAX_BPE_MERGES,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(), trainer)
    # Not special: decode(skip_special_tokens=True) must keep them, the format reward reads them.
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ("<think>", "</think>")])
    return tok


def _build_tokenizer(arch: str, chat_template: str, model_max_length: int) -> PreTrainedTokenizerFast:
    if arch == "smolvlm":
        tok = PreTrainedTokenizerFast(
            tokenizer_object=_train_bpe(_SMOLVLM_SPECIAL_TOKENS),
            bos_token="<|im_start|>",  # the template writes it; nothing adds it automatically
            eos_token="<end_of_utterance>",
            pad_token="<|endoftext|>",
            unk_token=None,
            padding_side="left",
            clean_up_tokenization_spaces=False,
            # Idefics3Processor registers <fake_token_around_image>, <image> and <end_of_utterance>
            # as the extra special tokens itself (replacing any list given here).
        )
    else:
        tok = PreTrainedTokenizerFast(
            tokenizer_object=_train_bpe(_QWEN_SPECIAL_TOKENS),
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            unk_token=None,
            padding_side="left",
            clean_up_tokenization_spaces=False,
            # Named model-specific tokens become tokenizer.image_token(_id) etc.; the Qwen processors
            # read image_token/video_token/vision_start_token/vision_end_token, the notes' spelling
            # vision_bos_token/vision_eos_token is what the Omni processors read.
            extra_special_tokens={
                "image_token": "<|image_pad|>",
                "video_token": "<|video_pad|>",
                "vision_start_token": "<|vision_start|>",
                "vision_end_token": "<|vision_end|>",
                "vision_bos_token": "<|vision_start|>",
                "vision_eos_token": "<|vision_end|>",
            },
        )
    tok.chat_template = chat_template
    tok.model_max_length = model_max_length
    for text in SINGLE_TOKEN_STRINGS:
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) != 1:  # a corpus edit broke the invariant: fail at build time, not in training
            raise RuntimeError(
                f"tiny tokenizer splits {text!r} into {len(ids)} tokens; extend _synthetic_corpus"
            )
    return tok


def _chat_template(arch: str) -> str:
    # Located without importing trl (a multi-second import) so the CLI stays quick.
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("trl is not installed; the tiny VLMs take their chat templates from it")
    path = Path(next(iter(spec.submodule_search_locations))) / "chat_templates" / _CHAT_TEMPLATE_FILES[arch]
    return path.read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------------
# Configs and processors
# ---------------------------------------------------------------------------------------------------


def _mrope_section(arch: str, head_dim: int) -> list[int]:
    """Split head_dim/2 rotary frequencies over (time, height, width), in the real models' proportions.

    transformers' default ([16, 24, 24] for Qwen2/2.5-VL, [24, 20, 20] for Qwen3-VL) assumes
    head_dim 128; with any other head_dim the split no longer sums to head_dim/2 and RoPE breaks.
    """
    half = head_dim // 2
    # Qwen2/2.5-VL: height and width get 3/8 of the frequencies each; Qwen3-VL (interleaved): 5/16.
    spatial = max(1, half * 5 // 16) if arch == "qwen3_vl" else max(1, half * 3 // 8)
    return [half - 2 * spatial, spatial, spatial]


def _qwen_token_ids(tok: PreTrainedTokenizerFast) -> dict[str, int]:
    ids = {
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
    }
    return {key: tok.convert_tokens_to_ids(token) for key, token in ids.items()}


def _qwen_config(arch: str, size: TinyVLMSize, tok: PreTrainedTokenizerFast):
    head_dim = size.hidden_size // size.num_heads
    text = {
        "vocab_size": len(tok),
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_layers,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "max_position_embeddings": size.max_position_embeddings,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0 if arch != "qwen3_vl" else 5_000_000.0,
            "mrope_section": _mrope_section(arch, head_dim),
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
        "patch_size": _QWEN_PATCH_SIZE[arch],
        "spatial_merge_size": _QWEN_MERGE_SIZE,
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
    return config_cls(text_config=text, vision_config=vision, dtype="float32", **_qwen_token_ids(tok))


def _qwen_processor(arch: str, size: TinyVLMSize, tok: PreTrainedTokenizerFast, chat_template: str):
    patch = _QWEN_PATCH_SIZE[arch]
    pixels = {"shortest_edge": size.min_pixels, "longest_edge": size.max_pixels}
    image_processor = Qwen2VLImageProcessor(
        size=pixels, patch_size=patch, merge_size=_QWEN_MERGE_SIZE, temporal_patch_size=2
    )
    # The processors refuse to be built without a video processor, even if we never pass videos.
    if arch == "qwen3_vl":
        video_processor = Qwen3VLVideoProcessor(
            size=pixels, patch_size=patch, merge_size=_QWEN_MERGE_SIZE, temporal_patch_size=2,
            cap_pixels_per_frame=True,  # the announced future default; silences a warning per call
        )  # fmt: skip
        processor_cls = Qwen3VLProcessor
    else:
        video_processor = Qwen2VLVideoProcessor(
            size=pixels, patch_size=patch, merge_size=_QWEN_MERGE_SIZE, temporal_patch_size=2
        )
        processor_cls = Qwen2_5_VLProcessor if arch == "qwen2_5_vl" else Qwen2VLProcessor
    return processor_cls(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=chat_template,
    )


def _smolvlm_config(size: TinyVLMSize, tok: PreTrainedTokenizerFast):
    text = {
        "model_type": "llama",
        "vocab_size": len(tok),
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_layers,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "max_position_embeddings": size.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    vision = {
        "hidden_size": size.vision_hidden_size,
        "intermediate_size": size.vision_intermediate_size,
        "num_hidden_layers": size.vision_depth,
        "num_attention_heads": size.vision_num_heads,
        "image_size": size.image_size,
        "patch_size": size.image_patch_size,
        "dtype": "float32",
    }
    return Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=_SMOLVLM_SCALE_FACTOR,
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
    image_seq_len = (size.image_size // size.image_patch_size // _SMOLVLM_SCALE_FACTOR) ** 2
    return Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        image_seq_len=image_seq_len,
        chat_template=chat_template,
    )


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------


def build_tiny_vlm(arch: str, *, seed: int = 0, **size_overrides: Any):
    """Build a tiny random-weight VLM of a real architecture, fully offline.

    Args:
        arch: one of `TINY_ARCHS`: "qwen2_5_vl" (Qwen2_5_VLForConditionalGeneration), "qwen2_vl",
            "qwen3_vl", or "smolvlm" (Idefics3ForConditionalGeneration).
        seed: seeds the weight initialisation; the same seed gives identical weights. The global
            torch RNG state is left untouched.
        **size_overrides: any field of `TinyVLMSize`: num_layers, hidden_size, num_heads,
            num_kv_heads, intermediate_size (text); vision_depth, vision_hidden_size,
            vision_num_heads, vision_intermediate_size (vision); max_position_embeddings;
            min_pixels/max_pixels (Qwen: image area bounds, hence image tokens per image);
            image_size/image_patch_size (SmolVLM).

    Returns:
        (model, processor): the model in eval mode, float32, default (sdpa) attention; the real
        processor class with the tiny tokenizer and the official chat template. The config carries
        the tokenizer's image/video/vision-start/vision-end token ids.

    Raises:
        ValueError: unknown arch, unknown knob, or sizes that do not fit together (the message
            names the fix).
    """
    _check_arch(arch)
    return _build(arch, seed, _resolve_size(arch, size_overrides))


def _build(arch: str, seed: int, size: TinyVLMSize):
    chat_template = _chat_template(arch)
    tok = _build_tokenizer(arch, chat_template, size.max_position_embeddings)

    if arch == "smolvlm":
        config = _smolvlm_config(size, tok)
        processor = _smolvlm_processor(size, tok, chat_template)
    else:
        config = _qwen_config(arch, size, tok)
        processor = _qwen_processor(arch, size, tok, chat_template)

    # fork_rng: seeding must not perturb the caller's RNG stream (tests and trainers seed their own).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _MODEL_CLASSES[arch](config)
    model.eval()

    gen = model.generation_config
    gen.bos_token_id = tok.bos_token_id
    gen.eos_token_id = tok.eos_token_id
    gen.pad_token_id = tok.pad_token_id
    return model, processor


def save_tiny_vlm(
    arch: str, out_dir: str | Path, *, seed: int = 0, overwrite: bool = False, **size_overrides: Any
) -> Path:
    """Build a tiny VLM (see `build_tiny_vlm`) and save model + processor to `out_dir`.

    The folder is written to a temporary sibling first and renamed into place, so a crash never
    leaves a half-written model where a loader would find it. Besides the `save_pretrained` files it
    holds `tiny_vlm.json` (arch, seed, sizes, parameter count) for provenance.

    Args:
        arch, seed, **size_overrides: as for `build_tiny_vlm`.
        out_dir: target folder; it may be missing or empty.
        overwrite: replace an existing non-empty `out_dir` instead of refusing.

    Returns:
        The resolved `out_dir`.

    Raises:
        FileExistsError: `out_dir` exists, is not empty, and `overwrite` is False.
        ValueError: as for `build_tiny_vlm`.
    """
    _check_arch(arch)
    out_dir = Path(out_dir).expanduser().resolve()
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory; choose another --out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} is not empty; pass overwrite=True (CLI: --overwrite) to replace it")

    size = _resolve_size(arch, size_overrides)  # before touching the disk: bad sizes fail fast
    model, processor = _build(arch, seed, size)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; other users' jobs may load the model
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        meta = {
            "arch": arch,
            "seed": seed,
            "num_params": model.num_parameters(),
            "size": dataclasses.asdict(size),
        }
        (tmp / "tiny_vlm.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if out_dir.exists():
            # Move the old folder aside before deleting it, so out_dir is never missing for long
            # and never half-deleted.
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(old / out_dir.name)
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trl_mdi.tiny",
        description="Build a tiny random-weight vision-language model offline and save it with save_pretrained.",
    )
    parser.add_argument("--arch", required=True, choices=TINY_ARCHS, help="Architecture to build.")
    parser.add_argument(
        "--out", required=True, type=Path, help="Output folder (missing or empty unless --overwrite)."
    )
    parser.add_argument("--seed", type=int, default=0, help="Weight-initialisation seed (default 0).")
    parser.add_argument("--overwrite", action="store_true", help="Replace a non-empty output folder.")
    # One flag per TinyVLMSize field, so the CLI can never drift from the Python API.
    for f in dataclasses.fields(TinyVLMSize):
        default = "per-arch" if f.default is None else f.default
        parser.add_argument(
            f"--{f.name}", type=int, default=None, help=f"{f.metadata['help']} (default {default})"
        )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: build, save, and print what was written. Returns the exit code."""
    args = _parse_args(argv)
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TinyVLMSize)
        if getattr(args, f.name) is not None
    }
    start = time.perf_counter()
    try:
        out = save_tiny_vlm(args.arch, args.out, seed=args.seed, overwrite=args.overwrite, **overrides)
    except (ValueError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    meta = json.loads((out / "tiny_vlm.json").read_text(encoding="utf-8"))
    files = sorted(p.name for p in out.iterdir())
    print(
        f"wrote {args.arch} (seed {args.seed}, {meta['num_params']:,} parameters) to {out} "
        f"in {time.perf_counter() - start:.1f} s\nfiles: {', '.join(files)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
