"""Checkpoints that are whole or refused: what a resume needs, the latest whole checkpoint, a failed save.

transformers' ``Trainer._save_checkpoint`` writes ``checkpoint-N/`` file by file (weights, optimizer, scheduler, RNG,
``trainer_state.json``; TRL's override adds a file after them), on every process. A save that dies half-way (full disk, ``kill -9``) leaves a folder that looks like a
checkpoint, and a resume from it either fails after the weights load or, without ``optimizer.pt``, silently restarts
Adam. Here:

- **Completion marker.** Once every process has finished a save, the main process writes ``trl_mdi_checkpoint.json``
  (every file of the folder with its size, and the run's log paths, so a resume continues the run's own logs). It is
  removed before a save into an existing folder starts, so a marker always describes a whole save.
- **A failed save** (any exception inside it) removes the partial folder and raises :class:`CheckpointSaveError`
  naming the cause: ``No space left on device`` rather than torch's ``unexpected pos``.
- **Resume checks** (:func:`resume_problems`), without loading anything: ``trainer_state.json``, the weights (full,
  sharded, or LoRA's ``adapter_model.safetensors``; under DeepSpeed the ``global_step*/`` shards ``latest`` names;
  under FSDP the ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` shard folders with every file their index names, or
  the full-state-dict files),
  ``optimizer.pt`` and ``scheduler.pt``; files cut short (a safetensors file shorter than its header says, a torch
  zip without its end record, a marker's size that differs). Missing optimizer, scheduler or trainer state may be
  accepted with ``allow_partial_resume``; missing weights and cut files never.

A checkpoint written before the marker existed (or by plain TRL) is judged by the file checks alone.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

MARKER = "trl_mdi_checkpoint.json"
TRAINER_STATE = "trainer_state.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_ADAPTER = ("adapter_model.safetensors", "adapter_model.bin")


class CheckpointError(ValueError):
    """A checkpoint a resume cannot use, or no usable checkpoint: the message names what is missing and the fix."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint save that failed; the partial folder is gone and the message names the cause."""


OPTIONAL = ("optimizer.pt", "scheduler.pt", TRAINER_STATE)  # state that may restart fresh (allow_partial_resume)


@dataclass(frozen=True)
class Problem:
    """One thing a resume from a checkpoint lacks (``cut``: the file is there but cut short, and why). ``optional``:
    ``allow_partial_resume`` may accept it (that state then restarts fresh); never for a cut file."""

    name: str
    optional: bool = False
    cut: str | None = None


# --------------------------------------------------------------------------------------------------- file checks
def cut_file(path: Path) -> str | None:
    """Why ``path`` is cut short (None: it looks whole), from its own framing, reading a few bytes only.

    safetensors: 8-byte header length, JSON header, data up to the largest offset. torch.save / DeepSpeed (zip): the
    central directory at the end. JSON: parses. Other files: None.
    """
    try:
        size = path.stat().st_size
        if path.suffix == ".safetensors":
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    return f"{size} bytes, shorter than a safetensors header"
                (n,) = struct.unpack("<Q", head)
                header = json.loads(f.read(n)) if 0 < n <= size - 8 else None
            if header is None:
                return f"{size} bytes, its header is cut"
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            return None if size >= 8 + n + end else f"{size} bytes of {8 + n + end}"
        if path.suffix in (".pt", ".bin", ".pth"):
            with open(path, "rb") as f:
                zipped = f.read(2) == b"PK"
            return "its zip archive has no end record (written part-way)" if zipped and not zipfile.is_zipfile(
                path) else None
        if path.suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        return f"unreadable ({type(e).__name__})"
    return None


# FSDP's checkpoint layouts (accelerate's save_fsdp_model / save_fsdp_optimizer, which transformers' Trainer calls
# under FSDP): SHARDED_STATE_DICT writes torch.distributed.checkpoint folders, every process its own files; the full
# state dict, one file each from the main process.
FSDP_MODEL_DIR, FSDP_OPTIMIZER_DIR = "pytorch_model_fsdp_0", "optimizer_0"
FSDP_MODEL_FILE, FSDP_OPTIMIZER_FILE = "pytorch_model_fsdp.bin", "optimizer.bin"


def fsdp_layout(folder: Path) -> bool:
    """Whether ``folder`` is a checkpoint saved under FSDP (sharded or full state dict)."""
    return (folder / FSDP_MODEL_DIR).is_dir() or (folder / FSDP_MODEL_FILE).is_file()


def dcp_problems(shards: Path, what: str) -> list[Problem]:
    """What a ``torch.distributed.checkpoint`` folder lacks: its ``.metadata`` index, or a shard file (``*.distcp``)
    the index names (read without loading any tensor)."""
    rel = shards.name
    if not (shards / ".metadata").is_file():
        return [Problem(f"{rel}/.metadata ({what}: the index of torch.distributed.checkpoint)")]
    try:
        from torch.distributed.checkpoint import FileSystemReader

        named = {item.relative_path for item in FileSystemReader(str(shards)).read_metadata().storage_data.values()}
    except Exception as e:  # noqa: BLE001 - an index that does not read is a cut file, whatever torch raises
        return [Problem(f"{rel}/.metadata", cut=f"unreadable ({type(e).__name__})")]
    if not named:
        return [Problem(f"{rel}/*.distcp ({what})")]
    return [Problem(f"{rel}/{name}") for name in sorted(named) if not (shards / name).is_file()]


def _weights_problems(folder: Path) -> list[Problem]:
    """The model's weights: under DeepSpeed the ``global_step*/`` shards (what DeepSpeed resumes from), else a full,
    sharded or LoRA adapter file."""
    latest = folder / "latest"
    if latest.is_file() or any(folder.glob("global_step*")):
        tag = latest.read_text().strip() if latest.is_file() else None
        shards = folder / tag if tag else None
        if shards is None or not shards.is_dir():
            return [Problem(f"the DeepSpeed shard folder {tag or 'global_step*/'}"
                            + (" named in 'latest'" if tag else " ('latest' is missing too)"))]
        out = []
        if not any(shards.glob("*model_states.pt")):
            out.append(Problem(f"{tag}/*model_states.pt (the model shards)"))
        if not any(shards.glob("*optim_states.pt")):
            out.append(Problem(f"{tag}/*optim_states.pt (the optimizer shards; DeepSpeed cannot resume without them)"))
        return out
    if fsdp_layout(folder):
        return (dcp_problems(folder / FSDP_MODEL_DIR, "the FSDP model shards") if (folder / FSDP_MODEL_DIR).is_dir()
                else [])
    if (folder / "adapter_config.json").is_file():
        return [] if any((folder / n).is_file() for n in _ADAPTER) else [Problem("adapter_model.safetensors (LoRA)")]
    if not any((folder / n).is_file() for n in (*_WEIGHTS, *_ADAPTER)):
        return [Problem("the model weights (model.safetensors, its shards, or adapter_model.safetensors)")]
    index = next((folder / n for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json")
                  if (folder / n).is_file()), None)
    if index is not None and not cut_file(index):
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [Problem(s) for s in shards if not (folder / s).is_file()]
    return []


def resume_problems(folder: str | os.PathLike) -> list[Problem]:
    """What a resume from ``folder`` lacks (empty: whole), without loading anything: the marker's files and sizes when
    there is one, the files resuming reads, and files cut short."""
    folder = Path(folder)
    if not folder.is_dir():
        return [Problem(f"the folder itself ({folder} does not exist or is not a folder)")]
    problems: list[Problem] = []
    listed: dict[str, int] = {}
    if (folder / MARKER).is_file():
        try:
            listed = json.loads((folder / MARKER).read_text(encoding="utf-8"))["files"]
        except (OSError, ValueError, KeyError):
            problems.append(Problem(MARKER, cut="unreadable"))
    for rel, size in listed.items():
        path = folder / rel
        if not path.is_file():
            problems.append(Problem(rel, optional=rel in OPTIONAL))
        elif path.stat().st_size != size:
            problems.append(Problem(rel, cut=f"{path.stat().st_size} bytes found, {size} saved"))
    deepspeed = (folder / "latest").is_file() or any(folder.glob("global_step*"))
    fsdp = fsdp_layout(folder)
    expected = [Problem(n, optional=True) for n in (TRAINER_STATE,) + (() if deepspeed else ("optimizer.pt",
                                                                                              "scheduler.pt"))
                if not (folder / n).is_file() and not (n == "optimizer.pt" and (folder / "optimizer.bin").is_file())
                and not (n == "optimizer.pt" and fsdp)]
    if fsdp:  # FSDP's optimizer: a sharded folder or the full file
        if (folder / FSDP_OPTIMIZER_DIR).is_dir():
            expected += dcp_problems(folder / FSDP_OPTIMIZER_DIR, "the FSDP optimizer shards")
        elif not (folder / FSDP_OPTIMIZER_FILE).is_file():
            expected.append(Problem(f"{FSDP_OPTIMIZER_DIR}/ or {FSDP_OPTIMIZER_FILE} (the FSDP optimizer state)",
                                    optional=True))
    named = {p.name for p in problems}
    problems += [p for p in expected + _weights_problems(folder) if p.name not in named]
    named = {p.name for p in problems}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel not in named and rel != MARKER and (why := cut_file(path)):
            problems.append(Problem(rel, cut=why))
    return problems


def describe(problems: list[Problem]) -> str:
    """'lacks optimizer.pt, scheduler.pt and has optimizer.pt cut (...)' style text. A file whose size differs from
    the size its save recorded says both sizes, and is "cut short" only when it is shorter: a file that grew has
    changed since the save.

    >>> describe([Problem("optimizer.pt", optional=True), Problem("model.safetensors", cut="10 bytes of 99")])
    'lacks optimizer.pt and has model.safetensors cut short (10 bytes of 99)'
    >>> describe([Problem("scheduler.pt", cut="1065 bytes found, 1064 saved")])
    'has scheduler.pt changed since the save (1065 bytes found, 1064 saved)'
    """
    def damage(why: str) -> str:
        sizes = re.fullmatch(r"(\d+) bytes found, (\d+) saved", why)
        grew = sizes is not None and int(sizes.group(1)) > int(sizes.group(2))
        return f"changed since the save ({why})" if grew else f"cut short ({why})"

    missing = [p.name for p in problems if p.cut is None]
    cut = [f"{p.name} {damage(p.cut)}" for p in problems if p.cut is not None]
    return " and ".join(([f"lacks {', '.join(missing)}"] if missing else []) + ([f"has {', '.join(cut)}"] if cut else []))


# --------------------------------------------------------------------------------------------------- resume
def checkpoints_newest_first(output_dir: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-N`` folders of ``output_dir``, highest N first."""
    root = Path(output_dir)
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))] \
        if root.is_dir() else []
    return [p for _, p in sorted(found, reverse=True)]


def resolve_resume(value: str | bool | None, output_dir: str | os.PathLike, *,
                   allow_partial: bool = False) -> tuple[str | None, list[str]]:
    """The checkpoint to resume from and warnings to print; :class:`CheckpointError` when there is none usable.

    ``value``: None / False (no resume), True or ``"true"`` (the newest *whole* checkpoint of ``output_dir``; an
    incomplete newer one is skipped with a warning), or a path (refused if it lacks anything resuming needs, unless
    ``allow_partial`` and only optional state is missing).
    """
    if value is None or value is False or (isinstance(value, str) and value.lower() in ("", "false")):
        return None, []
    if value is True or (isinstance(value, str) and value.lower() == "true" and not Path(value).exists()):
        skipped, partial = [], None
        for folder in checkpoints_newest_first(output_dir):
            problems = resume_problems(folder)
            if not problems:
                notes = [f"resume: skipped {p} (incomplete: it {why})" for p, why in skipped]
                return str(folder), notes
            skipped.append((folder.name, describe(problems)))
            if partial is None and allow_partial and all(p.optional for p in problems):
                partial = (folder, problems)
        if partial is not None:
            folder, problems = partial
            return str(folder), [f"resume: skipped {p} (incomplete: it {why})" for p, why in skipped
                                 if p != folder.name] + [_partial_note(folder, problems)]
        what = "; ".join(f"{p} {why}" for p, why in skipped) or "it holds no checkpoint-N folder"
        raise CheckpointError(f"--resume_from_checkpoint true: no whole checkpoint in {output_dir} ({what}). "
                              "Start without --resume_from_checkpoint, or name a checkpoint folder")
    folder = Path(value)
    if not folder.is_dir():
        found = [p.name for p in checkpoints_newest_first(output_dir) if not resume_problems(p)]
        raise CheckpointError(f"--resume_from_checkpoint {folder}: no such folder. Whole checkpoints in {output_dir}: "
                              f"{', '.join(found) or 'none'} (or pass true for the newest whole one)")
    problems = resume_problems(folder)
    if not problems:
        return str(folder), []
    if allow_partial and all(p.optional for p in problems):
        return str(folder), [_partial_note(folder, problems)]
    whole = next((p for p in checkpoints_newest_first(folder.parent) if p != folder and not resume_problems(p)), None)
    earlier = f"resume from {whole} (whole), or " if whole else ""
    fix = (f"{earlier}set allow_partial_resume: true to resume without it (that state restarts fresh)"
           if all(p.optional for p in problems) else f"{earlier}start afresh (weights and cut files cannot be skipped)")
    raise CheckpointError(f"cannot resume from {folder}: it {describe(problems)}, which resuming needs. Fix: {fix}")


def _partial_note(folder: Path, problems: list[Problem]) -> str:
    return (f"resume from {folder} (allow_partial_resume): it {describe(problems)}; that state restarts fresh "
            "(a missing optimizer.pt or scheduler.pt: both, as transformers loads them only together)")


def recorded_logs(folder: str | os.PathLike | None) -> dict[str, str] | None:
    """The log paths the run that saved ``folder`` wrote to (its marker), None when not recorded."""
    if folder is None:
        return None
    try:
        return json.loads((Path(folder) / MARKER).read_text(encoding="utf-8")).get("logs") or None
    except (OSError, ValueError, AttributeError):
        return None


# --------------------------------------------------------------------------------------------------- resume settings
def resume_record(model_config, args, *, processes: int, deepspeed: bool, reward_names, reward_weights) -> dict:
    """What a resume from a checkpoint must match, recorded in its marker at the save: the model (its type and every
    size of its config), ``num_generations``, the batch layout (per process, and the world size), the reward stack.
    ``args``: the run's config; ``reward_weights`` None means 1 each."""
    names = [str(n) for n in reward_names]
    weights = [float(w) for w in reward_weights] if reward_weights is not None else [1.0] * len(names)
    return {
        "model": {"name": str(getattr(model_config, "_name_or_path", "") or "") or "a model built in code",
                  "type": str(model_config.model_type), "sizes": _config_sizes(model_config.to_dict())},
        "num_generations": int(args.num_generations),
        "batch": {"per_device_train_batch_size": int(args.per_device_train_batch_size),
                  "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
                  "steps_per_generation": int(args.steps_per_generation or args.gradient_accumulation_steps),
                  "num_iterations": int(args.num_iterations), "processes": int(processes),
                  "deepspeed": bool(deepspeed)},
        "rewards": {"names": names, "weights": weights},
    }


def check_resume_matches(folder: str | os.PathLike | None, now: dict) -> None:
    """:class:`CheckpointError` when this run (``now``, :func:`resume_record`) differs from the run that saved
    ``folder`` in anything a resume must keep: one line naming the setting, both values and the way to proceed. The
    batch layout must give the same rollouts per optimizer step and per generation batch (the data order and each
    step's update depend on them); the number of processes itself only where the checkpoint is per process
    (DeepSpeed). A checkpoint without a record (saved before it existed, or by plain TRL) is not checked.

    >>> cfg = type("C", (), {"model_type": "m", "_name_or_path": "m", "to_dict": lambda self: {"hidden_size": 8}})()
    >>> args = type("A", (), dict(num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=1,
    ...                           steps_per_generation=1, num_iterations=1))()
    >>> record = resume_record(cfg, args, processes=1, deepspeed=False, reward_names=["r"], reward_weights=None)
    >>> _resume_mismatch(record, {**record, "num_generations": 8}, "ck")
    'num_generations: 4 in the run that saved ck, 8 in this one. Resume with num_generations 4, or start a new run from its weights (--model_name_or_path ck, without --resume_from_checkpoint)'
    """
    if folder is None:
        return
    try:
        saved = json.loads((Path(folder) / MARKER).read_text(encoding="utf-8")).get("resume")
    except (OSError, ValueError, AttributeError):
        return
    if saved and (problem := _resume_mismatch(saved, now, str(folder))):
        raise CheckpointError(f"cannot resume from {folder}: {problem}")


def _resume_mismatch(saved: dict, now: dict, folder: str) -> str | None:
    fresh = f"start a new run from its weights (--model_name_or_path {folder}, without --resume_from_checkpoint)"
    a, b = saved["model"], now["model"]
    if a["type"] != b["type"]:
        return (f"model: the run that saved it trained a {a['type']} model ({a['name']}), this one loads a "
                f"{b['type']} ({b['name']}). Resume with the model it was saved from (--model_name_or_path "
                f"{a['name']})")
    differ = [k for k in sorted(a["sizes"].keys() | b["sizes"].keys()) if a["sizes"].get(k) != b["sizes"].get(k)]
    if differ:
        k = differ[0]
        return (f"model: its config's {k} is {a['sizes'].get(k)} in the model it was saved from ({a['name']}), "
                f"{b['sizes'].get(k)} in this run's ({b['name']})"
                + (f", and {len(differ) - 1} more sizes differ" if len(differ) > 1 else "")
                + f". Resume with the model it was saved from (--model_name_or_path {a['name']})")
    if saved["num_generations"] != now["num_generations"]:
        return (f"num_generations: {saved['num_generations']} in the run that saved {folder}, "
                f"{now['num_generations']} in this one. Resume with num_generations {saved['num_generations']}, or "
                f"{fresh}")
    x, y = saved["batch"], now["batch"]
    if _layout(x)[1:] != _layout(y)[1:] or ((x["deepspeed"] or y["deepspeed"]) and x["processes"] != y["processes"]):
        why = (" (DeepSpeed saves its optimizer and weights per process)"
               if _layout(x)[1:] == _layout(y)[1:] else "")
        return (f"batch layout: {_layout(x)[0]} in the run that saved {folder}, {_layout(y)[0]} in this one{why}. "
                f"Resume with the saved layout, or {fresh}")
    r, q = saved["rewards"], now["rewards"]
    if r["names"] != q["names"] or any(abs(u - v) > 1e-9 for u, v in zip(r["weights"], q["weights"])):
        return (f"reward stack: {_stack(r)} in the run that saved {folder}, {_stack(q)} in this one. Resume with "
                f"--reward_funcs {' '.join(r['names'])} --reward_weights {' '.join(f'{w:g}' for w in r['weights'])}, "
                f"or {fresh}")
    return None


def _layout(b: dict) -> tuple[str, int, int, int]:
    """Words for a batch layout, then what must stay equal: rollouts per optimizer step, per generation batch, and
    num_iterations."""
    step = b["per_device_train_batch_size"] * b["gradient_accumulation_steps"] * b["processes"]
    generation = b["per_device_train_batch_size"] * b["steps_per_generation"] * b["processes"]
    words = (f"per_device_train_batch_size {b['per_device_train_batch_size']} x gradient_accumulation_steps "
             f"{b['gradient_accumulation_steps']} x {b['processes']} processes ({step} rollouts per step, "
             f"steps_per_generation {b['steps_per_generation']}, num_iterations {b['num_iterations']})")
    return words, step, generation, b["num_iterations"]


def _stack(r: dict) -> str:
    return ", ".join(f"{n} x{w:g}" for n, w in zip(r["names"], r["weights"])) or "none"


def _config_sizes(config: dict, prefix: str = "") -> dict[str, int]:
    """Every size of a model config (``*_size``, ``num_*``, ``depth``, in sub-configs too) by dotted name: what a
    checkpoint's tensors are shaped by."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_config_sizes(value, f"{prefix}{key}."))
        elif isinstance(value, int) and not isinstance(value, bool) and (
                key.endswith("_size") or key.startswith("num_") or key == "depth"):
            out[prefix + key] = value
    return out


def already_trained(folder: str | os.PathLike | None, max_steps: int,
                    num_train_epochs: float) -> tuple[int, str] | None:
    """``(step, line to print)`` when ``folder``'s run has already reached this run's end (``max_steps``, or with
    ``max_steps`` <= 0 the step count the saved run computed for the same ``num_train_epochs``): a resume would have
    nothing to train (transformers would run one more step and save past the end). None otherwise."""
    if folder is None:
        return None
    try:
        state = json.loads((Path(folder) / TRAINER_STATE).read_text(encoding="utf-8"))
        step = int(state["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if max_steps > 0:
        end, what = max_steps, f"max_steps is {max_steps}"
    elif state.get("max_steps") and state.get("num_train_epochs") == num_train_epochs:
        end, what = int(state["max_steps"]), f"num_train_epochs {num_train_epochs:g} ends at step {state['max_steps']}"
    else:
        return None
    if step < end:
        return None
    return step, (f"nothing to train: {folder} is at step {step} and {what}. Raise --max_steps (or "
                  "--num_train_epochs) to train on from it")


# --------------------------------------------------------------------------------------------------- loading weights
def holds_full_weights(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a whole model's weights (``model.safetensors``, ``pytorch_model.bin`` or a shard index
    of either), as opposed to a LoRA adapter or only DeepSpeed's ``global_step*/`` shards."""
    return any((Path(folder) / n).is_file() for n in _WEIGHTS)


def load_full_weights(model, folder: str | os.PathLike) -> None:
    """Load the whole-model weights saved in ``folder`` into ``model`` (a transformers ``PreTrainedModel``) in place,
    converted as ``from_pretrained`` converts them; :class:`CheckpointError` when any tensor stays unloaded.

    ``save_pretrained`` writes the Hub layout (``revert_weight_conversion``: Qwen2.5-VL's ``model.visual.*`` saved as
    ``visual.*``, LLaVA's ``model.language_model.*`` as ``language_model.model.*``, MoE experts split per expert), and
    that layout stays as saved (vLLM and the Hub read it). transformers' Trainer reloads it with
    ``load_state_dict(strict=False)`` and no conversion, so most tensors kept their old values behind a warning. Here
    the checkpoint goes through transformers' own loader (``convert_and_load_state_dict_in_model`` with the model's
    conversion mapping, as in ``from_pretrained``). That loader puts new ``Parameter`` objects on the modules; each
    value is copied into the model's own tensor and that tensor put back, so that devices, ``requires_grad``, tied
    weights and whatever holds a reference (an optimizer, DDP) are unchanged. Every model tensor must load, except the
    tied ones and ``_keys_to_ignore_on_save`` (never saved); a checkpoint tensor that fits no model tensor, a shape
    that differs or a failed conversion refuse as well.
    """
    import torch
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    folder = Path(folder)
    slots = [(module, name, tensor) for module in model.modules()
             for name, tensor in (*module._parameters.items(), *module._buffers.items()) if tensor is not None]
    conversions = model.__dict__.get("_weight_conversions", _UNSET)  # what a later save reverts: left as it was
    config = LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(model))
    with _saved_tensors(folder) as state_dict:
        try:
            info, _ = convert_and_load_state_dict_in_model(model, state_dict, config)
        finally:
            with torch.no_grad():
                for module, name, own in slots:
                    loaded = getattr(module, name)
                    if loaded is not own:
                        own.copy_(loaded)
                        setattr(module, name, own)
            if conversions is _UNSET:
                model.__dict__.pop("_weight_conversions", None)
            else:
                model._weight_conversions = conversions
    skipped = set(getattr(model, "all_tied_weights_keys", None) or ()) | set(model._keys_to_ignore_on_save or ())
    unloaded = sorted(set(info.missing_keys) - skipped)
    unexpected = sorted(info.unexpected_keys)
    mismatched = sorted(f"{k} ({tuple(saved)} saved, {tuple(ours)} here)" for k, saved, ours in info.mismatched_keys)
    failed = sorted(getattr(info, "conversion_errors", None) or ())
    if unloaded or unexpected or mismatched or failed:
        total = len(model.state_dict())
        parts = [f"{len(unloaded)} of the model's {total} tensors found no weights in it ({_some(unloaded)})"
                 if unloaded else "",
                 f"{len(unexpected)} of its tensors fit no tensor of the model ({_some(unexpected)})" if unexpected else "",
                 f"{len(mismatched)} differ in shape ({_some(mismatched)})" if mismatched else "",
                 f"{len(failed)} failed to convert ({_some(failed)})" if failed else ""]
        raise CheckpointError(
            f"the weights in {folder} do not fit this model ({type(model).__name__}{_saved_as(folder)}): "
            f"{'; '.join(p for p in parts if p)}. Continuing would train those tensors from their current values, "
            "not the checkpoint's. Fix: resume with the model the checkpoint was saved from, or start afresh")


def check_adapter_loaded(model, folder: str | os.PathLike) -> None:
    """After transformers loaded a LoRA (PEFT) checkpoint into ``model``: its active adapter holds exactly the saved
    tensors; :class:`CheckpointError` naming those that did not load (PEFT only warns, and training would continue
    with them freshly initialised). A no-op for a model without adapters or a folder without an adapter file."""
    import torch

    folder = Path(folder)
    files = [folder / n for n in _ADAPTER if (folder / n).is_file()]
    if not files or not is_peft_model(model):
        return
    from peft.utils import get_peft_model_state_dict

    if files[0].suffix == ".safetensors":
        from safetensors.torch import load_file

        saved = load_file(files[0])
    else:
        saved = torch.load(files[0], map_location="cpu", weights_only=True)
    ours = get_peft_model_state_dict(model, adapter_name=model.active_adapters[0])
    unloaded = sorted(ours.keys() - saved.keys())
    unexpected = sorted(saved.keys() - ours.keys())
    differ = sorted(k for k in ours.keys() & saved.keys()
                    if not torch.equal(ours[k].detach().cpu(), saved[k].to(ours[k].dtype)))
    if unloaded or unexpected or differ:
        parts = [f"{len(unloaded)} of the adapter's {len(ours)} tensors are not in it ({_some(unloaded)})"
                 if unloaded else "",
                 f"{len(unexpected)} of its tensors fit no adapter tensor ({_some(unexpected)})" if unexpected else "",
                 f"{len(differ)} did not load ({_some(differ)})" if differ else ""]
        raise CheckpointError(
            f"the LoRA adapter in {folder} does not fit this model's adapter: {'; '.join(p for p in parts if p)}. "
            "Fix: resume with the LoRA settings (peft_config, target modules) and model it was saved with, or start "
            "afresh")


def is_peft_model(model) -> bool:
    """Whether ``model`` is a PEFT wrapper (its checkpoints hold an adapter, loaded by PEFT)."""
    from peft import PeftMixedModel, PeftModel

    return isinstance(model, (PeftModel, PeftMixedModel))


_UNSET = object()


class _saved_tensors:
    """The tensors of a checkpoint's whole-model weights, file or shards, as a dict: safetensors read lazily (slices
    that ``from_pretrained``'s loader materialises one by one), ``.bin`` files memory-mapped."""

    def __init__(self, folder: Path):
        self.folder, self.handles = folder, []

    def __enter__(self) -> dict:
        import torch
        from safetensors import safe_open

        index = next((self.folder / n for n in _WEIGHTS if n.endswith(".index.json") and (self.folder / n).is_file()),
                     None)
        if index is not None:
            files = [self.folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        else:
            files = [next(self.folder / n for n in _WEIGHTS if (self.folder / n).is_file())]
        tensors = {}
        for file in files:
            if file.suffix == ".safetensors":
                handle = safe_open(str(file), framework="pt", device="cpu")
                self.handles.append(handle)
                tensors.update({k: handle.get_slice(k) for k in handle.keys()})
            else:
                tensors.update(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
        return tensors

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.__exit__(None, None, None)


def _some(names: list[str], n: int = 3) -> str:
    """'a, b, c and 4 more'

    >>> _some(["a", "b", "c", "d", "e"])
    'a, b, c and 2 more'
    """
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _saved_as(folder: Path) -> str:
    """'; saved from Qwen2_5_VLForConditionalGeneration' when the checkpoint's config.json names its class."""
    try:
        saved = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return ""
    return f"; the checkpoint was saved from {', '.join(saved)}" if saved else ""


# --------------------------------------------------------------------------------------------------- saving
def clear_marker(folder: str | os.PathLike) -> None:
    """Before a save into ``folder`` starts: an existing marker would vouch for files about to be replaced."""
    (Path(folder) / MARKER).unlink(missing_ok=True)


def mark_complete(folder: str | os.PathLike, logs: dict[str, str] | None = None, resume: dict | None = None) -> None:
    """Write the marker (every file and its size; ``logs``; ``resume``: what a resume must match,
    :func:`resume_record`) once every process finished the save: atomically, a temporary file renamed into place."""
    folder = Path(folder)
    files = {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != MARKER and not p.name.startswith(f".{MARKER}")}
    tmp = folder / f".{MARKER}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"version": 1, "files": files, "logs": logs or {}, **({"resume": resume} if resume else {})}, f,
                  indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MARKER)


def save_failure(folder: str | os.PathLike, error: BaseException, *, remove: bool) -> CheckpointSaveError:
    """The error to raise for a save of ``folder`` that failed with ``error``, after removing the partial folder when
    ``remove`` (the main process): the cause in words (an OSError's strerror anywhere in the chain; torch's
    short-write errors, such as ``unexpected pos``, read as "No space left on device" when the disk is (nearly) full,
    which is what they mean there), the file being written (the folder's newest), the latest whole checkpoint."""
    folder = Path(folder)
    cause, e = None, error
    while e is not None and cause is None:
        if isinstance(e, OSError) and e.errno:
            cause = os.strerror(e.errno)
        e = e.__cause__ or e.__context__
    if cause is None:
        text = str(error)
        short_write = any(s in text for s in ("unexpected pos", "PytorchStreamWriter failed", "file write failed"))
        free = _free_bytes(folder)
        if short_write and free is not None and free < 256 * 2**20:
            cause = f"{os.strerror(errno.ENOSPC)} ({free // 2**20} MiB free; torch said: {text.splitlines()[0][:160]})"
        else:
            cause = f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
    newest = max(files, key=lambda p: p.stat().st_mtime_ns, default=None)
    writing = f" while writing {newest.relative_to(folder).as_posix()}" if newest is not None else ""
    removed = remove and remove_partial(folder)
    whole = next((p for p in checkpoints_newest_first(folder.parent) if p != folder and not resume_problems(p)), None)
    return CheckpointSaveError(
        f"saving checkpoint {folder} failed{writing}: {cause}. "
        + ("The partial folder was removed" if removed else "The partial folder is left; resume will refuse it")
        + (f"; the latest whole checkpoint is {whole}." if whole else "; no whole checkpoint exists yet."))


def remove_partial(folder: str | os.PathLike) -> bool:
    """Remove what a failed save left (True when nothing is left)."""
    shutil.rmtree(folder, ignore_errors=True)
    return not Path(folder).exists()


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


__all__ = ["MARKER", "CheckpointError", "CheckpointSaveError", "Problem", "already_trained", "check_adapter_loaded",
           "check_resume_matches", "checkpoints_newest_first", "clear_marker", "cut_file", "describe",
           "holds_full_weights", "is_peft_model", "load_full_weights", "mark_complete", "recorded_logs", "remove_partial",
           "resolve_resume", "resume_problems", "resume_record", "save_failure"]
