"""trl_mdi: perception-aware GRPO for vision-language models on top of TRL.

The public names, importable from the package root the way ``trl`` exposes its trainers::

    from trl_mdi import MDIGRPOConfig, MDIGRPOTrainer   # drop-in for trl's GRPOConfig / GRPOTrainer
    from trl_mdi import measure_modality_attention       # the exact O(L) attention probe on any supported model

The reward functions live in ``trl_mdi.rewards`` under their registry names (``trl_mdi.rewards.mc_idx``); here they
would be ambiguous (``trl_mdi.mdi_balance`` is the attention metric the ``mdi_balance`` reward reads).

Names are resolved on first use (PEP 562), so ``import trl_mdi.attention.metrics`` does not pay for importing TRL.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "MDIGRPOTrainer": "trl_mdi.trainer",
    "MDIGRPOConfig": "trl_mdi.config",
    "measure_modality_attention": "trl_mdi.attention",
    "probe_attention": "trl_mdi.attention",
    "ModalityAttention": "trl_mdi.attention",
    "ModelFacts": "trl_mdi.attention.model_facts",
    "model_facts": "trl_mdi.attention.model_facts",
    "layer_segments": "trl_mdi.attention.metrics",
    "mdi": "trl_mdi.attention.metrics",
    "aei": "trl_mdi.attention.metrics",
    "mdi_balance": "trl_mdi.attention.metrics",
    "REWARD_REGISTRY": "trl_mdi.rewards",
    "DEFAULT_REWARDS": "trl_mdi.rewards",
    "DEFAULT_REWARD_WEIGHTS": "trl_mdi.rewards",
    "resolve_rewards": "trl_mdi.rewards",
    "reward_help": "trl_mdi.rewards",
}

__all__ = [  # a literal list, so linters and `from trl_mdi import *` see every name; a test checks it equals _EXPORTS
    "DEFAULT_REWARDS", "DEFAULT_REWARD_WEIGHTS", "MDIGRPOConfig", "MDIGRPOTrainer", "ModalityAttention", "ModelFacts",
    "REWARD_REGISTRY", "aei", "layer_segments", "mdi", "mdi_balance", "measure_modality_attention", "model_facts",
    "probe_attention", "resolve_rewards", "reward_help",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trl_mdi' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily
    from .attention import ModalityAttention, measure_modality_attention, probe_attention
    from .attention.metrics import aei, layer_segments, mdi, mdi_balance
    from .attention.model_facts import ModelFacts, model_facts
    from .config import MDIGRPOConfig
    from .rewards import (
        DEFAULT_REWARD_WEIGHTS,
        DEFAULT_REWARDS,
        REWARD_REGISTRY,
        resolve_rewards,
        reward_help,
    )
    from .trainer import MDIGRPOTrainer
