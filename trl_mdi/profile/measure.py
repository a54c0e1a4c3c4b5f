"""One model over the profile's rows: batches rendered as GRPOTrainer renders prompts, completions generated greedily
(or taken from a column), and every row measured with the exact probe (``measure_modality_attention``).

A batch is laid out as the trainer lays out a generation batch: prompts left-padded, completions right-padded,
each completion ending at its first end-of-sequence token. The probe then runs one teacher-forced no-grad forward
over prompt + completion with its own SDPA path, whatever ``attn_implementation`` the model generated with.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from ..attention import ModalityAttention, image_token_ids, measure_modality_attention
from ..data import DatasetError
from ..data.images import decode_row_images, row_images


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

    from ..cli_args import ModelCheckError

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


def completion_mask_of(completion_ids: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """1 on each completion's tokens up to and including its first end-of-sequence token (as GRPOTrainer masks).

    >>> completion_mask_of(torch.tensor([[5, 2, 0], [5, 6, 7]]), [2]).tolist()
    [[1, 1, 0], [1, 1, 1]]
    """
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    pos = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    first = torch.where(is_eos, pos, completion_ids.shape[1]).amin(dim=1, keepdim=True)
    return (pos <= first).long()


def _eos_ids(model, tokenizer) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = tokenizer.eos_token_id if eos is None else eos
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]


def render_prompts(processor, rows: list[dict], device) -> dict[str, torch.Tensor]:
    """Prompts as GRPOTrainer renders them: the images inserted into the first user turn
    (``prepare_multimodal_messages``), the chat template with the generation prompt, left padding."""
    from trl.data_utils import prepare_multimodal_messages

    conversations = [prepare_multimodal_messages(r["prompt"], images=row_images(r)) for r in rows]
    inputs = processor.apply_chat_template(conversations, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt", processor_kwargs={"padding": True,
                                                                                 "padding_side": "left"})
    return inputs.to(device)


def _column_completions(tokenizer, texts: list[str], device) -> torch.Tensor:
    ids = [tokenizer(t or "", add_special_tokens=False)["input_ids"] for t in texts]
    width = max([len(i) for i in ids] + [1])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for r, row in enumerate(ids):
        out[r, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[r, : len(row)] = 1
    return out.to(device), mask.to(device)


@torch.no_grad()
def measure_batch(model, processor, rows: list[dict], *, max_new_tokens: int, query_phase: str = "completion",
                  completion_texts: list[str] | None = None) -> tuple[ModalityAttention, list[str], dict]:
    """Render, complete and measure one batch of rows (images decoded). Returns the probe's result, the decoded
    completions and the exact tensors measured (``input_ids``, ``attention_mask``, ``completion_mask`` and the
    processor's multimodal tensors), so a caller can check them against another implementation."""
    tok = getattr(processor, "tokenizer", processor)
    inputs = render_prompts(processor, rows, model.device)
    prompt_ids, prompt_mask = inputs["input_ids"], inputs["attention_mask"]
    if query_phase == "prompt":  # the prompt's queries never see a completion (causal): none is generated
        completion = prompt_ids[:, :0]
        c_mask = prompt_mask[:, :0]
    elif completion_texts is not None:
        completion, c_mask = _column_completions(tok, completion_texts, model.device)
    else:
        pad = tok.pad_token_id if tok.pad_token_id is not None else _eos_ids(model, tok)[0]
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             suppress_tokens=image_token_ids(model.config), pad_token_id=pad,
                             eos_token_id=_eos_ids(model, tok), temperature=None, top_p=None, top_k=None)
        completion = out[:, prompt_ids.shape[1]:]
        c_mask = completion_mask_of(completion, _eos_ids(model, tok))
    extra = {}
    for key, value in inputs.items():
        if key in ("input_ids", "attention_mask") or not isinstance(value, torch.Tensor):
            continue
        if key.endswith("token_type_ids"):  # per-token types cover the completion too (as TRL extends them)
            value = torch.cat([value, torch.zeros_like(completion)], dim=1)
        extra[key] = value
    batch = {"input_ids": torch.cat([prompt_ids, completion], dim=1),
             "attention_mask": torch.cat([prompt_mask, c_mask], dim=1),
             "completion_mask": torch.cat([torch.zeros_like(prompt_mask), c_mask], dim=1), **extra}
    result = measure_modality_attention(model, **batch, query_phase=query_phase)
    texts = [tok.decode(c[m.bool()], skip_special_tokens=True) for c, m in zip(completion, c_mask)]
    return result, texts, batch


def measure_rows(model, processor, dataset, *, batch_size: int = 8, max_new_tokens: int = 32,
                 query_phase: str = "completion", completion_column: str | None = None, progress: bool = True,
                 desc: str = "profile") -> MeasuredRows:
    """Every row of ``dataset`` (prepared rows with ``prompt`` and ``image``/``images``), in batches, with a progress
    bar over batches. A row whose image does not decode is skipped and recorded in ``skipped``."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    parts, kept, texts, skipped = [], [], [], {}
    n = dataset.num_rows
    for lo in tqdm(range(0, n, batch_size), desc=desc, unit="batch", disable=not progress):
        rows = [dataset[i] for i in range(lo, min(lo + batch_size, n))]
        errors = decode_row_images(rows)
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
