"""MDIGRPOTrainer with 2 CPU processes: DDP (gloo) and DeepSpeed ZeRO-3."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForImageTextToText

from fixtures.testing import parameter_digest

ROOT = Path(__file__).resolve().parents[1]


def launch(config: str, model_dir: Path, data: Path, out: Path, overrides: dict, env: dict | None = None) -> list[dict]:
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs" / config),
        str(ROOT / "tests" / "dist" / "train_tiny.py"), str(model_dir), str(data), str(out), json.dumps(overrides),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-5000:]
    return sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"])


@pytest.mark.e2e  # minutes-long (a launch of 2 processes or a whole command): make test-e2e, which CI runs
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "config, overrides, dist_type",
    [
        ("cpu_ddp.yaml", {"use_cpu": True}, "MULTI_CPU"),
        ("cpu_zero3.yaml", {}, "DEEPSPEED"),
    ],
    ids=["ddp", "zero3"],
)
def test_two_processes(tiny_vlm_dir, prepared_aokvqa_dir, tmp_path, config, overrides, dist_type):
    # per_device_train_batch_size 2 with 4 generations: every group spans both processes.
    # All three TPRL parts on: the perturbed-image forward runs on every rank, TAS normalises the gathered batch.
    tprl = {"enable_entropy_filtering": True, "enable_perception_filtering": True,
            "enable_trajectory_reweighting": True}
    overrides = {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 2, "log_full_rollouts_per_step": 8,
                 **tprl, **overrides}
    records = launch(config, tiny_vlm_dir("qwen2_5_vl"), prepared_aokvqa_dir / "train.parquet",
                     tmp_path / "ranks.jsonl", overrides)
    assert [r["rank"] for r in records] == [0, 1]
    for r in records:
        assert r["world_size"] == 2 and r["distributed_type"].endswith(dist_type), r
        # Every rank ran the same no-grad policy forwards per generation batch (ZeRO-3 needs them in step):
        # the probe forward and the perturbed-image forward.
        assert r["forwards_per_generation"] == [2, 2], r
        assert r["measured_rows"] == [2, 2], r
    if dist_type == "DEEPSPEED":
        assert all(0.4 < r["local_param_fraction"] < 0.6 for r in records)  # really sharded
    # The group-relative score is computed over whole groups gathered across processes: zero-mean per group.
    for step in range(2):
        total = sum(sum(r["group_scores"][step]) for r in records)
        assert abs(total) < 1e-5, [r["group_scores"][step] for r in records]
    logs = records[0]["logs"]
    assert len(logs) == 2
    for key in ("attention/mdi", "attention/mdi_early", "attention/mdi_late", "rewards/mdi_balance/mean",
                "rewards/mdi_group/zero_spread_frac", "tprl/perception_token_fraction",
                "tprl/entropy_token_fraction", "tprl/scaling_factor_mean", "tprl/sensitivity_score_mean"):
        assert key in logs[0], key
    # TAS multipliers are normalised over the gathered batch: their mean over it is 1.
    assert all(abs(h["tprl/scaling_factor_mean"] - 1.0) < 1e-5 for h in logs)

    # The live logs, written by the main process from data gathered on both: every rollout of a step once.
    text = (tmp_path / "out" / "logs" / "rollouts.md").read_text()
    steps = re.split(r"^## Step ", text, flags=re.M)[1:]
    assert [int(b.split()[0]) for b in steps] == [1, 2]
    for block in steps:
        assert [int(i) for i in re.findall(r"^### Rollout (\d+)", block, flags=re.M)] == [0, 1, 2, 3]
    attention = (tmp_path / "out" / "logs" / "attention.md").read_text()
    assert len(re.findall(r"^## Step ", attention, flags=re.M)) == 2


# Rows 1, 6 and 7 lose their image; unshuffled, 2 prompts x 2 generations per process and generation batch, one row
# per training micro-batch. Step 1: rank 0 holds prompts 0 (image) and 1 (text), rank 1 prompts 2 and 3 (images): the
# generation batch has images on both processes, yet two of rank 0's micro-batches have none. Step 2: rank 0 holds
# prompts 4 and 5 (images), rank 1 prompts 6 and 7 (text): images on one process only from generation on.
MIXED_LAYOUT = {"limit_rows": 8, "text_only_rows": [1, 6, 7], "shuffle_dataset": False, "num_generations": 2,
                "per_device_train_batch_size": 1, "steps_per_generation": 4, "gradient_accumulation_steps": 4}


def check_mixed_layout(records: list[dict]) -> None:
    """The first two steps of a MIXED_LAYOUT run had the batches it promises (rank-ordered records; ranks step
    together, so index i is the same batch on both)."""
    generation = list(zip(*(r["generation_has_image"] for r in records)))[:2]
    micro = list(zip(*(r["micro_batch_has_image"] for r in records)))[:8]
    assert generation == [(True, True), (True, False)], generation
    assert (False, True) in micro[:4] and micro[4:] == [(True, False)] * 4, micro


@pytest.mark.e2e  # minutes-long (a launch of 2 processes or a whole command): make test-e2e, which CI runs
@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_with_images_on_one_process_only_trains_checkpoints_and_resumes(tiny_vlm_dir, prepared_aokvqa_dir,
                                                                               tmp_path):
    """MIXED_LAYOUT's generation batches and micro-batches with images on one process only: image-less forwards run
    the zero-weighted dummy vision pass, and the run trains, saves and resumes from its checkpoint."""
    out = tmp_path / "out"
    base = {**MIXED_LAYOUT, "output_dir": str(out), "save_strategy": "steps", "save_steps": 2}

    def run(overrides, jsonl):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "accelerate_configs" / "cpu_zero3.yaml"), str(ROOT / "tests" / "dist" / "train_tiny.py"),
               str(tiny_vlm_dir("qwen2_5_vl")), str(prepared_aokvqa_dir / "train.parquet"), str(jsonl),
               json.dumps({**base, **overrides})]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ})
        assert proc.returncode == 0, proc.stderr[-5000:]
        assert "images on some processes and none on others" not in proc.stderr
        return sorted((json.loads(line) for line in jsonl.read_text().splitlines()), key=lambda r: r["rank"])

    first = run({"max_steps": 2}, tmp_path / "a.jsonl")
    assert [r["global_step"] for r in first] == [2, 2]
    assert sum(r["dummy_vision_passes"] for r in first) > 0, first  # some process had no image somewhere
    # The cases the issue names happened: generation batches and training micro-batches with images on one process
    # only (ranks step together, so index i is the same batch on both).
    check_mixed_layout(first)
    assert (out / "checkpoint-2").is_dir()
    resumed = run({"max_steps": 4, "resume_from_checkpoint": str(out / "checkpoint-2")}, tmp_path / "b.jsonl")
    assert [r["global_step"] for r in resumed] == [4, 4]
    # The weights: both processes start from the checkpoint's parameters (gathered from DeepSpeed's global_step2/
    # shards), equal to the consolidated copy saved beside them.
    saved = parameter_digest(AutoModelForImageTextToText.from_pretrained(out / "checkpoint-2"))
    assert [r["start_digest"] for r in resumed] == [saved, saved] != [r["start_digest"] for r in first]
    logs = resumed[0]["logs"]
    assert logs and all(math.isfinite(h["loss"]) for h in logs)


@pytest.mark.e2e  # minutes-long (a launch of 2 processes or a whole command): make test-e2e, which CI runs
@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_parameters_are_the_same_with_and_without_the_dummy_vision_pass(tiny_vlm_dir, prepared_aokvqa_dir,
                                                                            tmp_path):
    """DDP with find_unused_parameters can train mixed batches without the dummy pass: with it, the image-less
    process's zero-weighted tower adds exactly zero to the averaged gradients, so the parameters are bit-identical.
    Plain SGD: with a stateful optimizer a step in which *no* process has an image differs by construction (the
    tower's gradient is 0 with the pass and None without, and Adam skips None but still moves on 0 with momentum)."""
    base = {**MIXED_LAYOUT, "max_steps": 2, "use_cpu": True, "ddp_find_unused_parameters": True, "optim": "sgd"}
    digests = {}
    # The "with" run also logs its completions table to trackio (local store under tmp_path): observing changes nothing.
    table = {"log_completions": True, "report_to": ["trackio"], "project": "dist", "run_name": "mixed"}
    for label, extra in (("with", table), ("without", {"no_vision_pass": True})):
        records = launch("cpu_ddp.yaml", tiny_vlm_dir("qwen2_5_vl"), prepared_aokvqa_dir / "train.parquet",
                         tmp_path / f"{label}.jsonl", {**base, **extra, "output_dir": str(tmp_path / label)},
                         env={"TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HOME": str(tmp_path / "hf_home")})
        assert len({r["param_digest"] for r in records}) == 1  # DDP: every rank holds the same weights
        digests[label] = records[0]["param_digest"]
        if label == "with":
            assert sum(r["dummy_vision_passes"] for r in records) > 0
            check_mixed_layout(records)
            check_mixed_table(records, tmp_path / label, tmp_path / "trackio" / "dist.db")
    assert digests["with"] == digests["without"]


def check_mixed_table(records: list[dict], out: Path, trackio_db: Path) -> None:
    """MIXED_LAYOUT's completions tables, 2 processes, steps_per_generation = gradient accumulation = 4: rows in TRL's
    order (rank 0's rollouts, then rank 1's); the mdi column is the value each rank handed its rewards, NaN for the
    text-only rollouts; in trackio's table, step 2 (images on rank 0 only) keeps its image column: an image for each
    of rank 0's rollouts, none for rank 1's."""
    import sqlite3
    from contextlib import closing

    import pandas as pd
    from test_trackers import number

    with closing(sqlite3.connect(f"file:{trackio_db}?mode=ro", uri=True)) as conn:
        blobs = [json.loads(b) for (b,) in conn.execute("SELECT metrics FROM metrics WHERE run_name = 'mixed'")]
    tables = {t["_value"][0]["step"]: t["_value"] for t in (b["completions"] for b in blobs if "completions" in b)}
    assert sorted(tables) == [1, 2], sorted(tables)
    for step in (1, 2):
        want = [math.nan if v is None else v for r in records for v in r["mdi"][step - 1]]  # rank order
        parquet = pd.read_parquet(out / "completions" / f"completions_{step:05d}.parquet")
        assert parquet["mdi"].tolist() == pytest.approx(want, nan_ok=True), step
        rows = tables[step]
        assert [number(r["mdi"]) for r in rows] == pytest.approx(want, nan_ok=True), step
        has_image = [not math.isnan(v) for v in want]
        assert [bool(r.get("image")) for r in rows] == has_image, (step, [r.get("image") for r in rows])
    assert [not math.isnan(number(r["mdi"])) for r in tables[2]] == [True] * 4 + [False] * 4


def zero3_families(script: str, out: Path, model_dirs: list[str], timeout: int = 900) -> list[dict]:
    """Launch tests/dist/<script> with 2 processes under ZeRO-3 on ``model_dirs``; the records it wrote to ``out``."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "cpu_zero3.yaml"), str(ROOT / "tests" / "dist" / script), str(out),
           *model_dirs]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.e2e  # minutes-long (a launch of 2 processes or a whole command): make test-e2e, which CI runs
@pytest.mark.distributed
@pytest.mark.slow
def test_every_family_under_zero3_in_one_launch(tiny_vlm_dir, tmp_path):
    """A plain GRPOConfig and default attention settings, 2 steps per family, weights sharded over 2 processes, and
    every step an image prompt on rank 0 and a text-only one on rank 1: the dummy vision pass works on every family
    under ZeRO-3 (a family it failed on would hang here and hit the timeout)."""
    from fixtures.tiny import TINY_ARCHS
    from trl_mdi.attention.model_facts import IMAGE_IN_EVERY_PROMPT, ZERO3_TRAINING_PROBLEMS

    # The families that cannot train under ZeRO-3 are refused at construction instead (tests/test_families.py).
    archs = [arch for arch in TINY_ARCHS if arch not in ZERO3_TRAINING_PROBLEMS]
    dirs = [str(tiny_vlm_dir(arch)) for arch in archs]
    records = zero3_families("train_families.py", tmp_path / "families.jsonl", dirs)
    for arch, path in zip(archs, dirs):
        ranks = sorted((r for r in records if r["model"] == path), key=lambda r: r["rank"])
        assert [r["rank"] for r in ranks] == [0, 1], arch
        for r in ranks:
            assert r["world_size"] == 2 and r["distributed_type"].endswith("DEEPSPEED"), (arch, r)
            assert 0.4 < r["local_param_fraction"] < 0.6, (arch, r["local_param_fraction"])  # really sharded
            # No reward reads attention: measured inside the sharded training forward, no extra forward.
            assert r["placement"] == "training_forward", (arch, r["placement"])
        # Rank 1 never had an image: it ran the pass (its generation prefill, each training forward); rank 0 never.
        # PaliGemma takes no prompt without an image: images on both ranks, no pass.
        rank1_passes = (lambda n: n == 0) if arch in IMAGE_IN_EVERY_PROMPT else (lambda n: n >= 4)
        assert ranks[0]["dummy_vision_passes"] == 0 and rank1_passes(ranks[1]["dummy_vision_passes"]), (arch, ranks)
        logs = ranks[0]["logs"]
        assert len(logs) == 2 and all(0 < h["attention/mdi"] < float("inf") for h in logs), (arch, logs)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.e2e  # one 2-process launch, 3 families trained and resumed: minutes on 2 cores
@pytest.mark.timeout(1800)
def test_zero3_resumes_from_deepspeeds_shards_on_each_family(tiny_vlm_dir, tmp_path):
    """Issue 42: under ZeRO-3 a resume loads DeepSpeed's own global_step*/ shards, not model.safetensors (the path
    transformers' conversion fault is on), on Qwen2.5-VL, LLaVA 1.5 and Gemma 3 (hybrid attention). The guard: the
    checkpoint's model.safetensors is overwritten with perturbed weights before the resume, and both processes still
    start from exactly the weights the first run trained (tests/dist/resume_families.py)."""
    archs = ["qwen2_5_vl", "llava", "gemma3"]
    dirs = [str(tiny_vlm_dir(arch)) for arch in archs]
    records = zero3_families("resume_families.py", tmp_path / "resume.jsonl", dirs, timeout=1500)
    for i, (arch, path) in enumerate(zip(archs, dirs)):
        ranks = sorted((r for r in records if r["model"] == path), key=lambda r: r["rank"])
        assert [r["rank"] for r in ranks] == [0, 1], arch
        perturbed = parameter_digest(AutoModelForImageTextToText.from_pretrained(tmp_path / f"run{i}" / "checkpoint-1"))
        for r in ranks:
            assert r["distributed_type"].endswith("DEEPSPEED") and r["global_step"] == 2, (arch, r)
            assert r["trained"] != r["base"] and r["trained"] != perturbed, (arch, r)  # three different weight sets
            assert r["resumed"] == r["trained"], (arch, r)  # the shards, exactly; not the safetensors copy
