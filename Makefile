# Two commands on a fresh machine: `make demo` runs the main job, `make test` runs the test suite.
# Both create .venv and install what they need on first use.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch first, pinned, so pip takes the CPU wheel instead of resolving a multi-GB CUDA build
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[dev,bench]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/adaflash demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 $(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) *.egg-info
