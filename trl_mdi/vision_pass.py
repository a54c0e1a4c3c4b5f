"""A zero-weighted vision pass for processes whose batch holds no image, so every process joins the same collectives.

Under ZeRO-3 the vision tower's sharded weights are gathered collectively when it runs: a process whose batch has no
image would skip the gather the others wait in, and the run hangs. Under DDP, a tower that got no gradient on one
process fails the unused-parameter check. The usual cure (other VLM RL stacks do the same) is a dummy vision forward
on the image-less processes whose output enters the computation times zero:

    h <- h + 0 * sum(vision_tower(dummy image))

so the forward and the gradients are unchanged (every vision parameter gets exactly zero gradient there) while every
process runs the tower at the same point of the model's forward, in the same order.

Where it runs: a forward pre-hook on the VLM's backbone (the ``*Model`` that owns ``get_image_features``) marks a call
without images; a pre-hook of its language model then runs the tower, after the token embedding and before the
decoder layers, where image processes run it (every supported family embeds the tokens, encodes the images, then
calls its language model with ``inputs_embeds``), and adds the zero-weighted term to ``inputs_embeds``. Not in the
embedding's own forward hook: under ZeRO-3 the embedding's backward hook would then fire before the tower's on
image-less processes and after it on the others, and the backward gathers would pair the wrong parameters. It runs on *full* forwards without ``pixel_values`` (training micro-batches, the scoring forward,
generation's prefill), never on cached decoding steps (no process runs the tower there). Image processes are
untouched. The rows stay text-only: no image token is added to any prompt.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from PIL import Image

from .attention.model_facts import unwrap_model
from .data.images import check_images_on_every_rank, images_per_process

# Keys of a processor's output that feed the vision tower's get_image_features (the rest is text).
_TEXT_KEYS = {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}
# Model inputs indexed by image (or image patch / tile), never by row or token: all empty when a slice has no image.
_IMAGE_INDEXED = ("pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask", "image_position_ids",
                  "spatial_shapes")


def vision_backbone(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose forward runs the vision tower and the language model (``model.model`` for the
    ``*ForConditionalGeneration`` classes); None when the model has no ``get_image_features``."""
    base = unwrap_model(model)
    base = getattr(base, "base_model", base)  # PEFT
    base = getattr(base, "model", base) if not hasattr(base, "get_image_features") else base
    inner = getattr(base, "model", None)
    for candidate in (inner, base):
        if candidate is not None and hasattr(type(candidate), "get_image_features") and hasattr(candidate, "forward"):
            if "pixel_values" in inspect.signature(candidate.forward).parameters:
                return candidate
    return None


def dummy_vision_inputs(processor, size: int = 28) -> dict[str, torch.Tensor]:
    """The vision inputs of one small black image, as this model's processor makes them (any family)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "."}]}]
    text = processor.apply_chat_template(messages, tokenize=False)
    encoded = processor(images=[Image.new("RGB", (size, size))], text=[text], return_tensors="pt")
    return {k: v for k, v in encoded.items() if k not in _TEXT_KEYS and torch.is_tensor(v)}


# Outputs of get_image_features, besides pooler_output, that a backbone's forward feeds into the embeddings on image
# processes: Qwen3-VL's deepstack features; Ovis2's indicator embeddings (a second call of its visual embedding table,
# written over <IMG_START> ... on image processes: left out, ZeRO-3's backward met that table once fewer on image-less
# processes, "Detected a disagreement on list length ... 225 / 224" in the every-family launch).
_EXTRA_USED_FEATURES = ("deepstack_features", "visual_indicator_features")


def _used_features(output: Any) -> Any:
    """What a backbone's forward takes from ``get_image_features`` on image processes: ``pooler_output`` and the
    ``_EXTRA_USED_FEATURES`` it has, not ``last_hidden_state`` (the pre-merger states): summing those too would add a
    path image processes lack, and ZeRO-3's backward would visit the modules in another order."""
    pooled = getattr(output, "pooler_output", None)
    if pooled is None:
        return output
    extra = [value for name in _EXTRA_USED_FEATURES if (value := getattr(output, name, None)) is not None]
    return [pooled, *extra] if extra else pooled


def _float_sum(value: Any) -> torch.Tensor | None:
    """Sum of every floating-point tensor in a (possibly nested) model output."""
    if torch.is_tensor(value):
        return value.float().sum() if value.is_floating_point() else None
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        parts = [s for s in (_float_sum(v) for v in value) if s is not None]
        return torch.stack(parts).sum() if parts else None
    return None


def _tower_on(backbone: torch.nn.Module, dummy: dict[str, torch.Tensor]) -> Any:
    """The backbone's ``get_image_features`` on the dummy inputs, moved to the tower's device and float dtype."""
    reference = next(backbone.parameters())
    inputs = {k: v.to(reference.device, dtype=reference.dtype if v.is_floating_point() else v.dtype)
              for k, v in dummy.items()}
    return backbone.get_image_features(**inputs, return_dict=True)


def _is_decode_step(kwargs: dict) -> bool:
    # transformers 5.24 renamed the forward's cache argument ``cache`` (``past_key_values`` until 5.23, still taken
    # with a deprecation warning until 5.40)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0


class VisionPass:
    """Installed dummy vision pass (``install_zero_weighted_vision_pass``): ``count`` of dummy passes run; ``remove()``."""

    def __init__(self, handles: list):
        self.handles, self.count = handles, 0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _text_decoder(backbone: torch.nn.Module) -> torch.nn.Module | None:
    """The child of the backbone that holds the token embedding: the language model it calls with inputs_embeds."""
    embedding = backbone.get_input_embeddings()
    for child in backbone.children():
        if any(m is embedding for m in child.modules()):
            return child
    return None


def drop_empty_image_inputs(model: torch.nn.Module):
    """Make a forward whose ``pixel_values`` hold zero images a text-only forward; returns the hook's handle (None for
    a model without a vision backbone).

    TRL slices a batch's image tensors per chunk of its log-prob forwards and per training micro-batch; a slice of
    text-only rows gets ``pixel_values`` with zero images, which VLM forwards cannot take (Qwen2.5-VL fails in
    ``torch.cat`` of an empty list), so a dataset mixing text-only and image rows crashed whenever a slice held text
    rows only. A pre-hook on the backbone drops those empty image inputs (``_IMAGE_INDEXED``): the forward is then
    the text-only forward those rows are, and with several processes the dummy vision pass (registered after this
    hook) sees a forward without images. Slices with an image are untouched.
    """
    backbone = vision_backbone(model)
    if backbone is None:
        return None

    def pre_hook(_module, args, kwargs):
        pixels = kwargs.get("pixel_values")
        if not isinstance(pixels, torch.Tensor) or pixels.shape[0] > 0:  # None, a list (some families), or images
            return None
        return args, {k: v for k, v in kwargs.items() if k not in _IMAGE_INDEXED}

    return backbone.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True)


def install_zero_weighted_vision_pass(model: torch.nn.Module, dummy: dict[str, torch.Tensor]) -> VisionPass:
    """From now on, every full forward of ``model`` without ``pixel_values`` also runs the vision tower on ``dummy``
    where image processes run it (every supported family embeds the tokens, encodes the images, then calls its
    language model with ``inputs_embeds``): in a pre-hook of the language model, whose ``inputs_embeds`` get
    ``+ 0 * sum(features)``. Same collectives in the same order on every process, forward and backward (the zero term
    joins the embeddings where image features would, after the embedding's own ZeRO-3 hooks); outputs and gradients
    unchanged."""
    backbone = vision_backbone(model)
    decoder = _text_decoder(backbone) if backbone is not None else None
    if backbone is None or decoder is None:
        raise ValueError(f"{type(unwrap_model(model)).__name__} has no get_image_features and language model with "
                         "the token embedding: no dummy vision pass")
    signature = inspect.signature(backbone.forward)
    armed: list[bool] = []

    def pre_hook(_module, args, kwargs):
        armed.clear()
        bound = signature.bind_partial(*args, **kwargs).arguments if args else kwargs
        # mm_encoder_outputs (even empty) means generate() already ran the encoding step (and, on image-less
        # processes, the dummy below): nothing more here.
        if (bound.get("pixel_values") is None and bound.get("inputs_embeds") is None
                and bound.get("mm_encoder_outputs") is None and not _is_decode_step(bound)):
            armed.append(True)

    def decoder_hook(_module, args, kwargs):
        embeds = kwargs.get("inputs_embeds")
        if not armed or embeds is None:
            return None
        armed.clear()  # once per backbone call
        total = _float_sum(_used_features(_tower_on(backbone, dummy)))
        if total is None:
            return None
        state.count += 1
        return args, {**kwargs, "inputs_embeds": embeds + (total * 0.0).to(embeds.dtype)}

    def post_hook(_module, _args, _kwargs, output):
        armed.clear()
        return output

    state = VisionPass([backbone.register_forward_pre_hook(pre_hook, with_kwargs=True),
                        decoder.register_forward_pre_hook(decoder_hook, with_kwargs=True),
                        backbone.register_forward_hook(post_hook, with_kwargs=True)])
    # transformers 5's generate() encodes images before the prefill (mm_encoder_outputs): image-less processes run the
    # dummy there too, in the same place. No gradient flows in generation, so running the tower is all it takes.
    for module in unwrap_model(model).modules():
        original = getattr(module, "_prepare_multimodal_encoder_kwargs_for_generation", None)
        if original is not None:
            module._prepare_multimodal_encoder_kwargs_for_generation = _encoding_step(original, backbone, dummy, state)
            state.handles.append(_Restore(module, "_prepare_multimodal_encoder_kwargs_for_generation"))
            break
    return state


class _Restore:
    """A removable handle for an instance attribute set over a class method."""

    def __init__(self, module, name: str):
        self.module, self.name = module, name

    def remove(self) -> None:
        self.module.__dict__.pop(self.name, None)


def _encoding_step(original, backbone, dummy: dict[str, torch.Tensor], state: VisionPass):
    def prepare(model_kwargs):
        out = original(model_kwargs)
        if not (out.get("mm_encoder_outputs") or {}).get("image"):
            _tower_on(backbone, dummy)
            state.count += 1
        return out

    return prepare


@contextlib.contextmanager
def zero_weighted_vision_pass(model: torch.nn.Module, dummy: dict[str, torch.Tensor]) -> Iterator[VisionPass]:
    """``install_zero_weighted_vision_pass`` for the duration of a ``with`` block."""
    state = install_zero_weighted_vision_pass(model, dummy)
    try:
        yield state
    finally:
        state.remove()


def vision_pass_problem(model: torch.nn.Module, processing_class) -> str | None:
    """Why this model cannot take the dummy vision pass (None: it can), read from its modules alone, so a model's
    skeleton built without weights answers as the loaded model does: a vision backbone with ``get_image_features``
    and a language model holding the token embedding to hook, and a processor that encodes a blank image."""
    backbone = vision_backbone(model)
    if backbone is None or _text_decoder(backbone) is None:
        return (f"{type(unwrap_model(model)).__name__} has no get_image_features and language model with the token "
                "embedding")
    try:
        dummy_vision_inputs(processing_class)
    except Exception as e:  # any family-specific failure means "no dummy pass", never a failed construction
        return f"its processor cannot encode a blank image ({type(e).__name__}: {e})"
    return None


def vision_pass_for_run(model, processing_class, num_processes: int, is_vlm: bool, log) -> VisionPass | None:
    """The dummy vision pass a multi-process VLM run installs (None with one process or a text-only model), or None
    with the reason logged when this model cannot take one (no ``get_image_features``, a processor that cannot
    encode a blank image): then ZeRO-3 keeps its clear error for batches with images on some processes only."""
    if num_processes < 2 or not is_vlm:
        return None
    try:
        state = install_zero_weighted_vision_pass(model, dummy_vision_inputs(processing_class))
    except Exception as e:  # any family-specific failure means "no dummy pass", never a failed construction
        log(f"MDIGRPOTrainer: no dummy vision pass for this model ({type(e).__name__}: {e}); under ZeRO-3 a batch "
            "with images on some processes only stops with an error instead")
        return None
    log("MDIGRPOTrainer: processes whose batch holds no image run a zero-weighted dummy vision pass (same "
        "collectives on every process, gradients unchanged)")
    return state


def images_on_some_processes_only(inputs: list[dict], accelerator, *, has_vision_pass: bool, zero3: bool) -> bool:
    """Whether this batch has images on some processes and none on others (False with one process). Under ZeRO-3
    without the dummy pass such a batch is the clear error of ``check_images_on_every_rank`` (a hang otherwise).
    All processes must call it (one gather)."""
    if accelerator.num_processes < 2:
        return False
    flags = images_per_process(inputs, accelerator.gather, accelerator.device)
    if zero3 and not has_vision_pass:
        check_images_on_every_rank(flags)
    return any(flags) and not all(flags)
