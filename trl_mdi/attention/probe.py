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

from . import routes as R
from .layout import (
    TokenLayout,
    token_query_mask,
)
from .model_facts import UNMEASURED_LAYER_TYPES, text_config_of, unwrap_model
from .result import COMPLETION, GROUPS, IMAGE, PROMPT_TEXT, SPECIAL, ModalityAttention
from .routes import ROUTES, attend  # noqa: F401  (attend: the soft-capped attention, public here too)

PROBE_ATTN_IMPLEMENTATION = "trl_mdi_probe"

# The probe active in this context (thread / task); the registered attention function reads it.
_ACTIVE: contextvars.ContextVar[_ProbeState | None] = contextvars.ContextVar("trl_mdi_probe", default=None)


# --------------------------------------------------------------------------------------------------
# The attention function and its per-forward state
# --------------------------------------------------------------------------------------------------
class _ProbeState:
    """Per-probe accumulator. One forward call of the model = one :class:`_Call` in ``calls``.

    Everything a layer reads or writes lives on the device the attention runs on: the per-forward tensors (key-group
    indicators, query masks, row counts, the causal bias) are moved and cast once per forward (:class:`_Call`'s
    cache), and the masses, the per-token map and the per-image map rows are written there, layer by layer, and copied
    to the host once, in :meth:`result`. So a layer adds device work only: no host-device copy and no implicit
    synchronisation that would stall the GPU's queue 36 times a forward.
    """

    def __init__(self, num_layers: int, layout_fn: Callable[[dict], TokenLayout], image_map_rows: Sequence[int],
                 token_layers: Sequence[int] = (), native: str | None = None, route: str = "indicator"):
        if route not in ROUTES:
            raise ValueError(f"probe route must be one of {ROUTES}, got {route!r}")
        self.num_layers = num_layers
        self.layout_fn = layout_fn
        self.image_map_rows = list(image_map_rows)
        # Layers whose per-query image mass is summed into a (B, L) map (mean taken in result()): the per-token
        # perception signal, O(L) like the rest (one column of the group masses the probe computes anyway).
        self.token_layers = set(int(i) for i in token_layers)
        self.native = native  # the model's own attention implementation, which keeps computing the outputs
        self.route = route
        self.token_layers_seen: set[int] = set()
        self.calls: list[_Call] = []
        # Layers whose attention function ran: softmax-attention layers only (a hybrid model's linear-attention
        # layers never call it, so their masses stay NaN and they are left out of every segment).
        self.recorded_layers: set[int] = set()
        self._rows_seen = 0
        self._layer_counter = 0

    def begin_call(self, forward_kwargs: dict) -> None:
        layout = self.layout_fn(forward_kwargs)
        b = layout.groups.shape[0]
        # Attention maps only for the requested rows of this call (global row index -> local)
        rows = [r - self._rows_seen for r in self.image_map_rows if self._rows_seen <= r < self._rows_seen + b]
        self.calls.append(_Call(layout, self.num_layers, rows))
        self._rows_seen += b
        self._layer_counter = 0

    @torch.no_grad()
    def record(self, module, query: torch.Tensor, key: torch.Tensor, attention_mask, scaling,
               softcap: float | None = None, bias: torch.Tensor | None = None,
               sinks: torch.Tensor | None = None) -> None:
        if not self.calls:
            raise RuntimeError("trl_mdi probe: attention ran before the model's forward pre-hook (unexpected call path)")
        call = self.calls[-1]
        layout = call.layout
        length = layout.query_mask.shape[1]
        if query.shape[2] != length and key.shape[2] != length:
            # Attention over something other than the token sequence (Inkling 2's block attention residuals mix a
            # position's earlier layer outputs): no token is a key there, so there is nothing to measure.
            return
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            layer = self._layer_counter
        self._layer_counter += 1
        self.recorded_layers.add(int(layer))
        q0, q1 = layout.span
        if q1 <= q0:
            return  # no measured query in this call: masses stay NaN and rows are flagged invalid
        call.measured = True
        tokens = layer in self.token_layers
        if tokens:
            # The token map also covers the position just before each query: its logits chose that query's token,
            # so the attention it paid is what decided the token (the first generated token is decided at the last
            # prompt position). One more query column, still O(L).
            q0 = max(q0 - 1, 0)
        n_heads, q_len = query.shape[1], query.shape[2]
        if q_len != layout.query_mask.shape[1]:
            raise RuntimeError(
                f"trl_mdi probe expects one teacher-forced forward over the full sequence (got {q_len} queries for "
                f"{layout.query_mask.shape[1]} tokens); it cannot measure cached, token-by-token decoding."
            )
        dev = call.on(query.device, query.dtype, query.shape[-1])
        q = query[:, :, q0:q1].detach()
        key = key.detach()
        if attention_mask is None:
            # sdpa_mask returns None when nothing is padded: plain causal, aligned bottom-right (a bias object, so
            # that SDPA runs its fused kernels without a materialised mask).
            k_cut, mask = dev.causal(q0, q1, q_len, key.shape[2])
        else:
            k_cut, mask = key.shape[2], attention_mask[:, :, q0:q1, : key.shape[2]]
            if mask.dtype != torch.bool:  # an eager, additive mask: 0 where attending, the dtype's minimum elsewhere
                mask = mask == 0
        scored = softcap is not None or bias is not None or sinks is not None
        if scored and attention_mask is None:
            # score terms are applied to materialised scores (``attend``): a boolean mask, not a bias object
            mask = R.causal_bool(q0, q1, q_len, k_cut, q.device)
        # The score terms over the measured queries and kept keys (a per-query term has the full query length).
        if bias is not None:
            bias = bias.detach()
            bias = bias[..., q0:q1, :k_cut] if bias.shape[-2] == q_len else bias[..., :k_cut]
        if sinks is not None:
            sinks = sinks.detach()
            if sinks.dim() > 1 and sinks.shape[-2] == q_len:
                sinks = sinks[..., q0:q1, :]
        if self.route == "lse" and not scored:
            raw = R.lse_masses(q, key[:, :, :k_cut], dev.block_masks(attention_mask, mask, q0, q1, q_len, k_cut),
                               scaling, len(GROUPS))
        else:  # the indicator route; a model with score terms always takes it (flex's log-sum-exp here has none)
            k = repeat_kv(key[:, :, :k_cut], n_heads // key.shape[1])
            raw = R.indicator_masses(q, k, dev.values[:, :k_cut], mask, scaling, len(GROUPS), softcap, bias,
                                     sinks)  # (B, q, G)
        qmask = dev.query_mask[:, q0:q1]
        per_query = raw.masked_fill(~qmask[..., None], 0.0)  # padded queries may be NaN (no visible key)
        layer_mass = per_query.sum(dim=1) / dev.n_queries[:, None]
        call.masses[:, layer] = torch.where(dev.has_queries[:, None], layer_mass, float("nan"))
        if tokens:
            tmask = dev.token_mask[:, q0:q1]
            call.token_map[:, q0:q1] += raw[..., IMAGE].masked_fill(~tmask, 0.0)  # 0 at other positions
            self.token_layers_seen.add(int(layer))
        if call.map_rows:
            k = repeat_kv(key[:, :, :k_cut], n_heads // key.shape[1])
            for row, v_row in dev.map_values.items():
                # Per-image-token mass for this one row: a (H, q, n_image) slice, O(L) like the rest.
                row_mask = mask if attention_mask is None or mask.shape[0] == 1 else mask[row : row + 1]
                row_bias = bias if bias is None or bias.shape[0] == 1 else bias[row : row + 1]
                row_sinks = sinks if sinks is None or sinks.dim() == 1 or sinks.shape[0] == 1 else sinks[row : row + 1]
                o = R.attend(q[row : row + 1], k[row : row + 1], v_row[None, None, :k_cut].expand(1, n_heads, -1, -1),
                             row_mask, scaling, softcap, row_bias, row_sinks)[0].float().mean(dim=0)  # (q, n_image)
                qm = qmask[row]
                call.maps[row][layer] = torch.where(qm[:, None], o, 0.0).sum(dim=0) / dev.n_queries[row]

    def result(self) -> ModalityAttention:
        if self.calls and not self.recorded_layers:
            raise ValueError(
                f"the model ran none of its {self.num_layers} text layers through softmax attention (e.g. a hybrid "
                "model made of linear-attention layers only), so there is no attention to measure"
            )
        measured = tuple(sorted(self.recorded_layers))
        n_token_layers = len(self.token_layers_seen)
        parts = []
        for call in self.calls:
            masses, counts = call.masses.cpu(), call.counts  # the forward has ended: one copy per tensor
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
                    n_queries=call.n_queries,
                    image_token_mass={r: m.cpu() for r, m in call.maps.items()} if call.measured else {},
                    measured_layers=measured,
                    query_image_mass=call.token_map.cpu() / n_token_layers if n_token_layers else None,
                    token_layers=tuple(sorted(self.token_layers_seen)) if n_token_layers else None,
                )
            )
        if not parts:
            raise RuntimeError("trl_mdi probe recorded no forward call: was the model called inside the probe?")
        return ModalityAttention.cat(parts)


class _Call:
    """One forward call: its layout, its accumulators (on the layout's device, which is the input's), the row
    counts on the host (copied once, at the start of the forward), and the per-layer inputs on the attention's
    device and dtype (:meth:`on`, built at the first layer)."""

    def __init__(self, layout: TokenLayout, num_layers: int, map_rows: list[int]):
        self.layout = layout
        device = layout.groups.device
        b, length = layout.query_mask.shape
        self.counts = layout.counts.cpu()
        self.n_queries = layout.n_queries.cpu()
        self.map_rows = list(map_rows)
        self.measured = False  # whether a layer measured queries (else no map is returned, as before)
        self.present = [g for g in range(len(GROUPS)) if int(self.counts[:, g].sum()) > 0]  # groups with a key
        self.map_sizes = {r: int(self.counts[r, IMAGE]) for r in map_rows}
        self.masses = torch.full((b, num_layers, len(GROUPS)), float("nan"), device=device)
        self.token_map = torch.zeros(b, length, device=device)
        self.maps = {r: torch.zeros(num_layers, n, device=device) for r, n in self.map_sizes.items()}
        # Without padding the model passes no mask: the causal bias of the measured span, and of the span one
        # query longer that the per-token map reads (a bias object holds no data: built here, for any device).
        q0, q1 = layout.span
        self.causal = {(a, q1): R.causal_visibility(a, q1, length, length) for a in {q0, max(q0 - 1, 0)} if q1 > a}
        self._inputs: dict[tuple, _LayerInputs] = {}

    def on(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> _LayerInputs:
        key = (device, dtype, head_dim)
        if key not in self._inputs:
            if self.masses.device != device:  # a model split over devices: its layers write where they run
                self.masses, self.token_map = self.masses.to(device), self.token_map.to(device)
                self.maps = {r: m.to(device) for r, m in self.maps.items()}
            self._inputs[key] = _LayerInputs(self, device, dtype, head_dim)
        return self._inputs[key]


class _LayerInputs:
    """What every layer of one forward reads, moved and cast once: the indicator value columns, the query masks and
    counts, the per-image-map value columns, and (cached per span) the causal bias and the flex block masks."""

    def __init__(self, call: _Call, device: torch.device, dtype: torch.dtype, head_dim: int):
        layout = call.layout
        groups = layout.groups.to(device=device, dtype=dtype)
        n_groups = groups.shape[-1]
        # Pad the indicator columns to the head dim so SDPA picks the same fused kernel as for the model's own call
        # (several kernels require equal q/k/v head dims).
        self.values = F.pad(groups, (0, max(head_dim, n_groups) - n_groups))
        self.query_mask = layout.query_mask.to(device)
        self.token_mask = token_query_mask(layout).to(device)
        n_queries = layout.n_queries.to(device)
        self.has_queries = n_queries > 0
        self.n_queries = n_queries.clamp(min=1).float()
        self.group_ids = torch.where(layout.groups.sum(-1) > 0, layout.groups.argmax(-1), -1).to(device)
        self.present = call.present
        # Per-image-token values for the rows with a map: column j is the indicator of the row's j-th image key.
        self.map_values = {}
        for row, n_img in call.map_sizes.items():
            if n_img == 0:
                continue
            positions = torch.argsort((layout.groups[row, :, IMAGE] > 0).to(torch.int8), descending=True, stable=True)
            v_row = torch.zeros(layout.groups.shape[1], n_img, dtype=dtype, device=device)
            v_row[positions[:n_img].to(device), torch.arange(n_img, device=device)] = 1
            self.map_values[row] = v_row
        self._causal = call.causal
        self._block_masks: dict[tuple, dict] = {}

    def causal(self, q0: int, q1: int, q_len: int, k_len: int):
        if q_len == k_len and (q0, q1) in self._causal:
            return self._causal[(q0, q1)]
        return R.causal_visibility(q0, q1, q_len, k_len)  # keys other than the sequence (not a path the model takes)

    def block_masks(self, attention_mask, mask, q0: int, q1: int, q_len: int, k_len: int) -> dict:
        """The flex block masks of the present groups, per distinct layer mask (a sliding-window layer's differs)."""
        key = (id(attention_mask), q0, q1, q_len, k_len)
        if key not in self._block_masks:
            if attention_mask is None:
                off = q0 + k_len - q1  # query qi (of the span) sits at q0 + qi; keys cut at q1 + K - q_len

                def visible(b, qi, kv):
                    return kv <= qi + off
            else:
                dense = mask[:, 0] if mask.shape[0] > 1 else mask[:, 0].expand(self.group_ids.shape[0], -1, -1)

                def visible(b, qi, kv):
                    return dense[b, qi, kv]
            self._block_masks[key] = R.group_block_masks(self.group_ids[:, :k_len], self.present, visible, q1 - q0,
                                                         k_len)
        return self._block_masks[key]


NATIVE_IMPLEMENTATIONS = ("sdpa", "eager")
"""Attention implementations the probe runs beside unchanged (their kernel computes the layer's output, their mask
function builds the mask); under any other the probe's forward computes the output with SDPA."""


def _native(state: _ProbeState | None) -> str:
    return state.native if state is not None and state.native in NATIVE_IMPLEMENTATIONS else "sdpa"


SCORE_TERMS = ("softcap", "position_bias", "s_aux", "sinks")
"""Keyword arguments by which a modeling file adds a term to the attention scores, which the probe reproduces
(``routes.attend``): Gemma 2's logit ``softcap``, Inkling 2's additive ``position_bias``, and the attention sinks of
GPT-OSS / HunYuan (``s_aux``, one logit per head) and Inkling 2 (``sinks``). A layer passing one has no SDPA kernel
here: its own eager function computes the output."""


def _probe_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Registered as ``trl_mdi_probe``: the layer's output from the model's own kernel (SDPA or the modeling file's
    eager function, see ``NATIVE_IMPLEMENTATIONS``), unchanged, plus, when a probe is active, the group masses."""
    state = _ACTIVE.get()
    if kwargs.get("indices") is not None:
        attention_mask = _mask_unselected_keys(attention_mask, kwargs.pop("indices"), key.shape[-2])
    kernel = sdpa_attention_forward
    # A layer with a score term (Gemma 2's soft cap, sinks, a position bias) has no SDPA kernel: its own eager function
    # computes the output whatever the model was loaded with.
    if _native(state) == "eager" or any(kwargs.get(name) is not None for name in SCORE_TERMS):
        # Every modeling file that dispatches through AttentionInterface holds its eager function under this name
        # (its default when the implementation is "eager"); a file without one keeps SDPA's output.
        kernel = getattr(sys.modules[type(module).__module__], "eager_attention_forward", sdpa_attention_forward)
    out = kernel(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if state is not None:
        state.record(module, query, key, attention_mask, scaling, kwargs.get("softcap"), kwargs.get("position_bias"),
                     kwargs.get("s_aux", kwargs.get("sinks")))
    return out


def _mask_unselected_keys(attention_mask: torch.Tensor, indices: torch.Tensor, n_keys: int) -> torch.Tensor:
    """The mask with every key outside each query's top-k ``indices`` (B, q, k) masked out. DeepSeek Sparse Attention
    layers (Dots3 Note's indexed layers, HunYuan V4, Mistral Large 4) mask those keys themselves only under "eager"
    and "sdpa" and hand the indices to any other implementation (a sparse kernel's input), so under the probe's name
    the unselected keys would stay visible: the layer's output would change and the masses would count keys the
    layer never reads. The same mask as the modeling files build.

    >>> mask = torch.ones(1, 1, 2, 3, dtype=torch.bool)
    >>> _mask_unselected_keys(mask, torch.tensor([[[0], [2]]]), 3)[0, 0].tolist()
    [[True, False, False], [False, False, True]]
    """
    unselected = torch.ones(*indices.shape[:2], n_keys, dtype=torch.bool, device=indices.device).scatter(
        -1, indices.long(), False).unsqueeze(1)
    if attention_mask.dtype == torch.bool:
        return attention_mask & ~unselected
    return attention_mask.masked_fill(unselected, torch.finfo(attention_mask.dtype).min)


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
    route: str = "indicator",
) -> Iterator[_ProbeState]:
    """Context manager: every forward of ``model`` inside the block is measured.

    ``layout_fn(forward_kwargs) -> TokenLayout`` decides per forward call which keys are image / text /
    completion and which queries are measured. Results accumulate over calls (chunked forwards), in
    order; read them with ``state.result()`` after the block. ``token_layers``: also return, per query token, its
    image mass averaged over these layers (``ModalityAttention.query_image_mass``). ``route``: how each layer's
    masses are computed, ``"indicator"`` (default) or ``"lse"`` (both exact; ``trl_mdi.attention.routes``).
    """
    base = unwrap_model(model)
    text_config = text_config_of(base.config)
    num_layers = int(text_config.num_hidden_layers)
    state = _ProbeState(num_layers, layout_fn, image_map_rows, token_layers, native=text_config._attn_implementation,
                        route=route)
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
# Paths outside the text decoder: the vision / audio towers, BLIP-2's Q-Former, Chameleon's VQ-VAE image tokenizer
# (vqmodel), and the multimodal projector, whose attention (Aria's cross-attention pooling of image features) runs over
# image features before they reach the text sequence.
_VISION_PATH_WORDS = frozenset({"vision", "visual", "vit", "audio", "projector", "qformer", "vqmodel"})


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
