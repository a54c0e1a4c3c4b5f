"""The sweep of transformers' image-text-to-text mapping (``python -m fixtures.sweep``, docs/support_matrix.md):
the committed table covers the mapping, every type it calls exact is still exact, and every refusal it lists is what
the trainer's construction raises."""

from __future__ import annotations

import pytest
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from fixtures import sweep
from trl_mdi.attention.model_facts import FAMILY_REFUSALS, NOT_CHAT_VLMS, family_refusal

ROWS = sweep.committed_rows()
EXACT_TYPES = sorted(t for t, (category, _) in ROWS.items() if category in (sweep.EXACT, sweep.EXACT_TRAINS))
# The fast subset `make test` re-runs (about 2 s each on 2 cores): one type per mechanism the probe had to meet beyond
# the TINY_ARCHS families (which tests/test_families.py measures with real images): attention sinks (HunYuan V4's
# s_aux), Inkling 2's per-query sinks, position bias and block attention residuals, a projector with its own
# attention (Aria), multi-head latent attention (Kimi K2.5), M-RoPE with a partial rotary (GLM-4.6V), a sliding window
# the default leaves unset (Step3p7), DeepSeek Sparse Attention's top-k keys with per-layer config overrides (Dots3
# Note; the modeling file leaves the top-k mask to the attention implementation). `make test-e2e` re-runs every
# exact type.
FAST = ("hy_v4_vl", "inkling2", "aria", "kimi_k25", "glm46v", "step3p7", "dots3_note")


def test_the_table_has_one_row_per_type_of_the_mapping():
    assert list(ROWS) == list(sweep.mapping()), "rerun `python -m fixtures.sweep --write` (the mapping changed)"
    assert {category for category, _ in ROWS.values()} <= set(sweep.CATEGORIES)


def test_exact_and_trains_means_a_tiny_builder():
    from fixtures.tiny import TINY_ARCHS

    trains = {t for t, (category, _) in ROWS.items() if category == sweep.EXACT_TRAINS}
    assert trains == set(TINY_ARCHS) & set(ROWS)


def test_the_readme_counts_what_the_table_says():
    """README.md's family and type counts follow the committed table (issue 45: "README's family count follows")."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    trains = sum(category == sweep.EXACT_TRAINS for category, _ in ROWS.values())
    assert re.search(rf"the {trains}\s+families measured exactly and trained", readme), (
        f"README.md should say the {trains} families measured exactly and trained")
    assert f"each of the {len(ROWS)} model types" in readme, f"README.md should say each of the {len(ROWS)} model types"


def _still_exact(model_type):
    from fixtures.tiny import TINY_ARCHS

    row = sweep.sweep_type(model_type, set(TINY_ARCHS))
    assert row.category == ROWS[model_type][0], f"{model_type}: {row.category}: {row.detail}"
    assert row.max_diff is not None and row.max_diff <= sweep.EXACT_TOLERANCE and row.layers


@pytest.mark.parametrize("model_type", FAST)
def test_a_type_the_table_calls_exact_is_still_exact(model_type):
    assert model_type in EXACT_TYPES, f"{model_type} is no longer exact in the committed table: pick another"
    _still_exact(model_type)


@pytest.mark.e2e
@pytest.mark.parametrize("model_type", EXACT_TYPES)
def test_every_type_the_table_calls_exact_is_still_exact(model_type):
    _still_exact(model_type)


@pytest.mark.parametrize("reason", sorted(FAMILY_REFUSALS))
def test_every_refusal_reason_stops_the_trainer_at_construction(reason, tmp_path):
    """One type per reason through ``plan_run`` (what MDIGRPOTrainer.__init__ and the entry point call) with the
    family's default config: a ValueError naming the family and the reason, before any weight."""
    from trl_mdi import MDIGRPOConfig
    from trl_mdi.run_plan import plan_run

    types, why = FAMILY_REFUSALS[reason]
    model_type = sorted(types)[0]
    args = MDIGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(ValueError) as e:
        plan_run("some/checkpoint", None, None, args, {}, model_config=CONFIG_MAPPING[model_type]())
    assert repr(model_type) in str(e.value) and why in str(e.value) and "Fix:" in str(e.value)
    for t in types:  # and the sweep lists each type of the reason as refused, with that message
        assert ROWS[t] == (sweep.REFUSED, " ".join(family_refusal(t).split())), t


@pytest.mark.parametrize("model_type", sorted(NOT_CHAT_VLMS))
def test_entries_that_are_not_chat_vlms_are_refused(model_type, tmp_path):
    from trl_mdi import MDIGRPOConfig
    from trl_mdi.run_plan import plan_run

    args = MDIGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(ValueError, match="is not a chat vision-language model"):
        plan_run("some/checkpoint", None, None, args, {}, model_config=CONFIG_MAPPING[model_type]())
    assert ROWS[model_type][0] == sweep.NOT_CHAT


def test_shrink_keeps_one_layer_of_each_kind():
    config = CONFIG_MAPPING["qwen3_5"]()
    kinds = list(config.text_config.layer_types)
    sweep.shrink_config(config)
    text = config.text_config
    assert set(text.layer_types) == set(kinds) and len(text.layer_types) == text.num_hidden_layers <= 3
    assert text.hidden_size == sweep.HIDDEN and config.vision_config.hidden_size <= sweep.HIDDEN


def test_construction_problem_is_what_the_run_plan_decides():
    """The sweep's refusal column comes from plan_run itself: a text-only entry of the mapping (Mistral 4's causal LM)
    gets the plan's "metrics off" reason, a family the probe measures (Aria, whose projector has its own attention)
    gets none, and a refused family the plan's error."""
    from trl_mdi.run_plan import construction_problem

    text_only, _ = sweep.build_tiny("mistral4")
    assert construction_problem(text_only) == "attention metrics off: a text-only model: no image token"
    aria, _ = sweep.build_tiny("aria")
    assert construction_problem(aria) is None
    aria.config.model_type = "mllama"  # the same modules under a refused family's name: refused from the config
    assert construction_problem(aria) == family_refusal("mllama")
