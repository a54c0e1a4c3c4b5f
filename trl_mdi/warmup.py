"""Supervised warm start of a tiny VLM on the synthetic questions, and greedy held-out accuracy.

GRPO only learns from groups whose rollouts get different rewards. A random tiny VLM first learns to emit a
letter, then every rollout of a group names the same letter, the group's mc_idx reward has zero spread and it
stops teaching anything: pure GRPO from random weights stalls near chance (benchmarks/learning_curve.py shows it).
What a real user does instead is a short supervised warm-up on a few hundred labelled examples with TRL's
SFTTrainer, stopped well before it solves the task, then GRPO. This module is that warm-up:

1. ``synthetic_dataset`` draws synthetic A-OKVQA rows (``trl_mdi.synthetic``) and converts them with the prep
   script's own row conversion (``trl_mdi.aokvqa.convert_row``), so prompts read exactly as in training data
   prepared by ``data_prep/prepare_aokvqa_for_trl.py``; ``to_conversational`` adds the system prompt.
2. ``target_completion`` is the supervised answer: ``"<think> image</think>\\nAnswer: A"``, a constant reasoning
   text that does not reveal the answer, then the letter. ``think_format_reward`` pays 1 for it and
   ``mc_idx_reward`` parses the letter; with the Qwen templates it is 7 tokens plus <|im_end|>, so GRPO's
   ``max_completion_length=8`` holds it.
3. ``warm_start`` builds the tiny model (``trl_mdi.tiny``, seeded) and trains it with ``trl.SFTTrainer``
   (prompt-completion data, loss on the completion only). Everything is seeded, so a given recipe and thread
   count give the same weights.
4. ``evaluate_accuracy`` is greedy generation on held-out rows with the image placeholder token suppressed
   (GRPOTrainer suppresses it when it samples, so the policy never learns to avoid it), scored with the same
   parser as the reward (``score_completions``).

CLI (the warm-started model for ``make demo``, and the demo's before/after score of the trained model):

    python -m trl_mdi.warmup --out demo_run/tiny-warm [--arch qwen2_vl] [--n_train 200] [--epochs 6] ...
    python -m trl_mdi.warmup --evaluate demo_run/grpo [--n_eval 200]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .aokvqa import LETTERS, convert_row
from .data import DEFAULT_SYSTEM_PROMPT, to_conversational
from .evaluation import EvalResult, evaluate_accuracy, score_completions
from .synthetic import KINDS, OPTION_ORDERS, generate_synthetic_rows
from .tiny import TINY_ARCHS, build_tiny_vlm, save_model_atomically

__all__ = [
    "DEFAULT_MODEL_SIZE",
    "EvalResult",
    "WarmupRecipe",
    "evaluate_accuracy",
    "main",
    "score_completions",
    "sft_dataset",
    "synthetic_dataset",
    "target_completion",
    "warm_start",
]

DEFAULT_MODEL_SIZE: dict[str, int] = dict(
    num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=384,
    vision_depth=2, vision_hidden_size=64, vision_num_heads=2, vision_intermediate_size=256,
)
"""About 1.2M parameters (Qwen2-VL): the size that learned the colour questions on 2 CPU cores in trials here."""

DEFAULT_THINK = "image"
"""The warm-up's reasoning text: a constant that does not reveal the answer, so the letter is the model's own
reading of the image. With ``"{answer}"`` (the colour as reasoning) SFT alone solves the colour questions in
about two epochs, and there is nothing left for GRPO to show."""


@dataclasses.dataclass
class WarmupRecipe:
    """Everything that decides the warm-started weights (saved as ``warmup.json`` next to them)."""

    arch: str = "qwen2_vl"
    model_seed: int = 0
    model_size: dict[str, int] = dataclasses.field(default_factory=lambda: dict(DEFAULT_MODEL_SIZE))
    n_train: int = 200
    data_seed: int = 0
    think: str = DEFAULT_THINK
    kinds: tuple[str, ...] = ("color",)
    option_order: str = "fixed"
    image_size: int = 56
    blank_images: bool = False
    conflict_rate: float = 0.2  # language-prior kinds only: share of rows whose image contradicts the prior
    epochs: float = 6.0
    learning_rate: float = 1e-3
    lr_scheduler_type: str = "linear"
    batch_size: int = 8
    train_seed: int = 0

    def __post_init__(self):
        if self.arch not in TINY_ARCHS:
            raise ValueError(f"arch must be one of {TINY_ARCHS}, got {self.arch!r}")
        if self.option_order not in OPTION_ORDERS:
            raise ValueError(f"option_order must be one of {OPTION_ORDERS}, got {self.option_order!r}")
        if not self.kinds or any(k not in KINDS for k in self.kinds):
            raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {self.kinds}")
        if not 0.0 <= self.conflict_rate <= 1.0:
            raise ValueError(f"conflict_rate must be in [0, 1], got {self.conflict_rate}")
        if self.n_train < 1 or self.epochs <= 0 or self.learning_rate <= 0 or self.batch_size < 1:
            raise ValueError("n_train and batch_size must be >= 1, epochs and learning_rate > 0")
        self.kinds = tuple(self.kinds)


# ------------------------------------------------------------------------------------------------------- data


def synthetic_dataset(n: int, *, split: str = "train", seed: int = 0, kinds: Sequence[str] = ("color",),
                      option_order: str = "fixed", image_size: int = 56, blank_images: bool = False,
                      system_prompt: str | None = DEFAULT_SYSTEM_PROMPT, conflict_rate: float = 0.2):
    """``n`` synthetic questions as GRPO training rows: conversational ``prompt``, ``image``, ``label_idx``,
    ``choices``, ``question_id``, plus ``answer`` (the correct choice's text), ``conflict`` (True where the image
    contradicts the language prior of a ``prior_color`` question; ``conflict_rate`` of those rows) and
    ``prior_idx`` (the index of the choice the wording suggests, -1 for kinds without a prior).

    Rows are converted with the prep script's ``convert_row``, so the prompt text is exactly what
    ``data_prep/prepare_aokvqa_for_trl.py`` writes. Each (split, seed) is its own random stream, so "validation"
    rows are drawn independently of "train" rows.
    """
    from datasets import Dataset, Image

    rows = []
    for raw in generate_synthetic_rows(n, split=split, seed=seed, kinds=tuple(kinds), option_order=option_order,
                                       image_size=image_size, blank_images=blank_images, conflict_rate=conflict_rate):
        row, why = convert_row(raw)
        if row is None:  # cannot happen for synthetic rows; fail loudly rather than return fewer
            raise RuntimeError(f"synthetic row {raw['question_id']} was rejected by convert_row: {why}")
        row["answer"] = row["choices"][row["label_idx"]]
        # convert_row keeps the A-OKVQA columns only; the prior's bookkeeping is carried over here.
        row["conflict"] = bool(raw["conflict"])
        row["prior_idx"] = row["choices"].index(raw["prior_answer"]) if raw["prior_answer"] is not None else -1
        rows.append({**row, **to_conversational(row, system_prompt)})
    return Dataset.from_list(rows).cast_column("image", Image())


def target_completion(answer: str, label_idx: int, think: str = DEFAULT_THINK) -> str:
    """The supervised completion: a think block, then the letter. ``think`` may name the answer as ``{answer}``.

    >>> target_completion("red", 0)
    '<think> image</think>\\nAnswer: A'
    >>> target_completion("red", 2, think="{answer}")
    '<think> red</think>\\nAnswer: C'
    """
    return f"<think> {think.format(answer=answer)}</think>\nAnswer: {LETTERS[label_idx]}"


def sft_dataset(ds, think: str = DEFAULT_THINK):
    """Prompt-completion rows for ``trl.SFTTrainer``: the GRPO prompt plus the assistant's ``target_completion``."""
    def add(row):
        text = target_completion(row["answer"], row["label_idx"], think)
        return {"completion": [{"role": "assistant", "content": text}]}

    keep = {"prompt", "image", "completion"}
    ds = ds.map(add)
    return ds.remove_columns([c for c in ds.column_names if c not in keep])


# ------------------------------------------------------------------------------------------------ evaluation


def warm_start(recipe: WarmupRecipe | None = None, out_dir: str | Path | None = None, *, work_dir: str | None = None,
               overwrite: bool = False, log=print):
    """Build the tiny VLM of ``recipe`` and SFT-warm-start it on ``recipe.n_train`` synthetic examples.

    Returns ``(model, processor, info)``; ``info`` holds the recipe, SFT steps, final loss and seconds. With
    ``out_dir`` the model, the processor and ``warmup.json`` (info) are saved there (written to a temporary
    sibling first, then renamed into place). ``work_dir`` receives SFTTrainer's output (default: a temporary
    folder, removed afterwards).
    """
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    recipe = recipe or WarmupRecipe()
    if out_dir is not None:
        out_dir = Path(out_dir).expanduser().resolve()
        if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
            raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True (CLI: --overwrite)")
    start = time.perf_counter()
    model, processor = build_tiny_vlm(recipe.arch, seed=recipe.model_seed, **recipe.model_size)
    train = sft_dataset(synthetic_dataset(recipe.n_train, split="train", seed=recipe.data_seed, kinds=recipe.kinds,
                                          option_order=recipe.option_order, image_size=recipe.image_size,
                                          blank_images=recipe.blank_images, conflict_rate=recipe.conflict_rate),
                        recipe.think)
    tmp = tempfile.mkdtemp(prefix="trl_mdi_warmup_") if work_dir is None else work_dir
    try:
        args = SFTConfig(
            output_dir=tmp, use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=10,
            num_train_epochs=recipe.epochs, learning_rate=recipe.learning_rate,
            lr_scheduler_type=recipe.lr_scheduler_type, per_device_train_batch_size=recipe.batch_size,
            seed=recipe.train_seed, data_seed=recipe.train_seed, max_length=None, gradient_checkpointing=False,
            disable_tqdm=True, dataloader_num_workers=0,
        )
        trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=processor)
        trainer.remove_callback(PrinterCallback)  # one summary line below instead of a dict every 10 steps
        result = trainer.train()
    finally:
        if work_dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    model = trainer.model
    model.eval()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    info = {
        "recipe": dataclasses.asdict(recipe),
        "num_params": model.num_parameters(),
        "sft_steps": trainer.state.global_step,
        "train_loss": result.training_loss,
        "last_logged_loss": losses[-1] if losses else None,
        "seconds": round(time.perf_counter() - start, 2),
        "torch_threads": torch.get_num_threads(),
    }
    log(f"warm-up: {info['sft_steps']} SFT steps on {recipe.n_train} examples in {info['seconds']:.1f} s, "
        f"mean loss {info['train_loss']:.3f}")
    if out_dir is not None:
        _save(model, processor, info, out_dir)
    return model, processor, info


def _save(model, processor, info: dict, out_dir: Path) -> None:
    save_model_atomically(model, processor, out_dir, {"warmup.json": info})


# ------------------------------------------------------------------------------------------------------- CLI


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    d = WarmupRecipe()
    p = argparse.ArgumentParser(prog="python -m trl_mdi.warmup",
                                description="Build a tiny VLM offline and SFT-warm-start it on synthetic questions.")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", type=Path, help="output folder (model + processor + warmup.json)")
    mode.add_argument("--evaluate", type=Path, metavar="MODEL_DIR",
                      help="train nothing: score a saved model (e.g. a GRPO output_dir) on --n_eval held-out "
                      "questions drawn as the warm-up draws them (same --data_seed, --kinds, --option_order, "
                      "--image_size), greedy, so its accuracy compares with the warm-up's")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--arch", choices=TINY_ARCHS, default=d.arch)
    p.add_argument("--model_seed", type=int, default=d.model_seed)
    p.add_argument("--n_train", type=int, default=d.n_train, help="labelled warm-up examples")
    p.add_argument("--data_seed", type=int, default=d.data_seed)
    p.add_argument("--think", default=d.think, help="reasoning text of the target completion ('{answer}': the answer)")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(d.kinds))
    p.add_argument("--option_order", choices=OPTION_ORDERS, default=d.option_order)
    p.add_argument("--image_size", type=int, default=d.image_size)
    p.add_argument("--blank_images", action="store_true", help="warm up on blank images (the control)")
    p.add_argument("--conflict_rate", type=float, default=d.conflict_rate,
                   help="prior_color rows whose image contradicts the object's usual colour (share)")
    p.add_argument("--epochs", type=float, default=d.epochs)
    p.add_argument("--learning_rate", type=float, default=d.learning_rate)
    p.add_argument("--lr_scheduler_type", default=d.lr_scheduler_type)
    p.add_argument("--batch_size", type=int, default=d.batch_size)
    p.add_argument("--train_seed", type=int, default=d.train_seed)
    p.add_argument("--n_eval", type=int, default=200, help="held-out validation questions to score (0: skip)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: a ~1M-parameter model gains little from a second thread, and "
                   "on a machine shared with other jobs 2 threads ran the warm-up ~10x slower in trials here)")
    return p.parse_args(argv)


def _held_out(recipe: WarmupRecipe, n: int):
    """The ``n`` held-out validation questions of ``recipe``'s data (the same rows for the warm-up and later)."""
    return synthetic_dataset(n, split="validation", seed=recipe.data_seed, kinds=recipe.kinds,
                             option_order=recipe.option_order, image_size=recipe.image_size,
                             blank_images=recipe.blank_images, conflict_rate=recipe.conflict_rate)


def _evaluate_saved(model_dir: Path, recipe: WarmupRecipe, n_eval: int) -> int:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(model_dir)
    result = evaluate_accuracy(model, processor, _held_out(recipe, n_eval))
    print(f"held-out greedy ({n_eval} validation questions) of {model_dir}: {result.summary()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    recipe_fields = {f.name for f in dataclasses.fields(WarmupRecipe)}
    try:
        recipe = WarmupRecipe(**{k: v for k, v in vars(args).items() if k in recipe_fields})
        if args.evaluate is not None:
            if not (args.evaluate / "config.json").is_file():
                raise ValueError(f"--evaluate {args.evaluate}: no config.json there; give a folder written by "
                                 "save_pretrained (a warm-up --out, a GRPO output_dir or one of its checkpoints)")
            if args.n_eval < 1:
                raise ValueError("--evaluate needs --n_eval >= 1")
        out = args.out.expanduser().resolve() if args.out is not None else None
        if out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
            raise FileExistsError(f"{out} exists and is not empty; pass --overwrite to replace it")
    except (ValueError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    if args.evaluate is not None:
        return _evaluate_saved(args.evaluate, recipe, args.n_eval)
    model, processor, info = warm_start(recipe, overwrite=args.overwrite)
    if args.n_eval:
        result = evaluate_accuracy(model, processor, _held_out(recipe, args.n_eval))
        info["held_out"] = {"n": args.n_eval, "accuracy": result.accuracy, "format_rate": result.format_rate,
                            "letters": result.letters}
        print(f"held-out greedy ({args.n_eval} validation questions): {result.summary()}")
    _save(model, processor, info, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
