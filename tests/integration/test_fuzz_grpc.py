"""Schema-driven fuzzing of the OIP v2 gRPC ModelInfer request (guarded.yaml's server).

Every field of ``ModelInferRequest`` is varied in each way protobuf lets a client get it
wrong: missing, the wrong typed-contents field for the datatype, contents or raw bytes
of the wrong length, shapes that disagree with the data or are huge, negative or empty,
unknown datatypes, inputs, outputs, models and versions, raw and typed contents together.
Each answer must be INVALID_ARGUMENT or NOT_FOUND with a message naming the field (or
RESOURCE_EXHAUSTED for a message past http.max_request_bytes), never INTERNAL or UNKNOWN; the server keeps serving, and valid requests (also with extension
parameters) still equal eager PyTorch afterwards.
"""

import random
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc

from neuron_serve.serve.protocols.oip_rest_schema import MAX_ID_CHARS

sys.path.insert(0, str(Path(__file__).parent / "models"))
import faulty  # noqa: E402

MODEL = "guarded"
FEATURES = 8
TOLERANCE = 1e-5  # XLA:CPU vs eager float32, as in test_grpc.py
REQUESTS = 2000
SEED = 17


def valid(rows: int, rng: random.Random, raw: bool) -> tuple[pb.ModelInferRequest, np.ndarray]:
    """A correct request of ``rows`` rows (raw bytes or typed contents) and its data."""
    data = np.array([[rng.uniform(-1, 1) for _ in range(FEATURES)] for _ in range(rows)], dtype="float32")
    request = pb.ModelInferRequest(model_name=MODEL)
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[rows, FEATURES])
    if raw:
        request.raw_input_contents.append(data.astype("<f4").tobytes())
    else:
        tensor.contents.fp32_contents.extend(data.reshape(-1).tolist())
    return request, data


def _wrong_contents_field(r: pb.ModelInferRequest, rng: random.Random) -> None:
    tensor = r.inputs[0]
    values = list(tensor.contents.fp32_contents) or [0.5] * int(np.prod(tensor.shape))
    tensor.contents.Clear()
    field = rng.choice(["int_contents", "int64_contents", "uint_contents", "uint64_contents", "bool_contents",
                        "fp64_contents", "bytes_contents"])
    getattr(tensor.contents, field).extend({"bool_contents": [True] * len(values), "fp64_contents": values,
                                            "bytes_contents": [b"x"] * len(values)}.get(field, [1] * len(values)))
    del r.raw_input_contents[:]


def _set_shape(shape):
    def mutate(r, rng):
        del r.inputs[0].shape[:]
        r.inputs[0].shape.extend(shape(rng))
    return mutate


def _raw_length(delta):
    def mutate(r, rng):
        data = r.raw_input_contents[0] if r.raw_input_contents else b"\0" * (4 * int(np.prod(r.inputs[0].shape)))
        del r.raw_input_contents[:]
        r.inputs[0].contents.Clear()
        r.raw_input_contents.append(data[:max(0, len(data) + delta(rng))] if delta(rng) < 0
                                    else data + b"\1" * delta(rng))
    return mutate


def _contents_length(r, rng):
    del r.raw_input_contents[:]
    r.inputs[0].contents.Clear()
    n = int(np.prod(r.inputs[0].shape))
    r.inputs[0].contents.fp32_contents.extend([0.25] * rng.choice([0, 1, n - 1, n + 1, 2 * n]))


def _datatype(value):
    def mutate(r, rng):
        r.inputs[0].datatype = value
    return mutate


def _two_inputs(r, rng):
    extra = r.inputs.add()
    extra.CopyFrom(r.inputs[0])
    if r.raw_input_contents:
        r.raw_input_contents.append(r.raw_input_contents[0])


def _raw_and_typed(r, rng):
    n = int(np.prod(r.inputs[0].shape))
    if not r.raw_input_contents:
        r.raw_input_contents.append(b"\0" * (4 * n))
    r.inputs[0].contents.fp32_contents.extend([0.5] * n)


def _extra_raw_entry(r, rng):
    r.inputs[0].contents.Clear()
    del r.raw_input_contents[:]
    n = int(np.prod(r.inputs[0].shape))
    r.raw_input_contents.extend([b"\0" * (4 * n)] * 2)


# (kind, mutation, status, what the message must name)
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
CASES = [
    ("no model_name", lambda r, g: r.ClearField("model_name"), NOT_FOUND, "model ''"),
    ("unknown model_name", lambda r, g: setattr(r, "model_name", g.choice(["nope", "Guarded", "guarded ", "x" * 300])),
     NOT_FOUND, "not found"),
    ("unknown model_version", lambda r, g: setattr(r, "model_version", g.choice(["2", "0", "latest", "1 "])),
     NOT_FOUND, "version"),
    ("no inputs", lambda r, g: (r.ClearField("inputs"), r.ClearField("raw_input_contents")), INVALID, "input"),
    ("no input name", lambda r, g: r.inputs[0].ClearField("name"), INVALID, "name"),
    ("unknown input name", lambda r, g: setattr(r.inputs[0], "name", g.choice(["y", "X", "x" * 200])), INVALID,
     "input"),
    ("no datatype", lambda r, g: r.inputs[0].ClearField("datatype"), INVALID, "datatype"),
    ("unknown datatype", _datatype("FP99"), INVALID, "datatype"),
    ("other datatype", lambda r, g: setattr(r.inputs[0], "datatype", g.choice(["INT64", "FP64", "INT8", "BOOL"])),
     INVALID, "input 'x'"),
    ("FP16 in typed contents", lambda r, g: (setattr(r.inputs[0], "datatype", "FP16"),
                                              r.ClearField("raw_input_contents"),
                                              r.inputs[0].contents.fp32_contents.extend([0.5] * 8)), INVALID, "FP16"),
    ("BYTES", _datatype("BYTES"), INVALID, "input 'x'"),
    ("wrong contents field", _wrong_contents_field, INVALID, "input 'x'"),
    ("no shape", lambda r, g: r.inputs[0].ClearField("shape"), INVALID, "shape"),
    ("shape disagrees", _set_shape(lambda g: g.choice([[1, 7], [2, 9], [3], [1, 1, 8], [8, 1]])), INVALID, "shape"),
    ("negative shape", _set_shape(lambda g: [g.choice([-1, -8, -(2 ** 62)]), 8]), INVALID, "shape"),
    ("huge shape", _set_shape(lambda g: g.choice([[2 ** 40, 8], [2 ** 62, 8], [2 ** 31, 2 ** 31], [1, 2 ** 33]])),
     INVALID, "shape"),
    ("zero rows", _set_shape(lambda g: [0, 8]), INVALID, "shape"),
    ("contents length", _contents_length, INVALID, "input 'x'"),
    ("raw too short", _raw_length(lambda g: -g.choice([1, 3, 4, 31])), INVALID, "input 'x'"),
    ("raw too long", _raw_length(lambda g: g.choice([1, 4, 100])), INVALID, "input 'x'"),
    ("raw entries != inputs", _extra_raw_entry, INVALID, "raw_input_contents"),
    ("raw and typed together", _raw_and_typed, INVALID, "both contents and raw_input_contents"),
    ("input twice", _two_inputs, INVALID, "input"),
    ("unknown output", lambda r, g: r.outputs.add(name=g.choice(["nope", "", "output_1"])), INVALID, "output"),
    ("huge id", lambda r, g: setattr(r, "id", "i" * (MAX_ID_CHARS + g.choice([1, 1000]))), INVALID, "id"),
    # Past http.max_request_bytes gRPC itself refuses the message.
    ("huge message", lambda r, g: setattr(r, "id", "i" * 100_000), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "larger than max"),
]


@pytest.fixture(scope="module")
def stub(guarded):
    channel = grpc.insecure_channel(guarded.grpc_url)
    # HTTP readiness can come a moment before the server app's gRPC port listens.
    grpc.channel_ready_future(channel).result(timeout=120)
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def eager_out(data: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return faulty.build(features=FEATURES, delay_ms=0)(torch.from_numpy(data)).numpy()


def call(stub, auth, request) -> tuple[grpc.StatusCode, str, pb.ModelInferResponse | None]:
    try:
        return grpc.StatusCode.OK, "", stub.ModelInfer(request, metadata=auth, timeout=60)
    except grpc.RpcError as err:
        return err.code(), err.details() or "", None


def check_valid(stub, auth, rng: random.Random, count: int) -> None:
    """Valid requests, some with extension parameters, equal eager."""
    for index in range(count):
        request, data = valid(rng.randint(1, 4), rng, raw=index % 2 == 0)
        if index % 3 == 0:  # open extension parameters, as the protocol allows
            request.parameters["priority"].int64_param = 1
            request.inputs[0].parameters["note"].string_param = "fuzz"
        code, message, response = call(stub, auth, request)
        assert code == grpc.StatusCode.OK, message
        got = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(len(data), -1)
        np.testing.assert_allclose(got, eager_out(data), rtol=TOLERANCE, atol=TOLERANCE)


def test_every_field_wrong_is_a_named_client_error_and_the_server_keeps_serving(guarded, stub):
    auth = [("authorization", f"Bearer {guarded.token}")]
    rng = random.Random(SEED)
    check_valid(stub, auth, rng, 4)
    jobs = []
    for index in range(REQUESTS):
        kind, mutate, status, names = CASES[index % len(CASES)]
        request, _ = valid(rng.randint(1, 4), rng, raw=rng.random() < 0.5)
        mutate(request, rng)
        jobs.append((kind, status, names, request))

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda job: call(stub, auth, job[3])[:2], jobs))
    wrong = Counter()
    seen = Counter()
    for (kind, status, names, _), (code, message) in zip(jobs, answers, strict=True):
        seen[code.name] += 1
        if code != status or names not in message:
            wrong[(kind, code.name, message[:160])] += 1
    print(f"\ngRPC fuzz: {len(jobs)} requests over {len(CASES)} kinds: {dict(seen)}")
    assert not wrong, "\n".join(f"{n} x {k}" for k, n in wrong.most_common(40))
    assert set(seen) <= {"INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED"}
    check_valid(stub, auth, rng, 12)  # still serving, still right
