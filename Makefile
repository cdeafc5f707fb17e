# jaxnn: `make train` and `make test` are the whole set-up on a fresh machine with only Python.
# The first call creates .venv and installs jaxnn with its dev extra (pinned by constraints.txt).
# Other targets live in mk/*.mk, one file per area, so the areas can grow without stepping on each other.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?= cnn
DATA ?=
DEVICES ?= 1
ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install train test test-all lint typecheck bench clean

help:
	@echo "make train        train the CNN on the bundled digits (MODEL=gpt, DATA=dir, DEVICES=8, ARGS='...')"
	@echo "make test         ruff, then the fast tier of the tests: run on every change (installs .venv on first use)"
	@echo "make test-all     ruff, mypy and every test: slow and process-starting ones too (what CI runs)"
	@echo "make lint         ruff (lint and format check)"
	@echo "make typecheck    mypy on jaxnn/"
	@echo "make bench        time training steps of the benchmark models, fp32 and bf16"
	@grep -hE '^[a-z][a-z0-9-]*:.*## ' mk/*.mk 2>/dev/null | sed -E 's/:.*## /\t/' | awk -F'\t' '{printf "make %-15s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,all,interop,onednn]'
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(PY) -m jaxnn.cli train --model $(MODEL) $(if $(DATA),--data $(DATA)) --devices $(DEVICES) $(ARGS)

# -n 2: one pytest worker per core. Tests are spread one by one (loadgroup), except modules that mark a group
# to share an expensive module-scoped fixture on one worker; --durations shows where the time goes.
# Two tiers (docs/testing.md): `test` leaves out the tests marked slow or system, `test-all` runs every test.
FAST_TIER := not slow and not system

test: lint
	@echo "== fast tier: tests marked neither slow nor system (make test-all runs every test)"
	$(PY) -m pytest -n 2 --dist loadgroup --durations=10 -m "$(FAST_TIER)" tests

test-all: lint typecheck
	@echo "== every test: the fast, slow and system tiers together"
	$(PY) -m pytest -n 2 --dist loadgroup --durations=15 tests

# The same checks as .pre-commit-config.yaml, from the pinned versions in .venv.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: $(STAMP)
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) -m benchmarks.train_steps $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

-include mk/*.mk
