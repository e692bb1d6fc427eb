"""OpenAI's tools on the chat route: the request's tool choice, and the tool calls in the model's answer.

``tool_choice`` decides how an answer becomes calls:

- ``"none"``: the tools reach the chat template, the answer is text;
- ``"auto"`` (the default when tools are given): the answer is read by the model's tool-call
  parser (model.yaml's ``generation.tool_call_parser``, vLLM's ``--tool-call-parser`` names):
  ``hermes`` finds ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, the text
  around them is the answer's content; ``llama3_json`` reads an answer that starts with ``{``
  as ``{"name": ..., "parameters": {...}}`` objects separated by ``;``;
- ``"required"``: the answer is held, by the structured-output path, to a JSON array of
  ``{"name", "parameters"}`` objects, one tool's parameters schema each (vLLM's form);
- a named function: the answer is held to that function's parameters schema, and is its arguments.

An answer the parser cannot read stays content, whole: nothing the model wrote is lost.
Streams carry each call as OpenAI streams it (``delta.tool_calls`` with an index, the
call's id, name and its arguments as they become known).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...generation.frontend.structured import Constraint

PARSERS = ("hermes", "llama3_json")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A tools field that cannot be served; ``param`` is the field, as OpenAI's error names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: Any  # the function's JSON schema (an empty object schema when not given)


@dataclass(frozen=True)
class ToolChoice:
    """What a chat request asks of its tools: ``mode`` is none, auto, required or named (``name`` the function)."""

    mode: str
    tools: tuple[Tool, ...] = ()
    name: str | None = None
    parallel: bool = True

    @property
    def constraint(self) -> Constraint | None:
        """The structured-output constraint of a required or named choice."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.name == self.name)
            return Constraint("json_schema", tool.parameters, "tool_choice")
        if self.mode != "required":
            return None
        calls = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [t.name]}, "parameters": t.parameters},
             "required": ["name", "parameters"]} for t in self.tools]}}
        if not self.parallel:
            calls["maxItems"] = 1
        return Constraint("json_schema", calls, "tool_choice")


def tools_of(tools: list[dict] | None) -> tuple[Tool, ...]:
    """The request's ``tools``, checked: functions with a name and, if given, a parameters schema (an object)."""
    found: list[Tool] = []
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(f'{where}.type: give "function" (the only tool type served)', f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolError(f"{where}.function: give the function, an object with its name and parameters",
                            f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"{where}.function.name: {name!r} is not a function name (1 to 64 letters, digits, _ "
                            f"or -)", f"{where}.function.name")
        if any(t.name == name for t in found):
            raise ToolError(f"{where}.function.name: {name!r} is given twice", f"{where}.function.name")
        parameters = function.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise ToolError(f"{where}.function.parameters: give the parameters' JSON schema (an object)",
                            f"{where}.function.parameters")
        found.append(Tool(name, parameters))
    return tuple(found)


def tool_choice(tools: list[dict] | None, choice: str | dict | None, parallel: bool | None,
                parser: str | None) -> ToolChoice:
    """The request's tool choice, checked against its tools and the model's parser (``None``: none configured)."""
    given = tools_of(tools)
    if choice is None:
        choice = "auto" if given else "none"
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ToolError('tool_choice: give "none", "auto", "required" or {"type": "function", "function": '
                            '{"name": ...}}', "tool_choice")
        if not any(t.name == name for t in given):
            raise ToolError(f"tool_choice: the function {name!r} is not among the request's tools "
                            f"({', '.join(t.name for t in given) or 'none given'})", "tool_choice")
        return ToolChoice("named", given, name, parallel is not False)
    if choice not in ("none", "auto", "required"):
        raise ToolError(f'tool_choice: {choice!r} is not one of "none", "auto", "required" or a named function',
                        "tool_choice")
    if choice != "none" and not given:
        raise ToolError(f'tool_choice: {choice!r} needs tools; give the tools the model may call', "tool_choice")
    if choice == "auto" and parser is None:
        raise ToolError('tool_choice: "auto" needs the model\'s tool-call parser: set generation.tool_call_parser '
                        f'({" or ".join(PARSERS)}) in its model.yaml, or send tool_choice "required" or a named '
                        f'function', "tool_choice")
    return ToolChoice(choice, given, None, parallel is not False)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates take them: an assistant's tool calls with their arguments as objects (the
    API sends them as JSON strings; templates write them with ``tojson``), as vLLM and transformers do."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise ToolError(f"messages[{i}].tool_calls: give a list of tool calls", f"messages[{i}].tool_calls")
            message = {**message, "tool_calls": [_template_call(call, f"messages[{i}].tool_calls[{j}]")
                                                 for j, call in enumerate(calls)]}
        out.append(message)
    return out


def _template_call(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolError(f"{where}.function: give the call's function, with its name and arguments", f"{where}.function")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ToolError(f"{where}.function.arguments: not JSON ({exc})", f"{where}.function.arguments") from None
    return {**call, "function": {**function, "arguments": arguments}}


# -- reading calls from the answer ------------------------------------------------------------


@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj: Any, arguments_key: str) -> Call | None:
    """A call of a parsed object ``{"name": ..., <arguments_key>: {...}}``; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    return Call(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


class Reader:
    """One choice's answer read into content and calls as its text arrives.

    ``add(text)`` returns (content delta, stream deltas of calls); ``finish()`` the same for what
    was held back; ``calls`` are the calls read so far. Each mode holds back only what may
    still turn out to be a call, so content streams as it is generated.
    """

    def __init__(self, choice: ToolChoice, parser: str | None) -> None:
        self.mode = choice.mode
        self.parser = parser
        self.parallel = choice.parallel
        self.name = choice.name
        self.calls: list[Call] = []
        self.text = ""  # everything received
        self._held = 0  # where the text not yet handed out starts
        self._content: list[str] = []
        self._decided: bool | None = None  # llama3_json: the answer is calls (True), or content (False)

    @property
    def content(self) -> str | None:
        text = "".join(self._content)
        return text if text.strip() or not self.calls else None

    def add(self, text: str) -> tuple[str, list[dict]]:
        self.text += text
        if self.mode == "named":
            return self._named(text)
        if self.mode == "required":
            return "", []
        if self.mode == "none":
            return self._out(len(self.text)), []
        if self.parser == "hermes":
            return self._hermes(final=False)
        return self._llama3(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        if self.mode == "named":
            return "", []
        if self.mode == "required":
            try:
                found = json.loads(self.text)
            except json.JSONDecodeError:
                found = None
            calls = [c for c in (_call(o, "parameters") for o in found) if c] if isinstance(found, list) else []
            if not calls:
                return self._out(len(self.text)), []
            return "", self._emit(calls)
        if self.mode == "none":
            return self._out(len(self.text)), []
        if self.parser == "hermes":
            return self._hermes(final=True)
        return self._llama3(final=True)

    def _out(self, upto: int) -> str:
        """Hand out the text up to ``upto`` as content."""
        delta = self.text[self._held:upto]
        self._held = max(self._held, upto)
        self._content.append(delta)
        return delta

    def _emit(self, calls: list[Call]) -> list[dict]:
        if not self.parallel:
            calls = calls[:max(0, 1 - len(self.calls))]
        deltas = []
        for call in calls:
            deltas.append({"index": len(self.calls), **call.message()})
            self.calls.append(call)
        return deltas

    def _named(self, text: str) -> tuple[str, list[dict]]:
        """The answer is the named function's arguments: its call opens on the first text, then grows."""
        if not self.calls:
            self.calls.append(Call(self.name, text))
            return "", [{"index": 0, **self.calls[0].message()}]
        self.calls[0].arguments += text
        return "", [{"index": 0, "function": {"arguments": text}}] if text else []

    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"

    def _hermes(self, final: bool) -> tuple[str, list[dict]]:
        content, deltas = [], []
        while True:
            start = self.text.find(self._OPEN, self._held)
            if start < 0:
                # Content up to a possible start of the opening tag.
                keep = 0 if final else _partial_suffix(self.text[self._held:], self._OPEN)
                content.append(self._out(len(self.text) - keep))
                break
            content.append(self._out(start))
            end = self.text.find(self._CLOSE, start)
            if end < 0 and not final:
                break  # inside a call: held until it closes
            body = self.text[start + len(self._OPEN):end if end >= 0 else len(self.text)]
            try:
                call = _call(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a call after all: it is content, as written
                content.append(self._out(len(self.text) if end < 0 else end + len(self._CLOSE)))
                continue
            deltas += self._emit([call])
            self._held = len(self.text) if end < 0 else end + len(self._CLOSE)
        return "".join(content), deltas

    def _llama3(self, final: bool) -> tuple[str, list[dict]]:
        if self._decided is None:
            stripped = self.text.lstrip()
            if stripped:
                self._decided = stripped.startswith("{")
        if self._decided is False or (self._decided is None and final):
            return self._out(len(self.text)), []
        if not final:
            return "", []  # a JSON answer: read whole, when it ends
        calls, at, decoder = [], 0, json.JSONDecoder()
        text = self.text
        while True:
            while at < len(text) and (text[at].isspace() or text[at] == ";"):
                at += 1
            if at >= len(text):
                break
            try:
                obj, at = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                calls = []
                break
            call = _call(obj, "parameters")
            if call is None:
                calls = []
                break
            calls.append(call)
        if not calls:
            return self._out(len(text)), []
        self._held = len(text)
        return "", self._emit(calls)


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
