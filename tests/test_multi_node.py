"""Two machines, emulated on one: two ``accelerate launch`` commands with the shipped ``multi_node_zero3.yaml``
(``--num_machines 2 --machine_rank 0/1``, ``--main_process_ip 127.0.0.1``, DeepSpeed ZeRO-3 with
``deepspeed_multinode_launcher: standard``), one process each, on the CPU, running the entry point.

Only what a CPU machine needs is given on the command line over the shipped file: the address and a free port, 2
processes in all, and ``--mixed_precision no`` (bf16 is the GPU file's setting). docs/training.md ("Several
machines") is the recipe these runs check:

- **shared filesystem** (both nodes get the same ``--output_dir``): one set of Markdown logs and one completions table,
  written by the global main process (node 0), with the rows of both nodes; node 0's main process holds the
  output_dir's lock for the run (node 1 takes none); checkpoints hold every rank's ZeRO-3 shards, and a resume from
  one continues to the parameters of the uninterrupted run;
- **no shared filesystem** (node 1 writes to a path of its own): training runs and node 0 writes the logs, the
  table, the lock and the final model; each checkpoint is split, node 0 holding the trainer state and rank 0's
  shards, node 1 only rank 1's shards and RNG state, so a resume on node 1 is refused (naming what its copy lacks)
  until the nodes' copies are gathered, after which each copy is whole.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fixtures.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "scripts" / "grpo_vlm.py"
CONFIG = ROOT / "accelerate_configs" / "multi_node_zero3.yaml"
# What the test sets over the shipped file, and why (everything else is the file's).
CPU_OVERRIDES = {"main_process_ip": "127.0.0.1", "num_processes": 2, "mixed_precision": "no"}
STEP = re.compile(r"^## Step (\d+)", re.M)

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]


def node_command(rank: int, port: int, output_dir: Path, model_dir, data_dir, logs: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
            "--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", CPU_OVERRIDES["main_process_ip"],
            "--main_process_port", str(port), "--num_processes", str(CPU_OVERRIDES["num_processes"]),
            "--mixed_precision", CPU_OVERRIDES["mixed_precision"], str(SCRIPT),
            "--model_name_or_path", str(model_dir), "--dataset_path", str(data_dir), "--dataset_train_split", "train",
            "--output_dir", str(output_dir), "--per_device_train_batch_size", "2", "--num_generations", "2",
            "--max_completion_length", "8", "--logging_steps", "1", "--seed", "0", "--report_to", "none",
            "--log_completions", "true", "--save_steps", "1",
            "--rollout_log_path", str(logs / "rollouts.md"), "--attention_diag_log_path", str(logs / "attention.md"),
            *extra]


def launch(outputs: tuple[Path, Path], model_dir, data_dir, logs: Path, *extra: str, watch_lock: bool = False,
           timeout: float = 900) -> tuple[list[subprocess.CompletedProcess], str | None]:
    """Both nodes, node ``r`` writing to ``outputs[r]``; returns their results and, with ``watch_lock``, the error a
    third run got when it tried to lock node 0's output_dir while the run was going (None: never refused).

    Each node's output goes to a file: with pipes, a node blocked on a full pipe while the test waits on the other
    would stall the collectives of both."""
    from trl_mdi.run_lock import LOCK_NAME, RunLockedError, lock_output_dir

    port = free_port()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1"}
    logs.mkdir(parents=True, exist_ok=True)
    files = [(open(logs / f"node{r}.out", "w"), open(logs / f"node{r}.err", "w")) for r in (0, 1)]  # noqa: SIM115
    procs = [subprocess.Popen(node_command(r, port, outputs[r], model_dir, data_dir, logs, *extra), cwd=ROOT, env=env,
                              stdout=files[r][0], stderr=files[r][1], text=True) for r in (0, 1)]
    refused = None
    lock_file = outputs[0] / LOCK_NAME
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise AssertionError(f"the 2-node run did not end within {timeout:g} s; node 0's last lines:\n"
                                     + (logs / "node0.err").read_text()[-3000:])
            # Only once node 0 has written its name into the file (it holds the lock by then): trying earlier could
            # take the lock before node 0 and make *it* the refused run.
            if watch_lock and refused is None and lock_file.is_file() and "pid" in lock_file.read_text():
                try:
                    lock_output_dir(outputs[0]).release()
                except RunLockedError as err:
                    refused = str(err)
            time.sleep(1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for out, err in files:
            out.close()
            err.close()
    results = [subprocess.CompletedProcess(p.args, p.returncode, (logs / f"node{r}.out").read_text(),
                                           (logs / f"node{r}.err").read_text()) for r, p in enumerate(procs)]
    for r, res in enumerate(results):
        assert res.returncode == 0, f"node {r}:\n{res.stderr[-4000:]}"
    return results, refused


def steps_in(log: Path) -> list[int]:
    return [int(s) for s in STEP.findall(log.read_text())]


def load_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_the_shipped_file_is_what_runs():
    """The launches use multi_node_zero3.yaml as shipped, less only the CPU overrides (and the per-node rank)."""
    shipped = yaml.safe_load(CONFIG.read_text())
    assert shipped["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"
    assert shipped["deepspeed_config"]["zero_stage"] == 3 and shipped["num_machines"] == 2
    assert set(CPU_OVERRIDES) <= set(shipped)


@pytest.mark.timeout(2400)  # two 2-node launches, each a few minutes on 2 shared cores
def test_two_nodes_with_a_shared_filesystem(tiny_vlm_dir, prepared_aokvqa_dir, tmp_path):
    import pandas as pd

    model_dir = tiny_vlm_dir("qwen2_5_vl")
    out, logs = tmp_path / "out", tmp_path / "logs"
    (node0, node1), refused = launch((out, out), model_dir, prepared_aokvqa_dir, logs, "--max_steps", "2",
                                     watch_lock=True)
    # Node 0's main process is the global main: it prints the configuration and writes every log, once.
    assert node0.stdout.count("effective configuration") == 1 and "effective configuration" not in node1.stdout
    assert "world_size                     2" in node0.stdout
    assert steps_in(logs / "rollouts.md") == [1, 2] and steps_in(logs / "attention.md") == [1, 2]
    for step in (1, 2):  # both nodes' rows: 2 prompts (one per process) x 2 generations
        table = pd.read_parquet(out / "completions" / f"completions_{step:05d}.parquet")
        assert len(table) == 4 and table["prompt"].astype(str).nunique() == 2 and table["mdi"].notna().all()
    # The lock: held by node 0's main process while the run went (a third run was refused, naming it).
    assert refused is not None and "is in use by another run" in refused and "pid" in refused
    # Every rank's ZeRO-3 shards in the one checkpoint folder.
    shards = sorted(p.name for p in (out / "checkpoint-1" / "global_step1").iterdir())
    assert [s for s in shards if "optim_states" in s] == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                                                          for r in (0, 1)]
    final = load_weights(out)

    # Resume from checkpoint-1 into a copy of the output_dir: the run continues to the uninterrupted run's weights.
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoint-1", resumed / "checkpoint-1")
    launch((resumed, resumed), model_dir, prepared_aokvqa_dir, tmp_path / "logs_resumed",
                        "--max_steps", "2", "--resume_from_checkpoint", str(resumed / "checkpoint-1"))
    again = load_weights(resumed)
    assert again.keys() == final.keys()
    for name in final:
        assert (again[name].float() - final[name].float()).abs().max() <= 1e-6, name


def test_two_nodes_without_a_shared_filesystem(tiny_vlm_dir, prepared_aokvqa_dir, tmp_path):
    from trl_mdi.checkpoints import resolve_resume, resume_problems
    from trl_mdi.run_lock import LOCK_NAME

    node0_dir, node1_dir, logs = tmp_path / "node0" / "out", tmp_path / "node1" / "out", tmp_path / "logs"
    launch((node0_dir, node1_dir), tiny_vlm_dir("qwen2_5_vl"), prepared_aokvqa_dir, logs, "--max_steps", "1")
    # Node 0 writes the logs, the table, the final model, and holds the lock; node 1's folder gets none of them.
    assert steps_in(logs / "rollouts.md") == [1]
    assert (node0_dir / "completions").is_dir() and (node0_dir / "model.safetensors").is_file()
    assert (node0_dir / LOCK_NAME).is_file() and not (node1_dir / LOCK_NAME).exists()
    assert not (node1_dir / "completions").exists() and not (node1_dir / "model.safetensors").exists()
    # The checkpoint is split: each node has its own ranks' shards (and RNG state); only node 0 the trainer state.
    ck0, ck1 = node0_dir / "checkpoint-1", node1_dir / "checkpoint-1"
    assert {p.name for p in (ck0 / "global_step1").iterdir()} == {f"zero_pp_rank_0_mp_rank_00_{k}_states.pt"
                                                                   for k in ("model", "optim")}
    assert {p.name for p in (ck1 / "global_step1").iterdir()} == {f"zero_pp_rank_1_mp_rank_00_{k}_states.pt"
                                                                   for k in ("model", "optim")}
    assert (ck1 / "rng_state_1.pth").is_file() and not (ck1 / "trainer_state.json").exists()
    # A resume on node 1 from its own copy is refused before anything loads, naming what the copy lacks.
    with pytest.raises(ValueError, match="trainer_state.json"):
        resolve_resume(str(ck1), str(node1_dir), allow_partial=False)
    # Gathered (each node's checkpoint-1 copied into the other's), both copies are whole.
    for a, b in ((ck0, ck1), (ck1, ck0)):
        shutil.copytree(a, b, dirs_exist_ok=True)
    assert resume_problems(ck0) == [] and resume_problems(ck1) == []
    assert sorted(p.name for p in (ck0 / "global_step1").iterdir()) == sorted(
        p.name for p in (ck1 / "global_step1").iterdir())
