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
    text = embeddings.report({"seconds": 4, "load_average": [1.0, 2.0], "systems": systems, "lengths_text": "docs",
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
    text = embeddings.report({"seconds": 4, "load_average": [1.0, 2.0], "systems": systems, "ratios": found,
                              "lengths_text": "lognormal lengths: 3 to 183 tokens"})
    assert "- requests/s at concurrency 16, with the proposed length buckets: 3.00x against infinity" in text
    assert ("(tokens computed over the texts' own, from the replica's `parameters.padding` before and after the "
            "measured points): neuron-serve: 1.45x; neuron-serve, length buckets [16, 24, 40, 256]: 1.08x") in text
    assert "Workload: one text a request (lognormal lengths: 3 to 183 tokens, 256 texts)" in text


def test_the_auto_run_is_a_ratio_of_its_own():
    systems = {**SYSTEMS, "neuron-serve-auto": {"label": "neuron-serve, length_buckets: auto",
                                                "points": {1: point(40, 24, 48), 16: point(99, 160, 290)}}}
    found = embeddings.ratios(systems)
    assert found["rps_c16_auto"] == {"peer": "ray", "ratio": pytest.approx(99 / 33)}
    text = embeddings.report({"seconds": 4, "load_average": [1.0, 2.0], "systems": systems, "ratios": found,
                              "lengths_text": "docs"})
    assert "- requests/s at concurrency 16, with length_buckets: auto after its warm-up: 3.00x against ray" in text


def test_padding_counts_only_the_work_between_two_readings():
    before = {"length": {"padded_fraction": 0.5, "buckets": {"32": {"calls": 10, "real": 100, "padded": 220}}}}
    after = {"length": {"padded_fraction": 0.4, "buckets": {"32": {"calls": 12, "real": 140, "padded": 244},
                                                            "64": {"calls": 1, "real": 50, "padded": 14}}}}
    ratio, by_bucket = embeddings.padding(before, after)
    # Between them: 32: 2 calls, 40 real, 24 padded; 64: 1 call, 50 real, 14 padded.
    assert ratio == pytest.approx((40 + 24 + 50 + 14) / (40 + 50))
    assert by_bucket == {"32": {"calls": 2, "real": 40, "padded": 24}, "64": {"calls": 1, "real": 50, "padded": 14}}
    assert embeddings.padding(after, after) is None and embeddings.padding({}, {}) is None


def test_the_lognormal_texts_are_mostly_short_with_a_long_tail_and_the_same_each_time():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embeddings.real_model())
    texts = embeddings.workload(tokenizer, 64, lengths="lognormal")
    assert texts == embeddings.workload(tokenizer, 64, lengths="lognormal") and all(texts)
    counts = sorted(embeddings.token_counts(tokenizer, texts))
    assert counts[0] >= 3 and counts[-1] <= 250
    assert 10 <= counts[len(counts) // 2] <= 24 and counts[-1] > 3 * counts[len(counts) // 2]
