"""The HTML partition report in a real browser: headless Chromium opens it from disk.

`neuron-serve analyze --html --report-json --profile` runs as a user runs it; the page
must draw one node per operator, filled with its placement's colour, inside its
subgraph's box, and load nothing but itself.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chromium import Chromium, find_chromium

ROOT = Path(__file__).resolve().parents[3]
CHROMIUM = find_chromium()
if CHROMIUM is None:
    if os.environ.get("CI"):
        raise RuntimeError("chromium is missing; make test installs it (apt-get install -y chromium)")
    pytest.skip("chromium is not installed (apt-get install -y chromium)", allow_module_level=True)

# The app note's MLP with relu forced to CPU: all three placements in one graph.
MODEL_YAML = """\
name: mlp-forced
model:
  factory: example_models.mlp:build
  kwargs: {layers: [64, 32]}
inputs:
  - {name: x, shape: [8, 784], dtype: float32}
partitioner:
  ops_to_partition: [aten::relu]
"""

# Per node (in graph order): placement and subgraph, as the planner numbers them.
EXPECTED = {
    "linear": ("accelerator", 1), "relu": ("cpu-forced", 2), "linear_1": ("accelerator", 3),
    "relu_1": ("cpu-forced", 4), "linear_2": ("accelerator", 5), "log_softmax": ("accelerator", 5),
    "sort": ("cpu-unsupported", 6),
}

NODES_JS = """Array.from(document.querySelectorAll('#graph [data-op]')).map(g => {
  const r = g.querySelector('rect').getBoundingClientRect();
  return {node: g.dataset.node, op: g.dataset.op, placement: g.dataset.placement, subgraph: +g.dataset.subgraph,
          fill: getComputedStyle(g.querySelector('rect')).fill, box: [r.left, r.top, r.right, r.bottom]};
})"""
BOXES_JS = """Object.fromEntries(Array.from(document.querySelectorAll('#graph g.subgraph')).map(g => {
  const r = g.querySelector('rect').getBoundingClientRect();
  return [g.dataset.subgraph, [r.left, r.top, r.right, r.bottom]];
}))"""


def _rgb(hex_colour: str) -> str:
    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("report")
    (folder / "model.yaml").write_text(MODEL_YAML)
    shutil.copytree(ROOT / "deployments" / "example_models", folder / "example_models")
    html, data = folder / "report.html", folder / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "neuron_serve.cli", "analyze", str(folder / "model.yaml"), "--html", str(html),
         "--report-json", str(data), "--profile", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 0, result.stderr
    return html, json.loads(data.read_text())


def test_page_draws_every_operator_in_its_placement_colour(report, tmp_path):
    html, data = report
    with Chromium(CHROMIUM, tmp_path / "profile") as browser:
        browser.open(html.as_uri())
        nodes = browser.evaluate(NODES_JS)
        boxes = browser.evaluate(BOXES_JS)
        browser.screenshot(tmp_path / "report.png")
        urls = browser.requested_urls()

    assert len(nodes) == data["operator_count"] == 7
    assert {n["node"]: (n["placement"], n["subgraph"]) for n in nodes} == EXPECTED
    fills = {key: _rgb(c["fill"]) for key, c in data["categories"].items()}
    for n in nodes:
        assert n["fill"] == fills[n["placement"]], n
        left, top, right, bottom = boxes[str(n["subgraph"])]
        assert left <= n["box"][0] and n["box"][2] <= right and top <= n["box"][1] and n["box"][3] <= bottom, n
    # The six boxes are stacked in execution order and do not overlap.
    tops = [boxes[str(i)] for i in range(1, 7)]
    assert all(a[3] <= b[1] for a, b in zip(tops, tops[1:]))
    assert urls == [html.as_uri()]  # nothing but the page itself
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_page_shows_reasons_suggestions_and_times(report, tmp_path):
    html, data = report
    with Chromium(CHROMIUM, tmp_path / "profile") as browser:
        browser.open(html.as_uri())
        text = browser.evaluate("document.body.innerText")
        browser.evaluate("document.querySelector('[data-node=\"sort\"]').dispatchEvent(new MouseEvent('click'))")
        detail = browser.evaluate("document.getElementById('detail').textContent")

    assert "aten::relu is listed in ops_to_partition (the target supports it)" in text
    assert "neuronx-cc does not support sort" in text
    assert "remove aten::relu from ops_to_partition" in text
    assert "median of 2 runs" in text
    assert detail.startswith("sort (aten::sort) in subgraph #6 on cpu because neuronx-cc does not support sort | mlp.py ")
    assert detail.endswith(": sort_out, _ = torch.sort(out)")
    assert [s["index"] for s in data["profile"]["subgraphs"]] == [1, 2, 3, 4, 5, 6]
