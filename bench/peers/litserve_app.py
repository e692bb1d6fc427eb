"""LitServe with its batching enabled, one worker per model (JSON requests only).

    python -m bench.peers.litserve_app --port 18300

LitServe hands ``decode_request`` the parsed JSON body (or a form), never the raw
bytes, so the binary tensor extension cannot be served by a LitAPI.
"""

from __future__ import annotations

import argparse

import litserve as ls
import numpy as np

from . import codec
from .models import EagerModels, pad_batch, split_rows

# The same batch bounds as the neuron-serve deployments (deployments/*.yaml).
BATCHING = {"mlp": (64, 0.002), "encoder": (16, 0.005)}


class OipAPI(ls.LitAPI):
    def __init__(self, name: str) -> None:
        size, delay = BATCHING[name]
        super().__init__(max_batch_size=size, batch_timeout=delay, api_path=f"/v2/models/{name}/infer")
        self.name = name

    def setup(self, device) -> None:
        self.models = EagerModels()

    def decode_request(self, request):
        inputs = {i["name"]: np.asarray(i["data"], dtype=codec.DTYPES[i["datatype"]]).reshape(i["shape"])
                  for i in request["inputs"]}
        return inputs, [o["name"] for o in request.get("outputs") or []] or None

    def batch(self, items):
        return items

    def predict(self, items):
        batch, rows = pad_batch([inputs for inputs, _ in items])
        outputs = split_rows(self.models.run(self.name, batch), rows)
        return [(out, wanted) for out, (_, wanted) in zip(outputs, items)]

    def unbatch(self, output):
        return output

    def encode_response(self, output):
        outputs, wanted = output
        names = wanted or list(outputs)
        return {"model_name": self.name, "model_version": "1", "outputs": [
            {"name": n, "datatype": codec.NAMES[outputs[n].dtype], "shape": list(outputs[n].shape),
             "data": outputs[n].ravel().tolist()} for n in names]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=18300)
    args = parser.parse_args()
    server = ls.LitServer([OipAPI("mlp"), OipAPI("encoder")], accelerator="cpu", workers_per_device=1,
                          track_requests=False)
    server.run(host="127.0.0.1", port=args.port, num_api_servers=1, log_level="warning",
               generate_client_file=False)


if __name__ == "__main__":
    main()
