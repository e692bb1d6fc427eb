"""The OpenAI API (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``) as a codec.

Requests are decoded into prompts and the engine's `SamplingParams`; the engine's output
(text deltas, tokens, log-probabilities, finish reasons) is encoded back into OpenAI's
JSON objects and server-sent-event chunks. Field names, defaults and error objects are
OpenAI's; vLLM's extra sampling fields (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``) are accepted too. A field OpenAI defines that this
server cannot honour is refused by name, never ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...errors import InvalidInput, NeuronServeError
from ...generation.sample.sampling import MAX_LOGPROBS, SamplingParams
from ...generation.frontend.structured import Constraint
from .openai_tools import ToolChoice, ToolError, template_messages, tool_choice

MAX_N = 16  # choices per request: each is a sequence holding a KV-cache slot
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat has none: the context)
OWNER = "neuron-serve"

# OpenAI's error ``type`` for each status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error",
               504: "timeout_error"}


class OpenAIError(NeuronServeError):
    """An error answered as OpenAI's error object, with the field it is about (``param``)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.http_status = status
        self.param = param
        self.code = code


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_of(exc: Exception) -> tuple[int, dict]:
    """(status, error object) of any exception raised while serving an OpenAI request."""
    if isinstance(exc, OpenAIError):
        return exc.http_status, error_body(str(exc), exc.http_status, exc.param, exc.code)
    if isinstance(exc, NeuronServeError):
        return exc.http_status, error_body(str(exc), exc.http_status, getattr(exc, "field", None))
    return 500, error_body(f"internal error: {type(exc).__name__}: {exc}", 500)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage (so far) on every chunk


class _Sampling(_Strict):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    user: str | None = None  # an end user's id: logged with the request, kept nowhere
    min_tokens: int = Field(0, ge=0)  # vLLM's: no EOS nor stop token id before this many tokens
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(COMPLETIONS_DEFAULT_MAX_TOKENS, ge=0)  # 0: with echo or prompt_logprobs only
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt before the completion, with its tokens' logprobs when logprobs is given
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: choices[].prompt_logprobs
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the chat template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


# Fields OpenAI defines that this server cannot honour: refused when given a non-default value.
_REFUSED = {
    "suffix": (None, "suffix (insertion) is not supported by causal LMs served here"),
}


def json_object(body: bytes, error: type[NeuronServeError] = OpenAIError) -> dict:
    """A request body as a JSON object, or ``error`` (400) saying why it is not one."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise error("the request body must be a JSON object")
    return data


def parse(kind: Literal["completions", "chat"], body: bytes) -> CompletionRequest | ChatRequest:
    """The request body decoded and checked; errors are OpenAIErrors naming the field."""
    return validate(kind, json_object(body))


def validate(kind: Literal["completions", "chat"], data: dict) -> CompletionRequest | ChatRequest:
    """A decoded request body checked (:func:`parse` after the JSON); errors are OpenAIErrors naming the field."""
    schema = CompletionRequest if kind == "completions" else ChatRequest
    try:
        request = schema.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            raise OpenAIError(f"unknown field {param!r}: this server does not support it", param=param) from None
        message = first["msg"]
        raise OpenAIError(f"{param}: {message}" if param else message, param=param) from None
    for name, (default, why) in _REFUSED.items():
        if name in request.model_fields_set and getattr(request, name, default) not in (default, {}, []):
            raise OpenAIError(why, param=name)
    if isinstance(request, CompletionRequest) and request.best_of not in (None, request.n):
        raise OpenAIError("best_of is not supported unless equal to n", param="best_of")
    if isinstance(request, CompletionRequest) and request.max_tokens == 0 and not request.echo \
            and request.prompt_logprobs is None:
        raise OpenAIError("max_tokens: 0 generates nothing; it needs echo: true or prompt_logprobs (to score the "
                          "prompt), else give max_tokens >= 1", param="max_tokens")
    if isinstance(request, ChatRequest) and request.top_logprobs is not None and not request.logprobs:
        raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs")
    if request.stream_options is not None and not request.stream:
        raise OpenAIError("stream_options is only allowed with stream: true", param="stream_options")
    _logit_bias(request.logit_bias)
    constraint(request)
    return request


_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}


def constraint(request: CompletionRequest | ChatRequest) -> Constraint | None:
    """The request's structured-output constraint, from whichever one field gives it; an OpenAIError naming the
    field when it is malformed or when two fields give one."""
    found: list[Constraint] = []
    fmt = request.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            found.append(Constraint("json_object", field="response_format"))
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
            if not isinstance(schema, (dict, bool)):
                raise OpenAIError("response_format.json_schema.schema: give the JSON schema (an object)",
                                  param="response_format.json_schema.schema")
            found.append(Constraint("json_schema", schema, "response_format.json_schema.schema"))
        elif kind != "text":
            raise OpenAIError(f"response_format.type: {kind!r} is not one of text, json_object, json_schema",
                              param="response_format.type")
    given = request.structured_outputs or {}
    unknown = sorted(set(given) - set(_STRUCTURED_KEYS))
    if unknown:
        raise OpenAIError(f"structured_outputs.{unknown[0]}: not one of {', '.join(_STRUCTURED_KEYS)}",
                          param=f"structured_outputs.{unknown[0]}")
    for key, kind in _STRUCTURED_KEYS.items():
        value = given.get(key)
        if value is None or value is False:
            continue
        found.append(Constraint(kind, None if kind == "json_object" else _spec(kind, value, f"structured_outputs.{key}"),
                                f"structured_outputs.{key}"))
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(request, name)
        if value is not None:
            found.append(Constraint(kind, _spec(kind, value, name), name))
    if len(found) > 1:
        raise OpenAIError(f"{found[1].field}: give one structured-output constraint; {found[0].field} gives one "
                          f"already", param=found[1].field)
    return found[0] if found else None


def _spec(kind: str, value: Any, field: str) -> Any:
    """A constraint's spec, checked for its form (the grammar library checks the rest)."""
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise OpenAIError(f"{field}: not a JSON schema ({exc})", param=field) from None
        if not isinstance(value, (dict, bool)):
            raise OpenAIError(f"{field}: give the JSON schema (an object)", param=field)
        return value
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise OpenAIError(f"{field}: give a list of non-empty strings", param=field)
        return tuple(value)
    if not isinstance(value, str) or not value:
        raise OpenAIError(f"{field}: give the {kind} as a non-empty string", param=field)
    return value


def _logit_bias(bias: dict[str, float] | None) -> list[tuple[int, float]]:
    """``logit_bias`` as (token id, bias) pairs; an OpenAIError naming it when a key is no token id or a bias
    is outside [-100, 100]."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise OpenAIError(f"logit_bias: {key!r} is not a token id (give token ids as strings of integers)",
                              param="logit_bias") from None
        if token < 0 or not -100 <= value <= 100:
            raise OpenAIError(f"logit_bias: token {key} has bias {value}; give token ids >= 0 and biases in "
                              f"[-100, 100]", param="logit_bias")
        pairs.append((token, float(value)))
    return pairs


def tools(request: ChatRequest, parser: str | None) -> ToolChoice:
    """The chat request's tool choice (see openai_tools), checked against the model's tool-call parser
    (``None``: the model has none); an OpenAIError naming the field when it cannot be served."""
    try:
        choice = tool_choice(request.tools, request.tool_choice, request.parallel_tool_calls, parser)
    except ToolError as exc:
        raise OpenAIError(str(exc), param=exc.param) from None
    given = constraint(request)
    if choice.constraint is not None and given is not None:
        raise OpenAIError(f"tool_choice: {request.tool_choice!r} holds the answer to a tool call, and {given.field} "
                          f"to another form; give one of them", param="tool_choice")
    return choice


def sampling(request: CompletionRequest | ChatRequest, choice: int = 0,
             tool: ToolChoice | None = None) -> SamplingParams:
    """The engine's parameters for one choice (each choice of a seeded request gets its own seed); a required
    or named ``tool`` choice holds the answer to its calls."""
    scored = None
    if isinstance(request, ChatRequest):
        max_tokens = request.max_completion_tokens or request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        max_tokens, logprobs = request.max_tokens, request.logprobs
        # The prompt's own logprobs: vLLM's prompt_logprobs, or echo's with logprobs (lm-eval's loglikelihood).
        scored = request.prompt_logprobs if request.prompt_logprobs is not None else \
            (logprobs if request.echo and logprobs is not None else None)
        if max_tokens == 0 and scored is None:
            scored = 0  # echo of the prompt alone: nothing is generated, the prompt is only prefilled
    stop = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=max(request.top_k or 0, 0),
            min_p=request.min_p or 0.0,
            repetition_penalty=request.repetition_penalty or 1.0,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            seed=None if request.seed is None else request.seed + choice,
            stop_token_ids=tuple(request.stop_token_ids or ()),
            stop=tuple(stop),
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            logit_bias=tuple(_logit_bias(request.logit_bias)),
            min_tokens=request.min_tokens,
            prompt_logprobs=scored,
            structured=constraint(request) or (tool.constraint if tool is not None else None),
        )
    except InvalidInput as exc:
        raise OpenAIError(str(exc), param=str(exc).split(" ", 1)[0]) from None


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: text, or token ids (one or a list of either)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError("prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def chat_messages(request: ChatRequest) -> list[dict]:
    """Messages as a chat template takes them (text parts joined, an assistant's tool-call arguments as objects)."""
    messages = []
    for message in request.messages:
        item = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            item["content"] = "".join(part.text for part in message.content)
        messages.append(item)
    try:
        return template_messages(messages)
    except ToolError as exc:
        raise OpenAIError(str(exc), param=exc.param) from None


# -- encoding ------------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(tokens: list[str], logprobs: list[float | None],
                        tops: list[list[tuple[str, float]] | None], offset: int) -> dict:
    """The legacy completions ``logprobs`` object of one chunk or choice.

    Its ``top_logprobs`` are objects keyed by token text, and two of a position's top
    tokens can decode to the same text (a byte-level BPE's pieces of one character both
    decode to U+FFFD): that text keeps the higher of their logprobs, so an entry can hold
    fewer than the ``logprobs`` asked for (the chat API's lists keep every token).
    """
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    keyed: list[dict[str, float] | None] = []
    for top in tops:
        if top is None:  # an echoed prompt's first token: nothing came before it
            keyed.append(None)
            continue
        best: dict[str, float] = {}
        for text, logprob in top:
            if text not in best or logprob > best[text]:
                best[text] = logprob
        keyed.append(best)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": keyed, "text_offset": offsets}


def chat_logprobs(entries: list[tuple[str, float | None, list[tuple[str, float]]]], top_n: int | None = None) -> dict:
    """The chat ``logprobs`` object: one entry per token, with its ``top_n`` alternatives (default: all given)."""
    return {"content": [{"token": token, "logprob": logprob, "bytes": list(token.encode()),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                          for t, lp in (top if top_n is None else top[:top_n])]}
                        for token, logprob, top in entries]}


def envelope(kind: str, rid: str, model: str, created: int, choices: list[dict], *, chunk: bool,
             usage_: dict | None = None) -> dict:
    """A response or stream chunk around ``choices``."""
    if kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def sse(data: dict | str) -> bytes:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


DONE = sse("[DONE]")


def models_list(names: list[str], details: dict[str, dict] | None = None) -> dict:
    """``GET /v1/models``; ``details`` adds fields to a model's entry (vLLM adds ``max_model_len`` and the like)."""
    return {"object": "list", "data": [model_card(n, (details or {}).get(n)) for n in names]}


def model_card(name: str, details: dict | None = None) -> dict:
    """One model's object, as ``GET /v1/models/{id}`` answers it."""
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": OWNER, **(details or {})}


def unknown_model(name: Any, served: list[str]) -> OpenAIError:
    return OpenAIError(f"the model {name!r} does not exist; this server serves: {', '.join(served) or 'none'}",
                       status=404, param="model", code="model_not_found")
