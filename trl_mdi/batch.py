"""One builder for every policy batch the project lays out itself: prompt + completion, as GRPOTrainer lays it out.

The trainer's extra no-grad forwards (the probe's, the perturbed image's), the profile command, the held-out
evaluation and the tests all feed the policy ``prompt + completion`` sequences. TRL 1.16 builds its own log-prob
forward in ``_generate_and_score_completions``: prompts left-padded, completions right-padded, per-token
multimodal fields (``token_type_ids``, ``mm_token_type_ids``) extended with zeros over the completion, every other
multimodal field passed through. This module is that layout, once:

- :func:`encode_prompts` renders and encodes conversational prompts the way TRL's ``_tokenize_prompts`` does
  (same return shape), for callers that have no TRL encoding to reuse;
- :func:`image_fields_for_model` gives the processor's image fields the layout and dtype the model's forward takes
  (Llama 4: per-image tile stacks concatenated, bfloat16 pixels cast to the model's dtype);
- :func:`multimodal_tensors` turns the processor's multimodal fields into tensors by TRL's generation rule;
- :func:`policy_batch` pads and concatenates: the one place the layout is decided;
- :func:`check_counterfactual_encodes` tries, before any batch runs, that the processor encodes a counterfactual
  prompt (``trl_mdi.counterfactual.counterfactual_prompts``).

Keys come from one table, :data:`MULTIMODAL_KEYS`; end of sequence from the generation config's list
(:func:`eos_token_ids`); image token ids from the model facts (``trl_mdi.attention.model_facts``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .attention.model_facts import TILE_STACK_FIELDS, ModelFacts, processor_for_trl
from .counterfactual import NO_IMAGE, counterfactual_prompts

# Multimodal keys of a processor's output that TRL's log-prob forward takes (its keyword arguments), by kind:
# "token" fields hold one value per prompt token (padded like the prompt, extended with zeros over the
# completion); "image" fields are per image or patch and pass through unchanged.
MULTIMODAL_KEYS: dict[str, str] = {
    "token_type_ids": "token",
    "mm_token_type_ids": "token",
    "pixel_values": "image",
    "image_grid_thw": "image",
    "pixel_attention_mask": "image",
    "spatial_shapes": "image",
    "image_sizes": "image",
    "image_position_ids": "image",
}


@dataclass(frozen=True)
class PolicyBatch:
    """Prompt + completion laid out as TRL lays out its log-prob forward.

    ``input_ids`` / ``attention_mask`` are (B, P + C), prompts left-padded and completions right-padded;
    ``completion_mask`` is (B, P + C) with ones on the completion tokens only (what the probe measures);
    ``logits_to_keep`` is C; ``multimodal`` holds the forward's multimodal tensors (per-token ones already (B, P + C)).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    logits_to_keep: int
    multimodal: dict[str, torch.Tensor] = field(default_factory=dict)
    num_images: list[int] | None = None
    num_tiles: list[int] | None = None  # per row, where pixel_values hold tiles, not images (``tile_counts``)

    @property
    def completion_ids(self) -> torch.Tensor:
        """(B, C) completion tokens (padding included)."""
        return self.input_ids[:, self.input_ids.shape[1] - self.logits_to_keep:]

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of a plain model forward (``model(**batch.model_inputs())``)."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, **self.multimodal}

    def probe_inputs(self) -> dict[str, Any]:
        """Keyword arguments of ``trl_mdi.measure_modality_attention`` (model first)."""
        return {**self.model_inputs(), "completion_mask": self.completion_mask}

    def logp_inputs(self) -> dict[str, Any]:
        """Keyword arguments of TRL's ``_get_per_token_logps_and_entropies`` after ``model``."""
        return {**self.model_inputs(), "logits_to_keep": self.logits_to_keep, "num_images": self.num_images,
                "num_tiles": self.num_tiles}


def pad_rows(rows: Sequence[Sequence[int]] | Sequence[torch.Tensor], value: int, side: str,
             pad_to_multiple_of: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows padded to one width: (ids, mask), ``side`` "left" (prompts) or "right" (completions).

    >>> ids, mask = pad_rows([[5, 6], [7]], 0, "left")
    >>> ids.tolist(), mask.tolist()
    ([[5, 6], [0, 7]], [[1, 1], [0, 1]])
    >>> pad_rows([[5], [7, 8, 9]], 0, "right", pad_to_multiple_of=4)[0].tolist()
    [[5, 0, 0, 0], [7, 8, 9, 0]]
    """
    tensors = [torch.as_tensor(list(r) if not torch.is_tensor(r) else r, dtype=torch.long) for r in rows]
    width = max([len(t) for t in tensors] + [0])
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    ids = torch.full((len(tensors), width), value, dtype=torch.long)
    mask = torch.zeros((len(tensors), width), dtype=torch.long)
    for i, t in enumerate(tensors):
        span = slice(width - len(t), width) if side == "left" else slice(0, len(t))
        ids[i, span] = t
        mask[i, span] = 1
    return ids, mask


def multimodal_tensors(fields: dict[str, Any], pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """The processor's multimodal fields as tensors, by the rule TRL 1.16 applies before ``generate``: tensors pass,
    per-token fields (lists of lists) are left-padded with 0 like the prompt, anything else goes through numpy.
    Keys outside :data:`MULTIMODAL_KEYS` are dropped (TRL's log-prob forward would not take them)."""
    import numpy as np

    out = {}
    for key, value in fields.items():
        if key not in MULTIMODAL_KEYS or value is None:
            continue
        if torch.is_tensor(value):
            out[key] = value
        elif MULTIMODAL_KEYS[key] == "token":
            out[key] = pad_rows(value, 0, "left", pad_to_multiple_of)[0]
        else:
            out[key] = torch.tensor(np.array(value))
    return out


def completion_token_types(token_type_ids: torch.Tensor | None, completion_length: int,
                           value: int) -> torch.Tensor | None:
    """``token_type_ids`` (B, P + C) with the completion's columns, the last C, set to ``value``: the type generation
    gives each new token (``ModelFacts.completion_token_type``; PaliGemma: 1, its causal suffix) where TRL 1.16
    extends the prompt's types with zeros. Unchanged (the same object) for ``value`` 0 or no ``token_type_ids``.

    >>> completion_token_types(torch.tensor([[0, 0, 0, 0]]), 2, 1).tolist()
    [[0, 0, 1, 1]]
    """
    if token_type_ids is None or value == 0:
        return token_type_ids
    fixed = token_type_ids.clone()
    fixed[:, fixed.shape[1] - completion_length:] = value
    return fixed


def policy_batch(prompt_ids: Sequence[Sequence[int]] | torch.Tensor, completion_ids: Sequence[Sequence[int]] | torch.Tensor,
                 *, pad_token_id: int, multimodal: dict[str, Any] | None = None,
                 prompt_mask: torch.Tensor | None = None, completion_mask: torch.Tensor | None = None,
                 num_images: list[int] | None = None, pad_to_multiple_of: int | None = None,
                 device: torch.device | str | None = None, facts: ModelFacts | None = None) -> PolicyBatch:
    """Lay out prompt + completion as TRL's log-prob forward does.

    Prompts and completions come as token lists (padded here: prompts left, completions right, with
    ``pad_to_multiple_of`` as TRL pads) or as padded tensors with their masks. Every completion token is kept,
    truncated completions included (TRL masks those out of the loss only). Per-token multimodal fields are
    left-padded to the prompt's width and extended with zeros over the completion; ``token_type_ids``, given the
    model's ``facts``, with its ``completion_token_type`` (PaliGemma's 1), as the trainer hands them to TRL's forward.
    """
    if torch.is_tensor(prompt_ids):
        p_ids = prompt_ids
        p_mask = prompt_mask if prompt_mask is not None else torch.ones_like(prompt_ids)
    else:
        p_ids, p_mask = pad_rows(prompt_ids, pad_token_id, "left", pad_to_multiple_of)
    if torch.is_tensor(completion_ids):
        c_ids = completion_ids
        c_mask = completion_mask if completion_mask is not None else torch.ones_like(completion_ids)
    else:
        c_ids, c_mask = pad_rows(completion_ids, pad_token_id, "right", pad_to_multiple_of)
    device = device if device is not None else p_ids.device
    p_ids, p_mask, c_ids, c_mask = (t.to(device) for t in (p_ids, p_mask, c_ids, c_mask))
    mm = {}
    for key, value in multimodal_tensors(multimodal or {}, pad_to_multiple_of).items():
        value = value.to(device)
        if MULTIMODAL_KEYS[key] == "token":
            if value.shape[1] < p_ids.shape[1]:  # prompts padded to a multiple: pad the types alike, on the left
                value = torch.nn.functional.pad(value, (p_ids.shape[1] - value.shape[1], 0))
            value = torch.cat([value, value.new_zeros(c_ids.shape)], dim=1)
            if key == "token_type_ids":
                value = completion_token_types(value, c_ids.shape[1], facts.completion_token_type if facts else 0)
        mm[key] = value
    return PolicyBatch(
        input_ids=torch.cat([p_ids, c_ids], dim=1),
        attention_mask=torch.cat([p_mask, c_mask.to(p_mask.dtype)], dim=1),
        completion_mask=torch.cat([torch.zeros_like(p_mask), c_mask.to(p_mask.dtype)], dim=1),
        logits_to_keep=c_ids.shape[1],
        multimodal=mm,
        num_images=num_images,
    )


def merge_prompt_encodings(parts: Sequence[tuple[list, list | None, dict]]) -> tuple[list, list | None, dict]:
    """TRL 1.16's ``_tokenize_prompts`` output ``(prompt_ids, images, multimodal_fields)`` for a batch, from its outputs
    for the batch's prompts one at a time (``parts``), merged the way TRL merges the per-prompt encodings of its
    environment path: ids and image lists row after row (``images`` None when no prompt has one), tensors
    concatenated, per-prompt lists joined.

    >>> a = ([[1, 2]], [["img"]], {"token_type_ids": [[0, 0]], "pixel_values": torch.zeros(1, 3)})
    >>> b = ([[3]], None, {"token_type_ids": [[0]], "pixel_values": torch.zeros(0, 3)})
    >>> ids, images, fields = merge_prompt_encodings([a, b])
    >>> ids, images, fields["token_type_ids"], tuple(fields["pixel_values"].shape)
    ([[1, 2], [3]], [['img'], None], [[0, 0], [0]], (1, 3))
    """
    ids = [row for part_ids, _, _ in parts for row in part_ids]
    images = [imgs[0] if imgs is not None else None for _, imgs, _ in parts]
    fields: dict[str, list] = {}
    for _, _, part_fields in parts:
        for key, value in part_fields.items():
            fields.setdefault(key, []).append(value)
    merged = {k: torch.cat(v) if torch.is_tensor(v[0]) else [row for part in v for row in part]
              for k, v in fields.items()}
    return ids, images if any(i is not None for i in images) else None, merged


def tile_counts(processing_class, images: list[list] | None, multimodal: dict[str, Any]) -> list[int] | None:
    """Tiles per row where the processor's ``pixel_values`` hold tiles rather than images, counted as TRL 1.16's
    ``_generate_and_score_completions`` counts them for its log-prob forward (``num_tiles``); without them TRL's
    chunked forward slices the tiles as if they were images (LFM2-VL: TRL's forward stops on the missing count).

    - LFM2-VL (``spatial_shapes`` among the fields): each image is one view, or ``rows x cols`` tiles plus a thumbnail
      (when the image processor's ``use_thumbnail`` is on), from the image processor's ``return_row_col_info``.
    - InternVL (4-D ``pixel_values`` with more entries than images): up to ``max_patches`` tiles and a thumbnail per
      image, the image processor run again with ``crop_to_patches=True``.

    None for every other layout (one ``pixel_values`` entry per image or per row)."""
    pixels = multimodal.get("pixel_values")
    num_images = [len(i) if i else 0 for i in images or []]
    if not any(num_images) or not torch.is_tensor(pixels):
        return None
    if "spatial_shapes" in multimodal:
        image_processor = processing_class.image_processor
        info = image_processor(images=images, return_tensors="pt", return_row_col_info=True)
        tiles = torch.as_tensor(info["image_rows"]) * torch.as_tensor(info["image_cols"])
        if image_processor.use_thumbnail:
            tiles = tiles + (tiles > 1).to(tiles.dtype)
        return [int(group.sum()) for group in torch.split(tiles, num_images)]
    if pixels.ndim != 4 or pixels.shape[0] == sum(num_images):
        return None
    patches = processing_class.image_processor(images=images, crop_to_patches=True, return_tensors="pt")["num_patches"]
    return [int(group.sum()) for group in torch.split(torch.as_tensor(patches), num_images)]


PIXEL_KEYS = ("pixel_values", "pixel_values_videos")
"""The image fields holding pixels, cast to the model's dtype by :func:`image_fields_for_model`."""


def image_fields_for_model(fields: dict[str, Any], processing_class,
                           dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The multimodal ``fields`` of ``processing_class`` as the model's forward takes them; every other field is kept.

    - The fields ``TILE_STACK_FIELDS`` names for the processor's class (Llama 4's ``pixel_values``: a list with one
      ``(tiles, C, H, W)`` stack per image when the processor is called without ``return_tensors``, as TRL 1.16 calls
      it) are concatenated into one tensor, what the processor returns with ``return_tensors="pt"``. TRL's generation
      rule would stack the list into a 5-D tensor (``np.array``), which the vision tower rejects.
    - Floating pixel tensors (``PIXEL_KEYS``) are cast to ``dtype`` (the model's) when given: Llama 4's image
      processor normalises in bfloat16 whatever the model's dtype, and its vision tower does not cast its input, so a
      float32 model stops on "expected m1 and m2 to have the same dtype" (under stock TRL too).

    >>> class Llama4Processor: ...
    >>> fields = {"pixel_values": [torch.zeros(1, 3, 2, 2, dtype=torch.bfloat16)] * 2, "token_type_ids": [[0, 1]]}
    >>> out = image_fields_for_model(fields, Llama4Processor(), torch.float32)
    >>> tuple(out["pixel_values"].shape), out["pixel_values"].dtype, out["token_type_ids"]
    ((2, 3, 2, 2), torch.float32, [[0, 1]])
    """
    out = dict(fields)
    for key in TILE_STACK_FIELDS.get(type(processing_class).__name__, ()):
        value = out.get(key)
        if isinstance(value, (list, tuple)) and value and all(torch.is_tensor(v) for v in value):
            out[key] = torch.cat(list(value))
    for key in PIXEL_KEYS:
        value = out.get(key)
        if dtype is not None and torch.is_tensor(value) and value.is_floating_point() and value.dtype != dtype:
            out[key] = value.to(dtype)
    return out


def encode_prompts(processing_class, prompts: list, images: list[list] | None = None,
                   chat_template_kwargs: dict | None = None, chat_template: str | None = None,
                   facts: ModelFacts | None = None, dtype: torch.dtype | None = None):
    """``(prompt_ids, multimodal_fields)`` of conversational prompts, as TRL 1.16's ``_tokenize_prompts`` returns them
    (as the trainer's override does: a processor's ``labels`` left out, the image fields laid out and cast to
    ``dtype``, the model's, by :func:`image_fields_for_model`).

    ``prompts`` are chat messages; ``images`` (one list per row) are inserted into each first user turn the way
    GRPOTrainer inserts them (``prepare_multimodal_messages``). The chat template adds the generation prompt. Given
    the model's ``facts``, a family whose processor cannot encode an unpadded batch (``unpadded_batch_problem``:
    PaliGemma) is encoded one prompt at a time and merged (:func:`merge_prompt_encodings`), as the trainer encodes it.
    """
    from trl.data_utils import prepare_multimodal_messages

    processing_class = processor_for_trl(processing_class)  # as the trainer hands it to TRL
    if images is not None:
        prompts = [prepare_multimodal_messages(p, images=list(imgs or [])) for p, imgs in zip(prompts, images)]
    else:
        prompts = [prepare_multimodal_messages(p) for p in prompts]

    def encode(batch: list) -> tuple[list, None, dict]:
        tokenized = processing_class.apply_chat_template(conversation=batch, chat_template=chat_template,
                                                         add_generation_prompt=True, tokenize=True, return_dict=True,
                                                         **(chat_template_kwargs or {}))
        return tokenized["input_ids"], None, {k: v for k, v in tokenized.items()
                                              if k not in ("input_ids", "attention_mask", "labels")}

    if facts is not None and facts.unpadded_batch_problem and len(prompts) > 1:
        ids, _, fields = merge_prompt_encodings([encode([p]) for p in prompts])
    else:
        ids, _, fields = encode(prompts)
    return ids, image_fields_for_model(fields, processing_class, dtype)


def eos_token_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids as generation uses them: the generation config's (a list for chat models), else the
    tokenizer's."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    eos = tokenizer.eos_token_id if eos is None else eos
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]


def completion_mask_until_eos(completion_ids: torch.Tensor, eos_ids: Sequence[int]) -> torch.Tensor:
    """1 on each completion's tokens up to and including its first end-of-sequence token (as GRPOTrainer masks).

    >>> completion_mask_until_eos(torch.tensor([[5, 2, 0], [5, 6, 7]]), [2]).tolist()
    [[1, 1, 0], [1, 1, 1]]
    """
    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_ids), device=completion_ids.device))
    pos = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    first = torch.where(is_eos, pos, completion_ids.shape[1]).amin(dim=1, keepdim=True)
    return (pos <= first).long()


@contextlib.contextmanager
def rng_untouched(device: torch.device):
    """Fork the CPU RNG (and the device's, on an accelerator) so a forward inside consumes no random numbers."""
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            yield
        return
    index = device.index if device.index is not None else getattr(torch, device.type).current_device()
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        yield


def check_counterfactual_encodes(processing_class, kind: str, chat_template_kwargs: dict | None = None,
                                 chat_template: str | None = None, *, prompt: list[dict] | None = None,
                                 images: list | None = None, seed: int = 0) -> None:
    """ValueError naming the kind and the fix when the processor cannot encode a prompt with the counterfactual
    image of ``kind`` (before any batch runs: a run must not stop at its first batch). ``prompt``/``images``: a row
    to try (its images are inserted as GRPOTrainer inserts them); default a one-image colour question. ``"none"``
    is a text-only prompt, which some templates and processors refuse."""
    from PIL import Image
    from trl.data_utils import prepare_multimodal_messages

    if images is None:
        images = [Image.new("RGB", (56, 56), (200, 30, 30))]
    if prompt is None:
        prompt = [{"role": "user", "content": "Colour?"}]
    try:
        inserted = prepare_multimodal_messages(prompt, images=list(images))
        (cf,) = counterfactual_prompts([inserted], [list(images)], kind, seed=seed, step=0)
        encode_prompts(processing_class, [cf], chat_template_kwargs=chat_template_kwargs, chat_template=chat_template)
    except Exception as e:  # any processor or template error: the message is what the user needs
        alternative = "black" if kind == NO_IMAGE else NO_IMAGE
        raise ValueError(f"counterfactual_image={kind!r}: the processor ({type(processing_class).__name__}) cannot "
                         f"encode the counterfactual {kind!r} prompt ({type(e).__name__}: {e}); choose another kind, "
                         f"e.g. {alternative!r}") from e
