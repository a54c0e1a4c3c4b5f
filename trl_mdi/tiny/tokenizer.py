"""The tiny models' tokenizer and chat template: parts 1 and 2 of the build described in `trl_mdi.tiny`.

The tokenizer is trained on a fixed synthetic corpus, so a given arch always gets the same tokenizer
files; the chat template is the official one shipped inside trl. Keys are the VLM archs plus "qwen2",
the text-only models' family.

Qwen3.5 (dense and MoE) and Qwen2 checkpoints are reloaded by `AutoTokenizer` as their own tokenizer classes
(transformers overrides the saved class for these model types), which rebuild the pre-tokenizer from
scratch; so for them the trained tokenizer is passed through that class once at build time, and the
tokenizer the model is built with is the one every later load gives.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ..data import DEFAULT_SYSTEM_PROMPT

# The training script's system prompt: the tokenizer corpus includes it so it encodes to few tokens.
SYSTEM_PROMPT = DEFAULT_SYSTEM_PROMPT

# Colour and shape names our synthetic data draws from, and the multiple-choice letters.
COLOURS = tuple("red green blue yellow purple orange black white gray pink brown cyan".split())
SHAPES = tuple("circle square triangle star rectangle diamond hexagon pentagon cross heart".split())
LETTERS = ("A", "B", "C", "D")

# Strings that must encode to exactly one token: the reward parses the answer letter, and a letter
# split over two tokens would make the policy's choice depend on two sampling steps.
SINGLE_TOKEN_STRINGS = (" A", " B", " C", " D", "<think>", "</think>")

# Upper bound on BPE merges. The trainer stops earlier, once every word of the closed synthetic
# vocabulary is a single token, so every arch gets the same merges whatever its special tokens.
_MAX_BPE_MERGES = 320

_QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Idefics3Processor looks up <fake_token_around_image>, <image>, <global-img> and the 6x6
# <row_r_col_c> tags by name when it expands an image; <end_of_utterance> closes each chat turn.
_SMOLVLM_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<end_of_utterance>",
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
)

# Gemma3Processor looks up boi_token (<start_of_image>, what the template writes), eoi_token and
# image_token (<image_soft_token>, the placeholder the model replaces) on the tokenizer by name.
_GEMMA3_SPECIAL_TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
# Gemma 4: Gemma4Processor reads boi/eoi/image tokens (<|image>, <image|>, <|image|>: the template writes
# the last, the processor expands it to <|image> + n x <|image|> + <image|>) and, even without audio,
# boa/eoa (<|audio>, <audio|>) from the tokenizer by name; it adds <|video|> itself (present here, so the
# vocabulary does not grow under the model). The rest are the turn, thinking and tool markers of the template.
_GEMMA4_SPECIAL_TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<|turn>",
    "<turn|>",
    "<|image>",
    "<image|>",
    "<|image|>",
    "<|audio>",
    "<audio|>",
    "<|audio|>",
    "<|video|>",
    "<|think|>",
    "<|channel>",
    "<channel|>",
    "<|tool>",
    "<tool|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
)
# Llama-2 / Mistral style, as in the llava-v1.6-mistral checkpoints; <image> is the placeholder.
_LLAVA_NEXT_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<image>")
# Scaffolding words of the families' templates, trained in so rendered prompts stay short. Only the
# families that need them get them: the corpus (hence the tokenizer) of the older archs is unchanged.
# Gemma 3 and 4 both name the reply turn "model".
_GEMMA_MODEL_ROLE = ("model\n", "model:", "Picture 1: model") * 10
_EXTRA_CORPUS = {
    "gemma3": _GEMMA_MODEL_ROLE,
    "llava_next": ("[INST] What", " [/INST]", " [/INST] Answer", "<<SYS>>\n", "\n<</SYS>>\n\n") * 10,
    "gemma4": _GEMMA_MODEL_ROLE,
}
# The tokenizer class AutoTokenizer loads for these families whatever the saved tokenizer_config says.
_FAMILY_TOKENIZER_CLASSES = {
    "qwen3_5": "Qwen3_5Tokenizer",
    "qwen3_5_moe": "Qwen3_5Tokenizer",
    "qwen2": "Qwen2Tokenizer",
}

# Official templates shipped inside trl. Qwen2-VL has no file of its own: trl's README says Qwen2-VL
# ships a byte-identical template to Qwen2.5-VL, so it reuses qwen2_5_vl.jinja. SmolVLM (an
# Idefics3 model) uses smolvlm.jinja, the template SmolVLM checkpoints ship; idefics3.jinja is the
# Idefics3-8B-Llama3 one and starts with a Llama-3 <|begin_of_text|> token our tokenizer lacks.
_CHAT_TEMPLATE_FILES = {
    "qwen2_5_vl": "qwen2_5_vl.jinja",
    "qwen2_vl": "qwen2_5_vl.jinja",
    "qwen3_vl": "qwen3_vl.jinja",
    "smolvlm": "smolvlm.jinja",
    "qwen3_5": "qwen3_5_nothink.jinja",  # what Qwen3.5-2B and smaller ship: thinking off by default
    "gemma3": "gemma3.jinja",
    "llava_next": "llava_next.jinja",
    # The real Qwen3.5 MoE checkpoints (35B-A3B and up) ship qwen3_5_think.jinja; we keep qwen3_5's template
    # so both Qwen3.5 archs render identical prompts (an empty think block closed in the generation prompt).
    "qwen3_5_moe": "qwen3_5_nothink.jinja",
    # Gemma 4: of trl's five revisions, v2 and v3 print a system message's typed content (what the
    # processor's apply_chat_template passes) as a Python list repr, and v2 also wraps <|image|> in blank
    # lines the processor does not expect; gemma4.jinja, v4 and v5 render system + image + text prompts
    # identically, and gemma4.jinja is the one trl's README calls the original (its gemma4_chat_template).
    "gemma4": "gemma4.jinja",
    "qwen2": "qwen2_5.jinja",  # the text-only models
}


def _synthetic_corpus() -> list[str]:
    """Text that covers our synthetic data's vocabulary; fixed, so the tokenizer never varies.

    The answer letters rotate so " A".." D" are equally frequent; chat-template scaffolding words
    (system, user, Assistant, ...) are included so rendered prompts stay short.
    """
    lines = [SYSTEM_PROMPT] * 20
    # Role names open a line in both templates ("<|im_start|>assistant", "Assistant:"), so they are
    # trained both at the start of a sequence and after a space.
    for role in ("system", "user", "assistant", "System", "User", "Assistant"):
        lines += [f"{role}\n", f"{role}:", f"Picture 1: {role}"] * 10
    lines += ["0 1 2 3 4 5 6 7 8 9"] * 10
    for i, colour in enumerate(COLOURS):
        for j, shape in enumerate(SHAPES):
            letter = LETTERS[(i + j) % 4]
            count = (i * 3 + j) % 9 + 1
            options = "\n".join(f"{LETTERS[k]}. {COLOURS[(i + k) % len(COLOURS)]}" for k in range(4))
            lines += [
                f"What colour is the {shape} in the image?\n{options}",
                f"What color is the shape? What shape is in the image? It is a {colour} {shape}.",
                f"How many shapes are in the image? How many {colour} {shape}s are there? {count}",
                f"<think>The {shape} is {colour}. There are {count} shapes.</think>\nAnswer: {letter}",
                f"Answer: {letter}. The answer is {letter}, not {LETTERS[(i + j + 1) % 4]}.",
            ]
    return lines


def _train_bpe(special_tokens: tuple[str, ...], extra_corpus: tuple[str, ...] = ()) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # GPT-2 style byte-level pre-tokenization: every byte has a token, so nothing is ever unknown.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=len(special_tokens) + len(pre_tokenizers.ByteLevel.alphabet()) + _MAX_BPE_MERGES,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus() + list(extra_corpus), trainer)
    # Not special: decode(skip_special_tokens=True) must keep them, the format reward reads them.
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ("<think>", "</think>")])
    return tok


def build_tokenizer(arch: str, chat_template: str, model_max_length: int) -> PreTrainedTokenizerFast:
    if arch == "smolvlm":
        tok = PreTrainedTokenizerFast(
            tokenizer_object=_train_bpe(_SMOLVLM_SPECIAL_TOKENS),
            bos_token="<|im_start|>",  # the template writes it; nothing adds it automatically
            eos_token="<end_of_utterance>",
            pad_token="<|endoftext|>",
            unk_token=None,
            padding_side="left",
            clean_up_tokenization_spaces=False,
            # Idefics3Processor registers <fake_token_around_image>, <image> and <end_of_utterance>
            # as the extra special tokens itself (replacing any list given here).
        )
    elif arch == "gemma3":
        tok = _gemma_tokenizer(
            "gemma3",
            _GEMMA3_SPECIAL_TOKENS,
            "<end_of_turn>",
            {
                "boi_token": "<start_of_image>",
                "eoi_token": "<end_of_image>",
                "image_token": "<image_soft_token>",
            },
        )
    elif arch == "gemma4":
        tok = _gemma_tokenizer(
            "gemma4",
            _GEMMA4_SPECIAL_TOKENS,
            "<turn|>",
            {
                "image_token": "<|image|>",
                "boi_token": "<|image>",
                "eoi_token": "<image|>",
                "audio_token": "<|audio|>",
                "boa_token": "<|audio>",
                "eoa_token": "<audio|>",
            },
        )
    elif arch == "llava_next":
        tok = PreTrainedTokenizerFast(
            tokenizer_object=_train_bpe(_LLAVA_NEXT_SPECIAL_TOKENS, _EXTRA_CORPUS["llava_next"]),
            bos_token="<s>",
            eos_token="</s>",
            pad_token="<pad>",
            unk_token="<unk>",
            add_bos_token=True,  # as the Llama/Mistral tokenizers do: the template does not write <s>
            padding_side="left",
            clean_up_tokenization_spaces=False,
            extra_special_tokens={"image_token": "<image>"},  # LlavaNextProcessor reads tokenizer.image_token
        )
    else:
        tok = PreTrainedTokenizerFast(
            tokenizer_object=_train_bpe(_QWEN_SPECIAL_TOKENS),
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            unk_token=None,
            padding_side="left",
            clean_up_tokenization_spaces=False,
            # Named model-specific tokens become tokenizer.image_token(_id) etc.; the Qwen processors
            # read image_token/video_token/vision_start_token/vision_end_token, the notes' spelling
            # vision_bos_token/vision_eos_token is what the Omni processors read.
            extra_special_tokens={
                "image_token": "<|image_pad|>",
                "video_token": "<|video_pad|>",
                "vision_start_token": "<|vision_start|>",
                "vision_end_token": "<|vision_end|>",
                "vision_bos_token": "<|vision_start|>",
                "vision_eos_token": "<|vision_end|>",
            },
        )
    tok.chat_template = chat_template
    tok.model_max_length = model_max_length
    if arch in _FAMILY_TOKENIZER_CLASSES:
        tok = _as_family_class(tok, _FAMILY_TOKENIZER_CLASSES[arch])
    for text in SINGLE_TOKEN_STRINGS:
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) != 1:  # a corpus edit broke the invariant: fail at build time, not in training
            raise RuntimeError(
                f"tiny tokenizer splits {text!r} into {len(ids)} tokens; extend _synthetic_corpus"
            )
    return tok


def _gemma_tokenizer(
    arch: str, special_tokens: tuple[str, ...], eos_token: str, extra_special_tokens: dict[str, str]
) -> PreTrainedTokenizerFast:
    """Gemma 3 and 4 spell their <bos>/<pad>/<unk> alike and differ in the end-of-turn token and the image tokens."""
    return PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(special_tokens, _EXTRA_CORPUS[arch]),
        bos_token="<bos>",  # the template writes it, so nothing adds it automatically
        eos_token=eos_token,  # what ends a model turn; <eos> stays in the vocabulary
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
        extra_special_tokens=extra_special_tokens,
    )


def _as_family_class(tok: PreTrainedTokenizerFast, class_name: str):
    """Save `tok` and load it back as `class_name`, exactly as `AutoTokenizer` will load the saved model."""
    with tempfile.TemporaryDirectory(prefix="tiny-tokenizer-") as tmp:
        tok.save_pretrained(tmp)
        return getattr(transformers, class_name).from_pretrained(tmp)


def official_chat_template(arch: str) -> str:
    # Located without importing trl (a multi-second import) so the CLI stays quick.
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("trl is not installed; the tiny VLMs take their chat templates from it")
    path = Path(next(iter(spec.submodule_search_locations))) / "chat_templates" / _CHAT_TEMPLATE_FILES[arch]
    return path.read_text(encoding="utf-8")
