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
    """``benchmarks.language_prior``. Importing it sets environment defaults for its own runs (offline, warnings,
    OpenMP): this process's environment is restored."""
    import os

    saved = dict(os.environ)
    try:
        from benchmarks import language_prior
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
    from benchmarks import language_prior_report as rep

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
    """The training goal is the paired conflict gain over the baseline (>= +0.10, its 95% t interval above 0) with
    non-conflict >= 0.98 and clean format >= 0.9; the AUROC goals are read with the runs' counterfactual; every
    number is the records'."""
    import math

    lp = _benchmark()
    from benchmarks import language_prior_report as rep

    runs = [_run("answer_format", 0, 0.5, 1.0, 1.0, 0.9), _run("answer_format", 1, 0.7, 1.0, 1.0, 0.8),
            _run("answer_visual_gain", 0, 0.7, 1.0, 0.95, 1.0), _run("answer_visual_gain", 1, 0.85, 0.99, 0.95, 1.0),
            _run("mdi_group", 0, 0.9, 0.9, 1.0)]
    groups = rep.by_variant(runs, lp.VARIANTS)
    assert rep.paired(groups, "answer_visual_gain", "conflict") == pytest.approx([0.2, 0.15])
    # Mean +0.175 >= +0.10 over 2 seeds, but the t interval (df 1: t = tan(0.475 pi) = 12.706, the Cauchy
    # quantile) is 0.175 -+ 12.706 * 0.0354 / sqrt(2): it includes 0, so the goal is not shown (was "met").
    half = math.tan(0.475 * math.pi) * math.sqrt(((0.2 - 0.175) ** 2 + (0.15 - 0.175) ** 2) / 1) / math.sqrt(2)
    low, high = 0.175 - half, 0.175 + half
    assert rep.training_goal(groups, "answer_visual_gain") == (
        False, f"not shown: interval [{low:.3f}, {high:.3f}] includes 0")
    ok, why = rep.training_goal(groups, "mdi_group")
    assert not ok and why == "not shown: 1 paired seed: no interval (needs 2 or more); non-conflict 0.900 < 0.98"
    assert rep.training_goal(groups, "answer_format") is None
    table = "\n".join(rep.accuracy_table(groups, lp.VARIANTS))
    assert f"+0.175 [{low:+.3f}, {high:+.3f}] (2 seeds)" in table and "(baseline)" in table
    assert "| not shown: interval" in table and "| met" not in table
    assert "+0.400 (1 seed, no interval)" in table  # mdi_group, seed 0: 0.9 - 0.5

    _, s = lp.parse_settings([])
    rel = {"kinds": {k: {"table": {"answer_visual_gain": {"auroc": a, "low": a - 0.02, "high": min(1.0, a + 0.02)},
                                   "blind_agrees": {"auroc": b, "low": b - 0.05, "high": min(1.0, b + 0.05)},
                                   "mdi": {"auroc": 0.7, "low": 0.6, "high": 0.8, "n": 12}}}
                     for k, a, b in (("black", 0.7, 0.6), ("grey", 0.99, 0.95), ("none", 0.97, 0.85))}}
    # The development split: `none` meets both goals there and has the highest within-prompt AUROC (the test rows'
    # best, grey, is not chosen: the test rows choose nothing).
    dev = {"kinds": {k: {"table": {"answer_visual_gain": {"auroc": a, "within_auroc": w},
                                   "blind_agrees": {"auroc": b}}}
                     for k, a, w, b in (("black", 0.90, 0.80, 0.80), ("grey", 0.93, 0.85, 0.95),
                                        ("none", 0.96, 0.91, 0.92))}}
    goals = "\n".join(rep.goal_lines(groups, lp.VARIANTS, rel, s, dev))
    assert "answer_visual_gain AUROC ≥ 0.95 with the runs' counterfactual `black` (the trainer's default): warm-up " \
           "0.700 [0.680, 0.720]: NOT met; at the end of the runs 0.925 ± 0.096" in goals
    assert "answer_visual_gain AUROC ≥ 0.95 with the development split's pick `none` (not the runs'): warm-up " \
           "0.970 [0.950, 0.990]: met; not measured at the end of the runs." in goals
    assert "blind_agrees AUROC ≥ 0.90 with the development split's pick `none` (not the runs'): warm-up " \
           "0.850 [0.800, 0.900]: NOT met" in goals
    assert "Kinds meeting both AUROC goals on the development split: `none`." in goals
    assert "grey" not in goals  # the test rows' best is named nowhere as a choice
    assert "MDI (all layers) beside them, test rows: AUROC 0.700 [0.600, 0.800], within-prompt —, on the same " \
           "common set of 12 rollouts" in goals
    # Without a development measurement no kind is picked and no kind is said to meet the goals.
    goals = "\n".join(rep.goal_lines(groups, lp.VARIANTS, rel, s))
    assert "pick" not in goals and "Kinds meeting" not in goals
    # An AUROC whose point estimate meets the goal while its interval reaches below it says so.
    rel["kinds"]["black"]["table"]["answer_visual_gain"] = {"auroc": 0.96, "low": 0.94, "high": 0.98}
    assert "0.960 [0.940, 0.980]: met by the point estimate only (its interval reaches below)" in \
           "\n".join(rep.goal_lines(groups, lp.VARIANTS, rel, s))
    budget = rep.budget_line(s, 61.0, runs, 2)
    assert "OVER it" in budget and "200 prompts x 4 samples at the end of each run" in budget
    assert "(8 samples would have added about 0.1 min of wall time here)" in budget


def test_dev_split_picks_the_kind_by_the_within_prompt_auroc_with_ties_to_the_default():
    """The rule: the highest within-prompt AUROC of answer_visual_gain on the development split at 3 decimals; a tie
    goes to the trainer's default, then to the higher pooled AUROC, then to the earlier kind; a kind without a
    within-prompt AUROC is never picked. The section's choice paragraph names the split, the rule, the ranking, the
    pick, whether the runs use it, and where the fixed settings came from."""
    lp = _benchmark()
    from benchmarks import language_prior_report as rep

    def dev(**kinds):
        return {"kinds": {k: {"table": {"answer_visual_gain": {"within_auroc": w, "auroc": a}}}
                          for k, (w, a) in kinds.items()}, "prompts": 200, "samples": 8, "split": lp.DEV_SPLIT,
                "rows": 798, "excluded": 2}

    assert rep.pick_kind(None, "black") == (None, [])
    pick, ranked = rep.pick_kind(dev(grey=(0.9, 0.99), black=(0.8, 0.9), none=(0.95, 0.5)), "black")
    assert pick == "none" and [k for k, _, _ in ranked] == ["none", "grey", "black"]
    # 0.9004 and 0.8996 are 0.900 at 3 decimals: the default wins, whatever the pooled AUROC says.
    assert rep.pick_kind(dev(grey=(0.9004, 0.99), black=(0.8996, 0.6)), "black")[0] == "black"
    # Neither is the default: the pooled AUROC breaks the tie, then the table order.
    assert rep.pick_kind(dev(grey=(0.9004, 0.7), blur=(0.8996, 0.8)), "black")[0] == "blur"
    assert rep.pick_kind(dev(grey=(0.9, 0.7), blur=(0.9, 0.7)), "black")[0] == "grey"
    # Undefined within-prompt AUROC (None in the JSON record) ranks last and is never the pick.
    pick, ranked = rep.pick_kind(dev(black=(None, 0.99), grey=(0.4, 0.5)), "black")
    assert pick == "grey" and ranked[-1][0] == "black"
    assert rep.pick_kind(dev(black=(None, 0.99)), "black")[0] is None

    _, s = lp.parse_settings([])
    text = "\n".join(rep.selection_lines(dev(grey=(0.9, 0.99), black=(0.8, 0.9)), {"prompts": 200}, s))
    assert f"split `{lp.DEV_SPLIT}`" in text and "800 rows drawn at conflict rate 0.5 less the 2 whose image" in text
    assert "(798 kept)" in text
    assert "Ranking (within-prompt / pooled AUROC of answer_visual_gain): `grey` 0.900 / 0.990, `black` 0.800 / " \
           "0.900." in text
    assert "The development split picks `grey`" in text and "`black` (the trainer's default): it is not the pick" \
           in text
    assert "4:1:1" in text and "ANSWER_GAIN_CLIP` = 4 nats" in text and "120 GRPO steps" in text
    text = "\n".join(rep.selection_lines(dev(grey=(0.8, 0.99), black=(0.9, 0.9)), {"prompts": 200}, s))
    assert "picks `black`" in text and ": it is the pick" in text
    assert "no kind was picked" in "\n".join(rep.selection_lines(None, None, s))


def test_dev_split_shares_no_image_with_the_test_rows_the_pool_or_the_warmup_rows():
    """The development split at the benchmark's full size: no row's image (PNG bytes, hashed here independently of
    the benchmark's `image_keys`) or question id occurs in the 400 test rows, the 2000-row GRPO pool or the 200
    warm-up rows; the rows it dropped are exactly those whose image does; 200 conflict prompts remain."""
    import hashlib

    lp = _benchmark()
    _, s = lp.parse_settings([])
    recipe = lp.prior_recipe()
    kw = dict(kinds=recipe.kinds, option_order=recipe.option_order, image_size=recipe.image_size)
    others = {"test": generate_synthetic_rows(s.n_eval, split="validation", seed=recipe.data_seed,
                                              conflict_rate=s.eval_conflict_rate, **kw),
              "pool": generate_synthetic_rows(s.n_pool, split="train", seed=recipe.data_seed + 1,
                                              conflict_rate=s.pool_conflict_rate, **kw),
              "warm-up": generate_synthetic_rows(recipe.n_train, split="train", seed=recipe.data_seed,
                                                 conflict_rate=recipe.conflict_rate, **kw)}

    def key(row):
        return hashlib.sha256(row["image"]["bytes"]).hexdigest()

    taken = {key(r) for rows in others.values() for r in rows}
    ids = {r["question_id"] for rows in others.values() for r in rows}
    raw = generate_synthetic_rows(s.n_dev, split=lp.DEV_SPLIT, seed=recipe.data_seed,
                                  conflict_rate=s.eval_conflict_rate, **kw)
    kept = [r for r in raw if key(r) not in taken]
    held = lp.HeldOut(s, recipe)
    assert [r["question_id"] for r in others["test"]] == held.ds["question_id"]  # the test rows, as the benchmark's
    dev = lp.dev_split(s, recipe, held)
    assert dev.excluded == len(raw) - len(kept) and dev.ds["question_id"] == [r["question_id"] for r in kept]
    assert not set(dev.ds["question_id"]) & ids
    assert not {key(r) for r in kept} & taken
    assert len(dev.rows["conflict"]) >= s.reliance_prompts
    assert dev.conflict_rows(s.reliance_prompts)["question_id"] == \
        [r["question_id"] for r in kept if r["conflict"]][: s.reliance_prompts]


def test_benchmark_verdict_is_shown_only_with_an_interval_above_zero():
    """Three seeds whose paired differences agree (+0.20, +0.21, +0.22: t interval 0.21 -+ 4.303 * 0.01 / sqrt(3))
    are "shown"; the same mean with differences of both signs is not, and neither is a variant that breaks the
    non-conflict rows; the comparison paragraph names only the interval that excludes 0."""
    lp = _benchmark()
    from benchmarks import language_prior_report as rep

    base = [_run("answer_format", s, c, 1.0, 1.0) for s, c in ((0, 0.5), (1, 0.6), (2, 0.4))]
    good = [_run("answer_visual_gain", s, c, 0.99, 1.0) for s, c in ((0, 0.70), (1, 0.81), (2, 0.62))]
    mixed = [_run("mdi_balance", s, c, 1.0, 1.0) for s, c in ((0, 0.95), (1, 0.50), (2, 0.68))]
    broken = [_run("mdi_group", s, c, 0.9, 1.0) for s, c in ((0, 0.70), (1, 0.81), (2, 0.62))]
    groups = rep.by_variant(base + good + mixed + broken, lp.VARIANTS)
    t_975_df2 = 4.302652729911275  # Student t, 2 degrees of freedom (sqrt(2) * 0.975-quantile identity, tables)
    half = t_975_df2 * 0.01 / 3 ** 0.5
    assert rep.training_goal(groups, "answer_visual_gain") == (True, "shown")
    assert f"+0.210 [{0.21 - half:+.3f}, {0.21 + half:+.3f}] (3 seeds)" in "\n".join(
        rep.accuracy_table(groups, lp.VARIANTS))
    # mdi_balance: differences +0.45, -0.10, +0.28 (mean +0.21, sd 0.2816): the interval includes 0.
    ok, why = rep.training_goal(groups, "mdi_balance")
    assert not ok and why.startswith("not shown: interval [") and why.endswith("] includes 0")
    ok, why = rep.training_goal(groups, "mdi_group")
    assert not ok and why == "not shown: non-conflict 0.900 < 0.98"
    warm = {"eval": {"mdi_all_conflict": 1.0, "mdi_all_plain": 1.0, "conflict": 0.5, "plain": 1.0}}
    text = "\n".join(rep.comparison_lines(groups, lp.VARIANTS, warm))
    assert "Intervals that exclude 0: + mdi_group (4:1:1), + answer_visual_gain (4:1:1)." in text
    assert "better on 2/3" in text and "The baseline's own seed-to-seed sd is 0.100." in text


def test_code_version_reads_commit_dirty_flag_and_a_diff_hash(tmp_path):
    """``code_version``: the commit; clean -> dirty False, diff None; an edited tracked file or a new untracked one
    -> dirty with a diff hash that changes with the edit; ``paths`` limits both; outside git every value None."""
    root, tmp_path = tmp_path, tmp_path / "repo"
    tmp_path.mkdir()
    _benchmark()
    from benchmarks import results

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "a.py").write_text("x = 1\n")
    (tmp_path / "notes.md").write_text("hello\n")
    git("add", ".")
    git("commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert results.code_version(root=tmp_path) == {"commit": head, "dirty": False, "diff": None}
    (tmp_path / "notes.md").write_text("changed\n")
    whole = results.code_version(root=tmp_path)
    assert whole["commit"] == head and whole["dirty"] is True and len(whole["diff"]) == 16
    # Only the code's folder counts: the doc edit leaves it clean.
    assert results.code_version(("code",), root=tmp_path) == {"commit": head, "dirty": False, "diff": None}
    (tmp_path / "code" / "a.py").write_text("x = 2\n")
    first = results.code_version(("code",), root=tmp_path)
    (tmp_path / "code" / "a.py").write_text("x = 3\n")
    second = results.code_version(("code",), root=tmp_path)
    assert first["dirty"] and second["dirty"] and first["diff"] != second["diff"]
    (tmp_path / "code" / "a.py").write_text("x = 1\n")
    (tmp_path / "code" / "new.py").write_text("y = 1\n")  # untracked, not ignored: it can change what runs
    assert results.code_version(("code",), root=tmp_path)["dirty"] is True
    assert results.describe_version(first) == f"commit {head[:7]} + uncommitted changes (diff {first['diff']})"
    assert results.describe_version({"commit": head, "dirty": False, "diff": None}) == f"commit {head[:7]}"
    outside = root / "plain"
    outside.mkdir()
    env_ceiling = subprocess.run(["git", "rev-parse", "HEAD"], cwd=outside, capture_output=True).returncode
    if env_ceiling != 0:  # the temp dir is in no checkout (the usual case): unknown
        assert results.code_version(root=outside) == {"commit": None, "dirty": None, "diff": None}


def test_benchmark_reruns_a_result_from_another_code_version(tmp_path):
    """A stored job is reused only when its fingerprint (settings and code version) matches; the same settings from
    another version, or from before the version was stored, are rerun, or with reuse_other_code reused with a note;
    the section names the jobs that came from another version."""
    lp = _benchmark()
    from benchmarks import language_prior_report as rep

    now = {"commit": "a" * 40, "dirty": True, "diff": "0123456789abcdef"}
    old = {"commit": "b" * 40, "dirty": False, "diff": None}
    path = tmp_path / "run.json"
    assert lp.reusable(path, "k1", now) == (None, "")  # nothing stored
    lp.write_json(path, {"fingerprint": lp.fingerprint("k1", now), "settings_key": "k1", "code_version": now})
    stored, note = lp.reusable(path, "k1", now)
    assert stored["code_version"] == now and note == ""
    assert lp.reusable(path, "k2", now) == (None, "")  # other settings: rerun, nothing to say
    lp.write_json(path, {"fingerprint": lp.fingerprint("k1", old), "settings_key": "k1", "code_version": old})
    stored, note = lp.reusable(path, "k1", now)
    assert stored is None and note == ("the stored result came from commit bbbbbbb, this is commit aaaaaaa + "
                                       "uncommitted changes (diff 0123456789abcdef): rerunning it")
    stored, note = lp.reusable(path, "k1", now, reuse_other_code=True)
    assert stored["code_version"] == old and note == " (from commit bbbbbbb, --reuse_other_code)"
    lp.write_json(path, {"fingerprint": "k1"})  # written before the code version was stored
    assert lp.reusable(path, "k1", now)[0] is None
    assert lp.reusable(path, "k1", now, reuse_other_code=True)[1] == " (from an unrecorded code version, " \
                                                                       "--reuse_other_code)"

    warm = {"code_version": now}
    runs = [{**_run("answer_format", 0, 0.5, 1.0, 1.0), "key": "answer_format-s0", "code_version": now},
            {**_run("answer_format", 1, 0.5, 1.0, 1.0), "key": "answer_format-s1", "code_version": old},
            {**_run("mdi_balance", 0, 0.5, 1.0, 1.0), "key": "mdi_balance-s0"}]
    [line] = rep.code_lines(runs, warm, None, now)
    assert line.startswith("- Code: commit aaaaaaa + uncommitted changes (diff 0123456789abcdef)")
    assert line.endswith("Reused from another version (--reuse_other_code): answer_format-s1: commit bbbbbbb; "
                         "mdi_balance-s0: an unrecorded code version (measured before the version was stored).")
    [line] = rep.code_lines(runs[:1], warm, None, now)
    assert line.endswith("every figure below came from this version.")


def _measurement():
    """A hand-made RelianceMeasurement: 3 conflict prompts x 4 sampled rollouts, one kind, every signal known."""
    from trl_mdi.profile.reference import RelianceMeasurement

    prompts = [{"row": j, "has_image": True, "gold": "A", "answer": "A", "blind": {"black": "D"}, "conflict": True,
                "prior": "D"} for j in range(3)]
    answers = ["A", "D", "A", "D", "A", "A", "D", "B", "D", "D", "A", None]
    gains = [2.0, -0.1, 1.5, 0.2, 3.0, 2.5, 0.1, 0.0, -0.3, 0.4, 1.0, None]
    rollouts = []
    for i, (ans, g) in enumerate(zip(answers, gains)):
        nan = float("nan")
        rollouts.append({"prompt": i // 4, "sample": 1 + i % 4, "completion": f"Answer: {ans}", "answer": ans,
                         "correct": ans == "A", "mdi": 0.9 + 0.01 * i, "mdi_late": 0.8 + 0.02 * (i % 3),
                         "signals": {"black": {"visual_gain": 0.1 * (g or 0.0),
                                               "answer_visual_gain": nan if g is None else g,
                                               "blind_agrees": float(ans == "D")}}})
    return RelianceMeasurement(kinds=["black"], prompts=prompts, rollouts=rollouts, skipped={}, samples=4,
                               seconds=1.5, data_labels=True)


def test_reliance_records_recompute_the_tables_and_use_prompts(tmp_path):
    """The stored per-rollout records rebuild the stored tables exactly (JSON round trip); the table scores every
    signal on the rollouts where all are defined (n 10 of 11 labelled: one has no answer_visual_gain), with the
    within-prompt AUROC computed here by hand over same-prompt pairs."""
    import json as _json

    _benchmark()
    from benchmarks import language_prior_eval as ev

    summary = ev.summarize(_measurement(), n_boot=200, seed=3)
    stored = _json.loads(_json.dumps(summary))
    assert stored["records"]["rollouts"][11]["signals"]["black"]["answer_visual_gain"] is None
    again = ev.recompute(stored)
    assert _json.loads(_json.dumps(again)) == stored
    row = stored["kinds"]["black"]["table"]["answer_visual_gain"]
    # Labelled: answers A (image-following) or D (prior-following); "B" and None are left out -> 10 labelled, and
    # every signal is defined on them (the None answer is also the one without a gain).
    assert (row["n"], row["n_defined"], row["n_prior"]) == (10, 10, 5)
    mdi = stored["kinds"]["black"]["table"]["mdi"]
    assert mdi["n"] == 10 and mdi["n_defined"] == 10 and mdi["resample"] == "prompts"
    # Within-prompt AUROC of answer_visual_gain (prior-following when LOW): per prompt, pairs (prior, image) with
    # the prior one lower win. Prompt 0: prior gains {-0.1, 0.2}, image {2.0, 1.5}: 4/4. Prompt 1: prior {0.1},
    # image {3.0, 2.5}: 2/2. Prompt 2: prior {-0.3, 0.4}, image {1.0}: 2/2 -> 8/8.
    assert row["within_auroc"] == 1.0 and row["within_pairs"] == 8 and row["within_prompts"] == 3
    assert ev.recompute(stored, n_boot=50)["kinds"]["black"]["table"]["mdi"]["auroc"] == mdi["auroc"]
    with pytest.raises(ValueError, match="no per-rollout records"):
        ev.recompute({k: v for k, v in stored.items() if k != "records"})


@pytest.mark.slow
@pytest.mark.e2e
def test_benchmark_quick_mode_runs_end_to_end_and_resumes(tmp_path):
    """`python -m benchmarks.language_prior --quick` trains every variant briefly from a shared warm-up, measures the reliance signals'
    AUROC on the warm-up model under every counterfactual kind and at the end of every run, and reports them with
    the full benchmark's projected time; it writes no RESULTS.md or plot, and a rerun in the same work dir skips
    the finished jobs."""
    from trl_mdi.counterfactual import counterfactual_kinds

    work, results, png = tmp_path / "work", tmp_path / "RESULTS.md", tmp_path / "plot.png"
    cmd = [sys.executable, "-m", "benchmarks.language_prior", "--quick", "--work_dir", str(work),
           "--results", str(results), "--png", str(png)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "## Language prior" in proc.stdout and not results.exists() and not png.exists()
    assert "| counterfactual | blind acc. |" in proc.stdout and "Goals (issue 25)" in proc.stdout
    assert "Projected full benchmark (27 jobs on 2 workers" in proc.stdout
    assert "Development split (the choice of the counterfactual kind" in proc.stdout
    assert "Test rows (the report; nothing chosen on them)" in proc.stdout and "Rule: the highest" in proc.stdout
    variants = ("answer_format", "mdi_balance", "mdi_group", "tprl_perturbation", "tprl_attention",
                "answer_visual_gain", "tprl_counterfactual")
    signals = {"mdi", "mdi_late", "answer_image_attention", "visual_gain", "answer_visual_gain", "blind_agrees"}
    for name in variants:
        run = json.loads((work / "runs" / f"{name}-s0.json").read_text())
        assert [e["step"] for e in run["evals"]] == [0, 2, 4]
        assert {"conflict", "plain", "clean", "mdi_all", "mdi_late"} <= set(run["evals"][-1])
        assert len(run["steps"]) == 4 and "rewards/mc_idx/zero_spread_frac" in run["steps"][0]
        assert "reliance/blind_agree_rate" in run["steps"][0] and len(run["step_seconds"]) == 4
        end = run["reliance_end"]
        assert (end["prompts"], end["samples"], end["rollouts"]) == (8, 2, 16) and list(end["kinds"]) == ["black"]
        assert signals <= set(end["kinds"]["black"]["table"]) and end["labelled"]["rollouts"] > 0
        assert len(end["records"]["rollouts"]) == 16 and run["code_version"]["commit"]
    [warm_file] = [p for p in work.glob("warmup-reliance-*.json") if not p.name.startswith("warmup-reliance-dev-")]
    [dev_file] = work.glob("warmup-reliance-dev-*.json")
    warm, dev = json.loads(warm_file.read_text()), json.loads(dev_file.read_text())
    assert (warm["split"], dev["split"]) == ("validation", "language_prior_dev")
    assert list(warm["kinds"]) == list(counterfactual_kinds()) and warm["rollouts"] == 16
    assert len(warm["records"]["rollouts"]) == 16 and warm["records"]["kinds"] == list(counterfactual_kinds())
    assert list(dev["kinds"]) == list(counterfactual_kinds()) and dev["rollouts"] == 16
    for kind in [*warm["kinds"].values(), *dev["kinds"].values()]:
        assert signals <= set(kind["table"]) and kind["agreement"]["n"] > 0
        assert all({"auroc", "low", "high", "within_group_share", "mean_prior", "mean_other"} <= set(row)
                   for row in kind["table"].values())
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("done earlier") == len(variants) + 2 and "reusing" in again.stdout
