"""Turning prepared rows into what GRPOTrainer consumes: conversational prompts plus an image column."""

from __future__ import annotations

from typing import Any

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Think inside <think>...</think>, then give the final line 'Answer: X'."
)
"""The system prompt of the training script: asks for a <think> block and a final 'Answer: X' line, which is
what think_format_reward and mc_idx_reward check."""


def to_conversational(example: dict[str, Any], system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
                      prompt_column: str = "prompt") -> dict[str, Any]:
    """Map a row with a text prompt to TRL's conversational form.

    TRL requires conversational prompts for multimodal training: it inserts the row's image into the first user
    message itself (``prepare_multimodal_messages``), so the image stays in its own ``image`` column.

    >>> to_conversational({"prompt": "Q?"}, "Be brief.")["prompt"]
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Q?'}]
    """
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": example[prompt_column]})
    return {"prompt": messages}
