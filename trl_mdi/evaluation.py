"""Greedy held-out evaluation of a VLM on multiple-choice rows: accuracy, format and what the answers looked like.

Used by the repository's warm-up (``python -m fixtures.warmup --evaluate``), the demo and the learning-check
benchmark, so every accuracy figure of the project is computed the same way, with the reward's own answer parser.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from .answer_format import LETTERS, too_many_choices
from .rewards import completion_text


@dataclasses.dataclass
class EvalResult:
    """Greedy held-out accuracy and what the answers looked like."""

    accuracy: float
    format_rate: float  # fraction of completions the lenient think format accepts (any text after </think>)
    answered_rate: float  # fraction with a parseable, unhedged letter
    clean_rate: float  # fraction in the asked format (think_format's rule), ended at end of sequence
    letters: dict[str, int]  # parsed letter -> count ("" = none)
    completions: list[str]
    seconds: float = 0.0
    # With measure_attention: per row, the MDI of its greedy answer for "all" measured layers and each layer
    # segment (e.g. "late"); NaN for a row without a generated token.
    mdi: dict[str, list[float]] | None = None

    def mean_mdi(self, segment: str = "all", rows: Sequence[int] | None = None) -> float:
        """Mean MDI of ``segment`` over ``rows`` (default all) where finite; NaN when none is (or not measured)."""
        if self.mdi is None:
            return float("nan")
        values = self.mdi[segment] if rows is None else [self.mdi[segment][i] for i in rows]
        finite = [v for v in values if math.isfinite(v)]
        return sum(finite) / len(finite) if finite else float("nan")

    def summary(self) -> str:
        spread = " ".join(f"{k or '-'}:{v}" for k, v in sorted(self.letters.items()))
        return (f"accuracy {self.accuracy:.3f}, format {self.format_rate:.2f}, clean {self.clean_rate:.2f}, "
                f"answered {self.answered_rate:.2f}, letters {spread}")


def score_completions(completions: Sequence[Any], labels: Sequence[int], num_choices: int | Sequence[int] = 4,
                      ended: Sequence[bool] | None = None) -> EvalResult:
    """Score completions against label indices with the reward's parser (``extract_choice_letter``).

    ``num_choices``: one count for every row or one per row, at most 26 (the choice letters A to Z; ValueError
    beyond). ``ended`` (optional, one bool per completion) says whether generation stopped at the end-of-sequence
    token; a completion counts as clean only if it did and its text is exactly ``<think>...</think>\\nAnswer: X``.

    >>> r = score_completions(["<think> red</think>\\nAnswer: A", "Answer: C", "no idea"], [0, 1, 2])
    >>> round(r.accuracy, 3), round(r.format_rate, 3), round(r.clean_rate, 3), r.letters
    (0.333, 0.333, 0.333, {'A': 1, 'C': 1, '': 1})
    """
    from .answer_format import clean_format
    from .rewards import parse_mc_answer, think_format_lenient

    if len(completions) != len(labels):
        raise ValueError(f"{len(completions)} completions but {len(labels)} labels")
    if not completions:
        raise ValueError("nothing to score: no completions")
    counts = [num_choices] * len(labels) if isinstance(num_choices, int) else list(num_choices)
    for i, n in enumerate(counts):
        if (error := too_many_choices(n, f"row {i}")) is not None:
            raise ValueError(error)
    texts = [completion_text(c) for c in completions]
    parsed = [parse_mc_answer(t, n)[0] for t, n in zip(texts, counts)]
    correct = sum(p is not None and p == LETTERS[int(y)] for p, y in zip(parsed, labels))
    fmt = think_format_lenient(texts)
    ended = [True] * len(texts) if ended is None else list(ended)
    clean = sum(bool(e) and clean_format(t, choices=[None] * n) for t, e, n in zip(texts, ended, counts))
    return EvalResult(
        accuracy=correct / len(texts),
        format_rate=sum(fmt) / len(texts),
        answered_rate=sum(p is not None for p in parsed) / len(texts),
        clean_rate=clean / len(texts),
        letters=dict(Counter(p or "" for p in parsed)),
        completions=texts,
    )


@torch.no_grad()
def evaluate_accuracy(model, processor, ds, *, batch_size: int = 50, max_new_tokens: int = 16,
                      measure_attention: bool = False, segments: str | dict | None = "thirds") -> EvalResult:
    """Greedy held-out multiple-choice accuracy of ``model`` on ``ds`` (rows of ``synthetic_dataset``).

    Prompts are encoded and laid out by the trainer's batch builder (``trl_mdi.batch``: the images inserted as
    GRPOTrainer inserts them, the chat template with the generation prompt); generation is greedy with the image
    placeholder ids suppressed, the one departure GRPOTrainer's sampling makes from a plain ``generate``, and ends at
    the generation config's end-of-sequence ids. The model's train/eval mode is restored.

    ``measure_attention``: also measure, per row, the MDI of the greedy answer (``measure_modality_attention`` on
    prompt + answer, the answer's tokens up to its end-of-sequence as queries, as the trainer measures rollouts;
    text = every prompt token that is no image token), for all measured layers and each of ``segments``.
    """
    from .attention import measure_modality_attention
    from .attention.model_facts import model_facts
    from .batch import completion_mask_until_eos, encode_prompts, eos_token_ids, policy_batch

    start = time.perf_counter()
    was_training = model.training
    model.eval()
    tok = getattr(processor, "tokenizer", processor)
    eos = eos_token_ids(model, tok)
    facts = model_facts(model.config)
    texts: list[str] = []
    ended: list[bool] = []
    mdi: dict[str, list[float]] = {}
    try:
        for lo in range(0, len(ds), batch_size):
            batch = ds[lo : lo + batch_size]
            prompt_ids, fields = encode_prompts(processor, batch["prompt"], [[img] for img in batch["image"]],
                                                facts=facts, dtype=getattr(model, "dtype", None))
            prompt = policy_batch(prompt_ids, [[] for _ in prompt_ids], pad_token_id=tok.pad_token_id,
                                  multimodal=fields, device=model.device, facts=facts)
            out = model.generate(**prompt.model_inputs(), max_new_tokens=max_new_tokens, do_sample=False,
                                 suppress_tokens=list(model_facts(model.config).image_token_ids),
                                 pad_token_id=tok.pad_token_id, eos_token_id=eos, temperature=None, top_p=None,
                                 top_k=None)
            new = out[:, prompt.input_ids.shape[1]:]
            texts += tok.batch_decode(new, skip_special_tokens=True)
            ended += torch.isin(new, torch.tensor(eos, device=new.device)).any(dim=1).tolist()
            if measure_attention:
                # The answer's tokens up to and including its end of sequence are the measured queries, as the
                # trainer measures rollouts; text = every prompt token that is no image token.
                answer = policy_batch(prompt.input_ids, new, prompt_mask=prompt.attention_mask,
                                      completion_mask=completion_mask_until_eos(new, eos), multimodal=fields,
                                      pad_token_id=tok.pad_token_id, device=model.device, facts=facts)
                result = measure_modality_attention(model, **answer.probe_inputs())
                for name, m in result.segment_metrics(segments).items():
                    mdi.setdefault(name, []).extend(m["mdi"].tolist())
    finally:
        model.train(was_training)
    result = score_completions(texts, ds["label_idx"], [len(c) for c in ds["choices"]], ended)
    result.mdi = mdi if measure_attention else None
    result.seconds = time.perf_counter() - start
    return result
