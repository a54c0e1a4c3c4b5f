"""Did the answer come from the image? The counterfactual reliance signals of a checkpoint, measured from scratch.

The trainer computes ``visual_gain``, ``answer_visual_gain``, ``blind_agrees`` and ``answer_image_attention`` from
TRL's log-prob forwards. This module computes them again with nothing of TRL's log-prob path: the same rollouts
laid out by the project's one batch builder (``trl_mdi.batch``), then PLAIN no-grad forwards
(``model(**batch.model_inputs())``, every position's logits, ``log_softmax`` in float32), once with the real
images and once per counterfactual (``trl_mdi.counterfactual.counterfactual_prompts``: a pixel perturbation of the
same size, or ``"none"``, the image removed). It is the reference the trainer is checked against
(:func:`reference_signals`, on explicit tensors), and the measurement behind the profile command's reliance section
and the language-prior benchmark (:func:`measure_reliance`, on dataset rows).

Alignment. Completion tokens are the last C positions of every layout (prompts left-padded, completions
right-padded), so the logits at positions L-C-1 .. L-2 predict them, whatever the prompt's length: a text-only
counterfactual prompt (fewer tokens) aligns with the real one on the completion.

Per rollout, with y the completion, I the real images, I' the counterfactual (``trl_mdi.counterfactual``):
``visual_gain`` = mean_t [log p(y_t | I) - log p(y_t | I')]; ``answer_visual_gain`` = the same summed over the answer
letter's tokens; ``blind_agrees`` = whether I''s most likely choice letter, at the position that wrote the
answer letter, is the rollout's; ``answer_image_attention`` = the probe's image mass (``token_segment`` layers)
at that position; and any other counterfactual entry of the signal table (``trl_mdi.signals.reliance_names``), all
computed by ``trl_mdi.signals.counterfactual_signals`` from these passes. ``mdi`` / ``mdi_<segment>`` come from the
same probe forward.

The choice letters' logits are the one quantity not read off the full logits: as in the trainer, the backbone's
hidden state at the position that chose the letter goes through the LM head's rows of the choice letters
(``trl_mdi.attention.model_parts.choice_logits``), so the profile and the trainer compare letters with one function.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..answer_format import DEFAULT_ANSWER_PATTERN
from ..answer_tokens import LETTERS, answer_tokens
from ..attention.model_facts import model_facts, unwrap_model
from ..attention.model_parts import choice_logits, hidden_states_at
from ..batch import (
    PolicyBatch,
    check_counterfactual_encodes,
    completion_mask_until_eos,
    encode_prompts,
    eos_token_ids,
    pad_rows,
    policy_batch,
)
from ..counterfactual import counterfactual_kinds, counterfactual_prompts
from ..signals import (
    CounterfactualForward,
    CounterfactualInputs,
    PolicyForward,
    counterfactual_signals,
    reliance_names,
)

__all__ = ["RelianceMeasurement", "check_counterfactuals", "completion_logits", "generate_completions",
           "measure_reliance", "reference_signals"]


# ---------------------------------------------------------------------------------------------------------------
# Prompts, layouts, plain forwards
# ---------------------------------------------------------------------------------------------------------------


def _has_filled_image(prompt: list[dict]) -> bool:
    return any(isinstance(part, dict) and part.get("type") == "image" and "image" in part
               for m in prompt if isinstance(m.get("content"), list) for part in m["content"])


def _image_list(images: Any) -> list:
    """A row's images as a list: a list or tuple as it is, one image as [image], None as []."""
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def _inserted(prompts: Sequence[list[dict]], images: Sequence[Sequence[Any]]) -> list[list[dict]]:
    """Chat prompts with each row's images inserted as GRPOTrainer inserts them (left as they are when the prompt
    already carries its images, as TRL's own prompts do after generation)."""
    from trl.data_utils import prepare_multimodal_messages

    return [prepare_multimodal_messages(p, images=[] if _has_filled_image(p) else _image_list(imgs))
            for p, imgs in zip(prompts, images)]


def _counterfactual(prompts: list[list[dict]], images: Sequence[Sequence[Any]], kind: str, *, seed: int,
                    step: int, rows: Sequence[int], perturbation: dict) -> list[list[dict]]:
    """``counterfactual_prompts`` row by row, row i drawing its perturbation as row ``rows[i]`` (the trainer's rows are
    ``row_offset + i``, which this reproduces; the profile gives every rollout of a prompt the prompt's index)."""
    return [counterfactual_prompts([p], [_image_list(imgs)], kind, seed=seed, step=step, row_offset=int(r),
                                   **perturbation)[0] for p, imgs, r in zip(prompts, images, rows)]


def _pad_id(model, tok) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else eos_token_ids(model, tok)[0]


def _layout(model, processor, prompts: list[list[dict]], completion_ids: torch.Tensor,
            completion_mask: torch.Tensor, pad: int) -> PolicyBatch:
    """Prompt + completion laid out as the trainer lays them out for this model's family."""
    facts = model_facts(unwrap_model(model).config)
    prompt_ids, fields = encode_prompts(processor, prompts, facts=facts)  # images already in the messages
    return policy_batch(prompt_ids, completion_ids, completion_mask=completion_mask, pad_token_id=pad,
                        multimodal=fields, device=model.device, facts=facts)


@torch.no_grad()
def completion_logits(model, batch: PolicyBatch, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, logps)`` of the completion from one plain forward: logits (B, C, V) float32 at positions
    L-C-1 .. L-2 (each predicts the next completion token), divided by ``temperature`` as TRL divides them, and the
    completion tokens' log-probs (B, C) from their ``log_softmax``."""
    length, c = batch.input_ids.shape[1], batch.logits_to_keep
    if c < 1:
        raise ValueError("the batch has no completion token to score")
    logits = model(**batch.model_inputs(), use_cache=False).logits[:, length - c - 1: length - 1].float()
    logits = logits / temperature
    logps = logits.log_softmax(-1).gather(-1, batch.completion_ids[..., None].to(logits.device))[..., 0]
    return logits, logps


def _completions(completion_ids, completion_mask, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C) ids and mask from token lists (right-padded here) or from a tensor (mask: given, else all ones)."""
    if torch.is_tensor(completion_ids):
        mask = completion_mask if completion_mask is not None else torch.ones_like(completion_ids)
        return completion_ids, mask.long()
    return pad_rows(completion_ids, pad, "right")


# ---------------------------------------------------------------------------------------------------------------
# The reference on explicit tensors
# ---------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def _signals(model, processor, prompts, images, completion_ids, kinds: Sequence[str], *, completion_mask=None,
             choices=None, answer_pattern=DEFAULT_ANSWER_PATTERN, seed: int = 0, step: int = 0, row_offset: int = 0,
             rows: Sequence[int] | None = None, attention: bool = True, token_segment: str = "late",
             segments: str | dict | None = "thirds", temperature: float = 1.0,
             perturbation: dict | None = None) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The real-image tensors (shared by every kind) and, per kind, the counterfactual ones (see reference_signals)."""
    from ..attention import measure_modality_attention

    tok = getattr(processor, "tokenizer", processor)
    pad = _pad_id(model, tok)
    images = [_image_list(imgs) for imgs in images]
    prompts = _inserted(prompts, images)
    ids, mask = _completions(completion_ids, completion_mask, pad)
    b = ids.shape[0]
    if not len(prompts) == len(images) == b:
        raise ValueError(f"{len(prompts)} prompts, {len(images)} image rows and {b} completions: give one of each "
                         "per rollout")
    rows = list(range(row_offset, row_offset + b)) if rows is None else list(rows)
    if len(rows) != b:
        raise ValueError(f"rows has {len(rows)} entries for {b} rollouts")
    choices = list(choices) if choices is not None else [None] * b
    has_image = torch.tensor([len(imgs) > 0 for imgs in images], dtype=torch.bool)

    batch = _layout(model, processor, prompts, ids, mask, pad)
    _, logps = completion_logits(model, batch, temperature)
    c_mask = batch.completion_mask[:, -batch.logits_to_keep:]
    answers = answer_tokens(tok, batch.completion_ids.cpu(), c_mask.cpu(), choices, answer_pattern)
    real = {"logps": logps.cpu(), "completion_mask": c_mask.cpu(), "has_image": has_image,
            "answer_index": answers.answer_index, "letter_position": answers.letter_position}
    attention_signal = None
    if attention:
        result = measure_modality_attention(model, **batch.probe_inputs(), token_segment=token_segment,
                                            segments=segments)
        attention_signal = result.attention_signal(batch.logits_to_keep).cpu()
        for name, values in _mdi_columns(result.rows(segments)).items():
            real[name] = values

    per_kind = {}
    for kind in kinds:
        cf_prompts = _counterfactual(prompts, images, kind, seed=seed, step=step, rows=rows,
                                     perturbation=perturbation or {})
        cf_batch = _layout(model, processor, cf_prompts, ids, mask, pad)
        # The choice letters' logits as the trainer reads them (one function, ``choice_logits``): the backbone's
        # hidden state where the answer letter was chosen, through the LM head's rows of the letters. The log-probs
        # stay those of the plain forward's full logits: the independent reference for the trainer's.
        with hidden_states_at(unwrap_model(model).base_model, answers.letter_position,
                              cf_batch.logits_to_keep) as hidden:
            _, cf_logps = completion_logits(model, cf_batch, temperature)
        cf_choice = choice_logits(model, hidden.result(), answers.candidates).cpu()
        policy = PolicyForward(logps=logps.cpu(), perception={} if attention_signal is None
                               else {"attention": attention_signal})
        signals = counterfactual_signals(CounterfactualInputs.of(policy, CounterfactualForward(cf_logps.cpu(), cf_choice,
                                                                                               answers),
                                                                 c_mask.cpu(), has_image))
        per_kind[kind] = {**signals, "cf_logps": cf_logps.cpu(), "cf_choice_logits": cf_choice}
    return real, per_kind


def _mdi_columns(rows: list[dict]) -> dict[str, torch.Tensor]:
    """``mdi`` and ``mdi_<segment>`` (not the balance) of the probe's rows as (B,) float tensors, None -> NaN."""
    names = [n for n in (rows[0] if rows else {}) if n.startswith("mdi") and n != "mdi_balance"]
    return {n: torch.tensor([math.nan if r[n] is None else float(r[n]) for r in rows]) for n in names}


def reference_signals(model, processor, prompts: Sequence[list[dict]], images: Sequence[Sequence[Any]],
                      completion_ids: torch.Tensor | Sequence[Sequence[int]], kind: str = "black", *,
                      completion_mask: torch.Tensor | None = None,
                      choices: Sequence[Sequence[str] | None] | None = None,
                      answer_pattern=DEFAULT_ANSWER_PATTERN, seed: int = 0, step: int = 0, row_offset: int = 0,
                      rows: Sequence[int] | None = None, attention: bool = True, token_segment: str = "late",
                      segments: str | dict | None = "thirds", temperature: float = 1.0,
                      **perturbation) -> dict[str, torch.Tensor]:
    """The per-rollout reliance signals of given completions (no generation), from plain no-grad forwards.

    Args:
        prompts: chat messages per rollout, with or without their images inserted (TRL's ``prompt`` column, or the
            prompts GRPOTrainer holds after inserting the images).
        images: per rollout, a list of PIL images (one image or None also do; [] or None for a text-only rollout,
            whose signals are NaN).
        completion_ids: (B, C) tensor with ``completion_mask`` (B, C) (TRL's, 1 up to the first EOS; default all
            ones), or B token lists (right-padded here).
        kind: a counterfactual kind (``trl_mdi.counterfactual.counterfactual_kinds()``).
        choices: per rollout the choice texts (multiple choice: the answer is the ``letter`` group of
            ``answer_pattern`` on the last line) or None.
        seed, step, row_offset, perturbation: as the trainer passes them to ``counterfactual_prompts`` (its
            counterfactual seed, global step, ``process_index * rows``, and the perturbation's ``patch_size``,
            ``prob``, ``noise_std``, ``blur_radius``): rollout i's image is perturbed as row ``row_offset + i``, or as
            row ``rows[i]`` when ``rows`` is given. ``"none"`` draws nothing.
        attention: also run the attention probe (``answer_image_attention``, ``mdi``, ``mdi_<segment>``); False for
            models the probe cannot measure.
        temperature: logits are divided by it before ``log_softmax``, as TRL does (its ``temperature``).

    Returns (all on CPU): ``visual_gain``, ``answer_visual_gain``, ``blind_agrees`` and, with ``attention``,
    ``answer_image_attention``, ``mdi``, ``mdi_<segment>`` ((B,) float, NaN where undefined); ``logps`` and
    ``cf_logps`` (B, C) (the completion tokens' log-probs with the real and the counterfactual images; meaningless
    where ``completion_mask`` is 0), ``completion_mask`` (B, C), ``has_image`` (B,) bool, ``answer_index`` and
    ``letter_position`` (B,) long (-1: no answer), ``cf_choice_logits`` (B, K) (the LM head's raw logits of the choice
    letters with the counterfactual image, before ``temperature``: ``trl_mdi.attention.model_parts.choice_logits``).
    Every counterfactual entry of the signal table is among the signals (``trl_mdi.signals.reliance_names``).
    """
    real, per_kind = _signals(model, processor, prompts, images, completion_ids, [kind],
                              completion_mask=completion_mask, choices=choices, answer_pattern=answer_pattern,
                              seed=seed, step=step, row_offset=row_offset, rows=rows, attention=attention,
                              token_segment=token_segment, segments=segments, temperature=temperature,
                              perturbation=perturbation)
    return {**per_kind[kind], **real}


def check_counterfactuals(processor, prompt: list[dict], images: Sequence[Any], kinds: Sequence[str],
                          seed: int = 0) -> None:
    """Encode one row's counterfactual prompt of every kind (no weights needed): ValueError naming the kind when the
    processor cannot (``trl_mdi.batch.check_counterfactual_encodes``, as the trainer checks at
    construction), or when a kind is unknown."""
    known = counterfactual_kinds()
    for kind in kinds:
        if kind not in known:
            raise ValueError(f"unknown counterfactual kind {kind!r}; choose from {', '.join(known)}")
        check_counterfactual_encodes(processor, kind, prompt=prompt, images=list(images), seed=seed)


# ---------------------------------------------------------------------------------------------------------------
# Rollouts of dataset rows: greedy and sampled completions, blind answers, and their signals
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RelianceMeasurement:
    """Every rollout's signals and every prompt's answers, for one model (``trl_mdi.profile.reliance_report``
    summarises them).

    ``prompts``: one dict per measured row: ``row`` (index in the dataset), ``has_image``, ``gold`` (letter or
    None), ``answer`` (rollout 0's letter), ``blind`` (kind -> the greedy answer with the counterfactual),
    ``conflict`` / ``prior`` (the data's own prior label, None without). ``rollouts``: one dict per rollout:
    ``prompt`` (index into ``prompts``), ``sample`` (0: greedy or the given completion; 1..: sampled),
    ``completion``, ``answer``, ``correct``, ``mdi*``, and per kind under ``signals[kind]`` every counterfactual
    signal of the table that was computed (``trl_mdi.signals.reliance_names``: ``visual_gain``,
    ``answer_visual_gain``, ``blind_agrees``, and ``answer_image_attention`` when the probe ran, the same under
    every kind), NaN where undefined.
    """

    kinds: list[str]
    prompts: list[dict]
    rollouts: list[dict]
    skipped: dict[int, str]
    samples: int
    seconds: float
    data_labels: bool  # the rows carry their own prior label (``conflict`` and ``prior_idx``)


def _letter(index, choices) -> str | None:
    if index is None or choices is None or isinstance(index, bool):
        return None
    if isinstance(index, float) and math.isnan(index):
        return None
    index = int(index)
    return LETTERS[index] if 0 <= index < min(len(choices), len(LETTERS)) else None


@torch.no_grad()
def generate_completions(model, processor, prompts: list[list[dict]], *, images: list[list] | None = None,
                         max_new_tokens: int, sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(completion_ids, completion_mask)`` of the prompts: greedy, or sampled at temperature 1 over the whole
    vocabulary (top_k 0, top_p 1, as GRPOConfig's defaults); image tokens suppressed, as GRPOTrainer generates.
    ``prompts`` are chat messages with their images inserted, or plain ones with ``images`` (one list per prompt,
    inserted as GRPOTrainer inserts them). The mask ends each completion at its first end token."""
    tok = getattr(processor, "tokenizer", processor)
    eos = eos_token_ids(model, tok)
    pad = _pad_id(model, tok)
    facts = model_facts(unwrap_model(model).config)
    prompt_ids, fields = encode_prompts(processor, prompts, images=images, facts=facts)
    prompt = policy_batch(prompt_ids, [[] for _ in prompts], pad_token_id=pad, multimodal=fields, device=model.device,
                          facts=facts)
    how = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else \
        dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    out = model.generate(**prompt.model_inputs(), max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=eos,
                         suppress_tokens=list(facts.image_token_ids), **how)
    completion = out[:, prompt.input_ids.shape[1]:].cpu()
    return completion, completion_mask_until_eos(completion, eos)


def _texts(tok, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    return [tok.decode(c[m.bool()], skip_special_tokens=True) for c, m in zip(ids, mask)]


def _answer(text: str, choices) -> str | None:
    from ..rewards import parse_mc_answer

    return parse_mc_answer(text, len(choices))[0] if choices else None


def _value(t: torch.Tensor, i: int) -> float:
    return float(t[i])


def measure_reliance(model, processor, dataset, kinds: Sequence[str] = ("black",), *, samples: int = 0,
                     max_new_tokens: int = 32, batch_size: int = 8, completion_column: str | None = None,
                     answer_pattern=DEFAULT_ANSWER_PATTERN, seed: int = 0, step: int = 0,
                     segments: str | dict | None = "thirds", token_segment: str = "late", attention: bool = True,
                     progress: bool = False, desc: str = "reliance", **perturbation) -> RelianceMeasurement:
    """Measure every row of ``dataset`` (prepared rows: ``prompt`` chat messages, ``image`` or ``images``, optional
    ``label_idx`` + ``choices``, optional ``conflict`` + ``prior_idx``): a datasets.Dataset or a list of dicts.

    Per row, rollout 0 is the greedy completion (or the ``completion_column`` text), then ``samples`` completions
    sampled at temperature 1 (torch seeded with ``seed`` first). Every rollout is scored under the real images and
    each counterfactual kind (:func:`reference_signals`; the counterfactual of row r is drawn as row r at ``step``,
    the same for all its rollouts), in chunks of ``batch_size`` rollouts; per kind, the row's blind answer is the
    greedy answer to its counterfactual prompt. A row whose image fails to decode is skipped (``skipped``).
    """
    from tqdm.auto import tqdm

    from ..data.images import ProcessorImageCheck, decode_row_images, row_images

    kinds = list(kinds)
    tok = getattr(processor, "tokenizer", processor)
    pad = _pad_id(model, tok)
    if samples:
        torch.manual_seed(seed)
    start = time.perf_counter()
    n = len(dataset)
    prompts_out, rollouts_out, skipped = [], [], {}
    data_labels = False
    check = ProcessorImageCheck(processor)
    for lo in tqdm(range(0, n, batch_size), desc=desc, unit="batch", disable=not progress):
        rows = [dict(dataset[i]) for i in range(lo, min(lo + batch_size, n))]
        errors = decode_row_images(rows, check=check)  # unreadable, or refused by the processor
        skipped.update({lo + i: e for i, e in errors.items()})
        keep = [i for i in range(len(rows)) if i not in errors]
        if not keep:
            continue
        rows, index = [rows[i] for i in keep], [lo + i for i in keep]
        images = [row_images(r) for r in rows]
        prompts = _inserted([r["prompt"] for r in rows], images)
        # Rollouts: (row position in this batch, sample number, ids, mask)
        if completion_column:
            given = [tok(r[completion_column] or "", add_special_tokens=False)["input_ids"] for r in rows]
            first = pad_rows(given, pad, "right")
        else:
            first = generate_completions(model, processor, prompts, max_new_tokens=max_new_tokens, sample=False)
        drawn = [first] + [generate_completions(model, processor, prompts, max_new_tokens=max_new_tokens, sample=True)
                           for _ in range(samples)]
        rollouts = [(j, k, ids[j], mask[j]) for k, (ids, mask) in enumerate(drawn) for j in range(len(rows))]
        rollouts.sort(key=lambda r: (r[0], r[1]))
        blind = {}
        for kind in kinds:
            cf = _counterfactual(prompts, images, kind, seed=seed, step=step, rows=index, perturbation=perturbation)
            ids, mask = generate_completions(model, processor, cf, max_new_tokens=max_new_tokens, sample=False)
            blind[kind] = [_answer(t, r.get("choices")) for t, r in zip(_texts(tok, ids, mask), rows)]
        base = len(prompts_out)
        for j, r in enumerate(rows):
            gold = _letter(r.get("label_idx"), r.get("choices"))
            has_prior = "conflict" in r and "prior_idx" in r
            data_labels |= has_prior
            prompts_out.append({"row": index[j], "has_image": bool(images[j]), "gold": gold, "answer": None,
                                "blind": {kind: blind[kind][j] for kind in kinds},
                                "conflict": bool(r["conflict"]) if has_prior and r["conflict"] is not None else None,
                                "prior": _letter(r.get("prior_idx"), r.get("choices")) if has_prior else None})
        for c0 in range(0, len(rollouts), batch_size):
            chunk = rollouts[c0:c0 + batch_size]
            # Each mask is a prefix of ones (up to the first EOS, or the given text): re-pad the chunk's own tokens
            ids, mask = pad_rows([i[: int(m.sum())] for _, _, i, m in chunk], pad, "right")
            if ids.shape[1] == 0:  # every completion empty: one masked pad token keeps the layout defined
                ids, mask = torch.full((len(chunk), 1), pad), torch.zeros((len(chunk), 1), dtype=torch.long)
            js = [j for j, _, _, _ in chunk]
            real, per_kind = _signals(
                model, processor, [prompts[j] for j in js], [images[j] for j in js], ids, kinds, completion_mask=mask,
                choices=[rows[j].get("choices") for j in js], answer_pattern=answer_pattern, seed=seed, step=step,
                rows=[index[j] for j in js], attention=attention, token_segment=token_segment, segments=segments,
                perturbation=perturbation)
            for i, (j, k, _, _) in enumerate(chunk):
                p = prompts_out[base + j]
                text = _texts(tok, ids[i:i + 1], mask[i:i + 1])[0]
                answer = _answer(text, rows[j].get("choices"))
                if k == 0:
                    p["answer"] = answer
                rollout = {"prompt": base + j, "sample": k, "completion": text, "answer": answer,
                           "correct": None if p["gold"] is None else answer == p["gold"]}
                rollout.update({name: _value(real[name], i) for name in real if name.startswith("mdi")})
                rollout["signals"] = {kind: {name: _value(s[name], i) for name in reliance_names() if name in s}
                                      for kind, s in per_kind.items()}
                rollouts_out.append(rollout)
    rollouts_out.sort(key=lambda r: (r["prompt"], r["sample"]))
    return RelianceMeasurement(kinds=kinds, prompts=prompts_out, rollouts=rollouts_out, skipped=skipped,
                               samples=samples, seconds=time.perf_counter() - start, data_labels=data_labels)
