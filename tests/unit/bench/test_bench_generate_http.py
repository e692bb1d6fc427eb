"""bench/generate_http.py without servers: the SSE parser, the per-request and per-point
figures, the ratios against the best peer and the workload's exact prompt lengths."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench import generate_http as gh  # noqa: E402


def sse(event) -> bytes:
    return f"data: {json.dumps(event)}\n".encode()


def chunk(text="", finish=None, usage=None, choices=True) -> bytes:
    body = {"id": "c", "object": "text_completion",
            "choices": [{"index": 0, "text": text, "finish_reason": finish}] if choices else []}
    if usage:
        body["usage"] = usage
    return sse(body)


def test_a_canned_stream_gives_ttft_and_tpot_from_the_usage_count():
    # Sent at 10.0; 5 tokens whose text arrives in 4 chunks (one token decodes to no text yet);
    # the finish chunk at 10.9, then usage in its own chunk (vLLM's layout), then [DONE].
    stream = gh.SSEStream(sent=10.0)
    lines = [(b": keep-alive\n", 10.05), (chunk("He"), 10.1), (b"\n", 10.1), (chunk(""), 10.2),
             (chunk("llo"), 10.3), (chunk(" wor"), 10.5), (chunk("ld"), 10.7), (chunk("", finish="length"), 10.9),
             (chunk(choices=False, usage={"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}), 11.5),
             (b"data: [DONE]\n", 11.6)]
    for line, now in lines:
        stream.feed(line, now)
    figures = stream.figures()
    assert stream.done and stream.chunks == 4
    assert figures["tokens"] == 5 and figures["prompt_tokens"] == 7 and figures["finish_reason"] == "length"
    assert figures["ttft_s"] == pytest.approx(0.1)
    assert figures["tpot_s"] == pytest.approx((10.9 - 10.1) / 4)  # to the finish chunk, not the usage chunk
    assert figures["error"] is None


def test_without_usage_each_text_chunk_is_a_token_and_chat_deltas_count():
    stream = gh.SSEStream(sent=0.0)
    for now, text in [(0.5, "a"), (1.0, "b"), (2.0, "c")]:
        stream.feed(sse({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}), now)
    stream.feed(sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}), 2.0)
    figures = stream.figures()
    assert figures["tokens"] == 3 and figures["ttft_s"] == 0.5 and figures["tpot_s"] == pytest.approx(0.75)


def test_an_error_event_or_a_bad_line_is_the_request_s_error():
    stream = gh.SSEStream(sent=0.0)
    stream.feed('data: {"error": "CB worker died"}', 1.0)
    assert "CB worker died" in stream.figures()["error"]
    stream = gh.SSEStream(sent=0.0)
    stream.feed("data: {not json", 1.0)
    assert stream.figures()["error"].startswith("not JSON")


def test_one_token_has_a_ttft_and_no_tpot():
    stream = gh.SSEStream(sent=1.0)
    stream.feed(chunk("x", finish="length", usage={"prompt_tokens": 3, "completion_tokens": 1}), 1.25)
    assert stream.figures()["ttft_s"] == 0.25 and stream.figures()["tpot_s"] is None


def test_a_point_pools_its_requests_percentiles_and_counts_short_and_failed_ones():
    requests = [{"prompt": "p", "prompt_tokens": 4, "max_tokens": 10} for _ in range(102)]
    results = [{"tokens": 10, "prompt_tokens": 4, "ttft_s": i / 100, "tpot_s": i / 1000, "finish_reason": "length",
                "error": None} for i in range(101)]
    results[3] = {**results[3], "tokens": 7, "prompt_tokens": 5}  # stopped early, its prompt counted differently
    results.append({"tokens": 0, "prompt_tokens": None, "ttft_s": None, "tpot_s": None, "finish_reason": None,
                    "error": "HTTP 500"})
    point = gh.summarise(results, requests, wall=2.0)
    assert point["requests"] == 102 and point["errors"] == 1 and point["first_error"] == "HTTP 500"
    assert point["short"] == 1 and point["prompt_mismatch"] == 1
    assert point["output_tokens"] == 100 * 10 + 7 and point["tokens_per_s"] == pytest.approx(1007 / 2.0)
    assert point["ttft_p50_s"] == pytest.approx(0.50) and point["ttft_p99_s"] == pytest.approx(0.99)
    assert point["tpot_p50_s"] == pytest.approx(0.050) and point["tpot_p99_s"] == pytest.approx(0.099)


def test_ratios_compare_each_neuron_serve_configuration_with_the_best_peer_and_skip_failed_points():
    def point(tps, ttft, tpot, errors=0):
        return {"requests": 4, "errors": errors, "tokens_per_s": tps, "ttft_p50_s": ttft, "ttft_p99_s": ttft,
                "tpot_p50_s": tpot, "tpot_p99_s": tpot}

    systems = {"neuron-serve": {"points": {1: point(100, 0.02, 0.004), 16: point(3000, 0.1, 0.01)},
                                "sampled": {16: point(2400, 0.4, 0.02)}},
               "neuron-serve-defaults": {"points": {1: point(50, 0.04, 0.004), 16: point(1000, 0.3, 0.01)}},
               "transformers-cb": {"points": {1: point(90, 0.01, 0.002), 16: point(1500, 0.2, 0.02)},
                                   "sampled": {16: point(1200, 0.2, 0.02)}},
               "ray": {"points": {1: point(80, 0.04, 0.001, errors=4), 16: point(2000, 0.3, 0.03)}},
               "transformers": {"failed": "exited"}}
    found = gh.ratios(systems)
    ours = found["neuron-serve"]
    assert ours["tokens_per_s_c16"] == {"peer": "ray", "ratio": pytest.approx(1.5)}
    assert ours["ttft_p50_c16"] == {"peer": "transformers-cb", "ratio": pytest.approx(0.5)}  # the lowest TTFT
    assert ours["sampled_tokens_per_s_c16"] == {"peer": "transformers-cb", "ratio": pytest.approx(2.0)}
    assert ours["sampled_ttft_p50_c16"] == {"peer": "transformers-cb", "ratio": pytest.approx(2.0)}
    # ray's concurrency-1 point failed every request: its 1 ms TPOT is not the best peer's
    assert ours["ttft_p50_c1"] == {"peer": "transformers-cb", "ratio": pytest.approx(2.0)}
    assert ours["tpot_p50_c1"] == {"peer": "transformers-cb", "ratio": pytest.approx(2.0)}
    # The default model.yaml is measured against the peers too, never taken for one.
    assert found["neuron-serve-defaults"]["tokens_per_s_c16"] == {"peer": "ray", "ratio": pytest.approx(0.5)}
    assert gh.ratios({k: v for k, v in systems.items() if not k.startswith("neuron-serve")}) == {}


def test_the_proposed_buckets_run_is_compared_with_the_example_not_taken_for_a_peer():
    def point(tps, ttft, tpot):
        return {"requests": 4, "errors": 0, "tokens_per_s": tps, "ttft_p50_s": ttft, "ttft_p99_s": ttft,
                "tpot_p50_s": tpot, "tpot_p99_s": tpot, "short": 0}

    systems = {"neuron-serve": {"label": "neuron-serve", "points": {1: point(30, 0.6, 0.05), 16: point(300, 2.0, 0.1)},
                                "padding": {"prefill": 3.1, "decode_rows": 1.2}},
               "neuron-serve-proposed": {"label": "neuron-serve, prefill [200, 512]",
                                         "points": {1: point(33, 0.3, 0.05), 16: point(360, 1.0, 0.1)},
                                         "padding": {"prefill": 1.4, "decode_rows": 1.1}},
               "ray": {"label": "ray", "points": {1: point(40, 0.1, 0.02), 16: point(100, 0.5, 0.2)}}}
    found = gh.ratios(systems)
    # The proposed run is neither "neuron-serve" nor a peer: the best peer at 16 is ray's 100 tok/s.
    assert found["neuron-serve"]["tokens_per_s_c16"] == {"peer": "ray", "ratio": pytest.approx(3.0)}
    assert found["proposed"]["c1"] == {"ttft_p50": pytest.approx(2.0), "tpot_p50": pytest.approx(1.0),
                                       "tokens_per_s": pytest.approx(1.1)}
    assert found["proposed"]["c16"]["tokens_per_s"] == pytest.approx(1.2)
    systems["neuron-serve"]["points"][16]["engine"] = gh.engine_split(
        {key: [0.0, 0.0] for key in gh.ENGINE_SERIES},
        {"host": [0.5, 100], "core_wait": [9.5, 100], "queue": [0.2, 4], "ttft": [0.8, 4], "prefill": [0.4, 2]})
    text = gh.report({"systems": systems, "ratios": found, "mode": "quick", "requests_per_point": {},
                      "load_average": [1.0, 1.0], "workload": {"requests": 8, "prompt_tokens": "8-200",
                                                                "new_tokens": "16-128", "output_tokens": 500}})
    assert "- output tok/s at concurrency 16: 3.00x ray's" in text
    assert "- concurrency 1: TTFT p50 2.00x, TPOT p50 1.00x, output tok/s 1.10x" in text
    assert ("- neuron-serve, concurrency 16: 100 steps, host 5.0 + core wait 95.0 ms a step; queue 50.0 ms, prefill "
            "call 200.0 ms, TTFT in the engine 200.0 ms (means)") in text
    assert ("neuron-serve: prefill 3.10x, decode_rows 1.20x; neuron-serve, prefill [200, 512]: prefill 1.40x, "
            "decode_rows 1.10x") in text


def test_the_workload_s_prompts_have_their_token_lengths_and_are_the_same_each_time():
    from example_models import make_tiny_llm

    tokenizer = make_tiny_llm.tokenizer()
    first, again = gh.make_workload(tokenizer, 12), gh.make_workload(tokenizer, 12)
    assert first == again
    for request in first:
        assert len(tokenizer(request["prompt"])["input_ids"]) == request["prompt_tokens"]
        assert gh.PROMPT_TOKENS[0] <= request["prompt_tokens"] <= gh.PROMPT_TOKENS[1]
        assert gh.NEW_TOKENS[0] <= request["max_tokens"] <= gh.NEW_TOKENS[1]


def test_transformers_serve_gets_the_model_s_generation_config_with_an_eos_it_cannot_produce(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1024, "eos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1,
         "transformers_version": "5.24.0"}))
    assert json.loads(gh.no_eos_config(tmp_path)) == {"bos_token_id": 0, "eos_token_id": 1024, "pad_token_id": 1,
                                                      "do_sample": False}


def test_the_engine_split_says_each_bucket_s_calls_and_the_share_of_the_wall_they_took():
    before = {"host": [1.0, 10], "core_wait": [2.0, 10], "queue": [0.0, 0], "ttft": [0.0, 0], "prefill": [0.3, 1],
              "calls": {"prefill_64": [0.3, 1], "decode_16x256": [1.0, 10]}}
    after = {"host": [1.5, 20], "core_wait": [4.0, 20], "queue": [0.2, 2], "ttft": [0.6, 2], "prefill": [0.9, 3],
             "calls": {"prefill_64": [0.9, 3], "decode_16x256": [2.5, 20], "decode_1x128": [0.04, 1]}}
    split = gh.engine_split(before, after, wall=2.5)
    assert split["steps"] == 10 and split["host_ms"] == pytest.approx(50) and split["prefill_call_ms"] == pytest.approx(300)
    assert list(split["calls"]) == ["decode_16x256", "prefill_64", "decode_1x128"]  # most time first
    assert split["calls"]["decode_16x256"] == {"calls": 10, "seconds": pytest.approx(1.5), "mean_ms": pytest.approx(150)}
    assert split["calls_share"] == pytest.approx((1.5 + 0.6 + 0.04) / 2.5)
    assert "compiled calls 86% of the wall (decode_16x256 10 x 150 ms, prefill_64 2 x 300 ms, decode_1x128 1 x 40 ms)" \
        in gh._engine_text(split)
    assert "calls_share" not in gh.engine_split(before, after)  # no wall given: no share


def test_cpu_shares_count_a_busy_child_of_the_server_and_the_load_generator_apart():
    import os
    import subprocess
    import time

    from bench import cpu_shares

    # The "server": a process whose child (named as Ray's replicas are) spins for 0.5 s of CPU once told to.
    child = ("import sys, time\nsys.stdin.readline()\nend = time.process_time() + 0.5\n"
             "while time.process_time() < end: pass\nprint('done', flush=True)\nsys.stdin.readline()")
    server = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', "
                               f"{child!r}, 'ray::ServeReplica:llm'])"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        before, started = cpu_shares.snapshot(), time.monotonic()
        server.stdin.write("go\n")
        server.stdin.flush()
        end = time.process_time() + 0.2
        while time.process_time() < end:  # this process is the load generator
            pass
        assert server.stdout.readline().strip() == "done"
        after, seconds = cpu_shares.snapshot(), time.monotonic() - started
        found = cpu_shares.shares(before, after, seconds, server.pid)
    finally:
        server.stdin.write("end\n")
        server.stdin.close()
        server.wait(timeout=30)
        server.stdout.close()
    assert found["replicas"] == pytest.approx(100 * 0.5 / seconds, rel=0.2)  # the spinning child, by its name
    assert found["load generator"] >= 100 * 0.15 / seconds  # CPU times come in clock ticks (10 ms)
    assert found["total"] == pytest.approx(sum(v for k, v in found.items() if k != "total"))
    assert cpu_shares.text(found).endswith(f"of {os.cpu_count()} CPUs")
