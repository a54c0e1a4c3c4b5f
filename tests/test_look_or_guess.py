"""The look-or-guess task (issue 30): the `look_or_guess` kind of `fixtures.synthetic`, its two reasoning styles and
their reader, the warm-up recipe that redraws each row's style every epoch (`fixtures.warmup.LookOrGuessRecipe`),
the figures of the look-or-guess benchmark (benchmarks/look_or_guess_*.py) on handmade rollouts, and a short warm-up that writes both styles."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from benchmarks import look_or_guess_evaluation as lg_eval
from benchmarks import look_or_guess_report as lg_report
from benchmarks import look_or_guess_runs as lg_runs
from benchmarks import look_or_guess_task as lg_task
from benchmarks import look_or_guess_variants as lg_variants
from fixtures.synthetic import PRIOR_OBJECTS, generate_synthetic_rows
from fixtures.synthetic.look_or_guess import (
    GUESS,
    LOOK,
    MAX_COMPLETION_LENGTH,
    OTHER,
    Reasoning,
    check_equal_lengths,
    read_reasoning,
    read_style,
    style_target,
    style_token_counts,
)
from fixtures.warmup import (
    LookOrGuessRecipe,
    WarmupRecipe,
    look_or_guess_sft_dataset,
    style_plan,
    synthetic_dataset,
)

ROOT = Path(__file__).resolve().parents[1]
NEW_FIELDS = ("object", "drawn_color", "usual_color")


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from fixtures.tiny import build_tiny_vlm
    from fixtures.warmup import DEFAULT_MODEL_SIZE

    _, processor = build_tiny_vlm("qwen2_vl", seed=0, **DEFAULT_MODEL_SIZE)  # the warm-up's model
    return processor.tokenizer


# ------------------------------------------------------------------------------------------------------ rows


def test_rows_are_the_prior_color_rows_plus_what_either_target_needs():
    args = dict(split="validation", seed=3, conflict_rate=0.5, option_order="fixed")
    prior = generate_synthetic_rows(80, kinds=("prior_color",), **args)
    rows = generate_synthetic_rows(80, kinds=("look_or_guess",), **args)
    # Same draws: every prior_color field is equal, row for row (ids, questions, images, labels, conflicts).
    assert [{k: v for k, v in r.items() if k not in NEW_FIELDS} for r in rows] == prior
    assert not any(f in r for r in prior for f in NEW_FIELDS)  # the existing kind's rows gained nothing
    for r in rows:
        answer = r["choices"][r["correct_choice_idx"]]
        assert r["object"] in r["question"] and r["object"] in PRIOR_OBJECTS
        assert r["drawn_color"] == answer
        assert r["usual_color"] == PRIOR_OBJECTS[r["object"]] == r["prior_answer"]
        assert r["conflict"] == (r["drawn_color"] != r["usual_color"])
    # Exactly half conflict rows, letter-balanced on both subsets (rule 2 of fixtures.synthetic).
    cells = collections.Counter((r["conflict"], r["correct_choice_idx"]) for r in rows)
    assert cells == {(c, letter): 10 for c in (False, True) for letter in range(4)}


def test_unlabelled_rows_hide_the_colours_but_keep_the_object():
    rows = generate_synthetic_rows(8, split="test", kinds=("look_or_guess",))
    assert all(r["drawn_color"] is None and r["usual_color"] is None and r["object"] in r["question"] for r in rows)


def test_dataset_columns_for_the_kind_only():
    ds = synthetic_dataset(12, kinds=("look_or_guess", "color"), conflict_rate=0.5)
    by_kind = collections.Counter(o is None for o in ds["object"])
    assert by_kind == {False: 6, True: 6}  # colour rows carry the columns, as None
    for o, d, ans, u, p, choices in zip(ds["object"], ds["drawn_color"], ds["answer"], ds["usual_color"],
                                        ds["prior_idx"], ds["choices"]):
        if o is not None:
            assert d == ans and u == choices[p] == PRIOR_OBJECTS[o]
    assert "object" not in synthetic_dataset(4, kinds=("prior_color",)).column_names


# ---------------------------------------------------------------------------------------------------- styles


def test_targets_answer_from_their_reasoning():
    choices = ["red", "green", "blue", "yellow"]
    # A conflict row: a banana drawn blue. Look reads blue (C, right); guess recalls yellow (D, the prior).
    assert style_target(LOOK, "banana", "blue", choices) == "<think> the shape in the image is blue</think>\nAnswer: C"
    assert style_target(GUESS, "banana", "blue", choices) == "<think> a banana is yellow</think>\nAnswer: D"
    assert style_target(LOOK, "sky", "blue", choices[::-1]).endswith("Answer: B")  # the letter follows the options
    with pytest.raises(ValueError, match="style must be one of"):
        style_target("stare", "sky", "blue", choices)
    with pytest.raises(ValueError, match="not among the choices"):
        style_target(GUESS, "sky", "red", ["red", "green", "purple", "yellow"])


def test_both_styles_are_the_same_number_of_tokens_for_each_object(tiny_tokenizer):
    counts = check_equal_lengths(tiny_tokenizer)
    # Counted by hand from the tiny tokenizer: <think> + " a" + the name + " is" + colour + </think> "\n" "Answer"
    # ":" " X" = 10 tokens + the name's pieces (" tomato" 6, " grass" 4, " sky" 3, " banana" 4).
    name_pieces = {obj: len(tiny_tokenizer(" " + obj, add_special_tokens=False)["input_ids"]) for obj in PRIOR_OBJECTS}
    assert name_pieces == {"tomato": 6, "grass": 4, "sky": 3, "banana": 4}
    assert counts == {obj: {LOOK: 9 + n, GUESS: 9 + n} for obj, n in name_pieces.items()}
    assert max(n for c in counts.values() for n in c.values()) + 1 <= MAX_COMPLETION_LENGTH  # + the end token
    # Any drawn colour: every colour word is one token, so a conflict row's look target is as long.
    for obj in PRIOR_OBJECTS:
        for colour in ("red", "green", "blue", "yellow"):
            text = style_target(LOOK, obj, colour, ["red", "green", "blue", "yellow"])
            assert len(tiny_tokenizer(text, add_special_tokens=False)["input_ids"]) == counts[obj][GUESS]


def test_uneven_lengths_are_an_error():
    class CharTokenizer:  # one token per character: the styles' lengths differ
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(range(len(text)))}

    # "<think>" 7 + " the shape here is blue" 23 | " a sky is blue" 14, + "</think>" 8 + "\nAnswer: C" 10
    assert style_token_counts(CharTokenizer(), ["sky"]) == {"sky": {LOOK: 48, GUESS: 39}}
    with pytest.raises(ValueError, match="differ in length"):
        check_equal_lengths(CharTokenizer())


@pytest.mark.parametrize("text, expected", [
    ("<think> the shape is red</think>\nAnswer: A", Reasoning(LOOK, "red")),
    ("<think> the shape in the image here is blue</think>\nAnswer: C", Reasoning(LOOK, "blue")),
    ("<think> the shape here is yellow</think>", Reasoning(LOOK, "yellow")),  # no answer line: still a look
    ("  <think> the shape in the image is purple</think>\nAnswer: B", Reasoning(LOOK, "purple")),
    ("<think> a tomato is red</think>\nAnswer: A", Reasoning(GUESS, "red", "tomato")),
    ("<think> a sky is green</think>\nAnswer: B", Reasoning(GUESS, "green", "sky")),  # a wrong recollection
    ("<think> an banana is yellow</think>\nAnswer: D", Reasoning(GUESS, "yellow", "banana")),
    ("<think> the shape is tomato</think>\nAnswer: A", Reasoning(OTHER)),  # not a colour
    ("<think> a circle is red</think>\nAnswer: A", Reasoning(OTHER)),  # not an object with a usual colour
    ("<think> the shape is in the image red</think>\nAnswer: A", Reasoning(OTHER)),
    ("<think> the shape is red and a tomato is red</think>\nAnswer: A", Reasoning(OTHER)),
    ("<think> image</think>\nAnswer: A", Reasoning(OTHER)),  # the language-prior warm-up's constant text
    ("Answer: A <think> the shape is red</think>", Reasoning(OTHER)),  # the block must open the completion
    ("<think> the shape is red", Reasoning(OTHER)),  # never closed
    ("", Reasoning(OTHER)),
])
def test_read_reasoning_on_handmade_texts(text, expected):
    assert read_reasoning(text) == expected
    assert read_style(text) == expected.style


# ------------------------------------------------------------------------------------------------- warm-up


def test_style_plan_is_seeded_redrawn_every_epoch_and_independent_of_the_row():
    plan = style_plan(400, 6, seed=0)
    assert plan == style_plan(400, 6, seed=0)
    assert plan != style_plan(400, 6, seed=1)
    assert all(plan[e] != plan[e + 1] for e in range(5))
    rows = synthetic_dataset(400, kinds=("look_or_guess",), conflict_rate=0.5)
    conflict = rows["conflict"]
    looks = [s == LOOK for epoch in plan for s in epoch]
    assert 0.47 <= sum(looks) / len(looks) <= 0.53  # 2400 draws at 1/2: sd 0.01
    # A row's style in one epoch says nothing about the next: agreement between epochs near 1/2, not 1.
    agree = sum(a == b for e in range(5) for a, b in zip(plan[e], plan[e + 1])) / (5 * 400)
    assert 0.45 <= agree <= 0.55
    # ... nor about the row: conflict and non-conflict rows look alike often.
    by_kind = [sum(plan[e][i] == LOOK for e in range(6) for i in range(400) if conflict[i] == c) / 1200
               for c in (False, True)]
    assert abs(by_kind[0] - by_kind[1]) < 0.06
    assert all(s == GUESS for s in style_plan(50, 1, look_share=0.0)[0])
    assert all(s == LOOK for s in style_plan(50, 1, look_share=1.0)[0])


def test_sft_dataset_has_one_block_per_epoch_with_that_epochs_styles():
    rows = synthetic_dataset(24, kinds=("look_or_guess",), conflict_rate=0.5, seed=2)
    sft = look_or_guess_sft_dataset(rows, 3, seed=5)
    assert len(sft) == 72 and set(sft.column_names) == {"prompt", "image", "completion"}
    plan = style_plan(24, 3, seed=5)
    texts = [c[0]["content"] for c in sft["completion"]]
    pairs = [(str(p[-1]["content"]), t) for p, t in zip(sft["prompt"], texts)]
    for epoch in range(3):
        # Every row once per epoch, with the style drawn for it in that epoch (its target exactly style_target's) ...
        expected = [(str(rows[i]["prompt"][-1]["content"]),
                     style_target(plan[epoch][i], rows[i]["object"], rows[i]["drawn_color"], rows[i]["choices"]))
                    for i in range(24)]
        block = pairs[24 * epoch: 24 * (epoch + 1)]
        assert sorted(block) == sorted(expected)
        assert block != expected  # ... in a shuffled order
        assert [read_style(t) for _, t in expected] == plan[epoch]
    assert texts[:24] != texts[24:48]  # the SFT data differ between epochs


def test_recipe_guards():
    with pytest.raises(ValueError, match="use LookOrGuessRecipe"):
        WarmupRecipe(kinds=("look_or_guess",))
    with pytest.raises(ValueError, match="whole epochs"):
        LookOrGuessRecipe(epochs=2.5)
    with pytest.raises(ValueError, match="look_share"):
        LookOrGuessRecipe(look_share=1.5)
    with pytest.raises(ValueError, match="one look-or-guess kind"):
        LookOrGuessRecipe(kinds=("look_or_guess", "color"))
    with pytest.raises(ValueError, match="use LookOrGuessRecipe"):
        WarmupRecipe(kinds=("look_or_guess_long",))
    assert LookOrGuessRecipe(kinds=("look_or_guess_long",)).kinds == ("look_or_guess_long",)
    r = LookOrGuessRecipe()
    assert (r.n_train, r.conflict_rate, r.epochs, r.kinds) == (400, 0.5, 8.0, ("look_or_guess",))


# ------------------------------------------------------------------------------ the benchmark's figures


def _rollout(prompt, style, conflict, answer, *, named, gold, prior, clean=True, gains=None, ids=None):
    return {"prompt": prompt, "sample": 1, "style": style, "conflict": conflict, "answer": answer,
            "follows": answer is not None and answer == named, "correct": answer == gold,
            "answers_prior": answer == prior, "clean": clean, "gains": gains, "ids": ids}


def test_style_metrics_on_handmade_rollouts():
    rs = [
        # prompt 0, conflict (gold B, prior A): look right, look wrong, guess on the prior, other
        _rollout(0, LOOK, True, "B", named="B", gold="B", prior="A"),
        _rollout(0, LOOK, True, "C", named="A", gold="B", prior="A"),  # reasoning named A, answered C
        _rollout(0, GUESS, True, "A", named="A", gold="B", prior="A"),
        _rollout(0, OTHER, True, None, named=None, gold="B", prior="A", clean=False),
        # prompt 1, non-conflict (gold D = prior): guesses only
        _rollout(1, GUESS, False, "D", named="D", gold="D", prior="D"),
        _rollout(1, GUESS, False, "D", named="D", gold="D", prior="D"),
    ]
    m = lg_task.style_metrics(rs)
    assert (m["rollouts"], m["prompts"]) == (6, 2)
    assert m["all"]["look_rate"] == pytest.approx(2 / 6) and m["all"]["other_rate"] == pytest.approx(1 / 6)
    assert m["conflict"]["look_rate"] == 0.5 and m["plain"]["guess_rate"] == 1.0
    assert m["both_styles"] == 0.5 and m["both_styles_conflict"] == 1.0 and m["both_styles_plain"] == 0.0
    assert m["conflict"][LOOK] == {"n": 2, "follows": 0.5, "accuracy": 0.5, "answers_prior": 0.0}
    assert m["conflict"][GUESS]["answers_prior"] == 1.0 and m["conflict"][GUESS]["accuracy"] == 0.0
    assert m["all"]["clean"] == pytest.approx(5 / 6)
    # Conflict accuracy 1/4 = look 0.5 x 0.5 + guess 0.25 x 0 + other 0.25 x 0.
    d = m["conflict_decomposition"]
    assert m["conflict"]["accuracy"] == 0.25 and d == {LOOK: 0.25, GUESS: 0.0, OTHER: 0.0}


def test_position_gains_line_up_from_the_end(tiny_tokenizer):
    def ids(text):
        return tiny_tokenizer(text, add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]

    choices = ["red", "green", "blue", "yellow"]
    look_sky, look_tomato = ids(style_target(LOOK, "sky", "red", choices)), ids(style_target(LOOK, "tomato", "red",
                                                                                               choices))
    guess_sky = ids(style_target(GUESS, "sky", "red", choices))
    # Gains: 2.0 at the look colour word (7th from the end), 0 elsewhere; 0.1 everywhere for the guess.
    lg_sky = [0.0] * len(look_sky)
    lg_sky[-7] = 2.0
    lg_tom = [0.0] * len(look_tomato)
    lg_tom[-7] = 4.0
    rs = [_rollout(0, LOOK, True, "A", named="A", gold="A", prior="C", gains=lg_sky, ids=look_sky),
          _rollout(1, LOOK, True, "A", named="A", gold="A", prior="A", gains=lg_tom, ids=look_tomato),
          _rollout(2, GUESS, True, "C", named="C", gold="A", prior="C", gains=[0.1] * len(guess_sky), ids=guess_sky),
          _rollout(3, GUESS, True, "C", named="C", gold="A", prior="C", clean=False, gains=[9.0] * 13, ids=[1] * 13)]
    p = lg_task.position_gains(rs, tiny_tokenizer)
    look = p[LOOK]["positions"]
    assert look[-7]["mean"] == pytest.approx(3.0) and look[-7]["n"] == 2 and look[-7]["token"] == " red"
    assert look[-1]["token"] == tiny_tokenizer.eos_token and look[-2]["token"] == " A"
    assert look[-len(look_tomato)]["n"] == 1  # only the tomato rollout is that long
    assert p[LOOK]["colour_word"] == pytest.approx(3.0) and p[LOOK]["elsewhere"] == 0.0
    assert p[GUESS]["rollouts"] == 1  # the unclean one is left out
    assert p[GUESS]["colour_word"] == pytest.approx(0.1) and p[GUESS]["elsewhere"] == pytest.approx(0.1)


# ---------------------------------------------------------------------------------------------------- smoke


@pytest.mark.e2e  # minutes-long (a launch of 2 processes or a whole command): make test-e2e, which CI runs
def test_short_warmup_writes_both_styles():
    """A short look-or-guess warm-up (well under the full recipe) already writes both styles when sampled, each
    answering from its reasoning; the full recipe's figures are `python -m benchmarks.look_or_guess warmup-check`'s."""
    import torch

    from fixtures.warmup import warm_start

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a ~1M-parameter model: a second thread only slows it on a shared machine
    try:
        # 128 steps at a higher rate: the shortest trial here after which both styles answer from their reasoning
        # (80 steps: a third of the rollouts followed it; this: 0.91, 25 look and 31 guess of 64, in 46 s).
        recipe = LookOrGuessRecipe(n_train=128, epochs=8.0, learning_rate=3e-3)
        model, processor, info = warm_start(recipe, log=lambda m: None)
        ds = lg_task.held_out_rows(recipe, lg_task.Settings(n_eval=16))
        rollouts = lg_task.label_rollouts(lg_task.sample_rollouts(model, processor, ds, samples=4, max_new_tokens=20,
                                                              greedy=False), ds)
        clean = [r for r in rollouts if r["clean"]]
        lg_task.score_rollouts(model, processor, clean, ds)
    finally:
        torch.set_num_threads(threads)
    assert info["sft_steps"] == 128  # 8 blocks of 128 rows, batch 8, one pass in order
    styles = collections.Counter(r["style"] for r in rollouts)
    assert len(rollouts) == 64 and styles[LOOK] >= 8 and styles[GUESS] >= 8, styles
    followed = [r["follows"] for r in rollouts if r["style"] in (LOOK, GUESS)]
    assert sum(followed) / len(followed) >= 0.8
    # The per-token gains are the reference's own: their mean is its visual_gain, and at the answer letter (the
    # token before the end token in a clean rollout) they are its answer_visual_gain.
    assert clean and all(len(r["gains"]) == len(r["ids"]) for r in clean)
    for r in clean:
        assert sum(r["gains"]) / len(r["gains"]) == pytest.approx(r["visual_gain"], abs=1e-4)
        assert r["gains"][-2] == pytest.approx(r["answer_visual_gain"], abs=1e-4)


# ------------------------------------------------------------------- the shortcut experiment (issue 30 items 2-3)


def test_style_loggers_read_each_rollouts_text():
    from fixtures.synthetic.look_or_guess import guess_rate, look_rate

    texts = ["<think> the shape in the image is green</think>\nAnswer: B",
             [{"role": "assistant", "content": "<think> a banana is yellow</think>\nAnswer: D"}],
             "Answer: A", "<think> a banana is tasty</think>"]
    assert look_rate(texts) == [1.0, 0.0, 0.0, 0.0]
    assert guess_rate(texts) == [0.0, 1.0, 0.0, 0.0]


def test_every_variant_logs_the_style_with_weight_zero_and_the_trainer_resolves_the_loggers():
    from trl_mdi.rewards.registry import resolve_rewards

    for form in ("visual_gain", "visual_gain_sum"):
        variants = lg_variants.experiment_variants(form)
        assert tuple(variants) == lg_variants.ALL_VARIANTS
        for name, v in variants.items():
            weights = dict(zip(v.rewards, v.weights))
            assert weights[lg_variants.STYLE_LOGGERS[0]] == 0.0 and weights[lg_variants.STYLE_LOGGERS[1]] == 0.0, name
            assert v.rewards[:2] == ("mc_idx", "think_format") and v.weights[:2] == (4.0, 1.0)
        assert variants[lg_variants.RELIANCE].rewards[2] == form and variants[lg_variants.RELIANCE].weights[2] == 1.0
        other = "visual_gain_sum" if form == "visual_gain" else "visual_gain"
        assert variants[lg_variants.OTHER_FORM].rewards[2] == other  # the form the development split did not choose
        assert variants["tprl_counterfactual"].tprl == "perturbation"
    funcs, _ = resolve_rewards(list(lg_variants.STYLE_LOGGERS), [0.0, 0.0])
    assert [f.__name__ for f in funcs] == ["look_rate", "guess_rate"]  # logged as rewards/look_rate/mean
    with pytest.raises(ValueError, match="gain_form"):
        lg_variants.experiment_variants("answer_visual_gain")


def test_step_logger_keeps_each_steps_look_rate():
    run = {"steps": [], "step_seconds": []}
    log = lg_runs.step_log(run, evaluate=None, mid=None)

    class State:
        global_step, max_steps = 1, 2

    log.on_train_begin(None, State, None)
    for step, rate in ((1, 0.25), (2, 0.5)):
        State.global_step = step
        log.on_step_end(None, State, None)
        log.on_log(None, State, None, logs={"reward": 4.0, "rewards/look_rate/mean": rate, "loss": 0.1,
                                            "rewards/visual_gain/zero_spread_frac": 0.0})
    log.on_log(None, State, None, logs={"train_runtime": 3.0})  # the closing log has no reward: not a step
    assert [s["rewards/look_rate/mean"] for s in run["steps"]] == [0.25, 0.5]
    assert "loss" not in run["steps"][0] and len(run["step_seconds"]) == 2


def test_trajectory_averages_windows_of_steps_over_seeds():
    runs = [{"steps": [{"rewards/look_rate/mean": x} for x in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)]},
            {"steps": [{"rewards/look_rate/mean": x} for x in (1.0, 1.0, 1.0, 1.0, 1.0, 1.0)]}]
    t = lg_report.trajectory(runs, window=4)
    assert [e for e, _ in t] == [4, 6]
    assert t[0][1] == pytest.approx((0.0 + 0.2 + 0.4 + 0.6 + 4.0) / 8) and t[1][1] == pytest.approx((1.8 + 2.0) / 4)


def _scored(prompt, style, gains):
    return {"prompt": prompt, "sample": 1, "style": style, "gains": gains, "visual_gain": sum(gains) / len(gains)}


def test_gain_form_choice_on_handmade_rollouts():
    rs = [
        # prompt 0: two looks (mean 0.3 -> reward 0.6, sum 4.5 -> 1.0; mean 0.1 -> 0.2, sum 1.5 -> 0.375), two guesses
        _scored(0, LOOK, [0.0] * 14 + [4.5]), _scored(0, LOOK, [0.0] * 14 + [1.5]),
        _scored(0, GUESS, [0.0] * 15), _scored(0, GUESS, [-0.15] + [0.0] * 14),
        # prompt 1: a look that gained nothing ties with the guess (reward 0 both: the group has zero spread)
        _scored(1, LOOK, [0.0] * 15), _scored(1, GUESS, [0.0] * 15), _scored(1, OTHER, [-1.0] * 15),
    ]
    t = lg_eval.gain_form_table(rs, n_boot=50)
    # 5 look-guess pairs inside prompts: 4 wins in prompt 0, one tie (1/2) in prompt 1.
    for form in ("visual_gain", "visual_gain_sum"):
        assert t[form]["within_auroc"] == pytest.approx(4.5 / 5) and t[form]["pairs"] == 5
        assert t[form]["zero_spread"] == 0.5
        assert t[form]["reward_guess"] == 0.0
    assert t["visual_gain"]["reward_look"] == pytest.approx((0.6 + 0.2 + 0.0) / 3)
    assert t["visual_gain_sum"]["reward_look"] == pytest.approx((1.0 + 0.375 + 0.0) / 3)
    assert t["visual_gain_sum"]["saturated_look"] == pytest.approx(1 / 3)
    form, why = lg_eval.pick_gain_form(t)
    assert form == "visual_gain" and "tied" in why
    assert lg_eval.zero_spread_share([0.2, 0.2, 0.0, 0.0, 0.1], [0, 0, 1, 1, 1]) == 0.5


def _final(conflict, plain=0.99, clean=0.95, look=0.5):
    return {"conflict": conflict, "plain": plain, "clean": clean, "look_rate": look, "look_rate_conflict": look,
            "look_acc_conflict": 0.97, "guess_rate_conflict": 1 - look, "guess_acc_conflict": 0.0,
            "other_rate_conflict": 0.0, "greedy_conflict": 1.0, "greedy_plain": 1.0, "greedy_look_rate": 1.0}


def _runs(name, conflicts, **kw):
    return [{"variant": name, "seed": seed, "final": _final(c, **kw), "step_seconds": [1.0, 1.2],
             "steps": [{"rewards/look_rate/mean": 0.5}, {"rewards/look_rate/mean": 0.7}],
             "code": {"commit": "abcdef123456", "dirty": False, "diff": None}} for seed, c in enumerate(conflicts)]


BASE = [0.50, 0.52, 0.48, 0.50, 0.55]


def test_verdicts_pair_seeds_with_the_baseline():
    import statistics

    push = [0.90, 0.88, 0.95, 0.92, 0.90]
    groups = lg_report.by_variant(_runs("answer_format", BASE) + _runs("visual_gain", push)
                              + _runs("answer_visual_gain", [0.51, 0.50, 0.49, 0.52, 0.54])
                              + _runs("mdi_balance", push, plain=0.90))
    v = lg_report.variant_verdicts(groups)
    assert set(v) == {"visual_gain", "answer_visual_gain", "mdi_balance"}
    diffs = [p - b for p, b in zip(push, BASE)]
    half = 2.7764451052 * statistics.stdev(diffs) / 5 ** 0.5  # t(0.975, 4) sd / sqrt(n)
    d = v["visual_gain"]["difference"]
    assert d["mean"] == pytest.approx(statistics.fmean(diffs))
    assert (d["low"], d["high"]) == (pytest.approx(d["mean"] - half), pytest.approx(d["mean"] + half))
    assert v["visual_gain"]["verdict"]["text"] == "shown"
    assert "includes 0" in v["answer_visual_gain"]["verdict"]["text"]
    assert "non-conflict 0.900 < 0.98" in v["mdi_balance"]["verdict"]["text"]  # the interval alone is not enough


def _records(n_prompts, conflict):
    """Per prompt two looks (gain 0.3, 0.4) and two guesses (gain 0.0, -0.01) and one rollout in neither style; MDI
    higher on the guesses in every prompt but shifted per prompt; blind_agrees 1 everywhere."""
    out = []
    for p in range(n_prompts):
        for style, gain, mdi in ((LOOK, 0.3, 0.8), (LOOK, 0.4, 0.85), (GUESS, 0.0, 0.9), (GUESS, -0.01, 0.95),
                                 (OTHER, 0.0, 2.0)):
            rec = {"prompt": p + (100 if conflict else 0), "conflict": conflict, "style": style,
                   "answers_prior": style == GUESS}
            rec.update({n: 0.0 for n in ("mdi_late", "answer_image_attention", "visual_gain_max",
                                          "answer_visual_gain", "answer_logprob")})
            rec.update(mdi=mdi + 0.5 * p, visual_gain=gain, visual_gain_sum=15 * gain, blind_agrees=1.0)
            out.append(rec)
    return out


def test_detection_tables_on_handmade_records():
    t = lg_eval.detection_tables(_records(4, False) + _records(3, True), n_boot=50)
    assert set(t) == {"plain", "conflict", "conflict_answer"}
    rows = {r["signal"]: r for r in t["plain"]}
    assert list(rows) == list(lg_variants.DETECTION_SIGNALS)
    assert rows["visual_gain"]["n"] == 16 and rows["visual_gain"]["n_prior"] == 8  # the 'other' rollouts left out
    assert rows["visual_gain"]["within_auroc"] == 1.0 and rows["visual_gain"]["auroc"] == 1.0
    assert rows["visual_gain"]["within_pairs"] == 16  # 2 x 2 pairs in each of 4 prompts
    # MDI: higher on guesses inside every prompt (within 1.0), but the prompts' shifts mix them when pooled:
    # guesses of prompt p (0.9 + 0.5p, 0.95 + 0.5p) against looks of prompt q (0.8 + 0.5q, 0.85 + 0.5q) win for
    # p >= q: 10 of the 16 prompt pairs, 4 wins each: 40 of 64.
    assert rows["mdi"]["within_auroc"] == 1.0 and rows["mdi"]["auroc"] == pytest.approx(40 / 64)
    assert rows["blind_agrees"]["within_auroc"] == 0.5  # constant: every pair a tie
    assert {r["signal"]: r["n"] for r in t["conflict"]}["visual_gain"] == 12
    assert lg_eval.best_within(t["plain"])[1] == 1.0
    assert lg_eval.steadiest_signal({"a": t["plain"], "b": [{"signal": "mdi", "within_auroc": 0.7},
                                                          {"signal": "visual_gain", "within_auroc": 0.96}]}) == (
        "visual_gain", 0.96)


def test_a_job_saves_its_stamped_result_and_a_failing_job_loses_nothing(tmp_path, monkeypatch, capsys):
    """execute (through results.run_job): a job's result is stamped with its fingerprint and code version and
    written where the resume looks for it; a job that raises is logged with its traceback and returned as an error,
    nothing written, so the other jobs of the pool go on."""
    monkeypatch.setattr(lg_runs, "_DATA", {"test": "rows"})
    job = dict(settings=None, recipe=None, work=tmp_path, threads=1, started=0.0, what="warmup", model_dir="m",
               label="warm-up", key="k1", code={"commit": "abc"}, path=tmp_path / "warmup.json")
    monkeypatch.setattr(lg_runs, "warmup_figures", lambda model_dir, rows, s, log: {"look_rate": 0.5, "rows": rows,
                                                                                 "auroc": float("nan")})
    result, error = lg_runs.execute(job)
    assert error is None and result["fingerprint"] == "k1" and result["code"] == {"commit": "abc"}
    saved = json.loads(job["path"].read_text())
    assert saved["look_rate"] == 0.5 and saved["fingerprint"] == "k1"
    assert saved["auroc"] is None  # saved by this benchmark's writer: an undefined AUROC is null, not NaN

    def broken(model_dir, rows, s, log):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(lg_runs, "warmup_figures", broken)
    job["path"] = tmp_path / "broken.json"
    assert lg_runs.execute(job) == (None, "RuntimeError: out of memory")
    assert not job["path"].exists()
    assert "[warm-up] FAILED: RuntimeError: out of memory" in capsys.readouterr().out


def test_a_detection_goal_is_met_only_by_its_interval_on_enough_pairs():
    """A model that keeps 2 guessing rollouts gives a within-prompt AUROC of 1.000 with a degenerate interval on a
    handful of pairs: that is no evidence either way. The handmade table's 16 pairs are too few; the same rows with
    the pair count and interval of the warm-up's real row meet the goal; a point value at the goal with an interval
    below it does not."""
    t = lg_eval.detection_tables(_records(4, False) + _records(3, True), n_boot=50)
    row = lg_eval.best_within_row(t["plain"])
    assert row["within_auroc"] == 1.0 and row["within_pairs"] == 16
    assert lg_eval.detection_verdict(row) == "too few pairs to tell (16 pairs)"
    assert lg_eval.detection_verdict({**row, "within_pairs": 223, "within_low": 0.959}) == "met"
    assert lg_eval.detection_verdict({**row, "within_auroc": 0.97, "within_pairs": 223, "within_low": 0.93}) == (
        "not met (interval from 0.930)")
    assert lg_eval.detection_verdict(None) == "not met (no pair)"


def test_report_from_stored_records():
    from benchmarks.stats import format_paired_difference, paired_seed_difference

    s = lg_variants.ExperimentSettings(steps=2, detect_prompts=7)
    recipe = lg_task.look_or_guess_recipe()
    push = [0.90, 0.88, 0.95, 0.92, 0.90]
    runs = _runs("answer_format", BASE) + _runs("visual_gain", push)
    runs[0]["detection"] = {"records": _records(4, False) + _records(3, True)}
    row = {"clip": 1.0, "within_auroc": 0.9, "low": 0.8, "high": 1.0, "pairs": 5, "raw_within_auroc": 0.9,
           "zero_spread": 0.5, "reward_look": 0.3, "reward_guess": 0.0, "saturated_look": 0.1}
    tables = {"black": {f: row for f in lg_variants.GAIN_FORMS}, "none": {f: {**row, "within_auroc": 0.99}
                                                                     for f in lg_variants.GAIN_FORMS}}
    kind, why_kind = lg_eval.pick_kind(tables, ("black", "none"))
    assert kind == "none" and why_kind.startswith("within-prompt AUROC of its reward 0.990 (others: black 0.900)")
    choice = {"form": "visual_gain", "why": "tied", "rollouts": 16, "prompts": 2, "look_rate": 0.5,
              "both_styles": 1.0, "tables": tables, "kind": kind, "why_kind": why_kind, "tprl_perturbation": "black",
              "where": {LOOK: {"colour_word": 4.4, "elsewhere": 0.001}, GUESS: {"colour_word": 0.0, "elsewhere": 0.0}}}
    body = lg_report.report(choice=choice, warm=None, runs=runs, s=s, recipe=recipe, argv=["experiment", "--steps", "2",
                        "--work_dir", "/tmp/x"], missing=["warmup", "mdi_balance-s0"], failed=[],
                        code={"commit": "abcdef123456", "dirty": True, "diff": "0123456789"}, minutes=None, workers=2,
                        threads=1)
    assert body.startswith(lg_report.SECTION + "\n")
    assert "`python -m benchmarks.look_or_guess experiment --steps 2`" in body  # output-only flags dropped
    assert "`abcdef123456`" in body and "this report: `abcdef123456+dirty(diff 0123456789)`" in body
    expected = format_paired_difference(paired_seed_difference(dict(enumerate(push)), dict(enumerate(BASE))))
    row = next(line for line in body.splitlines() if line.startswith("| + visual_gain (4:1:1) | 5 |"))
    assert expected in row and row.endswith("| shown |")
    assert "| answer + format only | 0.60 |" in body  # the look-rate trajectory: one window (of 5) holds 2 steps
    assert "Not finished (rerun the command above to finish them): warmup, mdi_balance-s0." in body
    assert "**shown**" in body  # the training goal
    assert "Detection, answer + format only, seed 0: best within-prompt AUROC on non-conflict rows 1.000" in body
    assert "look 4.400, guess 0.000 nats" in body
    for name in lg_variants.VARIANT_NAMES:  # every expected outcome stated, whatever ran
        assert lg_variants.EXPECTED[name][:40] in body
    assert "| none | visual_gain | 1 | 0.990 [0.800, 1.000] (5) |" in body
    assert "Chosen: counterfactual `none`: within-prompt AUROC of its reward 0.990" in body
    assert "TPRL's perturbation: `black`" in body
    # Nothing finished yet: the section says so.
    empty = lg_report.report(choice=None, warm=None, runs=[], s=s, recipe=recipe, argv=["report", "--work_dir", "/w"],
                         missing=["warmup"], failed=[], code={"commit": "abcdef123456", "dirty": False}, minutes=None,
                         workers=2, threads=1)
    assert "Detection table: not finished." in empty and "Runs finished: 0 of 25." in empty
    assert "Reproduce: `python -m benchmarks.look_or_guess experiment` (" in empty  # the command behind the records


def test_the_report_states_every_variant_it_can_run():
    """`experiment --variants ... guarded_visual_gain placebo_guarded` finished its runs and then crashed in its report
    (KeyError: EXPECTED lacked the replication's arms): every runnable variant has its expected outcome."""
    assert set(lg_variants.ALL_VARIANTS) <= set(lg_variants.EXPECTED)
    s = lg_variants.ExperimentSettings(steps=2, variants=("answer_format", "guarded_visual_gain", "placebo_guarded"),
                                       detect_seeds=())
    runs = (_runs("answer_format", BASE) + _runs("guarded_visual_gain", [0.9, 0.88, 0.95, 0.92, 0.9])
            + _runs("placebo_guarded", BASE))
    body = lg_report.report(choice=None, warm=None, runs=runs, s=s, recipe=lg_task.look_or_guess_recipe(),
                            argv=["experiment"], missing=[], failed=[], code={"commit": "abcdef123456", "dirty": False},
                            minutes=None, workers=2, threads=1)
    for name in s.variants:
        assert lg_variants.EXPECTED[name][:40] in body


def test_code_version_names_the_commit_and_the_dirty_tree():
    import re

    code = lg_runs.code_version()
    assert re.fullmatch(r"[0-9a-f]{40}", code["commit"]) and isinstance(code["dirty"], bool)
    assert lg_runs.code_label({"commit": "abc", "dirty": False, "diff": None}) == "abc"
    assert lg_runs.code_label({"commit": "abc", "dirty": True, "diff": "d1"}) == "abc+dirty(diff d1)"
    assert lg_runs.code_label(None) == "unknown"


# ------------------------------------------------------------------------------------ the replication (issue 35)


def test_placebo_permutes_the_guarded_values_within_each_group():
    from benchmarks.look_or_guess_placebo import PlaceboGuardedReward
    from trl_mdi.rewards import guarded_visual_gain

    ok = "<think> the shape is red</think>\nAnswer: A"
    gains = [0.0, 0.2, 0.4, 0.6, 0.05, 0.35, 0.9, None] * 2  # 4 groups of 4
    kw = dict(visual_gain_max=gains, label_idx=[0] * 16)
    real = guarded_visual_gain([ok] * 16, **kw)
    placebo = PlaceboGuardedReward(seed=3, group_size=4)

    class State:
        global_step = 5

    out = placebo([ok] * 16, trainer_state=State(), **kw)
    key = lambda v: (v is None, v or 0.0)  # noqa: E731
    for lo in range(0, 16, 4):  # every group keeps its values
        assert sorted(out[lo:lo + 4], key=key) == sorted(real[lo:lo + 4], key=key)
    assert out != real  # ...in another order
    assert placebo([ok] * 16, trainer_state=State(), **kw) == out  # seeded by (seed, step)
    State.global_step = 6
    assert placebo([ok] * 16, trainer_state=State(), **kw) != out  # a fresh permutation each step
    assert placebo.__name__ == "placebo_guarded_visual_gain_reward"
    with pytest.raises(ValueError, match="whole groups"):
        placebo([ok] * 3, visual_gain_max=[0.1] * 3, label_idx=[0] * 3)


def test_the_trainer_binds_the_format_to_the_placebo_as_to_the_real_reward():
    import pickle

    from benchmarks.look_or_guess_placebo import PlaceboGuardedReward
    from trl_mdi.rewards import bind_think_format

    bound = bind_think_format([PlaceboGuardedReward(seed=1, group_size=8)], think_prefilled=True)[0]
    assert bound.think_prefilled and bound.seed == 1 and bound.group_size == 8
    assert pickle.loads(pickle.dumps(bound)) == bound  # a module-level class: TRL's async worker can pickle it


def test_colour_word_gains_align_every_style_at_the_colour_word(tiny_tokenizer):
    def ids(text):
        return tiny_tokenizer(text, add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]

    choices = ["red", "green", "blue", "yellow"]
    look = style_target(LOOK, "tomato", "red", choices)
    neither = "<think> the shape in the image red</think>\nAnswer: A"  # a word dropped: another length
    texts = [look, neither, "no think block at all"]
    rows = []
    for i, (text, style) in enumerate(zip(texts, (LOOK, OTHER, OTHER))):
        t = ids(text)
        gains = [0.0] * len(t)
        close = tiny_tokenizer.convert_tokens_to_ids("</think>")
        if close in t:
            gains[t.index(close) - 1] = 2.0 + i  # the colour word
        rows.append({"prompt": 0, "style": style, "ids": t, "gains": gains, "text": text,
                     "visual_gain": sum(gains) / len(gains)})
    ds = [{"label_idx": 0, "choices": choices}]
    out = lg_task.colour_word_gains(rows, tiny_tokenizer, ds)
    assert out[LOOK]["aligned"] == 1 and out[LOOK]["offsets"][0]["mean"] == pytest.approx(2.0)
    assert out[LOOK]["offsets"][0]["token"] == " red"
    assert out[OTHER]["rollouts"] == 2 and out[OTHER]["aligned"] == 1  # the text without </think> is not aligned
    assert out[OTHER]["offsets"][0]["mean"] == pytest.approx(3.0) and out[OTHER]["offsets"][1]["mean"] == 0.0
    assert out[GUESS]["rollouts"] == 0
    # The rewards each style earns: guarded pays the aligned neither-style text (right, clean, 3 nats) in full and
    # the unformatted one nothing; the mean form pays by the per-token mean.
    assert out[LOOK]["guarded_visual_gain"] == 1.0 and out[OTHER]["guarded_visual_gain"] == 0.5
    assert 0 < out[OTHER]["visual_gain"] < 1


def fake_run(variant, seed, conflict, neither=0.1, plain=0.95, clean=0.93):
    styles = {LOOK: {"accuracy": 0.98}, GUESS: {"accuracy": 0.02}}
    m = {"conflict": {"accuracy": conflict, "guess_rate": 0.3, "look_rate": 0.5, "other_rate": neither, **styles},
         "plain": {"accuracy": plain}, "all": {"clean": clean, "other_rate": neither, "look_rate": 0.5}}
    return {"variant": variant, "seed": seed, "eval": {"sampled": m, "greedy": m},
            "code": {"commit": "c0ffee" * 7, "dirty": False}}


def test_the_replication_report_keeps_the_plan_and_writes_below_it(tmp_path):
    from benchmarks import look_or_guess_replication as rep

    plan = f"{rep.SECTION}\n\nThe plan, word for word.\n\n{rep.PLAN_END}"
    results = tmp_path / "RESULTS.md"
    results.write_text(f"# Results\n\n## Before\n\nkept\n\n{plan}\n\nold results\n\n## After\n\nkept too\n")
    rep.write_results(results, "\n### Results\n\nnew\n")
    text = results.read_text()
    assert rep.plan_text(text) == plan and "old results" not in text and "\nnew\n" in text
    assert text.startswith("# Results\n\n## Before\n\nkept\n") and text.endswith("## After\n\nkept too\n")
    rep.write_results(results, "\n### Results\n\nnewer\n")  # idempotent: the plan stays, the results are replaced
    assert rep.plan_text(results.read_text()) == plan and "newer" in results.read_text() and "\nnew\n" not in \
        results.read_text()
    # a note added below the results by hand survives a rewrite of the results, between them and the next section
    results.write_text(results.read_text().replace("newer\n", f"newer\n\n{rep.NOTE}\n\nby hand\n"))
    rep.write_results(results, "\n### Results\n\nnewest\n")
    text = results.read_text()
    assert "newer" not in text and text.count(rep.NOTE) == 1 and rep.plan_text(text) == plan
    assert text.index("newest") < text.index(rep.NOTE) < text.index("by hand") < text.index("## After")
    assert text.endswith("by hand\n\n## After\n\nkept too\n")
    results.write_text("# no plan here\n")
    with pytest.raises(ValueError, match="commit it first"):
        rep.write_results(results, "x")


def test_the_committed_plan_is_the_plan_commits_text_word_for_word():
    import subprocess

    from benchmarks import look_or_guess_replication as rep

    results = ROOT / "benchmarks" / "RESULTS.md"
    commit = rep.plan_commit(results)
    if commit is None:
        pytest.skip("no git history here (the plan commit cannot be read)")
    then = subprocess.run(["git", "show", f"{commit}:benchmarks/RESULTS.md"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
    assert rep.plan_text(results.read_text()) == rep.plan_text(then)


def test_the_replication_report_from_runs():
    from benchmarks import look_or_guess_replication as rep

    rng = __import__("random").Random(0)
    runs = []
    for seed in range(100, 116):
        base = 0.4 + rng.uniform(-0.2, 0.2)
        runs += [fake_run("answer_format", seed, base), fake_run("visual_gain", seed, base + 0.05, neither=0.35),
                 fake_run("guarded_visual_gain", seed, base + 0.3), fake_run("placebo_guarded", seed, base + 0.02)]
    res = rep.analyse(runs)
    assert res["primary"]["C"]["shown"] and res["primary"]["B"]["shown"]  # equal p: the order of the arms breaks the tie
    assert res["verdicts"]["C"]["verdict"] == "shown"
    assert res["verdicts"]["B"]["verdict"] == "refuted: hacking"
    body = rep.report(runs=runs, choice=None, earlier=None, code="c0ffee", plan="fdc0a07", earlier_code=None,
                      minutes=None, workers=2, missing=[])
    assert "**C: + guarded_visual_gain: shown**" in body and "**B: + visual_gain (as shipped): refuted: hacking**" \
        in body
    assert "64 runs (A 16, B 16, C 16, D 16), seeds 100 to 115; nothing was cut" in body
    # The earlier section re-stated: 5 seeds, Holm over five: nothing can be shown (p >= 0.0625).
    earlier = [fake_run(v, s, 0.4 + 0.3 * (v != "answer_format") + 0.01 * s) for s in range(5)
               for v in ("answer_format", *rep.EARLIER)]
    restated = rep.restate(earlier)
    assert set(restated) == set(rep.EARLIER)
    assert all(x["primary"]["p"] == 0.0625 and not x["primary"]["shown"] for x in restated.values())
    assert "re-stated under the corrected rules" in rep.report(runs=runs, choice=None, earlier=earlier, code="c",
                                                                plan=None, earlier_code="35eeeeb", minutes=None,
                                                                workers=2, missing=[])


@pytest.mark.e2e  # minutes-long (a launch of 2 processes or a whole command): make test-e2e, which CI runs
def test_a_tie_for_the_steadiest_signal_goes_to_the_first_listed_in_every_process():
    """It used to depend on a set's order, which changes with the process's hash seed."""
    import os
    import subprocess
    import sys

    code = ("from benchmarks.look_or_guess_evaluation import steadiest_signal as f; "
            "t = [{'signal': s, 'within_auroc': 0.667} for s in ('answer_image_attention', 'visual_gain', "
            "'answer_visual_gain')]; print(f({'warm': t, 'run': t})[0])")
    names = {subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout.strip() for seed in range(4)}
    assert names == {"answer_image_attention"}


def test_benchmark_module_doctests():
    import doctest

    from benchmarks import look_or_guess_replication

    for module in (lg_eval, lg_task, look_or_guess_replication):
        failed, _ = doctest.testmod(module)
        assert not failed, module.__name__


# ------------------------------------------------------------------------------------------------ the long kind (issue 44)


def test_the_short_kind_is_unchanged_row_for_row_and_target_for_target():
    """The replication's figures come from the `look_or_guess` kind: adding the long kind changed none of its rows,
    images or targets, nor the prior_color rows (digests recorded on the code before the long kind existed)."""
    import hashlib

    def digest(kind):
        h = hashlib.sha256()
        for split, rate in (("train", 0.5), ("validation", 0.0), ("look_or_guess_test", 0.5), ("test", 0.5)):
            for r in generate_synthetic_rows(24, split=split, seed=0, kinds=(kind,), option_order="fixed",
                                             conflict_rate=rate):
                h.update(hashlib.sha256(r.pop("image")["bytes"]).digest())
                h.update(json.dumps(r, sort_keys=True).encode())
                if kind == "look_or_guess" and r["drawn_color"] is not None:
                    for s in (LOOK, GUESS):
                        t = style_target(s, r["object"], r["drawn_color"], r["choices"])
                        h.update((t + repr(read_reasoning(t))).encode())
        return h.hexdigest()

    assert digest("look_or_guess") == "6c22e548cce625e26c36f67e1c5c08ce8b022f2207fd3d91c10959cf93720a08"
    assert digest("prior_color") == "e189208cb0189b7c20cae8c6be82a318003ed3fdb45ba67cd530f11859167239"


def test_long_rows_are_the_same_rows_and_both_long_styles_are_equally_long(tiny_tokenizer):
    from fixtures.synthetic.look_or_guess import (
        CHAINS,
        LONG_MAX_COMPLETION_LENGTH,
        LOOK_OR_GUESS_LONG,
        chains_for,
        check_long_equal_lengths,
        long_style_target,
    )

    short = generate_synthetic_rows(16, split="train", seed=3, kinds=("look_or_guess",), conflict_rate=0.5)
    long = generate_synthetic_rows(16, split="train", seed=3, kinds=(LOOK_OR_GUESS_LONG,), conflict_rate=0.5)
    assert [{k: v for k, v in r.items() if k != "question_id"} for r in short] == \
        [{k: v for k, v in r.items() if k != "question_id"} for r in long]
    counts = check_long_equal_lengths(tiny_tokenizer)
    assert counts == {"tomato": {LOOK: 45, GUESS: 45}, "grass": {LOOK: 43, GUESS: 43}, "sky": {LOOK: 42, GUESS: 42},
                      "banana": {LOOK: 43, GUESS: 43}}
    assert max(n for c in counts.values() for n in c.values()) + 1 <= LONG_MAX_COMPLETION_LENGTH
    # the colour word is one token of 42-45: about 2% of the completion (the short chains: 1 of 12-15)
    target = long_style_target(LOOK, "sky", "red", ["red", "green", "blue", "yellow"])
    ids = tiny_tokenizer(target, add_special_tokens=False)["input_ids"]
    assert sum(tiny_tokenizer.decode([i]) == " red" for i in ids) == 1 and 1 / len(ids) < 0.025
    assert chains_for(("look_or_guess_long",)) is CHAINS[LOOK_OR_GUESS_LONG]
    with pytest.raises(ValueError, match="exactly one look-or-guess kind"):
        chains_for(("look_or_guess", "look_or_guess_long"))


@pytest.mark.parametrize("text, expected", [
    ("<think> What is the color of the sky? I use the image: the shape in the image here is red. It is the "
     "answer.</think>\nAnswer: A", Reasoning(LOOK, "red", "sky")),
    ("<think> What is the color of the banana? I use the name: its color is yellow. It is the answer.</think>",
     Reasoning(GUESS, "yellow", "banana")),
    # a garbled restatement: still a chain that read the image (seen in the first development runs)
    ("<think> What is the color of the sky? o? use the image: the shape in the image here is green. It is the "
     "answer.</think>", Reasoning(LOOK, "green", None)),
    # neither: a word dropped from the style sentence, two style sentences, no closing sentence, no colour word,
    # the short kind's chain, no think block
    ("<think> What is the color of the sky? I use the image: the shape in the image is red. It is the answer.</think>",
     Reasoning(OTHER)),
    ("<think> What is the color of the sky? I use the image: the shape in the image here is red. I use the name: its "
     "color is blue. It is the answer.</think>", Reasoning(OTHER)),
    ("<think> What is the color of the sky? I use the name: its color is blue.</think>", Reasoning(OTHER)),
    ("<think> What is the color of the sky? I use the name: its color is tasty. It is the answer.</think>",
     Reasoning(OTHER)),
    ("<think> the shape is red</think>\nAnswer: A", Reasoning(OTHER)),
    ("Answer: A", Reasoning(OTHER)),
])
def test_read_long_reasoning_on_handmade_texts(text, expected):
    from fixtures.synthetic.look_or_guess import long_look_rate, read_long_reasoning

    assert read_long_reasoning(text) == expected
    assert long_look_rate([text]) == [1.0 if expected.style == LOOK else 0.0]


def test_long_targets_read_back_and_their_decision_spans(tiny_tokenizer):
    from fixtures.synthetic.look_or_guess import long_style_spans, long_style_target, read_long_reasoning

    for obj in PRIOR_OBJECTS:
        for colour in ("red", "green", "blue", "yellow"):
            choices = ["red", "green", "blue", "yellow"]
            for style in (LOOK, GUESS):
                text = long_style_target(style, obj, colour, choices)
                named = colour if style == LOOK else PRIOR_OBJECTS[obj]
                assert read_long_reasoning(text) == Reasoning(style, named, obj)
                spans = long_style_spans(text)
                assert text[slice(*spans["colour"])] == " " + named
                assert text[slice(*spans["branch"])] == (" image" if style == LOOK else " name")
                assert text.endswith(f"Answer: {'ABCD'[choices.index(named)]}")
    assert long_style_spans("Answer: A") is None


def test_the_long_warmup_data_uses_the_long_targets():
    from fixtures.synthetic.look_or_guess import LOOK_OR_GUESS_LONG, read_long_style

    ds = synthetic_dataset(8, split="train", seed=0, kinds=(LOOK_OR_GUESS_LONG,), conflict_rate=0.5)
    sft = look_or_guess_sft_dataset(ds, 2, seed=0, kind=LOOK_OR_GUESS_LONG)
    styles = [read_long_style(c[0]["content"]) for c in sft["completion"]]
    assert len(styles) == 16 and set(styles) == {LOOK, GUESS}
    assert lg_task.look_or_guess_recipe(kind=LOOK_OR_GUESS_LONG).kinds == (LOOK_OR_GUESS_LONG,)


def test_a_finished_job_is_keyed_by_its_environment():
    """The replication's keys (a run, the warm-up's test figures, the development choice) take the environment
    (float path, CPU capability, library versions), so a record made in another environment is rerun, never reused;
    without one they are the keys of the records made before environments were keyed."""
    s, recipe = lg_variants.ExperimentSettings(), LookOrGuessRecipe()
    variant = next(iter(lg_variants.experiment_variants("visual_gain", None).values()))
    pinned = {"float_path": "pinned", "torch_cpu_capability": "AVX2", "libraries": {"torch": "2.14.1"}}
    native = {**pinned, "float_path": "native", "torch_cpu_capability": "AVX512"}
    for key in (lambda e: lg_variants.run_key(s, recipe, variant, 100, 1, e),
                lambda e: lg_variants.warmup_key(s, recipe, 1, e), lambda e: lg_variants.choice_key(s, recipe, 1, e)):
        assert key(pinned) == key(dict(pinned)) != key(native)
        assert key(None) not in (key(pinned), key(native))
    assert lg_variants.run_key(s, recipe, variant, 100, 1) == lg_variants.run_key(s, recipe, variant, 100, 1, None)


def test_the_benchmark_refuses_a_process_that_did_not_take_the_pinned_float_path(tmp_path, monkeypatch):
    """``main`` runs pinned by default; this test process imported torch without the pins, so it stops before any
    work with the error naming the fix (``python -m benchmarks.look_or_guess`` pins before torch is imported)."""
    import torch

    from benchmarks import look_or_guess
    from benchmarks.environment import PINS

    for name in PINS:
        monkeypatch.delenv(name, raising=False)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        with pytest.raises(RuntimeError, match="pin_float_path|--float_path native"):
            look_or_guess.main(["warmup-check", "--work_dir", str(tmp_path / "work")])
    finally:  # the pins' torch settings must not leak into the rest of the suite
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    assert not (tmp_path / "work").exists()


def test_run_as_a_script_it_pins_the_float_path_before_torch(tmp_path):
    """``python -m benchmarks.look_or_guess`` sets the pins before torch is imported, so the default (pinned) run
    passes the check that refuses an unpinned process; ``report`` on an empty work dir then stops with nothing run."""
    import os
    import subprocess
    import sys

    from benchmarks.environment import PINS
    from benchmarks.results import ROOT

    env = {k: v for k, v in os.environ.items() if k not in PINS}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.look_or_guess", "report", "--work_dir",
                           str(tmp_path / "work")], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing to report" in proc.stdout and "float path is not pinned" not in proc.stderr
