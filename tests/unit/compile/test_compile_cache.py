"""The persistent compile cache: a second start compiles nothing it already knows; bad entries are never used."""

import json
import logging

import torch

import neuron_serve
from neuron_serve.analysis import placement
from neuron_serve.compile import cache as compile_cache
from neuron_serve import logs
from neuron_serve.assembly.progress import BuildProgress, reporting
from reference_models import MLP


def _start(model, x):
    """What a replica start does for this model; returns the one-op compiles it ran."""
    placement._ORACLES.clear()
    traced = neuron_serve.trace(model, x, partitioner_config=neuron_serve.PartitionerConfig())
    return traced, placement.oracle_for(neuron_serve.api.get_target("neuron")).stats.compiles


def test_a_second_start_compiles_no_support_checks(fresh_cache):
    model, x = MLP().eval(), torch.rand(4, 784)
    cold, cold_compiles = _start(model, x)
    warm, warm_compiles = _start(model, x)
    assert cold_compiles > 0 and warm_compiles == 0
    assert fresh_cache.stats["support"].hits == cold_compiles
    assert warm.partition_devices == cold.partition_devices == ["neuron", "cpu"]
    torch.testing.assert_close(warm(x), model(x), atol=1e-4, rtol=1e-4)


def test_a_tampered_or_truncated_entry_is_logged_removed_and_recomputed(fresh_cache, caplog):
    model, x = MLP().eval(), torch.rand(4, 784)
    _, compiles = _start(model, x)
    entries = sorted((fresh_cache.root / "support").rglob("*.json"))
    assert len(entries) == compiles
    edited = json.loads(entries[0].read_text())
    edited["payload"]["supported"] = not edited["payload"]["supported"]
    entries[0].write_text(json.dumps(edited))
    entries[1].write_bytes(entries[1].read_bytes()[:20])
    with caplog.at_level(logging.WARNING, logger="neuron_serve"):
        traced, recompiled = _start(model, x)
    assert recompiled == 2 and fresh_cache.stats["support"].corrupt == 2
    warnings = [r.getMessage() for r in caplog.records if "compile cache" in r.getMessage()]
    assert sorted(warnings) == [f"compile cache: {p} is corrupt (hash check failed); removing it and recomputing"
                                for p in entries[:2]]
    assert traced.partition_devices == ["neuron", "cpu"]  # the tampered decision was not used
    assert json.loads(entries[0].read_text())["payload"]["supported"] != edited["payload"]["supported"]


def test_cache_dir_from_the_environment_and_off(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(tmp_path / "here"))
    assert compile_cache.default_dir() == tmp_path / "here"
    monkeypatch.setenv(compile_cache.CACHE_ENV, "off")
    assert compile_cache.default_dir() is None
    monkeypatch.delenv(compile_cache.CACHE_ENV)
    assert compile_cache.default_dir().name == "neuron-serve"  # under the user's cache dir


def test_progress_is_a_line_per_compiled_model_and_a_placement_summary_off_a_terminal(fresh_cache, neuron_logs,
                                                                                      monkeypatch):
    # As in a program that never called logs.configure (a command or replica of this process may have).
    monkeypatch.setattr(logs, "_partitioner_level", logging.INFO)
    with reporting(BuildProgress("mlp", 1, tty=False)):
        neuron_serve.trace(MLP().eval(), torch.rand(4, 784), partitioner_config=neuron_serve.PartitionerConfig())
    lines = [line for line in neuron_logs() if line.startswith(("compil", "placement"))]
    assert len(lines) == 2, lines
    assert lines[0].startswith("compiled mlp (1 of 1) in ") and lines[0].endswith(" s")
    # The operator lists are printed too here (a library call logs them at INFO), so no pointer to --verbose.
    assert lines[1] == ("placement of mlp (1 compiled model): 1 accelerator subgraph, 1 CPU subgraph; "
                        "operators: 6 on the accelerator, 1 on CPU (aten::sort)")


def test_each_subgraph_compile_is_a_debug_line(fresh_cache, caplog):
    caplog.set_level(logging.DEBUG, logger="neuron_serve")
    with reporting(BuildProgress("mlp", 1, tty=False)):
        neuron_serve.trace(MLP().eval(), torch.rand(4, 784), partitioner_config=neuron_serve.PartitionerConfig())
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "subgraph accel_0" in r.getMessage()]
    assert debug[0] == "compiling mlp: subgraph accel_0 (1/1)"
    assert debug[1].startswith("compiled mlp: subgraph accel_0 (1/1) in ")


def test_progress_is_a_bar_on_a_terminal(fresh_cache, capsys):
    with reporting(BuildProgress("encoder", 2, tty=True)):
        for _ in range(2):
            neuron_serve.trace(MLP().eval(), torch.rand(4, 784), partitioner_config=neuron_serve.PartitionerConfig())
    err = capsys.readouterr().err
    assert "compiling encoder" in err and "2/2" in err and "accel_0 1/1" in err
