"""A small built model (an accelerator subgraph, then a CPU one), shared by the runtime tests."""

from pathlib import Path

import pytest

from neuron_serve.assembly.from_config import build
from neuron_serve.config.factory import build_model
from neuron_serve.config.schema import parse_config

HERE = Path(__file__).resolve().parent / "models"  # the factories model.yaml names
TRACE_BATCH = 4
CONFIG = {
    "name": "scores", "model": {"factory": "scores_model:build"}, "inputs": [{"name": "x", "shape": [TRACE_BATCH, 8]}],
    "outputs": ["scores"], "partitioner": {"model_support_percentage_threshold": 0.5}, "dynamic_batch": True,
    "batching": {"max_batch_size": 16, "max_queue_delay_ms": 1},
}


@pytest.fixture(scope="session")
def config():
    return parse_config(CONFIG)


@pytest.fixture(scope="session")
def eager(config):
    """The same model (same seed), uncompiled."""
    return build_model(config, HERE)


@pytest.fixture(scope="session")
def built(config):
    """The model as a replica builds it: through neuron_serve.assembly.from_config from its model.yaml."""
    return build(config, HERE)


@pytest.fixture(scope="session")
def pooled(pooling_dirs):
    """``pooled(name, **changes)``: the pooling model ``name`` of tests/pooling_models.py built as a replica builds
    it (compiled model, spec, tokenizer), once per session for each model.yaml."""
    from neuron_serve.pooling.build import build as build_pooling  # noqa: PLC0415

    built: dict = {}

    def get(name: str, source: str | None = None, **changes):
        config = parse_config(pooling_dirs.config(name, source, **changes))
        key = config.model_dump_json()
        if key not in built:
            built[key] = (config, *build_pooling(config))
        return built[key]

    return get
