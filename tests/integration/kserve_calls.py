"""Calls a neuron-serve URL through KServe's own Python client; used by test_kserve_client.py.

Runs with .venv-kserve's python, not the test venv: kserve pins protobuf<7, which Ray
cannot use, so the two never share an environment. Only kserve and numpy are imported.

    python kserve_calls.py BASE_URL WORKDIR < calls.json > results.json

A BASE_URL without a scheme (``127.0.0.1:8001``) is a gRPC address: the calls then go
through KServe's InferenceGRPCClient, ``binary`` choosing raw_input_contents over typed
contents, and a call the server refuses answers the gRPC status code's name.

Each call is one of
    {"op": "live"} | {"op": "ready"} | {"op": "model_ready", "model": NAME}
    {"op": "infer", "model": NAME, "inputs": "in.npz", "binary": BOOL, "out": "out.npz"}
(npz paths relative to WORKDIR; the npz keys are the input names, in order). An infer
answers the outputs' datatype and shape and whether the reply was binary, and writes
their arrays to "out"; a call the
client raises on answers {"error": {"type", "status", "message"}} as the client reported it.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import grpc
import httpx
import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig


def _request(model: str, arrays: dict[str, np.ndarray], binary: bool) -> InferRequest:
    inputs = []
    for name, array in arrays.items():
        datatype = {"float32": "FP32", "int64": "INT64", "int32": "INT32"}[str(array.dtype)]
        infer_input = InferInput(name=name, shape=list(array.shape), datatype=datatype)
        infer_input.set_data_from_numpy(array, binary_data=binary)
        inputs.append(infer_input)
    # Binary outputs are asked for through the extension's request-level parameter.
    parameters = {"binary_data_output": True} if binary else None
    return InferRequest(model_name=model, infer_inputs=inputs, parameters=parameters)


async def _call(client: InferenceRESTClient, base_url: str, workdir: Path, call: dict) -> dict:
    op = call["op"]
    if op == "live":
        return {"value": await client.is_server_live(base_url)}
    if op == "ready":
        return {"value": await client.is_server_ready(base_url)}
    if op == "model_ready":
        return {"value": await client.is_model_ready(base_url, call["model"])}
    with np.load(workdir / call["inputs"]) as npz:
        arrays = {name: npz[name] for name in npz.files}
    headers: dict[str, str] = {}
    request = _request(call["model"], arrays, call["binary"])
    response = await client.infer(base_url, request, model_name=call["model"], response_headers=headers)
    np.savez(workdir / call["out"], **{out.name: out.as_numpy() for out in response.outputs})
    return {
        "outputs": {out.name: {"datatype": out.datatype, "shape": list(out.shape)} for out in response.outputs},
        # The binary extension's header says the reply carried raw tensor bytes.
        "binary_reply": "inference-header-content-length" in {k.lower() for k in headers},
    }


async def _grpc_call(client: InferenceGRPCClient, workdir: Path, call: dict) -> dict:
    op = call["op"]
    if op == "live":
        return {"value": await client.is_server_live()}
    if op == "ready":
        return {"value": await client.is_server_ready()}
    if op == "model_ready":
        return {"value": await client.is_model_ready(call["model"])}
    with np.load(workdir / call["inputs"]) as npz:
        arrays = {name: npz[name] for name in npz.files}
    response = await client.infer(_request(call["model"], arrays, call["binary"]))
    np.savez(workdir / call["out"], **{out.name: out.as_numpy() for out in response.outputs})
    return {"outputs": {out.name: {"datatype": out.datatype, "shape": list(out.shape)} for out in response.outputs}}


async def grpc_main(address: str, workdir: Path, calls: list[dict]) -> list[dict]:
    results = []
    async with InferenceGRPCClient(address, timeout=120) as client:
        for call in calls:
            try:
                results.append(await _grpc_call(client, workdir, call))
            except grpc.aio.AioRpcError as exc:
                results.append({"error": {"type": type(exc).__name__, "status": exc.code().name,
                                          "message": exc.details()}})
    return results


async def main(base_url: str, workdir: Path, calls: list[dict]) -> list[dict]:
    if "://" not in base_url:
        return await grpc_main(base_url, workdir, calls)
    client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=120))
    results = []
    try:
        for call in calls:
            try:
                results.append(await _call(client, base_url, workdir, call))
            except httpx.HTTPStatusError as exc:
                results.append({"error": {"type": type(exc).__name__, "status": exc.response.status_code, "message": str(exc)}})
    finally:
        await client.close()
    return results


if __name__ == "__main__":
    url, folder = sys.argv[1], Path(sys.argv[2])
    json.dump(asyncio.run(main(url, folder, json.load(sys.stdin))), sys.stdout)
