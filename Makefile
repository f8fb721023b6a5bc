# Sluice: `make up` serves the default model locally; `make test` runs the whole suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODEL  ?= SmolLM2-135M-Instruct
EXAMPLE ?= examples/smollm2.yaml

.PHONY: install model up test test-fast bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

model: install
	$(BIN)/sluice models fetch $(MODEL)

up: model
	$(BIN)/sluice up -f $(EXAMPLE)

test: model
	$(BIN)/pytest -q -p no:cacheprovider

test-fast: model
	$(BIN)/pytest -q -p no:cacheprovider -m "not slow"

bench: model
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) build *.egg-info
