"""Tiny random-weight text-only Qwen2 models, for trainer drop-in tests that need a policy or a reward model.

`build_tiny_text_model("causal_lm")` gives a `Qwen2ForCausalLM`, `"sequence_classification"` a
`Qwen2ForSequenceClassification` with one label (what TRL loads a reward model as). Both use the Qwen
recipe of the tiny VLMs' tokenizer, passed through `Qwen2Tokenizer` (the class `AutoTokenizer` loads
for Qwen2 folders), with trl's `qwen2_5.jinja` chat template and left padding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

from .saving import check_out_dir, provenance, save_model_atomically
from .sizes import TinyTextSize, check_text_task, resolve_text_size
from .tokenizer import build_tokenizer, official_chat_template

TEXT_MODEL_META_FILE = "tiny_text_model.json"
_TEXT_FAMILY = "qwen2"  # tokenizer and chat-template key


def build_tiny_text_model(task: str = "causal_lm", *, seed: int = 0, **size_overrides: Any):
    """Build a tiny random-weight Qwen2 text model, fully offline.

    Args:
        task: "causal_lm" (Qwen2ForCausalLM) or "sequence_classification" (Qwen2ForSequenceClassification,
            num_labels=1, config.pad_token_id set so it can find each row's last real token).
        seed: seeds the weight initialisation; the global torch RNG state is left untouched.
        **size_overrides: any field of `TinyTextSize`: num_layers (default 2), hidden_size, num_heads,
            num_kv_heads, intermediate_size, max_position_embeddings.

    Returns:
        (model, tokenizer): the model in eval mode, float32, default (sdpa) attention.

    Raises:
        ValueError: unknown task, unknown knob, or sizes that do not fit together (the message names the fix).
    """
    check_text_task(task)
    return _build(task, seed, resolve_text_size(size_overrides))


def _build(task: str, seed: int, size: TinyTextSize):
    tok = build_tokenizer(_TEXT_FAMILY, official_chat_template(_TEXT_FAMILY), size.max_position_embeddings)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        max_position_embeddings=size.max_position_embeddings,
        bos_token_id=tok.pad_token_id,  # <|endoftext|>, as the real Qwen2 configs
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        num_labels=1,  # used by the sequence-classification head only
        dtype="float32",
    )
    model_cls = Qwen2ForCausalLM if task == "causal_lm" else Qwen2ForSequenceClassification
    with torch.random.fork_rng(devices=[]):  # seeding must not perturb the caller's RNG stream
        torch.manual_seed(seed)
        model = model_cls(config)
    model.eval()
    if task == "causal_lm":
        gen = model.generation_config
        gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = (
            tok.pad_token_id,
            tok.eos_token_id,
            tok.pad_token_id,
        )
    return model, tok


def save_tiny_text_model(
    out_dir: str | Path,
    task: str = "causal_lm",
    *,
    seed: int = 0,
    overwrite: bool = False,
    **size_overrides: Any,
) -> Path:
    """Build a tiny text model (see `build_tiny_text_model`) and save model + tokenizer to `out_dir`.

    The folder reloads with `AutoModelForCausalLM` / `AutoModelForSequenceClassification` and
    `AutoTokenizer.from_pretrained(out_dir)`; it also holds `tiny_text_model.json` (task, seed, sizes,
    parameter count). Written atomically, as `save_tiny_vlm` does.

    Raises:
        FileExistsError: `out_dir` exists, is not empty, and `overwrite` is False.
        ValueError: as for `build_tiny_text_model`.
    """
    check_text_task(task)
    out_dir = check_out_dir(out_dir, overwrite)
    size = resolve_text_size(size_overrides)  # before touching the disk: bad sizes fail fast
    model, tok = _build(task, seed, size)
    meta = provenance(model, size, task=task, seed=seed)
    save_model_atomically(model, tok, out_dir, {TEXT_MODEL_META_FILE: meta})
    return out_dir
