"""What a benchmark run's numbers depend on besides its code: the float path pinned before torch is imported, the
environment each run record carries, and the fingerprint of the weights a run starts from.

Why (issue 44): the look-or-guess replication did not reproduce on another machine of the same kind. The warm-up
weights differed from the same code, because CPU kernels take different paths on different CPUs (torch picks
AVX-512 or AVX2 kernels, MKL and oneDNN pick their own), and a trained policy amplifies the difference. So:

1. :func:`pin_float_path` sets, BEFORE torch is imported, the variables that choose those paths, at a level every
   x86-64 machine of this kind has (:data:`PINS`); :func:`apply_torch_pins` then fixes threads and deterministic
   algorithms and checks that torch took the pinned path. Measured on this machine (AMD EPYC with AVX-512,
   oneMKL 2024.0, torch 2.14.1):
   - ``ATEN_CPU_CAPABILITY=avx2``: torch's own vectorised kernels (softmax, SDPA, elementwise) at AVX2; without
     it torch picks AVX512 here, and those kernels give other bits.
   - ``MKL_CBWR=COMPATIBLE``: MKL's conditional numerical reproducibility. MKL honours a *branch* setting
     (``MKL_CBWR=AVX2``) on Intel processors only: on this AMD EPYC ``MKL_VERBOSE`` reports ``CNR:AUTO`` for it,
     i.e. MKL still chooses its own code path per processor. ``COMPATIBLE`` is the one setting MKL applies on
     every x86-64 processor, Intel or not, so an Intel machine with AVX-512 and an AMD one run the same sgemm.
   - ``ONEDNN_MAX_CPU_ISA=AVX2`` (and its older name ``DNNL_MAX_CPU_ISA``): oneDNN's kernels at most AVX2.
   - one thread for torch, OpenMP and MKL (a reduction split over threads sums in another order), and
     ``torch.use_deterministic_algorithms(True)``.
2. :func:`environment_record` is what every run record carries: Python, torch, transformers, trl, accelerate
   (and the other libraries that touch the numbers), the CPU model and its instruction-set flags, torch's CPU
   capability, threads, the pins in effect.
3. :func:`weights_sha256` fingerprints a model folder by its tensors (names, dtypes, shapes, bytes; not the files'
   metadata); :func:`check_weights` refuses a start whose fingerprint is not the one a plan names.

What stays machine-dependent even pinned: anything the pins do not reach (a library that dispatches on the CPU by
itself without a switch, e.g. libm's transcendental functions outside MKL, or another torch/MKL build); the
records name the CPU model and every version so that a difference can be traced. Wall times are machine- and
load-dependent by nature.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PINNED, NATIVE = "pinned", "native"
FLOAT_PATHS = (PINNED, NATIVE)
"""``pinned``: the variables of :data:`PINS` (the default); ``native``: whatever the machine picks (what the
benchmarks did before issue 44; kept to show that it differs and to rerun old records)."""

CPU_CAPABILITY = "AVX2"
"""torch's CPU capability under the pins (``torch.backends.cpu.get_cpu_capability()``)."""

PINS: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "DNNL_MAX_CPU_ISA": "AVX2",
}
"""The float-path variables, read once by torch, MKL and oneDNN when they load: set before ``import torch``."""

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

RECORDED_VARS = (*PINS, *THREAD_VARS, "MKL_ENABLE_INSTRUCTIONS", "OMP_WAIT_POLICY")
"""Environment variables a record lists (set or not): the pins and whatever else changes a float path or threads."""

LIBRARIES = ("torch", "transformers", "trl", "accelerate", "datasets", "tokenizers", "numpy", "PIL", "safetensors",
             "scipy")
"""Libraries whose versions a record lists (those that compute or load what a run's numbers are made of)."""

KEY_LIBRARIES = ("torch", "transformers", "trl", "accelerate")
"""The versions that enter a run's key (:func:`environment_key`): another version of these reruns the run."""

CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "amx_tile", "amx_bf16")
"""The instruction-set flags of /proc/cpuinfo a record lists (those a float path may use)."""


def pin_float_path(threads: int = 1, float_path: str = PINNED, environ: dict | None = None) -> dict[str, str]:
    """Set the float path's variables in ``environ`` (default ``os.environ``) and return what was set.

    ``pinned``: :data:`PINS` plus ``threads`` for OpenMP and MKL; ``native``: the thread variables only (the
    machine picks its kernels; a pin variable holding its pinned value, inherited from a pinned parent, is removed,
    any other value set by hand stays and is recorded). Must run before torch is imported in this process (torch, MKL and oneDNN read these
    variables once): with torch already imported it raises RuntimeError unless every variable already holds the
    value asked for (a worker that inherited them, or a second call). Spawned workers inherit ``os.environ``, and
    each checks again (:func:`check_torch_pins`).

    >>> env = {}
    >>> pin_float_path(1, environ=env) == {**PINS, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"} == env
    True
    >>> sorted(pin_float_path(2, "native", environ={}))
    ['MKL_NUM_THREADS', 'OMP_NUM_THREADS']
    """
    if float_path not in FLOAT_PATHS:
        raise ValueError(f"float_path must be one of {FLOAT_PATHS}, got {float_path!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
    env = os.environ if environ is None else environ
    wanted = {**(PINS if float_path == PINNED else {}), **{v: str(threads) for v in THREAD_VARS}}
    if environ is None and "torch" in sys.modules:
        wrong = {k: (env.get(k), v) for k, v in wanted.items() if env.get(k) != v}
        if wrong:
            raise RuntimeError(
                "torch was imported before the float path was pinned, so these variables cannot take effect in this "
                f"process: {', '.join(f'{k}={have!r} (wanted {want!r})' for k, (have, want) in wrong.items())}. "
                "Call benchmarks.environment.pin_float_path() before anything imports torch.")
    if float_path == NATIVE:
        for k, v in PINS.items():  # a native run must not inherit a pinned parent's path (another value stays)
            if env.get(k) == v:
                env.pop(k)
    env.update(wanted)
    return wanted


def apply_torch_pins(threads: int = 1, float_path: str = PINNED) -> None:
    """After ``import torch``: ``threads`` torch threads, deterministic algorithms, and (pinned) a check that
    torch took the pinned CPU capability (:func:`check_torch_pins`)."""
    import torch

    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    if float_path == PINNED:
        check_torch_pins()


def check_torch_pins(capability: str | None = None) -> None:
    """Raise RuntimeError when torch's CPU capability is not :data:`CPU_CAPABILITY` or a pin variable is missing:
    the process imported torch before :func:`pin_float_path` (or was started without the variables)."""
    if capability is None:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    missing = {k: v for k, v in PINS.items() if os.environ.get(k) != v}
    if capability != CPU_CAPABILITY or missing:
        raise RuntimeError(
            f"the float path is not pinned in this process: torch's CPU capability is {capability!r} (pinned: "
            f"{CPU_CAPABILITY!r}); variables not as pinned: {sorted(missing) or 'none'}. Set them before torch is "
            "imported (benchmarks.environment.pin_float_path), or run with --float_path native to record an unpinned "
            "run as such.")


# ------------------------------------------------------------------------------------------------ the record


def parse_cpuinfo(text: str) -> dict[str, Any]:
    """The CPU model and the float-path flags (:data:`CPU_FLAGS`, in that order) from /proc/cpuinfo's text.

    >>> parse_cpuinfo("processor\\t: 0\\nmodel name\\t: AMD EPYC\\nflags\\t\\t: fpu sse4_2 avx avx2 fma avx512f\\n")
    {'model': 'AMD EPYC', 'flags': ['sse4_2', 'avx', 'avx2', 'fma', 'avx512f']}
    >>> parse_cpuinfo("")
    {'model': None, 'flags': []}
    """
    model, flags = None, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return {"model": model, "flags": [f for f in CPU_FLAGS if f in flags]}


def cpu_record() -> dict[str, Any]:
    """:func:`parse_cpuinfo` of this machine (``platform.processor()`` where /proc/cpuinfo is absent), and the CPU
    count."""
    try:
        info = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        info = {"model": platform.processor() or None, "flags": []}
    return {**info, "count": os.cpu_count()}


def library_versions(names: tuple[str, ...] = LIBRARIES) -> dict[str, str | None]:
    """``{name: version}`` of each importable library (None when absent), read from its package metadata, so that
    nothing is imported here (torch must not be imported before the pins)."""
    from importlib import metadata

    dists = {"PIL": "pillow"}
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(dists.get(name, name))
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def float_path_in_effect(environ: Mapping[str, str] | None = None) -> str:
    """``pinned`` when every variable of :data:`PINS` holds its pinned value in ``environ`` (default
    ``os.environ``), else ``native``.

    >>> float_path_in_effect(dict(PINS)), float_path_in_effect({})
    ('pinned', 'native')
    """
    env = os.environ if environ is None else environ
    return PINNED if all(env.get(k) == v for k, v in PINS.items()) else NATIVE


def environment_record() -> dict[str, Any]:
    """What a run's numbers depend on besides its code, for its record: ``python``, ``platform``, ``libraries``
    (:func:`library_versions`), ``cpu`` (:func:`cpu_record`), ``float_path`` (:func:`float_path_in_effect`),
    ``variables`` (:data:`RECORDED_VARS` as set, None where unset), and, once torch is imported,
    ``torch_cpu_capability``, ``torch_threads``, ``torch_interop_threads``, ``deterministic`` and torch's ``mkl`` /
    ``onednn`` build versions."""
    rec: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(), "libraries": library_versions(),
        "cpu": cpu_record(), "float_path": float_path_in_effect(),
        "variables": {k: os.environ.get(k) for k in RECORDED_VARS},
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        config = torch.__config__.show()
        rec.update(torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
                   torch_threads=torch.get_num_threads(), torch_interop_threads=torch.get_num_interop_threads(),
                   deterministic=torch.are_deterministic_algorithms_enabled(),
                   mkl=_config_line(config, "Math Kernel Library"), onednn=_config_line(config, "MKL-DNN"))
    return rec


def _config_line(config: str, needle: str) -> str | None:
    return next((line.strip(" -") for line in config.splitlines() if needle in line), None)


def environment_key(record: Mapping[str, Any]) -> dict[str, Any]:
    """The part of an environment record that enters a run's key: the float path and its variables, the threads,
    torch's CPU capability and the versions of :data:`KEY_LIBRARIES`. Not the CPU model: the pins exist so that
    machines of one kind give the same numbers, and the record keeps the model for tracing a difference.

    >>> rec = {"float_path": "pinned", "variables": {"MKL_CBWR": "COMPATIBLE"}, "torch_threads": 1,
    ...        "torch_cpu_capability": "AVX2", "libraries": {"torch": "2.14.1", "numpy": "2"}, "cpu": {"model": "x"}}
    >>> environment_key(rec)["libraries"]
    {'torch': '2.14.1', 'transformers': None, 'trl': None, 'accelerate': None}
    """
    return {"float_path": record.get("float_path"), "variables": dict(record.get("variables") or {}),
            "torch_threads": record.get("torch_threads"), "torch_cpu_capability": record.get("torch_cpu_capability"),
            "libraries": {k: (record.get("libraries") or {}).get(k) for k in KEY_LIBRARIES}}


def describe_environment(records: list[Mapping[str, Any]]) -> str:
    """One sentence for a report: every distinct CPU model, float path, CPU capability and key library versions
    among ``records`` (environment records), each with its count when they differ.

    >>> r = {"float_path": "pinned", "torch_cpu_capability": "AVX2", "cpu": {"model": "AMD EPYC"},
    ...      "libraries": {"torch": "2.14.1", "transformers": "5.23.0", "trl": "1.16.0", "accelerate": "1.15.0"},
    ...      "variables": {"MKL_CBWR": "COMPATIBLE"}, "torch_threads": 1, "python": "3.11.7"}
    >>> describe_environment([r, r])
    'CPU AMD EPYC; float path pinned (torch AVX2, MKL_CBWR=COMPATIBLE), 1 thread; Python 3.11.7, torch 2.14.1, transformers 5.23.0, trl 1.16.0, accelerate 1.15.0'
    """
    from collections import Counter

    def part(values: list[str]) -> str:
        counts = Counter(values)
        if len(counts) == 1:
            return next(iter(counts))
        return " / ".join(f"{v} ({n} runs)" for v, n in counts.most_common())

    if not records:
        return "no environment recorded"
    libs = [", ".join(f"{k} {(r.get('libraries') or {}).get(k)}" for k in KEY_LIBRARIES) for r in records]
    return (f"CPU {part([str((r.get('cpu') or {}).get('model')) for r in records])}; float path "
            + part([f"{r.get('float_path')} (torch {r.get('torch_cpu_capability')}, MKL_CBWR="
                    f"{(r.get('variables') or {}).get('MKL_CBWR')}), {r.get('torch_threads')} thread"
                    + ("s" if r.get("torch_threads") != 1 else "") for r in records])
            + f"; Python {part([str(r.get('python')) for r in records])}, {part(libs)}")


# ------------------------------------------------------------------------------------------------ weights


def weights_sha256(model_dir: str | Path) -> str:
    """A SHA-256 of a saved model's weights: for every tensor of every ``*.safetensors`` file in ``model_dir``,
    sorted by name, its name, dtype, shape and raw bytes. The files' own metadata and layout do not enter, so a
    re-saved copy of the same weights has the same hash and any changed value a different one. Raises
    FileNotFoundError when the folder holds no safetensors file."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}: not a saved model folder")
    tensors = {}
    for path in files:
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                if name in tensors:
                    raise ValueError(f"tensor {name!r} appears in two files of {model_dir}")
                tensors[name] = (path, name)
    h = hashlib.sha256()
    for name in sorted(tensors):
        path, _ = tensors[name]
        with safe_open(str(path), framework="numpy") as f:
            array = f.get_tensor(name)
        h.update(f"{name}\0{array.dtype.str}\0{tuple(array.shape)}\0".encode())
        h.update(array.tobytes(order="C"))
    return h.hexdigest()


def check_weights(found: str, expected: str | None, *, what: str = "warm-up", allow_other: bool = False,
                  flag: str = "--allow_other_warmup") -> str:
    """Return ``found`` when it matches ``expected`` (a full SHA-256, or a prefix of at least 12 hex digits), or
    when nothing is expected; otherwise raise ValueError naming both and the fix, unless ``allow_other`` (then the
    mismatch is the caller's to record).

    >>> check_weights("ab" * 32, "abababababab")[:4]
    'abab'
    >>> check_weights("ab" * 32, "cd" * 6)
    Traceback (most recent call last):
    ...
    ValueError: the warm-up's weights hash to abababababab..., not cdcdcdcdcdcd as expected: another environment or code built it. Rebuild it in the pinned environment, or pass --allow_other_warmup to train from it anyway (the records then say so).
    """
    if expected is None:
        return found
    expected = expected.strip().lower()
    if len(expected) < 12 or any(c not in "0123456789abcdef" for c in expected):
        raise ValueError(f"an expected {what} hash must be at least 12 hex digits, got {expected!r}")
    if found.startswith(expected) or allow_other:
        return found
    raise ValueError(f"the {what}'s weights hash to {found[:12]}..., not {expected[:12]} as expected: another "
                     f"environment or code built it. Rebuild it in the pinned environment, or pass {flag} to train "
                     "from it anyway (the records then say so).")
