"""kill -9 of a 2-process run after a checkpoint, then --resume_from_checkpoint: nothing lost, nothing twice. The
parameters the resumed run starts from are the checkpoint's, on every process (DDP reloads through the trainer's own
load: transformers' kept 68 of Qwen2.5-VL's 69 tensors at the base model's values)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoModelForImageTextToText

from fixtures.testing import parameter_digest

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"^## Step (\d+)", re.M)


def _cmd(model_dir, data, out_jsonl, overrides):
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(ROOT / "accelerate_configs" / "cpu_ddp.yaml"), str(ROOT / "tests" / "dist" / "train_tiny.py"),
            str(model_dir), str(data), str(out_jsonl), json.dumps(overrides)]


def _steps(path: Path) -> list[int]:
    # Outside fenced blocks only: a completion may contain anything.
    body, fence = [], None
    for line in path.read_text().splitlines():
        m = re.match(r"^(`{3,})", line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and line.strip() == fence:
            fence = None
        elif fence is None:
            body.append(line)
    return [int(s) for s in STEP.findall("\n".join(body))]


def _prompts(path: Path) -> dict[int, list[str]]:
    blocks = re.split(r"^## Step ", path.read_text(), flags=re.M)[1:]
    out = {}
    for b in blocks:
        step = int(b.split()[0])
        out[step] = re.findall(r"\*\*Prompt\*\*.*?\n\n(`{3,})text\n(.*?)\n\1", b, flags=re.S)
    return out


@pytest.mark.e2e  # minutes-long (a launch of 2 processes or a whole command): make test-e2e, which CI runs
@pytest.mark.distributed
@pytest.mark.slow
def test_kill_9_then_resume(tiny_vlm_dir, prepared_aokvqa_dir, tmp_path):
    model_dir, data = tiny_vlm_dir("qwen2_5_vl"), prepared_aokvqa_dir / "train.parquet"
    base = {"use_cpu": True, "max_steps": 6, "save_strategy": "steps", "save_steps": 2,
            "log_full_rollouts_per_step": 8, "enable_perception_filtering": True}
    env = {**os.environ}

    # Reference: the same run, uninterrupted.
    ref = subprocess.run(_cmd(model_dir, data, tmp_path / "ref.jsonl", {**base, "output_dir": str(tmp_path / "ref")}),
                         cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert ref.returncode == 0, ref.stderr[-4000:]

    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(model_dir, data, tmp_path / "a.jsonl",
                                 {**base, "output_dir": str(out), "slow_reward_seconds": 1.0}),
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 600
    while not (out / "checkpoint-2" / "trainer_state.json").exists():
        assert proc.poll() is None, "the run ended before its first checkpoint"
        assert time.time() < deadline
        time.sleep(0.2)
    time.sleep(1.5)  # into step 3: some of it may already be in the logs
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert not (out / "checkpoint-6").exists()
    checkpoints = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    last = checkpoints[-1]
    resumed_at = int(last.name.split("-")[1])

    res = subprocess.run(_cmd(model_dir, data, tmp_path / "b.jsonl",
                              {**base, "output_dir": str(out), "resume_from_checkpoint": str(last)}),
                         cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    # The weights: every process starts the resumed steps from the checkpoint's parameters, bit for bit (as
    # from_pretrained reads the checkpoint), not from the base model's.
    checkpoint, base = (parameter_digest(AutoModelForImageTextToText.from_pretrained(d)) for d in (last, model_dir))
    resumed = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert checkpoint != base and [r["start_digest"] for r in resumed] == [checkpoint, checkpoint], resumed
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    # The killed run's main process held output_dir's lock (trl_mdi.run_lock): kill -9 released it, or the resume
    # would have stopped at start. Every checkpoint the runs finished carries its completion marker.
    assert (out / ".trl_mdi.lock").is_file()
    assert all((c / "trl_mdi_checkpoint.json").is_file() for c in out.glob("checkpoint-*"))
    for name in ("rollouts.md", "attention.md"):
        log = out / "logs" / name
        assert _steps(log) == [1, 2, 3, 4, 5, 6], name
        assert f"Resumed at step {resumed_at}" in log.read_text()
        # What the killed run logged after its checkpoint (if anything) is kept, marked undone.
        assert all(int(s) > resumed_at for s in re.findall(r"^### Undone step (\d+)", log.read_text(), re.M)), name
    # The data order continues deterministically: after the resume each step sees exactly the prompts the
    # uninterrupted run saw. (Sampled completions start alike too, but float rounding after a reload can flip a
    # near-tie sample later in a sequence, so they are not compared token for token.)
    ours, theirs = _prompts(out / "logs" / "rollouts.md"), _prompts(tmp_path / "ref" / "logs" / "rollouts.md")
    for step in range(resumed_at + 1, 7):
        assert ours[step] and ours[step] == theirs[step], step
