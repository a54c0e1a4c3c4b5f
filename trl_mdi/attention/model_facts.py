"""What the probe can measure on a model, read from its config (and, for the image token, its processor) before any
weight is loaded.

A trainer needs this at construction (to validate segments and reward inputs, and to decide whether attention
metrics can run at all), but a model given by Hub id or path is only loaded inside ``GRPOTrainer.__init__``; so
the facts come from the config alone. ``tests/test_families.py`` checks, per supported family, that the layers
predicted here are exactly the layers the probe then records.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

# Layer kinds that never call the attention interface: no softmax over keys, hence nothing to measure.
# ("linear_attention" covers Gated DeltaNet, Mamba and other recurrent mixers; "conv" and "moe" are the
# convolution and MoE-only layers of some hybrid models.)
UNMEASURED_LAYER_TYPES = frozenset({"linear_attention", "mamba", "conv", "moe"})

# Families that cannot take more than one image per prompt under TRL 1.16, and why: {model_type: reason}.
ONE_IMAGE_PER_ROW = {
    "llava_onevision": "its processor lays a prompt with several images out without tiles and says so in "
    "batch_num_images, which TRL 1.16's log-prob forward does not pass to the model (it forwards a fixed list of "
    "keys), so the model tiles every image and stops with 'Image features and image tokens do not match'",
}


# Families whose processor cannot encode a prompt without an image, and why: {model_type: reason}.
IMAGE_IN_EVERY_PROMPT = {
    "paligemma": "PaliGemmaProcessor refuses a batch without images (\"`images` are expected\") and, in a batch with "
    "images, writes <bos> into a text-only prompt at its 7th character (it inserts <bos> after the last <image> of "
    "each prompt and finds none there)",
}

# Families whose processor cannot encode several unpadded prompts of different lengths in one call, as TRL 1.16's
# _tokenize_prompts calls it, and why: {model_type: reason}. The trainer encodes their prompts one at a time.
UNPADDED_BATCH_PROBLEMS = {
    "paligemma": "PaliGemmaProcessor builds its labels with np.array(input_ids), which fails on unpadded prompts of "
    "different lengths (\"inhomogeneous shape\")",
}

# The token_type_ids value of generated tokens, for families where TRL 1.16's default (it extends the prompt's
# token_type_ids with zeros over the completion) is wrong: {model_type: value}. PaliGemma reads 0 as its
# bidirectional prefix and 1 as the causal suffix, and generation gives each new token 1; with TRL's zeros the
# log-prob forward would let every completion token attend to the ones after it.
COMPLETION_TOKEN_TYPE = {"paligemma": 1}

# Processors that, called without return_tensors (as TRL 1.16's _tokenize_prompts calls them), return an image field as
# a list of per-image tile stacks, (tiles, C, H, W) each, that the model takes concatenated along the first axis (what
# the processor returns with return_tensors="pt"): {processor class name: field names}. Keyed by the processor, which
# every caller has (a test batch has no config). TRL's generation rule (np.array of the list) would stack them into a
# 5-D tensor the vision tower rejects; Llama 4's stacks are bfloat16, which numpy refuses before that.
TILE_STACK_FIELDS = {"Llama4Processor": ("pixel_values",)}


@dataclass(frozen=True)
class ModelFacts:
    """The parts of a model's config that attention measurement depends on."""

    model_type: str
    image_token_ids: tuple[int, ...]  # image/video placeholder ids; empty for a text-only model
    num_layers: int  # text decoder layers
    measured_layers: tuple[int, ...]  # softmax-attention layers: the ones the probe measures
    layer_types: tuple[str, ...] | None  # text_config.layer_types, when the family declares them
    sliding_window: int | None  # window of the sliding-attention layers, if any
    vision_part: str | None = None  # the config attribute holding the vision tower's config, e.g. "vision_config"
    image_token_source: str | None = None  # where image_token_ids were read, e.g. "config.image_token_id"
    image_token_problem: str | None = None  # a vision part but no image token found: which attributes were missing
    # Tokens that delimit or punctuate an image's run without carrying image features: GLM-4.1V's
    # <|begin_of_image|> / <|end_of_image|>, Pixtral's [IMG_BREAK] / [IMG_END], Qwen's <|vision_start|> /
    # <|vision_end|>, Gemma's begin / end of image. They count as text keys (``IMAGE_MARKER_ATTRIBUTES`` says why).
    image_marker_ids: tuple[int, ...] = ()
    one_image_per_row: str | None = None  # why a prompt may hold at most one image (ONE_IMAGE_PER_ROW), else None
    image_in_every_prompt: str | None = None  # why every prompt needs an image (IMAGE_IN_EVERY_PROMPT), else None
    completion_token_type: int = 0  # token_type_ids of generated tokens (COMPLETION_TOKEN_TYPE)
    unpadded_batch_problem: str | None = None  # why prompts are encoded one at a time (UNPADDED_BATCH_PROBLEMS)

    @property
    def is_vlm(self) -> bool:
        """Image tokens located: the probe can tell image keys from text keys."""
        return bool(self.image_token_ids)

    @property
    def has_vision(self) -> bool:
        """A vision-language model, image token found or not (``image_token_problem`` says what is missing)."""
        return self.is_vlm or self.vision_part is not None

    def images_per_row_problem(self, counts: list[int]) -> str | None:
        """None when every prompt's image count (``counts``) is one this family takes under TRL, else the error."""
        over = [i for i, n in enumerate(counts) if n > 1]
        if self.one_image_per_row and over:
            return (f"{self.model_type!r} prompts with several images cannot be trained under TRL 1.16 ({len(over)} "
                    f"row(s) here, e.g. row {over[0]} with {counts[over[0]]} images): {self.one_image_per_row}. Give "
                    "each prompt at most one image (e.g. paste the images side by side into one).")
        bare = [i for i, n in enumerate(counts) if n == 0]
        if self.image_in_every_prompt and bare:
            return (f"{self.model_type!r} cannot take a prompt without an image ({len(bare)} row(s) here, e.g. row "
                    f"{bare[0]}): {self.image_in_every_prompt}. Give every prompt an image, or drop the text-only "
                    "rows.")
        return None

    @property
    def unmeasured_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in set(self.measured_layers))

    def describe_layers(self) -> str:
        """One line for logs: '24 text layers, 6 measured (full attention): 3, 7, ...; 18 linear-attention skipped'."""
        if not self.unmeasured_layers:
            kinds = sorted(set(self.layer_types or ())) or ["attention"]
            return f"{self.num_layers} text layers, all measured ({', '.join(kinds)})"
        skipped = sorted({self.layer_types[i] for i in self.unmeasured_layers}) if self.layer_types else ["unmeasured"]
        return (f"{self.num_layers} text layers, {len(self.measured_layers)} measured: "
                f"{', '.join(map(str, self.measured_layers))}; {len(self.unmeasured_layers)} "
                f"{'/'.join(skipped)} layers have no attention weights and are skipped")


def text_config_of(config):
    """The text decoder's config (the config itself for a text-only model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


IMAGE_TOKEN_ATTRIBUTES = ("image_token_id", "video_token_id", "image_token_index", "img_context_token_id",
                          "media_placeholder_token_id")
"""Config attributes that hold an image / video placeholder id, as transformers' families (image_token_id,
video_token_id; LLaVA: image_token_index) and custom-code VLMs (InternVL: img_context_token_id; Kimi-VL:
media_placeholder_token_id) name them."""

IMAGE_MARKER_ATTRIBUTES = ("image_start_token_id", "image_end_token_id", "vision_start_token_id", "vision_end_token_id",
                           "boi_token_id", "eoi_token_id", "boi_token_index", "eoi_token_index",
                           "image_break_token_id")
"""Config (and processor) attributes naming tokens that sit around or inside an image's run of placeholders but are not
placeholders: GLM-4.1V's ``image_start_token_id`` / ``image_end_token_id`` (<|begin_of_image|> / <|end_of_image|>
around its M-RoPE run), Qwen's vision start / end, Gemma's begin / end of image, and Pixtral's ``[IMG_BREAK]`` (after
each row of ``[IMG]`` tokens) and ``[IMG_END]`` (closing the image; ``PixtralProcessor.image_end_token_id``).

Decision: they are text keys (prompt text; the ``special`` group under ``attention_text_keys="content"``, as special
tokens). The image group is exactly the positions whose input embedding the model replaces with vision features (the
placeholders, ``IMAGE_TOKEN_ATTRIBUTES``); a marker's embedding is a learned text-vocabulary row, the same for every
image, so mass on it says nothing about how much the model reads the picture. ``ModelFacts.image_marker_ids`` lists
them so that logs and tests can name them; they are never added to ``image_token_ids``."""

IMAGE_MARKER_TOKEN_ATTRIBUTES = ("image_start_token", "image_end_token", "image_thumbnail_token",
                                 "start_of_img_token", "end_of_img_token", "tile_global_token")
"""Processor attributes naming such markers as token strings, looked up in its tokenizer: LFM2-VL's ``<|image_start|>``
/ ``<|image_end|>`` around each image and ``<|img_thumbnail|>`` before a tiled image's thumbnail; Aya Vision's
``<|START_OF_IMG|>`` / ``<|END_OF_IMG|>`` around each image and ``TILE_GLOBAL`` before its global view. Text keys, as
above."""

IMAGE_MARKER_LIST_ATTRIBUTES = ("visual_indicator_token_ids",)
"""Config attributes holding a list of such marker ids: Ovis2's five indicator tokens (``<IMG_START>``,
``<IMG_GRID>``, ``<IMG_COL>``, ``<IMG_ROW>``, ``<IMG_END>``) around and between an image's crops. The model replaces
their embeddings with rows of its visual embedding table, but fixed rows, the same for every image: they carry nothing
of the picture, so they are text keys, as above."""

_VISION_WORDS = frozenset({"vision", "visual", "vit", "img", "image"})


def vision_part(config) -> str | None:
    """The name of the config attribute that holds a vision tower's config, or None (a text-only config).

    Any sub-config (a config object or a dict) whose name has a word "vision", "visual", "vit", "img" or "image":
    ``vision_config`` (transformers' families, InternVL, MiniCPM-V, DeepSeek-VL2), ``visual`` (Qwen-VL),
    ``vit_config``, ``vision_tower_config``, ``img_processor`` (Phi-3.5-vision), ``visual_tokenizer_config`` (Ovis).

    >>> from transformers import PretrainedConfig
    >>> vision_part(PretrainedConfig(vit_config={"hidden_size": 8}, image_token_index=5))
    'vit_config'
    >>> vision_part(PretrainedConfig(hidden_size=8)) is None
    True
    """
    names = sorted(vars(config), key=lambda n: (n != "vision_config", n))
    for name in names:
        value = getattr(config, name, None)
        if (isinstance(value, (dict, PretrainedConfig)) and not name.startswith("_")
                and _VISION_WORDS & set(name.lower().split("_"))):
            return name
    return None


def _ids_from_config(config) -> list[int]:
    ids = []
    for name in IMAGE_TOKEN_ATTRIBUTES:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0 and value not in ids:
            ids.append(value)
    return ids


def _ids_from_processor(processor) -> tuple[list[int], str | None]:
    """The placeholder ids a processor writes into the prompt: its image_token_id / video_token_id, else its
    image_token / video_token strings looked up in its tokenizer (the way the processor expands them)."""
    ids = [v for v in (getattr(processor, n, None) for n in ("image_token_id", "video_token_id"))
           if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    if ids:
        return list(dict.fromkeys(ids)), f"{type(processor).__name__}.image_token_id"
    tokenizer = getattr(processor, "tokenizer", None)
    vocab = tokenizer.get_vocab() if tokenizer is not None and hasattr(tokenizer, "get_vocab") else {}
    tokens = [t for t in (getattr(processor, n, None) for n in ("image_token", "video_token")) if isinstance(t, str)]
    ids = [vocab[t] for t in tokens if t in vocab]
    return list(dict.fromkeys(ids)), (f"{type(processor).__name__}.image_token" if ids else None)


def find_image_token_ids(config, processor=None) -> tuple[tuple[int, ...], str | None]:
    """``(ids, source)``: the image / video placeholder ids of a model and where they were read, or ``((), None)``.

    The config comes first (``IMAGE_TOKEN_ATTRIBUTES``: the ids the model itself matches against). Only when it
    names none and it has a vision part (``vision_part``) is ``processor`` asked, as the processor itself finds
    the token: its ``image_token_id``, else its ``image_token`` looked up in its tokenizer. (A text-only model's
    tokenizer may well hold an ``<|image_pad|>`` token: that does not make it a VLM.)
    """
    ids = _ids_from_config(config)
    if ids:
        found = next(n for n in IMAGE_TOKEN_ATTRIBUTES if isinstance(getattr(config, n, None), int))
        return tuple(ids), f"config.{getattr(config, 'attribute_map', {}).get(found, found)}"  # the stored name
    if processor is None or vision_part(config) is None or getattr(processor, "tokenizer", None) is None:
        return (), None
    ids, source = _ids_from_processor(processor)
    return tuple(ids), source


def _marker_ids(config, processor, image_ids) -> tuple[int, ...]:
    """The ids ``IMAGE_MARKER_ATTRIBUTES`` name on the config, then on the processor (Pixtral keeps its markers
    there), then the config's lists (``IMAGE_MARKER_LIST_ATTRIBUTES``, Ovis2), then the tokens
    ``IMAGE_MARKER_TOKEN_ATTRIBUTES`` name on the processor (LFM2-VL), leaving out any that is an image placeholder."""
    values = [getattr(source, name, None) for source in (config, processor) if source is not None
              for name in IMAGE_MARKER_ATTRIBUTES]
    values += [v for name in IMAGE_MARKER_LIST_ATTRIBUTES for v in (getattr(config, name, None) or ())]
    tokenizer = getattr(processor, "tokenizer", None)
    vocab = tokenizer.get_vocab() if tokenizer is not None and hasattr(tokenizer, "get_vocab") else {}
    values += [vocab.get(getattr(processor, name, None)) for name in IMAGE_MARKER_TOKEN_ATTRIBUTES]
    ids = []
    for value in values:
        if (isinstance(value, int) and not isinstance(value, bool) and value >= 0 and value not in ids
                and value not in image_ids):
            ids.append(value)
    return tuple(ids)


def model_facts(config, processor=None) -> ModelFacts:
    """Read :class:`ModelFacts` from a transformers config (a VLM's top config or a causal LM's config).

    ``processor`` (optional) supplies the image token when the config names none (``find_image_token_ids``); a
    config with a vision part and no image token anywhere gets ``image_token_problem`` instead of passing for a
    text-only model.
    """
    ids, source = find_image_token_ids(config, processor)
    part = vision_part(config)
    problem = None
    if part is not None and not ids:
        model_type = getattr(config, "model_type", type(config).__name__)
        where = (f"and its processor ({type(processor).__name__}) names no image_token either" if processor is not None
                 else "and no processor was given to read the image token from")
        problem = (f"the {model_type!r} config has a vision part ({part!r}) but none of the attributes "
                   f"{', '.join(IMAGE_TOKEN_ATTRIBUTES)} names its image placeholder token, {where}")
    text = text_config_of(config)
    num_layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    layer_types = getattr(text, "layer_types", None)
    layer_types = tuple(str(t) for t in layer_types) if layer_types else None
    if layer_types is not None and len(layer_types) == num_layers:
        measured = tuple(i for i, t in enumerate(layer_types) if t not in UNMEASURED_LAYER_TYPES)
    else:
        measured = tuple(range(num_layers))
    window = getattr(text, "sliding_window", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None  # some configs keep a sliding_window value that no layer uses
    return ModelFacts(
        model_type=str(getattr(config, "model_type", type(config).__name__)),
        image_token_ids=ids,
        num_layers=num_layers,
        measured_layers=measured,
        layer_types=layer_types,
        sliding_window=int(window) if isinstance(window, int) else None,
        vision_part=part,
        image_token_source=source,
        image_token_problem=problem,
        image_marker_ids=_marker_ids(config, processor, ids) if part is not None else (),
        one_image_per_row=ONE_IMAGE_PER_ROW.get(str(getattr(config, "model_type", ""))),
        image_in_every_prompt=IMAGE_IN_EVERY_PROMPT.get(str(getattr(config, "model_type", ""))),
        completion_token_type=COMPLETION_TOKEN_TYPE.get(str(getattr(config, "model_type", "")), 0),
        unpadded_batch_problem=UNPADDED_BATCH_PROBLEMS.get(str(getattr(config, "model_type", ""))),
    )


def image_token_problem(config, processor=None) -> str | None:
    """None when a vision-language model's image token is where everything reads it, else what is missing.

    Two readers: the probe's layout (``model_facts``: the config, else the processor) and TRL's ``GRPOTrainer``,
    which reads ``model.config.image_token_id`` for every model with a processor (to keep generation from sampling
    the image token), so a config without it fails inside TRL's construction even when the processor knows the
    token. A text-only config has no problem.
    """
    facts = model_facts(config, processor)
    if not facts.has_vision:
        return None
    if facts.image_token_problem:
        return f"{facts.image_token_problem}: the image tokens cannot be located; add image_token_id to its config.json"
    if not isinstance(getattr(config, "image_token_id", None), int):
        token = facts.image_token_ids[0]
        return (f"the {facts.model_type!r} config has no image_token_id (its image token {token} is known from "
                f"{facts.image_token_source}), and TRL's GRPOTrainer reads model.config.image_token_id: add "
                f'"image_token_id": {token} to the model\'s config.json')
    return None


_HUB_KWARGS = ("revision", "trust_remote_code", "cache_dir", "token", "subfolder", "local_files_only")


def load_model_config(model: Any, model_init_kwargs: dict | None = None, *, trust_remote_code: bool = False):
    """The config of a model given as a PreTrainedModel (plain, PEFT, wrapped) or as a Hub id / local path.

    For an id or path only ``config.json`` is read (offline: from the local cache or folder) with what
    ``GRPOTrainer`` will load the weights with: the hub arguments of ``model_init_kwargs`` (revision,
    trust_remote_code, cache_dir, ...) and, where they do not set it, ``trust_remote_code`` (pass
    ``GRPOConfig.trust_remote_code``: TRL copies it into its model_init_kwargs the same way, with ``setdefault``).
    A model with custom code read without it raises transformers' own "custom code" error, as TRL's load would.
    """
    if isinstance(model, str):
        from transformers import AutoConfig

        kwargs = {k: v for k, v in (model_init_kwargs or {}).items() if k in _HUB_KWARGS}
        kwargs.setdefault("trust_remote_code", trust_remote_code)
        return AutoConfig.from_pretrained(model, **kwargs)
    return unwrap_model(model).config


def trl_model_class(config):
    """The class ``GRPOTrainer`` loads a model id or path with (TRL 1.16's ``create_model_from_path``, pinned by
    tests/test_trl_contract.py): the config's first architecture when transformers has it, else the auto class its
    ``auto_map`` names (custom code: image-text-to-text first), else ``AutoModelForCausalLM``."""
    import transformers

    architectures = getattr(config, "architectures", None) or []
    architecture = getattr(transformers, architectures[0], None) if architectures else None
    if architecture is not None:
        return architecture
    auto_map = getattr(config, "auto_map", None) or {}
    for candidate in (transformers.AutoModelForImageTextToText, transformers.AutoModelForCausalLM):
        if candidate.__name__ in auto_map:
            return candidate
    return transformers.AutoModelForCausalLM


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def model_skeleton(model: Any, config, model_init_kwargs: dict | None = None, *,
                   trust_remote_code: bool = False) -> torch.nn.Module:
    """The model's modules without its weights, to read what only the modules tell (the attention implementation
    transformers picks for the class, whether the probe can measure it, where a dummy vision pass would hook):
    ``model`` itself when it is already loaded, else the class ``GRPOTrainer`` will load (``trl_model_class``)
    built from ``config`` on the meta device, with the ``attn_implementation`` and ``dtype`` of
    ``model_init_kwargs`` as TRL passes them (dtype float32 unless given). Nothing is allocated and no weight is
    read. Raises whatever the class's construction raises (a custom class that cannot be built without weights)."""
    if not isinstance(model, str):
        return model
    import copy

    kwargs = dict(model_init_kwargs or {})
    dtype = kwargs.get("dtype", "float32")
    build = {"dtype": _DTYPES.get(dtype, dtype)} if isinstance(dtype, torch.dtype) or dtype in _DTYPES else {}
    if kwargs.get("attn_implementation") is not None:
        build["attn_implementation"] = kwargs["attn_implementation"]
    from transformers.modeling_utils import set_zero3_state

    cls = trl_model_class(config)
    config = copy.deepcopy(config)  # the build writes the resolved implementation into the config it is given
    # set_zero3_state: under a DeepSpeed ZeRO-3 config transformers would build inside deepspeed.zero.Init (partitioned
    # across the processes, a collective); built as if inside one already, the skeleton stays whole, on meta.
    with torch.device("meta"), set_zero3_state():
        if hasattr(cls, "_from_config"):  # a transformers class
            return cls._from_config(config, **build)
        return cls.from_config(config, trust_remote_code=kwargs.get("trust_remote_code", trust_remote_code), **build)


def attention_implementation(model: torch.nn.Module) -> str | None:
    """The attention implementation of a model's text decoder (its config's ``_attn_implementation``)."""
    return getattr(text_config_of(unwrap_model(model).config), "_attn_implementation", None)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers PreTrainedModel inside DDP / DeepSpeed engines and PEFT wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model") and callable(model.get_base_model):  # PEFT
            model = model.get_base_model()
        elif hasattr(model, "module") and isinstance(model.module, torch.nn.Module):  # DDP / DeepSpeed
            model = model.module
    return model


def expert_count_for_trl(model: torch.nn.Module) -> None:
    """Give a MoE text config the ``num_experts`` TRL 1.16 reads, where the family names its routed-expert count
    otherwise.

    With an MoE model TRL enables its load-balancing loss (the config's ``router_aux_loss_coef``), and its fused
    log-prob forward (``trl.trainer.utils``, ``_fused_forward``) reads the expert count as ``text_config.num_experts``
    on transformers 5. GLM-4.5V's text config (``Glm4vMoeTextConfig``, from GLM-4.5-Air's) names it
    ``n_routed_experts`` (``num_local_experts`` as an alias) and has no ``num_experts``, so every training step stopped
    with "AttributeError: 'Glm4vMoeTextConfig' object has no attribute 'num_experts'", under stock TRL too. This sets
    ``num_experts`` on the loaded model's text config to the same count (what the model's own load-balancing loss uses,
    ``num_local_experts``); a config that has ``num_experts`` already, or no routed experts, is left as it is.

    >>> from types import SimpleNamespace
    >>> model = SimpleNamespace(config=SimpleNamespace(num_local_experts=4))
    >>> expert_count_for_trl(model); model.config.num_experts
    4
    """
    config = text_config_of(unwrap_model(model).config)
    if not hasattr(config, "num_experts") and isinstance(getattr(config, "num_local_experts", None), int):
        config.num_experts = config.num_local_experts


# Families whose model forward leaves the text config's ``logit_scale`` unapplied, and why: {model_type: reason}.
LOGIT_SCALE_UNUSED = {
    "aya_vision": "AyaVisionForConditionalGeneration computes its logits as lm_head(hidden) and never multiplies them "
    "by its Cohere 2 text config's logit_scale (Cohere2ForCausalLM does)",
}


# Text defaults of a processor class that TRL 1.16's batched prompt tokenization cannot take (``processor_for_trl``).
_TEXT_DEFAULTS_TRL_CANNOT_TAKE = ("return_tensors", "padding", "padding_side")


def processor_for_trl(processing_class):
    """The processor as TRL 1.16's batched prompt tokenization needs it: text returned as unpadded lists, images as
    tensors where the processor needs them to be (``IMAGE_TENSORS_FOR_TRL``: Ovis2).

    ``GRPOTrainer._tokenize_prompts`` renders and tokenizes a whole batch in one ``apply_chat_template`` call without
    padding, and takes each row's ``input_ids`` as its prompt (it reads no attention mask). Two class defaults of
    some processors' text kwargs (``text_kwargs``) break that:

    - ``return_tensors="pt"`` (``PixtralProcessor``, Mistral 3): any batch whose prompts differ in length fails inside
      TRL with "Unable to create tensor, you should probably activate truncation and/or padding".
    - ``padding=True`` (``AyaVisionProcessor``, MiniCPM-V 4.6's, also ``Cohere2VisionProcessor`` and
      ``Gemma4Processor``): the shorter
      prompts of a batch come back led by pad tokens, which TRL then keeps as prompt tokens that generation and every
      log-prob forward attend to (Aya Vision: any two prompts whose images cost different numbers of tiles,
      ``tests/test_trl_contract.py``).

    This returns a shallow copy whose own ``text_kwargs`` leaves those defaults out (images keep theirs: TRL takes image
    tensors, and a processor in ``IMAGE_TENSORS_FOR_TRL`` gets ``images_kwargs`` asking for them); a processor without
    such a default, or a tokenizer, is returned as it is. The user's object is not changed, and nothing of this is
    saved with the processor (``text_kwargs`` and ``images_kwargs`` are no saved attributes).

    >>> class Proc:
    ...     text_kwargs = {"return_tensors": "pt", "padding": True, "padding_side": "left", "truncation": False}
    >>> fixed = processor_for_trl(Proc())
    >>> fixed.text_kwargs, Proc.text_kwargs["return_tensors"]
    ({'truncation': False}, 'pt')
    >>> class Padding:
    ...     text_kwargs = {"padding": True, "padding_side": "left", "return_tensors": "pt"}
    >>> processor_for_trl(Padding()).text_kwargs
    {}
    >>> tok = object()
    >>> processor_for_trl(tok) is tok
    True
    """
    defaults = getattr(processing_class, "text_kwargs", None)
    text_fix = isinstance(defaults, dict) and any(defaults.get(key) not in (None, False)
                                                  for key in _TEXT_DEFAULTS_TRL_CANNOT_TAKE)
    image_tensors = type(processing_class).__name__ in IMAGE_TENSORS_FOR_TRL
    if not (text_fix or image_tensors):
        return processing_class
    import copy

    fixed = copy.copy(processing_class)
    if text_fix:
        fixed.text_kwargs = {k: v for k, v in defaults.items() if k not in _TEXT_DEFAULTS_TRL_CANNOT_TAKE}
    if image_tensors:
        fixed.images_kwargs = {**(getattr(processing_class, "images_kwargs", None) or {}), "return_tensors": "pt"}
    return fixed


IMAGE_TENSORS_FOR_TRL = {
    "Ovis2Processor": "its replace_image_token calls grids[i].tolist(), which fails on the plain lists its image "
    "processor returns when no return_tensors is asked for (TRL 1.16's _tokenize_prompts asks for none: \"'list' object "
    "has no attribute 'tolist'\"), and the model takes an image's crops as one (crops, 3, H, W) tensor",
}
"""Processors whose image outputs must be tensors even where TRL 1.16 asks for lists, and why: ``processor_for_trl``
gives them ``images_kwargs={"return_tensors": "pt"}`` (text stays lists, as TRL needs it)."""


def processor_setting_problem(processing_class) -> str | None:
    """Why the processor's settings cannot train under TRL 1.16, naming the fix, or None.

    Ovis2 with ``crop_to_patches=True`` (what transformers' converter saves for the Ovis2 -hf checkpoints): an image
    larger than the processor's square becomes a thumbnail plus crops, several ``pixel_values`` entries for one image;
    TRL 1.16's ``_generate_and_score_completions`` then recounts the crops per row with
    ``image_processor(images, crop_to_patches=True)["num_patches"]`` (InternVL's key), which Ovis2's image processor
    does not return, so the first such batch stops with ``KeyError: 'num_patches'`` inside TRL.

    >>> processor_setting_problem(object()) is None
    True
    """
    image_processor = getattr(processing_class, "image_processor", None)
    if type(processing_class).__name__ == "Ovis2Processor" and getattr(image_processor, "crop_to_patches", False):
        return ("'ovis2' cannot train with its image processor's crop_to_patches=True under TRL 1.16: an image larger "
                "than its square becomes a thumbnail plus crops, and TRL's _generate_and_score_completions recounts "
                "those crops with image_processor(...)['num_patches'], which Ovis2ImageProcessor does not return "
                "(KeyError: 'num_patches' at the first such batch). Fix: processor.image_processor.crop_to_patches = "
                "False (each image resized to the one square; the same input for an image the square covers) and pass "
                "processing_class=processor")
    return None



def typed_system_problem(processing_class) -> str | None:
    """Why the processor's chat template garbles a system message in TRL's typed form, or None.

    TRL 1.16 (``prepare_multimodal_messages``) turns every message's content, the system turn's included, into a list
    of ``{"type": "text", "text": ...}`` blocks before rendering. A template that prints a system message's content
    as it is (GLM-4.1V's official one: ``{{ msg.content }}``) then writes that list's Python repr into the prompt. This
    renders a typed system turn and looks for the repr; a template that cannot render it at all is left to TRL's own
    error.

    >>> class Tok:
    ...     def apply_chat_template(self, messages, tokenize=False, **kw):
    ...         return "".join(str(m["content"]) for m in messages)
    >>> typed_system_problem(Tok()).startswith("its chat template prints a typed system message as a Python list")
    True
    """
    probe = "trl_mdi system probe"
    messages = [{"role": "system", "content": [{"type": "text", "text": probe}]},
                {"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    try:
        rendered = processing_class.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that cannot render this is not ours to judge
        return None
    if not isinstance(rendered, str) or f"'text': '{probe}'" not in rendered:
        return None
    return ("its chat template prints a typed system message as a Python list (TRL hands every message's content as "
            "a list of {'type': 'text', ...} blocks), so a system turn reaches the model as \"[{'type': 'text', "
            "'text': ...}]\". Fix: put the instructions in the user turn, or pass a chat_template whose system turn "
            "reads the text blocks")


ZERO3_LOADING_PROBLEMS = {
    "qwen3_vl_moe": (
        "transformers 5.23 loads Qwen3-VL-MoE's fused expert weights (mlp.experts.gate_up_proj / down_proj, stored "
        "transposed in its checkpoints) without their Transpose conversion when DeepSpeed ZeRO-3 is on, so loading "
        "stops with \"size mismatch for ...mlp.experts.down_proj\" (or, where a weight happens to be square, loads it "
        "untransposed without a word)"),
}
"""Families whose checkpoints transformers cannot load through its DeepSpeed ZeRO-3 path (what ``GRPOTrainer`` uses
for a model given by id or path once a ZeRO-3 config is active), and what goes wrong."""


def check_zero3_loading(model: Any, model_type: str, zero3: bool) -> None:
    """ValueError at construction when ``model`` is an id or path that ``GRPOTrainer`` would load through
    transformers' ZeRO-3 path (``zero3``: ``transformers.integrations.is_deepspeed_zero3_enabled()``) and the family
    is in ``ZERO3_LOADING_PROBLEMS``; the message names the fix. A model object loaded before the ZeRO-3 config
    existed loads normally, and ZeRO-3 shards it when the trainer prepares it (tests/dist/train_families.py does so).

    >>> check_zero3_loading("Qwen/Qwen3-VL-30B-A3B-Instruct", "qwen3_vl_moe", zero3=False)
    >>> check_zero3_loading(object(), "qwen3_vl_moe", zero3=True)
    """
    problem = ZERO3_LOADING_PROBLEMS.get(model_type)
    if problem is None or not zero3 or not isinstance(model, str):
        return
    raise ValueError(
        f"{model!r} ({model_type}) cannot be loaded under DeepSpeed ZeRO-3 by id or path: {problem}. Fix: load it "
        f"before building the GRPOConfig (model = AutoModelForImageTextToText.from_pretrained({model!r}), outside "
        "ZeRO-3's loading path) and pass the model object; ZeRO-3 shards it when training starts.")


ZERO3_TRAINING_PROBLEMS = {
    "lfm2_vl": (
        "its get_image_features runs the multimodal projector once per image tile, and DeepSpeed ZeRO-3 gathers the "
        "projector's sharded weights at every call, so two processes whose micro-batches hold different numbers of "
        "tiles (a process without images runs one dummy tile) issue different numbers of collectives and the run "
        "stops (gloo: \"Received data size doesn't match expected size\"; NCCL: a hang). TRL's own GRPOTrainer is "
        "affected alike; only batches with the same number of tiles on every process get through"),
}
"""Families that cannot train under DeepSpeed ZeRO-3 at all (however the model is given), and why."""


def check_zero3_training(model_type: str, zero3: bool) -> None:
    """ValueError at construction when DeepSpeed ZeRO-3 is on (``zero3``) and the family is in
    ``ZERO3_TRAINING_PROBLEMS``: the message names the family, the reason and the fix (ZeRO-2 or DDP, which shard no
    weight and so gather nothing per call).

    >>> check_zero3_training("lfm2_vl", zero3=False)
    >>> check_zero3_training("qwen2_5_vl", zero3=True)
    """
    problem = ZERO3_TRAINING_PROBLEMS.get(model_type)
    if problem is None or not zero3:
        return
    raise ValueError(
        f"{model_type!r} cannot train under DeepSpeed ZeRO-3: {problem}. Fix: train it with ZeRO-2 "
        "(accelerate_configs/deepspeed_zero2.yaml) or DDP (accelerate_configs/multi_gpu.yaml), which keep every weight "
        "whole on each process.")


TRANSFORMERS_FORWARD_PROBLEMS = {
    "llama4": (
        "5.24.0",
        "its Llama4ForConditionalGeneration.forward builds its output from `outputs.image_outputs`, which the output "
        "of its language model (MoeCausalLMOutputWithPast) does not have, so every forward stops with AttributeError "
        "after computing the logits: generation and TRL's log-prob forward alike, with or without an image "
        "(transformers 5.23 runs it, and there the probe is exact; 5.17 builds the output as 5.23 does)"),
}
"""Families whose every forward fails from a transformers release on (no later release is known to fix them):
{model_type: (first failing version, what fails)}. tests/test_families.py checks each entry against the installed
transformers: the refusal fires exactly where the tiny model's forward really fails."""


def _release(version: str) -> tuple[int, ...]:
    """A version's release numbers ("5.24.0.dev0" -> (5, 24, 0)): enough to order transformers releases without
    importing ``packaging`` into the maths modules."""
    return tuple(int(part) for part in re.match(r"\d+(?:\.\d+)*", version).group().split("."))


def transformers_forward_problem(model_type: str, version: str | None = None) -> str | None:
    """Why the family cannot run a forward on transformers ``version`` (default: the installed one), else None.

    >>> transformers_forward_problem("llama4", "5.23.0") is None
    True
    >>> transformers_forward_problem("llama4", "5.24.0").startswith("its Llama4ForConditionalGeneration.forward")
    True
    >>> transformers_forward_problem("qwen2_5_vl", "5.24.0") is None
    True
    """
    entry = TRANSFORMERS_FORWARD_PROBLEMS.get(model_type)
    if entry is None:
        return None
    if version is None:
        import transformers

        version = transformers.__version__
    first, problem = entry
    return problem if _release(version) >= _release(first) else None


TRAINING_PROBLEMS = {
    "llama4": (
        "its log-prob forward (the fused LM head TRL adds to the model) runs model.base_model and reads its "
        "last_hidden_state, but Llama4ForConditionalGeneration has no backbone module (its base_model_prefix \"model\" "
        "names no attribute, so base_model is the model itself, whose output has logits and no last_hidden_state): "
        "the first training step stops with \"AttributeError: 'Llama4CausalLMOutputWithPast' object has no attribute "
        "'last_hidden_state'\". TRL's own GRPOTrainer stops earlier, at its first generation: it turns the processor's "
        "bfloat16 per-image tile stacks into a tensor through numpy (\"Got unsupported ScalarType BFloat16\")"),
    "minicpmv4_6": (
        "its model needs target_sizes (each image's patch grid) with pixel_values, and TRL 1.16's log-prob forward "
        "passes a fixed list of keyword arguments without it; it also packs every image of a batch into one "
        "pixel_values sequence (shape (1, 3, patch, all patches)), which TRL slices per chunk of rows as if it held "
        "one entry per image or tile. Stock GRPOTrainer stops at the first batch with images, in "
        "_generate_and_score_completions (\"MiniCPMV4_6ImageProcessorKwargs.__init__() got an unexpected keyword "
        "argument 'crop_to_patches'\": TRL takes the packed sequence for InternVL's tiles). MiniCPM-V 4.6 is also "
        "newer than transformers 5.17, the newest the vLLM virtualenv runs"),
}
"""Families TRL 1.16's GRPOTrainer cannot train whatever the run's settings, and why: {model_type: reason}; refused at
construction (``check_trainable``). The probe measures them outside the trainer
(``trl_mdi.measure_modality_attention`` with the family's own inputs, e.g. MiniCPM-V 4.6's ``target_sizes``)."""


def check_trainable(model_type: str) -> None:
    """ValueError at construction for a family in ``TRAINING_PROBLEMS`` (naming, where the installed transformers
    cannot run its forward either, that reason too: ``TRANSFORMERS_FORWARD_PROBLEMS``), with the fix, before TRL
    builds anything: not an AttributeError at the first step.

    >>> check_trainable("qwen2_5_vl")
    """
    problem = TRAINING_PROBLEMS.get(model_type)
    if problem is None:
        return
    import transformers

    forward = transformers_forward_problem(model_type)
    also = f". On transformers {transformers.__version__} it cannot even run a forward: {forward}" if forward else ""
    first = TRANSFORMERS_FORWARD_PROBLEMS.get(model_type, (None,))[0]
    measure = (f"measure it without training (trl_mdi.attention.measure_modality_attention, exact on transformers "
               f"< {first})" if first else "measure it without training (trl_mdi.attention.measure_modality_attention)")
    raise ValueError(
        f"{model_type!r} cannot be trained with TRL 1.16's GRPOTrainer: {problem}{also}. Fix: none within trl_mdi; "
        f"{measure}, and train a family listed in docs/support_matrix.md until a TRL release can train this one.")
NOT_CHAT_VLMS = {
    "pi0": "PI0 is a vision-language-action policy: it generates robot actions by flow matching, not text completions "
    "to score with rewards",
    "evolla": "Evolla reads protein sequences and structures, not images: it has no image tokens to measure",
}
"""Entries of transformers' image-text-to-text mapping that are no chat vision-language model, and what they are
instead: {model_type: what it is}. ``MDIGRPOTrainer`` refuses them at construction (``check_family``)."""

FAMILY_REFUSALS: dict[str, tuple[frozenset[str], str]] = {
    "cross_attention": (
        frozenset({"mllama", "idefics", "blip"}),
        "its text decoder reads the image through cross-attention layers (keys are image features outside the token "
        "sequence), not through image tokens among its self-attention keys, so an image mass over self-attention "
        "keys would be zero by construction"),
    "encoder_decoder": (
        frozenset({"florence2", "pix2struct", "udop", "t5gemma2", "vision-encoder-decoder", "pp_formulanet"}),
        "it is an encoder-decoder: the image is encoded once and the decoder reaches it only through cross-attention, "
        "so there is no causal completion over image keys to measure"),
    "no_image_tokens": (
        frozenset({"git", "kosmos-2", "kosmos-2.5"}),
        "its image features enter the text sequence without image placeholder ids (GIT prepends them as embeddings; "
        "Kosmos-2 / 2.5 mark them with image_embeds_position_mask), so the probe, which finds image keys by their "
        "placeholder ids, cannot tell them from text"),
    "pixel_values_required": (
        frozenset({"blip-2", "instructblip", "instructblipvideo"}),
        "its forward takes pixel_values as a required argument (its Q-Former's query embeddings are computed in every "
        "call), so a prompt without an image cannot run, and TRL's batches mix prompts with and without images"),
    "not_autoregressive": (
        frozenset({"diffusion_gemma"}),
        "it generates by block diffusion (bidirectional attention inside each block), not token by token, so GRPO's "
        "per-token log-probs and the probe's causal completion queries do not apply"),
}
"""Families whose image attention the probe cannot measure exactly, one entry per reason: {reason key: (model types,
why)}. ``MDIGRPOTrainer`` refuses them at construction (``check_family``); ``python -m fixtures.sweep`` lists them as
"refused at construction" with that message."""


def family_refusal(model_type: str) -> str | None:
    """Why ``MDIGRPOTrainer`` refuses the family ``model_type`` at construction (``NOT_CHAT_VLMS``,
    ``FAMILY_REFUSALS``), or None.

    >>> family_refusal("qwen2_5_vl") is None
    True
    >>> family_refusal("pi0").startswith("'pi0' is not a chat vision-language model")
    True
    """
    if model_type in NOT_CHAT_VLMS:
        return (f"{model_type!r} is not a chat vision-language model: {NOT_CHAT_VLMS[model_type]}, so GRPO with "
                "image-attention metrics does not apply to it")
    for types, why in FAMILY_REFUSALS.values():
        if model_type in types:
            return (f"{model_type!r}: the attention probe cannot measure this family's image attention: {why}. Fix: "
                    "train it with trl.GRPOTrainer (no image-attention metrics), or use a decoder-only VLM whose "
                    "image tokens are self-attention keys (docs/support_matrix.md lists them)")
    return None


def check_family(model_type: str) -> None:
    """ValueError at construction when ``family_refusal(model_type)`` names a reason.

    >>> check_family("llava")
    """
    problem = family_refusal(model_type)
    if problem:
        raise ValueError(problem)
