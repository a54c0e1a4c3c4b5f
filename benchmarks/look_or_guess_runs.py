"""Look or guess (issue 30), one job of the experiment: a GRPO run of one variant and seed from the warm-up (its
per-step logs, held-out figures and detection records), or the warm-up's own figures; the JSON they are saved as,
stamped with the code version they came from.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

from benchmarks import results
from benchmarks.callbacks import EvaluateEvery, at
from benchmarks.look_or_guess_evaluation import detection_records, evaluate_styles, headline
from benchmarks.look_or_guess_task import colour_word_gains, held_out_test_rows, pool_rows, score_rollouts
from benchmarks.look_or_guess_variants import GUARDED, PLACEBO, RELIANCE, ExperimentSettings
from benchmarks.variants import grpo_config


def code_version(root: Path = results.ROOT) -> dict:
    """The code a result came from (``results.code_version``: ``commit``, ``dirty``, ``diff``) over the paths that
    decide a result here: trl_mdi/, fixtures/, benchmarks/, pyproject.toml."""
    return results.code_version(paths=("trl_mdi", "fixtures", "benchmarks", "pyproject.toml"), root=root)


def code_label(code: dict | None) -> str:
    """``abc123def456`` or ``abc123def456+dirty(diff 1a2b3c)``."""
    if not code or not code.get("commit"):
        return "unknown"
    return code["commit"][:12] + (f"+dirty(diff {code['diff']})" if code.get("dirty") else "")


def write_json(path: Path, data: dict) -> None:
    """``data`` as JSON at ``path`` (``results.write_json``: whole or not at all), NaN as null, keys as strings."""
    results.write_json(path, clean_json(data))


def clean_json(x):
    """``x`` with every NaN float as None and every dict key as a string: what JSON can hold."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {str(k): clean_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean_json(v) for v in x]
    return x


# ------------------------------------------------------------------------------------ GRPO runs


LOGGED = ("reward", "rewards/", "reliance/", "tprl/", "attention/mdi", "completions/mean_length",
          "completions/clipped_ratio", "entropy")


def step_log(run: dict, evaluate, mid: int | None) -> EvaluateEvery:
    """Each step's logged metrics (``rewards/look_rate/mean`` among them) and time into ``run``; with ``mid`` the
    held-out figures at that step (``evaluate(model)``: :func:`evaluate_styles`; their time kept out of the training
    time)."""

    def evaluate_mid(model, step: int, elapsed: float) -> float:
        ev = evaluate(model)
        run["mid"] = {"step": step, **headline(ev)}
        return ev["seconds"]

    def record_step(step: int, logs: dict) -> None:
        run["steps"].append({"step": step, **{k: v for k, v in logs.items() if k.startswith(LOGGED)}})

    return EvaluateEvery(evaluate_mid, at(mid), step_seconds=run["step_seconds"], record_step=record_step)


def run_one(name: str, variant, seed: int, model_dir: Path, pool, test, s: ExperimentSettings, work: Path,
            log) -> dict:
    """One GRPO run from the warm-up: per-step logs, the held-out figures at the end (and midway with
    ``s.eval_mid``), and with ``seed`` in ``s.detect_seeds`` the detection records of the trained model."""
    from transformers import AutoProcessor
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from trl_mdi.diagnostics import ConsoleSummaryCallback
    from trl_mdi.trainer import MDIGRPOTrainer

    key = f"{name}-s{seed}"
    run = {"key": key, "variant": name, "seed": seed, "steps": [], "step_seconds": [], "started_at": time.time(),
           "load": [os.getloadavg()[0]]}
    t0 = time.perf_counter()
    config = grpo_config(variant, seed, s, work / "grpo" / key)
    funcs = None
    if name == PLACEBO:  # arm D: the guarded reward's values, permuted within each group
        from benchmarks.look_or_guess_placebo import PlaceboGuardedReward
        from trl_mdi.rewards import resolve_reward_funcs

        placebo = PlaceboGuardedReward(seed=seed, group_size=s.num_generations)
        funcs = [placebo if getattr(f, "__name__", "") == "guarded_visual_gain" else f
                 for f in resolve_reward_funcs(list(config.reward_funcs), list(config.reward_weights))]
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=funcs, args=config, train_dataset=pool)
    for cb in (ConsoleSummaryCallback, PrinterCallback, ProgressCallback):  # keep the output readable
        trainer.remove_callback(cb)
    processor = AutoProcessor.from_pretrained(model_dir)
    mid = s.steps // 2 if s.eval_mid and s.steps >= 2 else None
    logger = step_log(run, lambda m: evaluate_styles(m, processor, test, s, seed), mid)
    trainer.add_callback(logger)
    trainer.train()
    run["grpo_seconds"] = round(logger.train_seconds(), 1)
    model = trainer.model
    score = seed in s.position_seeds and name in (RELIANCE, GUARDED)
    ev = evaluate_styles(model, processor, test, s, seed, keep=score)
    if score:  # the colour-word table: this run's sampled test rollouts, scored per token (counterfactual none)
        t_pos = time.perf_counter()
        sampled = [r for r in ev.pop("rollouts") if r["sample"] > 0]
        model.eval()
        score_rollouts(model, processor, sampled, test, kind="none")
        run["colour_word"] = colour_word_gains(sampled, processor.tokenizer, test)
        run["colour_word_seconds"] = round(time.perf_counter() - t_pos, 1)
        log(f"  [{key}] colour-word gains: {run['colour_word_seconds']:.0f} s")
    run["eval"] = ev
    run["final"] = headline(ev)
    f = run["final"]
    look = [x.get("rewards/look_rate/mean") for x in run["steps"]]
    log(f"  [{key}] {s.steps} steps {run['grpo_seconds']:.0f} s; look rate in training {look[0]:.2f} -> "
        f"{look[-1]:.2f}; test: conflict {f['conflict']:.3f} (look rate {f['look_rate_conflict']:.2f} x "
        f"{f['look_acc_conflict']:.2f}), non-conflict {f['plain']:.3f}, clean {f['clean']:.3f}")
    if seed in s.detect_seeds:
        run["detection"] = detection_records(model, processor, test, s, seed)
        log(f"  [{key}] detection: {len(run['detection']['records'])} rollouts, {run['detection']['seconds']:.0f} s")
    run["wall_seconds"] = round(time.perf_counter() - t0, 1)
    run["load"].append(os.getloadavg()[0])
    run["ended_at"] = time.time()
    return run


def warmup_figures(model_dir: Path, test, s: ExperimentSettings, log) -> dict:
    """The warm-up model on the test split: its held-out figures (step 0 of every run) and detection records."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    started_at = time.time()
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    ev = evaluate_styles(model, processor, test, s, 0)
    out = {"eval": ev, "final": headline(ev), "started_at": started_at}
    log(f"  warm-up on the test split: conflict {out['final']['conflict']:.3f}, look rate "
        f"{out['final']['look_rate']:.3f}, {ev['seconds']:.0f} s")
    if s.detect_seeds:  # the detection table's warm-up column (the replication measures none)
        out["detection"] = detection_records(model, processor, test, s, 0)
        log(f"  warm-up detection: {len(out['detection']['records'])} rollouts, {out['detection']['seconds']:.0f} s")
    out["ended_at"] = time.time()
    return out


_DATA: dict = {}


def execute(job: dict) -> tuple[dict | None, str | None]:
    """Run one job and save its JSON: the warm-up's figures or a (variant, seed) run. Returns ``(result, None)``,
    or ``(None, error)`` (``results.run_and_save``). The rows are built once per process."""
    s, recipe, work = job["settings"], job["recipe"], job["work"]

    def body(log) -> dict:
        from benchmarks.environment import apply_torch_pins, environment_record

        if job.get("float_path"):  # deterministic algorithms, and a pinned job checks its worker took the pinned path
            apply_torch_pins(job["threads"], job["float_path"])
        out = _body(log)
        out["environment"] = environment_record()
        return out

    def _body(log) -> dict:
        if "test" not in _DATA:
            _DATA["test"] = held_out_test_rows(recipe, s)
        if job["what"] == "warmup":
            log("== the warm-up model on the test split")
            return warmup_figures(job["model_dir"], _DATA["test"], s, log)
        if "pool" not in _DATA:
            _DATA["pool"] = pool_rows(recipe, s)
        log(f"== {job['name']}, seed {job['seed']}")
        return run_one(job["name"], job["variant"], job["seed"], job["model_dir"], _DATA["pool"], _DATA["test"], s,
                       work, log)

    return results.run_and_save(job, body, {"fingerprint": job["key"], "code": job["code"], "settings_key": job["key"]},
                                save=write_json)  # this module's: NaN as null, keys as strings
