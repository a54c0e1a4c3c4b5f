"""The wheel is the library and nothing else, and works installed alone.

One slow test in steps, each built on the last: a source distribution of a copy of the checkout, the wheel built
from that unpacked sdist, the wheel installed into an empty folder and imported by a fresh process. The copy holds a
stale ``build/lib/trl_mdi/tiny/x.py`` (what an old build leaves in ``build/``): setuptools ships whatever sits in
``build/lib`` when a wheel is built straight from a tree, so the wheel is built from the sdist, which has no
``build/``. The repository's ``fixtures/`` (tiny models, synthetic data, warm-up, test helpers) must not be in it,
and the installed library must not need it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # builds and installs the wheel: make test-e2e, which CI runs

ROOT = Path(__file__).resolve().parents[1]
# What a clean clone lacks (.gitignore), so the copy is what a release would be built from.
NOT_IN_A_CLONE = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache",
                                        "*.egg-info", "build", "dist", "demo_run", "demo_bench", "training_logs",
                                        "wandb", "trackio", "outputs")
STALE = "trl_mdi/tiny/x.py"
FIXTURE_MODULES = ("tiny", "synthetic", "warmup", "testing")

# Run from an empty folder with only the installed wheel on PYTHONPATH (the venv's own dependencies still import).
CHILD = r"""
import importlib.util, json, sys

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

import trl_mdi
from trl_mdi import measure_modality_attention

model_dir = sys.argv[1]
processor = AutoProcessor.from_pretrained(model_dir)
model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is the shape?"}]}]
prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
enc = processor(text=[prompt], images=[[Image.new("RGB", (56, 56), (220, 30, 30))]], return_tensors="pt")
prompt_ids, prompt_mask = enc.pop("input_ids"), enc.pop("attention_mask")
completion = processor.tokenizer("Answer: A", add_special_tokens=False, return_tensors="pt").input_ids
extra = {k: v for k, v in enc.items() if isinstance(v, torch.Tensor)}
if "mm_token_type_ids" in extra:
    extra["mm_token_type_ids"] = torch.cat([extra["mm_token_type_ids"], torch.zeros_like(completion)], dim=1)
res = measure_modality_attention(
    model, torch.cat([prompt_ids, completion], dim=1), torch.cat([prompt_mask, torch.ones_like(completion)], dim=1),
    torch.cat([torch.zeros_like(prompt_ids), torch.ones_like(completion)], dim=1), **extra)
print(json.dumps({
    "trl_mdi": trl_mdi.__file__,
    "fixtures": importlib.util.find_spec("fixtures") is not None,
    "old_modules": [m for m in sys.argv[2:] if importlib.util.find_spec(m) is not None],
    "n_image": int(res.n_image[0]),
    "mdi": float(res.segment_metrics()["all"]["mdi"][0]),
}))
"""


def build(kind: str, source: Path, out: Path) -> Path:
    """``build_sdist`` or ``build_wheel`` of setuptools' PEP 517 backend, run in ``source``, without build isolation
    (setuptools is installed; no index is asked)."""
    code = f"import sys, setuptools.build_meta as b; print(b.build_{kind}(sys.argv[1]))"
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=source, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"build_{kind} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out / proc.stdout.strip().splitlines()[-1]


def test_wheel_from_a_clean_sdist_is_the_library_alone_and_works_installed(tiny_vlm_dir, tmp_path):
    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT, checkout, ignore=NOT_IN_A_CLONE)
    (checkout / "build" / "lib" / STALE).parent.mkdir(parents=True)
    (checkout / "build" / "lib" / STALE).write_text("raise ImportError('a stale module from an old build')\n")
    library = {p.relative_to(checkout).as_posix() for p in (checkout / "trl_mdi").rglob("*.py")}

    sdist = build("sdist", checkout, tmp_path / "sdist")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        assert not [n for n in names if "/build/" in n], "the sdist carries the checkout's build/ folder"
        tar.extractall(tmp_path / "unpacked", filter="data")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    wheel = build("wheel", unpacked, tmp_path / "wheel")

    files = zipfile.ZipFile(wheel).namelist()
    dist_info = f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info/"
    outside = [f for f in files if not f.startswith(("trl_mdi/", dist_info))]
    assert not outside, f"files outside trl_mdi/ and {dist_info}: {outside}"
    fixtures = [f for f in files if f.split("/")[1].removesuffix(".py") in FIXTURE_MODULES]
    assert not fixtures, f"the wheel ships fixtures: {fixtures}"
    assert {f for f in files if f.endswith(".py")} == library, "the wheel's modules differ from trl_mdi/'s"

    # The check above is not vacuous: the same stale file does ship in a wheel built straight from the tree.
    direct = build("wheel", checkout, tmp_path / "direct")
    assert STALE in zipfile.ZipFile(direct).namelist(), "setuptools no longer ships stale build/lib files"

    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check", "-q",
           "--target", str(site), str(wheel)]
    proc = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    model_dir = tiny_vlm_dir("qwen2_5_vl")  # built with the repository's fixtures.tiny, in the test process
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    old_modules = [f"trl_mdi.{m}" for m in FIXTURE_MODULES]  # where the fixtures lived before they left the package
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), *old_modules], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(seen["trl_mdi"]).is_relative_to(site), f"imported {seen['trl_mdi']}, not the installed wheel"
    assert not seen["fixtures"] and not seen["old_modules"], seen
    assert seen["n_image"] > 0 and 0 < seen["mdi"] < float("inf"), seen
