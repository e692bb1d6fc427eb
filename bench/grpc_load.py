"""The gRPC load generators: h2load (nghttp2's C HTTP/2 benchmarking tool), and a closed
loop over grpcio's asyncio client when h2load is missing (wrk speaks no gRPC).

Both send the requests wrk sends over HTTP, each manifest body converted to a
``ModelInferRequest`` (JSON bodies as typed contents, binary ones as ``raw_input_contents``),
and report what wrk reports.

``run_h2load`` is the fair twin of wrk: C, one thread, ``concurrency`` HTTP/2 connections
with one stream each (a closed loop, as wrk's connections), every request the manifest's
first message framed as gRPC frames it on the wire. h2load sees HTTP only: a gRPC error
arrives as HTTP 200 with a non-zero ``grpc-status`` trailer, which it counts as a success.
So the same message is sent once through grpcio first, and a failure there stops the
measurement (``GrpcPreflightError``); an error that only some requests meet under load
goes unseen, where the Python generator below would count it.

``run_grpc_load`` is Python sharing the machine with the server, so its own CPU use weighs
more on the figures than wrk's does (on 2 cores it measured itself more than the server).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc

from .loadgen import LoadResult
from .workloads import HEADER  # noqa: F401  (the manifest's header lengths are that header's value)

_NUMPY = {"FP32": np.float32, "INT64": np.int64}
_TYPED = {"FP32": "fp32_contents", "INT64": "int64_contents"}


def to_grpc(model: str, body: bytes, header_length: int) -> pb.ModelInferRequest:
    """The gRPC twin of one REST body of the bench (JSON, or with the binary extension)."""
    doc = json.loads(body[:header_length] if header_length else body)
    request = pb.ModelInferRequest(model_name=model)
    offset = header_length
    for entry in doc["inputs"]:
        tensor = request.inputs.add(name=entry["name"], datatype=entry["datatype"], shape=entry["shape"])
        if header_length:
            size = entry["parameters"]["binary_data_size"]
            request.raw_input_contents.append(body[offset:offset + size])
            offset += size
        else:
            values = np.asarray(entry["data"], dtype=_NUMPY[entry["datatype"]]).ravel().tolist()
            getattr(tensor.contents, _TYPED[entry["datatype"]]).extend(values)
    for output in doc.get("outputs", []):
        request.outputs.add(name=output["name"])
    return request


def requests_of(model: str, manifest: Path) -> list[pb.ModelInferRequest]:
    found = []
    for line in manifest.read_text().splitlines():
        path, header_length = line.split()
        found.append(to_grpc(model, Path(path).read_bytes(), int(header_length)))
    return found


async def _drive(address: str, requests: list[pb.ModelInferRequest], concurrency: int, seconds: float,
                 timeout_s: float) -> tuple[list[float], int, float]:
    latencies: list[float] = []
    errors = 0
    # Serialized once and sent as bytes, answers left unparsed (as h2load and wrk do): the
    # client shares the server's cores, so its own per-call work would weigh on the figures.
    payloads = [r.SerializeToString() for r in requests]
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)]) as channel:
        infer = channel.unary_unary(MODEL_INFER)
        started = time.perf_counter()
        stop = started + seconds

        async def worker(offset: int) -> None:
            nonlocal errors
            i = offset
            while time.perf_counter() < stop:
                sent = time.perf_counter()
                try:
                    await infer(payloads[i % len(payloads)], timeout=timeout_s)
                    latencies.append(time.perf_counter() - sent)
                except grpc.aio.AioRpcError as exc:
                    if not errors:
                        print(f"grpc_load: first error: {exc.code().name}: {exc.details()}", file=sys.stderr)
                    errors += 1
                i += concurrency

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        return latencies, errors, time.perf_counter() - started


def wait_ready(address: str, timeout_s: float = 600) -> None:
    """Block until the server's ServerReady says every model is ready (the gRPC service
    starts with the server app, after the models' applications)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        while True:
            try:
                if stub.ServerReady(pb.ServerReadyRequest(), timeout=5).ready:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"gRPC service at {address} not ready after {timeout_s:g}s")
            time.sleep(1)


def run_grpc_load(address: str, model: str, manifest: Path, concurrency: int, seconds: float,
                  timeout_s: float = 10) -> LoadResult:
    """Drive ``address`` (host:port) with ``concurrency`` calls in flight for ``seconds``."""
    latencies, errors, duration = asyncio.run(_drive(address, requests_of(model, manifest), concurrency,
                                                     seconds, timeout_s))
    p50, p90, p99 = (float(np.percentile(latencies, q)) * 1000 if latencies else 0.0 for q in (50, 90, 99))
    return LoadResult(len(latencies) + errors, duration, len(latencies) / duration if duration else 0.0,
                      p50, p90, p99, errors)


MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
# h2load's summary line (nghttp2 1.52): in "failed" are the errored streams (reset, or lost with
# their connection, timeouts among them) and the responses with a 4xx or 5xx status.
_SUMMARY = re.compile(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                      r"(\d+) errored, (\d+) timeout")


class GrpcPreflightError(RuntimeError):
    """The request h2load would send failed once over grpcio: nothing is measured."""


def frame(message: bytes) -> bytes:
    """One gRPC length-prefixed message as on the wire: a compressed flag of 0, the
    message's length as 4 bytes big-endian, the message."""
    return struct.pack(">BI", 0, len(message)) + message


def unframe(data: bytes) -> bytes:
    """The message of one uncompressed length-prefixed gRPC message (``frame``'s inverse)."""
    flag, length = struct.unpack(">BI", data[:5])
    if flag != 0 or len(data) != 5 + length:
        raise ValueError(f"not one uncompressed gRPC message: flag {flag}, length {length}, {len(data) - 5} bytes")
    return data[5:]


def one_shape(requests: list[pb.ModelInferRequest]) -> bool:
    """Whether every request has the same inputs (names, datatypes, shapes): then the first one,
    all h2load sends, costs what any of them does (W1's bodies; not W2's sequence lengths)."""
    def inputs(request):
        return [(t.name, t.datatype, tuple(t.shape)) for t in request.inputs]
    return all(inputs(r) == inputs(requests[0]) for r in requests)


def preflight(address: str, message: bytes, timeout_s: float = 10) -> bytes:
    """Send ``message`` (a serialized ModelInferRequest) once as a ModelInfer call through
    grpcio; the response's bytes, or ``GrpcPreflightError`` with the gRPC status."""
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)]) as channel:
        call = channel.unary_unary(MODEL_INFER)  # no (de)serializers: bytes in, bytes out
        try:
            return call(message, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise GrpcPreflightError(f"ModelInfer at {address} failed before the load: "
                                     f"{exc.code().name}: {exc.details()}") from None


def h2load_command(binary: str, address: str, body: Path, log: Path, concurrency: int, seconds: float,
                   warm_up_s: float) -> list[str]:
    """h2load over h2c (prior knowledge, its default for http:// URIs): ``concurrency``
    connections of one stream each, one thread, a timed run after a warm-up on the same
    connections; only the timed run's requests are in ``log``."""
    return [binary, "-t", "1", "-c", str(concurrency), "-m", "1",
            "-D", f"{max(1, round(seconds * 1000))}ms", "--warm-up-time", f"{round(warm_up_s * 1000)}ms",
            "--log-file", str(log), "-H", "content-type: application/grpc", "-H", "te: trailers",
            "-d", str(body), f"http://{address}{MODEL_INFER}"]


def parse_h2load(log_text: str, stdout: str, seconds: float) -> LoadResult:
    """The figures of one h2load run: its per-request log (tab-separated start time in µs since
    the epoch, HTTP status or -1 for a failed stream, µs to the end of the response) and its
    summary. Latencies are of the status 200 responses; errors are h2load's failed requests
    plus the 2xx and 3xx responses other than 200 (which it counts as successes)."""
    latencies_ms: list[float] = []
    other = 0
    for line in log_text.splitlines():
        if not line.strip():
            continue
        _start, status, elapsed_us = line.split("\t")[:3]
        if int(status) == 200:
            latencies_ms.append(int(elapsed_us) / 1000)
        elif 200 <= int(status) < 400:
            other += 1
    summary = _SUMMARY.search(stdout)
    if summary is None:
        raise RuntimeError(f"h2load printed no summary: {stdout[-500:]}")
    errors = int(summary.group(5)) + other
    p50, p90, p99 = (float(np.percentile(latencies_ms, q)) if latencies_ms else 0.0 for q in (50, 90, 99))
    return LoadResult(len(latencies_ms) + errors, seconds, len(latencies_ms) / seconds if seconds else 0.0,
                      p50, p90, p99, errors)


def h2load_binary() -> str | None:
    return shutil.which("h2load")


def run_h2load(address: str, model: str, manifest: Path, concurrency: int, seconds: float,
               warm_up_s: float = 1, timeout_s: float = 10) -> LoadResult:
    """Drive ``address`` (host:port) with h2load: ``concurrency`` connections, one call in flight
    on each, for ``seconds`` after ``warm_up_s``, every call the manifest's first request.
    Raises ``GrpcPreflightError`` when that request fails over grpcio (see the module's doc)."""
    binary = h2load_binary()
    if binary is None:
        raise RuntimeError("h2load not found (Debian: apt-get install nghttp2-client)")
    message = requests_of(model, manifest)[0].SerializeToString()
    preflight(address, message, timeout_s)
    with tempfile.TemporaryDirectory(prefix="h2load-") as tmp:
        body, log = Path(tmp) / "request.grpc", Path(tmp) / "requests.log"
        body.write_bytes(frame(message))
        command = h2load_command(binary, address, body, log, concurrency, seconds, warm_up_s)
        proc = subprocess.run(command, capture_output=True, text=True, timeout=warm_up_s + seconds + timeout_s + 30)
        if proc.returncode != 0:
            raise RuntimeError(f"h2load failed (rc {proc.returncode}): {proc.stdout[-500:]} {proc.stderr[-500:]}")
        return parse_h2load(log.read_text() if log.exists() else "", proc.stdout, seconds)
