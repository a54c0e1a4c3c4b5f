"""The demo's figures, measured: runs ``examples/demo.sh`` (what ``make demo`` runs) and writes its numbers to the
"## Demo" section of benchmarks/RESULTS.md, where docs/demo.md and the README quote them from.

    .venv/bin/python -m benchmarks.demo [--work_dir demo_bench]

Recorded: the wall time of the whole demo and of its GRPO step, the demo's CPU time and the load average (the
machine may be shared); held-out greedy accuracy (and clean-format rate) after the warm-up and after GRPO; from the
training's ``trainer_state.json``, the means over the first and the last 20 steps of the weighted reward, sampled
accuracy (``mc_idx``), clean format, MDI, MDI balance, the answer reward's zero-spread fraction and the reliance
signals (visual gain, answer visual gain, blind agreement: the demo config turns them on, with a black
counterfactual image); from the closing profile, all-layer and late-layer MDI of both models and its reliance
section (accuracy with the image and with the counterfactual, multimodal gain, same answer without the image, the
signals' means). One run: the demo is seeded, but its figures move with the thread count and the machine
(tests/test_demo.py checks margins).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.results import replace_section, result_args

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Demo"
SCORE = re.compile(r"held-out greedy \(200 validation questions\).*?: accuracy ([0-9.]+), format [0-9.]+, "
                   r"clean ([0-9.]+)")
WINDOW = 20


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _window_means(history: list[dict], key: str) -> tuple[float, float]:
    # a metric undefined at a step (e.g. blind agreement with no answered rollout) is absent or NaN there
    values = [h[key] for h in history if h.get(key) is not None and not math.isnan(h[key])]
    if len(values) < 2 * WINDOW:
        raise SystemExit(f"trainer_state.json has {len(values)} logged values of {key}: need {2 * WINDOW}")
    return _mean(values[:WINDOW]), _mean(values[-WINDOW:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work_dir", type=Path, default=ROOT / "demo_bench",
                        help="where the demo writes its models, data and logs (replaced)")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    args = parser.parse_args(argv)
    work = args.work_dir.resolve()
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable), "TRL_MDI_LOG_DIR": str(work / "logs")}
    load_start = os.getloadavg()[0]
    started = time.perf_counter()
    lines: list[str] = []
    with subprocess.Popen(["bash", "examples/demo.sh", str(work)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        marks: dict[str, float] = {}
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
            if line.startswith("== 4/6") or line.startswith("== 5/6"):
                marks[line[3:6]] = time.perf_counter()
    if proc.returncode != 0:
        raise SystemExit(f"examples/demo.sh failed (exit {proc.returncode})")
    total = time.perf_counter() - started
    # user + system seconds of every process the demo ran (waited for): unlike the wall time, barely moved by other
    # jobs sharing the cores
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = children.ru_utime + children.ru_stime
    grpo = marks["5/6"] - marks["4/6"]
    text = "".join(lines)
    scores = SCORE.findall(text)
    if len(scores) != 2:
        raise SystemExit(f"expected two held-out scores in the demo's output, found {len(scores)}")
    (warm_acc, warm_clean), (trained_acc, trained_clean) = [(float(a), float(c)) for a, c in scores]
    checkpoint = max((work / "grpo").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    windows = {label: _window_means(history, key) for label, key in (
        ("weighted reward", "reward"), ("sampled accuracy (mc_idx reward)", "rewards/mc_idx/mean"),
        ("clean format (sampled)", "completions/clean_format_frac"), ("MDI (all layers)", "attention/mdi"),
        ("MDI balance (attention/mdi_balance)", "attention/mdi_balance"),
        ("MDI balance reward", "rewards/mdi_balance/mean"),
        ("answer reward zero-spread fraction", "rewards/mc_idx/zero_spread_frac"),
        ("visual gain (reliance/visual_gain, nats per token)", "reliance/visual_gain"),
        ("answer visual gain (reliance/answer_visual_gain, nats)", "reliance/answer_visual_gain"),
        ("blind agreement (reliance/blind_agree_rate)", "reliance/blind_agree_rate"))}
    profile = json.loads((work / "profile" / "profile.json").read_text())
    segs = [m["profile"]["segments"] for m in profile["models"]]
    rows = [f"| {label} | {a:.3f} | {b:.3f} |" for label, (a, b) in windows.items()]
    kinds = (profile["settings"]["reliance"] or {}).get("counterfactual_image") or []
    if len(kinds) != 1 or any(not m.get("reliance") for m in profile["models"]):
        raise SystemExit(f"the closing profile has no reliance section with one counterfactual kind (got {kinds}): "
                         "examples/demo.sh's trl_mdi.profile step needs --reliance")
    kind = kinds[0]
    reliance = [m["reliance"]["summary"]["kinds"][kind] for m in profile["models"]]
    reliance_rows = [f"| {label} | " + " | ".join(fmt.format(get(r)) for r in reliance) + " |" for label, get, fmt in (
        ("accuracy, image", lambda r: r["accuracy_image"], "{:.3f}"),
        ("accuracy, counterfactual (the blind answer)", lambda r: r["accuracy_counterfactual"], "{:.3f}"),
        ("multimodal gain", lambda r: r["multimodal_gain"], "{:+.3f}"),
        ("same answer without the image", lambda r: r["same_answer_rate"], "{:.3f}"),
        ("visual_gain mean (nats per token)", lambda r: r["means"]["visual_gain"], "{:+.4f}"),
        ("answer_visual_gain mean (nats)", lambda r: r["means"]["answer_visual_gain"], "{:+.3f}"),
        ("blind_agrees rate", lambda r: r["means"]["blind_agrees"], "{:.3f}"))]
    flags = "".join(" " + a for a in result_args(sys.argv[1:] if argv is None else list(argv),
                                                  ("--work_dir", "--results")))
    body = "\n".join([
        SECTION,
        "",
        f"Reproduce: `.venv/bin/python -m benchmarks.demo{flags}` (runs `examples/demo.sh`, what `make demo` runs, "
        "with `.venv` installed).",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"load average (1 min) at the start {load_start:.2f}, at the end {os.getloadavg()[0]:.2f}.",
        f"- Wall time: {total:.0f} s for the whole demo, {grpo:.0f} s of it the GRPO step (200 steps, 2 processes, "
        f"ZeRO-3 on CPU) with its launch; {cpu:.0f} s of CPU time (user + system, all its processes).",
        f"- Held-out greedy accuracy, 200 validation questions: {warm_acc:.3f} after the warm-up (clean format "
        f"{warm_clean:.2f}), {trained_acc:.3f} after GRPO (clean format {trained_clean:.2f}).",
        f"- Closing profile, 64 held-out questions, greedy answers: all-layer MDI {segs[0]['all']['mdi']:.3f} after "
        f"the warm-up, {segs[1]['all']['mdi']:.3f} after GRPO; late layers {segs[0]['late']['mdi']:.3f} to "
        f"{segs[1]['late']['mdi']:.3f}.",
        "",
        f"| training log, mean over steps | first {WINDOW} | last {WINDOW} |",
        "|---|---:|---:|",
        *rows,
        "",
        # not "Closing profile...": docs cite the bullet above as the one line starting so
        f"The closing profile's reliance section (`--reliance`, counterfactual `{kind}`), on the greedy answers to "
        "the 64 held-out questions:",
        "",
        "| profile, reliance on the image | after the warm-up | after GRPO |",
        "|---|---:|---:|",
        *reliance_rows,
        "",
    ])
    replace_section(SECTION, body, args.results)
    print(f"wrote the '{SECTION}' section of {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
