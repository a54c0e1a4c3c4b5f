"""`make demo` end to end: what a newcomer runs first must learn, and its logs must show it.

Runs ``examples/demo.sh`` exactly as ``make demo`` does (warm-up, data, prep, 200 GRPO steps with 2 processes
under ZeRO-3 on CPU, held-out score, profile): 686 s on the 2-core machine of RESULTS.md's Demo record, less than
half that on a faster one. The figures the README quotes for the demo come from this script (recorded by
benchmarks/demo.py in benchmarks/RESULTS.md); this test holds it to what the README promises with margins (accuracy
after GRPO well above the warm-up's, the reward trend rising), not to the exact figures, which depend on the thread
count.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.e2e
@pytest.mark.timeout(1800)  # about 11 minutes on the slower 2-core machines (it runs alone: make test-e2e's serial half)
def test_make_demo_learns_and_its_logs_show_it(tmp_path):
    out, logs = tmp_path / "demo_run", tmp_path / "logs"
    env = {**os.environ, "PYTHON": sys.executable, "TRL_MDI_LOG_DIR": str(logs)}
    proc = subprocess.run(["bash", "examples/demo.sh", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    text = proc.stdout

    scores = [float(x) for x in re.findall(r"held-out greedy \(200 validation questions\).*?: accuracy ([0-9.]+)", text)]
    assert len(scores) == 2, text[-3000:]  # after the warm-up (step 1) and after GRPO (step 5)
    warm, trained = scores
    assert 0.35 <= warm <= 0.8, f"the warm-up should leave room for GRPO, got {warm}"
    assert trained >= 0.9 and trained - warm >= 0.25, (warm, trained)
    state = out / "grpo" / "checkpoint-200" / "trainer_state.json"
    assert state.is_file()

    # The answers stay in the asked format (issue 14: the lenient format reward let them drift to 'Answer" A'):
    # the final greedy answers and the last 20 steps' rollouts, by the format reward's own rule.
    clean = [float(x) for x in re.findall(r"held-out greedy \(200 validation questions\).*?, clean ([0-9.]+)", text)]
    assert len(clean) == 2 and clean[1] >= 0.9, clean
    import json

    history = [h for h in json.loads(state.read_text())["log_history"] if "completions/clean_format_frac" in h]
    first = [h["completions/clean_format_frac"] for h in history[:20]]
    last = [h["completions/clean_format_frac"] for h in history[-20:]]
    # Sampled at temperature 0.7 (examples/configs/demo.yaml), few rollouts are noise ('Answer:' then a stray byte,
    # which earns 0 format and 0 answer); issue 24's goal is 0.9 of the last 20 steps' rollouts in the asked format
    # (benchmarks/RESULTS.md records the run). The point is also no drift to paid junk.
    assert len(last) == 20 and sum(last) / 20 >= 0.9 and sum(last) / 20 >= sum(first) / 20 - 0.05, (first, last)

    # The live log the README tells a user to `tail -f`: the trend line of its last step spans the whole run.
    rollout_logs = sorted(logs.glob("rollout_results_*.md"))
    assert len(rollout_logs) == 1 and f"Markdown log:   {rollout_logs[0]}" in text
    last_trend = re.findall(r"^Mean reward trend: .*first 10% mean ([0-9.]+) → last 10% mean ([0-9.]+)",
                            rollout_logs[0].read_text(), flags=re.M)[-1]
    first, last = map(float, last_trend)
    assert last >= first + 0.5, f"mean weighted reward should rise over the demo: {first} -> {last}"
    assert len(list(logs.glob("attention_diagnostics_*_maps/*.png"))) >= 20

    # Step 6: the per-layer attention profile of the warm-started and the trained model on the held-out questions,
    # compared layer by layer, and where its pictures are.
    profile = json.loads((out / "profile" / "profile.json").read_text())
    assert [m["profile"]["rows"]["measured"] for m in profile["models"]] == [64, 64]
    assert profile["comparison"]["by"] == "layer" and (out / "profile" / "mdi_by_layer.png").stat().st_size > 10_000
    assert f"pictures:       {out}/profile/mdi_by_layer.png" in text

    # The reliance signals (examples/configs/demo.yaml: reliance_signals, a black counterfactual image): every step
    # logs them, the live log shows them per rollout with the image evidence in bold, and the answers come to depend
    # on the image (benchmarks/RESULTS.md recorded 1.555 -> 4.798 nats for the answer letter's visual gain).
    gains = [h["reliance/answer_visual_gain"] for h in json.loads(state.read_text())["log_history"]
             if "reliance/answer_visual_gain" in h]
    assert len(gains) == 200 and sum(gains[-20:]) / 20 >= sum(gains[:20]) / 20 + 1.0, (gains[:20], gains[-20:])
    log = rollout_logs[0].read_text()
    assert "**Reliance on the image** (counterfactual: a black image of the same size)" in log
    assert "| vis gain | ans gain | blind |" in log and "Blind agreement trend: " in log
    assert re.search(r"^\*\*Image evidence\*\* \(tokens at least 1 nat likelier with the image\): .*Answer: \*\*[ABCD]\*\*",
                     log, flags=re.M)
    assert f"reliance:       {rollout_logs[0]}" in text
    # The profile's reliance section: the image adds more accuracy over a black one after GRPO than before
    # (recorded: multimodal gain +0.328 -> +0.750).
    assert profile["settings"]["reliance"]["counterfactual_image"] == ["black"]
    gain = [m["reliance"]["summary"]["kinds"]["black"]["multimodal_gain"] for m in profile["models"]]
    assert gain[1] >= gain[0] + 0.2, gain
    assert "## Reliance on the image" in (out / "profile" / "profile.md").read_text()
