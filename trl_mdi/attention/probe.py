"""The registered ``trl_mdi_probe`` attention function, the probe context manager and the public measurement.

Importing this module registers ``trl_mdi_probe`` with transformers' ``AttentionInterface`` and
``AttentionMaskInterface``.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .layout import (
    TokenLayout,
    forward_tensors,
    image_token_ids,
    template_text_exclusion_mask,
    token_layout,
    token_query_mask,
)
from .model_facts import model_facts, unwrap_model
from .result import COMPLETION, GROUPS, IMAGE, PROMPT_TEXT, SPECIAL, ModalityAttention

PROBE_ATTN_IMPLEMENTATION = "trl_mdi_probe"

# The probe active in this context (thread / task); the registered attention function reads it.
_ACTIVE: contextvars.ContextVar[_ProbeState | None] = contextvars.ContextVar("trl_mdi_probe", default=None)


# --------------------------------------------------------------------------------------------------
# The attention function and its per-forward state
# --------------------------------------------------------------------------------------------------
class _ProbeState:
    """Per-probe accumulator. One forward call of the model = one entry in ``calls``."""

    def __init__(self, num_layers: int, layout_fn: Callable[[dict], TokenLayout], image_map_rows: Sequence[int],
                 token_layers: Sequence[int] = ()):
        self.num_layers = num_layers
        self.layout_fn = layout_fn
        self.image_map_rows = list(image_map_rows)
        # Layers whose per-query image mass is summed into a (B, L) map (mean taken in result()): the per-token
        # perception signal, O(L) like the rest (one column of the group SDPA the probe runs anyway).
        self.token_layers = set(int(i) for i in token_layers)
        self.token_maps: list[torch.Tensor] = []
        self.token_layers_seen: set[int] = set()
        self.calls: list[tuple[TokenLayout, torch.Tensor, dict[int, torch.Tensor]]] = []
        # Layers whose attention function ran: softmax-attention layers only (a hybrid model's linear-attention
        # layers never call it, so their masses stay NaN and they are left out of every segment).
        self.recorded_layers: set[int] = set()
        self._rows_seen = 0
        self._layer_counter = 0

    def begin_call(self, forward_kwargs: dict) -> None:
        layout = self.layout_fn(forward_kwargs)
        b = layout.groups.shape[0]
        masses = torch.full((b, self.num_layers, len(GROUPS)), float("nan"))
        # Attention maps only for the requested rows of this call (global row index -> local)
        local = {r - self._rows_seen: r for r in self.image_map_rows if self._rows_seen <= r < self._rows_seen + b}
        self.calls.append((layout, masses, {}))
        self.token_maps.append(torch.zeros(b, layout.query_mask.shape[1]))
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
        self.recorded_layers.add(int(layer))
        q0, q1 = layout.span
        if q1 <= q0:
            return  # no measured query in this call: masses stay NaN and rows are flagged invalid
        tokens = layer in self.token_layers
        if tokens:
            # The token map also covers the position just before each query: its logits chose that query's token,
            # so the attention it paid is what decided the token (the first generated token is decided at the last
            # prompt position). One more query column, still O(L).
            q0 = max(q0 - 1, 0)
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
        raw = out.float().mean(dim=1)  # (B, q, G): mean over heads
        qmask = layout.query_mask[:, q0:q1].to(raw.device)
        per_query = raw.masked_fill(~qmask[..., None], 0.0)  # padded queries may be NaN (no visible key)
        n_q = layout.n_queries.to(per_query.device).clamp(min=1).float()
        layer_mass = per_query.sum(dim=1) / n_q[:, None]
        masses[:, layer] = torch.where(layout.n_queries[:, None].to(layer_mass.device) > 0, layer_mass, float("nan")).cpu()
        if tokens:
            tmask = token_query_mask(layout)[:, q0:q1].to(raw.device)
            self.token_maps[-1][:, q0:q1] += raw[..., IMAGE].masked_fill(~tmask, 0.0).cpu()  # 0 at other positions
            self.token_layers_seen.add(int(layer))
        for local_row in self._map_rows:
            maps.setdefault(local_row, torch.zeros(self.num_layers, int(layout.counts[local_row, IMAGE])))
            is_img = layout.groups[local_row, :, IMAGE].bool()
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
        if self.calls and not self.recorded_layers:
            raise ValueError(
                f"the model ran none of its {self.num_layers} text layers through softmax attention (e.g. a hybrid "
                "model made of linear-attention layers only), so there is no attention to measure"
            )
        measured = tuple(sorted(self.recorded_layers))
        n_token_layers = len(self.token_layers_seen)
        parts = []
        for (layout, masses, maps), tokens in zip(self.calls, self.token_maps):
            counts = layout.counts.cpu()
            parts.append(
                ModalityAttention(
                    image=masses[..., IMAGE],
                    prompt_text=masses[..., PROMPT_TEXT],
                    completion=masses[..., COMPLETION],
                    special=masses[..., SPECIAL],
                    n_image=counts[:, IMAGE],
                    n_prompt_text=counts[:, PROMPT_TEXT],
                    n_special=counts[:, SPECIAL],
                    n_completion=counts[:, COMPLETION],
                    n_queries=layout.n_queries.cpu(),
                    image_token_mass=maps,
                    measured_layers=measured,
                    query_image_mass=tokens / n_token_layers if n_token_layers else None,
                    token_layers=tuple(sorted(self.token_layers_seen)) if n_token_layers else None,
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
def _text_config(model: torch.nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@contextlib.contextmanager
def probe_attention(
    model: torch.nn.Module,
    layout_fn: Callable[[dict], TokenLayout],
    image_map_rows: Sequence[int] = (),
    token_layers: Sequence[int] = (),
) -> Iterator[_ProbeState]:
    """Context manager: every forward of ``model`` inside the block is measured.

    ``layout_fn(forward_kwargs) -> TokenLayout`` decides per forward call which keys are image / text /
    completion and which queries are measured. Results accumulate over calls (chunked forwards), in
    order; read them with ``state.result()`` after the block. ``token_layers``: also return, per query token, its
    image mass averaged over these layers (``ModalityAttention.query_image_mass``).
    """
    base = unwrap_model(model)
    text_config = _text_config(base)
    num_layers = int(text_config.num_hidden_layers)
    state = _ProbeState(num_layers, layout_fn, image_map_rows, token_layers)
    # The backbone (``base.model`` for *ForConditionalGeneration) receives input_ids and the 2-D mask on every path
    # (plain, PEFT, DDP, DeepSpeed); some families pass input_ids positionally (LLaVA-NeXT), so positional
    # arguments are bound to the forward's parameter names.
    core = getattr(base, "base_model", base)
    signature = inspect.signature(core.forward)

    def pre_hook(_module, args, kwargs):
        if _ACTIVE.get() is state:
            state.begin_call(signature.bind_partial(*args, **kwargs).arguments if args else kwargs)

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
    token_segment: str | None = None,
    segments: str | dict | None = "thirds",
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
        token_segment: a layer segment of ``segments`` (e.g. ``"late"``): also return, per query token, the
            attention mass on image keys averaged over heads and over that segment's measured layers
            (``ModalityAttention.query_image_mass``, (B, L), 0 at positions that are no query): a per-token
            perception signal. A segment the model does not have (1-2 layers, few softmax layers) falls back to
            ``"all"`` with a warning.
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
    with torch.no_grad(), probe_attention(model, layout_fn, image_map_rows, token_layers) as state:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra, **multimodal_inputs)
    return state.result()


def _segment_layers(model: torch.nn.Module, segments, name: str) -> list[int]:
    """The measured layers of segment ``name`` on this model (``"all"`` when the model has no such segment)."""
    import warnings

    from .metrics import layer_segments

    facts = model_facts(model.config)
    found = layer_segments(facts.num_layers, segments, list(facts.measured_layers))
    if name not in found:
        warnings.warn(f"segment {name!r} does not exist on this model (segments: {sorted(found)}): per-token image "
                      "mass averaged over all measured layers instead", stacklevel=3)
        name = "all"
    return found[name]
