"""bench/embeddings.py without servers: the ratios against the better peer and the report (a real run checks each
server's embeddings against sentence-transformers' encode itself)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench import embeddings  # noqa: E402


def point(rps: float, p50: float, p99: float, errors: int = 0) -> dict:
    return {"requests": 100, "rps": rps, "p50_ms": p50, "p99_ms": p99, "errors": errors}


SYSTEMS = {
    "neuron-serve": {"label": "neuron-serve", "max_diff": 4e-8, "points": {1: point(36, 26, 51), 16: point(66, 217, 435)}},
    "infinity": {"label": "infinity", "max_diff": 3e-8, "points": {1: point(19, 52, 93), 16: point(29, 526, 687)}},
    "ray": {"label": "ray", "max_diff": 3e-8, "points": {1: point(27, 34, 66), 16: point(33, 406, 699)}},
}


def test_ratios_take_the_better_peer_of_each_figure():
    found = embeddings.ratios(SYSTEMS)
    assert found["rps_c16"] == {"peer": "ray", "ratio": pytest.approx(66 / 33)}
    assert found["p50_c1"] == {"peer": "ray", "ratio": pytest.approx(34 / 26)}
    assert found["p99_c1"] == {"peer": "ray", "ratio": pytest.approx(66 / 51)}


def test_a_peer_that_failed_is_left_out_and_the_report_says_so():
    systems = {**SYSTEMS, "ray": {"label": "ray", "points": {}, "failed": "ray exited with 1"}}
    assert embeddings.ratios(systems)["rps_c16"]["peer"] == "infinity"
    text = embeddings.report({"seconds": 4, "load_average": [1.0, 2.0], "systems": systems,
                              "ratios": embeddings.ratios(systems)})
    assert "| ray | | failed: ray exited with 1 |" in text
    assert "- requests/s at concurrency 16: 2.28x against infinity" in text


def test_the_proposed_buckets_run_is_a_ratio_of_its_own_and_the_report_gives_each_runs_padding():
    systems = {"neuron-serve": {**SYSTEMS["neuron-serve"], "padding": 1.45},
               "neuron-serve-proposed": {"label": "neuron-serve, length buckets [16, 24, 40, 256]", "padding": 1.08,
                                         "points": {1: point(40, 24, 48), 16: point(87, 180, 300)}},
               "infinity": SYSTEMS["infinity"]}
    found = embeddings.ratios(systems)
    assert found["rps_c16_proposed"] == {"peer": "infinity", "ratio": pytest.approx(87 / 29)}
    text = embeddings.report({"seconds": 4, "load_average": [1.0, 2.0], "systems": systems, "ratios": found})
    assert "- requests/s at concurrency 16, with the proposed length buckets: 3.00x against infinity" in text
    assert ("(tokens computed over the texts' own, the replica's `parameters.padding` after the load): "
            "neuron-serve: 1.45x; neuron-serve, length buckets [16, 24, 40, 256]: 1.08x") in text
