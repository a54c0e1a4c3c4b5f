"""Live diagnostics of a run: two Markdown logs (``tail -f training_logs/*.md``), attention maps, per-layer pictures
and a console summary, fed one :class:`~trl_mdi.diagnostics.batch_log.BatchLog` per generation batch.

Library side (no trainer, TRL or transformers import; usable on their own):

* :mod:`.markdown`: safe formatting (clean, fence, escape_inline, md_table, sparkline, trend_line).
* :mod:`.log_file`: append-only step-block files (header once, fsync per step, resume, warn-once on failure).
* :mod:`.writers`: RolloutLogWriter and AttentionLogWriter (the rollout log reads its reliance columns, words and
  summary rows from the signal table, ``trl_mdi.signals``, imported when the first step is written).
* :mod:`.maps`: attention maps: each image's token grid, a rollout's masses cut per image, the PNG (PIL only).
* :mod:`.plots`: per-layer pictures from plain arrays (MDI by layer, stacked masses), also drawn by
  ``python -m trl_mdi.profile``.
* :mod:`.console`: a per-step console summary (rich, or plain text without colour).

Trainer side (loaded on first use, PEP 562: they import TRL's rewards and transformers' callbacks):

* :mod:`.answers`: the task's columns from the rows, the answer format and the reward names (gold, parsed, format;
  which rewards say "right").
* :mod:`.batch_log`: ``BatchLog`` and the plain per-rollout records built from it; the perception strips.
* :mod:`.live`: ``LiveDiagnostics`` (the callback owning the logs), ``write_batch`` (the one call per batch) and
  ``ConsoleSummaryCallback``.

The trainer, per generation batch, on every process::

    write_batch(live_logs, BatchLog(step=..., rows=inputs, rewards=gathered_rewards, ...),
                processing_class=processor, answer_format=think_format)

The writers alone, with rows already gathered::

    rollout_path, attention_path = default_log_paths("training_logs", run_name)
    rollouts = RolloutLogWriter(rollout_path, run_name=run_name, config=summary).open(resume_from_step=resumed)
    rollouts.write_step(step, epoch, rollout_rows, summary_metrics)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .console import format_step_summary, print_step_summary, use_color
from .log_file import LogPathError, StepLogFile, default_log_paths, sanitize_run_name
from .maps import (
    attention_map_records,
    image_token_grids,
    render_attention_map,
    render_image_maps,
    render_segment_maps,
    split_per_image,
    token_grid_hw,
)
from .markdown import clean, escape_inline, fence, format_value, md_table, sparkline, trend_line
from .plots import plot_mass_by_layer, plot_mdi_by_layer
from .writers import AttentionLogWriter, RolloutLogWriter, prompt_text

# trainer-side name -> its module (loaded on first use)
_LAZY = {"BatchLog": "batch_log", "rollout_records": "batch_log", "perception_strips": "batch_log",
         "image_evidence": "batch_log",
         "LiveDiagnostics": "live", "write_batch": "live", "ConsoleSummaryCallback": "live",
         "accuracy_rewards": "answers", "answer_fields": "answers", "console_reward_keys": "answers",
         "gold_answer": "answers"}

__all__ = [
    "AttentionLogWriter", "BatchLog", "ConsoleSummaryCallback", "LiveDiagnostics", "LogPathError", "RolloutLogWriter",
    "StepLogFile", "accuracy_rewards", "answer_fields", "attention_map_records", "clean", "console_reward_keys",
    "default_log_paths", "escape_inline", "fence", "format_step_summary", "format_value", "gold_answer",
    "image_evidence", "image_token_grids", "md_table", "perception_strips", "plot_mass_by_layer", "plot_mdi_by_layer",
    "print_step_summary", "prompt_text", "render_attention_map", "render_image_maps", "render_segment_maps",
    "rollout_records", "sanitize_run_name", "sparkline", "split_per_image", "token_grid_hw", "trend_line", "use_color",
    "write_batch",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:  # for type checkers and IDEs; at run time these load lazily
    from .answers import accuracy_rewards, answer_fields, console_reward_keys, gold_answer
    from .batch_log import BatchLog, image_evidence, perception_strips, rollout_records
    from .live import ConsoleSummaryCallback, LiveDiagnostics, write_batch
