"""benchmarks/results.py: each benchmark replaces its own RESULTS.md section and nothing else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.results import replace_section

ROOT = Path(__file__).resolve().parents[1]

DOC = "# Benchmark results\n\n## A\n\nold a\n\n## B\n\nold b\n| x |\n\n## C\n\nold c\n"


@pytest.mark.parametrize("title, kept", [("## A", ["## B\n\nold b\n| x |\n", "## C\n\nold c\n"]),
                                         ("## B", ["## A\n\nold a\n", "## C\n\nold c\n"]),
                                         ("## C", ["## A\n\nold a\n", "## B\n\nold b\n| x |\n"])])
def test_replaces_only_its_own_section(tmp_path, title, kept):
    path = tmp_path / "RESULTS.md"
    path.write_text(DOC)
    replace_section(title, f"{title}\n\nnew\n", path)
    text = path.read_text()
    assert text.count(title + "\n") == 1 and f"{title}\n\nnew\n" in text and f"old {title[-1].lower()}" not in text
    assert all(section in text for section in kept)
    assert text.startswith("# Benchmark results\n") and text.endswith("\n") and "\n\n\n" not in text
    replace_section(title, f"{title}\n\nnew\n", path)  # idempotent
    assert path.read_text() == text


def test_appends_a_missing_section_and_creates_the_file(tmp_path):
    path = tmp_path / "RESULTS.md"
    replace_section("## New", "## New\n\nbody", path)
    assert path.read_text() == "# Benchmark results\n\n## New\n\nbody\n"
    with pytest.raises(ValueError, match="heading"):
        replace_section("## New", "no heading", path)
    assert replace_section("## Newer", "## Newer\n\nx\n", path) is None
    assert path.read_text().endswith("## New\n\nbody\n\n## Newer\n\nx\n")  # "## New" is not a prefix match


BENCHMARKS = ("attention_memory", "overhead", "learning_curve", "language_prior", "gpu_probe", "look_or_guess", "demo")


def test_every_benchmark_imports_its_helpers():
    """Each benchmark runs as ``python -m benchmarks.<name>`` from the repository root, with no sys.path edit. (The
    seven start together: each spends its 10-20 s importing torch and transformers.)"""
    procs = {name: subprocess.Popen([sys.executable, "-m", f"benchmarks.{name}", "--help"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=ROOT) for name in BENCHMARKS}
    failed = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        if proc.returncode != 0 or "usage:" not in out:
            failed[name] = (proc.returncode, err[-2000:])
    assert not failed, failed
