"""Look or guess (issue 30): prior-colour questions answered by a short chain of thought that either reads the
image ("the shape is red") or recalls the object's usual colour ("a tomato is red"). This module holds the
experiment's shared pieces and, today, its first command: the check of the warm-up before any GRPO run.

    .venv/bin/python benchmarks/look_or_guess.py warmup-check            # warm up (cached), sample, report
    .venv/bin/python -m benchmarks.look_or_guess warmup-check --n_eval 200 --samples 4 --epochs 8

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

Layout, for the GRPO experiment to join: :class:`Settings` (the knobs), :func:`look_or_guess_recipe` and
:func:`shared_warmup` (the cached warm-up), :func:`held_out_rows`, :func:`sample_rollouts` (sampling),
:func:`label_rollouts` (the text label of each rollout), :func:`score_rollouts` (the per-token gains),
:func:`style_metrics` / :func:`position_gains` (the figures), :func:`warmup_check` and :func:`report_warmup_check`.
A command is a function of ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as `python benchmarks/look_or_guess.py` or `python -m benchmarks.look_or_guess`: fixtures/ is a folder of the
# checkout (not installed) and _results.py sits beside this file.
for _path in (str(ROOT), str(ROOT / "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _results import set_offline_env  # noqa: E402

set_offline_env()
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep (see learning_curve.py)

import torch  # noqa: E402

from fixtures.synthetic.look_or_guess import (  # noqa: E402
    GUESS,
    LOOK,
    MAX_COMPLETION_LENGTH,
    OTHER,
    STYLES,
    check_equal_lengths,
    read_reasoning,
    read_style,
)
from fixtures.warmup import LookOrGuessRecipe, synthetic_dataset, warm_start  # noqa: E402

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


def look_or_guess_recipe(epochs: int = 8, n_train: int = 400, image_size: int = 56) -> LookOrGuessRecipe:
    """The warm-up of the experiment: 400 ``look_or_guess`` rows, conflict rate 0.5, styles redrawn every epoch,
    8 SFT epochs of the warm-up's tiny Qwen2-VL. Trials here (200 held-out prompts x 4 samples): 6 epochs gave look
    accuracy 0.944 on conflict rows but 14% of rollouts in neither style (clean 0.899); 8 epochs 0.974 and 8%
    (clean 0.959), every goal of the check met."""
    return LookOrGuessRecipe(epochs=float(epochs), n_train=n_train, image_size=image_size)


def fingerprint(*parts) -> str:
    """A short hash of everything that decides a result: a cached one with another hash is recomputed."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def warmup_dir(recipe: LookOrGuessRecipe, work: Path) -> Path:
    """The warm-up's folder in ``work``: named by the recipe's and the torch thread count's hash."""
    return work / f"warmup-{fingerprint(dataclasses.asdict(recipe), torch.get_num_threads())}"


def shared_warmup(recipe: LookOrGuessRecipe, work: Path, log=print):
    """The warm-up model of ``recipe``: trained once into ``work`` and reloaded from there later (its folder is named
    by the recipe's and the thread count's hash). Returns ``(model, processor, info)``."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_dir = warmup_dir(recipe, work)
    if (model_dir / "warmup.json").exists():
        log(f"warm-up: reusing {model_dir}")
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
        processor = AutoProcessor.from_pretrained(model_dir)
        return model.eval(), processor, json.loads((model_dir / "warmup.json").read_text())
    work.mkdir(parents=True, exist_ok=True)
    model, processor, info = warm_start(recipe, model_dir, overwrite=True, log=log)
    return model.eval(), processor, info


def held_out_rows(recipe: LookOrGuessRecipe, s: Settings):
    """The held-out prompts: ``s.n_eval`` validation rows of the recipe's task with conflict rate
    ``s.eval_conflict_rate`` (its own random stream: no row of the warm-up's training split)."""
    return synthetic_dataset(s.n_eval, split="validation", seed=recipe.data_seed, kinds=recipe.kinds,
                             option_order=recipe.option_order, image_size=recipe.image_size,
                             conflict_rate=s.eval_conflict_rate)


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


def label_rollouts(rollouts: list[dict], ds) -> list[dict]:
    """Each rollout's label, read from its own text and the row (no model signal): ``style`` and the colour the
    reasoning ``named`` (``read_reasoning``), the parsed ``answer`` letter, ``follows`` (the answer is the letter
    of the named colour), ``correct`` (the gold letter), ``prior`` (the object's usual colour's letter), ``conflict``
    and ``clean`` (the asked format, ended by the end token). Adds the fields in place and returns the list."""
    from trl_mdi.answer_format import clean_format
    from trl_mdi.rewards import parse_mc_answer

    conflict, gold, prior, choices = ds["conflict"], ds["label_idx"], ds["prior_idx"], ds["choices"]
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


def _share(flags) -> float:
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
                     "accuracy": _share(r["correct"] for r in rs), "clean": _share(r["clean"] for r in rs)}
        for style in STYLES:
            mine = [r for r in rs if r["style"] == style]
            out[name][style] = {"n": len(mine), "follows": _share(r["follows"] for r in mine),
                                "accuracy": _share(r["correct"] for r in mine),
                                "answers_prior": _share(r["answers_prior"] for r in mine)}
        other = [r for r in rs if r["style"] == OTHER]
        out[name][OTHER] = {"n": len(other), "accuracy": _share(r["correct"] for r in other)}
    groups = defaultdict(set)
    for r in rollouts:
        groups[r["prompt"]].add(r["style"])
    out["both_styles"] = _share({LOOK, GUESS} <= g for g in groups.values())
    out["both_styles_conflict"] = _share({LOOK, GUESS} <= groups[p] for p in {r["prompt"] for r in subsets["conflict"]})
    out["both_styles_plain"] = _share({LOOK, GUESS} <= groups[p] for p in {r["prompt"] for r in subsets["plain"]})
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
                                "visual_gain": _share(r["visual_gain"] for r in rs),
                                "visual_gain_sum": _share(sum(r["gains"]) for r in rs),
                                "answer_visual_gain": _share(r["answer_visual_gain"] for r in rs)}
    return out


# ------------------------------------------------------------------------------------------------ the check


def warmup_check(model, processor, ds, s: Settings, log=print) -> dict:
    """The pre-GRPO check of a look-or-guess warm-up on held-out rows ``ds`` (see the module docstring): sampled
    and greedy rollouts, each labelled from its text and scored per token against the ``s.counterfactual``
    image. Returns ``{"sampled": style_metrics, "greedy": style_metrics, "positions": position_gains, "signals":
    signal_means, "goals": ..., "rollouts": every labelled rollout (greedy ones: sample 0), "seconds": ...}``."""
    start = time.perf_counter()
    check_equal_lengths(processor.tokenizer)
    was_training = model.training
    model.eval()
    try:
        rollouts = sample_rollouts(model, processor, ds, samples=s.samples, max_new_tokens=s.max_new_tokens,
                                   seed=s.seed, batch_size=s.batch_size)
        label_rollouts(rollouts, ds)
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


def _f(x, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def report_warmup_check(result: dict, warm: dict | None = None) -> str:
    """The warm-up check as a short Markdown report."""
    m, g, s = result["sampled"], result["greedy"], result["settings"]
    lines = ["## Look or guess: warm-up check", ""]
    if warm:
        r = warm["recipe"]
        lines += [f"Warm-up: {r['n_train']} `look_or_guess` rows, conflict rate {r['conflict_rate']}, look share "
                  f"{r.get('look_share')}, styles redrawn every epoch, {r['epochs']:g} SFT epochs of the tiny "
                  f"{r['arch']} ({warm.get('num_params')} parameters), {warm.get('sft_steps')} steps in "
                  f"{warm.get('seconds')} s, mean loss {_f(warm.get('train_loss'))}.", ""]
    lines += [f"Held out: {m['prompts']} validation prompts (conflict rate {s['eval_conflict_rate']}) x {s['samples']} "
              f"completions sampled at temperature 1 ({m['rollouts']} rollouts), greedy beside; "
              f"{result['seconds']:.0f} s.", "",
              "| rows | n | look rate | guess rate | other | look: follows | look: accuracy | guess: follows | "
              "guess: answers prior | accuracy | clean |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, label in (("all", "all"), ("conflict", "conflict"), ("plain", "non-conflict")):
        x = m[name]
        lines.append(f"| {label} | {x['n']} | {_f(x['look_rate'])} | {_f(x['guess_rate'])} | {_f(x['other_rate'])} | "
                     f"{_f(x[LOOK]['follows'])} | {_f(x[LOOK]['accuracy'])} | {_f(x[GUESS]['follows'])} | "
                     f"{_f(x[GUESS]['answers_prior'])} | {_f(x['accuracy'])} | {_f(x['clean'])} |")
    d = m["conflict_decomposition"]
    lines += ["", f"Prompts whose {s['samples']} samples hold both styles: {_f(m['both_styles'])} (conflict "
              f"{_f(m['both_styles_conflict'])}, non-conflict {_f(m['both_styles_plain'])}). Conflict accuracy "
              f"{_f(m['conflict']['accuracy'])} = look {_f(d[LOOK])} + guess {_f(d[GUESS])} + other {_f(d[OTHER])} "
              "(rate x accuracy). Greedy: look rate "
              f"{_f(g['all']['look_rate'])} (conflict {_f(g['conflict']['look_rate'])}), conflict accuracy "
              f"{_f(g['conflict']['accuracy'])}, non-conflict {_f(g['plain']['accuracy'])}, clean {_f(g['all']['clean'])}.",
              "", "Goals: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in result["goals"].items()) + ".",
              "", f"Where the image enters: mean per-token gain log p(y_t | image) - log p(y_t | {s['counterfactual']} "
              "image) at each completion position counted from the end (clean rollouts; token: the most frequent "
              "one there, with its share).", "",
              "| position | look: token | look: mean gain | n | guess: token | guess: mean gain | n |",
              "|---:|---|---:|---:|---|---:|---:|"]
    p = result["positions"]
    positions = sorted(set(p[LOOK]["positions"]) | set(p[GUESS]["positions"]))
    for pos in positions:
        cells = []
        for st in STYLES:
            c = p[st]["positions"].get(pos)
            cells += ["", "", "0"] if c is None else [f"`{c['token']!r}` {c['token_share']:.2f}", f"{c['mean']:+.3f}",
                                                      str(c["n"])]
        lines.append(f"| {pos} | " + " | ".join(cells) + " |")
    lines += ["", "At the colour word (the token before `</think>`): look " + _f(p[LOOK]["colour_word"]) + ", guess "
              + _f(p[GUESS]["colour_word"]) + "; mean |gain| at every other position: look " + _f(p[LOOK]["elsewhere"])
              + ", guess " + _f(p[GUESS]["elsewhere"]) + ".", "",
              "| rows | style | n | visual_gain (mean) | visual_gain (sum) | answer_visual_gain |",
              "|---|---|---:|---:|---:|---:|"]
    for name, label in (("conflict", "conflict"), ("plain", "non-conflict")):
        for st in STYLES:
            x = result["signals"][name][st]
            lines.append(f"| {label} | {st} | {x['n']} | {_f(x['visual_gain'])} | {_f(x['visual_gain_sum'])} | "
                         f"{_f(x['answer_visual_gain'])} |")
    lines += ["", "Examples: " + "; ".join(f"{k}: `{v!r}`" for k, v in result["examples"].items() if v)]
    return "\n".join(lines) + "\n"


def _clean_json(x):
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean_json(v) for v in x]
    return x


# ---------------------------------------------------------------------------------------------------- commands


def cmd_warmup_check(a: argparse.Namespace) -> dict:
    """Warm up (or reuse the cached warm-up), run :func:`warmup_check`, print the report; ``--json`` saves it."""
    import transformers

    torch.set_num_threads(a.threads)
    transformers.logging.set_verbosity_error()
    started = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - started:6.1f} s] {msg}", flush=True)

    recipe = look_or_guess_recipe(epochs=a.epochs, n_train=a.n_train, image_size=a.image_size)
    s = Settings(n_eval=a.n_eval, samples=a.samples, seed=a.seed, counterfactual=a.counterfactual or "black")
    work = Path(a.work_dir) if a.work_dir else DEFAULT_WORK
    model, processor, info = shared_warmup(recipe, work, log)
    result = warmup_check(model, processor, held_out_rows(recipe, s), s, log)
    result["warmup"] = info
    print("\n" + report_warmup_check(result, info))
    if a.json:
        Path(a.json).write_text(json.dumps(_clean_json(result), indent=1, default=str))
        print(f"wrote {a.json}")
    return result


# ======================================================================================= the shortcut experiment
#
# Issue 30 items 2-3: GRPO from the warm-up on training rows WITHOUT conflicts (guessing is never wrong there, so
# the answer and format rewards cannot tell the styles apart), evaluated on held-out rows WITH conflicts (only the
# look style is right there); and which per-rollout signal sees the style (the detection table).

TEST_SPLIT = "look_or_guess_test"
"""The split name of the test rows (its own random stream): the reported figures, nothing chosen on them."""
DEV_SPLIT = "validation"
"""The development split: the reward form is chosen on the warm-up's rollouts of these rows (with the training
rows' conflict rate, 0), and the warm-up check ran on this split."""
BASELINE = "answer_format"
RELIANCE = "visual_gain"
"""The reliance-reward variant: pays the completion's visual gain (mean or sum form, chosen on the dev split)."""
GAIN_FORMS = ("visual_gain", "visual_gain_sum")
OTHER_FORM = "visual_gain_other_form"
"""Optional (``--variants``): the reliance reward in the form the development split did NOT choose."""
STYLE_LOGGERS = ("fixtures.synthetic.look_or_guess:look_rate", "fixtures.synthetic.look_or_guess:guess_rate")
"""Zero-weight 'rewards' in every run: TRL logs ``rewards/look_rate/mean`` (the look rate of each step's rollouts)
and ``rewards/guess_rate/mean``; a zero weight changes no advantage."""
DETECTION_SIGNALS = ("mdi", "mdi_late", "answer_image_attention", "visual_gain", "visual_gain_sum", "visual_gain_max",
                     "answer_visual_gain", "blind_agrees", "answer_logprob")
"""The per-rollout signals of the detection table, in table order (``answer_logprob``: the confidence baseline)."""
SECTION = "## Look or guess"
OUTPUT_ONLY_FLAGS = ("--work_dir", "--results", "--workers")
# Issue 30's goals.
GOAL_CONFLICT_GAIN, GOAL_PLAIN, GOAL_CLEAN, GOAL_WITHIN_AUROC = 0.30, 0.98, 0.90, 0.95

EXPECTED = {
    "answer_format": "the baseline. Both styles are right on every training row, of one length per object and in "
                     "the same format, so the answer and format rewards tie between them: nothing pushes the style, "
                     "and the look rate drifts only by chance (or towards whichever style is written cleaner).",
    "mdi_balance": "pays attention balance, not reading: unless MDI differs between the styles (the detection table "
                   "says whether it does), it ties as the baseline does, and moves the style no more.",
    RELIANCE: "the reliance push: a look rollout's colour word gains nats from the image (the warm-up check's "
              "per-position gains), a guess rollout's nothing, so the reward separates the styles inside a group "
              "where the other rewards "
              "tie; the look rate should rise, and conflict accuracy with it (towards the look style's accuracy).",
    "answer_visual_gain": "control: the answer letter follows the chain in both passes (the counterfactual pass "
                          "reads the same chain), so its gain is ~0 for both styles: the reward ties, as the "
                          "baseline.",
    OTHER_FORM: "the reliance reward in the form the development split did not choose, added after seed 0's "
                "training log of the chosen form showed the style moving away from both look and guess late in the "
                "run (a completion-level reward can be raised by the text's shape as well as by reading). The mean form "
                "pays the gain per token, so a shorter or reshaped chain with the same gain earns more; the sum form "
                "pays the gain over the chain (clipped at 4 nats), which a shorter chain does not raise. Expected "
                "with the sum form: the look rate rises as with the mean form, with fewer rollouts in neither style.",
    "tprl_counterfactual": "control: TPRL only rescales the advantages of tokens (by the counterfactual's per-token "
                           "gain); where the rewards tie the advantage is 0 and stays 0, so it cannot move the style: "
                           "as the baseline.",
}


def experiment_variants(gain_form: str, tprl_perturbation: str | None = None) -> dict:
    """The variants (``language_prior.Variant``), every one with the two zero-weight style loggers. ``gain_form``:
    the reliance reward's registry name (``visual_gain``: clip(mean g, 0, 0.5) / 0.5, or ``visual_gain_sum``:
    clip(sum g, 0, 4) / 4), chosen on the development split (:func:`choose_reward`). ``tprl_perturbation``: TPRL's
    perturbed image, None = the runs' counterfactual kind (a kind name where that kind is ``"none"``)."""
    lp = _lp()
    if gain_form not in GAIN_FORMS:
        raise ValueError(f"gain_form must be one of {GAIN_FORMS}, got {gain_form!r}")
    log_w = (0.0,) * len(STYLE_LOGGERS)
    other = next(f for f in GAIN_FORMS if f != gain_form)

    def v(label, rewards, weights, tprl=None, perturbation=None):
        return lp.Variant(label, (*rewards, *STYLE_LOGGERS), (*weights, *log_w), tprl, perturbation, all_seeds=True)

    return {
        BASELINE: v("answer + format only", ("mc_idx", "think_format"), (4.0, 1.0)),
        "mdi_balance": v("+ mdi_balance (4:1:1)", ("mc_idx", "think_format", "mdi_balance"), (4.0, 1.0, 1.0)),
        RELIANCE: v(f"+ {gain_form} (4:1:1)", ("mc_idx", "think_format", gain_form), (4.0, 1.0, 1.0)),
        "answer_visual_gain": v("+ answer_visual_gain (4:1:1, control)",
                                ("mc_idx", "think_format", "answer_visual_gain"), (4.0, 1.0, 1.0)),
        "tprl_counterfactual": v("+ TPRL, counterfactual as perturbation (control)", ("mc_idx", "think_format"),
                                 (4.0, 1.0), "perturbation", tprl_perturbation or lp.COUNTERFACTUAL),
        OTHER_FORM: v(f"+ {other} (4:1:1, the other form)", ("mc_idx", "think_format", other), (4.0, 1.0, 1.0)),
    }


VARIANT_NAMES = (BASELINE, "mdi_balance", RELIANCE, "answer_visual_gain", "tprl_counterfactual")
"""The default variants."""
ALL_VARIANTS = (*VARIANT_NAMES, OTHER_FORM)


def _lp():
    """benchmarks/language_prior.py (its Variant, grpo_config and write_json are reused): imported on first use, as
    it imports the trainer."""
    import language_prior

    return language_prior


@dataclasses.dataclass
class ExperimentSettings:
    # GRPO steps per run (every variant, every seed): 50 fits 25 runs into the hour on 2 shared cores (pilots: 1 to
    # 3.5 s a step at load average 5 to 8, 25 to 35 s per test evaluation, 40 to 75 s per detection measurement).
    steps: int = 50
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    variants: tuple[str, ...] = VARIANT_NAMES
    gain_form: str = "auto"  # the reliance reward's form; auto: chosen on the development split
    n_pool: int = 400  # training rows (no conflict row): steps x prompts_per_step of them are drawn
    pool_conflict_rate: float = 0.0
    n_test: int = 200  # test prompts, half of them conflict rows
    test_conflict_rate: float = 0.5
    eval_samples: int = 4  # completions sampled per test prompt at temperature 1 (greedy beside)
    eval_mid: bool = False  # also evaluate at the middle step
    n_dev: int = 100  # development prompts (the choice of the gain form), no conflict rows as in training
    dev_samples: int = 8  # one GRPO group per prompt
    detect_prompts: int = 200  # test prompts of the detection table (both row kinds)
    detect_samples: int = 4
    detect_seeds: tuple[int, ...] = (0,)  # trained models measured for the detection table
    n_boot: int = 1000
    learning_rate: float = 3e-4  # language_prior.py's (1e-3 broke non-conflict rows there)
    lr_scheduler_type: str = "linear"
    prompts_per_step: int = 4
    num_generations: int = 8
    max_completion_length: int = MAX_COMPLETION_LENGTH
    # The runs' counterfactual image; auto: chosen on the development split among dev_kinds (black, the trainer's
    # default, first). Resolved before any run: the run records hold the kind used.
    counterfactual: str = "auto"
    dev_kinds: tuple[str, ...] = ("black", "grey", "gaussian_noise", "blur", "patch_blackening", "none")
    reliance_everywhere: bool = True  # reliance signals logged in every run (reliance/* comparable across variants)


RUN_INDEPENDENT = ("seeds", "variants", "detect_seeds", "gain_form")
"""Settings that decide nothing inside one run (which runs exist; the chosen form enters through the variant)."""


def code_version(root: Path = ROOT) -> dict:
    """The code a result came from (``_results.code_version``: ``commit``, ``dirty``, ``diff``) over the paths that
    decide a result here: trl_mdi/, fixtures/, benchmarks/, pyproject.toml."""
    from _results import code_version as version

    return version(paths=("trl_mdi", "fixtures", "benchmarks", "pyproject.toml"), root=root)


def code_label(code: dict | None) -> str:
    """``abc123def456`` or ``abc123def456+dirty(diff 1a2b3c)``."""
    if not code or not code.get("commit"):
        return "unknown"
    return code["commit"][:12] + (f"+dirty(diff {code['diff']})" if code.get("dirty") else "")


def write_json(path: Path, data: dict) -> None:
    _lp().write_json(path, _clean_json(data))


def held_out_test_rows(recipe: LookOrGuessRecipe, s: ExperimentSettings):
    """The test split: ``s.n_test`` rows with conflict rate ``s.test_conflict_rate`` from their own stream."""
    return synthetic_dataset(s.n_test, split=TEST_SPLIT, seed=recipe.data_seed, kinds=recipe.kinds,
                             option_order=recipe.option_order, image_size=recipe.image_size,
                             conflict_rate=s.test_conflict_rate)


def dev_rows(recipe: LookOrGuessRecipe, s: ExperimentSettings):
    """The development split: ``s.n_dev`` validation rows at the training rows' conflict rate."""
    return synthetic_dataset(s.n_dev, split=DEV_SPLIT, seed=recipe.data_seed, kinds=recipe.kinds,
                             option_order=recipe.option_order, image_size=recipe.image_size,
                             conflict_rate=s.pool_conflict_rate)


def pool_rows(recipe: LookOrGuessRecipe, s: ExperimentSettings):
    """The GRPO training rows: train split, seed ``data_seed + 1`` (not the warm-up's rows), no conflict row."""
    return synthetic_dataset(s.n_pool, split="train", seed=recipe.data_seed + 1, kinds=recipe.kinds,
                             option_order=recipe.option_order, image_size=recipe.image_size,
                             conflict_rate=s.pool_conflict_rate)


# ------------------------------------------------------------------------------------ the choice (dev split)


def zero_spread_share(values, prompts) -> float:
    """Share of prompts whose rollouts all have the same value (GRPO's advantage from it is 0 there).

    >>> zero_spread_share([1.0, 1.0, 0.0, 0.5], [0, 0, 1, 1])
    0.5
    """
    groups = defaultdict(set)
    for v, p in zip(values, prompts):
        groups[p].add(round(float(v), 9))
    return _share(len(g) == 1 for g in groups.values())


def gain_form_table(rollouts: list[dict], n_boot: int = 1000) -> dict:
    """Per form of the completion's gain (``visual_gain``: mean over tokens; ``visual_gain_sum``: sum), how well the
    REWARD it pays (clip(g, 0, G) / G, the registry's G) separates look from guess rollouts inside a prompt's group
    (``within_prompt_auroc``, look = positive, prompt-bootstrap interval), the raw gain's within-prompt AUROC, and
    the reward's zero-spread share over groups (every rollout of the group, either style or neither). ``rollouts``:
    labelled and scored (``label_rollouts``, ``score_rollouts``), sampled ones only."""
    from trl_mdi.profile.validation import HIGH, within_prompt_auroc
    from trl_mdi.rewards.functions import VISUAL_GAIN_CLIP, VISUAL_GAIN_SUM_CLIP

    clips = {"visual_gain": VISUAL_GAIN_CLIP, "visual_gain_sum": VISUAL_GAIN_SUM_CLIP}
    scored = [r for r in rollouts if r.get("gains") is not None]
    prompts = [r["prompt"] for r in scored]
    labels = [1 if r["style"] == LOOK else 0 if r["style"] == GUESS else None for r in scored]
    out = {}
    for form, clip in clips.items():
        raw = [r["visual_gain"] if form == "visual_gain" else sum(r["gains"]) for r in scored]
        reward = [min(max(g, 0.0), clip) / clip for g in raw]
        w = within_prompt_auroc(reward, labels, prompts, direction=HIGH, n_boot=n_boot)
        w_raw = within_prompt_auroc(raw, labels, prompts, direction=HIGH)
        look = [x for x, y in zip(reward, labels) if y == 1]
        guess = [x for x, y in zip(reward, labels) if y == 0]
        out[form] = {"clip": clip, "within_auroc": w["auroc"], "low": w["low"], "high": w["high"], "pairs": w["pairs"],
                     "prompts": w["prompts"], "raw_within_auroc": w_raw["auroc"],
                     "zero_spread": zero_spread_share(reward, prompts),
                     "reward_look": _share(look), "reward_guess": _share(guess),
                     "saturated_look": _share(x >= 1.0 for x in look)}
    return out


def pick_gain_form(table: dict) -> tuple[str, str]:
    """The form with the higher within-prompt AUROC of its reward; within 0.005 of each other, the one with the
    smaller zero-spread share; still tied, the mean form (the registry's ``visual_gain``). Returns (form, why).

    >>> pick_gain_form({"visual_gain": {"within_auroc": 0.98, "zero_spread": 0.2},
    ...                 "visual_gain_sum": {"within_auroc": 0.99, "zero_spread": 0.1}})[0]
    'visual_gain_sum'
    >>> pick_gain_form({"visual_gain": {"within_auroc": 0.990, "zero_spread": 0.2},
    ...                 "visual_gain_sum": {"within_auroc": 0.992, "zero_spread": 0.2}})[0]
    'visual_gain'
    """
    a, b = table["visual_gain"], table["visual_gain_sum"]
    if abs(a["within_auroc"] - b["within_auroc"]) > 0.005:
        form = max(GAIN_FORMS, key=lambda f: table[f]["within_auroc"])
        return form, f"higher within-prompt AUROC of its reward ({table[form]['within_auroc']:.3f})"
    if abs(a["zero_spread"] - b["zero_spread"]) > 1e-9:
        form = min(GAIN_FORMS, key=lambda f: table[f]["zero_spread"])
        return form, (f"within-prompt AUROCs within 0.005 ({a['within_auroc']:.3f} vs {b['within_auroc']:.3f}); "
                      f"smaller zero-spread share ({table[form]['zero_spread']:.3f})")
    return "visual_gain", (f"tied on within-prompt AUROC ({a['within_auroc']:.3f} vs {b['within_auroc']:.3f}) and "
                           "zero-spread share: the mean form, the registry's default")


def pick_kind(tables: dict[str, dict], order: tuple[str, ...]) -> tuple[str, str]:
    """The counterfactual kind whose better reward form separates look from guess best inside groups (within-prompt
    AUROC of the reward); within 0.005 of the best, the smaller zero-spread share; still tied, the first in
    ``order`` (the trainer's default first). ``tables``: kind -> :func:`gain_form_table`. Returns (kind, why).

    >>> t = lambda a, z: {"visual_gain": {"within_auroc": a, "zero_spread": z},
    ...                   "visual_gain_sum": {"within_auroc": a, "zero_spread": z}}
    >>> pick_kind({"black": t(0.88, 0.0), "grey": t(0.99, 0.1), "none": t(0.992, 0.0)}, ("black", "grey", "none"))[0]
    'none'
    """
    best = {k: max(t[f]["within_auroc"] for f in GAIN_FORMS) for k, t in tables.items()}
    spread = {k: min(t[f]["zero_spread"] for f in GAIN_FORMS) for k, t in tables.items()}
    top = max(best.values())
    near = [k for k in order if k in tables and best[k] >= top - 0.005]
    kind = min(near, key=lambda k: (spread[k], order.index(k)))
    others = ", ".join(f"{k} {best[k]:.3f}" for k in order if k in tables and k != kind)
    return kind, (f"within-prompt AUROC of its reward {best[kind]:.3f} (others: {others or 'none'})"
                  + (f"; of the kinds within 0.005 of the best ({', '.join(near)}), the smallest zero-spread share "
                     f"({spread[kind]:.3f}) then the trainer's order" if len(near) > 1 else ""))


def choose_reward(model, processor, ds, s: ExperimentSettings, log=print) -> dict:
    """The development-split choice: ``s.dev_samples`` rollouts per dev prompt from the warm-up (one GRPO group),
    each labelled from its text and scored per token against every candidate counterfactual kind (``s.dev_kinds``
    when ``s.counterfactual`` is ``"auto"``, else that kind alone); per kind :func:`gain_form_table`; the kind by
    :func:`pick_kind`, the form by :func:`pick_gain_form` (``s.gain_form`` when given). TPRL's perturbation: the
    chosen kind, or the best pixel kind when the chosen one is ``"none"`` (TPRL perturbs an image)."""
    from trl_mdi.counterfactual import NO_IMAGE

    start = time.perf_counter()
    model.eval()
    rollouts = sample_rollouts(model, processor, ds, samples=s.dev_samples, max_new_tokens=s.max_completion_length,
                               seed=0, greedy=False)
    label_rollouts(rollouts, ds)
    kinds = tuple(s.dev_kinds) if s.counterfactual == "auto" else (s.counterfactual,)
    tables, scored = {}, {}
    for kind in kinds:
        rs = [dict(r) for r in rollouts]
        score_rollouts(model, processor, rs, ds, kind=kind)
        tables[kind], scored[kind] = gain_form_table(rs, s.n_boot), rs
        log(f"  dev split, counterfactual {kind}: " + "; ".join(
            f"{f}: within AUROC {t['within_auroc']:.3f}, zero spread {t['zero_spread']:.3f}"
            for f, t in tables[kind].items()))
    kind, why_kind = pick_kind(tables, kinds)
    form, why = (s.gain_form, "given by --gain_form") if s.gain_form != "auto" else pick_gain_form(tables[kind])
    pixel = [k for k in kinds if k != NO_IMAGE]
    tprl = kind if kind != NO_IMAGE else (pick_kind({k: tables[k] for k in pixel}, tuple(pixel))[0] if pixel
                                          else "black")
    m = style_metrics(rollouts)
    pos = position_gains(scored[kind], processor.tokenizer)
    log(f"  dev split: {len(rollouts)} rollouts, look rate {m['all']['look_rate']:.3f} -> counterfactual {kind}, "
        f"{form}; TPRL's perturbation {tprl}")
    return {"tables": tables, "kind": kind, "why_kind": why_kind, "form": form, "why": why, "tprl_perturbation": tprl,
            "rollouts": len(rollouts), "prompts": len(ds), "look_rate": m["all"]["look_rate"],
            "both_styles": m["both_styles"],
            "where": {st: {"colour_word": pos[st]["colour_word"], "elsewhere": pos[st]["elsewhere"],
                           "rollouts": pos[st]["rollouts"]} for st in STYLES},
            "seconds": round(time.perf_counter() - start, 1)}


# ------------------------------------------------------------------------------------ held-out figures


def evaluate_styles(model, processor, ds, s: ExperimentSettings, seed: int = 0) -> dict:
    """Held-out figures of one model on ``ds``: ``s.eval_samples`` completions per prompt at temperature 1 and the
    greedy one, labelled from their text; ``sampled`` / ``greedy``: :func:`style_metrics`; ``records``: per
    rollout (prompt, sample, style, correct, clean, conflict) for recomputing."""
    start = time.perf_counter()
    was_training = model.training
    model.eval()
    try:
        rollouts = sample_rollouts(model, processor, ds, samples=s.eval_samples,
                                   max_new_tokens=s.max_completion_length, seed=seed)
    finally:
        model.train(was_training)
    label_rollouts(rollouts, ds)
    return {"sampled": style_metrics([r for r in rollouts if r["sample"] > 0]),
            "greedy": style_metrics([r for r in rollouts if r["sample"] == 0]),
            "records": [[r["prompt"], r["sample"], r["style"], int(r["correct"]), int(r["clean"]), int(r["conflict"])]
                        for r in rollouts],
            # the most frequent sampled texts of each style: what a policy writes when it leaves both styles
            "examples": {st: Counter(r["text"] for r in rollouts if r["sample"] > 0 and r["style"] == st).most_common(3)
                         for st in (*STYLES, OTHER)},
            "seconds": round(time.perf_counter() - start, 1)}


def headline(ev: dict) -> dict:
    """The figures a variant is compared on, from :func:`evaluate_styles`: sampled conflict accuracy (and its
    decomposition), non-conflict accuracy, clean format, look rate (all rows), greedy conflict / non-conflict."""
    m, g = ev["sampled"], ev["greedy"]
    c = m["conflict"]
    return {"conflict": c["accuracy"], "plain": m["plain"]["accuracy"], "clean": m["all"]["clean"],
            "look_rate": m["all"]["look_rate"], "look_rate_conflict": c["look_rate"],
            "look_acc_conflict": c[LOOK]["accuracy"], "guess_rate_conflict": c["guess_rate"],
            "guess_acc_conflict": c[GUESS]["accuracy"], "other_rate_conflict": c["other_rate"],
            "greedy_conflict": g["conflict"]["accuracy"], "greedy_plain": g["plain"]["accuracy"],
            "greedy_look_rate": g["all"]["look_rate"]}


# ------------------------------------------------------------------------------------ detection


def detection_records(model, processor, ds, s: ExperimentSettings, seed: int = 0) -> dict:
    """Rollouts sampled from ``model`` on the first ``s.detect_prompts`` rows of ``ds`` (``s.detect_samples`` per
    prompt at temperature 1) and every per-rollout signal of :data:`DETECTION_SIGNALS` from plain forwards
    (``trl_mdi.profile.reference.measure_reliance``: the probe's MDI and the counterfactual pass against
    ``s.counterfactual``). One record per sampled rollout: ``prompt``, ``conflict``, ``style`` (its text's, the
    label), ``answers_prior`` and the signals (None where undefined)."""
    from trl_mdi.profile.reference import measure_reliance

    was_training = model.training
    model.eval()
    try:
        m = measure_reliance(model, processor, ds.select(range(min(s.detect_prompts, len(ds)))), [s.counterfactual],
                             samples=s.detect_samples, max_new_tokens=s.max_completion_length, batch_size=32,
                             seed=seed)
    finally:
        model.train(was_training)
    records = []
    for r in m.rollouts:
        if r["sample"] == 0:
            continue
        p = m.prompts[r["prompt"]]
        sig = r["signals"][s.counterfactual]
        values = {n: (r.get(n) if n.startswith("mdi") else sig.get(n)) for n in DETECTION_SIGNALS}
        records.append({"prompt": r["prompt"], "conflict": p["conflict"], "style": read_style(r["completion"]),
                        "answers_prior": r["answer"] is not None and r["answer"] == p["prior"],
                        **{n: None if v is None or (isinstance(v, float) and math.isnan(v)) else round(float(v), 6)
                           for n, v in values.items()}})
    return {"records": records, "seconds": round(m.seconds, 1), "prompts": len(m.prompts)}


def detection_tables(records: list[dict], n_boot: int = 1000, seed: int = 0) -> dict:
    """Per row kind (``plain``: non-conflict, the detection goal; ``conflict``), ``trl_mdi.profile.validation.signal_table``
    of every signal against the style label (guess = positive: it follows the prior; look = 0; other rollouts left
    out), on the common set of rollouts, prompts resampled; plus on conflict rows the same signals against the
    language-prior benchmark's answer label (``answer``: the answer is the object's usual colour)."""
    from trl_mdi.profile.validation import signal_table

    out = {}
    for name, keep in (("plain", False), ("conflict", True)):
        rs = [r for r in records if bool(r["conflict"]) == keep]
        if not rs:
            continue
        labels = [1 if r["style"] == GUESS else 0 if r["style"] == LOOK else None for r in rs]
        signals = {n: [math.nan if r.get(n) is None else r[n] for r in rs] for n in DETECTION_SIGNALS}
        out[name] = signal_table(signals, labels, [r["prompt"] for r in rs], n_boot=n_boot, seed=seed)
        if keep:
            answer = [1 if r["answers_prior"] else 0 for r in rs]
            out["conflict_answer"] = signal_table(signals, answer, [r["prompt"] for r in rs], n_boot=n_boot,
                                                  seed=seed)
    return out


def best_within(table: list[dict] | None) -> tuple[str | None, float]:
    """The signal with the highest within-prompt AUROC of a ``signal_table`` (NaN rows skipped)."""
    r = best_within_row(table)
    return (None, math.nan) if r is None else (r["signal"], r["within_auroc"])


def best_within_row(table: list[dict] | None) -> dict | None:
    """The ``signal_table`` row with the highest within-prompt AUROC (NaN rows skipped), or None."""
    rows = [r for r in table or [] if r.get("within_auroc") is not None and not math.isnan(r["within_auroc"])]
    return max(rows, key=lambda r: r["within_auroc"]) if rows else None


MIN_DETECTION_PAIRS = 20  # fewer look/guess pairs of one prompt than this: the prompt bootstrap cannot say much


def detection_verdict(row: dict | None, goal: float = GOAL_WITHIN_AUROC) -> str:
    """"met" only when the within-prompt AUROC's prompt-bootstrap interval lies at or above ``goal`` on at least
    ``MIN_DETECTION_PAIRS`` pairs; "too few pairs to tell" below that (a model that keeps 2 guessing rollouts gives
    a degenerate interval); else "not met".

    >>> detection_verdict({"within_auroc": 1.0, "within_low": 1.0, "within_pairs": 6})
    'too few pairs to tell (6 pairs)'
    >>> detection_verdict({"within_auroc": 0.982, "within_low": 0.959, "within_pairs": 223})
    'met'
    >>> detection_verdict({"within_auroc": 0.96, "within_low": 0.91, "within_pairs": 223})
    'not met (interval from 0.910)'
    """
    if row is None:
        return "not met (no pair)"
    if row.get("within_pairs", 0) < MIN_DETECTION_PAIRS:
        return f"too few pairs to tell ({row.get('within_pairs', 0)} pairs)"
    low = row.get("within_low", math.nan)
    if row["within_auroc"] >= goal and not math.isnan(low) and low >= goal:
        return "met"
    return "not met" if row["within_auroc"] < goal else f"not met (interval from {low:.3f})"


def steadiest_signal(tables: dict[str, list[dict] | None]) -> tuple[str | None, float]:
    """The signal whose LOWEST within-prompt AUROC over the models' tables is highest (the detection goal asks one
    signal to hold on the warm-up and on every trained model), with that lowest value; a model on which a signal
    has no pair (NaN), or a model whose table lacks it, counts as a miss for it."""
    names = {r["signal"] for table in tables.values() for r in table or []}
    scores = {n: math.inf for n in names}
    for table in tables.values():
        values = {r["signal"]: r.get("within_auroc") for r in table or []}
        for n in names:
            a = values.get(n)
            scores[n] = min(scores[n], -math.inf if a is None or math.isnan(a) else a)
    if not scores:
        return None, math.nan
    name = max(scores, key=scores.get)
    return name, scores[name] if math.isfinite(scores[name]) else math.nan


# ------------------------------------------------------------------------------------ GRPO runs


LOGGED = ("reward", "rewards/", "reliance/", "tprl/", "attention/mdi", "completions/mean_length",
          "completions/clipped_ratio", "entropy")


def _step_logger_class():
    from transformers import TrainerCallback

    class StepLog(TrainerCallback):
        """Each step's logged metrics (``rewards/look_rate/mean`` among them) and time; with ``mid`` the held-out
        figures at that step (their time kept out of the training time)."""

        def __init__(self, run: dict, evaluate, mid: int | None):
            self.run, self.evaluate, self.mid = run, evaluate, mid
            self.t0 = self.last = self.eval_seconds = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.t0 = self.last = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            now = time.perf_counter()
            self.run["step_seconds"].append(round(now - self.last, 3))
            self.last = now
            if self.mid and state.global_step == self.mid:
                ev = self.evaluate(model)
                self.eval_seconds += ev["seconds"]
                self.run["mid"] = {"step": state.global_step, **headline(ev)}
                self.last = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.run["steps"].append({"step": state.global_step,
                                          **{k: v for k, v in logs.items() if k.startswith(LOGGED)}})

    return StepLog


def run_one(name: str, variant, seed: int, model_dir: Path, pool, test, s: ExperimentSettings, work: Path,
            log) -> dict:
    """One GRPO run from the warm-up: per-step logs, the held-out figures at the end (and midway with
    ``s.eval_mid``), and with ``seed`` in ``s.detect_seeds`` the detection records of the trained model."""
    from transformers import AutoProcessor
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from trl_mdi.diagnostics import ConsoleSummaryCallback
    from trl_mdi.trainer import MDIGRPOTrainer

    key = f"{name}-s{seed}"
    run = {"key": key, "variant": name, "seed": seed, "steps": [], "step_seconds": [], "started_at": time.time(),
           "load": [os.getloadavg()[0]]}
    t0 = time.perf_counter()
    trainer = MDIGRPOTrainer(str(model_dir), args=_lp().grpo_config(variant, seed, s, work / "grpo" / key),
                             train_dataset=pool)
    for cb in (ConsoleSummaryCallback, PrinterCallback, ProgressCallback):  # keep the output readable
        trainer.remove_callback(cb)
    processor = AutoProcessor.from_pretrained(model_dir)
    mid = s.steps // 2 if s.eval_mid and s.steps >= 2 else None
    logger = _step_logger_class()(run, lambda m: evaluate_styles(m, processor, test, s, seed), mid)
    trainer.add_callback(logger)
    trainer.train()
    run["grpo_seconds"] = round(time.perf_counter() - logger.t0 - logger.eval_seconds, 1)
    model = trainer.model
    ev = evaluate_styles(model, processor, test, s, seed)
    run["eval"] = ev
    run["final"] = headline(ev)
    f = run["final"]
    look = [x.get("rewards/look_rate/mean") for x in run["steps"]]
    log(f"  [{key}] {s.steps} steps {run['grpo_seconds']:.0f} s; look rate in training {look[0]:.2f} -> "
        f"{look[-1]:.2f}; test: conflict {f['conflict']:.3f} (look rate {f['look_rate_conflict']:.2f} x "
        f"{f['look_acc_conflict']:.2f}), non-conflict {f['plain']:.3f}, clean {f['clean']:.3f}")
    if seed in s.detect_seeds:
        run["detection"] = detection_records(model, processor, test, s, seed)
        log(f"  [{key}] detection: {len(run['detection']['records'])} rollouts, {run['detection']['seconds']:.0f} s")
    run["wall_seconds"] = round(time.perf_counter() - t0, 1)
    run["load"].append(os.getloadavg()[0])
    run["ended_at"] = time.time()
    return run


def warmup_figures(model_dir: Path, test, s: ExperimentSettings, log) -> dict:
    """The warm-up model on the test split: its held-out figures (step 0 of every run) and detection records."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    started_at = time.time()
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    ev = evaluate_styles(model, processor, test, s, 0)
    out = {"eval": ev, "final": headline(ev), "started_at": started_at}
    log(f"  warm-up on the test split: conflict {out['final']['conflict']:.3f}, look rate "
        f"{out['final']['look_rate']:.3f}, {ev['seconds']:.0f} s")
    out["detection"] = detection_records(model, processor, test, s, 0)
    out["ended_at"] = time.time()
    log(f"  warm-up detection: {len(out['detection']['records'])} rollouts, {out['detection']['seconds']:.0f} s")
    return out


_DATA: dict = {}


def execute(job: dict) -> tuple[dict | None, str | None]:
    """Run one job and save its JSON: the warm-up's figures or a (variant, seed) run. Returns ``(result, None)``,
    or ``(None, error)`` (``_results.run_and_save``). The rows are built once per process."""
    from _results import run_and_save

    s, recipe, work = job["settings"], job["recipe"], job["work"]

    def body(log) -> dict:
        if "test" not in _DATA:
            _DATA["test"] = held_out_test_rows(recipe, s)
        if job["what"] == "warmup":
            log("== the warm-up model on the test split")
            return warmup_figures(job["model_dir"], _DATA["test"], s, log)
        if "pool" not in _DATA:
            _DATA["pool"] = pool_rows(recipe, s)
        log(f"== {job['name']}, seed {job['seed']}")
        return run_one(job["name"], job["variant"], job["seed"], job["model_dir"], _DATA["pool"], _DATA["test"], s,
                       work, log)

    return run_and_save(job, body, {"fingerprint": job["key"], "code": job["code"], "settings_key": job["key"]},
                        save=write_json)  # this module's: NaN as null, keys as strings


# ------------------------------------------------------------------------------------ the report


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and isinstance(x, (int, float)) and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def _spread(xs, digits: int = 3) -> str:
    """``mean ± sd`` over seeds (sample sd; one value: the value)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return "—"
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return f"{m:.{digits}f} ± {sd:.{digits}f}"


def by_variant(runs: list[dict]) -> dict[str, list[dict]]:
    out = defaultdict(list)
    for r in runs:
        out[r["variant"]].append(r)
    return {k: sorted(v, key=lambda r: r["seed"]) for k, v in out.items()}


def variant_verdicts(groups: dict[str, list[dict]], metric: str = "conflict") -> dict[str, dict]:
    """Per variant other than the baseline: the paired difference of its final ``metric`` to the baseline's, seed by
    seed (``paired_seed_difference``), and ``benchmarks.stats.verdict`` with issue 30's goals (difference >= +0.30
    with the interval above 0, non-conflict >= 0.98, clean >= 0.9; means over seeds)."""
    from benchmarks.stats import paired_seed_difference, verdict

    base = {r["seed"]: r["final"][metric] for r in groups.get(BASELINE, [])}
    out = {}
    for name, rs in groups.items():
        if name == BASELINE:
            continue
        d = paired_seed_difference({r["seed"]: r["final"][metric] for r in rs}, base)
        plain = _mean(r["final"]["plain"] for r in rs)
        clean = _mean(r["final"]["clean"] for r in rs)
        v = verdict(d, min_effect=GOAL_CONFLICT_GAIN,
                    goals=[("non-conflict", plain, ">=", GOAL_PLAIN), ("clean format", clean, ">=", GOAL_CLEAN)])
        out[name] = {"difference": d, "verdict": v, "plain": plain, "clean": clean}
    return out


def trajectory(rs: list[dict], key: str = "rewards/look_rate/mean", window: int = 5) -> list[tuple[int, float]]:
    """The mean over seeds of a logged per-step metric, averaged over consecutive windows of ``window`` steps (one
    step holds only prompts_per_step x num_generations rollouts): ``[(last step of the window, mean), ...]``."""
    steps = max((len(r["steps"]) for r in rs), default=0)
    out = []
    for lo in range(0, steps, window):
        vals = [x.get(key) for r in rs for x in r["steps"][lo:lo + window]]
        out.append((min(lo + window, steps), _mean(vals)))
    return out


def _cell(x, digits: int = 3) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _auc_cell(row: dict | None, within: bool) -> str:
    if not row:
        return "—"
    k = "within_" if within else ""
    return f"{_cell(row.get(k + 'auroc'))} [{_cell(row.get(k + 'low'))}, {_cell(row.get(k + 'high'))}]"


def report(*, choice: dict | None, warm: dict | None, runs: list[dict], s: ExperimentSettings, recipe,
           argv: list[str], missing: list[str], failed: list[tuple[str, str]], code: dict, minutes: float | None,
           workers: int, threads: int, load: float | None = None, variants: dict | None = None) -> str:
    """The RESULTS.md section, from stored records only (no model): the design, the warm-up, the dev-split choice,
    per variant the held-out figures and paired verdicts, the look-rate trajectories, the detection tables and
    the goals, then what did not finish."""
    from _results import result_args

    from benchmarks.stats import format_paired_difference
    from trl_mdi.profile.validation import format_signal_table

    groups = by_variant(runs)
    names = [n for n in s.variants if n in groups]
    variants = variants or experiment_variants(choice["form"] if choice else "visual_gain")
    codes = sorted({code_label(r.get("code")) for r in runs + ([warm] if warm else [])})
    L = [SECTION, ""]
    args = result_args(argv, OUTPUT_ONLY_FLAGS)
    args = ["experiment" if a == "report" else a for a in args]  # the command that produces these records
    cmd = " ".join(["python benchmarks/look_or_guess.py", *args])
    L += [f"Reproduce: `{cmd}` (resumable: finished runs are JSON files in `--work_dir`; `report` rewrites this "
          "section from them). Code: " + ", ".join(f"`{c}`" for c in codes or [code_label(code)])
          + (f" (this report: `{code_label(code)}`)" if codes and code_label(code) not in codes else "") + ".", ""]
    L += ["Design (issue 30 items 2-3). Task: the prior-colour questions answered by a short chain of thought in one of "
          "two styles of equal length per object: *look* (`<think> the shape is red</think>`, the colour read off the "
          "image) or *guess* (`<think> a tomato is red</think>`, the object's usual colour), each rollout's style "
          "read from its own text (no model signal). Warm-up: "
          f"{recipe.n_train} rows, conflict rate {recipe.conflict_rate}, styles drawn afresh every epoch, "
          f"{recipe.epochs:g} SFT epochs of the tiny Qwen2-VL. GRPO (`MDIGRPOTrainer`) from it on training rows "
          f"WITHOUT conflicts ({s.n_pool}-row pool, conflict rate {s.pool_conflict_rate}: guessing is never wrong, "
          "so the answer and format rewards cannot tell the styles apart), "
          f"{s.steps} steps x {s.prompts_per_step} prompts x {s.num_generations} rollouts, lr {s.learning_rate}, "
          f"max_completion_length {s.max_completion_length}, counterfactual `{s.counterfactual}`, seeds "
          f"{', '.join(map(str, s.seeds))} for every variant (same steps, same seeds). Every run logs its rollouts' "
          "look rate per step (a zero-weight reward, `fixtures.synthetic.look_or_guess.look_rate`). Held out: the "
          f"TEST split (`{TEST_SPLIT}`, {s.n_test} prompts, conflict rate {s.test_conflict_rate}; nothing was chosen "
          f"on it), {s.eval_samples} completions per prompt sampled at temperature 1, greedy beside; on conflict rows "
          "only the look style is right. Choices were made on the DEVELOPMENT split (validation rows at the training "
          "conflict rate) or fixed in advance: the reward form (below), the clip (the registry's: 0.5 nats per token "
          "for the mean, 4 nats for the sum), weight 1 beside 4:1 (the brief's stack), the counterfactual kind (below), "
          "the steps (the time budget).", ""]
    # ---- warm-up
    if warm:
        w = warm["eval"]["sampled"]
        g = warm["eval"]["greedy"]
        L += ["### Warm-up (test split, sampled at temperature 1)", "",
              "| rows | n | look rate | guess rate | other | look: accuracy | guess: accuracy | guess: answers prior | "
              "accuracy | clean |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for k, label in (("all", "all"), ("conflict", "conflict"), ("plain", "non-conflict")):
            x = w[k]
            L.append(f"| {label} | {x['n']} | {_cell(x['look_rate'])} | {_cell(x['guess_rate'])} | "
                     f"{_cell(x['other_rate'])} | {_cell(x[LOOK]['accuracy'])} | {_cell(x[GUESS]['accuracy'])} | "
                     f"{_cell(x[GUESS]['answers_prior'])} | {_cell(x['accuracy'])} | {_cell(x['clean'])} |")
        L += ["", f"Both styles among a prompt's {s.eval_samples} samples: {_cell(w['both_styles'])}. Greedy: look rate "
              f"{_cell(g['all']['look_rate'])}, conflict accuracy {_cell(g['conflict']['accuracy'])}, non-conflict "
              f"{_cell(g['plain']['accuracy'])}.", ""]
    else:
        L += ["Warm-up figures on the test split: not finished.", ""]
    # ---- the choice
    if choice and choice.get("tables"):
        L += ["### The counterfactual and the reward form, chosen on the development split", "",
              f"{choice['rollouts']} rollouts of the warm-up ({choice['prompts']} dev prompts x {s.dev_samples}, one "
              f"GRPO group each; look rate {_cell(choice['look_rate'])}, both styles in {_cell(choice['both_styles'])} "
              "of groups), each counterfactual kind's and form's reward against the style (look = positive):", "",
              "| counterfactual | form | clip | within-prompt AUROC of the reward [95% CI] (pairs) | of the raw gain | "
              "zero-spread groups | mean reward, look | mean reward, guess | look rollouts at the clip |",
              "|---|---|---:|---|---:|---:|---:|---:|---:|"]
        for kind, table in choice["tables"].items():
            for f, t in table.items():
                L.append(f"| {kind} | {f} | {t['clip']:g} | {_cell(t['within_auroc'])} [{_cell(t['low'])}, "
                         f"{_cell(t['high'])}] ({t['pairs']}) | {_cell(t['raw_within_auroc'])} | "
                         f"{_cell(t['zero_spread'])} | {_cell(t['reward_look'])} | {_cell(t['reward_guess'])} | "
                         f"{_cell(t['saturated_look'])} |")
        where = choice.get("where")
        if where:
            L += ["", "Where the image enters, on these rollouts (clean ones): mean per-token gain at the colour word "
                  f"(the token before `</think>`): look {_cell(where[LOOK]['colour_word'])}, guess "
                  f"{_cell(where[GUESS]['colour_word'])} nats; mean |gain| at every other position: look "
                  f"{_cell(where[LOOK]['elsewhere'])}, guess {_cell(where[GUESS]['elsewhere'])}."]
        L += ["", f"Chosen: counterfactual `{choice['kind']}`: {choice['why_kind']}; reward `{choice['form']}`: "
              f"{choice['why']}. TPRL's perturbation: `{choice['tprl_perturbation']}`.", ""]
    # ---- expectations
    L += ["### Expected outcomes, stated before the runs", ""]
    L += [f"- **{variants[n].label}**: {EXPECTED[n]}" for n in s.variants]
    L += [""]
    # ---- variants
    verdicts = variant_verdicts(groups)
    L += [f"### Held-out figures per variant (test split, {s.eval_samples} samples per prompt at T=1; mean ± sd over "
          "seeds)", "",
          "| variant | seeds | conflict accuracy | = look rate x look accuracy | + guess rate x guess accuracy | "
          "non-conflict accuracy | clean format | look rate (all rows) | greedy: conflict / non-conflict | "
          "Δ conflict vs answer + format, paired [95% CI] | verdict |", "|---|---:|---|---|---|---|---|---|---|---|---|"]
    if warm:
        f = warm["final"]
        L.append(f"| warm-up (step 0) | — | {_cell(f['conflict'])} | {_cell(f['look_rate_conflict'])} x "
                 f"{_cell(f['look_acc_conflict'])} | {_cell(f['guess_rate_conflict'])} x {_cell(f['guess_acc_conflict'])}"
                 f" | {_cell(f['plain'])} | {_cell(f['clean'])} | {_cell(f['look_rate'])} | "
                 f"{_cell(f['greedy_conflict'])} / {_cell(f['greedy_plain'])} | | |")
    for n in names:
        rs = groups[n]
        fin = [r["final"] for r in rs]
        v = verdicts.get(n)
        L.append(f"| {variants[n].label} | {len(rs)} | {_spread([x['conflict'] for x in fin])} | "
                 f"{_spread([x['look_rate_conflict'] for x in fin], 2)} x {_spread([x['look_acc_conflict'] for x in fin], 2)}"
                 f" | {_spread([x['guess_rate_conflict'] for x in fin], 2)} x "
                 f"{_spread([x['guess_acc_conflict'] for x in fin], 2)} | {_spread([x['plain'] for x in fin])} | "
                 f"{_spread([x['clean'] for x in fin])} | {_spread([x['look_rate'] for x in fin])} | "
                 f"{_cell(_mean(x['greedy_conflict'] for x in fin))} / {_cell(_mean(x['greedy_plain'] for x in fin))} | "
                 + (f"{format_paired_difference(v['difference'])} | {v['verdict']['text']} |" if v else "baseline | |"))
    others = [(variants[n].label, r["eval"]["examples"][OTHER][0]) for n in names for r in groups[n][:1]
              if r.get("eval", {}).get("examples", {}).get(OTHER)]
    if others:
        L += ["", "Most frequent sampled text in neither style (the first seed's test rollouts, with its count): "
              + "; ".join(f"{lab}: `{t!r}` ({c})" for lab, (t, c) in others) + "."]
    L += ["", "Verdict: `benchmarks.stats.verdict`: \"shown\" only when the paired 95% t interval over seeds lies above 0, "
          f"the mean difference reaches +{GOAL_CONFLICT_GAIN:.2f}, non-conflict accuracy >= {GOAL_PLAIN} and clean "
          f"format >= {GOAL_CLEAN} (means over seeds). A mid-run evaluation: "
          + ("at step " + str(s.steps // 2) + " (in the run records)." if s.eval_mid else "none (cut for time)."), ""]
    # ---- trajectories
    if groups:
        traj = {n: trajectory(groups[n]) for n in names}
        ends = [e for e, _ in next(iter(traj.values()))]
        L += ["### Look rate of the training rollouts, per step (mean over seeds, windows of 5 steps)", "",
              "| variant | " + " | ".join(f"≤{e}" for e in ends) + " |", "|---|" + "---:|" * len(ends)]
        for n in names:
            L.append(f"| {variants[n].label} | " + " | ".join(_cell(v, 2) for _, v in traj[n]) + " |")
        L += ["", "Zero-spread share during training (groups of a step in which a reward ties; mean over steps and "
              "seeds): where answer and format tie, only the third reward can move the style.", "",
              "| variant | mc_idx | think_format | third reward |", "|---|---:|---:|---|"]
        for n in names:
            def zs(reward, rs=groups[n]):
                return _mean(x.get(f"rewards/{reward}_reward/zero_spread_frac") for r in rs for x in r["steps"])
            third = variants[n].rewards[2] if len(variants[n].rewards) > 4 else None
            L.append(f"| {variants[n].label} | {_cell(zs('mc_idx'))} | {_cell(zs('think_format'))} | "
                     + (f"{third}: {_cell(zs(third))}" if third else "—") + " |")
        L += [""]
    # ---- detection
    models = ([("warm-up", warm)] if warm and warm.get("detection") else []) + [
        (f"{variants[r['variant']].label}, seed {r['seed']}", r) for n in names for r in groups[n] if r.get("detection")]
    tables = {label: detection_tables(rec["detection"]["records"], s.n_boot) for label, rec in models}
    if models:
        wl = models[0][0]
        t = tables[wl]
        L += ["### Which signal sees the style (the detection table)", "",
              f"Rollouts sampled at T=1 ({s.detect_samples} per prompt, first {s.detect_prompts} test prompts), every "
              "signal from plain forwards (`trl_mdi.profile.reference.measure_reliance`, counterfactual "
              f"`{s.counterfactual}`), against the style label: guess = positive (it follows the prior), look = "
              "negative, rollouts in neither style left out; one common set of rollouts per table (n per signal: "
              "before the restriction), prompts resampled for the 95% intervals, within-prompt AUROC over pairs of "
              "rollouts of the same prompt (what GRPO's groups can use). Oriented as the signal table says "
              "(`visual_gain` low = guess, MDI high = guess).", ""]
        for key, title in (("plain", "non-conflict rows (the detection goal)"), ("conflict", "conflict rows"),
                           ("conflict_answer", "conflict rows, against the language-prior answer label (the answer "
                            "is the object's usual colour)")):
            if key in t:
                L += [f"{wl}, {title}:", "", format_signal_table(t[key]), ""]
        if len(models) > 1:
            L += ["Every model, non-conflict rows: within-prompt AUROC [95% CI] (pooled AUROC below it in the "
                  "next table).", "", "| signal | " + " | ".join(lab for lab, _ in models) + " |",
                  "|---|" + "---|" * len(models)]
            for sig in DETECTION_SIGNALS:
                row = [next((r for r in tables[lab].get("plain", []) if r["signal"] == sig), None) for lab, _ in models]
                L.append(f"| {sig} | " + " | ".join(_auc_cell(r, True) for r in row) + " |")
            L += ["", "| signal (pooled AUROC) | " + " | ".join(lab for lab, _ in models) + " |",
                  "|---|" + "---|" * len(models)]
            for sig in DETECTION_SIGNALS:
                row = [next((r for r in tables[lab].get("plain", []) if r["signal"] == sig), None) for lab, _ in models]
                L.append(f"| {sig} | " + " | ".join(_auc_cell(r, False) for r in row) + " |")
            L += ["", "n (guess) on the common set: " + "; ".join(
                f"{lab}: {tables[lab]['plain'][0]['n']} ({tables[lab]['plain'][0]['n_prior']})"
                for lab, _ in models if tables[lab].get("plain")) + ".", ""]
    else:
        L += ["Detection table: not finished.", ""]
    # ---- goals
    L += ["### Goals, as they came out", ""]
    reliance_names_ = [n for n in names if n not in (BASELINE, "answer_visual_gain", "tprl_counterfactual")]
    best = max((n for n in reliance_names_ if n in verdicts),
               key=lambda n: verdicts[n]["difference"]["mean"] if not math.isnan(verdicts[n]["difference"]["mean"])
               else -math.inf, default=None)
    if best:
        v = verdicts[best]
        L.append(f"- Training: best reliance variant **{variants[best].label}**: Δ conflict "
                 f"{format_paired_difference(v['difference'])} (goal >= +{GOAL_CONFLICT_GAIN:.2f}, interval above 0), "
                 f"non-conflict {_cell(v['plain'])} (goal >= {GOAL_PLAIN}), clean {_cell(v['clean'])} (goal >= "
                 f"{GOAL_CLEAN}): **{v['verdict']['text']}**.")
    else:
        L.append("- Training: no reliance variant with paired seeds finished.")
    for label, _ in models:
        row = best_within_row(tables[label].get("plain"))
        sig, a = (None, math.nan) if row is None else (row["signal"], row["within_auroc"])
        L.append(f"- Detection, {label}: best within-prompt AUROC on non-conflict rows {_cell(a)} ({sig}; goal >= "
                 f"{GOAL_WITHIN_AUROC}, its interval too, on >= {MIN_DETECTION_PAIRS} pairs): "
                 f"**{detection_verdict(row)}**.")
    if models:
        sig, worst = steadiest_signal({lab: tables[lab].get("plain") for lab, _ in models})
        every = len(models) > 1 and worst >= GOAL_WITHIN_AUROC
        L.append(f"- Detection, one signal on the warm-up and every trained model measured: {sig}, lowest "
                 f"within-prompt AUROC {_cell(worst)} over the {len(models)} models: **{'met' if every else 'not met'}**"
                 + ("" if len(models) > 1 else " (no trained model measured yet)") + ".")
    for n in ("answer_visual_gain", "tprl_counterfactual"):
        if n in verdicts:
            d = verdicts[n]["difference"]
            moved = d["n"] >= 2 and not (d["low"] <= 0.0 <= d["high"])
            L.append(f"- Control {variants[n].label}: Δ conflict {format_paired_difference(d)}; expected no "
                     "difference (rewards tie between the styles): "
                     + ("**not as expected: the interval excludes 0**." if moved else "as expected, none shown."))
    misses = [line for line in L[-(len(models) + 5):] if "not met" in line or "not shown" in line]
    if misses or not best:
        L.append(f"- Tried: reward `{choice['form'] if choice else RELIANCE}` ({choice['why'] if choice else 'no form'}), "
                 "clip the registry's (0.5 nats per token mean / 4 nats sum), weight 1 beside mc_idx 4 and "
                 f"think_format 1, counterfactual `{s.counterfactual}`, chains of 13 to 16 tokens (the two styles of "
                 f"equal length per object), {s.steps} steps at lr {s.learning_rate}; what the signals show is in the "
                 "look-rate trajectory (is the style moving?), the zero-spread share (does the reward tie inside "
                 "groups?) and the detection tables above (does the signal still separate the styles?).")
    L.append("")
    # ---- what did not finish
    done_jobs = len(runs)
    L += [f"Runs finished: {done_jobs} of {len(s.variants) * len(s.seeds)}"
          + (f"; wall time {minutes:.1f} min on {workers} worker(s) x {threads} thread(s)" if minutes else "")
          + (f", load average {load:.1f} at the end" if load is not None else "")
          + (f"; step time median {_median([x for r in runs for x in r['step_seconds']]):.2f} s" if runs else "")
          + (f"; the runs' own wall times (GRPO, evaluation, detection) sum to "
             f"{sum(r.get('wall_seconds', 0.0) for r in runs) / 60:.1f} min" if runs else "")
          + "."]
    if missing:
        L.append("Not finished (rerun the command above to finish them): " + ", ".join(missing) + ".")
    if failed:
        L.append("Failed: " + "; ".join(f"{k}: {e}" for k, e in failed) + ".")
    return "\n".join(L).rstrip() + "\n"


def _median(xs) -> float:
    xs = sorted(xs)
    if not xs:
        return math.nan
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


# ------------------------------------------------------------------------------------ the experiment command


def experiment_settings(a: argparse.Namespace) -> ExperimentSettings:
    s = ExperimentSettings()
    for name in ("steps", "gain_form", "n_pool", "n_test", "eval_samples", "n_dev", "dev_samples", "detect_prompts",
                 "detect_samples", "n_boot", "learning_rate", "counterfactual"):  # None: the default
        value = getattr(a, name, None)
        if value is not None:
            setattr(s, name, value)
    for name in ("seeds", "variants", "detect_seeds"):
        value = getattr(a, name, None)
        if value:
            setattr(s, name, tuple(value))
    s.eval_mid = bool(getattr(a, "eval_mid", False))
    from trl_mdi.counterfactual import counterfactual_kinds

    if s.counterfactual not in (*counterfactual_kinds(), "auto"):
        raise SystemExit(f"--counterfactual must be auto or one of {counterfactual_kinds()}, got {s.counterfactual!r}")
    if s.gain_form not in (*GAIN_FORMS, "auto"):
        raise SystemExit(f"--gain_form must be auto or one of {GAIN_FORMS}, got {s.gain_form!r}")
    unknown = [v for v in s.variants if v not in ALL_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {ALL_VARIANTS}")
    if BASELINE not in s.variants:
        raise SystemExit(f"--variants must include the baseline {BASELINE!r}: every verdict is paired with it")
    return s


def run_key(s: ExperimentSettings, recipe, variant, seed: int, threads: int) -> str:
    return fingerprint({k: v for k, v in dataclasses.asdict(s).items() if k not in RUN_INDEPENDENT},
                       dataclasses.asdict(recipe), dataclasses.asdict(variant), seed, threads)


def warmup_key(s: ExperimentSettings, recipe, threads: int) -> str:
    return fingerprint(dataclasses.asdict(recipe), {k: getattr(s, k) for k in (
        "n_test", "test_conflict_rate", "eval_samples", "detect_prompts", "detect_samples", "counterfactual",
        "max_completion_length")}, threads)


def choice_key(s: ExperimentSettings, recipe, threads: int) -> str:
    return fingerprint(dataclasses.asdict(recipe), {k: getattr(s, k) for k in (
        "n_dev", "dev_samples", "pool_conflict_rate", "counterfactual", "dev_kinds", "gain_form",
        "max_completion_length", "n_boot")}, threads)


def cmd_experiment(a: argparse.Namespace, run_jobs: bool = True) -> int:
    """The shortcut experiment and the detection table (see :data:`SECTION` and the module docstring): the cached
    warm-up, the gain form chosen on the dev split, the warm-up's test figures, every (variant, seed) run (2 worker
    processes by default), then the RESULTS.md section from every finished record. ``run_jobs=False`` (the
    ``report`` command): only the section, from what is finished."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import transformers
    from _results import replace_section

    torch.set_num_threads(a.threads)
    transformers.logging.set_verbosity_error()
    started = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - started:7.1f} s] {msg}", flush=True)

    s = experiment_settings(a)
    recipe = look_or_guess_recipe(epochs=a.epochs, n_train=a.n_train, image_size=a.image_size)
    work = Path(a.work_dir) if a.work_dir else DEFAULT_WORK
    (work / "runs").mkdir(parents=True, exist_ok=True)
    code = code_version()
    log(f"work dir {work}; code {code_label(code)}")
    model_dir = warmup_dir(recipe, work)

    def load(path: Path, key: str) -> dict | None:
        if not path.exists():
            return None
        rec = json.loads(path.read_text())
        if rec.get("fingerprint") != key:
            return None
        if a.rerun_other_code and code_label(rec.get("code")) != code_label(code):
            return None
        return rec

    # 1. The counterfactual kind and the reward's form, on the development split (the runs depend on them).
    path = work / f"choice-{choice_key(s, recipe, a.threads)}.json"
    choice = load(path, path.stem[len("choice-"):])
    if choice is None and run_jobs:
        model, processor, _ = shared_warmup(recipe, work, log)
        log("== the counterfactual kind and the reward form, on the development split")
        choice = choose_reward(model, processor, dev_rows(recipe, s), s, log)
        choice.update(fingerprint=path.stem[len("choice-"):], code=code)
        write_json(path, choice)
        del model
    elif choice is not None:
        log(f"counterfactual {choice['kind']}, reward {choice['form']} (chosen earlier, {path})")
    if choice is None:
        print("the development-split choice was not made yet: nothing to report")
        return 1
    if run_jobs and not (model_dir / "warmup.json").exists():
        shared_warmup(recipe, work, log)
    s.counterfactual = choice["kind"]  # every run, the warm-up's figures and their keys use the chosen kind
    tprl = choice["tprl_perturbation"]
    variants = experiment_variants(choice["form"], tprl if tprl != choice["kind"] else None)

    # 2. Jobs: the warm-up's test figures, then every variant of a seed before the next seed.
    common = dict(settings=s, recipe=recipe, work=work, threads=a.threads, started=started, model_dir=model_dir,
                  code=code)
    jobs, done = [], {}

    def plan(label: str, path: Path, key: str, **job) -> None:
        rec = load(path, key)
        if rec is not None and job.get("seed") in s.detect_seeds and not rec.get("detection"):
            rec = None  # finished before its seed was among --detect_seeds: rerun it with the measurement
        if rec is not None:
            done[label] = (rec, None)
        else:
            jobs.append({**common, **job, "label": label, "path": path, "key": key})

    wkey = warmup_key(s, recipe, a.threads)
    plan("warmup", work / f"warmup-test-{wkey}.json", wkey, what="warmup")
    order = []
    for seed in s.seeds:
        for name in s.variants:
            label = f"{name}-s{seed}"
            order.append(label)
            plan(label, work / "runs" / f"{label}.json", run_key(s, recipe, variants[name], seed, a.threads),
                 what="run", name=name, variant=variants[name], seed=seed)
    log(f"{len(done)} job(s) finished earlier, {len(jobs)} to run" + ("" if run_jobs else " (not run: report only)"))
    if run_jobs and jobs:
        if a.workers > 1 and len(jobs) > 1:
            ctx = multiprocessing.get_context("spawn")  # a fresh interpreter per worker: no forked torch state
            with ProcessPoolExecutor(min(a.workers, len(jobs)), mp_context=ctx) as ex:
                done |= dict(zip([j["label"] for j in jobs], ex.map(execute, jobs)))
        else:
            done |= {j["label"]: execute(j) for j in jobs}
    runs = [done[k][0] for k in order if k in done and done[k][0] is not None]
    failed = [(k, done[k][1]) for k in ["warmup", *order] if k in done and done[k][0] is None]
    missing = [k for k in ["warmup", *order] if k not in done]
    warm = done.get("warmup", (None, None))[0]
    minutes = (time.time() - started) / 60 if run_jobs and jobs else None
    body = report(choice=choice, warm=warm, runs=runs, s=s, recipe=recipe, argv=a.argv, missing=missing,
                  variants=variants,
                  failed=failed, code=code, minutes=minutes, workers=a.workers, threads=a.threads,
                  load=os.getloadavg()[0])
    print("\n" + body)
    if a.no_write:
        return 1 if failed else 0
    if len(s.seeds) < 5:
        print(f"not writing {a.results}: {len(s.seeds)} seed(s); the section needs 5 or more (--no-write to silence)")
        return 1
    replace_section(SECTION, body, Path(a.results))
    print(f"wrote the section '{SECTION}' of {a.results}")
    return 1 if failed else 0


def cmd_report(a: argparse.Namespace) -> int:
    """The RESULTS.md section from the finished records of the same settings (nothing is run)."""
    return cmd_experiment(a, run_jobs=False)


COMMANDS = {"warmup-check": cmd_warmup_check, "experiment": cmd_experiment, "report": cmd_report}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/look_or_guess.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=list(COMMANDS))
    p.add_argument("--n_train", type=int, default=400, help="warm-up rows (default 400)")
    p.add_argument("--epochs", type=int, default=8, help="warm-up SFT epochs, each with its own styles (default 8)")
    p.add_argument("--image_size", type=int, default=56)
    p.add_argument("--n_eval", type=int, default=200, help="held-out prompts, half conflict rows (default 200)")
    p.add_argument("--samples", type=int, default=4, help="completions sampled per prompt (default 4)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--counterfactual", help="the image the per-token gain compares with (warmup-check: default black; "
                   "experiment: default auto, chosen on the development split)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work_dir", help=f"the cached warm-up (default {DEFAULT_WORK})")
    p.add_argument("--json", help="also write the result as JSON here")
    e = p.add_argument_group("experiment / report (the shortcut experiment and the detection table)")
    e.add_argument("--steps", type=int, help="GRPO steps per run (default 50)")
    e.add_argument("--seeds", type=int, nargs="+", help="GRPO seeds, every variant (default 0 1 2 3 4; the section "
                   "is written only with 5 or more)")
    e.add_argument("--variants", nargs="+", choices=ALL_VARIANTS, help=f"default: {' '.join(VARIANT_NAMES)}; "
                   f"{OTHER_FORM}: the reliance reward in the form the development split did not choose")
    e.add_argument("--gain_form", help="the reliance reward: visual_gain or visual_gain_sum (default auto: chosen on "
                   "the development split)")
    e.add_argument("--n_pool", type=int, help="GRPO training rows, no conflict row (default 400)")
    e.add_argument("--n_test", type=int, help="test prompts, half conflict rows (default 200)")
    e.add_argument("--eval_samples", type=int, help="completions sampled per test prompt at T=1 (default 4)")
    e.add_argument("--eval_mid", action="store_true", help="also evaluate at the middle step")
    e.add_argument("--n_dev", type=int, help="development prompts of the reward-form choice (default 100)")
    e.add_argument("--dev_samples", type=int, help="rollouts per development prompt (default 8)")
    e.add_argument("--detect_prompts", type=int, help="test prompts of the detection table (default 200)")
    e.add_argument("--detect_samples", type=int, help="rollouts per detection prompt (default 4)")
    e.add_argument("--detect_seeds", type=int, nargs="+", help="trained models measured for the detection table "
                   "(default 0)")
    e.add_argument("--n_boot", type=int, help="bootstrap resamples (default 1000)")
    e.add_argument("--learning_rate", type=float, help="GRPO learning rate (default 3e-4)")
    e.add_argument("--workers", type=int, default=2, help="jobs at a time, each in its own process (default 2)")
    e.add_argument("--rerun_other_code", action="store_true", help="rerun finished records made by another code "
                   "version (default: reuse them; the section lists every code version used)")
    e.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    e.add_argument("--no-write", dest="no_write", action="store_true", help="print the section only")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    COMMANDS[a.command](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
