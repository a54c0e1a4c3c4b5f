"""The trainer's own forwards under FSDP2 (torch's ``fully_shard``) on a 2-process CPU mesh (gloo): the probe, the
counterfactual's forward and choice-letter logits (the LM head's rows read outside the forward, where the head is a
sharded DTensor), and the dummy vision pass, each against an unsharded copy (``tests/dist/fsdp2_forwards.py`` says
how). accelerate engages FSDP only on GPUs, so the trainer itself is not launched under FSDP2 here
(``accelerate_configs/fsdp2.yaml``: not yet run on a GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.e2e
def test_the_trainers_forwards_under_fully_shard_equal_the_unsharded_models(tiny_vlm_dir, tmp_path):
    from fixtures.testing import free_port

    out = tmp_path / "fsdp2.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "tests" / "dist" / "fsdp2_forwards.py"), str(tiny_vlm_dir("qwen2_5_vl")), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == [0, 1]
    for r in records:
        # Really sharded: every parameter a DTensor, the LM head included.
        assert r["head_is_dtensor"] and r["dtensor_params"] == r["params"], r
        assert r["probe"] < 1e-6 and 0 < r["probe_mean_image_mass"] < 1, r
        assert r["choice_logits"] < 1e-5 and r["choice_logits_finite"] == 5, r  # 3 + 2 candidates, one -1
        assert r["choice_logits_type"] == "Tensor", r  # not a DTensor leaking into the signals
        # accelerate's wrap keeps the head unsharded after a forward; a tail that reshards leaves a sharded DTensor,
        # which choice_logits makes whole (before: "mixed torch.Tensor and DTensor")
        assert not r["head_sharded_at_read"] and r["head_sharded_at_read_resharded"], r
        assert "choice_logits_resharded_error" not in r, r
        assert r["choice_logits_resharded"] < 1e-5 and r["choice_logits_resharded_type"] == "Tensor", r
        assert r["counterfactual_logps"] < 1e-5, r
        # The dummy vision pass: ran once, left the loss and the (rank-averaged) gradients as they were, and gave
        # every vision parameter a zero gradient.
        assert r["vision_pass_count"] == 1 and r["vision_pass_loss"] < 1e-6 and r["vision_pass_grad"] < 1e-6, r
        assert r["vision_grads_present"] > 0 and r["vision_grads_max"] == 0.0 and r["text_grads_compared"] > 0, r
    assert records[0]["probe_mean_image_mass"] != records[1]["probe_mean_image_mass"]  # each rank its own rows
