"""``python -m trl_mdi.profile``: how a VLM checkpoint looks at images, layer by layer, and how two checkpoints differ.

    python -m trl_mdi.profile --model_name_or_path demo_run/tiny-warm demo_run/grpo \
        --dataset_path demo_run/aokvqa_trl_data_simple --out demo_run/profile

For every model in turn: completions are generated greedily for the rows of one split (or taken from
``--completion_column``), every row is measured with the exact attention probe (``measure_modality_attention``, exact
whatever ``--attn_implementation`` the model uses), and the per-row masses become, per layer and per layer segment,
means and spreads over rows with MDI as a ratio of means (``trl_mdi.attention.layer_stats``, which the trainer's live
logs share). The command writes ``profile.md``, ``profile.json``, ``mdi_by_layer.png`` and ``mass_by_layer.png``
(``report``, drawn by ``trl_mdi.diagnostics.plots``). Models, data and flags are checked before any weight is
loaded (``arguments``, ``rows``).

With ``--reliance`` it also asks whether the answers come from the image: every rollout (greedy, and sampled with
``--samples_per_row``) is scored again with a counterfactual image in plain no-grad forwards, and the section reports
accuracy with and without the image and how well each per-rollout signal separates prior-following rollouts
(``reference``, ``reliance_report``, ``validation``). ``reference_signals`` is that measurement on explicit tensors:
the reference the trainer's counterfactual signals are tested against.

Layout: ``arguments`` (flags, model checks), ``rows`` (the split, sampled and prepared with ``trl_mdi.data``),
``measure`` (generation and measurement of one model), ``report`` (the files), ``reference`` (the counterfactual
measurement in plain forwards: the signals' reference values), ``validation`` (a signal against labels: AUROC,
prompt bootstrap, within-prompt AUROC, the signal table; for your own data too), ``reliance_report`` (the
``--reliance`` section: summary, Markdown and pictures), ``command`` (``main``). docs/profile.md has the ``--help``
output and worked examples.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..attention.layer_stats import compare, layer_profile, mass_curve, mdi_curve

# The command's names load on first use (PEP 562): the numbers and curves above, which the trainer's live logs may
# use, then import no entry-point code (argument parsing, model checks, TRL's config).
_LAZY = {"ProfileArguments": "arguments", "build_parser": "arguments", "parse_args": "arguments", "main": "command",
         "run": "command", "measure_reliance": "reference", "reference_signals": "reference",
         "summarize_reliance": "reliance_report"}

__all__ = ["ProfileArguments", "build_parser", "compare", "layer_profile", "main", "mass_curve", "measure_reliance",
           "mdi_curve", "parse_args", "reference_signals", "run", "summarize_reliance"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
