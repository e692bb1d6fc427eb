"""A task: generate model served for real: the OpenAI routes through the official client,
the OIP generate extension, disconnects, limits and a fuzz of malformed requests.

The model is the LLM example (a small Llama with random weights and a byte-level BPE
tokenizer made from local text), two replicas behind HAProxy. Every generated text is
compared with transformers' own greedy generation of the same prompt ids, decoded by
the same tokenizer: they must be equal, character for character.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import LLM_MAX_MODEL_LEN as MAX_MODEL_LEN
from http_client import Client

MODEL = "llm"
PROMPTS = ["Hello world", "neuron-serve compiles", "The cores are emulated", "café ünïcode 中文 tokens"]


@pytest.fixture(scope="module")
def client(llm):
    api = openai.OpenAI(base_url=f"{llm.url}/v1", api_key="unused", max_retries=0)
    yield api
    api.close()


def eager_text(llm, ids: list[int], max_tokens: int) -> str:
    """transformers' greedy generation of ``ids``, decoded (stopping at EOS as the server does)."""
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = llm.eager.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=llm.tokenizer.eos_token_id)
    return llm.tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def completion_ids(llm, prompt: str) -> list[int]:
    return llm.tokenizer(prompt)["input_ids"]


def chat_ids(llm, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return llm.tokenizer(text, add_special_tokens=False)["input_ids"]


def metric(llm, name: str, **labels: str) -> float:
    """The sum of a metric's samples on the server's /metrics (those with ``labels``)."""
    text = urllib.request.urlopen(f"{llm.url}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- the OpenAI client ---------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_streamed_and_not_equal_eager_greedy(llm, client, prompt):
    expected = eager_text(llm, completion_ids(llm, prompt), 24)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True))
    assert whole.choices[0].text == expected
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert whole.usage.prompt_tokens == len(completion_ids(llm, prompt))
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_streamed_and_not_equal_eager_greedy(llm, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a NeuronCore?"}]
    expected = eager_text(llm, chat_ids(llm, messages), 32)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage == whole.usage
    assert usage.prompt_tokens == len(chat_ids(llm, messages))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_async_client_and_the_models_own_base_url(llm):
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{llm.url}/v2/models/{MODEL}/v1", api_key="x") as own:
            models = await own.models.list()
            whole = await own.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
            stream = await own.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=16, temperature=0, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
            return [m.id for m in models.data], whole.choices[0].text, text

    names, completion, chat = asyncio.run(run())
    assert names == [MODEL]
    assert completion == eager_text(llm, completion_ids(llm, PROMPTS[0]), 16)
    assert chat == eager_text(llm, chat_ids(llm, [{"role": "user", "content": "hi"}]), 16)


def test_32_concurrent_streams_each_equal_their_own_eager_answer(llm):
    prompts = [f"Request {i}: " + " ".join(["tokens"] * (i % 7 + 1)) for i in range(32)]
    lengths = [16 + (i * 5) % 48 for i in range(32)]

    async def one(api, prompt, max_tokens):
        stream = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{llm.url}/v1", api_key="x", max_retries=0) as api:
            return await asyncio.gather(*(one(api, p, n) for p, n in zip(prompts, lengths)))

    before = {r: metric(llm, "neuron_serve_generation_tokens_total", replica=r) for r in _replicas(llm)}
    texts = asyncio.run(run())
    for prompt, n, text in zip(prompts, lengths, texts):
        assert text == eager_text(llm, completion_ids(llm, prompt), n), prompt
    # Both replicas took part.
    after = {r: metric(llm, "neuron_serve_generation_tokens_total", replica=r) for r in _replicas(llm)}
    assert len(after) == 2 and all(after[r] > before.get(r, 0) for r in after), after


def _replicas(llm) -> set[str]:
    text = urllib.request.urlopen(f"{llm.url}/metrics", timeout=10).read().decode()
    return set(re.findall(r'neuron_serve_generation_tokens_total\{[^}]*replica="([^"]+)"', text))


def test_n_seed_logprobs_stop_and_penalties(llm, client):
    seeded = [client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=1.0, seed=7, n=2)
              for _ in range(2)]
    assert [c.text for c in seeded[0].choices] == [c.text for c in seeded[1].choices]
    assert [c.index for c in seeded[0].choices] == [0, 1]
    scored = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=3)
    logprobs = scored.choices[0].logprobs
    assert len(logprobs.tokens) == 5 and "".join(logprobs.tokens) == scored.choices[0].text
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    # Keyed by text, a position's top 3 can be fewer keys (two tokens decoding alike); greedy's own
    # token is the most likely one, so its text carries its logprob.
    assert all(1 <= len(top) <= 3 and top[token] == lp
               for token, lp, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 4
    assert all(len(entry.top_logprobs) == 2 for entry in chat.choices[0].logprobs.content)
    full = eager_text(llm, completion_ids(llm, "Hello"), 40)
    stop = full[10:13]
    stopped = client.completions.create(model=MODEL, prompt="Hello", max_tokens=40, temperature=0, stop=[stop])
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=40, temperature=0, stop=[stop], stream=True))
    assert stopped.choices[0].text == full[:full.index(stop)] == streamed
    assert stopped.choices[0].finish_reason == "stop"
    penalized = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=1.0)
    assert penalized.usage.completion_tokens >= 1


def test_health_model_retrieval_user_and_usage_on_every_chunk(llm, client):
    with urllib.request.urlopen(f"{llm.url}/health", timeout=10) as health:  # vLLM's, as guidellm probes it
        assert (health.status, health.read()) == (200, b"")
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.model_extra["max_model_len"]) == (MODEL, "model", MAX_MODEL_LEN)
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.body["message"] == "the model 'gpt-4' does not exist; this server serves: llm"
    expected = eager_text(llm, completion_ids(llm, "Hello"), 6)
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0,
                                     user="end-user-1").choices[0].text == expected
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and chunks[-1].usage.completion_tokens == 6
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected


def test_logit_bias_min_tokens_and_the_sampled_token_in_top_logprobs(llm, client):
    ids = completion_ids(llm, "Hello")
    greedy = llm.eager.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=1, do_sample=False, pad_token_id=llm.tokenizer.eos_token_id)[0, -1].item()
    forced_id = 1 + (greedy + 7) % (len(llm.tokenizer) - 1)
    forced = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                       logit_bias={str(forced_id): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == llm.tokenizer.decode([forced_id] * 4, skip_special_tokens=True)
    banned = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={str(greedy): -100})
    assert banned.choices[0].text != llm.tokenizer.decode([greedy]) and banned.usage.completion_tokens == 1
    # The greedy first token as a stop token id: it ends the answer at once, unless min_tokens holds it off.
    ended = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0,
                                      extra_body={"stop_token_ids": [greedy]})
    held = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0,
                                     extra_body={"stop_token_ids": [greedy], "min_tokens": 3})
    assert ended.usage.completion_tokens == 1 and ended.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens >= 3
    sampled = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=1.5, seed=5,
                                        logprobs=1)
    logprobs = sampled.choices[0].logprobs
    assert all(token in top for token, top in zip(logprobs.tokens, logprobs.top_logprobs))
    with pytest.raises(openai.BadRequestError) as outside:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, logit_bias={"999999": 5})
    assert outside.value.body["message"].startswith("logit_bias: token id 999999 is outside the vocabulary")


def eager_prompt_logprobs(llm, ids: list[int]) -> list[float]:
    """transformers' log-softmax at each prompt position, of the prompt's next token."""
    with torch.no_grad():
        logits = llm.eager(torch.tensor([ids])).logits[0].float()
    scores = torch.log_softmax(logits, -1)
    return [float(scores[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def test_echo_returns_the_prompts_logprobs_as_transformers_computes_them(llm, client):
    prompt = "The cores are emulated"
    ids = completion_ids(llm, prompt)
    want = eager_prompt_logprobs(llm, ids)
    # lm-eval's loglikelihood request: the prompt scored, nothing generated.
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                       temperature=0)
    choice = scored.choices[0]
    assert choice.text == prompt and scored.usage.completion_tokens == 0 and choice.finish_reason == "length"
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) and logprobs.token_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)  # XLA:CPU against eager, float32
    assert logprobs.top_logprobs[0] is None
    assert all(token in top for token, top in zip(logprobs.tokens[1:], logprobs.top_logprobs[1:]))
    assert logprobs.text_offset[0] == 0 and "".join(logprobs.tokens) == prompt
    # With tokens generated after it: the prompt, then the completion greedy decoding gives.
    expected = eager_text(llm, ids, 8)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, echo=True, logprobs=0,
                                      temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, echo=True, temperature=0, stream=True))
    assert whole.choices[0].text == prompt + expected == streamed
    assert whole.choices[0].logprobs.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-4)
    assert len(whole.choices[0].logprobs.tokens) == len(ids) + whole.usage.completion_tokens
    # vLLM's prompt_logprobs: each position's entries keyed by token id, the prompt's own token among them.
    vllm = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 2})
    entries = vllm.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    assert [entries[i + 1][str(ids[i + 1])]["logprob"] for i in range(len(ids) - 1)] == pytest.approx(want, abs=1e-4)


STRUCTURED_SCHEMA = {"type": "object", "properties": {"tag": {"enum": ["red", "green"]},
                                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                     "required": ["tag", "n"]}


def test_structured_outputs_validate_beside_unconstrained_requests(llm, client):
    import jsonschema  # noqa: PLC0415

    messages = [{"role": "user", "content": "Give me a tag"}]
    expected = eager_text(llm, completion_ids(llm, PROMPTS[1]), 12)

    def constrained(kind: str):
        if kind == "schema":
            answer = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=60, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "tag", "schema": STRUCTURED_SCHEMA}})
            return answer.choices[0].message.content, answer.choices[0].finish_reason
        if kind == "choice":
            answer = client.completions.create(model=MODEL, prompt="Yes or no?", max_tokens=8, temperature=0.9,
                                               seed=2, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
            return answer.choices[0].text, answer.choices[0].finish_reason
        if kind == "regex":
            chunks = client.completions.create(model=MODEL, prompt="A code:", max_tokens=12, temperature=0,
                                               stream=True, extra_body={"guided_regex": r"[A-C]{2}-[0-9]{3}"})
            pieces = list(chunks)
            return "".join(c.choices[0].text for c in pieces), pieces[-1].choices[0].finish_reason
        free = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0)
        return free.choices[0].text, free.choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:  # sent at once: constrained and unconstrained rows share decode calls
        schema, choice, regex, free = pool.map(constrained, ["schema", "choice", "regex", "free"])
    jsonschema.validate(json.loads(schema[0]), STRUCTURED_SCHEMA)
    assert choice[0] in ("yes", "no") and re.fullmatch(r"[A-C]{2}-[0-9]{3}", regex[0])
    assert schema[1] == choice[1] == regex[1] == "stop"
    assert free[0] == expected
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "nosuchtype"}}}}})
    assert bad.value.body["param"] == "response_format.json_schema.schema"
    assert bad.value.body["message"].startswith("response_format.json_schema.schema: the json schema cannot be "
                                                "compiled")


# Small schemas: the example's tokenizer spends many tokens on JSON, and its context is 256.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "today's weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def streamed_calls(chunks) -> tuple[list[dict], str | None, str]:
    """A chat stream's tool calls folded by index (name and arguments joined), its finish reason and content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def test_named_and_required_tool_choices_give_valid_calls_streamed_and_not(llm, client):
    import jsonschema  # noqa: PLC0415

    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [WEATHER, CLOCK]
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in tools}
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=named,
                                            max_tokens=40, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_weather"])
    # The tools reached the chat template: the prompt is the template's with them.
    assert answer.usage.prompt_tokens == len(chat_ids(llm, messages, tools))
    calls, finish, content = streamed_calls(client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, tool_choice=named, max_tokens=40, temperature=0, stream=True))
    assert (finish, content) == ("tool_calls", "")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]

    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=messages, tools=tools, tool_choice="required", max_tokens=140,
                      temperature=0.8, seed=5)
        if stream:
            calls, finish, _ = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
        else:
            message = client.chat.completions.create(**kwargs).choices[0]
            finish = message.finish_reason
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in message.message.tool_calls]
        assert finish == "tool_calls" and calls, stream
        for made in calls:
            assert made["id"].startswith("call_")
            jsonschema.validate(json.loads(made["arguments"]), schemas[made["name"]])
    one = client.chat.completions.create(parallel_tool_calls=False, **{**kwargs, "seed": 6})
    assert len(one.choices[0].message.tool_calls) == 1


def test_tool_results_go_back_through_the_template(llm, client):
    messages = [{"role": "user", "content": "Weather in Lima?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Lima", "celsius": true}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, cloudy"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=10, temperature=0)
    templated = [messages[0], {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Lima", "celsius": True}}}]}, messages[2]]
    ids = chat_ids(llm, templated, [WEATHER])
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].message.content == eager_text(llm, ids, 10)
    assert answer.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, tool_choice="required",
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {
                                           "type": "object", "properties": {"a": {"type": "nosuchtype"}}}}}])
    assert bad.value.body["param"] == "tools[0].function.parameters"


# -- errors ------------------------------------------------------------------------------


def test_errors_are_openai_error_objects(llm, client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt="x")
    assert missing.value.body["message"] == "the model 'gpt-4' does not exist; this server serves: llm"
    assert missing.value.body["code"] == "model_not_found"
    prompt = "word " * 30
    length = len(completion_ids(llm, prompt))
    assert length < MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_MODEL_LEN)
    assert (f"the prompt has {length} tokens and max_tokens is {MAX_MODEL_LEN}: {length + MAX_MODEL_LEN} tokens, "
            f"more than max_model_len ({MAX_MODEL_LEN})") in too_long.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:  # the example model has no tool-call parser
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert refused.value.body["param"] == "tool_choice" and "generation.tool_call_parser" in \
        refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as unknown:
        client.completions.create(model=MODEL, prompt="x", extra_body={"temprature": 0})
    assert unknown.value.body["message"] == "unknown field 'temprature': this server does not support it"


def test_oip_generate_and_generate_stream(llm):
    api = Client(llm.url)
    expected = eager_text(llm, completion_ids(llm, PROMPTS[1]), 20)
    body = json.dumps({"id": "r1", "text_input": PROMPTS[1], "parameters": {"max_tokens": 20, "temperature": 0}})
    whole = api.request("POST", f"/v2/models/{MODEL}/generate", body.encode())
    assert whole.status == 200, whole.body
    answer = whole.json()
    assert answer["text_output"] == expected and answer["model_name"] == MODEL and answer["id"] == "r1"
    streamed = api.request("POST", f"/v2/models/{MODEL}/generate_stream", body.encode())
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in streamed.body.decode().splitlines() if line.startswith("data: ")]
    assert "".join(e["text_output"] for e in events) == expected
    assert events[-1]["details"]["finish_reason"] in ("stop", "length")
    bad = api.request("POST", f"/v2/models/{MODEL}/generate", b'{"text_input": "x", "parameters": {"tempo": 1}}')
    assert bad.status == 400 and bad.json()["error"].startswith("parameters.tempo: unknown field")
    infer = api.request("POST", f"/v2/models/{MODEL}/infer", b"{}")
    assert infer.status == 400 and "task: generate" in infer.json()["error"]
    server = api.request("GET", "/v2").json()
    assert "generate" in server["extensions"] and MODEL in server["models"]
    assert api.request("POST", "/v2/models/nope/generate", body.encode()).status == 404
    api.close()


# -- streaming and disconnects -----------------------------------------------------------------


def _open_stream(llm, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    conn = socket.create_connection(("127.0.0.1", llm.port), timeout=30)
    conn.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return conn


def leave_and_see_the_abort(server, path: str, model: str, max_tokens: int, stream: bool) -> None:
    """Send a long generation, close the connection early: exactly one abort, nothing left running.

    The example's model makes a hundred tokens in about a tenth of a second, and a leave takes tens
    of milliseconds to reach the engine: on a loaded machine a request can end at its length first.
    Such a try had nothing to abort; the next one is made. A leave that never aborts fails all five.
    """
    body = {"model": model, "prompt": "Hi", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    outcomes = []
    for _ in range(5):
        aborted = metric(server, "neuron_serve_request_success_total", finished_reason="abort")
        done = metric(server, "neuron_serve_request_success_total", finished_reason="length")
        with _open_stream(server, path, body) as conn:
            if stream:
                assert conn.recv(100).startswith(b"HTTP/1.1 200")
            else:  # nothing comes back before the end: leave once the sequence runs
                deadline = time.monotonic() + 10
                while metric(server, "neuron_serve_num_requests_running") == 0 \
                        and metric(server, "neuron_serve_request_success_total", finished_reason="length") == done \
                        and time.monotonic() < deadline:
                    time.sleep(0.005)
        deadline = time.monotonic() + 10
        while (now := (metric(server, "neuron_serve_request_success_total", finished_reason="abort"),
                       metric(server, "neuron_serve_request_success_total", finished_reason="length"))) \
                == (aborted, done) and time.monotonic() < deadline:
            time.sleep(0.02)
        outcomes.append(now)
        if now[0] != aborted:
            assert now == (aborted + 1, done)
            assert metric(server, "neuron_serve_num_requests_running") == 0
            return
    pytest.fail(f"no leave aborted its request in five tries; (aborted, ended at length) after each: {outcomes}")


def test_stream_arrives_as_generated_not_buffered(llm):
    # 250 tokens take the tiny model about 0.15 s: a client not scheduled for that long (two test processes on two
    # cores) reads the whole stream at once however it was sent. A buffered stream arrives at once every time, so
    # one try in three that arrives in pieces tells them apart.
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 250, "temperature": 0, "ignore_eos": True, "stream": True}
    tries = []
    for _ in range(3):
        started = time.perf_counter()
        conn = _open_stream(llm, "/v1/completions", body)
        arrivals, data = [], b""
        with conn:
            while not data.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's end
                chunk = conn.recv(65536)
                assert chunk, data[-500:]
                arrivals.append(time.perf_counter() - started)
                data += chunk
        assert b"data: [DONE]" in data
        assert data.count(b'"finish_reason":"length"') == 1
        # Through HAProxy and the Serve handle, the first token arrives long before the last.
        if arrivals[0] < 0.5 * arrivals[-1] and len(arrivals) > 10:
            return
        tries.append(arrivals)
    pytest.fail(f"every stream arrived in a few pieces at its end (arrival times of each read): {tries}")


@pytest.mark.parametrize("path", ["/v1/completions", f"/v2/models/{MODEL}/v1/completions"])
@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_the_sequence(llm, client, path, stream):
    leave_and_see_the_abort(llm, path, MODEL, 250, stream)
    again = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0)
    assert again.choices[0].text == eager_text(llm, completion_ids(llm, "Hi"), 4)


# -- fuzz ------------------------------------------------------------------------------------

FIELDS = {
    "model": st.one_of(st.just(MODEL), st.integers(), st.none(), st.text(max_size=5)),
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 5000), max_size=5), st.integers(),
                        st.lists(st.lists(st.integers(0, 10), max_size=3), max_size=3), st.none()),
    "max_tokens": st.one_of(st.integers(-10, 10**9), st.floats(allow_nan=True), st.text(max_size=3), st.none()),
    "temperature": st.one_of(st.floats(-5, 5), st.text(max_size=3), st.booleans()),
    "top_p": st.one_of(st.floats(-1, 2), st.integers(-1, 3)),
    "n": st.integers(-2, 40),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), st.integers()),
    "stream": st.one_of(st.booleans(), st.text(max_size=3)),
    "logprobs": st.one_of(st.integers(-3, 40), st.booleans()),
    "seed": st.one_of(st.integers(), st.floats()),
    "echo": st.one_of(st.booleans(), st.text(max_size=3)),
    "prompt_logprobs": st.one_of(st.integers(-2, 30), st.text(max_size=2)),
    "logit_bias": st.one_of(st.dictionaries(st.text(max_size=4) | st.integers(-5, 10**6).map(str),
                                            st.floats(-200, 200) | st.text(max_size=2), max_size=3), st.integers()),
    "min_tokens": st.one_of(st.integers(-3, 50), st.text(max_size=2)),
    "user": st.one_of(st.text(max_size=8), st.integers()),
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml", ""])},
                              optional={"json_schema": st.one_of(st.none(), st.fixed_dictionaries(
                                  {"name": st.text(max_size=3)},
                                  optional={"schema": st.sampled_from([{}, {"type": "integer"}, {"type": "nope"},
                                                                       [], "x", {"enum": []}])}))}),
        st.text(max_size=3)),
    "guided_regex": st.one_of(st.text(max_size=4), st.integers()),
    "guided_choice": st.one_of(st.lists(st.text(max_size=3), max_size=3), st.text(max_size=2)),
    "unknown_field": st.integers(),
}


@settings(max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.fixed_dictionaries({}, optional=FIELDS))
def test_fuzzed_openai_requests_get_4xx_with_messages(llm, body):
    assert_no_5xx(llm, "/v1/completions", body)


def assert_no_5xx(llm, path: str, body: dict) -> None:
    """``body`` sent to ``path``: answered, or refused with OpenAI's error object, never a 5xx."""
    api = Client(llm.url, timeout=60)
    answer = api.request("POST", path, json.dumps(body).encode())
    api.close()
    assert answer.status < 500, (body, answer.body)
    if answer.status >= 400:
        error = answer.json()["error"]
        assert error["message"] and error["type"], answer.body


_ARGUMENTS = st.one_of(st.text(max_size=6), st.just('{"city": "Paris", "celsius": true}'), st.integers(),
                       st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_CALL = st.fixed_dictionaries({}, optional={
    "id": st.text(max_size=4), "type": st.sampled_from(["function", "x"]),
    "function": st.one_of(st.fixed_dictionaries({}, optional={"name": st.one_of(st.text(max_size=4), st.integers()),
                                                              "arguments": _ARGUMENTS}), st.text(max_size=2))})
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"])}, optional={
    "content": st.one_of(st.text(max_size=12), st.none(), st.integers(),
                         st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                         "text": st.text(max_size=5)}), max_size=2)),
    "tool_calls": st.one_of(st.lists(_CALL, max_size=2), st.integers(), st.text(max_size=2)),
    "tool_call_id": st.one_of(st.text(max_size=4), st.integers()),
    "name": st.text(max_size=4)})
_TOOL = st.one_of(st.just(WEATHER), st.just(CLOCK), st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["function", "retrieval", ""]),
    "function": st.one_of(st.fixed_dictionaries({}, optional={
        "name": st.one_of(st.text(max_size=5), st.integers()),
        "parameters": st.sampled_from([{}, {"type": "nope"}, [], "x", {"type": "object", "properties": {
            "a": {"type": "integer"}}}]),
        "strict": st.booleans()}), st.integers())}))
CHAT_FIELDS = {
    **{name: FIELDS[name] for name in ("temperature", "top_p", "stop", "stream", "seed", "logit_bias",
                                       "min_tokens", "user", "response_format", "guided_choice", "unknown_field")},
    "n": st.integers(-1, 3),
    "max_tokens": st.one_of(st.integers(-3, 12), st.text(max_size=2), st.none()),
    "max_completion_tokens": st.one_of(st.integers(-3, 12), st.floats(allow_nan=True)),
    "logprobs": st.one_of(st.booleans(), st.integers(-2, 3)),
    "top_logprobs": st.one_of(st.integers(-2, 30), st.text(max_size=2)),
    "tools": st.one_of(st.lists(_TOOL, max_size=3), st.integers(), st.text(max_size=3)),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", "any", ""]), st.integers(),
                             st.fixed_dictionaries({"type": st.sampled_from(["function", "x"])}, optional={
                                 "function": st.fixed_dictionaries({}, optional={
                                     "name": st.sampled_from(["get_weather", "get_time", "other", ""])})})),
    "parallel_tool_calls": st.one_of(st.booleans(), st.text(max_size=2)),
}


@settings(max_examples=100, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.fixed_dictionaries({
    # Mostly the model served and a user's turn, so the fuzzed fields are read, not refused before.
    "model": st.sampled_from([MODEL, MODEL, MODEL, MODEL, None, 7]),
    "messages": st.one_of(st.just([{"role": "user", "content": "Weather in Paris?"}]), st.lists(_MESSAGE, max_size=3),
                          st.text(max_size=3))}, optional=CHAT_FIELDS))
def test_fuzzed_chat_requests_get_4xx_with_messages(llm, body):
    assert_no_5xx(llm, "/v1/chat/completions", body)


@pytest.mark.parametrize("raw", [b"\xff\xfe{", b"", b"[]", b"null", b'{"model": "llm", "prompt": "\xc3\x28"}',
                                 b'{"model": "llm", "messages": "hi"}', b'{"model":"llm","prompt":"x","max_tokens":-1}',
                                 b'{"model":"llm","prompt":"x","max_tokens":100000000000}'])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_bodies_are_400(llm, raw, path):
    api = Client(llm.url)
    answer = api.request("POST", path, raw)
    api.close()
    assert 400 <= answer.status < 500 and answer.json()["error"]["message"], answer.body


# -- two generate models: /v1 is routed by the body's model (the server app forwards) ---------------

PAIR = """
name: {name}
task: generate
model:
  pretrained: llm
generation:
  max_num_seqs: 4
  max_model_len: 128
  prefill_buckets: [128]           # two models, greedy requests: a prefill and a decode each
  decode_batch_buckets: [4]
  decode_context_buckets: [128]
  on_device_sampling: false
"""


QUANTIZED = """
name: quantized
task: generate
model:
  pretrained: llm
generation:
  max_num_seqs: 4
  max_model_len: 128
  prefill_buckets: [128]           # a prefill and a decode, by argmax and sampled on the core
  decode_batch_buckets: [4]
  decode_context_buckets: [128]
  quantization: int8
  kv_cache_dtype: fp8
"""


@pytest.fixture(scope="module")
def pair(llm, server_factory, tmp_path_factory):
    """Two generate models of the same directory, "left" and "right", and beside them "quantized" (int8 weights, an
    fp8 KV cache), one server."""
    tmp = tmp_path_factory.mktemp("pair")
    (tmp / "llm").symlink_to(llm.model_dir)
    for name in ("left", "right"):
        (tmp / f"{name}.yaml").write_text(PAIR.format(name=name))
    (tmp / "quantized.yaml").write_text(QUANTIZED)
    srv = server_factory([str(tmp / f"{name}.yaml") for name in ("left", "right", "quantized")], tmp)
    srv.quantized_yaml = tmp / "quantized.yaml"
    yield srv
    srv.stop()


def test_two_generate_models_share_v1_by_the_requests_model(llm, pair):
    expected = eager_text(llm, completion_ids(llm, PROMPTS[2]), 12)
    with openai.OpenAI(base_url=f"{pair.url}/v1", api_key="x", max_retries=0) as api:
        assert sorted(m.id for m in api.models.list().data) == ["left", "quantized", "right"]
        left = api.models.retrieve("left")  # GET /v1/models/{id}, through the server app
        assert (left.id, left.owned_by, left.model_extra["max_model_len"]) == ("left", "neuron-serve", 128)
        with pytest.raises(openai.NotFoundError) as gone:
            api.models.retrieve("llm")
        assert gone.value.body["code"] == "model_not_found"
        for name in ("left", "right"):
            whole = api.completions.create(model=name, prompt=PROMPTS[2], max_tokens=12, temperature=0)
            streamed = "".join(c.choices[0].text for c in api.completions.create(
                model=name, prompt=PROMPTS[2], max_tokens=12, temperature=0, stream=True))
            assert whole.model == name and whole.choices[0].text == streamed == expected
        with pytest.raises(openai.NotFoundError) as missing:
            api.completions.create(model="llm", prompt="x")
        assert missing.value.body["message"] == \
            "the model 'llm' does not exist; this server serves: left, quantized, right"
        with pytest.raises(openai.BadRequestError) as bad:
            api.completions.create(model="left", prompt="x", max_tokens=0)
        assert bad.value.body["param"] == "max_tokens"


def test_an_int8_model_with_an_fp8_cache_answers_openai_streamed_and_sampled_as_its_reference(llm, pair):
    """int8 weights and an fp8 KV cache, served: the model cards say so, and greedy and seeded sampled answers,
    whole and streamed, are those of the eager model with the same weights and rounding (tests/precision_models)."""
    import precision_models as pm  # noqa: PLC0415
    from neuron_serve.config.schema import load_config  # noqa: PLC0415
    from neuron_serve.generation.precision import kv_cache  # noqa: PLC0415
    from neuron_serve.generation.compiling.loading import load_lm  # noqa: PLC0415
    from neuron_serve.generation.sample.sampling import SamplingParams  # noqa: PLC0415
    import generation_models as gm  # noqa: PLC0415

    form = kv_cache.of(load_lm(load_config(pair.quantized_yaml), pair.quantized_yaml.parent))
    reference = pm.dequantized_copy(llm.eager, "int8")
    ids = completion_ids(llm, PROMPTS[1])
    want = pm.rounded_greedy(reference, ids, 12, form.k_scales, form.v_scales)
    if llm.tokenizer.eos_token_id in want:
        want = want[:want.index(llm.tokenizer.eos_token_id)]
    with openai.OpenAI(base_url=f"{pair.url}/v1", api_key="x", max_retries=0) as api:
        card = api.models.retrieve("quantized").model_extra
        assert (card["dtype"], card["quantization"], card["kv_cache_dtype"]) == ("float32", "int8", "fp8_e4m3")
        whole = api.completions.create(model="quantized", prompt=PROMPTS[1], max_tokens=12, temperature=0)
        streamed = "".join(c.choices[0].text for c in api.completions.create(
            model="quantized", prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True))
        assert whole.choices[0].text == streamed == llm.tokenizer.decode(want, skip_special_tokens=True)
        sampled = dict(model="quantized", prompt=PROMPTS[1], max_tokens=10, temperature=0.8, top_p=0.9, seed=5,
                       logprobs=0)
        alone = api.completions.create(**sampled)
        chunks = list(api.completions.create(**sampled, stream=True))
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=5)
    drawn = gm.eager_sampled(pm.RoundedModel(reference, form.k_scales, form.v_scales), ids, 10, params)
    if llm.tokenizer.eos_token_id in drawn:
        drawn = drawn[:drawn.index(llm.tokenizer.eos_token_id)]
    tokens = [llm.tokenizer.decode([t], skip_special_tokens=True) for t in drawn]
    assert alone.choices[0].logprobs.tokens == tokens
    assert "".join(c.choices[0].text for c in chunks) == alone.choices[0].text
    meta = json.loads(urllib.request.urlopen(f"{pair.url}/v2/models/quantized", timeout=30).read())["parameters"]
    assert (meta["quantization"], meta["quantization_type"], meta["kv_cache_dtype"], meta["kv_cache_scales"]) == \
        ("int8", "per_channel_symmetric", "fp8_e4m3", "calibrated")


@pytest.mark.parametrize("stream", [True, False])
def test_a_forwarded_request_whose_client_leaves_is_aborted(pair, stream):
    leave_and_see_the_abort(pair, "/v1/completions", "right", 120, stream)


def test_deploy_prints_at_most_a_line_per_compiled_model_and_the_placement_not_the_operator_lists(llm):
    """Each replica is ready on its first two models (the longest prefill, the largest decode) and compiles the
    other 4 behind (conftest.LLM_CONFIG: the other prefill, and decode of 1 and 8 rows by 1 and 4 steps, by
    argmax: on_device_sampling is off)."""
    finished = r"neuron_serve: model llm: background compile finished [\d.]+ s after the build began: 6 compiled " \
               r"models(?!,)"  # and no ", N failed"
    # Both replicas' models compiled (the metrics: Ray may hold back the second replica's alike closing line).
    deadline = time.monotonic() + 600
    while (metric(llm, "neuron_serve_compiled_models", model="llm", state="compiled") < 2 * 6
           and time.monotonic() < deadline):
        time.sleep(1)
    # Beside the 6 planned, a replica may have compiled the prefill that keeps every position's logits (one
    # variant, when a request first asked for prompt logprobs: earlier tests of the session do).
    assert 2 * 6 <= metric(llm, "neuron_serve_compiled_models", model="llm", state="compiled") <= 2 * 7
    assert metric(llm, "neuron_serve_compiled_models", model="llm", state="failed") == 0
    while not re.search(finished, llm.log.read_text(errors="replace")) and time.monotonic() < deadline:
        time.sleep(1)
    log = re.sub(r"\x1b\[[0-9;]*m", "", llm.log.read_text(errors="replace"))  # Ray colours its prefixes
    assert re.search(finished, log), log[-3000:]
    # Ray folds the replicas' alike lines ("[repeated 2x across cluster]").
    repeated = r"(?: \[repeated \d+x across cluster\].*)?$"
    prefix = r"^\(ServeReplica:llm:generate pid=\d+\) neuron_serve: "
    steps = re.findall(prefix + r"compiled llm (\w+) \((\d+) of 6\) in [\d.]+ s" + repeated, log, re.MULTILINE)
    # And the prefill keeping every position's logits, compiled when a request first asked for prompt logprobs.
    asked = re.findall(prefix + r"compiled llm prefill_\d+_every_position \(asked for by a request\) in [\d.]+ s" +
                       repeated, log, re.MULTILINE)
    assert len(steps) + len(asked) == len(re.findall(r"neuron_serve: compiled llm ", log))  # each well-formed
    assert len(steps) <= 2 * 6
    # Ray prints the first line of a pattern (words with digits ignored: every "compiled" line is one pattern) at
    # once and folds the other replica's alike lines into later "[repeated]" ones, so which lines show varies;
    # each shown says its model's place in the order: the two ready ones first, then shortest prefill first,
    # one-step decodes fewest rows first, then multi-step.
    order = {"1": "prefill_256", "2": "decode_8x256", "3": "prefill_32", "4": "decode_1x256",
             "5": "decode_1x256_steps4", "6": "decode_8x256_steps4"}
    assert ("prefill_256", "1") in steps
    assert all(order[place] == model for model, place in steps), steps
    ready = re.findall(prefix + r"model llm built in [\d.]+s; ready on 2 of 6 compiled models, the other 4 compile in "
                       r"the background" + repeated, log, re.MULTILINE)
    assert 1 <= len(ready) <= 2
    placed = re.findall(prefix + r"placement of llm \(6 compiled models\): 6 accelerator subgraphs, 0 CPU "
                        r"subgraphs; operators: \d+ on the accelerator, 0 on CPU; --verbose lists them" + repeated,
                        log, re.MULTILINE)
    assert 1 <= len(placed) <= 2
    for operator_list in ("Num Partitions", "The following operat", "aten::linear:", "subgraph accel_0"):
        assert operator_list not in log  # those are --verbose's

