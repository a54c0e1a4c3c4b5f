"""Counterfactual reliance signals: did a rollout's answer come from the image or from the wording?

Attention mass (MDI) cannot tell. A counterfactual comparison can: score the SAME rollout (prompt + sampled
completion, teacher-forced) once with the real image I and once with a counterfactual I' (an image of the same size,
one of ``trl_mdi.tprl.perturb``'s kinds, by default ``black``, which keeps every token position; or no image at all,
``strip_images``), and compare per completion token t (shapes: B rollouts, C completion tokens, K choice letters):

    g_t = log p(y_t | I, q, y_<t) - log p(y_t | I', q, y_<t)

* ``visual_gain`` = mean of g_t over the completion (VIG-style, arXiv 2602.17186): > 0 the image made the sampled
  text likelier, ~0 the text would have come out the same without it, < 0 the image argued against it.
* ``answer_visual_gain`` = sum of g_t over the answer span (``answer_span``): the pointwise visual information
  log p(a | I, q) - log p(a | I', q) of the answer a (PVI, Ethayarajh et al. 2022, in nats), undiluted by the
  chain of thought.
* ``blind_agrees`` = whether the counterfactual's own argmax over the choice letters, at the position where the
  rollout wrote its answer letter, is the rollout's letter: the "blind" model would have answered the same
  (MMStar's leakage, arXiv 2403.20330, per rollout).

Everything here is pure: tensors and strings in, tensors out (the counterfactual prompts too: messages and images
in, messages out), and imports nothing of trl_mdi outside the maths (``trl_mdi.tprl.perturb``'s images);
the trainer runs the counterfactual forward. Where a rollout wrote its answer (the answer span, the choice letters'
token ids) is ``trl_mdi.answer_tokens``'s; whether a processor encodes a counterfactual prompt is checked by
``trl_mdi.batch.check_counterfactual_encodes``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "IMAGE_PART_TYPES", "NO_IMAGE", "answer_visual_gain", "blind_agrees", "candidate_logits", "counterfactual_kinds",
    "counterfactual_prompts", "gather_choice_logits", "strip_images", "visual_gain", "with_images",
]

IMAGE_PART_TYPES = ("image", "image_url")
"""Content-part types ``strip_images`` removes (TRL's ``{"type": "image"}``, OpenAI-style ``image_url``)."""


# ---------------------------------------------------------------------------------------------------------------
# Token-level log-prob differences
# ---------------------------------------------------------------------------------------------------------------


def _check_same_2d(*named: tuple[str, torch.Tensor]) -> None:
    shape = named[0][1].shape
    for name, t in named:
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D (B, C), got shape {tuple(t.shape)}")
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like {named[0][0]}")


def _masked_gain(logps: torch.Tensor, cf_logps: torch.Tensor, mask: torch.Tensor, name: str,
                 has_image: torch.Tensor | None) -> tuple:
    _check_same_2d(("logps", logps), ("cf_logps", cf_logps), (name, mask))
    dtype = torch.promote_types(torch.promote_types(logps.dtype, cf_logps.dtype), torch.float32)
    valid = mask != 0
    if has_image is not None:
        if has_image.shape != logps.shape[:1]:
            raise ValueError(f"has_image must have shape ({logps.shape[0]},), got {tuple(has_image.shape)}")
        valid = valid & has_image.bool()[:, None].to(valid.device)
    diff = logps.to(dtype) - cf_logps.to(dtype)
    total = torch.where(valid, diff, torch.zeros((), dtype=dtype, device=diff.device)).sum(dim=1)
    return total, valid.sum(dim=1)


def visual_gain(logps: torch.Tensor, cf_logps: torch.Tensor, mask: torch.Tensor, *,
                has_image: torch.Tensor | None = None) -> torch.Tensor:
    """Per rollout, the mean over completion tokens (``mask != 0``) of ``log p(y_t | I) - log p(y_t | I')``.

    ``logps`` / ``cf_logps``: (B, C) log-probs of the sampled tokens under the real and the counterfactual image;
    ``mask``: (B, C) completion mask. Returns (B,), at least float32; NaN for a row without a token. Masked
    positions are ignored even when they hold NaN or inf. ``has_image`` (B,) bool, optional: rows without an
    image are NaN (their "counterfactual" is the rollout itself, and a gain of exactly 0 would read as "answered
    from the wording").

    >>> lp = torch.tensor([[-1.0, -2.0, -9.0], [-1.0, -1.0, -1.0]])
    >>> cf = torch.tensor([[-2.0, -4.0, float("nan")], [-1.0, -1.0, -1.0]])
    >>> visual_gain(lp, cf, torch.tensor([[1, 1, 0], [0, 0, 0]]))
    tensor([1.5000,    nan])
    """
    total, count = _masked_gain(logps, cf_logps, mask, "mask", has_image)
    return torch.where(count > 0, total / count.clamp(min=1).to(total.dtype), torch.full_like(total, math.nan))


def answer_visual_gain(logps: torch.Tensor, cf_logps: torch.Tensor, span_mask: torch.Tensor, *,
                       has_image: torch.Tensor | None = None) -> torch.Tensor:
    """Per rollout, the SUM over the answer span of ``log p(y_t | I) - log p(y_t | I')``.

    That sum is ``log p(a | I, q, think) - log p(a | I', q, think)`` for the answer a the span covers (the chain of
    thought before it is teacher-forced identically in both passes). ``span_mask``: (B, C), from
    ``answer_span_mask``. Returns (B,), at least float32; NaN where the row has no span (or, given ``has_image``,
    no image).

    >>> lp, cf = torch.tensor([[-1.0, -0.1], [-1.0, -1.0]]), torch.tensor([[-1.0, -2.1], [-3.0, -3.0]])
    >>> answer_visual_gain(lp, cf, torch.tensor([[False, True], [False, False]]))
    tensor([2.0000,    nan])
    """
    total, count = _masked_gain(logps, cf_logps, span_mask, "span_mask", has_image)
    return torch.where(count > 0, total, torch.full_like(total, math.nan))


# ---------------------------------------------------------------------------------------------------------------
# The blind answer: what would the counterfactual have chosen at the answer letter?
# ---------------------------------------------------------------------------------------------------------------


def gather_choice_logits(logits: torch.Tensor, positions: torch.Tensor, candidate_ids: torch.Tensor
                         ) -> torch.Tensor:
    """(B, K) logits of each row's candidate letter tokens at the completion position that chose its letter.

    ``logits``: (B, C, V) counterfactual logits aligned with the completion (``logits[b, t]`` predicts completion
    token t); ``positions``: (B,) long, the position of the token holding the answer letter, -1 for none: for a
    one-character ``letter`` group that is ``answer_span(...)[1] - 1`` (the span's first tokens may be empty ones);
    ``candidate_ids``: (B, K) long (``choice_letter_token_ids`` per row), -1 padding. Entries with position or id
    -1 are NaN (``blind_agrees`` ignores them past a row's choices, and leaves a row missing one of its
    choices undefined). Float32 at least.

    >>> lg = torch.arange(2 * 3 * 5, dtype=torch.float32).reshape(2, 3, 5)
    >>> gather_choice_logits(lg, torch.tensor([1, -1]), torch.tensor([[0, 4, -1], [1, 2, 3]]))
    tensor([[5., 9., nan],
            [nan, nan, nan]])
    """
    if logits.dim() != 3 or positions.shape != logits.shape[:1] or candidate_ids.dim() != 2 \
            or candidate_ids.shape[0] != logits.shape[0]:
        raise ValueError(f"expected logits (B, C, V), positions (B,), candidate_ids (B, K); got "
                         f"{tuple(logits.shape)}, {tuple(positions.shape)}, {tuple(candidate_ids.shape)}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    rows = torch.arange(logits.shape[0], device=logits.device)
    at = logits[rows, positions.clamp(min=0)]  # (B, V)
    out = at.gather(1, candidate_ids.clamp(min=0)).to(dtype)
    valid = (positions >= 0)[:, None] & (candidate_ids >= 0)
    return torch.where(valid, out, torch.full_like(out, math.nan))


def blind_agrees(cf_choice_logits: torch.Tensor, answer_index: torch.Tensor, n_choices: torch.Tensor,
                 has_image: torch.Tensor) -> torch.Tensor:
    """1.0 where the counterfactual would have picked the rollout's own letter, else 0.0; (B,) float32.

    ``cf_choice_logits``: (B, K) counterfactual logits of the K candidate letter tokens at the position that
    chose the rollout's answer letter (``gather_choice_logits``); only the row's first ``n_choices`` columns
    count (the rest may be NaN padding). ``answer_index``: (B,) long, the rollout's letter as an index into the
    candidates (A = 0), -1 for no parsable answer. ``has_image``: (B,) bool.

        blind_agrees_b = [argmax_{k < n_b} cf_choice_logits[b, k] == answer_index_b]

    Ties go to the lowest index (``torch.argmax``). NaN where there is no answer, the answer is not one of the
    row's choices (``answer_index >= n_choices``), one of the row's candidate logits is NaN (a letter without a
    token: the candidates are incomplete), or the row has no image (no counterfactual to speak of).

    >>> cf = torch.tensor([[0.1, 2.0, 0.3], [3.0, 1.0, 9.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    >>> blind_agrees(cf, torch.tensor([1, 1, -1, 1]), torch.tensor([3, 2, 3, 3]),
    ...              torch.tensor([True, True, True, False]))
    tensor([1., 0., nan, nan])
    """
    if cf_choice_logits.dim() != 2:
        raise ValueError(f"cf_choice_logits must be 2-D (B, K), got shape {tuple(cf_choice_logits.shape)}")
    b, k = cf_choice_logits.shape
    for name, t in (("answer_index", answer_index), ("n_choices", n_choices), ("has_image", has_image)):
        if t.shape != (b,):
            raise ValueError(f"{name} must have shape ({b},), got {tuple(t.shape)}")
    if bool((n_choices > k).any()):
        raise ValueError(f"n_choices exceeds the {k} candidate columns of cf_choice_logits")
    in_row = torch.arange(k, device=cf_choice_logits.device)[None, :] < n_choices[:, None]
    scores = torch.where(in_row, cf_choice_logits.float(), torch.full((), -math.inf,
                                                                       device=cf_choice_logits.device))
    missing = torch.isnan(scores)
    agrees = (scores.masked_fill(missing, -math.inf).argmax(dim=1) == answer_index).float()
    complete = ~missing.any(dim=1)
    defined = (answer_index >= 0) & (answer_index < n_choices) & has_image.bool() & complete
    return torch.where(defined, agrees, torch.full_like(agrees, math.nan))


# ---------------------------------------------------------------------------------------------------------------
# The counterfactual prompt: the image removed, or replaced by other pixels
# ---------------------------------------------------------------------------------------------------------------


def strip_images(prompt_messages: list[dict[str, Any]] | str) -> list[dict[str, Any]] | str:
    """The chat messages with every image part removed: the text-only "without the image" counterfactual prompt.

    Each message is copied (the input is never modified); list content keeps its non-image parts in their
    order; string content, and a plain-string (standard format) prompt, come back unchanged. A message whose
    only parts were images keeps its role with empty content (the turn structure stays). Removed part types:
    ``IMAGE_PART_TYPES``.

    TRL's ``prepare_multimodal_messages`` inserts an image placeholder into a string-content user turn when
    images are passed, so the forward that uses this prompt must also pass no images. The prompt then has fewer
    tokens than the real one: align the two passes on completion tokens, not on absolute positions. Models whose
    processor or template require an image cannot take it; use the ``black`` image instead.

    >>> msgs = [{"role": "system", "content": "Be brief."},
    ...         {"role": "user", "content": [{"type": "text", "text": "Left:"}, {"type": "image"},
    ...                                      {"type": "text", "text": "Colour?"}]}]
    >>> strip_images(msgs)[1]["content"]
    [{'type': 'text', 'text': 'Left:'}, {'type': 'text', 'text': 'Colour?'}]
    >>> len(msgs[1]["content"])
    3
    """
    if isinstance(prompt_messages, str):
        return prompt_messages
    out = []
    for message in prompt_messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [p for p in content if not (isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES)]
            message = {**message, "content": content}
        else:
            message = dict(message)
        out.append(message)
    return out


def with_images(prompt: list[dict], images: Sequence[Any]) -> list[dict]:
    """Chat messages with their image parts' images replaced, in order, by ``images`` (a perturbed or
    counterfactual copy of the row's images): same parts, same positions, other pixels. The input is not changed.

    >>> msgs = [{"role": "user", "content": [{"type": "image", "image": "real"}, {"type": "text", "text": "Q?"}]}]
    >>> with_images(msgs, ["grey"])[0]["content"][0]["image"], msgs[0]["content"][0]["image"]
    ('grey', 'real')
    """
    images = list(images)
    out, k = [], 0
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    if k >= len(images):
                        raise ValueError(f"the prompt has more image parts than the {len(images)} images given")
                    part = {**part, "image": images[k]}
                    k += 1
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    if k != len(images):
        raise ValueError(f"the prompt has {k} image parts but {len(images)} images were given")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Counterfactual prompts, and the blind answer's logits from the LM head
# ---------------------------------------------------------------------------------------------------------------

NO_IMAGE = "none"
"""The counterfactual kind that removes the image (a text-only prompt); the others are ``trl_mdi.tprl.perturb``'s
pixel perturbations of the same size (same token positions)."""


def counterfactual_kinds() -> tuple[str, ...]:
    """Every valid ``counterfactual_image``: the pixel perturbations, then ``"none"``."""
    from .tprl.perturb import PERTURBATIONS

    return (*PERTURBATIONS, NO_IMAGE)


def counterfactual_prompts(prompts: list, images: list[list], kind: str, *, seed: int, step: int,
                           row_offset: int = 0, **perturbation) -> list:
    """The prompts (chat messages with their images inserted) with each row's images replaced by its counterfactual:
    removed (``kind="none"``: ``strip_images``) or perturbed deterministically per (seed, step, row, image)
    (``trl_mdi.tprl.perturb.perturb_images``; ``perturbation`` holds its size, probability, noise and blur)."""
    from .tprl.perturb import perturb_images

    if kind == NO_IMAGE:
        return [strip_images(p) for p in prompts]
    perturbed = perturb_images(images, kind, seed=seed, step=step, row_offset=row_offset, **perturbation)
    return [with_images(p, imgs) for p, imgs in zip(prompts, perturbed)]


def candidate_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     candidates: torch.Tensor) -> torch.Tensor:
    """(B, K) logits of each row's candidate tokens from its hidden state (B, H) at the position that chose the letter,
    through the LM head's rows ``weight[candidates]``: ``h . W_k (+ b_k)``; NaN for -1 candidates. Temperature,
    soft-capping and logit scales are monotone, so the argmax over candidates is the head's own.

    >>> candidate_logits(torch.tensor([[1.0, 2.0]]), torch.eye(2), None, torch.tensor([[1, 0, -1]]))
    tensor([[2., 1., nan]])
    """
    w = weight[candidates.clamp(min=0)].to(hidden.dtype)  # (B, K, H)
    out = torch.einsum("bkh,bh->bk", w, hidden).float()
    if bias is not None:
        out = out + bias[candidates.clamp(min=0)].float()
    return torch.where(candidates >= 0, out, torch.full_like(out, math.nan))
