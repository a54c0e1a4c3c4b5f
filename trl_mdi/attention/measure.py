"""``measure_modality_attention``: the probe's public one-call measurement of a batch."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from .layout import TokenLayout, forward_tensors, image_token_ids, template_text_exclusion_mask, token_layout
from .model_facts import model_facts, unwrap_model
from .probe import probe_attention
from .result import ModalityAttention


def measure_modality_attention(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    query_phase: str = "completion",
    text_keys: str = "all",
    tokenizer=None,
    image_map_rows: Sequence[int] = (),
    token_segment: str | None = None,
    segments: str | dict | None = "thirds",
    route: str = "indicator",
    **multimodal_inputs,
) -> ModalityAttention:
    """Measure, per row and text layer, the attention mass of the generated tokens on each key group.

    One teacher-forced, no-grad forward of ``model`` over prompt + completion (the layer outputs from the model's
    own SDPA or eager kernel, from SDPA under other implementations), exact (no sampling of heads or layers), O(L)
    extra memory.

    Args:
        model: a transformers VLM (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Idefics3/SmolVLM, ...), plain,
            PEFT-wrapped, inside DDP, or a DeepSpeed ZeRO-3 engine / its module.
        input_ids, attention_mask: (B, L) prompt + completion, as GRPOTrainer builds them (prompts
            left-padded, completions right-padded); any padding layout works.
        completion_mask: (B, L), 1 on the generated tokens. Keys at or after a row's first generated
            token form the ``completion`` group; with ``query_phase="completion"`` these tokens are also
            the measured queries. A row with no generated token gets NaN masses and ``valid=False``.
        query_phase: ``"completion"`` (default): the generated tokens are the queries (generation-phase
            attention). ``"prompt"``: the prompt's own text tokens after its last image token are the
            queries (prompt-phase attention, e.g. the question read after the image).
        text_keys: ``"all"`` (default): every non-image prompt token counts as prompt text, chat-template
            special tokens and the system prompt included. ``"content"``: special tokens and the system
            turn go to the ``special`` group instead (needs ``tokenizer``).
        tokenizer: the processor's tokenizer; required for ``text_keys="content"``.
        image_map_rows: row indices for which to also return the mass on every individual image token
            (``ModalityAttention.image_token_mass``), for attention maps.
        token_segment: a layer segment of ``segments`` (e.g. ``"late"``): also return, per query token, the
            attention mass on image keys averaged over heads and over that segment's measured layers
            (``ModalityAttention.query_image_mass``, (B, L), 0 at positions that are no query): a per-token
            perception signal. A segment the model does not have (1-2 layers, few softmax layers) falls back to
            ``"all"`` with a warning.
        route: how each layer's masses are computed: ``"indicator"`` (default: one SDPA call whose values are the
            key groups' indicator columns) or ``"lse"`` (flex attention's log-sum-exp over each group's keys); both
            exact (``trl_mdi.attention.routes``).
        **multimodal_inputs: pixel_values, image_grid_thw, mm_token_type_ids, pixel_attention_mask, ...
            exactly as the processor or GRPOTrainer produce them.

    Returns:
        :class:`ModalityAttention`. Image keys are the image/video placeholder tokens (``input_ids ==
        config.image_token_id`` / ``video_token_id``, or ``mm_token_type_ids > 0``).

    The model's attention implementation is switched only for this call (text config only) and restored
    afterwards; the model's outputs are unchanged.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    for name, t in (("attention_mask", attention_mask), ("completion_mask", completion_mask)):
        if t.shape != input_ids.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but input_ids has {tuple(input_ids.shape)}: pass the full "
                "prompt + completion layout, e.g. torch.cat([prompt_mask, completion_mask], dim=1)"
            )
    if text_keys not in ("all", "content"):
        raise ValueError(f"text_keys must be 'all' or 'content', got {text_keys!r}")
    if text_keys == "content" and tokenizer is None:
        raise ValueError("text_keys='content' needs the tokenizer to find special tokens and the system turn")
    base = unwrap_model(model)
    image_ids = image_token_ids(base.config)
    completion_mask = completion_mask.bool()
    pos = torch.arange(input_ids.shape[1], device=input_ids.device)
    first = torch.where(completion_mask, pos, torch.full_like(pos, input_ids.shape[1])).amin(dim=1, keepdim=True)
    completion_region = pos >= first
    exclusion = template_text_exclusion_mask(input_ids, tokenizer, image_ids) if text_keys == "content" else None

    def layout_fn(kwargs: dict) -> TokenLayout:
        ids, am, mm = forward_tensors(kwargs)
        return token_layout(ids, am, completion_region, image_ids, mm, exclusion, query_phase, completion_mask)

    # The masses come from inside the layers: ask for one position of logits, not (B, L, vocab), which at a real
    # vocabulary (152k for Qwen2.5-VL) costs more memory than the whole rest of the forward.
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}
    token_layers = _segment_layers(base, segments, token_segment) if token_segment else ()
    with torch.no_grad(), probe_attention(model, layout_fn, image_map_rows, token_layers, route) as state:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra, **multimodal_inputs)
    return state.result()


def _segment_layers(model: torch.nn.Module, segments, name: str) -> tuple[int, ...]:
    """The measured layers of segment ``name`` on this model (``"all"`` when the model has no such segment)."""
    from .metrics import token_segment_layers

    facts = model_facts(model.config)
    return token_segment_layers(facts.num_layers, segments, list(facts.measured_layers), name)
