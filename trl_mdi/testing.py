"""Helpers shared by the tests and the benchmarks: GRPO-shaped batches and eager reference masses."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from PIL import Image, ImageDraw


def shape_image(size: int = 56, seed: int = 0) -> Image.Image:
    """A small RGB image with one filled shape, varying with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    colours = [(220, 30, 30), (30, 180, 30), (30, 60, 220), (230, 200, 20)]
    img = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    c = colours[int(torch.randint(0, len(colours), (1,), generator=g))]
    m = size // 6
    draw.ellipse([m, m, size - m, size - m], fill=c)
    return img


def chat_prompt(processor, text: str, with_image: bool | int) -> str:
    """The chat-templated prompt with ``with_image`` image placeholders (True = 1) before the text."""
    content = [{"type": "image"}] * int(with_image) + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    return processor.apply_chat_template(messages, add_generation_prompt=True)


def grpo_batch(
    processor,
    prompts: Sequence[str],
    images: Sequence[Image.Image | Sequence[Image.Image] | None],
    completion_lengths: Sequence[int],
    *,
    forbidden_ids: Sequence[int] = (),
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Build a batch laid out as GRPOTrainer lays it out: left-padded prompts, right-padded completions.

    Completion tokens are random ids (not image placeholders): the probe needs no generator, only ids.
    Returns input_ids, attention_mask, completion_mask (over the full length) and the processor's
    multimodal tensors (mm_token_type_ids extended with zeros over the completion, as TRL does).
    """
    # One image list per row, as TRL passes them: processors that pair images with rows (Gemma 3) need the nesting.
    # A row is one image, a list of images (multi-image rows) or None.
    imgs = [list(img) if isinstance(img, (list, tuple)) else [img] if img is not None else [] for img in images]
    texts = [chat_prompt(processor, p, len(row)) for p, row in zip(prompts, imgs)]
    tok = processor.tokenizer
    tok.padding_side = "left"
    enc = processor(text=texts, images=imgs if any(imgs) else None, return_tensors="pt", padding=True)
    prompt_ids, prompt_mask = enc.pop("input_ids"), enc.pop("attention_mask")
    g = torch.Generator().manual_seed(seed)
    c_len = max(completion_lengths)
    # Ordinary tokens only: special ids (image placeholders included) never come out of a sampler.
    banned = set(tok.all_special_ids) | set(forbidden_ids)
    allowed = torch.tensor([i for i in range(len(tok)) if i not in banned])
    completion = allowed[torch.randint(0, len(allowed), (len(texts), c_len), generator=g)]
    c_mask = torch.zeros(len(texts), c_len, dtype=torch.long)
    for i, n in enumerate(completion_lengths):
        c_mask[i, :n] = 1
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    completion = torch.where(c_mask.bool(), completion, torch.full_like(completion, pad))
    out = {
        "input_ids": torch.cat([prompt_ids, completion], dim=1),
        "attention_mask": torch.cat([prompt_mask, c_mask], dim=1),
        "completion_mask": torch.cat([torch.zeros_like(prompt_mask), c_mask], dim=1),
    }
    if "mm_token_type_ids" in enc:
        mm = enc.pop("mm_token_type_ids")
        out["mm_token_type_ids"] = torch.cat([mm, torch.zeros_like(completion)], dim=1)
    out.update({k: v for k, v in enc.items() if isinstance(v, torch.Tensor)})
    return out


@torch.no_grad()
def eager_group_masses(attentions: Sequence[torch.Tensor], groups: torch.Tensor, query_mask: torch.Tensor) -> torch.Tensor:
    """Reference masses from materialised attention weights.

    ``attentions``: per layer (B, H, L, L) weights (``output_attentions=True`` with eager attention);
    ``groups``: (B, L, G) 0/1 key-group indicators; ``query_mask``: (B, L) measured queries.
    Returns (B, num_layers, G): ``mean_q mean_h sum_{k in g} A[b, h, q, k]``.
    """
    out = []
    q = query_mask.double()
    for a in attentions:
        per_q = torch.einsum("bhqk,bkg->bqg", a.double(), groups.double()) / a.shape[1]
        out.append(torch.einsum("bqg,bq->bg", per_q, q) / q.sum(dim=1, keepdim=True).clamp(min=1))
    return torch.stack(out, dim=1)


def eager_masses(eager_model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference masses of a ``grpo_batch`` from ``eager_model``'s materialised attention weights: (B, layers with
    weights, 4) masses on image / prompt text / completion / special keys (special empty) over the completion
    queries, and the (B, L, 4) key groups. A hybrid model returns weights for its softmax layers only."""
    from .attention import image_token_ids

    with torch.no_grad():
        out = eager_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_attentions=True,
                          **{k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask",
                                                                        "completion_mask")})
    ids, am, cm = batch["input_ids"], batch["attention_mask"].bool(), batch["completion_mask"].bool()
    img = torch.isin(ids, torch.tensor(image_token_ids(eager_model.config))) & am
    pos = torch.arange(ids.shape[1])
    comp = (pos >= torch.where(cm, pos, ids.shape[1]).amin(dim=1, keepdim=True)) & am
    groups = torch.stack([img, am & ~comp & ~img, comp & ~img, torch.zeros_like(img)], dim=-1)
    return eager_group_masses([a for a in out.attentions if a is not None], groups, cm), groups


def zen_image_dataset(n: int = 12, *, images_per_row: Sequence[int] | None = None, seed: int = 0):
    """A prompt-only conversational dataset shaped like TRL's test sets ``zen-image`` / ``zen-multi-image``.

    Each row has a user message (plain-string content, as TRL's sets have; TRL inserts the image blocks) and either
    an ``image`` column (``images_per_row`` None) or an ``images`` column of lists with ``images_per_row[i % len]``
    images each (0 = a text-only row).
    """
    from datasets import Dataset

    questions = ["What colour is the shape?", "Describe the picture.", "Is the shape round?", "What is in the image?",
                 "Which colour dominates?", "How big is the shape?"]
    rows: dict[str, list] = {"prompt": []}
    for i in range(n):
        rows["prompt"].append([{"role": "user", "content": questions[i % len(questions)]}])
        if images_per_row is None:
            rows.setdefault("image", []).append(shape_image(56, seed + i))
        else:
            k = images_per_row[i % len(images_per_row)]
            rows.setdefault("images", []).append([shape_image(56, seed + 10 * i + j) for j in range(k)])
    return Dataset.from_dict(rows)
