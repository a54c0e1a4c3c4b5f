"""Exact text/vision attention mass per layer, in O(sequence length) memory, with the SDPA kernel.

How it works. Attention weights are never materialised. For every text attention layer the probe runs
one extra ``scaled_dot_product_attention`` call on the same queries and keys whose *value* tensor holds
indicator columns, one per key group (image, prompt text, completion, special)::

    softmax(q k^T / sqrt(d) + mask) @ [1_image | 1_prompt_text | 1_completion | 1_special]

which is, per query and head, exactly the attention mass on each group, computed by the same fused,
memory-efficient kernels that compute the model's own attention. Only the rows of the measured queries
are passed (the span that holds them), so the extra cost is a fraction of one attention call per layer.

Scoping. The probe registers its attention function under its own name ("trl_mdi_probe", never
replacing "sdpa" or another built-in), points only the *text* config at it for the duration of a
``with`` block, and restores the previous implementation on exit, exceptions included. Inside the
block the text attention output is computed by transformers' own SDPA path with the same mask, so the
model's outputs are those of its SDPA implementation. The vision tower is untouched.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import metrics as M

PROBE_ATTN_IMPLEMENTATION = "trl_mdi_probe"
GROUPS = ("image", "prompt_text", "completion", "special")
_IMAGE, _PROMPT_TEXT, _COMPLETION, _SPECIAL = range(len(GROUPS))
QUERY_PHASES = ("completion", "prompt")

# The probe active in this context (thread / task); the registered attention function reads it.
_ACTIVE: contextvars.ContextVar[_ProbeState | None] = contextvars.ContextVar("trl_mdi_probe", default=None)


# --------------------------------------------------------------------------------------------------
# Result
# --------------------------------------------------------------------------------------------------
@dataclass
class ModalityAttention:
    """Per-row, per-layer attention mass of the measured queries on each key group.

    Masses are averaged over heads, then over the row's measured query tokens. For each layer and valid
    row, ``image + prompt_text + completion + special == 1``. ``special`` is zero unless special tokens
    and the system prompt were excluded from text (``text_keys="content"``).

    Attributes:
        image, prompt_text, completion, special: float32 tensors of shape (B, num_layers).
        n_image, n_prompt_text, n_special, n_completion: key counts per row, shape (B,).
        n_queries: measured query tokens per row, shape (B,). Rows with 0 are invalid: their masses are
            NaN and ``valid`` is False.
        image_token_mass: for rows listed in ``image_map_rows`` when measuring, a dict
            row -> (num_layers, n_image) tensor of the mass on each individual image token (attention maps).
    """

    image: torch.Tensor
    prompt_text: torch.Tensor
    completion: torch.Tensor
    special: torch.Tensor
    n_image: torch.Tensor
    n_prompt_text: torch.Tensor
    n_special: torch.Tensor
    n_completion: torch.Tensor
    n_queries: torch.Tensor
    image_token_mass: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.image.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """Rows that had at least one measured query token."""
        return self.n_queries > 0

    @property
    def has_image(self) -> torch.Tensor:
        return self.n_image > 0

    def segment_metrics(self, segments: str | dict | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """MDI / AEI per layer segment (see :func:`trl_mdi.metrics.segment_metrics`); text = prompt text."""
        seg = M.layer_segments(self.num_layers, segments)
        return M.segment_metrics(self.prompt_text, self.image, self.n_prompt_text, self.n_image, seg)

    def rows(self, segments: str | dict | None = None, balance_ratio: float = 2.0) -> list[dict[str, float | None]]:
        """Per-row plain-Python summaries (None where undefined), the form rewards and logs consume."""
        seg = self.segment_metrics(segments)
        balance = M.mdi_balance(seg["all"]["mdi"], balance_ratio)
        out = []
        for i in range(self.image.shape[0]):
            row: dict[str, float | None] = {}
            for name, vals in seg.items():
                row[f"mdi_{name}"] = _opt(vals["mdi"][i])
                row[f"aei_text_{name}"] = _opt(vals["aei_text"][i])
                row[f"aei_image_{name}"] = _opt(vals["aei_image"][i])
            row["mdi"] = row["mdi_all"]
            row["mdi_balance"] = _opt(balance[i])
            for g in GROUPS:
                row[f"{g}_mass"] = _opt(getattr(self, g)[i].mean())
            row["n_image"] = int(self.n_image[i])
            row["n_prompt_text"] = int(self.n_prompt_text[i])
            row["n_special"] = int(self.n_special[i])
            row["n_completion"] = int(self.n_completion[i])
            row["n_queries"] = int(self.n_queries[i])
            out.append(row)
        return out

    @staticmethod
    def cat(parts: Sequence[ModalityAttention]) -> ModalityAttention:
        """Concatenate results along the batch (row indices of attention maps are shifted)."""
        maps: dict[int, torch.Tensor] = {}
        offset = 0
        for p in parts:
            maps.update({offset + k: v for k, v in p.image_token_mass.items()})
            offset += p.image.shape[0]
        names = [f for f in ModalityAttention.__dataclass_fields__ if f != "image_token_mass"]
        return ModalityAttention(
            **{n: torch.cat([getattr(p, n) for p in parts]) for n in names}, image_token_mass=maps
        )


def _opt(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if v != v else v  # NaN -> None


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
class _Layout:
    groups: torch.Tensor  # (B, L, G) float one-hot over valid keys
    query_mask: torch.Tensor  # (B, L) bool
    span: tuple[int, int]  # [q0, q1) holding every measured query
    counts: torch.Tensor  # (B, G) long
    n_queries: torch.Tensor  # (B,)


def _layout(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_region: torch.Tensor,
    image_ids: Sequence[int],
    mm_token_type_ids: torch.Tensor | None,
    exclusion: torch.Tensor | None,
    phase: str,
    completion_queries: torch.Tensor | None = None,
) -> _Layout:
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
    return _Layout(groups.float(), queries, span, groups.sum(dim=1), queries.sum(dim=1))


# --------------------------------------------------------------------------------------------------
# The attention function and its per-forward state
# --------------------------------------------------------------------------------------------------
class _ProbeState:
    """Per-probe accumulator. One forward call of the model = one entry in ``calls``."""

    def __init__(self, num_layers: int, layout_fn: Callable[[dict], _Layout], image_map_rows: Sequence[int]):
        self.num_layers = num_layers
        self.layout_fn = layout_fn
        self.image_map_rows = list(image_map_rows)
        self.calls: list[tuple[_Layout, torch.Tensor, dict[int, torch.Tensor]]] = []
        self._rows_seen = 0
        self._layer_counter = 0

    def begin_call(self, forward_kwargs: dict) -> None:
        layout = self.layout_fn(forward_kwargs)
        b = layout.groups.shape[0]
        masses = torch.full((b, self.num_layers, len(GROUPS)), float("nan"))
        # Attention maps only for the requested rows of this call (global row index -> local)
        local = {r - self._rows_seen: r for r in self.image_map_rows if self._rows_seen <= r < self._rows_seen + b}
        self.calls.append((layout, masses, {}))
        self._map_rows = local
        self._rows_seen += b
        self._layer_counter = 0

    @torch.no_grad()
    def record(self, module, query: torch.Tensor, key: torch.Tensor, attention_mask, scaling) -> None:
        if not self.calls:
            raise RuntimeError("trl_mdi probe: attention ran before the model's forward pre-hook (unexpected call path)")
        layout, masses, maps = self.calls[-1]
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            layer = self._layer_counter
        self._layer_counter += 1
        q0, q1 = layout.span
        if q1 <= q0:
            return  # no measured query in this call: masses stay NaN and rows are flagged invalid
        bsz, n_heads, q_len, _ = query.shape
        if q_len != layout.query_mask.shape[1]:
            raise RuntimeError(
                f"trl_mdi probe expects one teacher-forced forward over the full sequence (got {q_len} queries for "
                f"{layout.query_mask.shape[1]} tokens); it cannot measure cached, token-by-token decoding."
            )
        q = query[:, :, q0:q1].detach()
        k = repeat_kv(key.detach(), n_heads // key.shape[1])
        if attention_mask is None:
            # sdpa_mask returns None when nothing is padded: plain causal, aligned bottom-right.
            pos_q = torch.arange(q0, q1, device=q.device)[:, None] + (k.shape[2] - q_len)
            mask = (pos_q >= torch.arange(k.shape[2], device=q.device)[None, :])[None, None]
        else:
            mask = attention_mask[:, :, q0:q1, : k.shape[2]]
        g = layout.groups.to(device=q.device, dtype=q.dtype)
        # Pad the indicator columns to the head dim so SDPA picks the same fused kernel as for the model's
        # own call (several kernels require equal q/k/v head dims).
        head_dim = q.shape[-1]
        ncols = max(head_dim, g.shape[-1])
        v = F.pad(g, (0, ncols - g.shape[-1]))[:, None].expand(bsz, n_heads, -1, -1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)[..., : g.shape[-1]]
        per_query = out.float().mean(dim=1)  # (B, q, G): mean over heads
        qmask = layout.query_mask[:, q0:q1].to(per_query.device)
        per_query = per_query.masked_fill(~qmask[..., None], 0.0)  # padded queries may be NaN (no visible key)
        n_q = layout.n_queries.to(per_query.device).clamp(min=1).float()
        layer_mass = per_query.sum(dim=1) / n_q[:, None]
        masses[:, layer] = torch.where(layout.n_queries[:, None].to(layer_mass.device) > 0, layer_mass, float("nan")).cpu()
        for local_row in self._map_rows:
            maps.setdefault(local_row, torch.zeros(self.num_layers, int(layout.counts[local_row, _IMAGE])))
            is_img = layout.groups[local_row, :, _IMAGE].bool()
            if not is_img.any():
                continue
            # Per-image-token mass for this one row: a (H, q, n_image) slice, O(L) like the rest.
            vi = torch.eye(int(is_img.sum()), dtype=q.dtype, device=q.device)
            v_row = torch.zeros(k.shape[2], vi.shape[0], dtype=q.dtype, device=q.device)
            v_row[is_img.to(q.device)] = vi
            o = F.scaled_dot_product_attention(
                q[local_row : local_row + 1], k[local_row : local_row + 1],
                v_row[None, None].expand(1, n_heads, -1, -1), attn_mask=mask[local_row : local_row + 1] if mask.shape[0] > 1 else mask,
                scale=scaling,
            )[0].float().mean(dim=0)  # (q, n_image)
            qm = qmask[local_row]
            maps[local_row][layer] = (o[qm].sum(dim=0) / qm.sum().clamp(min=1)).cpu()

    def result(self) -> ModalityAttention:
        parts = []
        for layout, masses, maps in self.calls:
            counts = layout.counts.cpu()
            parts.append(
                ModalityAttention(
                    image=masses[..., _IMAGE],
                    prompt_text=masses[..., _PROMPT_TEXT],
                    completion=masses[..., _COMPLETION],
                    special=masses[..., _SPECIAL],
                    n_image=counts[:, _IMAGE],
                    n_prompt_text=counts[:, _PROMPT_TEXT],
                    n_special=counts[:, _SPECIAL],
                    n_completion=counts[:, _COMPLETION],
                    n_queries=layout.n_queries.cpu(),
                    image_token_mass=maps,
                )
            )
        if not parts:
            raise RuntimeError("trl_mdi probe recorded no forward call: was the model called inside the probe?")
        return ModalityAttention.cat(parts)


def _probe_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Registered as ``trl_mdi_probe``: SDPA output (unchanged) plus, when a probe is active, the group masses."""
    out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    state = _ACTIVE.get()
    if state is not None:
        state.record(module, query, key, attention_mask, scaling)
    return out


AttentionInterface.register(PROBE_ATTN_IMPLEMENTATION, _probe_attention_forward)
# Without a mask function registered under the same name the model would pass attention_mask=None and
# padding and causality would be silently lost.
AttentionMaskInterface.register(PROBE_ATTN_IMPLEMENTATION, sdpa_mask)


# --------------------------------------------------------------------------------------------------
# Model plumbing
# --------------------------------------------------------------------------------------------------
def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers PreTrainedModel inside DDP / DeepSpeed engines and PEFT wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model") and callable(model.get_base_model):  # PEFT
            model = model.get_base_model()
        elif hasattr(model, "module") and isinstance(model.module, torch.nn.Module):  # DDP / DeepSpeed
            model = model.module
    return model


def _text_config(model: torch.nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@contextlib.contextmanager
def probe_attention(
    model: torch.nn.Module,
    layout_fn: Callable[[dict], _Layout],
    image_map_rows: Sequence[int] = (),
) -> Iterator[_ProbeState]:
    """Context manager: every forward of ``model`` inside the block is measured.

    ``layout_fn(forward_kwargs) -> _Layout`` decides per forward call which keys are image / text /
    completion and which queries are measured. Results accumulate over calls (chunked forwards), in
    order; read them with ``state.result()`` after the block.
    """
    base = unwrap_model(model)
    text_config = _text_config(base)
    num_layers = int(text_config.num_hidden_layers)
    state = _ProbeState(num_layers, layout_fn, image_map_rows)
    # The backbone (``base.model`` for *ForConditionalGeneration) receives input_ids and the 2-D mask as
    # keyword arguments on every path (plain, PEFT, DDP, DeepSpeed).
    core = getattr(base, "base_model", base)

    def pre_hook(_module, args, kwargs):
        if _ACTIVE.get() is state:
            state.begin_call(kwargs)

    previous = text_config._attn_implementation
    handle = core.register_forward_pre_hook(pre_hook, with_kwargs=True)
    token = _ACTIVE.set(state)
    text_config._attn_implementation_internal = PROBE_ATTN_IMPLEMENTATION
    try:
        yield state
    finally:
        text_config._attn_implementation_internal = previous
        _ACTIVE.reset(token)
        handle.remove()


def _forward_tensors(kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    input_ids = kwargs.get("input_ids")
    if input_ids is None:
        raise ValueError("the attention probe needs input_ids in the model call (inputs_embeds alone hide image tokens)")
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if isinstance(attention_mask, dict) or attention_mask.dim() != 2:
        raise ValueError("the attention probe needs the 2-D (batch, seq) padding mask as attention_mask")
    return input_ids, attention_mask, kwargs.get("mm_token_type_ids")


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------
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
    **multimodal_inputs,
) -> ModalityAttention:
    """Measure, per row and text layer, the attention mass of the generated tokens on each key group.

    One teacher-forced, no-grad forward of ``model`` over prompt + completion, with the SDPA kernel,
    exact (no sampling of heads or layers), O(L) extra memory.

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

    def layout_fn(kwargs: dict) -> _Layout:
        ids, am, mm = _forward_tensors(kwargs)
        return _layout(ids, am, completion_region, image_ids, mm, exclusion, query_phase, completion_mask)

    # The masses come from inside the layers: ask for one position of logits, not (B, L, vocab), which at a real
    # vocabulary (152k for Qwen2.5-VL) costs more memory than the whole rest of the forward.
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}
    with torch.no_grad(), probe_attention(model, layout_fn, image_map_rows) as state:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra, **multimodal_inputs)
    return state.result()
