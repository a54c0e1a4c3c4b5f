"""The one check, before any weight is loaded, that every reward's named inputs will exist.

A reward names what it reads as parameters without defaults (``required_reward_inputs``). Each must be either a
column of every dataset split it runs on, or a per-rollout signal the trainer provides (``trl_mdi.signals``:
``mdi``, ``mdi_<segment>``, ``aei_text``, ...; only with attention metrics on, and only for the model's real
segments). The trainer and the entry point both call :func:`check_reward_inputs`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..signals import provided_fields, reads_attention, reward_field_pattern, trainer_field
from .registry import REQUIRED_COLUMNS, required_reward_inputs, reward_name

# How a label column is produced, for the error that names a missing one.
LABEL_SOURCES = {"label_idx": "mc_idx (A-OKVQA: trl_mdi.aokvqa.prepare_aokvqa writes it)",
                 "solution": "accuracy (math VQA)"}


def check_reward_inputs(reward_funcs: Sequence, splits: Mapping[str, Sequence[str] | None], *, attention: bool,
                        segments: Sequence[str] = (), reliance: bool = False) -> None:
    """Raise ValueError naming the split, the reward and the fix when a reward's input cannot exist.

    ``splits`` maps a split name to its column names (None: unknown, e.g. an iterable dataset, not checked);
    ``attention``: whether the trainer computes attention signals; ``segments``: the model's segment names;
    ``reliance``: whether it can compute the counterfactual reliance signals (a vision-language model: a reward
    reading one turns them on; ``answer_image_attention`` needs attention too).
    Reward models (``nn.Module``) and Hub ids are skipped: TRL feeds them text, not columns.

    >>> from trl_mdi.rewards import mc_idx, mdi_balance
    >>> check_reward_inputs([mc_idx, mdi_balance], {"train": ["prompt", "image", "label_idx"]},
    ...                     attention=True, segments=["early", "late"])
    >>> check_reward_inputs([mc_idx], {"train": ["prompt", "image"]}, attention=True)
    Traceback (most recent call last):
    ...
    ValueError: split 'train': reward 'mc_idx' needs column(s) ['label_idx'], which the dataset lacks (its columns: ['image', 'prompt']). Label columns: 'label_idx' for mc_idx (A-OKVQA: trl_mdi.aokvqa.prepare_aokvqa writes it); 'solution' for accuracy (math VQA). Add the column or drop the reward.
    """
    funcs = [f for f in reward_funcs if callable(f) and not isinstance(f, torch.nn.Module)]
    provided = provided_fields(segments, attention=attention, counterfactual=reliance)  # the signal table's reward fields
    if not attention:
        for f in funcs:
            needed = [n for n in required_reward_inputs(f) if reads_attention(n)]
            if needed:
                raise ValueError(f"reward {reward_name(f)!r} reads {needed}, which the trainer computes only with "
                                 "compute_attention_metrics=True (attention metrics are off)")
    for split, columns in splits.items():
        if columns is None:
            continue
        available = set(columns)
        problems, missing_signals = [], False
        for f in funcs:
            missing = [c for c in required_reward_inputs(f) if c not in available and c not in provided]
            if missing:
                problems.append(f"reward {reward_name(f)!r} needs column(s) {missing}")
                missing_signals |= any(trainer_field(c) for c in missing)
        if problems:
            labels = "; ".join(f"'{c}' for {r}" for c, r in LABEL_SOURCES.items())
            signals = (f" Per-rollout fields the trainer provides for this model: {sorted(provided) or 'none'}."
                       if missing_signals else "")
            raise ValueError(f"split {split!r}: {'; '.join(problems)}, which the dataset lacks (its columns: "
                             f"{sorted(available)}).{signals} Label columns: {labels}. Add the column or drop the "
                             "reward.")
        clash = sorted(c for c in available if c in provided or (attention and reward_field_pattern(c)))
        if clash:
            raise ValueError(f"split {split!r} has columns {clash} that the trainer fills with attention signals: "
                             "rename them")


def dataset_columns(train_dataset, eval_dataset) -> dict[str, list[str] | None]:
    """``{split: column names}`` of a trainer's datasets (eval may be a dict of datasets; None: columns unknown)."""
    evals = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval_dataset", eval_dataset)]
    out = {}
    for split, ds in [("train_dataset", train_dataset), *evals]:
        cols = getattr(ds, "column_names", None)
        out[split] = cols if isinstance(cols, list) else None
    return out


__all__ = ["LABEL_SOURCES", "REQUIRED_COLUMNS", "check_reward_inputs", "dataset_columns"]
