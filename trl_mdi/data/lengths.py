"""How many tokens a prepared row's prompt takes, and the check that every prompt leaves the completion room in the
model's positions (``check_prompt_lengths``), at data load: a prompt longer than the model's positions otherwise passes
every check, then the run shows no progress for minutes while it generates past what the model was built for.

The count, per row, is the length of the prompt ids TRL's encoding gives (``processor.apply_chat_template`` with
``tokenize=True``), worked out without processing a single image of the data (:class:`PromptTokens`):

- the chat template of the row's prompt with its images inserted as TRL inserts them
  (``trl.data_utils.prepare_multimodal_messages``), tokenized as the processor tokenizes it (special tokens added
  unless the text starts with the BOS token);
- plus, per image, the tokens the processor adds for an image of its size: its own count of the image's tokens
  (``trl_mdi.data.images.ProcessorImageCheck.image_tokens``), offset by the markers it adds around them (measured once,
  on one blank image); a processor without a count is run on a blank image of each size (cached per size).

Image sizes are read from the image headers; no image of the data is decoded.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from .columns import DatasetError


def model_positions(config) -> int | None:
    """The text model's ``max_position_embeddings`` (None where the config has none)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None) or getattr(config, "max_position_embeddings", None)
    return int(value) if value else None


def image_sizes(ds, image_column: str) -> list[list[tuple[int, int]]]:
    """Each row's image sizes ``(width, height)``, read from the stored image headers (no pixel is decoded)."""
    from datasets import Image, List
    from PIL import Image as PILImage

    feature = ds.features[image_column]
    if isinstance(feature, Image):
        ds = ds.cast_column(image_column, Image(decode=False))
    elif isinstance(feature, List) and isinstance(feature.feature, Image):
        ds = ds.cast_column(image_column, List(Image(decode=False)))
    out = []
    for batch in ds.select_columns([image_column]).iter(batch_size=256):  # a batch of image bytes in memory at a time
        for cell in batch[image_column]:
            cells = cell if isinstance(cell, list) else [] if cell is None else [cell]
            sizes = []
            for c in cells:
                source = io.BytesIO(c["bytes"]) if c.get("bytes") else c.get("path")
                with PILImage.open(source) as img:
                    sizes.append(img.size)
            out.append(sizes)
    return out


class PromptTokens:
    """The token counts of :mod:`trl_mdi.data.lengths` for one processor (see the module docstring)."""

    CALIBRATION_SIZE = (64, 64)

    def __init__(self, processor, image_check):
        self.processor, self.image_check = processor, image_check
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self._added: dict[tuple[int, int], int] = {}
        self._offset: int | None = None

    def text(self, texts: list[str]) -> list[int]:
        """Tokens of chat-templated texts as the processor's ``apply_chat_template`` tokenizes them."""
        bos = getattr(self.tokenizer, "bos_token", None)
        plain = self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        special = len(self.tokenizer("", add_special_tokens=True, verbose=False)["input_ids"])
        return [len(ids) + (0 if bos and t.startswith(bos) else special) for t, ids in zip(texts, plain)]

    def added(self, size: tuple[int, int]) -> int:
        """Tokens the processor adds to the templated text for one image of ``size`` (width, height)."""
        size = (int(size[0]), int(size[1]))
        if size not in self._added:
            tokens = self.image_check.image_tokens(size) if self.image_check is not None else None
            if tokens is not None:
                if self._offset is None:
                    calibration = self.image_check.image_tokens(self.CALIBRATION_SIZE)
                    self._offset = self._measured(self.CALIBRATION_SIZE) - (calibration or 0)
                self._added[size] = tokens + self._offset
            else:
                self._added[size] = self._measured(size)
        return self._added[size]

    def _measured(self, size: tuple[int, int]) -> int:
        """The processor's own answer, on a one-image prompt with a blank image of ``size``."""
        from PIL import Image

        conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
        text = self.processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        bos = getattr(self.tokenizer, "bos_token", None)
        encoded = self.processor(text=[text], images=[[Image.new("RGB", size)]],
                                 add_special_tokens=not (bos and text.startswith(bos)))
        return len(encoded["input_ids"][0]) - self.text([text])[0]


def prompt_lengths(prompts: Sequence[Any], sizes: Sequence[Sequence[tuple[int, int]]], processor, image_check,
                   batch_size: int = 256) -> list[int]:
    """Tokens of each prompt (conversational messages) with its images of ``sizes``, as TRL's prompt encoding counts
    them (see the module docstring)."""
    from PIL import Image
    from trl.data_utils import prepare_multimodal_messages

    blank = Image.new("RGB", (1, 1))  # the template renders a placeholder; it never reads the pixels
    count = PromptTokens(processor, image_check)
    lengths: list[int] = []
    for lo in range(0, len(prompts), batch_size):
        chunk = range(lo, min(lo + batch_size, len(prompts)))
        conversations = [prepare_multimodal_messages(list(prompts[i]), images=[blank] * len(sizes[i])) for i in chunk]
        texts = processor.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
        for i, n in zip(chunk, count.text(list(texts))):
            lengths.append(n + sum(count.added(size) for size in sizes[i]))
    return lengths


def check_prompt_lengths(splits: dict[str, Any], processor, config, max_completion_length: int | None, image_check,
                         image_column: str) -> None:
    """DatasetError naming the rows whose prompt (text and image tokens, ``prompt_lengths``) and
    ``max_completion_length`` do not fit the model's positions together (``model_positions``): refused at load, never
    cut (a cut question is another question). ``splits``: split name -> prepared dataset."""
    positions = model_positions(config)
    if not positions:
        return
    room = positions - (max_completion_length or 0)
    for name, ds in splits.items():
        if ds is None or "prompt" not in ds.column_names:
            continue
        lengths = prompt_lengths(list(ds.select_columns(["prompt"])["prompt"]), image_sizes(ds, image_column), processor,
                                 image_check)
        over = [i for i, n in enumerate(lengths) if n > room]
        if not over:
            continue
        ids = (ds.select_columns(["question_id"])[over[:5]]["question_id"] if "question_id" in ds.column_names
               else [None] * len(over[:5]))
        shown = ", ".join((f"question_id {q!r}" if q is not None else f"row {i}") + f" ({lengths[i]} tokens)"
                          for i, q in zip(over, ids))
        raise DatasetError(
            f"split {name!r}: {len(over)} prompt(s) too long for the model: {shown}{', ...' if len(over) > 5 else ''}; "
            f"a prompt (its text and image tokens) and --max_completion_length {max_completion_length} must fit the "
            f"model's {positions} positions together, which leaves a prompt {room} tokens. Drop or shorten these rows "
            "(or lower --max_completion_length, or --max_pixels for fewer image tokens)")
