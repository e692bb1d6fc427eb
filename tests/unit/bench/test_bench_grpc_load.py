"""bench/grpc_load.py's h2load runner: the gRPC framing of the request it sends, the figures
from its per-request log and summary, and (when h2load is installed) a short run against a
grpcio server started here, which counts what it was sent."""

import shutil
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench import grpc_load, workloads  # noqa: E402

# h2load 1.52's summary of a run: 6 requests done, 2 of them failed (one reset stream, one 503).
SUMMARY = """finished in 2.00s, 3.00 req/s, 1.00KB/s
requests: 6 total, 7 started, 6 done, 5 succeeded, 2 failed, 1 errored, 0 timeout
status codes: 4 2xx, 1 3xx, 0 4xx, 1 5xx
"""
LOG = "\n".join(["1795570278310289\t200\t1000", "1795570278310314\t200\t2000", "1795570278310774\t200\t4000",
                 "1795570278311000\t-1\t50", "1795570278312000\t503\t700", "1795570278313000\t302\t800", ""])


@pytest.fixture
def manifest(tmp_path):
    return workloads.write_bodies(workloads.WORKLOADS["W1"], tmp_path / "bodies", count=3)


def test_the_request_is_framed_as_grpc_frames_it_and_parses_back(manifest):
    request = grpc_load.requests_of("mlp", manifest)[0]
    message = request.SerializeToString()
    framed = grpc_load.frame(message)
    assert framed[0] == 0 and int.from_bytes(framed[1:5], "big") == len(message) and len(framed) == 5 + len(message)
    parsed = pb.ModelInferRequest.FromString(grpc_load.unframe(framed))
    assert parsed == request and parsed.model_name == "mlp" and list(parsed.inputs[0].shape) == [1, 784]
    with pytest.raises(ValueError, match="not one uncompressed"):
        grpc_load.unframe(b"\x01" + framed[1:])


def test_the_log_gives_the_percentiles_of_the_200s_and_the_summary_the_errors():
    result = grpc_load.parse_h2load(LOG, SUMMARY, seconds=2.0)
    # The 200s: 1, 2 and 4 ms. Errors: the 2 h2load failed (-1 and 503) and the 302 it counts as a success.
    assert (result.p50_ms, result.p99_ms) == (2.0, pytest.approx(3.96))
    assert result.errors == 3 and result.requests == 6 and result.rps == 1.5 and result.seconds == 2.0


def test_no_summary_is_an_error_not_zero_requests():
    with pytest.raises(RuntimeError, match="no summary"):
        grpc_load.parse_h2load(LOG, "h2load: ev_epoll.c:134: epoll_modify: Assertion failed", seconds=1.0)


def test_one_shape_tells_w1_from_w2_requests(tmp_path):
    assert grpc_load.one_shape(grpc_load.requests_of(
        "mlp", workloads.write_bodies(workloads.WORKLOADS["W3-mlp"], tmp_path / "w3", count=4)))
    assert not grpc_load.one_shape(grpc_load.requests_of(
        "encoder", workloads.write_bodies(workloads.WORKLOADS["W3-enc"], tmp_path / "w3e", count=4)))


class CountingServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self):
        self.seen: list[pb.ModelInferRequest] = []
        self.lock = threading.Lock()

    def ModelInfer(self, request, context):
        with self.lock:
            self.seen.append(request)
        if request.model_name != "mlp":
            context.abort(grpc.StatusCode.NOT_FOUND, f"no model {request.model_name}")
        return pb.ModelInferResponse(model_name=request.model_name, outputs=[pb.ModelInferResponse.InferOutputTensor(
            name="y", datatype="FP32", shape=[1])], raw_output_contents=[b"\0\0\0\0"])


@pytest.fixture
def grpc_server():
    servicer = CountingServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


needs_h2load = pytest.mark.skipif(shutil.which("h2load") is None,
                                  reason="h2load not installed (Debian: nghttp2-client; `make bench` installs it)")


@needs_h2load
def test_h2load_counts_the_calls_the_server_answered(grpc_server, manifest):
    address, servicer = grpc_server
    result = grpc_load.run_h2load(address, "mlp", manifest, concurrency=2, seconds=1, warm_up_s=0)
    assert result.errors == 0 and result.requests > 10 and result.rps == result.requests / 1
    assert 0 < result.p50_ms <= result.p90_ms <= result.p99_ms
    # The server saw the pre-flight call, the measured ones, and at most one per connection
    # still in flight when the run stopped (not counted); each the manifest's first request.
    assert result.requests + 1 <= len(servicer.seen) <= result.requests + 1 + 2
    first = grpc_load.requests_of("mlp", manifest)[0]
    assert all(r == first for r in servicer.seen)


@needs_h2load
def test_a_grpc_error_stops_the_run_before_any_load(grpc_server, manifest):
    # h2load would count these calls as successes: HTTP 200 with grpc-status 5 in the trailers.
    address, servicer = grpc_server
    with pytest.raises(grpc_load.GrpcPreflightError, match="NOT_FOUND: no model other"):
        grpc_load.run_h2load(address, "other", manifest, concurrency=2, seconds=1, warm_up_s=0)
    assert len(servicer.seen) == 1
