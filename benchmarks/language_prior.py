"""Language prior: does a tiny VLM that leans on the question's wording read the image after GRPO, and which
per-rollout signal sees whether an answer came from the image?

    .venv/bin/python -m benchmarks.language_prior            # full run: 7 variants, 3 or 5 seeds, 2 at a time
    .venv/bin/python -m benchmarks.language_prior --quick    # pipeline check: 1 seed, 4 steps; prints only

Task (`fixtures.synthetic`, kind prior_color): "What color is the banana?" about one big drawn shape; options A. red
B. green C. blue D. yellow. Each object (tomato, grass, sky, banana) has a canonical colour, the shape is drawn in it
except on *conflict* rows, and the answer is always the image's colour. Reliance on the prior is behaviour:
conflict-row accuracy below non-conflict accuracy, and accuracy on blank images (the same questions, nothing
drawn) above chance on non-conflict rows.

Warm-up (`fixtures.warmup.warm_start`, shared by every run): 200 rows with conflict rate 0.05, 6 SFT epochs; trials
while this benchmark was built: conflict rate 0 gives a text-only model (conflict accuracy 0, so GRPO's groups on
conflict prompts all fail alike), 0.1 to 0.2 a model that already reads the image on conflict rows (0.85 to 1.0),
0.05 one in between (conflict accuracy 0.36 to 0.46, non-conflict 1.0, blank non-conflict 0.69 to 0.94).

Reliance (issue 25): rollouts sampled at temperature 1 on the held-out conflict rows (default 200 prompts x 8) are
scored by `trl_mdi.profile.reference.measure_reliance` with the real image and a counterfactual one, and every
per-rollout signal (MDI all / late, answer_image_attention, visual_gain, answer_visual_gain, blind_agrees) gets its
AUROC at separating prior-following rollouts (they answer the object's usual colour: the data's own label) from
image-following ones (the drawn colour), pooled and within prompts (pairs of rollouts of one prompt: what GRPO's
group-relative advantage sees), each with a 95% interval from a bootstrap over prompts, every signal on one common
set of rollouts (those where all are defined; n per signal beside it), and its within-group variance share
(`trl_mdi.profile.validation.signal_table`, through `trl_mdi.profile.reliance_report.summarize_reliance`), and the general
rule's agreement with that label (`label_agreement`). Under every counterfactual kind for the warm-up model, twice
(two jobs of their own, beside the runs): on a development split (`DEV_SPLIT`: the generator's own stream, rows
sharing an image with the test rows, the GRPO pool or the warm-up's rows dropped), where the kind of the reported
signals is ranked (`language_prior_report.pick_kind`: the highest within-prompt AUROC of answer_visual_gain, ties to
the trainer's default), and on the test rows (the first 200 held-out conflict rows), which report every kind and
choose nothing. The runs keep the trainer's default counterfactual whatever the development split picks. With the
runs' counterfactual kind only at the end of every run. Training verdicts:
each variant's final accuracy minus the baseline's on the same seed, with a 95% t interval over the paired seeds
(`benchmarks.stats.paired_seed_difference`); "shown" only when that interval excludes 0 and the other goals hold
(`benchmarks.stats.verdict`).

GRPO (`MDIGRPOTrainer`) from that warm-up on a 2000-row pool with conflict rate 0.5 (trials, answer + format only,
120 steps: conflict accuracy 0.36 -> 0.41 with pool conflict rate 0.2, too little signal to tell variants apart;
0.36 -> 0.64 with 0.5; GRPO lr 1e-3 instead of 3e-4 broke non-conflict rows, 1.0 -> 0.46 by step 20), 120 steps
per run, side by side on the same steps and seeds, every run computing and logging the reliance signals
(`reliance_signals=True`, counterfactual `--counterfactual`, default the trainer's), variants:

    answer_format        mc_idx 4, think_format 1                                         (5 seeds)
    mdi_balance          + mdi_balance 1 (4:1:1, the default stack)           (3 seeds)
    mdi_group            + mdi_group 1 (group-relative MDI balance)                       (3 seeds)
    tprl_perturbation    answer_format + TPRL (entropy + perception filtering, trajectory reweighting), VPPO's
                         perturbed-image signal (perception_signal="perturbation")        (3 seeds)
    tprl_attention       the same with the probe's per-token image attention               (3 seeds)
    answer_visual_gain   + answer_visual_gain 1 (pays clip(g, 0, 4) / 4)                  (5 seeds)
    tprl_counterfactual  tprl_perturbation with the counterfactual image as its perturbation
                         (perception_perturbation = counterfactual_image: one forward serves both) (3 seeds)

Held-out: 400 validation rows, 200 conflict + 200 not, greedy, every --eval_every steps, with the MDI of the greedy
answers (`evaluate_accuracy(measure_attention=True)`); the same rows blank at the start and the end.

Resumable: every finished (variant, seed) is a JSON file in --work_dir (default: a fixed folder under the system
temp dir), the warm-up a model folder there, its reliance measurement a JSON file; a rerun with the same settings
and the same code version skips what is done. The code version (git commit, dirty flag and a hash of the
uncommitted changes of the files that decide a result, `CODE_PATHS`) is part of every job's fingerprint: a stored
result from other code is rerun, not reused (the reported figures must come from the code the section names: a
stale one once stood in RESULTS.md, answer_visual_gain seed 0 at 0.430 / 0.580, which the commit it was recorded
at gives as 0.505 / 0.710), unless --reuse_other_code, which reuses it and makes the section list the jobs that came
from another version. Every reliance measurement keeps its per-rollout records (prompt, answer, every signal per
counterfactual kind) beside its tables, so its statistics can be recomputed without measuring again
(`language_prior_eval.recompute`). Outputs: benchmarks/language_prior.png and the section "## Language prior" of
benchmarks/RESULTS.md (only when every job finished; --quick prints only unless --write). --quick also prints the
projected time of the full benchmark, from its own per-step and per-row timings.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results import (
    code_version,
    describe_version,
    replace_section,
    run_and_save,
    run_pool,
    set_offline_env,
    write_json,
)

set_offline_env()
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep (see learning_curve.py)

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoProcessor  # noqa: E402
from transformers.trainer_callback import PrinterCallback, ProgressCallback  # noqa: E402

from benchmarks.callbacks import EvaluateEvery, every  # noqa: E402
from benchmarks.language_prior_eval import HeldOut, image_keys  # noqa: E402
from benchmarks.language_prior_report import SECTION, plot, projection_lines, report  # noqa: E402
from benchmarks.variants import COUNTERFACTUAL, Variant, grpo_config  # noqa: E402
from fixtures.warmup import WarmupRecipe, synthetic_dataset, warm_start  # noqa: E402
from trl_mdi.config import MDIGRPOConfig  # noqa: E402
from trl_mdi.counterfactual import NO_IMAGE, counterfactual_kinds  # noqa: E402
from trl_mdi.diagnostics import ConsoleSummaryCallback  # noqa: E402
from trl_mdi.trainer import MDIGRPOTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WORK = Path(tempfile.gettempdir()) / "trl_mdi_language_prior"
LOGGED = ("reward", "rewards/", "attention/mdi", "tprl/", "reliance/", "completions/clipped_ratio",
          "completions/mean_length", "entropy")
DEV_SPLIT = "language_prior_dev"
"""The development split's name: the synthetic generator's own random stream for it (rows drawn independently of
the test rows, split validation, of the GRPO pool and of the warm-up's rows, split train). The counterfactual kind
of the reported signals is ranked on its conflict rows (``language_prior_report.pick_kind``), never on the test
rows."""
CODE_PATHS = ("trl_mdi", "fixtures", "benchmarks/language_prior.py", "benchmarks/language_prior_eval.py",
              "benchmarks/results.py", "benchmarks/callbacks.py", "benchmarks/variants.py", "pyproject.toml")
"""The files whose code decides a stored result (the report's file only formats it): their uncommitted changes
count in the code version."""


def _config_default(name: str):
    return next(f.default for f in dataclasses.fields(MDIGRPOConfig) if f.name == name)


VARIANTS = {
    "answer_format": Variant("answer + format only", ("mc_idx", "think_format"), (4.0, 1.0), all_seeds=True),
    "mdi_balance": Variant("+ mdi_balance (4:1:1)", ("mc_idx", "think_format", "mdi_balance"), (4.0, 1.0, 1.0)),
    "mdi_group": Variant("+ mdi_group (4:1:1)", ("mc_idx", "think_format", "mdi_group"), (4.0, 1.0, 1.0)),
    "tprl_perturbation": Variant("+ TPRL, perturbation signal", ("mc_idx", "think_format"), (4.0, 1.0),
                                 "perturbation"),
    "tprl_attention": Variant("+ TPRL, attention signal", ("mc_idx", "think_format"), (4.0, 1.0), "attention"),
    "answer_visual_gain": Variant("+ answer_visual_gain (4:1:1)", ("mc_idx", "think_format", "answer_visual_gain"),
                                  (4.0, 1.0, 1.0), all_seeds=True),
    "tprl_counterfactual": Variant("+ TPRL, counterfactual as perturbation", ("mc_idx", "think_format"), (4.0, 1.0),
                                   "perturbation", COUNTERFACTUAL),
}


@dataclasses.dataclass
class Settings:
    steps: int = 120  # per-run step budget
    eval_every: int = 20
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)  # every seed for the baseline and answer_visual_gain ...
    seeds_other: int = 3  # ... the first 3 for the other variants
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
    counterfactual: str = _config_default("counterfactual_image")  # the runs' counterfactual image (the trainer's)
    reliance_everywhere: bool = True  # reliance_signals=True in every run, not only where a reward reads them
    kinds: tuple[str, ...] = counterfactual_kinds()  # measured on the warm-up model
    reliance_prompts: int = 200  # held-out conflict prompts of the reliance measurements (dev and test alike)
    # Development rows (DEV_SPLIT, conflict rate eval_conflict_rate): twice the test rows, so that their first
    # reliance_prompts conflict rows remain after the rows sharing an image with another split are dropped.
    n_dev: int = 800
    warmup_samples: int = 8  # sampled rollouts per prompt, warm-up model (every kind)
    # Sampled rollouts per prompt at the end of every run, the runs' kind only: 4, not 8, for time (8 would add
    # about 4 min of wall time to the 25 runs on 2 cores, from per-rollout timings while building this; 200 x 4
    # still gives each run hundreds of labelled rollouts). The report says what 8 would have cost.
    end_samples: int = 4
    n_boot: int = 1000  # bootstrap resamples of every AUROC interval

    def seeds_for(self, name: str) -> tuple[int, ...]:
        return self.seeds if VARIANTS[name].all_seeds else self.seeds[: self.seeds_other]


RUN_INDEPENDENT = ("seeds", "seeds_other", "variants", "kinds", "warmup_samples", "n_dev")
"""Settings that decide nothing inside a run (which runs exist, the warm-up's own measurement)."""


def prior_recipe(quick: bool = False) -> WarmupRecipe:
    """The shared warm-up: prior_color rows on which the prior holds 95% of the time (see the module docstring).
    --quick: 3 epochs, the fewest after which the model writes answers (1 epoch: none, so no rollout is labelled
    and the AUROC tables would stay empty; 3: accuracy 0.55 on 40 held-out rows, 7 s)."""
    return WarmupRecipe(kinds=("prior_color",), conflict_rate=0.05, epochs=3.0 if quick else 6.0)


def fingerprint(*parts) -> str:
    """A short hash of everything that decides a result: a finished file with another one is rerun."""
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def reusable(path: Path, settings_key: str, version: dict, reuse_other_code: bool = False) -> tuple[dict | None, str]:
    """The stored result at ``path`` if it may stand for this job, and a note for the log.

    The job's fingerprint is ``fingerprint(settings_key, version)``: the settings' hash and the code version. A
    record with that fingerprint is reused. One with the same settings from another code version (or from before
    the version was stored: its ``fingerprint`` is then the settings' hash itself) is rerun, since the reported
    figures must come from the code the section names, unless ``reuse_other_code``: then it is reused and the note
    (and the section, from its ``code_version``) says which version it came from. Anything else: rerun."""
    stored = json.loads(path.read_text()) if path.exists() else {}
    if stored and stored.get("fingerprint") == fingerprint(settings_key, version):
        return stored, ""
    if not stored or settings_key not in (stored.get("settings_key"), stored.get("fingerprint")):
        return None, ""
    other = describe_version(stored.get("code_version")) if stored.get("code_version") else \
        "an unrecorded code version"
    if reuse_other_code:
        return stored, f" (from {other}, --reuse_other_code)"
    return None, f"the stored result came from {other}, this is {describe_version(version)}: rerunning it"


def grpo_pool(s: Settings, recipe: WarmupRecipe):
    """The GRPO runs' prompts: ``s.n_pool`` rows of split train, seed data_seed + 1 (the warm-up's are seed
    data_seed), conflict rate ``s.pool_conflict_rate``."""
    return synthetic_dataset(s.n_pool, split="train", seed=recipe.data_seed + 1, kinds=recipe.kinds,
                             option_order=recipe.option_order, image_size=recipe.image_size,
                             conflict_rate=s.pool_conflict_rate)


def warmup_rows(recipe: WarmupRecipe):
    """The warm-up's training rows, as ``fixtures.warmup.warm_start`` draws them (the same arguments)."""
    return synthetic_dataset(recipe.n_train, split="train", seed=recipe.data_seed, kinds=recipe.kinds,
                             option_order=recipe.option_order, image_size=recipe.image_size,
                             blank_images=recipe.blank_images, conflict_rate=recipe.conflict_rate)


def dev_split(s: Settings, recipe: WarmupRecipe, test: HeldOut) -> HeldOut:
    """The development split: ``s.n_dev`` rows of ``DEV_SPLIT`` without any row whose image (its PNG bytes) also
    occurs in the test rows, the GRPO pool or the warm-up's rows. The split's own stream already makes the rows
    independent draws, but the image space is finite (the pool repeats 7 of its 2000 images; at the default sizes 4
    of the split's first 200 conflict rows share an image, with another question, with the test rows or the pool):
    dropping them makes disjointness a checked fact (tests/test_language_prior.py checks it), not a likely one."""
    taken = frozenset(image_keys(test.ds)) | frozenset(image_keys(grpo_pool(s, recipe))) \
        | frozenset(image_keys(warmup_rows(recipe)))
    return HeldOut(s, recipe, split=DEV_SPLIT, n=s.n_dev, blank=False, exclude=taken)


# ------------------------------------------------------------------------------------------------ evaluation


def shared_warmup(recipe: WarmupRecipe, held: HeldOut, work: Path, version: dict, log,
                  reuse_other_code: bool = False) -> tuple[Path, dict]:
    """The warm-up model and its held-out scores, trained once and reused by every run (and every rerun on the same
    code version; on another one it is trained again unless ``reuse_other_code``)."""
    key = fingerprint(dataclasses.asdict(recipe), torch.get_num_threads())
    model_dir, done = work / f"warmup-{key}", work / f"warmup-{key}.json"
    if done.exists():
        info = json.loads(done.read_text())
        stored = info.get("code_version")
        if stored == version or reuse_other_code:
            log(f"warm-up: reusing {model_dir}" + ("" if stored == version else
                f" (from {describe_version(stored)}, --reuse_other_code)"))
            return model_dir, {**info, "key": key}
        log(f"warm-up: the stored one came from {describe_version(stored)}, this is {describe_version(version)}: "
            "training it again")
    started_at = time.time()
    model, processor, info = warm_start(recipe, model_dir, overwrite=True, log=lambda m: log(f"  {m}"))
    info["started_at"] = started_at
    info["key"] = key
    info["code_version"] = version
    info["eval"] = held.evaluate(model, processor)
    info["eval_blank"] = held.evaluate(model, processor, blank=True)
    write_json(done, info)
    return model_dir, info


def warmup_reliance(model_dir: Path, held: HeldOut, s: Settings, log) -> dict:
    """The reliance experiment on the warm-up model under every counterfactual kind of ``s.kinds`` (a kind the
    processor cannot encode is left out, with the reason), on ``held``'s conflict rows: the test rows (the reported
    figures) or the development split (where the kind is chosen); the record names the split."""
    from transformers import AutoModelForImageTextToText

    from trl_mdi.data.images import row_images
    from trl_mdi.profile.reference import check_counterfactuals

    started_at = time.time()
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    processor = AutoProcessor.from_pretrained(model_dir)
    row = dict(held.conflict_rows(1)[0])
    kinds, unusable = [], {}
    for kind in s.kinds:
        try:
            check_counterfactuals(processor, row["prompt"], row_images(row), [kind])
            kinds.append(kind)
        except ValueError as err:
            unusable[kind] = str(err)
    out = held.reliance(model, processor, kinds, prompts=s.reliance_prompts, samples=s.warmup_samples,
                        max_new_tokens=s.max_completion_length, n_boot=s.n_boot)
    out.update(unusable=unusable, started_at=started_at, ended_at=time.time(), split=held.split,
               rows=len(held.ds), excluded=held.excluded)
    log(f"  warm-up reliance ({held.split}): {out['rollouts']} sampled rollouts of {out['prompts']} conflict prompts, "
        f"{len(kinds)} counterfactual kinds, {out['seconds']:.0f} s")
    return out


# --------------------------------------------------------------------------------------------------- GRPO


def recorder(run: dict, processor, held: HeldOut, s: Settings, log) -> EvaluateEvery:
    """Held-out scores every ``s.eval_every`` steps (their time kept out of the training time), each step's own time
    and the logged metrics, into ``run``."""

    def evaluate(model, step: int, elapsed: float) -> float:
        e = held.evaluate(model, processor)
        run["evals"].append({"step": step, "train_seconds": round(elapsed, 2), **e})
        log(f"  [{run['key']}] step {step:4d} {elapsed:6.1f} s  conflict {e['conflict']:.3f}  "
            f"non-conflict {e['plain']:.3f}  clean {e['clean']:.3f}  MDI all {e['mdi_all']:.3f} "
            f"late {e['mdi_late']:.3f}")
        return e["seconds"]

    def record_step(step: int, logs: dict) -> None:
        run["steps"].append({"step": step, **{k: v for k, v in logs.items() if k.startswith(LOGGED)}})

    return EvaluateEvery(evaluate, every(s.eval_every), step_seconds=run["step_seconds"], record_step=record_step)


def run_one(name: str, seed: int, model_dir: Path, warm: dict, pool, held: HeldOut, s: Settings, work: Path,
            log) -> dict:
    """One GRPO run from the shared warm-up: its evaluations, logged metrics, end-of-run reliance and times."""
    variant = VARIANTS[name]
    run = {"key": f"{name}-s{seed}", "variant": name, "seed": seed, "evals": [], "steps": [], "step_seconds": [],
           "load": [os.getloadavg()[0]], "started_at": time.time()}
    t0 = time.perf_counter()
    trainer = MDIGRPOTrainer(str(model_dir), args=grpo_config(variant, seed, s, work / "grpo" / run["key"]),
                             train_dataset=pool)
    for cb in (ConsoleSummaryCallback, PrinterCallback, ProgressCallback):  # keep the output readable
        trainer.remove_callback(cb)
    processor = AutoProcessor.from_pretrained(model_dir)
    # The warm-up's own scores are step 0: the same weights, greedy, the same rows.
    run["evals"].append({"step": 0, "train_seconds": 0.0, **warm["eval"]})
    callback = recorder(run, processor, held, s, log)
    trainer.add_callback(callback)
    trainer.train()
    run["grpo_seconds"] = callback.train_seconds()
    run["eval_seconds"] = callback.eval_seconds
    run["blank_final"] = held.evaluate(trainer.model, processor, blank=True)
    if s.end_samples and s.reliance_prompts:
        run["reliance_end"] = held.reliance(trainer.model, processor, [s.counterfactual], prompts=s.reliance_prompts,
                                            samples=s.end_samples, max_new_tokens=s.max_completion_length,
                                            n_boot=s.n_boot, seed=seed)
        t = run["reliance_end"]["kinds"][s.counterfactual]["table"]
        log(f"  [{run['key']}] end-of-run reliance ({s.counterfactual}): AUROC answer_visual_gain "
            f"{t.get('answer_visual_gain', {}).get('auroc')}, blind_agrees {t.get('blind_agrees', {}).get('auroc')}, "
            f"{run['reliance_end']['seconds']:.0f} s")
    run["wall_seconds"] = time.perf_counter() - t0
    run["load"].append(os.getloadavg()[0])
    run["ended_at"] = time.time()
    return run


_DATA: dict = {}


def execute(job: dict) -> tuple[dict | None, str | None]:
    """Run one job and save its JSON: a (variant, seed) run or the warm-up's reliance measurement. Returns
    ``(result, None)``, or ``(None, error)`` if it failed (``results.run_and_save``). The held-out rows and the GRPO pool
    are built once per process."""
    s, recipe, work = job["settings"], job["recipe"], job["work"]

    def body(log) -> dict:
        if "held" not in _DATA:
            _DATA["held"] = HeldOut(s, recipe)
        if job["what"] == "warmup_reliance":
            log("== reliance of the warm-up model, every counterfactual kind, test rows")
            return warmup_reliance(job["model_dir"], _DATA["held"], s, log)
        if job["what"] == "warmup_reliance_dev":
            log(f"== reliance of the warm-up model, every counterfactual kind, development split ({DEV_SPLIT})")
            return warmup_reliance(job["model_dir"], dev_split(s, recipe, _DATA["held"]), s, log)
        if "pool" not in _DATA:
            _DATA["pool"] = grpo_pool(s, recipe)
        log(f"== {job['name']}, seed {job['seed']}")
        return run_one(job["name"], job["seed"], job["model_dir"], job["warm"], _DATA["pool"], _DATA["held"], s,
                       work, log)

    # fingerprint: the settings and the code version; settings_key: the settings alone (--reuse_other_code matches it)
    return run_and_save(job, body, {"fingerprint": job["key"], "settings_key": job["settings_key"],
                                    "code_version": job["version"]})


def parse_settings(argv: list[str]) -> tuple[argparse.Namespace, Settings]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="pipeline check: seed 0, 4 steps, 40 held-out rows, a "
                   "3-epoch warm-up, reliance on 8 conflict prompts x 2 samples, in a fresh temporary work dir; "
                   "prints only (and the full benchmark's projected time) unless --write")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="default: all seven")
    p.add_argument("--seeds", type=int, nargs="+", help="GRPO seeds of answer_format and answer_visual_gain (default "
                   "0 1 2 3 4; --quick 0); the other variants run the first --seeds_other of them")
    p.add_argument("--seeds_other", type=int, help="how many of --seeds the other variants run (default 3)")
    p.add_argument("--steps", type=int, help="GRPO steps per run (default 120; --quick 4)")
    p.add_argument("--eval_every", type=int, help="steps between held-out evaluations (default 20; --quick 2)")
    p.add_argument("--n_eval", type=int, help="held-out rows, half conflict (default 400; --quick 40)")
    p.add_argument("--pool_conflict_rate", type=float, help="conflict rate of the GRPO prompts (default 0.5)")
    p.add_argument("--learning_rate", type=float, help="GRPO learning rate (default 3e-4)")
    p.add_argument("--counterfactual", choices=counterfactual_kinds(),
                   help=f"the runs' counterfactual image (counterfactual_image; default the trainer's, "
                   f"{_config_default('counterfactual_image')!r}); also TPRL's perturbation in tprl_counterfactual")
    p.add_argument("--kinds", nargs="+", choices=counterfactual_kinds(),
                   help="counterfactual kinds measured on the warm-up model (default: all)")
    p.add_argument("--reliance_prompts", type=int, help="held-out conflict prompts of the reliance measurements "
                   "(default 200; --quick 8; 0: no reliance measurement)")
    p.add_argument("--n_dev", type=int, help=f"rows of the development split {DEV_SPLIT!r}, where the "
                   "counterfactual kind is chosen (default 800, half conflict rows; --quick 80)")
    p.add_argument("--warmup_samples", type=int, help="rollouts sampled per prompt on the warm-up model (default 8)")
    p.add_argument("--end_samples", type=int, help="rollouts sampled per prompt at the end of each run (default 4; "
                   "0: no end-of-run measurement)")
    p.add_argument("--reliance_only_where_read", action="store_true", help="compute the reliance signals during "
                   "training only in the runs whose rewards read them (saves one forward per step elsewhere)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1, as learning_curve.py)")
    p.add_argument("--workers", type=int, default=2, help="jobs at a time, each in its own process (default 2: one "
                   "per core of the 2-core target machine; 1: one after the other, in this process)")
    p.add_argument("--work_dir", help=f"finished runs and the warm-up, for resuming (default {DEFAULT_WORK})")
    p.add_argument("--reuse_other_code", action="store_true", help="reuse stored results measured with another "
                   "code version (commit, uncommitted changes) instead of rerunning them; the section then lists "
                   "which jobs came from which version")
    p.add_argument("--png", default=str(ROOT / "benchmarks" / "language_prior.png"))
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="write the PNG and the RESULTS.md section (default unless "
                   "--quick)")
    g.add_argument("--no-write", action="store_true", help="print only")
    a = p.parse_args(argv)
    s = Settings()
    if a.quick:
        s.steps, s.eval_every, s.n_eval, s.seeds, s.n_pool, s.n_dev = 4, 2, 40, (0,), 64, 80
        s.reliance_prompts, s.warmup_samples, s.end_samples, s.n_boot = 8, 2, 2, 200
    s.seeds = tuple(a.seeds) if a.seeds else s.seeds
    s.seeds_other = s.seeds_other if a.seeds_other is None else a.seeds_other
    s.variants = tuple(a.variants) if a.variants else s.variants
    s.steps, s.eval_every, s.n_eval = a.steps or s.steps, a.eval_every or s.eval_every, a.n_eval or s.n_eval
    s.pool_conflict_rate = s.pool_conflict_rate if a.pool_conflict_rate is None else a.pool_conflict_rate
    s.learning_rate = a.learning_rate or s.learning_rate
    s.counterfactual = a.counterfactual or s.counterfactual
    s.kinds = tuple(a.kinds) if a.kinds else s.kinds
    for name in ("reliance_prompts", "warmup_samples", "end_samples", "n_dev"):
        if getattr(a, name) is not None:
            setattr(s, name, getattr(a, name))
    s.reliance_everywhere = not a.reliance_only_where_read
    if s.counterfactual == NO_IMAGE and "tprl_counterfactual" in s.variants:
        if a.variants:
            p.error("tprl_counterfactual needs an image as TPRL's perturbation and the counterfactual 'none' removes "
                    "it: choose another --counterfactual or leave the variant out of --variants")
        # The default list: leave it out (the report says so) rather than fail when the default kind is "none".
        s.variants = tuple(v for v in s.variants if v != "tprl_counterfactual")
    if min(s.reliance_prompts, s.warmup_samples, s.end_samples, s.seeds_other) < 0:
        p.error("--reliance_prompts, --warmup_samples, --end_samples and --seeds_other must be >= 0")
    return a, s


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a, s = parse_settings(argv)
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
        version = code_version(CODE_PATHS)
        log(f"code version: {describe_version(version)}")
        model_dir, warm = shared_warmup(recipe, held, work, version, log, a.reuse_other_code)
        w, b = warm["eval"], warm["eval_blank"]
        log(f"warm-up: conflict {w['conflict']:.3f}, non-conflict {w['plain']:.3f}, conflict rows answered with the "
            f"prior {w['prior_follow']:.3f}; blank images: non-conflict {b['plain']:.3f}; MDI all {w['mdi_all']:.3f}, "
            f"late {w['mdi_late']:.3f}")
        common = dict(settings=s, recipe=recipe, work=work, threads=a.threads, started=started, model_dir=model_dir,
                      version=version)
        jobs, done = [], {}

        def plan(label: str, path: Path, settings_key: str, **job) -> None:
            stored, note = reusable(path, settings_key, version, a.reuse_other_code)
            if stored is not None:
                log(f"== {label}: done earlier, {path}{note}")
                done[label] = (stored, None)
            else:
                if note:
                    log(f"== {label}: {note}")
                jobs.append({**common, **job, "label": label, "path": path, "key": fingerprint(settings_key, version),
                             "settings_key": settings_key})

        if s.reliance_prompts and s.warmup_samples and s.kinds:  # first: they run beside the first runs
            measured = {k: getattr(s, k) for k in ("kinds", "reliance_prompts", "warmup_samples",
                                                   "max_completion_length", "n_boot", "n_eval", "eval_conflict_rate")}
            key = fingerprint(warm["key"], measured, a.threads)
            plan("warmup_reliance", work / f"warmup-reliance-{key}.json", key, what="warmup_reliance")
            # The development split's rows depend on the test rows, the pool and the warm-up rows it excludes.
            key = fingerprint(warm["key"], measured, DEV_SPLIT, s.n_dev, s.n_pool, s.pool_conflict_rate, a.threads)
            plan("warmup_reliance_dev", work / f"warmup-reliance-dev-{key}.json", key, what="warmup_reliance_dev")
        for seed in s.seeds:  # every variant of a seed before the next seed: an interrupted run is comparable
            for name in s.variants:
                if seed not in s.seeds_for(name):
                    continue
                key = fingerprint({k: v for k, v in dataclasses.asdict(s).items() if k not in RUN_INDEPENDENT},
                                  dataclasses.asdict(recipe), dataclasses.asdict(VARIANTS[name]), seed, a.threads)
                plan(f"{name}-s{seed}", work / "runs" / f"{name}-s{seed}.json", key, what="run", name=name, seed=seed,
                     warm=warm)
        done |= run_pool(jobs, execute, a.workers)
    order = [f"{n}-s{sd}" for sd in s.seeds for n in s.variants if sd in s.seeds_for(n)]
    runs = [done[k][0] for k in order if done[k][0] is not None]
    failed = [(k, done[k][1]) for k in [*order, "warmup_reliance", "warmup_reliance_dev"]
              if k in done and done[k][0] is None]
    warm_rel = done.get("warmup_reliance", (None, None))[0]
    dev_rel = done.get("warmup_reliance_dev", (None, None))[0]
    load = os.getloadavg()[0]
    body = report(runs, warm, warm_rel, s, recipe, VARIANTS, argv, started, failed, load, a.workers, version,
                  dev_rel=dev_rel)
    print("\n" + body)
    if a.quick:
        print("\n" + "\n".join(projection_lines(runs, warm, warm_rel, s, Settings(), recipe, prior_recipe(False),
                                                VARIANTS, a.workers, dev_rel=dev_rel)))
    if failed:
        print(f"{len(failed)} job(s) failed: " + "; ".join(f"{k}: {e}" for k, e in failed))
        if write:
            print("not writing RESULTS.md or the plot: not every job finished")
        return 1
    if write:
        plot(runs, warm_rel, s, VARIANTS, Path(a.png), dev_rel=dev_rel)
        replace_section(SECTION, body, Path(a.results))
        print(f"wrote {a.png} and the section '{SECTION}' of {a.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
