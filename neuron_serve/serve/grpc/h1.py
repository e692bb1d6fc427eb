"""Unary gRPC calls over HTTP/1.1, for HAProxy's HTTP/2 front on the gRPC port.

grpcio's server costs about four times what the HTTP path costs per call (0.65 against
0.16 ms of CPU for an empty answer, measured at 16 connections), which made gRPC the slow
protocol. Behind HAProxy the HTTP/2 side (framing, flow control, HPACK) is HAProxy's C,
and each call reaches the replica as an HTTP/1.1 request: the gRPC message framed in its
body, the answer's status in chunked trailers, which HAProxy turns into HTTP/2 trailers
(0.05 ms of CPU a call here, and as much in HAProxy). The servicers are grpcio's
generated handlers, run with a context that gives what they use of grpcio's.

Only unary methods are served (the OIP v2 and health services have no others); the rest
of gRPC on the wire: message framing with gzip or deflate compression, ``grpc-timeout``
deadlines, metadata (``-bin`` values base64), and statuses with percent-encoded messages.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import struct
import time
import urllib.parse
import zlib
from typing import Any, Callable

import grpc
import httptools

logger = logging.getLogger("neuron_serve")

HEADER = struct.Struct(">BI")  # a gRPC message's prefix: compressed flag, length
# Headers of the transport, not the call's metadata (grpcio leaves them out of invocation_metadata).
_TRANSPORT = frozenset({b"content-type", b"te", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding", b"host",
                        b"content-length", b"transfer-encoding", b"connection", b"x-forwarded-for"})
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_DECOMPRESS = {b"gzip": lambda data: zlib.decompress(data, 31), b"deflate": zlib.decompress}
_OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\n"


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple = ()) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, tuple(trailing)


class CallContext:
    """What the servicers use of ``grpc.aio.ServicerContext``, for one call."""

    def __init__(self, metadata: tuple[tuple[str, str | bytes], ...], deadline: float | None) -> None:
        self._metadata = metadata
        self._deadline = deadline
        self.trailing: tuple = ()

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: tuple = ()) -> None:
        raise _Abort(code, details, trailing_metadata)

    def set_trailing_metadata(self, trailing_metadata: tuple) -> None:
        self.trailing = tuple(trailing_metadata)


def _metadata(headers: list[tuple[bytes, bytes]]) -> tuple[tuple[str, str | bytes], ...]:
    found: list[tuple[str, str | bytes]] = []
    for name, value in headers:
        if name in _TRANSPORT or name.startswith(b":"):
            continue
        key = name.decode("latin-1")
        if key.endswith("-bin"):
            found.append((key, base64.b64decode(value + b"=" * (-len(value) % 4))))
        else:
            found.append((key, value.decode("latin-1")))
    return tuple(found)


def _deadline(value: bytes | None) -> float | None:
    if not value:
        return None
    try:
        return time.monotonic() + int(value[:-1]) * _TIMEOUT_UNITS[value[-1:]]
    except (KeyError, ValueError):
        raise _Abort(grpc.StatusCode.INTERNAL, f"malformed grpc-timeout {value.decode('latin-1')!r}") from None


def _status(code: grpc.StatusCode, details: str, trailing: tuple = ()) -> bytes:
    """Status and metadata lines (of trailers, or of a trailers-only answer's headers)."""
    lines = [b"grpc-status: %d\r\n" % code.value[0]]
    if details:
        quoted = urllib.parse.quote(details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")
        lines.append(b"grpc-message: " + quoted.encode("ascii") + b"\r\n")
    for key, value in trailing:
        if key.endswith("-bin"):
            value = base64.b64encode(value).rstrip(b"=").decode("ascii")
        lines.append(f"{key}: {value}\r\n".encode("latin-1"))
    return b"".join(lines)


def _answer(message: bytes, trailing: tuple = ()) -> bytes:
    framed = HEADER.pack(0, len(message)) + message
    return b"".join((_OK, b"transfer-encoding: chunked\r\n\r\n", b"%x\r\n" % len(framed), framed, b"\r\n0\r\n",
                     _status(grpc.StatusCode.OK, "", trailing), b"\r\n"))


def _failure(code: grpc.StatusCode, details: str, trailing: tuple = ()) -> bytes:
    """A trailers-only answer: the status in the headers, no message."""
    return _OK + _status(code, details, trailing) + b"content-length: 0\r\n\r\n"


class GrpcOverH1:
    """Serve ``handlers`` (a method's path, ``/package.Service/Method``, to grpcio's method
    handler) over HTTP/1.1; messages longer than ``max_message_bytes`` are refused."""

    def __init__(self, handlers: dict[str, Any], max_message_bytes: int) -> None:
        self.handlers = {path.encode(): handler for path, handler in handlers.items()}
        self.max_message_bytes = max_message_bytes
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host:port`` (0: a free port); returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self, grace: float = 5.0) -> None:
        """Stop listening, let calls in flight finish for up to ``grace`` seconds, then close."""
        if self._server is None:
            return
        self._server.close()
        deadline = time.monotonic() + grace
        while any(c.busy for c in self._connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for connection in list(self._connections):
            connection.close()

    async def call(self, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes, size: int | None = None) -> bytes:
        """One call's whole HTTP/1.1 answer; ``size`` is the body's length where only its start was kept."""
        handler = self.handlers.get(path)
        if handler is None or handler.unary_unary is None:
            return _failure(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        fields = dict(headers)
        try:
            deadline = _deadline(fields.get(b"grpc-timeout"))
            request = self._message(body, len(body) if size is None else size, fields.get(b"grpc-encoding", b"identity"))
            if handler.request_deserializer is not None:
                try:
                    request = handler.request_deserializer(request)
                except Exception:  # noqa: BLE001 - grpcio answers a message that does not parse so
                    return _failure(grpc.StatusCode.INTERNAL, "Exception deserializing request!")
            context = CallContext(_metadata(headers), deadline)
            work = handler.unary_unary(request, context)
            timeout = context.time_remaining()
            answer = await (work if timeout is None else asyncio.wait_for(work, timeout))
        except _Abort as abort:
            return _failure(abort.code, abort.details, abort.trailing)
        except asyncio.TimeoutError:
            return _failure(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        except Exception as exc:  # noqa: BLE001 - as grpcio: the call fails, the server serves on
            logger.exception("gRPC %s failed", path.decode())
            return _failure(grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}")
        serialize: Callable[[Any], bytes] | None = handler.response_serializer
        return _answer(serialize(answer) if serialize is not None else answer, context.trailing)

    def _message(self, body: bytes, size: int, encoding: bytes) -> bytes:
        if size < HEADER.size:
            raise _Abort(grpc.StatusCode.INTERNAL, "the request has no complete gRPC message")
        compressed, length = HEADER.unpack_from(body)
        if length > self.max_message_bytes:
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"Received message larger than max ({length} vs. {self.max_message_bytes})")
        if size != HEADER.size + length:
            raise _Abort(grpc.StatusCode.INTERNAL, f"the request's gRPC message says {length} bytes and carries "
                                                   f"{size - HEADER.size}")
        message = body[HEADER.size:]
        if not compressed:
            return message
        decompress = _DECOMPRESS.get(encoding)
        if decompress is None:
            raise _Abort(grpc.StatusCode.UNIMPLEMENTED,
                         f"Compression algorithm '{encoding.decode('latin-1')}' is not supported")
        message = decompress(message)
        if len(message) > self.max_message_bytes:
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"Received message larger than max ({len(message)} vs. {self.max_message_bytes})")
        return message


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection from HAProxy: requests parsed by httptools, answered in order."""

    def __init__(self, server: GrpcOverH1) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0
        self._last: asyncio.Future | None = None  # the previous answer's write: answers go out in order

    @property
    def busy(self) -> bool:
        return self._last is not None and not self._last.done()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._connections.discard(self)
        if self._last is not None and not self._last.done():
            self._last.cancel()  # the client left: its call stops (a queued inference is dropped)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self.transport.close()
            logger.debug("gRPC over HTTP/1.1: unparsable request: %s", exc)

    # -- httptools' callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._size = b"", [], [], 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        # Past the limit only the message's prefix is kept: its declared length refuses the call.
        if self._size + len(body) <= self.server.max_message_bytes + HEADER.size:
            self._body.append(body)
        elif self._size < HEADER.size:
            self._body.append(body[:HEADER.size - self._size])
        self._size += len(body)

    def on_message_complete(self) -> None:
        call = self.server.call(self._url, self._headers, b"".join(self._body), self._size)
        self._last = asyncio.ensure_future(self._answer(call, self._last, self.parser.should_keep_alive()))

    async def _answer(self, call, previous: asyncio.Future | None, keep_alive: bool) -> None:
        answer = await call
        if previous is not None:
            await asyncio.shield(previous)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(answer)
            if not keep_alive:
                self.transport.close()
