"""bench/guidellm.py without a server or guidellm: its figures read from a guidellm report,
the table they make, and the command it runs."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench import guidellm as gl  # noqa: E402


def distribution(mean: float, p50: float, p99: float, total: float = 0.0) -> dict:
    return {"mean": mean, "median": p50, "total_sum": total, "percentiles": {"p50": p50, "p99": p99}}


def report(errored: int, errors: list[dict]) -> dict:
    """guidellm 0.8's report, cut to what bench/guidellm.py reads: one benchmark, its metrics
    split by request status."""
    metrics = {
        "request_totals": {"successful": 40, "errored": errored, "incomplete": 1, "total": 41 + errored},
        "requests_per_second": {"successful": distribution(4.0, 4.1, 9.0)},
        "output_tokens_per_second": {"successful": distribution(256.0, 250.0, 900.0)},
        "output_token_count": {"successful": distribution(64.0, 64.0, 64.0, total=2560.0)},
        "time_to_first_token_ms": {"successful": distribution(30.0, 25.0, 120.0)},
        "inter_token_latency_ms": {"successful": distribution(3.0, 2.5, 14.0)},
        "time_per_output_token_ms": {"successful": distribution(3.5, 3.0, 15.0)},
    }
    return {"benchmarks": [{"duration": 10.2, "metrics": metrics,
                            "requests": {"successful": [], "errored": errors, "incomplete": []}}]}


def test_figures_are_guidellm_s_own_and_name_the_first_error():
    errors = [{"info": {"error": None}}, {"info": {"error": "HTTPStatusError: 500 Internal Server Error"}}]
    figures = gl.figures(report(2, errors))
    assert figures["requests"] == {"successful": 40, "errored": 2, "incomplete": 1, "total": 43}
    assert figures["requests_per_s"] == 4.0 and figures["output_tokens_per_s"] == 256.0
    assert figures["output_tokens"] == 2560.0 and figures["duration_s"] == 10.2
    assert (figures["ttft_p50_ms"], figures["ttft_p99_ms"]) == (25.0, 120.0)
    assert (figures["itl_p50_ms"], figures["tpot_p99_ms"]) == (2.5, 15.0)
    assert figures["first_error"] == "HTTPStatusError: 500 Internal Server Error"
    table = gl.markdown({**figures, "seconds": 10, "guidellm": "guidellm 0.8.1"})
    assert "| 40 / 2 / 1 | 4.0 | 256.0 | 25.0 / 120.0 | 2.50 / 14.00 | 3.00 / 15.00 |" in table
    assert "First error: `HTTPStatusError: 500 Internal Server Error`" in table


def test_a_clean_run_has_no_error_line():
    figures = gl.figures(report(0, []))
    assert figures["first_error"] is None
    assert "First error" not in gl.markdown({**figures, "seconds": 30, "guidellm": "guidellm 0.8.1"})


def test_the_command_targets_the_server_with_the_local_tokenizer_and_writes_the_report(tmp_path):
    command = gl.guidellm_command(tmp_path / "llm", 10, tmp_path / "report.json")
    assert command[1] == "run" and Path(command[0]).name == "guidellm"
    options = dict(zip(command[2::2], command[3::2]))
    assert options["--backend"] == f"kind=openai_http,target=http://127.0.0.1:{gl.PORT}"
    assert options["--tokenizer"] == f"kind=huggingface_auto,model={(tmp_path / 'llm').resolve()}"
    assert options["--constraint"] == "kind=max_duration,seconds=10"
    assert options["--output"] == f"kind=json,path={tmp_path / 'report.json'}"
    # The longest request fits the example's 256 positions (the chat template adds 3 tokens).
    assert gl.PROMPT_TOKENS + 3 + gl.OUTPUT_TOKENS <= 256
