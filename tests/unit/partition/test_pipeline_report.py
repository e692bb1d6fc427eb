"""The partition report of a pipelined model.yaml: its stages, their cores in every pipeline copy,
each stage's memory against the core's and the bytes crossing between stages."""

import re

import pytest
import torch

from neuron_serve.analysis.capture import capture
from neuron_serve.analysis.placement import analyze_graph
from neuron_serve.config.schema import parse_config
from neuron_serve.partition.pipeline import CORE_MEMORY_ENV
from neuron_serve.report import partition_report
from neuron_serve.report.html import render
from neuron_serve.targets import get_target
from test_pipeline_placement import BUDGET, FourLayers

CONFIG = {"name": "four", "model": {"factory": "four_layers:build"}, "inputs": [{"name": "x", "shape": [4, 64]}],
          "cores_per_replica": 4, "placement": {"mode": "pipeline", "cores_per_pipeline": 2}}


def _report(budget: int) -> dict:
    torch.manual_seed(0)
    model = FourLayers().eval()
    config = parse_config(CONFIG)
    captured = capture(model, config.example_inputs())
    analysis = analyze_graph(captured, get_target("neuron"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CORE_MEMORY_ENV, str(budget))
        return partition_report.build(config, model, captured, analysis)


def test_report_lists_each_stage_its_cores_memory_and_bytes_in():
    data = _report(BUDGET)
    pipe = data["pipeline"]
    assert (pipe["balance"], pipe["core_memory_bytes"], pipe["span"], pipe["copies"]) == ("size_based", BUDGET, 2, 2)
    assert [(s["name"], s["cores"], s["memory_bytes"], s["bytes_in"]) for s in pipe["stages"]] == [
        ("accel_0", [0, 2], 38400, 1024), ("accel_1", [1, 3], 38400, 1024)]
    page = render(data)
    drawn = re.findall(r'data-stage="(\w+)" data-cores="([\d, ]+)" data-memory-bytes="(\d+)"', page)
    assert drawn == [("accel_0", "0, 2", "38400"), ("accel_1", "1, 3", "38400")]
    # One arrow between the two stages, carrying the 4x64 float32 activation.
    assert re.findall(r'class="crossing" data-bytes="(\d+)"', page) == ["1024"]
    assert "37.5 KiB of 39.1 KiB" in page


def test_report_shows_why_no_pipeline_fits():
    data = _report(20_000)
    assert data["pipeline"]["error"].startswith("Devices have no enough memory for the module (75776 bytes over 2")
    assert "placement mode pipeline over 2 core(s) (size_based): Devices have no enough memory" in render(data)
