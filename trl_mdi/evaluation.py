"""Greedy held-out evaluation of a VLM on multiple-choice rows: accuracy, format and what the answers looked like.

Used by the warm-up (``python -m trl_mdi.warmup --evaluate``), the demo and the learning-check benchmark, so every
accuracy figure of the project is computed the same way, with the reward's own answer parser.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from .rewards import LETTERS, completion_text


@dataclasses.dataclass
class EvalResult:
    """Greedy held-out accuracy and what the answers looked like."""

    accuracy: float
    format_rate: float  # fraction of completions the lenient think format accepts (any text after </think>)
    answered_rate: float  # fraction with a parseable, unhedged letter
    clean_rate: float  # fraction in the asked format (think_format_reward's rule), ended at end of sequence
    letters: dict[str, int]  # parsed letter -> count ("" = none)
    completions: list[str]
    seconds: float = 0.0

    def summary(self) -> str:
        spread = " ".join(f"{k or '-'}:{v}" for k, v in sorted(self.letters.items()))
        return (f"accuracy {self.accuracy:.3f}, format {self.format_rate:.2f}, clean {self.clean_rate:.2f}, "
                f"answered {self.answered_rate:.2f}, letters {spread}")


def score_completions(completions: Sequence[Any], labels: Sequence[int], num_choices: int | Sequence[int] = 4,
                      ended: Sequence[bool] | None = None) -> EvalResult:
    """Score completions against label indices with the reward's parser (``extract_choice_letter``).

    ``ended`` (optional, one bool per completion) says whether generation stopped at the end-of-sequence token;
    a completion counts as clean only if it did and its text is exactly ``<think>...</think>\\nAnswer: X``.

    >>> r = score_completions(["<think> red</think>\\nAnswer: A", "Answer: C", "no idea"], [0, 1, 2])
    >>> round(r.accuracy, 3), round(r.format_rate, 3), round(r.clean_rate, 3), r.letters
    (0.333, 0.333, 0.333, {'A': 1, 'C': 1, '': 1})
    """
    from .answer_format import clean_format
    from .rewards import parse_mc_answer, think_format_lenient_reward

    if len(completions) != len(labels):
        raise ValueError(f"{len(completions)} completions but {len(labels)} labels")
    if not completions:
        raise ValueError("nothing to score: no completions")
    counts = [num_choices] * len(labels) if isinstance(num_choices, int) else list(num_choices)
    texts = [completion_text(c) for c in completions]
    parsed = [parse_mc_answer(t, n)[0] for t, n in zip(texts, counts)]
    correct = sum(p is not None and p == LETTERS[int(y)] for p, y in zip(parsed, labels))
    fmt = think_format_lenient_reward(texts)
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
def evaluate_accuracy(model, processor, ds, *, batch_size: int = 50, max_new_tokens: int = 16) -> EvalResult:
    """Greedy held-out multiple-choice accuracy of ``model`` on ``ds`` (rows of ``synthetic_dataset``).

    Prompts are rendered as GRPOTrainer renders them (``prepare_multimodal_messages`` + the processor's chat
    template with the generation prompt); generation is greedy with ``suppress_tokens=[image_token_id]``, the one
    departure GRPOTrainer's sampling makes from a plain ``generate``. The model's train/eval mode is restored.
    """
    from trl.data_utils import prepare_multimodal_messages

    start = time.perf_counter()
    was_training = model.training
    model.eval()
    tok = getattr(processor, "tokenizer", processor)
    image_token_id = model.config.image_token_id
    texts: list[str] = []
    ended: list[bool] = []
    try:
        for lo in range(0, len(ds), batch_size):
            batch = ds[lo : lo + batch_size]
            conversations = [prepare_multimodal_messages(p, images=[img])
                             for p, img in zip(batch["prompt"], batch["image"])]
            inputs = processor.apply_chat_template(conversations, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True, return_tensors="pt",
                                                   processor_kwargs={"padding": True, "padding_side": "left"})
            inputs = inputs.to(model.device)
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 suppress_tokens=[image_token_id], pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id, temperature=None, top_p=None, top_k=None)
            new = out[:, inputs["input_ids"].shape[1]:]
            texts += tok.batch_decode(new, skip_special_tokens=True)
            ended += (new == tok.eos_token_id).any(dim=1).tolist()
    finally:
        model.train(was_training)
    result = score_completions(texts, ds["label_idx"], [len(c) for c in ds["choices"]], ended)
    result.seconds = time.perf_counter() - start
    return result


# ------------------------------------------------------------------------------------------------ warm start
