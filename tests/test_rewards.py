"""Reward functions, answer parsing, the registry and the group helpers (trl_mdi.rewards).

All pure: strings and hand-made tensors, no model, no trainer.
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from trl_mdi import rewards as R
from trl_mdi import signals as S
from trl_mdi.attention import metrics
from trl_mdi.rewards import extract_choice_letter as parse

NAN = float("nan")


# A custom reward loaded by import path in the registry tests: f"{__name__}:<attr>" names this module,
# which is already imported, whatever pytest's import mode called it.
def length_reward(completions, **kwargs):
    return [float(len(R.completion_text(c))) for c in completions]


class MinLengthReward:
    """Parameterised reward as a picklable callable class (the project's pattern)."""

    __name__ = "min_length_reward"

    def __init__(self, min_chars: int):
        self.min_chars = min_chars

    def __call__(self, completions, **kwargs):
        return [1.0 if len(R.completion_text(c)) >= self.min_chars else 0.0 for c in completions]


min_length_reward = MinLengthReward(5)
NOT_CALLABLE = 42


def msg(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


# ---------------------------------------------------------------------------------------------------
# extract_choice_letter
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Answer: B", "B"),
        ("Final answer: D", "D"),
        ("So the answer is c", "C"),
        ("the answer is (b).", "B"),
        ("**Answer:** (C)", "C"),
        ("Answer: **A**", "A"),
        ("The answer is option d", "D"),
        (r"Therefore \boxed{C}", "C"),
        ("(B)", "B"),
        ("B. a red circle", "B"),
        ("Looking at the image...\nC. blue", "C"),
        ("the correct option is b", "B"),
        ("It could be A or B, I pick C", "C"),
        ("No letter here.", None),
        ("", None),
    ],
)
def test_english_forms(text, expected):
    assert parse(text, num_choices=4) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("答案：B", "B"),
        ("答案: C", "C"),
        ("答案是D。", "D"),
        ("选项 A 正确", "A"),
        ("选项C", "C"),
        ("所以故选B", "B"),
        ("图中是一只猫，答案：C，因为选项A不对", "C"),  # an answer statement beats a later option mention
    ],
)
def test_chinese_forms(text, expected):
    assert parse(text, num_choices=4) == expected


@pytest.mark.parametrize(
    "text, expected",
    [("Answer: Ｃ", "C"), ("答案：Ｂ", "B"), ("（Ｄ）", "D"), ("Ａｎｓｗｅｒ：ａ", "A"), ("答案：Ｅ", None)],
)
def test_full_width_is_normalised(text, expected):
    assert parse(text, num_choices=4) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("A cat is sitting on the mat.", None),  # article
        ("A dog runs. The answer is B", "B"),
        ("A red bus is parked near a tree, so C.", "C"),  # article first, letter last
        ("I think it is D", "D"),  # pronoun I, with num_choices=10 (I is a valid letter)
        ("I'm fairly sure it's B", "B"),
        ("The answer is a dog", None),  # lowercase article after an answer keyword
        ("Answer: A cat", None),  # documented: read as the article, not as option A
        ("A is correct", "A"),  # A followed by a verb is the letter
        ("A or B? Both look plausible. B", "B"),
        ("A and C match; I choose A.", "A"),
        ("(A) cat", "A"),
        ("A. cat", "A"),
        ("Answer: A\nthe cat is left", "A"),  # the next word is on another line
        ("B cat", "B"),  # only A and I double as English words
        ("An A-frame house, so H", "H"),  # hyphenated letters are words
        ("The answer is I", "I"),
    ],
)
def test_article_and_pronoun_rule(text, expected):
    assert parse(text, num_choices=10) == expected


def test_last_explicit_statement_wins_and_beats_stray_letters():
    assert parse("Answer: A. Wait, that is wrong. Final answer: C", 4) == "C"
    assert parse("The answer is B, not C or D.", 4) == "B"
    assert parse("Answer: D\n\nOption B was tempting, A too.", 4) == "D"
    # Without any statement, the last standalone capital wins.
    assert parse("Between B and D I go with D, not B", 4) == "B"


def test_num_choices_limits_letters():
    assert parse("Answer: E", 4) is None
    assert parse("Answer: E", 5) == "E"
    assert parse("Answer: B. See figure E.", 4) == "B"
    assert parse("Picture E shows it, C", 4) == "C"
    with pytest.raises(ValueError, match="num_choices"):
        parse("A", 0)
    with pytest.raises(ValueError, match="num_choices"):
        parse("A", 27)


def test_think_block_is_ignored_when_an_answer_follows():
    text = "<think>Answer: A looks right. The answer is B? Option D no.</think>\nAnswer: C"
    assert parse(text, 4) == "C"
    # A stray letter after the block still beats explicit statements inside it.
    assert parse("<think>the answer is A</think>\n(D)", 4) == "D"
    # No letter after the block: the reasoning is read.
    assert parse("<think>so the answer is B</think>\nI am not sure.", 4) == "B"
    # Cut off inside the block: the reasoning is read.
    assert parse("<think>A is wrong, B fits", 4) == "B"


# ---------------------------------------------------------------------------------------------------
# mc_idx
# ---------------------------------------------------------------------------------------------------


def test_mc_idx_reward_strings_and_messages():
    completions = ["Answer: B", msg("Answer: B"), msg("<think>A?</think>Answer: C"), "no idea"]
    assert R.mc_idx(completions, [1, 1, 1, 1]) == [1.0, 1.0, 0.0, 0.0]
    # Parts-style content (multimodal message format) reads the same.
    parts = [[{"role": "assistant", "content": [{"type": "text", "text": "Answer: D"}]}]]
    assert R.mc_idx(parts, [3]) == [1.0]


def test_mc_idx_reward_missing_labels_give_none():
    out = R.mc_idx(["Answer: A"] * 5, [None, NAN, np.float64("nan"), np.int64(0), 0.0])
    assert out == [None, None, None, 1.0, 1.0]


def test_mc_idx_reward_bad_labels_raise():
    with pytest.raises(ValueError, match="outside 0..3"):
        R.mc_idx(["Answer: A"], [4], choices=[["a", "b", "c", "d"]])
    with pytest.raises(ValueError, match="int index"):
        R.mc_idx(["Answer: A"], [1.5])
    with pytest.raises(ValueError, match="int index"):
        R.mc_idx(["Answer: A"], ["B"])
    with pytest.raises(ValueError, match="2 completions but 1"):
        R.mc_idx(["Answer: A", "B"], [0])


def test_mc_idx_reward_uses_choices_column_and_logs_parsed_letters():
    logged = {}
    choices = [["cat", "dog", "cow", "pig"]] * 2
    out = R.mc_idx(
        ["The answer is C. Figure E.", "Answer: F"],
        [2, 1],
        choices=choices,
        log_extra=lambda name, values: logged.update({name: values}),
    )
    assert out == [1.0, 0.0]
    assert logged == {"parsed_choice": ["C", ""]}


# ---------------------------------------------------------------------------------------------------
# think_format
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>The circle is red.</think>\nAnswer: A", 1.0),
        ("\n<think>\nreasoning\n</think>\n\nAnswer: A", 1.0),  # leading whitespace is fine
        ("<think></think>Answer: A", 0.0),  # empty reasoning
        ("<think>  \n </think>Answer: A", 0.0),
        ("<think>reasoning</think>", 0.0),  # no answer
        ("<think>reasoning</think>  \n", 0.0),
        ("<think>reasoning without a close. Answer: A", 0.0),
        ("Answer: A <think>reasoning</think> done", 0.0),  # answer before the block
        ("<think>a</think><think>b</think>Answer: A", 0.0),  # two blocks
        ("<think>a</think>b</think>Answer: A", 0.0),  # stray close
        ("<think>a <think> b</think>Answer: A", 0.0),  # nested open
        ("Answer: A", 0.0),
    ],
)
def test_think_format_cases(text, expected):
    assert R.think_format([text]) == [expected]
    assert R.think_format([msg(text)]) == [expected]
    assert R.think_format_lenient([text]) == [expected]  # the lenient one agrees on these


# The drifted completions of the demo's last step before the strict reward (issue 14): the lenient reward paid 1.
JUNK = ['<think> image</think>\nAnswer" A', "<think> image</think>\nAnswers A", "<think> image</think>\nAnswer\ufffd A",
        "<think> image</think>\nAnswer hexagon C", "<think> image</think>\nAnswer cyan\ufffd C",
        "<think> image</think>\nAnswerYou A", "<think> image</think>\nA B"]


def test_strict_format_rejects_the_demos_junk_the_lenient_one_paid_for():
    assert R.think_format(JUNK) == [0.0] * len(JUNK)
    assert R.think_format_lenient(JUNK) == [1.0] * len(JUNK)
    ok = ["<think> image</think>\nAnswer: B", "<think>red</think>   \n\nAnswer: B  \n", msg("<think> x</think>\nAnswer: B")]
    assert R.think_format(ok, choices=[["a", "b", "c", "d"]] * 3) == [1.0, 1.0, 1.0]
    bad = ["<think> x</think>\nAnswer: B\nbecause", "<think> x</think>\nAnswer: E", "<think> x</think>\nthen Answer: B",
           "<think> x</think>\nAnswer: b", "<think> x</think>\nAnswer: A or B"]
    assert R.think_format(bad, choices=[["a", "b", "c", "d"]] * 5) == [0.0] * 5
    # Without a choices column any capital letter is valid.
    assert R.think_format(["<think> x</think>\nAnswer: E"]) == [1.0]


def test_think_format_binds_a_pattern_and_a_prefilled_think():
    final = R.ThinkFormatReward(r"Final: \((?P<letter>[A-D])\)")
    assert final(["<think> x</think>\nFinal: (C)", "<think> x</think>\nAnswer: C"]) == [1.0, 0.0]
    prefilled = R.ThinkFormatReward(think_prefilled=True)  # Qwen3 thinking templates open <think> in the prompt
    assert prefilled(["reasoning</think>\nAnswer: A", "<think>r</think>\nAnswer: A", "</think>\nAnswer: A"]) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="named group"):
        R.ThinkFormatReward(r"Answer: ([A-Z])")
    bound = R.bind_think_format([R.think_format, R.mc_idx], answer_pattern=final.answer_pattern)
    assert bound[0].answer_pattern == final.answer_pattern and bound[1] is R.mc_idx
    assert R.think_format.answer_pattern == R.ThinkFormatReward().answer_pattern  # the default is untouched


def test_default_system_prompt_and_pattern_agree():
    """The prompt shows the model the line the pattern pays for: built from one example, checked together."""
    import re

    from trl_mdi import answer_format as F
    from trl_mdi.data import DEFAULT_SYSTEM_PROMPT

    assert DEFAULT_SYSTEM_PROMPT == F.DEFAULT_SYSTEM_PROMPT and F.DEFAULT_ANSWER_EXAMPLE in DEFAULT_SYSTEM_PROMPT
    for letter in "ABCD":
        line = F.DEFAULT_ANSWER_EXAMPLE.replace("X", letter)
        m = re.fullmatch(F.DEFAULT_ANSWER_PATTERN, line)
        assert m is not None and m.group("letter") == letter
    assert "<think>...</think>" in DEFAULT_SYSTEM_PROMPT


@pytest.mark.parametrize("text, label, expected", [
    ("<think>x</think>\nAnswer: A or B", 0, 0.0),  # a hedge names two letters: 0 even when one is right
    ("<think>x</think>\nA B", 0, 0.0),
    ("Answer: A or B", 1, 0.0),
    ("Answer: A. On reflection, final answer: C", 2, 1.0),  # a correction ending on one letter is that letter
    ("<think>A or B?</think>\nAnswer: B", 1, 1.0),  # hesitation inside the think block does not count
    ("I think the right one is D.", 3, 1.0),
])
def test_hedged_answers_score_zero(text, label, expected):
    assert R.mc_idx([text], [label], choices=[["a", "b", "c", "d"]]) == [expected]


def test_trl_think_format_pays_for_the_shortcuts_ours_rejects():
    # Why we wrote our own (see the docstring): TRL's accepts an empty block and a missing answer.
    from trl.rewards import think_format_reward as trl_think

    shortcuts = ["<think></think>Answer: A", "<think>reasoning</think>", "<think>a</think>b</think>c"]
    assert trl_think([msg(t) for t in shortcuts]) == [1.0, 1.0, 1.0]
    assert R.think_format(shortcuts) == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------------
# MDI rewards
# ---------------------------------------------------------------------------------------------------


def test_mdi_balance_reward_follows_its_formula():
    mdi = torch.tensor([1.0, 2**0.5, 2.0, 1 / 2**0.5, 10.0, NAN])
    balance = metrics.mdi_balance(mdi, ratio=2.0).tolist()
    balance = [None if math.isnan(b) else b for b in balance]
    out = R.mdi_balance(["x"] * 6, balance)
    assert out[:5] == pytest.approx([1.0, 0.0, -1.0, 0.0, -1.0], abs=1e-6)
    assert out[5] is None
    assert R.mdi_balance(["x", "y"], [None, NAN]) == [None, None]
    with pytest.raises(ValueError, match="1 completions but 2"):
        R.mdi_balance(["x"], [0.5, 0.5])


def test_mdi_group_reward_passes_scores_through():
    assert R.mdi_group(["a", "b", "c", "d"], [0.5, -0.5, None, NAN]) == [0.5, -0.5, None, None]
    with pytest.raises(ValueError, match="2 completions but 1"):
        R.mdi_group(["a", "b"], [0.0])


def _log_abs(x: torch.Tensor) -> torch.Tensor:
    return x.double().log().abs()


def test_group_score_is_bounded_zero_mean_and_ordered():
    g = torch.Generator().manual_seed(0)
    mdi = torch.exp(torch.randn(64 * 8, generator=g) * 2)
    mdi[::7] = NAN
    score = S.group_relative_mdi_score(mdi, 8)
    assert score.shape == mdi.shape and score.dtype == mdi.dtype
    assert torch.equal(score.isnan(), mdi.isnan())
    valid = ~score.isnan()
    assert score[valid].min() >= -1 and score[valid].max() <= 1
    for s, m in zip(score.view(-1, 8), mdi.view(-1, 8)):
        keep = ~s.isnan()
        assert s[keep].sum().item() == pytest.approx(0.0, abs=1e-5)
        if keep.sum() > 1:  # the most balanced gets 1, the least -1
            dist = _log_abs(m[keep])
            assert s[keep][dist.argmin()] == pytest.approx(1.0) and s[keep][dist.argmax()] == pytest.approx(
                -1.0
            )
            # strictly more balanced -> strictly higher score
            order = dist.argsort()
            assert (s[keep][order].diff() < 0).all()


def test_group_score_ties_nan_and_single_valid():
    score = S.group_relative_mdi_score(
        torch.tensor([2.0, 0.5, 8.0, 1.0, NAN, NAN, 3.0, NAN, NAN, NAN, NAN, NAN]), 4
    )
    # MDI 2 and 1/2 are equally unbalanced: tied, average rank 1.5 of 0..3.
    torch.testing.assert_close(score[:4], torch.tensor([0.0, 0.0, -1.0, 1.0]))
    assert score[4:6].isnan().all() and score[7].isnan()
    assert score[6].item() == 0.0  # the only valid rollout of its group
    assert score[8:].isnan().all()  # a group without images
    # All equal: every rollout gets 0 (no signal, nothing invented).
    assert torch.equal(S.group_relative_mdi_score(torch.full((4,), 7.0), 4), torch.zeros(4))
    # Zero attention on the image (MDI inf) is the least balanced, tied with MDI 0.
    s = S.group_relative_mdi_score(torch.tensor([math.inf, 0.0, 3.0, 1.0]), 4)
    torch.testing.assert_close(s, torch.tensor([-2 / 3, -2 / 3, 1 / 3, 1.0]))


def test_group_score_separates_a_group_the_balance_reward_cannot():
    # Typical MDI, all outside (1/R, R) = (0.5, 2): the balance reward is -1 for every rollout.
    mdi = torch.tensor([5.0, 17.0, 8.0, 12.0])
    balance = R.mdi_balance(["x"] * 4, metrics.mdi_balance(mdi, 2.0).tolist())
    assert balance == [-1.0] * 4
    score = S.group_relative_mdi_score(mdi, 4)
    torch.testing.assert_close(score, torch.tensor([1.0, -1.0, 1 / 3, -1 / 3]))
    rewards = torch.tensor([balance, R.mdi_group(["x"] * 4, score.tolist())]).T
    torch.testing.assert_close(R.zero_spread_fraction(rewards, 4), torch.tensor([1.0, 0.0]))


def test_group_score_input_checks():
    with pytest.raises(ValueError, match="groups of num_generations=4"):
        S.group_relative_mdi_score(torch.ones(6), 4)
    with pytest.raises(ValueError, match="1-D"):
        S.group_relative_mdi_score(torch.ones(2, 4), 4)
    assert S.group_relative_mdi_score(torch.tensor([1, 2]), 2).dtype == torch.float32


# ---------------------------------------------------------------------------------------------------
# zero_spread_fraction
# ---------------------------------------------------------------------------------------------------


def test_zero_spread_fraction_hand_made():
    rewards = torch.tensor(
        [
            # group 0: f0 varies, f1 constant, f2 constant apart from NaN, f3 all NaN
            [1.0, -1.0, 0.5, NAN],
            [0.0, -1.0, NAN, NAN],
            [1.0, -1.0, 0.5, NAN],
            # group 1: f0 constant, f1 varies, f2 a single valid value, f3 varies apart from NaN
            [1.0, 0.2, NAN, 0.0],
            [1.0, 0.3, 0.1, NAN],
            [1.0, 0.2, NAN, 1.0],
        ]
    )
    torch.testing.assert_close(R.zero_spread_fraction(rewards, 3), torch.tensor([0.5, 0.5, 1.0, 0.5]))
    torch.testing.assert_close(R.zero_spread_fraction(rewards, 1), torch.ones(4))  # one rollout per group
    with pytest.raises(ValueError, match="groups of num_generations=4"):
        R.zero_spread_fraction(rewards, 4)
    with pytest.raises(ValueError, match="2-D"):
        R.zero_spread_fraction(rewards[:, 0], 3)


# ---------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------


def test_registry_contents_and_defaults():
    assert set(R.REWARD_REGISTRY) == {"mc_idx", "think_format", "think_format_lenient", "mdi_balance", "mdi_group",
                                      "accuracy", "answer_visual_gain", "answer_visual_gain_group", "visual_gain",
                                      "visual_gain_sum", "guarded_visual_gain"}
    # accuracy is TRL's accuracy_reward under the registry's name (TRL names its metrics by the function's name)
    from trl.rewards import accuracy_reward

    completions = [[{"role": "assistant", "content": c}] for c in (r"\boxed{\frac{1}{2}}", r"\boxed{3}")]
    solution = [r"$\frac{1}{2}$", "$4$"]
    assert R.accuracy(completions, solution) == accuracy_reward(completions, solution) == [1.0, 0.0]
    assert set(R.DEFAULT_REWARDS) <= set(R.REWARD_REGISTRY)
    assert len(R.DEFAULT_REWARD_WEIGHTS) == len(R.DEFAULT_REWARDS)
    funcs, weights = R.resolve_rewards(list(R.DEFAULT_REWARDS), list(R.DEFAULT_REWARD_WEIGHTS))
    assert funcs == [R.mc_idx, R.think_format, R.mdi_balance]
    assert weights == [4.0, 1.0, 1.0]
    # Registry rewards survive pickling (TRL's async rollout worker sends them to a child process).
    for fn in R.REWARD_REGISTRY.values():
        copy = pickle.loads(pickle.dumps(fn))
        assert copy is fn or copy == fn  # functions by reference; ThinkFormatReward (a frozen dataclass) by value


def test_required_inputs_agree_with_signatures():
    for name, fn in R.REWARD_REGISTRY.items():
        needs = R.required_reward_inputs(fn)
        columns = [n for n in needs if not S.trainer_field(n)]
        assert columns == ([R.REQUIRED_COLUMNS[name]] if name in R.REQUIRED_COLUMNS else []), name
    assert R.required_reward_inputs(R.mdi_balance) == ("mdi_balance",)
    assert R.required_reward_inputs(R.mdi_group) == ("mdi_group_score",)
    assert {n for fn in R.REWARD_REGISTRY.values() for n in R.required_reward_inputs(fn)
            if S.reward_field_pattern(n)} == {"mdi_balance", "mdi_group_score"}
    assert {n for fn in R.REWARD_REGISTRY.values() for n in R.required_reward_inputs(fn)
            if S.trainer_field(n) and not S.reward_field_pattern(n)} == {
        "answer_visual_gain", "answer_visual_gain_group_score", "visual_gain", "visual_gain_sum", "visual_gain_max"}
    assert R.required_reward_inputs(min_length_reward) == ()


def test_check_reward_inputs():
    from trl_mdi.rewards.inputs import check_reward_inputs

    check_reward_inputs(list(R.REWARD_REGISTRY.values())[:4], {"train": ["prompt", "image", "label_idx"]},
                        attention=True, segments=["early", "late"])
    with pytest.raises(ValueError, match=r"'mc_idx' needs column\(s\) \['label_idx'\].*'prompt'.*'label_idx' for mc_idx"):
        check_reward_inputs([R.mc_idx, R.mdi_balance], {"train": ["prompt", "image"]}, attention=True)
    with pytest.raises(ValueError, match="'accuracy' needs column.*solution"):
        check_reward_inputs([R.REWARD_REGISTRY["accuracy"]], {"eval": ["prompt", "label_idx"]}, attention=True)
    # A segment the model does not have is named, with the fields it does have.
    def late_reward(completions, mdi_late, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"needs column\(s\) \['mdi_late'\].*fields the trainer provides for this model: \[.*'mdi_middle'"):
        check_reward_inputs([late_reward], {"train": ["prompt"]}, attention=True, segments=["middle"])
    with pytest.raises(ValueError, match="compute_attention_metrics=True"):
        check_reward_inputs([late_reward], {"train": ["prompt"]}, attention=False)
    with pytest.raises(ValueError, match=r"has columns \['mdi'\] that the trainer fills"):
        check_reward_inputs([R.mc_idx], {"train": ["prompt", "label_idx", "mdi"]}, attention=True)
    check_reward_inputs([R.mc_idx], {"train": None}, attention=True)  # columns unknown: not checked


def test_resolve_rewards_default_weights_and_errors():
    assert R.resolve_rewards(["mc_idx", "think_format"])[1] == [1.0, 1.0]
    with pytest.raises(ValueError) as err:
        R.resolve_rewards(["mc_idx", "mdi_balanse"])
    text = str(err.value)
    assert "'mdi_balanse'" in text and "pkg.module:function" in text
    assert all(name in text for name in R.REWARD_REGISTRY)
    with pytest.raises(ValueError, match="2 reward weights for 3 reward functions"):
        R.resolve_rewards(list(R.DEFAULT_REWARDS), [4.0, 1.0])
    with pytest.raises(ValueError, match="share the name 'mc_idx'"):
        R.resolve_rewards(["mc_idx", "trl_mdi.rewards:mc_idx"])
    with pytest.raises(ValueError, match="no reward functions"):
        R.resolve_rewards([])


def test_resolve_rewards_by_import_path():
    funcs, weights = R.resolve_rewards(
        ["mc_idx", f"{__name__}:length_reward", f" {__name__}:min_length_reward "], [2.0, 0.5, 1]
    )
    assert funcs[1] is length_reward and funcs[2] is min_length_reward
    assert weights == [2.0, 0.5, 1.0]
    assert funcs[1](["abc", msg("hello")]) == [3.0, 5.0]
    assert funcs[2](["abc", msg("hello")]) == [0.0, 1.0]
    clone = pickle.loads(pickle.dumps(min_length_reward))
    assert clone.__name__ == "min_length_reward" and clone(["hello"]) == [1.0]


def test_resolve_rewards_import_path_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="No module named 'no_such_pkg_xyz'"):
        R.resolve_rewards(["no_such_pkg_xyz.rewards:fn"])
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        R.resolve_rewards([f"{__name__}:nope"])
    (tmp_path / "broken_reward_mod.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="RuntimeError: boom at import") as err:
        R.resolve_rewards(["broken_reward_mod:fn"])
    assert isinstance(err.value.__cause__, RuntimeError)
    with pytest.raises(TypeError, match="not a callable"):
        R.resolve_rewards([f"{__name__}:NOT_CALLABLE"])
    with pytest.raises(TypeError, match="is a class"):
        R.resolve_rewards([f"{__name__}:MinLengthReward"])
    with pytest.raises(ValueError, match="expected 'pkg.module:function'"):
        R.resolve_rewards([":fn"])


def test_reward_help_lists_every_registry_entry():
    help_text = R.reward_help()
    lines = help_text.splitlines()
    for name, fn in R.REWARD_REGISTRY.items():
        line = next(line for line in lines if line.split()[:1] == [name])
        first_doc_line = fn.__doc__.strip().splitlines()[0].strip()
        assert first_doc_line in line
    assert (
        "[dataset column: label_idx]" in help_text and "computed by the trainer: mdi_group_score" in help_text
    )
    assert "pkg.module:function" in help_text
    assert " ".join(R.DEFAULT_REWARDS) in lines[0]


def test_answer_visual_gain_rewards_are_clipped_and_ranked():
    """The reliance reward pays clip(g, 0, G) / G (G = ANSWER_GAIN_CLIP nats); None stays None; the group variant
    passes the trainer's rank through."""
    G = R.ANSWER_GAIN_CLIP
    assert R.answer_visual_gain(["a"] * 5, [-3.0, 0.0, G / 4, G, 10 * G]) == [0.0, 0.0, 0.25, 1.0, 1.0]
    assert R.answer_visual_gain(["a", "b"], [None, float("nan")]) == [None, None]
    with pytest.raises(ValueError, match="2 completions but 1"):
        R.answer_visual_gain(["a", "b"], [1.0])
    assert R.answer_visual_gain_group(["a", "b", "c"], [1.0, -1.0, None]) == [1.0, -1.0, None]


# ------------------------------------------------------------------------------------------ None and NaN counts


def test_count_outcomes_tells_none_from_nan():
    """None (not applicable) and NaN / inf (a failure) counted apart: TRL merges them into NaN right after."""
    assert R.count_outcomes([1.0, None, NAN, 0.0, None, -math.inf]) == (2, 2)
    assert R.count_outcomes(np.array([0.5, np.nan])) == (0, 1)  # numpy values, as a custom reward may return
    assert R.count_outcomes([torch.tensor(1.0), torch.tensor(NAN)]) == (0, 1)
    assert R.count_outcomes([]) == (0, 0)


def test_reward_tally_counts_each_call_and_keeps_names():
    def half_nan(completions, **kwargs):
        return [NAN if i % 2 else None for i in range(len(completions))]

    model = torch.nn.Linear(1, 1)  # a reward model: TRL calls it differently, left as it is

    async def async_reward(completions, **kwargs):
        return [1.0] * len(completions)

    tally = R.RewardTally([R.mc_idx, half_nan, model, async_reward])
    assert [getattr(f, "__name__", None) for f in tally.funcs[:2]] == ["mc_idx", "half_nan"]
    assert tally.funcs[2] is model and tally.funcs[3] is async_reward
    tally.funcs[1](completions=["a"] * 4)
    out = tally.funcs[0](completions=["Answer: A", "Answer: B", "x"], label_idx=[0, 0, None])
    assert out == [1.0, 0.0, None] and tally.counts[0] == (1, 0, 3)
    assert tally.counts[1] == (2, 2, 4) and tally.counts[2] == tally.counts[3] == (0, 0, 0)
    pickle.loads(pickle.dumps(R.RewardTally([R.mc_idx]).funcs[0]))  # picklable, like the rewards it wraps


def test_outcome_metrics_fractions_per_reward():
    metrics = R.outcome_metrics(["a_reward", "b_reward", "model"], torch.tensor([[0, 0, 8], [3, 1, 8], [0, 0, 0]]))
    assert metrics == {"rewards/a_reward/none_frac": 0.0, "rewards/a_reward/nan_frac": 0.0,
                       "rewards/b_reward/none_frac": 0.375, "rewards/b_reward/nan_frac": 0.125}
