"""What the entry point prints: the effective configuration with each value's origin, and where a run's outputs are.

Kept apart from :mod:`trl_mdi.cli.command` (which parses, checks and trains) because it is read by people, not
by the run:
``format_effective_config`` is the start-of-run table (value and source: command line, ``--config`` file, a
trl_mdi default or the library's), ``describe_outputs`` the end-of-run list of files actually written.
"""

from __future__ import annotations

import dataclasses
import enum
import glob
import os
from collections.abc import Sequence
from typing import Any

from ..data import DataArguments, TrainingData
from ..rewards import default_reward_stack
from .arguments import SOURCE_CLI, SOURCE_OURS, SOURCE_YAML, ParsedRun
from .config_doc import added_fields

GRPO_KEY_FIELDS = (
    "loss_type", "beta", "epsilon", "epsilon_high", "num_generations", "max_completion_length", "temperature",
    "scale_rewards", "mask_truncated_completions", "top_entropy_quantile", "num_iterations", "learning_rate",
    "lr_scheduler_type", "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
    "max_steps", "num_train_epochs", "gradient_checkpointing", "use_vllm", "vllm_mode", "seed",
)
RUN_KEY_FIELDS = (
    "output_dir", "run_name", "logging_steps", "save_strategy", "save_steps", "eval_strategy", "eval_steps",
    "log_completions", "report_to", "bf16", "fp16", "use_cpu", "ddp_backend", "resume_from_checkpoint",
)
MODEL_KEY_FIELDS = ("model_name_or_path", "model_revision", "dtype", "attn_implementation", "trust_remote_code",
                    "model_init_kwargs", "min_pixels", "max_pixels", "use_peft")
PEFT_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_modules_to_save")



def _fmt(value: Any, width: int = 56) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, (list, tuple)):
        text = " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value) or "none"
    elif isinstance(value, float):
        text = f"{value:g}"
    else:
        text = str(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 3] + "..."


def format_effective_config(run: ParsedRun, data: TrainingData | None = None) -> str:
    """The start-of-run printout: sections of name / value / where the value came from."""
    t, m, s, d = run.training, run.model, run.script, run.data
    values = {**vars(d), **vars(s), **{f.name: getattr(m, f.name) for f in dataclasses.fields(m)}}
    rows: list[tuple[str, list[tuple[str, Any, str]]]] = []

    def field_rows(obj_names: Sequence[str]) -> list[tuple[str, Any, str]]:
        out = []
        for n in obj_names:
            v = getattr(t, n) if hasattr(t, n) and n not in values else values.get(n)
            source = run.source(n)
            if n == "model_init_kwargs" and source != SOURCE_CLI:
                source = "from the model flags" + (f" + {source}" if source else "")
            out.append((n, v, source))
        return out

    model_fields = list(MODEL_KEY_FIELDS) + (list(PEFT_FIELDS) if m.use_peft else [])
    rows.append(("model", field_rows(model_fields)))
    rows.append(("data", field_rows([f.name for f in dataclasses.fields(DataArguments)])))
    if data is not None:
        loaded = [(k, v if k != "eval split" or t.eval_strategy != "no" else "none (eval_strategy no)", "")
                  for k, v in data.describe()]
        rows.append(("data as loaded", loaded))
    names, weights = default_reward_stack(t.reward_funcs, t.reward_weights)
    reward_rows = [("reward_funcs", names, run.source("reward_funcs") or "trl_mdi default"),
                   ("reward_weights", weights if weights is not None else "1 each",
                    run.source("reward_weights") or ("trl_mdi default" if weights is not None else ""))]
    rows.append(("rewards", reward_rows))
    rows.append(("trl_mdi", field_rows([f.name for f in added_fields() if f.name != "reward_funcs"])))
    rows.append(("GRPO", field_rows(GRPO_KEY_FIELDS)))
    rows.append(("run", field_rows(RUN_KEY_FIELDS) + [("world_size", t.world_size, ""), ("dry_run", s.dry_run,
                                                                                          run.source("dry_run"))]))
    width = max(len(n) for _, section in rows for n, _, _ in section) + 2
    lines = ["=" * 100, "trl_mdi GRPO: effective configuration"
             + (f" (--config {run.config_file})" if run.config_file else ""),
             f"  last column: where the value comes from ({SOURCE_CLI} = command line, {SOURCE_YAML} = --config "
             f"file, {SOURCE_OURS} = trl_mdi's own (MDIGRPOConfig's or this script's), blank = TRL's or transformers')"]
    for title, section in rows:
        lines.append(f"[{title}]")
        for name, value, source in section:
            text = _fmt(value, 56 if title != "data as loaded" else 300)  # what was loaded is never cut
            lines.append(f"  {name:<{width}}{text:<58}{source}".rstrip())
    lines.append("=" * 100)
    return "\n".join(lines)


def _recent(patterns: Sequence[str], since: float) -> list[str]:
    found = set()
    for pattern in patterns:
        found.update(os.path.normpath(p) for p in glob.glob(pattern, recursive=True) if os.path.getmtime(p) >= since)
    return sorted(found)


def describe_outputs(training_args, since: float) -> str:
    """Where this run wrote its model, checkpoints, metrics and logs (files found on disk, not guessed)."""
    out = training_args.output_dir
    checkpoints = sorted(glob.glob(os.path.join(out, "checkpoint-*")), key=lambda p: int(p.rsplit("-", 1)[-1])
                         if p.rsplit("-", 1)[-1].isdigit() else -1)
    lines = [f"  final model + processor: {out}"]
    if checkpoints:
        lines.append(f"  checkpoints:             {', '.join(checkpoints[-3:])}")
        lines.append(f"  metrics (log_history):   {os.path.join(checkpoints[-1], 'trainer_state.json')}")
    if os.path.isdir(os.path.join(out, "completions")):
        lines.append(f"  completions (TRL):       {os.path.join(out, 'completions')}/")
    # Where trl_mdi's logs may be: output_dir, training_logs/ (the default; $TRL_MDI_LOG_DIR moves it), and the
    # folder of any *_dir / *_path field of the config (e.g. rollout_log_path); a log's attention maps sit in a
    # folder beside it.
    log_dir = os.environ.get("TRL_MDI_LOG_DIR", "training_logs")  # the default folder, as trl_mdi.diagnostics
    md_patterns = [os.path.join(out, "**", "*.md"), os.path.join(log_dir, "**", "*.md")]
    png_patterns = [os.path.join(out, "**", "*.png"), os.path.join(log_dir, "**", "*.png")]
    for name in [f.name for f in added_fields()]:
        value = getattr(training_args, name, None)
        if isinstance(value, str) and name.endswith(("_dir", "_path")):
            folder = value if name.endswith("_dir") else (os.path.dirname(value) or ".")
            md_patterns.append(os.path.join(folder, "*.md"))
            png_patterns.append(os.path.join(folder, "*", "*.png"))
    # README.md in output_dir is the model card Trainer.save_model writes, not a log.
    markdown = [p for p in _recent(md_patterns, since) if os.path.basename(p) != "README.md"]
    maps = _recent(png_patterns, since)
    for md in markdown:
        lines.append(f"  Markdown log:            {md}")
    if maps:
        folders = sorted({os.path.dirname(p) for p in maps})
        lines.append(f"  attention maps:          {len(maps)} PNG files in {', '.join(folders[:3])}")
    if not markdown and not maps:
        lines.append("  Markdown logs / attention maps: none written by this run")
    return "\n".join(lines)
