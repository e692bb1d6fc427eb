"""The OpenAI answers of a generate model, in process: its routes over ASGI, the real front end and plane,
and OpenAI's own client, over an engine stand-in that emits scripted tokens.

The stand-in replaces only the compiled model's choices (what text comes out, its
logprobs): everything between the request and the bytes (decoding, the front end's
checks, detokenizing, stop strings, the plane, the encoders of streams, tool calls and
logprobs) is the server's own. What needs a real model (answers equal to transformers',
grammars, the engine under load) is tested served, in tests/integration.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Callable

import httpx
import openai
import pytest

import generation_models as gm
from neuron_serve.config.schema import parse_config
from neuron_serve.generation.frontend.processor import Frontend
from neuron_serve.generation.frontend.protocol import EngineRequest, Engines, TokenEvent
from neuron_serve.serve.generate import plane as generate_plane
from neuron_serve.serve.generate.http import generate_app
from neuron_serve.serve.generate.plane import GenerationPlane

MODEL = "scripted"


class ScriptedEngines(Engines):
    """Engines that answer each request with the tokens of ``script(prompt ids)``, then EOS, one event a token
    from a thread of their own (as an engine's thread); a logprob of -0.25 per position and, when asked,
    the top alternatives (the token itself and token 1)."""

    def __init__(self, script: Callable[[list[int]], list[int]], eos: int) -> None:
        self.script = script
        self.eos = eos
        self.aborted: dict[str, str] = {}  # request id -> the reason its abort gave
        self.requests: list[EngineRequest] = []

    def submit(self, request: EngineRequest, sink: Callable[[TokenEvent], None]) -> None:
        self.requests.append(request)
        threading.Thread(target=self._emit, args=(request, sink), daemon=True).start()

    def _emit(self, request: EngineRequest, sink: Callable[[TokenEvent], None]) -> None:
        params = request.params
        tokens = [*self.script(request.prompt), self.eos]
        if params.max_tokens is not None:
            tokens = tokens[:params.max_tokens]
        for index, token in enumerate(tokens, 1):
            if request.request_id in self.aborted:
                sink(TokenEvent(request.request_id, None, finish_reason=self.aborted[request.request_id],
                                prompt_tokens=len(request.prompt), completion_tokens=index - 1))
                return
            top = [(token, -0.25), (1, -1.5)][:params.logprobs] if params.logprobs else []
            event = TokenEvent(request.request_id, token, -0.25 if params.logprobs is not None else None, top,
                               prompt_tokens=len(request.prompt), completion_tokens=index)
            if token == self.eos:
                event.finish_reason, event.stop_reason = "stop", self.eos
            elif index == len(tokens):
                event.finish_reason = "length"
            sink(event)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self.aborted[request_id] = reason

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer():
    """The byte-level tokenizer of the tests, with an end-of-sequence token (special: never in the text)."""
    made = gm.byte_tokenizer()
    made.add_special_tokens({"eos_token": "</s>"})
    return made


# Shows the tools to the model, as Hermes' and Qwen's templates do: a template that never reads them is refused.
TEMPLATE = ("{% if tools %}tools: {% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def served(tokenizer, answer: str, parser: str | None = None) -> tuple[openai.AsyncOpenAI, ScriptedEngines]:
    """A client of the model's app answering ``answer`` to every prompt."""
    tokenizer.chat_template = TEMPLATE
    engines = ScriptedEngines(lambda prompt: _encode(tokenizer, answer), tokenizer.eos_token_id)
    info = {"engines": 1, "slots": 4, "max_waiting": 4, "vocab_size": len(tokenizer), "max_model_len": 256,
            "eos_token_ids": [tokenizer.eos_token_id]}
    generation = {"max_num_seqs": 4, "max_model_len": 256, **({"tool_call_parser": parser} if parser else {})}
    config = parse_config({"name": MODEL, "task": "generate", "model": {"factory": "m:f"}, "generation": generation})
    plane = GenerationPlane(config, Frontend(engines, info, tokenizer))
    plane.start()
    generate_plane.set_current(plane)
    transport = httpx.ASGITransport(app=generate_app())
    client = openai.AsyncOpenAI(base_url="http://model/v1", api_key="unused", max_retries=0,
                                http_client=httpx.AsyncClient(transport=transport, base_url="http://model"))
    return client, engines


def run(coroutine):
    try:
        return asyncio.run(coroutine)
    finally:
        generate_plane.set_current(None)


ANSWER = "Paris is the capital. It is large."


def test_a_stream_joins_to_the_whole_answer_with_usage_on_every_chunk(tokenizer):
    client, _ = served(tokenizer, ANSWER)

    async def calls():
        whole = await client.completions.create(model=MODEL, prompt="Capital?", max_tokens=64, temperature=0)
        chunks = [c async for c in await client.completions.create(
            model=MODEL, prompt="Capital?", max_tokens=64, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True})]
        return whole, chunks

    whole, chunks = run(calls())
    assert whole.choices[0].text == ANSWER and whole.choices[0].finish_reason == "stop"
    answered = len(_encode(tokenizer, ANSWER)) + 1  # and EOS
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(_encode(tokenizer, "Capital?")),
                                                                          answered)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ANSWER
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == answered and not chunks[-1].choices


def test_a_stop_string_cuts_the_answer_streamed_and_not(tokenizer):
    client, engines = served(tokenizer, ANSWER)

    async def calls():
        whole = await client.completions.create(model=MODEL, prompt="x", max_tokens=64, stop=[" It"])
        streamed = [c async for c in await client.completions.create(model=MODEL, prompt="x", max_tokens=64,
                                                                     stop=["capital"], stream=True)]
        return whole, streamed

    whole, streamed = run(calls())
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == ("Paris is the capital.", "stop")
    assert "".join(c.choices[0].text for c in streamed) == "Paris is the "
    assert streamed[-1].choices[0].finish_reason == "stop"
    # The engine was told to stop each, as soon as the text had the string.
    assert list(engines.aborted.values()) == ["stop", "stop"]


def test_chat_streams_a_role_then_deltas_and_n_choices_keep_their_index(tokenizer):
    client, _ = served(tokenizer, ANSWER)

    async def calls():
        chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=64, n=2, stream=True, seed=3)]
        return chunks

    chunks = run(calls())
    by_choice = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            by_choice[choice.index] += choice.delta.content or ""
    assert by_choice == {0: ANSWER, 1: ANSWER}
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]


def test_logprobs_of_completions_and_chat_in_openais_shapes(tokenizer):
    client, _ = served(tokenizer, "ab")

    async def calls():
        completion = await client.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=2)
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                    max_tokens=2, logprobs=True, top_logprobs=2)
        return completion, chat

    completion, chat = run(calls())
    logprobs = completion.choices[0].logprobs
    texts = [tokenizer.decode([t]) for t in _encode(tokenizer, "ab")]
    assert logprobs.tokens == texts and logprobs.token_logprobs == [-0.25, -0.25]
    assert logprobs.text_offset == [0, len(texts[0])]
    assert logprobs.top_logprobs == [{texts[0]: -0.25, tokenizer.decode([1]): -1.5},
                                     {texts[1]: -0.25, tokenizer.decode([1]): -1.5}]
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content] == texts and [entry.logprob for entry in content] == [-0.25, -0.25]
    assert [[top.logprob for top in entry.top_logprobs] for entry in content] == [[-0.25, -1.5], [-0.25, -1.5]]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_a_hermes_tool_call_becomes_openais_tool_calls(tokenizer, stream):
    client, _ = served(tokenizer, "Let me look. " + CALL, parser="hermes")

    async def call():
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
                      max_tokens=128, temperature=0)
        if not stream:
            return await client.chat.completions.create(**kwargs)
        return [c async for c in await client.chat.completions.create(stream=True, **kwargs)]

    answer = run(call())
    if not stream:
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look. "
        (made,) = choice.message.tool_calls
        assert made.id.startswith("call_") and made.function.name == "get_weather"
        assert json.loads(made.function.arguments) == {"city": "Paris"}
        return
    content = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    calls = [t for c in answer if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me look. " and answer[-1].choices[0].finish_reason == "tool_calls"
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert json.loads("".join(t.function.arguments or "" for t in calls)) == {"city": "Paris"}


def test_tools_a_chat_template_never_shows_are_refused_unless_the_model_may_not_call_them(tokenizer):
    client, engines = served(tokenizer, ANSWER, parser="hermes")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}assistant:"
    messages = [{"role": "user", "content": "Weather?"}]

    async def calls():
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8)
        plain = await client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                     tool_choice="none", max_tokens=64)
        return refused.value, plain

    try:
        refused, plain = run(calls())
    finally:
        tokenizer.chat_template = TEMPLATE
    assert refused.status_code == 400 and refused.body["message"] == (
        "tools: model 'scripted''s chat template does not show tools to the model, so it cannot call them; send the "
        "request without tools (or with tool_choice \"none\"), or give the tokenizer a chat template that renders "
        "tools.")
    assert plain.choices[0].message.content == ANSWER and len(engines.requests) == 1


def test_the_front_end_checks_once_and_the_engine_gets_its_decision(tokenizer):
    client, engines = served(tokenizer, ANSWER)

    async def calls():
        with pytest.raises(openai.BadRequestError) as too_long:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=300)
        sampled = await client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0.7)
        return too_long.value, sampled

    refused, _ = run(calls())
    assert "more than max_model_len (256)" in refused.body["message"]
    [request] = engines.requests  # the refused one never reached the engine
    assert request.params.temperature == 0.7 and request.params.seed is not None  # its stream, drawn once
