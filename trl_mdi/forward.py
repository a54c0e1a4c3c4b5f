"""The policy forward's inputs, rebuilt as TRL 1.16 builds them for its log-prob forward."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from trl.data_utils import apply_chat_template

from .data.images import row_images

# Keys of the processor output that TRL's log-prob forward accepts (its keyword arguments).
FORWARD_KEYS = (
    "pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
    "token_type_ids", "mm_token_type_ids", "image_position_ids",
)


def fit_width(t: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad with zeros or cut (B, C) to (B, width): TRL may pad completions to a multiple of N."""
    if t.shape[1] >= width:
        return t[:, :width]
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def rebuild_forward_inputs(processing_class, pad_token_id: int, chat_template_kwargs: dict, inputs: list[dict],
                           prompts: list, completion_ids_list: list, device) -> dict[str, Any]:
    """Prompt + completion tensors and multimodal kwargs, built as TRL 1.16 builds them for its log-prob forward.

    The chat-templated prompts go through the processor with the rows' images (left padding), completions are
    right-padded, token-type ids are extended with zeros over the completion. Every generated token is kept,
    truncated completions included (TRL masks those out of the loss only). tests/test_trl_contract.py checks that
    the result equals TRL's own inputs.
    """
    images = [row_images(x) for x in inputs]
    if all(not imgs for imgs in images):
        images = None
    texts = [apply_chat_template({"prompt": p}, processing_class, **chat_template_kwargs)["prompt"] for p in prompts]
    proc_kwargs = {"images": images} if images is not None else {}
    enc = processing_class(text=texts, padding=True, padding_side="left", return_tensors="pt", **proc_kwargs)
    enc = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in enc.items()}
    prompt_ids, prompt_mask = enc["input_ids"], enc["attention_mask"]
    c_len = max(1, max(len(c) for c in completion_ids_list))
    completion_ids = torch.full((len(prompts), c_len), pad_token_id, dtype=prompt_ids.dtype, device=device)
    completion_mask = torch.zeros((len(prompts), c_len), dtype=prompt_mask.dtype, device=device)
    for i, ids in enumerate(completion_ids_list):
        completion_ids[i, : len(ids)] = torch.as_tensor(list(ids), dtype=prompt_ids.dtype)
        completion_mask[i, : len(ids)] = 1
    forward_kwargs = {k: v for k, v in enc.items() if k in FORWARD_KEYS}
    for key in ("token_type_ids", "mm_token_type_ids"):
        if key in forward_kwargs:
            forward_kwargs[key] = torch.cat([forward_kwargs[key], forward_kwargs[key].new_zeros(completion_ids.shape)], 1)
    return {
        "input_ids": torch.cat([prompt_ids, completion_ids], dim=1),
        "attention_mask": torch.cat([prompt_mask, completion_mask], dim=1),
        "logits_to_keep": c_len,
        "num_images": [len(imgs) for imgs in images] if images is not None else None,
        **forward_kwargs,
    }


@contextlib.contextmanager
def rng_untouched(device: torch.device):
    """Fork the CPU RNG (and the device's, on an accelerator) so a forward inside consumes no random numbers."""
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            yield
        return
    index = device.index if device.index is not None else getattr(torch, device.type).current_device()
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        yield
