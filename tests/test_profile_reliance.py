"""``trl_mdi.profile.reference``: the reference reliance signals equal a brute-force computation (two plain forwards per
rollout, unbatched, written here) within 1e-5; on a model whose image cannot change the output they are 0 and the
blind answer agrees; ``python -m trl_mdi.profile --reliance`` runs end to end and writes its section; bad flags fail
before any weight is loaded."""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image
from test_profile import run_profile

from fixtures.testing import shape_image
from trl_mdi import signals as S
from trl_mdi.profile import parse_args
from trl_mdi.profile import validation as R
from trl_mdi.profile.reference import reference_signals
from trl_mdi.profile.reliance_report import data_prior_label
from trl_mdi.tprl.perturb import perturb_images

QUESTION = "What colour is the shape in the image?\nA. red\nB. green\nC. blue\nD. yellow"
CHOICES = ["red", "green", "blue", "yellow"]
COMPLETIONS = ["<think>x</think>\nAnswer: B", "<think>the shape is round and blue</think>\nAnswer: C", "red",
               "<think>y</think>\nAnswer: A"]


@pytest.fixture(scope="module")
def tiny():
    from fixtures.tiny import build_tiny_vlm

    return build_tiny_vlm("qwen2_5_vl")


@pytest.fixture(scope="module")
def blind_model():
    """A tiny Qwen2.5-VL whose image cannot change the output: the vision merger's last projection is zero, so every
    image token's embedding is 0 whatever the pixels (the token positions still depend on the image's size)."""
    from fixtures.tiny import build_tiny_vlm

    model, proc = build_tiny_vlm("qwen2_5_vl")
    last = model.model.visual.merger.mlp[2]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.zero_()
    return model, proc


def _rows():
    """Rollouts of different prompt and completion lengths: three with an image (two with choices), one text-only."""
    prompts = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
               [{"role": "user", "content": QUESTION + "\nLook closely."}],
               [{"role": "user", "content": "Shape?"}],
               [{"role": "user", "content": QUESTION}]]
    images = [[shape_image(56, 0)], [shape_image(56, 2)], [shape_image(56, 1)], []]
    return prompts, images, [CHOICES, CHOICES, None, CHOICES]


# ------------------------------------------------------------------------------- brute force, written separately


def _messages(prompt, n_images):
    """The prompt with ``n_images`` image parts before the first user turn's text, written out by hand."""
    out = []
    for m in prompt:
        if m["role"] == "user" and n_images:
            parts = [{"type": "image"}] * n_images + [{"type": "text", "text": m["content"]}]
            out.append({"role": "user", "content": parts})
            n_images = 0
        else:
            out.append({"role": m["role"], "content": [{"type": "text", "text": m["content"]}]})
    return out


@torch.no_grad()
def _forward(model, proc, prompt, imgs, completion):
    """One row, no padding: the processor's own encoding, the completion appended; (C + 1, V) float64 logits at the
    positions that predict each completion token and the one after it."""
    text = proc.apply_chat_template(_messages(prompt, len(imgs)), add_generation_prompt=True, tokenize=False)
    enc = proc(text=[text], images=list(imgs) or None, return_tensors="pt")
    ids = torch.cat([enc.pop("input_ids"), torch.tensor([completion], dtype=torch.long)], dim=1)
    enc.pop("attention_mask")
    if "mm_token_type_ids" in enc:  # one type per token: the completion's are text (0)
        zeros = torch.zeros(1, len(completion), dtype=torch.long)
        enc["mm_token_type_ids"] = torch.cat([enc["mm_token_type_ids"], zeros], 1)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **enc).logits[0].double()
    return logits[-len(completion) - 1:]


def _brute(model, proc, prompt, imgs, cf_imgs, completion, letter_at, letter_ids, answer):
    """(visual_gain, answer_visual_gain, blind_agrees) of one rollout from two forwards; letter_at: the index of the
    answer letter's token (None without one)."""
    c = len(completion)
    target = torch.tensor(completion)
    real = _forward(model, proc, prompt, imgs, completion)[:c].log_softmax(-1)[torch.arange(c), target]
    cf_logits = _forward(model, proc, prompt, cf_imgs, completion)[:c]
    cf = cf_logits.log_softmax(-1)[torch.arange(c), target]
    gain = (real - cf).mean().item()
    if letter_at is None:
        return gain, None, None
    blind = float(int(cf_logits[letter_at, letter_ids].argmax()) == answer)
    return gain, (real - cf)[letter_at].item(), blind


def _letter_ids(tok):
    return tok.convert_tokens_to_ids(["ĠA", "ĠB", "ĠC", "ĠD"])


@pytest.mark.parametrize("kind", ["grey", "patch_blackening", "none"])
def test_reference_signals_equal_two_plain_forwards_by_hand(tiny, kind):
    model, proc = tiny
    tok = proc.tokenizer
    prompts, images, choices = _rows()
    completions = [tok.encode(t, add_special_tokens=False) for t in COMPLETIONS]
    out = reference_signals(model, proc, prompts, images, completions, kind, choices=choices, seed=3, step=7,
                            row_offset=10)
    for i, (prompt, imgs, completion) in enumerate(zip(prompts, images, completions)):
        if not imgs:  # a text-only rollout has no counterfactual
            assert all(math.isnan(out[n][i]) for n in ("visual_gain", "answer_visual_gain", "blind_agrees"))
            continue
        # The counterfactual as the trainer draws it for row row_offset + i (nothing drawn for "none")
        cf_imgs = [] if kind == "none" else perturb_images([imgs], kind, seed=3, step=7, row_offset=10 + i)[0]
        has_letter = choices[i] is not None
        at = len(completion) - 1 if has_letter else None  # "... Answer: X": the last token holds the letter
        answer = "ABCD".index(COMPLETIONS[i][-1]) if has_letter else None
        gain, answer_gain, blind = _brute(model, proc, prompt, imgs, cf_imgs, completion, at, _letter_ids(tok), answer)
        assert out["visual_gain"][i].item() == pytest.approx(gain, abs=1e-5)
        assert gain != 0.0  # the image matters to this model: the check is not vacuous
        if has_letter:
            assert out["answer_visual_gain"][i].item() == pytest.approx(answer_gain, abs=1e-5)
            assert out["blind_agrees"][i].item() == blind and out["letter_position"][i] == at
        else:
            assert math.isnan(out["blind_agrees"][i])
    # The same rollouts' own log-probs, under the real image, from a plain forward by hand (row 1: the longest prompt)
    target = torch.tensor(completions[1])
    by_hand = _forward(model, proc, prompts[1], images[1], completions[1])[:-1].log_softmax(-1)
    c = len(completions[1])
    assert torch.allclose(out["logps"][1, :c].double(), by_hand[torch.arange(c), target], atol=1e-5)


def test_rows_reproduce_the_trainers_row_offset(tiny):
    model, proc = tiny
    prompts, images, choices = _rows()
    ids = [proc.tokenizer.encode(t, add_special_tokens=False) for t in COMPLETIONS]
    a = reference_signals(model, proc, prompts, images, ids, "patch_blackening", choices=choices, row_offset=4,
                          attention=False)
    b = reference_signals(model, proc, prompts, images, ids, "patch_blackening", choices=choices, rows=[4, 5, 6, 7],
                          attention=False)
    assert torch.equal(a["cf_logps"], b["cf_logps"]) and "answer_image_attention" not in a


def test_answer_image_attention_is_the_eager_image_mass_at_the_letter(tiny):
    """The probe's per-token signal at the answer letter equals eager attention weights summed over image keys,
    averaged over heads and the late layer, at the position that chose the letter."""
    from transformers import AutoModelForImageTextToText

    model, proc = tiny
    prompts, images, choices = _rows()
    ids = [proc.tokenizer.encode(t, add_special_tokens=False) for t in COMPLETIONS]
    out = reference_signals(model, proc, prompts[:1], images[:1], ids[:1], "grey", choices=choices[:1])
    eager = AutoModelForImageTextToText.from_config(model.config, attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    text = proc.apply_chat_template(_messages(prompts[0], 1), add_generation_prompt=True, tokenize=False)
    enc = proc(text=[text], images=images[0], return_tensors="pt")
    input_ids = torch.cat([enc.pop("input_ids"), torch.tensor([ids[0]])], dim=1)
    enc.pop("attention_mask")
    enc["mm_token_type_ids"] = torch.cat([enc["mm_token_type_ids"], torch.zeros(1, len(ids[0]), dtype=torch.long)], 1)
    with torch.no_grad():
        att = eager(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), output_attentions=True,
                    **enc).attentions
    image_keys = input_ids[0] == model.config.image_token_id
    chooser = input_ids.shape[1] - 2  # the letter is the last token: the position before it chose it
    late = att[-1][0, :, chooser, image_keys].sum(-1).mean().item()  # 3 layers: "late" is the last
    assert out["answer_image_attention"][0].item() == pytest.approx(late, abs=1e-5)


# ------------------------------------------------------------------------------- a model blind to its image


def test_a_model_blind_to_its_image_has_zero_gain_and_the_blind_answer_agrees(blind_model):
    model, proc = blind_model
    tok = proc.tokenizer
    prompts, images, choices = _rows()
    prompts, images, choices = prompts[:2], images[:2], choices[:2]
    # The premise: another image of the same size changes no logit
    other = [[Image.new("RGB", (56, 56), (0, 0, 0))] for _ in images]
    prefix = tok.encode("<think>x</think>\nAnswer:", add_special_tokens=False)
    for prompt, imgs, alt in zip(prompts, images, other):
        assert torch.equal(_forward(model, proc, prompt, imgs, prefix), _forward(model, proc, prompt, alt, prefix))
    # Greedy rollouts that carry an answer line: the think block given, the letter the real image's greedy choice
    # among the choice letters (a random model puts no letter first over its whole vocabulary)
    letters = _letter_ids(tok)
    completions = []
    for prompt, imgs in zip(prompts, images):
        nxt = _forward(model, proc, prompt, imgs, prefix)[-1]
        completions.append(prefix + [letters[int(nxt[letters].argmax())]])
    for kind in ("grey", "black", "patch_blackening", "gaussian_noise"):
        out = reference_signals(model, proc, prompts, images, completions, kind, choices=choices, step=1)
        assert torch.allclose(out["visual_gain"], torch.zeros(2), atol=1e-5), kind
        assert torch.allclose(out["answer_visual_gain"], torch.zeros(2), atol=1e-5), kind
        assert out["blind_agrees"].tolist() == [1.0, 1.0], kind
    # Removing the image removes its tokens: the text-only prompt is another input, so the gain is defined and not 0:
    # the two plain forwards by hand (with the image, and the text-only prompt), unbatched
    out = reference_signals(model, proc, prompts, images, completions, "none", choices=choices, attention=False)
    for i, (prompt, imgs, completion) in enumerate(zip(prompts, images, completions)):
        answer = letters.index(completion[-1])
        gain, answer_gain, blind = _brute(model, proc, prompt, imgs, [], completion, len(completion) - 1, letters,
                                          answer)
        assert gain != 0.0 and out["visual_gain"][i].item() == pytest.approx(gain, abs=1e-5)
        assert out["answer_visual_gain"][i].item() == pytest.approx(answer_gain, abs=1e-5)
        assert out["blind_agrees"][i].item() == blind


def test_a_processor_that_cannot_encode_a_counterfactual_is_a_clear_error(tiny):
    from trl_mdi.profile.reference import check_counterfactuals

    _, proc = tiny
    prompt, imgs = [{"role": "user", "content": QUESTION}], [shape_image(56, 0)]
    check_counterfactuals(proc, prompt, imgs, ["grey", "none", "patch_blackening"])

    class NeedsAnImage:  # a processor whose template requires an image, as some models' do
        tokenizer = proc.tokenizer

        def apply_chat_template(self, conversation, **kwargs):
            if not any(p.get("type") == "image" for m in conversation[0] for p in m["content"]):
                raise ValueError("this model needs one image per prompt")
            return proc.apply_chat_template(conversation=conversation, **kwargs)

    check_counterfactuals(NeedsAnImage(), prompt, imgs, ["grey"])
    with pytest.raises(ValueError, match=r"cannot encode the counterfactual 'none' prompt \(ValueError: this model "
                                         r"needs one image per prompt\); choose another kind, e.g. 'black'"):
        check_counterfactuals(NeedsAnImage(), prompt, imgs, ["grey", "none"])
    with pytest.raises(ValueError, match="unknown counterfactual kind 'gray'"):
        check_counterfactuals(proc, prompt, imgs, ["gray"])


def test_data_prior_label():
    assert [data_prior_label(a, "A", "D", True) for a in ("D", "A", "B", None)] == [True, False, None, None]
    assert data_prior_label("D", "A", "D", False) is None and data_prior_label("D", "A", None, True) is None


# ------------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def prior_data(tmp_path_factory):
    """8 language-prior rows (half of them conflicts) as a validation split, with a completion column answering the
    prior's colour on some conflict rows and the gold one elsewhere, so the data's own label has both classes."""
    from fixtures.warmup import synthetic_dataset

    root = tmp_path_factory.mktemp("prior_data")
    ds = synthetic_dataset(8, split="validation", kinds=("prior_color",), conflict_rate=0.5)
    completions = []
    for i, row in enumerate(ds):
        pick = row["prior_idx"] if row["conflict"] and i % 2 == 0 else row["label_idx"]
        completions.append(f"<think> it is {row['choices'][pick]}</think>\nAnswer: {'ABCD'[pick]}")
    ds = ds.add_column("completion", completions)
    ds.to_parquet(root / "validation.parquet")
    return root


def _pair_auroc(prior: list[float], other: list[float]) -> float | None:
    """P(a prior-following value is larger than an other one), ties 1/2: every pair counted; None for an empty class."""
    if not prior or not other:
        return None
    return sum((a > b) + 0.5 * (a == b) for a in prior for b in other) / (len(prior) * len(other))


def _data_label_aurocs(reliance: dict, kind: str, names: list[str]) -> dict[str, tuple]:
    """Per signal: (AUROC, n, n_prior) against the data's own label, from a model's stored prompts and rollouts: over
    the rollouts with an image whose label and every signal of ``names`` are defined (the report's common set), the
    signal oriented by the table's direction (-x where prior-following rollouts lie LOW)."""
    prompts = reliance["prompts"]
    scored = []
    for r in reliance["rollouts"]:
        p = prompts[r["prompt"]]
        label = data_prior_label(r["answer"], p["gold"], p["prior"], p["conflict"])
        values = {n: r[n] if n.startswith("mdi") else r["signals"][kind].get(n) for n in names}
        if p["has_image"] and label is not None and all(v is not None for v in values.values()):
            scored.append((label, values))
    out = {}
    for n in names:
        sign = -1.0 if S.direction(n) == S.LOW else 1.0
        prior = [sign * float(v[n]) for label, v in scored if label]
        other = [sign * float(v[n]) for label, v in scored if not label]
        out[n] = (_pair_auroc(prior, other), len(scored), len(prior))
    return out


def test_the_command_writes_the_reliance_section(tiny_vlm_dir, prior_data, tmp_path, capsys):
    a, b = tiny_vlm_dir("qwen2_5_vl"), tiny_vlm_dir("qwen2_5_vl", seed=1)
    out = tmp_path / "profile"
    code, stdout, stderr = run_profile(["--model_name_or_path", a, b, "--dataset_path", prior_data, "--out", out,
                                 "--completion_column", "completion", "--counterfactual_image", "grey", "none",
                                 "--samples_per_row", 1, "--max_new_tokens", 3, "--batch_size", 8, "--threads", 1],
                                capsys)
    assert code == 0, stderr
    report = json.loads((out / "profile.json").read_text())
    assert report["settings"]["reliance"] == {"counterfactual_image": ["grey", "none"], "samples_per_row": 1}
    for m in report["models"]:
        r = m["reliance"]
        s = r["summary"]
        assert s["rows_with_image"] == 8 and s["rollouts"] == 16 and len(r["rollouts"]) == 16
        assert [x["sample"] for x in r["rollouts"][:2]] == [0, 1]
        assert s["data_labels"]["rollouts"] >= 2 and s["data_labels"]["prior_following"] >= 1
        for kind in ("grey", "none"):
            k = s["kinds"][kind]
            # rollout 0 is the given completion: its accuracy is the column's
            gold = [p["gold"] for p in r["prompts"]]
            given = [x["answer"] for x in r["rollouts"] if x["sample"] == 0]
            assert k["accuracy_image"] == pytest.approx(sum(g == a for g, a in zip(gold, given)) / 8)
            assert k["multimodal_gain"] == pytest.approx(k["accuracy_image"] - k["accuracy_counterfactual"])
            names = [row["signal"] for row in k["rule_table"]]
            assert {"mdi", "mdi_late", "answer_image_attention", "visual_gain", "answer_visual_gain",
                    "blind_agrees"} <= set(names)
            assert k["data_table"] is not None and k["agreement"]["n"] >= 1
            # Every AUROC against the data's label, counted pair by pair from the values profile.json stores
            by_hand = _data_label_aurocs(r, kind, names)
            assert {row["signal"]: (row["n"], row["n_prior"]) for row in k["data_table"]} == \
                {n: (h[1], h[2]) for n, h in by_hand.items()}
            for row in k["data_table"]:
                assert row["direction"] == S.direction(row["signal"])
                want = by_hand[row["signal"]][0]
                assert want is not None and row["auroc"] == pytest.approx(want, abs=1e-12), row["signal"]
    md = (out / "profile.md").read_text()
    assert "## Reliance on the image" in md and "| model | counterfactual | accuracy, image |" in md
    assert md.count("which signal sees prior-following rollouts") == 4 and "Against the data's own label" in md
    for name in ("visual_gain", "answer_visual_gain", "blind_agrees", "answer_image_attention"):
        with Image.open(out / f"reliance_{name}.png") as img:
            assert img.size[0] >= 500 and len(img.convert("RGB").getcolors(1 << 20)) > 20
    assert "reliance `grey`: accuracy" in stdout and "reliance_visual_gain.png" in stdout


def test_bad_reliance_flags_fail_before_any_weight_is_loaded(tiny_vlm_dir, prior_data, tmp_path, capsys, monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForImageTextToText, "from_pretrained", refuse)
    vlm = tiny_vlm_dir("qwen2_5_vl")
    base = ["--model_name_or_path", vlm, "--dataset_path", prior_data, "--out", tmp_path / "o"]
    cases = [
        (["--counterfactual_image", "gray"], "--counterfactual_image 'gray' is not a counterfactual kind (did you "
         "mean grey?); choose from patch_blackening, gaussian_noise, blur, black, grey, grayscale, none"),
        (["--counterfactual_image"], "expected at least one argument"),
        (["--counterfactual_image", "grey", "grey"], "more than once"),
        (["--samples_per_row", "-1"], "--samples_per_row must be >= 0"),
    ]
    for argv, message in cases:
        code, _, stderr = run_profile([*base, *argv], capsys)
        assert code == 2 and message in stderr, (argv, stderr)
        assert stderr.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in stderr
    assert not (tmp_path / "o").exists()


def test_reliance_flags_imply_the_section():
    base = ["--model_name_or_path", "m", "--out", "/tmp/x"]
    assert parse_args(base).reliance is False
    args = parse_args([*base, "--reliance"])
    assert args.reliance and args.counterfactual_image == ["black"] and args.samples_per_row == 0
    assert parse_args([*base, "--samples_per_row", "2"]).counterfactual_image == ["black"]
    assert parse_args([*base, "--counterfactual_image", "none", "blur"]).counterfactual_image == ["none", "blur"]


# ------------------------------------------------------------------------------- a counterfactual entry added to the table

# The largest per-token visual gain over the completion (docs/signals.md's counterfactual example): NaN tokens
# (padding, no image) become -inf first, and a row without a valid token (-inf) gets NaN.
MAX_TOKEN_GAIN = S.Signal(
    "max_token_gain", "largest per-token visual gain g_t over the completion (nats)",
    lambda x: torch.where(x.token_gain.isnan().all(1), math.nan,
                          x.token_gain.nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf).amax(1)),
    source=S.COUNTERFACTUAL, metric=True, log="max gain", direction=S.LOW)


def test_a_counterfactual_entry_added_to_the_table_reaches_the_reliance_report(tiny, monkeypatch, tmp_path):
    """One entry in SIGNALS, nothing else: the profile measures it per counterfactual kind (each value the largest
    per-token gain of two plain forwards by hand), and the report gives its mean, its AUROC rows with the table's
    direction (the AUROC counted pair by pair), a column, its glossary line, and a picture."""
    from fixtures.warmup import synthetic_dataset
    from trl_mdi.profile.reference import measure_reliance
    from trl_mdi.profile.reliance_report import plot_reliance, render_reliance, summarize_reliance

    monkeypatch.setattr(S, "SIGNALS", (*S.SIGNALS, MAX_TOKEN_GAIN))
    model, proc = tiny
    tok = proc.tokenizer
    ds = synthetic_dataset(6, split="validation", kinds=("prior_color",), conflict_rate=0.5)
    picks = [row["prior_idx"] if row["conflict"] and i % 2 == 0 else row["label_idx"] for i, row in enumerate(ds)]
    ds = ds.add_column("completion", [f"<think> it is {row['choices'][pick]}</think>\nAnswer: {'ABCD'[pick]}"
                                      for row, pick in zip(ds, picks)])
    m = measure_reliance(model, proc, ds, ["grey"], completion_column="completion", batch_size=4, seed=2)
    assert len(m.rollouts) == 6
    for r in m.rollouts:  # the entry's value: max_t [log p(y_t | I) - log p(y_t | I')] of two forwards by hand
        row = ds[m.prompts[r["prompt"]]["row"]]
        completion = tok.encode(row["completion"], add_special_tokens=False)
        cf = perturb_images([[row["image"]]], "grey", seed=2, step=0, row_offset=m.prompts[r["prompt"]]["row"])[0]
        c = len(completion)
        target = torch.tensor(completion)
        real = _forward(model, proc, row["prompt"], [row["image"]], completion)[:c].log_softmax(-1)[torch.arange(c),
                                                                                                     target]
        blind = _forward(model, proc, row["prompt"], cf, completion)[:c].log_softmax(-1)[torch.arange(c), target]
        assert r["signals"]["grey"]["max_token_gain"] == pytest.approx((real - blind).max().item(), abs=1e-5)

    summary = summarize_reliance(m, n_boot=20)
    k = summary["kinds"]["grey"]
    values = [r["signals"]["grey"]["max_token_gain"] for r in m.rollouts]
    assert k["means"]["max_token_gain"] == pytest.approx(sum(values) / len(values))
    names = [row["signal"] for row in k["data_table"]]
    assert names[-1] == "max_token_gain" and {"visual_gain", "blind_agrees", "mdi"} <= set(names)
    row = k["data_table"][-1]
    by_hand = _data_label_aurocs({"prompts": m.prompts, "rollouts": m.rollouts}, "grey", names)["max_token_gain"]
    assert row["direction"] == "low" and (row["n"], row["n_prior"]) == by_hand[1:] and 1 <= by_hand[2] < by_hand[1]
    assert row["auroc"] == pytest.approx(by_hand[0], abs=1e-12)
    assert R.default_direction("max_token_gain") == R.LOW == S.LOW  # trl_mdi.profile.validation orients it too, unedited
    assert [r["signal"] for r in k["rule_table"]][-1] == "max_token_gain"

    md = "\n".join(render_reliance([{"label": "tiny", "reliance": {"summary": summary}}],
                                   {"counterfactual_image": ["grey"], "seed": 2, "samples_per_row": 0,
                                    "completion_column": "completion", "max_new_tokens": 3}))
    assert "| " + " | ".join(S.reliance_names()[-3:]) + " |" in md  # the new entry's column, last, in table order
    assert S.reliance_names()[-1] == "max_token_gain"
    assert f"**max_token_gain**: {MAX_TOKEN_GAIN.help}." in md and "(reliance_max_token_gain.png)" in md
    paths = plot_reliance({"tiny": {"prompts": m.prompts, "rollouts": m.rollouts}}, ["grey"], tmp_path)
    assert (tmp_path / "reliance_max_token_gain.png").is_file() and len(paths) == len(S.reliance_names())


def test_the_reports_names_read_the_table():
    from trl_mdi.profile import reliance_report

    assert reliance_report.picture_file("blind_agrees") == "reliance_blind_agrees.png"
    assert "**visual_gain**: mean over the completion" in reliance_report.how_to_read()
