"""The vLLM tests: TRL's colocate mode with vLLM's CPU build generating, in the environment `make test-vllm` builds
(.venv-vllm). They live outside `make test`'s testpaths: the main environment has no vLLM.

The offline variables and the engine's environment (``fixtures.vllm_cpu.VLLM_ENV``) are set here, at import, before
any test module imports vLLM or an HF library (both read them once, when first imported); the CPU harness
(``fixtures.vllm_cpu.install``, why: its docstring) is installed before any engine starts.
"""

from fixtures.offline import set_offline_env

set_offline_env("trl_mdi_vllm_test_logs_")

from fixtures import vllm_cpu  # noqa: E402

vllm_cpu.set_env()

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# vLLM's CPU attention kernels take head sizes of 32 and up (the suite's default tiny models have 16): 4 layers of
# width 256 with 4 heads (head_dim 64) and 2 KV heads.
VLLM_TINY_SIZE = dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="session", autouse=True)
def cpu_harness():
    vllm_cpu.install()


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``tiny_vlm_dir(arch, **kwargs)`` -> folder of a saved tiny VLM sized for vLLM's CPU kernels
    (``VLLM_TINY_SIZE``, overridable by kwargs); each distinct (arch, kwargs) built once per session."""
    built: dict[tuple, Path] = {}

    def factory(arch: str = "qwen2_5_vl", **kwargs) -> Path:
        size = {**VLLM_TINY_SIZE, **kwargs}
        key = (arch, tuple(sorted(size.items())))
        if key not in built:
            from fixtures.tiny import save_tiny_vlm

            built[key] = save_tiny_vlm(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), **size)
        return built[key]

    return factory
