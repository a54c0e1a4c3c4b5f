"""Live Markdown training diagnostics (``tail -f training_logs/*.md``): library side, no trainer imports.

* :mod:`.markdown`: safe formatting (clean, fence, escape_inline, md_table, sparkline, trend_line).
* :mod:`.base`: append-only step-block files (header once, fsync per step, resume, warn-once on failure).
* :mod:`.writers`: RolloutLogWriter and AttentionLogWriter.
* :mod:`.maps`: attention-map PNGs (PIL only).
* :mod:`.console`: a per-step console summary (rich, or plain text without colour).

The trainer calls the writers on the main process only, with rows gathered from all processes::

    rollout_path, attention_path = default_log_paths("training_logs", run_name)
    rollouts = RolloutLogWriter(rollout_path, run_name=run_name, config=summary).open(resume_from_step=resumed)
    rollouts.write_step(step, epoch, rollout_rows, summary_metrics)
"""

from .base import LogPathError, StepLogFile, default_log_paths, sanitize_run_name
from .console import format_step_summary, print_step_summary, use_color
from .maps import render_attention_map, render_image_maps, render_segment_maps, split_per_image, token_grid_hw
from .markdown import clean, escape_inline, fence, format_value, md_table, sparkline, trend_line
from .writers import AttentionLogWriter, RolloutLogWriter, prompt_text

__all__ = [
    "AttentionLogWriter",
    "LogPathError",
    "RolloutLogWriter",
    "StepLogFile",
    "clean",
    "default_log_paths",
    "escape_inline",
    "fence",
    "format_step_summary",
    "format_value",
    "md_table",
    "print_step_summary",
    "prompt_text",
    "render_attention_map",
    "render_segment_maps",
    "render_image_maps",
    "split_per_image",
    "sanitize_run_name",
    "sparkline",
    "token_grid_hw",
    "trend_line",
    "use_color",
]
