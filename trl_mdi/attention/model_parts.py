"""Reading parts of a loaded model during a forward: a hidden state at chosen positions, the LM head's rows of a few
tokens (gathered under DeepSpeed ZeRO-3 and FSDP2), and the choice-letter logits made of the two.

``model_facts`` reads what a model *is* from its config, before any weight is loaded; this module works on the loaded
modules at run time (a forward hook, parameter gathering). Both the trainer's counterfactual forward and the
profile's reference (``trl_mdi.profile.reference``) compute the counterfactual's choice-letter logits with
:func:`choice_logits`, so the two agree by construction on what ``blind_agrees`` compares::

    with hidden_states_at(unwrap_model(model).base_model, answers.letter_position, completion_length) as hidden:
        model(...)                                    # any forward of the batch: whole, or chunk after chunk
    logits = choice_logits(model, hidden.result(), answers.candidates)   # (B, K), never (B, C, vocabulary)
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..counterfactual import candidate_logits
from .model_facts import unwrap_model


@contextlib.contextmanager
def hidden_states_at(backbone: torch.nn.Module, positions: torch.Tensor, completion_length: int):
    """Collect, over the (chunked) forwards of ``backbone`` inside the block, each row's last hidden state at the
    position that chose completion token ``positions[row]`` (``L - C - 1 + t``; -1: none, a NaN vector, so whatever
    is read from it, such as :func:`choice_logits`, is undefined rather than a number). Rows arrive in order, chunk
    after chunk, as TRL's log-prob path runs them. ``.result()`` gives (B, H).

    ``backbone``: the module whose output is the final hidden state (the ``base_model`` of a transformers model: its
    final norm applied, the LM head not); ``completion_length``: C, the completion's width in the batch (the last C
    positions of every layout are the completion's). Detached: nothing here takes part in a backward pass.
    """
    collected = HiddenStates()

    def hook(_module, _args, output):
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        start = sum(len(c) for c in collected)
        t = positions[start:start + hidden.shape[0]].to(hidden.device)
        index = (hidden.shape[1] - completion_length - 1 + t.clamp(min=0))
        picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), index].detach()
        collected.append(torch.where((t >= 0)[:, None], picked, torch.full_like(picked, math.nan)))

    handle = backbone.register_forward_hook(hook)
    try:
        yield collected
    finally:
        handle.remove()


class HiddenStates(list):
    """The hidden states :func:`hidden_states_at` collected, one (rows, H) tensor per forward; ``result()``: (B, H)."""

    def result(self) -> torch.Tensor:
        if not self:
            raise RuntimeError("hidden_states_at collected nothing: no forward of the hooked backbone ran inside the "
                               "block (hook the module the model's forward calls, e.g. unwrap_model(model).base_model)")
        return torch.cat(self)


@contextlib.contextmanager
def gathered_parameters(params: list):
    """The full tensors of ``params`` inside the block, in order (``None`` entries, a head without bias, stay None):
    under DeepSpeed ZeRO-3 gathered in place (``GatheredParameters``); under FSDP2 a sharded ``DTensor`` parameter
    made whole (``full_tensor()``, an all-gather); else the parameters as they are. Every process must enter the
    block together (both are collectives).

    Why FSDP2 needs it: outside the model's forward its parameters are sharded DTensors, and an operation mixing one
    with a plain tensor (the hidden state) fails ("mixed torch.Tensor and DTensor")."""
    present = [p for p in params if p is not None]
    if any(hasattr(p, "ds_id") for p in present):
        import deepspeed

        with deepspeed.zero.GatheredParameters(present, modifier_rank=None):
            yield list(params)
        return
    yield [_full(p) for p in params]


def _full(param):
    """A DTensor's full tensor (an all-gather over its mesh), anything else as it is."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has no FSDP2 either
        return param
    return param.full_tensor() if isinstance(param, DTensor) else param


@torch.no_grad()
def choice_logits(model: torch.nn.Module, hidden: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """(B, K) float32 logits of each row's choice-letter tokens at the position that chose its answer letter: the
    hidden state ``hidden`` (B, H) there (:func:`hidden_states_at`) through the LM head's rows of those tokens,
    ``h . W_k (+ b_k)`` (``trl_mdi.counterfactual.candidate_logits``); NaN for -1 candidates and for rows without a
    position (``hidden_states_at`` gives them a NaN hidden state).

    ``model``: the transformers model, or any wrapper of it (DDP, DeepSpeed, PEFT: ``unwrap_model``; FSDP2's
    ``fully_shard`` works in place); its output embeddings are gathered for the product under ZeRO-3 and FSDP2, so
    every process must call this together. Only K rows of
    the head are read, never (B, C, vocabulary) logits. Temperature, logit soft-capping and scales are monotone, so
    the argmax over the candidates (what ``blind_agrees`` compares) is the head's own; the values are the head's
    raw logits, before any temperature. A measurement: no gradient flows through it.
    """
    head = unwrap_model(model).get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"{type(unwrap_model(model)).__name__} has no output embeddings with a weight "
                         "(get_output_embeddings()): the choice-letter logits need the LM head's rows")
    with gathered_parameters([head.weight, getattr(head, "bias", None)]) as (weight, bias):
        device = weight.device
        return candidate_logits(hidden.to(device), weight, bias, candidates.to(device))
