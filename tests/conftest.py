import logging
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "deployments"))  # example_models, as model.yaml files resolve it
sys.path.insert(0, str(Path(__file__).resolve().parent))
from collected_files import COLLECTED  # noqa: E402 - from the folder just put on the path
# One compile cache per test run (servers started by tests inherit it), never the user's.
os.environ.setdefault("NEURON_SERVE_CACHE_DIR", tempfile.mkdtemp(prefix="neuron-serve-test-cache-"))
# The suite's two workers share the machine's CPUs, each starting servers: a served engine computes on one thread
# per emulated core (alone on a machine it takes every CPU), so neither worker's engines crowd out the other's.
os.environ.setdefault("NEURON_SERVE_EMULATED_CORE_THREADS", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def neuron_logs(caplog):
    """The INFO lines of the `neuron_serve` logger, as a list of messages."""
    caplog.set_level(logging.INFO, logger="neuron_serve")

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "neuron_serve"]

    return lines


@pytest.fixture
def fresh_cache(tmp_path):
    """An empty compile cache in tmp_path and new support oracles, as in a newly started process."""
    from neuron_serve.analysis import placement  # noqa: PLC0415
    from neuron_serve.compile import cache as compile_cache  # noqa: PLC0415

    store = compile_cache.configure(tmp_path / "cache")
    placement._ORACLES.clear()
    yield store
    placement._ORACLES.clear()
    compile_cache.configure()


@pytest.hookimpl(tryfirst=True)  # before -m deselects: tests/unit/test_collection.py sees every collected file
def pytest_collection_modifyitems(config, items):
    """The documentation's examples last, and just before them the other tests of their servers.

    They run in this process, as a reader runs them (a page's blocks share one
    namespace): they initialise XLA, whose environment variables a page's clean-up then
    removes, and they compile graphs that other tests expect to compile first (torch-xla
    keeps compiled graphs per process). Run last, they change nothing another test sees.
    The serial tests that share their session servers (tests/integration/conftest.py's
    examples_server, then examples_llm_server) come right before them, so that neither
    server is started twice or left idle beside the timed tests of the serial run.
    """
    config.stash[COLLECTED] = {Path(str(item.path)).resolve() for item in items}
    items.sort(key=_late)  # stable: the rest keep their order


def _late(item) -> int:
    if "test_doc_examples.py" in item.nodeid:
        return 3
    for rank, name in enumerate(("examples_server", "examples_llm_server"), 1):
        if name in item.fixturenames:
            return rank
    return 0


@pytest.fixture(scope="session")
def pooling_dirs(tmp_path_factory):
    """The pooling tests' model directories (tests/pooling_models.py), written on first use, shared by the unit
    and the served tests."""
    import pooling_models  # noqa: PLC0415

    return pooling_models.Directories(tmp_path_factory.mktemp("pooling-models"))
