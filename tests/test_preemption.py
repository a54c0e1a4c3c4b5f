"""SIGTERM to a real run (issue 42, item 2): what SLURM and Kubernetes send before they kill a job.

Before: Python's default, the process gone at once (status 143), no "Run stopped" line, no checkpoint. Now: the line
always; with ``save_on_sigterm`` a whole checkpoint first, saved by every process together (they agree at the end
of the step in progress, so a signal that reached one process only still stops all of them at the same step), then
status 143; the output_dir lock is free and a resume continues from that checkpoint, its parameters exactly.
"""

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
from trl_mdi.checkpoints import MARKER, resume_problems
from trl_mdi.preemption import EXIT_STATUS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "dist" / "train_tiny.py")
STOPPED = re.compile(r"^> \*\*Run stopped\*\* at step (\d+) · [^·]+ · (.*)$", re.M)


def command(model_dir, data, out_jsonl, overrides, processes: int = 1) -> list[str]:
    """train_tiny.py run directly (one process, as ``python script.py`` runs) or under ``accelerate launch``."""
    if processes == 1:  # no process group to set up (train_tiny.py's gloo default is for its launches)
        overrides = {**overrides, "ddp_backend": None}
    args = [SCRIPT, str(model_dir), str(data), str(out_jsonl), json.dumps(overrides)]
    if processes == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(ROOT / "accelerate_configs" / "cpu_ddp.yaml"), *args]


def run_until_step(cmd, log: Path, step: int, console: Path, timeout: float = 600) -> subprocess.Popen:
    """Start ``cmd`` (its output to ``console``) and return once the rollout log shows ``step``: mid-training."""
    with open(console, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + timeout
    while not (log.is_file() and f"## Step {step} " in log.read_text()):
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before step {step}: {console.read_text()[-4000:]}")
        assert time.time() < deadline, "no progress"
        time.sleep(0.2)
    return proc


def finish(proc: subprocess.Popen, console: Path, timeout: float = 600) -> tuple[int, str]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, console.read_text()


def last_stop(log: Path) -> tuple[int, str]:
    """The log's "Run stopped" line (it must be the last one): step and reason."""
    text = log.read_text()
    found = STOPPED.findall(text)
    assert found and text.rstrip().endswith(f"<!-- trl_mdi:stopped step={found[-1][0]} -->"), text[-800:]
    return int(found[-1][0]), found[-1][1]


def base_overrides(out: Path, **more) -> dict:
    return {"use_cpu": True, "output_dir": str(out), "max_steps": 30, "slow_reward_seconds": 0.5,
            "learning_rate": 1e-2, **more}


def check_saved_and_resumable(model_dir, data, overrides: dict, tmp_path: Path, reason: str, processes: int) -> None:
    """The stop's checkpoint is whole and the only one; a resume starts from its parameters and continues."""
    out = Path(overrides["output_dir"])
    step = int(re.search(r"\(step (\d+)\)", reason).group(1))
    checkpoint = out / f"checkpoint-{step}"
    assert [p.name for p in out.glob("checkpoint-*")] == [checkpoint.name]
    assert (checkpoint / MARKER).is_file() and resume_problems(checkpoint) == []
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == step
    resumed = subprocess.run(command(model_dir, data, tmp_path / "b.jsonl",
                                     {**overrides, "max_steps": step + 1, "slow_reward_seconds": 0.0,
                                      "resume_from_checkpoint": "true"}, processes),
                             cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]  # the stopped run's lock was released
    records = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    saved = parameter_digest(AutoModelForImageTextToText.from_pretrained(checkpoint))
    assert [r["global_step"] for r in records] == [step + 1] * processes
    assert [r["start_digest"] for r in records] == [saved] * processes
    assert f"Resumed at step {step}" in (out / "logs" / "rollouts.md").read_text()


@pytest.mark.slow
def test_sigterm_writes_the_stopped_line_and_with_save_on_sigterm_saves_a_checkpoint_first(
        tiny_vlm_dir, prepared_aokvqa_dir, tmp_path):
    """One process, the signal to the training process itself (``python script.py`` under SLURM or Kubernetes)."""
    model_dir, data = tiny_vlm_dir("qwen2_5_vl"), prepared_aokvqa_dir / "train.parquet"

    # Default: stopped at once, the logs say so (before: nothing; rc 143 either way).
    out, console = tmp_path / "plain", tmp_path / "plain.txt"
    proc = run_until_step(command(model_dir, data, tmp_path / "p.jsonl", base_overrides(out)), out / "logs" /
                          "rollouts.md", 1, console)
    proc.send_signal(signal.SIGTERM)
    code, output = finish(proc, console)
    assert code == EXIT_STATUS, output[-3000:]
    for name in ("rollouts.md", "attention.md"):
        step, reason = last_stop(out / "logs" / name)
        assert reason.startswith(f"Preempted: SIGTERM during step {step + 1}: stopped at once, no checkpoint saved "
                                 "(save_on_sigterm is off); resume from the last checkpoint"), reason
    assert not list(out.glob("checkpoint-*"))

    # save_on_sigterm: the step in progress finishes, its checkpoint is saved whole, then the same stop.
    out, console = tmp_path / "saving", tmp_path / "saving.txt"
    overrides = base_overrides(out, save_on_sigterm=True)
    proc = run_until_step(command(model_dir, data, tmp_path / "a.jsonl", overrides), out / "logs" / "rollouts.md", 1,
                          console)
    proc.send_signal(signal.SIGTERM)
    code, output = finish(proc, console)
    assert code == EXIT_STATUS, output[-3000:]
    step, reason = last_stop(out / "logs" / "rollouts.md")
    assert re.fullmatch(rf"Preempted: SIGTERM during step {step}: saved checkpoint {re.escape(str(out))}/checkpoint-{step} "
                        rf"\(step {step}\) on every process and stopped \(save_on_sigterm\); resume with "
                        r"--resume_from_checkpoint true", reason), reason
    assert reason.removeprefix("Preempted: ") in output  # and on the console
    check_saved_and_resumable(model_dir, data, overrides, tmp_path, reason, processes=1)


@pytest.mark.e2e  # minutes-long (a launch of 2 processes or a whole command): make test-e2e, which CI runs
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("to", ["launcher", "rank 1"])
def test_save_on_sigterm_under_accelerate_launch_all_ranks_agree(to, tiny_vlm_dir, prepared_aokvqa_dir, tmp_path):
    """2 processes (DDP). ``launcher``: SIGTERM to ``accelerate launch``, as SLURM and Kubernetes send it; torchrun
    forwards it to the workers (and kills them TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later). ``rank 1``: to one
    worker only, the hard case (the forwarded signals do not arrive at the same moment either): rank 0 never sees
    it, yet both save the same checkpoint-N (the flag is reduced over the processes at each step's end; a rank
    saving alone would hang the other in the save's collectives) and stop; the resume continues on both from its
    parameters."""
    model_dir, data = tiny_vlm_dir("qwen2_5_vl"), prepared_aokvqa_dir / "train.parquet"
    out, console = tmp_path / "run", tmp_path / "console.txt"
    overrides = base_overrides(out, save_on_sigterm=True, pid_dir=str(tmp_path / "pids"),
                               per_device_train_batch_size=2)
    proc = run_until_step(command(model_dir, data, tmp_path / "a.jsonl", overrides, processes=2),
                          out / "logs" / "rollouts.md", 1, console, timeout=900)
    os.kill(proc.pid if to == "launcher" else int((tmp_path / "pids" / "rank1").read_text()), signal.SIGTERM)
    code, output = finish(proc, console, timeout=900)
    assert code != 0, output[-3000:]  # the launcher reports its workers' status 143 (or its own signal)
    step, reason = last_stop(out / "logs" / "rollouts.md")  # written by rank 0
    seen = r"SIGTERM during step \d+" if to == "launcher" else "SIGTERM on another process"
    assert re.fullmatch(rf"Preempted: {seen}: saved checkpoint \S+/checkpoint-{step} \(step {step}\) on every "
                        r"process and stopped \(save_on_sigterm\); resume with --resume_from_checkpoint true",
                        reason), reason
    check_saved_and_resumable(model_dir, data, overrides, tmp_path, reason, processes=2)


def test_a_sigterm_the_interrupted_code_rewraps_still_ends_the_run_as_preempted(tiny_vlm_dir, grpo_train_dataset,
                                                                              tmp_path):
    """Seen in the suite: SIGTERM landed while matplotlib's C extension initialised; its module init turned the
    handler's Preempted into "ImportError: initialization failed" and the run exited 1 instead of 143. A callback
    plays that import: ``train`` must still end with Preempted (status 143) and write it as the logs' last line."""
    from test_trainer import make_args, spread_reward
    from transformers import TrainerCallback

    from trl_mdi import MDIGRPOTrainer
    from trl_mdi.preemption import Preempted

    class ImportInterrupted(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises here, at the next bytecode
            except Preempted as interrupted:
                raise ImportError("initialization failed") from interrupted

    args = make_args(tmp_path, max_steps=1)
    trainer = MDIGRPOTrainer(model=str(tiny_vlm_dir("qwen2_5_vl")), reward_funcs=spread_reward, args=args,
                             train_dataset=grpo_train_dataset, callbacks=[ImportInterrupted()])
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as stopped:
        trainer.train()
    assert stopped.value.code == EXIT_STATUS and isinstance(stopped.value.__cause__, ImportError)
    assert str(stopped.value).startswith("SIGTERM during step 1: stopped at once")
    step, reason = last_stop(Path(args.rollout_log_path))
    assert step == 0 and reason.startswith("Preempted: SIGTERM during step 1"), reason
    assert signal.getsignal(signal.SIGTERM) is handler  # put back
