"""The registered ``trl_mdi_probe`` attention function, the probe context manager and the public measurement.

Importing this module registers ``trl_mdi_probe`` with transformers' ``AttentionInterface`` and
``AttentionMaskInterface``.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from .layout import (
    TokenLayout,
    token_query_mask,
)
from .model_facts import UNMEASURED_LAYER_TYPES, text_config_of, unwrap_model
from .result import COMPLETION, GROUPS, IMAGE, PROMPT_TEXT, SPECIAL, ModalityAttention

PROBE_ATTN_IMPLEMENTATION = "trl_mdi_probe"

# The probe active in this context (thread / task); the registered attention function reads it.
_ACTIVE: contextvars.ContextVar[_ProbeState | None] = contextvars.ContextVar("trl_mdi_probe", default=None)


# Query rows per block when soft-capped scores are materialised (``attend``): memory O(block x keys) per head.
SOFTCAP_QUERY_BLOCK = 256


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None,
           softcap: float | None = None) -> torch.Tensor:
    """``softmax(s) v`` with ``s = cap * tanh(q k^T * scale / cap)`` where ``mask`` (bool, True = attend) allows, else
    ``-inf``: attention with the logit soft cap of Gemma 2 (PaliGemma 2) applied before the mask, as its eager kernel
    does; ``s = q k^T * scale`` without a cap.

    Without a cap this is SDPA (O(keys) memory per query); with one, the scores are materialised for
    ``SOFTCAP_QUERY_BLOCK`` query rows at a time. ``q``: (B, H, Q, D), ``k``: (B, H, K, D), ``v``: (B, H, K, G),
    ``mask``: broadcastable to (B, H, Q, K); ``scale`` None means ``D ** -0.5``. A query row that sees no key gives NaN.

    >>> q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 2)
    >>> mask = torch.ones(1, 1, 3, 5, dtype=torch.bool).tril(2)
    >>> torch.allclose(attend(q, k, v, mask, 0.5), F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5))
    True
    >>> capped = torch.softmax((torch.tanh(q @ k.transpose(-1, -2) * 0.5 / 0.3) * 0.3).masked_fill(~mask, -torch.inf), -1)
    >>> torch.allclose(attend(q, k, v, mask, 0.5, softcap=0.3), capped @ v, atol=1e-6)
    True
    """
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    blocks = []
    for start in range(0, q.shape[2], SOFTCAP_QUERY_BLOCK):
        rows = slice(start, start + SOFTCAP_QUERY_BLOCK)
        scores = torch.tanh(torch.matmul(q[:, :, rows], k.transpose(-1, -2)) * (scale / softcap)) * softcap
        block_mask = mask[:, :, rows] if mask.shape[2] > 1 else mask
        weights = torch.softmax(scores.float().masked_fill(~block_mask, float("-inf")), dim=-1).to(q.dtype)
        blocks.append(torch.matmul(weights, v))
    return torch.cat(blocks, dim=2)


# --------------------------------------------------------------------------------------------------
# The attention function and its per-forward state
# --------------------------------------------------------------------------------------------------
class _ProbeState:
    """Per-probe accumulator. One forward call of the model = one entry in ``calls``."""

    def __init__(self, num_layers: int, layout_fn: Callable[[dict], TokenLayout], image_map_rows: Sequence[int],
                 token_layers: Sequence[int] = (), native: str | None = None):
        self.num_layers = num_layers
        self.layout_fn = layout_fn
        self.image_map_rows = list(image_map_rows)
        # Layers whose per-query image mass is summed into a (B, L) map (mean taken in result()): the per-token
        # perception signal, O(L) like the rest (one column of the group SDPA the probe runs anyway).
        self.token_layers = set(int(i) for i in token_layers)
        self.native = native  # the model's own attention implementation, which keeps computing the outputs
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
    def record(self, module, query: torch.Tensor, key: torch.Tensor, attention_mask, scaling,
               softcap: float | None = None) -> None:
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
            if mask.dtype != torch.bool:  # an eager, additive mask: 0 where attending, the dtype's minimum elsewhere
                mask = mask == 0
        g = layout.groups.to(device=q.device, dtype=q.dtype)
        # Pad the indicator columns to the head dim so SDPA picks the same fused kernel as for the model's
        # own call (several kernels require equal q/k/v head dims).
        head_dim = q.shape[-1]
        ncols = max(head_dim, g.shape[-1])
        v = F.pad(g, (0, ncols - g.shape[-1]))[:, None].expand(bsz, n_heads, -1, -1)
        out = attend(q, k, v, mask, scaling, softcap)[..., : g.shape[-1]]
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
            o = attend(
                q[local_row : local_row + 1], k[local_row : local_row + 1],
                v_row[None, None].expand(1, n_heads, -1, -1), mask[local_row : local_row + 1] if mask.shape[0] > 1 else mask,
                scaling, softcap,
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


NATIVE_IMPLEMENTATIONS = ("sdpa", "eager")
"""Attention implementations the probe runs beside unchanged (their kernel computes the layer's output, their mask
function builds the mask); under any other the probe's forward computes the output with SDPA."""


def _native(state: _ProbeState | None) -> str:
    return state.native if state is not None and state.native in NATIVE_IMPLEMENTATIONS else "sdpa"


def _probe_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Registered as ``trl_mdi_probe``: the layer's output from the model's own kernel (SDPA or the modeling file's
    eager function, see ``NATIVE_IMPLEMENTATIONS``), unchanged, plus, when a probe is active, the group masses."""
    state = _ACTIVE.get()
    kernel = sdpa_attention_forward
    # A soft-capped layer (Gemma 2) has no SDPA kernel: its own eager function computes the output whatever the model
    # was loaded with.
    if _native(state) == "eager" or kwargs.get("softcap") is not None:
        # Every modeling file that dispatches through AttentionInterface holds its eager function under this name
        # (its default when the implementation is "eager"); a file without one keeps SDPA's output.
        kernel = getattr(sys.modules[type(module).__module__], "eager_attention_forward", sdpa_attention_forward)
    out = kernel(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if state is not None:
        state.record(module, query, key, attention_mask, scaling, kwargs.get("softcap"))
    return out


def _probe_mask(*args, **kwargs):
    """The mask function of the model's own implementation (eager: additive floats; SDPA: booleans or None)."""
    return (eager_mask if _native(_ACTIVE.get()) == "eager" else sdpa_mask)(*args, **kwargs)


AttentionInterface.register(PROBE_ATTN_IMPLEMENTATION, _probe_attention_forward)
# Without a mask function registered under the same name the model would pass attention_mask=None and
# padding and causality would be silently lost.
AttentionMaskInterface.register(PROBE_ATTN_IMPLEMENTATION, _probe_mask)


# --------------------------------------------------------------------------------------------------
# Model plumbing
# --------------------------------------------------------------------------------------------------
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
    text_config = text_config_of(base.config)
    num_layers = int(text_config.num_hidden_layers)
    state = _ProbeState(num_layers, layout_fn, image_map_rows, token_layers, native=text_config._attn_implementation)
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
# Can the probe reach a model's attention?
# --------------------------------------------------------------------------------------------------
_DISPATCH_NAMES = frozenset({"ALL_ATTENTION_FUNCTIONS", "get_interface"})
_VISION_PATH_WORDS = frozenset({"vision", "visual", "vit", "audio"})


def _code_names(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _code_names(const)
    return names


def _dispatches(cls: type) -> bool:
    """Whether a module class's own methods (its MRO below torch's classes) look the attention function up in
    transformers' attention interface (``ALL_ATTENTION_FUNCTIONS[...]`` / ``.get_interface(...)``)."""
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch") or klass is object:
            continue
        for value in vars(klass).values():
            fn = getattr(value, "__func__", value)  # staticmethod / classmethod
            code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
            if code is not None and _code_names(code) & _DISPATCH_NAMES:
                return True
    return False


def probe_support(model: torch.nn.Module) -> str | None:
    """None when the probe can measure ``model`` (plain, PEFT-wrapped, DDP / DeepSpeed), else a one-line reason.

    The probe measures by registering its own attention function and pointing the text config's attention
    implementation at it, so it sees exactly the attention modules that (1) read their implementation from that
    config and (2) call the function it names through transformers' attention interface. Every supported family's
    text attention does; custom code that computes its own softmax, or the pre-interface ``*SdpaAttention`` classes
    chosen once at construction, does not. The text attention modules are the ``*Attention`` / ``*Attn`` modules
    outside the vision (and audio) towers that do not hold another config; each must dispatch through the
    interface, itself or through a module it contains or is contained in, unless its layer is one the probe skips
    anyway (``layer_types``: a hybrid model's linear-attention layers).
    """
    base = unwrap_model(model)
    text_config = text_config_of(base.config)
    name_of = type(base).__name__
    candidates = {}
    for path, module in base.named_modules():
        kind = type(module).__name__.lower()
        own_config = getattr(module, "config", text_config)
        if ("attention" not in kind and "attn" not in kind) or any(
            _VISION_PATH_WORDS & set(part.lower().split("_")) for part in path.split(".")
        ):
            continue
        if isinstance(own_config, PretrainedConfig) and own_config is not text_config:
            continue  # a vision / audio tower's attention, or a config the probe's switch does not reach
        candidates[path] = module
    if not candidates:
        return (f"{name_of} has no attention module that reads its text config ({type(text_config).__name__}), so "
                "the probe, which switches that config's attention implementation, cannot measure it")
    dispatching = [p for p, m in candidates.items() if _dispatches(type(m))]

    layer_types = list(getattr(text_config, "layer_types", None) or [])

    def reached(path: str) -> bool:  # dispatches itself, or holds / sits inside a module that does
        return any(d == path or d.startswith(f"{path}.") or path.startswith(f"{d}.") for d in dispatching)

    def unmeasured(module) -> bool:  # a hybrid model's linear-attention mixer: nothing to measure there anyway
        i = getattr(module, "layer_idx", None)
        return isinstance(i, int) and i < len(layer_types) and layer_types[i] in UNMEASURED_LAYER_TYPES

    own = sorted({type(m).__name__ for p, m in candidates.items() if not reached(p) and not unmeasured(m)})
    if own:
        return (f"{name_of} computes attention itself (its attention modules ({', '.join(own)}) do not dispatch "
                "through transformers' attention interface), so the probe cannot measure it")
    return None
