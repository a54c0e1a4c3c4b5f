"""The language-prior task (`fixtures.synthetic` kind prior_color), its dataset columns, the held-out MDI of greedy
answers, and benchmarks/language_prior.py end to end in its quick mode (the pipeline, not the result)."""

from __future__ import annotations

import collections
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from fixtures import synthetic
from fixtures.synthetic import PRIOR_OBJECTS, generate_synthetic_rows, rows_to_table

ROOT = Path(__file__).resolve().parents[1]


def _shape_colours(row) -> set[tuple[int, int, int]]:
    img = Image.open(io.BytesIO(row["image"]["bytes"])).convert("RGB")
    return {c for _, c in img.getcolors(56 * 56)} - set(synthetic.BACKGROUNDS)


@pytest.mark.parametrize("option_order", ["fixed", "shuffled"])
def test_prior_rows_answer_is_the_image_and_conflicts_are_exact_and_letter_balanced(option_order):
    rows = generate_synthetic_rows(400, split="validation", seed=5, kinds=("prior_color",), conflict_rate=0.5,
                                   option_order=option_order)
    cells = collections.Counter((r["conflict"], r["correct_choice_idx"]) for r in rows)
    # Exactly half conflict rows, and each subset letter-balanced: a letter preference cannot score on either.
    assert cells == {(c, letter): 50 for c in (False, True) for letter in range(4)}
    for row in rows:
        answer = row["choices"][row["correct_choice_idx"]]
        obj = next(o for o in PRIOR_OBJECTS if o in row["question"])
        assert row["prior_answer"] == PRIOR_OBJECTS[obj] and row["prior_answer"] in row["choices"]
        assert row["conflict"] == (answer != row["prior_answer"])
        assert set(row["choices"]) == {"red", "green", "blue", "yellow"}
        if option_order == "fixed":
            assert row["choices"] == ["red", "green", "blue", "yellow"]
    for row in rows[:40]:  # the answer is the drawn colour, on conflict rows too
        assert _shape_colours(row) == {synthetic.COLORS[row["choices"][row["correct_choice_idx"]]]}
    # On conflict rows, which wrong colour the prior names is spread over the other three.
    prior_letters = collections.Counter(r["choices"].index(r["prior_answer"]) for r in rows if r["conflict"])
    assert len(prior_letters) == 4 and min(prior_letters.values()) >= 30


def test_prior_rows_text_predicts_non_conflict_rows_and_the_image_shape_does_not():
    rows = generate_synthetic_rows(200, seed=2, kinds=("prior_color",), conflict_rate=0.2)
    assert sum(r["conflict"] for r in rows) == 40
    # The object's name alone answers every non-conflict row (that is the prior) ...
    by_name = [r["choices"][r["correct_choice_idx"]] == r["prior_answer"] for r in rows]
    assert sum(by_name) == 160
    # ... and only the name: the question names no shape and no colour.
    words = set(synthetic.SHAPES) | set(synthetic.COLORS)
    assert not any(w in r["question"].lower() for r in rows for w in words)


def test_prior_rows_determinism_blank_control_and_labels():
    kwargs = dict(seed=3, kinds={"color": 1, "prior_color": 1}, conflict_rate=0.25)
    rows = generate_synthetic_rows(24, **kwargs)
    assert rows == generate_synthetic_rows(24, **kwargs)
    blank = generate_synthetic_rows(24, blank_images=True, **kwargs)
    for row, ctrl in zip(rows, blank):
        assert {k: v for k, v in ctrl.items() if k != "image"} == {k: v for k, v in row.items() if k != "image"}
        assert _shape_colours(ctrl) == set()
    # Kinds without a prior never conflict and name no prior answer; prior rows: round(0.25 * 12) = 3 conflicts.
    plain = [r for r in rows if r["prior_answer"] is None]
    assert len(plain) == 12 and not any(r["conflict"] for r in plain)
    assert sum(r["conflict"] for r in rows) == 3
    # Unlabelled (test split) rows hide the conflict flag with the label.
    test_rows = generate_synthetic_rows(8, split="test", kinds=("prior_color",))
    assert {(r["conflict"], r["prior_answer"], r["correct_choice_idx"]) for r in test_rows} == {(None, None, None)}
    with pytest.raises(ValueError, match="conflict_rate"):
        generate_synthetic_rows(4, kinds=("prior_color",), conflict_rate=1.5)


def test_prior_rows_keep_the_aokvqa_parquet_schema(tmp_path):
    from trl_mdi.aokvqa import aokvqa_features

    table = rows_to_table(generate_synthetic_rows(8, kinds=("prior_color",)))
    assert table.schema.names == list(aokvqa_features())
    out = synthetic.write_synthetic_aokvqa(str(tmp_path), n_train=8, n_validation=4, n_test=0,
                                           kinds=("prior_color",), conflict_rate=0.5, num_shards=1)
    import pyarrow.parquet as pq

    assert pq.read_schema(out["files"]["train"][0]).names == list(aokvqa_features())


def test_synthetic_dataset_carries_conflict_and_prior_columns():
    from fixtures.warmup import WarmupRecipe, synthetic_dataset

    ds = synthetic_dataset(16, split="validation", kinds=("prior_color",), conflict_rate=0.5)
    assert sum(ds["conflict"]) == 8
    for c, label, prior in zip(ds["conflict"], ds["label_idx"], ds["prior_idx"]):
        assert 0 <= prior < 4 and (label != prior) == c
    plain = synthetic_dataset(4, split="validation")  # the colour kind: no prior
    assert plain["conflict"] == [False] * 4 and plain["prior_idx"] == [-1] * 4
    assert WarmupRecipe(kinds=("prior_color",), conflict_rate=0.05).conflict_rate == 0.05
    with pytest.raises(ValueError, match="conflict_rate"):
        WarmupRecipe(conflict_rate=-0.1)


def test_evaluate_accuracy_measures_the_mdi_of_greedy_answers(tiny_vlm_dir):
    """Per-row MDI of the greedy answers equals the probe run by hand on prompt + answer (up to its end)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from fixtures.warmup import evaluate_accuracy, synthetic_dataset
    from trl_mdi.attention import measure_modality_attention

    model_dir = tiny_vlm_dir("qwen2_vl")
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    processor = AutoProcessor.from_pretrained(model_dir)
    ds = synthetic_dataset(3, split="validation", kinds=("prior_color",))
    r = evaluate_accuracy(model, processor, ds, max_new_tokens=6, measure_attention=True)
    assert set(r.mdi) >= {"all", "late"} and all(len(v) == 3 for v in r.mdi.values())
    plain = evaluate_accuracy(model, processor, ds, max_new_tokens=6)
    assert plain.mdi is None and plain.completions == r.completions  # measuring changes no answer

    # By hand, row 0 alone (no padding): prompt + the answer's tokens up to end-of-sequence.
    from trl.data_utils import prepare_multimodal_messages

    conv = [prepare_multimodal_messages(ds[0]["prompt"], images=[ds[0]["image"]])]
    inputs = processor.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False, suppress_tokens=[model.config.image_token_id],
                         eos_token_id=processor.tokenizer.eos_token_id, pad_token_id=processor.tokenizer.pad_token_id)
    ids = out[:, : inputs["input_ids"].shape[1] + 6]
    completion = torch.zeros_like(ids)
    completion[:, inputs["input_ids"].shape[1]:] = 1
    mm = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    mm = {k: torch.nn.functional.pad(v, (0, ids.shape[1] - v.shape[1])) if k == "mm_token_type_ids" else v
          for k, v in mm.items()}
    ref = measure_modality_attention(model, ids, torch.ones_like(ids), completion, **mm).segment_metrics("thirds")
    assert r.mdi["all"][0] == pytest.approx(ref["all"]["mdi"].item(), rel=1e-4)
    assert r.mean_mdi("late", [0]) == pytest.approx(ref["late"]["mdi"].item(), rel=1e-4)


def _benchmark():
    """benchmarks/language_prior.py as a module (its folder holds the helpers it imports). Importing it sets
    environment defaults for its own runs (offline, warnings, OpenMP): this process's environment is restored."""
    import os

    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    saved = dict(os.environ)
    try:
        import language_prior
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return language_prior


def test_benchmark_variants_configure_the_reliance_forward(tmp_path):
    """Every run computes the reliance signals with the runs' counterfactual (the live reliance/* metrics compare);
    answer_visual_gain reads them; TPRL with the counterfactual as its perturbation shares that forward; with
    --reliance_only_where_read only the variants whose rewards read them compute them."""
    lp = _benchmark()
    _, s = lp.parse_settings([])
    assert s.counterfactual == "black" and s.seeds == (0, 1, 2, 3, 4)
    assert {n: len(s.seeds_for(n)) for n in lp.VARIANTS} == {
        "answer_format": 5, "mdi_balance": 3, "mdi_group": 3, "tprl_perturbation": 3, "tprl_attention": 3,
        "answer_visual_gain": 5, "tprl_counterfactual": 3}
    configs = {n: lp.grpo_config(v, 0, s, tmp_path / n) for n, v in lp.VARIANTS.items()}
    assert all(c.reliance_signals and c.counterfactual_image == "black" for c in configs.values())
    assert configs["answer_visual_gain"].reward_funcs == ["mc_idx", "think_format", "answer_visual_gain"]
    cf = configs["tprl_counterfactual"]
    assert cf.perception_perturbation == "black" and cf.shares_counterfactual_forward
    assert not cf.perception_signal_compare and configs["tprl_perturbation"].perception_signal_compare
    assert not configs["tprl_perturbation"].shares_counterfactual_forward  # VPPO's patch blackening: its own forward

    _, s = lp.parse_settings(["--reliance_only_where_read", "--counterfactual", "black"])
    read = {n for n, v in lp.VARIANTS.items() if lp.grpo_config(v, 0, s, tmp_path / n).reliance_signals}
    assert read == {"answer_visual_gain"}
    assert lp.grpo_config(lp.VARIANTS["tprl_counterfactual"], 0, s, tmp_path / "t").perception_perturbation == "black"
    # TPRL's perturbation must be an image: with the counterfactual "none" the variant is left out of the default
    # list (and the report says so), and asking for it is an error.
    _, s = lp.parse_settings(["--counterfactual", "none"])
    assert "tprl_counterfactual" not in s.variants and len(s.variants) == len(lp.VARIANTS) - 1
    import _language_prior_report as rep

    assert "TPRL with the counterfactual as its perturbation is left out" in rep.budget_line(s, None, [], 2)
    with pytest.raises(SystemExit):
        lp.parse_settings(["--counterfactual", "none", "--variants", "tprl_counterfactual"])


def _run(variant, seed, conflict, plain, clean, auroc=None):
    fin = {"step": 4, "conflict": conflict, "plain": plain, "clean": clean, "prior_follow": 1 - conflict,
           "mdi_all": 1.0, "mdi_late": 1.0}
    run = {"variant": variant, "seed": seed, "evals": [{**fin, "step": 0}, fin], "steps": [], "blank_final": fin,
           "grpo_seconds": 4.0, "load": [1.0]}
    if auroc is not None:
        run["reliance_end"] = {"prompts": 8, "samples": 2, "seconds": 1.0, "labelled": {"rollouts": 10,
                               "prior_following": 4},
                               "kinds": {"black": {"table": {"answer_visual_gain": {"auroc": auroc}},
                                                  "agreement": None, "means": {}}}}
    return run


def test_benchmark_report_pairs_by_seed_and_states_the_goals():
    """The training goal is the paired conflict gain over the baseline (>= +0.10) with non-conflict >= 0.98 and clean
    format >= 0.9; the AUROC goals are read with the runs' counterfactual; every number is the records'."""
    lp = _benchmark()
    import _language_prior_report as rep

    runs = [_run("answer_format", 0, 0.5, 1.0, 1.0, 0.9), _run("answer_format", 1, 0.7, 1.0, 1.0, 0.8),
            _run("answer_visual_gain", 0, 0.7, 1.0, 0.95, 1.0), _run("answer_visual_gain", 1, 0.85, 0.99, 0.95, 1.0),
            _run("mdi_group", 0, 0.9, 0.9, 1.0)]
    groups = rep.by_variant(runs, lp.VARIANTS)
    assert rep.paired(groups, "answer_visual_gain", "conflict") == pytest.approx([0.2, 0.15])
    assert rep.training_goal(groups, "answer_visual_gain") == (True, "met")
    ok, why = rep.training_goal(groups, "mdi_group")
    assert not ok and "non-conflict 0.900 < 0.98" in why and "conflict" not in why.replace("non-conflict", "")
    assert rep.training_goal(groups, "answer_format") is None
    table = "\n".join(rep.accuracy_table(groups, lp.VARIANTS))
    assert "+0.175 ± 0.035 [+0.150–+0.200]" in table and "(baseline)" in table

    _, s = lp.parse_settings([])
    rel = {"kinds": {k: {"table": {"answer_visual_gain": {"auroc": a, "low": a - 0.02, "high": min(1.0, a + 0.02)},
                                   "blind_agrees": {"auroc": b, "low": b - 0.05, "high": min(1.0, b + 0.05)},
                                   "mdi": {"auroc": 0.7, "low": 0.6, "high": 0.8}}}
                     for k, a, b in (("black", 0.7, 0.6), ("grey", 0.99, 0.95), ("none", 0.97, 0.85))}}
    goals = "\n".join(rep.goal_lines(groups, lp.VARIANTS, rel, s))
    assert "answer_visual_gain AUROC ≥ 0.95 with the runs' counterfactual `black` (the trainer's default): warm-up " \
           "0.700 [0.680, 0.720]: NOT met; at the end of the runs 0.925 ± 0.096" in goals
    assert "Kinds meeting both AUROC goals on the warm-up model: `grey`; highest answer_visual_gain AUROC: `grey`" \
           in goals
    assert "MDI (all layers) beside them: AUROC 0.700" in goals
    budget = rep.budget_line(s, 61.0, runs, 2)
    assert "OVER it" in budget and "200 prompts x 4 samples at the end of each run" in budget
    assert "(8 samples would have added about 0.1 min of wall time here)" in budget


@pytest.mark.slow
def test_benchmark_quick_mode_runs_end_to_end_and_resumes(tmp_path):
    """`language_prior.py --quick` trains every variant briefly from a shared warm-up, measures the reliance signals'
    AUROC on the warm-up model under every counterfactual kind and at the end of every run, and reports them with
    the full benchmark's projected time; it writes no RESULTS.md or plot, and a rerun in the same work dir skips
    the finished jobs."""
    from trl_mdi.counterfactual import counterfactual_kinds

    work, results, png = tmp_path / "work", tmp_path / "RESULTS.md", tmp_path / "plot.png"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "language_prior.py"), "--quick", "--work_dir", str(work),
           "--results", str(results), "--png", str(png)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "## Language prior" in proc.stdout and not results.exists() and not png.exists()
    assert "| counterfactual | blind acc. |" in proc.stdout and "Goals (issue 25)" in proc.stdout
    assert "Projected full benchmark (26 jobs on 2 workers" in proc.stdout
    variants = ("answer_format", "mdi_balance", "mdi_group", "tprl_perturbation", "tprl_attention",
                "answer_visual_gain", "tprl_counterfactual")
    signals = {"mdi", "mdi_late", "answer_image_attention", "visual_gain", "answer_visual_gain", "blind_agrees"}
    for name in variants:
        run = json.loads((work / "runs" / f"{name}-s0.json").read_text())
        assert [e["step"] for e in run["evals"]] == [0, 2, 4]
        assert {"conflict", "plain", "clean", "mdi_all", "mdi_late"} <= set(run["evals"][-1])
        assert len(run["steps"]) == 4 and "rewards/mc_idx_reward/zero_spread_frac" in run["steps"][0]
        assert "reliance/blind_agree_rate" in run["steps"][0] and len(run["step_seconds"]) == 4
        end = run["reliance_end"]
        assert (end["prompts"], end["samples"], end["rollouts"]) == (8, 2, 16) and list(end["kinds"]) == ["black"]
        assert set(end["kinds"]["black"]["table"]) == signals and end["labelled"]["rollouts"] > 0
    [warm_file] = work.glob("warmup-reliance-*.json")
    warm = json.loads(warm_file.read_text())
    assert list(warm["kinds"]) == list(counterfactual_kinds()) and warm["rollouts"] == 16
    for kind in warm["kinds"].values():
        assert set(kind["table"]) == signals and kind["agreement"]["n"] > 0
        assert all({"auroc", "low", "high", "within_group_share", "mean_prior", "mean_other"} <= set(row)
                   for row in kind["table"].values())
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("done earlier") == len(variants) + 1 and "reusing" in again.stdout
