"""A generate model's HTTP app in process, over ASGI, with a real compiled engine: the queue
bound and bearer auth, which the served example does not set."""

import asyncio
import json

import pytest

import generation_models as gm
from neuron_serve.config.schema import parse_config
from neuron_serve.generation import engine_for
from neuron_serve.generation.frontend.processor import Frontend
from neuron_serve.serve.http import auth
from neuron_serve.serve.generate import plane as generate_plane
from neuron_serve.serve.generate.http import generate_app
from neuron_serve.serve.generate.plane import GenerationPlane

TOKEN = "generate-test-token-0123456789"


@pytest.fixture(scope="module")
def plane():
    """One slot and room for one waiting request: a third request at once is refused."""
    tokenizer = gm.byte_tokenizer()
    engine = engine_for(gm.build("llama"), max_num_seqs=1, max_model_len=128, prefill_buckets=[16, 128],
                        decode_batch_buckets=[1], decode_context_buckets=[128], max_waiting=1, tokenizer=tokenizer,
                        name="tiny")
    config = parse_config({"name": "tiny", "task": "generate", "model": {"factory": "m:f"},
                           "generation": {"max_num_seqs": 1, "max_model_len": 128, "max_waiting": 1}})
    served = GenerationPlane(config, engine)
    served.start()
    generate_plane.set_current(served)
    yield served
    generate_plane.set_current(None)
    engine.close()


async def call(app, method: str, path: str, body: bytes = b"", headers: dict | None = None):
    """One request through the ASGI app: (status, headers, body)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "server": ("t", 80),
             "client": ("c", 1), "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    sent = asyncio.Event()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    answer = {"body": b""}

    async def receive():
        if messages:
            return messages.pop(0)
        await sent.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
            answer["headers"] = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            answer["body"] += message.get("body", b"")
            if not message.get("more_body"):
                sent.set()

    await app(scope, receive, send)
    return answer["status"], answer["headers"], answer["body"]


def completion(max_tokens: int) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "neuron", "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()


def test_a_full_queue_answers_503_with_retry_after(plane):
    app = generate_app()

    async def burst():
        return await asyncio.gather(*(call(app, "POST", "/v1/completions", completion(100)) for _ in range(4)))

    answers = asyncio.run(burst())
    refused = [a for a in answers if a[0] == 503]
    assert refused, [a[0] for a in answers]
    for status, headers, body in refused:
        assert headers["retry-after"] == "1"
        error = json.loads(body)["error"]
        assert error["type"] == "server_error" and error["message"].startswith("the generation queue is full")
    assert all(status == 200 for status, _, _ in answers if status != 503)
    # Once the burst is over the model answers again.
    assert asyncio.run(call(app, "POST", "/v1/completions", completion(2)))[0] == 200


def test_bearer_auth_answers_openais_error_object_on_v1(plane):
    app = generate_app()
    auth.configure(TOKEN)
    try:
        status, headers, body = asyncio.run(call(app, "POST", "/v1/completions", completion(2)))
        assert status == 401 and headers["www-authenticate"].startswith("Bearer")
        assert json.loads(body)["error"]["type"] == "authentication_error"
        status, _, body = asyncio.run(call(app, "POST", "/generate", b'{"text_input": "x"}'))
        assert status == 401 and json.loads(body)["error"].startswith("unauthorized: missing Authorization header")
        status, _, body = asyncio.run(call(app, "POST", "/v1/completions", completion(2),
                                           {"Authorization": f"Bearer {TOKEN}"}))
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
    finally:
        auth.configure(None)


def _timing_out(plane, seconds: float):
    """The plane's engine with a request timeout of ``seconds``, for the length of a with block."""
    class _Limit:
        def __enter__(self):
            plane.frontend.engines.request_timeout_s = seconds

        def __exit__(self, *exc):
            plane.frontend.engines.request_timeout_s = None
    return _Limit()


def test_a_request_past_its_timeout_is_answered_504_and_its_slot_freed(plane):
    app = generate_app()
    with _timing_out(plane, 0.005):  # 100 tokens take longer than 5 ms
        status, _, body = asyncio.run(call(app, "POST", "/v1/completions", completion(100)))
        assert status == 504, body
        error = json.loads(body)["error"]
        assert error["message"] == ("the request timed out: it was not finished 0.005s after it arrived "
                                    "(request_timeout_s); ask for fewer tokens or retry later")
        streamed = json.loads(completion(100)) | {"stream": True}
        status, _, body = asyncio.run(call(app, "POST", "/v1/completions", json.dumps(streamed).encode()))
        # A stream that times out before its first token is answered 504 like any request; one that
        # times out after it has started ends with an error event (which of the two depends on how
        # fast this machine prefills).
        if status == 504:
            assert json.loads(body)["error"]["message"].startswith("the request timed out")
        else:
            events = [line[len("data: "):] for line in body.decode().splitlines() if line.startswith("data: ")]
            assert status == 200 and events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["message"].startswith("the request timed out")
    assert plane.frontend.running == 0
    # The one slot is free again: the next request is served whole.
    status, _, body = asyncio.run(call(app, "POST", "/v1/completions", completion(3)))
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3


def test_a_special_tokens_logprob_text_is_empty_as_in_the_output_text():
    # The output text leaves special tokens out; their logprob entries must too, or a
    # choice's logprob tokens no longer join to its text.
    tokenizer = gm.byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|assistant|>"]})
    [marker] = tokenizer.encode("<|assistant|>", add_special_tokens=False)
    config = parse_config({"name": "tiny", "task": "generate", "model": {"factory": "m:f"},
                           "generation": {"max_num_seqs": 1, "max_model_len": 128}})
    info = {"engines": 1, "slots": 1, "max_waiting": 1, "vocab_size": len(tokenizer), "max_model_len": 128}
    served = GenerationPlane(config, Frontend(None, info, tokenizer))
    [n] = tokenizer.encode("n", add_special_tokens=False)
    assert (served.token_text(marker), served.token_text(n)) == ("", "n")
