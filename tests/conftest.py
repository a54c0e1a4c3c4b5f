"""Shared test fixtures. The suite runs offline: nothing may come from the Hugging Face Hub.

The environment variables are set at import time, before any test module imports an HF library,
because huggingface_hub and transformers read them once, when first imported.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: `tiny_vlm_dir(arch, **kwargs)` -> folder holding a saved tiny VLM (model + processor).

    kwargs are those of `trl_mdi.tiny.save_tiny_vlm` (seed and size knobs). Each distinct
    (arch, kwargs) is built once per session and shared, so tests must not modify the folder.
    """
    built: dict[tuple, Path] = {}

    def factory(arch: str = "qwen2_5_vl", **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in built:
            from trl_mdi.tiny import save_tiny_vlm  # imported late: the env above must come first

            built[key] = save_tiny_vlm(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), **kwargs)
        return built[key]

    return factory
