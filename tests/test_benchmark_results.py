"""benchmarks/_results.py: each benchmark replaces its own RESULTS.md section and nothing else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
from _results import replace_section  # noqa: E402

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


@pytest.mark.parametrize("script", ["attention_memory.py", "overhead.py", "learning_curve.py", "language_prior.py",
                                    "gpu_probe.py"])
def test_every_benchmark_imports_its_helpers(script):
    proc = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
