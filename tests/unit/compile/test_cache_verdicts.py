"""The compile cache keeps only verdicts about an operator: a failure of torch-xla's own state is retried in a clean
state and never stored, an entry holding one is not trusted, and a stored "unsupported" never refuses a model alone.

torch-xla's internal failures cannot be caused at will, so two tests make torch-xla's own calls raise its words
("Check failed: ...") a set number of times; everything else runs for real.
"""

import hashlib
import json
import logging

import pytest
import torch

import neuron_serve
from neuron_serve.analysis import placement
from neuron_serve.compile import cache as compile_cache
from neuron_serve.errors import InternalCompileError
from neuron_serve.targets import xla_state
from neuron_serve.targets.pjrt import xla


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.softmax(torch.relu(self.fc(x)) * 2.0, dim=-1)


def _entries(store):
    return sorted((store.root / "support").rglob("*.json"))


def _rewrite(path, payload):
    """An entry whose hash checks out (as an older version wrote it), saying ``payload``."""
    entry = json.loads(path.read_text())
    entry["payload"] = payload
    entry["sha256"] = hashlib.sha256(compile_cache._canonical([entry["key"], payload])).hexdigest()
    path.write_text(json.dumps(entry))


def _trace(model, x, **options):
    placement._ORACLES.clear()  # a new process: nothing decided in memory
    return neuron_serve.trace(model, x, **options)


def test_an_entry_whose_reason_is_internal_is_decided_again_not_used(fresh_cache, caplog):
    model, x = Small().eval(), torch.rand(4, 8)
    _trace(model, x, partitioner_config=neuron_serve.PartitionerConfig())
    entries = _entries(fresh_cache)
    assert entries and all(json.loads(p.read_text())["payload"]["supported"] for p in entries)
    for path in entries:  # what a race wrote before this rule
        _rewrite(path, {"supported": False, "failure_at": "xla compile",
                        "reason": "RuntimeError: Check failed: tensor_data: "})
    with caplog.at_level(logging.WARNING, logger="neuron_serve"):
        traced = _trace(model, x, partitioner_config=neuron_serve.PartitionerConfig())
    assert traced.partition_devices == ["neuron"]  # every operator on the accelerator again
    torch.testing.assert_close(traced(x), model(x), atol=1e-5, rtol=1e-5)
    untrusted = [r.getMessage() for r in caplog.records if "not trusted" in r.getMessage()]
    assert len(untrusted) == len(entries)
    assert "says unsupported for a reason of torch-xla's own (RuntimeError: Check failed: tensor_data: )" in untrusted[0]
    assert all(json.loads(p.read_text())["payload"] == {"supported": True, "failure_at": None, "reason": None}
               for p in entries)


def test_a_wrong_cached_unsupported_verdict_does_not_stop_a_model_that_compiles(fresh_cache, caplog):
    model, x = Small().eval(), torch.rand(4, 8)
    _trace(model, x)
    entries = _entries(fresh_cache)
    for path in entries:  # a verdict-like "no", written by hand
        _rewrite(path, {"supported": False, "failure_at": "xla compile",
                        "reason": "XlaRuntimeError: UNIMPLEMENTED: the operator is not supported"})
    with caplog.at_level(logging.INFO, logger="neuron_serve"):
        traced = _trace(model, x)  # no partitioner: a "no" would refuse the model
    torch.testing.assert_close(traced(x), model(x), atol=1e-5, rtol=1e-5)
    replaced = [r.getMessage() for r in caplog.records if "decided afresh, it runs on the accelerator" in r.getMessage()]
    assert len(replaced) == len(entries)
    assert all(json.loads(p.read_text())["payload"]["supported"] for p in entries)


def _failing(monkeypatch, module, name, times, message):
    """torch-xla's ``module.name`` raising its internal-check error the first ``times`` calls."""
    real, calls = getattr(module, name), {"n": 0}

    def call(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] <= times:
            raise RuntimeError(message)
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, call)
    return calls


def test_a_probe_that_fails_inside_torch_xla_is_tried_again_in_a_clean_state(fresh_cache, monkeypatch, caplog):
    model, x = Small().eval(), torch.rand(4, 8)
    calls = _failing(monkeypatch, xla()._XLAC, "_xla_sync_multi", 1, "Check failed: data()->tensor_data")
    with caplog.at_level(logging.WARNING, logger="neuron_serve"):
        traced = _trace(model, x)
    monkeypatch.undo()
    assert calls["n"] > 1
    assert any("failed inside torch-xla (RuntimeError: Check failed: data()->tensor_data); trying it again in a "
               "clean state" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(traced(x), model(x), atol=1e-5, rtol=1e-5)
    assert all(json.loads(p.read_text())["payload"]["supported"] for p in _entries(fresh_cache))


def test_a_probe_failing_inside_torch_xla_twice_is_an_internal_error_and_caches_nothing(fresh_cache, monkeypatch):
    model, x = Small().eval(), torch.rand(4, 8)
    _failing(monkeypatch, xla()._XLAC, "_xla_sync_multi", 2, "Check failed: data()->tensor_data")
    with pytest.raises(InternalCompileError) as raised:
        _trace(model, x)
    monkeypatch.undo()
    message = str(raised.value)
    assert message.startswith("torch-xla failed inside its own state while checking whether aten::")
    assert ("runs on the accelerator, twice (the second time in a clean state): RuntimeError: Check failed: "
            "data()->tensor_data. This is not a verdict on the operator and nothing was cached") in message
    assert "replace the operator" not in message and "cannot run" not in message
    assert _entries(fresh_cache) == []  # the first operator failed; nothing was stored for it


def test_a_subgraph_compile_failing_inside_torch_xla_is_retried_then_an_internal_error(fresh_cache, monkeypatch):
    from torch_xla._dynamo import dynamo_bridge  # noqa: PLC0415

    model, x = Small().eval(), torch.rand(4, 8)
    _trace(model, x)  # the support checks, cached
    message = "Check failed: cachedComputation: Failed to get computation by hash 123"
    _failing(monkeypatch, dynamo_bridge, "extract_compiled_graph", 1, message)
    traced = _trace(model, x)
    torch.testing.assert_close(traced(x), model(x), atol=1e-5, rtol=1e-5)
    _failing(monkeypatch, dynamo_bridge, "extract_compiled_graph", 2, message)
    with pytest.raises(InternalCompileError) as raised:
        _trace(model, x)
    assert str(raised.value) == (
        f"torch-xla failed inside its own state compiling subgraph accel_0, twice (the second time in a clean "
        f"state): RuntimeError: {message}. This is not the model's operators: nothing about them was cached; deploy "
        "again, and report it if it persists.")
    assert InternalCompileError.exit_code == 5 and InternalCompileError.http_status == 500


@pytest.mark.parametrize("reason, internal", [
    ("RuntimeError: Check failed: tensor_data: ", True),
    ("RuntimeError: INTERNAL: during context [pre-optimization]: out of memory", True),
    ("MemoryError: ", True),
    ("torch-xla has no lowering (CPU fallback: aten::_unique2)", False),
    ("XlaRuntimeError: UNIMPLEMENTED: sort of complex64", False),
    (None, False),
])
def test_what_counts_as_a_failure_of_torch_xla_s_own(reason, internal):
    assert xla_state.internal_failure(reason) is internal


def test_torch_xla_s_whole_process_calls_wait_for_another_thread_s_device_work():
    """A trace's sync (torch_xla.sync, as the dynamo bridge calls it) never falls inside another thread's call."""
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    torch_xla = xla()
    assert all(getattr(getattr(torch_xla._XLAC, name), "_holds_xla_state", False) for name in xla_state.PROCESS_WIDE)
    holding, synced = threading.Event(), []

    def dispatch():
        with xla_state.exclusive():
            holding.set()
            time.sleep(0.3)
            synced.append(("dispatch done", time.perf_counter()))

    worker = threading.Thread(target=dispatch)
    worker.start()
    assert holding.wait(10)
    torch_xla.sync()
    synced.append(("sync", time.perf_counter()))
    worker.join(10)
    assert [what for what, _ in synced] == ["dispatch done", "sync"]
