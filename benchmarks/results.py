"""What every benchmark script shares: offline settings, replacing its own section of RESULTS.md, the code version
a result came from, and running one job of a pool and saving its result.

The scripts run as ``python -m benchmarks.<name>`` from the repository root, so the root is on ``sys.path``:
``benchmarks``, ``fixtures`` and (without an install) ``trl_mdi`` import from the checkout.
"""

from __future__ import annotations

import json
import os
import re
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from fixtures.offline import OFFLINE_ENV  # the tests' offline variables: one list

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
ROOT = RESULTS.parent.parent


def set_offline_env() -> None:
    """Nothing from the Hugging Face Hub at run time (``fixtures.offline.OFFLINE_ENV``; unlike the tests, a value
    already in the environment wins). Call before importing transformers / datasets: they read these at import."""
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



def code_version(paths: tuple[str, ...] = (), root: Path = ROOT) -> dict:
    """The code a result came from, read with git in ``root`` (the repository holding this folder)::

        {"commit": <HEAD's full hash>, "dirty": <bool>, "diff": <16 hex digits or None>}

    ``dirty``: the working tree differs from that commit (a tracked file changed, staged or not, or an untracked,
    not ignored file exists), so the commit alone does not say what ran. ``diff``: a hash of those differences
    (``git diff HEAD`` plus the untracked files' names and bytes), None when clean: two dirty trees on one commit
    with the same ``diff`` ran the same code. ``paths`` (e.g. ``("trl_mdi", "fixtures")``) limits both to the files
    that decide a result, so an edit elsewhere (a doc) does not count; empty = the whole tree. Outside a git
    checkout (an unpacked archive) every value is None: unknown, which a comparison treats as different from any
    known version.
    """
    import hashlib
    import subprocess

    def git(*args: str) -> bytes | None:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    unknown = {"commit": None, "dirty": None, "diff": None}
    commit = git("rev-parse", "HEAD")
    if commit is None:
        return unknown
    scope = ("--", *paths) if paths else ()
    diff = git("diff", "HEAD", "--binary", *scope)
    untracked = git("ls-files", "--others", "--exclude-standard", "-z", *scope)
    if diff is None or untracked is None:
        return {**unknown, "commit": commit.decode().strip()}
    h = hashlib.sha256(diff)
    for name in sorted(n for n in untracked.split(b"\0") if n):
        h.update(b"\0" + name + b"\0")
        try:
            h.update((root / name.decode()).read_bytes())
        except OSError:  # removed or unreadable since ls-files listed it
            pass
    dirty = bool(diff.strip() or untracked.strip())
    return {"commit": commit.decode().strip(), "dirty": dirty, "diff": h.hexdigest()[:16] if dirty else None}


def describe_version(version: dict | None) -> str:
    """``code_version``'s dict in words for a RESULTS.md line: ``commit 8ce988e`` or ``commit 8ce988e + uncommitted
    changes (diff 1a2b3c4d5e6f7a8b)``; ``unknown code version`` without git."""
    if not version or not version.get("commit"):
        return "unknown code version (not a git checkout)"
    text = f"commit {version['commit'][:7]}"
    if version.get("dirty"):
        text += f" + uncommitted changes (diff {version.get('diff')})"
    return text


def run_job(job: dict, body: Callable[[Callable[[str], None]], dict]) -> tuple[dict | None, str | None]:
    """One job of a benchmark's pool, in the main process or a spawned worker: ``body(log)`` computes its result.
    Sets the process's torch threads (``job["threads"]``) and quiets transformers first; ``log`` prints with the
    seconds since ``job["started"]``. Returns ``(result, None)``, or ``(None, error)`` with the traceback logged: one
    job failing must not lose the others."""
    import torch
    import transformers

    torch.set_num_threads(job["threads"])
    transformers.logging.set_verbosity_error()

    def log(msg: str) -> None:
        print(f"[{time.time() - job['started']:7.1f} s] {msg}", flush=True)

    try:
        return body(log), None
    except Exception as err:  # noqa: BLE001 - one job failing must not lose the others
        log(f"  [{job['label']}] FAILED: {type(err).__name__}: {err}\n{traceback.format_exc()}")
        return None, f"{type(err).__name__}: {err}"


def write_json(path: Path, data: dict) -> None:
    """``data`` as JSON at ``path``, written whole or not at all (a temporary file, then renamed)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)  # a run interrupted while saving leaves no half-written result behind


def run_and_save(job: dict, body: Callable[[Callable[[str], None]], dict], stamp: dict,
                 save: Callable[[Path, dict], None] = write_json) -> tuple[dict | None, str | None]:
    """:func:`run_job`, then its result with ``stamp`` added (the fingerprint and code version a resume matches on)
    saved at ``job["path"]`` by ``save`` (default :func:`write_json`); a failing job saves nothing. Returns what
    :func:`run_job` returns, stamped."""
    result, error = run_job(job, body)
    if error:
        return None, error
    result.update(stamp)
    save(job["path"], result)
    return result, None


def run_pool(jobs: list[dict], execute: Callable[[dict], tuple[dict | None, str | None]],
             workers: int) -> dict[str, tuple[dict | None, str | None]]:
    """Every job of ``jobs`` through ``execute`` (a module-level function, e.g. one that calls :func:`run_and_save`),
    ``workers`` at a time, each worker a fresh spawned interpreter (no forked torch state); with one worker or one
    job, in this process. Returns ``{job["label"]: execute(job)}``.

    A job's result does not depend on the jobs run before it in its process: answer_visual_gain seed 0 after the
    warm-up's reliance job and four GRPO jobs of other variants, in one process, logged the same values at every
    step as run alone (20-step runs, checked for issue 30)."""
    if workers > 1 and len(jobs) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=ctx) as ex:
            return dict(zip([j["label"] for j in jobs], ex.map(execute, jobs)))
    return {j["label"]: execute(j) for j in jobs}
