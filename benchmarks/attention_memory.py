#!/usr/bin/env python
"""Peak memory and wall time of the attention probe, against a plain SDPA forward and eager attention.

    .venv/bin/python -m benchmarks.attention_memory            # 512 ... 8192 tokens, writes RESULTS.md
    .venv/bin/python -m benchmarks.attention_memory --quick    # 512, 1024, 2048
    .venv/bin/python -m benchmarks.attention_memory --lengths 1024 4096 --no-write

Variants, all no-grad, on the same GRPO-shaped inputs and the same forward kwargs
(input_ids, attention_mask, use_cache=False, pixel_values, image_grid_thw, mm_token_type_ids, and
logits_to_keep=1 for all three: measure_modality_attention passes it internally, so (a) and (c) get it
explicitly; a forward pre-hook checks that the probe really did):

    (a)  model(..., logits_to_keep=1)                          plain forward, SDPA attention
    (b)  measure_modality_attention(model, ...)               the probe (SDPA + one extra SDPA call per layer)
    (c)  eager_model(..., output_attentions=True, logits_to_keep=1)   the old approach, every layer's weights kept
    (a_full) model(...) with full (B, L, vocab) logits, for the logits_to_keep check only: at the tiny
         vocab and at Qwen2.5-VL's real 151,936 (output layer resized), L=2048.

Memory. torch has no CPU peak-allocation counter, so every (variant, length) runs in a fresh
subprocess (this script re-invoked with --worker mem). There: load the model, build the inputs,
warm up on the shortest input, gc, then reset the kernel's RSS high-water mark (write "5" to
/proc/self/clear_refs, Linux >= 4.0), read VmRSS (the baseline), make the measured call, read VmHWM
while its output is still alive. peak_delta = VmHWM_after - VmRSS_before: the largest RSS growth
during the call, exact to the page and maintained by the kernel (no sampling thread that can miss a
short-lived buffer). ru_maxrss is only a lifetime high-water mark (it would hide a call whose peak is
below the load/warm-up peak); it is recorded as a cross-check. RSS only tracks tensor memory if
freed memory goes back to the OS: glibc keeps freed heap chunks and raises its mmap threshold up to
32 MiB at run time, so a warm process re-uses freed memory and under-reports. The memory worker
therefore runs with MALLOC_MMAP_THRESHOLD_=65536 (which also freezes the threshold): every buffer of
64 KiB or more is its own mmap, unmapped when torch frees it.

Time. A separate subprocess per length (--worker time) with the default allocator: warm up every
variant on the shortest input, then `repeats` rounds, each calling every variant once (round robin,
so load drift from other jobs hits all variants alike); median per variant. torch.set_num_threads
is fixed (--threads, default 2) and OMP/MKL threads are set to match.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Offline, as the test-suite: nothing may come from the Hub. Set before any HF import.
from benchmarks.results import replace_section, set_offline_env

set_offline_env()

ROOT = Path(__file__).resolve().parents[1]

SECTION = "## Attention probe: memory and time"
ALL_LENGTHS = (512, 1024, 2048, 4096, 8192)
QUICK_LENGTHS = (512, 1024, 2048)
VARIANTS = {
    "a": "plain no-grad forward, SDPA, logits_to_keep=1",
    "b": "measure_modality_attention (SDPA + probe; passes logits_to_keep=1 itself)",
    "c": "eager forward, output_attentions=True, logits_to_keep=1",
    "a_full": "plain no-grad forward, SDPA, full logits",
}
MAIN_VARIANTS = ("a", "b", "c")
LOGITS_VARIANTS = ("a_full", "a", "b")
ARCH = "qwen2_5_vl"
MODEL_SIZE = {
    "num_layers": 8,
    "hidden_size": 256,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 1024,
    "vision_depth": 2,
    "vision_hidden_size": 64,
    "vision_num_heads": 4,
    "vision_intermediate_size": 128,
    "max_position_embeddings": 16384,
}
PIXELS_PER_IMAGE_TOKEN = 28 * 28  # Qwen2.5-VL: 14-px patches, 2x2 merge
WORDS = "red green blue yellow purple circle square triangle star diamond".split()
MEM_TARGET, TIME_TARGET = 1.25, 2.0
EAGER_MEM_FRACTION = 0.75  # run (c) only if its projected peak is below this share of MemAvailable
MIB = 2**20
_OVERHEAD = {"waiting_s": 0.0, "retried_timing_s": 0.0}  # run time lost to other jobs on the machine


# ------------------------------------------------------------------------------------------------
# Helpers shared by the workers
# ------------------------------------------------------------------------------------------------
def proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, val = line.split(":")
                out[key] = int(val.split()[0]) * 1024
    return out


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (the peak RSS) to the current RSS


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    return 0


def _load(model_dir: str, eager: bool, vocab: int | None = None):
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager" if eager else "sdpa"
    )
    if vocab:  # a real-sized output layer (the tokenizer is unchanged: the new ids are never fed in)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model.resize_token_embeddings(vocab, mean_resizing=False)
    return model.eval()


def build_inputs(processor, length: int, batch: int, image_tokens: int, seed: int = 0) -> dict:
    """GRPO-shaped batch of exactly ``length`` tokens: left-padded prompts with one image, right-padded completions.

    Completion: half of the sequence. Even rows: the longest prompt (no left padding) and a completion
    3/4 of the maximum (right-padded); odd rows: a prompt 1/8 shorter (left-padded) and the longest
    completion. Prompt text (single-token words) is padded so the longest prompt hits its target exactly.
    """
    from fixtures.testing import chat_prompt, grpo_batch, shape_image

    side = 28 * math.isqrt(image_tokens)
    c_len = length // 2
    p_len = length - c_len
    images = [shape_image(side, seed + i) for i in range(batch)]
    targets = [p_len if i % 2 == 0 else p_len - p_len // 8 for i in range(batch)]
    completions = [c_len - c_len // 4 if i % 2 == 0 else c_len for i in range(batch)]

    def n_tokens(n_words: int, img) -> int:
        text = chat_prompt(processor, " ".join((WORDS * (n_words // len(WORDS) + 1))[:n_words]), True)
        return int(processor(text=[text], images=[img], return_tensors="pt")["input_ids"].shape[1])

    texts = []
    for target, img in zip(targets, images):
        overhead = n_tokens(1, img) - 1
        if overhead + 1 > target:
            raise ValueError(f"length {length} too short: the prompt template + image alone is {overhead} tokens")
        n = target - overhead
        for _ in range(5):
            got = n_tokens(n, img)
            if got == target:
                break
            n += target - got
        else:
            raise RuntimeError(f"could not pad the prompt to {target} tokens (got {got})")
        texts.append(" ".join((WORDS * (n // len(WORDS) + 1))[:n]))
    out = grpo_batch(processor, texts, images, completions, seed=seed)
    assert out["input_ids"].shape == (batch, length), out["input_ids"].shape
    return out


def variant_call(variant: str, model, batch: dict):
    """The zero-argument callable that runs ``variant`` on ``batch`` (all no-grad, same forward kwargs)."""
    import torch

    from trl_mdi.attention import measure_modality_attention

    ids, am, cm = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    mm = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "completion_mask")}

    if variant == "a":
        def run():
            with torch.no_grad():
                return model(input_ids=ids, attention_mask=am, use_cache=False, logits_to_keep=1, **mm)
    elif variant == "a_full":
        def run():
            with torch.no_grad():
                return model(input_ids=ids, attention_mask=am, use_cache=False, **mm)
    elif variant == "c":
        def run():
            with torch.no_grad():
                return model(input_ids=ids, attention_mask=am, use_cache=False, output_attentions=True,
                             logits_to_keep=1, **mm)
    elif variant == "b":
        def run():
            return measure_modality_attention(model, ids, am, cm, **mm)
    else:
        raise ValueError(variant)
    return run


def _set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    torch.set_num_interop_threads(1)


# ------------------------------------------------------------------------------------------------
# Workers (each runs in its own subprocess)
# ------------------------------------------------------------------------------------------------
def worker_mem(args) -> dict:
    _set_threads(args.threads)
    import torch
    from transformers import AutoProcessor

    model = _load(args.model_dir, eager=args.variant == "c", vocab=args.vocab)
    processor = AutoProcessor.from_pretrained(args.model_dir)
    warm = build_inputs(processor, args.warmup_length, args.batch, args.image_tokens)
    batch = build_inputs(processor, args.length, args.batch, args.image_tokens)
    variant_call(args.variant, model, warm)()  # lazy init (thread pools, kernels, RoPE caches) outside the measurement
    run = variant_call(args.variant, model, batch)
    seen_kwargs = {}
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: seen_kwargs.update(kw), with_kwargs=True)
    del warm
    gc.collect()
    reset_hwm()
    before = proc_status()
    t0 = time.perf_counter()
    out = run()
    elapsed = time.perf_counter() - t0
    after = proc_status()  # read while the output is alive: what the caller holds counts
    ru_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    hook.remove()
    res = {
        "variant": args.variant,
        "length": args.length,
        "rss_before": before["VmRSS"],
        "hwm_after": after["VmHWM"],
        "peak_delta": after["VmHWM"] - before["VmRSS"],
        "ru_maxrss_delta": ru_after - before["VmRSS"],
        "first_call_s": elapsed,
        "num_params": sum(p.numel() for p in model.parameters()),
        "logits_to_keep": seen_kwargs.get("logits_to_keep"),  # what the model's forward actually received
        "n_image": [int(x) for x in (batch["input_ids"] == model.config.image_token_id).sum(dim=1)],
        "left_pad": [int(x) for x in (batch["attention_mask"].cumsum(dim=1) == 0).sum(dim=1)],
        "n_completion": [int(x) for x in batch["completion_mask"].sum(dim=1)],
    }
    if args.variant == "c":
        res["attention_maps_bytes"] = sum(a.numel() * a.element_size() for a in out.attentions if a is not None)
    if args.variant in ("a", "a_full", "c"):
        res["logits_bytes"] = out.logits.numel() * out.logits.element_size()
    if args.variant == "b":
        res["finite"] = bool(torch.isfinite(out.image).all())
    del out
    return res


def worker_time(args) -> dict:
    _set_threads(args.threads)
    from transformers import AutoProcessor

    variants = args.variants.split(",")
    sdpa = _load(args.model_dir, eager=False, vocab=args.vocab)
    eager = _load(args.model_dir, eager=True, vocab=args.vocab) if "c" in variants else None
    processor = AutoProcessor.from_pretrained(args.model_dir)
    warm = build_inputs(processor, args.warmup_length, args.batch, args.image_tokens)
    batch = build_inputs(processor, args.length, args.batch, args.image_tokens)
    model_for = {v: eager if v == "c" else sdpa for v in variants}
    for v in variants:
        variant_call(v, model_for[v], warm)()
    runs = {v: variant_call(v, model_for[v], batch) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            c0, t0 = time.process_time(), time.perf_counter()
            out = runs[v]()
            times[v].append(time.perf_counter() - t0)
            cpu[v].append(time.process_time() - c0)
            del out
            gc.collect()
    # CPU time / (wall time x threads): ~1 when this process had its cores to itself, lower under contention.
    util = sum(map(sum, cpu.values())) / (sum(map(sum, times.values())) * args.threads)
    res = {"length": args.length, "times": times, "median": {v: statistics.median(t) for v, t in times.items()},
           "cpu_utilisation": util}
    if args.check and "b" in variants and "c" in variants:
        res["max_abs_err_vs_eager"] = _probe_vs_eager(sdpa, eager, batch)
    return res


def _probe_vs_eager(sdpa, eager, batch) -> float:
    """Max |probe mass - eager reference mass| over rows, layers and groups (sanity check, small lengths)."""
    import torch

    from fixtures.testing import eager_group_masses
    from trl_mdi.attention import image_token_ids, measure_modality_attention

    ids, am, cm = batch["input_ids"], batch["attention_mask"].bool(), batch["completion_mask"].bool()
    mm = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "completion_mask")}
    res = measure_modality_attention(sdpa, ids, am.long(), cm, **mm)
    with torch.no_grad():
        out = eager(input_ids=ids, attention_mask=am.long(), use_cache=False, output_attentions=True, **mm)
    img = torch.isin(ids, torch.tensor(image_token_ids(sdpa.config))) & am
    pos = torch.arange(ids.shape[1])
    comp = (pos >= torch.where(cm, pos, ids.shape[1]).amin(dim=1, keepdim=True)) & am
    groups = torch.stack([img, am & ~comp & ~img, comp & ~img, torch.zeros_like(img)], dim=-1)
    ref = eager_group_masses(out.attentions, groups, cm)
    got = torch.stack([res.image, res.prompt_text, res.completion, res.special], dim=-1).double()
    return float((got - ref).abs().max())


def worker_kernels(args) -> dict:
    """Which SDPA backend the model's and the probe's calls get on this machine, and what the alternatives cost."""
    _set_threads(args.threads)
    import torch
    import torch.nn.functional as F
    from transformers import AutoProcessor

    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
    model = _load(args.model_dir, eager=False)
    processor = AutoProcessor.from_pretrained(args.model_dir)
    batch = build_inputs(processor, args.length, args.batch, args.image_tokens)
    seen: dict[tuple, int] = {}
    captured = {}
    original = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if k.shape[2] == batch["input_ids"].shape[1]:  # text layers only (vision calls have other lengths)
            role = "model" if q.shape[2] == k.shape[2] else "probe"
            choice = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
            key = (role, names.get(int(choice), str(choice)), tuple(q.shape), tuple(k.shape), tuple(v.shape),
                   None if attn_mask is None else str(attn_mask.dtype).replace("torch.", ""), bool(enable_gqa))
            seen[key] = seen.get(key, 0) + 1
            if role == "probe" and "probe" not in captured and attn_mask is not None:
                captured["probe"] = (q.clone(), k.clone(), attn_mask.clone(), v.shape[-1])
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = spy
    try:
        variant_call("b", model, batch)()
    finally:
        F.scaled_dot_product_attention = original
    calls = [
        {"role": r, "backend": b, "q": q, "k": k, "v": v, "mask": m, "enable_gqa": g, "calls": n}
        for (r, b, q, k, v, m, g), n in seen.items()
    ]
    # Micro-benchmark of one probe call (layer 0's q/k/mask) with the alternatives the probe could use.
    q, k, mask, head_dim = captured["probe"]
    n_rep = model.config.text_config.num_attention_heads // model.config.text_config.num_key_value_heads
    k_kv = k[:, ::n_rep].contiguous()  # the un-repeated KV heads (repeat_kv is repeat_interleave)
    bsz, n_heads, n_q, _ = q.shape
    n_k = k.shape[2]
    fmask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))

    def v_cols(c, heads):
        return torch.zeros(bsz, 1, n_k, c).expand(bsz, heads, n_k, c)

    options = {
        f"padded value ({head_dim} cols), repeat_kv keys, bool mask [current]": (q, k, v_cols(head_dim, n_heads), mask, {}),
        "4 value cols (unpadded), repeat_kv keys, bool mask": (q, k, v_cols(4, n_heads), mask, {}),
        "padded value, enable_gqa=True (no repeat_kv), bool mask": (q, k_kv, v_cols(head_dim, k_kv.shape[1]), mask,
                                                                    {"enable_gqa": True}),
        "padded value, repeat_kv keys, float additive mask": (q, k, v_cols(head_dim, n_heads), fmask, {}),
    }
    micro = []
    for label, (qq, kk, vv, mm, kw) in options.items():
        choice = names.get(int(torch._fused_sdp_choice(qq, kk, vv, mm, 0.0, False, **kw)), "?")
        F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mm, **kw)  # warm-up
        gc.collect()
        reset_hwm()
        before = proc_status()["VmRSS"]
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mm, **kw)
            ts.append(time.perf_counter() - t0)
            del out
        micro.append({"option": label, "backend": choice, "ms": 1000 * statistics.median(ts),
                      "peak_delta": proc_status()["VmHWM"] - before})
    return {"length": args.length, "calls": calls, "micro": micro,
            "bool_mask_bytes": mask.numel(), "float_mask_bytes": fmask.numel() * fmask.element_size()}


# ------------------------------------------------------------------------------------------------
# Orchestration
# ------------------------------------------------------------------------------------------------
def _run_worker(kind: str, args, timeout: float, env_extra: dict | None = None, **extra) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.attention_memory", "--worker", kind, "--model-dir", args.model_dir,
           "--threads", str(args.threads), "--batch", str(args.batch), "--image-tokens", str(args.image_tokens),
           "--warmup-length", str(args.warmup_length)]
    for k, v in extra.items():
        if isinstance(v, bool):
            if v:
                cmd.append(f"--{k.replace('_', '-')}")
        else:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = dict(os.environ)
    n = str(args.threads)
    env.update({"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "PYTHONWARNINGS": "ignore"})
    env.update(env_extra or {})
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        why = "killed (SIGKILL: out of memory?)" if proc.returncode == -9 else f"exit code {proc.returncode}"
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        return {"error": f"{why}: {tail}"}
    return json.loads(lines[-1][len("RESULT "):])


def _cpu_busy(interval: float = 1.0) -> float:
    """Share of the machine's CPU time spent busy (any process) over ``interval`` seconds, from /proc/stat."""
    def snap():
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        return vals[3] + vals[4], sum(vals)  # idle + iowait, total
    i0, t0 = snap()
    time.sleep(interval)
    i1, t1 = snap()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def _wait_idle(budget: float) -> float:
    """Before timing: wait (up to ``budget`` s) until other jobs leave the CPU mostly idle; return the last reading."""
    start = time.monotonic()
    deadline = start + budget
    busy = _cpu_busy()
    while busy > 0.15 and time.monotonic() < deadline:
        _log(f"  CPU {busy:.0%} busy with other jobs; waiting before timing ...")
        time.sleep(5)
        busy = _cpu_busy()
    if busy > 0.15:
        _log(f"  CPU still {busy:.0%} busy; timing anyway (see cpu_utilisation in the cross-checks)")
    _OVERHEAD["waiting_s"] += time.monotonic() - start
    return busy


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _machine() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mem_total_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        "mem_available_gib": _mem_available() / 2**30,
        "loadavg": os.getloadavg(),
        "python": platform.python_version(),
    }


def _model_info(model_dir: str) -> dict:
    meta = json.loads((Path(model_dir) / "tiny_vlm.json").read_text())
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return {"num_params": meta["num_params"], "size": meta["size"], "vocab_size": text["vocab_size"],
            "head_dim": meta["size"]["hidden_size"] // meta["size"]["num_heads"]}


def _eager_projection(length: int, batch: int, info: dict) -> int:
    """Bytes (c) needs at least: every layer's (B, H, L, L) fp32 weights kept, plus 2 transient copies in the layer."""
    s = info["size"]
    per_layer = batch * s["num_heads"] * length * length * 4
    return (s["num_layers"] + 2) * per_layer


def _fmt_mib(b) -> str:
    return "—" if b is None else f"{b / MIB:,.0f}"


def fmt_ratio(x, target=None) -> str:
    if x is None:
        return "—"
    mark = "" if target is None else (" ✓" if x <= target else " ✗")
    return f"{x:.2f}{mark}"


def ratio(num, den):
    return None if num is None or den in (None, 0) else num / den


def measure_length(args, length: int, variants: list[str], info: dict, vocab: int | None = None,
                   check: bool = False, repeats: int | None = None) -> dict:
    """Memory of every variant (one fresh subprocess each), then their times (one subprocess, round robin)."""
    tag = f"L={length}" + (f" vocab={vocab}" if vocab else "")
    row = {"length": length, "vocab": vocab, "mem": {}, "time": {}, "skip": {}}
    for v in variants:
        if v == "c":
            need = _eager_projection(length, args.batch, info)
            avail = _mem_available()
            if need > EAGER_MEM_FRACTION * avail:
                row["skip"][v] = (f"projected ≥ {need / 2**30:.1f} GiB (every layer's (B,H,L,L) fp32 weights "
                                  f"+ 2 transients) > {EAGER_MEM_FRACTION:.0%} of MemAvailable {avail / 2**30:.1f} GiB")
                _log(f"{tag} ({v}) skipped: {row['skip'][v]}")
                continue
        _log(f"{tag} ({v}) memory ...")
        r = _run_worker("mem", args, args.timeout, {"MALLOC_MMAP_THRESHOLD_": "65536"}, variant=v, length=length,
                        vocab=vocab or 0)
        if "error" in r:
            row["skip"][v] = r["error"]
            _log(f"{tag} ({v}) failed: {r['error']}")
            continue
        row["mem"][v] = r
        _log(f"{tag} ({v}) peak_delta {r['peak_delta'] / MIB:,.1f} MiB, first call {r['first_call_s']:.2f} s")
    timed = [v for v in variants if v in row["mem"]]
    if timed:
        repeats = args.repeats or repeats or (5 if length <= 2048 else 3)
        r, attempts = None, 0
        # Other jobs share the cores: retry a run whose CPU utilisation shows it was contended, keep the cleanest.
        while attempts <= args.timing_retries:
            attempts += 1
            busy = _wait_idle(args.wait_idle)
            _log(f"{tag} timing {timed} x {repeats} (round robin), attempt {attempts} ...")
            t_attempt = time.perf_counter()
            got = _run_worker("time", args, args.timeout * len(timed), variants=",".join(timed), length=length,
                              vocab=vocab or 0, check=check, repeats=repeats)
            if "error" in got:
                r = r or got
                break
            got["cpu_busy_before_timing"] = busy
            if r is None or "error" in r or got["cpu_utilisation"] > r["cpu_utilisation"]:
                r = got
            if got["cpu_utilisation"] >= 0.85:
                break
            if attempts <= args.timing_retries:
                _OVERHEAD["retried_timing_s"] += time.perf_counter() - t_attempt
            _log(f"{tag} CPU utilisation {got['cpu_utilisation']:.0%} < 85%: contended by other jobs")
        row["timing_attempts"] = attempts
        if "error" in r:
            _log(f"{tag} timing failed: {r['error']}")
            row["skip"]["timing"] = r["error"]
        else:
            row["time"] = r["median"]
            row["time_all"] = r["times"]
            row["cpu_utilisation"] = r["cpu_utilisation"]
            row["cpu_busy_before_timing"] = r["cpu_busy_before_timing"]
            row["repeats"] = repeats
            if "max_abs_err_vs_eager" in r:
                row["max_abs_err_vs_eager"] = r["max_abs_err_vs_eager"]
            _log(f"{tag} medians: " + ", ".join(f"{v} {t:.3f} s" for v, t in r["median"].items()))
    return row


def orchestrate(args) -> int:
    t_start = time.perf_counter()
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else ALL_LENGTHS)
    variants = [v for v in MAIN_VARIANTS if v not in (args.skip or [])]
    machine = _machine()
    _log(f"machine: {machine}")
    tmp = None
    if args.model_dir is None:
        from fixtures.tiny import save_tiny_vlm

        tmp = tempfile.mkdtemp(prefix="attn-mem-bench-")
        args.model_dir = str(save_tiny_vlm(
            ARCH, Path(tmp) / "model", seed=0, max_pixels=args.image_tokens * PIXELS_PER_IMAGE_TOKEN, **MODEL_SIZE
        ))
    info = _model_info(args.model_dir)
    _log(f"model: {ARCH} {info}")
    rows, vocab_rows = [], []
    kernels = None
    try:
        for length in lengths:
            rows.append(measure_length(args, length, variants, info, check=length == min(lengths) and not args.no_check))
        if args.vocab_check:
            vlen = max([n for n in lengths if n <= 2048] or [min(lengths)])
            for vocab in (None, args.vocab_check):
                vocab_rows.append(measure_length(args, vlen, list(LOGITS_VARIANTS), info, vocab=vocab, repeats=3))
        if not args.no_kernels:
            klen = max([n for n in lengths if n <= 4096] or [min(lengths)])
            _log(f"kernel check at L={klen} ...")
            kernels = _run_worker("kernels", args, args.timeout, {"MALLOC_MMAP_THRESHOLD_": "65536"}, length=klen)
            if "error" in kernels:
                _log(f"kernel check failed: {kernels['error']}")
                kernels = None
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    total = time.perf_counter() - t_start
    report = render(args, machine, info, rows, vocab_rows, kernels, total)
    print(report)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "model": info, "rows": rows, "vocab_rows": vocab_rows,
                                               "kernels": kernels, "total_s": total}, indent=2, default=str))
    if not args.no_write:
        replace_section(SECTION, report)
        _ensure_readme()
        _log(f"updated {ROOT / 'benchmarks' / 'RESULTS.md'}")
    return 0


def render(args, machine, info, rows, vocab_rows, kernels, total) -> str:
    s = info["size"]
    cmd = " ".join([".venv/bin/python", "-m", "benchmarks.attention_memory", *map(shlex.quote, args.argv)])
    first = next((r["mem"][v] for r in rows for v in MAIN_VARIANTS if v in r["mem"]), None)
    n_img = first["n_image"] if first else "?"
    probe_ltk = sorted({str(r["mem"]["b"]["logits_to_keep"]) for r in rows if "b" in r["mem"]})
    probe_ltk_ok = probe_ltk == ["1"]
    out = [
        SECTION,
        "",
        f"Reproduce: `{cmd}` (from the repository root). Total run time {total / 60:.1f} min, of which "
        f"{_OVERHEAD['waiting_s'] / 60:.1f} min waiting for other jobs to leave the CPU and "
        f"{_OVERHEAD['retried_timing_s'] / 60:.1f} min in timing runs repeated because they were contended.",
        "",
        f"- Date: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- Machine: {machine['cpu']}, {machine['cores']} cores available, {machine['mem_total_gib']:.0f} GiB RAM "
        f"({machine['mem_available_gib']:.0f} GiB available at start), load average at start "
        f"{machine['loadavg'][0]:.2f}; torch {machine['torch']} (CPU capability {machine['cpu_capability']}), "
        f"transformers {machine['transformers']}, Python {machine['python']}; "
        f"`torch.set_num_threads({args.threads})`, OMP/MKL threads {args.threads}, 1 interop thread.",
        f"- Model: tiny random-weight Qwen2.5-VL (`fixtures.tiny.save_tiny_vlm('{ARCH}', ...)`), "
        f"{info['num_params']:,} parameters, float32. Text: {s['num_layers']} layers, hidden {s['hidden_size']}, "
        f"{s['num_heads']} heads / {s['num_kv_heads']} KV heads (head_dim {info['head_dim']}), MLP "
        f"{s['intermediate_size']}, vocab {info['vocab_size']}. Vision: {s['vision_depth']} blocks, hidden "
        f"{s['vision_hidden_size']}, {s['vision_num_heads']} heads; max_pixels {s['max_pixels']}.",
        f"- Inputs: GRPO-shaped batch of {args.batch} (`fixtures.testing.grpo_batch`), one "
        f"{28 * math.isqrt(args.image_tokens)}x{28 * math.isqrt(args.image_tokens)} image per row = "
        f"{n_img} image tokens; the completion is half of L. Row 0: longest prompt, completion 3/4 of the max "
        "(right-padded); row 1: prompt 1/8 shorter (left-padded), longest completion. Prompt text padded with "
        "single-token words to reach L exactly.",
        "- Same inputs and forward kwargs for every variant (`input_ids, attention_mask, use_cache=False, "
        "pixel_values, image_grid_thw, mm_token_type_ids`), and **`logits_to_keep=1` for all of (a), (b), (c)**: "
        "`measure_modality_attention` passes it itself, so (a) and (c) get it explicitly. "
        + ("A forward pre-hook confirmed that the probe's model call received `logits_to_keep=1`."
           if probe_ltk_ok else
           f"**Warning: the probe's model call received logits_to_keep={', '.join(probe_ltk)} (pre-hook), so (b) "
           "computed different logits from (a) and (c); the comparison is not like for like.**"),
        "- (a) `model(..., logits_to_keep=1)` no-grad, SDPA; (b) `measure_modality_attention(model, ...)`; (c) same "
        "weights loaded with `attn_implementation=\"eager\"`, `output_attentions=True`, `logits_to_keep=1`, no-grad "
        "(the old approach; the forward only, without reducing the maps).",
        "- Memory: peak RSS growth during the call, `VmHWM_after - VmRSS_before`, one fresh subprocess per "
        "(variant, L): model loaded, warm-up on a 512-token batch, `gc.collect()`, VmHWM reset via "
        "`/proc/self/clear_refs`, baseline VmRSS, call, VmHWM read while the call's output is alive. Run with "
        "`MALLOC_MMAP_THRESHOLD_=65536` so that glibc returns every freed buffer ≥ 64 KiB to the OS (otherwise a warm "
        "process re-uses freed heap and under-reports). Baseline (model + inputs) RSS is excluded.",
        f"- Time: median of {args.repeats or '5 (L ≤ 2048) or 3 (larger L)'} calls per variant, in one subprocess per L with the default allocator, "
        "after a warm-up on the 512-token batch; the variants are called round robin so that load from other jobs "
        "hits them alike.",
        f"- Targets: (b)/(a) peak memory ≤ {MEM_TARGET}x, time ≤ {TIME_TARGET}x.",
        "",
        "| L | (a) peak Δ MiB | (b) peak Δ MiB | (c) peak Δ MiB | (b)/(a) mem | (c)/(a) mem "
        "| (a) time s | (b) time s | (c) time s | (b)/(a) time | (c)/(a) time |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for r in rows:
        m = {v: r["mem"][v]["peak_delta"] if v in r["mem"] else None for v in MAIN_VARIANTS}
        t = {v: r["time"].get(v) for v in MAIN_VARIANTS}

        def ts(v, t=t):
            return "—" if t[v] is None else f"{t[v]:.3f}"

        out.append(
            f"| {r['length']} | {_fmt_mib(m['a'])} | {_fmt_mib(m['b'])} | {_fmt_mib(m['c'])} "
            f"| {fmt_ratio(ratio(m['b'], m['a']), MEM_TARGET)} | {fmt_ratio(ratio(m['c'], m['a']))} "
            f"| {ts('a')} | {ts('b')} | {ts('c')} "
            f"| {fmt_ratio(ratio(t['b'], t['a']), TIME_TARGET)} | {fmt_ratio(ratio(t['c'], t['a']))} |"
        )
        for v, why in r["skip"].items():
            notes.append(f"- L={r['length']} ({v}) not measured: {why}")
    if notes:
        out += ["", *notes]
    out += ["", "Cross-checks:", ""]
    for r in rows:
        bits = []
        if "c" in r["mem"]:
            c = r["mem"]["c"]
            bits.append(f"(c) keeps {c['attention_maps_bytes'] / MIB:,.0f} MiB of attention maps alive "
                        f"(peak Δ {c['peak_delta'] / MIB:,.0f} MiB)")
        ru = [f"{v} {r['mem'][v]['ru_maxrss_delta'] / MIB:,.0f}" for v in MAIN_VARIANTS if v in r["mem"]]
        if ru:
            bits.append("ru_maxrss − baseline (MiB): " + ", ".join(ru))
        if "max_abs_err_vs_eager" in r:
            bits.append(f"probe vs eager masses: max |Δ| = {r['max_abs_err_vs_eager']:.1e}")
        if "time_all" in r:
            ta = r["time_all"]
            paired = [f"{v}/a {statistics.median(x / y for x, y in zip(ta[v], ta['a'])):.2f}"
                      for v in ("b", "c") if v in ta and "a" in ta]
            if paired:
                bits.append("time ratios, median of per-round pairs: " + ", ".join(paired))
            bits.append("all times (s): " + "; ".join(f"{v} " + " ".join(f"{x:.2f}" for x in xs) for v, xs in ta.items()))
            bits.append(f"CPU busy before timing {r['cpu_busy_before_timing']:.0%}, CPU utilisation while timing "
                        f"{r['cpu_utilisation']:.0%} (≈100% = uncontended; attempt {r['timing_attempts']})")
        if bits:
            out.append(f"- L={r['length']}: " + "; ".join(bits) + ".")
    if vocab_rows:
        out += [
            "",
            "What full logits cost: (a_full) = (a) without `logits_to_keep`, i.e. a forward that returns (B, L, vocab) "
            "logits, which is what `measure_modality_attention` did before it passed `logits_to_keep=1`. Measured at "
            "the tiny vocab and with the same model's embeddings / output layer resized to "
            f"{args.vocab_check:,} (Qwen2.5-VL's vocab), everything else unchanged:",
            "",
            "| L | vocab | (a_full) peak Δ MiB | (a) peak Δ MiB | (b) peak Δ MiB | (b)/(a_full) mem | (b)/(a) mem "
            "| (a_full) time s | (a) time s | (b) time s | (b)/(a_full) time | (b)/(a) time | full logits MiB |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in vocab_rows:
            m = {v: r["mem"][v]["peak_delta"] if v in r["mem"] else None for v in LOGITS_VARIANTS}
            t = {v: r["time"].get(v) for v in LOGITS_VARIANTS}
            lg = r["mem"]["a_full"]["logits_bytes"] if "a_full" in r["mem"] else None
            out.append(
                f"| {r['length']} | {r['vocab'] or info['vocab_size']:,} "
                + "".join(f"| {_fmt_mib(m[v])} " for v in LOGITS_VARIANTS)
                + f"| {fmt_ratio(ratio(m['b'], m['a_full']))} | {fmt_ratio(ratio(m['b'], m['a']))} "
                + "".join(f"| {'—' if t[v] is None else f'{t[v]:.3f}'} " for v in LOGITS_VARIANTS)
                + f"| {fmt_ratio(ratio(t['b'], t['a_full']))} | {fmt_ratio(ratio(t['b'], t['a']))} | {_fmt_mib(lg)} |"
            )
        for r in vocab_rows:
            for v, why in r["skip"].items():
                out.append(f"\n- L={r['length']} vocab {r['vocab']} ({v}) not measured: {why}")
    if kernels:
        out += ["", f"SDPA kernels chosen on this machine (text layers, L={kernels['length']}; "
                "`torch._fused_sdp_choice` on the actual arguments):", ""]
        out += ["| call | backend | q | k | v | mask | enable_gqa | calls |", "|---|---|---|---|---|---|---|---:|"]
        for c in kernels["calls"]:
            out.append(f"| {c['role']} | {c['backend']} | {tuple(c['q'])} | {tuple(c['k'])} | {tuple(c['v'])} "
                       f"| {c['mask']} | {c['enable_gqa']} | {c['calls']} |")
        out += ["", "One probe SDPA call (layer 0) with alternative arguments; peak Δ over the call, median of 3:", "",
                "| option | backend | ms | peak Δ MiB |", "|---|---|---:|---:|"]
        for mrow in kernels["micro"]:
            out.append(f"| {mrow['option']} | {mrow['backend']} | {mrow['ms']:.1f} | {mrow['peak_delta'] / MIB:,.1f} |")
        out.append(f"\n(bool mask slice {kernels['bool_mask_bytes'] / MIB:,.1f} MiB; torch converts a bool mask to a "
                   f"float one of {kernels['float_mask_bytes'] / MIB:,.1f} MiB inside every such call.)")
    return "\n".join(out) + "\n"


def _ensure_readme() -> None:
    """benchmarks/README.md lists one line per benchmark; add this one's line if it is missing."""
    path = ROOT / "benchmarks" / "README.md"
    line = ("- `attention_memory.py`: peak memory and time of `measure_modality_attention` vs a plain SDPA forward vs "
            "eager `output_attentions=True`, tiny Qwen2.5-VL, L = 512 ... 8192 (CPU, ~10 min idle): "
            "`.venv/bin/python -m benchmarks.attention_memory` (`--quick`: L ≤ 2048; `--lengths N ...`).\n")
    text = path.read_text(encoding="utf-8") if path.exists() else (
        "# Benchmarks\n\nRun from the repository root; each one replaces its own section of `benchmarks/RESULTS.md`.\n\n")
    if "attention_memory.py" not in text:
        path.write_text(text.rstrip("\n") + "\n" + line, encoding="utf-8")


# ------------------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"lengths {QUICK_LENGTHS} instead of {ALL_LENGTHS}")
    p.add_argument("--lengths", type=int, nargs="+", help="total sequence lengths to measure (overrides --quick)")
    p.add_argument("--threads", type=int, default=2, help="torch/OMP/MKL threads (default 2)")
    p.add_argument("--repeats", type=int, help="timed calls per variant and length (default 5 up to L=2048, else 3)")
    p.add_argument("--timing-retries", type=int, default=1, help="re-run a timing whose CPU utilisation shows "
                   "contention from other jobs (< 85%%) up to this many times, keeping the cleanest (default 1)")
    p.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    p.add_argument("--image-tokens", type=int, default=144, help="image tokens per row, a perfect square (default 144)")
    p.add_argument("--warmup-length", type=int, default=512, help=argparse.SUPPRESS)
    p.add_argument("--skip", nargs="+", choices=list(VARIANTS), help="variants to leave out")
    p.add_argument("--timeout", type=float, default=600, help="seconds per worker subprocess (default 600)")
    p.add_argument("--model-dir", help="use this saved tiny model instead of building one")
    p.add_argument("--vocab-check", type=int, default=151936, help="after the main table, measure (a_full), (a), (b) "
                   "at L=min(2048, max length), with the tiny vocab and with the output layer resized to this vocab "
                   "(default 151936, Qwen2.5-VL's), to see what full logits cost; 0 disables")
    p.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--wait-idle", type=float, default=120, help="seconds to wait for other jobs to leave the CPU "
                   "before each timing run (default 120)")
    p.add_argument("--no-write", action="store_true", help="print only; do not update benchmarks/RESULTS.md")
    p.add_argument("--no-kernels", action="store_true", help="skip the SDPA kernel check")
    p.add_argument("--no-check", action="store_true", help="skip the probe-vs-eager sanity check")
    p.add_argument("--json", help="also dump raw results to this file")
    # internal: worker mode
    p.add_argument("--worker", choices=["mem", "time", "kernels"], help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--variants", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if math.isqrt(args.image_tokens) ** 2 != args.image_tokens:
        p.error("--image-tokens must be a perfect square (the image is a square grid of 28-px tokens)")
    args.argv = list(argv)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        fn = {"mem": worker_mem, "time": worker_time, "kernels": worker_kernels}[args.worker]
        res = fn(args)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
