"""The counterfactual reliance signals in MDIGRPOTrainer: exact against two plain forwards, zero on a model whose image
cannot change the output, their cost counted at each limit, and observing them changes nothing.

A random tiny model never writes an answer line by itself, so the exactness tests script the generation: every
rollout is ``<think>look</think>\\nAnswer: X`` + end of sequence, with X the model's own most likely choice letter
at that position under the real image (a greedy choice among the letters). The counterfactual is the black image of
the same size (``counterfactual_image="black"``, the default).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from test_trainer import ForwardCounter, make_args, spread_reward
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl import GRPOTrainer

from fixtures.testing import family_params
from fixtures.tiny import TINY_ARCHS
from trl_mdi.batch import policy_batch
from trl_mdi.diagnostics.completions_table import column_names
from trl_mdi.trainer import MDIGRPOTrainer

PREFIX = "<think>look</think>\nAnswer:"


@pytest.fixture(scope="module")
def model_dir(tiny_vlm_dir):
    return tiny_vlm_dir("qwen2_5_vl")


@pytest.fixture(scope="module")
def blind_model_dir(tiny_vlm_dir, tmp_path_factory):
    """The same model with the vision merger's output zeroed: every image embeds to zeros, so pixels cannot change
    the output (the image's token positions stay)."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir("qwen2_5_vl"))
    last = model.model.visual.merger.mlp[-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.zero_()
    out = tmp_path_factory.mktemp("blind") / "model"
    model.save_pretrained(out)
    AutoProcessor.from_pretrained(tiny_vlm_dir("qwen2_5_vl")).save_pretrained(out)
    return out


def answer_tokens_of(tok) -> tuple[list[int], list[int]]:
    """The prefix's token ids and the ids of " A" .. " D" after it, as this family's tokenizer writes them."""
    prefix = tok(PREFIX, add_special_tokens=False)["input_ids"]
    letters = []
    for letter in "ABCD":
        ids = tok(f"{PREFIX} {letter}", add_special_tokens=False)["input_ids"]
        assert ids[: len(prefix)] == prefix and len(ids) == len(prefix) + 1, (letter, ids)
        letters.append(ids[-1])
    return prefix, letters


def scripted_generation(monkeypatch):
    """Replace TRL's generation with answer-line completions whose letter is the model's greedy choice among A-D."""

    def generate(trainer, prompt_ids, images, multimodal_fields, num_generations):
        tok = trainer._tokenizer
        prefix, letters = answer_tokens_of(tok)
        batch = policy_batch(prompt_ids, [prefix] * len(prompt_ids), pad_token_id=tok.pad_token_id,
                             multimodal=multimodal_fields, device=trainer.accelerator.device)
        with torch.no_grad():
            logits = trainer.model(**batch.model_inputs()).logits[:, -1, letters]
        chosen = logits.argmax(-1).tolist()
        return [prefix + [letters[k], tok.eos_token_id] for k in chosen], None

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", generate)


def capture(monkeypatch):
    """Record each batch's rows, prompts and completions as the counterfactual forward sees them, and the signals the
    trainer computed from them."""
    seen = []
    original_cf, original_signals = MDIGRPOTrainer._counterfactual_forward, MDIGRPOTrainer._batch_signals

    def counterfactual_forward(trainer, inputs, prompts, completion_ids_list, *rest):
        seen.append({"inputs": inputs, "prompts": prompts, "completions": [list(c) for c in completion_ids_list]})
        return original_cf(trainer, inputs, prompts, completion_ids_list, *rest)

    def batch_signals(trainer, record, mode):
        out = original_signals(trainer, record, mode)
        seen[-1]["signals"] = {k: v.clone() for k, v in out.local.items()}
        return out

    monkeypatch.setattr(MDIGRPOTrainer, "_counterfactual_forward", counterfactual_forward)
    monkeypatch.setattr(MDIGRPOTrainer, "_batch_signals", batch_signals)
    return seen


def plain_reference(model, processor, prompt, images, completion: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(C,) log-probs of ``completion`` and (C, V) logits that predict its tokens, from one plain no-grad forward of
    this row alone (no padding): the chat template, the processor, the model, log_softmax."""
    text = processor.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=[images], return_tensors="pt")
    ids = torch.cat([enc["input_ids"], torch.tensor([completion])], dim=1)
    extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    extra["mm_token_type_ids"] = torch.cat([extra["mm_token_type_ids"], torch.zeros(1, len(completion),
                                                                                   dtype=torch.long)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0].float()
    p = enc["input_ids"].shape[1]
    aligned = logits[p - 1: p - 1 + len(completion)]
    logps = aligned.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
    return logps, aligned


def expected_signals(model_dir, batch) -> dict[str, list[float]]:
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    prefix, letters = answer_tokens_of(processor.tokenizer)
    n_prefix = len(prefix)
    out = {"visual_gain": [], "answer_visual_gain": [], "blind_agrees": []}
    for prompt, row, completion in zip(batch["prompts"], batch["inputs"], batch["completions"]):
        images = row["images"] if row.get("images") is not None else [row["image"]]
        black = [Image.new("RGB", img.size, (0, 0, 0)) for img in images]
        real, _ = plain_reference(model, processor, prompt, images, completion)
        cf, cf_logits = plain_reference(model, processor, prompt, black, completion)
        gain = real - cf
        out["visual_gain"].append(float(gain.mean()))
        out["answer_visual_gain"].append(float(gain[n_prefix]))  # the letter token
        choice = cf_logits[n_prefix, letters[: len(row["choices"])]].argmax().item()
        out["blind_agrees"].append(float(letters[choice] == completion[n_prefix]))
    return out


def profile_reference(path, batch, kind: str, temperature: float, attention: bool) -> dict[str, torch.Tensor]:
    """``trl_mdi.profile.reference.reference_signals`` of the batch's rollouts (the prompts, images, choices and
    completion tokens the trainer's counterfactual forward saw) on a fresh copy of the model from the checkpoint:
    plain no-grad forwards through the project's batch builder, none of TRL's log-prob path."""
    from trl_mdi.profile.reference import reference_signals

    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    images = [row["images"] if row.get("images") is not None else [row["image"]] for row in batch["inputs"]]
    return reference_signals(model, processor, batch["prompts"], images, batch["completions"], kind,
                             choices=[row.get("choices") for row in batch["inputs"]], attention=attention,
                             temperature=temperature)


def completions_table(trainer, step: int) -> pd.DataFrame:
    """TRL's completions parquet of one step (``log_completions=True``)."""
    return pd.read_parquet(Path(trainer.args.output_dir) / "completions" / f"completions_{step:05d}.parquet")


def check_completions_table(trainer, seen: list[dict], want: list[dict[str, list[float]]]) -> None:
    """Every step's parquet carries every per-rollout signal the trainer computed for that step's batch, row for row
    in TRL's order, equal to ``want`` (two plain forwards per rollout) where given; the image-evidence column marks
    the answer letter in bold where the image made it at least 1 nat likelier; the step's p10/p50/p90 metrics are
    the quantiles of the plain-forward values."""
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for step, (batch, expected, logged) in enumerate(zip(seen, want, logs), start=1):
        table = completions_table(trainer, step)
        assert len(table) == len(batch["completions"]) and (table["step"] == step).all()
        # a signal named like one of the run's rewards is shown under its metric namespace (reliance/<name>)
        shown = column_names(list(batch["signals"]), trainer.reward_func_names)
        missing = sorted(shown[n] for n in batch["signals"] if shown[n] not in table.columns)
        assert not missing, f"step {step}: the completions table lacks {missing}; it has {list(table.columns)}"
        for name, values in batch["signals"].items():
            np.testing.assert_allclose(table[shown[name]].to_numpy(), values.double().numpy(), rtol=0, atol=0,
                                       equal_nan=True, err_msg=name)
        for name, values in expected.items():
            np.testing.assert_allclose(table[shown[name]].to_numpy(), values, rtol=0, atol=1e-5, err_msg=name)
            if name != "blind_agrees":
                assert logged[f"reliance/{name}/p50"] == pytest.approx(float(np.quantile(values, 0.5)), abs=1e-5)
        for cell, gain in zip(table["image_evidence"], expected.get("answer_visual_gain", [])):
            assert isinstance(cell, str) and cell, cell
            assert ("**" in cell) == (gain >= 1.0), (cell, gain)
    # varies across rollouts, not a broadcast batch mean (the scripted rollouts of one prompt are identical)
    assert pd.concat([completions_table(trainer, s) for s in (1, 2)])["visual_gain"].nunique() > 1


RELIANCE_REWARD = dict(reward_funcs=["answer_visual_gain", spread_reward])


@pytest.mark.parametrize("which", ["model", "blind"])
def test_signals_equal_two_plain_forwards(model_dir, blind_model_dir, grpo_train_dataset, tmp_path, monkeypatch,
                                          which):
    """A reward reads answer_visual_gain: the real image's log-probs come from the trainer's no-grad forward before
    the rewards; every signal equals the plain-forward computation within 1e-5. On the image-blind model the gains
    are 0 and the counterfactual picks the rollout's own (greedy) letter every time."""
    path = model_dir if which == "model" else blind_model_dir
    scripted_generation(monkeypatch)
    seen = capture(monkeypatch)
    trainer = MDIGRPOTrainer(str(path), reward_funcs=RELIANCE_REWARD["reward_funcs"],
                             args=make_args(tmp_path, log_completions=which == "model"), train_dataset=grpo_train_dataset)
    assert trainer.run_plan.counterfactual and trainer.run_plan.placement == "extra_forward"
    trainer.train()
    assert len(seen) == 2
    wants = []
    for batch in seen:
        want = expected_signals(path, batch)
        wants.append(want)
        got = batch["signals"]
        for name in want:
            torch.testing.assert_close(got[name].double(), torch.tensor(want[name], dtype=torch.double),
                                       atol=1e-5, rtol=0, msg=name)
        if which == "blind":
            assert got["visual_gain"].abs().max() < 1e-5 and got["answer_visual_gain"].abs().max() < 1e-5
            assert got["blind_agrees"].tolist() == [1.0] * len(got["blind_agrees"])
        # The probe's image mass at the letter: the profile's reference on a fresh copy of the checkpoint (itself
        # checked against eager attention weights summed by hand, tests/test_profile_reliance.py)
        attention = profile_reference(path, batch, "black", trainer.args.temperature, attention=True)
        assert not got["answer_image_attention"].isnan().any() and got["answer_image_attention"].min() > 0
        torch.testing.assert_close(got["answer_image_attention"].double(),
                                   attention["answer_image_attention"].double(), atol=1e-5, rtol=0)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all("reliance/blind_agree_rate" in h and h["reliance/answer_rate"] == 1.0 for h in logs)
    if which == "model":
        assert any(abs(v) > 1e-3 for b in seen for v in b["signals"]["visual_gain"].tolist())  # the image matters
        # The completions table (extra forward before the rewards): step 2's plain forwards use the checkpoint's
        # weights, not the weights after step 1, so only step 1 is compared with them.
        check_completions_table(trainer, seen, wants[:1] + [{}])


def test_signals_from_the_training_forward(model_dir, grpo_train_dataset, tmp_path, monkeypatch):
    """Only the logs read them: the real image's log-probs come from TRL's grad-enabled training forward (no forward
    of ours but the counterfactual one); they equal the plain forwards within the tolerance measured here."""
    scripted_generation(monkeypatch)
    seen = capture(monkeypatch)
    counter = ForwardCounter(monkeypatch)
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                             args=make_args(tmp_path, reliance_signals=True, log_completions=True),
                             train_dataset=grpo_train_dataset)
    assert trainer.run_plan.placement == "training_forward"
    trainer.train()
    assert counter.per_generation == [1, 1]  # the counterfactual forward alone: the completions table adds none
    errors, wants = [], []
    for batch in seen:
        want = expected_signals(model_dir, batch)
        wants.append(want)
        for name in want:
            errors.append((batch["signals"][name].double() - torch.tensor(want[name], dtype=torch.double)).abs().max())
    print(f"\nmax |training-forward signals - plain forwards| = {max(errors):.1e}")
    assert max(errors) < 1e-5
    # Measured after TRL flushed its log_extra queue, yet in the table TRL wrote at the step's log.
    check_completions_table(trainer, seen, wants[:1] + [{}])
    assert all(completions_table(trainer, step)["mdi"].notna().all() for step in (1, 2))


@pytest.mark.parametrize("case, overrides, rewards, expected", [
    ("nothing reads them", {}, [spread_reward], [0, 0]),
    ("logs only", {"reliance_signals": True}, [spread_reward], [1, 1]),
    ("a reward reads them", {}, ["answer_visual_gain", spread_reward], [2, 2]),
    ("a reward, TRL's old-log-prob forward", {"num_iterations": 2, "max_steps": 2},
     ["answer_visual_gain", spread_reward], [2]),  # TRL's forward + ours: the counterfactual alone is added
    ("with an MDI reward", {}, ["answer_visual_gain", "mdi_balance", spread_reward], [2, 2]),
    ("TPRL perturbing as the counterfactual", {"enable_perception_filtering": True,
                                               "perception_perturbation": "black"},
     ["answer_visual_gain", spread_reward], [2, 2]),
    ("TPRL perturbing otherwise", {"enable_perception_filtering": True, "perception_perturbation": "grey"},
     ["answer_visual_gain", spread_reward], [3, 3]),
])
def test_cost_at_each_limit(model_dir, grpo_train_dataset, tmp_path, monkeypatch, case, overrides, rewards, expected):
    """No-grad policy forwards per generation batch, TRL's own included."""
    counter = ForwardCounter(monkeypatch)
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=rewards, args=make_args(tmp_path, **overrides),
                             train_dataset=grpo_train_dataset)
    trainer.train()
    assert counter.per_generation == expected, (case, counter.per_generation, trainer.run_plan.describe())


def test_observing_the_signals_changes_nothing(model_dir, grpo_train_dataset, tmp_path):
    """Same seed, no reward reads them: parameters bit-identical with the reliance signals computed and not."""
    def params_after(**overrides):
        trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                                 args=make_args(tmp_path / str(overrides), max_steps=3, **overrides),
                                 train_dataset=grpo_train_dataset)
        trainer.train()
        return trainer, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    on, after_on = params_after(reliance_signals=True)
    assert any("reliance/visual_gain" in h for h in on.state.log_history)
    _, after_off = params_after()
    for name in after_on:
        assert torch.equal(after_on[name], after_off[name]), name


def test_the_signals_need_no_probe(model_dir, grpo_train_dataset, tmp_path, monkeypatch):
    """Attention metrics off: the signals are log-probabilities, not attention; answer_image_attention is None."""
    scripted_generation(monkeypatch)
    seen = capture(monkeypatch)
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=["answer_visual_gain", spread_reward],
                             args=make_args(tmp_path, compute_attention_metrics=False), train_dataset=grpo_train_dataset)
    trainer.train()
    got = seen[-1]["signals"]
    assert "answer_image_attention" not in got and not got["answer_visual_gain"].isnan().any()
    want = expected_signals(model_dir, seen[-1])  # two plain forwards per rollout, written in this file
    for name in want:
        torch.testing.assert_close(got[name].double(), torch.tensor(want[name], dtype=torch.double), atol=1e-5,
                                   rtol=0, msg=name)


def test_bad_input_is_a_clear_error(model_dir, grpo_train_dataset, tmp_path, tiny_vlm_dir):
    from trl_mdi.config import MDIGRPOConfig

    with pytest.raises(ValueError, match="counterfactual_image must be one of .*none"):
        MDIGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, counterfactual_image="pink")
    with pytest.raises(ValueError, match="answer_image_attention.*compute_attention_metrics"):
        def reward(completions, answer_image_attention, **kwargs):
            return [0.0] * len(completions)

        MDIGRPOTrainer(str(model_dir), reward_funcs=[reward],
                       args=make_args(tmp_path, compute_attention_metrics=False), train_dataset=grpo_train_dataset)


def test_a_processor_that_cannot_encode_the_counterfactual_fails_at_construction(model_dir, grpo_train_dataset,
                                                                                   tmp_path):
    """A template that insists on an image cannot take the "none" counterfactual: said before any batch runs."""
    processor = AutoProcessor.from_pretrained(model_dir)
    template = processor.apply_chat_template

    def needs_an_image(conversation, *args, **kwargs):
        if not any(p.get("type") == "image" for c in conversation for m in c for p in
                   (m["content"] if isinstance(m["content"], list) else [])):
            raise ValueError("this template needs an image")
        return template(conversation, *args, **kwargs)

    processor.apply_chat_template = needs_an_image
    with pytest.raises(ValueError, match="counterfactual_image='none'.*cannot encode.*needs an image.*e.g. 'black'"):
        MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], processing_class=processor,
                       args=make_args(tmp_path, reliance_signals=True, counterfactual_image="none"),
                       train_dataset=grpo_train_dataset)


def test_the_plan_says_which_forwards_run_and_why(model_dir, grpo_train_dataset, tmp_path):
    from types import SimpleNamespace

    from trl_mdi.attention.model_facts import ModelFacts
    from trl_mdi.run_plan import counterfactual_plan

    text_only = ModelFacts("qwen2", (), 2, (0, 1), None, None)
    with pytest.raises(ValueError, match="text-only.*reliance_signals=True compare"):
        counterfactual_plan(SimpleNamespace(reliance_signals=True, counterfactual_image="grey"), text_only, [])
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=["answer_visual_gain", spread_reward],
                             args=make_args(tmp_path, enable_perception_filtering=True, perception_perturbation="black"),
                             train_dataset=grpo_train_dataset)
    plan = trainer.run_plan.describe()
    assert "reward answer_visual_gain reads answer_visual_gain" in plan
    assert "counterfactual image (reliance signals and the perturbation perception signal" in plan
    assert "perturbed images" not in plan  # one forward serves both


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_every_counterfactual_kind_encodes_on_every_family(tiny_vlm_dir, arch):
    """Each ``counterfactual_image`` kind, checked as the trainer checks it at construction (the family's processor
    and template encode a prompt with that counterfactual image, or a ValueError names a kind to use instead): on
    every tiny family every kind encodes, removing the image ("none") included, except on PaliGemma, whose processor
    takes no prompt without an image: there "none" is refused, naming "black"."""
    from transformers import AutoConfig

    from trl_mdi.attention.model_facts import model_facts
    from trl_mdi.batch import check_counterfactual_encodes
    from trl_mdi.counterfactual import counterfactual_kinds

    processor = AutoProcessor.from_pretrained(tiny_vlm_dir(arch))
    failed = {}
    for kind in counterfactual_kinds():
        try:
            check_counterfactual_encodes(processor, kind)
        except ValueError as err:
            failed[kind] = str(err)
    if model_facts(AutoConfig.from_pretrained(tiny_vlm_dir(arch))).image_in_every_prompt:
        # PaliGemma's processor takes no prompt without an image: "none" is refused at construction, naming "black".
        assert set(failed) == {"none"} and "choose another kind, e.g. 'black'" in failed["none"], (arch, failed)
        return
    assert not failed, (arch, failed)


@pytest.mark.parametrize("arch", family_params(TINY_ARCHS))
def test_every_family_gets_the_signals_at_its_answer_letter(tiny_vlm_dir, grpo_train_dataset, tmp_path, monkeypatch,
                                                            arch):
    """Hybrid (Qwen3.5), sliding-window (Gemma 3), any-resolution tiles (LLaVA-NeXT, LLaVA-OneVision), image splitting
    (Idefics3, SmolVLM), tiles + thumbnail (InternVL), MoE, Gemma 4: the counterfactual forward finds every rollout's answer letter and reads the choice letters'
    logits there, with the image removed and with a black one; every per-rollout signal equals the profile's
    reference (plain forwards of a fresh copy of the checkpoint, on the same rollouts) within 1e-5. (The tiny
    Gemma 3's output does not depend on its image at all: its gains with a black image are exactly 0 and the blind
    answer always agrees.)"""
    from transformers import AutoConfig

    from trl_mdi.attention.model_facts import model_facts

    scripted_generation(monkeypatch)
    seen = capture(monkeypatch)
    path = tiny_vlm_dir(arch)
    # PaliGemma takes no prompt without an image: "none" is refused at construction (the test above).
    needs_image = model_facts(AutoConfig.from_pretrained(path)).image_in_every_prompt
    for kind in ("black",) if needs_image else ("black", "none"):
        trainer = MDIGRPOTrainer(str(path), reward_funcs=[spread_reward],
                                 args=make_args(tmp_path / kind, max_steps=1, reliance_signals=True,
                                                counterfactual_image=kind),
                                 train_dataset=grpo_train_dataset)
        trainer.train()
        batch = seen[-1]
        got = batch["signals"]
        # max_steps=1: the one generation batch is scored before the optimizer step, so with the checkpoint's weights
        measured = "answer_image_attention" in got
        want = profile_reference(path, batch, kind, trainer.args.temperature, attention=measured)
        names = ["visual_gain", "answer_visual_gain", "blind_agrees"] + (["answer_image_attention"] if measured else [])
        for name in names:
            assert not got[name].isnan().any(), (arch, kind, name, got[name])  # every rollout has an answer letter
            torch.testing.assert_close(got[name].double(), want[name].double(), atol=1e-5, rtol=0,
                                       msg=lambda m, name=name, kind=kind: f"{arch} {kind} {name}: {m}")
        if arch == "gemma3" and kind == "black":
            # Exactly 0, by construction: transformers initialises Gemma 3's multimodal projection
            # (mm_input_projection_weight) to zeros, so every image embeds to zeros whatever its pixels; a black image
            # of the same size leaves every input embedding, hence every logit, unchanged.
            fresh = AutoModelForImageTextToText.from_pretrained(path)
            assert not fresh.model.multi_modal_projector.mm_input_projection_weight.any()
            assert got["visual_gain"].tolist() == [0.0] * len(got["visual_gain"])
            assert got["answer_visual_gain"].tolist() == [0.0] * len(got["answer_visual_gain"])
            assert got["blind_agrees"].tolist() == [1.0] * len(got["blind_agrees"])
        else:  # the image matters to this model (removing it always does): the comparison is not vacuous
            assert got["visual_gain"].abs().max() > 1e-4, (arch, kind, got["visual_gain"])
        logged = [h for h in trainer.state.log_history if "loss" in h][0]
        assert logged["reliance/answer_rate"] == 1.0, (arch, kind)
