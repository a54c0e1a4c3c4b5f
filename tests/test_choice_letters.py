"""Any number of choices up to 26: one definition of the choice letters (A to Z, ``trl_mdi.answer_format.LETTERS``)
read by the parser, the format, the A-OKVQA prep, the answer tokens and the evaluation; a row with 12 or 26 choices
gets a blind answer whichever letter it answered (A, E and K alike), in the pure functions and through training; a
row with 27 choices is refused at data load.

The tiny tokenizer has single tokens only for " A" .. " D" and " X", so the letter tests build the tiny model with
``all_capital_letters=True`` (every " A" .. " Z" one token; the default vocabulary is unchanged).
"""

from __future__ import annotations

import ast
import io
import math
from pathlib import Path

import datasets
import pytest
import torch
from PIL import Image

from trl_mdi.answer_format import DEFAULT_ANSWER_PATTERN, LETTERS, clean_format, valid_letters

PREFIX = "<think>look</think>\nAnswer:"
ARCH = "qwen2_5_vl"
CHOICE_WORDS = [f"option {i}" for i in range(26)]


@pytest.fixture(scope="module")
def letters_tokenizer():
    """The tiny Qwen2.5-VL tokenizer with every capital letter a token after a space."""
    from fixtures.tiny.tokenizer import build_tokenizer, official_chat_template

    return build_tokenizer(ARCH, official_chat_template(ARCH), 4096, all_capital_letters=True)


def letter_ids(tok) -> dict[str, int]:
    """" A" .. " Z" -> its one token id, read by encoding the text (not by the surface-form lookup under test)."""
    out = {}
    for letter in LETTERS:
        ids = tok.encode(f" {letter}", add_special_tokens=False)
        assert len(ids) == 1, (letter, ids)
        out[letter] = ids[0]
    return out


def answer_completion(tok, letter: str) -> list[int]:
    """``<think>look</think>\\nAnswer: X`` as the model would sample it: the prefix's tokens, then the letter's."""
    prefix = tok.encode(PREFIX, add_special_tokens=False)
    full = tok.encode(f"{PREFIX} {letter}", add_special_tokens=False)
    assert full[: len(prefix)] == prefix and len(full) == len(prefix) + 1, (letter, full)
    return full


def test_the_all_letters_tokenizer_is_an_opt_in_with_the_same_special_tokens(letters_tokenizer):
    """The default tiny tokenizer has no single token for " E" (why the option exists); the opt-in has one for every
    letter and keeps the default's special token ids, so the tiny processors and model configs stay valid."""
    from fixtures.tiny.tokenizer import build_tokenizer, official_chat_template

    default = build_tokenizer(ARCH, official_chat_template(ARCH), 4096)
    assert len(default.encode(" E", add_special_tokens=False)) == 2
    assert len(letter_ids(letters_tokenizer)) == 26
    assert {t: letters_tokenizer.convert_tokens_to_ids(t) for t in default.all_special_tokens} == \
        {t: default.convert_tokens_to_ids(t) for t in default.all_special_tokens}


# --------------------------------------------------------------------------------------------- one definition


def test_one_definition_of_the_choice_letters():
    """Every reader holds the same object, A to Z, and no module of the library spells its own letter string."""
    import trl_mdi.answer_tokens
    import trl_mdi.aokvqa
    import trl_mdi.evaluation
    import trl_mdi.rewards
    import trl_mdi.rewards.parsing

    assert LETTERS == "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    for module in (trl_mdi.rewards, trl_mdi.rewards.parsing, trl_mdi.answer_tokens, trl_mdi.aokvqa,
                   trl_mdi.evaluation):
        assert module.LETTERS is LETTERS, module.__name__
    package = Path(trl_mdi.answer_tokens.__file__).parent
    definers = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                    isinstance(node.value.value, str) and "ABCDEFGH" in node.value.value:
                definers.append(str(path.relative_to(package)))
    assert definers == ["answer_format.py"]


def test_the_parser_the_format_and_the_prompt_read_all_26_letters():
    from trl_mdi.aokvqa import format_prompt
    from trl_mdi.evaluation import score_completions
    from trl_mdi.rewards import extract_choice_letter, mc_idx

    twelve = CHOICE_WORDS[:12]
    assert format_prompt("Which?", twelve).splitlines()[-1] == "L. option 11"
    assert format_prompt("Which?", CHOICE_WORDS).splitlines()[-1] == "Z. option 25"
    assert extract_choice_letter("Answer: K", 12) == "K" and extract_choice_letter("Answer: M", 12) is None
    assert extract_choice_letter("Answer: Z", 26) == "Z"
    assert clean_format("<think>x</think>\nAnswer: L", choices=twelve)
    assert not clean_format("<think>x</think>\nAnswer: M", choices=twelve)
    assert valid_letters(CHOICE_WORDS) == LETTERS
    rewards = mc_idx(["Answer: K", "Answer: E", "Answer: Z"], [10, 10, 25],
                            choices=[twelve, twelve, CHOICE_WORDS])
    assert rewards == [1.0, 0.0, 1.0]
    result = score_completions(["Answer: K", "Answer: Z"], [10, 24], [12, 26])
    assert result.accuracy == 0.5 and result.letters == {"K": 1, "Z": 1}
    with pytest.raises(ValueError, match="row 1 has 27 choices, more than the 26 choice letters A to Z"):
        score_completions(["Answer: A", "Answer: A"], [0, 0], [4, 27])


# ------------------------------------------------------------------------------------------ the answer tokens


@pytest.mark.parametrize("n", [12, 26])
def test_answer_tokens_give_every_choice_a_candidate(letters_tokenizer, n):
    """A 12- (26-) choice row answering A, E, K (and the last letter) gets n candidates, its letter's index, and
    n_choices = n: the candidates agree with n_choices whichever letter was answered."""
    from trl_mdi.answer_tokens import answer_tokens

    tok = letters_tokenizer
    answered = ["A", "E", "K", LETTERS[n - 1]]
    rows = [answer_completion(tok, letter) for letter in answered]
    width = max(map(len, rows)) + 2
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    got = answer_tokens(tok, ids, mask, [CHOICE_WORDS[:n]] * len(rows), DEFAULT_ANSWER_PATTERN)
    want = [letter_ids(tok)[letter] for letter in LETTERS[:n]]
    assert got.candidates.tolist() == [want] * len(rows)
    assert got.n_choices.tolist() == [n] * len(rows)
    assert got.answer_index.tolist() == [LETTERS.index(letter) for letter in answered]
    assert got.letter_position.tolist() == [len(row) - 1 for row in rows]


@pytest.mark.parametrize("n", [12, 26])
def test_blind_agrees_is_defined_for_A_E_and_K(letters_tokenizer, n):
    """blind_agrees over the candidates of a 12- (26-) choice row: 1 exactly where the argmax of the counterfactual
    logits over the row's n letter tokens (read here straight from the logits) is the answered letter."""
    from trl_mdi.answer_tokens import answer_tokens
    from trl_mdi.counterfactual import blind_agrees, gather_choice_logits

    tok = letters_tokenizer
    answered = ["A", "E", "K", "K", "E", "A"]
    rows = [answer_completion(tok, letter) for letter in answered]
    ids = torch.tensor(rows)  # same length each: the letter is one token
    answers = answer_tokens(tok, ids, torch.ones_like(ids), [CHOICE_WORDS[:n]] * len(rows), DEFAULT_ANSWER_PATTERN)
    logits = torch.randn(len(rows), ids.shape[1], len(tok), generator=torch.Generator().manual_seed(n))
    # Rows 3-5: make the blind argmax the answered letter itself, so both verdicts occur.
    letters = letter_ids(tok)
    for i in range(3, 6):
        logits[i, -1, letters[answered[i]]] = 100.0
    cf = gather_choice_logits(logits, answers.letter_position, answers.candidates)
    got = blind_agrees(cf, answers.answer_index, answers.n_choices, torch.ones(len(rows), dtype=torch.bool))
    column = [letters[letter] for letter in LETTERS[:n]]
    want = [float(LETTERS[int(logits[i, -1, column].argmax())] == answered[i]) for i in range(len(rows))]
    assert got.tolist() == want
    assert want[3:] == [1.0, 1.0, 1.0] and not any(math.isnan(v) for v in got.tolist())


def test_answer_tokens_refuse_27_choices(letters_tokenizer):
    from trl_mdi.answer_tokens import answer_tokens

    ids = torch.tensor([answer_completion(letters_tokenizer, "A")])
    with pytest.raises(ValueError, match="rollout 0 of the batch has 27 choices, more than the 26 choice letters A to "
                                         "Z.*len\\(row\\['choices'\\]\\) <= 26"):
        answer_tokens(letters_tokenizer, ids, torch.ones_like(ids), [CHOICE_WORDS + ["one more"]],
                      DEFAULT_ANSWER_PATTERN)


# ------------------------------------------------------------------------------- 27 choices at data load


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_a_27_choice_row_is_a_data_load_error(tmp_path):
    from trl_mdi.data import DataArguments, DatasetError, load_training_data

    counts = [4, 26, 27, 12, 30]
    rows = {"image": [{"bytes": _png(), "path": None} for _ in counts],
            "prompt": [f"Question {i}?" for i in range(len(counts))], "label_idx": [0] * len(counts),
            "choices": [[f"option {k}" for k in range(n)] for n in counts],  # distinct: a duplicate is an error
            "question_id": [f"q{i}" for i in range(len(counts))]}
    ds = datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image())
    (tmp_path / "data").mkdir()
    ds.to_parquet(str(tmp_path / "data" / "train.parquet"))
    with pytest.raises(DatasetError) as info:
        load_training_data(DataArguments(dataset_path=str(tmp_path / "data")), log=lambda *a, **k: None)
    message = str(info.value)
    assert message.startswith("row 2 of split 'train' (question_id 'q2') has 27 choices, more than the 26 choice "
                              "letters A to Z")
    assert "len(row['choices']) <= 26" in message
    assert "2 rows of 'train' have more than 26 choices: rows 2 (question_id 'q2'), 4 (question_id 'q4')" in message
    # The same rows without the long ones load, 26 choices included.
    ds.select([0, 1, 3]).to_parquet(str(tmp_path / "data" / "train.parquet"))
    loaded = load_training_data(DataArguments(dataset_path=str(tmp_path / "data")), log=lambda *a, **k: None)
    assert [len(c) for c in loaded.train["choices"]] == [4, 26, 12]


def test_the_check_reads_rows_after_a_selection_and_lists_of_dicts():
    from trl_mdi.data import DatasetError, check_choice_counts

    ds = datasets.Dataset.from_dict({"choices": [["a"] * 3, None, ["b"] * 27], "prompt": ["x", "y", "z"]})
    check_choice_counts(ds.select([0, 1]), "train")  # a null counts as no choices
    with pytest.raises(DatasetError, match="^row 0 of split 'eval' has 27 choices"):
        check_choice_counts(ds.select([2, 0]), "eval")
    with pytest.raises(DatasetError, match="^row 1 of split 'train' \\(question_id 'b'\\) has 28 choices"):
        check_choice_counts([{"choices": ["a"], "question_id": "a"}, {"choices": ["a"] * 28, "question_id": "b"}])
    check_choice_counts(datasets.Dataset.from_dict({"prompt": ["no choices column"]}))


def test_the_aokvqa_prep_skips_a_27_choice_row_with_its_own_reason():
    from trl_mdi.aokvqa import SKIP_TOO_MANY_CHOICES, convert_row

    def row(n):
        return {"question_id": f"q{n}", "image": {"bytes": _png(), "path": None}, "question": "Which?",
                "choices": CHOICE_WORDS[:1] * n, "correct_choice_idx": n - 1}

    out, reason = convert_row(row(26))
    assert reason is None and out["prompt"].splitlines()[-1] == "Z. option 0" and out["label_idx"] == 25
    assert convert_row(row(27)) == (None, SKIP_TOO_MANY_CHOICES)
    assert "more than 26 choices" in SKIP_TOO_MANY_CHOICES and "A to Z" in SKIP_TOO_MANY_CHOICES


# --------------------------------------------------------------------------------------------- through training


@pytest.fixture(scope="module")
def letters_model_dir(tmp_path_factory):
    """The tiny Qwen2.5-VL built by the fixtures' own builder with the all-letters tokenizer (its embedding table
    sized for it); the builder takes no tokenizer option, so its tokenizer function is swapped while it builds."""
    from functools import partial

    import fixtures.tiny as tiny
    from fixtures.tiny.tokenizer import build_tokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny, "build_tokenizer", partial(build_tokenizer, all_capital_letters=True))
        return tiny.save_tiny_vlm(ARCH, tmp_path_factory.mktemp("tiny-all-letters"))


def choice_dataset(n_choices: int, rows: int = 2):
    """``rows`` rows of one question with ``n_choices`` lettered choices, each with its own shape image."""
    from fixtures.testing import shape_image

    choices = CHOICE_WORDS[:n_choices]
    prompt = "Which option is shown?\n" + "\n".join(f"{LETTERS[k]}. {c}" for k, c in enumerate(choices))
    return datasets.Dataset.from_dict({
        "prompt": [[{"role": "user", "content": prompt}]] * rows,
        "image": [shape_image(56, seed=i) for i in range(rows)],
        "choices": [choices] * rows,
        "label_idx": [4] * rows,
    })


class BlindAgreesProbe:
    """A reward that reads ``blind_agrees``, records what it receives per rollout, and pays nothing."""

    __name__ = "blind_agrees_probe"

    def __init__(self):
        self.calls = []

    def __call__(self, completions, blind_agrees, completion_ids, prompts, **kwargs):
        self.calls.append({"blind_agrees": list(blind_agrees), "completion_ids": [list(c) for c in completion_ids],
                           "prompts": prompts})
        return [0.0] * len(completions)


def blind_letter(model_dir, ds, n_choices: int) -> tuple[str, str]:
    """The letter the model writes after ``PREFIX`` with the black counterfactual image (argmax over the row's n
    letter tokens), from one plain forward of the prompt and the prefix alone, and the rendered prompt text.

    The logits at the letter's position depend on the prompt and the prefix only (a causal model), not on the letter
    written there; every row has the same text and a 56x56 image, so their black counterfactuals are identical."""
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl.data_utils import prepare_multimodal_messages

    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    black = Image.new("RGB", ds[0]["image"].size, (0, 0, 0))
    messages = prepare_multimodal_messages([dict(m) for m in ds[0]["prompt"]], images=[black])
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=[[black]], return_tensors="pt")
    prefix = processor.tokenizer.encode(PREFIX, add_special_tokens=False)
    ids = torch.cat([enc["input_ids"], torch.tensor([prefix])], dim=1)
    extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    extra["mm_token_type_ids"] = torch.cat([extra["mm_token_type_ids"],
                                            torch.zeros(1, len(prefix), dtype=torch.long)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0, -1].float()
    letters = letter_ids(processor.tokenizer)
    column = [letters[letter] for letter in LETTERS[:n_choices]]
    return LETTERS[int(logits[column].argmax())], text


@pytest.mark.parametrize("n_choices", [12, 26])
def test_training_gives_a_blind_answer_for_A_E_and_K(letters_model_dir, tmp_path, monkeypatch, n_choices):
    """One MDIGRPOTrainer step on a 12- (26-) choice row, reliance signals on (a reward reads blind_agrees), the four
    rollouts scripted to answer A, E, K and the letter the model itself picks with the black image: every rollout
    gets a blind answer, 1 exactly for the rollout(s) whose letter is the blind one."""
    from test_trainer import make_args
    from transformers import AutoProcessor
    from trl import GRPOTrainer

    from trl_mdi.trainer import MDIGRPOTrainer

    ds = choice_dataset(n_choices)
    blind, prompt_text = blind_letter(letters_model_dir, ds, n_choices)
    answered = ["A", "E", "K", blind]
    processor = AutoProcessor.from_pretrained(letters_model_dir)
    tok = processor.tokenizer
    scripted = [answer_completion(tok, letter) + [tok.eos_token_id] for letter in answered]

    def generate(trainer, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        return [scripted[i % len(scripted)] for i in range(len(prompt_ids))], None

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", generate)
    probe = BlindAgreesProbe()
    trainer = MDIGRPOTrainer(str(letters_model_dir), reward_funcs=[probe],
                             args=make_args(tmp_path, max_steps=1, counterfactual_image="black"),
                             train_dataset=ds)
    trainer.train()
    assert len(probe.calls) == 1
    call = probe.calls[0]
    assert call["completion_ids"] == scripted
    # The reference's prompt is the one the trainer encoded.
    assert all(processor.apply_chat_template(p, add_generation_prompt=True, tokenize=False) == prompt_text
               for p in call["prompts"])
    assert call["blind_agrees"] == [float(letter == blind) for letter in answered], (answered, call["blind_agrees"])
    assert [h for h in trainer.state.log_history if "loss" in h][0]["reliance/answer_rate"] == 1.0


def test_a_trainer_given_a_27_choice_dataset_refuses_it_at_construction(tiny_vlm_dir, tmp_path, monkeypatch):
    """A TRL user hands datasets to the trainer directly: construction is their data load. The error comes before any
    weight or processor loads (the loaders are made to fail loudly if reached)."""
    import transformers

    from trl_mdi import MDIGRPOConfig, MDIGRPOTrainer
    from trl_mdi.data import DatasetError

    def no_load(*args, **kwargs):
        raise AssertionError("loaded something before the data check")

    model = str(tiny_vlm_dir("qwen2_5_vl"))
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", no_load)
    train = datasets.Dataset.from_dict({"prompt": ["x"] * 2, "label_idx": [0, 0],
                                        "choices": [list("abcd"), [f"b{k}" for k in range(27)]]})
    args = MDIGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=2,
                         num_generations=2, max_completion_length=4)
    with pytest.raises(DatasetError, match="^row 1 of split 'train_dataset' has 27 choices, more than the 26"):
        MDIGRPOTrainer(model, args=args, train_dataset=train)
    evals = {"held": datasets.Dataset.from_dict({"prompt": ["x"], "choices": [["c"] * 30]})}
    with pytest.raises(DatasetError, match="^row 0 of split 'held' has 30 choices"):
        MDIGRPOTrainer(model, args=args, train_dataset=train.select([0]), eval_dataset=evals)
