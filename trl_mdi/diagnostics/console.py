"""A short per-step summary on the console: a rich table on a colour terminal, plain aligned text otherwise.

Colour is used only when all hold: ``colorize`` is True, the ``NO_COLOR`` environment variable is unset or
empty (https://no-color.org), and the output stream is a TTY (so redirected logs stay free of ANSI codes).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, TextIO


def use_color(colorize: bool = True, file: TextIO | None = None) -> bool:
    """Whether to emit colour on ``file`` (default stdout)."""
    if not colorize or os.environ.get("NO_COLOR"):
        return False
    stream = file if file is not None else sys.stdout
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _fmt(value: Any) -> str:
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    if value is None:
        return "—"
    if isinstance(value, float):
        return str(value) if not math.isfinite(value) else f"{value:.4g}"
    return str(value)


def format_step_summary(step: int, metrics: dict[str, Any], *, colorize: bool = True, file: TextIO | None = None):
    """The summary of one step: a ``rich.table.Table`` when colour is on (see :func:`use_color`), else a str.

    >>> print(format_step_summary(3, {"reward": 1.23456, "attention/mdi": None}, colorize=False))
    step 3
      reward        1.235
      attention/mdi —
    """
    items = [(str(k), _fmt(v)) for k, v in metrics.items()]
    if not use_color(colorize, file):
        width = max((len(k) for k, _ in items), default=0)
        return "\n".join([f"step {step}"] + [f"  {k.ljust(width)} {v}" for k, v in items])
    from rich.table import Table

    table = Table(title=f"step {step}", title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column("metric", style="cyan")
    table.add_column("value", justify="right", style="bold")
    for k, v in items:
        table.add_row(k, v)
    return table


def print_step_summary(step: int, metrics: dict[str, Any], *, colorize: bool = True, file: TextIO | None = None) -> None:
    """Print :func:`format_step_summary` to ``file`` (default stdout)."""
    stream = file if file is not None else sys.stdout
    summary = format_step_summary(step, metrics, colorize=colorize, file=stream)
    if isinstance(summary, str):
        print(summary, file=stream, flush=True)
        return
    from rich.console import Console

    Console(file=stream, force_terminal=True).print(summary)
