"""Counterfactual reliance signals: brute-force references, answer spans on real tokenizations, the blind answer."""

import math
import random
import re

import numpy as np
import pytest
import torch
from PIL import Image

from trl_mdi import answer_tokens as AT
from trl_mdi import counterfactual as CF
from trl_mdi.tprl.perturb import perturb_images

try:
    from fixtures.tiny import tokenizer as tiny_tokenizer
except ImportError:  # before the move of the tiny builders out of the package
    from trl_mdi.tiny import tokenizer as tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    """The tiny Qwen2.5-VL byte-level BPE tokenizer, built offline."""
    return tiny_tokenizer.build_tokenizer("qwen2_5_vl", tiny_tokenizer.official_chat_template("qwen2_5_vl"), 8192)


# --------------------------------------------------------------------------------------------------------------
# visual_gain / answer_visual_gain
# --------------------------------------------------------------------------------------------------------------


def _random_case(seed, b=6, c=9):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, c, generator=g) * 5
    cf = -torch.rand(b, c, generator=g) * 5
    mask = torch.rand(b, c, generator=g) < 0.6
    mask[0] = False  # a row without tokens
    mask[1] = True
    lp[~mask] = float("nan")  # padding may hold anything
    cf[~mask] = float("-inf")
    return lp, cf, mask


@pytest.mark.parametrize("seed", range(3))
def test_visual_gain_is_the_masked_mean_difference(seed):
    lp, cf, mask = _random_case(seed)
    got = CF.visual_gain(lp, cf, mask.long())
    for b in range(lp.shape[0]):
        diffs = [float(lp[b, t] - cf[b, t]) for t in range(lp.shape[1]) if mask[b, t]]
        if diffs:
            assert got[b].item() == pytest.approx(sum(diffs) / len(diffs), abs=1e-6)
        else:
            assert math.isnan(got[b].item())


@pytest.mark.parametrize("seed", range(3))
def test_answer_visual_gain_is_the_span_sum(seed):
    lp, cf, mask = _random_case(seed)
    got = CF.answer_visual_gain(lp, cf, mask)
    for b in range(lp.shape[0]):
        diffs = [float(lp[b, t] - cf[b, t]) for t in range(lp.shape[1]) if mask[b, t]]
        if diffs:
            assert got[b].item() == pytest.approx(sum(diffs), abs=1e-5)
        else:
            assert math.isnan(got[b].item())


def test_rows_without_an_image_have_no_gain():
    lp, cf = torch.tensor([[-1.0, -1.0], [-1.0, -2.0]]), torch.tensor([[-1.0, -1.0], [-3.0, -3.0]])
    has_image = torch.tensor([False, True])
    assert CF.visual_gain(lp, cf, torch.ones(2, 2), has_image=has_image).tolist()[1] == 1.5
    assert math.isnan(CF.visual_gain(lp, cf, torch.ones(2, 2), has_image=has_image)[0])
    assert math.isnan(CF.answer_visual_gain(lp, cf, torch.ones(2, 2), has_image=has_image)[0])
    assert CF.visual_gain(lp, cf, torch.ones(2, 2))[0].item() == 0.0  # what has_image guards against
    with pytest.raises(ValueError, match="has_image must have shape"):
        CF.visual_gain(lp, cf, torch.ones(2, 2), has_image=torch.tensor([True]))


def test_gain_sign_dtype_and_shape_checks():
    lp = torch.tensor([[-0.1, -0.2]], dtype=torch.bfloat16)
    cf = torch.tensor([[-2.0, -3.0]], dtype=torch.bfloat16)
    gain = CF.visual_gain(lp, cf, torch.ones(1, 2))
    assert gain.dtype == torch.float32 and gain.item() > 0  # the image made the sampled tokens likelier
    assert CF.visual_gain(cf, lp, torch.ones(1, 2)).item() == pytest.approx(-gain.item())
    assert CF.answer_visual_gain(lp.double(), cf.double(), torch.ones(1, 2)).dtype == torch.float64
    with pytest.raises(ValueError, match="cf_logps has shape"):
        CF.visual_gain(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="must be 2-D"):
        CF.answer_visual_gain(torch.zeros(3), torch.zeros(3), torch.ones(3))


# --------------------------------------------------------------------------------------------------------------
# answer_span
# --------------------------------------------------------------------------------------------------------------


def _random_split(text, rng, max_len=4):
    """Split text into consecutive pieces of 1..max_len characters, with a few empty pieces mixed in."""
    pieces, i = [], 0
    while i < len(text):
        if rng.random() < 0.1:
            pieces.append("")
        n = rng.randint(1, max_len)
        pieces.append(text[i:i + n])
        i += n
    return pieces


def _covering_range(pieces, a, b):
    """Brute force: every token overlapping characters [a, b), then the empty tokens right before."""
    pos, hit = 0, []
    for i, p in enumerate(pieces):
        if any(a <= k < b for k in range(pos, pos + len(p))):
            hit.append(i)
        pos += len(p)
    start = hit[0]
    while start > 0 and pieces[start - 1] == "":
        start -= 1
    return start, hit[-1] + 1


@pytest.mark.parametrize("seed", range(20))
def test_answer_span_covers_exactly_the_letter_under_any_tokenization(seed):
    rng = random.Random(seed)
    letter = rng.choice("ABCD")
    tail = rng.choice(["", "\n", "  \n\n ", " "])
    text = f"<think>Answer: Z is wrong.\nIt is red.</think>\n  Answer: {letter}{tail}"
    pieces = _random_split(text, rng)
    at = text.rindex(f"Answer: {letter}") + len("Answer: ")
    span = AT.answer_span(pieces)
    assert span == _covering_range(pieces, at, at + 1)
    assert letter in "".join(pieces[span[0]:span[1]])


@pytest.mark.parametrize("text", [
    "<think>x</think>\nAnswer: B maybe",  # the last line must match fully
    "<think>x</think>\nAnswer: B\nor C",  # the answer is not on the last non-empty line
    "<think>x</think>\nAnswer: b",
    "<think>x\nAnswer: B</think>",  # an answer inside the think block is no answer
    "",
    " \n\t\n",
])
def test_answer_span_is_none_without_a_matching_last_line(text):
    assert AT.answer_span(list(text)) is None


def test_answer_on_the_think_closing_line_counts_after_the_tag():
    pieces = ["<think>", "It", " is", " red", ".", "</think>", " Answer", ":", " B"]
    assert AT.answer_span(pieces) == (8, 9)
    assert AT.answer_span(pieces, None) == (6, 9)
    from trl_mdi.answer_format import clean_format

    assert clean_format("".join(pieces))  # the format reward accepts the same completion


def test_answer_span_custom_patterns_and_errors():
    pieces = ["<think>", "x", "</think>", "\n", "Final", " choice", " is", " (", "C", ")", "."]
    assert AT.answer_span(pieces, r"Final choice is \((?P<letter>[A-D])\)\.") == (8, 9)
    assert AT.answer_span(pieces, re.compile(r"Final choice is \((?P<letter>[A-D])\)\.")) == (8, 9)
    assert AT.answer_span(pieces, r"Final choice is \((?P<letter>[A-B])\)\.") is None
    # the letter group may span several tokens
    assert AT.answer_span(["Pick", ":", " gr", "een"], r"Pick: (?P<letter>\w+)") == (2, 4)
    with pytest.raises(ValueError, match="named group"):
        AT.answer_span(pieces, r"Final (\w)")


def test_free_form_span_is_the_last_non_empty_line():
    pieces = ["<think>", "hm", "</think>", "\n", " It", " is", " red", ".", " \n", "\n"]
    assert AT.answer_span(pieces, None) == (4, 8)
    # a line that starts inside a token ("\nIt" is one token) still takes that token
    assert AT.answer_span(["ok", "\nIt", " is"], None) == (1, 3)
    assert AT.answer_span([], None) is None


def test_answer_span_on_a_real_tokenization(tok):
    text = "<think>The circle is red, café 日本.</think>\nAnswer: C"
    ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    texts = AT.completion_token_texts(tok, ids)
    start, end = AT.answer_span(texts)
    assert (end - start, tok.convert_ids_to_tokens(ids[start])) == (1, "ĠC")
    # free-form: the multi-byte line keeps its leading byte tokens, which decode to nothing on their own
    ids = tok.encode("<think>x</think>\n日本", add_special_tokens=False)
    texts = AT.completion_token_texts(tok, ids)
    start, end = AT.answer_span(texts, None)
    assert tok.decode(ids[start:end]) == "日本" and texts[start] == ""


def test_answer_span_mask():
    mask = AT.answer_span_mask([(0, 2), None, (3, 4)], 4)
    assert mask.dtype == torch.bool and mask.tolist() == [
        [True, True, False, False], [False] * 4, [False, False, False, True]]
    for bad in ((2, 5), (3, 3), (-1, 2)):
        with pytest.raises(ValueError, match="not a non-empty range"):
            AT.answer_span_mask([bad], 4)


# --------------------------------------------------------------------------------------------------------------
# completion_token_texts
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "<think>The circle is red.</think>\nAnswer: B",
    "café 日本 🙂 ½ naïve — “quoted” 𝔘𝔫𝔦",
    "🙂🙂🙂🙂🙂🙂🙂🙂 end",  # many split characters in a row, longer than the decoding context
    "  leading spaces and trailing\n\n",
])
def test_token_texts_concatenate_to_the_decoded_completion(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    texts = AT.completion_token_texts(tok, torch.tensor(ids))
    assert len(texts) == len(ids) and "".join(texts) == text == tok.decode(ids)
    for i, piece in zip(ids, texts):  # a token that decodes to whole characters gives exactly those
        alone = tok.decode([i])
        if "\ufffd" not in alone:
            assert piece == alone


def test_token_texts_of_random_ids_and_special_tokens(tok):
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 25))]
        for skip in (True, False):
            texts = AT.completion_token_texts(tok, ids, skip_special_tokens=skip)
            assert "".join(texts) == tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Answer: A", add_special_tokens=False) + [end]
    assert AT.completion_token_texts(tok, ids)[-1] == ""
    assert AT.completion_token_texts(tok, ids, skip_special_tokens=False)[-1] == "<|im_end|>"

    class Processor:  # a processor hands over its tokenizer
        tokenizer = tok

    assert AT.completion_token_texts(Processor(), ids) == AT.completion_token_texts(tok, ids)
    assert AT.completion_token_texts(tok, []) == []


class _MergingDecoder:
    """A decoder whose output is not prefix-stable: "a" then "b" decode together to "X"."""

    vocab = {0: "a", 1: "b", 2: "c"}

    def decode(self, ids, **kwargs):
        return "".join(self.vocab[i] for i in ids).replace("ab", "X")


def test_token_texts_fall_back_to_full_prefixes_for_unstable_decoders():
    texts = AT.completion_token_texts(_MergingDecoder(), [2, 0, 1, 2])
    assert texts == ["c", "", "X", "c"]


class _LeadingSpaceDecoder:
    """SentencePiece-like: "▁" is a space, and a decode drops the space its output starts with."""

    vocab = {0: "▁The", 1: "▁red", 2: "▁circle", 3: ".", 4: "▁Answer", 5: ":", 6: "▁B"}

    def decode(self, ids, **kwargs):
        return "".join(self.vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")


def test_token_texts_keep_the_spaces_a_windowed_decode_would_drop():
    ids = [0, 1, 2, 3, 1, 2, 3, 0, 1, 2, 4, 5, 6]  # longer than the decoding context
    texts = AT.completion_token_texts(_LeadingSpaceDecoder(), ids)
    pieces = [_LeadingSpaceDecoder.vocab[i].replace("▁", " ") for i in ids]
    assert texts == ["The", *pieces[1:]]  # every later token keeps its space, also past the context window


# --------------------------------------------------------------------------------------------------------------
# choice letters, their logits, blind_agrees
# --------------------------------------------------------------------------------------------------------------


def test_choice_letter_token_ids_on_the_tiny_tokenizer(tok):
    spaced = tok.convert_tokens_to_ids("ĠB")
    ids = AT.choice_letter_token_ids(tok, spaced, "ABCD")
    assert tok.convert_ids_to_tokens(ids) == ["ĠA", "ĠB", "ĠC", "ĠD"] and ids[1] == spaced
    assert all(len(tok.encode(f" {x}", add_special_tokens=False)) == 1 for x in "ABCD")
    bare = AT.choice_letter_token_ids(tok, tok.convert_tokens_to_ids("B"), "ABCDEFGH")
    assert tok.convert_ids_to_tokens(bare) == list("ABCDEFGH")
    assert tok.convert_tokens_to_ids("ĠQ") is None  # not in the tiny vocabulary, so no " Q" choice token:
    assert AT.choice_letter_token_ids(tok, spaced, "ABQ") is None
    assert AT.choice_letter_token_ids(tok, tok.convert_tokens_to_ids("Answer"), "AB") is None  # no lone capital

    class Processor:
        tokenizer = tok

    assert AT.choice_letter_token_ids(Processor(), spaced, "AB") == ids[:2]


class _ToyVocab:
    """A tokenizer with a hand-made vocabulary; unknown strings map to the unk id 0."""

    def __init__(self, tokens):
        self.tokens = ["<unk>", *tokens]

    def convert_ids_to_tokens(self, i):
        return self.tokens[i]

    def convert_tokens_to_ids(self, s):
        return self.tokens.index(s) if s in self.tokens else 0


def test_choice_letter_token_ids_on_a_toy_vocabulary():
    v = _ToyVocab(["▁A", "▁B", "▁C", "A", "B", "(B)", "(A)", "AB", "▁the", "▁D"])
    assert AT.choice_letter_token_ids(v, v.tokens.index("▁B"), "ABC") == [1, 2, 3]  # SentencePiece form
    assert AT.choice_letter_token_ids(v, v.tokens.index("▁B"), "CBAD") == [3, 2, 1, 10]  # order of letters
    assert AT.choice_letter_token_ids(v, v.tokens.index("(B)"), "AB") == [7, 6]  # punctuation kept
    assert AT.choice_letter_token_ids(v, v.tokens.index("(B)"), "ABC") is None  # "(C)" is not a token
    assert AT.choice_letter_token_ids(v, v.tokens.index("B"), "ABC") is None  # bare "C" is not either
    assert AT.choice_letter_token_ids(v, v.tokens.index("AB"), "AB") is None  # two capitals: ambiguous
    assert AT.choice_letter_token_ids(v, v.tokens.index("▁the"), "AB") is None
    with pytest.raises(ValueError, match="single characters"):
        AT.choice_letter_token_ids(v, 1, ["A", "BB"])


def test_gather_choice_logits_matches_indexing():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    positions = torch.tensor([4, -1, 0])
    cands = torch.tensor([[1, 2, 3, -1], [4, 5, 6, 7], [10, 0, -1, -1]])
    got = CF.gather_choice_logits(logits, positions, cands)
    for b in range(3):
        for k in range(4):
            if positions[b] < 0 or cands[b, k] < 0:
                assert math.isnan(got[b, k])
            else:
                assert got[b, k] == logits[b, positions[b], cands[b, k]]
    with pytest.raises(ValueError, match="expected logits"):
        CF.gather_choice_logits(logits[0], positions, cands)


def test_blind_agrees_against_a_loop():
    g = torch.Generator().manual_seed(1)
    b, k = 40, 6
    logits = torch.randint(0, 3, (b, k), generator=g).float()  # many ties
    n = torch.randint(1, k + 1, (b,), generator=g)
    answer = torch.randint(-1, k, (b,), generator=g)
    has_image = torch.rand(b, generator=g) < 0.8
    logits[torch.arange(k)[None, :] >= n[:, None]] = float("nan")  # padding beyond the row's choices
    got = CF.blind_agrees(logits, answer, n, has_image)
    assert got.dtype == torch.float32
    for i in range(b):
        if answer[i] < 0 or answer[i] >= n[i] or not has_image[i]:
            assert math.isnan(got[i])
            continue
        row = logits[i, : n[i]].tolist()
        first_max = row.index(max(row))  # ties: the lowest index
        assert got[i].item() == float(first_max == answer[i])
    assert not torch.isnan(got).all() and (got == 1).any() and (got == 0).any()
    # a candidate letter without a logit (no token for it) leaves the row undefined, not decided by NaN
    partial = torch.tensor([[1.0, float("nan"), 0.0], [1.0, 0.0, float("nan")]])
    got = CF.blind_agrees(partial, torch.tensor([0, 0]), torch.tensor([3, 2]), torch.tensor([True, True]))
    assert math.isnan(got[0]) and got[1].item() == 1.0


def test_blind_agrees_errors():
    with pytest.raises(ValueError, match="n_choices exceeds"):
        CF.blind_agrees(torch.zeros(1, 2), torch.tensor([0]), torch.tensor([3]), torch.tensor([True]))
    with pytest.raises(ValueError, match="has_image must have shape"):
        CF.blind_agrees(torch.zeros(2, 2), torch.tensor([0, 1]), torch.tensor([2, 2]), torch.tensor([True]))


# --------------------------------------------------------------------------------------------------------------
# strip_images
# --------------------------------------------------------------------------------------------------------------


def test_strip_images_keeps_text_in_order_and_leaves_the_input_alone(tok):
    img = Image.new("RGB", (8, 8))
    msgs = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Left:"}, {"type": "image", "image": img},
                                     {"type": "text", "text": "Right:"}, {"type": "image"},
                                     {"type": "image_url", "image_url": {"url": "x.png"}},
                                     {"type": "text", "text": "Same colour?"}]},
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": [{"type": "image"}]},
    ]
    before = repr(msgs)
    out = CF.strip_images(msgs)
    assert repr(msgs) == before and out is not msgs and out[1] is not msgs[1]
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert [p["text"] for p in out[1]["content"]] == ["Left:", "Right:", "Same colour?"]
    assert out[0] == msgs[0] and out[2] == msgs[2] and out[3]["content"] == []
    assert CF.strip_images("plain prompt") == "plain prompt"
    rendered = tok.apply_chat_template(out[:3], tokenize=False)
    assert "<|vision_start|>" not in rendered and rendered.index("Left:") < rendered.index("Same colour?")
    assert "<|vision_start|>" in tok.apply_chat_template(msgs[:3], tokenize=False)


# --------------------------------------------------------------------------------------------------------------
# End to end on a tiny Qwen2.5-VL: the forward the trainer will run
# --------------------------------------------------------------------------------------------------------------


def test_counterfactual_forward_on_a_tiny_vlm():
    from fixtures.tiny import build_tiny_vlm

    model, proc = build_tiny_vlm("qwen2_5_vl")
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?\nA. red\nB. blue"}]}]
    completion = proc.tokenizer.encode("<think>It is red.</think>\nAnswer: B", add_special_tokens=False)
    c = len(completion)

    def teacher_forced(messages, images):
        prompt = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        enc = proc(text=[prompt], images=images, return_tensors="pt")
        ids = torch.cat([enc.pop("input_ids"), torch.tensor([completion])], 1)
        enc.pop("attention_mask")
        if "mm_token_type_ids" in enc:
            enc["mm_token_type_ids"] = torch.cat([enc["mm_token_type_ids"], torch.zeros(1, c, dtype=torch.long)], 1)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **enc).logits[:, -c - 1:-1]
        logps = logits.log_softmax(-1).gather(-1, torch.tensor([completion])[..., None])[..., 0]
        return ids[:, :-c], logits, logps

    prompt_ids, logits, logps = teacher_forced(msgs, [img])
    grey = perturb_images([img], "grey", seed=0, step=0)[0]
    # The grey counterfactual is a uniform mid-grey (128) RGB image of the real one's size, written here by hand;
    # a 3:2 image too, so a swapped width and height would show
    assert grey.size == (56, 56) and np.array_equal(np.asarray(grey), np.full((56, 56, 3), 128, dtype=np.uint8))
    wide = perturb_images([Image.new("RGB", (6, 4), (10, 200, 30))], "grey", seed=0, step=0)[0]
    assert wide.mode == "RGB" and np.asarray(wide).tolist() == [[[128, 128, 128]] * 6] * 4
    grey_ids, grey_logits, grey_logps = teacher_forced(msgs, [grey])
    assert torch.equal(prompt_ids, grey_ids)  # same size: same image tokens at the same positions
    text_ids, _, text_logps = teacher_forced(CF.strip_images(msgs), None)
    assert text_ids.shape[1] < prompt_ids.shape[1]  # no image tokens; the completion is aligned all the same

    mask = torch.ones(1, c)
    assert CF.visual_gain(logps, teacher_forced(msgs, [img])[2], mask).item() == 0.0
    # visual_gain against the per-token mean of the stored log-probs, summed here token by token: over the whole
    # completion, and over its last 4 tokens only (a partial mask)
    tail = torch.zeros(1, c)
    tail[0, -4:] = 1
    for cf in (grey_logps, text_logps):
        diffs = [logps[0, t].item() - cf[0, t].item() for t in range(c)]
        assert max(abs(d) for d in diffs) > 1e-3  # the image changes this model's log-probs: not vacuous
        assert CF.visual_gain(logps, cf, mask).item() == pytest.approx(sum(diffs) / c, abs=1e-6)
        assert CF.visual_gain(logps, cf, tail).item() == pytest.approx(sum(diffs[-4:]) / 4, abs=1e-6)

    span = AT.answer_span(AT.completion_token_texts(proc, completion))
    span_mask = AT.answer_span_mask([span], c)
    assert span == (c - 1, c)  # "... Answer: B": the letter is the last token
    for cf in (grey_logps, text_logps):  # the span's sum of the stored per-token differences
        want = sum(logps[0, t].item() - cf[0, t].item() for t in range(*span))
        assert CF.answer_visual_gain(logps, cf, span_mask).item() == pytest.approx(want, abs=1e-6)
    at = span[1] - 1  # the token holding the letter
    letters = AT.choice_letter_token_ids(proc, completion[at], "AB")
    choice = CF.gather_choice_logits(grey_logits, torch.tensor([at]), torch.tensor([letters]))
    agrees = CF.blind_agrees(choice, torch.tensor([1]), torch.tensor([2]), torch.tensor([True]))
    assert agrees.item() == float(grey_logits[0, at, letters].argmax().item() == 1)


def test_the_sum_max_and_confidence_forms_follow_their_formulas():
    """visual_gain_sum, visual_gain_max and answer_logprob (trl_mdi.signals) against loops over the tokens."""
    from types import SimpleNamespace

    from trl_mdi import signals as S

    g = torch.Generator().manual_seed(3)
    logps, cf = -torch.rand(3, 5, generator=g) * 3, -torch.rand(3, 5, generator=g) * 3
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    span = torch.tensor([[0, 0, 1, 0, 0], [0, 0, 0, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    answers = SimpleNamespace(span_mask=span, letter_position=torch.tensor([2, 3, -1]),
                              answer_index=torch.tensor([0, 1, -1]), n_choices=torch.tensor([4, 4, 4]))
    has_image = torch.tensor([True, True, True])
    policy, counterfactual = S.PolicyForward(logps=logps), S.CounterfactualForward(cf, None, answers)
    values = S.counterfactual_signals(S.CounterfactualInputs.of(policy, counterfactual, mask, has_image))
    for b in range(2):
        gains = [float(logps[b, t] - cf[b, t]) for t in range(5) if mask[b, t]]
        assert values["visual_gain_sum"][b].item() == pytest.approx(sum(gains), abs=1e-5)
        assert values["visual_gain_max"][b].item() == pytest.approx(max(gains), abs=1e-6)
        assert values["answer_logprob"][b].item() == pytest.approx(
            sum(float(logps[b, t]) for t in range(5) if span[b, t]), abs=1e-6)
    assert all(torch.isnan(values[n][2]) for n in ("visual_gain_sum", "visual_gain_max", "answer_logprob"))
    assert "blind_agrees" not in values  # no choice logits read: left out, not invented
    no_image = S.counterfactual_signals(S.CounterfactualInputs.of(policy, counterfactual, mask,
                                                                  torch.tensor([False, True, True])))
    assert torch.isnan(no_image["visual_gain_sum"][0]) and torch.isnan(no_image["visual_gain_max"][0])
