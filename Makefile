# Two commands: `make demo` runs the main job on the embedded default, `make test` runs the suite.
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

.PHONY: install test test-fast demo lint clean

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
	$(BIN)/python -m pytest

test-fast: install
	$(BIN)/python -m pytest -m "not slow and not distributed"

demo: install
	bash examples/demo.sh $(DEMO_DIR)

lint: install
	$(BIN)/ruff check trl_mdi fixtures tests examples data_prep benchmarks

clean:
	rm -rf $(DEMO_DIR) demo_bench training_logs/*.md training_logs/*/ .pytest_cache
