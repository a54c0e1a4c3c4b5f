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
block the text attention output is computed by the model's own kernel and mask function when it uses SDPA or eager
attention (so a probed training forward computes exactly the loss and gradients it computes without the probe), and
by transformers' SDPA path otherwise (FlashAttention, flex: the probe's no-grad forwards then run SDPA).
The vision tower is untouched.

Layout: ``result`` (``ModalityAttention``), ``layout`` (token groups and measured queries), ``probe`` (the
registered attention function, ``probe_attention``), ``measure`` (``measure_modality_attention``). Every name is
re-exported here (public names only); importing this package registers ``"trl_mdi_probe"`` (via ``probe``).
"""

from . import metrics
from .layout import (
    QUERY_PHASES,
    TokenLayout,
    forward_tensors,
    image_token_ids,
    template_text_exclusion_mask,
    token_layout,
    trailing_completion_layout,
)
from .measure import measure_modality_attention
from .model_facts import unwrap_model
from .probe import PROBE_ATTN_IMPLEMENTATION, probe_attention
from .result import COMPLETION, GROUPS, IMAGE, PROMPT_TEXT, SPECIAL, ModalityAttention

__all__ = [
    "COMPLETION", "GROUPS", "IMAGE", "PROBE_ATTN_IMPLEMENTATION", "PROMPT_TEXT", "QUERY_PHASES", "SPECIAL",
    "ModalityAttention", "TokenLayout", "forward_tensors", "image_token_ids", "measure_modality_attention", "metrics",
    "probe_attention", "template_text_exclusion_mask", "token_layout", "trailing_completion_layout", "unwrap_model",
]
