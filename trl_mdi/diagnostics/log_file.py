"""The file mechanics shared by the Markdown log writers: path checks, header, append + fsync, resume.

File layout (what ``tail -f`` shows and what resume parses)::

    # <title> · <run name>
    <!-- trl_mdi:header kind=<kind> version=1 -->
    ... run name, start time, config table ...
    <!-- trl_mdi:header-end -->

    ## Step 1 · epoch 0.01 · 2025-01-01 12:00:03 (+0:00:12)
    ... step body ...
    <!-- trl_mdi:end step=1 {"mean_mdi": 1.23} -->

    > **Resumed at step 3** ...                (one per resume)
    <!-- trl_mdi:resume step=3 -->

Every step is one ``write`` + ``flush`` + ``os.fsync``, so a reader sees whole steps. The ``end`` comment
marks a step as complete and carries the few numbers the writer needs again after a resume (the MDI trend),
so the log itself is the only state: no sidecar to keep in sync. HTML comments do not render.

Resume (``open(resume_from_step=N)``): the file is scanned (fence-aware, so text inside a logged completion
cannot pose as a marker) and truncated right after the last *complete* step block numbered <= N. Steps > N
were written after the checkpoint being resumed from; the resumed run writes them again, so they are cut,
and a step block left incomplete by a crash is cut as well (it could hold an unclosed fence). A
"Resumed at step N" note follows, naming the steps that were dropped. The header is never written twice.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

from .markdown import escape_inline, iter_lines_outside_fences, md_table

FORMAT_VERSION = 1
_HEADER_RE = re.compile(r"^<!-- trl_mdi:header kind=(\w+) version=(\d+) -->$")
_HEADER_END = "<!-- trl_mdi:header-end -->"
_STEP_RE = re.compile(r"^## Step (\d+)\b")
_END_RE = re.compile(r"^<!-- trl_mdi:end step=(\d+)(?: (\{.*\}))? -->$")


class LogPathError(OSError):
    """A log file cannot be created or written at construction; ``path`` and ``reason`` say why."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"cannot write training log {self.path}: {reason}")


def sanitize_run_name(name: str) -> str:
    """A run name usable in a file name: letters, digits, ``._-``; other runs of characters become ``_``.

    >>> sanitize_run_name("Qwen/Qwen2.5-VL 3B: lr=1e-5")
    'Qwen_Qwen2.5-VL_3B_lr_1e-5'
    """
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)).strip("._")[:120]


def default_log_paths(output_root: str | os.PathLike = "training_logs", run_name: str | None = None) -> tuple[Path, Path]:
    """``(<root>/rollout_results_<run>.md, <root>/attention_diagnostics_<run>.md)``.

    ``<run>`` is the sanitised ``run_name``, or the local start time ``YYYYmmdd-HHMMSS`` when there is none.

    >>> [p.as_posix() for p in default_log_paths("logs", "my run")]
    ['logs/rollout_results_my_run.md', 'logs/attention_diagnostics_my_run.md']
    """
    run = sanitize_run_name(run_name) if run_name else ""
    run = run or time.strftime("%Y%m%d-%H%M%S")
    root = Path(output_root)
    return root / f"rollout_results_{run}.md", root / f"attention_diagnostics_{run}.md"


def check_writable(path: Path) -> None:
    """Raise LogPathError unless ``path`` can be appended to (parent folders are created)."""
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if ancestor.exists() and not ancestor.is_dir():
        raise LogPathError(path, f"{ancestor} is a file, not a directory")
    if path.is_dir():
        raise LogPathError(path, "it is a directory")
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise LogPathError(path, e.strerror or str(e)) from e
    if not existed:
        path.unlink(missing_ok=True)  # created on open(), with its header


def _json_safe(data: dict[str, Any]) -> dict[str, Any]:
    """Floats to 6 significant digits, NaN/inf to null: the end marker stays short and valid JSON."""
    return {k: (None if not math.isfinite(v) else float(f"{v:.6g}")) if isinstance(v, float) else v
            for k, v in data.items()}


def scan_log(text: str) -> tuple[str | None, int | None, list[tuple[int, int, int | None, dict]]]:
    """Parse a log: (kind, end offset of the header, [(step, block start, block end or None, data)]).

    Offsets are character offsets into ``text``; a block's end is None when its end marker is missing.
    """
    kind, header_end, blocks = None, None, []
    for offset, line in iter_lines_outside_fences(text):
        if kind is None and (m := _HEADER_RE.match(line)):
            kind = m.group(1)
        elif line == _HEADER_END and header_end is None:
            header_end = offset + len(line) + 1
        elif m := _STEP_RE.match(line):
            blocks.append([int(m.group(1)), offset, None, {}])
        elif (m := _END_RE.match(line)) and blocks and blocks[-1][0] == int(m.group(1)) and blocks[-1][2] is None:
            blocks[-1][2] = offset + len(line) + 1
            blocks[-1][3] = json.loads(m.group(2)) if m.group(2) else {}
    return kind, header_end, [tuple(b) for b in blocks]


class StepLogFile:
    """Append-only Markdown log made of step blocks. Subclasses format the blocks; this class owns the file.

    Protocol (after torchtune's metric loggers): ``open(resume_from_step=None)``, ``write_step(...)``,
    ``close()``; also a context manager. ``write_step`` opens a fresh log if ``open`` was not called.
    A write that fails (disk full, ...) warns once; later writes are dropped so training continues.
    """

    kind = "log"
    title = "Training log"

    def __init__(self, path: str | os.PathLike, *, run_name: str | None = None, config: dict | None = None):
        self.path = Path(path)
        self.run_name = run_name or self.path.stem
        self.config = dict(config or {})
        check_writable(self.path)
        self._fh = None
        self._failed = False
        self._closed = False
        self.dropped_writes = 0
        self._t0 = time.monotonic()
        # (step, data) of every complete step block in the file, restored on resume.
        self.records: list[tuple[int, dict]] = []

    # ---------------------------------------------------------------------------------------------- file
    def open(self, resume_from_step: int | None = None) -> StepLogFile:
        """Start the log. Fresh (None): a previous non-empty file is moved to ``<name>.bak`` and a header is
        written. Resume (N): append to the same file after cutting steps > N (see the module docstring)."""
        if self._fh is not None:
            raise RuntimeError(f"{self.path} is already open")
        self._closed = False
        self._t0 = time.monotonic()
        exists = self.path.exists() and self.path.stat().st_size > 0
        note = ""
        try:
            if resume_from_step is None and exists:
                backup = self.path.with_name(self.path.name + ".bak")
                os.replace(self.path, backup)
                note = f"A previous log at this path was moved to `{escape_inline(backup.name)}`."
                exists = False
            if resume_from_step is not None and exists:
                resume_note = self._truncate_for_resume(int(resume_from_step))
            self._fh = open(self.path, "a", encoding="utf-8", errors="replace", newline="")
        except OSError as e:
            raise LogPathError(self.path, e.strerror or str(e)) from e
        if not exists:
            self._append(self._header(note))
        if resume_from_step is not None:
            if not exists:
                resume_note = "no earlier log was found at this path"
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            self._append(
                f"---\n\n> **Resumed at step {int(resume_from_step)}** · {stamp} · {resume_note}\n"
                f"<!-- trl_mdi:resume step={int(resume_from_step)} -->\n\n"
            )
        return self

    def _truncate_for_resume(self, step: int) -> str:
        text = self.path.read_bytes().decode("utf-8", "surrogateescape")
        kind, header_end, blocks = scan_log(text)
        if kind != self.kind or header_end is None:
            found = f"a {kind!r} log" if kind else "not a trl_mdi log"
            raise LogPathError(self.path, f"cannot resume a {self.kind!r} log here: the existing file is {found}")
        cut, kept, dropped = header_end, [], []
        for s, _start, end, data in blocks:
            if end is None or s > step or dropped:
                dropped.append(s)
            else:
                cut, kept = end, kept + [(s, data)]
        if text[cut : cut + 1] == "\n":
            cut += 1  # the blank line that follows every block
        os.truncate(self.path, len(text[:cut].encode("utf-8", "surrogateescape")))
        self.records = kept
        if not dropped:
            return "nothing written after that step was found"
        return f"dropped {len(dropped)} step block(s) written after it or left incomplete ({_ranges(dropped)})"

    def _header(self, note: str = "") -> str:
        lines = [
            f"# {self.title} · {escape_inline(self.run_name)}",
            f"<!-- trl_mdi:header kind={self.kind} version={FORMAT_VERSION} -->",
            "",
            f"- **Run:** {escape_inline(self.run_name)}",
            f"- **Started:** {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
            f"- **File:** `{escape_inline(self.path.name)}` (append-only; one block per step; `tail -f` friendly)",
        ]
        if note:
            lines.append(f"- **Note:** {note}")
        lines.append("")
        if self.config:
            rows = [(k, v if isinstance(v, (int, float, str, type(None))) else json.dumps(v, default=str))
                    for k, v in self.config.items()]
            lines += ["### Configuration", "", md_table(["setting", "value"], rows)]
        lines += [_HEADER_END, "", ""]
        return "\n".join(lines)

    def _append(self, text: str) -> bool:
        """Write, flush and fsync; on the first failure warn once, afterwards drop writes silently."""
        if self._failed or self._fh is None:
            self.dropped_writes += 1
            return False
        try:
            self._fh.write(text)
            self._fh.flush()
            os.fsync(self._fh.fileno())
            return True
        except (OSError, ValueError) as e:
            self._fail(os.strerror(e.errno) if getattr(e, "errno", None) else str(e))
            return False

    def _fail(self, reason: str) -> None:
        self._failed = True
        self.dropped_writes += 1
        warnings.warn(
            f"trl_mdi: writing the training log {self.path} failed ({reason}); further entries of this log are "
            "dropped, training continues.",
            RuntimeWarning,
            stacklevel=4,
        )

    @property
    def failed(self) -> bool:
        """True once a write has failed (the log is then disabled)."""
        return self._failed

    def close(self) -> None:
        """Close the file; later writes are dropped (with one warning), never reopened silently."""
        self._closed = True
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
            self._fh = None

    def __enter__(self) -> StepLogFile:
        if self._fh is None:
            self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --------------------------------------------------------------------------------------------- steps
    @property
    def last_step(self) -> int | None:
        return self.records[-1][0] if self.records else None

    def _write_block(self, step: int, epoch: float | None, body: str, data: dict | None = None) -> bool:
        """Append one step block. A step lower than the last one written is refused with a warning (it would
        make a step appear twice); the same step again (several generation batches per optimizer step) is
        written as a continuation."""
        if self._fh is None and not self._failed:
            if self._closed:
                self._fail("the log was closed")
                return False
            self.open()
        step = int(step)
        last = self.last_step
        if last is not None and step < last:
            warnings.warn(f"trl_mdi: {self.path.name}: step {step} comes after step {last}; not logged",
                          RuntimeWarning, stacklevel=3)
            return False
        part = sum(1 for s, _ in self.records if s == step)
        heading = f"## Step {step}" + (f" (continued, batch {part + 1})" if part else "")
        if epoch is not None:
            heading += f" · epoch {float(epoch):.3f}"
        elapsed = int(time.monotonic() - self._t0)
        heading += f" · {time.strftime('%Y-%m-%d %H:%M:%S')} (+{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d})"
        data = _json_safe(dict(data or {}))
        end = f"<!-- trl_mdi:end step={step} {json.dumps(data, separators=(',', ':'))} -->"
        ok = self._append(f"{heading}\n\n{body.rstrip()}\n\n{end}\n\n")
        if ok:
            self.records.append((step, data))
        return ok


def _ranges(steps: list[int]) -> str:
    """'4-5, 7' style summary of step numbers (sorted, de-duplicated)."""
    steps = sorted(set(steps))
    out, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        out.append(f"steps {steps[i]}–{steps[j]}" if j > i else f"step {steps[i]}")
        i = j + 1
    return ", ".join(out)


__all__ = ["LogPathError", "StepLogFile", "check_writable", "default_log_paths", "sanitize_run_name", "scan_log"]
