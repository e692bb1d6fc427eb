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


def system(label: str, one: dict, sixteen: dict, padding: float | None = None, **more) -> dict:
    run = {"points": {1: one, 16: sixteen}, **({"padding": padding} if padding is not None else {})}
    return {"label": label, "max_diff": 4e-8, "runs": {1: run}, "points": run["points"], **more}


SYSTEMS = {
    "neuron-serve": system("neuron-serve", point(36, 26, 51), point(66, 217, 435), 1.10),
    "infinity": system("infinity", point(19, 52, 93), point(29, 526, 687)),
    "ray": system("ray", point(27, 34, 66), point(33, 406, 699)),
}


def test_ratios_take_the_better_peer_of_each_figure():
    found = embeddings.ratios(SYSTEMS)
    assert found["rps_c16_x1_peer"] == {"peer": "ray", "ratio": pytest.approx(66 / 33)}
    assert found["p50_c1_x1_peer"] == {"peer": "ray", "ratio": pytest.approx(34 / 26)}
    assert found["p99_c1_x1_peer"] == {"peer": "ray", "ratio": pytest.approx(66 / 51)}


def test_a_peer_that_failed_is_left_out_and_the_report_says_so():
    systems = {**SYSTEMS, "ray": {"label": "ray", "points": {}, "runs": {}, "failed": "ray exited with 1"}}
    assert embeddings.ratios(systems)["rps_c16_x1_peer"]["peer"] == "infinity"
    text = embeddings.report({"seconds": 4, "load_average": [1.0, 2.0], "systems": systems, "lengths_text": "docs",
                              "ratios": embeddings.ratios(systems)})
    assert "| ray | | | failed: ray exited with 1 |" in text
    assert "- 1 text(s) a request, requests/s at concurrency 16, against the better peer: 2.28x (infinity)" in text


def test_packed_rows_are_compared_with_one_text_a_row_for_each_workload_and_the_report_gives_the_padding():
    """neuron-serve against itself one text a row (default and auto buckets) at one and 32 texts a request."""
    systems = dict(SYSTEMS)
    systems["neuron-serve"] = system("neuron-serve", point(36, 26, 51), point(66, 217, 435), 1.10)
    systems["neuron-serve"]["runs"][32] = {"points": {1: point(4, 240, 260), 16: {**point(8, 1900, 2100),
                                                                                "padding": 1.02}}, "padding": 1.02}
    systems["neuron-serve-padded"] = system("neuron-serve, one text a row", point(30, 30, 60),
                                            {**point(40, 380, 700), "padding": 2.29}, 2.29)
    systems["neuron-serve-padded"]["runs"][32] = {"points": {1: point(2, 480, 500), 16: point(4, 3800, 4000)},
                                                  "padding": 2.31}
    systems["neuron-serve-auto"] = system("neuron-serve, one text a row, length_buckets: auto", point(33, 28, 55),
                                          point(50, 300, 600), 1.60)
    found = embeddings.ratios(systems)
    assert found["rps_c16_x1_padded"] == {"peer": "neuron-serve-padded", "ratio": pytest.approx(66 / 40)}
    assert found["rps_c16_x1_auto"] == {"peer": "neuron-serve-auto", "ratio": pytest.approx(66 / 50)}
    assert found["p50_c1_x1_padded"]["ratio"] == pytest.approx(30 / 26)
    assert found["rps_c16_x32_padded"]["ratio"] == pytest.approx(8 / 4)
    assert "rps_c16_x32_auto" not in found and "rps_c16_x32_peer" not in found  # no figures at 32 texts from them
    text = embeddings.report({"seconds": 4, "load_average": [1.0, 2.0], "systems": systems, "ratios": found,
                              "lengths_text": "lognormal lengths: 3 to 183 tokens"})
    assert "| neuron-serve | 32 | 16 | 8.0 | 256.0 | 1900.0 | 2100.0 | 0 | 1.02x | 4.0e-08 |" in text
    assert "| neuron-serve, one text a row | 1 | 16 | 40.0 | 40.0 | 380.0 | 700.0 | 0 | 2.29x | 4.0e-08 |" in text
    assert ("- 32 text(s) a request, requests/s at concurrency 16, against one text a row, default buckets: 2.00x "
            "(neuron-serve, one text a row)") in text
    assert "Workload: lognormal lengths: 3 to 183 tokens, 256 texts" in text


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
