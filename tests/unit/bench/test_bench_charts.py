"""bench/charts.py draws its PNGs from results in the format bench/run.py and bench/generate.py write."""

import json

from bench import charts

PNG = b"\x89PNG\r\n\x1a\n"


def _row(server, workload, conc, rps, p50, p99):
    return {"server": server, "workload": workload, "concurrency": conc, "rps": rps, "p50_ms": p50,
            "p99_ms": p99, "p90_ms": p99, "errors": 0, "seconds": 10.0}


# As raw.json's "rows": every (server, point), skipped points included.
ROWS = [
    _row("neuron-serve", "W1", 1, 310.0, 3.1, 4.0), _row("neuron-serve", "W1", 16, 900.0, 17.0, 30.0),
    _row("neuron-serve", "W1", 64, 1100.0, 55.0, 90.0), _row("starlette", "W1", 1, 250.0, 3.9, 5.2),
    _row("starlette", "W1", 16, 400.0, 40.0, 60.0), _row("starlette", "W1", 64, 390.0, 160.0, 240.0),
    _row("neuron-serve", "W2", 16, 260.0, 60.0, 110.0), _row("starlette", "W2", 16, 150.0, 100.0, 180.0),
    _row("neuron-serve", "W1-grpc", 16, 950.0, 16.0, 28.0),
    {"server": "starlette", "workload": "W1-grpc", "concurrency": 16, "skipped": "no OIP v2 gRPC"},
]
# As generate.json: the figures of each system.
GENERATION = {"workload": {"requests": 32}, "systems": {
    "engine": {"tokens_per_s": 1352.5, "tpot_p50_s": 0.0103, "tpot_p99_s": 0.0199},
    "transformers_cb": {"tokens_per_s": 1401.6, "tpot_p50_s": 0.0109, "tpot_p99_s": 0.0187},
    "sequential": {"tokens_per_s": 563.6, "tpot_p50_s": 0.0017, "tpot_p99_s": 0.0023}}}


def test_serving_charts(tmp_path):
    written = charts.serving_charts(ROWS, tmp_path, {"neuron-serve": "neuron-serve", "starlette": "Starlette"})
    assert [p.name for p in written] == ["throughput.png", "latency.png"]
    for path in written:
        assert path.read_bytes().startswith(PNG) and path.stat().st_size > 10_000


def test_one_line_per_server_in_every_panel(tmp_path, monkeypatch):
    drawn = []
    plt = charts._pyplot()
    monkeypatch.setattr(charts, "_save", lambda plt_, fig, path: drawn.append(fig) or path)
    charts.serving_charts(ROWS, tmp_path)
    throughput, latency = drawn
    panels = {ax.get_title(): [line.get_label() for line in ax.get_lines()] for ax in throughput.axes}
    assert panels == {"W1": ["neuron-serve", "starlette"], "W1-grpc": ["neuron-serve"],
                      "W2": ["neuron-serve", "starlette"]}
    w1 = next(ax for ax in latency.axes if ax.get_title() == "W1")
    assert [line.get_label() for line in w1.get_lines()] == [
        "neuron-serve p99", "neuron-serve p50", "starlette p99", "starlette p50"]
    assert list(w1.get_lines()[0].get_xdata()) == [1, 16, 64]
    assert list(w1.get_lines()[0].get_ydata()) == [4.0, 30.0, 90.0]
    for fig in drawn:
        plt.close(fig)


def test_nothing_measured_draws_nothing(tmp_path):
    assert charts.serving_charts([ROWS[-1]], tmp_path) == []
    assert charts.generation_chart({}, tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_generation_chart(tmp_path):
    path = charts.generation_chart(GENERATION, tmp_path)
    assert path == tmp_path / "generation.png" and path.read_bytes().startswith(PNG)


def test_charts_of_a_results_directory(tmp_path):
    run = tmp_path / "results" / "20250101-000000"
    run.mkdir(parents=True)
    (run / "raw.json").write_text(json.dumps({"rows": ROWS, "memory": {}, "internal": None, "targets": [],
                                              "generation": GENERATION}))
    assert charts.latest_results(tmp_path / "results") == run
    out = tmp_path / "charts"
    assert charts.main([str(run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["generation.png", "latency.png", "throughput.png"]
