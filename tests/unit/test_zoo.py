"""The model zoo matrix: real architectures trace, match eager, batch dynamically and reload.

For each model of tests/zoo.py: analyze, trace with a PartitionerConfig, outputs equal
to eager PyTorch within TOLERANCE, dynamic_batch at two batch sizes, and save. One
fresh process then loads every artifact (subgraphs compiled again, onto core 0 and core 1
in turn) and compares with the saved eager outputs. Models that cannot be captured must fail with
an UnsupportedModelError naming the construct and its line. The results are written to
build/zoo-results.json; `python tests/zoo_table.py` renders them into README.md.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

import neuron_serve
from zoo import BATCH, ZOO

# float32: the largest difference from eager may be TOLERANCE times the largest |eager
# output| (at least 1), since XLA:CPU sums in another order than eager PyTorch.
TOLERANCE = 1e-4
DYNAMIC_BATCHES = (1, 3)
MIN_OUTPUT_SCALE = 0.05  # largest |eager output| of every model: well above TOLERANCE
ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(os.environ.get("NEURON_SERVE_ZOO_RESULTS", ROOT / "build" / "zoo-results.json"))


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


@pytest.fixture(scope="module")
def results():
    collected: dict[str, dict] = {}
    yield collected
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    ordered = [collected[e.name] for e in ZOO if e.name in collected]
    RESULTS.write_text(json.dumps(ordered, indent=1))


def _leaves(value) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _scale(expected) -> float:
    return max(1.0, max(float(t.abs().max()) for t in _leaves(expected) if t.numel()))


def _check(actual, expected) -> float:
    """The largest absolute difference, after checking it is within tolerance."""
    got, want = _leaves(actual), _leaves(expected)
    assert len(got) == len(want)
    allowed = TOLERANCE * _scale(expected)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=allowed, rtol=0)
    return max(float((a.double() - b.double()).abs().max()) if a.numel() else 0.0 for a, b in zip(got, want))


def _rebatch(example: tuple, batch: int) -> tuple:
    """Inputs with ``batch`` rows made from the example's rows (floats perturbed)."""
    rows = torch.arange(batch) % BATCH
    return tuple(
        t[rows] + 0.1 * torch.rand_like(t[rows]) if t.is_floating_point() else t[rows].roll(batch, dims=-1)
        for t in example
    )


def _slug(name: str) -> str:
    return name.replace("/", "__")


@pytest.mark.parametrize("entry", ZOO, ids=[e.name for e in ZOO])
def test_model(entry, zoo_dir, results):
    torch.manual_seed(0)
    model, example = entry.build()
    row = {"model": entry.name, "kind": entry.kind}
    results[entry.name] = row
    if entry.fails_at:
        with pytest.raises(neuron_serve.UnsupportedModelError) as info:
            neuron_serve.trace(model, example, partitioner_config=neuron_serve.PartitionerConfig())
        assert entry.fails_at in str(info.value)
        assert info.value.__cause__ is None and info.value.__suppress_context__
        row["error"] = str(info.value)
        return
    with torch.no_grad():
        expected = model(*example)
    # Outputs near zero would make the comparison below pass whatever the model computed.
    assert max(float(t.abs().max()) for t in _leaves(expected)) >= MIN_OUTPUT_SCALE
    report = neuron_serve.analyze(model, example)
    started = time.perf_counter()
    traced = neuron_serve.trace(model, example, partitioner_config=neuron_serve.PartitionerConfig())
    row["compile_seconds"] = round(time.perf_counter() - started, 1)
    row["support_percentage"] = report["support_percentage"]
    unsupported = report["unsupported_operators"].get("aten", [])
    row["supported_count"] = sum(report["supported_operators"].get("aten", {}).values())
    row["operator_count"] = row["supported_count"] + len(unsupported)
    row["unsupported"] = sorted({u["kind"] for u in unsupported})
    row["partitions"] = [p.device for p in traced.partitions]
    row["max_abs_diff"] = _check(traced(*example), expected)
    row["output_scale"] = _scale(expected)

    artifact = zoo_dir / _slug(entry.name)
    neuron_serve.save(traced, artifact)
    flat_inputs = list(example)
    torch.save({"inputs": flat_inputs, "expected": [t.detach() for t in _leaves(expected)]}, f"{artifact}.io.pt")
    row["artifact"] = str(artifact)

    neuron_serve.dynamic_batch(traced)
    for batch in DYNAMIC_BATCHES:
        inputs = _rebatch(example, batch)
        with torch.no_grad():
            want = model(*inputs)
        diff = _check(traced(*inputs), want)
        row["max_abs_diff"] = max(row["max_abs_diff"], diff)


def test_artifacts_load_in_a_fresh_process_on_two_cores(zoo_dir, results):
    saved = [{"name": r["model"], "artifact": r["artifact"], "io": f"{r['artifact']}.io.pt"}
             for r in results.values() if "artifact" in r]
    assert len(saved) >= 25, f"only {len(saved)} models traced"
    listing = zoo_dir / "artifacts.json"
    listing.write_text(json.dumps(saved))
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "zoo_load_check.py"), str(listing)],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(loaded) == {s["name"] for s in saved}
    assert {r["core"] for r in loaded.values()} == {0, 1}
    for name, reloaded in loaded.items():
        allowed = TOLERANCE * results[name]["output_scale"]
        assert reloaded["diff"] <= allowed, (name, reloaded, allowed)
        results[name]["reload_max_abs_diff"] = reloaded["diff"]
