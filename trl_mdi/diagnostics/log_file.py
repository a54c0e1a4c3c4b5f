"""The file mechanics shared by the Markdown log writers: path checks, header, append + fsync, resume.

File layout (what ``tail -f`` shows and what resume parses)::

    # <title> · <run name>
    <!-- trl_mdi:header kind=<kind> version=1 -->
    ... run name, start time, config table ...
    <!-- trl_mdi:header-end -->

    ## Step 1 · epoch 0.01 · 2025-01-01 12:00:03 (+0:00:12)
    ... step body ...
    <!-- trl_mdi:end step=1 {"mean_mdi": 1.23} -->

    > **Undone by the resume from step 3** ...  (a resume that finds steps after 3: kept, marked, renamed)
    <details><summary>Undone: step 4</summary> ... ### Undone step 4 ... </details>
    <!-- trl_mdi:undone step=3 -->

    > **Resumed at step 3** ...                (one per resume)
    <!-- trl_mdi:resume step=3 -->

    > **Run stopped** at step 5 ...              (a crash: the exception, where the process could still write)
    <!-- trl_mdi:stopped step=5 -->

Every step is one ``write`` + ``flush`` + ``os.fsync``, so a reader sees whole steps. The ``end`` comment
marks a step as complete and carries the few numbers the writer needs again after a resume (the MDI trend),
so the log itself is the only state: no sidecar to keep in sync. HTML comments do not render.

Nothing is ever deleted or overwritten (docs/logs.md, "Crash, resume, reused name"):

- **Fresh run** (``open()``) on a path that already holds a file (another run's log: a reused run name, two runs
  started together): the run writes ``<stem>-2.md`` (``-3``, ...) instead, claimed with ``O_EXCL`` so two runs never
  pick the same file, and warns; the other file is left untouched.
- **Resume** (``open(resume_from_step=N)``): the file is scanned (fence-aware, so text inside a logged completion
  cannot pose as a marker); every complete step block numbered <= N stays as it is. What follows (steps > N, written
  after the checkpoint being resumed from, and a block left incomplete by a crash) is *undone*: it is kept, moved
  under an "Undone by the resume from step N" section with its headings renamed ``### Undone step K`` (so no step
  is counted twice), and the resumed run writes those steps again after a "Resumed at step N" note.
- **Stop** (``stopped(step, reason)``): the last lines a crashing run writes, "Run stopped at step K" and why.
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

from .markdown import code_span, escape_inline, iter_lines_outside_fences, md_table, unclosed_fence

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


def log_path_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a log file, found without writing anything (None: no such reason): it is a directory, or
    a parent of it is a file."""
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if ancestor.exists() and not ancestor.is_dir():
        return f"{ancestor} is a file, not a directory"
    if path.is_dir():
        return "it is a directory"
    return None


def check_writable(path: Path) -> None:
    """Raise LogPathError unless ``path`` can be appended to (parent folders are created)."""
    problem = log_path_problem(path)
    if problem:
        raise LogPathError(path, problem)
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
    def open(self, resume_from_step: int | None = None, *, claimed: bool = False) -> StepLogFile:
        """Start the log. Fresh (None): a path that already holds a file is left alone and the log goes to the first
        free ``<stem>-K.md`` (``fresh_log_path``), with a warning; ``claimed``: the caller created ``self.path`` for
        this run (``claim_log_paths``). Resume (N): append to the same file after marking steps > N as undone (see
        the module docstring)."""
        if self._fh is not None:
            raise RuntimeError(f"{self.path} is already open")
        self._closed = False
        self._t0 = time.monotonic()
        note, undone = "", ""
        try:
            if resume_from_step is None and not claimed:
                wanted = self.path
                self.path = fresh_log_path(wanted)
                if self.path != wanted:
                    note = (f"{code_span(wanted.name)} already held another run's log (kept as it is); "
                            "this run writes here.")
                    warnings.warn(f"trl_mdi: {wanted} already holds another run's log (kept as it is); this run's "
                                  f"log is {self.path}", UserWarning, stacklevel=2)
            exists = self.path.exists() and self.path.stat().st_size > 0
            if resume_from_step is not None and exists:
                resume_note, undone = self._cut_for_resume(int(resume_from_step))
            self._fh = open(self.path, "a", encoding="utf-8", errors="replace", newline="")
        except OSError as e:
            raise LogPathError(self.path, e.strerror or str(e)) from e
        if not exists:
            self._append(self._header(note))
        if resume_from_step is not None:
            step = int(resume_from_step)
            if not exists:
                resume_note = "no earlier log was found at this path"
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            if undone:
                self._append(undone_section(undone, step, stamp))
            self._append(
                f"---\n\n> **Resumed at step {step}** · {stamp} · {resume_note}\n"
                f"<!-- trl_mdi:resume step={step} -->\n\n"
            )
        return self

    def _cut_for_resume(self, step: int) -> tuple[str, str]:
        """Cut the file after its last complete step block <= ``step``; returns (the resume note, the text cut off,
        which the caller writes back as undone). Nothing is cut when no step block follows that point (a crash line
        or an earlier resume note stays where it is)."""
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
        self.records = kept
        if not dropped:
            return "nothing written after that step was found", ""
        if text[cut : cut + 1] == "\n":
            cut += 1  # the blank line that follows every block
        os.truncate(self.path, len(text[:cut].encode("utf-8", "surrogateescape")))
        return (f"{len(dropped)} step block(s) written after it or left incomplete ({_ranges(dropped)}) were undone: "
                "kept above under \"Undone\", written again below"), text[cut:]

    def _header(self, note: str = "") -> str:
        lines = [
            f"# {self.title} · {escape_inline(self.run_name)}",
            f"<!-- trl_mdi:header kind={self.kind} version={FORMAT_VERSION} -->",
            "",
            f"- **Run:** {escape_inline(self.run_name)}",
            f"- **Started:** {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
            f"- **File:** {code_span(self.path.name)} (append-only; one block per step; `tail -f` friendly)",
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

    def stopped(self, step: int, reason: str) -> bool:
        """Append the run's last lines: "Run stopped at step ``step``" and ``reason`` (one line, capped). Opens the
        log first if the run stopped before writing any step (a resume's cut included). Never raises."""
        if self._fh is None and not self._failed and not self._closed:
            try:
                self.open(resume_from_step=step if step > 0 else None)
            except OSError:
                return False
        reason = " ".join(str(reason).split())
        reason = reason if len(reason) <= 400 else reason[:400] + " ..."
        return self._append(f"---\n\n> **Run stopped** at step {int(step)} · {time.strftime('%Y-%m-%d %H:%M:%S')} · "
                            f"{escape_inline(reason)}\n<!-- trl_mdi:stopped step={int(step)} -->\n\n")

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


def fresh_log_path(path: Path) -> Path:
    """``path`` itself if no file is there, else the first free ``<stem>-K<suffix>`` (K = 2, 3, ...); the file is
    created empty (``O_EXCL``), so two runs starting together never pick the same one.

    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> [fresh_log_path(d / "r.md").name for _ in range(3)]
    ['r.md', 'r-2.md', 'r-3.md']
    """
    return claim_log_paths([path])[0]


def claim_log_paths(paths: list[Path]) -> list[Path]:
    """Create empty files for a fresh run's logs: ``paths`` if none exists, else all of them with the first suffix
    ``-K`` free for every one (the rollout and attention logs of a run keep matching names). ``O_EXCL`` creation:
    another run's file is never reused, even one that is still empty."""
    for k in range(1, 10_000):
        chosen = [p if k == 1 else p.with_name(f"{p.stem}-{k}{p.suffix}") for p in paths]
        made = []
        for p in chosen:
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
                os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                made.append(p)
            except FileExistsError:
                break
        if len(made) == len(chosen):
            return chosen
        for p in made:  # ours and still empty: give the name back
            p.unlink(missing_ok=True)
    raise LogPathError(paths[0], "no free name left beside it (10,000 tried)")


def undone_section(text: str, step: int, stamp: str) -> str:
    """``text`` (what a resume from ``step`` cut off the log) as a collapsed "Undone" section: every step heading
    renamed ``### Undone step K`` and every end marker ``undone-end`` (so a reader, and the next resume, count no step
    twice), a fence a crash left open closed, nothing else changed."""
    renamed, out, last = [], [], 0
    for offset, line in iter_lines_outside_fences(text):
        if m := _STEP_RE.match(line):
            renamed.append(int(m.group(1)))
            out += [text[last:offset], "### Undone step" + line[len("## Step"):]]
            last = offset + len(line)
        elif _END_RE.match(line):
            out += [text[last:offset], line.replace("trl_mdi:end ", "trl_mdi:undone-end ", 1)]
            last = offset + len(line)
    body = ("".join(out) + text[last:]).rstrip("\n")
    closing = unclosed_fence(body)
    if closing:
        body += "\n" + closing
    what = _ranges(renamed) if renamed else "a partial block"
    return (f"---\n\n> **Undone by the resume from step {step}** · {stamp} · the {what} below "
            f"{'were' if len(renamed) > 1 else 'was'} written after that checkpoint by a run that stopped; the resumed "
            f"run writes {'them' if len(renamed) > 1 else 'it'} again after the \"Resumed\" note\n"
            f"<!-- trl_mdi:undone step={step} -->\n\n<details><summary>Undone: {what}</summary>\n\n{body}\n\n"
            "</details>\n\n")


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


__all__ = ["LogPathError", "StepLogFile", "check_writable", "claim_log_paths", "default_log_paths", "fresh_log_path",
           "log_path_problem", "sanitize_run_name", "scan_log", "undone_section"]
