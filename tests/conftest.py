"""Shared test fixtures. The suite runs offline: nothing may come from the Hugging Face Hub.

The environment variables are set at import time, before any test module imports an HF library,
because huggingface_hub and transformers read them once, when first imported.
"""

from fixtures.offline import set_offline_env

set_offline_env("trl_mdi_test_logs_")

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def own_log_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets an empty default log folder (``TRL_MDI_LOG_DIR``) of its own, inherited by what it launches.

    A trainer built without log paths names its logs by the second it started, so two tests' trainers (one on each
    xdist worker, or two in a row on one) may pick the same file and read each other's lines; a test that lists the
    folder (``describe_outputs``) would count another test's files. Seen in CI: a worker's attention maps landed in
    the folder while the other worker's test counted PNG files. Module- and session-scoped fixtures are set up
    before this one and keep the session-wide folder set above."""
    folder = tmp_path_factory.mktemp("training_logs")
    monkeypatch.setenv("TRL_MDI_LOG_DIR", str(folder))
    return folder


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
    """A test that launches 2 processes (marker `distributed`) must also be marked `e2e`.

    `make test` runs on 2 pytest-xdist workers; `make test-e2e` runs its `distributed` tests afterwards, alone and
    one after another (a 2-process launch beside another test runs about twice as slow, and two launches at once
    would share accelerate's default port). A `distributed` test outside `e2e` would run in `make test` beside the
    other worker, so collection refuses it.
    """
    unmarked = [item.nodeid for item in items
                if item.get_closest_marker("distributed") is not None and item.get_closest_marker("e2e") is None]
    if unmarked:
        raise pytest.UsageError(
            f"{len(unmarked)} test(s) marked distributed but not e2e: {', '.join(unmarked[:5])}. A test that launches "
            "2 processes must run alone, after the parallel tests: add @pytest.mark.e2e (make test-e2e runs it)."
        )
