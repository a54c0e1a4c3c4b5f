"""Shared test fixtures. The suite runs offline: nothing may come from the Hugging Face Hub.

The environment variables are set at import time, before any test module imports an HF library,
because huggingface_hub and transformers read them once, when first imported.
"""

from fixtures.offline import set_offline_env

set_offline_env("trl_mdi_test_logs_")

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: `tiny_vlm_dir(arch, **kwargs)` -> folder holding a saved tiny VLM (model + processor).

    kwargs are those of `fixtures.tiny.save_tiny_vlm` (seed and size knobs). Each distinct
    (arch, kwargs) is built once per session and shared, so tests must not modify the folder.
    """
    built: dict[tuple, Path] = {}

    def factory(arch: str = "qwen2_5_vl", **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in built:
            from fixtures.tiny import save_tiny_vlm  # imported late: the env above must come first

            built[key] = save_tiny_vlm(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), **kwargs)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def prepared_aokvqa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Synthetic A-OKVQA-format data run through the prep pipeline: train/validation parquet for training."""
    from fixtures.synthetic import write_synthetic_aokvqa
    from trl_mdi.aokvqa import prepare_aokvqa

    root = tmp_path_factory.mktemp("aokvqa")
    write_synthetic_aokvqa(root / "src", n_train=64, n_validation=16, n_test=8, seed=0, num_shards=1)
    prepare_aokvqa(root / "src", root / "prepared", log=lambda *a, **k: None)
    return root / "prepared"


@pytest.fixture(scope="session")
def grpo_train_dataset(prepared_aokvqa_dir: Path):
    """The prepared training split in TRL's conversational form (prompt messages + image column)."""
    from datasets import load_dataset

    from trl_mdi.data import to_conversational

    ds = load_dataset("parquet", data_files=str(prepared_aokvqa_dir / "train.parquet"), split="train")
    return ds.map(to_conversational)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that launch 2 processes share one pytest-xdist worker (`--dist loadgroup`, the Makefile's default).

    Two launches at once would both ask for accelerate's default port (the second falls back to a random one, racily)
    and each would get one of the 2 cores, so their timeouts would be measured on half the machine. Serially on one
    worker, they run beside the single-process tests on the other. Without xdist the mark does nothing.
    """
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.get_closest_marker("distributed") is not None:
            item.add_marker(pytest.mark.xdist_group("two_process_launches"))
