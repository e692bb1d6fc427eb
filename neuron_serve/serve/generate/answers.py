"""Answers of the generation routes, as (status, headers, body or stream of bytes).

One function per protocol: OpenAI's completions and chat, and the OIP generate
extension. Each decodes the request with its codec, runs it on the replica's
GenerationPlane and encodes the pieces: a JSON body, or server-sent events. The answer
is transport-neutral, so the model replica's own routes and a call forwarded from
the server app (``/v1`` without a model prefix) return the same bytes.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Literal

from ...errors import AdapterNotLoaded, InvalidInput, NeuronServeError
from ...generation.sample.sampling import SamplingParams
from ...generation.frontend.structured import Constraint
from .plane import GenerationPlane, Piece, UnknownModel
from ..protocols import oip_generate, openai
from ..protocols.openai_tools import Reader, ToolChoice

JSON = {"content-type": "application/json"}
EVENTS = {"content-type": "text/event-stream", "cache-control": "no-cache", "x-accel-buffering": "no"}
CHOICES = "\u0000choices\u0000"  # where a stream chunk's choices go in its encoded frame

logger = logging.getLogger("neuron_serve")


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes | AsyncIterator[bytes]

    @property
    def streamed(self) -> bool:
        return not isinstance(self.body, bytes)


def _json(status: int, body: dict) -> Answer:
    return Answer(status, dict(JSON), json.dumps(body, ensure_ascii=False).encode())


def retry_after(status: int) -> dict[str, str]:
    """Clients (the openai library among them) wait this long before retrying a full queue."""
    return {"retry-after": "1"} if status in (429, 503) else {}


def openai_error(exc: Exception) -> Answer:
    status, body = openai.error_of(exc)
    answer = _json(status, body)
    answer.headers.update(retry_after(status))
    return answer


async def _first(stream: AsyncIterator[list[Piece]]) -> list[Piece]:
    """The stream's first batch, so a request refused at submission is an error status, not a broken stream."""
    return await stream.__anext__()


# -- OpenAI ---------------------------------------------------------------------------------


async def openai_answer(plane: GenerationPlane, kind: Literal["completions", "chat"],
                        request: openai.CompletionRequest | openai.ChatRequest) -> Answer:
    """``POST /v1/completions`` or ``/v1/chat/completions`` on this replica's model, decoded (once, by the
    route that received it: openai.parse)."""
    started = time.perf_counter()
    try:
        try:
            adapter = await plane.adapter_for(request.model)
        except UnknownModel:
            # The adapters served now (the registry's), not the ones this replica has not yet dropped.
            raise openai.unknown_model(request.model, [plane.name, *await plane.adapter_cards()]) from None
        if request.user is not None:  # who the end user is, for the operator's logs; kept nowhere else
            logger.info("%s: OpenAI %s request for end user %r", plane.name, kind, request.user)
        echo = tool = None
        if kind == "chat":
            tool = openai.tools(request, plane.tool_call_parser)
            for i, given in enumerate(tool.tools if tool.mode != "none" else ()):
                check(plane, Constraint("json_schema", given.parameters, f"tools[{i}].function.parameters"))
            prompts = [plane.chat(openai.chat_messages(request), tools=request.tools if tool.tools else None,
                                  calls=tool.mode != "none")]
        else:
            given = openai.completion_prompts(request)
            prompts = [plane.encode(p) for p in given]
            if request.echo:  # the prompt as sent (token ids as their text), before each of its choices
                echo = [p if isinstance(p, str) else plane.tokenizer.decode(p) for p in given
                        for _ in range(request.n)]
        every = [(prompt, openai.sampling(request, choice, tool)) for prompt in prompts
                 for choice in range(request.n)]
        structured = every[0][1].structured
        if structured is not None:
            check(plane, structured)
        stream = plane.run([p for p, _ in every], [s for _, s in every], adapter)
        first = await _first(stream)
    except Exception as exc:  # noqa: BLE001 - every failure is answered with OpenAI's error object
        if isinstance(exc, AdapterNotLoaded):  # unloaded after adapter_for found it: as if never found
            exc = openai.unknown_model(request.model, [plane.name, *await plane.adapter_cards()])
        answer = openai_error(exc)
        plane.record(answer.status, time.perf_counter() - started)
        return answer
    rid, created = openai.new_id(kind), int(time.time())
    encoder = _OpenAIEncoder(plane, kind, request, rid, created, [len(p) for p in prompts], every, echo, tool)
    if request.stream:
        return Answer(200, dict(EVENTS), encoder.events(first, stream, started))
    try:
        pieces = [first] + [batch async for batch in stream]
    except Exception as exc:  # noqa: BLE001
        answer = openai_error(exc)
        plane.record(answer.status, time.perf_counter() - started)
        return answer
    plane.record(200, time.perf_counter() - started)
    return _json(200, encoder.whole([p for batch in pieces for p in batch]))


def check(plane: GenerationPlane, constraint: Constraint) -> None:
    """``constraint`` compiled here, so one the grammar library refuses is the request's 400 naming its field."""
    try:
        plane.check_constraint(constraint)
    except InvalidInput as exc:
        raise openai.OpenAIError(str(exc), param=constraint.field) from None


class _OpenAIEncoder:
    """Pieces of one request to OpenAI's response object or its stream of chunks."""

    def __init__(self, plane: GenerationPlane, kind: str, request, rid: str, created: int, prompt_lengths: list[int],
                 every: list[tuple[list[int], SamplingParams]], echo: list[str] | None = None,
                 tool: ToolChoice | None = None) -> None:
        self.plane, self.kind, self.request, self.rid, self.created = plane, kind, request, rid, created
        # Each choice's answer read for tool calls (tool_choice other than "none").
        self.readers = [Reader(tool, plane.tool_call_parser) for _ in every] \
            if tool is not None and tool.mode != "none" else None
        self.echo = echo  # per choice: the prompt's text, echoed before the completion
        self.prompt_logprobs = getattr(request, "prompt_logprobs", None) is not None
        self._started: set[int] = set()  # choices whose first piece went out
        self.prompt_tokens = sum(prompt_lengths)
        self.logprobs = [params.logprobs is not None for _, params in every]
        self.offsets = [0] * len(every)
        options = request.stream_options
        self.include_usage = options is not None and options.include_usage
        self.continuous_usage = options is not None and options.continuous_usage_stats
        self.completion: dict[int, int] = {}  # tokens so far, by choice
        self._frame: tuple[bytes, bytes] | None = None

    def _first(self, piece: Piece) -> dict:
        """On a choice's first piece: the echoed prompt put before its text and logprobs; the choice's
        extra fields (vLLM's ``prompt_logprobs``)."""
        if piece.index in self._started:
            return {}
        self._started.add(piece.index)
        if self.echo is not None:
            piece.text = self.echo[piece.index] + piece.text
            if self.logprobs[piece.index] and piece.prompt_logprobs is not None:
                piece.logprobs = piece.prompt_logprobs + piece.logprobs
        if not self.prompt_logprobs or piece.prompt_scores is None:
            return {}
        text = self.plane.token_text
        return {"prompt_logprobs": [
            None if scored is None else {str(t): {"logprob": lp, "decoded_token": text(t)}
                                         for t, lp in [*scored[1], (token, scored[0])]}
            for token, scored in piece.prompt_scores]}

    def _usage(self, completion_tokens: int) -> dict:
        return openai.usage(self.prompt_tokens, completion_tokens)

    def _logprobs(self, index: int, piece: Piece) -> dict | None:
        if not self.logprobs[index]:
            return None
        if self.kind == "chat":  # the chat API's lists hold the top n only (the sampled token has its own entry)
            return openai.chat_logprobs(piece.logprobs, self.request.top_logprobs or 0)
        tokens = [token for token, _, _ in piece.logprobs]
        encoded = openai.completion_logprobs(tokens, [lp for _, lp, _ in piece.logprobs],
                                             [top for _, _, top in piece.logprobs], self.offsets[index])
        self.offsets[index] += sum(len(t) for t in tokens)
        return encoded

    def whole(self, pieces: list[Piece]) -> dict:
        merged: dict[int, Piece] = {}
        for piece in pieces:
            if piece.index in merged:
                merged[piece.index].merge(piece)
            else:
                merged[piece.index] = piece
        choices = []
        for index in sorted(merged):
            piece = merged[index]
            extra = self._first(piece)
            choice = {"index": index, "logprobs": self._logprobs(index, piece), "finish_reason": piece.finish_reason,
                      **extra}
            if self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": piece.text}
                if self.readers is not None:
                    reader = self.readers[index]
                    reader.add(piece.text)
                    reader.finish()
                    choice["message"]["content"] = reader.content
                    if reader.calls:
                        choice["message"]["tool_calls"] = [call.message() for call in reader.calls]
                        choice["finish_reason"] = _tools_finish(piece.finish_reason)
            else:
                choice["text"] = piece.text
            choices.append(choice)
        completion = sum(p.completion_tokens for p in merged.values())
        return openai.envelope(self.kind, self.rid, self.request.model, self.created, choices, chunk=False,
                               usage_=self._usage(completion))

    def _chunk(self, choices: list[dict]) -> bytes:
        if self.continuous_usage:  # vLLM's continuous_usage_stats: each chunk carries the usage so far
            return openai.sse(openai.envelope(self.kind, self.rid, self.request.model, self.created, choices,
                                              chunk=True, usage_=self._usage(sum(self.completion.values()))))
        if self._frame is None:
            # Everything of a chunk but its choices is the same for the whole stream: encoded
            # once, around a marker the choices replace (one small dumps a token, not the envelope).
            body = openai.envelope(self.kind, self.rid, self.request.model, self.created, [CHOICES], chunk=True)
            if self.include_usage:
                body["usage"] = None  # as OpenAI: every chunk has the key, the last one the counts
            head, _, tail = openai.sse(body).partition(json.dumps(CHOICES).encode())
            self._frame = (head, tail)
        head, tail = self._frame
        return head + b",".join(json.dumps(c, separators=(",", ":"), ensure_ascii=False).encode()
                                for c in choices) + tail

    def _choice(self, piece: Piece) -> dict | None:
        extra = self._first(piece)
        if not piece.text and piece.finish_reason is None and not piece.logprobs and not extra:
            return None  # nothing to say yet (a character still incomplete, or a stop string's possible start)
        choice: dict = {"index": piece.index, **extra}
        finish = piece.finish_reason
        if self.kind == "chat" and self.readers is not None:
            reader = self.readers[piece.index]
            content, calls = reader.add(piece.text)
            if finish is not None:
                more, last = reader.finish()
                content, calls = content + more, calls + last
                if reader.calls:
                    finish = _tools_finish(finish)
            delta: dict = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = calls
            if not delta and finish is None and not piece.logprobs:
                return None  # held: what arrived may still be part of a call
            choice["delta"] = delta
        elif self.kind == "chat":
            choice["delta"] = {"content": piece.text} if piece.text or piece.logprobs else {}
        else:
            choice["text"] = piece.text
        choice["logprobs"] = self._logprobs(piece.index, piece)
        choice["finish_reason"] = finish
        return choice

    async def events(self, first: list[Piece], rest: AsyncIterator[list[Piece]], started: float) -> AsyncIterator[bytes]:
        status = 200
        completion = self.completion
        try:
            if self.kind == "chat":
                for index in range(len(self.logprobs)):
                    yield self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}])
            batch = first
            while True:
                chunks = []
                for piece in batch:
                    completion[piece.index] = piece.completion_tokens
                    choice = self._choice(piece)
                    if choice is not None:
                        chunks.append(self._chunk([choice]))
                if chunks:  # one write for what arrived together
                    yield b"".join(chunks)
                try:
                    batch = await rest.__anext__()
                except StopAsyncIteration:
                    break
            if self.include_usage:
                yield openai.sse(openai.envelope(self.kind, self.rid, self.request.model, self.created, [],
                                                 chunk=True, usage_=self._usage(sum(completion.values()))))
        except NeuronServeError as exc:  # a failed step: the stream says so, then ends
            status, body = openai.error_of(exc)
            yield openai.sse(body)
        finally:
            await rest.aclose()  # aborts what still runs when the client left
            self.plane.record(status, time.perf_counter() - started)
        yield openai.DONE


def _tools_finish(reason: str | None) -> str | None:
    """An answer that made tool calls ends with "tool_calls", unless it was cut short ("length" says so)."""
    return "tool_calls" if reason in ("stop", None) else reason


# -- the OIP generate extension ------------------------------------------------------------


async def generate_answer(plane: GenerationPlane, body: bytes, stream: bool) -> Answer:
    """``POST /v2/models/{name}/generate`` (``stream`` False) or ``/generate_stream``."""
    started = time.perf_counter()
    try:
        request = oip_generate.parse(body)
        params = oip_generate.sampling(request)
        batches = plane.run([plane.encode(request.text_input)], [params])
        first = await _first(batches)
    except Exception as exc:  # noqa: BLE001 - answered as OIP's {"error": ...}
        status = exc.http_status if isinstance(exc, NeuronServeError) else 500
        message = str(exc) if isinstance(exc, NeuronServeError) else f"internal error: {type(exc).__name__}: {exc}"
        plane.record(status, time.perf_counter() - started)
        return Answer(status, {**JSON, **retry_after(status)}, json.dumps({"error": message}).encode())
    if stream:
        return Answer(200, dict(EVENTS), _generate_events(plane, request, first, batches, started))
    try:
        pieces = [first] + [batch async for batch in batches]
    except NeuronServeError as exc:
        plane.record(exc.http_status, time.perf_counter() - started)
        return Answer(exc.http_status, dict(JSON), json.dumps({"error": str(exc)}).encode())
    merged = Piece(0)
    for piece in (p for batch in pieces for p in batch):
        merged.merge(piece)
    plane.record(200, time.perf_counter() - started)
    return _json(200, oip_generate.response(plane.name, request, merged))


async def _generate_events(plane: GenerationPlane, request, first: list[Piece], rest: AsyncIterator[list[Piece]],
                           started: float) -> AsyncIterator[bytes]:
    status = 200
    try:
        batch = first
        while True:
            chunks = [openai.sse(oip_generate.response(plane.name, request, piece))
                      for piece in batch if piece.text or piece.finish_reason is not None]
            if chunks:
                yield b"".join(chunks)
            try:
                batch = await rest.__anext__()
            except StopAsyncIteration:
                break
    except NeuronServeError as exc:
        status = exc.http_status
        yield openai.sse({"error": str(exc)})
    finally:
        await rest.aclose()
        plane.record(status, time.perf_counter() - started)


def infer_refused(name: str) -> Answer:
    """``/infer`` on a generate model: it takes text, through the generate routes."""
    error = InvalidInput(f"model {name!r} is a task: generate model; send text to POST /v2/models/{name}/generate "
                         f"(or generate_stream), or use the OpenAI routes under /v1.")
    return Answer(400, dict(JSON), json.dumps({"error": str(error)}).encode())
