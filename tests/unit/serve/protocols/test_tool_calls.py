"""OpenAI's tools on the chat route: tool choices checked by field, and calls read from answers.

Every parser is read twice, whole and streamed in pieces of every size, and both must give the
same content and calls: what a client sees does not depend on how the text arrived.
"""

import json

import pytest

from neuron_serve.serve.protocols import openai
from neuron_serve.serve.protocols.openai_tools import Reader, ToolChoice, tool_choice

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**fields) -> openai.ChatRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    return openai.parse("chat", json.dumps(body).encode())


def refused(parser=None, **fields) -> openai.OpenAIError:
    with pytest.raises(openai.OpenAIError) as caught:
        openai.tools(chat(**fields), parser)
    return caught.value


@pytest.mark.parametrize("fields,param,message", [
    ({"tools": [{}]}, "tools[0].type", 'tools[0].type: give "function" (the only tool type served)'),
    ({"tools": [{"type": "function"}]}, "tools[0].function",
     "tools[0].function: give the function, an object with its name and parameters"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
     "tools[0].function.name: 'a b' is not a function name (1 to 64 letters, digits, _ or -)"),
    ({"tools": [TIME, TIME]}, "tools[1].function.name", "tools[1].function.name: 'get_time' is given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters",
     "tools[0].function.parameters: give the parameters' JSON schema (an object)"),
    ({"tools": [TIME], "tool_choice": "sometimes"}, "tool_choice",
     "tool_choice: 'sometimes' is not one of \"none\", \"auto\", \"required\" or a named function"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice: 'required' needs tools; give the tools the model "
                                                 "may call"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice",
     "tool_choice: the function 'get_weather' is not among the request's tools (get_time)"),
    ({"tools": [TIME], "tool_choice": {"type": "function"}}, "tool_choice",
     'tool_choice: give "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'),
    ({"tools": [TIME], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "tool_choice: 'required' holds the answer to a tool call, and response_format to another form; give one of "
     "them"),
])
def test_bad_tools_name_the_field(fields, param, message):
    error = refused("hermes", **fields)
    assert (str(error), error.param, error.http_status) == (message, param, 400)


def test_auto_needs_the_models_parser_and_is_the_default_with_tools():
    error = refused(None, tools=[TIME])
    assert error.param == "tool_choice" and str(error).startswith(
        'tool_choice: "auto" needs the model\'s tool-call parser: set generation.tool_call_parser (hermes or '
        'llama3_json) in its model.yaml')
    assert openai.tools(chat(tools=[TIME]), "hermes").mode == "auto"
    assert openai.tools(chat(), None).mode == "none"
    assert openai.tools(chat(tools=[TIME], tool_choice="none"), None).mode == "none"  # no parser needed
    assert openai.tools(chat(tools=[TIME], tool_choice="required"), None).mode == "required"


def test_required_and_named_choices_become_the_answers_schema():
    required = tool_choice([WEATHER, TIME], "required", False, None).constraint
    assert required.kind == "json_schema" and required.field == "tool_choice"
    assert required.spec == {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER["function"]["parameters"]}, "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}}}, "required": ["name", "parameters"]}]}}
    named = tool_choice([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None, None)
    assert named.constraint.spec == WEATHER["function"]["parameters"]
    request = chat(tools=[WEATHER], tool_choice="required")
    assert openai.sampling(request, 0, openai.tools(request, None)).structured.field == "tool_choice"
    assert tool_choice([TIME], "auto", None, "hermes").constraint is None


def test_assistant_tool_calls_reach_the_template_with_their_arguments_as_objects():
    request = chat(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    messages = openai.chat_messages(request)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    with pytest.raises(openai.OpenAIError) as bad:
        openai.chat_messages(chat(messages=[{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]))
    assert bad.value.param == "messages[0].tool_calls[0].function.arguments"


def read(choice: ToolChoice, parser: str | None, text: str, size: int | None) -> tuple[str | None, list[dict], list]:
    """(content, calls as the whole answer gives them, stream deltas) of ``text``, fed ``size`` characters at a time
    (None: at once)."""
    reader = Reader(choice, parser)
    pieces = [text] if size is None else [text[i:i + size] for i in range(0, len(text), size)]
    streamed_content, deltas = "", []
    for piece in pieces:
        content, calls = reader.add(piece)
        streamed_content += content
        deltas += calls
    content, calls = reader.finish()
    streamed_content += content
    deltas += calls
    assert streamed_content == "".join(reader._content)
    calls = [{"name": c.name, "arguments": json.loads(c.arguments)} for c in reader.calls]
    return reader.content, calls, deltas


def accumulate(deltas: list[dict]) -> list[dict]:
    """Stream deltas folded into calls, as the openai client's stream helpers fold them."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
        function = delta.get("function", {})
        call["name"] += function.get("name") or ""
        call["arguments"] += function.get("arguments") or ""
    return [{"name": c["name"], "arguments": json.loads(c["arguments"])} for _, c in sorted(calls.items())]


AUTO = ToolChoice("auto", ())
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.\n", [{"name": "get_weather", "arguments": {"city": "Paris"}}]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": 1}}'
               '</tool_call>', None, [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]),
    ("hermes", "No tools needed: 1 < 2 and <tool is not a tag.", "No tools needed: 1 < 2 and <tool is not a tag.", []),
    ("hermes", "<tool_call>{broken</tool_call> rest", "<tool_call>{broken</tool_call> rest", []),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"k": "v"}}', None, [{"name": "a", "arguments": {"k": "v"}}]),
    ("llama3_json", ' {"name": "get_weather", "parameters": {"city": "Tokyo"}}; {"name": "get_time", "parameters": {}}',
     None, [{"name": "get_weather", "arguments": {"city": "Tokyo"}}, {"name": "get_time", "arguments": {}}]),
    ("llama3_json", "It is sunny in {Paris}.", "It is sunny in {Paris}.", []),
    ("llama3_json", '{"name": "x", "parameters": ', '{"name": "x", "parameters": ', []),
]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_each_parser_reads_calls_the_same_whole_or_streamed(parser, text, content, calls):
    for size in (None, 1, 2, 5, 13):
        got_content, got_calls, deltas = read(AUTO, parser, text, size)
        assert (got_content, got_calls) == (content, calls), size
        assert accumulate(deltas) == calls
        assert all(d["id"].startswith("call_") and d["type"] == "function" for d in deltas)


def test_hermes_streams_content_before_the_call_as_it_arrives():
    reader = Reader(AUTO, "hermes")
    assert reader.add("Sure, ") == ("Sure, ", [])
    assert reader.add("one moment <tool") == ("one moment ", [])  # "<tool" may open a call: held
    assert reader.add('_call>{"name": "f", "arguments": {}}') == ("", [])
    content, deltas = reader.add("</tool_call>")
    assert content == "" and deltas[0]["function"] == {"name": "f", "arguments": "{}"}


def test_without_parallel_calls_only_the_first_is_kept():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    _, calls, _ = read(ToolChoice("auto", (), parallel=False), "hermes", text, 3)
    assert calls == [{"name": "a", "arguments": {}}]


def test_named_choice_streams_the_arguments_as_generated():
    named = ToolChoice("named", (), name="get_weather")
    content, calls, deltas = read(named, None, '{"city": "Paris"}', 4)
    assert content is None and calls == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": '{"ci'} and deltas[0]["id"].startswith("call_")
    assert deltas[1] == {"index": 0, "function": {"arguments": 'ty":'}}


def test_required_choice_reads_the_array_and_keeps_an_unreadable_answer_as_content():
    required = ToolChoice("required", ())
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    content, calls, _ = read(required, None, text, 7)
    assert content is None and [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert read(required, None, '[{"name": "get_wea', 7)[:2] == ('[{"name": "get_wea', [])  # cut by max_tokens
