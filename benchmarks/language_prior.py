"""Language prior: do MDI rewards or TPRL make a tiny VLM that leans on the question's wording read the image?

    .venv/bin/python benchmarks/language_prior.py            # full run: 5 variants x 3 seeds, 2 at a time
    .venv/bin/python benchmarks/language_prior.py --quick    # pipeline check: 1 seed, 4 steps; prints only

Task (`trl_mdi.synthetic`, kind prior_color): "What color is the banana?" about one big drawn shape; options A. red
B. green C. blue D. yellow. Each object (tomato, grass, sky, banana) has a canonical colour, the shape is drawn in it
except on *conflict* rows, and the answer is always the image's colour. Reliance on the prior is behaviour:
conflict-row accuracy below non-conflict accuracy, and accuracy on blank images (the same questions, nothing
drawn) above chance on non-conflict rows.

Warm-up (`trl_mdi.warmup.warm_start`, shared by every run): 200 rows with conflict rate 0.05, 6 SFT epochs; trials
while this benchmark was built: conflict rate 0 gives a text-only model (conflict accuracy 0, so GRPO's groups on
conflict prompts all fail alike), 0.1 to 0.2 a model that already reads the image on conflict rows (0.85 to 1.0),
0.05 one in between (conflict accuracy 0.36 to 0.46, non-conflict 1.0, blank non-conflict 0.69 to 0.94).

GRPO (`MDIGRPOTrainer`) from that warm-up on a 2000-row pool with conflict rate 0.5 (trials, answer + format only,
120 steps: conflict accuracy 0.36 -> 0.41 with pool conflict rate 0.2, too little signal to tell variants apart;
0.36 -> 0.64 with 0.5; GRPO lr 1e-3 instead of 3e-4 broke non-conflict rows, 1.0 -> 0.46 by step 20), 120 steps
per run, side by side on the same steps and seeds, variants:

    answer_format      mc_idx 4, think_format 1
    mdi_balance        + mdi_balance 1 (the brief's 4:1:1, the default stack)
    mdi_group          + mdi_group 1 (group-relative MDI balance)
    tprl_perturbation  answer_format + TPRL (entropy + perception filtering, trajectory reweighting), VPPO's
                       perturbed-image signal (perception_signal="perturbation")
    tprl_attention     the same with the probe's per-token image attention (perception_signal="attention")

Held-out: 400 validation rows, 200 conflict + 200 not, greedy, every --eval_every steps, with the MDI of the greedy
answers (`evaluate_accuracy(measure_attention=True)`); the same rows blank at the start and the end.

Resumable: every finished (variant, seed) is a JSON file in --work_dir (default: a fixed folder under the system
temp dir), the warm-up a model folder there; a rerun with the same settings skips what is done. Outputs:
benchmarks/language_prior.png and the section "## Language prior" of benchmarks/RESULTS.md (only when every run
finished; --quick prints only unless --write).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from _results import replace_section, set_offline_env

set_offline_env()
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep (see learning_curve.py)

import torch  # noqa: E402
import transformers  # noqa: E402
from _language_prior_eval import HeldOut  # noqa: E402
from _language_prior_report import SECTION, plot, report  # noqa: E402
from transformers import AutoProcessor, TrainerCallback  # noqa: E402
from transformers.trainer_callback import PrinterCallback, ProgressCallback  # noqa: E402

from trl_mdi.config import MDIGRPOConfig  # noqa: E402
from trl_mdi.diagnostics import ConsoleSummaryCallback  # noqa: E402
from trl_mdi.trainer import MDIGRPOTrainer  # noqa: E402
from trl_mdi.warmup import WarmupRecipe, synthetic_dataset, warm_start  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WORK = Path(tempfile.gettempdir()) / "trl_mdi_language_prior"
LOGGED = ("reward", "rewards/", "attention/mdi", "tprl/", "completions/clipped_ratio", "completions/mean_length")


@dataclasses.dataclass(frozen=True)
class Variant:
    label: str
    rewards: tuple[str, ...]
    weights: tuple[float, ...]
    tprl: str | None = None  # the perception signal, with TPRL on


VARIANTS = {
    "answer_format": Variant("answer + format only", ("mc_idx", "think_format"), (4.0, 1.0)),
    "mdi_balance": Variant("+ mdi_balance (4:1:1)", ("mc_idx", "think_format", "mdi_balance"), (4.0, 1.0, 1.0)),
    "mdi_group": Variant("+ mdi_group (4:1:1)", ("mc_idx", "think_format", "mdi_group"), (4.0, 1.0, 1.0)),
    "tprl_perturbation": Variant("+ TPRL, perturbation signal", ("mc_idx", "think_format"), (4.0, 1.0),
                                 "perturbation"),
    "tprl_attention": Variant("+ TPRL, attention signal", ("mc_idx", "think_format"), (4.0, 1.0), "attention"),
}


@dataclasses.dataclass
class Settings:
    steps: int = 120  # per-run step budget
    eval_every: int = 20
    seeds: tuple[int, ...] = (0, 1, 2)
    variants: tuple[str, ...] = tuple(VARIANTS)
    n_eval: int = 400  # held-out rows; half of them conflict rows
    eval_conflict_rate: float = 0.5
    n_pool: int = 2000
    pool_conflict_rate: float = 0.5  # 0.2 moved conflict accuracy 0.36 -> 0.41 in 120 steps in trials; 0.5: 0.64
    learning_rate: float = 3e-4
    lr_scheduler_type: str = "linear"
    prompts_per_step: int = 4
    num_generations: int = 8
    max_completion_length: int = 8
    eval_max_new_tokens: int = 16


def prior_recipe(quick: bool = False) -> WarmupRecipe:
    """The shared warm-up: prior_color rows on which the prior holds 95% of the time (see the module docstring)."""
    return WarmupRecipe(kinds=("prior_color",), conflict_rate=0.05, epochs=1.0 if quick else 6.0)


def fingerprint(*parts) -> str:
    """A short hash of everything that decides a result: a finished file with another one is rerun."""
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)  # a run interrupted while saving leaves no half-written result behind


# ------------------------------------------------------------------------------------------------ evaluation


def shared_warmup(recipe: WarmupRecipe, held: HeldOut, work: Path, log) -> tuple[Path, dict]:
    """The warm-up model and its held-out scores, trained once and reused by every run (and every rerun)."""
    key = fingerprint(dataclasses.asdict(recipe), torch.get_num_threads())
    model_dir, done = work / f"warmup-{key}", work / f"warmup-{key}.json"
    if done.exists():
        log(f"warm-up: reusing {model_dir}")
        return model_dir, json.loads(done.read_text())
    started_at = time.time()
    model, processor, info = warm_start(recipe, model_dir, overwrite=True, log=lambda m: log(f"  {m}"))
    info["started_at"] = started_at
    info["eval"] = held.evaluate(model, processor)
    info["eval_blank"] = held.evaluate(model, processor, blank=True)
    write_json(done, info)
    return model_dir, info


# --------------------------------------------------------------------------------------------------- GRPO


class Recorder(TrainerCallback):
    """Held-out scores every N steps (their time kept out of the training time) and the logged metrics."""

    def __init__(self, run: dict, processor, held: HeldOut, s: Settings, log):
        self.run, self.processor, self.held, self.s, self.log = run, processor, held, s, log
        self.t0, self.eval_seconds = 0.0, 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def train_seconds(self) -> float:
        return time.perf_counter() - self.t0 - self.eval_seconds

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if step % self.s.eval_every == 0 or step == state.max_steps:
            elapsed = self.train_seconds()
            e = self.held.evaluate(model, self.processor)
            self.eval_seconds += e["seconds"]
            self.run["evals"].append({"step": step, "train_seconds": round(elapsed, 2), **e})
            self.log(f"  [{self.run['key']}] step {step:4d} {elapsed:6.1f} s  conflict {e['conflict']:.3f}  "
                     f"non-conflict {e['plain']:.3f}  MDI all {e['mdi_all']:.3f} late {e['mdi_late']:.3f}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.run["steps"].append({"step": state.global_step,
                                      **{k: v for k, v in logs.items() if k.startswith(LOGGED)}})


def grpo_config(variant: Variant, seed: int, s: Settings, out: Path) -> MDIGRPOConfig:
    extra = {}
    has_signal = "perception_signal" in {f.name for f in dataclasses.fields(MDIGRPOConfig)}
    if variant.tprl is not None:
        extra = dict(enable_entropy_filtering=True, enable_perception_filtering=True, enable_trajectory_reweighting=True)
        # "perturbation" is what TPRL did before the option existed; "attention" needs it (and fails without it).
        if has_signal or variant.tprl != "perturbation":
            extra["perception_signal"] = variant.tprl
        if has_signal and variant.tprl == "perturbation":
            # Also the attention signal, free here (the probe runs anyway): logs tprl/signal_rank_corr, how well
            # the probe's per-token image attention ranks tokens as the perturbed forward does. Trains the same.
            extra["perception_signal_compare"] = True
    return MDIGRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True,
        seed=seed, max_steps=s.steps, logging_steps=1,
        per_device_train_batch_size=s.prompts_per_step * s.num_generations, num_generations=s.num_generations,
        max_completion_length=s.max_completion_length, learning_rate=s.learning_rate,
        lr_scheduler_type=s.lr_scheduler_type, beta=0.0, temperature=1.0, gradient_checkpointing=False,
        mask_truncated_completions=True, reward_funcs=list(variant.rewards), reward_weights=list(variant.weights),
        compute_attention_metrics=True, realtime_rollout_logging=False, attention_map_every_n_steps=0, **extra,
    )


def run_one(name: str, seed: int, model_dir: Path, warm: dict, pool, held: HeldOut, s: Settings, work: Path,
            log) -> dict:
    """One GRPO run from the shared warm-up: its evaluations, logged metrics and times."""
    variant = VARIANTS[name]
    run = {"key": f"{name}-s{seed}", "variant": name, "seed": seed, "evals": [], "steps": [],
           "load": [os.getloadavg()[0]], "started_at": time.time()}
    t0 = time.perf_counter()
    trainer = MDIGRPOTrainer(str(model_dir), args=grpo_config(variant, seed, s, work / "grpo" / run["key"]),
                             train_dataset=pool)
    for cb in (ConsoleSummaryCallback, PrinterCallback, ProgressCallback):  # keep the output readable
        trainer.remove_callback(cb)
    processor = AutoProcessor.from_pretrained(model_dir)
    # The warm-up's own scores are step 0: the same weights, greedy, the same rows.
    run["evals"].append({"step": 0, "train_seconds": 0.0, **warm["eval"]})
    recorder = Recorder(run, processor, held, s, log)
    trainer.add_callback(recorder)
    trainer.train()
    run["grpo_seconds"] = recorder.train_seconds()
    run["eval_seconds"] = recorder.eval_seconds
    run["blank_final"] = held.evaluate(trainer.model, processor, blank=True)
    run["wall_seconds"] = time.perf_counter() - t0
    run["load"].append(os.getloadavg()[0])
    run["ended_at"] = time.time()
    return run


_DATA: dict = {}


def execute(job: tuple) -> tuple[dict | None, str | None]:
    """Run one (variant, seed) and save its JSON: ``(run, None)``, or ``(None, error)`` if it failed. Runs in the
    main process or in a worker; the held-out rows and the GRPO pool are built once per process."""
    name, seed, key, model_dir, warm, s, recipe, work, threads, started = job
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()

    def log(msg: str) -> None:
        print(f"[{time.time() - started:7.1f} s] {msg}", flush=True)

    if "held" not in _DATA:
        _DATA["held"] = HeldOut(s, recipe)
    if "pool" not in _DATA:
        _DATA["pool"] = synthetic_dataset(s.n_pool, split="train", seed=recipe.data_seed + 1, kinds=recipe.kinds,
                                          option_order=recipe.option_order, image_size=recipe.image_size,
                                          conflict_rate=s.pool_conflict_rate)
    log(f"== {name}, seed {seed}")
    try:
        run = run_one(name, seed, model_dir, warm, _DATA["pool"], _DATA["held"], s, work, log)
    except Exception as err:  # noqa: BLE001 - one variant failing must not lose the others
        log(f"  [{name}-s{seed}] FAILED: {type(err).__name__}: {err}")
        return None, f"{type(err).__name__}: {err}"
    run["fingerprint"] = key
    write_json(work / "runs" / f"{name}-s{seed}.json", run)
    return run, None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="pipeline check: seed 0, 4 steps, 40 held-out rows, a "
                   "1-epoch warm-up, in a fresh temporary work dir; prints only unless --write")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="default: all five")
    p.add_argument("--seeds", type=int, nargs="+", help="GRPO seeds (default 0 1 2; --quick 0)")
    p.add_argument("--steps", type=int, help="GRPO steps per run (default 120; --quick 4)")
    p.add_argument("--eval_every", type=int, help="steps between held-out evaluations (default 20; --quick 2)")
    p.add_argument("--n_eval", type=int, help="held-out rows, half conflict (default 400; --quick 40)")
    p.add_argument("--pool_conflict_rate", type=float, help="conflict rate of the GRPO prompts (default 0.5)")
    p.add_argument("--learning_rate", type=float, help="GRPO learning rate (default 3e-4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1, as learning_curve.py)")
    p.add_argument("--workers", type=int, default=2, help="runs at a time, each in its own process (default 2: one "
                   "per core of the 2-core target machine; 1: one after the other, in this process)")
    p.add_argument("--work_dir", help=f"finished runs and the warm-up, for resuming (default {DEFAULT_WORK})")
    p.add_argument("--png", default=str(ROOT / "benchmarks" / "language_prior.png"))
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="write the PNG and the RESULTS.md section (default unless "
                   "--quick)")
    g.add_argument("--no-write", action="store_true", help="print only")
    a = p.parse_args(argv)
    s = Settings()
    if a.quick:
        s.steps, s.eval_every, s.n_eval, s.seeds, s.n_pool = 4, 2, 40, (0,), 64
    s.seeds = tuple(a.seeds) if a.seeds else s.seeds
    s.variants = tuple(a.variants) if a.variants else s.variants
    s.steps, s.eval_every, s.n_eval = a.steps or s.steps, a.eval_every or s.eval_every, a.n_eval or s.n_eval
    s.pool_conflict_rate = s.pool_conflict_rate if a.pool_conflict_rate is None else a.pool_conflict_rate
    s.learning_rate = a.learning_rate or s.learning_rate
    write = a.write or not (a.quick or a.no_write)

    torch.set_num_threads(a.threads)
    transformers.logging.set_verbosity_error()
    started = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - started:7.1f} s] {msg}", flush=True)

    recipe = prior_recipe(a.quick)
    with tempfile.TemporaryDirectory(prefix="language_prior_") as tmp:
        work = Path(a.work_dir) if a.work_dir else Path(tmp) if a.quick else DEFAULT_WORK
        (work / "runs").mkdir(parents=True, exist_ok=True)
        log(f"work dir {work}")
        held = _DATA["held"] = HeldOut(s, recipe)  # reused by runs in this process (--workers 1)
        model_dir, warm = shared_warmup(recipe, held, work, log)
        w, b = warm["eval"], warm["eval_blank"]
        log(f"warm-up: conflict {w['conflict']:.3f}, non-conflict {w['plain']:.3f}, conflict rows answered with the "
            f"prior {w['prior_follow']:.3f}; blank images: non-conflict {b['plain']:.3f}; MDI all {w['mdi_all']:.3f}, "
            f"late {w['mdi_late']:.3f}")
        jobs, done = [], {}
        for seed in s.seeds:  # every variant of a seed before the next seed: an interrupted run is comparable
            for name in s.variants:
                path = work / "runs" / f"{name}-s{seed}.json"
                key = fingerprint(dataclasses.asdict(s) | {"seeds": None, "variants": None},
                                  dataclasses.asdict(recipe), dataclasses.asdict(VARIANTS[name]), seed, a.threads)
                if path.exists() and json.loads(path.read_text()).get("fingerprint") == key:
                    log(f"== {name}, seed {seed}: done earlier, {path}")
                    done[name, seed] = (json.loads(path.read_text()), None)
                else:
                    jobs.append((name, seed, key, model_dir, warm, s, recipe, work, a.threads, started))
        if a.workers > 1 and len(jobs) > 1:
            ctx = multiprocessing.get_context("spawn")  # a fresh interpreter per worker: no forked torch state
            with ProcessPoolExecutor(min(a.workers, len(jobs)), mp_context=ctx) as ex:
                done |= dict(zip([(j[0], j[1]) for j in jobs], ex.map(execute, jobs)))
        else:
            done |= {(j[0], j[1]): execute(j) for j in jobs}
    order = [(n, sd) for sd in s.seeds for n in s.variants]
    runs = [done[k][0] for k in order if done[k][0] is not None]
    failed = [(*k, done[k][1]) for k in order if done[k][0] is None]
    load = os.getloadavg()[0]
    body = report(runs, warm, s, recipe, VARIANTS, argv, started, failed, load, a.workers)
    print("\n" + body)
    if failed:
        print(f"{len(failed)} run(s) failed: " + "; ".join(f"{n} seed {sd}: {e}" for n, sd, e in failed))
        if write:
            print("not writing RESULTS.md or the plot: not every run finished")
        return 1
    if write:
        plot(runs, VARIANTS, Path(a.png))
        replace_section(SECTION, body, Path(a.results))
        print(f"wrote {a.png} and the section '{SECTION}' of {a.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
