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

Layout: `tokenizer` builds parts 1 and 2, `archs` parts 3 and 4, `sizes` holds the size knobs and their
checks; building, saving and the CLI are here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..data import DEFAULT_SYSTEM_PROMPT as DEFAULT_SYSTEM_PROMPT  # importable from here, as before
from .archs import _MODEL_CLASSES, _qwen_config, _qwen_processor, _smolvlm_config, _smolvlm_processor
from .archs import _mrope_section as _mrope_section  # tests call it as tiny._mrope_section
from .sizes import TINY_ARCHS, TinyVLMSize, _check_arch, _resolve_size
from .tokenizer import COLOURS as COLOURS
from .tokenizer import LETTERS as LETTERS
from .tokenizer import SHAPES as SHAPES
from .tokenizer import SINGLE_TOKEN_STRINGS as SINGLE_TOKEN_STRINGS
from .tokenizer import SYSTEM_PROMPT, _build_tokenizer, _chat_template

__all__ = ["TINY_ARCHS", "SYSTEM_PROMPT", "TinyVLMSize", "build_tiny_vlm", "save_model_atomically", "save_tiny_vlm", "main"]


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
    meta = {"arch": arch, "seed": seed, "num_params": model.num_parameters(), "size": dataclasses.asdict(size)}
    save_model_atomically(model, processor, out_dir, {"tiny_vlm.json": meta})
    return out_dir


def save_model_atomically(model, processor, out_dir: Path, extra_json: dict[str, Any] | None = None) -> None:
    """``save_pretrained`` model and processor (plus ``{file name: JSON-able}`` files) into ``out_dir`` atomically.

    Everything is written to a temporary sibling first and renamed into place; an existing ``out_dir`` is moved
    aside before it is deleted. So a crash never leaves a half-written model where a loader would find it, and
    ``out_dir`` is never half-deleted. The caller decides whether replacing ``out_dir`` is allowed.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; other users' jobs may load the model
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        for name, data in (extra_json or {}).items():
            (tmp / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(old / out_dir.name)
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


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
