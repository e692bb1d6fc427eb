"""The request bodies of W1 (MLP, batch 1), W2 (encoder, sequence 16..128) and W3 (both, binary).

Bodies are written to files once per run, with a manifest that the wrk script reads,
so every server gets byte-identical requests in the same order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HEADER = "Inference-Header-Content-Length"


@dataclass(frozen=True)
class Workload:
    key: str          # W1, W2, W3-mlp, W3-encoder
    model: str        # model name in the URL
    binary: bool
    describe: str
    grpc: bool = False  # sent over OIP v2 gRPC by bench/grpc_load.py instead of wrk
    bodies: str = ""    # the workload whose request files it sends (default: its own)


WORKLOADS = {
    "W1": Workload("W1", "mlp", False, "MLP 784->4096->2048->10 + sort, batch 1, JSON"),
    "W2": Workload("W2", "encoder", False, "encoder 4x256, seq 16..128, JSON, pooler_output only"),
    "W3-mlp": Workload("W3-mlp", "mlp", True, "W1 requests with the binary tensor extension"),
    "W3-enc": Workload("W3-enc", "encoder", True, "W2 requests with the binary tensor extension"),
    "W1-grpc": Workload("W1-grpc", "mlp", False, "W1 requests over gRPC, typed contents", grpc=True, bodies="W1"),
    "W3-mlp-grpc": Workload("W3-mlp-grpc", "mlp", True, "W1 requests over gRPC, raw_input_contents", grpc=True,
                            bodies="W3-mlp"),
    "W3-enc-grpc": Workload("W3-enc-grpc", "encoder", True, "W2 requests over gRPC, raw_input_contents",
                            grpc=True, bodies="W3-enc"),
}


def _inputs(model: str, rng: np.random.Generator) -> list[tuple[str, np.ndarray]]:
    if model == "mlp":
        return [("x", rng.standard_normal((1, 784)).astype(np.float32).round(4))]
    length = int(rng.integers(16, 129))
    return [("input_ids", rng.integers(1, 1000, (1, length), dtype=np.int64)),
            ("attention_mask", np.ones((1, length), dtype=np.int64))]


def _body(model: str, inputs: list[tuple[str, np.ndarray]], binary: bool) -> tuple[bytes, int]:
    """The body and its JSON header length (0 for a plain JSON body)."""
    names = {np.float32: "FP32", np.int64: "INT64"}
    entries, blobs = [], []
    for name, array in inputs:
        entry = {"name": name, "shape": list(array.shape), "datatype": names[array.dtype.type]}
        if binary:
            raw = array.tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = array.ravel().tolist()
        entries.append(entry)
    doc: dict = {"inputs": entries}
    if model == "encoder":
        doc["outputs"] = [{"name": "pooler_output"}]
    if binary:
        doc["parameters"] = {"binary_data_output": True}
    header = json.dumps(doc, separators=(",", ":")).encode()
    return header + b"".join(blobs), (len(header) if binary else 0)


def write_bodies(workload: Workload, directory: Path, count: int = 128, seed: int = 0) -> Path:
    """Write ``count`` request bodies and a manifest (``path header_length`` per line)."""
    directory.mkdir(parents=True, exist_ok=True)
    # The same seed for W2 and W3-enc: W3 sends W2's requests, only encoded differently.
    rng = np.random.default_rng(seed + (0 if workload.model == "mlp" else 1))
    lines = []
    for i in range(count):
        body, header_length = _body(workload.model, _inputs(workload.model, rng), workload.binary)
        path = directory / f"{i:04d}.bin"
        path.write_bytes(body)
        lines.append(f"{path} {header_length}")
    manifest = directory / "manifest.txt"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def first_body(manifest: Path) -> tuple[bytes, dict[str, str]]:
    """The first request of a manifest, for readiness probes and checks."""
    path, header_length = manifest.read_text().split("\n")[0].split()
    headers = {"Content-Type": "application/json"}
    if int(header_length):
        headers = {"Content-Type": "application/octet-stream", HEADER: header_length}
    return Path(path).read_bytes(), headers
