"""What the probe can measure on a model, read from its config before any weight is loaded.

A trainer needs this at construction (to validate segments and reward inputs, and to decide whether attention
metrics can run at all), but a model given by Hub id or path is only loaded inside ``GRPOTrainer.__init__``; so
the facts come from the config alone. ``tests/test_families.py`` checks, per supported family, that the layers
predicted here are exactly the layers the probe then records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .layout import image_token_ids

# Layer kinds that never call the attention interface: no softmax over keys, hence nothing to measure.
# ("linear_attention" covers Gated DeltaNet, Mamba and other recurrent mixers; "conv" and "moe" are the
# convolution and MoE-only layers of some hybrid models.)
UNMEASURED_LAYER_TYPES = frozenset({"linear_attention", "mamba", "conv", "moe"})


@dataclass(frozen=True)
class ModelFacts:
    """The parts of a model's config that attention measurement depends on."""

    model_type: str
    image_token_ids: tuple[int, ...]  # image/video placeholder ids; empty for a text-only model
    num_layers: int  # text decoder layers
    measured_layers: tuple[int, ...]  # softmax-attention layers: the ones the probe measures
    layer_types: tuple[str, ...] | None  # text_config.layer_types, when the family declares them
    sliding_window: int | None  # window of the sliding-attention layers, if any

    @property
    def is_vlm(self) -> bool:
        return bool(self.image_token_ids)

    @property
    def unmeasured_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in set(self.measured_layers))

    def describe_layers(self) -> str:
        """One line for logs: '24 text layers, 6 measured (full attention): 3, 7, ...; 18 linear-attention skipped'."""
        if not self.unmeasured_layers:
            kinds = sorted(set(self.layer_types or ())) or ["attention"]
            return f"{self.num_layers} text layers, all measured ({', '.join(kinds)})"
        skipped = sorted({self.layer_types[i] for i in self.unmeasured_layers}) if self.layer_types else ["unmeasured"]
        return (f"{self.num_layers} text layers, {len(self.measured_layers)} measured: "
                f"{', '.join(map(str, self.measured_layers))}; {len(self.unmeasured_layers)} "
                f"{'/'.join(skipped)} layers have no attention weights and are skipped")


def text_config_of(config):
    """The text decoder's config (the config itself for a text-only model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_facts(config) -> ModelFacts:
    """Read :class:`ModelFacts` from a transformers config (a VLM's top config or a causal LM's config)."""
    try:
        ids = tuple(image_token_ids(config))
    except ValueError:
        ids = ()
    text = text_config_of(config)
    num_layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    layer_types = getattr(text, "layer_types", None)
    layer_types = tuple(str(t) for t in layer_types) if layer_types else None
    if layer_types is not None and len(layer_types) == num_layers:
        measured = tuple(i for i, t in enumerate(layer_types) if t not in UNMEASURED_LAYER_TYPES)
    else:
        measured = tuple(range(num_layers))
    window = getattr(text, "sliding_window", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None  # some configs keep a sliding_window value that no layer uses
    return ModelFacts(
        model_type=str(getattr(config, "model_type", type(config).__name__)),
        image_token_ids=ids,
        num_layers=num_layers,
        measured_layers=measured,
        layer_types=layer_types,
        sliding_window=int(window) if isinstance(window, int) else None,
    )


def load_model_config(model: Any, model_init_kwargs: dict | None = None):
    """The config of a model given as a PreTrainedModel (plain, PEFT, wrapped) or as a Hub id / local path.

    For an id or path only ``config.json`` is read (offline: from the local cache or folder), with the revision
    and ``trust_remote_code`` the trainer will load the weights with.
    """
    if isinstance(model, str):
        from transformers import AutoConfig

        kwargs = {k: v for k, v in (model_init_kwargs or {}).items() if k in ("revision", "trust_remote_code")}
        return AutoConfig.from_pretrained(model, **kwargs)
    return unwrap_model(model).config


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
