"""The training entry point behind ``examples/scripts/grpo_vlm.py``: parse, check, print, train, save.

What it adds to a bare ``TrlParser`` + ``MDIGRPOTrainer`` script, and why:

1. **Defaults, never overrides.** Recommended settings (``RECOMMENDED_DEFAULTS``: DAPO loss, epsilon_high 0.28,
   mask_truncated_completions) and, on a machine without an accelerator, ``bf16=False`` plus, when launched with
   several processes, ``ddp_backend="gloo"`` (and ``use_cpu=True`` without DeepSpeed): without them the processes
   of a CPU run do not see each other. They are installed as parser defaults, so a flag or the ``--config`` YAML
   file changes them like any other default.
2. **Provenance.** The effective configuration is printed at start (main process only), each value marked with
   where it came from: the command line, the YAML file, a trl_mdi default, or the library default.
3. **Fail before loading weights.** The model config must describe a vision-language model, the data must have an
   image and a prompt column and the labels the rewards read, and unknown flags are errors (TrlParser's own
   behaviour, kept). Input problems exit with status 2 and one message, no traceback.
4. **The model is passed by path**, so ``model_init_kwargs`` (dtype, attn_implementation) and DeepSpeed ZeRO-3's
   sharded initialisation apply at load time; the processor is loaded here so its pixel budget can be set from the
   command line (``--min_pixels`` / ``--max_pixels``; TRL 1.16 has no max_prompt_length).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import MDIGRPOConfig
from .data import DataArguments, DatasetError, TrainingData, check_label_columns, load_training_data
from .run_report import (  # noqa: F401  (re-exported: the entry point's public names)
    GRPO_KEY_FIELDS,
    MODEL_KEY_FIELDS,
    PEFT_FIELDS,
    RUN_KEY_FIELDS,
    SOURCE_CLI,
    SOURCE_LIBRARY,
    SOURCE_OURS,
    SOURCE_YAML,
    added_fields,
    describe_outputs,
    format_effective_config,
)

RECOMMENDED_DEFAULTS: dict[str, Any] = {
    "loss_type": "dapo",  # TRL 1.16's default too; pinned so a TRL release cannot change it under us
    "epsilon_high": 0.28,  # DAPO clip-higher
    "mask_truncated_completions": True,  # a cut-off completion has no answer: keep it out of the loss
}
"""GRPO settings recommended by the product brief, installed as parser defaults (a flag or YAML key wins)."""

CPU_DEFAULTS: dict[str, Any] = {"bf16": False}
"""Parser defaults on a machine without CUDA / XPU / MPS."""
CPU_MULTIPROCESS_DEFAULTS: dict[str, Any] = {"ddp_backend": "gloo"}
"""Parser defaults on such a machine when launched with several processes (WORLD_SIZE > 1). Not for a single
process: there, an explicit backend makes accelerate query a process group that was never created."""
CPU_DDP_DEFAULTS: dict[str, Any] = {"use_cpu": True}
"""Added for a multi-process CPU run without DeepSpeed (accelerate_configs/cpu_ddp.yaml): without use_cpu the
processes run but never gather from each other (2 rollouts where 4 were expected)."""



class UsageError(ValueError):
    """A flag combination or input the user must fix; the script prints it without a traceback and exits with 2."""


class ModelCheckError(UsageError):
    """The model (or its processor) cannot be trained by this script."""


@dataclasses.dataclass
class ScriptArguments:
    """Flags of the script itself (the processor's pixel budget, dry run)."""

    _argument_group_name = "script"

    min_pixels: int | None = dataclasses.field(
        default=None,
        metadata={"help": "Smallest image size in pixels (height x width) the processor resizes to, for Qwen-VL-style "
                  "processors (default: the processor's own)."},
    )
    max_pixels: int | None = dataclasses.field(
        default=None,
        metadata={"help": "Largest image size in pixels the processor resizes to (e.g. 401408 = 512*28*28), for "
                  "Qwen-VL-style processors: caps the image tokens per prompt (default: the processor's own)."},
    )
    eval_only: bool = dataclasses.field(
        default=False,
        metadata={"help": "Measure without training: generate on the eval split, compute every reward and the "
                  "attention metrics, write the Markdown logs and output_dir/eval_summary.json (accuracy, mean MDI "
                  "per segment). Use it on a base model or a checkpoint (--model_name_or_path DIR)."},
    )
    dry_run: bool = dataclasses.field(
        default=False,
        metadata={"help": "Check the model config, processor and data, print the effective configuration, and exit "
                  "without loading weights or training."},
    )


@dataclasses.dataclass
class ParsedRun:
    """Parsed arguments plus, for every flag name, where its value came from (see ``SOURCE_*``)."""

    script: ScriptArguments
    training: MDIGRPOConfig
    model: Any  # trl.ModelConfig
    data: DataArguments
    sources: dict[str, str]
    config_file: str | None = None

    def source(self, name: str) -> str:
        return self.sources.get(name, SOURCE_LIBRARY)


# ---------------------------------------------------------------------------------------------------- parsing


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the line breaks of multi-line help texts (the reward list) and wraps each line."""

    def _split_lines(self, text, width):
        lines = []
        for line in text.splitlines():
            lines += super()._split_lines(line, width) or [""]
        return lines


def _cpu_only() -> bool:
    import torch

    xpu = getattr(torch, "xpu", None)
    mps = getattr(torch.backends, "mps", None)
    return not (
        torch.cuda.is_available()
        or (xpu is not None and xpu.is_available())
        or (mps is not None and mps.is_available())
    )


def script_defaults() -> dict[str, Any]:
    """The defaults this script installs on top of the dataclasses' (they only apply to flags the user left unset)."""
    defaults = dict(RECOMMENDED_DEFAULTS)
    if _cpu_only():
        defaults.update(CPU_DEFAULTS)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            defaults.update(CPU_MULTIPROCESS_DEFAULTS)
            if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
                defaults.update(CPU_DDP_DEFAULTS)
    return defaults


def build_parser():
    """TrlParser over (ScriptArguments, MDIGRPOConfig, ModelConfig, DataArguments) with the script defaults."""
    from trl import ModelConfig, TrlParser

    # allow_abbrev=False: "--epsilon 0.3" must not be read as some other flag that starts the same way.
    parser = TrlParser((ScriptArguments, MDIGRPOConfig, ModelConfig, DataArguments), allow_abbrev=False,
                       formatter_class=_HelpFormatter,
                       description="GRPO for vision-language models with MDI/AEI attention metrics (trl_mdi). "
                       "Every flag can also be set in a YAML file given with --config; flags on the command line "
                       "win over the file.")
    parser.set_defaults(**script_defaults())
    return parser


def _cli_dests(parser, argv: Sequence[str]) -> set[str]:
    options = {opt: action.dest for action in parser._actions for opt in action.option_strings}
    return {options[tok.split("=", 1)[0]] for tok in argv if tok.startswith("-") and tok.split("=", 1)[0] in options}


def _yaml_keys(argv: Sequence[str]) -> tuple[str | None, set[str]]:
    import yaml

    if "--config" not in argv:
        return None, set()
    i = list(argv).index("--config")
    if i + 1 >= len(argv):
        raise ValueError("--config needs a YAML file path")
    path = argv[i + 1]
    try:
        with open(path) as fh:
            content = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read --config {path!r}: {e}") from None
    return path, set(content) - {"env"} if isinstance(content, dict) else set()


def parse_args(argv: Sequence[str] | None = None) -> ParsedRun:
    """Parse flags and the --config YAML file; raises ValueError for unknown flags or keys and invalid values."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    config_file, yaml_keys = _yaml_keys(argv)
    cli = _cli_dests(parser, argv)
    ours = set(script_defaults())
    script, training, model, data = parser.parse_args_and_config(argv)
    names = {f.name for dc in (script, training, model, data) for f in dataclasses.fields(dc)}
    sources = {}
    for name in names:
        if name in cli:
            sources[name] = SOURCE_CLI
        elif name in yaml_keys:
            sources[name] = SOURCE_YAML
        elif name in ours:
            sources[name] = SOURCE_OURS
    return ParsedRun(script, training, model, data, sources, config_file)


# ------------------------------------------------------------------------------------------ model and processor


def check_vlm(model_name_or_path: str | None, *, revision: str | None = None, trust_remote_code: bool = False):
    """The model's config, after checking it describes an image-text-to-text model; ModelCheckError otherwise."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if not model_name_or_path:
        raise ModelCheckError("no model given: pass --model_name_or_path (a local folder or a Hub id such as "
                              "Qwen/Qwen2.5-VL-3B-Instruct)")
    local = os.path.isabs(model_name_or_path) or model_name_or_path.startswith((".", "~"))
    if local and not os.path.exists(os.path.expanduser(model_name_or_path)):
        raise ModelCheckError(f"model path {model_name_or_path!r} does not exist")
    try:
        config = AutoConfig.from_pretrained(model_name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as e:  # OSError, ValueError, ...: one clear message either way
        raise ModelCheckError(f"cannot read a model config from {model_name_or_path!r} ({type(e).__name__}: {e}). "
                              "Give a folder holding config.json, or a Hub model id (needs network).") from e
    what = f"model_type {config.model_type!r}, architectures {getattr(config, 'architectures', None)}"
    if getattr(config, "vision_config", None) is None:
        raise ModelCheckError(
            f"{model_name_or_path!r} is not a vision-language model: its config ({what}) has no vision_config. "
            "trl_mdi trains image-text models such as Qwen2.5-VL (e.g. Qwen/Qwen2.5-VL-3B-Instruct)."
        )
    if not trust_remote_code and config.model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        raise ModelCheckError(
            f"{model_name_or_path!r} has a vision config but no image-text-to-text model class in transformers "
            f"({what}): it cannot generate text from images. Use a VLM such as Qwen2.5-VL."
        )
    return config


def check_segments(training_args, config) -> None:
    """--attention_layer_segments against the model's real layers (ranges, softmax-attention layers), as the trainer
    will check them, so that --dry_run catches 'early:0-99' on a 3-layer model."""
    from .attention.model_facts import model_facts
    from .drop_in import model_segment_names

    facts = model_facts(config)
    if not facts.is_vlm or training_args.compute_attention_metrics is False:
        return
    probe = copy.copy(training_args)  # the check must not decide the flag for the trainer
    probe.compute_attention_metrics = True
    try:
        model_segment_names(probe, facts)
    except ValueError as e:
        raise UsageError(f"--{e}") from None


def check_peft(model_args, config) -> None:
    """--use_peft without target modules fails deep inside PEFT for VLMs it has no default for: say so up front."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULT_TARGETS

    if not model_args.use_peft or model_args.lora_target_modules or model_args.lora_target_parameters:
        return
    if config.model_type not in DEFAULT_TARGETS:
        raise ModelCheckError(
            f"--use_peft: PEFT has no default LoRA target modules for model_type {config.model_type!r}; pass "
            "--lora_target_modules, e.g. q_proj k_proj v_proj o_proj (the language model's attention projections; "
            "Qwen-VL vision blocks name theirs qkv / proj) or all-linear (every linear layer but the output head, "
            "vision tower included)"
        )


def load_processor(model_name_or_path: str, *, revision: str | None = None, trust_remote_code: bool = False,
                   min_pixels: int | None = None, max_pixels: int | None = None):
    """AutoProcessor, with the image pixel budget replaced when min_pixels / max_pixels are given.

    Only Qwen-VL-style image processors (a ``merge_size`` and a size in total pixels, shortest_edge / longest_edge)
    have a pixel budget; for any other the flags are an error rather than silently ignored.
    """
    from transformers import AutoProcessor

    kwargs = {"revision": revision, "trust_remote_code": trust_remote_code}
    processor = AutoProcessor.from_pretrained(model_name_or_path, **kwargs)
    if min_pixels is None and max_pixels is None:
        return processor
    image_processor = getattr(processor, "image_processor", None)
    size = getattr(image_processor, "size", None)
    lo, hi = getattr(size, "shortest_edge", None), getattr(size, "longest_edge", None)
    if image_processor is None or not hasattr(image_processor, "merge_size") or lo is None or hi is None:
        raise ModelCheckError(
            f"--min_pixels / --max_pixels set the pixel budget of Qwen-VL-style image processors; "
            f"{type(image_processor).__name__} has size {size}. Drop the flags for this model."
        )
    lo, hi = min_pixels or lo, max_pixels or hi
    if lo > hi:
        raise ModelCheckError(f"min_pixels {lo} is larger than max_pixels {hi}")
    return AutoProcessor.from_pretrained(model_name_or_path, size={"shortest_edge": lo, "longest_edge": hi}, **kwargs)


def model_init_kwargs(model_args, training_args) -> dict[str, Any]:
    """from_pretrained kwargs from ModelConfig (revision, dtype, attn_implementation); --model_init_kwargs wins."""
    kwargs: dict[str, Any] = {"revision": model_args.model_revision, "dtype": model_args.dtype}
    if model_args.attn_implementation:
        kwargs["attn_implementation"] = model_args.attn_implementation
    kwargs.update(training_args.model_init_kwargs or {})
    return kwargs


def effective_rewards(training_args) -> tuple[list[str], list[float] | None]:
    """Reward names and weights the trainer will use (the same defaulting as MDIGRPOTrainer)."""
    from .rewards import default_reward_stack

    return default_reward_stack(training_args.reward_funcs, training_args.reward_weights)


def _check_reward_data(run: ParsedRun, data: TrainingData) -> None:
    from .rewards import required_reward_inputs, resolve_rewards
    from .scoring import is_attention_field

    names, weights = effective_rewards(run.training)
    functions = [n for n in names if "/" not in n or ":" in n]  # the others are reward model ids, loaded by TRL
    try:
        funcs = resolve_rewards(functions, weights if len(functions) == len(names) else None)[0]
    except (ValueError, TypeError) as e:
        raise UsageError(f"--reward_funcs / --reward_weights: {e}") from None
    computed = []
    if run.training.compute_attention_metrics is not False:  # None = on: the entry point only takes VLMs
        computed = [n for f in funcs for n in required_reward_inputs(f) if is_attention_field(n)]
    for name, ds in (("train", data.train), ("eval", data.eval)):
        if ds is not None:
            check_label_columns(funcs, [*ds.column_names, *computed], data.train_split if name == "train" else "eval")


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
    summary = {"accuracy": pick.get("rewards/mc_idx_reward/mean", pick.get("rewards/accuracy_reward/mean")),
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
        diag = trainer._diagnostics
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
        model_config = check_vlm(m.model_name_or_path, revision=m.model_revision,
                                 trust_remote_code=t.trust_remote_code)
        check_peft(m, model_config)
        check_segments(t, model_config)
        processor = load_processor(m.model_name_or_path, revision=m.model_revision,
                                   trust_remote_code=t.trust_remote_code, min_pixels=s.min_pixels,
                                   max_pixels=s.max_pixels)
        # The main process prepares (and caches) the data first; the others then read the cache.
        with t.main_process_first(desc="dataset preparation"):
            data = load_training_data(run.data, need_eval=t.eval_strategy != "no" or s.eval_only, seed=t.seed, log=log)
        _check_reward_data(run, data)
    except (UsageError, DatasetError) as e:
        return _fail(str(e))
    t.model_init_kwargs = model_init_kwargs(m, t)
    if is_main:
        print(format_effective_config(run, data), flush=True)
    if s.dry_run:
        log("dry run: configuration, model config, processor and data checked; exiting before training")
        return 0

    from trl import get_peft_config, get_quantization_config

    from .trainer import MDIGRPOTrainer

    trainer = MDIGRPOTrainer(
        model=m.model_name_or_path,  # a path: model_init_kwargs and ZeRO-3 sharded init apply at load time
        args=t,
        train_dataset=data.train,
        eval_dataset=data.eval if t.eval_strategy != "no" or s.eval_only else None,
        processing_class=processor,
        peft_config=get_peft_config(m),
        quantization_config=get_quantization_config(m),
    )
    if s.eval_only:
        return _evaluate_only(trainer, t, start, log)
    trainer.train(resume_from_checkpoint=t.resume_from_checkpoint)
    trainer.save_model(t.output_dir)  # model (gathered from ZeRO-3 shards) + processor
    if is_main:
        print(f"training done in {time.time() - start:.0f} s; outputs:\n{describe_outputs(t, start)}", flush=True)
    trainer.end()
    return 0
