"""The prompt token ids vLLM's colocated engine expects, from the ids the processor expanded (TRL 1.16, vLLM 0.31).

Why: TRL 1.16 tokenizes a VLM prompt with the processor (``GRPOTrainer._tokenize_prompts``), which expands each image
placeholder into the image's tokens (Qwen2.5-VL: ``<|image_pad|>`` -> one ``<|image_pad|>`` per merged patch), and
hands those ids with the images to vLLM in colocate mode (``{"prompt_token_ids": ids, "multi_modal_data": ...}``).
vLLM starts from what a tokenizer alone makes of the chat-templated text (one placeholder per image) and expands the
placeholders itself: given already-expanded ids it expands the first placeholder of the run again and keeps the rest
as text. On the tiny Qwen2.5-VL, 31 prompt tokens sent became 34 (7 image tokens for 4), and vLLM's sampling
log-probs differed from the policy's by up to 0.16 (huggingface/trl#6294, open; PR #6718 proposes re-rendering the
prompt with the tokenizer). TRL's own later forward scores its own expanded ids, so the rollouts were sampled from
one prompt and trained on as if from another.

The fix, for the families where it is exact: collapse each run of the image token to one token
(:func:`collapse_image_runs`), which gives the tokenizer-only rendering vLLM expects, whenever the processor's
expansion of one placeholder is a run of that one token and nothing else (:func:`collapse_problem` checks exactly
that on the loaded processor). It needs only the ids, so it also serves TRL's tool loop, which generates again from
prompt + completion + tool ids without any text. Exact (tests/test_vllm_prompts.py, on the tiny families' real
processors): Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, Qwen3.5-MoE, LLaVA-NeXT. Not exact: Gemma 3 and Gemma 4 (the
processor adds begin/end-of-image tokens and newlines around the run), SmolVLM / Idefics3 (a block of tile markers,
row tokens and one run per tile): for those :func:`check_vllm_prompts` refuses colocate mode at construction, since
the rollouts would come from a corrupted prompt. (vLLM 0.31's own multimodal processor expands the collapsed ids into
exactly the processor's ids for the six, and the tokenizer-only rendering into them for SmolVLM too: #6718's route,
which needs the prompts' text, would cover SmolVLM; tests_vllm/test_prompt_ids.py.)

A second thing TRL 1.16 leaves out in colocate mode: vLLM caches each image's encoder output (the vision tower's
features) by the image's content hash and reuses it for any later request with the same image, across weight syncs
(``LLMEngine.reset_encoder_cache``: "should be called when model weights are updated"; TRL resets only the prefix
cache). With a trained vision tower, an image seen again after an update (a second epoch, a repeated image) is then
generated from with the old tower's features: on the tiny Qwen2.5-VL the second batch's image rows differed from
the policy by up to 0.19 in log-prob, and by under 1e-6 with the cache reset before each sync
(:func:`drop_stale_image_features`).

Server mode is left as TRL makes it: there TRL has the server compute the image features separately and places them
on the runs of image tokens in its own expanded ids (``VLLMGeneration._place_features``), so the ids must stay
expanded; tests_vllm/test_server.py shows the server then generates from exactly the scored prompt (Qwen2.5-VL,
Idefics3), and ``trl_mdi.vllm_server`` refuses the families whose images are several runs. Whether the server's
encoder cache goes stale across weight syncs is untested (the sync needs a CUDA GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

from PIL import Image

from .attention.model_facts import processor_for_trl

TRL_ISSUE = "huggingface/trl#6294"


def collapse_image_runs(ids: Sequence[int], image_token_id: int) -> list[int]:
    """``ids`` with every run of consecutive ``image_token_id`` tokens replaced by one such token.

    >>> collapse_image_runs([1, 7, 7, 7, 2, 7, 7, 3, 7], image_token_id=7)
    [1, 7, 2, 7, 3, 7]
    """
    out: list[int] = []
    for i, t in enumerate(ids):
        if t != image_token_id or i == 0 or ids[i - 1] != image_token_id:
            out.append(t)
    return out


def probe_conversation() -> list[dict]:
    """A one-image user turn in TRL's content-block form (what ``prepare_multimodal_messages`` makes of a row)."""
    image = Image.new("RGB", (56, 56), (200, 40, 40))
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]}]


def rendered_ids(processing_class, conversation: list[dict], *, chat_template=None,
                 chat_template_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """(the processor's ids, the tokenizer-only ids) of one chat-templated conversation, as TRL renders it.

    The first is what TRL hands vLLM (each image placeholder expanded by the processor); the second is where vLLM
    itself starts from: the same chat-templated text, tokenized by the tokenizer alone (one placeholder per image).
    """
    kwargs = dict(chat_template=chat_template, add_generation_prompt=True, **(chat_template_kwargs or {}))
    processing_class = processor_for_trl(processing_class)  # as the trainer hands it to TRL (Ovis2: image tensors)
    expanded = processing_class.apply_chat_template([conversation], tokenize=True, return_dict=True, **kwargs)
    text = processing_class.apply_chat_template([conversation], tokenize=False, **kwargs)
    text = text[0] if isinstance(text, list) else text
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    # The processor's own rule (transformers' ProcessorMixin.apply_chat_template): special tokens (BOS) are added
    # unless the templated text already starts with BOS.
    bos = tokenizer.bos_token
    plain = tokenizer(text, add_special_tokens=not (bos is not None and text.startswith(bos)))["input_ids"]
    return list(expanded["input_ids"][0]), list(plain)


def collapse_problem(processing_class, image_token_id: int, *, chat_template=None,
                     chat_template_kwargs: dict | None = None) -> str | None:
    """None when collapsing the image runs of the processor's ids gives exactly the tokenizer-only ids (checked on a
    one-image conversation rendered by this very processor and template), else what differs."""
    expanded, plain = rendered_ids(processing_class, probe_conversation(), chat_template=chat_template,
                                   chat_template_kwargs=chat_template_kwargs)
    collapsed = collapse_image_runs(expanded, image_token_id)
    if collapsed == plain:
        return None
    n_runs = sum(1 for i, t in enumerate(expanded) if t == image_token_id and (i == 0 or expanded[i - 1] != t))
    return (f"the processor expands one image placeholder into more than a run of one token ({n_runs} run(s) of "
            f"image tokens, {len(collapsed)} ids once collapsed, {len(plain)} in the tokenizer-only rendering)")


def engine_prompt_ids(prompt_ids: Sequence[Sequence[int]], image_token_id: int) -> list[list[int]]:
    """The ids to hand vLLM's colocated engine for TRL's processor-expanded ``prompt_ids``: each row with its image
    runs collapsed (:func:`collapse_image_runs`; a row without image tokens is unchanged). Exact where
    :func:`collapse_problem` is None; :func:`check_vllm_prompts` refuses colocate mode elsewhere."""
    return [collapse_image_runs(ids, image_token_id) for ids in prompt_ids]


# vLLM clamps ``logit_bias`` to [-100, 100]: -100 is the most it can take away (exp(-100) ~ 4e-44 of the mass).
IMAGE_TOKEN_BIAS = -100.0


def suppress_image_tokens(generation_kwargs: dict | None, image_token_ids: Sequence[int]) -> dict:
    """A copy of TRL's vLLM ``generation_kwargs`` whose ``logit_bias`` keeps the engine from sampling the image
    placeholder tokens (:data:`IMAGE_TOKEN_BIAS` on each); a bias the user set for one of them is kept.

    Why: TRL 1.16 suppresses the image token when it generates with transformers (``suppress_tokens``), not under
    vLLM; a sampled placeholder in a completion makes the policy's next forward fail ("Image features and image
    tokens do not match": one more image token than features), which ends the run. A trained model rarely samples it,
    a fresh or small one does (a random tiny Qwen2.5-VL did at its second step). The sampling distribution then
    leaves those tokens out, and vLLM's processed log-probs say so: the importance-sampling correction sees the
    difference, as it should.

    >>> suppress_image_tokens({"top_k": 5, "logit_bias": {7: 2.0}}, [7, 9])
    {'top_k': 5, 'logit_bias': {7: 2.0, 9: -100.0}}
    >>> suppress_image_tokens(None, [9])
    {'logit_bias': {9: -100.0}}
    """
    out = dict(generation_kwargs or {})
    bias = {int(k): float(v) for k, v in (out.get("logit_bias") or {}).items()}
    for token in image_token_ids:
        bias.setdefault(int(token), IMAGE_TOKEN_BIAS)
    out["logit_bias"] = bias
    return out


def drop_stale_image_features(vllm_generation) -> None:
    """Drop the colocated engine's cached image encoder outputs; call before each weight sync (the module docstring
    says why). Text and prefix caches are TRL's business (it resets the prefix cache itself)."""
    vllm_generation.llm.llm_engine.reset_encoder_cache()


VLLM_CPU_CANNOT_START = {
    "qwen3_vl_moe": ("vLLM 0.31's CPU build stops while the engine starts, in its fused-MoE layer (\"expert parallel "
                     "group is not initialized\", tests_vllm/test_colocate.py)"),
}
"""Families vLLM's CPU build cannot start in TRL's colocate mode, and what it says; a GPU build is not affected."""


def _vllm_runs_on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:  # no vLLM: TRL refuses use_vllm itself
        return False
    return bool(current_platform.is_cpu())


def colocated_vlm(args, facts) -> bool:
    """vLLM generates in this process (TRL's colocate mode) for a VLM: the case that needs :func:`engine_prompt_ids`.
    Server mode keeps TRL's expanded ids (the module docstring says why)."""
    return bool(getattr(args, "use_vllm", False)) and getattr(args, "vllm_mode", None) == "colocate" and facts.is_vlm


def check_vllm_prompts(args, processing_class, facts) -> None:
    """Refuse vLLM colocate mode at construction for a VLM whose expanded prompt ids cannot be turned back into the
    ids vLLM expects (see the module docstring), naming the family, the TRL issue and the alternative.

    ``facts``: the model's :class:`~trl_mdi.attention.model_facts.ModelFacts` (its first image token id is the
    image placeholder). No-op without vLLM, in server mode, or for a text-only model.
    """
    if not colocated_vlm(args, facts):
        return
    engine_problem = VLLM_CPU_CANNOT_START.get(facts.model_type)
    if engine_problem is not None and _vllm_runs_on_cpu():
        raise ValueError(
            f"vLLM colocate mode cannot run {facts.model_type!r} on vLLM's CPU build: {engine_problem}. Generate with "
            "transformers instead (use_vllm=False, drop --use_vllm), or run vLLM on a GPU.")
    problem = collapse_problem(processing_class, facts.image_token_ids[0],
                               chat_template_kwargs=getattr(args, "chat_template_kwargs", None))
    if problem is not None:
        raise ValueError(
            f"vLLM colocate mode would generate from a corrupted prompt for {facts.model_type!r}: TRL 1.16 hands vLLM "
            f"the processor's expanded image tokens, which vLLM expands again ({TRL_ISSUE}, open), and trl_mdi can "
            f"undo that only where an image is one run of one token; here {problem}. Generate with transformers "
            f"instead: use_vllm=False (drop --use_vllm).")
