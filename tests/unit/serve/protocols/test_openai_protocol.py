"""The OpenAI codec: requests decoded into prompts and sampling parameters, errors by field."""

import json

import pytest

from neuron_serve.generation.sample.sampling import SamplingParams
from neuron_serve.serve.protocols import oip_generate, openai


def parse(kind, **body):
    import json

    return openai.parse(kind, json.dumps(body).encode())


def error(kind, body: bytes) -> openai.OpenAIError:
    with pytest.raises(openai.OpenAIError) as caught:
        openai.parse(kind, body)
    return caught.value


def test_completion_defaults_are_openais():
    request = parse("completions", model="m", prompt="hi")
    params = openai.sampling(request)
    assert params == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0)
    chat = parse("chat", model="m", messages=[{"role": "user", "content": "hi"}])
    assert openai.sampling(chat).max_tokens is None  # chat: until the context is full


def test_sampling_fields_reach_the_engine():
    request = parse("completions", model="m", prompt="hi", max_tokens=5, temperature=0.5, top_p=0.9, seed=3,
                    stop="\n", presence_penalty=0.5, frequency_penalty=-0.5, logprobs=2, top_k=4,
                    repetition_penalty=1.1, ignore_eos=True, stop_token_ids=[7], n=2)
    first, second = openai.sampling(request, 0), openai.sampling(request, 1)
    assert first == SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=4, repetition_penalty=1.1,
                                   presence_penalty=0.5, frequency_penalty=-0.5, seed=3, stop_token_ids=(7,),
                                   stop=("\n",), ignore_eos=True, logprobs=2)
    assert second.seed == 4  # each choice of a seeded request draws its own sequence
    chat = parse("chat", model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}],
                 max_completion_tokens=7, max_tokens=99, logprobs=True, top_logprobs=3)
    assert openai.sampling(chat).max_tokens == 7 and openai.sampling(chat).logprobs == 3
    assert openai.chat_messages(chat) == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize("body,param,message", [
    (b"{", None, "the request body is not valid JSON"),
    (b"\xff", None, "the request body is not valid JSON"),
    (b"[1]", None, "the request body must be a JSON object"),
    (b'{"model": "m"}', "prompt", "prompt: Field required"),
    (b'{"model": "m", "prompt": "x", "max_tokens": 0}', "max_tokens",
     "max_tokens: 0 generates nothing; it needs echo: true or prompt_logprobs (to score the prompt), else give "
     "max_tokens >= 1"),
    (b'{"model": "m", "prompt": "x", "max_tokens": -1}', "max_tokens", "max_tokens: Input should be greater than or equal to 0"),
    (b'{"model": "m", "prompt": "x", "prompt_logprobs": 21}', "prompt_logprobs",
     "prompt_logprobs: Input should be less than or equal to 20"),
    (b'{"model": "m", "prompt": "x", "temperature": "hot"}', "temperature", "temperature: Input should be a valid number"),
    (b'{"model": "m", "prompt": "x", "n": 99}', "n", "n: Input should be less than or equal to 16"),
    (b'{"model": "m", "prompt": "x", "foo": 1}', "foo", "unknown field 'foo': this server does not support it"),
    (b'{"model": "m", "prompt": "x", "best_of": 3}', "best_of", "best_of is not supported unless equal to n"),
    (b'{"model": "m", "prompt": "x", "logit_bias": {"a": 1}}', "logit_bias",
     "logit_bias: 'a' is not a token id (give token ids as strings of integers)"),
    (b'{"model": "m", "prompt": "x", "logit_bias": {"5": 200}}', "logit_bias",
     "logit_bias: token 5 has bias 200.0; give token ids >= 0 and biases in [-100, 100]"),
    (b'{"model": "m", "prompt": "x", "min_tokens": -1}', "min_tokens",
     "min_tokens: Input should be greater than or equal to 0"),
    (b'{"model": "m", "prompt": "x", "stream_options": {"include_usage": true}}', "stream_options",
     "stream_options is only allowed with stream: true"),
])
def test_bad_completion_requests_name_the_field(body, param, message):
    caught = error("completions", body)
    assert str(caught).startswith(message) and caught.param == param and caught.http_status == 400


def test_bad_chat_requests_name_the_field():
    assert error("chat", b'{"model": "m", "messages": []}').param == "messages"
    assert error("chat", b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}').param == "messages.0.role"
    refused = error("chat", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}')
    assert str(refused) == "top_logprobs needs logprobs: true"
    assert error("chat", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "suffix": "y"}').param \
        == "suffix"


def test_echo_scores_the_prompt_as_lm_eval_asks_it():
    # lm-eval's loglikelihood request: the prompt's logprobs, nothing generated.
    params = openai.sampling(parse("completions", model="m", prompt="x", max_tokens=0, echo=True, logprobs=1,
                                   temperature=0))
    assert (params.max_tokens, params.prompt_logprobs, params.logprobs) == (0, 1, 1)
    assert openai.sampling(parse("completions", model="m", prompt="x", echo=True, max_tokens=0)).prompt_logprobs == 0
    assert openai.sampling(parse("completions", model="m", prompt="x", echo=True)).prompt_logprobs is None
    assert openai.sampling(parse("completions", model="m", prompt="x", prompt_logprobs=3)).prompt_logprobs == 3


def test_each_structured_output_field_becomes_one_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
         ("json_schema", schema, "response_format.json_schema.schema")),
        ({"response_format": {"type": "json_object"}}, ("json_object", None, "response_format")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, ("choice", ("a", "b"), "structured_outputs.choice")),
        ({"structured_outputs": {"regex": "x+"}}, ("regex", "x+", "structured_outputs.regex")),
        ({"structured_outputs": {"json": json.dumps(schema)}}, ("json_schema", schema, "structured_outputs.json")),
        ({"guided_grammar": 'root ::= "a"'}, ("grammar", 'root ::= "a"', "guided_grammar")),
        ({"guided_json": schema}, ("json_schema", schema, "guided_json")),
        ({"response_format": {"type": "text"}}, None),
    ]
    for fields, want in cases:
        found = openai.sampling(parse("chat", model="m", messages=[{"role": "user", "content": "x"}], **fields))
        got = found.structured
        assert (None if got is None else (got.kind, got.spec, got.field)) == want, fields


@pytest.mark.parametrize("fields,param,message", [
    ({"response_format": {"type": "xml"}}, "response_format.type",
     "response_format.type: 'xml' is not one of text, json_object, json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "response_format.json_schema.schema: give the JSON schema (an object)"),
    ({"guided_choice": []}, "guided_choice", "guided_choice: give a list of non-empty strings"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json", "structured_outputs.json: not a JSON schema"),
    ({"structured_outputs": {"cfg": "x"}}, "structured_outputs.cfg", "structured_outputs.cfg: not one of json, regex"),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace", "structured_outputs.disable_any_whitespace: not one of json"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "guided_regex: give one structured-output constraint; response_format gives one already"),
])
def test_bad_structured_output_fields_name_the_field(fields, param, message):
    caught = error("completions", json.dumps({"model": "m", "prompt": "x", **fields}).encode())
    assert str(caught).startswith(message) and caught.param == param


def test_user_logit_bias_and_min_tokens_reach_the_sampling_parameters():
    request = parse("completions", model="m", prompt="x", user="end-user-7", logit_bias={"5": -100, "9": 2.5},
                    min_tokens=3, max_tokens=8)
    params = openai.sampling(request)
    assert params.logit_bias == ((5, -100.0), (9, 2.5)) and params.min_tokens == 3
    assert request.user == "end-user-7"


def test_error_objects_are_openais():
    status, body = openai.error_of(openai.unknown_model("gpt-4", ["llm"]))
    assert status == 404
    assert body == {"error": {"message": "the model 'gpt-4' does not exist; this server serves: llm",
                              "type": "not_found_error", "param": "model", "code": "model_not_found"}}
    status, body = openai.error_of(RuntimeError("boom"))
    assert status == 500 and body["error"]["type"] == "server_error"


def test_prompts_text_ids_and_lists():
    assert openai.completion_prompts(parse("completions", model="m", prompt="a")) == ["a"]
    assert openai.completion_prompts(parse("completions", model="m", prompt=[1, 2])) == [[1, 2]]
    assert openai.completion_prompts(parse("completions", model="m", prompt=["a", "b"])) == ["a", "b"]
    assert openai.completion_prompts(parse("completions", model="m", prompt=[[1], [2, 3]])) == [[1], [2, 3]]


def test_sse_and_logprob_objects():
    assert openai.sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert openai.DONE == b"data: [DONE]\n\n"
    legacy = openai.completion_logprobs(["He", "llo"], [-0.1, -0.2], [[("He", -0.1)], [("llo", -0.2)]], offset=3)
    assert legacy["text_offset"] == [3, 5] and legacy["top_logprobs"] == [{"He": -0.1}, {"llo": -0.2}]
    # Two top tokens that decode to the same text (halves of one character): one key, the higher logprob.
    merged = openai.completion_logprobs(["\ufffd"], [-0.3], [[("\ufffd", -0.3), ("a", -0.9), ("\ufffd", -1.2)]], 0)
    assert merged["top_logprobs"] == [{"\ufffd": -0.3, "a": -0.9}]
    chat = openai.chat_logprobs([("é", -0.5, [("é", -0.5), ("e", -1.0)])])
    assert chat["content"][0]["bytes"] == [195, 169] and len(chat["content"][0]["top_logprobs"]) == 2


def test_oip_generate_parameters():
    request = oip_generate.parse(b'{"text_input": "hi", "parameters": {"max_tokens": 3, "stop": "x", "temperature": 0}}')
    assert oip_generate.sampling(request) == SamplingParams(max_tokens=3, temperature=0, stop=("x",))
    with pytest.raises(Exception, match=r"^parameters.top_q: unknown field"):
        oip_generate.parse(b'{"text_input": "hi", "parameters": {"top_q": 1}}')
    with pytest.raises(Exception, match=r"^text_input: Field required"):
        oip_generate.parse(b'{"parameters": {}}')
