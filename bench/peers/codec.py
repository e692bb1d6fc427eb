"""A minimal OIP v2 REST codec for the peers (JSON and the binary tensor extension).

Peers only need what the benchmark sends: named inputs with a shape, a datatype and
either `data` or `parameters.binary_data_size`, an optional `outputs` list, and
`parameters.binary_data_output`. numpy does the conversions, as a hand-written
server would.
"""

from __future__ import annotations

import json
from typing import Mapping

import numpy as np

HEADER = "inference-header-content-length"
DTYPES = {"FP32": np.float32, "INT64": np.int64, "INT32": np.int32, "FP16": np.float16}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


def decode(body: bytes, headers: Mapping[str, str]) -> tuple[dict[str, np.ndarray], list[str] | None, bool]:
    """(inputs by name, requested output names or None, binary output wanted)."""
    length = headers.get(HEADER)
    if length is None:
        doc, rest = json.loads(body), b""
    else:
        n = int(length)
        doc, rest = json.loads(body[:n]), memoryview(body)[n:]
    inputs, offset = {}, 0
    for item in doc["inputs"]:
        dtype = DTYPES[item["datatype"]]
        size = (item.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            array = np.frombuffer(rest[offset:offset + size], dtype=dtype)
            offset += size
        else:
            array = np.asarray(item["data"], dtype=dtype)
        inputs[item["name"]] = array.reshape(item["shape"])
    wanted = [o["name"] for o in doc.get("outputs") or []] or None
    binary = bool((doc.get("parameters") or {}).get("binary_data_output", False))
    return inputs, wanted, binary


def encode(model: str, outputs: dict[str, np.ndarray], wanted: list[str] | None, binary: bool) -> tuple[bytes, dict]:
    """The response body and its extra headers."""
    names = wanted or list(outputs)
    entries, blobs = [], []
    for name in names:
        array = np.ascontiguousarray(outputs[name])
        entry = {"name": name, "datatype": NAMES[array.dtype], "shape": list(array.shape)}
        if binary:
            raw = array.tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = array.ravel().tolist()
        entries.append(entry)
    header = json.dumps({"model_name": model, "model_version": "1", "outputs": entries}).encode()
    if not binary:
        return header, {"content-type": "application/json"}
    return header + b"".join(blobs), {"content-type": "application/octet-stream", HEADER: str(len(header))}
