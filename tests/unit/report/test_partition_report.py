"""The partition report's data: placements, reasons, rules, suggestions and times.

Suggestions are checked against what trace really builds with the suggested config.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import yaml

import neuron_serve
from neuron_serve.analysis.capture import capture
from neuron_serve.report.explain import explain
from neuron_serve.report.html import render
from neuron_serve.analysis.placement import analyze_graph
from neuron_serve.report.profile import profile
from neuron_serve.report.suggest import suggest
from neuron_serve.targets import get_target
from reference_models import MLP, SandwichMLP, line_of

ROOT = Path(__file__).resolve().parents[3]
TOLERANCE = 1e-5


def _data(model, x, config):
    captured = capture(model, x)
    analysis = analyze_graph(captured, get_target("neuron"))
    data = explain(captured, analysis, config)
    if config is not None:
        data["suggestions"] = suggest(captured, analysis, config)
    return data


def _placements(data):
    return [(op["node"], op["category"], op["subgraph"]) for op in data["ops"]]


def test_sandwich_placements_reasons_and_the_broken_count_rule():
    model, x = SandwichMLP(layers=[64, 32]).eval(), torch.rand(8, 784)
    config = neuron_serve.PartitionerConfig(max_subgraph_count=2)
    data = _data(model, x, config)

    assert _placements(data) == [
        ("linear", "accelerator", 1), ("relu", "accelerator", 1), ("sort", "cpu-unsupported", 2),
        ("linear_1", "accelerator", 3), ("relu_1", "accelerator", 3), ("linear_2", "accelerator", 3),
        ("log_softmax", "accelerator", 3),
    ]
    sort = data["ops"][2]
    assert (sort["reason"], sort["failure_at"], sort["device"]) == ("neuronx-cc does not support sort", "neuronx-cc", "cpu")
    assert sort["call_site"]["short"] == f"reference_models.py {line_of('sort_r1, _ = torch.sort(r1)')}"
    assert sort["call_site"]["code"] == "sort_r1, _ = torch.sort(r1)"
    assert [(s["index"], s["device_label"], s["size"]) for s in data["subgraphs"]] == [
        (1, "Device.NEURON", 2), (2, "Device.CPU", 1), (3, "Device.NEURON", 4)]
    # float32 tensors crossing each boundary: x [8, 784], relu [8, 64], sorted [8, 64], output [8, 10].
    assert [(s["bytes_in"], s["bytes_out"]) for s in data["subgraphs"]] == [(25088, 2048), (2048, 2048), (2048, 320)]
    assert (data["supported_count"], data["operator_count"], data["report"]["support_percentage"]) == (6, 7, "85.71%")

    with pytest.raises(ValueError) as refused:
        neuron_serve.trace(model, x, partitioner_config=config)
    assert data["accepted"] is False
    assert [(v["rule"], v["message"]) for v in data["violations"]] == [("max_subgraph_count", str(refused.value))]
    assert all(s["breaks"] == ["max_subgraph_count"] for s in data["subgraphs"])


def test_sandwich_suggestion_is_what_trace_builds():
    model, x = SandwichMLP(layers=[64, 32]).eval(), torch.rand(8, 784)
    found = _data(model, x, neuron_serve.PartitionerConfig())["suggestions"]

    assert found["current"] == {"subgraphs": 3, "accelerator_subgraphs": 2, "accelerator_ops": 6,
                                "accelerator_percentage": "85.71%", "min_subgraph_size_max": 1}
    assert found["suggestions"] == [{
        "change": "send the operator types of accelerator subgraphs of 2 or fewer operators to CPU",
        "ops_to_partition": ["aten::linear", "aten::relu"], "subgraphs": 2, "accelerator_subgraphs": 1,
        "accelerator_ops": 1, "accelerator_percentage": "14.29%", "min_subgraph_size_max": 1, "cost": 5,
    }]
    config = neuron_serve.PartitionerConfig(ops_to_partition=found["suggestions"][0]["ops_to_partition"])
    traced = neuron_serve.trace(model, x, partitioner_config=config)
    assert [(p.device, p.size) for p in traced.partitions] == [("cpu", 6), ("neuron", 1)]
    torch.testing.assert_close(traced(x), model(x), atol=TOLERANCE, rtol=TOLERANCE)


def test_forced_ops_are_explained_and_dropping_them_is_suggested():
    model, x = MLP(layers=[64, 32]).eval(), torch.rand(8, 784)
    config = neuron_serve.PartitionerConfig(ops_to_partition={"aten::relu"}, min_subgraph_size=2)
    data = _data(model, x, config)

    assert _placements(data) == [
        ("linear", "accelerator", 1), ("relu", "cpu-forced", 2), ("linear_1", "accelerator", 3),
        ("relu_1", "cpu-forced", 4), ("linear_2", "accelerator", 5), ("log_softmax", "accelerator", 5),
        ("sort", "cpu-unsupported", 6),
    ]
    assert data["ops"][1]["reason"] == "aten::relu is listed in ops_to_partition (the target supports it)"
    assert data["ops"][1]["supported"] is True
    assert data["op_counts"]["aten::relu"] == {"total": 2, "accelerator": 0, "cpu": 2}
    assert [(v["rule"], v["subgraphs"]) for v in data["violations"]] == [
        ("min_subgraph_size", [1]), ("min_subgraph_size", [2]), ("min_subgraph_size", [3]),
        ("min_subgraph_size", [4]), ("min_subgraph_size", [6])]
    assert [(s["change"], s["subgraphs"], s["cost"]) for s in data["suggestions"]["suggestions"]] == [
        ("remove aten::relu from ops_to_partition", 2, -2),
        ("add aten::linear to ops_to_partition", 3, 3),
    ]
    traced = neuron_serve.trace(model, x, partitioner_config=neuron_serve.PartitionerConfig(ops_to_partition=[]))
    assert len(traced.partitions) == data["suggestions"]["suggestions"][0]["subgraphs"]


def test_threshold_and_missing_partitioner_section_are_reported():
    model, x = MLP(layers=[64, 32]).eval(), torch.rand(8, 784)
    below = _data(model, x, neuron_serve.PartitionerConfig(model_support_percentage_threshold=0.9))
    assert [v["message"] for v in below["violations"]] == [
        "The partitioner has found 85.71% of arithmetic operations (6 of 7) supported which is below "
        "the specified model support percentage threshold of 90.00%."]

    none = _data(model, x, None)
    assert none["accepted"] is False and none["partitioner_section"] is False
    assert none["violations"][0]["message"].startswith(
        "The model has unsupported operators and the model.yaml has no 'partitioner' section, so trace refuses it")
    assert [s["device"] for s in none["subgraphs"]] == ["neuron", "cpu"]


class _Nodes(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ops, self.boxes, self.links = [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "data-op" in attrs:
            self.ops.append((attrs["data-node"], attrs["data-placement"], int(attrs["data-subgraph"])))
        if tag == "g" and "subgraph" in (attrs.get("class") or "").split():
            self.boxes.append(int(attrs["data-subgraph"]))
        self.links += [v for k, v in attrs.items() if k in ("src", "href") and v]


def test_page_carries_each_operator_and_no_outside_reference():
    data = _data(MLP(layers=[64, 32]).eval(), torch.rand(8, 784),
                 neuron_serve.PartitionerConfig(ops_to_partition={"aten::relu"}))
    page = render(data)
    parsed = _Nodes()
    parsed.feed(page)
    assert parsed.ops == _placements(data)
    assert parsed.boxes == [1, 2, 3, 4, 5, 6]
    assert parsed.links == []
    assert re.findall(r"https?://[^\s\"'<]+", page) == ["http://www.w3.org/2000/svg"]  # the SVG namespace name
    assert json.loads(re.search(r'id="report-data">(.*?)</script>', page, re.S).group(1)) == json.loads(json.dumps(data))


def test_profile_times_each_subgraph_and_its_transfers():
    model, x = SandwichMLP(layers=[64, 32]).eval(), torch.rand(8, 784)
    timed = profile(model, x, neuron_serve.PartitionerConfig(), runs=2)
    assert timed["runs"] == 2 and timed["total_ms"] > 0
    assert [(s["index"], s["device"], sorted(s)) for s in timed["subgraphs"]] == [
        (1, "neuron", ["compile_s", "compute_ms", "device", "index", "to_cpu_ms", "to_device_ms"]),
        (2, "cpu", ["compute_ms", "device", "index"]),
        (3, "neuron", ["compile_s", "compute_ms", "device", "index", "to_cpu_ms", "to_device_ms"]),
    ]
    assert all(value > 0 for s in timed["subgraphs"] for key, value in s.items() if key.endswith("_ms"))


def test_cli_report_json_carries_buckets_and_batch_sizes(tmp_path):
    out = tmp_path / "encoder.json"
    result = subprocess.run(
        [sys.executable, "-m", "neuron_serve.cli", "analyze", "deployments/encoder.yaml", "--report-json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stderr
    data = json.loads(out.read_text())
    deployment = yaml.safe_load((ROOT / "deployments" / "encoder.yaml").read_text())
    assert data["buckets"] == deployment["buckets"]
    assert data["batch_sizes"] == [1, 4, 16]  # the default for its max_batch_size 16
    assert "Compiled batch sizes: <code>[1, 4, 16]</code>" in render(data)
    assert (data["operator_count"], len(data["ops"]), [s["device"] for s in data["subgraphs"]]) == (155, 155, ["neuron"])
    assert data["accepted"] is True and data["profile"] is None
    assert json.loads(result.stdout)["support_percentage"] == "100.00%"  # the torch-neuronx report still prints


def test_cli_writes_the_page_for_a_refused_config_and_still_fails(tmp_path):
    shutil.copytree(ROOT / "deployments" / "example_models", tmp_path / "example_models")
    (tmp_path / "model.yaml").write_text(
        "name: refused\nmodel: {factory: 'example_models.mlp:build', kwargs: {layers: [64, 32]}}\n"
        "inputs: [{name: x, shape: [8, 784]}]\npartitioner: {min_subgraph_size: 2}\n"
    )
    page, data = tmp_path / "r.html", tmp_path / "r.json"
    result = subprocess.run(
        [sys.executable, "-m", "neuron_serve.cli", "analyze", str(tmp_path / "model.yaml"), "--html", str(page),
         "--report-json", str(data)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    message = ("The partitioner has found a subgraph of size 1 (Partition #2 for device: Device.CPU) which is "
               "below the specified min subgraph size of 2.")
    assert result.returncode == 3
    assert f"error: {message}" in result.stderr
    report = json.loads(data.read_text())
    assert report["accepted"] is False
    assert [v["message"] for v in report["violations"]] == [message]
    assert message in page.read_text()


def test_the_report_says_what_the_recorded_traffic_padded_and_what_would_pad_least(fresh_cache):
    """A task: infer model's two families, from the sizes its replicas kept in the compile cache: today's buckets and
    their padding, the proposal and its (recomputed here by hand), in the data and on the page."""
    from neuron_serve.buckets import usage as bucket_usage
    from neuron_serve.config.factory import build_model
    from neuron_serve.config.schema import parse_config
    from neuron_serve.report import partition_report

    config = parse_config({"name": "row-sums-report", "model": {"factory": "two_stage_model:row_sums"},
                           "inputs": [{"name": "x", "shape": [2, 8]}], "buckets": {"sizes": [4, 8], "inputs": {"x": 1}},
                           "batch_sizes": [2, 4], "batching": {"max_batch_size": 4}})
    models = ROOT / "tests" / "unit" / "models"
    model = build_model(config, models)
    captured = capture(model, config.example_inputs())
    analysis = analyze_graph(captured, get_target("neuron"))
    assert partition_report.build(config, model, captured, analysis)["padding"] == {}
    assert "No sizes recorded for this model in the compile cache yet" in render(
        partition_report.build(config, model, captured, analysis))
    recorded = bucket_usage.Usage("row-sums-report", "earlier", fresh_cache.root)
    for family, size, times in (("shape", 3, 6), ("shape", 7, 2), ("rows", 1, 8)):
        recorded.sizes.record(family, size, times)
    recorded.save()
    data = partition_report.build(config, model, captured, analysis)
    shape, rows = data["padding"]["shape"], data["padding"]["rows"]
    # shape: 6 of size 3 and 2 of 7 on [4, 8] compute 6*4 + 2*8 = 40 for 32 real; on [3, 8], 6*3 + 2*8 = 34.
    assert (shape["today"], shape["proposed"], shape["calls"]) == ([4, 8], [3, 8], 8)
    assert (shape["padding_today"], shape["padding_proposed"]) == (pytest.approx(40 / 32), pytest.approx(34 / 32))
    # rows: 8 one-row chunks on [2, 4] compute 16 rows for 8; on [1, 4], 8.
    assert (rows["today"], rows["proposed"], rows["padding_today"], rows["padding_proposed"]) == (
        [2, 4], [1, 4], pytest.approx(2.0), pytest.approx(1.0))
    page = render(data)
    assert "<h3>What the recorded traffic padded</h3>" in page
    assert "<td>shape</td><td><code>buckets.sizes</code></td><td class=n>8</td><td><code>[4, 8]</code></td>" \
           "<td class=n>1.25x</td><td><code>[3, 8]</code></td><td class=n>1.06x</td>" in page
