"""The entry point's arguments: TrlParser over ScriptArguments, MDIGRPOConfig, ModelConfig and DataArguments, with
the CPU defaults installed as parser defaults and the provenance of every value (``ParsedRun``)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..config import MDIGRPOConfig, redeclared_grpo_fields
from ..data import DataArguments

SOURCE_CLI, SOURCE_YAML, SOURCE_OURS, SOURCE_LIBRARY = "cli", "yaml", "trl_mdi default", ""

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

    def __post_init__(self):
        # Typed and ranged like the training config's numbers, for flags and YAML keys alike.
        from ..config import NumberRule, check_number

        for name, example in (("min_pixels", "3136"), ("max_pixels", "401408")):
            setattr(self, name, check_number(NumberRule(name, int, 1, optional=True, example=example),
                                             getattr(self, name)))


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
    """The defaults this script installs on top of the dataclasses' (they only apply to flags the user left unset):
    only the machine's (a CPU run's). The recommended GRPO settings are MDIGRPOConfig's own defaults, so Python and
    the command line get the same run."""
    defaults: dict[str, Any] = {}
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
        with open(path, encoding="utf-8") as fh:
            content = yaml.safe_load(fh)
    except OSError as e:
        raise ValueError(f"cannot read --config {path!r}: {e}") from None
    except (UnicodeDecodeError, yaml.YAMLError) as e:  # a binary file (parquet, ...) or broken YAML syntax
        why = (f"byte {e.object[e.start:e.start + 1].hex()} at offset {e.start} is not UTF-8 text"
               if isinstance(e, UnicodeDecodeError) else " ".join(str(e).split()))
        raise ValueError(f"--config {path!r} is not readable YAML ({why}). --config takes a YAML file of flag names "
                         "and values, e.g. examples/configs/demo.yaml.") from None
    if not isinstance(content, dict):
        held = "nothing" if content is None else f"a {type(content).__name__}"
        raise ValueError(f"--config {path!r} is YAML but holds {held}, not a mapping of flag names to values "
                         "(e.g. 'learning_rate: 1.0e-6' on its own line).")
    refuse_duplicate_keys(path)
    return path, set(content) - {"env"}


def duplicate_yaml_keys(text: str) -> list[tuple[str, int, int]]:
    """``(key, first line, repeated line)`` of every key a YAML mapping of ``text`` sets twice (YAML loaders keep the
    last value silently), nested mappings included.

    >>> duplicate_yaml_keys("max_steps: 3\\nlr: 1\\nmax_steps: 5\\n")
    [('max_steps', 1, 3)]
    """
    import yaml

    found: list[tuple[str, int, int]] = []

    class _Loader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            try:
                key = loader.construct_object(key_node, deep=True)
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: YAML itself refuses it below
                continue
            if first != key_node.start_mark.line + 1:
                found.append((str(key), first, key_node.start_mark.line + 1))
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    _Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    return found


def refuse_duplicate_keys(path: str) -> None:
    """ValueError, one line, when the ``--config`` file sets a key twice: which value wins is a guess the user should
    not have to make."""
    with open(path, encoding="utf-8") as fh:
        duplicates = duplicate_yaml_keys(fh.read())
    if duplicates:
        shown = "; ".join(f"{key!r} on lines {a} and {b}" for key, a, b in duplicates[:5])
        raise ValueError(f"--config {path!r} sets a key twice ({shown}): YAML would silently keep the last value. "
                         "Keep one line per key.")


_KINDS = {"int": ("a whole number", "8"), "float": ("a number", "1e-06")}


def argparse_message(message: str, config_file: str | None = None, yaml_keys: set[str] = frozenset()) -> str:
    """argparse's error as one line, in the config checks' words: the field, the value and where it was set, the
    rule and a valid example (argparse converts YAML values too: TrlParser hands them over as string defaults).

    >>> argparse_message("argument --learning_rate/--learning-rate: invalid float value: 'abc'", "c.yaml",
    ...                  {"learning_rate"})
    "learning_rate: got 'abc' (set in --config c.yaml); it must be a number. Valid example: --learning_rate 1e-06 (or 'learning_rate: 1e-06' in a --config YAML)"
    """
    import re

    m = re.match(r"argument --(\w+)(?:/\S+)?: invalid (\w+) value: (.*)$", message)
    if not m:
        return " ".join(message.split())
    field, kind, value = m.groups()
    rule, example = _KINDS.get(kind, (f"a {kind}", "..."))
    where = f" (set in --config {config_file})" if field in yaml_keys else ""
    return (f"{field}: got {value}{where}; it must be {rule}. Valid example: --{field} {example} (or "
            f"'{field}: {example}' in a --config YAML)")


def parse_args(argv: Sequence[str] | None = None) -> ParsedRun:
    """Parse flags and the --config YAML file; raises ValueError for unknown flags or keys and invalid values."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    config_file, yaml_keys = _yaml_keys(argv)
    cli = _cli_dests(parser, argv)
    # "trl_mdi default": what this script installs, and the GRPOConfig fields whose default MDIGRPOConfig sets.
    ours = set(script_defaults()) | {f.name for f in redeclared_grpo_fields()}

    def one_line_error(message: str):  # argparse would print the whole usage, then exit
        raise UsageError(argparse_message(message, config_file, yaml_keys - cli))

    parser.error = one_line_error
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


