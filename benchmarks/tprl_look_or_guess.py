"""TPRL on look or guess with conflict rows (issue 44): does TPRL push a policy toward the image where the answer
reward sometimes tells looking from guessing? Four commands, each pinning the float path before torch is imported
(``benchmarks.environment``; ``--float_path native`` to run unpinned):

    .venv/bin/python -m benchmarks.tprl_look_or_guess warmup --work_dir DIR
        # the long-chain warm-up (rule D1), its check on the development split and its weights' SHA-256
    .venv/bin/python -m benchmarks.tprl_look_or_guess dev --work_dir DIR
        # the development-split choices (rules D1-D5 of benchmarks/tprl_design.py): record and summary
    .venv/bin/python -m benchmarks.tprl_look_or_guess experiment --work_dir DIR --warmup_sha256 HASH \\
        --steps N --pool_conflict_rate R --learning_rate LR --perturbation KIND --attention_segment SEG \\
        --seeds 200 ... 215
        # every (arm, seed) run of the plan, resumable: one JSON record per run in DIR/runs
    .venv/bin/python -m benchmarks.tprl_look_or_guess report --work_dir DIR
        # the results from the records, written below the plan's closing line in benchmarks/RESULTS.md

The parts: ``tprl_design`` (settings, arms, GRPO config, keys, development rules), ``tprl_dev`` (the warm-up's
signals for D2 and D3), ``tprl_runs`` (one run and its record), ``tprl_report`` (the results and their tests),
``environment`` (pins, environment records, weights hash). This script wires them: read it top to bottom.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.environment import FLOAT_PATHS, PINNED, check_weights, environment_key, pin_float_path

DEFAULT_WORK = Path("/tmp/trl_mdi_tprl_look_or_guess")


def _setup(a: argparse.Namespace):
    """Pin the float path (before torch), then import what the commands need; returns the log function."""
    pin_float_path(a.threads, a.float_path)
    from benchmarks.results import set_offline_env

    set_offline_env()
    import transformers

    from benchmarks.environment import apply_torch_pins

    apply_torch_pins(a.threads, a.float_path)
    transformers.logging.set_verbosity_error()
    started = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - started:7.1f} s] {msg}", flush=True)

    log.started = started
    return log


def _environment():
    from benchmarks.environment import environment_record

    record = environment_record()
    return record, environment_key(record)


def _recipe(a: argparse.Namespace, epochs: int | None = None):
    from benchmarks.look_or_guess_task import look_or_guess_recipe
    from fixtures.synthetic.look_or_guess import LOOK_OR_GUESS_LONG

    return look_or_guess_recipe(epochs=epochs or a.warmup_epochs, kind=LOOK_OR_GUESS_LONG)


def warmup(a: argparse.Namespace, log, epochs: int | None = None, check: bool = True) -> dict:
    """The warm-up of ``epochs`` (default ``--warmup_epochs``) in the work dir (reused when its folder exists: the
    folder is keyed by the recipe and the environment), its weights' hash, and with ``check`` its warm-up check on
    200 validation prompts x 4 samples. Returns ``{"model_dir", "info", "check"}``."""
    from benchmarks.look_or_guess_task import Settings, held_out_rows, shared_warmup, warmup_check, warmup_dir
    from fixtures.synthetic.look_or_guess import LONG_MAX_COMPLETION_LENGTH, LOOK_OR_GUESS_LONG

    recipe = _recipe(a, epochs)
    record, env_key = _environment()
    work = Path(a.work_dir)
    model, processor, info = shared_warmup(recipe, work, log, environment=env_key)
    out = {"model_dir": str(warmup_dir(recipe, work, env_key)), "info": info, "epochs": recipe.epochs}
    if check:
        path = Path(out["model_dir"]) / "check.json"
        if path.exists():
            out["check"] = json.loads(path.read_text())
        else:
            s = Settings(n_eval=200, samples=4, seed=0, counterfactual="none",
                         max_new_tokens=LONG_MAX_COMPLETION_LENGTH)
            result = warmup_check(model, processor, held_out_rows(recipe, s), s, log, kind=LOOK_OR_GUESS_LONG)
            result.pop("rollouts")
            out["check"] = result
            from benchmarks.look_or_guess_runs import write_json

            write_json(path, result)
    return out


def cmd_warmup(a: argparse.Namespace) -> int:
    log = _setup(a)
    w = warmup(a, log)
    from benchmarks.tprl_report import warmup_summary

    print("\n" + warmup_summary(w))
    return 0


# ------------------------------------------------------------------------------------ development


def _jobs(a, s, arms_seeds, *, model_dir, recipe, warmup_sha, work: Path, code, log, evaluate_end=True,
          reuse_other_code=False, prefix: str = "") -> tuple[list[dict], dict]:
    """The jobs of ``arms_seeds`` not finished yet in ``work`` (a record with the same key and, unless
    ``reuse_other_code``, the same code version), and the finished records by label (``prefix`` + arm-seed)."""
    from benchmarks.look_or_guess_runs import code_label
    from benchmarks.tprl_design import ARMS, run_key

    _, env_key = _environment()
    (work / "runs").mkdir(parents=True, exist_ok=True)
    jobs, done = [], {}
    for arm, seed in arms_seeds:
        label = f"{prefix}{arm}-s{seed}"
        path = work / "runs" / f"{arm}-s{seed}.json"
        key = run_key(s, ARMS[arm], seed, env_key, warmup_sha)
        rec = json.loads(path.read_text()) if path.exists() else None
        if rec is not None and rec.get("key") == key and (reuse_other_code or
                                                          code_label(rec.get("code")) == code_label(code)):
            done[label] = rec
            continue
        if rec is not None:
            log(f"  {label}: a record of other {'settings' if rec.get('key') != key else 'code'} "
                f"({code_label(rec.get('code'))}): rerun")
        jobs.append({"arm": arm, "seed": seed, "settings": s, "recipe": recipe, "model_dir": Path(model_dir),
                     "work": work, "path": path, "key": key, "float_path": a.float_path,
                     "warmup_sha256": warmup_sha, "code": code, "threads": a.threads, "started": log.started,
                     "label": label, "evaluate_end": evaluate_end})
    return jobs, done


def _run(jobs: list[dict], workers: int) -> dict:
    from benchmarks.results import run_pool
    from benchmarks.tprl_runs import execute

    return {label: rec for label, (rec, _err) in run_pool(jobs, execute, workers).items() if rec is not None}


def cmd_dev(a: argparse.Namespace) -> int:
    """Rules D1-D5 (``benchmarks/tprl_design.py``) in order, each step's record kept in the work dir (resumable):
    the warm-up (the first epoch count meeting every goal), the perturbation and segment, the timing pilot, the
    baseline at each candidate rate; then ``dev.json`` and the Markdown summary."""
    log = _setup(a)
    import dataclasses

    from benchmarks.look_or_guess_runs import code_label, code_version, write_json
    from benchmarks.tprl_design import (
        DEV_SEEDS,
        LR_CANDIDATES,
        PILOT_STEPS,
        RATE_CANDIDATES,
        TprlSettings,
        pick_learning_rate,
        pick_rate,
        projected_hours,
        settings_dict,
        steps_for_budget,
    )
    from benchmarks.tprl_report import dev_summary

    work = Path(a.work_dir)
    dev_dir = work / "dev"
    dev_dir.mkdir(parents=True, exist_ok=True)
    code = code_version()
    log(f"work dir {work}; code {code_label(code)}; float path {a.float_path}")
    record: dict = {"code": code, "environment": _environment()[0], "dev_seeds": list(DEV_SEEDS)}

    # D1: the warm-up, the first of 8, 12, 16 epochs meeting every goal of the check.
    tried = []
    for epochs in (8, 12, 16):
        w = warmup(a, log, epochs)
        goals = w["check"]["goals"]
        tried.append({"epochs": epochs, "goals": goals, "sha256": w["info"]["weights_sha256"]})
        log(f"D1: {epochs} epochs: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in goals.items()))
        if all(goals.values()):
            break
    record["warmup"] = {"tried": tried, "chosen_epochs": w["epochs"], "sha256": w["info"]["weights_sha256"],
                        "model_dir": w["model_dir"], "check": w["check"], "info": w["info"]}
    model_dir, warmup_sha = Path(w["model_dir"]), w["info"]["weights_sha256"]
    recipe = _recipe(a, int(w["epochs"]))

    # D2, D3: the perturbation and the attention segment, on the warm-up's rollouts of the development split.
    s = TprlSettings(eval_split="dev")
    path = dev_dir / f"signals-{warmup_sha[:12]}.json"
    if path.exists():
        signals = json.loads(path.read_text())
    else:
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        from benchmarks.tprl_dev import develop_signals
        from fixtures.warmup import synthetic_dataset

        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        processor = AutoProcessor.from_pretrained(model_dir)
        ds = synthetic_dataset(a.n_dev, split="validation", seed=recipe.data_seed, kinds=recipe.kinds,
                               option_order=recipe.option_order, image_size=recipe.image_size, conflict_rate=0.5)
        signals = develop_signals(model, processor, ds, s, samples=a.dev_samples, log=log)
        write_json(path, signals)
        del model
    record["signals"] = signals
    s.perturbation, s.attention_segment = signals["perturbation"], signals["segment"]

    # D0: the learning rate, the largest whose A pilot keeps the chains in the two styles (one run at a time).
    warm_neither = w["check"]["sampled"]["all"]["other_rate"]
    tried = {}
    for lr in LR_CANDIDATES:
        pl = TprlSettings(**{**dataclasses.asdict(s), "steps": PILOT_STEPS, "eval_mid": False, "learning_rate": lr})
        jobs, done = _jobs(a, pl, [("A", DEV_SEEDS[0])], model_dir=model_dir, recipe=recipe, warmup_sha=warmup_sha,
                           work=dev_dir / f"pilot-lr{lr:g}", code=code, log=log)
        done |= _run(jobs, 1)
        rec = next(iter(done.values()))
        tried[lr] = {"final": rec["final"], "look_rate": [x.get("rewards/long_look_rate/mean") for x in rec["steps"]],
                     "examples": rec["eval"]["examples"]}
        log(f"D0: lr {lr:g}: neither {rec['final']['neither']:.3f}, conflict {rec['final']['conflict']:.3f}")
        if pick_learning_rate({lr: rec["final"]["neither"]}, warm_neither)[0] == lr:
            break
    s.learning_rate, why_lr = pick_learning_rate({lr: v["final"]["neither"] for lr, v in tried.items()}, warm_neither)
    record["learning_rate"] = {"chosen": s.learning_rate, "why": why_lr, "warmup_neither": warm_neither,
                               "tried": {f"{lr:g}": v for lr, v in tried.items()}}
    log(f"D0: learning rate {s.learning_rate:g} ({why_lr})")

    # D4: the timing pilot (A and T, PILOT_STEPS steps, seed 900, one evaluation at the end of A), then the steps.
    pilot = TprlSettings(**{**dataclasses.asdict(s), "steps": PILOT_STEPS, "eval_mid": False})
    jobs, done = _jobs(a, pilot, [("A", DEV_SEEDS[0]), ("T", DEV_SEEDS[0])], model_dir=model_dir, recipe=recipe,
                       warmup_sha=warmup_sha, work=dev_dir / f"pilot-lr{s.learning_rate:g}", code=code, log=log)
    for j in jobs:
        j["evaluate_end"] = j["arm"] == "A"
    done |= _run(jobs, 1)  # one at a time: the pilot measures a run's own time, not two runs sharing the CPU
    timing = _timing(done)
    record["pilot"] = {"settings": settings_dict(pilot), **timing}
    s.steps = steps_for_budget(timing["step_seconds"], timing["eval_seconds"], timing["overhead_seconds"])
    record["steps"] = {"chosen": s.steps, "projected_hours": projected_hours(
        s.steps, timing["step_seconds"], timing["eval_seconds"], timing["overhead_seconds"])}
    log(f"D4: steps {s.steps} (projected {record['steps']['projected_hours']:.2f} h for 80 runs on 2 workers)")

    # D5: A at those steps on the development seeds at each candidate rate, evaluated on the development split.
    by_rate = {}
    for rate in RATE_CANDIDATES:
        sr = TprlSettings(**{**dataclasses.asdict(s), "pool_conflict_rate": rate})
        jobs, done = _jobs(a, sr, [("A", seed) for seed in DEV_SEEDS], model_dir=model_dir, recipe=recipe,
                           warmup_sha=warmup_sha, work=dev_dir / f"rate-{rate:g}", code=code, log=log,
                           prefix=f"rate {rate:g} ")
        by_rate[rate] = (sr, jobs, done)
    all_jobs = [j for _, jobs, _ in by_rate.values() for j in jobs]
    log(f"D5: {len(all_jobs)} baseline run(s) to run on {a.workers} worker(s)")
    finished = _run(all_jobs, a.workers) if all_jobs else {}
    rates = {}
    for rate, (_, jobs, done) in by_rate.items():
        runs = list(done.values()) + [finished[j["label"]] for j in jobs if j["label"] in finished]
        rates[rate] = {"runs": [_dev_run(r) for r in sorted(runs, key=lambda r: r["seed"])]}
        finals = [r["final"]["conflict"] for r in runs if r.get("final")]
        rates[rate]["mean_conflict"] = statistics.fmean(finals) if finals else float("nan")
    rate, why = pick_rate({r: v["mean_conflict"] for r, v in rates.items()})
    s.pool_conflict_rate = rate
    record["rates"] = {f"{r:g}": v for r, v in rates.items()}
    record["rate"] = {"chosen": rate, "why": why}
    record["settings"] = settings_dict(s)
    write_json(work / "dev.json", record)
    summary = dev_summary(record)
    print("\n" + summary)
    if a.summary:
        Path(a.summary).write_text(summary)
        print(f"wrote {a.summary}")
    return 0


def _timing(done: dict) -> dict:
    """Rule D4's figures from the pilot's records: CPU seconds per training step (median over steps after the first,
    per arm), per evaluation, and the rest of a run (set-up, model load, TRL's first step beyond the median), each
    the run's own process on one thread; the wall-clock figures beside (longer on a machine other jobs load)."""
    step, wall_step = {}, {}
    for rec in done.values():
        step[rec["arm"]] = statistics.median(rec["step_cpu_seconds"][1:] or rec["step_cpu_seconds"])
        wall_step[rec["arm"]] = statistics.median(rec["step_seconds"][1:] or rec["step_seconds"])
    evals = [e for rec in done.values() for e in rec.get("eval_cpu_seconds", [])]
    overhead = [rec["cpu_seconds"] - step[rec["arm"]] * len(rec["step_cpu_seconds"]) - sum(rec["eval_cpu_seconds"])
                for rec in done.values()]
    return {"step_seconds": step, "eval_seconds": max(evals) if evals else 60.0,
            "overhead_seconds": max(overhead) if overhead else 30.0, "wall_step_seconds": wall_step,
            "wall_eval_seconds": [e for rec in done.values() for e in rec.get("eval_seconds", [])],
            "wall_seconds": {rec["arm"]: rec["wall_seconds"] for rec in done.values()},
            "cpu_seconds": {rec["arm"]: rec["cpu_seconds"] for rec in done.values()},
            "load": {rec["arm"]: rec.get("load") for rec in done.values()}}


def _dev_run(rec: dict) -> dict:
    """What the development record keeps of one baseline run: its final and midpoint outcomes, the look rate per
    step, its times."""
    return {"seed": rec["seed"], "final": rec.get("final"), "mid": (rec.get("mid") or {}).get("outcomes"),
            "look_rate": [x.get("rewards/long_look_rate/mean") for x in rec["steps"]],
            "grpo_seconds": rec["grpo_seconds"], "wall_seconds": rec["wall_seconds"],
            "eval_seconds": rec.get("eval_seconds"), "load": rec.get("load")}


# ------------------------------------------------------------------------------------ the plan's runs


def cmd_experiment(a: argparse.Namespace) -> int:
    """Every (arm, seed) run of the plan from the warm-up whose weights hash to ``--warmup_sha256`` (a different
    warm-up is refused unless ``--allow_other_warmup``), 2 workers, resumable: a finished record with the same key
    (settings, arm, seed, environment, warm-up hash) and code version is kept, any other is rerun."""
    log = _setup(a)
    from benchmarks.look_or_guess_runs import code_label, code_version
    from benchmarks.tprl_design import ARM_NAMES, TprlSettings

    missing = [f"--{n}" for n in ("steps", "pool_conflict_rate", "learning_rate", "perturbation", "attention_segment",
                                  "seeds") if getattr(a, n) in (None, [])]
    if missing or (a.warmup_sha256 is None and not a.allow_other_warmup):
        raise SystemExit(f"experiment: give {', '.join(missing + ([] if a.warmup_sha256 else ['--warmup_sha256']))} "
                         "(the plan's values: nothing is left to a default)")
    unknown = [x for x in a.arms if x not in ARM_NAMES]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; choose from {ARM_NAMES}")
    code = code_version()
    if code.get("dirty"):
        log(f"WARNING: the working tree differs from commit {code['commit'][:12]} (diff {code['diff']}): the records "
            "will say so; the plan's runs belong to a clean commit")
    w = warmup(a, log, check=False)
    sha = check_weights(w["info"]["weights_sha256"], a.warmup_sha256, allow_other=a.allow_other_warmup)
    s = TprlSettings(steps=a.steps, pool_conflict_rate=a.pool_conflict_rate, learning_rate=a.learning_rate,
                     perturbation=a.perturbation, attention_segment=a.attention_segment, eval_split="test")
    pairs = [(arm, seed) for seed in a.seeds for arm in a.arms]
    jobs, done = _jobs(a, s, pairs, model_dir=w["model_dir"], recipe=_recipe(a), warmup_sha=sha,
                       work=Path(a.work_dir), code=code, log=log, reuse_other_code=a.reuse_other_code)
    log(f"code {code_label(code)}; warm-up {sha[:12]}; {len(done)} run(s) finished earlier, {len(jobs)} to run on "
        f"{a.workers} worker(s)")
    finished = _run(jobs, a.workers) if jobs else {}
    failed = [j["label"] for j in jobs if j["label"] not in finished]
    log(f"finished {len(done) + len(finished)} of {len(pairs)}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def cmd_report(a: argparse.Namespace) -> int:
    """The results below the plan's closing line in ``--results``, from every record in ``--work_dir/runs`` (each
    record's code version, environment and warm-up hash named)."""
    from benchmarks.tprl_report import load_runs, report, write_results

    runs = load_runs(Path(a.work_dir))
    results = Path(a.results)
    body = report(runs, results, workers=a.workers)
    print(body)
    if not a.no_write:
        write_results(results, body)
        print(f"wrote the results below the plan in {results}")
    return 0


# ------------------------------------------------------------------------------------ reproducibility


REPRO_VARIANTS = {
    "pinned": ("pinned", {}),
    "pinned, again": ("pinned", {}),
    "native": ("native", {}),
    "native, ATEN_CPU_CAPABILITY=default": ("native", {"ATEN_CPU_CAPABILITY": "default"}),
}
"""The repro command's jobs: each a fresh process (float path, extra environment variables)."""


def cmd_repro_job(a: argparse.Namespace) -> int:
    """One short job in this (fresh) process, for ``repro``: a small long-chain warm-up (48 rows, 1 epoch), then 3
    GRPO steps of arm T from it (the perturbed forward, both filters and the multipliers), no evaluation. Writes
    ``--out``: the warm-up's and the trained weights' SHA-256, a SHA-256 of every logged step, the environment."""
    log = _setup(a)
    import dataclasses
    import hashlib
    import tempfile

    from benchmarks.environment import environment_record, weights_sha256
    from benchmarks.look_or_guess_runs import write_json
    from benchmarks.tprl_design import TprlSettings
    from benchmarks.tprl_runs import pool_rows, run_one
    from fixtures.warmup import LookOrGuessRecipe, warm_start

    work = Path(tempfile.mkdtemp(prefix="tprl_repro_"))
    recipe = LookOrGuessRecipe(kinds=(_recipe(a).kinds[0],), n_train=48, epochs=1.0)
    warm_start(recipe, work / "warm", log=log)
    s = TprlSettings(steps=3, eval_mid=False, pool_conflict_rate=0.25, perturbation="patch_blackening")
    run = run_one("T", 0, work / "warm", pool_rows(recipe, s), None, s, work, log, evaluate_end=False,
                  save_to=work / "trained")
    steps = json.dumps(run["steps"], sort_keys=True).encode()
    out = {"warmup_sha256": weights_sha256(work / "warm"), "trained_sha256": weights_sha256(work / "trained"),
           "steps_sha256": hashlib.sha256(steps).hexdigest(), "environment": environment_record(),
           "settings": dataclasses.asdict(s), "steps": run["steps"]}
    write_json(Path(a.out), out)
    log(f"warm-up {out['warmup_sha256'][:16]}, trained {out['trained_sha256'][:16]}, steps {out['steps_sha256'][:16]}")
    return 0


def cmd_repro(a: argparse.Namespace) -> int:
    """Reproducibility, shown: the same short job (:func:`cmd_repro_job`) in a fresh process per entry of
    :data:`REPRO_VARIANTS` (pinned twice; unpinned, i.e. this machine's own kernels; unpinned with torch's CPU
    capability forced to another level), and the hashes compared. ``--compare FILE ...``: also list the results of
    the same job run elsewhere (a fresh clone, another machine)."""
    import os
    import subprocess

    work = Path(a.work_dir) / "repro"
    work.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, (float_path, extra) in REPRO_VARIANTS.items():
        out = work / f"{name.replace(', ', '-').replace('=', '-').replace(' ', '_')}.json"
        env = {**os.environ, **extra}
        cmd = [sys.executable, "-m", "benchmarks.tprl_look_or_guess", "repro-job", "--out", str(out),
               "--float_path", float_path, "--work_dir", a.work_dir]
        print(f"== {name}: {' '.join(cmd[1:])}" + (f" with {extra}" if extra else ""), flush=True)
        subprocess.run(cmd, env=env, check=True, cwd=Path(__file__).resolve().parent.parent)
        rows[name] = json.loads(out.read_text())
    for path in a.compare or []:
        rows[f"elsewhere: {path}"] = json.loads(Path(path).read_text())
    print("\n| job | float path | torch CPU capability | warm-up sha256 | trained sha256 | logged steps sha256 |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        e = r["environment"]
        print(f"| {name} | {e['float_path']} | {e.get('torch_cpu_capability')} | `{r['warmup_sha256'][:16]}` | "
              f"`{r['trained_sha256'][:16]}` | `{r['steps_sha256'][:16]}` |")
    pinned = [r for n, r in rows.items() if r["environment"]["float_path"] == PINNED]
    same = len({(r["warmup_sha256"], r["trained_sha256"], r["steps_sha256"]) for r in pinned}) == 1
    print(f"\npinned jobs bit-identical: {same} ({len(pinned)} jobs)")
    return 0 if same else 1


COMMANDS = {"warmup": cmd_warmup, "dev": cmd_dev, "experiment": cmd_experiment, "report": cmd_report,
            "repro": cmd_repro, "repro-job": cmd_repro_job}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from benchmarks.results import RESULTS

    p = argparse.ArgumentParser(prog="python -m benchmarks.tprl_look_or_guess", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=list(COMMANDS))
    p.add_argument("--work_dir", default=str(DEFAULT_WORK), help=f"warm-up, records (default {DEFAULT_WORK})")
    p.add_argument("--float_path", choices=FLOAT_PATHS, default=PINNED,
                   help="pinned (default): CPU kernels at AVX2, MKL_CBWR=COMPATIBLE, deterministic algorithms; "
                   "native: whatever this machine picks (recorded as such)")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP / MKL threads per process (default 1)")
    p.add_argument("--workers", type=int, default=2, help="runs at a time, each in its own process (default 2)")
    p.add_argument("--warmup_epochs", type=int, default=8, help="the warm-up's SFT epochs (rule D1's choice)")
    d = p.add_argument_group("dev")
    d.add_argument("--n_dev", type=int, default=100, help="development prompts of D2/D3 (default 100)")
    d.add_argument("--dev_samples", type=int, default=8, help="rollouts per development prompt (default 8)")
    d.add_argument("--summary", help="also write the Markdown summary here")
    e = p.add_argument_group("experiment (every value is the plan's; none has a default)")
    e.add_argument("--warmup_sha256", help="the plan's warm-up weights hash (12 hex digits or more)")
    e.add_argument("--allow_other_warmup", action="store_true", help="train from a warm-up with another hash")
    e.add_argument("--steps", type=int)
    e.add_argument("--pool_conflict_rate", type=float)
    e.add_argument("--learning_rate", type=float)
    e.add_argument("--perturbation", help="TPRL's perturbation (T and P)")
    e.add_argument("--attention_segment", help="the attention signal's layer segment (T_att)")
    e.add_argument("--seeds", type=int, nargs="+")
    e.add_argument("--arms", nargs="+", default=["A", "T", "T_att", "P", "M"])
    e.add_argument("--reuse_other_code", action="store_true",
                   help="keep finished records made by another code version (default: rerun them)")
    x = p.add_argument_group("repro / repro-job")
    x.add_argument("--out", help="repro-job: where its JSON goes")
    x.add_argument("--compare", nargs="+", help="repro: results of the same job run elsewhere (JSON files)")
    r = p.add_argument_group("report")
    r.add_argument("--results", default=str(RESULTS))
    r.add_argument("--no-write", dest="no_write", action="store_true", help="print the results only")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    return COMMANDS[a.command](a)


if __name__ == "__main__":
    sys.exit(main())
