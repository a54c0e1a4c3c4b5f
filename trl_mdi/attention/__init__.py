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

Layout: ``result`` (``ModalityAttention``), ``layout`` (token groups and measured queries), ``probe`` (the
registered attention function, ``probe_attention``, ``measure_modality_attention``). Every name is
re-exported here; importing this package registers ``"trl_mdi_probe"`` (via ``probe``).
"""

from .layout import QUERY_PHASES as QUERY_PHASES
from .layout import _forward_tensors as _forward_tensors
from .layout import _Layout as _Layout
from .layout import _layout as _layout
from .layout import image_token_ids as image_token_ids
from .layout import template_text_exclusion_mask as template_text_exclusion_mask
from .probe import _ACTIVE as _ACTIVE
from .probe import PROBE_ATTN_IMPLEMENTATION as PROBE_ATTN_IMPLEMENTATION
from .probe import _probe_attention_forward as _probe_attention_forward
from .probe import _ProbeState as _ProbeState
from .probe import _text_config as _text_config
from .probe import measure_modality_attention as measure_modality_attention
from .probe import probe_attention as probe_attention
from .probe import unwrap_model as unwrap_model
from .result import _COMPLETION as _COMPLETION
from .result import _IMAGE as _IMAGE
from .result import _PROMPT_TEXT as _PROMPT_TEXT
from .result import _SPECIAL as _SPECIAL
from .result import GROUPS as GROUPS
from .result import ModalityAttention as ModalityAttention
from .result import _opt as _opt
