"""The engine process a generate replica runs its engines in, behind the replica's front end: same answers
as transformers, the front end's refusals at once (nothing reaches the process), and what happens to open
requests when the process ends."""

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest

import generation_models as gm
from neuron_serve.config.schema import parse_config
from neuron_serve.errors import ConfigError, InvalidInput, ModelNotReady, Overloaded
from neuron_serve.generation import SamplingParams
from neuron_serve.generation.frontend.processor import Frontend
from neuron_serve.generation.process.client import EngineProcess
from neuron_serve.serve.generate import plane as generate_plane
from neuron_serve.serve.generate.http import generate_app
from neuron_serve.serve.generate.plane import GenerationPlane

GREEDY = SamplingParams(max_tokens=6, temperature=0)


def _config(directory, **generation) -> dict:
    return {"name": "tiny", "task": "generate", "model": {"pretrained": str(directory)},
            "generation": {"max_num_seqs": 2, "max_model_len": 64, "prefill_buckets": [16, 64],
                           "decode_batch_buckets": [2], "decode_context_buckets": [64], "max_waiting": 1,
                           **generation}}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    gm.build("llama").save_pretrained(directory)
    gm.byte_tokenizer().save_pretrained(directory)
    return directory


def front(process: EngineProcess) -> Frontend:
    """The replica's front end over an engine process."""
    return Frontend(process, process.info, process.tokenizer)


@pytest.fixture(scope="module")
def engines(pretrained):
    started = front(EngineProcess(_config(pretrained), None, "r0"))
    yield started
    started.close()


def test_the_engines_run_in_their_own_process_and_generate_as_transformers_does(engines):
    assert engines.engines.process.pid != os.getpid() and engines.alive
    assert (engines.info["engines"], engines.slots, engines.max_model_len) == (1, 2, 64)
    assert engines.tokenizer.decode(engines.tokenizer.encode("neuron")) == "neuron"  # the replica decodes text
    lm = gm.build("llama")
    prompts = [[5, 9, 200, 17], list(range(40, 70)), [3]]  # three prompts over two slots: one waits its turn
    done = engines.generate_batch(prompts, GREEDY, timeout=120)
    assert [d.tokens for d in done] == [gm.eager_greedy(lm, p, 6) for p in prompts]
    assert [d.finish_reason for d in done] == ["length"] * 3
    # What the engine process holds of host memory reaches the replica (its metadata's parameters.host_memory).
    held = engines.engines.host_memory
    weights = sum(p.numel() * p.element_size() for p in lm.parameters())
    assert weights <= held["weights_on_cores_bytes"] == held["weights_bytes"] < weights * 1.01
    assert {"prefill_64", "decode_2x64"} <= set(held["compiled_models_bytes"]) <= {"prefill_64", "decode_2x64",
                                                                                   "prefill_16"}
    assert held["resident_bytes"] > held["weights_bytes"] + held["kv_cache_bytes"] > 0


def test_the_async_stream_and_an_abort_cross_the_process(engines):
    async def two_tokens() -> list[int]:
        tokens = []
        stream = engines.generate([1, 2, 3], SamplingParams(max_tokens=40, temperature=0))
        async for event in stream:
            if event.token is not None:
                tokens.append(event.token)
            if len(tokens) == 2:
                break  # leaving the stream aborts the request in the worker
        await stream.aclose()
        return tokens

    assert asyncio.run(two_tokens()) == gm.eager_greedy(gm.build("llama"), [1, 2, 3], 2)
    # An abort sent after the second token ends the request in the worker with "abort".
    events, ended = [], threading.Event()

    def sink(event):
        events.append(event)
        if len(events) == 2:
            engines.abort("abort-me")
        if event.finished:
            ended.set()

    engines.submit([1, 2, 3], SamplingParams(max_tokens=60, temperature=0), sink, request_id="abort-me")
    assert ended.wait(60)
    assert events[-1].finish_reason == "abort" and len(events) < 60 and engines.running == 0


def test_a_request_is_checked_in_the_replica_with_the_engines_own_messages(engines):
    with pytest.raises(InvalidInput, match=r"^prompt token id 300 is outside the vocabulary \(0 to 255\)\.$"):
        engines.submit([1, 300], GREEDY, lambda event: None)
    with pytest.raises(InvalidInput, match=r"^the prompt has 4 tokens and max_tokens is 61: 65 tokens, more than "
                                           r"max_model_len \(64\)\."):
        engines.submit([1, 2, 3, 4], SamplingParams(max_tokens=61), lambda event: None)


def test_past_the_slots_and_the_queue_a_request_is_refused_at_once(engines):
    ended = threading.Semaphore(0)
    long = SamplingParams(max_tokens=50, temperature=0)
    ids = [engines.submit([1, 2], long, lambda e: e.finished and ended.release()) for _ in range(3)]  # 2 slots + 1
    try:
        with pytest.raises(Overloaded, match=r"^the generation queue is full \(1 requests waiting\); retry later\.$"):
            engines.submit([1, 2], long, lambda event: None)
    finally:
        for rid in ids:
            engines.abort(rid)
        assert all(ended.acquire(timeout=60) for _ in ids)


def test_a_build_error_in_the_worker_is_raised_in_the_replica(tmp_path):
    with pytest.raises(ConfigError, match=r"^model.pretrained: .*missing is not a directory"):
        EngineProcess(_config(tmp_path / "missing"), None, "r0")


def test_when_the_worker_dies_open_requests_end_with_an_error_and_new_ones_get_503(pretrained):
    doomed = front(EngineProcess(_config(pretrained), None, "r1"))
    events = []
    ended = threading.Event()

    def sink(event):
        events.append(event)
        if len(events) == 2:
            os.kill(doomed.engines.process.pid, signal.SIGKILL)
        if event.finished:
            ended.set()

    try:
        doomed.submit([1, 2, 3], SamplingParams(max_tokens=60, temperature=0), sink)
        assert ended.wait(60)
        last = events[-1]
        assert last.finish_reason == "error" and last.error == "the generation engine process ended (exit code -9)"
        assert not doomed.alive
        with pytest.raises(ModelNotReady, match=r"^the generation engine process has ended \(exit code -9\); the "
                                                r"replica is being replaced, retry shortly\.$"):
            doomed.submit([1], GREEDY, lambda event: None)
    finally:
        doomed.close()


def test_closing_ends_open_requests_with_abort(pretrained):
    closing = front(EngineProcess(_config(pretrained), None, "r2"))
    finished = []
    closing.submit([1, 2], SamplingParams(max_tokens=60, temperature=0),
                   lambda e: e.finished and finished.append(e.finish_reason))
    closing.close()
    assert finished == ["abort"] and closing.engines.process.returncode == 0


def test_an_adapter_the_engine_no_longer_serves_is_a_404_as_an_unknown_model_is(engines, pretrained):
    """The race an unload leaves: the replica found the adapter, the engine process had dropped it by the time
    the request arrived. The engine's refusal crosses the process with its status; OpenAI's answer is the one an
    unknown model gets (it was a 500 "generation failed")."""
    config = parse_config(_config(pretrained, lora={"max_lora_rank": 8, "lora_modules": {"gone": "gone"}}))
    plane = GenerationPlane(config, engines)  # believes it serves "gone"; the engines (no LoRA) do not
    plane.start()
    generate_plane.set_current(plane)
    transport = httpx.ASGITransport(app=generate_app())

    async def ask() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://model") as client:
            return await client.post("/v1/completions", json={"model": "gone", "prompt": [1, 2], "max_tokens": 2})

    try:
        answer = asyncio.run(ask())
    finally:
        generate_plane.set_current(None)
    assert answer.status_code == 404
    assert answer.json()["error"] == {
        # What the replica serves by its registry (here its model.yaml's, which still names "gone").
        "message": "the model 'gone' does not exist; this server serves: tiny, gone", "type": "not_found_error",
        "param": "model", "code": "model_not_found"}


def test_auto_buckets_switched_in_the_engine_process_are_in_the_replicas_metadata(pretrained):
    """prefill_buckets: auto in a replica's engine process: its switch while serving reaches the model's metadata
    (``parameters.rebucketing``) as the next request ends, and the answers are transformers' throughout."""
    raw = _config(pretrained, prefill_buckets="auto", learn_buckets_after=2)
    engines = front(EngineProcess(raw, None, "r-auto"))
    plane = GenerationPlane(parse_config(raw), engines)
    try:
        lm = gm.build("llama")
        prompt = [5, 9, 200, 17, 33]
        answers, deadline = [], time.monotonic() + 240
        while time.monotonic() < deadline:  # a look once the background compile is done; it compiles while these run
            answers.append(engines.generate_batch([prompt], GREEDY, timeout=120)[0].tokens)
            state = plane.metadata()["parameters"].get("rebucketing", {}).get("generation.prefill_buckets", {})
            if state.get("switches"):
                break
        assert answers == [gm.eager_greedy(lm, prompt, 6)] * len(answers)
        assert state == {"buckets": [5, 64], "every": 2, "switches": 1, "state": "serving"}, state
    finally:
        engines.close()
