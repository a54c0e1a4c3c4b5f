"""trl_mdi.vllm_prompts: the prompt ids vLLM's colocated engine is handed (huggingface/trl#6294), on every tiny family's
real processor, without vLLM. The engine-side check (vLLM runs exactly the prompt the trainer scores, log-probs equal
the policy's) is tests_vllm/test_colocate.py::test_the_engine_generates_from_the_trainers_prompt."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
from trl import GRPOConfig, GRPOTrainer

from fixtures.testing import shape_image
from fixtures.tiny import TINY_ARCHS, build_tiny_vlm
from trl_mdi.attention.model_facts import model_facts, processor_for_trl
from trl_mdi.trainer import MDIGRPOTrainer
from trl_mdi.vllm_prompts import (
    TRL_ISSUE,
    check_vllm_prompts,
    collapse_image_runs,
    collapse_problem,
    engine_prompt_ids,
)

# Families whose processor expands an image placeholder into a run of that one token, so collapsing the run gives the
# ids vLLM starts from; the others add tokens around the run (Gemma 3 / 4: begin / end of image and newlines; Idefics3
# and SmolVLM: tile markers; InternVL: <img> ... </img>). Checked against vLLM 0.31's own multimodal processor
# (.venv-vllm, tests_vllm/test_prompt_ids.py): for these, vLLM expands the collapsed ids into exactly the processor's
# ids; it expands the processor's ids into more.
COLLAPSE_EXACT = {"qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "llava_next",
                  "llava", "llava_onevision"}
# GLM-4.1V: its template writes <|begin_of_image|> and <|end_of_image|> around the placeholder, so they are in the
# tokenizer-only rendering too; Qwen3-VL-MoE: Qwen3-VL's processor. Mistral 3's processor adds [IMG_BREAK] / [IMG_END]
# inside the image's tokens: not exact, refused.
COLLAPSE_EXACT |= {"glm4v", "qwen3_vl_moe"}
COLLAPSE_EXACT |= {"glm4v_moe"}  # GLM-4.5V: GLM-4.1V's processor and template
assert COLLAPSE_EXACT < set(TINY_ARCHS)


def test_collapse_image_runs_keeps_one_token_per_run():
    assert collapse_image_runs([5, 9, 9, 9, 9, 6, 9, 7, 9, 9], image_token_id=9) == [5, 9, 6, 9, 7, 9]
    assert collapse_image_runs([9, 9], image_token_id=9) == [9]
    assert collapse_image_runs([1, 2, 3], image_token_id=9) == [1, 2, 3]
    assert collapse_image_runs([], image_token_id=9) == []


@pytest.fixture(scope="module")
def processors():
    built = {}

    def get(arch):
        if arch not in built:
            model, processor = build_tiny_vlm(arch)
            # As the trainer hands the processor to TRL (Ovis2's needs image tensors: model_facts.IMAGE_TENSORS_FOR_TRL).
            built[arch] = (processor_for_trl(processor), model_facts(model.config, processor))
        return built[arch]

    return get


def conversations():
    """A batch as TRL renders it: one image, two images of different sizes, no image."""
    def user(text, images):
        return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                             {"type": "text", "text": text}]}]

    return [user("What colour is the shape?", [shape_image(56, 1)]),
            user("Compare the two pictures.", [shape_image(56, 2), shape_image(84, 3)]),
            user("Name a colour.", [])]


def tokenizer_only(processor, conversation) -> list[int]:
    """What vLLM starts from: the chat-templated text through the tokenizer alone, special tokens as the processor
    adds them (BOS unless the template wrote it)."""
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    bos = processor.tokenizer.bos_token
    return processor.tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_engine_ids_are_the_tokenizer_only_rendering_where_collapsing_is_exact(arch, processors):
    processor, facts = processors(arch)
    # PaliGemma takes no prompt without an image (the trainer refuses such rows): its batch has none.
    batch = conversations()[: 2 if facts.image_in_every_prompt else 3]
    # TRL's _tokenize_prompts: one batched processor call (text-only rows carry no image blocks).
    expanded = processor.apply_chat_template(batch, add_generation_prompt=True, tokenize=True, return_dict=True,
                                             padding=True)
    rows = [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(expanded["input_ids"],
                                                                    expanded["attention_mask"])]
    image_token = facts.image_token_ids[0]
    assert all(image_token in row for row in rows[:2]) and all(image_token not in row for row in rows[2:])
    engine = engine_prompt_ids(rows, image_token)
    expected = [tokenizer_only(processor, c) for c in batch]
    assert engine[2:] == rows[2:] == expected[2:]  # the text-only row is untouched
    if arch in COLLAPSE_EXACT:
        assert engine == expected
        assert [row.count(image_token) for row in engine[:2]] == [1, 2]
        assert collapse_problem(processor, image_token) is None
    else:
        assert engine[:2] != expected[:2]
        problem = collapse_problem(processor, image_token)
        assert problem is not None and "more than a run of one token" in problem


def vllm_args(**kw):
    return SimpleNamespace(**{"use_vllm": True, "vllm_mode": "colocate", "chat_template_kwargs": None, **kw})


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_colocate_mode_is_refused_where_collapsing_is_not_exact(arch, processors):
    processor, facts = processors(arch)
    for args in (vllm_args(use_vllm=False), vllm_args(vllm_mode="server")):  # nothing to fix in either
        check_vllm_prompts(args, processor, facts)
    if arch in COLLAPSE_EXACT:
        check_vllm_prompts(vllm_args(), processor, facts)
        return
    with pytest.raises(ValueError) as err:
        check_vllm_prompts(vllm_args(), processor, facts)
    message = str(err.value)
    assert repr(facts.model_type) in message and TRL_ISSUE in message and "use_vllm=False" in message


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_trainer_refuses_idefics3_under_vllm_colocate_before_loading_vllm(tiny_vlm_dir, tmp_path):
    """At construction, before TRL starts (so before any vLLM import: the main environment has none)."""
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", use_vllm=True, vllm_mode="colocate",
                      per_device_train_batch_size=2, num_generations=2)
    with mock.patch.object(GRPOTrainer, "__init__", side_effect=AssertionError("TRL was built")):
        with pytest.raises(ValueError, match=r"'idefics3'.*huggingface/trl#6294"):
            MDIGRPOTrainer(str(tiny_vlm_dir("idefics3")), reward_funcs=[zero_reward], args=args)


def test_the_trainer_hands_the_engine_collapsed_ids_and_keeps_its_own(processors):
    """MDIGRPOTrainer._generate_single_turn under colocate mode calls TRL's with one placeholder per image, and drops
    the engine's cached image features exactly when TRL is about to sync the weights (step moved since the last
    sync); in server mode, or without vLLM, it calls TRL's with TRL's ids and touches no engine (server mode places
    features on the expanded runs)."""
    _, facts = processors("qwen2_5_vl")
    token = facts.image_token_ids[0]
    ids = [[1, token, token, token, 2], [3, 4]]
    cases = [(vllm_args(), 3, 2, [[1, token, 2], [3, 4]], 1), (vllm_args(), 3, 3, [[1, token, 2], [3, 4]], 0),
             (vllm_args(vllm_mode="server"), 3, 2, ids, 0), (vllm_args(use_vllm=False), 3, 2, ids, 0)]
    for args, step, last_synced, sent, resets in cases:
        trainer = mock.Mock(spec=MDIGRPOTrainer)  # super() inside the method needs an MDIGRPOTrainer
        trainer.args, trainer.run_plan = args, SimpleNamespace(facts=facts)
        trainer.state, trainer._last_loaded_step = SimpleNamespace(global_step=step), last_synced
        trainer.vllm_generation = mock.Mock()
        with mock.patch.object(GRPOTrainer, "_generate_single_turn", return_value=("c", "l")) as trl:
            out = MDIGRPOTrainer._generate_single_turn(trainer, ids, ["imgs"], {"f": 1}, 4)
        assert out == ("c", "l")
        assert trl.call_args.args == (sent, ["imgs"], {"f": 1}, 4)  # the rest as TRL passed it
        assert trainer.vllm_generation.llm.llm_engine.reset_encoder_cache.call_count == resets, (args, step)
    assert ids == [[1, token, token, token, 2], [3, 4]]  # TRL's own list untouched


def test_llama4_colocate_mode_is_refused(processors):
    """Llama 4's processor writes <|image_start|>, the <|image|> marker and <|image_end|> around each run of <|patch|>
    (the model's image token): collapsing the run is not exact, so colocate mode is refused at construction. Run on
    every transformers, also where Llama 4 is no TINY_ARCHS family (transformers 5.24: its forward fails, and the
    trainer refuses it before this check)."""
    processor, facts = processors("llama4")
    assert facts.image_token_ids[0] == processor.tokenizer.convert_tokens_to_ids("<|patch|>")
    problem = collapse_problem(processor, facts.image_token_ids[0])
    assert problem is not None and "more than a run of one token" in problem
    with pytest.raises(ValueError, match=r"'llama4'.*huggingface/trl#6294.*use_vllm=False"):
        check_vllm_prompts(vllm_args(), processor, facts)
