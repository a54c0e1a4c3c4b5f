"""Token layout: which keys are image / prompt text / completion / special, which queries are measured."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

QUERY_PHASES = ("completion", "prompt")


# --------------------------------------------------------------------------------------------------
# Token layout: which keys belong to which group, which queries are measured
# --------------------------------------------------------------------------------------------------
def image_token_ids(config) -> list[int]:
    """Placeholder token ids of images/videos from a VLM config; ValueError if the model has none."""
    ids = []
    for name in ("image_token_id", "video_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= 0 and value not in ids:
            ids.append(value)
    if not ids:
        raise ValueError(
            f"model type {getattr(config, 'model_type', type(config).__name__)!r} has no image_token_id in its "
            "config, so image tokens cannot be located. The attention probe needs a vision-language model whose "
            "config names its image placeholder token (Qwen2-VL/2.5-VL/3-VL, Idefics3/SmolVLM, LLaVA, ...)."
        )
    return ids


def template_text_exclusion_mask(input_ids: torch.Tensor, tokenizer, image_ids: Sequence[int] = ()) -> torch.Tensor:
    """Positions that ``text_keys="content"`` moves out of prompt text: special tokens and the system turn.

    Special tokens are the tokenizer's special and added-special ids (image/video placeholders excluded:
    they are image keys). The system turn is recognised for ChatML-style templates (Qwen, SmolVLM):
    from an ``<|im_start|>`` followed by the token(s) of ``system`` up to and including the next
    ``<|im_end|>``. For other templates only the special tokens are excluded.
    """
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False):
            special.add(int(tokenizer.convert_tokens_to_ids(str(tok))))
    special -= set(image_ids)
    excl = torch.isin(input_ids, torch.tensor(sorted(special), dtype=input_ids.dtype, device=input_ids.device))
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    unk = getattr(tokenizer, "unk_token_id", None)
    if start is None or end is None or start == unk or end == unk:
        return excl
    sys_ids = tokenizer.encode("system", add_special_tokens=False)
    ids = input_ids.tolist()
    for b, row in enumerate(ids):
        i = 0
        while i < len(row):
            if row[i] == start and row[i + 1 : i + 1 + len(sys_ids)] == sys_ids:
                j = i
                while j < len(row) and row[j] != end:
                    j += 1
                excl[b, i : j + 1] = True
                i = j
            i += 1
    return excl


@dataclass
class TokenLayout:
    groups: torch.Tensor  # (B, L, G) float one-hot over valid keys
    query_mask: torch.Tensor  # (B, L) bool
    span: tuple[int, int]  # [q0, q1) holding every measured query
    counts: torch.Tensor  # (B, G) long
    n_queries: torch.Tensor  # (B,)


def token_layout(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_region: torch.Tensor,
    image_ids: Sequence[int],
    mm_token_type_ids: torch.Tensor | None,
    exclusion: torch.Tensor | None,
    phase: str,
    completion_queries: torch.Tensor | None = None,
) -> TokenLayout:
    valid = attention_mask.bool()
    is_image = torch.isin(input_ids, torch.tensor(list(image_ids), device=input_ids.device, dtype=input_ids.dtype))
    if mm_token_type_ids is not None and mm_token_type_ids.shape == input_ids.shape:
        is_image = is_image | (mm_token_type_ids > 0)
    completion_region = completion_region.bool() & valid
    # Image keys live in the prompt: a generated placeholder id (TRL suppresses the image token when sampling, not
    # the video one) is text the model wrote, not an image.
    is_image = is_image & valid & ~completion_region
    prompt = valid & ~completion_region & ~is_image
    excluded = prompt & exclusion.bool() if exclusion is not None else torch.zeros_like(prompt)
    groups = torch.stack([is_image, prompt & ~excluded, completion_region & ~is_image, excluded], dim=-1)
    if phase == "completion":
        queries = completion_queries.bool() & valid if completion_queries is not None else completion_region
    elif phase == "prompt":
        # The prompt's own text after its last image token (the question, read after looking), so that
        # prompt-phase and generation-phase attention can be compared. Rows without an image: all prompt text.
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        last_img = torch.where(is_image, pos, torch.full_like(pos, -1)).amax(dim=1, keepdim=True)
        queries = (prompt & ~excluded) & (pos > last_img)
    else:
        raise ValueError(f"query phase must be one of {QUERY_PHASES}, got {phase!r}")
    cols = queries.any(dim=0).nonzero()
    span = (int(cols.min()), int(cols.max()) + 1) if len(cols) else (0, 0)
    return TokenLayout(groups.float(), queries, span, groups.sum(dim=1), queries.sum(dim=1))



def token_query_mask(layout: TokenLayout) -> torch.Tensor:
    """(B, L) bool: the measured queries and every valid position just before one, where the per-token image mass
    (``ModalityAttention.query_image_mass``) is recorded. Position p's logits choose token p + 1, so the mass at p is
    what the model looked at when it chose token p + 1."""
    q = layout.query_mask
    before = torch.nn.functional.pad(q[:, 1:], (0, 1), value=False)
    return (q | before) & (layout.groups.sum(-1) > 0)


def forward_tensors(kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    input_ids = kwargs.get("input_ids")
    if input_ids is None:
        raise ValueError("the attention probe needs input_ids in the model call (inputs_embeds alone hide image tokens)")
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if isinstance(attention_mask, dict) or attention_mask.dim() != 2:
        raise ValueError("the attention probe needs the 2-D (batch, seq) padding mask as attention_mask")
    return input_ids, attention_mask, kwargs.get("mm_token_type_ids")


def trailing_completion_layout(completion_length: int, image_ids: Sequence[int], tokenizer=None):
    """A probe ``layout_fn`` for forwards over ``prompt + completion`` whose last ``completion_length`` positions are
    the completion (TRL's log-prob forward): those are the measured queries. With ``tokenizer``, special tokens and
    the system turn are moved out of prompt text (``attention_text_keys="content"``)."""

    def layout_fn(kwargs: dict) -> TokenLayout:
        ids, am, mm = forward_tensors(kwargs)
        region = torch.zeros_like(am, dtype=torch.bool)
        region[:, ids.shape[1] - completion_length:] = True
        excl = template_text_exclusion_mask(ids, tokenizer, image_ids) if tokenizer is not None else None
        return token_layout(ids, am, region, image_ids, mm, excl, "completion")

    return layout_fn
