"""The training entry point behind ``examples/scripts/grpo_vlm.py``: parse, check, print, train, save.

What it adds to a bare ``TrlParser`` + ``MDIGRPOTrainer`` script, and why:

1. **Defaults, never overrides.** On a machine without an accelerator, ``bf16=False`` plus, when launched with
   several processes, ``ddp_backend="gloo"`` (and ``use_cpu=True`` without DeepSpeed): without them the processes
   of a CPU run do not see each other. They are installed as parser defaults, so a flag or the ``--config`` YAML
   file changes them like any other default. The recommended GRPO settings (DAPO loss, epsilon_high 0.28,
   mask_truncated_completions, the 4:1:1 reward stack) are ``MDIGRPOConfig``'s own defaults: Python users get them
   too.
2. **Provenance.** The effective configuration is printed at start (main process only), each value marked with
   where it came from: the command line, the YAML file, a trl_mdi default, or the library default.
3. **One plan, decided before loading weights** (``trl_mdi.run_plan.plan_run``), printed, and handed to the
   trainer, which follows it: ``--dry_run`` prints the plan the run follows.
4. **Fail before loading weights.** The model config must describe a vision-language model, the data must have an
   image and a prompt column and the labels the rewards read, ``--use_vllm`` must be runnable here (vLLM installed,
   a ``--vllm_mode`` the machine can run), and unknown flags are errors (TrlParser's own behaviour, kept). So are an
   ``--output_dir`` whose saves would overwrite a model, a log path that is a directory, a model without processor
   files, images the processor refuses (dropped and counted, or an error with ``on_bad_image: error``) and prompts
   too long for the model's positions. Input problems exit with status 2 and one message, no traceback.
5. **The model is passed by path**, so ``model_init_kwargs`` (dtype, attn_implementation) and DeepSpeed ZeRO-3's
   sharded initialisation apply at load time; the processor is loaded here so its pixel budget can be set from the
   command line (``--min_pixels`` / ``--max_pixels``; TRL 1.16 has no max_prompt_length).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..checkpoints import (
    CheckpointError,
    already_trained,
    check_resume_matches,
    resolve_resume,
    resume_record,
)
from ..data import DatasetError, load_training_data
from ..data.images import ProcessorImageCheck
from ..data.lengths import check_prompt_lengths
from .arguments import UsageError, parse_args
from .checks import (
    answer_format_warning,
    check_image_token,
    check_log_paths,
    check_output_dir,
    check_peft,
    check_vllm,
    check_vlm,
    load_processor,
    model_init_kwargs,
    plan_entry_point,
)
from .run_report import describe_outputs, format_effective_config

# --------------------------------------------------------------------------------------------------------- main


def _is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _fail(message: str) -> int:
    if _is_main_process():
        print(f"error: {message}", file=sys.stderr, flush=True)
    return 2


def eval_summary(metrics: dict[str, float]) -> dict[str, Any]:
    """The headline numbers of an evaluation: accuracy, mean reward, mean MDI and balance per segment."""
    pick = {k.removeprefix("eval_"): v for k, v in metrics.items()}
    summary = {"accuracy": pick.get("rewards/mc_idx/mean", pick.get("rewards/accuracy/mean")),
               "reward": pick.get("reward")}
    summary.update({k: v for k, v in pick.items() if k.startswith(("attention/mdi", "attention/aei"))})
    summary.update({k: v for k, v in pick.items() if k.startswith("rewards/") and k.endswith("/mean")})
    return summary


def _evaluate_only(trainer, t, start: float, log) -> int:
    import json

    metrics = trainer.evaluate()
    summary = eval_summary(metrics)
    if t.process_index == 0:
        Path(t.output_dir).mkdir(parents=True, exist_ok=True)
        out = Path(t.output_dir) / "eval_summary.json"
        out.write_text(json.dumps({"summary": summary, "metrics": metrics}, indent=2, sort_keys=True))
        width = max(len(k) for k in summary)
        log("evaluation (no training):\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in summary.items()))
        diag = trainer.live_logs
        logs = [str(p) for p in (diag.rollout_path, diag.attention_path) if p.exists()] if diag else []
        log(f"summary: {out}\nMarkdown logs: {', '.join(logs) or 'off'}\ndone in {time.time() - start:.0f} s")
    trainer.end()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the script; returns the exit status (0 done, 2 bad input). Other errors propagate with a traceback."""
    start = time.time()
    try:
        run = parse_args(argv)
    except ValueError as e:  # unknown flags / YAML keys, invalid values (config __post_init__)
        return _fail(str(e))
    t, m, s = run.training, run.model, run.script
    is_main = t.process_index == 0
    log = print if is_main else (lambda *a, **k: None)
    try:
        check_vllm(t, m.model_name_or_path)  # --use_vllm with no vLLM, or a mode this machine cannot run: before anything loads
        check_output_dir(t.output_dir, m.model_name_or_path)  # never the model's own folder
        check_log_paths(t)
        # A checkpoint that lacks what resuming needs is refused before anything loads (the trainer's train() checks
        # again, for library use; "true" becomes the newest whole checkpoint).
        resume_from_checkpoint, _ = resolve_resume(t.resume_from_checkpoint, t.output_dir,
                                                   allow_partial=t.allow_partial_resume)
        if (done := already_trained(resume_from_checkpoint, t.max_steps, t.num_train_epochs)) is not None:
            log(done[1])  # a run already at its end: nothing loads, nothing is saved
            return 0
        model_config = check_vlm(m.model_name_or_path, revision=m.model_revision,
                                 trust_remote_code=t.trust_remote_code)
        check_peft(m, model_config)
        processor = load_processor(m.model_name_or_path, revision=m.model_revision,
                                   trust_remote_code=t.trust_remote_code, min_pixels=s.min_pixels,
                                   max_pixels=s.max_pixels)
        check_image_token(model_config, processor)
        # The main process prepares (and caches) the data first; the others then read the cache.
        image_check = ProcessorImageCheck(processor)  # what the processor refuses, and each image's tokens
        with t.main_process_first(desc="dataset preparation"):
            data = load_training_data(run.data, need_eval=t.eval_strategy != "no" or s.eval_only, seed=t.seed, log=log,
                                      image_check=image_check, on_bad_image=t.on_bad_image)
        check_prompt_lengths({data.train_split: data.train, "eval": data.eval}, processor, model_config,
                             t.max_completion_length, image_check, data.image_column)
        t.model_init_kwargs = model_init_kwargs(m, t)
        plan = plan_entry_point(run, data, processor, model_config)
        # What a resume must keep (model, num_generations, batch layout, reward stack), before any weight loads.
        check_resume_matches(resume_from_checkpoint, resume_record(
            model_config, t, processes=t.world_size, deepspeed=t.deepspeed_plugin is not None,
            reward_names=plan.reward_names, reward_weights=plan.reward_weights))
    except (UsageError, DatasetError, CheckpointError) as e:
        return _fail(str(e))
    if is_main:
        print(format_effective_config(run, data), flush=True)
        print(plan.describe(), flush=True)
        warning = answer_format_warning(run)
        if warning:
            print(warning, file=sys.stderr, flush=True)
    if s.dry_run:
        log("dry run: configuration, model config, processor and data checked; exiting before training")
        return 0

    from trl import get_peft_config, get_quantization_config

    from ..run_lock import RunLockedError
    from ..trainer import MDIGRPOTrainer

    try:
        trainer = MDIGRPOTrainer(
            model=m.model_name_or_path,  # a path: model_init_kwargs and ZeRO-3 sharded init apply at load time
            args=t,
            train_dataset=data.train,
            eval_dataset=data.eval if t.eval_strategy != "no" or s.eval_only else None,
            processing_class=processor,
            peft_config=get_peft_config(m),
            quantization_config=get_quantization_config(m),
            run_plan=plan,  # decided once, above: the trainer follows the plan the dry run prints
        )
    except RunLockedError as e:  # taken before any weight loads
        return _fail(str(e))
    if trainer.run_plan is not plan:  # lines that waited for the weights, now decided (or a revision, warned about)
        log(trainer.run_plan.describe())
    if s.eval_only:
        return _evaluate_only(trainer, t, start, log)
    try:
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    except CheckpointError as e:  # weights that do not fit the model: refused once read (trl_mdi.checkpoints)
        return _fail(str(e))
    trainer.save_model(t.output_dir)  # model (gathered from ZeRO-3 shards) + processor
    if is_main:
        print(f"training done in {time.time() - start:.0f} s; outputs:\n{describe_outputs(t, start)}", flush=True)
    trainer.end()
    return 0
