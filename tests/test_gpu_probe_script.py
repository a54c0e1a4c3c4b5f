"""benchmarks/gpu_probe.py end to end on the CPU at tiny widths (``--tiny``), and its RESULTS.md section.

The GPU run itself needs a CUDA machine; this runs the same code path (model build, the GRPO-shaped batch,
memory, round-robin timing, the probe's checks against the eager reference, the SDPA spy, the JSON) on the CPU,
then renders the JSON into a copy of RESULTS.md. Expected values are derived from the arguments, not read back.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SECTION = "## Attention probe on a GPU"
# L=1024, not less: the CPU peak is VmHWM growth, which the kernel's per-CPU RSS counters blur by up to about
# CPUs x 128 KiB; at L=256 batch 1 the call adds ~140 KiB and read as 0 on a CI run. At 1024 the smallest row adds
# ~2.4 MiB, ten times that blur.
LENGTH, BATCHES, REPEATS = 1024, (1, 2), 2
TINY_TEXT = {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    # One torch thread: on a shared 2-core machine, more threads spin against other jobs and time out.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_probe", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("gpu_probe") / "gpu_probe.json"
    _run("--tiny", "--device", "cpu", "--lengths", str(LENGTH), "--batches", *map(str, BATCHES),
         "--repeats", str(REPEATS), "--out", str(out))
    return json.loads(out.read_text()), out


@pytest.mark.e2e  # minutes-long (a launch of 2 processes or a whole command): make test-e2e, which CI runs
def test_every_shape_is_measured_on_the_inputs_asked_for(report):
    data, _ = report
    assert data["skipped"] == []
    assert [(r["length"], r["batch"]) for r in data["rows"]] == [(LENGTH, b) for b in BATCHES]
    p_len = LENGTH - LENGTH // 2
    side = math.isqrt(p_len // 4)  # a quarter of the prompt is one square image of 28-px tokens
    for r in data["rows"]:
        b = r["batch"]
        # batch 1: no padding; batch 2: row 1's prompt 1/8 shorter (left-padded), row 0's completion 3/4 of the max
        assert r["left_pad"] == ([0] if b == 1 else [0, p_len // 8])
        assert r["n_completion"] == ([LENGTH // 2] if b == 1 else [LENGTH // 2 - LENGTH // 8, LENGTH // 2])
        assert r["checks"]["n_image"] == [side * side] * b
        assert r["checks"]["n_queries"] == r["n_completion"]  # the probe measured every completion token


@pytest.mark.e2e  # minutes-long (a launch of 2 processes or a whole command): make test-e2e, which CI runs
def test_memory_and_times_are_measured_and_the_ratios_follow_from_them(report):
    data, _ = report
    for r in data["rows"]:
        assert r["variants"] == ["a", "b", "c"] and r["failed_variants"] == {}  # side by side, in one run
        for v in ("a", "b", "c"):
            assert r["peak_bytes"][v] > 0  # the MLP's (B, 1024, 128) float32 buffers alone are 512 KiB a row
            assert len(r["times_s"][v]) == REPEATS and all(t > 0 for t in r["times_s"][v])
            assert r["median_s"][v] == statistics.median(r["times_s"][v])
        assert r["ratio_mem"] == pytest.approx(r["peak_bytes"]["b"] / r["peak_bytes"]["a"])
        assert r["ratio_time"] == pytest.approx(r["median_s"]["b"] / r["median_s"]["a"])
        pairs = [b / a for a, b in zip(r["times_s"]["a"], r["times_s"]["b"])]
        assert r["ratio_time_paired"] == pytest.approx(statistics.median(pairs))
        for v in ("b", "c"):
            assert r["ratios"][v]["mem"] == pytest.approx(r["peak_bytes"][v] / r["peak_bytes"]["a"])
            assert r["ratios"][v]["time"] == pytest.approx(r["median_s"][v] / r["median_s"]["a"])


@pytest.mark.e2e  # minutes-long (a launch of 2 processes or a whole command): make test-e2e, which CI runs
def test_probe_masses_sum_to_one_and_match_the_eager_reference(report):
    data, _ = report
    for r in data["rows"]:
        for c in (r["checks"], r["checks_c"]):  # the indicator route (b) and the log-sum-exp route (c)
            assert c["finite"] is True and c["num_layers"] == TINY_TEXT["num_layers"]
            assert c["max_abs_sum_error"] < 1e-5
            assert c["max_abs_err_vs_eager"] < 1e-5  # float32 at L=1024 <= --eager-max-length
            assert 0 < c["image_mass_mean"] < 1
        assert r["max_abs_diff_vs_b"]["c"] < 1e-5
        # every text layer: one SDPA call of the model's own and one of the probe's
        by_role = {role: sum(n for k, n in r["sdpa_backends"].items() if k.startswith(role + ":"))
                   for role in ("model", "probe")}
        assert by_role == {"model": TINY_TEXT["num_layers"], "probe": TINY_TEXT["num_layers"]}


@pytest.mark.e2e  # minutes-long (a launch of 2 processes or a whole command): make test-e2e, which CI runs
def test_machine_and_model_are_recorded(report):
    data, _ = report
    assert data["machine"]["torch"] == torch.__version__ and data["machine"]["device"] == "cpu"
    text = data["model"]["text"]
    assert {k: text[k] for k in TINY_TEXT} == TINY_TEXT
    assert text["head_dim"] == 16 and text["rope_parameters"]["mrope_section"] == [2, 3, 3]
    assert data["model"]["dtype"] == "float32" and data["model"]["attn_implementation"] == "sdpa"
    assert "--out" not in data["argv"] and data["argv"][:3] == ["--tiny", "--device", "cpu"]


@pytest.mark.e2e  # minutes-long (a launch of 2 processes or a whole command): make test-e2e, which CI runs
def test_the_section_is_rendered_into_results(report, tmp_path):
    data, path = report
    results = tmp_path / "RESULTS.md"
    shutil.copy(BENCH / "RESULTS.md", results)
    before = results.read_text()
    _run("--write-results", str(path), "--results", str(results), timeout=120)
    text = results.read_text()
    assert text.count(SECTION + "\n") == 1
    start = text.index(SECTION + "\n")
    assert text[:start] == (before[:before.index(SECTION + "\n")] if SECTION in before else before.rstrip("\n") + "\n\n")
    section = text[start:].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith(f"| {LENGTH} |")]
    assert len(table) == len(BATCHES)
    for line, r in zip(table, data["rows"]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[10] == f"{r['peak_bytes']['c'] / 2**20:,.1f}" and cells[12] == f"{1e3 * r['median_s']['c']:,.2f}"
        assert cells[13].startswith(f"{r['ratios']['c']['time']:.2f}")
        assert cells[1] == str(r["batch"])
        assert cells[4] == f"{r['peak_bytes']['a'] / 2**20:,.1f}" and cells[5] == f"{r['peak_bytes']['b'] / 2**20:,.1f}"
        assert cells[7] == f"{1e3 * r['median_s']['a']:,.2f}" and cells[8] == f"{1e3 * r['median_s']['b']:,.2f}"
        assert cells[9].startswith(f"{r['ratio_time']:.2f}")
    assert data["machine"]["name"] in section and f"transformers {data['machine']['transformers']}" in section
    assert "float32" in section and f"median of {REPEATS} calls" in section
    assert 'route=\"lse\"' in section and "max |(c) − (b)|" in section
    _run("--write-results", str(path), "--results", str(results), timeout=120)
    assert results.read_text() == text  # replaced, not appended


def test_matching_commit_finds_the_commit_whose_files_a_dirty_base_held(tmp_path):
    """The GPU machine's copy records 'base commit + uncommitted changes (diff hash)'; matching_commit names the later
    commit whose files give that hash over the base, and None for files no commit holds."""
    from benchmarks.gpu_probe import CODE_PATHS, matching_commit
    from benchmarks.results import code_version

    repo = tmp_path / "repo"
    (repo / CODE_PATHS[0]).mkdir(parents=True)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    probe = repo / CODE_PATHS[0] / "probe.py"
    probe.write_text("v = 1\n")
    git("add", "-A")
    git("commit", "-qm", "base")
    base = git("rev-parse", "HEAD")
    commits = []
    for v in (2, 3):
        probe.write_text(f"v = {v}\n")
        (repo / CODE_PATHS[0] / f"new{v}.py").write_text("x = 0\n")
        git("add", "-A")
        git("commit", "-qm", f"v{v}")
        commits.append(git("rev-parse", "HEAD"))
    # what the device records: the base checked out, commit v2's files laid over it (a new file untracked)
    device = tmp_path / "device"
    git("worktree", "add", "-q", "--detach", str(device), base)
    (device / CODE_PATHS[0] / "probe.py").write_text("v = 2\n")
    (device / CODE_PATHS[0] / "new2.py").write_text("x = 0\n")
    recorded = code_version(CODE_PATHS, root=device)
    assert recorded["commit"] == base and recorded["dirty"]
    assert matching_commit(recorded, root=repo) == commits[0]
    (device / CODE_PATHS[0] / "probe.py").write_text("v = 4\n")  # files no commit holds
    assert matching_commit(code_version(CODE_PATHS, root=device), root=repo) is None
    assert matching_commit({"commit": base, "dirty": False, "diff": None}, root=repo) is None  # clean: nothing to match


@pytest.mark.e2e  # minutes-long (a launch of 2 processes or a whole command): make test-e2e, which CI runs
def test_a_peak_read_as_zero_finishes_the_run_and_renders_a_dash(tmp_path):
    # On the CPU a small call's peak can read as 0 (the kernel's per-CPU RSS counters): the ratio is then None, and
    # the run must still log, write its JSON and render, not stop at a format string.
    out = tmp_path / "zero.json"
    code = ("import sys; from benchmarks import gpu_probe as g\n"
            "g.peak_memory = lambda run, device: (run(), 0)[1]\n"
            f"sys.exit(g.main(['--tiny', '--device', 'cpu', '--lengths', '256', '--batches', '1', '--repeats', '1', "
            f"'--out', {str(out)!r}]))")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["peak_bytes"] for r in data["rows"]] == [{"a": 0, "b": 0, "c": 0}] and data["rows"][0]["ratio_mem"] is None
    from benchmarks import gpu_probe

    line = next(line for line in gpu_probe.render(data).splitlines() if line.startswith("| 256 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4:7] == ["0.0", "0.0", "—"] and cells[10:12] == ["0.0", "—"]
