# Two entry points for a fresh machine: `make serve` and `make test`.
# `make serve EXAMPLE=deployments/encoder.yaml` serves another example.
# Both create .venv on first use; every other target is a helper.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
EXAMPLE ?= deployments/mlp.yaml

.PHONY: install serve analyze test bench bench-quick

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

# Benchmarks against peer servers (needs wrk: apt-get install wrk). Results: bench/results/.
$(VENV)/.bench: $(STAMP)
	$(BIN)/pip install -e '.[test,bench]'
	touch $(VENV)/.bench

bench: $(VENV)/.bench
	$(BIN)/python -m bench

bench-quick: $(VENV)/.bench
	$(BIN)/python -m bench --quick
