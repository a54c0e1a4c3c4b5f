"""Look or guess (issue 30), the task: prior-colour questions answered by a short chain of thought that either reads
the image ("the shape is red") or recalls the object's usual colour ("a tomato is red"); the warm-up that writes both
styles, the rows of every split, the rollouts sampled from a model, the label of each rollout read from its own
text, the per-token visual gains of a rollout, and the figures computed from them (style metrics, position gains).

Task and warm-up: ``fixtures.synthetic.look_or_guess`` (the ``look_or_guess`` kind, the two styles, both the same
number of tokens for each object, and the reader of a rollout's style) and ``fixtures.warmup.LookOrGuessRecipe``
(400 rows, half of them conflict rows, each row's style drawn afresh every epoch, 8 SFT epochs).

The warm-up check (:func:`warmup_check`), on held-out rows with conflicts (validation split, conflict rate 0.5):
``samples`` completions per prompt sampled at temperature 1 over the whole vocabulary (greedy decoding picks one
style per prompt, so it cannot show the mix; the greedy completion is reported beside), each labelled from its own
text (:func:`fixtures.synthetic.look_or_guess.read_reasoning`, no model signal), and:

1. the style rate (near 1/2 by construction of the warm-up) and the share of prompts whose samples hold both styles
   (GRPO can only move the style inside groups that hold both);
2. each style's answer following its reasoning (the letter is the colour the reasoning named);
3. the look style reading the image: its accuracy on conflict rows (goal >= 0.9), where only the image tells;
4. the guess style answering the prior on conflict rows; the clean-format rate;
5. where the image enters: per style, the mean per-token visual gain g_t = log p(y_t | image) - log p(y_t | black)
   at each completion position, teacher-forced on the sampled tokens with plain no-grad forwards
   (``trl_mdi.profile.reference.reference_signals``, the project's reference for the trainer's signals). The two
   styles of one object have the same length and end in the same answer line, so positions are counted from the
   end of the completion, where they line up across objects.

Layout: :class:`Settings` (the check's knobs), :func:`look_or_guess_recipe` and :func:`shared_warmup` (the cached
warm-up), :func:`held_out_rows` and the experiment's splits (:func:`held_out_test_rows`, :func:`dev_rows`,
:func:`pool_rows`), :func:`sample_rollouts` (sampling), :func:`label_rollouts` (the text label of each rollout),
:func:`score_rollouts` (the per-token gains), :func:`style_metrics` / :func:`position_gains` (the figures) and
:func:`warmup_check`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from fixtures.synthetic.look_or_guess import (
    CHAINS,
    GUESS,
    LOOK,
    LOOK_OR_GUESS,
    MAX_COMPLETION_LENGTH,
    OTHER,
    STYLES,
)
from fixtures.warmup import LookOrGuessRecipe, synthetic_dataset, warm_start

DEFAULT_WORK = Path(tempfile.gettempdir()) / "trl_mdi_look_or_guess"
LETTERS = "ABCD"


@dataclasses.dataclass
class Settings:
    n_eval: int = 200  # held-out prompts (validation split); half of them conflict rows
    eval_conflict_rate: float = 0.5
    samples: int = 4  # completions sampled per prompt at temperature 1
    max_new_tokens: int = MAX_COMPLETION_LENGTH
    counterfactual: str = "black"  # the image the per-token gain compares with
    batch_size: int = 32  # rollouts per forward
    seed: int = 0  # sampling seed


def look_or_guess_recipe(epochs: int = 8, n_train: int = 400, image_size: int = 56,
                         kind: str = LOOK_OR_GUESS) -> LookOrGuessRecipe:
    """The warm-up of the experiment: 400 ``look_or_guess`` rows, conflict rate 0.5, styles redrawn every epoch,
    8 SFT epochs of the warm-up's tiny Qwen2-VL. Trials here (200 held-out prompts x 4 samples): 6 epochs gave look
    accuracy 0.944 on conflict rows but 14% of rollouts in neither style (clean 0.899); 8 epochs 0.974 and 8%
    (clean 0.959), every goal of the check met. ``kind``: ``look_or_guess_long`` for the long chains (issue 44)."""
    return LookOrGuessRecipe(epochs=float(epochs), n_train=n_train, image_size=image_size, kinds=(kind,))


def fingerprint(*parts) -> str:
    """A short hash of everything that decides a result: a cached one with another hash is recomputed."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def warmup_dir(recipe: LookOrGuessRecipe, work: Path, environment: dict | None = None) -> Path:
    """The warm-up's folder in ``work``: named by the hash of the recipe, the torch thread count and, given,
    ``environment`` (``benchmarks.environment.environment_key``: the float path and library versions), so that a
    warm-up built in another environment is never taken for this one's."""
    parts = (dataclasses.asdict(recipe), torch.get_num_threads()) + ((environment,) if environment else ())
    return work / f"warmup-{fingerprint(*parts)}"


def shared_warmup(recipe: LookOrGuessRecipe, work: Path, log=print, environment: dict | None = None):
    """The warm-up model of ``recipe``: trained once into ``work`` and reloaded from there later (its folder:
    :func:`warmup_dir`). Its ``warmup.json`` (``info``) holds ``weights_sha256`` (``benchmarks.environment
    .weights_sha256``), and a reused folder whose weights no longer hash to it is an error. Returns ``(model,
    processor, info)``."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from benchmarks.environment import environment_record, weights_sha256

    model_dir = warmup_dir(recipe, work, environment)
    if (model_dir / "warmup.json").exists():
        log(f"warm-up: reusing {model_dir}")
        info = json.loads((model_dir / "warmup.json").read_text())
        found = weights_sha256(model_dir)
        if info.get("weights_sha256") not in (None, found):
            raise ValueError(f"the warm-up in {model_dir} no longer holds the weights it was saved with (hash "
                             f"{found[:12]}, recorded {info['weights_sha256'][:12]}): delete the folder to rebuild it")
        info["weights_sha256"] = found
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
        processor = AutoProcessor.from_pretrained(model_dir)
        return model.eval(), processor, info
    work.mkdir(parents=True, exist_ok=True)
    model, processor, info = warm_start(recipe, model_dir, overwrite=True, log=log)
    info.update(weights_sha256=weights_sha256(model_dir), environment=environment_record())
    (model_dir / "warmup.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    log(f"warm-up: weights sha256 {info['weights_sha256']}")
    return model.eval(), processor, info


def held_out_rows(recipe: LookOrGuessRecipe, s: Settings):
    """The held-out prompts: ``s.n_eval`` validation rows of the recipe's task with conflict rate
    ``s.eval_conflict_rate`` (its own random stream: no row of the warm-up's training split)."""
    return synthetic_dataset(s.n_eval, split="validation", seed=recipe.data_seed, kinds=recipe.kinds,
                             option_order=recipe.option_order, image_size=recipe.image_size,
                             conflict_rate=s.eval_conflict_rate)


TEST_SPLIT = "look_or_guess_test"
"""The split name of the test rows (its own random stream): the reported figures, nothing chosen on them."""
DEV_SPLIT = "validation"
"""The development split: the reward form is chosen on the warm-up's rollouts of these rows (with the training
rows' conflict rate, 0), and the warm-up check ran on this split."""
def held_out_test_rows(recipe: LookOrGuessRecipe, s):
    """The test split (``s``: the experiment's settings): ``s.n_test`` rows with conflict rate ``s.test_conflict_rate`` from their own stream."""
    return synthetic_dataset(s.n_test, split=TEST_SPLIT, seed=recipe.data_seed, kinds=recipe.kinds,
                             option_order=recipe.option_order, image_size=recipe.image_size,
                             conflict_rate=s.test_conflict_rate)


def dev_rows(recipe: LookOrGuessRecipe, s):
    """The development split: ``s.n_dev`` validation rows at the training rows' conflict rate."""
    return synthetic_dataset(s.n_dev, split=DEV_SPLIT, seed=recipe.data_seed, kinds=recipe.kinds,
                             option_order=recipe.option_order, image_size=recipe.image_size,
                             conflict_rate=s.pool_conflict_rate)


def pool_rows(recipe: LookOrGuessRecipe, s):
    """The GRPO training rows: train split, seed ``data_seed + 1`` (not the warm-up's rows), no conflict row."""
    return synthetic_dataset(s.n_pool, split="train", seed=recipe.data_seed + 1, kinds=recipe.kinds,
                             option_order=recipe.option_order, image_size=recipe.image_size,
                             conflict_rate=s.pool_conflict_rate)


# --------------------------------------------------------------------------------------------------- rollouts


def sample_rollouts(model, processor, ds, *, samples: int, max_new_tokens: int, seed: int = 0,
                    batch_size: int = 32, greedy: bool = True) -> list[dict]:
    """Per prompt of ``ds``, ``samples`` completions sampled at temperature 1 (torch seeded with ``seed`` first) and,
    with ``greedy``, the greedy one (``sample`` 0; sampled ones are 1..). One dict per rollout: ``prompt`` (row
    index), ``sample``, ``ids`` (its tokens up to and including the end token), ``ended`` (the end token was
    generated within ``max_new_tokens``) and ``text``."""
    from trl_mdi.batch import eos_token_ids
    from trl_mdi.profile.reference import generate_completions

    tok = processor.tokenizer
    eos = set(eos_token_ids(model, tok))
    torch.manual_seed(seed)
    out = []
    for lo in range(0, len(ds), batch_size):
        rows = [ds[i] for i in range(lo, min(lo + batch_size, len(ds)))]
        draws = ([(0, False)] if greedy else []) + [(k, True) for k in range(1, samples + 1)]
        for k, sample in draws:
            ids, mask = generate_completions(model, processor, [r["prompt"] for r in rows],
                                             images=[[r["image"]] for r in rows], max_new_tokens=max_new_tokens,
                                             sample=sample)
            for j in range(len(rows)):
                kept = ids[j][mask[j].bool()].tolist()
                out.append({"prompt": lo + j, "sample": k, "ids": kept, "ended": bool(kept) and kept[-1] in eos,
                            "text": tok.decode(kept, skip_special_tokens=True)})
    out.sort(key=lambda r: (r["prompt"], r["sample"]))
    return out


def label_rollouts(rollouts: list[dict], ds, kind: str = LOOK_OR_GUESS) -> list[dict]:
    """Each rollout's label, read from its own text and the row (no model signal): ``style`` and the colour the
    reasoning ``named`` (``read_reasoning``), the parsed ``answer`` letter, ``follows`` (the answer is the letter
    of the named colour), ``correct`` (the gold letter), ``prior`` (the object's usual colour's letter), ``conflict``
    and ``clean`` (the asked format, ended by the end token). ``kind``: whose chains (``CHAINS[kind]`` reads the
    style). Adds the fields in place and returns the list."""
    from trl_mdi.answer_format import clean_format
    from trl_mdi.rewards import parse_mc_answer

    conflict, gold, prior, choices = ds["conflict"], ds["label_idx"], ds["prior_idx"], ds["choices"]
    read_reasoning = CHAINS[kind].read_reasoning
    for r in rollouts:
        i = r["prompt"]
        reading = read_reasoning(r["text"])
        answer = parse_mc_answer(r["text"], len(choices[i]))[0]
        named = LETTERS[choices[i].index(reading.color)] if reading.color in choices[i] else None
        r.update(style=reading.style, named=reading.color, answer=answer, conflict=bool(conflict[i]),
                 follows=answer is not None and answer == named, correct=answer == LETTERS[gold[i]],
                 answers_prior=answer == LETTERS[prior[i]],
                 clean=r["ended"] and clean_format(r["text"], choices=[None] * len(choices[i])))
    return rollouts


def score_rollouts(model, processor, rollouts: list[dict], ds, *, kind: str = "black", batch_size: int = 32) -> None:
    """Per rollout, the per-token visual gain ``gains`` (g_t = log p(y_t | real image) - log p(y_t | ``kind``
    image), teacher-forced on its own tokens) and its ``visual_gain`` (mean) and ``answer_visual_gain`` (answer
    letter), from ``trl_mdi.profile.reference.reference_signals``: plain no-grad forwards, the trainer's
    reference. Each prompt's counterfactual is drawn as its row index (the same for all its rollouts)."""
    from trl_mdi.batch import pad_rows
    from trl_mdi.profile.reference import reference_signals

    tok = processor.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    for lo in range(0, len(rollouts), batch_size):
        chunk = rollouts[lo:lo + batch_size]
        rows = [ds[r["prompt"]] for r in chunk]
        ids, mask = pad_rows([r["ids"] or [pad] for r in chunk], pad, "right")
        for j, r in enumerate(chunk):
            if not r["ids"]:
                mask[j] = 0
        sig = reference_signals(model, processor, [row["prompt"] for row in rows], [[row["image"]] for row in rows],
                                ids, kind, completion_mask=mask, choices=[row["choices"] for row in rows],
                                rows=[r["prompt"] for r in chunk], attention=False)
        gains = (sig["logps"] - sig["cf_logps"]) * sig["completion_mask"]
        for j, r in enumerate(chunk):
            n = int(sig["completion_mask"][j].sum())
            r["gains"] = [round(float(g), 5) for g in gains[j, :n]]
            r["visual_gain"] = float(sig["visual_gain"][j])
            r["answer_visual_gain"] = float(sig["answer_visual_gain"][j])


# ---------------------------------------------------------------------------------------------------- figures


def share(flags) -> float:
    flags = list(flags)
    return sum(flags) / len(flags) if flags else math.nan


def style_metrics(rollouts: list[dict]) -> dict:
    """The warm-up check's figures over labelled rollouts (``label_rollouts``), one sample set (e.g. the sampled
    rollouts, or the greedy ones): counts, style rates (all, conflict, non-conflict rows), the share of prompts
    holding both styles, per style the answer following its reasoning, the look style's accuracy and its reasoning
    naming the drawn colour, the guess style answering the prior, accuracy on conflict rows with its
    decomposition (look rate x look accuracy + guess rate x guess accuracy + other), and the clean-format rate."""
    subsets = {"all": rollouts, "conflict": [r for r in rollouts if r["conflict"]],
               "plain": [r for r in rollouts if not r["conflict"]]}
    out: dict = {"rollouts": len(rollouts), "prompts": len({r["prompt"] for r in rollouts})}
    for name, rs in subsets.items():
        counts = Counter(r["style"] for r in rs)
        out[name] = {"n": len(rs), **{f"{s}_rate": counts[s] / len(rs) if rs else math.nan for s in (*STYLES, OTHER)},
                     "accuracy": share(r["correct"] for r in rs), "clean": share(r["clean"] for r in rs)}
        for style in STYLES:
            mine = [r for r in rs if r["style"] == style]
            out[name][style] = {"n": len(mine), "follows": share(r["follows"] for r in mine),
                                "accuracy": share(r["correct"] for r in mine),
                                "answers_prior": share(r["answers_prior"] for r in mine)}
        other = [r for r in rs if r["style"] == OTHER]
        out[name][OTHER] = {"n": len(other), "accuracy": share(r["correct"] for r in other)}
    groups = defaultdict(set)
    for r in rollouts:
        groups[r["prompt"]].add(r["style"])
    out["both_styles"] = share({LOOK, GUESS} <= g for g in groups.values())
    out["both_styles_conflict"] = share({LOOK, GUESS} <= groups[p] for p in {r["prompt"] for r in subsets["conflict"]})
    out["both_styles_plain"] = share({LOOK, GUESS} <= groups[p] for p in {r["prompt"] for r in subsets["plain"]})
    c = out["conflict"]
    out["conflict_decomposition"] = {
        s: (c[f"{s}_rate"] * (c[s]["accuracy"] if c[s]["n"] else 0.0)) for s in (*STYLES, OTHER)}
    return out


def position_gains(rollouts: list[dict], tokenizer) -> dict:
    """Per style, the mean per-token visual gain at each completion position counted from the END (-1 is the last
    token, the end token; a look and a guess rollout of one object have the same length and the same answer line, so
    from the end the colour word, the answer letter and the end token line up across objects), over the clean
    rollouts of that style. Each position: ``mean``, ``n``, ``sd`` and the token most often there (``token``, its
    share ``token_share``); plus ``colour_word``: the mean gain at the token before ``</think>`` (the colour the
    reasoning names) and ``elsewhere``: the mean absolute gain at every other position."""
    close = tokenizer.convert_tokens_to_ids("</think>")
    out = {}
    for style in STYLES:
        rs = [r for r in rollouts if r["style"] == style and r["clean"] and r.get("gains")]
        by_pos: dict[int, list[tuple[float, int]]] = defaultdict(list)
        colour, rest = [], []
        for r in rs:
            n = len(r["gains"])
            at_colour = r["ids"].index(close) - 1 if close in r["ids"] else None
            for t, g in enumerate(r["gains"]):
                by_pos[t - n].append((g, r["ids"][t]))
                (colour if t == at_colour else rest).append(g if t == at_colour else abs(g))
        table = {}
        for pos in sorted(by_pos):
            gs = [g for g, _ in by_pos[pos]]
            tok_id, count = Counter(i for _, i in by_pos[pos]).most_common(1)[0]
            mean = sum(gs) / len(gs)
            sd = math.sqrt(sum((g - mean) ** 2 for g in gs) / (len(gs) - 1)) if len(gs) > 1 else math.nan
            table[pos] = {"mean": mean, "sd": sd, "n": len(gs), "token": tokenizer.decode([tok_id]),
                          "token_share": count / len(gs)}
        out[style] = {"rollouts": len(rs), "positions": table,
                      "colour_word": sum(colour) / len(colour) if colour else math.nan,
                      "elsewhere": sum(rest) / len(rest) if rest else math.nan}
    return out


def signal_means(rollouts: list[dict]) -> dict:
    """Per row kind (conflict / non-conflict) and style, the mean of each per-rollout gain over clean rollouts:
    ``visual_gain`` (mean over the completion), its sum form, and ``answer_visual_gain`` (the letter)."""
    out = {}
    for name, keep in (("conflict", True), ("plain", False)):
        out[name] = {}
        for style in STYLES:
            rs = [r for r in rollouts if r["conflict"] == keep and r["style"] == style and r["clean"] and r.get("gains")]
            out[name][style] = {"n": len(rs),
                                "visual_gain": share(r["visual_gain"] for r in rs),
                                "visual_gain_sum": share(sum(r["gains"]) for r in rs),
                                "answer_visual_gain": share(r["answer_visual_gain"] for r in rs)}
    return out


COLOUR_OFFSETS = tuple(range(-5, 4))
"""Positions of the colour-word table, counted from the colour word (0: the token before ``</think>``)."""


def colour_word_gains(rollouts: list[dict], tokenizer, ds, offsets: tuple[int, ...] = COLOUR_OFFSETS) -> dict:
    """Where the image's gain sits, per style (look, guess and neither), aligned at the colour word.

    Every scored rollout (``score_rollouts``: per-token ``gains``) whose text holds ``</think>`` after at least one
    token is aligned at the token before it (the colour the reasoning names, in every style, the neither-style texts
    such as ``<think> the shape in the image green</think>`` included); position ``k`` is ``k`` tokens after it.
    Per style: ``rollouts`` (scored), ``aligned``, per offset the mean gain, its n and the most frequent token there,
    and the mean of each reward over the style's rollouts: ``visual_gain`` (the shipped mean form,
    ``visual_gain``) and ``guarded_visual_gain`` (on the rollout's largest token gain, gated by its answer
    and format against the row's label)."""
    from trl_mdi.rewards import guarded_visual_gain, visual_gain

    close = tokenizer.convert_tokens_to_ids("</think>")
    out = {}
    for style in (*STYLES, OTHER):
        rs = [r for r in rollouts if r["style"] == style and r.get("gains") is not None]
        by_offset: dict[int, list[tuple[float, int]]] = defaultdict(list)
        aligned = 0
        for r in rs:
            ids = r["ids"][:len(r["gains"])]
            if close not in ids or ids.index(close) < 1:
                continue
            aligned += 1
            at = ids.index(close) - 1
            for k in offsets:
                if 0 <= at + k < len(ids):
                    by_offset[k].append((r["gains"][at + k], ids[at + k]))
        table = {}
        for k in offsets:
            if by_offset[k]:
                gs = [g for g, _ in by_offset[k]]
                tok_id, count = Counter(i for _, i in by_offset[k]).most_common(1)[0]
                table[k] = {"mean": sum(gs) / len(gs), "n": len(gs), "token": tokenizer.decode([tok_id]),
                            "token_share": count / len(gs)}
        texts = [r["text"] for r in rs]
        mean_form = visual_gain(texts, [r.get("visual_gain") for r in rs]) if rs else []
        guarded = guarded_visual_gain(
            texts, visual_gain_max=[max(r["gains"]) if r["gains"] else None for r in rs],
            label_idx=[ds[r["prompt"]]["label_idx"] for r in rs],
            choices=[ds[r["prompt"]]["choices"] for r in rs]) if rs else []
        out[style] = {"rollouts": len(rs), "aligned": aligned, "offsets": table,
                      "visual_gain": share(x for x in mean_form if x is not None),
                      "guarded_visual_gain": share(x for x in guarded if x is not None)}
    return out


def guarded_levels(rollouts: list[dict], ds) -> dict:
    """Per style, the largest token gain's quantiles (10, 25, 50, 75, 90, 99%) and the share of rollouts at each
    level of ``guarded_visual_gain`` (the registry's settings), over scored rollouts (``score_rollouts``)."""
    import numpy as np

    from trl_mdi.rewards import guarded_visual_gain as reward

    out = {"thresholds": reward.thresholds}
    for style in (*STYLES, OTHER):
        rs = [r for r in rollouts if r["style"] == style and r.get("gains")]
        if not rs:
            out[style] = {"n": 0}
            continue
        top = [max(r["gains"]) for r in rs]
        values = reward([r["text"] for r in rs], visual_gain_max=top, label_idx=[ds[r["prompt"]]["label_idx"] for r in rs],
                        choices=[ds[r["prompt"]]["choices"] for r in rs])
        levels = Counter(round(v, 4) for v in values if v is not None)
        out[style] = {"n": len(rs), "quantiles": [round(float(q), 4) for q in
                                                   np.quantile(top, [0.1, 0.25, 0.5, 0.75, 0.9, 0.99])],
                      "levels": {str(k): levels[k] / len(rs) for k in sorted(levels)},
                      "mean": share(v for v in values if v is not None)}
    return out



# ------------------------------------------------------------------------------------------------ the check


def warmup_check(model, processor, ds, s: Settings, log=print, kind: str = LOOK_OR_GUESS) -> dict:
    """The pre-GRPO check of a look-or-guess warm-up on held-out rows ``ds`` (see the module docstring): sampled
    and greedy rollouts, each labelled from its text and scored per token against the ``s.counterfactual``
    image. Returns ``{"sampled": style_metrics, "greedy": style_metrics, "positions": position_gains, "signals":
    signal_means, "goals": ..., "rollouts": every labelled rollout (greedy ones: sample 0), "seconds": ...}``.
    ``kind``: whose chains (``fixtures.synthetic.look_or_guess.CHAINS``)."""
    start = time.perf_counter()
    CHAINS[kind].check_equal_lengths(processor.tokenizer)
    was_training = model.training
    model.eval()
    try:
        rollouts = sample_rollouts(model, processor, ds, samples=s.samples, max_new_tokens=s.max_new_tokens,
                                   seed=s.seed, batch_size=s.batch_size)
        label_rollouts(rollouts, ds, kind)
        sampled = [r for r in rollouts if r["sample"] > 0]
        log(f"  sampled {len(sampled)} rollouts of {len(ds)} prompts ({time.perf_counter() - start:.0f} s); "
            "scoring them per token")
        score_rollouts(model, processor, sampled, ds, kind=s.counterfactual, batch_size=s.batch_size)
    finally:
        model.train(was_training)
    m = style_metrics(sampled)
    result = {"settings": dataclasses.asdict(s), "sampled": m,
              "greedy": style_metrics([r for r in rollouts if r["sample"] == 0]),
              "positions": position_gains(sampled, processor.tokenizer), "signals": signal_means(sampled),
              "examples": {st: next((r["text"] for r in sampled if r["style"] == st), None) for st in (*STYLES, OTHER)},
              "rollouts": rollouts, "seconds": round(time.perf_counter() - start, 1)}
    c = m["conflict"]
    result["goals"] = {
        "look rate in [0.3, 0.7] (sampled)": 0.3 <= m["all"]["look_rate"] <= 0.7,
        "both styles in most groups (> 0.5)": m["both_styles"] > 0.5,
        "answer follows reasoning >= 0.95, both styles": all(m["all"][st]["follows"] >= 0.95 for st in STYLES),
        "look accuracy on conflict rows >= 0.9": c[LOOK]["accuracy"] >= 0.9,
        "guess answers the prior on conflict rows >= 0.9": c[GUESS]["answers_prior"] >= 0.9,
        "clean format >= 0.9": m["all"]["clean"] >= 0.9,
    }
    return result
