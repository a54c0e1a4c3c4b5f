"""The probe under DeepSpeed ZeRO-3 with 2 CPU processes: each rank measures its own rows exactly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e  # minutes-long (a launch of 2 processes or a whole command): make test-e2e, which CI runs
@pytest.mark.distributed
@pytest.mark.slow
def test_probe_exact_under_zero3_two_processes(tiny_vlm_dir, tmp_path):
    model_dir = tiny_vlm_dir("qwen2_5_vl")
    out = tmp_path / "ranks.jsonl"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / "accelerate_configs" / "cpu_zero3.yaml"),
        str(ROOT / "tests" / "dist" / "probe_zero3.py"), str(model_dir), str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == [0, 1]
    for r in records:
        assert r["world_size"] == 2
        assert r["max_abs_err"] < 1e-5, r
        # Really sharded: each rank holds about half of every weight's elements.
        assert 0.4 < r["local_param_fraction"] < 0.6, r
    # Each rank measured its own rows: rank 0's second row has no image, rank 1's has one.
    assert records[0]["n_image"][1] == 0 and records[1]["n_image"][1] > 0
