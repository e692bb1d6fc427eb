"""The gRPC load generator: a closed loop over grpcio's asyncio client (wrk has no gRPC).

Sends the same pre-built requests as wrk does over HTTP (each manifest body converted to a
``ModelInferRequest``: JSON bodies as typed contents, binary ones as
``raw_input_contents``), ``concurrency`` calls in flight on one HTTP/2 channel, and
reports what wrk reports. It is Python sharing the machine with the server, so its own
CPU use weighs more on the figures than wrk's does.
"""

from __future__ import annotations

import asyncio
import json
import sys
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
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        started = time.perf_counter()
        stop = started + seconds

        async def worker(offset: int) -> None:
            nonlocal errors
            i = offset
            while time.perf_counter() < stop:
                sent = time.perf_counter()
                try:
                    await stub.ModelInfer(requests[i % len(requests)], timeout=timeout_s)
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
