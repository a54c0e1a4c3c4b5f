"""One model over the profile's rows: batches rendered as GRPOTrainer renders prompts, completions generated greedily
(or taken from a column), and every row measured with the exact probe (``measure_modality_attention``).

A batch is laid out by the trainer's batch builder (``trl_mdi.batch``), as a generation batch: prompts left-padded,
completions right-padded, each completion ending at its first end-of-sequence token. The probe then runs one teacher-forced no-grad forward
over prompt + completion with its own SDPA path, whatever ``attn_implementation`` the model generated with.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from ..attention import ModalityAttention, measure_modality_attention
from ..attention.model_facts import model_facts
from ..batch import completion_mask_until_eos, encode_prompts, eos_token_ids, pad_rows, policy_batch
from ..data import DatasetError
from ..data.images import ProcessorImageCheck, decode_row_images, row_images


@dataclasses.dataclass
class MeasuredRows:
    """The probe's result over every measured row, in row order, and what was generated."""

    attention: ModalityAttention
    rows: list[int]  # index of each measured row in the profiled dataset
    completions: list[str]  # decoded completion of each measured row ("" in the prompt phase)
    skipped: dict[int, str]  # row -> why it was skipped (an image that does not decode)
    seconds: float


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(name: str, *, dtype: str = "auto", attn_implementation: str | None = None, device: str = "auto",
               trust_remote_code: bool = False):
    """The VLM in eval mode on ``device``. ``attn_implementation`` is the model's own attention; the probe's
    measurement is exact under any (see ``trl_mdi.attention``). A model the flags cannot load (an attention
    implementation whose package is missing, a dtype the device lacks) is a ModelCheckError naming the flag."""
    from transformers import AutoModelForImageTextToText

    from ..cli.arguments import ModelCheckError

    kwargs: dict[str, Any] = {"dtype": dtype if dtype == "auto" else getattr(torch, dtype),
                              "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForImageTextToText.from_pretrained(name, **kwargs)
    except (ImportError, ValueError) as e:
        raise ModelCheckError(f"{name!r} cannot be loaded with --attn_implementation {attn_implementation} "
                              f"--dtype {dtype}: {e}") from None
    return model.to(resolve_device(device)).eval()


@torch.no_grad()
def measure_batch(model, processor, rows: list[dict], *, max_new_tokens: int, query_phase: str = "completion",
                  completion_texts: list[str] | None = None) -> tuple[ModalityAttention, list[str], dict]:
    """Render, complete and measure one batch of rows (images decoded). Returns the probe's result, the decoded
    completions and the exact tensors measured (``input_ids``, ``attention_mask``, ``completion_mask`` and the
    processor's multimodal tensors), so a caller can check them against another implementation.

    Prompts are encoded and laid out by the trainer's own batch builder (``trl_mdi.batch``): chat template with the
    generation prompt, images inserted as GRPOTrainer inserts them, left padding; completions right-padded, each
    ending at its first end-of-sequence token (the generation config's list)."""
    tok = getattr(processor, "tokenizer", processor)
    eos = eos_token_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    facts = model_facts(model.config)
    prompt_ids, fields = encode_prompts(processor, [r["prompt"] for r in rows], [row_images(r) for r in rows],
                                        facts=facts)
    prompt = policy_batch(prompt_ids, [[] for _ in rows], pad_token_id=pad, multimodal=fields, device=model.device,
                          facts=facts)
    if query_phase == "prompt":  # the prompt's queries never see a completion (causal): none is generated
        batch = prompt
    else:
        if completion_texts is not None:
            completion = [tok(t or "", add_special_tokens=False)["input_ids"] for t in completion_texts]
            completion, c_mask = pad_rows(completion, pad, "right")
        else:
            out = model.generate(**prompt.model_inputs(), max_new_tokens=max_new_tokens, do_sample=False,
                                 suppress_tokens=list(facts.image_token_ids), pad_token_id=pad,
                                 eos_token_id=eos, temperature=None, top_p=None, top_k=None)
            completion = out[:, prompt.input_ids.shape[1]:]
            c_mask = completion_mask_until_eos(completion, eos)
        batch = policy_batch(prompt.input_ids, completion, prompt_mask=prompt.attention_mask, completion_mask=c_mask,
                             pad_token_id=pad, multimodal=fields, device=model.device, facts=facts)
    result = measure_modality_attention(model, **batch.probe_inputs(), query_phase=query_phase)
    texts = [""] * len(rows)
    if batch.logits_to_keep:
        c_mask = batch.completion_mask[:, -batch.logits_to_keep:].bool()
        texts = [tok.decode(c[m], skip_special_tokens=True) for c, m in zip(batch.completion_ids, c_mask)]
    return result, texts, batch.probe_inputs()


def measure_rows(model, processor, dataset, *, batch_size: int = 8, max_new_tokens: int = 32,
                 query_phase: str = "completion", completion_column: str | None = None, progress: bool = True,
                 desc: str = "profile") -> MeasuredRows:
    """Every row of ``dataset`` (prepared rows with ``prompt`` and ``image``/``images``), in batches, with a progress
    bar over batches. A row whose image does not decode is skipped and recorded in ``skipped``."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    parts, kept, texts, skipped = [], [], [], {}
    n = dataset.num_rows
    check = ProcessorImageCheck(processor)
    for lo in tqdm(range(0, n, batch_size), desc=desc, unit="batch", disable=not progress):
        rows = [dataset[i] for i in range(lo, min(lo + batch_size, n))]
        errors = decode_row_images(rows, check=check)  # unreadable, or refused by the processor
        skipped.update({lo + i: e for i, e in errors.items()})
        keep = [i for i in range(len(rows)) if i not in errors]
        if not keep:
            continue
        batch = [rows[i] for i in keep]
        column = [r[completion_column] for r in batch] if completion_column else None
        result, completions, _ = measure_batch(model, processor, batch, max_new_tokens=max_new_tokens,
                                               query_phase=query_phase, completion_texts=column)
        parts.append(result)
        kept += [lo + i for i in keep]
        texts += completions
    if not parts:
        raise DatasetError(f"no row could be measured: every image failed to decode ({len(skipped)} rows)")
    return MeasuredRows(ModalityAttention.cat(parts), kept, texts, skipped, time.perf_counter() - start)
