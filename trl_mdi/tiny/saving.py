"""Writing a built model to disk: the output-folder checks and the atomic save shared by every tiny builder."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any


def check_out_dir(out_dir: str | Path, overwrite: bool) -> Path:
    """Resolve ``out_dir`` and refuse a non-empty one unless ``overwrite`` (or a file in its place).

    Raises:
        FileExistsError: naming the fix (another folder, or overwrite=True / --overwrite).
    """
    out_dir = Path(out_dir).expanduser().resolve()
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory; choose another --out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} is not empty; pass overwrite=True (CLI: --overwrite) to replace it")
    return out_dir


def provenance(model, size: Any, **what: Any) -> dict[str, Any]:
    """The JSON saved next to a tiny model: ``what`` (e.g. arch or task, then seed), parameter count, sizes."""
    return {**what, "num_params": model.num_parameters(), "size": dataclasses.asdict(size)}


def save_model_atomically(model, processor, out_dir: Path, extra_json: dict[str, Any] | None = None) -> None:
    """``save_pretrained`` model and processor (plus ``{file name: JSON-able}`` files) into ``out_dir`` atomically.

    Everything is written to a temporary sibling first and renamed into place; an existing ``out_dir`` is moved
    aside before it is deleted. So a crash never leaves a half-written model where a loader would find it, and
    ``out_dir`` is never half-deleted. The caller decides whether replacing ``out_dir`` is allowed. ``processor``
    may be a tokenizer (text-only models).
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; other users' jobs may load the model
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        for name, data in (extra_json or {}).items():
            (tmp / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(old / out_dir.name)
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
