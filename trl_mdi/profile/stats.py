"""Deprecated alias of ``trl_mdi.attention.layer_stats``, where the per-layer statistics now live.

They are pure over ``ModalityAttention`` and read by both the profile and the trainer's live logs
(``trl_mdi.diagnostics``); living in ``trl_mdi.profile`` made the two packages import each other. Import from
``trl_mdi.attention.layer_stats`` (or the unchanged public names of ``trl_mdi.profile``: ``layer_profile``,
``mdi_curve``, ``mass_curve``, ``compare``). This module will be removed in a later release.
"""

from __future__ import annotations

import warnings

from ..attention.layer_stats import compare, layer_profile, mass_curve, mdi_curve, row_counts

warnings.warn("trl_mdi.profile.stats is deprecated: import from trl_mdi.attention.layer_stats (same names)",
              FutureWarning, stacklevel=2)

__all__ = ["compare", "layer_profile", "mass_curve", "mdi_curve", "row_counts"]
