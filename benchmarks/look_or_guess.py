"""Look or guess (issue 30): prior-colour questions answered by a short chain of thought that either reads the
image ("the shape is red") or recalls the object's usual colour ("a tomato is red"). Does a reliance reward push a
model from guessing to looking, and which per-rollout signal sees the style? Five commands:

    .venv/bin/python -m benchmarks.look_or_guess warmup-check   # the warm-up (cached) sampled and labelled: the
                                                                # check before any GRPO run (printed)
    .venv/bin/python -m benchmarks.look_or_guess experiment     # the reward choice on the development split, every
                                                                # (variant, seed) GRPO run, the RESULTS.md section
    .venv/bin/python -m benchmarks.look_or_guess report         # that section again from the finished records
    .venv/bin/python -m benchmarks.look_or_guess replicate      # the pre-registered replication (arms A-D, 16
                                                                # seeds), its results below its plan in RESULTS.md
    .venv/bin/python -m benchmarks.look_or_guess replication-report --earlier DIR   # those results again, with the
                                                                # earlier section's runs (DIR) re-stated

The parts, each in its own module: ``look_or_guess_task`` (the task, the warm-up, the rows, rollouts, their labels,
gains and figures, the warm-up check), ``look_or_guess_variants`` (the experiment's design: variants, settings,
goals, the keys of finished jobs), ``look_or_guess_evaluation`` (what is measured on a model: the development
split's choice, the held-out figures, the detection table), ``look_or_guess_runs`` (one job: a GRPO run or the
warm-up's figures, saved as JSON), ``look_or_guess_report`` (the warm-up check's report and the RESULTS.md
section) and ``look_or_guess_replication`` (the replication's tests and its results, written below its plan). This script wires them: read it top to bottom.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.environment import (
    FLOAT_PATHS,
    PINNED,
    apply_torch_pins,
    environment_key,
    environment_record,
    pin_float_path,
)
from benchmarks.results import ROOT, replace_section, run_pool, set_offline_env

set_offline_env()
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep (see learning_curve.py)
if __name__ == "__main__":
    # The float path is chosen before torch is imported (torch, MKL and oneDNN read it once; spawned workers inherit
    # it): the same seed gives the same figures on every machine of this kind (issue 44; benchmarks/environment.py).
    _early = argparse.ArgumentParser(add_help=False)
    _early.add_argument("--threads", type=int, default=1)
    _early.add_argument("--float_path", choices=FLOAT_PATHS, default=PINNED)
    _known = _early.parse_known_args()[0]
    pin_float_path(_known.threads, _known.float_path)

import torch  # noqa: E402

from benchmarks import look_or_guess_replication as lg_replication  # noqa: E402
from benchmarks.look_or_guess_evaluation import choose_reward  # noqa: E402
from benchmarks.look_or_guess_report import SECTION, report, report_warmup_check  # noqa: E402
from benchmarks.look_or_guess_runs import clean_json, code_label, code_version, execute, write_json  # noqa: E402
from benchmarks.look_or_guess_task import (  # noqa: E402
    DEFAULT_WORK,
    Settings,
    dev_rows,
    held_out_rows,
    look_or_guess_recipe,
    shared_warmup,
    warmup_check,
    warmup_dir,
)
from benchmarks.look_or_guess_variants import (  # noqa: E402
    ALL_VARIANTS,
    BASELINE,
    GAIN_FORMS,
    GUARDED,
    OTHER_FORM,
    RELIANCE,
    REPLICATION_ARMS,
    REPLICATION_SEEDS,
    VARIANT_NAMES,
    ExperimentSettings,
    choice_key,
    experiment_variants,
    run_key,
    warmup_key,
)


def cmd_warmup_check(a: argparse.Namespace) -> dict:
    """Warm up (or reuse the cached warm-up), run :func:`warmup_check`, print the report; ``--json`` saves it."""
    import transformers

    torch.set_num_threads(a.threads)
    transformers.logging.set_verbosity_error()
    started = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - started:6.1f} s] {msg}", flush=True)

    recipe = look_or_guess_recipe(epochs=a.epochs, n_train=a.n_train, image_size=a.image_size)
    s = Settings(n_eval=a.n_eval, samples=a.samples, seed=a.seed, counterfactual=a.counterfactual or "black")
    work = Path(a.work_dir) if a.work_dir else DEFAULT_WORK
    model, processor, info = shared_warmup(recipe, work, log, getattr(a, "environment", None))
    result = warmup_check(model, processor, held_out_rows(recipe, s), s, log)
    result["warmup"] = info
    print("\n" + report_warmup_check(result, info))
    if a.json:
        Path(a.json).write_text(json.dumps(clean_json(result), indent=1, default=str))
        print(f"wrote {a.json}")
    return result


# ------------------------------------------------------------------------------------ the experiment command


def experiment_settings(a: argparse.Namespace) -> ExperimentSettings:
    s = ExperimentSettings()
    for name in ("steps", "gain_form", "n_pool", "n_test", "eval_samples", "n_dev", "dev_samples", "detect_prompts",
                 "detect_samples", "n_boot", "learning_rate", "counterfactual"):  # None: the default
        value = getattr(a, name, None)
        if value is not None:
            setattr(s, name, value)
    for name in ("seeds", "variants", "detect_seeds"):
        value = getattr(a, name, None)
        if value:
            setattr(s, name, tuple(value))
    s.eval_mid = bool(getattr(a, "eval_mid", False))
    from trl_mdi.counterfactual import counterfactual_kinds

    if s.counterfactual not in (*counterfactual_kinds(), "auto"):
        raise SystemExit(f"--counterfactual must be auto or one of {counterfactual_kinds()}, got {s.counterfactual!r}")
    if s.gain_form not in (*GAIN_FORMS, "auto"):
        raise SystemExit(f"--gain_form must be auto or one of {GAIN_FORMS}, got {s.gain_form!r}")
    unknown = [v for v in s.variants if v not in ALL_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {ALL_VARIANTS}")
    if BASELINE not in s.variants:
        raise SystemExit(f"--variants must include the baseline {BASELINE!r}: every verdict is paired with it")
    return s


def cmd_experiment(a: argparse.Namespace, run_jobs: bool = True) -> int:
    """The shortcut experiment and the detection table (see :data:`SECTION` and the module docstring): the cached
    warm-up, the gain form chosen on the dev split, the warm-up's test figures, every (variant, seed) run (2 worker
    processes by default), then the RESULTS.md section from every finished record. ``run_jobs=False`` (the
    ``report`` command): only the section, from what is finished."""
    import transformers

    torch.set_num_threads(a.threads)
    transformers.logging.set_verbosity_error()
    started = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - started:7.1f} s] {msg}", flush=True)

    replication = a.command in ("replicate", "replication-report")
    s = experiment_settings(a)
    if replication:  # the pre-registered plan's settings (benchmarks/RESULTS.md): no detection, the colour-word table
        s.detect_seeds = ()
        s.position_seeds = (s.seeds[0],)
    recipe = look_or_guess_recipe(epochs=a.epochs, n_train=a.n_train, image_size=a.image_size)
    work = Path(a.work_dir) if a.work_dir else (DEFAULT_WORK.with_name(DEFAULT_WORK.name + "_replication")
                                                if replication else DEFAULT_WORK)
    (work / "runs").mkdir(parents=True, exist_ok=True)
    code = code_version()
    env = getattr(a, "environment", None)  # main() sets it: the float path and versions enter every key
    log(f"work dir {work}; code {code_label(code)}")
    model_dir = warmup_dir(recipe, work, env)

    def load(path: Path, key: str) -> dict | None:
        if not path.exists():
            return None
        rec = json.loads(path.read_text())
        if rec.get("fingerprint") != key:
            return None
        if a.rerun_other_code and code_label(rec.get("code")) != code_label(code):
            return None
        return rec

    # 1. The counterfactual kind and the reward's form, on the development split (the runs depend on them).
    path = work / f"choice-{choice_key(s, recipe, a.threads, env)}.json"
    choice = load(path, path.stem[len("choice-"):])
    if choice is None and run_jobs:
        model, processor, _ = shared_warmup(recipe, work, log, env)
        log("== the counterfactual kind and the reward form, on the development split")
        choice = choose_reward(model, processor, dev_rows(recipe, s), s, log)
        choice.update(fingerprint=path.stem[len("choice-"):], code=code)
        write_json(path, choice)
        del model
    elif choice is not None:
        log(f"counterfactual {choice['kind']}, reward {choice['form']} (chosen earlier, {path})")
    if choice is None:
        print("the development-split choice was not made yet: nothing to report")
        return 1
    if run_jobs and not (model_dir / "warmup.json").exists():
        shared_warmup(recipe, work, log, env)
    s.counterfactual = choice["kind"]  # every run, the warm-up's figures and their keys use the chosen kind
    tprl = choice["tprl_perturbation"]
    variants = experiment_variants(choice["form"], tprl if tprl != choice["kind"] else None)

    # 2. Jobs: the warm-up's test figures, then every variant of a seed before the next seed.
    common = dict(settings=s, recipe=recipe, work=work, threads=a.threads, float_path=a.float_path, started=started,
                  model_dir=model_dir, code=code)
    jobs, done = [], {}

    def plan(label: str, path: Path, key: str, **job) -> None:
        rec = load(path, key)
        if rec is not None and job.get("seed") in s.detect_seeds and not rec.get("detection"):
            rec = None  # finished before its seed was among --detect_seeds: rerun it with the measurement
        if (rec is not None and job.get("seed") in s.position_seeds and job.get("name") in (RELIANCE, GUARDED)
                and not rec.get("colour_word")):
            rec = None  # likewise for the colour-word table
        if rec is not None:
            done[label] = (rec, None)
        else:
            jobs.append({**common, **job, "label": label, "path": path, "key": key})

    wkey = warmup_key(s, recipe, a.threads, env)
    plan("warmup", work / f"warmup-test-{wkey}.json", wkey, what="warmup")
    order = []
    for seed in s.seeds:
        for name in s.variants:
            label = f"{name}-s{seed}"
            order.append(label)
            plan(label, work / "runs" / f"{label}.json", run_key(s, recipe, variants[name], seed, a.threads, env),
                 what="run", name=name, variant=variants[name], seed=seed)
    log(f"{len(done)} job(s) finished earlier, {len(jobs)} to run" + ("" if run_jobs else " (not run: report only)"))
    if run_jobs and jobs:
        done |= run_pool(jobs, execute, a.workers)
    runs = [done[k][0] for k in order if k in done and done[k][0] is not None]
    failed = [(k, done[k][1]) for k in ["warmup", *order] if k in done and done[k][0] is None]
    missing = [k for k in ["warmup", *order] if k not in done]
    warm = done.get("warmup", (None, None))[0]
    minutes = (time.time() - started) / 60 if run_jobs and jobs else None
    if replication:
        return write_replication(a, work, s, choice, minutes)
    body = report(choice=choice, warm=warm, runs=runs, s=s, recipe=recipe, argv=a.argv, missing=missing,
                  variants=variants,
                  failed=failed, code=code, minutes=minutes, workers=a.workers, threads=a.threads,
                  load=os.getloadavg()[0])
    print("\n" + body)
    if a.no_write:
        return 1 if failed else 0
    if len(s.seeds) < 5:
        print(f"not writing {a.results}: {len(s.seeds)} seed(s); the section needs 5 or more (--no-write to silence)")
        return 1
    replace_section(SECTION, body, Path(a.results))
    print(f"wrote the section '{SECTION}' of {a.results}")
    return 1 if failed else 0


def cmd_report(a: argparse.Namespace) -> int:
    """The RESULTS.md section from the finished records of the same settings (nothing is run)."""
    return cmd_experiment(a, run_jobs=False)


def cmd_replicate(a: argparse.Namespace) -> int:
    """The pre-registered replication (benchmarks/RESULTS.md, "Look or guess, replication"): arms A-D on seeds
    100-115 unless given, the ``visual_gain`` form and counterfactual ``none`` fixed as in the earlier section; then
    its results below the plan (``write_replication``)."""
    a.seeds = a.seeds or list(REPLICATION_SEEDS)
    a.variants = list(REPLICATION_ARMS.values())
    a.gain_form = a.gain_form or "visual_gain"
    a.counterfactual = a.counterfactual or "none"
    return cmd_experiment(a, run_jobs=a.command == "replicate")


def write_replication(a: argparse.Namespace, work: Path, s, choice: dict, minutes: float | None) -> int:
    """The replication's results from every run record in ``work`` of its arms and seeds (whatever code version made
    it: the text names each), and with ``--earlier DIR`` the earlier section's runs re-stated; written below the
    plan's closing line of ``--results`` (the plan itself is never rewritten)."""
    runs = [r for r in lg_replication.load_runs(work) if r["variant"] in REPLICATION_ARMS.values()
            and r["seed"] in s.seeds]
    earlier = lg_replication.load_runs(Path(a.earlier)) if a.earlier else None
    missing = [f"{v}-s{seed}" for seed in s.seeds for v in REPLICATION_ARMS.values()
               if not any(r["variant"] == v and r["seed"] == seed for r in runs)]
    results_path = Path(a.results)
    body = lg_replication.report(
        runs=runs, choice=choice, earlier=earlier, code=lg_replication.code_labels(runs),
        plan=lg_replication.plan_commit(results_path),
        earlier_code=lg_replication.code_labels(earlier) if earlier else None, minutes=minutes,
        workers=a.workers, missing=missing)
    print("\n" + body)
    if a.no_write:
        return 1 if missing else 0
    lg_replication.write_results(results_path, body)
    print(f"wrote the replication's results below its plan in {results_path}")
    return 1 if missing else 0


COMMANDS = {"warmup-check": cmd_warmup_check, "experiment": cmd_experiment, "report": cmd_report,
            "replicate": cmd_replicate, "replication-report": cmd_replicate}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.look_or_guess", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=list(COMMANDS))
    p.add_argument("--n_train", type=int, default=400, help="warm-up rows (default 400)")
    p.add_argument("--epochs", type=int, default=8, help="warm-up SFT epochs, each with its own styles (default 8)")
    p.add_argument("--image_size", type=int, default=56)
    p.add_argument("--n_eval", type=int, default=200, help="held-out prompts, half conflict rows (default 200)")
    p.add_argument("--samples", type=int, default=4, help="completions sampled per prompt (default 4)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--counterfactual", help="the image the per-token gain compares with (warmup-check: default black; "
                   "experiment: default auto, chosen on the development split)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--float_path", choices=FLOAT_PATHS, default=PINNED,
                   help="pinned (default): the float path of benchmarks/environment.py, set before torch is imported, "
                   "the same on every machine of this kind; native: the machine's own kernels (its figures differ "
                   "between machines)")
    p.add_argument("--work_dir", help=f"the cached warm-up (default {DEFAULT_WORK})")
    p.add_argument("--json", help="also write the result as JSON here")
    e = p.add_argument_group("experiment / report (the shortcut experiment and the detection table)")
    e.add_argument("--steps", type=int, help="GRPO steps per run (default 50)")
    e.add_argument("--seeds", type=int, nargs="+", help="GRPO seeds, every variant (default 0 1 2 3 4; the section "
                   "is written only with 5 or more)")
    e.add_argument("--variants", nargs="+", choices=ALL_VARIANTS, help=f"default: {' '.join(VARIANT_NAMES)}; "
                   f"{OTHER_FORM}: the reliance reward in the form the development split did not choose")
    e.add_argument("--gain_form", help="the reliance reward: visual_gain or visual_gain_sum (default auto: chosen on "
                   "the development split)")
    e.add_argument("--n_pool", type=int, help="GRPO training rows, no conflict row (default 400)")
    e.add_argument("--n_test", type=int, help="test prompts, half conflict rows (default 200)")
    e.add_argument("--eval_samples", type=int, help="completions sampled per test prompt at T=1 (default 4)")
    e.add_argument("--eval_mid", action="store_true", help="also evaluate at the middle step")
    e.add_argument("--n_dev", type=int, help="development prompts of the reward-form choice (default 100)")
    e.add_argument("--dev_samples", type=int, help="rollouts per development prompt (default 8)")
    e.add_argument("--detect_prompts", type=int, help="test prompts of the detection table (default 200)")
    e.add_argument("--detect_samples", type=int, help="rollouts per detection prompt (default 4)")
    e.add_argument("--detect_seeds", type=int, nargs="+", help="trained models measured for the detection table "
                   "(default 0)")
    e.add_argument("--n_boot", type=int, help="bootstrap resamples (default 1000)")
    e.add_argument("--learning_rate", type=float, help="GRPO learning rate (default 3e-4)")
    e.add_argument("--workers", type=int, default=2, help="jobs at a time, each in its own process (default 2)")
    e.add_argument("--rerun_other_code", action="store_true", help="rerun finished records made by another code "
                   "version (default: reuse them; the section lists every code version used)")
    e.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    e.add_argument("--no-write", dest="no_write", action="store_true", help="print the section only")
    r = p.add_argument_group("replicate / replication-report (the pre-registered replication: arms A-D)")
    r.add_argument("--earlier", help="work dir of the earlier section's runs (rerun from its recorded code version): "
                   "its verdicts re-stated under the corrected rules")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    # torch threads, deterministic algorithms and, pinned, a check that this process took the pinned path (a caller
    # that imported torch first gets the error naming the fix, before any work)
    apply_torch_pins(a.threads, a.float_path)
    a.environment = environment_key(environment_record())
    COMMANDS[a.command](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
