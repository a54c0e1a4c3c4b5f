"""benchmarks/environment.py (issue 44): the float path pinned before torch, the environment a run record carries,
and the weights fingerprint a plan names. Pure parts here; the pinned runs' bit-identity is shown by
``python -m benchmarks.tprl_look_or_guess repro`` (minutes, not a unit test)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import environment as E
from benchmarks.results import ROOT


def test_pins_set_every_variable_and_native_drops_only_inherited_pins():
    env = {"OMP_NUM_THREADS": "8"}
    wanted = E.pin_float_path(1, environ=env)
    assert env == wanted == {**E.PINS, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    assert env["MKL_CBWR"] == "COMPATIBLE" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    # a native child of a pinned parent: the inherited pins go; a value set by hand for another level stays
    env = {**E.PINS, "ATEN_CPU_CAPABILITY": "default"}
    E.pin_float_path(2, "native", environ=env)
    assert env == {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    with pytest.raises(ValueError, match="float_path"):
        E.pin_float_path(1, "avx2", environ={})
    with pytest.raises(ValueError, match="threads"):
        E.pin_float_path(0, environ={})


def test_pinning_after_torch_is_imported_is_refused(monkeypatch):
    import torch  # noqa: F401 - the point: torch is already loaded in this process

    for k in E.PINS:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="torch was imported before the float path was pinned"):
        E.pin_float_path(1)
    assert all(k not in os.environ for k in E.PINS)  # nothing half-set
    with pytest.raises(RuntimeError, match="not pinned in this process"):
        E.check_torch_pins("AVX512")


def _fresh(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)


def test_a_fresh_process_takes_the_pinned_path():
    clean = {k: "" for k in E.PINS}  # an empty value is no pin
    code = ("from benchmarks.environment import pin_float_path, apply_torch_pins, environment_record\n"
            "pin_float_path(1)\nimport torch\napply_torch_pins(1)\nr = environment_record()\n"
            "print(r['torch_cpu_capability'], r['float_path'], r['deterministic'], r['torch_threads'])")
    done = _fresh(code, clean)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["AVX2", "pinned", "True", "1"]
    # started without the pins, torch picks its own path and the check refuses it (unless this CPU's best is AVX2)
    done = _fresh("import torch\nfrom benchmarks.environment import check_torch_pins\ncheck_torch_pins()", clean)
    assert done.returncode != 0 and "not pinned in this process" in done.stderr


def test_cpuinfo_record_and_key():
    info = E.parse_cpuinfo("processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu avx2 fma avx512f amx_tile\n"
                           "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    assert info == {"model": "AMD EPYC 9B14", "flags": ["avx2", "fma", "avx512f", "amx_tile"]}
    rec = E.environment_record()
    for key in ("python", "platform", "libraries", "cpu", "float_path", "variables"):
        assert key in rec
    assert set(E.KEY_LIBRARIES) <= set(rec["libraries"]) and rec["libraries"]["torch"]
    key = E.environment_key({**rec, "cpu": {"model": "another CPU"}})
    assert key == E.environment_key(rec)  # the CPU model is recorded, not keyed: the pins make machines agree
    assert key != E.environment_key({**rec, "libraries": {**rec["libraries"], "torch": "0.0"}})
    assert key != E.environment_key({**rec, "variables": {**rec["variables"], "MKL_CBWR": "AUTO"}})
    assert E.float_path_in_effect(dict(E.PINS)) == "pinned"
    assert E.float_path_in_effect({**E.PINS, "MKL_CBWR": "AVX2"}) == "native"
    two = E.describe_environment([{**rec, "cpu": {"model": "a"}}, {**rec, "cpu": {"model": "b"}}])
    assert "a (1 runs) / b (1 runs)" in two


def test_weights_fingerprint_reads_tensors_not_files(tmp_path):
    from safetensors.numpy import save_file

    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, dtype=np.float32)
    (tmp_path / "one").mkdir()
    save_file({"w.a": a, "w.b": b}, str(tmp_path / "one" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "two").mkdir()  # the same tensors, in two shards, other metadata
    save_file({"w.b": b}, str(tmp_path / "two" / "model-00002.safetensors"), metadata={"note": "x"})
    save_file({"w.a": a}, str(tmp_path / "two" / "model-00001.safetensors"))
    (tmp_path / "three").mkdir()  # one value changed by one ulp
    c = a.copy()
    c[1, 2] = np.nextafter(c[1, 2], np.float32(10))
    save_file({"w.a": c, "w.b": b}, str(tmp_path / "three" / "model.safetensors"))
    h = E.weights_sha256(tmp_path / "one")
    assert len(h) == 64 and h == E.weights_sha256(tmp_path / "two") != E.weights_sha256(tmp_path / "three")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        E.weights_sha256(tmp_path)


def test_a_different_warmup_is_refused_unless_told():
    found = "ab12" * 16
    assert E.check_weights(found, None) == found  # nothing expected: recorded only
    assert E.check_weights(found, found[:12].upper()) == found
    with pytest.raises(ValueError, match="--allow_other_warmup"):
        E.check_weights(found, "cd" * 32)
    assert E.check_weights(found, "cd" * 32, allow_other=True) == found
    with pytest.raises(ValueError, match="at least 12 hex digits"):
        E.check_weights(found, "ab12")
