"""Tiny random-weight vision-language (and text-only) models, built fully offline.

Tests and CPU benchmarks need real model classes (the trainer and the attention probe touch their
internals), but the Hub is out of reach, so we assemble each model from parts:

1. a byte-level BPE tokenizer trained with `tokenizers` on a few KB of synthetic text that covers the
   vocabulary of our synthetic data (colours, shapes, digits, the system prompt, "Answer: X"), so
   those words cost one token each; special tokens come first, as in the real tokenizers;
2. the official chat template, read from trl's installed `chat_templates/` folder;
3. the real processor class (image processor + video processor for Qwen, Idefics3Processor for
   SmolVLM, Gemma3Processor, LlavaNextProcessor, Gemma4Processor) sized so that a 56x56 or 64x64 image
   costs 4 image tokens by default (10 for LLaVA-NeXT; 64 for Gemma 4, whose processor will not go lower);
4. the real `*ForConditionalGeneration` class with random weights drawn from a fixed seed.

Archs (`TINY_ARCHS`): qwen2_5_vl, qwen2_vl, qwen3_vl, smolvlm (Idefics3), qwen3_5 (hybrid linear /
full attention), gemma3 (hybrid sliding-window / full attention, SigLIP tower), llava_next (CLIP tower,
Llama decoder), qwen3_5_moe (qwen3_5 with sparse MoE MLPs), gemma4 (hybrid sliding-window / full
attention, per-layer embeddings, Gemma 4's own vision tower). `build_tiny_text_model` /
`save_tiny_text_model` build text-only Qwen2 models (a causal LM, or a one-logit sequence classifier to
serve as a reward model).

Everything is deterministic for a given seed: two builds give identical weights and identical
tokenizer files, also across processes. Saved folders reload with
`AutoModelForImageTextToText.from_pretrained(dir)` and `AutoProcessor.from_pretrained(dir)` (text
models: `AutoModelForCausalLM` / `AutoModelForSequenceClassification` and `AutoTokenizer`).

CLI:
    python -m trl_mdi.tiny --arch qwen2_5_vl --out /tmp/tiny-qwen2_5_vl [--seed 0] [--num_layers 8] ...
    python -m trl_mdi.tiny --arch gemma3 --out /tmp/tiny-gemma3 --sliding_window 8
    python -m trl_mdi.tiny --text_task sequence_classification --out /tmp/tiny-reward [--num_layers 2]

Layout: `tokenizer` builds parts 1 and 2, `archs` (the first four archs), `families` (Qwen3.5 dense and
MoE, Gemma 3, LLaVA-NeXT) and `gemma4_family` parts 3 and 4, `sizes` holds the size knobs, `resolve` their
per-arch defaults and checks, `text` the text-only models, `saving` the atomic save; building, saving and
the CLI of the VLMs are here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..data import DEFAULT_SYSTEM_PROMPT as DEFAULT_SYSTEM_PROMPT  # importable from here, as before
from . import archs, families, gemma4_family
from .archs import mrope_section as mrope_section  # tests call it as tiny.mrope_section
from .resolve import resolve_size
from .saving import check_out_dir, provenance, save_model_atomically
from .sizes import TEXT_TASKS, TINY_ARCHS, TinyTextSize, TinyVLMSize, check_arch
from .text import TEXT_MODEL_META_FILE, build_tiny_text_model, save_tiny_text_model
from .tokenizer import COLOURS as COLOURS
from .tokenizer import LETTERS as LETTERS
from .tokenizer import SHAPES as SHAPES
from .tokenizer import SINGLE_TOKEN_STRINGS as SINGLE_TOKEN_STRINGS
from .tokenizer import SYSTEM_PROMPT, build_tokenizer, official_chat_template

# The tokenizer helpers' former private names (tests call tiny._build_tokenizer / tiny._chat_template).
_build_tokenizer = build_tokenizer
_chat_template = official_chat_template

__all__ = [
    "TEXT_TASKS",
    "TINY_ARCHS",
    "SYSTEM_PROMPT",
    "TinyTextSize",
    "TinyVLMSize",
    "build_tiny_text_model",
    "build_tiny_vlm",
    "save_model_atomically",
    "save_tiny_text_model",
    "save_tiny_vlm",
    "main",
]

_BUILDERS = {arch: module for module in (archs, families, gemma4_family) for arch in module.MODEL_CLASSES}
_MODEL_CLASSES = {arch: module.MODEL_CLASSES[arch] for arch, module in _BUILDERS.items()}


def build_tiny_vlm(arch: str, *, seed: int = 0, **size_overrides: Any):
    """Build a tiny random-weight VLM of a real architecture, fully offline.

    Args:
        arch: one of `TINY_ARCHS`: "qwen2_5_vl" (Qwen2_5_VLForConditionalGeneration), "qwen2_vl",
            "qwen3_vl", "smolvlm" (Idefics3ForConditionalGeneration), "qwen3_5"
            (Qwen3_5ForConditionalGeneration), "gemma3" (Gemma3ForConditionalGeneration),
            "llava_next" (LlavaNextForConditionalGeneration), "qwen3_5_moe"
            (Qwen3_5MoeForConditionalGeneration) or "gemma4" (Gemma4ForConditionalGeneration).
        seed: seeds the weight initialisation; the same seed gives identical weights. The global
            torch RNG state is left untouched.
        **size_overrides: any field of `TinyVLMSize`: num_layers, hidden_size, num_heads,
            num_kv_heads, intermediate_size (text); vision_depth, vision_hidden_size,
            vision_num_heads, vision_intermediate_size (vision); max_position_embeddings;
            min_pixels/max_pixels (Qwen archs: image area bounds, hence image tokens per image);
            image_size/image_patch_size (smolvlm, gemma3, llava_next; gemma4: image_patch_size only);
            full_attention_interval (qwen3_5, gemma3, qwen3_5_moe, gemma4: which text layers use full
            attention, default 2); sliding_window (gemma3, gemma4, default 512); num_experts,
            num_experts_per_tok, moe_intermediate_size (qwen3_5_moe, default 4, 2, 32). num_layers
            defaults to 3 (4 for the hybrid archs).

    Returns:
        (model, processor): the model in eval mode, float32, default (sdpa) attention; the real
        processor class with the tiny tokenizer and the official chat template. The config carries
        the tokenizer's image token id as `config.image_token_id`: the placeholder the processor
        repeats once per image token (Gemma 3: <image_soft_token>, not the processor's
        image_token_id, which is the begin-of-image token; Gemma 4: <|image|>, which is also the
        processor's image_token_id), and for Qwen the video/vision-start/vision-end ids too.

    Raises:
        ValueError: unknown arch, unknown knob, or sizes that do not fit together (the message
            names the fix).
    """
    check_arch(arch)
    return _build(arch, seed, resolve_size(arch, size_overrides))


def _build(arch: str, seed: int, size: TinyVLMSize):
    chat_template = official_chat_template(arch)
    tok = build_tokenizer(arch, chat_template, size.max_position_embeddings)
    config, processor = _BUILDERS[arch].config_and_processor(arch, size, tok, chat_template)

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
    check_arch(arch)
    out_dir = check_out_dir(out_dir, overwrite)
    size = resolve_size(arch, size_overrides)  # before touching the disk: bad sizes fail fast
    model, processor = _build(arch, seed, size)
    meta = provenance(model, size, arch=arch, seed=seed)
    save_model_atomically(model, processor, out_dir, {"tiny_vlm.json": meta})
    return out_dir


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trl_mdi.tiny",
        description="Build a tiny random-weight vision-language model (or text-only model) offline and save it "
        "with save_pretrained.",
    )
    kind = parser.add_mutually_exclusive_group(required=True)
    kind.add_argument("--arch", choices=TINY_ARCHS, help="Vision-language architecture to build.")
    kind.add_argument(
        "--text_task",
        choices=TEXT_TASKS,
        help="Build a text-only Qwen2 model instead: causal_lm (Qwen2ForCausalLM) or sequence_classification "
        "(Qwen2ForSequenceClassification, 1 label: a reward model). Takes the text size flags only "
        f"({', '.join(f.name for f in dataclasses.fields(TinyTextSize))}); num_layers defaults to 2.",
    )
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
        if args.text_task is not None:
            what = f"text model {args.text_task}"
            out = save_tiny_text_model(
                args.out, args.text_task, seed=args.seed, overwrite=args.overwrite, **overrides
            )
            meta_file = TEXT_MODEL_META_FILE
        else:
            what = args.arch
            out = save_tiny_vlm(args.arch, args.out, seed=args.seed, overwrite=args.overwrite, **overrides)
            meta_file = "tiny_vlm.json"
    except (ValueError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    meta = json.loads((out / meta_file).read_text(encoding="utf-8"))
    files = sorted(p.name for p in out.iterdir())
    print(
        f"wrote {what} (seed {args.seed}, {meta['num_params']:,} parameters) to {out} "
        f"in {time.perf_counter() - start:.1f} s\nfiles: {', '.join(files)}"
    )
    return 0
