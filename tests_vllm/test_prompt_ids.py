"""The prompt ids the trainer hands vLLM (``trl_mdi.vllm_prompts``), through vLLM 0.31's own multimodal processor: the
step of vLLM's input processing that expands image placeholders, run without an engine on each tiny family's config
and processor.

For each family: what vLLM makes of TRL's processor-expanded ids (longer: the bug, huggingface/trl#6294), of those ids
with each image run collapsed (what the trainer sends), and of the tokenizer-only rendering (where vLLM itself starts,
#6718's route); against the processor's expanded ids, which the trainer scores.
"""

from __future__ import annotations

import pytest

from fixtures.tiny import TINY_ARCHS
from trl_mdi.vllm_prompts import collapse_image_runs, collapse_problem, probe_conversation, rendered_ids

COLLAPSE_EXACT = ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "llava_next",
                  "llava", "llava_onevision"]
COLLAPSE_EXACT += ["glm4v", "qwen3_vl_moe"]  # Mistral 3: [IMG_BREAK] / [IMG_END] inside the run, refused
COLLAPSE_EXACT += ["glm4v_moe"]  # GLM-4.5V: GLM-4.1V's processor and template
# vLLM 0.31's processors for these fail on the tiny models themselves (not on the ids): Gemma 3's and PaliGemma's
# newline handling looks up "\n" in the vocabulary (the tiny byte-level tokenizer has "Ċ" instead: KeyError), Gemma
# 4's reads a vision-config attribute transformers 5.17's Gemma4VisionConfig lacks (default_output_length).
NOT_CHECKABLE = {"gemma3", "gemma4", "paligemma"}
# vLLM 0.31 has no Ovis2ForConditionalGeneration (its registry's "Ovis" is AIDC-AI's remote-code class): no processor to
# run. The trainer refuses Ovis2 under colocate mode anyway (indicator tokens around the run).
NOT_CHECKABLE |= {"ovis2"}
# Gemma 3n: vLLM 0.31's processor looks up "\n" in the vocabulary, as for Gemma 3 above (KeyError on the tiny
# tokenizer). Aya Vision: vLLM 0.31's processor stops with "Failed to apply prompt replacement" on the tiny model
# (seen; its tile labels are single tokens in the tiny tokenizer, which may not hold for the real one: not checked).
# The trainer refuses both under colocate mode anyway (markers around and inside the image run).
NOT_CHECKABLE |= {"gemma3n", "aya_vision"}


def vllm_expand(model_dir, ids, image) -> list[int]:
    """vLLM's prompt ids for ``ids`` with one image, as its input processor makes them (no engine)."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    processor = MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=str(model_dir), dtype="float32",
                                                                 max_model_len=512))
    items = processor.info.get_data_parser().parse_mm_data({"image": image})
    return list(processor.apply(ProcessorInputs(prompt=list(ids), mm_data_items=items), TimingContext())[
        "prompt_token_ids"])


@pytest.fixture(scope="module")
def family(tiny_vlm_dir):
    """arch -> (the saved tiny family, its processor, its image token id)."""
    from transformers import AutoConfig, AutoProcessor

    def get(arch):
        folder = tiny_vlm_dir(arch)
        return folder, AutoProcessor.from_pretrained(folder), AutoConfig.from_pretrained(folder).image_token_id

    return get


@pytest.mark.parametrize("arch", [a for a in TINY_ARCHS if a not in NOT_CHECKABLE])
def test_vllm_expands_what_the_trainer_sends_into_the_scored_prompt(arch, family):
    folder, processor, image_token = family(arch)
    conversation = probe_conversation()
    image = conversation[0]["content"][0]["image"]
    expanded, plain = rendered_ids(processor, conversation)
    collapsed = collapse_image_runs(expanded, image_token)
    # TRL 1.16 as shipped: vLLM expands the expanded ids again.
    assert len(vllm_expand(folder, expanded, image)) > len(expanded)
    # Where vLLM starts: the tokenizer-only rendering becomes exactly the processor's ids, for every family here.
    assert vllm_expand(folder, plain, image) == expanded
    if arch in COLLAPSE_EXACT:
        assert collapse_problem(processor, image_token) is None
        assert vllm_expand(folder, collapsed, image) == expanded
    else:  # Idefics3, SmolVLM, InternVL: the trainer refuses colocate mode (collapse_problem), rightly
        assert collapse_problem(processor, image_token) is not None
        assert vllm_expand(folder, collapsed, image) != expanded
