#!/usr/bin/env python
"""Time and peak memory of the attention probe against a plain forward on one GPU, at Qwen2.5-VL-3B's text widths.

    # on the GPU machine (torch and transformers there; trl travels as a wheel, read for its chat templates only):
    python3 -m benchmarks.gpu_probe --out gpu_probe.json
    # here, afterwards: the section "## Attention probe on a GPU" of benchmarks/RESULTS.md from that file
    .venv/bin/python -m benchmarks.gpu_probe --write-results gpu_probe.json
    # a smoke run at tiny widths on the CPU (what tests/test_gpu_probe_script.py runs)
    .venv/bin/python -m benchmarks.gpu_probe --tiny --device cpu --out /tmp/gpu_probe_tiny.json

The GPU half of ``attention_memory.py``'s comparison (same forward kwargs, its (a)), with both exact routes of the
probe (``trl_mdi.attention.routes``) measured side by side in one run (``--variants`` picks; (a) always runs):

    (a)  model(..., logits_to_keep=1)                              plain no-grad forward, SDPA
    (b)  measure_modality_attention(model, ...)                   the probe, indicator route (one extra SDPA call
                                                                  per text layer; the default)
    (c)  measure_modality_attention(model, ..., route="lse")      the probe, flex attention's log-sum-exp per key
                                                                  group (compiled on CUDA: its first call, the
                                                                  warm-up, compiles)

A probe variant whose warm-up call fails (a kernel this card or torch lacks) is recorded with its error and left out;
the others are measured. (b) and (c) are checked against the eager reference and against each other.

Model: ``Qwen2_5_VLForConditionalGeneration`` with the text config of Qwen/Qwen2.5-VL-3B-Instruct (36 layers,
hidden 2048, 16 heads / 2 KV heads, MLP 11008, vocab 151,936, tied embeddings, mRoPE [16, 24, 24]), built by the
tiny-model fixtures (``fixtures.tiny``: config, tokenizer, processor) at those widths, random weights drawn directly
on the device in bfloat16 (initialising 3B parameters on the CPU would take minutes). The vision tower is a small
one: the probe measures the language model's attention, and (a) and (b) run the same tower on the same pixels.

Inputs: GRPO-shaped rows of exactly L tokens, laid out by the trainer's own batch builder (``trl_mdi.batch``): half
of L is the prompt, a quarter of the prompt is one image (a square grid of 28-px tokens), the rest is
chat-templated text; the other half is a random completion. Rows as in ``attention_memory.build_inputs``: even rows
the longest prompt and a completion 3/4 of the maximum (right-padded), odd rows a prompt 1/8 shorter (left-padded)
and the longest completion; at batch 1, the one row has the longest prompt and the longest completion. The prompt is spliced at the token level (one word of a templated prompt replaced by as
many single-token words as L needs), so no TRL code runs here: the GPU machine has no ``datasets``, which
``trl.data_utils`` imports.

Memory: on CUDA, ``torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()`` around the call, after
``torch.cuda.reset_peak_memory_stats()``, read while the call's output is alive (weights and inputs are in the
baseline). On the CPU (``--tiny``), the peak RSS growth (VmHWM after - VmRSS before, ``attention_memory``'s
method) with glibc's mmap threshold fixed at 64 KiB through ``mallopt`` so that freed buffers leave the RSS. The
kernel records VmHWM from its per-CPU RSS counters, which may each hold back max(32, 2 x CPUs) pages (Linux >= 6.2),
so a CPU peak is exact only to about CPUs x 128 KiB (up to 16 CPUs): a call that adds less can read as 0, and its
ratio is then shown as "—". The CPU mode is a smoke test of the code path; RESULTS.md's figures come from CUDA.

Time: one warm-up call per variant and shape, then ``--repeats`` rounds calling every variant once (round robin),
``torch.cuda.synchronize()`` before and after each call; median per variant.

Checks (in the JSON, and rendered): the probe's masses are finite and sum to 1 per row and layer; at L <=
``--eager-max-length`` the probe's masses against the reference from materialised eager attention weights
(``fixtures.testing.eager_masses``: every layer's (B, H, L, L) weights kept, so never at 8192); which SDPA kernel the
model's and the probe's calls get (``torch._fused_sdp_choice`` on the actual arguments).

The JSON is rewritten after every (L, batch) so that a run stopped by its time limit keeps what it measured, and
``--budget-s`` skips the remaining shapes once the run has taken that long.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

# Offline: nothing may come from the Hub. Importing attention_memory sets the offline variables (before any HF
# import). `python -m benchmarks.gpu_probe` from the repository root puts the root on sys.path, so benchmarks/,
# fixtures/ and trl_mdi/ import from the checkout on a machine with only torch, transformers and trl's wheel.
from benchmarks import attention_memory as am
from benchmarks.results import (
    RESULTS,
    ROOT,
    code_version,
    describe_version,
    replace_section,
    result_args,
    write_json,
)

SECTION = "## Attention probe on a GPU"
CODE_PATHS = ("trl_mdi", "fixtures", "benchmarks")  # the files that decide the figures (code_version's scope)
ARCH = "qwen2_5_vl"
VARIANTS = {"a": "model(..., logits_to_keep=1), no-grad, SDPA",
            "b": "measure_modality_attention(model, ...): the probe, indicator route (the default)",
            "c": "measure_modality_attention(model, ..., route=\"lse\"): the probe, log-sum-exp route"}
PROBE_ROUTES = {"b": "indicator", "c": "lse"}  # trl_mdi.attention.routes
# Qwen/Qwen2.5-VL-3B-Instruct's text config (config.json of the checkpoint); the rest keeps the fixture's values,
# which are the real ones (rope_theta 1e6, mRoPE split [16, 24, 24] at head_dim 128, no sliding window).
TEXT_3B = {"num_layers": 36, "hidden_size": 2048, "num_heads": 16, "num_kv_heads": 2, "intermediate_size": 11008,
           "max_position_embeddings": 128000}
VOCAB_3B, RMS_EPS_3B = 151936, 1e-6
TEXT_TINY = {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
             "max_position_embeddings": 8192}
# Small on purpose (the real tower: 32 blocks, hidden 1280): the probe does not touch it.
VISION = {"vision_depth": 4, "vision_hidden_size": 128, "vision_num_heads": 4, "vision_intermediate_size": 256}
GPU_DEFAULTS = {"lengths": (2048, 8192), "batches": (1, 2), "repeats": 10, "dtype": "bfloat16"}
TINY_DEFAULTS = {"lengths": (128, 256), "batches": (1, 2), "repeats": 3, "dtype": "float32"}
IMAGE_SHARE = 4  # a quarter of the prompt is image tokens
GOAL_TIME, GOAL_MEM = 1.1, 1.05  # issue 46's goal for the probe on a GPU, (probe)/(a) at L 2048 and 8192, batch 1 and 2
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MIB = 2**20


def _log(msg: str) -> None:
    print(f"[{time.time() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


_T0 = time.time()


# ------------------------------------------------------------------------------------------------
# Model and inputs
# ------------------------------------------------------------------------------------------------
def build_model(tiny: bool, device, dtype, max_image_tokens: int, num_layers: int | None = None):
    """(model, processor): Qwen2.5-VL at the 3B text widths (tiny widths with ``tiny``; ``num_layers`` text layers
    if given), random weights drawn on ``device`` in ``dtype``, SDPA attention. The processor's image area cap fits
    ``max_image_tokens``."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from fixtures.tiny import archs, build_tokenizer, official_chat_template, resolve_size

    text = {**(TEXT_TINY if tiny else TEXT_3B), **({"num_layers": num_layers} if num_layers else {})}
    size = resolve_size(ARCH, {**text, **VISION, "max_pixels": max_image_tokens * am.PIXELS_PER_IMAGE_TOKEN})
    template = official_chat_template(ARCH)
    tok = build_tokenizer(ARCH, template, size.max_position_embeddings)
    config, processor = archs.config_and_processor(ARCH, size, tok, template)
    if not tiny:  # the real vocabulary (the tiny tokenizer's ids are a prefix of it) and norm epsilon, tied output
        config.text_config.vocab_size = VOCAB_3B
        config.text_config.rms_norm_eps = RMS_EPS_3B
        config.text_config.tie_word_embeddings = True
        config.tie_word_embeddings = True
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval(), processor


def probe_batch(processor, length: int, batch: int, seed: int = 0) -> dict:
    """A GRPO-shaped batch of exactly ``length`` tokens per row (see the module docstring), on the CPU.

    Each prompt is the chat template around one image and one word; that word is replaced, at the token level,
    by as many single-token words as the row's prompt length needs (per-token multimodal fields get zeros there).
    """
    import torch

    from fixtures.testing import chat_prompt, shape_image
    from trl_mdi.batch import MULTIMODAL_KEYS, policy_batch

    tok = processor.tokenizer
    c_len = length // 2
    p_len = length - c_len
    side = math.isqrt(p_len // IMAGE_SHARE)
    filler = [tok.convert_tokens_to_ids(tok.tokenize(" " + w)) for w in am.WORDS]
    if any(len(f) != 1 for f in filler):
        raise RuntimeError("the tiny tokenizer no longer encodes the filler words as one token each")
    filler = [f[0] for f in filler]
    targets = [p_len if i % 2 == 0 else p_len - p_len // 8 for i in range(batch)]
    # Batch 1: one row with the longest prompt and the longest completion, no padding.
    completions_len = [c_len - c_len // 4 if i % 2 == 0 and batch > 1 else c_len for i in range(batch)]
    prompt_ids, token_fields, image_fields = [], {}, {}
    for i, target in enumerate(targets):
        enc = processor(text=[chat_prompt(processor, " " + am.WORDS[0], True)],
                        images=[shape_image(28 * side, seed + i)], return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        at = len(ids) - 1 - ids[::-1].index(filler[0])  # the word (after the image, so its last occurrence)
        n = target - (len(ids) - 1)
        if n < 1:
            raise ValueError(f"L={length}: the template and a {side * side}-token image alone take {len(ids) - 1} "
                             f"of the row's {target} prompt tokens; use a longer L")
        prompt_ids.append(ids[:at] + [filler[k % len(filler)] for k in range(n)] + ids[at + 1:])
        for key, value in enc.items():
            kind = MULTIMODAL_KEYS.get(key)
            if kind == "token":
                v = value[0].tolist()
                token_fields.setdefault(key, []).append(v[:at] + [0] * n + v[at + 1:])
            elif kind == "image":
                image_fields.setdefault(key, []).append(value)
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor(sorted(set(range(len(tok))) - set(tok.all_special_ids)))
    completions = [allowed[torch.randint(0, len(allowed), (n,), generator=g)] for n in completions_len]
    fields = {**token_fields, **{k: torch.cat(v) for k, v in image_fields.items()}}
    out = policy_batch(prompt_ids, completions, pad_token_id=tok.pad_token_id, multimodal=fields).probe_inputs()
    if tuple(out["input_ids"].shape) != (batch, length):
        raise RuntimeError(f"built a batch of shape {tuple(out['input_ids'].shape)}, wanted {(batch, length)}")
    return out


# ------------------------------------------------------------------------------------------------
# Measurements
# ------------------------------------------------------------------------------------------------
def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(run, device) -> int:
    """Bytes the call ``run()`` adds at its peak over what was allocated before it (output alive at the read)."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        am.reset_hwm()
        before = am.proc_status()["VmRSS"]
        out = run()
        peak = am.proc_status()["VmHWM"] - before
    del out
    return peak


def round_robin_times(runs: dict, repeats: int, device) -> dict[str, list[float]]:
    """Seconds per call of every variant, ``repeats`` rounds each calling every variant once."""
    times: dict[str, list[float]] = {v: [] for v in runs}
    for _ in range(repeats):
        for v, run in runs.items():
            _sync(device)
            t0 = time.perf_counter()
            out = run()
            _sync(device)
            times[v].append(time.perf_counter() - t0)
            del out
    return times


def sdpa_backends(run, length: int) -> dict[str, int]:
    """{"model: FLASH_ATTENTION": calls, "probe: EFFICIENT_ATTENTION": calls, ...} over the text layers' SDPA calls
    of ``run()`` (key length == L; the model's own calls have as many queries as keys, the probe's fewer)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.bias import CausalBias

    seen: dict[str, int] = {}
    original = F.scaled_dot_product_attention
    inside_bias: list[bool] = []

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        # The probe's lower-right causal bias (no padding) chooses its kernel itself, as if there were no mask.
        bias = isinstance(attn_mask, CausalBias)
        if k.shape[-2] == length and not inside_bias:
            try:  # a private torch function: if it moves, say so rather than lose the shape's figures
                choice = int(torch._fused_sdp_choice(q, k, v, None if bias else attn_mask, dropout_p, is_causal,
                                                     scale=scale, enable_gqa=enable_gqa))
                name = SDPBackend(choice).name
            except Exception as err:  # noqa: BLE001
                name = f"unknown ({type(err).__name__})"
            role = "model" if q.shape[-2] == k.shape[-2] else "probe"
            mask = ("no mask" if attn_mask is None else "lower-right causal bias" if bias
                    else f"{str(attn_mask.dtype).replace('torch.', '')} mask")
            key = f"{role}: {name} ({mask})"
            seen[key] = seen.get(key, 0) + 1
        if bias:  # what SDPA does with one (its __torch_function__ compares against the function this replaced); a
            # kernel without lower-right support (the CPU's) calls SDPA again with the bias materialised: not counted
            inside_bias.append(True)
            try:
                return CausalBias._dispatch(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            finally:
                inside_bias.pop()
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = spy
    try:
        del_out = run()
        del del_out
    finally:
        F.scaled_dot_product_attention = original
    return seen


class _EagerOnDevice:
    """The model with eager attention, called on ``device`` by ``fixtures.testing.eager_masses`` (which builds its
    reference on the CPU, in float64, as the tests do): inputs go to the device, the attention weights come back."""

    def __init__(self, model, device):
        self.model, self.device, self.config = model, device, model.config

    def __call__(self, **kwargs):
        import torch

        kwargs = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
        self.model.set_attn_implementation("eager")
        try:
            with torch.no_grad():
                out = self.model(**kwargs, use_cache=False, logits_to_keep=1)
        finally:
            self.model.set_attn_implementation("sdpa")
        return argparse.Namespace(attentions=[None if a is None else a.cpu() for a in out.attentions])


def eager_reference(model, cpu_batch, device):
    """(B, layers, 4) masses from the eager model's materialised weights on ``cpu_batch`` (float64 sums)."""
    from fixtures.testing import eager_masses

    return eager_masses(_EagerOnDevice(model, device), cpu_batch)[0]


def probe_checks(result, ref=None) -> dict:
    """Finite masses, their sums (1 per valid row and layer), the mean image mass; with ``ref`` (the eager
    reference), the largest difference from it."""
    import torch

    masses = _masses(result)
    valid = result.valid.cpu()
    out = {
        "finite": bool(torch.isfinite(masses[valid]).all()),
        "max_abs_sum_error": float((masses[valid].sum(dim=-1) - 1).abs().max()),
        "image_mass_mean": float(masses[valid][..., 0].mean()),
        "n_image": [int(x) for x in result.n_image],
        "n_queries": [int(x) for x in result.n_queries],
        "num_layers": int(result.num_layers),
    }
    if ref is not None:
        out["max_abs_err_vs_eager"] = float((masses - ref).abs().max())
    return out


def variant_call(variant: str, model, inputs: dict):
    """The zero-argument callable of ``variant`` (``VARIANTS``) on ``inputs``: (a) as ``attention_memory``'s, the
    probe variants with their route."""
    if variant == "a":
        return am.variant_call("a", model, inputs)
    from trl_mdi.attention import measure_modality_attention

    ids, mask, cm = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
    mm = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "completion_mask")}
    return lambda: measure_modality_attention(model, ids, mask, cm, route=PROBE_ROUTES[variant], **mm)


def _masses(result):
    import torch

    return torch.stack([result.image, result.prompt_text, result.completion, result.special], dim=-1).cpu().double()


def measure_shape(model, processor, length: int, batch: int, args, device) -> dict:
    """Memory, times and checks of every variant of ``args.variants`` on one (L, batch), side by side. A probe variant
    that fails its warm-up call (a kernel this card or torch lacks, say) is recorded with its error and left out."""
    import torch

    cpu_batch = probe_batch(processor, length, batch)
    inputs = {k: v.to(device) for k, v in cpu_batch.items()}
    runs, failed = {}, {}
    for v in args.variants:  # kernels, workspaces, RoPE caches, flex's compilation: outside the measurement
        run = variant_call(v, model, inputs)
        try:
            run()
        except Exception as err:  # noqa: BLE001 - one route failing must not lose the others
            if v == "a":
                raise
            failed[v] = f"{type(err).__name__}: {str(err)[:300]}"
            _log(f"L={length} batch={batch}: variant {v} FAILED\n{traceback.format_exc()}")
            continue
        runs[v] = run
    _sync(device)
    probes = [v for v in runs if v != "a"]
    row = {"length": length, "batch": batch, "variants": list(runs), "failed_variants": failed,
           "left_pad": [int(x) for x in (inputs["attention_mask"].cumsum(dim=1) == 0).sum(dim=1)],
           "n_completion": [int(x) for x in inputs["completion_mask"].sum(dim=1)]}
    row["peak_bytes"] = {v: peak_memory(runs[v], device) for v in runs}
    times = round_robin_times(runs, args.repeats, device)
    row["times_s"] = times
    row["median_s"] = {v: statistics.median(t) for v, t in times.items()}
    # (v)/(a) for each probe variant; "ratio_mem" / "ratio_time" / "ratio_time_paired" are (b)'s, as before.
    row["ratios"] = {v: {"mem": am.ratio(row["peak_bytes"][v], row["peak_bytes"]["a"]),
                         "time": am.ratio(row["median_s"][v], row["median_s"]["a"]),
                         "time_paired": statistics.median(x / a for a, x in zip(times["a"], times[v]))}
                     for v in probes}
    if "b" in row["ratios"]:
        row["ratio_mem"], row["ratio_time"], row["ratio_time_paired"] = (
            row["ratios"]["b"]["mem"], row["ratios"]["b"]["time"], row["ratios"]["b"]["time_paired"])
    row["sdpa_backends"] = sdpa_backends(runs[probes[0]], length) if probes else {}
    ref, skipped = None, None
    if probes and length <= args.eager_max_length:
        try:
            ref = eager_reference(model, cpu_batch, device)
        except torch.OutOfMemoryError:  # the eager reference keeps every layer's weights: keep the figures without it
            skipped = "out of memory"
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    results = {}
    for v in probes:
        results[v] = runs[v]()
        key = "checks" if v == probes[0] else f"checks_{v}"
        row[key] = probe_checks(results[v], ref) | ({"eager_skipped": skipped} if skipped else {})
    if len(results) > 1:  # the routes against each other, on the card
        first, *others = probes
        row["max_abs_diff_vs_" + first] = {v: float((_masses(results[v]) - _masses(results[first])).nan_to_num(0.0)
                                                    .abs().max()) for v in others}
    del inputs, runs, results
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------
def _machine(device) -> dict:
    import torch
    import transformers

    info = {"device": str(device), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "host": platform.node()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"name": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
                 "capability": list(torch.cuda.get_device_capability(device)),
                 "total_memory_gib": props.total_memory / 2**30, "multiprocessors": props.multi_processor_count}
    else:
        info["name"] = f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads"
    return info


def _model_info(model, tiny: bool) -> dict:
    text = model.config.text_config
    vision = model.config.vision_config
    emb = model.get_input_embeddings().weight
    return {
        "class": type(model).__name__, "widths": "tiny widths" if tiny else "Qwen2.5-VL-3B-Instruct's text config",
        "num_params": sum(p.numel() for p in model.parameters()),
        "text": {"num_layers": text.num_hidden_layers, "hidden_size": text.hidden_size,
                 "num_heads": text.num_attention_heads, "num_kv_heads": text.num_key_value_heads,
                 "head_dim": text.hidden_size // text.num_attention_heads,
                 "intermediate_size": text.intermediate_size, "vocab_size": int(emb.shape[0]),
                 "rms_norm_eps": text.rms_norm_eps, "rope_parameters": getattr(text, "rope_parameters", None),
                 "tied_embeddings": model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()},
        "vision": {"depth": vision.depth, "hidden_size": vision.hidden_size, "num_heads": vision.num_heads,
                   "intermediate_size": vision.intermediate_size},
        "dtype": str(emb.dtype).replace("torch.", ""),
        "attn_implementation": text._attn_implementation,
    }


def run(args) -> int:
    import torch

    if args.device == "cpu":
        # Every buffer of 64 KiB or more is its own mmap, returned on free, so the RSS peak tracks tensor memory.
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 65536)
    elif not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device; on a machine "
                         "without one, run the CPU smoke test: --tiny --device cpu")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shapes = [(n, b) for b in args.batches for n in args.lengths]  # batch 1 first: the figures the issue asks for
    max_image = max(n - n // 2 for n in args.lengths) // IMAGE_SHARE
    _log(f"building the model on {device} ({args.dtype}) ...")
    t0 = time.perf_counter()
    model, processor = build_model(args.tiny, device, dtype, math.isqrt(max_image) ** 2, args.num_layers)
    _sync(device)
    report = {"machine": _machine(device), "model": _model_info(model, args.tiny), "build_s": time.perf_counter() - t0,
              "argv": args.argv, "repeats": args.repeats, "eager_max_length": args.eager_max_length,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "code": code_version(CODE_PATHS), "rows": [], "skipped": [],
              "allocated_after_build_bytes": torch.cuda.memory_allocated(device) if device.type == "cuda" else None}
    _log(f"model: {report['model']['num_params']:,} parameters in {report['build_s']:.1f} s; "
         f"{report['machine']['name']}")
    write_json(Path(args.out), report)  # the machine and model, should the first shape never finish
    for length, batch in shapes:
        tag = f"L={length} batch={batch}"
        if time.time() - _T0 > args.budget_s:
            report["skipped"].append({"length": length, "batch": batch, "why": f"time budget {args.budget_s:.0f} s spent"})
            _log(f"{tag}: skipped (time budget spent)")
            continue
        try:
            row = measure_shape(model, processor, length, batch, args, device)
        except Exception as err:  # noqa: BLE001 - one shape failing (out of memory, say) must not lose the others
            report["skipped"].append({"length": length, "batch": batch, "why": f"{type(err).__name__}: {str(err)[:300]}"})
            _log(f"{tag}: FAILED\n{traceback.format_exc()}")
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        else:
            report["rows"].append(row)
            _log(f"{tag}: " + "; ".join(
                f"{v}: peak {row['peak_bytes'][v] / MIB:,.1f} MiB, median {1e3 * row['median_s'][v]:.2f} ms"
                + (f" ({v}/a mem {am.fmt_ratio(row['ratios'][v]['mem'])}, time {am.fmt_ratio(row['ratios'][v]['time'])})"
                   if v in row["ratios"] else "") for v in row["variants"])
                 + f"; checks {row.get('checks')}; SDPA {row['sdpa_backends']}"
                 + (f"; failed {row['failed_variants']}" if row["failed_variants"] else ""))
        report["total_s"] = time.time() - _T0
        write_json(Path(args.out), report)
    report["total_s"] = time.time() - _T0
    write_json(Path(args.out), report)
    _log(f"wrote {args.out} ({len(report['rows'])} shapes measured, {len(report['skipped'])} skipped)")
    return 0 if report["rows"] else 1


# ------------------------------------------------------------------------------------------------
# RESULTS.md
# ------------------------------------------------------------------------------------------------
def render(report: dict) -> str:
    """The section ``SECTION`` of RESULTS.md from a run's JSON."""
    m, mod = report["machine"], report["model"]
    t, v = mod["text"], mod["vision"]
    rope = t.get("rope_parameters") or {}
    card = m["name"] + (f" ({m['total_memory_gib']:.1f} GiB, compute capability "
                        f"{'.'.join(map(str, m['capability']))}, CUDA {m['cuda']})" if "cuda" in m else "")
    cmd = " ".join(["python3", "-m", "benchmarks.gpu_probe", *report["argv"]])
    rows = report["rows"]
    cuda = "cuda" in m
    side_by_side = any("variants" in r for r in rows)  # runs before issue 46 measured (a) and (b) only
    with_c = any("c" in r["peak_bytes"] for r in rows)
    failed = {v: why for r in rows for v, why in r.get("failed_variants", {}).items()}
    memory = ("peak `torch.cuda.max_memory_allocated()` minus `torch.cuda.memory_allocated()` before the call, after "
              "`reset_peak_memory_stats()`" if cuda else
              "peak RSS growth during the call (VmHWM after minus VmRSS before, glibc's mmap threshold fixed at 64 KiB; "
              "exact to about CPUs x 128 KiB, the kernel's per-CPU RSS counter batches)")
    out = [
        SECTION,
        "",
        f"Reproduce: `{cmd}` on {'the GPU machine' if cuda else 'the CPU'} (it writes a JSON), then "
        "`.venv/bin/python -m benchmarks.gpu_probe --write-results <that JSON>` here. Run time "
        f"{report.get('total_s', 0):.0f} s, of which {report['build_s']:.0f} s building the model.",
        "",
        f"- Date: {report['date']}; {describe_version(report.get('code'))}"
        f"{f' = the files of commit {same[:7]} (matched here)' if (same := report.get('same_as_commit')) else ''}.",
        f"- Card: **{card}**; torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}.",
        f"- Model: `{mod['class']}` with {mod['widths']}: {t['num_layers']} layers, hidden {t['hidden_size']}, "
        f"{t['num_heads']} heads / {t['num_kv_heads']} KV heads (head_dim {t['head_dim']}), MLP "
        f"{t['intermediate_size']}, vocab {t['vocab_size']:,}, {'tied' if t['tied_embeddings'] else 'untied'} "
        f"embeddings, RMSNorm eps {t['rms_norm_eps']:g}, rope θ {rope.get('rope_theta', '?'):g}, mRoPE "
        f"{rope.get('mrope_section', '?')}; random weights, **{mod['dtype']}**, `attn_implementation="
        f"\"{mod['attn_implementation']}\"`; {mod['num_params']:,} parameters"
        + (f" ({report['allocated_after_build_bytes'] / 2**30:.2f} GiB allocated on the GPU after the build)"
           if report.get("allocated_after_build_bytes") else "")
        + ". The vision tower is small "
        f"({v['depth']} blocks, hidden {v['hidden_size']}, {v['num_heads']} heads; the real one: 32 blocks, hidden "
        "1280): the probe measures the language model's attention, and (a) and (b) run the same tower on the same "
        "pixels.",
        "- Inputs: GRPO-shaped rows of exactly L tokens (`trl_mdi.batch.policy_batch`): half of L prompt, of which a "
        "quarter is one image, the rest chat-templated text; half completion (random tokens). Even rows: longest "
        "prompt, completion 3/4 of the max (right-padded); odd rows: prompt 1/8 shorter (left-padded), longest "
        "completion (batch 1: no padding). Same inputs and forward kwargs for both variants, `logits_to_keep=1` for both.",
        "- (a) `model(..., logits_to_keep=1)`, no-grad, SDPA; (b) `measure_modality_attention(model, ...)`"
        + ("." if not side_by_side else " (the indicator route); (c) `measure_modality_attention(model, ..., "
           "route=\"lse\")` (flex attention's log-sum-exp per key group; `trl_mdi.attention.routes`), measured in the "
           "same run" + "".join(f"; {v} failed here: {why}" for v, why in failed.items()) + "."),
        f"- Memory: {memory}, read while the output is alive: what the call adds over the weights and inputs.",
        f"- Time: median of {report['repeats']} calls per variant"
        + (", `torch.cuda.synchronize()` before and after each" if cuda else "")
        + ", one warm-up call per variant and shape first, variants called round robin; (b)/(a) of the medians "
        "(and, in the checks, the median of the per-round ratios).",
        f"- Targets (as for the CPU table): (b)/(a) memory ≤ {am.MEM_TARGET}x, time ≤ {am.TIME_TARGET}x"
        + ("." if not side_by_side else f"; the GPU goal of issue 46: memory ≤ {GOAL_MEM}x, time ≤ {GOAL_TIME}x."),
        "",
        "| L | batch | image tokens | completion tokens | (a) peak MiB | (b) peak MiB | (b)/(a) mem "
        "| (a) ms | (b) ms | (b)/(a) time |" + (" (c) peak MiB | (c)/(a) mem | (c) ms | (c)/(a) time |" if with_c else ""),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" * 4 if with_c else ""),
    ]
    for r in rows:
        p, s = r["peak_bytes"], r["median_s"]
        line = (
            f"| {r['length']} | {r['batch']} | {', '.join(map(str, r['checks']['n_image']))} "
            f"| {', '.join(map(str, r['n_completion']))} | {p['a'] / MIB:,.1f} | {p['b'] / MIB:,.1f} "
            f"| {am.fmt_ratio(r['ratio_mem'], am.MEM_TARGET)} | {1e3 * s['a']:,.2f} | {1e3 * s['b']:,.2f} "
            f"| {am.fmt_ratio(r['ratio_time'], am.TIME_TARGET)} |"
        )
        if with_c:
            c = r.get("ratios", {}).get("c")
            line += (f" {p['c'] / MIB:,.1f} | {am.fmt_ratio(c['mem'], GOAL_MEM)} | {1e3 * s['c']:,.2f} "
                     f"| {am.fmt_ratio(c['time'], GOAL_TIME)} |" if c else " — | — | — | — |")
        out.append(line)
    for sk in report.get("skipped", []):
        out.append(f"\n- L={sk['length']} batch {sk['batch']} not measured: {sk['why']}")
    out += ["", f"Checks (the eager reference only up to L = {report['eager_max_length']}: it keeps every layer's "
            "(B, H, L, L) weights):", ""]
    for r in rows:
        c = r["checks"]
        bits = [f"masses {'finite' if c['finite'] else '**not finite**'}",
                f"max |image + prompt text + completion + special − 1| = {c['max_abs_sum_error']:.1e}",
                f"mean image mass {c['image_mass_mean']:.4f} over {c['num_layers']} layers"]
        if "max_abs_err_vs_eager" in c:
            bits.append(f"probe vs eager reference (materialised weights, float64 sums): max |Δ| = "
                        f"{c['max_abs_err_vs_eager']:.1e}")
        bits.append(f"time ratio, median of per-round pairs {r['ratio_time_paired']:.3f}")
        if "checks_c" in r:
            cc = r["checks_c"]
            bits.append(f"(c): masses {'finite' if cc['finite'] else '**not finite**'}, sum error "
                        f"{cc['max_abs_sum_error']:.1e}"
                        + (f", vs eager {cc['max_abs_err_vs_eager']:.1e}" if "max_abs_err_vs_eager" in cc else "")
                        + (f", max |(c) − (b)| = {r['max_abs_diff_vs_b']['c']:.1e}" if "max_abs_diff_vs_b" in r else "")
                        + f", time ratio of per-round pairs {r['ratios']['c']['time_paired']:.3f}")
        bits.append("SDPA kernels (text layers, calls): " + ", ".join(f"{k} × {n}" for k, n in r["sdpa_backends"].items()))
        out.append(f"- L={r['length']} batch {r['batch']}: " + "; ".join(bits) + ".")
    return "\n".join(out) + "\n"


def matching_commit(code: dict | None, root: Path = ROOT, depth: int = 30) -> str | None:
    """The commit among HEAD's last ``depth`` whose files (:data:`CODE_PATHS`) are the ones a run recorded as
    ``code_version``'s ``base commit + uncommitted changes (diff hash)``; None if none is.

    Why: the GPU machine gets a copy of the session's checkout whose git sits at the commit the session started
    from, with everything since as uncommitted changes, so the run can only record that base and a hash of the
    changes. Laying each candidate's files over the base in a scratch worktree and hashing them the same way tells
    which commit ran, checked rather than stated."""
    import shutil
    import subprocess
    import tempfile

    if not code or not code.get("dirty") or not code.get("commit") or not code.get("diff"):
        return None

    def git(*args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, check=True, **kw)

    candidates = git("rev-list", f"-n{depth}", "HEAD").stdout.decode().split()
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        git("worktree", "add", "--detach", str(tree), code["commit"])
        try:
            for commit in candidates:
                for path in CODE_PATHS:
                    shutil.rmtree(tree / path, ignore_errors=True)
                present = git("ls-tree", "--name-only", commit, *CODE_PATHS).stdout.decode().split()
                archive = git("archive", commit, *present).stdout if present else b""
                if archive:
                    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
                if code_version(CODE_PATHS, root=tree).get("diff") == code["diff"]:
                    return commit
        finally:
            git("worktree", "remove", "--force", str(tree))
    return None


def write_results(json_path: str, results_path: Path) -> None:
    report = json.loads(Path(json_path).read_text(encoding="utf-8"))
    report["same_as_commit"] = matching_commit(report.get("code"))
    text = render(report)
    print(text)
    replace_section(SECTION, text, results_path)
    print(f"updated {results_path}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_probe.json", help="where to write the results JSON (default gpu_probe.json)")
    p.add_argument("--device", default="cuda", help="torch device (default cuda; cpu with --tiny for a smoke run)")
    p.add_argument("--tiny", action="store_true", help=f"tiny text widths {TEXT_TINY}, lengths "
                   f"{TINY_DEFAULTS['lengths']}, {TINY_DEFAULTS['repeats']} repeats, float32 (a CPU smoke run)")
    p.add_argument("--lengths", type=int, nargs="+", help="total tokens per row (default 2048 8192; --tiny 128 256)")
    p.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 2)")
    p.add_argument("--repeats", type=int, help="timed calls per variant and shape (default 10; --tiny 3)")
    p.add_argument("--num-layers", type=int, help="text layers (default 36, --tiny 4): fewer for a quick check of "
                   "the 3B widths on a small machine")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="what to measure side by side (default all): " + "; ".join(f"({k}) {v}" for k, v in VARIANTS.items())
                   + ". (a) is always measured")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="weights and activations (default bfloat16; --tiny float32)")
    p.add_argument("--eager-max-length", type=int, default=2048, help="compare the probe with the eager reference "
                   "(every layer's (B, H, L, L) weights kept) up to this L (default 2048; 0 disables)")
    p.add_argument("--budget-s", type=float, default=420, help="skip the remaining shapes once the run has taken "
                   "this many seconds (default 420: the device check must end within 8 minutes)")
    p.add_argument("--write-results", metavar="JSON", help="render a run's JSON into the section "
                   f"'{SECTION}' of RESULTS.md (no measurement)")
    p.add_argument("--results", type=Path, default=RESULTS, help="the RESULTS.md to update (default benchmarks/RESULTS.md)")
    args = p.parse_args(argv)
    defaults = TINY_DEFAULTS if args.tiny else GPU_DEFAULTS
    for key in ("lengths", "batches", "repeats", "dtype"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    args.variants = ["a"] + [v for v in args.variants if v != "a"]
    args.argv = result_args(argv, ("--out",))
    return args




def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.write_results:
        write_results(args.write_results, args.results)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
