"""One generation batch as the live logs receive it (:class:`BatchLog`), and the plain per-rollout records built from
it once, with their final values (:func:`rollout_records`).

The trainer fills a ``BatchLog`` after TRL scored the batch (rewards and advantages gathered from every process, the
rest this process's rows) and hands it to ``trl_mdi.diagnostics.live.write_batch``. A record is plain Python (no
tensors, no images), cheap to gather across processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .. import signals
from ..data.images import row_images
from .answers import answer_fields

if TYPE_CHECKING:
    from ..attention import ModalityAttention


@dataclass(frozen=True, eq=False)
class BatchLog:
    """What the trainer has of one generation batch once TRL scored it. Local rows are this process's, in TRL's order
    (each prompt's generations consecutive); gathered tensors hold every process's rows in process order."""

    step: int  # the optimizer step this batch feeds
    epoch: float
    rows: list[dict]  # local dataset rows (TRL's inputs): label_idx / choices / solution, images
    prompts: list  # local prompts as TRL hands them to rewards
    completions: list  # local completions (strings or messages)
    completion_lengths: list[int]  # local completion lengths in tokens
    rewards: torch.Tensor  # (N_global, F) per reward function, NaN where a reward gave None
    advantages: torch.Tensor  # (N_global,)
    reward_names: Sequence[str]  # the F rewards, in column order
    reward_weights: Sequence[float] | torch.Tensor  # (F,)
    # local per-rollout signals (trl_mdi.signals): attention and / or reliance ones; None: neither computed
    signals: dict[str, torch.Tensor] | None = None
    # the batch's attention/* and reliance/* metrics over every process (trl_mdi.signals.BatchSignals.metrics),
    # computed once: the rollout log's step summary reads them; None: neither computed
    metrics: dict[str, float] | None = None
    attention: ModalityAttention | None = None  # the probe's local result, None: metrics off
    map_rows: Sequence[int] = ()  # local rows that get an attention map (their per-image-token masses were kept)
    strips: Sequence[dict | None] | None = None  # local perception strips (:func:`perception_strips`)
    evidence: Sequence[dict | None] | None = None  # local image evidence (:func:`image_evidence`)
    skipped: torch.Tensor | None = None  # (N_global,) bool: rollouts left out of the update (an unreadable image)


def rollout_records(batch: BatchLog, *, offset: int = 0, answer_format: Callable[..., list[float]] | None = None
                    ) -> list[dict]:
    """This process's rollouts as ``{"rollout": {...}, "attention": {...} or None}``, numbered globally from
    ``offset`` (the process's first row in the gathered tensors), with their rewards, weighted total and advantage.

    The rollout fields are those ``RolloutLogWriter`` reads; the task fields (gold, parsed, format) come from
    :func:`~trl_mdi.diagnostics.answers.answer_fields`. The signal table says where each of the batch's signals
    goes: the counterfactual ones (``trl_mdi.signals.reliance_names()``), when the batch has them, are rollout fields
    too (None where undefined): they need no attention probe, so they go to the rollout log. The attention part is
    the rollout's probe signals (``source="probe"``, as ``trl_mdi.signals.rollout_rows`` gives them) with its index,
    None when the batch has none. Group signals (reward inputs only) go to neither.
    """
    n = len(batch.rows)
    if offset + n > batch.rewards.shape[0]:
        raise ValueError(f"rows {offset}..{offset + n - 1} are not in the {batch.rewards.shape[0]} gathered rewards")
    weights = torch.as_tensor(batch.reward_weights, dtype=batch.rewards.dtype, device=batch.rewards.device)
    rewards = batch.rewards[offset : offset + n]
    # TRL's weighted total is a nansum, but a rollout with no reward at all (every one None or NaN: an unreadable
    # image, or nothing applied) is set aside by TRL (NaN total, advantage 0): it has no total, not a total of 0.
    totals = [None if unscored else total for total, unscored in
              zip((rewards * weights).nansum(dim=1).tolist(), rewards.isnan().all(dim=1).tolist())]
    skipped = ([bool(x) for x in batch.skipped[offset : offset + n].tolist()] if batch.skipped is not None
               else [False] * n)
    advantages = batch.advantages[offset : offset + n].tolist()
    table = batch.signals or {}
    reliance = signals.rollout_rows({k: table[k] for k in signals.reliance_names() if k in table}) or [{}] * n
    attention = signals.rollout_rows({k: v for k, v in table.items() if _source(k) == signals.PROBE}) or [None] * n
    strips = list(batch.strips or []) + [None] * n
    evidence = list(batch.evidence or []) + [None] * n
    records = []
    for i, (row, prompt, completion, length) in enumerate(zip(batch.rows, batch.prompts, batch.completions,
                                                              batch.completion_lengths)):
        index, text = offset + i, completion_string(completion)
        rollout = {
            "index": index,
            "prompt": without_image_payloads(prompt),
            "image_sizes": [getattr(img, "size", None) for img in row_images(row)],
            "completion": text,
            "rewards": {name: None if math.isnan(v) else v for name, v in zip(batch.reward_names, rewards[i].tolist())},
            "reward": totals[i],
            "advantage": advantages[i],
            **({"skipped": "unreadable image"} if skipped[i] else {}),
            **answer_fields(text, row, answer_format),
            "completion_length": length,
            **reliance[i],
            **({"perception": strips[i]} if strips[i] is not None else {}),
            **({"image_evidence": evidence[i]} if evidence[i] is not None else {}),
        }
        records.append({"rollout": rollout,
                        "attention": None if attention[i] is None else {**attention[i], "index": index}})
    return records


def _source(name: str) -> str | None:
    """The table source of a batch signal's name (None: not in the table)."""
    signal = signals.signal_of(name)
    return None if signal is None else signal.source


def completion_string(completion: Any) -> str:
    """A completion as text: a string as is, messages' contents joined."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in completion)
    return str(completion)


def without_image_payloads(prompt: Any) -> Any:
    """The prompt messages with image parts reduced to placeholders (no PIL objects to pickle across ranks)."""
    if not isinstance(prompt, list):
        return prompt
    out = []
    for msg in prompt:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            content = [{"type": "image"} if isinstance(p, dict) and p.get("type") == "image" else p for p in content]
            msg = {**msg, "content": content}
        out.append(msg)
    return out


def perception_strips(scores: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor, tokenizer, *,
                      top_p: float, signal: str, rows: int) -> list[dict | None]:
    """For the first ``rows`` local rollouts, each completion token with its perception score and whether the
    perception filter keeps it (the same per-sequence top-p selection, ``top_p_token_mask``); None for the others."""
    from ..tprl import fit_width, top_p_token_mask

    mask = completion_mask.bool().cpu()
    scores = fit_width(scores.float().cpu(), mask.shape[1])
    kept = top_p_token_mask(scores, mask, top_p)
    strips: list[dict | None] = []
    for i in range(len(mask)):
        if i >= rows:
            strips.append(None)
            continue
        ids = completion_ids[i].cpu()[mask[i]].tolist()
        strips.append({"signal": signal, "top_p": top_p, "tokens": [tokenizer.decode([t]) for t in ids],
                       "scores": scores[i][mask[i]].tolist(), "kept": kept[i][mask[i]].tolist()})
    return strips


EVIDENCE_MIN_GAIN = 1.0
"""A token is image evidence when the image made it at least this many nats likelier than the counterfactual did
(g_t >= 1: about 2.7 times as likely): a colour read off the image, not the drift of a token that barely depends on
it (the tiny look-or-guess model's non-perception tokens move by about 0.001)."""

EVIDENCE_TOP_K = 3
"""At most this many tokens are marked per rollout: the few where the image entered most."""


def image_evidence(token_gain: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor, tokenizer,
                   *, rows: int, min_gain: float = EVIDENCE_MIN_GAIN, top_k: int = EVIDENCE_TOP_K
                   ) -> list[dict | None]:
    """For the first ``rows`` local rollouts, the completion's tokens (their text, as TRL decodes the completion) and
    the ones whose log-probability the counterfactual image changes most: the ``top_k`` largest per-token gains
    ``g_t = log p(y_t | I) - log p(y_t | I')`` (``token_gain``, (B, C), NaN where undefined) that reach ``min_gain``;
    None for the other rows. A guessing rollout, whose tokens do not depend on the image, gets none marked.

    >>> class Tok:
    ...     def decode(self, ids, **kwargs):
    ...         return "".join({1: " the", 2: " shape", 3: " is", 4: " red"}[i] for i in ids)
    >>> gain = torch.tensor([[0.0, 0.01, -0.02, 4.4], [0.0, 0.0, 0.001, float("nan")]])
    >>> ev = image_evidence(gain, torch.tensor([[1, 2, 3, 4], [1, 2, 3, 0]]), torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
    ...                     Tok(), rows=2)
    >>> ev[0]["marked"], ev[1]["marked"], ev[0]["tokens"]
    ([3], [], [' the', ' shape', ' is', ' red'])
    """
    from ..answer_tokens import completion_token_texts
    from ..tprl import fit_width

    mask = completion_mask.bool().cpu()
    gains = fit_width(token_gain.float().cpu(), mask.shape[1])
    out: list[dict | None] = []
    for i in range(len(mask)):
        if i >= rows:
            out.append(None)
            continue
        ids = completion_ids[i].cpu()[mask[i]]
        g = gains[i][mask[i]]
        order = [t for t in torch.argsort(g.nan_to_num(nan=-math.inf), descending=True).tolist()
                 if math.isfinite(float(g[t])) and float(g[t]) >= min_gain][:top_k]
        out.append({"tokens": completion_token_texts(tokenizer, ids), "marked": sorted(order),
                    "gains": [float(g[t]) for t in sorted(order)], "min_gain": min_gain})
    return out
