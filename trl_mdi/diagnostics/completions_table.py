"""The per-rollout signals as columns of TRL's completions table (``log_completions=True``).

TRL 1.16 keeps the rows of its completions table in ``trainer._logs`` (deques sized to the generation batch: prompt,
completion, rewards, advantages, images, and the ``extra`` columns that rewards add through ``log_extra``), gathered
from every process in process order, and writes them at each ``log()``: the parquet file
``output_dir/completions/completions_{step:05d}.parquet`` and a table to wandb and trackio. Whatever is in
``_logs["extra"]`` at that moment becomes a column everywhere, with no tracker code of ours.

Our values cannot go through TRL's ``log_extra`` queue: TRL flushes it inside ``_generate_and_score_completions``,
and a batch measured in the training forward has its values only after the last training slice. So
:class:`CompletionColumns` keeps each generation batch's columns, batch by batch in the order TRL appended the
batches' rows (a batch still being measured holds none yet), and :meth:`CompletionColumns.columns` lays them out
under TRL's rows just before TRL's ``log()`` reads them: the trailing rows of TRL's deques are the trailing rows
of ours. Column names are the signal table's field names (``trl_mdi.signals``), plus ``image_evidence``; a field
that shares its name with one of the run's rewards (the ``mdi_balance`` reward reads the ``mdi_balance`` field) is
written under its metric's namespace instead (:func:`column_names`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

from ..signals import EVIDENCE_COLUMN, METRIC_PREFIX, signal_of

TEXT_COLUMNS = (EVIDENCE_COLUMN,)  # text: None where missing (numbers: NaN)


@dataclass
class TableBatch:
    """One generation batch's rows in TRL's table: how many (all processes), and our columns once measured."""

    rows: int
    columns: dict[str, list] = field(default_factory=dict)


class CompletionColumns:
    """Our columns of TRL's completions table, one :class:`TableBatch` per generation batch (train and eval alike,
    in the order TRL appended their rows), at most ``capacity`` rows (TRL's deques' length)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.batches: deque[TableBatch] = deque()

    def add(self, rows: int) -> TableBatch:
        """Register the batch whose ``rows`` TRL has just appended to its table; fill its ``columns`` (now or once
        measured) with :func:`table_columns`."""
        batch = TableBatch(rows)
        self.batches.append(batch)
        while sum(b.rows for b in self.batches) - self.batches[0].rows >= self.capacity:
            self.batches.popleft()  # TRL's table no longer holds any of its rows
        return batch

    def columns(self, n_rows: int) -> dict[str, list]:
        """Each column over the last ``n_rows`` rows (the length of TRL's table now): NaN (None for text) where a
        batch is not measured yet or lacks the column.

        >>> table = CompletionColumns(capacity=4)
        >>> table.add(2).columns.update({"mdi": [1.0, 2.0]})
        >>> _ = table.add(2)  # still being measured
        >>> table.columns(3)
        {'mdi': [2.0, nan, nan]}
        >>> table.columns(5)  # more rows than it registered: padded at the front, the last rows aligned
        {'mdi': [nan, 1.0, 2.0, nan, nan]}
        """
        names = list(dict.fromkeys(n for b in self.batches for n in b.columns))
        missing = {n: None if n in TEXT_COLUMNS else math.nan for n in names}
        out: dict[str, list] = {n: [] for n in names}
        for b in self.batches:
            for n in names:
                out[n] += b.columns.get(n) or [missing[n]] * b.rows
        # Rows TRL holds from before our first kept batch (none in a normal run) get the missing value, so a column
        # is never shorter than TRL's table (which would fail TRL's table write) and its last rows stay aligned.
        return {n: ([missing[n]] * max(0, n_rows - len(v)) + v[max(0, len(v) - n_rows):]) if n_rows else []
                for n, v in out.items()}


def column_names(names, reward_names) -> dict[str, str]:
    """Each of our column names as TRL's table shows it: the field name, or, where a reward of the run has that name,
    ``<attention|reliance>/<name>`` (the namespace of the signal's metric).

    TRL builds its table as ``{**rewards, **extra}``, its reward columns named by the rewards' names: a field named
    like a reward (``mdi_balance``, the balance in [0, 1], beside the ``mdi_balance`` reward, 2 * balance - 1) would
    overwrite the reward's column with no warning.

    >>> column_names(["mdi", "mdi_balance", "visual_gain", "image_evidence"], ["mc_idx", "mdi_balance", "visual_gain"])
    {'mdi': 'mdi', 'mdi_balance': 'attention/mdi_balance', 'visual_gain': 'reliance/visual_gain', 'image_evidence': 'image_evidence'}
    """
    taken = set(reward_names)

    def shown(name: str) -> str:
        if name not in taken:
            return name
        signal = signal_of(name)
        return f"{METRIC_PREFIX[signal.source] if signal is not None else 'trl_mdi'}/{name}"

    return {name: shown(name) for name in names}


def table_columns(gathered: dict[str, torch.Tensor], evidence: list[str | None] | None = None) -> dict[str, list]:
    """A batch's columns from its gathered per-rollout values (``trl_mdi.signals.BatchSignals.gathered``: (N,) each,
    every process's rows in process order) and, when the counterfactual ran, the image-evidence text of every row
    (same order).

    >>> table_columns({"mdi": torch.tensor([2.0, float("nan")])}, ["**red**", None])
    {'mdi': [2.0, nan], 'image_evidence': ['**red**', None]}
    """
    out = {name: [float(v) for v in values.tolist()] for name, values in gathered.items()}
    if evidence is not None:
        out[EVIDENCE_COLUMN] = list(evidence)
    return out


def table_prompts(prompts, *, text: bool) -> list | None:
    """TRL's prompts (conversations) in a form its completions table can store, or None when they can be stored as
    they are. ``text=True`` (wandb): as text (``[image]`` for each image part, as the rollout log writes them) when
    some prompt holds an image part: wandb cannot type TRL's multimodal messages (an image part ``{"type": "image"}``
    beside text parts), and TRL 1.16's ``wandb.Table`` raises a TypeError. Otherwise, when some messages' content is
    a list of parts and others' a string (TRL turns a process's prompts into parts only when that process holds an
    image), each string content becomes one text part: pyarrow cannot mix the two in the parquet file.

    >>> mixed = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]}],
    ...          [{"role": "user", "content": "Shape?"}]]
    >>> table_prompts(mixed, text=True)
    ['user: [image] Color?', 'user: Shape?']
    >>> table_prompts(mixed, text=False)[1]
    [{'role': 'user', 'content': [{'type': 'text', 'text': 'Shape?'}]}]
    >>> table_prompts(mixed[1:], text=True) is None
    True
    """
    from .writers import prompt_text

    messages = [m for p in prompts if isinstance(p, list) for m in p if isinstance(m, dict)]
    parts = [m["content"] for m in messages if isinstance(m.get("content"), list)]
    if text and any(isinstance(part, dict) and part.get("type") == "image" for c in parts for part in c):
        return [prompt_text(p) for p in prompts]
    if not text and parts and any(isinstance(m.get("content"), str) for m in messages):
        return [[{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str)
                 else m for m in p] if isinstance(p, list) else p for p in prompts]
    return None
