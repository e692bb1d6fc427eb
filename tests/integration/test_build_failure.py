"""A model that cannot be built stops `neuron-serve deploy` at once with the model's own error."""

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, free_port

sys.path.insert(0, str(ROOT / "tests/integration/models"))
import unbuildable  # noqa: E402

# Bounds a hang (Serve rebuilding replicas forever), not a speed: a failing build takes
# about 30 s here, most of it starting Ray.
EXIT_TIMEOUT_S = 300


def deploy(config: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(
        [sys.executable, "-m", "neuron_serve.cli", "-v", "deploy", config, "--port", str(free_port())],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=EXIT_TIMEOUT_S,
    )


@pytest.mark.parametrize(
    ("config", "code", "error"),
    [
        ("tests/integration/models/unbuildable.yaml", 1,
         f"error: model 'unbuildable' failed to start: FileNotFoundError: {unbuildable.MESSAGE}\n"),
        ("tests/integration/models/unsupported.yaml", 3,
         "error: model 'unsupported' failed to start: UnsupportedModelError: The model has 1 operator(s) "
         "that target 'neuron' cannot run:\n  tests_faulty::gate at faulty.py(46): x = gate(x, self.delay_ms): "
         "torch-xla has no lowering (CPU fallback: aten::_local_scalar_dense)\n"
         "Pass partitioner_config=neuron_serve.PartitionerConfig() to run them on CPU.\n"),
    ],
    ids=["factory raises", "unsupported operator"],
)
def test_deploy_fails_fast_with_the_models_error(config, code, error):
    done = deploy(config)
    assert done.returncode == code, done.stderr[-3000:]
    assert error in done.stderr
    # Serve gave up at the first failed build of each of the (at most 2) replicas starting
    # together; by default it would rebuild 3 times per replica first.
    attempts = re.search(r"failed to start (\d+) times in a row", done.stderr)
    assert attempts and int(attempts.group(1)) <= 2, done.stderr[-3000:]
