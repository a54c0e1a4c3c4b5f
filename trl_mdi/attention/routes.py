"""The probe's per-layer kernels: the attention mass of every measured query on every key group, by two exact routes.

With ``s_qk = scale * q . k`` over the keys ``V(q)`` query q may see (causality, padding, a sliding window) and
``1_g`` the indicator of key group g (image, prompt text, completion, special), the mass on group g is::

    m_g(q) = sum_{k in V(q) & g} exp(s_qk) / sum_{k in V(q)} exp(s_qk)

- ``"indicator"``: one SDPA call whose value tensor holds the indicator columns (padded to the head dim, so that
  SDPA may pick the kernel it picks for the model's own call): ``softmax(s + mask) @ [1_image | 1_prompt_text |
  1_completion | 1_special]``. Its output is in the query's dtype (bfloat16 on a GPU: about 3 significant digits).
- ``"lse"``: the log-sum-exp of the scores over each group's keys, from flex attention over a block-sparse mask of
  that group (``LSE_g(q) = log sum_{k in V(q) & g} exp(s_qk)``, float32 inside the kernel), then
  ``m_g = exp(LSE_g - logsumexp_g LSE_g)``. A group's call touches only the key blocks that hold its keys, so the
  calls together cost about one pass over the visible keys, with a value tensor of 16 columns instead of head-dim
  columns and no (queries x keys) mask in memory. On CUDA the flex kernel is compiled (``torch.compile``); on the CPU it
  runs unfused (it materialises the scores: tests only).

Both return, per row and measured query, the mass averaged over heads: (B, q, G) float32. The probe
(``trl_mdi.attention.probe``) builds their per-forward inputs once per forward (:class:`ForwardKernels`), so a layer
adds device work only: no host-device copy, no synchronisation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

ROUTES = ("indicator", "lse")
"""The exact routes the probe can take per layer (see the module docstring); ``"indicator"`` is the default."""

_LSE_VALUE_COLUMNS = 16  # flex attention's smallest value head dim; its output is not used


def causal_visibility(q0: int, q1: int, q_len: int, k_len: int):
    """Key visibility when the model passes no mask (nothing padded): causal, aligned bottom-right, for the queries
    ``[q0, q1)`` of ``q_len``. Keys after the last query's position are never visible, so the keys are cut there:
    returns ``(k_cut, bias)`` with ``bias`` torch's lower-right causal bias over (q1 - q0, k_cut), which SDPA runs with
    its fused kernels without materialising a mask."""
    from torch.nn.attention.bias import causal_lower_right

    k_cut = q1 + (k_len - q_len)
    return k_cut, causal_lower_right(q1 - q0, k_cut)


# Query rows per block when soft-capped scores are materialised (``attend``): memory O(block x keys) per head.
SOFTCAP_QUERY_BLOCK = 256


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None,
           softcap: float | None = None, bias: torch.Tensor | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(s) v`` with ``s = cap * tanh(q k^T * scale / cap)`` where ``mask`` (bool, True = attend) allows, else
    ``-inf``: attention with the logit soft cap of Gemma 2 (PaliGemma 2) applied before the mask, as its eager kernel
    does; ``s = q k^T * scale`` without a cap.

    Two more score terms, as the modeling files that pass them apply them: ``bias``, an additive score bias
    broadcastable to (B, H, Q, K) (Inkling 2's ``position_bias``), added after the cap; ``sinks``, one extra logit per
    head (``(H,)``, GPT-OSS / HunYuan's ``s_aux``) or per query (broadcastable to (B, H, Q, 1), Inkling 2's
    ``sinks``) joining the softmax with a zero value: it only absorbs mass, so the key masses sum to less than 1.

    Without any of these this is SDPA (O(keys) memory per query); with one, the scores are materialised for
    ``SOFTCAP_QUERY_BLOCK`` query rows at a time. ``q``: (B, H, Q, D), ``k``: (B, H, K, D), ``v``: (B, H, K, G),
    ``mask``: broadcastable to (B, H, Q, K); ``scale`` None means ``D ** -0.5``. A query row that sees no key gives NaN.

    >>> q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 2)
    >>> mask = torch.ones(1, 1, 3, 5, dtype=torch.bool).tril(2)
    >>> torch.allclose(attend(q, k, v, mask, 0.5), F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5))
    True
    >>> capped = torch.softmax((torch.tanh(q @ k.transpose(-1, -2) * 0.5 / 0.3) * 0.3).masked_fill(~mask, -torch.inf), -1)
    >>> torch.allclose(attend(q, k, v, mask, 0.5, softcap=0.3), capped @ v, atol=1e-6)
    True
    >>> sink = torch.tensor([0.7, -0.2])
    >>> s = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~mask, -torch.inf)
    >>> sunk = torch.softmax(torch.cat([s, sink.view(1, 2, 1, 1).expand(1, 2, 3, 1)], -1), -1)[..., :-1]
    >>> torch.allclose(attend(q, k, v, mask, 0.5, sinks=sink), sunk @ v, atol=1e-6)
    True
    """
    if softcap is None and bias is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if sinks is not None and sinks.dim() == 1:
        sinks = sinks.view(1, -1, 1, 1)
    blocks = []
    for start in range(0, q.shape[2], SOFTCAP_QUERY_BLOCK):
        rows = slice(start, start + SOFTCAP_QUERY_BLOCK)
        scores = torch.matmul(q[:, :, rows], k.transpose(-1, -2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if bias is not None:
            scores = scores + (bias[:, :, rows] if bias.shape[2] > 1 else bias)
        block_mask = mask[:, :, rows] if mask.shape[2] > 1 else mask
        scores = scores.float().masked_fill(~block_mask, float("-inf"))
        if sinks is not None:
            sink = sinks[:, :, rows] if sinks.shape[2] > 1 else sinks
            sink = sink.float().expand(scores.shape[0], scores.shape[1], scores.shape[2], 1)
            weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(q.dtype)
        else:
            weights = torch.softmax(scores, dim=-1).to(q.dtype)
        blocks.append(torch.matmul(weights, v))
    return torch.cat(blocks, dim=2)


def causal_bool(q0: int, q1: int, q_len: int, k_cut: int, device) -> torch.Tensor:
    """The boolean form (1, 1, q1 - q0, k_cut) of :func:`causal_visibility`'s bias, for kernels that need a tensor
    mask (the soft-capped :func:`attend`): query ``q0 + i`` sees key ``j`` when ``j <= i + k_cut - (q1 - q0)``.

    >>> causal_bool(1, 3, 3, 4, "cpu")[0, 0].int().tolist()
    [[1, 1, 1, 0], [1, 1, 1, 1]]
    """
    n = q1 - q0
    rows = torch.arange(n, device=device)[:, None] + (k_cut - n)
    return (rows >= torch.arange(k_cut, device=device)[None, :])[None, None]


def indicator_masses(q: torch.Tensor, k: torch.Tensor, values: torch.Tensor, mask, scale: float | None,
                     n_groups: int, softcap: float | None = None, bias: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """(B, q, G) float32: the indicator route. ``q`` (B, H, q, D), ``k`` (B, H, K, D) (KV heads repeated),
    ``values`` (B, K, >= G) the indicator columns, ``mask`` a boolean (B or 1, 1, q, K) mask or an SDPA attention
    bias object (a boolean tensor with a score term: ``softcap``, ``bias``, ``sinks``, :func:`attend`). Padded queries
    (no visible key) may be NaN: mask them."""
    v = values[:, None].expand(q.shape[0], q.shape[1], -1, -1)
    out = attend(q, k, v, mask, scale, softcap, bias, sinks)[..., :n_groups]
    return out.float().mean(dim=1)


# ------------------------------------------------------------------------------------------------
# The log-sum-exp route
# ------------------------------------------------------------------------------------------------
def _flex():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


@functools.cache
def _compiled_flex():
    return torch.compile(_flex(), dynamic=False)


def flex_lse(q: torch.Tensor, k: torch.Tensor, block_mask, scale: float | None) -> torch.Tensor:
    """(B, H, q) float32 log-sum-exp of ``scale * q . k`` over the keys ``block_mask`` allows (-inf where none),
    from flex attention (GQA: ``k`` has the model's KV heads). The value tensor is a narrow zero tensor: only the
    kernel's log-sum-exp is read."""
    from torch.nn.attention import flex_attention as fa

    v = k.new_zeros(k.shape[0], k.shape[1], k.shape[2], _LSE_VALUE_COLUMNS)
    fn = _compiled_flex() if q.is_cuda else _flex()
    gqa = q.shape[1] != k.shape[1]
    if hasattr(fa, "AuxRequest"):  # torch >= 2.9: return_aux; older releases: return_lse
        _, aux = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=fa.AuxRequest(lse=True))
        lse = aux.lse
    else:
        _, lse = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_lse=True)
    return lse.float()


def group_block_masks(group_ids: torch.Tensor, groups: list[int], visible: Callable, q_len: int,
                      k_len: int) -> dict[int, object]:
    """{group: flex BlockMask} for the measured queries (``q_len`` of them) against ``k_len`` keys: key ``kv`` of
    row ``b`` is allowed to query ``qi`` when ``visible(b, qi, kv)`` and ``group_ids[b, kv] == group``.
    ``group_ids`` (B, K) long on the device, -1 for keys in no group (padding)."""
    from torch.nn.attention.flex_attention import create_block_mask

    masks = {}
    for g in groups:
        def mask_mod(b, h, qi, kv, g=g):
            return visible(b, qi, kv) & (group_ids[b, kv] == g)

        masks[g] = create_block_mask(mask_mod, group_ids.shape[0], None, q_len, k_len, device=group_ids.device,
                                     _compile=group_ids.is_cuda)
    return masks


def lse_masses(q: torch.Tensor, k: torch.Tensor, block_masks: dict[int, object], scale: float | None,
               n_groups: int) -> torch.Tensor:
    """(B, q, G) float32: the log-sum-exp route, ``m_g = exp(LSE_g - logsumexp_g LSE_g)`` averaged over heads.
    Groups without a block mask (no key in the batch) get 0; queries without any visible key get NaN."""
    lse = torch.full((n_groups, q.shape[0], q.shape[1], q.shape[2]), float("-inf"), device=q.device)
    for g, bm in block_masks.items():
        lse[g] = flex_lse(q, k, bm, scale)
    total = torch.logsumexp(lse, dim=0)
    return torch.exp(lse - total).mean(dim=2).permute(1, 2, 0)
