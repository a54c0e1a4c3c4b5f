"""The flags of ``python -m trl_mdi.profile`` and the checks that run before any weight is loaded.

The data flags are the entry point's own (``trl_mdi.data.DataArguments``: same names, help and defaults), less
the three that choose training and eval splits, which ``--split`` replaces here. Unknown flags are an error that
names the closest known flag, never argparse's silent prefix matching.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from collections.abc import Sequence
from pathlib import Path

from ..attention import QUERY_PHASES
from ..cli.arguments import ModelCheckError, UsageError
from ..data import DataArguments

PROG = "python -m trl_mdi.profile"
DTYPES = ("auto", "float32", "bfloat16", "float16")
# DataArguments fields that pick training / eval splits: a profile reads one split, chosen with --split.
TRAINING_SPLIT_FIELDS = ("dataset_train_split", "dataset_eval_split", "eval_split_size")
HELP_WIDTH = 100  # the width docs/profile.md shows --help at (tests compare it with this parser's output)


@dataclasses.dataclass
class ProfileArguments:
    """Everything the profile command was asked to do (data options are in ``data``)."""

    model_name_or_path: list[str]
    out: str
    data: DataArguments
    split: str | None = None
    num_samples: int = 64
    max_new_tokens: int = 32
    batch_size: int = 8
    query_phase: str = "completion"
    completion_column: str | None = None
    attn_implementation: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    threads: int = 0
    layer_segments: str = "thirds"
    min_pixels: int | None = None
    max_pixels: int | None = None
    trust_remote_code: bool = False
    progress: bool = True
    reliance: bool = False
    counterfactual_image: list[str] | None = None  # the kinds measured (["black"] when --reliance names none)
    samples_per_row: int = 0


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one (no "(default: None)" on required or unset flags)."""

    def __init__(self, prog, width: int | None = None):
        super().__init__(prog, width=width, max_help_position=30)

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.required:
            return action.help
        return super()._get_help_string(action)


def build_parser(width: int | None = None) -> argparse.ArgumentParser:
    """The command's parser; ``width`` fixes the help's line width (default: the terminal's, at most 100 columns)."""
    if width is None:
        import shutil

        width = min(shutil.get_terminal_size().columns - 2, HELP_WIDTH)
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False, formatter_class=lambda prog: _Formatter(prog, width),
        description="Per-layer attention profile of one or more VLM checkpoints: generate completions greedily (or "
        "take them from a column), measure every row with the exact attention probe, and write profile.md, "
        "profile.json, mdi_by_layer.png and mass_by_layer.png to --out. The measurement is exact whatever "
        "--attn_implementation is: under sdpa or eager the model's own kernel computes the layers, under others SDPA. "
        "--reliance adds a section on whether the answers come from the image: every rollout scored again with a "
        "counterfactual image (and reliance_*.png).")
    m = p.add_argument_group("models and output")
    m.add_argument("--model_name_or_path", nargs="+", required=True, metavar="M",
                   help="One or more models: local folders or Hub ids. Two or more of the same depth are compared "
                   "layer by layer, others by layer segment.")
    m.add_argument("--out", required=True, metavar="DIR", help="Output folder (created; the files it writes replaced).")
    r = p.add_argument_group("what to measure")
    r.add_argument("--split", metavar="NAME", help="Split to profile (default: the first present of validation, "
                   "val, eval, dev, test, else train).")
    r.add_argument("--num_samples", type=int, default=64, metavar="N",
                   help="Rows to profile, drawn with --seed (0: all rows).")
    r.add_argument("--max_new_tokens", type=int, default=32, metavar="N", help="Greedy completion length.")
    r.add_argument("--batch_size", type=int, default=8, metavar="N", help="Rows per generation and measurement batch.")
    r.add_argument("--query_phase", choices=QUERY_PHASES, default="completion",
                   help="completion: the generated tokens are the queries; prompt: the prompt text after the image "
                   "(no generation needed).")
    r.add_argument("--completion_column", metavar="COLUMN",
                   help="Take the completions from this text column instead of generating them.")
    r.add_argument("--layer_segments", default="thirds", metavar="SPEC",
                   help="Layer segments of the summary: 'thirds' or 'early:0-3,middle:4-7,late:8-11'.")
    c = p.add_argument_group("reliance on the image (docs/profile.md, section Reliance)")
    c.add_argument("--reliance", action="store_true",
                   help="Add the reliance section: accuracy with the image and with a counterfactual, the counterfactual "
                   "signals of every rollout and, with gold answers, how well each signal separates prior-following "
                   "rollouts (AUROC).")
    c.add_argument("--counterfactual_image", nargs="+", metavar="KIND",
                   help="Counterfactual image(s) of the reliance section (implies --reliance; default black): "
                   f"{', '.join(_counterfactual_kinds())} (none: the image removed, a text-only prompt).")
    c.add_argument("--samples_per_row", type=int, default=0, metavar="N",
                   help="Reliance section: completions sampled per row at temperature 1, besides the greedy one "
                   "(implies --reliance).")
    e = p.add_argument_group("model loading")
    e.add_argument("--attn_implementation", metavar="IMPL", help="The model's own attention (sdpa, eager, "
                   "flash_attention_2, ...), used for generation; the measurement is exact under any of them.")
    e.add_argument("--dtype", choices=DTYPES, default="auto", help="Weights dtype (auto: the checkpoint's).")
    e.add_argument("--device", default="auto", metavar="DEV",
                   help="cpu, cuda, cuda:1, ... (auto: cuda when available).")
    e.add_argument("--seed", type=int, default=0, metavar="N", help="Seed of the row sample and of torch.")
    e.add_argument("--threads", type=int, default=0, metavar="N", help="CPU threads for torch (0: torch's "
                   "default). A tiny model on a busy machine runs several times faster with 1.")
    for flag in ("min_pixels", "max_pixels"):
        e.add_argument(f"--{flag}", type=int, metavar="N",
                       help="The processor's pixel budget (Qwen-VL-style), as the entry point's flag.")
    e.add_argument("--trust_remote_code", action="store_true", help="Allow custom model code from the Hub.")
    e.add_argument("--no_progress", action="store_true", help="No progress bar.")
    d = p.add_argument_group("data (the entry point's flags)")
    for f in dataclasses.fields(DataArguments):
        if f.name in TRAINING_SPLIT_FIELDS:
            continue
        kind = int if f.type in ("int", int) else str
        d.add_argument(f"--{f.name}", type=kind, default=f.default, help=f.metadata.get("help", ""),
                       metavar=f.name.rsplit("_", 1)[-1].upper())
    return p


def parse_args(argv: Sequence[str]) -> ProfileArguments:
    """Parse and check the flags; UsageError (with the closest known flag for a typo) for anything wrong."""
    parser = build_parser()
    parser.error = _raise  # type: ignore[method-assign]  # one error style: ours, not argparse's exit
    ns, unknown = parser.parse_known_args(list(argv))
    if unknown:
        known = [o for a in parser._actions for o in a.option_strings]
        hints = [f"{u} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(u.split("=")[0], known, 1))
                 else u for u in unknown]
        raise UsageError(f"unknown flag(s): {', '.join(hints)}. See {PROG} --help")
    for name, minimum in (("num_samples", 0), ("max_new_tokens", 1), ("batch_size", 1), ("threads", 0),
                          ("samples_per_row", 0)):
        if getattr(ns, name) < minimum:
            raise UsageError(f"--{name} must be >= {minimum}, got {getattr(ns, name)}")
    repeated = sorted({m for m in ns.model_name_or_path if ns.model_name_or_path.count(m) > 1})
    if repeated:
        raise UsageError(f"--model_name_or_path lists {repeated} more than once: give each model once")
    _check_device(ns.device)
    _check_out_dir(ns.out)
    ns.reliance = ns.reliance or ns.counterfactual_image is not None or ns.samples_per_row > 0
    if ns.reliance:
        ns.counterfactual_image = _check_kinds(ns.counterfactual_image or ["black"])
    if ns.attn_implementation is not None:
        from transformers import AttentionInterface

        known = ["eager", *(k for k in AttentionInterface().valid_keys() if k != "trl_mdi_probe")]
        if ns.attn_implementation not in known:
            raise UsageError(f"--attn_implementation {ns.attn_implementation!r} is not one transformers knows; "
                             f"choose from {', '.join(known)}")
    from ..attention.metrics import check_segment_spec

    try:
        check_segment_spec(ns.layer_segments)
    except ValueError as e:
        raise UsageError(f"--layer_segments: {e}") from None
    data = DataArguments(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(DataArguments)
                            if f.name not in TRAINING_SPLIT_FIELDS})
    own = {f.name: getattr(ns, f.name) for f in dataclasses.fields(ProfileArguments) if f.name not in ("data", "progress")}
    return ProfileArguments(**own, data=data, progress=not ns.no_progress)


def _counterfactual_kinds() -> tuple[str, ...]:
    from ..counterfactual import counterfactual_kinds

    return counterfactual_kinds()


def _check_kinds(kinds: list[str]) -> list[str]:
    """--counterfactual_image: known kinds, each once."""
    known = _counterfactual_kinds()
    for kind in kinds:
        if kind not in known:
            close = difflib.get_close_matches(kind, known, 1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UsageError(f"--counterfactual_image {kind!r} is not a counterfactual kind{hint}; choose from "
                             f"{', '.join(known)}")
    repeated = sorted({k for k in kinds if kinds.count(k) > 1})
    if repeated:
        raise UsageError(f"--counterfactual_image lists {repeated} more than once: give each kind once")
    return list(kinds)


def _check_device(device: str) -> None:
    """A device torch can name and this machine has, before any weight loads."""
    if device == "auto":
        return
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError as e:
        raise UsageError(f"--device {device!r}: {e}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device!r}: this machine has no CUDA device; use --device cpu (or auto)")


def _check_out_dir(out: str) -> None:
    """--out must be a folder we can create and write: checked before hours of profiling, not after (and nothing is
    created for a run that fails its checks)."""
    path = Path(out).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"--out {out!r}: {str(existing)!r} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out!r}: {str(existing)!r} is not writable; choose another folder")


def _raise(message: str):
    raise UsageError(message)


def check_models(args: ProfileArguments) -> dict:
    """Each model's config, read without weights: a VLM whose config names its image token, with the segments
    fitting its layers. ModelCheckError / UsageError otherwise. Returns ``{model: config}``."""
    from ..attention.metrics import layer_segments
    from ..attention.model_facts import model_facts
    from ..cli.checks import check_vlm

    configs = {}
    for name in args.model_name_or_path:
        config = check_vlm(name, trust_remote_code=args.trust_remote_code)
        facts = model_facts(config)
        if not facts.is_vlm:
            raise ModelCheckError(f"{name!r}: its config names no image token id, so image tokens cannot be located")
        if not facts.measured_layers:
            raise ModelCheckError(f"{name!r}: none of its {facts.num_layers} text layers runs softmax attention "
                                  "(linear-attention layers only), so there is no attention to profile")
        try:
            layer_segments(facts.num_layers, args.layer_segments, list(facts.measured_layers))
        except ValueError as e:
            raise UsageError(f"--layer_segments on {name!r}: {e}") from None
        configs[name] = config
    return configs


def model_labels(names: Sequence[str]) -> list[str]:
    """Short, distinct labels for legends and headings: the folder or repo name, with a number when two collide.

    >>> model_labels(["runs/a/grpo", "Qwen/Qwen2.5-VL-3B-Instruct", "other/grpo"])
    ['grpo', 'Qwen2.5-VL-3B-Instruct', 'grpo (3)']
    """
    labels: list[str] = []
    for i, name in enumerate(names, 1):
        label = os.path.basename(os.path.normpath(name)) or name
        labels.append(f"{label} ({i})" if label in labels else label)
    return labels
