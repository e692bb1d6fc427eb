"""Every field of the OIP v2 infer request, with every wrong JSON type, against the real server.

For each field of the JSON body and of the binary extension's JSON header (id,
parameters, inputs[].name/shape/datatype/data/parameters.binary_data_size,
outputs[].name/parameters), one at a time: missing, null, each other JSON type, nested,
huge, or given twice in its object; plus binary segments of the wrong length. A change
that leaves the request valid (an optional field missing or null, an extension
parameter) must answer 200 with the eager model's numbers; every other one must answer
a 4xx JSON error whose message names the field. Over 10,000 requests: 0 x 5xx, 0
dropped connections, and valid requests equal eager PyTorch afterwards.
"""

from __future__ import annotations

import json
import random
import re
import struct
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from http_client import Client, infer_body, outputs

sys.path.insert(0, str(Path(__file__).parent / "models"))
import faulty  # noqa: E402

MODEL = "guarded"
TOLERANCE = 1e-5  # XLA:CPU vs eager float32 for two small linear layers
REQUESTS = 10_000
THREADS = 4  # the guarded model queues 16 requests; 4 senders never fill it
MISSING = object()  # the field is left out

ROWS = 2
X = torch.linspace(-2, 2, ROWS * 8).reshape(ROWS, 8)


def base(binary: bool) -> dict:
    """A valid request that sets every field the protocol defines."""
    x = {"name": "x", "shape": [ROWS, 8], "datatype": "FP32"}
    if binary:
        x["parameters"] = {"binary_data_size": ROWS * 8 * 4}
    else:
        x["data"] = X.flatten().tolist()
        x["parameters"] = {}
    return {
        "id": "req-1",
        "parameters": {"binary_data_output": False},
        "inputs": [x],
        "outputs": [{"name": "output_0", "parameters": {"binary_data": False}}],
    }


# (path, names): the field, and the words of which an error about it must contain one.
FIELDS = [
    (("id",), ["id"]),
    (("parameters",), ["parameters"]),
    (("parameters", "binary_data_output"), ["binary_data_output"]),
    # Without inputs, a binary request's bytes belong to nothing: an error about those names the field too.
    (("inputs",), ["inputs", "input '", "binary tensor data"]),
    (("inputs", 0), ["inputs[0]", "input '", "binary tensor data"]),
    (("inputs", 0, "name"), ["name", "input '"]),
    (("inputs", 0, "shape"), ["shape"]),
    (("inputs", 0, "datatype"), ["datatype"]),
    (("inputs", 0, "data"), ["data"]),
    (("inputs", 0, "parameters"), ["parameters"]),
    (("inputs", 0, "parameters", "binary_data_size"), ["binary_data_size"]),
    (("outputs",), ["outputs"]),
    (("outputs", 0), ["outputs[0]"]),
    (("outputs", 0, "name"), ["name", "output '"]),
    (("outputs", 0, "parameters"), ["parameters"]),
    (("outputs", 0, "parameters", "binary_data"), ["binary_data"]),
]


def values(rng: random.Random) -> list:
    """One value of each JSON type and shape of trouble; random where the type allows."""
    word = "w" + "".join(rng.choice("abcxyzXY_09") for _ in range(rng.randint(0, 8)))  # never "x"
    deep = leaf = {}
    for _ in range(rng.randint(2, 30)):
        leaf["a"] = {}
        leaf = leaf["a"]
    return [
        MISSING, None, True, False,
        rng.randint(-2**40, 2**40), rng.choice([0, -1, 10**30, -(10**30)]), rng.uniform(-1e6, 1e6),
        "", word, "n" * rng.randint(1025, 20000),
        [], [word], [[rng.randint(0, 9)]], [rng.randint(0, 9) for _ in range(rng.randint(65, 3000))],
        {}, {word: rng.randint(0, 9)}, deep, [deep],
    ]


def valid_change(field: tuple, value, binary: bool) -> bool:
    """Whether the request stays valid when `field` is set to `value` (MISSING removes it)."""
    absent = value is MISSING or value is None
    key = field[-1]
    if field == ("id",):
        return absent or (isinstance(value, str) and len(value) <= 1024)
    if key == "parameters":  # open objects: extension parameters are allowed
        if field == ("inputs", 0, "parameters") and binary:
            return False  # it carries binary_data_size
        return absent or isinstance(value, dict)
    if key in ("binary_data_output", "binary_data"):
        return absent or isinstance(value, bool)
    if field == ("outputs",):
        return absent or value == []
    if field == ("outputs", 0):
        return value is MISSING  # leaves an empty list: every output
    if key == "data":
        return binary and absent
    if key == "binary_data_size":
        return not binary and absent
    return False


def mutate(doc: dict, field: tuple, value) -> dict:
    doc = json.loads(json.dumps(doc))
    parent = doc
    for part in field[:-1]:
        parent = parent[part]
    if value is MISSING:
        if isinstance(parent, dict):
            parent.pop(field[-1], None)
        else:
            del parent[field[-1]]
    else:
        parent[field[-1]] = value
    return doc


def duplicate_key(doc: dict, field: tuple, rng: random.Random) -> bytes:
    """The JSON text of `doc` with the key of `field` given a second time, right after the first."""
    marker = "__duplicate_marker__"
    text = json.dumps(mutate(doc, field, marker))
    again = json.dumps(rng.choice([None, 1, "x", [], {}]))
    key = json.dumps(field[-1])
    return text.replace(f'{key}: "{marker}"', f"{key}: {json.dumps(_get(doc, field))}, {key}: {again}").encode()


def _word(name: str) -> str:
    """A regex finding `name` in a message, not as part of a longer identifier ('data' in 'binary_data')."""
    before = r"(?<![A-Za-z_])" if name[0].isalnum() else ""
    after = r"(?![A-Za-z_])" if name[-1].isalnum() else ""
    return before + re.escape(name) + after


def _get(doc, field):
    for part in field:
        doc = doc[part]
    return doc


def encode(doc: dict | bytes, binary: bool, payload: bytes) -> tuple[bytes, dict]:
    header = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    if not binary:
        return header, {}
    return header + payload, {"Inference-Header-Content-Length": str(len(header))}


def cases(rng: random.Random, count: int):
    """`count` (body, headers, expected) triples; expected is None (valid) or the words naming the field."""
    payload = struct.pack(f"<{ROWS * 8}f", *X.flatten().tolist())
    produced = 0
    while produced < count:
        binary = rng.random() < 0.5
        doc = base(binary)
        roll = rng.random()
        if roll < 0.08:
            field, names = rng.choice([f for f in FIELDS if f[0][-1] != 0 and _has(doc, f[0])])
            body, headers = encode(duplicate_key(doc, field, rng), binary, payload)
            yield body, headers, [f"the key '{field[-1]}' twice"]
        elif roll < 0.16 and binary:
            # A binary segment of the wrong length, or a header length that lies.
            header = json.dumps(doc).encode()
            cut = rng.choice([-32, -4, -1, 1, 3, 64])
            if rng.random() < 0.5:
                body = header + (payload[:cut] if cut < 0 else payload + b"\0" * cut)
                yield body, {"Inference-Header-Content-Length": str(len(header))}, ["binary"]
            else:
                length = rng.choice([len(header) + cut, 10**25, -5, "12a"])
                yield header + payload, {"Inference-Header-Content-Length": str(length)}, [
                    "Inference-Header-Content-Length", "binary", "JSON"]
        else:
            field, names = rng.choice(FIELDS)
            value = rng.choice(values(rng))
            if binary and field[-1] == "data" and value is MISSING:
                value = None  # absent already in the binary form; null is the interesting case
            changed = mutate(doc, field, value)
            body, headers = encode(changed, binary, payload)
            yield body, headers, (None if valid_change(field, value, binary) else names)
        produced += 1


def _has(doc, field) -> bool:
    try:
        _get(doc, field)
        return True
    except (KeyError, IndexError):
        return False


def first_output(answer) -> torch.Tensor:
    """The first output of an answer, JSON or binary (binary_data asked for)."""
    length = answer.headers.get("inference-header-content-length")
    if length is None:
        return torch.tensor(outputs(answer))
    header = json.loads(answer.body[: int(length)])
    out = header["outputs"][0]
    raw = answer.body[int(length): int(length) + out["parameters"]["binary_data_size"]]
    return torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw)).reshape(out["shape"])


@pytest.fixture(scope="module")
def api(guarded):
    client = Client(guarded.url, token=guarded.token)
    yield client
    client.close()


def test_every_field_with_every_json_type(api):
    eager = faulty.build(features=8, delay_ms=0)
    with torch.no_grad():
        expected = eager(X)
    tally: Counter = Counter()
    failures: dict[str, list[str]] = {}

    def send(case):
        body, headers, names = case
        try:
            answer = api.infer(MODEL, body, headers)
        except Exception as exc:  # noqa: BLE001 - a dropped connection is what this counts
            return "dropped", f"{type(exc).__name__}: {exc} for {body[:200]!r}"
        if answer.status >= 500:
            return "5xx", f"{answer.status} {answer.body[:300]!r} for {body[:200]!r}"
        if names is None:
            if answer.status != 200:
                return "refused valid", f"{answer.status} {answer.body[:300]!r} for {body[:300]!r}"
            got = first_output(answer)
            if not torch.allclose(got, expected, atol=TOLERANCE, rtol=TOLERANCE):
                return "wrong numbers", f"{got} != {expected}"
            return "200", None
        if answer.status == 200:
            return "accepted invalid", f"200 for {body[:300]!r} (expected an error naming {names})"
        if answer.headers.get("content-type") != "application/json":
            return "not json", f"{answer.status} {answer.headers} {answer.body[:300]!r}"
        message = answer.json().get("error", "")
        if not any(re.search(_word(n), message) for n in names):
            return "unnamed field", f"{answer.status} {message[:300]!r} does not name {names} ({body[:200]!r})"
        return f"{answer.status}", None

    with ThreadPoolExecutor(THREADS) as pool:
        for kind, detail in pool.map(send, cases(random.Random(17), REQUESTS), chunksize=16):
            tally[kind] += 1
            if detail is not None and len(failures.setdefault(kind, [])) < 5:
                failures[kind].append(detail)
    print(f"\nschema fuzz: {dict(tally)}")
    assert not failures, "\n".join(f"{kind}: {d}" for kind, ds in failures.items() for d in ds)
    assert sum(tally.values()) == REQUESTS
    assert tally["400"] > REQUESTS // 2 and tally["200"] > REQUESTS // 20, tally

    # Afterwards the server still answers correctly, JSON and binary.
    for rows in range(1, 5):
        x = torch.linspace(-3, 3, rows * 8).reshape(rows, 8)
        answer = api.infer(MODEL, infer_body(x.tolist()))
        assert answer.status == 200, answer.body
        with torch.no_grad():
            torch.testing.assert_close(torch.tensor(outputs(answer)), eager(x), atol=TOLERANCE, rtol=TOLERANCE)
