"""TPRL on look or guess with conflict rows (issue 44): one run of an arm and seed from the warm-up, its held-out
figures at the midpoint and the end, and the JSON record it is saved as, stamped with its environment, the
warm-up's weights hash and the code version.

A job runs in a spawned worker (``benchmarks.results.run_pool``) that inherited the pinned float path from the
command's process (``benchmarks.environment``): :func:`execute` refuses to run when the worker's torch did not take
it (a pinned job) and records the environment it ran in either way.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from benchmarks import results
from benchmarks.callbacks import EvaluateEvery, at
from benchmarks.environment import PINNED, check_torch_pins, environment_record
from benchmarks.tprl_design import ARMS, TprlSettings, grpo_config, settings_dict

LOGGED = ("reward", "rewards/", "tprl/", "attention/mdi", "completions/mean_length", "completions/clipped_ratio",
          "entropy", "clip_ratio")


def eval_rows(recipe, s: TprlSettings):
    """The held-out rows: the TEST split (``look_or_guess_test``) for the plan's runs, the development split
    (validation rows) for development runs; ``s.n_eval`` rows at ``s.eval_conflict_rate``, the warm-up's data
    seed."""
    from benchmarks.look_or_guess_task import DEV_SPLIT, TEST_SPLIT
    from fixtures.warmup import synthetic_dataset

    if s.eval_split not in ("test", "dev"):
        raise ValueError(f"eval_split must be 'test' or 'dev', got {s.eval_split!r}")
    split = TEST_SPLIT if s.eval_split == "test" else DEV_SPLIT
    return synthetic_dataset(s.n_eval, split=split, seed=recipe.data_seed, kinds=recipe.kinds,
                             option_order=recipe.option_order, image_size=recipe.image_size,
                             conflict_rate=s.eval_conflict_rate)


def pool_rows(recipe, s: TprlSettings):
    """The GRPO rows: ``s.n_pool`` train-split rows of seed ``data_seed + 1`` (not the warm-up's), with
    ``round(s.pool_conflict_rate * n_pool)`` conflict rows spread over the answer letters."""
    from fixtures.warmup import synthetic_dataset

    return synthetic_dataset(s.n_pool, split="train", seed=recipe.data_seed + 1, kinds=recipe.kinds,
                             option_order=recipe.option_order, image_size=recipe.image_size,
                             conflict_rate=s.pool_conflict_rate)


def outcomes(ev: dict) -> dict[str, float]:
    """The plan's outcomes of one held-out evaluation (``look_or_guess_evaluation.evaluate_styles``; sampled
    rollouts): ``conflict`` (accuracy on conflict rows, the primary), ``plain`` (non-conflict accuracy), ``clean``
    (clean format, all rows), ``neither`` (the share in neither style, all rows: the hacking alarm), ``guess`` (guess
    rate on conflict rows), ``look`` (look rate, all rows).

    >>> m = {"conflict": {"accuracy": 0.5, "guess_rate": 0.4}, "plain": {"accuracy": 0.9},
    ...      "all": {"clean": 0.95, "other_rate": 0.1, "look_rate": 0.5}}
    >>> outcomes({"sampled": m})
    {'conflict': 0.5, 'plain': 0.9, 'clean': 0.95, 'neither': 0.1, 'guess': 0.4, 'look': 0.5}
    """
    m = ev["sampled"]
    return {"conflict": m["conflict"]["accuracy"], "plain": m["plain"]["accuracy"], "clean": m["all"]["clean"],
            "neither": m["all"]["other_rate"], "guess": m["conflict"]["guess_rate"], "look": m["all"]["look_rate"]}


def run_one(arm_name: str, seed: int, model_dir: Path, pool, held_out, s: TprlSettings, work: Path, log,
            evaluate_end: bool = True, save_to: Path | None = None) -> dict:
    """One GRPO run of arm ``arm_name`` from the warm-up in ``model_dir``: every step's logged metrics (the look and
    guess rates of its rollouts among them) and training seconds, the held-out figures at ``s.mid_step`` and at the
    end (``evaluate_end=False``: none at the end, for the timing pilot), and the seconds each part took. With
    ``save_to``, the trained model is saved there (the reproducibility check hashes it)."""
    from transformers import AutoProcessor
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from benchmarks.look_or_guess_evaluation import evaluate_styles
    from trl_mdi.diagnostics import ConsoleSummaryCallback
    from trl_mdi.trainer import MDIGRPOTrainer

    arm = ARMS[arm_name]
    key = f"{arm_name}-s{seed}"
    run = {"arm": arm_name, "seed": seed, "steps": [], "step_seconds": [], "eval_seconds": [],
           "step_cpu_seconds": [], "eval_cpu_seconds": [], "started_at": time.time(), "load": [os.getloadavg()[0]]}
    # CPU seconds of this process (one thread) beside the wall clock: what a run costs on a core of its own, which
    # other jobs' load on a shared machine changes far less than the wall time.
    t0, c0 = time.perf_counter(), time.process_time()
    cpu = {"last": c0, "eval": 0.0}
    trainer = MDIGRPOTrainer(str(model_dir), args=grpo_config(arm, seed, s, work / "grpo" / key),
                             train_dataset=pool)
    for cb in (ConsoleSummaryCallback, PrinterCallback, ProgressCallback):  # keep the output readable
        trainer.remove_callback(cb)
    processor = AutoProcessor.from_pretrained(model_dir)
    run["setup_seconds"] = round(time.perf_counter() - t0, 1)
    run["setup_cpu_seconds"] = round(time.process_time() - c0, 1)

    def evaluate(model) -> dict:
        c = time.process_time()
        ev = evaluate_styles(model, processor, held_out, s, seed, kind=s.kind)
        spent = time.process_time() - c
        cpu["eval"] += spent
        run["eval_cpu_seconds"].append(round(spent, 1))
        return ev

    def evaluate_mid(model, step: int, elapsed: float) -> float:
        ev = evaluate(model)
        run["mid"] = {"step": step, "train_seconds": round(elapsed, 1), "outcomes": outcomes(ev), "eval": ev}
        run["eval_seconds"].append(ev["seconds"])
        log(f"  [{key}] step {step}: conflict {run['mid']['outcomes']['conflict']:.3f}, look rate "
            f"{run['mid']['outcomes']['look']:.3f} ({ev['seconds']:.0f} s)")
        return ev["seconds"]

    def record_step(step: int, logs: dict) -> None:
        run["steps"].append({"step": step, **{k: v for k, v in logs.items() if k.startswith(LOGGED)}})
        now = time.process_time()
        run["step_cpu_seconds"].append(round(now - cpu["last"] - cpu["eval"], 3))  # the first holds TRL's set-up
        cpu["last"], cpu["eval"] = now, 0.0

    logger = EvaluateEvery(evaluate_mid, at(s.mid_step), step_seconds=run["step_seconds"], record_step=record_step)
    trainer.add_callback(logger)
    cpu["last"] = time.process_time()
    trainer.train()
    run["grpo_seconds"] = round(logger.train_seconds(), 1)
    if save_to is not None:
        trainer.model.save_pretrained(save_to)
    if evaluate_end:
        ev = evaluate(trainer.model)
        run["eval_seconds"].append(ev["seconds"])
        run["eval"] = ev
        run["final"] = outcomes(ev)
        f = run["final"]
        log(f"  [{key}] {s.steps} steps in {run['grpo_seconds']:.0f} s; test: conflict {f['conflict']:.3f}, look "
            f"{f['look']:.3f}, neither {f['neither']:.3f}, non-conflict {f['plain']:.3f}, clean {f['clean']:.3f}")
    run["wall_seconds"] = round(time.perf_counter() - t0, 1)
    run["cpu_seconds"] = round(time.process_time() - c0, 1)
    run["load"].append(os.getloadavg()[0])
    run["ended_at"] = time.time()
    return run


_DATA: dict = {}


def execute(job: dict) -> tuple[dict | None, str | None]:
    """Run one job in this process and save its JSON record (``results.run_and_save``): a (arm, seed) run.
    ``job``: ``arm``, ``seed``, ``settings``, ``recipe``, ``model_dir``, ``work``, ``path``, ``key``, ``float_path``,
    ``warmup_sha256``, ``code``, ``threads``, ``started``, ``label``; ``evaluate_end`` (default True). The record
    carries its ``environment`` (``benchmarks.environment.environment_record``, taken in this process), the
    warm-up's hash, the code version, the settings and the key. A pinned job whose process did not take the pinned
    path fails before it trains."""
    s, recipe = job["settings"], job["recipe"]

    def body(log) -> dict:
        from benchmarks.environment import apply_torch_pins

        apply_torch_pins(job["threads"], job["float_path"])
        if job["float_path"] == PINNED:
            check_torch_pins()
        rows_key = (s.eval_split, s.n_eval, s.eval_conflict_rate, s.n_pool, s.pool_conflict_rate, s.kind)
        if _DATA.get("key") != rows_key:
            _DATA.update(key=rows_key, held_out=eval_rows(recipe, s), pool=pool_rows(recipe, s))
        log(f"== {job['arm']}, seed {job['seed']}")
        run = run_one(job["arm"], job["seed"], job["model_dir"], _DATA["pool"], _DATA["held_out"], s, job["work"],
                      log, evaluate_end=job.get("evaluate_end", True))
        run["environment"] = environment_record()
        return run

    stamp = {"key": job["key"], "code": job["code"], "warmup_sha256": job["warmup_sha256"],
             "settings": settings_dict(s), "label": job["label"]}
    return results.run_and_save(job, body, stamp, save=_save)


def _save(path: Path, data: dict) -> None:
    from benchmarks.look_or_guess_runs import write_json

    write_json(path, data)
