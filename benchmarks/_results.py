"""What every benchmark script shares: offline settings and replacing its own section of RESULTS.md.

The scripts run as ``python benchmarks/<name>.py``, so this folder is on ``sys.path`` and ``import _results``
works without installing anything.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def set_offline_env() -> None:
    """Nothing from the Hugging Face Hub at run time (a value already in the environment wins). Call before
    importing transformers / datasets: they read these at import."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


def replace_section(title: str, body: str, path: Path = RESULTS) -> None:
    """Replace the section headed by the line ``title`` (e.g. ``"## Learning check"``) with ``body``, which must
    start with that heading; append it when the file has no such section. Other sections are left byte for byte.
    """
    if not body.startswith(title + "\n"):
        raise ValueError(f"the section body must start with its heading line {title!r}")
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    new = body.rstrip("\n") + "\n"
    if pattern.search(text):
        text = pattern.sub(lambda _: new + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + new
    path.write_text(text.rstrip("\n") + "\n", encoding="utf-8")


def result_args(argv: list[str], output_only_flags: tuple[str, ...]) -> list[str]:
    """The arguments that decide the results (output-path flags and their values dropped), for 'Reproduce' lines."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in output_only_flags:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in output_only_flags)):
            out.append(arg)
    return out
