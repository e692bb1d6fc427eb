"""What neuron-serve's commands and replicas print while they build: a line per compiled model and a
placement summary; the partitioner's operator lists only with --verbose (NEURON_SERVE_VERBOSE)."""

import logging
import os
import subprocess
import sys

import pytest
import torch

import neuron_serve
from neuron_serve import logs
from neuron_serve.assembly.progress import BuildProgress, reporting
from reference_models import MLP

OPERATOR_LISTS = ("The following operations are currently supported:", "Num Partitions: 2",
                  "Creating Partition #1 for device: Device.NEURON", "aten::linear:3")


@pytest.fixture
def configured():
    """logs.configure as a command calls it; the library's own set-up back afterwards."""
    serve = logging.getLogger("neuron_serve")
    level, partitioner_level = serve.level, logs._partitioner_level
    yield logs.configure
    serve.setLevel(level)
    logs._partitioner_level = partitioner_level


def _build(name="mlp"):
    with reporting(BuildProgress(name, 1, tty=False)):
        neuron_serve.trace(MLP().eval(), torch.rand(4, 784), partitioner_config=neuron_serve.PartitionerConfig())


def test_a_command_prints_a_line_per_compiled_model_and_the_placement_not_the_operator_lists(configured, caplog):
    configured(verbose=False)
    _build()  # at the level configure set: INFO
    printed = [r.getMessage() for r in caplog.records if r.name == "neuron_serve"]
    assert not [line for line in printed if line in OPERATOR_LISTS or line.startswith("aten::")], printed
    assert [line for line in printed if line.startswith("compiled")] == [
        line for line in printed if line.startswith("compiled mlp (1 of 1) in ")]
    assert ("placement of mlp (1 compiled model): 1 accelerator subgraph, 1 CPU subgraph; operators: 6 on the "
            "accelerator, 1 on CPU (aten::sort); --verbose lists them") in printed


def test_verbose_prints_the_operator_lists(configured, caplog):
    configured(verbose=True)
    assert logging.getLogger("neuron_serve").isEnabledFor(logging.DEBUG)
    _build()
    printed = [r.getMessage() for r in caplog.records if r.name == "neuron_serve"]
    assert set(OPERATOR_LISTS) <= set(printed)
    summary = [line for line in printed if line.startswith("placement of mlp")]
    assert summary and not summary[0].endswith("--verbose lists them")


def test_the_app_notes_neuron_logger_still_gets_the_lines_under_a_command(configured, caplog):
    configured(verbose=False)
    neuron = logging.getLogger("Neuron")
    previous = neuron.level
    neuron.setLevel(logging.INFO)  # as the graph partitioner app note does
    neuron.addHandler(caplog.handler)
    try:
        _build()
    finally:
        neuron.removeHandler(caplog.handler)
        neuron.setLevel(previous)
    lines = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.name == "Neuron"]
    assert "Neuron: Num Partitions: 2" in lines


def test_a_replica_reads_verbose_from_the_environment(tmp_path):
    # A replica (or its engine process) calls logs.configure() with NEURON_SERVE_VERBOSE as deploy -v passed it on.
    script = (
        "import os, sys, torch, neuron_serve\n"
        "from neuron_serve import logs\n"
        "from neuron_serve.assembly.progress import BuildProgress, reporting\n"
        "for verbose in ('', '1'):\n"
        "    os.environ[logs.VERBOSE_ENV] = verbose\n"
        "    logs.configure()\n"
        "    print(f'--- verbose={verbose!r}', file=sys.stderr, flush=True)\n"
        "    with reporting(BuildProgress('tiny', 1, tty=False)):\n"
        "        neuron_serve.trace(torch.nn.Linear(4, 4).eval(), torch.rand(2, 4),\n"
        "                           partitioner_config=neuron_serve.PartitionerConfig())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != logs.VERBOSE_ENV}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True,
                         env=env)
    quiet, verbose = run.stderr.split("--- verbose='1'")
    assert "Num Partitions" not in quiet and "aten::" not in quiet.replace("(aten::", "")
    assert "neuron_serve: compiled tiny (1 of 1) in " in quiet
    assert ("neuron_serve: placement of tiny (1 compiled model): 1 accelerator subgraph, 0 CPU subgraphs; "
            "operators: 1 on the accelerator, 0 on CPU; --verbose lists them") in quiet
    assert "neuron_serve: Num Partitions: 1\n" in verbose and "neuron_serve: aten::linear:1\n" in verbose
    assert "neuron_serve: compiled tiny (1 of 1) in " in verbose


def test_deploy_passes_verbose_on_to_its_replicas():
    # In a process of its own: importing Ray here would fix its settings for the other tests.
    script = (
        "import os\n"
        "from neuron_serve import logs\n"
        "from neuron_serve.config.schema import parse_config\n"
        "from neuron_serve.serve.ray.deployment import replica_env\n"
        "config = parse_config({'name': 'm', 'model': {'factory': 'a.b:c'}, 'inputs': [{'name': 'x', 'shape': [1]}]})\n"
        "print(replica_env(config).get(logs.VERBOSE_ENV))\n"
        "os.environ[logs.VERBOSE_ENV] = '1'\n"
        "print(replica_env(config).get(logs.VERBOSE_ENV))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != logs.VERBOSE_ENV}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True,
                         env={**env, "PYTHONWARNINGS": "ignore"})
    assert run.stdout.split() == ["None", "1"]


@pytest.mark.parametrize("argv", [["-v", "status"], ["status", "--verbose"]])
def test_the_verbose_flag_goes_before_or_after_the_command(argv):
    from neuron_serve.cli import build_parser  # noqa: PLC0415

    assert build_parser().parse_args(argv).verbose is True
    assert build_parser().parse_args(argv[-1:] if argv[0] == "-v" else argv[:1]).verbose is False
