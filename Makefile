# Two entry points for a fresh machine: `make serve` and `make test`.
# `make serve EXAMPLE=deployments/encoder.yaml` serves another example.
# Both create .venv on first use; every other target is a helper.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
EXAMPLE ?= deployments/mlp.yaml

.PHONY: install serve analyze test

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/neuron-serve deploy $(EXAMPLE)

analyze: $(STAMP)
	$(BIN)/neuron-serve analyze $(EXAMPLE)

test: $(STAMP)
	$(BIN)/pytest
